"""The run sections of an experiment file: ``privacy``, ``training`` (with ``training.routine`` and
``training.schedule``), ``local``, ``evaluation`` and ``output``.

Each field is declared once (:func:`~diff2_flwr.runtime.spec.setting`: default, help and, where the
Python API names it otherwise, its argument; the type by its annotation; the checks in
``__post_init__``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping

from ..core.routines import ROUTINES, Routine, RoutineError, make_routine, routine_parameters
from ..core.sampling import Sampling
from ..core.schedules import (SCHEDULES, Schedule, ScheduleError, make_schedule,
                              schedule_parameters)
from .config_privacy import LocalConfig, PrivacyConfig
from .spec import Invalid, require, setting

__all__ = ["PrivacyConfig", "RoutineConfig", "SamplingConfig", "ScheduleConfig", "TrainingConfig",
           "LocalConfig",
           "EvaluationConfig", "OutputConfig",
           "CLIENTS_AUTO", "AUTO_CLIENTS_DEFAULT"]


@dataclass(frozen=True)
class RoutineConfig:
    """The routine that turns the released ṽ_r into x_r (``training.routine``); see
    core/routines.py.

    YAML: a name (``routine: adam``) or a mapping (``routine: {name: adam, beta1: 0.9}``). A key
    left out (null) takes the routine's default; a key the named routine does not have is refused.
    The learning rate is ``training.learning_rate``. To add a routine: a class in
    :data:`~diff2_flwr.core.routines.ROUTINES`, and a field here for each parameter it adds.
    """

    name: str = setting("gd", "the routine: gd, momentum, nesterov, adam, adamw")
    momentum: float | None = setting(None, "momentum, nesterov: μ (default 0.9)")
    beta1: float | None = setting(None, "adam, adamw: β₁ (default 0.9)")
    beta2: float | None = setting(None, "adam, adamw: β₂ (default 0.999)")
    eps: float | None = setting(None, "adam, adamw: ε in the denominator (default 1e-8)")
    weight_decay: float | None = setting(None,
                                         "adam: L2 on the gradient (default 0); adamw: decoupled "
                                         "(default 0.01)")

    #: ``routine: adam`` stands for ``routine: {name: adam}``.
    SHORTHAND = "name"

    def __post_init__(self) -> None:
        _check_named(self, "routine", ROUTINES, routine_parameters,
                     "none (its step is training.learning_rate)")
        try:
            self.build(1.0)
        except RoutineError as err:
            raise Invalid(err.key, err.expected, err.found) from None

    def params(self) -> dict[str, float]:
        """The parameters set in the file (the routine's defaults fill the rest)."""
        return _params_set(self)

    def build(self, learning_rate: float) -> Routine:
        """The routine, with ``learning_rate`` (``training.learning_rate``)."""
        return make_routine(self.name, learning_rate, **self.params())

    def to_yaml(self) -> str | dict[str, Any]:
        """``"gd"`` for a name alone (as files have always said it), else a mapping of the keys
        set."""
        return _named_yaml(self)


@dataclass(frozen=True)
class ScheduleConfig:
    """The step-size schedule s(r) of the step η·s(r) of round r (``training.schedule``); see
    core/schedules.py.

    YAML: a name (``schedule: cosine``) or a mapping (``schedule: {name: step, decay: 0.5, every:
    500}``). A key left out (null) takes the schedule's default; a key the named schedule does not
    have is refused, and so is a required one left out (step's ``every``). To add a schedule: a
    class in :data:`~diff2_flwr.core.schedules.SCHEDULES`, and a field here for each parameter it
    adds.
    """

    name: str = setting("constant",
                        "s(r) in the step η·s(r) of round r: constant (s = 1), step (γ^⌊(r-1)/k⌋), "
                        "cosine (f + (1-f)·½(1 + cos(π(r-1)/R))), inverse_sqrt (1/√(1 + (r-1)/k))")
    decay: float | None = setting(None, "step: γ in (0, 1], the factor every k rounds (default "
                                        "0.1)")
    every: int | None = setting(None, "step: k, rounds between decays (required); inverse_sqrt: "
                                      "k in 1/√(1 + (r-1)/k) (default 1: 1/√r)")
    floor: float | None = setting(None, "cosine: f in [0, 1), the factor the step anneals "
                                        "towards (default 0)")

    #: ``schedule: cosine`` stands for ``schedule: {name: cosine}``.
    SHORTHAND = "name"

    def __post_init__(self) -> None:
        _check_named(self, "schedule", SCHEDULES, schedule_parameters, "none (s(r) = 1)")
        try:
            self.build()
        except ScheduleError as err:
            raise Invalid(err.key, err.expected, err.found) from None

    @property
    def constant(self) -> bool:
        """Whether every round steps with η (s(r) = 1)."""
        return self.name == "constant"

    def params(self) -> dict[str, float]:
        """The parameters set in the file (the schedule's defaults fill the rest)."""
        return _params_set(self)

    def build(self) -> Schedule:
        """The schedule s(r)."""
        return make_schedule(self.name, **self.params())

    def to_yaml(self) -> str | dict[str, Any]:
        """``"constant"`` for a name alone, else a mapping of the keys set."""
        return _named_yaml(self)


def _check_named(section: Any, what: str, registry: Mapping[str, Any],
                 parameters: Callable[[str], Mapping[str, Any]], none: str) -> None:
    """A section that names an entry of ``registry`` (``training.routine``, ``training.schedule``):
    the name is one of it, and no key is set that the named entry does not have."""
    require(section.name in registry, "name", f"one of {', '.join(repr(n) for n in registry)}",
            section.name)
    allowed = parameters(section.name)
    for key, value in _params_set(section).items():
        if key not in allowed:
            has = ", ".join(allowed) or none
            raise Invalid(key, f"nothing for {what} {section.name} (its keys: {has})", value)


def _params_set(section: Any) -> dict[str, Any]:
    """A named section's keys set in the file, its name aside."""
    return {f.name: getattr(section, f.name) for f in dataclasses.fields(section)
            if f.name != "name" and getattr(section, f.name) is not None}


def _named_yaml(section: Any) -> str | dict[str, Any]:
    """A named section as YAML: its name alone when no key is set, else a mapping."""
    params = _params_set(section)
    return {"name": section.name, **params} if params else section.name


#: ``training.clients: auto``: P is the number of SuperNodes of the federation that runs the config.
#: A Flower simulation resolves it (``flwr run .`` simulates 2 SuperNodes unless
#: ``--federation-config "num-supernodes=N"``), and so do the launchers that start the SuperNodes
#: themselves (``diff2 run``: :data:`AUTO_CLIENTS_DEFAULT` unless ``--set training.clients=N``;
#: ``diff2 deploy-local``: ``--clients``; the compose deployment: its SuperNodes). A deployment's
#: ServerApp refuses it: its SuperNodes come and go, and the calibration needs P before round 1.
CLIENTS_AUTO = "auto"

#: P for ``training.clients: auto`` where our own launcher starts the SuperNodes (``diff2 run``,
#: ``deploy-local``).
AUTO_CLIENTS_DEFAULT = 10


@dataclass(frozen=True)
class SamplingConfig:
    """Client sampling (``training.sampling``; issue 44): which clients each round reaches.

    ``kind: none`` (the default): every round takes all P clients, as the paper's DIFF2.
    ``poisson``: each client independently with probability ``rate``; ``fixed``: ``size`` clients
    uniformly without replacement. A round's sum over its cohort is divided by the expected cohort
    (qP or m) and the noise is calibrated for the sampled rounds
    (:mod:`diff2_flwr.core.sampling`, :class:`~diff2_flwr.core.accounting.SampledGaussianEvent`).
    """

    kind: Literal["none", "poisson", "fixed"] = setting(
        "none", "none (every round takes all P clients), poisson (each client with probability "
                "rate) or fixed (size clients without replacement)", argument="sampling")
    rate: float | None = setting(None, "poisson: q in (0, 1], each client's chance to be in a "
                                       "round", argument="sampling_rate")
    size: int | None = setting(None, "fixed: m, the clients of every round (at most P)",
                               argument="sampling_size")

    def __post_init__(self) -> None:
        if self.kind == "poisson":
            require(self.rate is not None and math.isfinite(self.rate) and 0 < self.rate <= 1,
                    "rate", "a number in (0, 1] with kind poisson", self.rate)
            require(self.size is None, "size", "null with kind poisson (it takes rate)", self.size)
        elif self.kind == "fixed":
            require(self.size is not None and self.size >= 1, "size",
                    "an integer >= 1 with kind fixed", self.size)
            require(self.rate is None, "rate", "null with kind fixed (it takes size)", self.rate)
        else:
            require(self.rate is None and self.size is None, "kind",
                    "poisson (with rate) or fixed (with size) when rate or size is set",
                    self.kind)

    @property
    def enabled(self) -> bool:
        """Whether rounds sample their clients."""
        return self.kind != "none"

    def build(self) -> Sampling | None:
        """The core's :class:`~diff2_flwr.core.sampling.Sampling` (None: no sampling)."""
        if self.kind == "none":
            return None
        return Sampling(self.kind, rate=self.rate, size=self.size)


@dataclass(frozen=True)
class TrainingConfig:
    """How the run trains (``training``): R, T, the clipping radii, the step and its routine, P, the
    noise seed, and how the gradients are computed (dtype, chunk, path, threads)."""

    rounds: int = setting(100, "R, the number of rounds")
    restart_every: int | None = setting(None,
                                        "T, a restart every T rounds (required for diff2, at most "
                                        "R; dpgd and gd use 1)")
    clip_restart: float = setting(1.0, "C1, the clipping radius of per-sample gradients")
    clip_diff: float = setting(1.0, "C2: difference rounds clip at C2 ||x_(r-1) - x_(r-2)||")
    learning_rate: float = setting(0.25, "η, the routine's step (GD: x_r = x_(r-1) - η ṽ_r)")
    routine: RoutineConfig = setting(factory=RoutineConfig,
                                     help="x_r from ṽ_r: a name (gd, momentum, nesterov, adam, "
                                          "adamw) or a mapping {name: adam, beta1: 0.9, ...}; "
                                          "costs no privacy")
    schedule: ScheduleConfig = setting(factory=ScheduleConfig,
                                       help="round r steps with η·s(r): a name (constant, step, "
                                            "cosine, inverse_sqrt) or a mapping {name: step, "
                                            "decay: 0.5, every: 500}; costs no privacy "
                                            "(post-processing of ṽ_r)",
                                       before="constant")
    sampling: SamplingConfig = setting(factory=SamplingConfig,
                                       help="client sampling: {kind: poisson, rate: q} or {kind: "
                                            "fixed, size: m}; none by default (every client every "
                                            "round)",
                                       before={"kind": "none", "rate": None, "size": None})
    clients: int | Literal["auto"] = setting(10,
                                             "P, the number of clients; auto: the SuperNodes of "
                                             "the federation that runs it (see CLIENTS_AUTO)")
    seed: int | None = setting(None, "noise seed; null draws the noise key from OS entropy")
    dtype: Literal["auto", "float64", "float32"] = setting(
        "auto",
        "compute dtype of per-sample gradients (norms, clip factors and sums are float64 on every "
        "path); auto: float64 for the paper MLP, float32 for any other model")
    chunk_size: int | Literal["auto"] = setting(
        "auto",
        "samples per pass of per-sample work; auto: the most (up to 1024, a power of two) whose "
        "measured pass fits memory_budget_mb, per round kind; a number is checked against it")
    device: str = setting(
        "cpu",
        "where a client computes its per-sample work: cpu, cuda, cuda:N, or auto (the first GPU "
        "torch sees on the client's machine, else the CPU); records stay in host memory, each "
        "pass's samples are copied over; norms, clip factors and sums stay float64 there")
    memory_budget_mb: float | Literal["auto"] = setting(
        "auto",
        "MiB a client's per-sample work may take on top of its model and records; auto: half of "
        "the machine's memory (its cgroup limit in a container) over the workers computing on it "
        "at once, at most 80% of what is available; a model whose one sample does not fit is "
        "refused before round 1")
    gradients: Literal["auto", "torch_func", "closed_form", "ghost"] = setting(
        "auto",
        "per-sample gradient path: torch_func, closed_form (the paper MLP), ghost (norms and "
        "clipped sums per layer without per-sample gradients: Linear, Conv1d/2d, Embedding, "
        "LayerNorm, GroupNorm; torch_func for other parameters), auto (the paper MLP: closed "
        "form when it applies, else torch_func; any other model: ghost, or torch_func where "
        "ghost's first-call check refuses it)")
    round_timeout_s: float | None = setting(None,
                                            "Flower: a client silent this long fails the round",
                                            identifies=False)
    round_retries: int = setting(0,
                                 "Flower: failed rounds retried (releasing nothing) before the "
                                 "run stops", identifies=False)
    threads: int = setting(1,
                           "torch/BLAS threads of every computing process (the bit-for-bit claims "
                           "need equal counts)")

    def __post_init__(self) -> None:
        require(self.rounds >= 1, "rounds", "an integer >= 1", self.rounds)
        require(self.restart_every is None or self.restart_every >= 1, "restart_every",
                "an integer >= 1", self.restart_every)
        for key in ("clip_restart", "clip_diff"):
            v = getattr(self, key)
            # core.clipping.RADIUS_FLOOR (this module imports no torch): smaller radii round by
            # more than their size
            require(v >= 2.0**-900, key, "a number >= 1.2e-271 (.inf only for method gd)", v)
        lr = self.learning_rate
        require(math.isfinite(lr) and lr > 0, "learning_rate", "a finite number > 0", lr)
        require(self.clients == CLIENTS_AUTO or self.clients >= 1, "clients",
                "an integer >= 1, or auto (P = the SuperNodes of the federation that runs it)",
                self.clients)
        require(self.seed is None or self.seed >= 0, "seed", "null or an integer >= 0", self.seed)
        require(self.chunk_size == "auto" or self.chunk_size >= 1, "chunk_size",
                "an integer >= 1, or auto", self.chunk_size)
        require(self.device in ("cpu", "cuda", "auto") or (self.device.startswith("cuda:")
                                                         and self.device[5:].isdigit()),
                "device", "cpu, cuda, cuda:N or auto", self.device)
        require(self.memory_budget_mb == "auto" or (math.isfinite(self.memory_budget_mb)
                                                    and self.memory_budget_mb > 0),
                "memory_budget_mb", "a number of MiB > 0, or auto", self.memory_budget_mb)
        require(self.round_timeout_s is None or self.round_timeout_s > 0, "round_timeout_s",
                "null or a number > 0", self.round_timeout_s)
        require(self.round_retries >= 0, "round_retries", "an integer >= 0", self.round_retries)
        require(self.threads >= 1, "threads", "an integer >= 1", self.threads)


@dataclass(frozen=True)
class EvaluationConfig:
    """What the run measures on each evaluated iterate (``evaluation``), and how often."""

    every: int = setting(1, "evaluate x_r every this many rounds (and always at rounds 0 and R)",
                         argument="eval_every")
    train_metrics: bool = setting(True,
                                  "train loss and ||∇f||² on the private train split (not covered "
                                  "by ε)")
    test_metrics: bool = setting(True, "test loss (and accuracy for classification)")
    clip_stats: bool = setting(False,
                               "each round's clip_fraction in the released rows (counts of private "
                               "records: not covered by ε, announced with a warning)")

    def __post_init__(self) -> None:
        require(self.every >= 1, "every", "an integer >= 1", self.every)


@dataclass(frozen=True)
class OutputConfig:
    """Where the run writes (``output``): its folder and the server's checkpoint."""

    dir: str = setting("outputs", "each run writes into a new sub-folder of this")
    checkpoint: str | None = setting(None,
                                     "file of the server's durable state (a secret: it holds the "
                                     "noise key); an existing one is resumed")

    def __post_init__(self) -> None:
        require(bool(self.dir), "dir", "a non-empty path", self.dir)
        require(self.checkpoint is None or bool(self.checkpoint), "checkpoint",
                "null or a file path", self.checkpoint)
