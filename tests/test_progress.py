"""Progress on stderr: a live bar only on a terminal, plain periodic lines in a log."""

from __future__ import annotations

import io
import re

from diff2_flwr.lab.study.runner import parse_study, run_study
from diff2_flwr.runtime.progress import ProgressReporter


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_not_a_terminal_gets_plain_lines_and_no_carriage_return():
    log = io.StringIO()
    progress = ProgressReporter(4, label="runs", stream=log, interval_s=3600)
    assert not progress.is_live
    for done in range(1, 5):
        progress.update(done)
    progress.finish()
    text = log.getvalue()
    assert "\r" not in text and "\x1b" not in text
    lines = text.splitlines()
    # the first update and the completion, not every update (interval 1 h)
    assert len(lines) == 2, lines
    assert re.fullmatch(r"\[diff2\] runs 1/4 \(25 %\), \d+ s elapsed, ETA \d+ s", lines[0])
    assert lines[-1].startswith("[diff2] runs 4/4 (100 %)")


def test_a_job_that_ends_short_says_where_it_stopped():
    log = io.StringIO()
    progress = ProgressReporter(10, stream=log, interval_s=3600)
    progress.update(1)
    progress.update(3)
    progress.finish()
    assert log.getvalue().splitlines()[-1].startswith("[diff2] runs 3/10 (30 %)")


def test_a_terminal_gets_a_live_bar():
    tty = _Tty()
    progress = ProgressReporter(4, stream=tty)
    assert progress.is_live
    for done in range(1, 5):
        progress.update(done)
    progress.finish()
    assert "4/4" in tty.getvalue() and "\x1b" in tty.getvalue()


def test_disabled_writes_nothing():
    log = io.StringIO()
    progress = ProgressReporter(4, stream=log, enabled=False)
    progress.update(4)
    progress.finish()
    assert log.getvalue() == ""


def test_a_study_logs_plain_lines_when_stderr_is_not_a_terminal(tmp_path, capsys):
    data = {"name": "tiny", "dataset": {"name": "synthetic", "num_samples": 300}, "clients": 2,
            "rounds": 3,
            "epsilons": [3.0], "eval_every": 1, "seeds": {"tune": [9], "evaluate": [1, 2]},
            "analysis": {"protocol": "paper"},
            "methods": [{"name": "DP-GD", "method": "dpgd", "grid": {"learning_rate": [0.2, 0.4]}}]}
    run_study(parse_study(data, "s.yaml"), output_root=tmp_path, show_progress=True,
              make_plots=False)
    err = capsys.readouterr().err
    assert "\r" not in err
    runs = [line for line in err.splitlines() if line.startswith("[diff2] runs ")]
    assert runs and runs[-1].startswith("[diff2] runs 6/6 (100 %)"), runs


def test_a_studys_total_never_goes_down(tmp_path, monkeypatch):
    """The smallest study that used to make the total fall: 2 grid points on 3 tuning seeds plus
    both criteria's picks on 2 evaluation seeds plan 6 + 4 = 10 runs; the edge pick extends the grid
    (+3 runs: 13), then both criteria pick one point (its 2 evaluation runs serve both). The total
    only grows (10, then 13; it used to fall to 11) and the study ends 13/13; run again, every run
    is reused and it ends 13/13 too."""
    import diff2_flwr.lab.study.scheduler as study_module

    seen: list[tuple[float, float]] = []

    class Spy(ProgressReporter):
        def update(self, done, status=None):
            seen.append((self.total, done))
            super().update(done, status)

    monkeypatch.setattr(study_module, "ProgressReporter", Spy)
    data = {"name": "tiny", "dataset": {"name": "synthetic", "num_samples": 300}, "clients": 2,
            "rounds": 3,
            "epsilons": [3.0], "eval_every": 1, "seeds": {"tune": [9, 10, 11], "evaluate": [1, 2]},
            "methods": [{"name": "DP-GD", "method": "dpgd", "grid": {"learning_rate": [0.2, 0.4]}}]}
    summary = run_study(parse_study(data, "s.yaml"), output_root=tmp_path, show_progress=False,
                        make_plots=False)
    method = summary["epsilons"]["3.0"]["methods"]["DP-GD"]
    assert len(method["extensions"]) == 1 and method["points_tuned"] == 3
    assert method["criteria"]["train_loss"]["point"] == method["criteria"]["grad_norm_sq"]["point"]
    assert len(list((tmp_path / "tiny" / "runs").glob("*.json"))) == 9 + 2
    totals, done = [t for t, _ in seen], [d for _, d in seen]
    assert totals[0] == 10 and set(totals) == {10, 13} and totals == sorted(totals)
    assert done == sorted(done) and seen[-1] == (13, 13)
    seen.clear()
    again = run_study(parse_study(data, "s.yaml"), output_root=tmp_path, show_progress=False,
                      make_plots=False)
    assert again["execution"]["runs_reused"] == 11
    assert [t for t, _ in seen] == sorted(t for t, _ in seen) and seen[-1] == (13, 13)
