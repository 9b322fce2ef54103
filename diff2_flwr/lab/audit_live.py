"""Score a data owner's canaries in a live run (``diff2 audit --live FOLDER``): how much noise the server really
added along them, and the μ-GDP estimate of the run from their scores. Reads what
:mod:`~diff2_flwr.runtime.canary_monitor` recorded; can run at any time while the run trains.

What the owner saw. Round r's task carried x_(r-1); the folder holds y_(r-1) = U x_(r-1) (U the canaries'
orthonormal frame, B rows). With routine gd, U ṽ_r = (y_(r-1) - y_r)/η for each round r whose task and the next
one were seen (round R never is: no task follows it), and the round's release along the frame is a_r = U ṽ_r on
a restart round, U(ṽ_r - ṽ_(r-1)) on a difference round:

    a_r = U(the other updates) + s·C_r/((n_p + B)P) + N(0, (k σ_r)² I_B),

σ_r the calibrated noise std, k the factor the server really used (k = 1: as declared), s the canaries' signs.

1. **The noise scale** k. Within each sign group the canary term is one constant, so the round's spread
   ρ_r² = Σ_k (a_rk/σ_r - its group's mean)²/(B - 2) is, given the past, k² times a noncentral χ²(B - 2)/(B - 2)
   whose noncentrality is the other updates' spread along the frame (≥ 0), with fresh noise each round. Early in
   training the other updates dominate some rounds; the bound reads the lower quartile of the rounds' spreads,
   whose law under pure noise is exact (:func:`noise_scale`): a one-sided (1 - a) upper bound k_upper on k. The
   claim is refuted when k_upper < 1: the server added less noise than declared. This needs nothing of the
   sensitivity, and the B - 2 degrees of freedom of each round give it power in one run.
2. **The μ-GDP estimate** (Andrew et al. 2024, on the whole trajectory rather than the final model): canary k's
   score is S_k = Σ_r w_r a_rk/σ_r with w_r = h_r/ρ_r², h_r = C_r/((n_p + B)P σ_r) the canary term in noise
   units — the likelihood-ratio weights for the spread each round shows (ρ_r² is independent of the group means
   for Gaussian noise, so the weights do not bias the scores). (mean₊ - mean₋)/sd estimates 2(Σ_r h_r²/ρ_r²)^½,
   which is μ_obs·n_min/(n_p + B) were the noise as declared and the other updates orthogonal to the frame
   (μ_obs: the calibrated μ of the observed rounds). μ̂ of the run (for a record of the smallest shard) is that
   times (n_p + B)/n_min, with the noncentral-t interval of :func:`~.audit_gdp.mu_interval`. It is exploratory,
   not a test: once the model reacts to the canaries (a difference round's update along u_k depends on where
   the canaries moved the iterate: measured on the default model, it cancels most of their signal), the B
   scores are neither independent trials nor free of that reaction. The verdict is the noise test's alone.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from scipy.stats import beta, chi2

from ..core.calibration import gdp_epsilon, gdp_mu
from ..core.canaries import CanaryFrame
from ..runtime.canary_monitor import META_FILE, ROUNDS_FILE, read_seed
from .audit_gdp import gaussian_checks, mu_interval

__all__ = ["live_audit", "LiveAuditError", "noise_scale"]

#: Each of the two tests' level (one-sided); the audit's default α = 0.001 split in two.
LEVEL = 0.0005

#: The order statistic of the rounds' spreads the noise-scale bound reads: their lower quartile (up to three
#: quarters of the rounds may be dominated by the run's own updates, early in training, without costing power).
QUANTILE = 0.25

#: The fewest canaries per sign the Gaussian checks of the (exploratory) μ̂ are run on.
MIN_CHECKED = 20

#: A round is scored only if its noise moves the iterate by at least this fraction of its largest entry
#: (float64 rounds x_r to ~1e-16 of it): the rounding then adds at most ~1e-20 of the noise variance.
ROUNDING_GUARD = 1e-6


def noise_scale(spread: np.ndarray, df: int, level: float, quantile: float = QUANTILE) -> tuple[float, float, int]:
    """(estimate, one-sided upper bound at ``level``, rank j) of k from the rounds' spreads ρ_r² (see the module).

    Given the past, ρ_r²/k² stochastically dominates χ²(df)/df, each round with fresh noise; so the j-th smallest
    of m spreads over k² dominates the j-th smallest of m independent χ²(df)/df, whose law is binomial:
    P(ρ_(j) ≤ c k²) ≤ P(Binom(m, F(c·df)) ≥ j). With c_a the c where that is ``level``, k ≤ (ρ_(j)/c_a)^½ with
    probability ≥ 1 - level. The estimate divides by the median of that order statistic instead.
    """
    m = len(spread)
    j = max(1, math.ceil(quantile * m))
    value = float(np.sort(spread)[j - 1])

    def c_at(p: float) -> float:
        # P(Binom(m, F(c df)) >= j) = p  <=>  F(c df) = the p-quantile of the j-th order statistic of m uniforms
        u = float(beta.ppf(p, j, m - j + 1))
        return float(chi2.ppf(u, df)) / df

    return math.sqrt(value / c_at(0.5)), math.sqrt(value / c_at(level)), j


class LiveAuditError(ValueError):
    """A canary folder that cannot be scored (missing, unreadable, or too few rounds yet)."""


def _read(folder: Path) -> tuple[dict, dict[int, dict]]:
    meta_path, rounds_path = folder / META_FILE, folder / ROUNDS_FILE
    if not meta_path.exists() or not rounds_path.exists():
        raise LiveAuditError(f"{folder}: expected a canary folder ({META_FILE} and {ROUNDS_FILE}, written by a node "
                             "whose policy has `canaries`); found neither. Give the run's folder, <state>/run-<run id>.")
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
    eta, B = float(meta["learning_rate"]), int(meta["count"])
    n_min, P, n_p = int(meta["n_min"]), int(meta["clients"]), int(meta["num_samples"])
    y = {r: np.asarray(row["projection"], dtype=np.float64) for r, row in rows.items()}  # task r: U x_(r-1)
    v = {r: (y[r] - y[r + 1]) / eta for r in seen if r + 1 in y}  # U ṽ_r, from the iterates of tasks r and r + 1
    if not v:
        raise LiveAuditError(f"{folder}: {len(seen)} task(s) observed ({seen[:5]}); scoring needs the tasks of two "
                             "consecutive rounds at least (round r's release is read from the iterates of tasks r and "
                             "r + 1).")
    signs = CanaryFrame(read_seed(folder), B, int(meta["dim"])).signs
    plus, minus = signs > 0, signs < 0
    spread, weight, z_rows, mu2, rounded = [], [], [], 0.0, 0
    for r in sorted(v):
        row = rows[r]
        radius, sd = float(row["radius"]), float(row["noise_std"])
        if not (radius > 0 and sd > 0):
            continue  # radius 0: nothing depends on the data
        if not row["restart"] and r - 1 not in v:
            continue  # a difference round's release needs ṽ_(r-1) too (the first task seen after a resume)
        used = (r - 1, r, r + 1) if not row["restart"] else (r, r + 1)
        if eta * sd < ROUNDING_GUARD * max(float(rows[t]["x_max"]) for t in used if t in rows):
            rounded += 1  # the iterate's rounding would be a visible part of the spread: not scored
            continue
        z = (v[r] if row["restart"] else v[r] - v[r - 1]) / sd
        rho2 = float(((z[plus] - z[plus].mean()) ** 2).sum() + ((z[minus] - z[minus].mean()) ** 2).sum()) / (B - 2)
        h = radius / ((n_p + B) * P * sd)  # the canary term in noise units
        spread.append(rho2)
        weight.append(h / rho2)
        z_rows.append(z)
        mu2 += (2 * radius / (n_min * P * sd)) ** 2
    if not spread:
        raise LiveAuditError(f"{folder}: no observed round with a positive radius to score yet.")
    k_hat, k_upper, rank = noise_scale(np.array(spread), B - 2, level)
    scores = np.array(weight) @ np.array(z_rows)  # [B]: each canary's score over the scored rounds
    d, d_prime = scores[plus], scores[minus]
    pooled = math.sqrt((np.var(d, ddof=1) + np.var(d_prime, ddof=1)) / 2)
    to_run = (n_p + B) / n_min  # a canary record is one of n_p + B; the claim is for one of n_min
    mu_c = float((d.mean() - d_prime.mean()) / pooled)
    lower_c, upper_c = mu_interval(mu_c, len(d), len(d_prime), level)
    mu_hat, lower, upper = mu_c * to_run, lower_c * to_run, upper_c * to_run
    epsilon, delta = float(meta["epsilon"]), float(meta["delta"])
    mu_critical = gdp_mu(epsilon, delta)
    checks = (gaussian_checks(d, d_prime) if len(d) >= MIN_CHECKED else
              {"passed": None, "reason": f"{len(d)} canaries per sign: the normality checks need {MIN_CHECKED}"})
    scored = len(spread)

    def eps(mu: float) -> float:
        return gdp_epsilon(mu, delta) if mu > 0 else 0.0

    too_little_noise = k_upper < 1
    return {
        "folder": str(folder), "run_id": meta["run_id"], "node": meta["node"], "method": meta["method"],
        "canaries": B, "records": n_p, "n_min": n_min, "clients": P,
        "rounds": {"run": int(meta["rounds"]), "tasks_seen": len(seen), "scored": scored, "below_rounding": rounded,
                   "note": "round r is scored from the iterates of tasks r and r + 1: the last round is never seen"},
        "epsilon_claimed": epsilon, "delta": delta,
        "noise_scale": {"estimate": k_hat, "upper": k_upper, "rank": rank,
                        "meaning": "the noise the server added along the canaries over the calibrated noise (1: as "
                                   "declared), from the rounds' spreads (their lower quartile): the run's own updates "
                                   f"only raise it, so `upper` is a one-sided {1 - level:.2%} bound"},
        "mu": mu_hat, "mu_interval": [lower, upper], "epsilon": eps(mu_hat),
        "epsilon_interval": [eps(lower), eps(upper)],
        "mu_if_calibrated": math.sqrt(mu2),
        "mu_critical": mu_critical,
        "checks": checks,
        "mu_estimate_is": "exploratory: the canaries of one run are not independent trials once the model reacts "
                          "to them (its updates along the frame depend on where the canaries moved it), so μ̂ is what "
                          "this adversary reaches, with a nominal interval; it is not a test",
        "violation": too_little_noise,
        "findings": ([f"the iterates carry at most {k_upper:.3f} x the calibrated noise along the canaries (one-sided "
                      f"{1 - level:.2%}): the server added less noise than declared, or used another learning rate"]
                     if too_little_noise else []),
        "level": level,
        "trust": "a data owner's check of the server's noise on the iterates it received, with canaries the server "
                 "cannot tell apart; it does not catch a server that releases correctly noised iterates and leaks "
                 "the clipped means another way",
    }
