"""The two sides of a DIFF2 run without any transport, and how to build them from a config.

:class:`Diff2Server` (:mod:`~diff2_flwr.runtime.server`) is the trusted server: its pure core
(:mod:`~diff2_flwr.runtime.server_core`) plans each round, checks and averages the workers' replies
(failing closed), adds the noise, steps the estimator and keeps the privacy ledger; its journal
(:mod:`~diff2_flwr.runtime.journal`) evaluates and records. :class:`Worker` is one data owner: its
shard and the per-sample gradient machinery. The Flower Strategy and NumPyClient are thin wrappers
around these two; an in-process driver makes the same calls in the same order.

This module builds the server of a config (:func:`build_server`, after :func:`preflight`) and is the
one place to import the run's pieces from: :mod:`~diff2_flwr.runtime.workers` (:class:`Worker`,
:func:`make_worker`), :mod:`~diff2_flwr.runtime.server_setup` (:func:`make_server` from plain
arguments), :mod:`~diff2_flwr.runtime.loading` (a config's data and workers: :func:`load_data`,
:func:`build_worker`) and :mod:`~diff2_flwr.runtime.preflight_checks` (:func:`preflight`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

from ..core.estimator import Diverged
from ..core.gradients import PerSampleGradients
from ..task.evaluation import Evaluator
from ..task.losses import get_loss
from .config import ExperimentConfig
from .loading import build_worker, initial_parameters, load_data, model_of, subsample_info
from .preflight_checks import Preflight, PreflightError, preflight
from .server import Diff2Server
from .server_core import check_mechanism
from .server_setup import make_server
from .workers import Worker, compute_dtype, make_worker

__all__ = ["Diff2Server", "Worker", "Diverged", "Preflight", "PreflightError", "check_mechanism",
           "load_data",
           "make_server", "make_worker", "preflight", "build_server", "build_worker",
           "initial_parameters",
           "subsample_info"]


def _gradients(cfg: ExperimentConfig, num_features: int, num_outputs: int) -> PerSampleGradients:
    model = model_of(cfg, num_features, num_outputs)
    return PerSampleGradients(model, get_loss(cfg.loss),
                              dtype=compute_dtype(cfg.training.dtype, model))


def build_server(
    cfg: ExperimentConfig, *, output_root: str | Path | None = None, record: bool = True,
    progress: Callable[[str], None] | None = print, checked: Preflight | None = None,
) -> Diff2Server:
    """The server of ``cfg``: calibration from the data's n_min, x_0, evaluator, run folder.

    :func:`preflight` first (or ``checked``, its result for this very ``cfg``): every mistake it can
    find is raised before anything is written. With ``dataset.shards`` (a deployment) the server
    reads only ``server.npz`` there: the test split and the shard sizes, no training sample (so no
    train metrics).
    """
    pre = preflight(cfg) if checked is None else checked
    data, n_min, gradients = pre.data, pre.n_min, pre.gradients
    if progress:
        for line in pre.lines:
            progress(line)
    evaluate_fn = None
    if cfg.evaluation.train_metrics or cfg.evaluation.test_metrics:
        evaluator = Evaluator.of(gradients, data, train_metrics=cfg.evaluation.train_metrics,
                                 test_metrics=cfg.evaluation.test_metrics)
        evaluate_fn = lambda arrays: evaluator(gradients.layout.flatten(arrays))  # noqa: E731
    run_info: dict[str, Any] = {
        "name": cfg.name, "method": cfg.method, "config_file": cfg.source, "config": cfg.to_dict(),
        "dataset": {"name": data.name, "train": sum(data.shard_sizes),
                    "test": int(data.x_test.shape[0]),
                    "shard_sizes": list(data.shard_sizes), **subsample_info(cfg, data),
                    "partitioner": cfg.dataset.partitioner.describe(
                        cfg.dataset.split_seed, cfg.dataset.task_kind, cfg.clients)}}
    if pre.noise is not None:
        run_info["noise_to_radius"] = pre.noise
    if pre.warnings:
        run_info["warnings"] = list(pre.warnings)
    for warning in pre.warnings:
        if progress:
            progress(f"[diff2] WARNING: {warning}")
    spec = dataclasses.replace(cfg, privacy=dataclasses.replace(cfg.privacy, n_min=n_min))
    return make_server(
        spec, model=model_of(cfg, data.num_features, data.num_outputs), evaluate_fn=evaluate_fn,
        output_dir=(output_root or cfg.output.dir) if record else None,
        checkpoint=cfg.output.checkpoint, progress=progress, run_info=run_info, source=cfg.source,
        section="privacy.",
    )
