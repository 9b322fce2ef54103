"""The two sides of a DIFF2 run without any transport, and how to build them from a config.

:class:`Diff2Server` (:mod:`~diff2_flwr.runtime.server`) is the trusted server: its pure core
(:mod:`~diff2_flwr.runtime.server_core`) plans each round, checks and averages the workers' replies
(failing closed), adds the noise, steps the estimator and keeps the privacy ledger; its journal
(:mod:`~diff2_flwr.runtime.journal`) evaluates and records. :class:`Worker` is one data owner: its shard
and the per-sample gradient machinery. The Flower Strategy and NumPyClient are thin wrappers around
these two; an in-process driver makes the same calls in the same order.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from ..core.aggregation import Reply
from ..core.estimator import Diverged, RoundPlan
from ..core.local import LocalTask, run_local_phase
from ..core.closed_form import PaperMLPGradients
from ..core.gradients import Contribution, LossFn, PerSampleGradients, check_per_sample_safe
from ..core.layout import ParameterLayout
from ..core.privacy import Calibration
from ..task.data import CLASSIFICATION, DataError, PreparedData, load_classification, load_csv, load_raw, prepare
from ..task.evaluation import Evaluator
from ..task.losses import LOSSES, get_loss, half_squared_error
from ..task.models import PaperMLP, build_model
from ..task.records import DatasetRecords, TensorRecords, as_records
from .checkpoint import Checkpoint, config_fingerprint, legacy_config_fingerprint, load_checkpoint
from .config import ConfigError, ExperimentConfig, TrainingConfig, argument_error, from_arguments
from .noise_report import noise_summary, noise_warning
from .outputs import RunRecorder, new_run_dir
from .server import Diff2Server
from .server_core import check_mechanism, check_planned_budget
from .shard_report import check_shards, shard_lines

__all__ = ["Diff2Server", "Worker", "Diverged", "Preflight", "PreflightError", "check_mechanism", "load_data",
           "make_server", "make_worker", "preflight", "build_server", "build_worker"]


CLIP_STATS_WARNING = ("evaluation.clip_stats is on: each round's clip_fraction (the share of the private training "
                      "records whose gradient or gradient difference was clipped) is counted on the private data "
                      "without noise; it leaks and is NOT covered by ε. Research only: set evaluation.clip_stats: "
                      "false for anything deployed.")
SEED_WARNING = ("training.seed is set, so the noise is reproducible by anyone who knows the seed; use seeds for "
                "research only. The seed is the noise key: whoever knows it (from the config, the run config, the "
                "summary or the checkpoint) can subtract the noise from the released iterates.")


@dataclass(frozen=True)
class Worker:
    """One worker (data owner): its records and the per-sample gradient machinery."""

    partition_id: int
    gradients: PerSampleGradients | PaperMLPGradients
    records: TensorRecords | DatasetRecords

    @property
    def num_samples(self) -> int:
        return self.records.num_samples

    @property
    def features(self) -> torch.Tensor:
        """The features of in-memory records (a Dataset is only ever read in chunks)."""
        if not isinstance(self.records, TensorRecords):
            raise AttributeError("This worker reads a Dataset in chunks; it holds no features tensor.")
        return self.records.features

    @property
    def targets(self) -> torch.Tensor:
        """The targets of in-memory records."""
        if not isinstance(self.records, TensorRecords):
            raise AttributeError("This worker reads a Dataset in chunks; it holds no targets tensor.")
        return self.records.targets

    def contribute(self, radius: float, x_current: np.ndarray, x_previous: np.ndarray | None) -> Contribution:
        """ClippedMean of per-sample gradients (x_previous None) or of gradient differences."""
        if isinstance(self.records, TensorRecords):
            return self.gradients.clipped_mean(x_current, self.records.features, self.records.targets, radius,
                                               x_previous)
        return self.gradients.clipped_mean_of(x_current, self.records.chunks(), radius, x_previous)

    def reply(self, plan: RoundPlan) -> Reply:
        """This worker's reply to ``plan`` exactly as the wire carries it (one float64 array per tensor)."""
        c = self.contribute(plan.radius, plan.x_current, plan.x_previous)
        return Reply(client=f"partition {self.partition_id}", partition_id=self.partition_id,
                     arrays=self.gradients.layout.split(c.mean), num_samples=c.num_samples, num_clipped=c.num_clipped,
                     overflow=c.overflow)

    def local_phase(self, task: LocalTask) -> Reply:
        """The private local steps of the local routine (:mod:`diff2_flwr.core.local`) on this shard: y_K as a reply.

        The worker checks what it receives (its partition, shapes, finiteness, b <= n_p) before touching data.
        """
        if task.partition_id != self.partition_id:
            raise ValueError(f"The local task is for partition {task.partition_id}; this worker is partition "
                             f"{self.partition_id}.")
        if task.x_start.shape != (self.gradients.layout.dim,):
            raise ValueError(f"The local task's x_(r-1) has shape {task.x_start.shape}; the model has "
                             f"{self.gradients.layout.dim} parameters.")
        if not isinstance(self.records, TensorRecords):
            raise ValueError("The local routine needs the shard in memory (features and targets tensors); this worker "
                             "reads a Dataset in chunks.")
        features, targets = self.records.features, self.records.targets

        def clipped_sum(y: np.ndarray, y_prev: np.ndarray, batch: np.ndarray, radius: float) -> tuple[np.ndarray, int, bool]:
            index = torch.from_numpy(batch)
            c = self.gradients.clipped_mean(y, features[index], targets[index], radius, y_prev)
            return c.mean * batch.size, c.num_clipped, c.overflow

        result = run_local_phase(task, self.num_samples, clipped_sum)
        return Reply(client=f"partition {self.partition_id}", partition_id=self.partition_id,
                     arrays=self.gradients.layout.split(result.y), num_samples=self.num_samples,
                     num_clipped=result.num_clipped, overflow=result.overflow)


# -------------------------------------------------------------------- from plain arguments (the Python API)

_DTYPES = {"float64": torch.float64, "float32": torch.float32}


def _initial_point(function: str, model: torch.nn.Module | None,
                   initial_parameters: Sequence[np.ndarray] | None) -> tuple[ParameterLayout, np.ndarray]:
    """x_0 and its layout from a model (its trainable parameters) or from per-tensor arrays."""
    if (model is None) == (initial_parameters is None):
        raise ConfigError(f"{function}: give exactly one of `model` (a torch.nn.Module: x_0 is its parameters) and "
                          "`initial_parameters` (x_0 as a list of arrays, one per model tensor). Found "
                          f"{'both' if model is not None else 'neither'}.")
    if model is not None:
        if not isinstance(model, torch.nn.Module):
            raise argument_error(function, "model", "a torch.nn.Module", type(model).__name__)
        layout = ParameterLayout.of(model)
        tensors = [p for _, p in model.named_parameters() if p.requires_grad]
        x0 = np.concatenate([p.detach().to(torch.float64).reshape(-1).numpy() for p in tensors]) if tensors else np.zeros(0)
    else:
        try:
            arrays = [np.asarray(a) for a in initial_parameters]  # type: ignore[union-attr]
        except TypeError:
            raise argument_error(function, "initial_parameters", "a list of numpy arrays (one per model tensor)",
                                  type(initial_parameters).__name__) from None
        if not all(np.issubdtype(a.dtype, np.floating) for a in arrays):
            raise argument_error(function, "initial_parameters", "floating-point arrays",
                                  [str(a.dtype) for a in arrays])
        layout = ParameterLayout(tuple(f"parameter_{i}" for i in range(len(arrays))), tuple(a.shape for a in arrays))
        x0 = layout.flatten(arrays)
    if layout.dim == 0:
        raise ConfigError(f"{function}: the model has no trainable parameters: there is nothing to train.")
    if not np.all(np.isfinite(x0)):
        raise ConfigError(f"{function}: x_0 (the initial parameters) has non-finite entries; initialise the model "
                          "with finite values.")
    return layout, x0


def make_server(
    spec: ExperimentConfig,
    *,
    model: torch.nn.Module | None = None,
    initial_parameters: Sequence[np.ndarray] | None = None,
    evaluate_fn: Callable[[list[np.ndarray]], Mapping[str, float]] | None = None,
    output_dir: str | Path | None = None,
    checkpoint: str | Path | None = None,
    progress: Callable[[str], None] | None = print,
    run_info: Mapping[str, Any] | None = None,
    source: str = "diff2_flwr.make_server",
    section: str = "",
) -> Diff2Server:
    """The trusted server of a DIFF2 run of ``spec`` (validated: :func:`~diff2_flwr.runtime.config.from_arguments`
    on the Python API's path, the experiment file on the YAML path); x_0 and what the server writes are given here.

    ``spec.privacy.n_min`` is the fewest records any client holds: the noise is calibrated for it and every reply
    with fewer is refused. x_0 is ``model``'s trainable parameters or ``initial_parameters`` (one array per tensor).
    ``evaluate_fn(arrays) -> {metric: value}`` evaluates each released iterate (every ``evaluation.every`` rounds,
    and always rounds 0 and R). With ``output_dir`` each round's row and a summary go into a new folder
    ``output_dir/<spec.name>-<time>-<random>``. With ``checkpoint`` the server's state is durable after every round, and
    an existing checkpoint of the same run is resumed. ``run_info``: extra fields of the summary; its ``"config"``
    (the experiment file, on the YAML path) also identifies the run for a checkpoint. Errors name ``source`` and
    the budget's keys with ``section`` (``"privacy."`` on the YAML path).

    References:
        Murata & Suzuki (2023), Algorithm 1 (server lines); Theorem 4.1 (the noise for (ε, δ)).
    """
    _check_server_arguments(spec, source, evaluate_fn)
    layout, x0 = _initial_point(source, model, initial_parameters)
    n_min = spec.privacy.n_min
    calibration = spec.calibration(n_min)
    if calibration is not None:
        check_planned_budget(calibration, source, section)
    evaluator = None
    if evaluate_fn is not None:
        def evaluator(x: np.ndarray) -> dict[str, float]:
            return {str(k): float(v) for k, v in evaluate_fn(layout.split(x)).items()}

    info = dict(run_info or {})
    info.setdefault("name", spec.name)
    info.setdefault("method", spec.method)
    described = info.get("config") or spec.to_dict()
    x0_hash = hashlib.sha256(x0.tobytes()).hexdigest()
    fingerprint, legacy = (hashlib.sha256((rule(described, n_min) + x0_hash).encode()).hexdigest()
                           for rule in (config_fingerprint, legacy_config_fingerprint))
    checkpoint_path = Path(checkpoint).expanduser().resolve() if checkpoint else None
    resume = None
    if checkpoint_path is not None and checkpoint_path.exists():
        resume = load_checkpoint(checkpoint_path, fingerprint, legacy_fingerprint=legacy,
                                 routine=spec.training.routine.build(spec.training.learning_rate), x0=x0)
    recorder = _recorder(output_dir, spec.name, resume, info, progress)
    warnings = _announce(spec, calibration, progress)
    if warnings:
        info["warnings"] = [*info.get("warnings", ()), *warnings]
    return Diff2Server(
        mechanism=spec.mechanism(calibration),
        routine=spec.training.routine.build(spec.training.learning_rate),
        layout=layout, x0=x0, rounds=spec.training.rounds, clients=spec.clients, n_min=n_min,
        calibration=calibration, seed=spec.training.seed, evaluator=evaluator, eval_every=spec.evaluation.every,
        recorder=recorder, run_info=info, progress=progress, checkpoint_path=checkpoint_path,
        fingerprint=fingerprint, resume=resume, local=spec.local_mechanism(calibration),
        clip_stats=spec.evaluation.clip_stats,
    )


def _check_server_arguments(spec: ExperimentConfig, source: str, evaluate_fn: Any) -> None:
    """What :func:`make_server` needs beyond a valid experiment: n_min, a callable."""
    if spec.privacy.n_min is None:
        raise argument_error(source, "n_min", "an integer >= 1 (the fewest records any client holds; the noise "
                             "is calibrated for it)", None)
    if evaluate_fn is not None and not callable(evaluate_fn):
        raise argument_error(source, "evaluate_fn", "None or a callable evaluate_fn(arrays) -> {metric: value}",
                             type(evaluate_fn).__name__)


def _recorder(output_dir: str | Path | None, name: str, resume: Checkpoint | None, info: dict[str, Any],
              progress: Callable[[str], None] | None) -> RunRecorder | None:
    """The run folder's writer (None without ``output_dir``); a resumed run continues in its own folder."""
    if output_dir is None:
        return None
    if resume is not None and resume.run_dir:
        run_dir = Path(resume.run_dir)
        recorder = RunRecorder(run_dir, keep_through_round=resume.state.round)
    else:
        run_dir = new_run_dir(output_dir, name)
        recorder = RunRecorder(run_dir)
    info["output_dir"] = str(run_dir)
    if progress:
        progress(f"[diff2] writing per-round metrics and summary to {run_dir}")
    return recorder


def _announce(spec: ExperimentConfig, calibration: Calibration | None,
              progress: Callable[[str], None] | None) -> list[str]:
    """Say where the noise key comes from, and return (and say) the warnings of the server's own settings: clip
    statistics released (outside ε), a seeded noise key (the seed is the key). They go into the summary too."""
    warnings = [CLIP_STATS_WARNING] if spec.evaluation.clip_stats else []
    if calibration is not None and spec.training.seed is not None:
        warnings.append(SEED_WARNING)
    if progress and calibration is not None and spec.training.seed is None:
        progress("[diff2] noise key drawn from OS entropy (no training.seed): the noise is not reproducible.")
    for warning in warnings:
        if progress:
            progress(f"[diff2] WARNING: {warning}")
    return warnings


def _closed_form_applies(model: torch.nn.Module, loss: LossFn) -> bool:
    """The closed form is for the paper MLP (one softplus hidden layer, one output) with ½-squared error."""
    return type(model) is PaperMLP and loss is half_squared_error and model.out.out_features == 1


def make_worker(
    *,
    model: torch.nn.Module,
    loss: LossFn | str,
    data: Any,
    partition_id: int,
    dtype: str = "float64",
    chunk_size: int = 1024,
    gradients: str = "auto",
    _function: str = "diff2_flwr.make_worker",
) -> Worker:
    """One worker from a model, a per-sample loss and its records; the YAML path calls it too.

    ``loss(output[n, ...], target[n]) -> losses[n]`` (one loss per record, no reduction), or the name of one
    of ours. ``data``: ``(features, targets)`` tensors or arrays, or a map-style ``Dataset`` of
    ``(features, target)`` pairs, read ``chunk_size`` records at a time. ``model`` is copied (its parameters
    come from the server each round; the caller's module is left as it is). ``gradients``: "auto" takes the
    closed form for the paper MLP with ½-squared error, ``torch.func`` otherwise. Models that mix the samples
    of a batch (batch-norm) are refused.

    References:
        Murata & Suzuki (2023), Algorithm 1 (worker lines), Algorithm 2 (ClippedMean).
    """
    options: TrainingConfig = from_arguments(_function, {"dtype": dtype, "chunk_size": chunk_size,
                                                         "gradients": gradients}, TrainingConfig)
    if not isinstance(partition_id, int) or isinstance(partition_id, bool) or partition_id < 0:
        raise argument_error(_function, "partition_id", "an integer >= 0", partition_id)
    if not isinstance(model, torch.nn.Module):
        raise argument_error(_function, "model", "a torch.nn.Module", type(model).__name__)
    if isinstance(loss, str):
        if loss not in LOSSES:
            raise argument_error(_function, "loss", f"a callable loss(output, target) -> per-sample losses, or one "
                                  f"of {sorted(LOSSES)}", loss)
        loss = get_loss(loss)
    if not callable(loss):
        raise argument_error(_function, "loss", "a callable loss(output, target) -> per-sample losses",
                              type(loss).__name__)
    torch_dtype = _DTYPES[options.dtype]
    generic = PerSampleGradients(copy.deepcopy(model), loss, dtype=torch_dtype, chunk_size=options.chunk_size)
    closed_form = _closed_form_applies(model, loss)
    if options.gradients == "closed_form" and not closed_form:
        raise argument_error(_function, "gradients", "'auto' or 'torch_func' unless the model is the paper MLP "
                              "(PaperMLP, one output) with loss half_squared_error (the closed form is for that model)",
                              options.gradients)
    grads: PerSampleGradients | PaperMLPGradients = generic
    if closed_form and options.gradients != "torch_func":
        grads = PaperMLPGradients(generic.layout, dtype=torch_dtype)
    records = as_records(data, dtype=torch_dtype, chunk_size=options.chunk_size)
    if records.num_samples == 0:
        raise ValueError(f"Partition {partition_id} holds no samples: an empty shard cannot contribute a ClippedMean.")
    _check_first_records(_function, model, loss, records, torch_dtype)
    return Worker(partition_id, grads, records)


def _check_first_records(function: str, model: torch.nn.Module, loss: LossFn, records: TensorRecords | DatasetRecords,
                         dtype: torch.dtype) -> None:
    """The loss on the first two records, so that a target the loss cannot take fails here, in one line."""
    x, y = (records.features[:2], records.targets[:2]) if isinstance(records, TensorRecords) else next(records.chunks())
    with torch.no_grad(), torch.random.fork_rng(devices=[]):  # no draw from torch's global generator leaks out
        try:
            output = copy.deepcopy(model).to(dtype)(x[:2])
        except Exception:  # noqa: BLE001 - the model's own failure is reported where the gradients run it
            return
        try:
            loss(output, y[:2])
        except Exception as exc:  # noqa: BLE001 - any failure of the loss is reported, in one line
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise argument_error(function, "loss", "a loss that takes this client's targets (floating-point "
                                  f"targets arrive as {dtype}, integer ones as they are: give class labels as "
                                  "integers, e.g. y.astype(int), or convert in the loss with target.long())",
                                  f"{type(exc).__name__}: {first}") from None


# -------------------------------------------------------------------- builders

def privacy_warnings(cfg: ExperimentConfig, n_train: int) -> list[str]:
    """What the run releases or assumes outside its (ε, δ) guarantee, said loudly."""
    out = []
    if cfg.evaluation.train_metrics:
        out.append("evaluation.train_metrics is on: train_loss and grad_norm_sq are computed on the private training "
                   "data without clipping or noise (train_accuracy too, for classification); they leak and are NOT covered by ε. Research only: set "
                   "evaluation.train_metrics: false for anything deployed.")
    if cfg.private and cfg.privacy.delta >= 1 / n_train:
        out.append(f"privacy.delta = {cfg.privacy.delta:g} is not below 1/n = {1 / n_train:.3g} (n = {n_train} training "
                   "records): a mechanism that publishes a random record in full would meet such a δ. Choose δ ≪ 1/n.")
    return out


@functools.lru_cache(maxsize=4)
def load_data(cfg: ExperimentConfig) -> PreparedData:
    """The dataset of ``cfg`` after the paper's preprocessing (cached per process)."""
    d = cfg.dataset
    classes: tuple[str, ...] = ()
    if d.name == "csv":
        assert d.path is not None and d.target is not None
        x, y, classes = load_csv(d.path, target=d.target, drop=d.drop, categorical=d.categorical, task=d.task_kind)
    elif d.name in CLASSIFICATION:
        x, y, classes = load_classification(d.name, data_dir=d.dir)
    else:
        x, y = load_raw(d.name, data_dir=d.dir, num_samples=d.num_samples, num_features=d.num_features,
                        seed=d.generator_seed)
    try:
        return prepare(d.name, x, y, clients=cfg.clients, test_fraction=d.test_fraction,
                       split_seed=d.split_seed, classes=classes,
                       partitioner=d.partitioner.arguments(d.split_seed, d.task_kind, cfg.clients),
                       standardise=d.standardise, train_samples=d.train_samples, subsample_seed=d.subsample_seed)
    except DataError as exc:  # say which experiment file asked for it
        raise DataError(f"{cfg.source}: {exc}") from None


def subsample_info(cfg: ExperimentConfig, data: PreparedData) -> dict[str, Any]:
    """What a run or study reports of ``dataset.train_samples``: nothing without it, else the kept and available
    record counts and the seed (a deployment's server knows only the kept records: its shard sizes)."""
    d = cfg.dataset
    if d.train_samples is None:
        return {}
    return {"train_samples": d.train_samples, "subsample_seed": d.subsample_seed,
            "train_available": data.train_available}


def _model(cfg: ExperimentConfig, num_features: int, num_outputs: int) -> torch.nn.Module:
    m = cfg.model
    return build_model(m.name, in_features=num_features, out_features=num_outputs, hidden=m.hidden_units,
                       init_seed=m.init_seed, kwargs=m.kwargs.as_dict())


def _gradients(cfg: ExperimentConfig, num_features: int, num_outputs: int) -> PerSampleGradients:
    return PerSampleGradients(_model(cfg, num_features, num_outputs), get_loss(cfg.loss),
                              dtype=_DTYPES[cfg.training.dtype], chunk_size=cfg.training.chunk_size)


def initial_parameters(cfg: ExperimentConfig, data: PreparedData) -> np.ndarray:
    """x_0: the model's initial parameters as a flat float64 vector."""
    return _initial_point(cfg.source, _model(cfg, data.num_features, data.num_outputs), None)[1]


def _num_outputs(cfg: ExperimentConfig, classes: tuple[str, ...]) -> int:
    return len(classes) if cfg.dataset.task_kind == "classification" else 1


@functools.lru_cache(maxsize=64)
def build_worker(cfg: ExperimentConfig, partition_id: int, data_path: str | None = None) -> Worker:
    """Worker ``partition_id`` of ``cfg`` (cached per process: simulation actors serve many rounds).

    With ``data_path`` (a deployment) the worker reads only its own shard file (see
    :mod:`diff2_flwr.runtime.shard_files`); otherwise it prepares the whole dataset and takes its shard.
    """
    if data_path is not None:
        from .shard_files import read_shard

        shard = read_shard(data_path, cfg, partition_id, cfg.clients)
        features, targets = shard.features, shard.targets
        num_outputs = _num_outputs(cfg, shard.classes)
    else:
        data = load_data(cfg)
        features, targets = data.shard(partition_id)
        num_outputs = data.num_outputs
    return make_worker(model=_model(cfg, features.shape[1], num_outputs), loss=get_loss(cfg.loss),
                       data=(features, targets), partition_id=partition_id, dtype=cfg.training.dtype,
                       chunk_size=cfg.training.chunk_size, gradients=cfg.training.gradients, _function=cfg.source)


class PreflightError(ValueError):
    """The first problem of a run found before any transport; the message is one line (file or key, what was
    expected, what was found, what to do)."""


#: Records of the probe: one clipped per-sample gradient at x_0 through the workers' own code.
PROBE_RECORDS = 4


@dataclass(frozen=True)
class Preflight:
    """What a run of a config is built from, checked before any transport (see :func:`preflight`)."""

    data: PreparedData  # the dataset; in a deployment (dataset.shards) the server's test split and shard sizes
    n_min: int
    calibration: Calibration | None  # None for method gd
    gradients: PerSampleGradients  # the model (factory imported and called, layers checked) and its loss
    lines: tuple[str, ...]  # what is said before training: the shards, n_min and σ
    warnings: tuple[str, ...]  # what the run releases or assumes outside ε, and noise that drowns the signal
    noise: dict[str, float | int] | None  # E‖noise‖ / C per kind of round (None for gd)


def _server_data(cfg: ExperimentConfig) -> PreparedData:
    """The data the server holds: the whole prepared dataset, or in a deployment only ``server.npz``."""
    if not cfg.dataset.shards:
        return load_data(cfg)
    from .shard_files import SERVER_FILE, read_server_data

    sdata = read_server_data(Path(cfg.dataset.shards).expanduser() / SERVER_FILE, cfg)
    if len(sdata.shard_sizes) != cfg.clients:
        raise ValueError(f"{cfg.source}: the shards are for {len(sdata.shard_sizes)} workers, "
                         f"training.clients = {cfg.clients}.")
    return PreparedData(name=cfg.dataset.name, x_train=np.zeros((0, sdata.x_test.shape[1])), y_train=np.zeros(0),
                        x_test=sdata.x_test, y_test=sdata.y_test,
                        shard_bounds=tuple((0, n) for n in sdata.shard_sizes), target_scale=sdata.target_scale,
                        task=sdata.task, classes=sdata.classes)


def _probe(cfg: ExperimentConfig, data: PreparedData, model: torch.nn.Module) -> None:
    """One clipped per-sample gradient at x_0 on the first records the server holds, through a worker built as the
    workers build theirs: a forward that does not fit the data, or targets the loss cannot take, fail here."""
    if data.x_train.shape[0]:
        features, targets = data.shard(0)
        where = "training records of partition 0"
    else:  # a deployment's server holds the test split only
        features, targets = data.x_test, data.y_test
        where = "test records"
    k = min(PROBE_RECORDS, int(features.shape[0]))
    if k == 0:
        return
    worker = make_worker(model=model, loss=get_loss(cfg.loss), data=(features[:k], targets[:k]), partition_id=0,
                         dtype=cfg.training.dtype, chunk_size=cfg.training.chunk_size,
                         gradients=cfg.training.gradients, _function=cfg.source)
    x0 = _initial_point(cfg.source, model, None)[1]
    try:
        records = worker.records  # in memory: a (features, targets) pair
        contribution = worker.gradients.clipped_mean(x0, records.features, records.targets, 1.0)
    except Exception as err:  # noqa: BLE001 (the user's forward or loss: any error is the user's to fix)
        raise PreflightError(
            f"{cfg.source}: the model (model.name {cfg.model.name}) and loss {cfg.loss} fail on the first {k} {where} "
            f"at x_0: {type(err).__name__}: {' '.join(str(err).split())}. The model is called on features of shape "
            f"[n, {data.num_features}] and must return [n, {data.num_outputs}] outputs; "
            + ("cross_entropy takes integer class indices as targets." if cfg.loss == "cross_entropy" else
               "half_squared_error takes one real target per record.")) from None
    if contribution.overflow:
        raise PreflightError(f"{cfg.source}: the per-sample gradients at x_0 are not finite on the first {k} {where}; "
                             "check the model's initialisation (model.init_seed, the factory) and the data's scale.")


def _checked_gradients(cfg: ExperimentConfig, data: PreparedData) -> PerSampleGradients:
    """The model (factory imported and called) and its per-sample gradients; a refusal names the file and key."""
    try:
        model = _model(cfg, data.num_features, data.num_outputs)
    except ValueError as err:
        raise PreflightError(f"{cfg.source}: {err}") from None
    try:
        check_per_sample_safe(model)
    except ValueError as err:
        raise PreflightError(f"{cfg.source}: key `model.name`: the model {cfg.model.name!r} cannot be trained "
                             f"privately: {err}") from None
    return PerSampleGradients(model, get_loss(cfg.loss), dtype=_DTYPES[cfg.training.dtype],
                              chunk_size=cfg.training.chunk_size)


def preflight(cfg: ExperimentConfig) -> Preflight:
    """Build and check everything a run of ``cfg`` needs that no transport does, and raise the first problem.

    In order: the data (files, columns, values, target), the partition (shard sizes, n_min, ``privacy.n_min``),
    the local routine's limits (``local.batch_size`` <= n_min), the calibration (σ above
    ``dataset.partitioner.max_sigma``, the planned ε), the model (factory imported and called, a
    ``torch.nn.Module`` without batch-norm, finite x_0) and one clipped per-sample gradient at x_0 on a few
    records. Each problem is a ``ValueError`` (``DataError``, ``ConfigError``, :class:`PreflightError`, ...)
    whose message names the file or key, what was expected and what was found. Both engines of ``diff2 run``
    and the ServerApp call it first (:func:`build_server` does); it writes nothing. The returned
    :class:`Preflight` holds what :func:`build_server` goes on with, what to say before training and the
    estimate of the noise against the clipping radius (:mod:`~diff2_flwr.runtime.noise_report`).
    """
    data = _server_data(cfg)
    check_shards(cfg, data.shard_sizes)  # an empty (or too small) shard: refused before any calibration
    n_min = cfg.privacy.n_min or data.n_min
    if n_min > data.n_min:
        raise ValueError(
            f"{cfg.source}: key `privacy.n_min` = {n_min} but the smallest shard has {data.n_min} samples; "
            "the noise would be calibrated for a smaller sensitivity than the real one."
        )
    if cfg.local.enabled and cfg.local.batch_size > n_min:
        raise ConfigError(f"{cfg.source}: key `local.batch_size`: expected at most n_min = {n_min} (the smallest shard: "
                          f"every worker samples each record with probability b / n_p <= 1). Found {cfg.local.batch_size}.",
                          key="local.batch_size", expected=f"an integer <= {n_min}", found=cfg.local.batch_size)
    calibration = cfg.calibration(n_min)  # make_server calibrates the same way; here for the checks and the report
    check_shards(cfg, data.shard_sizes, calibration)
    if calibration is not None:
        check_planned_budget(calibration, cfg.source, "privacy.")
    gradients = _checked_gradients(cfg, data)
    _initial_point(cfg.source, gradients.model, None)  # parameters to train, finite
    _probe(cfg, data, _model(cfg, data.num_features, data.num_outputs))
    warnings = privacy_warnings(cfg, n_train=sum(data.shard_sizes))
    noise = None
    if calibration is not None:
        noise = noise_summary(calibration, gradients.layout.dim)
        drowned = noise_warning(calibration, gradients.layout.dim)
        if drowned:
            warnings.append(drowned)
    lines = shard_lines(cfg, data.shard_sizes, n_min, calibration, available=data.train_available)
    return Preflight(data, n_min, calibration, gradients, tuple(lines), tuple(warnings), noise)


def build_server(
    cfg: ExperimentConfig, *, output_root: str | Path | None = None, record: bool = True,
    progress: Callable[[str], None] | None = print, checked: Preflight | None = None,
) -> Diff2Server:
    """The server of ``cfg``: calibration from the data's n_min, x_0, evaluator, run folder.

    :func:`preflight` first (or ``checked``, its result for this very ``cfg``): every mistake it can find is
    raised before anything is written. With ``dataset.shards`` (a deployment) the server reads only
    ``server.npz`` there: the test split and the shard sizes, no training sample (so no train metrics).
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
        "dataset": {"name": data.name, "train": sum(data.shard_sizes), "test": int(data.x_test.shape[0]),
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
        spec, model=_model(cfg, data.num_features, data.num_outputs), evaluate_fn=evaluate_fn,
        output_dir=(output_root or cfg.output.dir) if record else None,
        checkpoint=cfg.output.checkpoint, progress=progress, run_info=run_info, source=cfg.source, section="privacy.",
    )
