"""Studies on a Ray cluster: a real local cluster (a head and one more worker node, each a `ray
start` process group started and stopped by PID, on loopback) runs a study through `diff2 experiment
--ray`, which must give the local engine's summary and run files bit for bit, resume without
computing, and refuse a node that read other data."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from diff2_flwr.lab.study.runner import load_study, run_study
from diff2_flwr.runtime.outputs import to_json

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[1]
RAY = Path(sys.executable).with_name("ray")
# Ray turns 127.0.0.1 into the machine's routable address; any other loopback address it keeps.
LOOPBACK = "127.0.0.2"

TINY = {
    "name": "tiny-ray", "dataset": {"name": "synthetic", "num_samples": 400}, "clients": 2,
    "rounds": 12,
    "delta": 1e-5, "epsilons": [3.0], "eval_every": 4, "seeds": {"tune": [7], "evaluate": [1, 2]},
    "analysis": {"protocol": "paper"},
    "batch_size": 2, "threads": 1,
    "methods": [
        {"name": "DP-GD", "method": "dpgd", "grid": {"learning_rate": [0.2, 0.4],
                                                     "clip_restart": [0.5, 1.0]}},
        {"name": "DIFF2", "method": "diff2", "grid": {"restart_every": [3], "learning_rate": [0.2,
                                                                                              0.4],
                                                     "clip_restart": [0.5, 1.0],
                                                     "clip_diff": [3.0]}},
    ],
}


def _free_ports(n: int) -> list[int]:
    """n distinct ports free on every interface (Ray's services listen on all of them)."""
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class LocalRayCluster:
    """A head and one worker node on loopback, each `ray start --block` in its own process group."""

    def __init__(self, env: dict[str, str]) -> None:
        # short: Ray's socket paths must fit
        self.tmp = Path(tempfile.mkdtemp(prefix="d2ray-", dir="/tmp"))
        self.env = {**env, "RAY_USAGE_STATS_ENABLED": "0",
                    "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0"}
        self.procs: list[subprocess.Popen] = []
        self.port, *ports = _free_ports(14)  # all at once: distinct
        head_ports, worker_ports = ports[:7], ports[7:]
        self.address = f"{LOOPBACK}:{self.port}"
        common = ["--node-ip-address", LOOPBACK, "--num-cpus", "1", "--temp-dir", str(self.tmp),
                  "--block",
                  "--disable-usage-stats"]
        self._start("head", ["--head", "--port", str(self.port), "--include-dashboard", "false",
                             "--ray-client-server-port", str(head_ports[0]),
                             *self._node_ports(head_ports[1:]), *common])
        self._start("worker", ["--address", self.address, *self._node_ports(worker_ports), *common])

    @staticmethod
    def _node_ports(p: list[int]) -> list[str]:
        keys = ("--node-manager-port", "--object-manager-port", "--dashboard-agent-listen-port",
                "--dashboard-agent-grpc-port", "--runtime-env-agent-port", "--metrics-export-port")
        return [x for k, v in zip(keys, p) for x in (k, str(v))]

    def _start(self, name: str, args: list[str]) -> None:
        log = self.tmp / f"{name}.log"
        with open(log, "w") as out:
            proc = subprocess.Popen([str(RAY), "start", *args], env=self.env, stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        self.procs.append(proc)
        deadline = time.monotonic() + 120
        while "Ray runtime started" not in log.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"`ray start` ({name}) did not come up:\n{log.read_text()[-3000:]}")
            time.sleep(0.3)

    def stop(self) -> None:
        """SIGTERM each node's process group (by the PID we started), then SIGKILL what is left."""
        for proc in reversed(self.procs):
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _write_housing_csv(folder: Path, bump: float) -> None:
    """A small California-like file; ``bump`` changes one cell (data that differs between
    machines)."""
    rng = np.random.default_rng(0)
    values = rng.uniform(1, 10, size=(300, 9))
    values[0, 0] += bump
    header = (
        "longitude,latitude,housing_median_age,total_rooms,total_bedrooms,population,households,"
              "median_income,median_house_value")
    (folder / "california_housing").mkdir(parents=True)
    np.savetxt(folder / "california_housing" / "cal_housing.csv", values, delimiter=",",
               header=header, comments="")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    data = tmp_path_factory.mktemp("data")
    _write_housing_csv(data / "nodes", bump=0.0)
    _write_housing_csv(data / "driver", bump=0.5)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    c = LocalRayCluster({**env, "DIFF2_DATA_DIR": str(data / "nodes")})
    try:
        yield c, data
    finally:
        c.stop()


def _experiment(study: Path, out: Path, address: str, env: dict[str, str] | None = None):
    return subprocess.run([sys.executable, "-m", "diff2_flwr.cli", "experiment", str(study),
                           "--output", str(out),
                           "--ray", address], capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0", **(env or {})})


def test_a_study_on_a_ray_cluster_equals_the_local_one_bit_for_bit_and_resumes(cluster, tmp_path):
    c, _ = cluster
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY))
    started = time.monotonic()
    proc = _experiment(path, tmp_path / "ray", c.address)
    assert proc.returncode == 0, proc.stderr[-4000:]
    took = time.monotonic() - started
    remote = json.loads((tmp_path / "ray" / "tiny-ray" / "summary.json").read_text())
    runs = sorted((tmp_path / "ray" / "tiny-ray" / "runs").glob("*.json"))
    ex = remote["execution"]
    assert ex["executor"] == "ray" and ex["ray_address"] == c.address and ex["ray_capacity"] == 2
    assert ex["runs_computed_here"] == len(runs) and ex["runs_reused"] == 0
    assert len(ex["ray_nodes"]) == 2, ex  # both nodes computed units
    local = run_study(load_study(path), output_root=tmp_path / "local", show_progress=False,
                      make_plots=False)
    # bit for bit (floats through JSON's exact repr)
    assert remote["epsilons"] == to_json(local["epsilons"])
    for r in runs:
        a, b = json.loads(r.read_text()), json.loads((
            tmp_path / "local" / "tiny-ray" / "runs" / r.name).read_text())
        when = ("computed_by", "wall_s")  # who computed it, and how long its unit took
        assert {k: v for k, v in a.items() if k not in when} == {
            k: v for k, v in b.items() if k not in when}
    print(
        f"ray study: {len(runs)} runs on {ex['ray_nodes']} in {took:.1f} s (driver process "
        f"included)")
    # the same command again: every run is reused, nothing is computed
    again = _experiment(path, tmp_path / "ray", c.address)
    assert again.returncode == 0, again.stderr[-4000:]
    assert "0 run(s) computed by this driver (ray), 0 by other drivers, %d reused" % len(
        runs) in again.stderr
    assert not list((tmp_path / "ray" / "tiny-ray" / "runs").glob("*.claim-*"))


def test_a_node_with_other_data_stops_the_study(cluster, tmp_path):
    c, data = cluster
    study = {**TINY, "name": "other-data", "dataset": {"name": "california_housing"}, "clients": 2,
             "methods": TINY["methods"][:1]}
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(study))
    proc = _experiment(path, tmp_path / "out", c.address,
                       env={"DIFF2_DATA_DIR": str(data / "driver")})
    assert proc.returncode == 2
    assert "computed with other data than the driver" in proc.stderr
    assert "DIFF2_DATA_DIR" in proc.stderr
    # nothing of the mixed data kept
    assert not list((tmp_path / "out" / "other-data" / "runs").glob("*.json"))
