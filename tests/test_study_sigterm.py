"""SIGTERM stops a study as Ctrl-C does: the driver's clean-up terminates its pool's workers.

Before, `diff2 experiment` died at once on SIGTERM (Python's default), and its two spawned workers
kept computing their units for minutes, orphaned (found re-running the studies of issue 42)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def _children(pid: int) -> set[int]:
    out = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        ppid = next((int(line.split()[1]) for line in status.splitlines()
                     if line.startswith("PPid:")), None)
        if ppid == pid:
            out.add(int(entry.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_sigterm_stops_the_driver_and_terminates_its_workers(tmp_path):
    study = yaml.safe_load((ROOT / "configs" / "smoke.yaml").read_text())
    study.update(name="sigterm", rounds=20000, workers=2, output={"dir": str(tmp_path / "out")})
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(study, sort_keys=False))
    driver = subprocess.Popen([str(Path(sys.executable).parent / "diff2"), "experiment",
                               str(tmp_path / "s.yaml")], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        workers: set[int] = set()
        deadline = time.monotonic() + 120
        # both workers spawned (the resource tracker is a child too) and computing
        while len(workers) < 3 and time.monotonic() < deadline and driver.poll() is None:
            workers = _children(driver.pid)
            time.sleep(0.5)
        assert len(workers) >= 3, f"the study's workers never started: {workers}"
        time.sleep(3)
        driver.send_signal(signal.SIGTERM)
        _, err = driver.communicate(timeout=60)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
            for pid in workers:
                if _alive(pid):
                    os.kill(pid, signal.SIGKILL)
    try:
        assert driver.returncode == 128 + signal.SIGTERM, err[-2000:]
        assert "stopped by SIGTERM; the runs finished so far are kept" in err
        deadline = time.monotonic() + 20
        while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not [pid for pid in workers if _alive(pid)], "a worker outlived its driver"
    finally:  # a failure leaves no orphan computing on the machine
        for pid in workers:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
