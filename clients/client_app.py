"""Flower ClientApp: one worker per SuperNode, holding shard ``partition-id`` of ``num-partitions``.

With ``training.clients: auto``, P is ``num-partitions`` (in a simulation, Flower's number of
SuperNodes: the same number the ServerApp resolved).

The node's operator may give it a policy (node config ``policy``, or ``$DIFF2_NODE_POLICY`` in a
simulation): see :mod:`diff2_flwr.runtime.policy`. The run is checked against it before any record
is read.

A data owner's node (anything but a node of Flower's simulation engine:
:mod:`diff2_flwr.runtime.node_mode`) takes settings from the run config, never paths: it reads the
experiment file only from inside the app bundle or its own ``experiments`` folder, its records only
from its node config's ``data-path``, and no error it raises quotes a file's content (the error text
travels to the server).
"""

from __future__ import annotations

import functools
import os
from typing import Any

from flwr.client import Client, ClientApp
from flwr.common import Context

from diff2_flwr.core.distributed import DistributedNoise
from diff2_flwr.fl import protocol
from diff2_flwr.fl.client import Diff2Client
from diff2_flwr.fl.secagg import secure_sum_mod
from diff2_flwr.runtime.compute import pin_threads
from diff2_flwr.runtime.config import ExperimentConfig, load_run_config
from diff2_flwr.runtime.node_guard import NodeGuard
from diff2_flwr.runtime.node_mode import simulated_node
from diff2_flwr.runtime.policy import NODE_CONFIG_KEY, NodePolicy, Refused, load_policy, policy_path
from diff2_flwr.runtime.session import build_worker


@functools.lru_cache(maxsize=8)
def _config(run_config: tuple[tuple[str, bool | int | float | str], ...],
            node_config: tuple[tuple[str, Any], ...] | None) -> ExperimentConfig:
    return load_run_config(dict(run_config),
                           node_config=None if node_config is None else dict(node_config),
                           quote=False)


@functools.lru_cache(maxsize=4)
def _policy(path: str | None) -> NodePolicy | None:
    return None if path is None else load_policy(path)


def _node_keys(context: Context) -> tuple[int, int]:
    try:
        return int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    except KeyError as err:
        raise ValueError(
            f"Node config key {err.args[0]!r} is missing: every SuperNode needs "
            "--node-config \"partition-id=<i> num-partitions=<P>\"."
        ) from None


def run_experiment(context: Context) -> ExperimentConfig:
    """The run's experiment as this node reads it: a simulated node (:func:`simulated_node`) from
    wherever the run config names, a data owner's node only from the app bundle or its own
    ``experiments`` folder, and only once its node config names its records (``data-path``); errors
    quote nothing of the file either way (they travel to the server). The SecAgg+ mod calls it too,
    before ``client_fn``."""
    if simulated_node(context.node_config):
        return _config(tuple(sorted(context.run_config.items())), None)
    # the run config's dataset settings would name files on this node
    if not context.node_config.get("data-path"):
        partition = context.node_config.get("partition-id", "?")
        raise Refused(f"node {context.node_id} (partition {partition})", "data-path",
                      "this SuperNode runs outside Flower's simulation engine, so it is a data "
                      "owner's node, and its node config names no data-path: it reads its records "
                      "only from the shard file its own node config names, never from the run "
                      "config's dataset settings. Its operator adds "
                      "data-path=\"/path/shard-<i>-of-<P>.npz\" (written by `diff2 shard`).")
    return _config(tuple(sorted(context.run_config.items())),
                   tuple(sorted(context.node_config.items())))


def client_fn(context: Context) -> Client:
    """This node's worker for shard ``partition-id`` of the run's experiment, checked by its policy.

    Checks ``num-partitions`` against ``training.clients`` and the run against the node's policy
    (:class:`~diff2_flwr.runtime.node_guard.NodeGuard`) before any record is read; the records are
    loaded on the first task. With distributed noise the worker adds its own noise share.
    """
    partition_id, num_partitions = _node_keys(context)
    deployment = not simulated_node(context.node_config)
    # a deployment: this node's own shard file only
    data_path = context.node_config.get("data-path")
    # the node's own file, before anything the run config names
    policy = _policy(policy_path(context.node_config))
    name = policy.name if policy is not None and policy.name else f"partition {partition_id}"
    node = f"node {context.node_id} ({name})"
    # The ServerApp's run config: the same file with the same overridden keys (a deployment: from
    # the bundle only).
    cfg = run_experiment(context)
    # A fixed thread count (default 1: simulation runs several workers per core) keeps the
    # floating-point reductions, and so the replies, equal to the in-process driver's.
    pin_threads(cfg.training.threads)
    # P = the federation's partitions, as the ServerApp resolved it from the same simulation
    if cfg.clients_auto:
        cfg = cfg.with_clients(num_partitions, "the node config's num-partitions")
    if num_partitions != cfg.clients:
        raise ValueError(
            f"Node config num-partitions = {num_partitions} but {cfg.source} has training.clients "
            f"= {cfg.clients}; they must match (in a simulation, num-supernodes = "
            f"training.clients)."
        )
    # Before any record is read or any model factory imported: the run against this node's policy.
    guard = NodeGuard.admit_run(cfg, node=node, partition_id=partition_id, run_id=context.run_id,
                                policy=policy, deployment=deployment,
                                shared_policy=NODE_CONFIG_KEY not in context.node_config)
    noise = None
    # the node's own settings: its noise share follows its run config
    if cfg.private and cfg.privacy.distributed:
        noise = functools.partial(_distributed_noise, cfg)
    client = Diff2Client if _fault(partition_id) is None else _FaultyClient
    return client(functools.partial(build_worker, cfg, partition_id,
                                    None if data_path is None else str(data_path)),
                  guard, noise=noise, seed=cfg.training.seed,
                  partition_id=partition_id).to_client()


def _fault(partition_id: int) -> int | None:
    """Fault injection (tests): ``DIFF2_FAULT_CLIENT_FAILS=p:r`` makes partition p fail its round-r
    task."""
    spec = os.environ.get("DIFF2_FAULT_CLIENT_FAILS", "")
    p, _, r = spec.partition(":")
    return int(r) if p and int(p) == partition_id else None


class _FaultyClient(Diff2Client):
    """A worker that fails one round (:func:`_fault`): a node dropping out mid-run."""

    def fit(self, parameters, config):
        if config.get(protocol.ROUND) == _fault(self.worker.partition_id):
            raise RuntimeError(f"fault injection: partition {self.worker.partition_id} fails round "
                               f"{config.get(protocol.ROUND)}")
        return super().fit(parameters, config)


@functools.lru_cache(maxsize=8)
def _distributed_noise(cfg: ExperimentConfig, n_min: int, dim: int) -> DistributedNoise:
    return cfg.distributed_noise(n_min, dim)


def _secure_sum_settings(context: Context) -> tuple[int, int, int] | None:
    """(P, t, bits) when this run's config asks for distributed noise (its messages then go through
    SecAgg+ only)."""
    cfg = run_experiment(context)
    if not (cfg.private and cfg.privacy.distributed):
        return None
    clients = int(context.node_config["num-partitions"]) if cfg.clients_auto else cfg.clients
    return clients, cfg.privacy.tolerated, cfg.privacy.bits


app = ClientApp(client_fn=client_fn, mods=[secure_sum_mod(_secure_sum_settings,
                                                          round_key=protocol.ROUND)])
