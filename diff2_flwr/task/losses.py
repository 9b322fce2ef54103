"""Per-sample losses: ``loss(prediction[n, ...], target[n]) -> losses[n]``."""

from __future__ import annotations

import torch

__all__ = ["half_squared_error", "cross_entropy", "get_loss", "LOSSES", "class_label_problem"]


def half_squared_error(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """ℓ = ½ (f(x) - y)², the paper's squared loss (½·MSE when averaged)."""
    return 0.5 * (prediction.reshape(target.shape) - target) ** 2


def cross_entropy(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """ℓ = -log softmax(f(x))_y for class index y (an integer, or a whole number stored as a float:
    the workers check that every target is one, :func:`class_label_problem`, so nothing is
    truncated here)."""
    return torch.nn.functional.cross_entropy(prediction, target.long(), reduction="none")


def class_label_problem(targets: torch.Tensor, classes: int, first: int = 0) -> str | None:
    """Why ``targets`` are not class indices in ``0..classes-1`` (None: they are). ``first`` is the
    index of the first target, for the message.

    A float target must be a whole number: cross-entropy reads it as an index, and 0.5 or 14.23
    would be truncated silently to another class.
    """
    flat = targets.reshape(-1)
    if flat.is_floating_point():
        bad = torch.nonzero(~(torch.isfinite(flat) & (flat == torch.round(flat))))
        if bad.numel():
            i = int(bad[0])
            return (f"target {flat[i].item()!r} of record {first + i}, which is not a whole number "
                    "(a class label is an index, never a fraction)")
    bad = torch.nonzero((flat < 0) | (flat >= classes))
    if bad.numel():
        i = int(bad[0])
        return (f"target {flat[i].item()!r} of record {first + i}, outside 0..{classes - 1} (the "
                f"model has {classes} outputs, one per class)")
    return None


LOSSES = {"half_squared_error": half_squared_error, "cross_entropy": cross_entropy}


def get_loss(name: str):
    """The per-sample loss named ``name`` (a key of :data:`LOSSES`); ValueError if there is none."""
    try:
        return LOSSES[name]
    except KeyError:
        raise ValueError(f"Unknown loss {name!r}. Expected one of {sorted(LOSSES)}.") from None
