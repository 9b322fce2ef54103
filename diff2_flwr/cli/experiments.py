"""The handlers of the ``diff2`` commands that compute, run and read experiments: noise, run,
experiment, family, regime, plot, audit, bench (the parser is in :mod:`diff2_flwr.cli`).

Each takes the parsed arguments and returns the exit code; each imports what it needs when it runs,
so that ``diff2 --help`` loads none of torch, scipy or Flower.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Mapping

from ..runtime.outputs import to_json
from ..runtime.spec import setting_names

__all__ = ["DEFAULT_CONFIG", "audit", "bench", "experiment", "family", "figures", "noise", "plot",
           "regime", "run"]


def noise(args: argparse.Namespace) -> int:
    """``diff2 noise``: print the noise calibration of the schedule as JSON (σ1, σ2, z1, z2, ...)
    with its ε by the closed form and by dp-accounting's PLD and RDP accountants."""
    from ..core.privacy import calibrate, schedule_cross_check

    cal = calibrate(
        epsilon=args.epsilon, delta=args.delta, rounds=args.rounds,
        restart_every=args.restart_every, u=args.u, n_min=args.n_min, clients=args.clients,
        mode=args.mode,
    )
    print(json.dumps(to_json({**cal.as_dict(), "accountants": schedule_cross_check(cal)}),
                     indent=2))
    return 0


def _node_policy_env(args: argparse.Namespace) -> dict[str, str]:
    """``--node-policy FILE``: validated now, then given to every simulated node
    (``$DIFF2_NODE_POLICY``)."""
    if not args.node_policy:
        return {}
    if args.engine != "flower":
        raise ValueError(
            "`--node-policy` is enforced by the simulated nodes' ClientApps: use it with --engine "
                         f"flower (the default). Found --engine {args.engine}.")
    from ..runtime.policy import ENV_VAR, load_policy

    path = Path(args.node_policy).expanduser().resolve()
    load_policy(path)  # a bad policy fails here, in one line, before Flower starts
    return {ENV_VAR: str(path)}


def _check_node_policy(env: Mapping[str, str], cfg: Any) -> None:
    """The run against the node policy this launcher hands every simulated node: what each would
    refuse at round 1 (its rule, in its words), refused now, before Flower starts."""
    from ..runtime.policy import ENV_VAR, check_run, load_policy

    if ENV_VAR in env:
        check_run(load_policy(env[ENV_VAR]), cfg, "every simulated node")


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())


def _refused(args: argparse.Namespace, err: BaseException, wall_time_s: float) -> int:
    """A run refused before it started: one line on stderr, the same text as the JSON's
    ``error``."""
    message = _one_line(err)
    print(f"diff2 run: error: {message}", file=sys.stderr)
    print(json.dumps(to_json({"engine": args.engine, "run_id": None, "output_dir": None,
                              "wall_time_s": wall_time_s,
                              "status": "failed", "error": message})))
    # the command line's entry may end the process at once (cli.console)
    args.started_nothing = True
    return 2


#: The experiment file of ``diff2 run`` when none is given.
DEFAULT_CONFIG = "configs/default.yaml"


def run(args: argparse.Namespace) -> int:
    """Progress and the end-of-run summary on stderr; one JSON object (the run's key figures) on
    stdout.

    Both engines first build and check everything that needs no transport (``session.preflight``): a
    mistake is one line on stderr and the JSON's ``error`` within seconds, before Flower (or any
    round) starts.
    """
    started = time.perf_counter()
    try:
        from ..runtime.config import AUTO_CLIENTS_DEFAULT, load_config, set_assignments
        from ..runtime.paths import resolve_config_path
        from ..runtime.session import preflight

        auto_line = None
        # `--set a=1 CONFIG`: the last word without `=` is the file when none other was given
        args.config, overrides = set_assignments(args.set, args.config, DEFAULT_CONFIG)
        env = _node_policy_env(args)
        cfg = load_config(resolve_config_path(args.config), overrides)
        # diff2 run starts the SuperNodes (or the in-process workers): it says how many
        if cfg.clients_auto:
            cfg = cfg.with_clients(AUTO_CLIENTS_DEFAULT, "diff2 run's SuperNodes")
            overrides["training.clients"] = AUTO_CLIENTS_DEFAULT
            auto_line = (
                f"[diff2] training.clients: auto -> P = {AUTO_CLIENTS_DEFAULT} (the SuperNodes "
                f"diff2 run "
                         "simulates; --set training.clients=N for another number)")
        _check_node_policy(env, cfg)
        checked = preflight(cfg)
    except (ValueError, FileNotFoundError) as err:
        return _refused(args, err, time.perf_counter() - started)

    from ..runtime.console import RunConsole, run_report, summary_block, verbose_from_env
    from ..runtime.launch import SimulationFailed, run_simulation

    console = RunConsole(verbose=args.verbose or verbose_from_env())
    if auto_line:
        console.message(auto_line)
    run_id, failure = None, None
    try:
        if args.engine == "inprocess":
            from ..runtime.driver import run_inprocess

            try:
                server = run_inprocess(cfg, progress=console.message, checked=checked)
            # a refused round or a diverged iterate: the run folder says so
            except RuntimeError as err:
                failure = f"{type(err).__name__}: {err}"
            else:
                console.output_dir = Path(server.run_info["output_dir"]) if server.run_info.get(
                    "output_dir") else None
        else:
            # Said now, in seconds; the ServerApp says it again (the console shows each of our lines
            # once).
            for line in (*checked.lines, *(f"[diff2] WARNING: {w}" for w in checked.warnings)):
                console.message(line)
            from ..runtime.session import load_data

            # the simulation's own processes load the data: this one need not hold it meanwhile
            del checked
            load_data.cache_clear()
            try:
                result = run_simulation(args.config, timeout_s=args.timeout, console=console,
                                        set_keys=overrides, env=env)
            except SimulationFailed as err:
                failure = str(err)
            else:
                run_id, console.output_dir = result.run_id, result.output_dir or console.output_dir
    finally:
        console.close()
    report = run_report(console.output_dir, run_id=run_id, engine=args.engine,
                        wall_time_s=time.perf_counter() - started)
    # said once: by the run's summary when it has the error, else here
    summary_says = report.get("status") != "unknown" and report.get("error")
    if (failure or console.server_error) and not summary_says:
        print(f"[diff2] FAILED: {console.server_error or failure}", file=sys.stderr)
    if console.output_dir is not None:
        print(summary_block(report), file=sys.stderr)
    if failure:
        status = report.get("status") if report.get("status") in ("failed",
                                                                  "diverged") else "failed"
        report["status"], report["error"] = status, report.get("error") or failure
    print(json.dumps(to_json(report)))
    return 1 if failure else 0


def _stop_on_sigterm() -> Any:
    """SIGTERM stops a study as Ctrl-C does: the handler raises SystemExit, so the study's clean-up
    runs (its pool's worker processes are terminated, its claims released) instead of the process
    vanishing and leaving its workers computing. Returns the previous handler (None off the main
    thread, where no handler can be set)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def stop(signum: int, frame: Any) -> None:
        print("diff2 experiment: stopped by SIGTERM; the runs finished so far are kept and a rerun "
              "resumes", file=sys.stderr)
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, stop)


def experiment(args: argparse.Namespace) -> int:
    """``diff2 experiment``: run (or resume) a study file and print where its summary and report
    are, with its primary results, as JSON; 2 if its Ray cluster fails."""
    from ..lab.study.cluster import ClusterError
    from ..lab.study.runner import load_study, run_study
    from ..lab.study.tables import TABLE_FILE

    study = load_study(args.study)
    if args.engine:
        study = dataclasses.replace(study, engine=args.engine)
    if not args.stale_after > 0:
        raise ValueError(
            f"`--stale-after`: expected a number of seconds > 0. Found {args.stale_after}.")
    previous = _stop_on_sigterm()
    try:
        summary = run_study(study, output_root=args.output, fresh=args.fresh, ray_address=args.ray,
                            stale_after_s=args.stale_after, table=args.from_table)
    except ClusterError as err:
        print(f"diff2 experiment: error: {err}", file=sys.stderr)
        return 2
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    root = Path(args.output or study.output_dir).expanduser().resolve() / study.name
    if args.from_table:
        root = root.with_name(f"{study.name}-from-table")
    print(
        f"[diff2] study {study.name} done in {summary['wall_time_s']:.0f} s: {root / 'report.md'}",
        file=sys.stderr)
    inference = summary.get("inference", {})
    print(json.dumps(to_json({"study": study.name, "summary": str(root / "summary.json"),
                              "report": str(root / "report.md"), "runs": str(root / TABLE_FILE),
                              "wall_time_s": summary["wall_time_s"],
                              "protocol": inference.get("protocol"),
                              "primary_results": inference.get("primary_results", [])})))
    return 0


def family(args: argparse.Namespace) -> int:
    """``diff2 family``: Holm across the primary tests of several finished studies, printed as
    JSON (family.json and family.md written)."""
    from ..lab.study.family import run_family

    print(json.dumps(to_json(run_family(args.family, output_root=args.output,
                                        tables=args.from_tables))))
    return 0


def figures(args: argparse.Namespace) -> int:
    """``diff2 figures``: the generated blocks of the given Markdown files recomputed from the run
    tables (written, or with ``--check`` compared); JSON on stdout; 1 if a checked block differs."""
    from ..lab.regime.published import render_regime
    from ..lab.study.figures import RENDERERS, refresh

    result = refresh([Path(f) for f in args.files], Path(args.tables), check=args.check,
                     renderers={**RENDERERS, "regime": render_regime})
    print(json.dumps(to_json(result)))
    if args.check and result["differ"]:
        for d in result["differ"]:
            if "missing" in d:
                print(f"diff2 figures: {d['file']}: the block of {d['block']} links images that "
                      f"do not exist: {', '.join(d['missing'])}; run diff2 figures "
                      f"{' '.join(args.files)} to draw them from {args.tables}/", file=sys.stderr)
                continue
            print(f"diff2 figures: {d['file']}: the block of {d['block']} differs from its "
                  f"recomputation from {args.tables}/ (first difference: line {d['line']}); run "
                  f"diff2 figures {' '.join(args.files)} to rewrite it, and read the new numbers "
                  "before committing them", file=sys.stderr)
        return 1
    return 0


def regime(args: argparse.Namespace) -> int:
    """``diff2 regime``: the regime map of finished studies (ratios over n × ε, marks, the slope's
    bootstrap fit) written to ``--out`` and printed as JSON."""
    from ..lab.regime.runner import BOOTSTRAP_REPLICATES, BOOTSTRAP_SEED, read_cells, write_regime

    if not 0 < args.alpha < 1:
        raise ValueError(f"`--alpha`: expected a significance level in (0, 1). Found {args.alpha}.")
    replicates = BOOTSTRAP_REPLICATES if args.replicates is None else args.replicates
    if replicates < 1:
        raise ValueError(
            f"`--replicates`: expected a number of bootstrap replicates >= 1. Found {replicates}.")
    with tempfile.TemporaryDirectory(prefix="diff2-regime-") as work:
        sources = args.study_dirs
        if args.from_tables:
            from ..lab.regime.read import replay_tables
            sources = replay_tables(args.study_dirs, args.from_tables, work)
        cells = read_cells(sources, diff2=args.diff2, control=args.control)
        result = write_regime(cells, args.out, alpha=args.alpha, plots=not args.no_plots,
                              replicates=replicates,
                              seed=BOOTSTRAP_SEED if args.bootstrap_seed is None
                              else args.bootstrap_seed)
    print(json.dumps(to_json(result)))
    return 0


def _bench_line(message: str) -> None:
    print(f"[diff2 bench] {message}", file=sys.stderr, flush=True)


def bench(args: argparse.Namespace) -> int:
    """``diff2 bench``: measure the engine's speed and print the figures as JSON; the JAX peer's
    flags are checked before anything is measured."""
    from ..lab.bench.runner import run_bench
    from ..lab.bench.jax_cells import plan_jax_peer

    jax_peer = None if args.skip_jax else plan_jax_peer(  # checked before anything is measured
        jax_python=args.jax_python, reps=args.jax_reps, cells=args.jax_cells,
        rounds=args.jax_rounds, eager=args.jax_eager)
    for flag in ("models_records", "models_batch"):
        if getattr(args, flag) < 1:
            raise ValueError(f"`--{flag.replace('_', '-')}`: expected an integer >= 1. Found "
                             f"{getattr(args, flag)}.")
    models = None if args.skip_models else {"n": args.models_records, "batch": args.models_batch}
    if args.flower_clients < 2:
        raise ValueError("`--flower-clients`: expected an integer >= 2. Found "
                         f"{args.flower_clients}.")
    if not 0 < args.flower_rate <= 1:
        raise ValueError(f"`--flower-rate`: expected a rate in (0, 1]. Found {args.flower_rate}.")
    result = run_bench(data_dir=args.data_dir, protocol=not args.skip_protocol,
                       flower=not args.skip_flower, rounds=args.rounds,
                       flower_rounds=args.flower_rounds, flower_clients=args.flower_clients,
                       flower_rate=args.flower_rate, jax_peer=jax_peer, models=models,
                       progress=_bench_line)
    print(json.dumps(to_json(result), indent=2))
    return 0


def audit(args: argparse.Namespace) -> int:
    """``diff2 audit``: audit the (ε, δ) guarantee of the real server path and print the result as
    JSON; exit code 3 when the audit proves the claimed ε false."""
    from ..lab.audit.runner import AuditSpec, run_audit, stderr_progress, summary_line

    if args.live is not None:
        return _live_audit(args)
    if args.engines is not None:
        return _engines_audit(args)
    spec = AuditSpec(**{name: getattr(args, name) for name in setting_names(AuditSpec)})
    result = run_audit(spec, progress=None if args.quiet else stderr_progress)
    _print_result(args, result)
    print(summary_line(result), file=sys.stderr)
    if result["violation"]:
        found = " and ".join({
            "clopper_pearson": f"Clopper–Pearson ε̂ >= {result['epsilon_lower_bound']:.4g}",
            "gdp": f"{'cohort test' if (result['gdp'] or {}).get('test') == 'cohort' else 'μ-GDP'}"
                   f" ε̂ >= {(result['gdp'] or {}).get('epsilon_interval', [0])[0]:.4g}"}[k]
            for k in result["violation_by"])
        print(f"diff2 audit: VIOLATION: {found} > claimed ε = {result['epsilon_claimed']:.4g} "
              f"(confidence {result['confidence']:.2%})", file=sys.stderr)
        return 3
    return 0


def _live_audit(args: argparse.Namespace) -> int:
    """``diff2 audit --live FOLDER``: the data owner's canaries scored (JSON; exit 3 on a finding, 2
    unreadable)."""
    from ..lab.audit.live import LiveAuditError, live_audit

    try:
        result = live_audit(Path(args.live).expanduser())
    except LiveAuditError as err:
        print(f"diff2 audit --live: {err}", file=sys.stderr)
        return 2
    _print_result(args, result)
    k = result["noise_scale"]
    print(
        f"diff2 audit --live: {result['rounds']['scored']} rounds x {result['canaries']} "
        f"canaries: the iterates carry {k['estimate']:.3f} x the calibrated noise (upper bound "
        f"{k['upper']:.3f}); exploratory μ̂ {result['mu']:.3f}, ε̂ {result['epsilon']:.3g} "
        f"(claimed {result['epsilon_claimed']:g})"
          + (": VIOLATION: " + "; ".join(result["findings"]) if result["violation"]
             else ": no violation"),
          file=sys.stderr)
    return 3 if result["violation"] else 0


def _engines_audit(args: argparse.Namespace) -> int:
    """``diff2 audit --engines [ENGINE ...]``: the per-sample gradient engines attacked with real
    models and adversarial records (JSON; exit 3 on a finding)."""
    from ..lab.audit.engines import engine_audit, engine_summary_line
    from ..lab.audit.runner import stderr_progress
    from ..lab.audit.spec import ENGINE_SEED, ENGINES, EngineAuditSpec

    spec = EngineAuditSpec(engines=tuple(dict.fromkeys(args.engines)) or ENGINES,
                           samples=args.samples, clip_restart=args.clip_restart,
                           clip_diff=args.clip_diff,
                           seed=ENGINE_SEED if args.seed is None else args.seed)
    result = engine_audit(spec, progress=None if args.quiet else stderr_progress)
    _print_result(args, result)
    print(engine_summary_line(result), file=sys.stderr)
    return 3 if result["violation"] else 0


def _print_result(args: argparse.Namespace, result: dict) -> None:
    """An audit's result as one JSON object on stdout, and in ``--out`` when given."""
    text = json.dumps(to_json(result), indent=2)
    if args.out:
        Path(args.out).expanduser().parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).expanduser().write_text(text + "\n")
    print(text)


def plot(args: argparse.Namespace) -> int:
    """``diff2 plot``: draw the per-round curves of one or several run folders side by side and
    print the PNG's path."""
    from ..runtime.curves import CURVES_FILE, plot_runs, read_privacy, read_rows, run_labels

    dirs = [Path(d).expanduser() for d in args.run_dirs]
    runs = [(label, read_rows(d)) for label, d in zip(run_labels(dirs), dirs)]
    out = Path(args.out).expanduser() if args.out else (dirs[0] / CURVES_FILE if len(dirs) == 1 else
                                                           Path("curves-comparison.png"))
    print(plot_runs(runs, out, title=args.title, privacy=[read_privacy(d) for d in dirs]))
    return 0
