"""DIFF2 with distributed Skellam noise: the privacy of a schedule, and its calibration.

In ``privacy.noise: distributed`` mode every round is a Skellam mechanism on the integer sum of the clients'
encoded vectors (:mod:`diff2_flwr.core.skellam`). A round whose clients clip to radius C encodes with scale s and
rounding bound ρ, so one record moves the integer sum by at most Δ₂ = s·2C/n_min + 2ρ. The honest clients' shares
add up to Skellam noise of variance (z Δ₂)²: z is the round's noise multiplier, as in central mode, but against the
*integer* sensitivity, so rounding's inflation of Δ₂ is paid for in noise.

The round's Rényi DP is then at most α/(2z²) (the Gaussian's) plus the discretisation surcharge of Corollary 3.6
at variance (zΔ₂)². The surcharge only shrinks as Δ₂ grows (for fixed z), and Δ₂ >= 2ρ, so evaluating it at
Δ₂ = 2ρ bounds every round whatever its radius: the schedule's ε is known before the run, like central mode's.

Calibration follows central DIFF2: a budget B split by u between the m1 restart and m2 difference rounds
(m1/z1² = B/u, m2/z2² = B(u-1)/u), with B the largest whose composed Rényi DP converts to at most ε at δ.

Threat model parameter: ``tolerated`` = t, the number of the P clients that may drop out or collude. A colluder
knows its own share and a dropped client's share is missing, so each client adds variance (zΔ₂)²/(P - t): the
P - t honest survivors alone carry (zΔ₂)².

References:
    Agarwal, Kairouz & Liu (2021), Corollary 3.6 (Skellam RDP). Murata & Suzuki (2023), the budget split by u.
    Canonne, Kamath & Steinke (2020), Proposition 12 (RDP to (ε, δ)).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

from .calibration import check_epsilon_delta, count_rounds, split_budget
from .skellam import RDP_ORDERS, rdp_to_epsilon, skellam_rdp

__all__ = ["SkellamEvent", "DistributedCalibration", "schedule_rdp", "schedule_epsilon", "calibrate_distributed",
           "client_variance"]


@dataclass(frozen=True)
class SkellamEvent:
    """One round under distributed noise: honest noise std ``noise_multiplier`` · Δ₂ on an integer sum of
    ``padded_dim`` coordinates whose rounding bound is ``rho``."""

    noise_multiplier: float
    rho: float
    padded_dim: int
    kind: str  # "restart" or "difference"

    def rdp(self, order: int) -> float:
        """Rényi DP at ``order``, for any round radius: Corollary 3.6 at the smallest Δ₂ = 2ρ (see the module)."""
        l2 = 2 * self.rho
        l1 = min(math.sqrt(self.padded_dim) * l2, l2 * l2)
        return skellam_rdp(order, l1, l2, (self.noise_multiplier * l2) ** 2)


def schedule_rdp(events: Sequence[SkellamEvent], orders: Sequence[int] = RDP_ORDERS) -> list[float]:
    """The composed Rényi DP of ``events`` at each order (RDP adds up under composition; equal events counted)."""
    counts = Counter(events)
    return [sum(n * e.rdp(a) for e, n in counts.items()) for a in orders]


def schedule_epsilon(events: Sequence[SkellamEvent], delta: float) -> float:
    """ε at ``delta`` of the composition of ``events`` (0 for none)."""
    if not events:
        return 0.0
    return rdp_to_epsilon(schedule_rdp(events), RDP_ORDERS, delta)


@dataclass(frozen=True)
class DistributedCalibration:
    """The noise of a DIFF2 schedule under distributed Skellam noise, and what it was calibrated for."""

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
        z = self.z1 if restart else self.z2
        if z is None:
            raise ValueError("this schedule has no difference rounds (T = 1).")
        return SkellamEvent(z, self.rho, self.padded_dim, "restart" if restart else "difference")

    def events(self) -> list[SkellamEvent]:
        differences = [self.event(False)] * self.difference_rounds if self.difference_rounds else []
        return [self.event(True)] * self.restart_rounds + differences


def calibrate_distributed(*, epsilon: float, delta: float, rounds: int, restart_every: int, u: float, rho: float,
                          padded_dim: int) -> DistributedCalibration:
    """The least noise (largest budget B) whose schedule is (ε, δ)-DP by this module's accounting.

    Raises:
        ValueError: on an invalid argument, naming it, with the value found.
    """
    check_epsilon_delta(epsilon, delta)
    if rounds < 1:
        raise ValueError(f"`rounds` must be >= 1. Found {rounds}.")
    m1, m2 = count_rounds(rounds, restart_every)
    if m2 > 0 and not (math.isfinite(u) and u > 1):
        raise ValueError(f"`u` must be a finite number > 1 when there are difference rounds. Found {u}.")

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
    return DistributedCalibration(epsilon=epsilon, delta=delta, rounds=rounds, restart_every=restart_every, u=u,
                                  restart_rounds=m1, difference_rounds=m2, rho=rho, padded_dim=padded_dim, z1=z1,
                                  z2=z2, epsilon_spent=spent(lo))


def client_variance(noise_multiplier: float, l2: float, clients: int, tolerated: int) -> float:
    """Each client's share of the noise variance so that any P - t honest clients add up to (z·Δ₂)².

    Raises:
        ValueError: t >= P (no honest client would be left to carry the noise).
    """
    if not 0 <= tolerated < clients:
        raise ValueError(f"`tolerated` (t, clients that may drop out or collude) must be in [0, P - 1] = "
                         f"[0, {clients - 1}]. Found {tolerated}.")
    return (noise_multiplier * l2) ** 2 / (clients - tolerated)
