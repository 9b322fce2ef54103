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

**Client sampling** (:func:`cohort_gdp_audit`): a round's output carries the canary only when its
client is in the cohort, and the cohort is public (the journal records it; the accounting covers an
adversary who sees it). Given the cohorts, the drawn rounds S form a Gaussian mechanism of μ_S² =
Σ_{r∈S} 1/z_r², so the run's trade-off is the binomial mixture over S of μ_S-GDP, and ε(δ) of a
schedule whose per-round μ's are all ρ times the claimed ones is exact (:func:`sampled_epsilon`).
Per trial, with u_r the drawn round's output along e minus the canary client's known other records,
in units of the claimed std, G = Σ_{r∈S} u_r/z_r ~ N(±ρ μ_S²/2, μ_S²)·(noise scale): the regression
of y = G/μ_S on x = ±μ_S/2 through 0 gives ρ̂ = β̂/k̂ and T = ρ̂ (Σ x²)^½ ~ noncentral t(N − 1, ρ (Σ
x²)^½), exactly, given the cohorts (:func:`ncp_interval`).

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
from scipy.special import log_ndtr, ndtr
from scipy.stats import binom
from scipy.stats import f as f_dist
from scipy.stats import nct, normaltest

from ...core.calibration import gdp_epsilon, gdp_mu

__all__ = ["CHECK_LEVEL", "POWER", "cohort_gdp_audit", "detectable_noise_scale", "gaussian_checks",
           "gdp_audit", "mu_interval", "ncp_interval", "sampled_epsilon"]

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
    return ncp_interval(mu_hat, n_d + n_d_prime - 2, _scale(n_d, n_d_prime), a)


def ncp_interval(estimate: float, df: int, c: float, a: float) -> tuple[float, float]:
    """One-sided (1 − a) lower and upper bounds on θ ≥ 0 when T = ``estimate``·c ~ noncentral
    t(df, θ·c) (:func:`mu_interval`'s inversion, for any such estimate)."""
    t = estimate * c
    se = math.sqrt(1 / c**2 + estimate**2 / (2 * df))  # the delta method's: brackets the roots
    hi_bracket = abs(estimate) + 20 * se + 1.0

    def tail_above(theta: float) -> float:
        return float(nct.sf(t, df, theta * c))

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


# ------------------------------------------------------------------------------- client sampling

def _sampled_delta(epsilon: float, mu: np.ndarray, weight: np.ndarray) -> float:
    """δ(ε) of the binomial mixture of μ-GDP: Σ w δ_μ(ε) (Dong, Roth & Su, Cor. 2.13, per term)."""
    gauss = ndtr(-epsilon / mu + mu / 2) - np.exp(epsilon + log_ndtr(-epsilon / mu - mu / 2))
    return float(np.sum(weight * np.maximum(gauss, 0.0)))


def _drawn_support(m: int, pi: float) -> tuple[np.ndarray, np.ndarray]:
    """The numbers k of m rounds the client is drawn in, and their binomial weights (terms below
    1e-22 dropped: they change δ by < 1e-18)."""
    if m == 0:
        return np.array([0]), np.array([1.0])
    k = np.arange(m + 1)
    w = binom.pmf(k, m, pi)
    return k[w > 1e-22], w[w > 1e-22]


@functools.lru_cache(maxsize=1024)
def sampled_epsilon(delta: float, m1: int, z1: float, m2: int, z2: float | None,
                    pi: float) -> float:
    """The exact ε(δ) of m1 restart and m2 difference client-sampled Gaussian rounds (multipliers
    z1, z2 in :class:`~diff2_flwr.core.accounting.SampledGaussianEvent`'s convention), for an
    adversary who sees the cohorts: given the k1, k2 rounds the record's client was drawn in
    (independent binomials), the run is μ-GDP with μ² = k1/z1² + k2/z2², so δ(ε) = E_k δ_μ(ε).

    The mixture PLD the ledger composes is this pair's (pessimistically discretised); this is the
    closed form the cohort test inverts. 0 when δ(0) <= δ.

    References:
        Dong, Roth & Su (2019), Cor. 2.13 (δ(ε) of μ-GDP) and Cor. 3.3 (composition).
    """
    (k1, w1), (k2, w2) = _drawn_support(m1, pi), _drawn_support(m2, pi)
    mu2 = k1[:, None] / z1**2 + (k2[None, :] / z2**2 if m2 and z2 else 0.0)
    weight = (w1[:, None] * w2[None, :])[mu2 > 0]
    mu = np.sqrt(mu2[mu2 > 0])
    if mu.size == 0 or _sampled_delta(0.0, mu, weight) <= delta:
        return 0.0
    hi = 1.0
    while _sampled_delta(hi, mu, weight) > delta:
        hi *= 2
    return float(brentq(lambda e: _sampled_delta(e, mu, weight) - delta, 0.0, hi, xtol=1e-12,
                        rtol=1e-12))


def _epsilon_at_ratio(rho: float, delta: float, schedule: tuple[int, float, int, float | None,
                                                                 float]) -> float:
    """ε(δ) of the sampled ``schedule`` (m1, z1, m2, z2, π) with every round's μ times ρ."""
    if rho <= 0:
        return 0.0
    m1, z1, m2, z2, pi = schedule
    return sampled_epsilon(delta, m1, z1 / rho, m2, None if z2 is None else z2 / rho, pi)


def _critical_ratio(epsilon_claimed: float, delta: float,
                    schedule: tuple[int, float, int, float | None, float]) -> float:
    """ρ*: the μ ratio whose exact ε(δ) is the claimed ε (ε increases with ρ)."""
    hi = 2.0
    while _epsilon_at_ratio(hi, delta, schedule) <= epsilon_claimed:
        hi *= 2
    return float(brentq(lambda r: _epsilon_at_ratio(r, delta, schedule) - epsilon_claimed,
                        1e-6, hi, xtol=1e-9))


def _cohort_flag_probability(k: float, critical: float, df: int, c: float, a: float) -> float:
    """P(the cohort test flags) when the noise is k times the calibrated (ρ = 1/k)."""
    t_crit = float(nct.isf(a, df, critical * c))
    return float(nct.sf(t_crit, df, c / k))


def _cohort_power(critical: float, df: int, c: float, a: float) -> float:
    """The largest noise scale k flagged with probability ≥ :data:`POWER` (0 if none is)."""
    if _cohort_flag_probability(1e-3, critical, df, c, a) < POWER:
        return 0.0
    hi = 1.0
    while _cohort_flag_probability(hi, critical, df, c, a) >= POWER:  # pragma: no cover
        hi *= 2
    return float(brentq(lambda k: _cohort_flag_probability(k, critical, df, c, a) - POWER, 1e-3,
                        hi, xtol=1e-6))


def cohort_gdp_audit(d: np.ndarray, d_prime: np.ndarray, *, epsilon_claimed: float, delta: float,
                     a: float, schedule: tuple[int, float, int, float | None, float],
                     rounds: int) -> dict:
    """The cohort test of a client-sampled audit and its verdict on the claimed ε, at level ``a``
    (module docstring).

    Args:
        d, d_prime: per trial on D and on D′, the columns (G, μ_S²) (columns 1 and 2 of a sampled
            trial's scores); trials whose client was never drawn (μ_S = 0) carry nothing.
        epsilon_claimed, delta: the claim.
        a: the level.
        schedule: (m1, z1, m2, z2, π) of the claimed calibration.
        rounds: R (the power's expected share of trials with a draw).
    """
    g = np.concatenate([d[:, 0], d_prime[:, 0]])
    mu2 = np.concatenate([d[:, 1], d_prime[:, 1]])
    sign = np.concatenate([np.ones(len(d)), -np.ones(len(d_prime))])
    drawn = mu2 > 0
    mu = np.sqrt(mu2[drawn])
    y, x = g[drawn] / mu, sign[drawn] * mu / 2
    n = int(drawn.sum())
    if n < 3:
        raise ValueError(f"The cohort test needs trials whose canary client was drawn at least "
                         f"once; found {n} of {len(g)}. Raise --trials or --sampling-rate.")
    sxx = float(x @ x)
    beta = float(x @ y) / sxx
    residual = y - beta * x
    k_hat = math.sqrt(float(residual @ residual) / (n - 1))
    rho, c = beta / k_hat, math.sqrt(sxx)
    lower, upper = ncp_interval(rho, n - 1, c, a)
    critical = _critical_ratio(epsilon_claimed, delta, schedule)
    checks = gaussian_checks(residual[sign[drawn] > 0], residual[sign[drawn] < 0])
    m1, z1, m2, z2, pi = schedule
    # the power at this trial count, with the expected Σ x² and number of trials with a draw
    mu2_full = m1 / z1**2 + (m2 / z2**2 if m2 and z2 else 0.0)
    trials = min(len(d), len(d_prime))
    expected_c = math.sqrt(2 * trials * pi * mu2_full / 4)
    expected_df = max(2, int(2 * trials * (1 - (1 - pi) ** rounds)) - 1)
    scale = _cohort_power(critical, expected_df, expected_c, a)

    def eps(r: float) -> float:
        return _epsilon_at_ratio(r, delta, schedule)

    return {
        "test": "cohort",
        "mu": rho, "mu_interval": [lower, upper],
        "ratio_of_claimed_mu": rho, "noise_scale_estimate": 1 / rho if rho > 0 else math.inf,
        "epsilon": eps(rho), "epsilon_interval": [eps(lower), eps(upper)],
        "mu_critical": critical,
        "fraction_of_claimed_epsilon": eps(rho) / epsilon_claimed,
        "trials_with_canary_client_drawn": n,
        "level": a,
        "interval": f"each end a one-sided {1 - a:.4%} bound (noncentral t, given the cohorts)",
        "checks": checks,
        "applicable": checks["passed"],
        "violation": bool(checks["passed"] and lower > critical),
        "power": {"noise_scale": scale, "probability": POWER, "trials": trials,
                  "statement": f"detects noise <= {scale:.3f} x calibrated with {POWER:.0%} "
                               f"probability at {trials} trials per federation (cohort test, "
                               f"level {a:g})"},
        "assumption": "given the public cohorts, the drawn rounds' outputs along e are Gaussian "
                      "with the claimed shift (ρ = 1) and noise; ρ = the measured ratio of every "
                      "round's μ to the claimed one, ε(δ) of the sampled schedule at ρ exact "
                      "(sampled_epsilon). Checked on the residuals (`checks`); if rejected, not "
                      "counted",
    }
