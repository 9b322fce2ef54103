"""The privacy events a DIFF2 run releases, and dp-accounting's distributions of them.

:class:`GaussianEvent` (a released server round) and :class:`LocalEvent` (the local phase of a
round) are what a :class:`~diff2_flwr.core.privacy.PrivacyLedger` records. Their privacy-loss
distributions (PLDs) and their Rényi accounting come from Google's dp-accounting (imported when
first needed; pure, so cached per process). :class:`PldMemo` (the process-wide :data:`PLD_MEMO`) is
what a process remembers of its ledgers' PLD composition. Everything here is importable from
:mod:`diff2_flwr.core.privacy` as well.

References:
    Koskela, Jälkö & Honkela (2020) and dp-accounting's ``privacy_loss_distribution`` (PLD
    composition).
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
    "PldMemo",
    "PLD_MEMO",
    "event_key",
    "event_pld",
    "gaussian_pld",
    "counts_pld_epsilon",
    "local_pld",
    "rdp_epsilon",
    "schedule_pld_epsilon",
]

#: Discretisation of dp-accounting's privacy-loss distributions (pessimistic: an upper bound on ε).
PLD_DISCRETIZATION = 1e-4


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


def event_pld(event: "GaussianEvent | LocalEvent") -> Any:
    """The PLD of one released event, at the ledger's discretisation."""
    if isinstance(event, LocalEvent):
        return local_pld(event.noise_multiplier, event.sampling_prob, event.steps,
                         PLD_DISCRETIZATION)
    return gaussian_pld(event.noise_multiplier)


def event_key(event: "GaussianEvent | LocalEvent") -> tuple[float, float, int]:
    """(noise multiplier, sampling probability, steps): what identifies an event's PLD."""
    if isinstance(event, LocalEvent):
        return (event.noise_multiplier, event.sampling_prob, event.steps)
    return (event.noise_multiplier, 1.0, 0)


@functools.lru_cache(maxsize=64)
def gaussian_pld(noise_multiplier: float) -> Any:
    """PLD of one full-batch Gaussian mechanism with this multiplier (dp-accounting,
    pessimistic)."""
    from dp_accounting.pld import privacy_loss_distribution  # noqa: PLC0415 -- dp-accounting: ~2 s import, on first use

    return privacy_loss_distribution.from_gaussian_mechanism(
        standard_deviation=noise_multiplier, sensitivity=1.0,
        value_discretization_interval=PLD_DISCRETIZATION)


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
    pld = None
    for (z, q, steps), count in counts:
        one = gaussian_pld(z) if steps == 0 else local_pld(z, q, steps, PLD_DISCRETIZATION)
        part = one.self_compose(count) if count > 1 else one
        pld = part if pld is None else pld.compose(part)
    return 0.0 if pld is None else float(pld.get_epsilon_for_delta(delta))


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
