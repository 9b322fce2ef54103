"""Tests for diff2_flwr.task.data: synthetic data, preparation, and CSV loading."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest

from diff2_flwr.task.data import (
    DATA_DIR_ENV, DataError, load_raw, prepare, resolve_data_dir, synthetic_regression,
)

CAL_HEADER = (
    "longitude,latitude,housing_median_age,total_rooms,total_bedrooms,population,households,"
    "median_income,median_house_value"
)
GAS_HEADER = "AT,AP,AH,AFDP,GTEP,TIT,TAT,TEY,CDP,CO,NOX"
GAS_YEARS = range(2011, 2016)


def _real_data_dir() -> Path:
    env = os.environ.get(DATA_DIR_ENV)
    return Path(env) if env else Path(__file__).resolve().parents[2] / "shared" / "data"


REAL_DATA = _real_data_dir()
skip_without_real_data = pytest.mark.skipif(not REAL_DATA.is_dir(),
                                            reason=f"paper datasets not found at {REAL_DATA}")


def _write_cal(root: Path, rows: list[str]) -> Path:
    """A fake california_housing/cal_housing.csv under root; returns the file."""
    folder = root / "california_housing"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "cal_housing.csv"
    path.write_text("\n".join([CAL_HEADER, *rows]) + "\n")
    return path


def _write_gas(root: Path, rows_per_year: int = 3, skip: int | None = None) -> None:
    """Fake gas_turbine/gt_YYYY.csv files; CO = 100 * year index + row, NOX = -1."""
    folder = root / "gas_turbine"
    folder.mkdir(parents=True, exist_ok=True)
    for i, year in enumerate(GAS_YEARS):
        if year == skip:
            continue
        rows = [",".join([*(str(float(j + r)) for j in range(9)), str(100.0 * i + r),
                          "-1"]) for r in range(rows_per_year)]
        (folder / f"gt_{year}.csv").write_text("\n".join([GAS_HEADER, *rows]) + "\n")


@pytest.fixture(scope="module")
def synth() -> tuple[np.ndarray, np.ndarray]:
    return synthetic_regression(1003, 5, seed=7)


# --------------------------------------------------------------------------- synthetic data

def test_synthetic_is_deterministic_by_seed() -> None:
    x1, y1 = synthetic_regression(200, 4, seed=3)
    x2, y2 = synthetic_regression(200, 4, seed=3)
    assert x1.shape == (200, 4) and y1.shape == (200,)
    np.testing.assert_array_equal(x1, x2)
    np.testing.assert_array_equal(y1, y2)


def test_synthetic_differs_across_seeds() -> None:
    x1, y1 = synthetic_regression(200, 4, seed=3)
    x2, y2 = synthetic_regression(200, 4, seed=4)
    assert not np.allclose(x1, x2)
    assert not np.allclose(y1, y2)


def test_load_raw_synthetic_matches_generator() -> None:
    x, y = load_raw("synthetic", num_samples=50, num_features=3, seed=11)
    xe, ye = synthetic_regression(50, 3, seed=11)
    np.testing.assert_array_equal(x, xe)
    np.testing.assert_array_equal(y, ye)


def test_unknown_dataset_name() -> None:
    with pytest.raises(DataError, match="'mnist'"):
        load_raw("mnist")


# --------------------------------------------------------------------------- prepare()

def test_prepare_split_sizes(synth: tuple[np.ndarray, np.ndarray]) -> None:
    x, y = synth
    data = prepare("synthetic", x, y, clients=7)
    n_test = round(0.2 * len(x))
    assert data.x_test.shape == (n_test, 5) and data.y_test.shape == (n_test,)
    assert data.x_train.shape == (len(x) - n_test, 5) and data.y_train.shape == (len(x) - n_test,)
    assert data.num_features == 5


def test_prepare_split_is_a_partition_of_the_rows(synth: tuple[np.ndarray, np.ndarray]) -> None:
    """Every original row lands exactly once in train or test (checked via the scaled target)."""
    x, y = synth
    data = prepare("synthetic", x, y, clients=4)
    both = np.sort(np.concatenate([data.y_train, data.y_test]) * data.target_scale)
    np.testing.assert_allclose(both, np.sort(y), rtol=1e-12)


def test_prepare_standardises_with_train_statistics(synth: tuple[np.ndarray, np.ndarray]) -> None:
    x, y = synth
    # shift and scale columns so standardisation has something to undo
    x = x * np.array([1.0, 10.0, 0.1, 3.0, 1e3]) + np.array([5.0, -2.0, 100.0, 0.0, 7.0])
    data = prepare("synthetic", x, y, clients=4)
    np.testing.assert_allclose(data.x_train.mean(axis=0), 0.0, atol=1e-9)
    np.testing.assert_allclose(data.x_train.std(axis=0), 1.0, atol=1e-9)
    # the test split is transformed with the train statistics, so it is not exactly standardised
    assert not np.allclose(data.x_test.mean(axis=0), 0.0, atol=1e-9)


def test_prepare_scales_target_by_global_max(synth: tuple[np.ndarray, np.ndarray]) -> None:
    x, y = synth
    y = 3.0 * y - 0.5  # make max |y| clearly different from 1
    data = prepare("synthetic", x, y, clients=4)
    assert data.target_scale == pytest.approx(np.max(np.abs(y)))
    assert np.max(np.abs(data.y_train)) <= 1.0 and np.max(np.abs(data.y_test)) <= 1.0
    assert max(np.max(np.abs(data.y_train)), np.max(np.abs(data.y_test))) == 1.0


def test_target_scale_uses_whole_dataset_not_train() -> None:
    """When max |y| lies in the test split, train targets stay strictly below 1."""
    x, _ = synthetic_regression(100, 3, seed=1)
    y = np.arange(1.0, 101.0)  # distinct targets identify rows
    data = prepare("synthetic", x, y, clients=4)
    test_row = int(round(data.y_test[0] * data.target_scale)) - 1
    y[test_row] = -500.0
    data2 = prepare("synthetic", x, y, clients=4)  # same split_seed -> same split
    assert data2.target_scale == 500.0
    assert data2.y_test[0] == -1.0
    assert np.max(np.abs(data2.y_train)) < 1.0
    np.testing.assert_allclose(data2.y_train, data.y_train * 100.0 / 500.0, rtol=1e-12)


@pytest.mark.parametrize("clients", [1, 3, 7, 10])
def test_shards_cover_train_once_and_are_balanced(synth: tuple[np.ndarray, np.ndarray],
                                                  clients: int) -> None:
    x, y = synth
    data = prepare("synthetic", x, y, clients=clients)
    n_train = len(data.y_train)
    assert len(data.shard_bounds) == clients
    covered = np.zeros(n_train, dtype=int)
    for a, b in data.shard_bounds:
        covered[a:b] += 1
    assert np.all(covered == 1)
    sizes = data.shard_sizes
    assert sum(sizes) == n_train
    assert max(sizes) - min(sizes) <= 1
    assert data.n_min == min(sizes) == n_train // clients
    # shard(i) returns exactly the rows of its bounds
    stacked = np.concatenate([data.shard(i)[1] for i in range(clients)])
    np.testing.assert_array_equal(stacked, data.y_train)


def test_shard_rejects_bad_partition_id(synth: tuple[np.ndarray, np.ndarray]) -> None:
    x, y = synth
    data = prepare("synthetic", x, y, clients=3)
    with pytest.raises(DataError, match="Found 3"):
        data.shard(3)


def test_same_split_seed_same_arrays_different_seed_different(synth: tuple[np.ndarray,
                                                                           np.ndarray]) -> None:
    x, y = synth
    a = prepare("synthetic", x, y, clients=4, split_seed=1)
    b = prepare("synthetic", x, y, clients=4, split_seed=1)
    c = prepare("synthetic", x, y, clients=4, split_seed=2)
    for name in ("x_train", "y_train", "x_test", "y_test"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
        assert not np.array_equal(getattr(a, name), getattr(c, name)), name


def test_too_few_samples_for_shards() -> None:
    x, y = synthetic_regression(10, 2, seed=0)  # 8 train samples
    assert prepare("synthetic", x, y, clients=8).n_min == 1
    with pytest.raises(DataError, match=r"10 samples.*9 non-empty shards"):
        prepare("synthetic", x, y, clients=9)


# --------------------------------------------------------------------------- CSV loading (fixtures)

def test_california_fixture_loads_target_and_features(tmp_path: Path) -> None:
    _write_cal(tmp_path, ["1,2,3,4,5,6,7,8,900", "10,20,30,40,50,60,70,80,-5"])
    x, y = load_raw("california_housing", data_dir=tmp_path)
    np.testing.assert_array_equal(x, [[1, 2, 3, 4, 5, 6, 7, 8], [10, 20, 30, 40, 50, 60, 70, 80]])
    np.testing.assert_array_equal(y, [900, -5])


def test_csv_found_directly_in_data_dir(tmp_path: Path) -> None:
    """The file may also lie directly in the data directory (no sub-folder)."""
    (tmp_path / "cal_housing.csv").write_text(CAL_HEADER + "\n1,2,3,4,5,6,7,8,9\n")
    x, y = load_raw("california_housing", data_dir=tmp_path)
    assert x.shape == (1, 8) and y.tolist() == [9.0]


def test_data_dir_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write_cal(tmp_path, ["1,2,3,4,5,6,7,8,9"])
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))
    assert resolve_data_dir(None) == tmp_path
    x, _ = load_raw("california_housing")
    assert x.shape == (1, 8)


def test_gas_turbine_fixture_drops_nox_and_concatenates_years(tmp_path: Path) -> None:
    _write_gas(tmp_path, rows_per_year=3)
    x, y = load_raw("gas_turbine", data_dir=tmp_path)
    assert x.shape == (15, 9)
    assert not np.any(x == -1.0)  # the NOX column (all -1) is dropped
    # CO, years in order
    np.testing.assert_array_equal(y, [100.0 * i + r for i in range(5) for r in range(3)])


def test_missing_data_dir_names_file_looked_for(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    expected = re.escape(str(missing / "california_housing" / "cal_housing.csv"))
    with pytest.raises(DataError, match=rf"'cal_housing\.csv' not found.*{expected}"):
        load_raw("california_housing", data_dir=missing)


def test_missing_gas_turbine_year_names_that_file(tmp_path: Path) -> None:
    _write_gas(tmp_path, skip=2013)
    with pytest.raises(DataError, match=re.escape(str(tmp_path / "gas_turbine" / "gt_2013.csv"))):
        load_raw("gas_turbine", data_dir=tmp_path)


def test_nan_cell_names_file_and_column(tmp_path: Path) -> None:
    path = _write_cal(tmp_path, ["1,2,3,4,5,6,7,8,9", "1,2,3,4,nan,6,7,8,9"])
    with pytest.raises(DataError,
                       match=rf"{re.escape(str(path))}: 1 NaN or infinite value \(first at line "
                             rf"3, column 'total_bedrooms': nan\)"):
        load_raw("california_housing", data_dir=tmp_path)


def test_empty_cell_names_file_and_column(tmp_path: Path) -> None:
    path = _write_cal(tmp_path, ["1,2,3,4,5,6,7,8,9", "1,2,3,4,,6,7,8,9"])
    with pytest.raises(DataError, match=rf"{re.escape(str(path))}.*'total_bedrooms'"):
        load_raw("california_housing", data_dir=tmp_path)


def test_empty_cell_still_raises_data_error_naming_file(tmp_path: Path) -> None:
    """Whatever the message detail, an empty cell is a DataError naming the file."""
    path = _write_cal(tmp_path, ["1,2,3,4,5,6,7,8,9", "1,2,3,4,,6,7,8,9"])
    with pytest.raises(DataError, match=re.escape(str(path))):
        load_raw("california_housing", data_dir=tmp_path)


def test_missing_target_column(tmp_path: Path) -> None:
    folder = tmp_path / "california_housing"
    folder.mkdir()
    path = folder / "cal_housing.csv"
    path.write_text("a,b\n1,2\n")
    with pytest.raises(DataError, match=rf"{re.escape(str(path))}.*'median_house_value' not found"):
        load_raw("california_housing", data_dir=tmp_path)


def test_no_data_dir_and_no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    with pytest.raises(DataError, match=DATA_DIR_ENV):
        resolve_data_dir(None)
    with pytest.raises(DataError, match=DATA_DIR_ENV):
        load_raw("california_housing")


# --------------------------------------------------------------------------- the paper's datasets

@pytest.fixture(scope="module")
def california() -> tuple[np.ndarray, np.ndarray]:
    return load_raw("california_housing", data_dir=REAL_DATA)


@pytest.mark.realdata
@skip_without_real_data
def test_california_housing_shape(california: tuple[np.ndarray, np.ndarray]) -> None:
    x, y = california
    assert x.shape == (20640, 8) and y.shape == (20640,)
    assert np.all(np.isfinite(x)) and np.all(y > 0)  # house values are positive
    assert y.max() == 500001.0  # the dataset's well-known cap on median_house_value


@pytest.mark.realdata
@skip_without_real_data
def test_california_housing_ten_clients_n_min(california: tuple[np.ndarray, np.ndarray]) -> None:
    x, y = california
    data = prepare("california_housing", x, y, clients=10)
    assert len(data.y_test) == 4128 and len(data.y_train) == 16512
    assert data.n_min == 1651
    assert data.target_scale == 500001.0


@pytest.mark.realdata
@skip_without_real_data
def test_gas_turbine_shape() -> None:
    """36733 rows over 2011-2015, 9 features (NOX dropped), target CO."""
    x, y = load_raw("gas_turbine", data_dir=REAL_DATA)
    assert x.shape == (36733, 9) and y.shape == (36733,)
    first = np.loadtxt(REAL_DATA / "gas_turbine" / "gt_2011.csv", delimiter=",", skiprows=1,
                       max_rows=1)
    np.testing.assert_array_equal(x[0], first[:9])  # AT..CDP
    assert y[0] == first[9]  # CO, not NOX (column 10)
