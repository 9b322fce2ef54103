"""The wire protocol between the DIFF2 server and its workers: every key lives here.

Server -> worker (``FitIns``): parameters = x_{r-1} (one array per model tensor), followed on
difference rounds by x_{r-2}; config = round, kind, radius and n_min (the smallest shard the
calibration took: a worker with fewer records refuses, and recomputes the calibration from it).
Workers keep no state between messages (a deployment may start a fresh worker process per
message); a worker checks every task against the run config before it touches its shard
(:mod:`diff2_flwr.runtime.node_guard`).

Under ``privacy.noise: distributed`` the same task is answered with a Skellam message inside
Flower's SecAgg+ (:func:`encode_share`; the server sees only the unmasked sum,
:func:`decode_secure_sum`).

Worker -> server (``FitRes``): parameters = the ClippedMean (float64, one array per tensor);
num_examples = n_p; metrics = partition id, echoed round, number of clipped samples, and an
overflow flag (1: the worker's per-sample gradients overflow at this iterate; the arrays are then
zeros; absent = 0).

The local routine's extra message (kind ``local``, to the one chosen worker only): parameters =
x_{r-1} then ṽ_r (one array per tensor each); config = round, kind, the chosen partition id, K, b,
η, C3, σ3, n_min and q = b / n_min (the sampling rate the analysis accounted) and, in a seeded run
only, the seed of the worker's generator (a uint64 sent as the int64 with the same 64 bits, so that
it fits every integer type of Flower's records). The reply: parameters = y_K, num_examples = n_p,
metrics = partition id, echoed round, echoed kind (``local``, so a gradient reply of the same round
can never be taken for y_K) and the overflow flag. Nothing else about the local steps (batch sizes,
records clipped) leaves the worker.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from ..core.aggregation import Reply, RoundRejected
from ..core.clipping import RADIUS_FLOOR
from ..core.estimator import RoundPlan
from ..core.gradients import Contribution
from ..core.layout import ParameterLayout
from ..core.local import LocalMechanism, LocalTask
from .secagg import from_secagg, to_secagg

__all__ = [
    "ROUND", "KIND", "RADIUS", "N_MIN", "LOCAL_SAMPLING_PROB", "PARTITION_ID", "NUM_CLIPPED",
    "ECHO_ROUND", "OVERFLOW",
    "LOCAL", "LOCAL_STEPS", "LOCAL_BATCH_SIZE", "LOCAL_LEARNING_RATE", "LOCAL_CLIP", "LOCAL_SIGMA",
    "LOCAL_SEED", "PARTITION_QUERY", "PARTITION_KEY",
    "ECHO_KIND", "WorkerTask", "encode_task", "decode_task", "encode_reply", "decode_reply",
    "is_local",
    "encode_local_task", "decode_local_task", "encode_local_reply", "decode_local_reply",
    "encode_share",
    "decode_secure_sum",
]

# FitIns.config
ROUND = "diff2.round"
KIND = "diff2.kind"
RADIUS = "diff2.radius"
N_MIN = "diff2.n-min"
# FitRes.metrics
PARTITION_ID = "diff2.partition-id"
ECHO_ROUND = "diff2.round"
NUM_CLIPPED = "diff2.num-clipped"
OVERFLOW = "diff2.overflow"

# FitIns.config of the local phase: ROUND, KIND = LOCAL, PARTITION_ID (the chosen worker) and these
# client sampling: the strategy asks each node once which partition it holds (get_properties)
PARTITION_QUERY = {"diff2.query": "partition"}
PARTITION_KEY = PARTITION_ID

LOCAL = "local"
LOCAL_STEPS = "diff2.local-steps"  # K
LOCAL_BATCH_SIZE = "diff2.local-batch-size"  # b
LOCAL_LEARNING_RATE = "diff2.local-learning-rate"  # η
LOCAL_CLIP = "diff2.local-clip"  # C3
LOCAL_SIGMA = "diff2.local-sigma"  # σ3
LOCAL_SAMPLING_PROB = "diff2.local-sampling-prob"  # q = b / n_min, as accounted
LOCAL_SEED = "diff2.local-seed"  # seeded runs only
# FitRes.metrics of the local phase: PARTITION_ID, ECHO_ROUND, OVERFLOW and
ECHO_KIND = "diff2.kind"

_KINDS = ("restart", "difference")
_LOCAL_REQUIRED = (ROUND, KIND, PARTITION_ID, LOCAL_STEPS, LOCAL_BATCH_SIZE, LOCAL_LEARNING_RATE,
                   LOCAL_CLIP, LOCAL_SIGMA, N_MIN, LOCAL_SAMPLING_PROB)
_LOCAL_METRICS = (PARTITION_ID, ECHO_ROUND, ECHO_KIND, OVERFLOW)
_UINT64 = 1 << 64
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


@dataclass(frozen=True)
class WorkerTask:
    """What a worker must compute in one round."""

    round: int
    radius: float
    x_current: np.ndarray
    x_previous: np.ndarray | None
    n_min: int

    @property
    def kind(self) -> str:
        """``"restart"`` (x_r only: a full gradient) or ``"difference"`` (x_r and x_{r-1})."""
        return "restart" if self.x_previous is None else "difference"


def encode_task(plan: RoundPlan, layout: ParameterLayout,
                n_min: int) -> tuple[list[np.ndarray], dict[str, int | float | str]]:
    """The server's gradient task of ``plan``: x_r (and x_{r-1} in a difference round) as arrays,
    round, kind, clipping radius and n_min as config."""
    arrays = layout.split(plan.x_current)
    if plan.x_previous is not None:
        arrays += layout.split(plan.x_previous)
    return arrays, {ROUND: plan.round, KIND: plan.kind, RADIUS: float(plan.radius),
                    N_MIN: int(n_min)}


def decode_task(arrays: Sequence[np.ndarray], config: Mapping,
                layout: ParameterLayout) -> WorkerTask:
    """Parse a server message; raise ValueError if it does not follow the protocol."""
    missing = [k for k in (ROUND, KIND, RADIUS, N_MIN) if k not in config]
    if missing:
        raise ValueError(
            f"The server's message lacks config keys {missing}: is the server a DIFF2 server of "
            f"the same version?")
    kind, radius = config[KIND], float(config[RADIUS])
    if kind not in _KINDS:
        raise ValueError(f"Config key {KIND!r} must be one of {_KINDS}. Found {kind!r}.")
    if math.isnan(radius) or radius < 0:
        raise ValueError(f"Config key {RADIUS!r} must be >= 0. Found {radius}.")
    if 0 < radius < RADIUS_FLOOR:  # e.g. iterates sent a hair apart: C2 ||x_(r-1) - x_(r-2)||
        raise ValueError(
            f"Config key {RADIUS!r} is {radius:.3g}, below {RADIUS_FLOOR:.3g} (2^-900): clipped "
            "values that small round by more than their size (subnormal floats), so neither the "
            "clipping bound nor noise scaled to the radius holds; this node computes nothing for "
            "the round.")
    r = _integer(config, ROUND, 1, "round")
    n_min = _integer(config, N_MIN, 1, "n_min, the smallest shard")
    k = len(layout.shapes)
    expected = k if kind == "restart" else 2 * k
    if len(arrays) != expected:
        raise ValueError(f"A {kind} round carries {expected} arrays. Found {len(arrays)}.")
    x_current = layout.flatten(arrays[:k])
    x_previous = layout.flatten(arrays[k:]) if kind == "difference" else None
    return WorkerTask(r, radius, x_current, x_previous, n_min)


def encode_reply(
    task: WorkerTask, contribution: Contribution, partition_id: int, layout: ParameterLayout
) -> tuple[list[np.ndarray], int, dict[str, int]]:
    """A worker's reply to a gradient task: its clipped mean as arrays, n_p, and as metrics its
    partition, the echoed round, how many records were clipped and the overflow flag."""
    metrics = {PARTITION_ID: partition_id, ECHO_ROUND: task.round,
               NUM_CLIPPED: contribution.num_clipped, OVERFLOW: int(contribution.overflow)}
    return layout.split(contribution.mean), contribution.num_samples, metrics


def decode_reply(
    client: str, arrays: Sequence[np.ndarray], num_examples: int, metrics: Mapping,
    expected_round: int
) -> Reply:
    """Turn a worker's reply into a :class:`Reply`; a malformed one rejects the round."""
    for key in (PARTITION_ID, ECHO_ROUND, NUM_CLIPPED):
        if not isinstance(metrics.get(key), int) or isinstance(metrics.get(key), bool):
            raise RoundRejected(expected_round, "protocol",
                                f"metric {key!r} must be an integer; found {metrics.get(key)!r}.",
                                client)
    overflow = metrics.get(OVERFLOW, 0)
    if overflow not in (0, 1) or isinstance(overflow, bool) or not isinstance(overflow, int):
        raise RoundRejected(expected_round, "protocol",
                            f"metric {OVERFLOW!r} must be 0 or 1; found {overflow!r}.", client)
    if metrics[ECHO_ROUND] != expected_round:
        raise RoundRejected(expected_round, "round",
                            f"the reply is for round {metrics[ECHO_ROUND]}.", client)
    return Reply(client=f"partition {metrics[PARTITION_ID]} ({client})",
                 partition_id=metrics[PARTITION_ID], arrays=list(arrays),
                 num_samples=int(num_examples), num_clipped=metrics[NUM_CLIPPED],
                 overflow=bool(overflow))


# ------------------------------------------------------------------------------ distributed noise
# (SecAgg+)

def encode_share(task: WorkerTask, message: np.ndarray, partition_id: int,
                 bits: int) -> tuple[list[np.ndarray], int, dict[str, int]]:
    """A worker's reply under ``privacy.noise: distributed``, for Flower's ``secaggplus_mod`` to
    mask: parameters = its message centred to [-M/2, M/2) (one float64 array,
    :func:`~diff2_flwr.fl.secagg.to_secagg`), num_examples = 1 (every weight equal: the sum is not
    reweighted), metrics = partition id and echoed round only (the mod sends metrics in the clear:
    no count of clipped records, no n_p beyond the public n_min check)."""
    return [to_secagg(message, bits)], 1, {PARTITION_ID: partition_id, ECHO_ROUND: task.round}


def decode_secure_sum(results: Sequence[tuple[str, Sequence[np.ndarray], Mapping]],
                      expected_round: int, clients: int, bits: int) -> tuple[np.ndarray, int]:
    """The modular sum and the number of survivors from SecAgg+'s results: one (node, arrays,
    metrics) per client whose masked vector is in the sum, each carrying the same unmasked mean. A
    malformed one rejects the round."""
    if not results:
        raise RoundRejected(expected_round, "survivors",
                            "SecAgg+ handed over no result: nothing to decode.")
    seen: dict[int, str] = {}
    for node, arrays, metrics in results:
        for key in (PARTITION_ID, ECHO_ROUND):
            if not isinstance(metrics.get(key), int) or isinstance(metrics.get(key), bool):
                raise RoundRejected(expected_round, "protocol",
                                    f"metric {key!r} must be an integer; found "
                                    f"{metrics.get(key)!r}.", node)
        if metrics[ECHO_ROUND] != expected_round:
            raise RoundRejected(expected_round, "round",
                                f"the message is for round {metrics[ECHO_ROUND]}.", node)
        p = metrics[PARTITION_ID]
        if not 0 <= p < clients or p in seen:
            raise RoundRejected(expected_round, "partition",
                                f"partition id {p} is outside 0..{clients - 1} or "
                                f"answered twice ({seen.get(p)} and {node}).", node)
        seen[p] = node
        if len(arrays) != 1:
            raise RoundRejected(expected_round, "secure-sum",
                                f"the secure sum carries 1 array; found {len(arrays)}.")
    mean = results[0][1][0]
    try:
        total = from_secagg(mean, len(results), bits)
    except ValueError as err:
        raise RoundRejected(expected_round, "secure-sum", str(err)) from None
    return total, len(results)


# ------------------------------------------------------------------------------ the local phase

def is_local(config: Mapping) -> bool:
    """Whether a server message is the local routine's task (rather than a gradient round's)."""
    return config.get(KIND) == LOCAL


def _seed_to_wire(seed: int) -> int:
    """A uint64 seed as the int64 with the same bits (Flower's records hold sint64 safely
    everywhere)."""
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < _UINT64:
        raise ValueError(f"The local seed must be an integer in [0, 2**64). Found {seed!r}.")
    return seed - _UINT64 if seed > _INT64_MAX else seed


def _seed_from_wire(value: object) -> int:
    if not isinstance(value, int) or isinstance(value,
                                                bool) or not _INT64_MIN <= value <= _INT64_MAX:
        raise ValueError(
            f"Config key {LOCAL_SEED!r} must be a 64-bit signed integer (a uint64 seed's bits). "
                         f"Found {value!r}.")
    return value % _UINT64


def encode_local_task(task: LocalTask,
                      layout: ParameterLayout) -> tuple[list[np.ndarray], dict[str,
                                                                               int | float | str]]:
    """The chosen worker's message: x_{r-1} and ṽ_r as arrays, the mechanism (and a seeded run's
    seed) as config."""
    m = task.mechanism
    config: dict[str, int | float | str] = {
        ROUND: task.round, KIND: LOCAL, PARTITION_ID: task.partition_id, LOCAL_STEPS: m.steps,
        LOCAL_BATCH_SIZE: m.batch_size, LOCAL_LEARNING_RATE: float(m.learning_rate),
        LOCAL_CLIP: float(m.clip), LOCAL_SIGMA: float(m.sigma), N_MIN: int(task.n_min),
        LOCAL_SAMPLING_PROB: float(task.sampling_prob),
    }
    if task.seed is not None:
        config[LOCAL_SEED] = _seed_to_wire(task.seed)
    return layout.split(task.x_start) + layout.split(task.v), config


def _integer(config: Mapping, key: str, minimum: int, what: str) -> int:
    value = config[key]
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(
            f"Config key {key!r} ({what}) must be an integer >= {minimum}. Found {value!r}.")
    return value


def _number(config: Mapping, key: str, what: str, *, positive: bool) -> float:
    value = config[key]
    if not isinstance(value, (int, float)) or isinstance(value,
                                                         bool) or not math.isfinite(value) or (
            value <= 0 if positive else value < 0):
        raise ValueError(
            f"Config key {key!r} ({what}) must be a finite number {'>' if positive else '>='} 0. "
                         f"Found {value!r}.")
    return float(value)


def _vector(arrays: Sequence[np.ndarray], layout: ParameterLayout, what: str) -> np.ndarray:
    for name, a in zip(layout.names, arrays):
        if not isinstance(a, np.ndarray) or a.dtype != np.float64:
            raise ValueError(f"The local task's {what} array {name!r} must be float64. "
                             f"Found {getattr(a, 'dtype', type(a).__name__)}.")
    try:
        flat = layout.flatten(arrays)
    except ValueError as err:
        raise ValueError(f"The local task's {what} does not fit the model: {err}") from None
    if not np.all(np.isfinite(flat)):
        raise ValueError(
            f"The local task's {what} holds {int(np.sum(~np.isfinite(flat)))} NaN or inf values.")
    return flat


def decode_local_task(arrays: Sequence[np.ndarray], config: Mapping, layout: ParameterLayout, *,
                      partition_id: int, num_samples: int) -> LocalTask:
    """Parse and check the local routine's message before any record is touched; raise ValueError if
    it does not follow the protocol or does not fit this worker (another partition, b > n_p, shapes,
    NaN/inf, K < 2)."""
    missing = [k for k in _LOCAL_REQUIRED if k not in config]
    if missing:
        raise ValueError(
            f"The server's local task lacks config keys {missing}: is the server a DIFF2 server "
            f"of the "
                         "same version?")
    unknown = sorted(set(config) - set(_LOCAL_REQUIRED) - {LOCAL_SEED})
    if unknown:
        raise ValueError(
            f"The server's local task has unknown config keys {unknown}: is the server a DIFF2 "
            f"server of "
                         "the same version?")
    if config[KIND] != LOCAL:
        raise ValueError(
            f"Config key {KIND!r} must be {LOCAL!r} for a local task. Found {config[KIND]!r}.")
    r = _integer(config, ROUND, 1, "round")
    target = _integer(config, PARTITION_ID, 0, "the chosen partition")
    if target != partition_id:
        raise ValueError(
            f"The local task of round {r} is for partition {target}; this worker is partition "
                         f"{partition_id}. Nothing was computed.")
    steps = _integer(config, LOCAL_STEPS, 2, "K, the local steps")
    batch_size = _integer(config, LOCAL_BATCH_SIZE, 1, "b, the local batch size")
    if batch_size > num_samples:
        raise ValueError(
            f"Config key {LOCAL_BATCH_SIZE!r} (b) = {batch_size} exceeds this worker's "
            f"{num_samples} "
                         "records: Poisson sampling with probability b / n_p needs b <= n_p.")
    learning_rate = _number(config, LOCAL_LEARNING_RATE, "η", positive=True)
    clip = _number(config, LOCAL_CLIP, "C3", positive=True)
    sigma = _number(config, LOCAL_SIGMA, "σ3", positive=False)
    n_min = _integer(config, N_MIN, 1, "n_min, the smallest shard")
    q = _number(config, LOCAL_SAMPLING_PROB, "q = b / n_min", positive=True)
    if not (q <= 1 and q == batch_size / n_min):
        raise ValueError(
            f"Config key {LOCAL_SAMPLING_PROB!r} (q) must be b / n_min = {batch_size} / {n_min}. "
            f"Found {q!r}. Nothing was computed.")
    if n_min > num_samples:
        raise ValueError(
            f"The local task says n_min = {n_min}, but this worker holds {num_samples} records: "
            f"it would "
                         f"sample at b / n_p = {batch_size / num_samples:.6g}, above the "
                         f"accounted q = {q:.6g}. Nothing "
                         "was computed.")
    seed = _seed_from_wire(config[LOCAL_SEED]) if LOCAL_SEED in config else None
    k = len(layout.shapes)
    if len(arrays) != 2 * k:
        raise ValueError(
            f"A local task carries {2 * k} arrays (x_(r-1), then ṽ_r). Found {len(arrays)}.")
    x_start = _vector(arrays[:k], layout, "x_(r-1)")
    v = _vector(arrays[k:], layout, "ṽ_r")
    mechanism = LocalMechanism(steps=steps, batch_size=batch_size, learning_rate=learning_rate,
                               clip=clip, sigma=sigma)
    return LocalTask(round=r, partition_id=target, x_start=x_start, v=v, mechanism=mechanism,
                     seed=seed, n_min=n_min, sampling_prob=q)


def encode_local_reply(task: LocalTask, reply: Reply) -> tuple[list[np.ndarray], int,
                                                               dict[str, int | str]]:
    """y_K, n_p and the metrics the server checks (the worker's own :class:`Reply` of its local
    phase)."""
    metrics: dict[str, int | str] = {PARTITION_ID: reply.partition_id, ECHO_ROUND: task.round,
                                     ECHO_KIND: LOCAL, OVERFLOW: int(reply.overflow)}
    return list(reply.arrays), reply.num_samples, metrics


def decode_local_reply(
    client: str, arrays: Sequence[np.ndarray], num_examples: int, metrics: Mapping,
    expected_round: int
) -> Reply:
    """Turn the chosen worker's reply into a :class:`Reply`; a malformed one, or one that is not a
    local-phase reply of this round, releases nothing (the server then checks partition, shapes,
    finiteness, n_p)."""
    def reject(check: str, detail: str) -> RoundRejected:
        return RoundRejected(expected_round, check, detail, client)

    if metrics.get(ECHO_KIND) != LOCAL:
        raise reject("phase",
                     f"metric {ECHO_KIND!r} must be {LOCAL!r} in a reply to the local phase; "
                     f"found {metrics.get(ECHO_KIND)!r} (a reply to the gradient phase cannot be "
                     f"taken for y_K).")
    unknown = sorted(set(metrics) - set(_LOCAL_METRICS))
    if unknown:
        raise reject("protocol", f"unknown metrics {unknown} in a reply to the local phase.")
    for key in (PARTITION_ID, ECHO_ROUND):
        if not isinstance(metrics.get(key), int) or isinstance(metrics.get(key), bool):
            raise reject("protocol",
                         f"metric {key!r} must be an integer; found {metrics.get(key)!r}.")
    overflow = metrics.get(OVERFLOW, 0)
    if overflow not in (0, 1) or isinstance(overflow, bool) or not isinstance(overflow, int):
        raise reject("protocol", f"metric {OVERFLOW!r} must be 0 or 1; found {overflow!r}.")
    if metrics[ECHO_ROUND] != expected_round:
        raise reject("round", f"the reply is for round {metrics[ECHO_ROUND]}.")
    return Reply(client=f"partition {metrics[PARTITION_ID]} ({client})",
                 partition_id=metrics[PARTITION_ID], arrays=list(arrays),
                 num_samples=int(num_examples), num_clipped=0, overflow=bool(overflow))
