"""The two sides of a DIFF2 run without any transport, and how to build them from a config.

:class:`Diff2Server` is the trusted server: it plans each round, checks and averages the
workers' replies (failing closed), adds the noise and steps the estimator, keeps the privacy
ledger, evaluates and records. :class:`Worker` is one data owner: its shard and the
per-sample gradient machinery. The Flower Strategy and NumPyClient are thin wrappers around
these two; an in-process driver makes the same calls in the same order.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from ..core.aggregation import Reply, RoundRejected, average_contributions
from ..core.estimator import DIVERGENCE_ADVICE, Diverged, Mechanism, Release, RoundPlan, init_state, plan_round, server_step
from ..core.closed_form import PaperMLPGradients
from ..core.gradients import Contribution, PerSampleGradients
from ..core.layout import ParameterLayout
from ..core.privacy import PLD_DISCRETIZATION, Calibration, GaussianEvent, PrivacyLedger
from ..core.routines import Routine, make_routine
from ..task.data import CLASSIFICATION, PreparedData, load_classification, load_csv, load_raw, prepare
from ..task.evaluation import Evaluator
from ..task.losses import get_loss
from ..task.models import build_model
from .checkpoint import Checkpoint, CheckpointError, config_fingerprint, load_checkpoint, save_checkpoint
from .config import ExperimentConfig
from .outputs import RunRecorder, new_run_dir, to_json
from .shard_report import check_shards, shard_lines

__all__ = ["Diff2Server", "Worker", "Diverged", "check_mechanism", "load_data", "build_server", "build_worker"]


#: Relative slack of the budget guard: the exact composition may exceed the target by float rounding only.
BUDGET_RTOL = 1e-9
#: ... and the PLD accountant by its (pessimistic) discretisation only.
PLD_RTOL = 0.01


def check_mechanism(mechanism: Mechanism, calibration: Calibration, *, rounds: int, clients: int, n_min: int) -> None:
    """Refuse a server whose mechanism is not the one its calibration (and so its ledger) describes.

    The ledger charges each round the calibration's multiplier z; that is the truth only if the noise
    actually added is σ·radius with the calibration's σ, for the schedule, P and n_min it was computed for.
    """
    problems = []
    for what, have, want in (("rounds", rounds, calibration.rounds), ("clients (P)", clients, calibration.clients),
                             ("n_min", n_min, calibration.n_min),
                             ("restart_every (T)", mechanism.restart_every, calibration.restart_every),
                             ("sigma_restart (σ1)", mechanism.sigma_restart, calibration.sigma1)):
        if have != want:
            problems.append(f"{what} is {have!r}, the calibration's {want!r}")
    if calibration.difference_rounds and mechanism.sigma_diff != calibration.sigma2:
        problems.append(f"sigma_diff (σ2) is {mechanism.sigma_diff!r}, the calibration's {calibration.sigma2!r}")
    if not math.isfinite(mechanism.clip_restart) or (calibration.difference_rounds and not math.isfinite(mechanism.clip_diff)):
        problems.append("a clipping radius is infinite (the sensitivity would be unbounded)")
    if problems:
        raise ValueError("The mechanism disagrees with the calibration the ledger accounts for: " + "; ".join(problems)
                         + ". The ε reported would not be the ε spent: build the mechanism from this calibration "
                         "(ExperimentConfig.mechanism) or calibrate for this mechanism.")


class Diff2Server:
    """The trusted server's side of DIFF2 (Algorithm 1, server lines), transport-free."""

    def __init__(
        self,
        *,
        mechanism: Mechanism,
        routine: Routine,
        layout: ParameterLayout,
        x0: np.ndarray,
        rounds: int,
        clients: int,
        n_min: int,
        calibration: Calibration | None,
        seed: int | None,
        evaluator: Callable[[np.ndarray], dict[str, float]] | None = None,
        eval_every: int = 1,
        recorder: RunRecorder | None = None,
        run_info: dict | None = None,
        progress: Callable[[str], None] | None = print,
        checkpoint_path: Path | None = None,
        fingerprint: str = "",
        resume: Checkpoint | None = None,
    ) -> None:
        if layout.dim != x0.size:
            raise ValueError(f"x0 has {x0.size} entries but the model has {layout.dim} parameters.")
        if calibration is not None:
            check_mechanism(mechanism, calibration, rounds=rounds, clients=clients, n_min=n_min)
        self.mechanism, self.routine, self.layout = mechanism, routine, layout
        self.rounds, self.clients, self.n_min = rounds, clients, n_min
        self.calibration = calibration
        self.evaluator, self.eval_every = evaluator, eval_every
        self.recorder, self.progress = recorder, progress
        self.run_info = dict(run_info or {})
        self.checkpoint_path, self.fingerprint = checkpoint_path, fingerprint
        self._started = time.perf_counter()
        self._status, self._error = "running", None
        self.diverged_at: int | None = None  # the round at which the optimisation diverged, if it did
        if resume is not None:
            if resume.state.x.shape != x0.shape:
                raise CheckpointError(f"The checkpoint's iterate has shape {resume.state.x.shape}, the model {x0.shape}.")
            self.state, self.ledger = resume.state, resume.ledger
            self.history = list(recorder.kept) if recorder else []
            if progress:
                progress(f"[diff2] resumed from {checkpoint_path} after round {self.state.round} "
                         f"(ε spent so far {self.epsilon_spent:.4g})")
            recorded = {r["round"] for r in self.history}
            if recorder is not None and resume.release_row is not None and self.state.round not in recorded:
                # Died after round r's checkpoint, before its row: write the row now (x_r is released already).
                self._record_release(dict(resume.release_row), bool(np.all(np.isfinite(self.state.x))))
            return
        self.state = init_state(x0, routine, seed)
        self.ledger = PrivacyLedger(calibration.delta) if calibration else None
        self.history = []
        initial = {"round": 0, "kind": "init"}
        self._checkpoint(initial)  # the noise key is durable before anything is written or released
        self._record_release(initial, True)

    # ---------------------------------------------------------------- rounds
    @property
    def done(self) -> bool:
        return self.state.round >= self.rounds

    @property
    def epsilon_spent(self) -> float:
        """ε spent so far: the exact μ-GDP composition of the ledger's Gaussian events (cheap, every round)."""
        return self.ledger.epsilon if self.ledger else math.inf

    @property
    def epsilon_pld(self) -> float:
        """ε spent so far per dp-accounting's PLD accountant (independent; one composition per round)."""
        return self.ledger.epsilon_pld if self.ledger else math.inf

    @property
    def epsilon_rdp(self) -> float:
        """ε spent so far per dp-accounting's RDP accountant (looser; for comparison)."""
        return self.ledger.epsilon_rdp if self.ledger else math.inf

    def _guard(self, plan: RoundPlan) -> PrivacyLedger | None:
        """The ledger after this round; refuse the round (release nothing) if it would exceed the target ε.

        The exact GDP composition must stay within the target (float rounding aside); dp-accounting's
        PLD accountant, computed independently, must agree within its discretisation (1 %).
        """
        if self.ledger is None or self.calibration is None:
            return None
        z = self.calibration.z1 if plan.restart else self.calibration.z2
        after = self.ledger.record(GaussianEvent(float(z), plan.kind))
        target = self.calibration.epsilon
        for name, spent, slack in (("exact GDP", after.epsilon, BUDGET_RTOL), ("dp-accounting PLD", after.epsilon_pld, PLD_RTOL)):
            if spent > target * (1 + slack):
                raise RoundRejected(plan.round, "budget", f"releasing it would bring ε spent ({name} accountant) to "
                                    f"{spent:.6g}, above the target ε = {target:g} by {spent - target:.3g}; the run "
                                    "stops here.")
        return after

    def plan(self) -> RoundPlan:
        """The next round's plan (kind, radius, iterates); derived from released values only."""
        if self.done:
            raise RuntimeError(f"All {self.rounds} rounds are released; there is no round {self.state.round + 1}.")
        try:
            return plan_round(self.state, self.mechanism)
        except Diverged as err:  # a radius or noise std that is not finite: nothing to ask the workers
            self.fail(err)
            raise

    def release(self, replies: Sequence[Reply]) -> Release:
        """Check and average the replies, add noise, step: release round r (or nothing, raising)."""
        plan = self.plan()
        try:
            ledger = self._guard(plan)
            aggregate = average_contributions(plan, self.layout, replies, clients=self.clients, n_min=self.n_min)
            self.state, release = server_step(self.state, self.mechanism, self.routine, aggregate.mean)
        except Exception as err:
            self.fail(err)
            raise
        if ledger is not None:
            self.ledger = ledger
        row = {
            "round": plan.round, "kind": plan.kind, "radius": plan.radius, "noise_std": plan.noise_std,
            "clip_fraction": aggregate.clip_fraction, "epsilon_spent": self.epsilon_spent,
            "epsilon_pld": self.epsilon_pld, "epsilon_rdp": self.epsilon_rdp,
            "update_norm": float(np.linalg.norm(release.x - plan.x_current)),
        }
        self._checkpoint(row)  # durable before anything of round r is written elsewhere
        finite = bool(np.all(np.isfinite(release.x)))
        self._record_release(row, finite)
        if not finite:
            err = Diverged(plan.round, "iterate", "the iterate is no longer finite. " + DIVERGENCE_ADVICE)
            self.fail(err)
            raise err
        if self.done:
            self._status = "completed"
            if self.recorder:
                self.recorder.parameters(self.state.x)
            self._write_summary()
            self._draw_curves()
        return release

    def _checkpoint(self, release_row: dict) -> None:
        if self.checkpoint_path is not None:
            run_dir = str(self.recorder.directory) if self.recorder else None
            save_checkpoint(self.checkpoint_path, Checkpoint(self.fingerprint, self.state, self.ledger, run_dir,
                                                             to_json(release_row)))

    def _record_release(self, row: dict, finite: bool) -> None:
        """Evaluate x_r (when due and finite) and record round r's row."""
        if finite:
            row.update(self._evaluate(self.state.x, force=self.done or self.state.round == 0))
        self._record(row)

    def fail(self, error: BaseException) -> None:
        """Record that the run stopped with ``error`` (nothing more is released)."""
        self._status, self._error = "failed", f"{type(error).__name__}: {error}"
        if isinstance(error, Diverged):
            self._status, self.diverged_at = "diverged", error.round
        if self.progress:
            self.progress(f"[diff2] run failed: {self._error}")
        self._write_summary()
        self._draw_curves()

    def _draw_curves(self) -> None:
        """``curves.png`` at the end of a run (completed or failed); a drawing failure never fails the run."""
        if self.recorder is None or not self.history:
            return
        name = self.run_info.get("name", "run")
        title = f"{name}: {self.run_info.get('method', '')}, {self._status}, round {self.state.round}/{self.rounds}"
        try:
            self.recorder.curves(self.history, title)
        except Exception as err:  # noqa: BLE001 (a picture must not fail a private run)
            if self.progress:
                self.progress(f"[diff2] WARNING: curves.png not drawn ({type(err).__name__}: {err})")

    # ---------------------------------------------------------------- helpers
    def _evaluate(self, x: np.ndarray, force: bool) -> dict[str, float]:
        if self.evaluator is None or not (force or self.state.round % self.eval_every == 0):
            return {}
        return self.evaluator(x)

    def _record(self, row: dict) -> None:
        row["elapsed_s"] = time.perf_counter() - self._started
        self.history.append(row)
        if self.recorder:
            self.recorder.row(row)
            if row["round"] == 0:
                self._write_summary()
        if self.progress:
            shown = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                             if k not in ("round", "kind", "elapsed_s"))
            self.progress(f"[diff2] round {row['round']}/{self.rounds} ({row['kind']}) {shown}")

    def summary(self) -> dict:
        evaluated = [r for r in self.history if "train_loss" in r or "test_loss" in r]
        final = evaluated[-1] if evaluated else {}
        metric_keys = ("train_loss", "grad_norm_sq", "test_loss")
        best = {k: min((r[k] for r in evaluated if k in r and math.isfinite(r[k])), default=None) for k in metric_keys}
        return {
            **self.run_info,
            "status": self._status,
            "error": self._error,
            "rounds_planned": self.rounds,
            "rounds_released": self.state.round,
            "diverged_at": self.diverged_at,
            "privacy": {
                "private": self.calibration is not None,
                "guarantee": "record-level (ε, δ)-DP, replace-one adjacency, central DP (trusted server adds the noise)"
                if self.calibration else "none (method gd: no clipping, no noise)",
                "epsilon_spent": self.epsilon_spent,
                "epsilon_accountant": "exact μ-GDP composition (Dong, Roth & Su 2019)",
                "epsilon_pld": self.epsilon_pld if self.ledger else None,
                "epsilon_pld_accountant": f"dp-accounting PLD, pessimistic, discretisation {PLD_DISCRETIZATION:g}",
                "epsilon_rdp": self.epsilon_rdp if self.ledger else None,
                "delta": self.calibration.delta if self.calibration else None,
                "epsilon_target": self.calibration.epsilon if self.calibration else None,
                "calibration": self.calibration.as_dict() if self.calibration else None,
                "noise_key": "seed (reproducible by anyone who knows it)" if self.state.noise_seeded else "os-entropy",
                "n_min": self.n_min,
            },
            "final": {k: final.get(k) for k in metric_keys} | {"round": final.get("round")},
            "best": best,
            "wall_time_s": time.perf_counter() - self._started,
        }

    def _write_summary(self) -> None:
        if self.recorder:
            self.recorder.summary(self.summary())


@dataclass(frozen=True)
class Worker:
    """One worker (data owner): its shard and the per-sample gradient machinery."""

    partition_id: int
    gradients: PerSampleGradients | PaperMLPGradients
    features: torch.Tensor
    targets: torch.Tensor

    @property
    def num_samples(self) -> int:
        return int(self.features.shape[0])

    def contribute(self, radius: float, x_current: np.ndarray, x_previous: np.ndarray | None) -> Contribution:
        """ClippedMean of per-sample gradients (x_previous None) or of gradient differences."""
        return self.gradients.clipped_mean(x_current, self.features, self.targets, radius, x_previous)

    def reply(self, plan: RoundPlan) -> Reply:
        """This worker's reply to ``plan`` exactly as the wire carries it (one float64 array per tensor)."""
        c = self.contribute(plan.radius, plan.x_current, plan.x_previous)
        return Reply(client=f"partition {self.partition_id}", partition_id=self.partition_id,
                     arrays=self.gradients.layout.split(c.mean), num_samples=c.num_samples, num_clipped=c.num_clipped,
                     overflow=c.overflow)


# -------------------------------------------------------------------- builders

def privacy_warnings(cfg: ExperimentConfig, n_train: int) -> list[str]:
    """What the run releases or assumes outside its (ε, δ) guarantee, said loudly."""
    out = []
    if cfg.evaluation.train_metrics:
        out.append("evaluation.train_metrics is on: train_loss and grad_norm_sq are computed on the private training "
                   "data without clipping or noise; they leak and are NOT covered by ε. Research only: set "
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
    return prepare(d.name, x, y, clients=cfg.training.clients, test_fraction=d.test_fraction, split_seed=d.split_seed,
                   classes=classes, partitioner=d.partitioner.arguments(d.split_seed, d.task_kind, cfg.training.clients))


def _model(cfg: ExperimentConfig, num_features: int, num_outputs: int) -> torch.nn.Module:
    m = cfg.model
    return build_model(m.name, in_features=num_features, out_features=num_outputs, hidden=m.hidden,
                       init_seed=m.init_seed)


def _gradients(cfg: ExperimentConfig, num_features: int, num_outputs: int) -> PerSampleGradients:
    dtype = {"float64": torch.float64, "float32": torch.float32}[cfg.training.dtype]
    return PerSampleGradients(_model(cfg, num_features, num_outputs), get_loss(cfg.loss), dtype=dtype,
                              chunk_size=cfg.training.chunk_size)


def initial_parameters(cfg: ExperimentConfig, data: PreparedData) -> np.ndarray:
    """x_0: the model's initial parameters as a flat float64 vector."""
    model = _model(cfg, data.num_features, data.num_outputs)
    return np.concatenate([p.detach().double().reshape(-1).numpy() for _, p in model.named_parameters()])


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

        shard = read_shard(data_path, cfg, partition_id, cfg.training.clients)
        features, targets = shard.features, shard.targets
        num_outputs = _num_outputs(cfg, shard.classes)
    else:
        data = load_data(cfg)
        features, targets = data.shard(partition_id)
        num_outputs = data.num_outputs
    if len(targets) == 0:
        raise ValueError(f"Partition {partition_id} holds no samples: an empty shard cannot contribute a ClippedMean.")
    gradients: PerSampleGradients | PaperMLPGradients = _gradients(cfg, features.shape[1], num_outputs)
    if cfg.closed_form_gradients:
        gradients = PaperMLPGradients(gradients.layout, dtype=gradients.dtype)
    as_t = lambda a: torch.as_tensor(a, dtype=gradients.dtype)  # noqa: E731
    return Worker(partition_id, gradients, as_t(features), as_t(targets))


def build_server(
    cfg: ExperimentConfig, *, output_root: str | Path | None = None, record: bool = True,
    progress: Callable[[str], None] | None = print,
) -> Diff2Server:
    """The server of ``cfg``: calibration from the data's n_min, x_0, evaluator, run folder.

    With ``dataset.shards`` (a deployment) the server reads only ``server.npz`` there: the test
    split and the shard sizes, no training sample (so no train metrics).
    """
    if cfg.dataset.shards:
        from .shard_files import SERVER_FILE, read_server_data

        sdata = read_server_data(Path(cfg.dataset.shards).expanduser() / SERVER_FILE, cfg)
        if len(sdata.shard_sizes) != cfg.training.clients:
            raise ValueError(f"{cfg.source}: the shards are for {len(sdata.shard_sizes)} workers, "
                             f"training.clients = {cfg.training.clients}.")
        data = PreparedData(name=cfg.dataset.name, x_train=np.zeros((0, sdata.x_test.shape[1])), y_train=np.zeros(0),
                            x_test=sdata.x_test, y_test=sdata.y_test,
                            shard_bounds=tuple((0, n) for n in sdata.shard_sizes), target_scale=sdata.target_scale,
                            task=sdata.task, classes=sdata.classes)
    else:
        data = load_data(cfg)
    check_shards(cfg, data.shard_sizes)  # an empty (or too small) shard: refused before any calibration
    n_min = cfg.privacy.n_min or data.n_min
    if n_min > data.n_min:
        raise ValueError(
            f"{cfg.source}: key `privacy.n_min` = {n_min} but the smallest shard has {data.n_min} samples; "
            "the noise would be calibrated for a smaller sensitivity than the real one."
        )
    calibration = cfg.calibration(n_min)
    if calibration is not None:
        planned = calibration.epsilon_spent(calibration.restart_rounds, calibration.difference_rounds)
        if planned > calibration.epsilon * (1 + BUDGET_RTOL):
            raise ValueError(f"{cfg.source}: the planned schedule would spend ε = {planned:.6g}, above the target "
                             f"privacy.epsilon = {calibration.epsilon:g} by {planned - calibration.epsilon:.3g}; "
                             "the run does not start.")
    check_shards(cfg, data.shard_sizes, calibration)
    if progress:
        for line in shard_lines(cfg, data.shard_sizes, n_min, calibration):
            progress(line)
    gradients = _gradients(cfg, data.num_features, data.num_outputs)
    evaluator = None
    if cfg.evaluation.train_metrics or cfg.evaluation.test_metrics:
        evaluator = Evaluator.of(gradients, data, train_metrics=cfg.evaluation.train_metrics,
                                 test_metrics=cfg.evaluation.test_metrics)
    recorder = None
    run_info = {"name": cfg.name, "method": cfg.method, "config_file": cfg.source, "config": cfg.to_dict(),
                "dataset": {"name": data.name, "train": sum(data.shard_sizes), "test": int(data.x_test.shape[0]),
                            "shard_sizes": list(data.shard_sizes),
                            "partitioner": cfg.dataset.partitioner.describe(
                                cfg.dataset.split_seed, cfg.dataset.task_kind, cfg.training.clients)}}
    fingerprint = config_fingerprint(cfg.to_dict(), n_min)
    checkpoint_path = Path(cfg.output.checkpoint).expanduser().resolve() if cfg.output.checkpoint else None
    resume = None
    if checkpoint_path is not None and checkpoint_path.exists():
        resume = load_checkpoint(checkpoint_path, fingerprint)
    if record:
        if resume is not None and resume.run_dir:  # a resumed run continues in its own folder
            run_dir = Path(resume.run_dir)
            recorder = RunRecorder(run_dir, keep_through_round=resume.state.round)
        else:
            run_dir = new_run_dir(output_root or cfg.output.dir, cfg.name)
            recorder = RunRecorder(run_dir)
        run_info["output_dir"] = str(run_dir)
        if progress:
            progress(f"[diff2] writing per-round metrics and summary to {run_dir}")
    for warning in privacy_warnings(cfg, n_train=sum(data.shard_sizes)):
        run_info.setdefault("warnings", []).append(warning)
        if progress:
            progress(f"[diff2] WARNING: {warning}")
    if progress and cfg.training.seed is None and calibration is not None:
        progress("[diff2] noise key drawn from OS entropy (no training.seed): the noise is not reproducible.")
    elif progress and calibration is not None:
        progress("[diff2] WARNING: training.seed is set, so the noise is reproducible by anyone who knows the seed; "
                 "use seeds for research only.")
    return Diff2Server(
        mechanism=cfg.mechanism(calibration),
        routine=make_routine(cfg.training.routine, learning_rate=cfg.training.learning_rate),
        layout=gradients.layout, x0=initial_parameters(cfg, data), rounds=cfg.training.rounds,
        clients=cfg.training.clients, n_min=n_min, calibration=calibration, seed=cfg.training.seed,
        evaluator=evaluator, eval_every=cfg.evaluation.every, recorder=recorder, run_info=run_info,
        progress=progress, checkpoint_path=checkpoint_path, fingerprint=fingerprint, resume=resume,
    )
