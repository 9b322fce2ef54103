"""Partitions of the train split (dataset.partitioner): IID unchanged, Flower Datasets' non-IID
partitioners with their properties, validation, and the refusal of shards too small for ε."""

from __future__ import annotations

import json
import re
import sys

import numpy as np
import pytest

from diff2_flwr.deploy.shards import write_shards
from diff2_flwr.runtime.config import ConfigError, parse_config
from diff2_flwr.runtime.driver import run_inprocess
from diff2_flwr.runtime.session import build_server, load_data
from diff2_flwr.runtime.shard_files import (
    SERVER_FILE, ShardError, read_server_data, read_shard, shard_name,
)
from diff2_flwr.runtime.shard_report import PartitionRefused
from diff2_flwr.task.data import DataError, prepare, synthetic_regression
from diff2_flwr.task.partitions import PartitionError, partition, quantile_bins

pytest.importorskip("flwr_datasets",
                    reason="the non-IID partitioners need the `partitions` extra "
                           "(scripts/setup.sh)")

N, P = 3000, 6


def labels(n: int = N, classes: int = 5, seed: int = 0) -> np.ndarray:
    """Balanced class labels in random order."""
    return np.random.default_rng(seed).permutation(np.arange(n) % classes).astype(np.float64)


def check_cover(parts: list[np.ndarray], n: int) -> None:
    """Disjoint shards that cover every index 0..n-1 exactly once."""
    placed = np.concatenate(parts)
    assert len(placed) == n
    np.testing.assert_array_equal(np.sort(placed), np.arange(n))


# ------------------------------------------------------------------ IID: today's shards, bit for
# bit

def _paper_prepare(x, y, clients, test_fraction=0.2, split_seed=0):
    """The preparation as it was before partitioners existed (the reference the IID default must
    equal)."""
    n = x.shape[0]
    n_test = int(round(test_fraction * n))
    target_scale = float(np.max(np.abs(y)))
    perm = np.random.default_rng(np.random.SeedSequence(split_seed,
                                                        spawn_key=(0x5B117,))).permutation(n)
    test, train = perm[:n_test], perm[n_test:]
    mean, std = x[train].mean(axis=0), x[train].std(axis=0)
    std = np.where(std > 0, std, 1.0)
    bounds, start = [], 0
    for size in (len(s) for s in np.array_split(np.arange(n - n_test), clients)):
        bounds.append((start, start + size))
        start += size
    return (x[train] - mean) / std, y[train] / target_scale, (x[test] - mean) / std, y[
        test] / target_scale, tuple(bounds)


@pytest.mark.parametrize("clients,split_seed", [(10, 0), (7, 3)])
def test_iid_default_is_bit_identical_to_the_paper_preparation(clients, split_seed):
    x, y = synthetic_regression(2003, 5, seed=1)
    want = _paper_prepare(x, y, clients, split_seed=split_seed)
    for spec in (None, {"name": "iid"}, {"name": "iid", "seed": 99}):
        got = prepare("s", x, y, clients=clients, split_seed=split_seed, partitioner=spec)
        for a, b in zip((got.x_train, got.y_train, got.x_test, got.y_test), want[:4]):
            assert a.tobytes() == b.tobytes()
        assert got.shard_bounds == want[4]


def test_default_config_loads_the_same_shards_as_an_explicit_iid_partitioner():
    base = {"dataset": {"name": "synthetic", "num_samples": 1500}, "training": {"restart_every": 2,
                                                                                "clients": 4}}
    plain = load_data(parse_config(base))
    explicit = load_data(parse_config({**base, "dataset": {**base["dataset"],
                                                           "partitioner": {"name": "iid"}}}))
    assert plain.shard_bounds == explicit.shard_bounds
    assert plain.x_train.tobytes() == explicit.x_train.tobytes()


def test_our_iid_cut_is_flower_datasets_iid_partitioner():
    from datasets import Dataset
    from flwr_datasets.partitioner import IidPartitioner

    flower = IidPartitioner(P)
    flower.dataset = Dataset.from_dict({"row": np.arange(N + 5)})
    for p, ours in enumerate(partition(np.zeros(N + 5), P)):
        np.testing.assert_array_equal(ours, flower.load_partition(p)["row"])


# ------------------------------------------------------------------ properties of each partitioner

SPECS = {
    "dirichlet": {"name": "dirichlet", "alpha": 0.3, "seed": 1},
    "pathological": {"name": "pathological", "classes_per_client": 2, "seed": 1},
    "linear": {"name": "linear"},
    "square": {"name": "square"},
    "size": {"name": "size", "sizes": (100, 200, 300, 400, 500, N - 1500)},
}


@pytest.mark.parametrize("task", ["classification", "regression"])
@pytest.mark.parametrize("which", sorted(SPECS))
def test_every_partitioner_cuts_disjoint_shards_covering_the_train_split_deterministically(which,
                                                                                           task):
    y = labels() if task == "classification" else np.random.default_rng(2).standard_normal(N)
    parts = partition(y, P, task=task, **SPECS[which])
    assert len(parts) == P and min(map(len, parts)) >= 1
    check_cover(parts, N)
    again = partition(y, P, task=task, **SPECS[which])
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))


@pytest.mark.parametrize("which", ["dirichlet", "pathological"])
def test_the_seed_changes_a_random_partition(which):
    y = labels()
    a = partition(y, P, task="classification", **{**SPECS[which], "seed": 1})
    b = partition(y, P, task="classification", **{**SPECS[which], "seed": 2})
    assert any(not np.array_equal(u, v) for u, v in zip(a, b))


def _dominant_share(parts: list[np.ndarray], y: np.ndarray) -> float:
    """Mean over clients of the share of the client's most frequent label."""
    return float(np.mean([np.bincount(y[idx].astype(int)).max() / len(idx) for idx in parts]))


def test_dirichlet_skew_grows_as_alpha_shrinks():
    y = labels(N, classes=5)
    skewed = partition(y, P, name="dirichlet", task="classification", alpha=0.1,
                       min_partition_size=10, seed=0)
    mild = partition(y, P, name="dirichlet", task="classification", alpha=1000.0, seed=0)
    # α = 0.1: a client is mostly one label; α = 1000: every client holds the 1/5 mix.
    assert _dominant_share(skewed, y) > 0.7
    assert _dominant_share(mild, y) < 0.25
    assert min(map(len, skewed)) >= 10  # Flower's min_partition_size is honoured


@pytest.mark.parametrize("k", [1, 2, 3])
def test_pathological_gives_each_client_exactly_k_classes(k):
    y = labels(N, classes=5)
    parts = partition(y, P, name="pathological", task="classification", classes_per_client=k,
                      seed=4)
    assert [len(np.unique(y[idx])) for idx in parts] == [k] * P


def test_pathological_on_a_regression_target_uses_k_quantile_bins_per_client():
    y = np.random.default_rng(3).standard_normal(N)
    parts = partition(y, P, name="pathological", task="regression", classes_per_client=2, bins=6,
                      seed=0)
    bins = quantile_bins(y, 6)
    assert all(len(np.unique(bins[idx])) == 2 for idx in parts)


def test_quantile_bins_hold_equal_counts_and_merge_tied_edges():
    y = np.random.default_rng(0).standard_normal(1000)
    assert np.bincount(quantile_bins(y, 10)).tolist() == [100] * 10
    # 60 % ties: the low edges coincide
    tied = np.array([0.0] * 600 + list(range(1, 401)), dtype=float)
    b = quantile_bins(tied, 10)
    assert len(np.unique(b)) < 10 and (b[:600] == b[0]).all()


def test_size_skewed_partitioners_follow_flower_shares():
    n = 1000
    for name, share in (("linear", np.arange(1, P + 1)), ("square", np.arange(1, P + 1) ** 2)):
        sizes = [len(idx) for idx in partition(np.zeros(n), P, name=name)]
        want = (share / share.sum() * n).astype(int)
        want[-1] += n - want.sum()
        assert sizes == want.tolist()


def test_the_test_split_and_standardisation_do_not_depend_on_the_partition():
    x, y = synthetic_regression(2000, 4, seed=0)
    iid = prepare("s", x, y, clients=P)
    skew = prepare("s", x, y, clients=P, partitioner={"name": "dirichlet", "alpha": 0.1, "seed": 0})
    np.testing.assert_array_equal(iid.x_test, skew.x_test)
    np.testing.assert_array_equal(iid.y_test, skew.y_test)
    np.testing.assert_array_equal(iid.feature_mean, skew.feature_mean)
    # same train rows, reordered
    np.testing.assert_array_equal(np.sort(iid.y_train), np.sort(skew.y_train))
    assert iid.shard_sizes != skew.shard_sizes and sum(skew.shard_sizes) == len(skew.y_train)
    # shard p is the contiguous block: its targets are the rows Dirichlet gave client p
    bins = quantile_bins(skew.y_train, P)  # the default: one bin per client
    assert _dominant_share([np.arange(a, b) for a, b in skew.shard_bounds], bins) > 0.5


# ------------------------------------------------------------------ refusals at partition time

def test_refusals_name_the_key_and_the_numbers():
    y = labels(N, classes=5)
    with pytest.raises(PartitionError,
                       match=r"classes_per_client` must be in 1\.\.5.*5 classes. Found 6"):
        partition(y, P, name="pathological", task="classification", classes_per_client=6)
    with pytest.raises(PartitionError,
                       match=rf"`sizes` must list {P} shard sizes.*{N} samples.*sum 10\)"):
        partition(y, P, name="size", sizes=(1, 2, 3, 1, 2, 1))
    with pytest.raises(PartitionError,
                       match=r"500 train samples in 10 shards .* leave shard\(s\) \[0, 1, 2, 3\] "
                             r"empty \(sizes \[0, 0, 0, 0, 2, 5, 15, 42, 116, 320\]\)"):
        partition(np.zeros(500), 10, name="exponential")
    with pytest.raises(PartitionError, match="alpha` must be a number > 0"):
        partition(y, P, name="dirichlet", task="classification", alpha=0.0)
    with pytest.raises(PartitionError, match=r"samples are on no client \(labels \[.*\]"):
        # random assignment with 2 clients x 1 class cannot cover 5 classes
        partition(y, 2, name="pathological", task="classification", classes_per_client=1,
                  class_assignment="random")
    with pytest.raises(PartitionError, match=r"Flower Datasets refused.*max number of attempts"):
        partition(y, P, name="dirichlet", task="classification", alpha=0.01, min_partition_size=490,
                  seed=0)


def test_a_missing_flower_datasets_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "flwr_datasets", None)
    with pytest.raises(PartitionError, match=r"pip install 'diff2-flwr\[partitions\]'"):
        partition(labels(), P, name="dirichlet", task="classification", alpha=1.0)
    assert len(partition(labels(), P)) == P  # IID needs no extra package


# ------------------------------------------------------------------ config validation

BASE = {"name": "part", "method": "diff2", "dataset": {"name": "synthetic", "num_samples": 2000},
        "training": {"rounds": 4, "restart_every": 2, "clip_diff": 3.0, "clients": 5, "seed": 1}}


def cfg_of(partitioner=None, dataset=None, training=None, privacy=None, **top):
    d = {**BASE["dataset"], **(dataset or {})}
    if partitioner is not None:
        d["partitioner"] = partitioner
    return parse_config({**BASE, **top, "dataset": d, "training": {**BASE["training"],
                                                                   **(training or {})},
                         "privacy": privacy or {}})


@pytest.mark.parametrize("partitioner,dataset,message", [
    ({"name": "zipf"}, {},
     r"`dataset.partitioner.name`: expected one of 'iid', 'dirichlet'.*Found 'zipf'"),
    ({"name": "dirichlet"}, {},
     r"`dataset.partitioner.alpha`: expected a finite number > 0.*Found None"),
    ({"name": "dirichlet", "alpha": 0}, {},
     r"`dataset.partitioner.alpha`: expected a finite number > 0.*Found 0"),
    ({"name": "dirichlet", "alpha": -1.5}, {}, r"alpha`.*Found -1.5"),
    ({"name": "iid", "alpha": 0.5}, {},
     r"`dataset.partitioner.alpha`: expected nothing for partitioner iid"),
    ({"name": "pathological"}, {},
     r"`dataset.partitioner.classes_per_client`: expected an integer >= 1"),
    ({"name": "pathological", "classes_per_client": 6}, {},
     r"`dataset.partitioner.classes_per_client`: expected at most the 5 target bins of dataset "
     r"synthetic \(dataset.partitioner.bins, null: one per client\). Found 6"),
    ({"name": "pathological", "classes_per_client": 5, "bins": 4}, {},
     r"at most the 4 target bins.*Found 5"),
    ({"name": "pathological", "classes_per_client": 3}, {"name": "kddcup99"},
     r"at most the 2 classes.*Found 3"),
    ({"name": "dirichlet", "alpha": 1, "bins": 5}, {"name": "covertype"},
     r"`dataset.partitioner.bins`: expected nothing for the classification dataset covertype"),
    ({"name": "dirichlet", "alpha": 1, "bins": 1}, {},
     r"`dataset.partitioner.bins`: expected null or an integer >= 2"),
    ({"name": "size", "sizes": [100, 200]}, {},
     r"`dataset.partitioner.sizes`: expected one size per client: "
                                                 r"training.clients = 5 sizes. Found \[100, 200\]"),
    ({"name": "size"}, {},
     r"`dataset.partitioner.sizes`: expected a list of training.clients shard sizes"),
    ({"name": "iid", "min_samples": 0}, {},
     r"`dataset.partitioner.min_samples`: expected an integer >= 1"),
    ({"name": "iid", "max_sigma": 0}, {},
     r"key `dataset.partitioner.max_sigma` has moved to `privacy.max_sigma` \(the same setting\): "
     r"write it there"),
    ({"name": "iid", "beta": 1}, {},
     r"unknown key dataset.partitioner.beta. Allowed in dataset.partitioner: name"),
    ("dirichlet", {}, r"`dataset.partitioner` must be a mapping"),
])
def test_config_validation_names_the_key_expectation_and_finding(partitioner, dataset, message):
    with pytest.raises(ConfigError, match=message):
        cfg_of(partitioner, dataset)


def test_config_round_trips_and_the_seed_defaults_to_the_split_seed():
    cfg = cfg_of({"name": "dirichlet", "alpha": 0.5}, {"split_seed": 7})
    assert parse_config(cfg.to_dict()) == cfg
    assert cfg.dataset.partitioner.arguments(7, "regression", 5) == {
        "name": "dirichlet", "seed": 7, "alpha": 0.5, "min_partition_size": 10,
        "self_balancing": False, "bins": 5}
    seeded = cfg_of({"name": "dirichlet", "alpha": 0.5, "seed": 3, "bins": 8}).dataset.partitioner
    assert seeded.arguments(7, "regression", 5)["seed"] == 3 and seeded.arguments(7, "regression",
                                                                                  5)["bins"] == 8
    assert "bins" not in seeded.arguments(7, "classification", 5)


# ------------------------------------------------------------------ printed before training,
# refused with numbers

def test_sizes_n_min_and_sigma_are_printed_before_training():
    lines: list[str] = []
    build_server(cfg_of({"name": "square"}), record=False, progress=lines.append)
    text = "\n".join(lines)
    data = load_data(cfg_of({"name": "square"}))
    assert f"sizes {list(data.shard_sizes)}" in text and "square" in text
    cal = cfg_of().calibration(data.n_min)
    assert f"n_min = {data.n_min} (client 0): σ1 = {cal.sigma1:.4g}, σ2 = {cal.sigma2:.4g}" in text
    assert "an IID split of the same 1600 samples would give n_min = 320" in text
    iid_lines: list[str] = []
    build_server(cfg_of(), record=False, progress=iid_lines.append)
    assert any("n_min = 320 (client 0)" in line for line in iid_lines)
    assert not any("an IID split" in line for line in iid_lines)
    # the lines come before round 0
    first_round = next(i for i, line in enumerate(lines) if "round 0/" in line)
    assert max(i for i, line in enumerate(lines) if "n_min =" in line) < first_round


def test_a_shard_below_min_samples_is_refused_naming_client_size_n_min_and_sigma():
    cfg = cfg_of({"name": "square", "min_samples": 50})
    sizes = load_data(cfg).shard_sizes  # square on 1600 samples, 5 clients: [29, 116, ...]
    cal = cfg.calibration(sizes[0])
    with pytest.raises(PartitionRefused) as err:
        build_server(cfg, record=False, progress=None)
    text = str(err.value)
    assert f"client 0 holds {sizes[0]}, so n_min = {sizes[0]} and σ1 = {cal.sigma1:.4g}" in text
    assert "min_samples = 50" in text and str(list(sizes)) in text


def test_a_partition_forcing_sigma_above_max_sigma_is_refused_and_null_lifts_the_limit():
    tight = {"epsilon": 0.05}
    cfg = cfg_of({"name": "square"}, privacy=tight, training={"rounds": 40, "restart_every": 4})
    with pytest.raises(PartitionRefused,
                       match=r"client 0 holds only \d+ samples; n_min = \d+ gives σ1 = .*above "
                                               r"privacy.max_sigma = 1"):
        build_server(cfg, record=False, progress=None)
    # the IID split of the same data has 11× more samples in its smallest shard and stays below the
    # limit
    build_server(cfg_of(privacy=tight, training={"rounds": 40, "restart_every": 4}), record=False,
                 progress=None)
    lifted = cfg_of({"name": "square"}, privacy={**tight, "max_sigma": None},
                    training={"rounds": 40, "restart_every": 4})
    assert build_server(lifted, record=False, progress=None).calibration.sigma2 > 1


def test_the_sigma_refusal_advises_what_helps_for_its_partition():
    """IID: n_min·P is about the records whatever P, so the advice is never "fewer clients" or "a
    milder skew" (issue 40); a skewed partition is told its own key; both name the threshold's key
    and what raising it means. (1600 records, P = 5: IID n_min·P = 1600.)"""
    tight = {"privacy": {"epsilon": 0.01}, "training": {"rounds": 40, "restart_every": 4}}
    with pytest.raises(PartitionRefused) as iid:
        build_server(cfg_of(**tight), record=False, progress=None)
    text = " ".join(str(iid.value).split())
    assert ("The partition is IID: n_min·P = 1600 is about the 1600 train records whatever P, so "
            "fewer clients do not lower σ; more records do") in text
    assert "milder skew" not in text and "Use fewer clients" not in text
    assert ("a larger privacy.epsilon or fewer training.rounds lower z, hence σ. Or raise "
            "privacy.max_sigma (null: no limit), the threshold of this check") in text
    with pytest.raises(PartitionRefused) as skewed:
        build_server(cfg_of({"name": "dirichlet", "alpha": 0.1, "seed": 0}, **tight),
                     record=False, progress=None)
    text = " ".join(str(skewed.value).split())
    assert re.search(r"This partition gives n_min·P = \d+; an IID split of the same 1600 records "
                     r"gives about 1600, so a milder skew \(a larger dataset.partitioner.alpha or "
                     r"min_partition_size\) lowers σ up to [\d.]+×", text), text
    # too few records per shard under IID: there, fewer clients do help
    with pytest.raises(PartitionRefused, match=r"The partition is IID \(shards of about 1600 / P "
                                               r"records\): fewer clients \(P <= 4\)"):
        build_server(cfg_of({"name": "iid", "min_samples": 400}), record=False, progress=None)


def test_an_in_process_run_on_a_skewed_partition_completes_with_smaller_n_min_and_larger_sigma(
    tmp_path):
    runs = {}
    for name, spec in (("iid", None), ("dirichlet", {"name": "dirichlet", "alpha": 0.1,
                                                     "seed": 0})):
        server = run_inprocess(cfg_of(spec), output_root=tmp_path / name, progress=None)
        runs[name] = json.loads((server.recorder.directory / "summary.json").read_text())
    iid, skew = runs["iid"], runs["dirichlet"]
    assert skew["status"] == iid["status"] == "completed"
    assert skew["privacy"]["n_min"] < iid["privacy"]["n_min"] == 320
    ratio = iid["privacy"]["n_min"] / skew["privacy"]["n_min"]
    for key in ("sigma1", "sigma2"):
        assert skew["privacy"]["calibration"][key] == pytest.approx(iid["privacy"]["calibration"][
            key] * ratio, rel=1e-12)
    assert skew["privacy"]["epsilon_spent"] == pytest.approx(iid["privacy"]["epsilon_spent"],
                                                             rel=1e-9)
    assert skew["dataset"]["shard_sizes"] != iid["dataset"]["shard_sizes"]
    assert skew["dataset"]["partitioner"].startswith("dirichlet(seed=0, alpha=0.1")


# ------------------------------------------------------------------ shard files for deployments

def test_shard_files_carry_the_partition_and_refuse_another_partition(tmp_path):
    cfg = cfg_of({"name": "pathological", "classes_per_client": 2},
                 evaluation={"train_metrics": False})
    write_shards(cfg, tmp_path)
    data = load_data(cfg)
    for p in range(5):
        shard = read_shard(tmp_path / shard_name(p, 5), cfg, p, 5)
        np.testing.assert_array_equal(shard.targets, data.shard(p)[1])
    assert read_server_data(tmp_path / SERVER_FILE, cfg).shard_sizes == data.shard_sizes
    iid = cfg_of(evaluation={"train_metrics": False})
    with pytest.raises(ShardError, match="other dataset settings"):
        read_shard(tmp_path / shard_name(0, 5), iid, 0, 5)


def test_shards_too_small_are_refused_before_files_are_written(tmp_path):
    cfg = cfg_of({"name": "square", "min_samples": 50})
    with pytest.raises(PartitionRefused, match="client 0 holds"):
        write_shards(cfg, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_data_time_partition_error_is_a_data_error_naming_the_dataset():
    cfg = cfg_of({"name": "size", "sizes": [1, 2, 3, 4, 5]})
    with pytest.raises(DataError,
                       match=r"Dataset 'synthetic': .*summing to the 1600 samples of the train "
                             r"split"):
        load_data(cfg)


@pytest.mark.flower
def test_a_flwr_run_on_a_skewed_partition_equals_the_in_process_run_bit_for_bit(tmp_path):
    """Every simulation actor cuts the same Dirichlet shards as the in-process driver."""
    import yaml

    from diff2_flwr.runtime.config import load_config
    from diff2_flwr.runtime.launch import run_simulation

    path = tmp_path / "skew.yaml"
    path.write_text(yaml.safe_dump({
        "name": "skew", "method": "diff2",
        "dataset": {"name": "synthetic", "num_samples": 3000, "partitioner": {"name": "dirichlet",
                                                                              "alpha": 0.1}},
        "training": {"rounds": 4, "restart_every": 2, "clip_diff": 3.0, "clients": 4, "seed": 3},
        "output": {"dir": str(tmp_path / "out")}}))
    result = run_simulation(str(path), echo=False)
    summary = json.loads((result.output_dir / "summary.json").read_text())
    cfg = load_config(path)
    data = load_data(cfg)
    assert summary["status"] == "completed"
    assert summary["dataset"]["shard_sizes"] == list(data.shard_sizes) and summary["privacy"][
        "n_min"] == data.n_min
    assert data.n_min < 600  # the IID cut of these 2400 samples gives 600
    server = run_inprocess(cfg, record=False, progress=None)
    np.testing.assert_array_equal(server.state.x,
                                  np.load(result.output_dir / "final_parameters.npy"))


def test_a_study_refuses_a_grid_point_whose_sigma_is_above_max_sigma_before_any_run(tmp_path):
    """The batched engine builds no server: the study itself applies the partition's refusal rule up
    front."""
    from diff2_flwr.lab.study.runner import parse_study, run_study

    data = {"name": "skewed", "dataset": {**BASE["dataset"], "partitioner": {"name": "square"}},
            "clients": BASE["training"]["clients"], "rounds": 40, "epsilons": [3.0, 0.05],
            "eval_every": 10,
            "seeds": {"tune": [9], "evaluate": [1, 2]}, "analysis": {"protocol": "paper"},
            "engine": "batch",
            "methods": [{"name": "DIFF2-GD", "method": "diff2", "grid": {"restart_every": [4],
                                                                         "learning_rate": [0.2]}}]}
    with pytest.raises(PartitionRefused, match=r"above privacy.max_sigma = 1"):
        run_study(parse_study(data, "skewed.yaml"), output_root=tmp_path, show_progress=False,
                  make_plots=False)
    # refused before the ε = 3 runs too
    assert not list((tmp_path / "skewed" / "runs").glob("*.json"))
