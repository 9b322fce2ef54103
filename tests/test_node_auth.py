"""SuperNode authentication (Flower 1.42: `--enable-supernode-auth` + `flwr supernode register`) and
key files."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
import yaml

from diff2_flwr.cli import main
from diff2_flwr.deploy.certs import make_node_keys
from diff2_flwr.deploy.native import run_local_deployment


def test_node_keys_are_what_flower_loads_and_private_keys_are_0600(tmp_path):
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key
    from flwr.cli.supernode.register import try_load_public_key
    from flwr.supercore.primitives.asymmetric import public_key_to_bytes

    keys = make_node_keys(tmp_path / "k", 3)
    assert [k.private.name for k in keys] == ["supernode-0.key", "supernode-1.key",
                                              "supernode-2.key"]
    publics = set()
    for key in keys:
        assert stat.S_IMODE(key.private.stat().st_mode) == 0o600
        private = load_ssh_private_key(key.private.read_bytes(), None)  # what flower-supernode does
        assert private.curve.name == "secp384r1"
        registered = try_load_public_key(key.public)  # what `flwr supernode register` does
        assert registered == public_key_to_bytes(private.public_key())
        publics.add(registered)
    assert len(publics) == 3
    again = make_node_keys(tmp_path / "k", 1)[0]  # replaced, still 0600
    assert stat.S_IMODE(again.private.stat().st_mode) == 0o600 and try_load_public_key(
        again.public) not in publics


def test_diff2_certs_writes_one_key_pair_per_data_owner(tmp_path, capsys):
    assert main(["certs", "--out", str(tmp_path / "c"), "--clients", "2"]) == 0
    names = sorted(p.name for p in (tmp_path / "c").iterdir())
    assert names == ["ca.crt", "server.key", "server.pem", "supernode-0.key", "supernode-0.pub",
                     "supernode-1.key",
                     "supernode-1.pub"]
    assert stat.S_IMODE((tmp_path / "c" / "server.key").stat().st_mode) == 0o600
    assert "flwr supernode register" in capsys.readouterr().out
    assert main(["certs", "--out", str(tmp_path / "d"), "--clients", "0"]) == 0
    assert not list((tmp_path / "d").glob("supernode-*"))


def test_node_auth_without_tls_is_refused_before_anything_starts(tmp_path, capsys):
    with pytest.raises(ValueError, match="needs TLS"):
        run_local_deployment("configs/deploy.yaml", node_auth=True, workdir=tmp_path / "w",
                             echo=False)
    assert not (tmp_path / "w").exists()
    assert main(["compose", "--no-node-auth"]) == 0  # plain compose has none anyway
    assert main(["compose", "--tls", "--publish", "0.0.0.0"]) == 2
    assert "every interface" in capsys.readouterr().err


def _forged_activation(live) -> int:
    """Claim data owner 0's registered public key but sign with another key: the HTTP status of
    ActivateNode."""
    import httpx
    from flwr.proto.fleet_pb2 import ActivateNodeRequest
    from flwr.supercore.interceptors.http.runtime_version import RuntimeVersionHttpInterceptor
    from flwr.supercore.primitives.asymmetric import generate_key_pairs, public_key_to_bytes
    from flwr.supernode.fleet_http_client import FleetHttpClient
    from flwr.supernode.node_auth_http_interceptor import NodeAuthHttpInterceptor
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key

    claimed = load_ssh_private_key(live.node_keys[0].private.read_bytes(), None).public_key()
    wrong_private, _ = generate_key_pairs()
    with FleetHttpClient.from_server_address(
        f"127.0.0.1:{live.port}", False, live.certificates.ca.read_bytes(),
        interceptors=[RuntimeVersionHttpInterceptor(component_name="SuperNode"),
                      NodeAuthHttpInterceptor(wrong_private, claimed)],
    ) as client:
        try:
            client.ActivateNode(ActivateNodeRequest(public_key=public_key_to_bytes(claimed),
                                                    heartbeat_interval=30))
        except httpx.HTTPStatusError as err:
            return err.response.status_code
    return 200


def _runtime_requests(live) -> dict[str, int]:
    """HTTP status of AcquireTask on the live deployment's runtime APIs, unsigned and signed."""
    from test_superexec_auth import acquire_task

    node = live.node_ports[0]
    secret = {name: path.read_bytes() for name, path in live.secrets.items()}
    return {"superlink unsigned": acquire_task(live.port, None, live.certificates.ca),
            "superlink signed": acquire_task(live.port, secret["superlink"], live.certificates.ca),
            "supernode-0 unsigned": acquire_task(node, None),
            "supernode-0 other owner's secret": acquire_task(node, secret["supernode-1"]),
            "supernode-0 signed": acquire_task(node, secret["supernode-0"])}


def _assert_secrets_stay_in_their_files(work: Path, outputs: Path) -> None:
    """Every SuperExec secret is 0600 in a 0700 folder and appears in no other file (logs, configs,
    outputs)."""
    secrets = sorted((work / "secrets").glob("*.secret"))
    assert len(secrets) == 3 and stat.S_IMODE((work / "secrets").stat().st_mode) == 0o700
    assert all(stat.S_IMODE(s.stat().st_mode) == 0o600 for s in secrets)
    values = [s.read_bytes() for s in secrets]
    others = [f for f in [*work.rglob("*"),
                          *outputs.rglob("*")] if f.is_file() and f.parent != work / "secrets"]
    assert any(f.name == "superlink.log" for f in others) and any(f.name == "summary.json"
                                                                  for f in others)
    leaked = [str(f) for f in others if any(v in f.read_bytes() for v in values)]
    assert leaked == []


@pytest.mark.flower
@pytest.mark.deployment
def test_only_registered_supernodes_join_and_the_run_completes_with_them(tmp_path):
    path = tmp_path / "dep.yaml"
    path.write_text(yaml.safe_dump({
        "name": "auth", "method": "diff2", "dataset": {"name": "synthetic", "num_samples": 600},
        "training": {"rounds": 2, "restart_every": 2, "clip_diff": 3.0, "clients": 2, "seed": 4},
        "output": {"dir": str(tmp_path / "out")},
    }))
    forged: list[int] = []
    runtime: dict[str, int] = {}

    def on_ready(live) -> None:
        forged.append(_forged_activation(live))
        runtime.update(_runtime_requests(live))

    policy = tmp_path / "policy.yaml"  # the run is seeded: the owners allow it (tests only)
    policy.write_text(yaml.safe_dump({"max_epsilon": 3.0, "max_delta": 1e-5, "allow_seeded": True}))
    result = run_local_deployment(path, tls=True, workdir=tmp_path / "work", echo=False,
                                  intruders=("no-key", "unregistered-key"), on_ready=on_ready,
                                  node_policy=policy)
    assert result.node_auth and result.launch.status == "finished:completed"
    rows = [json.loads(line)
            for line in (result.launch.output_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 1, 2]
    # exactly the P registered nodes took part: the SuperLink knows no other node
    assert len(set(result.node_ids)) == 2
    assert sorted(int(n["node-id"]) for n in result.nodes) == sorted(result.node_ids)
    assert all(n["status"] == "online" for n in result.nodes)
    # an unregistered SuperNode (no key: Flower self-registers an ephemeral one) is refused and
    # exits
    no_key, unregistered = result.intruders
    assert no_key.kind == "no-key" and no_key.returncode not in (None, 0)
    refused = "[code: 2001] SuperNode authentication is enabled. All SuperNodes must be registered"
    assert refused in no_key.log.read_text()
    # a SuperNode with a key pair nobody registered is refused and exits
    assert unregistered.returncode not in (None, 0)
    assert "[code: 2004] Failed to activate SuperNode." in unregistered.log.read_text()
    # claiming a registered node's public key without its private key: the signature check refuses
    # it
    assert forged == [401]
    # SuperExec authentication: an unsigned AcquireTask is refused on the SuperLink's and a
    # SuperNode's runtime API; the SuperExecs we started sign theirs (the run completed through
    # them)
    print(f"AcquireTask during the deployment: {runtime}")
    assert runtime == {"superlink unsigned": 401, "superlink signed": 200,
                       "supernode-0 unsigned": 401,
                       "supernode-0 other owner's secret": 401, "supernode-0 signed": 200}
    _assert_secrets_stay_in_their_files(tmp_path / "work", result.launch.output_dir)
    link_log = (tmp_path / "work" / "superlink.log").read_text()
    assert "[/v1/fleet/register-node][ApiError:2001]" in link_log
    assert "No SuperNode found with the given public key" in link_log
    assert link_log.count("[Fleet.ActivateNode] Activated node_id=") == 2


def test_certificate_names_ipv4_ipv6_and_dns_hosts_correctly(tmp_path):
    """An IPv6 address is an IP entry of the certificate, not a DNS name (which no client would
    match)."""
    import ipaddress

    from cryptography import x509

    from diff2_flwr.deploy.certs import make_certificates

    hosts = ("superlink", "127.0.0.1", "::1", "[2001:db8::7]", "fl.example.org")
    certs = make_certificates(tmp_path, hosts)
    cert = x509.load_pem_x509_certificate(certs.cert.read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["superlink", "fl.example.org"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1"),
                                                       ipaddress.ip_address("::1"),
                                                       ipaddress.ip_address("2001:db8::7")]


def test_operator_takes_data_owners_public_keys_and_refuses_anything_else(tmp_path, capsys):
    """Node keys made on the data owner's side: the operator's `diff2 certs --node-pub` copies the
    public keys it is sent (as Flower's register reads them) and refuses a private key, a non-key
    and a key sent twice."""
    from flwr.cli.supernode.register import try_load_public_key

    owners = [tmp_path / f"owner-{i}" for i in range(2)]
    for i, folder in enumerate(owners):
        assert main(["node-key", "--out", str(folder)]) == 0
    printed = capsys.readouterr().out
    pubs = [str(folder / "supernode.pub") for folder in owners]
    assert main(["certs", "--out", str(tmp_path / "op"), "--host", "sl.example.org", "--node-pub",
                 *pubs]) == 0
    out = capsys.readouterr().out
    for i, folder in enumerate(owners):
        copied = tmp_path / "op" / f"supernode-{i}.pub"
        assert try_load_public_key(copied) == try_load_public_key(folder / "supernode.pub")
        assert f"flwr supernode register {copied}" in out
        # what the owner is told to send
        assert (folder / "supernode.pub").read_text().strip() in printed
        assert (folder / "supernode.key").read_text() not in printed
    # the operator holds no data owner's key
    assert not list((tmp_path / "op").glob("supernode-*.key"))
    # a key named after its owner keeps its index, whatever the order or how many came in so far
    assert main(["node-key", "--out", str(tmp_path / "owner-7"), "--name", "supernode-7"]) == 0
    assert main(["certs", "--out", str(tmp_path / "op7"), "--node-pub",
                 str(tmp_path / "owner-7" / "supernode-7.pub")]) == 0
    assert [p.name for p in (tmp_path / "op7").glob("*.pub")] == ["supernode-7.pub"]
    capsys.readouterr()
    named_one = tmp_path / "named" / "supernode-1.pub"
    named_one.parent.mkdir()
    named_one.write_bytes(Path(pubs[0]).read_bytes())
    bad = tmp_path / "bad.pub"
    bad.write_text("ssh-rsa AAAA not a key\n")
    refused = [([str(owners[0] / "supernode.key")], "is a private key"),
               ([str(bad)], "expected a SuperNode public key"),
               ([pubs[0], pubs[0]], "same public key"), ([str(tmp_path / "missing.pub")],
                                                         "no such file"),
               # owner 1 by name and by position
               ([str(named_one), pubs[1]], "two files would both be")]
    for files, match in refused:
        assert main(["certs", "--out", str(tmp_path / "op2"), "--node-pub", *files]) == 2
        assert match in capsys.readouterr().err
    assert not (tmp_path / "op2").exists()  # refused before anything was written
    assert main(["certs", "--out", str(tmp_path / "op3"), "--clients", "2", "--node-pub",
                 pubs[0]]) == 2
