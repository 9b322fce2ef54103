"""The privacy sections of an experiment file: ``privacy``, and ``local`` (the private local
routine).

Each field is declared once (:func:`~diff2_flwr.runtime.spec.setting`: default, help and, where the
Python API names it otherwise, its argument; the type by its annotation; the checks in
``__post_init__``). They are apart from the other run sections (:mod:`.config_training`) because
they need nothing beyond the standard library: ``diff2 audit`` builds its settings from these
declarations, and its parser must stay light to import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from .spec import require, setting

__all__ = ["PrivacyConfig", "LocalConfig"]


@dataclass(frozen=True)
class PrivacyConfig:
    """The target (ε, δ) of the whole run, its accounting, and who adds the noise."""

    epsilon: float = setting(3.0, "the target ε of the whole run")
    delta: float = setting(1e-5, "the target δ of the whole run")
    mode: Literal["exact", "rdp"] = setting(
        "exact", "exact (μ-GDP, tight) or rdp (zCDP, the paper's style, more noise)")
    u: float = setting(1.25, "budget split: restart rounds get 1/u, difference rounds (u-1)/u; > 1 "
                             "when T > 1")
    n_min: int | None = setting(None, "samples of the smallest shard (null: computed from the "
                                      "dataset); clients holding fewer make the server refuse the "
                                      "round")
    max_sigma: float | None = setting(1.0, "refuse a run whose σ1 or σ2 (noise std per coordinate, "
                                           "in clipping radii) exceeds this: the noise would drown "
                                           "any signal (the (ε, δ) guarantee holds either way); "
                                           "null: no limit")
    noise: Literal["central", "distributed"] = setting(
        "central", "who adds the noise: central (the server, trusted with each client's clipped "
                   "mean) or distributed (each client adds a share of Skellam noise, the server "
                   "learns only the sum through Flower's SecAgg+)")
    bits: int = setting(20, "distributed: bits per coordinate of the secure sum (modulus 2**bits, "
                            "at most 31 for Flower's SecAgg+)")
    tolerated: int = setting(0, "distributed: t, the clients that may drop out or collude with the "
                                "server; the other P - t carry the whole noise (P > 2t)")
    wrap: float = setting(1e-6, "distributed: bound on the probability that a round's secure sum "
                                "wraps around the modulus (the grid is the finest that keeps it)")

    def __post_init__(self) -> None:
        require(math.isfinite(self.epsilon) and self.epsilon > 0, "epsilon", "a finite number > 0",
                self.epsilon)
        require(0 < self.delta < 1, "delta", "a number in (0, 1)", self.delta)
        require(self.n_min is None or self.n_min >= 1, "n_min", "null or an integer >= 1",
                self.n_min)
        require(self.max_sigma is None or (math.isfinite(self.max_sigma) and self.max_sigma > 0),
                "max_sigma", "null or a finite number > 0", self.max_sigma)
        require(self.noise in ("central", "distributed"), "noise", "central or distributed",
                self.noise)
        require(2 <= self.bits <= 31, "bits", "an integer in [2, 31] (Flower's SecAgg+ quantiser "
                "casts to int32)", self.bits)
        require(self.tolerated >= 0, "tolerated", "an integer >= 0", self.tolerated)
        require(0 < self.wrap < 1, "wrap", "a probability in (0, 1)", self.wrap)

    @property
    def distributed(self) -> bool:
        """Whether the clients add the noise (``noise: distributed``)."""
        return self.noise == "distributed"


@dataclass(frozen=True)
class LocalConfig:
    """DIFF2's private BVR-L-SGD local routine (``steps: 0``: off, x_r = Routine(x_(r-1), ṽ_r) on
    the server)."""

    steps: int = setting(0, "K: K - 1 private local steps per round on one worker chosen at "
                            "random; 0 = off", argument="local_steps")
    batch_size: int = setting(64, "b: expected Poisson batch size (the minibatch sum is divided "
                                  "by b); at most n_min", argument="local_batch_size")
    clip: float = setting(1.0, "C3: the radius of a local step is C3 ||y_k - y_(k-1)||",
                          argument="local_clip")
    share: float = setting(0.5, "fraction of the GDP budget μ² the server's rounds leave to the "
                                "local steps", argument="local_share")

    def __post_init__(self) -> None:
        require(self.steps == 0 or self.steps >= 2, "steps", "0 (off) or an integer K >= 2",
                self.steps)
        require(self.batch_size >= 1, "batch_size", "an integer >= 1", self.batch_size)
        require(math.isfinite(self.clip) and self.clip > 0, "clip", "a finite number > 0",
                self.clip)
        require(math.isfinite(self.share) and 0 < self.share < 1, "share", "a number in (0, 1)",
                self.share)

    @property
    def enabled(self) -> bool:
        """Whether the local routine runs (K > 0)."""
        return self.steps > 0
