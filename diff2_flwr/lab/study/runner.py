"""Studies: the paper's protocol (grid search per method, seeds, criteria, t-tests) from one YAML
file.

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

A study is four parts, and this module runs them in order: the spec (:mod:`.spec`: the file,
validated by the experiment file's validator), the plan (:mod:`.plan`: run ids, units, the
grid's extension), the scheduler (:mod:`.scheduler`: claims, executors, run files) and the analysis
(:mod:`.analysis`: pure functions of the loaded table of runs).

References:
    Murata & Suzuki (2023), Section 6; DIFF2.md, "The paper's experiments".
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

from ...runtime.config import ExperimentConfig
from ...runtime.outputs import to_json
from ...runtime.session import initial_parameters, subsample_info
from .claims import STALE_AFTER_S, ClaimBook, atomic_write_text
from .cluster import unit_data
from .scheduler import Progress, Tally, execute, load_runs, make_executor
from .analysis import inference, select_method, summarise
from .plan import GridSearch, Job, check_point, eval_jobs, planned_runs, tune_jobs
from .registration import check_runs
from .report import write_report
from .spec import MethodSpec, Study, StudyError, load_study, parse_study
from .tables import (TABLE_FILE, TableExecutor, read_table, table_path, table_rows, unpack,
                     write_table)

# Names that code and tests import from here, each defined in its part (``X as X``: re-exported).
from .scheduler import compute_unit as compute_unit
from .analysis import cost_summary as cost_summary, paired_one_sided_ttest as paired_one_sided_ttest
from .analysis import select as select
from .plan import Unit as Unit, batchable as batchable, plan_units as plan_units
from .spec import ACCURACY as ACCURACY, CRITERIA as CRITERIA, test_pairs as test_pairs

__all__ = [
    "ACCURACY",
    "CRITERIA",
    "MethodSpec",
    "Study",
    "StudyError",
    "load_study",
    "parse_study",
    "replay_study",
    "run_study",
    "select",
    "paired_one_sided_ttest",
]


def run_study(
    study: Study, *, output_root: str | Path | None = None, fresh: bool = False,
    show_progress: bool = True,
    make_plots: bool = True, ray_address: str | None = None, stale_after_s: float = STALE_AFTER_S,
    table: str | Path | None = None,
) -> dict:
    """Run the whole study (resumable) and write summary.json, runs.csv.gz (its run table,
    :mod:`.tables`), report.md and plots; return the summary.

    With ``table`` the study is replayed from that run table alone: its runs are written back into
    ``<output root>/<name>-from-table/runs`` (emptied first), and the study runs as it did with an
    executor that computes nothing (:class:`~.tables.TableExecutor`), so that its summary holds
    every figure recomputed from the table.

    With ``ray_address`` the units run as tasks of that Ray cluster
    (:class:`~.cluster.RayExecutor`), else in this process. Any number of drivers (processes,
    machines) may share one output folder: each run is claimed before it is computed
    (:mod:`~.claims`), so none is computed twice, every file is written whole, and a run claimed by
    a driver that died is taken over (at once if that driver ran on this machine, else after
    ``stale_after_s`` seconds without its heartbeat).
    """
    if ray_address is not None and study.engine == "flower":
        raise StudyError(f"{study.source}: key `engine`: expected 'batch' or 'inprocess' on a Ray "
                         "cluster (each `flower` run is a Flower simulation that starts its own "
                         "Ray). Found 'flower'.")
    root = Path(output_root or study.output_dir).expanduser().resolve() / study.name
    if table is not None:
        if ray_address is not None or fresh:
            raise StudyError(f"{study.source}: a replay from a run table computes nothing: "
                             "--ray and --fresh do not apply to it.")
        root = root.with_name(f"{study.name}-from-table")
        records = read_table(table)
        check_runs(study.registration, records, f"{study.source} (run table {table})")
        for f in (root / "runs").glob("*.json"):
            f.unlink()
        unpack(records, root / "runs", str(table))
    runs_dir = root / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    # On the way out (done, error, Ctrl-C): the executor stops first, then every claim still held is
    # released.
    with ClaimBook(runs_dir,
                   stale_after_s=stale_after_s) as book, contextlib.ExitStack() as cleanup:
        if fresh:
            _start_afresh(study, runs_dir, book)
        def executor_for(probe: ExperimentConfig) -> Any:
            if table is None:
                return make_executor(study, ray_address, probe)
            return TableExecutor(str(table), lambda j: f"{j.method.name}, ε = {j.epsilon:g}, "
                                                       f"seed {j.seed}, {dict(j.point)}")

        return _run_study(study, root, runs_dir, book, cleanup, executor_for=executor_for,
                          show_progress=show_progress, make_plots=make_plots)


def _start_afresh(study: Study, runs_dir: Path, book: ClaimBook) -> None:
    """``--fresh``: delete the run files and claims, unless a live driver holds some of them."""
    live = book.live_foreign_claims()
    if live:
        path, owner = live[0]
        who = f"driver on {owner.host} (pid {owner.pid})" if owner else "another driver"
        raise StudyError(
            f"{study.source}: --fresh would delete the runs of {runs_dir}, but {len(live)} run(s) "
            f"there are claimed by a live {who}, e.g. {path.name}. Stop that driver first (or, if "
            "it is gone and ran on another machine, delete runs/*.claim-*), or run without "
            "--fresh to share its work.")
    for f in runs_dir.glob("*.json"):
        f.unlink()
    book.clear()


def replay_study(study: Study, tables: str | Path, output_root: str | Path, *,
                 make_plots: bool = False) -> tuple[dict, Path]:
    """Replay ``study`` from its committed run table ``<tables>/<name>.csv.gz`` (or ``.csv``) into
    ``output_root``, computing nothing: its summary and the folder holding it
    (``<output_root>/<name>-from-table``; with ``make_plots``, its report's figures too). A missing
    table is a :class:`StudyError` naming it."""
    table = table_path(tables, study.name)
    if not table.is_file():
        raise StudyError(f"{study.source}: no run table {table}: a study's table is the "
                         f"{TABLE_FILE} beside its summary, committed as {table}.")
    summary = run_study(study, output_root=output_root, show_progress=False,
                        make_plots=make_plots, table=table)
    return summary, Path(output_root).expanduser().resolve() / f"{study.name}-from-table"


def _run_study(study: Study, root: Path, runs_dir: Path, book: ClaimBook,
               cleanup: contextlib.ExitStack, *, executor_for: Callable[[ExperimentConfig], Any],
               show_progress: bool, make_plots: bool) -> dict:
    """Spec → plan → scheduler → analysis, per ε: tune (and extend), select, evaluate, summarise;
    then the study's inference, its summary.json and its report."""
    started = time.perf_counter()
    first = study.methods[0]
    probe = study.experiment(first, first.points()[0], study.epsilons[0], study.tune_seeds[0])
    data = unit_data(probe)
    # Every configuration of the grid passes the partition's refusal rule (min_samples, max_sigma)
    # before any run starts, on every engine: the batched one never builds a server that would check
    # it.
    for epsilon in study.epsilons:
        for m in study.methods:
            for p in m.points():
                check_point(study, m, p, epsilon, data)
    summary = _header(study, probe, data)
    progress, tally = Progress(sum(planned_runs(study)), show_progress), Tally()
    executor = executor_for(probe)
    cleanup.callback(executor.close)
    every: dict[str, dict] = {}  # every run the study read, across ε: its run table

    def run(jobs: list[Job], table: dict[str, dict]) -> None:
        execute(study, jobs, runs_dir, progress, executor, book, tally)
        load_runs(runs_dir, (j.run_id for j in jobs), table)
        check_runs(study.registration, (table[j.run_id] for j in jobs), study.source)
        every.update((j.run_id, table[j.run_id]) for j in jobs)

    # every test of the study, across ε: the families are corrected over all of them
    rows: list[dict] = []
    for epsilon in study.epsilons:
        table: dict[str, dict] = {}  # this ε's runs, read once: what the analysis sees
        # 1. tuning, and 2. selection on the tuning seeds' mean; an edge pick extends its axis and
        # re-tunes
        chosen, searched = _tune(study, epsilon, data, run, table, progress)
        # 3. evaluation
        jobs = eval_jobs(study, chosen, epsilon)
        run(jobs, table)
        # Planned per selection criterion (train loss, ‖∇f‖²); where both picked one point, its runs
        # are done with their twins.
        progress.done += 2 * len(study.methods) * len(study.eval_seeds) - len(jobs)
        progress.show()
        # 4. summary
        summary["epsilons"][str(epsilon)], found = summarise(
            study, epsilon, chosen, searched, table, data.n_min, sum(data.shard_sizes))
        rows += found
    summary["inference"] = inference(study, rows)
    progress.finish()
    summary["wall_time_s"] = time.perf_counter() - started
    write_table(root / TABLE_FILE, table_rows(study.name, summary["dataset"]["name"],
                                              summary.get("registration", {}).get("sha256"),
                                              every.values()))
    return _finish(study, summary, root, runs_dir, executor, book, tally, make_plots)


def _tune(study: Study, epsilon: float, data: Any,
          run: Callable[[list[Job], dict[str, dict]], None], table: dict[str, dict],
          progress: Progress) -> tuple[dict[str, dict[str, dict]], dict[str, dict]]:
    """Tune every method at ``epsilon``: run its grid on the tuning seeds, pick per criterion, and
    extend where a pick lies on an edge (:class:`~.plan.GridSearch`), until no pick moves outward.

    Returns the picks (method -> criterion -> point) and, per method, the values searched per key,
    the points tuned, the extensions made and the picks that stay on an edge (with the reason).
    """
    search = GridSearch.start(study)
    done: set[str] = set()
    while True:
        jobs = [j for j in tune_jobs(study, search.tuned, epsilon) if j.run_id not in done]
        done.update(j.run_id for j in jobs)  # each extension tunes its new points only
        run(jobs, table)
        chosen = {m.name: select_method(study, m, search.tuned[m.name], epsilon, table)
                  for m in study.methods}
        steps = search.extend(study, chosen,
                              lambda m, point: check_point(study, m, point, epsilon, data))
        for step in steps:
            print(f"[diff2] study {study.name}, ε = {epsilon:g}: {step['method']} picked "
                  f"{step['key']} = {step['from']:g} on the {step['side']} edge of its line for "
                  f"{step['because']}: tuning {step['key']} = {step['value']:g} there",
                  file=sys.stderr)
            progress.grow(len(study.tune_seeds))
        if not steps:
            return chosen, search.searched(study, chosen)


def _header(study: Study, probe: ExperimentConfig, data: Any) -> dict[str, Any]:
    """The summary's description of the study, before any result."""
    return {"study": study.name, "source": study.source, "rounds": study.rounds,
            "delta": study.delta, "mode": study.mode, "clients": study.clients,
            "n_min": data.n_min, "dataset": _data_info(study, probe, data),
            "tune_seeds": list(study.tune_seeds), "eval_seeds": list(study.eval_seeds),
            "engine": study.engine, "dtype": study.dtype, "accumulate": study.accumulate,
            "two_valued": study.two_valued,
            "threads": study.threads,
            "workers": study.workers, "epsilons": {},
            **({} if study.registration is None else
               {"registration": study.registration.summary()})}


def _data_info(study: Study, probe: ExperimentConfig, data: Any) -> dict[str, Any]:
    """The data a study trained on: its dataset settings, the training records n (the sum of the
    shard sizes), the test records, the shard sizes, the subsample (``train_samples``) if any, and
    the model's parameter count d."""
    # where the files lie is not the data
    settings = {k: v for k, v in study.dataset.items() if k != "dir"}
    return {"settings": settings, "name": data.name, "train": int(sum(data.shard_sizes)),
            "test": int(data.x_test.shape[0]), "shard_sizes": list(data.shard_sizes),
            **subsample_info(probe, data),
            "parameters": int(initial_parameters(probe, data).size), "features": data.num_features,
            "outputs": data.num_outputs}


def _finish(study: Study, summary: dict, root: Path, runs_dir: Path, executor: Any, book: ClaimBook,
            tally: Tally, make_plots: bool) -> dict:
    """Say who computed what, write summary.json (whole) and the report; return the summary."""
    # Who computed what, as this driver saw it (drivers sharing the folder each rewrite the summary,
    # whole).
    summary["execution"] = {**executor.describe(), "driver": book.owner.driver,
                            "host": book.owner.host,
                            "runs_computed_here": tally.computed,
                            "runs_by_other_drivers": tally.by_others, "runs_reused": tally.reused}
    print(f"[diff2] study {study.name}: {tally.computed} run(s) computed by this driver "
          f"({summary['execution']['executor']}), {tally.by_others} by other drivers, "
          f"{tally.reused} reused", file=sys.stderr)
    atomic_write_text(root / "summary.json", json.dumps(to_json(summary), indent=2) + "\n")
    write_report(study, summary, root, runs_dir, make_plots=make_plots)
    return summary
