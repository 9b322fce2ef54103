"""What one audit runs: light to import, so ``diff2 --help`` shows its defaults fast.

Each field is declared once (:func:`~diff2_flwr.runtime.spec.setting`: default and help; the type by its annotation)
and checked with :func:`~diff2_flwr.runtime.spec.require`; ``diff2 audit``'s flags are derived from the fields.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from ..runtime.spec import Invalid, require, setting

if TYPE_CHECKING:
    from ..core.privacy import Calibration

__all__ = ["LOCAL_STEPS", "AuditSpec", "default_workers"]

_METHODS = ("dpgd", "diff2", "diff2-bvr")  # AuditSpec.method's Literal, checked also when built in Python

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

    method: Literal["dpgd", "diff2", "diff2-bvr"] = setting(
        "diff2", "mechanism; diff2-bvr: DIFF2 with its private BVR-L-SGD local routine, K = 2")
    epsilon: float = setting(3.0, "claimed ε")
    delta: float = setting(1e-5, "δ")
    rounds: int = setting(10, "R, rounds per run")
    restart_every: int = setting(5, "T for diff2 (dpgd is T = 1)")
    u: float = setting(1.25, "budget split u")
    clients: int = setting(2, "P, workers")
    samples: int = setting(16, "records per worker")
    dim: int = setting(4, "model dimension: one canary axis and dim - 1 benign coordinates")
    learning_rate: float = setting(0.5, "η of the audited GD step")
    clip_restart: float = setting(1.0, "C1, the radius of restart rounds")
    clip_diff: float = setting(1.0, "C2, the radius of difference rounds (C2 ||x_(r-1) - x_(r-2)||)")
    noise_scale: float = setting(1.0, "multiply the calibrated noise (< 1 breaks the mechanism on purpose)")
    local_batch_size: int = setting(8, "diff2-bvr: b, each record sampled with probability b / samples")
    local_share: float = setting(0.98, "diff2-bvr: fraction of the budget μ² left to the local steps")
    local_clip: float = setting(1.0, "diff2-bvr: C3, local radius C3 ||y_1 - y_0||")
    local_noise_scale: float = setting(1.0, "diff2-bvr: multiply the calibrated local noise σ3 (< 1 breaks it on "
                                            "purpose)")
    trials: int = setting(10_000, "runs on each of D and D'")
    alpha: float = setting(0.05, "1 - confidence")
    seed: int | None = setting(None, "reproducible noise (default: OS entropy per run)")
    workers: int = setting(1, "processes", cli_default=lambda: default_workers())

    def __post_init__(self) -> None:
        try:
            self._check()
        except Invalid as err:  # the same check as every section's, said as the audit's flag
            raise ValueError(f"`--{err.key.replace('_', '-')}` must be {err.expected}. Found {err.found!r}.") from None
        self.calibration()  # ε, δ, u: the calibration's own checks, with their messages

    def _check(self) -> None:
        require(self.method in _METHODS, "method", f"one of {_METHODS}", self.method)
        for key in ("rounds", "restart_every", "clients", "samples", "dim", "workers", "local_batch_size"):
            value = getattr(self, key)
            require(isinstance(value, int) and not isinstance(value, bool) and value >= 1, key, "an integer >= 1",
                    value)
        require(self.dim >= 2, "dim", "at least 2 (one canary axis and at least one benign coordinate)", self.dim)
        require(isinstance(self.trials, int) and self.trials >= 20, "trials", "an integer >= 20", self.trials)
        require(math.isfinite(self.noise_scale) and self.noise_scale > 0, "noise_scale",
                "a finite number > 0 (1 = the calibrated noise)", self.noise_scale)
        require(math.isfinite(self.local_noise_scale) and self.local_noise_scale > 0, "local_noise_scale",
                "a finite number > 0 (1 = the calibrated local noise σ3)", self.local_noise_scale)
        require(self.local_noise_scale == 1.0 or self.local, "local_noise_scale",
                "1 unless --method is diff2-bvr (only diff2-bvr has local steps)", self.local_noise_scale)
        require(not self.local or self.local_batch_size <= self.samples, "local_batch_size",
                f"at most --samples = {self.samples} (each record is sampled with probability b / samples)",
                self.local_batch_size)
        require(math.isfinite(self.local_share) and 0 < self.local_share < 1, "local_share",
                "in (0, 1): the fraction of the budget left to the local steps", self.local_share)
        require(0 < self.alpha < 1, "alpha", "in (0, 1)", self.alpha)
        for key in ("clip_restart", "clip_diff", "learning_rate", "local_clip"):
            require(math.isfinite(getattr(self, key)) and getattr(self, key) > 0, key, "a finite number > 0",
                    getattr(self, key))
        require(self.method == "dpgd" or 2 <= self.restart_every < self.rounds, "restart_every",
                f"between 2 and rounds - 1 = {self.rounds - 1} for {self.method} (restarts and difference rounds "
                "both audited)", self.restart_every)

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
