"""What one audit runs: light to import, so ``diff2 --help`` shows its defaults fast.

Each field is declared once (:func:`~diff2_flwr.runtime.spec.setting`: default and help; the type by its annotation)
and checked with :func:`~diff2_flwr.runtime.spec.require`; ``diff2 audit``'s flags are derived from the fields.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from ...runtime.spec import Invalid, require, setting

if TYPE_CHECKING:
    from ...core.distributed import DistributedNoise
    from ...core.privacy import Calibration

__all__ = ["LOCAL_STEPS", "WRAP", "AuditSpec", "default_workers"]

_METHODS = ("dpgd", "diff2", "diff2-bvr")  # AuditSpec.method's Literal, checked also when built in Python
_NOISES = ("central", "distributed")  # AuditSpec.noise's Literal
_PATHS = ("in-process", "flower")  # AuditSpec.path's Literal

#: The most canaries one run may carry (``--canaries``): a run's rows are dense, ~(B + 16)² float64 per client.
MAX_CANARIES = 4096

#: The wrap-around bound of an audited distributed-noise round: ``privacy.wrap``'s default.
WRAP = 1e-6

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

    ``noise = "distributed"`` audits ``privacy.noise: distributed``: each client adds its share of Skellam noise to
    its encoded clipped mean and the server decodes the modular sum (``bits`` per coordinate); ``tolerated`` = t of
    the P clients (never worker 0, the canary's) drop out of every round, so that the sum carries exactly the
    P - t shares the analysis counts on. There ``noise_scale`` multiplies every client's share std (the server and
    its ledger keep the calibrated noise).
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
    noise_scale: float = setting(1.0, "multiply the calibrated noise (< 1 breaks the mechanism on purpose); "
                                      "distributed: every client's share std")
    noise: Literal["central", "distributed"] = setting(
        "central", "who adds the noise: central (the server) or distributed (each client a Skellam share, the "
                   "server decodes the secure sum), as privacy.noise")
    bits: int = setting(20, "distributed: bits per coordinate of the secure sum (modulus 2**bits), as privacy.bits")
    tolerated: int = setting(0, "distributed: t, clients (never the canary's) that drop out of every round; the "
                                "other P - t carry the whole noise (P > 2t), as privacy.tolerated")
    local_batch_size: int = setting(8, "diff2-bvr: b, each record sampled with probability b / samples")
    local_share: float = setting(0.98, "diff2-bvr: fraction of the budget μ² left to the local steps")
    local_clip: float = setting(1.0, "diff2-bvr: C3, local radius C3 ||y_1 - y_0||")
    local_noise_scale: float = setting(1.0, "diff2-bvr: multiply the calibrated local noise σ3 (< 1 breaks it on "
                                            "purpose)")
    trials: int = setting(10_000, "trials on each of D and D' (with --canaries 1: runs)")
    canaries: int = setting(1, "B, canaries per run (dpgd, diff2; central): 1 = one run per trial; an even B > 1: "
                               "B canaries on axes of their own in one run, each an independent trial "
                               "(canaries.py), so 2 x trials / B runs")
    path: Literal["in-process", "flower"] = setting(
        "in-process", "in-process: the Strategy's and the clients' calls in this process; flower: a Flower "
                      "simulation of the audit's ServerApp (the real Diff2Strategy) and ClientApp (the real "
                      "Diff2Client), with --canaries B > 1")
    alpha: float = setting(0.001, "probability of reporting a violation of a correct mechanism (split between the "
                                  "Clopper-Pearson and the μ-GDP tests)")
    seed: int | None = setting(None, "reproducible noise (default: OS entropy per run)")
    workers: int = setting(1, "processes", cli_default=lambda: default_workers())

    def __post_init__(self) -> None:
        try:
            self._check()
        except Invalid as err:  # the same check as every section's, said as the audit's flag
            raise ValueError(f"`--{err.key.replace('_', '-')}` must be {err.expected}. Found {err.found!r}.") from None
        self.calibration()  # ε, δ, u: the calibration's own checks, with their messages
        if self.distributed:
            self.distributed_noise()  # the Skellam calibration's and the bits' own checks, with their messages

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
        require(isinstance(self.canaries, int) and not isinstance(self.canaries, bool)
                and (self.canaries == 1 or (self.canaries >= 2 and self.canaries % 2 == 0)), "canaries",
                "1 or an even integer >= 2 (half the canaries on D, half on D')", self.canaries)
        require(self.canaries <= MAX_CANARIES, "canaries", f"at most {MAX_CANARIES} (a run's per-sample rows are dense, "
                "(B + samples) x (B + dim - 1) per client: memory and time grow as B², trials per run as B; "
                "1,000 is a good size)", self.canaries)
        require(self.canaries == 1 or (self.method in ("dpgd", "diff2") and not self.distributed), "canaries",
                "1 for --method diff2-bvr and --noise distributed (independent trials from one run need Gaussian "
                "noise independent across coordinates and a fixed μ per round: central dpgd and diff2)",
                self.canaries)
        require(self.path in _PATHS, "path", f"one of {_PATHS}", self.path)
        require(self.path == "in-process" or self.canaries >= 2, "path",
                "in-process unless --canaries B >= 2 (a Flower run takes seconds: one per trial would take hours)",
                self.path)
        require(self.noise in _NOISES, "noise", f"one of {_NOISES}", self.noise)
        require(not (self.distributed and self.local), "noise", "central for --method diff2-bvr (privacy.noise: "
                "distributed has no local routine)", self.noise)
        require(isinstance(self.bits, int) and 2 <= self.bits <= 31, "bits", "an integer in [2, 31] (Flower's "
                "SecAgg+ quantiser casts to int32)", self.bits)
        require(isinstance(self.tolerated, int) and self.tolerated >= 0 and 2 * self.tolerated < self.clients,
                "tolerated", f"an integer t >= 0 with 2t < --clients = {self.clients}", self.tolerated)
        require(self.tolerated == 0 or self.distributed, "tolerated", "0 unless --noise is distributed",
                self.tolerated)
        require(not self.distributed or self.clients >= 2, "clients", "at least 2 for --noise distributed (secure "
                "aggregation of one client is its value)", self.clients)
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

    @property
    def distributed(self) -> bool:
        """Whether the clients add the noise (``privacy.noise: distributed``)."""
        return self.noise == "distributed"

    def distributed_noise(self) -> "DistributedNoise":
        """The run's distributed-noise settings (``privacy.noise: distributed``) for this schedule and federation."""
        return _distributed_noise(self.epsilon, self.delta, self.rounds, self.period, self.u, self.dim, self.bits,
                                  self.clients, self.tolerated, self.samples)

    def calibration(self) -> "Calibration":
        """The claimed calibration: the one a run of this schedule would use (the local routine's σ3 by PLD)."""
        from ...core.privacy import calibrate

        local = ({"local_steps": LOCAL_STEPS, "local_batch_size": self.local_batch_size,
                  "local_share": self.local_share} if self.local else {})
        return calibrate(epsilon=self.epsilon, delta=self.delta, rounds=self.rounds, restart_every=self.period,
                         u=self.u, n_min=self.samples, clients=self.clients, **local)


@functools.lru_cache(maxsize=8)
def _distributed_noise(epsilon: float, delta: float, rounds: int, restart_every: int, u: float, dim: int, bits: int,
                       clients: int, tolerated: int, n_min: int) -> "DistributedNoise":
    """:func:`~diff2_flwr.core.distributed.distributed_noise`, once per setting (its calibration takes seconds)."""
    from ...core.distributed import distributed_noise

    return distributed_noise(epsilon=epsilon, delta=delta, rounds=rounds, restart_every=restart_every, u=u, dim=dim,
                             bits=bits, clients=clients, tolerated=tolerated, n_min=n_min, wrap=WRAP)


def default_workers() -> int:
    return max(1, min(4, os.cpu_count() or 1))
