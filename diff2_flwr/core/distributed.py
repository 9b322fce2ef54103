"""DIFF2 with distributed Skellam noise: the privacy of a schedule, and its calibration.

In ``privacy.noise: distributed`` mode every round is a Skellam mechanism on the integer sum of the
clients' encoded vectors (:mod:`diff2_flwr.core.skellam`). A round whose clients clip to radius C
encodes with scale s and rounding bound ρ, so one record moves the integer sum by at most Δ₂ =
s·2C/n_min + 2ρ. The honest clients' shares add up to Skellam noise of variance (z Δ₂)²: z is the
round's noise multiplier, as in central mode, but against the *integer* sensitivity, so rounding's
inflation of Δ₂ is paid for in noise.

The round's Rényi DP is then at most α/(2z²) (the Gaussian's) plus the discretisation surcharge of
Corollary 3.6 at variance (zΔ₂)². The surcharge only shrinks as Δ₂ grows (for fixed z), and Δ₂ >=
2ρ, so evaluating it at Δ₂ = 2ρ bounds every round whatever its radius: the schedule's ε is known
before the run, like central mode's.

Calibration follows central DIFF2: a budget B split by u between the m1 restart and m2 difference
rounds (m1/z1² = B/u, m2/z2² = B(u-1)/u), with B the largest whose composed Rényi DP converts to at
most ε at δ.

Threat model parameter: ``tolerated`` = t, the number of the P clients that may drop out or collude.
A colluder knows its own share and a dropped client's share is missing, so each client adds variance
(zΔ₂)²/(P - t): the P - t honest survivors alone carry (zΔ₂)².

References:
    Agarwal, Kairouz & Liu (2021), Corollary 3.6 (Skellam RDP). Murata & Suzuki (2023), the budget
    split by u. Canonne, Kamath & Steinke (2020), Proposition 12 (RDP to (ε, δ)).
"""

from __future__ import annotations

import functools
import math
import secrets
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .calibration import check_epsilon_delta, count_rounds, split_budget
from .skellam import (RDP_ORDERS, SkellamCode, choose_scale, decode, encode, rdp_to_epsilon,
                      rounding_bound, sensitivity, skellam_rdp, wrap_probability)

__all__ = ["ROUNDING_BETA", "SkellamEvent", "DistributedCalibration", "DistributedNoise",
           "SkellamLedger",
           "schedule_rdp", "schedule_epsilon", "calibrate_distributed", "client_variance",
           "client_rng", "distributed_noise"]

#: Conditional rounding's target: a draw is kept when its error norm is within ρ, which fails with
#: probability at most β per draw (Kairouz, Liu & Steinke 2021 take e^-0.5). It changes only how
#: often a client redraws.
ROUNDING_BETA = math.exp(-0.5)


@dataclass(frozen=True)
class SkellamEvent:
    """One round under distributed noise: honest noise std ``noise_multiplier`` · Δ₂ on an integer
    sum of ``padded_dim`` coordinates whose rounding bound is ``rho``."""

    noise_multiplier: float
    rho: float
    padded_dim: int
    kind: str  # "restart" or "difference"

    def rdp(self, order: int) -> float:
        """Rényi DP at ``order``, for any round radius: Corollary 3.6 at the smallest Δ₂ = 2ρ (see
        the module)."""
        l2 = 2 * self.rho
        l1 = min(math.sqrt(self.padded_dim) * l2, l2 * l2)
        return skellam_rdp(order, l1, l2, (self.noise_multiplier * l2) ** 2)


def schedule_rdp(events: Sequence[SkellamEvent], orders: Sequence[int] = RDP_ORDERS) -> list[float]:
    """The composed Rényi DP of ``events`` at each order (RDP adds up under composition; equal
    events counted)."""
    counts = Counter(events)
    return [sum(n * e.rdp(a) for e, n in counts.items()) for a in orders]


def schedule_epsilon(events: Sequence[SkellamEvent], delta: float) -> float:
    """ε at ``delta`` of the composition of ``events`` (0 for none)."""
    if not events:
        return 0.0
    return rdp_to_epsilon(schedule_rdp(events), RDP_ORDERS, delta)


@dataclass(frozen=True)
class DistributedCalibration:
    """The noise of a DIFF2 schedule under distributed Skellam noise, and what it was calibrated
    for."""

    epsilon: float
    delta: float
    rounds: int
    restart_every: int
    u: float
    restart_rounds: int
    difference_rounds: int
    rho: float
    padded_dim: int
    z1: float
    z2: float | None
    epsilon_spent: float  # the schedule's ε by this accounting (<= epsilon)

    def event(self, restart: bool) -> SkellamEvent:
        """What one restart round (``restart`` False: a difference round) of the schedule costs."""
        z = self.z1 if restart else self.z2
        if z is None:
            raise ValueError("this schedule has no difference rounds (T = 1).")
        return SkellamEvent(z, self.rho, self.padded_dim, "restart" if restart else "difference")

    def events(self) -> list[SkellamEvent]:
        """Every round's event: the m1 restart rounds', then the m2 difference rounds'."""
        differences = [self.event(False)] * self.difference_rounds if self.difference_rounds else []
        return [self.event(True)] * self.restart_rounds + differences


def calibrate_distributed(*, epsilon: float, delta: float, rounds: int, restart_every: int,
                          u: float, rho: float, padded_dim: int) -> DistributedCalibration:
    """The least noise (largest budget B) whose schedule is (ε, δ)-DP by this module's accounting.

    Raises:
        ValueError: on an invalid argument, naming it, with the value found.
    """
    check_epsilon_delta(epsilon, delta)
    if rounds < 1:
        raise ValueError(f"`rounds` must be >= 1. Found {rounds}.")
    m1, m2 = count_rounds(rounds, restart_every)
    if m2 > 0 and not (math.isfinite(u) and u > 1):
        raise ValueError(
            f"`u` must be a finite number > 1 when there are difference rounds. Found {u}.")

    def spent(log_budget: float) -> float:
        z1, z2 = split_budget(math.exp(log_budget), m1, m2, u)
        events = [SkellamEvent(z1, rho, padded_dim, "restart")] * m1
        events += [SkellamEvent(z2, rho, padded_dim, "difference")] * m2 if z2 is not None else []
        return schedule_epsilon(events, delta)

    lo, hi = math.log(1e-12), math.log(1e6)
    if spent(lo) > epsilon:
        raise ValueError(f"no noise reaches ε = {epsilon} at δ = {delta} over {rounds} rounds.")
    for _ in range(200):  # ε grows with the budget: the largest budget within ε, to 1e-12 in log
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if spent(mid) <= epsilon else (lo, mid)
        if hi - lo < 1e-12:
            break
    z1, z2 = split_budget(math.exp(lo), m1, m2, u)
    return DistributedCalibration(epsilon=epsilon, delta=delta, rounds=rounds,
                                  restart_every=restart_every, u=u, restart_rounds=m1,
                                  difference_rounds=m2, rho=rho, padded_dim=padded_dim, z1=z1,
                                  z2=z2, epsilon_spent=spent(lo))


def client_variance(noise_multiplier: float, l2: float, clients: int, tolerated: int) -> float:
    """Each client's share of the noise variance so that any P - t honest clients add up to (z·Δ₂)².

    Raises:
        ValueError: t >= P (no honest client would be left to carry the noise).
    """
    if not 0 <= tolerated < clients:
        raise ValueError(
            f"`tolerated` (t, clients that may drop out or collude) must be in [0, P - 1] = "
                         f"[0, {clients - 1}]. Found {tolerated}.")
    return (noise_multiplier * l2) ** 2 / (clients - tolerated)


@dataclass(frozen=True)
class SkellamLedger:
    """The distributed-noise rounds released so far and ε spent: the Rényi DP of Corollary 3.6
    composed and converted by dp-accounting (:func:`schedule_epsilon`). It is the only accountant of
    this mechanism, so ``epsilon_pld`` and ``epsilon_rdp`` (the names of the central ledger's
    cross-checks) report the same number; the tests check it against dp-accounting's Gaussian RDP
    and the exact Skellam divergence."""

    delta: float
    events: tuple[SkellamEvent, ...] = ()

    def record(self, *events: SkellamEvent) -> "SkellamLedger":
        """A new ledger with ``events`` released after this one's (this ledger is unchanged)."""
        return SkellamLedger(self.delta, self.events + tuple(events))

    exact = False

    @functools.cached_property
    def epsilon(self) -> float:
        """Computed once per ledger (a value): the budget guard and the round's row read it several
        times."""
        return schedule_epsilon(self.events, self.delta)

    @property
    def epsilon_pld(self) -> float:
        """:attr:`epsilon`, under the central ledger's name for its PLD cross-check."""
        return self.epsilon

    @property
    def epsilon_rdp(self) -> float:
        """:attr:`epsilon`, under the central ledger's name for its RDP cross-check."""
        return self.epsilon


@dataclass(frozen=True)
class DistributedNoise:
    """A run's public distributed-noise settings: what every client and the server derive each
    round's encoding and noise from (nothing here is secret; each client draws its own noise).

    Round r with clipping radius C_r: every client clips its mean to C_r, so Σ_p x_p has norm <=
    P·C_r and one record moves one client's mean by at most 2 C_r / n_min. The round's code
    (:meth:`code`) is the finest grid whose noised sum wraps around the modulus with probability <=
    ``wrap``; its rotation seed is r (public).
    """

    calibration: DistributedCalibration
    dim: int
    bits: int
    clients: int
    tolerated: int
    n_min: int
    wrap: float

    @property
    def threshold(self) -> int:
        """The fewest surviving clients a round may release with: P - t (their shares alone carry
        the noise)."""
        return self.clients - self.tolerated

    def event(self, restart: bool) -> SkellamEvent:
        """What a restart round (or, ``restart`` False, a difference round) of this run costs."""
        return self.calibration.event(restart)

    def code(self, r: int, restart: bool, radius: float) -> SkellamCode:
        """Round r's encoding (scale, rounding bound, modulus, rotation seed r) for clipping radius
        ``radius``."""
        return _round_code(self, r, restart, radius)

    def _code(self, r: int, restart: bool, radius: float) -> SkellamCode:
        if not (math.isfinite(radius) and radius >= 0):
            raise ValueError(
                f"round {r}: distributed noise needs a finite clipping radius >= 0. Found "
                f"{radius}.")
        z, rho = self.event(restart).noise_multiplier, self.calibration.rho
        # every clipped mean is 0: the grid carries no signal, only the noise of Δ₂ = 2ρ
        if radius == 0:
            code = SkellamCode(self.dim, 1.0, rho, self.bits, r)
            if wrap_probability(code, 0.0, self.clients, (2 * z * rho) ** 2) > self.wrap:
                raise ValueError(
                    f"round {r}: `bits` = {self.bits} cannot hold the noise of {self.clients} "
                    f"clients.")
            return code
        return choose_scale(self.dim, self.bits, self.clients * radius, self.clients, z,
                            2 * radius / self.n_min, rho, self.wrap, r)

    def total_variance(self, code: SkellamCode, restart: bool, radius: float) -> float:
        """(z Δ₂)²: the variance the P - t honest clients' shares add up to, in integer units."""
        l2 = sensitivity(2 * radius / self.n_min, code)[1]
        return (self.event(restart).noise_multiplier * l2) ** 2

    def share_variance(self, code: SkellamCode, restart: bool, radius: float) -> float:
        """One client's share of the noise variance: (z Δ₂)² / (P - t)."""
        return self.total_variance(code, restart, radius) / self.threshold

    def encode(self, mean: np.ndarray, r: int, restart: bool, radius: float,
               rng: np.random.Generator) -> np.ndarray:
        """One client's message of round r: its clipped mean (norm <= ``radius``) encoded with its
        noise share."""
        code = self.code(r, restart, radius)
        return encode(mean, code, self.share_variance(code, restart, radius), rng)

    def decode(self, total: np.ndarray, r: int, restart: bool, radius: float,
               survivors: int) -> np.ndarray:
        """The noised mean (1/k) Σ_p x_p + noise of the k = ``survivors`` clients whose messages add
        up to ``total`` (mod 2**bits)."""
        return decode(total, self.code(r, restart, radius)) / survivors

    def noise_std(self, r: int, restart: bool, radius: float, survivors: int) -> float:
        """The std per coordinate of the noise in :meth:`decode`'s mean (k shares of (zΔ₂)²/(P - t)
        each)."""
        code = self.code(r, restart, radius)
        return math.sqrt(survivors * self.share_variance(code, restart,
                                                         radius)) / code.scale / survivors


@functools.lru_cache(maxsize=64)
def _round_code(noise: DistributedNoise, r: int, restart: bool, radius: float) -> SkellamCode:
    return noise._code(r, restart, radius)


def distributed_noise(  # noqa: PLR0913 -- keyword-only: the run's settings, one keyword each
        *, epsilon: float, delta: float, rounds: int, restart_every: int, u: float, dim: int,
        bits: int, clients: int, tolerated: int, n_min: int, wrap: float) -> DistributedNoise:
    """The distributed-noise settings of a run, calibrated for (ε, δ) over its schedule and checked:
    parameters under which the sum would wrap around at every grid, or the honest clients could not
    carry the noise, raise.

    Raises:
        ValueError: naming the parameter, the value found and what would do.
    """
    if not (isinstance(clients, int) and clients >= 2):
        raise ValueError(
            f"distributed noise needs at least 2 clients (secure aggregation of one is its value). "
                         f"Found P = {clients}.")
    if not (isinstance(tolerated, int) and 0 <= 2 * tolerated < clients):
        raise ValueError(
            f"`tolerated` (t, the clients that may drop out or collude) must satisfy 0 <= 2t < P "
            f"= {clients}: the P - t survivors needed to unmask must outnumber the t colluders. "
            f"Found t = {tolerated}.")
    if not 0 < wrap < 1:
        raise ValueError(
            f"`wrap` (the wrap-around probability per round) must be in (0, 1). Found {wrap}.")
    if not (isinstance(n_min, int) and n_min >= 1) or not (isinstance(dim, int) and dim >= 1):
        raise ValueError(f"`n_min` and `dim` must be integers >= 1. Found {n_min}, {dim}.")
    rho = rounding_bound(dim, ROUNDING_BETA)
    cal = calibrate_distributed(epsilon=epsilon, delta=delta, rounds=rounds,
                                restart_every=restart_every, u=u, rho=rho,
                                padded_dim=SkellamCode(dim, 1.0, rho, 2, 0).padded)
    noise = DistributedNoise(cal, dim, bits, clients, tolerated, n_min, wrap)
    for restart in (True, False) if cal.difference_rounds else (True,):
        # the bits must hold the rounding and the noise at some grid (any radius)
        noise.code(1, restart, 1.0)
    return noise


_CLIENT_NOISE_DOMAIN = 0x5EC0A99


def client_rng(seed: int | None, partition_id: int, r: int) -> np.random.Generator:
    """A client's generator for round r's rounding and noise share: OS entropy (128 bits), or with
    ``seed`` one derived from (seed, partition, round) alone, which anyone who knows the seed can
    rebuild (tests only)."""
    entropy = secrets.randbits(128) if seed is None else seed
    spawn = () if seed is None else (_CLIENT_NOISE_DOMAIN, partition_id, r)
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(entropy=entropy,
                                                                      spawn_key=spawn)))
