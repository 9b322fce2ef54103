"""The regime map: where DIFF2-GD beats DP-GD, over the training set's size n and the budget ε.

A *family* of studies (``configs/regime/``: one study per dataset and n, each with a list of ε and the
two methods tuned alike) leaves one ``summary.json`` per study. Each (dataset, n, ε) is a *cell*; per
criterion c (min train loss, min ‖∇f‖², min test loss at the train-loss-best point) the cell holds

    ratio_c = mean over seeds of DIFF2-GD's minimum  /  mean over seeds of DP-GD's minimum

(< 1: DIFF2-GD reaches lower) and the one-sided paired t-test by seed of the study (H1: DIFF2-GD's
minimum < DP-GD's, p); the reverse one-sided test (H1: DP-GD's minimum < DIFF2-GD's) has p' = 1 − p
(the t distribution is continuous). A cell is marked ``*`` when p < α (DIFF2-GD significantly lower)
and ``†`` when p' < α (DP-GD significantly lower).

The theory (Murata & Suzuki 2023): DP-GD reaches ‖∇f‖² ≲ √d/(nε) and DIFF2-GD d^{2/3}/(nε)^{4/3}, so
the ratio of the bounds is (nε/√d)^{-1/3}: DIFF2 wins once nε ≫ √d, by more the larger nε/√d. The
map therefore also plots every cell's ratios against x = nε/√d (n the training records, i.e. the sum
of the shard sizes; d the model's parameter count) on log-log axes, with a line of the theory's slope
−1/3 drawn through the geometric mean of the points (the bounds' constants are unknown, so only the
slope is the theory's), and the least-squares slope of log ratio on log x with its 95 % confidence
interval (``scipy.stats.linregress``; CI = slope ± t_{0.975, k−2} · stderr over k cells), pooled over
the datasets and per dataset. With P fixed, using n_min = n/P instead of n would only shift x by a
constant factor: the slope is the same.

Outputs (:func:`write_regime`): ``heatmap_<dataset>.png`` (one per dataset, one panel per criterion:
the ratio over n × ε on a log colour scale centred at 1, each cell annotated with the ratio and its
mark), ``scatter.png`` (the ratios against nε/√d, one panel per criterion), ``regime.md`` (the cells
and fits as Markdown tables) and ``regime.json``; :func:`regime_map` returns the same object, which
``diff2 regime`` prints on stdout.

References:
    Murata & Suzuki (2023), the utility bounds of DP-GD and DIFF2-GD (the ratio (nε/√d)^{-1/3}, issue 12);
    DIFF2.md, "The paper's experiments" (the t-test).
"""

from __future__ import annotations

import io
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from .claims import atomic_write_bytes, atomic_write_text
from .study import CRITERIA, paired_one_sided_ttest

__all__ = ["ALPHA", "THEORY_SLOPE", "Cell", "Fit", "RegimeError", "cells_from_summary", "fit_slope", "mark",
           "read_cells", "regime_map", "summary_paths", "write_regime"]

ALPHA = 0.05
#: Slope of log(DIFF2 bound / DP-GD bound) against log(nε/√d): (nε/√d)^{-1/3}.
THEORY_SLOPE = -1.0 / 3.0
LABELS = {"train_loss": "min train loss", "grad_norm_sq": "min ‖∇f‖²", "test_loss": "min test loss"}
MARK_BETTER, MARK_WORSE = "*", "†"
LEGEND = (f"{MARK_BETTER} DIFF2-GD lower, one-sided paired t-test by seed p < α; "
          f"{MARK_WORSE} DP-GD lower, reverse one-sided p' = 1 − p < α")


class RegimeError(ValueError):
    """Summaries that cannot make a regime map; the message names the file and what is missing."""


@dataclass(frozen=True)
class Cell:
    """One (dataset, n, ε) of the family: the two methods' mean minima, their ratios and the p-values."""

    dataset: str
    n: int  # training records (sum of the shard sizes)
    epsilon: float
    d: int  # the model's parameters
    study: str  # the summary.json it came from
    diff2: str  # method names in that study
    control: str
    diff2_min: Mapping[str, float]
    control_min: Mapping[str, float]
    p_values: Mapping[str, float]  # one-sided, H1: DIFF2-GD's minimum < DP-GD's
    train_available: int | None = None  # records of the whole train split when n is a subsample
    points: Mapping[str, Mapping[str, Mapping[str, float]]] = field(default_factory=dict)  # chosen hyper-parameters
    grids: Mapping[str, Mapping[str, Sequence[float]]] = field(default_factory=dict)  # each method's grid

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

    @property
    def x(self) -> float:
        """nε/√d."""
        return self.n * self.epsilon / math.sqrt(self.d)

    def ratio(self, criterion: str) -> float:
        """DIFF2-GD's mean minimum / DP-GD's (inf or NaN when one of them diverged on a seed)."""
        a, b = self.diff2_min[criterion], self.control_min[criterion]
        if not (math.isfinite(a) and math.isfinite(b)):
            return math.nan if not math.isfinite(a) and not math.isfinite(b) else (math.inf if not math.isfinite(a)
                                                                                   else 0.0)
        return a / b if b > 0 else math.nan

    def p_reverse(self, criterion: str) -> float:
        """The reverse one-sided p-value (H1: DP-GD's minimum < DIFF2-GD's): 1 − p."""
        p = self.p_values[criterion]
        return 1.0 - p if math.isfinite(p) else math.nan

    def mark(self, criterion: str, alpha: float = ALPHA) -> str:
        return mark(self.p_values[criterion], alpha)

    def as_dict(self, alpha: float = ALPHA) -> dict[str, Any]:
        return {"dataset": self.dataset, "n": self.n, "epsilon": self.epsilon, "d": self.d, "x": self.x,
                "train_available": self.train_available, "study": self.study, "diff2_method": self.diff2,
                "control_method": self.control,
                "criteria": {c: {"ratio": self.ratio(c), "diff2_min_mean": self.diff2_min[c],
                                 "control_min_mean": self.control_min[c], "p_value": self.p_values[c],
                                 "p_value_reverse": self.p_reverse(c), "mark": self.mark(c, alpha),
                                 "diff2_point": dict(self.points.get(self.diff2, {}).get(c, {})),
                                 "control_point": dict(self.points.get(self.control, {}).get(c, {})),
                                 "grid_edges": self.edges(c)}
                             for c in CRITERIA}}


def mark(p_value: float, alpha: float = ALPHA) -> str:
    """``*`` if DIFF2-GD is significantly lower (p < α), ``†`` if DP-GD is (1 − p < α), else ``""``."""
    if not math.isfinite(p_value):
        return ""
    if p_value < alpha:
        return MARK_BETTER
    if 1.0 - p_value < alpha:
        return MARK_WORSE
    return ""


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


def cells_from_summary(summary: Mapping[str, Any], source: str = "<summary>", *, diff2: str | None = None,
                       control: str | None = None, runs_dir: Path | None = None) -> list[Cell]:
    """The cells of one study's summary: one per ε.

    The p-values are the summary's own t-tests when it holds the pair, else computed from the per-seed
    minima of the run files (``runs_dir``) that the summary names by run id.
    """
    info = summary.get("dataset")
    if not isinstance(info, Mapping) or "train" not in info or "parameters" not in info:
        raise RegimeError(f"{source}: the summary lacks `dataset.train` and `dataset.parameters` (n and d; written "
                          "by diff2 experiment since the regime map exists). Run `diff2 experiment` on the study "
                          "again: it reuses every run and rewrites the summary.")
    out = []
    for eps_key, entry in summary["epsilons"].items():
        methods = entry["methods"]
        treat = _pick(source, methods, "diff2", diff2, "--diff2")
        ctrl = _pick(source, methods, "dpgd", control, "--control")
        test = entry.get("tests", {}).get(f"{treat} vs {ctrl}")
        p_values = {}
        for c in CRITERIA:
            if test is not None:
                p_values[c] = float(test[c]["p_value"])
                continue
            if runs_dir is None:
                raise RegimeError(f"{source}: ε = {eps_key} has no t-test of {treat!r} against {ctrl!r} and no runs "
                                  "folder to compute it from.")
            mins = [[min(math.inf if v is None else v for v in json.loads((runs_dir / f"{rid}.json").read_text())[c])
                     for rid in methods[m]["criteria"][c]["run_ids"]] for m in (treat, ctrl)]
            p_values[c] = paired_one_sided_ttest(mins[0], mins[1])
        out.append(Cell(
            dataset=str(info.get("name") or info.get("settings", {}).get("name")), n=int(info["train"]),
            epsilon=float(eps_key), d=int(info["parameters"]), study=source, diff2=treat, control=ctrl,
            diff2_min={c: _number(methods[treat]["criteria"][c]["min_mean"]) for c in CRITERIA},
            control_min={c: _number(methods[ctrl]["criteria"][c]["min_mean"]) for c in CRITERIA},
            p_values=p_values, train_available=info.get("train_available"),
            points={m: {c: methods[m]["criteria"][c]["point"] for c in CRITERIA} for m in (treat, ctrl)},
            grids={m: methods[m].get("grid", {}) for m in (treat, ctrl)}))
    return out


def _number(value: Any) -> float:
    return math.inf if value is None else float(value)  # a diverged mean is written as null (inf)


def read_cells(paths: Iterable[str | Path], *, diff2: str | None = None, control: str | None = None) -> list[Cell]:
    """Every cell of the summaries found under ``paths`` (see :func:`summary_paths`), sorted by dataset, n, ε."""
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
    """Least squares of log10(ratio) on log10(nε/√d) over k cells."""

    k: int
    slope: float
    intercept: float
    stderr: float
    ci_low: float
    ci_high: float
    r: float
    p_slope_negative: float  # one-sided: H1 slope < 0 (DIFF2's relative advantage grows with nε/√d)
    p_theory: float  # two-sided: H0 slope = −1/3
    anchor_log_x: float  # the geometric mean of the points (log10), where the theory's line is drawn through
    anchor_log_ratio: float

    @property
    def crossing(self) -> float:
        """nε/√d where the fitted ratio is 1 (NaN for a flat fit)."""
        return 10 ** (-self.intercept / self.slope) if self.slope != 0 else math.nan

    @property
    def theory_in_ci(self) -> bool:
        return self.ci_low <= THEORY_SLOPE <= self.ci_high

    def as_dict(self) -> dict[str, Any]:
        return {"k": self.k, "slope": self.slope, "ci95": [self.ci_low, self.ci_high], "stderr": self.stderr,
                "intercept": self.intercept, "r": self.r, "p_slope_negative": self.p_slope_negative,
                "p_slope_equals_theory": self.p_theory, "theory_slope": THEORY_SLOPE,
                "theory_in_ci": self.theory_in_ci, "crossing_x": self.crossing,
                "theory_line_through": {"x": 10 ** self.anchor_log_x, "ratio": 10 ** self.anchor_log_ratio}}


def fit_slope(xs: Sequence[float], ratios: Sequence[float]) -> Fit | None:
    """The fit over the points with a finite positive ratio; None with fewer than 3 of them (no CI)."""
    from scipy import stats

    pts = [(math.log10(x), math.log10(r)) for x, r in zip(xs, ratios) if math.isfinite(r) and r > 0 and x > 0]
    if len(pts) < 3 or len({p[0] for p in pts}) < 2:
        return None
    lx, lr = np.array(pts).T
    res = stats.linregress(lx, lr)
    k = len(pts)
    if res.stderr > 0:
        q = float(stats.t.ppf(0.975, k - 2))
        t_neg = res.slope / res.stderr
        p_neg = float(stats.t.cdf(t_neg, k - 2))
        p_theory = float(2 * stats.t.sf(abs((res.slope - THEORY_SLOPE) / res.stderr), k - 2))
    else:  # the points lie exactly on a line
        q, p_neg = 0.0, (0.0 if res.slope < 0 else 1.0)
        p_theory = 1.0 if math.isclose(res.slope, THEORY_SLOPE, abs_tol=1e-12) else 0.0
    return Fit(k=k, slope=float(res.slope), intercept=float(res.intercept), stderr=float(res.stderr),
               ci_low=float(res.slope - q * res.stderr), ci_high=float(res.slope + q * res.stderr), r=float(res.rvalue),
               p_slope_negative=p_neg, p_theory=p_theory, anchor_log_x=float(lx.mean()),
               anchor_log_ratio=float(lr.mean()))


def _fits(cells: Sequence[Cell]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for c in CRITERIA:
        pooled = fit_slope([cell.x for cell in cells], [cell.ratio(c) for cell in cells])
        per = {}
        for ds in sorted({cell.dataset for cell in cells}):
            sub = [cell for cell in cells if cell.dataset == ds]
            fit = fit_slope([cell.x for cell in sub], [cell.ratio(c) for cell in sub])
            per[ds] = None if fit is None else fit.as_dict()
        out[c] = {"pooled": None if pooled is None else pooled.as_dict(), "per_dataset": per}
    return out


def regime_map(cells: Sequence[Cell], *, alpha: float = ALPHA) -> dict[str, Any]:
    """The machine-readable map: cells (ratios, p-values, marks) and fitted slopes per criterion."""
    counts = {c: {"diff2_lower": sum(cell.mark(c, alpha) == MARK_BETTER for cell in cells),
                  "dpgd_lower": sum(cell.mark(c, alpha) == MARK_WORSE for cell in cells),
                  "ratio_below_1": sum(cell.ratio(c) < 1 for cell in cells), "cells": len(cells),
                  "chosen_at_a_grid_edge": sum(bool(cell.edges(c)) for cell in cells)} for c in CRITERIA}
    return {"alpha": alpha, "marks": {MARK_BETTER: "DIFF2-GD lower (p < alpha)",
                                      MARK_WORSE: "DP-GD lower (1 - p < alpha)"},
            "theory_slope": THEORY_SLOPE, "cells": [cell.as_dict(alpha) for cell in cells], "counts": counts,
            "fits": _fits(cells)}


# ------------------------------------------------------------------------------------------ outputs

def _fmt(v: float, digits: int = 3) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if v == math.inf:
        return "inf"
    return f"{v:.{digits}g}"


def markdown(cells: Sequence[Cell], result: Mapping[str, Any], alpha: float = ALPHA) -> str:
    """The cells and fits as Markdown."""
    lines = ["# Regime map: DIFF2-GD / DP-GD", "",
             "Ratio = DIFF2-GD's mean (over seeds) minimum over rounds / DP-GD's (test loss at the train-loss-best "
             f"point); < 1: DIFF2-GD lower. {LEGEND} (α = {alpha:g}). n = training records (sum of the shard "
             "sizes), d = parameters, x = nε/√d.", "",
             "| dataset | n | ε | d | nε/√d | " + " | ".join(f"{LABELS[c]}: ratio (p)" for c in CRITERIA) + " |",
             "|---|---|---|---|---|" + "---|" * len(CRITERIA)]
    for cell in cells:
        ratios = " | ".join(f"{_fmt(cell.ratio(c))}{cell.mark(c, alpha)} ({_fmt(cell.p_values[c], 2)})"
                            for c in CRITERIA)
        lines.append(f"| {cell.dataset} | {cell.n} | {cell.epsilon:g} | {cell.d} | {cell.x:.4g} | {ratios} |")
    edges = [f"- {cell.dataset}, n = {cell.n}, ε = {cell.epsilon:g}, {LABELS[c]}: " + "; ".join(
                 f"{m} {', '.join(hits)}" for m, hits in cell.edges(c).items())
             for cell in cells for c in CRITERIA if cell.edges(c)]
    if edges:
        lines += ["", "Chosen at an edge of its grid (lowest or highest value of an axis; the grid may have been too "
                  "narrow for that method there, so read the ratio with care):", "", *edges]
    lines += ["", "Counts: " + "; ".join(
        f"{LABELS[c]}: {k['diff2_lower']} {MARK_BETTER}, {k['dpgd_lower']} {MARK_WORSE}, ratio < 1 in "
        f"{k['ratio_below_1']} of {k['cells']}" for c, k in result["counts"].items()), "",
        f"Fitted slope of log10(ratio) on log10(nε/√d) (least squares; 95 % CI = slope ± t(0.975, k − 2)·stderr); "
        f"the theory's slope is {THEORY_SLOPE:.3f}. 'p(slope<0)': one-sided test that the ratio falls as nε/√d "
        "grows; 'p(=theory)': two-sided test of slope = −1/3; 'crossing': nε/√d where the fitted ratio is 1.", "",
        "| criterion | cells | k | slope | 95 % CI | p(slope<0) | p(=theory) | crossing |", "|---|---|---|---|---|---|---|---|"]
    for c, fits in result["fits"].items():
        for who, fit in [("pooled", fits["pooled"]), *fits["per_dataset"].items()]:
            if fit is None:
                lines.append(f"| {LABELS[c]} | {who} | < 3 | – | – | – | – | – |")
                continue
            lines.append(f"| {LABELS[c]} | {who} | {fit['k']} | {fit['slope']:.3f} | [{fit['ci95'][0]:.3f}, "
                         f"{fit['ci95'][1]:.3f}] | {_fmt(fit['p_slope_negative'], 2)} | "
                         f"{_fmt(fit['p_slope_equals_theory'], 2)} | {_fmt(fit['crossing_x'])} |")
    return "\n".join(lines) + "\n"


def _png(fig: Any) -> bytes:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def _cell_text(cell: Cell, criterion: str, alpha: float) -> str:
    """``0.77*``, or which method diverged (on some seed: its mean minimum is infinite)."""
    r = cell.ratio(criterion)
    if math.isfinite(r) and r > 0:
        return f"{r:.2f}{cell.mark(criterion, alpha)}"
    gone = [name for name, v in (("DIFF2-GD", cell.diff2_min[criterion]), ("DP-GD", cell.control_min[criterion]))
            if not math.isfinite(v)]
    return f"{' and '.join(gone)}\ndiverged" if gone else "–"


#: The colour scale of a heatmap panel saturates at this factor either way (the cell's text gives the exact ratio).
MAX_SPAN_DECADES = 1.0


def _ticks(span: float) -> list[float]:
    """Colour-bar ticks inside [10^-span, 10^span]: decades and halves for a wide span, finer steps near 1."""
    wide = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100)
    narrow = (0.25, 0.33, 0.5, 0.67, 0.8, 0.9, 1, 1.1, 1.25, 1.5, 2, 3, 4)
    return [v for v in (wide if span > 0.45 else narrow) if 10 ** -span <= v * (1 + 1e-9) and v <= 10 ** span * (1 + 1e-9)]


def _heatmap(cells: Sequence[Cell], dataset: str, alpha: float) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    mine = [cell for cell in cells if cell.dataset == dataset]
    ns = sorted({cell.n for cell in mine})
    eps = sorted({cell.epsilon for cell in mine})
    by = {(cell.n, cell.epsilon): cell for cell in mine}
    fig, axes = plt.subplots(1, len(CRITERIA), figsize=(4.6 * len(CRITERIA), 0.9 * len(ns) + 2.4),
                             layout="constrained")
    for ax, c in zip(axes, CRITERIA):
        grid = np.full((len(ns), len(eps)), np.nan)
        for (i, n), (j, e) in ((a, b) for a in enumerate(ns) for b in enumerate(eps)):
            cell = by.get((n, e))
            if cell is not None and math.isfinite(cell.ratio(c)) and cell.ratio(c) > 0:
                grid[i, j] = cell.ratio(c)
        # one scale per panel (the criteria differ by orders of magnitude), symmetric in log so that a ratio of 1
        # is the centre colour, saturating at MAX_SPAN_DECADES
        finite = grid[np.isfinite(grid)]
        span = float(np.max(np.abs(np.log10(finite)))) if finite.size else 0.05
        span = min(max(span, 0.05), MAX_SPAN_DECADES)
        cmap = matplotlib.colormaps["RdBu_r"].with_extremes(bad="0.85")
        image = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, norm=LogNorm(vmin=10 ** -span, vmax=10 ** span),
                          origin="lower", aspect="auto")
        for i, n in enumerate(ns):
            for j, e in enumerate(eps):
                cell = by.get((n, e))
                text = "no run" if cell is None else _cell_text(cell, c, alpha)
                dark = cell is not None and math.isfinite(grid[i, j]) and abs(math.log10(grid[i, j])) > 0.6 * span
                ax.text(j, i, text, ha="center", va="center", fontsize=10, color="white" if dark else "black")
        ax.set_xticks(range(len(eps)), [f"{e:g}" for e in eps])
        ax.set_yticks(range(len(ns)), [f"{n:,}" for n in ns])
        ax.set_xlabel("ε")
        ax.set_title(f"{LABELS[c]}: DIFF2-GD / DP-GD", fontsize=10)
        bar = fig.colorbar(image, ax=ax, shrink=0.9, extend="both" if span >= MAX_SPAN_DECADES else "neither")
        bar.ax.minorticks_off()
        ticks = _ticks(span)
        bar.set_ticks(ticks, labels=[f"{v:g}" for v in ticks])
        if c == CRITERIA[-1]:
            bar.set_label("ratio of mean minima (< 1: DIFF2-GD lower)", fontsize=8)
    axes[0].set_ylabel("n (training records)")
    fig.suptitle(f"{dataset}: {LEGEND} (α = {alpha:g}); grey: no cell", fontsize=9)
    return _png(fig)


def _scatter(cells: Sequence[Cell], result: Mapping[str, Any], alpha: float) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = sorted({cell.dataset for cell in cells})
    markers = dict(zip(datasets, "osD^v<>p"))
    colours = dict(zip(datasets, ("tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown")))
    fig, axes = plt.subplots(1, len(CRITERIA), figsize=(5.2 * len(CRITERIA), 4.8))
    for ax, c in zip(axes, CRITERIA):
        if not any(math.isfinite(cell.ratio(c)) and cell.ratio(c) > 0 for cell in cells):
            ax.text(0.5, 0.5, f"{LABELS[c]}: no finite ratio\n(a method diverged in every cell)", ha="center",
                    va="center", transform=ax.transAxes)
            ax.set_axis_off()
            continue
        for ds in datasets:
            pts = [cell for cell in cells if cell.dataset == ds and math.isfinite(cell.ratio(c)) and cell.ratio(c) > 0]
            for cell in pts:
                filled = cell.mark(c, alpha) != ""
                ax.scatter(cell.x, cell.ratio(c), marker=markers[ds], s=40, edgecolors=colours[ds],
                           facecolors=colours[ds] if filled else "none", zorder=3)
                if filled:
                    ax.annotate(cell.mark(c, alpha), (cell.x, cell.ratio(c)), textcoords="offset points",
                                xytext=(5, 3), fontsize=10)
            ax.scatter([], [], marker=markers[ds], edgecolors=colours[ds], facecolors="none", label=ds)
        fit = result["fits"][c]["pooled"]
        ax.axhline(1.0, color="0.5", lw=0.8, ls=":")
        ax.set_xscale("log")
        ax.set_yscale("log")
        title = LABELS[c]
        if fit is not None:
            xs = np.array([cell.x for cell in cells])
            lo, hi = math.log10(xs.min()) - 0.1, math.log10(xs.max()) + 0.1
            lx = np.linspace(lo, hi, 50)
            ax.plot(10 ** lx, 10 ** (fit["intercept"] + fit["slope"] * lx), color="k", lw=1.2,
                    label=f"fit: slope {fit['slope']:.2f} [{fit['ci95'][0]:.2f}, {fit['ci95'][1]:.2f}]")
            ax0, ay0 = math.log10(fit["theory_line_through"]["x"]), math.log10(fit["theory_line_through"]["ratio"])
            ax.plot(10 ** lx, 10 ** (ay0 + THEORY_SLOPE * (lx - ax0)), color="tab:red", lw=1.2, ls="--",
                    label="theory: slope −1/3, through the points' geometric mean")
            title += f" (k = {fit['k']} cells)"
        from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter, NullLocator

        for axis in (ax.xaxis, ax.yaxis):  # plain numbers at 1, 2, 5 × 10^k (matplotlib's minor labels overlap)
            axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            axis.set_minor_locator(NullLocator())
            axis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("nε/√d")
        ax.set_ylabel("DIFF2-GD / DP-GD (mean min)")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7)
    fig.suptitle(f"Filled: significant at α = {alpha:g} ({LEGEND})", fontsize=8)
    fig.tight_layout()
    return _png(fig)


def write_regime(cells: Sequence[Cell], out: str | Path, *, alpha: float = ALPHA, plots: bool = True) -> dict[str, Any]:
    """Write the heatmaps, the scatter, ``regime.md`` and ``regime.json`` into ``out``; return the map."""
    out = Path(out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    result = regime_map(cells, alpha=alpha)
    files = {"table": str(out / "regime.md"), "json": str(out / "regime.json"), "figures": []}
    if plots:
        for ds in sorted({cell.dataset for cell in cells}):
            path = out / f"heatmap_{ds}.png"
            atomic_write_bytes(path, _heatmap(cells, ds, alpha))
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
