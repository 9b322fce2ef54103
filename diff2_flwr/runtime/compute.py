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
import sys
from typing import Any, Iterator

import torch
from threadpoolctl import ThreadpoolController, threadpool_info, threadpool_limits

__all__ = ["DEFAULT_THREADS", "pin_threads", "pinned_threads", "compute_threads"]

#: Threads per computing process unless the config says otherwise.
DEFAULT_THREADS = 1


def compute_threads() -> dict[str, int]:
    """The thread counts in force: torch's intra-op pool and each BLAS/OpenMP pool numpy or torch
    loaded."""
    out = {"torch": torch.get_num_threads()}
    for pool in threadpool_info():
        out[f"{pool['user_api']}:{pool['internal_api']}"] = int(pool["num_threads"])
    return out


def pin_threads(threads: int = DEFAULT_THREADS) -> None:
    """Pin torch's intra-op pool and every BLAS/OpenMP pool of this process to ``threads``
    (process-wide).

    Flower calls a ClientApp's ``client_fn`` for every message, so this runs once per client and
    round. Finding the pools (threadpoolctl walks every loaded shared library: 1–5 ms in a Ray
    worker) is done again only when a module was imported since the last call — a BLAS or OpenMP
    runtime is loaded with the extension module that links it (numpy's, scipy's, torch's); the
    limits themselves are set on every call.
    """
    if threads < 1:
        raise ValueError(f"`threads` must be an integer >= 1. Found {threads}.")
    torch.set_num_threads(threads)
    _pools().limit(limits=threads)


#: (how many modules were imported, threadpoolctl's controller of the pools then), from the last
#: scan.
_POOLS: tuple[int, Any] | None = None


def _pools() -> Any:
    """This process's BLAS/OpenMP pools (a ``threadpoolctl.ThreadpoolController``), scanned again
    when a module was imported since the last scan. (Not ``dl_iterate_phdr`` with a Python callback:
    that holds the loader's lock while it waits for the GIL, and a thread importing an extension
    holds the GIL while it waits for that lock.)"""
    global _POOLS
    imported = len(sys.modules)
    if _POOLS is None or _POOLS[0] != imported:
        controller = ThreadpoolController()
        _POOLS = (len(sys.modules), controller)  # after: the scan may import
    return _POOLS[1]


@contextlib.contextmanager
def pinned_threads(threads: int = DEFAULT_THREADS) -> Iterator[None]:
    """:func:`pin_threads` for a block, restoring the caller's thread counts afterwards."""
    before = torch.get_num_threads()
    with threadpool_limits(limits=threads):
        torch.set_num_threads(threads)
        try:
            yield
        finally:
            torch.set_num_threads(before)
