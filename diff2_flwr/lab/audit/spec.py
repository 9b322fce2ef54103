"""What one audit runs: light to import, so ``diff2 --help`` shows its defaults fast.

The settings an audit shares with a run (ε, δ, u, the noise, its bits and t; the local routine's
b, share and C3) are the run's declarations (:mod:`~diff2_flwr.runtime.config_privacy`, through
:func:`run_setting`): their help text, their default unless the audit's deliberately differs,
their type and their checks (the section's own, run on the audit's values). The audit's own
fields are declared here (:func:`~diff2_flwr.runtime.spec.setting`: default and help; the type by
its annotation) and checked with :func:`~diff2_flwr.runtime.spec.require`; ``diff2 audit``'s
flags are derived from the fields.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Literal

from ...runtime.config_privacy import LocalConfig, PrivacyConfig
from ...runtime.spec import Invalid, describe_type, require, setting, type_ok

if TYPE_CHECKING:
    from ...core.distributed import DistributedNoise
    from ...core.privacy import Calibration
    from ...core.sampling import Sampling

__all__ = ["BATCH_ENGINES", "ENGINES", "ENGINE_DTYPES", "ENGINE_SEED", "LOCAL_STEPS",
           "WORKER_ENGINES", "WRAP", "AuditSpec", "EngineAuditSpec", "default_workers",
           "run_setting"]

# AuditSpec.method's and .path's Literals, checked also when built in Python
_METHODS = ("dpgd", "diff2", "diff2-bvr")
_PATHS = ("in-process", "flower")
_SAMPLINGS = ("none", "poisson", "fixed")

#: The most canaries one run may carry (``--canaries``): a run's rows are dense, ~(B + 16)²
#: float64 per client.
MAX_CANARIES = 4096

#: K of the audited local routine: one private local step per round, so that x_r = y_2 reveals
#: that step's output exactly (with K > 2 only y_K is released and the K - 1 steps' outputs are
#: mixed; the ledger charges each).
LOCAL_STEPS = 2

_SAME: Any = object()  # run_setting's default: the declaration's


def _declaration(section: type, key: str) -> dataclasses.Field:
    """The field ``key`` of the run's settings section ``section``."""
    return {f.name: f for f in dataclasses.fields(section)}[key]


#: The wrap-around bound of an audited distributed-noise round: ``privacy.wrap``'s default.
WRAP: float = _declaration(PrivacyConfig, "wrap").default


def run_setting(section: type, key: str, default: Any = _SAME, note: str = "") -> Any:
    """An audit field that is the run's setting ``key`` of ``section``: the declaration's help
    text (then ``note``: what it means in the audit) and default (unless ``default``: the audit's
    differs on purpose). The field's metadata names the section and key: the audit checks the
    value with the declaration's type and with the section's own checks (its
    ``privacy_section`` and ``local_section``)."""
    declared = _declaration(section, key)
    text = declared.metadata["help"] + (f"; {note}" if note else "")
    return setting(declared.default if default is _SAME else default, text, section=section,
                   key=key)


@dataclass(frozen=True)
class AuditSpec:
    """One audit: the mechanism under test, its schedule, the federation, the number of trials.

    ``trials`` runs are made on each of D and D′. ``noise_scale`` multiplies the calibrated noise
    (values < 1 deliberately break the mechanism: the audit must then report ε̂ > ε).
    ``seed`` makes the trials' noise reproducible; ``None`` draws every trial's noise key from OS
    entropy, as a production run does.

    ``diff2-bvr`` is DIFF2 with its private BVR-L-SGD local routine (K = :data:`LOCAL_STEPS`):
    each round's local step on worker 0 (forced: the canary's worker) samples every record with
    probability ``local_batch_size / samples``, clips its gradient difference to
    C3 ||y_1 - y_0|| (``local_clip`` = C3), divides the sum by b and adds σ3-calibrated noise;
    ``local_share`` is the fraction of the GDP budget μ² the server's rounds leave to the local
    steps, and ``local_noise_scale`` multiplies σ3 only.

    ``noise = "distributed"`` audits ``privacy.noise: distributed``: each client adds its share of
    Skellam noise to its encoded clipped mean and the server decodes the modular sum (``bits`` per
    coordinate); ``tolerated`` = t of the P clients (never worker 0, the canary's) drop out of
    every round, so that the sum carries exactly the P - t shares the analysis counts on. There
    ``noise_scale`` multiplies every client's share std (the server and its ledger keep the
    calibrated noise).

    ``sampling`` audits client sampling (``training.sampling``): ``"poisson"`` with
    ``sampling_rate`` q, or ``"fixed"`` with ``sampling_size`` m; each round the server draws its
    cohort from the trial's key and the canary's client (worker 0) is drawn like any other
    (:mod:`.runner`: the canary design and the tests).
    """

    method: Literal["dpgd", "diff2", "diff2-bvr"] = setting(
        "diff2", "mechanism; diff2-bvr: DIFF2 with its private BVR-L-SGD local routine, K = 2")
    epsilon: float = run_setting(PrivacyConfig, "epsilon", note="the claim audited")
    delta: float = run_setting(PrivacyConfig, "delta")
    rounds: int = setting(10, "R, rounds per run")
    restart_every: int = setting(5, "T for diff2 (dpgd is T = 1)")
    u: float = run_setting(PrivacyConfig, "u")
    clients: int = setting(2, "P, workers")
    samples: int = setting(16, "records per worker")
    dim: int = setting(4, "model dimension: one canary axis and dim - 1 benign coordinates")
    learning_rate: float = setting(0.5, "η of the audited GD step")
    clip_restart: float = setting(1.0, "C1, the radius of restart rounds")
    clip_diff: float = setting(
        1.0, "C2, the radius of difference rounds (C2 ||x_(r-1) - x_(r-2)||)")
    noise_scale: float = setting(
        1.0, "multiply the calibrated noise (< 1 breaks the mechanism on purpose); distributed: "
             "every client's share std")
    noise: Literal["central", "distributed"] = run_setting(PrivacyConfig, "noise")
    bits: int = run_setting(PrivacyConfig, "bits")
    tolerated: int = run_setting(
        PrivacyConfig, "tolerated", note="the audit drops t clients (never the canary's) from "
                                         "every round")
    local_batch_size: int = run_setting(LocalConfig, "batch_size", 8,
                                        "diff2-bvr, n_min = --samples")
    local_share: float = run_setting(LocalConfig, "share", 0.98, "diff2-bvr")
    local_clip: float = run_setting(LocalConfig, "clip", note="diff2-bvr")
    local_noise_scale: float = setting(
        1.0, "diff2-bvr: multiply the calibrated local noise σ3 (< 1 breaks it on purpose)")
    sampling: Literal["none", "poisson", "fixed"] = setting(
        "none", "client sampling (dpgd, diff2; central): none = every client every round; poisson: "
                "each client with probability --sampling-rate q; fixed: --sampling-size m of the P "
                "clients; the canary's client is drawn like any other")
    sampling_rate: float | None = setting(None, "q in (0, 1] of --sampling poisson")
    sampling_size: int | None = setting(None, "m in 1..P of --sampling fixed")
    trials: int = setting(10_000, "trials on each of D and D' (with --canaries 1: runs)")
    canaries: int = setting(
        1, "B, canaries per run (dpgd, diff2; central): 1 = one run per trial; an even B > 1: B "
           "canaries on axes of their own in one run, each an independent trial (canaries.py), "
           "so 2 x trials / B runs")
    path: Literal["in-process", "flower"] = setting(
        "in-process", "in-process: the Strategy's and the clients' calls in this process; flower: "
                      "a Flower simulation of the audit's ServerApp (the real Diff2Strategy) and "
                      "ClientApp (the real Diff2Client), with --canaries B > 1")
    alpha: float = setting(
        0.001, "probability of reporting a violation of a correct mechanism (split between the "
               "Clopper-Pearson and the μ-GDP tests)")
    seed: int | None = setting(None, "reproducible noise (default: OS entropy per run)")
    workers: int = setting(1, "processes", cli_default=lambda: default_workers())

    def __post_init__(self) -> None:
        _as_flag(self._check)
        _as_flag(self.local_section)  # before the calibration, which uses b and the share
        self.calibration()  # ε, δ, u: the calibration's own checks, with their messages
        _as_flag(self.privacy_section)  # then the run's own checks of ε, δ, the noise, bits and t
        if self.distributed:
            self.distributed_noise()  # the Skellam calibration's own checks, with their messages

    def _check(self) -> None:
        """The audit's own checks, and the types of the run's settings it shares (the
        declarations')."""
        for f in dataclasses.fields(self):
            if "section" in f.metadata:
                hint = _hints(f.metadata["section"])[f.metadata["key"]]
                value = getattr(self, f.name)
                require(type_ok(value, hint)[0], f.name, describe_type(hint), value)
        require(self.method in _METHODS, "method", f"one of {_METHODS}", self.method)
        for key in ("rounds", "restart_every", "clients", "samples", "dim", "workers"):
            value = getattr(self, key)
            require(isinstance(value, int) and not isinstance(value, bool) and value >= 1, key,
                    "an integer >= 1", value)
        require(self.dim >= 2, "dim",
                "at least 2 (one canary axis and at least one benign coordinate)", self.dim)
        require(isinstance(self.trials, int) and self.trials >= 20, "trials", "an integer >= 20",
                self.trials)
        self._check_noise_scales()
        self._check_local()
        require(0 < self.alpha < 1, "alpha", "in (0, 1)", self.alpha)
        self._check_canaries()
        self._check_distributed()
        self._check_sampling()
        for key in ("clip_restart", "clip_diff", "learning_rate"):
            value = getattr(self, key)
            require(math.isfinite(value) and value > 0, key, "a finite number > 0", value)
        require(self.method == "dpgd" or 2 <= self.restart_every < self.rounds, "restart_every",
                f"between 2 and rounds - 1 = {self.rounds - 1} for {self.method} (restarts and "
                "difference rounds both audited)", self.restart_every)

    def _check_noise_scales(self) -> None:
        require(math.isfinite(self.noise_scale) and self.noise_scale > 0, "noise_scale",
                "a finite number > 0 (1 = the calibrated noise)", self.noise_scale)
        require(math.isfinite(self.local_noise_scale) and self.local_noise_scale > 0,
                "local_noise_scale", "a finite number > 0 (1 = the calibrated local noise σ3)",
                self.local_noise_scale)
        require(self.local_noise_scale == 1.0 or self.local, "local_noise_scale",
                "1 unless --method is diff2-bvr (only diff2-bvr has local steps)",
                self.local_noise_scale)

    def _check_local(self) -> None:
        """What the local section cannot know (n = ``samples``), and the share said as the audit
        says it (the section's own checks follow: :meth:`local_section`)."""
        require(not self.local or self.local_batch_size <= self.samples, "local_batch_size",
                f"at most --samples = {self.samples} (each record is sampled with probability "
                "b / samples)", self.local_batch_size)
        require(math.isfinite(self.local_share) and 0 < self.local_share < 1, "local_share",
                "in (0, 1): the fraction of the budget left to the local steps", self.local_share)

    def _check_canaries(self) -> None:
        b = self.canaries
        require(isinstance(b, int) and not isinstance(b, bool)
                and (b == 1 or (b >= 2 and b % 2 == 0)), "canaries",
                "1 or an even integer >= 2 (half the canaries on D, half on D')", b)
        require(b <= MAX_CANARIES, "canaries", f"at most {MAX_CANARIES} (a run's per-sample rows "
                "are dense, (B + samples) x (B + dim - 1) per client: memory and time grow as B², "
                "trials per run as B; 1,000 is a good size)", b)
        require(b == 1 or (self.method in ("dpgd", "diff2") and not self.distributed), "canaries",
                "1 for --method diff2-bvr and --noise distributed (independent trials from one run "
                "need Gaussian noise independent across coordinates and a fixed μ per round: "
                "central dpgd and diff2)", b)
        require(self.path in _PATHS, "path", f"one of {_PATHS}", self.path)
        require(self.path == "in-process" or b >= 2, "path",
                "in-process unless --canaries B >= 2 (a Flower run takes seconds: one per trial "
                "would take hours)", self.path)

    def _check_distributed(self) -> None:
        """What the privacy section cannot know about t and P (its own checks follow)."""
        require(not (self.distributed and self.local), "noise", "central for --method diff2-bvr "
                "(privacy.noise: distributed has no local routine)", self.noise)
        require(self.tolerated >= 0 and 2 * self.tolerated < self.clients, "tolerated",
                f"an integer t >= 0 with 2t < --clients = {self.clients}", self.tolerated)
        require(self.tolerated == 0 or self.distributed, "tolerated",
                "0 unless --noise is distributed", self.tolerated)
        require(not self.distributed or self.clients >= 2, "clients", "at least 2 for --noise "
                "distributed (secure aggregation of one client is its value)", self.clients)

    def _check_sampling(self) -> None:
        """The cohort rule, said as the audit's flags, and what it cannot be combined with."""
        require(self.sampling in _SAMPLINGS, "sampling", f"one of {_SAMPLINGS}", self.sampling)
        rate, size = self.sampling_rate, self.sampling_size
        require(rate is None or self.sampling == "poisson", "sampling_rate",
                "unset unless --sampling is poisson", rate)
        require(size is None or self.sampling == "fixed", "sampling_size",
                "unset unless --sampling is fixed", size)
        require(self.sampling != "poisson" or (isinstance(rate, (int, float))
                                               and not isinstance(rate, bool)
                                               and math.isfinite(rate) and 0 < rate <= 1),
                "sampling_rate", "a number in (0, 1] with --sampling poisson", rate)
        require(self.sampling != "fixed" or (isinstance(size, int) and not isinstance(size, bool)
                                             and 1 <= size <= self.clients),
                "sampling_size", f"an integer in 1..--clients = {self.clients} with --sampling "
                "fixed", size)
        if not self.sampled:
            return
        require(self.method in ("dpgd", "diff2"), "sampling", "none for --method diff2-bvr (the "
                "local routine is not accounted for a sampled cohort)", self.sampling)
        require(not self.distributed, "sampling", "none with --noise distributed (its shares are "
                "not calibrated for a sampled cohort)", self.sampling)
        require(self.canaries == 1, "canaries", "1 with --sampling (the audit's canary client's "
                "other records are part of the attack: one canary per run)", self.canaries)
        require(self.samples >= 2, "samples", "at least 2 with --sampling (the canary's client "
                "needs records besides the canary: they move its contribution away from where "
                "the round is without it)", self.samples)

    @property
    def sampled(self) -> bool:
        """Whether the audited rounds sample their cohort (``sampling`` not ``"none"``)."""
        return self.sampling != "none"

    def client_sampling(self) -> "Sampling | None":
        """The server's cohort rule (None: every client every round)."""
        if not self.sampled:
            return None
        # the CLI's parser imports this module, which stays numpy-free
        from ...core.sampling import Sampling  # noqa: PLC0415 -- see above

        if self.sampling == "poisson":
            return Sampling("poisson", rate=self.sampling_rate)
        return Sampling("fixed", size=self.sampling_size)

    def privacy_section(self) -> PrivacyConfig:
        """The run's ``privacy`` section with the audit's values (its checks are the audit's)."""
        return PrivacyConfig(epsilon=self.epsilon, delta=self.delta, u=self.u, noise=self.noise,
                             bits=self.bits, tolerated=self.tolerated, wrap=WRAP)

    def local_section(self) -> LocalConfig:
        """The run's ``local`` section of the audited routine, K = :data:`LOCAL_STEPS` (its checks
        are the audit's, for every method)."""
        return LocalConfig(steps=LOCAL_STEPS, batch_size=self.local_batch_size,
                           clip=self.local_clip, share=self.local_share)

    @property
    def period(self) -> int:
        """T: 1 for dpgd, ``restart_every`` otherwise."""
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
        """The run's distributed-noise settings (``privacy.noise: distributed``) for this schedule
        and federation."""
        return _distributed_noise(self.epsilon, self.delta, self.rounds, self.period, self.u,
                                  self.dim, self.bits, self.clients, self.tolerated, self.samples)

    def calibration(self) -> "Calibration":
        """The claimed calibration: the one a run of this schedule would use (the local routine's
        σ3 by PLD)."""
        # the CLI's parser imports this module, which stays numpy-free
        from ...core.privacy import calibrate  # noqa: PLC0415 -- see above

        local = ({"local_steps": LOCAL_STEPS, "local_batch_size": self.local_batch_size,
                  "local_share": self.local_share} if self.local else {})
        sampled = {"sampling": self.client_sampling()} if self.sampled else {}
        return calibrate(epsilon=self.epsilon, delta=self.delta, rounds=self.rounds,
                         restart_every=self.period, u=self.u, n_min=self.samples,
                         clients=self.clients, **local, **sampled)


#: The worker's per-sample gradient engines ``diff2 audit --engines`` attacks
#: (``training.gradients``: the two that take any model; ``closed_form`` is the paper MLP's alone).
WORKER_ENGINES = ("torch_func", "ghost")
#: The batched engine's accumulations it attacks (:mod:`diff2_flwr.lab.backend`, the studies'
#: engine): ``batch``, float64 clipped sums; ``batch_f32sums``, ``accumulate="float32"`` (float32
#: compute dtype only).
BATCH_ENGINES = ("batch", "batch_f32sums")
#: Every engine ``diff2 audit --engines`` attacks (all of them when none is named).
ENGINES = WORKER_ENGINES + BATCH_ENGINES
#: The compute dtypes each engine is attacked in (``training.dtype``).
ENGINE_DTYPES = ("float64", "float32")
#: ``--engines``' seed when ``--seed`` is not given: the engine audit is reproducible by default.
ENGINE_SEED = 0


@dataclass(frozen=True)
class EngineAuditSpec:
    """One engine audit (``diff2 audit --engines``, :mod:`.engines`): the engines and compute dtypes
    attacked, the models (``None``: all of :data:`~.engine_models.MODELS` for the worker's engines
    and of :data:`~.engine_models.BATCH_MODELS` for the batched engine's), the attacked records
    (``None``: :data:`~.engines.DEFAULT_ATTACKS`; any of :data:`~.engines.ATTACKS`), n records per
    shard (the batched engine's: rounded up to a multiple of 64, plus the attacked record), the
    radii C1 and C2 of the rounds, and the seed of the models and their benign records.
    """

    engines: tuple[str, ...] = ENGINES
    dtypes: tuple[str, ...] = ENGINE_DTYPES
    models: tuple[str, ...] | None = None
    attacks: tuple[str, ...] | None = None
    samples: int = 16
    clip_restart: float = 1.0
    clip_diff: float = 1.0
    seed: int = ENGINE_SEED

    def __post_init__(self) -> None:
        _as_flag(self._check)

    def _check(self) -> None:
        for key, allowed in (("engines", ENGINES), ("dtypes", ENGINE_DTYPES)):
            value = getattr(self, key)
            require(isinstance(value, tuple) and bool(value) and set(value) <= set(allowed), key,
                    f"a non-empty tuple of {allowed}", value)
        for key in ("models", "attacks"):
            value = getattr(self, key)
            require(value is None or (isinstance(value, tuple) and bool(value)), key,
                    "None (the default set) or a non-empty tuple of names", value)
        require(isinstance(self.samples, int) and not isinstance(self.samples, bool)
                and self.samples >= 3, "samples",
                "an integer >= 3 (the attacked record and at least two benign ones)", self.samples)
        for key in ("clip_restart", "clip_diff"):
            value = getattr(self, key)
            require(isinstance(value, (int, float)) and math.isfinite(value) and value > 0, key,
                    "a finite number > 0", value)
        require(isinstance(self.seed, int) and not isinstance(self.seed, bool) and self.seed >= 0,
                "seed", "an integer >= 0", self.seed)


def _as_flag(check: Callable[[], object]) -> None:
    """Run ``check``; a bad value (:class:`Invalid`, the same as every section's) said as the
    audit's flag, named as the audit's field (a section's key by the field that shares it)."""
    try:
        check()
    except Invalid as err:
        flag = "--" + _SHARED_KEYS.get(err.key, err.key).replace("_", "-")
        raise ValueError(f"`{flag}` must be {err.expected}. Found {err.found!r}.") from None


@functools.lru_cache(maxsize=None)
def _hints(section: type) -> dict[str, Any]:
    """The section's declared types (its annotations, evaluated once)."""
    return typing.get_type_hints(section)


#: A run section's key -> the audit field that shares it (``batch_size`` -> ``local_batch_size``).
_SHARED_KEYS = {f.metadata["key"]: f.name for f in dataclasses.fields(AuditSpec)
                if "key" in f.metadata}


@functools.lru_cache(maxsize=8)
def _distributed_noise(  # noqa: PLR0913 -- the cache's key: every setting the calibration reads
        epsilon: float, delta: float, rounds: int, restart_every: int, u: float, dim: int,
        bits: int, clients: int, tolerated: int, n_min: int) -> "DistributedNoise":
    """:func:`~diff2_flwr.core.distributed.distributed_noise`, once per setting (its calibration
    takes seconds)."""
    # the CLI's parser imports this module, which stays numpy-free
    from ...core.distributed import distributed_noise  # noqa: PLC0415 -- see above

    return distributed_noise(epsilon=epsilon, delta=delta, rounds=rounds,
                             restart_every=restart_every, u=u, dim=dim, bits=bits,
                             clients=clients, tolerated=tolerated, n_min=n_min, wrap=WRAP)


def default_workers() -> int:
    """``--workers``' default: the machine's cores, at most 4."""
    return max(1, min(4, os.cpu_count() or 1))
