"""The small real models the engine audit (:mod:`.engines`) attacks: one per rule of the ghost
engine (:mod:`~diff2_flwr.core.ghost_layers`) and one whose parameters only its ``torch.func``
fallback covers, each with a per-record weighted ½-squared-error loss and benign records; and the
batched engine's (:mod:`diff2_flwr.lab.backend`): the paper MLP at two widths
(:data:`BATCH_MODELS`), with its float32-accumulation window (:func:`float32_window`).

The loss is ``w·½‖f(x) − y‖²`` with the weight w the target's last column: a weight of −1 makes a
record's gradient (difference) the exact negative of the same record's with weight 1, bit for bit
in any dtype (rounding to nearest is symmetric), and a weight of 0 makes it exactly zero. The
engine audit builds its neighbours from that: D holds the attacked record, D′ the same record with
its weight negated (the replace-one worst case: its clipped contribution moves by twice the
radius), D⁰ a null record (its clipped contribution is 0, so ``n·(mean(D) − mean(D⁰))`` is the
attacked record's own clipped contribution as the engine summed it).

The batched engine runs MLPs with an unweighted loss, so it has no weight to negate: its neighbour
of a record (x, y) is the record reflected through the model's output at the round's first
iterate, (x, 2 f(x₁; x) − y), whose residual f − y, hence whose gradient (f − y) ∇f, is the exact
negative at x₁ (to the compute dtype's rounding of f); its null record is no record (a client of n −
1, padded).

References:
    Murata & Suzuki (2023), Algorithm 2 (ClippedMean; sensitivity 2C/#A under replace-one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np
import torch
from torch import nn

from ...core.fused import FLUSH, PRODUCT_BLOCK
from ...core.ghost import MLP
from ...task.models import PaperMLP
from ..backend import KERNEL_W1_FEATURES

__all__ = ["BATCH_MODELS", "MODELS", "PADDING", "VOCAB", "WINDOW_INPUT", "WINDOW_MARGIN",
           "BatchModelKind", "ModelKind", "Window", "float32_window", "mlp_outputs", "mlp_rows",
           "weighted_half_squared_error"]

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


# ------------------------------------------------------------------ the batched engine's models


@dataclass(frozen=True)
class BatchModelKind:
    """One model of the batched engine: the paper MLP F -> ``hidden`` (softplus) -> 1 with
    ½-squared error (:class:`~diff2_flwr.task.models.PaperMLP`, as studies run it), its benign
    records and what it exercises."""

    features: int
    exercises: str
    hidden: int = 10

    def mlp(self) -> MLP:
        """Its shape, as :func:`~diff2_flwr.lab.sweep.batch_model` gives it to the engine."""
        return MLP((self.features, self.hidden, 1), ("softplus",), "half_squared_error")

    def iterate(self, seed: int) -> np.ndarray:
        """x₁: the paper MLP's initial parameters for ``seed`` (flat float64, (W_1, b_1, W_2,
        b_2))."""
        net = PaperMLP(self.features, self.hidden, 1, init_seed=seed)
        return np.concatenate([p.detach().double().reshape(-1).numpy() for p in net.parameters()])

    def records(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        """n benign records: features [n, F] ~ N(0, 1), targets [n] ~ N(0, 1)."""
        return rng.normal(size=(n, self.features)), rng.normal(size=n)


#: name -> the batched engine's model. 8 features: California Housing's width (the kernel's own
#: forward pass and W_1's sums in its lanes); 118: KDD Cup 99's (over backend.KERNEL_W1_FEATURES:
#: torch's forward, W_1's sums by a float64 product, or by the kernel's float32 block products).
BATCH_MODELS = {
    "paper_mlp_8": BatchModelKind(8, "paper MLP 8 -> 10 -> 1: the kernel's forward, W_1's sums in "
                                     "its lanes"),
    "paper_mlp_118": BatchModelKind(118, "paper MLP 118 -> 10 -> 1: torch's forward, W_1's sums by "
                                         "products (float32: the kernel's block products)"),
}


def mlp_outputs(mlp: MLP, x: np.ndarray, features: np.ndarray) -> np.ndarray:
    """f(x; features) [n] of a one-hidden-layer softplus MLP, in float64 (numpy)."""
    F, H, _ = mlp.sizes
    w1, b1 = x[:H * F].reshape(H, F), x[H * F:H * F + H]
    w2, b2 = x[H * F + H:H * F + 2 * H], x[-1]
    with np.errstate(all="ignore"):
        return np.logaddexp(0.0, features @ w1.T + b1) @ w2 + b2


def mlp_rows(mlp: MLP, x: np.ndarray, features: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """The per-sample gradients [n, d] of ½(f − y)² in float64 (numpy): (f − y) ∇f, ∇f = (W_2 ⊙
    σ(h) ⊗ features, W_2 ⊙ σ(h), softplus(h), 1)."""
    F, H, _ = mlp.sizes
    w1, b1 = x[:H * F].reshape(H, F), x[H * F:H * F + H]
    w2 = x[H * F + H:H * F + 2 * H]
    with np.errstate(all="ignore"):
        h = features @ w1.T + b1
        residual = mlp_outputs(mlp, x, features) - targets
        g1 = residual[:, None] * w2 * (1 / (1 + np.exp(-h)))
        return np.concatenate([(g1[:, :, None] * features[:, None, :]).reshape(len(h), -1), g1,
                               residual[:, None] * np.logaddexp(0.0, h), residual[:, None]], axis=1)


#: The float32 window: the first input of its records (a power of two, so that W_1's terms are the
#: output gradient's times a power of two, rounded alike), and how far below the radius the records'
#: norm is (their clip factor is exactly 1 at a radius C' >= C (1 − 2^-22): the float32 terms are
#: the crafted values, bit for bit, when nothing shrinks the radius).
WINDOW_INPUT = 64.0
WINDOW_MARGIN = 2.0**-22


class Window(NamedTuple):
    """The float32 window attack: the iterate x₁ [d] (float64) and the records of D (features [n,
    F], targets [n]; the attacked one last)."""

    iterate: np.ndarray
    features: np.ndarray
    targets: np.ndarray


def _window_excess(g: np.ndarray, copies: int) -> np.ndarray:
    """For float32 values g > 0: by how much more than 2g (relative to 2g) a float32 partial of
    ``copies`` terms g moves when one more term is g rather than −g, and by how much more than g
    (relative to g) when it is g rather than none — the smaller of the two."""
    partial = np.zeros_like(g)
    for _ in range(copies):
        partial = (partial + g).astype(np.float32)
    p64, g64 = partial.astype(np.float64), g.astype(np.float64)
    up = (partial + g).astype(np.float32).astype(np.float64)
    down = (partial - g).astype(np.float32).astype(np.float64)
    return np.minimum((up - down - 2 * g64) / (2 * g64), (up - p64 - g64) / g64)


def float32_window(kind: BatchModelKind, radius: float) -> Window:
    """The records that make float32 accumulation's rounding largest in one window, at an iterate
    where every float32 term is known exactly; used at the radius ``radius``.

    At x₁ with W_1 = 0, b_1 = 0, W_2 = (1, −1, 0, ...), b_2 = 0 every hidden unit outputs
    softplus(0) and f ≡ 0 exactly (two equal outputs cancel, in any dtype and order), so a record
    (x, y) has output gradient −y exactly and gradient −y·u, u = (±½ x in W_1's first two rows, ±½
    in b_1's, softplus(0) in W_2's, 1): the records "all point the same way". With x = (64, x_1, 0,
    ...) W_1's entries hold 99.7 % of ‖u‖², and their float32 terms are −y times powers of two (an
    unclipped record's clip factor is exactly 1). All n records are the same, n such that the
    attacked (last) record closes a window: a product block of
    :data:`~diff2_flwr.core.fused.PRODUCT_BLOCK` samples (index 63) above
    :data:`~diff2_flwr.lab.backend.KERNEL_W1_FEATURES` features, else lane 15's window of
    :data:`~diff2_flwr.core.fused.FLUSH` blocks of 16 (index 1023). −y is the float32 value near
    C/‖u‖ whose partial of 63 copies moves furthest beyond 2|y| (and |y|) when the 64th is y rather
    than −y (its neighbour, reflected through f = 0; or none): measured 2.7e-6 of it. x_1 then puts
    the record's norm at C (1 − 2^-22): unclipped at C, clipped at float32 accumulation's C / (1 +
    ρ). A ValueError if C/‖u‖ is outside float32's normal range.
    """
    F, H = kind.features, kind.hidden
    a = math.log(2.0)
    base = 0.5 * WINDOW_INPUT**2 + 1.5 + H * a * a  # ‖u‖² with x_1 = 0
    target = radius * (1 - WINDOW_MARGIN)
    top = target / math.sqrt(base)
    if not 2.0**-120 < top < 2.0**120:
        raise ValueError(f"the float32 window attack needs a radius whose records' output gradient "
                         f"(C / {math.sqrt(base):.4g}) is a normal float32. Found C = {radius!r}.")
    lo, hi = (np.array([top * (1 - 2.0**-12), top * (1 - 2.0**-14)],
                       dtype=np.float32).view(np.int32))
    g = np.arange(lo, hi, dtype=np.int32).view(np.float32)
    with np.errstate(all="ignore"):
        g = g[int(np.argmax(_window_excess(g, 63)))]
    x_1 = np.float32(math.sqrt(2 * ((target / float(g))**2 - base)))
    n = PRODUCT_BLOCK if F > KERNEL_W1_FEATURES else 16 * FLUSH
    features = np.zeros((n, F))
    features[:, 0], features[:, 1] = WINDOW_INPUT, x_1
    iterate = np.zeros(H * F + 2 * H + 1)
    iterate[H * F + H:H * F + H + 2] = (1.0, -1.0)
    return Window(iterate, features, np.full(n, -float(g)))
