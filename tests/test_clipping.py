"""ClippedMean (Algorithm 2): norm bound, zero rows, idempotence, exactness."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from diff2_flwr.core.clipping import (
    clip_rows, clipped_mean, clipped_sum, robust_norm, row_norm_error, row_norms, row_norms_np,
)

from exact_norms import inside as exactly_inside

finite = st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False)
rows_strategy = st.integers(1, 12).flatmap(
    lambda n: st.integers(1, 6).flatmap(lambda d: arrays("float64", (n, d), elements=finite))
)
radius_strategy = st.floats(1e-6, 1e3, allow_nan=False)


@settings(max_examples=200, deadline=None)
@given(rows_strategy, radius_strategy)
def test_clipped_rows_and_mean_have_norm_at_most_radius(rows, radius):
    t = torch.from_numpy(rows)
    clipped, over = clip_rows(t, radius)
    # the true norm of every clipped row (exact, in Fractions) is within the radius: no tolerance
    assert all(exactly_inside(r, radius) for r in clipped.numpy())
    assert float(torch.linalg.vector_norm(clipped_mean(t, radius))) <= radius * (1 + 1e-12)
    # rows inside the ball by more than the norm's error bound are untouched, bit for bit; the
    # others are scaled by at least 1 - 2·bound (a row whose computed norm is within rounding of
    # the radius may be above it: it is clipped at the radius shrunk by the bound)
    rel = row_norm_error(t.shape[1], t.dtype)
    norms = row_norms(t)
    keep = norms * (1 + 2 * rel) <= radius
    assert torch.equal(clipped[keep], t[keep])
    assert torch.equal(over, norms > radius)
    ratio = row_norms(clipped) / torch.where(norms > 0, norms, 1.0)
    assert bool((ratio[~over & ~keep] >= 1 - 4 * rel).all())


@settings(max_examples=200, deadline=None)
@given(rows_strategy, radius_strategy)
def test_clipping_is_idempotent_and_keeps_direction(rows, radius):
    t = torch.from_numpy(rows)
    once, _ = clip_rows(t, radius)
    twice, _ = clip_rows(once, radius)
    torch.testing.assert_close(twice, once, rtol=1e-12, atol=0)
    # a clipped row is a non-negative multiple of the original row
    dots = (once * t).sum(dim=1)
    assert bool((dots >= 0).all())


def test_zero_rows_stay_exactly_zero_for_any_radius():
    t = torch.zeros(3, 4, dtype=torch.float64)
    for radius in (0.0, 1e-300, 1.0, math.inf):
        clipped, over = clip_rows(t, radius)
        assert torch.equal(clipped, t) and not bool(over.any())


def test_clipped_mean_hand_worked():
    # rows of norm 5 and 0.5; C = 1: the first is scaled to norm 1, the second kept
    t = torch.tensor([[3.0, 4.0], [0.3, 0.4]], dtype=torch.float64)
    expected = (torch.tensor([0.6, 0.8],
                             dtype=torch.float64) + torch.tensor([0.3, 0.4],
                                                                 dtype=torch.float64)) / 2
    torch.testing.assert_close(clipped_mean(t, 1.0), expected, rtol=0, atol=1e-15)
    result = clipped_sum(t, 1.0)
    assert (result.count, result.clipped) == (2, 1)


def test_radius_zero_maps_everything_to_zero_and_inf_clips_nothing():
    t = torch.tensor([[3.0, 4.0], [0.0, 0.0]], dtype=torch.float64)
    assert torch.equal(clip_rows(t, 0.0)[0], torch.zeros_like(t))
    assert torch.equal(clip_rows(t, math.inf)[0], t)


def test_replacing_one_row_moves_the_mean_by_at_most_2c_over_n():
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(50, 7, generator=gen, dtype=torch.float64) * 10
    b = a.clone()
    b[17] = torch.randn(7, generator=gen, dtype=torch.float64) * 1000
    shift = torch.linalg.vector_norm(clipped_mean(a, 2.0) - clipped_mean(b, 2.0))
    assert float(shift) <= 2 * 2.0 / 50 * (1 + 1e-12)


@pytest.mark.parametrize("radius", [-1.0, math.nan])
def test_invalid_radius_is_refused(radius):
    with pytest.raises(ValueError, match="radius"):
        clip_rows(torch.ones(2, 2), radius)


def test_empty_set_is_refused():
    with pytest.raises(ValueError, match="empty"):
        clipped_mean(torch.zeros(0, 3), 1.0)


def test_rows_whose_squares_underflow_or_overflow_are_clipped_all_the_same():
    """A row of norm 1e-170 squares to 0 (it passed radius 1e-200 unclipped); one of norm 1e200
    squares to inf (it was clipped to 0 and counted as an overflow). Both are clipped onto the ball
    (but where C/‖row‖ < 1e-300 rounds to 0: the row becomes 0, inside the ball); a zero row stays
    zero."""
    t = torch.tensor([[1e-170, 1e-170], [3e-171, -4e-171], [1e200, -1e200], [1e-310, 0.0], [0.0,
                                                                                            0.0]],
                     dtype=torch.float64)
    exact = torch.tensor([robust_norm(r) for r in t.numpy()], dtype=torch.float64)
    torch.testing.assert_close(row_norms(t), exact, rtol=1e-15, atol=0)
    assert exact[0] > 1e-170 and exact[4] == 0  # the reference is not fooled either
    for radius in (1e-200, 1.0):
        clipped, over = clip_rows(t, radius)
        assert over.tolist() == [radius < 1e-170, radius < 1e-170, True, radius < 1e-310, False]
        norms = torch.tensor([robust_norm(r) for r in clipped.numpy()], dtype=torch.float64)
        # beyond, C/‖row‖ underflows to 0: the row is clipped to 0
        onto = over & (exact < radius * 1e300)
        torch.testing.assert_close(norms[onto], torch.full_like(norms[onto], radius), rtol=1e-14,
                                   atol=0)
        assert all(exactly_inside(r, radius) for r in clipped.numpy())
        assert torch.equal(clipped[~over], t[~over])
        assert clipped_sum(t, radius).nonfinite == 0


extreme_rows = st.integers(1, 8).flatmap(lambda n: st.integers(1, 6).flatmap(lambda d: st.tuples(
    arrays("float64", (n, d), elements=st.floats(-10, 10, allow_nan=False)),
    arrays("float64", (n, 1), elements=st.floats(-300, 300, allow_nan=False)))))


@settings(max_examples=300, deadline=None)
@given(extreme_rows, st.floats(-300, 300, allow_nan=False))
def test_clipped_rows_have_norm_at_most_radius_at_any_magnitude(rows, log_radius):
    """Rows of norms 1e-300 to 1e300 (each row its own magnitude), radii 1e-300 to 1e300: clipped
    rows are within the radius (by the scaled norm; to float64 rounding, as the bound of the first
    property test), rows inside it are untouched, and no norm is lost to underflow or overflow (the
    row_norms equal numpy-scaled ones)."""
    mantissa, exponent = rows
    t = torch.from_numpy(mantissa * 10.0 ** exponent)
    radius = 10.0 ** log_radius
    exact = torch.tensor([robust_norm(r) for r in t.numpy()], dtype=torch.float64)
    torch.testing.assert_close(row_norms(t), exact, rtol=1e-14, atol=0)
    clipped, over = clip_rows(t, radius)
    assert torch.equal(over, exact > radius)
    assert all(exactly_inside(r, radius) for r in clipped.numpy())
    keep = exact * (1 + 2 * row_norm_error(t.shape[1], t.dtype)) <= radius
    assert torch.equal(clipped[keep], t[keep])


def test_a_subnormal_clip_factor_never_takes_a_row_above_the_radius():
    """‖a‖ / C > 2^1022: C/‖a‖ is subnormal (few bits), so a row times it rounded to nearest could
    exceed C (by 1e-5 relative for 1e13 at radius 1e-300, which hypothesis found); clip_rows goes
    through the unit sphere, and the factor the sum paths use (clip_factors) is taken one step
    toward 0."""
    from diff2_flwr.core.clipping import clip_factors

    for value, radius in ((1e13, 1e-300), (2.90464295e84, 1e-228), (1e231, 1e-86), (3e300, 1e-10)):
        row = torch.tensor([[value]], dtype=torch.float64)
        clipped, over = clip_rows(row, radius)
        assert bool(over.all()) and exactly_inside(clipped.numpy()[0], radius)
        c = clip_factors(row[:, 0], radius)
        assert float(c[0]) * value <= radius and float(c[0]) > 0
    normal = torch.tensor([4.0, 0.5, 1e200], dtype=torch.float64)
    # a factor is C / N rounded and then one step toward 0: never above C / N, within 2 ulp of it
    got = clip_factors(normal, 1.0).tolist()
    assert got == [math.nextafter(0.25, 0), 1.0, math.nextafter(1.0 / 1e200, 0)]
    assert all(Fraction(c) * Fraction(n) <= 1 for c, n in zip(got, normal.tolist()))


def test_the_numpy_row_norms_agree_with_the_torch_ones_at_every_magnitude():
    """``row_norms_np`` (the batched engine's worker step, on small arrays) is ``row_norms`` to
    rounding: ordinary rows, rows whose squares underflow or overflow, zero, inf and NaN rows."""
    rng = np.random.default_rng(5)
    rows = rng.normal(size=(40, 9)) * 10.0 ** rng.uniform(-320, 300, size=(40, 1))
    rows = np.vstack([rows, [[1e-170] * 9, [1e200] + [0.0] * 8, [1e-310] + [0.0] * 8, [0.0] * 9,
                             [np.inf] + [0.0] * 8, [np.nan] + [1.0] * 8]])
    got, want = row_norms_np(rows), row_norms(torch.as_tensor(rows)).numpy()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    finite = ~np.isnan(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-14, atol=0)
    assert (got[:40] > 0).all() and got[-6] > 1e-170 and got[-5] == 1e200 and got[-3] == 0 and got[
        -2] == np.inf


def test_a_radius_below_the_floor_is_refused_everywhere_it_enters():
    """``diff2 audit --engines`` found that with C/n subnormal a record's clipped contribution
    rounded to 5x C: the engines, the server's round plan and the configuration refuse such
    radii."""
    from diff2_flwr.core.clipping import RADIUS_FLOOR, check_radius
    from diff2_flwr.core.estimator import Diverged, round_scale
    from diff2_flwr.core.gradients import PerSampleGradients
    from diff2_flwr.runtime.config import TrainingConfig
    from diff2_flwr.runtime.spec import Invalid

    for ok in (0.0, RADIUS_FLOOR, 1.0, math.inf):
        check_radius(ok)
    for bad in (RADIUS_FLOOR / 2, 1e-322, 5e-324):
        with pytest.raises(ValueError, match=r"is below 1.18e-271: .* releases nothing\.$"):
            check_radius(bad)
    grads = PerSampleGradients(torch.nn.Linear(3, 1).double(), lambda o, t: (o[:, 0] - t) ** 2)
    x = np.zeros(4)
    with pytest.raises(ValueError, match="is below"):
        grads.clipped_mean(x, torch.ones(5, 3, dtype=torch.float64),
                           torch.ones(5, dtype=torch.float64), 1e-300)
    with pytest.raises(Diverged, match=r"restart round's clipping radius 1e-300 is below"):
        round_scale(1, True, 1e-300, 1.0, x, None)
    assert round_scale(2, False, 3.0, 1.0, x, x) == (0.0, 0.0)  # equal iterates: radius 0 is exact
    with pytest.raises(Invalid, match=r"key `clip_restart`: expected a number >= 1.2e-271"):
        TrainingConfig(clip_restart=1e-300)
    assert TrainingConfig(clip_restart=1e-270).clip_restart == 1e-270
