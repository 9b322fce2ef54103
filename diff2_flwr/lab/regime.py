"""The regime map: where DIFF2-GD beats DP-GD, over the training set's size n and the budget ε.

A *family* of studies (``configs/regime/``: one study per dataset and n, each with a list of ε and the
two methods tuned alike) leaves one ``summary.json`` per study and its ``runs/`` folder. Each
(dataset, n, ε) is a *cell*. Everything the map reports is computed here from the run files the
summary names (``summary["epsilons"][ε]["methods"][m]["criteria"][c]["run_ids"]``, in the order of
``summary["eval_seeds"]``); of the summary only the run ids, the seed list, the chosen points, the grids,
the methods' ``base_method`` and the dataset's n and d (``dataset.train``, ``dataset.parameters``) are read,
never its means or tests.

**Endpoints** (per seed, from the runs of the criterion's own chosen point; no test-set oracle):

* ``grad_norm_sq_final`` — ‖∇f‖² at the last recorded round (runs of the ‖∇f‖²-best point). The
  *primary* endpoint: the only one the theory speaks of, and the only one fitted against it.
* ``grad_norm_sq_min`` — the smallest ‖∇f‖² over rounds (same runs; exploratory).
* ``train_loss_min`` — the smallest train loss over rounds (runs of the train-loss-best point; exploratory).
* ``test_loss_at_train_best`` — the test loss *at the round where that run's train loss is smallest*
  (same runs; never the smallest test loss, which would pick the round by the test set; exploratory).

Per cell and endpoint: ratio = mean over seeds of DIFF2-GD's value / mean over seeds of DP-GD's (< 1:
DIFF2-GD lower), and the two-sided paired t-test by seed (:func:`.inference.paired_ttest`; on log values
for ‖∇f‖², which spans decades). Adjusted across the cells: **Holm** over the primary endpoint's family
(every cell), **Benjamini–Hochberg** q over one family holding every exploratory endpoint of every cell.
A test whose p is NaN (a diverged run) still counts in its family. A cell is marked ``*`` (DIFF2-GD
lower) or ``†`` (DP-GD lower) when its *adjusted* p < α, the direction the sign of the mean paired
difference on the tested scale (for ‖∇f‖² the mean log difference, which can disagree in sign with a
ratio of arithmetic means when one seed dominates a mean). Loss ratios are descriptive and exploratory: the theory predicts
nothing about them, and no slope is fitted to them.

**The fit** (Murata & Suzuki 2023): DP-GD reaches ‖∇f‖² ≲ √d/(nε) and DIFF2-GD d^{2/3}/(nε)^{4/3}, so the
ratio of the *bounds* is (nε/√d)^{-1/3}. Over the cells whose per-seed final ‖∇f‖² are all finite and
positive, least squares fits

    log10(ratio) = a_dataset + b · log10(nε/√d)

(one intercept per dataset — the bounds' constants differ by dataset — and one common slope b; n the
training records, i.e. the sum of the shard sizes; d the model's parameters). Its 95 % interval and the
p-value of H0: b = −1/3 come from a **cluster bootstrap over evaluation seeds**: the cells share their
seeds and what a seed fixes (the starting point among others), so their errors are not independent and
an OLS interval over the cells would be too narrow; a replicate draws seed indices with
replacement once and uses the same indices in every cell, recomputes each cell's ratio of seed means
and refits; B replicates (:data:`BOOTSTRAP_REPLICATES`) from ``numpy.random.default_rng(seed)`` with a
fixed default seed (:data:`BOOTSTRAP_SEED`); percentile interval; p = 2·min(share ≤ −1/3, share ≥ −1/3),
at least 1/(B+1). When the studies of a map evaluated different seed lists (of one length), the
bootstrap resamples seed *positions* (the index in each study's ``eval_seeds``), which treats the i-th
seed of every study as one cluster; the output says which (``bootstrap.cluster``). With S seeds the
bootstrap has few distinct resamples (126 for S = 5) and a percentile interval from few clusters tends to
be too narrow: read it as a lower bound on the uncertainty. It also holds the cells fixed (their tuned
points, their departures from a straight line): the fit reports the cells' residual scatter beside the
seed-resampling spread of a cell's ratio (``lack_of_fit``), and when the first is much larger the interval
understates the slope's uncertainty. Per-dataset slopes are exploratory lines.

**Stalled runs** (:data:`STALL_PROGRESS`, :func:`stall_reason`): a rule stated as a constant and applied
mechanically, not one chosen blind to the cells it removes (it was written after a review traced the
largest ratios to one stalled seed). The main fit uses every cell it can (all but those with a non-finite
final ‖∇f‖² on some seed, listed as ``not_fitted``); a *sensitivity* fit leaves out each
cell in which any run of either method at the ‖∇f‖²-best point stalled, and the report lists those cells
and why.

Outputs (:func:`write_regime`): ``heatmap_<dataset>.png`` (one panel per endpoint: the ratio over n × ε
on a log colour scale centred at 1, annotated with the ratio and its mark), ``scatter.png`` (the ratios
against nε/√d; only the ‖∇f‖² panel carries the fitted lines), ``regime.md`` and ``regime.json``;
:func:`regime_map` returns the same object, which ``diff2 regime`` prints on stdout.

References:
    Murata & Suzuki (2023), the utility bounds of DP-GD and DIFF2-GD (the ratio (nε/√d)^{-1/3}, issue 12);
    issue 20 item 4 (the review of the first fit); Field & Welsh (2007), "Bootstrapping clustered data",
    JRSS B 69 (resampling whole clusters); Holm (1979); Benjamini & Hochberg (1995).
"""

from __future__ import annotations

import io
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from .claims import atomic_write_bytes, atomic_write_text
from .analysis import endpoint_value
from .inference import benjamini_hochberg, holm, paired_ttest

__all__ = ["ALPHA", "BOOTSTRAP_REPLICATES", "BOOTSTRAP_SEED", "ENDPOINTS", "PRIMARY", "STALL_PROGRESS",
           "THEORY_SLOPE", "Cell", "Endpoint", "Fit", "RegimeError", "bootstrap_p", "cell_tests", "cells_from_summary",
           "fit_regime", "mark", "read_cells", "read_run", "regime_map", "stall_reason", "summary_paths",
           "write_regime"]

ALPHA = 0.05
#: Slope of log(DIFF2 bound / DP-GD bound) on log(nε/√d) for ‖∇f‖²: (nε/√d)^{-1/3}.
THEORY_SLOPE = -1.0 / 3.0
BOOTSTRAP_REPLICATES = 2000
#: The default seed of the bootstrap's generator: a map is reproducible unless asked otherwise.
BOOTSTRAP_SEED = 20
#: A run *stalls* when it diverged, or when its final train loss is >= STALL_PROGRESS x its train loss at the
#: first recorded round (less than 10 % progress over the run). Applied mechanically to every run of both
#: methods at the ‖∇f‖²-best point; a cell with a stalled run leaves the sensitivity fit (never the main one).
STALL_PROGRESS = 0.9
STALL_RULE = (f"a run stalls if it diverged or its final train loss is >= {STALL_PROGRESS:g} x its train loss at the "
              "first recorded round; a cell leaves the sensitivity fit if any run of either method at the "
              "‖∇f‖²-best point stalled")
MARK_BETTER, MARK_WORSE = "*", "†"
LEGEND = (f"{MARK_BETTER} DIFF2-GD lower, {MARK_WORSE} DP-GD lower: two-sided paired t-test by seed, adjusted p < α "
          "(Holm for final ‖∇f‖², Benjamini–Hochberg q for the exploratory endpoints)")
RUN_KEYS = ("rounds", "train_loss", "grad_norm_sq", "test_loss")


class RegimeError(ValueError):
    """Studies that cannot make a regime map; the message names the file and what is missing."""


@dataclass(frozen=True)
class Endpoint:
    """A per-seed value of a run: which criterion's chosen point it reads, and how it is tested."""

    name: str
    criterion: str  # the run ids of summary[...]["criteria"][criterion]
    label: str
    log: bool  # tested and coloured on log values
    primary: bool  # Holm's family and the fit; else exploratory (BH)
    value: Callable[[Mapping[str, Any]], float]


ENDPOINTS: dict[str, Endpoint] = {e.name: e for e in (
    # the study's own endpoint rules (lab.analysis): one definition of "final", "best" and "train_best"
    Endpoint("grad_norm_sq_final", "grad_norm_sq", "final ‖∇f‖²", True, True,
             lambda r: endpoint_value(r, "grad_norm_sq", "final")),
    Endpoint("grad_norm_sq_min", "grad_norm_sq", "min ‖∇f‖²", True, False,
             lambda r: endpoint_value(r, "grad_norm_sq", "best")),
    Endpoint("train_loss_min", "train_loss", "min train loss", False, False,
             lambda r: endpoint_value(r, "train_loss", "best")),
    Endpoint("test_loss_at_train_best", "train_loss", "test loss at train-best round", False, False,
             lambda r: endpoint_value(r, "test_loss", "train_best")),
)}
PRIMARY = "grad_norm_sq_final"


def stall_reason(run: Mapping[str, Any]) -> str | None:
    """Why the run stalled under :data:`STALL_PROGRESS`, or None if it did not."""
    if run.get("diverged_at") is not None:
        return f"diverged at round {run['diverged_at']}"
    first, final = run["train_loss"][0], run["train_loss"][-1]
    if not math.isfinite(final):
        return "non-finite final train loss"
    if final >= STALL_PROGRESS * first:
        return (f"final train loss {final:.4g} >= {STALL_PROGRESS:g} x {first:.4g} at the first recorded round "
                f"{run['rounds'][0]}")
    return None


@dataclass(frozen=True)
class Cell:
    """One (dataset, n, ε) of the family: both methods' per-seed endpoint values and their stalled runs."""

    dataset: str
    n: int  # training records (sum of the shard sizes)
    epsilon: float
    d: int  # the model's parameters
    study: str  # the summary.json it came from
    diff2: str  # method names in that study
    control: str
    seeds: tuple[int, ...]  # the study's eval_seeds: position i of every per-seed tuple
    diff2_values: Mapping[str, Sequence[float]]  # endpoint -> per-seed values (inf: diverged)
    control_values: Mapping[str, Sequence[float]]
    stalled: tuple[str, ...] = ()  # one line per stalled run at the ‖∇f‖²-best point
    train_available: int | None = None  # records of the whole train split when n is a subsample
    points: Mapping[str, Mapping[str, Mapping[str, float]]] = field(default_factory=dict)  # chosen hyper-parameters
    grids: Mapping[str, Mapping[str, Sequence[float]]] = field(default_factory=dict)  # each method's grid

    @property
    def x(self) -> float:
        """nε/√d."""
        return self.n * self.epsilon / math.sqrt(self.d)

    @property
    def label(self) -> str:
        return f"{self.dataset} n={self.n} ε={self.epsilon:g}"

    def mean(self, endpoint: str, method: str) -> float:
        values = self.diff2_values if method == self.diff2 else self.control_values
        v = np.asarray(values[endpoint], dtype=float)
        return float(v.mean()) if np.all(np.isfinite(v)) else math.inf

    def ratio(self, endpoint: str) -> float:
        """DIFF2-GD's seed mean / DP-GD's (inf or 0 when one of them diverged on a seed, NaN when both did)."""
        a, b = self.mean(endpoint, self.diff2), self.mean(endpoint, self.control)
        if not (math.isfinite(a) and math.isfinite(b)):
            return math.nan if not math.isfinite(a) and not math.isfinite(b) else (math.inf if not math.isfinite(a)
                                                                                   else 0.0)
        return a / b if b > 0 else math.nan

    def fit_ready(self, endpoint: str = PRIMARY) -> bool:
        """Every per-seed value of both methods finite and positive (a ratio of seed means under any resample)."""
        v = np.asarray([self.diff2_values[endpoint], self.control_values[endpoint]], dtype=float)
        return bool(np.all(np.isfinite(v)) and np.all(v > 0))

    def tested(self, endpoint: str) -> tuple[np.ndarray, np.ndarray]:
        """The two per-seed samples the t-test compares (log10 for a log endpoint)."""
        a, b = (np.asarray(v[endpoint], dtype=float) for v in (self.diff2_values, self.control_values))
        if ENDPOINTS[endpoint].log:
            with np.errstate(divide="ignore", invalid="ignore"):
                a, b = np.log10(a), np.log10(b)
        return a, b

    def p_value(self, endpoint: str) -> float:
        """Raw two-sided p of the paired t-test by seed (NaN if a difference is not finite)."""
        return paired_ttest(*self.tested(endpoint), "two-sided")

    def mean_difference(self, endpoint: str) -> float:
        """Mean over seeds of DIFF2-GD − DP-GD on the tested scale (< 0: DIFF2-GD lower)."""
        a, b = self.tested(endpoint)
        with np.errstate(invalid="ignore"):
            d = a - b
        return float(d.mean()) if np.all(np.isfinite(d)) else math.nan

    def edges(self, criterion: str) -> dict[str, list[str]]:
        """Per method, the hyper-parameters chosen at the lowest or highest value of their grid axis (an axis of
        more than one value): there the grid may have been too narrow for that method, and the ratio unfair."""
        out: dict[str, list[str]] = {}
        for method in (self.diff2, self.control):
            point, grid = self.points.get(method, {}).get(criterion, {}), self.grids.get(method, {})
            hits = [f"{k}={v:g} ({'lowest' if v == min(grid[k]) else 'highest'})" for k, v in point.items()
                    if len(grid.get(k, ())) > 1 and v in (min(grid[k]), max(grid[k]))]
            if hits:
                out[method] = hits
        return out


def mark(p_adjusted: float, mean_difference: float, alpha: float = ALPHA) -> str:
    """``*`` if the adjusted p < α and DIFF2-GD is lower on average, ``†`` if DP-GD is, else ``""``."""
    if not (math.isfinite(p_adjusted) and math.isfinite(mean_difference)) or p_adjusted >= alpha:
        return ""
    return MARK_BETTER if mean_difference < 0 else MARK_WORSE if mean_difference > 0 else ""


def cell_tests(cells: Sequence[Cell], alpha: float = ALPHA) -> list[dict[str, dict[str, Any]]]:
    """Per cell and endpoint: raw two-sided p, adjusted p (Holm over the primary family, BH over every
    exploratory test of the map), the mean paired difference and the mark."""
    out: list[dict[str, dict[str, Any]]] = [{} for _ in cells]
    raw = {e: [cell.p_value(e) for cell in cells] for e in ENDPOINTS}
    adjusted = {PRIMARY: holm(raw[PRIMARY])}
    exploratory = [e for e in ENDPOINTS if not ENDPOINTS[e].primary]
    q = benjamini_hochberg([p for e in exploratory for p in raw[e]])
    for j, e in enumerate(exploratory):
        adjusted[e] = q[j * len(cells):(j + 1) * len(cells)]
    for i, cell in enumerate(cells):
        for e, spec in ENDPOINTS.items():
            diff = cell.mean_difference(e)
            out[i][e] = {"p_value": raw[e][i], "p_adjusted": adjusted[e][i],
                         "adjustment": "holm" if spec.primary else "benjamini_hochberg",
                         "mean_difference": diff, "mark": mark(adjusted[e][i], diff, alpha)}
    return out


# ------------------------------------------------------------------------------------------ reading

def summary_paths(paths: Iterable[str | Path]) -> list[Path]:
    """The ``summary.json`` files named: a file itself, a study folder holding one, or a folder whose
    sub-folders hold them (e.g. the family's output folder)."""
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
            raise RegimeError(f"{path}: no summary.json there nor in its sub-folders. Pass the folders of finished "
                              "studies (diff2 experiment writes <output.dir>/<name>/summary.json).")
    return out


def _pick(source: str, methods: Mapping[str, Any], base: str, name: str | None, option: str) -> str:
    if name is not None:
        if name not in methods:
            raise RegimeError(f"{source}: no method {name!r} ({option}); the study has {sorted(methods)}.")
        return name
    found = [m for m, e in methods.items() if e.get("base_method") == base]
    if base == "dpgd" and found:
        return found[0]  # the study's own control (its t-tests compare every DIFF2 method with the first DP-GD)
    if len(found) != 1:
        raise RegimeError(f"{source}: expected exactly one {base} method to compare, found {found or 'none'}. "
                          f"Name one with {option}.")
    return found[0]


def read_run(path: Path) -> dict[str, Any]:
    """One run file (``runs/<run_id>.json``): its per-round lists with null read as inf (a diverged run)."""
    if not path.is_file():
        raise RegimeError(f"{path}: run file missing. The regime map computes every number from the runs the summary "
                          "names: keep the study's runs/ folder beside its summary.json (diff2 experiment writes both; "
                          "running it again recomputes a missing run).")
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise RegimeError(f"Cannot read {path}: {exc}.") from None
    missing = [k for k in RUN_KEYS if not isinstance(record.get(k), list) or not record[k]]
    if missing:
        raise RegimeError(f"{path}: expected non-empty per-round lists {', '.join(RUN_KEYS)}; missing or empty: "
                          f"{', '.join(missing)}. Run `diff2 experiment` on the study again to rewrite its runs.")
    if len({len(record[k]) for k in RUN_KEYS}) != 1:
        raise RegimeError(f"{path}: the per-round lists {', '.join(RUN_KEYS)} differ in length "
                          f"({[len(record[k]) for k in RUN_KEYS]}); expected one entry per recorded round.")
    out = dict(record)
    for k in RUN_KEYS[1:]:
        out[k] = [math.inf if v is None else float(v) for v in record[k]]
    out.setdefault("diverged_at", None)
    return out


def cells_from_summary(summary: Mapping[str, Any], source: str = "<summary>", *, diff2: str | None = None,
                       control: str | None = None, runs_dir: Path | None = None) -> list[Cell]:
    """The cells of one study: one per ε, every per-seed value read from the run files in ``runs_dir``
    (default: ``runs/`` beside ``source``)."""
    info = summary.get("dataset")
    if not isinstance(info, Mapping) or "train" not in info or "parameters" not in info:
        raise RegimeError(f"{source}: the summary lacks `dataset.train` and `dataset.parameters` (n and d; written "
                          "by diff2 experiment since the regime map exists). Run `diff2 experiment` on the study "
                          "again: it reuses every run and rewrites the summary.")
    seeds = summary.get("eval_seeds")
    if not isinstance(seeds, list) or len(seeds) < 2:
        raise RegimeError(f"{source}: expected `eval_seeds`, a list of at least 2 seeds (the paired t-test and the "
                          f"bootstrap pair runs by seed). Found {seeds!r}.")
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
                    raise RegimeError(f"{source}: ε = {eps_key}, {m}, {c}: expected one run id per eval seed "
                                      f"({len(seeds)}), found {len(ids)}.")
                runs[m, c] = [read_run(runs_dir / f"{rid}.json") for rid in ids]
        values = {m: {e.name: tuple(e.value(r) for r in runs[m, e.criterion]) for e in ENDPOINTS.values()}
                  for m in (treat, ctrl)}
        stalled = tuple(f"{m} seed {s}: {why}" for m in (treat, ctrl)
                        for s, r in zip(seeds, runs[m, "grad_norm_sq"]) if (why := stall_reason(r)) is not None)
        out.append(Cell(
            dataset=str(info.get("name") or info.get("settings", {}).get("name")), n=int(info["train"]),
            epsilon=float(eps_key), d=int(info["parameters"]), study=source, diff2=treat, control=ctrl,
            seeds=tuple(int(s) for s in seeds), diff2_values=values[treat], control_values=values[ctrl],
            stalled=stalled, train_available=info.get("train_available"),
            points={m: {c: methods[m]["criteria"][c]["point"] for c in methods[m]["criteria"]} for m in (treat, ctrl)},
            grids={m: methods[m].get("grid", {}) for m in (treat, ctrl)}))
    return out


def read_cells(paths: Iterable[str | Path], *, diff2: str | None = None, control: str | None = None) -> list[Cell]:
    """Every cell of the studies found under ``paths`` (see :func:`summary_paths`), sorted by dataset, n, ε."""
    cells: dict[tuple[str, int, float], Cell] = {}
    for path in summary_paths(paths):
        try:
            summary = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise RegimeError(f"Cannot read {path}: {exc}.") from None
        for cell in cells_from_summary(summary, str(path), diff2=diff2, control=control, runs_dir=path.parent / "runs"):
            key = (cell.dataset, cell.n, cell.epsilon)
            if key in cells:
                raise RegimeError(f"Two summaries hold dataset {cell.dataset}, n = {cell.n}, ε = {cell.epsilon:g}: "
                                  f"{cells[key].study} and {path}. Pass each cell's study once.")
            cells[key] = cell
    if not cells:
        raise RegimeError("No cells: the summaries hold no ε.")
    return [cells[k] for k in sorted(cells)]


# ------------------------------------------------------------------------------------------ the fit

@dataclass(frozen=True)
class Fit:
    """log10(ratio) = a_dataset + b·log10(nε/√d) over k cells, with a cluster-bootstrap interval for b."""

    cells: tuple[str, ...]  # the cells' labels
    slope: float
    intercepts: Mapping[str, float]  # per dataset
    ci_low: float
    ci_high: float
    p_theory: float  # bootstrap, two-sided: H0 b = −1/3
    p_zero: float  # bootstrap, two-sided: H0 b = 0 (the ratio does not change with nε/√d)
    replicates: int
    seed: int
    cluster: str  # "seed" (one seed list) or "seed position" (different lists of one length)
    anchor_log_x: float  # the points' mean log10 x and log10 ratio: where the theory's line is drawn through
    anchor_log_ratio: float
    residual_sd: float = math.nan  # log10 scatter of the cells about the fitted lines (k − datasets − 1 dof)
    seed_sd: float = math.nan  # log10 spread of a cell's ratio under the bootstrap (root mean square over cells)

    @property
    def k(self) -> int:
        return len(self.cells)

    @property
    def theory_in_ci(self) -> bool:
        """−1/3 inside the interval (within rounding, 1e-12, as :func:`bootstrap_p` counts ties)."""
        return self.ci_low - 1e-12 <= THEORY_SLOPE <= self.ci_high + 1e-12

    def crossing(self, dataset: str) -> float:
        """nε/√d where the dataset's fitted ratio is 1 (NaN for a flat fit, inf beyond floating point)."""
        if self.slope == 0:
            return math.nan
        try:
            return 10 ** (-self.intercepts[dataset] / self.slope)
        except OverflowError:  # a nearly flat fit
            return math.inf

    def as_dict(self) -> dict[str, Any]:
        return {"k": self.k, "cells": list(self.cells), "slope": self.slope, "ci95": [self.ci_low, self.ci_high],
                "intercepts": dict(self.intercepts), "p_slope_equals_theory": self.p_theory,
                "p_slope_equals_zero": self.p_zero, "theory_slope": THEORY_SLOPE, "theory_in_ci": self.theory_in_ci,
                "crossing_x": {ds: self.crossing(ds) for ds in self.intercepts},
                "bootstrap": {"replicates": self.replicates, "seed": self.seed, "cluster": self.cluster,
                              "interval": "percentile"},
                "lack_of_fit": {"residual_sd_log10": self.residual_sd, "seed_sd_log10": self.seed_sd},
                "theory_line_through": {"x": 10 ** self.anchor_log_x, "ratio": 10 ** self.anchor_log_ratio}}


def bootstrap_p(replicates: np.ndarray, null: float) -> float:
    """Two-sided bootstrap p of H0 slope = ``null``: 2·min(share ≤ null, share ≥ null), in [1/(B+1), 1].

    A replicate within rounding (1e-12) of ``null`` counts on both sides: an exactly constructed slope is a tie,
    not a coin toss of floating-point error.
    """
    b = replicates.size
    tie = np.abs(replicates - null) <= 1e-12
    share = min(float(np.mean((replicates <= null) | tie)), float(np.mean((replicates >= null) | tie)))
    return min(1.0, max(2.0 * share, 1.0 / (b + 1)))


def _cluster(cells: Sequence[Cell]) -> str:
    if len({cell.seeds for cell in cells}) == 1:
        return "seed"
    sizes = {len(cell.seeds): cell for cell in cells}
    if len(sizes) > 1:
        a, b = list(sizes.values())[:2]
        raise RegimeError(f"The bootstrap resamples seed positions, but {a.study} evaluated {len(a.seeds)} seeds and "
                          f"{b.study} {len(b.seeds)}. Evaluate every study of the map on the same number of seeds "
                          "(`seeds.evaluate`), or map them separately.")
    return "seed position"


def fit_regime(cells: Sequence[Cell], *, endpoint: str = PRIMARY, replicates: int = BOOTSTRAP_REPLICATES,
               seed: int = BOOTSTRAP_SEED) -> Fit | None:
    """The dataset-effect fit over the cells whose per-seed values are finite and positive, with its cluster
    bootstrap (see the module docstring); None when the slope is not identified (fewer than 3 such cells, or no
    dataset with two different nε/√d)."""
    if replicates < 1:
        raise ValueError(f"`replicates` must be >= 1. Found {replicates}.")
    usable = [cell for cell in cells if cell.fit_ready(endpoint)]
    if len(usable) < 3:
        return None
    datasets = sorted({cell.dataset for cell in usable})
    lx = np.log10([cell.x for cell in usable])
    group = np.array([datasets.index(cell.dataset) for cell in usable])
    within = lx - np.array([lx[group == g].mean() for g in range(len(datasets))])[group]
    if float(np.sum(within ** 2)) <= 1e-24:
        return None
    cluster = _cluster(usable)
    design = np.column_stack([(group[:, None] == np.arange(len(datasets))).astype(float), lx])
    treat = np.array([cell.diff2_values[endpoint] for cell in usable], dtype=float)  # k x S
    ctrl = np.array([cell.control_values[endpoint] for cell in usable], dtype=float)
    ly = np.log10(treat.mean(axis=1) / ctrl.mean(axis=1))
    coef = np.linalg.lstsq(design, ly, rcond=None)[0]
    # one draw of seed indices per replicate, the same for every cell: the seeds are the clusters
    idx = np.random.default_rng(seed).integers(0, treat.shape[1], size=(replicates, treat.shape[1]))
    ly_b = np.log10(treat[:, idx].mean(axis=2) / ctrl[:, idx].mean(axis=2))  # k x B
    slopes = np.linalg.lstsq(design, ly_b, rcond=None)[0][-1]
    low, high = np.percentile(slopes, [2.5, 97.5])
    dof = len(usable) - design.shape[1]
    resid = ly - design @ coef
    return Fit(cells=tuple(cell.label for cell in usable), slope=float(coef[-1]),
               intercepts={ds: float(coef[g]) for g, ds in enumerate(datasets)}, ci_low=float(low),
               ci_high=float(high), p_theory=bootstrap_p(slopes, THEORY_SLOPE), p_zero=bootstrap_p(slopes, 0.0),
               replicates=replicates, seed=seed, cluster=cluster, anchor_log_x=float(lx.mean()),
               anchor_log_ratio=float(ly.mean()),
               residual_sd=float(np.sqrt(np.sum(resid ** 2) / dof)) if dof > 0 else math.nan,
               seed_sd=float(np.sqrt(np.mean(np.var(ly_b, axis=1)))))


def _fits(cells: Sequence[Cell], replicates: int, seed: int) -> dict[str, Any]:
    def fit(sub: Sequence[Cell]) -> dict[str, Any] | None:
        found = fit_regime(sub, replicates=replicates, seed=seed)
        return None if found is None else found.as_dict()

    kept = [cell for cell in cells if not cell.stalled]
    excluded = [{"dataset": cell.dataset, "n": cell.n, "epsilon": cell.epsilon, "stalled_runs": list(cell.stalled)}
                for cell in cells if cell.stalled]
    return {"endpoint": PRIMARY, "model": "log10(ratio) = a_dataset + b * log10(n*eps/sqrt(d))",
            "not_fitted": [cell.label for cell in cells if not cell.fit_ready(PRIMARY)],
            "pooled": fit(cells),
            "per_dataset": {ds: fit([c for c in cells if c.dataset == ds]) for ds in sorted({c.dataset for c in cells})},
            "sensitivity": {"rule": STALL_RULE, "excluded": excluded, "fit": fit(kept)}}


def regime_map(cells: Sequence[Cell], *, alpha: float = ALPHA, replicates: int = BOOTSTRAP_REPLICATES,
               seed: int = BOOTSTRAP_SEED) -> dict[str, Any]:
    """The machine-readable map: cells (per-seed values, ratios, raw and adjusted p, marks), counts and fits."""
    tests = cell_tests(cells, alpha)
    rows = []
    for cell, test in zip(cells, tests):
        per = {}
        for e, spec in ENDPOINTS.items():
            per[e] = {"ratio": cell.ratio(e), "diff2_mean": cell.mean(e, cell.diff2),
                      "control_mean": cell.mean(e, cell.control), "diff2_per_seed": list(cell.diff2_values[e]),
                      "control_per_seed": list(cell.control_values[e]), **test[e],
                      "exploratory": not spec.primary, "criterion": spec.criterion,
                      "diff2_point": dict(cell.points.get(cell.diff2, {}).get(spec.criterion, {})),
                      "control_point": dict(cell.points.get(cell.control, {}).get(spec.criterion, {})),
                      "grid_edges": cell.edges(spec.criterion)}
        rows.append({"dataset": cell.dataset, "n": cell.n, "epsilon": cell.epsilon, "d": cell.d, "x": cell.x,
                     "train_available": cell.train_available, "study": cell.study, "diff2_method": cell.diff2,
                     "control_method": cell.control, "eval_seeds": list(cell.seeds),
                     "stalled_runs": list(cell.stalled), "endpoints": per})
    counts = {e: {"diff2_lower": sum(t[e]["mark"] == MARK_BETTER for t in tests),
                  "dpgd_lower": sum(t[e]["mark"] == MARK_WORSE for t in tests),
                  "ratio_below_1": sum(cell.ratio(e) < 1 for cell in cells), "cells": len(cells),
                  "chosen_at_a_grid_edge": sum(bool(cell.edges(ENDPOINTS[e].criterion)) for cell in cells)}
              for e in ENDPOINTS}
    return {"alpha": alpha, "theory_slope": THEORY_SLOPE, "primary_endpoint": PRIMARY,
            "endpoints": {e: {"label": s.label, "criterion": s.criterion, "scale": "log10" if s.log else "linear",
                              "family": "primary" if s.primary else "exploratory",
                              "adjustment": "holm" if s.primary else "benjamini_hochberg"}
                          for e, s in ENDPOINTS.items()},
            "marks": {MARK_BETTER: "DIFF2-GD lower (adjusted p < alpha, mean difference < 0)",
                      MARK_WORSE: "DP-GD lower (adjusted p < alpha, mean difference > 0)"},
            "stall_rule": {"definition": STALL_RULE, "progress_threshold": STALL_PROGRESS},
            "cells": rows, "counts": counts, "fits": _fits(cells, replicates, seed)}


# ------------------------------------------------------------------------------------------ outputs

def _fmt(v: float | None, digits: int = 3) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if v == math.inf:
        return "inf"
    return f"{v:.{digits}g}"


def _fit_row(name: str, fit: Mapping[str, Any] | None) -> str:
    if fit is None:
        return f"| {name} | < 3 | – | – | – | – | – | – |"
    crossing = ", ".join(f"{ds}: {_fmt(x)}" for ds, x in fit["crossing_x"].items())
    lack = fit["lack_of_fit"]
    return (f"| {name} | {fit['k']} | {fit['slope']:.3f} | [{fit['ci95'][0]:.3f}, {fit['ci95'][1]:.3f}] | "
            f"{_fmt(fit['p_slope_equals_theory'], 2)} | {_fmt(fit['p_slope_equals_zero'], 2)} | "
            f"{_fmt(lack['residual_sd_log10'], 2)} / {_fmt(lack['seed_sd_log10'], 2)} | {crossing} |")


def markdown(cells: Sequence[Cell], result: Mapping[str, Any], alpha: float = ALPHA) -> str:
    """The cells and fits as Markdown."""
    rows = result["cells"]
    explore = [e for e in ENDPOINTS if not ENDPOINTS[e].primary]
    fits = result["fits"]
    boot = (fits["pooled"] or {}).get("bootstrap") or {}
    lines = ["# Regime map: DIFF2-GD / DP-GD", "",
             "Ratio = DIFF2-GD's mean over seeds / DP-GD's; < 1: DIFF2-GD lower. p = two-sided paired t-test by seed "
             f"(on log10 values for ‖∇f‖²). {LEGEND} (α = {alpha:g}). n = training records (sum of the shard sizes), "
             "d = parameters, x = nε/√d.", "",
             f"## Primary: {ENDPOINTS[PRIMARY].label} (runs of the ‖∇f‖²-best point; Holm over {len(cells)} cells)", "",
             "| dataset | n | ε | d | nε/√d | ratio | p | p (Holm) | mark | stalled runs |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        e = row["endpoints"][PRIMARY]
        lines.append(f"| {row['dataset']} | {row['n']} | {row['epsilon']:g} | {row['d']} | {row['x']:.4g} | "
                     f"{_fmt(e['ratio'])} | {_fmt(e['p_value'], 2)} | {_fmt(e['p_adjusted'], 2)} | {e['mark']} | "
                     f"{len(row['stalled_runs']) or ''} |")
    lines += ["", "## Exploratory endpoints (descriptive; Benjamini–Hochberg q over all "
              f"{len(explore) * len(cells)} exploratory tests; no slope is fitted to them)", "",
              "| dataset | n | ε | " + " | ".join(f"{ENDPOINTS[e].label}: ratio (p, q)" for e in explore) + " |",
              "|---|---|---|" + "---|" * len(explore)]
    for row in rows:
        parts = [f"{_fmt(row['endpoints'][e]['ratio'])}{row['endpoints'][e]['mark']} "
                 f"({_fmt(row['endpoints'][e]['p_value'], 2)}, {_fmt(row['endpoints'][e]['p_adjusted'], 2)})"
                 for e in explore]
        lines.append(f"| {row['dataset']} | {row['n']} | {row['epsilon']:g} | " + " | ".join(parts) + " |")
    criteria = list(dict.fromkeys(s.criterion for s in ENDPOINTS.values()))
    edges = [f"- {cell.dataset}, n = {cell.n}, ε = {cell.epsilon:g}, point of {c}: " + "; ".join(
                 f"{m} {', '.join(hits)}" for m, hits in cell.edges(c).items())
             for cell in cells for c in criteria if cell.edges(c)]
    if edges:
        lines += ["", "Chosen at an edge of its grid (lowest or highest value of an axis; the grid may have been too "
                  "narrow for that method there, so read the ratio with care):", "", *edges]
    lines += ["", "Counts: " + "; ".join(
        f"{ENDPOINTS[e].label}: {k['diff2_lower']} {MARK_BETTER}, {k['dpgd_lower']} {MARK_WORSE}, ratio < 1 in "
        f"{k['ratio_below_1']} of {k['cells']}" for e, k in result["counts"].items()), "",
        f"## Fit of {ENDPOINTS[PRIMARY].label}: {fits['model']}", "",
        f"One intercept per dataset, one common slope (least squares). 95 % CI: percentile cluster bootstrap over "
        f"evaluation {boot.get('cluster', 'seed')}s ({boot.get('replicates', '–')} replicates, seed "
        f"{boot.get('seed', '–')}): each replicate resamples the seeds with replacement, the same draw in every cell. "
        f"p(=theory): bootstrap two-sided p of slope = {THEORY_SLOPE:.3f}; p(=0): of slope = 0. With few seeds the "
        "bootstrap has few distinct resamples and its interval is likely too narrow. The bootstrap holds the cells "
        "(their chosen points) fixed and varies only the seeds: 'resid. / seed sd' compares the cells' log10 scatter "
        "about the fitted lines with the log10 spread of one cell's ratio over seed resamples; a residual sd well "
        "above the seed sd means the cells depart from the line by more than seed noise, and the interval "
        "understates the slope's uncertainty. 'crossing': nε/√d where the dataset's fitted ratio is 1. Cells with "
        "a non-finite or zero value on a seed are left out of every fit.", "",
        "| fit | k | slope | 95 % CI | p(=theory) | p(=0) | resid. / seed sd | crossing |",
        "|---|---|---|---|---|---|---|---|",
        _fit_row("pooled, dataset effect", fits["pooled"]),
        _fit_row("sensitivity: without cells with a stalled run", fits["sensitivity"]["fit"]),
        *(_fit_row(f"{ds} alone (exploratory)", fit) for ds, fit in fits["per_dataset"].items()),
        "", f"Stall rule (stated as a constant, applied mechanically): {STALL_RULE}."]
    if fits["not_fitted"]:
        lines += ["", "Left out of every fit (a method's final ‖∇f‖² not finite and positive on some seed, e.g. a "
                  "diverged run): " + "; ".join(fits["not_fitted"]) + "."]
    excluded = fits["sensitivity"]["excluded"]
    lines += ["", "Cells left out of the sensitivity fit:" if excluded else "No cell has a stalled run.", ""]
    lines += [f"- {x['dataset']}, n = {x['n']}, ε = {x['epsilon']:g}: " + "; ".join(x["stalled_runs"])
              for x in excluded]
    return "\n".join(lines).rstrip("\n") + "\n"


def _png(fig: Any) -> bytes:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def _cell_text(cell: Cell, endpoint: str, mark_: str) -> str:
    """``0.77*``, or which method diverged (on some seed: its mean is infinite)."""
    r = cell.ratio(endpoint)
    if math.isfinite(r) and r > 0:
        return f"{r:.2f}{mark_}"
    gone = [name for name, m in (("DIFF2-GD", cell.diff2), ("DP-GD", cell.control))
            if not math.isfinite(cell.mean(endpoint, m))]
    return f"{' and '.join(gone)}\ndiverged" if gone else "–"


#: The colour scale of a heatmap panel saturates at this factor either way (the cell's text gives the exact ratio).
MAX_SPAN_DECADES = 1.0


def _ticks(span: float) -> list[float]:
    """Colour-bar ticks inside [10^-span, 10^span]: decades and halves for a wide span, finer steps near 1."""
    wide = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100)
    narrow = (0.25, 0.33, 0.5, 0.67, 0.8, 0.9, 1, 1.1, 1.25, 1.5, 2, 3, 4)
    return [v for v in (wide if span > 0.45 else narrow) if 10 ** -span <= v * (1 + 1e-9) and v <= 10 ** span * (1 + 1e-9)]


def _heatmap(cells: Sequence[Cell], result: Mapping[str, Any], dataset: str, alpha: float) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    marks = {(row["n"], row["epsilon"]): {e: v["mark"] for e, v in row["endpoints"].items()}
             for row in result["cells"] if row["dataset"] == dataset}
    mine = [cell for cell in cells if cell.dataset == dataset]
    ns = sorted({cell.n for cell in mine})
    eps = sorted({cell.epsilon for cell in mine})
    by = {(cell.n, cell.epsilon): cell for cell in mine}
    fig, axes = plt.subplots(1, len(ENDPOINTS), figsize=(4.6 * len(ENDPOINTS), 0.9 * len(ns) + 2.4),
                             layout="constrained")
    for ax, (e, spec) in zip(axes, ENDPOINTS.items()):
        grid = np.full((len(ns), len(eps)), np.nan)
        for (i, n), (j, ep) in ((a, b) for a in enumerate(ns) for b in enumerate(eps)):
            cell = by.get((n, ep))
            if cell is not None and math.isfinite(cell.ratio(e)) and cell.ratio(e) > 0:
                grid[i, j] = cell.ratio(e)
        # one scale per panel (the endpoints differ by orders of magnitude), symmetric in log so that a ratio of 1
        # is the centre colour, saturating at MAX_SPAN_DECADES
        finite = grid[np.isfinite(grid)]
        span = float(np.max(np.abs(np.log10(finite)))) if finite.size else 0.05
        span = min(max(span, 0.05), MAX_SPAN_DECADES)
        cmap = matplotlib.colormaps["RdBu_r"].with_extremes(bad="0.85")
        image = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, norm=LogNorm(vmin=10 ** -span, vmax=10 ** span),
                          origin="lower", aspect="auto")
        for i, n in enumerate(ns):
            for j, ep in enumerate(eps):
                cell = by.get((n, ep))
                text = "no run" if cell is None else _cell_text(cell, e, marks[n, ep][e])
                if cell is not None and cell.stalled and spec.criterion == "grad_norm_sq":
                    text += f"\n{len(cell.stalled)} run(s) stalled"
                dark = cell is not None and math.isfinite(grid[i, j]) and abs(math.log10(grid[i, j])) > 0.6 * span
                ax.text(j, i, text, ha="center", va="center", fontsize=10, color="white" if dark else "black")
        ax.set_xticks(range(len(eps)), [f"{v:g}" for v in eps])
        ax.set_yticks(range(len(ns)), [f"{n:,}" for n in ns])
        ax.set_xlabel("ε")
        ax.set_title(f"{spec.label}{'' if spec.primary else ' (exploratory)'}: DIFF2-GD / DP-GD", fontsize=10)
        bar = fig.colorbar(image, ax=ax, shrink=0.9, extend="both" if span >= MAX_SPAN_DECADES else "neither")
        bar.ax.minorticks_off()
        ticks = _ticks(span)
        bar.set_ticks(ticks, labels=[f"{v:g}" for v in ticks])
        if e == list(ENDPOINTS)[-1]:
            bar.set_label("ratio of seed means (< 1: DIFF2-GD lower)", fontsize=8)
    axes[0].set_ylabel("n (training records)")
    fig.suptitle(f"{dataset}: {LEGEND} (α = {alpha:g}); grey: no cell", fontsize=9)
    return _png(fig)


def _scatter(cells: Sequence[Cell], result: Mapping[str, Any], alpha: float) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter, NullLocator

    datasets = sorted({cell.dataset for cell in cells})
    markers = dict(zip(datasets, "osD^v<>p"))
    colours = dict(zip(datasets, ("tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown")))
    marks = [{e: v["mark"] for e, v in row["endpoints"].items()} for row in result["cells"]]
    fig, axes = plt.subplots(1, len(ENDPOINTS), figsize=(5.2 * len(ENDPOINTS), 4.8))
    for ax, (e, spec) in zip(axes, ENDPOINTS.items()):
        if not any(math.isfinite(cell.ratio(e)) and cell.ratio(e) > 0 for cell in cells):
            ax.text(0.5, 0.5, f"{spec.label}: no finite ratio\n(a method diverged in every cell)", ha="center",
                    va="center", transform=ax.transAxes)
            ax.set_axis_off()
            continue
        for ds in datasets:
            for cell, m in zip(cells, marks):
                r = cell.ratio(e)
                if cell.dataset != ds or not (math.isfinite(r) and r > 0):
                    continue
                ax.scatter(cell.x, r, marker=markers[ds], s=40, edgecolors=colours[ds],
                           facecolors=colours[ds] if m[e] else "none", zorder=3)
                if m[e]:
                    ax.annotate(m[e], (cell.x, r), textcoords="offset points", xytext=(5, 3), fontsize=10)
            ax.scatter([], [], marker=markers[ds], edgecolors=colours[ds], facecolors="none", label=ds)
        stalled = [cell for cell in cells if cell.stalled and math.isfinite(cell.ratio(e)) and cell.ratio(e) > 0]
        if spec.primary and stalled:
            ax.scatter([c.x for c in stalled], [c.ratio(e) for c in stalled], marker="x", s=90, color="k", lw=1.0,
                       zorder=4, label="a run stalled (out of the sensitivity fit)")
        ax.axhline(1.0, color="0.5", lw=0.8, ls=":")
        ax.set_xscale("log")
        ax.set_yscale("log")
        title = spec.label if spec.primary else f"{spec.label} (exploratory, no fit)"
        fit = result["fits"]["pooled"] if spec.primary else None
        if fit is not None:
            lx = np.linspace(math.log10(min(c.x for c in cells)) - 0.1, math.log10(max(c.x for c in cells)) + 0.1, 50)
            for ds, a in fit["intercepts"].items():
                ax.plot(10 ** lx, 10 ** (a + fit["slope"] * lx), color=colours[ds], lw=1.2)
            ax.plot([], [], color="k", lw=1.2,
                    label=f"fit: slope {fit['slope']:.2f} [{fit['ci95'][0]:.2f}, {fit['ci95'][1]:.2f}]")
            ax0, ay0 = math.log10(fit["theory_line_through"]["x"]), math.log10(fit["theory_line_through"]["ratio"])
            ax.plot(10 ** lx, 10 ** (ay0 + THEORY_SLOPE * (lx - ax0)), color="tab:red", lw=1.0, ls="--",
                    label="slope −1/3 (theory)")
            title += f" (k = {fit['k']} cells)"
        for axis in (ax.xaxis, ax.yaxis):  # plain numbers at 1, 2, 5 × 10^k (matplotlib's minor labels overlap)
            axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            axis.set_minor_locator(NullLocator())
            axis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("nε/√d")
        ax.set_ylabel("DIFF2-GD / DP-GD (seed means)")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7)
    fig.suptitle(f"Filled: adjusted p < α = {alpha:g} ({LEGEND})", fontsize=8)
    fig.tight_layout()
    return _png(fig)


def write_regime(cells: Sequence[Cell], out: str | Path, *, alpha: float = ALPHA, plots: bool = True,
                 replicates: int = BOOTSTRAP_REPLICATES, seed: int = BOOTSTRAP_SEED) -> dict[str, Any]:
    """Write the heatmaps, the scatter, ``regime.md`` and ``regime.json`` into ``out``; return the map."""
    out = Path(out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    result = regime_map(cells, alpha=alpha, replicates=replicates, seed=seed)
    files: dict[str, Any] = {"table": str(out / "regime.md"), "json": str(out / "regime.json"), "figures": []}
    if plots:
        for ds in sorted({cell.dataset for cell in cells}):
            path = out / f"heatmap_{ds}.png"
            atomic_write_bytes(path, _heatmap(cells, result, ds, alpha))
            files["figures"].append(str(path))
        path = out / "scatter.png"
        atomic_write_bytes(path, _scatter(cells, result, alpha))
        files["figures"].append(str(path))
    result["files"] = files
    atomic_write_text(out / "regime.md", markdown(cells, result, alpha))
    from ..runtime.outputs import to_json

    atomic_write_text(out / "regime.json", json.dumps(to_json(result), indent=2) + "\n")
    print(f"[diff2] regime map of {len(cells)} cell(s) ({', '.join(sorted({c.dataset for c in cells}))}) written to "
          f"{out}", file=sys.stderr)
    return result
