"""Evaluation metrics of an iterate: train loss f(x), ||∇f(x)||², test loss.

These are the paper's criteria. They are computed by whoever is given the data for
evaluation (in a simulation: the server) and are **not** part of the private protocol:
the train metrics read the private train split without clipping or noise, so they are not
covered by ε. Deployment configs should switch them off.

f(x) = (1/P) Σ_p f_p(x), the objective of DIFF2.md "Setting", with f_p the mean loss on shard p.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ..core.gradients import PerSampleGradients
from .data import PreparedData

__all__ = ["Evaluator"]


class Evaluator:
    """Computes the evaluation metrics of a flat parameter vector."""

    def __init__(
        self, gradients: PerSampleGradients, *, shards: Sequence[tuple[np.ndarray, np.ndarray]] = (),
        test: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> None:
        """``shards``: the train shards for train loss and ‖∇f‖² (none: not computed); ``test``: the test split."""
        self.gradients = gradients
        as_t = lambda a: torch.as_tensor(a, dtype=gradients.dtype)  # noqa: E731
        self._shards = [(as_t(x), as_t(y)) for x, y in shards]
        self._test = None if test is None else (as_t(test[0]), as_t(test[1]))

    @classmethod
    def of(cls, gradients: PerSampleGradients, data: PreparedData, *, train_metrics: bool = True,
           test_metrics: bool = True) -> "Evaluator":
        shards = [data.shard(p) for p in range(len(data.shard_bounds))] if train_metrics else []
        return cls(gradients, shards=shards, test=(data.x_test, data.y_test) if test_metrics else None)

    def __call__(self, x: np.ndarray) -> dict[str, float]:
        out: dict[str, float] = {}
        if self._shards:
            losses, grads = zip(*(self.gradients.loss_and_gradient(x, xs, ys) for xs, ys in self._shards))
            full_grad = np.mean(grads, axis=0)
            out["train_loss"] = float(np.mean(losses))
            out["grad_norm_sq"] = float(full_grad @ full_grad)
        if self._test is not None:
            out["test_loss"] = self.gradients.mean_loss(x, *self._test)
        return out
