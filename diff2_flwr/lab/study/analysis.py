"""A study's analysis: pure functions of a loaded table of runs (run id -> run record) and the
study's spec.

Selection (:func:`select`, :func:`select_method`: the grid point with the best mean over the tuning
seeds), one ε's summary (:func:`summarise`: per method and criterion the chosen point and the
endpoint values over the evaluation seeds, per tested pair the paired t-tests with their 95 %
intervals (:mod:`.intervals`), per method its tuning budget), the study's inference
(:func:`inference`: Holm over the primary family, BH over the exploratory one) and the cost of
each method (:func:`cost_summary`). Nothing here reads or writes a file: the scheduler
loads the runs (:func:`~.scheduler.load_runs`).

References:
    Murata & Suzuki (2023), Section 6; :mod:`.analysis` (the protocol and its endpoints);
    :mod:`.inference`.
"""

from __future__ import annotations

import json
import math
from typing import Any, Mapping, Sequence

import numpy as np

from ...core.cost import gradient_evaluations
from .report import aligned_metric
from .stats import correct_families, endpoint_value
from .inference import paired_ttest
from .intervals import paired_intervals
from .plan import SELECTING, run_id
from .spec import ACCURACY, CRITERIA, MethodSpec, Study, test_pairs

__all__ = ["TARGET_SLACK", "budget_summary", "cost_summary", "inference", "mean",
           "paired_one_sided_ttest", "select", "select_method", "std", "summarise"]

#: How close to the reference's mean minimum a method's curve must come to count as reaching its
#: utility.
TARGET_SLACK = 0.05

# run id -> run record (criteria as lists, inf/NaN for a diverged run's missing values)
Runs = Mapping[str, dict]


def mean(values: Sequence[float]) -> float:
    """The mean, or inf if any value is not finite (a diverged run makes its point the worst)."""
    arr = np.asarray(values, dtype=float)
    return float(np.mean(arr)) if np.all(np.isfinite(arr)) else math.inf


def std(values: Sequence[float]) -> float:
    """The sample standard deviation (ddof 1); NaN for one value or any value not finite."""
    arr = np.asarray(values, dtype=float)
    return float(np.std(arr, ddof=1)) if arr.size > 1 and np.all(np.isfinite(arr)) else math.nan


def _stats(values: Sequence[float]) -> dict[str, Any]:
    return {"mean": mean(values), "std": std(values), "per_seed": list(values)}


def paired_one_sided_ttest(treatment: Sequence[float], control: Sequence[float]) -> float:
    """p-value of the paired t-test with H1: mean(treatment - control) < 0 (n - 1 degrees of
    freedom)."""
    return paired_ttest(treatment, control, "less")


# ------------------------------------------------------------------------------- selection

def select(table: Mapping[str, Mapping[str, Sequence[float]]]) -> dict[str, str]:
    """Choose a grid point per criterion from ``table[point][criterion] = per-seed minima``.

    train_loss and grad_norm_sq each pick their own best (smallest mean over seeds, diverged =
    inf; ties go to the first point); test_loss uses the train-loss-best point.
    """
    if not table:
        raise ValueError("Nothing to select from: the grid is empty.")
    chosen = {}
    for criterion in SELECTING:
        chosen[criterion] = min(table, key=lambda point: mean(table[point][criterion]))
    chosen["test_loss"] = chosen["train_loss"]
    return chosen


def _point_key(point: Mapping[str, float]) -> str:
    return json.dumps(dict(point), sort_keys=True)


def select_method(study: Study, m: MethodSpec, points: Sequence[Mapping[str, float]],
                  epsilon: float, runs: Runs) -> dict[str, dict]:
    """Per criterion, the point with the best mean over the tuning seeds of the criterion's
    selection endpoint."""
    table: dict[str, dict[str, list[float]]] = {}
    for p in points:
        records = [runs[run_id("tune", m, p, epsilon, s, study)] for s in study.tune_seeds]
        row = table[_point_key(p)] = {}
        for c in SELECTING:
            e = study.analysis.selection(c)
            row[c] = [endpoint_value(r, c, e.at, e.scale) for r in records]
        row["test_loss"] = row["train_loss"]
    picks = select(table)
    return {c: json.loads(picks[c]) for c in CRITERIA}


# ------------------------------------------------------------------------------- one ε's summary

def summarise(study: Study, epsilon: float, chosen: Mapping[str, Mapping[str, dict]],
              searched: Mapping[str, dict],
              runs: Runs, n_min: int, n_train: int) -> tuple[dict, list[dict]]:
    """One ε's summary: per method and criterion the chosen point and the endpoint values over the
    evaluation seeds; per tested pair the paired t-tests. Returns the summary and its test rows (to
    be corrected over the whole study: :func:`inference`)."""
    out: dict[str, Any] = {"methods": {}, "tests": {}}
    runs_of: dict[tuple[str, str], list[dict]] = {}
    for m in study.methods:
        out["methods"][m.name] = _method_entry(study, m, epsilon, chosen[m.name], searched[m.name],
                                               runs, n_min, runs_of)
    rows: list[dict] = []
    for treat, control in test_pairs(study):
        pair = f"{treat} vs {control}"
        out["tests"][pair] = {}
        for c in (*CRITERIA, ACCURACY):
            if (treat, c) in runs_of and (control, c) in runs_of:
                out["tests"][pair][c] = _pair_test(study, epsilon, treat, control, c, runs_of, rows)
    out["cost"] = cost_summary(study, epsilon, out["methods"], runs, n_train)
    out["budgets"] = budget_summary(study, searched)
    return out, rows


def budget_summary(study: Study, searched: Mapping[str, dict]) -> dict[str, Any]:
    """What each method spent on tuning at one ε: its grid configurations as declared and as tuned
    (with the extensions), and its tuning runs (every tuned configuration on every tuning seed);
    ``rule`` is the study's ``analysis.budgets``."""
    seeds = len(study.tune_seeds)
    return {"rule": study.analysis.budgets, "tune_seeds": seeds, "methods": {
        m.name: {"configurations_declared": len(m.points()),
                 "configurations_tuned": searched[m.name]["points"],
                 "tuning_runs": searched[m.name]["points"] * seeds} for m in study.methods}}


def _method_entry(study: Study, m: MethodSpec, epsilon: float, chosen: Mapping[str, dict],
                  searched: Mapping[str, Any], runs: Runs, n_min: int,
                  runs_of: dict[tuple[str, str], list[dict]]) -> dict[str, Any]:
    """One method's entry: what it is, what was searched, and per criterion its pick's evaluation
    (the runs it read are added to ``runs_of`` for the tests)."""
    entry: dict[str, Any] = {"base_method": m.method, "u": m.u, "routine": m.routine_of({}),
                             "schedule": m.schedules_fixed(),
                             "rounds": study.rounds_of(m), "seed_offset": m.seed_offset,
                             "grid": {k: list(v) for k, v in m.grid},
                             "grid_searched": searched["grid"],
                             "points_tuned": searched["points"],
                             "extensions": searched["extensions"],
                             "edges": searched["edges"], "criteria": {}}
    for c in CRITERIA:
        point = chosen[c]
        records = [runs[run_id("eval", m, point, epsilon, s, study)] for s in study.eval_seeds]
        runs_of[m.name, c] = records
        entry["criteria"][c] = _criterion_entry(study, m, c, point, epsilon, records, n_min)
    records = runs_of[m.name, "train_loss"]
    if all(ACCURACY in r for r in records):
        runs_of[m.name, ACCURACY] = records
        entry["accuracy"] = _accuracy_entry(study, chosen["train_loss"], records)
    return entry


def _criterion_entry(study: Study, m: MethodSpec, c: str, point: dict, epsilon: float,
                     records: Sequence[dict], n_min: int) -> dict[str, Any]:
    analysis = study.analysis
    cal = study.experiment(m, point, epsilon, study.eval_seeds[0]).calibration(n_min)
    info: dict[str, Any] = {
        "point": point, "run_ids": [r["run_id"] for r in records], "selected_by": (
            analysis.selection(c).as_dict() if c != "test_loss" else {"criterion": "train_loss",
                                                                      "at": "the train-loss pick"}),
        "diverged": sum(r["diverged_at"] is not None for r in records),
        "calibration": None if cal is None else {
            k: cal.as_dict()[k] for k in ("sigma1", "sigma2", "z1", "z2", "mode")},
        "at": {at: _stats([endpoint_value(r, c, at) for r in records])
               for at in analysis.reported_at(c)}}
    for name, at in (("min", "best"), ("train_best", "train_best"), ("final", "final")):
        if at in info["at"]:
            values = info["at"][at]
            info[f"{name}_mean"], info[f"{name}_std"] = values["mean"], values["std"]
    info["reported"] = {"at": analysis.reported_at(c)[0], **info["at"][analysis.reported_at(c)[0]]}
    return info


def _accuracy_entry(study: Study, point: dict, records: Sequence[dict]) -> dict[str, Any]:
    """The test accuracy at the train-loss pick (reported, never selected on)."""
    reported = study.analysis.reported_at(ACCURACY)
    at_values = {at: _stats([endpoint_value(r, ACCURACY, at) for r in records]) for at in reported}
    out = {"at_point": "train_loss", "point": point, "run_ids": [r["run_id"] for r in records],
           "at": at_values, "reported": {"at": reported[0], **at_values[reported[0]]},
           "final_mean": at_values["final"]["mean"], "final_std": at_values["final"]["std"]}
    if "best" in at_values:  # the paper's protocol: each run's best accuracy over rounds
        out["best_mean"], out["best_std"] = at_values["best"]["mean"], at_values["best"]["std"]
    else:
        out["train_best_mean"] = at_values["train_best"]["mean"]
    return out


def _pair_test(study: Study, epsilon: float, treat: str, control: str, c: str,
               runs_of: Mapping[tuple[str, str], list[dict]], rows: list[dict]) -> dict[str, Any]:
    """The paired t-tests of one criterion for one pair, at each reported round and each declared
    endpoint (each test is also appended to ``rows``)."""
    analysis = study.analysis
    ats = list(dict.fromkeys([*analysis.reported_at(c),
                              *(e.at for e in analysis.primary if e.criterion == c)]))
    per: dict[str, Any] = {"df": len(study.eval_seeds) - 1, "rows": {}}
    for at in ats:
        declared = analysis.primary_for(c, at)
        scale = declared.scale if declared else "linear"
        alternative = declared.alternative if declared else analysis.alternative
        a = [endpoint_value(r, c, at, scale) for r in runs_of[treat, c]]
        b = [endpoint_value(r, c, at, scale) for r in runs_of[control, c]]
        row = {"epsilon": epsilon, "pair": f"{treat} vs {control}", "treatment": treat,
               "control": control, "criterion": c, "at": at, "scale": scale,
               "alternative": alternative,
               "family": "primary" if declared else "exploratory",
               "p_value": paired_ttest(a, b, alternative), "df": len(a) - 1,
               "treatment_mean": mean(a), "control_mean": mean(b),
               "mean_difference": mean(np.subtract(a, b)) if len(a) == len(b) else math.nan,
               **paired_intervals(a, b, scale)}
        per["rows"][at] = row
        rows.append(row)
    per["p_value"] = per["rows"][ats[0]]["p_value"]
    per["p_value_final"] = per["rows"]["final"]["p_value"]
    return per


# ---------------------------------------------------------------------- the study's inference

def inference(study: Study, rows: list[dict]) -> dict[str, Any]:
    """Correct the study's tests (in place: each row gains p_adjusted) and list the primary
    results."""
    families = correct_families(rows)
    alpha = study.analysis.alpha
    primary = [dict(r, significant=bool(math.isfinite(r["p_adjusted"]) and r["p_adjusted"] < alpha),
                    lower=("treatment" if r["mean_difference"] < 0 else "control"
                           if r["mean_difference"] > 0
                           else "neither"))
               for r in rows if r["family"] == "primary"]
    exploratory = [r for r in rows if r["family"] == "exploratory"]
    return {**study.analysis.as_dict(), "families": families, "primary_results": primary,
            "exploratory_below_alpha": sum(1 for r in exploratory if math.isfinite(r["p_adjusted"])
                                           and r["p_adjusted"] < alpha),
            "exploratory_raw_below_alpha": sum(1 for r in exploratory if math.isfinite(r["p_value"])
                                               and r["p_value"] < alpha)}


# ------------------------------------------------------------------------------- cost

def cost_summary(study: Study, epsilon: float, methods: Mapping[str, dict], runs: Runs,
                 n_train: int) -> dict:
    """What each method's evaluated runs cost, and what it cost them to reach the reference's
    utility.

    Per method and criterion (at the criterion's chosen point): R, the per-sample gradient
    evaluations of the whole run (:func:`~diff2_flwr.core.cost.gradient_evaluations`), and the
    curve of the seed-mean of the running minimum against rounds and evaluations. With a reference
    method (the study's ``reference``, else its first diff2 method with GD and no local routine),
    the first evaluated round at which that curve is within ``TARGET_SLACK`` of the reference's
    mean minimum, and the evaluations spent by then ("rounds/evaluations to the reference's
    utility").
    """
    reference = study.reference or next((m.name for m in study.methods
                                         if m.method == "diff2" and m.routine == "gd"
                                         and not m.local and m.rounds is None), None)
    # the running minimum of a test metric is the test-set oracle: the corrected protocol costs
    # the training criteria
    criteria = CRITERIA if not study.analysis.corrected else SELECTING
    out: dict[str, Any] = {"reference": reference, "target_slack": TARGET_SLACK,
                           "n_train": n_train, "methods": {}}
    for m in study.methods:
        per = {c: _cost_curve(study, m, epsilon, methods[m.name]["criteria"][c], c, runs, n_train)
               for c in criteria}
        out["methods"][m.name] = {"rounds": study.rounds_of(m), "criteria": per}
    if reference is not None:
        for c in criteria:
            _to_target(out["methods"], methods[reference]["criteria"][c]["min_mean"]
                       * (1 + TARGET_SLACK), c)
    return out


def _cost_curve(study: Study, m: MethodSpec, epsilon: float, info: Mapping[str, Any], c: str,
                runs: Runs, n_train: int) -> dict[str, Any]:
    """The seed-mean running minimum of ``c`` at the pick, against rounds and gradient
    evaluations."""
    cfg = study.experiment(m, info["point"], epsilon, study.eval_seeds[0])
    rounds, values = aligned_metric([runs[rid] for rid in info["run_ids"]], c)
    # a run that diverged keeps its best from before
    running = np.minimum.accumulate(values, axis=1)
    finite = np.all(np.isfinite(running[:, -1]))
    curve = np.mean(running, axis=0) if finite else np.full(len(rounds), math.inf)
    return {"rounds": rounds.tolist(), "gradient_evaluations": gradient_evaluations(
                rounds=int(rounds[-1]), restart_every=cfg.restart_every, n=n_train,
                local_steps=cfg.local.steps if cfg.local.enabled else 1,
                local_batch=cfg.local.batch_size if cfg.local.enabled else 0, at=rounds).tolist(),
            "running_min_mean": curve.tolist(),
            # each local phase is one more exchange, with one client
            "local_exchanges": int(rounds[-1]) if cfg.local.enabled else 0}


def _to_target(methods: Mapping[str, dict], target: float, c: str) -> None:
    """Mark on each method's curve of ``c`` the first round (and evaluations) at or below
    ``target``."""
    for entry in methods.values():
        curve = entry["criteria"][c]
        hit = next((i for i, v in enumerate(curve["running_min_mean"]) if v <= target), None)
        curve["target"] = target if math.isfinite(target) else None
        curve["round_to_target"] = None if hit is None else curve["rounds"][hit]
        curve["evaluations_to_target"] = None if hit is None else curve["gradient_evaluations"][hit]
