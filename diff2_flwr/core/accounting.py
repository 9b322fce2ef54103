"""The privacy events a DIFF2 run releases, and dp-accounting's distributions of them.

:class:`GaussianEvent` (a released server round) and :class:`LocalEvent` (the local phase of a
round) are what a :class:`~diff2_flwr.core.privacy.PrivacyLedger` records. Their privacy-loss
distributions (PLDs) and their Rényi accounting come from Google's dp-accounting (imported when
first needed; pure, so cached per process). :class:`PldMemo` (the process-wide :data:`PLD_MEMO`) is
what a process remembers of its ledgers' PLD composition. Everything here is importable from
:mod:`diff2_flwr.core.privacy` as well.

References:
    Koskela, Jälkö & Honkela (2020) and dp-accounting's ``privacy_loss_distribution`` (PLD
    composition). Zhu, Dong & Wang (2022), "Optimal Accounting of Differential Privacy via
    Characteristic Function", Def. 7 and Thm 10 (dominating pairs and their composition).
"""

from __future__ import annotations

import functools
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

__all__ = [
    "PLD_DISCRETIZATION",
    "GaussianEvent",
    "LocalEvent",
    "SAMPLED_STEPS",
    "SampledGaussianEvent",
    "PldMemo",
    "PLD_MEMO",
    "event_key",
    "event_pld",
    "gaussian_pld",
    "counts_pld_epsilon",
    "local_pld",
    "rdp_epsilon",
    "sampled_gaussian_pld",
    "sampled_schedule_epsilon",
    "schedule_pld_epsilon",
]

#: Discretisation of dp-accounting's privacy-loss distributions (pessimistic: an upper bound on ε).
PLD_DISCRETIZATION = 1e-4

#: The ``steps`` slot of a :class:`SampledGaussianEvent`'s :func:`event_key`: full-batch rounds have
#: 0 and local phases >= 1, so the keys of the three kinds never collide.
SAMPLED_STEPS = -1


@dataclass(frozen=True)
class GaussianEvent:
    """One released round: a Gaussian mechanism with this noise multiplier (std / sensitivity)."""

    noise_multiplier: float
    kind: str  # "restart" or "difference"


@dataclass(frozen=True)
class LocalEvent:
    """The local phase of one round: ``steps`` Poisson-subsampled Gaussian mechanisms on one
    worker's shard.

    Each local step samples every record of the chosen worker independently with probability
    ``q_p = b / n_p <= sampling_prob = b / n_min``, sums the sampled records' clipped gradient
    differences (each of norm <= c), divides by the *fixed* b and adds N(0, (σ3 c)² I). Under
    replace-one adjacency one record's term changes from a to a' (both of norm <= c/b) if it is
    sampled: the pair (1-q) N(0, s²) + q N(a, s²) vs (1-q) N(0, s²) + q N(a', s²), dominated by
    dp-accounting's ``REPLACE_ONE`` Poisson-subsampled Gaussian with sensitivity c/b.
    ``noise_multiplier`` is in that convention: std / (c/b) = σ3 b (not std over the replace-one
    sensitivity 2c/b, as for :class:`GaussianEvent`). Every record is charged every local phase,
    whichever worker ran it.
    """

    noise_multiplier: float
    sampling_prob: float
    steps: int
    kind: str = "local"


@dataclass(frozen=True)
class SampledGaussianEvent:
    """One released round under client sampling: a Gaussian mechanism seen by a record only when
    its client is in the round's cohort.

    The round releases A_r + N(0, std² I) with A_r = (1/E|S|) Σ_{p∈S_r} a_p
    (:mod:`~diff2_flwr.core.sampling`). A record of client p is in it iff p ∈ S_r, with
    probability π = ``sampling_prob`` (q for Poisson; m/P for a fixed cohort: only the marginal
    matters). Given p ∈ S_r, replacing the record moves A_r by at most Δ = 2C / (n_min E|S|),
    whoever else was drawn.

    ``noise_multiplier`` is in :class:`GaussianEvent`'s convention: z = std / Δ, std over the
    replace-one sensitivity (the diameter 2C/(n_min E|S|), not the radius of :class:`LocalEvent`'s
    convention), so the noise std per unit radius is σ = 2z / (n_min E|S|).

    **Accounting (record level, replace-one).** Let the mechanism also reveal the cohort: M̃(D) =
    (S_r, M(D)); M is a post-processing of it, so a bound for M̃ bounds M. The cohort's law does not
    depend on the data; given p ∉ S_r the two outputs have the same law, given p ∈ S_r they are
    N(c + b, std²) and N(c + b', std²) with ‖b − b'‖ ≤ Δ. Hence for every α ≥ 1 (both directions)

        H_α(M̃(D) ‖ M̃(D')) = π H_α(N(b, std²) ‖ N(b', std²)) ≤ H_α(P_π ‖ Q_π),
        P_π = (1 − π) ⊥ + π N(1, z²),      Q_π = (1 − π) ⊥ + π N(0, z²),

    (⊥ a point off the real line), a dominating pair whose privacy-loss distribution is the mixture
    (1 − π) δ_0 + π L_z of no loss and the Gaussian's loss L_z. Dominating pairs compose (adaptive
    rounds, fresh independent cohorts), so the ledger composes these PLDs. The pair is tight: the
    client's other records put b far from c (‖b‖ up to C/E|S|, typically many std away), and then
    the output reveals whether p was drawn. For the same reason dp-accounting's ``REPLACE_ONE``
    Poisson-subsampled Gaussian (its pair (1 − π) N(0) + π N(∓s)) is *not* a valid bound here: it
    assumes that the record's absence moves the output by at most one record's contribution, as
    with record-level sampling (the local routine's :class:`LocalEvent`), whereas a client's absence
    removes all its records. Nor is ``SampledWithoutReplacementDpEvent`` (record-level, a replaced
    record's slot taken by another record). So the amplification is linear in π (over the rounds a
    record takes part in), not quadratic, and it survives a public cohort. With π = 1 the event is
    exactly ``GaussianEvent(z)``.
    """

    noise_multiplier: float
    sampling_prob: float
    kind: str  # "restart" or "difference"

    def __post_init__(self) -> None:
        z, q = self.noise_multiplier, self.sampling_prob
        if not isinstance(z, (int, float)) or isinstance(z, bool) or not (math.isfinite(z)
                                                                          and z >= 0):
            raise ValueError(
                f"SampledGaussianEvent: `noise_multiplier` must be a finite number >= 0. Found "
                f"{z!r}.")
        if not isinstance(q, (int, float)) or isinstance(q, bool) or not 0 < q <= 1:
            raise ValueError(
                f"SampledGaussianEvent: `sampling_prob` (the probability that a record's client is "
                f"in the cohort) must be in (0, 1]. Found {q!r}.")


def event_pld(event: "GaussianEvent | SampledGaussianEvent | LocalEvent") -> Any:
    """The PLD of one released event, at the ledger's discretisation."""
    if isinstance(event, LocalEvent):
        return local_pld(event.noise_multiplier, event.sampling_prob, event.steps,
                         PLD_DISCRETIZATION)
    if isinstance(event, SampledGaussianEvent):
        return sampled_gaussian_pld(event.noise_multiplier, event.sampling_prob,
                                    PLD_DISCRETIZATION)
    return gaussian_pld(event.noise_multiplier)


def event_key(event: "GaussianEvent | SampledGaussianEvent | LocalEvent"
              ) -> tuple[float, float, int]:
    """(noise multiplier, sampling probability, steps): what identifies an event's PLD.

    ``steps`` is 0 for a full-batch round, :data:`SAMPLED_STEPS` (-1) for a client-sampled round
    and the number of local steps (>= 1) for a local phase, so no two kinds share a key.
    """
    if isinstance(event, LocalEvent):
        return (event.noise_multiplier, event.sampling_prob, event.steps)
    if isinstance(event, SampledGaussianEvent):
        return (event.noise_multiplier, event.sampling_prob, SAMPLED_STEPS)
    return (event.noise_multiplier, 1.0, 0)


@functools.lru_cache(maxsize=64)
def gaussian_pld(noise_multiplier: float) -> Any:
    """PLD of one full-batch Gaussian mechanism with this multiplier (dp-accounting,
    pessimistic)."""
    return _gaussian_pld_at(noise_multiplier, PLD_DISCRETIZATION)


@functools.lru_cache(maxsize=64)
def _gaussian_pld_at(noise_multiplier: float, interval: float) -> Any:
    from dp_accounting.pld import privacy_loss_distribution  # noqa: PLC0415 -- dp-accounting: ~2 s import, on first use

    return privacy_loss_distribution.from_gaussian_mechanism(
        standard_deviation=noise_multiplier, sensitivity=1.0,
        value_discretization_interval=interval)


@functools.lru_cache(maxsize=64)
def sampled_gaussian_pld(noise_multiplier: float, sampling_prob: float,
                         interval: float = PLD_DISCRETIZATION) -> Any:
    """PLD of one client-sampled round (:class:`SampledGaussianEvent`): the mixture
    π L_z + (1 − π) δ_0 (dp-accounting, pessimistic).

    Built from dp-accounting's public pieces: ``from_gaussian_mechanism(z, sensitivity=1)`` (the
    pair N(0, z²) vs N(1, z²), connect-the-dots, pessimistic) mixed by
    ``PrivacyLossDistribution.compute_mixture`` with ``identity()`` (all mass at loss 0);
    dp-accounting mixes PLDs the same way in ``from_truncated_subsampled_gaussian_mechanism``.
    δ(ε) is linear in the PLD, so the result's δ(ε) is π times the Gaussian's (pessimistic)
    δ_z(ε), and the mixture of the connect-the-dots PLD (itself a dominating PLD) with no loss is
    the PLD of a pair dominating (P_π, Q_π). π = 1 gives the full-batch Gaussian's PLD object
    itself.

    Args:
        noise_multiplier: z, std over the replace-one sensitivity.
        sampling_prob: π in (0, 1].
        interval: the PLD's discretisation.
    """
    from dp_accounting.pld import privacy_loss_distribution  # noqa: PLC0415 -- dp-accounting: ~2 s import, on first use

    gauss = _gaussian_pld_at(noise_multiplier, interval)
    if sampling_prob == 1:
        return gauss
    return gauss.compute_mixture(privacy_loss_distribution.identity(interval), sampling_prob)


@functools.lru_cache(maxsize=64)
def local_pld(noise_multiplier: float, sampling_prob: float, steps: int, interval: float) -> Any:
    """PLD of ``steps`` Poisson-subsampled Gaussian steps under replace-one (dp-accounting,
    pessimistic)."""
    from dp_accounting import NeighboringRelation  # noqa: PLC0415 -- dp-accounting: ~2 s import, on first use
    from dp_accounting.pld import privacy_loss_distribution  # noqa: PLC0415 -- dp-accounting: ~2 s import, on first use

    one = privacy_loss_distribution.from_gaussian_mechanism(
        standard_deviation=noise_multiplier, sensitivity=1.0, sampling_prob=sampling_prob,
        neighboring_relation=NeighboringRelation.REPLACE_ONE,
        value_discretization_interval=interval)
    return one.self_compose(steps) if steps > 1 else one


@functools.lru_cache(maxsize=1024)
def schedule_pld_epsilon(  # noqa: PLR0913 -- lru_cache'd: the schedule as hashable numbers
        delta: float, m1: int, z1: float, m2: int, z2: float | None, z3: float, q: float,
        local_steps: int, rounds: int, interval: float = PLD_DISCRETIZATION) -> float:
    """ε (PLD, composed by counts) of m1 + m2 server rounds and ``rounds`` local phases of
    ``local_steps`` steps."""
    from dp_accounting.pld import privacy_loss_distribution as plds  # noqa: PLC0415 -- dp-accounting: ~2 s import, on first use

    local = local_pld(z3, q, local_steps, interval)
    pld = local.self_compose(rounds) if rounds > 1 else local
    for m, z in ((m1, z1), (m2, z2)):
        if m:
            assert z is not None
            gauss = plds.from_gaussian_mechanism(standard_deviation=z / math.sqrt(m),
                                                 sensitivity=1.0,
                                                 value_discretization_interval=interval)
            pld = pld.compose(gauss)
    return float(pld.get_epsilon_for_delta(delta))


@functools.lru_cache(maxsize=256)
def counts_pld_epsilon(delta: float, counts: tuple[tuple[tuple[float, float, int], int],
                                                   ...]) -> float:
    """ε at ``delta`` of events given as (:func:`event_key`, count) pairs, by dp-accounting's PLD
    accountant: each distinct event's PLD self-composed ``count`` times, then the results composed
    (pessimistic, the ledger's discretisation). Order-free, so one call covers a whole schedule (≈
    0.1–0.2 s for 2,000 rounds, where composing them one at a time costs ≈ 15 ms per round)."""
    return _counts_epsilon(delta, counts, PLD_DISCRETIZATION)


def _key_pld(key: tuple[float, float, int], interval: float) -> Any:
    z, q, steps = key
    if steps == 0:
        return gaussian_pld(z) if interval == PLD_DISCRETIZATION else _gaussian_pld_at(z, interval)
    if steps == SAMPLED_STEPS:
        return sampled_gaussian_pld(z, q, interval)
    return local_pld(z, q, steps, interval)


def _counts_epsilon(delta: float, counts: tuple[tuple[tuple[float, float, int], int], ...],
                    interval: float) -> float:
    pld = None
    for key, count in counts:
        one = _key_pld(key, interval)
        part = one.self_compose(count) if count > 1 else one
        pld = part if pld is None else pld.compose(part)
    return 0.0 if pld is None else float(pld.get_epsilon_for_delta(delta))


@functools.lru_cache(maxsize=1024)
def sampled_schedule_epsilon(  # noqa: PLR0913 -- lru_cache'd: the schedule as hashable numbers
        delta: float, m1: int, z1: float, m2: int, z2: float | None, sampling_prob: float,
        interval: float = PLD_DISCRETIZATION) -> float:
    """ε (PLD, composed by counts) of m1 restart and m2 difference client-sampled rounds.

    The events' keys are composed in :func:`counts_pld_epsilon`'s order, so at
    :data:`PLD_DISCRETIZATION` this is the same number as the PLD by counts of a ledger holding
    those events (:attr:`~diff2_flwr.core.privacy.PrivacyLedger.epsilon_pld_by_counts`).

    Args:
        delta: δ in (0, 1).
        m1, z1: restart rounds and their multiplier (:class:`SampledGaussianEvent` convention).
        m2, z2: difference rounds and theirs (z2 None when m2 = 0).
        sampling_prob: π, the probability that a record's client is in a round's cohort.
        interval: the PLDs' discretisation (coarser is faster and more pessimistic).
    """
    counts: dict[tuple[float, float, int], int] = {}
    for m, z in ((m1, z1), (m2, z2)):
        if m:
            if z is None or z == 0:
                return math.inf
            key = (float(z), float(sampling_prob), SAMPLED_STEPS)
            counts[key] = counts.get(key, 0) + m
    return _counts_epsilon(delta, tuple(sorted(counts.items())), interval)


@functools.lru_cache(maxsize=16384)
def rdp_epsilon(delta: float, counts: tuple[tuple[float, int], ...]) -> float:
    """ε at ``delta`` of (multiplier, count) full-batch Gaussians by dp-accounting's RDP
    accountant."""
    from dp_accounting import dp_event  # noqa: PLC0415 -- dp-accounting: ~2 s import, on first use
    from dp_accounting.rdp import rdp_privacy_accountant  # noqa: PLC0415 -- dp-accounting: ~2 s import, on first use

    accountant = rdp_privacy_accountant.RdpAccountant()
    for z, count in counts:
        accountant.compose(dp_event.GaussianDpEvent(z), count)
    return float(accountant.get_epsilon(delta))


class _BoundedCache(OrderedDict):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size

    def put(self, key: Any, value: Any) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.size:
            self.popitem(last=False)


class PldMemo:
    """What a process remembers of its ledgers' PLD accounting: the one mutable part of it, owned
    here.

    A :class:`~diff2_flwr.core.privacy.PrivacyLedger` is a value (δ and its events). Its PLD ε needs
    the events' PLDs composed in release order, one FFT convolution each; a run asks after every
    round, so composing from the first event every time would cost O(R²). The memo keeps the
    composed PLD of the last ``chains`` event sequences: a ledger whose events extend one composes
    only its new events. Composition is a left fold in release order either way, so the value is the
    same bits as a fresh composition (a resumed run reproduces it). And ε by (δ, the events): the
    runs of one schedule (a study's seeds, an audit's trials) release the same events, so each
    prefix's ε is computed once. Values never depend on what the memo holds; ``clear()`` forgets
    everything.

    Args:
        epsilons: how many ε values to keep (least recently stored dropped first).
        chains: how many composed PLDs to keep (each a few MB for thousands of events).
    """

    def __init__(self, *, epsilons: int = 16384, chains: int = 4) -> None:
        self.epsilons = _BoundedCache(epsilons)
        self.chains = _BoundedCache(chains)  # events' keys -> their composed PLD

    def clear(self) -> None:
        """Forget every remembered ε and composed PLD (later values are the same, only slower)."""
        self.epsilons.clear()
        self.chains.clear()

    def longest_prefix(self, keys: tuple[tuple[float, float, int], ...]) -> tuple[Any, int]:
        """The composed PLD of the longest remembered sequence that ``keys`` starts with, and its
        length (None, 0 if there is none)."""
        best: tuple[Any, int] = (None, 0)
        for chain, pld in self.chains.items():
            if best[1] < len(chain) <= len(keys) and keys[:len(chain)] == chain:
                best = (pld, len(chain))
        return best

    def extend(self, keys: tuple[tuple[float, float, int], ...], start: int, pld: Any) -> None:
        """Remember ``pld``, the composition of ``keys``, in place of the sequence of its first
        ``start`` keys."""
        self.chains.pop(keys[:start], None)
        self.chains.put(keys, pld)


#: The process-wide memo of :attr:`~diff2_flwr.core.privacy.PrivacyLedger.epsilon_pld`.
PLD_MEMO = PldMemo()
