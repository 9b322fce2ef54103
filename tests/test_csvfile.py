"""CSV files read with pyarrow (task/csvfile.py): the same float64 as the old reader, one-line
errors naming the line.

The old hand-written reader (csv module + numpy, until this change) is kept below as the reference:
the paper's datasets must load to exactly its arrays (the published results are bit-for-bit
reproducible).
"""

from __future__ import annotations

import csv
import gzip
import time
from pathlib import Path

import numpy as np
import pytest

from diff2_flwr.runtime.config import ConfigError, parse_config
from diff2_flwr.runtime.driver import run_inprocess
from diff2_flwr.task.data import DataError, load_classification, load_csv, load_raw


# ----------------------------------------------------------------- the old reader (reference, as it
# was)

def _old_read_rows(path: Path, header: bool = True) -> tuple[list[str], list[list[str]]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", newline="", encoding="utf-8-sig") as fh:
        reader = csv.reader(fh)
        first = next(reader)
        rows = [[c.strip() for c in r] for r in reader if r]
    if header:
        return [h.strip() for h in first], rows
    return [f"column_{i}" for i in range(len(first))], [[c.strip() for c in first]] + rows


def _old_numbers(rows: list[list[str]], width: int) -> np.ndarray:
    return np.array(rows, dtype=np.float64).reshape(len(rows), width)


def _old_split(path: Path, target: str, drop: tuple[str, ...] = ()) -> tuple[np.ndarray,
                                                                             np.ndarray]:
    header, rows = _old_read_rows(path)
    values = _old_numbers(rows, len(header))
    keep = [i for i, h in enumerate(header) if h != target and h not in drop]
    return values[:, keep], values[:, header.index(target)]


def _old_kddcup(path: Path) -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
    header, rows = _old_read_rows(path, header=False)
    for r in rows:
        r[41] = "normal" if r[41].rstrip(".") == "normal" else "attack"
    target, categorical = 41, {1, 2, 3}
    numeric = [j for j in range(len(header)) if j != target and j not in categorical]
    blocks = [_old_numbers([[r[j] for j in numeric] for r in rows], len(numeric))]
    for j in sorted(categorical):
        levels = {v: k for k, v in enumerate(dict.fromkeys(r[j] for r in rows))}
        one_hot = np.zeros((len(rows), len(levels)))
        one_hot[np.arange(len(rows)), [levels[r[j]] for r in rows]] = 1.0
        blocks.append(one_hot)
    classes = tuple(sorted({r[target] for r in rows}))
    index = {c: k for k, c in enumerate(classes)}
    return np.concatenate(blocks, axis=1), np.array([index[r[target]] for r in rows],
                                                    dtype=np.float64), classes


def _same(new: np.ndarray, old: np.ndarray) -> None:
    assert new.dtype == old.dtype == np.float64 and new.shape == old.shape
    # bit for bit: equal floats (no NaN is accepted by either reader)
    assert np.array_equal(new, old)
    assert new.tobytes() == np.ascontiguousarray(old).tobytes()


# ----------------------------------------------------------------- bit for bit

@pytest.mark.realdata
def test_paper_datasets_load_to_the_old_readers_arrays(data_dir: Path) -> None:
    x, y = load_raw("california_housing", data_dir=data_dir)
    ox, oy = _old_split(data_dir / "california_housing" / "cal_housing.csv", "median_house_value")
    _same(x, ox)
    _same(y, oy)
    assert x.flags.c_contiguous
    x, y = load_raw("gas_turbine", data_dir=data_dir)
    parts = [_old_split(data_dir / "gas_turbine" / f"gt_{year}.csv", "CO",
                        ("NOX",)) for year in range(2011, 2016)]
    _same(x, np.concatenate([p[0] for p in parts])), _same(y, np.concatenate([p[1] for p in parts]))
    kdd = next((data_dir / "kddcup99").glob("kddcup.data_10_percent*"))
    x, y, classes = load_classification("kddcup99", data_dir=data_dir)
    ox, oy, oclasses = _old_kddcup(kdd)
    assert classes == oclasses == ("attack", "normal")
    _same(x, ox)
    _same(y, oy)
    assert x.shape == (494_021, 118) and x.flags.c_contiguous


def test_hard_decimals_parse_to_pythons_correctly_rounded_floats(tmp_path: Path) -> None:
    """17 significant digits, halfway cases, subnormals, long mantissas: each cell must equal
    float(text)."""
    rng = np.random.default_rng(7)
    cells = [repr(float(v)) for v in rng.standard_normal(2000) * 10.0 ** rng.integers(-300, 300,
                                                                                      2000)]
    cells += [f"{v:.25f}" for v in rng.random(500)] + [f"{v:.17e}"
                                                       for v in rng.standard_normal(500)]
    cells += ["9007199254740993", "2.2250738585072011e-308", "4.9e-324", "0.1",
              "1.7976931348623157e308",
              "123456789012345678901234567890", " 2.5 ", "+1", ".5", "5.", "1E5", "-0",
              "0.30000000000000004"]
    cells = cells[: len(cells) // 4 * 4]
    path = tmp_path / "hard.csv"
    path.write_text("a,b,c,y\n" + "".join(",".join(cells[i:i + 4]) + "\n"
                                          for i in range(0, len(cells), 4)))
    x, y, _ = load_csv(path, target="y", task="regression")
    expected = np.array([float(c) for c in cells]).reshape(-1, 4)
    assert x.tobytes() == expected[:,
                                   :3].copy().tobytes() and y.tobytes() == expected[
                                       :, 3].copy().tobytes()
    ox, oy = _old_split(path, "y")
    _same(x, ox)
    _same(y, oy)


# ----------------------------------------------------------------- malformed files: one line,
# naming line and column

def _refused(call, pattern: str, *, names_line: bool = True) -> str:
    """The one-line DataError of ``call()``, matching ``pattern`` (and naming a file line unless
    told not to)."""
    with pytest.raises(DataError, match=pattern) as info:
        call()
    message = str(info.value)
    assert "\n" not in message, message
    assert not names_line or "line " in message, message
    return message


def _csv(tmp_path: Path, text: str | bytes, name: str = "f.csv") -> Path:
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


RAGGED = {  # a file of a, b, y (or a, y) and the one-line refusal that names its file line
    "too many fields": ("a,b,y\n1,2,3\n\n4,5,6,7\n",  # line 3 is empty (skipped, but counted)
                        r"line 4 has 4 fields, the header \(line 1\) has 3\. Every line needs one "
                        r"value per column"),
    "too few fields": ("a,b,y\n1,2,3\n4,5\n7,8,9\n",
                       r"line 3 has 2 fields, the header \(line 1\) has 3"),
    "a line of spaces is ragged, not empty": ("a,b,y\n1,2,3\n   \n4,5,6\n",
                                              r"line 3 has 1 field, the header \(line 1\) has 3"),
    "an unbalanced quote inside a line": (
        'a,b,y\n1,2,3\n4,"5,6\n7,8,9\n',
        r'line 3, in 2 fields where 3 were expected: an unbalanced quote \("\): the quoted value '
        r'is not closed'),
    # the quote swallows the last line: still 2 fields
    "an unbalanced quote that runs to the end": (
        'a,y\n1,2\n3,"4\n5,6\n',
        r"line 3, column 'y': an unbalanced quote .*Close the quote, or remove it\.$"),
}


@pytest.mark.parametrize("case", list(RAGGED))
def test_a_ragged_or_misquoted_row_names_its_file_line(case: str, tmp_path: Path) -> None:
    text, pattern = RAGGED[case]
    path = _csv(tmp_path, text)
    message = _refused(lambda: load_csv(path, target="y", task="regression"), pattern)
    assert message.startswith(f"{path}: "), message


def test_a_ragged_row_in_a_file_without_header_says_the_first_line(tmp_path: Path) -> None:
    folder = tmp_path / "blogfeedback"
    folder.mkdir()
    (folder / "blogData_train.csv").write_text("1,2,3\n4,5,6\n7,8\n")
    _refused(lambda: load_raw("blogfeedback", data_dir=tmp_path),
             r"line 3 has 2 fields, the first line has 3")


def test_empty_lines_are_skipped_anywhere(tmp_path: Path) -> None:
    path = _csv(tmp_path, "a,b,y\n\n1,2,3\n\n\n4,5,6\n\n")
    x, y, _ = load_csv(path, target="y", task="regression")
    np.testing.assert_array_equal(x, [[1, 2], [4, 5]])
    np.testing.assert_array_equal(y, [3, 6])


def test_an_unbalanced_quote_in_a_text_column(tmp_path: Path) -> None:
    path = _csv(tmp_path, 'a,kind\n1,x\n2,"y\n3,z\n')
    _refused(lambda: load_csv(path, target="kind", task="classification"),
             r"line 3, column 'kind': an unbalanced quote")


def test_quoted_values_are_read(tmp_path: Path) -> None:
    path = _csv(tmp_path, 'a,"the, target"\n"1.5",2\n3,"4"\n')
    x, y, _ = load_csv(path, target="the, target", task="regression")
    np.testing.assert_array_equal(x, [[1.5], [3]])
    np.testing.assert_array_equal(y, [2, 4])


@pytest.mark.parametrize("header", [True, False])
def test_a_file_that_is_not_utf8_names_line_and_byte(tmp_path: Path, header: bool) -> None:
    """In the header, or in a data line (the empty line 3 is counted)."""
    text = "prix,café\n1,2\n" if header else "prix,b\n1,2\n\n3,café\n"
    path = _csv(tmp_path, text.encode("latin-1"))
    line = 1 if header else 4
    message = _refused(lambda: load_csv(path, target="prix", task="regression"),
                       rf"^Cannot read {path}: it is not UTF-8 text \(line {line}, byte \d+ of "
                       rf"that line: 0xe9, ")
    assert "Save it as UTF-8 CSV" in message and "iconv -f latin1 -t utf-8" in message


def test_a_gzip_file_not_utf8_names_its_line(tmp_path: Path) -> None:
    folder = tmp_path / "covertype"
    folder.mkdir()
    rows = ["1," * 54 + "1\n"] * 3 + ["1," * 54 + "d\xe9\n"]
    (folder / "covtype.data.gz").write_bytes(gzip.compress("".join(rows).encode("latin-1")))
    _refused(lambda: load_classification("covertype", data_dir=tmp_path),
             r"it is not UTF-8 text \(line 4, byte 110 ")


def test_text_in_a_numeric_column_names_line_and_column(tmp_path: Path) -> None:
    path = _csv(tmp_path, "a,colour,y\n1,2,3\n\n4,red,6\n")
    _refused(lambda: load_csv(path, target="y", task="regression"),
             rf"^{path}: line 4, column 'colour' holds 'red', not a number\. Fill in or drop "
             rf"missing values first")


def test_text_in_a_file_without_header_names_the_column_by_position(tmp_path: Path) -> None:
    folder = tmp_path / "blogfeedback"
    folder.mkdir()
    (folder / "blogData_train.csv").write_text("1,2,3,4\n4,5,6,7\n7,8,x,9\n")
    _refused(lambda: load_raw("blogfeedback", data_dir=tmp_path),
             r"line 3, column 3 holds 'x', not a number")


def test_text_in_a_regression_target_says_how_to_ask_for_classes(tmp_path: Path) -> None:
    path = _csv(tmp_path, "a,kind\n1,0\n2,cat\n")
    _refused(lambda: load_csv(path, target="kind", task="regression"),
             r"line 3, column 'kind' holds 'cat', not a number\. A regression target must be a "
             r"number: for class labels write `dataset.task: classification`\.")


@pytest.mark.parametrize("cell, pattern", [  # line 4 holds a second NaN
    ("", r"line 3, column 'b' holds '', not a number"),
    ("NA", r"line 3, column 'b' holds 'NA', not a number"),
    ("nan", r"2 NaN or infinite values \(first at line 3, column 'b': nan\)\. Fill in or drop"),
    ("-inf", r"2 NaN or infinite values \(first at line 3, column 'b': -inf\)\. Fill in or drop"),
    ("1e400", r"2 NaN or infinite values \(first at line 3, column 'b': inf\)\. Fill in or drop"),
])
def test_missing_nan_and_infinite_cells_are_refused_naming_the_first(tmp_path: Path, cell: str,
                                                                     pattern: str) -> None:
    path = _csv(tmp_path, f"a,b,y\n1,2,3\n4,{cell},6\n7,nan,9\n")
    _refused(lambda: load_csv(path, target="y", task="regression"), pattern)


def test_a_misspelt_target_suggests_the_closest_column(tmp_path: Path) -> None:
    path = _csv(tmp_path, "area,price,rooms\n1,2,3\n")
    _refused(lambda: load_csv(path, target="prcie", task="regression"),
             r"`dataset.target` column 'prcie' not found in the header\. Did you mean 'price'\? "
             r"Columns: \[", names_line=False)
    _refused(lambda: load_csv(path, target="price", drop=("room",), task="regression"),
             r"`dataset.drop` names column\(s\) \['room'\] that the header lacks\. Did you mean "
             r"'rooms'\?", names_line=False)


def test_two_columns_of_one_name_are_refused(tmp_path: Path) -> None:
    path = _csv(tmp_path, "a,b,a\n1,2,3\n")
    _refused(lambda: load_csv(path, target="b", task="regression"),
             r"columns 1 and 3 of the header are both named 'a'", names_line=False)


def test_empty_and_broken_gzip_files(tmp_path: Path) -> None:
    path = _csv(tmp_path, b"")
    _refused(lambda: load_csv(path, target="y", task="regression"),
             r"^Cannot read .*f.csv: the file is empty", names_line=False)
    folder = tmp_path / "covertype"
    folder.mkdir()
    (folder / "covtype.data.gz").write_bytes(gzip.compress(("1," * 54 + "1\n").encode() * 5000)[
        :200])
    with pytest.raises(DataError,
                       match=r"^Cannot read .*covtype.data.gz: .*\(a .gz file must be complete "
                             r"gzip\)\.$"):
        load_classification("covertype", data_dir=tmp_path)


def test_gzip_files_load_like_plain_ones(tmp_path: Path) -> None:
    text = "a,b,y\n" + "".join(f"{i * 0.1},{i % 3},{i}\n" for i in range(50))
    plain = _csv(tmp_path, text)
    packed = _csv(tmp_path, gzip.compress(text.encode()), "f.csv.gz")
    for a, b in zip(load_csv(plain, target="y", task="regression"), load_csv(packed, target="y",
                                                                             task="regression")):
        assert np.array_equal(a, b)


def test_thousands_of_columns_load_fast_and_name_a_late_column(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    data = rng.standard_normal((300, 5000)).round(6)
    header = ",".join(f"c{j}" for j in range(4999)) + ",y\n"
    path = _csv(tmp_path, header + "".join(",".join(map(repr, r.tolist())) + "\n" for r in data))
    # CPU seconds of this process (all its threads): not stretched by a busy machine
    start = time.process_time()
    x, y, _ = load_csv(path, target="y", task="regression")
    assert time.process_time() - start < 10  # about 0.3 s; the old reader took seconds
    assert x.tobytes() == data[:, :-1].copy().tobytes() and y.tobytes() == data[:,
                                                                                -1].copy().tobytes()
    lines = path.read_text().splitlines()
    cells = lines[200].split(",")
    cells[4321] = "oops"
    lines[200] = ",".join(cells)
    path.write_text("\n".join(lines) + "\n")
    _refused(lambda: load_csv(path, target="y", task="regression"),
             r"line 201, column 'c4321' holds 'oops'")


# ----------------------------------------------------------------- class labels and the task

def test_float_class_labels_holding_integers_are_those_classes(tmp_path: Path) -> None:
    path = _csv(tmp_path,
                "a,label\n" + "".join(f"{i},{['0.0', '1.0', '2', '10'][i % 4]}\n"
                                      for i in range(12)))
    x, y, classes = load_csv(path, target="label", task="classification")
    assert classes == ("0", "1", "2", "10")  # by value (as text "10" would sort before "2")
    np.testing.assert_array_equal(y, [i % 4 for i in range(12)])


def test_text_class_labels_keep_their_sorted_order(tmp_path: Path) -> None:
    path = _csv(tmp_path, "a,label\n1,dog\n2, cat \n3,dog\n4,1\n")
    _, y, classes = load_csv(path, target="label", task="classification")
    assert classes == ("1", "cat", "dog") and y.tolist() == [2, 1, 2, 0]


@pytest.mark.parametrize("label, pattern", [
    ("1.5",
     r"line 4, column 'label' holds the class label '1.5': class labels must be integers \(1 or "
     r"1.0\) or text\. Round the labels, or for a numeric target write `dataset.task: "
     r"regression`\."),
    ("nan", r"line 4, column 'label' holds the class label 'nan'"),
    ("", r"line 4, column 'label' holds no class label"),
])
def test_other_class_labels_are_refused_naming_column_line_and_value(tmp_path: Path, label: str,
                                                                     pattern: str) -> None:
    path = _csv(tmp_path, f"a,label\n1,0\n2,1\n3,{label}\n4,1\n")
    _refused(lambda: load_csv(path, target="label", task="classification"), pattern)


def test_a_single_class_is_refused(tmp_path: Path) -> None:
    path = _csv(tmp_path, "a,label\n1,1.0\n2,1\n")
    with pytest.raises(DataError, match=r"the target column 'label' has a single class \('1',\)"):
        load_csv(path, target="label", task="classification")


def _float_label_config(path: Path, **model) -> dict:
    return {"method": "dpgd", "dataset": {"name": "csv", "path": str(path), "target": "label"},
            "model": model,
            "privacy": {"epsilon": 3.0}, "training": {"rounds": 2, "clients": 2, "seed": 0}}


def test_the_task_of_a_csv_is_said_by_the_loss_or_required(tmp_path: Path) -> None:
    path = _csv(tmp_path, "a,label\n1,0.0\n")
    cfg = parse_config(_float_label_config(path, loss="cross_entropy"))
    assert cfg.dataset.task == "classification" and cfg.dataset.task_kind == "classification"
    regression = parse_config(_float_label_config(path, loss="half_squared_error"))
    assert regression.dataset.task_kind == "regression"
    with pytest.raises(ConfigError,
                       match=r"key `dataset.task`: expected regression or classification for "
                             r"dataset csv \(or model.loss: cross_entropy"):
        parse_config(_float_label_config(path))
    with pytest.raises(ConfigError,
                       match=r"key `model.loss`: expected half_squared_error \(or auto\) for the "
                             r"regression dataset csv \(or dataset.task: classification\)"):
        parse_config({**_float_label_config(path, loss="cross_entropy"),
                      "dataset": {"name": "csv", "path": str(path), "target": "label",
                                  "task": "regression"}})


def test_float_labels_with_cross_entropy_and_no_task_train(tmp_path: Path) -> None:
    """Issue 21's case: was `Target 1 is out of bounds.` inside the run (the task defaulted to
    regression)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((200, 3))
    path = _csv(tmp_path,
                "a,b,c,label\n" + "".join(f"{r[0]},{r[1]},{r[2]},{float(r[0] > 0)}\n" for r in x))
    server = run_inprocess(parse_config(_float_label_config(path, loss="cross_entropy")),
                           record=False, progress=None)
    assert server.state.round == 2 and all(np.isfinite(h["train_loss"]) for h in server.history)
