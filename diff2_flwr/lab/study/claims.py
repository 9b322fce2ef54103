"""Claims on a shared study folder: every run is computed once, however many drivers share the
folder.

A study writes one result file per run into ``runs/``; a run whose file exists is done. Before a
driver computes a run it *claims* it by creating ``runs/<run_id>.claim-<g>`` with
``O_CREAT | O_EXCL``: creating a file that must not exist yet is atomic on a local file system and
on NFS v3 and later, so of two drivers racing for the same name exactly one wins. The claim holds
its owner (host, boot, PID namespace, PID and the PID's start time, and a random driver id).

Generations make a takeover as safe as a first claim. Claims of an unfinished run are never
deleted; the run's claim is the one with the largest ``g``. A driver that finds that claim *stale*
takes the run over by creating ``g + 1`` with the same exclusive create: two drivers that both
judge ``g`` stale race for ``g + 1``, and one loses. A claim is stale when

* its owner released it (a ``.released`` marker beside it: the driver stopped on an error or an
  interrupt before computing the run), or
* its owner ran on this host (same host name, boot and PID namespace) and that process is gone
  (no such PID, or a PID reused by a process that started at another time), or
* its heartbeat stopped: the owner touches its claims every ``heartbeat_s``; a claim whose
  modification time did not change for ``stale_after_s`` seconds *of the observer's own
  monotonic clock* is stale. Only changes are compared, never two machines' clocks, so clock skew
  does not matter; NFS caches attributes for up to a minute (``acregmax``), hence the default of
  five minutes.

A driver that computed a run writes its result atomically (:func:`atomic_write_bytes`: a
temporary file of a unique name in the same folder, flushed and fsynced, then ``os.replace``,
then the folder fsynced), and then deletes the run's claims: anyone who claims a run re-checks its
result file after the claim succeeded and lets go of a finished run, so a deleted claim cannot lead
to a second computation. The one way a run is computed twice is a live driver whose heartbeat
stalls for longer than ``stale_after_s`` (a frozen machine): both then write the same result, each
file whole.

References:
    open(2), "O_EXCL" (atomic, also on NFSv3 and later); rename(2) (atomic replacement within a
    file system); nfs(5), "acregmax".
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable
from ...runtime.secret_files import fsync_folder

__all__ = [
    "HEARTBEAT_S",
    "STALE_AFTER_S",
    "ClaimBook",
    "Owner",
    "atomic_write_bytes",
    "atomic_write_text",
]

#: Seconds between two heartbeats of a claim.
HEARTBEAT_S = 30.0
#: Seconds without a heartbeat after which another driver takes a run over.
STALE_AFTER_S = 300.0

_CLAIM = ".claim-"
_RELEASED = ".released"


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``path`` so that a reader sees either the old file or the whole new one, never a part.

    Two writers of the same path each write their own temporary file (unique name, same folder),
    so neither tears the other's; the last ``os.replace`` wins.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_folder(path.parent)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """:func:`atomic_write_bytes` of UTF-8 text."""
    atomic_write_bytes(path, text.encode("utf-8"))


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _start_time(pid: int) -> str:
    """The start time of ``pid`` in clock ticks since boot (``/proc/<pid>/stat`` field 22), "" if
    unknown."""
    stat = _read(f"/proc/{pid}/stat")
    if not stat:
        return ""
    return stat.rsplit(")", 1)[-1].split()[19]  # fields after "(comm)" start at field 3


@dataclass(frozen=True)
class Owner:
    """Who holds a claim: enough to tell, on the same host, whether that process still runs."""

    driver: str
    host: str
    boot: str
    pid_ns: str
    pid: int
    pid_start: str

    @classmethod
    def this_process(cls) -> "Owner":
        """This process: its driver id, host, boot, pid namespace, pid and start time."""
        try:
            pid_ns = os.readlink("/proc/self/ns/pid")
        except OSError:
            pid_ns = ""
        return cls(driver=secrets.token_hex(8), host=socket.gethostname(),
                   boot=_read("/proc/sys/kernel/random/boot_id"), pid_ns=pid_ns, pid=os.getpid(),
                   pid_start=_start_time(os.getpid()))

    def same_machine(self, other: "Owner") -> bool:
        """Whether PIDs of ``other`` can be checked from here (same host, boot and PID
        namespace)."""
        mine, theirs = (self.host, self.boot, self.pid_ns), (other.host, other.boot, other.pid_ns)
        return bool(self.boot) and mine == theirs

    def process_gone(self) -> bool:
        """Whether this owner's process has ended (call only for an owner on this machine)."""
        if Path("/proc/self/stat").exists():
            now = _start_time(self.pid)
            return not now or (bool(self.pid_start) and now != self.pid_start)
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False

    def to_json(self) -> str:
        """The owner as a claim file's JSON text."""
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Owner | None":
        """The owner a claim file names (None: not a claim of this format)."""
        try:
            return cls(**json.loads(text))
        except (ValueError, TypeError):
            return None  # being written, or not ours: judged by its heartbeat alone


@dataclass(frozen=True)
class _Claim:
    run_id: str
    generation: int
    path: Path
    released: bool


class ClaimBook:
    """The claims one driver holds in one ``runs/`` folder, with their heartbeat.

    Use as a context manager: on exit the heartbeat stops and every claim still held is released
    (marked, so that another driver takes the run over at once).
    """

    def __init__(self, folder: str | os.PathLike[str], *, owner: Owner | None = None,
                 stale_after_s: float = STALE_AFTER_S, heartbeat_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not stale_after_s > 0:
            raise ValueError(f"`stale_after_s` must be > 0. Found {stale_after_s}.")
        self.folder = Path(folder)
        self.owner = owner or Owner.this_process()
        self.stale_after_s = float(stale_after_s)
        self.heartbeat_s = float(heartbeat_s if heartbeat_s is not None
                                 else min(HEARTBEAT_S, stale_after_s / 5))
        self._clock = clock
        self._held: dict[str, Path] = {}
        self._claims: dict[str, _Claim] | None = None  # the last listing (refresh)
        # claim -> (mtime_ns last seen, when it last changed)
        self._seen: dict[Path, tuple[int, float]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- files
    def result_path(self, run_id: str) -> Path:
        """The result file of ``run_id``."""
        return self.folder / f"{run_id}.json"

    def done(self, run_id: str) -> bool:
        """Whether ``run_id``'s result file exists."""
        return self.result_path(run_id).exists()

    def refresh(self) -> None:
        """Read the folder's claims once (one directory listing; every decision below uses it).

        A listing that is out of date never lets two drivers hold one run: a claim is only ever
        made by an exclusive create of the generation after the one seen, which fails if that
        generation exists.
        """
        latest: dict[str, tuple[int, str]] = {}
        released = set()
        with os.scandir(self.folder) as entries:
            for entry in entries:
                name = entry.name
                if name.endswith(_RELEASED):
                    released.add(name[: -len(_RELEASED)])
                    continue
                run_id, sep, tail = name.rpartition(_CLAIM)
                if sep and tail.isdigit() and (run_id not in latest
                                               or int(tail) > latest[run_id][0]):
                    latest[run_id] = (int(tail), name)
        self._claims = {r: _Claim(r, g, self.folder / name, name in released)
                        for r, (g, name) in latest.items()}

    def _latest(self, run_id: str) -> _Claim | None:
        if self._claims is None:
            self.refresh()
        assert self._claims is not None
        return self._claims.get(run_id)

    # -- judging other drivers' claims
    def is_stale(self, claim: _Claim) -> bool:
        """Whether ``claim`` may be taken over (see the module docstring)."""
        if claim.released:
            return True
        owner = Owner.from_json(_read(str(claim.path)))
        if owner is not None and owner.driver == self.owner.driver:
            return False
        if owner is not None and self.owner.same_machine(owner) and owner.process_gone():
            return True
        try:
            mtime = claim.path.stat().st_mtime_ns
        except FileNotFoundError:
            # finished meanwhile (claims of a finished run are deleted): the result re-check decides
            return True
        now = self._clock()
        seen = self._seen.get(claim.path)
        if seen is None or seen[0] != mtime:
            self._seen[claim.path] = (mtime, now)
            return False
        return now - seen[1] >= self.stale_after_s

    def held_by_other(self, run_id: str) -> Owner | None | bool:
        """The live owner of ``run_id``'s claim if another driver holds it (``True`` if unreadable),
        else ``False``."""
        claim = self._latest(run_id)
        if claim is None or run_id in self._held or self.is_stale(claim):
            return False
        return Owner.from_json(_read(str(claim.path))) or True

    # -- our own claims
    def try_claim(self, run_id: str) -> bool:
        """Claim ``run_id`` for this driver; False if it is done or another live driver holds it.

        Judged on the last listing (:meth:`refresh`); the exclusive create makes the decision safe.
        """
        if run_id in self._held:
            return True
        if self.done(run_id):
            return False
        latest = self._latest(run_id)
        if latest is not None and not self.is_stale(latest):
            return False
        path = self.folder / f"{run_id}{_CLAIM}{(latest.generation if latest else 0) + 1}"
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False  # another driver took this generation first
        try:
            os.write(fd, self.owner.to_json().encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        with self._lock:
            self._held[run_id] = path
        if self.done(run_id):  # finished between our check and our claim: nothing to compute
            self.finish(run_id)
            return False
        return True

    def claim(self, run_ids: Iterable[str]) -> list[str]:
        """Claim each of ``run_ids`` (after one fresh listing); return those now held by this
        driver."""
        self.refresh()
        return [r for r in run_ids if self.try_claim(r)]

    def release(self, run_id: str) -> None:
        """Give ``run_id`` up unfinished: mark our claim released, so any driver may take it at
        once."""
        with self._lock:
            path = self._held.pop(run_id, None)
        if path is not None:
            Path(f"{path}{_RELEASED}").touch()

    def release_all(self) -> None:
        """Release every claim this book holds."""
        for run_id in list(self._held):
            self.release(run_id)

    def finish(self, run_id: str) -> None:
        """After ``run_id``'s result is written: delete every claim of it (ours and stale ones)."""
        with self._lock:
            self._held.pop(run_id, None)
        for path in self.folder.glob(f"{run_id}{_CLAIM}*"):
            path.unlink(missing_ok=True)

    def sweep_finished(self, run_ids: Iterable[str]) -> int:
        """Delete the claims left on finished runs among ``run_ids``; return how many.

        A driver killed between writing a result and deleting its claims leaves a claim on a
        finished run. No one computes a finished run (a claimer re-checks the result), so such a
        claim is garbage whoever holds it: a live holder is about to delete it itself.
        """
        finished = {r for r in run_ids if self.done(r)}
        swept = 0
        for path in self.folder.glob(f"*{_CLAIM}*"):
            if path.name.split(_CLAIM)[0] in finished:
                path.unlink(missing_ok=True)
                swept += 1
        return swept

    @property
    def held(self) -> tuple[str, ...]:
        """The run ids this book holds claims on."""
        return tuple(self._held)

    # -- heartbeat
    def beat(self) -> None:
        """Touch every claim this driver holds (the heartbeat other drivers watch)."""
        with self._lock:
            paths = list(self._held.values())
        for path in paths:
            try:
                os.utime(path)
            except FileNotFoundError:
                pass

    def _run(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            self.beat()

    def __enter__(self) -> "ClaimBook":
        self.folder.mkdir(parents=True, exist_ok=True)
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="diff2-claims-heartbeat",
                                        daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.release_all()

    # -- a folder's claims as a whole
    def live_foreign_claims(self) -> list[tuple[Path, Owner | None]]:
        """Claims in the folder that are not this driver's and not provably dead (for
        ``--fresh``)."""
        out = []
        for path in sorted(self.folder.glob(f"*{_CLAIM}*")):
            if not path.name.rsplit("-", 1)[-1].isdigit() or Path(f"{path}{_RELEASED}").exists():
                continue
            owner = Owner.from_json(_read(str(path)))
            if owner is not None and (owner.driver == self.owner.driver or
                                      (self.owner.same_machine(owner) and owner.process_gone())):
                continue
            out.append((path, owner))
        return out

    def clear(self) -> None:
        """Delete every claim file in the folder (``--fresh``, once no other driver holds any)."""
        for path in self.folder.glob(f"*{_CLAIM}*"):
            path.unlink(missing_ok=True)
