"""One CSV file read with pyarrow: float64 and text columns, every malformed file refused in one
line.

Why pyarrow (not pandas, not our own reader): its CSV reader converts numbers with a correctly
rounded parser, so every cell is the same float64 as Python's ``float`` gave the earlier
hand-written reader (the published results are bit-for-bit reproducible; ``tests/test_csvfile.py``
checks the paper's datasets against that reader), reads gzip files by their ``.gz`` name, and
reports a ragged line with its row number and text. pandas (which can use pyarrow underneath) adds
little here: its C parser was correctly rounded only with ``float_precision="round_trip"`` before
pandas 3, and it fills a short row with NaN without a word. pyarrow is a main dependency
(pyproject.toml).

Conventions of every message: a *line* is a line of the file, 1-based, the header (if any) being
line 1; a record is named by the line it starts on (exact unless a quoted value holds a line break,
which numeric data never needs). *Empty lines are skipped* wherever they are (a line of spaces is
not empty: it is a row with one field, and refused as ragged). Columns are named by their header
name, or by their 1-based position in a file without a header. Numbers may carry spaces around them;
text is stripped of them.
"""

from __future__ import annotations

import difflib
import gzip
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pac
import pyarrow.csv as pcsv

__all__ = ["CsvFile", "CsvTable", "DataError"]

# Arrow's message for a cell it cannot convert (with use_threads=False it carries the row).
_CONVERSION = re.compile(
    r"column #(\d+): Row #(\d+): CSV conversion error to \w+: invalid value '(.*)'\Z", re.S)
T = TypeVar("T")
_CLEAN = "Fill in or drop missing values first: the model and the DP guarantee need finite data."


class DataError(ValueError):
    """A dataset that cannot be found, read or used; the message says which file and why."""


@dataclass(frozen=True)
class CsvFile:
    """A CSV file's path and column names (read from its first block); :meth:`read` reads the
    columns.

    Attributes:
        path: the file (``.gz``: gzip-compressed).
        header: whether line 1 names the columns (else they are ``column_0``, ``column_1``, ...).
        names: the column names, stripped of spaces.
        arrow_names: the names as pyarrow sees them (unstripped, or ``f0``, ``f1``, ...).
    """

    path: Path
    header: bool
    names: tuple[str, ...]
    arrow_names: tuple[str, ...]

    @classmethod
    def open(cls, path: str | Path, *, header: bool = True) -> "CsvFile":
        """The file's column names; a file pyarrow cannot start reading is refused (one line)."""
        path = Path(path)
        invalid: list[pcsv.InvalidRow] = []
        arrow_names = _arrow(path, lambda: tuple(pcsv.open_csv(path,
                                                               read_options=_read_options(
                                                                   header),
                                                                   parse_options=_parse_options(
                                                                       invalid)).schema.names),
                             invalid, header)
        names = tuple(n.strip() for n in arrow_names) if header else tuple(
            f"column_{j}" for j in range(len(arrow_names)))
        first = {}
        for j, name in enumerate(names):
            if name in first:
                raise DataError(
                    f"{path}: columns {first[name] + 1} and {j + 1} of the header are both named "
                    f"{name!r}. "
                                "Give every column its own name.")
            first[name] = j
        return cls(path=path, header=header, names=names, arrow_names=arrow_names)

    def label(self, column: int) -> str:
        """How messages name ``column``: ``column 'price'``, or ``column 4`` in a file without a
        header."""
        return f"column {self.names[column]!r}" if self.header else f"column {column + 1}"

    def index(self, name: str, key: str) -> int:
        """The position of column ``name`` (``key`` says who asks: "target column"); else the
        closest name."""
        if name in self.names:
            return self.names.index(name)
        close = difflib.get_close_matches(name, self.names, n=1)
        hint = f"Did you mean {close[0]!r}? " if close else ""
        raise DataError(
            f"{self.path}: {key} {name!r} not found in the header. {hint}Columns: "
            f"{list(self.names)}.")

    def read(self, columns: Iterable[int], *, text: Iterable[int] = (),
             hints: Mapping[int, str] | None = None) -> "CsvTable":
        """Columns ``columns`` as float64 and ``text`` as strings (others are not converted);
        one-line errors.

        ``hints`` replaces the advice of the message about a non-number in that column (e.g. for a
        target).
        """
        numeric, text = sorted(set(columns)), sorted(set(text))
        types = {self.arrow_names[j]: pa.float64()
                 for j in numeric} | {self.arrow_names[j]: pa.string() for j in text}
        convert = pcsv.ConvertOptions(column_types=types,
                                      include_columns=[self.arrow_names[j] for j in sorted(
                                          numeric + text)], null_values=[],
                                          strings_can_be_null=False,
                                          quoted_strings_can_be_null=False)
        invalid: list[pcsv.InvalidRow] = []
        table = _arrow(self.path, lambda: pcsv.read_csv(self.path,
                                                        read_options=_read_options(self.header),
                                                        parse_options=_parse_options(invalid),
                                                        convert_options=convert),
                       invalid, self.header, self, hints or {})
        return CsvTable(file=self, table=table)

    def line(self, row: int) -> int:
        """The file line of data row ``row`` (0-based, empty lines skipped); reads the file (error
        paths only)."""
        return _file_line(self.path, row + 1 + int(self.header))


@dataclass(frozen=True)
class CsvTable:
    """The columns :meth:`CsvFile.read` read, as checked numpy arrays."""

    file: CsvFile
    table: pa.Table

    @property
    def num_rows(self) -> int:
        """The number of records read (data rows; the header is not one)."""
        return self.table.num_rows

    def numbers(self, columns: Iterable[int]) -> np.ndarray:
        """Columns as a C-ordered float64 matrix (rows, columns); NaN or infinite cells are refused,
        naming the first."""
        columns = list(columns)
        if not columns:
            return np.zeros((self.num_rows, 0))
        x = np.column_stack([self.table.column(self.file.arrow_names[j]).to_numpy()
                             for j in columns])
        x = np.ascontiguousarray(x, dtype=np.float64)
        bad = ~np.isfinite(x)
        if bad.any():
            row, k = map(int, np.argwhere(bad)[0])
            count = int(bad.sum())
            raise DataError(
                f"{self.file.path}: {count} NaN or infinite value{'s' if count > 1 else ''} "
                f"(first at line {self.file.line(row)}, {self.file.label(columns[k])}: "
                f"{x[row, k]}). {_CLEAN}")
        return x

    def text(self, column: int) -> pa.Array:
        """A text column, each value stripped of spaces; a value holding a line break (an open
        quote) is refused."""
        values = pac.utf8_trim_whitespace(self.table.column(self.file.arrow_names[
            column]).combine_chunks())
        broken = pac.match_substring(values, "\n").to_numpy(zero_copy_only=False)
        if broken.any():
            row = int(np.argmax(broken))
            raise DataError(_open_quote(self.file.path, self.file.line(row),
                                        self.file.label(column)))
        return values


def _read_options(header: bool) -> pcsv.ReadOptions:
    # One thread: pyarrow then numbers the rows in its errors (and two cores are no faster for our
    # files).
    return pcsv.ReadOptions(use_threads=False, autogenerate_column_names=not header)


def _parse_options(invalid: list[pcsv.InvalidRow]) -> pcsv.ParseOptions:
    def refuse(row: pcsv.InvalidRow) -> str:  # keep the first bad row, to describe it
        invalid.append(row)
        return "error"
    return pcsv.ParseOptions(invalid_row_handler=refuse, ignore_empty_lines=True)


def _arrow(path: Path, call: Callable[[], T], invalid: list[pcsv.InvalidRow], header: bool,
           file: CsvFile | None = None, hints: Mapping[int, str] | None = None) -> T:
    """``call()``, with pyarrow's errors turned into one-line DataErrors that name the line and
    column."""
    try:
        return call()
    except UnicodeDecodeError:
        raise DataError(_not_utf8(
            path) or f"Cannot read {path}: it is not UTF-8 text. Save it as UTF-8 CSV.") from None
    except pa.ArrowInvalid as exc:
        raise DataError(_explain(path, str(exc), invalid, header, file, hints or {})) from None
    except OSError as exc:  # a missing file, or a truncated or broken gzip stream
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DataError(
            f"Cannot read {path}: {first}. Check the file (a .gz file must be complete gzip)."
        ) from None


def _explain(path: Path, message: str, invalid: list[pcsv.InvalidRow], header: bool,
             file: CsvFile | None, hints: Mapping[int, str]) -> str:
    """The one-line message of a file pyarrow refused: encoding first (it causes the rest), then the
    row."""
    not_utf8 = _not_utf8(path)
    if not_utf8:
        return not_utf8
    if message.startswith("Empty CSV file"):
        return (f"Cannot read {path}: the file is empty (a CSV file needs a header line and data "
                f"lines).")
    if invalid:
        row = invalid[0]
        line = _file_line(path, row.number) if row.number else "?"
        if row.text.count('"') % 2:
            return _open_quote(path, line,
                               f"in {row.actual_columns} fields where {row.expected_columns} were "
                               f"expected")
        first = "the header (line 1)" if header else "the first line"
        fields = f"{row.actual_columns} field{'s' if row.actual_columns != 1 else ''}"
        return (f"{path}: line {line} has {fields}, {first} has {row.expected_columns}. Every line "
                "needs one value per column: fix or remove that line.")
    found = _CONVERSION.search(message)
    if found and file is not None and int(found[1]) < len(file.names):
        # column #: of the file
        column, line, value = int(found[1]), _file_line(path, int(found[2])), found[3]
        if "\n" in value:
            return _open_quote(path, line, file.label(column))
        return (f"{path}: line {line}, {file.label(column)} holds {value!r}, not a number. "
                f"{hints.get(column, _CLEAN)}")
    return f"Cannot read {path}: {message.splitlines()[0] if message else 'pyarrow refused it'}."


def _open_quote(path: Path, line: int | str, where: str) -> str:
    return (
        f"{path}: line {line}, {where}: an unbalanced quote (\"): the quoted value is not closed "
        f"on its line. "
            "Close the quote, or remove it.")


def _raw(path: Path) -> bytes:
    return gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()


def _not_utf8(path: Path) -> str | None:
    """The message for a file that is not UTF-8 (None if it is): which line and byte, and what to
    do."""
    try:
        raw = _raw(path)
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        byte = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        return (f"Cannot read {path}: it is not UTF-8 text (line {line}, byte {byte} of that "
                f"line: 0x{raw[exc.start]:02x}, {exc.reason}). Save it as UTF-8 CSV (with or "
                f"without a byte-order mark), e.g. `iconv -f latin1 -t utf-8 {path.name} > "
                f"fixed.csv`.")
    except (OSError, EOFError):
        return None
    return None


def _file_line(path: Path, record: int) -> int:
    """The 1-based file line of pyarrow's row ``record`` (which does not count empty lines)."""
    seen = 0
    for number, line in enumerate(_raw(path).split(b"\n"), start=1):
        if line not in (b"", b"\r"):
            seen += 1
            if seen == record:
                return number
    return record
