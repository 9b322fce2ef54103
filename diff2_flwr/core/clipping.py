"""ClippedMean (Algorithm 2 of DIFF2) for a batch of per-sample vectors.

    ClippedMean(A, C) = (1/#A) * sum_{a in A} a * min(1, C / ||a||)      (a = 0 stays 0)

The scale factor is computed without any ``+ eps``: rows whose norm is at most ``C`` are
multiplied by exactly 1, rows above it by ``C / ||a||``. ``C = inf`` disables clipping and
``C = 0`` maps every row to 0, both exactly.

References:
    Murata & Suzuki (2023), Algorithm 2 (ClippedMean); sensitivity 2C/#A under replace-one.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

__all__ = ["ClippedSum", "clip_rows", "clipped_sum", "clipped_mean"]


class ClippedSum(NamedTuple):
    """Sum of clipped rows, how many rows there were, and how many were scaled down."""

    total: torch.Tensor
    count: int
    clipped: int


def _check_radius(radius: float) -> None:
    if math.isnan(radius) or radius < 0:
        raise ValueError(f"`radius` must be >= 0 (or inf for no clipping). Found {radius}.")


def clip_rows(rows: torch.Tensor, radius: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale each row of ``rows`` (shape [n, d]) onto the ball of radius ``radius``.

    Returns:
        The clipped rows and a boolean mask of the rows that were scaled down.
    """
    _check_radius(radius)
    if rows.ndim != 2:
        raise ValueError(f"`rows` must have shape [n, d]. Found shape {tuple(rows.shape)}.")
    norms = torch.linalg.vector_norm(rows, dim=1)
    over = norms > radius
    if math.isinf(radius) or not bool(over.any()):
        return rows, over
    # Only rows with norm > radius >= 0 are divided, so no division by zero can be selected.
    factor = torch.where(over, radius / torch.where(over, norms, 1.0), 1.0)
    return rows * factor.unsqueeze(1), over


def clipped_sum(rows: torch.Tensor, radius: float) -> ClippedSum:
    """Sum of the clipped rows; the building block of ClippedMean over chunks."""
    clipped, over = clip_rows(rows, radius)
    return ClippedSum(clipped.sum(dim=0), int(rows.shape[0]), int(over.sum()))


def clipped_mean(rows: torch.Tensor, radius: float) -> torch.Tensor:
    """ClippedMean(A, C) of Algorithm 2 for the rows of ``rows``.

    References:
        Murata & Suzuki (2023), Algorithm 2.
    """
    if rows.shape[0] == 0:
        raise ValueError("ClippedMean of an empty set is undefined: the shard has no samples.")
    result = clipped_sum(rows, radius)
    return result.total / result.count
