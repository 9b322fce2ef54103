"""The distributed Skellam mechanism: integer encoding for secure aggregation, and its privacy
bound.

For ``privacy.noise: distributed`` (issue 23) the server must learn only the noised *sum* of the
clients' vectors, through secure aggregation, which adds integers modulo ``M = 2**bits``. Each
client therefore

1. scales its clipped vector by ``scale`` (the integer grid's spacing is ``1 / scale``);
2. rotates it with a randomised Walsh-Hadamard transform whose signs come from a public per-round
   seed (it flattens the vector, so every coordinate needs about ``norm / sqrt(D)`` of the modulus,
   not ``norm``);
3. rounds it to integers by conditional randomised rounding: unbiased per coordinate, retried until
   the rounding error's norm is at most ``rho`` (a deterministic bound, which the sensitivity uses);
4. adds its share of Skellam noise, ``Poisson(v/2) - Poisson(v/2)`` per coordinate (variance ``v``),
   and
5. reduces modulo ``M``.

The server centres the modular sum, undoes the rotation and the scale. A sum of independent Skellams
is a Skellam, so the honest clients' shares add up to one Skellam mechanism of their summed
variance: with at most ``t`` of the ``P`` clients dropped out or colluding (a colluder knows its own
share), ``P - t`` honest shares carry the guarantee.

Privacy: the integer sum's sensitivity to one record is ``Delta_2 <= scale * record_l2 + 2 rho``
(the two roundings of the neighbouring vectors are each within ``rho``; any coupling of them bounds
the Rényi divergence of the mixtures by the worst pair) and ``Delta_1 <= min(sqrt(D) Delta_2,
Delta_2**2)`` (an integer vector's ℓ1 norm is at most its squared ℓ2 norm). The Skellam mechanism's
Rényi DP is bounded in closed form (Agarwal, Kairouz & Liu 2021, Corollary 3.6); the tests check
that bound against the exact divergence of the Skellam distribution, computed from its probability
mass function. Wrapping around the modulus is post-processing of the noised sum (it costs no
privacy) but breaks the decoded value: :func:`wrap_probability` bounds it and :func:`choose_scale`
picks the largest scale that keeps it below a target.

References:
    Agarwal, Kairouz & Liu (2021), "The Skellam Mechanism for Differentially Private Federated
    Learning", Algorithm 1 and Corollary 3.6. Kairouz, Liu & Steinke (2021), "The Distributed
    Discrete Gaussian Mechanism for Federated Learning with Secure Aggregation", Section 4
    (randomised rotation, conditional rounding). Canonne, Kamath & Steinke (2020), Proposition 12
    (RDP to (ε, δ)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = [
    "RDP_ORDERS",
    "SkellamCode",
    "padded_dim",
    "rotation_signs",
    "rotate",
    "unrotate",
    "rounding_bound",
    "conditional_round",
    "skellam_noise",
    "encode",
    "modular_sum",
    "decode",
    "centre",
    "sensitivity",
    "skellam_rdp",
    "rdp_to_epsilon",
    "wrap_probability",
    "choose_scale",
]

#: Integer Rényi orders: Corollary 3.6 holds for integer α > 1.
RDP_ORDERS: tuple[int, ...] = tuple(range(2, 65)) + tuple(range(68, 257, 4)) + (320, 384, 512, 768,
                                                                                1024)

_MAX_ROUNDING_TRIES = 1000


def padded_dim(dim: int) -> int:
    """D: the smallest power of two >= ``dim`` (the Walsh-Hadamard transform's length)."""
    if dim < 1:
        raise ValueError(f"`dim` must be >= 1. Found {dim}.")
    return 1 << (dim - 1).bit_length()


def rotation_signs(seed: int, dim: int) -> np.ndarray:
    """The rotation's ±1 signs (length D) from a public seed: every client and the server derive the
    same."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(entropy=seed,
                                                                     spawn_key=(0x5CE11A,))))
    return rng.integers(0, 2, padded_dim(dim)).astype(np.float64) * 2 - 1


def _walsh_hadamard(x: np.ndarray) -> np.ndarray:
    """H x / sqrt(D) (orthonormal, its own inverse), in O(D log D)."""
    y = np.array(x, dtype=np.float64)
    n, h = y.shape[-1], 1
    while h < n:
        y = y.reshape(*y.shape[:-1], n // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = np.stack((a + b, a - b), axis=-2).reshape(*y.shape[:-3], n)
        h *= 2
    return y / math.sqrt(n)


def rotate(x: np.ndarray, signs: np.ndarray) -> np.ndarray:
    """The randomised Hadamard rotation H·diag(signs)·x / sqrt(D) of ``x`` zero-padded to D =
    len(signs)."""
    x = np.asarray(x, dtype=np.float64)
    if x.shape[-1] > signs.size:
        raise ValueError(
            f"a vector of {x.shape[-1]} entries does not fit a rotation of {signs.size}.")
    padded = np.zeros((*x.shape[:-1], signs.size))
    padded[..., : x.shape[-1]] = x
    return _walsh_hadamard(padded * signs)


def unrotate(y: np.ndarray, signs: np.ndarray, dim: int) -> np.ndarray:
    """The inverse of :func:`rotate`: the first ``dim`` entries of diag(signs)·H·y / sqrt(D)."""
    return (_walsh_hadamard(np.asarray(y, dtype=np.float64)) * signs)[..., :dim]


def rounding_bound(dim: int, beta: float) -> float:
    """ρ such that randomised rounding's error norm exceeds it with probability <= ``beta`` (a retry
    then).

    Each coordinate's error e_i has e_i² in [0, 1] and mean p(1 - p) <= 1/4; by Hoeffding,
    P(‖e‖² >= D/4 + t) <= exp(-2 t² / D), so ρ² = D/4 + sqrt(D ln(1/β) / 2).
    """
    if not 0 < beta < 1:
        raise ValueError(f"`beta` must be in (0, 1). Found {beta}.")
    d = padded_dim(dim)
    return math.sqrt(d / 4 + math.sqrt(d * math.log(1 / beta) / 2))


def conditional_round(y: np.ndarray, rho: float, rng: np.random.Generator) -> np.ndarray:
    """Unbiased randomised rounding of ``y`` to integers, redrawn until ‖round(y) - y‖₂ <= ρ.

    Raises:
        RuntimeError: no draw within ρ in 1000 tries (ρ far below :func:`rounding_bound`'s).
    """
    floor = np.floor(y)
    frac = y - floor
    for _ in range(_MAX_ROUNDING_TRIES):
        rounded = floor + (rng.random(y.shape) < frac)
        if np.linalg.norm(rounded - y) <= rho:
            return rounded.astype(np.int64)
    raise RuntimeError(
        f"conditional rounding found no integer vector within ρ = {rho:.4g} of the scaled vector "
                       f"in {_MAX_ROUNDING_TRIES} draws; use rounding_bound(dim, beta) for ρ.")


def skellam_noise(shape: int | tuple[int, ...], variance: float,
                  rng: np.random.Generator) -> np.ndarray:
    """Symmetric Skellam noise Poisson(v/2) - Poisson(v/2) of variance ``v`` per coordinate (zeros
    for v = 0)."""
    if not (variance >= 0 and math.isfinite(variance)):
        raise ValueError(f"`variance` must be a finite number >= 0. Found {variance}.")
    if variance == 0:
        return np.zeros(shape, dtype=np.int64)
    return rng.poisson(variance / 2, shape).astype(np.int64) - rng.poisson(variance / 2,
                                                                           shape).astype(np.int64)


@dataclass(frozen=True)
class SkellamCode:
    """One round's public encoding: the grid, the rotation, the rounding bound and the modulus.

    ``scale``: integers per unit of the vector; ``rho``: the rounding error's bound in integer units
    (see :func:`rounding_bound`); ``bits``: the modulus is ``2**bits``; ``seed``: the rotation's
    public seed.
    """

    dim: int
    scale: float
    rho: float
    bits: int
    seed: int

    def __post_init__(self) -> None:
        if not (self.scale > 0 and math.isfinite(self.scale)):
            raise ValueError(f"`scale` must be a finite number > 0. Found {self.scale}.")
        if not 2 <= self.bits <= 62:
            raise ValueError(
                f"`bits` must be in [2, 62] (the sum is held in int64). Found {self.bits}.")
        if not self.rho > 0:
            raise ValueError(f"`rho` must be > 0. Found {self.rho}.")

    @property
    def modulus(self) -> int:
        """M = 2**bits: secure aggregation adds the clients' integers modulo M."""
        return 1 << self.bits

    @property
    def padded(self) -> int:
        """D: the vector's length once zero-padded for the rotation (:func:`padded_dim`)."""
        return padded_dim(self.dim)


def encode(x: np.ndarray, code: SkellamCode, variance: float,
           rng: np.random.Generator) -> np.ndarray:
    """A client's message: round(rotate(scale·x)) plus Skellam noise of ``variance``, mod M (int64
    in [0, M))."""
    x = np.asarray(x, dtype=np.float64)
    if x.shape != (code.dim,) or not np.all(np.isfinite(x)):
        raise ValueError(
            f"the vector to encode must be {code.dim} finite numbers. Found shape {x.shape}.")
    rounded = conditional_round(rotate(code.scale * x, rotation_signs(code.seed, code.dim)),
                                code.rho, rng)
    return np.mod(rounded + skellam_noise(code.padded, variance, rng), code.modulus)


def modular_sum(messages: Sequence[np.ndarray], bits: int) -> np.ndarray:
    """Σ messages mod 2**bits: what secure aggregation gives the server."""
    total = np.zeros_like(np.asarray(messages[0], dtype=np.int64))
    for m in messages:
        total = np.mod(total + np.asarray(m, dtype=np.int64), 1 << bits)
    return total


def decode(total: np.ndarray, code: SkellamCode) -> np.ndarray:
    """The server's estimate of Σ x_p from the modular sum: centred to [-M/2, M/2), unrotated,
    unscaled."""
    centred = centre(total, code.bits).astype(np.float64)
    return unrotate(centred, rotation_signs(code.seed, code.dim), code.dim) / code.scale


def centre(values: np.ndarray, bits: int) -> np.ndarray:
    """Integers mod 2**bits as their representatives in [-2**(bits-1), 2**(bits-1)) (int64)."""
    values = np.asarray(values, dtype=np.int64)
    half = 1 << (bits - 1)
    return np.where(values >= half, values - 2 * half, values)


def sensitivity(record_l2: float, code: SkellamCode) -> tuple[float, float]:
    """(Δ₁, Δ₂) of the integer sum when one record changes one client's vector by at most
    ``record_l2``.

    Δ₂ = scale·record_l2 + 2ρ: both neighbours' roundings are within ρ of their scaled rotated
    vectors (rotation preserves ℓ2). Δ₁ <= sqrt(D)·Δ₂, and <= Δ₂² since |v_i| <= v_i² for integers.
    """
    l2 = code.scale * record_l2 + 2 * code.rho
    return min(math.sqrt(code.padded) * l2, l2 * l2), l2


def skellam_rdp(order: int, l1: float, l2: float, variance: float) -> float:
    """Rényi DP of order ``order`` of adding Skellam noise of ``variance`` per coordinate to an
    integer vector of sensitivities (ℓ1, ℓ2) = (``l1``, ``l2``).

    ε(α) <= α Δ₂² / (2μ) + min(((2α - 1) Δ₂² + 6 Δ₁) / (4 μ²), 3 Δ₁ / (2 μ)): the Gaussian term plus
    a discretisation surcharge.

    References:
        Agarwal, Kairouz & Liu (2021), Corollary 3.6 (integer α > 1; μ is the variance).
    """
    if not (isinstance(order, (int, np.integer)) and order > 1):
        raise ValueError(f"`order` must be an integer > 1 (Corollary 3.6). Found {order!r}.")
    if not variance > 0:
        return math.inf
    mu, a = variance, int(order)
    return a * l2 * l2 / (2 * mu) + min(((2 * a - 1) * l2 * l2 + 6 * l1) / (4 * mu * mu),
                                        3 * l1 / (2 * mu))


def rdp_to_epsilon(rdp: Sequence[float], orders: Sequence[int], delta: float) -> float:
    """ε at ``delta`` of a mechanism with Rényi DP ``rdp[i]`` at ``orders[i]``: dp-accounting's
    conversion, min_α rdp(α) + ln((α - 1)/α) - (ln δ + ln α) / (α - 1).

    References:
        Canonne, Kamath & Steinke (2020), Proposition 12.
    """
    if not 0 < delta < 1:
        raise ValueError(f"`delta` must be in (0, 1). Found {delta}.")
    from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon  # noqa: PLC0415 -- dp-accounting: ~2 s import, on first use

    return float(compute_epsilon(list(orders), list(rdp), delta)[0])


def _tail(t: float, variance: float) -> float:
    """P(|Skellam(variance)| >= t) <= 2 exp(-t² / (2 (v + t/3))) (Bernstein: a limit of ±1 Bernoulli
    sums)."""
    if t <= 0:
        return 1.0
    return min(1.0, 2 * math.exp(-t * t / (2 * (variance + t / 3)))) if variance > 0 else 0.0


def wrap_probability(code: SkellamCode, sum_l2: float, clients: int, variance: float) -> float:
    """An upper bound on the probability that some coordinate of the noised integer sum leaves
    [-M/2, M/2).

    The sum is rotate(scale·Σ x_p) (rotation is linear; ‖Σ x_p‖ <= ``sum_l2``) plus the P rounding
    errors (each coordinate in (-1, 1)) plus Skellam noise of total ``variance``. A
    randomised-Hadamard coordinate of a vector of norm L is sub-Gaussian: P(|y_i| >= s) <= 2 exp(-s²
    D / (2 L²)). Union bound over the D coordinates, minimised over how the room M/2 - P is split
    between the signal and the noise.
    """
    room = code.modulus / 2 - clients
    if room <= 0:
        return 1.0
    d, signal = code.padded, code.scale * sum_l2
    share = np.linspace(0.0, 1.0, 201)
    s, t = share * room, (1 - share) * room
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        if signal == 0:
            p_signal = np.zeros_like(s)
        else:
            p_signal = np.where(s <= 0, 1.0, np.minimum(1.0,
                                                        2 * np.exp(-s * s * d / (2 * signal**2))))
        if variance > 0:
            tail = np.where(t <= 0, 1.0, np.minimum(1.0,
                                                    2 * np.exp(-t * t / (2 * (variance + t / 3)))))
        else:
            tail = np.where(t <= 0, 1.0, 0.0)
    return float(min(np.min(d * (p_signal + tail)), 1.0))


def choose_scale(  # noqa: PLR0913 -- a round's numbers (grid, sum, noise): no type holds them
        dim: int, bits: int, sum_l2: float, clients: int, noise_multiplier: float,
        record_l2: float, rho: float, wrap: float, seed: int) -> SkellamCode:
    """The finest grid (largest scale) whose noised sum wraps around with probability <= ``wrap``.

    The noise is calibrated to the *integer* sensitivity: its std is ``noise_multiplier ·
    Δ₂(scale)``, so rounding's inflation of Δ₂ is paid for in noise at every scale. The wrap-around
    probability grows with the scale (signal and noise both grow), so the largest scale is found by
    bisection (in log2, to 1e-9).

    Raises:
        ValueError: no scale keeps the wrap-around probability at or below ``wrap``: too few
            bits for P, d and the noise. The message says how many bits would do.
    """
    if record_l2 <= 0 or noise_multiplier <= 0:
        raise ValueError(
            f"`record_l2` and `noise_multiplier` must be > 0. Found {record_l2}, "
            f"{noise_multiplier}.")

    def fits(b: int, log_scale: float) -> bool:
        code = SkellamCode(dim, 2.0**log_scale, rho, b, seed)
        l2 = sensitivity(record_l2, code)[1]
        return wrap_probability(code, sum_l2, clients, (noise_multiplier * l2) ** 2) <= wrap

    lo, hi = -60.0, 62.0
    # the rounding errors and their noise alone overflow: more bits, not a coarser grid
    if not fits(bits, lo):
        need = next((b for b in range(bits + 1, 63) if fits(b, lo)), None)
        raise ValueError(
            f"`bits` = {bits} cannot hold the noised sum of {clients} clients' vectors in {dim} "
            f"coordinates: it wraps around with probability above {wrap:g} at every scale. "
                         + (f"Use at least {need} bits." if need else "Even 62 bits do not."))
    while hi - lo > 1e-9:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if fits(bits, mid) else (lo, mid)
    return SkellamCode(dim, 2.0**lo, rho, bits, seed)
