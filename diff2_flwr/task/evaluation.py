"""Evaluation metrics of an iterate: train loss f(x), ||∇f(x)||², test loss; for classification also
test accuracy and (with the train metrics) train accuracy.

These are the paper's criteria. They are computed by whoever is given the data for
evaluation (in a simulation: the server) and are **not** part of the private protocol:
the train metrics read the private train split without clipping or noise, so they are not
covered by ε. Deployment configs should switch them off.

f(x) = (1/P) Σ_p f_p(x), the objective of DIFF2.md "Setting", with f_p the mean loss on shard p.
Accuracy is the fraction of records whose largest output is at the true class (ties: the first
class), pooled over all records of the split (train: all shards together, so a large shard counts
more, unlike f).
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
        self, gradients: PerSampleGradients, *, shards: Sequence[tuple[np.ndarray,
                                                                       np.ndarray]] = (),
        test: tuple[np.ndarray, np.ndarray] | None = None, classification: bool = False,
    ) -> None:
        """``shards``: the train shards for train loss and ‖∇f‖² (none: not computed); ``test``: the
        test split; ``classification``: targets are class indices, and accuracy is reported too."""
        self.gradients = gradients
        self.classification = classification
        as_t = lambda a: torch.as_tensor(a, dtype=gradients.dtype)  # noqa: E731
        self._shards = [(as_t(x), as_t(y)) for x, y in shards]
        self._test = None if test is None else (as_t(test[0]), as_t(test[1]))

    @classmethod
    def of(cls, gradients: PerSampleGradients, data: PreparedData, *, train_metrics: bool = True,
           test_metrics: bool = True) -> "Evaluator":
        """An evaluator of ``data``: its train shards if ``train_metrics``, its test split if
        ``test_metrics``."""
        shards = [data.shard(p) for p in range(len(data.shard_bounds))] if train_metrics else []
        return cls(gradients, shards=shards, test=(data.x_test,
                                                   data.y_test) if test_metrics else None,
                   classification=data.task == "classification")

    def _correct(self, x: np.ndarray, features: torch.Tensor, targets: torch.Tensor) -> int:
        outputs = self.gradients.outputs(x, features)
        if outputs.ndim != 2 or outputs.shape[1] < 2:
            raise ValueError(
                f"Accuracy needs one output per class; the model gives outputs of shape "
                f"{tuple(outputs.shape)}.")
        return int((outputs.argmax(dim=1) == targets.long()).sum())

    def __call__(self, x: np.ndarray) -> dict[str, float]:
        """The metrics at ``x`` by name: train_loss and grad_norm_sq (given shards), test_loss
        (given a test split), and for classification their accuracies."""
        out: dict[str, float] = {}
        if self._shards:
            losses, grads = zip(*(self.gradients.loss_and_gradient(x, xs, ys) for xs,
                                  ys in self._shards))
            full_grad = np.mean(grads, axis=0)
            out["train_loss"] = float(np.mean(losses))
            out["grad_norm_sq"] = float(full_grad @ full_grad)
            if self.classification:
                total = sum(int(xs.shape[0]) for xs, _ in self._shards)
                out["train_accuracy"] = sum(self._correct(x, xs, ys) for xs,
                                            ys in self._shards) / total
        if self._test is not None:
            out["test_loss"] = self.gradients.mean_loss(x, *self._test)
            if self.classification:
                out["test_accuracy"] = self._correct(x, *self._test) / int(self._test[0].shape[0])
        return out
