"""`diff2 audit --sampling`: the audit of a client-sampled DIFF2 run through the real Strategy (the
server draws each round's cohort from the trial's key; the strategy asks each node its partition
once and only the cohort) and the real clients. It must find no violation of the calibrated run,
must catch noise x 0.7, and its scores are checked against their claimed model.

Seeded (reproducible). R = 6 with T = 3 (2 restarts, 4 difference rounds), P = 4 clients of 64
records, ε = 8 at δ = 1e-5, Poisson q = 1/2: the canary's client is drawn in a round with
probability 1/2, and when it is, its other records put the round's output 20 (restart) and 7
(difference) noise std away from where it is without it.
"""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
from scipy import integrate
from scipy.stats import norm

from diff2_flwr.cli import main
from diff2_flwr.lab.audit.gdp import sampled_epsilon
from diff2_flwr.lab.audit.runner import AuditSpec, naive_poisson_epsilon, run_audit
from diff2_flwr.lab.audit.stats import (_mixture_loss_moments, local_log_likelihood_ratio,
                                        mixture_log_likelihood_ratio, sampled_offsets)
from diff2_flwr.lab.audit.trials import _trial_sampled, _workers

DELTA = 1e-5
SCHEDULE = dict(method="diff2", epsilon=8.0, delta=DELTA, rounds=6, restart_every=3, clients=4,
                samples=64, sampling="poisson", sampling_rate=0.5, workers=1)


# --------------------------------------------------------------------------------- the maths

@pytest.mark.parametrize("pi, centre, half", [(0.5, 7.3, 0.11), (0.1, 20.6, 0.03),
                                              (0.9, 0.0, 1.0), (0.25, 1.7, 0.6)])
def test_the_mixture_likelihood_ratio_is_the_ratio_of_the_two_mixtures(pi, centre, half):
    """Against a direct evaluation of the two mixture densities (scipy's normal pdf)."""
    t = np.linspace(-6.0, centre + 6.0, 97)
    direct = np.log(((1 - pi) * norm.pdf(t) + pi * norm.pdf(t, centre + half))
                    / ((1 - pi) * norm.pdf(t) + pi * norm.pdf(t, centre - half)))
    np.testing.assert_allclose(mixture_log_likelihood_ratio(t, pi, centre, half), direct,
                               rtol=1e-10, atol=1e-12)


def test_the_mixture_likelihood_ratio_reduces_to_the_gaussian_and_the_local_steps():
    t = np.linspace(-5, 5, 41)
    # π = 1: the Gaussian 2·half·(t − centre)
    np.testing.assert_allclose(mixture_log_likelihood_ratio(t, 1.0, 3.0, 0.2), 0.4 * (t - 3.0),
                               atol=1e-12)
    # centre 0, half 1/z, t in units of z: the local step's
    z = 1.7
    np.testing.assert_allclose(mixture_log_likelihood_ratio(t / z, 0.3, 0.0, 1 / z),
                               local_log_likelihood_ratio(t, 0.3, z), rtol=1e-12, atol=1e-12)


def test_the_claimed_moments_are_the_mixtures_integrals():
    """The Gauss–Hermite moments of one round's score under D against adaptive quadrature."""
    pi, (centre, half) = 0.5, sampled_offsets(1.5, 16)

    def density(t: float) -> float:
        return (1 - pi) * norm.pdf(t) + pi * norm.pdf(t, centre + half)

    def moment(k: int) -> float:
        f = lambda t: density(t) * float(mixture_log_likelihood_ratio(t, pi, centre, half))**k  # noqa: E731
        return integrate.quad(f, -12, centre + 12, points=[0, centre], limit=200)[0]

    mean, variance = _mixture_loss_moments(pi, centre, half)
    assert mean == pytest.approx(moment(1), rel=1e-8)
    assert variance == pytest.approx(moment(2) - moment(1)**2, rel=1e-8)


def test_the_cohort_tests_epsilon_is_the_ledgers():
    """The closed form the cohort test inverts (binomial mixture of μ-GDP) against the run's ledger
    (dp-accounting PLD of the π-mixtures): the same ε to the PLD's discretisation; and the naive
    REPLACE_ONE Poisson ε far below both."""
    spec = AuditSpec(**SCHEDULE, trials=20)
    cal = spec.calibration()
    exact = sampled_epsilon(DELTA, cal.restart_rounds, cal.z1, cal.difference_rounds, cal.z2, 0.5)
    assert exact == pytest.approx(cal.planned_epsilon, rel=1e-6)
    assert exact <= cal.planned_epsilon + 1e-9  # the PLD is pessimistic
    assert naive_poisson_epsilon(spec, cal) < 0.5 * exact


# --------------------------------------------------------------------------------- the trials

def test_the_canary_client_is_sampled_like_any_other():
    """μ_S² of a trial is Σ 1/z_r² over the rounds whose cohort holds worker 0: its mean over
    trials is π Σ_r 1/z_r² (not Σ_r 1/z_r², as if the canary's client were forced in)."""
    spec = AuditSpec(**SCHEDULE, trials=20)
    cal = spec.calibration()
    workers = _workers(spec, +1)
    mu2 = np.array([_trial_sampled(spec, cal, workers, seed)[2] for seed in range(200)])
    full = cal.restart_rounds / cal.z1**2 + cal.difference_rounds / cal.z2**2
    # the number of draws is Binomial(6, 1/2) per kind: the mean over 200 trials within 4 se
    se = math.sqrt(0.25 * (cal.restart_rounds / cal.z1**4 + cal.difference_rounds / cal.z2**4)
                   / 200)
    assert abs(mu2.mean() - 0.5 * full) < 4 * se
    assert 0 < np.isclose(mu2, full, rtol=1e-12).mean() < 0.1  # drawn in every round: 1 in 64


@pytest.fixture(scope="module")
def calibrated():
    return run_audit(AuditSpec(**SCHEDULE, trials=400, seed=44))


def test_a_calibrated_sampled_run_shows_no_violation(calibrated):
    out = calibrated
    assert not out["violation"] and out["violation_by"] == []
    assert out["epsilon_claimed"] == pytest.approx(8.0, rel=0.01)
    cohort = out["gdp"]
    assert cohort["test"] == "cohort" and cohort["applicable"]
    lo, hi = cohort["mu_interval"]
    assert lo < 1 < hi  # the measured μ's are the claimed ones
    # the mixture scores' moments are the claimed model's (within sampling error)
    scores, se = out["scores"], out["scores"]["sd_claimed"] / math.sqrt(400)
    assert abs(scores["mean_d"] - scores["mean_claimed"]) < 4 * se
    assert abs(scores["mean_d_prime"] + scores["mean_claimed"]) < 4 * se
    assert scores["sd_d"] == pytest.approx(scores["sd_claimed"], rel=0.15)
    sampling = out["schedule"]["sampling"]
    assert sampling["probability"] == 0.5 and sampling["expected_cohort"] == 2.0
    assert min(sampling["canary_client_offset_in_noise_std"].values()) > 5
    assert out["epsilon_naive_poisson"] < out["epsilon_claimed"]
    assert "Diff2Strategy.configure_fit" in out["path"]


def test_a_fixed_cohort_audit_shows_no_violation():
    out = run_audit(AuditSpec(**{**SCHEDULE, "sampling": "fixed", "sampling_rate": None,
                                 "sampling_size": 2}, trials=200, seed=45))
    assert not out["violation"] and out["schedule"]["sampling"]["kind"] == "fixed"
    assert out["schedule"]["sampling"]["probability"] == 0.5
    lo, hi = out["gdp"]["mu_interval"]
    assert lo < 1 < hi


def test_the_audit_flags_noise_times_0_7():
    """TEETH: the server adds 0.7 x the calibrated noise; the cohort test refutes the claim."""
    out = run_audit(AuditSpec(**SCHEDULE, trials=400, noise_scale=0.7, seed=46))
    assert out["violation"] and "gdp" in out["violation_by"]
    cohort = out["gdp"]
    assert cohort["applicable"] and cohort["mu_interval"][0] > cohort["mu_critical"]
    assert cohort["epsilon_interval"][0] > out["epsilon_claimed"]
    assert cohort["noise_scale_estimate"] == pytest.approx(0.7, rel=0.1)


# --------------------------------------------------------------------------------- refusals

@pytest.mark.parametrize(
    "argv,match",
    [
        (["--sampling", "poisson"],
         r"`--sampling-rate` must be a number in \(0, 1\] with --sampling poisson. Found None"),
        (["--sampling", "poisson", "--sampling-rate", "1.5"],
         r"`--sampling-rate` must be a number in \(0, 1\]"),
        (["--sampling", "fixed", "--sampling-size", "5", "--clients", "4"],
         r"`--sampling-size` must be an integer in 1..--clients = 4 with --sampling fixed"),
        (["--sampling", "fixed", "--sampling-rate", "0.5"],
         r"`--sampling-rate` must be unset unless --sampling is poisson"),
        (["--sampling-size", "2"], r"`--sampling-size` must be unset unless --sampling is fixed"),
        (["--sampling", "poisson", "--sampling-rate", "0.5", "--method", "diff2-bvr"],
         r"`--sampling` must be none for --method diff2-bvr"),
        (["--sampling", "poisson", "--sampling-rate", "0.5", "--noise", "distributed"],
         r"`--sampling` must be none with --noise distributed"),
        (["--sampling", "poisson", "--sampling-rate", "0.5", "--canaries", "200"],
         r"`--canaries` must be 1 with --sampling"),
        (["--sampling", "poisson", "--sampling-rate", "0.5", "--samples", "1"],
         r"`--samples` must be at least 2 with --sampling"),
    ],
)
def test_cli_refuses_bad_sampling_arguments(argv, match, capsys):
    assert main(["audit", "--quiet", "--trials", "20", *argv]) == 2
    err = capsys.readouterr().err
    assert re.search(match, err), err


def test_cli_refuses_an_unknown_sampling_kind(capsys):
    with pytest.raises(SystemExit):
        main(["audit", "--sampling", "bernoulli"])
    assert "invalid choice: 'bernoulli'" in capsys.readouterr().err


def test_cli_runs_a_sampled_audit(capsys):
    rc = main(["audit", "--sampling", "poisson", "--sampling-rate", "0.5", "--clients", "4",
               "--samples", "32", "--rounds", "4", "--restart-every", "2", "--trials", "20",
               "--seed", "4", "--workers", "1", "--quiet"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["spec"]["sampling"] == "poisson" and out["trials"] == 20
    assert out["schedule"]["sampling"]["rate"] == 0.5 and out["mu_claimed"] is None
    assert out["epsilon_naive_poisson"] > 0 and "naive_refuted" in out
