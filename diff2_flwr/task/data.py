"""Datasets and the paper's preprocessing.

Preparation (DIFF2.md, "The paper's experiments"): a random 80/20 train/test split; features
standardised to mean 0 and std 1 (statistics of the train split); the target divided by the
maximum absolute target of the whole dataset; the train split cut into P IID shards whose
sizes differ by at most one (``n_min`` is the smallest). Preprocessing uses statistics of
the private data and is, as in the paper, outside the DP guarantee.

Datasets: ``synthetic`` (in-package, deterministic by seed: the embedded default);
``california_housing``, ``gas_turbine`` and ``blogfeedback`` (regression), ``kddcup99`` and
``covertype`` (classification), read from files in a data directory given in the config or by
``DIFF2_DATA_DIR`` (never downloaded; expected file names in :data:`EXPECTED_FILES`); and
``csv``, any CSV file with a header (a target column, columns to drop, categorical columns); and
``digits``, scikit-learn's bundled 8×8 handwritten digits (1,797 images, 10 classes, no download;
the ``examples`` extra), whose 64 pixel intensities 0..16 are divided by 16 into [0, 1] and not
standardised (a CNN reads them as a 1×8×8 image; per-pixel standardisation would blow up the nearly
always blank border pixels). For classification the target is a class index and is not scaled:
labels that are all numbers must be integers (``1`` and ``1.0`` are class 1; classes ordered by
value), other labels are text (ordered as text). Non-IID shards (Dirichlet, pathological,
size-skewed) come from :mod:`diff2_flwr.task.partitions`.

Every CSV file is read by pyarrow through :mod:`diff2_flwr.task.csvfile`, chosen because its number
parser is correctly rounded (the arrays are bit for bit those of the hand-written reader it
replaced) and it names the row of a malformed line; messages name the file's 1-based line (header =
line 1, empty lines skipped but counted).
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute as pac

from .csvfile import CsvFile, DataError
from .partitions import PartitionError, partition

__all__ = [
    "DATA_DIR_ENV",
    "DATASETS",
    "DataError",
    "PreparedData",
    "load_digits",
    "load_raw",
    "prepare",
    "resolve_data_dir",
    "subsample",
    "synthetic_regression",
]

DATA_DIR_ENV = "DIFF2_DATA_DIR"
DATASETS = ("synthetic", "california_housing", "gas_turbine", "blogfeedback", "kddcup99",
            "covertype", "digits", "csv")
CLASSIFICATION = ("kddcup99", "covertype", "digits")
#: Datasets whose features arrive on a fixed, known scale and are not standardised (digits: pixels /
#: 16 in [0, 1]).
PRESCALED = ("digits",)

#: Files each real dataset is read from (in ``<data dir>/<dataset>/`` or ``<data dir>/``).
EXPECTED_FILES = {
    "california_housing": ("cal_housing.csv",),
    "gas_turbine": tuple(f"gt_{year}.csv" for year in range(2011, 2016)),
    # UCI BlogFeedback: 281 numbers per row, no header, target last
    "blogfeedback": ("blogData_train.csv",),
    # UCI KDD Cup 1999, 10 % file (or .gz / .csv): 41 features + label
    "kddcup99": ("kddcup.data_10_percent",),
    "covertype": ("covtype.data",),  # UCI Covertype (or .gz): 54 features + cover type 1..7
}

# Where each real dataset's files are looked for, relative to the data directory: first in
# a sub-folder named like the dataset (the layout of ../shared/data), then directly in it.
_CALIFORNIA_FILE = "cal_housing.csv"
_CALIFORNIA_TARGET = "median_house_value"
_GAS_TURBINE_FILES = tuple(f"gt_{year}.csv" for year in range(2011, 2016))
_GAS_TURBINE_TARGET, _GAS_TURBINE_DROP = "CO", ("NOX",)


@dataclass(frozen=True)
class PreparedData:
    """Train/test arrays after preprocessing, and the P shards of the train split."""

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    shard_bounds: tuple[tuple[int, int], ...]
    target_scale: float
    task: str = "regression"
    classes: tuple[str, ...] = ()
    feature_mean: np.ndarray | None = None  # the standardisation statistics (train split)
    feature_std: np.ndarray | None = None
    #: Records of the train split before ``train_samples`` kept a subsample of them (None: no
    #: subsample).
    train_available: int | None = None
    subsample_seed: int | None = None  # the seed of that subsample (None: no subsample)

    @property
    def num_outputs(self) -> int:
        """Model outputs: 1 for regression, the number of classes for classification."""
        return len(self.classes) if self.task == "classification" else 1

    @property
    def num_features(self) -> int:
        """Model inputs: the features per record after preprocessing (one-hot columns counted)."""
        return int(self.x_train.shape[1])

    @property
    def shard_sizes(self) -> tuple[int, ...]:
        """n_p: the number of train records of each worker's shard, in partition order."""
        return tuple(b - a for a, b in self.shard_bounds)

    @property
    def n_min(self) -> int:
        """The smallest shard's size: the n_min of the sensitivity 2C/(n_min P)."""
        return min(self.shard_sizes)

    def shard(self, partition_id: int) -> tuple[np.ndarray, np.ndarray]:
        """Features and targets of worker ``partition_id``'s shard."""
        if not 0 <= partition_id < len(self.shard_bounds):
            raise DataError(
                f"partition-id must be in 0..{len(self.shard_bounds) - 1}. Found {partition_id}.")
        a, b = self.shard_bounds[partition_id]
        return self.x_train[a:b], self.y_train[a:b]


def synthetic_regression(num_samples: int, num_features: int, seed: int) -> tuple[np.ndarray,
                                                                                  np.ndarray]:
    """A smooth nonlinear regression task, deterministic by ``seed`` (needs no download).

    y = tanh(w1·x) + 0.5 sin(w2·x) + 0.1 (w3·x)² + 0.1 N(0, 1), with x ~ N(0, I) and fixed
    random directions w.
    """
    if num_samples < 2 or num_features < 1:
        raise DataError(
            f"synthetic data needs num_samples >= 2 and num_features >= 1. Found {num_samples}, "
            f"{num_features}.")
    rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(0x5EED,)))
    w = rng.standard_normal((3, num_features)) / np.sqrt(num_features)
    x = rng.standard_normal((num_samples, num_features))
    proj = x @ w.T
    y = np.tanh(proj[:, 0]) + 0.5 * np.sin(2 * proj[:, 1]) + 0.1 * proj[:, 2] ** 2
    y = y + 0.1 * rng.standard_normal(num_samples)
    return x, y


def resolve_data_dir(configured: str | os.PathLike[str] | None) -> Path:
    """The data directory: the configured one, else ``$DIFF2_DATA_DIR``."""
    if configured:
        return Path(configured).expanduser()
    env = os.environ.get(DATA_DIR_ENV)
    if env:
        return Path(env).expanduser()
    raise DataError(
        f"No data directory: set `dataset.dir` in the config or the environment variable "
        f"{DATA_DIR_ENV} "
        "to the folder holding california_housing/ and gas_turbine/ (e.g. ../shared/data)."
    )


def _find(data_dir: Path, sub: str, filename: str, variants: tuple[str, ...] = ("",)) -> Path:
    for suffix in variants:
        for candidate in (data_dir / sub / (filename + suffix), data_dir / (filename + suffix)):
            if candidate.is_file():
                return candidate
    raise DataError(
        f"Dataset file {filename!r} not found: looked for {data_dir / sub / filename} and "
        f"{data_dir / filename}. Point `dataset.dir` or {DATA_DIR_ENV} at the folder that holds "
        f"it."
    )


def _features_and_target(path: Path, target: str, drop: tuple[str, ...] = ()) -> tuple[np.ndarray,
                                                                                       np.ndarray]:
    """A numeric CSV file with a header: the features (every column but the target and ``drop``) and
    the target."""
    file = CsvFile.open(path)
    t = file.index(target, "target column")
    keep = [j for j, name in enumerate(file.names) if j != t and name not in drop]
    table = file.read(keep + [t])
    return table.numbers(keep), table.numbers([t])[:, 0]


def load_raw(
    name: str, *, data_dir: str | os.PathLike[str] | None = None,
    num_samples: int = 10_000, num_features: int = 8, seed: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """Features and target of a dataset before preprocessing."""
    if name == "synthetic":
        return synthetic_regression(num_samples, num_features, seed)
    if name == "california_housing":
        return _features_and_target(_find(resolve_data_dir(data_dir), "california_housing",
                                          _CALIFORNIA_FILE),
                                    _CALIFORNIA_TARGET)
    if name == "gas_turbine":
        root = resolve_data_dir(data_dir)
        parts = []
        for filename in _GAS_TURBINE_FILES:
            parts.append(_features_and_target(_find(root, "gas_turbine", filename),
                                              _GAS_TURBINE_TARGET, _GAS_TURBINE_DROP))
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    if name == "blogfeedback":
        path = _find(resolve_data_dir(data_dir), "blogfeedback", "blogData_train.csv", ("", ".gz"))
        file = CsvFile.open(path, header=False)
        width = len(file.names)
        table = file.read(range(width))
        return table.numbers(range(width - 1)), table.numbers([width - 1])[:, 0]
    raise DataError(f"Unknown dataset {name!r}. Expected one of {list(DATASETS)}.")


def _encode(file: CsvFile, target: int, categorical: set[int], drop: set[int], classification: bool,
            labels: Callable[[pa.Array], pa.Array] | None = None) -> tuple[np.ndarray, np.ndarray,
                                                                           tuple[str, ...]]:
    """Features (categorical columns one-hot, in order of first appearance) and target (class index,
    or number).

    ``labels`` maps the target's text before the classes are taken (KDD Cup 99: any attack ->
    "attack").
    """
    keep = [j for j in range(len(file.names)) if j != target and j not in drop]
    numeric = [j for j in keep if j not in categorical]
    hints = {} if classification else {
        target: "A regression target must be a number: for class labels write "
                                                "`dataset.task: classification`."}
    table = file.read(numeric if classification else numeric + [target],
                      text=sorted(categorical) + ([target] if classification else []), hints=hints)
    blocks = [table.numbers(numeric)]
    for j in sorted(categorical):
        codes = pac.dictionary_encode(table.text(j))  # codes in order of first appearance
        one_hot = np.zeros((table.num_rows, len(codes.dictionary)))
        one_hot[np.arange(table.num_rows), codes.indices.to_numpy()] = 1.0
        blocks.append(one_hot)
    x = np.concatenate(blocks, axis=1)
    if not classification:
        return x, table.numbers([target])[:, 0], ()
    values = table.text(target)
    y, classes = class_indices(file, target, labels(values) if labels else values)
    return x, y, classes


def class_indices(file: CsvFile, column: int, values: pa.Array) -> tuple[np.ndarray, tuple[str,
                                                                                           ...]]:
    """Class index (float64) of each label, and the class names.

    Labels that are all numbers must hold integers (``1`` and ``1.0`` are class 1), ordered by value
    and named ``"1"``; text labels are ordered as text. Anything else (``1.5``, ``nan``, an empty
    label) is refused with its line.
    """
    try:
        numbers = pac.cast(values, pa.float64()).to_numpy(zero_copy_only=False)
    except pa.ArrowInvalid:
        numbers = None
    if numbers is not None:
        bad = ~np.isfinite(numbers) | (numbers != np.round(numbers))
        if bad.any():
            row = int(np.argmax(bad))
            raise DataError(
                f"{file.path}: line {file.line(row)}, {file.label(column)} holds the class label "
                            f"{values[row].as_py()!r}: class labels must be integers (1 or 1.0) "
                            f"or text. Round the "
                            "labels, or for a numeric target write `dataset.task: regression`.")
        levels = np.unique(numbers)
        classes = tuple(str(int(v)) for v in levels)
        y = np.searchsorted(levels, numbers).astype(np.float64)
    else:
        empty = pac.equal(values, "").to_numpy(zero_copy_only=False)
        if empty.any():
            raise DataError(
                f"{file.path}: line {file.line(int(np.argmax(empty)))}, {file.label(column)} "
                f"holds no "
                            "class label. Fill in or drop the records without a label first.")
        classes = tuple(sorted(set(values.unique().to_pylist())))
        y = pac.index_in(values,
                         value_set=pa.array(classes)).to_numpy(zero_copy_only=False).astype(
                             np.float64)
    if len(classes) < 2:
        raise DataError(
            f"{file.path}: the target {file.label(column)} has a single class {classes}: "
                        "classification needs at least two.")
    return y, classes


def load_digits() -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
    """scikit-learn's bundled handwritten digits: 1,797 rows of 64 pixels / 16 (in [0, 1]), class
    0..9, names."""
    try:
        from sklearn.datasets import load_digits as _sklearn_load_digits  # noqa: PLC0415 -- optional extra (examples)
    except ImportError as exc:
        raise DataError(
            "dataset `digits` reads scikit-learn's bundled handwritten digits, but scikit-learn "
            "is not installed "
            f"({exc}). Install the examples extra: pip install 'diff2-flwr[examples]' "
            f"(scripts/setup.sh does)."
        ) from None
    bunch = _sklearn_load_digits()
    x = np.asarray(bunch.data, dtype=np.float64) / 16.0  # intensities 0..16 -> [0, 1]
    y = np.asarray(bunch.target, dtype=np.float64)
    return x, y, tuple(str(c) for c in range(10))


def load_classification(name: str, *, data_dir: str | os.PathLike[str] | None = None):
    """KDD Cup 99 (normal vs attack), Covertype (7 cover types) or digits (10 digits): features,
    class index, class names."""
    if name == "digits":
        return load_digits()
    root = resolve_data_dir(data_dir)
    if name == "kddcup99":
        path = _find(root, "kddcup99", "kddcup.data_10_percent", ("", ".gz", ".csv"))
        file = CsvFile.open(path, header=False)
        if len(file.names) != 42:
            raise DataError(
                f"{path}: KDD Cup 99 rows have 42 values (41 features and a label). Found "
                f"{len(file.names)}.")
        return _encode(file, target=41, categorical={1, 2, 3}, drop=set(), classification=True,
                       labels=_normal_or_attack)
    if name == "covertype":
        path = _find(root, "covertype", "covtype.data", ("", ".gz"))
        file = CsvFile.open(path, header=False)
        if len(file.names) != 55:
            raise DataError(
                f"{path}: Covertype rows have 55 values (54 features and the cover type). Found "
                f"{len(file.names)}.")
        return _encode(file, target=54, categorical=set(), drop=set(), classification=True)
    raise DataError(
        f"Unknown classification dataset {name!r}. Expected one of {list(CLASSIFICATION)}.")


def load_csv(path: str | os.PathLike[str], *, target: str, drop: tuple[str, ...] = (),
             categorical: tuple[str, ...] = (), task: str = "regression"):
    """Any CSV file with a header: the named target column, minus dropped columns."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise DataError(f"CSV dataset {path} not found: set `dataset.path` to an existing file.")
    if task not in ("regression", "classification"):
        raise DataError(f"`dataset.task` must be 'regression' or 'classification'. Found {task!r}.")
    file = CsvFile.open(path)
    t = file.index(target, "`dataset.target` column")
    for key, names in (("drop", drop), ("categorical", categorical)):
        missing = [n for n in names if n not in file.names]
        if missing:
            close = difflib.get_close_matches(missing[0], file.names, n=1)
            hint = f"Did you mean {close[0]!r}? " if close else ""
            raise DataError(
                f"{path}: `dataset.{key}` names column(s) {missing} that the header lacks. {hint}"
                            f"Columns: {list(file.names)}.")
    if target in drop or target in categorical:
        raise DataError(
            f"{path}: the target column {target!r} cannot also be dropped or categorical.")
    return _encode(file, target=t, categorical={file.names.index(c) for c in categorical},
                   drop={file.names.index(c) for c in drop},
                   classification=task == "classification")


def _normal_or_attack(labels: pa.Array) -> pa.Array:
    """KDD Cup 99's binary task: normal traffic (``normal.``) against any attack."""
    normal = pac.equal(pac.utf8_rtrim(labels, characters="."), "normal")
    return pac.if_else(normal, "normal", "attack")


def prepare(  # noqa: PLR0913 -- keyword-only options, most of them the dataset section's settings
    name: str, x: np.ndarray, y: np.ndarray, *, clients: int, test_fraction: float = 0.2,
    split_seed: int = 0, classes: tuple[str, ...] = (),
    partitioner: Mapping[str, Any] | None = None, standardise: bool | None = None,
    train_samples: int | None = None, subsample_seed: int = 0,
) -> PreparedData:
    """Split, standardise, scale the target (regression only) and shard (the paper's preparation).

    With ``classes`` the task is classification: ``y`` holds class indices and is not scaled.
    ``partitioner`` holds the keyword arguments of :func:`~diff2_flwr.task.partitions.partition`
    (``name``, ``seed``, ``alpha``, ...); ``None`` or ``{"name": "iid"}`` is the paper's IID cut.
    The train split is then reordered so that shard p is the contiguous block ``shard_bounds[p]``;
    the test split and the standardisation statistics do not depend on the partition.
    ``standardise`` (default: unless ``name`` is in :data:`PRESCALED`) False keeps the features as
    they are (mean 0, std 1 are recorded as the statistics).

    ``train_samples`` N keeps a uniform random subset of N records of the train split, drawn with
    ``subsample_seed``, *before* standardising and sharding: the kept records are the training set
    from then on (their statistics standardise the features, the partitioner cuts them into the P
    shards, n_min follows), while the test split holds the same records as without a subsample and
    the target keeps its scale (the largest |target| of the whole dataset). The subsets of one seed
    are nested (the N₁ records kept for N₁ < N₂ are among the N₂ kept for N₂), and N = the whole
    train split keeps every record in its order, i.e. gives exactly the data without a subsample.
    """
    n = x.shape[0]
    if not 0 < test_fraction < 1:
        raise DataError(f"`test_fraction` must be in (0, 1). Found {test_fraction}.")
    if not np.all(np.isfinite(x)) or not np.all(np.isfinite(y)):
        raise DataError(f"Dataset {name!r} holds NaN or infinite values; clean it first.")
    n_test = int(round(test_fraction * n))
    n_train = n - n_test
    if n_test < 1 or n_train < clients:
        raise DataError(
            f"Dataset {name!r} has {n} samples: too few for a {test_fraction:.0%} test split and "
            f"{clients} non-empty shards."
        )
    target_scale = 1.0 if classes else float(np.max(np.abs(y)))
    if target_scale == 0:
        raise DataError(
            f"Dataset {name!r}: every target is 0, so the target cannot be scaled by max|y|.")
    perm = np.random.default_rng(np.random.SeedSequence(split_seed,
                                                        spawn_key=(0x5B117,))).permutation(n)
    test, train = perm[:n_test], perm[n_test:]
    available = None
    if train_samples is not None:
        available = len(train)
        train = train[subsample(available, train_samples, subsample_seed, name=name,
                                clients=clients)]
    if standardise is None:
        standardise = name not in PRESCALED
    if standardise:
        mean, std = x[train].mean(axis=0), x[train].std(axis=0)
        std = np.where(std > 0, std, 1.0)
    else:
        # a constant column stays 0 after centring
        mean, std = np.zeros(x.shape[1]), np.ones(x.shape[1])
    spec = dict(partitioner or {})
    if spec.get("name", "iid") != "iid":  # shard p becomes the contiguous block of its rows
        try:
            parts = partition(y[train], clients, task="classification" if classes else "regression",
                              **spec)
        except PartitionError as exc:
            raise DataError(f"Dataset {name!r}: {exc}") from None
        train = train[np.concatenate(parts)]
    else:
        parts = partition(y[train], clients)
    bounds, start = [], 0
    for size in (len(s) for s in parts):
        bounds.append((start, start + size))
        start += size
    return PreparedData(
        name=name,
        x_train=(x[train] - mean) / std, y_train=y[train] / target_scale,
        x_test=(x[test] - mean) / std, y_test=y[test] / target_scale,
        shard_bounds=tuple(bounds), target_scale=target_scale,
        task="classification" if classes else "regression", classes=tuple(classes),
        feature_mean=mean, feature_std=std, train_available=available,
        subsample_seed=None if available is None else subsample_seed,
    )


def subsample(available: int, train_samples: int, seed: int, *, name: str = "dataset",
              clients: int = 1) -> np.ndarray:
    """Positions (ascending) of ``train_samples`` of ``available`` train records: a uniform random
    subset.

    The subset is the first ``train_samples`` entries of one permutation drawn from ``seed`` (so the
    subsets of one seed are nested), sorted, so that the kept records stay in the train split's
    (already random) order.
    """
    if isinstance(train_samples, bool) or not isinstance(train_samples, (int, np.integer)):
        raise DataError(
            f"`dataset.train_samples` must be an integer (records of the train split to keep). "
                        f"Found {train_samples!r}.")
    if train_samples < clients:
        raise DataError(
            f"`dataset.train_samples` = {train_samples} leaves too few training records for "
            f"{clients} clients: every client needs at least one. Keep at least {clients} records.")
    if train_samples > available:
        raise DataError(
            f"`dataset.train_samples` = {train_samples} is more than the {available} records in "
            f"the train split of dataset {name!r}. Use at most {available}, or null to keep them "
            f"all.")
    rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(0x5AB5E7,)))
    return np.sort(rng.permutation(available)[:train_samples])
