"""DIFF2's local routine: private BVR-L-SGD steps on one randomly chosen worker.

After the server releases ṽ_r it draws one worker p_r uniformly at random (its secure generator)
and sends it x_{r-1}, ṽ_r and (K, b, η, C3, σ3). The worker runs a recursive, bias-variance-reduced
estimator seeded by the global one (Murata & Suzuki 2021, BVR-L-SGD, with one local model chosen at
random), with its own Gaussian noise::

    y_0 = x_{r-1},  w_0 = ṽ_r,  y_1 = y_0 - η w_0
    for k = 1 .. K-1:
        I_k   ⊂ D_p, each record independently with probability b / n_p (Poisson; fresh each step)
        c_k   = C3 ||y_k - y_{k-1}||
        g_k   = (1/b) Σ_{z ∈ I_k} clip(∇ℓ(y_k, z) - ∇ℓ(y_{k-1}, z), c_k)
        w_k   = w_{k-1} + g_k + N(0, (σ3 c_k)² I)
        y_{k+1} = y_k - η w_k
    return y_K                                  # becomes x_r

Dividing by the fixed b (not by |I_k|) bounds one record's term by c_k / b, so each step is a
Poisson-subsampled Gaussian mechanism under replace-one adjacency, accounted exactly as such by
dp-accounting's PLD accountant (:class:`~diff2_flwr.core.privacy.LocalEvent`). c_k depends only on
earlier (noised) outputs, so the steps compose adaptively. The batch and the noise are drawn from
one generator: seeded only when the run is seeded (research), otherwise from OS entropy.

References:
    Murata & Suzuki (2023), Section 5 (DIFF2 with a BVR-L-SGD sub-routine).
    Murata & Suzuki (2021), "Bias-Variance Reduced Local SGD for Less Heterogeneous Federated
    Learning".
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .estimator import DIVERGENCE_ADVICE, Diverged, difference_radius

__all__ = ["LocalMechanism", "LocalResult", "LocalTask", "choose_worker", "local_generator",
           "local_seed",
           "run_local_phase"]

# Domain tags of the generators derived from the server's noise key (distinct from the server
# noise's).
_CHOICE_DOMAIN = 0xC401CE
_LOCAL_DOMAIN = 0x10CA1

#: Σ-function of the local steps: (y_k, y_{k-1}, indices of I_k, radius c_k) -> (Σ of clipped
#: differences, number clipped, overflow flag).
ClippedSum = Callable[[np.ndarray, np.ndarray, np.ndarray, float], "tuple[np.ndarray, int, bool]"]


@dataclass(frozen=True)
class LocalMechanism:
    """The local routine's parameters: K, b, η, C3, σ3 (σ3 = noise std per unit radius c_k)."""

    steps: int
    batch_size: int
    learning_rate: float
    clip: float
    sigma: float

    def __post_init__(self) -> None:
        if not isinstance(self.steps, int) or isinstance(self.steps, bool) or self.steps < 2:
            raise ValueError(f"`steps` (K) must be an integer >= 2. Found {self.steps!r}.")
        if not isinstance(self.batch_size, int) or isinstance(self.batch_size,
                                                              bool) or self.batch_size < 1:
            raise ValueError(
                f"`batch_size` (b) must be an integer >= 1. Found {self.batch_size!r}.")
        if not (math.isfinite(self.learning_rate) and self.learning_rate > 0):
            raise ValueError(
                f"`learning_rate` (η) must be a finite number > 0. Found {self.learning_rate}.")
        if not (math.isfinite(self.clip) and self.clip > 0):
            raise ValueError(f"`clip` (C3) must be a finite number > 0. Found {self.clip}.")
        if not (math.isfinite(self.sigma) and self.sigma >= 0):
            raise ValueError(f"`sigma` (σ3) must be a finite number >= 0. Found {self.sigma}.")


@dataclass(frozen=True)
class LocalTask:
    """What the chosen worker receives: x_{r-1}, ṽ_r, the mechanism and (seeded runs only) its
    generator's seed."""

    round: int
    partition_id: int
    x_start: np.ndarray
    v: np.ndarray
    mechanism: LocalMechanism
    seed: int | None
    #: n_min and q = b / n_min as the server's calibration took them (the worker refuses a rate b /
    #: n_p above q).
    n_min: int | None = None
    sampling_prob: float | None = None


@dataclass(frozen=True)
class LocalResult:
    """y_K and what the worker may report about its steps (sizes of I_k, records clipped)."""

    y: np.ndarray
    batch_sizes: tuple[int, ...]
    num_clipped: int
    overflow: bool


def choose_worker(noise_key: int, r: int, clients: int) -> int:
    """p_r, uniform over the P workers, from a generator derived from (noise key, r) alone."""
    seq = np.random.SeedSequence(entropy=noise_key, spawn_key=(_CHOICE_DOMAIN, r))
    return int(np.random.Generator(np.random.PCG64(seq)).integers(clients))


def local_seed(noise_key: int, r: int) -> int:
    """The seed of round r's local generator in a seeded run (sent to the chosen worker)."""
    seq = np.random.SeedSequence(entropy=noise_key, spawn_key=(_LOCAL_DOMAIN, r))
    return int(seq.generate_state(2, np.uint64).view(np.uint64)[0])


def local_generator(seed: int | None) -> np.random.Generator:
    """The worker's generator for batches and noise: OS entropy unless the run is seeded."""
    return np.random.Generator(np.random.PCG64(secrets.randbits(128) if seed is None else seed))


def run_local_phase(task: LocalTask, num_samples: int, clipped_sum: ClippedSum) -> LocalResult:
    """The K - 1 private local steps of :mod:`this module <diff2_flwr.core.local>` on a shard of
    ``num_samples``.

    Raises:
        ValueError: the task does not fit this shard (b > n_p, b / n_p above the accounted q,
            shapes, non-finite values).
        Diverged: a radius or noise std that is not finite (the iterates ran away); nothing is
            returned.
    """
    m = task.mechanism
    x0, v = np.asarray(task.x_start, dtype=np.float64), np.asarray(task.v, dtype=np.float64)
    if x0.ndim != 1 or v.shape != x0.shape:
        raise ValueError(
            f"The local task's x_(r-1) and ṽ_r must be flat vectors of one shape; found "
            f"{x0.shape}, {v.shape}.")
    if not (np.all(np.isfinite(x0)) and np.all(np.isfinite(v))):
        raise ValueError("The local task's x_(r-1) or ṽ_r holds NaN or inf values.")
    if m.batch_size > num_samples:
        raise ValueError(
            f"The local batch size b = {m.batch_size} exceeds this worker's {num_samples} records.")
    q = m.batch_size / num_samples
    if task.sampling_prob is not None and q > task.sampling_prob:
        raise ValueError(
            f"This worker would sample each record with probability b / n_p = {m.batch_size} / "
                         f"{num_samples} = {q:.6g}, above the q = {task.sampling_prob:.6g} (b / "
                         f"n_min, n_min = "
                         f"{task.n_min}) the privacy analysis accounted: the task's n_min exceeds "
                         f"this worker's "
                         "records. Nothing was computed.")
    rng = local_generator(task.seed)
    y_prev, w = x0, v
    with np.errstate(over="ignore", invalid="ignore"):
        y = y_prev - m.learning_rate * w
    sizes, clipped = [], 0
    for k in range(1, m.steps):
        radius = difference_radius(m.clip, y, y_prev)
        std = m.sigma * radius
        if not (math.isfinite(radius) and math.isfinite(std)):
            raise Diverged(task.round, "radius",
                           f"local step {k}'s radius {radius:.3g} or noise std {std:.3g} is not "
                           "finite; the local iterates have run away. " + DIVERGENCE_ADVICE)
        batch = np.flatnonzero(rng.random(num_samples) < q)
        sizes.append(int(batch.size))
        total = np.zeros_like(x0)
        if batch.size:
            total, n_clipped, over = clipped_sum(y, y_prev, batch, radius)
            clipped += n_clipped
            if over:
                return LocalResult(np.zeros_like(x0), tuple(sizes), clipped, True)
        noise = rng.standard_normal(x0.size) * std if std > 0 else 0.0
        # a run-away step: refused at the next radius
        with np.errstate(over="ignore", invalid="ignore"):
            w = w + total / m.batch_size + noise
            y_prev, y = y, y - m.learning_rate * w
    return LocalResult(y, tuple(sizes), clipped, False)
