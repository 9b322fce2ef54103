"""Ghost clipping of generic models never lets a clipped contribution exceed its radius: for every
sample, c_i·‖g_i‖ <= C exactly (Fractions), with c_i the factor the engine used and g_i the true
per-sample gradient (issue: no clipped contribution ever exceeds its radius).

The data are dyadic and narrow (inputs of 28 significant bits, output gradients of a few): every
per-sample gradient entry, and every product and partial sum that forms one (``torch.func``'s and
the materialised rows'), is exact in float64, so g_i is known exactly (computed here in Fractions,
independently of the engine) and is the very row every path of the engine adds. The Gram form's
entries (products of two 28-bit inputs, ~56 bits) are not exact: a Gram-form norm of positions
that nearly cancel is off by far more than an ulp, and row norms by an ulp or so. The loss is
linear in the model's output, ℓ = Σ out·y, so the output gradient is y exactly. The radii are
half the smallest norm (every sample clipped) and each sample's computed norm (a sample exactly
on the radius: the computed norm says "not clipped").
"""

from __future__ import annotations

import copy
from fractions import Fraction

import numpy as np
import pytest
import torch
from torch import nn

from diff2_flwr.core import ghost_layers, ghost_parts
from diff2_flwr.core.clipping import gamma
from diff2_flwr.core.ghost_layers import GhostGradients
from diff2_flwr.core.gradients import PerSampleGradients

N = 16


def linear_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """ℓ_i = Σ out_i ⊙ y_i: the output gradient is y exactly."""
    return (out * y.reshape(out.shape)).flatten(1).sum(1)


class Scale(nn.Module):
    """x ⊙ s: a parameter no rule covers (the torch.func fallback)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ⊙ s."""
        return x * self.s


def _mantissas(gen: np.random.Generator, shape, bits: int = 27) -> np.ndarray:
    """Random signed integers of ``bits`` + 1 bits (|m| in [2^bits, 2^(bits+1)))."""
    m = gen.integers(2**bits, 2**(bits + 1), size=shape)
    return (m * gen.choice([-1, 1], size=shape)).astype(np.float64)


def _near(gen: np.random.Generator, base: np.ndarray, depth: np.ndarray) -> np.ndarray:
    """``base`` (integers of 28 bits) moved by a relative ~2^-depth per sample: still integers of
    at most 29 bits."""
    shape = base.shape
    step = np.floor(2.0**(27 - depth)).reshape((-1,) + (1,) * (len(shape) - 1))
    return base + gen.integers(-1, 2, size=shape) * step * gen.integers(1, 3, size=shape)


def linear_case(gen: np.random.Generator):
    """Linear(8, 4) over 3 positions: positions 0 and 1 nearly cancel (x₁ ≈ x₀, y₁ = -y₀: the
    gradient y₀ (x₀ - x₁)ᵀ is 2^-2 .. 2^-9 of its terms), position 2 adds a small term."""
    x0 = _mantissas(gen, (N, 8))
    depth = np.arange(N) % 8 + 2
    x = np.stack([x0, _near(gen, x0, depth), _mantissas(gen, (N, 8))], axis=1) * 2.0**-12
    y0 = gen.integers(1, 9, size=(N, 4)) * gen.choice([-1, 1], size=(N, 4))
    y2 = gen.integers(-8, 9, size=(N, 4)) * 2.0**-10
    y = np.stack([y0, -y0, y2], axis=1).astype(np.float64)
    model = nn.Linear(8, 4)
    with torch.no_grad():
        model.weight.copy_(torch.from_numpy(gen.integers(-2, 3, size=(4, 8)).astype(np.float64)))
    return model, x, y


def linear_exact(x: np.ndarray, y: np.ndarray) -> list[Fraction]:
    """‖Σ_t y_t (x_t, 1)ᵀ‖² per sample, exactly."""
    out = []
    for xi, yi in zip(x.tolist(), y.tolist()):
        X = [[Fraction(v) for v in row] + [Fraction(1)] for row in xi]
        Y = [[Fraction(v) for v in row] for row in yi]
        out.append(sum(sum((Y[t][o] * X[t][k] for t in range(len(X))), Fraction(0)) ** 2
                       for o in range(len(Y[0])) for k in range(len(X[0]))))
    return out


def conv_case(gen: np.random.Generator):
    """Conv1d(3, 2, 3) over a ramp x[c, l] = m_c + l·δ_c with y alternating in sign: the gradient
    is ~δ, its 6 positions' terms ~m (2^-2 .. 2^-8 apart), plus a small independent term."""
    base = _mantissas(gen, (N, 3))
    depth = np.arange(N) % 7 + 2
    slope = _near(gen, base, depth) - base
    x = (base[:, :, None] + slope[:, :, None] * np.arange(8)) * 2.0**-12
    sign = (-1.0) ** np.arange(6)
    y0 = gen.integers(1, 9, size=(N, 2)) * gen.choice([-1, 1], size=(N, 2))
    y = y0[:, :, None] * sign + gen.integers(-8, 9, size=(N, 2, 6)) * 2.0**-12
    model = nn.Conv1d(3, 2, 3)
    with torch.no_grad():
        model.weight.copy_(torch.from_numpy(gen.integers(-2, 3, size=(2, 3, 3)).astype(
            np.float64)))
    return model, x, y


def conv_exact(x: np.ndarray, y: np.ndarray) -> list[Fraction]:
    """‖∂(W, bias)‖² of Σ_l y[o, l] conv(x)[o, l] per sample (kernel 3, stride 1), exactly."""
    out = []
    for xi, yi in zip(x.tolist(), y.tolist()):
        X = [[Fraction(v) for v in row] for row in xi]
        Y = [[Fraction(v) for v in row] for row in yi]
        total = Fraction(0)
        for yo in Y:
            for xc in X:
                for k in range(3):
                    total += sum((yo[l] * xc[l + k] for l in range(len(yo))), Fraction(0)) ** 2
            total += sum(yo, Fraction(0)) ** 2
        out.append(total)
    return out


def embedding_case(gen: np.random.Generator):
    """Embedding(6, 4, padding_idx 0) over 8 ids: rows are sums of y over equal ids."""
    ids = gen.integers(0, 6, size=(N, 8))
    y = _mantissas(gen, (N, 8, 4), bits=20) * 2.0**-12
    return nn.Embedding(6, 4, padding_idx=0), ids, y


def embedding_exact(ids: np.ndarray, y: np.ndarray) -> list[Fraction]:
    out = []
    for idi, yi in zip(ids.tolist(), y.tolist()):
        rows: dict[int, list[Fraction]] = {}
        for v, row in zip(idi, yi):
            if v == 0:
                continue
            acc = rows.setdefault(v, [Fraction(0)] * len(row))
            for j, value in enumerate(row):
                acc[j] += Fraction(value)
        out.append(sum(value * value for row in rows.values() for value in row))
    return out


def fallback_case(gen: np.random.Generator):
    """x ⊙ s over 3 positions (torch.func rows): ∂s = Σ_t y_t ⊙ x_t."""
    x = _mantissas(gen, (N, 3, 5)) * 2.0**-12
    y = gen.integers(-8, 9, size=(N, 3, 5)).astype(np.float64)
    return Scale(5), x, y


def fallback_exact(x: np.ndarray, y: np.ndarray) -> list[Fraction]:
    out = []
    for xi, yi in zip(x.tolist(), y.tolist()):
        total = Fraction(0)
        for j in range(len(xi[0])):
            total += sum((Fraction(xi[t][j]) * Fraction(yi[t][j]) for t in range(len(xi))),
                         Fraction(0)) ** 2
        out.append(total)
    return out


CASES = {"linear": (linear_case, linear_exact), "conv1d": (conv_case, conv_exact),
         "embedding": (embedding_case, embedding_exact),
         "fallback": (fallback_case, fallback_exact)}

#: (scale of the inputs, of the output gradients): large activations and gradients ~2^18; tiny
#: activations (squares underflow), huge ones (squares overflow); gradients of ~2^-870 (squares
#: underflow; above the radius floor) and ~2^990 (squares overflow). Every product stays exact.
SCALES = {"large": (0, 0), "tiny_activations": (-600, 600), "huge_activations": (500, -490),
          "tiny_gradients": (-440, -440), "huge_gradients": (480, 480)}


def _build(name: str, scale: str, seed: int = 0):
    make, exact = CASES[name]
    model, x, y = make(np.random.default_rng(seed))
    sx, sy = SCALES[scale]
    if name == "embedding":
        y = y * 2.0**(sx + sy)  # ids carry no scale
    else:
        x, y = x * 2.0**sx, y * 2.0**sy
    sq = exact(x, y)
    model = model.double()
    ghost = GhostGradients(copy.deepcopy(model), linear_loss)
    ref = PerSampleGradients(copy.deepcopy(model), linear_loss)
    params = dict(model.named_parameters())
    x1 = np.concatenate([params[n].detach().reshape(-1).numpy() for n in ghost.layout.names])
    xt = torch.from_numpy(x) if name == "embedding" else torch.from_numpy(x).double()
    yt = torch.from_numpy(y).double()
    # the data's design: torch.func's rows (as every path's) are the exact gradients
    rows = ref.per_sample(x1, xt, yt)
    assert [sum(Fraction(v) ** 2 for v in r) for r in rows.tolist()] == sq
    return ghost, xt, yt, x1, sq


def _violations(ghost: GhostGradients, x, y, x1, sq: list[Fraction],
                monkeypatch) -> list[tuple[float, int]]:
    """(radius, sample) whose clipped gradient c_i g_i exceeds the radius, with c_i the engine's
    factors, over the radii: half the smallest computed norm, and each sample's computed norm."""
    seen = []
    real = ghost_layers.clip_factors

    def spy(upper, radius):
        c = real(upper, radius)
        seen.append(c.clone())
        return c

    monkeypatch.setattr(ghost_layers, "clip_factors", spy)
    norms = ghost.norms(x1, x, y)
    assert bool(torch.isfinite(norms).all()) and float(norms.min()) > 2.0**-900
    bad = []
    for radius in [float(norms.min()) / 2] + norms.tolist():
        seen.clear()
        got = ghost.clipped_mean(x1, x, y, radius)
        assert not got.overflow and len(seen) == 1
        r2 = Fraction(radius) ** 2
        bad += [(radius, i) for i, (c, s) in enumerate(zip(seen[0].tolist(), sq))
                if Fraction(c) ** 2 * s > r2]
    return bad


FORMS = {"gram": 0, "materialised": float("inf")}
RULES = [("linear", "gram"), ("linear", "materialised"), ("conv1d", "gram"),
         ("conv1d", "materialised"), ("embedding", None), ("fallback", None)]


@pytest.mark.parametrize("scale", list(SCALES))
@pytest.mark.parametrize("name,form", RULES)
def test_no_clipped_gradient_exceeds_the_radius(name, form, scale, monkeypatch):
    if form is not None:
        monkeypatch.setattr(ghost_parts, "GRAM_COST", FORMS[form])
    ghost, x, y, x1, sq = _build(name, scale)
    assert _violations(ghost, x, y, x1, sq, monkeypatch) == []


@pytest.mark.parametrize("scale", list(SCALES))
@pytest.mark.parametrize("name,form", RULES)
def test_clipping_by_the_computed_norms_exceeds_the_radius(name, form, scale, monkeypatch):
    """Teeth: the same factors from the computed norms (the bounds switched off) let some clipped
    gradient exceed its radius, on every rule and scale."""
    if form is not None:
        monkeypatch.setattr(ghost_parts, "GRAM_COST", FORMS[form])
    monkeypatch.setattr(ghost_layers, "upper_norms", lambda norms, rel, extra=0.0: norms)
    ghost, x, y, x1, sq = _build(name, scale)
    assert _violations(ghost, x, y, x1, sq, monkeypatch)


@pytest.mark.parametrize("name", ["linear", "conv1d"])
def test_a_gram_form_value_needs_more_than_a_row_norms_bound(name, monkeypatch):
    """Teeth of the Gram form's own bound: kept values bounded as a row norm would be (a relative
    γ_64, above both layers' row-norm bounds) let some clipped gradient exceed its radius."""
    monkeypatch.setattr(ghost_parts, "GRAM_COST", 0)
    monkeypatch.setattr(ghost_parts, "_gram_bound",
                        lambda sq, error, s: (torch.full_like(sq, gamma(64)), 0.0))
    assert ghost_parts.rows_error([4 * 9]) < gamma(64) and ghost_parts.rows_error([2 * 10]) < \
        gamma(64)
    ghost, x, y, x1, sq = _build(name, "large")
    assert _violations(ghost, x, y, x1, sq, monkeypatch)


def test_the_gram_form_keeps_samples_whose_terms_nearly_cancel(monkeypatch):
    """The linear case's Gram form keeps most samples, among them some whose computed norm is
    below the true one by more than 2^-45 (far more than rounding of a row norm): what the Gram
    form's bound covers."""
    monkeypatch.setattr(ghost_parts, "GRAM_COST", 0)
    kept = []
    real = ghost_parts._gram_bound

    def spy(sq, error, s):
        kept.append((sq, error, s))
        return real(sq, error, s)

    monkeypatch.setattr(ghost_parts, "_gram_bound", spy)
    ghost, x, y, x1, sq = _build("linear", "large")
    norms = ghost.norms(x1, x, y)
    (gram_sq, error, _), = kept
    keep = gram_sq >= ghost_parts.KEEP_MARGIN * error
    assert 8 <= int(keep.sum()) < N
    low = [i for i in range(N) if keep[i] and Fraction(norms[i].item()) ** 2 < sq[i] * (
        1 - Fraction(1, 2**44))]
    assert low
