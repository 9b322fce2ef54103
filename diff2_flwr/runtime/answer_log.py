"""A data owner's durable record of the tasks its node has answered: each (run, round, stage) once.

A node that draws noise of its own (its Skellam share under distributed noise, the local routine's
σ3 noise) gives the server an independent draw each time it answers. A server that sends the same
round again, k times, could average those draws and shrink the noise by √k; a SuperLink that hands
out a run id again could get a second run's answers under the first run's ledger charge. So the node
writes down every (run, round, stage) it answers before it answers, and refuses the same triple
again (:class:`Replayed`) — also after a restart of the SuperNode or the ClientApp process, since
the record is a file, not process memory. A task whose answer is a deterministic function of what it
carries (a central-noise gradient round: the clipped mean at the iterates sent) may come again with
exactly the same content (a retried round): its digest is recorded, and the same digest is answered
again — the same answer, no new draw; another digest is refused.

Durable and crash-safe like the node's ledger (:mod:`~diff2_flwr.runtime.node_ledger`): an
append-only text file (one ``run<TAB>round<TAB>stage<TAB>digest`` line per answer, ``-`` for no
digest), read and appended under an exclusive ``flock`` on a sibling lock file, the line flushed and
fsynced before the answer leaves; created 0600 in folders made 0700. A record that cannot be read or
written refuses the task (:class:`AnswerLogError`): an unreadable record must never read as empty,
since that would let every round be answered again.

Trust (``THREATS.md``): protects the node's noise draws against a server (or SuperLink operator)
that replays a round or a run id. It cannot stop a server that runs a *new* run (a new id): that one
is a new charge on the node's lifetime ledger, where the node keeps one.

References:
    flock(2), fsync(2), O_APPEND in write(2) (POSIX: appends by one write are not interleaved).
    Issue 38, item 4 (each node answers each (run, round, stage) once).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import ContextManager

from .secret_files import exclusive_lock, fsync_folder

__all__ = ["AnswerLog", "AnswerLogError", "Replayed"]

_HEADER = ("# diff2 answer log v1: run<TAB>round<TAB>stage<TAB>digest, one line per task this "
           "node answered\n")
_NO_DIGEST = "-"


class Replayed(ValueError):
    """The node has already answered this (run, round, stage): the task is refused and nothing is
    drawn."""


class AnswerLogError(ValueError):
    """The node's answer log cannot be read or written: the node answers nothing until it is
    fixed."""


class AnswerLog:
    """The record of one node (one file). ``claim`` before answering; a missing file is a node that
    answered nothing.

    Args:
        path: the record's file; its lock is the sibling ``<name>.lock``.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path).expanduser().absolute()
        self.lock_path = self.path.with_name(self.path.name + ".lock")

    def __repr__(self) -> str:
        return f"AnswerLog({str(self.path)!r})"

    def answered(self) -> dict[tuple[str, int, str], str | None]:
        """Every (run, round, stage) answered so far, with its digest (None: a task that is never
        answered twice)."""
        return self._read()

    def claim(self, run_id: str, round_: int, stage: str, *, digest: str | None = None,
              node: str = "this node") -> None:
        """Record that the node answers (run, round, stage) now, or refuse a task it has answered
        before.

        Args:
            digest: for a task whose answer is deterministic in its content, a digest of that
                content: the same (run, round, stage) with the same digest is answered again
                (nothing new is drawn or computed from other inputs); None for a task that draws
                noise (never answered twice).

        Raises:
            Replayed: the triple is in the record already (with another digest, or without one);
                nothing written.
            AnswerLogError: the record cannot be read or written; nothing is answered.
        """
        entry = (_field(run_id, "run id"), int(round_), _field(stage, "stage"))
        digest = None if digest is None else _field(digest, "digest")
        with self._locked():
            answered = self._read()
            if entry in answered:
                if digest is not None and answered[entry] == digest:
                    return
                raise Replayed(
                    f"{node} refused: rule `replay`: it has already answered round {entry[1]} "
                    f"({entry[2]}) of run "
                    f"{entry[0]}; a second, different answer to one round would release its "
                    f"records "
                    "twice (a second draw of its noise, or the round at other iterates). Nothing "
                    "was computed; the round "
                    "releases nothing.")
            self._append(entry, digest)

    # ------------------------------------------------------------------ file
    def _read(self) -> dict[tuple[str, int, str], str | None]:
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return {}
        except (OSError, UnicodeDecodeError) as err:
            raise AnswerLogError(
                f"Answer log {self.path} cannot be read ({err}); it is not read as empty (every "
                "round could then be answered again): restore or repair it.") from err
        out: dict[tuple[str, int, str], str | None] = {}
        for number, line in enumerate(text.splitlines(), 1):
            if not line or line.startswith("#"):
                continue
            parts = line.split("\t")
            if len(parts) != 4 or not parts[1].lstrip("-").isdigit():
                raise AnswerLogError(
                    f"Answer log {self.path}, line {number}: expected run<TAB>round<TAB>stage<TAB>"
                                     f"digest ({len(parts)} field(s) found); restore or repair it.")
            out[(parts[0], int(parts[1]), parts[2])] = None if parts[3] == _NO_DIGEST else parts[3]
        return out

    def _append(self, entry: tuple[str, int, str], digest: str | None) -> None:
        new = not self.path.exists()
        line = (("" if not new else _HEADER) + f"{entry[0]}\t{entry[1]}\t{entry[2]}\t"
                f"{_NO_DIGEST if digest is None else digest}\n")
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, line.encode("utf-8"))
                os.fsync(fd)
            finally:
                os.close(fd)
            if new:
                fsync_folder(self.path.parent)
        except OSError as err:
            raise AnswerLogError(
                f"Answer log {self.path} could not be written ({err}); nothing was answered. Free "
                "space on its file system or fix its folder's permissions.") from err

    def _locked(self) -> ContextManager[None]:
        return exclusive_lock(self.lock_path, lambda err: AnswerLogError(
            f"Answer log {self.path}: cannot create its folder or lock file ({err}); nothing was "
            f"answered. The "
            "ClientApp's user must be able to write that folder."))


def _field(value: str, what: str) -> str:
    text = str(value)
    if not text or any(c in text for c in "\t\r\n"):
        raise ValueError(
            f"An answer log's {what} must be non-empty text without tabs or line breaks. Found "
            f"{text!r}.")
    return text
