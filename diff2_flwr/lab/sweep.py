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
and against the reference driver. Where every run samples its clients (issue 44), a round computes
only the union of the runs' cohorts (:func:`_round_clients`), bit for bit what computing every
client gives (``tests/test_sweep_union.py``). This module plans the radii, finishes the workers'
means, adds the noise and steps the routines, as the server does: in numpy on the small [K, d] and
[P, K, d] arrays, with shortcuts that change no bit (a restart round's radius taken once per run, a
difference round's without round_scale's layers, the noise's normals drawn ahead in blocks of
rounds, the workers' scalar check only near the radius, one ``np.errstate`` for the whole loop);
``tests/test_sweep.py`` checks the results against a loop one run at a time, bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from ..core.clipping import (
    _SQUARES_SAFE_BELOW, RADIUS_FLOOR, SAFE_NORM_RANGE, onto_ball, robust_norm, row_norms_np,
)
from ..core.device import resolve_device
from ..core.estimator import Diverged, round_normals, round_scale
from ..core.ghost import MLP, forward
from ..core.routines import Routine, make_routine
from ..core.sampling import Sampling, cohort_key, denominator, round_cohort
from ..core.schedules import Constant, Schedule, make_schedule, routine_at
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
    # client sampling (None: every round takes all P clients) and the key of its cohort draws
    # (core.sampling.round_cohort; None: cohort_key(noise_seed), as the per-run server derives it)
    sampling: Sampling | None = None
    cohort_seed: int | None = None

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


def _np(t: torch.Tensor | np.ndarray) -> np.ndarray:
    """A numpy view of a CPU tensor (writes go through to it), or the array itself."""
    return t.numpy() if isinstance(t, torch.Tensor) else t


def _difference_scale(clip: float, sigma: float, x_current: np.ndarray,
                      x_previous: np.ndarray) -> tuple[float, float] | None:
    """A difference round's radius and noise std, bit for bit those of
    :func:`~diff2_flwr.core.estimator.round_scale`, where it takes them as plain products of the
    plain norm; None where the caller must ask round_scale: C2 not finite, a norm outside
    :func:`~diff2_flwr.core.clipping.radius_norm`'s plain branch (not finite, or below 2^-500), a
    radius or std that round_scale refuses or that is not finite.

    Where a pair is returned it is round_scale's: radius_norm is then
    ``float(np.linalg.norm(step))``, which for a contiguous float64 vector is numpy's
    ``sqrt(step.dot(step))`` (the same ``dot`` on the same fresh difference, and a correctly rounded
    square root either way), then the same products. What it skips are round_scale's two
    ``np.errstate`` contexts and call layers (microseconds a run and round, cold after a kernel
    call): float warnings are the caller's to silence."""
    if not math.isfinite(clip):
        return None
    step = x_current - x_previous
    norm = math.sqrt(step.dot(step))
    if not _SQUARES_SAFE_BELOW <= norm < math.inf:  # NaN too
        return None
    radius = float(clip * norm)
    noise_std = 0.0 if sigma == 0 or radius == 0 else sigma * radius
    if not (RADIUS_FLOOR <= radius < math.inf and noise_std < math.inf):  # NaN too
        return None
    return radius, noise_std


class _Planner:
    """Every run's radius and noise std per round, exactly as the server plans them (bit for bit
    :func:`~diff2_flwr.core.estimator.round_scale` on the same float64 iterates). A restart round's
    pair depends on (C1, σ1) alone: taken from round_scale once per run. A difference round's is
    :func:`_difference_scale`'s, or round_scale's where that declines."""

    def __init__(self, specs: Sequence[RunSpec]) -> None:
        self.diff = [(s.clip_diff, s.sigma_diff) for s in specs]
        self.first: list[tuple[float, float] | None] = []  # None: round_scale refuses it
        for s in specs:
            try:
                self.first.append(round_scale(1, True, s.clip_restart, s.sigma_restart,
                                              np.empty(0), None))
            except Diverged:
                self.first.append(None)

    def __call__(self, r: int, restart: np.ndarray, x: np.ndarray, x_prev: np.ndarray,
                 alive: np.ndarray, diverged: list[int | None]) -> tuple[np.ndarray, np.ndarray]:
        """Round r's radius and noise std [K] (numpy arrays in, ``alive`` written in place); see
        :func:`_plan_radii`. Float warnings (an overflowing x_{r-1} - x_{r-2}) are the caller's."""
        K = len(self.diff)
        radius, std = [0.0] * K, [0.0] * K
        for k, (first, live) in enumerate(zip(restart.tolist(), alive.tolist())):
            if not live:
                continue
            if first:
                scale = self.first[k]
            else:
                clip, sigma = self.diff[k]
                scale = _difference_scale(clip, sigma, x[k], x_prev[k])
                if scale is None:
                    try:
                        scale = round_scale(r, False, clip, sigma, x[k], x_prev[k])
                    except Diverged:
                        pass
            if scale is None:
                diverged[k] = r
                alive[k] = False
                continue
            radius[k], std[k] = scale
        return np.array(radius, dtype=np.float64), np.array(std, dtype=np.float64)


def _plan_radii(r: int, specs: Sequence[RunSpec], restart: torch.Tensor | np.ndarray,
                x: torch.Tensor | np.ndarray, x_prev: torch.Tensor | np.ndarray,
                alive: torch.Tensor | np.ndarray,
                diverged: list[int | None]) -> tuple[np.ndarray, np.ndarray]:
    """Round r's radius and noise std of every run [K], exactly as the server plans them (the same
    :func:`~diff2_flwr.core.estimator.round_scale` on the same float64 iterates, so bit for bit).
    A run whose radius or noise std is not finite diverges at r, in place, and releases nothing;
    parked (dead) runs get radius 0 and no noise. (The round loop keeps one :class:`_Planner`.)"""
    with np.errstate(all="ignore"):
        return _Planner(specs)(r, _np(restart), _np(x), _np(x_prev), _np(alive), diverged)


class _Cohorts:
    """Each sampled run's cohort per round (:func:`~diff2_flwr.core.sampling.round_cohort` of its
    ``cohort_seed``: the bits any engine draws for (key, r)) as a mask over the P clients, and what
    its round's sum is divided by (E|S|; P for a run without sampling)."""

    def __init__(self, specs: Sequence[RunSpec], clients: int) -> None:
        self.P = clients
        self.sampled = [k for k, s in enumerate(specs) if s.sampling is not None]
        for k in self.sampled:
            try:
                specs[k].sampling.probability(clients)  # type: ignore[union-attr]
            except ValueError as err:
                raise ValueError(f"Run {k}: {err}") from None
        self.specs = specs
        self.keys = [s.cohort_seed if s.cohort_seed is not None else cohort_key(s.noise_seed)
                     for s in specs]
        self.denominators = np.array([denominator(s.sampling, clients) for s in specs])

    def mask(self, r: int) -> np.ndarray:
        """Round r's [P, K] membership (all True for runs without sampling)."""
        out = np.ones((self.P, len(self.specs)), dtype=bool)
        for k in self.sampled:
            spec = self.specs[k]
            out[:, k] = False
            out[round_cohort(self.keys[k], r, spec.sampling, self.P), k] = True
        return out


def _sampled_means(client_means: torch.Tensor, mask: np.ndarray, sampled: Sequence[int],
                   denominators: np.ndarray, mean: np.ndarray) -> None:
    """Overwrite the sampled runs' rows of ``mean`` [K, d] with (1/E|S|) Σ_{p∈S} ClippedMean_p
    (summed in client order, divided: :func:`~diff2_flwr.core.sampling.sampled_sum`'s bits; an
    empty cohort gives zeros)."""
    for k in sampled:
        rows = client_means[torch.from_numpy(np.flatnonzero(mask[:, k])), k]  # [|S|, d]
        mean[k] = (rows.sum(0) / float(denominators[k])).numpy()


def _workers_finish(client_means: torch.Tensor | np.ndarray, overflow: torch.Tensor | np.ndarray,
                    radius: np.ndarray, alive: torch.Tensor | np.ndarray,
                    diverged: list[int | None], r: int, mask: np.ndarray | None = None,
                    clients: np.ndarray | None = None) -> None:
    """What each worker does with its ClippedMean before replying, in place: a run with a client
    whose gradients overflowed (or whose mean is not finite) diverges at round r (the reference's
    ``Diverged('gradients')``); a mean that exceeds the radius by float rounding is projected onto
    the ball by :func:`~diff2_flwr.core.clipping.onto_ball`, bit for bit as the worker does.
    ``clients``: the batch indices of the rows (a round of some clients; None: row p is client p),
    ``mask`` their rows of the cohorts' mask.

    The arrays are small ([P, K, d]): numpy on views of the tensors (a torch call costs more than
    its work here), with few calls when nothing needs a look (the usual round)."""
    # views: written in place
    means, flags, live = _np(client_means), _np(overflow), _np(alive)
    P, K, _ = means.shape
    if P == 0:  # no client computed this round
        return
    # Scaled where squares would underflow (a mean of norm 1e-170 read 0 and skipped its
    # projection at radius 1e-200): row_norms_np, whose plain norms these are, and which this
    # calls only when one of them lies outside SAFE_NORM_RANGE (0, tiny, huge, inf or NaN). A mean
    # that is not finite has a norm that is not (NaN, or inf), so every entry's finiteness is read
    # only when some norm is not finite.
    flat = means.reshape(P * K, -1)
    norms = np.sqrt(np.einsum("ij,ij->i", flat, flat))
    low, high = SAFE_NORM_RANGE
    finite = True
    if not (low <= norms.min() and norms.max() <= high):  # NaN too
        norms = row_norms_np(flat)
        finite = bool(np.isfinite(norms).all())
    norms = norms.reshape(P, K)
    if not finite or flags.any():
        bad = flags | ~np.isfinite(means).all(-1)  # [P, K]
        if mask is not None:  # a client outside a run's cohort did not take part in its round
            bad &= mask
        for k in np.flatnonzero(live & bad.any(0)).tolist():
            diverged[k] = r
            live[k] = False
    # Only means within 1e-12 of the radius can need a projection (the two exact norms differ from
    # this one by a few ulps): the rest skip the scalar check.
    near = norms >= radius * (1 - 1e-12)
    if not near.any():
        return
    near &= live & np.isfinite(radius)
    for p, k in zip(*np.nonzero(near)):
        row = means[p, k]
        projected = onto_ball(row, float(radius[k]))
        if max(robust_norm(projected), float(np.linalg.norm(projected))) > radius[k]:
            raise RuntimeError(
                f"Batched engine, round {r}, run {k}, client "
                f"{p if clients is None else int(clients[p])}: the clipped mean's norm "
                               f"{robust_norm(row):.17g} exceeds the radius {radius[k]:.17g} "
                               f"beyond float rounding "
                               "(a clipping bug).")
        means[p, k] = projected


class _Noise:
    """Round r's standard normals of each run, drawn ahead for a block of rounds: the bits of
    :func:`~diff2_flwr.core.estimator.round_noise`, which is ``round_normals(key, r, d) * std``
    (:func:`~diff2_flwr.core.estimator.round_normals`: a fresh generator per (key, round)), the
    product taken by the caller. Drawn in a row, a draw (seed sequence, generator, normals) took
    13 µs; one at a time after each kernel call, with the caches cold, 45 µs. Only the (round, run)
    pairs whose round kind has σ > 0, of runs alive when the block is drawn: no others take
    noise."""

    #: At most this many float64s drawn ahead (512 KiB), and at most this many rounds.
    FLOATS, ROUNDS = 1 << 16, 64

    def __init__(self, specs: Sequence[RunSpec], restarts: np.ndarray, dim: int) -> None:
        K = len(specs)
        self.keys = [s.noise_seed for s in specs]
        self.dim, self.restarts = dim, restarts  # restarts [R + 1, K]: row r - 1 is round r's
        self.noisy = np.where(restarts, np.array([s.sigma_restart != 0 for s in specs]),
                              np.array([s.sigma_diff != 0 for s in specs]))
        self.block = max(1, min(self.ROUNDS, self.FLOATS // max(1, K * dim)))
        self.start, self.drawn = 1, np.empty((0, K, dim))
        self.have = np.zeros((0, K), dtype=bool)

    def normals(self, r: int, k: int, alive: np.ndarray) -> np.ndarray:
        """Round r's standard normals of run k [dim] (rounds asked in increasing order)."""
        i = r - self.start
        if not 0 <= i < len(self.drawn):
            last = min(r + self.block, len(self.restarts))  # rounds r .. last - 1
            self.have = self.noisy[r - 1:last - 1] & alive
            self.drawn = np.empty((last - r, len(self.keys), self.dim))
            for j, k2 in zip(*np.nonzero(self.have)):
                self.drawn[j, k2] = round_normals(self.keys[k2], r + int(j), self.dim)
            self.start, i = r, 0
        if not self.have[i, k]:  # a run brought back to life cannot happen; kept exact anyway
            return round_normals(self.keys[k], r, self.dim)
        return self.drawn[i, k]


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
        # the constant schedule steps with the routine itself (what routine_at returns for it)
        self.constant = [isinstance(schedule, Constant) for _, schedule, _ in self.groups]
        # one group of every run in order: its rows are the whole arrays (no gather or scatter)
        self.whole = len(self.groups) == 1

    def step(self, r: int, x: np.ndarray, v: np.ndarray) -> np.ndarray:
        """x_r = Routine_{η s(r)}(x_{r-1}, ṽ_r) for every run [K, d] (float warnings are the
        caller's: parked runs may hold inf, their rows are discarded)."""
        if self.whole:
            routine, schedule, _ = self.groups[0]
            step = routine if self.constant[0] else routine_at(routine, schedule, r, self.rounds)
            out, self.states[0] = step.update(x, v, self.states[0])
            return out
        out = np.empty_like(x)
        for i, (routine, schedule, idx) in enumerate(self.groups):
            step = routine if self.constant[i] else routine_at(routine, schedule, r, self.rounds)
            out[idx], self.states[i] = step.update(x[idx], v[idx], self.states[i])
        return out


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
        r: int, client_means: torch.Tensor, std: np.ndarray, restart: np.ndarray | bool,
        x: np.ndarray, v: np.ndarray, routines: _Routines, noise: _Noise, alive: np.ndarray,
        diverged: list[int | None], cohorts: tuple[np.ndarray, _Cohorts] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The server's release and step of round r for every run: ṽ_r = (1/P) Σ_p ClippedMean_p (+
    ṽ_{r-1} in a difference round) + N(0, std²) from (noise seed, r), then x_r = Routine(x_{r-1},
    ṽ_r) with round r's learning rate η·s(r). A run whose iterate is not finite diverges at r, in
    place, and is parked (x kept, ṽ zeroed). ``restart``: which runs restart [K], or True (all) or
    False (none). Returns (x_{r-1}, x_r, ṽ_r) [K, d]. In numpy (float warnings are the caller's) on
    the small CPU arrays. ``cohorts`` (round r's [P, K] mask and the runs' :class:`_Cohorts`):
    a sampled run's sum is over its cohort, divided by E|S|; where every run samples, the rows
    (and the mask's) may be those of the round's clients only (the union of the cohorts)."""
    P, K, d = client_means.shape
    if cohorts is not None and len(cohorts[1].sampled) == K:
        mean = np.empty((K, d))  # every row is a cohort's sum
    else:  # (1/P) Σ_p ClippedMean_p (torch's sum: the engine's bits unchanged)
        mean = (client_means.sum(0) / P).numpy()
    if cohorts is not None:
        mask, c = cohorts
        _sampled_means(client_means, mask, c.sampled, c.denominators, mean)
    if restart is True:  # every run restarts: what np.where(restart, mean, v + mean) selects
        v = mean
    elif restart is False:  # none does
        v = v + mean
    else:
        v = np.where(restart[:, None], mean, v + mean)
    for k, (s, live) in enumerate(zip(std.tolist(), alive.tolist())):
        if s and live:  # round_noise(seed, r, d, s) = round_normals(seed, r, d) * s
            v[k] += noise.normals(r, k, alive) * std[k]
    x_prev, x = x, routines.step(r, x, v)
    if not np.isfinite(x).all():
        for k in np.flatnonzero(alive & ~np.isfinite(x).all(1)).tolist():
            diverged[k] = r
            alive[k] = False
    if not alive.all():  # park dead runs
        keep = torch.from_numpy(alive).unsqueeze(1)
        x_t, x_prev_t = torch.from_numpy(x), torch.from_numpy(x_prev)
        x_t = torch.where(keep, x_t, x_prev_t.nan_to_num(0.0))
        x_prev_t = torch.where(keep, x_prev_t, x_t)
        x, x_prev = x_t.numpy(), x_prev_t.numpy()
        v = torch.where(keep, torch.from_numpy(v), 0.0).numpy()
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
    two_valued: bool = False,
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
    2.4e-4); ``"float64"`` (the default) as before. ``two_valued`` (opt-in; fused backend, torch's
    forward, many features): the first layer's sums of the columns that take two values (one-hot
    columns) from per-record minority sums (:class:`~diff2_flwr.lab.backend.FusedBackend`); refused
    in one line where it cannot apply.

    A spec's ``sampling`` (:class:`~diff2_flwr.core.sampling.Sampling`; issue 44) samples its
    clients: round r's cohort is :func:`~diff2_flwr.core.sampling.round_cohort` of its
    ``cohort_seed`` and r, its release sums the cohort's clipped means and divides by E|S| (qP or
    m), and only the cohort's overflows diverge it. Its σ must come from a calibration for that
    sampling (:func:`~diff2_flwr.core.calibration.calibrate`'s ``sampling``). Where every run of
    the batch samples, a round computes only the union of the runs' cohorts
    (:func:`_round_clients`; an evaluated round every client, whose metrics read them all), with
    the bits of computing every client (the backend's ``subsets``); a batch with a run that does
    not sample computes every client each round.

    References:
        Murata & Suzuki (2023), Algorithms 1-3, as in :mod:`diff2_flwr.core.estimator`.
    """
    if not specs:
        return []
    # refused before anything is built: a cohort larger than the federation
    cohorts = (_Cohorts(specs, len(data.shard_sizes))
               if any(s.sampling is not None for s in specs) else None)
    retain_freed_memory()
    inits = [batch_model(data, model=model, hidden=hidden, model_kwargs=model_kwargs, loss=loss,
                         init_seed=s.init_seed)
             for s in specs]
    mlp, b = inits[0][0], Batch(data, dtype, resolve_device(device))
    x = np.stack([x0 for _, x0 in inits])  # [K, d] float64
    routines = _Routines(specs, x, rounds)
    # every run samples: rounds of the cohorts' union
    subsets = cohorts is not None and len(cohorts.sampled) == len(specs)
    backend = choose_backend(mlp, b, len(specs), compile=compile, accumulate=accumulate,
                             two_valued=two_valued, subsets=subsets)
    T = np.array([s.restart_every for s in specs])
    # row r - 1: which runs restart in round r (rows 0 .. rounds; the last is for keep below)
    restarts = np.arange(rounds + 1)[:, None] % T == 0
    # round r + 1 restarts every run (DP-GD, GD; DIFF2 before a restart): round r's pass is not
    # read again
    every = restarts.all(1).tolist()
    # round r's restarts for the server's step: True (every run), False (none) or row r - 1
    kinds = [row if some and not all_ else all_
             for all_, some, row in zip(every, restarts.any(1).tolist(), restarts)]
    planner, noise = _Planner(specs), _Noise(specs, restarts, x.shape[1])
    n = b.n.reshape(b.P, 1, 1)
    x_prev, v = x.copy(), np.zeros_like(x)
    alive = np.ones(len(specs), dtype=bool)
    diverged: list[int | None] = [None] * len(specs)
    evals: list[_Row] = []
    # Float warnings are silenced once for the loop's numpy (values never depend on them): parked
    # runs may hold inf, and an overflowing x_{r-1} - x_{r-2} is refused by the plan.
    with np.errstate(all="ignore"):
        for r in range(1, rounds + 1):
            restart = restarts[r - 1]  # [K]
            evaluated = (r - 1) % eval_every == 0 or r == 1
            live = alive.copy()  # alive at x_{r-1}: this pass's metrics
            radius, std = planner(r, restart, x, x_prev, alive, diverged)
            mask = None if cohorts is None else cohorts.mask(r)
            clients = _round_clients(mask, evaluated) if subsets else None
            x_t = _fed(x, live)
            out = backend.round(x_t, torch.from_numpy(restart), torch.from_numpy(radius),
                                train=evaluated, keep=not every[r], clients=clients)
            if evaluated:
                evals.append(_metrics(r - 1, mlp, b, x_t, torch.from_numpy(live), out.train))
            if clients is not None:  # the rows of the round's clients
                mask = mask[clients]  # type: ignore[index]
            # ClippedMean_p of every run [P, K, d] (of the round's clients)
            client_means = out.sums / (n if clients is None else n[clients])
            _workers_finish(client_means, out.overflow, radius, alive, diverged, r, mask, clients)
            x_prev, x, v = _server_step(r, client_means, std, kinds[r - 1], x, v, routines,
                                        noise, alive, diverged,
                                        None if mask is None else (mask, cohorts))
            if progress:
                progress(r, rounds)
    x_t = _fed(x, alive)
    evals.append(_metrics(rounds, mlp, b, x_t, torch.from_numpy(alive.copy()), backend.train(x_t)))
    return _results(specs, evals, x, diverged, classification=mlp.loss == "cross_entropy")


def _fed(x: np.ndarray, alive: np.ndarray) -> torch.Tensor:
    """The iterates [K, d] the backend's pass reads: x, with the rows of runs parked before this
    pass (not ``alive``) at zero. A parked run's row is its last finite iterate, often beyond the
    compute dtype's range (a run diverges by growing): its pass, all inf and NaN, cost the kernel
    4-5 times a live run's (measured: a batch of one diverged California GD run, 7.3 s against 1.6 s
    for 2,000 rounds). Nothing reads a parked run's pass (radius 0; its metrics are inf), so every
    live run keeps its bits."""
    if alive.all():
        return torch.from_numpy(x)
    return torch.from_numpy(np.where(alive[:, None], x, 0.0))


def _round_clients(mask: np.ndarray | None, evaluated: bool) -> np.ndarray | None:
    """The clients a round of a batch whose runs all sample computes: the union of the runs'
    cohorts (sorted; ``mask`` [P, K]), or None (every client) in an evaluated round, whose metrics
    (train loss, ‖∇f‖²) read every client's pass. A round of the union gives the runs the bits of
    a round of every client (the backends' ``clients``)."""
    if evaluated or mask is None:
        return None
    return np.flatnonzero(mask.any(1))


def _results(specs: Sequence[RunSpec], evals: Sequence[_Row], x: np.ndarray,
             diverged: Sequence[int | None], *, classification: bool) -> list[RunResult]:
    """Each run's :class:`RunResult` from the evaluated rows (one per evaluated round) and the final
    iterates."""
    rounds = np.array([e[0] for e in evals])
    return [RunResult(spec=spec, rounds=rounds, train_loss=np.array([e[1][k] for e in evals]),
                      grad_norm_sq=np.array([e[2][k] for e in evals]),
                      test_loss=np.array([e[3][k] for e in evals]), final_x=x[k].copy(),
                      diverged_at=diverged[k],
                      test_accuracy=np.array([e[4][k] for e in evals]) if classification else None)
            for k, spec in enumerate(specs)]
