"""Thread counts of every process that computes: the condition of the bit-for-bit claims.

A floating-point reduction split over k threads adds in another order than over 1 thread, so
its last bit depends on the thread count: torch's intra-op pool (OpenMP, MKL) and numpy's BLAS
(OpenBLAS: ``np.linalg.norm`` of a long vector is a threaded ``ddot``) both split reductions.
The ServerApp, every ClientApp and the in-process driver therefore pin both pools to
``training.threads`` (default 1) before they compute: a `flwr run` simulation, a deployment, a
resumed run and the in-process driver then add in the same order on one machine, whatever
``OMP_NUM_THREADS`` or the number of cores says.

The kernel family (torch's ``ATEN_CPU_CAPABILITY``: AVX-512, AVX2 or the default) is chosen
per process at start-up from the CPU and the environment; every process we start inherits the
environment, so both sides of a comparison run the same kernels. Across kernel families (two
different machines) results agree to rounding only (docs/explanation/reproducibility.md).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from typing import Any, Iterator

__all__ = ["DEFAULT_THREADS", "pin_threads", "pinned_threads", "compute_threads"]

#: Threads per computing process unless the config says otherwise.
DEFAULT_THREADS = 1


def compute_threads() -> dict[str, int]:
    """The thread counts in force: torch's intra-op pool and each BLAS/OpenMP pool numpy or torch loaded."""
    import torch
    from threadpoolctl import threadpool_info

    out = {"torch": torch.get_num_threads()}
    for pool in threadpool_info():
        out[f"{pool['user_api']}:{pool['internal_api']}"] = int(pool["num_threads"])
    return out


def pin_threads(threads: int = DEFAULT_THREADS) -> None:
    """Pin torch's intra-op pool and every BLAS/OpenMP pool of this process to ``threads`` (process-wide).

    Flower calls a ClientApp's ``client_fn`` for every message, so this runs once per client and round. Finding the
    pools (threadpoolctl walks every loaded shared library: 1–5 ms in a Ray worker) is done again only when the set
    of loaded libraries changed since the last call; the limits themselves are set on every call.
    """
    import torch

    if threads < 1:
        raise ValueError(f"`threads` must be an integer >= 1. Found {threads}.")
    torch.set_num_threads(threads)
    _pools().limit(limits=threads)


#: (the loaded shared libraries, threadpoolctl's controller of their pools), from the last :func:`_pools` that scanned.
_POOLS: tuple[tuple[str, ...] | None, Any] | None = None


def _pools() -> Any:
    """This process's BLAS/OpenMP pools (a ``threadpoolctl.ThreadpoolController``), scanned again only when a
    shared library was loaded or unloaded since the last scan (always where the libraries cannot be listed)."""
    from threadpoolctl import ThreadpoolController

    global _POOLS
    libraries = _loaded_libraries()
    if _POOLS is None or libraries is None or _POOLS[0] != libraries:
        _POOLS = (libraries, ThreadpoolController())
    return _POOLS[1]


def _loaded_libraries() -> tuple[str, ...] | None:
    """The paths of the shared objects loaded in this process, in load order (``dl_iterate_phdr``: Linux, the BSDs);
    None where that call is not available."""
    iterate = _dl_iterate_phdr()
    if iterate is None:
        return None
    names: list[bytes] = []

    def visit(info: Any, size: int, data: Any) -> int:
        names.append(info.contents.dlpi_name or b"")
        return 0

    iterate(_PHDR_CALLBACK(visit), None)
    return tuple(n.decode(errors="replace") for n in names)


class _PhdrInfo(ctypes.Structure):  # the first two fields of struct dl_phdr_info (<link.h>)
    _fields_ = [("dlpi_addr", ctypes.c_void_p), ("dlpi_name", ctypes.c_char_p)]


_PHDR_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(_PhdrInfo), ctypes.c_size_t, ctypes.c_void_p)


@functools.lru_cache(maxsize=1)
def _dl_iterate_phdr() -> Any:
    try:
        libc = ctypes.CDLL(None)
        fn = libc.dl_iterate_phdr
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [_PHDR_CALLBACK, ctypes.c_void_p]
    return fn


@contextlib.contextmanager
def pinned_threads(threads: int = DEFAULT_THREADS) -> Iterator[None]:
    """:func:`pin_threads` for a block, restoring the caller's thread counts afterwards."""
    import torch
    from threadpoolctl import threadpool_limits

    before = torch.get_num_threads()
    with threadpool_limits(limits=threads):
        torch.set_num_threads(threads)
        try:
            yield
        finally:
            torch.set_num_threads(before)
