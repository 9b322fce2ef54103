"""Per-sample gradient norms and clipped sums of models built from common layers, without
materialising a per-sample gradient of the whole model ("ghost clipping", issue 41, item 1).

One forward and one backward per iterate. Forward hooks record each supported module's input a
and add to its output a zero (a scalar leaf that requires grad, broadcast to the output's shape:
no memory); the gradient that reaches it is ∂(Σ_i ℓ_i)/∂output, whose sample-i part is sample i's
output gradient b_i (no module mixes samples: batch-norm is refused).
The backward asks for those gradients only, so no parameter gradient is formed. Per layer kind:

- ``Linear`` (inputs [n, ..., in], any number of positions T) and ``Conv1d``/``Conv2d`` (groups 1,
  zero padding; the input unfolded into patches, positions = output locations): the per-sample
  gradient of (W, bias) is Bᵀ Ã with Ã = (a, 1) [T, in + 1] (the column of ones is carried as
  an indicator, never stored) and B = b [T, out]. A difference of two iterates is B₁ᵀÃ₁ - B₂ᵀÃ₂
  (P = 2T positions; (B₁ - B₂)ᵀÃ₁ with P = T when Ã₁ = Ã₂, as for a first layer). Then either

  * Gram form (when :data:`~.ghost_parts.GRAM_COST` · P (in + out) < in·out, e.g. a wide layer on
    a few positions): the difference written in small differences (the batched MLP engine's lesson,
    see :mod:`~diff2_flwr.core.ghost`), (B₁ - B₂)ᵀÃ₁ + B₂ᵀ(Ã₁ - Ã₂) = BᵀÃ with the stacked
    B = [B₁ - B₂; B₂], Ã = [Ã₁; Ã₁ - Ã₂], so that its terms are of the difference's size, not
    the gradients'; ‖BᵀÃ‖² = ⟨ÃÃᵀ, BBᵀ⟩ in float64, the clipped sum Σ_i c_i B_iᵀÃ_i one float64
    matrix product; or
  * materialised (convolutions over many positions, narrow layers): D_i = B₁ᵀÃ₁ - B₂ᵀÃ₂ per
    sample, formed in the compute dtype as ``torch.func`` forms it, its norm and Σ c_i D_i in
    float64 (the norm is that of the very row that is summed, as on the ``torch.func`` path;
    nothing cancels unseen).

  The clipped sums take no second backward ("book-keeping", Bu et al.): with a and b recorded,
  Σ_i c_i ∇ℓ_i is a float64 product per layer, whereas a backward of Σ c_i ℓ_i would cost one
  more pass per iterate and sum in the compute dtype (float32 sums exceed the radius by ~1e-6).

  **Cancellation safeguard** (Gram form only). With S = Σ_s ‖Ã_s‖ ‖B_s‖, the computed ⟨ÃÃᵀ,
  BBᵀ⟩ is within E = 1.01·u·(in + out + P² + 1)·S² of the exact one (u = 2⁻⁵³; Higham,
  Accuracy and Stability of Numerical Algorithms, §3.1: each Gram entry within γ_in ‖Ã_s‖‖Ã_t‖,
  the P² products summed within γ_{P²} Σ|·| ≤ γ_{P²} S²; together γ_(in + out + P²) S². E is
  formed from the computed S, a non-negative sum within γ_(in + out + P + 4) of the true one: the
  1.01 covers that and γ's 1/(1 - k·u) where (in + out + P² + 1)·u <= 2⁻¹⁰, beyond which a layer
  is materialised, :func:`~.ghost_parts.gram_bounded`. In the safe ranges below nothing
  overflows, and what underflows is under 2⁻¹²⁰ of E). A sample's Gram value is kept only
  where it is ≥ 2³³·E (relative error ≤ 2⁻³³ ≈ 1.2e-10 on the squared norm, half that on the
  norm), S² lies in [2⁻⁶⁰⁰, 2⁶⁰⁰] and every non-zero row of Ã and B has a squared norm in [2⁻⁹⁰⁰,
  2⁹⁰⁰] (nothing that matters under- or overflows). Every other sample of that layer is
  materialised: its norm is then that of its computed row, its clipped sum added from that row
  (and left out of the Gram product, whose rounding relative to such a sample's norm is not
  bounded). A kept sample has S/‖D‖ ≤ 2¹⁰/√(in + out + P²), so its share of the float64
  product's rounding, ≤ γ_{nP}·c·S, is ≤ n·u·2¹⁰·C (1.2e-10·C for passes of 1024). Summed over
  the n kept samples of a pass, the product's rounding is at most n²·u·2¹⁰·C (1.2e-7·C for passes
  of 1024): in the worst case the sum's sensitivity may exceed 2C by that much, which no
  projection removes (``torch.func``'s float64 sum of n rows: n²·u·C). ``diff2 audit --engines``
  measures the realised excess: ≤ 1.3e-15 relative on its models at n = 16, 1.1e-10 at
  n = 1024.

- ``Embedding`` (no ``max_norm``, no ``scale_grad_by_freq``): the per-sample gradient's non-zero
  rows are the sums of b over equal token ids (``padding_idx`` rows stay 0); they are formed
  explicitly in float64 (``index_add`` over the distinct (sample, id) pairs: n·T·width work
  whatever the vocabulary) and clipped and summed as rows.
- ``LayerNorm`` / ``GroupNorm`` (affine): the per-sample gradients Σ b ⊙ x̂ and Σ b (x̂ recomputed
  from the recorded input), n × (2·width) numbers, formed in the compute dtype (as
  ``torch.func`` does) and clipped and summed in float64.
- Anything else that holds trainable parameters (``nn.MultiheadAttention``'s fused projections,
  ``PReLU``, custom parametrised modules, weights shared between modules, a supported module
  with a frozen weight): those parameters only get ``torch.func`` per-sample gradients
  (``vmap(grad)`` with respect to that subset), and their squared norms join the others.

**Bounds** (issue: no clipped contribution ever exceeds its radius). Each part also bounds the
true norm of the row its sums add (:class:`~.ghost_parts.Part`: ``norms·(1 + rel) + extra``, with
the sums' rounding of c·row on top):

- rows held (materialised, re-formed, norm layers, the ``torch.func`` fallback, a Gram-form sample
  not kept): their norms are :func:`~diff2_flwr.core.clipping.row_norms` in float64 of the rows as
  held (a float32 row converts exactly), so within :func:`~diff2_flwr.core.clipping.row_norm_error`
  of the width (pieces joined: :func:`~.ghost_parts.rows_error`);
- the embedding: its rows' norms joined by a second ``row_norms``: γ_(dim + K + 12), K the most
  distinct ids of a sample;
- a kept Gram value sq: ‖D‖ <= √(sq + E) <= fl(√sq)·(1 + fl(E/sq) + γ₃), and the product c·B that
  the sums round moves the row by u·c·S at most: + 2u·s.

Per sample, the layers' norms are joined by :func:`~diff2_flwr.core.clipping.row_norms` (scaled
where squares would under- or overflow), and so are their bounds, with a last relative γ_(L + 6)
(L parts) rounded upward; the clip factor is C over that bound, rounded down
(:func:`~diff2_flwr.core.clipping.clip_factors`): ‖c_i·row_i‖ <= C exactly. Counts of clipped
samples (computed norm > C) and of non-finite ones and the float64 sums follow
:func:`~diff2_flwr.core.clipping.clipped_sum` and the worker's
:func:`~diff2_flwr.core.gradients.finish_contribution`. A module's parameter used outside its own
call (``F.linear(x, self.fc.weight)``) would escape the hooks: the first call compares two
samples' norms with a plain backward's and refuses the model if they differ. A module called
several times (shared layers) has its calls' positions joined; one called at one iterate only
(control flow that depends on x) contributes its one term.

References:
    Murata & Suzuki (2023), Algorithm 1 (worker lines), Algorithm 2 (ClippedMean);
    Goodfellow (2015), "Efficient per-example gradient computations"; Li et al. (2022), "Large
    language models can be strong differentially private learners" (ghost clipping); Bu et al.
    (2023), "Differentially private optimization on large model at small cost" (book-keeping).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from .clipping import ClippedSum, clip_factors, row_norm_error, row_norms, upper_norms
from .ghost_parts import (KEEP_MARGIN, REFORM_BLOCK, Part, embedding_part, gram_error_bound,
                          matrix_part, no_sums, norm_part, rows_part)
from .gradients import LossFn, PerSampleGradients
from .memory import MARGIN, PROBES, Budget, Footprint

__all__ = ["GhostGradients", "GhostUnsupported", "KEEP_MARGIN", "gram_error_bound",
           "supported_modules"]

#: Relative difference of the first call's ghost and ``torch.func`` norms that refuses a model.
_VERIFY_RTOL = {torch.float64: 1e-8, torch.float32: 1e-3}

_LINEAR, _CONV, _EMBEDDING, _NORM = "linear", "conv", "embedding", "norm"


def _kind(module: nn.Module) -> str | None:
    """The rule that applies to ``module`` (exact types: a subclass may change ``forward``)."""
    t = type(module)
    if t is nn.Linear:
        return _LINEAR
    if t in (nn.Conv1d, nn.Conv2d):
        padding_ok = module.padding == "valid" or not isinstance(module.padding, str)
        plain = module.groups == 1 and module.padding_mode == "zeros"
        return _CONV if plain and padding_ok else None
    if t is nn.Embedding:
        return _EMBEDDING if module.max_norm is None and not module.scale_grad_by_freq else None
    if t in (nn.LayerNorm, nn.GroupNorm):
        return _NORM
    return None


def supported_modules(model: nn.Module) -> dict[str, tuple[nn.Module, str, dict[str, str]]]:
    """Module name -> (module, rule, {its parameter attribute: layout name}) for every module a
    rule covers: a supported type whose direct parameters are all trainable and used by no other
    module. The remaining trainable parameters take the ``torch.func`` fallback."""
    owners: dict[int, int] = {}
    for _, module in model.named_modules(remove_duplicate=False):
        for p in module.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    names = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
    out = {}
    for name, module in model.named_modules():
        kind = _kind(module)
        params = dict(module.named_parameters(recurse=False))
        if kind is None or not params:
            continue
        if all(id(p) in names and owners[id(p)] == 1 for p in params.values()):
            out[name] = (module, kind, {k: names[id(p)] for k, p in params.items()})
    return out


class GhostUnsupported(ValueError):
    """A model whose covered parameters are used outside their modules' calls (found by the first
    call's check): its ghost norms would be wrong; ``torch.func`` computes it."""


class GhostGradients(PerSampleGradients):
    """:class:`~diff2_flwr.core.gradients.PerSampleGradients` whose clipped means come from
    per-layer ghost norms and book-keeping sums (see the module's docstring); ``per_sample``,
    ``loss_and_gradient`` and the evaluation methods are inherited unchanged."""

    engine = "ghost"

    def __init__(self, model: nn.Module, loss: LossFn, *, dtype: torch.dtype = torch.float64,
                 chunk_size: int = 1024, budget: Budget | None = None,
                 fit_chunk: bool = False, device: torch.device | str = "cpu") -> None:
        super().__init__(model, loss, dtype=dtype, chunk_size=chunk_size, budget=budget,
                         fit_chunk=fit_chunk, device=device)
        self.rules = supported_modules(self.model)
        covered = {n for _, _, names in self.rules.values() for n in names.values()}
        self.fallback_names = tuple(n for n in self.layout.names if n not in covered)
        self._recording = False
        self._calls: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._verified = False
        #: measuring a memory plan (:meth:`measure_footprints`), and the most numbers per sample a
        #: block of re-formed rows has taken (its rows and what forming them takes)
        self._probing = False
        self._block_numbers = 0
        self._offsets = dict(zip(self.layout.names,
                                 (int(o) for o in np.cumsum((0,) + self.layout.sizes[:-1]))))
        for name, (module, _, _) in self.rules.items():
            module.register_forward_hook(self._hook(name))
        self._fallback = self._fallback_grad() if self.fallback_names else None

    def _hook(self, name: str):
        def record(module: nn.Module, inputs: tuple, output: torch.Tensor):
            if not self._recording:
                return None
            # a zero broadcast to the output's shape (no memory): the gradient that reaches it is
            # the output's; added in place where the output is a tensor of its own
            zero = torch.zeros((), dtype=output.dtype, device=output.device, requires_grad=True)
            tap = zero.expand(output.shape)
            self._calls.setdefault(name, []).append((inputs[0].detach(), tap))
            return output + tap if output._base is not None else output.add_(tap)
        return record

    def _fallback_grad(self):
        fallback = set(self.fallback_names)

        def one_sample_loss(mine: dict[str, torch.Tensor], rest: dict[str, torch.Tensor],
                            x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            out = functional_call(self.model, ({**rest, **mine}, self._buffers), (x.unsqueeze(0),))
            return self.loss(out, y.unsqueeze(0)).sum()

        per_sample = vmap(grad(one_sample_loss), in_dims=(None, None, 0, 0))

        def rows(params: dict[str, torch.Tensor], x: torch.Tensor,
                 y: torch.Tensor) -> torch.Tensor:
            mine = {k: v for k, v in params.items() if k in fallback}
            rest = {k: v for k, v in params.items() if k not in fallback}
            g = per_sample(mine, rest, x, y)
            return torch.cat([g[k].reshape(x.shape[0], -1) for k in self.fallback_names], dim=1)

        return rows

    def _record(self, params: dict[str, torch.Tensor], x: torch.Tensor,
                y: torch.Tensor) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Each covered module's calls as (input a, output gradient b) at ``params``."""
        self._calls = {}
        self._recording = True
        try:
            out = functional_call(self.model, (params, self._buffers), (x,))
        finally:
            self._recording = False
        calls, self._calls = self._calls, {}
        taps = [t for c in calls.values() for _, t in c]
        if not taps:
            return {}
        total = self.loss(out, y).sum()
        grads = torch.autograd.grad(total, taps, allow_unused=True) if total.requires_grad else [
            None] * len(taps)
        it = iter(grads)
        return {name: [(a, torch.zeros_like(t) if (g := next(it)) is None else g.detach())
                       for a, t in c] for name, c in calls.items()}

    def _parts(self, current: dict[str, torch.Tensor], previous: dict[str, torch.Tensor] | None,
               x: torch.Tensor, y: torch.Tensor) -> list[Part]:
        cur = self._record(current, x, y)
        prev = None if previous is None else self._record(previous, x, y)
        n = int(x.shape[0])
        parts = []
        for name, (module, kind, names) in self.rules.items():
            # popped: a layer's records are freed once its part is formed
            c1 = cur.pop(name, [])
            c2 = None if prev is None else prev.pop(name, [])
            if not c1 and not c2:
                parts.append(Part(torch.zeros(n, dtype=torch.float64, device=x.device),
                                  no_sums, 0.0))
            elif kind in (_LINEAR, _CONV):
                # the small probes of a memory plan: blocks of one sample (measure_footprints)
                small = self._probing and n <= max(PROBES)
                parts.append(matrix_part(module, names, c1, c2, n, 1 if small else None))
            elif kind == _EMBEDDING:
                parts.append(embedding_part(module, names, c1, c2, n))
            else:
                parts.append(norm_part(module, names, c1, c2, n))
        self._block_numbers = max([self._block_numbers] + [p.block_numbers for p in parts])
        if self._fallback is not None:
            rows = self._fallback(current, x, y)
            if previous is not None:
                rows = rows - self._fallback(previous, x, y)
            parts.append(rows_part([(rows, self._fallback_split())]))
        return parts

    def measure_footprints(self, x_vec: np.ndarray, features: torch.Tensor,
                           targets: torch.Tensor) -> dict[bool, Footprint]:
        """:meth:`PerSampleGradients.measure_footprints` with the re-formed rows' blocks counted as
        what they are: memory that stops growing with the pass once a block holds
        :data:`~.ghost_parts.REFORM_BLOCK` numbers. The probes of :data:`~.memory.PROBES` would
        read a block's growth as per-sample memory and charge it to every sample of a large pass
        (a plan 2.7× the measured peak on the bench's transformer); they run with blocks of one
        sample instead, and their lines add :meth:`_bounded_bytes`. Larger probes run their blocks
        as the rounds will."""
        self._probing, self._block_numbers = True, 0
        try:
            return super().measure_footprints(x_vec, features, targets)
        finally:
            self._probing = False

    def _bounded_bytes(self) -> int:
        """One full block of the widest re-formed layer seen so far: its rows in the compute dtype,
        their float64 copy and a float64 temporary, and what forming them takes; at most
        REFORM_BLOCK numbers, at most ``chunk_size`` rows."""
        numbers = min(REFORM_BLOCK, self.chunk_size * self._block_numbers)
        return math.ceil(MARGIN * numbers * (16 + self.dtype.itemsize))

    def _fallback_split(self) -> list[tuple[str, int]]:
        sizes = dict(zip(self.layout.names, self.layout.sizes))
        return [(k, sizes[k]) for k in self.fallback_names]

    def norms(self, x_current: np.ndarray, features: torch.Tensor, targets: torch.Tensor,
              x_previous: np.ndarray | None = None) -> torch.Tensor:
        """Per-sample norms ‖∇ℓ(x_current, z)‖ (or of the differences with ``x_previous``) [n],
        float64 (for tests and diagnostics)."""
        current = self._params(x_current)
        previous = None if x_previous is None else self._params(x_previous)
        parts = self._parts(current, previous, *self._on_device(features, targets))
        return row_norms(torch.stack([p.norms for p in parts], dim=1)).cpu()

    def verify(self, x_current: np.ndarray, x: torch.Tensor, y: torch.Tensor) -> None:
        """Refuse a model whose covered parameters are also used outside their modules' calls:
        the ghost norms of the first samples against one plain backward per sample."""
        x, y = x[:2], y[:2]
        ghost = self.norms(x_current, x, y)
        ref = row_norms(torch.stack([self._plain_gradient(x_current, x[i:i + 1], y[i:i + 1])
                                     for i in range(x.shape[0])]))
        tol = _VERIFY_RTOL.get(self.dtype, 1e-3)
        finite = torch.isfinite(ghost) & torch.isfinite(ref)
        if bool((finite & ((ghost - ref).abs() > tol * ref)).any()):
            raise GhostUnsupported(
                f"training.gradients 'ghost': the per-sample gradient norms of the first samples "
                f"differ from a plain backward's ({ghost.tolist()} vs {ref.tolist()}), so a "
                f"parameter of a covered module ({', '.join(self.rules) or 'none'}) is used "
                "outside that module's own call (weight tying, or F.linear(x, self.fc.weight)). "
                "Use gradients='torch_func' for this model.")
        self._verified = True

    def _plain_gradient(self, x_vec: np.ndarray, x: torch.Tensor,
                        y: torch.Tensor) -> torch.Tensor:
        """∇ of the summed loss of ``x`` by one plain backward, flat float64 (unused parameters:
        0)."""
        params = {k: v.requires_grad_(True) for k, v in self._params(x_vec).items()}
        out = functional_call(self.model, (params, self._buffers), (x,))
        tensors = [params[k] for k in self.layout.names]
        grads = torch.autograd.grad(self.loss(out, y).sum(), tensors, allow_unused=True)
        return torch.cat([(torch.zeros_like(t) if g is None else g).reshape(-1).to(torch.float64)
                          for g, t in zip(grads, tensors)])

    def _chunk_sum(self, x_current: np.ndarray, current: dict[str, torch.Tensor],
                   previous: dict[str, torch.Tensor] | None, xc: torch.Tensor, yc: torch.Tensor,
                   radius: float) -> ClippedSum:
        """One chunk of :meth:`PerSampleGradients.clipped_mean_of` by ghost norms and book-keeping
        sums: the same result up to float64 rounding, the same counts of clipped and non-finite
        samples (the radius checked by the caller, :meth:`PerSampleGradients._clipped_mean`)."""
        if not self._verified:
            self.verify(x_current, xc, yc)
        parts = self._parts(current, previous, xc, yc)
        norms, upper = _joined(parts)
        c = clip_factors(upper, radius)  # <= C / upper: no clipped row exceeds C
        total = torch.zeros(self.layout.dim, dtype=torch.float64, device=xc.device)
        for part in parts:  # each parameter belongs to one part: its slice is set once
            for name, value in part.sums(c).items():
                start = self._offsets[name]
                total[start:start + value.numel()] += value.reshape(-1)
        return ClippedSum(total, int(xc.shape[0]), int((norms > radius).sum()),
                          int((~torch.isfinite(norms)).sum()))


def _joined(parts: list[Part]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sample [n]: the parts' norms joined (the computed norm), and an upper bound of the true
    norm of the row the sums add: each part's bound (:class:`~.ghost_parts.Part`), joined by
    :func:`~diff2_flwr.core.clipping.row_norms` (its rounding, and once more the product by the
    factor, within γ_(L + 6) of the true join of the bounds), rounded upward."""
    norms = row_norms(torch.stack([p.norms for p in parts], dim=1))
    bounds = torch.stack([upper_norms(p.norms, p.rel, p.extra) for p in parts], dim=1)
    return norms, upper_norms(row_norms(bounds), row_norm_error(len(parts), torch.float64))
