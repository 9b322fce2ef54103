"""The regime map's cells: the endpoints, the stall rule, one (dataset, n, ε) cell and its adjusted
tests.

A :class:`Cell` holds both methods' per-seed endpoint values (:data:`ENDPOINTS`) and its stalled
runs (:func:`stall_reason`); :func:`cell_tests` adjusts the cells' p-values (Holm over the primary
endpoint, BH over every exploratory one) and marks them (:func:`mark`). What the map is and why:
:mod:`.regime`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ..study.stats import endpoint_value
from ..study.inference import benjamini_hochberg, holm, paired_ttest
from ..study.intervals import difference_interval

__all__ = ["ALPHA", "ENDPOINTS", "LEGEND", "MARK_BETTER", "MARK_WORSE", "PRIMARY", "STALL_PROGRESS",
           "STALL_RULE",
           "Cell", "Endpoint", "RegimeError", "cell_tests", "mark", "stall_reason"]

ALPHA = 0.05
#: A run *stalls* when it diverged, or when its final train loss is >= STALL_PROGRESS x its train
#: loss at the first recorded round (less than 10 % progress over the run). Applied mechanically to
#: every run of both methods at the ‖∇f‖²-best point; a cell with a stalled run leaves the
#: sensitivity fit (never the main one).
STALL_PROGRESS = 0.9
STALL_RULE = (
    f"a run stalls if it diverged or its final train loss is >= {STALL_PROGRESS:g} x its train "
    f"loss at the "
              "first recorded round; a cell leaves the sensitivity fit if any run of either "
              "method at the "
              "‖∇f‖²-best point stalled")
MARK_BETTER, MARK_WORSE = "*", "†"
LEGEND = (
    f"{MARK_BETTER} DIFF2-GD lower, {MARK_WORSE} DP-GD lower: two-sided paired t-test by seed, "
    f"adjusted p < α "
          "(Holm for final ‖∇f‖², Benjamini–Hochberg q for the exploratory endpoints)")


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
    # the study's own endpoint rules (lab.analysis): one definition of "final", "best" and
    # "train_best"
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
        return (
            f"final train loss {final:.4g} >= {STALL_PROGRESS:g} x {first:.4g} at the first "
            f"recorded round {run['rounds'][0]}")
    return None


@dataclass(frozen=True)
class Cell:
    """One (dataset, n, ε) of the family: both methods' per-seed endpoint values and their stalled
    runs."""

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
    # chosen hyper-parameters
    points: Mapping[str, Mapping[str, Mapping[str, float]]] = field(default_factory=dict)
    # each method's grid
    grids: Mapping[str, Mapping[str, Sequence[float]]] = field(default_factory=dict)

    @property
    def x(self) -> float:
        """nε/√d."""
        return self.n * self.epsilon / math.sqrt(self.d)

    @property
    def label(self) -> str:
        """``<dataset> n=<n> ε=<ε>``: how the fit and the reports name the cell."""
        return f"{self.dataset} n={self.n} ε={self.epsilon:g}"

    def mean(self, endpoint: str, method: str) -> float:
        """The seed mean of ``method``'s ``endpoint`` values (``method`` is :attr:`diff2` or
        :attr:`control`); inf when a seed's value is not finite (a diverged run)."""
        values = self.diff2_values if method == self.diff2 else self.control_values
        v = np.asarray(values[endpoint], dtype=float)
        return float(v.mean()) if np.all(np.isfinite(v)) else math.inf

    def ratio(self, endpoint: str) -> float:
        """DIFF2-GD over DP-GD: for a log endpoint (‖∇f‖²) the geometric mean of the per-seed
        ratios, 10^(mean log10 difference), the quantity its t-test tests, which one seed cannot
        dominate; for a loss the ratio of the seed means. inf or 0 when one of them diverged on a
        seed, NaN when both did."""
        a, b = self.mean(endpoint, self.diff2), self.mean(endpoint, self.control)
        if not (math.isfinite(a) and math.isfinite(b)):
            return math.nan if not math.isfinite(a) and not math.isfinite(b) else (
                math.inf if not math.isfinite(a) else 0.0)
        if ENDPOINTS[endpoint].log:
            diff = self.mean_difference(endpoint)
            return 10 ** diff if math.isfinite(diff) else math.nan
        return a / b if b > 0 else math.nan

    def ratio_interval(self, endpoint: str) -> tuple[float, float] | None:
        """The 95 % interval of :meth:`ratio` for a log endpoint (10^ of the paired t-interval of
        the mean log10 difference); None for a loss, or when a value is not finite."""
        if not ENDPOINTS[endpoint].log:
            return None
        found = difference_interval(*self.tested(endpoint))
        return None if found is None else (10 ** found[0], 10 ** found[1])

    def fit_ready(self, endpoint: str = PRIMARY) -> bool:
        """Every per-seed value of both methods finite and positive (a finite log ratio on every
        seed, so under any resample)."""
        v = np.asarray([self.diff2_values[endpoint], self.control_values[endpoint]], dtype=float)
        return bool(np.all(np.isfinite(v)) and np.all(v > 0))

    def tested(self, endpoint: str) -> tuple[np.ndarray, np.ndarray]:
        """The two per-seed samples the t-test compares (log10 for a log endpoint)."""
        a, b = (np.asarray(v[endpoint], dtype=float) for v in (self.diff2_values,
                                                               self.control_values))
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
        """Per method, the hyper-parameters chosen at the lowest or highest value of their grid axis
        (an axis of more than one value): there the grid may have been too narrow for that method,
        and the ratio unfair."""
        out: dict[str, list[str]] = {}
        for method in (self.diff2, self.control):
            point, grid = self.points.get(method, {}).get(criterion, {}), self.grids.get(method, {})
            hits = [f"{k}={v:g} ({'lowest' if v == min(grid[k]) else 'highest'})" for k,
                    v in point.items()
                    if len(grid.get(k, ())) > 1 and v in (min(grid[k]), max(grid[k]))]
            if hits:
                out[method] = hits
        return out


def mark(p_adjusted: float, mean_difference: float, alpha: float = ALPHA) -> str:
    """``*`` if the adjusted p < α and DIFF2-GD is lower on average, ``†`` if DP-GD is, else
    ``""``."""
    if not (math.isfinite(p_adjusted) and math.isfinite(mean_difference)) or p_adjusted >= alpha:
        return ""
    return MARK_BETTER if mean_difference < 0 else MARK_WORSE if mean_difference > 0 else ""


def cell_tests(cells: Sequence[Cell], alpha: float = ALPHA) -> list[dict[str, dict[str, Any]]]:
    """Per cell and endpoint: raw two-sided p, adjusted p (Holm over the primary family, BH over
    every exploratory test of the map), the mean paired difference and the mark."""
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
