"""Noise calibration for DIFF2 and the privacy spent so far.

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

References:
    Murata & Suzuki (2023), sensitivity of ClippedMean and the budget split by u.
    Dong, Roth & Su (2019), "Gaussian Differential Privacy", Cor. 2.13 (δ(ε) of μ-GDP)
    and Cor. 3.3 (composition of Gaussian mechanisms).
    Bun & Steinke (2016), Prop. 1.3 (zCDP to (ε, δ)-DP) and Prop. 1.6 (Gaussian is ρ-zCDP).
"""

from __future__ import annotations

import functools
import hashlib
import math
import struct
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Literal

from scipy.optimize import brentq
from scipy.special import log_ndtr, ndtr

__all__ = [
    "Calibration",
    "GaussianEvent",
    "PrivacyLedger",
    "CalibrationMode",
    "calibrate",
    "count_rounds",
    "gdp_delta",
    "gdp_epsilon",
    "gdp_mu",
    "gdp_mu_of_multipliers",
    "noise_multiplier",
    "schedule_cross_check",
    "sigma_from_multiplier",
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
    _check_epsilon_delta(epsilon, delta)
    lo, hi = 1e-8, 1.0
    while gdp_delta(epsilon, hi) < delta:
        hi *= 2
        if hi > 1e6:  # pragma: no cover - unreachable for delta < 1
            raise ValueError(f"No μ reaches δ = {delta} at ε = {epsilon}.")
    return float(brentq(lambda m: gdp_delta(epsilon, m) - delta, lo, hi, xtol=1e-15, rtol=1e-14, maxiter=500))


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
    return float(brentq(lambda e: gdp_delta(e, mu) - delta, 0.0, hi, xtol=1e-14, rtol=1e-14, maxiter=500))


def zcdp_rho(epsilon: float, delta: float) -> float:
    """ρ with ρ + 2 sqrt(ρ ln(1/δ)) = ε (Bun & Steinke 2016, Prop. 1.3, solved for ρ)."""
    _check_epsilon_delta(epsilon, delta)
    log_inv_delta = math.log(1 / delta)
    return (math.sqrt(log_inv_delta + epsilon) - math.sqrt(log_inv_delta)) ** 2


def noise_multiplier(sigma: float, n_min: int, clients: int) -> float:
    """z = σ n_min P / 2: noise std over the sensitivity 2C/(n_min P) of the averaged ClippedMean."""
    return sigma * n_min * clients / 2


def sigma_from_multiplier(z: float, n_min: int, clients: int) -> float:
    """σ = 2z / (n_min P), the inverse of :func:`noise_multiplier`."""
    return 2 * z / (n_min * clients)


def count_rounds(rounds: int, restart_every: int) -> tuple[int, int]:
    """(m1, m2): restart rounds ceil(R/T) and difference rounds R - m1 among rounds 1..R."""
    if rounds < 0 or restart_every < 1:
        raise ValueError(f"Need rounds >= 0 and restart_every >= 1. Found {rounds}, {restart_every}.")
    m1 = -(-rounds // restart_every)
    return m1, rounds - m1


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

    @property
    def mu(self) -> float:
        """The exact GDP μ of the whole schedule (whatever the calibration mode)."""
        return gdp_mu_of_multipliers(self.restart_rounds, self.z1, self.difference_rounds, self.z2)

    def epsilon_spent(self, restart_rounds: int, difference_rounds: int) -> float:
        """ε actually spent (exact GDP accounting) after the given numbers of released rounds."""
        mu = gdp_mu_of_multipliers(restart_rounds, self.z1, difference_rounds, self.z2)
        return gdp_epsilon(mu, self.delta)

    def as_dict(self) -> dict[str, float | int | str | None]:
        return {
            "mode": self.mode, "epsilon": self.epsilon, "delta": self.delta, "rounds": self.rounds,
            "restart_every": self.restart_every, "u": self.u, "n_min": self.n_min,
            "clients": self.clients, "restart_rounds": self.restart_rounds,
            "difference_rounds": self.difference_rounds, "budget": self.budget,
            "z1": self.z1, "z2": self.z2, "sigma1": self.sigma1, "sigma2": self.sigma2,
            "mu": self.mu, "epsilon_spent_at_end": self.epsilon_spent(self.restart_rounds, self.difference_rounds),
        }


def _check_epsilon_delta(epsilon: float, delta: float) -> None:
    if not (math.isfinite(epsilon) and epsilon > 0):
        raise ValueError(f"`epsilon` must be a finite number > 0. Found {epsilon}.")
    if not 0 < delta < 1:
        raise ValueError(f"`delta` must be in (0, 1). Found {delta}.")


def calibrate(
    *,
    epsilon: float,
    delta: float,
    rounds: int,
    restart_every: int,
    u: float,
    n_min: int,
    clients: int,
    mode: CalibrationMode = "exact",
) -> Calibration:
    """Noise (σ1, σ2) so that R rounds of DIFF2 with restart period T are (ε, δ)-DP.

    Raises:
        ValueError: on an invalid argument, naming it, with the value found.
    """
    _check_epsilon_delta(epsilon, delta)
    if mode not in _MODES:
        raise ValueError(f"`mode` must be one of {_MODES}. Found {mode!r}.")
    for name, value in (("rounds", rounds), ("restart_every", restart_every), ("n_min", n_min), ("clients", clients)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"`{name}` must be an integer >= 1. Found {value!r}.")
    m1, m2 = count_rounds(rounds, restart_every)
    if m2 > 0 and not (math.isfinite(u) and u > 1):
        raise ValueError(
            f"`u` must be a finite number > 1 when there are difference rounds (T = {restart_every} > 1). "
            f"Found {u}. The paper uses u = 1.25; T = 1 is DP-GD."
        )
    budget = gdp_mu(epsilon, delta) ** 2 if mode == "exact" else 2 * zcdp_rho(epsilon, delta)
    if m2 == 0:
        z1, z2 = math.sqrt(m1 / budget), None
    else:
        z1 = math.sqrt(m1 * u / budget)
        z2 = math.sqrt(m2 * u / (budget * (u - 1)))
    return Calibration(
        mode=mode, epsilon=epsilon, delta=delta, rounds=rounds, restart_every=restart_every, u=u,
        n_min=n_min, clients=clients, restart_rounds=m1, difference_rounds=m2, budget=budget,
        z1=z1, z2=z2, sigma1=sigma_from_multiplier(z1, n_min, clients),
        sigma2=None if z2 is None else sigma_from_multiplier(z2, n_min, clients),
    )


@dataclass(frozen=True)
class GaussianEvent:
    """One released round: a Gaussian mechanism with this noise multiplier (std / sensitivity)."""

    noise_multiplier: float
    kind: str  # "restart" or "difference"


#: Discretisation of dp-accounting's privacy-loss distributions (pessimistic: an upper bound on ε).
PLD_DISCRETIZATION = 1e-4


@functools.lru_cache(maxsize=64)
def _gaussian_pld(noise_multiplier: float) -> Any:
    from dp_accounting.pld import privacy_loss_distribution

    return privacy_loss_distribution.from_gaussian_mechanism(
        standard_deviation=noise_multiplier, sensitivity=1.0, value_discretization_interval=PLD_DISCRETIZATION)


class _PldChain:
    """The PLD composed along one ledger lineage so far: each new round costs one composition.

    Shared (mutable) by the successive ledgers of one run; a ledger whose events do not extend
    the chain's (a branch, a ledger read back from a checkpoint) composes from its first event.
    Composition is a left fold in release order, so a resumed run reproduces the same values.
    """

    __slots__ = ("multipliers", "pld")

    def __init__(self) -> None:
        self.multipliers: tuple[float, ...] = ()
        self.pld: Any = None


class _BoundedCache(OrderedDict):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size

    def put(self, key: Any, value: float) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.size:
            self.popitem(last=False)


# ε by (δ, digest of the multipliers in order): the runs of one schedule (a study's seeds, an audit's trials)
# release the same events, so the PLD of each prefix is composed once per process.
_PLD_EPSILONS = _BoundedCache(16384)


def schedule_cross_check(cal: Calibration) -> dict[str, float]:
    """ε of a whole calibrated schedule by dp-accounting's PLD and RDP accountants (composed by counts),
    next to the closed form: what ``diff2 noise`` prints to cross-check a calibration."""
    from dp_accounting import dp_event
    from dp_accounting.pld import pld_privacy_accountant

    pld = pld_privacy_accountant.PLDAccountant(value_discretization_interval=PLD_DISCRETIZATION)
    counts = [(cal.z1, cal.restart_rounds), (cal.z2, cal.difference_rounds)]
    for z, m in counts:
        if m:
            pld.compose(dp_event.GaussianDpEvent(z), m)
    exact = cal.epsilon_spent(cal.restart_rounds, cal.difference_rounds)
    epsilon_pld = float(pld.get_epsilon(cal.delta))
    return {"epsilon_exact_gdp": exact, "epsilon_pld": epsilon_pld,
            "epsilon_rdp": _rdp_epsilon(cal.delta, tuple((z, m) for z, m in counts if m)),
            "pld_vs_exact_relative": epsilon_pld / exact - 1}


@functools.lru_cache(maxsize=16384)
def _rdp_epsilon(delta: float, counts: tuple[tuple[float, int], ...]) -> float:
    from dp_accounting import dp_event
    from dp_accounting.rdp import rdp_privacy_accountant

    accountant = rdp_privacy_accountant.RdpAccountant()
    for z, count in counts:
        accountant.compose(dp_event.GaussianDpEvent(z), count)
    return float(accountant.get_epsilon(delta))


@dataclass(frozen=True)
class PrivacyLedger:
    """The Gaussian events released so far, and ε spent by three accountants.

    ``epsilon``: the exact μ-GDP composition (closed form; the budget guard's number).
    ``epsilon_pld``: Google's dp-accounting privacy-loss-distribution accountant, composed
    incrementally (one FFT convolution per released round), pessimistic by its discretisation.
    ``epsilon_rdp``: dp-accounting's Rényi accountant (looser; for comparison).
    ``noise_multiplier = 0`` (a non-private round) makes every ε infinite.
    """

    delta: float
    events: tuple[GaussianEvent, ...] = ()
    _chain: _PldChain | None = field(default=None, compare=False, repr=False)

    def record(self, event: GaussianEvent) -> "PrivacyLedger":
        chain = self._chain if self._chain is not None else _PldChain()
        return PrivacyLedger(self.delta, self.events + (event,), chain)

    @property
    def mu(self) -> float:
        if any(e.noise_multiplier == 0 for e in self.events):
            return math.inf
        return math.sqrt(sum(1 / e.noise_multiplier**2 for e in self.events))

    @property
    def epsilon(self) -> float:
        """ε spent at the ledger's δ (exact for full-batch Gaussian composition)."""
        return gdp_epsilon(self.mu, self.delta)

    def _degenerate(self) -> float | None:
        """ε when no accountant is needed: 0 with no events, inf with a noise-free event."""
        if not self.events:
            return 0.0
        if any(e.noise_multiplier == 0 for e in self.events):
            return math.inf
        return None

    def _counts(self) -> tuple[tuple[float, int], ...]:
        counts: dict[float, int] = {}
        for e in self.events:
            counts[e.noise_multiplier] = counts.get(e.noise_multiplier, 0) + 1
        return tuple(sorted(counts.items()))

    @property
    def epsilon_pld(self) -> float:
        """ε spent per dp-accounting's PLD accountant (an independent, slightly pessimistic bound)."""
        if (trivial := self._degenerate()) is not None:
            return trivial
        zs = tuple(e.noise_multiplier for e in self.events)
        key = (self.delta, len(zs), hashlib.blake2b(struct.pack(f"{len(zs)}d", *zs), digest_size=32).digest())
        if key in _PLD_EPSILONS:
            return _PLD_EPSILONS[key]
        chain = self._chain
        pld, start = None, 0
        if chain is not None and chain.pld is not None and zs[:len(chain.multipliers)] == chain.multipliers:
            pld, start = chain.pld, len(chain.multipliers)
        for z in zs[start:]:
            pld = _gaussian_pld(z) if pld is None else pld.compose(_gaussian_pld(z))
        if chain is not None:
            chain.multipliers, chain.pld = zs, pld
        epsilon = float(pld.get_epsilon_for_delta(self.delta))
        _PLD_EPSILONS.put(key, epsilon)
        return epsilon

    @property
    def epsilon_rdp(self) -> float:
        """ε spent per dp-accounting's RDP accountant (looser; for comparison)."""
        if (trivial := self._degenerate()) is not None:
            return trivial
        return _rdp_epsilon(self.delta, self._counts())
