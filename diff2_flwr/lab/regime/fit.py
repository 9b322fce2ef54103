"""The regime map's fit: mean log10 ratio = a_dataset + b·log10(nε/√d) with a cluster bootstrap
over seeds (a cell's response: the mean over seeds of the paired log10 difference).

:func:`fit_regime` fits one set of cells (:class:`Fit`); :func:`regime_fits` the map's pooled,
per-dataset and sensitivity fits. Why a cluster bootstrap, and what its interval does not cover:
:mod:`.regime`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from .cells import PRIMARY, STALL_RULE, Cell, RegimeError

__all__ = ["BOOTSTRAP_REPLICATES", "BOOTSTRAP_SEED", "THEORY_SLOPE", "Fit", "bootstrap_p",
           "fit_regime",
           "regime_fits"]

#: Slope of log(DIFF2 bound / DP-GD bound) on log(nε/√d) for ‖∇f‖²: (nε/√d)^{-1/3}.
THEORY_SLOPE = -1.0 / 3.0
BOOTSTRAP_REPLICATES = 2000
#: The default seed of the bootstrap's generator: a map is reproducible unless asked otherwise.
BOOTSTRAP_SEED = 20


@dataclass(frozen=True)
class Fit:
    """mean log10 ratio = a_dataset + b·log10(nε/√d) over k cells, with a cluster-bootstrap interval
    for b."""

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
    # the points' mean log10 x and log10 ratio: where the theory's line is drawn through
    anchor_log_x: float
    anchor_log_ratio: float
    # log10 scatter of the cells about the fitted lines (k − datasets − 1 dof)
    residual_sd: float = math.nan
    # log10 spread of a cell's ratio under the bootstrap (root mean square over cells)
    seed_sd: float = math.nan

    @property
    def k(self) -> int:
        """The number of cells fitted."""
        return len(self.cells)

    @property
    def theory_in_ci(self) -> bool:
        """−1/3 inside the interval (within rounding, 1e-12, as :func:`bootstrap_p` counts ties)."""
        return self.ci_low - 1e-12 <= THEORY_SLOPE <= self.ci_high + 1e-12

    def crossing(self, dataset: str) -> float:
        """nε/√d where the dataset's fitted ratio is 1 (NaN for a flat fit, inf beyond floating
        point)."""
        if self.slope == 0:
            return math.nan
        try:
            return 10 ** (-self.intercepts[dataset] / self.slope)
        except OverflowError:  # a nearly flat fit
            return math.inf

    def as_dict(self) -> dict[str, Any]:
        """The fit as the regime map's JSON reports it: slope, 95 % interval, intercepts, both
        bootstrap p, crossings, the bootstrap's settings, lack of fit, the theory line's anchor."""
        return {"k": self.k, "cells": list(self.cells), "slope": self.slope, "ci95": [self.ci_low,
                                                                                      self.ci_high],
                "intercepts": dict(self.intercepts), "p_slope_equals_theory": self.p_theory,
                "p_slope_equals_zero": self.p_zero, "theory_slope": THEORY_SLOPE,
                "theory_in_ci": self.theory_in_ci,
                "crossing_x": {ds: self.crossing(ds) for ds in self.intercepts},
                "bootstrap": {"replicates": self.replicates, "seed": self.seed,
                              "cluster": self.cluster,
                              "interval": "percentile"},
                "lack_of_fit": {"residual_sd_log10": self.residual_sd,
                                "seed_sd_log10": self.seed_sd},
                "theory_line_through": {"x": 10 ** self.anchor_log_x,
                                        "ratio": 10 ** self.anchor_log_ratio}}


def bootstrap_p(replicates: np.ndarray, null: float) -> float:
    """Two-sided bootstrap p of H0 slope = ``null``: 2·min(share ≤ null, share ≥ null), in [1/(B+1),
    1].

    A replicate within rounding (1e-12) of ``null`` counts on both sides: an exactly constructed
    slope is a tie, not a coin toss of floating-point error.
    """
    b = replicates.size
    tie = np.abs(replicates - null) <= 1e-12
    share = min(float(np.mean((replicates <= null) | tie)),
                float(np.mean((replicates >= null) | tie)))
    return min(1.0, max(2.0 * share, 1.0 / (b + 1)))


def _cluster(cells: Sequence[Cell]) -> str:
    if len({cell.seeds for cell in cells}) == 1:
        return "seed"
    sizes = {len(cell.seeds): cell for cell in cells}
    if len(sizes) > 1:
        a, b = list(sizes.values())[:2]
        raise RegimeError(
            f"The bootstrap resamples seed positions, but {a.study} evaluated {len(a.seeds)} "
            f"seeds and "
                          f"{b.study} {len(b.seeds)}. Evaluate every study of the map on the same "
                          f"number of seeds "
                          "(`seeds.evaluate`), or map them separately.")
    return "seed position"


def fit_regime(cells: Sequence[Cell], *, endpoint: str = PRIMARY,
               replicates: int = BOOTSTRAP_REPLICATES, seed: int = BOOTSTRAP_SEED) -> Fit | None:
    """The dataset-effect fit over the cells whose per-seed values are finite and positive, with its
    cluster bootstrap (see the module docstring); None when the slope is not identified (fewer than
    3 such cells, or no dataset with two different nε/√d)."""
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
    # per seed, the paired log10 difference; a cell's response is their mean (the log of the
    # geometric mean of the per-seed ratios), which no single seed dominates
    diffs = np.log10(treat) - np.log10(ctrl)  # k x S
    ly = diffs.mean(axis=1)
    coef = np.linalg.lstsq(design, ly, rcond=None)[0]
    # one draw of seed indices per replicate, the same for every cell: the seeds are the clusters
    idx = np.random.default_rng(seed).integers(0, treat.shape[1], size=(replicates, treat.shape[1]))
    ly_b = diffs[:, idx].mean(axis=2)  # k x B
    slopes = np.linalg.lstsq(design, ly_b, rcond=None)[0][-1]
    low, high = np.percentile(slopes, [2.5, 97.5])
    dof = len(usable) - design.shape[1]
    resid = ly - design @ coef
    return Fit(cells=tuple(cell.label for cell in usable), slope=float(coef[-1]),
               intercepts={ds: float(coef[g]) for g, ds in enumerate(datasets)}, ci_low=float(low),
               ci_high=float(high), p_theory=bootstrap_p(slopes, THEORY_SLOPE),
               p_zero=bootstrap_p(slopes, 0.0), replicates=replicates, seed=seed, cluster=cluster,
               anchor_log_x=float(lx.mean()), anchor_log_ratio=float(ly.mean()),
               residual_sd=float(np.sqrt(np.sum(resid ** 2) / dof)) if dof > 0 else math.nan,
               seed_sd=float(np.sqrt(np.mean(np.var(ly_b, axis=1)))))


def regime_fits(cells: Sequence[Cell], replicates: int, seed: int) -> dict[str, Any]:
    """The map's fits of the primary endpoint: pooled (every cell), per dataset (exploratory), and
    the sensitivity fit without the cells that have a stalled run."""
    def fit(sub: Sequence[Cell]) -> dict[str, Any] | None:
        found = fit_regime(sub, replicates=replicates, seed=seed)
        return None if found is None else found.as_dict()

    kept = [cell for cell in cells if not cell.stalled]
    excluded = [{"dataset": cell.dataset, "n": cell.n, "epsilon": cell.epsilon,
                 "stalled_runs": list(cell.stalled)}
                for cell in cells if cell.stalled]
    return {"endpoint": PRIMARY,
            "model": "mean_seeds(log10 DIFF2 - log10 DP-GD) = a_dataset + b * log10(n*eps/sqrt(d))",
            "not_fitted": [cell.label for cell in cells if not cell.fit_ready(PRIMARY)],
            "pooled": fit(cells),
            "per_dataset": {ds: fit([c for c in cells if c.dataset == ds])
                            for ds in sorted({c.dataset for c in cells})},
            "sensitivity": {"rule": STALL_RULE, "excluded": excluded, "fit": fit(kept)}}
