"""A study's run table (issue 42, item 1): the records it holds read back as the very numbers the
analysis read, and a replay computes nothing."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from diff2_flwr.lab.study import tables
from diff2_flwr.lab.study.registration import RegistrationError
from diff2_flwr.lab.study.runner import load_study, run_study
from diff2_flwr.lab.study.scheduler import load_run
from diff2_flwr.lab.study.spec import StudyError


def _record(run_id: str, **changes) -> dict:
    record = {"run_id": run_id, "method": "DP-GD", "base_method": "dpgd",
              "routine": {"name": "gd"}, "point": {"learning_rate": 0.5, "clip_restart": 1.0},
              "epsilon": 3.0, "seed": 21, "engine": "batch", "diverged_at": None,
              "rounds": [0, 50, 100], "train_loss": [0.9, 0.1 + 2**-40, 1 / 3],
              "grad_norm_sq": [2.5, 1e-300, 7.0], "test_loss": [1.0, 0.2, 0.3],
              "wall_s": 0.125}
    return {**record, **changes}


def test_a_table_reads_back_the_very_numbers_including_a_diverged_run(tmp_path):
    runs = [_record("tune-dp-gd-aaaaaaaaaaaa"),
            _record("eval-dp-gd-bbbbbbbbbbbb", diverged_at=100,
                    train_loss=[0.9, 0.5, math.inf], grad_norm_sq=[1.0, 2.0, math.inf],
                    test_loss=[1.0, 0.4, math.inf], test_accuracy=[0.5, 0.75, math.nan])]
    rows = tables.table_rows("confirm2_california", "california_housing", "ab12", runs)
    path = tables.write_table(tmp_path / "runs.csv", rows)
    back = {r["run_id"]: r for r in tables.read_table(path)}
    assert [r["role"] for r in rows] == ["evaluate", "tune"]  # sorted by run id
    for want in runs:
        got = back[want["run_id"]]
        for key in ("point", "routine", "epsilon", "seed", "rounds", "train_loss", "grad_norm_sq",
                    "test_loss", "diverged_at", "wall_s"):
            assert got[key] == want[key], key
        assert got["registration"] == "ab12"
    diverged = back["eval-dp-gd-bbbbbbbbbbbb"]
    assert diverged["train_loss"][-1] == math.inf and math.isnan(diverged["test_accuracy"][-1])
    assert "test_accuracy" not in back["tune-dp-gd-aaaaaaaaaaaa"]


def test_a_gzipped_table_reads_as_its_csv_and_its_bytes_depend_only_on_its_rows(tmp_path):
    rows = tables.table_rows("s", "d", "ab12", [_record("tune-dp-gd-aaaaaaaaaaaa"),
                                                _record("eval-dp-gd-bbbbbbbbbbbb", seed=22)])
    plain = tables.write_table(tmp_path / "t.csv", rows)
    packed = tables.write_table(tmp_path / "t.csv.gz", rows)
    assert gzip.decompress(packed.read_bytes()) == plain.read_bytes()
    assert tables.read_table(packed) == tables.read_table(plain)
    again = tables.write_table(tmp_path / "u.csv.gz", rows)  # no time stamp in the gzip header
    assert again.read_bytes() == packed.read_bytes()
    assert tables.table_path(tmp_path, "t") == packed  # the packed one first
    packed.unlink()
    assert tables.table_path(tmp_path, "t") == plain
    truncated = tmp_path / "cut.csv.gz"
    truncated.write_bytes(again.read_bytes()[:40])
    with pytest.raises(StudyError, match=r"cut.csv.gz: not a readable run table"):
        tables.read_table(truncated)


def test_unpacked_run_files_load_as_the_scheduler_wrote_them(tmp_path):
    runs = [_record("eval-diff2-gd-cccccccccccc", method="DIFF2-GD", base_method="diff2",
                    grad_norm_sq=[3.0, math.inf, math.inf], diverged_at=50)]
    rows = tables.table_rows("s", "d", None, runs)
    records = tables.read_table(tables.write_table(tmp_path / "t.csv", rows))
    assert tables.unpack(records, tmp_path / "runs", "t.csv") == 1
    loaded = load_run(tmp_path / "runs", "eval-diff2-gd-cccccccccccc")
    assert loaded["grad_norm_sq"] == [3.0, math.inf, math.inf]
    assert loaded["train_loss"] == runs[0]["train_loss"]
    raw = json.loads((tmp_path / "runs" / "eval-diff2-gd-cccccccccccc.json").read_text())
    assert raw["computed_by"] == {"table": "t.csv"} and raw["registration"] is None


def test_a_damaged_or_foreign_table_is_refused_in_one_line(tmp_path):
    foreign = tmp_path / "other.csv"
    foreign.write_text("a,b\n1,2\n")
    with pytest.raises(StudyError, match=r"lacks study, registration"):
        tables.read_table(foreign)
    rows = tables.table_rows("s", "d", None, [_record("tune-x-dddddddddddd")])
    rows[0]["train_loss"] = "[0.9, oops]"
    path = tables.write_table(tmp_path / "bad.csv", rows)
    with pytest.raises(StudyError, match=r"line 2 \(run 'tune-x-dddddddddddd'\).*damaged"):
        tables.read_table(path)


def test_a_replay_computes_nothing_and_names_the_run_the_table_lacks():
    executor = tables.TableExecutor("results/x.csv", lambda job: f"{job.method}, seed {job.seed}")
    job = SimpleNamespace(run_id="eval-dp-gd-eeeeeeeeeeee", method="DP-GD", seed=40)
    study = SimpleNamespace(source="configs/confirm2/california.yaml")
    with pytest.raises(StudyError) as caught:
        executor.submit(study, SimpleNamespace(jobs=[job]))
    message = str(caught.value)
    assert "\n" not in message
    assert "lacks run eval-dp-gd-eeeeeeeeeeee (DP-GD, seed 40)" in message
    assert executor.completed(0.1) == [] and executor.in_flight == 0


def test_roles_come_from_the_run_ids_phase():
    assert tables.role_of("tune-dp-gd-0123456789ab") == "tune"
    assert tables.role_of("eval-dp-gd-0123456789ab") == "evaluate"
    with pytest.raises(ValueError):
        tables.role_of("x-dp-gd-0123456789ab")


# ------------------------------------------------------------------ a study's table and its replay

SMOKE = Path(__file__).resolve().parents[1] / "configs" / "smoke.yaml"
_RUN_SPECIFIC = ("wall_time_s", "execution")


def _figures(summary: dict) -> dict:
    """A summary without what differs between a computation and its replay (time, who computed)."""
    return {k: v for k, v in summary.items() if k not in _RUN_SPECIFIC}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("studies")
    study = load_study(SMOKE)
    return study, run_study(study, output_root=out, show_progress=False), out


def test_a_study_writes_its_run_table_and_a_replay_from_it_recomputes_every_figure(smoke,
                                                                                   monkeypatch):
    study, summary, out = smoke
    table = out / study.name / "runs.csv.gz"
    records = tables.read_table(table)
    assert len(records) == len(list((out / study.name / "runs").glob("*.json")))
    assert {r["role"] for r in tables.table_rows("s", "d", None, records)} == {"tune", "evaluate"}
    assert all(r["wall_s"] > 0 for r in records)
    # the replay computes nothing: any computation fails the test
    monkeypatch.setattr("diff2_flwr.lab.study.scheduler.compute_unit",
                        lambda *a, **k: pytest.fail("a replay computed a run"))
    again = run_study(study, output_root=out, show_progress=False, table=table)
    assert _figures(again) == _figures(summary)
    assert again["execution"]["executor"] == "table"
    assert (out / f"{study.name}-from-table" / "runs.csv.gz").read_bytes() == table.read_bytes()


def test_a_table_that_lacks_a_planned_run_stops_the_replay_in_one_line(smoke, tmp_path):
    study, _, out = smoke
    lines = gzip.decompress((out / study.name / "runs.csv.gz").read_bytes()).decode().splitlines(
        keepends=True)
    dropped = next(line for line in lines if ",evaluate,eval-dp-gd-" in line)
    short = tmp_path / "short.csv"
    short.write_text("".join(line for line in lines if line is not dropped))
    with pytest.raises(StudyError) as caught:
        run_study(study, output_root=tmp_path, show_progress=False, table=short)
    message = str(caught.value)
    assert "\n" not in message and "lacks run eval-dp-gd-" in message
    assert "a replay computes nothing" in message


# ------------------------------------------------------------------------------ the registration

def _registered(tmp_path: Path, **changes) -> Path:
    """A registered copy of the smoke study (study, family, registration) in ``tmp_path``."""
    study = yaml.safe_load(SMOKE.read_text())
    study.update(name="registered", registration="registration.yaml",
                 output={"dir": str(tmp_path / "out")})
    (tmp_path / "smoke.yaml").write_text(yaml.safe_dump(study))
    (tmp_path / "family.yaml").write_text(yaml.safe_dump({"name": "f", "studies": ["smoke.yaml"],
                                                          "alpha": 0.05}))
    registration = {"registration": "test", "registered": "2026-12-04", "question": "q",
                    "endpoints": "e", "family": "family.yaml", "studies": ["smoke.yaml"],
                    "seeds": "s", "grids": "g", "selection": "s", "analysis": "a",
                    "amendments": [], **changes}
    (tmp_path / "registration.yaml").write_text(yaml.safe_dump(registration))
    return tmp_path / "smoke.yaml"


def test_a_registered_study_ties_every_run_and_its_table_to_the_registration(tmp_path):
    path = _registered(tmp_path)
    study = load_study(path)
    digest = study.registration.digest
    assert len(digest) == 64
    summary = run_study(study, show_progress=False, make_plots=False)
    assert summary["registration"]["sha256"] == digest
    root = tmp_path / "out" / "registered"
    assert all(json.loads(f.read_text())["registration"] == digest
               for f in (root / "runs").glob("*.json"))
    assert {r["registration"] for r in tables.read_table(root / "runs.csv.gz")} == {digest}
    # an amendment (any change to a registered file) changes the digest, and the runs computed
    # under the old one are refused
    family = tmp_path / "family.yaml"
    family.write_text(family.read_text() + "# amended\n")
    amended = load_study(path)
    assert amended.registration.digest != digest
    pattern = r"computed under registration [0-9a-f]{64}, and the study is registered as [0-9a-f]"
    with pytest.raises(RegistrationError, match=pattern):
        run_study(amended, show_progress=False, make_plots=False)


def test_an_incomplete_or_foreign_registration_is_refused_in_one_line(tmp_path):
    path = _registered(tmp_path, registered="last week")
    with pytest.raises(StudyError, match=r"key `registered`: expected the date it was committed"):
        load_study(path)
    path = _registered(tmp_path, studies=["family.yaml"])
    with pytest.raises(StudyError, match=r"registers family.yaml, family.yaml, not this file"):
        load_study(path)
    path = _registered(tmp_path, amendments=[{"date": "2026-12-05", "change": "grid",
                                              "reason": "cost"}])
    with pytest.raises(StudyError, match=r"amendments\[0\].*results_read"):
        load_study(path)


def test_the_second_confirmation_is_registered_as_the_issue_asks():
    """Issue 42, item 3: both methods tune the same number of configurations, DP-GD with decaying
    steps, the paper's budgets and ε 8, fresh evaluation seeds 21-40, Holm over the family, and
    one registration covering every file of it."""
    from diff2_flwr.lab.study.registration import load_registration

    configs = SMOKE.parent
    registration = load_registration(configs / "confirm2" / "registration.yaml")
    assert registration.amendments == () and registration.registered == "2026-12-04"
    studies = [load_study(f) for f in registration.files[1:]]
    assert {s.dataset["name"] for s in studies} == {"california_housing", "gas_turbine"}
    others = [load_study(p) for p in sorted(configs.rglob("*.yaml"))
              if "confirm2" not in p.parts and "seeds" in yaml.safe_load(p.read_text())
              and "methods" in yaml.safe_load(p.read_text())]
    used = {seed for s in others for seed in (*s.tune_seeds, *s.eval_seeds)}
    for s in studies:
        assert s.registration.digest == registration.digest
        assert s.epsilons == (3.0, 5.0, 8.0) and s.rounds == 2000 and s.clients == 10
        assert s.eval_seeds == tuple(range(21, 41)) and len(s.tune_seeds) == 3
        assert not (set(s.eval_seeds) | set(s.tune_seeds)) & used  # fresh: no earlier run reused
        assert s.analysis.corrected and s.analysis.budgets == "equal" and not s.analysis.extend
        assert [(e.criterion, e.at, e.scale, e.alternative) for e in s.analysis.primary] == [
            ("grad_norm_sq", "final", "log", "two-sided"),
            ("train_loss", "best", "log", "two-sided")]
        dpgd, diff2 = s.methods
        assert (dpgd.method, diff2.method) == ("dpgd", "diff2")
        assert len(dpgd.points()) == len(diff2.points()) == 24
        assert {p["schedule"] for p in dpgd.points()} == {"constant", "cosine", "step",
                                                          "inverse_sqrt"}
        for key in ("learning_rate", "clip_restart"):  # the shared axes alike
            assert dict(dpgd.grid)[key] == dict(diff2.grid)[key]
