"""The audit's statistics: the likelihood-ratio scores under the claimed mechanism, and ε̂ from the
scores.

The local step's log-likelihood ratio and a client-sampled round's
(:func:`mixture_log_likelihood_ratio`), the claimed score's moments (which fix the threshold grid
of a diff2-bvr or a sampled audit), the fixed threshold grids, the Clopper–Pearson bounds and the
Bonferroni-corrected ε lower bound. What they mean: :mod:`.audit`.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.special import ndtri
from scipy.stats import beta

from ...core.privacy import Calibration, gdp_epsilon
from .spec import LOCAL_STEPS, AuditSpec

__all__ = ["POWER_SCALES", "claimed_score_moments", "clopper_pearson_upper", "epsilon_lower_bound",
           "local_log_likelihood_ratio", "local_power", "mixture_log_likelihood_ratio",
           "sampled_offsets", "sampled_score_moments", "score_grid", "threshold_grid"]

# ----------------------------------------------------------------- the scores' claimed distribution

def local_log_likelihood_ratio(t: np.ndarray | float, q: float, z: float) -> np.ndarray:
    """ln p_D(t) / p_D′(t) of one local step's output along e, in units of the canary's term Δ =
    c/b.

    Under D the canary adds +1 when sampled (probability q), under D′ −1; the noise is N(0, z²) with
    z the claimed z3 = σ3·b. Dividing both mixtures by the density of N(0, z²) at t:

        ln((1 − q) + q·exp((2t − 1)/(2z²))) − ln((1 − q) + q·exp((−2t − 1)/(2z²)));

    for q = 1 this is the Gaussian 2t/z².

    References:
        dp-accounting, ``privacy_loss_mechanism.AdditiveNoisePrivacyLoss`` (REPLACE, sub-sampled:
        the same pair).
    """
    t = np.asarray(t, dtype=np.float64)
    keep = -math.inf if q >= 1 else math.log1p(-q)
    log_q, two_z2 = math.log(q), 2 * z * z
    return (np.logaddexp(keep, log_q + (2 * t - 1) / two_z2)
            - np.logaddexp(keep, log_q + (-2 * t - 1) / two_z2))


def mixture_log_likelihood_ratio(t: np.ndarray | float, pi: float, centre: float,
                                 half: float) -> np.ndarray:
    """ln p_D(t) / p_D′(t) of one client-sampled round's output along e, in units of its noise std.

    The round's output is N(0, 1) when the canary's client is not in the cohort (probability 1 − π)
    and N(centre ± half, 1) when it is (+ under D, − under D′):

        ln((1 − π) φ(t) + π φ(t − centre − half)) − ln((1 − π) φ(t) + π φ(t − centre + half));

    dividing both by φ(t), φ(t − m)/φ(t) = exp(t m − m²/2). For π = 1 this is the Gaussian
    2·half·(t − centre); for centre = 0 and half = 1/z, t in units of z, the local step's
    (:func:`local_log_likelihood_ratio`).

    References:
        Neyman–Pearson: the likelihood ratio of the pair of mixtures the audit's federations make
        (:mod:`.runner`, client sampling).
    """
    t = np.asarray(t, dtype=np.float64)
    keep = -math.inf if pi >= 1 else math.log1p(-pi)
    log_pi, plus, minus = math.log(pi), centre + half, centre - half
    return (np.logaddexp(keep, log_pi + t * plus - plus * plus / 2)
            - np.logaddexp(keep, log_pi + t * minus - minus * minus / 2))


def sampled_offsets(z: float, samples: int) -> tuple[float, float]:
    """(centre, half) of a sampled round's output along e in units of its noise std, for the audit's
    canary client (its n − 1 other records at +C·e, the canary at ±C·e): centre = (n − 1)/(2z),
    half = 1/(2z), with z the round's claimed multiplier (std over 2C/(n E|S|))."""
    return (samples - 1) / (2 * z), 1 / (2 * z)


def _mixture_loss_moments(pi: float, centre: float, half: float,
                          nodes: int = 201) -> tuple[float, float]:
    """Mean and variance under D of :func:`mixture_log_likelihood_ratio` (Gauss–Hermite over each
    mixture part)."""
    x, w = np.polynomial.hermite_e.hermegauss(nodes)
    w = w / w.sum()
    first = second = 0.0
    for mean, weight in ((0.0, 1 - pi), (centre + half, pi)):
        if weight > 0:
            loss = mixture_log_likelihood_ratio(mean + x, pi, centre, half)
            first += weight * float(w @ loss)
            second += weight * float(w @ loss**2)
    return first, second - first**2


def sampled_score_moments(spec: AuditSpec, calibration: Calibration) -> tuple[float, float]:
    """Mean and standard deviation under D of a sampled audit's mixture score if the mechanism is
    the claimed one: a sum over rounds of independent :func:`mixture_log_likelihood_ratio` terms."""
    mean = variance = 0.0
    pi = calibration.sampling_prob
    for r in range(1, spec.rounds + 1):
        z = calibration.z1 if (r - 1) % spec.period == 0 else calibration.z2
        assert z is not None
        m, v = _mixture_loss_moments(pi, *sampled_offsets(z, spec.samples))
        mean, variance = mean + m, variance + v
    return mean, math.sqrt(variance)


def _local_loss_moments(q: float, z: float, nodes: int = 201) -> tuple[float, float]:
    """Mean and variance under D of :func:`local_log_likelihood_ratio` (Gauss–Hermite over each
    mixture part)."""
    x, w = np.polynomial.hermite_e.hermegauss(nodes)
    w = w / w.sum()
    first = second = 0.0
    for centre, weight in ((0.0, 1 - q), (1.0, q)):
        if weight > 0:
            loss = local_log_likelihood_ratio(centre + z * x, q, z)
            first += weight * float(w @ loss)
            second += weight * float(w @ loss**2)
    return first, second - first**2


def claimed_score_moments(spec: AuditSpec, calibration: Calibration) -> tuple[float, float]:
    """Mean and standard deviation under D of the audit's score if the mechanism is the claimed one.

    The score is a sum of independent log-likelihood ratios (given the announced radii): per server
    round a Gaussian one, N(1/(2z²), 1/z²), and per local step :func:`local_log_likelihood_ratio`'s.
    """
    mean = variance = 0.0
    for r in range(1, spec.rounds + 1):
        z = calibration.z1 if (r - 1) % spec.period == 0 else calibration.z2
        assert z is not None
        mean, variance = mean + 1 / (2 * z * z), variance + 1 / (z * z)
        if calibration.local is not None:
            m, v = _local_loss_moments(calibration.local.sampling_prob, calibration.local.z3)
            mean, variance = mean + (LOCAL_STEPS - 1) * m, variance + (LOCAL_STEPS - 1) * v
    return mean, math.sqrt(variance)


# --------------------------------------------------------------------------------------- statistics

def clopper_pearson_upper(k: np.ndarray | int, n: int, alpha: float) -> np.ndarray:
    """One-sided (1 − alpha) Clopper–Pearson upper bound on a rate with k successes in n trials."""
    k = np.asarray(k)
    return np.where(k >= n, 1.0, beta.ppf(1 - alpha, k + 1, np.maximum(n - k, 1)))


def _bounds(d: np.ndarray, d_prime: np.ndarray, thresholds: np.ndarray, alpha: float,
            delta: float) -> dict:
    """ε lower bounds (and their counts) at each threshold; "guess D iff score > t"."""
    d_sorted, p_sorted = np.sort(d), np.sort(d_prime)
    fn = np.searchsorted(d_sorted, thresholds, side="right")  # D scored <= t: missed
    fp = len(p_sorted) - np.searchsorted(p_sorted, thresholds, side="right")  # D′ scored > t
    fnr_hi = clopper_pearson_upper(fn, len(d), alpha / 2)
    fpr_hi = clopper_pearson_upper(fp, len(d_prime), alpha / 2)
    return {"epsilon": _epsilon_of_rates(fpr_hi, fnr_hi, delta), "fn": fn, "fp": fp,
            "fnr_hi": fnr_hi, "fpr_hi": fpr_hi}


def _epsilon_of_rates(fpr: np.ndarray | float, fnr: np.ndarray | float, delta: float) -> np.ndarray:
    """The smallest ε that (ε, δ)-DP allows for a test with these error rates (0 if none is
    implied): max(ln((1 − δ − FPR)/FNR), ln((1 − δ − FNR)/FPR), 0)."""
    fpr, fnr = np.asarray(fpr, dtype=float), np.asarray(fnr, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        one = np.log(np.clip(1 - delta - fpr, 0, None) / fnr)
        two = np.log(np.clip(1 - delta - fnr, 0, None) / fpr)
    return np.maximum(np.nan_to_num(np.maximum(one, two), nan=0.0, neginf=0.0, posinf=np.inf), 0.0)


def score_grid(mean: float, sd: float, points: int = 65) -> np.ndarray:
    """Thresholds fixed before any trial runs: mean + sd·k/4, k = −32..32, with the claimed score's
    mean and standard deviation under D (:func:`claimed_score_moments`); :func:`threshold_grid` for
    a μ-GDP claim."""
    half = (points - 1) // 2
    return mean + sd * np.arange(-half, half + 1) / 4


def threshold_grid(mu_claimed: float, points: int = 65) -> np.ndarray:
    """Thresholds fixed before any trial runs: μ²/2 + μ·k/4, k = −32..32, in the claimed score
    units.

    Under the claim the scores are N(±μ²/2, μ²); a mechanism with less noise than claimed keeps
    the means and shrinks the spread, so the grid covers both. Fixing it in advance (rather than
    picking the best threshold on the data) keeps the Clopper–Pearson intervals honest; the
    Bonferroni correction pays for taking the best of ``points`` thresholds.
    """
    half = (points - 1) // 2
    return mu_claimed**2 / 2 + mu_claimed * np.arange(-half, half + 1) / 4


def epsilon_lower_bound(d: np.ndarray, d_prime: np.ndarray, *, delta: float, thresholds: np.ndarray,
                        alpha: float = 0.05) -> dict:
    """ε̂ with confidence 1 − alpha from scores on D and D′: the best of the fixed ``thresholds``,
    each bound at level alpha/len(thresholds) (Bonferroni), so the maximum is a valid lower
    bound."""
    per_threshold = alpha / len(thresholds)
    bounds = _bounds(d, d_prime, thresholds, per_threshold, delta)
    k = int(np.argmax(bounds["epsilon"]))
    fn, fp = int(bounds["fn"][k]), int(bounds["fp"][k])
    fnr, fpr = fn / len(d), fp / len(d_prime)
    point = float(_epsilon_of_rates(fpr, fnr, delta))
    # Assuming a Gaussian trade-off curve (μ-GDP, as Nasr et al. 2023):
    # μ ≥ Φ⁻¹(1 − FPR⁺) − Φ⁻¹(FNR⁺).
    fpr_hi, fnr_hi = float(bounds["fpr_hi"][k]), float(bounds["fnr_hi"][k])
    mu_lower = (max(0.0, float(ndtri(1 - fpr_hi) - ndtri(fnr_hi)))
                if fpr_hi < 1 and fnr_hi < 1 else 0.0)
    return {
        "epsilon_lower_bound": float(bounds["epsilon"][k]),
        "threshold": float(thresholds[k]),
        "thresholds_tried": len(thresholds),
        "false_negatives": fn, "false_positives": fp,
        "fnr": fnr, "fpr": fpr, "fnr_upper": fnr_hi, "fpr_upper": fpr_hi,
        "epsilon_point_estimate": point,
        "mu_lower_bound_gdp": mu_lower,
        "epsilon_lower_bound_gdp": gdp_epsilon(mu_lower, delta) if mu_lower > 0 else 0.0,
    }


# ---------------------------------------------------------------- power of the Clopper–Pearson test

#: The local noise scales at which :func:`local_power` measures the test, largest first.
POWER_SCALES = (0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.25, 0.2, 0.15, 0.1)


def _simulated_local_scores(rng: np.random.Generator, spec: AuditSpec, calibration: Calibration,
                            scale: float, sign: int, n: int) -> np.ndarray:
    """n scores of a diff2-bvr audit under the claimed model with the local noise scaled by
    ``scale``: per round the server's Gaussian term N(±1/(2z²), 1/z²) and one local step's
    log-likelihood ratio at t = ±B + N(0, (k z3)²), B ~ Bernoulli(q) (the canary sampled), scored
    with the claimed z3."""
    assert calibration.local is not None
    q, z3 = calibration.local.sampling_prob, calibration.local.z3
    score = np.zeros(n)
    for r in range(1, spec.rounds + 1):
        z = calibration.z1 if (r - 1) % spec.period == 0 else calibration.z2
        assert z is not None
        score += rng.normal(sign / (2 * z * z), 1 / z, n)
        for _ in range(LOCAL_STEPS - 1):
            t = sign * (rng.random(n) < q) + rng.normal(0.0, scale * z3, n)
            score += local_log_likelihood_ratio(t, q, z3)
    return score


def local_power(spec: AuditSpec, calibration: Calibration, epsilon_claimed: float, *,
                reps: int = 100, power: float = 0.95, seed: int = 26) -> dict:
    """The power of a diff2-bvr audit's Clopper–Pearson test at its trial count, simulated from the
    claimed score model (the scores' claimed moments are checked on the real path by
    tests/test_audit.py): for each local noise scale k of :data:`POWER_SCALES`, the fraction of
    ``reps`` seeded audits of ``spec.trials`` runs per federation that report ε̂ > ε claimed;
    ``noise_scale`` is the largest k reported in at least ``power`` of them (``None`` if none
    is)."""
    # a simulation of the test, not the mechanism's noise: fixed on purpose
    rng = np.random.default_rng(seed)
    mean, sd = claimed_score_moments(spec, calibration)
    grid = score_grid(mean, sd)
    rates, found = {}, None
    for k in POWER_SCALES:
        hits = 0
        for _ in range(reps):
            d = _simulated_local_scores(rng, spec, calibration, k, +1, spec.trials)
            d_prime = _simulated_local_scores(rng, spec, calibration, k, -1, spec.trials)
            hits += epsilon_lower_bound(d, d_prime, delta=spec.delta, thresholds=grid,
                                        alpha=spec.alpha)["epsilon_lower_bound"] > epsilon_claimed
        rates[k] = hits / reps
        if rates[k] >= power:
            found = k
            break
    text = ("not reached at any local noise scale down to 0.1" if found is None else
            f"detects local noise <= {found:g} x calibrated with {power:.0%} probability")
    return {"noise_scale": found, "probability": power, "trials": spec.trials, "rates": rates,
            "reps": reps,
            "statement": f"{text} at {spec.trials} trials per federation (Clopper–Pearson test, "
                         f"level {spec.alpha:g}; simulated from the claimed score model, {reps} "
                         "seeded audits per scale)"}
