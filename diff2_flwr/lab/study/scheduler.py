"""A study's scheduler: computes the planned runs that have no result file yet, each exactly once
across drivers.

The runs of one phase are planned into units (:func:`~.plan.plan_units`), claimed run by run
(:class:`~.claims.ClaimBook`), computed by an executor (here, in a local pool of worker processes,
or as tasks of a Ray cluster: :mod:`.cluster`) with :func:`compute_unit`, and written atomically
(:func:`write_run`). :class:`Progress` shows runs done / planned; :class:`Tally` counts who did
what. The run files are the one table the analysis reads (:func:`load_runs`).

References:
    :mod:`.claims` (the claim protocol); :mod:`.cluster` (the executors).
"""

from __future__ import annotations

import collections
import json
import math
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import yaml

from ...core.layout import ParameterLayout
from ...runtime.compute import pinned_threads
from ...runtime.config import ExperimentConfig
from ...runtime.driver import run_inprocess
from ...runtime.launch import SimulationDiverged, run_simulation
from ...runtime.loading import model_of
from ...runtime.outputs import to_json
from ...runtime.progress import ProgressReporter
from ...runtime.server_core import ServerSpec
from .claims import ClaimBook, Owner, atomic_write_text
from .cluster import (LocalExecutor, PoolExecutor, RayExecutor, code_fingerprint, node_report,
                      unit_data)
from .plan import Job, Unit, plan_units
from .spec import ACCURACY, CRITERIA, Study

__all__ = ["POLL_S", "Progress", "Tally", "compute_unit", "execute", "load_run", "load_runs",
           "make_executor", "write_run"]

#: Seconds between two looks at runs that other drivers are computing.
POLL_S = 1.0


class Progress:
    """Runs done / total with an ETA on stderr: a live bar on a terminal, plain periodic lines
    otherwise.

    The total never goes down: it is the plan (every grid point on the tuning seeds, and per method
    and selection criterion its pick on the evaluation seeds), grown only when a grid extends
    (:meth:`grow`). Runs found done (reused, by other drivers, or shared by two criteria that picked
    one point) count as done.
    """

    def __init__(self, total: int, enabled: bool) -> None:
        self._total, self.done = total, 0
        self._reporter = ProgressReporter(total, label="runs", enabled=enabled)

    @property
    def total(self) -> int:
        """The runs planned so far."""
        return self._total

    def grow(self, runs: int) -> None:
        """``runs`` more runs to do than planned (a grid extension)."""
        if runs < 0:
            raise ValueError(f"`runs`: the study's total of runs only grows. Found {runs}.")
        self._total += runs

    def show(self, fraction_of_batch: float = 0.0, batch: int = 0) -> None:
        """Show the runs done, plus ``fraction_of_batch`` of a running batch of ``batch`` runs."""
        if self._reporter.total != self.total:
            self._reporter.set_total(self.total)
        self._reporter.update(self.done + fraction_of_batch * batch)

    def finish(self) -> None:
        """End the progress display."""
        self._reporter.finish()


@dataclass
class Tally:
    """Runs this driver computed, found done by other drivers, and reused from earlier (the study's
    ``execution``)."""

    computed: int = 0
    by_others: int = 0
    reused: int = 0


# ------------------------------------------------------------------------------- computing one unit

def compute_unit(study: Study, unit: Unit, progress: Callable[[int, int], None]
                 | None = None) -> list[dict]:
    """Compute the runs of ``unit`` in this process; one ``{"metrics", "diverged_at", "engine"}``
    per run.

    Every thread pool is pinned to ``study.threads`` while it computes (the inprocess and flower
    engines pin ``training.threads``, which the study sets to the same): on one machine a unit
    gives the same bits wherever it runs, in the driver, in a worker process or in a task on a
    cluster node.
    """
    started = time.perf_counter()
    if unit.engine != "batch":
        out = []
        for j in unit.jobs:
            metrics, diverged = _run_single(j.cfg, unit.engine)
            out.append({"metrics": metrics, "diverged_at": diverged, "engine": unit.engine})
    else:
        out = _run_batch(study, unit, progress)
    share = (time.perf_counter() - started) / max(1, len(out))  # a run's share of its unit's time
    return [{**o, "wall_s": share} for o in out]


def _run_batch(study: Study, unit: Unit, progress: Callable[[int, int], None] | None) -> list[dict]:
    """The runs of one batch of the batched engine (:func:`~.sweep.run_batch`), each run as the
    server of the per-run path would be: its mechanism, checked against its calibration, from the
    one place a server is built from an experiment
    (:meth:`~diff2_flwr.runtime.server_core.ServerSpec.of`), for the n_min the per-run path takes (a
    run that sets what the batch cannot honour is not here: :func:`~.plan.batch_ignores`)."""
    import torch  # noqa: PLC0415 -- torch and the batched engine load where a batch runs

    from ..sweep import RunSpec, run_batch  # noqa: PLC0415 -- see above

    batch = unit.jobs
    with pinned_threads(study.threads):
        cfg = batch[0].cfg
        data = unit_data(cfg)
        layout = ParameterLayout.of(model_of(cfg, data.num_features, data.num_outputs))
        specs = []
        for j in batch:
            server = ServerSpec.of(j.cfg, layout=layout, n_min=j.cfg.privacy.n_min or data.n_min)
            mech, routine = server.mechanism, j.cfg.training.routine
            schedule = j.cfg.training.schedule
            specs.append(RunSpec(mech.restart_every, j.cfg.training.learning_rate,
                                 mech.clip_restart, mech.clip_diff, mech.sigma_restart,
                                 mech.sigma_diff, j.cfg.training.seed, j.cfg.model.init_seed,
                                 routine=routine.name,
                                 routine_params=tuple(sorted(routine.params().items())),
                                 schedule=schedule.name,
                                 schedule_params=tuple(sorted(schedule.params().items())),
                                 # its cohorts: cohort_key(seed), as the per-run server's
                                 sampling=j.cfg.training.sampling.build()))
        model = cfg.model  # the study's, in every run config
        results = run_batch(data, specs, rounds=cfg.training.rounds, hidden=model.hidden_units,
                            model=model.name, model_kwargs=model.kwargs.as_dict(), loss=cfg.loss,
                            eval_every=cfg.evaluation.every,
                            dtype=torch.float32 if study.dtype == "float32" else torch.float64,
                            compile=study.compile, progress=progress, device=study.device,
                            accumulate=study.accumulate, two_valued=study.two_valued)
    out = []
    for res in results:
        metrics = {"rounds": res.rounds.tolist(), "train_loss": res.train_loss.tolist(),
                   "grad_norm_sq": res.grad_norm_sq.tolist(), "test_loss": res.test_loss.tolist()}
        if res.test_accuracy is not None:
            metrics[ACCURACY] = res.test_accuracy.tolist()
        out.append({"metrics": metrics, "diverged_at": res.diverged_at, "engine": "batch"})
    return out


def _run_single(cfg: ExperimentConfig, engine: str) -> tuple[dict, int | None]:
    """One run on the per-run path (``inprocess``: the in-process driver; ``flower``: a Flower
    simulation)."""
    if engine == "flower":
        rows, diverged = _run_flower(cfg)
    else:
        server = run_inprocess(cfg, record=False, progress=None, stop_on_divergence=True)
        rows, diverged = server.history, server.diverged_at
    rows = [r for r in rows if "train_loss" in r or "test_loss" in r]
    accuracy = any(ACCURACY in r for r in rows)
    # the diverged iterate has no finite metrics: its criteria are inf from then on
    if diverged is not None:
        rows.append({"round": diverged, **{c: math.inf for c in CRITERIA}, ACCURACY: math.nan})
    metrics = {"rounds": [r["round"] for r in rows],
               **{c: [r.get(c, math.inf) for r in rows] for c in CRITERIA}}
    if accuracy:  # a diverged iterate's accuracy is unknown (NaN), never counted as a best
        metrics[ACCURACY] = [r.get(ACCURACY, math.nan) for r in rows]
    return metrics, diverged


def _run_flower(cfg: ExperimentConfig) -> tuple[list[dict], int | None]:
    """The metric rows of one Flower simulation of ``cfg``, and the round it diverged at (None: it
    did not)."""
    with tempfile.TemporaryDirectory(prefix="diff2-study-") as tmp:
        path = Path(tmp) / "run.yaml"
        data = cfg.to_dict()
        data["output"] = {"dir": tmp}
        path.write_text(yaml.safe_dump(data))
        try:
            result, diverged = run_simulation(str(path), echo=False), None
        except SimulationDiverged as err:  # a training failure: the study records it and goes on
            result, diverged = err.result, err.diverged_at
        rows = (result.output_dir / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line) for line in rows], diverged


# ------------------------------------------------------------------------------- run files

def write_run(runs_dir: Path, job: Job, metrics: dict, diverged: int | None, engine: str,
              computed_by: Mapping[str, str] | None = None, *, registration: str | None = None,
              wall_s: float | None = None) -> None:
    """Write one run's record, whole (atomically): what it is, the registration it was computed
    under, its per-round metrics, its share of its unit's wall time, and who computed it."""
    record = {"run_id": job.run_id, "method": job.method.name, "base_method": job.method.method,
              "registration": registration, "wall_s": wall_s,
              "routine": job.method.routine_of(job.point),
              "schedule": job.method.schedule_of(job.point), "point": job.point,
              "epsilon": job.epsilon, "seed": job.seed, "engine": engine, "diverged_at": diverged,
              **metrics, "computed_by": dict(computed_by or {})}
    atomic_write_text(runs_dir / f"{job.run_id}.json", json.dumps(to_json(record)))


def load_run(runs_dir: Path, run_id: str) -> dict:
    """One run's record, with JSON's nulls as inf (a criterion of a diverged run) or NaN (its
    accuracy)."""
    record = json.loads((runs_dir / f"{run_id}.json").read_text())
    for c in CRITERIA:  # null = inf/NaN (a diverged run)
        record[c] = [math.inf if v is None else v for v in record[c]]
    if ACCURACY in record:
        record[ACCURACY] = [math.nan if v is None else v for v in record[ACCURACY]]
    return record


def load_runs(runs_dir: Path, run_ids: Iterable[str],
              table: dict[str, dict] | None = None) -> dict[str, dict]:
    """The table of runs (run id -> record) of ``run_ids``, added to ``table`` (runs already in it
    are not re-read)."""
    table = {} if table is None else table
    for rid in run_ids:
        if rid not in table:
            table[rid] = load_run(runs_dir, rid)
    return table


# ------------------------------------------------------------------------------- executing a phase

def make_executor(study: Study, ray_address: str | None, probe: ExperimentConfig) -> Any:
    """Where units run: this process (``workers: 1``), a pool of this machine's processes, or a Ray
    cluster."""
    if ray_address is not None:
        if study.workers > 1:
            print(f"[diff2] study {study.name}: `workers: {study.workers}` is for this machine; on "
                  "the Ray cluster the cluster's CPUs set how many units run at once",
                  file=sys.stderr)
        return RayExecutor(ray_address, compute_unit, threads=study.threads,
                           expect={"code": code_fingerprint(), "data": node_report(probe)["data"]})
    if study.workers == 1:
        return LocalExecutor(compute_unit)
    return PoolExecutor(compute_unit, study.workers, study.source)


@dataclass
class _Phase:
    """What one call of :func:`execute` works with; its methods move runs from planned to done."""

    study: Study
    runs_dir: Path
    progress: Progress
    executor: Any
    book: ClaimBook
    tally: Tally

    def submit(self, queue: collections.deque) -> list[Job]:
        """Claim and submit units while the executor has room; return the runs other drivers
        hold."""
        held: list[Job] = []
        while queue and self.executor.has_capacity():
            unit = queue.popleft()
            mine = set(self.book.claim([j.run_id for j in unit.jobs]))
            others = [j for j in unit.jobs if j.run_id not in mine]
            waiting = [j for j in others if not self.book.done(j.run_id)]
            held += waiting
            self._count("by_others", len(others) - len(waiting))
            if mine:
                got = Unit(unit.engine, tuple(j for j in unit.jobs if j.run_id in mine))
                self.executor.submit(self.study, got, lambda r, total, n=len(got.jobs): (
                    self.progress.show(r / total, n) if r % 20 == 0 else None))
        return held

    def collect(self) -> None:
        """Write the results of the units that completed (waiting up to ``POLL_S`` for one)."""
        for unit, outcomes in self.executor.completed(timeout=POLL_S):
            for j, outcome in zip(unit.jobs, outcomes):
                registration = self.study.registration
                write_run(self.runs_dir, j, outcome["metrics"], outcome["diverged_at"],
                          outcome["engine"], {"driver": self.book.owner.driver,
                                              "host": outcome.get("host", self.book.owner.host)},
                          registration=None if registration is None else registration.digest,
                          wall_s=outcome.get("wall_s"))
                self.book.finish(j.run_id)
            self._count("computed", len(unit.jobs))
            self.progress.show()
        # every poll: the display's own interval decides (a plain line every 10 s off a terminal,
        # even while a pool's units run for many minutes without reporting their rounds)
        self.progress.show()

    def settle(self, waiting: list[Job]) -> list[Job]:
        """Count the held runs other drivers finished; return those still held."""
        finished = [j for j in waiting if self.book.done(j.run_id)]
        self._count("by_others", len(finished))
        if finished:
            self.progress.show()
        return [j for j in waiting if not self.book.done(j.run_id)]

    def _count(self, kind: str, runs: int) -> None:
        setattr(self.tally, kind, getattr(self.tally, kind) + runs)
        self.progress.done += runs


def execute(study: Study, jobs: list[Job], runs_dir: Path, progress: Progress, executor: Any,
            book: ClaimBook, tally: Tally) -> None:
    """Compute every job whose result file is missing, each exactly once across the drivers sharing
    ``runs_dir``.

    Units are planned from the missing runs and claimed run by run (:class:`ClaimBook`); a unit is
    computed (by ``executor``: here, or as tasks of a Ray cluster) for the runs this driver won,
    and each result is written atomically. Runs held by other drivers are waited for; when their
    claims turn stale (the driver died) they are planned again and taken over.
    """
    todo = [j for j in jobs if not book.done(j.run_id)]
    if len(todo) < len(jobs):
        book.sweep_finished(j.run_id for j in jobs if j not in todo)
    phase = _Phase(study, runs_dir, progress, executor, book, tally)
    phase._count("reused", len(jobs) - len(todo))
    progress.show()
    queue = collections.deque(plan_units(study, todo))
    waiting: list[Job] = []  # held by other drivers
    announced = False
    while queue or executor.in_flight or waiting:
        waiting += phase.submit(queue)
        if executor.in_flight:
            phase.collect()
        if not waiting:
            continue
        waiting = phase.settle(waiting)
        if not waiting or executor.in_flight or queue:
            continue
        if not announced:
            holders = {_describe(book.held_by_other(j.run_id)) for j in waiting}
            print(f"[diff2] study {study.name}: waiting for {len(waiting)} run(s) held by other "
                  f"driver(s) ({', '.join(sorted(holders))})", file=sys.stderr)
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
