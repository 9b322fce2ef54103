"""Parameter layout: one model's parameters as named arrays and as one flat vector.

The server's math works on flat float64 vectors x ∈ R^d; the wire carries one array per
parameter tensor (so shapes can be checked per tensor); torch code wants a name -> tensor
dict. A layout converts between the three in one fixed order.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

__all__ = ["ParameterLayout"]


@dataclass(frozen=True)
class ParameterLayout:
    """Names and shapes of a model's trainable parameters, in ``named_parameters()`` order."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, model: torch.nn.Module) -> "ParameterLayout":
        """The layout of ``model``'s parameters that require gradients (frozen ones left out)."""
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        return cls(tuple(n for n, _ in named), tuple(tuple(p.shape) for _, p in named))

    @functools.cached_property  # immutable: computed once (the wire path asks every message)
    def sizes(self) -> tuple[int, ...]:
        """The number of entries of each tensor, in layout order."""
        return tuple(int(np.prod(s, dtype=np.int64)) for s in self.shapes)

    @functools.cached_property
    def dim(self) -> int:
        """d: the length of the flat vector, every tensor's entries together."""
        return sum(self.sizes)

    def flatten(self, arrays: Sequence[np.ndarray]) -> np.ndarray:
        """Concatenate per-tensor arrays (checked against the layout) into a float64 vector."""
        self.check(arrays)
        if not arrays:
            return np.zeros(0)
        return np.concatenate([np.asarray(a, dtype=np.float64).ravel() for a in arrays])

    def split(self, vector: np.ndarray) -> list[np.ndarray]:
        """The inverse of :meth:`flatten`: per-tensor float64 arrays (copies)."""
        vector = np.asarray(vector, dtype=np.float64)
        if vector.shape != (self.dim,):
            raise ValueError(
                f"Expected a flat vector of shape ({self.dim},). Found {vector.shape}.")
        out, start = [], 0
        for shape, size in zip(self.shapes, self.sizes):
            out.append(vector[start:start + size].reshape(shape).copy())
            start += size
        return out

    def to_torch(self, vector: np.ndarray, dtype: torch.dtype,
                 device: torch.device | None = None) -> dict[str, torch.Tensor]:
        """A name -> tensor dict for ``torch.func.functional_call`` (on ``device``: the CPU by
        default)."""
        return {n: torch.as_tensor(a, dtype=dtype, device=device)
                for n, a in zip(self.names, self.split(vector))}

    def check(self, arrays: Sequence[np.ndarray]) -> None:
        """Raise ValueError unless ``arrays`` has exactly the layout's number of arrays and
        shapes."""
        if len(arrays) != len(self.shapes):
            raise ValueError(
                f"Expected {len(self.shapes)} arrays ({', '.join(self.names)}). Found "
                f"{len(arrays)}.")
        for name, shape, a in zip(self.names, self.shapes, arrays):
            if tuple(np.shape(a)) != shape:
                raise ValueError(
                    f"Array {name!r} must have shape {shape}. Found {tuple(np.shape(a))}.")
