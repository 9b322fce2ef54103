"""The ``diff2`` command line.

    diff2 noise --epsilon 3 --delta 1e-5 --rounds 2000 --restart-every 20 --u 1.25 \\
                --clients 10 --n-min 1651 --mode exact
    diff2 run [configs/default.yaml]        # a Flower simulation via `flwr run`
    diff2 audit --method diff2 --epsilon 3 --rounds 10 --trials 10000   # try to break the guarantee
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from .runtime.outputs import to_json
from .runtime.spec import add_setting_flags, setting_names

__all__ = ["main"]

# Only the standard library and light modules load before a command runs: `diff2 --help` must not pay
# for torch, scipy or Flower (each command imports what it needs).


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("diff2-flwr")
    except PackageNotFoundError:  # a source tree that is not installed
        return "unknown (not installed)"


def _noise(args: argparse.Namespace) -> int:
    from .core.privacy import calibrate, schedule_cross_check

    cal = calibrate(
        epsilon=args.epsilon, delta=args.delta, rounds=args.rounds, restart_every=args.restart_every,
        u=args.u, n_min=args.n_min, clients=args.clients, mode=args.mode,
    )
    print(json.dumps(to_json({**cal.as_dict(), "accountants": schedule_cross_check(cal)}), indent=2))
    return 0


def _node_policy_env(args: argparse.Namespace) -> dict[str, str]:
    """``--node-policy FILE``: validated now, then given to every simulated node (``$DIFF2_NODE_POLICY``)."""
    if not args.node_policy:
        return {}
    if args.engine != "flower":
        raise ValueError("`--node-policy` is enforced by the simulated nodes' ClientApps: use it with --engine "
                         f"flower (the default). Found --engine {args.engine}.")
    from .runtime.policy import ENV_VAR, load_policy

    path = Path(args.node_policy).expanduser().resolve()
    load_policy(path)  # a bad policy fails here, in one line, before Flower starts
    return {ENV_VAR: str(path)}


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())


def _refused(args: argparse.Namespace, err: BaseException, wall_time_s: float) -> int:
    """A run refused before it started: one line on stderr, the same text as the JSON's ``error``."""
    message = _one_line(err)
    print(f"diff2 run: error: {message}", file=sys.stderr)
    print(json.dumps(to_json({"engine": args.engine, "run_id": None, "output_dir": None, "wall_time_s": wall_time_s,
                              "status": "failed", "error": message})))
    return 2


#: The experiment file of ``diff2 run`` when none is given.
DEFAULT_CONFIG = "configs/default.yaml"


def _run(args: argparse.Namespace) -> int:
    """Progress and the end-of-run summary on stderr; one JSON object (the run's key figures) on stdout.

    Both engines first build and check everything that needs no transport (``session.preflight``): a mistake
    is one line on stderr and the JSON's ``error`` within seconds, before Flower (or any round) starts.
    """
    import time

    started = time.perf_counter()
    try:
        from .runtime.config import AUTO_CLIENTS_DEFAULT, load_config, set_assignments
        from .runtime.paths import resolve_config_path
        from .runtime.session import preflight

        auto_line = None
        # `--set a=1 CONFIG`: the last word without `=` is the file when none other was given
        args.config, overrides = set_assignments(args.set, args.config, DEFAULT_CONFIG)
        env = _node_policy_env(args)
        cfg = load_config(resolve_config_path(args.config), overrides)
        if cfg.clients_auto:  # diff2 run starts the SuperNodes (or the in-process workers): it says how many
            cfg = cfg.with_clients(AUTO_CLIENTS_DEFAULT, "diff2 run's SuperNodes")
            overrides["training.clients"] = AUTO_CLIENTS_DEFAULT
            auto_line = (f"[diff2] training.clients: auto -> P = {AUTO_CLIENTS_DEFAULT} (the SuperNodes diff2 run "
                         "simulates; --set training.clients=N for another number)")
        checked = preflight(cfg)
    except (ValueError, FileNotFoundError) as err:
        return _refused(args, err, time.perf_counter() - started)

    from .runtime.console import RunConsole, run_report, summary_block, verbose_from_env
    from .runtime.launch import SimulationFailed, run_simulation

    console = RunConsole(verbose=args.verbose or verbose_from_env())
    if auto_line:
        console.message(auto_line)
    run_id, failure = None, None
    try:
        if args.engine == "inprocess":
            from .runtime.driver import run_inprocess

            try:
                server = run_inprocess(cfg, progress=console.message, checked=checked)
            except RuntimeError as err:  # a refused round or a diverged iterate: the run folder says so
                failure = f"{type(err).__name__}: {err}"
            else:
                console.output_dir = Path(server.run_info["output_dir"]) if server.run_info.get("output_dir") else None
        else:
            # Said now, in seconds; the ServerApp says it again (the console shows each of our lines once).
            for line in (*checked.lines, *(f"[diff2] WARNING: {w}" for w in checked.warnings)):
                console.message(line)
            from .runtime.session import load_data

            del checked  # the simulation's own processes load the data: this one need not hold it meanwhile
            load_data.cache_clear()
            try:
                result = run_simulation(args.config, timeout_s=args.timeout, console=console, set_keys=overrides,
                                        env=env)
            except SimulationFailed as err:
                failure = str(err)
            else:
                run_id, console.output_dir = result.run_id, result.output_dir or console.output_dir
    finally:
        console.close()
    if failure:
        print(f"[diff2] FAILED: {failure}", file=sys.stderr)
    report = run_report(console.output_dir, run_id=run_id, engine=args.engine,
                        wall_time_s=time.perf_counter() - started)
    if console.output_dir is not None:
        print(summary_block(report), file=sys.stderr)
    if failure:
        status = report.get("status") if report.get("status") in ("failed", "diverged") else "failed"
        report["status"], report["error"] = status, report.get("error") or failure
    print(json.dumps(to_json(report)))
    return 1 if failure else 0


def _experiment(args: argparse.Namespace) -> int:
    from .lab.cluster import ClusterError
    from .lab.study import load_study, run_study

    study = load_study(args.study)
    if args.engine:
        import dataclasses

        study = dataclasses.replace(study, engine=args.engine)
    if not args.stale_after > 0:
        raise ValueError(f"`--stale-after`: expected a number of seconds > 0. Found {args.stale_after}.")
    try:
        summary = run_study(study, output_root=args.output, fresh=args.fresh, ray_address=args.ray,
                            stale_after_s=args.stale_after)
    except ClusterError as err:
        print(f"diff2 experiment: error: {err}", file=sys.stderr)
        return 2
    root = Path(args.output or study.output_dir).expanduser().resolve() / study.name
    print(f"[diff2] study {study.name} done in {summary['wall_time_s']:.0f} s: {root / 'report.md'}", file=sys.stderr)
    inference = summary.get("inference", {})
    print(json.dumps(to_json({"study": study.name, "summary": str(root / "summary.json"),
                              "report": str(root / "report.md"), "wall_time_s": summary["wall_time_s"],
                              "protocol": inference.get("protocol"),
                              "primary_results": inference.get("primary_results", [])})))
    return 0


def _family(args: argparse.Namespace) -> int:
    from .lab.family import run_family

    print(json.dumps(to_json(run_family(args.family, output_root=args.output))))
    return 0


def _regime(args: argparse.Namespace) -> int:
    from .lab.regime import BOOTSTRAP_REPLICATES, BOOTSTRAP_SEED, read_cells, write_regime

    if not 0 < args.alpha < 1:
        raise ValueError(f"`--alpha`: expected a significance level in (0, 1). Found {args.alpha}.")
    replicates = BOOTSTRAP_REPLICATES if args.replicates is None else args.replicates
    if replicates < 1:
        raise ValueError(f"`--replicates`: expected a number of bootstrap replicates >= 1. Found {replicates}.")
    cells = read_cells(args.study_dirs, diff2=args.diff2, control=args.control)
    result = write_regime(cells, args.out, alpha=args.alpha, plots=not args.no_plots, replicates=replicates,
                          seed=BOOTSTRAP_SEED if args.bootstrap_seed is None else args.bootstrap_seed)
    print(json.dumps(to_json(result)))
    return 0


def _bench(args: argparse.Namespace) -> int:
    from .lab.bench import run_bench

    result = run_bench(data_dir=args.data_dir, protocol=not args.skip_protocol, flower=not args.skip_flower,
                       rounds=args.rounds, flower_rounds=args.flower_rounds)
    print(json.dumps(to_json(result), indent=2))
    return 0


def _ledger(args: argparse.Namespace) -> int:
    from .runtime.node_ledger import NodeLedger

    print(json.dumps(to_json(NodeLedger(args.path).summary(args.delta))))
    return 0


def _audit(args: argparse.Namespace) -> int:
    from .lab.audit import AuditSpec, run_audit, stderr_progress

    spec = AuditSpec(**{name: getattr(args, name) for name in setting_names(AuditSpec)})
    result = run_audit(spec, progress=None if args.quiet else stderr_progress)
    text = json.dumps(to_json(result), indent=2)
    if args.out:
        Path(args.out).expanduser().parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).expanduser().write_text(text + "\n")
    print(text)
    if result["violation"]:
        print(f"diff2 audit: VIOLATION: ε̂ = {result['epsilon_lower_bound']:.4g} > claimed ε = "
              f"{result['epsilon_claimed']:.4g} (confidence {result['confidence']:.0%})", file=sys.stderr)
        return 3
    return 0


def _plot(args: argparse.Namespace) -> int:
    from .runtime.curves import CURVES_FILE, plot_runs, read_rows, run_labels

    dirs = [Path(d).expanduser() for d in args.run_dirs]
    runs = [(label, read_rows(d)) for label, d in zip(run_labels(dirs), dirs)]
    out = Path(args.out).expanduser() if args.out else (dirs[0] / CURVES_FILE if len(dirs) == 1 else
                                                           Path("curves-comparison.png"))
    print(plot_runs(runs, out, title=args.title))
    return 0


def _shard(args: argparse.Namespace) -> int:
    from .runtime.config import load_config
    from .deploy.shards import write_shards

    paths = write_shards(load_config(args.config), args.out)
    for path in paths:
        print(path)
    return 0


def _deploy_local(args: argparse.Namespace) -> int:
    from .deploy.native import run_local_deployment
    from .runtime.launch import SimulationFailed

    try:
        result = run_local_deployment(args.config, tls=args.tls, node_auth=args.node_auth, resume=args.resume,
                                      rounds=args.rounds, clients=args.clients, workdir=args.workdir,
                                      node_policy=args.node_policy)
    except SimulationFailed as err:
        print(f"[diff2] deployment FAILED: {err}", file=sys.stderr)
        return 1
    per_round = sorted(result.round_seconds)[len(result.round_seconds) // 2] if result.round_seconds else float("nan")
    security = ("TLS, SuperNode authentication" if result.node_auth else "TLS, no SuperNode authentication") \
        if args.tls else "insecure, loopback only"
    print(f"[diff2] deployment run {result.launch.run_id} {result.launch.status} ({security}); "
          f"median {per_round:.1f} s/round; results in {result.launch.output_dir}; run folder (shards, keys, "
          f"logs) {result.workdir}")
    return 0


def _certs(args: argparse.Namespace) -> int:
    from .deploy.certs import make_certificates

    if args.clients and args.node_pub:
        print("diff2 certs: give --node-pub (the data owners' public keys) or --clients (one-machine tests: makes "
              "their private keys here), not both.", file=sys.stderr)
        return 2
    try:
        publics = _node_publics(args.node_pub or [], Path(args.out))
    except ValueError as err:
        print(f"diff2 certs: {err}", file=sys.stderr)
        return 2
    certs = make_certificates(args.out, tuple(args.host))
    print(f"CA: {certs.ca} (send it to every data owner)\nserver certificate: {certs.cert}\n"
          f"server key: {certs.key} (0600: stays on the SuperLink host)")
    for public in publics:
        print(f"data owner {public.stem.split('-')[-1]}: public key {public} (register: flwr supernode register "
              f"{public} <connection>)")
    return _test_node_keys(args.out, args.clients)


def _node_publics(files: list[str], out: Path) -> list[Path]:
    """The data owners' public keys checked, then copied as ``out/supernode-<i>.pub``: i from a file already named
    so (``diff2 node-key --name supernode-<i>``), else its position among the files given."""
    import re

    from .deploy.certs import load_node_public_keys, node_key_names

    keys = load_node_public_keys(files)
    found = [re.fullmatch(r"supernode-(\d+)\.pub", Path(f).name) for f in files]
    indices = [int(m.group(1)) if m else i for i, m in enumerate(found)]
    if len(set(indices)) < len(indices):
        raise ValueError(f"--node-pub {' '.join(files)}: two files would both be data owner "
                         f"{max(indices, key=indices.count)}'s key. Name each supernode-<i>.pub after its owner's "
                         "index, or give them all in the owners' order under other names.")
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, key in sorted(zip(indices, keys)):
        path = out / node_key_names(i)[1]
        path.write_bytes(key + b"\n")
        paths.append(path)
    return paths


def _test_node_keys(out: str, clients: int) -> int:
    from .deploy.certs import make_node_keys

    if not clients:
        return 0
    print(f"--clients {clients}: one-machine tests only. Every data owner's private key was made here, so whoever "
          "holds this folder can act as any data owner; across hosts each data owner runs `diff2 node-key` and "
          "sends only its .pub (`diff2 certs --node-pub`).")
    for i, key in enumerate(make_node_keys(out, clients)):
        print(f"data owner {i}: SuperNode private key {key.private} (0600), public key {key.public} "
              f"(register: flwr supernode register {key.public} <connection>)")
    return 0


def _node_key(args: argparse.Namespace) -> int:
    from .deploy.certs import make_node_key

    key = make_node_key(args.out, args.name)
    print(f"private key: {key.private} (0600; it never leaves this machine: the SuperNode reads it with "
          f"--auth-supernode-private-key)\npublic key: {key.public} (send this file, and only this one, to the "
          f"SuperLink's operator, who registers it):\n{key.public.read_text().strip()}")
    return 0


def _secret(args: argparse.Namespace) -> int:
    from .runtime.secret_files import make_superexec_secret

    for name in args.names:
        if "/" in name or name in ("", ".", ".."):
            print(f"diff2 secret: a name, not a path, expected (superlink, supernode-0, ...). Found {name!r}.",
                  file=sys.stderr)
            return 2
        path = make_superexec_secret(Path(args.out) / f"{name}.secret")
        print(f"SuperExec secret: {path} (0600; give it to {name} and the SuperExec that runs its apps, nobody else)")
    return 0


def _compose(args: argparse.Namespace) -> int:
    from .deploy.compose import render_compose

    print(render_compose(args.clients, args.tls, node_auth=args.node_auth, publish=args.publish,
                         superlink=args.superlink), end="")
    return 0


def _add_run_commands(sub: Any) -> None:
    """The commands noise, run, experiment: a calibration, a run, a study."""
    noise = sub.add_parser("noise", help="print the noise calibration (σ1, σ2, z1, z2) as JSON")
    noise.add_argument("--epsilon", type=float, required=True, help="target ε (> 0)")
    noise.add_argument("--delta", type=float, required=True, help="target δ in (0, 1)")
    noise.add_argument("--rounds", type=int, required=True, help="R, total rounds")
    noise.add_argument("--restart-every", type=int, default=1, help="T, restart period (1 = DP-GD)")
    noise.add_argument("--u", type=float, default=1.25, help="budget split u > 1 (restart rounds get 1/u)")
    noise.add_argument("--clients", type=int, required=True, help="P, number of workers")
    noise.add_argument("--n-min", type=int, required=True, help="samples of the smallest shard")
    noise.add_argument("--mode", choices=("exact", "rdp"), default="exact", help="accounting (default exact GDP)")
    noise.set_defaults(func=_noise)

    run = sub.add_parser("run", help="run an experiment file as a Flower simulation (`flwr run`)")
    run.add_argument("config", nargs="?", default=None, help=f"experiment YAML (default: {DEFAULT_CONFIG})")
    run.add_argument("--timeout", type=float, default=6 * 3600, help="give up after this many seconds")
    run.add_argument("--engine", choices=("flower", "inprocess"), default="flower",
                     help="flower: `flwr run` simulation (default); inprocess: the same code without transport")
    run.add_argument("--set", action="extend", nargs="+", metavar="KEY=VALUE",
                     help="override keys of the experiment file, e.g. --set training.rounds=200 privacy.epsilon=8 "
                          "(or --set once per key; each value is read as YAML; validated like the file)")
    run.add_argument("--verbose", action="store_true",
                     help="show every line of Flower's log (also: DIFF2_VERBOSE=1); default: ours and warnings only")
    run.add_argument("--node-policy", metavar="FILE",
                     help="a data owner's node policy (YAML, e.g. configs/policy.yaml) held by every simulated node: "
                          "each refuses a run or task outside it (see the README, 'Node policy')")
    run.set_defaults(func=_run)

    exp = sub.add_parser("experiment", help="run a study (grid search, seeds, t-tests, report, plots) from a YAML file")
    exp.add_argument("study", help="study YAML, e.g. configs/smoke.yaml or configs/paper/california_eps3.yaml")
    exp.add_argument("--engine", choices=("batch", "inprocess", "flower"), default=None,
                     help="override the study's engine (batch: batched closed forms; flower: `flwr run` per run)")
    exp.add_argument("--output", default=None, help="output root (default: the study's output.dir)")
    exp.add_argument("--fresh", action="store_true", help="recompute every run instead of resuming")
    exp.add_argument("--ray", metavar="ADDRESS", default=None,
                     help="run the study's runs as tasks of the Ray cluster at ADDRESS (host:port of its head, or "
                          "'auto' for RAY_ADDRESS / the cluster started on this machine); same files and summary")
    from .lab.claims import STALE_AFTER_S  # standard library only

    exp.add_argument("--stale-after", type=float, default=STALE_AFTER_S, metavar="SECONDS",
                     help="take over a run another driver claimed once its heartbeat has been silent this long "
                          "(default %(default)s; a driver on this machine that died is noticed at once)")
    exp.set_defaults(func=_experiment)


def _add_study_commands(sub: Any) -> None:
    """The commands family, regime, plot: what is read from finished runs and studies."""
    fam = sub.add_parser("family", help="Holm across the primary tests of several finished studies (a "
                                        "pre-registered family, e.g. configs/confirm/family.yaml): family.json, "
                                        "family.md, JSON on stdout")
    fam.add_argument("family", help="family YAML: name, studies (study files relative to it), alpha")
    fam.add_argument("--output", default=None, help="output root the studies ran with (default: each study's "
                                                     "output.dir)")
    fam.set_defaults(func=_family)

    reg = sub.add_parser("regime", help="the regime map of a study family: DIFF2-GD / DP-GD ratios over n x ε "
                                        "(heatmaps, adjusted significance marks) and the final ‖∇f‖² ratio's slope "
                                        "against nε/√d (cluster bootstrap over seeds) beside the theory's −1/3")
    reg.add_argument("study_dirs", nargs="+", metavar="STUDY_DIR",
                     help="finished studies: folders holding summary.json (or summary.json files, or a folder whose "
                          "sub-folders hold them, e.g. outputs/regime)")
    reg.add_argument("--out", default="outputs/regime_map",
                     help="folder for heatmap_<dataset>.png, scatter.png, regime.md, regime.json (default %(default)s)")
    reg.add_argument("--diff2", default=None, metavar="METHOD",
                     help="the DIFF2 method of each study to compare (default: its only diff2 method)")
    reg.add_argument("--control", default=None, metavar="METHOD",
                     help="the DP-GD method to compare with (default: the study's first dpgd method)")
    reg.add_argument("--alpha", type=float, default=0.05,
                     help="significance level of the marks, read on Holm/BH-adjusted p (default %(default)s)")
    reg.add_argument("--replicates", type=int, default=None,
                     help="replicates of the cluster bootstrap over seeds for the slope's CI "
                          "(default: lab.regime.BOOTSTRAP_REPLICATES, 2000)")
    reg.add_argument("--bootstrap-seed", type=int, default=None,
                     help="seed of the bootstrap's generator (default: lab.regime.BOOTSTRAP_SEED, fixed, so that the "
                          "map is reproducible)")
    reg.add_argument("--no-plots", action="store_true", help="write the table and JSON only")
    reg.set_defaults(func=_regime)

    plot = sub.add_parser("plot", help="draw the per-round curves of one or several runs side by side (PNG)")
    plot.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run folders (each holds metrics.jsonl)")
    plot.add_argument("--out", default=None, help="PNG to write (default: RUN_DIR/curves.png for one run, "
                                                  "./curves-comparison.png for several)")
    plot.add_argument("--title", default=None, help="figure title")
    plot.set_defaults(func=_plot)


def _add_deploy_commands(sub: Any) -> None:
    """The commands shard, deploy-local, certs: a deployment's data, a local one, its certificates."""
    shard = sub.add_parser("shard", help="write one shard file per data owner (and the server's) for a deployment")
    shard.add_argument("config", help="experiment YAML whose dataset and training.clients define the shards")
    shard.add_argument("--out", required=True, help="output folder")
    shard.set_defaults(func=_shard)

    dep = sub.add_parser("deploy-local", help="run a native loopback deployment (SuperLink + P SuperNodes) of a config")
    dep.add_argument("config", nargs="?", default="configs/default.yaml", help="experiment YAML")
    dep.add_argument("--tls", action="store_true", help="TLS with a generated local CA (the default beyond a laptop); "
                     "turns on SuperNode authentication")
    dep.add_argument("--no-node-auth", dest="node_auth", action="store_false", default=None,
                     help="with --tls: accept any SuperNode instead of only the P registered keys")
    dep.add_argument("--resume", action="store_true",
                     help="continue from the checkpoint a previous run left in the run folder (default: start fresh)")
    dep.add_argument("--rounds", type=int, default=None, help="override training.rounds (~10 s per round)")
    dep.add_argument("--clients", type=int, default=None, help="override training.clients (one SuperNode each)")
    dep.add_argument("--workdir", default=None, help="run folder: shards, keys, logs and outputs "
                     "(default: ./deploy-local/<config name>); container paths such as /outputs map into it")
    dep.add_argument("--node-policy", metavar="FILE", default=None,
                     help="a data owner's node policy (e.g. configs/policy.yaml): each SuperNode gets a copy through "
                          "its node config, with a lifetime ledger of its own in the run folder")
    dep.set_defaults(func=_deploy_local)

    certs = sub.add_parser("certs", help="generate a CA and a SuperLink certificate for a TLS deployment, and check "
                                          "the data owners' SuperNode public keys")
    certs.add_argument("--out", required=True, help="output folder (0700; server.key 0600)")
    certs.add_argument("--host", action="append", default=None,
                       help="host name or IP the SuperLink is reached by (repeatable): the compose service name, the "
                            "name the SuperNodes dial, the address the operator's flwr uses")
    certs.add_argument("--node-pub", nargs="+", metavar="FILE", default=None,
                       help="the data owners' public keys (each made with `diff2 node-key` on its owner's machine), "
                            "checked and copied as supernode-<i>.pub for `flwr supernode register` (i from a file "
                            "named supernode-<i>.pub, else the order given)")
    certs.add_argument("--clients", type=int, default=0,
                       help="ONE-MACHINE TESTS ONLY: also make P SuperNode key pairs here, supernode-<i>.key/.pub "
                            "(whoever holds this folder then holds every data owner's key; default %(default)s)")
    certs.set_defaults(func=lambda a: _certs(argparse.Namespace(out=a.out, host=a.host or ["127.0.0.1", "localhost"],
                                                                clients=a.clients, node_pub=a.node_pub)))


def _add_secret_commands(sub: Any) -> None:
    """The commands node-key, secret, compose: what each party of a deployment holds, and its compose file."""
    node_key = sub.add_parser("node-key", help="(data owner) make this SuperNode's key pair; send only the .pub")
    node_key.add_argument("--out", required=True, help="folder (made 0700), e.g. deploy/certs")
    node_key.add_argument("--name", default="supernode",
                          help="file name stem: <name>.key (0600) and <name>.pub (default %(default)s; for the "
                               "compose files supernode-<i>)")
    node_key.set_defaults(func=_node_key)

    secret = sub.add_parser("secret", help="make SuperExec secrets (who may run the ServerApp / a ClientApp)")
    secret.add_argument("--out", required=True, help="folder (made 0700), e.g. deploy/secrets")
    secret.add_argument("names", nargs="+", metavar="NAME",
                        help="writes <out>/<NAME>.secret (0600) per name: superlink (operator), supernode-<i> "
                             "(data owner i, on its own machine)")
    secret.set_defaults(func=_secret)

    comp = sub.add_parser("compose", help="print docker-compose.yml for P data owners (default 3)")
    comp.add_argument("--clients", type=int, default=3, help="P: one SuperNode and one ClientApp per data owner")
    comp.add_argument("--tls", action="store_true", help="TLS between SuperLink and every other component, with "
                      "SuperNode authentication")
    comp.add_argument("--no-node-auth", dest="node_auth", action="store_false", default=None,
                      help="with --tls: accept any SuperNode (default: only registered keys)")
    comp.add_argument("--publish", default="127.0.0.1",
                      help="the one host address the SuperLink port is published on (default %(default)s; "
                           "multi-host: the SuperLink host's address on the data owners' network; never 0.0.0.0)")
    comp.add_argument("--superlink", default="superlink:8000",
                      help="address the SuperNodes dial (default %(default)s; multi-host: <SuperLink host>:8000)")
    comp.set_defaults(func=_compose)


def _add_lab_commands(sub: Any) -> None:
    """The commands audit (its flags derived from AuditSpec), bench, ledger."""
    from .lab.audit_spec import AuditSpec

    aud = sub.add_parser("audit", help="empirically audit the (ε, δ) guarantee of the real server path (JSON; exit 3 "
                                       "if the audit proves it false)")
    add_setting_flags(aud, AuditSpec)
    aud.add_argument("--out", default=None, help="also write the JSON here")
    aud.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    aud.set_defaults(func=_audit)

    bench = sub.add_parser("bench", help="measure speed (rounds/s, protocol wall time and GFLOP/s vs a plain "
                                         "matmul, Flower vs its floor) as JSON")
    bench.add_argument("--data-dir", default=None, help="data directory (default: $DIFF2_DATA_DIR)")
    bench.add_argument("--rounds", type=int, default=300, help="rounds timed for diff2_rounds_per_s")
    bench.add_argument("--flower-rounds", type=int, default=30, help="rounds of each Flower simulation")
    bench.add_argument("--skip-protocol", action="store_true", help="do not time the full California ε = 3 study")
    bench.add_argument("--skip-flower", action="store_true", help="do not run the two Flower simulations")
    bench.set_defaults(func=_bench)

    led = sub.add_parser("ledger", help="print a data owner's node ledger as JSON: the runs it charged, each run's ε, "
                                        "and the lifetime ε spent")
    led.add_argument("path", help="the node's ledger file (named in its node policy)")
    led.add_argument("--delta", type=float, default=None,
                     help="δ at which the runs are composed (default: the δ_L of the last admission, in the file)")
    led.set_defaults(func=_ledger)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="diff2", description="DIFF2 differentially private federated training on Flower.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    for add in (_add_run_commands, _add_study_commands, _add_deploy_commands, _add_secret_commands, _add_lab_commands):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"diff2 {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
