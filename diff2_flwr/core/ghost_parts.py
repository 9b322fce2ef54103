"""The per-layer rules of ghost clipping (:mod:`.ghost_layers`): each supported layer's per-sample
norms [n] in float64, an upper bound of each sample's true norm, and its clipped sums given clip
factors, from the inputs and output gradients the hooks recorded at one or two iterates; the Gram
form's error bound and its safeguard (see :mod:`.ghost_layers`'s docstring for the rules and the
bounds)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .clipping import gamma, row_norm_error, row_norms

__all__ = ["GRAM_COST", "KEEP_MARGIN", "Part", "REFORM_BLOCK", "embedding_part",
           "gram_bounded", "gram_error_bound", "matrix_part", "no_sums", "norm_part",
           "reformed_part", "rows_error", "rows_part"]

#: Unit roundoff of float64.
_U = 2.0**-53
#: A Gram-form squared norm is kept where it is at least this many times its error bound.
KEEP_MARGIN = 2.0**33
#: The Gram form is taken where GRAM_COST · P (in + out) < in·out (P positions per sample).
GRAM_COST = 4
_SAFE_SQ = (2.0**-600, 2.0**600)
_SAFE_ROW_SQ = (2.0**-900, 2.0**900)

def gram_error_bound(s: torch.Tensor, inner: int, rows: int) -> torch.Tensor:
    """The bound E on |fl(⟨ÃÃᵀ, BBᵀ⟩) - ⟨ÃÃᵀ, BBᵀ⟩| in float64 for S = Σ_s ‖Ã_s‖‖B_s‖ (``s``,
    as computed), ``inner`` = in + out columns and ``rows`` = P positions (see the module's
    docstring), where :func:`gram_bounded` holds."""
    return 1.01 * _U * (inner + rows * rows + 1) * s * s


#: (inner + P² + 1)·u at most this: γ_(inner + P²) <= 1.001·u·(inner + P²), and the computed S
#: (non-negative sums of at most inner + P + 3 terms) within 0.1 % of the true one, so that the
#: 1.01 of :func:`gram_error_bound` covers both with room.
_GRAM_BOUNDED = 2.0**-10


def gram_bounded(inner: int, rows: int) -> bool:
    """Whether :func:`gram_error_bound` is a bound for ``inner`` columns and ``rows`` positions
    (P up to ~2^21: any Gram form a memory plan admits); a layer beyond is materialised."""
    return (inner + rows * rows + 1) * _U <= _GRAM_BOUNDED


def rows_error(widths: list[int]) -> float:
    """The relative error bound of a norm taken by :func:`~.clipping.row_norms` per piece of
    ``widths`` entries (float64) and, for several pieces, joined by ``row_norms`` of the pieces'
    norms, with the product by the factor on top (:func:`~.clipping.row_norm_error`): (1 + γ_(w+6))
    (1 + γ_(K+6)) <= 1 + γ_(w+K+12) (Higham, Lemma 3.3)."""
    if len(widths) == 1:
        return row_norm_error(widths[0], torch.float64)
    return row_norm_error(max(widths) + len(widths) + 6, torch.float64)


@dataclass(frozen=True)
class Part:
    """One layer's per-sample norms [n] (float64), the bound of their error, and its clipped sums
    given clip factors.

    The bound: the true norm of each sample's contribution to :attr:`sums`, the row it adds (as
    held: the compute dtype's rows, or the exact Bᵀ Ã of the Gram form) with its products by the
    factor rounded as the sums round them, over the factor, is at most ``norms · (1 + rel) +
    extra`` (each operation rounded upward: :func:`~.clipping.upper_norms`). Kept relative to
    :attr:`norms` (not an upper bound of its own), so that a part whose norms are replaced (the
    engine audit's broken engines) clips by the replaced norms."""

    norms: torch.Tensor
    sums: Callable[[torch.Tensor], dict[str, torch.Tensor]]
    #: relative part of the bound: a float, or [n] float64
    rel: float | torch.Tensor
    #: absolute part of the bound: a float, or [n] float64
    extra: float | torch.Tensor = 0.0
    #: numbers per sample of one block of re-formed rows (rows and what forming them takes), 0
    #: for a part that holds its rows (:func:`reformed_part`)
    block_numbers: int = 0


def no_sums(c: torch.Tensor) -> dict[str, torch.Tensor]:
    """The sums of a covered module that took no part in the forward pass: nothing to add."""
    return {}


def rows_part(pieces: list[tuple[torch.Tensor, list[tuple[str, int]]]]) -> Part:
    """Materialised rows, given as pieces ([n, Σ sizes] in any float dtype, with the layout names
    of their columns): their joint norms and Σ c_i row_i per name, both in float64."""
    def sums(c: torch.Tensor) -> dict[str, torch.Tensor]:
        out = {}
        for rows, split in pieces:
            if rows.dtype == torch.float64:
                out.update(_split(rows.T @ c, split))
                continue
            total = torch.zeros(rows.shape[1], dtype=torch.float64, device=rows.device)
            for start, block in _blocks64(rows):
                total.addmv_(block.T, c[start:start + len(block)])
            out.update(_split(total, split))
        return out

    norms = [_norms64(rows) for rows, _ in pieces]
    # the rows' norms are taken in float64 of the rows as held (a float32 row converts exactly),
    # and the sums add those rows times c in float64
    rel = rows_error([rows.shape[1] for rows, _ in pieces])
    return Part(norms[0] if len(norms) == 1 else row_norms(torch.stack(norms, dim=1)), sums, rel)


#: Numbers per block of re-formed rows (a block's rows in the compute dtype and in float64).
REFORM_BLOCK = 2**21


def reformed_part(form: Callable[[slice], list[torch.Tensor]], n: int,
                  split: list[tuple[str, int]], block_rows: int | None = None,
                  forming: int = 0) -> Part:
    """Rows that are formed twice instead of held: ``form(samples)`` -> the rows of those samples,
    one tensor per entry of ``split`` ([m, size], any float dtype), formed by the same operations
    on the same shapes each time. Pass 1 forms them block by block for their norms (float64); the
    sums form each block again and add Σ c_i row_i in float64. A layer's rows then never occupy
    more than one block, whatever the chunk, and only while that layer is computed: the block's
    buffer is taken for each pass and given back after it, so the layers waiting for their clip
    factors hold their records only (issue 41, item 2). A block holds ``block_rows`` rows (default:
    as many as fit in :data:`REFORM_BLOCK` numbers, counting the ``forming`` numbers per sample
    that forming a row takes on the way, e.g. a convolution's unfolded patches).

    The norm a factor was made from is that of the very row summed: each re-formed block's norms
    are read again, and a row whose norm came out larger (a kernel that is not deterministic) has
    its factor scaled by the ratio of the two norms, rounded toward 0 (and the product too), to
    keep c_i·‖row_i‖ within the bound pass 1 allowed (the same relative bound holds for both
    passes' norms: the same operations on rows of the same widths)."""
    width = sum(size for _, size in split)
    size = max(1, min(n, block_rows or REFORM_BLOCK // max(width + forming, 1)))
    blocks = [slice(start, min(n, start + size)) for start in range(0, n, size)]
    columns, at = [], 0
    for _, piece in split:
        columns.append(slice(at, at + piece))
        at += piece

    def block64(rows: list[torch.Tensor], buffer: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's rows in float64 (in the pass's buffer) and their norms."""
        m = rows[0].shape[0]
        block = buffer[:m]
        norms = [row_norms(block[:, cols].copy_(piece)) for cols, piece in zip(columns, rows)]
        return block, norms[0] if len(norms) == 1 else row_norms(torch.stack(norms, dim=1))

    def buffer_like(rows: list[torch.Tensor]) -> torch.Tensor:
        """One float64 buffer for a pass's blocks (one allocation per pass, not per block)."""
        return torch.empty(min(size, n), width, dtype=torch.float64, device=rows[0].device)

    first = form(blocks[0])
    buffer = buffer_like(first)
    norms = torch.cat([block64(first if i == 0 else form(b), buffer)[1]
                       for i, b in enumerate(blocks)])
    del first, buffer

    def sums(c: torch.Tensor) -> dict[str, torch.Tensor]:
        total = buffer = None
        for b in blocks:
            rows = form(b)
            if buffer is None:
                buffer = buffer_like(rows)
                total = torch.zeros(width, dtype=torch.float64, device=buffer.device)
            block, again = block64(rows, buffer)
            del rows
            first, factor = norms[b], c[b]
            if not torch.equal(again, first):
                larger, zero = again > first, torch.zeros_like(factor)
                ratio = torch.nextafter(first / torch.where(larger, again, 1.0), zero)
                factor = torch.where(larger, torch.nextafter(factor * ratio, zero), factor)
            total.addmv_(block.T, factor)
        return _split(total, split)

    return Part(norms, sums, rows_error([size for _, size in split]),
                block_numbers=width + forming)


def _norms64(rows: torch.Tensor) -> torch.Tensor:
    """:func:`~diff2_flwr.core.clipping.row_norms` in float64 of rows in any float dtype."""
    if rows.dtype == torch.float64:
        return row_norms(rows)
    norms = torch.empty(rows.shape[0], dtype=torch.float64, device=rows.device)
    for start, block in _blocks64(rows):
        norms[start:start + len(block)] = row_norms(block)
    return norms


def _blocks64(rows: torch.Tensor):
    """(first row, float64 copy of a block of rows) over ``rows``, through one small buffer: a
    float64 copy of the whole would cost a fresh allocation's page faults (~10x the conversion)
    and twice the memory."""
    size = max(1, min(rows.shape[0], 2**18 // max(rows.shape[1], 1)))
    buffer = torch.empty(size, rows.shape[1], dtype=torch.float64, device=rows.device)
    for start in range(0, rows.shape[0], size):
        block = buffer[:min(size, rows.shape[0] - start)]
        block.copy_(rows[start:start + size])
        yield start, block


def _conv_rows(module: nn.Module, a: torch.Tensor, b: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """A convolution as a linear layer over patches: (patches [n, L, C·k], b [n, L, out])."""
    n = a.shape[0]
    if isinstance(module, nn.Conv1d):
        padding = 0 if module.padding == "valid" else module.padding[0]
        cols = F.unfold(a.unsqueeze(2), (1, module.kernel_size[0]),
                        dilation=(1, module.dilation[0]), padding=(0, padding),
                        stride=(1, module.stride[0]))
    else:
        padding = 0 if module.padding == "valid" else module.padding
        cols = F.unfold(a, module.kernel_size, dilation=module.dilation, padding=padding,
                        stride=module.stride)
    return cols.transpose(1, 2), b.reshape(n, b.shape[1], -1).transpose(1, 2)


def _matrix_rows(module: nn.Module, calls: list[tuple[torch.Tensor, torch.Tensor]],
                 idx: slice | torch.Tensor = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
    """A [m, T, in] and B [m, T, out] of the samples ``idx`` over all calls (positions of every
    call one after another): a convolution's patches are unfolded for those samples only, so that
    a materialised layer never holds the unfolded patches of a whole pass (issue 41, item 2)."""
    a_rows, b_rows = [], []
    for a, b in calls:
        a, b = a[idx], b[idx]
        m = a.shape[0]
        if isinstance(module, nn.Linear):
            a_t, b_t = a.reshape(m, -1, a.shape[-1]), b.reshape(m, -1, b.shape[-1])
        else:
            a_t, b_t = _conv_rows(module, a, b)
        a_rows.append(a_t)
        b_rows.append(b_t)
    if len(calls) == 1:
        return a_rows[0], b_rows[0]
    return torch.cat(a_rows, dim=1), torch.cat(b_rows, dim=1)


def _positions(module: nn.Module, calls: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    """T, the positions per sample over all calls, from the shapes alone (nothing unfolded)."""
    if isinstance(module, nn.Linear):
        return sum(b[0].numel() // b.shape[-1] for _, b in calls)
    return sum(b[0, 0].numel() for _, b in calls)


#: One term ±B_kᵀ A_k of a layer's per-sample gradient (difference), whether its positions also
#: carry the bias (Σ_t B_k,t), and its sign: (B_k, A_k, carries, sign).
_Term = tuple[torch.Tensor, torch.Tensor, bool, float]
#: A term whose rows are formed on demand: (samples -> (B_k, A_k) of those samples, positions T_k,
#: carries, sign).
_LazyTerm = tuple[Callable[[slice | torch.Tensor], tuple[torch.Tensor, torch.Tensor]], int, bool,
                  float]


def _terms(module: nn.Module, cur: list, prev: list | None) -> list[_LazyTerm]:
    """The gradient (restart) or the difference B₁ᵀÃ₁ - B₂ᵀÃ₂ (one term (B₁ - B₂)ᵀÃ₁ when Ã₁ =
    Ã₂, as for a first layer), each term's rows formed for the samples asked."""
    def rows(calls: list) -> Callable[[slice | torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        def form(idx: slice | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            a, b = _matrix_rows(module, calls, idx)
            return b, a
        return form

    if not cur:  # called at the previous iterate only (control flow that depends on x)
        return [(rows(prev or []), _positions(module, prev or []), True, -1.0)]
    t1 = _positions(module, cur)
    if not prev:
        return [(rows(cur), t1, True, 1.0)]
    same = len(cur) == len(prev) and all(
        a1.shape == a2.shape and torch.equal(a1, a2) for (a1, _), (a2, _) in zip(cur, prev))
    if same:
        first, second = rows(cur), rows(prev)

        def difference(idx: slice | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            b1, a1 = first(idx)
            return b1 - second(idx)[0], a1
        return [(difference, t1, True, 1.0)]
    return [(rows(cur), t1, True, 1.0), (rows(prev), _positions(module, prev), True, -1.0)]


def _small_differences(terms: list[_Term]) -> list[_Term]:
    """B₁ᵀÃ₁ - B₂ᵀÃ₂ as (B₁ - B₂)ᵀÃ₁ + B₂ᵀ(Ã₁ - Ã₂): terms of the size of the difference, not of
    the gradients (the Gram form's error is relative to them); other term lists as they are."""
    if len(terms) != 2 or terms[0][1].shape != terms[1][1].shape:
        return terms
    (b1, a1, _, _), (b2, a2, _, _) = terms
    return [(b1 - b2, a1, True, 1.0), (b2, a1 - a2, False, 1.0)]


def _materialised(terms: list[_LazyTerm], bias: bool, idx: slice | torch.Tensor = slice(None)
                  ) -> list[torch.Tensor]:
    """Per-sample rows of the samples ``idx``, weight [m, out·in] and bias [m, out], formed and
    kept in the compute dtype as ``torch.func`` forms them (norms and sums read them in
    float64)."""
    weight = bias_sum = None
    for form, _, carries, sign in terms:
        b, a = form(idx)
        if weight is None:
            weight = torch.bmm(b.transpose(1, 2), a)
            if sign < 0:
                weight.neg_()
        else:
            weight.baddbmm_(b.transpose(1, 2), a, alpha=sign)
        if bias and carries:
            part = b.sum(1)
            bias_sum = part * sign if bias_sum is None else bias_sum.add_(part, alpha=sign)
    rows = [weight.reshape(weight.shape[0], weight.shape[1] * weight.shape[2])]
    return rows + [bias_sum] if bias else rows


def _held(terms: list[_Term]) -> list[_LazyTerm]:
    """Terms already formed, as lazy terms (their samples taken by indexing)."""
    return [(lambda idx, b=b, a=a: (b[idx], a[idx]), b.shape[1], carries, sign)
            for b, a, carries, sign in terms]


def matrix_part(module: nn.Module, names: dict[str, str], cur: list, prev: list | None,
                 n: int, block_rows: int | None = None) -> Part:
    """Linear / convolution: Gram form with the cancellation safeguard, or materialised rows
    (re-formed in blocks of ``block_rows`` samples, :func:`reformed_part`)."""
    lazy = _terms(module, cur, prev)
    bias = module.bias is not None
    out = module.weight.shape[0]
    inner = module.weight[0].numel()
    rows = sum(t[1] for t in lazy)
    split = [(names["weight"], out * inner)] + ([(names["bias"], out)] if bias else [])
    # Gram form: P²(in + out) float64 work and an [n·P] x [n·P] float64 product for the sums,
    # against P·in·out in the compute dtype and n·in·out numbers to hold
    if (GRAM_COST * rows * (inner + bias + out) >= (inner + bias) * out
            or not gram_bounded(inner + bias + out, rows)):
        # forming a row takes each term's A (a convolution's patches: unfolded per block) and B
        forming = sum(t[1] for t in lazy) * (inner + out)
        return reformed_part(lambda idx: _materialised(lazy, bias, idx), n, split, block_rows,
                             forming)
    terms = _small_differences([(*form(slice(None)), carries, sign)
                                for form, _, carries, sign in lazy])
    a = torch.cat([t[1] for t in terms], dim=1).to(torch.float64)
    b = torch.cat([t[0] * t[3] for t in terms], dim=1).to(torch.float64)
    ind = torch.cat([torch.full((t[0].shape[1],), float(bias and t[2]), dtype=torch.float64,
                                device=a.device)
                     for t in terms])
    ra, rb = (a * a).sum(2) + ind, (b * b).sum(2)
    s = (ra.sqrt() * rb.sqrt()).sum(1)
    if rows == 1:
        sq = ra[:, 0] * rb[:, 0]
    else:
        gram_a = torch.bmm(a, a.transpose(1, 2)) + ind[:, None] * ind[None, :]
        sq = (gram_a * torch.bmm(b, b.transpose(1, 2))).sum((1, 2))
    error = gram_error_bound(s, inner + bias + out, rows)
    bounded = ((sq >= KEEP_MARGIN * error) & (s * s >= _SAFE_SQ[0]) & (s * s <= _SAFE_SQ[1]))
    # S = 0 with every row exactly 0 or safely scaled: each term has a zero factor, D = 0
    keep = _rows_safe(a, ra) & _rows_safe(b, rb) & (bounded | (s == 0))
    norms = torch.where(keep, sq.clamp(min=0).sqrt(), 0.0)
    idx = torch.nonzero(~keep).flatten()
    exact = torch.cat(_materialised(_held(terms), bias, idx), dim=1).to(torch.float64)
    norms = norms.index_put((idx,), row_norms(exact))
    rel_gram, extra_gram = _gram_bound(sq, error, s)
    rel = torch.where(keep, rel_gram, rows_error([exact.shape[1]]))
    extra = torch.where(keep, extra_gram, 0.0)

    def sums(c: torch.Tensor) -> dict[str, torch.Tensor]:
        cb = b * torch.where(keep, c, 0.0)[:, None, None]
        total = (cb.reshape(-1, out).T @ a.reshape(-1, inner)).reshape(-1)
        if bias:
            total = torch.cat([total, (cb * ind[None, :, None]).sum((0, 1))])
        return _split(total + exact.T @ c[idx], split)

    return Part(norms, sums, rel, extra)


def _gram_bound(sq: torch.Tensor, error: torch.Tensor, s: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rel, extra) [n] of a Gram-form norm √sq (:class:`Part`) from its error bound E
    (``error``) and the computed S (``s``).

    The true ‖D‖² is at most sq + E, and √(sq + E) <= √sq (1 + E / (2 sq)); √sq <= fl(√sq) /
    (1 - u). fl(E / sq) + γ_3 covers both (it is at least E/sq (1 - 2u) + 3u(1 - u): twice the
    first term, and the second's (1 + E / (2 sq)) u / (1 - u) beside it). Where sq <= 0 (S = 0,
    or a test's KEEP_MARGIN of 0) ‖D‖ <= √E. The sums round c·B once per entry: the row they add
    is within u·c·S of c D, and 2u·s >= u·S (s is within 0.1 % of S, :func:`gram_bounded`)."""
    positive = sq > 0
    rel = torch.where(positive, error / torch.where(positive, sq, 1.0), 0.0) + gamma(3)
    # 2^-52 · s is exact (s is 0 or at least 2^-300 where it is kept)
    extra = 2 * _U * s + torch.where(positive, 0.0, error.sqrt() * (1 + gamma(2)))
    return rel, extra


def _rows_safe(m: torch.Tensor, sq: torch.Tensor) -> torch.Tensor:
    """Per sample: every row of ``m`` [n, P, w] is exactly 0 or has a squared norm ``sq`` [n, P]
    in [2⁻⁹⁰⁰, 2⁹⁰⁰] (a row of tiny entries whose squares underflowed to 0 is not safe)."""
    ok = (sq >= _SAFE_ROW_SQ[0]) & (sq <= _SAFE_ROW_SQ[1])
    zero = sq == 0
    if bool(zero.any()):
        where = torch.nonzero(zero, as_tuple=True)
        ok = ok.index_put(where, m[where].abs().amax(1) == 0 if m.shape[2] else
                          torch.ones_like(where[0], dtype=torch.bool))
    return ok.all(1)


def _split(flat: torch.Tensor, split: list[tuple[str, int]]) -> dict[str, torch.Tensor]:
    """A flat float64 sum -> {layout name: its part}, in the order of ``split``."""
    out, start = {}, 0
    for name, size in split:
        out[name] = flat[start:start + size]
        start += size
    return out


def embedding_part(module: nn.Embedding, names: dict[str, str], cur: list, prev: list | None,
                    n: int) -> Part:
    """Embedding: the non-zero rows of each sample's gradient, formed exactly by ``index_add``."""
    if not cur:  # called at the previous iterate only: its rows, negated
        cur, prev = [(a, -g) for a, g in prev or []], None
    ids1 = torch.cat([a.reshape(n, -1) for a, _ in cur], dim=1)
    b1 = torch.cat([b.reshape(n, -1, module.embedding_dim) for _, b in cur], dim=1)
    ids, b = ids1, b1.to(torch.float64)
    if prev:
        ids2 = torch.cat([a.reshape(n, -1) for a, _ in prev], dim=1)
        b2 = torch.cat([g.reshape(n, -1, module.embedding_dim) for _, g in prev], dim=1)
        if ids1.shape == ids2.shape and torch.equal(ids1, ids2):
            b = (b1 - b2).to(torch.float64)
        else:
            ids, b = torch.cat([ids1, ids2], 1), torch.cat([b1, -b2], 1).to(torch.float64)
    if module.padding_idx is not None:
        b = b * (ids != module.padding_idx).unsqueeze(2)
    vocab = module.num_embeddings
    device = ids.device
    keys = torch.arange(n, device=device).unsqueeze(1) * vocab + ids.long()
    uniq, inverse = torch.unique(keys.reshape(-1), return_inverse=True)
    rows = torch.zeros(len(uniq), module.embedding_dim, dtype=torch.float64, device=device)
    rows.index_add_(0, inverse, b.reshape(-1, module.embedding_dim))
    sample = torch.div(uniq, vocab, rounding_mode="floor")
    counts = torch.bincount(sample, minlength=n)
    position = torch.arange(len(uniq), device=device) - (torch.cumsum(counts, 0) - counts)[sample]
    per_sample = torch.zeros(n, int(counts.max()) if len(uniq) else 0, dtype=torch.float64,
                             device=device)
    per_sample[sample, position] = row_norms(rows)
    # the rows' norms (width dim), joined per sample by a second row_norms over K of them:
    # (1 + γ_(dim+6)) (1 + γ_(K+6)) <= 1 + γ_(dim+K+12)
    rel = row_norm_error(module.embedding_dim + per_sample.shape[1] + 6, torch.float64)
    weight = names["weight"]

    def sums(c: torch.Tensor) -> dict[str, torch.Tensor]:
        total = torch.zeros(vocab, module.embedding_dim, dtype=torch.float64, device=device)
        total.index_add_(0, uniq - sample * vocab, rows * c[sample].unsqueeze(1))
        return {weight: total.reshape(-1)}

    return Part(row_norms(per_sample), sums, rel)


def _norm_rows(module: nn.Module, calls: list, n: int, device: torch.device) -> torch.Tensor:
    """LayerNorm / GroupNorm: per-sample (Σ b ⊙ x̂, Σ b) [n, 2·width], float64 (each call's
    entries formed in the compute dtype, as ``torch.func`` forms them; a missing weight or bias
    leaves its half out)."""
    weight, bias = module.weight is not None, module.bias is not None
    width = (module.weight if weight else module.bias).numel()
    total = torch.zeros(n, width * (int(weight) + int(bias)), dtype=torch.float64,
                        device=device)
    for a, b in calls:
        if isinstance(module, nn.LayerNorm):
            xhat = F.layer_norm(a, module.normalized_shape, None, None, module.eps)
            prod, b_t = (b * xhat).reshape(n, -1, width), b.reshape(n, -1, width)
            gw, gb = prod.sum(1), b_t.sum(1)
        else:
            xhat = F.group_norm(a, module.num_groups, None, None, module.eps)
            prod, b_t = (b * xhat).reshape(n, width, -1), b.reshape(n, width, -1)
            gw, gb = prod.sum(2), b_t.sum(2)
        total += torch.cat(([gw] if weight else []) + ([gb] if bias else []), dim=1).to(
            torch.float64)
    return total


def norm_part(module: nn.Module, names: dict[str, str], cur: list, prev: list | None,
               n: int) -> Part:
    """LayerNorm / GroupNorm: materialised per-sample rows (2·width numbers each)."""
    device = (cur or prev)[0][0].device
    rows = _norm_rows(module, cur, n, device)
    if prev is not None:
        rows = rows - _norm_rows(module, prev, n, device)
    split = [(names[k], getattr(module, k).numel()) for k in ("weight", "bias")
             if getattr(module, k) is not None]
    return rows_part([(rows, split)])
