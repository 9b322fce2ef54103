"""The ``diff2`` command line: its parser and :func:`main` (the entry point; also ``python -m
diff2_flwr.cli``).

    diff2 noise --epsilon 3 --delta 1e-5 --rounds 2000 --restart-every 20 --u 1.25 \\
                --clients 10 --n-min 1651 --mode exact
    diff2 run [configs/default.yaml]        # a Flower simulation via `flwr run`
    diff2 audit --method diff2 --epsilon 3 --rounds 10 --trials 10000   # try to break the guarantee

The commands' handlers are in :mod:`.experiments` (noise, run, experiment, family, regime, plot,
audit, bench), :mod:`.deployment` (shard, deploy-local, certs, node-key, secret, compose, ledger,
superlink)
and :mod:`.docs` (docs: the documentation site).
"""

from __future__ import annotations

import argparse
import os
import sys
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from ..lab.audit.spec import ENGINE_SEED, ENGINES, AuditSpec
from ..lab.study.claims import STALE_AFTER_S  # standard library only
from ..runtime.spec import add_setting_flags
from . import deployment, docs, experiments
from .experiments import DEFAULT_CONFIG

__all__ = ["DEFAULT_CONFIG", "build_parser", "main"]

# Only the standard library and light modules load before a command runs: `diff2 --help` must not
# pay for torch, scipy or Flower (each command imports what it needs).


def _version() -> str:
    try:
        return version("diff2-flwr")
    except PackageNotFoundError:  # a source tree that is not installed
        return "unknown (not installed)"


def _add_run_commands(sub: Any) -> None:
    """The commands noise, run, experiment: a calibration, a run, a study."""
    noise = sub.add_parser("noise", help="print the noise calibration (σ1, σ2, z1, z2) as JSON")
    noise.add_argument("--epsilon", type=float, required=True, help="target ε (> 0)")
    noise.add_argument("--delta", type=float, required=True, help="target δ in (0, 1)")
    noise.add_argument("--rounds", type=int, required=True, help="R, total rounds")
    noise.add_argument("--restart-every", type=int, default=1, help="T, restart period (1 = DP-GD)")
    noise.add_argument("--u", type=float, default=1.25,
                       help="budget split u > 1 (restart rounds get 1/u)")
    noise.add_argument("--clients", type=int, required=True, help="P, number of workers")
    noise.add_argument("--n-min", type=int, required=True, help="samples of the smallest shard")
    noise.add_argument("--mode", choices=("exact", "rdp"), default="exact",
                       help="accounting (default exact GDP)")
    noise.set_defaults(func=experiments.noise)

    run = sub.add_parser("run", help="run an experiment file as a Flower simulation (`flwr run`)")
    run.add_argument("config", nargs="?", default=None,
                     help=f"experiment YAML (default: {DEFAULT_CONFIG})")
    run.add_argument("--timeout", type=float, default=6 * 3600,
                     help="give up after this many seconds")
    run.add_argument("--engine", choices=("flower", "inprocess"), default="flower",
                     help="flower: `flwr run` simulation (default); inprocess: the same code "
                          "without transport")
    run.add_argument("--set", action="extend", nargs="+", metavar="KEY=VALUE",
                     help="override keys of the experiment file, e.g. --set training.rounds=200 "
                          "privacy.epsilon=8 (or --set once per key; each value is read as YAML; "
                          "validated like the file)")
    run.add_argument("--verbose", action="store_true",
                     help="show every line of Flower's log (also: DIFF2_VERBOSE=1); default: ours "
                          "and warnings only")
    run.add_argument("--node-policy", metavar="FILE",
                     help="a data owner's node policy (YAML, e.g. configs/policy.yaml) held by "
                          "every simulated node: each refuses a run or task outside it (see "
                          "docs/how-to/node-policy.md)")
    run.set_defaults(func=experiments.run)

    exp = sub.add_parser("experiment",
                         help="run a study (grid search, seeds, t-tests, report, plots) from a "
                              "YAML file")
    exp.add_argument("study",
                     help="study YAML, e.g. configs/smoke.yaml or "
                          "configs/paper/california_eps3.yaml")
    exp.add_argument("--engine", choices=("batch", "inprocess", "flower"), default=None,
                     help="override the study's engine (batch: batched closed forms; flower: "
                          "`flwr run` per run)")
    exp.add_argument("--output", default=None, help="output root (default: the study's output.dir)")
    exp.add_argument("--fresh", action="store_true", help="recompute every run instead of resuming")
    exp.add_argument("--ray", metavar="ADDRESS", default=None,
                     help="run the study's runs as tasks of the Ray cluster at ADDRESS (host:port "
                          "of its head, or 'auto' for RAY_ADDRESS / the cluster started on this "
                          "machine); same files and summary")
    exp.add_argument("--stale-after", type=float, default=STALE_AFTER_S, metavar="SECONDS",
                     help="take over a run another driver claimed once its heartbeat has been "
                          "silent this long (default %(default)s; a driver on this machine that "
                          "died is noticed at once)")
    exp.add_argument("--from-table", metavar="TABLE", default=None,
                     help="replay the study from its run table (runs.csv.gz, e.g. a committed "
                          "results/*.csv.gz; a plain .csv also reads): every figure recomputed "
                          "from the table alone, nothing computed; written to "
                          "<output>/<name>-from-table")
    exp.set_defaults(func=experiments.experiment)


def _add_study_commands(sub: Any) -> None:
    """The commands family, regime, plot: what is read from finished runs and studies."""
    fam = sub.add_parser("family",
                         help="Holm across the primary tests of several finished studies (a "
                              "pre-registered family, e.g. configs/confirm/family.yaml): "
                              "family.json, family.md, JSON on stdout")
    fam.add_argument("family",
                     help="family YAML: name, studies (study files relative to it), alpha")
    fam.add_argument("--output", default=None,
                     help="output root the studies ran with (default: each study's "
                                                     "output.dir)")
    fam.add_argument("--from-tables", metavar="DIR", default=None,
                     help="replay every study from its run table DIR/<study name>.csv.gz (e.g. "
                          "results/) first: the family from the committed tables alone")
    fam.set_defaults(func=experiments.family)

    fig = sub.add_parser("figures",
                         help="recompute the generated blocks of Markdown files (<!-- figures: "
                              "family FILE -->, study FILE or regime FOLDER ... <!-- "
                              "/figures -->) from the committed run "
                              "tables: rewrite them, or --check that they agree")
    fig.add_argument("files", nargs="+", metavar="FILE", help="Markdown files, e.g. README.md "
                                                             "docs/results.md")
    fig.add_argument("--tables", default="results",
                     help="folder of the run tables (default: %(default)s)")
    fig.add_argument("--check", action="store_true",
                     help="write nothing; exit 1 if a block differs from its recomputation")
    fig.set_defaults(func=experiments.figures)

    reg = sub.add_parser("regime",
                         help="the regime map of a study family: DIFF2-GD / DP-GD ratios over n x "
                              "ε (heatmaps, adjusted significance marks) and the final ‖∇f‖² "
                              "ratio's slope against nε/√d (cluster bootstrap over seeds) beside "
                              "the theory's −1/3")
    reg.add_argument("study_dirs", nargs="+", metavar="STUDY_DIR",
                     help="finished studies: folders holding summary.json (or summary.json files, "
                          "or a folder whose sub-folders hold them, e.g. outputs/regime); with "
                          "--from-tables, the study files (or their folder, e.g. configs/regime)")
    reg.add_argument("--from-tables", metavar="DIR", default=None,
                     help="replay every study from its run table DIR/<study name>.csv.gz (e.g. "
                          "results/) first: the map from the committed tables alone")
    reg.add_argument("--out", default="outputs/regime_map",
                     help="folder for heatmap_<dataset>.png, scatter.png, regime.md, regime.json "
                          "(default %(default)s)")
    reg.add_argument("--diff2", default=None, metavar="METHOD",
                     help="the DIFF2 method of each study to compare (default: its only diff2 "
                          "method)")
    reg.add_argument("--control", default=None, metavar="METHOD",
                     help="the DP-GD method to compare with (default: the study's first dpgd "
                          "method)")
    reg.add_argument("--alpha", type=float, default=0.05,
                     help="significance level of the marks, read on Holm/BH-adjusted p (default "
                          "%(default)s)")
    reg.add_argument("--replicates", type=int, default=None,
                     help="replicates of the cluster bootstrap over seeds for the slope's CI "
                          "(default: lab.regime.BOOTSTRAP_REPLICATES, 2000)")
    reg.add_argument("--bootstrap-seed", type=int, default=None,
                     help="seed of the bootstrap's generator (default: lab.regime.BOOTSTRAP_SEED, "
                          "fixed, so that the map is reproducible)")
    reg.add_argument("--no-plots", action="store_true", help="write the table and JSON only")
    reg.set_defaults(func=experiments.regime)

    plot = sub.add_parser("plot",
                          help="draw the per-round curves of one or several runs side by side "
                               "(PNG)")
    plot.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                      help="run folders (each holds metrics.jsonl)")
    plot.add_argument("--out", default=None,
                      help="PNG to write (default: RUN_DIR/curves.png for one run, "
                                                  "./curves-comparison.png for several)")
    plot.add_argument("--title", default=None, help="figure title")
    plot.set_defaults(func=experiments.plot)


def _add_superlink_command(sub: Any) -> None:
    """The command superlink: the local SuperLink plain `flwr run .` starts and leaves running."""
    link = sub.add_parser("superlink",
                          help="the local SuperLink plain `flwr run .` leaves running: its PID "
                               "(status) or stop it (stop)")
    link.add_argument("action", choices=("status", "stop"),
                      help="status: print its PID and address; stop: SIGTERM to its process group "
                           "(its simulation too), SIGKILL after 15 s")
    link.add_argument("--flwr-home", default=None, metavar="DIR",
                      help="the FLWR_HOME `flwr run` used (default: $FLWR_HOME, else ~/.flwr)")
    link.set_defaults(func=deployment.superlink)


def _add_deploy_commands(sub: Any) -> None:
    """The commands shard, deploy-local, certs: a deployment's data, a local one, its
    certificates."""
    shard = sub.add_parser("shard",
                           help="write one shard file per data owner (and the server's) for a "
                                "deployment")
    shard.add_argument("config",
                       help="experiment YAML whose dataset and training.clients define the shards")
    shard.add_argument("--out", required=True, help="output folder")
    shard.set_defaults(func=deployment.shard)

    dep = sub.add_parser("deploy-local",
                         help="run a native loopback deployment (SuperLink + P SuperNodes) of a "
                              "config")
    dep.add_argument("config", nargs="?", default="configs/default.yaml", help="experiment YAML")
    dep.add_argument("--tls", action="store_true",
                     help="TLS with a generated local CA (the default beyond a laptop); "
                     "turns on SuperNode authentication")
    dep.add_argument("--no-node-auth", dest="node_auth", action="store_false", default=None,
                     help="with --tls: accept any SuperNode instead of only the P registered keys")
    dep.add_argument("--resume", action="store_true",
                     help="continue from the checkpoint a previous run left in the run folder "
                          "(default: start fresh)")
    dep.add_argument("--rounds", type=int, default=None,
                     help="override training.rounds (~10 s per round)")
    dep.add_argument("--clients", type=int, default=None,
                     help="override training.clients (one SuperNode each)")
    dep.add_argument("--workdir", default=None, help="run folder: shards, keys, logs and outputs "
                                                     "(default: ./deploy-local/<config name>); "
                                                     "container paths such as /outputs map into it")
    dep.add_argument("--node-policy", metavar="FILE", default=None,
                     help="a data owner's node policy (e.g. configs/policy.yaml): each SuperNode "
                          "gets a copy through its node config, with a lifetime ledger of its own "
                          "in the run folder")
    dep.set_defaults(func=deployment.deploy_local)

    certs = sub.add_parser("certs",
                           help="generate a CA and a SuperLink certificate for a TLS deployment, "
                                "and check the data owners' SuperNode public keys")
    certs.add_argument("--out", required=True, help="output folder (0700; server.key 0600)")
    certs.add_argument("--host", action="append", default=None,
                       help="host name or IP the SuperLink is reached by (repeatable): the "
                            "compose service name, the name the SuperNodes dial, the address the "
                            "operator's flwr uses")
    certs.add_argument("--node-pub", nargs="+", metavar="FILE", default=None,
                       help="the data owners' public keys (each made with `diff2 node-key` on its "
                            "owner's machine), checked and copied as supernode-<i>.pub for `flwr "
                            "supernode register` (i from a file named supernode-<i>.pub, else the "
                            "order given)")
    certs.add_argument("--clients", type=int, default=0,
                       help="ONE-MACHINE TESTS ONLY: also make P SuperNode key pairs here, "
                            "supernode-<i>.key/.pub (whoever holds this folder then holds every "
                            "data owner's key; default %(default)s)")
    certs.set_defaults(func=lambda a: deployment.certs(argparse.Namespace(
        out=a.out, host=a.host or ["127.0.0.1", "localhost"], clients=a.clients,
        node_pub=a.node_pub)))


def _add_secret_commands(sub: Any) -> None:
    """The commands node-key, secret, compose: what each party of a deployment holds, and its
    compose file."""
    node_key = sub.add_parser("node-key",
                              help="(data owner) make this SuperNode's key pair; send only the "
                                   ".pub")
    node_key.add_argument("--out", required=True, help="folder (made 0700), e.g. deploy/certs")
    node_key.add_argument("--name", default="supernode",
                          help="file name stem: <name>.key (0600) and <name>.pub (default "
                               "%(default)s; for the compose files supernode-<i>)")
    node_key.set_defaults(func=deployment.node_key)

    secret = sub.add_parser("secret",
                            help="make SuperExec secrets (who may run the ServerApp / a ClientApp)")
    secret.add_argument("--out", required=True, help="folder (made 0700), e.g. deploy/secrets")
    secret.add_argument("names", nargs="+", metavar="NAME",
                        help="writes <out>/<NAME>.secret (0600) per name: superlink (operator), "
                             "supernode-<i> (data owner i, on its own machine)")
    secret.set_defaults(func=deployment.secret)

    comp = sub.add_parser("compose", help="print docker-compose.yml for P data owners (default 3)")
    comp.add_argument("--clients", type=int, default=3,
                      help="P: one SuperNode and one ClientApp per data owner")
    comp.add_argument("--tls", action="store_true",
                      help="TLS between SuperLink and every other component, with "
                      "SuperNode authentication")
    comp.add_argument("--no-node-auth", dest="node_auth", action="store_false", default=None,
                      help="with --tls: accept any SuperNode (default: only registered keys)")
    comp.add_argument("--publish", default="127.0.0.1",
                      help="the one host address the SuperLink port is published on (default "
                           "%(default)s; multi-host: the SuperLink host's address on the data "
                           "owners' network; never 0.0.0.0)")
    comp.add_argument("--superlink", default="superlink:8000",
                      help="address the SuperNodes dial (default %(default)s; multi-host: "
                           "<SuperLink host>:8000)")
    comp.set_defaults(func=deployment.compose)


def _add_lab_commands(sub: Any) -> None:
    """The commands audit (its flags derived from AuditSpec), bench, ledger."""
    aud = sub.add_parser("audit",
                         help="empirically audit the (ε, δ) guarantee of the real server path "
                              "(JSON; exit 3 if the audit proves it false)")
    add_setting_flags(aud, AuditSpec)
    aud.add_argument("--out", default=None, help="also write the JSON here")
    aud.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    aud.add_argument("--live", default=None, metavar="FOLDER",
                     help="instead: score a data owner's canaries in a live run, from the run "
                          "folder its policy's `canaries.state` holds (<state>/run-<run id>); any "
                          "time while the run trains")
    aud.add_argument("--engines", nargs="*", default=None, choices=ENGINES, metavar="ENGINE",
                     help=f"instead: attack the per-sample gradient engines ({', '.join(ENGINES)}"
                          "; all when none is named) with small real models and adversarial "
                          "records — the worker's (torch_func, ghost) through the client's own "
                          "path, the batched engine's (batch: float64 sums; batch_f32sums: float32 "
                          "accumulation, float32 only) through its round API — restart and "
                          "difference rounds, float64 and float32, and check each worker's "
                          "ClippedMean against its replace-one sensitivity 2C/n and each client "
                          "sum against 2C; --samples, --clip-restart, --clip-diff "
                          f"and --seed apply (without --seed: seed {ENGINE_SEED}, reproducible)")
    aud.set_defaults(func=experiments.audit)

    bench = sub.add_parser("bench",
                           help="measure speed (rounds/s, protocol wall time and GFLOP/s vs a "
                                "plain matmul, Flower vs its floor) as JSON")
    bench.add_argument("--data-dir", default=None, help="data directory (default: $DIFF2_DATA_DIR)")
    bench.add_argument("--rounds", type=int, default=300,
                       help="rounds timed for diff2_rounds_per_s")
    bench.add_argument("--flower-rounds", type=int, default=30,
                       help="rounds of each Flower simulation")
    bench.add_argument("--skip-protocol", action="store_true",
                       help="do not time the full California ε = 3 study")
    bench.add_argument("--flower-clients", type=int, default=1000, metavar="P",
                       help="SuperNodes of the sampled Flower federation (default %(default)s)")
    bench.add_argument("--flower-rate", type=float, default=0.05, metavar="Q",
                       help="its Poisson client-sampling rate (default %(default)s)")
    bench.add_argument("--skip-flower", action="store_true",
                       help="do not run the Flower simulations (10 clients, and the sampled "
                            "federation)")
    bench.add_argument("--skip-jax", action="store_true",
                       help="do not time the engine against hand-written JAX")
    bench.add_argument("--skip-models", action="store_true",
                       help="do not time DIFF2 against Opacus on the CNN and the transformer")
    bench.add_argument("--models-records", type=int, default=512, metavar="N",
                       help="records each side of the models section clips (default %(default)s)")
    bench.add_argument("--models-batch", type=int, default=256, metavar="B",
                       help="records per batch (chunk) of every side (default %(default)s)")
    bench.add_argument("--jax-python", default=None, metavar="PATH",
                       help="a Python with jax for the JAX side (default: $DIFF2_JAX_PYTHON, else "
                            "this one if it has jax; none: the section is skipped)")
    bench.add_argument("--jax-reps", type=int, default=2, metavar="N",
                       help="timed repetitions per side and cell, A/B/C then C/B/A (default "
                            "%(default)s)")
    bench.add_argument("--jax-cells", default=None, metavar="CELLS",
                       help="kind:K:dtype, comma-separated, of dpgd|diff2 : 1|18 : f32|f64 "
                            "(default: all 8)")
    bench.add_argument("--jax-rounds", default=None, metavar="R1,R18",
                       help="rounds per timed call at K = 1 and K = 18 (default: 100,10)")
    bench.add_argument("--jax-eager", action="store_true",
                       help="also time the engine with compile=False")
    bench.set_defaults(func=experiments.bench)

    led = sub.add_parser("ledger",
                         help="print a data owner's node ledger as JSON: the runs it charged, "
                              "each run's ε, and the lifetime ε spent")
    led.add_argument("path", help="the node's ledger file (named in its node policy)")
    led.add_argument("--delta", type=float, default=None,
                     help="δ at which the runs are composed (default: the δ_L of the last "
                          "admission, in the file)")
    led.set_defaults(func=deployment.ledger)


def _add_docs_command(sub: Any) -> None:
    """The command docs: build (and serve) this documentation site, offline."""
    doc = sub.add_parser("docs",
                         help="build the documentation site (mkdocs --strict, offline) and print "
                              "where it is as JSON; --serve then serves it on localhost")
    doc.add_argument("--out", default=None,
                     help="folder of the built site (default: site/ in the clone)")
    doc.add_argument("--serve", action="store_true",
                     help="after building, serve the site on 127.0.0.1 (rebuilt on changes) "
                          "until Ctrl-C; the JSON gives its URL")
    doc.add_argument("--port", type=int, default=None,
                     help=f"port of --serve (default {docs.DEFAULT_PORT}, or a free one when that "
                          f"is taken; a port given here and taken is an error)")
    doc.set_defaults(func=docs.docs)


def build_parser() -> argparse.ArgumentParser:
    """The ``diff2`` parser: every subcommand with its flags, each bound to its handler
    (``args.func``)."""
    parser = argparse.ArgumentParser(prog="diff2",
                                     description="DIFF2 differentially private federated training "
                                                 "on Flower.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    for add in (_add_run_commands, _add_superlink_command, _add_study_commands,
                _add_deploy_commands, _add_secret_commands, _add_lab_commands, _add_docs_command):
        add(sub)
    return parser


def main(argv: list[str] | None = None, *, _seen: list | None = None) -> int:
    """Run the ``diff2`` command of ``argv`` (default: the process's) and return its exit code; a
    ValueError or FileNotFoundError becomes one ``diff2 <command>: error:`` line and exit code 2."""
    args = build_parser().parse_args(argv)
    if _seen is not None:
        _seen.append(args)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"diff2 {args.command}: error: {err}", file=sys.stderr)
        return 2


def console() -> None:
    """The ``diff2`` command: :func:`main`, then exit with its code. A run refused before it started
    anything (``diff2 run``'s preflight) ends the process at once once its line and JSON are
    flushed: it has nothing to clean up, and the interpreter's teardown of native libraries' threads
    (torch's) under load once wrote a second line ("terminate called without an active exception")
    after the one promised."""
    seen: list = []
    code = main(_seen=seen)
    if seen and getattr(seen[0], "started_nothing", False):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
