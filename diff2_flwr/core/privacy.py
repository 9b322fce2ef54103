"""The privacy spent so far (a run's ledger, runs composed), and where to import privacy from.

:class:`PrivacyLedger` holds the events a run has released and reports ε by three accountants;
:class:`RunEvents` is a run's whole planned schedule by counts and :func:`composed_epsilon` composes
the runs a data owner's node has taken part in. The calibration of the noise (the closed forms of
Gaussian DP, σ of a schedule) lives in :mod:`~diff2_flwr.core.calibration`, the events and
dp-accounting's distributions of them in :mod:`~diff2_flwr.core.accounting`; both are importable
from here too (``__all__``).

References:
    Dong, Roth & Su (2019), "Gaussian Differential Privacy", Cor. 2.13 and Cor. 3.3.
    Koskela, Jälkö & Honkela (2020) and dp-accounting's ``privacy_loss_distribution`` (PLD
    composition).
"""

from __future__ import annotations

import functools
import hashlib
import math
import struct
from dataclasses import dataclass
from typing import Any, Sequence

from .accounting import (
    PLD_DISCRETIZATION,
    PLD_MEMO,
    SAMPLED_STEPS,
    GaussianEvent,
    LocalEvent,
    PldMemo,
    SampledGaussianEvent,
    event_key,
    counts_pld_epsilon,
    event_pld,
    gaussian_pld,
    local_pld,
    rdp_epsilon,
    sampled_gaussian_pld,
)
from .calibration import (
    Calibration,
    CalibrationMode,
    LocalCalibration,
    calibrate,
    calibrate_local,
    count_rounds,
    expected_noise_norm,
    gdp_delta,
    gdp_epsilon,
    gdp_mu,
    gdp_mu_of_multipliers,
    noise_multiplier,
    schedule_cross_check,
    sigma_from_multiplier,
    zcdp_rho,
)

__all__ = [
    "Calibration",
    "GaussianEvent",
    "LocalCalibration",
    "LocalEvent",
    "calibrate_local",
    "PrivacyLedger",
    "PldMemo",
    "PLD_MEMO",
    "CalibrationMode",
    "RunEvents",
    "SampledGaussianEvent",
    "calibrate",
    "composed_epsilon",
    "count_rounds",
    "expected_noise_norm",
    "gdp_delta",
    "gdp_epsilon",
    "gdp_mu",
    "gdp_mu_of_multipliers",
    "noise_multiplier",
    "schedule_cross_check",
    "sigma_from_multiplier",
    "zcdp_rho",
]


@dataclass(frozen=True)
class PrivacyLedger:
    """The events released so far, and ε spent by three accountants.

    ``epsilon``: the budget guard's number. For full-batch Gaussian rounds only, the exact μ-GDP
    composition (closed form); once a local phase (:class:`LocalEvent`, subsampled) or a
    client-sampled round (:class:`SampledGaussianEvent`) is in the ledger no closed form is exact
    and ``epsilon`` is the PLD accountant's (``exact`` says which).
    ``epsilon_pld``: Google's dp-accounting privacy-loss-distribution accountant, composed
    incrementally (one FFT convolution per released event), pessimistic by its discretisation.
    ``epsilon_rdp``: dp-accounting's Rényi accountant (looser; for comparison). Its RDP accountant
    has no replace-one Poisson subsampling, so a local step enters it unamplified (a full-batch
    Gaussian with multiplier σ3 b / 2 over the replace-one sensitivity 2c/b): a valid, looser upper
    bound. A client-sampled round enters it unamplified too (the full-batch Gaussian of its
    multiplier, which dominates it). ``noise_multiplier = 0`` (a non-private event) makes every ε
    infinite.

    A value: δ and the events, nothing else. What its PLD composition remembers across ledgers lives
    in a :class:`PldMemo` (the process-wide :data:`PLD_MEMO`), which never changes a value.
    """

    delta: float
    events: tuple[GaussianEvent | SampledGaussianEvent | LocalEvent, ...] = ()

    def record(self, *events: GaussianEvent | SampledGaussianEvent | LocalEvent
               ) -> "PrivacyLedger":
        """A new ledger with ``events`` released after this one's (this ledger is unchanged)."""
        return PrivacyLedger(self.delta, self.events + tuple(events))

    @property
    def exact(self) -> bool:
        """Whether ``epsilon`` is the exact GDP closed form (full-batch Gaussian rounds only: no
        subsampled local phase, no client-sampled round)."""
        return all(isinstance(e, GaussianEvent) for e in self.events)

    @property
    def mu(self) -> float:
        """μ of the exact GDP composition (full-batch Gaussian events only; nan with a local
        phase or a client-sampled round)."""
        if not self.exact:
            return math.nan
        if any(e.noise_multiplier == 0 for e in self.events):
            return math.inf
        return math.sqrt(sum(1 / e.noise_multiplier**2 for e in self.events))

    @property
    def epsilon(self) -> float:
        """ε spent at the ledger's δ: exact for full-batch Gaussian composition, else the PLD
        accountant's."""
        return gdp_epsilon(self.mu, self.delta) if self.exact else self.epsilon_pld

    def _degenerate(self) -> float | None:
        """ε when no accountant is needed: 0 with no events, inf with a noise-free event."""
        if not self.events:
            return 0.0
        if any(e.noise_multiplier == 0 for e in self.events):
            return math.inf
        return None

    def _counts(self) -> tuple[tuple[float, int], ...]:
        """(multiplier over the replace-one sensitivity, count) of full-batch Gaussians; local steps
        and client-sampled rounds unamplified."""
        counts: dict[float, int] = {}
        for e in self.events:
            z, n = (e.noise_multiplier / 2,
                    e.steps) if isinstance(e, LocalEvent) else (e.noise_multiplier, 1)
            counts[z] = counts.get(z, 0) + n
        return tuple(sorted(counts.items()))

    @property
    def epsilon_pld(self) -> float:
        """ε spent per dp-accounting's PLD accountant (an independent, slightly pessimistic
        bound)."""
        return self.pld_epsilon(PLD_MEMO)

    def pld_epsilon(self, memo: PldMemo) -> float:
        """:attr:`epsilon_pld`, composing only the events ``memo`` has not composed yet, and
        remembering in it."""
        if (trivial := self._degenerate()) is not None:
            return trivial
        keys = tuple(event_key(e) for e in self.events)
        flat = [v for k in keys for v in k]
        key = (self.delta, len(keys), hashlib.blake2b(struct.pack(f"{len(flat)}d", *flat),
                                                      digest_size=32).digest())
        if key in memo.epsilons:
            return memo.epsilons[key]
        pld, start = memo.longest_prefix(keys)
        for e in self.events[start:]:
            pld = event_pld(e) if pld is None else pld.compose(event_pld(e))
        memo.extend(keys, start, pld)
        epsilon = float(pld.get_epsilon_for_delta(self.delta))
        memo.epsilons.put(key, epsilon)
        return epsilon

    @functools.cached_property
    def event_counts(self) -> tuple[tuple[tuple[float, float, int], int], ...]:
        """(:func:`~diff2_flwr.core.accounting.event_key`, count) of the ledger's distinct events,
        sorted (counted once per ledger: a plan's are read every round)."""
        counts: dict[tuple[float, float, int], int] = {}
        for e in self.events:
            key = event_key(e)
            counts[key] = counts.get(key, 0) + 1
        return tuple(sorted(counts.items()))

    def within(self, other: "PrivacyLedger") -> bool:
        """Whether every event of this ledger is matched by one of ``other``'s (the same δ; counted
        per distinct event): then this ledger's mechanism is a part of ``other``'s, and any ε bound
        of ``other`` bounds it too (post-processing)."""
        if self.delta != other.delta:
            return False
        theirs = dict(other.event_counts)
        return all(count <= theirs.get(key, 0) for key, count in self.event_counts)

    @property
    def epsilon_pld_by_counts(self) -> float:
        """ε spent per dp-accounting's PLD accountant with the events composed by counts (each
        distinct event self-composed): :func:`~diff2_flwr.core.accounting.counts_pld_epsilon`, one
        call for a whole schedule. Not the same rounding as :attr:`epsilon_pld` (another composition
        order), equally pessimistic."""
        if (trivial := self._degenerate()) is not None:
            return trivial
        return counts_pld_epsilon(self.delta, self.event_counts)

    @property
    def epsilon_rdp(self) -> float:
        """ε spent per dp-accounting's RDP accountant (looser; for comparison)."""
        if (trivial := self._degenerate()) is not None:
            return trivial
        return rdp_epsilon(self.delta, self._counts())


@dataclass(frozen=True)
class RunEvents:
    """One run's whole planned schedule of privacy events, by counts: what a data owner's node is
    charged.

    ``gaussian``: (z, count) pairs, z in :class:`GaussianEvent`'s convention (std over the
    replace-one sensitivity). ``local``: (z3, q, steps, phases) tuples, z3 and q in
    :class:`LocalEvent`'s convention, ``steps`` Poisson-subsampled Gaussian steps per local phase
    and ``phases`` local phases (one per round). ``sampled``: (z, π, count) tuples of client-sampled
    rounds, the :class:`SampledGaussianEvent` (z, π) the run's own ledger records for them, π the
    probability that the node's client is in a round's cohort. ``delta`` is the run's own δ (its ε
    is reported at it; a node composes its runs at its own δ).

    References:
        Murata & Suzuki (2023), Alg. 1 (m1 restart rounds, m2 difference rounds); DIFF2.md,
        accounting section; :class:`SampledGaussianEvent` (the amplification of a sampled round).
    """

    delta: float
    gaussian: tuple[tuple[float, int], ...] = ()
    local: tuple[tuple[float, float, int, int], ...] = ()
    sampled: tuple[tuple[float, float, int], ...] = ()

    def __post_init__(self) -> None:
        if not 0 < self.delta < 1:
            raise ValueError(f"RunEvents: `delta` must be in (0, 1). Found {self.delta!r}.")
        for z, count in self.gaussian:
            _check_event("gaussian", z, count, "count")
        for z3, q, steps, phases in self.local:
            _check_event("local", z3, steps, "steps")
            _check_event("local", z3, phases, "phases")
            _check_probability("local", "sampling probability `q`", q)
        for z, pi, count in self.sampled:
            _check_event("sampled", z, count, "count")
            _check_probability("sampled", "inclusion probability `π`", pi)

    @classmethod
    def from_calibration(cls, cal: Calibration) -> "RunEvents":
        """The events of a calibrated schedule: m1 × z1, m2 × z2 and, with a local routine, R local
        phases LocalEvent(z3, q, K - 1); with client sampling m1 × (z1, π) and m2 × (z2, π) sampled
        rounds, the events :meth:`Calibration.round_events` gives the run's own ledger (a
        calibration with sampling has no local routine: :func:`calibrate` refuses the pair).
        """
        counts = ((cal.z1, cal.restart_rounds), (cal.z2, cal.difference_rounds))
        if cal.sampling is not None:
            pi = float(cal.sampling_prob)
            return cls(delta=cal.delta,
                       sampled=tuple((float(z), pi, m) for z, m in counts if m))
        gaussian = tuple((float(z), m) for z, m in counts if m)
        local = cal.local
        phases = () if local is None else ((float(local.z3), float(local.sampling_prob),
                                            local.steps - 1, cal.rounds),)
        return cls(delta=cal.delta, gaussian=gaussian, local=phases)

    @property
    def epsilon(self) -> float:
        """The run's own ε at its own δ (PLD, see :func:`composed_epsilon`)."""
        return composed_epsilon([self], self.delta)


def _check_probability(kind: str, name: str, q: Any) -> None:
    if not isinstance(q, (int, float)) or isinstance(q, bool) or not 0 < q <= 1:
        raise ValueError(f"RunEvents: a {kind} event's {name} must be in (0, 1]. Found {q!r}.")


def _check_event(kind: str, z: Any, count: Any, name: str) -> None:
    if not isinstance(z, (int, float)) or isinstance(z, bool) or not (math.isfinite(z) and z >= 0):
        raise ValueError(
            f"RunEvents: a {kind} event's noise multiplier must be a finite number >= 0. Found "
            f"{z!r}.")
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ValueError(
            f"RunEvents: a {kind} event's `{name}` must be an integer >= 1. Found {count!r}.")


def composed_epsilon(runs: "Sequence[RunEvents]", delta: float) -> float:
    """ε at ``delta`` of all the runs' events composed together (dp-accounting's PLD, pessimistic).

    Composition commutes, so the events are composed by counts: every full-batch Gaussian of every
    run together is one Gaussian with μ² = Σ count / z² (exact: Dong, Roth & Su 2019, Cor. 3.3;
    dp-accounting's ``PLDAccountant`` composes ``GaussianDpEvent`` × count the same way), the
    local phases of one kind (z3, q, steps) are one cached PLD self-composed by their total number
    of phases, and the client-sampled rounds of one kind (z, π) are the mixture PLD
    (:func:`~diff2_flwr.core.accounting.sampled_gaussian_pld`, the run's own ledger's)
    self-composed by their total count. A run of sampled rounds alone is then composed as
    :meth:`Calibration.planned_epsilon` composes it (the same PLDs in the same order: the same ε).
    ε is independent of the order of the runs. No runs (or no events): 0; a noise multiplier 0:
    inf.

    Args:
        runs: the runs' planned events.
        delta: the δ at which ε is reported, in (0, 1).

    References:
        Koskela, Jälkö & Honkela (2020) and dp-accounting's ``privacy_loss_distribution`` (PLD
        composition).
    """
    if not 0 < delta < 1:
        raise ValueError(f"`delta` must be in (0, 1). Found {delta!r}.")
    inverse_squares: list[float] = []
    # event_key's (z, q, steps): steps >= 1 a local phase, SAMPLED_STEPS a client-sampled round
    kinds: dict[tuple[float, float, int], int] = {}
    for run in runs:
        for z, count in run.gaussian:
            if z == 0:
                return math.inf
            inverse_squares.append(count / float(z) ** 2)
        for z, q, steps, n in (*run.local, *((z, pi, SAMPLED_STEPS, m) for z, pi, m in
                                             run.sampled)):
            if z == 0:
                return math.inf
            key = (float(z), float(q), steps)
            kinds[key] = kinds.get(key, 0) + n
    mu_squared = math.fsum(sorted(inverse_squares))
    return _composed_epsilon(float(delta), mu_squared, tuple(sorted(kinds.items())))


@functools.lru_cache(maxsize=4096)
def _composed_epsilon(delta: float, mu_squared: float,
                      kinds: tuple[tuple[tuple[float, float, int], int], ...]) -> float:
    pld = gaussian_pld(1 / math.sqrt(mu_squared)) if mu_squared > 0 else None
    for (z, q, steps), n in kinds:
        one = (sampled_gaussian_pld(z, q, PLD_DISCRETIZATION) if steps == SAMPLED_STEPS
               else local_pld(z, q, steps, PLD_DISCRETIZATION))
        one = one.self_compose(n) if n > 1 else one
        pld = one if pld is None else pld.compose(one)
    return 0.0 if pld is None else float(pld.get_epsilon_for_delta(delta))
