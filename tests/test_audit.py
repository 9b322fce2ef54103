"""The empirical privacy audit (`diff2 audit`): it must not find a violation of our guarantee, must
not be vacuous, and must catch a mechanism that adds less noise than it claims.

The audits run the real Strategy/Client path with fixed seeds (so the outcome is reproducible); the
tolerances are those of the statistics: with 5,000 runs per federation the (ε, δ) lower bound of a
correctly calibrated ε = 3 mechanism at δ = 1e-5 lands near 1.0–1.25 (the Clopper–Pearson intervals
at the tails of the trade-off curve are what keep it below ε), well above 0.3 ε and well below ε.
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
from diff2_flwr.lab.audit.runner import (
    AuditSpec,
    GradientCanaryShard,
    clopper_pearson_upper,
    epsilon_lower_bound,
    local_log_likelihood_ratio,
    run_audit,
    threshold_grid,
)

EPSILON, DELTA = 3.0, 1e-5


# ------------------------------------------------------------------------------ statistics

@pytest.mark.parametrize("k,n", [(0, 100), (3, 100), (50, 100), (999, 1000)])
def test_clopper_pearson_upper_matches_scipy(k, n):
    # scipy's exact two-sided interval at confidence 1 − 2a has the one-sided (1 − a) bound as its
    # upper end
    expected = binomtest(k, n).proportion_ci(confidence_level=0.9, method="exact").high
    assert float(clopper_pearson_upper(k, n, 0.05)) == pytest.approx(expected, rel=1e-9)
    assert float(clopper_pearson_upper(n, n, 0.05)) == 1.0
    assert float(clopper_pearson_upper(0, n, 0.05)) == pytest.approx(1 - 0.05 ** (1 / n), rel=1e-9)


def test_lower_bound_is_below_the_truth_and_grows_with_the_leak():
    """Scores of an exactly μ-GDP mechanism: ε̂ stays below ε(μ) and is positive; more signal,
    larger ε̂."""
    rng = np.random.default_rng(7)
    mu = gdp_mu(EPSILON, DELTA)
    grid = threshold_grid(mu)
    bounds = []
    for true_mu in (mu / 2, mu, 2 * mu):
        # LR scores of a μ-GDP pair: N(+μ²/2, μ²) and N(−μ²/2, μ²)
        d = rng.normal(true_mu**2 / 2, true_mu, 20_000)
        d_prime = rng.normal(-true_mu**2 / 2, true_mu, 20_000)
        out = epsilon_lower_bound(d, d_prime, delta=DELTA,
                                  thresholds=true_mu**2 / 2 + true_mu * np.arange(-32, 33) / 4)
        assert 0 < out["epsilon_lower_bound"] <= gdp_epsilon(true_mu, DELTA)
        assert out["epsilon_lower_bound"] <= out["epsilon_point_estimate"]
        bounds.append(out["epsilon_lower_bound"])
    assert bounds == sorted(bounds)
    # identical distributions: nothing to find (a positive ε̂ here has probability <= α = 5 % by
    # construction)
    same = epsilon_lower_bound(rng.normal(0, 1, 20_000), rng.normal(0, 1, 20_000), delta=DELTA,
                               thresholds=grid)
    assert same["epsilon_lower_bound"] == 0.0


def test_canary_sits_on_the_clipping_radius_and_benign_records_never_touch_its_axis():
    import torch

    rng = np.random.default_rng(0)
    a, b = rng.uniform(0.5, 2, (5, 3)), rng.normal(0, 1, (5, 3))
    a[:, 0] = b[:, 0] = 0.0
    x1, x0 = rng.normal(0, 1, 3), rng.normal(0, 1, 3)
    index = torch.arange(5, dtype=torch.float64)[:, None]  # a record's only feature is its index
    for canary in (+1, -1):
        shard = GradientCanaryShard(a, b, canary)
        for radius, prev in ((1.0, None), (0.37, x0)):
            c = shard.clipped_mean(x1, index, index[:, 0], radius, prev)
            # clipped onto the radius, along e
            assert c.mean[0] == pytest.approx(canary * radius / 5, rel=1e-12)
            assert c.num_clipped >= 1
        # a minibatch of the local steps holds the records it names: the canary only if record 0 is
        # among them
        with_canary = shard.clipped_mean(x1, index[[0, 3]], index[[0, 3], 0], 0.37, x0)
        without = shard.clipped_mean(x1, index[[1, 3]], index[[1, 3], 0], 0.37, x0)
        assert with_canary.num_samples == without.num_samples == 2
        assert with_canary.mean[0] == pytest.approx(canary * 0.37 / 2,
                                                    rel=1e-12) and without.mean[0] == 0.0
    with pytest.raises(ValueError, match="zero canary coordinate"):
        GradientCanaryShard(np.ones((5, 3)), b, +1)


# ------------------------------------------------------------------------------ audits of the real
# path

@pytest.fixture(scope="module")
def diff2_audit():
    spec = AuditSpec(method="diff2", epsilon=EPSILON, delta=DELTA, rounds=4, restart_every=2,
                     trials=5000, seed=11, workers=2, alpha=0.05)
    return run_audit(spec)


def test_audit_of_diff2_finds_no_violation_and_is_not_vacuous(diff2_audit):
    out = diff2_audit
    assert out["epsilon_claimed"] == pytest.approx(EPSILON, rel=1e-9)
    assert out["trials"] == 5000 and out["runs"] == 10_000
    assert out["schedule"]["restart_rounds"] == 2 and out["schedule"]["difference_rounds"] == 2
    assert not out["violation"] and out["epsilon_lower_bound"] <= EPSILON
    assert out["epsilon_lower_bound"] >= 0.3 * EPSILON
    # the μ-GDP estimate reaches the whole run's μ: its interval holds the claimed μ, and ε̂ is
    # close to ε
    gdp = out["gdp"]
    assert gdp["mu_interval"][0] <= out["mu_claimed"] <= gdp["mu_interval"][1] and gdp["applicable"]
    assert 0.9 <= gdp["fraction_of_claimed_epsilon"] <= 1.1 and gdp["level"] == 0.025
    assert out["clopper_pearson"]["level"] == 0.025 and out["confidence"] == 0.95 and out[
        "violation_by"] == []


def test_audit_scores_follow_the_claimed_gaussian_trade_off(diff2_audit):
    """The LR scores of the real path are N(±μ²/2, μ²) for the claimed μ: the server adds exactly
    the calibrated noise, the canary moves the released estimator by exactly the sensitivity on
    restarts and differences."""
    out, mu = diff2_audit, diff2_audit["mu_claimed"]
    se_mean = mu / math.sqrt(5000)
    assert out["scores"]["mean_d"] == pytest.approx(mu**2 / 2, abs=5 * se_mean)
    assert out["scores"]["mean_d_prime"] == pytest.approx(-mu**2 / 2, abs=5 * se_mean)
    for key in ("sd_d", "sd_d_prime"):
        assert out["scores"][key] == pytest.approx(mu, rel=0.05)  # SE of an sd with n = 5000: 1 %


def test_audit_of_dpgd_finds_no_violation_and_is_not_vacuous():
    out = run_audit(AuditSpec(method="dpgd", epsilon=EPSILON, delta=DELTA, rounds=2, trials=5000,
                              seed=12, workers=2, alpha=0.05))
    assert out["schedule"]["restart_rounds"] == 2 and out["schedule"]["difference_rounds"] == 0
    assert not out["violation"]
    assert 0.3 * EPSILON <= out["epsilon_lower_bound"] <= EPSILON


def test_audit_catches_a_mechanism_with_four_times_less_noise():
    out = run_audit(AuditSpec(method="diff2", epsilon=EPSILON, delta=DELTA, rounds=4,
                              restart_every=2, trials=1500, noise_scale=0.25, seed=13, workers=2,
                              alpha=0.05))
    assert out["violation"] and out["epsilon_lower_bound"] > EPSILON
    assert out["violation_by"] == ["clopper_pearson", "gdp"]  # both tests, each at α/2


# ------------------------------------------------------------------------------ DIFF2 with its
# private local routine

# R = 4 (2 restarts, 2 differences), a local step every round on worker 0 with q = b/n = 8/16 and 98
# % of the GDP budget μ² left to the local steps: they dominate ε, so the audit is sensitive to them
# (see docs/how-to/audit.md).
BVR = dict(method="diff2-bvr", epsilon=EPSILON, delta=DELTA, rounds=4, restart_every=2,
           local_batch_size=8, local_share=0.98,
           alpha=0.05)  # the Clopper–Pearson bound alone (no μ-GDP test), at 95 %


@pytest.mark.parametrize("q,z", [(0.5, 2.9), (0.125, 1.0), (1.0, 3.0)])
def test_local_likelihood_ratio_is_the_log_ratio_of_the_two_mixtures(q, z):
    from scipy.stats import norm

    from diff2_flwr.lab.audit.runner import _local_loss_moments

    t = np.linspace(-6, 7, 27)

    # the output along e, in units of c/b: canary term ±1 if sampled, plus N(0, z²)
    def mixture(sign):
        return (1 - q) * norm.pdf(t, 0, z) + q * norm.pdf(t, sign, z)

    assert local_log_likelihood_ratio(t, q, z) == pytest.approx(np.log(mixture(+1) / mixture(-1)),
                                                                rel=1e-9, abs=1e-12)
    assert local_log_likelihood_ratio(-t, q,
                                      z) == pytest.approx(-local_log_likelihood_ratio(t, q, z),
                                                          abs=1e-12)
    # the claimed moments under D (quadrature) against a seeded Monte Carlo of 10^6 draws
    rng = np.random.default_rng(5)
    draws = local_log_likelihood_ratio((rng.random(1_000_000) < q) + rng.normal(0, z, 1_000_000), q,
                                       z)
    mean, var = _local_loss_moments(q, z)
    assert mean == pytest.approx(draws.mean(), abs=5 * draws.std() / 1000)
    assert var == pytest.approx(draws.var(), rel=0.01)


def test_only_the_audits_own_server_forces_the_canarys_worker():
    """A run's server draws the local worker uniformly from its noise key; the audit's subclass
    always picks 0."""
    from diff2_flwr.core.estimator import Mechanism
    from diff2_flwr.core.local import LocalMechanism
    from diff2_flwr.core.routines import make_routine
    from diff2_flwr.lab.audit.runner import _CanaryWorkerServer, _workers
    from diff2_flwr.runtime.server_core import ServerSpec
    from diff2_flwr.runtime.session import Diff2Server

    spec = AuditSpec(**BVR, trials=20)
    cal = spec.calibration()
    chosen = {}
    for cls in (Diff2Server, _CanaryWorkerServer):
        server = cls(ServerSpec(mechanism=Mechanism(2, 1.0, 1.0, cal.sigma1, cal.sigma2),
                                routine=make_routine("gd", learning_rate=0.5),
                                layout=_workers(spec, +1)[0].gradients.layout, rounds=4, clients=2,
                                n_min=16, calibration=cal, local=LocalMechanism(2, 8, 0.5, 1.0,
                                                                                cal.local.sigma3)),
                     x0=np.zeros(spec.dim), seed=3)
        chosen[cls.__name__] = [server.local_worker(r) for r in range(1, 401)]
    draws = chosen["Diff2Server"]
    assert set(draws) == {0, 1} and abs(sum(draws) - 200) < 4 * math.sqrt(100)  # Binomial(400, 1/2)
    assert set(chosen["_CanaryWorkerServer"]) == {0}


@pytest.fixture(scope="module")
def bvr_audit():
    return run_audit(AuditSpec(**BVR, trials=5000, seed=21, workers=2))


def test_audit_of_diff2_bvr_finds_no_violation_and_is_not_vacuous(bvr_audit):
    out = bvr_audit
    local = out["schedule"]["local"]
    assert local["steps"] == 2 and local["sampling_prob"] == 0.5 and local["share"] == 0.98
    assert out["schedule"]["restart_rounds"] == 2 and out["schedule"]["difference_rounds"] == 2
    # the claimed ε is the run's ledger (PLD, round by round), within the target and what the
    # calibration planned
    assert out["epsilon_claimed"] <= EPSILON and out["epsilon_claimed"] == pytest.approx(EPSILON,
                                                                                         rel=0.01)
    assert out["epsilon_claimed"] == pytest.approx(out["epsilon_planned"], rel=1e-6)
    assert out["epsilon_of_mechanism_run"] == out["epsilon_claimed"]
    assert not out["violation"] and out["epsilon_lower_bound"] <= out["epsilon_claimed"]
    assert out["epsilon_lower_bound"] >= 0.3 * EPSILON


def test_audit_of_diff2_bvr_scores_follow_the_claimed_privacy_loss(bvr_audit):
    """The scores of the real path have the claimed privacy-loss mean and spread: the local step
    adds exactly σ3·c, samples the canary with probability b/n, and the canary moves it by exactly
    c/b (and D′ mirrors D)."""
    scores = bvr_audit["scores"]
    se_mean = scores["sd_claimed"] / math.sqrt(5000)
    assert scores["mean_d"] == pytest.approx(scores["mean_claimed"], abs=5 * se_mean)
    assert scores["mean_d_prime"] == pytest.approx(-scores["mean_claimed"], abs=5 * se_mean)
    for key in ("sd_d", "sd_d_prime"):
        assert scores[key] == pytest.approx(scores["sd_claimed"], rel=0.05)


def test_audit_catches_local_steps_with_four_times_less_noise():
    out = run_audit(AuditSpec(**BVR, trials=2500, local_noise_scale=0.25, seed=23, workers=2))
    assert out["schedule"]["local"]["noise_scale"] == 0.25 and out["schedule"]["noise_scale"] == 1.0
    assert out["violation"] and out["epsilon_lower_bound"] > out["epsilon_claimed"]
    # and the audit stays within what actually ran, as the same ledger accounts it
    assert out["epsilon_lower_bound"] <= out["epsilon_of_mechanism_run"]


def test_cli_prints_one_json_object_and_exits_3_on_a_violation(capsys, tmp_path):
    rc = main(["audit", "--method", "dpgd", "--rounds", "2", "--trials", "200", "--seed", "1",
               "--workers", "1",
               "--quiet", "--out", str(tmp_path / "a.json")])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and {"epsilon_lower_bound", "epsilon_claimed", "trials"} <= set(out)
    assert out["trials"] == 200 and json.loads((tmp_path / "a.json").read_text()) == out
    rc = main(["audit", "--method", "dpgd", "--rounds", "2", "--trials", "200", "--seed", "1",
               "--workers", "1",
               "--quiet", "--noise-scale", "0.05"])
    captured = capsys.readouterr()
    assert rc == 3 and json.loads(captured.out)["violation"] and "VIOLATION" in captured.err


def test_cli_audits_diff2_bvr_with_its_local_options(capsys):
    rc = main(["audit", "--method", "diff2-bvr", "--rounds", "4", "--restart-every", "2",
               "--local-batch-size", "8",
               "--local-share", "0.98", "--local-noise-scale", "0.5", "--trials", "20", "--seed",
               "2", "--workers", "1",
               "--quiet"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["method"] == "diff2-bvr" and out["trials"] == 20
    assert out["schedule"]["local"]["noise_scale"] == 0.5 and out["schedule"]["local"][
        "sampling_prob"] == 0.5
    # σ3 halved: the ledger of what ran says more
    assert out["epsilon_of_mechanism_run"] > out["epsilon_claimed"]


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
        (["--restart-every", "10", "--rounds", "10"],
         r"`--restart-every` must be between 2 and rounds - 1 = 9"),
        (["--noise-scale", "0"], r"`--noise-scale` must be a finite number > 0"),
        (["--local-noise-scale", "0.25"],
         r"`--local-noise-scale` must be 1 unless --method is diff2-bvr"),
        (["--method", "diff2-bvr", "--local-batch-size", "17"],
         r"`--local-batch-size` must be at most --samples = 16"),
        (["--method", "diff2-bvr", "--local-share", "1"], r"`--local-share` must be in \(0, 1\)"),
        (["--epsilon", "-1"], r"`epsilon` must be a finite number > 0\. Found -1\.0"),
        (["--delta", "1"], r"`delta` must be in \(0, 1\)\. Found 1\.0"),
    ],
)
def test_cli_refuses_bad_arguments(argv, match, capsys):
    with pytest.raises(SystemExit) if "invalid choice" in match else contextlib.nullcontext():
        rc = main(["audit", "--quiet", *argv])
        assert rc == 2
    assert re.search(match, capsys.readouterr().err)



def test_the_audit_flags_are_the_specs_fields(capsys):
    """``diff2 audit``'s options are derived from AuditSpec's declaration: one flag per field, its
    help and default."""
    import dataclasses

    from diff2_flwr.lab.audit.spec import AuditSpec

    with pytest.raises(SystemExit):
        main(["audit", "--help"])
    text = capsys.readouterr().out
    for f in dataclasses.fields(AuditSpec):
        assert f"--{f.name.replace('_', '-')}" in text and f.metadata["help"].split(" (")[0][
            :20] in text
    assert "{dpgd,diff2,diff2-bvr}" in text
