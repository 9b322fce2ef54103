"""The regime map as Markdown (``regime.md``): the cells' tables, the counts, the fits and the
stalled cells."""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from .cells import ALPHA, ENDPOINTS, LEGEND, MARK_BETTER, MARK_WORSE, PRIMARY, STALL_RULE, Cell
from .fit import THEORY_SLOPE

__all__ = ["markdown"]


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
    return (
        f"| {name} | {fit['k']} | {fit['slope']:.3f} | [{fit['ci95'][0]:.3f}, "
        f"{fit['ci95'][1]:.3f}] | {_fmt(fit['p_slope_equals_theory'], 2)} | "
        f"{_fmt(fit['p_slope_equals_zero'], 2)} | {_fmt(lack['residual_sd_log10'], 2)} / "
        f"{_fmt(lack['seed_sd_log10'], 2)} | {crossing} |")


def markdown(cells: Sequence[Cell], result: Mapping[str, Any], alpha: float = ALPHA) -> str:
    """The cells and fits as Markdown."""
    rows = result["cells"]
    lines = [*_primary_table(cells, rows, alpha), *_exploratory_table(cells, rows),
             *_edge_lines(cells), *_fit_section(result)]
    return "\n".join(lines).rstrip("\n") + "\n"


def _primary_table(cells: Sequence[Cell], rows: Sequence[Mapping[str, Any]],
                   alpha: float) -> list[str]:
    """The title, the legend and the table of the primary endpoint (Holm over the cells)."""
    lines = ["# Regime map: DIFF2-GD / DP-GD", "",
             "Ratio: DIFF2-GD / DP-GD, < 1: DIFF2-GD lower; for ‖∇f‖² the geometric mean over "
             "seeds of the per-seed ratios with its 95 % t-interval, for the losses the ratio of "
             "the seed means. p = two-sided paired t-test by seed "
             f"(on log10 values for ‖∇f‖²). {LEGEND} (α = {alpha:g}). n = training records (sum "
             f"of the shard sizes), "
             "d = parameters, x = nε/√d.", "",
             f"## Primary: {ENDPOINTS[PRIMARY].label} (runs of the ‖∇f‖²-best point; Holm over "
             f"{len(cells)} cells)", "",
             "| dataset | n | ε | d | nε/√d | ratio [95 % CI] | p | p (Holm) | mark | "
             "stalled runs |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        e = row["endpoints"][PRIMARY]
        ci = e.get("ratio_ci95")
        interval = f" [{_fmt(ci[0])}, {_fmt(ci[1])}]" if ci else ""
        lines.append(
            f"| {row['dataset']} | {row['n']} | {row['epsilon']:g} | {row['d']} | {row['x']:.4g} "
            f"| {_fmt(e['ratio'])}{interval} | {_fmt(e['p_value'], 2)} | "
            f"{_fmt(e['p_adjusted'], 2)} | "
            f"{e['mark']} | {len(row['stalled_runs']) or ''} |")
    return lines


def _exploratory_table(cells: Sequence[Cell], rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The exploratory endpoints' table: per cell and endpoint the ratio, its mark, p and BH q."""
    explore = [e for e in ENDPOINTS if not ENDPOINTS[e].primary]
    lines = ["", "## Exploratory endpoints (descriptive; Benjamini–Hochberg q over all "
             f"{len(explore) * len(cells)} exploratory tests; no slope is fitted to them)", "",
             "| dataset | n | ε | " + " | ".join(f"{ENDPOINTS[e].label}: ratio (p, q)"
                                                 for e in explore) + " |",
             "|---|---|---|" + "---|" * len(explore)]
    for row in rows:
        parts = [f"{_fmt(row['endpoints'][e]['ratio'])}{row['endpoints'][e]['mark']} "
                 f"({_fmt(row['endpoints'][e]['p_value'], 2)}, "
                 f"{_fmt(row['endpoints'][e]['p_adjusted'], 2)})"
                 for e in explore]
        lines.append(f"| {row['dataset']} | {row['n']} | {row['epsilon']:g} | " + " | ".join(
            parts) + " |")
    return lines


def _edge_lines(cells: Sequence[Cell]) -> list[str]:
    """The points chosen at an edge of their grid, per cell and criterion (none: no lines)."""
    criteria = list(dict.fromkeys(s.criterion for s in ENDPOINTS.values()))
    edges = [f"- {cell.dataset}, n = {cell.n}, ε = {cell.epsilon:g}, point of {c}: " + "; ".join(
                 f"{m} {', '.join(hits)}" for m, hits in cell.edges(c).items())
             for cell in cells for c in criteria if cell.edges(c)]
    if not edges:
        return []
    return ["",
            "Chosen at an edge of its grid (lowest or highest value of an axis; the grid may have "
            "been too narrow for that method there, so read the ratio with care):", "", *edges]


def _fit_section(result: Mapping[str, Any]) -> list[str]:
    """The counts of marks, the fits' table and what the fits leave out (non-finite cells, stalled
    runs)."""
    fits = result["fits"]
    boot = (fits["pooled"] or {}).get("bootstrap") or {}
    lines = ["", "Counts: " + "; ".join(
        f"{ENDPOINTS[e].label}: {k['diff2_lower']} {MARK_BETTER}, {k['dpgd_lower']} {MARK_WORSE}, "
        f"ratio < 1 in {k['ratio_below_1']} of {k['cells']}" for e, k in result["counts"].items()),
        "",
        f"## Fit of {ENDPOINTS[PRIMARY].label}: {fits['model']}", "",
        f"One intercept per dataset, one common slope (least squares). 95 % CI: percentile "
        f"cluster bootstrap over "
        f"evaluation {boot.get('cluster', 'seed')}s ({boot.get('replicates', '–')} replicates, "
        f"seed "
        f"{boot.get('seed', '–')}): each replicate resamples the seeds with replacement, the same "
        f"draw in every cell. "
        f"p(=theory): bootstrap two-sided p of slope = {THEORY_SLOPE:.3f}; p(=0): of slope = 0. "
        f"With few seeds the "
        "bootstrap has few distinct resamples and its interval is likely too narrow. The "
        "bootstrap holds the cells "
        "(their chosen points) fixed and varies only the seeds: 'resid. / seed sd' compares the "
        "cells' log10 scatter "
        "about the fitted lines with the log10 spread of one cell's ratio over seed resamples; a "
        "residual sd well "
        "above the seed sd means the cells depart from the line by more than seed noise, and the "
        "interval "
        "understates the slope's uncertainty. 'crossing': nε/√d where the dataset's fitted ratio "
        "is 1. Cells with "
        "a non-finite or zero value on a seed are left out of every fit.", "",
        "| fit | k | slope | 95 % CI | p(=theory) | p(=0) | resid. / seed sd | crossing |",
        "|---|---|---|---|---|---|---|---|",
        _fit_row("pooled, dataset effect", fits["pooled"]),
        _fit_row("sensitivity: without cells with a stalled run", fits["sensitivity"]["fit"]),
        *(_fit_row(f"{ds} alone (exploratory)", fit) for ds, fit in fits["per_dataset"].items()),
        "", f"Stall rule (stated as a constant, applied mechanically): {STALL_RULE}."]
    if fits["not_fitted"]:
        lines += ["",
                  "Left out of every fit (a method's final ‖∇f‖² not finite and positive on some "
                  "seed, e.g. a diverged run): " + "; ".join(fits["not_fitted"]) + "."]
    excluded = fits["sensitivity"]["excluded"]
    lines += ["",
              "Cells left out of the sensitivity fit:" if excluded
              else "No cell has a stalled run.", ""]
    lines += [f"- {x['dataset']}, n = {x['n']}, ε = {x['epsilon']:g}: " + "; ".join(x[
        "stalled_runs"])
              for x in excluded]
    return lines
