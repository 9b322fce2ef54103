"""The wire protocol between the DIFF2 server and its workers: every key lives here.

Server -> worker (``FitIns``): parameters = x_{r-1} (one array per model tensor), followed on
difference rounds by x_{r-2}; config = round, kind, radius. Workers keep no state between
messages (a deployment may start a fresh worker process per message).

Worker -> server (``FitRes``): parameters = the ClippedMean (float64, one array per tensor);
num_examples = n_p; metrics = partition id, echoed round, number of clipped samples, and an
overflow flag (1: the worker's per-sample gradients overflow at this iterate; the arrays are then
zeros; absent = 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from ..core.aggregation import Reply, RoundRejected
from ..core.estimator import RoundPlan
from ..core.gradients import Contribution
from ..core.layout import ParameterLayout

__all__ = [
    "ROUND", "KIND", "RADIUS", "PARTITION_ID", "NUM_CLIPPED", "ECHO_ROUND", "OVERFLOW",
    "WorkerTask", "encode_task", "decode_task", "encode_reply", "decode_reply",
]

# FitIns.config
ROUND = "diff2.round"
KIND = "diff2.kind"
RADIUS = "diff2.radius"
# FitRes.metrics
PARTITION_ID = "diff2.partition-id"
ECHO_ROUND = "diff2.round"
NUM_CLIPPED = "diff2.num-clipped"
OVERFLOW = "diff2.overflow"

_KINDS = ("restart", "difference")


@dataclass(frozen=True)
class WorkerTask:
    """What a worker must compute in one round."""

    round: int
    radius: float
    x_current: np.ndarray
    x_previous: np.ndarray | None


def encode_task(plan: RoundPlan, layout: ParameterLayout) -> tuple[list[np.ndarray], dict[str, int | float | str]]:
    arrays = layout.split(plan.x_current)
    if plan.x_previous is not None:
        arrays += layout.split(plan.x_previous)
    return arrays, {ROUND: plan.round, KIND: plan.kind, RADIUS: float(plan.radius)}


def decode_task(arrays: Sequence[np.ndarray], config: Mapping, layout: ParameterLayout) -> WorkerTask:
    """Parse a server message; raise ValueError if it does not follow the protocol."""
    missing = [k for k in (ROUND, KIND, RADIUS) if k not in config]
    if missing:
        raise ValueError(f"The server's message lacks config keys {missing}: is the server a DIFF2 server of the same version?")
    kind, radius = config[KIND], float(config[RADIUS])
    if kind not in _KINDS:
        raise ValueError(f"Config key {KIND!r} must be one of {_KINDS}. Found {kind!r}.")
    if math.isnan(radius) or radius < 0:
        raise ValueError(f"Config key {RADIUS!r} must be >= 0. Found {radius}.")
    k = len(layout.shapes)
    expected = k if kind == "restart" else 2 * k
    if len(arrays) != expected:
        raise ValueError(f"A {kind} round carries {expected} arrays. Found {len(arrays)}.")
    x_current = layout.flatten(arrays[:k])
    x_previous = layout.flatten(arrays[k:]) if kind == "difference" else None
    return WorkerTask(int(config[ROUND]), radius, x_current, x_previous)


def encode_reply(
    task: WorkerTask, contribution: Contribution, partition_id: int, layout: ParameterLayout
) -> tuple[list[np.ndarray], int, dict[str, int]]:
    metrics = {PARTITION_ID: partition_id, ECHO_ROUND: task.round, NUM_CLIPPED: contribution.num_clipped,
               OVERFLOW: int(contribution.overflow)}
    return layout.split(contribution.mean), contribution.num_samples, metrics


def decode_reply(
    client: str, arrays: Sequence[np.ndarray], num_examples: int, metrics: Mapping, expected_round: int
) -> Reply:
    """Turn a worker's reply into a :class:`Reply`; a malformed one rejects the round."""
    for key in (PARTITION_ID, ECHO_ROUND, NUM_CLIPPED):
        if not isinstance(metrics.get(key), int) or isinstance(metrics.get(key), bool):
            raise RoundRejected(expected_round, "protocol", f"metric {key!r} must be an integer; found {metrics.get(key)!r}.", client)
    overflow = metrics.get(OVERFLOW, 0)
    if overflow not in (0, 1) or isinstance(overflow, bool) or not isinstance(overflow, int):
        raise RoundRejected(expected_round, "protocol", f"metric {OVERFLOW!r} must be 0 or 1; found {overflow!r}.", client)
    if metrics[ECHO_ROUND] != expected_round:
        raise RoundRejected(expected_round, "round", f"the reply is for round {metrics[ECHO_ROUND]}.", client)
    return Reply(client=f"partition {metrics[PARTITION_ID]} ({client})", partition_id=metrics[PARTITION_ID],
                 arrays=list(arrays), num_samples=int(num_examples), num_clipped=metrics[NUM_CLIPPED],
                 overflow=bool(overflow))
