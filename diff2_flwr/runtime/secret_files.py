"""Secret files of a deployment: owner-only from creation, whatever the umask.

Private keys (the SuperLink's TLS key, a SuperNode's node key) and SuperExec secrets (the shared
secret with which Flower 1.42's SuperExec signs ``AcquireTask`` on a SuperLink's or SuperNode's
runtime API, ``--superexec-auth-secret-file``) are written 0600 into folders made 0700. The modes
are set explicitly, not left to the umask, and a file is never readable by others, not even for a
moment (it is created 0600, then written).
"""

from __future__ import annotations

import fcntl
import os
import secrets
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

__all__ = ["SECRET_BYTES", "append_private", "exclusive_lock", "fsync_folder",
           "make_missing_folders", "private_folder",
           "write_private", "make_superexec_secret"]

#: Bytes of entropy of a SuperExec secret (written as hex; Flower reads the file's exact bytes).
SECRET_BYTES = 32


def private_folder(folder: str | os.PathLike[str]) -> Path:
    """``folder`` (and missing parents) created; ``folder`` itself made 0700 whatever the umask."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    return folder


def write_private(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` readable by its owner only: 0600 from creation (an existing file is
    replaced)."""
    path = Path(path)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        # O_CREAT's mode is masked by the umask; a umask never adds bits
        os.fchmod(handle.fileno(), 0o600)
        handle.write(data)
    return path


def append_private(path: str | os.PathLike[str], data: bytes) -> Path:
    """Append ``data`` to a file readable by its owner only: 0600 from creation, whatever the
    umask."""
    path = Path(path)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    with os.fdopen(fd, "ab") as handle:
        os.fchmod(handle.fileno(), 0o600)
        handle.write(data)
    return path


def make_superexec_secret(path: str | os.PathLike[str]) -> Path:
    """A fresh SuperExec secret (256 bits from the OS's secure source, hex) at ``path``, 0600 in a
    0700 folder.

    Give the same file to the component that serves the runtime API (``flower-superlink`` or
    ``flower-supernode``, with ``--isolation process``) and to the ``flower-superexec`` that runs
    its apps.
    """
    path = Path(path)
    private_folder(path.parent)
    return write_private(path, secrets.token_hex(SECRET_BYTES).encode("ascii"))


def fsync_folder(folder: str | os.PathLike[str]) -> None:
    """Make a rename into ``folder`` durable (POSIX; a no-op where folders cannot be opened or
    synced)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def make_missing_folders(folder: str | os.PathLike[str]) -> None:
    """Create the missing folders of ``folder`` with mode 0700 by ``mkdir``'s mode (no window with
    wider modes); existing ones are left as they are (another process may make one first)."""
    folder, missing = Path(folder), []
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    for path in reversed(missing):
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass


@contextmanager
def exclusive_lock(lock_path: str | os.PathLike[str], error: Callable[[OSError],
                                                                      Exception]) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_path`` (created 0600, its missing folders 0700) for the
    ``with`` block: the read-check-write of a node's durable files (its ledger, its answer log). A
    folder or lock file that cannot be made raises ``error(oserror)``; nothing of the block runs
    then."""
    try:
        make_missing_folders(Path(lock_path).parent)
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as err:
        raise error(err) from err
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock
