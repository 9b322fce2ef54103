"""Routines: how an iterate is updated from the released estimator ṽ_r.

A routine is a pair of pure functions in the style of optax: ``init(x0) -> state`` and
``update(x, v, state) -> (x_new, state)``. A routine only post-processes the released ṽ_r,
so it costs no privacy (post-processing); momentum, Adam or BVR-L-SGD later implement the
same interface.

References:
    Murata & Suzuki (2023), Algorithm 3 (GD-Routine): x_r = x_{r-1} - η ṽ_r.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

__all__ = ["Routine", "GD", "make_routine"]


class Routine(Protocol):
    """Update rule x_r = Routine(x_{r-1}, ṽ_r)."""

    name: str

    def init(self, x0: np.ndarray) -> Any:
        """Return the routine's initial state for iterate ``x0``."""
        ...

    def update(self, x: np.ndarray, v: np.ndarray, state: Any) -> tuple[np.ndarray, Any]:
        """Return the next iterate and the next routine state."""
        ...


@dataclass(frozen=True)
class GD:
    """Plain gradient step with a fixed learning rate (Algorithm 3)."""

    learning_rate: float
    name: str = "gd"

    def __post_init__(self) -> None:
        if not (math.isfinite(self.learning_rate) and self.learning_rate > 0):
            raise ValueError(f"`learning_rate` must be a finite number > 0. Found {self.learning_rate}.")

    def init(self, x0: np.ndarray) -> None:
        return None

    def update(self, x: np.ndarray, v: np.ndarray, state: None) -> tuple[np.ndarray, None]:
        return x - self.learning_rate * v, None


_ROUTINES = {"gd": GD}


def make_routine(name: str, **kwargs: float) -> Routine:
    """Build a routine by name (``gd``)."""
    try:
        cls = _ROUTINES[name]
    except KeyError:
        raise ValueError(f"Unknown routine {name!r}. Expected one of {sorted(_ROUTINES)}.") from None
    return cls(**kwargs)
