"""The local SuperLink that plain ``flwr run .`` starts and leaves running, found by its PID and
stopped.

Flower 1.42 (``flwr/cli/local_superlink.py``) starts it detached, as the leader of a session of its
own, with ``--log-file $FLWR_HOME/local-superlink/superlink.log`` on its command line, and records
no PID anywhere. That command line is how it is found here: a ``flower-superlink`` process of this
user whose ``--log-file`` is this ``FLWR_HOME``'s (``diff2 superlink status``). Stopping it
(``diff2 superlink stop``) sends SIGTERM to its process group (the simulation it runs belongs to
it), then SIGKILL to what is left after the grace period; nothing else is signalled: no process of
another ``FLWR_HOME``, of another user, or of a SuperLink that our own launchers started (those
are stopped by the launchers themselves).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LocalSuperLink", "flwr_home", "find_local_superlinks", "stop_local_superlink"]

#: Where Flower keeps the local SuperLink's files under FLWR_HOME (its log names the process).
RUNTIME_DIR = "local-superlink"
LOG_FILE = "superlink.log"


@dataclass(frozen=True)
class LocalSuperLink:
    """One running local SuperLink: its PID, the address it serves ``flwr`` on, its log file."""

    pid: int
    address: str
    log_file: Path


def flwr_home(environ: dict[str, str] | None = None) -> Path:
    """``$FLWR_HOME``, else ``~/.flwr``: where Flower 1.42 looks (``get_flwr_home``)."""
    environ = dict(os.environ) if environ is None else environ
    return Path(environ.get("FLWR_HOME") or Path.home() / ".flwr")


def _argv_of(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def _processes() -> list[tuple[int, list[str], Path | None]]:
    """(PID, argv, working directory) of this user's processes (every process as root): from /proc,
    else from ``ps`` (argv split on spaces, no working directory)."""
    proc = Path("/proc")
    if (proc / "self" / "cmdline").is_file():
        found = []
        for entry in proc.iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if os.geteuid() != 0 and entry.stat().st_uid != os.geteuid():
                    continue
                cwd = Path(os.readlink(entry / "cwd"))
            except OSError:  # gone, or not ours to read
                cwd = None
            argv = _argv_of(int(entry.name))
            if argv:
                found.append((int(entry.name), argv, cwd))
        return found
    listing = subprocess.run(["ps", "-ww", "-U", str(os.geteuid()), "-o", "pid=", "-o", "args="],
                             capture_output=True, text=True, timeout=30, check=False).stdout
    rows = [line.strip().split(None, 1) for line in listing.splitlines() if line.strip()]
    return [(int(row[0]), row[1].split(), None) for row in rows if len(row) == 2]


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv[:-1] else None


def find_local_superlinks(home: Path | None = None) -> list[LocalSuperLink]:
    """The running local SuperLinks that ``flwr run`` started for ``home`` (default
    :func:`flwr_home`), oldest PID first: ``flower-superlink`` processes whose ``--log-file`` is
    ``home/local-superlink/superlink.log``."""
    expected = (Path(home) if home is not None else flwr_home()) / RUNTIME_DIR / LOG_FILE
    expected = Path(os.path.abspath(expected))
    found = []
    for pid, argv, cwd in _processes():
        if pid == os.getpid() or not any(Path(a).name == "flower-superlink" for a in argv[:2]):
            continue
        log = _flag(argv, "--log-file")
        if log is None:
            continue
        path = Path(log) if Path(log).is_absolute() or cwd is None else cwd / log
        if Path(os.path.abspath(path)) == expected:
            address = f"{_flag(argv, '--host') or '0.0.0.0'}:{_flag(argv, '--port') or '?'}"
            found.append(LocalSuperLink(pid, address, expected))
    return sorted(found, key=lambda link: link.pid)


def stop_local_superlink(link: LocalSuperLink, grace_s: float = 15.0) -> bool:
    """Stop ``link``: SIGTERM to its process group (its own PID when it leads one, as Flower starts
    it), SIGKILL to what is left after ``grace_s``; True once nothing of it is left running."""
    try:
        group = os.getpgid(link.pid)
    except ProcessLookupError:
        return True
    leads = group == link.pid
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            (os.killpg if leads else os.kill)(link.pid, sig)
        except ProcessLookupError:
            return True
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            if not _running(link.pid, leads):
                return True
            time.sleep(0.2)
    return not _running(link.pid, leads)


def _running(pid: int, group: bool) -> bool:
    """Whether ``pid`` (with ``group``, any member of its process group) still runs; a zombie, dead
    but not yet reaped by its parent, does not."""
    stats = Path("/proc")
    if not (stats / "self" / "stat").is_file():
        try:
            (os.killpg if group else os.kill)(pid, 0)
        except ProcessLookupError:
            return False
        return True
    entries = [e for e in stats.iterdir() if e.name.isdigit()] if group else [stats / str(pid)]
    for entry in entries:
        try:
            # pid (comm) state ppid pgrp ...: comm may hold spaces and parentheses
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and (int(fields[2]) == pid or not group):
            return True
    return False
