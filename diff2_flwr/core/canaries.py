"""Canary records a data owner adds to its own replies, to audit a live run from the iterates it
receives.

B canaries live in the model's own coordinates: an orthonormal random frame u_1..u_B of R^d (B ≤ d)
and balanced signs s_k = ±1, both from the owner's secret seed (the server never learns them). In
every gradient round r, canary k is a record whose clipped contribution is s_k·C_r·u_k (C_r the
round's clipping radius: on a restart round its gradient, on a difference round its gradient
difference, each exactly at the radius), so the owner's ClippedMean becomes (n_p·m_p + C_r Σ_k s_k
u_k)/(n_p + B) over n_p + B records — the reply B such records would give. A canary record is a
record like any other: its sensitivity 2C_r/((n_p + B)P) is at most the 2C_r/(n_min P) the
calibration accounts, so the owner's real records keep (at least) the claimed guarantee.

The owner sees x_{r-1} in round r's task; its projections y_{r-1} = U x_{r-1} onto the frame (B
numbers) are all the audit needs (:mod:`diff2_flwr.lab.audit.live`). Because the frame is
orthonormal, the server's Gaussian noise projected onto it is exactly B independent N(0, σ_r²) per
round.

References:
    Andrew, Kairouz, Oh, Oprea, McMahan & Suriyakumar (2024), "One-shot Empirical Privacy Estimation
    for Federated Learning", ICLR (random canaries whose projections on the released model estimate
    ε in one run).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["CanaryFrame", "MAX_FRAME_ENTRIES"]

#: The largest B·d a frame may hold (float64: 400 MB): a larger model takes fewer canaries.
MAX_FRAME_ENTRIES = 50_000_000


@dataclass(frozen=True)
class CanaryFrame:
    """B orthonormal random directions of R^d and their balanced signs, from ``seed`` (the owner's
    secret)."""

    seed: int
    count: int
    dim: int
    directions: np.ndarray = field(init=False, repr=False)  # [B, d], orthonormal rows
    signs: np.ndarray = field(init=False, repr=False)  # [B], half +1, half -1

    def __post_init__(self) -> None:
        if self.count < 2 or self.count % 2:
            raise ValueError(
                f"canaries: count must be an even number >= 2 (half + and half - records). Found "
                             f"{self.count}.")
        if self.count > self.dim:
            raise ValueError(
                f"canaries: count must be at most the model's {self.dim} coordinates (one "
                f"orthonormal direction each). Found {self.count}.")
        if self.count * self.dim > MAX_FRAME_ENTRIES:
            raise ValueError(
                f"canaries: count x model dimension must be at most {MAX_FRAME_ENTRIES:,} (the "
                f"frame is held in memory). Found {self.count} x {self.dim}; take at most "
                f"{MAX_FRAME_ENTRIES // self.dim} canaries.")
        rng = np.random.Generator(np.random.PCG64(self.seed))
        q, r = np.linalg.qr(rng.standard_normal((self.dim, self.count)))
        q *= np.sign(np.diag(r))  # the Haar-distributed frame (QR's sign convention removed)
        signs = np.repeat([1.0, -1.0], self.count // 2)
        rng.shuffle(signs)
        object.__setattr__(self, "directions", np.ascontiguousarray(q.T))
        object.__setattr__(self, "signs", signs)

    def add(self, mean: np.ndarray, num_samples: int, radius: float) -> tuple[np.ndarray, int]:
        """The ClippedMean over ``num_samples`` records with the B canary records added: (mean,
        count)."""
        total = num_samples + self.count
        canaries = radius * (self.signs @ self.directions)
        return (num_samples * np.asarray(mean, dtype=np.float64) + canaries) / total, total

    def project(self, x: np.ndarray) -> np.ndarray:
        """U x: the coordinates of ``x`` along the B directions."""
        return self.directions @ np.asarray(x, dtype=np.float64)
