"""docker-compose.yml: a structural check and that it matches its generator
(tests/test_compose_podman.py brings the files up for real)."""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path

import pytest
import yaml

from diff2_flwr.deploy.compose import render_compose
from diff2_flwr.runtime.config import load_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name,tls", [("docker-compose.yml", False), ("docker-compose.tls.yml",
                                                                      True)])
def test_committed_compose_files_are_the_generated_ones(name, tls):
    assert (ROOT / name).read_text() == render_compose(3, tls)


@pytest.mark.parametrize("clients", [1, 3, 5])
@pytest.mark.parametrize("tls", [False, True])
def test_topology_one_shard_per_node(clients, tls):
    services = yaml.safe_load(render_compose(clients, tls))["services"]
    assert set(services) == {"superlink", "serverapp"} | {f"{k}-{i}" for k in ("supernode",
                                                                               "clientapp")
                                                            for i in range(clients)}
    mounted = []
    for i in range(clients):
        node = " ".join(services[f"supernode-{i}"]["command"])
        assert f"partition-id={i} num-partitions={clients}" in node
        assert "--superlink superlink:8000" in node
        app = services[f"clientapp-{i}"]
        assert app["build"]["dockerfile"] == "clients/Dockerfile"
        assert app["command"][-1] == f"supernode-{i}:9094"
        # its own shard and its own SuperExec secret, read-only, and its own node folder (policy,
        # lifetime ledger)
        volume, secret, node_folder = app["volumes"]
        assert volume == f"./deploy/shards/shard-{i}-of-{clients}.npz:/data/shard.npz:ro"
        assert secret == f"./deploy/secrets/supernode-{i}.secret:/secrets/superexec.secret:ro"
        assert node_folder == f"./deploy/node-{i}:/node"
        # the node config names it: the ClientApp enforces it
        assert node.endswith('policy="/node/policy.yaml"')
        # with node authentication, its SecAgg+ signing key and the federation's keys, from its own
        # folder only
        signed = 'auth-key="/node/secagg.key" federation-keys="/node/federation.pub"'
        assert (signed in node) == tls
        assert not any("/deploy/node-" in v for v in services[f"supernode-{i}"]["volumes"])
        mounted.append(volume)
    assert len(set(mounted)) == clients
    server = services["serverapp"]
    # no data owner's policy or ledger
    assert not any("./deploy/node-" in v for v in server["volumes"])
    assert server["build"]["dockerfile"] == "server/Dockerfile"
    # the server never sees a training shard
    assert not any("shard-" in v for v in server["volumes"])
    link = " ".join(services["superlink"]["command"])
    if tls:
        assert "--insecure" not in link and "--ssl-certfile /certs/server.pem" in link
        assert all("--root-certificates" in services[f"supernode-{i}"]["command"]
                   for i in range(clients))
        assert "--root-certificates" in server["command"]
    else:
        assert "--insecure" in link


def _published(port_entry) -> tuple[str | None, str]:
    """(host address or None for every interface, container port) of a compose `ports` entry, short
    or long form."""
    if isinstance(port_entry, dict):
        return port_entry.get("host_ip"), str(port_entry["target"])
    text = str(port_entry)
    if text.startswith("["):  # [::1]:8000:8000
        address, rest = text[1:].split("]:", 1)
        return address, rest.split(":")[-1]
    parts = text.split(":")
    return (parts[0] if len(parts) == 3 else None), parts[-1]


def _compose_files() -> list[Path]:
    return sorted(ROOT.glob("docker-compose*.yml")) + sorted(ROOT.glob("docker-compose*.yaml"))


def test_no_compose_file_publishes_a_port_on_all_interfaces():
    files = _compose_files()
    assert {f.name for f in files} >= {"docker-compose.yml", "docker-compose.tls.yml"}
    for path in files:
        services = yaml.safe_load(path.read_text())["services"]
        published = {name: [_published(p) for p in s.get("ports", [])] for name,
                     s in services.items()}
        # the operator's `flwr` only
        assert published.pop("superlink") == [("127.0.0.1", "8000")], path.name
        assert not any(
            published.values()), f"{path.name} publishes more than the SuperLink: {published}"
        for name, service in services.items():
            assert "expose" not in service and service.get("network_mode") != "host", (path.name,
                                                                                       name)


def test_the_all_interfaces_check_catches_what_it_should():
    assert _published("8000:8000") == (None, "8000")
    assert _published("0.0.0.0:8000:8000") == ("0.0.0.0", "8000")
    assert _published({"target": 8000, "published": 8000}) == (None, "8000")
    assert _published("[::1]:8000:8000") == ("::1", "8000")


@pytest.mark.parametrize("publish", ["0.0.0.0", "::", "[::]", "", "*", "superlink.example.org"])
def test_the_generator_refuses_to_publish_on_all_interfaces(publish):
    with pytest.raises(ValueError, match="publish"):
        render_compose(3, True, publish=publish)


def test_multi_host_variant_publishes_one_address_and_says_who_must_reach_it():
    text = render_compose(2, True, publish="10.0.0.5", superlink="link.example.org:8000")
    services = yaml.safe_load(text)["services"]
    assert services["superlink"]["ports"] == ["10.0.0.5:8000:8000"]
    assert ipaddress.ip_address(_published(services["superlink"]["ports"][0])[0]).is_private
    assert all("link.example.org:8000" in services[f"supernode-{i}"]["command"] for i in range(2))
    # owners start no SuperLink
    assert not any("depends_on" in services[f"supernode-{i}"] for i in range(2))
    assert "allow-list" in text and ("data owners' SuperNode hosts and the\n# operator's address "
                                     "only") in text


@pytest.mark.parametrize("clients", [1, 3])
def test_tls_compose_authenticates_supernodes_each_with_only_its_own_key(clients):
    services = yaml.safe_load(render_compose(clients, True))["services"]
    assert "--enable-supernode-auth" in services["superlink"]["command"]
    assert "./deploy/certs/server.key:/certs/server.key:ro" in services["superlink"]["volumes"]
    for i in range(clients):
        node = services[f"supernode-{i}"]
        keys = [v for v in node["volumes"] if v.endswith(".key:ro") or "/keys/" in v]
        # its own, and nothing else
        assert keys == [f"./deploy/certs/supernode-{i}.key:/keys/supernode.key:ro"]
        command = node["command"]
        assert command[command.index("--auth-supernode-private-key") + 1] == "/keys/supernode.key"
        # refused (exit) until the operator registers its public key
        assert node["restart"] == "on-failure"
    others = [v for name, s in services.items() if name != "superlink" for v in s.get("volumes",
                                                                                      [])]
    assert not any("server.key" in v or "server.pem" in v or v.startswith("./deploy/certs:")
                   for v in others)
    assert not any("supernode" in v and ".key" in v for name,
                   s in services.items() if not name.startswith("supernode")
                   for v in s.get("volumes", []))


def test_node_auth_needs_tls_and_can_be_turned_off():
    with pytest.raises(ValueError, match="needs TLS"):
        render_compose(3, False, node_auth=True)
    services = yaml.safe_load(render_compose(3, True, node_auth=False))["services"]
    assert "--enable-supernode-auth" not in services["superlink"]["command"]
    assert not any("--auth-supernode-private-key" in services[f"supernode-{i}"]["command"]
                   for i in range(3))
    plain = yaml.safe_load(render_compose(3))["services"]
    assert "--enable-supernode-auth" not in plain["superlink"]["command"]


def test_dockerfiles_and_the_deploy_config_fit_the_compose_file():
    for side in ("server", "clients"):
        text = (ROOT / side / "Dockerfile").read_text()
        assert re.search(r"^FROM flwr/superexec:1\.42\.0$", text,
                         re.M) and 'ENTRYPOINT ["flower-superexec"]' in text
    cfg = load_config(ROOT / "configs" / "deploy.yaml")
    assert cfg.training.clients == 3 and cfg.dataset.shards == "/data/shards"
    assert cfg.evaluation.train_metrics is False and cfg.output.checkpoint.startswith("/outputs")


def _secret_of(service: dict) -> str:
    """The one SuperExec secret a service mounts, checked to be the file its command reads."""
    command = service["command"]
    assert command[command.index("--superexec-auth-secret-file") + 1] == "/secrets/superexec.secret"
    (secret,) = [v for v in service["volumes"] if "secret" in v]
    host, container, mode = secret.split(":")
    assert container == "/secrets/superexec.secret" and mode == "ro"
    return host


@pytest.mark.parametrize("tls", [False, True])
@pytest.mark.parametrize("clients", [1, 3])
def test_superexec_secret_pairs_each_runtime_api_with_its_superexec_only(tls, clients):
    """Without the secret, whoever reaches a runtime API could act as the ServerApp (and read every
    exact clipped mean) or as a data owner's ClientApp: every runtime API and the one SuperExec it
    serves share a secret of their own, and no other container holds it."""
    services = yaml.safe_load(render_compose(clients, tls))["services"]
    # Flower 1.42 ignores the secret in subprocess isolation
    assert "process" in services["superlink"]["command"]
    assert _secret_of(services["superlink"]) == _secret_of(services[
        "serverapp"]) == "./deploy/secrets/superlink.secret"
    for i in range(clients):
        node, app = services[f"supernode-{i}"], services[f"clientapp-{i}"]
        assert node["command"][node["command"].index("--isolation") + 1] == "process"
        assert _secret_of(node) == _secret_of(app) == f"./deploy/secrets/supernode-{i}.secret"
    holders = {}
    for name, service in services.items():
        holders.setdefault(_secret_of(service), []).append(name)
    assert len(holders) == clients + 1 and all(len(names) == 2 for names in holders.values())


def test_multi_host_file_names_the_right_certificate_hosts_and_each_side_s_steps():
    text = render_compose(2, True, publish="10.0.0.5", superlink="sl.example.org:8000")
    header = " ".join(line[2:] for line in text.splitlines() if line.startswith("# "))
    assert ("diff2 certs --out deploy/certs --host superlink --host sl.example.org --host "
            "10.0.0.5 --node-pub") in header
    assert "--host 127.0.0.1" not in header and "--clients" not in header.replace(
        "compose --clients", "")
    for step in ("diff2 node-key --out deploy/certs --name supernode-<i>",
                 "diff2 secret --out deploy/secrets supernode-<i>",
                 "diff2 secret --out deploy/secrets superlink",
                 "chown 49999 deploy/certs/supernode-<i>.key",
                 "a clone of this repository (`build:` needs it)",
                 "PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu",
                 "up -d supernode-<i> clientapp-<i>", "up -d --build superlink serverapp",
                 "flwr supernode register deploy/certs/supernode-<i>.pub"):
        assert step in header, step
    one_host = render_compose(3, True)
    assert (
        "diff2 certs --out deploy/certs --host superlink --host 127.0.0.1 --clients 3") in one_host
    assert "tests only" in one_host
