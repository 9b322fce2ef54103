"""Cutting the train split into P shards: IID (the paper's), or non-IID through Flower Datasets.

``iid`` cuts the shuffled train split into P contiguous shards whose sizes differ by at most
one (the paper's preparation; no extra package). Every other partitioner is the Flower
Datasets (``flwr-datasets``) partitioner of the same name, run on an in-memory
``datasets.Dataset`` of the partition column only (features never leave NumPy):

- ``dirichlet``: :class:`~flwr_datasets.partitioner.DirichletPartitioner` (label skew, α);
- ``pathological``: :class:`~flwr_datasets.partitioner.PathologicalPartitioner` (k classes per
  client);
- ``linear``, ``square``, ``exponential``: size skew, shard p gets a share ∝ p, p², e^p
  (p = 1..P) of the train split (:class:`LinearPartitioner` etc.);
- ``size``: :class:`~flwr_datasets.partitioner.SizePartitioner`, the shard sizes given outright.

Label-based partitioners read the class index for classification; for regression they read
the target cut into ``bins`` quantile bins of the train split (default: one per client, at least
2; bin edges at the j/bins quantiles of the train targets, j = 1..bins-1; tied edges merge, so
a target with many ties may give fewer bins). Everything is deterministic given ``seed``; the test
split is cut before and never seen here.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

__all__ = ["PARTITIONERS", "LABEL_PARTITIONERS", "SIZE_FUNCTIONS", "PartitionError", "partition",
           "quantile_bins",
           "INSTALL_HINT"]

PARTITIONERS = ("iid", "dirichlet", "pathological", "size", "linear", "square", "exponential")
LABEL_PARTITIONERS = ("dirichlet", "pathological")
#: shard p (p = 1..P) of the size-skewed partitioners gets a share ∝ f(p) (Flower's
#: IdToSizeFncPartitioner).
SIZE_FUNCTIONS = {"linear": lambda p: p, "square": np.square, "exponential": np.exp}
INSTALL_HINT = ("non-IID partitioners need Flower Datasets: pip install 'diff2-flwr[partitions]' "
                "(or pip install flwr-datasets); scripts/setup.sh installs it")


class PartitionError(ValueError):
    """A partition that cannot be made as configured; the message names the key and the numbers."""


def quantile_bins(y: np.ndarray, bins: int) -> np.ndarray:
    """Bin index (0..k-1, k <= ``bins``) of each target: edges at the j/bins quantiles of ``y``."""
    edges = np.unique(np.quantile(y, np.arange(1, bins) / bins))
    return np.searchsorted(edges, y, side="right")


def _iid(n: int, clients: int) -> list[np.ndarray]:
    return np.array_split(np.arange(n), clients)


def _flower(name: str, column: np.ndarray, clients: int, **params: Any) -> list[np.ndarray]:
    try:
        from datasets import Dataset  # noqa: PLC0415 -- optional extra (partitions)
        from flwr_datasets import partitioner as fp  # noqa: PLC0415 -- optional extra (partitions)
    except ImportError as exc:
        raise PartitionError(
            f"`dataset.partitioner.name: {name}`: {INSTALL_HINT} ({exc}).") from None
    builders = {
        "dirichlet": lambda: fp.DirichletPartitioner(num_partitions=clients, partition_by="label",
                                                     **params),
        "pathological": lambda: fp.PathologicalPartitioner(num_partitions=clients,
                                                           partition_by="label", **params),
        "linear": lambda: fp.LinearPartitioner(clients),
        "square": lambda: fp.SquarePartitioner(clients),
        "exponential": lambda: fp.ExponentialPartitioner(clients),
        "size": lambda: fp.SizePartitioner(list(params["partition_sizes"])),
    }
    part = builders[name]()
    # The row number rides along, so each partition's rows are read back through the public API.
    part.dataset = Dataset.from_dict({"label": column, "row": np.arange(len(column))})
    with warnings.catch_warnings():
        # Dirichlet's resampling notes; the outcome is checked below
        warnings.simplefilter("ignore")
        return [np.asarray(part.load_partition(p)["row"], dtype=np.int64) for p in range(clients)]


def partition(  # noqa: PLR0913 -- keyword-only: dataset.partitioner's keys (and task), one each
    y: np.ndarray, clients: int, *, name: str = "iid", task: str = "regression", seed: int = 0,
    alpha: float | None = None, min_partition_size: int = 10, self_balancing: bool = False,
    classes_per_client: int | None = None, class_assignment: str = "first-deterministic",
    bins: int | None = None, sizes: tuple[int, ...] = (),
) -> list[np.ndarray]:
    """Indices into the train split (``y``: its targets, class indices for classification) of each
    shard.

    The shards are disjoint and cover every train sample exactly once; a partitioner that would drop
    samples (a class no client gets) is refused. ``iid`` is ``np.array_split`` of ``arange(n)``.
    """
    n = len(y)
    if name == "iid":
        return _iid(n, clients)
    if name not in PARTITIONERS:
        raise PartitionError(
            f"`dataset.partitioner.name`: expected one of {list(PARTITIONERS)}. Found {name!r}.")
    key = f"`dataset.partitioner` ({name})"
    if name in LABEL_PARTITIONERS:
        column, params = _label_column_and_params(
            y, clients, name=name, key=key, task=task, seed=seed, alpha=alpha,
            min_partition_size=min_partition_size, self_balancing=self_balancing,
            classes_per_client=classes_per_client, class_assignment=class_assignment, bins=bins)
    else:
        column = np.zeros(n, dtype=np.int64)
        params = _size_params(n, clients, name=name, key=key, sizes=sizes)
    try:
        parts = _flower(name, column, clients, **params)
    except PartitionError:
        raise
    # Flower's own refusal (e.g. Dirichlet's min_partition_size never met)
    except ValueError as exc:
        raise PartitionError(
            f"{key} with {params or 'defaults'} on {n} train samples, {clients} clients: "
                             f"Flower Datasets refused: {exc}") from None
    _check_every_sample_placed(parts, column, key=key, class_assignment=class_assignment)
    return parts


def _label_column_and_params(  # noqa: PLR0913 -- partition()'s label keys, passed through
    y: np.ndarray, clients: int, *, name: str, key: str, task: str, seed: int,
    alpha: float | None, min_partition_size: int, self_balancing: bool,
    classes_per_client: int | None, class_assignment: str, bins: int | None,
) -> tuple[np.ndarray, dict[str, Any]]:
    """The column a label-based partitioner reads (class indices, or quantile bins of a real
    target) and the Flower partitioner's arguments, checked."""
    if task == "classification":
        column = np.asarray(y).astype(np.int64)
    else:
        column = quantile_bins(np.asarray(y, dtype=np.float64), bins or max(clients, 2))
    found = np.unique(column)
    if name == "dirichlet":
        if alpha is None or not alpha > 0:
            raise PartitionError(f"{key}: `alpha` must be a number > 0. Found {alpha!r}.")
        params: dict[str, Any] = {"alpha": float(alpha), "min_partition_size": min_partition_size,
                                  "self_balancing": self_balancing, "seed": seed}
    else:
        what = ("classes" if task == "classification"
                else f"non-empty target bins (of {bins or max(clients, 2)} quantile bins)")
        if classes_per_client is None or not 1 <= classes_per_client <= len(found):
            raise PartitionError(
                f"{key}: `classes_per_client` must be in 1..{len(found)}: the train split has "
                                 f"{len(found)} {what}. Found {classes_per_client!r}.")
        params = {"num_classes_per_partition": classes_per_client,
                  "class_assignment_mode": class_assignment,
                  "seed": seed}
    return column, params


def _size_params(n: int, clients: int, *, name: str, key: str,
                 sizes: tuple[int, ...]) -> dict[str, Any]:
    """The arguments of a size-skewed Flower partitioner, checked: no shard may be empty."""
    params: dict[str, Any] = {}
    if name == "size":
        if len(sizes) != clients or sum(sizes) != n or min(sizes, default=0) < 1:
            raise PartitionError(
                f"{key}: `sizes` must list {clients} shard sizes (training.clients), each >= 1, "
                f"summing to the {n} samples of the train split. Found {list(sizes)} (sum "
                f"{sum(sizes)}).")
        params = {"partition_sizes": tuple(int(s) for s in sizes)}
    else:
        shares = SIZE_FUNCTIONS[name](np.arange(1, clients + 1, dtype=np.float64))
        planned = (shares / shares.sum() * n).astype(np.int64)
        planned[-1] += n - planned.sum()  # Flower gives the rounding remainder to the last shard
        if planned.min() < 1:
            raise PartitionError(
                f"{key}: {n} train samples in {clients} shards with sizes ∝ {name}(p) leave "
                f"shard(s) "
                f"{[int(p) for p in np.flatnonzero(planned < 1)]} empty (sizes "
                f"{planned.tolist()}). Use fewer "
                "clients, more data, or a milder size skew (linear or square).")
    return params


def _check_every_sample_placed(parts: list[np.ndarray], column: np.ndarray, *, key: str,
                               class_assignment: str) -> None:
    """Refuse shards that are not disjoint or leave a train sample on no client."""
    n = len(column)
    placed = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    if len(placed) != n or len(np.unique(placed)) != n:
        left = np.setdiff1d(np.arange(n), placed)
        lost = sorted({int(c) for c in column[left]})
        raise PartitionError(
            f"{key}: {len(left)} of the {n} train samples are on no client (labels {lost} were "
            f"assigned to no "
            f"client with class_assignment {class_assignment!r}). Raise `classes_per_client`, use "
            "`class_assignment: first-deterministic` or `deterministic` with at least as many "
            "clients as classes, "
            "or fewer bins.")
