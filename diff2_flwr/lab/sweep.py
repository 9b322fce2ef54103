"""A batched engine for sweeps: K runs of DIFF2/DP-GD/GD on the paper MLP advance together.

All runs of a batch share the dataset, P and R; each has its own method parameters (T,
learning rate, C1, C2, σ1, σ2) and seeds. One round of the whole batch is a handful of large
tensor operations: the hidden pre-activations of every (sample, run) pair are one matrix
product, per-sample gradient norms and clipped sums use the closed forms of
:mod:`diff2_flwr.core.closed_form`, and the quantities of the previous iterate are cached
so a difference round costs one forward pass, not two.

The maths is the reference's (:class:`~diff2_flwr.runtime.session.Diff2Server` with
:class:`~diff2_flwr.core.closed_form.PaperMLPGradients` workers): the same noise
(:func:`~diff2_flwr.core.estimator.round_noise` of the run's seed and the round), the same
schedule, radius (:func:`~diff2_flwr.core.estimator.round_scale`, bit for bit), clipping, the
workers' projection onto the ball (:func:`~diff2_flwr.core.clipping.onto_ball`) and averaging
order. As there, only the forward pass runs in the compute dtype: norms, clip factors and sums
are float64. A run whose radius, gradients or iterate stop being finite is recorded as diverged
at that round (as the reference driver's ``Diverged``) and parked. Tests check it against the
reference driver.
The routine (GD, momentum, Adam, ...) is the core's own ``update``, applied to the stacked
iterates of all runs that share a routine and its parameters: every routine is elementwise, so
each row steps exactly as the reference's one run does.
Evaluation metrics come from the same forward pass (train loss and ‖∇f‖² at x_{r-1} are
by-products of round r).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from ..core.clipping import onto_ball, robust_norm
from ..core.closed_form import softplus_with_derivative
from ..core.estimator import Diverged, round_noise, round_scale
from ..core.routines import Routine, make_routine
from ..task.data import PreparedData
from ..task.models import PaperMLP

__all__ = ["RunSpec", "RunResult", "run_batch"]



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
    """Metrics at the evaluated rounds (0, every ``eval_every``, R) and the final iterate."""

    spec: RunSpec
    rounds: np.ndarray
    train_loss: np.ndarray
    grad_norm_sq: np.ndarray
    test_loss: np.ndarray
    final_x: np.ndarray
    diverged_at: int | None  # first round whose radius, gradients or iterate were not finite


def _initial(spec: RunSpec, features: int, hidden: int) -> np.ndarray:
    model = PaperMLP(features, hidden, init_seed=spec.init_seed)
    return np.concatenate([p.detach().double().reshape(-1).numpy() for p in model.parameters()])


class _Batch:
    """Padded shard tensors and the per-run forward pass."""

    def __init__(self, data: PreparedData, hidden: int, dtype: torch.dtype) -> None:
        sizes = data.shard_sizes
        self.P, self.N, self.F, self.H = len(sizes), max(sizes), data.num_features, hidden
        a = torch.zeros(self.P, self.N, self.F, dtype=dtype)
        y = torch.zeros(self.P, self.N, dtype=dtype)
        mask = torch.zeros(self.P, self.N, dtype=dtype)
        for p in range(self.P):
            xs, ys = data.shard(p)
            a[p, : len(ys)] = torch.as_tensor(xs, dtype=dtype)
            y[p, : len(ys)] = torch.as_tensor(ys, dtype=dtype)
            mask[p, : len(ys)] = 1
        self.a, self.y, self.mask = a, y.reshape(-1), mask.reshape(-1).to(torch.float64)
        self.a64 = a.to(torch.float64)  # for the float64 clipped sums (exact from float32)
        self.a_t = a.reshape(-1, self.F).T.contiguous()  # [F, M]: samples innermost
        a64_t = self.a64.reshape(-1, self.F).T
        self.sq_a1 = 1 + (a64_t * a64_t).sum(0)  # 1 + ||a||² per sample, float64
        self.n = torch.tensor(sizes, dtype=torch.float64)
        self.x_test_t = torch.as_tensor(data.x_test, dtype=dtype).T.contiguous()
        self.y_test = torch.as_tensor(data.y_test, dtype=dtype)
        self.dtype = dtype

    def unpack(self, x: torch.Tensor):
        """Flat [K, d] parameters -> W1 [K, H, F], b1 [K, H], w2 [K, H], b2 [K]."""
        H, F = self.H, self.F
        return (x[:, : H * F].reshape(-1, H, F), x[:, H * F: H * F + H], x[:, H * F + H: H * F + 2 * H],
                x[:, H * F + 2 * H])

    def forward(self, x: torch.Tensor, a_t: torch.Tensor, y: torch.Tensor):
        """(s, e, δ) at the flat parameters ``x`` [K, d] for the samples ``a_t`` [F, M]."""
        return _forward(a_t, y, *self.unpack(x.to(self.dtype)))


def _forward(a_t, y, w1, b1, w2, b2):
    """s = softplus(h) [K, H, M], residual e [K, M] and δ = e w2 φ'(h) [K, H, M] for every (run, sample).

    Samples are the innermost (contiguous) dimension, so elementwise work vectorises fully.
    """
    K, H = b1.shape
    h = (w1.reshape(K * H, a_t.shape[0]) @ a_t).reshape(K, H, -1) + b1.unsqueeze(-1)
    s, deriv = softplus_with_derivative(h)
    e = (s * w2.unsqueeze(-1)).sum(1) + b2.unsqueeze(-1) - y
    return s, e, e.unsqueeze(1) * w2.unsqueeze(-1) * deriv


def _client_sums(a, ge, gs, gd, c):
    """Σ_n c_n g_n per client for g = (gd aᵀ, gd, gs, ge), flat in the model's layout: [P, K, d]."""
    K, H, M = gd.shape
    P, N, F = a.shape
    cd = gd * c.unsqueeze(1)
    w1 = torch.bmm(cd.reshape(K * H, P, N).transpose(0, 1), a).reshape(P, K, H * F)
    b1 = cd.reshape(K, H, P, N).sum(-1).permute(2, 0, 1)
    w2 = (gs * c.unsqueeze(1)).reshape(K, H, P, N).sum(-1).permute(2, 0, 1)
    b2 = (ge * c).reshape(K, P, N).sum(-1).T.unsqueeze(-1)
    return torch.cat([w1, b1, w2, b2], dim=2)


def _forward64(a_t, y, w1, b1, w2, b2):
    return tuple(t.to(torch.float64) for t in _forward(a_t, y, w1, b1, w2, b2))


def _round_core(a_t, a, y, sq_a1, mask, w1, b1, w2, b2, w1p, b1p, w2p, b2p, restart, radius, with_previous: bool):
    """One round for every run: clipped sums per client [P, K, d] (float64) and, per client and
    run [P, K], whether a per-sample (difference) gradient's norm was not finite (an overflow).

    Only the forward pass runs in the compute dtype; norms, clip factors and sums are float64,
    as in :class:`~diff2_flwr.core.closed_form.PaperMLPGradients`. The previous iterate's
    per-sample quantities are recomputed rather than stored: writing and re-reading them costs
    more memory traffic than the second forward pass costs arithmetic.
    """
    s, e, delta = _forward64(a_t, y, w1, b1, w2, b2)
    ge, gs, gd = e, e.unsqueeze(1) * s, delta
    if with_previous:
        ps, pe, pdelta = _forward64(a_t, y, w1p, b1p, w2p, b2p)
        r2 = restart.unsqueeze(-1)
        ge = torch.where(r2, ge, ge - pe)
        gs = torch.where(r2.unsqueeze(-1), gs, gs - pe.unsqueeze(1) * ps)
        gd = torch.where(r2.unsqueeze(-1), gd, gd - pdelta)
    sq = ge * ge + (gs * gs).sum(1) + (gd * gd).sum(1) * sq_a1
    norms = torch.sqrt(sq)
    rad = radius.unsqueeze(-1)
    over = norms > rad
    c = torch.where(over, rad / torch.where(over, norms, 1.0), 1.0) * mask
    P, N = a.shape[0], a.shape[1]
    overflow = ((~torch.isfinite(norms)) & (mask > 0)).reshape(-1, P, N).any(-1).T
    return _client_sums(a, ge, gs, gd, c), overflow


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
    # this one by a few ulps): the rest skip the scalar check.
    near = torch.linalg.vector_norm(client_means, dim=-1) >= torch.as_tensor(radius) * (1 - 1e-12)
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


_COMPILED = None


def _compiled_core():
    global _COMPILED
    if _COMPILED is None:
        _COMPILED = torch.compile(_round_core, dynamic=True)
    return _COMPILED


def run_batch(
    data: PreparedData,
    specs: Sequence[RunSpec],
    *,
    rounds: int,
    hidden: int = 10,
    eval_every: int = 1,
    dtype: torch.dtype = torch.float64,
    compile: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> list[RunResult]:
    """Run every spec for ``rounds`` rounds on ``data``; return their evaluated metrics.

    References:
        Murata & Suzuki (2023), Algorithms 1-3, as in :mod:`diff2_flwr.core.estimator`.
    """
    if not specs:
        return []
    b = _Batch(data, hidden, dtype)
    K, P = len(specs), b.P
    x = torch.as_tensor(np.stack([_initial(s, b.F, hidden) for s in specs]))  # [K, d] float64
    d = x.shape[1]
    T = torch.tensor([s.restart_every for s in specs])
    routines = _Routines(specs, x.numpy())
    x_prev = x.clone()
    v = torch.zeros_like(x)
    alive = torch.ones(K, dtype=torch.bool)
    diverged: list[int | None] = [None] * K
    evals: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]] = []

    def evaluate(r: int, x_now: torch.Tensor) -> None:
        s, e, delta = (t.to(torch.float64) for t in b.forward(x_now, b.a_t, b.y))
        sums = _client_sums(b.a64, e, e.unsqueeze(1) * s, delta, b.mask.expand_as(e))
        grad = (sums / b.n.reshape(P, 1, 1)).sum(0) / P  # ∇f = (1/P) Σ_p ∇f_p, unclipped
        losses = (0.5 * e * e * b.mask).to(torch.float64).reshape(K, P, b.N).sum(-1) / b.n  # [K, P]
        _, e_test, _ = b.forward(x_now, b.x_test_t, b.y_test)
        test = (0.5 * e_test * e_test).to(torch.float64).mean(1)
        train = losses.mean(1)
        gn = (grad * grad).sum(1)
        for t in (train, gn, test):
            t[~alive] = math.inf
        evals.append((r, train.numpy().copy(), gn.numpy().copy(), test.numpy().copy()))

    core = _compiled_core() if compile else _round_core
    for r in range(1, rounds + 1):
        restart = (r - 1) % T == 0  # [K]
        if (r - 1) % eval_every == 0 or r == 1:
            evaluate(r - 1, x)
        radius_np, std_np = _plan_radii(r, specs, restart, x, x_prev, alive, diverged)
        radius = torch.as_tensor(radius_np)
        sums, overflow = core(b.a_t, b.a64, b.y, b.sq_a1, b.mask, *b.unpack(x.to(dtype)), *b.unpack(x_prev.to(dtype)),
                              restart, radius, not bool(restart.all()))
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
    evaluate(rounds, x)
    results = []
    rounds_arr = np.array([e[0] for e in evals])
    for k, spec in enumerate(specs):
        results.append(RunResult(
            spec=spec, rounds=rounds_arr,
            train_loss=np.array([e[1][k] for e in evals]), grad_norm_sq=np.array([e[2][k] for e in evals]),
            test_loss=np.array([e[3][k] for e in evals]), final_x=x[k].numpy().copy(), diverged_at=diverged[k],
        ))
    return results
