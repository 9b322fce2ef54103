"""`diff2 audit --noise distributed`: the audit of privacy.noise: distributed through the real
Strategy, the real clients' noise shares and the server's release_sum. It must find no violation of
a correctly noised run, must not be vacuous, and must catch clients whose shares carry 4x less noise
std than calibrated.

Seeded (reproducible). R = 4 with T = 2 (2 restarts, 2 difference rounds), P = 2, ε = 3 at δ = 1e-5:
the Skellam ledger's schedule has a Gaussian μ of 0.66, so the scores are N(±0.22, 0.66²) when the
noise is right.
"""

from __future__ import annotations

import json
import re
import math

import numpy as np
import pytest

from diff2_flwr.cli import main
from diff2_flwr.core.distributed import SkellamLedger, client_rng
from diff2_flwr.lab.audit.runner import AuditSpec, run_audit
from diff2_flwr.lab.audit.trials import _ScaledShares, worker_noise

EPSILON, DELTA = 3.0, 1e-5
SCHEDULE = dict(method="diff2", epsilon=EPSILON, delta=DELTA, rounds=4, restart_every=2,
                noise="distributed")


def test_scaled_shares_keep_the_runs_code_and_scale_only_the_share():
    spec = AuditSpec(**SCHEDULE, trials=20, noise_scale=0.25)
    noise = spec.distributed_noise()
    shares = worker_noise(spec, noise)
    assert isinstance(shares, _ScaledShares) and worker_noise(AuditSpec(**SCHEDULE, trials=20),
                                                              noise) is noise
    for r, restart, radius in ((1, True, 1.0), (2, False, 0.37)):
        code = noise.code(r, restart, radius)
        # the server decodes what the workers encoded
        assert shares.code(r, restart, radius) == code
        assert shares.share_variance(code, restart, radius) == pytest.approx(
            noise.share_variance(code, restart, radius) / 16, rel=1e-12)
    # the noise the workers add: a zero mean encoded and decoded, over many draws (std 4x smaller
    # than the run's)
    code = noise.code(1, True, 1.0)
    decoded = np.array([noise.decode(shares.encode(np.zeros(spec.dim), 1, True, 1.0,
                                                   client_rng(9, 0, i)), 1, True,
                                     1.0, 1) for i in range(4000)])
    predicted = math.sqrt(shares.share_variance(code, True, 1.0)) / code.scale
    # rounding error is far below the noise here
    assert np.std(decoded) == pytest.approx(predicted, rel=0.05)


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--noise", "distributed", "--method", "diff2-bvr"],
         r"`--noise` must be central for --method diff2-bvr"),
        (["--noise", "distributed", "--bits", "40"], r"`--bits` must be an integer in \[2, 31\]"),
        (["--noise", "distributed", "--tolerated", "1"],
         r"`--tolerated` must be an integer t >= 0 with 2t < "
                                                         r"--clients = 2"),
        (["--tolerated", "1", "--clients", "3"],
         r"`--tolerated` must be 0 unless --noise is distributed"),
        (["--noise", "distributed", "--clients", "1"],
         r"`--clients` must be at least 2 for --noise distributed"),
        (["--noise", "distributed", "--bits", "4"], r"`bits` = 4 cannot hold the noised sum"),
    ],
)
def test_cli_refuses_bad_distributed_arguments(argv, match, capsys):
    assert main(["audit", "--quiet", *argv]) == 2
    assert re.search(match, capsys.readouterr().err)


def test_cli_audits_distributed_noise_with_dropouts(capsys):
    """P = 3 with t = 1: the third client drops out of every round, the sum carries the other two
    shares."""
    rc = main(["audit", "--noise", "distributed", "--clients", "3", "--tolerated", "1", "--rounds",
               "4",
               "--restart-every", "2", "--trials", "20", "--seed", "4", "--workers", "1",
               "--quiet"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["noise_mode"] == "distributed" and out["trials"] == 20
    assert out["schedule"]["distributed"]["survivors"] == 2 and out["schedule"]["distributed"][
        "tolerated"] == 1
    assert "release_sum" in out["path"] and out["mu_claimed"] is None


@pytest.fixture(scope="module")
def distributed_audit():
    return run_audit(AuditSpec(**SCHEDULE, trials=1500, seed=31, workers=2, alpha=0.05))


def test_audit_of_distributed_noise_finds_no_violation_and_is_not_vacuous(distributed_audit):
    out = distributed_audit
    spec = AuditSpec(**SCHEDULE, trials=20)
    claimed = SkellamLedger(DELTA).record(*spec.distributed_noise().calibration.events()).epsilon
    assert out["epsilon_claimed"] == pytest.approx(claimed,
                                                   rel=1e-12) and claimed <= EPSILON * (1 + 1e-9)
    assert out["schedule"]["restart_rounds"] == 2 and out["schedule"]["difference_rounds"] == 2
    assert not out["violation"] and out["epsilon_lower_bound"] <= out["epsilon_claimed"]
    assert out["epsilon_lower_bound"] >= 0.15 * EPSILON
    # the μ-GDP estimate: the Skellam ledger (RDP) claims more than the Gaussian μ of the schedule
    # gives, so the correctly noised run reaches a fraction of the claim, and its interval holds the
    # schedule's Gaussian μ
    gdp = out["gdp"]
    assert gdp["mu_interval"][0] <= out["scores"]["mu_gaussian"] <= gdp["mu_interval"][1]
    assert gdp["mu_claimed"] is None and not gdp["violation"] and gdp["fraction_of_claimed_mu"] < 1


def test_audit_scores_follow_the_gaussian_equivalent_of_the_skellam_noise(distributed_audit):
    """The clients' shares add up to the calibrated noise and the canary moves the decoded mean by
    exactly the sensitivity: the scores are N(±μ²/2, μ²) with μ the schedule's Gaussian μ (Skellam
    of variance >> 1)."""
    out, mu = distributed_audit, distributed_audit["scores"]["mu_gaussian"]
    assert mu == pytest.approx(0.66, abs=0.01)
    se_mean = mu / math.sqrt(1500)
    assert out["scores"]["mean_d"] == pytest.approx(mu**2 / 2, abs=5 * se_mean)
    assert out["scores"]["mean_d_prime"] == pytest.approx(-mu**2 / 2, abs=5 * se_mean)
    for key in ("sd_d", "sd_d_prime"):
        assert out["scores"][key] == pytest.approx(mu, rel=0.08)  # SE of an sd with n = 1500: 1.8 %


def test_audit_catches_client_shares_with_four_times_less_noise():
    out = run_audit(AuditSpec(**SCHEDULE, trials=1500, noise_scale=0.25, seed=31, workers=2,
                              alpha=0.05))
    assert out["violation"] and out["epsilon_lower_bound"] > out["epsilon_claimed"]
    assert out["scores"]["sd_d"] == pytest.approx(out["scores"]["mu_gaussian"] / 4, rel=0.08)
    assert "gdp" in out["violation_by"] and out["gdp"]["mu"] == pytest.approx(4 * out["scores"][
        "mu_gaussian"], rel=0.1)
