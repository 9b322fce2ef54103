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
    "gamma", "row_norm_error", "unit_roundoff", "upper_norms",
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


def unit_roundoff(dtype: torch.dtype) -> float:
    """u of a float dtype: the largest relative error of one rounding to nearest (2^-53 for
    float64, 2^-24 for float32)."""
    return torch.finfo(dtype).eps / 2


def gamma(k: int, u: float = 2.0**-53) -> float:
    """γ_k(u) = k·u / (1 - k·u) (Higham, *Accuracy and Stability of Numerical Algorithms*, §3.1),
    rounded up: a sum of k products (or of k + 1 terms) in any order has absolute error at most
    γ_k · Σ|terms|, and a product of k factors (1 + δ_i), |δ_i| ≤ u, lies within 1 ± γ_k. Refuses
    k·u ≥ 1/2, where no such bound is useful."""
    if k < 0 or k * u >= 0.5:
        raise ValueError(f"γ_k needs 0 <= k·u < 1/2. Found k = {k}, u = {u:.3g}.")
    return math.nextafter(k * u / (1 - k * u), math.inf) if k else 0.0


def upper_norms(norms: torch.Tensor, rel: float | torch.Tensor,
                extra: torch.Tensor | float = 0.0) -> torch.Tensor:
    """``norms`` · (1 + ``rel``) + ``extra``, each operation rounded upward (to nearest, then one
    step up): an upper bound of a true norm that lies within a relative ``rel`` and an absolute
    ``extra`` of the computed ``norms``. Branch-free; float64.

    What underflowed inside a norm is relative too on every path: norms whose squares could lose
    anything that matters are taken again by scaling (:data:`SAFE_NORM_RANGE`), and what the safe
    range lets underflow is below 2^-400 of the result, far inside any ``rel`` a path passes."""
    up = torch.tensor(math.inf, dtype=norms.dtype, device=norms.device)
    one = torch.nextafter(1 + torch.as_tensor(rel, dtype=norms.dtype, device=norms.device), up)
    hi = norms * one
    if not (isinstance(extra, float) and extra == 0.0):
        hi = torch.nextafter(hi, up) + extra
    return torch.where(hi > 0, torch.nextafter(hi, up), hi)  # 0 · (1 + rel) is exactly 0


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
    upper = upper_norms(norms.to(torch.float64), row_norm_error(rows.shape[1], rows.dtype))
    over = norms > radius  # what is counted as clipped: the computed norm's view
    scaled = upper > radius  # what is scaled: the bound's
    if math.isinf(radius) or not bool(scaled.any()):
        return rows, over, norms
    factor = clip_factors(upper, radius)  # float64, <= C / upper
    low = factor.to(rows.dtype)  # rounded down into the rows' dtype: never above C / upper
    low = torch.where(low.to(torch.float64) > factor, torch.nextafter(low, torch.zeros_like(low)),
                      low)
    clipped = rows * low.unsqueeze(1)
    tiny = scaled & (factor < torch.finfo(rows.dtype).tiny) & (radius > 0)
    # C/N subnormal in the rows' dtype (few bits): the row divided by N first, then times C
    if bool(tiny.any()):
        safe = torch.where(tiny, upper, 1.0).to(rows.dtype)
        clipped = torch.where(tiny.unsqueeze(1), rows / safe.unsqueeze(1) * radius, clipped)
    return clipped, over, norms


def row_norm_error(width: int, dtype: torch.dtype) -> float:
    """The relative error bound of :func:`row_norms` of rows of ``width`` entries in ``dtype``, with
    the rounding of the clipped row (the row times its factor) on top: a sum of ``width`` squares
    (γ_width), its square root, the scaling by max|row| and back, the product by the factor. The
    true norm of a clipped row c·a is then at most c · N̂ · (1 + this)."""
    return gamma(width + 6, unit_roundoff(dtype))


def clip_factors(upper: torch.Tensor, radius: float | torch.Tensor) -> torch.Tensor:
    """min(1, C/N) per upper bound N of a row's true norm (:func:`upper_norms`), never above C/N:
    1 where N <= C, else C/N rounded to nearest and then one step toward 0 (the float just below a
    rounded-up quotient is below the exact one, subnormal factors included). A row with true norm
    ‖a‖ <= N then has ‖c·a‖ <= C exactly. Branch-free (it runs inside compiled rounds too)."""
    over = upper > radius
    c = torch.where(over, radius / torch.where(over, upper, 1.0), 1.0)
    return torch.where(over, torch.nextafter(c, torch.zeros_like(c)), c)


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
    """Scale ``flat`` (of norm ``norm`` > ``radius``) onto the ball of ``radius`` so that its exact
    norm is <= radius: both ways of computing its float64 norm, raised by their rounding-error bound
    (γ_(d+4), :func:`gamma`), are <= radius — so each computed norm is too, and so is the true one
    (a computed norm alone can be an ulp below it)."""
    rel = gamma(flat.size + 4)
    factor = radius / (norm * (1 + 2 * rel))
    projected = flat * factor
    while max(robust_norm(projected), float(np.linalg.norm(projected))) * (1 + 2 * rel) > radius:
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
