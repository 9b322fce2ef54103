"""A data owner's live audit: canary records in its replies (through the real Diff2Client and NodeGuard), scored
from the iterates it received (``diff2 audit --live``), against a server that adds the declared noise and one that
adds less."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import numpy as np
import pytest

from diff2_flwr.core.canaries import CanaryFrame
from diff2_flwr.fl import protocol
from diff2_flwr.fl.client import Diff2Client
from diff2_flwr.lab.audit_live import LiveAuditError, live_audit
from diff2_flwr.runtime.config import parse_config
from diff2_flwr.runtime.node_guard import NodeGuard
from diff2_flwr.runtime.policy import NodePolicy, Refused, load_policy
from diff2_flwr.runtime.session import build_server, build_worker


def frame_math():
    frame = CanaryFrame(seed=7, count=6, dim=10)
    assert np.allclose(frame.directions @ frame.directions.T, np.eye(6))  # orthonormal
    assert sorted(frame.signs) == [-1, -1, -1, 1, 1, 1]
    return frame


def test_canary_records_are_b_records_at_the_radius_and_the_frame_is_the_seeds():
    frame = frame_math()
    mean = np.linspace(-1, 1, 10)
    added, n = frame.add(mean, 100, radius=0.5)
    records = [0.5 * s * u for s, u in zip(frame.signs, frame.directions)]
    assert n == 106 and np.allclose(added, (100 * mean + np.sum(records, axis=0)) / 106)
    assert all(np.isclose(np.linalg.norm(r), 0.5) for r in records)  # each exactly at the clipping radius
    again = CanaryFrame(seed=7, count=6, dim=10)
    assert np.array_equal(again.directions, frame.directions) and np.array_equal(again.signs, frame.signs)
    assert not np.allclose(CanaryFrame(seed=8, count=6, dim=10).directions, frame.directions)
    assert np.allclose(frame.project(frame.directions[2]), np.eye(6)[2])


@pytest.mark.parametrize("count, dim, match", [(3, 10, "even"), (12, 10, "at most the model's 10"),
                                               (0, 10, "even number >= 2")])
def test_a_frame_that_cannot_be_built_says_why(count, dim, match):
    with pytest.raises(ValueError, match=match):
        CanaryFrame(seed=1, count=count, dim=dim)


def config(epsilon: float = 3.0, **training):
    return parse_config({
        "name": "live", "method": "diff2",
        "dataset": {"name": "synthetic", "num_samples": 1800, "num_features": 8},
        "model": {"name": "paper_mlp", "hidden": 10},
        "privacy": {"epsilon": epsilon, "delta": 1e-5},
        "training": {"rounds": 13, "restart_every": 4, "clip_restart": 1.0, "clip_diff": 3.0, "learning_rate": 0.2,
                     "clients": 3, "seed": 11, **training},
        "evaluation": {"test_metrics": False},
    })


def policy(tmp_path, count=64) -> NodePolicy:
    path = tmp_path / "policy.yaml"
    path.write_text(f"max_epsilon: 3.0\nmax_delta: 1.0e-5\ncanaries:\n  count: {count}\n  state: canaries\n")
    return load_policy(path)


def run(tmp_path, server_epsilon: float, count: int = 64):
    """13 rounds of a server built for ``server_epsilon``, whose owners all hold the claimed ε = 3 config; owner
    0 adds canaries. The calls are the Flower strategy's and client's (protocol in between)."""
    claimed, served = config(), config(server_epsilon)
    server = build_server(served, record=False, progress=None)
    guard = NodeGuard.admit_run(claimed, node="node 1 (owner 0)", partition_id=0, run_id=42,
                                policy=policy(tmp_path, count), deployment=True)
    clients = [Diff2Client(build_worker(claimed, p), guard if p == 0 else None) for p in range(3)]
    while not server.done:
        plan = server.plan()
        arrays, ins = protocol.encode_task(plan, server.layout, server.n_min)
        replies = []
        for p, client in enumerate(clients):
            out, n, metrics = client.fit([a.copy() for a in arrays], dict(ins))
            replies.append(protocol.decode_reply(f"node {p}", out, n, metrics, plan.round))
        server.release(replies)
    return tmp_path / "canaries" / "run-42", server


def test_the_owners_folder_is_private_and_its_reply_carries_the_canary_records(tmp_path):
    folder, server = run(tmp_path, 3.0)
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(folder / "seed").st_mode) == 0o600
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["count"] == 64 and meta["num_samples"] == 480 and meta["n_min"] == 480 and meta["clients"] == 3
    rows = [json.loads(line) for line in (folder / "rounds.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == list(range(1, 14))
    assert [r["restart"] for r in rows] == [(r - 1) % 4 == 0 for r in range(1, 14)]
    # round r's row holds U x_(r-1): the iterates the server really released
    frame = CanaryFrame(int((folder / "seed").read_text()), 64, server.layout.dim)
    assert np.allclose(rows[-1]["projection"], frame.project(server.state.x_prev))


def test_a_server_adding_the_declared_noise_passes_and_the_noise_is_measured_near_one(tmp_path):
    folder, _ = run(tmp_path, 3.0)
    result = live_audit(folder)
    assert not result["violation"], result["findings"]
    assert result["rounds"] == {**result["rounds"], "run": 13, "tasks_seen": 13, "scored": 12}
    k = result["noise_scale"]
    assert k["interval"][0] <= 1.0 <= k["interval"][1] * 1.0 or k["interval"][0] > 1.0  # never below 1 but by chance
    assert 0.9 < k["estimate"] < 1.3  # the run's own updates only add spread
    assert result["mu_interval"][0] < result["mu_critical"]


def test_a_server_adding_less_noise_than_declared_is_caught_in_one_run(tmp_path):
    claimed = config().calibration(480)
    served = config(7.0).calibration(480)
    k_true = served.sigma1 / claimed.sigma1
    assert 0.4 < k_true < 0.6  # about half the declared noise
    folder, _ = run(tmp_path, 7.0)
    result = live_audit(folder)
    assert result["violation"] and "at most" in result["findings"][0]
    lower, upper = result["noise_scale"]["interval"]
    assert upper < 1.0 and lower <= k_true * 1.3 and k_true <= upper  # the truth, up to the updates' spread
    completed = subprocess.run([sys.executable, "-m", "diff2_flwr.cli", "audit", "--live", str(folder)],
                               capture_output=True, text=True, timeout=120)
    assert completed.returncode == 3, completed.stderr
    assert json.loads(completed.stdout)["violation"] is True and "VIOLATION" in completed.stderr


def test_a_node_that_audits_refuses_a_run_its_audit_cannot_read(tmp_path):
    for training, match in (({"routine": "adam"}, "routine 'adam'"),):
        with pytest.raises(Refused, match=match):
            NodeGuard.admit_run(config(**training), node="node 1", partition_id=0, run_id=1,
                                policy=policy(tmp_path), deployment=True)


def test_a_folder_without_canaries_or_with_one_task_is_refused_with_the_reason(tmp_path):
    with pytest.raises(LiveAuditError, match="expected a canary folder"):
        live_audit(tmp_path)
    folder, _ = run(tmp_path, 3.0)
    lines = (folder / "rounds.jsonl").read_text().splitlines()
    (folder / "rounds.jsonl").write_text(lines[0] + "\n")
    with pytest.raises(LiveAuditError, match="needs the tasks of rounds 1 and 2"):
        live_audit(folder)
