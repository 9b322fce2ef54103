"""Confidence intervals for every ratio, and equal tuning budgets (issue 42, item 3): every paired
test carries the 95 % t-interval of its mean difference and a ratio treatment/control with its
interval; ``analysis.budgets: equal`` asks both methods of a tested pair to tune as many grid
configurations, and every summary records what each method tuned."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import yaml

from diff2_flwr.lab.study.analysis import budget_summary
from diff2_flwr.lab.study.family import markdown
from diff2_flwr.lab.study.inference import paired_ttest
from diff2_flwr.lab.study.intervals import (difference_interval, fieller_interval,
                                            paired_intervals)
from diff2_flwr.lab.study.report import format_table
from diff2_flwr.lab.study.runner import run_study
from diff2_flwr.lab.study.spec import StudyError, parse_study

SMOKE = Path(__file__).resolve().parents[1] / "configs" / "smoke.yaml"
T = [1.0, 2.0, 3.5, 4.0, 2.5]
C = [1.5, 2.5, 3.0, 5.0, 3.5]


# ------------------------------------------------------------------------------------ intervals

def test_the_difference_interval_is_the_paired_t_interval_by_hand():
    from scipy import stats

    d = np.subtract(T, C)  # -0.5, -0.5, 0.5, -1.0, -1.0
    n, mean, sd = 5, -0.5, math.sqrt(np.sum((d + 0.5) ** 2) / 4)
    half = stats.t.ppf(0.975, n - 1) * sd / math.sqrt(n)  # t_{0.975, 4} = 2.776…
    assert d.mean() == pytest.approx(mean) and sd == pytest.approx(math.sqrt(0.375))
    assert difference_interval(T, C) == pytest.approx((mean - half, mean + half), rel=1e-12)
    assert difference_interval(T, C) == pytest.approx(
        tuple(stats.ttest_rel(T, C).confidence_interval(0.95)), rel=1e-12)
    # 95 % whatever the test's α: a 90 % interval is narrower
    lo, hi = difference_interval(T, C, level=0.90)
    assert hi - lo == pytest.approx(2 * stats.t.ppf(0.95, 4) * sd / math.sqrt(5), rel=1e-12)
    assert difference_interval([1.0, 2.0, 3.0], [2.0, 3.0, 4.0]) == (-1.0, -1.0)  # no spread
    with pytest.raises(ValueError, match=r"equal size >= 2\. Found 1 and 1"):
        difference_interval([1.0], [2.0])


def test_a_log_scale_ratio_is_the_geometric_mean_ratio_and_its_interval_exp_of_the_difference():
    lt, lc = np.log(T), np.log(C)
    out = paired_intervals(lt, lc, "log")
    lo, hi = difference_interval(lt, lc)
    assert out["ci95_difference"] == pytest.approx([lo, hi], rel=1e-12)
    assert out["ci95_ratio"] == pytest.approx([math.exp(lo), math.exp(hi)], rel=1e-12)
    geometric = math.exp(np.mean(lt)) / math.exp(np.mean(lc))
    assert out["ratio"] == pytest.approx(geometric, rel=1e-12)
    assert out["ratio_kind"] == "geometric-mean ratio" and out["ci95_note"] is None
    # the ratio interval excludes 1 exactly when the two-sided p is below 0.05
    assert (out["ci95_ratio"][1] < 1) == (paired_ttest(lt, lc, "two-sided") < 0.05)


def test_a_linear_ratio_is_the_ratio_of_means_with_fiellers_interval():
    """Fieller's interval is the set of ρ the paired t-test of tᵢ − ρcᵢ against 0 keeps at 5 %: at
    its ends that test's two-sided p is 0.05, inside it is larger, outside smaller."""
    from scipy import stats

    out = paired_intervals(T, C)
    assert out["ratio"] == pytest.approx(np.mean(T) / np.mean(C), rel=1e-12)
    assert out["ratio_kind"] == "ratio of means" and out["ci95_ratio_method"] == "Fieller (paired)"
    lo, hi = out["ci95_ratio"]
    assert lo < out["ratio"] < hi

    def p(rho: float) -> float:
        return stats.ttest_1samp(np.asarray(T) - rho * np.asarray(C), 0.0).pvalue

    assert p(lo) == pytest.approx(0.05, rel=1e-9) and p(hi) == pytest.approx(0.05, rel=1e-9)
    assert p(out["ratio"]) > 0.05 and p(lo - 0.01) < 0.05 and p(hi + 0.01) < 0.05
    # wrong: the difference's interval over the control's mean ignores the control's own noise
    naive = 1 + np.asarray(difference_interval(T, C)) / np.mean(C)
    assert not np.allclose(naive, [lo, hi], rtol=1e-3)


def test_fiellers_interval_is_refused_when_the_controls_mean_may_be_zero():
    (ratio, why) = fieller_interval([1.0, 2.0, 1.5], [0.1, -0.2, 0.15])
    assert ratio is None and "unbounded" in why and "not distinguishable from 0" in why
    out = paired_intervals([1.0, 2.0, 1.5], [0.1, -0.2, 0.15])
    assert out["ratio"] == pytest.approx(4.5 / 0.05) and out["ci95_ratio"] is None
    assert out["ci95_difference"] is not None and "unbounded" in out["ci95_note"]


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_a_diverged_run_gives_no_interval_and_says_why(bad):
    """inf (a diverged loss), −inf (the log of 0), NaN (a missing accuracy): no p, no interval, no
    ratio, and the note counts the pairs; the report shows – ."""
    for scale in ("linear", "log"):
        out = paired_intervals([1.0, bad, 3.0], [1.0, 2.0, 2.5], scale)
        assert out["ci95_difference"] is None and out["ratio"] is None
        assert out["ci95_ratio"] is None
        assert out["ci95_note"].startswith("1 of 3 paired differences not finite")
    assert math.isnan(paired_ttest([1.0, bad, 3.0], [1.0, 2.0, 2.5], "two-sided"))
    row = {"criterion": "train_loss", "at": "best", "scale": "linear", "family": "exploratory",
           "alternative": "two-sided", "p_value": math.nan, "p_adjusted": math.nan,
           "adjustment": "bh", "df": 2, "mean_difference": math.inf, **out}
    tests = {"B vs A": {"train_loss": {"rows": {"best": row}}}}
    assert ("| B vs A | train loss, best over rounds | exploratory | two-sided | diverged | – | – |"
            in format_table({"methods": {}, "tests": tests}))


def test_the_family_table_shows_each_ratio_and_its_interval_beside_the_three_ps():
    row = {"study": "s", "epsilon": 3.0, "pair": "DIFF2-GD vs DP-GD", "treatment": "DIFF2-GD",
           "control": "DP-GD", "criterion": "grad_norm_sq", "at": "final", "scale": "log",
           "alternative": "two-sided", "mean_difference": -1.2, "p_value": 0.001,
           "p_study_adjusted": 0.002, "p_adjusted": 0.008, "significant": True,
           "lower": "treatment", **paired_intervals(np.log(T), np.log(C), "log")}
    row["mean_difference"] = float(np.mean(np.log(T) - np.log(C)))
    old = {k: v for k, v in row.items() if not k.startswith(("ci95", "ratio"))}  # an older summary
    budgets = budget_summary(
        SimpleNamespace(tune_seeds=(100, 101, 102), analysis=SimpleNamespace(budgets="equal"),
                        methods=[SimpleNamespace(name="DP-GD", points=lambda: [{}] * 24)]),
        {"DP-GD": {"points": 24}})
    text = markdown({"family": "f", "alpha": 0.05, "size": 2,
                     "results": [row, dict(old, study="t")],
                     "studies": [{"study": "s", "budgets": {"3.0": budgets}}, {"study": "t"}]})
    assert ("| mean difference (treatment − control) [95 % CI] | ratio [95 % CI] | p | Holm p "
            "(study) | Holm p (family) | result |") in text
    d, r = row["ci95_difference"], row["ci95_ratio"]
    # the ratio with four significant digits (1.004 is not 1), the difference with three
    assert (f"| {row['mean_difference']:.3g} [{d[0]:.3g}, {d[1]:.3g}] | {row['ratio']:.4g} "
            f"[{r[0]:.4g}, {r[1]:.4g}] | 0.001 | 0.002 | 0.008 | significant: DIFF2-GD lower |"
            ) in text
    assert f"| {row['mean_difference']:.3g} | – | 0.001 |" in text  # no interval recorded: –
    assert "**s, ε = 3.** Tuning budgets (`analysis.budgets`: equal" in text
    assert "| DP-GD | 24 | 24 | 72 |" in text


# ------------------------------------------------------------------------------------ budgets

def _smoke(*methods: dict, **analysis) -> dict:
    data = yaml.safe_load(SMOKE.read_text())
    data.update(methods=list(methods), tests=[{"treatment": "DIFF2-GD", "control": "DP-GD"}],
                analysis=analysis)
    return data


#: 2 × 2 × 2 × 3 = 24 points
DIFF2 = {"name": "DIFF2-GD", "method": "diff2",
         "grid": {"restart_every": [4, 8], "clip_restart": [0.5, 1.0], "clip_diff": [1.0, 3.0],
                  "learning_rate": [0.1, 0.2, 0.4]}}
#: 2 × 3 × 4 schedules = 24 points (`every` applies to step and inverse_sqrt)
DPGD = {"name": "DP-GD", "method": "dpgd", "every": 4,
        "grid": {"clip_restart": [0.5, 1.0], "learning_rate": [0.1, 0.2, 0.4],
                 "schedule": ["constant", "cosine", "step", "inverse_sqrt"]}}


def test_equal_budgets_accept_equal_counts_with_the_schedule_as_one_methods_own_axis():
    study = parse_study(_smoke(DIFF2, DPGD, budgets="equal"), "s.yaml")
    assert [len(m.points()) for m in study.methods] == [24, 24]
    assert study.analysis.budgets == "equal" and study.analysis.extend == ()  # nothing extended
    # without the rule, the corrected protocol asks both to tune the schedule alike
    with pytest.raises(StudyError, match=r"symmetric grids.*both tune `schedule`"):
        parse_study(_smoke(DIFF2, DPGD), "s.yaml")
    assert parse_study(_smoke(DIFF2, DPGD, protocol="paper", budgets="equal"),
                       "s.yaml").analysis.budgets == "equal"


def test_equal_budgets_count_points_after_schedule_parameters_merge_and_refuse_24_vs_23():
    shared = {"learning_rate": [0.2], "clip_restart": [1.0]}
    diff2 = {**DIFF2, "grid": {**shared, "restart_every": [2, 4, 8, 16],
                               "clip_diff": [0.5, 1.0, 2.0, 3.0, 4.0, 6.0]}}  # 4 × 6 = 24
    # constant + 10 cosine floors + 11 step decays + inverse_sqrt = 23 (the product: 440)
    dpgd = {**DPGD, "grid": {**shared, "schedule": ["constant", "cosine", "step", "inverse_sqrt"],
                             "floor": [i / 20 for i in range(10)],
                             "decay": [0.1 + i / 20 for i in range(11)]}}
    with pytest.raises(StudyError, match=r"s\.yaml: key `methods`: expected equal tuning budgets "
                       r"\(`analysis\.budgets: equal`\): 'DIFF2-GD' and 'DP-GD' are compared.* "
                       r"Found \{'DIFF2-GD': 24, 'DP-GD': 23\}\.") as err:
        parse_study(_smoke(diff2, dpgd, budgets="equal"), "s.yaml")
    assert "\n" not in str(err.value)
    dpgd["grid"]["decay"] = [0.1 + i / 20 for i in range(12)]  # 24
    study = parse_study(_smoke(diff2, dpgd, budgets="equal"), "s.yaml")
    assert len(study.methods[1].points()) == 24


@pytest.mark.parametrize("analysis, match", [
    ({"budgets": "equal", "extend": {"learning_rate": [0.05, 1.0]}},
     r"key `analysis\.extend`: expected no grid extension under `budgets: equal`.* Found "
     r"\{'learning_rate': \[0\.05, 1\.0\]\}\."),
    ({"budgets": "same"}, r"key `analysis\.budgets`: expected 'unconstrained' \(the default\) or "
                          r"'equal'"),
])
def test_equal_budgets_refuse_an_extension_and_a_bad_value_in_one_line(analysis, match):
    with pytest.raises(StudyError, match=match) as err:
        parse_study(_smoke(DIFF2, DPGD, **analysis), "s.yaml")
    assert "\n" not in str(err.value)
    # `extend: false` says the same as its absence
    assert parse_study(_smoke(DIFF2, DPGD, budgets="equal", extend=False),
                       "s.yaml").analysis.extend == ()


def test_equal_budgets_still_ask_the_shared_hyper_parameters_for_grids_of_one_size():
    # 2 η × 2 C₁ × (constant + 3 cosine floors + step + inverse_sqrt) = 24 against DIFF2's 24, but
    # DP-GD tunes 2 learning rates where DIFF2-GD tunes 3
    dpgd = {**DPGD, "grid": {"clip_restart": [0.5, 1.0], "learning_rate": [0.1, 0.2],
                             "schedule": ["constant", "cosine", "step", "inverse_sqrt"],
                             "floor": [0.0, 0.1, 0.2]}}
    with pytest.raises(StudyError, match=r"symmetric grids.*both tune `learning_rate`"):
        parse_study(_smoke(DIFF2, dpgd, budgets="equal"), "s.yaml")


def test_the_budget_summary_counts_extended_configurations_and_tuning_runs():
    study = SimpleNamespace(tune_seeds=(100, 101, 102),
                            analysis=SimpleNamespace(budgets="unconstrained"),
                            methods=[SimpleNamespace(name="A", points=lambda: [{}] * 6)])
    assert budget_summary(study, {"A": {"points": 8}}) == {
        "rule": "unconstrained", "tune_seeds": 3,
        "methods": {"A": {"configurations_declared": 6, "configurations_tuned": 8,
                          "tuning_runs": 24}}}


@pytest.fixture(scope="module")
def equal_run(tmp_path_factory):
    """A small study under `budgets: equal`: DP-GD tunes η × schedule (2 × 2), DIFF2-GD η × T
    (2 × 2)."""
    out = tmp_path_factory.mktemp("equal")
    data = {"name": "equal", "dataset": {"name": "synthetic", "num_samples": 800}, "clients": 2,
            "rounds": 12, "delta": 1e-5, "epsilons": [3.0], "eval_every": 3,
            "seeds": {"tune": [100, 101, 102], "evaluate": [1, 2, 3, 4]},
            "analysis": {"budgets": "equal", "primary": [
                {"criterion": "grad_norm_sq", "at": "final", "scale": "log"},
                {"criterion": "train_loss", "at": "best"}]},
            "methods": [{"name": "DP-GD", "method": "dpgd",
                         "grid": {"learning_rate": [0.3, 0.6], "clip_restart": [1.0],
                                  "schedule": ["constant", "cosine"]}},
                        {"name": "DIFF2-GD", "method": "diff2",
                         "grid": {"restart_every": [3, 6], "learning_rate": [0.3, 0.6],
                                  "clip_restart": [1.0], "clip_diff": [3.0]}}]}
    study = parse_study(data, "equal.yaml")
    return run_study(study, output_root=out, show_progress=False, make_plots=False), out / "equal"


def test_a_study_records_each_methods_tuning_budget_and_the_report_prints_it(equal_run):
    _, root = equal_run
    summary = json.loads((root / "summary.json").read_text())
    budgets = summary["epsilons"]["3.0"]["budgets"]
    assert budgets == {"rule": "equal", "tune_seeds": 3, "methods": {
        m: {"configurations_declared": 4, "configurations_tuned": 4, "tuning_runs": 12}
        for m in ("DP-GD", "DIFF2-GD")}}
    assert summary["inference"]["budgets"] == "equal"
    assert len(list((root / "runs").glob("tune-*.json"))) == 24  # nothing extended
    report = (root / "report.md").read_text()
    assert "Tuning budgets (`analysis.budgets`: equal" in report
    assert "| DP-GD | 4 | 4 | 12 |" in report and "| DIFF2-GD | 4 | 4 | 12 |" in report


def test_every_test_of_a_study_carries_its_intervals_from_the_run_files(equal_run):
    _, root = equal_run
    summary = json.loads((root / "summary.json").read_text())
    eps = summary["epsilons"]["3.0"]
    primary = summary["inference"]["primary_results"]
    grad = next(r for r in primary if r["criterion"] == "grad_norm_sq")
    values = {}
    for m in ("DIFF2-GD", "DP-GD"):
        ids = eps["methods"][m]["criteria"]["grad_norm_sq"]["run_ids"]
        values[m] = [math.log(json.loads((root / "runs" / f"{i}.json").read_text())[
            "grad_norm_sq"][-1]) for i in ids]
    lo, hi = difference_interval(values["DIFF2-GD"], values["DP-GD"])
    assert grad["ci95_difference"] == pytest.approx([lo, hi], rel=1e-12)
    assert grad["ci95_ratio"] == pytest.approx([math.exp(lo), math.exp(hi)], rel=1e-12)
    rows = [r for t in eps["tests"]["DIFF2-GD vs DP-GD"].values() for r in t["rows"].values()]
    assert rows and all("ci95_difference" in r and "ratio" in r and "ci95_ratio" in r
                        for r in rows)  # exploratory too
    report = (root / "report.md").read_text()
    assert "| mean difference [95 % CI] | ratio [95 % CI] | p | Holm p | result |" in report
    lo, hi = grad["ci95_ratio"]
    assert f"{grad['ratio']:.3g} [{lo:.3g}, {hi:.3g}]" in report
