"""A study's analysis plan (issue 20): declared primary endpoints with Holm, exploratory BH, test
metrics at the train-loss-best round, three tuning seeds, symmetric grids, grid extension, families
across studies."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml

from diff2_flwr.cli import main
from diff2_flwr.lab.study.stats import endpoint_value, train_best_round
from diff2_flwr.lab.study.family import FamilyError, run_family
from diff2_flwr.lab.study.inference import benjamini_hochberg, holm, paired_ttest
from diff2_flwr.lab.study.runner import StudyError, parse_study, run_study

PRIMARY = [{"criterion": "grad_norm_sq", "at": "final", "scale": "log", "alternative": "two-sided"},
           {"criterion": "train_loss", "at": "best", "alternative": "two-sided"}]


def study(**changes) -> dict:
    """A small corrected-protocol study on synthetic data: DP-GD against DIFF2-GD, one point each
    (no extension)."""
    data = {"name": "plan", "dataset": {"name": "synthetic", "num_samples": 800}, "clients": 2,
            "rounds": 12,
            "delta": 1e-5, "epsilons": [3.0], "eval_every": 3,
            "seeds": {"tune": [100, 101, 102], "evaluate": [1, 2, 3, 4]},
            "analysis": {"primary": PRIMARY},
            "methods": [{"name": "DP-GD", "method": "dpgd", "grid": {"learning_rate": [0.3],
                                                                     "clip_restart": [1.0]}},
                        {"name": "DIFF2-GD", "method": "diff2",
                         "grid": {"restart_every": [4], "learning_rate": [0.3],
                                  "clip_restart": [1.0],
                                  "clip_diff": [3.0]}}]}
    data.update(changes)
    return data


# ------------------------------------------------------------------------------------------ the
# statistics

def test_holm_and_bh_against_the_definitions_and_scipy():
    from scipy import stats

    rng = np.random.default_rng(3)
    for _ in range(50):
        p = rng.uniform(0, 1, int(rng.integers(1, 12))) ** 2
        assert np.allclose(benjamini_hochberg(p), stats.false_discovery_control(p))
        m, order = len(p), np.argsort(p)
        expected = np.maximum.accumulate([min(1.0, (m - i) * p[j]) for i, j in enumerate(order)])
        assert np.allclose(np.asarray(holm(p))[order], expected)
    adjusted = holm([0.01, math.nan, 0.02])  # a NaN test still counts in m
    assert adjusted[0] == pytest.approx(0.03) and math.isnan(adjusted[1]) and adjusted[
        2] == pytest.approx(0.04)


def test_paired_t_test_alternatives():
    from scipy import stats

    a, b = [1.0, 2.0, 3.5, 4.0], [1.5, 2.5, 3.0, 5.0]
    for alt in ("less", "greater", "two-sided"):
        assert paired_ttest(a, b,
                            alt) == pytest.approx(stats.ttest_rel(a, b, alternative=alt).pvalue,
                                                  rel=1e-12)
    assert paired_ttest([1, 2], [2, 3], "two-sided") == 0.0 and paired_ttest([1, 2], [2, 3],
                                                                             "greater") == 1.0
    assert math.isnan(paired_ttest([1, math.inf], [1, 2]))


def test_endpoints_read_the_round_the_rule_names():
    run = {"train_loss": [4.0, 2.0, 1.0, 1.5], "test_loss": [5.0, 0.5, 3.0, 2.0],
           "grad_norm_sq": [9.0, 1.0, 0.1, 0.01], "test_accuracy": [0.1, 0.9, 0.7, 0.6]}
    assert train_best_round(run) == 2
    # not the test loss's own minimum 0.5
    assert endpoint_value(run, "test_loss", "train_best") == 3.0
    assert endpoint_value(run, "test_loss", "best") == 0.5  # the paper's (optimistic) rule
    assert endpoint_value(run, "test_accuracy",
                          "train_best") == 0.7 and endpoint_value(run, "test_accuracy",
                                                                  "best") == 0.9
    assert endpoint_value(run, "grad_norm_sq", "final", "log") == pytest.approx(math.log(0.01))
    diverged = {"train_loss": [4.0, None], "test_loss": [5.0, None]}
    assert endpoint_value(diverged, "test_loss",
                          "train_best") == 5.0 and endpoint_value(diverged, "test_loss",
                                                                  "final") == math.inf


# ------------------------------------------------------------------------------------------ the
# plan is validated

@pytest.mark.parametrize("change, match", [
    ({"seeds": {"tune": [100], "evaluate": [1, 2]}},
     r"seeds\.tune.*at least 3 tuning seeds.*protocol: paper"),
    ({"seeds": {"tune": [100, 101, 102], "evaluate": [1]}},
     r"seeds\.evaluate.*at least 2 evaluation seeds.*paired t-tests.*Found \[1\]"),
    ({"analysis": {"primary": [{"criterion": "test_loss", "at": "best"}]}},
     r"analysis\.primary\[0\]\.at.*'train_best' or 'final' for a test metric"),
    ({"analysis": {"primary": [{"criterion": "train_loss", "alternative": "smaller"}]}},
     r"analysis\.primary\[0\]\.alternative"),
    ({"analysis": {"primary": PRIMARY + [PRIMARY[0]]}},
     r"analysis\.primary\[2\].*each \(criterion, at\) once"),
    ({"analysis": {"protocol": "optimistic"}}, r"analysis\.protocol"),
    ({"analysis": {"extend": {"learning_rate": [1.0, 0.1]}}}, r"analysis\.extend\.learning_rate"),
    ({"analysis": {"primary": PRIMARY, "oracle": True}}, r"`analysis`"),
])
def test_a_bad_analysis_plan_is_refused_by_key(change, match):
    with pytest.raises(StudyError, match=match):
        parse_study(study(**change), "plan.yaml")


def test_symmetric_grids_are_required_of_compared_methods_under_the_corrected_protocol():
    data = study()
    # DP-GD tunes C1, DIFF2-GD holds it fixed
    data["methods"][0]["grid"]["clip_restart"] = [0.5, 1.0, 2.0]
    with pytest.raises(StudyError,
                       match=r"`methods`.*symmetric grids.*tune `clip_restart`.*'DIFF2-GD': "
                             r"\[1\.0\]"):
        parse_study(data, "asym.yaml")
    data["analysis"] = {"protocol": "paper"}  # the paper's own grids stay available by name
    assert parse_study(data, "asym.yaml").analysis.protocol == "paper"
    data["analysis"], data["methods"][1]["grid"]["clip_restart"] = {"primary": PRIMARY}, [0.5, 1.0,
                                                                                          4.0]
    # the same size: symmetric (the values may differ)
    assert parse_study(data, "sym.yaml").analysis.corrected


# ------------------------------------------------------------------------------------------ reports

@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan")
    s = parse_study(study(), "plan.yaml")
    return s, run_study(s, output_root=out, show_progress=False, make_plots=False), out / "plan"


def test_declared_primary_endpoints_get_holm_adjusted_p_in_summary_and_report(planned):
    s, summary, root = planned
    on_disk = json.loads((root / "summary.json").read_text())
    inference = on_disk["inference"]
    assert inference["protocol"] == "corrected" and inference["primary"] == [
        {"criterion": "grad_norm_sq", "at": "final", "scale": "log", "alternative": "two-sided"},
        {"criterion": "train_loss", "at": "best", "scale": "linear", "alternative": "two-sided"}]
    rows = inference["primary_results"]
    assert [(r["criterion"], r["at"]) for r in rows] == [("train_loss", "best"), ("grad_norm_sq",
                                                                                  "final")]
    assert [r["p_adjusted"] for r in rows] == pytest.approx(holm([r["p_value"] for r in rows]),
                                                            rel=1e-12)
    # the raw p is the two-sided paired t-test of the declared endpoint (log final ‖∇f‖²) by
    # evaluation seed
    eps = on_disk["epsilons"]["3.0"]
    per = {}
    for m in ("DIFF2-GD", "DP-GD"):
        runs = [json.loads((root / "runs" / f"{rid}.json").read_text())
                for rid in eps["methods"][m]["criteria"]["grad_norm_sq"]["run_ids"]]
        per[m] = [math.log(r["grad_norm_sq"][-1]) for r in runs]
    assert rows[1]["p_value"] == pytest.approx(paired_ttest(per["DIFF2-GD"], per["DP-GD"],
                                                            "two-sided"), rel=1e-12)
    assert rows[1]["mean_difference"] == pytest.approx(np.mean(np.subtract(per["DIFF2-GD"], per[
        "DP-GD"])), rel=1e-12)
    # every other test is exploratory, with BH q over its family
    explo = [r for t in eps["tests"]["DIFF2-GD vs DP-GD"].values() for r in t["rows"].values()
             if r["family"] == "exploratory"]
    assert len(explo) == inference["families"]["exploratory"]["size"] > 0
    assert [r["p_adjusted"] for r in explo] == pytest.approx(benjamini_hochberg([r["p_value"]
                                                                                 for r in explo]))
    report = (root / "report.md").read_text()
    assert "**Primary endpoints** (declared in the study file; Holm over 2 tests" in report
    for r in rows:
        assert f"| {r['p_value']:.3g} | {r['p_adjusted']:.3g} |" in report


def test_test_metrics_come_from_the_train_selected_round_not_their_own_minimum(planned, tmp_path):
    """Rewrite the evaluation runs' test losses so that their minimum lies elsewhere than the
    train-loss-best round: the corrected report takes the train-best round's value, the paper's
    protocol the minimum."""
    s, _, root = planned
    import shutil

    for protocol in ("corrected", "paper"):
        out = tmp_path / protocol
        shutil.copytree(root.parent, out)
        expected = []
        info = json.loads((out / "plan" / "summary.json").read_text())["epsilons"]["3.0"][
            "methods"]["DP-GD"]
        for i, rid in enumerate(info["criteria"]["test_loss"]["run_ids"]):
            path = out / "plan" / "runs" / f"{rid}.json"
            run = json.loads(path.read_text())
            k = train_best_round(run)
            run["test_loss"] = [0.001 * (i + 1) if t != k else 10.0 + i
                                for t in range(len(run["rounds"]))]
            path.write_text(json.dumps(run))
            expected.append((10.0 + i) if protocol == "corrected" else 0.001 * (i + 1))
        data = study(analysis={"primary": PRIMARY} if protocol == "corrected"
                     else {"protocol": "paper"})
        again = run_study(parse_study(data, "plan.yaml"), output_root=out, show_progress=False,
                          make_plots=False)
        test_loss = again["epsilons"]["3.0"]["methods"]["DP-GD"]["criteria"]["test_loss"]
        assert test_loss["reported"]["per_seed"] == pytest.approx(expected)
        assert test_loss["reported"]["at"] == ("train_best" if protocol == "corrected" else "best")
        assert ("min_mean" in test_loss) == (protocol == "paper")


def test_a_pure_noise_study_reports_no_significant_adjusted_result(tmp_path):
    """An A/A study: two identical DP-GD methods, the second on independent seeds (seed_offset), 20
    evaluation seeds. Every difference is noise; no primary result may be significant after Holm,
    and no exploratory one after BH."""
    arm = {"method": "dpgd", "grid": {"learning_rate": [0.3], "clip_restart": [1.0]}}
    data = study(seeds={"tune": [100, 101, 102], "evaluate": list(range(1, 21))}, rounds=9,
                 tests=[{"treatment": "B", "control": "A"}],
                 analysis={"primary": PRIMARY + [{"criterion": "test_loss", "at": "train_best"}]},
                 methods=[{"name": "A", **arm}, {"name": "B", "seed_offset": 1000, **arm}])
    summary = run_study(parse_study(data, "aa.yaml"), output_root=tmp_path, show_progress=False,
                        make_plots=False)
    inference = summary["inference"]
    assert len(inference["primary_results"]) == 3
    assert not any(r["significant"] for r in inference["primary_results"])
    assert inference["exploratory_below_alpha"] == 0
    rows = [r for t in summary["epsilons"]["3.0"]["tests"]["B vs A"].values()
            for r in t["rows"].values()]
    assert all(r["p_adjusted"] >= 0.05 for r in rows)
    # real noise between the arms, not identical runs (p = 1)
    assert all(0 < r["p_value"] < 1 for r in rows)
    a, b = (summary["epsilons"]["3.0"]["methods"][m]["criteria"]["train_loss"]["run_ids"]
            for m in ("A", "B"))
    assert not set(a) & set(b)


def test_a_pick_on_a_grid_edge_extends_the_grid_until_interior_or_the_bound(tmp_path):
    """DP-GD's learning-rate grid far below its optimum: each pick is the top edge, the axis grows
    an octave at a time up to the bound in analysis.extend, and the report says the pick stays on
    the edge and why."""
    data = study(methods=[{"name": "DP-GD", "method": "dpgd",
                           "grid": {"learning_rate": [0.001, 0.002], "clip_restart": [1.0]}}],
                 tests=[], analysis={"extend": {"learning_rate": [0.001, 0.01]}})
    summary = run_study(parse_study(data, "edge.yaml"), output_root=tmp_path, show_progress=False,
                        make_plots=False)
    entry = summary["epsilons"]["3.0"]["methods"]["DP-GD"]
    assert entry["grid"]["learning_rate"] == [0.001, 0.002]  # as declared
    assert entry["grid_searched"]["learning_rate"] == pytest.approx([0.001, 0.002, 0.004, 0.008])
    assert [x["value"] for x in entry["extensions"]] == pytest.approx([0.004, 0.008])
    assert entry["criteria"]["train_loss"]["point"]["learning_rate"] == pytest.approx(0.008)
    edge = entry["edges"]["train_loss"][0]
    assert edge["key"] == "learning_rate" and edge[
        "side"] == "high" and "bound 0.01 of analysis.extend" in edge["why"]
    runs = list((tmp_path / "plan" / "runs").glob("tune-*.json"))
    assert len(runs) == 4 * 3  # every point of the grown axis on every tuning seed, each once
    report = (tmp_path / "plan" / "report.md").read_text()
    assert "Picks still on a grid edge" in report


def test_the_paper_protocol_extends_nothing_and_says_so(tmp_path):
    data = study(methods=[{"name": "DP-GD", "method": "dpgd",
                           "grid": {"learning_rate": [0.001, 0.002], "clip_restart": [1.0]}}],
                 tests=[], seeds={"tune": [100], "evaluate": [1, 2]},
                 analysis={"protocol": "paper"})
    summary = run_study(parse_study(data, "p.yaml"), output_root=tmp_path, show_progress=False,
                        make_plots=False)
    entry = summary["epsilons"]["3.0"]["methods"]["DP-GD"]
    assert entry["grid_searched"] == entry["grid"] and entry["extensions"] == []
    assert "paper's protocol extends nothing" in entry["edges"]["train_loss"][0]["why"]
    assert summary["inference"]["protocol"] == "paper" and "optimistic" in summary["inference"][
        "label"]


# ------------------------------------------------------------------------------------------
# families, the CLI

def test_a_family_holm_corrects_the_primary_tests_of_several_studies(tmp_path, capsys):
    files = []
    for name, eps in (("one", [3.0]), ("two", [3.0, 8.0])):
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(study(name=name, epsilons=eps,
                                             output={"dir": str(tmp_path / "out")})))
        files.append(path.name)
        assert main(["experiment", str(path)]) == 0
        printed = json.loads(capsys.readouterr().out)  # one JSON object on stdout
        assert printed["study"] == name and len(printed["primary_results"]) == 2 * len(eps)
    family = tmp_path / "family.yaml"
    family.write_text(yaml.safe_dump({"name": "fam", "studies": files, "alpha": 0.05}))
    assert main(["family", str(family)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["size"] == 6 and result["adjustment"] == "holm"
    raw = [r["p_value"] for r in result["results"]]
    assert [r["p_adjusted"] for r in result["results"]] == pytest.approx(holm(raw), rel=1e-12)
    # a larger family
    assert all(r["p_adjusted"] >= r["p_study_adjusted"] - 1e-15 for r in result["results"])
    assert (tmp_path / "out" / "fam" / "family.json").is_file()
    md = (tmp_path / "out" / "fam" / "family.md").read_text()
    assert "Holm over the 6 primary tests of 2 studies" in md
    # each ratio with its 95 % interval, and each study's tuning budgets per ε
    on_disk = json.loads((tmp_path / "out" / "fam" / "family.json").read_text())
    assert all({"ci95_difference", "ratio", "ci95_ratio"} <= set(r) for r in on_disk["results"])
    assert "| ratio [95 % CI] | p | Holm p (study) | Holm p (family) |" in md
    assert sorted(on_disk["studies"][1]["budgets"]) == ["3.0", "8.0"]
    assert "**two, ε = 8.** Tuning budgets" in md


def test_a_family_names_the_study_that_has_not_run(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(study(output={"dir": str(tmp_path / "out")})))
    family = tmp_path / "f.yaml"
    family.write_text(yaml.safe_dump({"studies": ["s.yaml"]}))
    with pytest.raises(FamilyError,
                       match=r"s\.yaml: no results at .*summary\.json\. Run it first: diff2 "
                             r"experiment"):
        run_family(family)


def test_the_confirmation_study_is_pre_registered_as_the_issue_asks():
    from diff2_flwr.lab.study.runner import load_study

    root = Path(__file__).resolve().parents[1] / "configs" / "confirm"
    family = yaml.safe_load((root / "family.yaml").read_text())
    studies = [load_study(root / f) for f in family["studies"]]
    assert {s.dataset["name"] for s in studies} == {"california_housing", "gas_turbine"}
    for s in studies:
        assert s.epsilons == (3.0, 8.0) and len(s.tune_seeds) == 3 and len(s.eval_seeds) == 20
        assert not set(s.tune_seeds) & set(
            s.eval_seeds) and s.rounds == 2000 and s.engine == "batch"
        assert s.analysis.corrected and [(e.criterion, e.at,
                                          e.scale) for e in s.analysis.primary] == [
            ("grad_norm_sq", "final", "log"), ("train_loss", "best", "linear")]
        dpgd, diff2 = s.methods
        assert (dpgd.method,
                diff2.method) == ("dpgd", "diff2") and len(dict(diff2.grid)["restart_every"]) > 1
        for key in ("learning_rate", "clip_restart"):  # symmetric: the same grid for both
            assert dict(dpgd.grid)[key] == dict(diff2.grid)[key]
