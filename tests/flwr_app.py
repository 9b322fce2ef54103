"""Helpers for tests that run the app with Flower's own commands (`flwr build`, `flwr run`, `flwr
ls`).

A copy of the app as a user has it, a fresh ``FLWR_HOME`` on free loopback ports, the run's status
from `flwr ls`, and the local SuperLink that `flwr run` leaves behind stopped by PID. These are the
helpers of tests/test_plain_flwr_run.py, shared here (that file keeps its own copy for now), with
one difference: ``start_run`` types the command once more when Flower gave up starting its local
SuperLink within 15 s. Not a test module.
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
import tomllib
from pathlib import Path

from diff2_flwr.runtime.launch import free_ports, wait_healthy

REPO = Path(__file__).resolve().parents[1]


def fab_folders(root: Path = REPO) -> list[str]:
    """The top-level folders that ``fab-include`` in ``root``'s pyproject.toml ships
    (``custom/**/*.py`` -> custom)."""
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["flwr"]["app"][
        "fab-include"]
    return sorted({p.lstrip("/").split("/")[0] for p in patterns if "/" in p.lstrip("/")})


def copy_app(dest: Path) -> Path:
    """The Flower app as a user has it (no outputs, no venv, no .gitignore): what `flwr run .`
    builds its FAB from."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    dest.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, dest / name)
    for name in fab_folders():
        shutil.copytree(REPO / name, dest / name, ignore=ignore)
    return dest


def flwr_env(home: Path) -> dict[str, str]:
    """This environment with the venv's `flwr` first, a fresh FLWR_HOME, free SuperLink ports and no
    per-run install."""
    env = {**os.environ,
           "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""),
           "FLWR_HOME": str(home), "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
           "FLWR_DISABLE_UPDATE_CHECK": "1",  # loopback only
           **dict(zip(("FLWR_LOCAL_SUPERLINK_HTTP_API_PORT", "FLWR_LOCAL_CONTROL_API_PORT"),
                      map(str, free_ports(2))))}
    env.pop("DIFF2_FAULT_CRASH_AFTER_ROUND", None)
    env.pop("DIFF2_FAULT_CLIENT_FAILS", None)
    return env


def superlink_pids(home: Path) -> list[int]:
    """The local SuperLink(s) that `flwr` started for this FLWR_HOME (their command line names its
    database)."""
    found = subprocess.run(["pgrep", "-f", re.escape(str(home / "local-superlink"))],
                           capture_output=True, text=True)
    return [int(pid) for pid in found.stdout.split()]


def stop_group(pid: int) -> None:
    """SIGTERM, then SIGKILL, the process group of ``pid``; returns once it is gone."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            # Flower starts it with start_new_session: its group holds its children too
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                os.killpg(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)


def stop_superlinks(home: Path) -> None:
    """Stop every local SuperLink of this FLWR_HOME, by PID."""
    for pid in superlink_pids(home):
        stop_group(pid)


def status(env: dict[str, str], cwd: Path, run_id: int) -> dict:
    """The run as `flwr ls --format json` lists it (``status``, ``status-details``, ``elapsed``,
    ...)."""
    listing = subprocess.run(["flwr", "ls", "--run-id", str(run_id), "--format", "json"], cwd=cwd,
                             env=env, capture_output=True, text=True, timeout=60)
    try:
        return json.loads(listing.stdout)["runs"][0]
    except (ValueError, KeyError, IndexError):
        raise AssertionError(
            f"`flwr ls` did not list run {run_id}: {listing.stdout}{listing.stderr}") from None


def wait_finished(env: dict[str, str], cwd: Path, run_id: int, timeout_s: float) -> dict:
    """The run as `flwr ls` lists it once its status is ``finished:*``; fail after ``timeout_s``.

    It waits inside `flwr log RUN_ID`, whose stream Flower's SuperLink ends when the run finishes:
    one process for the whole wait. (Polling `flwr ls` every 2 s started a Python process that
    imports Flower, ~2 CPU-s, each time: about one core for the length of every run, on a 2-core
    machine running the suite in parallel.)"""
    deadline = time.monotonic() + timeout_s
    while True:
        info = status(env, cwd, run_id)
        if info["status"].startswith("finished"):
            return info
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"run {run_id} still {info['status']} after {timeout_s:.0f} s")
        started = time.monotonic()
        try:
            subprocess.run(["flwr", "log", str(run_id)], cwd=cwd, env=env, capture_output=True,
                           timeout=left)
        except subprocess.TimeoutExpired:
            pass
        # a stream that ends at once (an error) is retried slowly
        time.sleep(max(0.0, 2 - (time.monotonic() - started)))


#: Flower 1.42 gives the local SuperLink it starts 15 s to answer
#: (``LOCAL_SUPERLINK_STARTUP_TIMEOUT``), then kills it.
SLOW_START = "Failed to start local SuperLink within"


def missed_slow_start(done: subprocess.CompletedProcess) -> bool:
    """Whether `flwr run` failed only because its local SuperLink did not answer within Flower's 15
    s."""
    said = re.sub(r"[\s│╭╮╰╯─]+", " ", done.stdout + done.stderr)  # Flower's error box, unwrapped
    return done.returncode != 0 and SLOW_START in said


def start_local_superlink(env: dict[str, str], timeout_s: float = 180) -> None:
    """Start the local SuperLink of ``env``'s FLWR_HOME with the very command `flwr run` uses
    (Flower 1.42's ``flwr/cli/local_superlink.py``), but wait for its health endpoint up to
    ``timeout_s`` instead of 15 s.

    For a machine so busy (the suite's parallel processes) that importing Flower takes longer than
    Flower's fixed 15 s: the `flwr run` typed next finds this SuperLink started and uses it, as it
    uses the one it starts itself. It is stopped like that one (:func:`stop_superlinks`: its command
    line names FLWR_HOME)."""
    runtime = Path(env["FLWR_HOME"]) / "local-superlink"
    runtime.mkdir(parents=True, exist_ok=True)
    http, control = env["FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"], env["FLWR_LOCAL_CONTROL_API_PORT"]
    superlink = shutil.which("flower-superlink", path=env["PATH"]) or "flower-superlink"
    proc = subprocess.Popen(
        [superlink, "--insecure", "--simulation", "--isolation", "subprocess",
         "--control-api-address",
         f"127.0.0.1:{control}", "--host", "127.0.0.1", "--port", http, "--log-file",
         str(runtime / "superlink.log"),
         "--log-rotation-interval-hours", "24", "--log-rotation-backup-count", "7", "--database",
         str(runtime / "state.db")],
        env={**env, "FLWR_DISABLE_UPDATE_CHECK": "1"}, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True)
    wait_healthy(int(http), proc, runtime / "superlink.log", timeout_s)


def start_run(argv: list[str], env: dict[str, str], cwd: Path) -> int:
    """Run a `flwr run ...` command line; the id of the run it started.

    Only when Flower gave up on starting the local SuperLink within its 15 s (importing Flower alone
    takes ~13 s on this shared 2-core machine under load) is that SuperLink started patiently
    (:func:`start_local_superlink`) and the command typed once more; any other failure fails.
    """
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    if missed_slow_start(done):
        print(
            f"`{shlex.join(argv)}`: Flower's local SuperLink did not answer within 15 s; started "
            f"it, typed again")
        start_local_superlink(env)
        done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (f"{shlex.join(argv)} exited "
                                  f"{done.returncode}:\n{done.stdout}{done.stderr}")
    started = re.search(r"Successfully started run (\d+)", done.stdout)
    assert started, f"{shlex.join(argv)} started no run:\n{done.stdout}{done.stderr}"
    return int(started.group(1))
