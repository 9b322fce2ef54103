"""The local routine's ledger, checked against dp-accounting's PLD accountant composing the same
schedule on its own.

An independent ``PLDAccountant(neighboring_relation=REPLACE_ONE)`` is fed the schedule's server
rounds as ``GaussianDpEvent``s and its R (K - 1) local steps as ``PoissonSampledDpEvent(b / n_min,
GaussianDpEvent(σ3·b))`` (by counts; the ledger composes the same events one round at a time, in
release order). Under ``REPLACE_ONE`` the accountant reads ``GaussianDpEvent(m)`` as one record
moving its sum from −1 to +1 (noise std m):

- a local step: one record's term is a or a′ with ‖a‖, ‖a′‖ <= c/b (the sum is divided by the fixed
  b), noise std σ3·c, so m = σ3·c / (c/b) = σ3·b = z3; sampled with probability q_p = b/n_p <=
  b/n_min;
- a server round: ``z`` is std over the replace-one sensitivity 2C/(nP) (the whole move), i.e. the
  pair N(0, z²) vs N(1, z²); in the accountant's −1/+1 convention that is m = 2z.

Getting either convention wrong moves ε far more than the 1 % tolerance (checked below).
"""

from __future__ import annotations

import math

import pytest
from dp_accounting import NeighboringRelation, dp_event
from dp_accounting.pld import pld_privacy_accountant

from diff2_flwr.core.privacy import PrivacyLedger, calibrate, gdp_epsilon

# (ε, δ, R, T, n_min, P, K, b, share): the audit's schedule, and a longer one with K - 1 = 2 steps
# and q = 0.08
SCHEDULES = [
    (3.0, 1e-5, 4, 2, 16, 2, 2, 8, 0.98),
    (3.0, 1e-5, 10, 5, 100, 4, 3, 8, 0.5),
]


def _independent_epsilon(cal, *, server_factor: float = 2.0, local_factor: float = 1.0) -> float:
    """The schedule's ε by dp-accounting alone: m1 restarts, m2 differences, R (K - 1) local steps
    (composition commutes, so composing by counts is the same schedule and costs a few
    self-compositions)."""
    acc = pld_privacy_accountant.PLDAccountant(neighboring_relation=NeighboringRelation.REPLACE_ONE,
                                               value_discretization_interval=1e-4)
    acc.compose(dp_event.GaussianDpEvent(server_factor * cal.z1), cal.restart_rounds)
    if cal.difference_rounds:
        acc.compose(dp_event.GaussianDpEvent(server_factor * cal.z2), cal.difference_rounds)
    local = dp_event.PoissonSampledDpEvent(cal.local.sampling_prob,
                                           dp_event.GaussianDpEvent(local_factor * cal.local.z3))
    acc.compose(local, cal.rounds * (cal.local.steps - 1))
    return acc.get_epsilon(cal.delta)


def _ledger(cal) -> PrivacyLedger:
    """The run's ledger after the whole schedule, recorded as the server records it (one round at a
    time)."""
    ledger = PrivacyLedger(cal.delta)
    for r in range(1, cal.rounds + 1):
        ledger = ledger.record(*cal.round_events((r - 1) % cal.restart_every == 0))
    return ledger


@pytest.fixture(scope="module", params=SCHEDULES,
                ids=lambda s: f"R{s[2]}-T{s[3]}-K{s[6]}-q{s[7] / s[4]:g}")
def schedule(request):
    eps, delta, rounds, period, n_min, clients, steps, b, share = request.param
    cal = calibrate(epsilon=eps, delta=delta, rounds=rounds, restart_every=period, u=1.25,
                    n_min=n_min, clients=clients, local_steps=steps, local_batch_size=b,
                    local_share=share)
    return cal, _ledger(cal), _independent_epsilon(cal)


def test_ledger_agrees_with_an_independent_replace_one_pld_accountant(schedule):
    cal, ledger, independent = schedule
    assert not ledger.exact and ledger.epsilon == ledger.epsilon_pld
    assert ledger.epsilon == pytest.approx(independent, rel=0.01)
    assert cal.planned_epsilon == pytest.approx(independent, rel=0.01)


def test_calibrated_schedule_ends_within_the_budget(schedule):
    cal, ledger, independent = schedule
    assert ledger.epsilon <= cal.epsilon and independent <= cal.epsilon
    assert cal.planned_epsilon <= cal.epsilon
    # and not far below it: σ3 is the smallest noise that fits (bisection to 0.1 %, margin 0.5 %)
    assert ledger.epsilon >= 0.98 * cal.epsilon


def test_either_convention_wrong_by_two_is_outside_the_tolerance(schedule):
    """The check above is not vacuous: halving the local multiplier, or taking the server's z for
    the accountant's m (half the noise in its convention), each moves ε by far more than 1 %."""
    cal, ledger, _ = schedule
    assert _independent_epsilon(cal, local_factor=0.5) > 1.1 * ledger.epsilon
    assert _independent_epsilon(cal, server_factor=1.0) > 1.02 * ledger.epsilon


def test_replace_one_poisson_gaussian_at_q_one_is_the_gaussian_of_twice_the_term():
    """q = 1: every record in every step; ±c/b with std σ3·c is a Gaussian of separation 2c/b, i.e.
    μ = 2 / z3. This pins the reading of dp-accounting's REPLACE_ONE convention that the ledger's
    LocalEvent relies on."""
    z3 = 4.0
    acc = pld_privacy_accountant.PLDAccountant(neighboring_relation=NeighboringRelation.REPLACE_ONE,
                                               value_discretization_interval=1e-4)
    acc.compose(dp_event.PoissonSampledDpEvent(1.0, dp_event.GaussianDpEvent(z3)), 3)
    assert acc.get_epsilon(1e-5) == pytest.approx(gdp_epsilon(math.sqrt(3) * 2 / z3, 1e-5),
                                                  rel=1e-3)
