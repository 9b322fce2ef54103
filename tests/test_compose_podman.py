"""docker-compose.yml and docker-compose.tls.yml brought up for real with Podman (marker `compose`).

Each class brings one committed compose file up, unchanged, in a scratch copy of the project
(stand-ins for Flower's images where Docker Hub is out of reach: diff2_flwr/deploy/podman.py), runs
`flwr run` against 127.0.0.1:8000 and brings everything down at the end, also on failure. Skipped,
with the reason, where Podman, podman-compose or root are missing (.ci/run installs them when it
can).
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from diff2_flwr.deploy.podman import ComposeStack, copy_project, ensure_images, unavailable_reason
from diff2_flwr.runtime.config import load_config
from diff2_flwr.runtime.driver import run_inprocess
from diff2_flwr.runtime.launch import SimulationFailed
from diff2_flwr.runtime.shard_files import shard_name
from test_superexec_auth import acquire_task

pytestmark = [pytest.mark.compose, pytest.mark.deployment, pytest.mark.flower]

# the config the compose files are written for, as docs/tutorials/deployment.md runs it
CONFIG = "configs/deploy.yaml"
# a restart and a difference round
SET = {"training.rounds": 2, "training.restart_every": 2, "training.seed": 4}


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def rows(output_dir: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k != "elapsed_s"}
            for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def host_config(stack: ComposeStack, tmp_path: Path, set_keys: dict = SET) -> Path:
    """The deployed config as the host runs it: the same keys, the same shard files, outputs in
    tmp_path."""
    cfg = load_config(stack.dir / CONFIG, {**set_keys,
                                           "dataset.shards": str(stack.deploy / "shards"),
                                           "output.dir": str(tmp_path / "reference"),
                                           "output.checkpoint": None})
    path = tmp_path / "reference.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    return path


def run_folders(stack: ComposeStack) -> set[Path]:
    return {p for p in stack.outputs.iterdir() if p.is_dir()}


def check_superexec_auth(stack: ComposeStack) -> None:
    """The published runtime API refuses an unsigned AcquireTask; each secret is in its two
    containers only, and in no log."""
    ca = stack.certs / "ca.crt" if stack.tls else None
    unsigned = acquire_task(8000, None, ca)
    signed = acquire_task(8000, (stack.secrets / "superlink.secret").read_bytes(), ca)
    log(f"[compose-test] {stack.file}: AcquireTask on 127.0.0.1:8000 unsigned -> HTTP {unsigned}, "
        f"with superlink.secret -> HTTP {signed}")
    assert unsigned == 401 and signed == 200
    secrets = sorted(stack.secrets.glob("*.secret"))
    assert len(secrets) == stack.clients + 1
    expected = {"superlink": "superlink.secret", "serverapp": "superlink.secret",
                **{f"{kind}-{i}": f"supernode-{i}.secret" for i in range(stack.clients)
                   for kind in ("supernode", "clientapp")}}
    for service, name in expected.items():
        assert stack.find_files_with_content(service,
                                             secrets) == {name: [
                                                 "/secrets/superexec.secret"]}, service
        assert not any(secret.read_text() in stack.logs(service) for secret in secrets), service


@pytest.fixture(scope="session")
def images():
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"compose test skipped: {reason}")
    report = ensure_images(log=log)
    log(f"[compose-test] Flower images: {report.source} in {report.seconds:.1f} s {report.steps}")
    return report


def _stack(tls: bool, images, tmp_path_factory):
    project = copy_project(tmp_path_factory.mktemp("compose-tls" if tls else "compose-plain"))
    with ComposeStack(project, tls=tls, log=log) as stack:
        # the runs are seeded, to be checked bit for bit: the owners allow seeds
        for i in range(stack.clients):
            # (a data owner's node refuses a seeded run otherwise; issue 38)
            node = stack.deploy / f"node-{i}"
            node.mkdir(parents=True, exist_ok=True)
            policy = (project / "configs" / "policy.yaml").read_text()
            (node / "policy.yaml").write_text(policy + "allow_seeded: true  # this test only\n")
        stack.prepare(project / CONFIG, SET)
        log(f"[compose-test] {stack.file}: app images built in {stack.build():.1f} s")
        log(f"[compose-test] {stack.file}: up in {stack.up():.1f} s, SuperNodes {stack.node_ids}")
        yield stack


@pytest.fixture(scope="class")
def plain(images, tmp_path_factory):
    yield from _stack(False, images, tmp_path_factory)


@pytest.fixture(scope="class")
def tls(images, tmp_path_factory):
    yield from _stack(True, images, tmp_path_factory)


class TestPlainCompose:
    def test_only_the_serverapp_and_clientapps_hold_their_runtime_secrets(self, plain):
        check_superexec_auth(plain)

    def test_a_run_completes_and_equals_the_in_process_driver(self, plain, tmp_path):
        """The deployed run's rows and final parameters equal the in-process driver's on the same
        config and shards, bit for bit. (The in-process driver equals a `flwr run` simulation bit
        for bit: tests/test_flower_e2e.py; and a native deployment equals a simulation directly:
        tests/test_deployment.py. The reference here was a simulation, about a minute of the compose
        tests' critical path for the same check.)"""
        plain.fresh()
        started = time.perf_counter()
        result = plain.run(CONFIG, SET)
        log(f"[compose-test] plain run {result.run_id}: {result.status} in "
            f"{time.perf_counter() - started:.1f} s")
        assert result.status == "finished:completed"
        deployed = rows(result.output_dir)
        assert [r["round"] for r in deployed] == [0, 1, 2] and "train_loss" not in deployed[-1]
        reference = run_inprocess(load_config(host_config(plain, tmp_path)), record=False,
                                  progress=None)
        assert [{k: v for k,
                 v in r.items() if k != "elapsed_s"} for r in reference.history] == deployed
        np.testing.assert_array_equal(reference.state.x,
                                      np.load(result.output_dir / "final_parameters.npy"))
        summary = json.loads((result.output_dir / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["config"]["dataset"][
            "shards"] == "/data/shards"
        from diff2_flwr.runtime.node_ledger import NodeLedger

        # each data owner's ClientApp charged the run to its own lifetime ledger
        for i in range(plain.clients):
            ledger = plain.deploy / f"node-{i}" / "ledger.json"
            assert str(result.run_id) in [c.run_id for c in NodeLedger(ledger).charges()]
            assert ledger.stat().st_uid == 49999 and ledger.stat().st_mode & 0o777 == 0o600

    def test_each_client_container_sees_only_its_own_shard(self, plain):
        shards = [plain.deploy / "shards" / shard_name(i,
                                                       plain.clients) for i in range(plain.clients)]
        server = plain.deploy / "shards" / "server.npz"
        for i in range(plain.clients):
            # every file in the container, by content: its own shard at /data/shard.npz, nothing
            # else
            found = plain.find_files_with_content(f"clientapp-{i}", shards + [server])
            log(f"[compose-test] clientapp-{i}: files with a shard's bytes: {found}")
            assert found == {shards[i].name: ["/data/shard.npz"]}
            # and a direct attempt to read another owner's shard, by every name it has anywhere
            other = shards[(i + 1) % plain.clients]
            tries = [str(other), f"/data/{other.name}", f"/data/shards/{other.name}",
                     f"/app/deploy/shards/{other.name}"]
            attempt = plain.exec(f"clientapp-{i}", ["python3", "-c", (
                "import json, sys\nout = {}\nfor p in sys.argv[1:]:\n    try:\n        open(p, "
                "'rb').read(); out[p] = 'read'\n    except OSError as e:\n        out[p] = "
                "type(e).__name__\nprint(json.dumps(out))"),
                *tries], check=True)
            log(f"[compose-test] clientapp-{i} reading {other.name}: {attempt.stdout.strip()}")
            assert json.loads(attempt.stdout) == {p: "FileNotFoundError" for p in tries}
            assert plain.exec(f"clientapp-{i}", ["id", "-u"], check=True).stdout.strip() == "49999"
        # the SuperNodes, the SuperLink and the ServerApp hold no training shard (the server:
        # server.npz only)
        for service in ["superlink", *(f"supernode-{i}" for i in range(plain.clients))]:
            assert plain.find_files_with_content(service, shards + [server]) == {}, service
        assert plain.find_files_with_content("serverapp", shards + [server]) == {
            "server.npz": ["/data/shards/server.npz"]}

    def test_a_stopped_client_container_fails_the_round_naming_its_node(self, plain):
        plain.fresh()
        victim, before = 1, run_folders(plain)
        stopped = []

        def on_line(line: str) -> None:
            if "[diff2] round 1/" in line and not stopped:
                plain.stop(f"clientapp-{victim}", grace_s=2)
                stopped.append(time.perf_counter())

        try:
            with pytest.raises(SimulationFailed) as info:
                # a stopped ClientApp container never answers: round 2 fails at this timeout. 180 s,
                # not 60: beside the suite's other processes round 1 itself expired at 60 s before
                # the stop ("never released")
                plain.run(CONFIG, {**SET, "training.round_timeout_s": 180}, on_line=on_line)
        finally:
            plain.start(f"clientapp-{victim}")
        message = str(info.value)
        assert stopped, f"round 1 was never released: {message}"
        log(f"[compose-test] fault error {time.perf_counter() - stopped[0]:.1f} s after the stop: "
            f"{message[:400]}")
        assert "Round 2 released nothing" in message and "client-failure" in message
        assert str(plain.node_ids[victim]) in message  # the error names the stopped owner's node
        assert not any(str(plain.node_ids[i]) in message for i in range(plain.clients)
                       if i != victim)
        (run_dir,) = run_folders(plain) - before
        assert [r["round"] for r in rows(run_dir)] == [0, 1]  # round 2 released nothing
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["status"] == "failed" and "Round 2 released nothing" in summary["error"]

    def test_a_killed_server_container_resumes_the_same_trajectory(self, plain, tmp_path):
        plain.fresh()
        before, seen = run_folders(plain), {}

        def on_line(line: str) -> None:
            started = re.search(r"Successfully started run (\d+)", line)
            if started:
                seen["run"] = int(started.group(1))
            if "[diff2] round 1/" in line and "killed" not in seen:
                plain.kill("serverapp")  # SIGKILL: no clean shutdown of anything in that container
                seen["killed"] = time.perf_counter()
                plain.stop_run(seen["run"])  # else the SuperLink waits for the lost heartbeat

        with pytest.raises(SimulationFailed):
            plain.run(CONFIG, SET, on_line=on_line)
        assert "killed" in seen
        (run_dir,) = run_folders(plain) - before
        released = [r["round"] for r in rows(run_dir)]
        # killed right after round 1 was checkpointed
        assert released[0] == 0 and released[-1] in (1, 2)
        plain.start("serverapp")
        resumed = plain.run(CONFIG, SET)
        assert resumed.status == "finished:completed" and resumed.output_dir == run_dir
        assert f"resumed from /outputs/checkpoint.npz after round {released[-1]}" in resumed.log
        # every round once, and the trajectory and ε of an uninterrupted run of the same config and
        # seed
        reference = run_inprocess(load_config(host_config(plain, tmp_path)), record=False,
                                  progress=None)
        assert rows(run_dir) == [{k: v for k,
                                  v in r.items() if k != "elapsed_s"} for r in reference.history]
        np.testing.assert_array_equal(np.load(run_dir / "final_parameters.npy"), reference.state.x)
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["rounds_released"] == 2
        assert summary["privacy"]["epsilon_spent"] == reference.epsilon_spent


class TestTlsCompose:
    def test_only_the_serverapp_and_clientapps_hold_their_runtime_secrets(self, tls):
        check_superexec_auth(tls)

    def test_a_tls_run_with_registered_node_keys_equals_the_in_process_driver(self, tls, tmp_path):
        assert tls.node_auth and sorted(tls.node_ids) == list(range(tls.clients))
        tls.fresh()
        started = time.perf_counter()
        result = tls.run(CONFIG, SET)
        log(f"[compose-test] TLS run {result.run_id}: {result.status} in "
            f"{time.perf_counter() - started:.1f} s")
        assert result.status == "finished:completed"
        nodes = tls.nodes()
        # exactly the P registered keys are the SuperLink's nodes, all online
        assert sorted(int(n["node-id"]) for n in nodes) == sorted(tls.node_ids.values())
        assert all(n["status"] == "online" for n in nodes)
        reference = run_inprocess(load_config(host_config(tls, tmp_path)), record=False,
                                  progress=None)
        assert rows(result.output_dir) == [{k: v for k, v in r.items() if k != "elapsed_s"}
                                           for r in reference.history]
        np.testing.assert_array_equal(np.load(result.output_dir / "final_parameters.npy"),
                                      reference.state.x)
        # only the superlink holds the server's key; supernode-i holds its own node key and no other
        keys = sorted(tls.certs.glob("*.key"))
        for service in ["serverapp", *(f"clientapp-{i}" for i in range(tls.clients))]:
            assert tls.find_files_with_content(service, keys) == {}, service
        for i in range(tls.clients):
            assert tls.find_files_with_content(f"supernode-{i}", keys) == {
                f"supernode-{i}.key": ["/keys/supernode.key"]}
        assert tls.find_files_with_content("superlink",
                                           keys) == {"server.key": ["/certs/server.key"]}

