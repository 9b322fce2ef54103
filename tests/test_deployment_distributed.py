"""`privacy.noise: distributed` through Flower's SecAgg+ in a real deployment: native processes on
127.0.0.1 with TLS and SuperNode authentication (issue 23), against the in-process driver of the
same config."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from diff2_flwr.core.distributed import SkellamLedger
from diff2_flwr.deploy.native import run_local_deployment
from diff2_flwr.runtime.config import load_config
from diff2_flwr.runtime.driver import run_inprocess

pytestmark = [pytest.mark.flower, pytest.mark.deployment]

ROUNDS, RESTART_EVERY, CLIENTS = 3, 2, 3  # restart, difference, restart (4 SecAgg+ stages each)


def config(tmp_path: Path) -> Path:
    path = tmp_path / "dist.yaml"
    path.write_text(yaml.safe_dump({
        "name": "dist", "method": "diff2", "dataset": {"name": "synthetic", "num_samples": 900},
        # bits 20, tolerated 0: all P = 3 clients in every secure sum
        "privacy": {"noise": "distributed"},
        "training": {"rounds": ROUNDS, "restart_every": RESTART_EVERY, "clip_diff": 3.0,
                     "clients": CLIENTS,
                     # seeded: every client's noise share is client_rng(4, partition, round)
                     "seed": 4},
        "output": {"dir": str(tmp_path / "out")},
    }))
    return path


def rows(output_dir: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k != "elapsed_s"}
            for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def test_distributed_noise_completes_through_secaggplus_with_tls_and_node_auth(tmp_path):
    # seeded, to be checked bit for bit: the owners allow seeds (tests only)
    policy = tmp_path / "policy.yaml"
    policy.write_text(yaml.safe_dump({"name": "owner", "max_epsilon": 3.0, "max_delta": 1e-5,
                                      "allow_seeded": True,
                                      "noise": ["distributed"], "min_honest": CLIENTS}))
    result = run_local_deployment(config(tmp_path), tls=True, workdir=tmp_path / "work", echo=False,
                                  node_policy=policy)
    assert result.launch.status == "finished:completed"
    # TLS turns SuperNode authentication on: exactly the P registered keys are the nodes the
    # SuperLink knows
    assert result.node_auth and len(set(result.node_ids)) == CLIENTS
    assert sorted(int(n["node-id"]) for n in result.nodes) == sorted(result.node_ids)
    # the ServerApp's log (streamed by `flwr run`): it ran the rounds through SecAggPlusWorkflow
    shares = "[diff2] distributed noise: each of the P = 3 clients adds a Skellam share"
    assert shares in result.launch.log

    out = result.launch.output_dir
    deployed = rows(out)
    assert [r["round"] for r in deployed] == list(range(ROUNDS + 1))
    # every client's share in every secure sum
    assert all(r["survivors"] == CLIENTS for r in deployed[1:])

    summary = json.loads((out / "summary.json").read_text())
    privacy = summary["privacy"]
    assert summary["status"] == "completed" and privacy["noise"] == "distributed"
    assert privacy["calibration"]["bits"] == 20 and privacy["calibration"]["tolerated"] == 0
    # ε spent is the Skellam ledger of the rounds released, by their kind (restart or difference)
    reference = run_inprocess(load_config(result.config), record=False, progress=None)
    noise = reference.distributed
    ledger = SkellamLedger(privacy["delta"]).record(*(noise.event(r["kind"] == "restart")
                                                      for r in deployed[1:]))
    assert [r["kind"] for r in deployed[1:]] == ["restart", "difference", "restart"]
    assert privacy["epsilon_spent"] == ledger.epsilon == reference.epsilon_spent
    assert privacy["epsilon_spent"] == pytest.approx(privacy["calibration"]["epsilon_planned"],
                                                     rel=1e-12)
    assert privacy["epsilon_spent"] <= privacy["epsilon_target"] * (1 + 1e-9)

    # bit for bit the in-process driver's run: its secure sum adds the same seeded client messages
    np.testing.assert_array_equal(np.load(out / "final_parameters.npy"), reference.state.x)
    assert deployed == [{k: v for k, v in r.items() if k != "elapsed_s"} for r in reference.history]
    print(f"distributed deployment seconds per round: {result.round_seconds}")
