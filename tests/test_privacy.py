"""Calibration and accounting, checked against Google's dp-accounting (an independent
accountant)."""

from __future__ import annotations

import math

import pytest
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from diff2_flwr.core.privacy import (
    GaussianEvent,
    PrivacyLedger,
    calibrate,
    count_rounds,
    gdp_delta,
    gdp_epsilon,
    gdp_mu,
    noise_multiplier,
    zcdp_rho,
)

# z = noise std / replace-one sensitivity, so each round is a Gaussian mechanism with unit
# sensitivity and std z: exactly what GaussianDpEvent(z) describes.


def pld_epsilon(cal, delta: float) -> float:
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(dp_event.GaussianDpEvent(cal.z1), cal.restart_rounds)
    if cal.difference_rounds:
        acc.compose(dp_event.GaussianDpEvent(cal.z2), cal.difference_rounds)
    return acc.get_epsilon(delta)


def rdp_epsilon(cal, delta: float) -> float:
    acc = rdp_privacy_accountant.RdpAccountant()
    acc.compose(dp_event.GaussianDpEvent(cal.z1), cal.restart_rounds)
    if cal.difference_rounds:
        acc.compose(dp_event.GaussianDpEvent(cal.z2), cal.difference_rounds)
    return acc.get_epsilon(delta)


CASES = [
    # (epsilon, delta, R, T, u)
    (3.0, 1e-5, 2000, 1, 1.25),
    (3.0, 1e-5, 2000, 20, 1.25),
    (5.0, 1e-5, 2000, 6, 1.25),
    (1.0, 1e-6, 500, 50, 2.0),
    (8.0, 1e-5, 100, 3, 1.1),
    (0.5, 1e-3, 37, 10, 1.5),
]


def test_spec_reference_multipliers():
    """DIFF2.md: DP-GD z = 62.19 (rdp 75.92); DIFF2-GD T=20, u=1.25: z1 = 15.55, z2 = 135.5."""
    common = dict(epsilon=3.0, delta=1e-5, rounds=2000, u=1.25, n_min=1651, clients=10)
    assert calibrate(restart_every=1, mode="exact", **common).z1 == pytest.approx(62.19, abs=0.005)
    assert calibrate(restart_every=1, mode="rdp", **common).z1 == pytest.approx(75.92, abs=0.005)
    diff2 = calibrate(restart_every=20, mode="exact", **common)
    assert diff2.z1 == pytest.approx(15.55, abs=0.005)
    assert diff2.z2 == pytest.approx(135.5, abs=0.05)
    assert (diff2.restart_rounds, diff2.difference_rounds) == (100, 1900)
    # sigma is the std per unit radius: z = sigma * n_min * P / 2
    assert noise_multiplier(diff2.sigma1, 1651, 10) == pytest.approx(diff2.z1, rel=1e-12)
    assert noise_multiplier(diff2.sigma2, 1651, 10) == pytest.approx(diff2.z2, rel=1e-12)


@pytest.mark.parametrize("epsilon,delta,rounds,T,u", CASES)
def test_exact_mode_spends_the_target_per_independent_pld(epsilon, delta, rounds, T, u):
    cal = calibrate(epsilon=epsilon, delta=delta, rounds=rounds, restart_every=T, u=u, n_min=1000,
                    clients=7, mode="exact")
    eps = pld_epsilon(cal, delta)
    # PLD discretisation is pessimistic by ~1e-7 relative here; 1e-4 is far below any meaningful
    # slack
    assert eps <= epsilon * (1 + 1e-4)
    assert eps >= epsilon * 0.99  # tight: within 1 % of the target
    assert cal.epsilon_spent(cal.restart_rounds, cal.difference_rounds) == pytest.approx(epsilon,
                                                                                         rel=1e-9)


@pytest.mark.parametrize("epsilon,delta,rounds,T,u", CASES)
def test_rdp_mode_is_private_and_noisier_than_exact(epsilon, delta, rounds, T, u):
    kw = dict(epsilon=epsilon, delta=delta, rounds=rounds, restart_every=T, u=u, n_min=1000,
              clients=7)
    rdp, exact = calibrate(mode="rdp", **kw), calibrate(mode="exact", **kw)
    assert pld_epsilon(rdp, delta) <= epsilon
    assert rdp_epsilon(rdp, delta) <= epsilon
    assert rdp.z1 > exact.z1
    if T > 1:
        assert rdp.z2 > exact.z2


@pytest.mark.parametrize("epsilon,delta,rounds,T,u", CASES)
def test_budget_split_by_u(epsilon, delta, rounds, T, u):
    cal = calibrate(epsilon=epsilon, delta=delta, rounds=rounds, restart_every=T, u=u, n_min=10,
                    clients=2)
    m1, m2 = count_rounds(rounds, T)
    assert (cal.restart_rounds, cal.difference_rounds) == (m1, m2)
    if m2 == 0:
        assert m1 / cal.z1**2 == pytest.approx(cal.budget, rel=1e-12)
        assert cal.z2 is None and cal.sigma2 is None
    else:
        assert m1 / cal.z1**2 == pytest.approx(cal.budget / u, rel=1e-12)
        assert m2 / cal.z2**2 == pytest.approx(cal.budget * (u - 1) / u, rel=1e-12)


def test_count_rounds_hand_worked():
    assert count_rounds(10, 3) == (4, 6)  # restarts at 1, 4, 7, 10
    assert count_rounds(10, 1) == (10, 0)
    assert count_rounds(10, 10) == (1, 9)


def test_gdp_delta_epsilon_round_trip_and_monotonicity():
    for mu in (0.1, 0.7191, 2.0, 5.0):
        for delta in (1e-8, 1e-5, 1e-2):
            eps = gdp_epsilon(mu, delta)
            assert gdp_delta(eps, mu) == pytest.approx(delta, rel=1e-8)
            assert gdp_mu(eps, delta) == pytest.approx(mu, rel=1e-8) if eps > 0 else True
    assert gdp_delta(1.0, 0.5) < gdp_delta(1.0, 1.0)
    assert gdp_delta(1.0, 1.0) > gdp_delta(2.0, 1.0)


def test_gdp_delta_matches_the_analytic_gaussian_formula_at_a_known_point():
    # μ = 1, ε = 0: δ = Φ(1/2) - Φ(-1/2) = 0.38292492254802624
    assert gdp_delta(0.0, 1.0) == pytest.approx(0.38292492254802624, rel=1e-12)


def test_zcdp_rho_inverts_the_conversion():
    rho = zcdp_rho(3.0, 1e-5)
    assert rho + 2 * math.sqrt(rho * math.log(1e5)) == pytest.approx(3.0, rel=1e-12)


def test_ledger_composes_events_like_pld():
    cal = calibrate(epsilon=3.0, delta=1e-5, rounds=60, restart_every=6, u=1.25, n_min=500,
                    clients=4)
    ledger = PrivacyLedger(1e-5)
    for r in range(1, 31):  # half of the schedule: 5 restarts, 25 differences
        restart = (r - 1) % 6 == 0
        ledger = ledger.record(GaussianEvent(cal.z1 if restart else cal.z2,
                                             "restart" if restart else "difference"))
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(dp_event.GaussianDpEvent(cal.z1), 5)
    acc.compose(dp_event.GaussianDpEvent(cal.z2), 25)
    assert ledger.epsilon == pytest.approx(acc.get_epsilon(1e-5), rel=1e-3)
    assert 0 < ledger.epsilon < 3.0
    assert PrivacyLedger(1e-5).epsilon == 0.0
    assert math.isinf(PrivacyLedger(1e-5).record(GaussianEvent(0.0, "restart")).epsilon)


@pytest.mark.parametrize("rounds,restart_every", [(120, 6), (60, 1), (10, 5)])
def test_ledger_per_round_pld_agrees_with_the_closed_form(rounds, restart_every):
    """Every round (not only the last): exact GDP vs dp-accounting's PLD within 1 %, PLD never below
    it by more than float noise (it is pessimistic), and RDP at least as large (looser)."""
    cal = calibrate(epsilon=3.0, delta=1e-5, rounds=rounds, restart_every=restart_every, u=1.25,
                    n_min=300, clients=5)
    ledger = PrivacyLedger(1e-5)
    for r in range(1, rounds + 1):
        restart = (r - 1) % restart_every == 0
        ledger = ledger.record(GaussianEvent(cal.z1 if restart else cal.z2,
                                             "restart" if restart else "difference"))
        exact, pld, rdp = ledger.epsilon, ledger.epsilon_pld, ledger.epsilon_rdp
        assert pld == pytest.approx(exact, rel=0.01, abs=1e-9), r
        assert pld >= exact * (1 - 1e-6) and rdp >= exact, r
    assert exact == pytest.approx(3.0, rel=1e-9)


def test_incremental_pld_equals_a_fresh_composition_and_a_resumed_ledger():
    """The per-round PLD (one composition per round) equals dp-accounting composing all events at
    once, and a ledger rebuilt from its events (a checkpoint) reproduces the incremental value bit
    for bit."""
    from diff2_flwr.core import privacy

    cal = calibrate(epsilon=2.0, delta=1e-6, rounds=40, restart_every=8, u=1.5, n_min=200,
                    clients=3)
    ledger = PrivacyLedger(1e-6)
    values = []
    for r in range(1, 41):
        ledger = ledger.record(GaussianEvent(cal.z1 if (r - 1) % 8 == 0 else cal.z2, "x"))
        values.append(ledger.epsilon_pld)
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(dp_event.GaussianDpEvent(cal.z1), 5)
    acc.compose(dp_event.GaussianDpEvent(cal.z2), 35)
    assert values[-1] == pytest.approx(acc.get_epsilon(1e-6), rel=1e-6)
    assert values == sorted(values)  # ε spent never decreases
    privacy.PLD_MEMO.clear()  # no cached value: the rebuilt ledger composes from its first event
    rebuilt = PrivacyLedger(1e-6, ledger.events[:25])
    assert rebuilt.epsilon_pld == values[24]
    assert rebuilt.record(ledger.events[25]).epsilon_pld == values[25]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(epsilon=0.0), r"`epsilon` must be a finite number > 0\. Found 0\.0"),
        (dict(epsilon=-1.0), r"`epsilon`.*Found -1\.0"),
        (dict(delta=1.0), r"`delta` must be in \(0, 1\)\. Found 1\.0"),
        (dict(delta=0.0), r"`delta`.*Found 0\.0"),
        (dict(u=1.0), r"`u` must be a finite number > 1.*Found 1\.0"),
        (dict(restart_every=0), r"`restart_every` must be an integer >= 1\. Found 0"),
        (dict(n_min=0), r"`n_min`.*Found 0"),
        (dict(mode="moments"), r"`mode` must be one of"),
    ],
)
def test_invalid_calibration_inputs_are_refused(kwargs, match):
    base = dict(epsilon=3.0, delta=1e-5, rounds=100, restart_every=10, u=1.25, n_min=100,
                clients=10, mode="exact")
    with pytest.raises(ValueError, match=match):
        calibrate(**{**base, **kwargs})


def test_u_is_irrelevant_without_difference_rounds():
    a = calibrate(epsilon=3.0, delta=1e-5, rounds=100, restart_every=1, u=1.0, n_min=100,
                  clients=10)
    b = calibrate(epsilon=3.0, delta=1e-5, rounds=100, restart_every=1, u=7.0, n_min=100,
                  clients=10)
    assert a.z1 == b.z1


def test_a_ledger_by_counts_agrees_with_the_accountant_and_is_within_its_plan_only_when_it_is():
    """The budget guard's bound: a whole schedule's PLD by counts equals dp-accounting's
    PLDAccountant composing the same counts, and agrees with the round-by-round composition;
    ``within`` holds exactly for sub-ledgers."""
    cal = calibrate(epsilon=3.0, delta=1e-5, rounds=60, restart_every=6, u=1.25, n_min=300,
                    clients=5)
    z1, z2 = GaussianEvent(cal.z1, "restart"), GaussianEvent(cal.z2, "difference")
    plan = PrivacyLedger(1e-5, (z1,) * 10 + (z2,) * 50)
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(dp_event.GaussianDpEvent(cal.z1), 10)
    acc.compose(dp_event.GaussianDpEvent(cal.z2), 50)
    assert plan.epsilon_pld_by_counts == pytest.approx(acc.get_epsilon(1e-5), rel=1e-6)
    assert plan.epsilon_pld_by_counts == pytest.approx(plan.epsilon_pld, rel=1e-6)
    assert plan.epsilon_pld_by_counts == pytest.approx(3.0, rel=0.01)
    interleaved = PrivacyLedger(1e-5, ((z1,) + (z2,) * 5) * 10)  # release order does not matter
    assert interleaved.within(plan) and plan.within(interleaved)
    assert PrivacyLedger(1e-5, (z1,) * 3 + (z2,) * 7).within(plan)
    assert not PrivacyLedger(1e-5, (z1,) * 11).within(plan)  # one restart more than planned
    # other noise
    assert not PrivacyLedger(1e-5, (GaussianEvent(cal.z2 * 0.99, "difference"),)).within(plan)
    assert not PrivacyLedger(1e-6, (z1,)).within(plan)  # another δ
    assert PrivacyLedger(1e-5).epsilon_pld_by_counts == 0.0
