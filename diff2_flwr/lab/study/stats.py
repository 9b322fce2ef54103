"""A study's analysis plan, declared in its file before it runs: protocol, endpoints, families, grid
extension.

A study file's ``analysis:`` block fixes how the runs become claims, before any run exists::

    analysis:
      protocol: corrected    # the default; `paper` is the paper's own rule (optimistic, see below)
      alpha: 0.05
      primary:               # the pre-registered endpoints: Holm across them (every ε and pair too)
        - {criterion: grad_norm_sq, at: final, scale: log, alternative: two-sided}
        - {criterion: train_loss, at: best, alternative: two-sided}
      alternative: two-sided # of the exploratory tests (every other reported comparison): BH q
      # bounds of the grid extension:
      extend: {learning_rate: [0.0078125, 8.0], clip_restart: [0.125, 8.0]}
      budgets: unconstrained # the default; `equal`: a tested pair's methods tune as many points

**Endpoints.** An endpoint is a criterion (``train_loss``, ``grad_norm_sq``, ``test_loss``,
``test_accuracy``) read at a round: ``best`` (the run's own best over rounds: the minimum, the
maximum for accuracy), ``final`` (the last round) or ``train_best`` (the round at which the run's
*train* loss is smallest), on a ``linear`` or ``log`` scale. A test of an endpoint is the paired
t-test by evaluation seed of a treatment against a control; its ``alternative`` is said of
treatment − control (``less``: the treatment's value is lower).

**Protocols.** ``corrected`` (the default of every report and claim):

* test data never chooses: the test loss and accuracy are read at ``train_best`` or ``final``,
  never at their own best (that would be early stopping with the test set as judge);
* selection on at least three tuning seeds (the mean of the criterion over them), disjoint from
  the evaluation seeds; each training criterion picks its grid point by its own declared
  endpoint (e.g. the mean log final ‖∇f‖²), test metrics are read at the train-loss pick;
* symmetric grids: the two methods of a tested pair tune the same shared hyper-parameters
  (learning rate, C₁, a shared routine parameter) with grids of the same size;
* a pick on an edge extends the search: when its value of a key is the smallest or largest among
  the tuned points that share its other values (its line), the point one geometric step further
  (the ratio of the line's two outermost values) is tuned too, and the picks are made again, until
  every pick is interior or the key's bound in ``extend`` is reached (a line search: one new point
  per step); the report lists every pick that stays on an edge.

``paper`` is Murata & Suzuki's Section 6 rule, kept for the faithful reproduction: one tuning seed
is allowed, the grids are the file's, and the test loss and accuracy are each run's best over
rounds of the test metric itself; reports label it *the paper's protocol, optimistic*.

**Budgets.** ``budgets: equal`` (the default is ``unconstrained``) makes the number of tuned grid
configurations the fairness rule: the two methods of every tested pair tune the same number of
points (:meth:`~.methods.MethodSpec.points`, after schedule parameters merge), and nothing is
extended (``extend`` absent or ``false``; the corrected protocol's default bounds do not apply),
so the counts stay equal. The schedule (its name and parameters) is then one method's own axis,
like DIFF2's T and C₂: the symmetric-grid rule no longer asks both to tune it alike, but still asks
it of the shared hyper-parameters (:func:`~.spec._check_symmetric`). Every summary records each
method's tuned configurations and tuning runs per ε, whatever the rule.

**Intervals.** Every test carries the two-sided 95 % interval of its mean difference and a ratio
treatment/control with its interval (:mod:`.intervals`), at 95 % whatever ``alpha``.

**Families.** The tests of the declared ``primary`` endpoints (over every ε and every tested pair)
form the primary family, corrected by Holm: a primary result is a claim when its Holm-adjusted p
is below ``alpha``. Every other reported comparison is exploratory (two-sided unless declared),
with Benjamini–Hochberg q over the study's exploratory family: never a confirmed result. Several
studies form one family with ``diff2 family`` (:mod:`.family`).

References:
    Murata & Suzuki (2023), Section 6, "Evaluation" (the paper's protocol); Holm (1979);
    Benjamini & Hochberg (1995); :mod:`.inference`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping, Sequence

import numpy as np

from .inference import ALTERNATIVES, benjamini_hochberg, holm
from .intervals import LEVEL

__all__ = ["AT", "Analysis", "BUDGETS", "Endpoint", "METRICS", "TEST_METRICS", "TRAIN_METRICS",
           "correct_families", "endpoint_value", "parse_analysis", "train_best_round"]

TRAIN_METRICS = ("train_loss", "grad_norm_sq")
TEST_METRICS = ("test_loss", "test_accuracy")
METRICS = TRAIN_METRICS + TEST_METRICS
AT = ("best", "final", "train_best")
Protocol = Literal["corrected", "paper"]
Budgets = Literal["unconstrained", "equal"]
#: ``analysis.budgets``: ``equal`` asks both methods of a tested pair to tune as many points.
BUDGETS: tuple[str, ...] = ("unconstrained", "equal")

#: Default bounds of the grid extension (corrected protocol), per key: learning rate and clipping
#: radii within 2^±10 / 2^±6 of 1; T from 2 up to R (clipped to the method's R).
DEFAULT_EXTEND: dict[str, tuple[float, float]] = {
    "learning_rate": (2.0 ** -10, 2.0 ** 4), "clip_restart": (2.0 ** -6, 2.0 ** 6),
    "clip_diff": (2.0 ** -6, 2.0 ** 6), "restart_every": (2.0, math.inf)}
#: Extensions of one axis in one direction, at most (a guard: each costs a full re-tuning of the new
#: points).
MAX_EXTENSIONS = 4


@dataclass(frozen=True)
class Endpoint:
    """A test's endpoint: a criterion, the round it is read at, its scale and the alternative."""

    criterion: str
    at: str = "best"
    scale: str = "linear"
    alternative: str = "two-sided"

    def label(self) -> str:
        """``log grad_norm_sq final``: the endpoint in words."""
        at = {"best": "best over rounds", "final": "final",
              "train_best": "at the train-loss-best round"}[self.at]
        return f"{'log ' if self.scale == 'log' else ''}{self.criterion} {at}"

    def matches(self, criterion: str, at: str) -> bool:
        """Whether this is the endpoint of ``criterion`` read ``at``."""
        return (self.criterion, self.at) == (criterion, at)

    def as_dict(self) -> dict[str, str]:
        """Plain data, as the summary gives it."""
        return {"criterion": self.criterion, "at": self.at, "scale": self.scale,
                "alternative": self.alternative}


@dataclass(frozen=True)
class Analysis:
    """A study's analysis plan: its protocol, α, primary endpoints and the grid's extension."""

    protocol: Protocol = "corrected"
    alpha: float = 0.05
    primary: tuple[Endpoint, ...] = ()
    alternative: str = "two-sided"  # of the exploratory tests
    extend: tuple[tuple[str, float, float], ...] = ()  # (key, low, high): the extension's bounds
    declared: bool = False  # the file has an analysis block
    #: ``equal``: both methods of a tested pair tune the same number of grid points, none extended
    budgets: Budgets = "unconstrained"

    @property
    def corrected(self) -> bool:
        """Whether the protocol is the corrected one (not the paper's)."""
        return self.protocol == "corrected"

    def bounds(self, key: str) -> tuple[float, float] | None:
        """The extension's (low, high) bounds of grid key ``key`` (None: it is not extended)."""
        return next(((lo, hi) for k, lo, hi in self.extend if k == key), None)

    def selection(self, criterion: str) -> Endpoint:
        """The endpoint a training criterion selects its grid point by: its first primary endpoint
        if one is declared (the corrected protocol), else its best over rounds (the paper's
        rule)."""
        if self.corrected:
            for e in self.primary:
                if e.criterion == criterion and e.at != "train_best":
                    return e
        return Endpoint(criterion, "best")

    def reported_at(self, criterion: str) -> tuple[str, ...]:
        """The rounds a criterion is reported (and compared) at: training criteria at their best and
        final; test metrics at the train-loss-best round and final (corrected) or at their own best
        and final (paper)."""
        if criterion in TRAIN_METRICS:
            return ("best", "final")
        return ("train_best", "final") if self.corrected else ("best", "final")

    def primary_for(self, criterion: str, at: str) -> Endpoint | None:
        """The primary endpoint of ``criterion`` read ``at`` (None: it is exploratory)."""
        return next((e for e in self.primary if e.matches(criterion, at)), None)

    def as_dict(self) -> dict[str, Any]:
        """Plain data, as the summary gives it (with the protocol in words)."""
        return {"protocol": self.protocol, "declared": self.declared, "alpha": self.alpha,
                "primary": [e.as_dict() for e in self.primary],
                "exploratory_alternative": self.alternative,
                "extend": {k: [lo, hi] for k, lo, hi in self.extend},
                "budgets": self.budgets, "ci_level": LEVEL,
                "label": ("corrected: test metrics at the train-loss-best round, selection on the "
                          "tuning seeds' mean, Holm over the primary family, BH q over the "
                          "exploratory one") if self.corrected else
                         ("the paper's protocol (Section 6): test metrics at their own best over "
                          "rounds, i.e. early stopping on the test set: optimistic; kept for the "
                          "faithful reproduction")}


def parse_analysis(data: Any, fail: Callable[[str, str, Any], Exception], *, tune_seeds: int,
                   rounds: int) -> Analysis:
    """Validate a study's ``analysis`` block (``None``: the corrected protocol with no primary
    endpoint)."""
    declared = data is not None
    data = {} if data is None else data
    keys = {"protocol", "alpha", "primary", "alternative", "extend", "budgets"}
    if not isinstance(data, Mapping) or set(data) - keys:
        raise fail("analysis", "a mapping with keys among protocol, alpha, primary, alternative, "
                   "extend, budgets", data)
    protocol = data.get("protocol", "corrected")
    if protocol not in ("corrected", "paper"):
        raise fail("analysis.protocol", "'corrected' (the default) or 'paper' (the paper's Section "
                   "6 rule, optimistic)", protocol)
    alpha = data.get("alpha", 0.05)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not 0 < alpha < 1:
        raise fail("analysis.alpha", "a number in (0, 1)", alpha)
    alternative = data.get("alternative", "two-sided")
    if alternative not in ALTERNATIVES:
        raise fail("analysis.alternative", f"one of {', '.join(ALTERNATIVES)}", alternative)
    primary = _parse_primary(data.get("primary") or [], protocol, fail)
    if protocol == "corrected" and tune_seeds < 3:
        raise fail("seeds.tune", "at least 3 tuning seeds under the corrected protocol (selection "
                   "on one seed picks that seed's noise); add seeds, or set `analysis: {protocol: "
                   "paper}` for the paper's one-seed rule", f"{tune_seeds} seed(s)")
    budgets = _parse_budgets(data, fail)
    extend = ({} if budgets == "equal" else
              _parse_extend(data.get("extend"), protocol, fail, rounds))
    return Analysis(protocol=protocol, alpha=float(alpha), primary=tuple(primary),
                    alternative=str(alternative), declared=declared, budgets=budgets,
                    extend=tuple((k, lo, hi) for k, (lo, hi) in sorted(extend.items())))


def _parse_budgets(data: Mapping[str, Any], fail: Callable[[str, str, Any], Exception]) -> Budgets:
    """``analysis.budgets``: ``unconstrained`` (the default) or ``equal``, which extends nothing
    (an extension tunes more points for the method whose pick lies on an edge)."""
    budgets = data.get("budgets", "unconstrained")
    if budgets not in BUDGETS:
        raise fail("analysis.budgets", "'unconstrained' (the default) or 'equal' (both methods of "
                   "a tested pair tune the same number of grid points)", budgets)
    extend = data.get("extend")
    if budgets == "equal" and extend is not None and extend is not False:
        raise fail("analysis.extend", "no grid extension under `budgets: equal` (an extension "
                   "tunes more points for the method whose pick lies on an edge, so the budgets "
                   "would differ): remove `extend`, or drop `budgets: equal`", extend)
    return budgets


def _parse_primary(raw: Any, protocol: str,
                   fail: Callable[[str, str, Any], Exception]) -> list[Endpoint]:
    """The ``analysis.primary`` list: each endpoint valid under ``protocol``, each (criterion, at)
    once."""
    if not isinstance(raw, list):
        raise fail("analysis.primary", "a list of endpoints {criterion, at, scale, alternative}",
                   raw)
    primary: list[Endpoint] = []
    for i, e in enumerate(raw):
        where = f"analysis.primary[{i}]"
        endpoint = _parse_endpoint(e, where, protocol, fail)
        if any(p.matches(endpoint.criterion, endpoint.at) for p in primary):
            raise fail(where, "each (criterion, at) once", e)
        primary.append(endpoint)
    return primary


def _parse_endpoint(e: Any, where: str, protocol: str,
                    fail: Callable[[str, str, Any], Exception]) -> Endpoint:
    """One entry of ``analysis.primary`` (at ``where``) as an :class:`Endpoint`."""
    keys = {"criterion", "at", "scale", "alternative"}
    if not isinstance(e, Mapping) or set(e) - keys or "criterion" not in e:
        raise fail(where, "a mapping with criterion and optionally at, scale, alternative", e)
    if e["criterion"] not in METRICS:
        raise fail(f"{where}.criterion", f"one of {', '.join(METRICS)}", e["criterion"])
    at = e.get("at", "best")
    if at not in AT:
        raise fail(f"{where}.at", f"one of {', '.join(AT)}", at)
    if protocol == "corrected" and e["criterion"] in TEST_METRICS and at == "best":
        raise fail(f"{where}.at", "'train_best' or 'final' for a test metric (its own best over "
                   "rounds lets the test set choose the round; the paper's protocol does that: "
                   "analysis.protocol: paper)", at)
    if e.get("scale", "linear") not in ("linear", "log"):
        raise fail(f"{where}.scale", "'linear' or 'log'", e.get("scale"))
    if e.get("alternative", "two-sided") not in ALTERNATIVES:
        raise fail(f"{where}.alternative", f"one of {', '.join(ALTERNATIVES)} (of treatment − "
                   "control)", e.get("alternative"))
    return Endpoint(str(e["criterion"]), str(at), str(e.get("scale", "linear")),
                    str(e.get("alternative", "two-sided")))


def _parse_extend(extend_raw: Any, protocol: str, fail: Callable[[str, str, Any], Exception],
                  rounds: int) -> dict[str, tuple[float, float]]:
    """Bounds of the grid extension per key: the defaults under the corrected protocol, updated by
    ``analysis.extend`` (``false``: none); T's bounds clipped to [2, R]."""
    extend: dict[str, tuple[float, float]] = dict(DEFAULT_EXTEND) if protocol == "corrected" else {}
    if extend_raw is False:
        extend = {}
    elif extend_raw is not None:
        if not isinstance(extend_raw, Mapping):
            raise fail("analysis.extend", "a mapping key -> [low, high] (bounds of the grid "
                       "extension), or false", extend_raw)
        for key, bounds in extend_raw.items():
            if (not isinstance(bounds, list) or len(bounds) != 2 or not all(
                    isinstance(b, (int, float)) and not isinstance(b, bool) and b > 0
                    for b in bounds)
                    or bounds[0] > bounds[1]):
                raise fail(f"analysis.extend.{key}", "[low, high] with 0 < low <= high", bounds)
            extend[str(key)] = (float(bounds[0]), float(bounds[1]))
    if "restart_every" in extend:
        lo, hi = extend["restart_every"]
        extend["restart_every"] = (max(lo, 2.0), min(hi, float(rounds)))
    return extend


def train_best_round(run: Mapping[str, Any]) -> int:
    """Index of the run's smallest finite train loss (the first, on ties); 0 if none is finite."""
    losses = np.asarray([math.inf if v is None else v for v in run["train_loss"]], dtype=float)
    finite = np.isfinite(losses)
    return int(np.argmin(np.where(finite, losses, np.inf))) if finite.any() else 0


def endpoint_value(run: Mapping[str, Any], criterion: str, at: str, scale: str = "linear") -> float:
    """One run's value of an endpoint (inf: a loss diverged; NaN: an accuracy that does not
    exist)."""
    accuracy = criterion == "test_accuracy"
    missing = math.nan if accuracy else math.inf
    values = np.asarray([missing if v is None else v for v in run[criterion]], dtype=float)
    if at == "final":
        v = float(values[-1])
    elif at == "train_best":
        v = float(values[train_best_round(run)])
    elif accuracy:
        finite = values[np.isfinite(values)]
        v = float(finite.max()) if finite.size else math.nan
    else:
        v = float(values.min())
    if scale == "log":
        v = math.log(v) if v > 0 and math.isfinite(v) else (
            v if not math.isfinite(v) else -math.inf)
    return v


def correct_families(rows: Sequence[dict]) -> dict[str, Any]:
    """Adjust the test rows of a study in place: Holm over the ``primary`` rows, BH over the
    ``exploratory`` ones.

    Each row has ``family`` and ``p_value``; it gains ``p_adjusted`` and ``adjustment``. Returns the
    families' sizes and adjustments.
    """
    out = {}
    for family, adjust, name in (("primary", holm, "holm"),
                                 ("exploratory", benjamini_hochberg, "bh")):
        members = [r for r in rows if r["family"] == family]
        for r, p in zip(members, adjust([r["p_value"] for r in members])):
            r["p_adjusted"], r["adjustment"] = p, name
        out[family] = {"size": len(members), "adjustment": name}
    return out
