"""The regime map's reading: its cells from the studies' ``summary.json`` files and the run files
they name.

Every number of a cell comes from the run files (``runs/<run_id>.json`` beside the summary); of the
summary only the run ids, the seed list, the chosen points, the grids, the methods' ``base_method``
and the dataset's n and d are read (:mod:`.regime`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable, Mapping

from ..study.runner import load_study, replay_study
from .cells import ENDPOINTS, Cell, RegimeError, stall_reason

__all__ = ["RUN_KEYS", "cells_from_summary", "read_cells", "read_run", "replay_tables",
           "study_files", "summary_paths"]

RUN_KEYS = ("rounds", "train_loss", "grad_norm_sq", "test_loss")


def summary_paths(paths: Iterable[str | Path]) -> list[Path]:
    """The ``summary.json`` files named: a file itself, a study folder holding one, or a folder
    whose sub-folders hold them (e.g. the family's output folder)."""
    out: list[Path] = []
    for given in paths:
        path = Path(given).expanduser()
        if path.is_file():
            out.append(path)
        elif (path / "summary.json").is_file():
            out.append(path / "summary.json")
        elif path.is_dir() and sorted(path.glob("*/summary.json")):
            out += sorted(path.glob("*/summary.json"))
        else:
            raise RegimeError(
                f"{path}: no summary.json there nor in its sub-folders. Pass the folders of "
                f"finished "
                              "studies (diff2 experiment writes <output.dir>/<name>/summary.json).")
    return out


def _pick(source: str, methods: Mapping[str, Any], base: str, name: str | None, option: str) -> str:
    if name is not None:
        if name not in methods:
            raise RegimeError(
                f"{source}: no method {name!r} ({option}); the study has {sorted(methods)}.")
        return name
    found = [m for m, e in methods.items() if e.get("base_method") == base]
    if base == "dpgd" and found:
        # the study's own control (its t-tests compare every DIFF2 method with the first DP-GD)
        return found[0]
    if len(found) != 1:
        raise RegimeError(
            f"{source}: expected exactly one {base} method to compare, found {found or 'none'}. "
                          f"Name one with {option}.")
    return found[0]


def read_run(path: Path) -> dict[str, Any]:
    """One run file (``runs/<run_id>.json``): its per-round lists with null read as inf (a diverged
    run)."""
    if not path.is_file():
        raise RegimeError(
            f"{path}: run file missing. The regime map computes every number from the runs the "
            f"summary "
                          "names: keep the study's runs/ folder beside its summary.json (diff2 "
                          "experiment writes both; "
                          "running it again recomputes a missing run).")
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise RegimeError(f"Cannot read {path}: {exc}.") from None
    missing = [k for k in RUN_KEYS if not isinstance(record.get(k), list) or not record[k]]
    if missing:
        raise RegimeError(
            f"{path}: expected non-empty per-round lists {', '.join(RUN_KEYS)}; missing or empty: "
            f"{', '.join(missing)}. Run `diff2 experiment` on the study again to rewrite its runs.")
    if len({len(record[k]) for k in RUN_KEYS}) != 1:
        raise RegimeError(f"{path}: the per-round lists {', '.join(RUN_KEYS)} differ in length "
                          f"({[len(record[k]) for k in RUN_KEYS]}); expected one entry per "
                          f"recorded round.")
    out = dict(record)
    for k in RUN_KEYS[1:]:
        out[k] = [math.inf if v is None else float(v) for v in record[k]]
    out.setdefault("diverged_at", None)
    return out


def cells_from_summary(summary: Mapping[str, Any], source: str = "<summary>", *,
                       diff2: str | None = None, control: str | None = None,
                       runs_dir: Path | None = None) -> list[Cell]:
    """The cells of one study: one per ε, every per-seed value read from the run files in
    ``runs_dir`` (default: ``runs/`` beside ``source``)."""
    info = summary.get("dataset")
    if not isinstance(info, Mapping) or "train" not in info or "parameters" not in info:
        raise RegimeError(
            f"{source}: the summary lacks `dataset.train` and `dataset.parameters` (n and d; "
            f"written "
                          "by diff2 experiment since the regime map exists). Run `diff2 "
                          "experiment` on the study "
                          "again: it reuses every run and rewrites the summary.")
    seeds = summary.get("eval_seeds")
    if not isinstance(seeds, list) or len(seeds) < 2:
        raise RegimeError(
            f"{source}: expected `eval_seeds`, a list of at least 2 seeds (the paired t-test and "
            f"the bootstrap pair runs by seed). Found {seeds!r}.")
    runs_dir = Path(source).parent / "runs" if runs_dir is None else runs_dir
    out = []
    for eps_key, entry in summary["epsilons"].items():
        methods = entry["methods"]
        treat = _pick(source, methods, "diff2", diff2, "--diff2")
        ctrl = _pick(source, methods, "dpgd", control, "--control")
        runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for m in (treat, ctrl):
            for c in {e.criterion for e in ENDPOINTS.values()}:
                ids = methods[m]["criteria"][c]["run_ids"]
                if len(ids) != len(seeds):
                    raise RegimeError(
                        f"{source}: ε = {eps_key}, {m}, {c}: expected one run id per eval seed "
                                      f"({len(seeds)}), found {len(ids)}.")
                runs[m, c] = [read_run(runs_dir / f"{rid}.json") for rid in ids]
        values = {m: {e.name: tuple(e.value(r) for r in runs[m, e.criterion])
                      for e in ENDPOINTS.values()}
                  for m in (treat, ctrl)}
        stalled = tuple(f"{m} seed {s}: {why}" for m in (treat, ctrl)
                        for s, r in zip(seeds, runs[m,
                                                    "grad_norm_sq"])
                                                    if (why := stall_reason(r)) is not None)
        out.append(Cell(
            dataset=str(info.get("name") or info.get("settings", {}).get("name")),
            n=int(info["train"]), epsilon=float(eps_key), d=int(info["parameters"]), study=source,
            diff2=treat, control=ctrl, seeds=tuple(int(s) for s in seeds),
            diff2_values=values[treat], control_values=values[ctrl], stalled=stalled,
            train_available=info.get("train_available"),
            points={m: {c: methods[m]["criteria"][c]["point"] for c in methods[m][
                "criteria"]} for m in (treat, ctrl)},
                grids={m: methods[m].get("grid", {}) for m in (treat, ctrl)}))
    return out


def read_cells(paths: Iterable[str | Path], *, diff2: str | None = None,
               control: str | None = None) -> list[Cell]:
    """Every cell of the studies found under ``paths`` (see :func:`summary_paths`), sorted by
    dataset, n, ε."""
    cells: dict[tuple[str, int, float], Cell] = {}
    for path in summary_paths(paths):
        try:
            summary = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise RegimeError(f"Cannot read {path}: {exc}.") from None
        for cell in cells_from_summary(summary, str(path), diff2=diff2, control=control,
                                       runs_dir=path.parent / "runs"):
            key = (cell.dataset, cell.n, cell.epsilon)
            if key in cells:
                raise RegimeError(
                    f"Two summaries hold dataset {cell.dataset}, n = {cell.n}, ε = "
                    f"{cell.epsilon:g}: {cells[key].study} and {path}. Pass each cell's study "
                    f"once.")
            cells[key] = cell
    if not cells:
        raise RegimeError("No cells: the summaries hold no ε.")
    return [cells[k] for k in sorted(cells)]


def study_files(paths: Iterable[str | Path]) -> list[Path]:
    """The study files named: a YAML file itself, or a folder's ``*.yaml`` (e.g.
    ``configs/regime``)."""
    out: list[Path] = []
    for given in paths:
        path = Path(given).expanduser()
        if path.is_file():
            out.append(path)
        elif path.is_dir() and sorted(path.glob("*.yaml")):
            out += sorted(path.glob("*.yaml"))
        else:
            raise RegimeError(f"{path}: not a study file nor a folder of them (*.yaml). With "
                              "--from-tables, pass the family's study files, e.g. configs/regime.")
    return out


def replay_tables(paths: Iterable[str | Path], tables: str | Path,
                  output_root: str | Path) -> list[Path]:
    """Replay every study named (:func:`study_files`) from its run table ``<tables>/<study
    name>.csv.gz`` into ``output_root``; return their ``summary.json`` files. Nothing is
    computed: every number of the map then comes from the committed tables."""
    out = []
    for path in study_files(paths):
        out.append(replay_study(load_study(path), tables, output_root)[1] / "summary.json")
    return out
