"""Many canaries in one run: B of the audit's trials from one run of the schedule (``--canaries
B``).

The audit of :mod:`.audit` spends one run of the whole schedule per trial. For the central Gaussian
mechanisms (``dpgd`` and ``diff2``) one run can carry B canaries, each on an axis of its own, and
give B trials that are *exactly* independent draws of the one-canary audit's score, so that 10⁴
trials take 2·10⁴ / B runs.

The federation (:func:`canary_workers`): each of the P clients holds n = B + ``samples`` records in
dimension d = B + ``dim`` − 1. Client 0's first B records are canaries: record k's gradient and
gradient difference is s_k·K·e_k (K = ``CANARY_MARGIN`` × the round's radius), clipped onto ±C_r·e_k
every round, with s_k = +1 for even k and −1 for odd k: half the trials are on D, half on D′. Every
other record is benign and touches only the last ``dim`` − 1 coordinates. The calibration is the one
a run with n_min = n claims (:func:`canary_spec`): each canary is one record of it, whose
replacement moves the released mean by 2C_r/(nP) along its own axis.

Why the B scores are B independent trials. Let ξ_(r,k) = (⟨ṽ_r − ṽ_(r−1)·[difference round], e_k⟩ −
s_k C_r/(nP)) / s_r with s_r = σ_r C_r the round's noise std. Given everything released before round
r (which fixes C_r, a function of x_(r−1) and x_(r−2) only), the server adds N(0, s_r² I) drawn
afresh, the benign records are zero on the canary axes, and canary k alone moves axis k by exactly
s_k C_r/(nP); so (ξ_(r,k))_k are independent N(0, 1) whatever the past was. A conditional law that
does not depend on the past makes round r's ξ's independent of it, so all ξ_(r,k) are i.i.d. N(0,
1), and the scores S_k = Σ_r (Δ_r / s_r²)⟨increment_r, e_k⟩ = Σ_r μ_r(s_k μ_r / 2 + ξ_(r,k)), with
μ_r = Δ_r / s_r = 2/(nPσ_r), are independent, each distributed as the one-canary audit's score on D
(s_k = +1) or D′ (s_k = −1). The radii adapt to the noise of every axis, but each round's μ_r does
not. The tests check the claim (the scores' means, spreads and correlations against the one-canary
audit's).

What the argument needs, and so where ``--canaries`` is refused: Gaussian noise independent across
coordinates and a fixed μ_r per round. Distributed noise is Skellam, rotated and rounded jointly
over all coordinates (not independent); the local routine (``diff2-bvr``) is left to the one-canary
audit.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import replace
from typing import Callable

import numpy as np
import torch

from ...core.privacy import Calibration
from ...runtime.session import Worker
from ...task.records import TensorRecords
from .spec import AuditSpec
from .pool import run_chunks
from .trials import GradientCanaryShard, _trial
from .trials import _seed as trial_seed

__all__ = ["canary_signs", "canary_spec", "canary_workers", "canary_scores", "canary_runs",
           "split_scores"]


def canary_spec(spec: AuditSpec) -> AuditSpec:
    """The schedule and federation one run of ``spec`` with B = ``spec.canaries`` canaries actually
    has: n = B + ``samples`` records per client, d = B + ``dim`` − 1 coordinates (its calibration is
    the claimed one)."""
    b = spec.canaries
    return replace(spec, samples=spec.samples + b, dim=spec.dim - 1 + b, canaries=1,
                   path="in-process")


def canary_signs(canaries: int) -> np.ndarray:
    """s_k: +1 (a trial on D) for even k, −1 (on D′) for odd k."""
    return np.where(np.arange(canaries) % 2 == 0, 1, -1)


def canary_runs(spec: AuditSpec) -> int:
    """Runs to make for ``spec.trials`` trials on each of D and D′ (B / 2 of each per run)."""
    return math.ceil(spec.trials / (spec.canaries // 2))


def canary_workers(spec: AuditSpec) -> list[Worker]:
    """The P workers of the B-canary federation (``spec`` is the audit's, not
    :func:`canary_spec`'s)."""
    b, run = spec.canaries, canary_spec(spec)
    rng = np.random.default_rng(20230724)  # data, not noise: fixed on purpose
    index = torch.arange(run.samples, dtype=torch.float64)[:, None]  # record i's only feature is i
    records = TensorRecords(index, torch.zeros(run.samples, dtype=torch.float64))
    workers = []
    for p in range(spec.clients):
        a = np.zeros((run.samples, run.dim))
        c = np.zeros((run.samples, run.dim))
        a[:, b:] = rng.uniform(0.5, 2.0, (run.samples, spec.dim - 1))
        c[:, b:] = rng.normal(0.0, 1.0, (run.samples, spec.dim - 1))
        if p == 0:
            a[:b] = c[:b] = 0.0  # the canary records (their rows are the canaries')
            shard = GradientCanaryShard(a, c, canary_signs(b))
        else:
            # its records are zero on every canary axis (above)
            shard = GradientCanaryShard(a, c, 0)
        workers.append(Worker(p, shard, records))
    return workers


def split_scores(scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One run's B scores as (trials on D, trials on D′), by :func:`canary_signs`."""
    signs = canary_signs(scores.shape[-1])
    return scores[..., signs > 0], scores[..., signs < 0]


def _seed(spec: AuditSpec, run: int) -> int | None:
    """Run ``run``'s noise key: the one-canary audit's derivation, as its federation 2 (D and D′ are
    one here)."""
    return trial_seed(spec, 2, run)


def _runs(spec: AuditSpec, calibration: Calibration, start: int, stop: int) -> np.ndarray:
    torch.set_num_threads(1)
    workers, run = canary_workers(spec), canary_spec(spec)
    return np.stack([_trial(run, calibration, workers, _seed(spec, i), axes=spec.canaries)
                     for i in range(start, stop)])


def canary_scores(spec: AuditSpec, progress: Callable[[str], None] | None = None,
                  calibration: Calibration | None = None) -> tuple[np.ndarray, np.ndarray]:
    """LR scores of ``spec.trials`` canaries on D and on D′ from :func:`canary_runs` runs of the
    B-canary federation through the real Strategy and clients (``calibration``:
    :func:`canary_spec`'s, if already computed)."""
    check_canaries(spec)
    calibration = calibration if calibration is not None else canary_spec(spec).calibration()
    runs = canary_runs(spec)
    chunk = max(1, min(50, math.ceil(runs / (4 * spec.workers))))
    jobs = [(s, min(s + chunk, runs)) for s in range(0, runs, chunk)]
    started, done = time.perf_counter(), 0

    def report(job: tuple) -> None:
        nonlocal done
        done += job[1] - job[0]
        if progress:
            elapsed = time.perf_counter() - started
            progress(f"[audit] {done}/{runs} runs of {spec.canaries} canaries, "
                     f"{done * spec.canaries / elapsed:.0f} trials/s, ETA "
                     f"{elapsed / done * (runs - done):.0f} s")

    scores = np.concatenate(run_chunks(functools.partial(_runs, spec, calibration), jobs,
                                       spec.workers, report))
    d, d_prime = split_scores(scores)  # [runs, B] -> the + and the − canaries
    return d.reshape(-1)[:spec.trials], d_prime.reshape(-1)[:spec.trials]


def check_canaries(spec: AuditSpec) -> None:
    """``--canaries B`` > 1 only where the independence argument of this module holds."""
    if spec.canaries == 1:
        raise ValueError("`--canaries` is 1: the one-canary audit runs one run per trial "
                         "(trials.py)")
