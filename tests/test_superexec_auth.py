"""SuperExec authentication: a SuperLink started with our flags refuses an unsigned runtime request.

The runtime API (the port the SuperLink also serves SuperNodes and `flwr run` on) hands the
ServerApp's task to whoever calls ``AcquireTask``; the task token it returns opens every other
runtime call (pull the clients' replies: their exact clipped means). With
``--superexec-auth-secret-file`` and process isolation, Flower 1.42 accepts ``AcquireTask`` only
signed with the secret. Called here with Flower's own client stub and signer.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from diff2_flwr.cli import main
from diff2_flwr.deploy.native import start_superlink
from diff2_flwr.runtime.secret_files import make_superexec_secret, private_folder, write_private
from diff2_flwr.runtime.launch import free_ports, stop_process, tool, wait_healthy, flwr_env, start

pytestmark = [pytest.mark.flower]

_ACQUIRE = "/flwr.proto.Runtime/AcquireTask"


def acquire_task(port: int, secret: bytes | None, ca: Path | None = None) -> int:
    """HTTP status of one ``AcquireTask`` on 127.0.0.1:``port``, signed with ``secret`` (None:
    unsigned)."""
    import httpx
    from flwr.proto.runtime_pb2 import AcquireTaskRequest
    from flwr.supercore.interceptors.http.runtime_version import RuntimeVersionHttpInterceptor
    from flwr.supercore.interceptors.http.superexec_auth import SuperExecAuthHttpInterceptor
    from flwr.supercore.runtime.runtime_http_client import RuntimeHttpClient

    interceptors = [RuntimeVersionHttpInterceptor(component_name="SuperExec")]
    if secret is not None:
        interceptors.append(SuperExecAuthHttpInterceptor(master_secret=secret,
                                                         protected_methods=[_ACQUIRE]))
    with RuntimeHttpClient.from_server_address(
        server_address=f"127.0.0.1:{port}", insecure=ca is None,
        root_certificates=ca.read_bytes() if ca else None, interceptors=interceptors,
    ) as client:
        try:
            client.AcquireTask(AcquireTaskRequest(supported_task_types=["serverapp"]))
        except httpx.HTTPStatusError as err:
            return err.response.status_code
    return 200


@pytest.fixture
def superlink(tmp_path):
    """A SuperLink started by our launch code (the native deployment's flags), stopped by PID."""
    home = tmp_path / "home"
    home.mkdir()
    port, health = free_ports(2)
    secret = make_superexec_secret(tmp_path / "secrets" / "superlink.secret")
    proc = start_superlink(tmp_path, flwr_env(home), port, health, secret)
    try:
        yield port, secret
    finally:
        stop_process(proc)


def test_unsigned_or_wrongly_signed_runtime_requests_are_refused(superlink, tmp_path):
    port, secret = superlink
    unsigned = acquire_task(port, None)
    wrong = acquire_task(port, b"not-the-secret")
    signed = acquire_task(port, secret.read_bytes())
    print(
        f"AcquireTask on our SuperLink: unsigned -> HTTP {unsigned}, wrong secret -> HTTP {wrong}, "
          f"with the secret -> HTTP {signed}")
    assert unsigned in (401, 403) and wrong in (401, 403)
    assert signed == 200
    log = (tmp_path / "superlink.log").read_text()
    assert secret.read_text() not in log  # never in the log


@pytest.mark.parametrize("flags", [["--isolation", "process"],
                                   ["--isolation", "subprocess", "--superexec-auth-secret-file",
                                    "SECRET"]],
                         ids=["no-secret", "subprocess-ignores-the-secret"])
def test_the_check_catches_an_unauthenticated_superlink(tmp_path, flags):
    """The control: without the secret, or with it in subprocess isolation (Flower 1.42 ignores it
    there: why our deployments use process isolation), the SuperLink answers an unsigned
    AcquireTask."""
    home = tmp_path / "home"
    home.mkdir()
    port, health = free_ports(2)
    secret = str(make_superexec_secret(tmp_path / "secrets" / "s.secret"))
    proc = start([tool("flower-superlink"), "--insecure",
                  *[secret if f == "SECRET" else f for f in flags],
                  "--host", "127.0.0.1", "--port", str(port), "--health-server-address",
                  f"127.0.0.1:{health}"],
                 tmp_path / "open.log", flwr_env(home))
    try:
        wait_healthy(port, proc, tmp_path / "open.log")
        assert acquire_task(port, None) == 200
    finally:
        stop_process(proc)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def test_secret_files_are_owner_only_whatever_the_umask(tmp_path, umask_022):
    secret = make_superexec_secret(tmp_path / "deploy" / "secrets" / "superlink.secret")
    assert _mode(secret) == 0o600 and _mode(secret.parent) == 0o700
    assert len(secret.read_bytes()) == 64 and secret.read_bytes() != make_superexec_secret(
        tmp_path / "b" / "s").read_bytes()
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o777)
    os.chmod(loose, 0o755)
    old = write_private(loose / "k", b"1")
    os.chmod(old, 0o644)  # a world-readable file in the way is replaced, not reused
    assert _mode(write_private(loose / "k",
                               b"2")) == 0o600 and _mode(private_folder(loose)) == 0o700


def test_every_private_file_the_cli_writes_is_owner_only_under_umask_022(tmp_path, umask_022,
                                                                         capsys):
    assert main(["secret", "--out", str(tmp_path / "secrets"), "superlink", "supernode-0"]) == 0
    assert main(["node-key", "--out", str(tmp_path / "owner"), "--name", "supernode-0"]) == 0
    assert main(["certs", "--out", str(tmp_path / "certs"), "--host", "sl.example.org",
                 "--node-pub", str(tmp_path / "owner" / "supernode-0.pub")]) == 0
    assert main(["certs", "--out", str(tmp_path / "test-certs"), "--clients", "2"]) == 0
    out = capsys.readouterr().out
    private = [*(tmp_path / "secrets").iterdir(), tmp_path / "owner" / "supernode-0.key",
               tmp_path / "certs" / "server.key", *(tmp_path / "test-certs").glob("*.key")]
    modes = {str(p.relative_to(tmp_path)): oct(_mode(p)) for p in private}
    folders = {str(p.relative_to(tmp_path)): oct(_mode(p)) for p in (tmp_path / "secrets",
                                                                     tmp_path / "owner",
                                                                     tmp_path / "certs",
                                                                     tmp_path / "test-certs")}
    print(f"modes under umask 022: files {modes}, folders {folders}")
    assert set(modes.values()) == {"0o600"} and len(modes) == 7 and set(folders.values()) == {
        "0o700"}
    for secret in (tmp_path / "secrets").iterdir():
        assert secret.read_text() not in out  # the CLI names the files, never prints a secret
    assert (tmp_path / "owner" / "supernode-0.key").read_text() not in out
    # what the data owner sends
    assert (tmp_path / "owner" / "supernode-0.pub").read_text().strip() in out
    assert "one-machine tests only" in out
    # with --node-pub the operator's folder holds the data owner's public key, and no private key
    # but its own
    assert sorted(p.name for p in (tmp_path / "certs").iterdir()) == ["ca.crt", "server.key",
                                                                      "server.pem",
                                                                      "supernode-0.pub"]


class _Probe:
    """A console for run_simulation that, on the first line (the SuperLink and its SuperExec are
    up), sends an unsigned AcquireTask to the simulation's SuperLink."""

    def __init__(self, port: int) -> None:
        self.port, self.status = port, None

    def feed(self, line: str) -> None:
        if self.status is None:
            self.status = acquire_task(self.port, None)

    def close(self) -> None:
        pass


def test_a_simulation_superlink_refuses_unsigned_runtime_requests(tmp_path, monkeypatch):
    """`diff2 run` / run_simulation: a local user who reaches the loopback port cannot take the
    simulation's task."""
    import yaml

    from diff2_flwr.runtime import launch

    ports = free_ports(2)
    monkeypatch.setattr(launch, "free_ports", lambda n: ports[:n])
    path = tmp_path / "sim.yaml"
    path.write_text(yaml.safe_dump({
        "name": "sim", "method": "diff2", "dataset": {"name": "synthetic", "num_samples": 300},
        "training": {"rounds": 1, "restart_every": 1, "clients": 2, "seed": 4},
        "output": {"dir": str(tmp_path / "out")},
    }))
    probe = _Probe(ports[0])
    result = launch.run_simulation(str(path), console=probe)
    print(
        f"unsigned AcquireTask on the simulation's SuperLink: HTTP {probe.status}; run "
        f"{result.status}")
    assert probe.status == 401 and result.status == "finished:completed"
