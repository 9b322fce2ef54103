"""``diff2 bench``'s ``models`` section (issue 41): DIFF2's per-sample clipping on practical models,
against Opacus 1.6 in the same run.

Two models a practitioner brings: a CIFAR-sized CNN (two 3×3 convolutions 3→32→64, each with
GroupNorm, ReLU and 2×2 max-pooling, then two linear layers; d = 545,290; 32×32×3 inputs, 10
classes) and a small transformer encoder (token and position embeddings, 2 pre-norm layers of
attention and MLP built from ``nn.Linear`` and ``nn.LayerNorm``, sequence 64, mean-pooled, 2
classes). Every side runs in a fresh process of its own, on one core with one torch thread
(:mod:`.pinning`), float32, and reports samples per second over the same records and the peak
resident memory of its process (``VmHWM``) with the part its setup already held:

- ``diff2/<path>``: the path :func:`~diff2_flwr.runtime.workers.make_worker` builds for
  ``training.gradients: <path>`` (``torch_func``; ``ghost`` where the engine has it), its restart
  round (the clipped mean of per-sample gradients at x₁) and its difference round (of ∇ℓ(x₁) −
  ∇ℓ(x₂)), through ``Worker.contribute`` as a client computes it;
- ``opacus/hooks``: Opacus' ``GradSampleModule`` (per-sample gradients by hooks), then each
  sample's gradient clipped and summed (a clipped gradient: a restart round's work);
- ``opacus/ghost``: Opacus' ghost clipping (``grad_sample_mode="ghost"``: norms without per-sample
  gradients, a second backward for the clipped sum);
- ``diff2/ghost@opacus-memory``: DIFF2's ghost clipping given, as its memory budget
  (``training.memory_budget_mb``), what ``opacus/ghost`` took beyond its setup: its passes are
  what that budget allows (``chunk_size: auto``), and its peak shows that the budget held.

The ``diff2/<path>`` sides run passes of Opacus' batch; a difference round's pass holds two
iterates' records. Each DIFF2 side reports its pass sizes, the memory its plan expected a pass to
take, the high-water mark of its memory plan's measuring (``planning_peak_mb``), of the restart
rounds alone (``restart_peak_mb``) and of both kinds (``rounds_peak_mb``), and the process's
highest (``peak_mb``, planning included), which its ratio to Opacus' peak uses.

Opacus has no difference round (DIFF2's is two iterates); its figure is the restart round's. Opacus
is a benchmark-only extra (``pip install -e .[bench]``), never a runtime dependency; without it its
sides say ``skipped``.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import resource
import time
import typing
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from ...core.memory import MemoryRefusal
from ...runtime.config_training import TrainingConfig
from ...runtime.workers import make_worker
from .pinning import one_core, one_torch_thread

__all__ = ["MODELS", "models_section", "make_cnn", "make_resnet18", "make_transformer"]

#: The sequence length, vocabulary, width and heads of the transformer.
SEQ, VOCAB, WIDTH, HEADS = 64, 1000, 128, 4
CLIP = 1.0


def make_cnn() -> nn.Module:
    """The issue's CNN: d = 545,290."""
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.GroupNorm(8, 32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.GroupNorm(8, 64), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 8 * 8, 128), nn.ReLU(), nn.Linear(128, 10))


class _Attention(nn.Module):
    """Multi-head self-attention from four ``nn.Linear`` layers (no fused in-projection)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Softmax attention of ``x`` [n, T, width] over its own positions."""
        n, t, w = x.shape
        # contiguous heads: Opacus' ghost norms view the gradients that flow back through them
        split = [f(x).reshape(n, t, self.heads, w // self.heads).transpose(1, 2).contiguous()
                 for f in (self.q, self.k, self.v)]
        weights = torch.softmax(split[0] @ split[1].transpose(-1, -2)
                                / math.sqrt(w // self.heads), dim=-1)
        return self.o((weights @ split[2]).transpose(1, 2).reshape(n, t, w))


class _Layer(nn.Module):
    """A pre-norm encoder layer: attention, then a 4× MLP, each residual."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attention = _Attention(width, heads)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x + attention, then + MLP."""
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class _Encoder(nn.Module):
    """Token and position embeddings, two layers, a final norm, mean pooling, a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(VOCAB, WIDTH), nn.Embedding(SEQ, WIDTH)
        self.layers = nn.Sequential(_Layer(WIDTH, HEADS), _Layer(WIDTH, HEADS))
        self.norm, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Class logits of token ids [n, SEQ]."""
        # positions batch-first, as every per-sample engine (ours, Opacus') expects an input
        where = torch.arange(ids.shape[1], device=ids.device).repeat(ids.shape[0], 1)
        x = self.layers(self.tokens(ids) + self.positions(where))
        return self.head(self.norm(x).mean(dim=1))


def make_transformer() -> nn.Module:
    """The small transformer encoder (embedding + 2 layers, sequence 64)."""
    return _Encoder()


class _Basic(nn.Module):
    """ResNet's basic block with GroupNorm (32 groups; per-sample, unlike batch-norm)."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.norm1 = nn.GroupNorm(32, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.norm2 = nn.GroupNorm(32, cout)
        self.skip = (nn.Sequential() if stride == 1 and cin == cout else
                     nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                   nn.GroupNorm(32, cout)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """relu(norm(conv(relu(norm(conv(x))))) + skip(x))."""
        out = torch.relu(self.norm1(self.conv1(x)))
        return torch.relu(self.norm2(self.conv2(out)) + self.skip(x))


def make_resnet18(classes: int = 10) -> nn.Module:
    """ResNet-18 for 32×32×3 inputs (a 3×3 stem, no max-pooling: the CIFAR variant) with
    GroupNorm in place of batch-norm: d = 11,173,962 (issue 41's model at real size)."""
    layers: list[nn.Module] = [nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.GroupNorm(32, 64),
                               nn.ReLU()]
    width = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [_Basic(width, cout, stride), _Basic(cout, cout, 1)]
        width = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, classes)]
    return nn.Sequential(*layers)


def _cnn_data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g)


def _transformer_data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, VOCAB, (n, SEQ), generator=g), torch.randint(0, 2, (n,), generator=g)


#: name -> (model factory, records of n samples).
MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[int], Any]]] = {
    "cnn": (make_cnn, _cnn_data), "transformer": (make_transformer, _transformer_data)}


def _model(name: str) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return MODELS[name][0]().float()


def _status_mb(key: str) -> float | None:
    """The MiB of ``key`` (``VmHWM``, ``VmRSS``) in this process's /proc/self/status, or None."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return None


def _peak_mb() -> float:
    """This process's peak resident memory: its memory map's high-water mark (``VmHWM``: its own
    since ``exec``; ``ru_maxrss`` would keep the parent's at the fork), else ``ru_maxrss``."""
    peak = _status_mb("VmHWM")
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0 if peak is None else peak


def _rss_mb() -> float:
    """This process's resident memory now (``VmRSS``), 0 where /proc has none."""
    return _status_mb("VmRSS") or 0.0


def _reset_peak() -> bool:
    """Restart the high-water mark at the resident memory now (Linux: ``5`` to
    ``/proc/self/clear_refs``); False where that is not possible (the peaks then include what came
    before)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _flat(model: nn.Module) -> np.ndarray:
    return np.concatenate([p.detach().double().numpy().ravel() for p in model.parameters()])


def _diff2_side(name: str, path: str, n: int, batch: int, reps: int,
                budget_mb: float | None = None) -> dict:
    """The client's restart and difference rounds on the path ``path``: passes of ``batch``
    samples (Opacus' batch), or with ``budget_mb`` the passes its memory budget allows
    (``chunk_size: auto``).

    Peaks: ``setup_mb`` with the model and records built; ``planning_peak_mb`` once the worker is
    built (its memory plan measures passes, :func:`~diff2_flwr.core.memory.measure_footprint`);
    ``restart_peak_mb`` during the restart rounds alone and ``rounds_peak_mb`` during both kinds
    (the high-water mark restarted after planning, where Linux allows it); ``peak_mb`` the process's
    highest, planning included: the figure set against Opacus' peak."""
    model = _model(name)
    features, targets = MODELS[name][1](n)
    memory: dict[str, Any] = ({"chunk_size": batch} if budget_mb is None else
                              {"chunk_size": "auto", "memory_budget_mb": budget_mb})
    setup, resident = _peak_mb(), _rss_mb()
    worker = make_worker(model=model, loss="cross_entropy", data=(features, targets),
                         partition_id=0, dtype="float32", gradients=path, **memory)
    planning = _peak_mb()
    separate = _reset_peak()
    x1 = _flat(model)
    x2 = x1 + 1e-3 * np.random.default_rng(0).standard_normal(x1.size)
    grads = worker.gradients
    out: dict[str, Any] = {"parameters": int(x1.size), "setup_mb": setup,
                           "planning_peak_mb": planning}
    for kind, previous in (("restart", None), ("difference", x2)):
        worker.contribute(CLIP, x1, previous)  # warm-up: torch.func's first call traces
        best = math.inf
        for _ in range(reps):
            started = time.perf_counter()
            worker.contribute(CLIP, x1, previous)
            best = min(best, time.perf_counter() - started)
        out[f"{kind}_samples_per_s"] = n / best
        difference = previous is not None
        out[f"{kind}_pass"] = grads.passes[difference]
        if grads.footprints:  # what the plan expected a pass to take
            planned = grads.footprints[difference].bytes_for(grads.passes[difference])
            out[f"{kind}_planned_mb"] = planned / 2**20
        # the high-water mark of the rounds so far: the restart round's alone, then both kinds'
        out[f"{kind}_peak_mb" if kind == "restart" else "rounds_peak_mb"] = (
            _peak_mb() if separate else None)
    out["peak_mb"] = max(planning, _peak_mb())
    if budget_mb is not None:  # planning and rounds: growth over the resident set before them
        out.update(budget_mb=budget_mb, grew_mb=out["peak_mb"] - resident,
                   within_budget=out["peak_mb"] - resident <= budget_mb)
    return out


def _opacus_side(name: str, mode: str, n: int, batch: int, reps: int) -> dict:
    """Opacus' clipped gradient (a restart round's work) by hooks or by ghost clipping."""
    try:
        from opacus import PrivacyEngine  # noqa: PLC0415 -- the bench's optional peer
    except ImportError:
        return {"skipped": "opacus is not installed (pip install -e .[bench])"}
    # Opacus' own notices (its secure RNG off: this side adds no noise; hooks on outputs)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"opacus(\.|$)")
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    model = _model(name)
    features, targets = MODELS[name][1](n)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(features, targets),
                                         batch_size=batch)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    engine = PrivacyEngine(accountant="rdp")
    kwargs: dict[str, Any] = {"criterion": nn.CrossEntropyLoss()} if mode == "ghost" else {}
    made = engine.make_private(module=model, optimizer=optimizer, data_loader=loader,
                               noise_multiplier=0.0, max_grad_norm=CLIP, poisson_sampling=False,
                               grad_sample_mode=mode, **kwargs)
    if mode == "ghost":  # (module, optimizer, criterion, data_loader)
        module, optimizer, criterion, loader = made
    else:
        (module, optimizer, loader), criterion = made, nn.CrossEntropyLoss()
    setup = _peak_mb()
    best = math.inf
    for rep in range(reps + 1):  # the first is a warm-up
        started = time.perf_counter()
        for x, y in loader:
            optimizer.zero_grad()
            criterion(module(x), y).backward()
            optimizer.pre_step()  # clips every sample's gradient and sums them (no step)
        if rep:
            best = min(best, time.perf_counter() - started)
    return {"parameters": sum(p.numel() for p in model.parameters()), "setup_mb": setup,
            "restart_samples_per_s": n / best, "peak_mb": _peak_mb()}


def _side(queue: Any, side: str, name: str, n: int, batch: int, reps: int,
          budget_mb: float | None) -> None:
    """One side in this (fresh) process, on one core with one torch thread; its result on
    ``queue``."""
    try:
        with one_core(), one_torch_thread():
            kind, path = side.split("/")
            path = path.split("@")[0]
            result = (_diff2_side(name, path, n, batch, reps, budget_mb) if kind == "diff2" else
                      _opacus_side(name, path, n, batch, reps))
    except MemoryRefusal as err:  # DIFF2 cannot run within that budget: a result, not a failure
        result = {"refused": " ".join(str(err).split())[:300], "budget_mb": budget_mb}
    except Exception as err:  # noqa: BLE001 -- one side's failure is reported, the others run
        result = {"error": f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"}
    queue.put(json.dumps(result))


#: The side that runs DIFF2's ghost clipping within the memory Opacus' ghost clipping used.
EQUAL_MEMORY = "diff2/ghost@opacus-memory"


def _diff2_paths() -> list[str]:
    """The per-sample paths ``training.gradients`` declares beyond auto and the paper MLP's."""
    hint = typing.get_type_hints(TrainingConfig)["gradients"]
    return [p for p in typing.get_args(hint) if p not in ("auto", "closed_form")]


def models_section(*, n: int = 512, batch: int = 256, reps: int = 2,
                   models: tuple[str, ...] = ("cnn", "transformer"),
                   progress: Callable[[str], None] | None = None) -> dict:
    """Samples/s and peak memory of every side on every model, with the ratios the issue sets
    (restart: DIFF2 / Opacus ghost >= 1; difference: DIFF2 / Opacus ghost >= 0.5; memory: DIFF2 /
    Opacus ghost <= 1), each side in a fresh process: Opacus first, then each DIFF2 path in
    passes of Opacus' batch, then :data:`EQUAL_MEMORY`: DIFF2's ghost clipping with a memory
    budget of what Opacus' ghost clipping took beyond its setup (``chunk_size: auto``)."""
    context = multiprocessing.get_context("spawn")
    sides = ["opacus/hooks", "opacus/ghost"] + [f"diff2/{p}" for p in _diff2_paths()]
    out: dict[str, Any] = {"records": n, "batch": batch, "dtype": "float32", "clip": CLIP,
                           "reps": reps}
    for name in models:
        results: dict[str, Any] = {}
        peer = {}
        for side in sides + [EQUAL_MEMORY]:
            budget = None
            if side == EQUAL_MEMORY:
                peer = results.get("opacus/ghost", {})
                if "peak_mb" not in peer:
                    continue
                budget = max(1.0, peer["peak_mb"] - peer["setup_mb"])
            if progress:
                progress(f"models: {name} {side}")
            queue = context.Queue()
            process = context.Process(target=_side,
                                      args=(queue, side, name, n, batch, reps, budget))
            process.start()
            results[side] = json.loads(queue.get())
            process.join()
        out[name] = {"sides": results, "ratios": _ratios(results)}
    return out


def _ratios(results: dict[str, Any]) -> dict[str, Any]:
    """Each DIFF2 path against Opacus' ghost clipping (the strongest peer)."""
    peer = results.get("opacus/ghost", {})
    if "restart_samples_per_s" not in peer:
        return {}
    out = {}
    for side, r in results.items():
        if side.startswith("diff2/") and "restart_samples_per_s" in r:
            out[side] = {
                "restart_vs_opacus_ghost": r["restart_samples_per_s"]
                / peer["restart_samples_per_s"],
                "difference_vs_opacus_ghost": r["difference_samples_per_s"]
                / peer["restart_samples_per_s"],
                "peak_mb_vs_opacus_ghost": r["peak_mb"] / peer["peak_mb"]}
            for key in ("restart_peak_mb", "rounds_peak_mb"):  # the rounds without planning
                if r.get(key) is not None:
                    out[side][f"{key}_vs_opacus_ghost"] = r[key] / peer["peak_mb"]
    return out
