"""Per-sample losses: ``loss(prediction[n, ...], target[n]) -> losses[n]``."""

from __future__ import annotations

import torch

__all__ = ["half_squared_error", "cross_entropy", "get_loss", "LOSSES"]


def half_squared_error(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """ℓ = ½ (f(x) - y)², the paper's squared loss (½·MSE when averaged)."""
    return 0.5 * (prediction.reshape(target.shape) - target) ** 2


def cross_entropy(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """ℓ = -log softmax(f(x))_y for class index y (stored as a float tensor)."""
    return torch.nn.functional.cross_entropy(prediction, target.long(), reduction="none")


LOSSES = {"half_squared_error": half_squared_error, "cross_entropy": cross_entropy}


def get_loss(name: str):
    """The per-sample loss named ``name`` (a key of :data:`LOSSES`); ValueError if there is none."""
    try:
        return LOSSES[name]
    except KeyError:
        raise ValueError(f"Unknown loss {name!r}. Expected one of {sorted(LOSSES)}.") from None
