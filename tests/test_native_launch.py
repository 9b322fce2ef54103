"""The native deployment's start-up, without Flower: ports outside the kernel's ephemeral range, and
every SuperNode connected (one that lost its port to another process started again on a fresh one)
before the run is submitted."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from diff2_flwr.deploy import native
from diff2_flwr.runtime import launch
from diff2_flwr.runtime.launch import SimulationFailed


class FakeProcess:
    """A started Flower component: ``returncode`` None while it runs."""

    def __init__(self, returncode: int | None = None) -> None:
        self.returncode = returncode

    def poll(self) -> int | None:
        return self.returncode


def test_free_ports_are_drawn_below_the_kernels_ephemeral_range_and_are_bindable():
    low = launch._ephemeral_low()
    if not Path("/proc/sys/net/ipv4/ip_local_port_range").exists():
        pytest.skip("no Linux ephemeral port range on this machine")
    ports = launch.free_ports(6)
    assert len(set(ports)) == 6
    # room below the range (a machine may start it lower: the kernel picks)
    if low - launch._UNASSIGNED_FROM > 4 * 6:
        assert all(launch._UNASSIGNED_FROM <= port < low for port in ports)
    for port in ports:  # released: a server can bind each of them
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))


def test_free_ports_fall_back_to_the_kernels_choice_without_room_below_the_range(monkeypatch):
    monkeypatch.setattr(launch, "_ephemeral_low", lambda: launch._UNASSIGNED_FROM + 3)
    ports = launch.free_ports(2)
    assert len(set(ports)) == 2 and all(port > 0 for port in ports)


def _owners(tmp_path: Path, logs: list[str], codes: list[int | None]):
    for p, text in enumerate(logs):
        (tmp_path / f"supernode-{p}.log").write_text(text)
    nodes = [FakeProcess(code) for code in codes]
    apps = {f"superexec-clientapp-{p}": FakeProcess() for p in range(len(nodes))}
    return nodes, apps


def test_a_supernode_that_lost_its_port_is_started_again_on_a_fresh_one_and_then_awaited(tmp_path):
    nodes, apps = _owners(tmp_path, ["INFO: SuperNode ID: 11\n",
                                     "ERROR: [Errno 98] error while attempting to bind on "
                                     "address: address already in use\n"], [None, 1])
    rebound = []

    def rebind(p: int) -> FakeProcess:
        rebound.append(p)
        apps[f"superexec-clientapp-{p}"] = FakeProcess()
        (tmp_path / f"supernode-{p}.log").write_text("INFO: SuperNode ID: 12\n")
        return FakeProcess()

    native._await_supernodes(nodes, apps, rebind, tmp_path, timeout_s=5)
    assert rebound == [1] and nodes[1].poll() is None
    assert "address already in use" in (tmp_path / "supernode-1.bind-failed.log").read_text()


def test_a_supernode_that_loses_its_port_twice_fails_with_its_log(tmp_path):
    lost = "ERROR: [Errno 98] error while attempting to bind: address already in use\n"
    nodes, apps = _owners(tmp_path, [lost], [1])

    def rebind(p: int) -> FakeProcess:
        (tmp_path / f"supernode-{p}.log").write_text(lost)
        return FakeProcess(1)

    with pytest.raises(SimulationFailed,
                       match=r"supernode-0 exited with code 1(.|\n)*address already in use"):
        native._await_supernodes(nodes, apps, rebind, tmp_path, timeout_s=5)


def test_a_supernode_that_exits_for_another_reason_fails_at_once_with_its_log(tmp_path):
    nodes, apps = _owners(tmp_path, ["INFO: SuperNode ID: 1\n", "ValueError: bad node config\n"],
                          [None, 2])
    with pytest.raises(SimulationFailed,
                       match=r"supernode-1 exited with code 2(.|\n)*bad node config"):
        native._await_supernodes(nodes, apps, lambda p: pytest.fail("no rebind"), tmp_path,
                                 timeout_s=60)


def test_a_supernode_that_never_connects_fails_naming_it_after_the_timeout(tmp_path):
    nodes, apps = _owners(tmp_path, ["INFO: SuperNode ID: 1\n",
                                     "INFO: Starting Flower SuperNode\n"], [None, None])
    with pytest.raises(SimulationFailed,
                       match=r"SuperNode 1 \(data owner 1\) did not connect(.|\n)*still "
                                                r"waiting: \[1\](.|\n)*Starting Flower SuperNode"):
        native._await_supernodes(nodes, apps, lambda p: pytest.fail("no rebind"), tmp_path,
                                 timeout_s=1)


def test_a_dead_clientapp_superexec_fails_the_start(tmp_path):
    nodes, apps = _owners(tmp_path, ["INFO: SuperNode ID: 1\n"], [None])
    apps["superexec-clientapp-0"] = FakeProcess(1)
    (tmp_path / "superexec-clientapp-0.log").write_text("grpc: invalid secret\n")
    with pytest.raises(SimulationFailed,
                       match=r"superexec-clientapp-0 exited with code 1(.|\n)*invalid secret"):
        native._await_supernodes(nodes, apps, lambda p: pytest.fail("no rebind"), tmp_path,
                                 timeout_s=5)


def test_stopping_a_group_leader_also_stops_a_member_that_ignores_sigterm(tmp_path):
    """A hung member of the group (it never runs its SIGTERM handler; here it ignores the signal)
    does not stay behind as an orphan once its leader has exited: it gets SIGKILL after the grace
    period."""
    import subprocess
    import sys
    import time

    pid_file = tmp_path / "member.pid"
    member = (f"import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
              f"open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)")
    leader = subprocess.Popen(["sh", "-c", f'"{sys.executable}" -c "{member}" & wait'],
                              start_new_session=True)
    deadline = time.monotonic() + 30
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    pid = int(pid_file.read_text())
    started = time.monotonic()
    launch.stop_process(leader, grace_s=1.0)
    assert leader.poll() is not None
    assert time.monotonic() - started < 10

    # the member's state: gone, or a letter of /proc/<pid>/stat (Z: killed, not yet reaped)
    def state() -> str:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return "gone"

    deadline = time.monotonic() + 10
    while state() not in ("gone", "Z") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert state() in ("gone",
                       "Z"), f"the member that ignored SIGTERM is still running (state {state()})"
