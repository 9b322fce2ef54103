"""What one audit runs (``diff2 audit`` options): light to import, so ``diff2 --help`` shows its defaults fast."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..core.privacy import Calibration

__all__ = ["LOCAL_STEPS", "AuditSpec", "default_workers"]

_METHODS = ("dpgd", "diff2", "diff2-bvr")

#: K of the audited local routine: one private local step per round, so that x_r = y_2 reveals that step's
#: output exactly (with K > 2 only y_K is released and the K - 1 steps' outputs are mixed; the ledger charges each).
LOCAL_STEPS = 2


@dataclass(frozen=True)
class AuditSpec:
    """One audit: the mechanism under test, its schedule, the federation, the number of trials.

    ``trials`` runs are made on each of D and D′. ``noise_scale`` multiplies the calibrated noise
    (values < 1 deliberately break the mechanism: the audit must then report ε̂ > ε).
    ``seed`` makes the trials' noise reproducible; ``None`` draws every trial's noise key from OS
    entropy, as a production run does.

    ``diff2-bvr`` is DIFF2 with its private BVR-L-SGD local routine (K = :data:`LOCAL_STEPS`): each round's
    local step on worker 0 (forced: the canary's worker) samples every record with probability
    ``local_batch_size / samples``, clips its gradient difference to C3 ||y_1 - y_0|| (``local_clip`` = C3),
    divides the sum by b and adds σ3-calibrated noise; ``local_share`` is the fraction of the GDP budget μ² the
    server's rounds leave to the local steps, and ``local_noise_scale`` multiplies σ3 only.
    """

    method: str = "diff2"
    epsilon: float = 3.0
    delta: float = 1e-5
    rounds: int = 10
    restart_every: int = 5
    u: float = 1.25
    clients: int = 2
    samples: int = 16
    dim: int = 4
    learning_rate: float = 0.5
    clip_restart: float = 1.0
    clip_diff: float = 1.0
    noise_scale: float = 1.0
    local_batch_size: int = 8
    local_share: float = 0.98
    local_clip: float = 1.0
    local_noise_scale: float = 1.0
    trials: int = 10_000
    alpha: float = 0.05
    seed: int | None = None
    workers: int = 1

    def __post_init__(self) -> None:
        def bad(key: str, expected: str) -> ValueError:
            return ValueError(f"`--{key.replace('_', '-')}` must be {expected}. Found {getattr(self, key)!r}.")

        if self.method not in _METHODS:
            raise bad("method", f"one of {_METHODS}")
        for key in ("rounds", "restart_every", "clients", "samples", "dim", "workers", "local_batch_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise bad(key, "an integer >= 1")
        if self.dim < 2:
            raise bad("dim", "at least 2 (one canary axis and at least one benign coordinate)")
        if not isinstance(self.trials, int) or self.trials < 20:
            raise bad("trials", "an integer >= 20")
        if not (math.isfinite(self.noise_scale) and self.noise_scale > 0):
            raise bad("noise_scale", "a finite number > 0 (1 = the calibrated noise)")
        if not (math.isfinite(self.local_noise_scale) and self.local_noise_scale > 0):
            raise bad("local_noise_scale", "a finite number > 0 (1 = the calibrated local noise σ3)")
        if self.local_noise_scale != 1.0 and not self.local:
            raise bad("local_noise_scale", "1 unless --method is diff2-bvr (only diff2-bvr has local steps)")
        if self.local and self.local_batch_size > self.samples:
            raise bad("local_batch_size", f"at most --samples = {self.samples} (each record is sampled with "
                                          "probability b / samples)")
        if not (math.isfinite(self.local_share) and 0 < self.local_share < 1):
            raise bad("local_share", "in (0, 1): the fraction of the budget left to the local steps")
        if not 0 < self.alpha < 1:
            raise bad("alpha", "in (0, 1)")
        for key in ("clip_restart", "clip_diff", "learning_rate", "local_clip"):
            if not (math.isfinite(getattr(self, key)) and getattr(self, key) > 0):
                raise bad(key, "a finite number > 0")
        if self.method in ("diff2", "diff2-bvr") and (self.restart_every < 2 or self.restart_every >= self.rounds):
            raise bad("restart_every", f"between 2 and rounds - 1 = {self.rounds - 1} for {self.method} (restarts "
                                       "and difference rounds both audited)")
        self.calibration()  # ε, δ, u: the calibration's own checks, with their messages

    @property
    def period(self) -> int:
        return 1 if self.method == "dpgd" else self.restart_every

    @property
    def local(self) -> bool:
        """Whether the audited mechanism has the private local routine (method diff2-bvr)."""
        return self.method == "diff2-bvr"

    def calibration(self) -> "Calibration":
        """The claimed calibration: the one a run of this schedule would use (the local routine's σ3 by PLD)."""
        from ..core.privacy import calibrate

        local = ({"local_steps": LOCAL_STEPS, "local_batch_size": self.local_batch_size,
                  "local_share": self.local_share} if self.local else {})
        return calibrate(epsilon=self.epsilon, delta=self.delta, rounds=self.rounds, restart_every=self.period,
                         u=self.u, n_min=self.samples, clients=self.clients, **local)


def default_workers() -> int:
    return max(1, min(4, os.cpu_count() or 1))
