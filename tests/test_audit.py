"""The empirical privacy audit (`diff2 audit`): it must not find a violation of our guarantee, must not be
vacuous, and must catch a mechanism that adds less noise than it claims.

The audits run the real Strategy/Client path with fixed seeds (so the outcome is reproducible); the
tolerances are those of the statistics: with 5,000 runs per federation the (ε, δ) lower bound of a
correctly calibrated ε = 3 mechanism at δ = 1e-5 lands near 1.0–1.25 (the Clopper–Pearson intervals at
the tails of the trade-off curve are what keep it below ε), well above 0.3 ε and well below ε.
"""

from __future__ import annotations

import contextlib
import json
import math
import re

import numpy as np
import pytest
from scipy.stats import binomtest

from diff2_flwr.cli import main
from diff2_flwr.core.privacy import gdp_epsilon, gdp_mu
from diff2_flwr.lab.audit import (
    AuditSpec,
    GradientCanaryShard,
    clopper_pearson_upper,
    epsilon_lower_bound,
    run_audit,
    threshold_grid,
)

EPSILON, DELTA = 3.0, 1e-5


# ------------------------------------------------------------------------------ statistics

@pytest.mark.parametrize("k,n", [(0, 100), (3, 100), (50, 100), (999, 1000)])
def test_clopper_pearson_upper_matches_scipy(k, n):
    # scipy's exact two-sided interval at confidence 1 − 2a has the one-sided (1 − a) bound as its upper end
    expected = binomtest(k, n).proportion_ci(confidence_level=0.9, method="exact").high
    assert float(clopper_pearson_upper(k, n, 0.05)) == pytest.approx(expected, rel=1e-9)
    assert float(clopper_pearson_upper(n, n, 0.05)) == 1.0
    assert float(clopper_pearson_upper(0, n, 0.05)) == pytest.approx(1 - 0.05 ** (1 / n), rel=1e-9)


def test_lower_bound_is_below_the_truth_and_grows_with_the_leak():
    """Scores of an exactly μ-GDP mechanism: ε̂ stays below ε(μ) and is positive; more signal, larger ε̂."""
    rng = np.random.default_rng(7)
    mu = gdp_mu(EPSILON, DELTA)
    grid = threshold_grid(mu)
    bounds = []
    for true_mu in (mu / 2, mu, 2 * mu):
        # LR scores of a μ-GDP pair: N(+μ²/2, μ²) and N(−μ²/2, μ²)
        d = rng.normal(true_mu**2 / 2, true_mu, 20_000)
        d_prime = rng.normal(-true_mu**2 / 2, true_mu, 20_000)
        out = epsilon_lower_bound(d, d_prime, delta=DELTA, thresholds=true_mu**2 / 2 + true_mu * np.arange(-32, 33) / 4)
        assert 0 < out["epsilon_lower_bound"] <= gdp_epsilon(true_mu, DELTA)
        assert out["epsilon_lower_bound"] <= out["epsilon_point_estimate"]
        bounds.append(out["epsilon_lower_bound"])
    assert bounds == sorted(bounds)
    # identical distributions: nothing to find (a positive ε̂ here has probability <= α = 5 % by construction)
    same = epsilon_lower_bound(rng.normal(0, 1, 20_000), rng.normal(0, 1, 20_000), delta=DELTA, thresholds=grid)
    assert same["epsilon_lower_bound"] == 0.0


def test_canary_sits_on_the_clipping_radius_and_benign_records_never_touch_its_axis():
    import torch

    rng = np.random.default_rng(0)
    a, b = rng.uniform(0.5, 2, (5, 3)), rng.normal(0, 1, (5, 3))
    a[:, 0] = b[:, 0] = 0.0
    x1, x0 = rng.normal(0, 1, 3), rng.normal(0, 1, 3)
    dummy = torch.zeros(5, 1)
    for canary in (+1, -1):
        shard = GradientCanaryShard(a, b, canary)
        for radius, prev in ((1.0, None), (0.37, x0)):
            c = shard.clipped_mean(x1, dummy, dummy[:, 0], radius, prev)
            assert c.mean[0] == pytest.approx(canary * radius / 5, rel=1e-12)  # clipped onto the radius, along e
            assert c.num_clipped >= 1
    with pytest.raises(ValueError, match="zero canary coordinate"):
        GradientCanaryShard(np.ones((5, 3)), b, +1)


# ------------------------------------------------------------------------------ audits of the real path

@pytest.fixture(scope="module")
def diff2_audit():
    spec = AuditSpec(method="diff2", epsilon=EPSILON, delta=DELTA, rounds=4, restart_every=2, trials=5000, seed=11,
                     workers=2)
    return run_audit(spec)


def test_audit_of_diff2_finds_no_violation_and_is_not_vacuous(diff2_audit):
    out = diff2_audit
    assert out["epsilon_claimed"] == pytest.approx(EPSILON, rel=1e-9)
    assert out["trials"] == 5000 and out["runs"] == 10_000
    assert out["schedule"]["restart_rounds"] == 2 and out["schedule"]["difference_rounds"] == 2
    assert not out["violation"] and out["epsilon_lower_bound"] <= EPSILON
    assert out["epsilon_lower_bound"] >= 0.3 * EPSILON


def test_audit_scores_follow_the_claimed_gaussian_trade_off(diff2_audit):
    """The LR scores of the real path are N(±μ²/2, μ²) for the claimed μ: the server adds exactly the calibrated
    noise, the canary moves the released estimator by exactly the sensitivity on restarts and differences."""
    out, mu = diff2_audit, diff2_audit["mu_claimed"]
    se_mean = mu / math.sqrt(5000)
    assert out["scores"]["mean_d"] == pytest.approx(mu**2 / 2, abs=5 * se_mean)
    assert out["scores"]["mean_d_prime"] == pytest.approx(-mu**2 / 2, abs=5 * se_mean)
    for key in ("sd_d", "sd_d_prime"):
        assert out["scores"][key] == pytest.approx(mu, rel=0.05)  # SE of an sd with n = 5000: 1 %


def test_audit_of_dpgd_finds_no_violation_and_is_not_vacuous():
    out = run_audit(AuditSpec(method="dpgd", epsilon=EPSILON, delta=DELTA, rounds=2, trials=5000, seed=12, workers=2))
    assert out["schedule"]["restart_rounds"] == 2 and out["schedule"]["difference_rounds"] == 0
    assert not out["violation"]
    assert 0.3 * EPSILON <= out["epsilon_lower_bound"] <= EPSILON


def test_audit_catches_a_mechanism_with_four_times_less_noise():
    out = run_audit(AuditSpec(method="diff2", epsilon=EPSILON, delta=DELTA, rounds=4, restart_every=2, trials=1500,
                              noise_scale=0.25, seed=13, workers=2))
    assert out["violation"] and out["epsilon_lower_bound"] > EPSILON


def test_cli_prints_one_json_object_and_exits_3_on_a_violation(capsys, tmp_path):
    rc = main(["audit", "--method", "dpgd", "--rounds", "2", "--trials", "200", "--seed", "1", "--workers", "1",
               "--quiet", "--out", str(tmp_path / "a.json")])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and {"epsilon_lower_bound", "epsilon_claimed", "trials"} <= set(out)
    assert out["trials"] == 200 and json.loads((tmp_path / "a.json").read_text()) == out
    rc = main(["audit", "--method", "dpgd", "--rounds", "2", "--trials", "200", "--seed", "1", "--workers", "1",
               "--quiet", "--noise-scale", "0.05"])
    captured = capsys.readouterr()
    assert rc == 3 and json.loads(captured.out)["violation"] and "VIOLATION" in captured.err


def test_unseeded_audit_draws_fresh_noise_per_run():
    spec = AuditSpec(method="dpgd", rounds=2, trials=40, workers=1)
    a, b = run_audit(spec), run_audit(spec)
    assert a["noise"] == "os-entropy key per run"
    assert a["scores"]["mean_d"] != b["scores"]["mean_d"]


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--method", "sgd"], "invalid choice"),
        (["--trials", "5"], r"`--trials` must be an integer >= 20\. Found 5"),
        (["--restart-every", "10", "--rounds", "10"], r"`--restart-every` must be between 2 and rounds - 1 = 9"),
        (["--noise-scale", "0"], r"`--noise-scale` must be a finite number > 0"),
        (["--epsilon", "-1"], r"`epsilon` must be a finite number > 0\. Found -1\.0"),
        (["--delta", "1"], r"`delta` must be in \(0, 1\)\. Found 1\.0"),
    ],
)
def test_cli_refuses_bad_arguments(argv, match, capsys):
    with pytest.raises(SystemExit) if "invalid choice" in match else contextlib.nullcontext():
        rc = main(["audit", "--quiet", *argv])
        assert rc == 2
    assert re.search(match, capsys.readouterr().err)

