"""The DIFF2 estimator (Algorithm 1): degenerate cases, telescoping, noise, schedule, radius."""

from __future__ import annotations

import math

import numpy as np
import pytest

from diff2_flwr.core.estimator import (
    Mechanism,
    difference_radius,
    init_state,
    is_restart,
    plan_round,
    round_noise,
    server_step,
)
from diff2_flwr.core.routines import GD

# f(x) = ½ ||A x - b||² / n: a smooth objective whose gradient we compute by hand.
RNG = np.random.default_rng(7)
A = RNG.standard_normal((40, 5))
B = RNG.standard_normal(40)


def grad_f(x: np.ndarray) -> np.ndarray:
    return A.T @ (A @ x - B) / len(B)


NO_PRIVACY = dict(clip_restart=math.inf, clip_diff=math.inf, sigma_restart=0.0, sigma_diff=0.0)


def run(mechanism: Mechanism, rounds: int, lr: float = 0.1, seed: int | None = 0, x0=None):
    """Drive the estimator with exact (un-clipped) gradient means; return states and releases."""
    routine = GD(lr)
    state = init_state(np.zeros(5) if x0 is None else x0, routine, seed)
    states, releases = [state], []
    for _ in range(rounds):
        plan = plan_round(state, mechanism)
        mean = grad_f(plan.x_current) if plan.restart else grad_f(plan.x_current) - grad_f(
            plan.x_previous)
        state, release = server_step(state, mechanism, routine, mean)
        states.append(state)
        releases.append(release)
    return states, releases


def test_sigma_zero_no_clipping_T1_is_plain_gd_bit_for_bit():
    states, _ = run(Mechanism(restart_every=1, **NO_PRIVACY), rounds=25)
    x = np.zeros(5)
    for r in range(1, 26):
        x = x - 0.1 * grad_f(x)
        np.testing.assert_array_equal(states[r].x, x)


def test_diff2_without_noise_and_clipping_telescopes_to_the_gradient():
    states, releases = run(Mechanism(restart_every=7, **NO_PRIVACY), rounds=30)
    for r, release in enumerate(releases, start=1):
        np.testing.assert_allclose(release.v, grad_f(states[r - 1].x), rtol=1e-10, atol=1e-13)
    # and therefore follows the GD trajectory up to rounding
    gd_states, _ = run(Mechanism(restart_every=1, **NO_PRIVACY), rounds=30)
    np.testing.assert_allclose(states[-1].x, gd_states[-1].x, rtol=1e-10, atol=1e-13)


def test_restart_schedule():
    assert [r for r in range(1, 12) if is_restart(r, 4)] == [1, 5, 9]
    assert all(is_restart(r, 1) for r in range(1, 20))
    with pytest.raises(ValueError):
        is_restart(0, 3)
    mech = Mechanism(restart_every=3, **NO_PRIVACY)
    _, releases = run(mech, rounds=7)
    assert [rel.plan.kind for rel in releases] == ["restart", "difference",
                                                   "difference"] * 2 + ["restart"]
    assert all((rel.plan.x_previous is None) == rel.plan.restart for rel in releases)


def test_difference_radius_hand_worked():
    # x0 = 0; round 1 (restart) mean (3, 4), GD lr 1 -> x1 = (-3, -4); round 2 radius = C2 * 5
    mech = Mechanism(restart_every=5, clip_restart=10.0, clip_diff=2.0, sigma_restart=0.0,
                     sigma_diff=0.0)
    routine = GD(1.0)
    state = init_state(np.zeros(2), routine, seed=0)
    state, _ = server_step(state, mech, routine, np.array([3.0, 4.0]))
    np.testing.assert_array_equal(state.x, [-3.0, -4.0])
    plan = plan_round(state, mech)
    assert (plan.round, plan.kind, plan.radius) == (2, "difference", 10.0)
    np.testing.assert_array_equal(plan.x_previous, [0.0, 0.0])
    np.testing.assert_array_equal(plan.x_current, [-3.0, -4.0])
    # the estimator accumulates: ṽ_2 = ṽ_1 + d_2
    state, release = server_step(state, mech, routine, np.array([1.0, -1.0]))
    np.testing.assert_array_equal(release.v, [4.0, 3.0])
    assert difference_radius(math.inf, np.ones(2), np.ones(2)) == math.inf
    assert difference_radius(3.0, np.ones(2), np.ones(2)) == 0.0


def test_zero_radius_round_adds_no_noise():
    mech = Mechanism(restart_every=5, clip_restart=1.0, clip_diff=1.0, sigma_restart=0.5,
                     sigma_diff=0.5)
    routine = GD(1.0)
    state = init_state(np.zeros(3), routine, seed=3)
    state, _ = server_step(state, mech, routine, np.zeros(3))
    # force x_{r-1} = x_{r-2}: a difference round with radius 0
    state = type(state)(round=state.round, x=state.x, x_prev=state.x, v=state.v, routine_state=None,
                        noise_key=state.noise_key, noise_seeded=True)
    plan = plan_round(state, mech)
    assert plan.radius == 0.0 and plan.noise_std == 0.0
    new, release = server_step(state, mech, routine, np.zeros(3))
    np.testing.assert_array_equal(release.v, state.v)


@pytest.mark.parametrize("restart", [True, False])
def test_noise_only_measured_std_matches_sigma_times_radius(restart):
    """Zero contributions: ṽ is pure noise with std σ·C (restart) or accumulated σ2·C_{2,r}
    noise."""
    d = 20_000
    sigma1, c1, sigma2, c2 = 0.5, 2.0, 0.25, 3.0
    mech = Mechanism(restart_every=10, clip_restart=c1, clip_diff=c2, sigma_restart=sigma1,
                     sigma_diff=sigma2)
    routine = GD(0.1)
    state = init_state(np.zeros(d), routine, seed=1234)
    state, rel1 = server_step(state, mech, routine, np.zeros(d))
    if restart:
        noise, expected = rel1.v, sigma1 * c1
    else:
        plan = plan_round(state, mech)
        assert plan.radius == pytest.approx(c2 * np.linalg.norm(state.x - state.x_prev))
        state, rel2 = server_step(state, mech, routine, np.zeros(d))
        noise, expected = rel2.v - rel1.v, sigma2 * plan.radius
    # std of a sample std with n = 20,000 is ~0.5 %: 3 % is > 5 standard errors
    assert np.std(noise) == pytest.approx(expected, rel=0.03)
    assert abs(np.mean(noise)) < 5 * expected / math.sqrt(d)


def test_noise_is_reproducible_with_a_seed_and_fresh_without():
    mech = Mechanism(restart_every=1, clip_restart=1.0, clip_diff=1.0, sigma_restart=1.0,
                     sigma_diff=1.0)
    a = run(mech, rounds=3, seed=42)[0][-1].x
    b = run(mech, rounds=3, seed=42)[0][-1].x
    c = run(mech, rounds=3, seed=43)[0][-1].x
    d = run(mech, rounds=3, seed=None)[0][-1].x
    e = run(mech, rounds=3, seed=None)[0][-1].x
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert not np.array_equal(d, e)
    # noise depends on (key, round) only, and rounds get different noise
    assert not np.array_equal(round_noise(1, 1, 5, 1.0), round_noise(1, 2, 5, 1.0))
    np.testing.assert_array_equal(round_noise(1, 2, 5, 1.0), round_noise(1, 2, 5, 1.0))


def test_state_is_immutable():
    state = run(Mechanism(restart_every=2, **NO_PRIVACY), rounds=2)[0][-1]
    with pytest.raises(ValueError):
        state.x[0] = 1.0
    with pytest.raises(AttributeError):
        state.round = 5  # type: ignore[misc]


def test_server_step_refuses_bad_means():
    mech = Mechanism(restart_every=1, **NO_PRIVACY)
    routine = GD(0.1)
    state = init_state(np.zeros(3), routine, seed=0)
    with pytest.raises(ValueError, match="shape"):
        server_step(state, mech, routine, np.zeros(4))
    with pytest.raises(ValueError, match="not finite"):
        server_step(state, mech, routine, np.array([0.0, np.nan, 0.0]))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(restart_every=0), "restart_every"),
        (dict(clip_restart=0.0), "clip_restart"),
        (dict(sigma_restart=-1.0), "sigma_restart"),
        (dict(clip_diff=math.inf, sigma_diff=1.0), "unbounded"),
    ],
)
def test_invalid_mechanisms_are_refused(kwargs, match):
    base = dict(restart_every=2, clip_restart=1.0, clip_diff=1.0, sigma_restart=0.1, sigma_diff=0.1)
    with pytest.raises(ValueError, match=match):
        Mechanism(**{**base, **kwargs})
