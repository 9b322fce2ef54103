"""A batched engine for sweeps: K runs of DIFF2/DP-GD/GD on one MLP advance together.

All runs of a batch share the dataset, the model's shape, P and R; each has its own method
parameters (T, learning rate, C1, C2, σ1, σ2) and seeds. The model is any MLP of linear layers with
elementwise activations (the paper's, :class:`~diff2_flwr.task.models.TanhMLP`, a plain
``nn.Sequential``; see :func:`~diff2_flwr.task.models.mlp_shape`) with ½-squared error (regression)
or cross-entropy (any number of classes). One round of the whole batch is a handful of large tensor
operations: the first layer's pre-activations of every (sample, run) pair are one matrix product,
and per-sample gradient norms and clipped sums use the closed forms of :mod:`diff2_flwr.core.ghost`.
A difference round needs the per-sample quantities at x_{r-1} and x_{r-2}: those at x_{r-2} are the
previous round's, kept, so every round costs one forward and backward pass.

The maths is the reference's (:class:`~diff2_flwr.runtime.session.Diff2Server` with its workers):
the same noise (:func:`~diff2_flwr.core.estimator.round_noise` of the run's seed and the round), the
same schedule, radius (:func:`~diff2_flwr.core.estimator.round_scale`, bit for bit), clipping, the
workers' projection onto the ball (:func:`~diff2_flwr.core.clipping.onto_ball`) and averaging order.
As there, only the forward and backward passes run in the compute dtype: norms, clip factors and
sums are float64. A run whose radius, gradients or iterate stop being finite is recorded as diverged
at that round (as the reference driver's ``Diverged``) and parked. Tests check it against the
reference driver (closed-form workers for the paper MLP with ½-squared error, ``torch.func`` workers
otherwise). The routine (GD, momentum, Adam, ...) is the core's own ``update``, applied to the
stacked iterates of all runs that share a routine, its parameters and a step-size schedule (round r
steps with the core's :func:`~diff2_flwr.core.schedules.routine_at`, learning rate η·s(r), as the
server does): every routine is elementwise, so each row steps exactly as the reference's one run
does. Evaluation metrics at x_{r-1} are
by-products of round r's pass (train loss and ‖∇f‖²); test loss and, for classification, test
accuracy take one forward pass over the test split.

A round's clipped sums come from a round backend (:mod:`diff2_flwr.lab.backend`), chosen once per
batch: for an MLP with one hidden layer (the paper's), one forward pass over every client's samples
in torch (compiled or not) and one call of the fused kernel of :mod:`diff2_flwr.core.fused`, which
does the backward pass, norms, clip factors, overflow flags and clipped sums per client and run in
one pass; its unclipped sums give the evaluation's ‖∇f‖². Other MLPs, or a machine where the kernel
cannot be built, take the torch backend (one client at a time); both are checked against each other
and against the reference driver. This module plans the radii, finishes the workers' means, adds the
noise and steps the routines, as the server does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from ..core.clipping import onto_ball, robust_norm, row_norms_np
from ..core.device import resolve_device
from ..core.estimator import Diverged, round_noise, round_scale
from ..core.ghost import MLP, forward
from ..core.routines import Routine, make_routine
from ..core.schedules import Schedule, make_schedule, routine_at
from ..task.data import PreparedData
from ..task.models import build_model, mlp_shape
from .backend import Batch, choose_backend, retain_freed_memory

__all__ = ["RunSpec", "RunResult", "batch_model", "resolve_device", "run_batch"]


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
    schedule: str = "constant"  # round r steps with η·s(r): a name of core.schedules.SCHEDULES
    schedule_params: tuple[tuple[str, float], ...] = ()  # its parameters

    def make_routine(self) -> Routine:
        """The run's routine (x_r = Routine(x_{r-1}, ṽ_r)) with its learning rate and parameters."""
        return make_routine(self.routine, self.learning_rate, **dict(self.routine_params))

    def make_schedule(self) -> Schedule:
        """The run's step-size schedule s(r)."""
        return make_schedule(self.schedule, **dict(self.schedule_params))


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
    """The MLP shape the batched engine runs for this model and loss, and x_0 for ``init_seed``
    (float64, the per-run path's vector); a ValueError naming the model when it is not an MLP the
    engine knows."""
    loss = loss or ("cross_entropy" if data.task == "classification" else "half_squared_error")
    net = build_model(model, in_features=data.num_features, out_features=data.num_outputs,
                      hidden=hidden, init_seed=init_seed, kwargs=model_kwargs)
    shape = mlp_shape(net, loss)
    if shape is None:
        raise ValueError(
            f"The batched engine runs MLPs (nn.Linear layers with elementwise activations: "
            f"softplus, tanh, sigmoid, relu) with loss half_squared_error or cross_entropy; model "
            f"{model!r} with loss {loss!r} is not one. Use engine: inprocess (any model) for it.")
    x0 = np.concatenate([p.detach().double().reshape(-1).numpy() for p in net.parameters()])
    return shape, x0


def _plan_radii(r: int, specs: Sequence[RunSpec], restart: torch.Tensor, x: torch.Tensor,
                x_prev: torch.Tensor, alive: torch.Tensor,
                diverged: list[int | None]) -> tuple[np.ndarray, np.ndarray]:
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
            radius[k], std[k] = round_scale(r, first,
                                            spec.clip_restart if first else spec.clip_diff,
                                            spec.sigma_restart if first else spec.sigma_diff,
                                            x_np[k], None if first else x_prev_np[k])
        except Diverged:
            diverged[k] = r
            alive[k] = False
    return radius, std


def _workers_finish(client_means: torch.Tensor, overflow: torch.Tensor, radius: np.ndarray,
                    alive: torch.Tensor, diverged: list[int | None], r: int) -> None:
    """What each worker does with its ClippedMean before replying, in place: a run with a client
    whose gradients overflowed (or whose mean is not finite) diverges at round r (the reference's
    ``Diverged('gradients')``); a mean that exceeds the radius by float rounding is projected onto
    the ball by :func:`~diff2_flwr.core.clipping.onto_ball`, bit for bit as the worker does.

    The arrays are small ([P, K, d]): numpy on views of the tensors (a torch call costs more than
    its work here)."""
    P, K, _ = client_means.shape
    # views: written in place
    means, flags, live = client_means.numpy(), overflow.numpy(), alive.numpy()
    bad = flags | ~np.isfinite(means).all(-1)  # [P, K]
    if bad.any():
        for k in np.flatnonzero(live & bad.any(0)).tolist():
            diverged[k] = r
            live[k] = False
    # Only means within 1e-12 of the radius can need a projection (the two exact norms differ from
    # this one by a few ulps): the rest skip the scalar check. Scaled where squares would underflow
    # (a mean of norm 1e-170 read 0 and skipped its projection at radius 1e-200).
    norms = row_norms_np(means.reshape(P * K, -1)).reshape(P, K)
    near = (norms >= radius * (1 - 1e-12)) & live & np.isfinite(radius)
    for p, k in zip(*np.nonzero(near)):
        row = means[p, k]
        projected = onto_ball(row, float(radius[k]))
        if max(robust_norm(projected), float(np.linalg.norm(projected))) > radius[k]:
            raise RuntimeError(
                f"Batched engine, round {r}, run {k}, client {p}: the clipped mean's norm "
                               f"{robust_norm(row):.17g} exceeds the radius {radius[k]:.17g} "
                               f"beyond float rounding "
                               "(a clipping bug).")
        means[p, k] = projected


class _Routines:
    """The routine step of every run: runs with equal routines (same kind and parameters) and equal
    schedules step together, through the core routine's own ``update`` on their stacked rows, with
    round r's learning rate η·s(r) (routines are elementwise, so each row is what the reference
    computes for that run alone)."""

    def __init__(self, specs: Sequence[RunSpec], x: np.ndarray, rounds: int) -> None:
        self.rounds = rounds
        groups: dict[tuple[Routine, Schedule], list[int]] = {}
        for k, spec in enumerate(specs):
            routine = spec.make_routine()
            if not routine.post_processing:
                raise ValueError(
                    f"Run {k}: routine {routine.name!r} is not post-processing (it computes on "
                    f"private "
                                 "data); the batched engine runs post-processing routines only. "
                                 "Use the inprocess engine.")
            groups.setdefault((routine, spec.make_schedule()), []).append(k)
        self.groups = [(routine, schedule, np.array(idx))
                       for (routine, schedule), idx in groups.items()]
        self.states = [routine.init(x[idx]) for routine, _, idx in self.groups]

    def step(self, r: int, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """x_r = Routine_{η s(r)}(x_{r-1}, ṽ_r) for every run [K, d]."""
        x_np, v_np = x.numpy(), v.numpy()
        out = np.empty_like(x_np)
        # parked (diverged) runs may hold inf; their rows are discarded
        with np.errstate(all="ignore"):
            for i, (routine, schedule, idx) in enumerate(self.groups):
                step = routine_at(routine, schedule, r, self.rounds)
                out[idx], self.states[i] = step.update(x_np[idx], v_np[idx], self.states[i])
        return torch.from_numpy(out)


#: One evaluated round: (r, train loss [K], ‖∇f‖² [K], test loss [K], test accuracy [K] or None).
_Row = tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]


def _metrics(r: int, mlp: MLP, b: Batch, x: torch.Tensor, alive: torch.Tensor,
             train: tuple[torch.Tensor, torch.Tensor]) -> _Row:
    """Round r's metrics at x [K, d] of the runs ``alive`` then, from the unclipped sums [P, K, d]
    and losses [K, M] at x (``train``, float64) and one forward pass over the test split: (r, f,
    ‖∇f‖², test loss, test accuracy or None); inf (accuracy NaN) for the other runs."""
    sums, loss = train
    K, P = x.shape[0], b.P
    grad = (sums / b.n.reshape(P, 1, 1)).sum(0) / P  # ∇f = (1/P) Σ_p ∇f_p, unclipped
    # f = (1/P) Σ_p f_p
    train_loss = ((loss * b.mask.cpu()).reshape(K, P, b.N).sum(-1) / b.n).mean(1)
    # on the batch's device
    test_pass = forward(mlp, x.to(b.device), b.x_test_t, b.y_test, backward=False)
    test = test_pass.loss.to(torch.float64).mean(1).cpu()
    gn = (grad * grad).sum(1)
    for t in (train_loss, gn, test):
        t[~alive] = math.inf
    accuracy = None
    # argmax: the first of tied classes, as the reference's evaluator
    if mlp.loss == "cross_entropy":
        correct = (test_pass.outputs.argmax(dim=1) == b.y_test.long()).to(torch.float64).mean(
            1).cpu()
        correct[~alive] = math.nan
        accuracy = correct.numpy().copy()
    return r, train_loss.numpy().copy(), gn.numpy().copy(), test.numpy().copy(), accuracy


def _server_step(  # noqa: PLR0913 -- round r's server state, alive and diverged updated in place
        r: int, specs: Sequence[RunSpec], client_means: torch.Tensor, std: np.ndarray,
        restart: torch.Tensor, x: torch.Tensor, v: torch.Tensor, routines: _Routines,
        alive: torch.Tensor,
        diverged: list[int | None]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The server's release and step of round r for every run: ṽ_r = (1/P) Σ_p ClippedMean_p (+
    ṽ_{r-1} in a difference round) + N(0, std²) from (noise seed, r), then x_r = Routine(x_{r-1},
    ṽ_r) with round r's learning rate η·s(r). A run whose iterate is not finite diverges at r, in
    place, and is parked (x kept, ṽ zeroed). Returns (x_{r-1}, x_r, ṽ_r) [K, d]. In numpy on views
    of the (small, CPU) tensors."""
    P, K, d = client_means.shape
    live = alive.numpy()  # a view: written in place
    # (1/P) Σ_p ClippedMean_p (torch's sum: the engine's bits unchanged)
    mean = (client_means.sum(0) / P).numpy()
    v_np = np.where(restart.numpy()[:, None], mean, v.numpy() + mean)
    for k in range(K):
        if std[k] and live[k]:
            v_np[k] += round_noise(specs[k].noise_seed, r, d, std[k])
    v = torch.from_numpy(v_np)
    x_prev, x = x, routines.step(r, x, v)
    bad = ~np.isfinite(x.numpy()).all(1)
    if bad.any():
        for k in np.flatnonzero(live & bad).tolist():
            diverged[k] = r
            live[k] = False
    if not live.all():
        keep = alive.unsqueeze(1)  # ``live`` is its view: updated above
        x = torch.where(keep, x, x_prev.nan_to_num(0.0))  # park dead runs
        x_prev = torch.where(keep, x_prev, x)
        v = torch.where(keep, v, 0.0)
    return x_prev, x, v


def run_batch(  # noqa: PLR0913 -- keyword-only options, as a run config's model, loss, device
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
    device: str | torch.device = "cpu",
    accumulate: str = "float64",
) -> list[RunResult]:
    """Run every spec for ``rounds`` rounds on ``data``; return their evaluated metrics.

    ``model``, ``hidden``, ``model_kwargs``: as the run config's ``model`` (x_0 of run k from its
    ``init_seed``); ``loss``: None for the task's (½-squared error or cross-entropy). ``device``:
    where the rounds' forward and backward passes, norms and clipped sums run
    (:func:`resolve_device`: ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or ``"auto"``); on a GPU the torch
    backend runs there and the server's step (radii, noise from the run's generator, routines) stays
    on the CPU in float64, as everywhere. ``accumulate``: ``"float32"`` (float32 ``dtype``, fused
    backend) takes the clipped sums through the kernel's float32 accumulation
    (:class:`~diff2_flwr.lab.backend.FusedBackend`: sensitivity still 2C, radii shorter by ρ ≈
    2.4e-4); ``"float64"`` (the default) as before.

    References:
        Murata & Suzuki (2023), Algorithms 1-3, as in :mod:`diff2_flwr.core.estimator`.
    """
    if not specs:
        return []
    retain_freed_memory()
    inits = [batch_model(data, model=model, hidden=hidden, model_kwargs=model_kwargs, loss=loss,
                         init_seed=s.init_seed)
             for s in specs]
    mlp, b = inits[0][0], Batch(data, dtype, resolve_device(device))
    x = torch.as_tensor(np.stack([x0 for _, x0 in inits]))  # [K, d] float64
    routines = _Routines(specs, x.numpy(), rounds)
    backend = choose_backend(mlp, b, len(specs), compile=compile, accumulate=accumulate)
    T = np.array([s.restart_every for s in specs])
    x_prev, v = x.clone(), torch.zeros_like(x)
    alive = torch.ones(len(specs), dtype=torch.bool)
    diverged: list[int | None] = [None] * len(specs)
    evals: list[_Row] = []
    for r in range(1, rounds + 1):
        restart = torch.from_numpy((r - 1) % T == 0)  # [K]
        live = alive.clone()  # alive at x_{r-1}, whose metrics this round's pass gives
        radius, std = _plan_radii(r, specs, restart, x, x_prev, alive, diverged)
        evaluated = (r - 1) % eval_every == 0 or r == 1
        # the next round restarts every run (DP-GD, GD; DIFF2 before a restart): this round's pass
        # is not read again
        keep = not (r % T == 0).all()
        out = backend.round(x, restart, torch.as_tensor(radius), train=evaluated, keep=keep)
        if evaluated:
            evals.append(_metrics(r - 1, mlp, b, x, live, out.train))
        client_means = out.sums / b.n.reshape(b.P, 1, 1)  # ClippedMean_p of every run [P, K, d]
        _workers_finish(client_means, out.overflow, radius, alive, diverged, r)
        x_prev, x, v = _server_step(r, specs, client_means, std, restart, x, v, routines, alive,
                                    diverged)
        if progress:
            progress(r, rounds)
    evals.append(_metrics(rounds, mlp, b, x, alive, backend.train(x)))
    return _results(specs, evals, x, diverged, classification=mlp.loss == "cross_entropy")


def _results(specs: Sequence[RunSpec], evals: Sequence[_Row], x: torch.Tensor,
             diverged: Sequence[int | None], *, classification: bool) -> list[RunResult]:
    """Each run's :class:`RunResult` from the evaluated rows (one per evaluated round) and the final
    iterates."""
    rounds = np.array([e[0] for e in evals])
    return [RunResult(spec=spec, rounds=rounds, train_loss=np.array([e[1][k] for e in evals]),
                      grad_norm_sq=np.array([e[2][k] for e in evals]),
                      test_loss=np.array([e[3][k] for e in evals]), final_x=x[k].numpy().copy(),
                      diverged_at=diverged[k],
                      test_accuracy=np.array([e[4][k] for e in evals]) if classification else None)
            for k, spec in enumerate(specs)]
