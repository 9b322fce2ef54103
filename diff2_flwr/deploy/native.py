"""A real multi-process deployment on this machine: SuperLink, one SuperNode per data owner, `flwr run`.

This is the topology of ``docker-compose.yml`` as native processes on 127.0.0.1 (no Docker
needed): ``flower-superlink`` (deployment mode, subprocess isolation: it runs the ServerApp),
P ``flower-supernode`` processes, each given ``partition-id``, ``num-partitions`` and the path
of its own shard file (written by ``diff2 shard``), and ``flwr run`` submitting the app. With
``tls=True`` a throw-away CA and a server certificate for 127.0.0.1 are generated; the
SuperLink serves TLS and every SuperNode and the CLI verify it. Every process started is
stopped by PID (its process group), also when the run fails.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from ..runtime.config import load_config, parse_config
from ..runtime.launch import (
    LaunchResult,
    SimulationFailed,
    _free_port,
    _stop,
    _tool,
    _wait_healthy,
    flwr_env,
    flwr_run,
    run_config_arg,
    start,
    write_connection,
)
from ..runtime.paths import APP_DIR, resolve_config_path
from ..runtime.shard_files import shard_name
from .certs import make_certificates
from .shards import write_shards

__all__ = ["DeploymentResult", "run_local_deployment"]


@dataclass(frozen=True)
class DeploymentResult:
    launch: LaunchResult
    config: Path  # the deployment config actually run (shards set, train metrics off)
    round_seconds: list[float]


def deployment_config(config: str | os.PathLike[str], workdir: Path, rounds: int | None = None,
                      clients: int | None = None) -> Path:
    """Write the shards of ``config`` into ``workdir`` and a config that reads them (server: no train data)."""
    cfg = load_config(resolve_config_path(config))
    data = cfg.to_dict()
    if clients is not None:
        data["training"]["clients"] = clients
        cfg = parse_config(data, str(config))
    shards = workdir / "shards"
    write_shards(cfg, shards)
    data["dataset"]["shards"] = str(shards)
    data["evaluation"]["train_metrics"] = False
    if rounds is not None:
        data["training"]["rounds"] = rounds
        if data["training"]["restart_every"] and data["training"]["restart_every"] > rounds:
            data["training"]["restart_every"] = rounds
    if not Path(data["output"]["dir"]).is_absolute():
        data["output"]["dir"] = str(Path.cwd() / data["output"]["dir"])
    path = workdir / "deployment.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def run_local_deployment(
    config: str | os.PathLike[str],
    *,
    tls: bool = False,
    rounds: int | None = None,
    clients: int | None = None,
    app_dir: str | os.PathLike[str] = APP_DIR,
    workdir: str | os.PathLike[str] | None = None,
    timeout_s: float = 1800,
    echo: bool = True,
    kill_node_after_round: tuple[int, int] | None = None,
) -> DeploymentResult:
    """Run ``config`` as a native loopback deployment; raise :class:`SimulationFailed` unless it completes.

    ``kill_node_after_round=(i, k)`` is fault injection: SuperNode i is killed once round k is released.
    """
    own_dir = workdir is None
    work = Path(workdir or tempfile.mkdtemp(prefix="diff2-deploy-"))
    work.mkdir(parents=True, exist_ok=True)
    processes = []
    try:
        dep_config = deployment_config(config, work, rounds, clients)
        cfg = load_config(dep_config)
        clients = cfg.training.clients
        home = work / "flwr-home"
        home.mkdir(exist_ok=True)
        port, health = _free_port(), _free_port()
        certs = make_certificates(work / "certs") if tls else None
        write_connection(home, port, certs.ca if certs else None)
        env = flwr_env(home)
        security = (["--ssl-certfile", str(certs.cert), "--ssl-keyfile", str(certs.key), "--ssl-ca-certfile",
                     str(certs.ca)] if certs else ["--insecure"])
        superlink = start([_tool("flower-superlink"), *security, "--isolation", "subprocess", "--host", "127.0.0.1",
                           "--port", str(port), "--health-server-address", f"127.0.0.1:{health}"],
                          work / "superlink.log", env)
        processes.append(superlink)
        _wait_healthy(port, superlink, work / "superlink.log", ca_file=certs.ca if certs else None)
        client_security = ["--root-certificates", str(certs.ca)] if certs else ["--insecure"]
        shards = Path(cfg.dataset.shards or "")
        for p in range(clients):
            node_config = (f'partition-id={p} num-partitions={clients} '
                           f'data-path="{shards / shard_name(p, clients)}"')
            processes.append(start([_tool("flower-supernode"), *client_security, "--superlink", f"127.0.0.1:{port}",
                                    "--isolation", "subprocess", "--host", "127.0.0.1", "--port", str(_free_port()),
                                    "--node-config", node_config], work / f"supernode-{p}.log", env))
        time.sleep(2)
        for p, proc in enumerate(processes[1:]):
            if proc.poll() is not None:
                raise SimulationFailed(f"supernode {p} exited with code {proc.returncode}; log: "
                                       f"{work / f'supernode-{p}.log'}\n" + (work / f"supernode-{p}.log").read_text()[-2000:])
        on_line = None
        if kill_node_after_round is not None:
            victim, after = kill_node_after_round
            marker = f"[diff2] round {after}/"

            def on_line(line: str) -> None:
                if marker in line:
                    _stop(processes[1 + victim])

        result = flwr_run(Path(app_dir).resolve(), env, ["--run-config", run_config_arg({"config": str(dep_config)})],
                          timeout_s=timeout_s, echo=echo, on_line=on_line)
        rows = []
        if result.output_dir is not None:
            import json

            rows = [json.loads(line) for line in (result.output_dir / "metrics.jsonl").read_text().splitlines()]
        elapsed = [r["elapsed_s"] for r in rows]
        return DeploymentResult(result, dep_config, [b - a for a, b in zip(elapsed, elapsed[1:])])
    finally:
        for proc in reversed(processes):
            _stop(proc)
        if own_dir and not os.environ.get("DIFF2_KEEP_DEPLOY_DIR"):
            shutil.rmtree(work, ignore_errors=True)
