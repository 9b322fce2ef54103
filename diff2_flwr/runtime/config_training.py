"""The run sections of an experiment file: ``privacy``, ``training`` (with ``training.routine``), ``local``,
``evaluation`` and ``output``.

Each field is declared once (:func:`~diff2_flwr.runtime.spec.setting`: default, help and, where the Python API
names it otherwise, its argument; the type by its annotation; the checks in ``__post_init__``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

from ..core.routines import ROUTINES, Routine, RoutineError, make_routine, routine_parameters
from .spec import Invalid, require, setting

__all__ = ["PrivacyConfig", "RoutineConfig", "TrainingConfig", "LocalConfig", "EvaluationConfig", "OutputConfig",
           "CLIENTS_AUTO", "AUTO_CLIENTS_DEFAULT"]


@dataclass(frozen=True)
class PrivacyConfig:
    epsilon: float = setting(3.0, "the target ε of the whole run")
    delta: float = setting(1e-5, "the target δ of the whole run")
    mode: Literal["exact", "rdp"] = setting("exact", "exact (μ-GDP, tight) or rdp (zCDP, the paper's style, more "
                                                     "noise)")
    u: float = setting(1.25, "budget split: restart rounds get 1/u, difference rounds (u-1)/u; > 1 when T > 1")
    n_min: int | None = setting(None, "samples of the smallest shard (null: computed from the dataset); clients "
                                      "holding fewer make the server refuse the round")
    noise: Literal["central", "distributed"] = setting(
        "central", "who adds the noise: central (the server, trusted with each client's clipped mean) or "
                   "distributed (each client adds a share of Skellam noise, the server learns only the sum through "
                   "Flower's SecAgg+)")
    bits: int = setting(20, "distributed: bits per coordinate of the secure sum (modulus 2**bits, at most 31 for "
                            "Flower's SecAgg+)")
    tolerated: int = setting(0, "distributed: t, the clients that may drop out or collude with the server; the "
                                "other P - t carry the whole noise (P > 2t)")
    wrap: float = setting(1e-6, "distributed: bound on the probability that a round's secure sum wraps around "
                                "the modulus (the grid is the finest that keeps it)")

    def __post_init__(self) -> None:
        require(math.isfinite(self.epsilon) and self.epsilon > 0, "epsilon", "a finite number > 0", self.epsilon)
        require(0 < self.delta < 1, "delta", "a number in (0, 1)", self.delta)
        require(self.n_min is None or self.n_min >= 1, "n_min", "null or an integer >= 1", self.n_min)
        require(self.noise in ("central", "distributed"), "noise", "central or distributed", self.noise)
        require(2 <= self.bits <= 31, "bits", "an integer in [2, 31] (Flower's SecAgg+ quantiser casts to int32)",
                self.bits)
        require(self.tolerated >= 0, "tolerated", "an integer >= 0", self.tolerated)
        require(0 < self.wrap < 1, "wrap", "a probability in (0, 1)", self.wrap)

    @property
    def distributed(self) -> bool:
        return self.noise == "distributed"


@dataclass(frozen=True)
class RoutineConfig:
    """The routine that turns the released ṽ_r into x_r (``training.routine``); see core/routines.py.

    YAML: a name (``routine: adam``) or a mapping (``routine: {name: adam, beta1: 0.9}``). A key left
    out (null) takes the routine's default; a key the named routine does not have is refused. The
    learning rate is ``training.learning_rate``. To add a routine: a class in
    :data:`~diff2_flwr.core.routines.ROUTINES`, and a field here for each parameter it adds.
    """

    name: str = setting("gd", "the routine: gd, momentum, nesterov, adam, adamw")
    momentum: float | None = setting(None, "momentum, nesterov: μ (default 0.9)")
    beta1: float | None = setting(None, "adam, adamw: β₁ (default 0.9)")
    beta2: float | None = setting(None, "adam, adamw: β₂ (default 0.999)")
    eps: float | None = setting(None, "adam, adamw: ε in the denominator (default 1e-8)")
    weight_decay: float | None = setting(None, "adam: L2 on the gradient (default 0); adamw: decoupled (default "
                                               "0.01)")

    #: ``routine: adam`` stands for ``routine: {name: adam}``.
    SHORTHAND = "name"

    def __post_init__(self) -> None:
        require(self.name in ROUTINES, "name", f"one of {', '.join(repr(n) for n in ROUTINES)}", self.name)
        allowed = routine_parameters(self.name)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name != "name" and value is not None and f.name not in allowed:
                has = ", ".join(allowed) or "none (its step is training.learning_rate)"
                raise Invalid(f.name, f"nothing for routine {self.name} (its keys: {has})", value)
        try:
            self.build(1.0)
        except RoutineError as err:
            raise Invalid(err.key, err.expected, err.found) from None

    def params(self) -> dict[str, float]:
        """The parameters set in the file (the routine's defaults fill the rest)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name != "name" and getattr(self, f.name) is not None}

    def build(self, learning_rate: float) -> Routine:
        """The routine, with ``learning_rate`` (``training.learning_rate``)."""
        return make_routine(self.name, learning_rate, **self.params())

    def to_yaml(self) -> str | dict[str, Any]:
        """``"gd"`` for a name alone (as files have always said it), else a mapping of the keys set."""
        params = self.params()
        return {"name": self.name, **params} if params else self.name


#: ``training.clients: auto``: P is the number of SuperNodes of the federation that runs the config. A Flower
#: simulation resolves it (``flwr run .`` simulates 2 SuperNodes unless ``--federation-config "num-supernodes=N"``),
#: and so do the launchers that start the SuperNodes themselves (``diff2 run``: :data:`AUTO_CLIENTS_DEFAULT` unless
#: ``--set training.clients=N``; ``diff2 deploy-local``: ``--clients``; the compose deployment: its SuperNodes). A
#: deployment's ServerApp refuses it: its SuperNodes come and go, and the calibration needs P before round 1.
CLIENTS_AUTO = "auto"

#: P for ``training.clients: auto`` where our own launcher starts the SuperNodes (``diff2 run``, ``deploy-local``).
AUTO_CLIENTS_DEFAULT = 10


@dataclass(frozen=True)
class TrainingConfig:
    rounds: int = setting(100, "R, the number of rounds")
    restart_every: int | None = setting(None, "T, a restart every T rounds (required for diff2, at most R; dpgd "
                                              "and gd use 1)")
    clip_restart: float = setting(1.0, "C1, the clipping radius of per-sample gradients")
    clip_diff: float = setting(1.0, "C2: difference rounds clip at C2 ||x_(r-1) - x_(r-2)||")
    learning_rate: float = setting(0.25, "η, the routine's step (GD: x_r = x_(r-1) - η ṽ_r)")
    routine: RoutineConfig = setting(factory=RoutineConfig, help="x_r from ṽ_r: a name (gd, momentum, nesterov, "
                                     "adam, adamw) or a mapping {name: adam, beta1: 0.9, ...}; costs no privacy")
    clients: int | Literal["auto"] = setting(10, "P, the number of clients; auto: the SuperNodes of the "
                                                 "federation that runs it (see CLIENTS_AUTO)")
    seed: int | None = setting(None, "noise seed; null draws the noise key from OS entropy")
    dtype: Literal["float64", "float32"] = setting("float64", "compute dtype of per-sample gradients (norms, clip "
                                                             "factors and sums are float64 on every path)")
    chunk_size: int = setting(1024, "samples per vmap chunk (bounds memory)")
    gradients: Literal["auto", "torch_func", "closed_form"] = setting(
        "auto", "per-sample gradient path: torch_func, closed_form (the paper MLP), auto (closed form when it applies)")
    round_timeout_s: float | None = setting(None, "Flower: a client silent this long fails the round",
                                            identifies=False)
    round_retries: int = setting(0, "Flower: failed rounds retried (releasing nothing) before the run stops",
                                 identifies=False)
    threads: int = setting(1, "torch/BLAS threads of every computing process (the bit-for-bit claims need equal "
                              "counts)")

    def __post_init__(self) -> None:
        require(self.rounds >= 1, "rounds", "an integer >= 1", self.rounds)
        require(self.restart_every is None or self.restart_every >= 1, "restart_every", "an integer >= 1", self.restart_every)
        for key in ("clip_restart", "clip_diff"):
            v = getattr(self, key)
            require(v > 0, key, "a number > 0 (.inf only for method gd)", v)
        lr = self.learning_rate
        require(math.isfinite(lr) and lr > 0, "learning_rate", "a finite number > 0", lr)
        require(self.clients == CLIENTS_AUTO or self.clients >= 1, "clients",
                 "an integer >= 1, or auto (P = the SuperNodes of the federation that runs it)", self.clients)
        require(self.seed is None or self.seed >= 0, "seed", "null or an integer >= 0", self.seed)
        require(self.chunk_size >= 1, "chunk_size", "an integer >= 1", self.chunk_size)
        require(self.round_timeout_s is None or self.round_timeout_s > 0, "round_timeout_s", "null or a number > 0",
                 self.round_timeout_s)
        require(self.round_retries >= 0, "round_retries", "an integer >= 0", self.round_retries)
        require(self.threads >= 1, "threads", "an integer >= 1", self.threads)


@dataclass(frozen=True)
class LocalConfig:
    """DIFF2's private BVR-L-SGD local routine (``steps: 0``: off, x_r = Routine(x_(r-1), ṽ_r) on the server)."""

    steps: int = setting(0, "K: K - 1 private local steps per round on one worker chosen at random; 0 = off",
                         argument="local_steps")
    batch_size: int = setting(64, "b: expected Poisson batch size (the minibatch sum is divided by b); at most "
                                  "n_min", argument="local_batch_size")
    clip: float = setting(1.0, "C3: the radius of a local step is C3 ||y_k - y_(k-1)||", argument="local_clip")
    share: float = setting(0.5, "fraction of the GDP budget μ² the server's rounds leave to the local steps",
                           argument="local_share")

    def __post_init__(self) -> None:
        require(self.steps == 0 or self.steps >= 2, "steps", "0 (off) or an integer K >= 2", self.steps)
        require(self.batch_size >= 1, "batch_size", "an integer >= 1", self.batch_size)
        require(math.isfinite(self.clip) and self.clip > 0, "clip", "a finite number > 0", self.clip)
        require(math.isfinite(self.share) and 0 < self.share < 1, "share", "a number in (0, 1)", self.share)

    @property
    def enabled(self) -> bool:
        return self.steps > 0


@dataclass(frozen=True)
class EvaluationConfig:
    every: int = setting(1, "evaluate x_r every this many rounds (and always at rounds 0 and R)",
                         argument="eval_every")
    train_metrics: bool = setting(True, "train loss and ||∇f||² on the private train split (not covered by ε)")
    test_metrics: bool = setting(True, "test loss (and accuracy for classification)")
    clip_stats: bool = setting(False, "each round's clip_fraction in the released rows (counts of private "
                                      "records: not covered by ε, announced with a warning)")

    def __post_init__(self) -> None:
        require(self.every >= 1, "every", "an integer >= 1", self.every)


@dataclass(frozen=True)
class OutputConfig:
    dir: str = setting("outputs", "each run writes into a new sub-folder of this")
    checkpoint: str | None = setting(None, "file of the server's durable state (a secret: it holds the noise "
                                           "key); an existing one is resumed")

    def __post_init__(self) -> None:
        require(bool(self.dir), "dir", "a non-empty path", self.dir)
        require(self.checkpoint is None or bool(self.checkpoint), "checkpoint", "null or a file path", self.checkpoint)
