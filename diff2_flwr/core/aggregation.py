"""The server's checks on the workers' replies, and their average.

The privacy analysis assumes: exactly P workers answer, once each; each reply is one
ClippedMean with the model's layout, finite, with norm at most the round's clipping radius;
each worker holds at least n_min samples (the calibration used n_min). If any of these fails
the round releases nothing: :func:`average_contributions` raises :class:`RoundRejected`
naming the worker and the check. A worker's per-sample clipping cannot be verified by the
server; the norm check catches a worker that did not clip its mean. A well-formed reply that
says its per-sample gradients overflow (an honest worker at a diverging iterate) stops the
round as :class:`Diverged` instead: nothing is released either way, and a NaN or inf the
worker does not explain stays a rejection.

References:
    Murata & Suzuki (2023), Algorithm 1 (server aggregation) and the sensitivity 2C/(n_min P).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .clipping import NORM_RTOL, project_onto_ball, robust_norm
from .estimator import Diverged, RoundPlan
from .layout import ParameterLayout
from .local import LocalTask

__all__ = ["NORM_RTOL", "Diverged", "NodeRefused", "RoundRejected", "Reply", "Aggregate",
           "average_contributions",
           "check_local_reply",
           "robust_norm"]


class RoundRejected(RuntimeError):
    """A round whose privacy assumptions failed; nothing was released."""

    def __init__(self, round: int, check: str, detail: str, client: str | None = None) -> None:
        self.round, self.check, self.client = round, check, client
        who = f" from {client}" if client else ""
        super().__init__(f"Round {round} released nothing: check '{check}' failed{who}: {detail}")


class NodeRefused(RoundRejected):
    """A round that released nothing because nodes refused its task: the message is the first
    node's own (first and whole), how many others refused, then ``more`` (where the round's
    failures are written, if anywhere)."""

    def __init__(self, round: int, refusals: Sequence[str], more: str = "") -> None:
        others = len(refusals) - 1
        also = f" ({others} other node(s) refused too.)" if others else ""
        RuntimeError.__init__(self, f"{refusals[0]}{also}{more}")
        self.round, self.check, self.client = round, "node-refused", None
        self.refusal = refusals[0]


@dataclass(frozen=True)
class Reply:
    """One worker's reply, as the server received it."""

    client: str  # a name for errors, e.g. "partition 3 (node 8123…)"
    partition_id: int
    arrays: Sequence[np.ndarray]
    num_samples: int
    num_clipped: int
    # the worker reports that its per-sample gradients overflow at this iterate
    overflow: bool = False


@dataclass(frozen=True)
class Aggregate:
    """(1/P) Σ_p ClippedMean_p as a flat vector, and the fraction of clipped samples
    (diagnostic)."""

    mean: np.ndarray
    clip_fraction: float


def _check_arrays(layout: ParameterLayout, reply: Reply, reject) -> None:
    """One float64 array per model tensor, each of the tensor's shape; ``reject(check, detail)``
    otherwise."""
    if len(reply.arrays) != len(layout.shapes):
        raise reject("arrays",
                     f"expected {len(layout.shapes)} arrays ({', '.join(layout.names)}), found "
                     f"{len(reply.arrays)}.")
    for name, shape, a in zip(layout.names, layout.shapes, reply.arrays):
        if not isinstance(a, np.ndarray) or a.dtype != np.float64:
            raise reject("dtype",
                         f"array {name!r} must be float64, found "
                         f"{getattr(a, 'dtype', type(a).__name__)}.")
        if a.shape != shape:
            raise reject("shape", f"array {name!r} must have shape {shape}, found {a.shape}.")


def _check_reply(plan: RoundPlan, layout: ParameterLayout, reply: Reply,
                 n_min: int) -> np.ndarray | None:
    """The reply's flat contribution after the checks (projected onto the ball if it exceeds the
    radius by float rounding), or None for a well-formed reply that reports an overflow."""
    def reject(check: str, detail: str) -> RoundRejected:
        return RoundRejected(plan.round, check, detail, reply.client)

    _check_arrays(layout, reply, reject)
    flat = layout.flatten(reply.arrays)
    if not reply.overflow and not np.all(np.isfinite(flat)):
        raise reject("finite",
                     f"the contribution holds {int(np.sum(~np.isfinite(flat)))} NaN or inf values.")
    if reply.num_samples < n_min:
        raise reject(
            "n_min",
            f"the worker holds {reply.num_samples} samples but the noise was calibrated for at "
            f"least n_min = {n_min} per worker; the sensitivity would be larger than assumed.",
        )
    if not 0 <= reply.num_clipped <= reply.num_samples:
        raise reject("clip-count",
                     f"reported {reply.num_clipped} clipped of {reply.num_samples} samples.")
    if reply.overflow:
        return None
    if not math.isinf(plan.radius):
        norm = robust_norm(flat)
        if norm > plan.radius * (1 + NORM_RTOL):
            raise reject(
                "norm",
                f"the contribution's norm {norm:.6g} exceeds the clipping radius "
                f"{plan.radius:.6g} of this {plan.kind} round. A worker that does not clip breaks "
                f"the privacy guarantee.",
            )
        if norm > plan.radius:
            flat = project_onto_ball(flat, plan.radius, norm)
    return flat


def average_contributions(
    plan: RoundPlan, layout: ParameterLayout, replies: Sequence[Reply], *, clients: int, n_min: int,
    cohort: Sequence[int] | None = None, denominator: float | None = None,
) -> Aggregate:
    """Check every reply and average them in partition order; raise :class:`RoundRejected` on any
    failure.

    With client sampling, ``cohort`` (sorted partition ids) is the round's and ``denominator`` its
    E|S|: exactly the cohort must answer, and the mean is Σ_{p∈S} ClippedMean_p / E|S| (summed in
    partition order, divided: :func:`~diff2_flwr.core.sampling.sampled_sum`'s bits; an empty
    cohort gives zeros)."""
    expected = list(range(clients)) if cohort is None else [int(p) for p in cohort]
    seen: dict[int, Reply] = {}
    for reply in replies:
        if reply.partition_id in seen:
            raise RoundRejected(
                plan.round, "duplicate",
                f"partition {reply.partition_id} answered twice "
                f"({seen[reply.partition_id].client} and {reply.client}).",
            )
        if not 0 <= reply.partition_id < clients:
            raise RoundRejected(plan.round, "partition",
                                f"partition id {reply.partition_id} is outside 0..{clients - 1}.",
                                reply.client)
        seen[reply.partition_id] = reply
    if cohort is not None:
        outside = sorted(set(seen) - set(expected))
        if outside:
            raise RoundRejected(
                plan.round, "cohort",
                f"partition(s) {outside} answered but are not in round {plan.round}'s cohort "
                f"{expected}; only the sampled clients may contribute (the calibration assumes "
                "it).", seen[outside[0]].client)
    missing = sorted(set(expected) - set(seen))
    if missing:
        if cohort is None:
            raise RoundRejected(
                plan.round, "all-clients",
                f"expected all P = {clients} workers, {len(seen)} answered; missing partitions "
                f"{missing}. "
                "The calibration assumes every worker contributes every round.",
            )
        raise RoundRejected(
            plan.round, "cohort",
            f"expected the {len(expected)} sampled workers {expected}, {len(seen)} answered; "
            f"missing partitions {missing}. The calibration assumes every sampled worker "
            "contributes.")
    flats = [_check_reply(plan, layout, seen[p], n_min) for p in expected]
    overflowed = [seen[p].client for p, f in zip(expected, flats) if f is None]
    if overflowed:  # every reply is well formed, and a worker explains why it has no finite mean
        raise Diverged(plan.round, "gradients",
                       f"{', '.join(overflowed)} report(s) that per-sample gradients overflow at "
                       f"x_{plan.round - 1}: "
                       "the optimisation diverged (the iterate is finite, its gradients are not). "
                       "Lower "
                       "training.learning_rate.")
    if cohort is None:
        mean = np.sum(flats, axis=0) / clients
    elif not flats:  # nobody drawn: the round releases its noise alone
        mean = np.zeros(layout.dim)
    else:
        mean = np.sum(flats, axis=0) / float(denominator if denominator is not None else clients)
    clipped = sum(r.num_clipped for r in seen.values())
    samples = sum(r.num_samples for r in seen.values())
    return Aggregate(mean=mean, clip_fraction=clipped / samples if samples else math.nan)


def check_local_reply(task: LocalTask, layout: ParameterLayout, reply: Reply,
                      n_min: int) -> np.ndarray:
    """y_K of the chosen worker's local phase, after the checks; raise :class:`RoundRejected` (or
    :class:`Diverged` for a well-formed overflow report) otherwise.

    The local phase's privacy rests on the worker's own clipping and noise, which the server cannot
    verify; it checks what it can: the right worker answered, with the model's layout, finite
    values, and at least n_min records (the calibration's sampling probability b / n_min bounds its
    b / n_p).
    """
    def reject(check: str, detail: str) -> RoundRejected:
        return RoundRejected(task.round, check, detail, reply.client)

    if reply.partition_id != task.partition_id:
        raise reject("local-worker",
                     f"the local phase was sent to partition {task.partition_id}, the reply is "
                     f"from partition {reply.partition_id}.")
    _check_arrays(layout, reply, reject)
    if reply.num_samples < max(n_min, task.mechanism.batch_size):
        raise reject("n_min",
                     f"the worker holds {reply.num_samples} samples; the local steps were "
                     f"calibrated for at least n_min = {n_min} (and b = "
                     f"{task.mechanism.batch_size}).")
    if reply.overflow:
        raise Diverged(task.round, "gradients",
                       f"{reply.client} reports that per-sample gradients overflow during its "
                       "local steps: the optimisation diverged. Lower training.learning_rate.")
    flat = layout.flatten(reply.arrays)
    if not np.all(np.isfinite(flat)):
        raise reject("finite", f"y_K holds {int(np.sum(~np.isfinite(flat)))} NaN or inf values.")
    return flat
