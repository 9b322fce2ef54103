"""``privacy.noise: distributed`` end to end through `flwr run`: Flower's SecAgg+ carries the
clients' Skellam messages, the server decodes only their sum. A seeded run equals the in-process
driver bit for bit; a dropout within t is tolerated; one beyond t releases nothing."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from diff2_flwr.core.distributed import schedule_epsilon
from diff2_flwr.runtime.config import load_config
from diff2_flwr.runtime.driver import run_inprocess
from diff2_flwr.runtime.launch import SimulationFailed, run_simulation
from test_flower_e2e import ROUNDS, check_completed_run, read_run, write_config

pytestmark = pytest.mark.flower

DISTRIBUTED = {"epsilon": 3.0, "delta": 1e-5, "noise": "distributed"}


def test_a_distributed_run_goes_through_secagg_and_equals_the_inprocess_driver(tmp_path):
    config = write_config(tmp_path, "distributed", privacy=DISTRIBUTED)
    result = run_simulation(str(config), echo=False)
    rows, summary = read_run(result)
    check_completed_run(rows, summary, 3.0)
    assert "SecAgg+ sum" in result.log and "Secure aggregation completed" in result.log
    assert all(r["survivors"] == 3 for r in rows[1:])
    privacy = summary["privacy"]
    assert privacy["noise"] == "distributed" and "Skellam" in privacy["epsilon_accountant"]
    server = run_inprocess(load_config(config), record=False, progress=None)
    assert privacy["epsilon_spent"] == pytest.approx(schedule_epsilon(
        server.distributed.calibration.events(), 1e-5),
                                                      rel=1e-12)
    np.testing.assert_array_equal(np.load(result.output_dir / "final_parameters.npy"),
                                  server.state.x)
    assert [r["radius"] for r in rows[1:]] == [r["radius"] for r in server.history[1:]]


def test_a_dropout_within_t_is_tolerated_and_beyond_t_releases_nothing(tmp_path):
    env = {**os.environ, "DIFF2_FAULT_CLIENT_FAILS": "2:2"}  # partition 2 fails round 2
    tolerant = write_config(tmp_path, "tolerant", privacy={**DISTRIBUTED, "tolerated": 1})
    rows, summary = read_run(run_simulation(str(tolerant), echo=False, env=env))
    assert summary["status"] == "completed" and len(rows) == ROUNDS + 1
    # round 2's sum: the two survivors' shares
    assert [r["survivors"] for r in rows[1:4]] == [3, 2, 3]
    strict = write_config(tmp_path, "strict", privacy=DISTRIBUTED)
    with pytest.raises(SimulationFailed,
                       match=r"Round 2 released nothing: check 'secure-aggregation'"):
        run_simulation(str(strict), echo=False, env=env)
    (run_dir,) = (tmp_path / "out").glob("strict-*")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["rounds_released"] == 1
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 2  # x_0 and round 1 only
