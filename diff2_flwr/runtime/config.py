"""Experiment configuration: one YAML file -> frozen, validated dataclasses.

Every error names the file, the key, what was expected and what was found. Unknown keys are
errors (a typo must not silently fall back to a default).

Example (``configs/default.yaml``)::

    name: default
    method: diff2             # gd | dpgd | diff2
    dataset: {name: synthetic}
    privacy: {epsilon: 3.0, delta: 1.0e-5, mode: exact, u: 1.25}
    training: {rounds: 100, restart_every: 10, clip_restart: 1.0, clip_diff: 1.0,
               learning_rate: 0.25, clients: 10, seed: null}
    output: {dir: outputs/default}
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

import yaml

from ..core.estimator import Mechanism
from ..core.local import LocalMechanism
from ..core.privacy import Calibration, calibrate
from ..core.routines import ROUTINES, Routine, RoutineError, make_routine, routine_parameters
from ..task.losses import LOSSES

__all__ = [
    "ConfigError",
    "CLIENTS_AUTO",
    "AUTO_CLIENTS_DEFAULT",
    "Kwargs",
    "DatasetConfig",
    "PartitionerConfig",
    "ModelConfig",
    "PrivacyConfig",
    "RoutineConfig",
    "TrainingConfig",
    "EvaluationConfig",
    "LocalConfig",
    "OutputConfig",
    "ExperimentConfig",
    "load_config",
    "parse_config",
    "read_yaml",
    "config_keys",
    "parse_assignment",
    "set_assignments",
    "apply_overrides",
    "run_config_overrides",
    "load_run_config",
    "yaml_text",
    "from_arguments",
    "parse_section",
    "require",
]

Method = Literal["gd", "dpgd", "diff2"]


class ConfigError(ValueError):
    """An invalid experiment file; the message names file, key, expectation and finding.

    For one key's bad value, ``key``, ``expected`` and ``found`` hold the parts of the message.
    """

    def __init__(self, message: str, *, key: str | None = None, expected: str | None = None,
                 found: Any = None) -> None:
        super().__init__(message)
        self.key, self.expected, self.found = key, expected, found


def _key_error(source: str, key: str, expected: str, found: Any) -> ConfigError:
    return ConfigError(f"{source}: key `{key}`: expected {expected}. Found {found!r}.", key=key, expected=expected,
                       found=found)


class _Invalid(ValueError):
    def __init__(self, key: str, expected: str, found: Any) -> None:
        super().__init__(f"key `{key}`: expected {expected}. Found {found!r}.")
        self.key, self.expected, self.found = key, expected, found


def _require(ok: bool, key: str, expected: str, found: Any) -> None:
    if not ok:
        raise _Invalid(key, expected, found)


#: Public name of the field check (``require(ok, key, expected, found)``) for sections declared outside this module.
require = _require


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class PartitionerConfig:
    """How the train split is cut into the P shards (``dataset.partitioner``); see task/partitions.py."""

    name: Literal["iid", "dirichlet", "pathological", "size", "linear", "square", "exponential"] = "iid"
    seed: int | None = None  # null: dataset.split_seed
    alpha: float | None = None  # dirichlet: concentration (small = skewed)
    min_partition_size: int = 10  # dirichlet: Flower resamples (<= 10 times) until every shard has this many
    self_balancing: bool = False  # dirichlet: Flower's balancing
    classes_per_client: int | None = None  # pathological: k
    class_assignment: Literal["first-deterministic", "deterministic", "random"] = "first-deterministic"
    bins: int | None = None  # dirichlet/pathological on a regression target: quantile bins (null: training.clients)
    sizes: tuple[int, ...] = ()  # size: the P shard sizes
    min_samples: int = 1  # refuse a partition with a shard below this many samples
    max_sigma: float | None = 1.0  # refuse a calibration whose σ1 or σ2 exceeds this (null: no limit)

    def __post_init__(self) -> None:
        name = self.name
        _require(self.seed is None or self.seed >= 0, "seed", "null or an integer >= 0", self.seed)
        only = {"alpha": ("dirichlet",), "classes_per_client": ("pathological",), "sizes": ("size",),
                "bins": ("dirichlet", "pathological")}
        for key, names in only.items():
            value = getattr(self, key)
            if name not in names:
                _require(value is None or value == (), f"{key}",
                         f"nothing for partitioner {name} ({' or '.join(names)} only)", value)
        if name == "dirichlet":
            a = self.alpha
            _require(a is not None and math.isfinite(a) and a > 0, "alpha",
                     "a finite number > 0 for partitioner dirichlet (small = skewed, e.g. 0.1; large -> IID)", a)
        if name == "pathological":
            _require(self.classes_per_client is not None and self.classes_per_client >= 1,
                     "classes_per_client", "an integer >= 1 for partitioner pathological",
                     self.classes_per_client)
        if name == "size":
            _require(bool(self.sizes) and min(self.sizes) >= 1, "sizes",
                     "a list of training.clients shard sizes, each >= 1, summing to the train split", list(self.sizes))
        _require(self.bins is None or self.bins >= 2, "bins", "null or an integer >= 2", self.bins)
        _require(self.min_partition_size >= 0, "min_partition_size", "an integer >= 0",
                 self.min_partition_size)
        _require(self.min_samples >= 1, "min_samples", "an integer >= 1", self.min_samples)
        m = self.max_sigma
        _require(m is None or (math.isfinite(m) and m > 0), "max_sigma", "null or a finite number > 0", m)

    def num_bins(self, clients: int) -> int:
        """Quantile bins of a regression target: ``bins``, or one per client (at least 2), so that
        pathological's first-deterministic assignment gives every bin a client."""
        return self.bins or max(clients, 2)

    def arguments(self, split_seed: int, task: str, clients: int) -> dict[str, Any]:
        """Keyword arguments of :func:`diff2_flwr.task.partitions.partition` (seed and bins resolved)."""
        args: dict[str, Any] = {"name": self.name}
        if self.name in ("dirichlet", "pathological"):  # the others draw nothing at random beyond the split
            args["seed"] = split_seed if self.seed is None else self.seed
        if self.name == "dirichlet":
            args.update(alpha=self.alpha, min_partition_size=self.min_partition_size,
                        self_balancing=self.self_balancing)
        if self.name == "pathological":
            args.update(classes_per_client=self.classes_per_client, class_assignment=self.class_assignment)
        if self.name in ("dirichlet", "pathological") and task == "regression":
            args["bins"] = self.num_bins(clients)
        if self.name == "size":
            args["sizes"] = self.sizes
        return args

    def describe(self, split_seed: int, task: str, clients: int) -> str:
        """One line: the partitioner and its parameters, e.g. ``dirichlet(seed=0, alpha=0.1, ..., by=class)``."""
        args = self.arguments(split_seed, task, clients)
        name = args.pop("name")
        if name == "iid":
            return "iid (the paper's: shuffled, sizes differ by at most one)"
        if name in ("dirichlet", "pathological"):
            args["by"] = "class" if task == "classification" else f"target in {args.pop('bins')} quantile bins"
        if "sizes" in args:
            args["sizes"] = list(args["sizes"])
        if name in ("linear", "square", "exponential"):
            return f"{name} (shard p = 1..P gets a share ∝ {dict(linear='p', square='p²', exponential='e^p')[name]})"
        return f"{name}(" + ", ".join(f"{k}={v}" for k, v in args.items()) + ")"


@dataclass(frozen=True)
class DatasetConfig:
    name: Literal["synthetic", "california_housing", "gas_turbine", "blogfeedback", "kddcup99", "covertype", "digits",
                  "csv"] = "synthetic"
    dir: str | None = None  # data directory for real datasets; default $DIFF2_DATA_DIR
    test_fraction: float = 0.2
    split_seed: int = 0
    train_samples: int | None = None  # keep a uniform random subset of this many train records (null: all)
    subsample_seed: int = 0  # seed of that subset (subsets of one seed are nested)
    num_samples: int = 10_000  # synthetic only
    num_features: int = 8  # synthetic only
    generator_seed: int = 0  # synthetic only
    path: str | None = None  # csv only: the file
    target: str | None = None  # csv only: the target column
    drop: tuple[str, ...] = ()  # csv only: columns to ignore
    categorical: tuple[str, ...] = ()  # csv only: columns to one-hot encode
    task: Literal["regression", "classification"] | None = None  # csv only (required unless model.loss says it)
    shards: str | None = None  # deployment: folder of `diff2 shard` files (the server reads server.npz there)
    partitioner: PartitionerConfig = field(default_factory=PartitionerConfig)  # how the train split is sharded

    @property
    def task_kind(self) -> str:
        if self.name == "csv":
            return self.task or "regression"
        return "classification" if self.name in ("kddcup99", "covertype", "digits") else "regression"

    def __post_init__(self) -> None:
        if self.name == "csv":
            _require(bool(self.path), "path", "the CSV file's path for dataset csv", self.path)
            _require(bool(self.target), "target", "the target column's name for dataset csv", self.target)
        else:
            for key in ("path", "target", "task"):
                _require(getattr(self, key) is None, key, f"nothing for dataset {self.name} (csv only)", getattr(self, key))
            for key in ("drop", "categorical"):
                _require(not getattr(self, key), key, f"nothing for dataset {self.name} (csv only)", getattr(self, key))
        _require(0 < self.test_fraction < 1, "test_fraction", "a number in (0, 1)", self.test_fraction)
        _require(self.split_seed >= 0, "split_seed", "an integer >= 0", self.split_seed)
        _require(self.train_samples is None or self.train_samples >= 1, "train_samples",
                 "null (every record of the train split) or an integer >= 1 (records to keep)", self.train_samples)
        _require(self.subsample_seed >= 0, "subsample_seed", "an integer >= 0", self.subsample_seed)
        _require(self.num_samples >= 2, "num_samples", "an integer >= 2", self.num_samples)
        _require(self.num_features >= 1, "num_features", "an integer >= 1", self.num_features)
        _require(self.generator_seed >= 0, "generator_seed", "an integer >= 0", self.generator_seed)
        part = self.partitioner
        if part.name in ("dirichlet", "pathological") and self.task_kind == "classification":
            _require(part.bins is None, "dataset.partitioner.bins",
                     f"nothing for the classification dataset {self.name} (bins cut a regression target)", part.bins)
        known = {"kddcup99": 2, "covertype": 7, "digits": 10}.get(self.name)
        if part.name == "pathological" and known is not None:
            _require(part.classes_per_client <= known, "dataset.partitioner.classes_per_client",
                     f"at most the {known} classes of dataset {self.name}", part.classes_per_client)


class Kwargs(tuple):
    """Keyword arguments from YAML as a hashable value: ``(name, value)`` pairs, sorted by name; nested
    mappings become :class:`Kwargs` and lists tuples (a config is frozen and hashable)."""

    def __new__(cls, pairs: Any = ()) -> "Kwargs":
        items = pairs.items() if isinstance(pairs, Mapping) else pairs
        return super().__new__(cls, sorted((str(k), _frozen(v)) for k, v in items))

    def as_dict(self) -> dict[str, Any]:
        """Plain Python values (mappings as dicts, sequences as lists), as YAML gave them."""
        return {k: _thawed(v) for k, v in self}


def _frozen(value: Any) -> Any:
    if isinstance(value, Kwargs):
        return value
    if isinstance(value, Mapping):
        return Kwargs(value)
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    return value


def _thawed(value: Any) -> Any:
    if isinstance(value, Kwargs):
        return value.as_dict()
    if isinstance(value, tuple):
        return [_thawed(v) for v in value]
    return value


#: The paper's model (the default); any other ``model.name`` is a factory "package.module:callable".
PAPER_MLP = "paper_mlp"
_FACTORY = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")


@dataclass(frozen=True)
class ModelConfig:
    name: str = PAPER_MLP  # paper_mlp, or a factory "package.module:callable" that returns a torch.nn.Module
    hidden: int | None = None  # paper_mlp only: hidden units (null: the paper's 10)
    kwargs: Kwargs = field(default_factory=Kwargs)  # factory only: its keyword arguments
    init_seed: int = 0  # seeds x_0 (the paper MLP's generator; torch's generator around a factory's call)
    loss: str = "auto"  # auto: half_squared_error for regression, cross_entropy for classification

    @property
    def is_paper_mlp(self) -> bool:
        return self.name == PAPER_MLP

    @property
    def hidden_units(self) -> int:
        """The paper MLP's hidden width (10 unless configured)."""
        return 10 if self.hidden is None else self.hidden

    def __post_init__(self) -> None:
        _require(self.is_paper_mlp or bool(_FACTORY.match(self.name)), "name",
                 "'paper_mlp' or a model factory as an import path 'package.module:callable'", self.name)
        if self.is_paper_mlp:
            _require(self.hidden is None or self.hidden >= 1, "hidden", "null or an integer >= 1", self.hidden)
            _require(not self.kwargs, "kwargs", "nothing for model paper_mlp (its width is model.hidden)",
                     self.kwargs.as_dict())
        else:
            _require(self.hidden is None, "hidden", f"nothing for a model factory ({self.name}): pass its sizes "
                     "in model.kwargs", self.hidden)
            reserved = sorted({"in_features", "out_features"} & {k for k, _ in self.kwargs})
            _require(not reserved, "kwargs", "no in_features or out_features (the data sets them: the factory is "
                     "called as factory(in_features=..., out_features=..., **model.kwargs))", self.kwargs.as_dict())
        _require(self.init_seed >= 0, "init_seed", "an integer >= 0", self.init_seed)
        _require(self.loss in LOSSES or self.loss == "auto", "loss", f"'auto' or one of {sorted(LOSSES)}", self.loss)


@dataclass(frozen=True)
class PrivacyConfig:
    epsilon: float = 3.0
    delta: float = 1e-5
    mode: Literal["exact", "rdp"] = "exact"
    u: float = 1.25
    n_min: int | None = None  # samples of the smallest shard; None: computed from the dataset

    def __post_init__(self) -> None:
        _require(math.isfinite(self.epsilon) and self.epsilon > 0, "epsilon", "a finite number > 0", self.epsilon)
        _require(0 < self.delta < 1, "delta", "a number in (0, 1)", self.delta)
        _require(self.n_min is None or self.n_min >= 1, "n_min", "null or an integer >= 1", self.n_min)


@dataclass(frozen=True)
class RoutineConfig:
    """The routine that turns the released ṽ_r into x_r (``training.routine``); see core/routines.py.

    YAML: a name (``routine: adam``) or a mapping (``routine: {name: adam, beta1: 0.9}``). A key left
    out (null) takes the routine's default; a key the named routine does not have is refused. The
    learning rate is ``training.learning_rate``. To add a routine: a class in
    :data:`~diff2_flwr.core.routines.ROUTINES`, and a field here for each parameter it adds.
    """

    name: str = "gd"
    momentum: float | None = None  # momentum, nesterov: μ (default 0.9)
    beta1: float | None = None  # adam, adamw: β₁ (default 0.9)
    beta2: float | None = None  # adam, adamw: β₂ (default 0.999)
    eps: float | None = None  # adam, adamw: ε in the denominator (default 1e-8)
    weight_decay: float | None = None  # adam: L2 on the gradient (default 0); adamw: decoupled (default 0.01)

    #: ``routine: adam`` stands for ``routine: {name: adam}``.
    SHORTHAND = "name"

    def __post_init__(self) -> None:
        _require(self.name in ROUTINES, "name", f"one of {', '.join(repr(n) for n in ROUTINES)}", self.name)
        allowed = routine_parameters(self.name)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name != "name" and value is not None and f.name not in allowed:
                has = ", ".join(allowed) or "none (its step is training.learning_rate)"
                raise _Invalid(f.name, f"nothing for routine {self.name} (its keys: {has})", value)
        try:
            self.build(1.0)
        except RoutineError as err:
            raise _Invalid(err.key, err.expected, err.found) from None

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
    rounds: int = 100
    restart_every: int | None = None  # T; required for diff2, 1 for dpgd
    clip_restart: float = 1.0  # C1
    clip_diff: float = 1.0  # C2
    learning_rate: float = 0.25
    routine: RoutineConfig = field(default_factory=RoutineConfig)  # x_r from ṽ_r: gd, momentum, nesterov, adam, adamw
    clients: int | Literal["auto"] = 10  # P; auto: the SuperNodes of the federation that runs it (see CLIENTS_AUTO)
    seed: int | None = None  # noise seed; null draws the noise key from OS entropy
    dtype: Literal["float64", "float32"] = "float64"
    chunk_size: int = 1024  # samples per vmap chunk (bounds memory)
    gradients: Literal["auto", "torch_func", "closed_form"] = "auto"  # per-sample gradient path
    round_timeout_s: float | None = None  # Flower: a client silent this long fails the round
    round_retries: int = 0  # Flower: failed rounds retried (releasing nothing) before the run stops
    threads: int = 1  # torch/BLAS threads of every computing process (the bit-for-bit claims need equal counts)

    def __post_init__(self) -> None:
        _require(self.rounds >= 1, "rounds", "an integer >= 1", self.rounds)
        _require(self.restart_every is None or self.restart_every >= 1, "restart_every", "an integer >= 1", self.restart_every)
        for key in ("clip_restart", "clip_diff"):
            v = getattr(self, key)
            _require(v > 0, key, "a number > 0 (.inf only for method gd)", v)
        lr = self.learning_rate
        _require(math.isfinite(lr) and lr > 0, "learning_rate", "a finite number > 0", lr)
        _require(self.clients == CLIENTS_AUTO or self.clients >= 1, "clients",
                 "an integer >= 1, or auto (P = the SuperNodes of the federation that runs it)", self.clients)
        _require(self.seed is None or self.seed >= 0, "seed", "null or an integer >= 0", self.seed)
        _require(self.chunk_size >= 1, "chunk_size", "an integer >= 1", self.chunk_size)
        _require(self.round_timeout_s is None or self.round_timeout_s > 0, "round_timeout_s", "null or a number > 0",
                 self.round_timeout_s)
        _require(self.round_retries >= 0, "round_retries", "an integer >= 0", self.round_retries)
        _require(self.threads >= 1, "threads", "an integer >= 1", self.threads)


@dataclass(frozen=True)
class LocalConfig:
    """DIFF2's private BVR-L-SGD local routine (``steps: 0``: off, x_r = Routine(x_(r-1), ṽ_r) on the server)."""

    steps: int = 0  # K: K - 1 private local steps per round on one worker chosen at random; 0 = off
    batch_size: int = 64  # b: expected Poisson batch size (the minibatch sum is divided by b)
    clip: float = 1.0  # C3: the radius of a local step is C3 ||y_k - y_(k-1)||
    share: float = 0.5  # fraction of the GDP budget μ² the server's rounds leave to the local steps

    def __post_init__(self) -> None:
        _require(self.steps == 0 or self.steps >= 2, "steps", "0 (off) or an integer K >= 2", self.steps)
        _require(self.batch_size >= 1, "batch_size", "an integer >= 1", self.batch_size)
        _require(math.isfinite(self.clip) and self.clip > 0, "clip", "a finite number > 0", self.clip)
        _require(math.isfinite(self.share) and 0 < self.share < 1, "share", "a number in (0, 1)", self.share)

    @property
    def enabled(self) -> bool:
        return self.steps > 0


@dataclass(frozen=True)
class EvaluationConfig:
    every: int = 1  # evaluate x_r every this many rounds (and always at rounds 0 and R)
    train_metrics: bool = True  # train loss and ||∇f||² on the private train split (not covered by ε)
    test_metrics: bool = True
    clip_stats: bool = False  # each round's clip_fraction in the released rows (counts of private records, not covered by ε)

    def __post_init__(self) -> None:
        _require(self.every >= 1, "every", "an integer >= 1", self.every)


@dataclass(frozen=True)
class OutputConfig:
    dir: str = "outputs"  # each run writes into a new sub-folder of this
    checkpoint: str | None = None  # file of the server's durable state; an existing one is resumed

    def __post_init__(self) -> None:
        _require(bool(self.dir), "dir", "a non-empty path", self.dir)
        _require(self.checkpoint is None or bool(self.checkpoint), "checkpoint", "null or a file path", self.checkpoint)


@dataclass(frozen=True)
class ExperimentConfig:
    """One experiment: dataset, model, method, privacy budget and training schedule."""

    name: str = "experiment"
    method: Method = "diff2"
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    local: LocalConfig = field(default_factory=LocalConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    source: str = field(default="<memory>", compare=False)

    def __post_init__(self) -> None:
        d = self.dataset
        if d.name == "csv" and d.task is None:  # said by the loss, or required: a column of 0s and 1s may be either
            _require(self.model.loss != "auto", "dataset.task", "regression or classification for dataset csv (or "
                     "model.loss: cross_entropy, which means classification; half_squared_error, regression)", None)
            if self.model.loss == "cross_entropy":
                object.__setattr__(self, "dataset", dataclasses.replace(d, task="classification"))
        t = self.training
        if self.method == "diff2":
            _require(t.restart_every is not None, "training.restart_every", "an integer T >= 1 for method diff2", None)
        elif t.restart_every not in (None, 1):
            raise _Invalid(
                "training.restart_every", f"1 or null for method {self.method} (T = 1; use method diff2 for T > 1)",
                t.restart_every,
            )
        _require(self.restart_every <= t.rounds, "training.restart_every",
                 f"at most training.rounds = {t.rounds} (T > R never restarts)", t.restart_every)
        if t.clients != CLIENTS_AUTO:  # else checked when a federation resolves P (with_clients)
            self._check_clients(t.clients)
        if self.dataset.shards:
            _require(not self.evaluation.train_metrics, "evaluation.train_metrics",
                     "false with dataset.shards (in a deployment the server holds no training data)",
                     self.evaluation.train_metrics)
        if self.loss == "half_squared_error":
            _require(self.dataset.task_kind == "regression", "model.loss",
                     f"cross_entropy (or auto) for the classification dataset {self.dataset.name}", self.model.loss)
        if self.loss == "cross_entropy":  # one output per class: a regression target is no class index
            _require(self.dataset.task_kind == "classification", "model.loss",
                     f"half_squared_error (or auto) for the regression dataset {self.dataset.name}"
                     f"{' (or dataset.task: classification)' if self.dataset.name == 'csv' else ''}", self.model.loss)
        if t.gradients == "closed_form":
            _require(self.model.is_paper_mlp and self.loss == "half_squared_error", "training.gradients",
                     "'auto' or 'torch_func' unless model.name is paper_mlp with loss half_squared_error "
                     "(the closed form is for that model)", t.gradients)
        if self.local.enabled:
            _require(self.method == "diff2", "local.steps", "0 unless method is diff2 (the local routine is DIFF2's)",
                     self.local.steps)
            _require(self.privacy.mode == "exact", "privacy.mode",
                     "exact with local.steps > 0 (the local routine is calibrated with dp-accounting's PLD)",
                     self.privacy.mode)
            _require(t.routine.name == "gd", "training.routine",
                     "gd with local.steps > 0 (the local routine computes x_r itself: its y_1 = x_(r-1) - η ṽ_r is "
                     "the GD step)", t.routine.name)
            _require(self.output.checkpoint is None, "output.checkpoint",
                     "null with local.steps > 0 (checkpoints of the local routine are not supported yet)",
                     self.output.checkpoint)
        if self.private:
            for key in ("clip_restart", "clip_diff"):
                v = getattr(t, key)
                _require(math.isfinite(v), f"training.{key}", f"a finite radius for private method {self.method}", v)
            if self.restart_every > 1:
                u = self.privacy.u
                _require(math.isfinite(u) and u > 1, "privacy.u", "a finite number > 1 when restart_every > 1 "
                         "(the paper uses 1.25)", u)

    def _check_clients(self, clients: int) -> None:
        """The checks that depend on P."""
        part, sizes = self.dataset.partitioner, self.dataset.partitioner.sizes
        if part.name == "pathological" and self.dataset.task_kind == "regression":
            bins = part.num_bins(clients)
            _require(part.classes_per_client <= bins, "dataset.partitioner.classes_per_client",
                     f"at most the {bins} target bins of dataset {self.dataset.name} (dataset.partitioner.bins"
                     f"{'' if part.bins else ', null: one per client'})", part.classes_per_client)
        if part.name == "size":
            _require(len(sizes) == clients, "dataset.partitioner.sizes",
                     f"one size per client: training.clients = {clients} sizes", list(sizes))
        need = clients * part.min_samples
        if self.dataset.train_samples is not None:
            _require(self.dataset.train_samples >= need, "dataset.train_samples",
                     f"at least training.clients × dataset.partitioner.min_samples = {clients} × "
                     f"{part.min_samples} = {need} records (every client needs {part.min_samples}); keep more "
                     "records or use fewer clients", self.dataset.train_samples)

    @property
    def clients_auto(self) -> bool:
        """Whether P is ``auto``: the SuperNodes of the federation that runs the config (see :data:`CLIENTS_AUTO`)."""
        return self.training.clients == CLIENTS_AUTO

    @property
    def clients(self) -> int:
        """P. A config with ``training.clients: auto`` has none until a federation resolves it (:meth:`with_clients`):
        asking for it then is an error that says so."""
        if self.clients_auto:
            raise ConfigError(
                f"{self.source}: key `training.clients`: expected the number of clients P here. Found 'auto', which "
                "only a federation resolves (a Flower simulation: its SuperNodes; `diff2 run`: "
                f"{AUTO_CLIENTS_DEFAULT}, or --set training.clients=N). Set training.clients to the number of data "
                "owners.", key="training.clients", expected="the number of clients P", found=CLIENTS_AUTO)
        return int(self.training.clients)

    def with_clients(self, clients: int, origin: str = "") -> ExperimentConfig:
        """This config with P = ``clients`` (how ``training.clients: auto`` is resolved; also a fixed P), checked again
        with that P; ``origin`` says where the number came from in an error (e.g. "the simulation's SuperNodes")."""
        try:
            return dataclasses.replace(self, training=dataclasses.replace(self.training, clients=clients))
        except _Invalid as err:
            because = f" (P = {clients}: {origin})" if origin else ""
            raise _key_error(self.source + because, err.key if "." in err.key else f"training.{err.key}",
                             err.expected, err.found) from None

    @property
    def private(self) -> bool:
        return self.method != "gd"

    @property
    def loss(self) -> str:
        """The loss: the configured one, or by task (½-squared error / cross-entropy)."""
        if self.model.loss != "auto":
            return self.model.loss
        return "cross_entropy" if self.dataset.task_kind == "classification" else "half_squared_error"

    @property
    def closed_form_gradients(self) -> bool:
        """Whether workers use the closed-form (ghost clipping) path rather than generic torch.func."""
        if self.training.gradients == "auto":
            return self.model.is_paper_mlp and self.loss == "half_squared_error"
        return self.training.gradients == "closed_form"

    @property
    def restart_every(self) -> int:
        """T: 1 for gd and dpgd, the configured value for diff2."""
        return 1 if self.method != "diff2" else int(self.training.restart_every or 1)

    def calibration(self, n_min: int) -> Calibration | None:
        """The noise calibration for shards of at least ``n_min`` samples (None for gd)."""
        if not self.private:
            return None
        p = self.privacy
        return calibrate(
            epsilon=p.epsilon, delta=p.delta, rounds=self.training.rounds, restart_every=self.restart_every,
            u=p.u, n_min=n_min, clients=self.clients, mode=p.mode,
            **({"local_steps": self.local.steps, "local_batch_size": self.local.batch_size,
                "local_share": self.local.share} if self.local.enabled else {}),
        )

    def mechanism(self, calibration: Calibration | None) -> Mechanism:
        """T, C1, C2, σ1, σ2 for the estimator: no clipping and no noise for gd."""
        t = self.training
        if calibration is None:
            return Mechanism(self.restart_every, math.inf, math.inf, 0.0, 0.0)
        return Mechanism(self.restart_every, t.clip_restart, t.clip_diff,
                         calibration.sigma1, calibration.sigma2 or 0.0)

    def local_mechanism(self, calibration: Calibration | None) -> LocalMechanism | None:
        """K, b, η, C3, σ3 of the local routine (None when it is off)."""
        if not self.local.enabled or calibration is None or calibration.local is None:
            return None
        loc = self.local
        return LocalMechanism(loc.steps, loc.batch_size, self.training.learning_rate, loc.clip, calibration.local.sigma3)

    def to_dict(self) -> dict[str, Any]:
        """Plain YAML/JSON data (lists, not tuples) that :func:`parse_config` turns back into this config."""
        def plain(value: Any) -> Any:
            if isinstance(value, Kwargs):
                return value.as_dict()
            if isinstance(value, dict):
                return {k: plain(v) for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                return [plain(v) for v in value]
            return value

        out = plain(dataclasses.asdict(self))
        out.pop("source")
        out["training"]["routine"] = self.training.routine.to_yaml()
        return out


# --------------------------------------------------------------------------- loading

def _type_ok(value: Any, hint: Any) -> tuple[bool, Any]:
    """Check ``value`` against a field's type hint; return (ok, value converted)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        args = typing.get_args(hint)
        if value is None:
            return type(None) in args, None
        for arg in args:
            if arg is not type(None):
                ok, conv = _type_ok(value, arg)
                if ok:
                    return True, conv
        return False, value
    if origin is Literal:
        return value in typing.get_args(hint), value
    if hint is Kwargs:
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            return False, value
        return True, Kwargs(value)
    if origin is tuple:
        item = typing.get_args(hint)[0]
        if not isinstance(value, list) or not all(_type_ok(v, item)[0] for v in value):
            return False, value
        return True, tuple(value)
    if hint is bool:
        return isinstance(value, bool), value
    if hint is int:
        return _is_int(value), value
    if hint is float:
        if _is_int(value):
            return True, float(value)
        return isinstance(value, float), value
    if hint is str:
        return isinstance(value, str), value
    return isinstance(value, hint), value


def _describe(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is Literal:
        args = typing.get_args(hint)
        return repr(args[0]) if len(args) == 1 else "one of " + ", ".join(repr(a) for a in args)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return " or ".join("null" if a is type(None) else _describe(a) for a in typing.get_args(hint))
    if origin is tuple:
        return f"a list of {_describe(typing.get_args(hint)[0]).replace('a ', '')}s"
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string",
            Kwargs: "a mapping of names to values"}.get(hint, str(hint))


def _expand_shorthand(cls: type, value: Any) -> Any:
    """A section that has a shorthand (``routine: adam``) given as a plain string: ``{name: adam}``."""
    key = getattr(cls, "SHORTHAND", None)
    return {key: value} if key is not None and isinstance(value, str) else value


def _build(cls: type, data: Any, prefix: str, source: str) -> Any:
    where = prefix.rstrip(".") or "the top level"
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: `{where}` must be a mapping of keys to values. Found {data!r}.")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.name != "source"]
    unknown = sorted(set(map(str, data)) - set(names))
    if unknown:
        raise ConfigError(
            f"{source}: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(prefix + k for k in unknown)}. "
            f"Allowed in {where}: {', '.join(names)}."
        )
    kwargs: dict[str, Any] = {}
    for name in names:
        if name not in data:
            continue
        hint, value = hints[name], data[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, _expand_shorthand(hint, value), f"{prefix}{name}.", source)
            continue
        ok, converted = _type_ok(value, hint)
        if not ok:
            raise _key_error(source, f"{prefix}{name}", _describe(hint), value)
        kwargs[name] = converted
    try:
        return cls(**kwargs) if cls is not ExperimentConfig else cls(**kwargs, source=source)
    except _Invalid as err:
        key = err.key if "." in err.key else prefix + err.key
        raise _key_error(source, key, err.expected, err.found) from None


def parse_config(data: Any, source: str = "<memory>") -> ExperimentConfig:
    """Validate a parsed YAML mapping into an :class:`ExperimentConfig`."""
    return _build(ExperimentConfig, data, "", source)


def from_arguments(function: str, data: Mapping[str, Any], cls: type = ExperimentConfig,
                   renamed: Mapping[str, str] | None = None) -> Any:
    """Validate a Python API call's keyword arguments with the YAML path's checks and messages.

    ``data`` is shaped like the YAML for ``cls`` (for an experiment, ``{"method": ..., "privacy": {...},
    "training": {...}}``); a bad value is reported by its argument's name (the config key without its
    section: the API's keyword arguments are named as the keys, or as ``renamed`` says), e.g.
    "diff2_flwr.make_strategy: argument `rounds`: expected an integer >= 1. Found 0."
    """
    try:
        return _build(cls, data, "", function)
    except ConfigError as err:
        if err.key is None:
            raise
        argument = (renamed or {}).get(err.key, err.key.rpartition(".")[2])
        raise ConfigError(f"{function}: argument `{argument}`: expected {err.expected}. Found {err.found!r}.",
                          key=argument, expected=err.expected, found=err.found) from None


class _Loader(yaml.SafeLoader):
    """Safe YAML with YAML 1.2 floats (PyYAML, YAML 1.1, reads ``1e-5`` as a string, not a number) that
    refuses a key given twice in one mapping (PyYAML keeps the last one without a word: a file that says
    ``epsilon`` twice would leave the reader guessing which budget was spent)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        if isinstance(node, yaml.MappingNode):
            lines: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line + 1
                try:
                    first = lines.get(key)
                except TypeError:  # an unhashable key: the base class reports it
                    continue
                if first is not None:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key!r} is given twice in one mapping (line {first} and line {line}); "
                        "keep one of them", key_node.start_mark)
                lines[key] = line
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def read_yaml(path: str | Path, what: str = "experiment", error: type[ConfigError] = ConfigError) -> Any:
    """Parse a YAML file (YAML 1.2 floats); an unreadable or malformed file raises ``error`` naming it."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise error(f"Cannot read {what} file {path}: {exc.strerror or exc}.") from exc
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as exc:
        tab = _tab_at(exc, text)
        if tab is not None:  # PyYAML's own words ("cannot start any token") do not say what to do
            raise error(f"{path}: not valid YAML: line {tab[0]}, column {tab[1]}: a tab character. YAML indents "
                        "with spaces, not tabs: replace the tab with spaces.") from exc
        raise error(f"{path}: not valid YAML: {exc}") from exc


def _tab_at(exc: yaml.YAMLError, text: str) -> tuple[int, int] | None:
    """(line, column), both from 1, of the tab character the parser stopped at; None if it stopped elsewhere."""
    mark = getattr(exc, "problem_mark", None)
    if mark is None:
        return None
    lines = text.splitlines()
    if mark.line < len(lines) and lines[mark.line][mark.column:mark.column + 1] == "\t":
        return mark.line + 1, mark.column + 1
    return None


def load_config(path: str | Path, overrides: Mapping[str, Any] | None = None) -> ExperimentConfig:
    """Read and validate an experiment YAML file, with single keys overridden (``{"training.rounds": 200}``).

    The overrides are validated like the file (unknown keys, types, ranges); errors name them.
    """
    data = read_yaml(path)
    if not overrides:
        return parse_config(data, str(path))
    shown = " ".join(f"{k}={_show(v)}" for k, v in overrides.items())
    source = f"{path} (with overrides {shown})"
    return parse_config(apply_overrides(data, overrides, source), source)


# --------------------------------------------------------------------------- overrides

def config_keys() -> list[str]:
    """Every settable key of an experiment file, dotted (``training.rounds``), in declaration order."""
    def walk(cls: type, prefix: str) -> list[str]:
        hints, out = typing.get_type_hints(cls), []
        for f in dataclasses.fields(cls):
            if f.name == "source":
                continue
            if dataclasses.is_dataclass(hints[f.name]):
                if getattr(hints[f.name], "SHORTHAND", None):  # settable whole too: training.routine=adam
                    out.append(prefix + f.name)
                out += walk(hints[f.name], f"{prefix}{f.name}.")
            else:
                out.append(prefix + f.name)
        return out

    return walk(ExperimentConfig, "")


def yaml_text(value: Any) -> str:
    """A value as the YAML text that reads back as it (``200``, ``1.0e-06``, ``null``, ``[a, b]``)."""
    return yaml.safe_dump(value, default_flow_style=True, width=10**9).strip().removesuffix("...").strip()


def _show(value: Any) -> str:
    return value if isinstance(value, str) else yaml_text(value)


def _yaml_value(text: str, key: str, source: str) -> Any:
    """A value written as YAML (``200``, ``1e-5``, ``null``, ``[a, b]``, ``{k: v}``, ``text``)."""
    try:
        return yaml.load(text, Loader=_Loader) if text.strip() else ""  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: override {key}={text!r} is not a valid YAML value: {exc}") from None


def parse_assignment(text: str, source: str = "--set") -> tuple[str, Any]:
    """``"training.rounds=200"`` -> ``("training.rounds", 200)``; the value is read as YAML."""
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"{source}: expected KEY=VALUE (e.g. training.rounds=200). Found {text!r}.")
    return key, _yaml_value(value, key, source)


def set_assignments(words: Sequence[str] | None, config: str | None, default: str) -> tuple[str, dict[str, Any]]:
    """The experiment file and the overrides of a command line whose ``--set`` takes several assignments.

    ``words`` are every ``--set``'s words in order (argparse ``action="extend", nargs="+"``), ``config`` the
    positional file or ``None``. ``--set`` swallows the file too in ``--set a=1 CONFIG``: a last word without
    ``=`` is the experiment file when no other was given (any other such word is refused by
    :func:`parse_assignment`, naming it); no file at all is ``default``.
    """
    texts = list(words or ())
    if config is None and texts and "=" not in texts[-1]:
        config = texts.pop()
    return (default if config is None else config), dict(parse_assignment(text) for text in texts)


def apply_overrides(data: Any, overrides: Mapping[str, Any], source: str = "<overrides>") -> dict:
    """A copy of the parsed file with each dotted key set; a key that does not exist is refused here."""
    import copy

    known = config_keys()
    out = copy.deepcopy(data) if isinstance(data, Mapping) else ({} if data is None else data)
    if not isinstance(out, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of keys to values. Found {out!r}.")
    # A whole section (training.routine=adam) before its keys (training.routine.beta1=0.8), whatever the order given.
    for key, value in sorted(overrides.items(), key=lambda item: item[0].count(".")):
        if key not in known:
            import difflib

            close = [k for k in known if k.rsplit(".", 1)[-1] == key.rsplit(".", 1)[-1]]
            close = close or difflib.get_close_matches(key, known, n=3, cutoff=0.75)
            hint = f" Did you mean {', '.join(close)}?" if close else f" Settable keys: {', '.join(known)}."
            raise ConfigError(f"{source}: unknown key {key} in the overrides.{hint}")
        node = out
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            if node.get(part) is None:
                node[part] = {}
            section = ".".join(parts[:i + 1])
            if isinstance(node[part], str) and section in _SHORTHAND_SECTIONS:  # routine: adam -> {name: adam}
                node[part] = {_SHORTHAND_SECTIONS[section]: node[part]}
            if not isinstance(node[part], dict):
                raise ConfigError(f"{source}: `{part}` must be a mapping of keys to values. Found {node[part]!r}.")
            node = node[part]
        node[parts[-1]] = value
    return out


#: Sections that a plain string may stand for, and the key the string sets (``routine: adam``).
_SHORTHAND_SECTIONS = {"training.routine": RoutineConfig.SHORTHAND}

#: A run-config value that leaves the file's value alone (Flower needs every key declared with a default).
UNSET = ""


def run_config_overrides(run_config: Mapping[str, Any]) -> dict[str, Any]:
    """The experiment-file overrides among a Flower run config's keys (all but ``config``).

    Strings are read as YAML (so ``training.seed='null'`` or ``dataset.drop='[a, b]'`` work); numbers
    and booleans are taken as Flower typed them; ``""`` (the declared default) means "as in the file".
    """
    out: dict[str, Any] = {}
    for key, value in run_config.items():
        if key == "config" or value == UNSET:
            continue
        out[key] = _yaml_value(value, key, "--run-config") if isinstance(value, str) else value
    return out


def load_run_config(run_config: Mapping[str, Any]) -> ExperimentConfig:
    """The experiment of a Flower run config: the file named by key ``config``, the other keys as overrides.

    A bad override is reported as the run-config key it is, in one line: "--run-config key `training.rounds`:
    expected an integer. Found 'five' (experiment file configs/default.yaml)." (the file as the run config names
    it, not the installed app's copy).
    """
    from .paths import resolve_config_path

    given = str(run_config.get("config", ""))
    overrides = run_config_overrides(run_config)
    try:
        return load_config(resolve_config_path(given), overrides)
    except ConfigError as err:
        if err.key is None or err.key not in overrides:
            raise
        raise ConfigError(f"--run-config key `{err.key}`: expected {err.expected}. Found {err.found!r} (experiment "
                          f"file {given}).", key=err.key, expected=err.expected, found=err.found) from None


def parse_section(cls: type, data: Any, source: str) -> Any:
    """Validate a mapping into the frozen dataclass ``cls`` with the experiment file's checks and messages
    (unknown keys, types, each field's ``_require``); used by files other than the experiment's (a node policy)."""
    return _build(cls, data, "", source)
