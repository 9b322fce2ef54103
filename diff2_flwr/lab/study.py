"""Studies: the paper's protocol (grid search per method, seeds, criteria, t-tests) from one YAML file.

A study names a dataset, R, δ and a list of ε; a list of methods, each a base method (gd,
dpgd, diff2) with a routine (gd by default; momentum, nesterov, adam, adamw: post-processing of
ṽ_r, no privacy cost) and a grid of hyper-parameters (learning rate, C1, C2, T, and the routine's
own parameters, e.g. beta1); tuning seeds and evaluation seeds. For every ε it

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
an interrupted study resumes where it stopped. Runs are computed in units (:func:`plan_units`,
:func:`compute_unit`) here or on a Ray cluster (:mod:`.cluster`), each run claimed first
(:mod:`.claims`), so several drivers may share one output folder without computing a run twice.

References:
    Murata & Suzuki (2023), Section 6; DIFF2.md, "The paper's experiments".
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, Sequence

import numpy as np
import yaml

from ..core.routines import ROUTINES
from .inference import paired_ttest
from .analysis import MAX_EXTENSIONS, correct_families, endpoint_value
from ..runtime.config import ConfigError, ExperimentConfig
from ..runtime.outputs import to_json
from ..runtime.progress import ProgressReporter
from .claims import STALE_AFTER_S, ClaimBook, Owner, atomic_write_text
from .study_spec import ACCURACY, CRITERIA, GRID_KEYS, LOCAL_KEYS, ROUTINE_GRID_KEYS, MethodSpec, Study, StudyError
from .study_spec import load_study, parse_study, test_pairs
from .study_spec import slug as _slug

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


# ------------------------------------------------------------------------------- statistics

def paired_one_sided_ttest(treatment: Sequence[float], control: Sequence[float]) -> float:
    """p-value of the paired t-test with H1: mean(treatment - control) < 0 (n - 1 degrees of freedom)."""
    return paired_ttest(treatment, control, "less")


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

def _method_key(method: MethodSpec) -> dict:
    """What identifies a method's runs; a plain-GD method's is as before routines existed (its run files are reused)."""
    key = asdict(method)
    if method.routine == "gd" and not method.routine_params:
        del key["routine"], key["routine_params"]
    if not method.local:  # run ids of methods without a local routine are as before it existed
        del key["local"]
    if method.rounds is None:  # nor are those of methods that run the study's R
        del key["rounds"]
    if not method.seed_offset:
        del key["seed_offset"]
    return key


def _run_id(phase: str, method: MethodSpec, point: Mapping[str, float], epsilon: float, seed: int, study: Study) -> str:
    key = json.dumps({"phase": phase, "method": _method_key(method), "point": dict(point), "epsilon": epsilon, "seed": seed,
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
    """Runs done / total with an ETA on stderr: a live bar on a terminal, plain periodic lines otherwise.

    The total never goes down: it is the plan (every grid point on the tuning seeds, and per method and
    selection criterion its pick on the evaluation seeds), grown only when a grid extends (:meth:`grow`).
    Runs found done (reused, by other drivers, or shared by two criteria that picked one point) count as done.
    """

    def __init__(self, total: int, enabled: bool) -> None:
        self._total, self.done = total, 0
        self._reporter = ProgressReporter(total, label="runs", enabled=enabled)

    @property
    def total(self) -> int:
        return self._total

    def grow(self, runs: int) -> None:
        """``runs`` more runs to do than planned (a grid extension)."""
        if runs < 0:
            raise ValueError(f"`runs`: the study's total of runs only grows. Found {runs}.")
        self._total += runs

    def show(self, fraction_of_batch: float = 0.0, batch: int = 0) -> None:
        if self._reporter.total != self.total:
            self._reporter.set_total(self.total)
        self._reporter.update(self.done + fraction_of_batch * batch)

    def finish(self) -> None:
        self._reporter.finish()


@dataclass(frozen=True)
class Unit:
    """Runs computed together, in one process: one batch of the batched engine, or one run of another engine."""

    engine: str
    jobs: tuple[_Job, ...]


def plan_units(study: Study, jobs: Sequence[_Job]) -> list[Unit]:
    """Split ``jobs`` into units, deterministically (the same jobs always give the same units).

    The batched engine takes batches of at most ``study.batch_size`` runs: a batch whose runs all
    restart every round (T = 1) skips the previous iterate's pass, so T = 1 runs never share a
    batch with T > 1 runs; within a group, batches are balanced (no batch much smaller than the
    others), sorted by T, and as many as a multiple of ``study.workers`` where there are runs
    enough, so that every worker process has its share. Runs the batched engine cannot run (a
    model that is not an MLP, a routine that computes on private data, the local routine) are
    units of one ``inprocess`` run. Units are ordered by their cost, largest first, so that no
    worker is left with a big one at the end.
    """
    engine = study.engine
    if engine != "batch":
        return [Unit(engine, (j,)) for j in jobs]
    mlp = bool(jobs) and batchable(study, jobs[0].cfg)  # one model and dataset per study
    fits = [j for j in jobs if mlp and ROUTINES[j.cfg.training.routine.name].post_processing
            and not j.cfg.local.enabled]
    units = [Unit("inprocess", (j,)) for j in jobs if j not in fits]
    groups = {(j.cfg.training.rounds, j.cfg.restart_every == 1): None for j in fits}  # a batch shares R
    for rounds, every in groups:
        group = [j for j in fits if (j.cfg.training.rounds, j.cfg.restart_every == 1) == (rounds, every)]
        group.sort(key=lambda j: j.cfg.restart_every)
        if group:
            count = -(-len(group) // study.batch_size)
            count = min(len(group), -(-count // study.workers) * study.workers)
            size = -(-len(group) // count)
            units += [Unit(engine, tuple(group[i:i + size])) for i in range(0, len(group), size)]
    return sorted(units, key=_unit_cost, reverse=True)  # stable: equal costs keep their order


def _unit_cost(unit: Unit) -> float:
    """Relative cost of a unit, in batched-engine restart rounds of one run: a difference round does a little more
    than a restart round; one run on the per-run path costs about as much as a batch of twenty."""
    if unit.engine != "batch":
        return 20.0 * sum(j.cfg.training.rounds for j in unit.jobs)
    return sum((1.0 if j.cfg.restart_every == 1 else 1.5) * j.cfg.training.rounds for j in unit.jobs)


def batchable(study: Study, cfg: ExperimentConfig) -> bool:
    """Whether the batched engine has closed forms for this study's model and loss (an MLP; see
    :func:`~diff2_flwr.task.models.mlp_shape`)."""
    from .cluster import unit_data
    from .sweep import batch_model

    try:
        batch_model(unit_data(cfg), model=study.model, hidden=study.hidden, model_kwargs=study.model_kwargs,
                    loss=cfg.loss)
    except ValueError:
        return False
    return True


def compute_unit(study: Study, unit: Unit, progress: Callable[[int, int], None] | None = None) -> list[dict]:
    """Compute the runs of ``unit`` in this process; one ``{"metrics", "diverged_at", "engine"}`` per run.

    Every thread pool is pinned to ``study.threads`` while it computes (the inprocess and flower
    engines pin ``training.threads``, which the study sets to the same): on one machine a unit
    gives the same bits wherever it runs, in the driver, in a worker process or in a task on a
    cluster node.
    """
    from ..runtime.compute import pinned_threads
    from .cluster import unit_data

    if unit.engine != "batch":
        out = []
        for j in unit.jobs:
            metrics, diverged = _run_single(j.cfg, unit.engine)
            out.append({"metrics": metrics, "diverged_at": diverged, "engine": unit.engine})
        return out
    import torch

    from .sweep import RunSpec, run_batch

    batch = unit.jobs
    with pinned_threads(study.threads):
        cfg = batch[0].cfg
        data = unit_data(cfg)
        n_min = data.n_min
        dtype = torch.float32 if study.dtype == "float32" else torch.float64
        specs = []
        for j in batch:
            mech = j.cfg.mechanism(j.cfg.calibration(n_min))
            routine = j.cfg.training.routine
            specs.append(RunSpec(mech.restart_every, j.cfg.training.learning_rate, mech.clip_restart,
                                 mech.clip_diff, mech.sigma_restart, mech.sigma_diff, j.cfg.training.seed,
                                 j.cfg.model.init_seed,
                                 routine=routine.name, routine_params=tuple(sorted(routine.params().items()))))
        results = run_batch(data, specs, rounds=cfg.training.rounds, hidden=study.hidden, model=study.model,
                            model_kwargs=study.model_kwargs, loss=cfg.loss, eval_every=study.eval_every,
                            dtype=dtype, compile=study.compile, progress=progress)
    out = []
    for res in results:
        metrics = {"rounds": res.rounds.tolist(), "train_loss": res.train_loss.tolist(),
                   "grad_norm_sq": res.grad_norm_sq.tolist(), "test_loss": res.test_loss.tolist()}
        if res.test_accuracy is not None:
            metrics[ACCURACY] = res.test_accuracy.tolist()
        out.append({"metrics": metrics, "diverged_at": res.diverged_at, "engine": "batch"})
    return out


#: Seconds between two looks at runs that other drivers are computing.
POLL_S = 1.0


def _execute(study: Study, jobs: list[_Job], runs_dir: Path, progress: _Progress, executor: Any,
             book: ClaimBook, tally: dict[str, int]) -> None:
    """Compute every job whose result file is missing, each exactly once across the drivers sharing ``runs_dir``.

    Units are planned from the missing runs and claimed run by run (:class:`ClaimBook`); a unit is
    computed (by ``executor``: here, or as tasks of a Ray cluster) for the runs this driver won,
    and each result is written atomically. Runs held by other drivers are waited for; when their
    claims turn stale (the driver died) they are planned again and taken over.
    """
    todo = [j for j in jobs if not book.done(j.run_id)]
    if len(todo) < len(jobs):
        book.sweep_finished(j.run_id for j in jobs if j not in todo)
    tally["reused"] += len(jobs) - len(todo)
    progress.done += len(jobs) - len(todo)
    progress.show()
    queue = collections.deque(plan_units(study, todo))
    waiting: list[_Job] = []  # held by other drivers
    announced = False
    while queue or executor.in_flight or waiting:
        while queue and executor.has_capacity():
            unit = queue.popleft()
            mine = set(book.claim([j.run_id for j in unit.jobs]))
            others = [j for j in unit.jobs if j.run_id not in mine]
            waiting += [j for j in others if not book.done(j.run_id)]
            tally["by_others"] += len(others) - sum(1 for j in others if j in waiting)
            progress.done += len(others) - sum(1 for j in others if j in waiting)
            if mine:
                got = Unit(unit.engine, tuple(j for j in unit.jobs if j.run_id in mine))
                executor.submit(study, got, lambda r, total, n=len(got.jobs): (
                    progress.show(r / total, n) if r % 20 == 0 else None))
        if executor.in_flight:
            for unit, outcomes in executor.completed(timeout=POLL_S):
                for j, outcome in zip(unit.jobs, outcomes):
                    _write_run(runs_dir, j, outcome["metrics"], outcome["diverged_at"], outcome["engine"],
                               {"driver": book.owner.driver, "host": outcome.get("host", book.owner.host)})
                    book.finish(j.run_id)
                tally["computed"] += len(unit.jobs)
                progress.done += len(unit.jobs)
                progress.show()
        if waiting:
            finished = [j for j in waiting if book.done(j.run_id)]
            tally["by_others"] += len(finished)
            progress.done += len(finished)
            if finished:
                progress.show()
            waiting = [j for j in waiting if not book.done(j.run_id)]
            if not waiting or executor.in_flight or queue:
                continue
            if not announced:
                holders = {_describe(book.held_by_other(j.run_id)) for j in waiting}
                print(f"[diff2] study {study.name}: waiting for {len(waiting)} run(s) held by other driver(s) "
                      f"({', '.join(sorted(holders))})", file=sys.stderr)
                announced = True
            book.refresh()
            stale = [j for j in waiting if not book.held_by_other(j.run_id)]
            if stale:  # their driver is gone: take them over
                waiting = [j for j in waiting if j not in stale]
                queue.extend(plan_units(study, stale))
            else:
                time.sleep(POLL_S)


def _describe(owner: Any) -> str:
    if isinstance(owner, Owner):
        return f"{owner.host} pid {owner.pid}"
    return "a driver whose claim is being written" if owner else "released"


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


def _write_run(runs_dir: Path, job: _Job, metrics: dict, diverged: int | None, engine: str,
               computed_by: Mapping[str, str] | None = None) -> None:
    record = {"run_id": job.run_id, "method": job.method.name, "base_method": job.method.method,
              "routine": job.method.routine_of(job.point), "point": job.point,
              "epsilon": job.epsilon, "seed": job.seed, "engine": engine, "diverged_at": diverged, **metrics,
              "computed_by": dict(computed_by or {})}
    atomic_write_text(runs_dir / f"{job.run_id}.json", json.dumps(to_json(record)))


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
    make_plots: bool = True, ray_address: str | None = None, stale_after_s: float = STALE_AFTER_S,
) -> dict:
    """Run the whole study (resumable) and write summary.json, report.md and plots; return the summary.

    With ``ray_address`` the units run as tasks of that Ray cluster (:class:`~.cluster.RayExecutor`),
    else in this process. Any number of drivers (processes, machines) may share one output folder:
    each run is claimed before it is computed (:mod:`~.claims`), so none is computed twice, every
    file is written whole, and a run claimed by a driver that died is taken over (at once if that
    driver ran on this machine, else after ``stale_after_s`` seconds without its heartbeat).
    """
    if ray_address is not None and study.engine == "flower":
        raise StudyError(f"{study.source}: key `engine`: expected 'batch' or 'inprocess' on a Ray cluster (each "
                         "`flower` run is a Flower simulation that starts its own Ray). Found 'flower'.")
    root = Path(output_root or study.output_dir).expanduser().resolve() / study.name
    runs_dir = root / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    # On the way out (done, error, Ctrl-C): the executor stops first, then every claim still held is released.
    with ClaimBook(runs_dir, stale_after_s=stale_after_s) as book, contextlib.ExitStack() as cleanup:
        if fresh:
            live = book.live_foreign_claims()
            if live:
                path, owner = live[0]
                who = f"driver on {owner.host} (pid {owner.pid})" if owner else "another driver"
                raise StudyError(
                    f"{study.source}: --fresh would delete the runs of {runs_dir}, but {len(live)} run(s) there are "
                    f"claimed by a live {who}, e.g. {path.name}. Stop that driver first (or, if it is gone and "
                    "ran on another machine, delete runs/*.claim-*), or run without --fresh to share its work.")
            for f in runs_dir.glob("*.json"):
                f.unlink()
            book.clear()
        return _run_study(study, root, runs_dir, book, cleanup, ray_address=ray_address, show_progress=show_progress,
                          make_plots=make_plots)


def _run_study(study: Study, root: Path, runs_dir: Path, book: ClaimBook, cleanup: contextlib.ExitStack, *,
               ray_address: str | None, show_progress: bool, make_plots: bool) -> dict:
    from ..runtime.shard_report import check_shards
    from .cluster import LocalExecutor, PoolExecutor, RayExecutor, code_fingerprint, node_report, unit_data

    started = time.perf_counter()
    probe = study.experiment(study.methods[0], study.methods[0].points()[0], study.epsilons[0], study.tune_seeds[0])
    data = unit_data(probe)
    # Every configuration of the grid passes the partition's refusal rule (min_samples, max_sigma) before any
    # run starts, on every engine: the batched one never builds a server that would check it.
    for epsilon in study.epsilons:
        for m in study.methods:
            for p in m.points():
                cfg = study.experiment(m, p, epsilon, study.tune_seeds[0])
                check_shards(cfg, data.shard_sizes, cfg.calibration(cfg.privacy.n_min or data.n_min))
    summary: dict[str, Any] = {"study": study.name, "source": study.source, "rounds": study.rounds, "delta": study.delta,
                               "mode": study.mode, "clients": study.clients, "n_min": data.n_min,
                               "dataset": _data_info(study, probe, data),
                               "tune_seeds": list(study.tune_seeds), "eval_seeds": list(study.eval_seeds),
                               "engine": study.engine, "dtype": study.dtype, "threads": study.threads,
                               "workers": study.workers, "epsilons": {}}
    n_tune = sum(len(m.points()) for m in study.methods) * len(study.tune_seeds) * len(study.epsilons)
    n_eval = 2 * len(study.methods) * len(study.eval_seeds) * len(study.epsilons)
    progress = _Progress(n_tune + n_eval, show_progress)
    tally = {"computed": 0, "by_others": 0, "reused": 0}
    if ray_address is not None and study.workers > 1:
        print(f"[diff2] study {study.name}: `workers: {study.workers}` is for this machine; on the Ray cluster the "
              "cluster's CPUs set how many units run at once", file=sys.stderr)
    executor = (LocalExecutor(compute_unit) if ray_address is None and study.workers == 1 else
                PoolExecutor(compute_unit, study.workers, study.source) if ray_address is None else
                RayExecutor(ray_address, compute_unit, threads=study.threads,
                            expect={"code": code_fingerprint(), "data": node_report(probe)["data"]}))
    cleanup.callback(executor.close)
    rows: list[dict] = []  # every test of the study, across ε: the families are corrected over all of them
    for epsilon in study.epsilons:
        # 1. tuning, and 2. selection on the tuning seeds' mean; an edge pick extends its axis and re-tunes
        chosen, searched = _tune(study, epsilon, data, runs_dir, progress, executor, book, tally)
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
        _execute(study, eval_jobs, runs_dir, progress, executor, book, tally)
        # Planned per selection criterion (train loss, ‖∇f‖²); where both picked one point, its runs are done with
        # their twins.
        progress.done += 2 * len(study.methods) * len(study.eval_seeds) - len(eval_jobs)
        progress.show()
        # 4. summary
        summary["epsilons"][str(epsilon)] = _summarise(study, epsilon, chosen, searched, runs_dir, data.n_min,
                                                       sum(data.shard_sizes), rows)
    summary["inference"] = _inference(study, rows)
    progress.finish()
    summary["wall_time_s"] = time.perf_counter() - started
    # Who computed what, as this driver saw it (drivers sharing the folder each rewrite the summary, whole).
    summary["execution"] = {**executor.describe(), "driver": book.owner.driver, "host": book.owner.host,
                            "runs_computed_here": tally["computed"], "runs_by_other_drivers": tally["by_others"],
                            "runs_reused": tally["reused"]}
    print(f"[diff2] study {study.name}: {tally['computed']} run(s) computed by this driver "
          f"({summary['execution']['executor']}), {tally['by_others']} by other drivers, {tally['reused']} reused",
          file=sys.stderr)
    atomic_write_text(root / "summary.json", json.dumps(to_json(summary), indent=2) + "\n")
    from .report import write_report

    write_report(study, summary, root, runs_dir, make_plots=make_plots)
    return summary


def _tune(study: Study, epsilon: float, data: Any, runs_dir: Path, progress: _Progress, executor: Any,
          book: ClaimBook, tally: dict[str, int]) -> tuple[dict[str, dict[str, dict]], dict[str, dict]]:
    """Tune every method at ``epsilon``: run its grid on the tuning seeds, pick per criterion, and extend where a
    pick lies on an edge, until no pick moves outward.

    The extension is a line search: when the pick's value of a key is the smallest or largest among the tuned
    points that agree with the pick on every other key (its *line*), the point one geometric step further along
    that key is tuned too (within the analysis's ``extend`` bounds, at most ``MAX_EXTENSIONS`` steps per key and
    side), and the picks are made again over every tuned point. One new point per step: extending the whole
    product would multiply the cost by every axis that moves at once.

    Returns the picks (method -> criterion -> point) and, per method, the values searched per key, the points
    tuned, the extensions made and the picks that stay on an edge (with the reason).
    """
    from ..runtime.shard_report import check_shards

    tuned = {m.name: m.points() for m in study.methods}
    made: dict[str, list[dict]] = {m.name: [] for m in study.methods}
    count: dict[tuple[str, str, str], int] = collections.Counter()
    refused: dict[tuple[str, str, str], str] = {}
    done: set[str] = set()
    while True:
        jobs = [_Job(_run_id("tune", m, p, epsilon, s, study), m, p, epsilon, s, study.experiment(m, p, epsilon, s))
                for m in study.methods for p in tuned[m.name] for s in study.tune_seeds]
        jobs = [j for j in jobs if j.run_id not in done]  # each extension tunes its new points only
        done.update(j.run_id for j in jobs)
        _execute(study, jobs, runs_dir, progress, executor, book, tally)
        chosen = {m.name: _select_method(study, m, tuned[m.name], epsilon, runs_dir) for m in study.methods}
        grown = False
        for m in study.methods:
            for c in ("train_loss", "grad_norm_sq"):
                pick = chosen[m.name][c]
                for key, value in pick.items():
                    line = _line(tuned[m.name], pick, key)
                    bounds = study.analysis.bounds(key)
                    if len(line) < 2 or bounds is None or value not in (line[0], line[-1]):
                        continue
                    side = "high" if value == line[-1] else "low"
                    if count[m.name, key, side] >= MAX_EXTENSIONS or (m.name, key, side) in refused:
                        continue
                    new = _step_out(line, side, key)
                    if not bounds[0] <= new <= bounds[1]:
                        refused[m.name, key, side] = f"the bound {bounds[0 if side == 'low' else 1]:g} of analysis.extend"
                        continue
                    point = dict(pick) | {key: new}
                    if point in tuned[m.name]:
                        continue
                    try:  # the new point must pass the partition's refusal rule like the declared ones
                        cfg = study.experiment(m, point, epsilon, study.tune_seeds[0])
                        check_shards(cfg, data.shard_sizes, cfg.calibration(cfg.privacy.n_min or data.n_min))
                    except (ConfigError, ValueError) as err:
                        refused[m.name, key, side] = f"{new:g} is refused: {str(err).splitlines()[0]}"
                        continue
                    tuned[m.name].append(point)
                    count[m.name, key, side] += 1
                    made[m.name].append({"key": key, "value": new, "side": side, "because": c, "point": point})
                    print(f"[diff2] study {study.name}, ε = {epsilon:g}: {m.name} picked {key} = {value:g} on the "
                          f"{side} edge of its line for {c}: tuning {key} = {new:g} there", file=sys.stderr)
                    progress.grow(len(study.tune_seeds))
                    grown = True
        if not grown:
            break
    searched = {}
    for m in study.methods:
        edges = {}
        for c in ("train_loss", "grad_norm_sq"):
            hits = []
            for key, value in chosen[m.name][c].items():
                line = _line(tuned[m.name], chosen[m.name][c], key)
                if len(line) > 1 and value in (line[0], line[-1]):
                    side = "high" if value == line[-1] else "low"
                    why = (refused.get((m.name, key, side))
                           or ("at most " + str(MAX_EXTENSIONS) + " extensions per key and side"
                               if count[m.name, key, side] >= MAX_EXTENSIONS else
                               "not extended: no bound in analysis.extend" + (" (the paper's protocol extends nothing)"
                                                                             if not study.analysis.corrected else "")))
                    hits.append({"key": key, "value": value, "side": side, "why": why})
            if hits:
                edges[c] = hits
        values = {k: sorted({float(p[k]) for p in tuned[m.name]}) for k, _ in m.grid}
        searched[m.name] = {"grid": values, "points": len(tuned[m.name]), "extensions": made[m.name], "edges": edges}
    return chosen, searched


def _line(points: Sequence[Mapping[str, float]], pick: Mapping[str, float], key: str) -> list[float]:
    """The sorted values of ``key`` among the points that agree with ``pick`` on every other key."""
    return sorted({float(p[key]) for p in points if all(p[k] == v for k, v in pick.items() if k != key)})


def _step_out(axis: Sequence[float], side: str, key: str) -> float:
    """One geometric step past an edge of a grid axis: the ratio of its two outermost values on that side."""
    if side == "high":
        new = axis[-1] * axis[-1] / axis[-2]
    else:
        new = axis[0] * axis[0] / axis[1]
    if key == "restart_every":
        new = float(round(new))
        if new in axis:
            new = axis[-1] + 1 if side == "high" else axis[0] - 1
    return float(new)


def _select_method(study: Study, m: MethodSpec, points: Sequence[Mapping[str, float]], epsilon: float,
                   runs_dir: Path) -> dict[str, dict]:
    """Per criterion, the point with the best mean over the tuning seeds of the criterion's selection endpoint."""
    table: dict[str, dict[str, list[float]]] = {}
    for p in points:
        records = [_load_run(runs_dir, _run_id("tune", m, p, epsilon, s, study)) for s in study.tune_seeds]
        table[_point_key(p)] = {}
        for c in ("train_loss", "grad_norm_sq"):
            e = study.analysis.selection(c)
            table[_point_key(p)][c] = [endpoint_value(r, c, e.at, e.scale) for r in records]
        table[_point_key(p)]["test_loss"] = table[_point_key(p)]["train_loss"]
    picks = select(table)
    return {c: json.loads(picks[c]) for c in CRITERIA}



def _data_info(study: Study, probe: ExperimentConfig, data: Any) -> dict[str, Any]:
    """The data a study trained on: its dataset settings, the training records n (the sum of the shard sizes), the
    test records, the shard sizes, the subsample (``train_samples``) if any, and the model's parameter count d."""
    from ..runtime.session import initial_parameters, subsample_info

    settings = {k: v for k, v in study.dataset.items() if k != "dir"}  # where the files lie is not the data
    return {"settings": settings, "name": data.name, "train": int(sum(data.shard_sizes)),
            "test": int(data.x_test.shape[0]), "shard_sizes": list(data.shard_sizes), **subsample_info(probe, data),
            "parameters": int(initial_parameters(probe, data).size), "features": data.num_features,
            "outputs": data.num_outputs}


def _stats(values: Sequence[float]) -> dict[str, Any]:
    return {"mean": _mean(values), "std": _std(values), "per_seed": list(values)}


def _summarise(study: Study, epsilon: float, chosen: dict, searched: dict, runs_dir: Path, n_min: int, n_train: int,
               rows: list[dict]) -> dict:
    """One ε's summary: per method and criterion the chosen point and the endpoint values over the evaluation seeds;
    per tested pair the paired t-tests (appended to ``rows``, corrected over the whole study afterwards)."""
    analysis = study.analysis
    out: dict[str, Any] = {"methods": {}, "tests": {}}
    runs_of: dict[tuple[str, str], list[dict]] = {}
    for m in study.methods:
        entry: dict[str, Any] = {"base_method": m.method, "u": m.u, "routine": m.routine_of({}),
                                 "rounds": study.rounds_of(m), "seed_offset": m.seed_offset,
                                 "grid": {k: list(v) for k, v in m.grid}, "grid_searched": searched[m.name]["grid"],
                                 "points_tuned": searched[m.name]["points"],
                                 "extensions": searched[m.name]["extensions"], "edges": searched[m.name]["edges"],
                                 "criteria": {}}
        for c in CRITERIA:
            point = chosen[m.name][c]
            runs = [_load_run(runs_dir, _run_id("eval", m, point, epsilon, s, study)) for s in study.eval_seeds]
            runs_of[m.name, c] = runs
            cfg = study.experiment(m, point, epsilon, study.eval_seeds[0])
            cal = cfg.calibration(n_min)
            info: dict[str, Any] = {
                "point": point, "run_ids": [r["run_id"] for r in runs], "selected_by": (
                    analysis.selection(c).as_dict() if c != "test_loss" else {"criterion": "train_loss", "at": "the "
                                                                              "train-loss pick"}),
                "diverged": sum(r["diverged_at"] is not None for r in runs),
                "calibration": None if cal is None else {k: cal.as_dict()[k] for k in ("sigma1", "sigma2", "z1", "z2", "mode")},
                "at": {}}
            for at in analysis.reported_at(c):
                info["at"][at] = _stats([endpoint_value(r, c, at) for r in runs])
            for name, at in (("min", "best"), ("train_best", "train_best"), ("final", "final")):
                if at in info["at"]:
                    info[f"{name}_mean"], info[f"{name}_std"] = info["at"][at]["mean"], info["at"][at]["std"]
            info["reported"] = {"at": analysis.reported_at(c)[0], **info["at"][analysis.reported_at(c)[0]]}
            entry["criteria"][c] = info
        runs = runs_of[m.name, "train_loss"]
        if all(ACCURACY in r for r in runs):
            runs_of[m.name, ACCURACY] = runs
            at_values = {at: _stats([endpoint_value(r, ACCURACY, at) for r in runs])
                         for at in analysis.reported_at(ACCURACY)}
            first = analysis.reported_at(ACCURACY)[0]
            entry["accuracy"] = {"at_point": "train_loss", "point": chosen[m.name]["train_loss"],
                                 "run_ids": [r["run_id"] for r in runs], "at": at_values,
                                 "reported": {"at": first, **at_values[first]},
                                 "final_mean": at_values["final"]["mean"], "final_std": at_values["final"]["std"]}
            if "best" in at_values:  # the paper's protocol: each run's best accuracy over rounds
                entry["accuracy"]["best_mean"], entry["accuracy"]["best_std"] = (at_values["best"]["mean"],
                                                                                 at_values["best"]["std"])
            else:
                entry["accuracy"]["train_best_mean"] = at_values["train_best"]["mean"]
        out["methods"][m.name] = entry
    for treat, control in test_pairs(study):
        pair = f"{treat} vs {control}"
        out["tests"][pair] = {}
        for c in (*CRITERIA, ACCURACY):
            if (treat, c) not in runs_of or (control, c) not in runs_of:
                continue
            ats = list(dict.fromkeys([*analysis.reported_at(c), *(e.at for e in analysis.primary if e.criterion == c)]))
            per: dict[str, Any] = {"df": len(study.eval_seeds) - 1, "rows": {}}
            for at in ats:
                declared = analysis.primary_for(c, at)
                scale = declared.scale if declared else "linear"
                alternative = declared.alternative if declared else analysis.alternative
                a = [endpoint_value(r, c, at, scale) for r in runs_of[treat, c]]
                b = [endpoint_value(r, c, at, scale) for r in runs_of[control, c]]
                row = {"epsilon": epsilon, "pair": pair, "treatment": treat, "control": control, "criterion": c,
                       "at": at, "scale": scale, "alternative": alternative,
                       "family": "primary" if declared else "exploratory",
                       "p_value": paired_ttest(a, b, alternative), "df": len(a) - 1,
                       "treatment_mean": _mean(a), "control_mean": _mean(b),
                       "mean_difference": _mean(np.subtract(a, b)) if len(a) == len(b) else math.nan}
                per["rows"][at] = row
                rows.append(row)
            per["p_value"] = per["rows"][ats[0]]["p_value"]
            per["p_value_final"] = per["rows"]["final"]["p_value"]
            out["tests"][pair][c] = per
    out["cost"] = cost_summary(study, epsilon, out["methods"], runs_dir, n_train)
    return out


def _inference(study: Study, rows: list[dict]) -> dict[str, Any]:
    """Correct the study's tests (in place: each row gains p_adjusted) and list the primary results."""
    families = correct_families(rows)
    alpha = study.analysis.alpha
    primary = [dict(r, significant=bool(math.isfinite(r["p_adjusted"]) and r["p_adjusted"] < alpha),
                    lower=("treatment" if r["mean_difference"] < 0 else "control" if r["mean_difference"] > 0
                           else "neither"))
               for r in rows if r["family"] == "primary"]
    exploratory = [r for r in rows if r["family"] == "exploratory"]
    return {**study.analysis.as_dict(), "families": families, "primary_results": primary,
            "exploratory_below_alpha": sum(1 for r in exploratory if math.isfinite(r["p_adjusted"])
                                           and r["p_adjusted"] < alpha),
            "exploratory_raw_below_alpha": sum(1 for r in exploratory if math.isfinite(r["p_value"])
                                               and r["p_value"] < alpha)}


def cost_summary(study: Study, epsilon: float, methods: Mapping[str, dict], runs_dir: Path, n_train: int) -> dict:
    """What each method's evaluated runs cost, and what it cost them to reach the reference's utility.

    Per method and criterion (at the criterion's chosen point): R, the per-sample gradient
    evaluations of the whole run (:func:`~diff2_flwr.core.cost.gradient_evaluations`), and the
    curve of the seed-mean of the running minimum against rounds and evaluations. With a reference
    method (the study's ``reference``, else its first diff2 method with GD and no local routine),
    the first evaluated round at which that curve is within ``TARGET_SLACK`` of the reference's
    mean minimum, and the evaluations spent by then ("rounds/evaluations to the reference's utility").
    """
    from ..core.cost import gradient_evaluations
    from .report import aligned_metric

    reference = study.reference or next((m.name for m in study.methods if m.method == "diff2" and m.routine == "gd"
                                         and not m.local and m.rounds is None), None)
    # the running minimum of a test metric is the test-set oracle: the corrected protocol costs the training criteria
    criteria = CRITERIA if not study.analysis.corrected else ("train_loss", "grad_norm_sq")
    out: dict[str, Any] = {"reference": reference, "target_slack": TARGET_SLACK, "n_train": n_train, "methods": {}}
    for m in study.methods:
        entry = methods[m.name]
        per: dict[str, Any] = {}
        for c in criteria:
            info = entry["criteria"][c]
            cfg = study.experiment(m, info["point"], epsilon, study.eval_seeds[0])
            rounds, values = aligned_metric([_load_run(runs_dir, rid) for rid in info["run_ids"]], c)
            running = np.minimum.accumulate(values, axis=1)  # a run that diverged keeps its best from before
            curve = np.mean(running, axis=0) if np.all(np.isfinite(running[:, -1])) else np.full(len(rounds), math.inf)
            per[c] = {"rounds": rounds.tolist(), "gradient_evaluations": gradient_evaluations(
                          rounds=int(rounds[-1]), restart_every=cfg.restart_every, n=n_train,
                          local_steps=cfg.local.steps if cfg.local.enabled else 1,
                          local_batch=cfg.local.batch_size if cfg.local.enabled else 0, at=rounds).tolist(),
                      "running_min_mean": curve.tolist(),
                      # each local phase is one more exchange, with one client
                      "local_exchanges": int(rounds[-1]) if cfg.local.enabled else 0}
        out["methods"][m.name] = {"rounds": study.rounds_of(m), "criteria": per}
    if reference is not None:
        for c in criteria:
            target = methods[reference]["criteria"][c]["min_mean"] * (1 + TARGET_SLACK)
            for name, entry in out["methods"].items():
                curve = entry["criteria"][c]
                hit = next((i for i, v in enumerate(curve["running_min_mean"]) if v <= target), None)
                curve["target"] = target if math.isfinite(target) else None
                curve["round_to_target"] = None if hit is None else curve["rounds"][hit]
                curve["evaluations_to_target"] = None if hit is None else curve["gradient_evaluations"][hit]
    return out


#: How close to the reference's mean minimum a method's curve must come to count as reaching its utility.
TARGET_SLACK = 0.05


def _mean(values: Sequence[float]) -> float:
    arr = np.asarray(values, dtype=float)
    return float(np.mean(arr)) if np.all(np.isfinite(arr)) else math.inf


def _std(values: Sequence[float]) -> float:
    arr = np.asarray(values, dtype=float)
    return float(np.std(arr, ddof=1)) if arr.size > 1 and np.all(np.isfinite(arr)) else math.nan
