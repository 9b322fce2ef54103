"""Radius feedback (diff2_flwr.runtime.step_report) told from drowned noise, named as the caller
named the settings.

The detector on made-up rows (feedback, healthy, a streak broken, feedback across restarts, noise
that drowns without feedback); the gain g = η·C2·σ2·χ̄_d against the growth a real run shows; the
closing note's cause; and the issue's case end to end: scikit-learn's wine data with the
own-model tutorial's settings (clip_diff=3, learning_rate=0.5) through the Python API and through
an experiment file, each warned with its own names, and the settings the warning proposes learning.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import diff2_flwr
from diff2_flwr.core.privacy import calibrate, expected_noise_norm
from diff2_flwr.core.routines import GD, Adam
from diff2_flwr.runtime.config import ExperimentConfig, experiment_from_arguments, parse_config
from diff2_flwr.runtime.driver import run_inprocess
from diff2_flwr.runtime.noise_report import loss_rise, loss_rise_warning, noise_summary
from diff2_flwr.runtime.spec import ArgumentSource, key_namer
from diff2_flwr.runtime.step_report import (FEEDBACK_GROWTH, FEEDBACK_STEPS, GAIN_LIMIT, WATCH_ROWS,
                                            gain_target, gain_warning, names_of, radius_feedback,
                                            radius_steps, step_gain)
from diff2_flwr.runtime.workers import make_worker

API = key_namer(ExperimentConfig, ArgumentSource("diff2_flwr.make_strategy"))
YAML = key_namer(ExperimentConfig, "configs/mine.yaml")


def rows(radii: list[float], restart_every: int, losses: dict[int, float] | None = None) -> list:
    """A run's rows: round 0, then round r (from 1) restart or difference with the r-th radius."""
    out = [{"round": 0, "kind": "init", **({"test_loss": losses[0]} if losses else {})}]
    for r, radius in enumerate(radii, start=1):
        kind = "restart" if (r - 1) % restart_every == 0 else "difference"
        row = {"round": r, "kind": kind, "radius": radius}
        if losses and r in losses:
            row["test_loss"] = losses[r]
        out.append(row)
    return out


# ------------------------------------------------------------------------------ the detector

def test_geometric_growth_of_the_difference_radius_is_feedback():
    # T = 5: the wine run's radii (restart rounds carry C1 = 1)
    run = rows([1, 1.222, 5.449, 23.16, 94.44, 1, 1.136, 5.39], restart_every=5)
    assert radius_steps(run)[:3] == [(3, pytest.approx(4.459, abs=1e-3)),
                                     (4, pytest.approx(4.250, abs=1e-3)),
                                     (5, pytest.approx(4.078, abs=1e-3))]
    found = radius_feedback(run)
    assert found is not None and found.round == 5 and found.radius == 94.44
    assert found.growth == pytest.approx((5.449 / 1.222, 23.16 / 5.449, 94.44 / 23.16))
    assert found.per_round == pytest.approx((94.44 / 1.222) ** (1 / 3))
    # the round that completes the streak, not before: two steps are not enough
    assert radius_feedback(run[:5]) is None


def test_a_healthy_run_is_not_feedback():
    """Radii that wander (seeded factors 0.6-1.45, as the paper's runs at η <= 2 show) or shrink."""
    rng = np.random.default_rng(0)
    radius, radii = 0.4, []
    for _ in range(400):
        radius *= rng.uniform(0.6, 1.45)
        radii.append(radius)
    assert radius_feedback(rows(radii, restart_every=20)) is None
    assert radius_feedback(rows([1.0] + [0.5 * 0.9 ** k for k in range(30)], 40)) is None


def test_a_streak_broken_by_a_smaller_step_is_not_feedback():
    # steps 2, 2, 1.2, 2, 2: never three in a row
    radii = [1, 1, 2, 4, 4.8, 9.6, 19.2]
    assert [round(s, 3) for _, s in radius_steps(rows(radii, 10))] == [2, 2, 1.2, 2, 2]
    assert radius_feedback(rows(radii, 10)) is None
    assert radius_feedback(rows(radii + [38.4], 10)).round == 8


def test_feedback_that_comes_back_after_every_restart_is_found_across_restarts():
    """T = 3: one step per restart period; three periods in a row grow >= 1.5x each."""
    run = rows([1, 0.3, 3.0] * 4, restart_every=3)
    assert [r for r, _ in radius_steps(run)] == [3, 6, 9, 12]
    assert radius_feedback(run).round == 9
    assert radius_feedback(run[-WATCH_ROWS:]) is not None  # the tail the server watches holds it
    # T = 2: no difference round follows another, nothing to watch
    assert radius_feedback(rows([1, 5.0] * 10, restart_every=2)) is None


def test_radii_that_are_not_finite_or_zero_are_skipped():
    assert radius_steps(rows([1, 0.0, 1.0, math.inf, 2.0], restart_every=10)) == []


@pytest.mark.parametrize("step,found", [(FEEDBACK_GROWTH, True), (FEEDBACK_GROWTH * 0.999, False)])
def test_the_rule_is_three_steps_of_at_least_one_and_a_half(step, found):
    radii = [1.0] + [step ** k for k in range(FEEDBACK_STEPS + 1)]
    assert (radius_feedback(rows(radii, restart_every=50)) is not None) == found


# ------------------------------------------------------------------------------ the closing note

def test_a_loss_that_rose_with_feedback_names_the_cause_and_the_callers_arguments():
    run = rows([1, 1.222, 5.449, 23.16, 94.44], 5, losses={0: 0.93, 5: 11.7})
    rise = loss_rise(run)
    assert rise is not None and rise.feedback is not None and rise.feedback.round == 5
    assert rise.as_dict()["cause"] == "radius_feedback"
    noise = {"parameters": 275, "limit": 1.0, "restart": 0.731, "difference": 2.92}
    api = loss_rise_warning(rise, names=API, noise=noise)
    assert "Cause: radius feedback, the step fed its own noise" in api
    assert "lower learning_rate= or clip_diff=" in api and "restart_every=" in api
    assert "training." not in api and "drowned" not in api
    yaml = loss_rise_warning(rise, names=YAML, noise=noise)
    assert "lower training.learning_rate or training.clip_diff" in yaml


def test_a_loss_that_rose_without_feedback_is_drowned_noise_or_the_step():
    run = rows([1, 0.5, 0.45, 0.5, 0.4], 5, losses={0: 0.9, 5: 4.0})
    rise = loss_rise(run)
    assert rise is not None and rise.feedback is None and "cause" not in rise.as_dict()
    drowned = loss_rise_warning(rise, names=API, noise={"restart": 3.1, "difference": 0.8})
    assert "Cause: the noise drowned the signal" in drowned
    assert "raise epsilon=" in drowned and "(rounds=)" in drowned
    assert "lower learning_rate=" in drowned
    step = loss_rise_warning(rise, names=YAML, noise={"restart": 0.4, "difference": 0.8})
    assert "Cause: neither drowned noise" in step and "lower training.learning_rate" in step
    assert "drowned the signal (" not in step


# ------------------------------------------------------------------------------ the gain g

def test_the_gain_is_eta_c2_sigma2_chi_and_only_for_gd():
    cal = calibrate(epsilon=3.0, delta=1e-5, rounds=20, restart_every=5, u=1.25, n_min=47,
                    clients=3)
    gain = step_gain(cal, GD(0.5), 3.0, 275)
    assert gain.gain == pytest.approx(0.5 * 3.0 * expected_noise_norm(cal.sigma2, 275), rel=1e-12)
    assert gain.gain == pytest.approx(4.38, abs=0.01)  # the wine run's
    assert gain.per_round == pytest.approx(math.sqrt(1 + gain.gain ** 2))
    assert gain.per_period == pytest.approx(gain.per_round ** 3)  # T - 2 steps in a period
    assert step_gain(cal, Adam(0.5), 3.0, 275) is None  # Adam scales its steps otherwise
    assert step_gain(cal, GD(0.5), 3.0, 275, local=True) is None
    assert step_gain(None, GD(0.5), 3.0, 275) is None
    dpgd = calibrate(epsilon=3.0, delta=1e-5, rounds=20, restart_every=1, u=1.25, n_min=47,
                     clients=3)
    assert step_gain(dpgd, GD(0.5), 3.0, 275) is None  # no difference rounds


def test_the_gain_warning_names_the_callers_settings_and_values_that_meet_the_target():
    cal = calibrate(epsilon=3.0, delta=1e-5, rounds=20, restart_every=5, u=1.25, n_min=47,
                    clients=3)
    gain = step_gain(cal, GD(0.5), 3.0, 275)
    assert gain.target == gain_target(5) == pytest.approx(1 / math.sqrt(5))
    api = gain_warning(gain, API)
    assert api.startswith("the step will feed the noise (radius feedback): with learning_rate=0.5 "
                          "and clip_diff=3,")
    eta = 0.5 * gain.target / gain.gain
    assert f"set learning_rate={eta:.3g} or lower" in api and "restart_every=5" in api
    assert step_gain(cal, GD(eta), 3.0, 275).gain == pytest.approx(gain.target)
    assert "training." not in api
    assert "set training.learning_rate = 0.051 or lower" in gain_warning(gain, YAML)
    assert gain_warning(step_gain(cal, GD(0.5), 0.3, 275), API) is None  # g = 0.44 <= 1
    assert gain_target(100) == pytest.approx(0.1) and gain_target(2) == 0.5
    assert GAIN_LIMIT == 1.0


def test_names_follow_where_the_settings_came_from():
    given = dict(epsilon=3.0, delta=1e-5, rounds=4, restart_every=2, clients=3, n_min=10,
                 clip_restart=1.0, clip_diff=3.0, learning_rate=0.2, eval_every=2)
    api = experiment_from_arguments("diff2_flwr.make_strategy", given, method="diff2")
    assert isinstance(api.source, ArgumentSource) and api.source == "diff2_flwr.make_strategy"
    names = names_of(api)
    assert [names(k) for k in ("training.learning_rate", "privacy.epsilon", "evaluation.every")] \
        == ["learning_rate=", "epsilon=", "eval_every="]
    yaml = parse_config({"training": {"restart_every": 2}}, "configs/mine.yaml")
    assert names_of(yaml)("training.learning_rate") == "training.learning_rate"
    assert names_of(None)("training.clip_diff") == "training.clip_diff"


# ------------------------------------------------------------------------------ in a run

#: ε = 0.2 with the tutorial's step: g = 6.46, the radius grows ~6.5x per difference round.
FEEDING = {"name": "feeding", "method": "diff2",
           "dataset": {"name": "synthetic", "num_samples": 600},
           "privacy": {"epsilon": 0.2, "max_sigma": None},
           "training": {"rounds": 12, "restart_every": 3, "clients": 3, "seed": 1,
                        "learning_rate": 0.5, "clip_diff": 3.0}}


def test_the_gain_predicts_the_growth_a_run_shows():
    lines: list[str] = []
    server = run_inprocess(parse_config(FEEDING, "feeding.yaml"), record=False,
                           progress=lines.append)
    gain = server.run_info["radius_feedback"]
    sigma2, dim = server.calibration.sigma2, server.layout.dim
    assert gain["gain"] == pytest.approx(0.5 * 3.0 * expected_noise_norm(sigma2, dim), rel=1e-12)
    assert gain["gain"] == pytest.approx(6.46, abs=0.01) and gain["limit"] == GAIN_LIMIT
    steps = [s for _, s in radius_steps(server.history)]
    assert len(steps) == 4  # one per restart period
    # √(1 + g²) within 15 %: the noise sets the step
    assert all(abs(s / gain["per_round"] - 1) < 0.15 for s in steps), (steps, gain)
    assert gain["detected_at"] == 9
    said = [line for line in lines if "radius feedback" in line]
    assert said[0].startswith("[diff2] WARNING: the step will feed the noise")
    assert said[1].startswith("[diff2] WARNING: radius feedback, the step feeds the noise")
    assert lines.index(said[1]) == next(i for i, line in enumerate(lines)
                                        if line.startswith("[diff2] round 9/12")) + 1
    assert "set training.learning_rate = 0.0" in said[1]
    assert said[1].removeprefix("[diff2] WARNING: ") in server.summary()["warnings"]
    assert server.summary()["status"] == "completed"  # said, not stopped: the run is the same


# ------------------------------------------------------------------------------ the case

TUTORIAL = dict(epsilon=3.0, delta=1e-5, rounds=20, restart_every=5, clip_restart=1.0,
                clip_diff=3.0, learning_rate=0.5)


def _wine() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """scikit-learn's wine (178 x 13, 3 classes): a seeded 80/20 split, standardised on the train
    part."""
    datasets = pytest.importorskip("sklearn.datasets")
    x, y = datasets.load_wine(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(y))
    x, y = x[order], y[order]
    test = round(0.2 * len(y))
    mean, std = x[test:].mean(0), x[test:].std(0)
    return (x[test:] - mean) / std, y[test:], (x[:test] - mean) / std, y[:test]


def _tutorial_model() -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(13, 16), torch.nn.Tanh(),
                                   torch.nn.Linear(16, 3)).double()


def _cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(output, target, reduction="none")


def _wine_through_the_api(**settings) -> tuple[object, list[str]]:
    """The API's server and its workers, driven in-process (the calls the Flower Strategy makes)."""
    x, y, x_test, y_test = _wine()
    shards = np.array_split(np.arange(len(y)), 3)
    test = torch.from_numpy(x_test), torch.from_numpy(y_test)

    def evaluate(arrays):
        model = _tutorial_model()
        with torch.no_grad():
            for parameter, array in zip(model.parameters(), arrays):
                parameter.copy_(torch.from_numpy(array))
            return {"test_loss": float(_cross_entropy(model(test[0]), test[1]).mean())}

    lines: list[str] = []
    strategy = diff2_flwr.make_strategy(**settings, clients=3, n_min=min(map(len, shards)),
                                        model=_tutorial_model(), evaluate_fn=evaluate, seed=1,
                                        progress=lines.append)
    workers = [make_worker(model=_tutorial_model(), loss=_cross_entropy,
                           data=(torch.from_numpy(x[s]), torch.from_numpy(y[s])), partition_id=p)
               for p, s in enumerate(shards)]
    server = strategy.server
    while not server.done:
        plan = server.plan()
        server.release([w.reply(plan) for w in workers])
    return server, lines


def test_wine_with_the_tutorials_settings_is_told_radius_feedback_in_api_arguments():
    server, lines = _wine_through_the_api(**TUTORIAL)
    losses = [r["test_loss"] for r in server.history]
    assert losses[-1] > 10 * losses[0]  # the issue: 0.93 -> 90
    found = server.summary()["radius_feedback"]
    assert found["detected_at"] == 5 and found["gain"] == pytest.approx(4.38, abs=0.01)
    before, during, after = (line for line in lines if "radius feedback" in line)
    assert before.startswith("[diff2] WARNING: the step will feed the noise (radius feedback): "
                             "with learning_rate=0.5 and clip_diff=3,")
    assert after.startswith("[diff2] WARNING: the run completed but made the model worse")
    assert "Cause: radius feedback, the step fed its own noise" in after
    assert during.startswith("[diff2] WARNING: radius feedback, the step feeds the noise: the "
                             "difference rounds' radius C2·‖x_(r-1) - x_(r-2)‖ grew 4.46×, "
                             "4.25×, 4.08× per round")
    for line in (before, during):
        assert "set learning_rate=0.051 or lower, or clip_diff=0.306 or lower" in line
        assert "training." not in line and "privacy." not in line
    assert "lower learning_rate= or clip_diff=" in after and "training." not in after


def test_wine_with_the_proposed_clip_diff_learns_without_a_warning():
    server, lines = _wine_through_the_api(**{**TUTORIAL, "clip_diff": 0.306})
    losses = [r["test_loss"] for r in server.history]
    assert losses[-1] < 0.25 * losses[0]  # 0.93 -> 0.11
    assert "detected_at" not in server.summary()["radius_feedback"]
    assert not [line for line in lines if "radius feedback" in line or "worse" in line]


def test_wine_from_an_experiment_file_is_told_in_its_keys(tmp_path):
    x, y, x_test, y_test = _wine()
    table = np.column_stack([np.vstack([x, x_test]), np.concatenate([y, y_test])])
    path = tmp_path / "wine.csv"
    header = ",".join([f"f{i}" for i in range(13)] + ["cultivar"])
    np.savetxt(path, table, delimiter=",", header=header, comments="", fmt="%.10g")
    cfg = parse_config({
        "name": "wine", "method": "diff2",
        "dataset": {"name": "csv", "path": str(path), "target": "cultivar",
                    "task": "classification"},
        "model": {"name": "diff2_flwr.task.models:TanhMLP", "kwargs": {"hidden": 16},
                  "init_seed": 0, "loss": "cross_entropy"},
        "privacy": {"epsilon": TUTORIAL["epsilon"], "delta": TUTORIAL["delta"]},
        "training": {k: TUTORIAL[k] for k in ("rounds", "restart_every", "clip_restart",
                                              "clip_diff", "learning_rate")}
        | {"clients": 3, "seed": 1},
        "evaluation": {"train_metrics": False, "test_metrics": True}}, str(tmp_path / "wine.yaml"))
    lines: list[str] = []
    server = run_inprocess(cfg, record=False, progress=lines.append)
    assert "detected_at" in server.summary()["radius_feedback"]
    before, during, after = (line for line in lines if "radius feedback" in line)
    assert "Cause: radius feedback" in after and "lower training.learning_rate or " in after
    for line in (before, during):
        assert "set training.learning_rate = " in line and "training.clip_diff = " in line
        assert "learning_rate=" not in line
    assert server.summary()["noise_to_radius"] == noise_summary(server.calibration,
                                                                 server.layout.dim)


def test_an_absurd_step_predicts_an_infinite_growth_instead_of_failing():
    from diff2_flwr.runtime.step_report import StepGain

    gain = StepGain(gain=1e200, learning_rate=1e200, clip_diff=1.0, sigma2=1.0, dim=10,
                    restart_every=6)
    assert gain.per_round == pytest.approx(1e200) and gain.per_period == float("inf")
