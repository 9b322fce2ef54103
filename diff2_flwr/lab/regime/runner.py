"""The regime map: where DIFF2-GD beats DP-GD, over the training set's size n and the budget ε.

A *family* of studies (``configs/regime/``: one study per dataset and n, each with a list of ε and
the two methods tuned alike) leaves one ``summary.json`` per study and its ``runs/`` folder. Each
(dataset, n, ε) is a *cell*. Everything the map reports is computed here from the run files the
summary names (``summary["epsilons"][ε]["methods"][m]["criteria"][c]["run_ids"]``, in the order of
``summary["eval_seeds"]``); of the summary only the run ids, the seed list, the chosen points, the
grids, the methods' ``base_method`` and the dataset's n and d (``dataset.train``,
``dataset.parameters``) are read, never its means or tests.

**Endpoints** (per seed, from the runs of the criterion's own chosen point; no test-set oracle):

* ``grad_norm_sq_final`` — ‖∇f‖² at the last recorded round (runs of the ‖∇f‖²-best point). The
  *primary* endpoint: the only one the theory speaks of, and the only one fitted against it.
* ``grad_norm_sq_min`` — the smallest ‖∇f‖² over rounds (same runs; exploratory).
* ``train_loss_min`` — the smallest train loss over rounds (runs of the train-loss-best point;
  exploratory).
* ``test_loss_at_train_best`` — the test loss *at the round where that run's train loss is smallest*
  (same runs; never the smallest test loss, which would pick the round by the test set;
  exploratory).

Per cell and endpoint: the ratio DIFF2-GD / DP-GD (< 1: DIFF2-GD lower) and the two-sided paired
t-test by seed (:func:`.inference.paired_ttest`; on log values for ‖∇f‖², which spans decades). For
‖∇f‖² the ratio is the geometric mean of the per-seed ratios, 10^(mean over seeds of the paired
log10 difference), with its 95 % t-interval: the quantity the test tests, which one stalled seed
cannot dominate (a ratio of arithmetic seed means can, and did: issue 42); for the losses it is the
ratio of the seed means. Adjusted across the cells: **Holm** over the primary
endpoint's family (every cell), **Benjamini–Hochberg** q over one family holding every exploratory
endpoint of every cell. A test whose p is NaN (a diverged run) still counts in its family. A cell is
marked ``*`` (DIFF2-GD lower) or ``†`` (DP-GD lower) when its *adjusted* p < α, the direction the
sign of the mean paired difference on the tested scale (for ‖∇f‖² the mean log difference, which can
disagree in sign with a ratio of arithmetic means when one seed dominates a mean). Loss ratios are
descriptive and exploratory: the theory predicts nothing about them, and no slope is fitted to them.

**The fit** (Murata & Suzuki 2023): DP-GD reaches ‖∇f‖² ≲ √d/(nε) and DIFF2-GD d^{2/3}/(nε)^{4/3},
so the ratio of the *bounds* is (nε/√d)^{-1/3}. Over the cells whose per-seed final ‖∇f‖² are all
finite and positive (every cell of a map without a diverged run: no cell is left out for what its
values are), least squares fits

    mean over seeds of (log10 DIFF2-GD − log10 DP-GD) = a_dataset + b · log10(nε/√d)

(one intercept per dataset — the bounds' constants differ by dataset — and one common slope b; n the
training records, i.e. the sum of the shard sizes; d the model's parameters). Its 95 % interval and
the p-value of H0: b = −1/3 come from a **cluster bootstrap over evaluation seeds**: the cells share
their seeds and what a seed fixes (the starting point among others), so their errors are not
independent and an OLS interval over the cells would be too narrow; a replicate draws seed indices
with replacement once and uses the same indices in every cell, recomputes each cell's mean log
difference over the drawn seeds and refits; B replicates (:data:`BOOTSTRAP_REPLICATES`) from
``numpy.random.default_rng(seed)`` with a fixed default seed (:data:`BOOTSTRAP_SEED`); percentile
interval; p = 2·min(share ≤ −1/3, share ≥ −1/3), at least 1/(B+1). When the studies of a map
evaluated different seed lists (of one length), the bootstrap resamples seed *positions* (the index
in each study's ``eval_seeds``), which treats the i-th seed of every study as one cluster; the
output says which (``bootstrap.cluster``). With S seeds the bootstrap has few distinct resamples
(126 for S = 5) and a percentile interval from few clusters tends to be too narrow: read it as a
lower bound on the uncertainty. It also holds the cells fixed (their tuned points, their departures
from a straight line): the fit reports the cells' residual scatter beside the seed-resampling spread
of a cell's ratio (``lack_of_fit``), and when the first is much larger the interval understates the
slope's uncertainty. Per-dataset slopes are exploratory lines.

**Stalled runs** (:data:`STALL_PROGRESS`, :func:`stall_reason`): a rule stated as a constant and
applied mechanically, not one chosen blind to the cells it removes (it was written after a review
traced the largest ratios to one stalled seed). The main fit uses every cell it can (all but those
with a non-finite final ‖∇f‖² on some seed, listed as ``not_fitted``); a *sensitivity* fit leaves
out each cell in which any run of either method at the ‖∇f‖²-best point stalled, and the report
lists those cells and why.

Outputs (:func:`write_regime`): ``heatmap_<dataset>.png`` (one panel per endpoint: the ratio over n
× ε on a log colour scale centred at 1, annotated with the ratio and its mark), ``scatter.png`` (the
ratios against nε/√d; only the ‖∇f‖² panel carries the fitted lines), ``regime.md`` and
``regime.json``; :func:`regime_map` returns the same object, which ``diff2 regime`` prints on
stdout.

The map is made in parts, each a module of its own: the endpoints, the cells and their adjusted
tests (:mod:`.cells`), the reading of the studies' files (:mod:`.read`), the fit (:mod:`.fit`), the
Markdown (:mod:`.report`) and the figures (:mod:`.plots`). This module assembles the map and writes
it; every name of the map is importable from here.

References:
    Murata & Suzuki (2023), the utility bounds of DP-GD and DIFF2-GD (the ratio (nε/√d)^{-1/3},
    issue 12); issue 20 item 4 (the review of the first fit); Field & Welsh (2007), "Bootstrapping
    clustered data", JRSS B 69 (resampling whole clusters); Holm (1979); Benjamini & Hochberg
    (1995).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Sequence

from ...runtime.outputs import to_json
from ..study.claims import atomic_write_bytes, atomic_write_text
from .cells import (ALPHA, ENDPOINTS, LEGEND, MARK_BETTER, MARK_WORSE, PRIMARY, STALL_PROGRESS,
                    STALL_RULE,
                           Cell, Endpoint, RegimeError, cell_tests, mark, stall_reason)
from .fit import (
    BOOTSTRAP_REPLICATES, BOOTSTRAP_SEED, THEORY_SLOPE, Fit, bootstrap_p, fit_regime, regime_fits,
)
from .plots import MAX_SPAN_DECADES, heatmap_png, scatter_png
from .read import RUN_KEYS, cells_from_summary, read_cells, read_run, summary_paths
from .report import markdown

__all__ = ["ALPHA", "BOOTSTRAP_REPLICATES", "BOOTSTRAP_SEED", "ENDPOINTS", "PRIMARY",
           "STALL_PROGRESS",
           "THEORY_SLOPE", "Cell", "Endpoint", "Fit", "RegimeError", "bootstrap_p", "cell_tests",
           "cells_from_summary",
           "fit_regime", "mark", "read_cells", "read_run", "regime_map", "stall_reason",
           "summary_paths",
           "write_regime"]
# The map's other names, defined in its parts and still importable from here (tests import the
# marks).
__all__ += ["LEGEND", "MARK_BETTER", "MARK_WORSE", "MAX_SPAN_DECADES", "RUN_KEYS", "STALL_RULE",
            "markdown"]


def regime_map(cells: Sequence[Cell], *, alpha: float = ALPHA,
               replicates: int = BOOTSTRAP_REPLICATES, seed: int = BOOTSTRAP_SEED) -> dict[str,
                                                                                           Any]:
    """The machine-readable map: cells (per-seed values, ratios, raw and adjusted p, marks), counts
    and fits."""
    tests = cell_tests(cells, alpha)
    rows = []
    for cell, test in zip(cells, tests):
        per = {}
        for e, spec in ENDPOINTS.items():
            per[e] = {"ratio": cell.ratio(e), "ratio_ci95": cell.ratio_interval(e),
                      "ratio_kind": "geometric mean of per-seed ratios" if spec.log
                      else "ratio of seed means",
                      "diff2_mean": cell.mean(e, cell.diff2),
                      "control_mean": cell.mean(e, cell.control),
                      "diff2_per_seed": list(cell.diff2_values[e]),
                      "control_per_seed": list(cell.control_values[e]), **test[e],
                      "exploratory": not spec.primary, "criterion": spec.criterion,
                      "diff2_point": dict(cell.points.get(cell.diff2, {}).get(spec.criterion, {})),
                      "control_point": dict(cell.points.get(cell.control, {}).get(spec.criterion,
                                                                                  {})),
                      "grid_edges": cell.edges(spec.criterion)}
        rows.append({"dataset": cell.dataset, "n": cell.n, "epsilon": cell.epsilon, "d": cell.d,
                     "x": cell.x,
                     "train_available": cell.train_available, "study": cell.study,
                     "diff2_method": cell.diff2,
                     "control_method": cell.control, "eval_seeds": list(cell.seeds),
                     "stalled_runs": list(cell.stalled), "endpoints": per})
    counts = {e: {"diff2_lower": sum(t[e]["mark"] == MARK_BETTER for t in tests),
                  "dpgd_lower": sum(t[e]["mark"] == MARK_WORSE for t in tests),
                  "ratio_below_1": sum(cell.ratio(e) < 1 for cell in cells), "cells": len(cells),
                  "chosen_at_a_grid_edge": sum(bool(cell.edges(ENDPOINTS[e].criterion))
                                               for cell in cells)}
              for e in ENDPOINTS}
    return {"alpha": alpha, "theory_slope": THEORY_SLOPE, "primary_endpoint": PRIMARY,
            "endpoints": {e: {"label": s.label, "criterion": s.criterion,
                              "scale": "log10" if s.log else "linear",
                              "family": "primary" if s.primary else "exploratory",
                              "adjustment": "holm" if s.primary else "benjamini_hochberg"}
                          for e, s in ENDPOINTS.items()},
            "marks": {MARK_BETTER: "DIFF2-GD lower (adjusted p < alpha, mean difference < 0)",
                      MARK_WORSE: "DP-GD lower (adjusted p < alpha, mean difference > 0)"},
            "stall_rule": {"definition": STALL_RULE, "progress_threshold": STALL_PROGRESS},
            "cells": rows, "counts": counts, "fits": regime_fits(cells, replicates, seed)}


def write_regime(cells: Sequence[Cell], out: str | Path, *, alpha: float = ALPHA,
                 plots: bool = True, replicates: int = BOOTSTRAP_REPLICATES,
                 seed: int = BOOTSTRAP_SEED) -> dict[str, Any]:
    """Write the heatmaps, the scatter, ``regime.md`` and ``regime.json`` into ``out``; return the
    map."""
    out = Path(out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    result = regime_map(cells, alpha=alpha, replicates=replicates, seed=seed)
    files: dict[str, Any] = {"table": str(out / "regime.md"), "json": str(out / "regime.json"),
                             "figures": []}
    if plots:
        for ds in sorted({cell.dataset for cell in cells}):
            path = out / f"heatmap_{ds}.png"
            atomic_write_bytes(path, heatmap_png(cells, result, ds, alpha))
            files["figures"].append(str(path))
        path = out / "scatter.png"
        atomic_write_bytes(path, scatter_png(cells, result, alpha))
        files["figures"].append(str(path))
    result["files"] = files
    atomic_write_text(out / "regime.md", markdown(cells, result, alpha))
    atomic_write_text(out / "regime.json", json.dumps(to_json(result), indent=2) + "\n")
    print(
        f"[diff2] regime map of {len(cells)} cell(s) "
        f"({', '.join(sorted({c.dataset for c in cells}))}) written to {out}", file=sys.stderr)
    return result
