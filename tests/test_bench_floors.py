"""diff2 bench's measured floors (issue 43): what is timed as the backend floor, and how the
protocol floor counts a study's rounds. No assertion here is about speed (the benchmark's job)."""

import json

import pytest
import torch

from diff2_flwr.lab.bench import floors
from diff2_flwr.lab.bench import runner as bench


class _Recorder:
    """A stand-in round backend: records what each round is given."""

    def __init__(self):
        self.calls = []

    def round(self, x, restart, radius, *, train, keep=True):
        self.calls.append((x.clone(), restart.clone(), radius.clone(), train, keep))


def _x(K=3, d=5):
    return torch.arange(K * d, dtype=torch.float64).reshape(K, d) / 7


def test_difference_rounds_alternate_between_two_nearby_iterates_after_one_restart():
    rec, x = _Recorder(), _x()
    floors.backend_seconds_per_round(None, None, x, dtype=torch.float64, accumulate="float64",
                                     difference=True, rounds=4, reps=2, backend=rec)
    first, *timed = rec.calls
    # the warm-up: a restart of every run at x (the pass the first difference round reads)
    assert torch.equal(first[0], x) and bool(first[1].all()) and first[3] is False
    assert len(timed) == 8
    other = timed[0][0]
    step = (other - x).abs().max().item()
    assert 0 < step < 10 * floors.STEP  # a step apart, not equal, not far
    for r, (xr, restart, radius, train, keep) in enumerate(timed):
        assert torch.equal(xr, other if r % 2 == 0 else x)  # never the same iterate twice running
        assert not bool(restart.any()) and keep is True and train is False
        assert torch.equal(radius, torch.ones(3, dtype=torch.float64))


def test_plain_rounds_restart_every_run_and_keep_no_pass():
    rec, x = _Recorder(), _x()
    radius = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64)
    floors.backend_seconds_per_round(None, None, x, dtype=torch.float64, accumulate="float64",
                                     difference=False, radius=radius, rounds=3, reps=1, backend=rec)
    assert len(rec.calls) == 1 + 3
    for _, restart, r, train, keep in rec.calls[1:]:
        assert bool(restart.all()) and keep is False and train is False and torch.equal(r, radius)


def test_the_floor_is_the_median_repetition_per_round(monkeypatch):
    clock = iter([0.0, 4.0, 10.0, 11.0, 20.0, 26.0])  # repetitions of 4, 1 and 6 s

    monkeypatch.setattr(floors.time, "perf_counter", lambda: next(clock))
    got = floors.backend_seconds_per_round(None, None, _x(), dtype=torch.float64,
                                           accumulate="float64", difference=False, rounds=2,
                                           reps=3, backend=_Recorder())
    assert got == pytest.approx(4.0 / 2)


def test_the_protocol_floor_counts_rounds_by_kind():
    records = [{"base_method": "gd", "point": {}}, {"base_method": "dpgd", "point": {}},
               {"base_method": "diff2", "point": {"restart_every": 4}},
               {"base_method": "diff2", "point": {"restart_every": 3}}]
    out = floors.protocol_floor(records, rounds=10, batch_size=4, workers=2, cores=8,
                                seconds={"restart": 0.8, "difference": 0.4})
    # GD and DP-GD: 10 restarts each; T = 4: rounds 0, 4, 8 restart; T = 3: 0, 3, 6, 9
    restarts, differences = 10 + 10 + 3 + 4, 7 + 6
    assert out["restart_configuration_rounds"] == restarts
    assert out["difference_configuration_rounds"] == differences
    assert out["cores"] == 2 and out["runs"] == 4
    assert out["ms_per_configuration_round"] == pytest.approx({"restart": 200.0,
                                                               "difference": 100.0})
    assert out["floor_s"] == pytest.approx((restarts * 0.2 + differences * 0.1) / 2)
    one = floors.protocol_floor(records, 10, 4, workers=2, cores=1,
                                seconds={"restart": 0.8, "difference": 0.4})
    assert one["cores"] == 1 and one["floor_s"] == pytest.approx(2 * out["floor_s"])


def test_the_protocol_floor_of_a_real_batched_study_runs_its_backend(tmp_path):
    """The runner's protocol floor on a small synthetic study: the real backend, the study's
    batch size, its counted rounds, and the target verdict."""
    path = tmp_path / "s.yaml"
    path.write_text(json.dumps({
        "name": "s", "dataset": {"name": "synthetic", "num_samples": 200}, "clients": 2,
        "rounds": 20, "delta": 1e-5, "epsilons": [3.0], "seeds": {"tune": [7], "evaluate": [1]},
        "engine": "batch", "analysis": {"protocol": "paper"}, "batch_size": 3, "dtype": "float32",
        "accumulate": "float32",
        "methods": [{"name": "DIFF2", "method": "diff2",
                     "grid": {"restart_every": [4], "learning_rate": [0.2], "clip_restart": [1.0],
                              "clip_diff": [0.5, 1.0]}}]}))
    study = bench.load_study(path)
    data, mlp = bench._study_data(study)
    records = [{"base_method": "diff2", "point": {"restart_every": 4}}] * 3
    out = bench._protocol_floor(study, data, mlp, records)
    assert out["batch_size"] == 3 and out["accumulate"] == "float32"
    assert out["restart_configuration_rounds"] == 3 * 5
    assert out["difference_configuration_rounds"] == 3 * 15
    assert out["floor_s"] > 0 and out["target_s"] == bench.PROTOCOL_TARGET_S == 60
    assert out["floor_allows_target"] is (out["floor_s"] <= 60)
