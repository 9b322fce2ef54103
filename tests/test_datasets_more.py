"""BlogFeedback, KDD Cup 99, Covertype and generic CSV datasets, on tiny fixture files the tests
write."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest

from diff2_flwr.runtime.config import ConfigError, parse_config
from diff2_flwr.runtime.driver import run_inprocess
from diff2_flwr.runtime.session import load_data
from diff2_flwr.task.data import EXPECTED_FILES, DataError, load_classification, load_csv, load_raw

RNG = np.random.default_rng(0)


def write_covtype(root: Path, n: int = 120, gz: bool = False) -> Path:
    folder = root / "covertype"
    folder.mkdir(parents=True, exist_ok=True)
    x = RNG.integers(0, 50, size=(n, 54))
    y = RNG.integers(1, 8, size=n)
    y[:7] = np.arange(1, 8)
    text = "\n".join(",".join(map(str, list(r) + [c])) for r, c in zip(x, y)) + "\n"
    path = folder / ("covtype.data.gz" if gz else "covtype.data")
    if gz:
        with gzip.open(path, "wt") as fh:
            fh.write(text)
    else:
        path.write_text(text)
    return path


def write_kdd(root: Path, n: int = 80) -> Path:
    folder = root / "kddcup99"
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        numbers = [str(v) for v in RNG.integers(0, 9, size=38)]
        label = "normal." if i % 3 else ("smurf." if i % 2 else "neptune.")
        rows.append(",".join([numbers[0], ["tcp", "udp", "icmp"][i % 3], ["http", "ftp"][i % 2],
                              "SF"] + numbers[1:] + [label]))
    path = folder / "kddcup.data_10_percent"
    path.write_text("\n".join(rows) + "\n")
    return path


def test_expected_file_names_are_documented():
    assert EXPECTED_FILES["blogfeedback"] == ("blogData_train.csv",)
    assert EXPECTED_FILES["kddcup99"] == ("kddcup.data_10_percent",)
    assert EXPECTED_FILES["covertype"] == ("covtype.data",)


def test_blogfeedback_target_is_the_last_column(tmp_path):
    folder = tmp_path / "blogfeedback"
    folder.mkdir()
    data = RNG.normal(size=(30, 281)).round(3)
    (folder / "blogData_train.csv").write_text("\n".join(",".join(map(str,
                                                                      r)) for r in data) + "\n")
    x, y = load_raw("blogfeedback", data_dir=tmp_path)
    np.testing.assert_array_equal(x, data[:, :-1])
    np.testing.assert_array_equal(y, data[:, -1])


@pytest.mark.parametrize("gz", [False, True])
def test_covertype_seven_classes(tmp_path, gz):
    write_covtype(tmp_path, gz=gz)
    x, y, classes = load_classification("covertype", data_dir=tmp_path)
    assert x.shape == (120, 54) and classes == tuple(str(c) for c in range(1, 8))
    assert set(np.unique(y)) == set(range(7))


def test_kddcup_binary_with_one_hot_categoricals(tmp_path):
    write_kdd(tmp_path)
    x, y, classes = load_classification("kddcup99", data_dir=tmp_path)
    assert classes == ("attack", "normal")
    # 38 numeric, protocol (3), service (2), flag (1) one-hot
    assert x.shape == (80, 38 + 3 + 2 + 1)
    assert y.sum() == sum(1 for i in range(80) if i % 3)  # "normal" is class 1
    onehot = x[:, 38:41]
    np.testing.assert_array_equal(onehot.sum(1), np.ones(80))


def test_kddcup_wrong_width_is_refused(tmp_path):
    folder = tmp_path / "kddcup99"
    folder.mkdir()
    (folder / "kddcup.data_10_percent").write_text("1,2,3\n")
    with pytest.raises(DataError, match="42 values"):
        load_classification("kddcup99", data_dir=tmp_path)


def test_missing_classification_file_names_what_was_looked_for(tmp_path):
    with pytest.raises(DataError, match="covtype.data"):
        load_classification("covertype", data_dir=tmp_path)


def test_generic_csv_regression_and_classification(tmp_path):
    path = tmp_path / "mine.csv"
    path.write_text("id,colour,a,b,price,kind\n" + "".join(
        f"{i},{['red', 'blue'][i % 2]},{i * 0.5},{i % 7},{10 + i},{'x' if i % 3 else 'y'}\n"
        for i in range(60)))
    x, y, classes = load_csv(path, target="price", drop=("id", "kind"), categorical=("colour",))
    assert x.shape == (60, 2 + 2) and classes == () and y[5] == 15
    x, y, classes = load_csv(path, target="kind", drop=("id",), categorical=("colour",),
                             task="classification")
    assert classes == ("x", "y") and x.shape == (60, 3 + 2)
    with pytest.raises(DataError, match=r"`dataset.drop` names column\(s\) \['nope'\]"):
        load_csv(path, target="price", drop=("nope",))
    with pytest.raises(DataError, match=r"column 'colour' holds 'red', not a number"):
        load_csv(path, target="price", drop=("id", "kind"))


@pytest.mark.parametrize("gz", [False, True])
def test_csv_saved_with_a_byte_order_mark_loads(tmp_path, gz):
    """Spreadsheet programs save UTF-8 CSV with a BOM: the first column's name must not carry it."""
    import gzip

    text = "y,a,b,c\n" + "".join(f"{i},{i * 0.5},{i % 3},{-i}\n" for i in range(20))
    path = tmp_path / ("bom.csv.gz" if gz else "bom.csv")
    raw = text.encode("utf-8-sig")
    assert raw.startswith(b"\xef\xbb\xbf")
    path.write_bytes(gzip.compress(raw) if gz else raw)
    x, y, _ = load_csv(path, target="y")
    assert x.shape == (20, 3) and list(y[:3]) == [0, 1, 2]


def test_csv_that_is_not_utf8_says_so(tmp_path):
    path = tmp_path / "latin.csv"
    path.write_bytes("prix,café\n1,2\n".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin.csv: it is not UTF-8 text.*Save it as UTF-8 CSV"):
        load_csv(path, target="prix")


def test_classification_run_end_to_end_with_cross_entropy(tmp_path):
    write_covtype(tmp_path, n=200)
    cfg = parse_config({"method": "dpgd", "dataset": {"name": "covertype", "dir": str(tmp_path)},
                        "privacy": {"epsilon": 5.0}, "training": {"rounds": 3, "clients": 2,
                                                                  "seed": 0}})
    assert cfg.loss == "cross_entropy" and not cfg.closed_form_gradients
    data = load_data(cfg)
    assert data.task == "classification" and data.num_outputs == 7 and data.target_scale == 1.0
    server = run_inprocess(cfg, record=False, progress=None)
    assert server.state.round == 3 and server.state.x.size == 54 * 10 + 10 + 10 * 7 + 7
    assert all(np.isfinite(h["train_loss"]) for h in server.history)


def test_csv_dataset_config_is_validated(tmp_path):
    with pytest.raises(ConfigError, match=r"dataset.path.*csv"):
        parse_config({"dataset": {"name": "csv", "target": "y"}, "method": "dpgd"})
    with pytest.raises(ConfigError, match=r"dataset.target.*nothing for dataset synthetic"):
        parse_config({"dataset": {"name": "synthetic", "target": "y"}, "method": "dpgd"})
    with pytest.raises(ConfigError, match=r"model.loss.*cross_entropy"):
        parse_config({"dataset": {"name": "covertype"}, "model": {"loss": "half_squared_error"},
                      "method": "dpgd"})
    cfg = parse_config({"dataset": {"name": "csv", "path": "x.csv", "target": "y", "drop": ["a"],
                                    "task": "classification"},
                        "method": "dpgd"})
    assert cfg.dataset.drop == ("a",) and cfg.loss == "cross_entropy"
