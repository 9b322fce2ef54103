"""Score a data owner's canaries in a live run (``diff2 audit --live FOLDER``): how much noise the server really
added along them, and the μ-GDP estimate of the run from their scores. Reads what
:mod:`~diff2_flwr.runtime.canary_monitor` recorded; can run at any time while the run trains.

What the owner saw. Round r's task carried x_(r-1); the folder holds y_(r-1) = U x_(r-1) (U the canaries'
orthonormal frame, B rows). With routine gd, U ṽ_r = (y_(r-1) - y_r)/η for r = 1..m-1 (m tasks seen; round R is
never seen: no task follows it), and the round's release along the frame is a_r = U ṽ_r on a restart round,
U(ṽ_r - ṽ_(r-1)) on a difference round:

    a_r = U(the other updates) + s·C_r/((n_p + B)P) + N(0, (k σ_r)² I_B),

σ_r the calibrated noise std, k the factor the server really used (k = 1: as declared), s the canaries' signs.

1. **The noise scale** k. Within each sign group the canary term is one constant: Q = Σ_r Σ_k (a_rk/σ_r - group
   mean)² is, given the past, k² times a noncentral χ²(B - 2) per round whose noncentrality is the other updates'
   spread along the frame (≥ 0), with fresh noise each round. So Q/k² stochastically dominates χ²(m'(B - 2)):
   k̂ = (Q/df)^½ overestimates k, and k_upper = (Q/χ²_a(df))^½ is a one-sided (1 - a) upper bound on it. The claim
   is refuted when k_upper < 1: the server added less noise than declared. This test needs nothing of the
   sensitivity, and B·m' terms give it power in one run.
2. **The μ-GDP estimate** (Andrew et al. 2024, with the whole trajectory rather than the final model): the
   likelihood-ratio score of canary k is S_k = Σ_r (2C_r/(n_min P σ_r²)) a_rk; were the noise as declared and
   the other updates orthogonal to the frame, (mean₊ - mean₋)/sd would be μ_obs·n_min/(n_p + B), μ_obs the
   calibrated μ of the observed rounds. μ̂ of the run (for a record of the smallest shard) is that ratio times
   (n_p + B)/n_min, with the noncentral-t interval of :func:`~.audit_gdp.mu_interval`. The other updates'
   projections only widen the scores' spread, so μ̂ is pulled down, never up: an estimate of what this
   adversary learns, flagged only when its lower end exceeds the μ whose ε(δ) is the claimed ε.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from scipy.stats import chi2

from ..core.calibration import gdp_epsilon, gdp_mu
from ..core.canaries import CanaryFrame
from .audit_gdp import gaussian_checks, mu_interval

__all__ = ["live_audit", "LiveAuditError"]

#: Each of the two tests' level (one-sided); the audit's default α = 0.001 split in two.
LEVEL = 0.0005


class LiveAuditError(ValueError):
    """A canary folder that cannot be scored (missing, unreadable, or too few rounds yet)."""


def _read(folder: Path) -> tuple[dict, dict[int, dict]]:
    meta_path, rounds_path = folder / "meta.json", folder / "rounds.jsonl"
    if not meta_path.exists() or not rounds_path.exists():
        raise LiveAuditError(f"{folder}: expected a canary folder (meta.json and rounds.jsonl, written by a node whose "
                             "policy has `canaries`); found neither. Give the run's folder, <state>/run-<run id>.")
    meta = json.loads(meta_path.read_text())
    rows: dict[int, dict] = {}
    for line in rounds_path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            rows[int(row["round"])] = row  # a repeated task (a retried round) observed the same iterate
    return meta, rows


def live_audit(folder: str | Path, *, level: float = LEVEL) -> dict:
    """The live audit of the canaries in ``folder`` (see the module): one JSON-ready dict."""
    folder = Path(folder)
    meta, rows = _read(folder)
    seen = sorted(rows)
    m = 0
    while m + 1 in rows:  # the consecutive tasks 1..m from the start
        m += 1
    if m < 2:
        raise LiveAuditError(f"{folder}: {len(seen)} task(s) observed ({seen[:5]}); scoring needs the tasks of rounds "
                             "1 and 2 at least (round r's release is read from the iterates of tasks r and r + 1).")
    eta, B = float(meta["learning_rate"]), int(meta["count"])
    n_min, P, n_p = int(meta["n_min"]), int(meta["clients"]), int(meta["num_samples"])
    y = np.array([rows[r]["projection"] for r in range(1, m + 1)])  # y[i] = U x_i, i = 0..m-1
    v = (y[:-1] - y[1:]) / eta  # v[r-1] = U ṽ_r, r = 1..m-1
    seed = int((folder / "seed").read_text().strip())
    signs = CanaryFrame(seed, B, int(meta["dim"])).signs
    plus, minus = signs > 0, signs < 0
    scores = np.zeros(B)
    q, df, mu2 = 0.0, 0, 0.0
    scored = 0
    for r in range(1, m):
        row = rows[r]
        radius, sd = float(row["radius"]), float(row["noise_std"])
        if not (radius > 0 and sd > 0):
            continue  # radius 0: nothing depends on the data
        a = v[r - 1] if row["restart"] else v[r - 1] - v[r - 2]
        z = a / sd
        q += float(((z[plus] - z[plus].mean()) ** 2).sum() + ((z[minus] - z[minus].mean()) ** 2).sum())
        df += B - 2
        weight = 2 * radius / (n_min * P * sd**2)
        scores += weight * a
        mu2 += (2 * radius / (n_min * P * sd)) ** 2
        scored += 1
    if scored == 0:
        raise LiveAuditError(f"{folder}: no observed round with a positive radius to score yet.")
    k_hat = math.sqrt(q / df)
    k_upper = math.sqrt(q / float(chi2.ppf(level, df)))
    k_lower = math.sqrt(q / float(chi2.isf(level, df)))
    d, d_prime = scores[plus], scores[minus]
    pooled = math.sqrt((np.var(d, ddof=1) + np.var(d_prime, ddof=1)) / 2)
    to_run = (n_p + B) / n_min  # a canary record is one of n_p + B; the claim is for one of n_min
    mu_c = float((d.mean() - d_prime.mean()) / pooled)
    lower_c, upper_c = mu_interval(mu_c, len(d), len(d_prime), level)
    mu_hat, lower, upper = mu_c * to_run, lower_c * to_run, upper_c * to_run
    epsilon, delta = float(meta["epsilon"]), float(meta["delta"])
    mu_critical = gdp_mu(epsilon, delta)
    checks = gaussian_checks(d, d_prime)

    def eps(mu: float) -> float:
        return gdp_epsilon(mu, delta) if mu > 0 else 0.0

    too_little_noise = k_upper < 1
    mu_violation = bool(checks["passed"] and lower > mu_critical)
    return {
        "folder": str(folder), "run_id": meta["run_id"], "node": meta["node"], "method": meta["method"],
        "canaries": B, "records": n_p, "n_min": n_min, "clients": P,
        "rounds": {"run": int(meta["rounds"]), "tasks_seen": m, "scored": scored,
                   "note": "round r is scored from the iterates of tasks r and r + 1: the last round is never seen"},
        "epsilon_claimed": epsilon, "delta": delta,
        "noise_scale": {"estimate": k_hat, "interval": [k_lower, k_upper], "df": df,
                        "meaning": "the noise the server added along the canaries over the calibrated noise (1: as "
                                   "declared); the run's own updates only raise the estimate, so the upper end is a "
                                   f"one-sided {1 - level:.2%} bound on it"},
        "mu": mu_hat, "mu_interval": [lower, upper], "epsilon": eps(mu_hat),
        "epsilon_interval": [eps(lower), eps(upper)],
        "mu_if_calibrated": math.sqrt(mu2),
        "mu_critical": mu_critical,
        "checks": checks,
        "violation": bool(too_little_noise or mu_violation),
        "findings": ([f"the server added at most {k_upper:.3f} x the calibrated noise (one-sided {1 - level:.2%})"]
                     if too_little_noise else [])
                    + ([f"μ̂ >= {lower:.3f} > {mu_critical:.3f}, the μ of the claimed ε = {epsilon:g}"]
                       if mu_violation else []),
        "level": level,
        "trust": "a data owner's check of the server's noise on the iterates it received, with canaries the server "
                 "cannot tell apart; it does not catch a server that releases correctly noised iterates and leaks "
                 "the clipped means another way",
    }
