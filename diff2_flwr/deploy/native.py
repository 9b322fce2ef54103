"""A real multi-process deployment on this machine: SuperLink, one SuperNode per data owner, `flwr
run`.

This is the topology of ``docker-compose.yml`` as native processes on 127.0.0.1 (no Docker
needed): ``flower-superlink`` (deployment mode, subprocess isolation: it runs the ServerApp),
P ``flower-supernode`` processes, each given ``partition-id``, ``num-partitions`` and the path
of its own shard file (written by ``diff2 shard``), and ``flwr run`` submitting the app. With
``tls=True`` a throw-away CA and a server certificate for 127.0.0.1 are generated; the
SuperLink serves TLS and every SuperNode and the CLI verify it. With ``node_auth`` (the default
with TLS; Flower refuses it without) each data owner gets a key pair, the SuperLink runs with
``--enable-supernode-auth``, the P public keys are registered through ``flwr supernode register``
and SuperNode i starts with ``--auth-supernode-private-key`` = its own key: any other SuperNode is
refused. Every process started is stopped by PID (its process group), also when the run fails.

SuperExec authentication is always on: the SuperLink and every SuperNode run with ``--isolation
process`` (Flower 1.42 ignores ``--superexec-auth-secret-file`` in subprocess isolation, where the
runtime API then takes any caller) and one ``flower-superexec`` each, started here, runs their apps.
A SuperExec must sign ``AcquireTask`` with its secret: ``<run folder>/secrets/superlink.secret``
(SuperLink and the ServerApp's SuperExec) and ``supernode-<i>.secret`` (SuperNode i and its
ClientApp's SuperExec), 0600 in a 0700 folder. Anyone else who reaches a runtime port (any local
user) is refused instead of receiving the ServerApp's task, i.e. every client's exact clipped mean.

Everything of a run lives in one run folder (default ``./deploy-local/<config name>``): shards,
certificates and keys, logs, the deployment config and the outputs. A config's container paths
(``/outputs``, where ``docker-compose.yml`` mounts ``./deploy/outputs``) are mapped to
``<run folder>/outputs``. A repeated run starts fresh (a checkpoint left in the run folder by a
previous run is removed, and said so) unless ``resume=True``.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..runtime.launch import (
    CONNECTION,
    LaunchResult,
    SimulationFailed,
    free_ports,
    stop_process,
    tool,
    wait_healthy,
    flwr_env,
    flwr_run,
    run_config_arg,
    start,
    write_connection,
)
from ..runtime.paths import APP_DIR
from ..runtime.shard_files import shard_name
from .run_folder import (check_data_owners_rules, default_run_folder, deployment_config,
                         owner_policies, prepare_run_folder)
from .certs import Certificates, NodeKey, make_certificates, make_node_keys
from ..runtime.secret_files import make_superexec_secret

__all__ = ["DeploymentResult", "Intruder", "LiveDeployment", "run_local_deployment",
           "default_run_folder", "deployment_config",
           "start_superexec", "start_superlink", "register_node", "list_nodes", "INTRUDER_KINDS"]

#: Fault injection for tests (``intruders=``): a SuperNode posing as data owner 0 with no key of its
#: own (Flower then self-registers an ephemeral one) or with a key pair the operator never
#: registered.
INTRUDER_KINDS = ("no-key", "unregistered-key")


@dataclass(frozen=True)
class Intruder:
    """How an injected intruder SuperNode ended (fault injection): its kind (one of
    :data:`INTRUDER_KINDS`), its exit code and its log."""

    kind: str
    returncode: int | None  # None: still running when the run started (it was not refused)
    log: Path


@dataclass(frozen=True)
class LiveDeployment:
    """What a running deployment looks like from outside (given to ``on_ready`` before ``flwr
    run``)."""
    port: int
    workdir: Path
    env: dict[str, str]
    certificates: Certificates | None
    node_keys: list[NodeKey]
    node_ids: list[int]  # registered node id of data owner i (node authentication only)
    # SuperExec secret of "superlink", "supernode-<i>"
    secrets: dict[str, Path] = field(default_factory=dict)
    node_ports: list[int] = field(default_factory=list)  # runtime API port of SuperNode i


@dataclass(frozen=True)
class DeploymentResult:
    """A completed native deployment: the ``flwr run`` result, the config it ran, the seconds
    between rounds, the run folder, and the data owners' nodes as the SuperLink saw them."""

    launch: LaunchResult
    config: Path  # the deployment config actually run (shards set, train metrics off)
    round_seconds: list[float]
    workdir: Path = Path(".")
    node_auth: bool = False
    # registered node id of data owner i (node auth only)
    node_ids: list[int] = field(default_factory=list)
    nodes: list[dict] = field(default_factory=list)  # `flwr supernode ls` at the end of the run
    intruders: list[Intruder] = field(default_factory=list)


def register_node(public_key: Path, env: dict[str, str], partition: int) -> int:
    """``flwr supernode register`` through the SuperLink's Control API; the new node id."""
    done = subprocess.run([tool("flwr"), "supernode", "register", str(public_key), CONNECTION,
                           "--name",
                           f"data-owner-{partition}", "--format", "json"],
                          env=env, capture_output=True, text=True, timeout=120)
    try:
        answer = json.loads(done.stdout[done.stdout.index("{"):])
        return int(answer["node-id"])
    except (ValueError, KeyError):
        raise SimulationFailed(
            f"`flwr supernode register {public_key}` (data owner {partition}) failed with code "
            f"{done.returncode}:\n{done.stdout[-2000:]}{done.stderr[-2000:]}") from None


def list_nodes(env: dict[str, str]) -> list[dict]:
    """The SuperNodes the SuperLink knows (``flwr supernode ls --format json``), each a dict of
    Flower's fields."""
    done = subprocess.run([tool("flwr"), "supernode", "ls", CONNECTION, "--format", "json"],
                          env=env, capture_output=True, text=True, timeout=120)
    try:
        return list(json.loads(done.stdout[done.stdout.index("{"):])["nodes"])
    except (ValueError, KeyError):
        return []


def start_superlink(work: Path, env: dict[str, str], port: int, health: int, secret: Path,
                    certs: Certificates | None = None, node_auth: bool = False) -> subprocess.Popen:
    """``flower-superlink`` on 127.0.0.1:``port`` with process isolation and SuperExec
    authentication; healthy."""
    security = (["--ssl-certfile", str(certs.cert), "--ssl-keyfile", str(certs.key),
                 "--ssl-ca-certfile", str(certs.ca)] if certs else ["--insecure"])
    log = work / "superlink.log"
    proc = start([tool("flower-superlink"), *security,
                  *(["--enable-supernode-auth"] if node_auth else []),
                  "--isolation", "process", "--superexec-auth-secret-file", str(secret), "--host",
                  "127.0.0.1",
                  "--port", str(port), "--health-server-address", f"127.0.0.1:{health}"], log, env)
    try:
        wait_healthy(port, proc, log, ca_file=certs.ca if certs else None)
    except SimulationFailed:
        stop_process(proc)
        raise
    return proc


def start_superexec(runtime: subprocess.Popen, runtime_port: int, secret: Path, log: Path,
                    env: dict[str, str], ca: Path | None = None) -> subprocess.Popen:
    """``flower-superexec`` for the runtime API of ``runtime`` on 127.0.0.1:``runtime_port``,
    signing with ``secret``; it exits with ``runtime`` (``--parent-pid``) should this process die
    before stopping it."""
    security = ["--root-certificates", str(ca)] if ca else ["--insecure"]
    return start([tool("flower-superexec"), *security, "--superexec-auth-secret-file", str(secret),
                  "--runtime-api-address", f"127.0.0.1:{runtime_port}", "--parent-pid",
                  str(runtime.pid)], log, env)


def node_config(p: int, clients: int, shards: Path, policy: Path | None = None,
                experiments: Path | None = None, auth_key: Path | None = None,
                federation: Path | None = None) -> str:
    """SuperNode ``p``'s ``--node-config``: its partition, the path of its shard file, (``policy``)
    of its node policy, (``experiments``) the folder of experiment files it opens besides the app
    bundle's and, with node authentication, (``auth_key``, ``federation``) its SuperNode key and the
    registered keys, with which its ClientApp signs and checks SecAgg+ public keys
    (:mod:`diff2_flwr.fl.secagg_checks`)."""
    config = (f'partition-id={p} num-partitions={clients} '
              f'data-path="{shards / shard_name(p, clients)}"')
    if experiments is not None:
        config += f' experiments="{experiments}"'
    if auth_key is not None and federation is not None:
        config += f' auth-key="{auth_key}" federation-keys="{federation}"'
    if policy is not None:
        config += f' policy="{policy}"'
    return config


def start_supernode(port: int, node_port: int, node_config: str, secret: Path, log: Path,
                    env: dict[str, str], ca: Path | None = None,
                    key: Path | None = None) -> subprocess.Popen:
    """``flower-supernode`` dialling the SuperLink on 127.0.0.1:``port`` (TLS verified with ``ca``,
    else insecure) with process isolation and SuperExec authentication, its runtime API on
    127.0.0.1:``node_port``; with ``key`` it authenticates with that private key."""
    security = ["--root-certificates", str(ca)] if ca else ["--insecure"]
    auth = ["--auth-supernode-private-key", str(key)] if key is not None else []
    return start([tool("flower-supernode"), *security, *auth, "--superlink", f"127.0.0.1:{port}",
                  "--isolation", "process", "--superexec-auth-secret-file", str(secret),
                  "--host", "127.0.0.1", "--port", str(node_port), "--node-config", node_config],
                  log, env)


def _secrets(work: Path, clients: int) -> dict[str, Path]:
    """Fresh SuperExec secrets for this run: the SuperLink's and one per SuperNode (0600 in a 0700
    folder)."""
    names = ["superlink", *(f"supernode-{p}" for p in range(clients))]
    return {name: make_superexec_secret(work / "secrets" / f"{name}.secret") for name in names}


#: How long every data owner's SuperNode may take to connect before ``flwr run`` (slow starts under
#: load).
SUPERNODE_CONNECT_S = 240.0


def _await_supernodes(nodes: list[subprocess.Popen], apps: dict[str, subprocess.Popen],
                      rebind: Callable[[int], subprocess.Popen], work: Path,
                      timeout_s: float = SUPERNODE_CONNECT_S) -> None:
    """Return once every SuperNode has connected (its log names the node id the SuperLink gave it).

    A SuperNode that could not bind its runtime port (taken between the probe and its bind) is
    started once more on a fresh port by ``rebind(p)`` (its first log kept as
    ``supernode-<p>.bind-failed.log``); any other exit, and a SuperNode still not connected after
    ``timeout_s``, raises with its log. Submitting the run before every owner is connected would
    leave the ServerApp waiting for a node that is gone, then fail the round without saying why.
    """
    rebound: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while True:
        for p, node in enumerate(nodes):
            log = work / f"supernode-{p}.log"
            if node.poll() is not None and p not in rebound and _bind_failed(log):
                log.replace(work / f"supernode-{p}.bind-failed.log")
                rebound.add(p)
                nodes[p] = rebind(p)
        _check_alive({**{f"supernode-{p}": proc for p, proc in enumerate(nodes)}, **apps}, work)
        waiting = [p for p in range(len(nodes))
                   if "SuperNode ID:" not in _read(work / f"supernode-{p}.log")]
        if not waiting:
            return
        if time.monotonic() >= deadline:
            p = waiting[0]
            raise SimulationFailed(
                f"SuperNode {p} (data owner {p}) did not connect to the SuperLink within "
                f"{timeout_s:.0f} s (still waiting: {waiting}); its log: "
                f"{work / f'supernode-{p}.log'}\n"
                + _read(work / f"supernode-{p}.log")[-2000:])
        time.sleep(0.5)


def _bind_failed(log: Path) -> bool:
    """Whether a Flower component's log says it could not bind its port."""
    return "address already in use" in _read(log).lower()


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _check_alive(procs: dict[str, subprocess.Popen], work: Path) -> None:
    """Raise with the log of the first process (by log name) that has already exited."""
    for name, proc in procs.items():
        if proc.poll() is not None:
            log = work / f"{name}.log"
            raise SimulationFailed(
                f"{name} exited with code {proc.returncode}; log: {log}\n" + log.read_text()[
                    -2000:])


def _check_deployment_arguments(tls: bool, node_auth: bool | None, intruders: tuple[str,
                                                                                    ...]) -> bool:
    """Whether SuperNodes authenticate (default: with TLS); refuse authentication without TLS and
    unknown intruders."""
    node_auth = tls if node_auth is None else node_auth
    if node_auth and not tls:
        raise ValueError(
            "SuperNode authentication needs TLS: Flower refuses `--enable-supernode-auth` on an "
            "insecure SuperLink (the keys would prove nothing over plain text). Add --tls, or "
            "pass --no-node-auth.")
    unknown = [k for k in intruders if k not in INTRUDER_KINDS]
    if unknown:
        raise ValueError(
            f"`intruders`: unknown kind(s) {unknown}; expected some of {list(INTRUDER_KINDS)}.")
    return node_auth


def _run_intruders(intruders: tuple[str, ...], work: Path, supernode: Callable[...,
                                                                               subprocess.Popen],
                   ports: list[int]) -> list[Intruder]:
    """Start one SuperNode per intruder kind, posing as data owner 0 (each with its own port and
    SuperExec secret), and return how each ended within 30 s (a refused one exits; one still running
    is None)."""
    runs = []
    for n, kind in enumerate(intruders):
        key = make_node_keys(work / "intruders" / f"{n}-{kind}",
                             1)[0].private if kind == "unregistered-key" else None
        log = work / f"intruder-{n}-{kind}.log"
        own = make_superexec_secret(work / "intruders" / f"{n}-{kind}" / "superexec.secret")
        runs.append((kind, supernode(0, log, key, ports[n], own), log))
    deadline = time.monotonic() + 30
    while runs and time.monotonic() < deadline and any(p.poll() is None for _, p, _ in runs):
        time.sleep(0.2)
    return [Intruder(kind, proc.poll(), log) for kind, proc, log in runs]


def _node_killer(kill_node_after_round: tuple[int, int] | None,
                 nodes: list[subprocess.Popen]) -> Callable[[str], None] | None:
    """For fault injection: a stream reader that stops SuperNode i once round k's line is
    released."""
    if kill_node_after_round is None:
        return None
    victim, after = kill_node_after_round
    marker = f"[diff2] round {after}/"

    def on_line(line: str) -> None:
        if marker in line:
            stop_process(nodes[victim])

    return on_line


def _round_seconds(output_dir: Path | None) -> list[float]:
    """The seconds between consecutive rounds, from the run's metrics.jsonl (none without an output
    folder)."""
    rows = []
    if output_dir is not None:
        rows = [json.loads(line)
                for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    elapsed = [r["elapsed_s"] for r in rows]
    return [b - a for a, b in zip(elapsed, elapsed[1:])]


def run_local_deployment(  # noqa: PLR0913 -- keyword-only options: CLI flags and test hooks
    config: str | os.PathLike[str],
    *,
    tls: bool = False,
    node_auth: bool | None = None,
    resume: bool = False,
    rounds: int | None = None,
    clients: int | None = None,
    app_dir: str | os.PathLike[str] = APP_DIR,
    workdir: str | os.PathLike[str] | None = None,
    timeout_s: float = 1800,
    echo: bool = True,
    kill_node_after_round: tuple[int, int] | None = None,
    intruders: tuple[str, ...] = (),
    on_ready: Callable[[LiveDeployment], None] | None = None,
    node_policy: str | os.PathLike[str] | None = None,
) -> DeploymentResult:
    """Run ``config`` as a native loopback deployment; raise :class:`SimulationFailed` unless it
    completes.

    ``node_auth`` (default: on with ``tls``) registers one key pair per data owner and refuses every
    other SuperNode; it needs TLS. ``workdir`` is the run folder (default
    :func:`default_run_folder`); a checkpoint a previous run left there is removed unless
    ``resume``. Fault injection for tests: ``kill_node_after_round=(i, k)`` kills SuperNode i once
    round k is released; ``intruders`` starts extra SuperNodes posing as data owner 0 (kinds in
    :data:`INTRUDER_KINDS`) before the run is submitted; ``on_ready`` is called with the live
    deployment just before ``flwr run``. ``node_policy``: every data owner's SuperNode gets a copy
    of this policy through its node config (``policy=...``), each with a lifetime ledger of its own
    (see :func:`owner_policies`).
    """
    node_auth = _check_deployment_arguments(tls, node_auth, intruders)
    work = Path(workdir) if workdir is not None else default_run_folder(config)
    work = work.expanduser().resolve()
    work.mkdir(parents=True, exist_ok=True)
    processes = []
    try:
        dep_config, cfg, home = prepare_run_folder(config, work, rounds, clients, resume, echo)
        check_data_owners_rules(cfg, node_policy)
        clients = cfg.training.clients
        # all distinct: the SuperLink's API and health server, each SuperNode's and each intruder's
        port, health, *node_ports = free_ports(2 + clients + len(intruders))
        certs = make_certificates(work / "certs") if tls else None
        keys = make_node_keys(work / "certs", clients) if node_auth else []
        secrets = _secrets(work, clients)
        write_connection(home, port, certs.ca if certs else None)
        env = flwr_env(home)
        processes.append(start_superlink(work, env, port, health, secrets["superlink"], certs,
                                         node_auth))
        apps = {"superexec-serverapp": start_superexec(processes[0], port, secrets["superlink"],
                                                       work / "superexec-serverapp.log", env,
                                                       certs.ca if certs else None)}
        processes.append(apps["superexec-serverapp"])
        node_ids = [register_node(key.public, env, p) for p, key in enumerate(keys)]
        federation = None
        # the registered keys, against which every data owner's node checks its peers' SecAgg+ keys
        if keys:
            federation = work / "certs" / "federation.pub"
            federation.write_bytes(b"".join(key.public.read_bytes().rstrip(b"\n") + b"\n"
                                            for key in keys))
        shards = Path(cfg.dataset.shards or "")
        policies = owner_policies(node_policy, work, clients) if node_policy is not None else []

        def supernode(p: int, log: Path, key: Path | None, node_port: int,
                      secret: Path) -> subprocess.Popen:
            # not an intruder's key
            signing = key if keys and p < clients and key == keys[p].private else None
            own = node_config(p, clients, shards, policies[p] if policies else None,
                              dep_config.parent, signing, federation)
            processes.append(start_supernode(port, node_port, own, secret, log, env,
                                             certs.ca if certs else None, key))
            return processes[-1]

        def owner(p: int) -> subprocess.Popen:
            """Data owner p's SuperNode and the SuperExec of its ClientApp (on node_ports[p])."""
            node = supernode(p, work / f"supernode-{p}.log", keys[p].private if keys else None,
                             node_ports[p], secrets[f"supernode-{p}"])
            name = f"superexec-clientapp-{p}"
            apps[name] = start_superexec(node, node_ports[p], secrets[f"supernode-{p}"],
                                         work / f"{name}.log", env)
            processes.append(apps[name])
            return node

        nodes = [owner(p) for p in range(clients)]

        def rebind(p: int) -> subprocess.Popen:
            node_ports[p] = free_ports(1)[0]
            return owner(p)

        _await_supernodes(nodes, apps, rebind, work)
        intruder_outcomes = _run_intruders(intruders, work, supernode, node_ports[clients:])
        if on_ready is not None:
            on_ready(LiveDeployment(port, work, env, certs, keys, node_ids, secrets,
                                    node_ports[:clients]))
        result = flwr_run(Path(app_dir).resolve(), env,
                          ["--run-config", run_config_arg({"config": str(dep_config)})],
                          timeout_s=timeout_s, echo=echo,
                          on_line=_node_killer(kill_node_after_round, nodes))
        return DeploymentResult(result, dep_config, _round_seconds(result.output_dir), work,
                                node_auth, node_ids, list_nodes(env), intruder_outcomes)
    finally:
        for proc in reversed(processes):
            stop_process(proc)
