"""End to end through `flwr run` (a real Flower simulation on a private local SuperLink)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import yaml

import numpy as np

from diff2_flwr.runtime.config import load_config
from diff2_flwr.runtime.driver import run_inprocess
from diff2_flwr.runtime.launch import SimulationFailed, run_simulation

pytestmark = pytest.mark.flower

ROUNDS = 10


def write_config(tmp_path: Path, name: str, **overrides) -> Path:
    cfg = {
        "name": name,
        "method": "diff2",
        "dataset": {"name": "synthetic", "num_samples": 3000},
        "privacy": {"epsilon": 3.0, "delta": 1e-5},
        "training": {"rounds": ROUNDS, "restart_every": 3, "clip_restart": 1.0, "clip_diff": 3.0,
                     "learning_rate": 0.2, "clients": 3, "seed": 11},
        "output": {"dir": str(tmp_path / "out")},
    }
    for section, values in overrides.items():
        cfg[section] = {**cfg.get(section, {}), **values} if isinstance(values, dict) else values
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def read_run(result) -> tuple[list[dict], dict]:
    assert result.output_dir is not None and result.output_dir.is_dir()
    rows = [json.loads(line)
            for line in (result.output_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((result.output_dir / "summary.json").read_text())
    return rows, summary


def check_completed_run(rows: list[dict], summary: dict, epsilon: float) -> None:
    assert [r["round"] for r in rows] == list(range(ROUNDS + 1))
    assert [r["kind"] for r in rows[1:]] == (["restart", "difference", "difference"] * 4)[:ROUNDS]
    assert summary["status"] == "completed" and summary["rounds_released"] == ROUNDS
    assert rows[-1]["train_loss"] < rows[0]["train_loss"]
    assert rows[-1]["test_loss"] < rows[0]["test_loss"]
    spent = [r["epsilon_spent"] for r in rows[1:]]
    assert spent == sorted(spent) and spent[-1] == pytest.approx(epsilon, rel=1e-6)
    assert summary["privacy"]["epsilon_spent"] == pytest.approx(epsilon, rel=1e-6)
    assert all(r["noise_std"] > 0 for r in rows[1:])
    # not covered by ε: withheld unless evaluation.clip_stats
    assert not any("clip_fraction" in r for r in rows)


def test_synthetic_simulation_completes_learns_and_is_reproducible(tmp_path):
    config = write_config(tmp_path, "synthetic")
    first = run_simulation(str(config), echo=False)
    second = run_simulation(str(config), echo=False)
    rows1, summary1 = read_run(first)
    rows2, _ = read_run(second)
    check_completed_run(rows1, summary1, 3.0)
    assert first.output_dir != second.output_dir
    strip = lambda rows: [{k: v for k,
                           v in r.items() if k != "elapsed_s"} for r in rows]  # noqa: E731
    assert strip(rows1) == strip(rows2)  # same seed -> same per-round metrics, bit for bit
    assert summary1["privacy"]["noise_key"].startswith("seed")
    # the in-process driver runs the same code without transport: the same trajectory, bit for bit
    server = run_inprocess(load_config(config), record=False, progress=None)
    flower_x = np.load(first.output_dir / "final_parameters.npy")
    np.testing.assert_array_equal(server.state.x, flower_x)
    assert [{k: v for k,
             v in r.items() if k != "elapsed_s"} for r in server.history] == strip(rows1)


def test_california_housing_simulation(tmp_path, data_dir):
    config = write_config(tmp_path, "california", dataset={"name": "california_housing",
                                                           "dir": str(data_dir)},
                          training={"learning_rate": 0.5, "clip_diff": 1.0})
    rows, summary = read_run(run_simulation(str(config), echo=False))
    check_completed_run(rows, summary, 3.0)
    assert summary["dataset"]["train"] == 16512 and min(summary["dataset"][
        "shard_sizes"]) == summary["privacy"]["n_min"]


def test_a_run_that_cannot_start_is_reported_as_failed(tmp_path):
    # n_min declared larger than the smallest shard: the server refuses to calibrate for it
    config = write_config(tmp_path, "bad", privacy={"n_min": 10_000})
    with pytest.raises(SimulationFailed, match=r"n_min"):
        run_simulation(str(config), echo=False)


def test_a_model_that_cannot_fit_the_memory_budget_is_refused_before_round_1(tmp_path):
    config = write_config(tmp_path, "too-big",
                          model={"name": "diff2_flwr.task.models:TanhMLP",
                                 "kwargs": {"hidden": 64}},
                          training={"memory_budget_mb": 0.0001})
    with pytest.raises(SimulationFailed) as caught:
        run_simulation(str(config), echo=False)
    assert ("training.memory_budget_mb: one sample of a restart round needs "
            in str(caught.value))
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").rglob("metrics.jsonl"))


def test_a_study_through_the_flower_engine_equals_the_batch_engine(tmp_path):
    from diff2_flwr.lab.study.runner import parse_study, run_study

    data = {"name": "tiny", "dataset": {"name": "synthetic", "num_samples": 600}, "clients": 3,
            "rounds": 4,
            "epsilons": [3.0], "eval_every": 2, "seeds": {"tune": [5], "evaluate": [1, 2]},
            "analysis": {"protocol": "paper"},
            # a routine, and a grid point on one of its parameters: the flower engine must honour
            # both
            "methods": [{"name": "DIFF2-GD", "method": "diff2", "routine": "adam",
                         "grid": {"restart_every": [2], "learning_rate": [0.02], "clip_diff": [3.0],
                                  "beta1": [0.8]}}]}
    flower = run_study(parse_study({**data, "engine": "flower"}, "f.yaml"),
                       output_root=tmp_path / "f", show_progress=False, make_plots=False)
    batch = run_study(parse_study({**data, "engine": "batch"}, "b.yaml"),
                      output_root=tmp_path / "b", show_progress=False, make_plots=False)
    a = flower["epsilons"]["3.0"]["methods"]["DIFF2-GD"]["criteria"]
    b = batch["epsilons"]["3.0"]["methods"]["DIFF2-GD"]["criteria"]
    for c in ("train_loss", "grad_norm_sq", "test_loss"):
        assert a[c]["min_mean"] == pytest.approx(b[c]["min_mean"], rel=1e-9)
        assert a[c]["final_mean"] == pytest.approx(b[c]["final_mean"], rel=1e-9)


def test_server_crash_and_restart_resumes_the_same_trajectory(tmp_path):
    """Kill the ServerApp after round 4 (fault injection), run again: it resumes from the
    checkpoint. Under umask 022 the ServerApp (a process of Flower's) leaves the checkpoint, which
    holds the noise key, owner-only."""
    checkpoint = tmp_path / "private" / "state.npz"
    config = write_config(tmp_path, "crash", output={"dir": str(tmp_path / "out"),
                                                     "checkpoint": str(checkpoint)})
    saved = os.umask(0o022)
    try:
        with pytest.raises(SimulationFailed, match="fault injection"):
            run_simulation(str(config), echo=False, env={"DIFF2_FAULT_CRASH_AFTER_ROUND": "4"})
        assert stat.S_IMODE(checkpoint.stat().st_mode) == 0o600
        assert stat.S_IMODE(checkpoint.parent.stat().st_mode) == 0o700
        resumed = run_simulation(str(config), echo=False)
    finally:
        os.umask(saved)
    assert stat.S_IMODE(checkpoint.stat().st_mode) == 0o600
    assert "resumed from" in resumed.log and "after round 4" in resumed.log
    rows, summary = read_run(resumed)
    check_completed_run(rows, summary, 3.0)
    (tmp_path / "ref").mkdir()
    reference = run_inprocess(load_config(write_config(tmp_path / "ref", "crash")), record=False,
                              progress=None)
    np.testing.assert_array_equal(np.load(resumed.output_dir / "final_parameters.npy"),
                                  reference.state.x)
    strip = lambda rs: [{k: v for k, v in r.items() if k != "elapsed_s"} for r in rs]  # noqa: E731
    assert strip(rows) == strip(reference.history)
    assert summary["privacy"]["epsilon_spent"] == reference.epsilon_spent


ADAM_KEYS = {"training.clients": 2, "training.rounds": 4, "training.seed": 5,
             "training.routine.name": "adam",
             "training.routine.beta1": 0.8, "training.learning_rate": 0.02,
             "training.schedule.name": "step", "training.schedule.every": 2,
             "training.schedule.decay": 0.5, "evaluation.clip_stats": True}
LOCAL_KEYS = {"training.clients": 2, "training.rounds": 4, "training.seed": 5, "local.steps": 3,
              "local.batch_size": 64}


@pytest.mark.parametrize("keys", [ADAM_KEYS, LOCAL_KEYS], ids=["adam", "local-routine"])
def test_overridden_keys_reach_the_server_app_and_every_client_app(tmp_path, keys):
    """`--set` keys travel as Flower run-config keys: P, R, the seed, the routine and the step-size
    schedule change on both sides alike, and `flwr run` equals the in-process driver bit for bit:
    rows, final parameters and ε. With Adam the summary names the routine and the schedule; with
    ``local.steps`` a DIFF2 round is two Flower rounds (all P, then the chosen worker alone) and
    every row says which worker ran the local phase."""
    config = write_config(tmp_path, "over")
    result = run_simulation(str(config), echo=False, set_keys=keys)
    rows, summary = read_run(result)
    assert summary["status"] == "completed" and summary["rounds_released"] == 4
    assert len(summary["dataset"]["shard_sizes"]) == 2 and summary["config"]["training"][
        "seed"] == 5
    reference = run_inprocess(load_config(config, keys), record=False, progress=None)
    strip = lambda rs: [{k: v for k, v in r.items() if k != "elapsed_s"} for r in rs]  # noqa: E731
    assert strip(rows) == strip(reference.history)
    np.testing.assert_array_equal(np.load(result.output_dir / "final_parameters.npy"),
                                  reference.state.x)
    assert summary["privacy"]["epsilon_spent"] == reference.epsilon_spent <= 3.0
    if keys is ADAM_KEYS:
        assert summary["routine"] == {"name": "adam", "learning_rate": 0.02, "beta1": 0.8,
                                      "beta2": 0.999,
                                      "eps": 1e-8, "weight_decay": 0.0}
        assert summary["schedule"] == {"name": "step", "every": 2, "decay": 0.5}
        # clip statistics opted in through the run config: released, and warned about on the console
        # and in the summary
        assert all(0 <= r["clip_fraction"] <= 1 for r in rows[1:])
        assert "WARNING: evaluation.clip_stats is on" in result.log
        assert any(w.startswith("evaluation.clip_stats is on") for w in summary["warnings"])
    else:
        assert summary["config"]["local"]["steps"] == 3
        assert not any("clip_fraction" in r for r in rows)
        assert summary["privacy"]["calibration"]["local"]["batch_size"] == 64
        # one local phase per DIFF2 round
        assert result.log.count("configure_fit: strategy sampled 1 clients") == 4
        assert [r["local_worker"] for r in rows[1:]] == [r["local_worker"]
                                                         for r in reference.history[1:]]
        # seed 5 sends the local phase to both workers
        assert len({r["local_worker"] for r in rows[1:]}) == 2


def test_a_sampled_run_through_flwr_run_equals_the_in_process_driver(tmp_path):
    """training.sampling through the real ServerApp and ClientApps (issue 44): the strategy learns
    each SuperNode's partition once (get_properties), asks only each round's cohort, and the run
    equals the in-process driver bit for bit — rows (each naming its cohort), parameters and ε."""
    config = write_config(tmp_path, "sampled", training={"clients": 4, "sampling": {
        "kind": "fixed", "size": 2}})
    result = run_simulation(str(config), echo=False)
    rows, summary = read_run(result)
    assert summary["status"] == "completed" and summary["rounds_released"] == ROUNDS
    cohorts = [r["cohort"] for r in rows[1:]]
    assert all(len(c) == 2 for c in cohorts) and len({tuple(c) for c in cohorts}) > 2
    assert result.log.count("configure_fit: strategy sampled 2 clients") == ROUNDS
    reference = run_inprocess(load_config(config), record=False, progress=None)
    strip = lambda rs: [{k: v for k, v in r.items() if k != "elapsed_s"} for r in rs]  # noqa: E731
    assert strip(rows) == strip(reference.history)
    np.testing.assert_array_equal(np.load(result.output_dir / "final_parameters.npy"),
                                  reference.state.x)
    assert summary["privacy"]["epsilon_spent"] == reference.epsilon_spent <= 3.0


def test_a_poisson_sampled_run_with_empty_rounds_equals_the_in_process_driver(tmp_path):
    """Poisson sampling at q = 0.2 over 4 SuperNodes: some rounds draw nobody; the strategy releases
    them itself (their noise alone) and Flower skips them ("no clients selected"); the run still
    equals the in-process driver bit for bit."""
    config = write_config(tmp_path, "poisson", training={"clients": 4, "sampling": {
        "kind": "poisson", "rate": 0.2}})
    result = run_simulation(str(config), echo=False)
    rows, summary = read_run(result)
    assert summary["status"] == "completed" and summary["rounds_released"] == ROUNDS
    assert any(r["cohort"] == [] for r in rows[1:]) and any(r["cohort"] for r in rows[1:])
    assert "configure_fit: no clients selected" in result.log
    reference = run_inprocess(load_config(config), record=False, progress=None)
    strip = lambda rs: [{k: v for k, v in r.items() if k != "elapsed_s"} for r in rs]  # noqa: E731
    assert strip(rows) == strip(reference.history)
    np.testing.assert_array_equal(np.load(result.output_dir / "final_parameters.npy"),
                                  reference.state.x)
