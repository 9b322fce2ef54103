"""`diff2 bench`'s jax_peer section: the skip path, the flags' way into the plan, and the
bookkeeping (order of the timed calls, medians, ratios) with stand-in timers. A real run against JAX
only where an interpreter with jax is found (never in CI)."""

from __future__ import annotations

import json
import os
import re
import sys

import pytest

from diff2_flwr.cli import build_parser, main
from diff2_flwr.lab.bench import runner as bench
from diff2_flwr.lab.bench.jax_cells import (DEFAULT_ROUNDS, SKIPPED, TARGET, Cell, find_jax_python,
                                            measure, parse_cells,
                                      plan_jax_peer, run_jax_peer, schedule, summarise)


@pytest.fixture
def no_jax(monkeypatch):
    """jax importable nowhere: not in this interpreter (an import of it fails), no
    DIFF2_JAX_PYTHON."""
    monkeypatch.setitem(sys.modules, "jax", None)
    monkeypatch.delenv("DIFF2_JAX_PYTHON", raising=False)


@pytest.fixture
def light_bench(monkeypatch):
    """run_bench without its own measurements (the matmul floor, the engine's rounds/s and the
    models section, whose own tests are tests/test_bench_models.py)."""
    monkeypatch.setattr(bench, "_matmul_gflops", lambda dtype, threads: 1.0)
    monkeypatch.setattr(bench, "_rounds_per_s", lambda data_dir,
                        rounds: {"diff2_rounds_per_s": 1.0})
    monkeypatch.setattr(bench, "models_section", lambda *, n, batch, progress: {
        "options": {"n": n, "batch": batch}})


def test_without_jax_the_section_is_skipped_with_one_stderr_line(no_jax, light_bench, capsys):
    with pytest.raises(ImportError):
        import jax  # noqa: F401
    assert main(["bench", "--skip-protocol", "--skip-flower"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["jax_peer"] == {"skipped": SKIPPED}
    assert SKIPPED == "jax is not importable (pip install jax jaxlib, or --jax-python PATH)"
    assert err.splitlines() == [f"[diff2 bench] jax_peer skipped: {SKIPPED}"]


def test_skip_jax_leaves_the_section_out(no_jax, light_bench, capsys):
    assert main(["bench", "--skip-protocol", "--skip-flower", "--skip-jax"]) == 0
    out, err = capsys.readouterr()
    assert "jax_peer" not in json.loads(out) and err == ""


def test_the_models_section_takes_its_flags_and_skip_models_leaves_it_out(no_jax, light_bench,
                                                                          capsys):
    assert main(["bench", "--skip-protocol", "--skip-flower", "--skip-jax",
                 "--models-records", "64", "--models-batch", "16"]) == 0
    options = json.loads(capsys.readouterr().out)["models"]["options"]
    assert options["n"] == 64 and options["batch"] == 16 and callable(bench.models_section)
    assert main(["bench", "--skip-protocol", "--skip-flower", "--skip-jax", "--skip-models"]) == 0
    assert "models" not in json.loads(capsys.readouterr().out)


def test_the_flags_reach_the_plan(monkeypatch):
    seen = {}
    monkeypatch.setattr(bench, "run_bench", lambda **kw: seen.update(kw) or {})
    monkeypatch.setenv("DIFF2_JAX_PYTHON", "/nowhere/python")  # the flag wins over the variable
    argv = ["bench", "--jax-python", sys.executable, "--jax-reps", "3", "--jax-cells",
            "diff2:18:f64, dpgd:1:f32",
            "--jax-rounds", "50,5", "--jax-eager", "--skip-protocol", "--flower-clients", "40",
            "--flower-rate", "0.1"]
    args = build_parser().parse_args(argv)
    assert (args.jax_python, args.jax_reps, args.jax_cells, args.jax_rounds, args.jax_eager,
            args.skip_jax) == \
        (sys.executable, 3, "diff2:18:f64, dpgd:1:f32", "50,5", True, False)
    assert main(argv) == 0
    plan = seen["jax_peer"]
    assert plan.python == sys.executable and plan.reps == 3 and plan.eager
    assert plan.cells == (Cell("dpgd", 1, "f32"), Cell("diff2", 18, "f64"))  # in the table's order
    assert dict(plan.rounds) == {1: 50, 18: 5}
    assert seen["protocol"] is False and seen["flower"] is True and callable(seen["progress"])
    assert (seen["flower_clients"], seen["flower_rate"]) == (40, 0.1)


def test_defaults_and_the_variable(monkeypatch, no_jax):
    sub = build_parser()._subparsers._group_actions[0].choices["bench"]
    help_text = next(a.help for a in sub._actions if a.dest == "jax_rounds")
    # the help names the real default
    assert f"default: {DEFAULT_ROUNDS[1]},{DEFAULT_ROUNDS[18]}" in help_text
    plan = plan_jax_peer()
    assert plan.python is None and plan.reps == 2 and len(plan.cells) == 8 and not plan.eager
    monkeypatch.setenv("DIFF2_JAX_PYTHON", sys.executable)
    assert find_jax_python(None) == sys.executable


@pytest.mark.parametrize("flags, message", [
    (["--jax-cells", "dpgd:2:f32"],
     r"--jax-cells: dpgd:2:f32 is not a cell\. Give a comma-separated list of "
                                    r"dpgd:1:f32, .*diff2:18:f64, or all"),
    (["--jax-reps", "0"], r"--jax-reps must be at least 1\. Found 0\."),
    (["--jax-rounds", "100"], r"--jax-rounds: expected two integers ≥ 2, 'R1,R18' .* found '100'"),
    (["--jax-rounds", "100,1"], r"--jax-rounds: .* found '100,1'"),
    (["--flower-clients", "1"], r"--flower-clients`: expected an integer >= 2\. Found 1\."),
    (["--flower-rate", "0"], r"--flower-rate`: expected a rate in \(0, 1\]\. Found 0\.0\."),
    (["--flower-rate", "1.5"], r"--flower-rate`: expected a rate in \(0, 1\]\. Found 1\.5\."),
    (["--jax-python", "/no/such/python"],
     r"--jax-python: '/no/such/python' is not an executable file\. Give a "
                                          r"Python interpreter that has jax"),
])
def test_bad_flags_fail_before_anything_is_measured(monkeypatch, capsys, flags, message):
    monkeypatch.setattr(bench, "run_bench", lambda **kw: pytest.fail("measured despite a bad flag"))
    assert main(["bench", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("diff2 bench: error: ")
    assert re.search(message, err), err


def test_a_bad_variable_is_named(monkeypatch):
    # a folder, not an interpreter
    monkeypatch.setenv("DIFF2_JAX_PYTHON", os.path.dirname(sys.executable))
    with pytest.raises(FileNotFoundError, match="DIFF2_JAX_PYTHON: .* is not an executable file"):
        plan_jax_peer()


def test_the_schedule_interleaves_abc_then_cba():
    a, b = Cell("dpgd", 1, "f32"), Cell("diff2", 18, "f64")
    plan = schedule([a, b], reps=3)
    k1 = ["project", "backend_floor", "jax_vmap", "jax_ghost"]
    k18 = ["project", "backend_floor", "jax_vmap", "jax_ghost", "jax_ghost_map"]
    assert plan == ([(0, a, s) for s in k1] + [(0, b, s) for s in k18] + [(1, a,
                                                                           s) for s in k1[::-1]]
                    + [(1, b, s) for s in k18[::-1]] + [(2, a, s) for s in k1] + [(2, b,
                                                                                   s) for s in k18])
    assert [s for _, c, s in schedule([a], reps=1, eager=True)] == ["project", "project_eager",
                                                                    "backend_floor", "jax_vmap",
                                                                    "jax_ghost"]


def test_medians_and_ratios_from_stand_in_timers():
    """Seconds per call from a table, each side's repetitions with one outlier: the rates are R /
    median (a mean or the first call would differ), the best JAX is the fastest, and the ratios
    point the right way."""
    fast, slow = Cell("dpgd", 1, "f32"), Cell("diff2", 18, "f64")
    R = {1: 100, 18: 10}
    seconds = {  # per (side, cell): one value per repetition
        ("project", fast): [1.0, 9.0, 0.8], ("jax_vmap", fast): [4.0, 4.0, 30.0],
        ("jax_ghost", fast): [2.0, 2.5, 1.5], ("project", slow): [3.0, 3.0, 0.1],
        ("jax_vmap", slow): [9.0, 8.0, 7.0], ("jax_ghost", slow): [2.0, 2.0, 2.0],
        ("jax_ghost_map", slow): [1.0, 50.0, 1.0],
        ("backend_floor", fast): [0.5, 0.4, 7.0], ("backend_floor", slow): [1.0, 1.2, 0.9],
    }
    # the project's 1-round call after each
    one_round = {fast: [0.2, 0.1, 0.1], slow: [0.5, 0.5, 0.5]}
    calls = []

    def run_one(cell, side):
        i = sum(1 for c, s in calls if (c, s) == (cell, side))
        calls.append((cell, side))
        return seconds[side, cell][i], (one_round[cell][i] if side == "project" else None)

    plan = schedule([fast, slow], reps=3)
    lines = []
    times = measure(plan, run_one, lines.append)
    assert calls == [(c, s) for _, c, s in plan] and len(lines) == 3
    table = summarise([fast, slow], times, R)

    row = table["dpgd:1:f32"]
    assert row["project_rounds_per_s"] == pytest.approx(100 / 1.0)
    assert row["jax_vmap_rounds_per_s"] == pytest.approx(100 / 4.0)
    assert row["jax_ghost_rounds_per_s"] == pytest.approx(100 / 2.0)
    assert row["best_jax"] == "jax_ghost"
    # median of t_R - t_1: 0.8, 8.9, 0.7
    assert row["project_marginal_rounds_per_s"] == pytest.approx(99 / 0.8)
    # the ratios use the marginal rate
    assert row["project_over_best_jax"] == pytest.approx(99 / 0.8 / 50)
    assert row["best_jax_over_project"] == pytest.approx(50 / (99 / 0.8))
    # whole calls: twice as fast
    assert row["project_over_best_jax_whole_calls"] == pytest.approx(2.0)
    assert row["meets_target"] is True and row["target"] == TARGET == 1.5
    assert "jax_ghost_map_rounds_per_s" not in row
    # the backend floor: R / median 0.5 = 200 rounds/s against the best JAX's 50
    assert row["backend_floor_rounds_per_s"] == pytest.approx(200)
    assert row["backend_floor_over_best_jax"] == pytest.approx(4.0)
    assert row["floor_allows_target"] is True

    row = table["diff2:18:f64"]
    assert row["project_rounds_per_s"] == pytest.approx(10 / 3.0)
    assert row["best_jax"] == "jax_ghost_map" and row[
        "jax_ghost_map_rounds_per_s"] == pytest.approx(10 / 1.0)
    # t_R - t_1: 2.5, 2.5, -0.4
    assert row["project_marginal_rounds_per_s"] == pytest.approx(9 / 2.5)
    assert row["best_jax_over_project"] == pytest.approx(10 / 3.6)  # JAX faster
    assert row["project_over_best_jax"] == pytest.approx(0.36)
    assert row["project_over_best_jax_whole_calls"] == pytest.approx(1 / 3)
    assert row["meets_target"] is False
    # floor: 10 / 1.0 rounds/s, the best JAX's 10: even the backend alone misses 1.5x
    assert row["backend_floor_over_best_jax"] == pytest.approx(1.0)
    assert row["floor_allows_target"] is False


def test_a_cell_just_under_the_target_misses_it():
    cell = Cell("dpgd", 1, "f64")
    times = {("project", cell): [(1.0, 0.1)], ("jax_vmap", cell): [(5.0, None)],
             ("jax_ghost", cell): [(1.49, None)], ("backend_floor", cell): [(0.99, None)]}
    row = summarise([cell], times, {1: 10, 18: 10})["dpgd:1:f64"]
    # 10 / (10 / 1.49)
    assert row["project_over_best_jax"] == pytest.approx(1.49) and row["meets_target"] is False


def test_parse_cells_keeps_the_tables_order():
    assert [c.name for c in parse_cells("diff2:1:f32,dpgd:18:f64")] == ["dpgd:18:f64",
                                                                        "diff2:1:f32"]
    assert len(parse_cells("all")) == len(parse_cells(None)) == 8


def test_a_real_run_against_jax(data_dir):
    """Where an interpreter with jax is found (this one, or DIFF2_JAX_PYTHON): one cell, a few
    rounds, one repetition, through the real subprocess; the sides agree and the ratios are each
    other's inverse."""
    python = find_jax_python(None)
    if python is None:
        pytest.skip(SKIPPED)
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    plan = plan_jax_peer(jax_python=python, reps=1, cells="dpgd:1:f64", rounds="4,2")
    lines = []
    result = run_jax_peer(plan, data_dir=str(data_dir), progress=lines.append)
    row = result["cells"]["dpgd:1:f64"]
    assert row["project_rounds_per_s"] > 0 and row["jax_vmap_rounds_per_s"] > 0 and row[
        "jax_ghost_rounds_per_s"] > 0
    assert row["project_over_best_jax"] * row["best_jax_over_project"] == pytest.approx(1.0)
    # the backend floor was timed on the same cell: a rate, and its verdict against the target
    assert row["backend_floor_rounds_per_s"] > 0
    assert row["floor_allows_target"] is (row["backend_floor_over_best_jax"] >= 1.5)
    agreement = row["agreement"]
    assert agreement["agrees"], agreement
    assert 0 < agreement["clipped_fraction_run0"] <= 1  # the check exercises the clip
    assert row["warm"]["jax_ghost_compile_s"] > 0 and row["warm"]["project_first_call_s"] > 0
    assert row["diverged"] == {}  # 4 rounds from the project's x_0: no side loses a run
    assert any("repetition 1 done" in line for line in lines)
    # the same adversarial rows through both sides' clipping: none of the project's is outside
    assert set(result["clipping"]) == {"dpgd:f32", "dpgd:f64", "diff2:f32", "diff2:f64"}
    for check in result["clipping"].values():
        assert check["project"]["outside"] == 0 and check["project"]["checked"] > 600
        assert check["peer"]["checked"] == check["project"]["checked"]
    if affinity is not None:
        assert os.sched_getaffinity(0) == affinity  # unpinned again


def _floor_study(tmp_path, workers: int):
    from diff2_flwr.lab.study.runner import load_study

    path = tmp_path / "floor.yaml"
    path.write_text(json.dumps({
        "name": "floor", "dataset": {"name": "synthetic", "num_samples": 200}, "clients": 2,
        "rounds": 300,
        "delta": 1e-5, "epsilons": [3.0], "seeds": {"tune": [7, 8], "evaluate": [1, 2, 3]},
        "engine": "batch", "analysis": {"protocol": "paper"},
        "workers": workers,
        "methods": [{"name": "DP-GD", "method": "dpgd", "grid": {"learning_rate": [0.1, 0.2, 0.4],
                                                                 "clip_restart": [1.0]}},
                    {"name": "DIFF2", "method": "diff2", "grid": {"restart_every": [4, 8],
                                                                  "learning_rate": [0.2],
                                                                 "clip_restart": [1.0],
                                                                 "clip_diff": [0.5, 1.0]}}]}))
    return load_study(path)


def test_the_first_layer_floor_counts_the_studys_fewest_runs_at_the_float64_peak(tmp_path):
    study = _floor_study(tmp_path, workers=2)
    floor = bench.first_layer_floor(study, records=10_000, features=50, hidden=10,
                                    float64_gflops_1_thread=20.0, cores=8)
    # tuning: (3 + 2·2 points) × 2 seeds; evaluation: 2 methods × 3 seeds
    runs = (3 + 4) * 2 + 2 * 3
    flop = 2 * 10 * 50 * 10_000
    assert floor["runs_at_least"] == runs and floor["cores"] == 2 and floor["rounds"] == 300
    assert floor["floor_s"] == pytest.approx(runs * 300 * flop / (20e9 * 2), rel=1e-12)
    assert floor["budget_ms_per_configuration_round"] == pytest.approx(1800 * 2 / (
        runs * 300) * 1e3, rel=1e-12)
    # one core: the workers cannot use more cores than the machine has
    one = bench.first_layer_floor(_floor_study(tmp_path, workers=4), 10_000, 50, 10, 20.0, cores=1)
    assert one["cores"] == 1 and one["floor_s"] == pytest.approx(2 * floor["floor_s"], rel=1e-12)


def test_the_kdd_floor_is_skipped_with_the_files_name_without_the_data(tmp_path):
    out = bench._kdd_floor(str(tmp_path), 20.0)
    assert set(out) == {"skipped"} and "kddcup.data_10_percent" in out["skipped"] and str(
        tmp_path) in out["skipped"]


@pytest.mark.realdata  # reads the whole KDD Cup 99 10 % file (≈ 12 s)
def test_the_kdd_floor_reads_the_full_data(data_dir):
    if not (data_dir / "kddcup99").is_dir():
        pytest.skip("no KDD Cup 99 beside the other datasets")
    floor = bench._kdd_floor(str(data_dir), 30.0)
    # 395,217 training records of 118 encoded features, the paper MLP's 10 hidden units; 52 tuning
    # configurations on one seed and 6 methods on 5 evaluation seeds, 2,000 rounds, two workers
    assert (floor["records"], floor["features"], floor["hidden"], floor["runs_at_least"],
            floor["cores"]) == \
        (395_217, 118, 10, 82, min(2, os.cpu_count() or 1))
    assert floor["float64_sums_gflop_per_configuration_round"] == pytest.approx(
        2 * 10 * 118 * 395_217 / 1e9)


@pytest.mark.flower
def test_the_sampled_federation_runs_both_apps_through_flwr_run():
    # issue 44, item 6, small: DIFF2 with Poisson sampling on 24 SuperNodes against the floor app's
    # FedAvg over a cohort of the same expected size, both through `flwr run`
    out = bench._flower_sampled(24, 0.25, 4)
    assert (out["clients"], out["rate"], out["rounds"], out["floor_cohort"]) == (24, 0.25, 4, 6)
    assert 0 <= out["mean_cohort"] <= 24
    assert out["round_s"] > 0 and out["floor_round_s"] > 0
    assert out["ratio"] == pytest.approx(out["round_s"] / out["floor_round_s"])
    assert out["first_round_end_s"] > 0 and out["floor_first_round_end_s"] > 0
