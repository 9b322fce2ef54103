"""Per-sample gradient norms and clipped sums of MLPs, for many runs at once, without materialising
a per-sample gradient ("ghost clipping"); ½-squared error or cross-entropy with any number of
classes.

An MLP is L linear layers with an elementwise activation φ_l after every layer but the last:
a_1 = the input, h_l = W_l a_l + b_l, a_{l+1} = φ_l(h_l), output z = h_L. For one sample, the
gradient with respect to (W_l, b_l) is (g_l a_lᵀ, g_l), with

    g_L = ∂ℓ/∂z = z - y                     (ℓ = ½ (z - y)², one output)
    g_L = softmax(z) - onehot(y)            (ℓ = -log softmax(z)_y, C outputs)
    g_l = (W_{l+1}ᵀ g_{l+1}) ⊙ φ_l'(h_l)

— one rank-one matrix per layer and sample. With ã = (a, 1):

    ‖∇ℓ‖² = Σ_l ‖g_l‖² (1 + ‖a_l‖²)          Σ_i c_i ∇_{W_l, b_l} ℓ_i = Σ_i c_i g_l,i ã_l,iᵀ (one
    matrix product).

A difference round needs the norm of ∇ℓ(x, z) - ∇ℓ(x', z). Per layer, with dg = g - g' and
da = a - a' (da = 0 at the first layer: both iterates see the same input),

    g ãᵀ - g' ã'ᵀ = dg ãᵀ + g' (da, 0)ᵀ,
    ‖·‖² = ‖dg‖² (1 + ‖a‖²) + ‖g'‖² ‖da‖² + 2 (dg · g') (a · da)       (A + B + X),

written in the small differences rather than as ‖a‖²‖g‖² + ‖a'‖²‖g'‖² - 2(ã·ã')(g·g'), whose large
terms cancel when the iterates are close. A + B + X still cancels when the two rank-one terms nearly
cancel each other (dg ãᵀ ≈ -g' (da, 0)ᵀ; with activations ~1e4 the security review found norms 1.76x
too small): its error is ~ε(A + B), so where A + B > 16·(A + B + X) the layer's norm is taken
instead from a QR factorisation of the right factors [ã, (da, 0)] = [q1, q2] R (one Gram–Schmidt
step, as in Golub & Van Loan, Matrix Computations, §5.2.8): with s² = 1 + ‖a‖², p = a · da, μ = p /
s²,

    ‖dg ãᵀ + g' (da, 0)ᵀ‖² = ‖s² dg + p g'‖² / s² + ‖(da - μ a, -μ)‖² ‖g'‖²,

two non-negative terms whose only rounding is that of forming the entries: the error is ~ε√(A +
B)·‖·‖, as good as writing out the matrix (and better than ``torch.func``'s difference of two
gradients). Rows without cancellation keep the cheaper A + B + X (error below 16·few·ε relative).

Squares underflow and overflow: a row of norm 1e-170 reads 0. :func:`norms` takes the square root
and takes again, by scaling (:func:`_scaled_norms`: every factor by a power of two, the rank-two
matrix written out), every sample whose squared norm is outside [2^-600, 2^600] or whose multipliers
(1 + ‖a‖², ‖g'‖², ‖da‖², 1 + ‖x‖²) exceed 2^400 (they could lift an underflowed square back into
view): what those bounds let underflow is below 2^-470 of the result. The clipped sum is Σ c dg ãᵀ +
Σ c g' (da, 0)ᵀ. A run that restarts in a batch of differences takes g' = 0 and a' = a, which gives
its plain gradient exactly (adding exact zeros).

Tensors are laid out with the runs first and the samples innermost: parameters [K, d] (K runs), the
shared input [F, M] (M samples), per-sample quantities [K, width, M]. The forward and backward
passes run in the input's dtype; :meth:`Pass.to64` gives the float64 copy in which norms, clip
factors and sums are taken (as :class:`~diff2_flwr.core.closed_form.PaperMLPGradients` does). The
result equals :class:`~diff2_flwr.core.gradients.PerSampleGradients` (``torch.func``) up to float
rounding; tests check both against each other.

References:
    Murata & Suzuki (2023), Algorithm 1 (worker lines), Algorithm 2 (ClippedMean);
    Goodfellow (2015), "Efficient per-example gradient computations" (rank-one per-sample
    gradients); Li et al. (2022), "Large language models can be strong differentially private
    learners" (ghost clipping).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .clipping import gamma, scaled_row_norms, upper_norms
from .closed_form import softplus_with_derivative

__all__ = ["ACTIVATIONS", "LOSSES", "MLP", "Pass", "activate", "clipped_sums", "forward",
           "forward_head", "norm_bounds", "norm_error", "norms", "scaled_norm_error",
           "prepare_for_compile", "sq_norms"]

LOSSES = ("half_squared_error", "cross_entropy")


def _tanh(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.tanh(h)
    return t, 1 - t * t  # as torch's tanh backward: from the output


def _sigmoid(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = torch.sigmoid(h)
    return s, s * (1 - s)


def _relu(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    r = torch.relu(h)
    return r, (r > 0).to(h.dtype)  # as torch's relu backward: derivative 0 at 0


def _identity(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return h, torch.ones_like(h)


#: name -> h -> (φ(h), φ'(h)), each derivative as torch's autograd takes it (softplus: beta 1,
#: threshold 20).
ACTIVATIONS: dict[str, Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]] = {
    "softplus": softplus_with_derivative, "tanh": _tanh, "sigmoid": _sigmoid, "relu": _relu,
    "identity": _identity,
}


def activate(name: str, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """φ(h) and φ'(h) of the activation ``name``."""
    return ACTIVATIONS[name](h)


@dataclass(frozen=True)
class MLP:
    """The shape of an MLP: layer widths (input, hidden..., output), one activation per hidden
    layer, the loss.

    Its flat parameter vector is (W_1, b_1, ..., W_L, b_L), each W_l [out, in] row-major: the
    ``named_parameters()`` order of ``nn.Linear`` layers, so the same vector as the per-run path's.
    """

    sizes: tuple[int, ...]
    activations: tuple[str, ...]
    loss: str

    def __post_init__(self) -> None:
        if len(self.sizes) < 2 or not all(isinstance(s, int) and s >= 1 for s in self.sizes):
            raise ValueError(
                f"An MLP needs widths (input, ..., output), each an integer >= 1. Found "
                f"{self.sizes}.")
        if len(self.activations) != len(self.sizes) - 2:
            raise ValueError(
                f"An MLP with widths {self.sizes} needs {len(self.sizes) - 2} activation(s), one "
                f"per hidden layer. Found {self.activations}.")
        bad = [a for a in self.activations if a not in ACTIVATIONS]
        if bad:
            raise ValueError(f"Unknown activation(s) {bad}. Expected among {sorted(ACTIVATIONS)}.")
        if self.loss not in LOSSES:
            raise ValueError(f"Unknown loss {self.loss!r}. Expected one of {list(LOSSES)}.")
        if self.loss == "half_squared_error" and self.sizes[-1] != 1:
            raise ValueError(
                f"½-squared error needs one output. Found {self.sizes[-1]} (use cross_entropy for "
                f"classes).")
        if self.loss == "cross_entropy" and self.sizes[-1] < 2:
            raise ValueError(
                f"cross_entropy needs one output per class (>= 2). Found {self.sizes[-1]}.")

    @property
    def dim(self) -> int:
        """d = Σ_l (out_l·in_l + out_l): the parameters, flat as (W_1, b_1, W_2, b_2, ...)."""
        return sum(o * i + o for i, o in zip(self.sizes, self.sizes[1:]))

    def layers(self, x: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Flat parameters [K, d] -> [(W_l [K, out, in], b_l [K, out])] (views)."""
        if x.ndim != 2 or x.shape[1] != self.dim:
            raise ValueError(
                f"Expected parameters of shape [runs, {self.dim}]. Found {tuple(x.shape)}.")
        out, start = [], 0
        for i, o in zip(self.sizes, self.sizes[1:]):
            w = x[:, start:start + o * i].reshape(-1, o, i)
            start += o * i
            out.append((w, x[:, start:start + o]))
            start += o
        return out

    def matmul_flops(self, samples: int, *, difference: bool) -> int:
        """Multiply-adds × 2 of the matrix products of one round for one run over ``samples``
        samples: the forward and backward passes at one iterate (the previous iterate's are reused)
        and the clipped sums (two products per layer after the first in a difference round).
        Elementwise work is not counted."""
        pairs = list(zip(self.sizes, self.sizes[1:]))
        forward = sum(i * o for i, o in pairs)
        backward = sum(i * o for i, o in pairs[1:])
        sums = sum((i + 1) * o for i, o in pairs) + (sum(i * o for i,
                                                         o in pairs[1:]) if difference else 0)
        return 2 * samples * (forward + backward + sums)


@dataclass(frozen=True)
class Pass:
    """Per-sample quantities of one iterate of K runs over M samples.

    ``inputs[l]``: a_{l+2} [K, width, M] (the inputs of the layers after the first; the first one's
    is shared); ``grads[l]``: g_{l+1} [K, out_{l+1}, M]; ``loss`` [K, M]; ``outputs``: z [K, out_L,
    M].
    """

    inputs: tuple[torch.Tensor, ...]
    grads: tuple[torch.Tensor, ...]
    loss: torch.Tensor
    outputs: torch.Tensor

    def to64(self) -> "Pass":
        """This pass with its inputs, gradients and losses in float64 (``outputs`` as they are)."""
        f64 = torch.float64
        return Pass(tuple(a.to(f64) for a in self.inputs), tuple(g.to(f64) for g in self.grads),
                    self.loss.to(f64), self.outputs)

    def restarting(self, current: "Pass", restart: torch.Tensor) -> "Pass":
        """This (previous) pass with g' = 0 and a' = a of ``current`` for the runs that restart [K
        bool]: their "difference" is then their plain gradient, exactly."""
        r = restart.reshape(-1, 1, 1)
        return Pass(tuple(torch.where(r, a, ap) for a, ap in zip(current.inputs, self.inputs)),
                    tuple(torch.where(r, 0.0, g) for g in self.grads), self.loss, self.outputs)


def _output_gradient(loss: str, z: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor,
                                                                           torch.Tensor]:
    """∂ℓ/∂z [K, out, M] and ℓ [K, M]; ``y`` [M] holds targets (regression) or class indices (as
    numbers)."""
    if loss == "half_squared_error":
        e = z[:, 0, :] - y
        return e.unsqueeze(1), 0.5 * e * e
    index = y.long()
    logp = torch.log_softmax(z, dim=1)
    onehot = torch.nn.functional.one_hot(index, z.shape[1]).T.to(z.dtype)  # [C, M]
    return torch.exp(logp) - onehot, -logp.gather(1, index.expand(z.shape[0], 1, -1)).squeeze(1)


#: Layers after the first with at most this many outputs (a regression head, a few classes) multiply
#: elementwise and reduce rather than call a batched matrix product: the work is then a few passes
#: over [K, in, M] that a compiler fuses, instead of permuted copies around a product with a tiny
#: dimension.
NARROW = 4


def _layer(w: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """W a per run: [K, O, I] x [K, I, M] -> [K, O, M]."""
    if w.shape[1] <= NARROW:
        return (w.unsqueeze(-1) * a.unsqueeze(1)).sum(2)
    return torch.bmm(w, a)


def _layer_t(w: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Wᵀ g per run: [K, O, I] x [K, O, M] -> [K, I, M]."""
    if w.shape[1] <= NARROW:
        return (w.unsqueeze(-1) * g.unsqueeze(2)).sum(1)
    return torch.bmm(w.transpose(1, 2), g)


def _forward(mlp: MLP, x: torch.Tensor, a_t: torch.Tensor):
    """Layers [(W_l, b_l)] in ``a_t``'s dtype, the inputs of the layers after the first, φ' of every
    hidden layer, and the output z [K, out_L, M]."""
    layers = mlp.layers(x.to(a_t.dtype))
    K, M = x.shape[0], a_t.shape[1]
    inputs, derivs, a = [], [], a_t
    for l, (w, b) in enumerate(layers):
        if l == 0:  # one matrix product for every run: [K·out, F] @ [F, M]
            h = (w.reshape(-1, a_t.shape[0]) @ a_t).reshape(K, -1, M)
        else:
            inputs.append(a)
            h = _layer(w, a)
        h = h + b.unsqueeze(-1)
        if l < len(layers) - 1:
            a, d = activate(mlp.activations[l], h)
            derivs.append(d)
    return layers, inputs, derivs, h


def forward(mlp: MLP, x: torch.Tensor, a_t: torch.Tensor, y: torch.Tensor, *,
            backward: bool = True) -> Pass:
    """The per-sample quantities of ``mlp`` at parameters ``x`` [K, d] for the samples ``a_t`` [F,
    M] (targets ``y`` [M]), in ``a_t``'s dtype. Without ``backward`` only ``loss`` and ``outputs``
    are filled."""
    layers, inputs, derivs, h = _forward(mlp, x, a_t)
    g, loss = _output_gradient(mlp.loss, h, y)
    if not backward:
        return Pass((), (), loss, h)
    grads = [g]
    for l in range(len(layers) - 1, 0, -1):
        g = _layer_t(layers[l][0], g) * derivs[l - 1]
        grads.append(g)
    return Pass(tuple(inputs), tuple(reversed(grads)), loss, h)


def forward_head(mlp: MLP, x: torch.Tensor, a_t: torch.Tensor,
                 y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward pass of a one-hidden-layer ``mlp`` without the backward to the hidden layer, in
    ``a_t``'s dtype: hidden activations a [K, H, M], φ'(h) [K, H, M], output gradient g_L [K, O, M]
    and ℓ [K, M] — what :func:`diff2_flwr.core.fused.clipped_sums` takes (with W_2) to do the rest
    in one pass."""
    if len(mlp.sizes) != 3:
        raise ValueError(
            f"forward_head takes an MLP with one hidden layer. Found widths {mlp.sizes}.")
    _, inputs, derivs, h = _forward(mlp, x, a_t)
    g, loss = _output_gradient(mlp.loss, h, y)
    return inputs[0], derivs[0], g, loss


def _dot(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return (u * v).sum(1)


#: Where A + B > CANCELLATION · (A + B + X) a layer's norm is taken from the QR form (the error of A
#: + B + X is ~ε(A + B), so at most 16·few·ε relative where it is kept).
CANCELLATION = 16.0
#: Squared norms in [2^-600, 2^600] with multipliers up to 2^400 lose nothing to underflow or
#: overflow.
SAFE_SQ, SAFE_MULTIPLIER = (2.0**-600, 2.0**600), 2.0**400


def norm_error(mlp: MLP) -> float:
    """κ of an MLP's ghost norms in float64 (see :func:`norm_bounds`): γ_(4W + 64) with W the sum of
    its widths, which bounds every sum a norm takes (no sum is longer than a width plus a few terms)
    and the products and square roots around them, with room to spare."""
    return gamma(4 * sum(mlp.sizes) + 64)


def scaled_norm_error(mlp: MLP) -> float:
    """κ of the norms taken again by scaling (:func:`_scaled_norms`): those write the rank-two
    matrices out, so their sums are as long as a layer's entries."""
    return gamma(sum((i + 1) * o for i, o in zip(mlp.sizes, mlp.sizes[1:])) + 64)


def _difference_term(dg: torch.Tensor, gp: torch.Tensor, a: torch.Tensor, da: torch.Tensor,
                     kappa: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """‖dg ãᵀ + g' (da, 0)ᵀ‖² per run and sample (cancellation-safe, see the module's docstring), an
    upper bound of its true value (:func:`norm_bounds`), and the largest of its multipliers 1 +
    ‖a‖², ‖g'‖², ‖da‖²."""
    sa, sgp, sda, p = 1 + _dot(a, a), _dot(gp, gp), _dot(da, da), _dot(a, da)
    sq_a = _dot(dg, dg) * sa
    ab = sq_a + sgp * sda
    x = 2 * _dot(dg, gp) * p
    term = ab + x
    # A + B + X: its error is at most γ·(A + B + |X|), whatever cancels
    hi = term + kappa * (ab + x.abs())
    cancel = ab > CANCELLATION * term
    # compiled: no data-dependent branch (graph break)
    if torch.compiler.is_compiling() or bool(cancel.any()):
        mu = (p / sa).unsqueeze(1)
        e = sa.unsqueeze(1) * dg + p.unsqueeze(1) * gp
        w = da - mu * a
        qr = _dot(e, e) / sa + (_dot(w, w) + mu[:, 0] * mu[:, 0]) * sgp
        # the QR form: its norm within κ·(√A + 4√B) of the true one (:func:`norm_bounds`)
        root = torch.sqrt(qr) * (1 + kappa) + kappa * (torch.sqrt(sq_a) + 4 * torch.sqrt(
            sgp * sda))
        term = torch.where(cancel, qr, term)
        hi = torch.where(cancel, root * root, hi)
    return term, hi, torch.maximum(sa, torch.maximum(sgp, sda))


def _sq_norms(cur: Pass, sq_input: torch.Tensor, prev: Pass | None,
              kappa: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`sq_norms`, an upper bound of each true value but for a relative κ
    (:func:`norm_bounds`) and the largest multiplier per run and sample."""
    dg = cur.grads[0] if prev is None else cur.grads[0] - prev.grads[0]
    total, big = _dot(dg, dg) * (1 + sq_input), 1 + sq_input
    hi = total
    for l in range(1, len(cur.grads)):
        g, a = cur.grads[l], cur.inputs[l - 1]
        if prev is None:
            sa = 1 + _dot(a, a)
            term = _dot(g, g) * sa
            bound = term
        else:
            term, bound, sa = _difference_term(g - prev.grads[l], prev.grads[l], a,
                                               a - prev.inputs[l - 1], kappa)
        total, hi, big = total + term, hi + bound, torch.maximum(big, sa)
    return total, hi, big


def sq_norms(cur: Pass, sq_input: torch.Tensor, prev: Pass | None = None) -> torch.Tensor:
    """‖∇ℓ(x, z)‖² per run and sample [K, M] (or ‖∇ℓ(x, z) - ∇ℓ(x', z)‖² with ``prev`` the pass at
    x'), from float64 passes; ``sq_input`` [M] = ‖a‖² of the shared input. Cancellation-safe, not
    underflow-safe: the clipping decision reads :func:`norms`."""
    return _sq_norms(cur, sq_input, prev)[0]


def norms(cur: Pass, inputs: torch.Tensor, sq_input: torch.Tensor,
          prev: Pass | None = None) -> torch.Tensor:
    """‖∇ℓ(x, z)‖ (or of the difference with ``prev``) per run and sample [K, M], float64, exact to
    rounding whatever its magnitude (see the module's docstring). ``inputs`` [M, F] float64: the
    shared input, read for the samples that need scaling; ``sq_input`` [M] its ‖·‖²."""
    sq, _, big = _sq_norms(cur, sq_input, prev)
    return _rescale_unsafe(torch.sqrt(sq), sq, big, cur, inputs, prev)


def norm_bounds(mlp: MLP, cur: Pass, inputs: torch.Tensor, sq_input: torch.Tensor,
                prev: Pass | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`norms` and an upper bound of every true norm [K, M], for the clip factors
    (:func:`~diff2_flwr.core.clipping.clip_factors`): a clipped row never exceeds its radius.

    The true norm is that of the rows :func:`clipped_sums` adds: per layer g ãᵀ (a plain round) or
    dg ãᵀ + g' (da, 0)ᵀ, from the float64 g, a, dg = g - g', da = a - a' as computed. With κ =
    :func:`norm_error` (Higham's γ, rounded generously):

    - a rank-one layer's ‖g‖²(1 + ‖a‖²) is a product of non-negative sums: within a relative κ;
    - A + B + X is within κ (A + B + |X|) of its true value: relative to the terms, not to the
      result (|X| <= A + B by Cauchy–Schwarz, so this is tight where nothing cancels);
    - the QR form's norm is within κ (√A + 4√B) of the true one: ‖M q1‖ = ‖s² dg + p g'‖ / s with
      s² and p to γ relative, which moves it by γ (√A + 2√B); and ‖M (I - q1 q1ᵀ)‖ = ‖g'‖ min_μ
      ‖(da, 0) - μ ã‖ <= ‖g'‖ ‖(da - μ̂ a, -μ̂)‖ for the computed μ̂ (whatever its error), whose
      forming adds γ·2√B;
    - a norm taken again by scaling writes each rank-two matrix out: its entries within γ_3 of
      |dg| |ã|ᵀ + |g'| |(da, 0)|ᵀ, so within κ_s (√A + √B) per layer (κ_s:
      :func:`scaled_norm_error`).

    Squared per-layer bounds add; the square root takes a last relative κ, rounded upward
    (:func:`~diff2_flwr.core.clipping.upper_norms`).
    """
    kappa = norm_error(mlp)
    sq, hi, big = _sq_norms(cur, sq_input, prev, kappa)
    out = _rescale_unsafe(torch.sqrt(sq), sq, big, cur, inputs, prev)
    upper = upper_norms(torch.sqrt(hi), kappa)
    return out, _rescale_upper(upper, sq, big, cur, inputs, prev, scaled_norm_error(mlp))


def _rescale_upper(upper: torch.Tensor, sq: torch.Tensor, big: torch.Tensor, cur: Pass,
                   inputs: torch.Tensor, prev: Pass | None, kappa: float) -> torch.Tensor:
    """``upper`` with the bounds of the samples taken again by scaling from their scaled norms (as
    :func:`_rescale_unsafe`, eager in a compiled round)."""
    unsafe = ~((sq >= SAFE_SQ[0]) & (sq <= SAFE_SQ[1])) | (big > SAFE_MULTIPLIER)
    if not bool(unsafe.any()):
        return upper
    k, m = torch.nonzero(unsafe, as_tuple=True)
    norm, width = _scaled_norms(cur, inputs, prev, k, m, with_width=True)
    return upper.index_put((k, m), upper_norms(norm, kappa, kappa * width))


def _rescale_unsafe(out: torch.Tensor, sq: torch.Tensor, big: torch.Tensor, cur: Pass,
                    inputs: torch.Tensor, prev: Pass | None) -> torch.Tensor:
    """``out`` with the samples whose squares may have underflowed or overflowed taken again by
    scaling (eager even in a compiled round, once :func:`prepare_for_compile` ran: a data-dependent
    number of samples)."""
    unsafe = ~((sq >= SAFE_SQ[0]) & (sq <= SAFE_SQ[1])) | (big > SAFE_MULTIPLIER)
    if not bool(unsafe.any()):
        return out
    k, m = torch.nonzero(unsafe, as_tuple=True)
    return out.index_put((k, m), _scaled_norms(cur, inputs, prev, k, m))


def prepare_for_compile() -> None:
    """Keep :func:`_rescale_unsafe` out of ``torch.compile``'d graphs (``torch.compiler.disable``);
    call it before compiling anything that calls :func:`norms`. Not done at import:
    ``torch.compiler.disable`` imports ``torch._dynamo`` (~1.7 s), which every process that only
    trains eagerly (``diff2 run``'s pre-flight, the ServerApp, each ClientApp) would pay for
    nothing. Idempotent; eager results are the same either way."""
    global _rescale_unsafe, _rescale_upper
    if not hasattr(_rescale_unsafe, "_torchdynamo_disable"):
        _rescale_unsafe = torch.compiler.disable(_rescale_unsafe)
    if not hasattr(_rescale_upper, "_torchdynamo_disable"):
        _rescale_upper = torch.compiler.disable(_rescale_upper)


def _ldexp(x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """x·2^e exactly (but for the final rounding), for any integer e: torch.ldexp multiplies by
    2.0**e, which is inf or 0 beyond ±1023. Three factors of at most 2^800, all on one side of 1: no
    intermediate rounding."""
    e = e.clamp(-2400, 2400).to(torch.int64)
    e1 = torch.div(e, 3, rounding_mode="trunc")
    e2 = torch.div(e - e1, 2, rounding_mode="trunc")
    for part in (e1, e2, e - e1 - e2):
        x = x * torch.pow(2.0, part.to(x.dtype))
    return x


def _expo(v: torch.Tensor) -> torch.Tensor:
    """e with max|v_i| = f·2^e, f in [0.5, 1), per row of v [n, w] (a very small e for a zero
    row)."""
    m = v.abs().amax(1)
    return torch.where(m > 0, torch.frexp(m).exponent, -4000)


def _scaled(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    e = _expo(v)
    return _ldexp(v, -e.unsqueeze(1)), e


def _layer_norm(dg: torch.Tensor, a1: torch.Tensor, gp: torch.Tensor | None,
                da1: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """‖dg a1ᵀ + gp da1ᵀ‖ per row [n] (gp None: rank one), every factor scaled by a power of two and
    the matrix written out: exact to rounding from 2^-1074 to the largest float; and ‖dg‖ ‖a1‖ +
    ‖gp‖ ‖da1‖, the scale of its rounding error (0 for rank one, whose error is relative)."""
    dgs, e_dg = _scaled(dg)
    a1s, e_a = _scaled(a1)
    if gp is None or da1 is None:
        return _ldexp(scaled_row_norms(dgs) * scaled_row_norms(a1s), e_dg + e_a), torch.zeros_like(
            dg[:, 0])
    gps, e_gp = _scaled(gp)
    das, e_da = _scaled(da1)
    e1, e2 = e_dg + e_a, e_gp + e_da
    top = torch.maximum(e1, e2)
    one = torch.ones_like(dg[:, 0])
    f1, f2 = _ldexp(one, e1 - top), _ldexp(one, e2 - top)
    mat = (f1[:, None, None] * dgs[:, :, None]) * a1s[:, None,
                                                      :] + (f2[:, None, None] * gps[
                                                          :, :, None]) * das[:, None, :]
    width = _ldexp(scaled_row_norms(dgs) * scaled_row_norms(a1s), e1) + _ldexp(
        scaled_row_norms(gps) * scaled_row_norms(das), e2)
    return _ldexp(scaled_row_norms(mat.reshape(len(dg), -1)), top), width


def _scaled_norms(cur: Pass, inputs: torch.Tensor, prev: Pass | None, k: torch.Tensor,
                  m: torch.Tensor, with_width: bool = False):
    """The norms of the samples (k, m) [n] by :func:`_layer_norm` per layer, joined by scaled row
    norms (and, ``with_width``, the sum of the layers' error scales)."""
    def one(t: torch.Tensor) -> torch.Tensor:  # [K, w, M] -> [n, w]
        return t[k, :, m]

    def tilde(a: torch.Tensor, bias: float) -> torch.Tensor:
        return torch.cat([a, a.new_full((len(a), 1), bias)], dim=1)

    x1 = tilde(inputs[m], 1.0)
    layers, widths = [], []
    for l, g in enumerate(cur.grads):
        dg = one(g) if prev is None else one(g) - one(prev.grads[l])
        a1 = x1 if l == 0 else tilde(one(cur.inputs[l - 1]), 1.0)
        if prev is None or l == 0:
            norm, width = _layer_norm(dg, a1, None, None)
        else:
            da1 = tilde(one(cur.inputs[l - 1]) - one(prev.inputs[l - 1]), 0.0)
            norm, width = _layer_norm(dg, a1, one(prev.grads[l]), da1)
        layers.append(norm)
        widths.append(width)
    out = scaled_row_norms(torch.stack(layers, dim=1))
    if with_width:
        return out, torch.stack(widths, dim=1).sum(1)
    return out


def _per_client(c_g: torch.Tensor, a: torch.Tensor, P: int, c_g2: torch.Tensor | None = None,
                a2: torch.Tensor | None = None) -> torch.Tensor:
    """Σ_n c g aᵀ (+ Σ_n c g₂ a₂ᵀ) per client and run for per-run inputs: c_g [K, O, M], a [K, I, M]
    -> [P, K, O·I]."""
    K, O, M = c_g.shape
    N = M // P
    if O <= NARROW:
        prod = c_g.reshape(K, O, 1, P, N) * a.reshape(K, 1, -1, P, N)
        if c_g2 is not None and a2 is not None:
            prod = prod + c_g2.reshape(K, O, 1, P, N) * a2.reshape(K, 1, -1, P, N)
        return prod.sum(-1).permute(3, 0, 1, 2).reshape(P, K, -1)  # [K, O, I, P] -> [P, K, O·I]

    def product(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.bmm(g.reshape(K, O, P, N).transpose(1, 2).reshape(K * P, O, N),
                         # [K·P, O, I]
                         x.reshape(K, -1, P, N).permute(0, 2, 3, 1).reshape(K * P, N, -1))

    prod = product(c_g, a) if c_g2 is None or a2 is None else product(c_g, a) + product(c_g2, a2)
    return prod.reshape(K, P, -1).transpose(0, 1)


def clipped_sums(cur: Pass, a_shared: torch.Tensor, c: torch.Tensor,
                 prev: Pass | None = None) -> torch.Tensor:
    """Σ_n c_n ∇ℓ(x, z_n) per client and run (or of the differences with ``prev``), flat: [P, K, d],
    float64.

    ``a_shared`` [P, N, F]: the input padded to N samples per client (samples m = p·N + n); ``c``
    [K, P·N]: the clip factors (0 for padding).
    """
    P, N, F = a_shared.shape
    c3 = c.unsqueeze(1)
    parts = []
    for l, g in enumerate(cur.grads):
        K, O, M = g.shape
        cdg = (g if prev is None else g - prev.grads[l]) * c3
        if l == 0:  # one product per client for every run: [K·O, N] @ [N, F]
            w = torch.bmm(cdg.reshape(K * O, P, N).transpose(0, 1), a_shared).reshape(P, K, O * F)
        else:
            a = cur.inputs[l - 1]
            if prev is None:
                w = _per_client(cdg, a, P)
            else:
                w = _per_client(cdg, a, P, prev.grads[l] * c3, a - prev.inputs[l - 1])
        parts += [w, cdg.reshape(K, O, P, N).sum(-1).permute(2, 0, 1)]
    return torch.cat(parts, dim=2)
