"""The DIFF2 worker as a Flower ``NumPyClient``: thin glue around
:class:`~diff2_flwr.runtime.session.Worker`.

Every task is checked by the node's :class:`~diff2_flwr.runtime.node_guard.NodeGuard` (the run
config's calibration, the node's policy and lifetime budget) before the worker touches its shard.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
from flwr.client import NumPyClient

from ..core.aggregation import Reply
from ..core.distributed import DistributedNoise
from ..core.estimator import Diverged
from ..core.memory import MemoryRefusal
from ..runtime.node_guard import NodeGuard
from ..runtime.policy import Refused
from ..runtime.session import Worker
from . import protocol

__all__ = ["Diff2Client"]


class Diff2Client(NumPyClient):
    """Returns ClippedMean of per-sample gradients (restart) or gradient differences on its shard;
    on the local routine's message (the worker chosen for round r), y_K of its private local steps.

    ``worker`` may be a callable that builds the worker (its shard and model) on first use, so that
    a task the guard refuses never loads the data.
    """

    def __init__(self, worker: Worker | Callable[[], Worker], guard: NodeGuard | None = None, *,
                 noise: Callable[[int, int], DistributedNoise] | None = None,
                 seed: int | None = None, partition_id: int | None = None) -> None:
        """``noise(n_min, dim)``: the run's distributed-noise settings (``privacy.noise:
        distributed``; None: central noise, the reply is the clipped mean). ``seed``:
        ``training.seed`` for the noise share (None: OS entropy). ``partition_id``: the shard this
        node holds, as its node config says (told to a strategy that samples clients without
        building the worker; None: the worker's)."""
        self._worker = worker
        self.guard = guard
        self.noise = noise
        self.seed = seed
        self.partition_id = partition_id

    def get_properties(self, config: dict) -> dict:
        """Which partition this node holds, to a strategy that samples clients
        (``protocol.PARTITION_QUERY``); nothing else is told. No record is read: the partition
        comes from the node config."""
        if dict(config) != protocol.PARTITION_QUERY:
            return {}
        p = self.partition_id if self.partition_id is not None else self.worker.partition_id
        return {protocol.PARTITION_KEY: int(p)}

    @property
    def worker(self) -> Worker:
        """This node's worker (its shard and model), built on first use when given as a callable."""
        if not isinstance(self._worker, Worker):
            try:
                self._worker = self._worker()
            except MemoryRefusal as err:  # the data owner's machine: before any record is used
                node = self.guard.node if self.guard is not None else "this node"
                raise Refused(node, "training.memory_budget_mb", str(err)) from None
        return self._worker

    def fit(self, parameters: list[np.ndarray], config: dict) -> tuple[list[np.ndarray], int, dict]:
        """Answer one server task once the guard passed it: the clipped mean (gradient phase), the
        noised SecAgg+ share (distributed noise) or y_K (local phase), encoded for the wire."""
        if protocol.is_local(config):
            return self._local_phase(parameters, config)
        layout = self.worker.gradients.layout
        task = protocol.decode_task(parameters, config, layout)
        if self.guard is not None:
            self.guard.check_task(task.round, task.radius, task.x_current, task.x_previous,
                                  task.n_min, self.worker.num_samples)
        # distributed noise: only inside SecAgg+ (see clients/client_app.py)
        if self.noise is not None:
            return self._share(task)
        contribution = self.worker.contribute(task.radius, task.x_current, task.x_previous)
        if self.guard is not None:  # the node's own canary records, if its policy audits the run
            contribution = self.guard.with_canaries(task.round, task.radius, task.x_current,
                                                    task.x_previous, task.n_min, contribution,
                                                    layout.dim, self.worker.num_samples)
        return protocol.encode_reply(task, contribution, self.worker.partition_id, layout)

    def _share(self, task: protocol.WorkerTask) -> tuple[list[np.ndarray], int, dict]:
        """This worker's noised, encoded message for the secure sum (the noise settings recomputed
        by this node from the run config and the task's n_min, which its guard checked)."""
        w = self.worker
        noise = self.noise(task.n_min, w.gradients.layout.dim)  # type: ignore[misc]
        message = w.message(noise, task.round, task.radius, task.x_current, task.x_previous,
                            self.seed)
        return protocol.encode_share(task, message, w.partition_id, noise.bits)

    def _local_phase(self, parameters: list[np.ndarray], config: dict) -> tuple[list[np.ndarray],
                                                                                int, dict]:
        w = self.worker
        task = protocol.decode_local_task(parameters, config, w.gradients.layout,
                                          partition_id=w.partition_id, num_samples=w.num_samples)
        if self.guard is not None:
            self.guard.check_local_task(task, w.num_samples)
        try:
            reply = w.local_phase(task)
        # the local iterates ran away: say so (zeros, overflow flag); the server stops as diverged
        except Diverged:
            reply = Reply(client=f"partition {w.partition_id}", partition_id=w.partition_id,
                          arrays=w.gradients.layout.split(np.zeros(w.gradients.layout.dim)),
                          num_samples=w.num_samples, num_clipped=0, overflow=True)
        return protocol.encode_local_reply(task, reply)
