"""A batched engine for sweeps: K runs of DIFF2/DP-GD/GD on one MLP advance together.

All runs of a batch share the dataset, the model's shape, P and R; each has its own method parameters
(T, learning rate, C1, C2, σ1, σ2) and seeds. The model is any MLP of linear layers with elementwise
activations (the paper's, :class:`~diff2_flwr.task.models.TanhMLP`, a plain ``nn.Sequential``; see
:func:`~diff2_flwr.task.models.mlp_shape`) with ½-squared error (regression) or cross-entropy (any
number of classes). One round of the whole batch is a handful of large tensor operations: the first
layer's pre-activations of every (sample, run) pair are one matrix product, and per-sample gradient
norms and clipped sums use the closed forms of :mod:`diff2_flwr.core.ghost`. A difference round needs
the per-sample quantities at x_{r-1} and x_{r-2}: those at x_{r-2} are the previous round's, kept, so
every round costs one forward and backward pass.

The maths is the reference's (:class:`~diff2_flwr.runtime.session.Diff2Server` with its workers):
the same noise (:func:`~diff2_flwr.core.estimator.round_noise` of the run's seed and the round), the
same schedule, radius (:func:`~diff2_flwr.core.estimator.round_scale`, bit for bit), clipping, the
workers' projection onto the ball (:func:`~diff2_flwr.core.clipping.onto_ball`) and averaging order.
As there, only the forward and backward passes run in the compute dtype: norms, clip factors and sums
are float64. A run whose radius, gradients or iterate stop being finite is recorded as diverged at
that round (as the reference driver's ``Diverged``) and parked. Tests check it against the reference
driver (closed-form workers for the paper MLP with ½-squared error, ``torch.func`` workers otherwise).
The routine (GD, momentum, Adam, ...) is the core's own ``update``, applied to the stacked
iterates of all runs that share a routine and its parameters: every routine is elementwise, so
each row steps exactly as the reference's one run does.
Evaluation metrics at x_{r-1} are by-products of round r's pass (train loss and ‖∇f‖²); test loss
and, for classification, test accuracy take one forward pass over the test split.

For an MLP with one hidden layer (the paper's) a round is one forward pass over every client's samples in
torch (compiled or not) and one call of the fused kernel of :mod:`diff2_flwr.core.fused`, which does the
backward pass, norms, clip factors, overflow flags and clipped sums per client and run in one pass; its
unclipped sums give the evaluation's ‖∇f‖². Other MLPs, or a machine where the kernel cannot be built, take
the torch path (:func:`_round_core`, one client at a time); both are checked against each other and against
the reference driver.
"""

from __future__ import annotations

import ctypes
import math
import sys
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from ..core import fused
from ..core.clipping import clip_factors, onto_ball, robust_norm, row_norms
from ..core.estimator import Diverged, round_noise, round_scale
from ..core.ghost import MLP, Pass, clipped_sums, forward, forward_head, norms as ghost_norms
from ..core.routines import Routine, make_routine
from ..task.data import PreparedData
from ..task.models import build_model, mlp_shape

__all__ = ["RunSpec", "RunResult", "batch_model", "run_batch"]


@dataclass(frozen=True)
class RunSpec:
    """One run of a sweep: the mechanism's parameters and the run's seeds."""

    restart_every: int
    learning_rate: float
    clip_restart: float
    clip_diff: float
    sigma_restart: float
    sigma_diff: float
    noise_seed: int
    init_seed: int
    routine: str = "gd"  # x_r = Routine(x_{r-1}, ṽ_r): a name of core.routines.ROUTINES
    routine_params: tuple[tuple[str, float], ...] = ()  # its parameters beyond the learning rate

    def make_routine(self) -> Routine:
        return make_routine(self.routine, self.learning_rate, **dict(self.routine_params))


@dataclass(frozen=True)
class RunResult:
    """Metrics at the evaluated rounds (0, every ``eval_every``, R) and the final iterate.

    ``test_accuracy`` for classification (None for regression): NaN once the run has diverged.
    """

    spec: RunSpec
    rounds: np.ndarray
    train_loss: np.ndarray
    grad_norm_sq: np.ndarray
    test_loss: np.ndarray
    final_x: np.ndarray
    diverged_at: int | None  # first round whose radius, gradients or iterate were not finite
    test_accuracy: np.ndarray | None = None


def batch_model(data: PreparedData, *, model: str = "paper_mlp", hidden: int = 10,
                model_kwargs: Mapping[str, Any] | None = None, loss: str | None = None,
                init_seed: int = 0) -> tuple[MLP, np.ndarray]:
    """The MLP shape the batched engine runs for this model and loss, and x_0 for ``init_seed`` (float64, the
    per-run path's vector); a ValueError naming the model when it is not an MLP the engine knows."""
    loss = loss or ("cross_entropy" if data.task == "classification" else "half_squared_error")
    net = build_model(model, in_features=data.num_features, out_features=data.num_outputs, hidden=hidden,
                      init_seed=init_seed, kwargs=model_kwargs)
    shape = mlp_shape(net, loss)
    if shape is None:
        raise ValueError(f"The batched engine runs MLPs (nn.Linear layers with elementwise activations: softplus, "
                         f"tanh, sigmoid, relu) with loss half_squared_error or cross_entropy; model {model!r} with "
                         f"loss {loss!r} is not one. Use engine: inprocess (any model) for it.")
    x0 = np.concatenate([p.detach().double().reshape(-1).numpy() for p in net.parameters()])
    return shape, x0


class _Batch:
    """Padded shard tensors: samples innermost, client p's samples at m = p·N + n."""

    def __init__(self, data: PreparedData, dtype: torch.dtype) -> None:
        sizes = data.shard_sizes
        self.P, self.N, self.F = len(sizes), max(sizes), data.num_features
        a = torch.zeros(self.P, self.N, self.F, dtype=dtype)
        y = torch.zeros(self.P, self.N, dtype=dtype)
        mask = torch.zeros(self.P, self.N, dtype=dtype)
        for p in range(self.P):
            xs, ys = data.shard(p)
            a[p, : len(ys)] = torch.as_tensor(xs, dtype=dtype)
            y[p, : len(ys)] = torch.as_tensor(ys, dtype=dtype)
            mask[p, : len(ys)] = 1
        self.y, self.mask = y.reshape(-1), mask.reshape(-1).to(torch.float64)
        self.a64 = a.to(torch.float64)  # for the float64 clipped sums (exact from float32)
        self.a_t = a.reshape(-1, self.F).T.contiguous()  # [F, M]: samples innermost
        a64_t = self.a64.reshape(-1, self.F).T
        self.sq_a = (a64_t * a64_t).sum(0)  # ||a||² per sample, float64
        self.n = torch.tensor(sizes, dtype=torch.float64)
        # One client at a time in a round: its [K, width, N] intermediates stay in the caches, where the whole
        # batch's [K, width, P·N] would stream through memory once per kernel.
        self.clients = [(self.a_t[:, p * self.N:(p + 1) * self.N].contiguous(), self.a64[p:p + 1],
                         self.y[p * self.N:(p + 1) * self.N], self.sq_a[p * self.N:(p + 1) * self.N],
                         self.mask[p * self.N:(p + 1) * self.N]) for p in range(self.P)]
        self.a64_t = a64_t
        self.x_test_t = torch.as_tensor(data.x_test, dtype=dtype).T.contiguous()
        self.y_test = torch.as_tensor(data.y_test, dtype=dtype)
        self.dtype = dtype

    def groups(self, runs: int, width: int, cap: int = 32 << 20) -> list["_Group"]:
        """Clients in groups of consecutive ones (equal sizes but the last) whose [runs, width, samples] tensors in
        the compute dtype stay under ``cap`` bytes (at least one client each): one forward call and one fused
        kernel call per group and round. Under 32 MB glibc reuses their memory (see _retain_freed_memory)."""
        per_client = runs * width * self.N * torch.finfo(self.dtype).bits // 8
        size = max(1, min(self.P, cap // max(1, per_client)))
        out = []
        for p0 in range(0, self.P, size):
            cols = slice(p0 * self.N, min(self.P, p0 + size) * self.N)
            rows = self.a64[p0:p0 + size] if self.F > KERNEL_W1_FEATURES else None
            out.append(_Group(len(range(p0, min(self.P, p0 + size))), self.a_t[:, cols].contiguous(), self.y[cols],
                              self.a64_t[:, cols].contiguous(), self.sq_a[cols], self.mask[cols], rows))
        return out


@dataclass(frozen=True)
class _Group:
    """Consecutive clients' samples for the fused path: inputs [F, M] (compute dtype and float64), targets, ‖x‖²,
    mask [M]."""

    clients: int
    a_t: torch.Tensor
    y: torch.Tensor
    x64_t: torch.Tensor
    sq_a: torch.Tensor
    mask: torch.Tensor
    x_rows: torch.Tensor | None  # [clients, N, F] float64 when the first layer's sums are a matrix product


#: Up to this many input features the fused kernel adds the first layer's weight sums itself (per lane, in the
#: caches); with more, a batched matrix product of its c·dg_1 [K, H, M] does it faster. Measured (K = 18 or 8,
#: float32, compiled, CPU ms per round): California's 8 features, 20-24 in the kernel against 26-28 with the
#: product; KDD Cup 99's 118, 1.25x the torch path's time in the kernel, 0.78x with the product. The crossover
#: between them was not measured.
KERNEL_W1_FEATURES = 32


def _round_core(mlp: MLP, a_t, a64, y, sq_a, mask, x, prev_inputs, prev_grads, restart, radius, some_restart: bool):
    """One round for every run: clipped sums per client [P, K, d] (float64); per client and run [P, K], whether
    a per-sample (difference) gradient's norm was not finite (an overflow); and this round's pass at x (in the
    compute dtype), which the next round reuses as its previous iterate's.

    ``prev_grads`` empty: every run restarts (no previous pass needed); ``some_restart``: some run restarts
    (the others take differences). Only the forward and backward passes run in the compute dtype; norms,
    clip factors and sums are float64 (the float64 copies of the passes are taken where they are read).
    """
    pass_ = forward(mlp, x, a_t, y)
    cur = pass_.to64()
    prev = None
    if prev_grads:
        prev = Pass(prev_inputs, prev_grads, cur.loss, cur.outputs).to64()
        if some_restart:
            prev = prev.restarting(cur, restart)
    norms = ghost_norms(cur, a64.reshape(-1, a64.shape[-1]), sq_a, prev)
    rad = radius.unsqueeze(-1)
    over = norms > rad
    c = clip_factors(norms, rad) * mask
    P, N = a64.shape[0], a64.shape[1]
    overflow = ((~torch.isfinite(norms)) & (mask > 0)).reshape(-1, P, N).any(-1).T
    return clipped_sums(cur, a64, c, prev), overflow, pass_.inputs, pass_.grads, pass_.loss


def _fused_round(kernel: fused.FusedKernel, head: Callable, group: _Group, x: torch.Tensor, w_out: torch.Tensor,
                 prev: fused.Parts | None, restart: torch.Tensor | None,
                 radius: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, fused.Parts, torch.Tensor]:
    """What :func:`_round_core` gives, for a group of clients and an MLP with one hidden layer: the forward pass of
    their samples in torch (``head``: :func:`~diff2_flwr.core.ghost.forward_head`, compiled or not: one call), the
    rest in the fused kernel — clipped sums [clients, K, d] (float64), overflow [clients, K], and this round's
    parts and losses [K, M] (compute dtype), which the next round reuses as its previous iterate's. ``w_out``: the
    output layer's weights [K, O, H] in the compute dtype; ``prev`` None: every run restarts."""
    a, dphi, g, loss = head(x, group.a_t, group.y)
    cur = fused.Parts(a.contiguous(), dphi.contiguous(), g.contiguous(), w_out)
    sums, overflow = fused.clipped_sums(kernel, cur, group.x64_t, group.sq_a, group.mask, radius, prev, restart,
                                        clients=group.clients, x_rows=group.x_rows)
    return sums, overflow, cur, loss


def _fused_rounds(kernel: fused.FusedKernel, head: Callable, mlp: MLP, groups: Sequence[_Group], x: torch.Tensor,
                  prev: Sequence[fused.Parts] | None, restart: torch.Tensor | None,
                  radius: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[fused.Parts], torch.Tensor]:
    """:func:`_fused_round` for every group: sums [P, K, d], overflow [P, K], the parts per group, losses [K, M]."""
    w_out = mlp.layers(x.to(groups[0].a_t.dtype))[1][0].contiguous()
    outs = [_fused_round(kernel, head, group, x, w_out, None if prev is None else prev[i], restart, radius)
            for i, group in enumerate(groups)]
    if len(outs) == 1:
        return outs[0][0], outs[0][1], [outs[0][2]], outs[0][3]
    return (torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs]), [o[2] for o in outs],
            torch.cat([o[3] for o in outs], dim=-1))


def _plan_radii(r: int, specs: Sequence[RunSpec], restart: torch.Tensor, x: torch.Tensor, x_prev: torch.Tensor,
                alive: torch.Tensor, diverged: list[int | None]) -> tuple[np.ndarray, np.ndarray]:
    """Round r's radius and noise std of every run [K], exactly as the server plans them (the same
    :func:`~diff2_flwr.core.estimator.round_scale` on the same float64 iterates, so bit for bit).
    A run whose radius or noise std is not finite diverges at r, in place, and releases nothing;
    parked (dead) runs get radius 0 and no noise."""
    K = len(specs)
    radius, std = np.zeros(K), np.zeros(K)
    x_np, x_prev_np = x.numpy(), x_prev.numpy()
    for k, spec in enumerate(specs):
        if not alive[k]:
            continue
        first = bool(restart[k])
        try:
            radius[k], std[k] = round_scale(r, first, spec.clip_restart if first else spec.clip_diff,
                                            spec.sigma_restart if first else spec.sigma_diff,
                                            x_np[k], None if first else x_prev_np[k])
        except Diverged:
            diverged[k] = r
            alive[k] = False
    return radius, std


def _workers_finish(client_means: torch.Tensor, overflow: torch.Tensor, radius: np.ndarray, alive: torch.Tensor,
                    diverged: list[int | None], r: int) -> None:
    """What each worker does with its ClippedMean before replying, in place: a run with a client
    whose gradients overflowed (or whose mean is not finite) diverges at round r (the reference's
    ``Diverged('gradients')``); a mean that exceeds the radius by float rounding is projected onto
    the ball by :func:`~diff2_flwr.core.clipping.onto_ball`, bit for bit as the worker does."""
    P, K, _ = client_means.shape
    finite = torch.isfinite(client_means).all(-1)  # [P, K]
    for k in torch.nonzero(alive & (overflow | ~finite).any(0)).flatten().tolist():
        diverged[k] = r
        alive[k] = False
    # Only means within 1e-12 of the radius can need a projection (the two exact norms differ from
    # this one by a few ulps): the rest skip the scalar check. Scaled where squares would underflow (a
    # mean of norm 1e-170 read 0 and skipped its projection at radius 1e-200).
    near = row_norms(client_means.reshape(P * K, -1)).reshape(P, K) >= torch.as_tensor(radius) * (1 - 1e-12)
    for p, k in torch.nonzero(near & alive.unsqueeze(0) & torch.isfinite(torch.as_tensor(radius))).tolist():
        row = client_means[p, k].numpy()
        projected = onto_ball(row, float(radius[k]))
        if max(robust_norm(projected), float(np.linalg.norm(projected))) > radius[k]:
            raise RuntimeError(f"Batched engine, round {r}, run {k}, client {p}: the clipped mean's norm "
                               f"{robust_norm(row):.17g} exceeds the radius {radius[k]:.17g} beyond float rounding "
                               "(a clipping bug).")
        client_means[p, k] = torch.as_tensor(projected)


class _Routines:
    """The routine step of every run: runs with equal routines (same kind and parameters) step together,
    through the core routine's own ``update`` on their stacked rows (routines are elementwise, so each
    row is what the reference computes for that run alone)."""

    def __init__(self, specs: Sequence[RunSpec], x: np.ndarray) -> None:
        groups: dict[Routine, list[int]] = {}
        for k, spec in enumerate(specs):
            routine = spec.make_routine()
            if not routine.post_processing:
                raise ValueError(f"Run {k}: routine {routine.name!r} is not post-processing (it computes on private "
                                 "data); the batched engine runs post-processing routines only. Use the inprocess engine.")
            groups.setdefault(routine, []).append(k)
        self.groups = [(routine, np.array(idx)) for routine, idx in groups.items()]
        self.states = [routine.init(x[idx]) for routine, idx in self.groups]

    def step(self, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """x_r = Routine(x_{r-1}, ṽ_r) for every run [K, d]."""
        x_np, v_np = x.numpy(), v.numpy()
        out = np.empty_like(x_np)
        with np.errstate(all="ignore"):  # parked (diverged) runs may hold inf; their rows are discarded
            for i, (routine, idx) in enumerate(self.groups):
                out[idx], self.states[i] = routine.update(x_np[idx], v_np[idx], self.states[i])
        return torch.from_numpy(out)


_RETAINED: list[bool] = []


def _retain_freed_memory() -> None:
    """Let glibc keep freed blocks of up to 32 MB for reuse (once per process). A round allocates its [K, width, M]
    tensors afresh; by default glibc maps each block over 128 kB (or the last freed size) from the OS and unmaps it
    on free, so every round pays a page fault per 4 kB touched: measured ≈ 3 ms of system time per round at K = 18
    on California Housing (12 % of it). Values are unchanged; the process holds up to 256 MB of freed memory."""
    if _RETAINED or not sys.platform.startswith("linux"):
        return
    _RETAINED.append(True)
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl): nothing to tune
        return
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    mallopt(M_MMAP_THRESHOLD, 32 << 20)  # glibc's largest
    mallopt(M_TRIM_THRESHOLD, 256 << 20)


_COMPILED: dict[tuple[str, MLP], Callable] = {}


def _compiled_core(mlp: MLP) -> Callable:
    if ("core", mlp) not in _COMPILED:
        def core(*args):
            return _round_core(mlp, *args)
        _COMPILED["core", mlp] = torch.compile(core, dynamic=True)
    return _COMPILED["core", mlp]


def _head(mlp: MLP, compile: bool) -> Callable:
    """x, a_t, y -> :func:`~diff2_flwr.core.ghost.forward_head` of ``mlp``, compiled or not."""
    def head(x, a_t, y):
        return forward_head(mlp, x, a_t, y)
    if not compile:
        return head
    if ("head", mlp) not in _COMPILED:
        _COMPILED["head", mlp] = torch.compile(head, dynamic=True)
    return _COMPILED["head", mlp]


def run_batch(
    data: PreparedData,
    specs: Sequence[RunSpec],
    *,
    rounds: int,
    hidden: int = 10,
    model: str = "paper_mlp",
    model_kwargs: Mapping[str, Any] | None = None,
    loss: str | None = None,
    eval_every: int = 1,
    dtype: torch.dtype = torch.float64,
    compile: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> list[RunResult]:
    """Run every spec for ``rounds`` rounds on ``data``; return their evaluated metrics.

    ``model``, ``hidden``, ``model_kwargs``: as the run config's ``model`` (x_0 of run k from its
    ``init_seed``); ``loss``: None for the task's (½-squared error or cross-entropy).

    References:
        Murata & Suzuki (2023), Algorithms 1-3, as in :mod:`diff2_flwr.core.estimator`.
    """
    if not specs:
        return []
    _retain_freed_memory()
    inits = [batch_model(data, model=model, hidden=hidden, model_kwargs=model_kwargs, loss=loss, init_seed=s.init_seed)
             for s in specs]
    mlp = inits[0][0]
    classification = mlp.loss == "cross_entropy"
    b = _Batch(data, dtype)
    K, P = len(specs), b.P
    x = torch.as_tensor(np.stack([x0 for _, x0 in inits]))  # [K, d] float64
    d = x.shape[1]
    T = torch.tensor([s.restart_every for s in specs])
    routines = _Routines(specs, x.numpy())
    x_prev = x.clone()
    v = torch.zeros_like(x)
    alive = torch.ones(K, dtype=torch.bool)
    diverged: list[int | None] = [None] * K
    evals: list[tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]] = []

    # The fused kernel does everything after the forward pass of an MLP with one hidden layer in one pass per
    # client (core/fused.py); other MLPs, or a machine where it cannot be built, take the torch path.
    kernel = fused.load() if len(mlp.sizes) == 3 else None
    head = _head(mlp, compile) if kernel is not None else None
    groups = b.groups(K, max(mlp.sizes[1:])) if kernel is not None else []
    unclipped = torch.full((K,), math.inf, dtype=torch.float64)

    def fused_train(parts: list[fused.Parts], loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Unclipped gradient sums [P, K, d] and losses [K, M] (float64) of this round's parts (fused path)."""
        sums = [fused.clipped_sums(kernel, part, group.x64_t, group.sq_a, group.mask, unclipped,
                                   clients=group.clients, x_rows=group.x_rows)[0] for part, group in zip(parts, groups)]
        return (sums[0] if len(sums) == 1 else torch.cat(sums)), loss.to(torch.float64)

    def torch_train(cur: Pass) -> tuple[torch.Tensor, torch.Tensor]:
        """Unclipped gradient sums [P, K, d] and losses [K, M] of a float64 pass (torch path)."""
        return clipped_sums(cur, b.a64, b.mask.expand(K, -1)), cur.loss

    def train_pass(x_now: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Unclipped gradient sums [P, K, d] and losses [K, M] (float64) at x_now."""
        if kernel is None:
            return torch_train(forward(mlp, x_now, b.a_t, b.y).to64())
        sums, _, _, loss = _fused_rounds(kernel, head, mlp, groups, x_now, None, None, unclipped)
        return sums, loss.to(torch.float64)

    def evaluate(r: int, x_now: torch.Tensor, live: torch.Tensor,
                 train_sums: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Metrics at x_now of the runs alive then (``live``), from this round's unclipped sums and losses if given."""
        alive = live
        sums, loss = train_sums if train_sums is not None else train_pass(x_now)
        grad = (sums / b.n.reshape(P, 1, 1)).sum(0) / P  # ∇f = (1/P) Σ_p ∇f_p, unclipped
        train = ((loss * b.mask).reshape(K, P, b.N).sum(-1) / b.n).mean(1)  # f = (1/P) Σ_p f_p
        test_pass = forward(mlp, x_now, b.x_test_t, b.y_test, backward=False)
        test = test_pass.loss.to(torch.float64).mean(1)
        gn = (grad * grad).sum(1)
        for t in (train, gn, test):
            t[~alive] = math.inf
        accuracy = None
        if classification:  # argmax: the first of tied classes, as the reference's evaluator
            correct = (test_pass.outputs.argmax(dim=1) == b.y_test.long()).to(torch.float64).mean(1)
            correct[~alive] = math.nan
            accuracy = correct.numpy().copy()
        evals.append((r, train.numpy().copy(), gn.numpy().copy(), test.numpy().copy(), accuracy))

    core = _compiled_core(mlp) if compile else (lambda *args: _round_core(mlp, *args))
    prev: list[tuple[tuple, tuple]] = [((), ())] * P  # per client: the pass at x_{r-2} (inputs, grads)
    prev_parts: list[fused.Parts] | None = None  # the same for the fused path, per group of clients
    for r in range(1, rounds + 1):
        restart = (r - 1) % T == 0  # [K]
        live = alive.clone()  # alive at x_{r-1}, whose metrics this round's pass gives
        radius_np, std_np = _plan_radii(r, specs, restart, x, x_prev, alive, diverged)
        radius = torch.as_tensor(radius_np)
        all_restart = bool(restart.all())
        evaluated = (r - 1) % eval_every == 0 or r == 1
        if kernel is not None:
            sums, overflow, prev_parts, loss = _fused_rounds(kernel, head, mlp, groups, x,
                                                             None if all_restart else prev_parts, restart, radius)
            if evaluated:
                evaluate(r - 1, x, live, fused_train(prev_parts, loss))
        else:
            # Compiled, the restart selection always runs (fused, it costs little): two round shapes to compile, not three.
            flag = compile or bool(restart.any())
            parts = [core(*client, x, () if all_restart else prev[p][0], () if all_restart else prev[p][1], restart,
                          radius, flag) for p, client in enumerate(b.clients)]
            sums = torch.cat([part[0] for part in parts])
            overflow = torch.cat([part[1] for part in parts])
            if evaluated:
                joined = [torch.cat(ts, dim=-1) for ts in zip(*(part[2] + part[3] + (part[4],) for part in parts))]
                n_in = len(parts[0][2])
                evaluate(r - 1, x, live,
                         torch_train(Pass(tuple(joined[:n_in]), tuple(joined[n_in:-1]), joined[-1], joined[-1]).to64()))
            prev = [(part[2], part[3]) for part in parts]  # the pass at x_{r-1}: round r+1's previous iterate
        client_means = sums / b.n.reshape(P, 1, 1)  # ClippedMean_p of every run [P, K, d]
        _workers_finish(client_means, overflow, radius_np, alive, diverged, r)
        mean = client_means.sum(0) / P  # (1/P) Σ_p ClippedMean_p
        noise = np.zeros((K, d))
        for k in range(K):
            if std_np[k] and alive[k]:
                noise[k] = round_noise(specs[k].noise_seed, r, d, std_np[k])
        v = torch.where(restart.unsqueeze(1), mean, v + mean) + torch.as_tensor(noise)
        x_prev, x = x, routines.step(x, v)
        for k in torch.nonzero(alive & ~torch.isfinite(x).all(1)).flatten().tolist():
            diverged[k] = r
            alive[k] = False
        if not bool(alive.all()):
            x = torch.where(alive.unsqueeze(1), x, x_prev.nan_to_num(0.0))  # park dead runs
            x_prev = torch.where(alive.unsqueeze(1), x_prev, x)
            v = torch.where(alive.unsqueeze(1), v, 0.0)
        if progress:
            progress(r, rounds)
    evaluate(rounds, x, alive)
    results = []
    rounds_arr = np.array([e[0] for e in evals])
    for k, spec in enumerate(specs):
        results.append(RunResult(
            spec=spec, rounds=rounds_arr,
            train_loss=np.array([e[1][k] for e in evals]), grad_norm_sq=np.array([e[2][k] for e in evals]),
            test_loss=np.array([e[3][k] for e in evals]), final_x=x[k].numpy().copy(), diverged_at=diverged[k],
            test_accuracy=np.array([e[4][k] for e in evals]) if classification else None,
        ))
    return results
