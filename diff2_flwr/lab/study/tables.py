"""A study's run table: every run of a study in one compact CSV file, the published form of its
results (issue 42, item 1).

A study writes ``runs.csv.gz`` beside its ``summary.json`` (gzip, with no time stamp in its header,
so the same runs give the same bytes): one row per run with what it is (study,
registration hash, dataset, ε, method, base method, routine, grid point, seed, role tune/evaluate,
run id, engine), its endpoints at every evaluated round (train loss, ‖∇f‖², test loss, and test
accuracy for a classification dataset; a run that diverged has no value from its divergence on)
and its share of the wall time of the unit that computed it. Lists and points are JSON inside
their cells, floats as ``repr`` writes them, so that reading a table back gives the very numbers
the analysis read.

``diff2 experiment FILE --from-table TABLE`` replays a study from its table alone
(:func:`unpack`, :class:`TableExecutor`): the run files are written back from the rows, and the
study runs as it did (tuning, selection, the grid's extensions, evaluation, the tests) with an
executor that computes nothing: a run the study plans and the table lacks stops it in one line. The
summary it writes then holds every figure the study published, recomputed from the table.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import math
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from ...runtime.outputs import to_json
from .claims import atomic_write_bytes, atomic_write_text
from .spec import ACCURACY, CRITERIA, StudyError

__all__ = ["COLUMNS", "TABLE_FILE", "TABLE_SUFFIX", "TableExecutor", "read_table", "role_of",
           "table_path", "table_rows", "unpack", "write_table"]

#: The columns of a run table, in order.
COLUMNS = ("study", "registration", "dataset", "epsilon", "method", "base_method", "routine",
           "point", "seed", "role", "run_id", "engine", "diverged_at", "rounds",
           *CRITERIA, ACCURACY, "wall_s")

#: The role of a run by its id's phase (:func:`~.plan.run_id`).
_ROLES = {"tune": "tune", "eval": "evaluate"}


def role_of(run_id: str) -> str:
    """``tune`` or ``evaluate``, from the phase that starts a run id."""
    phase = run_id.split("-", 1)[0]
    if phase not in _ROLES:
        raise ValueError(f"run id {run_id!r}: expected it to start with tune- or eval-")
    return _ROLES[phase]


def _cell(value: Any) -> str:
    """A list, mapping or number as compact JSON (inf and NaN as null), None as empty."""
    if value is None:
        return ""
    return json.dumps(to_json(value), separators=(",", ":"), sort_keys=True)


def table_rows(study_name: str, dataset: str, registration: str | None,
               records: Iterable[Mapping[str, Any]]) -> list[dict[str, str]]:
    """The table's rows of run records (as :func:`~.scheduler.load_run` reads them), in run-id
    order."""
    rows = []
    for r in sorted(records, key=lambda r: r["run_id"]):
        rows.append({
            "study": study_name, "registration": registration or "", "dataset": dataset,
            "epsilon": repr(float(r["epsilon"])), "method": r["method"],
            "base_method": r["base_method"], "routine": _cell(r.get("routine")),
            "point": _cell(r["point"]), "seed": str(int(r["seed"])), "role": role_of(r["run_id"]),
            "run_id": r["run_id"], "engine": r["engine"],
            "diverged_at": "" if r.get("diverged_at") is None else str(int(r["diverged_at"])),
            "rounds": _cell(r["rounds"]),
            **{c: _cell(r[c]) for c in CRITERIA},
            ACCURACY: _cell(r.get(ACCURACY)),
            "wall_s": "" if r.get("wall_s") is None else repr(float(r["wall_s"]))})
    return rows


#: The file name of a study's run table beside its summary, and the suffix of a published one.
TABLE_FILE = "runs.csv.gz"
TABLE_SUFFIX = ".csv.gz"


def _gzipped(path: Path) -> bool:
    return path.name.endswith(".gz")


def write_table(path: Path, rows: list[dict[str, str]]) -> Path:
    """Write the rows as CSV (whole, atomically); gzip-compressed when the name ends in ``.gz``,
    with a zero time stamp so that equal rows give equal bytes."""
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    if not _gzipped(path):
        atomic_write_text(path, text.getvalue())
        return path
    atomic_write_bytes(path, gzip.compress(text.getvalue().encode("utf-8"), compresslevel=9,
                                           mtime=0))
    return path


def table_path(folder: str | Path, name: str) -> Path:
    """A published table of study ``name`` in ``folder``: ``name.csv.gz``, or ``name.csv`` if only
    that exists."""
    folder = Path(folder)
    plain = folder / f"{name}.csv"
    packed = folder / f"{name}{TABLE_SUFFIX}"
    return plain if plain.is_file() and not packed.is_file() else packed


def read_table(path: str | Path) -> list[dict[str, Any]]:
    """The run records of a table, as the run files hold them (JSON's nulls in the criteria read as
    inf, in the accuracy as NaN, as :func:`~.scheduler.load_run` reads them)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
        text = gzip.decompress(raw) if _gzipped(path) else raw
        reader = csv.DictReader(io.StringIO(text.decode("utf-8"), newline=""))
    except (OSError, EOFError, UnicodeDecodeError) as err:
        raise StudyError(f"{path}: not a readable run table ({err}); expected the CSV (or "
                         "gzip-compressed CSV, .csv.gz) that diff2 experiment writes.") from None
    missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
    if missing:
        raise StudyError(f"{path}: a run table has the columns {', '.join(COLUMNS)}; this "
                         f"file lacks {', '.join(missing)}. Was it written by diff2 "
                         "experiment?")
    return [_record(path, i + 2, row) for i, row in enumerate(reader)]


def _record(path: Path, line: int, row: Mapping[str, str]) -> dict[str, Any]:
    def cell(key: str) -> Any:
        return None if row[key] == "" else json.loads(row[key])

    try:
        record: dict[str, Any] = {
            "run_id": row["run_id"], "method": row["method"], "base_method": row["base_method"],
            "routine": cell("routine"), "point": cell("point"), "epsilon": float(row["epsilon"]),
            "seed": int(row["seed"]), "engine": row["engine"],
            "diverged_at": None if row["diverged_at"] == "" else int(row["diverged_at"]),
            "rounds": cell("rounds"),
            "registration": row["registration"] or None,
            "wall_s": None if row["wall_s"] == "" else float(row["wall_s"])}
        for c in CRITERIA:
            record[c] = [math.inf if v is None else float(v) for v in cell(c)]
        if row[ACCURACY] != "":
            record[ACCURACY] = [math.nan if v is None else float(v) for v in cell(ACCURACY)]
    except (ValueError, TypeError, KeyError) as err:
        raise StudyError(f"{path}, line {line} (run {row.get('run_id')!r}): a cell does not "
                         f"read as the table's columns ({err}); the table is damaged: take it "
                         "from the repository again.") from None
    return record


def unpack(records: Iterable[Mapping[str, Any]], runs_dir: Path, source: str) -> int:
    """Write each record back as a run file in ``runs_dir`` (as the scheduler writes one, computed
    by ``source``); return how many."""
    runs_dir.mkdir(parents=True, exist_ok=True)
    count = 0
    for r in records:
        record = {**r, "computed_by": {"table": source}}
        atomic_write_text(runs_dir / f"{r['run_id']}.json", json.dumps(to_json(record)))
        count += 1
    return count


class TableExecutor:
    """The executor of a study replayed from its table: every run it plans is in the table (its run
    file written back), so nothing is submitted; a run that is not stops the study in one line."""

    name = "table"
    #: units submitted and not yet collected: never any
    in_flight = 0

    def __init__(self, table: str, describe_run: Callable[[Any], str]) -> None:
        self.table = table
        self._describe_run = describe_run

    def has_capacity(self) -> bool:
        """Always: a submission is the error it reports."""
        return True

    def submit(self, study: Any, unit: Any, progress: Any = None) -> None:
        """Refuse: the table lacks a run the study plans."""
        job = unit.jobs[0]
        raise StudyError(
            f"{study.source}: the run table {self.table} lacks run {job.run_id} "
            f"({self._describe_run(job)}) that the study plans, and a replay computes nothing. "
            "The study file or the code that plans it is not the one the table was made with: "
            "take the study file of the table's commit.")

    def completed(self, timeout: float) -> list:
        """Nothing is ever computed."""
        return []

    def close(self) -> None:
        """Nothing to stop."""

    def describe(self) -> dict[str, Any]:
        """What the summary says of this executor."""
        return {"executor": self.name, "table": self.table}
