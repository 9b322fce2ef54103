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
schedule, clipping and averaging order. Tests check it against the reference driver.
Evaluation metrics come from the same forward pass (train loss and ‖∇f‖² at x_{r-1} are
by-products of round r).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from ..core.closed_form import softplus_with_derivative
from ..core.estimator import round_noise
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


@dataclass(frozen=True)
class RunResult:
    """Metrics at the evaluated rounds (0, every ``eval_every``, R) and the final iterate."""

    spec: RunSpec
    rounds: np.ndarray
    train_loss: np.ndarray
    grad_norm_sq: np.ndarray
    test_loss: np.ndarray
    final_x: np.ndarray
    diverged_at: int | None  # first round whose iterate was not finite


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
        self.a, self.y, self.mask = a, y.reshape(-1), mask.reshape(-1)
        self.a_t = a.reshape(-1, self.F).T.contiguous()  # [F, M]: samples innermost
        self.sq_a1 = 1 + (self.a_t * self.a_t).sum(0)  # 1 + ||a||² per sample
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


def _round_core(a_t, a, y, sq_a1, mask, w1, b1, w2, b2, w1p, b1p, w2p, b2p, restart, radius, with_previous: bool):
    """One round for every run: per-sample (difference) gradient norms and clipped sums per client [P, K, d].

    The previous iterate's per-sample quantities are recomputed rather than stored: writing and
    re-reading them costs more memory traffic than the second forward pass costs arithmetic.
    """
    s, e, delta = _forward(a_t, y, w1, b1, w2, b2)
    ge, gs, gd = e, e.unsqueeze(1) * s, delta
    if with_previous:
        ps, pe, pdelta = _forward(a_t, y, w1p, b1p, w2p, b2p)
        r2 = restart.unsqueeze(-1)
        ge = torch.where(r2, ge, ge - pe)
        gs = torch.where(r2.unsqueeze(-1), gs, gs - pe.unsqueeze(1) * ps)
        gd = torch.where(r2.unsqueeze(-1), gd, gd - pdelta)
    sq = ge * ge + (gs * gs).sum(1) + (gd * gd).sum(1) * sq_a1
    norms = torch.sqrt(sq)
    rad = radius.unsqueeze(-1)
    over = norms > rad
    c = torch.where(over, rad / torch.where(over, norms, 1.0), 1.0) * mask
    return _client_sums(a, ge, gs, gd, c)


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
    lr = torch.tensor([s.learning_rate for s in specs], dtype=torch.float64).unsqueeze(1)
    c1 = torch.tensor([s.clip_restart for s in specs], dtype=torch.float64)
    c2 = torch.tensor([s.clip_diff for s in specs], dtype=torch.float64)
    s1 = [s.sigma_restart for s in specs]
    s2 = [s.sigma_diff for s in specs]
    x_prev = x.clone()
    v = torch.zeros_like(x)
    alive = torch.ones(K, dtype=torch.bool)
    diverged: list[int | None] = [None] * K
    evals: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]] = []

    def evaluate(r: int, x_now: torch.Tensor) -> None:
        s, e, delta = b.forward(x_now, b.a_t, b.y)
        sums = _client_sums(b.a, e, e.unsqueeze(1) * s, delta, b.mask.expand_as(e)).to(torch.float64)
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
    # In float32 the computed per-sample norms carry ~1e-7 relative error: clip to a radius
    # shrunk by 2^-20 so every clipped norm stays <= the radius the noise is calibrated for.
    shrink = 1.0 if dtype == torch.float64 else 1.0 - 2.0**-20
    for r in range(1, rounds + 1):
        restart = (r - 1) % T == 0  # [K]
        if (r - 1) % eval_every == 0 or r == 1:
            evaluate(r - 1, x)
        step = x - x_prev
        radius = torch.where(restart, c1, torch.where(torch.isinf(c2), math.inf, c2 * step.norm(dim=1)))
        sums = core(b.a_t, b.a, b.y, b.sq_a1, b.mask, *b.unpack(x.to(dtype)), *b.unpack(x_prev.to(dtype)),
                    restart, (radius * shrink).to(dtype), not bool(restart.all()))
        mean = (sums.to(torch.float64) / b.n.reshape(P, 1, 1)).sum(0) / P  # (1/P) Σ_p ClippedMean_p
        noise = np.zeros((K, d))
        rad = radius.numpy()
        for k in range(K):
            sigma = s1[k] if restart[k] else s2[k]
            std = 0.0 if sigma == 0 or rad[k] == 0 else sigma * rad[k]
            if std and alive[k]:
                noise[k] = round_noise(specs[k].noise_seed, r, d, std)
        v = torch.where(restart.unsqueeze(1), mean, v + mean) + torch.as_tensor(noise)
        x_prev, x = x, x - lr * v
        bad = alive & ~torch.isfinite(x).all(1)
        if bool(bad.any()):
            for k in torch.nonzero(bad).flatten().tolist():
                diverged[k] = r
            alive &= ~bad
            x = torch.where(alive.unsqueeze(1), x, x_prev.nan_to_num(0.0))  # park dead runs
            x_prev = torch.where(alive.unsqueeze(1), x_prev, x)
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
