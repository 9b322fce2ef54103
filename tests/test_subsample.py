"""`dataset.train_samples`: a deterministic uniform random subset of the train split, before
sharding.

Size, determinism, subset of (and nested in) the full train split, the test split unchanged, n_min
and the shards following, the errors, every dataset loader, and the places that identify or report
the data (study run ids, the cluster's data digest and cache, shard files, the run's and the study's
summaries).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from diff2_flwr.core.privacy import calibrate
from diff2_flwr.runtime.config import ConfigError, parse_config
from diff2_flwr.runtime.session import load_data
from diff2_flwr.task.data import DataError, prepare, subsample

from test_data import _write_cal, _write_gas
from test_datasets_more import write_kdd


def _ids(n: int = 1003, features: int = 3, seed: int = 5) -> tuple[np.ndarray, np.ndarray]:
    """Raw data whose first column is the row number, so that prepared rows can be traced back."""
    rng = np.random.default_rng(seed)
    x = np.column_stack([np.arange(n, dtype=float), rng.standard_normal((n, features - 1))])
    return x, rng.standard_normal(n) + 3.0


def _rows(data, split: str = "train") -> np.ndarray:
    """The original row numbers of a prepared split (undoing the standardisation)."""
    x = getattr(data, f"x_{split}")
    return np.rint(x[:, 0] * data.feature_std[0] + data.feature_mean[0]).astype(int)


def _cfg(dataset: dict, clients: int = 4, source: str = "sub.yaml", **sections):
    return parse_config({"method": "dpgd", "dataset": dataset, "training": {"clients": clients,
                                                                            "rounds": 10},
                         **sections}, source)


def test_size_subset_and_test_split_unchanged():
    x, y = _ids()
    full = prepare("synthetic", x, y, clients=4)
    sub = prepare("synthetic", x, y, clients=4, train_samples=301, subsample_seed=3)
    assert len(sub.y_train) == 301 and sub.x_train.shape == (301, 3) and sum(sub.shard_sizes) == 301
    assert sub.train_available == len(full.y_train) == 802 and sub.subsample_seed == 3
    assert full.train_available is None and full.subsample_seed is None
    rows = _rows(sub)
    # distinct records of the full train split
    assert len(set(rows)) == 301 and set(rows) <= set(_rows(full))
    # the kept records keep their order in the (already shuffled) train split
    position = {r: i for i, r in enumerate(_rows(full))}
    assert np.all(np.diff([position[r] for r in rows]) > 0)
    # the test split holds the same records, and the targets the same values (scale of the whole
    # dataset)
    np.testing.assert_array_equal(_rows(sub, "test"), _rows(full, "test"))
    np.testing.assert_array_equal(sub.y_test, full.y_test)
    assert sub.target_scale == full.target_scale == np.max(np.abs(y))
    np.testing.assert_allclose(sub.x_test * sub.feature_std + sub.feature_mean,
                               full.x_test * full.feature_std + full.feature_mean, rtol=0,
                               atol=1e-12)
    # the kept records are the training set: their own statistics standardise the features
    np.testing.assert_allclose(sub.x_train.mean(axis=0), 0.0, atol=1e-12)
    np.testing.assert_allclose(sub.x_train.std(axis=0), 1.0, atol=1e-12)
    np.testing.assert_allclose(sub.y_train, y[rows] / full.target_scale, rtol=0, atol=0)


def test_deterministic_by_seed_nested_and_the_whole_split_is_no_subsample():
    x, y = _ids()
    a = prepare("synthetic", x, y, clients=4, train_samples=200, subsample_seed=1)
    b = prepare("synthetic", x, y, clients=4, train_samples=200, subsample_seed=1)
    c = prepare("synthetic", x, y, clients=4, train_samples=200, subsample_seed=2)
    for name in ("x_train", "y_train", "x_test", "y_test"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert set(_rows(a)) != set(_rows(c))
    bigger = prepare("synthetic", x, y, clients=4, train_samples=500, subsample_seed=1)
    # one seed: the smaller subset is inside the larger one
    assert set(_rows(a)) < set(_rows(bigger))
    full = prepare("synthetic", x, y, clients=4)
    whole = prepare("synthetic", x, y, clients=4, train_samples=802)
    for name in ("x_train", "y_train", "x_test", "y_test", "feature_mean", "feature_std"):
        np.testing.assert_array_equal(getattr(whole, name), getattr(full, name))
    assert whole.shard_bounds == full.shard_bounds


def test_every_record_is_equally_likely_to_be_kept():
    """Uniform: over 4,000 seeds each of 50 records is kept in 30 % of the subsets (binomial sd
    0.0072)."""
    counts = np.zeros(50)
    for seed in range(4000):
        kept = subsample(50, 15, seed)
        assert len(kept) == 15 and len(set(kept)) == 15 and kept.min() >= 0 and kept.max() < 50
        counts[kept] += 1
    freq = counts / 4000
    assert np.max(np.abs(freq - 0.3)) < 5 * math.sqrt(0.3 * 0.7 / 4000)
    # and not one fixed subset: its first records are not favoured
    assert abs(freq[:15].mean() - 0.3) < 0.02


def test_shards_and_n_min_follow_the_subsample():
    x, y = _ids()
    sub = prepare("synthetic", x, y, clients=4, train_samples=403)
    assert sub.shard_sizes == (101, 101, 101, 100) and sub.n_min == 100
    sized = prepare("synthetic", x, y, clients=4, train_samples=100,
                    partitioner={"name": "size", "sizes": (10, 20, 30, 40)})
    assert sized.shard_sizes == (10, 20, 30, 40)
    cfg = _cfg({"name": "synthetic", "num_samples": 1000, "train_samples": 403})
    data = load_data(cfg)
    assert data.shard_sizes == (101, 101, 101, 100)
    cal = cfg.calibration(data.n_min)
    assert cal.sigma1 == calibrate(epsilon=3.0, delta=1e-5, rounds=10, restart_every=1, u=1.25,
                                   n_min=100, clients=4, mode="exact").sigma1


@pytest.mark.parametrize("changes, match", [
    ({"train_samples": 50.5},
     r"sub.yaml: key `dataset.train_samples`: expected an integer or null. Found 50.5"),
    ({"train_samples": "100"}, r"key `dataset.train_samples`: expected an integer or null"),
    ({"train_samples": True}, r"key `dataset.train_samples`: expected an integer or null"),
    ({"train_samples": 0}, r"key `dataset.train_samples`: expected null .* or an integer >= 1"),
    ({"train_samples": 3},
     r"sub.yaml: key `dataset.train_samples`: expected at least training.clients × "
                           r"dataset.partitioner.min_samples = 4 × 1 = 4 records.*Found 3"),
    ({"train_samples": 30, "partitioner": {"name": "iid", "min_samples": 10}},
     r"at least training.clients × dataset.partitioner.min_samples = 4 × 10 = 40 records"),
    ({"subsample_seed": -1}, r"key `dataset.subsample_seed`: expected an integer >= 0. Found -1"),
])
def test_bad_values_are_refused_naming_the_key_and_the_file(changes, match):
    with pytest.raises(ConfigError, match=match):
        _cfg({"name": "synthetic", "num_samples": 1000, **changes})


def test_more_records_than_the_train_split_names_the_key_the_file_and_both_numbers():
    cfg = _cfg({"name": "synthetic", "num_samples": 1000, "train_samples": 801},
               source="configs/x.yaml")
    with pytest.raises(DataError,
                       match=r"^configs/x.yaml: `dataset.train_samples` = 801 is more than the "
                             r"800 records in the train split of dataset 'synthetic'. Use at most "
                             r"800, or null"):
        load_data(cfg)
    with pytest.raises(DataError, match=r"`dataset.train_samples` must be an integer"):
        subsample(10, 2.0, 0)  # type: ignore[arg-type]


def _loader_cases(tmp_path: Path) -> dict[str, tuple[dict, int]]:
    """Each loader's dataset section on files written here, and the records of its train split."""
    _write_cal(tmp_path, [",".join(str(float(i * 9 + j)) for j in range(9)) for i in range(50)])
    _write_gas(tmp_path, rows_per_year=10)
    write_kdd(tmp_path, n=80)
    csv = tmp_path / "any.csv"
    csv.write_text("a,b,t\n" + "\n".join(f"{i},{i % 7},{i * 0.5}" for i in range(40)) + "\n")
    d = str(tmp_path)
    return {"california_housing": ({"name": "california_housing", "dir": d}, 40),
            "gas_turbine": ({"name": "gas_turbine", "dir": d}, 40),
            "kddcup99": ({"name": "kddcup99", "dir": d}, 64),
            "csv": ({"name": "csv", "path": str(csv), "target": "t", "task": "regression"}, 32),
            "synthetic": ({"name": "synthetic", "num_samples": 50}, 40)}


@pytest.mark.parametrize("name", ["california_housing", "gas_turbine", "kddcup99", "csv",
                                  "synthetic"])
def test_every_loader_subsamples_its_train_split(tmp_path, name):
    dataset, available = _loader_cases(tmp_path)[name]
    full = load_data(_cfg(dataset))
    assert len(full.y_train) == available
    sub = load_data(_cfg({**dataset, "train_samples": 12}))
    assert len(sub.y_train) == 12 and sub.shard_sizes == (3, 3, 3,
                                                          3) and sub.train_available == available
    np.testing.assert_array_equal(sub.y_test, full.y_test)
    # each kept (features, target) record is one of the full train split's, in raw units
    raw = lambda d: np.column_stack([d.x_train * d.feature_std + d.feature_mean,
                                     d.y_train])  # noqa: E731
    full_rows = {tuple(np.round(r, 6)) for r in raw(full)}
    assert all(tuple(np.round(r, 6)) in full_rows for r in raw(sub))
    with pytest.raises(DataError,
                       match=rf"`dataset.train_samples` = {available + 1} is more than the "
                             rf"{available} "):
        load_data(_cfg({**dataset, "train_samples": available + 1}))


def test_the_subsample_is_part_of_what_identifies_the_data(tmp_path):
    from diff2_flwr.lab.study.cluster import data_digest, unit_data
    from diff2_flwr.lab.study.runner import parse_study
    from diff2_flwr.lab.study.plan import run_id as _run_id
    from diff2_flwr.runtime.checkpoint import config_fingerprint
    from diff2_flwr.runtime.shard_files import data_fingerprint

    base = {"name": "synthetic", "num_samples": 1000}
    cfgs = [_cfg(base), _cfg({**base, "train_samples": 400}), _cfg({**base, "train_samples": 400,
                                                                    "subsample_seed": 1}),
            _cfg({**base, "train_samples": 300})]
    for ident in (lambda c: data_digest(unit_data(c)), data_fingerprint,
                  lambda c: config_fingerprint(c.to_dict(), 100)):
        values = [ident(c) for c in cfgs]
        assert len(set(values)) == len(values)
    # the cache keeps them apart
    assert [len(unit_data(c).y_train) for c in cfgs] == [800, 400, 400, 300]
    # without a subsample the fingerprints are those of the files and checkpoints written before the
    # keys existed
    plain = cfgs[0].to_dict()
    assert plain["dataset"]["train_samples"] is None
    for key in ("train_samples", "subsample_seed"):
        del plain["dataset"][key]
    assert config_fingerprint(plain, 100) == config_fingerprint(cfgs[0].to_dict(), 100)

    def study(dataset):
        return parse_study({"name": "s", "dataset": dataset, "rounds": 5, "epsilons": [3.0],
                            "seeds": {"tune": [0], "evaluate": [1, 2]},
                            "analysis": {"protocol": "paper"}, "clients": 4,
                            "methods": [{"name": "DP-GD", "method": "dpgd",
                                         "grid": {"learning_rate": [0.1]}}]})

    ids = {_run_id("tune", s.methods[0], {"learning_rate": 0.1}, 3.0, 0, s)
           for s in (study(base), study({**base, "train_samples": 400}),
                     study({**base, "train_samples": 300}))}
    assert len(ids) == 3


def test_the_run_and_the_study_report_the_subsample(tmp_path):
    from diff2_flwr.lab.study.runner import parse_study, run_study
    from diff2_flwr.runtime.driver import run_inprocess

    lines: list[str] = []
    dataset = {"name": "synthetic", "num_samples": 1000, "train_samples": 400, "subsample_seed": 2}
    server = run_inprocess(_cfg(dataset, output={"dir": str(tmp_path / "runs")}),
                           progress=lines.append)
    assert any(
        "400 train samples (dataset.train_samples: a uniform random subsample of the 800 in the "
        "train split, subsample_seed 2), sizes [100, 100, 100, 100]" in line for line in lines)
    summary = json.loads((server.recorder.directory / "summary.json").read_text())
    assert summary["dataset"]["train"] == 400 and summary["dataset"]["train_samples"] == 400
    assert summary["dataset"]["train_available"] == 800 and summary["dataset"][
        "subsample_seed"] == 2
    assert summary["config"]["dataset"]["train_samples"] == 400
    study = parse_study({"name": "s", "dataset": dataset, "rounds": 4, "epsilons": [3.0],
                         "clients": 4,
                         "seeds": {"tune": [0], "evaluate": [1, 2]},
                         "analysis": {"protocol": "paper"}, "eval_every": 2,
                         "methods": [{"name": "DP-GD", "method": "dpgd",
                                      "grid": {"learning_rate": [0.1]}}]})
    out = run_study(study, output_root=tmp_path / "studies", show_progress=False, make_plots=False)
    info = out["dataset"]
    assert (info["train"], info["test"], info["shard_sizes"]) == (400, 200, [100, 100, 100, 100])
    assert (info["train_samples"], info["train_available"], info["subsample_seed"]) == (400, 800, 2)
    assert info["parameters"] == 8 * 10 + 10 + 10 + 1 and info["settings"] == dataset
    report = (tmp_path / "studies" / "s" / "report.md").read_text()
    assert ("(n = 400 training records: a uniform subsample (`train_samples`, seed 2) of the "
            "train split's 800") in report


def test_dataset_standardise_is_one_declaration_and_leaves_earlier_files_matching():
    """`dataset.standardise` (added after checkpoints and shard files existed): false keeps the raw
    features, null (its default) standardises as before; at null every fingerprint is the one of a
    config without the key."""
    from diff2_flwr.runtime.checkpoint import config_fingerprint
    from diff2_flwr.runtime.config import config_keys
    from diff2_flwr.runtime.shard_files import data_fingerprint

    base = {"name": "synthetic", "num_samples": 1000}
    default, raw = _cfg(base), _cfg({**base, "standardise": False})
    scaled, kept = load_data(default), load_data(raw)
    np.testing.assert_allclose(scaled.x_train.mean(axis=0), 0, atol=1e-12)
    np.testing.assert_allclose(scaled.x_train.std(axis=0), 1, atol=1e-12)
    assert np.abs(kept.x_train.mean(axis=0)).max() > 1e-3  # the generator's features, as they came
    mean, std = scaled.feature_mean, scaled.feature_std
    # same records, same order
    np.testing.assert_allclose((kept.x_train - mean) / std, scaled.x_train, atol=1e-12)
    assert default.dataset.standardise is None
    assert _cfg({**base, "standardise": True}).dataset.standardise is True
    with pytest.raises(ConfigError, match=r"key `dataset.standardise`: expected"):
        _cfg({**base, "standardise": "yes"})
    # --set, Flower's run config (pyproject.toml is checked equal)
    assert "dataset.standardise" in config_keys()
    without = default.to_dict()
    del without["dataset"]["standardise"]
    assert config_fingerprint(without, 100) == config_fingerprint(default.to_dict(), 100)
    assert config_fingerprint(raw.to_dict(), 100) != config_fingerprint(default.to_dict(), 100)
    assert data_fingerprint(raw) != data_fingerprint(default)
