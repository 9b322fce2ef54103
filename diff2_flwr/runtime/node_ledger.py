"""A data owner's lifetime privacy ledger: one JSON file on the node, charged once per run, before
it releases.

Every run a node takes part in is charged with its whole planned schedule of privacy events
(:class:`~diff2_flwr.core.privacy.RunEvents`) before the node releases anything in it; the node
refuses a run whose charge would take the composed ε (PLD, at the node's δ_L) above its lifetime
ε_L. A deployment starts a fresh ClientApp process per message, so every message of a run calls
:meth:`NodeLedger.admit`: a run already charged with the same config digest is admitted again
without a new charge. A client-sampled run is charged as its node's policy says
(``lifetime.sampled_runs``, :func:`~diff2_flwr.runtime.policy.check_run`): refused (the default),
its amplified rounds (``RunEvents.sampled``: trusts the server's cohort draws), or unamplified
(:meth:`Charge.without_amplification`: each sampled event [z, π, count] charged as ``count`` full
Gaussian rounds of z, as if the node were in every round, which relies on no draw; charged in full
at admission, the rounds the node is not asked never refunded). Either is composed with every other
run by PLD.

Format: version 2 (each charge's ``events`` hold ``sampled``, a list of [z, π, count]); a version-1
file (no ``sampled``: every charge full-batch) is read as it is and written back as version 2 at
the next admission. A version-1 reader refuses a version-2 file (it would under-charge sampled
runs): fail closed.

Durable and crash-safe: read-check-write runs under an exclusive ``flock`` on a sibling lock file
(simulated nodes and concurrent ClientApp processes share nothing else); the new ledger is written
to a temporary file in the same folder, flushed and fsynced, renamed over the old one (atomic) and
the folder fsynced, so a crash leaves the old ledger or the new one, never a part. Files are created
0600 and missing folders 0700 (by the mode of ``open``/``mkdir``, so no window with wider modes). A
ledger that cannot be read is an error, never an empty ledger: that would reset the node's budget.

References:
    rename(2) and fsync(2) (POSIX: atomic replacement, durability of the folder entry); flock(2).
    DIFF2.md, accounting section; issue 19, item 2 (the node's lifetime budget).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import secrets
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, ContextManager, Mapping

from ..core.privacy import RunEvents, composed_epsilon
from .secret_files import exclusive_lock, fsync_folder

__all__ = [
    "Admission",
    "BudgetExceeded",
    "Charge",
    "LedgerError",
    "NodeLedger",
    "RunChanged",
    "config_digest",
    "unamplified_events",
]

FORMAT = "diff2-node-ledger"
#: The version written; :data:`READ_VERSIONS` are read (1: before client-sampled runs were charged).
VERSION = 2
READ_VERSIONS = (1, 2)
#: The keys of a charge's ``events`` by file version.
_EVENT_KEYS = {1: ("delta", "gaussian", "local"), 2: ("delta", "gaussian", "local", "sampled")}

_WHAT_TO_DO_CORRUPT = (
    "It is not read as empty (that would reset this node's lifetime budget): restore the file "
                       "from a backup or repair it by hand; until then this node admits no run.")


class LedgerError(ValueError):
    """The node's ledger cannot be read (unreadable, not JSON, another format or version, a bad
    charge) or written (its folder, its lock, a full disk): the node admits no run until it is
    fixed."""


class BudgetExceeded(ValueError):
    """A run would take the node's composed ε above its lifetime budget: refused, nothing
    charged."""


class RunChanged(ValueError):
    """A run already charged comes back with another config digest: refused (its charge no longer
    covers it)."""


def config_digest(config: Mapping[str, Any]) -> str:
    """``sha256:<hex>`` of a run config as canonical JSON (sorted keys): what a charge records of
    its run."""
    text = json.dumps(config, sort_keys=True, separators=(",", ":"), allow_nan=True, default=repr)
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class Charge:
    """What one run costs a node: its planned events, its own ε (at its own δ) and when it was
    charged.

    Attributes:
        run_id: the run's id (Flower's run id as text).
        digest: digest of the run's config (see :func:`config_digest`): a run whose config
            changes is refused.
        node: the node's name, for messages and the ledger's readers.
        events: the run's whole planned schedule of privacy events.
        epsilon: the run's own ε at ``events.delta`` (a record; the budget is checked on
            ``events``); None until charged (:meth:`NodeLedger.admit` computes it once, so later
            messages of the run do not).
        time: when it was charged, UTC, ISO 8601; None until charged.
        unamplified: the inclusion probabilities π of the client-sampled rounds that
            :meth:`without_amplification` turned into the full Gaussian rounds of ``events`` (for
            messages; the file records the events charged, not this).
    """

    run_id: str
    digest: str
    node: str
    events: RunEvents
    epsilon: float | None = None
    time: str | None = None
    unamplified: tuple[float, ...] = dataclasses.field(default=(), compare=False)

    @classmethod
    def new(cls, *, run_id: str, digest: str, node: str, events: RunEvents) -> "Charge":
        """A charge to admit (ε and time are filled in when it is charged)."""
        for name, value in (("run_id", run_id), ("digest", digest), ("node", node)):
            if not isinstance(value, str) or not value:
                raise ValueError(f"Charge: `{name}` must be a non-empty string. Found {value!r}.")
        if not isinstance(events, RunEvents):
            raise ValueError(
                f"Charge: `events` must be a RunEvents. Found {type(events).__name__}.")
        return cls(run_id, digest, node, events)

    def without_amplification(self) -> "Charge":
        """This charge with every client-sampled round charged unamplified
        (:func:`unamplified_events`): what a node that does not trust the server's cohort draws
        charges (``lifetime.sampled_runs: unamplified``). A charge without sampled rounds is
        returned as it is."""
        if not self.events.sampled:
            return self
        pis = tuple(sorted({float(pi) for _, pi, _ in self.events.sampled}))
        return dataclasses.replace(self, events=unamplified_events(self.events), epsilon=None,
                                   unamplified=pis)

    def priced(self) -> "Charge":
        """This charge with its own ε computed (if not yet) and stamped now (if not yet)."""
        stamp = datetime.now(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")
        epsilon = self.events.epsilon if self.epsilon is None else self.epsilon
        return dataclasses.replace(self, epsilon=epsilon, time=self.time or stamp)

    def as_json(self) -> dict[str, Any]:
        """The charge as the ledger stores it (version :data:`VERSION`): its run, config digest,
        node, time, ε and events."""
        events = {"delta": self.events.delta, "gaussian": [list(g) for g in self.events.gaussian],
                  "local": [list(e) for e in self.events.local],
                  "sampled": [list(e) for e in self.events.sampled]}
        return {"run_id": self.run_id, "digest": self.digest, "node": self.node, "time": self.time,
                "epsilon": self.epsilon, "events": events}

    @classmethod
    def from_json(cls, data: Any, version: int = VERSION) -> "Charge":
        """The charge written by :meth:`as_json` (or by a ledger of an earlier ``version``, one of
        :data:`READ_VERSIONS`); ValueError (what is wrong) on anything else."""
        if not isinstance(data, dict) or set(data) != {"run_id", "digest", "node", "time",
                                                       "epsilon", "events"}:
            found = sorted(data) if isinstance(data, dict) else type(data).__name__
            raise ValueError(
                f"expected an object with keys run_id, digest, node, time, epsilon, events; found "
                f"{found}")
        ev, keys = data["events"], _EVENT_KEYS[version]
        if not isinstance(ev, dict) or set(ev) != set(keys):
            raise ValueError(
                f"`events` must be an object with keys {', '.join(keys)} (version {version}); "
                f"found {ev!r}")
        events = RunEvents(delta=ev["delta"], gaussian=tuple(tuple(g) for g in ev["gaussian"]),
                           local=tuple(tuple(e) for e in ev["local"]),
                           sampled=tuple(tuple(e) for e in ev.get("sampled", ())))
        for key in ("run_id", "digest", "node", "time"):
            if not isinstance(data[key], str):
                raise ValueError(f"`{key}` must be a string; found {data[key]!r}")
        if not isinstance(data["epsilon"], (int, float)):
            raise ValueError(f"`epsilon` must be a number; found {data['epsilon']!r}")
        return cls(data["run_id"], data["digest"], data["node"], events, float(data["epsilon"]),
                   data["time"])


@dataclass(frozen=True)
class Admission:
    """A run admitted by the node: its charge, whether it was charged now, and ε spent at the
    budget's δ.

    ``new`` is False when the run had already been charged (a later message of the same run): then
    nothing was written and ``spent_before == spent_after`` (ε of every charge, this run's
    included).
    """

    charge: Charge
    new: bool
    spent_before: float
    spent_after: float
    budget_epsilon: float
    budget_delta: float


_LAST_KEYS = ("budget_epsilon", "budget_delta", "spent")


@dataclass(frozen=True)
class _State:
    charges: tuple[Charge, ...] = ()
    # the last admission's (ε_L, δ_L, ε spent at δ_L after it)
    last: tuple[float, float, float] | None = None

    def find(self, run_id: str) -> Charge | None:
        return next((c for c in self.charges if c.run_id == run_id), None)

    def spent(self, delta: float) -> float:
        """ε of every charge at ``delta``; the number stored by the last admission when ``delta`` is
        its δ_L (a later message of a run admits again in a fresh process: it should not pay a PLD
        composition)."""
        if self.last is not None and self.last[1] == delta:
            return self.last[2]
        return composed_epsilon([c.events for c in self.charges], delta)

    def as_json(self) -> dict[str, Any]:
        last = None if self.last is None else dict(zip(_LAST_KEYS, self.last))
        return {"format": FORMAT, "version": VERSION, "last_admission": last,
                "charges": [c.as_json() for c in self.charges]}


class NodeLedger:
    """The lifetime ledger of one node over one JSON file (a missing file is a node that was never
    charged).

    Args:
        path: the ledger file; its lock is the sibling ``<name>.lock``, its temporary files
            ``.<name>.*.tmp``.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path).expanduser().absolute()
        self.lock_path = self.path.with_name(self.path.name + ".lock")

    def __repr__(self) -> str:
        return f"NodeLedger({str(self.path)!r})"

    def charges(self) -> tuple[Charge, ...]:
        """Every run charged so far, in the order they were admitted."""
        return self._read().charges

    def spent(self, delta: float) -> float:
        """ε spent at ``delta``: every charge composed (PLD,
        :func:`~diff2_flwr.core.privacy.composed_epsilon`)."""
        return composed_epsilon([c.events for c in self.charges()], delta)

    def admit(self, charge: Charge, *, budget_epsilon: float, budget_delta: float) -> Admission:
        """Charge a run before it releases anything, or refuse it; idempotent per run id.

        Args:
            charge: the run's charge (see :meth:`Charge.new`).
            budget_epsilon: the node's lifetime ε_L (finite, > 0).
            budget_delta: the node's δ_L in (0, 1), at which every charge is composed.

        Returns:
            The admission: ε spent before and after this run, at ``budget_delta``.

        Raises:
            BudgetExceeded: the run would take the composed ε above ``budget_epsilon``; nothing
                written.
            RunChanged: the run id was charged with another config digest; nothing written.
            LedgerError: the ledger file cannot be read; nothing written.
        """
        _check_budget(budget_epsilon, budget_delta)
        with self._locked():
            state = self._read()
            previous = state.find(charge.run_id)
            if previous is not None:
                return self._readmit(previous, charge, state, budget_epsilon, budget_delta)
            charge = charge.priced()
            before = state.spent(budget_delta)
            after = composed_epsilon([c.events for c in state.charges] + [charge.events],
                                     budget_delta)
            if not after <= budget_epsilon:
                raise BudgetExceeded(self._refusal(charge, len(state.charges), before, after,
                                                   budget_epsilon, budget_delta))
            self._write(_State(state.charges + (charge,), (float(budget_epsilon),
                                                           float(budget_delta), after)))
        return Admission(charge, True, before, after, budget_epsilon, budget_delta)

    def summary(self, delta: float | None = None) -> dict[str, Any]:
        """What ``diff2 ledger`` prints: every charge and ε spent at ``delta`` (default: the last
        admission's δ).

        Raises:
            FileNotFoundError: there is no ledger file at this path.
            LedgerError: the file cannot be read.
        """
        if not self.path.exists():
            raise FileNotFoundError(
                f"No node ledger at {self.path}: no run was ever charged on this node, or the "
                                    "path is wrong (give the ledger file named in the node's "
                                    "policy).")
        state = self._read()
        if delta is None:
            delta = state.last[1] if state.last is not None else None
        if delta is None:
            raise ValueError(
                f"Node ledger {self.path} records no δ of an admission: give one with --delta.")
        charges = [{**c.as_json(), "delta": c.events.delta} for c in state.charges]
        last = None if state.last is None else dict(zip(_LAST_KEYS, state.last))
        return {"ledger": str(self.path), "format": FORMAT, "version": VERSION, "delta": delta,
                "epsilon_spent": composed_epsilon([c.events for c in state.charges], delta),
                "runs": len(charges), "last_admission": last, "charges": charges}

    def _readmit(self, previous: Charge, charge: Charge, state: _State, budget_epsilon: float,
                 budget_delta: float) -> Admission:
        if previous.digest != charge.digest:
            raise RunChanged(
                f"Node {charge.node!r} refuses run {charge.run_id!r} (rule: lifetime budget): it "
                f"was charged on {previous.time} with config digest {previous.digest}, and now "
                f"comes with {charge.digest}; the charge in {self.path} does not cover a changed "
                f"config. Submit the changed config as a new run.")
        spent = state.spent(budget_delta)
        return Admission(previous, False, spent, spent, budget_epsilon, budget_delta)

    def _refusal(self, charge: Charge, runs: int, before: float, after: float,
                 budget_epsilon: float, budget_delta: float) -> str:
        sampled = sorted({pi for _, pi, _ in charge.events.sampled})
        amplified = ("" if not sampled else
                     f", its client-sampled rounds amplified by π = "
                     f"{', '.join(f'{pi:g}' for pi in sampled)}")
        if charge.unamplified:
            amplified += (f", its client-sampled rounds (π = "
                          f"{', '.join(f'{pi:g}' for pi in charge.unamplified)}) charged "
                          f"unamplified, as if this node were in every round: its policy does not "
                          f"rely on the server's cohort draws")
        return (
            f"Node {charge.node!r} refuses run {charge.run_id!r} (rule: lifetime budget): the "
            f"node has spent ε = {before:.6g} over {runs} run(s) at δ_L = {budget_delta:g}; this "
            f"run alone costs ε = {charge.epsilon:.6g} (at its δ = {charge.events.delta:g}"
            f"{amplified}), "
            f"together ε = {after:.6g} > the lifetime budget ε_L = {budget_epsilon:g} (ledger "
            f"{self.path}). Nothing was charged or released. Submit the run with a smaller ε or "
            f"fewer rounds, or take this node out of it; only the node's operator can raise the "
            f"lifetime budget (node policy).")

    def _read(self) -> _State:
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return _State()
        except (OSError, UnicodeDecodeError) as err:
            raise LedgerError(
                f"Node ledger {self.path} cannot be read ({err}). {_WHAT_TO_DO_CORRUPT}") from err
        try:
            return _parse(text)
        except (ValueError, TypeError) as err:  # json.JSONDecodeError is a ValueError too
            raise LedgerError(
                f"Node ledger {self.path} is not a diff2 node ledger (format {FORMAT!r}, version "
                f"{' or '.join(map(str, READ_VERSIONS))}): {err}. {_WHAT_TO_DO_CORRUPT}") from err

    def _locked(self) -> ContextManager[None]:
        return exclusive_lock(self.lock_path, lambda err: LedgerError(
            f"Node ledger {self.path}: cannot create its folder or its lock file {self.lock_path} "
            f"({err}); nothing was "
            "charged. The ClientApp's user must be able to write the ledger's folder."))

    def _write(self, state: _State) -> None:
        """Replace the ledger atomically and durably (call under the lock)."""
        # a crashed writer's: we hold the lock
        for stale in self.path.parent.glob(f".{self.path.name}.*.tmp"):
            stale.unlink(missing_ok=True)
        text = json.dumps(state.as_json(), indent=1, allow_nan=False) + "\n"
        tmp = self.path.with_name(f".{self.path.name}.{secrets.token_hex(6)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException as err:
            tmp.unlink(missing_ok=True)
            if isinstance(err, OSError):
                raise LedgerError(
                    f"Node ledger {self.path} could not be written ({err}); nothing was charged "
                    f"and the "
                                  "old ledger stands. Free space on its file system or fix its "
                                  "folder.") from err
            raise
        fsync_folder(self.path.parent)


def _parse(text: str) -> _State:
    data = json.loads(text)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"expected a JSON object with \"format\": {FORMAT!r}; found {text[:60]!r}")
    version = data.get("version")
    if (isinstance(version, bool) or version not in READ_VERSIONS
            or set(data) != {"format", "version", "last_admission", "charges"}):
        newer = isinstance(version, int) and not isinstance(version, bool) and version > VERSION
        raise ValueError(
            f"expected version {' or '.join(map(str, READ_VERSIONS))} with keys format, version, "
            f"last_admission, charges; found version {version!r}, keys {sorted(data)}"
            + (f" (version {version} is a newer diff2's: upgrade this node's diff2)" if newer
               else ""))
    last = data["last_admission"]
    if last is not None and (not isinstance(last, dict) or set(last) != set(_LAST_KEYS)
                             or not all(isinstance(last[k], (int, float)) for k in _LAST_KEYS)):
        raise ValueError(
            f"`last_admission` must be null or an object of numbers {', '.join(_LAST_KEYS)}; "
                         f"found {last!r}")
    if not isinstance(data["charges"], list):
        raise ValueError(f"`charges` must be a list; found {type(data['charges']).__name__}")
    charges = []
    for i, item in enumerate(data["charges"]):
        try:
            charges.append(Charge.from_json(item, version))
        except (ValueError, TypeError) as err:
            raise ValueError(f"charge {i}: {err}") from err
    if last is None:
        return _State(tuple(charges))
    return _State(tuple(charges), (float(last["budget_epsilon"]), float(last["budget_delta"]),
                                   float(last["spent"])))


def unamplified_events(events: RunEvents) -> RunEvents:
    """``events`` with every client-sampled round [z, π, count] charged as ``count`` full Gaussian
    rounds of z (π = 1): the node's loss as if it were in every round. It bounds the node's loss
    whatever cohorts the server draws (a round the node is not asked does not touch its records, one
    it is asked is the Gaussian mechanism of multiplier z), so it relies on no draw. The full-batch
    and local events are kept as they are."""
    gaussian = events.gaussian + tuple((float(z), int(count)) for z, _, count in events.sampled)
    return RunEvents(delta=events.delta, gaussian=gaussian, local=events.local)


def _check_budget(epsilon: float, delta: float) -> None:
    if not isinstance(epsilon, (int, float)) or not (math.isfinite(epsilon) and epsilon > 0):
        raise ValueError(
            f"`budget_epsilon` (the node's lifetime ε_L) must be a finite number > 0. Found "
            f"{epsilon!r}.")
    if not isinstance(delta, (int, float)) or not 0 < delta < 1:
        raise ValueError(f"`budget_delta` (the node's δ_L) must be in (0, 1). Found {delta!r}.")
