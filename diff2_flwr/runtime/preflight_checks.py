"""The checks before any transport: :func:`preflight` builds everything a run of a config needs that
no transport does (data, partition, calibration, model, one probe gradient) and raises the first
problem; its :class:`Preflight` is what :func:`~diff2_flwr.runtime.session.build_server` goes on
with. Importable from :mod:`diff2_flwr.runtime.session` as well.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from ..core.gradients import PerSampleGradients, check_per_sample_safe
from ..core.memory import MemoryRefusal
from ..core.privacy import Calibration
from ..task.data import PreparedData
from ..task.losses import get_loss
from .config import ConfigError, ExperimentConfig, argument_error
from .loading import load_data, model_of
from .noise_report import noise_summary, noise_warning
from .server_core import check_planned_budget
from .server_setup import initial_point
from .shard_files import SERVER_FILE, read_server_data
from .shard_report import check_shards, shard_lines
from .step_report import names_of
from .workers import compute_dtype, make_worker

__all__ = ["PROBE_RECORDS", "Preflight", "PreflightError", "preflight", "preflight_strategy",
           "privacy_warnings"]


def privacy_warnings(cfg: ExperimentConfig, n_train: int) -> list[str]:
    """What the run releases or assumes outside its (ε, δ) guarantee, said loudly."""
    out = []
    if cfg.evaluation.train_metrics:
        out.append(
            "evaluation.train_metrics is on: train_loss and grad_norm_sq are computed on the "
            "private training data without clipping or noise (train_accuracy too, for "
            "classification); they leak and are NOT covered by ε. Research only: set "
            "evaluation.train_metrics: false for anything deployed.")
    if cfg.private and cfg.privacy.delta >= 1 / n_train:
        out.append(
            f"privacy.delta = {cfg.privacy.delta:g} is not below 1/n = {1 / n_train:.3g} (n = "
            f"{n_train} training "
                   "records): a mechanism that publishes a random record in full would meet such "
                   "a δ. Choose δ ≪ 1/n.")
    return out


class PreflightError(ValueError):
    """The first problem of a run found before any transport; the message is one line (file or key,
    what was expected, what was found, what to do)."""


#: Records of the probe: one clipped per-sample gradient at x_0 through the workers' own code.
PROBE_RECORDS = 4


@dataclass(frozen=True)
class Preflight:
    """What a run of a config is built from, checked before any transport (see
    :func:`preflight`)."""

    # the dataset; in a deployment (dataset.shards) the server's test split and shard sizes
    data: PreparedData
    n_min: int
    calibration: Calibration | None  # None for method gd
    # the model (factory imported and called, layers checked) and its loss
    gradients: PerSampleGradients
    lines: tuple[str, ...]  # what is said before training: the shards, n_min and σ
    # what the run releases or assumes outside ε, and noise that drowns the signal
    warnings: tuple[str, ...]
    noise: dict[str, float | int] | None  # E‖noise‖ / C per kind of round (None for gd)


def _server_data(cfg: ExperimentConfig) -> PreparedData:
    """The data the server holds: the whole prepared dataset, or in a deployment only
    ``server.npz``."""
    if not cfg.dataset.shards:
        return load_data(cfg)
    sdata = read_server_data(Path(cfg.dataset.shards).expanduser() / SERVER_FILE, cfg)
    if len(sdata.shard_sizes) != cfg.clients:
        raise ValueError(f"{cfg.source}: the shards are for {len(sdata.shard_sizes)} workers, "
                         f"training.clients = {cfg.clients}.")
    return PreparedData(name=cfg.dataset.name, x_train=np.zeros((0, sdata.x_test.shape[1])),
                        y_train=np.zeros(0), x_test=sdata.x_test, y_test=sdata.y_test,
                        shard_bounds=tuple((0, n) for n in sdata.shard_sizes),
                        target_scale=sdata.target_scale, task=sdata.task, classes=sdata.classes)


def _probe(cfg: ExperimentConfig, data: PreparedData, model: torch.nn.Module) -> None:
    """One clipped per-sample gradient at x_0 on the first records the server holds, through a
    worker built as the workers build theirs: a forward that does not fit the data, or targets the
    loss cannot take, fail here."""
    # a simulation's clients compute on this machine: its device and memory are theirs
    here = bool(data.x_train.shape[0])
    if here:
        features, targets = data.shard(0)
        where = "training records of partition 0"
    else:  # a deployment's server holds the test split only
        features, targets = data.x_test, data.y_test
        where = "test records"
    k = min(PROBE_RECORDS, int(features.shape[0]))
    if k == 0:
        return
    x0 = initial_point(cfg.source, model, None)[1]
    try:
        worker = make_worker(model=model, loss=get_loss(cfg.loss),
                             data=(features[:k], targets[:k]), partition_id=0,
                             dtype=cfg.training.dtype, chunk_size=cfg.training.chunk_size,
                             memory_budget_mb=cfg.training.memory_budget_mb,
                             device=cfg.training.device if here else "cpu",
                             gradients=cfg.training.gradients, _plan_memory=here,
                             _function=cfg.source)
        records = worker.records  # in memory: a (features, targets) pair
        contribution = worker.gradients.clipped_mean(x0, records.features, records.targets, 1.0)
    except MemoryRefusal as err:  # the model does not fit this machine's budget
        raise PreflightError(f"{cfg.source}: {err}") from None
    except Exception as err:  # noqa: BLE001 (the user's forward or loss: any error is the user's to fix)
        # the worker's own refusal of the forward carries the error it caught
        cause = (str(err.found) if isinstance(err, ConfigError) and err.key == "model" else
                 f"{type(err).__name__}: {' '.join(str(err).split())}")
        raise PreflightError(
            f"{cfg.source}: the model (model.name {cfg.model.name}) and loss {cfg.loss} fail on "
            f"the first {k} {where} at x_0: {cause}. "
            f"The model is called on features of shape [n, {data.num_features}] and must return "
            f"[n, {data.num_outputs}] outputs; "
            + ("cross_entropy takes integer class indices as targets."
               if cfg.loss == "cross_entropy" else
               "half_squared_error takes one real target per record.")) from None
    if contribution.overflow:
        raise PreflightError(
            f"{cfg.source}: the per-sample gradients at x_0 are not finite on the first {k} "
            f"{where}; "
                             "check the model's initialisation (model.init_seed, the factory) and "
                             "the data's scale.")


def _checked_gradients(cfg: ExperimentConfig, data: PreparedData) -> PerSampleGradients:
    """The model (factory imported and called) and its per-sample gradients; a refusal names the
    file and key."""
    try:
        model = model_of(cfg, data.num_features, data.num_outputs)
    except ValueError as err:
        raise PreflightError(f"{cfg.source}: {err}") from None
    try:
        check_per_sample_safe(model)
    except ValueError as err:
        raise PreflightError(
            f"{cfg.source}: key `model.name`: the model {cfg.model.name!r} cannot be trained "
                             f"privately: {err}") from None
    return PerSampleGradients(model, get_loss(cfg.loss),
                              dtype=compute_dtype(cfg.training.dtype, model))


def preflight(cfg: ExperimentConfig) -> Preflight:
    """Build and check everything a run of ``cfg`` needs that no transport does, and raise the first
    problem.

    In order: the data (files, columns, values, target), the partition (shard sizes, n_min,
    ``privacy.n_min``), the local routine's limits (``local.batch_size`` <= n_min), the calibration
    (σ above ``privacy.max_sigma``, the planned ε), the model (factory imported and
    called, a ``torch.nn.Module`` without batch-norm, finite x_0) and one clipped per-sample
    gradient at x_0 on a few records. Each problem is a ``ValueError`` (``DataError``,
    ``ConfigError``, :class:`PreflightError`, ...) whose message names the file or key, what was
    expected and what was found. Both engines of ``diff2 run`` and the ServerApp call it first
    (:func:`build_server` does); it writes nothing. The returned :class:`Preflight` holds what
    :func:`build_server` goes on with, what to say before training and the estimate of the noise
    against the clipping radius (:mod:`~diff2_flwr.runtime.noise_report`).
    """
    data = _server_data(cfg)
    # an empty (or too small) shard: refused before any calibration
    check_shards(cfg, data.shard_sizes)
    n_min = cfg.privacy.n_min or data.n_min
    if n_min > data.n_min:
        raise ValueError(
            f"{cfg.source}: key `privacy.n_min` = {n_min} but the smallest shard has {data.n_min} "
            f"samples; "
            "the noise would be calibrated for a smaller sensitivity than the real one."
        )
    if cfg.local.enabled and cfg.local.batch_size > n_min:
        raise ConfigError(
            f"{cfg.source}: key `local.batch_size`: expected at most n_min = {n_min} (the "
            f"smallest shard: every worker samples each record with probability b / n_p <= 1). "
            f"Found {cfg.local.batch_size}.",
                          key="local.batch_size", expected=f"an integer <= {n_min}",
                          found=cfg.local.batch_size)
    # make_server calibrates the same way; here for the checks and the report
    calibration = cfg.calibration(n_min)
    check_shards(cfg, data.shard_sizes, calibration)
    if calibration is not None:
        check_planned_budget(calibration, cfg.source, "privacy.")
    gradients = _checked_gradients(cfg, data)
    initial_point(cfg.source, gradients.model, None)  # parameters to train, finite
    # the bits, P, t and the budget, as make_server will build them
    if cfg.private and cfg.privacy.distributed:
        try:
            cfg.distributed_noise(n_min, gradients.layout.dim)
        except ValueError as err:
            raise ConfigError(f"{cfg.source}: privacy.noise: distributed: {err}",
                              key="privacy.bits", expected="settings the secure sum can hold",
                              found=cfg.privacy.bits) from None
    _probe(cfg, data, model_of(cfg, data.num_features, data.num_outputs))
    warnings = privacy_warnings(cfg, n_train=sum(data.shard_sizes))
    noise = None
    if calibration is not None:
        noise = noise_summary(calibration, gradients.layout.dim)
        drowned = noise_warning(calibration, gradients.layout.dim)
        if drowned:
            warnings.append(drowned)
    lines = shard_lines(cfg, data.shard_sizes, n_min, calibration, available=data.train_available)
    return Preflight(data, n_min, calibration, gradients, tuple(lines), tuple(warnings), noise)


# ------------------------------------------------------------------ the Python API's pre-flight

def preflight_strategy(spec: ExperimentConfig, model: torch.nn.Module | None,
                       initial_parameters: Any, source: str,
                       progress: Callable[[str], None] | None) -> tuple[str, ...]:
    """The checks of :func:`preflight` that a strategy's arguments allow, for the Python API
    (``source``: the function called): x_0's model without batch-norm, σ at most ``max_sigma``, the
    planned ε, and the noise estimate said through ``progress``. Raises a ``ConfigError`` whose one
    line names the API's arguments; returns the warnings (the noise drowning the signal)."""
    if model is not None:
        try:
            check_per_sample_safe(model)
        except ValueError as err:
            raise argument_error(source, "model",
                                 "a model whose samples do not mix within a batch (no batch-norm)",
                                 " ".join(str(err).split())) from None
    layout = initial_point(source, model, initial_parameters)[0]
    if spec.privacy.n_min is None:  # make_server says what n_min must be
        return ()
    calibration = spec.calibration(spec.privacy.n_min)
    if calibration is None:
        return ()
    check_planned_budget(calibration, source, "")
    _check_sigma(calibration, spec.privacy.max_sigma, source)
    ratios = noise_summary(calibration, layout.dim)
    if progress:
        progress(f"[diff2] pre-flight: expected noise norm per release / clipping radius: "
                 f"{ratios['restart']:.3g} in restart rounds"
                 + (f", {ratios['difference']:.3g} in difference rounds"
                    if "difference" in ratios else "")
                 + f" (d = {layout.dim} parameters; above {ratios['limit']:g} the noise drowns "
                   "the signal)")
    drowned = noise_warning(calibration, layout.dim, names_of(spec))
    if drowned and progress:
        progress(f"[diff2] WARNING: {drowned}")
    return (drowned,) if drowned else ()


def _check_sigma(calibration: Calibration, max_sigma: float | None, source: str) -> None:
    """Refuse a calibration whose per-coordinate σ exceeds ``max_sigma``, naming the API's
    arguments (the YAML path's check is :func:`~.shard_report.check_shards`)."""
    worst = max(calibration.sigma1, calibration.sigma2 or 0.0)
    if max_sigma is None or worst <= max_sigma:
        return
    sigmas = f"σ1 = {calibration.sigma1:.4g}" + (
        f", σ2 = {calibration.sigma2:.4g}" if calibration.sigma2 is not None else "")
    raise ConfigError(
        f"{source}: epsilon = {calibration.epsilon:g} (delta = {calibration.delta:g}, rounds = "
        f"{calibration.rounds}, restart_every = {calibration.restart_every}, clients = "
        f"{calibration.clients}, n_min = {calibration.n_min}) gives {sigmas} per coordinate "
        f"(σ = 2z/(n_min·clients)): above {max_sigma:g}, each coordinate's noise would exceed the "
        "clipping radius, the bound on the whole averaged signal, and training would not learn. "
        "Raise epsilon or n_min (more records per client), or lower rounds; or pass max_sigma=None "
        "(no limit: the (ε, δ) guarantee is the same) to run anyway.",
        key="epsilon", expected=f"a budget that gives σ <= {max_sigma:g}",
        found=calibration.epsilon)
