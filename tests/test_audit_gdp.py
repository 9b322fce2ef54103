"""The audit's μ-GDP estimate: its interval covers μ as often as it says, its test flags a correct
mechanism no more often than its level and a √2 mistake almost always, the power it states is the
power it has, and on the real path it tells a mechanism with 0.7 of the calibrated noise from the
calibrated one in both directions.

Seeded; the tolerances are binomial (a rate of p over m repetitions within 4·(p(1 − p)/m)^½ + 1/m).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from diff2_flwr.core.calibration import gdp_epsilon, gdp_mu
from diff2_flwr.lab.audit.runner import AuditSpec, run_audit
from diff2_flwr.lab.audit.gdp import detectable_noise_scale, gaussian_checks, gdp_audit, mu_interval

EPSILON, DELTA = 3.0, 1e-5
MU = gdp_mu(EPSILON, DELTA)


def _scores(rng: np.random.Generator, mu: float, n: int) -> tuple[np.ndarray, np.ndarray]:
    """LR scores of a μ-GDP pair in the claimed units (noise k = MU/mu times the calibrated):
    N(±MU²/2, (MU/mu·…)²)."""
    sd = MU * MU / mu
    return rng.normal(MU**2 / 2, sd, n), rng.normal(-MU**2 / 2, sd, n)


def _within(rate: float, p: float, m: int) -> bool:
    return abs(rate - p) <= 4 * math.sqrt(p * (1 - p) / m) + 1 / m


def test_the_interval_covers_mu_as_often_as_it_says():
    rng = np.random.default_rng(101)
    reps, n, a = 600, 500, 0.05
    below = above = 0
    for _ in range(reps):
        d, dp = _scores(rng, MU, n)
        sd = math.sqrt((np.var(d, ddof=1) + np.var(dp, ddof=1)) / 2)
        lo, hi = mu_interval(float((d.mean() - dp.mean()) / sd), n, n, a)
        below += MU < lo
        above += MU > hi
    assert _within(below / reps, a, reps) and _within(above / reps, a, reps)


def test_mu_interval_edges():
    lo, hi = mu_interval(-0.1, 100, 100, 0.05)  # no separation: the lower bound is 0, not negative
    assert lo == 0.0 and 0 < hi < 0.3
    lo, hi = mu_interval(MU, 10_000, 10_000, 0.0005)
    se = math.sqrt(2 / 10_000 + MU**2 / (4 * 2 * 10_000))  # the delta method's standard error
    assert lo == pytest.approx(MU - 3.2905 * se,
                               abs=0.002) and hi == pytest.approx(MU + 3.2905 * se, abs=0.002)


@pytest.mark.parametrize("k,expected", [(1.0, 0.05), (0.7, 1.0)])
def test_the_test_flags_a_correct_mechanism_at_its_level_and_a_sqrt2_mistake_always(k, expected):
    """At level a = 0.05 and 1,000 trials (so that the false-flag rate is measurable): a mechanism
    exactly at the claim is flagged at rate a, not more; one with 0.7 of the noise nearly always."""
    rng = np.random.default_rng(202 if k == 1 else 203)
    reps, flags = 400, 0
    for _ in range(reps):
        d, dp = _scores(rng, MU / k, 1000)
        out = gdp_audit(d, dp, epsilon_claimed=EPSILON, delta=DELTA, a=0.05, mu_run=MU,
                        mu_claimed=MU)
        flags += out["violation"]
    assert _within(flags / reps, expected, reps) if k == 1 else flags >= reps - 1


def test_the_stated_power_is_the_power_it_has():
    rng = np.random.default_rng(303)
    n, a = 1000, 0.0005
    k = detectable_noise_scale(MU, MU, n, a)
    assert 0.7 < k < 0.8  # 1,000 trials: a √2 mistake is within reach, a 10 % one is not
    reps = 400
    flags = sum(gdp_audit(*_scores(rng, MU / k, n), epsilon_claimed=EPSILON, delta=DELTA, a=a,
                          mu_run=MU, mu_claimed=MU)["violation"] for _ in range(reps))
    assert _within(flags / reps, 0.95, reps)
    assert detectable_noise_scale(MU, MU, 10_000, a) > 0.9  # the default trial count reaches 0.9x


def test_epsilon_of_the_estimate_is_the_gdp_conversion():
    rng = np.random.default_rng(404)
    out = gdp_audit(*_scores(rng, MU, 5000), epsilon_claimed=EPSILON, delta=DELTA, a=0.0005,
                    mu_run=MU, mu_claimed=MU)
    assert out["epsilon"] == pytest.approx(gdp_epsilon(out["mu"], DELTA), rel=1e-12)
    lo, hi = out["mu_interval"]
    assert out["epsilon_interval"] == [pytest.approx(gdp_epsilon(lo, DELTA)),
                                       pytest.approx(gdp_epsilon(hi, DELTA))]
    assert out["mu_critical"] == pytest.approx(MU,
                                               rel=1e-9) and lo < MU < hi and not out["violation"]
    assert 0.95 < out["fraction_of_claimed_epsilon"] < 1.05


def test_gaussian_checks_reject_skewed_scores_and_then_the_estimate_is_not_counted():
    rng = np.random.default_rng(505)
    d, dp = _scores(rng, MU, 5000)
    assert gaussian_checks(d, dp)["passed"]
    skewed = rng.exponential(1.0, 5000) + 3.0  # far apart, not normal: μ̂ alone would flag it
    out = gdp_audit(skewed, rng.exponential(1.0, 5000), epsilon_claimed=EPSILON, delta=DELTA,
                    a=0.0005, mu_run=MU, mu_claimed=MU)
    assert out["mu_interval"][0] > MU and not out["checks"]["passed"]
    assert not out["applicable"] and not out["violation"]
    unequal = gaussian_checks(rng.normal(0, 1, 5000), rng.normal(0, 1.2, 5000))
    assert unequal["equal_variance_p"] < 1e-3 and not unequal["passed"]


# ------------------------------------------------------------------------------ the real path, both
# directions

@pytest.mark.parametrize("method,schedule", [("dpgd", dict(rounds=2)),
                                             ("diff2", dict(rounds=4, restart_every=2))])
def test_the_audit_flags_a_sqrt2_mistake_and_not_the_calibrated_mechanism(method, schedule):
    """1,000 trials per federation (power at 0.7: 0.9995 by the noncentral t): the real
    Strategy/Client path with 0.7 of the calibrated noise is a violation by the μ-GDP test, the
    calibrated one is not, and its μ̂ reaches the claimed μ (the canary is in every round: the whole
    run's μ is audited)."""
    results = {k: run_audit(AuditSpec(method=method, epsilon=EPSILON, delta=DELTA, trials=1000,
                                      noise_scale=k, seed=26_000 + int(100 * k), workers=1,
                                      **schedule)) for k in (1.0, 0.7)}
    good, bad = results[1.0]["gdp"], results[0.7]["gdp"]
    assert not results[1.0]["violation"] and not good["violation"] and good["applicable"]
    lo, hi = good["mu_interval"]
    assert lo <= good["mu_claimed"] <= hi and good["mu_claimed"] == pytest.approx(MU, rel=1e-9)
    assert results[0.7]["violation"] and "gdp" in results[0.7]["violation_by"] and bad["applicable"]
    assert bad["mu_interval"][0] > MU and bad["mu"] == pytest.approx(MU / 0.7, rel=0.1)
    assert 0.7 < results[1.0]["power"]["noise_scale"] < 0.8


# ------------------------------------------------------------------------------ diff2-bvr: the
# Clopper–Pearson power

def test_the_local_power_simulation_draws_the_claimed_scores_and_finds_a_detectable_scale():
    """The simulated diff2-bvr scores have the claimed moments (the quadrature's, which the real
    path's scores are tested against in test_audit.py), and the stated power is found where the
    simulated detection rate crosses it."""
    from diff2_flwr.lab.audit.runner import _ledger_epsilon
    from diff2_flwr.lab.audit.stats import (
        _simulated_local_scores, claimed_score_moments, local_power,
    )

    spec = AuditSpec(method="diff2-bvr", epsilon=EPSILON, delta=DELTA, rounds=4, restart_every=2,
                     trials=2500, alpha=0.05)
    cal = spec.calibration()
    mean, sd = claimed_score_moments(spec, cal)
    draws = _simulated_local_scores(np.random.default_rng(606), spec, cal, 1.0, +1, 200_000)
    assert draws.mean() == pytest.approx(mean, abs=5 * sd / math.sqrt(200_000))
    assert draws.std() == pytest.approx(sd, rel=0.01)
    mirrored = _simulated_local_scores(np.random.default_rng(607), spec, cal, 1.0, -1, 200_000)
    assert mirrored.mean() == pytest.approx(-mean, abs=5 * sd / math.sqrt(200_000))
    out = local_power(spec, cal, _ledger_epsilon(spec, cal), reps=40)
    k = out["noise_scale"]
    assert k is not None and out["rates"][k] >= 0.95 and all(r < 0.95 for s,
                                                             r in out["rates"].items() if s > k)
    assert 0.2 <= k <= 0.4  # the Clopper–Pearson test alone is weak: a 4x fault, not a √2 one
