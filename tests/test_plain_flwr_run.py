"""`flwr run .` exactly as a Flower user types it, with a fresh FLWR_HOME (Flower 1.42).

Flower then creates ``$FLWR_HOME/config.toml`` whose default connection ``local`` has the address
``:local:``, starts a detached local SuperLink (``--database $FLWR_HOME/local-superlink/state.db``)
and submits the run with its default federation config: 2 simulated SuperNodes. The embedded
default needs P = 10, so the run must fail within seconds (not after the strategy's 5-minute wait
for clients that never come) and name the flag; the command it names must then work as typed.

The SuperLink ports come from Flower's own environment variables (free ports: other test runs may
share the machine); the command line is the user's. Flower leaves the SuperLink running: the test
finds it by its FLWR_HOME in its command line and stops its process group.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from diff2_flwr.runtime.launch import _free_ports

pytestmark = pytest.mark.flower

REPO = Path(__file__).resolve().parents[1]
#: The strategy waits 300 s for clients in a deployment; a simulation with the wrong count must fail well before.
FAIL_WITHIN_S = 120


def _copy_app(dest: Path) -> Path:
    """The Flower app as a user has it (no outputs, no venv): what `flwr run .` builds its FAB from."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    dest.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, dest / name)
    for name in ("diff2_flwr", "server", "clients", "configs"):
        shutil.copytree(REPO / name, dest / name, ignore=ignore)
    return dest


def _superlink_pids(home: Path) -> list[int]:
    """The local SuperLink(s) that `flwr` started for this FLWR_HOME (their command line names its database)."""
    found = subprocess.run(["pgrep", "-f", re.escape(str(home / "local-superlink"))], capture_output=True, text=True)
    return [int(pid) for pid in found.stdout.split()]


def _stop_group(pid: int) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)  # Flower starts it with start_new_session: its group holds its children too
        except ProcessLookupError:
            return
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                os.killpg(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)


def _status(env: dict[str, str], cwd: Path, run_id: int) -> dict:
    listing = subprocess.run(["flwr", "ls", "--run-id", str(run_id), "--format", "json"], cwd=cwd, env=env,
                             capture_output=True, text=True, timeout=60)
    try:
        return json.loads(listing.stdout)["runs"][0]
    except (ValueError, KeyError, IndexError):
        raise AssertionError(f"`flwr ls` did not list run {run_id}: {listing.stdout}{listing.stderr}") from None


def _wait_finished(env: dict[str, str], cwd: Path, run_id: int, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        info = _status(env, cwd, run_id)
        if info["status"].startswith("finished"):
            return info
        if time.monotonic() > deadline:
            raise AssertionError(f"run {run_id} still {info['status']} after {timeout_s:.0f} s")
        time.sleep(2)


def _flwr(argv: list[str], env: dict[str, str], cwd: Path) -> int:
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{shlex.join(argv)} exited {done.returncode}:\n{done.stdout}{done.stderr}"
    started = re.search(r"Successfully started run (\d+)", done.stdout)
    assert started, f"{shlex.join(argv)} started no run:\n{done.stdout}{done.stderr}"
    return int(started.group(1))


def test_plain_flwr_run_fails_within_seconds_naming_the_flag_and_that_command_works(tmp_path):
    app = _copy_app(tmp_path / "app")
    home = tmp_path / "flwr-home"
    env = {**os.environ, "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""),
           "FLWR_HOME": str(home), "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
           "FLWR_DISABLE_UPDATE_CHECK": "1",  # loopback only
           **dict(zip(("FLWR_LOCAL_SUPERLINK_HTTP_API_PORT", "FLWR_LOCAL_CONTROL_API_PORT"), map(str, _free_ports(2))))}
    env.pop("DIFF2_FAULT_CRASH_AFTER_ROUND", None)
    try:
        typed = time.monotonic()
        run_id = _flwr(["flwr", "run", "."], env, app)  # exactly as typed
        info = _wait_finished(env, app, run_id, FAIL_WITHIN_S)
        took = time.monotonic() - typed
        assert info["status"] == "finished:failed", info
        details = info["status-details"]
        assert "training.clients = 10 but this simulation has 2 SuperNodes" in details, details
        assert took < FAIL_WITHIN_S, f"the failure took {took:.0f} s"
        print(f"plain `flwr run .` failed after {took:.0f} s (run {info['elapsed']:.0f} s): {details}")

        # The command the error names, as typed, completes the embedded default.
        named = re.search(r"^\s*(flwr run \. .*)$", details, re.MULTILINE)
        assert named, details
        assert named.group(1) == 'flwr run . --federation-config "num-supernodes=10"'
        run_id = _flwr(shlex.split(named.group(1)), env, app)
        info = _wait_finished(env, app, run_id, 600)
        assert info["status"] == "finished:completed", info
        summaries = sorted((app / "outputs").glob("default-*/summary.json"))
        completed = [json.loads(p.read_text()) for p in summaries]
        assert [s["status"] for s in completed].count("completed") == 1, [s["status"] for s in completed]
    finally:
        for pid in _superlink_pids(home):
            _stop_group(pid)
    assert not _superlink_pids(home)
