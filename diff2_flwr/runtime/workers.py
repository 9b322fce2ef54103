"""One data owner of a DIFF2 run: :class:`Worker` (its records and the per-sample gradient
machinery) and :func:`make_worker`, which builds one from a model, a per-sample loss and records
(the Python API and the YAML path both call it). Importable from :mod:`diff2_flwr.runtime.session`
as well.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from ..core.aggregation import Reply
from ..core.clipping import project_onto_ball, robust_norm
from ..core.distributed import DistributedNoise, client_rng
from ..core.closed_form import PaperMLPGradients
from ..core.device import resolve_device
from ..core.estimator import Diverged, RoundPlan
from ..core.ghost_layers import GhostGradients, GhostUnsupported
from ..core.gradients import Contribution, LossFn, PerSampleGradients
from ..core.memory import Footprint
from ..core.local import LocalTask, run_local_phase
from ..task.losses import LOSSES, class_label_problem, cross_entropy, get_loss, half_squared_error
from ..task.models import PaperMLP
from ..task.records import DatasetRecords, TensorRecords, as_records
from .config import TrainingConfig, argument_error, from_arguments
from .memory_budget import resolve_budget

__all__ = ["AUTO_CHUNK", "DTYPES", "Worker", "compute_dtype", "make_worker"]

#: ``training.dtype`` -> the torch dtype the per-sample gradients are computed in.
DTYPES = {"float64": torch.float64, "float32": torch.float32}
#: ``training.chunk_size: auto``: records read at a time, and the most samples of a pass.
AUTO_CHUNK = 1024


def compute_dtype(setting: str, model: torch.nn.Module) -> torch.dtype:
    """``training.dtype`` for ``model``: as given, or ``auto``: float64 for the paper MLP (its
    closed form and the paper's protocol), float32 for any other model (what a practitioner's
    model is trained in; norms, clip factors and sums stay float64)."""
    if setting == "auto":
        return torch.float64 if type(model) is PaperMLP else torch.float32
    return DTYPES[setting]


@dataclass(frozen=True)
class Worker:
    """One worker (data owner): its records and the per-sample gradient machinery."""

    partition_id: int
    gradients: PerSampleGradients | PaperMLPGradients
    records: TensorRecords | DatasetRecords

    @property
    def num_samples(self) -> int:
        """n_p, the records this worker holds."""
        return self.records.num_samples

    @property
    def features(self) -> torch.Tensor:
        """The features of in-memory records (a Dataset is only ever read in chunks)."""
        if not isinstance(self.records, TensorRecords):
            raise AttributeError(
                "This worker reads a Dataset in chunks; it holds no features tensor.")
        return self.records.features

    @property
    def targets(self) -> torch.Tensor:
        """The targets of in-memory records."""
        if not isinstance(self.records, TensorRecords):
            raise AttributeError(
                "This worker reads a Dataset in chunks; it holds no targets tensor.")
        return self.records.targets

    def contribute(self, radius: float, x_current: np.ndarray,
                   x_previous: np.ndarray | None) -> Contribution:
        """ClippedMean of per-sample gradients (x_previous None) or of gradient differences."""
        if isinstance(self.records, TensorRecords):
            return self.gradients.clipped_mean(x_current, self.records.features,
                                               self.records.targets, radius, x_previous)
        return self.gradients.clipped_mean_of(x_current, self.records.chunks(), radius, x_previous)

    def reply(self, plan: RoundPlan) -> Reply:
        """This worker's reply to ``plan`` exactly as the wire carries it (one float64 array per
        tensor)."""
        c = self.contribute(plan.radius, plan.x_current, plan.x_previous)
        return Reply(client=f"partition {self.partition_id}", partition_id=self.partition_id,
                     arrays=self.gradients.layout.split(c.mean), num_samples=c.num_samples,
                     num_clipped=c.num_clipped, overflow=c.overflow)

    def message(self, noise: DistributedNoise, r: int, radius: float, x_current: np.ndarray,
                x_previous: np.ndarray | None, seed: int | None) -> np.ndarray:
        """``privacy.noise: distributed``: this worker's round-r message for the secure sum: its
        ClippedMean (restart: x_previous None; difference otherwise), projected onto the radius's
        ball, rotated, rounded and noised with this worker's share (int64 in [0, 2**bits)).

        The noise comes from OS entropy, or with ``seed`` (``training.seed``) from (seed, partition,
        round): the seed then reproduces every client's noise (tests only). A worker whose gradients
        overflow raises :class:`~diff2_flwr.core.estimator.Diverged`: the secure sum then misses it
        and the round releases nothing.
        """
        c = self.contribute(radius, x_current, x_previous)
        if c.overflow:
            raise Diverged(r, "gradients",
                           f"partition {self.partition_id}: per-sample gradients overflow at "
                           f"x_{r - 1}; it sends no message, so the round releases nothing.")
        mean = c.mean
        norm = robust_norm(mean)
        # no server checks a message: the worker's own mean must be within the radius
        if norm > radius:
            mean = project_onto_ball(mean, radius, norm)
        return noise.encode(mean, r, x_previous is None, radius, client_rng(seed, self.partition_id,
                                                                            r))

    def local_phase(self, task: LocalTask) -> Reply:
        """The private local steps of the local routine (:mod:`diff2_flwr.core.local`) on this
        shard: y_K as a reply.

        The worker checks what it receives (its partition, shapes, finiteness, b <= n_p) before
        touching data.
        """
        if task.partition_id != self.partition_id:
            raise ValueError(
                f"The local task is for partition {task.partition_id}; this worker is partition "
                             f"{self.partition_id}.")
        if task.x_start.shape != (self.gradients.layout.dim,):
            raise ValueError(
                f"The local task's x_(r-1) has shape {task.x_start.shape}; the model has "
                             f"{self.gradients.layout.dim} parameters.")
        if not isinstance(self.records, TensorRecords):
            raise ValueError(
                "The local routine needs the shard in memory (features and targets tensors); this "
                "worker reads a Dataset in chunks.")
        features, targets = self.records.features, self.records.targets

        def clipped_sum(y: np.ndarray, y_prev: np.ndarray, batch: np.ndarray,
                        radius: float) -> tuple[np.ndarray, int, bool]:
            index = torch.from_numpy(batch)
            c = self.gradients.clipped_mean(y, features[index], targets[index], radius, y_prev)
            return c.mean * batch.size, c.num_clipped, c.overflow

        result = run_local_phase(task, self.num_samples, clipped_sum)
        return Reply(client=f"partition {self.partition_id}", partition_id=self.partition_id,
                     arrays=self.gradients.layout.split(result.y), num_samples=self.num_samples,
                     num_clipped=result.num_clipped, overflow=result.overflow)


def _closed_form_applies(model: torch.nn.Module, loss: LossFn) -> bool:
    """The closed form is for the paper MLP (one softplus hidden layer, one output) with ½-squared
    error."""
    return type(model) is PaperMLP and loss is half_squared_error and model.out.out_features == 1


def make_worker(  # noqa: PLR0913 -- keyword-only: one argument per client setting
    *,
    model: torch.nn.Module,
    loss: LossFn | str,
    data: Any,
    partition_id: int,
    dtype: str = "auto",
    chunk_size: int | str = "auto",
    gradients: str = "auto",
    memory_budget_mb: float | str = "auto",
    device: str = "cpu",
    _plan_memory: bool = True,
    _function: str = "diff2_flwr.make_worker",
) -> Worker:
    """One worker from a model, a per-sample loss and its records; the YAML path calls it too.

    ``loss(output[n, ...], target[n]) -> losses[n]`` (one loss per record, no reduction), or the
    name of one of ours. ``data``: ``(features, targets)`` tensors or arrays, or a map-style
    ``Dataset`` of ``(features, target)`` pairs, read ``chunk_size`` records at a time (1024 with
    ``auto``). ``model`` is copied (its parameters come from the server each round; the caller's
    module is left as it is). ``dtype`` "auto": float64 for the paper MLP, float32 otherwise.
    ``device``: where the per-sample work runs ("cpu", "cuda", "cuda:N", "auto": a GPU if torch
    sees one); the records stay in host memory and each pass's samples are copied over (the
    paper MLP's closed form computes on the CPU).
    ``chunk_size`` "auto": each round kind's pass is the most samples (up to 1024) whose measured
    memory fits ``memory_budget_mb`` (:mod:`~diff2_flwr.runtime.memory_budget`), planned on the
    first records before the first round is computed; a model of which one sample does not fit, or
    a fixed ``chunk_size`` that does not, is refused then in one line
    (:class:`~diff2_flwr.core.memory.MemoryRefusal`).
    ``gradients``: "auto" takes the closed form for the paper MLP with ½-squared error,
    ``torch.func`` for the paper MLP otherwise, and ghost clipping for any other model (per-layer
    ghost norms and clipped sums, :mod:`~diff2_flwr.core.ghost_layers`; ``torch.func`` where its
    first call's check finds a parameter used outside its module); "ghost" and "torch_func" as
    named. Models that mix the samples of a batch (batch-norm)
    are refused.

    References:
        Murata & Suzuki (2023), Algorithm 1 (worker lines), Algorithm 2 (ClippedMean).
    """
    options: TrainingConfig = from_arguments(_function, {"dtype": dtype, "chunk_size": chunk_size,
                                                         "gradients": gradients,
                                                         "memory_budget_mb": memory_budget_mb,
                                                         "device": device},
                                             TrainingConfig)
    if not isinstance(partition_id, int) or isinstance(partition_id, bool) or partition_id < 0:
        raise argument_error(_function, "partition_id", "an integer >= 0", partition_id)
    if not isinstance(model, torch.nn.Module):
        raise argument_error(_function, "model", "a torch.nn.Module", type(model).__name__)
    if isinstance(loss, str):
        if loss not in LOSSES:
            raise argument_error(_function, "loss",
                                 f"a callable loss(output, target) -> per-sample losses, or one "
                                  f"of {sorted(LOSSES)}", loss)
        loss = get_loss(loss)
    if not callable(loss):
        raise argument_error(_function, "loss",
                             "a callable loss(output, target) -> per-sample losses",
                              type(loss).__name__)
    torch_dtype = compute_dtype(options.dtype, model)
    fit_chunk = options.chunk_size == "auto"
    chunk = AUTO_CHUNK if fit_chunk else options.chunk_size
    try:
        where = resolve_device(options.device)
    except ValueError as err:  # no such GPU on this machine
        raise argument_error(_function, "device", "a device torch sees on this machine",
                             " ".join(str(err).split())) from None
    budget = resolve_budget(options.memory_budget_mb, where) if _plan_memory else None
    memory = {"chunk_size": chunk, "budget": budget, "fit_chunk": fit_chunk, "device": where}
    try:
        generic = PerSampleGradients(copy.deepcopy(model), loss, dtype=torch_dtype, **memory)
    except ValueError as err:  # a module that mixes the samples of a batch
        raise argument_error(_function, "model",
                             "a model whose samples do not mix within a batch (no batch-norm)",
                             " ".join(str(err).split())) from None
    closed_form = _closed_form_applies(model, loss)
    if options.gradients == "closed_form" and not closed_form:
        raise argument_error(_function, "gradients",
                             "'auto' or 'torch_func' unless the model is the paper MLP (PaperMLP, "
                             "one output) with loss half_squared_error (the closed form is for "
                             "that model)",
                              options.gradients)
    grads: PerSampleGradients | PaperMLPGradients = generic
    # auto: a practitioner's own model (not the paper's MLP) takes ghost clipping
    ghost = options.gradients == "ghost" or (options.gradients == "auto"
                                              and type(model) is not PaperMLP)
    if ghost:
        grads = GhostGradients(copy.deepcopy(model), loss, dtype=torch_dtype, **memory)
    elif closed_form and options.gradients != "torch_func":
        grads = PaperMLPGradients(generic.layout, dtype=torch_dtype)
    records = as_records(data, dtype=torch_dtype, chunk_size=chunk)
    if records.num_samples == 0:
        raise ValueError(
            f"Partition {partition_id} holds no samples: an empty shard cannot contribute a "
            f"ClippedMean.")
    output, x, y = _check_first_records(_function, partition_id, model, loss, records, torch_dtype,
                                        chunk)
    if loss is cross_entropy and output.ndim >= 2:
        records = _class_labels_checked(records, _label_check(_function, partition_id, output))
    # before any round: a model that cannot fit (a deployment's server, whose machine is not the
    # clients', leaves it to them: _plan_memory False)
    if ghost and options.gradients == "auto":
        try:  # its first call's check, planned or not: a parameter used outside its module
            grads.verify(_flat_parameters(grads, model), x[:2], y[:2])
        except GhostUnsupported:
            grads = generic  # auto: torch.func computes any model
    if _plan_memory and isinstance(grads, PerSampleGradients):
        grads.use_footprints(_footprints(grads, model, loss, x, y))
    return Worker(partition_id, grads, records)


#: Measured footprints by what decides them (:func:`_footprints`): a client rebuilt every round
#: (a ClientApp's worker) measures once per process.
_FOOTPRINTS: dict[tuple, dict[bool, Footprint]] = {}


def _footprints(grads: PerSampleGradients, model: torch.nn.Module, loss: LossFn,
                x: torch.Tensor, y: torch.Tensor) -> dict[bool, Footprint]:
    """The engine's footprints (:meth:`~diff2_flwr.core.gradients.PerSampleGradients.
    measure_footprints`) at the model's own parameters on the first records, measured once per
    model class and shapes, engine, dtype, loss, record shape and largest pass in this process.
    A later worker with another budget reuses them: below the pass that was measured their line
    lies above the peak, and no pass above it is taken (``Footprint.limit``)."""
    key = (type(model), tuple(zip(grads.layout.names, grads.layout.shapes)), grads.engine,
           grads.dtype, loss, tuple(x.shape[1:]), x.dtype, tuple(y.shape[1:]), y.dtype,
           int(x.shape[0]), grads.chunk_size)
    if key not in _FOOTPRINTS:
        _FOOTPRINTS[key] = grads.measure_footprints(_flat_parameters(grads, model), x, y)
    return _FOOTPRINTS[key]


def _flat_parameters(grads: PerSampleGradients, model: torch.nn.Module) -> np.ndarray:
    """``model``'s own trainable parameters as the engine's flat float64 vector."""
    return grads.layout.flatten([p.detach().double().numpy()
                                 for p in model.parameters() if p.requires_grad])


def _label_check(function: str, partition_id: int,
                 output: torch.Tensor) -> Callable[[torch.Tensor, int], None]:
    """The check that targets are class indices below the model's outputs (cross-entropy's classes
    are dimension 1 of its output: [n, C] or [n, C, d1, ...]); it raises in one line, so that no
    target is ever truncated to another class by the loss."""
    classes = int(output.shape[1])

    def check(targets: torch.Tensor, first: int) -> None:
        problem = class_label_problem(targets, classes, first)
        if problem is not None:
            raise argument_error(
                function, "data", f"class labels for loss 'cross_entropy' (partition "
                f"{partition_id}): whole numbers in 0..{classes - 1}, best as integers (e.g. "
                "y.astype(int)); or a loss of your own for real-valued targets", problem)

    return check


def _class_labels_checked(records: TensorRecords | DatasetRecords,
                          check: Callable[[torch.Tensor, int], None]
                          ) -> TensorRecords | DatasetRecords:
    """``records`` whose targets pass ``check``: in memory all at once, here; a Dataset's first
    chunk here and every chunk as each round reads it."""
    if isinstance(records, TensorRecords):
        check(records.targets, 0)
        return records
    checked = dataclasses.replace(records, check_targets=check)
    next(checked.chunks())
    return checked


def _check_first_records(function: str, partition_id: int, model: torch.nn.Module, loss: LossFn,
                         records: TensorRecords | DatasetRecords, dtype: torch.dtype,
                         chunk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The loss on the first two records, so that a target the loss cannot take fails here, in one
    line; the model's output on them (a model that fails on them is refused here too), and the
    first chunk of records (what a memory plan measures)."""
    x, y = (records.features[:chunk], records.targets[:chunk]) if isinstance(
        records, TensorRecords) else next(records.chunks())
    # no draw from torch's global generator leaks out
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        try:
            output = copy.deepcopy(model).to(dtype)(x[:2])
        except Exception as exc:  # noqa: BLE001 - the user's forward: any failure is theirs to fix
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise argument_error(function, "model",
                                 "a model that takes this client's features (its first records "
                                 f"have shape {list(x[:2].shape)}, dtype {x.dtype})",
                                 f"{type(exc).__name__}: {first}") from None
        if loss is cross_entropy and output.ndim >= 2:  # the labels first: the loss would index
            _label_check(function, partition_id, output)(y[:2], 0)
        try:
            loss(output, y[:2])
        except Exception as exc:  # noqa: BLE001 - any failure of the loss is reported, in one line
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise argument_error(function, "loss",
                                 "a loss that takes this client's targets (floating-point "
                                  f"targets arrive as {dtype}, integer ones as they are: give "
                                  f"class labels as "
                                  "integers, e.g. y.astype(int), or convert in the loss with "
                                  "target.long())",
                                  f"{type(exc).__name__}: {first}") from None
    return output, x, y
