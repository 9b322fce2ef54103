"""Per-sample losses: ``loss(prediction[n, ...], target[n]) -> losses[n]``."""

from __future__ import annotations

import torch

__all__ = ["half_squared_error", "get_loss", "LOSSES"]


def half_squared_error(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """ℓ = ½ (f(x) - y)², the paper's squared loss (½·MSE when averaged)."""
    return 0.5 * (prediction.reshape(target.shape) - target) ** 2


LOSSES = {"half_squared_error": half_squared_error}


def get_loss(name: str):
    try:
        return LOSSES[name]
    except KeyError:
        raise ValueError(f"Unknown loss {name!r}. Expected one of {sorted(LOSSES)}.") from None
