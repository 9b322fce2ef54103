"""Clipped means of per-sample gradients without materialising them, for the paper's MLP.

For f(a) = w2 · φ(W1 a + b1) + b2 with an elementwise activation φ and the loss ½ (f(a) - y)²,
one sample's gradient is, with h = W1 a + b1, s = φ(h), e = f(a) - y and δ = e · w2 ⊙ φ'(h):

    ∂b2 = e,   ∂w2 = e s,   ∂b1 = δ,   ∂W1 = δ aᵀ   (an outer product)

so its squared norm is e² + ‖e s‖² + ‖δ‖² (1 + ‖a‖²), and the clipped sum over samples is
((c ⊙ δ)ᵀ A, Σ c δ, Σ c e s, Σ c e) with c_i = min(1, C / norm_i) — no n × d tensor ("ghost
clipping"). The difference of two iterates' gradients keeps the same input a, so it is again
(Δe, Δ(e s), Δδ, Δδ aᵀ) with squared norm Δe² + ‖Δ(e s)‖² + ‖Δδ‖² (1 + ‖a‖²). A sum of non-negative
terms: nothing cancels. Where squaring could underflow or overflow (a norm outside
:data:`~diff2_flwr.core.clipping.SAFE_NORM_RANGE`, or ‖a‖² > 2^400, which could lift an underflowed
‖Δδ‖² back into view) the norm is taken again by scaling: ‖(Δe, Δ(e s))‖ and ‖Δδ‖ ‖(a, 1)‖ each by
:func:`~diff2_flwr.core.clipping.scaled_row_norms`, joined by ``hypot``.

The result equals :class:`~diff2_flwr.core.gradients.PerSampleGradients` (the generic
``torch.func`` path) up to float rounding; tests check both against each other.

References:
    Murata & Suzuki (2023), Algorithm 1 (worker lines), Algorithm 2 (ClippedMean).
    Goodfellow (2015), "Efficient per-example gradient computations"; Li et al. (2022),
    "Large language models can be strong differentially private learners" (ghost clipping).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import numpy as np
import torch

from .clipping import (
    SAFE_NORM_RANGE, check_radius, clip_factors, gamma, scaled_row_norms, upper_norms,
)
from .gradients import Contribution, finish_contribution
from .layout import ParameterLayout

__all__ = ["MLPParts", "PaperMLPGradients", "norm_error", "softplus_with_derivative"]

_SOFTPLUS_THRESHOLD = 20.0  # as torch.nn.functional.softplus: linear above it


def softplus_with_derivative(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """softplus(h) and its derivative, matching ``torch.nn.functional.softplus`` and its autograd
    (linear above the threshold 20), from one exp(-|h|): two transcendentals, not three."""
    t = torch.exp(-h.abs())
    linear = h > _SOFTPLUS_THRESHOLD
    s = torch.where(linear, h, h.clamp(min=0) + torch.log1p(t))
    deriv = torch.where(linear, 1.0, torch.where(h >= 0, 1 / (1 + t), t / (1 + t)))
    return s, deriv


@dataclass(frozen=True)
class MLPParts:
    """Per-sample quantities of one iterate: s = φ(h), residual e, and δ = e · w2 ⊙ φ'(h)."""

    s: torch.Tensor  # [n, hidden]
    e: torch.Tensor  # [n]
    delta: torch.Tensor  # [n, hidden]


def _norms(features: torch.Tensor, sq_norm_a: torch.Tensor, ge: torch.Tensor, gs: torch.Tensor,
           gd: torch.Tensor) -> torch.Tensor:
    """Per-sample norms of the gradients (ge, gs, gd, gd aᵀ), float64: squared and summed where that
    is exact to rounding, scaled elsewhere (see the module's docstring)."""
    norms = torch.sqrt(ge * ge + (gs * gs).sum(1) + (gd * gd).sum(1) * (1 + sq_norm_a))
    low, high = SAFE_NORM_RANGE
    unsafe = ~((norms >= low) & (norms <= high)) | (sq_norm_a > 2.0**400)
    if not bool(unsafe.any()):
        return norms
    idx = torch.nonzero(unsafe).flatten()
    a1 = torch.cat([features[idx], features.new_ones(len(idx), 1)], dim=1)
    outer = scaled_row_norms(torch.cat([ge[idx].unsqueeze(1), gs[idx]], dim=1))
    safe = torch.hypot(outer, scaled_row_norms(gd[idx]) * scaled_row_norms(a1))
    return norms.index_put((idx,), safe)


def norm_error(hidden: int, features: int) -> float:
    """Relative error bound of :func:`_norms` in float64 for a hidden width and an input width, with
    the rounding of c·∂b1 in the sums on top: every term is a non-negative sum (γ_hidden, and
    γ_(features+1) for 1 + ‖a‖²), a product, three additions and a square root — or, where scaled,
    two scaled row norms, a product and ``hypot``. The true norm of the row the sums add is at most
    N̂ (1 + this)."""
    return gamma(hidden + features + 10)


class PaperMLPGradients:
    """Closed-form ClippedMean for :class:`~diff2_flwr.task.models.PaperMLP` with ½-squared loss.

    Same interface as :meth:`PerSampleGradients.clipped_mean`.
    """

    def __init__(self, layout: ParameterLayout, *, dtype: torch.dtype = torch.float64) -> None:
        shapes = layout.shapes
        if len(shapes) != 4 or len(shapes[0]) != 2 or shapes[2] != (1, shapes[0][0]) or shapes[
            3] != (1,):
            raise ValueError(
                f"The closed form needs the paper MLP layout (W1, b1, w2[1, h], b2[1]). Found "
                f"{shapes}.")
        self.layout = layout
        self.dtype = dtype
        self.hidden, self.in_features = shapes[0]

    def unpack(self, x_vec: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                 torch.Tensor]:
        """(W1, b1, w2, b2) of the flat vector ``x_vec`` in the compute dtype (w2 flat, b2 0-d)."""
        w1, b1, w2, b2 = (torch.as_tensor(a, dtype=self.dtype) for a in self.layout.split(x_vec))
        return w1, b1, w2.reshape(-1), b2.reshape(())

    def parts(self, x_vec: np.ndarray, features: torch.Tensor, targets: torch.Tensor) -> MLPParts:
        """Per-sample quantities at ``x_vec``, computed in the compute dtype and returned in
        float64."""
        w1, b1, w2, b2 = self.unpack(x_vec)
        h = torch.addmm(b1, features, w1.T)
        s, ds = softplus_with_derivative(h)
        e = s @ w2 + b2 - targets
        f64 = torch.float64
        return MLPParts(s=s.to(f64), e=e.to(f64), delta=(e.unsqueeze(1) * w2 * ds).to(f64))

    def clipped_sum_of(
        self, features: torch.Tensor, sq_norm_a: torch.Tensor, ge: torch.Tensor, gs: torch.Tensor,
        gd: torch.Tensor, radius: float,
    ) -> tuple[torch.Tensor, int, int]:
        """Clipped sum of the per-sample gradients given by (∂b2, ∂w2, ∂b1) = (ge, gs, gd), ∂W1 = gd
        aᵀ, how many were clipped, and how many had a non-finite norm.

        All of it in float64 (inputs are float64). The factor of a row is C over an upper bound of
        its true norm (:func:`norm_error`), rounded down: no clipped row exceeds the radius.
        """
        norms = _norms(features, sq_norm_a, ge, gs, gd)
        nonfinite = int((~torch.isfinite(norms)).sum())
        if math.isinf(radius):
            c = torch.ones_like(norms)
            clipped = 0
        else:
            over = norms > radius
            c = clip_factors(upper_norms(norms, norm_error(gs.shape[1], features.shape[1])),
                             radius)
            clipped = int(over.sum())
        cd = gd * c.unsqueeze(1)
        total = torch.cat([(cd.T @ features).reshape(-1), cd.sum(0), (gs * c.unsqueeze(1)).sum(0),
                           (ge * c).sum(0, keepdim=True)])
        return total, clipped, nonfinite

    def _clipped_sum(self, x_current: np.ndarray, features: torch.Tensor, targets: torch.Tensor,
                     radius: float, x_previous: np.ndarray | None) -> tuple[torch.Tensor, int, int]:
        """Clipped sum over these samples of the gradients at ``x_current`` (or of the differences
        with ``x_previous``), how many were clipped, how many had a non-finite norm."""
        cur = self.parts(x_current, features, targets)
        ge, gs, gd = cur.e, cur.e.unsqueeze(1) * cur.s, cur.delta
        if x_previous is not None:
            prev = self.parts(x_previous, features, targets)
            ge, gs, gd = ge - prev.e, gs - prev.e.unsqueeze(1) * prev.s, gd - prev.delta
        a = features.to(torch.float64)  # float32 -> float64 is exact
        return self.clipped_sum_of(a, (a * a).sum(1), ge, gs, gd, radius)

    def clipped_mean(
        self, x_current: np.ndarray, features: torch.Tensor, targets: torch.Tensor, radius: float,
        x_previous: np.ndarray | None = None,
    ) -> Contribution:
        """ClippedMean of the closed-form per-sample gradients at ``x_current`` (or differences).

        Same arguments and result as :meth:`PerSampleGradients.clipped_mean`; an empty shard or a
        radius that is NaN or < 0 raises ValueError.
        """
        n = int(features.shape[0])
        if n == 0:
            raise ValueError(
                "The shard is empty: a worker with no samples cannot compute a ClippedMean.")
        check_radius(radius)
        total, clipped, nonfinite = self._clipped_sum(x_current, features, targets, radius,
                                                      x_previous)
        return finish_contribution((total / n).numpy(), n, clipped, nonfinite, radius)

    def clipped_mean_of(
        self, x_current: np.ndarray, chunks: Iterable[tuple[torch.Tensor, torch.Tensor]],
        radius: float, x_previous: np.ndarray | None = None,
    ) -> Contribution:
        """:meth:`clipped_mean` over a shard given as chunks of (features, targets), read once, in
        order (equal to it up to the order of the sums' rounding); n is the number of samples
        read."""
        check_radius(radius)
        total = torch.zeros(self.layout.dim, dtype=torch.float64)
        n = clipped = nonfinite = 0
        for xc, yc in chunks:
            if xc.shape[0] == 0:
                continue
            part, c, bad = self._clipped_sum(x_current, xc, yc, radius, x_previous)
            total += part
            clipped += c
            nonfinite += bad
            n += int(xc.shape[0])
        if n == 0:
            raise ValueError(
                "The shard is empty: a worker with no samples cannot compute a ClippedMean.")
        return finish_contribution((total / n).numpy(), n, clipped, nonfinite, radius)
