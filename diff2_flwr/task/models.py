"""Models. The paper's MLP: one hidden layer of 10 softplus units.

Every parameter (weights and biases) of a layer with fan-in w_in is initialised uniformly
in [-1/sqrt(w_in), 1/sqrt(w_in)], from an explicit generator so that x_0 is reproducible.

References:
    Murata & Suzuki (2023), Section 6 (experimental setting); DIFF2.md, "Model".
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["PaperMLP", "build_model"]


class PaperMLP(nn.Module):
    """in_features -> hidden (softplus) -> out_features."""

    def __init__(self, in_features: int, hidden: int = 10, out_features: int = 1, *, init_seed: int = 0) -> None:
        super().__init__()
        self.hidden = nn.Linear(in_features, hidden)
        self.out = nn.Linear(hidden, out_features)
        gen = torch.Generator().manual_seed(init_seed)
        with torch.no_grad():
            for layer in (self.hidden, self.out):
                bound = 1 / math.sqrt(layer.in_features)
                for p in (layer.weight, layer.bias):
                    p.copy_(torch.rand(p.shape, generator=gen, dtype=torch.float64).mul(2 * bound).sub(bound))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(nn.functional.softplus(self.hidden(x)))


def build_model(name: str, *, in_features: int, out_features: int, hidden: int, init_seed: int) -> nn.Module:
    """Build a model by name; float64 parameters."""
    if name == "paper_mlp":
        return PaperMLP(in_features, hidden, out_features, init_seed=init_seed).double()
    raise ValueError(f"Unknown model {name!r}. Expected one of ['paper_mlp'].")
