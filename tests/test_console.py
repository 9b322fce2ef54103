"""The console of `diff2 run`: Flower's INFO chatter off, ours and real warnings kept, a summary at
the end."""

from __future__ import annotations

import io
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from diff2_flwr import cli
from diff2_flwr.runtime.config import parse_config
from diff2_flwr.runtime.console import (
    RunConsole, parse_round_line, run_report, server_summary_block, verbose_from_env,
)
from diff2_flwr.runtime.driver import run_inprocess

G, Y, R, Z = "\x1b[92m", "\x1b[93m", "\x1b[91m", "\x1b[0m"

# Recorded from `./scripts/run.sh` (Flower 1.42, `flwr run --stream`), shortened; then a Flower
# WARNING and an ERROR with its traceback as Flower prints them.
RECORDED = f"""\
Using SuperLink: diff2-local (127.0.0.1:33221)
Successfully started run 8729234683735617318
{G}INFO {Z}:      Starting logstream for run_id `8729234683735617318`
{G}INFO {Z}:      Starting Flower Simulation
{Y}WARNING {Z}:   Since flwr 1.32, default simulated SuperNodes changed from 10 to 2.
{G}INFO {Z}:      Federation `@none/default` (10 simulated SuperNodes)
{G}INFO {Z}:      To change federation size, use the following command:
{G}INFO {Z}:      \tflwr federation simulation-config @none/default <superlink> --num-supernodes <N>
Successfully installed diff2-flwr to /tmp/diff2-flwr-home-h3nifuez/apps/diff2.diff2-flwr.0.1.0.052076b8.
[diff2] writing per-round metrics and summary to /work/outputs/default-20261130-034432-34788f
[diff2] noise key drawn from OS entropy (no training.seed): the noise is not reproducible.
[diff2] round 0/100 (init) train_loss=0.1243 grad_norm_sq=0.7929 test_loss=0.1239
{G}INFO {Z}:      Starting Flower ServerApp, config: num_rounds=100, no round_timeout
{G}INFO {Z}:      
{G}INFO {Z}:      [INIT]
{G}INFO {Z}:      Using initial global parameters provided by strategy
{G}INFO {Z}:      Starting evaluation of initial global parameters
{G}INFO {Z}:      Evaluation returned no results (`None`)
{G}INFO {Z}:      
{G}INFO {Z}:      [ROUND 1]
/work/.venv/lib/python3.11/site-packages/ray/_private/worker.py:2051: FutureWarning: Tip: In future versions of Ray, Ray will no longer override accelerator visible devices env var if num_gpus=0 or num_gpus=None (default). To enable this behavior and turn off this error message, set RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=0
  warnings.warn(
{G}INFO {Z}:      configure_fit: strategy sampled 10 clients (out of 10)
{G}INFO {Z}:      aggregate_fit: received 10 results and 0 failures
[diff2] round 1/100 (restart) radius=1 noise_std=0.001229 clip_fraction=0.5099 epsilon_spent=0.739 epsilon_pld=0.739 epsilon_rdp=0.809 update_norm=0.1139 train_loss=0.06092 grad_norm_sq=0.06093 test_loss=0.06192
{G}INFO {Z}:      configure_evaluate: no clients selected, skipping evaluation
{G}INFO {Z}:      
{G}INFO {Z}:      [ROUND 2]
{Y}WARNING {Z}:   No fit_metrics_aggregation_fn provided
{G}INFO {Z}:      configure_fit: strategy sampled 10 clients (out of 10)
{G}INFO {Z}:      aggregate_fit: received 10 results and 0 failures
[diff2] round 2/100 (difference) radius=0.3416 noise_std=0.002519 clip_fraction=1 epsilon_spent=0.7502 epsilon_pld=0.7502 epsilon_rdp=0.8211 update_norm=0.05319 train_loss=0.05632 grad_norm_sq=0.025 test_loss=0.05795
{G}INFO {Z}:      configure_evaluate: no clients selected, skipping evaluation
{G}INFO {Z}:      
{G}INFO {Z}:      [SUMMARY]
{G}INFO {Z}:      Run finished 2 round(s) in 39.30s
[36m(ClientAppActor pid=11327)[0m {Y}WARNING {Z}:   Manually terminating ClientAppActor
[36m(ClientAppActor pid=11328)[0m {G}INFO {Z}:      an actor's info line
[36m(ClientAppActor pid=11329)[0m {Y}WARNING {Z}:   an actor's real warning
{R}ERROR {Z}:     ServerApp thread raised an exception: boom
{R}ERROR {Z}:     Traceback (most recent call last):
  File "/work/diff2_flwr/fl/strategy.py", line 71, in configure_fit
    raise error
RuntimeError: boom
"""  # noqa: E501 -- a recorded log, verbatim


def feed(console: RunConsole, text: str) -> None:
    for line in text.splitlines(keepends=True):
        console.feed(line)


def test_flower_info_noise_is_dropped_ours_and_warnings_are_kept():
    out = io.StringIO()
    console = RunConsole(stream=out)
    feed(console, RECORDED)
    console.close()
    lines = out.getvalue().splitlines()
    text = out.getvalue()
    assert "INFO" not in text and "[ROUND" not in text and "configure_evaluate" not in text
    assert "Since flwr 1.32" not in text  # known noise (we always pass num-supernodes)
    # Ray's, and its source line
    assert "FutureWarning" not in text and "warnings.warn(" not in text
    assert "Successfully started run" not in text and "Using SuperLink" not in text
    assert any(line.startswith("[diff2] noise key drawn from OS entropy") for line in lines)
    assert console.output_dir == Path("/work/outputs/default-20261130-034432-34788f")
    # one condensed line per round: ε spent, losses, time
    rounds = [line for line in lines if line.startswith("[diff2] round ")]
    assert len(rounds) == 3
    assert rounds[1].startswith(
        "[diff2] round 1/100 (1 %), restart, ε 0.739, train_loss 0.06092, test_loss 0.06192, ")
    assert "elapsed" in rounds[1] and "radius" not in rounds[1]
    # Flower's warnings and errors (with the traceback) are kept, colours and all
    assert f"{Y}WARNING {Z}:   No fit_metrics_aggregation_fn provided" in lines
    # Ray actor lines, too
    assert "Manually terminating" not in text and "an actor's info line" not in text
    actor = "\x1b[36m(ClientAppActor pid=11329)\x1b[0m"
    assert f"{actor} {Y}WARNING {Z}:   an actor's real warning" in lines
    assert f"{R}ERROR {Z}:     ServerApp thread raised an exception: boom" in lines
    assert '  File "/work/diff2_flwr/fl/strategy.py", line 71, in configure_fit' in lines
    assert lines[-1] == "RuntimeError: boom"
    assert "\r" not in text
    assert console.dropped == 32
    # ours, rounds, two warnings, two error records, the traceback
    assert len(lines) == 2 + 3 + 2 + 2 + 3


def test_the_server_apps_summary_block_is_dropped_for_diff2_runs_own(tmp_path, capsys):
    """The ServerApp ends its log with the run's summary block (for `flwr log`); `diff2 run` prints
    its own from summary.json, so the ServerApp's copy is dropped, its indented lines too, and what
    follows is shown again."""
    assert cli.main(["run", str(_tiny(tmp_path)), "--engine", "inprocess"]) == 0
    run_dir = json.loads(capsys.readouterr().out)["output_dir"]
    block = server_summary_block(run_report(run_dir))
    assert block.startswith("[diff2] summary: run completed: tiny") and "\n  ε spent " in block
    # the ServerApp knows no launch time
    assert "\n  training     " in block and "wall time" not in block
    out = io.StringIO()
    console = RunConsole(stream=out)
    feed(console, f"[diff2] round 6/6 (difference) epsilon_spent=3 "
                  f"train_loss=0.1\n{block}\n{R}ERROR {Z}:     after the block\nTraceback (most "
                  f"recent call last):\n  File \"x.py\", line 1\n")
    console.close()
    lines = out.getvalue().splitlines()
    assert not any("summary: run" in line or "ε spent" in line or "files " in line
                   for line in lines), lines
    assert console.dropped == len(block.splitlines())
    assert lines[-3:] == [f"{R}ERROR {Z}:     after the block",
                          "Traceback (most recent call last):", '  File "x.py", line 1']


def test_the_eta_ignores_the_start_up_paid_by_the_first_round(monkeypatch):
    import diff2_flwr.runtime.progress as progress

    now = [0.0]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: now[0])
    out = io.StringIO()
    console = RunConsole(stream=out)
    rounds = [line for line in RECORDED.splitlines() if line.startswith("[diff2] round ")]
    rounds.append(rounds[-1].replace("round 2/100", "round 3/100"))
    # round 1 comes after 20 s of start-up; rounds 2 and 3 arrive together (Flower relays logs in
    # batches), 4 s later
    for at, line in zip((0.0, 20.0, 24.0, 24.0), rounds):
        now[0] = at
        console.feed(line)
    lines = out.getvalue().splitlines()
    assert lines[0].endswith(", 0 s elapsed, ETA ?")
    assert lines[1].endswith(", 20 s elapsed, ETA ?")
    assert lines[2].endswith(", 24 s elapsed, ETA 392 s")  # 4 s a round, 98 rounds to go
    assert lines[3].endswith(", 24 s elapsed, ETA 194 s")  # 2 s a round, 97 rounds to go
    console = RunConsole(stream=io.StringIO())
    # less than ETA_MEASURE_S of pace: no estimate yet
    for at, line in zip((0.0, 20.0, 21.0), rounds):
        now[0] = at
        console.feed(line)
    assert console.stream.getvalue().splitlines()[2].endswith(", 21 s elapsed, ETA ?")


def test_verbose_keeps_every_line_verbatim():
    out = io.StringIO()
    console = RunConsole(stream=out, verbose=True)
    feed(console, RECORDED)
    console.close()
    assert out.getvalue() == RECORDED
    assert console.dropped == 0


def test_verbose_from_the_environment():
    assert verbose_from_env({"DIFF2_VERBOSE": "1"}) and verbose_from_env({"DIFF2_VERBOSE": "true"})
    assert not verbose_from_env({}) and not verbose_from_env({"DIFF2_VERBOSE": "0"})


def test_cli_verbose_flag_parses():
    args = cli.build_parser().parse_args(["run", "x.yaml", "--verbose"])
    assert args.verbose is True
    assert cli.build_parser().parse_args(["run"]).verbose is False


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_a_live_round_bar_and_lines_above_it(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    tty = _Tty()
    console = RunConsole(stream=tty)
    feed(console, RECORDED)
    console.close()
    text = tty.getvalue()
    # bar + status
    assert "\x1b" in text and "[diff2] round" in text and "2/100" in text and "ε 0.7502" in text
    assert "No fit_metrics_aggregation_fn provided" in text and "INFO" not in text


def _tiny(tmp_path: Path, **training) -> Path:
    cfg = {"name": "tiny", "method": "diff2", "dataset": {"name": "synthetic", "num_samples": 600},
           "training": {"rounds": 6, "restart_every": 3, "clients": 3, "seed": 1, **training},
           "output": {"dir": str(tmp_path / "out")}}
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_round_lines_of_the_server_are_parsed(tmp_path):
    """The console reads the very lines Diff2Server writes (the format lives in
    runtime/session.py)."""
    said: list[str] = []
    run_inprocess(parse_config(yaml.safe_load(_tiny(tmp_path).read_text())), record=False,
                  progress=said.append)
    parsed = [parse_round_line(line) for line in said if line.startswith("[diff2] round ")]
    assert [p[:3] for p in parsed] == [(0, 6, "init"), (1, 6, "restart"), (2, 6, "difference"),
                                       (3, 6, "difference"), (4, 6, "restart"),
                                       (5, 6, "difference"), (6, 6, "difference")]
    assert all({"train_loss", "test_loss"} <= set(p[3]) for p in parsed)
    assert all("epsilon_spent" in p[3] for p in parsed[1:])


def test_end_of_run_summary_has_the_runs_numbers(tmp_path, capsys):
    code = cli.main(["run", str(_tiny(tmp_path)), "--engine", "inprocess"])
    captured = capsys.readouterr()
    assert code == 0
    report = json.loads(captured.out)  # stdout: exactly one JSON object
    run_dir = Path(report["output_dir"])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert report["status"] == "completed" and report["engine"] == "inprocess"
    for key in ("train_loss", "test_loss", "grad_norm_sq"):
        assert report["final"][key] == rows[-1][key]
        assert report["best"][key] == min(r[key] for r in rows)
    assert report["epsilon_spent"] == rows[-1]["epsilon_spent"] == pytest.approx(3.0, rel=1e-9)
    assert report["epsilon_pld"] == summary["privacy"]["epsilon_pld"] == rows[-1]["epsilon_pld"]
    assert "accuracy" not in report["final"]  # regression: no accuracy line
    assert report["wall_time_s"] >= report["training_time_s"] > 0
    err = captured.err
    block = err[err.index("[diff2] run completed"):]
    assert block.startswith("[diff2] run completed: tiny (diff2, P = 3, 6/6 rounds)")
    assert f"train_loss   final {rows[-1]['train_loss']:.4g}" in block
    assert f"best {min(r['train_loss'] for r in rows):.4g}" in block
    assert f"‖∇f‖²        final {rows[-1]['grad_norm_sq']:.4g}" in block
    assert (f"ε spent      {rows[-1]['epsilon_spent']:.4g} exact μ-GDP, "
            f"{rows[-1]['epsilon_pld']:.4g} PLD") in block
    assert "accuracy" not in block
    assert (f"files        {run_dir}: curves.png, final_parameters.npy, metrics.jsonl, "
            f"summary.json") in block
    assert "wall time" in block
    assert len([line for line in err.splitlines() if line.startswith("[diff2] round ")]) == 7


# the step size is absurd on purpose
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_a_run_that_fails_says_so_in_its_summary(tmp_path, capsys):
    code = cli.main(["run", str(_tiny(tmp_path, learning_rate=1e308)), "--engine", "inprocess"])
    captured = capsys.readouterr()
    assert code == 1
    report = json.loads(captured.out)
    # gradients that overflow at a finite iterate: divergence, not a privacy rejection (nothing
    # released)
    assert report["status"] == "diverged" and "check 'gradients' failed" in report["error"]
    # said once (issue 40): in the summary block, from summary.json, not again in a FAILED line
    failed = "Diverged: Round 2 released nothing: check 'gradients' failed"
    assert captured.err.count(failed) == 1 and "[diff2] FAILED" not in captured.err
    assert f"  error        {failed}" in captured.err
    assert "[diff2] run diverged: tiny (diff2, P = 3, 1/6 rounds)" in captured.err


def test_the_summary_shows_accuracy_when_the_run_has_it(tmp_path):
    from diff2_flwr.runtime.console import run_report, summary_block

    (tmp_path / "summary.json").write_text(json.dumps({
        "name": "cls", "method": "dpgd", "status": "completed", "rounds_planned": 2,
        "rounds_released": 2,
        "privacy": {"private": True, "epsilon_spent": 1.5, "epsilon_pld": 1.5004,
                    "epsilon_target": 2.0, "delta": 1e-5},
        "final": {"train_loss": 0.5, "test_loss": 0.6, "grad_norm_sq": 0.1, "accuracy": 0.875,
                  "round": 2},
        "best": {"train_loss": 0.4, "test_loss": 0.55, "grad_norm_sq": 0.05, "accuracy": 0.9},
        "wall_time_s": 3.0, "config": {"training": {"clients": 4}}}))
    block = summary_block(run_report(tmp_path, wall_time_s=5.0))
    assert re.search(r"^  accuracy +final 0\.875 +best 0\.9$", block, re.MULTILINE), block
    assert "ε spent      1.5 exact μ-GDP, 1.5 PLD   (target ε = 2, δ = 1e-05)" in block
    assert not math.isnan(run_report(tmp_path)["epsilon_pld"])


@pytest.mark.flower
def test_diff2_run_console_through_flower_is_short_and_ends_with_the_summary(tmp_path):
    config = _tiny(tmp_path)
    done = subprocess.run([str(Path(sys.executable).with_name("diff2")), "run", str(config)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["status"] == "completed" and report["epsilon_spent"] == pytest.approx(3.0)
    # a string: Flower's run ids exceed JSON readers' exact integers
    assert report["run_id"].isdigit()
    lines = done.stderr.splitlines()
    assert not [line for line in lines if "INFO" in line], lines
    assert len([line for line in lines if line.startswith("[diff2] round ")]) == 7
    head = [i for i, line in enumerate(lines) if line.startswith("[diff2] run completed: ")]
    assert len(head) == 1 and lines[head[0]].startswith(
        "[diff2] run completed: tiny (diff2, P = 3, 6/6 rounds), "
                                                        f"Flower run {report['run_id']}")
    assert lines[-1].startswith(f"  files        {report['output_dir']}: ")
    assert len(lines) <= 20, lines


#: Each regime's settings, and the accountants its summaries must name: (ε spent, cross-check).
REGIMES = {
    "central exact": ({}, ("exact μ-GDP", "PLD"), ""),
    "central rdp": ({"privacy.mode": "rdp"}, ("exact μ-GDP", "PLD"),
                    " (σ calibrated by zCDP: privacy.mode rdp)"),
    "local routine": ({"local.steps": 2, "local.batch_size": 16}, ("PLD", None), ""),
    "distributed": ({"privacy.noise": "distributed"}, ("Skellam RDP", None), ""),
}


@pytest.mark.parametrize("regime", sorted(REGIMES))
def test_every_summary_names_the_accountant_its_run_used(tmp_path, capsys, regime):
    """summary.json, the end-of-run block (diff2 run's and the ServerApp's) and curves.png's legend
    name the accountant that computed ε, with no unexplained figure (issue 40: a distributed run was
    "ε spent 3 exact μ-GDP, - PLD")."""
    from diff2_flwr.runtime.curves import epsilon_series

    overrides, (spent, cross), note = REGIMES[regime]
    sets = [f"{key}={value}" for key, value in overrides.items()]
    code = cli.main(["run", str(_tiny(tmp_path)), "--engine", "inprocess",
                     *(["--set", *sets] if sets else [])])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    run_dir = Path(json.loads(captured.out)["output_dir"])
    privacy = json.loads((run_dir / "summary.json").read_text())["privacy"]
    assert privacy["accountant"] == spent
    eps = _fmt_g(privacy["epsilon_spent"])
    line = f"ε spent      {eps} {spent}" + (
        f", {_fmt_g(privacy['epsilon_pld'])} {cross}" if cross else "") + note + "   (target ε = 3"
    for block in (captured.err, server_summary_block(run_report(run_dir))):
        (shown,) = [text for text in block.splitlines() if "ε spent" in text]
        assert shown.strip().startswith(line), shown
        assert " - " not in shown and ("μ-GDP" in shown) == (spent == "exact μ-GDP"), shown
    legends = [legend for _, legend in epsilon_series(privacy)]
    assert legends == [spent] + ([cross] if cross else [])
    # curves.png drawn with them (a drawing failure would only warn)
    assert (run_dir / "curves.png").is_file() and "curves.png not drawn" not in captured.err
    if cross is None:  # the summary says why there is no separate PLD figure
        assert privacy.get("epsilon_pld_accountant")


def _fmt_g(value: float) -> str:
    return f"{value:.4g}"
