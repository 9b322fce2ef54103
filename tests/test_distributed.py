"""The privacy of a DIFF2 schedule under distributed Skellam noise (diff2_flwr/core/distributed.py):
its ε against dp-accounting's RDP accountant and against the exact Rényi divergence of the Skellam
distribution (within 1 % on two schedules, and never below either), its calibration, and each
client's share of the noise."""

from __future__ import annotations

import math

import numpy as np
import pytest

from diff2_flwr.core import skellam as sk
from diff2_flwr.core.calibration import calibrate
from diff2_flwr.core.distributed import (SkellamEvent, calibrate_distributed, client_variance,
                                         schedule_epsilon, schedule_rdp)
from test_skellam import _exact_rdp_1d

DELTA = 1e-5
# rho = 8.5: the smallest integer sensitivity is 2ρ = 17 = ‖(17)‖ = ‖(15, 8)‖, an integer shift the
# exact divergence can be computed for
RHO, PADDED = 8.5, 128
SCHEDULES = [dict(rounds=100, restart_every=10), dict(rounds=40, restart_every=4)]


@pytest.mark.parametrize("schedule", SCHEDULES, ids=["R100-T10", "R40-T4"])
def test_the_schedules_epsilon_is_within_one_percent_of_two_independent_computations(schedule):
    cal = calibrate_distributed(epsilon=3.0, delta=DELTA, u=1.25, rho=RHO, padded_dim=PADDED,
                                **schedule)
    ours = schedule_epsilon(cal.events(), DELTA)
    assert ours == pytest.approx(3.0,
                                 rel=1e-9) and ours <= 3.0 + 1e-12 and cal.epsilon_spent == ours

    # 1. dp-accounting's RDP accountant on the Gaussian mechanisms of the same multipliers (no
    #    discretisation)
    from dp_accounting import dp_event
    from dp_accounting.rdp import rdp_privacy_accountant

    accountant = rdp_privacy_accountant.RdpAccountant(orders=list(sk.RDP_ORDERS))
    accountant.compose(dp_event.GaussianDpEvent(cal.z1), cal.restart_rounds)
    accountant.compose(dp_event.GaussianDpEvent(cal.z2), cal.difference_rounds)
    gaussian = accountant.get_epsilon(DELTA)
    assert gaussian <= ours <= 1.01 * gaussian

    # 2. the exact Rényi divergence of Skellam noise of each round's variance, shifted by an integer
    #    vector of norm 2ρ, composed over the schedule (orders up to 64: the best order for these
    #    schedules is below)
    orders = [a for a in sk.RDP_ORDERS if a <= 64]
    exact = []
    for a in orders:
        per_round = {z: sum(_exact_rdp_1d(a, s,
                                          (z * 2 * RHO) ** 2) for s in (15, 8)) for z in (cal.z1,
                                                                                          cal.z2)}
        exact.append(cal.restart_rounds * per_round[cal.z1] + cal.difference_rounds * per_round[
            cal.z2])
    truth = sk.rdp_to_epsilon(exact, orders, DELTA)
    ours_on_those_orders = sk.rdp_to_epsilon(schedule_rdp(cal.events(), orders), orders, DELTA)
    assert ours_on_those_orders == pytest.approx(ours, rel=1e-12)  # the best order is among them
    assert truth <= ours <= 1.01 * truth


def test_calibration_splits_the_budget_by_u_and_needs_a_little_more_noise_than_central_exact():
    cal = calibrate_distributed(epsilon=3.0, delta=DELTA, rounds=100, restart_every=10, u=1.25,
                                rho=RHO, padded_dim=PADDED)
    assert (cal.restart_rounds, cal.difference_rounds) == (10, 90)
    restart_share = cal.restart_rounds / cal.z1**2
    difference_share = cal.difference_rounds / cal.z2**2
    assert difference_share / restart_share == pytest.approx(0.25, rel=1e-12)  # (u - 1) : 1
    central = calibrate(epsilon=3.0, delta=DELTA, rounds=100, restart_every=10, u=1.25, n_min=100,
                        clients=2)
    # RDP's conversion and the surcharge: a few % more noise
    assert 1.0 < cal.z1 / central.z1 < 1.15
    looser = calibrate_distributed(epsilon=6.0, delta=DELTA, rounds=100, restart_every=10, u=1.25,
                                   rho=RHO, padded_dim=PADDED)
    assert looser.z1 < cal.z1 and looser.z2 < cal.z2
    dpgd = calibrate_distributed(epsilon=3.0, delta=DELTA, rounds=10, restart_every=1, u=1.25,
                                 rho=RHO, padded_dim=PADDED)
    assert dpgd.z2 is None and len(dpgd.events()) == 10 and dpgd.epsilon_spent == pytest.approx(
        3.0, rel=1e-9)
    with pytest.raises(ValueError, match="no difference rounds"):
        dpgd.event(restart=False)


def test_every_round_is_bounded_whatever_its_radius():
    """The event's RDP is Corollary 3.6 at the smallest sensitivity 2ρ; a round of larger radius has
    a larger Δ₂ and proportionally more noise, and its bound is never above the event's."""
    event = SkellamEvent(4.0, RHO, PADDED, "difference")
    for order in (2, 8, 32, 256):
        for l2 in (2 * RHO, 2 * RHO + 0.5, 40.0, 1e3, 1e6):
            l1 = min(math.sqrt(PADDED) * l2, l2 * l2)
            assert sk.skellam_rdp(order, l1, l2, (4.0 * l2) ** 2) <= event.rdp(order) * (1 + 1e-12)
        # above the Gaussian's: the surcharge is counted
        assert event.rdp(order) > order / (2 * 4.0**2)


def test_each_clients_share_leaves_the_honest_survivors_enough_noise():
    # P = 10, t = 2: any 8 honest shares add up to (zΔ₂)², measured on draws
    z, l2, p, t = 3.0, 20.0, 10, 2
    share = client_variance(z, l2, p, t)
    assert share == pytest.approx((z * l2) ** 2 / 8)
    rng = np.random.default_rng(0)
    honest = sum(sk.skellam_noise(200_000, share, rng) for _ in range(p - t))
    assert honest.var() == pytest.approx((z * l2) ** 2, rel=5 * math.sqrt(2 / 200_000))
    with pytest.raises(ValueError, match=r"`tolerated` .* \[0, 9\]\. Found 10"):
        client_variance(z, l2, p, p)


@pytest.mark.parametrize("kwargs,match", [
    (dict(epsilon=0.0), "`epsilon`"), (dict(delta=1.0), "`delta`"), (dict(u=1.0), "`u`"),
    (dict(rounds=0), "rounds"),
])
def test_calibration_refuses_bad_arguments(kwargs, match):
    args = dict(epsilon=3.0, delta=DELTA, rounds=10, restart_every=5, u=1.25, rho=RHO,
                padded_dim=PADDED)
    with pytest.raises(ValueError, match=match):
        calibrate_distributed(**{**args, **kwargs})
