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
                         "training": {"rounds": 6, "restart_every": 3, "clients": 2, "seed": 1, **training},
                         "output": {"dir": str(tmp_path / "out")}}, "pic.yaml")


def test_a_completed_run_writes_curves_png_with_every_quantity(tmp_path):
    server = run_inprocess(_cfg(tmp_path), progress=None)
    run_dir = server.recorder.directory
    assert (run_dir / CURVES_FILE).read_bytes().startswith(PNG)
    assert panels([("pic", read_rows(run_dir))]) == ["loss", "‖∇f(x_r)‖²", "ε spent", "noise std per round",
                                                     "clipping radius"]


def test_a_diverging_run_still_draws_what_it_has(tmp_path):
    from diff2_flwr.runtime.session import Diverged

    with pytest.raises(Diverged):
        run_inprocess(_cfg(tmp_path, learning_rate=1e200, clip_restart=1e200, clip_diff=1e200), progress=None)
    (run_dir,) = (tmp_path / "out").iterdir()
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "diverged"
    assert (run_dir / CURVES_FILE).read_bytes().startswith(PNG)


def test_accuracy_gets_a_panel_and_non_run_folders_are_refused(tmp_path):
    rows = [{"round": 0, "kind": "init", "test_accuracy": 0.1}, {"round": 1, "kind": "restart", "test_accuracy": 0.5}]
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
