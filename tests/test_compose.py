"""docker-compose.yml: a structural check (no Docker engine here) and that it matches its generator."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from diff2_flwr.deploy.compose import render_compose
from diff2_flwr.runtime.config import load_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name,tls", [("docker-compose.yml", False), ("docker-compose.tls.yml", True)])
def test_committed_compose_files_are_the_generated_ones(name, tls):
    assert (ROOT / name).read_text() == render_compose(3, tls)


@pytest.mark.parametrize("clients", [1, 3, 5])
@pytest.mark.parametrize("tls", [False, True])
def test_topology_one_shard_per_node(clients, tls):
    services = yaml.safe_load(render_compose(clients, tls))["services"]
    assert set(services) == {"superlink", "serverapp"} | {f"{k}-{i}" for k in ("supernode", "clientapp")
                                                            for i in range(clients)}
    mounted = []
    for i in range(clients):
        node = " ".join(services[f"supernode-{i}"]["command"])
        assert f"partition-id={i} num-partitions={clients}" in node and "--superlink superlink:8000" in node
        app = services[f"clientapp-{i}"]
        assert app["build"]["dockerfile"] == "clients/Dockerfile"
        assert app["command"][-1] == f"supernode-{i}:9094"
        (volume,) = app["volumes"]  # its own shard and nothing else, read-only
        assert volume == f"./deploy/shards/shard-{i}-of-{clients}.npz:/data/shard.npz:ro"
        mounted.append(volume)
    assert len(set(mounted)) == clients
    server = services["serverapp"]
    assert server["build"]["dockerfile"] == "server/Dockerfile"
    assert not any("shard-" in v for v in server["volumes"])  # the server never sees a training shard
    link = " ".join(services["superlink"]["command"])
    if tls:
        assert "--insecure" not in link and "--ssl-certfile /certs/server.pem" in link
        assert all("--root-certificates" in services[f"supernode-{i}"]["command"] for i in range(clients))
        assert "--root-certificates" in server["command"]
    else:
        assert "--insecure" in link


def test_dockerfiles_and_the_deploy_config_fit_the_compose_file():
    for side in ("server", "clients"):
        text = (ROOT / side / "Dockerfile").read_text()
        assert re.search(r"^FROM flwr/superexec:1\.42\.0$", text, re.M) and 'ENTRYPOINT ["flower-superexec"]' in text
    cfg = load_config(ROOT / "configs" / "deploy.yaml")
    assert cfg.training.clients == 3 and cfg.dataset.shards == "/data/shards"
    assert cfg.evaluation.train_metrics is False and cfg.output.checkpoint.startswith("/outputs")
