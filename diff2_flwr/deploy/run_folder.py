"""The run folder of a local deployment (``diff2 deploy-local``): the deployment's experiment file
and its shards, each data owner's copy of the node policy, a previous run's checkpoint settled
(fresh or resume), and what every data owner's node would refuse, said before anything starts.
:mod:`.native` starts the processes in it."""

from __future__ import annotations

import os
import shutil
from pathlib import Path, PurePosixPath

import yaml

from ..runtime.config import (AUTO_CLIENTS_DEFAULT, ExperimentConfig, load_config, parse_config,
                              read_yaml)
from ..runtime.node_guard import check_deployment_run
from ..runtime.paths import resolve_config_path
from ..runtime.policy import PolicyError, check_run, load_policy
from ..runtime.secret_files import private_folder, write_private
from ..runtime.shard_files import SERVER_FILE, read_server_data
from .compose import CONTAINER_OUTPUTS
from .shards import write_shards

__all__ = ["EXPERIMENT_FOLDER", "default_run_folder", "deployment_config", "owner_policies",
           "prepare_run_folder",
           "check_data_owners_rules"]

#: The run folder's sub-folder of the deployment's experiment file: every data owner's node config
#: names it as its ``experiments`` folder (a data owner's node opens no other file the run config
#: names).
EXPERIMENT_FOLDER = "experiment"


def default_run_folder(config: str | os.PathLike[str]) -> Path:
    """``./deploy-local/<config name>``: where a native deployment keeps its shards, logs, keys and
    outputs."""
    return Path.cwd() / "deploy-local" / load_config(resolve_config_path(config)).name


def _map_container_path(value: str | None, workdir: Path) -> str | None:
    """``/outputs/...`` (the compose file's mount point) → ``<workdir>/outputs/...``; relative →
    absolute."""
    if value is None:
        return None
    path = PurePosixPath(value)
    if path == PurePosixPath(CONTAINER_OUTPUTS) or PurePosixPath(CONTAINER_OUTPUTS) in path.parents:
        return str(workdir / "outputs" / path.relative_to(CONTAINER_OUTPUTS))
    if not Path(value).expanduser().is_absolute():
        return str(Path.cwd() / value)
    return value


def deployment_config(config: str | os.PathLike[str], workdir: Path, rounds: int | None = None,
                      clients: int | None = None, echo: bool = False) -> Path:
    """Write the shards of ``config`` into ``workdir`` and a config that reads them (server: no
    train data)."""
    cfg = load_config(resolve_config_path(config))
    data = cfg.to_dict()
    # this deployment starts the SuperNodes: it says how many
    if clients is None and cfg.clients_auto:
        clients = AUTO_CLIENTS_DEFAULT
        if echo:
            print(
                f"[diff2] training.clients: auto -> P = {clients} SuperNodes (--clients N for "
                f"another number)",
                  flush=True)
    if clients is not None:
        data["training"]["clients"] = clients
        cfg = parse_config(data, str(config))
    shards = workdir / "shards"
    write_shards(cfg, shards)
    data["dataset"]["shards"] = str(shards)
    data["evaluation"]["train_metrics"] = False
    if data["privacy"].get("noise") == "distributed" and data["privacy"].get("n_min") is None:
        # the federation's constant under distributed noise (every node refuses a run without it):
        # the smallest shard's records, which this launcher knows as the one who wrote every shard
        data["privacy"]["n_min"] = read_server_data(shards / SERVER_FILE, cfg).n_min
    if rounds is not None:
        data["training"]["rounds"] = rounds
        if data["training"]["restart_every"] and data["training"]["restart_every"] > rounds:
            data["training"]["restart_every"] = rounds
    for key in ("dir", "checkpoint"):
        given = data["output"][key]
        data["output"][key] = _map_container_path(given, workdir)
        if echo and given is not None and data["output"][key] != given and Path(
            given).is_absolute():
            print(
                f"[diff2] output.{key} {given} is a container path (docker-compose.yml mounts "
                f"./deploy/outputs at {CONTAINER_OUTPUTS}); this native run uses "
                f"{data['output'][key]}", flush=True)
    # the data owners' `experiments` folder: this file and nothing else
    folder = workdir / EXPERIMENT_FOLDER
    folder.mkdir(exist_ok=True)
    path = folder / "deployment.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _fresh_or_resume(checkpoint: str | None, workdir: Path, resume: bool, echo: bool) -> None:
    """A repeated run starts fresh unless asked to resume; never silently continue or delete a
    user's file."""
    if checkpoint is None:
        if resume:
            raise ValueError(
                "--resume: the config sets no output.checkpoint, so there is nothing to resume. "
                "Set output.checkpoint (e.g. /outputs/checkpoint.npz) or run without --resume.")
        return
    path = Path(checkpoint)
    if resume:
        if not path.exists():
            raise ValueError(
                f"--resume: no checkpoint at {path} (output.checkpoint) from a previous run in "
                f"{workdir}. Run without --resume to start fresh, or pass the --workdir of that "
                f"run.")
        if echo:
            print(f"[diff2] resuming from {path}", flush=True)
        return
    if not path.exists():
        return
    if workdir.resolve() in path.resolve().parents:
        path.unlink()
        if echo:
            print(
                f"[diff2] starting fresh: removed {path} left by a previous run (pass --resume to "
                f"continue it)",
                  flush=True)
        return
    raise ValueError(
        f"output.checkpoint {path} exists (a previous run's state, outside the run folder "
        f"{workdir}). "
                     "Pass --resume to continue that run, or delete the file to start fresh.")


def owner_policies(policy: str | os.PathLike[str], work: Path, clients: int) -> list[Path]:
    """One copy of ``policy`` per data owner (``<work>/owners/<i>/policy.yaml``, 0600 in 0700
    folders), each with its own lifetime ledger beside it: on one machine the P owners are P nodes,
    each with its own budget."""
    load_policy(policy)  # a bad policy fails here, before anything starts
    data = read_yaml(policy, "node policy", PolicyError)
    paths = []
    for p in range(clients):
        folder = private_folder(work / "owners" / str(p))
        own = dict(data)
        if isinstance(own.get("lifetime"), dict) and own["lifetime"].get("ledger"):
            own["lifetime"] = {**own["lifetime"], "ledger": str(folder / "ledger.json")}
        paths.append(write_private(folder / "policy.yaml",
                                   yaml.safe_dump(own, sort_keys=False).encode()))
    return paths


def prepare_run_folder(config: str | os.PathLike[str], work: Path, rounds: int | None,
                       clients: int | None,
                        resume: bool, echo: bool) -> tuple[Path, ExperimentConfig, Path]:
    """The deployment config (and its shards) written into ``work``, a previous run's checkpoint
    settled (fresh or resume) and an empty Flower home for ``flwr``: the config's path, the config,
    the home."""
    dep_config = deployment_config(config, work, rounds, clients, echo=echo)
    cfg = load_config(dep_config)
    _fresh_or_resume(cfg.output.checkpoint, work, resume, echo)
    home = work / "flwr-home"
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir()
    return dep_config, cfg, home


def check_data_owners_rules(cfg: ExperimentConfig,
                            node_policy: str | os.PathLike[str] | None) -> None:
    """What every data owner's node would refuse at round 1: what its policy does not allow (ε, δ,
    rounds, methods, models, noise, ...) and, whatever the run's ε, a seed the policy does not
    allow, node-side noise without a policy's answer log, an undeclared or unpinned n_min; said
    before anything starts: the nodes' own rule
    (:func:`~diff2_flwr.runtime.node_guard.check_deployment_run`), the nodes' own words."""
    policy = load_policy(node_policy) if node_policy is not None else None
    node = "every data owner's node"
    if policy is not None:  # the policy's own rules (methods, ε, δ, rounds, models, noise, ...)
        check_run(policy, cfg, node)
    check_deployment_run(cfg, node, policy, keeps_record=policy is not None)
