"""Ghost clipping of a one-hidden-layer MLP in one fused pass: a small C++ kernel
(``fused_ghost.cpp``, beside this file) built once per machine and loaded with ``ctypes``.

For K runs of an MLP with widths (F, H, O) and P clients of N samples each (M = P·N, side by side),
:func:`clipped_sums` takes the forward pass's quantities in the compute dtype — hidden activations a
[K, H, M], φ'(h) [K, H, M], output gradient g_L [K, O, M] (from torch: any activation, ½-squared
error or cross-entropy) and output weights W_2 [K, O, H] — at x and, for a difference, at x', and
returns what :mod:`diff2_flwr.core.ghost` gives from them: per client and run, the clipped sums Σ_n
c_n ∇ℓ (or of the differences) [P, K, d] in float64 and whether a real sample's norm was not finite
[P, K]. Per sample it does, in one pass over blocks of 16 samples of one client and run:

    g_1 = (W_2ᵀ g_L) ⊙ φ'(h)                 in the compute dtype, as
    :func:`~diff2_flwr.core.ghost.forward`, ‖·‖² = ‖dg_1‖²(1 + ‖x‖²) + ‖dg_L‖²(1 + ‖a‖²) +
    ‖g_L'‖²‖da‖² + 2(dg_L·g_L')(a·da)    in float64, an upper bound U of the true norm, c = rad/U
    (rounded down) if U > rad else 1, times the mask (0 for padding),

the formulas of :func:`~diff2_flwr.core.ghost.norm_bounds` (difference form; a plain row is g' = 0,
a' = a, as :meth:`~diff2_flwr.core.ghost.Pass.restarting`; its κ from :func:`norm_errors`, the clip
factor :func:`~diff2_flwr.core.clipping.clip_factors`'s: a clipped row's true norm never exceeds
rad; the overflow flag is on the computed norm), with its safeguards: where the last three
terms cancel (A + B > 16 (A + B + X)) the output layer's term is taken from its QR form instead, and
a sample whose squares may have underflowed or overflowed has its norm taken again with every factor
scaled by a power of two — both only for the blocks and samples that need it (elsewhere they cost a
comparison per sample), each sample's result its own. It adds c·(the per-sample gradient) into
float64 per-lane sums — no [K, H, M] float64 tensor is ever formed. The sums over samples are taken
in another order than the torch path's matrix products (per lane over the blocks, then over the
lanes): equal to rounding, and deterministic — same inputs, same bits, whatever the other runs and
clients of the call.

Layouts: the sample arrays (inputs, parts) are rows of samples [.., R, M], or — ``blocked``
(:func:`to_blocked`) — each block's R rows one after another, so that a block is a few contiguous
cache lines; the kernel does the same operations on the same values in either (the same bits). The
engine's kernel-forward rounds use the blocked one: in rows, a difference round streams about sixty
rows M apart (inputs, this pass written, the previous one read), more than the caches' prefetchers
follow (measured 1.2–1.8× faster blocked, same bits).

The kernel is compiled with ``-O3 -ffp-contract=off`` and no ``-ffast-math``: every operation is one
IEEE operation in the order written and lanes are independent samples, so the bits do not depend on
the vector width (the build targets torch's CPU capability: AVX-512, AVX2 or the x86-64 baseline; a
test compares the baseline build with this machine's bit for bit). It is cached under
``$TORCH_EXTENSIONS_DIR`` (else torch's default extensions folder) in ``diff2_fused/``, named by the
capability and a hash of its source, flags and compiler; a build takes ≈ 5 s, once per machine
(processes that build at once each write their own file and rename it into place). Without a working
C++ compiler :func:`load` returns None after one warning on stderr, and the batched engine keeps the
torch path (same maths, slower).

Float32 accumulation (``accumulate="float32"``: opt-in, float32 compute dtype only). The float64
sums above cost a float32 round much of its time (KDD Cup 99's first-layer product: about a third).
In this mode the norms and clip factors are taken as above, in float64, and the sums go through
float32 (measured against float64 mode, one thread, interleaved on a loaded machine: the kernel's
and W_1's product's time 0.41x on KDD Cup 99's shapes — 118 features, K = 8, 10 clients of 39,522
samples — 0.54x in difference rounds, a round with torch's compiled forward 0.66x and 0.70x;
California Housing's kernel-forward rounds, K = 1 or 18, 0.91x and 0.90-0.96x):

- each lane's terms (W_1, b_1, W_2, b_2) go into float32 partials for a window of :data:`FLUSH`
  blocks of a client at fixed positions (blocks w·FLUSH .. (w + 1)·FLUSH - 1, the client's last,
  partial block in the last window): a lane's partial holds at most m = FLUSH samples, and each
  window's partials are then added into the float64 lane sums. The terms: c S dg_1, c S dg_L, c S
  g_L' formed in float64 and rounded to float32 once (S a power of two per run, S·C' in [2^62,
  2^63): exact, nothing overflows, and what underflows in float32 is 2^-150 absolute, below 2^-212
  of S·C'), times x (rounded to float32) or a (the float32 input) in float32; the output layer's
  difference terms c S (dg_L a + g_L' da) formed in float64 (the two products may cancel: float32
  would lose the difference) and rounded once. A lane whose x is beyond float32's range takes
  W_1's terms in float64, straight into its float64 lane sums;
- with ``x_rows`` (many features; :func:`product_rows`: the float32 inputs, zero-padded), W_1's
  sums are block products instead: per product block of :data:`PRODUCT_BLOCK` consecutive samples
  of a client (fixed; the last padded with zeros) and per run, the kernel's own float32 product
  c S dg_1 [H, b] @ x [b, F] (each entry added in sample order from 0, no FMA: the same bits on any
  instruction set and whatever the other runs — a BLAS product's bits may depend on its shape,
  i.e. on the batch's runs), the block results added into float64 in block order. It replaces the
  float64 mode's matrix product of c·dg_1 [K, H, M] with the inputs.

Sensitivity (replace-one; the accountant's 2C per client sum). Let e_n be record n's exact row
(from the float64 dg, a, x the kernel forms, as in float64 mode), t̃_n its row with the output
layer's difference terms as formed in float64 and everything else exact, and t_n its row as the
sums take it (after the float32 steps), all times c S.

(i) ‖t̃_n‖ ≤ S·C'. The forming error of the difference terms is at most γ_3(u64)·c·w, w = ‖dg_L‖
‖ã‖ + ‖g_L'‖ ‖da‖ (relative to the terms, not to the row). This mode passes κ + δ, δ = γ_32(u64)
(:data:`FORMING_ERROR`), for κ and κ_s (:func:`norm_errors`), which raises every bound U of
:func:`~diff2_flwr.core.ghost.norm_bounds` by at least that: a QR-form lane's root by δ(√A + 4√B) ≥
γ_3·w; a scaled lane's by δ·width; an expanded lane's squared bracket by δ(A + B + |X|), at least
2·γ_3·w·b + (γ_3·w)² for its bound b ≥ ‖e_2‖ since there A + B ≤ 16·bracket and |X| ≤ A + B (so
b² ≤ 2.01 (A + B), w ≤ √(2 (A + B))); plain rows form their terms to a relative γ_2, inside the
last factor 1 + κ + δ. So c (‖e_n‖ + γ_3 w) ≤ c U ≤ C'.
(ii) ‖t_n‖ ≤ (1 + γ_6(u32)) ‖t̃_n‖: per entry, two roundings of a factor (float64, then float32),
one of x, the float32 product, and underflow's 2^-150 absolute (at most 2^-212 of S·C') — within
a relative γ_6 (a far lane's W_1 terms, in float64: γ_2(u64)).
(iii) A lane's window partial, or a product block's entry, is a float32 sum of at most m terms:
within γ_m(u32) Σ|terms| (the block product rounds each term's product: counted in γ_m), so within
m γ_m(u32) max‖t‖ in norm.
(iv) Every float64 sum downstream (per lane over its windows and far lanes' terms, over the 16
lanes; over a client's product blocks) has at most L = 2⌈N/16⌉ + 16 additions of values
whose norms add to at most N max‖t‖ (1 + m γ_m): within γ_L(u64) of that.

Replacing record i changes its own row and the partials that hold it: one lane's window, and with
``x_rows`` also one product block (its W_1 entries; the window holds the others). Every other
partial is the same bits: same records at the same fixed positions, each lane's treatment its own
sample's, the kernel deterministic (its block products too). A partial of m terms rounds each entry
by at most γ_m times the sum of its terms' magnitudes, so over the entries it holds by at most m γ_m
max‖t‖; the window's and the block's entries are disjoint, and the records in one need not be the
records in the other, so together they round by at most √2 m γ_m max‖t‖ (each part of a row is at
most the row). So the released sum moves by at most

    ‖t_i - t_i'‖ + 2 k m γ_m max‖t‖ + 2 N γ_L max‖t‖ (1 + k m γ_m) ≤ 2 C' (1 + ρ),
    1 + ρ = (1 + γ_6(u32)) (1 + k m γ_m(u32)) (1 + N γ_L(u64)),

k = 1 in lanes alone, k = √2 (taken as 1.414214) with block products (after the exact division by
S), and the kernel clips at C' = C / (1 + ρ) rounded down (:func:`accumulation_error`,
:func:`float32_radii`, ``products``): the sensitivity is at most 2C. With FLUSH = PRODUCT_BLOCK = 64
(m = 64): in lanes ρ = 2.4450e-4 for N = 1,652 (m γ_64(2^-24) = 2.4414e-4; γ_6(2^-24) =
3.6e-7; N γ_L(u64) = 2e-8); with block products ρ = 3.456e-4 for N = 39,522; a clipped row is
2.4e-4 (3.5e-4) shorter than in float64 mode. (Until stop 52 the block-product case took k = 1: its
bound was short by the factor √2 on the m γ_m term, about 1.0e-4 of 2C at most; no attack reached
it — crafted windows reach about 1/8 of m γ_m — but the proof did not hold as written.) It needs
C ≥ 2^-900 (:data:`~diff2_flwr.core.clipping.RADIUS_FLOOR`; 0 and inf are
taken: inf, no clipping, sums in float32 windows at S = 1 and bounds nothing). Float64 mode is
unchanged: its own float64 rounding (~N γ_L(u64) of the sum's scale, and γ_3(u64) w per difference
row) is not shrunk for.

Two-valued columns (``two_valued``: opt-in, with ``x_rows``; KDD Cup 99's one-hot and binary
columns, 86 of its 118 over its training records, 87 over its test split). A column j whose records
take two values is written with its base b_j, the value of smaller magnitude (after centring, the
majority's: n_b |b| = n_m |m|), and its other value m_j. Then Σ_n u_n x_nj = b_j (S - S_min,j -
S_exc,j) + m_j S_min,j + E_j, with u_n sample n's c·dg_1 as the W_1 sums take it (float64 mode: the
float64 c dg_1; float32 mode: fl32(c S dg_1), the block products' own), S = Σ_n u_n, S_min,j = Σ u_n
over the records whose value is m_j, and over the records with any other value v (exceptions)
S_exc,j = Σ u_n and E_j = Σ u_n v: each record's effective value is exactly its own x_nj. The kernel
takes, per client, per block of :data:`TWO_VALUED_BLOCK` samples (fixed positions) and per column,
its records' u in record order into a float64 partial, added into the client's float64 totals in
block order; S is the b_1 sum (float64 mode) or float64 lane sums of the u (float32 mode, whose b_1
sums are float32 windows); the combination is 6 float64 operations. A record of KDD Cup 99 has 2.35
such entries (vectors of H adds) against 86 products (measured on its shapes, K = 8, one thread, a
round with torch's compiled forward, interleaved on a loaded machine: 0.88x float64 mode's time in
difference rounds, 0.83x in restarts; 0.96x and 0.93x float32 mode's). The dense columns keep their
products (``x_rows`` holds them only). The layout (columns, b, m: :func:`two_valued_columns`) is an
argument: the batched engine takes it from the test split, which holds no training record, so
neighbouring datasets get the same layout and any record outside it is an exception, taken exactly.
Float64 mode: the sums equal the dense path's to rounding (the combination rounds relative to its
totals, ~N γ(u64) of Σ_n |x_nj u_n|, as float64 mode's own sums; not shrunk for).

Float32 mode with two-valued columns of spread B ≥ ‖b‖ (:class:`TwoValued`). Rows t_n as above, the
two-valued W_1 entries x_nj u_nh exact (x exact, u the float32 factor): within (ii). Replacing
record i changes its own row, its lane window (b_1, W_2, b_2) and its product block (the dense
columns' W_1) — two float32 partials on disjoint entries (so also without the path, with
``x_rows``): their errors add in norm as √(e_W² + e_P²) ≤ √2 m γ_m max‖t‖ — and float64 sums only.
Every other partial is the same bits (the layout fixed). The two-valued entries' float64 error, per
entry (h, j) and per dataset, is at most γ_G(u64) Σ_n |u_nh| w_nj, G = 2⌈N/16⌉ + 278 (S's lanes:
⌈N/16⌉ + 16 additions; a partial at most 256 and the totals ⌈N/256⌉; an exception's product 1; the
combination 5 roundings per term), w_nj = |b_j| for a base record, 2|b_j| + |m_j| ≤ 3|x_nj| for a
minority one (|b_j| ≤ |m_j|), 2|b_j| + |v| for an exception; so ‖w_n‖ ≤ 3‖x_n,T‖ + 2B and, with
‖u_n‖ √(1 + ‖x_n,T‖²) ≤ ‖t_n‖, the entries' error is at most γ_G (3 + 2B) N max‖t‖ in norm. The
sum moves by at most ‖t_i - t_i'‖ + 2√2 m γ_m max‖t‖ + 2 N (γ_L (1 + √2 m γ_m) + (3 + 2B) γ_G)
max‖t‖ ≤ 2 C' (1 + ρ_2),

    1 + ρ_2 = (1 + γ_6(u32)) (1 + √2 m γ_m(u32)) (1 + N γ_L(u64) + (3 + 2B) N γ_G(u64))

(√2 taken as 1.414214), clipped at C' = C / (1 + ρ_2) (:func:`accumulation_error` and
:func:`float32_radii` with ``spread``): the sensitivity is at most 2C. On KDD Cup 99 (N = 39,522, B
= 1.85): ρ_2 = 3.4580e-4 against ρ = 3.4565e-4 without the path (block products, k = √2) — √2 m
γ_m = 3.4527e-4, the two-valued term (3 + 2B) N γ_G(u64) = 1.5e-7.

References:
    Murata & Suzuki (2023), Algorithm 1 (worker lines), Algorithm 2 (ClippedMean);
    Li et al. (2022), "Large language models can be strong differentially private learners" (ghost
    clipping).
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import shutil
import subprocess
import sys
import tempfile
from fractions import Fraction
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

import torch

from .clipping import RADIUS_FLOOR, gamma
from .ghost import MLP, norm_error, scaled_norm_error

__all__ = ["Parts", "TwoValued", "FusedKernel", "ACTIVATION_CODES", "LOSS_CODES", "ACCUMULATE",
           "FLUSH", "PRODUCT_BLOCK", "build", "load", "unload", "clipped_sums", "clip_factors",
           "norm_errors", "accumulation_error", "float32_radii", "product_rows",
           "forward_sums", "activation", "to_blocked", "from_blocked",
           "two_valued_columns", "two_valued"]

#: The accumulation modes of :func:`clipped_sums` and :func:`forward_sums` (the module's docstring).
ACCUMULATE = ("float64", "float32")
#: Float32 accumulation: blocks of a client per window of the float32 lane partials (each lane's
#: partial holds at most FLUSH samples), and samples per float32 product block of W_1's sums.
FLUSH = 64
PRODUCT_BLOCK = 64
#: Float32 accumulation: added to κ and κ_s, it covers the float64 forming of the output layer's
#: difference terms (the module's docstring, (i)).
FORMING_ERROR = gamma(32)
#: Float32 accumulation: roundings of one term in float32 units, with room for underflow (ibid.).
TERM_ROUNDINGS = 6
#: √2 rounded up (1.414214² = 2.0000012): two float32 partials on disjoint entries hold a record
#: with two-valued columns (the module's docstring, "Two-valued columns").
SQRT2_UP = Fraction(1414214, 1000000)
#: Two-valued columns: the fewest that make the path pay (:func:`two_valued_columns`).
TWO_VALUED_MIN_COLUMNS = 16
#: Two-valued columns: samples of a client per block of their entries (a multiple of
#: :data:`PRODUCT_BLOCK`; the kernel's ``TWO_FLUSH``): each column's sum over a block is a float64
#: partial.
TWO_VALUED_BLOCK = 256

#: The activations and losses whose forward pass the kernel computes itself (its ``Activation`` and
#: ``Loss`` codes): every one :mod:`diff2_flwr.core.ghost` knows.
ACTIVATION_CODES = {"softplus": 0, "tanh": 1, "sigmoid": 2, "relu": 3, "identity": 4}
LOSS_CODES = {"half_squared_error": 0, "cross_entropy": 1}

SOURCE = Path(__file__).with_name("fused_ghost.cpp")
#: IEEE arithmetic in the order written (no contraction into FMA, no fast-math); errno and traps off
#: only let sqrt and division vectorise, neither changes a value; the loops over a block's samples
#: are vectorised as loops (fully unrolled first, GCC leaves most of them scalar: 1.6x slower).
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=off", "-fno-math-errno",
         "-fno-trapping-math",
         "--param=max-completely-peel-times=1")
#: torch's CPU capability -> the instruction sets the build may use.
ISA = {"AVX512": ("-mavx512f", "-mavx512dq", "-mavx512vl", "-mavx512bw", "-mavx2", "-mfma",
                  "-mprefer-vector-width=512"),
       "AVX2": ("-mavx2", "-mfma")}


class Parts(NamedTuple):
    """One iterate's forward quantities, in the compute dtype, contiguous: hidden activations a [K,
    H, M], φ'(h) [K, H, M], output gradient g_L [K, O, M], output weights W_2 [K, O, H]."""

    a: torch.Tensor
    dphi: torch.Tensor
    grad_out: torch.Tensor
    w_out: torch.Tensor
    #: whether a, dphi and grad_out are in the blocked layout (:func:`to_blocked`) rather than [K,
    #: rows, M]
    blocked: bool = False


#: The kernel's two-valued arguments: T, cols, base, minor, blocks, groups, starts, rows, values,
#: dense columns, F_D.
_TWO_VALUED_ARGS = [ctypes.c_int64] + [ctypes.c_void_p] * 9 + [ctypes.c_int64]


class TwoValued(NamedTuple):
    """The two-valued columns of a group of clients' inputs (:func:`two_valued`; the module's
    docstring, "Two-valued columns"): the dense columns ``dense`` [F_D] (``x_rows`` holds them
    only) and the two-valued ones ``cols`` [T] (int64), each with its base value (the smaller
    magnitude) and its other value ``minor`` [T] (float64); ``spread`` ‖base‖ rounded up (it
    enters ρ). The records' non-base entries, by block of :data:`TWO_VALUED_BLOCK` samples of a
    client, then by column: block b of client p holds the groups ``blocks[p·nb + b] ..
    blocks[p·nb + b + 1] - 1`` ([P·nb + 1] int64, nb = ⌈N / 256⌉), group g the column slot
    ``groups[g]`` (int32; -1 - t for exceptions — values other than base and minor, taken as they
    are) and the entries ``starts[g] .. starts[g + 1] - 1`` ([G + 1] int64), each its record's
    offset in the block ``rows`` (int32, ascending in a group) and value ``value`` (float64)."""

    dense: torch.Tensor
    cols: torch.Tensor
    base: torch.Tensor
    minor: torch.Tensor
    spread: float
    blocks: torch.Tensor
    groups: torch.Tensor
    starts: torch.Tensor
    rows: torch.Tensor
    value: torch.Tensor


class FusedKernel:
    """The loaded kernel (float32 and float64 entry points) and where it was built; call it through
    :func:`clipped_sums`, which checks the arguments."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lib = ctypes.CDLL(str(path))
        self.block = int(self._lib.diff2_fused_block())
        self._entry = {}
        for dtype, name in ((torch.float32, "diff2_fused_f32"), (torch.float64, "diff2_fused_f64")):
            fn = getattr(self._lib, name)
            fn.restype = None
            fn.argtypes = ([ctypes.c_int64] * 6 + [ctypes.c_void_p] * 16 + [ctypes.c_int64]
                           + [ctypes.c_double] * 2 + [ctypes.c_void_p] * 2
                           + [ctypes.c_int64] * 2 + [ctypes.c_void_p, ctypes.c_int64]
                           + _TWO_VALUED_ARGS)
            self._entry[dtype] = fn
        self._forward, self._activation = {}, {}
        for dtype, suffix in ((torch.float32, "f32"), (torch.float64, "f64")):
            fn = getattr(self._lib, f"diff2_forward_{suffix}")
            fn.restype = None
            fn.argtypes = ([ctypes.c_int64] * 6 + [ctypes.c_void_p] + [ctypes.c_int64] * 2
                           + [ctypes.c_void_p] * 19 + [ctypes.c_int64] + [ctypes.c_double] * 2
                           + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2
                           + [ctypes.c_void_p, ctypes.c_int64] + _TWO_VALUED_ARGS)
            self._forward[dtype] = fn
            fn = getattr(self._lib, f"diff2_activation_{suffix}")
            fn.restype = None
            fn.argtypes = [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 3
            self._activation[dtype] = fn


def _cache_dir() -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if not root:
        from torch.utils.cpp_extension import get_default_build_root  # noqa: PLC0415 -- pulls in setuptools; only if needed
        root = get_default_build_root()
    return Path(root) / "diff2_fused"


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def build(capability: str | None = None, verbose: bool = False) -> Path:
    """Build the kernel for torch's CPU capability (``capability``: this process's, or one of
    ``ISA`` or ``"DEFAULT"``, the x86-64 baseline) or find it built; return the library's path, or
    raise a RuntimeError saying why it cannot be built."""
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (looked for $CXX, g++, c++)")
    capability = capability or torch.backends.cpu.get_cpu_capability()
    flags = list(FLAGS) + list(ISA.get(capability, ()))
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True,
                                 timeout=60).stdout
    except OSError as err:
        raise RuntimeError(f"cannot run the C++ compiler {cxx!r}: {err}") from err
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + "\0".join([cxx, version, *flags]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"fused_ghost_{capability.lower()}_{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built under a temporary name, then renamed: processes that build at once never see half a
    # library.
    if verbose:
        print(
            f"[diff2] building the fused ghost-clipping kernel (once per machine) into "
            f"{target.parent}",
              file=sys.stderr, flush=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([cxx, *flags, str(SOURCE), "-o", tmp], capture_output=True, text=True,
                              timeout=600)
        if done.returncode != 0:
            raise RuntimeError(
                f"{cxx} failed on {SOURCE} (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


#: This process's kernel once :func:`load` has tried (None: it could not), in one slot;
#: :func:`unload` empties it.
_LOADED: list[FusedKernel | None] = []


def load() -> FusedKernel | None:
    """The kernel, built and loaded once per process; None (after one warning on stderr) if it
    cannot be."""
    if not _LOADED:
        try:
            _LOADED.append(FusedKernel(build(verbose=True)))
        except (RuntimeError, OSError, subprocess.SubprocessError) as err:
            print(
                f"[diff2] warning: the fused ghost-clipping kernel is unavailable ({err}); the "
                f"batched engine "
                  "takes the torch path instead (same maths, slower). Install a C++ compiler "
                  "(g++) to use it.",
                  file=sys.stderr, flush=True)
            _LOADED.append(None)
    return _LOADED[0]


def unload() -> None:
    """Forget this process's kernel (or its failure to load): the next :func:`load` finds or builds
    it again and warns again if it cannot. The library already loaded stays mapped; a test's way to
    start afresh."""
    _LOADED.clear()


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


@lru_cache(maxsize=None)
def norm_errors(F: int, H: int, O: int) -> tuple[float, float]:
    """(κ, κ_s) of an MLP F -> H -> O: :func:`~diff2_flwr.core.ghost.norm_error` and
    :func:`~diff2_flwr.core.ghost.scaled_norm_error`, which depend on the widths only — the kernel's
    upper bounds of the true norms are :func:`~diff2_flwr.core.ghost.norm_bounds`' with these."""
    mlp = MLP((F, H, O), ("identity",), "half_squared_error" if O == 1 else "cross_entropy")
    return norm_error(mlp), scaled_norm_error(mlp)


@lru_cache(maxsize=None)
def accumulation_error(N: int, spread: float | None = None, *, products: bool = False) -> float:
    """ρ of float32 accumulation for clients of N samples (rounded up): a client sum's sensitivity
    is at most 2 C' (1 + ρ) at clipping radius C' (the module's docstring), 1 + ρ = (1 +
    γ_6(u32)) (1 + k m γ_m(u32)) (1 + N γ_L(u64)), m = max(FLUSH, PRODUCT_BLOCK), L = 2⌈N/16⌉ +
    16, k = 1 in lanes alone and √2 with ``products`` (W_1's sums by block products: a record in
    two partials). With two-valued columns of ``spread`` B (:class:`TwoValued`; the docstring's
    "Two-valued columns"): 1 + ρ = (1 + γ_6(u32)) (1 + √2 m γ_m(u32)) (1 + N γ_L(u64) + (3 + 2B) N
    γ_G(u64)), G = 2⌈N/16⌉ + 278, √2 taken as 1.414214."""
    u32 = 2.0**-24
    m = max(FLUSH, PRODUCT_BLOCK)
    L = 2 * -(-N // 16) + 16
    if spread is None:
        k = SQRT2_UP if products else 1  # a record in a lane window and a product block: √2
        one = ((1 + Fraction(gamma(TERM_ROUNDINGS, u32))) * (1 + k * m * Fraction(gamma(m, u32)))
               * (1 + N * Fraction(gamma(L))))
    else:
        G = 2 * -(-N // 16) + 278
        one = ((1 + Fraction(gamma(TERM_ROUNDINGS, u32)))
               * (1 + SQRT2_UP * m * Fraction(gamma(m, u32)))
               * (1 + N * Fraction(gamma(L)) + (3 + 2 * Fraction(spread)) * N * Fraction(gamma(G))))
    return math.nextafter(float(one - 1), math.inf)


def float32_radii(radius: torch.Tensor, N: int, spread: float | None = None, *,
                  products: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 accumulation's clipping radii C' = C / (1 + ρ) rounded down (0 and inf stay) and its
    scales S per run (powers of two, S·C' in [2^62, 2^63); 1 for 0 and inf), both [K] float64, for
    radii C [K] and clients of N samples (``spread``: two-valued columns',
    :func:`accumulation_error`); a ValueError for a radius in (0, RADIUS_FLOOR)."""
    # 1 + ρ rounded up; C / (1 + ρ) to nearest, then one step down: at most the exact quotient
    rho = (accumulation_error(N, products=products) if spread is None
           else accumulation_error(N, spread))
    one = math.nextafter(1 + rho, math.inf)
    radii, scales = [], []
    for c in radius.tolist():
        if c == 0 or c == math.inf:
            radii.append(c)
            scales.append(1.0)
            continue
        if not RADIUS_FLOOR <= c < math.inf:
            raise ValueError(f"fused: float32 accumulation takes radii 0, inf or in [2^-900, inf). "
                             f"Found {c!r}.")
        r = math.nextafter(c / one, 0.0)
        radii.append(r)
        scales.append(math.ldexp(1.0, 63 - math.frexp(r)[1]))
    return (torch.tensor(radii, dtype=torch.float64), torch.tensor(scales, dtype=torch.float64))


def clipped_sums(  # noqa: PLR0913 -- the kernel's inputs, one tensor each (as the C++ entry)
        kernel: FusedKernel, cur: Parts, x: torch.Tensor, sq_x: torch.Tensor, mask: torch.Tensor,
        radius: torch.Tensor, prev: Parts | None = None, restart: torch.Tensor | None = None, *,
        clients: int = 1, x_rows: torch.Tensor | None = None,
        accumulate: str = "float64",
        two_valued: TwoValued | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped sums per client and run [P, K, d] (float64, the flat (W_1, b_1, W_2, b_2) order) and
    whether a real sample's norm was not finite [P, K] (bool), for the ``clients`` (P) clients whose
    samples lie side by side: client p's are the samples p·N .. (p + 1)·N - 1 of the M = P·N.

    ``x`` [F, M] float64: the inputs (samples innermost); ``sq_x`` [M]: ‖x‖² per sample, ``mask``
    [M]: 1 for a sample, 0 for padding, ``radius`` [K]: the clipping radius per run (inf: no
    clipping), all float64; ``prev``: the pass at x' for differences, ``restart`` [K] (bool or
    uint8): runs that take their plain gradient. ``x_rows``: the same inputs as [P, N, F] (float64,
    contiguous) to take the first layer's weight sums Σ_n c dg_1 xᵀ by one batched matrix product,
    as :func:`~diff2_flwr.core.ghost.clipped_sums` does, from the kernel's c dg_1 [K, H, M] — faster
    than the kernel's per-lane sums when the inputs have many features. ``cur.blocked``: ``cur``,
    ``prev`` and ``x`` are in the blocked layout (:func:`to_blocked`; ``x_rows``, ``sq_x``, ``mask``
    and ``radius`` as always).

    ``accumulate="float32"`` (float32 compute dtype only): the sums through float32 windows and
    product blocks, clipped at :func:`float32_radii`'s C' < C so that each client sum's sensitivity
    stays at most 2C (the module's docstring); ``x_rows`` then float32 (the inputs as the forward
    pass reads them). The overflow flags are the same; the sums differ from float64 mode's by about
    ρ of their scale at most.

    ``two_valued`` (:func:`two_valued`, with ``x_rows``; the module's docstring, "Two-valued
    columns"): the first layer's sums of its two-valued columns from the kernel's per-record
    minority sums, those of its dense columns as above from ``x_rows``, which then holds the dense
    columns only ([P, N, F_D], or :func:`product_rows` of them); float32 accumulation clips at its
    own, slightly larger ρ.
    """
    return _call(kernel, cur, _dims(kernel, cur, "fused.clipped_sums"), x, sq_x, mask, radius,
                 prev, restart, clients, x_rows, None, "fused.clipped_sums", accumulate=accumulate,
                 two_valued=two_valued)


def _dims(kernel: FusedKernel, cur: Parts, who: str) -> tuple[torch.dtype, int, int, int, int]:
    """(compute dtype, K, H, O, M) of a pass read by the kernel, its tensors checked."""
    dtype = cur.a.dtype
    K, H, M = cur.a.shape
    O = cur.grad_out.shape[1]
    for name, t, shape in (("a", cur.a, (K, H, M)), ("dphi", cur.dphi, (K, H, M)),
                           ("grad_out", cur.grad_out, (K, O, M)), ("w_out", cur.w_out, (K, O, H))):
        if t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous():
            raise ValueError(
                f"{who}: {name} must be a contiguous {dtype} tensor of shape "
                f"{shape}. Found {t.dtype} "
                f"{tuple(t.shape)}{'' if t.is_contiguous() else ', not contiguous'}.")
    if dtype not in kernel._entry:
        raise ValueError(f"{who}: compute dtype must be float32 or float64. Found {dtype}.")
    return dtype, K, H, O, M


def clip_factors(  # noqa: PLR0913 -- clipped_sums' arguments
        kernel: FusedKernel, cur: Parts, x: torch.Tensor, sq_x: torch.Tensor, mask: torch.Tensor,
        radius: torch.Tensor, prev: Parts | None = None, restart: torch.Tensor | None = None, *,
        clients: int = 1, accumulate: str = "float64", x_rows: torch.Tensor | None = None,
        two_valued: TwoValued | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The clip factors c [K, M] (float64, times the mask; samples in their natural order whatever
    ``cur.blocked``) that :func:`clipped_sums` takes with these arguments, and its overflow flags
    [P, K]: its kernel call, which also writes them out (for inspection and tests; the sums are
    discarded)."""
    dims = _dims(kernel, cur, "fused.clip_factors")
    factors = torch.empty(dims[1], dims[4], dtype=torch.float64)
    _, overflow = _call(kernel, cur, dims, x, sq_x, mask, radius, prev, restart, clients, x_rows,
                        None, "fused.clip_factors", factors, accumulate=accumulate,
                        two_valued=two_valued)
    return factors, overflow


def _call(  # noqa: PLR0913 -- clipped_sums' and forward_sums' arguments, passed to the kernel
        kernel: FusedKernel, cur: Parts, dims: tuple[torch.dtype, int, int, int, int],
        x: torch.Tensor, sq_x: torch.Tensor, mask: torch.Tensor, radius: torch.Tensor,
        prev: Parts | None, restart: torch.Tensor | None, clients: int,
        x_rows: torch.Tensor | None, forward: tuple | None,
        who: str, factors: torch.Tensor | None = None, *,
        accumulate: str = "float64",
        two_valued: TwoValued | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel call of :func:`clipped_sums` (``forward`` None: ``cur`` is read) or
    :func:`forward_sums` (``forward`` = (params, activation code, loss code, x_t, y, losses):
    ``cur`` and the losses are written; ``cur``'s a, dphi and grad_out None: the pass is not kept);
    ``dims`` = (compute dtype, K, H, O, M); ``cur``'s and the forward's arguments checked by the
    caller (``who``, named in the errors), the others here. ``factors`` [K, M] float64: the clip
    factors are written there too."""
    dtype, K, H, O, M = dims
    F = x.shape[0]
    N = _client_size(M, clients, who)
    if prev is not None and prev.blocked != cur.blocked:
        raise ValueError(
            f"{who}: prev is {'' if prev.blocked else 'not '}in the blocked layout and this pass "
            f"is{'' if cur.blocked else ' not'}: both in one layout (fused.to_blocked converts).")
    if prev is not None:
        for name, t, shape in (("prev.a", prev.a, (K, H, M)), ("prev.dphi", prev.dphi, (K, H, M)),
                               ("prev.grad_out", prev.grad_out, (K, O, M)),
                               ("prev.w_out", prev.w_out, (K, O, H))):
            if t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous():
                raise ValueError(
                    f"{who}: {name} must be a contiguous {dtype} tensor of shape {shape}. Found "
                    f"{t.dtype} {tuple(t.shape)}{'' if t.is_contiguous() else ', not contiguous'}.")
    for name, t, shape in (("x", x, (F, M)), ("sq_x", sq_x, (M,)), ("mask", mask, (M,)),
                           ("radius", radius, (K,))):
        if t.dtype != torch.float64 or tuple(t.shape) != shape or not t.is_contiguous():
            raise ValueError(f"{who}: {name} must be a contiguous float64 tensor of shape {shape}. "
                             f"Found {t.dtype} {tuple(t.shape)}.")
    if accumulate not in ACCUMULATE:
        raise ValueError(f"{who}: accumulate must be one of {ACCUMULATE}. Found {accumulate!r}.")
    f32 = accumulate == "float32"
    if f32 and dtype != torch.float32:
        raise ValueError(f"{who}: accumulate='float32' is for the float32 compute dtype. Found "
                         f"{dtype}.")
    FR = F if two_valued is None else _check_two_valued(two_valued, F, N, clients, x_rows, who)
    if not f32 and x_rows is not None and (
            x_rows.dtype != torch.float64 or tuple(x_rows.shape) != (clients, N, FR)
            or not x_rows.is_contiguous()):
        raise ValueError(
            f"{who}: x_rows must be a contiguous float64 tensor of shape {(clients, N, FR)}. "
                         f"Found {x_rows.dtype} {tuple(x_rows.shape)}.")
    shape = (clients, -(-N // PRODUCT_BLOCK) * PRODUCT_BLOCK, -(-FR // 16) * 16)
    if f32 and x_rows is not None and (x_rows.dtype != torch.float32
                                       or tuple(x_rows.shape) != shape
                                       or not x_rows.is_contiguous()):
        raise ValueError(
            f"{who}: with accumulate='float32', x_rows must be a contiguous float32 tensor of "
            f"shape {shape} (fused.product_rows). Found {x_rows.dtype} {tuple(x_rows.shape)}.")
    if restart is not None and (restart.dtype not in (torch.bool,
                                                      torch.uint8) or tuple(restart.shape) != (K,)):
        raise ValueError(f"{who}: restart must be a bool or uint8 tensor of shape ({K},). Found "
                         f"{restart.dtype} {tuple(restart.shape)}.")
    restart_u8 = None if restart is None or prev is None else restart.to(torch.uint8).contiguous()
    sums = torch.empty(clients, K, H * F + H + O * H + O, dtype=torch.float64)
    overflow = torch.empty(clients, K, dtype=torch.bool)  # written as bytes 0 / 1
    kappa, kappa_s = norm_errors(F, H, O)
    scale, rows32, cd1 = None, None, None
    if f32:  # clipped at C' < C, κ widened by the forming error: the module's docstring
        radius, scale = float32_radii(radius, N, None if two_valued is None else two_valued.spread,
                                      products=x_rows is not None)
        kappa, kappa_s = kappa + FORMING_ERROR, kappa_s + FORMING_ERROR
        rows32 = x_rows  # W_1's sums by the kernel's float32 block products
    elif x_rows is not None:
        cd1 = torch.empty(K, H, M, dtype=torch.float64)
    p = prev if prev is not None else Parts(None, None, None, None)  # type: ignore[arg-type]
    tail = (_ptr(cur.w_out), _ptr(p.a), _ptr(p.dphi), _ptr(p.grad_out), _ptr(p.w_out),
            _ptr(restart_u8), _ptr(x), _ptr(sq_x), _ptr(mask), _ptr(radius), _ptr(sums),
            _ptr(overflow), _ptr(cd1), int(cur.blocked), kappa, kappa_s, _ptr(factors),
            _ptr(scale), FLUSH, PRODUCT_BLOCK, _ptr(rows32),
            0 if rows32 is None else rows32.shape[2], *_two_valued_args(two_valued))
    if forward is None:
        kernel._entry[dtype](clients, K, H, O, F, N, _ptr(cur.a), _ptr(cur.dphi),
                             _ptr(cur.grad_out), *tail)
    else:
        params, act, loss, x_t, y, losses = forward
        kernel._forward[dtype](clients, K, H, O, F, N, _ptr(params), act, loss, _ptr(x_t), _ptr(y),
                               _ptr(cur.a), _ptr(cur.dphi), _ptr(cur.grad_out), _ptr(losses), *tail)
    if cd1 is not None:  # one product per client for every run: [K·H, N] @ [N, F]
        w1 = torch.bmm(cd1.reshape(K * H, clients, N).transpose(0, 1), x_rows)
        if two_valued is None:
            sums[:, :, :H * F] = w1.reshape(clients, K, H * F)
        else:  # the dense columns; the kernel wrote the two-valued ones
            sums[:, :, :H * F].view(clients, K, H, F)[..., two_valued.dense] = w1.reshape(
                clients, K, H, FR)
    return sums, overflow


def _check_two_valued(tv: TwoValued, F: int, N: int, clients: int,
                      x_rows: torch.Tensor | None, who: str) -> int:
    """F_D, the dense columns of a :class:`TwoValued` for F features and clients of N samples, its
    tensors checked (a ValueError naming ``who``); ``x_rows`` must be given."""
    T = tv.cols.numel()
    blocks = clients * -(-N // TWO_VALUED_BLOCK)
    if x_rows is None:
        raise ValueError(f"{who}: two_valued takes the dense columns' sums from x_rows; pass "
                         "x_rows (the dense columns) too.")
    for name, t, dtype, shape in (("dense", tv.dense, torch.int64, (F - T,)),
                                  ("cols", tv.cols, torch.int64, (T,)),
                                  ("base", tv.base, torch.float64, (T,)),
                                  ("minor", tv.minor, torch.float64, (T,)),
                                  ("blocks", tv.blocks, torch.int64, (blocks + 1,)),
                                  ("groups", tv.groups, torch.int32, (tv.starts.numel() - 1,)),
                                  ("rows", tv.rows, torch.int32, (tv.value.numel(),)),
                                  ("value", tv.value, torch.float64, (tv.rows.numel(),))):
        if t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous():
            raise ValueError(
                f"{who}: two_valued.{name} must be a contiguous {dtype} tensor of shape {shape} "
                f"(fused.two_valued builds it). Found {t.dtype} {tuple(t.shape)}.")
    if T < 1 or int(tv.blocks[-1]) != tv.groups.numel() or int(tv.starts[-1]) != tv.rows.numel():
        raise ValueError(f"{who}: two_valued holds {T} columns, {int(tv.blocks[-1])} groups of "
                         f"{tv.groups.numel()}: build it with fused.two_valued.")
    return F - T


def _two_valued_args(tv: TwoValued | None) -> tuple:
    """The kernel's two-valued arguments (T, pointers, F_D): zeros and nulls without."""
    if tv is None:
        return (0, None, None, None, None, None, None, None, None, None, 0)
    return (tv.cols.numel(), _ptr(tv.cols), _ptr(tv.base), _ptr(tv.minor), _ptr(tv.blocks),
            _ptr(tv.groups), _ptr(tv.starts), _ptr(tv.rows), _ptr(tv.value), _ptr(tv.dense),
            tv.dense.numel())


def two_valued_columns(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The columns of the records x [n, F] (float64) that take at most two values (a constant
    column too), [T] int64, and per column its base — the value of smaller magnitude (ties: the
    more frequent, then the smaller) — and its other value (the base again for a constant column),
    [T] float64 each. After standardisation (centring) the base is the majority value: n_b |b| =
    n_m |m|."""
    if x.dim() != 2 or x.dtype != torch.float64 or x.shape[0] < 1:
        raise ValueError(f"fused.two_valued_columns: records [n >= 1, F] float64. Found {x.dtype} "
                         f"{tuple(x.shape)}.")
    v0 = x[0]
    other = x != v0
    v1 = x[other.to(torch.uint8).argmax(0), torch.arange(x.shape[1])]  # v0 where constant
    two = ((x == v0) | (x == v1)).all(0)
    n0 = (~other).sum(0)
    first = (v0.abs() < v1.abs()) | ((v0.abs() == v1.abs())
                                     & ((n0 > x.shape[0] - n0) | ((n0 == x.shape[0] - n0)
                                                                   & (v0 <= v1))))
    base, minor = torch.where(first, v0, v1), torch.where(first, v1, v0)
    cols = torch.nonzero(two).reshape(-1)
    return cols, base[cols].contiguous(), minor[cols].contiguous()


def two_valued(x_rows: torch.Tensor, mask: torch.Tensor, cols: torch.Tensor, base: torch.Tensor,
               minor: torch.Tensor) -> TwoValued:
    """The :class:`TwoValued` of a group of clients' inputs x_rows [P, N, F] (float64), ``mask``
    [P·N] (0: padding, no entries) and the columns ``cols`` with their ``base`` and ``minor`` values
    (:func:`two_valued_columns`; the batched engine takes them from the test split, so that they
    depend on no training record). A record whose value in such a column is neither is taken as it
    is (an exception entry)."""
    P, N, F = x_rows.shape
    cols = cols.to(torch.int64).contiguous()
    T = cols.numel()
    if cols.numel() < 1 or cols.unique().numel() != cols.numel() or int(cols.min()) < 0 \
            or int(cols.max()) >= F:
        raise ValueError(f"fused.two_valued: cols must be distinct columns of 0 .. {F - 1}. Found "
                         f"{cols.tolist()}.")
    base = base.to(torch.float64).contiguous()
    minor = minor.to(torch.float64).contiguous()
    if not (bool(torch.isfinite(base).all()) and bool(torch.isfinite(minor).all())
            and bool((base.abs() <= minor.abs()).all())):
        raise ValueError("fused.two_valued: base and minor values must be finite, |base| <= "
                         "|minor| (fused.two_valued_columns chooses them).")
    xt = x_rows.reshape(P * N, F)[:, cols]
    rows, slots = torch.nonzero((xt != base) & (mask.reshape(-1, 1) > 0), as_tuple=True)
    value = xt[rows, slots]
    # an exception's slot t is written -1 - t (the kernel takes its own value)
    slots = torch.where(value == minor[slots], slots, -1 - slots)
    nb = -(-N // TWO_VALUED_BLOCK)
    block = (rows // N) * nb + (rows % N) // TWO_VALUED_BLOCK
    # by block, then signed slot (exceptions first), then record: one sort key
    order = torch.argsort((block * (2 * T + 1) + slots + T) * TWO_VALUED_BLOCK
                          + (rows % N) % TWO_VALUED_BLOCK, stable=True)
    rows, slots, value, block = rows[order], slots[order], value[order], block[order]
    key = block * (2 * T + 1) + slots + T
    new = torch.ones(key.numel(), dtype=torch.bool)
    new[1:] = key[1:] != key[:-1]
    first = torch.nonzero(new).reshape(-1)
    starts = torch.cat([first, torch.tensor([key.numel()])]).to(torch.int64)
    blocks = torch.zeros(P * nb + 1, dtype=torch.int64)
    blocks[1:] = torch.bincount(block[first], minlength=P * nb).cumsum(0)
    keep = torch.ones(F, dtype=torch.bool)
    keep[cols] = False
    # ‖base‖ rounded up: spread² >= Σ b² exactly
    sq = sum((Fraction(b) ** 2 for b in base.tolist()), Fraction(0))
    spread = math.sqrt(float(sq))
    while Fraction(spread) ** 2 < sq:
        spread = math.nextafter(spread, math.inf)
    return TwoValued(torch.nonzero(keep).reshape(-1).contiguous(), cols, base, minor, spread,
                     blocks, slots[first].to(torch.int32).contiguous(), starts.contiguous(),
                     ((rows % N) % TWO_VALUED_BLOCK).to(torch.int32).contiguous(),
                     value.contiguous())


def product_rows(x_rows: torch.Tensor) -> torch.Tensor:
    """The inputs [P, N, F] as float32 accumulation's ``x_rows``: float32 (rounded; exact for a
    float32 batch) [P, ⌈N / b⌉·b, ⌈F / 16⌉·16] (b = :data:`PRODUCT_BLOCK`), zero-padded: whole
    product blocks per client, whole vectors per row."""
    P, N, F = x_rows.shape
    out = torch.zeros(P, -(-N // PRODUCT_BLOCK) * PRODUCT_BLOCK, -(-F // 16) * 16,
                      dtype=torch.float32)
    out[:, :N, :F] = x_rows
    if not bool(torch.isfinite(out).all()):
        raise ValueError("fused.product_rows: inputs beyond float32's range (or not finite): "
                         "float32 accumulation's products would be too.")
    return out


def forward_sums(  # noqa: PLR0913 -- the kernel's inputs, one tensor each (as the C++ entry)
        kernel: FusedKernel, params: torch.Tensor, x_t: torch.Tensor, y: torch.Tensor,
        activation: str, loss: str, x: torch.Tensor, sq_x: torch.Tensor, mask: torch.Tensor,
        radius: torch.Tensor, prev: Parts | None = None, restart: torch.Tensor | None = None, *,
        hidden: int, outputs: int, clients: int = 1, x_rows: torch.Tensor | None = None,
        keep: bool = True, blocked: bool = False, accumulate: str = "float64",
        out: Parts | None = None) -> tuple[torch.Tensor, torch.Tensor, Parts | None, torch.Tensor]:
    """:func:`clipped_sums` with the forward pass in the kernel too: for the K runs' parameters
    ``params`` [K, d] (the compute dtype, the flat (W_1, b_1, W_2, b_2) order) and the inputs
    ``x_t`` [F, M] and targets ``y`` [M] in the compute dtype, the kernel computes per block of
    samples h = W_1 x + b_1, a = φ(h), φ'(h), z = W_2 a + b_2, the output gradient and the loss (the
    maths of :func:`~diff2_flwr.core.ghost.forward_head`, with the kernel's own exp and log1p: equal
    to torch's to a few units in the last place, not in bits), then the rest as :func:`clipped_sums`
    — each block while it is in the caches. Returns the clipped sums [P, K, d] (float64), the
    overflow flags [P, K], this pass's :class:`Parts` (for the next round's ``prev``) and the losses
    [K, M].

    ``keep`` False (only without ``prev``: every row a plain gradient): no later round reads this
    pass, so its parts are not written out — each block's stay in scratch rows in the caches — and
    None is returned for them; the sums, flags and losses are the same bits. ``blocked``: ``x_t``
    and ``x`` are given, and the parts returned (and ``prev``) are, in the blocked layout
    (:func:`to_blocked`): the same bits, faster. ``accumulate``: as :func:`clipped_sums`'.

    ``out`` (with ``keep``): a pass no one reads any more (the one before ``prev``, say) whose a,
    dphi and grad_out this pass is written into instead of fresh tensors (same dtype, shapes and
    contiguity; no memory shared with ``prev`` or the inputs): the same bits. A fresh pass of K·(2H
    + O)·M elements each round costs page faults where the allocator returns it to the system
    (measured: a third of a DIFF2 difference round at K = 18 on California)."""
    dtype = params.dtype
    if dtype not in kernel._forward or params.dim() != 2:
        raise ValueError(
            f"fused.forward_sums: params must be a [K, d] float32 or float64 tensor. Found "
            f"{params.dtype} {tuple(params.shape)}.")
    K, d = params.shape
    H, O, F, M = hidden, outputs, x_t.shape[0], x_t.shape[1]
    if d != H * F + H + O * H + O:
        raise ValueError(
            f"fused.forward_sums: parameters of width {d} do not make an MLP {F} -> {H} -> {O} "
                         f"(expected {H * F + H + O * H + O}).")
    if activation not in ACTIVATION_CODES or loss not in LOSS_CODES:
        raise ValueError(
            f"fused.forward_sums: the kernel computes the activations {sorted(ACTIVATION_CODES)} "
            f"and the losses {sorted(LOSS_CODES)}. Found {activation!r} and {loss!r}.")
    for name, t, shape in (("params", params, (K, d)), ("x_t", x_t, (F, M)), ("y", y, (M,))):
        if t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous():
            raise ValueError(
                f"fused.forward_sums: {name} must be a contiguous {dtype} tensor of shape "
                f"{shape}. Found {t.dtype} "
                f"{tuple(t.shape)}{'' if t.is_contiguous() else ', not contiguous'}.")
    if not keep and prev is not None:
        raise ValueError(
            "fused.forward_sums: keep=False is for a pass of plain gradients only (prev None): a "
                         "difference round's parts are written where its rows are read.")
    w_out = params[:, H * F + H:H * F + H + O * H].reshape(K, O, H).contiguous()
    if out is not None:
        _check_out(out, prev, (params, x_t, y, x, sq_x, mask, radius), (dtype, K, H, O, M), keep)
        cur = Parts(out.a, out.dphi, out.grad_out, w_out, blocked)
    elif keep:
        cur = Parts(torch.empty(K, H, M, dtype=dtype), torch.empty(K, H, M, dtype=dtype),
                    torch.empty(K, O, M, dtype=dtype), w_out, blocked)
    else:
        cur = Parts(None, None, None, w_out, blocked)  # type: ignore[arg-type]
    losses = torch.empty(K, M, dtype=dtype)
    sums, overflow = _call(kernel, cur, (dtype, K, H, O, M), x, sq_x, mask, radius, prev, restart,
                           clients, x_rows, (params, ACTIVATION_CODES[activation], LOSS_CODES[loss],
                                             x_t, y, losses),
                           "fused.forward_sums", accumulate=accumulate)
    return sums, overflow, cur if keep else None, losses


def _overlaps(t: torch.Tensor, u: torch.Tensor) -> bool:
    """Whether the memory of two contiguous tensors overlaps."""
    a0, b0 = t.data_ptr(), u.data_ptr()
    return a0 < b0 + u.numel() * u.element_size() and b0 < a0 + t.numel() * t.element_size()


def _check_out(out: Parts, prev: Parts | None, inputs: tuple, dims: tuple, keep: bool) -> None:
    """forward_sums' ``out``: a ValueError unless its a, dphi and grad_out are contiguous tensors of
    the pass's dtype and shapes that share no memory with ``prev``, the inputs or each other."""
    dtype, K, H, O, M = dims
    if not keep:
        raise ValueError("fused.forward_sums: out is where a kept pass is written; with keep=False "
                         "no pass is written.")
    mine = (("out.a", out.a, (K, H, M)), ("out.dphi", out.dphi, (K, H, M)),
            ("out.grad_out", out.grad_out, (K, O, M)))
    for name, t, shape in mine:
        if (not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != shape
                or not t.is_contiguous()):
            raise ValueError(
                f"fused.forward_sums: {name} must be a contiguous {dtype} tensor of shape {shape}. "
                f"Found {getattr(t, 'dtype', None)} {tuple(getattr(t, 'shape', ()))}.")
    others = [t for t in inputs if t is not None]
    if prev is not None:
        others += [t for t in (prev.a, prev.dphi, prev.grad_out) if isinstance(t, torch.Tensor)]
    tensors = [t for _, t, _ in mine]
    for i, t in enumerate(tensors):
        if any(_overlaps(t, u) for u in others + tensors[i + 1:]):
            raise ValueError(
                "fused.forward_sums: out shares memory with prev, an input or itself: the kernel "
                "reads those while it writes out. Pass a pass no one reads any more (the one "
                "before prev).")


def activation(kernel: FusedKernel, name: str, h: torch.Tensor) -> tuple[torch.Tensor,
                                                                         torch.Tensor]:
    """φ(h) and φ'(h) by the kernel's own functions (float32 or float64, any shape): what its
    forward pass uses."""
    if name not in ACTIVATION_CODES or h.dtype not in kernel._activation:
        raise ValueError(
            f"fused.activation: one of {sorted(ACTIVATION_CODES)} on float32 or float64. Found "
                         f"{name!r} on {h.dtype}.")
    flat = h.contiguous().reshape(-1)
    a, d = torch.empty_like(flat), torch.empty_like(flat)
    kernel._activation[h.dtype](ACTIVATION_CODES[name], flat.numel(), flat.data_ptr(), a.data_ptr(),
                                d.data_ptr())
    return a.reshape(h.shape), d.reshape(h.shape)


def _client_size(M: int, clients: int, who: str) -> int:
    """N, the samples per client of M = clients · N (a ValueError naming ``who`` if they do not
    split)."""
    if clients < 1 or M % clients:
        raise ValueError(f"{who}: {M} samples do not split into {clients} clients of equal size.")
    return M // clients


def _chunks(t: torch.Tensor, clients: int, block: int, who: str) -> tuple[torch.Size, int, int, int,
                                                                          int]:
    *lead, R, M = t.shape
    N = _client_size(M, clients, who)
    return torch.Size(lead), R, N, N - N % block, N % block


def to_blocked(t: torch.Tensor, clients: int, block: int) -> torch.Tensor:
    """``t`` [..., R, M] (R rows of M = P·N samples, client p's at p·N .. (p + 1)·N - 1) in the
    kernel's blocked layout: per client, each block of ``block`` samples holds its R rows one after
    another (row r of the block at r·block + j), then the client's last ``N mod block`` samples
    likewise; clients in order. Same shape, same elements, another order: a block's inputs or parts
    are one contiguous run of memory, so the kernel reads and writes a few streams instead of R rows
    M apart (the caches' prefetchers follow few streams). Inverse: :func:`from_blocked`."""
    lead, R, N, full, tail = _chunks(t, clients, block, "fused.to_blocked")
    v = t.reshape(*lead, R, clients, N)
    parts = [v[..., :full].reshape(*lead, R, clients, full // block, block).movedim(-4, -2)
             .reshape(*lead, clients, full * R)]
    if tail:
        parts.append(v[..., full:].movedim(-3, -2).reshape(*lead, clients, tail * R))
    return torch.cat(parts, dim=-1).reshape(*lead, R, clients * N).contiguous()


def from_blocked(t: torch.Tensor, clients: int, block: int) -> torch.Tensor:
    """:func:`to_blocked`'s inverse: [..., R, M] in the blocked layout -> rows of samples."""
    lead, R, N, full, tail = _chunks(t, clients, block, "fused.from_blocked")
    v = t.reshape(*lead, clients, N * R)
    out = [v[..., :full * R].reshape(*lead, clients, full // block, R, block).movedim(-2, -4)
           .reshape(*lead, R, clients, full)]
    if tail:
        out.append(v[..., full * R:].reshape(*lead, clients, R, tail).movedim(-2, -3))
    return torch.cat(out, dim=-1).reshape(*lead, R, clients * N).contiguous()
