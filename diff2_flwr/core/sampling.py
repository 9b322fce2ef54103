"""Client sampling for DIFF2: who takes part in a round, and how the round's sum is normalised.

Each round the server draws a cohort S_r ⊂ {0, …, P-1} of the P registered clients, from its own
generator (never the global one), and only the cohort computes:

- ``poisson``: every client independently with probability q (|S_r| ~ Binomial(P, q), possibly 0);
- ``fixed``: m of the P clients uniformly without replacement (|S_r| = m).

Either way a given client is in the cohort with probability π = q (Poisson) or π = m/P (fixed),
and the expected cohort is E|S| = πP (= qP, or m).

**Normalisation by the expected cohort.** The round's aggregate of per-client statistics a_p is

    A_r = (1 / E|S|) Σ_{p∈S_r} a_p,

not the mean over the realised cohort. Then

    E[A_r] = (1 / E|S|) Σ_p P(p ∈ S_r) a_p = (1 / (πP)) Σ_p π a_p = (1/P) Σ_p a_p,

the full-participation average, and replacing one record of one client moves A_r by at most
‖a_p − a_p'‖ / E|S| ≤ 2C / (n_min E|S|) whoever else was drawn (a realised-cohort mean would have a
sensitivity that grows as the cohort shrinks). With π = 1 this is exactly DIFF2's (1/P) Σ_p.

The variance this adds (over the cohort draw alone; Horvitz–Thompson / simple random sampling):

    Poisson:  E‖A_r − ā‖² = (1 − q) / (q P²) · Σ_p ‖a_p‖²,
    fixed:    E‖A_r − ā‖² = (1 − m/P) / m · (1/(P−1)) Σ_p ‖a_p − ā‖²,      ā = (1/P) Σ_p a_p.

**The sampled-difference (SPIDER-style) estimator.** DIFF2's clients are stateless, so a round's
cohort can evaluate its statistics at both iterates the server sends. With g_p(x) client p's
statistic at x (its ClippedMean of per-sample gradients; its gradient ∇f_p(x) without clipping),
restart rounds (r − 1 ≡ 0 mod T) and difference rounds read

    ṽ_r = (1/E|S|) Σ_{p∈S_r} g_p(x_{r−1}) + ξ_r,
    ṽ_r = ṽ_{r−1} + (1/E|S|) Σ_{p∈S_r} (g_p(x_{r−1}) − g_p(x_{r−2})) + ξ_r,

with ξ_r ~ N(0, σ² C_r² I) and a fresh cohort S_r each round, drawn independently of everything
before. (With clipping the difference statistic is client p's ClippedMean of per-sample differences;
write δ_p(x_{r−1}, x_{r−2}) for it, = g_p(x_{r−1}) − g_p(x_{r−2}) without clipping. In the indexing
v_r = v_{r−1} + (1/E|S|) Σ_{p∈S_r} (g_p(x_r) − g_p(x_{r−1})) it is the same recursion.)

Let F_{r−1} be everything released before round r (so x_{r−1}, x_{r−2}, ṽ_{r−1} are fixed given it)
and r0 ≤ r the last restart round. Along the realised iterates define the full-cohort estimate

    V_{r0} = (1/P) Σ_p g_p(x_{r0−1}),      V_s = V_{s−1} + (1/P) Σ_p δ_p(x_{s−1}, x_{s−2}).

By the identity above (and E ξ_s = 0), each round's error increment

    e_s = (ṽ_s − ṽ_{s−1}) − (V_s − V_{s−1}),      E[e_s | F_{s−1}] = 0,

is a martingale difference (e_{r0} = ṽ_{r0} − V_{r0} likewise), so

    ṽ_r − V_r = Σ_{s=r0}^{r} e_s,      E[ṽ_r − V_r] = 0,      E‖ṽ_r − V_r‖² = Σ_s E‖e_s‖²,

and without clipping V_r = ∇f(x_{r−1}) by telescoping: the sampled estimator is unbiased. The
increments' errors add up until the next restart resets the sum; a difference increment's sampling
variance scales with Σ_p ‖δ_p‖² ≲ P L² ‖x_{r−1} − x_{r−2}‖² (L-smoothness), which is why sampled
differences stay cheap while the iterates settle.

Privacy: see :class:`~diff2_flwr.core.accounting.SampledGaussianEvent` (each round, the record's
client is in the cohort with probability π; the cohort itself may be public).

References:
    Murata & Suzuki (2023), Alg. 1 (DIFF2; the paper leaves client sampling to future work).
    Fang, Li, Lin & Zhang (2018), "SPIDER", Alg. 1 (the recursive estimator with sampled
    differences). Horvitz & Thompson (1952) (the unbiased normalisation by inclusion probability);
    Cochran (1977), Sampling Techniques, Thm 2.2 (variance under sampling without replacement).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

__all__ = [
    "SAMPLING_KINDS",
    "Sampling",
    "SamplingKind",
    "aggregate_scale",
    "cohort_key",
    "denominator",
    "draw_cohort",
    "round_cohort",
    "sampled_sum",
]

#: The domain tag of the cohort draws' seed sequences (the noise's is another:
#: :func:`~diff2_flwr.core.estimator.round_normals`), so that a key's cohorts and noise are
#: independent streams.
COHORT_DOMAIN = 0xC0407

SamplingKind = Literal["poisson", "fixed"]

SAMPLING_KINDS: tuple[str, ...] = ("poisson", "fixed")


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _check_clients(clients: object) -> int:
    if not _is_int(clients) or int(clients) < 1:  # type: ignore[call-overload]
        raise ValueError(
            f"`clients` (P, the federation's registered size) must be an integer >= 1. Found "
            f"{clients!r}.")
    return int(clients)  # type: ignore[call-overload]


@dataclass(frozen=True)
class Sampling:
    """How each round's cohort is drawn: ``Sampling("poisson", rate=q)`` or ``Sampling("fixed",
    size=m)``.

    Args:
        kind: ``"poisson"`` (each client independently with probability ``rate``) or ``"fixed"``
            (``size`` clients uniformly without replacement).
        rate: q in (0, 1], Poisson only.
        size: m >= 1, fixed only (m <= P is checked against P where P is known).

    Raises:
        ValueError: naming the field, what was expected and what was found.
    """

    kind: SamplingKind
    rate: float | None = None
    size: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in SAMPLING_KINDS:
            raise ValueError(f"`sampling.kind` must be one of {SAMPLING_KINDS}. Found "
                             f"{self.kind!r}.")
        if self.kind == "poisson":
            rate = self.rate
            if (not isinstance(rate, (int, float)) or isinstance(rate, bool)
                    or not (math.isfinite(rate) and 0 < rate <= 1)):
                raise ValueError(
                    f"`sampling.rate` (q) must be a number in (0, 1] for Poisson sampling. Found "
                    f"{rate!r}.")
            if self.size is not None:
                raise ValueError(
                    f"`sampling.size` is for kind 'fixed'; Poisson sampling takes `rate` only. "
                    f"Found size = {self.size!r}.")
            object.__setattr__(self, "rate", float(rate))  # plain data (an int 1, a numpy float)
        else:
            if not _is_int(self.size) or int(self.size) < 1:  # type: ignore[arg-type]
                raise ValueError(
                    f"`sampling.size` (m) must be an integer >= 1 for a fixed cohort. Found "
                    f"{self.size!r}.")
            if self.rate is not None:
                raise ValueError(
                    f"`sampling.rate` is for kind 'poisson'; a fixed cohort takes `size` only. "
                    f"Found rate = {self.rate!r}.")
            object.__setattr__(self, "size", int(self.size))  # type: ignore[arg-type]

    def probability(self, clients: int) -> float:
        """π: the probability that a given client (so each of its records) is in a round's cohort:
        q (Poisson) or m/P (fixed).

        Args:
            clients: P, the number of registered clients the cohort is drawn from.

        Raises:
            ValueError: P is not an integer >= 1, or a fixed cohort is larger than P.
        """
        p = _check_clients(clients)
        if self.kind == "poisson":
            return float(self.rate)  # type: ignore[arg-type]
        if int(self.size) > p:  # type: ignore[arg-type]
            raise ValueError(
                f"`sampling.size` (m) must be at most the number of clients P = {p}. Found "
                f"{self.size!r}.")
        return int(self.size) / p  # type: ignore[arg-type]

    def expected_cohort(self, clients: int) -> float:
        """E|S|: qP (Poisson) or m (fixed); the normaliser of a round's sum.

        Args:
            clients: P.
        """
        pi = self.probability(clients)
        return float(int(self.size)) if self.kind == "fixed" else pi * clients  # type: ignore[arg-type]


def draw_cohort(sampling: Sampling, clients: int, rng: np.random.Generator) -> np.ndarray:
    """One round's cohort: the sorted indices (int64) of the sampled clients among 0..P-1.

    Poisson: each client independently with probability q (the cohort may be empty); fixed: m
    distinct clients uniformly at random.

    Args:
        sampling: how to draw.
        clients: P.
        rng: the server's generator (in production from OS entropy; seeded in tests only). It is
            advanced; nothing global is touched.

    Raises:
        ValueError: an invalid P or m > P.
        TypeError: ``rng`` is not a ``numpy.random.Generator``.
    """
    if not isinstance(rng, np.random.Generator):
        raise TypeError(
            f"`rng` must be a numpy.random.Generator (the server's own; the global RNG is never "
            f"used). Found {type(rng).__name__}.")
    pi = sampling.probability(clients)
    if sampling.kind == "poisson":
        # random() is in [0, 1): q = 1 takes every client.
        return np.flatnonzero(rng.random(clients) < pi).astype(np.int64)
    return np.sort(rng.choice(clients, size=int(sampling.size), replace=False)).astype(np.int64)  # type: ignore[arg-type]


def cohort_key(noise_key: int) -> int:
    """The key of a run's cohort draws from its noise key, one way: the first 128 bits of
    SHA-256("diff2-cohort" ‖ the key's bytes). Cohorts may be public (the journal records them);
    recovering this key from them would still not give the noise key, which is secret. The same
    for every engine (the batched engine derives it from a run's noise seed), so that seeded runs
    draw the same cohorts everywhere and a resumed run the cohorts of the run it resumes.

    Args:
        noise_key: the run's noise key (an integer >= 0).
    """
    if not isinstance(noise_key, (int, np.integer)) or isinstance(noise_key, bool) or noise_key < 0:
        raise ValueError(f"`noise_key` must be an integer >= 0. Found {noise_key!r}.")
    key = int(noise_key)
    data = b"diff2-cohort" + key.to_bytes(max(1, (key.bit_length() + 7) // 8), "little")
    return int.from_bytes(hashlib.sha256(data).digest()[:16], "little")


def round_cohort(key: int, r: int, sampling: Sampling, clients: int) -> np.ndarray:
    """Round r's cohort for the run whose cohort key is ``key``: :func:`draw_cohort` with a fresh
    PCG64 from the SeedSequence of (key, (:data:`COHORT_DOMAIN`, r)), as
    :func:`~diff2_flwr.core.estimator.round_normals` draws a round's noise (another domain): the
    same cohort for the same (key, r) in every engine, whatever rounds were drawn before.

    The key is the server's (from its own entropy in a deployment; seeded only on request). The
    accounting does not need the cohort to be secret (:class:`~diff2_flwr.core.accounting.
    SampledGaussianEvent`), only independent of the data; a key should still not be the noise's.

    Args:
        key: an integer >= 0.
        r: the round, >= 1.
        sampling: how to draw.
        clients: P.
    """
    seq = np.random.SeedSequence(entropy=key, spawn_key=(COHORT_DOMAIN, r))
    return draw_cohort(sampling, clients, np.random.Generator(np.random.PCG64(seq)))


def denominator(sampling: Sampling | None, clients: int) -> float:
    """E|S|, what a round's sum over its cohort is divided by (P without sampling; qP or m).

    Args:
        sampling: the cohort rule, or None for full participation.
        clients: P.
    """
    p = _check_clients(clients)
    return float(p) if sampling is None else sampling.expected_cohort(p)


def aggregate_scale(sampling: Sampling | None, clients: int) -> float:
    """1 / E|S|: the factor of a round's sum over its cohort (1/P without sampling).

    Args:
        sampling: the cohort rule, or None for full participation.
        clients: P.
    """
    p = _check_clients(clients)
    return 1.0 / (p if sampling is None else sampling.expected_cohort(p))


def sampled_sum(sampling: Sampling | None, clients: int, cohort: np.ndarray,
                statistics: np.ndarray) -> np.ndarray:
    """(1 / E|S|) Σ_{p∈S} a_p: the unbiased estimate of (1/P) Σ_p a_p from the cohort's rows.

    Args:
        sampling: the cohort rule (None: full participation, the cohort must be all P clients).
        clients: P.
        cohort: the sampled indices (from :func:`draw_cohort`).
        statistics: shape (|S|, d), row i the statistic of client ``cohort[i]``. An empty cohort
            gives zeros (shape (0, d)).

    Raises:
        ValueError: the rows do not match the cohort.
    """
    stats = np.asarray(statistics, dtype=np.float64)
    cohort = np.asarray(cohort)
    if stats.ndim != 2 or stats.shape[0] != cohort.shape[0]:
        raise ValueError(
            f"`statistics` must have one row per sampled client: expected shape ({cohort.shape[0]},"
            f" d). Found {stats.shape}.")
    # divided (not multiplied by 1/E|S|): the bits of the full-participation mean Σ_p a_p / P
    return stats.sum(axis=0) / denominator(sampling, clients)
