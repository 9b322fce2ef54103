"""No clipped row ever exceeds its radius (issue 43): every path clips at C over an upper bound of
the row's true norm (:func:`~diff2_flwr.core.clipping.upper_norms`), rounded down
(:func:`~diff2_flwr.core.clipping.clip_factors`). Checked against exact oracles (Fractions: no
rounding in the check) on adversarial rows — activations ≥ 1e4, rank-two terms that nearly cancel,
squares that underflow or overflow, subnormal entries, radii on the computed norm — for the row
primitive, the closed form and the batched engine's ghost norms. Each attack also runs against the
clip factor the paths took before (C / N̂): some row then exceeds its radius, so the tests have
teeth. (The fused kernel and the generic models' ghost layers have theirs in test_fused.py and
test_ghost_layers.py.)"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from diff2_flwr.core import clipping
from diff2_flwr.core.clipping import (
    clip_factors, clip_rows, clipped_sum, gamma, row_norms, upper_norms,
)
from diff2_flwr.core.closed_form import PaperMLPGradients, norm_error as closed_form_error
from diff2_flwr.core.ghost import MLP, Pass, norm_bounds
from diff2_flwr.core.layout import ParameterLayout
from exact_norms import inside, rank_two_sq_norm, sq_norm


def _old_factors(norms: torch.Tensor, radius) -> torch.Tensor:
    """The factor every path took before: C / N̂ where N̂ > C."""
    over = norms > radius
    return torch.where(over, radius / torch.where(over, norms, 1.0), 1.0)


# --- primitives ----------------------------------------------------------------------------------

def test_gamma_is_higham_and_refuses_what_bounds_nothing():
    assert gamma(0) == 0.0
    assert gamma(3) >= 3 * 2.0**-53 / (1 - 3 * 2.0**-53)
    assert Fraction(gamma(3)) >= Fraction(3, 2**53) / (1 - Fraction(3, 2**53))
    assert gamma(10, 2.0**-24) > 10 * 2.0**-24
    with pytest.raises(ValueError, match="k·u < 1/2"):
        gamma(2**23, 2.0**-24)


def test_upper_norms_rounds_every_operation_upward():
    rng = np.random.default_rng(0)
    norms = torch.as_tensor(rng.uniform(0.1, 10, 2000) * 10.0 ** rng.integers(-200, 200, 2000))
    rel, extra = 3e-13, torch.as_tensor(rng.uniform(0, 1, 2000) * norms.numpy())
    hi = upper_norms(norms, rel, extra)
    for n, e, h in zip(norms.tolist(), extra.tolist(), hi.tolist()):
        assert Fraction(h) >= Fraction(n) * (1 + Fraction(rel)) + Fraction(e)
    assert upper_norms(torch.zeros(3, dtype=torch.float64), rel).tolist() == [0.0] * 3


def test_clip_factors_never_exceed_c_over_the_bound():
    rng = np.random.default_rng(1)
    upper = torch.as_tensor(rng.uniform(1, 2, 5000) * 10.0 ** rng.integers(-300, 300, 5000))
    radius = torch.as_tensor(rng.uniform(1, 2, 5000) * 10.0 ** rng.integers(-250, 250, 5000))
    c = clip_factors(upper, radius)
    for ci, u, r in zip(c.tolist(), upper.tolist(), radius.tolist()):
        assert ci == 1.0 if u <= r else Fraction(ci) * Fraction(u) <= Fraction(r)


# --- the row primitive ---------------------------------------------------------------------------

def _adversarial_rows(rng: np.random.Generator, d: int) -> np.ndarray:
    """Rows of every magnitude, with subnormal entries, near-cancelling pairs, and many equal
    entries (whose squares sum with the most rounding)."""
    rows = [rng.standard_normal(d) * 10.0 ** e for e in (-310, -170, -5, 0, 4, 12, 150, 300)]
    rows.append(np.full(d, 1.0 + 2.0**-52))
    rows.append(np.where(np.arange(d) % 2 == 0, 1e4, 1e-320))
    rows.append(np.concatenate([[5e-324] * (d - 1), [1e-300]]))
    big = rng.standard_normal(d) * 1e4
    rows.append(big - np.nextafter(big, np.inf))  # differences of neighbours: one ulp each
    return np.stack(rows)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("d", [1, 7, 300])
def test_the_row_primitive_keeps_every_clipped_row_inside_on_adversarial_rows(dtype, d):
    """Radii at the computed norm of each row and one ulp either side (where rounding decides), and
    over a range: the exact norm of every clipped row is <= C."""
    rng = np.random.default_rng(d)
    rows = torch.as_tensor(_adversarial_rows(rng, d)).to(dtype)
    rows = rows[torch.isfinite(rows).all(1)]
    norms = row_norms(rows).to(torch.float64).tolist()
    radii = [r for n in norms if n > 0
             for r in (n, math.nextafter(n, 0), math.nextafter(n, math.inf))
             if r >= clipping.RADIUS_FLOOR] + [1e-200, 1.0, 1e100]
    for radius in radii:
        clipped, _ = clip_rows(rows, radius)
        for r in clipped.to(torch.float64).numpy():
            assert inside(r, radius), (radius, r)
        total = clipped_sum(rows[:1], radius).total  # one row: the sum is the clipped row
        assert inside(total.to(torch.float64).numpy(), radius)


def test_the_row_primitive_had_rows_outside_before():
    """Teeth: the same attack with C / N̂ (the factor before) puts rows above the radius."""
    rng = np.random.default_rng(3)
    rows = torch.as_tensor(rng.standard_normal((400, 300)) * 1e4)
    norms = row_norms(rows)
    outside = 0
    for i in range(len(rows)):
        radius = math.nextafter(float(norms[i]), 0)
        old = rows[i] * _old_factors(norms[i:i + 1], radius)
        outside += not inside(old.numpy(), radius)
        new, _ = clip_rows(rows[i:i + 1], radius)
        assert inside(new[0].numpy(), radius)
    assert outside > 0


# --- the closed form (the paper's MLP) -----------------------------------------------------------

def _closed_form_rows(rng, n, hidden, features, scale_a, scale_g):
    a = torch.as_tensor(rng.standard_normal((n, features)) * scale_a)
    ge = torch.as_tensor(rng.standard_normal(n) * scale_g)
    gs = torch.as_tensor(rng.standard_normal((n, hidden)) * scale_g)
    gd = torch.as_tensor(rng.standard_normal((n, hidden)) * scale_g)
    return a, ge, gs, gd


def _closed_form_row(a, ge, gs, gd, i) -> Fraction:
    """‖(gd aᵀ, gd, gs, ge)‖² of sample i, exactly."""
    return rank_two_sq_norm(gd[i].numpy(), a[i].numpy()) + sq_norm(gd[i].numpy()) + sq_norm(
        gs[i].numpy()) + sq_norm([float(ge[i])])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("scale_a, scale_g", [(1.0, 1.0), (1e4, 1e-3), (1e-170, 1e150),
                                              (1e150, 1e-160), (1e-310, 1.0), (1e-30, 1e18)])
def test_the_closed_form_clips_every_sample_inside_its_radius(scale_a, scale_g, dtype):
    """One sample per call: its clipped sum is the clipped row as the sums add it (products
    rounded); its exact norm is <= C, at radii on its computed norm and around it. Float32: the
    factors a float32 pass gives (float32 values, read in float64 exactly, as the sums do)."""
    hidden, features = 6, 5
    layout = ParameterLayout(("w1", "b1", "w2", "b2"),
                             ((hidden, features), (hidden,), (1, hidden), (1,)))
    grads = PaperMLPGradients(layout)
    rng = np.random.default_rng(int(-math.log10(scale_a)) % 97)
    a, ge, gs, gd = (t.to(dtype).to(torch.float64) for t in _closed_form_rows(
        rng, 12, hidden, features, scale_a, scale_g))
    if not all(bool(torch.isfinite(t).all()) for t in (a, ge, gs, gd)):
        pytest.skip("beyond float32's range: a float32 pass cannot produce these factors")
    for i in range(len(a)):
        sl = slice(i, i + 1)
        exact = _closed_form_row(a, ge, gs, gd, i)
        approx = math.sqrt(float(exact)) if math.isfinite(float(exact)) else None
        if approx is None or approx == 0 or approx < clipping.RADIUS_FLOOR:
            continue
        for radius in (approx, math.nextafter(approx, 0), math.nextafter(approx, math.inf),
                       approx * 0.5):
            total, _, _ = grads.clipped_sum_of(a[sl], (a[sl] ** 2).sum(1), ge[sl], gs[sl], gd[sl],
                                               radius)
            assert inside(total.numpy(), radius), (i, radius)


def test_the_closed_forms_bound_covers_its_rounding_and_the_old_factor_did_not():
    """Teeth: at C = N̂ one ulp down, C / N̂ left some samples above C (the computed norm is below
    the true one for about half of them); the bound leaves none."""
    hidden, features = 30, 40
    rng = np.random.default_rng(11)
    a, ge, gs, gd = _closed_form_rows(rng, 200, hidden, features, 1e4, 1.0)
    from diff2_flwr.core.closed_form import _norms

    sq_a = (a * a).sum(1)
    norms = _norms(a, sq_a, ge, gs, gd)
    upper = upper_norms(norms, closed_form_error(hidden, features))
    outside_old = 0
    for i in range(len(a)):
        exact = _closed_form_row(a, ge, gs, gd, i)
        radius = math.nextafter(float(norms[i]), 0)
        r2 = Fraction(radius) ** 2
        old = float(_old_factors(norms[i:i + 1], radius)[0])
        new = float(clip_factors(upper[i:i + 1], radius)[0])
        outside_old += Fraction(old) ** 2 * exact > r2
        assert Fraction(new) ** 2 * exact <= r2
    assert outside_old > 0


# --- the batched engine's ghost norms (MLPs, many runs) ------------------------------------------

def _ghost_case(kind: str, seed: int, K: int = 4, M: int = 24, F: int = 5, H: int = 7, O: int = 3):
    """Passes at two iterates of an MLP (F, H, O) for K runs over M samples, built directly (the
    norms take any float64 pass): ``kind`` picks the attack."""
    rng = np.random.default_rng(seed)

    def t(*shape, scale=1.0):
        return torch.as_tensor(rng.standard_normal(shape) * scale)

    x = t(M, F)
    a = t(K, H, M, scale=1e4)
    g1, g2 = t(K, H, M), t(K, O, M)
    if kind == "cancel":
        # dg ãᵀ ≈ -g' (da, 0)ᵀ: g2 - g2' = g2', a - a' = -a (+ noise): the bracket is ~1e-8 of A + B
        gp2 = t(K, O, M)
        g2 = 2 * gp2 + t(K, O, M, scale=1e-7)
        ap = 2 * a + t(K, H, M, scale=1e-3)
        gp1 = g1 + t(K, H, M, scale=1e-9)
    elif kind == "near":
        gp2, gp1 = g2 + t(K, O, M, scale=1e-6), g1 + t(K, H, M, scale=1e-6)
        ap = a + t(K, H, M, scale=1e-2)
    elif kind == "huge":  # multipliers above 2^400 and squares that overflow: the scaled path
        a = t(K, H, M, scale=1e150)
        gp2, gp1, ap = t(K, O, M, scale=1e-100), t(K, H, M), a * (1 + 1e-3 * t(K, H, M))
        g2 = gp2 * (1 + t(K, O, M, scale=1e-2))
    elif kind == "tiny":  # squares that underflow, subnormal entries
        a, g1 = t(K, H, M, scale=1e-170), t(K, H, M, scale=1e-160)
        g2, gp2 = t(K, O, M, scale=1e-150), t(K, O, M, scale=1e-150)
        gp1, ap = g1 * 0.5, a + t(K, H, M, scale=1e-310)
    else:
        raise ValueError(kind)
    mlp = MLP((F, H, O), ("tanh",), "cross_entropy")
    loss = torch.zeros(K, M, dtype=torch.float64)
    cur = Pass((a,), (g1, g2), loss, torch.zeros(K, O, M, dtype=torch.float64))
    prev = Pass((ap,), (gp1, gp2), loss, torch.zeros(K, O, M, dtype=torch.float64))
    return mlp, x, cur, prev


def _ghost_row(x, cur, prev, k, m) -> Fraction:
    """The exact squared norm of the row clipped_sums adds for run k, sample m (difference round):
    layer 1 (g1 - g1') (x, 1)ᵀ, layer 2 (g2 - g2') (a, 1)ᵀ + g2' (a - a', 0)ᵀ, as float64 computes
    the differences."""
    x1 = np.append(x[m].numpy(), 1.0)
    dg1 = (cur.grads[0][k, :, m] - prev.grads[0][k, :, m]).numpy()
    dg2 = (cur.grads[1][k, :, m] - prev.grads[1][k, :, m]).numpy()
    a1 = np.append(cur.inputs[0][k, :, m].numpy(), 1.0)
    da1 = np.append((cur.inputs[0][k, :, m] - prev.inputs[0][k, :, m]).numpy(), 0.0)
    return rank_two_sq_norm(dg1, x1) + rank_two_sq_norm(dg2, a1, prev.grads[1][k, :, m].numpy(),
                                                         da1)


def _as_float32_pass(p: Pass) -> Pass:
    """A pass whose values a float32 forward and backward could give (rounded to float32), in
    float64 as the norms read it (Pass.to64: an exact cast)."""
    def r(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.float32).to(torch.float64)
    return Pass(tuple(r(a) for a in p.inputs), tuple(r(g) for g in p.grads), p.loss, p.outputs)


@pytest.mark.parametrize("kind, dtype", [("cancel", torch.float64), ("near", torch.float64),
                                         ("huge", torch.float64), ("tiny", torch.float64),
                                         ("cancel", torch.float32), ("near", torch.float32)])
def test_ghost_norms_bound_every_true_norm_and_no_clipped_row_leaves_its_ball(kind, dtype):
    """For every run and sample: the upper bound is >= the exact norm, and at radii on the computed
    norm (one per run, targeting one sample each) and at a radius below every norm, the clipped
    row's exact norm is <= C. The computed norm itself is not always >= the exact one. Float32: the
    passes a float32 round gives (its values, read exactly in float64)."""
    mlp, x, cur, prev = _ghost_case(kind, seed=len(kind))
    if dtype == torch.float32:
        x = x.to(torch.float32).to(torch.float64)
        cur, prev = _as_float32_pass(cur), _as_float32_pass(prev)
    K, M = cur.loss.shape
    norms, upper = norm_bounds(mlp, cur, x, (x * x).sum(1), prev)
    exact = [[_ghost_row(x, cur, prev, k, m) for m in range(M)] for k in range(K)]
    for k in range(K):
        for m in range(M):
            assert Fraction(float(upper[k, m])) ** 2 >= exact[k][m], (k, m)
    for radius in ([float(norms[k, k]) for k in range(K)],
                   [math.nextafter(float(norms[k, 2 * k]), 0) for k in range(K)],
                   [float(norms[k].min()) * 0.5 for k in range(K)]):
        rad = torch.tensor(radius, dtype=torch.float64).unsqueeze(-1)
        c = clip_factors(upper, rad)
        for k in range(K):
            r2 = Fraction(radius[k]) ** 2
            for m in range(M):
                assert Fraction(float(c[k, m])) ** 2 * exact[k][m] <= r2, (k, m)


def test_ghost_norms_had_rows_outside_before():
    """Teeth: the cancelling attack with C / N̂ at C = N̂ one ulp down leaves rows above C."""
    mlp, x, cur, prev = _ghost_case("cancel", seed=1, K=6, M=40)
    K, M = cur.loss.shape
    norms, upper = norm_bounds(mlp, cur, x, (x * x).sum(1), prev)
    outside_old = 0
    for k in range(K):
        for m in range(M):
            exact = _ghost_row(x, cur, prev, k, m)
            radius = math.nextafter(float(norms[k, m]), 0)
            r2 = Fraction(radius) ** 2
            old = float(_old_factors(norms[k, m:m + 1], radius)[0])
            outside_old += Fraction(old) ** 2 * exact > r2
            new = float(clip_factors(upper[k, m:m + 1], radius)[0])
            assert Fraction(new) ** 2 * exact <= r2
    assert outside_old > 0


def test_the_bound_costs_nothing_measurable_where_nothing_cancels():
    """Where nothing cancels the bound is within 1e-12 of the norm: clipping at the shrunk radius
    changes a float64 round by less than that."""
    mlp, x, cur, prev = _ghost_case("near", seed=5)
    norms, upper = norm_bounds(mlp, cur, x, (x * x).sum(1), prev)
    assert float((upper / norms).max()) < 1 + 1e-12 and bool((upper >= norms).all())
