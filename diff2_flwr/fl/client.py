"""The DIFF2 worker as a Flower ``NumPyClient``: thin glue around :class:`~diff2_flwr.runtime.session.Worker`."""

from __future__ import annotations

import numpy as np
from flwr.client import NumPyClient

from ..runtime.session import Worker
from . import protocol

__all__ = ["Diff2Client"]


class Diff2Client(NumPyClient):
    """Returns ClippedMean of per-sample gradients (restart) or gradient differences on its shard."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    def fit(self, parameters: list[np.ndarray], config: dict) -> tuple[list[np.ndarray], int, dict]:
        layout = self.worker.gradients.layout
        task = protocol.decode_task(parameters, config, layout)
        contribution = self.worker.contribute(task.radius, task.x_current, task.x_previous)
        return protocol.encode_reply(task, contribution, self.worker.partition_id, layout)
