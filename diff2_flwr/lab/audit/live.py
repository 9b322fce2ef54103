"""Score a data owner's canaries in a live run (``diff2 audit --live FOLDER``): how much noise the
server really added along them, whether that noise is fresh in every round, and the μ-GDP estimate
of the run from their scores. Reads what :mod:`~diff2_flwr.runtime.canary_monitor` recorded; can run
at any time while the run trains.

What the owner saw. Round r's task carried x_(r-1); the folder holds y_(r-1) = U x_(r-1) (U the
canaries' orthonormal frame, B rows). With routine gd, U ṽ_r = (y_(r-1) - y_r)/η for each round r
whose task and the next one were seen (round R never is: no task follows it), and the round's
release along the frame is a_r = U ṽ_r on a restart round, U(ṽ_r - ṽ_(r-1)) on a difference round:

    a_r = U(the other updates) + s·C_r/((n_p + B)P) + N(0, (k σ_r)² I_B),

σ_r the calibrated noise std, k the factor the server really used (k = 1: as declared), s the
canaries' signs. Within each sign group the canary term is one constant: the round's residual e_r =
a_r/σ_r minus its two group means lies in a fixed (B - 2)-dimensional subspace, where the declared
noise is isotropic N(0, k² I), fresh every round. Its norm and its direction θ_r = e_r/‖e_r‖ are
independent, and under declared noise with nothing else along the frame the θ_r are independent and
uniform on that subspace's sphere whatever the rounds' scales are. Three tests read them, each at
α/3 (Bonferroni; α = :data:`ALPHA`): ``violation`` when any rejects.

1. **The noise scale** k, from the norms. The round's spread ρ_r² = ‖e_r‖²/(B - 2) is, given the
   past, k² times a noncentral χ²(B - 2)/(B - 2) whose noncentrality is the other updates' spread
   along the frame (≥ 0), with fresh noise each round. Early in training the other updates dominate
   some rounds; the bound reads the lower quartile of the rounds' spreads, whose law under pure
   noise is exact (:func:`noise_scale`): a one-sided (1 - α/3) upper bound k_upper on k. The claim
   is refuted when k_upper < 1: the server added less noise than declared. This needs nothing of the
   sensitivity, and the B - 2 degrees of freedom of each round give it power in one run.
2. **Serial correlation**, from the directions (:func:`serial_correlation`). A spread reads one
   round alone: noise repeated in every round (n_r = n_(r-1)) or anti-correlated (n_r = -n_(r-1), or
   n_r = g_r - g_(r-1)) shows each round the declared spread, yet cancels in the differences of the
   releases or in the trajectory (x_r sums them). For lags ℓ = 1..3, R_ℓ is the mean of
   <θ_r, θ_(r+ℓ)> over the pairs of scored rounds ℓ apart; under independent isotropic noise each
   term has mean 0 and variance 1/(B - 2) exactly and the terms are uncorrelated, so
   z_ℓ = R_ℓ (n_ℓ (B - 2))^½ is about N(0, 1) and Q = Σ_ℓ z_ℓ² about χ²(3) (Box–Pierce),
   two-sided: both signs are faults. The p-value is Q's exact rank among random sign flips of the
   rounds (few rounds or canaries make the χ² law's far tail too light: 3 × the level at 20 rounds
   and B = 4).
3. **The trajectory's sum** (:func:`trajectory_sum`): W = (B - 2)‖Σ_r θ_r‖²/m over the m scored
   rounds has mean B - 2 exactly under independent rounds and law ≈ χ²(B - 2); noise that cancels
   over the rounds (the sum the iterate carries) makes it small, whatever the lags it cancels at.
   One-sided: a persistent direction (the run's own gradient along the frame) only raises it.

The direction tests are self-normalised: k is the spread test's, and a round the run's own updates
dominate weighs as much as any other (|<θ_r, θ_s>| ≤ 1), so a few such rounds early in training move
z_ℓ by (B - 2)^½/n_ℓ^½ each at most. They are not free of those updates: a gradient that keeps its
direction correlates rounds positively, and the model's reaction to the noise (a difference round's
update is about -ηH times the last round's noise) negatively. They run once :data:`MIN_ROUNDS`
rounds are scored (their normal and χ² laws are approximations over rounds).

4. **The μ-GDP estimate** (Andrew et al. 2024, on the whole trajectory rather than the final model):
   canary k's score is S_k = Σ_r w_r a_rk/σ_r with w_r = h_r/ρ_r², h_r = C_r/((n_p + B)P σ_r) the
   canary term in noise units — the likelihood-ratio weights for the spread each round shows (ρ_r²
   is independent of the group means for Gaussian noise, so the weights do not bias the scores).
   (mean₊ - mean₋)/sd estimates 2(Σ_r h_r²/ρ_r²)^½, which is μ_obs·n_min/(n_p + B) were the noise as
   declared and the other updates orthogonal to the frame (μ_obs: the calibrated μ of the observed
   rounds). μ̂ of the run (for a record of the smallest shard) is that times (n_p + B)/n_min, with
   the noncentral-t interval of :func:`~.gdp.mu_interval`. It is exploratory, not a test: once the
   model reacts to the canaries (a difference round's update along u_k depends on where the canaries
   moved the iterate: measured on the default model, it cancels most of their signal), the B scores
   are neither independent trials nor free of that reaction. The verdict is the three tests' alone.

References:
    Box & Pierce (1970), "Distribution of residual autocorrelations in autoregressive-integrated
    moving average time series models", JASA 65 (the portmanteau Q); Andrew, Kairouz, Oh, Oprea,
    McMahan & Suriyakumar (2024), "One-shot Empirical Privacy Estimation for Federated Learning",
    ICLR.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.stats import beta, chi2

from ...core.calibration import gdp_epsilon, gdp_mu
from ...core.canaries import CanaryFrame
from ...runtime.canary_monitor import META_FILE, ROUNDS_FILE, read_seed
from .gdp import gaussian_checks, mu_interval

__all__ = ["ALPHA", "LAGS", "LiveAuditError", "MIN_ROUNDS", "TESTS", "live_audit", "noise_scale",
           "serial_correlation", "spread_p_value", "trajectory_sum"]

#: The audit's family-wise level: a server adding the declared, independent noise is flagged at most
#: this often.
ALPHA = 0.001

#: The tests the verdict reads, each at ALPHA / len(TESTS) (Bonferroni: valid whatever their
#: dependence).
TESTS = ("noise_scale", "serial_correlation", "trajectory_sum")

#: Each test's level (one-sided for the spread and the sum, two-sided for the serial correlation).
LEVEL = ALPHA / len(TESTS)

#: The lags of the serial-correlation test (rounds apart).
LAGS = (1, 2, 3)

#: Random sign flips of the serial-correlation test (its smallest p-value is 1/(FLIPS + 1)), and
#: their seed.
FLIPS = 9999
FLIP_SEED = 38

#: The fewest scored rounds the across-round tests run on: the sum's law is a χ² approximation over
#: rounds (measured on 400,000 simulated runs of 20 rounds and B = 4: a rate of 3.8e-4 at a nominal
#: 3.3e-4).
MIN_ROUNDS = 20

#: The order statistic of the rounds' spreads the noise-scale bound reads: their lower quartile (up
#: to three quarters of the rounds may be dominated by the run's own updates, early in training,
#: without costing power).
QUANTILE = 0.25

#: The fewest canaries per sign the Gaussian checks of the (exploratory) μ̂ are run on.
MIN_CHECKED = 20

#: A round is scored only if its noise moves the iterate by at least this fraction of its largest
#: entry (float64 rounds x_r to ~1e-16 of it): the rounding then adds at most ~1e-20 of the noise
#: variance.
ROUNDING_GUARD = 1e-6


def _order_quantile(m: int, j: int, df: int, p: float) -> float:
    """The c with P(j-th smallest of m independent χ²(df)/df ≤ c) = p."""
    # P(Binom(m, F(c df)) >= j) = p  <=>  F(c df) = the p-quantile of the j-th order statistic of
    # m uniforms
    return float(chi2.ppf(float(beta.ppf(p, j, m - j + 1)), df)) / df


def noise_scale(spread: np.ndarray, df: int, level: float,
                quantile: float = QUANTILE) -> tuple[float, float, int]:
    """(estimate, one-sided upper bound at ``level``, rank j) of k from the rounds' spreads ρ_r²
    (see the module).

    Given the past, ρ_r²/k² stochastically dominates χ²(df)/df, each round with fresh noise; so the
    j-th smallest of m spreads over k² dominates the j-th smallest of m independent χ²(df)/df, whose
    law is binomial: P(ρ_(j) ≤ c k²) ≤ P(Binom(m, F(c·df)) ≥ j). With c_a the c where that is
    ``level``, k ≤ (ρ_(j)/c_a)^½ with probability ≥ 1 - level. The estimate divides by the median of
    that order statistic instead.
    """
    m = len(spread)
    j = max(1, math.ceil(quantile * m))
    value = float(np.sort(spread)[j - 1])
    return (math.sqrt(value / _order_quantile(m, j, df, 0.5)),
            math.sqrt(value / _order_quantile(m, j, df, level)), j)


def spread_p_value(spread: np.ndarray, df: int, quantile: float = QUANTILE) -> float:
    """The p-value of k ≥ 1 from the rounds' spreads: the smallest level at which
    :func:`noise_scale`'s bound is below 1, P(j-th smallest of m χ²(df)/df ≤ ρ_(j)) (exact for pure
    noise, conservative with other updates)."""
    m = len(spread)
    j = max(1, math.ceil(quantile * m))
    return float(beta.cdf(chi2.cdf(float(np.sort(spread)[j - 1]) * df, df), j, m - j + 1))


def serial_correlation(rounds: Sequence[int], directions: np.ndarray, df: int,
                       lags: Sequence[int] = LAGS, *, flips: int = FLIPS,
                       seed: int = FLIP_SEED) -> dict:
    """Box–Pierce test that the noise directions θ_r of rounds ``rounds`` ([m, B] rows) are
    independent across rounds.

    R_ℓ = mean of <θ_r, θ_(r+ℓ)> over the n_ℓ pairs of scored rounds ℓ apart; under independent
    isotropic noise in ``df`` dimensions each term has mean 0, variance 1/df and none is correlated
    with another (of any lag), so z_ℓ = R_ℓ (n_ℓ df)^½ is about N(0, 1) and Q = Σ_ℓ z_ℓ² about
    χ²(lags) (``p_value_box_pierce``). The verdict's p-value is exact instead: a sign-flip
    randomisation test. Noise that is independent across rounds and symmetric (θ_r and -θ_r equally
    likely) keeps its law when each round's sign is flipped at random, so Q among the Q's of
    ``flips`` random flips of the observed rounds is uniform: p = (1 + #{Q* ≥ Q})/(flips + 1), for
    any m and df. (A permutation of the rounds would not do: noise repeated every round is invariant
    under it.)

    References:
        Box & Pierce (1970), JASA 65, eq. (2.8): Q = n Σ r_ℓ², χ² with as many degrees of freedom
        as lags;
        Good (2005), "Permutation, Parametric and Bootstrap Tests of Hypotheses" (randomisation
        tests).
    """
    index = {r: i for i, r in enumerate(rounds)}
    used, pairs, terms = [], [], []
    for lag in lags:
        first = np.array([index[r] for r in rounds if r + lag in index], dtype=np.int64)
        if len(first):
            second = np.array([index[rounds[i] + lag] for i in first], dtype=np.int64)
            used.append(lag)
            pairs.append((first, second))
            terms.append(np.einsum("ij,ij->i", directions[first], directions[second]))
    scale = [math.sqrt(df / len(t)) for t in terms]
    z = [float(t.sum() * c) for t, c in zip(terms, scale)]
    q = float(np.sum(np.square(z)))
    # the test's own randomisation, not the mechanism's noise: fixed on purpose
    rng = np.random.default_rng(seed)
    exceed, left = 0, flips
    while left > 0:
        sign = rng.integers(0, 2, size=(min(left, 1000), len(rounds))) * 2.0 - 1.0
        q_star = sum(((sign[:, f] * sign[:, s]) @ t * c) ** 2
                     for (f, s), t, c in zip(pairs, terms, scale))
        exceed += int(np.count_nonzero(q_star >= q * (1 - 1e-12)))  # ties count against the data
        left -= len(sign)
    return {"lags": used, "correlation": [float(t.mean()) for t in terms], "z": z,
            "pairs": [len(t) for t in terms],
            "statistic": q, "df": len(used), "flips": flips,
            "p_value": (1 + exceed) / (flips + 1) if used else 1.0,
            "p_value_box_pierce": float(chi2.sf(q, len(used))) if used else 1.0}


def trajectory_sum(directions: np.ndarray, df: int) -> dict:
    """Test that the noise directions θ_r ([m, B] rows, in a ``df``-dimensional subspace) do not
    cancel over rounds.

    W = df ‖Σ_r θ_r‖²/m has mean df exactly when the rounds are independent and isotropic (every
    cross term has mean 0), and Σ_r θ_r/m^½ is then N(0, I/df) by the central limit theorem over
    rounds: W ≈ χ²(df). Noise that cancels over the trajectory gives W ≈ 0 (``ratio`` = W/df ≈ 0; 1
    for independent rounds); the p-value is the lower tail.
    """
    m = len(directions)
    total = directions.sum(axis=0)
    w = df * float(total @ total) / m
    return {"statistic": w, "ratio": w / df, "df": df, "rounds": m,
            "p_value": float(chi2.cdf(w, df))}


class LiveAuditError(ValueError):
    """A canary folder that cannot be scored (missing, unreadable, or too few rounds yet)."""


def _read(folder: Path) -> tuple[dict, dict[int, dict]]:
    meta_path, rounds_path = folder / META_FILE, folder / ROUNDS_FILE
    if not meta_path.exists() or not rounds_path.exists():
        raise LiveAuditError(f"{folder}: expected a canary folder ({META_FILE} and {ROUNDS_FILE}, "
                             "written by a node whose policy has `canaries`); found neither. Give "
                             "the run's folder, <state>/run-<run id>.")
    meta = json.loads(meta_path.read_text())
    rows: dict[int, dict] = {}
    for line in rounds_path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            # a repeated task (a retried round) observed the same iterate
            rows[int(row["round"])] = row
    return meta, rows


@dataclass(frozen=True)
class _Scored:
    """What the scored rounds show along the frame (see the module)."""

    rounds: list[int]  # the scored rounds
    spread: np.ndarray  # [m] ρ_r²
    weight: np.ndarray  # [m] w_r = h_r/ρ_r²
    z: np.ndarray  # [m, B] a_r/σ_r
    # [m', B] θ_r of the rounds in `direction_rounds` (a residual of norm 0 has none)
    directions: np.ndarray
    direction_rounds: list[int]
    mu2: float  # the calibrated μ² of the scored rounds
    rounded: int  # rounds left out: their noise is below the iterate's rounding


def _score(folder: Path, meta: dict, rows: dict[int, dict]) -> _Scored:
    seen = sorted(rows)
    eta, B = float(meta["learning_rate"]), int(meta["count"])
    n_min, P, n_p = int(meta["n_min"]), int(meta["clients"]), int(meta["num_samples"])
    # task r: U x_(r-1)
    y = {r: np.asarray(row["projection"], dtype=np.float64) for r, row in rows.items()}
    # U ṽ_r, from the iterates of tasks r and r + 1
    v = {r: (y[r] - y[r + 1]) / eta for r in seen if r + 1 in y}
    if not v:
        raise LiveAuditError(f"{folder}: {len(seen)} task(s) observed ({seen[:5]}); scoring needs "
                             "the tasks of two consecutive rounds at least (round r's release is "
                             "read from the iterates of tasks r and r + 1).")
    signs = CanaryFrame(read_seed(folder), B, int(meta["dim"])).signs
    groups = (signs > 0, signs < 0)
    scored, spread, weight, z_rows, theta, theta_rounds, mu2, rounded = (
        [], [], [], [], [], [], 0.0, 0)
    for r in sorted(v):
        row = rows[r]
        radius, sd = float(row["radius"]), float(row["noise_std"])
        if not (radius > 0 and sd > 0):
            continue  # radius 0: nothing depends on the data
        if not row["restart"] and r - 1 not in v:
            # a difference round's release needs ṽ_(r-1) too (the first task seen after a resume)
            continue
        used = (r - 1, r, r + 1) if not row["restart"] else (r, r + 1)
        if eta * sd < ROUNDING_GUARD * max(float(rows[t]["x_max"]) for t in used if t in rows):
            rounded += 1  # the iterate's rounding would be a visible part of the spread: not scored
            continue
        z = (v[r] if row["restart"] else v[r] - v[r - 1]) / sd
        residual = z.copy()
        for group in groups:
            residual[group] -= residual[group].mean()
        norm2 = float(residual @ residual)
        rho2 = norm2 / (B - 2)
        scored.append(r)
        spread.append(rho2)
        # h_r/ρ_r², h_r the canary term in noise units
        weight.append(radius / ((n_p + B) * P * sd) / rho2)
        z_rows.append(z)
        if norm2 > 0:
            theta.append(residual / math.sqrt(norm2))
            theta_rounds.append(r)
        mu2 += (2 * radius / (n_min * P * sd)) ** 2
    if not spread:
        raise LiveAuditError(f"{folder}: no observed round with a positive radius to score yet.")
    return _Scored(scored, np.array(spread), np.array(weight), np.array(z_rows),
                   np.array(theta).reshape(len(theta), B), theta_rounds, mu2, rounded)


def _tests(seen: _Scored, df: int, level: float) -> dict:
    """The three tests' statistics, p-values and verdicts at ``level`` each (see the module)."""
    k_hat, k_upper, rank = noise_scale(seen.spread, df, level)
    tests = {"noise_scale": {
        "statistic": float(np.sort(seen.spread)[rank - 1]), "rank": rank, "estimate": k_hat,
        "upper": k_upper, "p_value": spread_p_value(seen.spread, df),
        "null": f"the {rank}-th smallest of {len(seen.spread)} spreads ρ_r² is at least that of as "
                f"many independent χ²({df})/{df} (k = 1); one-sided, lower tail",
        "meaning": "the noise the server added along the canaries over the calibrated noise (1: as "
                   "declared), from the rounds' spreads (their lower quartile): the run's own "
                   f"updates only raise it, so `upper` is a one-sided {1 - level:.3%} bound"}}
    m = len(seen.direction_rounds)
    if m < MIN_ROUNDS or df < 1:
        reason = f"{m} rounds with a noise direction: the across-round tests need {MIN_ROUNDS}"
        skipped = {"statistic": None, "p_value": None, "rejected": None, "reason": reason}
        tests["serial_correlation"], tests["trajectory_sum"] = dict(skipped), dict(skipped)
    else:
        tests["serial_correlation"] = {
            **serial_correlation(seen.direction_rounds, seen.directions, df,
                                 flips=max(FLIPS, math.ceil(3 / level))),
            "null": "Q = Σ_ℓ z_ℓ², z_ℓ = R_ℓ (n_ℓ (B - 2))^½: its rank among the Q's of random "
                    "sign flips of the rounds (exact for independent, symmetric noise); about "
                    "χ²(lags) (Box–Pierce); two-sided in R_ℓ",
            "meaning": "R_ℓ: the mean correlation of the noise's directions ℓ rounds apart, 0 for "
                       "fresh noise, 1 for noise repeated every round, -1 for n_r = -n_(r-1)"}
        tests["trajectory_sum"] = {
            **trajectory_sum(seen.directions, df),
            "null": f"W = (B - 2)‖Σ_r θ_r‖²/m ≈ χ²({df}), mean {df} exactly; one-sided, lower tail",
            "meaning": "`ratio`: the variance of the sum of the rounds' noise directions over what "
                       "independent rounds give (1); near 0 when the noise cancels over the "
                       "trajectory the iterate carries"}
    for test in tests.values():
        if test["p_value"] is not None:
            test["level"], test["rejected"] = level, test["p_value"] < level
    return tests


def _findings(tests: dict, level: float) -> list[str]:
    found = []
    if tests["noise_scale"]["rejected"]:
        found.append(f"the iterates carry at most {tests['noise_scale']['upper']:.3f} x the "
                     f"calibrated noise along the canaries (one-sided {1 - level:.3%}): the server "
                     "added less noise than declared, or used another learning rate")
    if tests["serial_correlation"]["rejected"]:
        lags = ", ".join(f"lag {lag}: {r:+.3f}"
                         for lag, r in zip(tests["serial_correlation"]["lags"],
                                           tests["serial_correlation"]["correlation"]))
        found.append(f"the noise along the canaries is correlated across rounds ({lags}; p = "
                     f"{tests['serial_correlation']['p_value']:.2g}): noise repeated or "
                     "anti-correlated across rounds cancels in the releases' differences or in the "
                     "trajectory")
    if tests["trajectory_sum"]["rejected"]:
        found.append(f"the rounds' noise cancels over the trajectory: the sum of its directions "
                     f"has {tests['trajectory_sum']['ratio']:.3f} x the variance of independent "
                     f"rounds (p = {tests['trajectory_sum']['p_value']:.2g}): the iterates carry "
                     "less noise than declared")
    return found


def live_audit(folder: str | Path, *, alpha: float = ALPHA) -> dict:
    """The live audit of the canaries in ``folder`` (see the module): one JSON-ready dict.

    Args:
        folder: the run's canary folder, ``<state>/run-<run id>``.
        alpha: the family-wise level of the three tests (Bonferroni: each at ``alpha``/3).
    """
    folder = Path(folder)
    meta, rows = _read(folder)
    B, n_min, P, n_p = (int(meta["count"]), int(meta["n_min"]), int(meta["clients"]),
                        int(meta["num_samples"]))
    seen = _score(folder, meta, rows)
    level = alpha / len(TESTS)
    tests = _tests(seen, B - 2, level)
    signs = CanaryFrame(read_seed(folder), B, int(meta["dim"])).signs
    scores = seen.weight @ seen.z  # [B]: each canary's score over the scored rounds
    d, d_prime = scores[signs > 0], scores[signs < 0]
    pooled = math.sqrt((np.var(d, ddof=1) + np.var(d_prime, ddof=1)) / 2)
    to_run = (n_p + B) / n_min  # a canary record is one of n_p + B; the claim is for one of n_min
    mu_c = float((d.mean() - d_prime.mean()) / pooled)
    lower_c, upper_c = mu_interval(mu_c, len(d), len(d_prime), level)
    mu_hat, lower, upper = mu_c * to_run, lower_c * to_run, upper_c * to_run
    epsilon, delta = float(meta["epsilon"]), float(meta["delta"])
    checks = (gaussian_checks(d, d_prime) if len(d) >= MIN_CHECKED else
              {"passed": None, "reason": f"{len(d)} canaries per sign: the normality checks need "
                                         f"{MIN_CHECKED}"})

    def eps(mu: float) -> float:
        return gdp_epsilon(mu, delta) if mu > 0 else 0.0

    findings = _findings(tests, level)
    k = tests["noise_scale"]
    return {
        "folder": str(folder), "run_id": meta["run_id"], "node": meta["node"],
        "method": meta["method"],
        "canaries": B, "records": n_p, "n_min": n_min, "clients": P,
        "rounds": {"run": int(meta["rounds"]), "tasks_seen": len(rows), "scored": len(seen.rounds),
                   "below_rounding": seen.rounded,
                   "note": "round r is scored from the iterates of tasks r and r + 1: the last "
                           "round is never seen"},
        "epsilon_claimed": epsilon, "delta": delta,
        "noise_scale": {"estimate": k["estimate"], "upper": k["upper"], "rank": k["rank"],
                        "meaning": k["meaning"]},
        "tests": tests,
        "multiplicity": f"Bonferroni: family-wise level α = {alpha:g} over the {len(TESTS)} tests "
                        f"({', '.join(TESTS)}), each at α/{len(TESTS)} = {level:.3g}; `violation` "
                        "when any rejects",
        "mu": mu_hat, "mu_interval": [lower, upper], "epsilon": eps(mu_hat),
        "epsilon_interval": [eps(lower), eps(upper)],
        "mu_if_calibrated": math.sqrt(seen.mu2),
        "mu_critical": gdp_mu(epsilon, delta),
        "checks": checks,
        "mu_estimate_is": "exploratory: the canaries of one run are not independent trials once "
                          "the model reacts to them (its updates along the frame depend on where "
                          "the canaries moved it), so μ̂ is what this adversary reaches, with a "
                          "nominal interval; it is not a test",
        "violation": bool(findings),
        "findings": findings,
        "alpha": alpha, "level": level,
        "trust": "a data owner's check of the server's noise on the iterates it received, with "
                 "canaries the server cannot tell apart: its scale (each round's spread) and its "
                 "freshness (independence across rounds); it does not catch a server that releases "
                 "correctly noised iterates and leaks the clipped means another way, noise of the "
                 "declared variance but another law, or a server that shows this node other "
                 "iterates than the others",
    }
