"""Several drivers on one study folder: two `diff2 experiment` processes compute every run exactly
once and agree on one summary; a driver killed mid-study leaves a claim that the next driver on this
machine takes over at once, recomputing no finished run; --fresh never deletes the runs of a live
driver."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml

from diff2_flwr.lab.study.claims import ClaimBook, Owner
from diff2_flwr.lab.study.runner import CRITERIA, StudyError, load_study, run_study

ROOT = Path(__file__).resolve().parents[1]

# One run per unit (engine inprocess): ~30 runs of ~0.2-1 s, long enough for two drivers to share
# them.
SHARED = {
    "name": "shared", "dataset": {"name": "synthetic", "num_samples": 400}, "clients": 2,
    "rounds": 20,
    "delta": 1e-5, "epsilons": [3.0], "eval_every": 5,
    "seeds": {"tune": [7, 8], "evaluate": [1, 2]}, "analysis": {"protocol": "paper"},
    "engine": "inprocess",
    "methods": [
        {"name": "DP-GD", "method": "dpgd", "grid": {"learning_rate": [0.2, 0.4],
                                                     "clip_restart": [0.5, 1.0]}},
        {"name": "DIFF2", "method": "diff2", "grid": {"restart_every": [4], "learning_rate": [0.2,
                                                                                              0.4],
                                                     "clip_restart": [0.5, 1.0],
                                                     "clip_diff": [3.0]}},
    ],
}
COMPUTED = re.compile(
    r"(\d+) run\(s\) computed by this driver \(local\), (\d+) by other drivers, (\d+) reused")


def _write(tmp_path: Path, study: dict) -> Path:
    path = tmp_path / f"{study['name']}.yaml"
    path.write_text(yaml.safe_dump(study, sort_keys=False))
    return path


def _driver(study: Path, out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "diff2_flwr.cli", "experiment", str(study),
                             "--output", str(out), *extra], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, cwd=ROOT)


def test_two_driver_processes_on_one_folder_compute_every_run_once(tmp_path):
    path = _write(tmp_path, SHARED)
    drivers = [_driver(path, tmp_path / "out") for _ in range(2)]
    outputs = [d.communicate(timeout=600) for d in drivers]
    for d, (_, err) in zip(drivers, outputs):
        assert d.returncode == 0, err[-3000:]
    counts = [tuple(map(int, COMPUTED.search(err).groups())) for _, err in outputs]
    root = tmp_path / "out" / "shared"
    runs = [json.loads(p.read_text()) for p in (root / "runs").glob("*.json")]
    by_driver = Counter(r["computed_by"]["driver"] for r in runs)
    # every run file was written by one of the two drivers, and the drivers' own counts add up to
    # the files: a run computed twice would be counted twice
    assert sum(c[0] for c in counts) == len(runs) == sum(by_driver.values())
    assert sorted(by_driver.values()) == sorted(c[0] for c in counts) and len(by_driver) == 2, (
        counts, by_driver)
    # each driver saw every run: computed, by the other, or reused
    assert all(sum(c) == len(runs) for c in counts)
    assert not list((root / "runs").glob("*.claim-*")) and not list(root.rglob(".*.tmp"))
    print(f"two drivers: {counts} (computed, by the other, reused) of {len(runs)} runs")
    # one summary, the study's: the same as one driver computing everything alone (the batched
    # engine, to 1e-9)
    summary = json.loads((root / "summary.json").read_text())
    alone = run_study(dataclasses.replace(load_study(path), engine="batch"),
                      output_root=tmp_path / "alone", show_progress=False, make_plots=False)
    for name, entry in alone["epsilons"]["3.0"]["methods"].items():
        for c in CRITERIA:
            x, y = entry["criteria"][c], summary["epsilons"]["3.0"]["methods"][name]["criteria"][c]
            assert x["point"] == y["point"] and x["run_ids"] == y["run_ids"]
            assert x["min_mean"] == pytest.approx(y["min_mean"], rel=1e-9)


def _freeze(pid: int) -> None:
    """SIGSTOP `pid` and wait until the kernel reports it stopped (state T): the signal is
    asynchronous."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 30
    while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("T", "t"):
        assert time.monotonic() < deadline, f"pid {pid} did not stop within 30 s of SIGSTOP"
        time.sleep(0.005)


def test_a_killed_driver_is_resumed_without_recomputing_its_finished_runs(tmp_path):
    path = _write(tmp_path, {**SHARED, "name": "killed"})
    runs = tmp_path / "out" / "killed" / "runs"
    first = _driver(path, tmp_path / "out")
    deadline = time.monotonic() + 300
    while True:
        # kill it mid-run, not between two runs: freeze it (SIGSTOP), look, and kill only while it
        # holds a claim; a frozen driver cannot finish its run between the look and the kill
        assert first.poll() is None and time.monotonic() < deadline, ("the first driver ended "
                                                                      "before it was killed")
        if len(list(runs.glob("*.json"))) >= 3:
            _freeze(first.pid)
            if list(runs.glob("*.claim-*")):
                break
            os.kill(first.pid, signal.SIGCONT)
        time.sleep(0.02)
    first.kill()  # SIGKILL: no clean-up, its claim stays behind
    first.communicate()
    finished = {p.name: p.read_bytes() for p in runs.glob("*.json")}
    left = [p.name for p in runs.glob("*.claim-*")]
    assert left, "the killed driver held no claim"
    # the next driver may not wait for a heartbeat (100,000 s): a dead driver on this machine is
    # taken over at once
    second = _driver(path, tmp_path / "out", "--stale-after", "100000")
    _, err = second.communicate(timeout=600)
    assert second.returncode == 0, err[-3000:]
    computed, others, reused = map(int, COMPUTED.search(err).groups())
    total = len(list(runs.glob("*.json")))
    assert reused == len(finished) and computed == total - len(finished) and others == 0
    # finished runs untouched
    assert {name: (runs / name).read_bytes() for name in finished} == finished
    assert not list(runs.glob("*.claim-*"))
    print(
        f"killed after {len(finished)} runs with claim(s) {left}; resumed: {computed} computed, "
        f"{reused} reused")


def test_fresh_refuses_while_another_live_driver_holds_runs(tmp_path):
    study = load_study(_write(tmp_path, {**SHARED, "name": "busy", "engine": "batch"}))
    runs = tmp_path / "out" / "busy" / "runs"
    runs.mkdir(parents=True)
    (runs / "tune-x.json").write_text("{}")
    elsewhere = dataclasses.replace(Owner.this_process(), host="node-7", boot="b", pid=4242)
    ClaimBook(runs, owner=elsewhere).try_claim("tune-y")
    with pytest.raises(StudyError,
                       match=r"--fresh would delete.*1 run\(s\) there are claimed by a live "
                             r"driver on node-7 \(pid 4242\), e\.g\. tune-y\.claim-1"):
        run_study(study, output_root=tmp_path / "out", fresh=True, show_progress=False,
                  make_plots=False)
    assert (runs / "tune-x.json").exists()  # nothing deleted


def test_the_flower_engine_is_refused_on_a_ray_cluster(tmp_path):
    study = load_study(_write(tmp_path, {**SHARED, "name": "fl", "engine": "flower"}))
    with pytest.raises(StudyError,
                       match=r"`engine`: expected 'batch' or 'inprocess' on a Ray cluster.*Found "
                             r"'flower'"):
        run_study(study, output_root=tmp_path, ray_address="127.0.0.2:1", show_progress=False)


def test_threads_is_validated_and_reaches_every_run(tmp_path):
    study = load_study(_write(tmp_path, {**SHARED, "name": "t", "threads": 2}))
    m = study.methods[0]
    assert study.experiment(m, m.points()[0], 3.0, 7).training.threads == 2
    with pytest.raises(StudyError, match=r"key `threads`: expected an integer >= 1.*Found 0"):
        load_study(_write(tmp_path, {**SHARED, "name": "t0", "threads": 0}))


def test_an_unreachable_cluster_fails_at_once_and_names_the_address(tmp_path, capsys):
    from diff2_flwr.cli import main

    s = socket.socket()
    s.bind(("127.0.0.2", 0))
    address = f"127.0.0.2:{s.getsockname()[1]}"
    s.close()  # nothing listens there now
    started = time.monotonic()
    path = _write(tmp_path, {**SHARED, "name": "nowhere", "engine": "batch"})
    assert main(["experiment", str(path), "--output", str(tmp_path / "out"), "--ray", address]) == 2
    err = capsys.readouterr().err
    assert f"No Ray cluster answers at '{address}'" in err and "ray start --head" in err
    assert time.monotonic() - started < 60 and not list((
        tmp_path / "out" / "nowhere" / "runs").iterdir())


def test_a_driver_waiting_on_long_units_still_prints_its_progress_line(capsys, tmp_path):
    """Off a terminal the progress is a plain line at the display's interval, also while a pool's
    units run for many minutes without reporting their rounds (every poll shows it; before, a
    line came only when a unit finished: none for half an hour on KDD Cup 99)."""
    from diff2_flwr.lab.study.scheduler import Progress, Tally, _Phase

    class Busy:  # a pool whose units are still running
        def completed(self, timeout):
            return []

    progress = Progress(5, enabled=True)
    progress._reporter.interval_s = 0.0  # a line at every show
    phase = _Phase(study=None, runs_dir=tmp_path, progress=progress, executor=Busy(),
                   book=None, tally=Tally())
    capsys.readouterr()
    phase.collect()
    phase.collect()
    lines = [line for line in capsys.readouterr().err.splitlines() if "runs 0/5" in line]
    assert len(lines) == 2
