"""A compose project's files, for :class:`~.podman.ComposeStack`: its compose file (plain or TLS)
and the ``deploy/`` folder the file mounts, prepared the way the file's header says.

:meth:`ComposeFolder.prepare` writes everything the containers read, all on this one machine (as a
test does): the shards, the SuperExec secrets, each data owner's node folder and, for TLS, the
certificates and node keys; what the containers' user (UID 49999) must read owner-only or write is
owned by it. Paths the serverapp container reports (``/outputs/...``) map back to
``deploy/outputs`` here (:meth:`ComposeFolder.host_path`).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from ..runtime.config import load_config
from ..runtime.launch import write_connection
from ..runtime.secret_files import make_superexec_secret, private_folder
from .certs import make_certificates, make_node_key, make_node_keys
from .compose import (CONTAINER_OUTPUTS, FEDERATION_KEYS, SECAGG_KEY, SUPERLINK_PORT,
                      certificate_hosts)
from .shards import write_shards

__all__ = ["APP_UID", "ComposeFolder"]

#: The user the containers run as (Flower's images): it owns what they write or read owner-only.
APP_UID = 49999


class ComposeFolder:
    """The compose file of ``project_dir`` (``docker-compose.tls.yml`` with ``tls``), P = its
    SuperNodes, whether its SuperLink authenticates them, and the paths of its ``deploy/``
    folder."""

    def __init__(self, project_dir: str | os.PathLike[str], *, tls: bool) -> None:
        self.dir = Path(project_dir).resolve()
        self.tls = tls
        self.file = "docker-compose.tls.yml" if tls else "docker-compose.yml"
        services = yaml.safe_load((self.dir / self.file).read_text())["services"]
        self.clients = sum(1 for name in services if name.startswith("supernode-"))
        self.node_auth = "--enable-supernode-auth" in services["superlink"]["command"]
        self.deploy = self.dir / "deploy"
        self.outputs = self.deploy / "outputs"
        self.certs = self.deploy / "certs"
        self.secrets = self.deploy / "secrets"
        self.home = self.deploy / "flwr-home"

    def prepare(self, config: str | os.PathLike[str], set_keys: Mapping[str,
                                                                        Any] | None = None) -> Path:
        """``deploy/`` as the compose file's header asks: the shards of ``config`` (with
        ``set_keys``), ``deploy/outputs`` owned by UID 49999, the SuperExec secrets
        (``deploy/secrets``: the SuperLink's and one per SuperNode, owned by 49999), each data
        owner's node folder ``deploy/node-<i>`` (policy and lifetime ledger, 0700, owned by 49999),
        and for TLS the certificates and the P node keys (keys owned by 49999; all on this one
        machine, as a test does). Returns the shard folder."""
        cfg = load_config(config, set_keys)
        if cfg.clients_auto:  # P = the compose file's SuperNodes
            cfg = cfg.with_clients(self.clients, f"the SuperNodes of {self.file}")
        if cfg.clients != self.clients:
            raise ValueError(f"{config}: training.clients = {cfg.clients} but {self.file} has "
                             f"{self.clients} SuperNodes; regenerate it with `diff2 compose "
                             f"--clients {cfg.clients}` or set training.clients = {self.clients}.")
        shards = self.deploy / "shards"
        write_shards(cfg, shards)
        self.outputs.mkdir(parents=True, exist_ok=True)
        os.chown(self.outputs, APP_UID, -1)
        names = ["superlink", *(f"supernode-{i}" for i in range(self.clients))]
        private = [make_superexec_secret(self.secrets / f"{name}.secret") for name in names]
        if self.tls:
            make_certificates(self.certs, hosts=tuple(certificate_hosts()))
            keys = make_node_keys(self.certs, self.clients) if self.node_auth else []
            private += [self.certs / "server.key", *(k.private for k in keys)]
        for path in private:
            os.chown(path, APP_UID, -1)  # 0600: the containers' user must own them
        owners = [private_folder(self.deploy / f"node-{i}") for i in range(self.clients)]
        signing = [make_node_key(node, SECAGG_KEY) for node in owners] if self.node_auth else []
        federation = b"".join(key.public.read_bytes().rstrip(b"\n") + b"\n" for key in signing)
        for node in owners:  # each data owner's node policy, its lifetime ledger written beside it
            if not (node / "policy.yaml").exists():  # a data owner's own edits stand
                shutil.copyfile(self.dir / "configs" / "policy.yaml", node / "policy.yaml")
            own = [node, node / "policy.yaml"]
            if self.node_auth:  # its SecAgg+ signing key and the federation's (agreed out of band)
                (node / FEDERATION_KEYS).write_bytes(federation)
                own += [node / f"{SECAGG_KEY}.key", node / f"{SECAGG_KEY}.pub",
                        node / FEDERATION_KEYS]
            for path in own:
                os.chown(path, APP_UID, -1)
        self.home.mkdir(parents=True, exist_ok=True)
        write_connection(self.home, SUPERLINK_PORT, self.certs / "ca.crt" if self.tls else None)
        return shards

    def fresh(self) -> None:
        """Remove the checkpoint a previous run left in deploy/outputs (configs/deploy.yaml resumes
        from it)."""
        (self.outputs / "checkpoint.npz").unlink(missing_ok=True)

    def host_path(self, container_path: Path | str | None) -> Path | None:
        """``/outputs/...`` in the serverapp container → ``deploy/outputs/...`` here."""
        if container_path is None:
            return None
        path = Path(container_path)
        try:
            return self.outputs / path.relative_to(CONTAINER_OUTPUTS)
        except ValueError:
            return path
