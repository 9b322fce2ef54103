"""The data sections of an experiment file: ``dataset`` (with ``dataset.partitioner``) and
``model``.

Each field is declared once (:func:`~diff2_flwr.runtime.spec.setting`: default and help; the type by
its annotation; the checks in ``__post_init__``); see :mod:`diff2_flwr.runtime.spec` for what
derives from it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Literal

from ..task.losses import LOSSES
from .spec import Kwargs, require, setting

__all__ = ["PartitionerConfig", "DatasetConfig", "ModelConfig", "PAPER_MLP"]


@dataclass(frozen=True)
class PartitionerConfig:
    """How the train split is cut into the P shards (``dataset.partitioner``); see
    task/partitions.py."""

    name: Literal["iid", "dirichlet", "pathological", "size", "linear", "square",
                  "exponential"] = setting(
        "iid",
        "how the train split is cut into P shards: iid, dirichlet, pathological, linear, square, "
        "exponential, size (docs/how-to/partitions.md)")
    seed: int | None = setting(None, "seed of dirichlet and pathological; null: dataset.split_seed")
    alpha: float | None = setting(None, "dirichlet only: the concentration α > 0 (small = skewed)")
    min_partition_size: int = setting(10,
                                      "dirichlet only: Flower resamples (<= 10 times) until every "
                                      "shard has this many")
    self_balancing: bool = setting(False, "dirichlet only: Flower's balancing")
    classes_per_client: int | None = setting(None, "pathological only: k labels per client")
    class_assignment: Literal["first-deterministic", "deterministic", "random"] = setting(
        "first-deterministic", "pathological only: how the k labels are given out")
    bins: int | None = setting(None,
                               "dirichlet/pathological on a regression target: quantile bins of "
                               "the target (null: one per client, at least 2)")
    sizes: tuple[int, ...] = setting((), "size only: the P shard sizes, summing to the train split")
    min_samples: int = setting(1, "refuse a partition with a shard below this many samples")

    #: Keys that live elsewhere now (the old name is refused with the new one).
    MOVED = {"max_sigma": "privacy.max_sigma"}

    def __post_init__(self) -> None:
        name = self.name
        require(self.seed is None or self.seed >= 0, "seed", "null or an integer >= 0", self.seed)
        only = {"alpha": ("dirichlet",), "classes_per_client": ("pathological",),
                "sizes": ("size",),
                "bins": ("dirichlet", "pathological")}
        for key, names in only.items():
            value = getattr(self, key)
            if name not in names:
                require(value is None or value == (), f"{key}",
                         f"nothing for partitioner {name} ({' or '.join(names)} only)", value)
        if name == "dirichlet":
            a = self.alpha
            require(a is not None and math.isfinite(a) and a > 0, "alpha",
                     "a finite number > 0 for partitioner dirichlet (small = skewed, e.g. 0.1; "
                     "large -> IID)", a)
        if name == "pathological":
            require(self.classes_per_client is not None and self.classes_per_client >= 1,
                     "classes_per_client", "an integer >= 1 for partitioner pathological",
                     self.classes_per_client)
        if name == "size":
            require(bool(self.sizes) and min(self.sizes) >= 1, "sizes",
                     "a list of training.clients shard sizes, each >= 1, summing to the train "
                     "split", list(self.sizes))
        require(self.bins is None or self.bins >= 2, "bins", "null or an integer >= 2", self.bins)
        require(self.min_partition_size >= 0, "min_partition_size", "an integer >= 0",
                 self.min_partition_size)
        require(self.min_samples >= 1, "min_samples", "an integer >= 1", self.min_samples)

    def num_bins(self, clients: int) -> int:
        """Quantile bins of a regression target: ``bins``, or one per client (at least 2), so that
        pathological's first-deterministic assignment gives every bin a client."""
        return self.bins or max(clients, 2)

    def arguments(self, split_seed: int, task: str, clients: int) -> dict[str, Any]:
        """Keyword arguments of :func:`diff2_flwr.task.partitions.partition` (seed and bins
        resolved)."""
        args: dict[str, Any] = {"name": self.name}
        # the others draw nothing at random beyond the split
        if self.name in ("dirichlet", "pathological"):
            args["seed"] = split_seed if self.seed is None else self.seed
        if self.name == "dirichlet":
            args.update(alpha=self.alpha, min_partition_size=self.min_partition_size,
                        self_balancing=self.self_balancing)
        if self.name == "pathological":
            args.update(classes_per_client=self.classes_per_client,
                        class_assignment=self.class_assignment)
        if self.name in ("dirichlet", "pathological") and task == "regression":
            args["bins"] = self.num_bins(clients)
        if self.name == "size":
            args["sizes"] = self.sizes
        return args

    def describe(self, split_seed: int, task: str, clients: int) -> str:
        """One line: the partitioner and its parameters, e.g. ``dirichlet(seed=0, alpha=0.1, ...,
        by=class)``."""
        args = self.arguments(split_seed, task, clients)
        name = args.pop("name")
        if name == "iid":
            return "iid (the paper's: shuffled, sizes differ by at most one)"
        if name in ("dirichlet", "pathological"):
            args[
                "by"] = "class" if task == "classification" else (f"target in {args.pop('bins')} "
                                                                  f"quantile bins")
        if "sizes" in args:
            args["sizes"] = list(args["sizes"])
        if name in ("linear", "square", "exponential"):
            return (f"{name} (shard p = 1..P gets a share ∝ "
                    f"{dict(linear='p', square='p²', exponential='e^p')[name]})")
        return f"{name}(" + ", ".join(f"{k}={v}" for k, v in args.items()) + ")"


@dataclass(frozen=True)
class DatasetConfig:
    """The experiment's ``dataset`` section: which records, how they are split and sharded."""

    name: Literal["synthetic", "california_housing", "gas_turbine", "blogfeedback", "kddcup99",
                  "covertype", "digits",
                  "csv"] = setting("synthetic",
                                   "synthetic, california_housing, gas_turbine, blogfeedback, "
                                   "kddcup99, covertype, digits, csv (docs/how-to/datasets.md)")
    dir: str | None = setting(None, "data directory of the real datasets; null: $DIFF2_DATA_DIR")
    test_fraction: float = setting(0.2, "held-out fraction")
    split_seed: int = setting(0, "seed of the train/test split (the shards follow from it)")
    train_samples: int | None = setting(None,
                                        "keep a uniform random subset of this many train records, "
                                        "drawn before standardising and sharding (null: all)",
                                        before=None)
    subsample_seed: int = setting(0, "seed of that subset (the subsets of one seed are nested)",
                                  before=0)
    standardise: bool | None = setting(None,
                                       "scale each feature to mean 0, std 1 on the train split "
                                       "(null: yes, except digits, whose pixels arrive scaled to "
                                       "[0, 1])", before=None)
    num_samples: int = setting(10_000, "synthetic only: records")
    num_features: int = setting(8, "synthetic only: features")
    generator_seed: int = setting(0, "synthetic only: the generator's seed")
    path: str | None = setting(None, "csv only: the file")
    target: str | None = setting(None, "csv only: the target column")
    drop: tuple[str, ...] = setting((), "csv only: columns to ignore")
    categorical: tuple[str, ...] = setting((), "csv only: columns to one-hot encode")
    task: Literal["regression", "classification"] | None = setting(
        None, "csv only: regression or classification (required unless model.loss says it)")
    shards: str | None = setting(None,
                                 "deployment: folder of `diff2 shard` files (the server reads only "
                                       "server.npz there; needs evaluation.train_metrics: false)")
    partitioner: PartitionerConfig = setting(factory=PartitionerConfig,
                                             help="how the train split is sharded")

    @property
    def task_kind(self) -> str:
        """``regression`` or ``classification``: the dataset's task (a CSV's as declared)."""
        if self.name == "csv":
            return self.task or "regression"
        return "classification" if self.name in ("kddcup99", "covertype",
                                                 "digits") else "regression"

    def __post_init__(self) -> None:
        if self.name == "csv":
            require(bool(self.path), "path", "the CSV file's path for dataset csv", self.path)
            require(bool(self.target), "target", "the target column's name for dataset csv",
                    self.target)
        else:
            for key in ("path", "target", "task"):
                require(getattr(self, key) is None, key,
                        f"nothing for dataset {self.name} (csv only)", getattr(self, key))
            for key in ("drop", "categorical"):
                require(not getattr(self, key), key, f"nothing for dataset {self.name} (csv only)",
                        getattr(self, key))
        require(0 < self.test_fraction < 1, "test_fraction", "a number in (0, 1)",
                self.test_fraction)
        require(self.split_seed >= 0, "split_seed", "an integer >= 0", self.split_seed)
        require(self.train_samples is None or self.train_samples >= 1, "train_samples",
                 "null (every record of the train split) or an integer >= 1 (records to keep)",
                 self.train_samples)
        require(self.subsample_seed >= 0, "subsample_seed", "an integer >= 0", self.subsample_seed)
        require(self.num_samples >= 2, "num_samples", "an integer >= 2", self.num_samples)
        require(self.num_features >= 1, "num_features", "an integer >= 1", self.num_features)
        require(self.generator_seed >= 0, "generator_seed", "an integer >= 0", self.generator_seed)
        part = self.partitioner
        if part.name in ("dirichlet", "pathological") and self.task_kind == "classification":
            require(part.bins is None, "dataset.partitioner.bins",
                     f"nothing for the classification dataset {self.name} (bins cut a regression "
                     f"target)", part.bins)
        known = {"kddcup99": 2, "covertype": 7, "digits": 10}.get(self.name)
        if part.name == "pathological" and known is not None:
            require(part.classes_per_client <= known, "dataset.partitioner.classes_per_client",
                     f"at most the {known} classes of dataset {self.name}", part.classes_per_client)



#: The paper's model (the default); any other ``model.name`` is a factory "package.module:callable".
PAPER_MLP = "paper_mlp"
_FACTORY = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")


@dataclass(frozen=True)
class ModelConfig:
    """The experiment's ``model`` section: the paper's MLP or a factory, x_0's seed, the loss."""

    name: str = setting(PAPER_MLP,
                        "paper_mlp, or a factory \"package.module:callable\" called as "
                        "factory(in_features=..., out_features=..., **model.kwargs) that returns "
                        "a torch.nn.Module")
    hidden: int | None = setting(None, "paper_mlp only: hidden units (null: the paper's 10)")
    kwargs: Kwargs = setting(factory=Kwargs, help="factory only: its keyword arguments")
    init_seed: int = setting(0,
                             "seed of x_0 (the paper MLP's generator; torch's generator around a "
                             "factory's call)")
    loss: str = setting("auto",
                        "half_squared_error (regression) or cross_entropy (classification); auto "
                        "picks by task")

    @property
    def is_paper_mlp(self) -> bool:
        """Whether the model is the paper's built-in MLP (not a factory)."""
        return self.name == PAPER_MLP

    @property
    def hidden_units(self) -> int:
        """The paper MLP's hidden width (10 unless configured)."""
        return 10 if self.hidden is None else self.hidden

    def __post_init__(self) -> None:
        require(self.is_paper_mlp or bool(_FACTORY.match(self.name)), "name",
                 "'paper_mlp' or a model factory as an import path 'package.module:callable'",
                 self.name)
        if self.is_paper_mlp:
            require(self.hidden is None or self.hidden >= 1, "hidden", "null or an integer >= 1",
                    self.hidden)
            require(not self.kwargs, "kwargs",
                    "nothing for model paper_mlp (its width is model.hidden)",
                     self.kwargs.as_dict())
        else:
            require(self.hidden is None, "hidden",
                    f"nothing for a model factory ({self.name}): pass its sizes "
                     "in model.kwargs", self.hidden)
            reserved = sorted({"in_features", "out_features"} & {k for k, _ in self.kwargs})
            require(not reserved, "kwargs",
                    "no in_features or out_features (the data sets them: the factory is "
                     "called as factory(in_features=..., out_features=..., **model.kwargs))",
                     self.kwargs.as_dict())
        require(self.init_seed >= 0, "init_seed", "an integer >= 0", self.init_seed)
        require(self.loss in LOSSES or self.loss == "auto", "loss",
                f"'auto' or one of {sorted(LOSSES)}", self.loss)
