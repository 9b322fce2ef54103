"""Reading shard files: one file per data owner, and one for the server's evaluation.

``diff2 shard CONFIG --out DIR`` prepares the dataset of CONFIG exactly as a simulation would
and writes ``DIR/shard-<i>-of-<P>.npz`` (worker i's train samples only) and ``DIR/server.npz``
(the test split, the normalisation statistics, the shard sizes; no training sample). Each
SuperNode gets ``data-path=".../shard-<i>-of-<P>.npz"`` in its node config and reads only its
own file. Every file records the partition, P and a fingerprint of the dataset settings, so a
worker refuses a file that belongs to another partition or another run.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .config import ExperimentConfig
from .config_data import DatasetConfig
from .spec import run_identity

__all__ = ["ShardError", "Shard", "ServerData", "data_fingerprint", "save_npz", "read_shard",
           "read_server_data",
           "shard_name", "SERVER_FILE", "FORMAT"]

SERVER_FILE = "server.npz"
FORMAT = "diff2-shard/1"


class ShardError(ValueError):
    """A shard file that is missing, unreadable, or not this worker's."""


def data_fingerprint(cfg: ExperimentConfig) -> str:
    """A hash of the dataset settings and P: what decides which samples a shard holds."""
    # the dataset's keys as declared (run_identity: a key added later leaves old files matching at
    # its `before`)
    relevant = {"dataset": run_identity(DatasetConfig, cfg.to_dict()["dataset"]),
                "clients": cfg.clients}
    for key in ("dir", "shards"):  # where the files lie does not change the shards
        relevant["dataset"].pop(key, None)
    return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()


def shard_name(partition_id: int, clients: int) -> str:
    """The file name of data owner ``partition_id``'s shard of P = ``clients``."""
    return f"shard-{partition_id}-of-{clients}.npz"


@dataclass(frozen=True)
class Shard:
    """Data owner ``partition_id``'s training records (of ``num_partitions``), and the class names
    of a classification task."""

    partition_id: int
    num_partitions: int
    features: np.ndarray
    targets: np.ndarray
    classes: tuple[str, ...] = ()


@dataclass(frozen=True)
class ServerData:
    """What ``server.npz`` gives the server: the test split, every shard's size, the normalisation
    statistics, the target scale, the task and its class names (no training record)."""

    x_test: np.ndarray
    y_test: np.ndarray
    shard_sizes: tuple[int, ...]
    feature_mean: np.ndarray
    feature_std: np.ndarray
    target_scale: float
    task: str
    classes: tuple[str, ...]

    @property
    def n_min(self) -> int:
        """The fewest records any data owner holds (the smallest shard)."""
        return min(self.shard_sizes)


def save_npz(path: Path, meta: dict, **arrays: np.ndarray) -> None:
    """Write ``arrays`` and ``meta`` (as JSON) to the .npz ``path``: a temporary file renamed over
    it, so a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as fh:
        np.savez(fh, meta=np.array(json.dumps(meta)), **arrays)
    os.replace(tmp, path)


def _load(path: Path, kind: str) -> tuple[dict, dict[str, np.ndarray]]:
    if not path.is_file():
        raise ShardError(
            f"{kind.capitalize()} data file {path} does not exist. Write the shards with "
                         "`diff2 shard CONFIG --out DIR` and give each SuperNode its own file as "
                         "data-path.")
    try:
        with np.load(path, allow_pickle=False) as npz:
            meta = json.loads(str(npz["meta"]))
            arrays = {k: np.array(npz[k]) for k in npz.files if k != "meta"}
    except (OSError, ValueError, KeyError, EOFError, json.JSONDecodeError) as exc:
        raise ShardError(f"{kind.capitalize()} data file {path} is unreadable "
                         f"({type(exc).__name__}: {exc}).") from None
    if meta.get("format") != FORMAT or meta.get("kind") != kind:
        raise ShardError(
            f"{path} is not a {kind} data file of diff2-flwr (found {meta.get('format')}, "
            f"{meta.get('kind')}).")
    return meta, arrays


def read_shard(path: str | os.PathLike[str], cfg: ExperimentConfig, partition_id: int,
               num_partitions: int) -> Shard:
    """Worker ``partition_id``'s shard; refuse another partition's, another P's or another run's
    file."""
    path = Path(path)
    meta, arrays = _load(path, "worker")
    if (meta["partition_id"], meta["num_partitions"]) != (partition_id, num_partitions):
        raise ShardError(
            f"{path} holds partition {meta['partition_id']} of {meta['num_partitions']}, but this "
            f"node is partition-id={partition_id} of num-partitions={num_partitions}: each node "
            f"must get its own file.")
    if meta["fingerprint"] != data_fingerprint(cfg):
        raise ShardError(
            f"{path} was written for other dataset settings than {cfg.source} (fingerprint "
            f"{meta['fingerprint'][:12]}… ≠ {data_fingerprint(cfg)[:12]}…): re-shard with this "
            f"config.")
    if len(arrays["targets"]) != meta["num_samples"] or len(arrays["features"]) != meta[
        "num_samples"]:
        raise ShardError(f"{path} is inconsistent: {meta['num_samples']} samples announced.")
    return Shard(partition_id, num_partitions, arrays["features"], arrays["targets"],
                 tuple(meta["classes"]))


def read_server_data(path: str | os.PathLike[str], cfg: ExperimentConfig) -> ServerData:
    """The server's evaluation data (``server.npz``); refuse a file of another run's settings."""
    path = Path(path)
    meta, a = _load(path, "server")
    if meta["fingerprint"] != data_fingerprint(cfg):
        raise ShardError(
            f"{path} was written for other dataset settings than {cfg.source}: re-shard with this "
            f"config.")
    return ServerData(a["x_test"], a["y_test"], tuple(meta["shard_sizes"]), a["feature_mean"],
                      a["feature_std"], float(meta["target_scale"]), meta["task"],
                      tuple(meta["classes"]))
