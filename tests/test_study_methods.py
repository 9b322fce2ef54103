"""A study's methods are overrides of the experiment's declared settings (issue 39, item 2): fixed
or on a grid, written dotted or by the short names study files have always used, checked and cast by
the declarations, and run by the batched engine only where it honours every setting they make."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from diff2_flwr.lab.study import plan
from diff2_flwr.lab.study.methods import STUDY_SETS, dotted, point_key
from diff2_flwr.lab.study.spec import Study, StudyError, load_study, parse_study
from diff2_flwr.runtime.config import config_keys, parse_config, parse_section

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
STUDIES = sorted(p for p in CONFIGS.rglob("*.yaml")
                 if "methods" in (yaml.safe_load(p.read_text()) or {})
                 and "seeds" in yaml.safe_load(p.read_text()))
SMOKE = CONFIGS / "smoke.yaml"


def _dotted_entry(entry: dict) -> dict:
    """A method entry with every key written as its dotted experiment key (nested blocks
    flattened)."""
    out = {}
    for key, value in entry.items():
        if key in ("name", "method", "seed_offset"):
            out[key] = value
        elif key == "grid":
            out["grid"] = {dotted(k): v for k, v in value.items()}
        elif key == "routine" and isinstance(value, str):
            out["training.routine.name"] = value
        elif isinstance(value, dict):
            section = "training.routine" if key == "routine" else dotted(key)
            out.update({f"{section}.{k}": v for k, v in value.items()})
        else:
            out[dotted(key)] = value
    return out


def test_the_committed_studies_are_found():
    names = {str(p.relative_to(CONFIGS)) for p in STUDIES}
    assert {"smoke.yaml", "digits_study.yaml", "confirm/california.yaml",
            "regime/california_full.yaml", "routines/california_eps3.yaml",
            "paper/kddcup99_eps3.yaml"} <= names


@pytest.mark.parametrize("path", STUDIES, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_dotted_keys_and_short_names_make_the_same_methods_runs_and_run_ids(path):
    data = yaml.safe_load(path.read_text())
    short = parse_section(Study, data, str(path))
    again = parse_section(Study, {**data, "methods": [_dotted_entry(m) for m in data["methods"]]},
                          str(path))
    assert again == short and again.methods == short.methods  # so every run and run id is too
    for a, b in zip(again.methods, short.methods):
        point, seed = a.points()[0], short.tune_seeds[0]
        assert again.experiment(a, point, 3.0, seed) == short.experiment(b, point, 3.0, seed)
        assert plan.run_id("tune", a, point, 3.0, seed, again) == plan.run_id(
            "tune", b, point, 3.0, seed, short)


def test_run_ids_of_committed_studies_are_as_before_the_overrides():
    """Pinned from the version with its own key lists: routines, a local routine, a method's R, a
    factory model."""
    routines = load_study(CONFIGS / "routines" / "california_eps3.yaml")
    digits = load_study(CONFIGS / "digits_study.yaml")

    def first(study, i):
        m = study.methods[i]
        return plan.run_id("tune", m, m.points()[0], study.epsilons[0], study.tune_seeds[0], study)

    assert [first(routines, i) for i in (1, 4, 6)] == [
        "tune-dp-gd---adam-d49a1887b84d", "tune-diff2-bvr-l-sgd--t-20-dfe4eef76a13",
        "tune-diff2-bvr-l-sgd--t-20--r-500-add9d6ddf16c"]
    assert [first(digits, i) for i in range(3)] == [
        "tune-gd-1895f1696f99", "tune-dp-gd-c7153f68356b", "tune-diff2-gd-fe67b462a3c8"]


def _smoke(*methods: dict, **changes) -> dict:
    data = yaml.safe_load(SMOKE.read_text())
    data.update(methods=list(methods), **changes)
    return data


DIFF2 = {"name": "D", "method": "diff2", "grid": {"restart_every": [4], "learning_rate": [0.2]}}


def test_a_method_fixes_and_grids_any_key_the_study_leaves_to_it():
    method = {**DIFF2, "training.clip_diff": 3.0, "privacy": {"bits": 16},
              "grid": {**DIFF2["grid"], "privacy.u": [1.25, 1.5], "local.batch_size": [8]}}
    study = parse_study(_smoke(method), "s.yaml")
    m = study.methods[0]
    assert [p["u"] for p in m.points()] == [1.25, 1.5]  # a point names a key by its short name
    cfg = study.experiment(m, m.points()[1], 3.0, 100)
    got = (cfg.training.clip_diff, cfg.privacy.bits, cfg.privacy.u, cfg.local.batch_size)
    assert got == (3.0, 16, 1.5, 8)
    # a fixed setting identifies the runs (a method that does not set it keeps its run ids)
    plain = parse_study(_smoke({**DIFF2, "grid": {**DIFF2["grid"], "u": [1.25, 1.5]}}), "s.yaml")
    assert plan.method_key(m)["settings"] == [["training.clip_diff", 3.0]]
    assert "settings" not in plan.method_key(plain.methods[0])


def test_values_are_cast_to_their_declared_types():
    method = {**DIFF2, "local": {"steps": 3.0, "batch_size": 16},
              "grid": {"restart_every": [4.0], "learning_rate": [1]}}
    study = parse_study(_smoke(method), "s.yaml")
    m = study.methods[0]
    cfg = study.experiment(m, m.points()[0], 3.0, 100)
    assert type(cfg.training.restart_every) is int and type(cfg.local.steps) is int
    assert type(cfg.training.learning_rate) is float
    extended = study.experiment(m, {"restart_every": 8.0, "learning_rate": 0.2}, 3.0, 100)  # grown
    assert extended.training.restart_every == 8 and type(extended.training.restart_every) is int


BAD = [  # (method, the error it makes)
    ({**DIFF2, "lr": 0.1},
     r"s\.yaml: key `methods\[0\]\.lr`: expected a key of the experiment.*Found 0\.1\.$"),
    ({**DIFF2, "grid": {**DIFF2["grid"], "training.learnig_rate": [0.1]}},
     r"`methods\[0\]\.grid\.training\.learnig_rate`: .*did you mean training\.learning_rate\?"),
    ({**DIFF2, "privacy.epsilon": 8.0},
     r"key `methods\[0\]\.privacy\.epsilon`: expected a key the study leaves to its methods "
     r"\(privacy\.epsilon is set .* study's epsilons\)"),
    ({**DIFF2, "seed": 3},
     r"key `methods\[0\]\.seed`: .*training\.seed is set for every run by the study's seeds"),
    ({**DIFF2, "privacy": {"n_min": 10}},
     r"key `methods\[0\]\.privacy\.n_min`: expected a key the study leaves"),
    ({**DIFF2, "local": {"steps": "five"}},
     r"key `methods\[0\]\.local\.steps`: expected an integer\. Found 'five'\.$"),
    ({**DIFF2, "privacy.bits": 2.5},
     r"key `methods\[0\]\.privacy\.bits`: expected an integer\. Found 2\.5\.$"),
    ({**DIFF2, "grid": {**DIFF2["grid"], "privacy.noise": ["central"]}},
     r"key `methods\[0\]\.grid\.privacy\.noise`: expected a key whose values are numbers"),
    ({**DIFF2, "grid": {**DIFF2["grid"], "training.restart_every": [8]}},
     r"key `methods\[0\]\.grid\.training\.restart_every`: expected training\.restart_every once"),
    ({**DIFF2, "clip_diff": 1.0, "grid": {**DIFF2["grid"], "training.clip_diff": [1.0]}},
     r"key `methods\[0\]\.grid`: expected no key that methods\[0\] already fixes \(clip_diff\)"),
    ({**DIFF2, "u": 1.25, "privacy": {"u": 1.5}},
     r"key `methods\[0\]\.privacy\.u`: expected privacy\.u once"),
    ({**DIFF2, "grid": {**DIFF2["grid"], "local.clip": [True]}},
     r"key `methods\[0\]\.grid\.local\.clip`: expected a list of values of local\.clip, each a"),
    ({**DIFF2, "grid": {**DIFF2["grid"], "schedule": ["cosine", "linear"]}},
     r"key `methods\[0\]\.grid\.schedule`: expected a non-empty list of distinct schedule names "
     r"among 'constant', 'step', 'cosine', 'inverse_sqrt'\. Found \['cosine', 'linear'\]\.$"),
    ({**DIFF2, "grid": {**DIFF2["grid"], "floor": [0.1]}},
     r"key `methods\[0\]\.grid\.floor`: expected a parameter of its schedule constant \(none: "
     r"s\(r\) = 1\); floor needs a schedule that has it: set schedule\. Found \[0\.1\]\.$"),
    ({**DIFF2, "decay": 0.5, "grid": {**DIFF2["grid"], "schedule": ["cosine", "inverse_sqrt"]}},
     r"key `methods\[0\]\.decay`: expected a parameter of one of its schedules cosine, "
     r"inverse_sqrt \(every, floor\); decay needs a schedule"),
    ({**DIFF2, "schedule": "cosine", "grid": {**DIFF2["grid"], "schedule": ["step"]}},
     r"key `methods\[0\]\.grid`: expected no key that methods\[0\] already fixes \(schedule\)"),
    ({**DIFF2, "grid": {**DIFF2["grid"], "schedule": ["step"]}},
     r"point \{.*'schedule': 'step'\}\): key `training\.schedule\.every`: expected a value for "
     r"schedule 'step' \(it has no default\)"),
]


@pytest.mark.parametrize("method, match", BAD)
def test_a_bad_key_or_value_is_refused_in_one_line(method, match):
    with pytest.raises(StudyError, match=match) as err:
        parse_study(_smoke(method), "s.yaml")
    assert "\n" not in str(err.value)


def test_float32_accumulation_is_a_float32_batch_studys_only():
    """``accumulate: float32`` is the fused kernel's: refused in one line with float64 or another
    engine, taken with a float32 batch study."""
    for extra, found in (({"dtype": "float64"}, "'float32'"),
                         ({"dtype": "float32", "engine": "inprocess"}, "'float32'")):
        with pytest.raises(StudyError, match=r"key `accumulate`: expected 'float64' unless dtype "
                                             r"is 'float32' and engine is 'batch'") as err:
            parse_study(_smoke(DIFF2, accumulate="float32", **extra), "s.yaml")
        assert "\n" not in str(err.value) and found in str(err.value)
    with pytest.raises(StudyError, match=r"key `accumulate`: expected one of"):
        parse_study(_smoke(DIFF2, accumulate="float16", dtype="float32"), "s.yaml")
    study = parse_study(_smoke(DIFF2, accumulate="float32", dtype="float32"), "s.yaml")
    assert study.accumulate == "float32"


def test_every_key_is_either_a_methods_or_the_studys():
    for key in config_keys():
        if key != dotted(key) or point_key(key) != key:
            assert dotted(point_key(key)) == key  # a short name stands for one key, both ways
    owned = [k for k in config_keys()
             if any(k == s or (s.endswith(".") and k.startswith(s)) for s in STUDY_SETS)]
    assert {"privacy.epsilon", "training.seed", "dataset.name", "model.hidden",
            "evaluation.every"} <= set(owned)
    assert not {"privacy.u", "training.learning_rate", "local.steps"} & set(owned)


def test_one_study_value_is_parsed_by_the_experiment_files_machinery_and_checked_again_on_replace():
    data = _smoke(DIFF2, workers=2)
    study = parse_study(data, "s.yaml")
    assert parse_section(Study, data, "s.yaml") == study
    moved = dataclasses.replace(study, dataset={**study.dataset, "dir": "/data"})
    assert moved.methods == study.methods
    with pytest.raises(ValueError, match=r"key `workers`: expected 1 with engine 'flower'"):
        dataclasses.replace(study, engine="flower")
    extend = {"training.learning_rate": [0.1, 1]}
    same = parse_study({**data, "analysis": {"protocol": "paper", "extend": extend}}, "s.yaml")
    assert same.analysis.bounds("learning_rate") == (0.1, 1.0)  # a grid key as the points name it


def test_a_run_that_sets_n_min_is_sent_to_the_per_run_path(monkeypatch):
    """The batched engine calibrates for its data's smallest shard: a run config that sets
    privacy.n_min is not batched (where it would be ignored) but run on the per-run path, which
    honours it."""
    from types import SimpleNamespace

    monkeypatch.setattr(plan, "batchable", lambda study, cfg: True)
    base = {"name": "e", "method": "dpgd", "dataset": {"name": "synthetic", "num_samples": 400},
            "training": {"rounds": 4, "clients": 2, "seed": 1}}
    plain = parse_config(base, "e.yaml")
    pinned = parse_config({**base, "privacy": {"n_min": 100}}, "e.yaml")
    assert plan.batch_ignores(plain) == [] and plan.batch_ignores(pinned) == ["privacy.n_min"]
    jobs = [plan.Job(f"run-{i}", None, {}, 3.0, i, cfg) for i, cfg in enumerate([plain, pinned])]
    units = plan.plan_units(SimpleNamespace(engine="batch", batch_size=8, workers=1), jobs)
    engine = {j.run_id: u.engine for u in units for j in u.jobs}
    assert engine == {"run-0": "batch", "run-1": "inprocess"}


# ------------------------------------------------------------------------ step-size schedules

SCHEDULED = {"name": "DP-GD", "method": "dpgd", "every": 4,
             "grid": {"learning_rate": [0.2, 0.4], "schedule": ["constant", "cosine", "step"],
                      "floor": [0.0, 0.1], "decay": [0.25, 0.5]}}


def test_a_grid_over_schedules_plans_one_run_per_schedule_and_its_own_parameters():
    study = parse_study(_smoke(SCHEDULED), "s.yaml")
    m = study.methods[0]
    points = m.points()
    # per learning rate: constant, cosine at two floors, step at two decays (every: 4 fixed)
    assert [p for p in points if p["learning_rate"] == 0.2] == [
        {"learning_rate": 0.2, "schedule": "constant"},
        {"learning_rate": 0.2, "schedule": "cosine", "floor": 0.0},
        {"learning_rate": 0.2, "schedule": "cosine", "floor": 0.1},
        {"learning_rate": 0.2, "schedule": "step", "decay": 0.25},
        {"learning_rate": 0.2, "schedule": "step", "decay": 0.5}]
    assert len(points) == 10 and plan.planned_runs(study)[0] == 10 * 3
    ids = {plan.run_id("tune", m, p, 3.0, 100, study) for p in points}
    assert len(ids) == len(points)  # distinct runs, distinct ids
    schedules = [study.experiment(m, p, 3.0, 100).training.schedule for p in points[:5]]
    assert [s.to_yaml() for s in schedules] == [
        "constant", {"name": "cosine", "floor": 0.0}, {"name": "cosine", "floor": 0.1},
        {"name": "step", "every": 4, "decay": 0.25}, {"name": "step", "every": 4, "decay": 0.5}]
    assert m.schedule_of(points[3]) == {"name": "step", "every": 4, "decay": 0.25}
    # dotted keys make the same runs and ids
    dotted_entry = {"name": "DP-GD", "method": "dpgd", "training.schedule.every": 4,
                    "grid": {"training.learning_rate": [0.2, 0.4],
                             "training.schedule": ["constant", "cosine", "step"],
                             "training.schedule.floor": [0.0, 0.1],
                             "training.schedule.decay": [0.25, 0.5]}}
    again = parse_study(_smoke(dotted_entry), "s.yaml")
    assert again.methods == study.methods


def test_a_constant_schedule_leaves_run_ids_as_before_schedules():
    smoke = load_study(SMOKE)
    diff2 = smoke.methods[2]
    pinned = "tune-diff2-gd--t-4-4666ced630cb"  # tests/test_study.py, from before routines
    assert plan.run_id("tune", diff2, diff2.points()[0], 3.0, 100, smoke) == pinned
    entry = yaml.safe_load(SMOKE.read_text())["methods"][2]
    for constant in ("constant", {"name": "constant"}):
        same = parse_study(_smoke(*yaml.safe_load(SMOKE.read_text())["methods"][:2],
                                  {**entry, "schedule": constant}), "s.yaml")
        m = same.methods[2]
        assert plan.method_key(m) == plan.method_key(diff2)
        assert plan.run_id("tune", m, m.points()[0], 3.0, 100, same) == pinned
    cosine = parse_study(_smoke(*yaml.safe_load(SMOKE.read_text())["methods"][:2],
                                {**entry, "schedule": "cosine"}), "s.yaml")
    m = cosine.methods[2]
    assert plan.method_key(m)["schedule"] == "cosine"
    assert plan.run_id("tune", m, m.points()[0], 3.0, 100, cosine) != pinned


def test_the_line_search_moves_along_the_picks_own_schedule():
    extend = {"learning_rate": [0.1, 2.0], "decay": [0.1, 1.0], "floor": [0.01, 0.5]}
    study = parse_study(_smoke(SCHEDULED, analysis={"protocol": "paper", "extend": extend}),
                        "s.yaml")
    m = study.methods[0]
    search = plan.GridSearch.start(study)
    step = {"learning_rate": 0.4, "schedule": "step", "decay": 0.5}
    cosine = {"learning_rate": 0.2, "schedule": "cosine", "floor": 0.1}
    chosen = {m.name: {"train_loss": step, "grad_norm_sq": cosine, "test_loss": step}}
    made = search.extend(study, chosen, lambda method, point: study.experiment(method, point, 3.0,
                                                                               100))
    new = sorted((x["key"], round(x["value"], 12), x["because"]) for x in made)
    # step: η 0.4 is its line's high edge (0.8), γ 0.5 too (1.0); cosine: η 0.2 the low edge (0.1),
    # its floor 0.1 the high edge of [0, 0.1], which no ratio steps from; no step along `schedule`
    assert new == [("decay", 1.0, "train_loss"), ("learning_rate", 0.1, "grad_norm_sq"),
                   ("learning_rate", 0.8, "train_loss")]
    grown = [p for p in search.tuned[m.name] if p["learning_rate"] == pytest.approx(0.8)]
    assert grown == [{"learning_rate": grown[0]["learning_rate"], "schedule": "step", "decay": 0.5}]
    assert search.refused[m.name, "floor", "high"].startswith("no geometric step from 0")
    searched = search.searched(study, chosen)[m.name]
    assert searched["grid"]["schedule"] == ["constant", "cosine", "step"]
    assert searched["grid"]["decay"] == [0.25, 0.5, 1.0]
    assert searched["grid"]["learning_rate"] == pytest.approx([0.1, 0.2, 0.4, 0.8], rel=1e-12)
