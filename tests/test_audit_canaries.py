"""Many canaries in one run (`diff2 audit --canaries B`): B independent trials of the one-canary
score per run.

The claim (diff2_flwr/lab/audit/canaries.py) is exact: canary k's score is N(s_k μ²/2, μ²) with μ
the claimed μ of the schedule, and the B scores of a run are independent. The tests check both at
fixed seeds, against the law the one-canary audit's scores have (the μ-GDP pair of the calibration,
which tests/test_audit.py checks for one canary per run), and that the many-canary audit keeps the
audit's verdicts both ways.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from diff2_flwr.lab.audit.runner import AuditSpec, GradientCanaryShard, run_audit, summary_line
from diff2_flwr.lab.audit.canaries import (
    _runs, canary_runs, canary_signs, canary_spec, canary_workers, split_scores,
)
from diff2_flwr.lab.audit.trials import CANARY_MARGIN


@pytest.fixture(scope="module", params=["diff2", "dpgd"])
def many(request):
    """60 seeded runs of 200 canaries (6,000 trials per federation): the [runs, B] scores and the
    claimed μ."""
    spec = AuditSpec(method=request.param, rounds=10, restart_every=5, trials=6000, canaries=200,
                     seed=41, workers=1)
    calibration = canary_spec(spec).calibration()
    return spec, _runs(spec, calibration, 0, canary_runs(spec)), calibration.mu


def test_each_canary_score_has_the_one_canary_law(many):
    spec, scores, mu = many
    d, d_prime = split_scores(scores)
    for sample, sign in ((d.ravel(), +1), (d_prime.ravel(), -1)):
        # N(±μ²/2, μ²): Kolmogorov–Smirnov at the claimed law, and the two moments at 5 standard
        # errors
        assert stats.kstest(sample, "norm", args=(sign * mu**2 / 2, mu)).pvalue > 1e-3
        assert abs(sample.mean() - sign * mu**2 / 2) < 5 * mu / math.sqrt(sample.size)
        assert abs(sample.std(ddof=1) / mu - 1) < 5 / math.sqrt(2 * sample.size)


def test_the_canaries_of_a_run_are_independent(many):
    """Correlated scores would show in the spread of a run's mean score: Var = μ²(1 + (m − 1)ρ)/m
    for m canaries of a sign with pairwise correlation ρ; ρ = 0.01 would double it at m = 100.
    Checked against χ² bounds at 10⁻⁴ (59 degrees of freedom), and so are the correlations of
    neighbouring canaries, which share the noise of no coordinate, across the runs."""
    spec, scores, mu = many
    runs = scores.shape[0]
    for half in split_scores(scores):
        m = half.shape[1]
        ratio = np.var(half.mean(axis=1), ddof=1) / (mu**2 / m)
        lo, hi = stats.chi2.ppf([1e-4, 1 - 1e-4], runs - 1) / (runs - 1)
        assert lo < ratio < hi, ratio
    # k with k + 1
    corr = np.corrcoef(scores.T)[np.arange(spec.canaries - 1), np.arange(1, spec.canaries)]
    # the mean of 199 near-independent r's
    assert abs(corr.mean()) < 4 / math.sqrt(runs * (spec.canaries - 1))


def test_the_many_canary_federation():
    spec = AuditSpec(method="diff2", canaries=6, samples=4, dim=3, trials=30, seed=1)
    run = canary_spec(spec)
    assert (run.samples, run.dim) == (10, 8) and list(canary_signs(6)) == [1, -1, 1, -1, 1, -1]
    workers = canary_workers(spec)
    assert len(workers) == spec.clients
    x1, x0 = np.random.default_rng(0).normal(size=(2, run.dim))
    index = np.arange(run.samples, dtype=np.float64)[:, None]
    import torch

    for radius, prev in ((1.0, None), (0.3, x0)):
        c = workers[0].gradients.clipped_mean(x1, torch.from_numpy(index), torch.zeros(run.samples),
                                              radius, prev)
        # canary k moves axis k by s_k C / n, clipped onto the radius; the benign records touch no
        # canary axis
        assert c.mean[:6] == pytest.approx(canary_signs(6) * radius / run.samples, rel=1e-12)
        other = workers[1].gradients.clipped_mean(x1, torch.from_numpy(index),
                                                  torch.zeros(run.samples), radius, prev)
        assert np.all(other.mean[:6] == 0) and np.any(other.mean[6:] != 0)
    rows = workers[0].gradients.rows(0.5, x1, None)
    assert np.all(np.abs(np.diag(rows[:6, :6])) == CANARY_MARGIN)  # always clipped
    with pytest.raises(ValueError, match="canary signs"):
        GradientCanaryShard(np.zeros((3, 5)), np.zeros((3, 5)), np.array([1, 2]))


@pytest.mark.parametrize("method", ["diff2", "dpgd"])
def test_the_many_canary_audit_passes_a_calibrated_and_flags_a_sqrt2_mechanism(method):
    """2,000 trials per federation (4 runs of 1,000 canaries): × 1 is no violation and μ̂ covers the
    claimed μ; × 0.7 (a √2 mistake) is a violation of the μ-GDP test, with its μ̂ near μ / 0.7."""
    spec = AuditSpec(method=method, trials=2000, canaries=1000, seed=7, workers=1)
    calibrated, broken = run_audit(spec), run_audit(AuditSpec(**{**spec.__dict__,
                                                                 "noise_scale": 0.7, "seed": 8}))
    mu = calibrated["mu_claimed"]
    assert calibrated["runs"] == 4 and calibrated["canaries"]["per_run"] == 1000
    assert "1000 canaries per run, 4 runs): no violation" in summary_line(calibrated)
    assert not calibrated["violation"]
    lo, hi = calibrated["gdp"]["mu_interval"]
    assert lo < mu < hi
    assert broken["violation"] and "gdp" in broken["violation_by"]
    lo, hi = broken["gdp"]["mu_interval"]
    assert lo < mu / 0.7 < hi


@pytest.mark.parametrize("changes,message", [
    ({"canaries": 3}, "even integer"),
    ({"canaries": 5000}, "at most 4096"),
    ({"canaries": 4, "method": "diff2-bvr", "rounds": 4, "restart_every": 2}, "diff2-bvr"),
    ({"canaries": 4, "noise": "distributed"}, "distributed"),
    ({"path": "flower"}, "--canaries B >= 2"),
])
def test_canaries_are_refused_where_the_argument_does_not_hold(changes, message):
    with pytest.raises(ValueError, match=message):
        AuditSpec(**{"trials": 100, **changes})
