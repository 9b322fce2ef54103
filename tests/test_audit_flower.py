"""The audit on Flower's path (`diff2 audit --path flower --canaries B`): a Flower simulation of the
real Diff2Strategy and Diff2Client computes, seeded, the in-process audit's scores bit for bit, and
its verdicts agree with the in-process audit's within their intervals (different seeds: independent
noise)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from diff2_flwr.lab.audit.runner import AuditSpec, run_audit

pytestmark = pytest.mark.flower


def _within(mu: float, result: dict) -> bool:
    lo, hi = result["gdp"]["mu_interval"]
    return lo < mu < hi


def test_the_flower_path_audit_is_the_in_process_audit_bit_for_bit(tmp_path):
    args = ["--method", "diff2", "--rounds", "10", "--restart-every", "5", "--trials", "400",
            "--canaries", "200",
            "--seed", "9", "--workers", "2"]
    env = {**os.environ, "FLWR_HOME": str(tmp_path / "flwr-home")}
    proc = subprocess.run([sys.executable, "-m", "diff2_flwr.cli", "audit", *args, "--path",
                           "flower"],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # stdout is the JSON alone: Flower's and Ray's lines went to stderr
    flower = json.loads(proc.stdout)
    assert "Flower run 4/4" in proc.stderr and flower["path"].startswith("a Flower simulation")
    spec = AuditSpec(method="diff2", rounds=10, restart_every=5, trials=400, canaries=200, seed=9,
                     workers=1)
    local = run_audit(spec)
    # means and spreads of both federations, equal to the last bit
    assert flower["scores"] == local["scores"]
    assert flower["gdp"]["mu"] == local["gdp"]["mu"] and flower["violation"] is local[
        "violation"] is False
    # independent noise: agreement within intervals
    other = run_audit(AuditSpec(**{**spec.__dict__, "seed": 10}))
    assert _within(other["gdp"]["mu"], flower) and _within(flower["gdp"]["mu"], other)


def test_the_flower_path_flags_a_sqrt2_mistake_as_the_in_process_audit_does(tmp_path, monkeypatch):
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "flwr-home"))
    spec = AuditSpec(method="dpgd", trials=1000, canaries=500, noise_scale=0.7, seed=23, workers=2,
                     path="flower")
    flower = run_audit(spec)
    local = run_audit(AuditSpec(**{**spec.__dict__, "path": "in-process", "seed": 24,
                                   "workers": 1}))
    assert flower["violation"] and "gdp" in flower["violation_by"] and local["violation"]
    assert _within(local["gdp"]["mu"], flower) and _within(flower["gdp"]["mu"], local)
    assert _within(flower["mu_claimed"] / 0.7, flower)
