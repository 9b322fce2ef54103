"""Studies: the smoke study end to end, selection rules, the t-test, resumability, bad study
files."""

from __future__ import annotations

import itertools
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import yaml
from scipy import stats

from diff2_flwr.lab.study.runner import (
    CRITERIA,
    StudyError,
    load_study,
    paired_one_sided_ttest,
    parse_study,
    run_study,
    select,
)
from diff2_flwr.task.data import DataError

SMOKE = Path(__file__).resolve().parents[1] / "configs" / "smoke.yaml"


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("studies")
    study = load_study(SMOKE)
    summary = run_study(study, output_root=out, show_progress=False)
    return study, summary, out / study.name


def test_smoke_study_writes_runs_summary_report_and_plots(smoke_run):
    study, summary, root = smoke_run
    assert (root / "summary.json").is_file() and (root / "report.md").is_file() and (
        root / "figure_eps3.png").is_file()
    on_disk = json.loads((root / "summary.json").read_text())
    assert on_disk["study"] == "smoke" and on_disk["eval_seeds"] == [1, 2, 3]
    eps = on_disk["epsilons"]["3.0"]
    assert set(eps["methods"]) == {"GD", "DP-GD", "DIFF2-GD (T=4)"}
    for entry in eps["methods"].values():
        for c in ("train_loss", "grad_norm_sq"):
            info = entry["criteria"][c]
            assert {"point", "min_mean", "min_std", "final_mean", "final_std",
                    "run_ids"} <= set(info)
            assert len(info["run_ids"]) == 3 and info["min_mean"] <= info["final_mean"] + 1e-15
        # the test loss is reported at the train-loss-best point and round, never as its own minimum
        # over rounds
        test_loss = entry["criteria"]["test_loss"]
        assert test_loss["point"] == entry["criteria"]["train_loss"]["point"]
        assert {"train_best_mean", "final_mean"} <= set(test_loss) and "min_mean" not in test_loss
        assert test_loss["reported"]["at"] == "train_best"
    test = eps["tests"]["DIFF2-GD (T=4) vs DP-GD"]
    assert set(test) == set(CRITERIA) and all(0 <= r["p_value"] <= 1 and r["df"] == 2
                                              and 0 <= r["p_adjusted"] <= 1
                                              for t in test.values() for r in t["rows"].values())
    # the declared grid plus one point per extension (a line search along the edge key, never the
    # whole product)
    for entry in eps["methods"].values():
        assert entry["points_tuned"] == len(list(itertools.product(*entry["grid"].values()))) + len(
            entry["extensions"])
        for ext in entry["extensions"]:
            assert ext["point"][ext["key"]] == ext["value"] and ext["value"] in entry[
                "grid_searched"][ext["key"]]
    tuned = sum(e["points_tuned"] for e in eps["methods"].values()) * 3
    runs = list((root / "runs").glob("*.json"))
    assert len(runs) == tuned + len({rid for e in eps["methods"].values() for c in CRITERIA
                                     for rid in e["criteria"][c]["run_ids"]})
    record = json.loads(runs[0].read_text())
    assert record["rounds"] == list(range(0, 41, 5)) and len(record["train_loss"]) == 9
    report = (root / "report.md").read_text()
    row = "| DIFF2-GD (T=4) vs DP-GD | train loss, best over rounds | exploratory | two-sided |"
    assert row in report
    assert "z₁ / z₂" in report and "every test below is **exploratory**" in report


def test_summary_statistics_follow_from_the_run_files(smoke_run):
    _, summary, root = smoke_run
    info = summary["epsilons"]["3.0"]["methods"]["DP-GD"]["criteria"]["grad_norm_sq"]
    runs = [json.loads((root / "runs" / f"{rid}.json").read_text()) for rid in info["run_ids"]]
    mins = [min(r["grad_norm_sq"]) for r in runs]
    assert info["min_mean"] == pytest.approx(np.mean(mins), rel=1e-12)
    assert info["min_std"] == pytest.approx(np.std(mins, ddof=1), rel=1e-12)
    assert info["final_mean"] == pytest.approx(np.mean([r["grad_norm_sq"][-1] for r in runs]),
                                               rel=1e-12)


def test_rerun_resumes_without_computing(smoke_run, monkeypatch):
    study, summary, root = smoke_run

    def boom(*args, **kwargs):
        raise AssertionError("a finished run was computed again")

    monkeypatch.setattr("diff2_flwr.lab.sweep.run_batch", boom)
    again = run_study(study, output_root=root.parent, show_progress=False, make_plots=False)
    assert again["epsilons"] == json.loads(json.dumps(summary["epsilons"]))


ROUTINE_METHODS = [  # a routine fixed, and a grid over a routine parameter
    {"name": "DP-GD + momentum", "method": "dpgd", "routine": {"name": "momentum", "momentum": 0.5},
     "grid": {"learning_rate": [0.2], "clip_restart": [1.0]}},
    {"name": "DIFF2-Adam", "method": "diff2", "routine": "adam",
     "grid": {"restart_every": [4], "learning_rate": [0.02], "clip_diff": [3.0], "beta1": [0.5,
                                                                                           0.9]}},
]


def test_inprocess_engine_gives_the_same_study(tmp_path):
    """The batched engine and the reference driver agree on a small study, routines included."""
    data = yaml.safe_load(SMOKE.read_text())
    data.update(rounds=12, eval_every=4, seeds={"tune": [7], "evaluate": [1, 2]},
                analysis={"protocol": "paper"})
    data["methods"] = data["methods"][1:] + ROUTINE_METHODS
    a = run_study(parse_study({**data, "engine": "batch"}, "a.yaml"), output_root=tmp_path / "a",
                  show_progress=False, make_plots=False)
    b = run_study(parse_study({**data, "engine": "inprocess"}, "b.yaml"),
                  output_root=tmp_path / "b", show_progress=False, make_plots=False)
    for name, entry in a["epsilons"]["3.0"]["methods"].items():
        for c in CRITERIA:
            x, y = entry["criteria"][c], b["epsilons"]["3.0"]["methods"][name]["criteria"][c]
            assert x["point"] == y["point"]
            assert x["min_mean"] == pytest.approx(y["min_mean"], rel=1e-9)


def test_a_method_sets_a_routine_and_its_grid_ranges_over_the_routines_parameters(tmp_path):
    data = base_study(rounds=8, eval_every=4, seeds={"tune": [7], "evaluate": [1, 2]},
                      analysis={"protocol": "paper"},
                      methods=[data_method
                               for data_method in yaml.safe_load(SMOKE.read_text())["methods"][1:2]]
                      + ROUTINE_METHODS)
    study = parse_study(data, "r.yaml")
    adam = study.methods[2]
    assert (adam.routine, adam.routine_params, adam.points()[1]["beta1"]) == ("adam", (), 0.9)
    cfg = study.experiment(adam, adam.points()[1], 3.0, 7)
    assert cfg.training.routine.name == "adam" and cfg.training.routine.params() == {"beta1": 0.9}
    momentum = study.methods[1]
    assert study.experiment(momentum, momentum.points()[0], 3.0,
                            7).training.routine.params() == {"momentum": 0.5}
    summary = run_study(study, output_root=tmp_path, show_progress=False)
    methods = summary["epsilons"]["3.0"]["methods"]
    assert methods["DP-GD + momentum"]["routine"] == {"name": "momentum", "momentum": 0.5}
    assert methods["DIFF2-Adam"]["routine"] == {"name": "adam"} and "beta1" in methods[
        "DIFF2-Adam"]["criteria"][
        "train_loss"]["point"]
    assert methods["DP-GD"]["routine"] == {"name": "gd"}
    record = json.loads(next((tmp_path / "smoke" / "runs").glob(
        "tune-diff2-adam-*.json")).read_text())
    assert record["routine"]["name"] == "adam" and record["routine"]["beta1"] == record["point"][
        "beta1"]
    report = (tmp_path / "smoke" / "report.md").read_text()
    assert "| DP-GD + momentum | momentum(momentum=0.5) | train loss |" in report
    assert "| DIFF2-Adam | adam | train loss | " in report and "beta1=" in report
    assert "| DIFF2-Adam vs DP-GD | train loss, best over rounds |" in report


def test_a_plain_gd_methods_run_ids_are_unchanged_by_routines():
    """Run files of studies run before routines existed are reused (ids pinned from that
    version)."""
    from diff2_flwr.lab.study.plan import run_id as _run_id

    study = load_study(SMOKE)
    diff2, gd = study.methods[2], study.methods[0]
    assert _run_id("tune", diff2, diff2.points()[0], 3.0, 100,
                   study) == "tune-diff2-gd--t-4-4666ced630cb"
    assert _run_id("eval", gd, gd.points()[1], 3.0, 1, study) == "eval-gd-74c13cf1ddc6"
    with_routine = parse_study(base_study(methods=[{**yaml.safe_load(SMOKE.read_text())["methods"][
        0],
                                                    "routine": "momentum"}]), "m.yaml").methods[0]
    assert _run_id("eval", with_routine, gd.points()[1], 3.0, 1, study) != "eval-gd-74c13cf1ddc6"


def _classification_study(tmp_path, engine: str, out: str | None = None, **changes) -> dict:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((500, 4))
    label = np.where(x[:, 0] - x[:, 1] + 0.5 * rng.standard_normal(500) > 0, "pos", "neg")
    path = tmp_path / "two_classes.csv"
    path.write_text("a,b,c,d,y\n" + "".join(",".join(f"{v:.5f}" for v in r) + f",{t}\n" for r,
                                            t in zip(x, label)))
    data = yaml.safe_load(SMOKE.read_text())
    data.update(name="cls", rounds=12, eval_every=4, seeds={"tune": [7], "evaluate": [1, 2]},
                analysis={"protocol": "paper"}, engine=engine,
                dataset={"name": "csv", "path": str(path), "target": "y", "task": "classification"},
                model={"name": "diff2_flwr.task.models:TanhMLP", "kwargs": {"hidden": 5}},
                **changes)
    data["methods"] = [{"name": "DP-GD", "method": "dpgd", "grid": {"learning_rate": [0.5, 1.0]}},
                       {"name": "DIFF2-GD (T=4)", "method": "diff2",
                        "grid": {"restart_every": [4], "learning_rate": [0.5, 1.0],
                                 "clip_diff": [3.0]}}]
    return run_study(parse_study(data, f"{engine}.yaml"), output_root=tmp_path / (out or engine),
                     show_progress=False, make_plots=False)


def test_a_classification_study_on_the_batch_engine_equals_the_inprocess_one(tmp_path):
    """Cross-entropy, a two-hidden-layer MLP: the batched engine runs it (no fallback) and agrees
    with the reference driver on every criterion and on the accuracy."""
    a = _classification_study(tmp_path, "batch")
    b = _classification_study(tmp_path, "inprocess")
    runs = list((tmp_path / "batch" / "cls" / "runs").glob("*.json"))
    assert runs and all(json.loads(r.read_text())["engine"] == "batch" for r in runs)
    for name, entry in a["epsilons"]["3.0"]["methods"].items():
        other = b["epsilons"]["3.0"]["methods"][name]
        for c in CRITERIA:
            assert entry["criteria"][c]["point"] == other["criteria"][c]["point"]
            assert entry["criteria"][c]["min_mean"] == pytest.approx(other["criteria"][c][
                "min_mean"], rel=1e-9)
        assert entry["accuracy"]["at"]["best"]["per_seed"] == other["accuracy"]["at"]["best"][
            "per_seed"]
        assert 0.5 < entry["accuracy"]["best_mean"] <= 1


def test_two_worker_processes_give_the_same_study(tmp_path):
    """workers: 2 runs the batches in two spawned processes (one thread each here): the same runs,
    the same summary up to the rounding of another thread count."""
    one = _classification_study(tmp_path, "batch", "one", batch_size=3)
    two = _classification_study(tmp_path, "batch", "two", batch_size=3, workers=2)
    assert two["workers"] == 2
    names = lambda out: sorted(p.name for p in (tmp_path / out / "cls" / "runs").glob(
        "*.json"))  # noqa: E731
    assert names("one") == names("two") and names("one")
    for name, entry in one["epsilons"]["3.0"]["methods"].items():
        for c in CRITERIA:
            x, y = entry["criteria"][c], two["epsilons"]["3.0"]["methods"][name]["criteria"][c]
            assert x["point"] == y["point"] and x["min_mean"] == pytest.approx(y["min_mean"],
                                                                               rel=1e-12)


def test_sampled_runs_share_batches_with_the_runs_that_share_their_cohorts(monkeypatch):
    """The sampling study's tuning runs: no batch mixes runs that sample with runs that do not (such
    a batch computes every client each round), and sampled runs are batched by sampling rule and
    seed (one cohort key), so that a round computes the union of few cohorts; the cost that orders
    the units counts a sampled batch's computed share."""
    from diff2_flwr.lab.study import plan as study_mod
    from diff2_flwr.lab.study.plan import GridSearch, plan_units, tune_jobs, unit_cost

    monkeypatch.setattr(study_mod, "batchable", lambda study, cfg: True)
    study = load_study(SMOKE.parent / "sampling" / "kddcup99_p1000.yaml")
    jobs = tune_jobs(study, GridSearch.start(study).tuned, 3.0)
    # the jobs come seed by seed within each grid point: batches in that order mix three seeds
    assert len({j.cfg.training.seed for j in jobs[:3]}) == 3
    units = plan_units(study, jobs)
    assert sorted(j.run_id for u in units for j in u.jobs) == sorted(j.run_id for j in jobs)

    def keys(unit):
        return {(j.cfg.training.sampling.rate, j.cfg.training.seed) for j in unit.jobs}

    sampled = [u for u in units if u.jobs[0].cfg.training.sampling.enabled]
    assert sampled and all(len({j.cfg.training.sampling.enabled for j in u.jobs}) == 1
                           for u in units)
    # DP-GD at q = 0.1 and 0.02: 6 points x 3 seeds each, in 6 batches of 6: one cohort key each
    dpgd = [u for u in sampled if u.jobs[0].cfg.restart_every == 1]
    assert [len(keys(u)) for u in dpgd] == [1] * 6
    assert all(len(keys(u)) <= 2 for u in sampled)
    full = [u for u in units if not u.jobs[0].cfg.training.sampling.enabled]
    per_run = {id(u): unit_cost(u) / len(u.jobs) for u in units}
    # a batch at q = 0.02 of one seed computes 2 % of its clients, plus every client each 25th round
    q02 = [u for u in dpgd if u.jobs[0].cfg.training.sampling.rate == 0.02]
    assert per_run[id(q02[0])] == pytest.approx(study.rounds * (1 / 25 + 24 / 25 * 0.02))
    assert max(per_run[id(u)] for u in sampled) < min(per_run[id(u)] for u in full)
    costs = [unit_cost(u) for u in units]
    assert costs == sorted(costs, reverse=True)


def test_units_are_balanced_shared_by_the_workers_and_largest_first(monkeypatch):
    from types import SimpleNamespace

    from diff2_flwr.lab.study import plan as study_mod
    from diff2_flwr.lab.study.plan import Job as _Job, plan_units

    monkeypatch.setattr(study_mod, "batchable", lambda study, cfg: True)
    # the stand-in configs set nothing else
    monkeypatch.setattr(study_mod, "batch_ignores", lambda cfg: [])

    def jobs(ts, routine="gd", local=False, distributed=False):
        return [_Job(f"{routine}{local}{distributed}{i}", None, {}, 3.0, i, SimpleNamespace(
            restart_every=t, training=SimpleNamespace(routine=SimpleNamespace(name=routine),
                                                      rounds=2000,
                                                      sampling=SimpleNamespace(enabled=False)),
            local=SimpleNamespace(enabled=local), privacy=SimpleNamespace(distributed=distributed)))
            for i, t in enumerate(ts)]

    def sizes(js, batch_size=24, workers=1):
        units = plan_units(SimpleNamespace(engine="batch", batch_size=batch_size, workers=workers),
                           js)
        # each job once
        assert sorted(j.run_id for u in units for j in u.jobs) == sorted(j.run_id for j in js)
        return [(u.engine, len(u.jobs)) for u in units]

    assert sizes(jobs([1] * 16 + [20] * 36)) == [("batch", 18), ("batch", 18), ("batch", 16)]
    assert sizes(jobs([1] * 16 + [20] * 36), workers=2) == [("batch", 18), ("batch", 18),
                                                            ("batch", 8), ("batch", 8)]
    assert sorted(n for _, n in sizes(jobs([1] * 5 + [6] * 50), workers=2)) == [2, 3, 11, 13, 13,
                                                                                13]
    assert sizes(jobs([6]), workers=2) == [("batch", 1)]
    units = plan_units(SimpleNamespace(engine="batch", batch_size=4, workers=2), jobs([1, 6] * 9))
    assert all(len({j.cfg.restart_every == 1 for j in u.jobs}) == 1 for u in units)
    # the local routine runs one by one on the per-run path, first (it is the costliest)
    mixed = sizes(jobs([20] * 4) + jobs([20, 20], local=True), workers=2)
    assert mixed == [("inprocess", 1), ("inprocess", 1), ("batch", 2), ("batch", 2)]
    # so does distributed noise (each client's share is drawn and encoded on its own)
    assert sizes(jobs([20] * 4) + jobs([20], distributed=True), workers=2) == [
        ("inprocess", 1), ("batch", 2), ("batch", 2)]
    # not an MLP: every run on its own
    monkeypatch.setattr(study_mod, "batchable", lambda study, cfg: False)
    assert sizes(jobs([20] * 3)) == [("inprocess", 1)] * 3


def test_paired_t_test_against_scipy_and_the_formula():
    treatment = [0.0093, 0.0091, 0.0095, 0.0092, 0.0094]
    control = [0.0099, 0.0097, 0.0096, 0.0101, 0.0098]
    d = np.subtract(treatment, control)
    t_stat = d.mean() / (d.std(ddof=1) / math.sqrt(len(d)))
    expected = stats.t.cdf(t_stat, df=4)  # one-sided, H1: mean difference < 0
    assert paired_one_sided_ttest(treatment, control) == pytest.approx(expected, rel=1e-12)
    assert paired_one_sided_ttest(treatment, control) < 0.01
    assert paired_one_sided_ttest(control, treatment) == pytest.approx(1 - expected, rel=1e-9)
    assert math.isnan(paired_one_sided_ttest([1.0, math.inf], [1.0, 2.0]))
    with pytest.raises(ValueError, match="equal size"):
        paired_one_sided_ttest([1.0, 2.0], [1.0])


def test_selection_rules_on_a_hand_made_table():
    table = {
        # mean 0.20
        "a": {"train_loss": [0.30, 0.10], "grad_norm_sq": [1e-3, 1e-3], "test_loss": [0.01, 0.01]},
        # diverged once
        "b": {"train_loss": [0.15, 0.15], "grad_norm_sq": [5e-4, math.inf], "test_loss": [0.99,
                                                                                          0.99]},
        "c": {"train_loss": [0.16, 0.16], "grad_norm_sq": [2e-4, 3e-4], "test_loss": [0.00, 0.00]},
    }
    chosen = select(table)
    assert chosen["train_loss"] == "b"  # smallest mean train loss
    assert chosen["grad_norm_sq"] == "c"  # "b" diverged on one seed: inf
    # reported at the train-loss-best point, not its own best ("c")
    assert chosen["test_loss"] == "b"
    with pytest.raises(ValueError, match="empty"):
        select({})


def base_study(**changes):
    data = yaml.safe_load(SMOKE.read_text())
    data.update(changes)
    return data


@pytest.mark.parametrize(
    "changes,match",
    [
        ({"methods": [{"name": "X", "method": "adam", "grid": {"learning_rate": [0.1]}}]},
         r"methods\[0\]\.method.*'adam'"),
        ({"methods": [{"name": "X", "method": "dpgd", "grid": {"learning_rate": []}}]},
         r"grid\.learning_rate.*empty"),
        ({"methods": [{"name": "X", "method": "diff2", "grid": {"restart_every": [4, 50],
                                                                "learning_rate": [0.1]}}]},
         r"restart_every.*T <= rounds = 40.*50"),
        ({"methods": [{"name": "X", "method": "diff2", "grid": {"learning_rate": [0.1]}}]},
         r"restart_every.*diff2"),
        ({"methods": [{"name": "X", "method": "dpgd", "grid": {"momentum": [0.9]}}]},
         r"methods\[0\]\.grid.*parameters of its routine gd: none; momentum belong to another "
         r"routine: set routine"),
        ({"methods": [{"name": "X", "method": "dpgd", "routine": "adam",
                       "grid": {"momentum": [0.9]}}]},
         r"grid.*its routine adam: beta1, beta2, eps, weight_decay.*Found \['momentum'\]"),
        ({"methods": [{"name": "X", "method": "dpgd", "routine": "lion",
                       "grid": {"learning_rate": [0.1]}}]},
         r"methods\[0\]\.routine.*name one of 'gd', 'momentum', 'nesterov', 'adam', 'adamw'. "
         r"Found 'lion'"),
        ({"methods": [{"name": "X", "method": "dpgd", "routine": {"name": "adam", "momentum": 0.9},
                       "grid": {"learning_rate": [0.1]}}]},
                       r"methods\[0\]\.routine.*parameters of routine adam"),
        ({"methods": [{"name": "X", "method": "dpgd", "routine": {"name": "adam", "beta1": 0.9},
                       "grid": {"learning_rate": [0.1], "beta1": [0.5]}}]},
                       r"grid.*no key that.*routine already fixes"),
        ({"methods": [{"name": "X", "method": "dpgd", "routine": "adam",
                       "grid": {"learning_rate": [0.1],
                                                                                 "beta1": [1.0]}}]},
         r"method 'X'.*key `training.routine.beta1`: expected a number in \[0, 1\). Found 1.0"),
        ({"seeds": {"tune": [1], "evaluate": [1, 2]}}, r"seeds\.evaluate.*disjoint"),
        ({"epsilons": [0]}, r"`epsilons`"),
        ({"rounds": "many"}, r"`rounds`"),
        ({"colour": "blue"}, r"unknown key.*colour"),
        ({"workers": 0}, r"`workers`: expected an integer >= 1"),
        ({"batch_size": 0}, r"`batch_size`: expected an integer >= 1"),
        ({"methods": [{"name": "X", "method": "dpgd", "grid": {"learning_rate": [0.1]}, "u": 0.5},
                      {"name": "X", "method": "gd", "grid": {"learning_rate": [0.1]}}]},
                      r"distinct method names"),
    ],
)
def test_bad_study_files_are_refused_with_the_key(changes, match):
    with pytest.raises(StudyError, match=match):
        parse_study(base_study(**changes), "bad.yaml")


def test_missing_dataset_file_is_reported(tmp_path):
    study = parse_study(base_study(dataset={"name": "california_housing", "dir": str(tmp_path)}),
                        "s.yaml")
    with pytest.raises(DataError, match="cal_housing.csv"):
        run_study(study, output_root=tmp_path, show_progress=False)


def test_unreadable_or_malformed_study_file(tmp_path):
    with pytest.raises(StudyError, match="Cannot read study file"):
        load_study(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed")
    with pytest.raises(StudyError, match="not valid YAML"):
        load_study(bad)
    twice = tmp_path / "twice.yaml"
    twice.write_text(SMOKE.read_text() + "epsilons: [8.0]\n")
    with pytest.raises(StudyError,
                       match=r"key 'epsilons' is given twice in one mapping \(line \d+ and line "
                             r"\d+\)"):
        load_study(twice)


def test_paper_studies_are_valid_and_large_enough():
    for path in sorted((SMOKE.parent / "paper").glob("*.yaml")):
        if path.name.endswith("_rdp.yaml"):
            continue  # the rdp variant: below
        study = load_study(path)
        assert sum(len(m.points()) for m in study.methods) >= 50
        assert study.rounds == 2000 and len(study.eval_seeds) == 5 and len(study.methods) == 6
        assert [m.grid[0][1] for m in study.methods if m.method == "diff2"] == [(6,), (20,), (60,),
                                                                                (200,)]


def test_the_rdp_variant_is_the_paper_study_with_rdp_calibration_and_fewer_methods():
    paper = load_study(SMOKE.parent / "paper" / "california_eps3.yaml")
    rdp = load_study(SMOKE.parent / "paper" / "california_eps3_rdp.yaml")
    assert (rdp.mode, paper.mode) == ("rdp", "exact")
    kept = {m.name: m for m in paper.methods}
    assert [m.name for m in rdp.methods] == ["DP-GD", "DIFF2-GD (T=6)", "DIFF2-GD (T=20)"]
    assert all(m == kept[m.name] for m in rdp.methods)
    for key in ("rounds", "clients", "delta", "epsilons", "tune_seeds", "eval_seeds", "dataset"):
        assert getattr(rdp, key) == getattr(paper, key), key


# ---------------------------------------------------------------- per-method R, chosen t-tests, the
# cost report

def _cost_study(**changes) -> dict:
    data = yaml.safe_load(SMOKE.read_text())
    data.update(rounds=12, eval_every=3, seeds={"tune": [7], "evaluate": [1, 2]},
                analysis={"protocol": "paper"})
    data["methods"] = [
        {"name": "DP-GD", "method": "dpgd", "grid": {"learning_rate": [0.2]}},
        {"name": "DIFF2", "method": "diff2", "grid": {"restart_every": [4], "learning_rate": [0.2,
                                                                                              0.4],
                                                      "clip_diff": [3.0]}},
        {"name": "DIFF2 short", "method": "diff2", "rounds": 6,
         "grid": {"restart_every": [3], "learning_rate": [0.4], "clip_diff": [3.0]}},
        {"name": "DIFF2 local", "method": "diff2", "rounds": 6, "local": {"steps": 3,
                                                                          "batch_size": 16},
         "grid": {"restart_every": [3], "learning_rate": [0.2], "clip_diff": [3.0]}},
    ]
    data.update(changes)
    return data


def test_a_method_runs_its_own_rounds_at_the_same_epsilon_and_the_cost_report_counts_it(tmp_path):
    from diff2_flwr.core.cost import gradient_evaluations

    study = parse_study(_cost_study(tests=[{"treatment": "DIFF2 local", "control": "DIFF2 short"},
                                           {"treatment": "DIFF2", "control": "DP-GD"}]), "c.yaml")
    short = study.methods[2]
    cfg = study.experiment(short, short.points()[0], 3.0, 1)
    assert (cfg.training.rounds, study.rounds_of(study.methods[1]),
            study.rounds_of(short)) == (6, 12, 6)
    # R = 6 spends the same ε as R = 12 with less noise per round
    long_cfg = study.experiment(study.methods[1], {"restart_every": 3, "learning_rate": 0.4,
                                                   "clip_diff": 3.0}, 3.0, 1)
    assert cfg.calibration(400).z1 < long_cfg.calibration(400).z1
    summary = run_study(study, output_root=tmp_path, show_progress=False)
    eps = summary["epsilons"]["3.0"]
    # exactly the listed pairs
    assert set(eps["tests"]) == {"DIFF2 local vs DIFF2 short", "DIFF2 vs DP-GD"}
    runs = {rid: json.loads((tmp_path / "smoke" / "runs" / f"{rid}.json").read_text())
            for e in eps["methods"].values() for c in CRITERIA
            for rid in e["criteria"][c]["run_ids"]}
    for name, length in (("DIFF2", 12), ("DIFF2 short", 6), ("DIFF2 local", 6)):
        assert eps["methods"][name]["rounds"] == length
        assert all(runs[rid]["rounds"][-1] == length
                   for rid in eps["methods"][name]["criteria"]["train_loss"]["run_ids"])
    assert runs[eps["methods"]["DIFF2 short"]["criteria"]["train_loss"]["run_ids"][0]][
        "engine"] == "batch"
    assert runs[eps["methods"]["DIFF2 local"]["criteria"]["train_loss"]["run_ids"][0]][
        "engine"] == "inprocess"
    cost = eps["cost"]
    n = cost["n_train"]
    assert cost["reference"] == "DIFF2" and n == 1600  # synthetic 2,000 samples, 80 % train
    short_c, local_c, dpgd_c = (cost["methods"][k]["criteria"]["train_loss"]
                                for k in ("DIFF2 short", "DIFF2 local",
                                                                                       "DP-GD"))
    # restart rounds 1 and 4 cost n, the others 2n; the local phase 2b(K-1) = 64 per round
    assert short_c["gradient_evaluations"] == [0, 5 * n, 10 * n]
    assert local_c["gradient_evaluations"] == [0, 5 * n + 3 * 64,
                                               10 * n + 6 * 64] and local_c["local_exchanges"] == 6
    assert dpgd_c["gradient_evaluations"] == [3 * i * n
                                              for i in range(5)] and dpgd_c["local_exchanges"] == 0
    assert list(gradient_evaluations(rounds=6, restart_every=3, n=n, local_steps=3, local_batch=16,
                                     at=[0, 3, 6])) \
        == local_c["gradient_evaluations"]
    for c in CRITERIA:  # the reference reaches its own utility by its last round at the latest
        ref = cost["methods"]["DIFF2"]["criteria"][c]
        assert ref["running_min_mean"][-1] == pytest.approx(eps["methods"]["DIFF2"]["criteria"][c][
            "min_mean"], rel=1e-12)
        assert ref["round_to_target"] is not None
        i = ref["rounds"].index(ref["round_to_target"])
        assert ref["evaluations_to_target"] == ref["gradient_evaluations"][i]
        assert ref["running_min_mean"][i] <= ref["target"]
        # the first round that reaches it
        assert all(v > ref["target"] for v in ref["running_min_mean"][:i])
        assert all(np.diff(ref["running_min_mean"]) <= 0)  # a running minimum
    report = (tmp_path / "smoke" / "report.md").read_text()
    assert "| DIFF2 local | train loss | 6 | 6 |" in report and "round to reference" in report
    assert (tmp_path / "smoke" / "cost_eps3.png").is_file()


def test_run_ids_of_methods_at_the_studys_rounds_are_unchanged_and_own_rounds_change_them():
    from diff2_flwr.lab.study.plan import run_id as _run_id

    study = load_study(SMOKE)
    diff2 = study.methods[2]
    assert _run_id("tune", diff2, diff2.points()[0], 3.0, 100,
                   study) == "tune-diff2-gd--t-4-4666ced630cb"
    data = yaml.safe_load(SMOKE.read_text())
    data["methods"][2]["rounds"] = 20
    other = parse_study(data, "r.yaml")
    assert _run_id("tune", other.methods[2], diff2.points()[0], 3.0, 100,
                   other) != "tune-diff2-gd--t-4-4666ced630cb"


@pytest.mark.parametrize("change, key, found", [
    ({"tests": [{"treatment": "DIFF2", "control": "nope"}]}, "tests[0]", "nope"),
    ({"tests": [{"treatment": "DIFF2", "control": "DIFF2"}]}, "tests[0]", "DIFF2"),
    ({"tests": [{"treatment": "DIFF2"}]}, "tests[0]", "treatment"),
    ({"reference": "GD"}, "reference", "GD"),
])
def test_bad_tests_and_reference_are_refused_by_key(change, key, found):
    with pytest.raises(StudyError,
                       match=rf"c\.yaml: key `{re.escape(key)}`: expected .*Found .*{found}"):
        parse_study(_cost_study(**change), "c.yaml")


def test_a_methods_rounds_must_be_a_positive_integer_and_bound_its_T():
    data = _cost_study()
    data["methods"][2]["rounds"] = 0
    with pytest.raises(StudyError, match=r"key `methods\[2\]\.rounds`: expected an integer >= 1"):
        parse_study(data, "c.yaml")
    data["methods"][2]["rounds"] = 2
    with pytest.raises(StudyError,
                       match=r"key `methods\[2\]\.grid\.restart_every`: expected integers T <= "
                             r"rounds = 2"):
        parse_study(data, "c.yaml")


def test_gradient_evaluations_count_the_algorithm():
    from diff2_flwr.core.cost import gradient_evaluations, round_evaluations

    assert [round_evaluations(r, 3, 10) for r in range(1, 7)] == [10, 20, 20, 10, 20, 20]
    assert [round_evaluations(r, 1, 10) for r in range(1, 4)] == [10, 10, 10]  # DP-GD, GD
    assert round_evaluations(2, 3, 10, local_steps=5, local_batch=4) == 20 + 2 * 4 * 4
    assert list(gradient_evaluations(rounds=4, restart_every=2, n=5)) == [0, 5, 15, 20, 30]
    with pytest.raises(ValueError, match="rounds to report must lie in 0 … 4"):
        gradient_evaluations(rounds=4, restart_every=2, n=5, at=[5])
    with pytest.raises(ValueError, match="expected r >= 1"):
        round_evaluations(0, 2, 5)


def test_a_run_that_diverges_on_the_per_run_path_is_reported_and_costed(tmp_path):
    """The per-run path stops a diverged run (its rows end there), the batched engine records inf:
    the report and the cost curves put both on one round axis, and a diverged run keeps the best
    value it reached before."""
    data = _cost_study(engine="inprocess", reference="DP-GD")
    data["methods"] = [{"name": "DP-GD", "method": "dpgd", "grid": {"learning_rate": [0.2]}},
                       {"name": "wild", "method": "diff2", "grid": {"restart_every": [4],
                                                                    "learning_rate": [1.0e307],
                                                                    "clip_diff": [3.0]}}]
    summary = run_study(parse_study(data, "w.yaml"), output_root=tmp_path, show_progress=False)
    eps = summary["epsilons"]["3.0"]
    wild = eps["methods"]["wild"]["criteria"]["train_loss"]
    runs = [json.loads((tmp_path / "smoke" / "runs" / f"{rid}.json").read_text())
            for rid in wild["run_ids"]]
    assert all(r["diverged_at"] is not None and r["rounds"][-1] == r["diverged_at"] < 12
               for r in runs)
    curve = eps["cost"]["methods"]["wild"]["criteria"]["train_loss"]
    assert curve["rounds"] == runs[0]["rounds"]  # the longest run's axis
    best = np.mean([min(v for v in r["train_loss"] if v is not None) for r in runs])
    assert curve["running_min_mean"][-1] == pytest.approx(best, rel=1e-12)
    assert (tmp_path / "smoke" / "figure_eps3.png").is_file() and (
        tmp_path / "smoke" / "cost_eps3.png").is_file()


def test_runs_of_different_lengths_share_one_round_axis():
    from diff2_flwr.lab.study.report import aligned_metric

    full = {"rounds": [0, 3, 6, 9], "train_loss": [4.0, 3.0, 2.0, 1.0]}
    # the per-run path: diverged at 5
    stopped = {"rounds": [0, 3, 5], "train_loss": [5.0, 1.5, None]}
    axis, values = aligned_metric([stopped, full], "train_loss")
    assert axis.tolist() == [0, 3, 6, 9]
    assert values.tolist() == [[5.0, 1.5, math.inf, math.inf], [4.0, 3.0, 2.0, 1.0]]
    assert np.minimum.accumulate(values, axis=1)[0].tolist() == [5.0, 1.5, 1.5, 1.5]


def test_a_study_tunes_the_schedule_and_the_batch_engine_equals_the_inprocess_one(tmp_path):
    """A grid over schedules end to end: each run steps with its own schedule on both engines
    (records, picks and minima agree), and the summary and report say which schedule was run."""
    def study(engine):
        data = base_study(rounds=8, eval_every=4, seeds={"tune": [7], "evaluate": [1, 2]},
                          analysis={"protocol": "paper"}, engine=engine, methods=[
                              {"name": "DP-GD", "method": "dpgd", "every": 2,
                               "grid": {"learning_rate": [0.4],
                                        "schedule": ["constant", "step", "cosine"]}},
                              {"name": "DIFF2-GD", "method": "diff2", "schedule": "inverse_sqrt",
                               "grid": {"restart_every": [4], "learning_rate": [0.4],
                                        "clip_diff": [3.0]}}])
        out = tmp_path / engine
        return run_study(parse_study(data, f"{engine}.yaml"), output_root=out,
                         show_progress=False, make_plots=False), out / "smoke"

    (batch, root), (inprocess, other_root) = study("batch"), study("inprocess")
    records = {json.loads(p.read_text())["run_id"]: json.loads(p.read_text())
               for p in (root / "runs").glob("tune-dp-gd-*.json")}
    for run_id, record in records.items():  # the same run, run by the per-run path
        again = json.loads((other_root / "runs" / f"{run_id}.json").read_text())
        assert again["engine"] == "inprocess" and again["schedule"] == record["schedule"]
        np.testing.assert_allclose(record["train_loss"], again["train_loss"], rtol=1e-9)
    assert sorted(r["schedule"]["name"] for r in records.values()) == ["constant", "cosine", "step"]
    finals = {r["schedule"]["name"]: r["train_loss"][-1] for r in records.values()}
    assert len(set(finals.values())) == 3  # three schedules, three trajectories
    assert {r["engine"] for r in records.values()} == {"batch"}
    for name, entry in batch["epsilons"]["3.0"]["methods"].items():
        other = inprocess["epsilons"]["3.0"]["methods"][name]
        for c in CRITERIA:
            assert entry["criteria"][c]["point"] == other["criteria"][c]["point"]
            assert entry["criteria"][c]["min_mean"] == pytest.approx(
                other["criteria"][c]["min_mean"], rel=1e-9)
    methods = batch["epsilons"]["3.0"]["methods"]
    assert methods["DP-GD"]["schedule"] == {"name": ["constant", "step", "cosine"], "every": 2}
    assert methods["DIFF2-GD"]["schedule"] == {"name": "inverse_sqrt"}
    assert methods["DP-GD"]["grid_searched"]["schedule"] == ["constant", "step", "cosine"]
    report = (root / "report.md").read_text()
    assert "| DIFF2-GD | gd, inverse_sqrt | train loss |" in report
    assert "| DP-GD | gd, constant/step/cosine(every=2) | train loss |" in report
