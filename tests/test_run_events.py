"""A node's charge (RunEvents) and the composition of several runs, checked against dp-accounting on
its own.

The independent reference is ``PLDAccountant(REPLACE_ONE)`` fed each run's events by counts: a
server round of multiplier z (std over the replace-one sensitivity) is ``GaussianDpEvent(2z)`` in
the accountant's −1/+1 reading of replace-one (see tests/test_local_privacy.py), a local step
``PoissonSampledDpEvent(q, GaussianDpEvent(z3))``, composed steps × phases times.

Client-sampled rounds have no dp-accounting event; their reference is exact and needs no PLD. A
sampled round's privacy loss is 0 with probability 1 − π and the Gaussian's L_z with probability π
(:class:`~diff2_flwr.core.accounting.SampledGaussianEvent`), so m such rounds are K ~ Binomial(m, π)
Gaussian rounds, and K Gaussians of multiplier z are exactly √K / z-GDP (Dong, Roth & Su 2019, Cor.
3.3). δ(ε) is linear in the privacy-loss distribution, hence

    δ(ε) = Σ_k P(K = k) δ_GDP(ε; sqrt(μ0² + Σ_j k_j / z_j²)),

summed over the joint counts of every kind of sampled round (μ0² of the full-batch rounds), with
δ_GDP(ε; μ) = Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2) (Cor. 2.13); ε is its root (brentq). dp-accounting's
PLD is pessimistic: it may only be above this, by its discretisation.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from dp_accounting import NeighboringRelation, dp_event
from dp_accounting.pld import pld_privacy_accountant
from scipy.optimize import brentq
from scipy.stats import binom, norm

from diff2_flwr.core.estimator import is_restart
from diff2_flwr.core.privacy import PrivacyLedger, RunEvents, calibrate, composed_epsilon
from diff2_flwr.core.sampling import Sampling

COMMON = dict(u=1.25, n_min=1651, clients=10)


def _independent(runs, delta: float) -> float:
    acc = pld_privacy_accountant.PLDAccountant(neighboring_relation=NeighboringRelation.REPLACE_ONE,
                                               value_discretization_interval=1e-4)
    for run in runs:
        for z, count in run.gaussian:
            acc.compose(dp_event.GaussianDpEvent(2 * z), count)
        for z3, q, steps, phases in run.local:
            acc.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(z3)),
                        steps * phases)
    return acc.get_epsilon(delta)


def _diff2(epsilon: float, rounds: int, period: int):
    return calibrate(epsilon=epsilon, delta=1e-5, rounds=rounds, restart_every=period, **COMMON)


def _local(epsilon: float, rounds: int, period: int, n_min: int, steps: int, b: int, share: float):
    return calibrate(epsilon=epsilon, delta=1e-5, rounds=rounds, restart_every=period, u=1.25,
                     n_min=n_min, clients=4, local_steps=steps, local_batch_size=b,
                     local_share=share)


@pytest.fixture(scope="module")
def server_mix():
    """DIFF2-GD at ε = 3, DP-GD at ε = 1, and a hand-made run of 300 rounds: Gaussian events
    only."""
    return [RunEvents.from_calibration(_diff2(3.0, 2000, 20)),
            RunEvents.from_calibration(_diff2(1.0, 500, 1)), RunEvents(delta=1e-6,
                                                                       gaussian=((40.0, 300),))]


@pytest.fixture(scope="module")
def local_mix():
    """Two runs with a local routine (q = 0.08 and 0.5) and a DP-GD run."""
    return [RunEvents.from_calibration(_local(3.0, 10, 5, 100, 3, 8, 0.5)),
            RunEvents.from_calibration(_local(2.0, 4, 2, 16, 2, 8, 0.98)),
            RunEvents.from_calibration(_diff2(1.0, 200, 1))]


@pytest.mark.parametrize("delta", [1e-5, 1e-7])
def test_server_mix_agrees_with_an_independent_pld_accountant(server_mix, delta):
    ours = composed_epsilon(server_mix, delta)
    assert ours == pytest.approx(_independent(server_mix, delta), rel=0.01)
    # and the mix costs more than any of its runs
    assert ours > max(composed_epsilon([run], delta) for run in server_mix) + 0.5


@pytest.mark.parametrize("delta", [1e-5, 1e-7])
def test_local_mix_agrees_with_an_independent_pld_accountant(local_mix, delta):
    assert local_mix[0].local and local_mix[1].local
    assert composed_epsilon(local_mix, delta) == pytest.approx(_independent(local_mix, delta),
                                                               rel=0.01)


def test_a_calibrated_run_costs_its_calibrated_epsilon():
    """An ``exact`` calibration is calibrated to ε: the charge is ε, never above it by more than the
    PLD's pessimism (1e-3), and within 2 % (a local routine is calibrated to ε (1 - 0.5 %))."""
    for cal in (_diff2(3.0, 2000, 20), _diff2(5.0, 2000, 1), _local(3.0, 10, 5, 100, 3, 8, 0.5)):
        charged = composed_epsilon([RunEvents.from_calibration(cal)], cal.delta)
        assert charged <= cal.epsilon * (1 + 1e-3)
        assert charged == pytest.approx(cal.epsilon, rel=0.02)
        assert RunEvents.from_calibration(cal).epsilon == charged


def test_from_calibration_counts_every_event():
    cal = _local(3.0, 10, 5, 100, 3, 8, 0.5)
    events = RunEvents.from_calibration(cal)
    assert events.delta == cal.delta
    assert events.gaussian == ((cal.z1, 2), (cal.z2, 8))
    assert events.local == ((cal.local.z3, 0.08, 2, 10),)
    assert RunEvents.from_calibration(_diff2(3.0, 50, 1)).gaussian == ((_diff2(3.0, 50, 1).z1, 50),)


def _exact_sampled_delta(epsilon: float, mu0_squared: float, kinds) -> float:
    """δ(ε) of full-batch rounds (μ0²) and client-sampled ones (``kinds``: (z, π, m)), exactly."""
    mu_squared, weight = np.array([mu0_squared]), np.array([1.0])
    for z, pi, m in kinds:
        k = np.arange(m + 1)
        mu_squared = (mu_squared[:, None] + k[None, :] / z**2).ravel()
        weight = (weight[:, None] * binom.pmf(k, m, pi)[None, :]).ravel()
    mu = np.sqrt(mu_squared)
    with np.errstate(divide="ignore", invalid="ignore"):
        gdp = (norm.cdf(-epsilon / mu + mu / 2)
               - math.exp(epsilon) * norm.cdf(-epsilon / mu - mu / 2))
    return float(np.sum(weight * np.where(mu > 0, gdp, 0.0)))


def _exact_sampled_epsilon(runs, delta: float) -> float:
    mu0_squared = sum(count / z**2 for run in runs for z, count in run.gaussian)
    kinds = [k for run in runs for k in run.sampled]
    return brentq(lambda e: _exact_sampled_delta(e, mu0_squared, kinds) - delta, 1e-6, 50,
                  xtol=1e-12)


def _sampled(epsilon: float, rounds: int, period: int, sampling: Sampling, clients: int = 10,
             delta: float = 1e-5):
    return calibrate(epsilon=epsilon, delta=delta, rounds=rounds, restart_every=period, u=1.25,
                     n_min=1651, clients=clients, sampling=sampling)


@pytest.fixture(scope="module")
def sampled_mix():
    """DIFF2 with Poisson sampling (q = 0.3), DIFF2 with a fixed cohort (m = 5 of 20, π = 0.25) and
    DP-GD without sampling."""
    return [RunEvents.from_calibration(_sampled(3.0, 100, 10, Sampling("poisson", rate=0.3))),
            RunEvents.from_calibration(_sampled(2.0, 24, 6, Sampling("fixed", size=5), 20)),
            RunEvents.from_calibration(_diff2(1.0, 200, 1))]


def test_a_sampled_calibration_is_charged_the_events_its_own_ledger_records():
    """The charge of a client-sampled run holds the SampledGaussianEvents its run's ledger records
    over the whole schedule (no full-batch round), and costs what the run's calibration and its own
    ledger say, to 1e-6 (the calibration's: the same PLDs in the same order, so the same bits)."""
    cal = _sampled(3.0, 100, 10, Sampling("poisson", rate=0.3))
    events = RunEvents.from_calibration(cal)
    assert events.gaussian == () and events.local == () and events.delta == cal.delta
    assert events.sampled == ((cal.z1, 0.3, 10), (cal.z2, 0.3, 90))
    ledger = PrivacyLedger(cal.delta)
    for r in range(1, cal.rounds + 1):
        ledger = ledger.record(*cal.round_events(is_restart(r, cal.restart_every)))
    assert ledger.event_counts == tuple(((z, pi, -1), m) for z, pi, m in events.sampled)
    charged = composed_epsilon([events], cal.delta)
    assert charged == cal.planned_epsilon == events.epsilon
    assert charged == pytest.approx(ledger.epsilon, abs=1e-6)
    assert charged == pytest.approx(ledger.epsilon_pld_by_counts, abs=1e-6)
    # amplified: the same noise in every round, unsampled, costs more (ε 4.90 instead of 2.98)
    unsampled = RunEvents(delta=cal.delta, gaussian=tuple((z, m) for z, _, m in events.sampled))
    assert composed_epsilon([unsampled], cal.delta) > 1.6 * charged


@pytest.mark.parametrize("runs", [[0], [0, 2], [0, 1, 2]])
def test_sampled_runs_agree_with_the_exact_binomial_mixture_of_gdp(sampled_mix, runs):
    """A sampled run alone, with an unsampled one, and two sampled runs (π = 0.3 and 0.25) with an
    unsampled one: dp-accounting's ε is at least the exact ε, and above it by its discretisation
    only (measured 5e-8 relative)."""
    chosen = [sampled_mix[i] for i in runs]
    ours, exact = composed_epsilon(chosen, 1e-5), _exact_sampled_epsilon(chosen, 1e-5)
    assert exact * (1 - 1e-9) <= ours <= exact * (1 + 1e-6), (ours, exact)


def test_sampled_composition_is_order_free_and_counts_add(sampled_mix):
    assert composed_epsilon(sampled_mix[::-1], 1e-5) == composed_epsilon(sampled_mix, 1e-5)
    one = RunEvents(delta=1e-5, sampled=((5.0, 0.2, 40),))
    two = RunEvents(delta=1e-5, sampled=((5.0, 0.2, 80),))
    assert composed_epsilon([one, one], 1e-5) == composed_epsilon([two], 1e-5)
    # π = 1 is the full-batch Gaussian (to the PLD's discretisation)
    assert composed_epsilon([RunEvents(delta=1e-5, sampled=((5.0, 1.0, 40),))],
                            1e-5) == pytest.approx(composed_epsilon(
                                [RunEvents(delta=1e-5, gaussian=((5.0, 40),))], 1e-5), rel=1e-4)


def test_composition_is_monotone_and_order_free(server_mix, local_mix):
    runs = server_mix + local_mix
    prefixes = [composed_epsilon(runs[:k], 1e-5) for k in range(len(runs) + 1)]
    assert prefixes[0] == 0.0
    assert all(b > a for a, b in zip(prefixes, prefixes[1:])), prefixes
    assert composed_epsilon(runs[::-1], 1e-5) == pytest.approx(prefixes[-1], rel=1e-12)


def test_twice_one_run_is_one_run_of_twice_the_rounds():
    """Composition by counts: two charges of m rounds equal one of 2m (Gaussian: exactly μ√2)."""
    one = RunEvents(delta=1e-5, gaussian=((20.0, 100),), local=((2.0, 0.1, 3, 5),))
    two = RunEvents(delta=1e-5, gaussian=((20.0, 200),), local=((2.0, 0.1, 3, 10),))
    assert composed_epsilon([one, one], 1e-5) == pytest.approx(composed_epsilon([two], 1e-5),
                                                               rel=1e-9)


def test_degenerate_cases():
    assert composed_epsilon([], 1e-5) == 0.0
    assert composed_epsilon([RunEvents(delta=1e-5)], 1e-5) == 0.0
    assert composed_epsilon([RunEvents(delta=1e-5, gaussian=((0.0, 1),))], 1e-5) == math.inf
    assert composed_epsilon([RunEvents(delta=1e-5, local=((0.0, 0.5, 1, 1),))], 1e-5) == math.inf
    assert composed_epsilon([RunEvents(delta=1e-5, sampled=((0.0, 0.5, 1),))], 1e-5) == math.inf


@pytest.mark.parametrize("kwargs, match", [
    (dict(delta=0.0), r"`delta` must be in \(0, 1\). Found 0.0"),
    (dict(delta=1e-5, gaussian=((-1.0, 3),)),
     "noise multiplier must be a finite number >= 0. Found -1.0"),
    (dict(delta=1e-5, gaussian=((math.inf, 3),)),
     "noise multiplier must be a finite number >= 0. Found inf"),
    (dict(delta=1e-5, gaussian=((2.0, 0),)), "`count` must be an integer >= 1. Found 0"),
    (dict(delta=1e-5, local=((2.0, 1.5, 1, 1),)), r"`q` must be in \(0, 1\]. Found 1.5"),
    (dict(delta=1e-5, local=((2.0, 0.5, 0, 1),)), "`steps` must be an integer >= 1. Found 0"),
    (dict(delta=1e-5, local=((2.0, 0.5, 1, 2.5),)), "`phases` must be an integer >= 1. Found 2.5"),
    (dict(delta=1e-5, sampled=((2.0, 0.0, 3),)),
     r"a sampled event's inclusion probability `π` must be in \(0, 1\]. Found 0.0"),
    (dict(delta=1e-5, sampled=((2.0, True, 3),)), r"`π` must be in \(0, 1\]. Found True"),
    (dict(delta=1e-5, sampled=((-2.0, 0.5, 3),)),
     "a sampled event's noise multiplier must be a finite number >= 0. Found -2.0"),
    (dict(delta=1e-5, sampled=((2.0, 0.5, 0),)), "`count` must be an integer >= 1. Found 0"),
])
def test_invalid_events_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RunEvents(**kwargs)


def test_invalid_delta_of_the_composition_is_refused():
    with pytest.raises(ValueError, match=r"`delta` must be in \(0, 1\). Found 1.0"):
        composed_epsilon([], 1.0)
