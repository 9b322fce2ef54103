"""ClippedMean (Algorithm 2 of DIFF2) for a batch of per-sample vectors.

    ClippedMean(A, C) = (1/#A) * sum_{a in A} a * min(1, C / ||a||)      (a = 0 stays 0)

The scale factor is computed without any ``+ eps``: rows whose norm is at most ``C`` are
multiplied by exactly 1, rows above it by ``C / ||a||``. ``C = inf`` disables clipping and
``C = 0`` maps every row to 0, both exactly. Row norms are scaled where squaring would underflow or
overflow (:func:`row_norms`): a row of norm 1e-170 is clipped at radius 1e-200, a row of norm 1e200
is clipped rather than read as infinite.

References:
    Murata & Suzuki (2023), Algorithm 2 (ClippedMean); sensitivity 2C/#A under replace-one.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch

__all__ = [
    "NORM_RTOL", "ClippedSum", "clip_factors", "clip_rows", "row_norms", "row_norms_np",
    "scaled_row_norms",
    "RADIUS_FLOOR", "SAFE_NORM_RANGE", "check_radius", "clipped_sum", "clipped_mean",
    "robust_norm", "radius_norm",
    "project_onto_ball", "onto_ball",
]

#: Relative float tolerance on ``norm <= radius`` (float64 rounding of a clipped mean);
#: a norm inside the tolerance is projected back onto the ball, so the bound holds exactly.
NORM_RTOL = 1e-9

# np.linalg.norm squares the entries: its result is exact to float64 rounding when it is finite
# and at least this (no square of a relevant entry underflowed); otherwise scale first.
_SQUARES_SAFE_BELOW = 2.0**-500

#: A norm in [2^-300, 2^300] came from a sum of squares in [2^-600, 2^600]: what underflowed in it
#: is below d·2^-1074, a relative d·2^-474 of it (nothing for any d), and nothing overflowed.
#: Outside, scale first.
SAFE_NORM_RANGE = (2.0**-300, 2.0**300)


class ClippedSum(NamedTuple):
    """Sum of clipped rows, how many rows there were, how many were scaled down, and how many had
    a non-finite norm (an overflowing per-sample gradient: the sum then means nothing)."""

    total: torch.Tensor
    count: int
    clipped: int
    nonfinite: int = 0


#: The smallest positive clipping radius any path takes (2^-900 ≈ 1.2e-271). Below it a clipped
#: entry, and the mean's C/n, come near the subnormal floats, whose rounding is not relative: with
#: C/n subnormal a record's clipped contribution exceeded C by 5x (``diff2 audit --engines``).
#: Far above it for any n < 2^60 (C/n stays a normal float by a factor 2^62).
RADIUS_FLOOR = 2.0**-900


def check_radius(radius: float) -> None:
    """Refuse a radius that is NaN, negative, or positive below :data:`RADIUS_FLOOR` (0 and inf are
    taken: a zero contribution, no clipping)."""
    _check_radius(radius)
    if 0 < radius < RADIUS_FLOOR:
        raise ValueError(
            f"`radius` {radius:.3g} is below {RADIUS_FLOOR:.3g}: clipped values that small round "
            "by more than their size (subnormal floats), so no sensitivity bound holds; the round "
            "releases nothing.")



def _check_radius(radius: float) -> None:
    """The row primitives' check (NaN or negative); the radius floor is the entry points'
    (:func:`check_radius`: the engines, the server's round plan)."""
    if math.isnan(radius) or radius < 0:
        raise ValueError(f"`radius` must be >= 0 (or inf for no clipping). Found {radius}.")


def clip_rows(rows: torch.Tensor, radius: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale each row of ``rows`` (shape [n, d]) onto the ball of radius ``radius``.

    Returns:
        The clipped rows and a boolean mask of the rows that were scaled down.
    """
    clipped, over, _ = _clip_rows(rows, radius)
    return clipped, over


def _clip_rows(rows: torch.Tensor, radius: float) -> tuple[torch.Tensor, torch.Tensor,
                                                           torch.Tensor]:
    _check_radius(radius)
    if rows.ndim != 2:
        raise ValueError(f"`rows` must have shape [n, d]. Found shape {tuple(rows.shape)}.")
    norms = row_norms(rows)
    over = norms > radius
    if math.isinf(radius) or not bool(over.any()):
        return rows, over, norms
    # Only rows with norm > radius >= 0 are divided, so no division by zero can be selected.
    safe = torch.where(over, norms, 1.0)
    factor = torch.where(over, radius / safe, 1.0)
    clipped = rows * factor.unsqueeze(1)
    tiny = over & (factor < torch.finfo(factor.dtype).tiny)
    # C/‖a‖ subnormal: its few bits would overshoot C; onto the unit sphere first, then C
    if bool(tiny.any()):
        clipped = torch.where(tiny.unsqueeze(1), rows / safe.unsqueeze(1) * radius, clipped)
    return clipped, over, norms


def clip_factors(norms: torch.Tensor, radius: float | torch.Tensor) -> torch.Tensor:
    """min(1, C/‖a‖) per norm, never above C/‖a‖: a factor below the smallest normal float (‖a‖ >
    2^1022 C) is subnormal, and rounded to nearest it could exceed C/‖a‖ (a clipped row above C); it
    is taken one step toward 0. Branch-free (it runs inside compiled rounds too); a normal factor is
    exactly ``C / ‖a‖``."""
    over = norms > radius
    c = torch.where(over, radius / torch.where(over, norms, 1.0), 1.0)
    tiny = (c > 0) & (c < torch.finfo(c.dtype).tiny)
    return torch.where(tiny, torch.nextafter(c, torch.zeros_like(c)), c)


def row_norms(rows: torch.Tensor) -> torch.Tensor:
    """Euclidean norm of each row of ``rows`` [n, d], exact to float rounding whatever its
    magnitude.

    ``torch.linalg.vector_norm`` squares the entries unscaled: a row of norm 1e-170 reads 0 (and
    passes any radius unclipped), one of norm 1e200 reads inf. Its result is kept where it lies in
    :data:`SAFE_NORM_RANGE`; the other rows are divided by their largest magnitude first (LAPACK's
    ``dnrm2`` idea, two passes). A row holding NaN stays NaN, one holding inf is inf.
    """
    norms = torch.linalg.vector_norm(rows, dim=1)
    low, high = SAFE_NORM_RANGE
    unsafe = ~((norms >= low) & (norms <= high))  # also 0, inf and NaN
    if not bool(unsafe.any()):
        return norms
    return torch.where(unsafe, scaled_row_norms(rows), norms)


def row_norms_np(rows: np.ndarray) -> np.ndarray:
    """:func:`row_norms` of a float64 array [n, d] in numpy (for small arrays, where a torch call
    costs more than its work): the plain norm where it lies in :data:`SAFE_NORM_RANGE`, elsewhere
    max|row| · ‖row / max|row|‖."""
    norms = np.sqrt(np.einsum("ij,ij->i", rows, rows))
    low, high = SAFE_NORM_RANGE
    unsafe = ~((norms >= low) & (norms <= high))  # also 0, inf and NaN
    if unsafe.any():
        bad = rows[unsafe]
        scale = np.abs(bad).max(axis=1) if bad.shape[1] else np.zeros(bad.shape[0])
        ok = (scale > 0) & np.isfinite(scale)
        safe = np.where(ok, scale, 1.0)
        with np.errstate(invalid="ignore"):
            unit = bad / safe[:, None]
            scaled = safe * np.sqrt(np.einsum("ij,ij->i", unit, unit))
        norms[unsafe] = np.where(ok, scaled, scale)
    return norms


def scaled_row_norms(rows: torch.Tensor) -> torch.Tensor:
    """Row norms of ``rows`` [n, d] as max|row| · ‖row / max|row|‖: no square underflows or
    overflows that matters (entries below 2^-1074 of the largest are lost: a relative d·2^-1074 at
    most)."""
    scale = rows.abs().amax(dim=1) if rows.shape[1] else rows.new_zeros(rows.shape[0])
    ok = (scale > 0) & torch.isfinite(scale)
    safe = torch.where(ok, scale, 1.0)
    return torch.where(ok, safe * torch.linalg.vector_norm(rows / safe.unsqueeze(1), dim=1), scale)


def clipped_sum(rows: torch.Tensor, radius: float) -> ClippedSum:
    """Sum of the clipped rows; the building block of ClippedMean over chunks."""
    clipped, over, norms = _clip_rows(rows, radius)
    nonfinite = int((~torch.isfinite(norms)).sum())
    return ClippedSum(clipped.sum(dim=0), int(rows.shape[0]), int(over.sum()), nonfinite)


def clipped_mean(rows: torch.Tensor, radius: float) -> torch.Tensor:
    """ClippedMean(A, C) of Algorithm 2 for the rows of ``rows``.

    References:
        Murata & Suzuki (2023), Algorithm 2.
    """
    if rows.shape[0] == 0:
        raise ValueError("ClippedMean of an empty set is undefined: the shard has no samples.")
    result = clipped_sum(rows, radius)
    return result.total / result.count


def robust_norm(flat: np.ndarray) -> float:
    """Euclidean norm without underflow or overflow: ``np.linalg.norm`` squares the entries, so a
    contribution of 1e-300 would read as norm 0 and pass a zero radius. Scaled by the largest
    entry."""
    scale = float(np.max(np.abs(flat))) if flat.size else 0.0
    if scale == 0.0 or not math.isfinite(scale):
        return scale
    return scale * float(np.linalg.norm(flat / scale))


def radius_norm(flat: np.ndarray) -> float:
    """The norm that sets a difference round's radius, ‖x_{r-1} - x_{r-2}‖, on every engine.

    ``np.linalg.norm`` wherever it is exact to float64 rounding (finite, and no relevant square
    underflowed), else :func:`robust_norm`: finite for every finite vector (≈ 1e154 would overflow
    the squares), and not 0 for a tiny non-zero one.
    """
    with np.errstate(over="ignore", under="ignore"):
        norm = float(np.linalg.norm(flat))
    if math.isfinite(norm) and (norm >= _SQUARES_SAFE_BELOW or norm == 0.0 and not np.any(flat)):
        return norm
    return robust_norm(flat)


def project_onto_ball(flat: np.ndarray, radius: float, norm: float) -> np.ndarray:
    """Scale ``flat`` (of norm ``norm`` > ``radius``) onto the ball of ``radius`` so that its
    float64 norm is <= radius exactly, by either way of computing it."""
    factor = radius / norm
    projected = flat * factor
    # rounding can leave it 1 ulp outside (by either way of computing the norm)
    while max(robust_norm(projected), float(np.linalg.norm(projected))) > radius:
        factor = np.nextafter(factor, 0.0)
        projected = flat * factor
    return projected


def onto_ball(mean: np.ndarray, radius: float) -> np.ndarray:
    """A worker's last step: a ClippedMean whose norm exceeds ``radius`` by float rounding only
    (at most :data:`NORM_RTOL` relative) is projected onto the ball, exactly as the server would,
    so that the contribution's norm is <= radius with no tolerance. Projection onto a ball is
    1-Lipschitz, so it cannot raise the sensitivity. A larger excess is a clipping bug: it is left
    for the server's norm check to name."""
    if math.isinf(radius):
        return mean
    # The server's norm is robust_norm; np.linalg.norm may read 1 ulp higher. Both must be <=
    # radius. (When robust_norm exceeds, this is bit for bit the projection the server would make.)
    norm = robust_norm(mean)
    if norm <= radius:
        norm = float(np.linalg.norm(mean))
    if radius < norm <= radius * (1 + NORM_RTOL):
        return project_onto_ball(mean, radius, norm)
    return mean
