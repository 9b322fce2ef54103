"""What a run of a config is made of, built from the config: its data after the paper's
preprocessing (:func:`load_data`, cached per process), its model and x_0, and its workers
(:func:`build_worker`, cached per process). Importable from :mod:`diff2_flwr.runtime.session` as
well.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from ..task.data import (
    CLASSIFICATION, DataError, PreparedData, load_classification, load_csv, load_raw, prepare,
)
from ..task.losses import get_loss
from ..task.models import build_model
from .config import ExperimentConfig
from .server_setup import initial_point
from .shard_files import read_shard
from .workers import Worker, make_worker

__all__ = ["build_worker", "initial_parameters", "load_data", "model_of", "subsample_info"]


@functools.lru_cache(maxsize=4)
def load_data(cfg: ExperimentConfig) -> PreparedData:
    """The dataset of ``cfg`` after the paper's preprocessing (cached per process)."""
    d = cfg.dataset
    classes: tuple[str, ...] = ()
    if d.name == "csv":
        assert d.path is not None and d.target is not None
        x, y, classes = load_csv(d.path, target=d.target, drop=d.drop, categorical=d.categorical,
                                 task=d.task_kind)
    elif d.name in CLASSIFICATION:
        x, y, classes = load_classification(d.name, data_dir=d.dir)
    else:
        x, y = load_raw(d.name, data_dir=d.dir, num_samples=d.num_samples,
                        num_features=d.num_features, seed=d.generator_seed)
    try:
        return prepare(d.name, x, y, clients=cfg.clients, test_fraction=d.test_fraction,
                       split_seed=d.split_seed, classes=classes,
                       partitioner=d.partitioner.arguments(d.split_seed, d.task_kind, cfg.clients),
                       standardise=d.standardise, train_samples=d.train_samples,
                       subsample_seed=d.subsample_seed)
    except DataError as exc:  # say which experiment file asked for it
        raise DataError(f"{cfg.source}: {exc}") from None


def subsample_info(cfg: ExperimentConfig, data: PreparedData) -> dict[str, Any]:
    """What a run or study reports of ``dataset.train_samples``: nothing without it, else the kept
    and available record counts and the seed (a deployment's server knows only the kept records: its
    shard sizes)."""
    d = cfg.dataset
    if d.train_samples is None:
        return {}
    return {"train_samples": d.train_samples, "subsample_seed": d.subsample_seed,
            "train_available": data.train_available}


def model_of(cfg: ExperimentConfig, num_features: int, num_outputs: int) -> torch.nn.Module:
    """The model of ``cfg`` (``model.name`` and its options) for these numbers of inputs and
    outputs."""
    m = cfg.model
    return build_model(m.name, in_features=num_features, out_features=num_outputs,
                       hidden=m.hidden_units, init_seed=m.init_seed, kwargs=m.kwargs.as_dict())


def initial_parameters(cfg: ExperimentConfig, data: PreparedData) -> np.ndarray:
    """x_0: the model's initial parameters as a flat float64 vector."""
    return initial_point(cfg.source, model_of(cfg, data.num_features, data.num_outputs), None)[1]


def _num_outputs(cfg: ExperimentConfig, classes: tuple[str, ...]) -> int:
    return len(classes) if cfg.dataset.task_kind == "classification" else 1


@functools.lru_cache(maxsize=64)
def build_worker(cfg: ExperimentConfig, partition_id: int, data_path: str | None = None) -> Worker:
    """Worker ``partition_id`` of ``cfg`` (cached per process: simulation actors serve many rounds).

    With ``data_path`` (a deployment) the worker reads only its own shard file (see
    :mod:`diff2_flwr.runtime.shard_files`); otherwise it prepares the whole dataset and takes its
    shard.
    """
    if data_path is not None:
        shard = read_shard(data_path, cfg, partition_id, cfg.clients)
        features, targets = shard.features, shard.targets
        num_outputs = _num_outputs(cfg, shard.classes)
    else:
        data = load_data(cfg)
        features, targets = data.shard(partition_id)
        num_outputs = data.num_outputs
    return make_worker(model=model_of(cfg, features.shape[1], num_outputs), loss=get_loss(cfg.loss),
                       data=(features, targets), partition_id=partition_id,
                       dtype=cfg.training.dtype, chunk_size=cfg.training.chunk_size,
                       memory_budget_mb=cfg.training.memory_budget_mb,
                       device=cfg.training.device,
                       gradients=cfg.training.gradients, _function=cfg.source)
