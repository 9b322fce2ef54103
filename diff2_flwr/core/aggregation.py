"""The server's checks on the workers' replies, and their average.

The privacy analysis assumes: exactly P workers answer, once each; each reply is one
ClippedMean with the model's layout, finite, with norm at most the round's clipping radius;
each worker holds at least n_min samples (the calibration used n_min). If any of these fails
the round releases nothing: :func:`average_contributions` raises :class:`RoundRejected`
naming the worker and the check. A worker's per-sample clipping cannot be verified by the
server; the norm check catches a worker that did not clip its mean.

References:
    Murata & Suzuki (2023), Algorithm 1 (server aggregation) and the sensitivity 2C/(n_min P).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .estimator import RoundPlan
from .layout import ParameterLayout

__all__ = ["NORM_RTOL", "RoundRejected", "Reply", "Aggregate", "average_contributions", "robust_norm"]

#: Relative float tolerance on ``norm <= radius`` (float64 rounding of a clipped mean);
#: a norm inside the tolerance is projected back onto the ball, so the bound holds exactly.
NORM_RTOL = 1e-9


class RoundRejected(RuntimeError):
    """A round whose privacy assumptions failed; nothing was released."""

    def __init__(self, round: int, check: str, detail: str, client: str | None = None) -> None:
        self.round, self.check, self.client = round, check, client
        who = f" from {client}" if client else ""
        super().__init__(f"Round {round} released nothing: check '{check}' failed{who}: {detail}")


@dataclass(frozen=True)
class Reply:
    """One worker's reply, as the server received it."""

    client: str  # a name for errors, e.g. "partition 3 (node 8123…)"
    partition_id: int
    arrays: Sequence[np.ndarray]
    num_samples: int
    num_clipped: int


@dataclass(frozen=True)
class Aggregate:
    """(1/P) Σ_p ClippedMean_p as a flat vector, and the fraction of clipped samples (diagnostic)."""

    mean: np.ndarray
    clip_fraction: float


def _check_reply(plan: RoundPlan, layout: ParameterLayout, reply: Reply, n_min: int) -> np.ndarray:
    def reject(check: str, detail: str) -> RoundRejected:
        return RoundRejected(plan.round, check, detail, reply.client)

    if len(reply.arrays) != len(layout.shapes):
        raise reject("arrays", f"expected {len(layout.shapes)} arrays ({', '.join(layout.names)}), found {len(reply.arrays)}.")
    for name, shape, a in zip(layout.names, layout.shapes, reply.arrays):
        if not isinstance(a, np.ndarray) or a.dtype != np.float64:
            raise reject("dtype", f"array {name!r} must be float64, found {getattr(a, 'dtype', type(a).__name__)}.")
        if a.shape != shape:
            raise reject("shape", f"array {name!r} must have shape {shape}, found {a.shape}.")
    flat = layout.flatten(reply.arrays)
    if not np.all(np.isfinite(flat)):
        raise reject("finite", f"the contribution holds {int(np.sum(~np.isfinite(flat)))} NaN or inf values.")
    if reply.num_samples < n_min:
        raise reject(
            "n_min",
            f"the worker holds {reply.num_samples} samples but the noise was calibrated for at least "
            f"n_min = {n_min} per worker; the sensitivity would be larger than assumed.",
        )
    if not 0 <= reply.num_clipped <= reply.num_samples:
        raise reject("clip-count", f"reported {reply.num_clipped} clipped of {reply.num_samples} samples.")
    if not math.isinf(plan.radius):
        norm = robust_norm(flat)
        if norm > plan.radius * (1 + NORM_RTOL):
            raise reject(
                "norm",
                f"the contribution's norm {norm:.6g} exceeds the clipping radius {plan.radius:.6g} of this "
                f"{plan.kind} round. A worker that does not clip breaks the privacy guarantee.",
            )
        if norm > plan.radius:
            flat = _project(flat, plan.radius, norm)
    return flat


def robust_norm(flat: np.ndarray) -> float:
    """Euclidean norm without underflow or overflow: ``np.linalg.norm`` squares the entries, so a
    contribution of 1e-300 would read as norm 0 and pass a zero radius. Scaled by the largest entry."""
    scale = float(np.max(np.abs(flat))) if flat.size else 0.0
    if scale == 0.0 or not math.isfinite(scale):
        return scale
    return scale * float(np.linalg.norm(flat / scale))


def _project(flat: np.ndarray, radius: float, norm: float) -> np.ndarray:
    """Scale ``flat`` onto the ball of ``radius`` so that its float64 norm is <= radius exactly."""
    factor = radius / norm
    projected = flat * factor
    # rounding can leave it 1 ulp outside (by either way of computing the norm)
    while max(robust_norm(projected), float(np.linalg.norm(projected))) > radius:
        factor = np.nextafter(factor, 0.0)
        projected = flat * factor
    return projected


def average_contributions(
    plan: RoundPlan, layout: ParameterLayout, replies: Sequence[Reply], *, clients: int, n_min: int
) -> Aggregate:
    """Check every reply and average them in partition order; raise :class:`RoundRejected` on any failure."""
    seen: dict[int, Reply] = {}
    for reply in replies:
        if reply.partition_id in seen:
            raise RoundRejected(
                plan.round, "duplicate",
                f"partition {reply.partition_id} answered twice ({seen[reply.partition_id].client} and {reply.client}).",
            )
        if not 0 <= reply.partition_id < clients:
            raise RoundRejected(plan.round, "partition", f"partition id {reply.partition_id} is outside 0..{clients - 1}.", reply.client)
        seen[reply.partition_id] = reply
    missing = sorted(set(range(clients)) - set(seen))
    if missing:
        raise RoundRejected(
            plan.round, "all-clients",
            f"expected all P = {clients} workers, {len(seen)} answered; missing partitions {missing}. "
            "The calibration assumes every worker contributes every round.",
        )
    flats = [_check_reply(plan, layout, seen[p], n_min) for p in range(clients)]
    mean = np.sum(flats, axis=0) / clients
    clipped = sum(r.num_clipped for r in seen.values())
    samples = sum(r.num_samples for r in seen.values())
    return Aggregate(mean=mean, clip_fraction=clipped / samples)
