"""`flwr run .` exactly as a Flower user types it: the venv activated, a fresh FLWR_HOME, no flag
(Flower 1.42).

Flower then creates ``$FLWR_HOME/config.toml`` whose default connection ``local`` has the address
``:local:``, starts a detached local SuperLink (``--database $FLWR_HOME/local-superlink/state.db``)
and submits the run with its default federation config: 2 simulated SuperNodes. The embedded default
says ``training.clients: auto``, so P is those 2 SuperNodes (shards and calibration from there) and
the run completes.

The shell is a fresh ``bash`` that sources ``.venv/bin/activate`` (which, by ``scripts/setup.sh``,
also turns off Flower's per-run dependency install) from an environment that has neither the venv on
PATH nor any ``FLWR_*`` variable. The only variables the test adds are ``FLWR_HOME`` (fresh) and the
two that move the local SuperLink's ports to free ones (other test runs may share the machine; they
change nothing else). Flower leaves the SuperLink running: the test finds it by its FLWR_HOME in its
command line and stops its process group.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from diff2_flwr.runtime.launch import free_ports
from flwr_app import (
    copy_app, missed_slow_start, start_local_superlink, superlink_pids, stop_superlinks,
    wait_finished,
)

VENV = Path(sys.executable).parent.parent
ACTIVATE = VENV / "bin" / "activate"
OFFLINE = "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"
#: A simulation with the wrong number of SuperNodes must fail long before the strategy's 5-minute
#: deployment wait.
FAIL_WITHIN_S = 120
#: The ServerApp's line that says P, and how to change it (issue 40: P silently became 2).
P_LINE = ('[diff2] training.clients: auto -> P = 2, the SuperNodes of this simulation (another P: '
          'flwr run . --federation-config "num-supernodes=N")')


def _user_env(home: Path) -> dict[str, str]:
    """A shell before activation: the venv off PATH, no FLWR_* or DIFF2_* variable but a fresh
    FLWR_HOME and the local SuperLink's ports."""
    path = os.pathsep.join(p for p in os.environ.get("PATH",
                                                     "").split(os.pathsep)
                                                     if Path(p) != VENV / "bin")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("FLWR_", "DIFF2_", "VIRTUAL_ENV", "PYTHONPATH"))}
    env.update(PATH=path, FLWR_HOME=str(home))
    env.update(zip(("FLWR_LOCAL_SUPERLINK_HTTP_API_PORT", "FLWR_LOCAL_CONTROL_API_PORT"),
                   map(str, free_ports(2))))
    return env


def _activated(command: str, env: dict[str, str], cwd: Path,
               timeout: float = 120) -> subprocess.CompletedProcess:
    """``command`` typed in a bash that has just sourced the venv's activate script."""
    return subprocess.run(["bash", "-c", f"source {shlex.quote(str(ACTIVATE))} && {command}"],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _wait_finished(env: dict[str, str], cwd: Path, run_id: int, timeout_s: float) -> dict:
    """The run's final `flwr ls` entry (read with the venv's flwr; only the runs were typed in the
    activated shell)."""
    return wait_finished({**env, "PATH": f"{VENV / 'bin'}{os.pathsep}{env['PATH']}"}, cwd, run_id,
                         timeout_s)


def _flwr_run(command: str, env: dict[str, str], cwd: Path) -> int:
    """``command`` typed in an activated shell; once more only if Flower's local SuperLink missed
    its 15 s start."""
    done = _activated(command, env, cwd)
    if missed_slow_start(done):
        print(
            f"`{command}`: Flower's local SuperLink did not answer within 15 s; started it, typed "
            f"again")
        start_local_superlink({**env, "PATH": f"{VENV / 'bin'}{os.pathsep}{env['PATH']}"})
        done = _activated(command, env, cwd)
    assert done.returncode == 0, f"{command} exited {done.returncode}:\n{done.stdout}{done.stderr}"
    started = re.search(r"Successfully started run (\d+)", done.stdout)
    assert started, f"{command} started no run:\n{done.stdout}{done.stderr}"
    return int(started.group(1))


def _summaries(app: Path) -> list[dict]:
    return [json.loads(p.read_text())
            for p in sorted((app / "outputs").glob("default-*/summary.json"))]


def test_activating_the_venv_turns_flowers_per_run_install_off_and_deactivate_restores_the_shell(
    tmp_path):
    """scripts/setup.sh's activate lines: on when the shell had no value, the user's own value kept,
    both undone."""
    env = _user_env(tmp_path / "home")
    show = f'echo "${{{OFFLINE}-unset}}"'
    done = _activated(f"{show}; command -v flwr; deactivate; {show}", env, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", str(VENV / "bin" / "flwr"), "unset"]
    done = _activated(f"{show}; deactivate; {show}", {**env, OFFLINE: "0"}, tmp_path)
    assert done.stdout.split() == ["0", "0"]  # a user who wants Flower's install keeps it


def test_without_the_variable_flowers_own_dependency_step_resolves(tmp_path):
    """What `flwr run .` does without FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION: Flower 1.42 runs
    `uv sync` on the installed app's pyproject.toml. Its resolution (requires-python against every
    dependency's) must succeed; the install itself is not run (it would download a second copy of
    every dependency, on Linux the CUDA torch)."""
    installer = (Path(__import__(
        "flwr").__file__).parent / "supercore" / "superexec" / "dependency_installer.py")
    flags = ["sync", "--python", "--no-install-project", "--no-install-package", "--inexact"]
    source = installer.read_text()
    assert all(f'"{flag}"' in source
               for flag in flags), "Flower's uv command changed: update this test"
    app = copy_app(tmp_path / "app")
    env = {**os.environ, "UV_PROJECT_ENVIRONMENT": str(tmp_path / "runtime-env"),
           "UV_CACHE_DIR": str(tmp_path / "uv")}
    cmd = [sys.executable, "-m", "uv", "sync", "--python", sys.executable, "--no-install-project",
           "--no-install-package", "flwr", "--inexact", "--dry-run"]
    done = subprocess.run(cmd, cwd=app, env=env, capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    if done.returncode != 0 and re.search(
        r"(?i)failed to fetch|dns error|connection|network|offline", out):
        pytest.skip(
            f"no package index reachable for uv's resolution: {out.strip().splitlines()[-1]}")
    assert done.returncode == 0, out
    assert re.search(r"Resolved \d+ packages", out), out
    # resolved, nothing installed
    assert "unsatisfiable" not in out and not (tmp_path / "runtime-env").exists()


@pytest.mark.flower
def test_plain_flwr_run_completes_with_p_the_simulations_supernodes(tmp_path):
    app = copy_app(tmp_path / "app")
    home = tmp_path / "flwr-home"
    env = _user_env(home)
    try:
        typed = time.monotonic()
        run_id = _flwr_run("flwr run .", env, app)  # exactly as typed
        info = _wait_finished(env, app, run_id, 600)
        took = time.monotonic() - typed
        assert info["status"] == "finished:completed", info
        (summary,) = _summaries(app)
        assert summary["status"] == "completed" and summary["rounds_released"] == 100, summary
        assert summary["config"]["training"]["clients"] == 2 and summary["privacy"]["calibration"][
            "clients"] == 2
        first = json.loads((Path(summary["output_dir"]) / "metrics.jsonl").read_text().splitlines()[
            0])
        assert first["round"] == 0 and summary["final"]["train_loss"] < first["train_loss"], summary
        log = _activated(f"flwr log {run_id} --show", env, app, timeout=60).stdout
        assert P_LINE in log, log[-3000:]
        # the log ends with the outcome: the summary block, ε and where the files are
        assert "[diff2] summary: run completed: default (diff2, P = 2, 100/100 rounds)" in log, log[
            -3000:]
        assert f"  files        {summary['output_dir']}: " in log, log[-3000:]
        print(f"plain `flwr run .` completed in {took:.0f} s (run {info['elapsed']:.0f} s)")

        # Another federation size, from Flower's own flag: P follows it.
        run_id = _flwr_run('flwr run . --federation-config "num-supernodes=3" '
                           '--run-config "training.rounds=4 training.restart_every=2"', env, app)
        assert _wait_finished(env, app, run_id, 300)["status"] == "finished:completed"
        three = [s for s in _summaries(app) if s["config"]["training"]["rounds"] == 4]
        assert [(s["status"],
                 s["privacy"]["calibration"]["clients"]) for s in three] == [("completed", 3)]

        # The default with distributed noise: the clients' Skellam shares through Flower's SecAgg+
        # (issue 23).
        run_id = _flwr_run("flwr run . --run-config \"privacy.noise='distributed'\"", env, app)
        assert _wait_finished(env, app, run_id, 600)["status"] == "finished:completed"
        (dist,) = [s for s in _summaries(app) if s["privacy"].get("noise") == "distributed"]
        assert dist["status"] == "completed" and dist["rounds_released"] == 100
        assert dist["privacy"]["noise"] == "distributed" and dist["privacy"]["epsilon_spent"] <= 3.0
        log = _activated(f"flwr log {run_id} --show", env, app, timeout=60).stdout
        assert "Secure aggregation completed" in log and (
            "[diff2] summary: run completed") in log, log[-3000:]

        # A config that fixes P fails within seconds naming the flag, and that command, as typed,
        # completes.
        typed = time.monotonic()
        fixed = '--run-config "training.clients=4 training.rounds=3 training.restart_every=3"'
        run_id = _flwr_run(f"flwr run . {fixed}", env, app)
        info = _wait_finished(env, app, run_id, FAIL_WITHIN_S)
        assert info["status"] == "finished:failed", info
        details = info["status-details"]
        assert "training.clients = 4 but this simulation has 2 SuperNodes" in details, details
        assert time.monotonic() - typed < FAIL_WITHIN_S
        named = re.search(r"^\s*(flwr run \. .*)$", details, re.MULTILINE)
        assert named and named.group(
            1) == 'flwr run . --federation-config "num-supernodes=4"', details
        run_id = _flwr_run(f"{named.group(1)} {fixed}", env, app)
        assert _wait_finished(env, app, run_id, 300)["status"] == "finished:completed"
    finally:
        stop_superlinks(home)
    assert not superlink_pids(home)


@pytest.mark.flower
def test_plain_flwr_run_stream_says_p_first_and_diff2_superlink_stops_what_it_left(tmp_path):
    """`flwr run . --stream` typed in an activated shell: the first line of ours in what it prints
    says P and how to change it; then `diff2 superlink stop`, typed in the same shell, stops the
    local SuperLink that `flwr run` started and left running, by its PID."""
    app = copy_app(tmp_path / "app")
    home = tmp_path / "flwr-home"
    env = _user_env(home)
    command = 'flwr run . --stream --run-config "training.rounds=2 training.restart_every=2"'
    try:
        done = _activated(command, env, app, timeout=600)
        if missed_slow_start(done):
            start_local_superlink({**env, "PATH": f"{VENV / 'bin'}{os.pathsep}{env['PATH']}"})
            done = _activated(command, env, app, timeout=600)
        assert done.returncode == 0, done.stdout + done.stderr
        ours = [line for line in done.stdout.splitlines() if line.startswith("[diff2]")]
        assert ours and ours[0] == P_LINE, done.stdout[:3000]
        assert "[diff2] summary: run completed: default (diff2, P = 2, 2/2 rounds)" in ours
        (pid,) = superlink_pids(home)  # Flower left it running
        stop = _activated("diff2 superlink stop", env, app)
        assert stop.returncode == 0 and f"(PID {pid})" in stop.stdout, stop.stdout + stop.stderr
        assert superlink_pids(home) == []
    finally:
        stop_superlinks(home)
