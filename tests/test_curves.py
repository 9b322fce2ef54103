"""Pictures of runs: curves.png in every run folder (completed or failed) and `diff2 plot`."""

from __future__ import annotations

import json

import pytest

from diff2_flwr.cli import main
from diff2_flwr.runtime.config import parse_config
from diff2_flwr.runtime.curves import CURVES_FILE, panels, read_rows
from diff2_flwr.runtime.driver import run_inprocess

PNG = b"\x89PNG\r\n\x1a\n"


def _cfg(tmp_path, **training):
    return parse_config({"name": "pic", "dataset": {"name": "synthetic", "num_samples": 300},
                         "training": {"rounds": 6, "restart_every": 3, "clients": 2, "seed": 1,
                                      **training},
                         "output": {"dir": str(tmp_path / "out")}}, "pic.yaml")


def test_a_completed_run_writes_curves_png_with_every_quantity(tmp_path):
    server = run_inprocess(_cfg(tmp_path), progress=None)
    run_dir = server.recorder.directory
    assert (run_dir / CURVES_FILE).read_bytes().startswith(PNG)
    assert panels([("pic", read_rows(run_dir))]) == ["loss", "‖∇f(x_r)‖²", "ε spent",
                                                     "noise std per round",
                                                     "clipping radius"]


def test_a_diverging_run_still_draws_what_it_has(tmp_path):
    from diff2_flwr.runtime.session import Diverged

    with pytest.raises(Diverged):
        run_inprocess(_cfg(tmp_path, learning_rate=1e200, clip_restart=1e200, clip_diff=1e200),
                      progress=None)
    (run_dir,) = (tmp_path / "out").iterdir()
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "diverged"
    assert (run_dir / CURVES_FILE).read_bytes().startswith(PNG)


def test_accuracy_gets_a_panel_and_non_run_folders_are_refused(tmp_path):
    rows = [{"round": 0, "kind": "init", "test_accuracy": 0.1}, {"round": 1, "kind": "restart",
                                                                 "test_accuracy": 0.5}]
    assert panels([("a", rows)]) == ["accuracy"]
    with pytest.raises(FileNotFoundError, match="is not a run folder: it has no metrics.jsonl"):
        read_rows(tmp_path)


def test_diff2_plot_draws_several_runs_side_by_side(tmp_path, capsys):
    a = run_inprocess(_cfg(tmp_path), progress=None).recorder.directory
    b = run_inprocess(_cfg(tmp_path, learning_rate=0.5), progress=None).recorder.directory
    out = tmp_path / "both.png"
    assert main(["plot", str(a), str(b), "--out", str(out), "--title", "two"]) == 0
    assert capsys.readouterr().out.strip() == str(out) and out.read_bytes().startswith(PNG)
    assert main(["plot", str(tmp_path)]) == 2
    assert "is not a run folder" in capsys.readouterr().err


def _fake_run(root, folder, config=None, summary=None):
    """A run folder with one row and a summary.json (a YAML run's: its config; a Python API run's:
    ``summary``)."""
    run_dir = root / folder
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text(json.dumps({"round": 0, "kind": "init",
                                                       "train_loss": 1.0}) + "\n")
    if config is not None:
        summary = {"name": config.name, "method": config.method, "config": config.to_dict()}
    if summary is not None:
        (run_dir / "summary.json").write_text(json.dumps(summary))
    return run_dir


def test_diff2_plot_labels_runs_by_what_differs_between_them(tmp_path, monkeypatch):
    """ε 5 and ε 8 are told apart by ε (not by the folder's hex id); method, T and η likewise, named
    briefly and in that order; runs alike in everything get their folder's id; a folder without a
    summary keeps its name."""
    from diff2_flwr.runtime import curves

    def cfg(changes=None):
        data = {"name": "same", "privacy": {"epsilon": 5.0}, "training": {"restart_every": 4}}
        for key, value in (changes or {}).items():
            *sections, leaf = key.split(".")
            node = data
            for section in sections:
                node = node.setdefault(section, {})
            node[leaf] = value
        return parse_config(data, "x.yaml")

    eps5 = _fake_run(tmp_path, "same-20261201-000000-aaaaaa", cfg())
    eps8 = _fake_run(tmp_path, "same-20261201-000001-bbbbbb", cfg({"privacy.epsilon": 8.0}))
    assert curves.run_labels([eps5, eps8]) == ["ε=5", "ε=8"]
    other = _fake_run(tmp_path, "same-20261201-000002-cccccc",
                      cfg({"training.restart_every": 1, "training.learning_rate": 0.5,
                           "method": "dpgd"}))
    assert curves.run_labels([eps5, other]) == ["diff2, T=4, η=0.25", "dpgd, T=1, η=0.5"]
    twin = _fake_run(tmp_path, "same-20261201-000003-dddddd", cfg())
    assert curves.run_labels([eps5, twin, eps8]) == ["ε=5 aaaaaa", "ε=5 dddddd", "ε=8"]
    assert curves.run_labels([eps5, twin]) == ["same (diff2) aaaaaa", "same (diff2) dddddd"]
    bare = _fake_run(tmp_path, "not-a-yaml-run")
    assert curves.run_labels([eps5, eps8, bare]) == ["ε=5", "ε=8", "not-a-yaml-run"]
    api = _fake_run(tmp_path, "diff2-20261201-000004-eeeeee", summary={
        "name": "diff2", "method": "diff2", "routine": {"name": "gd", "learning_rate": 0.25},
        "privacy": {"calibration": {"epsilon": 8.0, "delta": 1e-5, "rounds": 20, "restart_every": 4,
                                    "clients": 2}}})
    # the API run's summary read into the same keys
    assert curves.run_labels([eps8, api])[1] == "R=20, P=2"
    seen = []
    monkeypatch.setattr(curves, "plot_runs", lambda runs, out, title=None,
                        privacy=None: seen.append([r[0] for r in runs]) or out)
    assert main(["plot", str(eps5), str(eps8), "--out", str(tmp_path / "two.png")]) == 0
    assert seen == [["ε=5", "ε=8"]]


def test_the_epsilon_legends_of_a_summary_written_before_privacy_accountant():
    """Run folders written before the summary named its accountant are read from its other fields;
    a folder without a summary names the row keys, not an accountant it cannot know."""
    from diff2_flwr.runtime.curves import epsilon_series

    assert epsilon_series({"private": True, "epsilon_accountant": "exact μ-GDP composition"}) == (
        ("epsilon_spent", "exact μ-GDP"), ("epsilon_pld", "PLD"))
    assert epsilon_series({"private": True, "epsilon_accountant": "dp-accounting PLD (local "
                                                                  "steps: ...)"}) == (
        ("epsilon_spent", "PLD"),)
    assert epsilon_series({"private": True, "noise": "distributed"}) == (
        ("epsilon_spent", "Skellam RDP"),)
    assert epsilon_series(None) == (("epsilon_spent", "epsilon_spent"),
                                    ("epsilon_pld", "epsilon_pld"))
