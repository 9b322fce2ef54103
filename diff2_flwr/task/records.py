"""A worker's records: in-memory tensors, or a ``torch.utils.data.Dataset`` read in chunks.

A worker reads every one of its records exactly once per round (ClippedMean is over the whole
shard, n_p of them). Tensors are cut into chunks by the per-sample gradient code; a ``Dataset``
is read here, ``chunk_size`` records at a time and in index order, so that a shard larger
than memory never becomes one batch. Floating-point features and targets are cast to the
compute dtype; integer ones (class indices, token ids) are kept as they are.

References:
    Murata & Suzuki (2023), Algorithm 1 (worker lines: ClippedMean over the worker's n_p records).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

__all__ = ["TensorRecords", "DatasetRecords", "as_records"]


def _cast(value: Any, dtype: torch.dtype, what: str) -> torch.Tensor:
    tensor = torch.as_tensor(value)
    if tensor.dtype == torch.bool or tensor.is_complex():
        raise ValueError(
            f"The {what} are {tensor.dtype}; expected real numbers (floating point, or integer "
            f"indices).")
    return tensor.to(dtype) if tensor.is_floating_point() else tensor


@dataclass(frozen=True)
class TensorRecords:
    """Records held as two tensors: ``features[n, ...]`` and ``targets[n, ...]``."""

    features: torch.Tensor
    targets: torch.Tensor

    def __post_init__(self) -> None:
        if self.features.ndim == 0 or self.targets.ndim == 0:
            raise ValueError(
                "`data` = (features, targets) must hold one row per record; found a scalar.")
        if self.features.shape[0] != self.targets.shape[0]:
            raise ValueError(f"`data` = (features, targets) must have one target per record. "
                             f"Found {self.features.shape[0]} feature rows and "
                             f"{self.targets.shape[0]} targets.")

    @classmethod
    def of(cls, features: Any, targets: Any, dtype: torch.dtype) -> "TensorRecords":
        """Records from tensors or arrays: floating-point ones cast to ``dtype``, integers kept."""
        return cls(_cast(features, dtype, "features"), _cast(targets, dtype, "targets"))

    @property
    def num_samples(self) -> int:
        """n_p: the number of records."""
        return int(self.features.shape[0])


@dataclass(frozen=True)
class DatasetRecords:
    """Records of a map-style ``Dataset`` whose item ``i`` is ``(features_i, target_i)``, read in
    chunks."""

    dataset: Dataset
    dtype: torch.dtype
    chunk_size: int
    #: called on each chunk's targets with the index of its first record (raises to refuse them):
    #: the worker's check that its loss can take them (class labels for cross-entropy)
    check_targets: Callable[[torch.Tensor, int], None] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.dataset, IterableDataset) or not hasattr(self.dataset, "__len__"):
            raise ValueError(
                f"`data` is a {type(self.dataset).__name__} without a length: a worker must know "
                f"n_p "
                             "(its number of records) and read each record once per round. Pass a "
                             "map-style "
                             "Dataset (with __len__ and __getitem__) or (features, targets) "
                             "tensors.")
        if self.chunk_size < 1:
            raise ValueError(f"`chunk_size` must be an integer >= 1. Found {self.chunk_size!r}.")

    @property
    def num_samples(self) -> int:
        """n_p: the number of records, the dataset's ``len()``."""
        return len(self.dataset)  # type: ignore[arg-type]

    def chunks(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(features, targets) of ``chunk_size`` records at a time, in index order, each record
        once."""
        loader = DataLoader(self.dataset, batch_size=self.chunk_size, shuffle=False,
                            drop_last=False)
        read = 0
        for batch in loader:
            if not isinstance(batch, (list, tuple)) or len(batch) != 2:
                raise ValueError(
                    f"Each item of the Dataset must be a pair (features, target). Found a batch of "
                                 f"type {type(batch).__name__}" + (f" with {len(batch)} parts"
                                                                   if isinstance(
                                     batch, (list,
                                             tuple))
                                             else "") + ": wrap the dataset so that it returns "
                                                        "pairs.")
            features, targets = _cast(batch[0], self.dtype, "features"), _cast(batch[1], self.dtype,
                                                                               "targets")
            if features.shape[0] != targets.shape[0]:
                raise ValueError(f"A chunk of the Dataset has {features.shape[0]} feature rows "
                                 f"but {targets.shape[0]} targets: each item must be one "
                                 f"(features, target) pair.")
            if self.check_targets is not None:
                self.check_targets(targets, read)
            read += int(features.shape[0])
            yield features, targets
        if read != self.num_samples:
            raise ValueError(
                f"The Dataset says it holds {self.num_samples} records but {read} were read: "
                             "its __len__ and __getitem__ disagree.")


def as_records(data: Any, *, dtype: torch.dtype, chunk_size: int) -> TensorRecords | DatasetRecords:
    """A worker's ``data`` as records: a pair ``(features, targets)`` of tensors or arrays, or a
    ``Dataset``."""
    if isinstance(data, DataLoader):
        raise ValueError(
            "`data` is a DataLoader; pass its dataset (`loader.dataset`). DIFF2 reads every "
            "record exactly once per round, in chunks of `chunk_size`: a loader's sampler, "
            "shuffling or drop_last would change which records count and break n_p.")
    if isinstance(data, Dataset):
        return DatasetRecords(data, dtype, chunk_size)
    if isinstance(data, (tuple, list)) and len(data) == 2:
        features, targets = data
        if isinstance(features, (torch.Tensor, np.ndarray)) and isinstance(targets, (torch.Tensor,
                                                                                     np.ndarray)):
            return TensorRecords.of(features, targets, dtype)
    raise ValueError(
        f"`data` must be a pair (features, targets) of tensors or numpy arrays, or a map-style "
        f"torch.utils.data.Dataset of (features, target) pairs. Found {type(data).__name__}.")
