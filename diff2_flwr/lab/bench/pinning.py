"""Where ``diff2 bench``'s timed code runs: one torch thread, and this process (with the
subprocesses it starts meanwhile) on one core, so that the sides it compares share the same
resources (:mod:`.jax_cells`)."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

__all__ = ["one_core", "one_torch_thread"]


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """torch's intra-op threads set to one inside the block, restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _set_affinity(cores: set[int]) -> None:
    """Every thread of this process on ``cores`` (``sched_setaffinity(0)`` alone moves only the
    calling thread)."""
    tasks = Path("/proc/self/task")
    for tid in (int(t) for t in os.listdir(tasks)) if tasks.is_dir() else [0]:
        try:
            os.sched_setaffinity(tid, cores)
        except OSError:  # a thread that ended meanwhile
            pass


@contextmanager
def one_core() -> Iterator[int | None]:
    """This process, and the subprocesses it starts meanwhile, on one core (the last it may use);
    restored after. None where the OS has no affinity call (the sides then share whatever cores the
    OS gives)."""
    if not hasattr(os, "sched_setaffinity"):
        yield None
        return
    before = os.sched_getaffinity(0)
    _set_affinity({max(before)})
    try:
        yield max(before)
    finally:
        _set_affinity(before)
