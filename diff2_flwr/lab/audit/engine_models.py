"""The small real models the engine audit (:mod:`.engines`) attacks: one per rule of the ghost
engine (:mod:`~diff2_flwr.core.ghost_layers`) and one whose parameters only its ``torch.func``
fallback covers, each with a per-record weighted ½-squared-error loss and benign records.

The loss is ``w·½‖f(x) − y‖²`` with the weight w the target's last column: a weight of −1 makes a
record's gradient (difference) the exact negative of the same record's with weight 1, bit for bit
in any dtype (rounding to nearest is symmetric), and a weight of 0 makes it exactly zero. The
engine audit builds its neighbours from that: D holds the attacked record, D′ the same record with
its weight negated (the replace-one worst case: its clipped contribution moves by twice the
radius), D⁰ a null record (its clipped contribution is 0, so ``n·(mean(D) − mean(D⁰))`` is the
attacked record's own clipped contribution as the engine summed it).

References:
    Murata & Suzuki (2023), Algorithm 2 (ClippedMean; sensitivity 2C/#A under replace-one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch import nn

__all__ = ["MODELS", "PADDING", "VOCAB", "ModelKind", "weighted_half_squared_error"]

#: Token ids of the token models: 0 .. VOCAB - 1.
VOCAB = 20
#: The embedding model's ``padding_idx`` (for the attention model, a token like any other).
PADDING = 0


def weighted_half_squared_error(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """ℓ = w·½‖f(x) − y‖² per record: ``target`` [n, k + 1] holds y (k outputs) and the weight w."""
    y, w = target[:, :-1], target[:, -1]
    return w * 0.5 * ((output.reshape(output.shape[0], -1) - y) ** 2).sum(1)


class _Sequence(nn.Module):
    """Linear layers on [n, T, in] (T = 3: the middle layer takes the Gram form at both round
    kinds), mean over positions, a Linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.mid, self.head = nn.Linear(8, 64), nn.Linear(64, 64), nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[n, T, 8] -> [n, 1]."""
        return self.head(torch.tanh(self.mid(torch.tanh(self.inp(x)))).mean(1))


class _Conv1d(nn.Module):
    """Conv1d (zero padding 1) over 12 positions, then a Linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.head = nn.Conv1d(2, 8, 3, padding=1), nn.Linear(8 * 12, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[n, 2, 12] -> [n, 1]."""
        return self.head(torch.tanh(self.conv(x)).flatten(1))


class _Conv2d(nn.Module):
    """Conv2d (padding 1), GroupNorm, a strided Conv2d, a Linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.norm = nn.Conv2d(1, 4, 3, padding=1), nn.GroupNorm(2, 4)
        self.conv2, self.head = nn.Conv2d(4, 6, 3, stride=2), nn.Linear(6 * 2 * 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[n, 1, 6, 6] -> [n, 1]."""
        h = torch.tanh(self.norm(self.conv1(x)))
        return self.head(torch.tanh(self.conv2(h)).flatten(1))


class _Embedding(nn.Module):
    """Embedding with ``padding_idx`` 0, LayerNorm, mean over tokens, a Linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.norm = nn.Embedding(VOCAB, 16, padding_idx=PADDING), nn.LayerNorm(16)
        self.head = nn.Linear(16, 1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """[n, T] token ids -> [n, 1]."""
        return self.head(self.norm(self.emb(tokens)).mean(1))


class _Attention(nn.Module):
    """One self-attention block built from Linear layers (q, k, v, o), a residual and LayerNorm, on
    embedded tokens (batch first)."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, width)
        self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, 1)
        self.scale = 1 / math.sqrt(width)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """[n, T] token ids -> [n, 1]."""
        h = self.emb(tokens)
        weights = torch.softmax(self.q(h) @ self.k(h).transpose(1, 2) * self.scale, dim=-1)
        h = self.norm(h + self.o(weights @ self.v(h)))
        return self.head(h.mean(1))


class _Fallback(nn.Module):
    """PReLU and ``nn.MultiheadAttention`` (their parameters: the ``torch.func`` fallback) between
    Linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.act = nn.Linear(8, 16), nn.PReLU(16)
        self.mha, self.head = nn.MultiheadAttention(16, 2, batch_first=True), nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[n, T, 8] -> [n, 1]."""
        h = self.act(self.inp(x).transpose(1, 2)).transpose(1, 2)
        return self.head(self.mha(h, h, h, need_weights=False)[0].mean(1))


class _MLP(nn.Module):
    """Linear layers on [n, in], the middle one called twice (its calls' positions joined: P = 2
    at a restart, 4 at a difference round, still the Gram form)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.mid, self.head = nn.Linear(6, 32), nn.Linear(32, 32), nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[n, 6] -> [n, 1]."""
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.mid(h))
        return self.head(torch.tanh(self.mid(h) + h))


def _normal(*shape: int) -> Callable[[np.random.Generator, int], np.ndarray]:
    return lambda rng, n: rng.normal(size=(n, *shape))


def _tokens(length: int) -> Callable[[np.random.Generator, int], np.ndarray]:
    # about one token in five is the padding id
    return lambda rng, n: np.where(rng.random((n, length)) < 0.2, PADDING,
                                   rng.integers(1, VOCAB, size=(n, length)))


@dataclass(frozen=True)
class ModelKind:
    """One audited model: how to build it, its benign features, and what it exercises. Its last
    parameter is its head's bias (the engine audit's "near, last coordinate" round moves it)."""

    build: Callable[[], nn.Module]
    features: Callable[[np.random.Generator, int], np.ndarray]
    exercises: str
    #: its features are token ids (no input scaling, no infinite input)
    tokens: bool = False

    def records(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        """n benign records: features, and targets [n, 2] (y ~ N(0, 1), weight 1)."""
        return self.features(rng, n), np.c_[rng.normal(size=(n, 1)), np.ones(n)]

    def model(self, seed: int) -> nn.Module:
        """The model with parameters drawn from ``seed`` (torch's global generator left as it
        was)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return self.build()


#: name -> the model, its records and the rules it exercises.
MODELS = {
    "linear": ModelKind(_MLP, _normal(6), "Linear on [n, in], one called twice (Gram form)"),
    "sequence": ModelKind(_Sequence, _normal(3, 8),
                          "Linear on [n, T, in] (Gram form and materialised rows)"),
    "conv1d": ModelKind(_Conv1d, _normal(2, 12), "Conv1d (zero padding), Linear"),
    "conv2d": ModelKind(_Conv2d, _normal(1, 6, 6), "Conv2d (padding, stride), GroupNorm"),
    "embedding": ModelKind(_Embedding, _tokens(5),
                           "Embedding (padding_idx), LayerNorm, Linear", tokens=True),
    "attention": ModelKind(_Attention, _tokens(6),
                           "Embedding, q/k/v/o Linear on [n, T, d], LayerNorm", tokens=True),
    "fallback": ModelKind(_Fallback, _normal(4, 8),
                          "PReLU and nn.MultiheadAttention (torch.func fallback), Linear"),
}
