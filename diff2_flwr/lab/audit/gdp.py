"""The audit's tight estimate: μ of the μ-GDP trade-off from the scores, its interval, ε̂(δ) and the
audit's power.

The audit's score is the likelihood-ratio statistic of the claimed Gaussian mechanism, summed over
every round of the run (:mod:`.audit`). Each round's term is (1/z_r)·(X_r/s_r) with X_r/s_r ~
N(±1/(2 z_r), k²) when the server adds k times the calibrated noise, whatever the (announced,
data-dependent) radius; the terms are independent given the past. So the scores are normal with one
variance under D and D′ and means μ_true·sd apart, with μ_true the whole run's μ = (Σ_r 1/z_r²)^½ /
k: the difference of means in units of the pooled standard deviation estimates it, without knowing
k.

    μ̂ = (mean_D − mean_D′) / s_pooled,
    T = μ̂ · (n_D n_D′ / (n_D + n_D′))^½ ~ noncentral t(n_D + n_D′ − 2, μ·(…)^½),

so the one-sided (1 − a) bounds on μ invert the noncentral t exactly (:func:`mu_interval`). μ-GDP
gives ε(δ) by δ(ε) = Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2)
(:func:`~diff2_flwr.core.calibration.gdp_epsilon`); ε is increasing in μ, so the claim is refuted at
level a when the lower bound on μ exceeds the μ whose ε(δ) is the claimed ε.

The assumption is the normal, equal-variance pair; :func:`gaussian_checks` tests it
(D'Agostino–Pearson on each federation's scores, the F test of equal variances), and the audit
counts this test only when the checks do not reject. For a mechanism whose true trade-off is not
Gaussian this is an estimate, not a bound: the audit keeps the distribution-free Clopper–Pearson
bound (:mod:`.stats`) beside it.

Power (:func:`detectable_noise_scale`): the test flags iff T > t_crit = the (1 − a) quantile of T at
the critical μ; with k times the calibrated noise, T has noncentrality μ/k·(…)^½, so the probability
of a flag is exact and the largest k flagged with probability 0.95 is found by bisection.

References:
    Dong, Roth & Su (2019), "Gaussian Differential Privacy", Cor. 2.13 (δ(ε) of μ-GDP), Cor. 3.3
    (composition).
    Nasr, Hayes, Steinke, Balle, Tramèr, Jagielski, Carlini & Terzis (2023), "Tight Auditing of
    Differentially Private Machine Learning", USENIX Security (μ from the scores of a white-box
    Gaussian audit).
"""

from __future__ import annotations

import functools
import math

import numpy as np
from scipy.optimize import brentq
from scipy.stats import f as f_dist
from scipy.stats import nct, normaltest

from ...core.calibration import gdp_epsilon, gdp_mu

__all__ = ["CHECK_LEVEL", "POWER", "detectable_noise_scale", "gaussian_checks", "gdp_audit",
           "mu_interval"]

#: A Gaussian check's p-value below this marks the μ-GDP estimate as not applicable (its assumption
#: rejected). Small: the three checks of Gaussian scores reject by chance with probability ≈ 3 ×
#: this, a loss of power (at 1e-3, one audit in about 300 of a √2 mistake went unflagged in a seeded
#: simulation); scores far from normal, the case the gate is for, give p-values far below it at the
#: audit's trial counts.
CHECK_LEVEL = 1e-6

#: The detection probability the power statement is made at.
POWER = 0.95


def _scale(n_d: int, n_d_prime: int) -> float:
    """(n_D n_D′ / (n_D + n_D′))^½: T = μ̂ times this."""
    return math.sqrt(n_d * n_d_prime / (n_d + n_d_prime))


def mu_interval(mu_hat: float, n_d: int, n_d_prime: int, a: float) -> tuple[float, float]:
    """One-sided (1 − a) lower and upper bounds on μ from μ̂ (each end holds with probability ≥ 1 −
    a).

    Inverts the noncentral t: the lower bound is the μ ≥ 0 at which T's upper tail beyond the
    observed T is a (0 if even μ = 0 makes it larger); the upper the μ at which its lower tail is a.
    """
    df, c = n_d + n_d_prime - 2, _scale(n_d, n_d_prime)
    t = mu_hat * c
    se = math.sqrt(1 / c**2 + mu_hat**2 / (2 * df))  # the delta method's: brackets the roots
    hi_bracket = abs(mu_hat) + 20 * se + 1.0

    def tail_above(mu: float) -> float:
        return float(nct.sf(t, df, mu * c))

    lower = 0.0 if tail_above(0.0) >= a else brentq(lambda m: tail_above(m) - a, 0.0, hi_bracket,
                                                     xtol=1e-12)
    upper = 0.0 if tail_above(0.0) >= 1 - a else brentq(lambda m: tail_above(m) - (1 - a), 0.0,
                                                         hi_bracket, xtol=1e-12)
    return lower, upper


def gaussian_checks(d: np.ndarray, d_prime: np.ndarray) -> dict:
    """Tests of the μ-GDP estimate's assumption: each federation's scores normal, and of one
    variance.

    Returns the p-values (D'Agostino–Pearson's K² on each; the two-sided F test of the variance
    ratio), the skewness and excess kurtosis of the standardised scores, and ``passed`` (no p-value
    below :data:`CHECK_LEVEL`).
    """
    var_d, var_p = float(np.var(d, ddof=1)), float(np.var(d_prime, ddof=1))
    ratio = var_d / var_p
    f_cdf = float(f_dist.cdf(ratio, len(d) - 1, len(d_prime) - 1))
    p_var = min(1.0, 2 * min(f_cdf, 1 - f_cdf))
    p_d, p_p = float(normaltest(d).pvalue), float(normaltest(d_prime).pvalue)

    def moments(x: np.ndarray) -> tuple[float, float]:
        z = (x - x.mean()) / x.std()
        return float(np.mean(z**3)), float(np.mean(z**4) - 3)

    (skew_d, kurt_d), (skew_p, kurt_p) = moments(d), moments(d_prime)
    return {"normality_p_d": p_d, "normality_p_d_prime": p_p, "equal_variance_p": p_var,
            "sd_ratio": math.sqrt(ratio), "skewness": [skew_d, skew_p],
            "excess_kurtosis": [kurt_d, kurt_p],
            "level": CHECK_LEVEL, "passed": min(p_d, p_p, p_var) >= CHECK_LEVEL}


def _flag_probability(mu_true: float, mu_critical: float, n: int, a: float) -> float:
    """P(the test flags) with n trials per federation when the scores' μ is ``mu_true``: P(T >
    t_crit)."""
    df, c = 2 * n - 2, _scale(n, n)
    t_crit = float(nct.isf(a, df, mu_critical * c))
    return float(nct.sf(t_crit, df, mu_true * c))


@functools.lru_cache(maxsize=256)  # pure; repeated audits of one schedule ask for the same
def detectable_noise_scale(mu_run: float, mu_critical: float, n: int, a: float,
                           power: float = POWER) -> float:
    """The largest k such that a mechanism adding k times the calibrated noise (scores' μ =
    ``mu_run``/k) is flagged with probability ≥ ``power`` by the test at level ``a`` with ``n``
    trials per federation (0 if none is)."""
    if _flag_probability(mu_run / 1e-3, mu_critical, n, a) < power:
        return 0.0
    hi = 1.0
    while _flag_probability(mu_run / hi, mu_critical, n, a) >= power:  # pragma: no cover
        hi *= 2  # a very loose claim
    return float(brentq(lambda k: _flag_probability(mu_run / k, mu_critical, n, a) - power, 1e-3,
                        hi, xtol=1e-6))


def gdp_audit(d: np.ndarray, d_prime: np.ndarray, *, epsilon_claimed: float, delta: float, a: float,
              mu_run: float, mu_claimed: float | None) -> dict:
    """The μ-GDP estimate of the scores and its verdict on the claimed ε, at level ``a``.

    ``mu_run``: the μ of the scores were the audited mechanism the calibrated one (for a μ-GDP
    claim, the claimed μ; for distributed noise, the Gaussian μ of the schedule): the unit of the
    power statement. (For distributed noise the power is the Gaussian equivalent's: the Skellam
    shares are close to Gaussian, and the clients' rounding, which ``--noise-scale`` does not scale,
    is far below the noise.) ``mu_claimed``: the claimed μ, if the claim is μ-GDP (``None``
    otherwise).
    """
    n_d, n_p = len(d), len(d_prime)
    pooled = math.sqrt(((n_d - 1) * np.var(d, ddof=1) + (n_p - 1) * np.var(d_prime, ddof=1))
                       / (n_d + n_p - 2))
    mu_hat = float((np.mean(d) - np.mean(d_prime)) / pooled)
    lower, upper = mu_interval(mu_hat, n_d, n_p, a)
    mu_critical = gdp_mu(epsilon_claimed, delta)  # ε(δ; μ) > ε claimed iff μ > this
    checks = gaussian_checks(d, d_prime)
    scale = detectable_noise_scale(mu_run, mu_critical, min(n_d, n_p), a)

    def eps(mu: float) -> float:
        return gdp_epsilon(mu, delta) if mu > 0 else 0.0

    return {
        "mu": mu_hat,
        "mu_interval": [lower, upper],
        "epsilon": eps(mu_hat),
        "epsilon_interval": [eps(lower), eps(upper)],
        "mu_claimed": mu_claimed,
        "mu_critical": mu_critical,
        "mu_of_calibrated_run": mu_run,
        "fraction_of_claimed_mu": mu_hat / mu_critical,
        "fraction_of_claimed_epsilon": eps(mu_hat) / epsilon_claimed,
        "level": a,
        "interval": f"each end a one-sided {1 - a:.4%} bound (noncentral t)",
        "checks": checks,
        "applicable": checks["passed"],
        "violation": bool(checks["passed"] and lower > mu_critical),
        "power": {"noise_scale": scale, "probability": POWER, "trials": min(n_d, n_p),
                  "statement": f"detects noise <= {scale:.3f} x calibrated with {POWER:.0%} "
                               f"probability at {min(n_d, n_p)} trials per federation (μ-GDP "
                               f"test, level {a:g})"},
        "assumption": "the scores are normal with one variance under D and D′ (a Gaussian "
                      "mechanism scored with its likelihood ratio); then ε(δ) of μ-GDP is exact. "
                      "Checked (`checks`); if rejected, not counted",
    }
