"""Studies: the paper's protocol (grid search per method, seeds, criteria, t-tests) from one YAML file.

A study names a dataset, R, δ and a list of ε; a list of methods, each a base method (gd,
dpgd, diff2) with a grid of hyper-parameters (learning rate, C1, C2, T); tuning seeds and
evaluation seeds. For every ε it

1. runs every grid point with every tuning seed (the tuning phase);
2. per method and criterion picks the grid point with the smallest mean (over tuning seeds)
   of the criterion's minimum over rounds — train loss and ‖∇f‖² each at their own best,
   test loss at the train-loss-best point (the paper's rule);
3. runs each chosen point with every evaluation seed (the evaluation phase);
4. summarises mean ± std over evaluation seeds of the minimum over rounds and of the final
   value, and the one-sided paired t-test of each DIFF2 method against DP-GD
   (H1: DIFF2's minimum < DP-GD's; pairs by seed; n - 1 degrees of freedom).

For a classification dataset the runs also record the test accuracy, and the summary reports it
at the train-loss-best point (as the paper reports the test loss): mean ± std over evaluation
seeds of the best (largest) accuracy over rounds and of the final one, and the same one-sided
paired t-test with the direction reversed (H1: DIFF2's accuracy > DP-GD's). Accuracy never takes
part in the selection.

Every run's per-round metrics land in ``runs/`` as JSON; an existing run file is reused, so
an interrupted study resumes where it stopped.

References:
    Murata & Suzuki (2023), Section 6; DIFF2.md, "The paper's experiments".
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

import numpy as np
import yaml

from ..runtime.config import ConfigError, ExperimentConfig, parse_config, read_yaml
from ..runtime.outputs import to_json
from ..runtime.progress import ProgressReporter

__all__ = [
    "ACCURACY",
    "CRITERIA",
    "MethodSpec",
    "Study",
    "StudyError",
    "load_study",
    "parse_study",
    "run_study",
    "select",
    "paired_one_sided_ttest",
]

CRITERIA = ("train_loss", "grad_norm_sq", "test_loss")
#: Reported, never selected on: larger is better, taken at the train-loss-best point (classification only).
ACCURACY = "test_accuracy"
GRID_KEYS = ("learning_rate", "clip_restart", "clip_diff", "restart_every")
Engine = Literal["batch", "inprocess", "flower"]


class StudyError(ConfigError):
    """An invalid study file; the message names the file, the key, and what was found."""


@dataclass(frozen=True)
class MethodSpec:
    """One compared method: a base method and its hyper-parameter grid."""

    name: str
    method: Literal["gd", "dpgd", "diff2"]
    grid: tuple[tuple[str, tuple[float, ...]], ...]
    u: float = 1.25

    def points(self) -> list[dict[str, float]]:
        keys = [k for k, _ in self.grid]
        return [dict(zip(keys, values)) for values in itertools.product(*(v for _, v in self.grid))]


@dataclass(frozen=True)
class Study:
    name: str
    dataset: Mapping[str, Any]
    clients: int
    rounds: int
    delta: float
    epsilons: tuple[float, ...]
    mode: Literal["exact", "rdp"]
    eval_every: int
    tune_seeds: tuple[int, ...]
    eval_seeds: tuple[int, ...]
    methods: tuple[MethodSpec, ...]
    hidden: int = 10
    model: str = "paper_mlp"  # or a factory "package.module:callable" (then model_kwargs, not hidden)
    model_kwargs: Mapping[str, Any] = field(default_factory=dict)
    engine: Engine = "batch"
    dtype: Literal["float64", "float32"] = "float64"
    compile: bool = False
    batch_size: int = 32
    workers: int = 1  # batch engine: processes that run batches side by side (runs are independent)
    output_dir: str = "outputs/studies"
    source: str = field(default="<memory>", compare=False)

    def experiment(self, method: MethodSpec, point: Mapping[str, float], epsilon: float, seed: int) -> ExperimentConfig:
        """The single-run config of one (method, grid point, ε, seed)."""
        training = {"rounds": self.rounds, "clients": self.clients, "seed": seed, "dtype": "float64",
                    **{k: (int(v) if k == "restart_every" else float(v)) for k, v in point.items()}}
        return parse_config({
            "name": f"{self.name}-{_slug(method.name)}", "method": method.method, "dataset": dict(self.dataset),
            "model": ({"hidden": self.hidden} if self.model == "paper_mlp" else
                      {"name": self.model, "kwargs": dict(self.model_kwargs)}) | {"init_seed": seed},
            "privacy": {"epsilon": epsilon, "delta": self.delta, "mode": self.mode, "u": method.u},
            "training": training, "evaluation": {"every": self.eval_every},
        }, source=f"{self.source} (method {method.name!r}, point {dict(point)})")


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text).strip("-").lower()


# ------------------------------------------------------------------------------- loading

_TOP_KEYS = {"name", "dataset", "clients", "rounds", "delta", "epsilons", "mode", "eval_every", "seeds", "methods",
             "hidden", "model", "engine", "dtype", "compile", "batch_size", "workers", "output"}


def parse_study(data: Any, source: str = "<memory>") -> Study:
    """Validate a study mapping; every error names the file and the key."""
    def fail(key: str, expected: str, found: Any) -> StudyError:
        return StudyError(f"{source}: key `{key}`: expected {expected}. Found {found!r}.")

    if not isinstance(data, Mapping):
        raise StudyError(f"{source}: a study must be a mapping of keys to values. Found {data!r}.")
    unknown = sorted(set(map(str, data)) - _TOP_KEYS)
    if unknown:
        raise StudyError(f"{source}: unknown key(s) {', '.join(unknown)}. Allowed: {', '.join(sorted(_TOP_KEYS))}.")
    for key in ("name", "dataset", "rounds", "epsilons", "methods", "seeds"):
        if key not in data:
            raise fail(key, "a value (required)", None)
    seeds = data["seeds"]
    if not isinstance(seeds, Mapping) or set(seeds) - {"tune", "evaluate"}:
        raise fail("seeds", "a mapping with keys tune and evaluate", seeds)
    tune, evaluate = seeds.get("tune", []), seeds.get("evaluate", [])
    for key, values in (("seeds.tune", tune), ("seeds.evaluate", evaluate)):
        if not isinstance(values, list) or not values or not all(isinstance(v, int) and v >= 0 for v in values):
            raise fail(key, "a non-empty list of integers >= 0", values)
        if len(set(values)) != len(values):
            raise fail(key, "distinct seeds", values)
    if set(tune) & set(evaluate):
        raise fail("seeds.evaluate", "seeds disjoint from seeds.tune (selection must not see the evaluation noise)",
                   sorted(set(tune) & set(evaluate)))
    epsilons = data["epsilons"]
    if not isinstance(epsilons, list) or not epsilons or not all(isinstance(e, (int, float)) and e > 0 for e in epsilons):
        raise fail("epsilons", "a non-empty list of numbers > 0", epsilons)
    rounds = data["rounds"]
    if not isinstance(rounds, int) or rounds < 1:
        raise fail("rounds", "an integer >= 1", rounds)
    methods_raw = data["methods"]
    if not isinstance(methods_raw, list) or not methods_raw:
        raise fail("methods", "a non-empty list of methods", methods_raw)
    methods = []
    for i, m in enumerate(methods_raw):
        where = f"methods[{i}]"
        if not isinstance(m, Mapping) or set(m) - {"name", "method", "grid", "u"} or "name" not in m or "method" not in m:
            raise fail(where, "a mapping with name, method, grid (and optionally u)", m)
        if m["method"] not in ("gd", "dpgd", "diff2"):
            raise fail(f"{where}.method", "one of 'gd', 'dpgd', 'diff2'", m["method"])
        grid = m.get("grid") or {}
        if not isinstance(grid, Mapping):
            raise fail(f"{where}.grid", "a mapping of hyper-parameter -> list of values", grid)
        bad = sorted(set(grid) - set(GRID_KEYS))
        if bad:
            raise fail(f"{where}.grid", f"keys among {', '.join(GRID_KEYS)}", bad)
        items = []
        for key, values in grid.items():
            if not isinstance(values, list) or not values:
                raise fail(f"{where}.grid.{key}", "a non-empty list (an empty grid runs nothing)", values)
            if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in values):
                raise fail(f"{where}.grid.{key}", "numbers > 0", values)
            if key == "restart_every" and any(v > rounds or int(v) != v for v in values):
                raise fail(f"{where}.grid.restart_every", f"integers T <= rounds = {rounds}", values)
            items.append((key, tuple(values)))
        if m["method"] == "diff2" and "restart_every" not in grid:
            raise fail(f"{where}.grid.restart_every", "a list of T values for a diff2 method", None)
        if m["method"] != "diff2" and "restart_every" in grid:
            raise fail(f"{where}.grid.restart_every", f"no T for method {m['method']} (T = 1)", grid["restart_every"])
        methods.append(MethodSpec(name=str(m["name"]), method=m["method"], grid=tuple(items), u=float(m.get("u", 1.25))))
    names = [m.name for m in methods]
    if len(set(names)) != len(names):
        raise fail("methods", "distinct method names", names)
    model = data.get("model") or {}
    if not isinstance(model, Mapping) or set(model) - {"name", "kwargs"} or not isinstance(model.get("kwargs") or {}, Mapping):
        raise fail("model", "a mapping with name (a factory 'package.module:callable') and optionally kwargs", model)
    if "hidden" in data and model.get("name", "paper_mlp") != "paper_mlp":
        raise fail("hidden", f"nothing with model {model.get('name')!r} (pass its sizes in model.kwargs)", data["hidden"])
    output = data.get("output") or {}
    if not isinstance(output, Mapping) or set(output) - {"dir"}:
        raise fail("output", "a mapping with key dir", output)
    study = Study(
        name=str(data["name"]), dataset=dict(data["dataset"]), clients=int(data.get("clients", 10)), rounds=rounds,
        delta=float(data.get("delta", 1e-5)), epsilons=tuple(float(e) for e in epsilons),
        mode=data.get("mode", "exact"), eval_every=int(data.get("eval_every", 1)), tune_seeds=tuple(tune),
        eval_seeds=tuple(evaluate), methods=tuple(methods), hidden=int(data.get("hidden", 10)),
        model=str(model.get("name", "paper_mlp")), model_kwargs=dict(model.get("kwargs") or {}),
        engine=data.get("engine", "batch"), dtype=data.get("dtype", "float64"), compile=bool(data.get("compile", False)),
        batch_size=int(data.get("batch_size", 32)), workers=data.get("workers", 1),
        output_dir=str(output.get("dir", "outputs/studies")), source=source,
    )
    if study.engine not in ("batch", "inprocess", "flower"):
        raise fail("engine", "one of 'batch', 'inprocess', 'flower'", study.engine)
    if study.dtype not in ("float64", "float32"):
        raise fail("dtype", "'float64' or 'float32'", study.dtype)
    if study.mode not in ("exact", "rdp"):
        raise fail("mode", "'exact' or 'rdp'", study.mode)
    if not isinstance(study.workers, int) or isinstance(study.workers, bool) or study.workers < 1:
        raise fail("workers", "an integer >= 1 (processes of the batch engine; 2 uses both cores of a 2-core machine)",
                   study.workers)
    if study.batch_size < 1:
        raise fail("batch_size", "an integer >= 1", study.batch_size)
    # Validate every run config once, up front: bad values fail before hours of compute.
    for method in study.methods:
        for point in method.points():
            try:
                study.experiment(method, point, study.epsilons[0], study.tune_seeds[0])
            except ConfigError as err:
                raise StudyError(f"{source}: method {method.name!r}: {err}") from None
    return study


def load_study(path: str | Path) -> Study:
    """Read and validate a study YAML file."""
    return parse_study(read_yaml(path, "study", StudyError), str(path))


# ------------------------------------------------------------------------------- statistics

def paired_one_sided_ttest(treatment: Sequence[float], control: Sequence[float]) -> float:
    """p-value of the paired t-test with H1: mean(treatment - control) < 0 (n - 1 degrees of freedom)."""
    from scipy import stats

    t = np.asarray(treatment, dtype=float)
    c = np.asarray(control, dtype=float)
    if t.shape != c.shape or t.size < 2:
        raise ValueError(f"A paired t-test needs two samples of equal size >= 2. Found {t.size} and {c.size}.")
    d = t - c
    if not np.all(np.isfinite(d)):
        return math.nan
    if np.all(d == d[0]):  # no variance: the test is undefined unless every difference has one sign
        return 0.0 if d[0] < 0 else 1.0
    return float(stats.ttest_rel(t, c, alternative="less").pvalue)


def _score(values: Sequence[float]) -> float:
    arr = np.asarray(values, dtype=float)
    return float(np.mean(arr)) if np.all(np.isfinite(arr)) else math.inf


def select(table: Mapping[str, Mapping[str, Sequence[float]]]) -> dict[str, str]:
    """Choose a grid point per criterion from ``table[point][criterion] = per-seed minima``.

    train_loss and grad_norm_sq each pick their own best (smallest mean over seeds, diverged =
    inf; ties go to the first point); test_loss uses the train-loss-best point.
    """
    if not table:
        raise ValueError("Nothing to select from: the grid is empty.")
    chosen = {}
    for criterion in ("train_loss", "grad_norm_sq"):
        chosen[criterion] = min(table, key=lambda point: _score(table[point][criterion]))
    chosen["test_loss"] = chosen["train_loss"]
    return chosen


# ------------------------------------------------------------------------------- running

def _run_id(phase: str, method: MethodSpec, point: Mapping[str, float], epsilon: float, seed: int, study: Study) -> str:
    key = json.dumps({"phase": phase, "method": asdict(method), "point": dict(point), "epsilon": epsilon, "seed": seed,
                      "rounds": study.rounds, "delta": study.delta, "mode": study.mode, "dataset": dict(study.dataset),
                      "clients": study.clients, "eval_every": study.eval_every, "hidden": study.hidden}, sort_keys=True)
    return f"{phase}-{_slug(method.name)}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


@dataclass
class _Job:
    run_id: str
    method: MethodSpec
    point: dict
    epsilon: float
    seed: int
    cfg: ExperimentConfig


class _Progress:
    """Runs done / total with an ETA on stderr: a live bar on a terminal, plain periodic lines otherwise."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done = total, 0
        self._reporter = ProgressReporter(total, label="runs", enabled=enabled)

    def show(self, fraction_of_batch: float = 0.0, batch: int = 0) -> None:
        if self._reporter.total != self.total:
            self._reporter.set_total(self.total)
        self._reporter.update(self.done + fraction_of_batch * batch)

    def finish(self) -> None:
        self._reporter.finish()


def _execute(study: Study, jobs: list[_Job], runs_dir: Path, progress: _Progress, pool=None) -> None:
    """Run the jobs whose result file is missing; write one JSON file per run."""
    from ..runtime.session import load_data

    todo = [j for j in jobs if not (runs_dir / f"{j.run_id}.json").exists()]
    progress.done += len(jobs) - len(todo)
    progress.show()
    if not todo:
        return
    engine = study.engine
    if engine == "batch" and not batchable(study, todo[0].cfg):
        engine = "inprocess"  # the batched engine has closed forms for MLPs with ½-squared error or cross-entropy
    if engine == "batch":
        from .sweep import RunSpec

        n_min = load_data(todo[0].cfg).n_min
        tasks = []
        for batch in _batches(todo, study.batch_size, study.workers):
            specs = []
            for j in batch:
                mech = j.cfg.mechanism(j.cfg.calibration(n_min))
                specs.append(RunSpec(mech.restart_every, j.cfg.training.learning_rate, mech.clip_restart,
                                     mech.clip_diff, mech.sigma_restart, mech.sigma_diff, j.seed, j.seed))
            tasks.append((batch, specs))

        def finish(batch: list[_Job], results: list) -> None:
            for j, res in zip(batch, results):
                metrics = {"rounds": res.rounds.tolist(), "train_loss": res.train_loss.tolist(),
                           "grad_norm_sq": res.grad_norm_sq.tolist(), "test_loss": res.test_loss.tolist()}
                if res.test_accuracy is not None:
                    metrics[ACCURACY] = res.test_accuracy.tolist()
                _write_run(runs_dir, j, metrics, res.diverged_at, "batch")
            progress.done += len(batch)
            progress.show()

        if pool is None:
            for batch, specs in tasks:
                finish(batch, _run_batch_task(study, todo[0].cfg, specs, lambda r, total, n=len(batch):
                                              progress.show(r / total, n) if r % 20 == 0 else None))
            return
        # Largest batches first, so that no worker is left with a big one at the end.
        futures = {pool.submit(_run_batch_task, study, todo[0].cfg, specs): batch
                   for batch, specs in sorted(tasks, key=lambda t: -_batch_cost(t[0]))}
        from concurrent.futures import as_completed

        from concurrent.futures.process import BrokenProcessPool

        try:
            for future in as_completed(futures):
                finish(futures[future], future.result())
        except BrokenProcessPool as err:
            raise RuntimeError(
                f"{study.source}: a worker process of the study died (workers: {study.workers}); the runs finished "
                "so far are kept and a rerun resumes. Worker processes are spawned and import the main module: a "
                "script that calls run_study must do so under `if __name__ == \"__main__\":`. Out of memory? Lower "
                "batch_size or workers.") from err
        return
    for j in todo:
        metrics, diverged = _run_single(j.cfg, engine)
        _write_run(runs_dir, j, metrics, diverged, engine)
        progress.done += 1
        progress.show()


def batchable(study: Study, cfg: ExperimentConfig) -> bool:
    """Whether the batched engine has closed forms for this study's model and loss (an MLP; see
    :func:`~diff2_flwr.task.models.mlp_shape`)."""
    from ..runtime.session import load_data
    from .sweep import batch_model

    try:
        batch_model(load_data(cfg), model=study.model, hidden=study.hidden, model_kwargs=study.model_kwargs,
                    loss=cfg.loss)
    except ValueError:
        return False
    return True


def _batch_cost(batch: list[_Job]) -> float:
    """Relative cost of a batch: a difference round does a little more than a restart round per run."""
    return sum(1.0 if j.cfg.restart_every == 1 else 1.5 for j in batch)


def _batches(todo: list[_Job], batch_size: int, workers: int) -> list[list[_Job]]:
    """Batches of at most ``batch_size`` runs. A batch whose runs all restart every round (T = 1) skips the
    difference terms, so T = 1 runs never share a batch with T > 1 runs; within a group batches are balanced (no
    batch much smaller than the others), sorted by T, and as many as a multiple of ``workers`` where there are
    runs enough, so that every worker process has its share."""
    batches = []
    for group in ([j for j in todo if j.cfg.restart_every == 1], [j for j in todo if j.cfg.restart_every > 1]):
        group.sort(key=lambda j: j.cfg.restart_every)
        if not group:
            continue
        count = -(-len(group) // batch_size)
        count = min(len(group), -(-count // workers) * workers)
        size = -(-len(group) // count)
        batches += [group[i:i + size] for i in range(0, len(group), size)]
    return batches


def _run_batch_task(study: Study, data_cfg: ExperimentConfig, specs: list, progress=None) -> list:
    """One batch on the batched engine (in this process or a worker's): the data of ``data_cfg``, the study's model."""
    import torch

    from ..runtime.session import load_data
    from .sweep import run_batch

    dtype = torch.float32 if study.dtype == "float32" else torch.float64
    return run_batch(load_data(data_cfg), specs, rounds=study.rounds, hidden=study.hidden, model=study.model,
                     model_kwargs=study.model_kwargs, loss=data_cfg.loss, eval_every=study.eval_every, dtype=dtype,
                     compile=study.compile, progress=progress)


def _init_worker(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def _worker_pool(study: Study):
    """A pool of ``study.workers`` processes (spawned: torch's thread pools do not survive a fork), each pinned to
    its share of the cores; None for one worker (batches run in this process)."""
    if study.workers == 1 or study.engine != "batch":
        return None
    import multiprocessing
    import os
    from concurrent.futures import ProcessPoolExecutor

    threads = max(1, (os.cpu_count() or 1) // study.workers)
    return ProcessPoolExecutor(study.workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_init_worker, initargs=(threads,))


def _run_single(cfg: ExperimentConfig, engine: str) -> tuple[dict, int | None]:
    from ..runtime.driver import run_inprocess

    if engine == "flower":
        import tempfile

        from ..runtime.launch import SimulationDiverged, run_simulation

        with tempfile.TemporaryDirectory(prefix="diff2-study-") as tmp:
            path = Path(tmp) / "run.yaml"
            data = cfg.to_dict()
            data["output"] = {"dir": tmp}
            path.write_text(yaml.safe_dump(data))
            try:
                result, diverged = run_simulation(str(path), echo=False), None
            except SimulationDiverged as err:  # a training failure: the study records it and goes on
                result, diverged = err.result, err.diverged_at
            rows = [json.loads(line) for line in (result.output_dir / "metrics.jsonl").read_text().splitlines()]
    else:
        server = run_inprocess(cfg, record=False, progress=None, stop_on_divergence=True)
        rows = server.history
        diverged = server.diverged_at
    rows = [r for r in rows if "train_loss" in r or "test_loss" in r]
    accuracy = any(ACCURACY in r for r in rows)
    if diverged is not None:  # the diverged iterate has no finite metrics: its criteria are inf from then on
        rows.append({"round": diverged, **{c: math.inf for c in CRITERIA}, ACCURACY: math.nan})
    metrics = {"rounds": [r["round"] for r in rows], **{c: [r.get(c, math.inf) for r in rows] for c in CRITERIA}}
    if accuracy:  # a diverged iterate's accuracy is unknown (NaN), never counted as a best
        metrics[ACCURACY] = [r.get(ACCURACY, math.nan) for r in rows]
    return metrics, diverged


def _write_run(runs_dir: Path, job: _Job, metrics: dict, diverged: int | None, engine: str) -> None:
    record = {"run_id": job.run_id, "method": job.method.name, "base_method": job.method.method, "point": job.point,
              "epsilon": job.epsilon, "seed": job.seed, "engine": engine, "diverged_at": diverged, **metrics}
    tmp = runs_dir / f"{job.run_id}.json.tmp"
    tmp.write_text(json.dumps(to_json(record)))
    tmp.replace(runs_dir / f"{job.run_id}.json")


def _load_run(runs_dir: Path, run_id: str) -> dict:
    record = json.loads((runs_dir / f"{run_id}.json").read_text())
    for c in CRITERIA:  # null = inf/NaN (a diverged run)
        record[c] = [math.inf if v is None else v for v in record[c]]
    if ACCURACY in record:
        record[ACCURACY] = [math.nan if v is None else v for v in record[ACCURACY]]
    return record


def _best_accuracy(values: Sequence[float]) -> float:
    """The largest finite accuracy over rounds (NaN if none: the run diverged before any evaluation)."""
    finite = [v for v in values if math.isfinite(v)]
    return max(finite) if finite else math.nan


def _point_key(point: Mapping[str, float]) -> str:
    return json.dumps(dict(point), sort_keys=True)


def run_study(
    study: Study, *, output_root: str | Path | None = None, fresh: bool = False, show_progress: bool = True,
    make_plots: bool = True,
) -> dict:
    """Run the whole study (resumable) and write summary.json, report.md and plots; return the summary."""
    from ..runtime.session import load_data
    from ..runtime.shard_report import check_shards

    root = Path(output_root or study.output_dir).expanduser().resolve() / study.name
    runs_dir = root / "runs"
    if fresh and runs_dir.exists():
        for f in runs_dir.glob("*.json"):
            f.unlink()
    runs_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    probe = study.experiment(study.methods[0], study.methods[0].points()[0], study.epsilons[0], study.tune_seeds[0])
    data = load_data(probe)
    # Every configuration of the grid passes the partition's refusal rule (min_samples, max_sigma) before any
    # run starts, on every engine: the batched one never builds a server that would check it.
    for epsilon in study.epsilons:
        for m in study.methods:
            for p in m.points():
                cfg = study.experiment(m, p, epsilon, study.tune_seeds[0])
                check_shards(cfg, data.shard_sizes, cfg.calibration(cfg.privacy.n_min or data.n_min))
    summary: dict[str, Any] = {"study": study.name, "source": study.source, "rounds": study.rounds, "delta": study.delta,
                               "mode": study.mode, "clients": study.clients, "n_min": data.n_min,
                               "tune_seeds": list(study.tune_seeds), "eval_seeds": list(study.eval_seeds),
                               "engine": study.engine, "workers": study.workers, "dtype": study.dtype, "epsilons": {}}
    n_tune = sum(len(m.points()) for m in study.methods) * len(study.tune_seeds) * len(study.epsilons)
    progress = _Progress(n_tune + 2 * len(study.methods) * len(study.eval_seeds) * len(study.epsilons), show_progress)
    pool = _worker_pool(study)
    try:
        _run_epsilons(study, runs_dir, progress, summary, data.n_min, pool)
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    progress.finish()
    summary["wall_time_s"] = time.perf_counter() - started
    (root / "summary.json").write_text(json.dumps(to_json(summary), indent=2) + "\n")
    from .report import write_report

    write_report(study, summary, root, runs_dir, make_plots=make_plots)
    return summary


def _run_epsilons(study: Study, runs_dir: Path, progress: _Progress, summary: dict, n_min: int, pool) -> None:
    for epsilon in study.epsilons:
        # 1. tuning
        tune_jobs = [
            _Job(_run_id("tune", m, p, epsilon, s, study), m, p, epsilon, s, study.experiment(m, p, epsilon, s))
            for m in study.methods for p in m.points() for s in study.tune_seeds
        ]
        _execute(study, tune_jobs, runs_dir, progress, pool)
        # 2. selection
        chosen: dict[str, dict[str, dict]] = {}
        for m in study.methods:
            table: dict[str, dict[str, list[float]]] = {}
            for p in m.points():
                records = [_load_run(runs_dir, _run_id("tune", m, p, epsilon, s, study)) for s in study.tune_seeds]
                table[_point_key(p)] = {c: [min(r[c]) for r in records] for c in CRITERIA}
            picks = select(table)
            chosen[m.name] = {c: json.loads(picks[c]) for c in CRITERIA}
        # 3. evaluation
        eval_jobs, seen = [], set()
        for m in study.methods:
            for c in CRITERIA:
                p = chosen[m.name][c]
                for s in study.eval_seeds:
                    rid = _run_id("eval", m, p, epsilon, s, study)
                    if rid not in seen:
                        seen.add(rid)
                        eval_jobs.append(_Job(rid, m, p, epsilon, s, study.experiment(m, p, epsilon, s)))
        progress.total -= 2 * len(study.methods) * len(study.eval_seeds) - len(eval_jobs)
        _execute(study, eval_jobs, runs_dir, progress, pool)
        # 4. summary
        summary["epsilons"][str(epsilon)] = _summarise(study, epsilon, chosen, runs_dir, n_min)


def _summarise(study: Study, epsilon: float, chosen: dict, runs_dir: Path, n_min: int) -> dict:
    out: dict[str, Any] = {"methods": {}, "tests": {}}
    per_seed_min: dict[str, dict[str, list[float]]] = {}
    per_seed_final: dict[str, dict[str, list[float]]] = {}
    for m in study.methods:
        entry: dict[str, Any] = {"base_method": m.method, "u": m.u, "criteria": {}}
        per_seed_min[m.name], per_seed_final[m.name] = {}, {}
        for c in CRITERIA:
            point = chosen[m.name][c]
            runs = [_load_run(runs_dir, _run_id("eval", m, point, epsilon, s, study)) for s in study.eval_seeds]
            mins = [min(r[c]) for r in runs]
            finals = [r[c][-1] for r in runs]
            per_seed_min[m.name][c], per_seed_final[m.name][c] = mins, finals
            cfg = study.experiment(m, point, epsilon, study.eval_seeds[0])
            cal = cfg.calibration(n_min)
            entry["criteria"][c] = {
                "point": point, "run_ids": [r["run_id"] for r in runs],
                "min_mean": _mean(mins), "min_std": _std(mins), "final_mean": _mean(finals), "final_std": _std(finals),
                "diverged": sum(r["diverged_at"] is not None for r in runs),
                "calibration": None if cal is None else {k: cal.as_dict()[k] for k in ("sigma1", "sigma2", "z1", "z2", "mode")},
            }
        point = chosen[m.name]["train_loss"]
        runs = [_load_run(runs_dir, _run_id("eval", m, point, epsilon, s, study)) for s in study.eval_seeds]
        if all(ACCURACY in r for r in runs):
            best, finals = [_best_accuracy(r[ACCURACY]) for r in runs], [r[ACCURACY][-1] for r in runs]
            per_seed_min[m.name][ACCURACY], per_seed_final[m.name][ACCURACY] = best, finals
            entry["accuracy"] = {"at": "train_loss", "point": point, "run_ids": [r["run_id"] for r in runs],
                                 "best_mean": _mean(best), "best_std": _std(best),
                                 "final_mean": _mean(finals), "final_std": _std(finals),
                                 "best_per_seed": best, "final_per_seed": finals}
        out["methods"][m.name] = entry
    controls = [m for m in study.methods if m.method == "dpgd"]
    for control in controls[:1]:
        for m in study.methods:
            if m.method != "diff2":
                continue
            out["tests"][f"{m.name} vs {control.name}"] = {
                c: {"p_value": paired_one_sided_ttest(per_seed_min[m.name][c], per_seed_min[control.name][c]),
                    "df": len(study.eval_seeds) - 1,
                    "treatment_min_mean": _mean(per_seed_min[m.name][c]),
                    "control_min_mean": _mean(per_seed_min[control.name][c]),
                    # the same test on the final values (the paper's "at the final rounds")
                    "p_value_final": paired_one_sided_ttest(per_seed_final[m.name][c], per_seed_final[control.name][c])}
                for c in CRITERIA
            }
            if ACCURACY in per_seed_min[m.name] and ACCURACY in per_seed_min[control.name]:
                treat, ctrl = per_seed_min[m.name][ACCURACY], per_seed_min[control.name][ACCURACY]
                # larger is better: H1 is DIFF2's accuracy > DP-GD's, i.e. the control's < the treatment's
                out["tests"][f"{m.name} vs {control.name}"][ACCURACY] = {
                    "p_value": paired_one_sided_ttest(ctrl, treat), "df": len(study.eval_seeds) - 1,
                    "treatment_best_mean": _mean(treat), "control_best_mean": _mean(ctrl),
                    "p_value_final": paired_one_sided_ttest(per_seed_final[control.name][ACCURACY],
                                                            per_seed_final[m.name][ACCURACY])}
    return out


def _mean(values: Sequence[float]) -> float:
    arr = np.asarray(values, dtype=float)
    return float(np.mean(arr)) if np.all(np.isfinite(arr)) else math.inf


def _std(values: Sequence[float]) -> float:
    arr = np.asarray(values, dtype=float)
    return float(np.std(arr, ddof=1)) if arr.size > 1 and np.all(np.isfinite(arr)) else math.nan
