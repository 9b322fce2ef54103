"""Exact oracles for clipping tests: a float row's squared norm as a Fraction (every float is a
dyadic rational, so the sum of squares is exact), and whether a row is inside a ball — with no
rounding anywhere, so a test that asks "is the true norm <= C" cannot be fooled by the norm it
uses to check."""

from __future__ import annotations

from fractions import Fraction
from typing import Iterable

import numpy as np


def sq_norm(values: Iterable[float]) -> Fraction:
    """Σ v² exactly."""
    total = Fraction(0)
    for v in np.asarray(values, dtype=np.float64).ravel().tolist():
        f = Fraction(v)
        total += f * f
    return total


def inside(values: Iterable[float], radius: float) -> bool:
    """Whether the exact norm of ``values`` is <= ``radius``."""
    r = Fraction(radius)
    return sq_norm(values) <= r * r


def rank_two_sq_norm(g: np.ndarray, a: np.ndarray, gp: np.ndarray | None = None,
                     da: np.ndarray | None = None, c: float = 1.0) -> Fraction:
    """‖c (g aᵀ + g' daᵀ)‖² exactly (the matrix written out in Fractions; g, a, g', da float)."""
    cf = Fraction(float(c))
    gF = [Fraction(v) for v in np.asarray(g, dtype=np.float64).tolist()]
    aF = [Fraction(v) for v in np.asarray(a, dtype=np.float64).tolist()]
    if gp is None or da is None:
        return cf * cf * sum(x * x for x in gF) * sum(x * x for x in aF)
    gpF = [Fraction(v) for v in np.asarray(gp, dtype=np.float64).tolist()]
    daF = [Fraction(v) for v in np.asarray(da, dtype=np.float64).tolist()]
    total = Fraction(0)
    for gi, gpi in zip(gF, gpF):
        for aj, daj in zip(aF, daF):
            m = gi * aj + gpi * daj
            total += m * m
    return cf * cf * total
