"""Shard files for deployment: each worker reads only its own; foreign or missing files are
refused."""

from __future__ import annotations

import numpy as np
import pytest

from diff2_flwr.cli import main
from diff2_flwr.runtime.config import ConfigError, parse_config
from diff2_flwr.runtime.driver import run_inprocess
from diff2_flwr.runtime.session import build_server, build_worker, load_data
from diff2_flwr.deploy.shards import write_shards
from diff2_flwr.runtime.shard_files import SERVER_FILE, ShardError, read_shard, shard_name

BASE = {"name": "sh", "method": "diff2", "dataset": {"name": "synthetic", "num_samples": 700},
        "training": {"rounds": 5, "restart_every": 2, "clip_diff": 3.0, "clients": 3, "seed": 1}}


def cfg_of(**dataset):
    return parse_config({**BASE, "dataset": {**BASE["dataset"], **dataset},
                         "evaluation": {"train_metrics": not dataset.get("shards")}})


def test_shards_partition_the_train_split_and_the_server_file_holds_no_train_sample(tmp_path):
    cfg = cfg_of()
    paths = write_shards(cfg, tmp_path)
    assert [p.name for p in paths] == [shard_name(i, 3) for i in range(3)] + [SERVER_FILE]
    data = load_data(cfg)
    for p in range(3):
        shard = read_shard(tmp_path / shard_name(p, 3), cfg, p, 3)
        np.testing.assert_array_equal(shard.features, data.shard(p)[0])
        np.testing.assert_array_equal(shard.targets, data.shard(p)[1])
    with np.load(tmp_path / SERVER_FILE) as server:
        assert set(server.files) == {"meta", "x_test", "y_test", "feature_mean", "feature_std"}


def test_a_deployment_style_run_equals_the_simulation_style_run(tmp_path):
    cfg = cfg_of()
    write_shards(cfg, tmp_path)
    deployed = cfg_of(shards=str(tmp_path))
    reference = run_inprocess(parse_config({**cfg.to_dict(),
                                            "evaluation": {"train_metrics": False}}),
                              record=False, progress=None)
    server = build_server(deployed, record=False, progress=None)
    workers = [build_worker(deployed, p, str(tmp_path / shard_name(p, 3))) for p in range(3)]
    while not server.done:
        server.release([w.reply(server.plan()) for w in workers])
    np.testing.assert_array_equal(server.state.x, reference.state.x)
    assert server.history[-1]["test_loss"] == reference.history[-1]["test_loss"]
    assert "train_loss" not in server.history[-1]


def test_wrong_missing_and_foreign_shards_are_refused(tmp_path):
    cfg = cfg_of()
    write_shards(cfg, tmp_path)
    with pytest.raises(ShardError,
                       match=r"holds partition 1 of 3, but this node is partition-id=0"):
        read_shard(tmp_path / shard_name(1, 3), cfg, 0, 3)
    with pytest.raises(ShardError, match=r"does not exist.*diff2 shard"):
        read_shard(tmp_path / "nope.npz", cfg, 0, 3)
    other = parse_config({**BASE, "dataset": {**BASE["dataset"], "split_seed": 9}})
    with pytest.raises(ShardError, match=r"other dataset settings"):
        read_shard(tmp_path / shard_name(0, 3), other, 0, 3)
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    with pytest.raises(ShardError, match=r"unreadable"):
        read_shard(tmp_path / "bad.npz", cfg, 0, 3)
    with pytest.raises(ShardError, match=r"not a worker data file"):
        read_shard(tmp_path / SERVER_FILE, cfg, 0, 3)


def test_train_metrics_are_refused_in_a_deployment():
    with pytest.raises(ConfigError, match=r"evaluation.train_metrics.*no training data"):
        parse_config({**BASE, "dataset": {**BASE["dataset"], "shards": "/tmp/x"}})


def test_cli_shard(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    import yaml

    path.write_text(yaml.safe_dump(BASE))
    assert main(["shard", str(path), "--out", str(tmp_path / "s")]) == 0
    assert capsys.readouterr().out.count(".npz") == 4
