"""Every mistake before Flower starts, and noise that drowns the signal said before and after (issue
21, items 2, 5).

The CLI tests run the real command (``.venv/bin/diff2 run``, the default engine: a Flower
simulation) as a subprocess: each mistake must be one line on stderr, the same text as the stdout
JSON's ``error``, within the issue's 10 s, without Flower ever starting.
"""

from __future__ import annotations

import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from scipy import stats

from diff2_flwr import cli
from diff2_flwr.core.privacy import calibrate, expected_noise_norm
from diff2_flwr.runtime.config import ConfigError, load_run_config, parse_config
from diff2_flwr.runtime.console import RunConsole
from diff2_flwr.runtime.noise_report import (
    LOSS_RISE_LIMIT, NOISE_RATIO_LIMIT, loss_rise, noise_warning,
)
from diff2_flwr.runtime.session import PreflightError, preflight

TESTS = Path(__file__).resolve().parent
DIFF2 = Path(sys.executable).with_name("diff2")
#: The issue's acceptance bound; measured ~3-5 s per mistake on the 2-core machine (most of it
#: importing torch). Counted in the command's CPU seconds (user + system), which a machine busy with
#: other tests (the suite runs in parallel processes) does not stretch as it stretches the wall
#: time; the wall time is printed beside it.
MAX_SECONDS = 10.0


def _tiny(**edit) -> dict:
    cfg = {"name": "tiny", "method": "diff2", "dataset": {"name": "synthetic", "num_samples": 600},
           "training": {"rounds": 6, "restart_every": 3, "clients": 3, "seed": 1}}
    for section, values in edit.items():
        cfg[section] = {**cfg.get(section, {}), **values}
    return cfg


def _csv(path: Path, cell: str | None = None) -> Path:
    """200 rows a, b, y; row 18's column b set to ``cell``."""
    rows = [[f"{(7 * i % 13) / 13:.4f}", f"{(5 * i % 11) / 11:.4f}",
             f"{(3 * i % 7) / 7:.4f}"] for i in range(200)]
    if cell is not None:
        rows[17][1] = cell
    path.write_text("a,b,y\n" + "\n".join(",".join(r) for r in rows) + "\n")
    return path


MISTAKES = {
    "misspelt factory": (lambda tmp: _tiny(model={"name": "preflight_models:no_such_factory"}),
                         "key `model.name`: module 'preflight_models' has no attribute "
                         "'no_such_factory'"),
    "factory module not found": (lambda tmp: _tiny(model={"name": "mypkg.models:make"}),
                                 "key `model.name`: cannot import module 'mypkg.models' of the "
                                 "model factory 'mypkg.models:make' (ModuleNotFoundError: No "
                                 "module named 'mypkg'). `flwr run` imports only what its FAB "
                                 "ships"),
    "factory returns a non-module": (lambda tmp: _tiny(model={
        "name": "preflight_models:not_a_module"}),
                                     "returned a dict, not a torch.nn.Module"),
    "factory raises": (lambda tmp: _tiny(model={"name": "preflight_models:raises"}),
                       "the model factory 'preflight_models:raises' raised RuntimeError: this "
                       "factory fails on purpose (called as factory(in_features=8, "
                       "out_features=1))"),
    "batch-norm model": (lambda tmp: _tiny(model={"name": "preflight_models:with_batch_norm"}),
                         "key `model.name`: the model 'preflight_models:with_batch_norm' cannot "
                         "be trained privately: Module '1' (BatchNorm1d) mixes samples within a "
                         "batch"),
    "local.batch_size above n_min": (lambda tmp: _tiny(local={"steps": 2, "batch_size": 500}),
                                     "key `local.batch_size`: expected at most n_min = 160"),
    "CSV with NaN": (lambda tmp: _tiny(dataset={"name": "csv",
                                                "path": str(_csv(tmp / "nan.csv", "nan")),
                                                "target": "y",
                                                "task": "regression", "num_samples": 10_000}),
                     "nan.csv: 1 NaN or infinite value (first at line 19, column 'b': nan)"),
    "CSV with text in a numeric column": (
        lambda tmp: _tiny(dataset={"name": "csv", "path": str(_csv(tmp / "text.csv", "hello")),
                                   "target": "y",
                                   "task": "regression", "num_samples": 10_000}),
        "text.csv: line 19, column 'b' holds 'hello', not a number"),
    "CSV with a ragged row": (
        lambda tmp: _tiny(dataset={"name": "csv", "path": str(_csv(tmp / "ragged.csv", "0.5,0.25")),
                                   "target": "y",
                                   "task": "regression", "num_samples": 10_000}),
        "ragged.csv: line 19 has 4 fields, the header (line 1) has 3"),
    "misspelt target column": (lambda tmp: _tiny(dataset={"name": "csv",
                                                          "path": str(_csv(tmp / "ok.csv")),
                                                          "target": "why", "task": "regression",
                                                          "num_samples": 10_000}),
                               "`dataset.target` column 'why' not found in the header"),
}


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_each_mistake_fails_diff2_run_in_one_line_before_flower_starts(mistake, tmp_path):
    make, expected = MISTAKES[mistake]
    cfg = make(tmp_path)
    if cfg["dataset"].get("name") == "csv":
        cfg["dataset"].pop("num_samples")  # synthetic only
    cfg["output"] = {"dir": str(tmp_path / "out")}
    path = tmp_path / "mistake.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH",
                                                                                   "")]),
           # were Flower started, it would leave traces here
           "FLWR_HOME": str(tmp_path / "flwr-home")}
    started, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run([str(DIFF2), "run", str(path)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    seconds = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    # shown with -s
    print(f"{mistake}: {seconds:.2f} s CPU, {time.perf_counter() - started:.2f} s wall")
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, lines
    report = json.loads(done.stdout)  # one JSON object
    assert lines[0] == f"diff2 run: error: {report['error']}"
    assert expected in report["error"], report["error"]
    assert report["status"] == "failed" and report["engine"] == "flower" and report[
        "output_dir"] is None
    # nothing ran, nothing written
    assert not (tmp_path / "out").exists() and not (tmp_path / "flwr-home").exists()
    assert seconds < MAX_SECONDS, f"{mistake}: {seconds:.1f} s"


def test_the_in_process_engine_reports_a_mistake_the_same_way(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))
    path = tmp_path / "bn.yaml"
    path.write_text(yaml.safe_dump(_tiny(model={"name": "preflight_models:with_batch_norm"})))
    code = cli.main(["run", str(path), "--engine", "inprocess"])
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert code == 2 and report["engine"] == "inprocess" and report["status"] == "failed"
    assert captured.err.splitlines() == [f"diff2 run: error: {report['error']}"]
    assert "BatchNorm1d" in report["error"]


def test_a_forward_that_does_not_fit_the_data_is_caught_by_the_probe(monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))
    cfg = parse_config(_tiny(model={"name": "preflight_models:wrong_width"}))
    with pytest.raises(PreflightError,
                       match=r"the model \(model.name preflight_models:wrong_width\) and loss "
                             r"half_squared_error fail on the first 4 training records of "
                             r"partition 0 at x_0: RuntimeError: .*features of shape \[n, 8\] and "
                             r"must return \[n, 1\] outputs"):
        preflight(cfg)


@pytest.mark.parametrize("source,name,message", [
    (None, "mypkg.models:make",
     r"cannot import module 'mypkg.models' .*put the module in the app's custom/ folder \(e.g. "
     r"custom/models.py, named 'custom.models:make'\) or in a folder added to fab-include, or "
     r"install its package into every node's environment"),
    (None, "custom.no_such_file:make",
     r"cannot import module 'custom.no_such_file' .*The app's custom/ folder has no "
     r"no_such_file.py \(Flower also leaves files named test_\*.py"),
    ("import no_such_dependency\n", "uses_a_missing_package:make",
     r"module 'uses_a_missing_package' of the model factory 'uses_a_missing_package:make' imports "
     r"'no_such_dependency', which is not installed .*Install it into every node's environment"),
])
def test_a_model_module_that_is_not_found_says_where_it_must_live(source, name, message, tmp_path,
                                                                  monkeypatch):
    if source is not None:
        (tmp_path / f"{name.partition(':')[0]}.py").write_text(source)
        monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PreflightError, match=r"key `model.name`: " + message):
        preflight(parse_config(_tiny(model={"name": name})))


def test_a_model_module_that_fails_to_import_says_so(tmp_path, monkeypatch):
    (tmp_path / "broken_models.py").write_text(
        "def make(in_features, out_features):\n    return (\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PreflightError,
                       match=r"key `model.name`: importing module 'broken_models' of the model "
                       r"factory 'broken_models:make' raised SyntaxError: .* Fix that module."):
        preflight(parse_config(_tiny(model={"name": "broken_models:make"})))


def test_the_server_app_says_the_mistake_in_one_line_first(tmp_path, capsys, monkeypatch):
    server_app = pytest.importorskip("server.server_app")
    monkeypatch.syspath_prepend(str(TESTS))
    path = tmp_path / "raises.yaml"
    path.write_text(yaml.safe_dump(_tiny(model={"name": "preflight_models:raises"})))
    with pytest.raises(PreflightError) as caught:
        server_app.checked_config({"config": str(path)})
    out = capsys.readouterr().out.splitlines()
    assert out == [f"[diff2] pre-flight failed: {caught.value}"]
    assert "raised RuntimeError: this factory fails on purpose" in str(caught.value)


def test_a_bad_run_config_value_names_the_key_the_type_and_the_value(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(_tiny()))
    with pytest.raises(ConfigError) as caught:
        load_run_config({"config": str(path), "training.rounds": "five", "privacy.epsilon": ""})
    assert str(caught.value) == (
        f"--run-config key `training.rounds`: expected an integer. Found 'five' "
                                 f"(experiment file {path}).")
    assert load_run_config({"config": str(path), "training.rounds": "4"}).training.rounds == 4


# ------------------------------------------------------------------------------ noise against the
# radius

@pytest.mark.parametrize("dim", [1, 2, 101, 560, 10_000])
def test_the_expected_noise_norm_is_the_chi_mean(dim):
    assert expected_noise_norm(0.449, dim) == pytest.approx(0.449 * stats.chi(dim).mean(),
                                                            rel=1e-10)
    assert expected_noise_norm(0.449, dim) < 0.449 * math.sqrt(dim)
    assert expected_noise_norm(0.0, dim) == 0.0


def test_the_issues_example_is_ten_radii_of_noise():
    """ε = 0.5 on a 560-parameter model, σ2 = 0.449 per coordinate: each difference round adds ~10.6
    radii."""
    assert expected_noise_norm(0.449, 560) == pytest.approx(10.62, abs=0.01)


def _drowning(epsilon: float) -> dict:
    return _tiny(privacy={"epsilon": epsilon})


def test_noise_that_drowns_the_signal_is_warned_before_the_run():
    pre = preflight(parse_config(_drowning(0.5)))  # σ2 = 0.131, d = 101: E‖noise‖ = 1.31 C
    cal = pre.calibration
    assert pre.noise["parameters"] == 101 == pre.gradients.layout.dim
    assert pre.noise["difference"] == pytest.approx(cal.sigma2 * stats.chi(101).mean(), rel=1e-10)
    assert pre.noise["difference"] > NOISE_RATIO_LIMIT > pre.noise["restart"]
    warning = next(w for w in pre.warnings if w.startswith("the noise drowns the signal"))
    assert ("expected norm 0.464× in restart rounds, 1.31× in difference rounds the clipping "
            "radius") in warning
    assert f"σ2 = {cal.sigma2:.3g} per coordinate over d = 101 parameters" in warning
    assert "raise privacy.epsilon" in warning and "smaller model" in warning
    assert warning == noise_warning(cal, 101)


def test_noise_well_below_the_radius_is_not_warned():
    pre = preflight(parse_config(_drowning(3.0)))  # E‖noise‖ = 0.26 C
    assert pre.noise["difference"] == pytest.approx(0.2598, abs=1e-3)
    assert not [w for w in pre.warnings if "drowns" in w]


def test_the_limit_is_one_radius():
    """Warned exactly for the models whose expected noise norm exceeds one radius (d > ~1/σ2² = 58
    here)."""
    cal = calibrate(epsilon=0.5, delta=1e-5, rounds=6, restart_every=3, u=1.25, n_min=160,
                    clients=3)
    warned = {d for d in range(1, 200) if noise_warning(cal, d)}
    assert warned == {d for d in range(1, 200) if expected_noise_norm(cal.sigma2,
                                                                      d) > NOISE_RATIO_LIMIT}
    assert min(warned) == 59 and max(warned) == 199


# ------------------------------------------------------------------------------ a loss far above
# x_0's

@pytest.mark.parametrize("final,rises", [(0.2, False), (0.5 * LOSS_RISE_LIMIT, False), (1.0001,
                                                                                        True),
                                         (math.inf, True), (math.nan, True)])
def test_a_loss_more_than_twice_x0s_is_far_above(final, rises):
    history = [{"round": 0, "train_loss": 0.5}, {"round": 1}, {"round": 2, "train_loss": final}]
    rise = loss_rise(history)
    assert (rise is not None) == rises
    if rises:
        assert rise.metric == "train_loss" and rise.initial == 0.5 and rise.ratio > LOSS_RISE_LIMIT


def test_without_train_metrics_the_test_loss_is_compared():
    rise = loss_rise([{"round": 0, "test_loss": 1.0}, {"round": 4, "test_loss": 3.0}])
    assert rise is not None and rise.metric == "test_loss" and rise.ratio == 3.0
    assert loss_rise([{"round": 0}, {"round": 4}]) is None  # nothing evaluated: nothing to say


#: ε = 0.2 with a large step: the noise (6.8 radii per difference round) drives the loss from 0.17
#: to ~1e7.
DIVERGING = {"privacy": {"epsilon": 0.2, "max_sigma": None},
             "training": {"rounds": 30, "learning_rate": 0.5, "clip_diff": 3.0}}


def _run_cli(tmp_path: Path, capsys, cfg: dict) -> tuple[int, dict, str]:
    cfg["output"] = {"dir": str(tmp_path / "out")}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    code = cli.main(["run", str(path), "--engine", "inprocess"])
    captured = capsys.readouterr()
    return code, json.loads(captured.out), captured.err


def test_a_run_that_ends_far_above_x0s_loss_completes_with_a_warning(tmp_path, capsys):
    code, report, err = _run_cli(tmp_path, capsys, _tiny(**DIVERGING))
    summary = json.loads(Path(report["summary_file"]).read_text())
    assert code == 0 and report["status"] == "completed" == summary["status"]
    rise = summary["loss_rise"]
    assert rise["metric"] == "train_loss" and rise["ratio"] > 1e3 and rise[
        "limit"] == LOSS_RISE_LIMIT
    warning = next(w for w in summary["warnings"]
                   if w.startswith("the run completed but made the model worse"))
    assert (f"the final train_loss {rise['final']:.4g} is {rise['ratio']:.3g}× x_0's "
            f"{rise['initial']:.4g}") in warning
    assert warning in report["warnings"] and report["loss_rise"] == rise
    assert f"[diff2] WARNING: {warning}" in err.splitlines()
    assert "[diff2] WARNING: the noise drowns the signal" in err  # said before, too
    block = err[err.index("[diff2] run completed"):]
    assert "  WARNING      train_loss ended at" in block


def test_a_run_that_learns_has_no_such_warning(tmp_path, capsys):
    code, report, err = _run_cli(tmp_path, capsys, _tiny())
    summary = json.loads(Path(report["summary_file"]).read_text())
    assert code == 0 and report["status"] == "completed"
    rows = [json.loads(line)
            for line in (Path(report["output_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["train_loss"] < rows[0]["train_loss"]  # it learned
    assert "loss_rise" not in summary and "loss_rise" not in report
    assert not [w for w in report["warnings"] if "worse" in w or "drowns" in w]
    assert "WARNING      " not in err


def test_the_console_says_each_of_our_lines_once():
    """The pre-flight of `diff2 run` says the shard report and warnings; the ServerApp says them
    again."""
    import io

    stream = io.StringIO()
    console = RunConsole(stream=stream)
    for line in ("[diff2] WARNING: x", "[diff2] shards: iid", "[diff2] WARNING: x",
                 "[diff2] shards: iid"):
        console.feed(line)
    assert stream.getvalue().splitlines() == ["[diff2] WARNING: x", "[diff2] shards: iid"]
