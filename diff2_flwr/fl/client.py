"""The DIFF2 worker as a Flower ``NumPyClient``: thin glue around :class:`~diff2_flwr.runtime.session.Worker`."""

from __future__ import annotations

import numpy as np
from flwr.client import NumPyClient

from ..core.aggregation import Reply
from ..core.estimator import Diverged
from ..runtime.session import Worker
from . import protocol

__all__ = ["Diff2Client"]


class Diff2Client(NumPyClient):
    """Returns ClippedMean of per-sample gradients (restart) or gradient differences on its shard; on the local
    routine's message (the worker chosen for round r), y_K of its private local steps."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    def fit(self, parameters: list[np.ndarray], config: dict) -> tuple[list[np.ndarray], int, dict]:
        layout = self.worker.gradients.layout
        if protocol.is_local(config):
            return self._local_phase(parameters, config)
        task = protocol.decode_task(parameters, config, layout)
        contribution = self.worker.contribute(task.radius, task.x_current, task.x_previous)
        return protocol.encode_reply(task, contribution, self.worker.partition_id, layout)

    def _local_phase(self, parameters: list[np.ndarray], config: dict) -> tuple[list[np.ndarray], int, dict]:
        w = self.worker
        task = protocol.decode_local_task(parameters, config, w.gradients.layout, partition_id=w.partition_id,
                                          num_samples=w.num_samples)
        try:
            reply = w.local_phase(task)
        except Diverged:  # the local iterates ran away: say so (zeros, overflow flag); the server stops as diverged
            reply = Reply(client=f"partition {w.partition_id}", partition_id=w.partition_id,
                          arrays=w.gradients.layout.split(np.zeros(w.gradients.layout.dim)),
                          num_samples=w.num_samples, num_clipped=0, overflow=True)
        return protocol.encode_local_reply(task, reply)
