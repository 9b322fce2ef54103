"""The audit's worker processes: jobs run in spawned processes (or in this one), results in
order."""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Callable, Sequence

import numpy as np

__all__ = ["run_chunks"]


def run_chunks(work: Callable[..., np.ndarray], jobs: Sequence[tuple], workers: int,
               finished: Callable[[tuple], None]) -> list[np.ndarray]:
    """``work(*job)`` for every job, in ``workers`` spawned processes (in this one with 1 worker or
    1 job), calling ``finished(job)`` as each completes (progress); the results in the jobs' order.
    ``work`` must pickle."""
    if workers == 1 or len(jobs) == 1:
        results = []
        for job in jobs:
            results.append(work(*job))
            finished(job)
        return results
    out: dict[int, np.ndarray] = {}
    with ProcessPoolExecutor(min(workers, len(jobs)),
                             mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(work, *job): i for i, job in enumerate(jobs)}
        for future in as_completed(futures):  # progress as chunks finish; results re-ordered below
            out[futures[future]] = future.result()
            finished(jobs[futures[future]])
    return [out[i] for i in range(len(jobs))]
