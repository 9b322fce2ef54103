"""`diff2 superlink status|stop`: the local SuperLink plain `flwr run .` leaves running, by its PID
(issue 40, item 6).

The SuperLink is started with Flower 1.42's own command for an FLWR_HOME (tests/flwr_app.py
``start_local_superlink``: what `flwr run` runs, with a longer wait); `diff2` is the installed entry
point, typed with that FLWR_HOME. Beside it runs a stand-in of another FLWR_HOME's SuperLink (a
process whose command line looks like one), which must be left alone.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from diff2_flwr.deploy.containers import port_free
from flwr_app import flwr_env, start_local_superlink, stop_superlinks, superlink_pids

DIFF2 = Path(sys.executable).parent / "diff2"


def diff2(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(DIFF2), "superlink", *args], env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.flower
def test_diff2_superlink_stops_the_local_superlink_by_its_pid_and_nothing_else(tmp_path):
    home, other = tmp_path / "flwr-home", tmp_path / "other-home"
    env = flwr_env(home)
    # another FLWR_HOME's "SuperLink": a script named flower-superlink with that home's log file
    script = tmp_path / "bin" / "flower-superlink"
    script.parent.mkdir()
    script.write_text("import time\ntime.sleep(600)\n")
    decoy = subprocess.Popen([sys.executable, str(script), "--log-file",
                              str(other / "local-superlink" / "superlink.log")],
                             start_new_session=True)
    try:
        assert "no local SuperLink" in diff2(env, "status").stdout  # nothing started yet
        start_local_superlink(env)
        (pid,) = superlink_pids(home)  # found independently: pgrep on its command line
        port = int(env["FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"])
        status = diff2(env, "status")
        assert status.returncode == 0 and f"PID {pid}, on 127.0.0.1:{port}" in status.stdout, (
            status.stdout + status.stderr)
        stop = diff2(env, "stop")
        assert stop.returncode == 0 and f"(PID {pid})" in stop.stdout, stop.stdout + stop.stderr
        assert superlink_pids(home) == [] and port_free(port)
        assert decoy.poll() is None  # another FLWR_HOME's is not touched
        again = diff2(env, "stop")
        assert again.returncode == 0 and "no local SuperLink" in again.stdout
        # the other home's, named explicitly, is found by the same rule
        named = diff2({**env, "FLWR_HOME": "/nonexistent"}, "status", "--flwr-home", str(other))
        assert f"PID {decoy.pid}," in named.stdout, named.stdout + named.stderr
    finally:
        stop_superlinks(home)
        if decoy.poll() is None:
            os.killpg(decoy.pid, 9)  # the decoy this test started, by its PID
        decoy.wait(timeout=30)
