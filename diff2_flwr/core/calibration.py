"""Noise calibration for DIFF2: the closed forms of Gaussian DP and the noise of a schedule.

Every round of DIFF2 is a Gaussian mechanism on (1/P) Σ_p ClippedMean_p. Replacing one
sample of worker p moves that average by at most 2C/(n_min P), so with noise std σC the
round has noise multiplier (std / sensitivity)

    z = σ n_min P / 2.

With m1 = ceil(R/T) restart rounds (multiplier z1) and m2 = R - m1 difference rounds (z2),
full-batch composition is exactly μ-GDP with μ² = m1/z1² + m2/z2², and μ-GDP implies
(ε, δ(ε))-DP with δ(ε) = Φ(-ε/μ + μ/2) - e^ε Φ(-ε/μ - μ/2).

Calibration splits a budget B with u > 1: m1/z1² = B/u and m2/z2² = B(u-1)/u (no split when
m2 = 0). Mode ``exact`` takes B = μ², μ solving δ(ε; μ) = δ (tight); mode ``rdp`` takes
B = 2ρ with ε = ρ + 2 sqrt(ρ ln(1/δ)) (zCDP, Bun & Steinke 2016; the paper's style).

With client sampling (:mod:`~diff2_flwr.core.sampling`: a record's client is in a round's cohort
with probability π, the round's sum divided by E|S|) each round is a
:class:`~diff2_flwr.core.accounting.SampledGaussianEvent` with z = std / (2C/(n_min E|S|)), so
σ = 2z/(n_min E|S|). No closed form composes them: the same split m1/z1² = B/u, m2/z2² = B(u-1)/u
is kept and the one scalar B is solved so that dp-accounting's PLD ε of the whole schedule (m1
restart and m2 difference events, composed by counts) is ε (1 - SAMPLING_MARGIN).

References:
    Murata & Suzuki (2023), sensitivity of ClippedMean and the budget split by u.
    Dong, Roth & Su (2019), "Gaussian Differential Privacy", Cor. 2.13 (δ(ε) of μ-GDP)
    and Cor. 3.3 (composition of Gaussian mechanisms).
    Bun & Steinke (2016), Prop. 1.3 (zCDP to (ε, δ)-DP) and Prop. 1.6 (Gaussian is ρ-zCDP).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Literal

from scipy.optimize import brentq
from scipy.special import log_ndtr, ndtr

from .accounting import (
    PLD_DISCRETIZATION,
    GaussianEvent,
    LocalEvent,
    SampledGaussianEvent,
    rdp_epsilon,
    sampled_schedule_epsilon,
    schedule_pld_epsilon,
)
from .sampling import Sampling

__all__ = [
    "Calibration",
    "CalibrationMode",
    "LocalCalibration",
    "SAMPLING_MARGIN",
    "calibrate",
    "calibrate_local",
    "check_epsilon_delta",
    "count_rounds",
    "expected_noise_norm",
    "gdp_delta",
    "gdp_epsilon",
    "gdp_mu",
    "gdp_mu_of_multipliers",
    "noise_multiplier",
    "sampled_budget",
    "schedule_cross_check",
    "sigma_from_multiplier",
    "split_budget",
    "zcdp_rho",
]

CalibrationMode = Literal["exact", "rdp"]

_MODES = ("exact", "rdp")


def gdp_delta(epsilon: float, mu: float) -> float:
    """δ(ε) of μ-GDP: Φ(-ε/μ + μ/2) - e^ε Φ(-ε/μ - μ/2) (Dong, Roth & Su 2019, Cor. 2.13)."""
    if mu == 0:
        return 0.0
    if math.isinf(mu):
        return 1.0
    a = -epsilon / mu + mu / 2
    b = -epsilon / mu - mu / 2
    # e^ε Φ(b) in log space: e^ε alone overflows long before the product does.
    return max(0.0, float(ndtr(a) - math.exp(epsilon + log_ndtr(b))))


def gdp_mu(epsilon: float, delta: float) -> float:
    """The μ whose μ-GDP guarantee gives exactly δ at ε (δ(ε; μ) is increasing in μ)."""
    check_epsilon_delta(epsilon, delta)
    lo, hi = 1e-8, 1.0
    while gdp_delta(epsilon, hi) < delta:
        hi *= 2
        if hi > 1e6:  # pragma: no cover - unreachable for delta < 1
            raise ValueError(f"No μ reaches δ = {delta} at ε = {epsilon}.")
    return float(brentq(lambda m: gdp_delta(epsilon, m) - delta, lo, hi, xtol=1e-15, rtol=1e-14,
                        maxiter=500))


def gdp_epsilon(mu: float, delta: float) -> float:
    """Smallest ε with δ(ε; μ) <= δ: the (ε, δ)-DP guarantee implied by μ-GDP."""
    return _gdp_epsilon(float(mu), float(delta))


@functools.lru_cache(maxsize=65536)  # pure; every run of one schedule asks for the same values
def _gdp_epsilon(mu: float, delta: float) -> float:
    if not 0 < delta < 1:
        raise ValueError(f"`delta` must be in (0, 1). Found {delta}.")
    if mu == 0:
        return 0.0
    if math.isinf(mu):
        return math.inf
    if gdp_delta(0.0, mu) <= delta:
        return 0.0
    hi = 1.0
    while gdp_delta(hi, mu) > delta:
        hi *= 2
    return float(brentq(lambda e: gdp_delta(e, mu) - delta, 0.0, hi, xtol=1e-14, rtol=1e-14,
                        maxiter=500))


def zcdp_rho(epsilon: float, delta: float) -> float:
    """ρ with ρ + 2 sqrt(ρ ln(1/δ)) = ε (Bun & Steinke 2016, Prop. 1.3, solved for ρ)."""
    check_epsilon_delta(epsilon, delta)
    log_inv_delta = math.log(1 / delta)
    return (math.sqrt(log_inv_delta + epsilon) - math.sqrt(log_inv_delta)) ** 2


def noise_multiplier(sigma: float, n_min: int, clients: int) -> float:
    """z = σ n_min P / 2: noise std over the sensitivity 2C/(n_min P) of the averaged
    ClippedMean."""
    return sigma * n_min * clients / 2


def sigma_from_multiplier(z: float, n_min: int, clients: int) -> float:
    """σ = 2z / (n_min P), the inverse of :func:`noise_multiplier`."""
    return 2 * z / (n_min * clients)


def expected_noise_norm(sigma: float, dim: int) -> float:
    """E‖N(0, σ² I_d)‖ = σ √2 Γ((d+1)/2) / Γ(d/2): the mean of a chi distribution with d degrees of
    freedom (just below σ√d), the expected norm of the noise a release adds in d coordinates with
    std σ each.

    References:
        Johnson, Kotz & Balakrishnan (1994), Continuous Univariate Distributions vol. 1, §18.9 (the
        chi mean).
    """
    if not (math.isfinite(sigma) and sigma >= 0):
        raise ValueError(f"`sigma` must be a finite number >= 0. Found {sigma!r}.")
    if not (isinstance(dim, int) and dim >= 1):
        raise ValueError(f"`dim` must be an integer >= 1. Found {dim!r}.")
    if sigma == 0:
        return 0.0
    return sigma * math.sqrt(2.0) * math.exp(math.lgamma((dim + 1) / 2) - math.lgamma(dim / 2))


def count_rounds(rounds: int, restart_every: int) -> tuple[int, int]:
    """(m1, m2): restart rounds ceil(R/T) and difference rounds R - m1 among rounds 1..R."""
    if rounds < 0 or restart_every < 1:
        raise ValueError(
            f"Need rounds >= 0 and restart_every >= 1. Found {rounds}, {restart_every}.")
    m1 = -(-rounds // restart_every)
    return m1, rounds - m1


def split_budget(budget: float, m1: int, m2: int, u: float) -> tuple[float, float | None]:
    """(z1, z2) with m1/z1² = B/u and m2/z2² = B(u-1)/u; all of B to the restarts (z2 None) when m2
    = 0."""
    if m2 == 0:
        return math.sqrt(m1 / budget), None
    return math.sqrt(m1 * u / budget), math.sqrt(m2 * u / (budget * (u - 1)))


def gdp_mu_of_multipliers(m1: int, z1: float, m2: int, z2: float | None) -> float:
    """μ of the composition of m1 Gaussian rounds with multiplier z1 and m2 with z2 (Cor. 3.3)."""
    total = 0.0
    for m, z in ((m1, z1), (m2, z2)):
        if m == 0:
            continue
        if z is None or z == 0:
            return math.inf
        total += m / z**2
    return math.sqrt(total)


@dataclass(frozen=True)
class Calibration:
    """Noise for a DIFF2 schedule: multipliers z, stds per unit radius σ, and their inputs."""

    mode: CalibrationMode
    epsilon: float
    delta: float
    rounds: int
    restart_every: int
    u: float
    n_min: int
    clients: int
    restart_rounds: int  # m1
    difference_rounds: int  # m2
    budget: float  # B: μ² (exact) or 2ρ (rdp)
    z1: float
    z2: float | None
    sigma1: float
    sigma2: float | None
    local: "LocalCalibration | None" = None
    #: Client sampling (None: every round takes all P clients). With it, ``budget`` is the solved B
    #: of the split (not a μ²), z's are :class:`SampledGaussianEvent` multipliers and σ = 2z /
    #: (n_min E|S|).
    sampling: Sampling | None = None

    @property
    def sampling_prob(self) -> float:
        """π: the probability that a record's client is in a round's cohort (1 without
        sampling)."""
        return 1.0 if self.sampling is None else self.sampling.probability(self.clients)

    @property
    def planned_epsilon(self) -> float:
        """ε of the whole schedule: the exact GDP closed form, or with a local phase or client
        sampling dp-accounting's PLD (composed by counts)."""
        if self.sampling is not None:
            return self.epsilon_spent(self.restart_rounds, self.difference_rounds)
        if self.local is None:
            return self.epsilon_spent(self.restart_rounds, self.difference_rounds)
        return schedule_pld_epsilon(self.delta, self.restart_rounds, self.z1,
                                    self.difference_rounds, self.z2,
                                     self.local.z3, self.local.sampling_prob, self.local.steps - 1,
                                     self.rounds)

    def round_events(self, restart: bool
                     ) -> tuple["GaussianEvent | SampledGaussianEvent | LocalEvent", ...]:
        """What one released round costs: its Gaussian event (client-sampled with sampling), then
        the local phase's steps (if any)."""
        z = self.z1 if restart else self.z2
        if self.sampling is not None:
            return (SampledGaussianEvent(float(z), self.sampling_prob,  # type: ignore[arg-type]
                                         "restart" if restart else "difference"),)
        gaussian = GaussianEvent(float(z),
                                 "restart" if restart else "difference")  # type: ignore[arg-type]
        return (gaussian,) if self.local is None else (gaussian, self.local.event)

    @property
    def mu(self) -> float:
        """The exact GDP μ of the whole schedule (whatever the calibration mode); nan with client
        sampling (no GDP closed form)."""
        if self.sampling is not None:
            return math.nan
        return gdp_mu_of_multipliers(self.restart_rounds, self.z1, self.difference_rounds, self.z2)

    def epsilon_spent(self, restart_rounds: int, difference_rounds: int) -> float:
        """ε actually spent after the given numbers of released rounds: exact GDP accounting, or
        with client sampling dp-accounting's PLD by counts (what the ledger's
        ``epsilon_pld_by_counts`` gives for those events)."""
        if self.sampling is not None:
            return sampled_schedule_epsilon(self.delta, restart_rounds, self.z1, difference_rounds,
                                            self.z2, self.sampling_prob)
        mu = gdp_mu_of_multipliers(restart_rounds, self.z1, difference_rounds, self.z2)
        return gdp_epsilon(mu, self.delta)

    def as_dict(self) -> dict[str, float | int | str | None]:
        """The calibration as plain data (inputs, m1, m2, B, z, σ, μ, planned ε, the local part;
        with client sampling, the sampling too and μ None)."""
        if self.sampling is not None:
            s = self.sampling
            return {**dataclasses.replace(self, sampling=None).as_dict(), "mu": None,
                    "epsilon_spent_at_end": self.planned_epsilon,
                    "sampling": {"kind": s.kind, "rate": s.rate, "size": s.size,
                                 "probability": self.sampling_prob,
                                 "expected_cohort": s.expected_cohort(self.clients),
                                 "event": "client-sampled Gaussian (record level, replace-one): "
                                          "PLD mixture π·Gaussian(z) + (1-π)·no loss"}}
        return {
            "mode": self.mode, "epsilon": self.epsilon, "delta": self.delta, "rounds": self.rounds,
            "restart_every": self.restart_every, "u": self.u, "n_min": self.n_min,
            "clients": self.clients, "restart_rounds": self.restart_rounds,
            "difference_rounds": self.difference_rounds, "budget": self.budget,
            "z1": self.z1, "z2": self.z2, "sigma1": self.sigma1, "sigma2": self.sigma2,
            "mu": self.mu, "epsilon_spent_at_end": self.planned_epsilon,
            "local": None if self.local is None else self.local.as_dict(),
        }


def check_epsilon_delta(epsilon: float, delta: float) -> None:
    """Refuse a budget unless ε is finite and > 0 and δ is in (0, 1) (a ValueError naming which)."""
    if not (math.isfinite(epsilon) and epsilon > 0):
        raise ValueError(f"`epsilon` must be a finite number > 0. Found {epsilon}.")
    if not 0 < delta < 1:
        raise ValueError(f"`delta` must be in (0, 1). Found {delta}.")


def calibrate(  # noqa: PLR0913 -- keyword-only: the privacy settings, one keyword each
    *,
    epsilon: float,
    delta: float,
    rounds: int,
    restart_every: int,
    u: float,
    n_min: int,
    clients: int,
    mode: CalibrationMode = "exact",
    local_steps: int | None = None,
    local_batch_size: int | None = None,
    local_share: float | None = None,
    sampling: Sampling | None = None,
) -> Calibration:
    """Noise (σ1, σ2) so that R rounds of DIFF2 with restart period T are (ε, δ)-DP.

    With ``local_steps`` = K (the BVR-L-SGD local routine: K - 1 private steps per round on one
    worker), the server's rounds get the GDP budget (1 - local_share) μ² and σ3 is then the smallest
    noise with which the whole schedule, composed by dp-accounting's PLD accountant, stays within ε
    (see :func:`calibrate_local`); mode ``exact`` only.

    With ``sampling`` (client sampling, :mod:`~diff2_flwr.core.sampling`), each round is a
    :class:`SampledGaussianEvent` and (z1, z2) keep the split of :func:`split_budget` with the one
    scalar B solved by :func:`sampled_budget`; mode ``exact`` only, no local routine. Without it the
    result is the same as before sampling existed, bit for bit.

    Args:
        epsilon, delta: the target (ε, δ).
        rounds: R.
        restart_every: T.
        u: the budget split (> 1 when there are difference rounds).
        n_min: the smallest client's number of records.
        clients: P, the registered clients.
        mode: ``exact`` (GDP / PLD) or ``rdp`` (zCDP, the paper's style).
        local_steps, local_batch_size, local_share: the local routine (K, b, its budget share).
        sampling: the cohort rule, or None for full participation.

    Raises:
        ValueError: on an invalid argument, naming it, with the value found.
    """
    check_epsilon_delta(epsilon, delta)
    if mode not in _MODES:
        raise ValueError(f"`mode` must be one of {_MODES}. Found {mode!r}.")
    for name, value in (("rounds", rounds), ("restart_every", restart_every), ("n_min", n_min),
                        ("clients", clients)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"`{name}` must be an integer >= 1. Found {value!r}.")
    m1, m2 = count_rounds(rounds, restart_every)
    if m2 > 0 and not (math.isfinite(u) and u > 1):
        raise ValueError(
            f"`u` must be a finite number > 1 when there are difference rounds (T = "
            f"{restart_every} > 1). Found {u}. The paper uses u = 1.25; T = 1 is DP-GD."
        )
    if sampling is not None:
        _check_sampling(sampling, mode, local_steps, clients)
        return _calibrate_sampled(epsilon=epsilon, delta=delta, rounds=rounds,
                                  restart_every=restart_every, u=u, n_min=n_min, clients=clients,
                                  sampling=sampling)
    budget = gdp_mu(epsilon, delta) ** 2 if mode == "exact" else 2 * zcdp_rho(epsilon, delta)
    if local_steps is not None:
        if mode != "exact":
            raise ValueError(
                "The local routine is calibrated against dp-accounting's PLD accountant: use "
                             f"privacy.mode 'exact'. Found {mode!r}.")
        _check_local(local_steps, local_batch_size, local_share, n_min)
        budget *= 1 - float(local_share)  # type: ignore[arg-type]
    z1, z2 = split_budget(budget, m1, m2, u)
    server = Calibration(
        mode=mode, epsilon=epsilon, delta=delta, rounds=rounds, restart_every=restart_every, u=u,
        n_min=n_min, clients=clients, restart_rounds=m1, difference_rounds=m2, budget=budget,
        z1=z1, z2=z2, sigma1=sigma_from_multiplier(z1, n_min, clients),
        sigma2=None if z2 is None else sigma_from_multiplier(z2, n_min, clients),
    )
    if local_steps is None:
        return server
    return dataclasses.replace(server, local=calibrate_local(server, local_steps, local_batch_size,
                                                             local_share))


def _check_sampling(sampling: object, mode: str, local_steps: int | None, clients: int) -> None:
    if not isinstance(sampling, Sampling):
        raise ValueError(
            f"`sampling` must be a Sampling (kind 'poisson' with a rate, or 'fixed' with a size) or"
            f" None. Found {type(sampling).__name__}: {sampling!r}.")
    if mode != "exact":
        raise ValueError(
            f"`mode` {mode!r} cannot be combined with `sampling`: client-sampled rounds are "
            f"calibrated by dp-accounting's PLD accountant (no closed form); use mode 'exact'.")
    if local_steps is not None:
        raise ValueError(
            f"`local_steps` ({local_steps!r}) cannot be combined with `sampling`: the local "
            f"routine's worker and its steps are not accounted for a sampled cohort; turn one off.")
    sampling.probability(clients)  # m <= P


#: With client sampling, B is solved so that the schedule's PLD ε (composed by counts) is at most
#: ε (1 - SAMPLING_MARGIN): the ledger composes the same events round by round (another rounding
#: path), which must stay within ε too.
SAMPLING_MARGIN = 0.005

#: The smallest restart multiplier the sampled search tries (below it the PLDs grow huge, and such
#: noise is too small to matter).
MIN_SAMPLED_Z = 0.05


def sampled_budget(*, epsilon: float, delta: float, m1: int, m2: int, u: float,
                   sampling_prob: float) -> float:
    """B: the largest budget (to about 0.02 %) whose split (:func:`split_budget`) keeps the PLD ε
    of m1 restart and m2 difference client-sampled rounds within ε (1 - SAMPLING_MARGIN).

    ε(B) increases with B (less noise). The root is found on coarse (pessimistic) PLDs, then
    refined, and checked, at the ledger's discretisation.

    Args:
        epsilon, delta: the target.
        m1, m2: restart and difference rounds.
        u: the split (unused when m2 = 0).
        sampling_prob: π in (0, 1].

    Raises:
        ValueError: the sampling alone keeps the schedule within (ε, δ) (a record's client is drawn
            at all with probability <= δ), or only with multipliers below :data:`MIN_SAMPLED_Z`.
    """
    drawn = -math.expm1((m1 + m2) * math.log1p(-sampling_prob)) if sampling_prob < 1 else 1.0
    if drawn <= delta:
        raise ValueError(
            f"With sampling probability π = {sampling_prob:g} a record's client is in any of the "
            f"{m1 + m2} rounds with probability {drawn:.3g} <= δ = {delta:g}: the sampling alone "
            f"keeps (ε, δ) and no noise would be calibrated; raise the sampling rate.")
    target = epsilon * (1 - SAMPLING_MARGIN)

    def excess(log_b: float, interval: float) -> float:
        z1, z2 = split_budget(math.exp(log_b), m1, m2, u)
        return sampled_schedule_epsilon(delta, m1, z1, m2, z2, sampling_prob, interval) - target

    lo = math.log(gdp_mu(epsilon, delta) ** 2) - math.log(2)  # below the full-batch budget
    while excess(lo, SEARCH_DISCRETIZATION) > 0:
        lo -= math.log(4)
    hi = lo + math.log(4)
    while excess(hi, SEARCH_DISCRETIZATION) <= 0:
        lo, hi = hi, hi + math.log(4)
        if split_budget(math.exp(hi), m1, m2, u)[0] < MIN_SAMPLED_Z:
            raise ValueError(
                f"With sampling probability π = {sampling_prob:g} the schedule stays within ε = "
                f"{epsilon:g} with noise multipliers below {MIN_SAMPLED_Z}: too little noise to "
                f"calibrate reliably; raise the sampling rate.")
    root = brentq(excess, lo, hi, args=(SEARCH_DISCRETIZATION,), xtol=1e-3)
    # The fine PLD is less pessimistic: its root usually lies just above the coarse one.
    lo, hi = root, root + math.log(1.02)
    while excess(lo, PLD_DISCRETIZATION) > 0:
        lo, hi = lo - math.log(1.02), lo
    while excess(hi, PLD_DISCRETIZATION) <= 0:
        lo, hi = hi, hi + math.log(1.02)
    log_b = brentq(excess, lo, hi, args=(PLD_DISCRETIZATION,), xtol=2e-4)
    while excess(log_b, PLD_DISCRETIZATION) > 0:
        log_b -= 2e-4
    return math.exp(log_b)


def _calibrate_sampled(*, epsilon: float, delta: float, rounds: int, restart_every: int, u: float,
                       n_min: int, clients: int, sampling: Sampling) -> Calibration:
    m1, m2 = count_rounds(rounds, restart_every)
    pi = sampling.probability(clients)
    budget = sampled_budget(epsilon=epsilon, delta=delta, m1=m1, m2=m2, u=u, sampling_prob=pi)
    z1, z2 = split_budget(budget, m1, m2, u)
    cohort = sampling.expected_cohort(clients)
    return Calibration(
        mode="exact", epsilon=epsilon, delta=delta, rounds=rounds, restart_every=restart_every,
        u=u, n_min=n_min, clients=clients, restart_rounds=m1, difference_rounds=m2, budget=budget,
        z1=z1, z2=z2, sigma1=2 * z1 / (n_min * cohort),
        sigma2=None if z2 is None else 2 * z2 / (n_min * cohort), sampling=sampling)


#: The local routine's σ3 is calibrated to ε (1 - LOCAL_MARGIN) by the PLD accountant composing the
#: schedule by counts, so that the ledger's own composition (round by round, another discretisation
#: path) stays within ε.
LOCAL_MARGIN = 0.005


@dataclass(frozen=True)
class LocalCalibration:
    """The local routine's noise: K - 1 Poisson-subsampled Gaussian steps per round (see
    :class:`LocalEvent`)."""

    steps: int  # K
    batch_size: int  # b: expected batch size and the fixed normaliser of the minibatch sum
    share: float  # the fraction of the GDP budget μ² the server's rounds leave to the local steps
    sampling_prob: float  # b / n_min: the largest per-record inclusion probability of any worker
    z3: float  # std / (c / b), c = C3 ||y_k - y_(k-1)||
    sigma3: float  # noise std per unit radius c: z3 / b

    @property
    def event(self) -> LocalEvent:
        """What one round's local phase costs: K - 1 subsampled Gaussian steps of multiplier z3."""
        return LocalEvent(self.z3, self.sampling_prob, self.steps - 1)

    def as_dict(self) -> dict[str, float | int | str]:
        """The local calibration as plain data (K, b, share, q, z3, σ3), its sampling in words."""
        return {"steps": self.steps, "batch_size": self.batch_size, "share": self.share,
                "sampling": "Poisson, each record with probability b / n_p; the sum is divided by "
                            "b",
                "adjacency": "replace-one (dp-accounting REPLACE_ONE, PoissonSampled Gaussian)",
                "sampling_prob": self.sampling_prob, "z3": self.z3, "sigma3": self.sigma3}


def _check_local(steps: int | None, batch_size: int | None, share: float | None,
                 n_min: int) -> None:
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 2:
        raise ValueError(
            f"`local_steps` (K) must be an integer >= 2 (K - 1 local steps per round). Found "
            f"{steps!r}.")
    if not isinstance(batch_size, int) or isinstance(batch_size,
                                                     bool) or not 1 <= batch_size <= n_min:
        raise ValueError(
            f"`local_batch_size` (b) must be an integer in [1, n_min = {n_min}] (every worker "
            f"samples with probability b / n_p <= 1). Found {batch_size!r}.")
    if share is None or not (math.isfinite(share) and 0 < share < 1):
        raise ValueError(
            f"`local_share` must be a number in (0, 1): the fraction of the budget left to the "
            f"local steps. Found {share!r}.")


#: Discretisation of the PLDs of the calibration's search (the result is then checked at
#: PLD_DISCRETIZATION).
SEARCH_DISCRETIZATION = 1e-3


def calibrate_local(server: Calibration, steps: int, batch_size: int | None,
                    share: float | None) -> LocalCalibration:
    """σ3: the smallest z3 (to about 0.2 %) with which the schedule's PLD ε stays within ε (1 -
    LOCAL_MARGIN).

    ``server`` is the server's rounds calibrated to the budget (1 - share) μ²; ε(z3) decreases in
    z3. The search runs on coarser (pessimistic) PLDs; the result is then checked, and raised if
    needed, at the ledger's discretisation.
    """
    _check_local(steps, batch_size, share, server.n_min)
    assert batch_size is not None and share is not None
    q = batch_size / server.n_min
    target = server.epsilon * (1 - LOCAL_MARGIN)

    def eps(z3: float, interval: float = SEARCH_DISCRETIZATION) -> float:
        return schedule_pld_epsilon(server.delta, server.restart_rounds, server.z1,
                                    server.difference_rounds,
                                     server.z2, z3, q, steps - 1, server.rounds, interval)

    lo, hi = 0.5, 1.0
    while eps(hi) > target:
        lo, hi = hi, hi * 2
        if hi > 1e7:
            raise ValueError(
                f"No local noise keeps the schedule within ε = {server.epsilon}: raise "
                f"local_share.")
    while eps(lo) <= target and lo > 1e-3:
        lo, hi = lo / 2, lo
    root = math.exp(brentq(lambda t: eps(math.exp(t)) - target, math.log(lo), math.log(hi),
                           xtol=1e-3))
    hi = min(hi, root * 1.002)
    while eps(hi) > target or eps(hi, PLD_DISCRETIZATION) > target:
        hi *= 1.002
    return LocalCalibration(steps=steps, batch_size=batch_size, share=float(share), sampling_prob=q,
                            z3=hi, sigma3=hi / batch_size)


def schedule_cross_check(cal: Calibration) -> dict[str, float]:
    """ε of a whole calibrated schedule by dp-accounting's PLD and RDP accountants (composed by
    counts), next to the closed form: what ``diff2 noise`` prints to cross-check a calibration."""
    if cal.sampling is not None:
        raise ValueError(
            "schedule_cross_check composes full-batch GaussianDpEvents; a calibration with "
            "`sampling` is not one (dp-accounting has no event for a client-sampled round): read "
            f"its planned_epsilon (PLD by counts) instead. Found sampling = {cal.sampling!r}.")
    from dp_accounting import dp_event  # noqa: PLC0415 -- dp-accounting: ~2 s import, on first use
    from dp_accounting.pld import pld_privacy_accountant  # noqa: PLC0415 -- dp-accounting: ~2 s import, on first use

    pld = pld_privacy_accountant.PLDAccountant(value_discretization_interval=PLD_DISCRETIZATION)
    counts = [(cal.z1, cal.restart_rounds), (cal.z2, cal.difference_rounds)]
    for z, m in counts:
        if m:
            pld.compose(dp_event.GaussianDpEvent(z), m)
    exact = cal.epsilon_spent(cal.restart_rounds, cal.difference_rounds)
    epsilon_pld = float(pld.get_epsilon(cal.delta))
    return {"epsilon_exact_gdp": exact, "epsilon_pld": epsilon_pld,
            "epsilon_rdp": rdp_epsilon(cal.delta, tuple((z, m) for z, m in counts if m)),
            "pld_vs_exact_relative": epsilon_pld / exact - 1}
