"""The regime map (`diff2 regime`): cells from study summaries, ratios, significance marks, the fitted slope.

Hand-made summaries whose ratios and p-values are known check the marks, the ratios and the fit (exactly
constructed data); a tiny real family (synthetic data, 2 n × 2 ε, through ``run_study``) checks that the
map reads what the studies wrote; the CLI prints one JSON object.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from diff2_flwr.cli import main
from diff2_flwr.lab.regime import (MARK_BETTER, MARK_WORSE, THEORY_SLOPE, RegimeError, cells_from_summary, fit_slope,
                                   mark, read_cells, regime_map, write_regime)
from diff2_flwr.lab.study import CRITERIA, paired_one_sided_ttest, parse_study, run_study


def _summary(dataset: str, n: int, d: int, cells: dict[float, tuple[dict, dict, dict]], *, tests: bool = True,
             extra_diff2: bool = False) -> dict:
    """A summary.json as run_study writes it, reduced to what the map reads: per ε the two methods' mean
    minima per criterion (diff2, control) and the one-sided p-values."""
    out = {"dataset": {"name": dataset, "train": n, "parameters": d, "test": 100}, "epsilons": {}}
    for eps, (diff2, control, p) in cells.items():
        methods = {"DP-GD": {"base_method": "dpgd", "grid": {"learning_rate": [0.5, 1.0, 2.0]}, "criteria": {
                       c: {"min_mean": control[c], "point": {"learning_rate": 1.0}, "run_ids": [f"ctrl-{eps}-{c}"]}
                       for c in CRITERIA}},
                   "DIFF2-GD": {"base_method": "diff2", "grid": {"learning_rate": [0.25, 0.5], "clip_diff": [1.0]},
                                "criteria": {
                       c: {"min_mean": diff2[c], "point": {"learning_rate": 0.5, "clip_diff": 1.0},
                           "run_ids": [f"d2-{eps}-{c}"]} for c in CRITERIA}}}
        if extra_diff2:
            methods["DIFF2-GD (T=6)"] = methods["DIFF2-GD"]
        out["epsilons"][str(eps)] = {"methods": methods, "tests": {
            "DIFF2-GD vs DP-GD": {c: {"p_value": p[c]} for c in CRITERIA}} if tests else {}}
    return out


def _same(value: float) -> dict:
    return {c: value for c in CRITERIA}


def test_marks_follow_the_one_sided_p_value_and_its_reverse():
    assert mark(0.01) == MARK_BETTER and mark(0.0499) == MARK_BETTER
    assert mark(0.99) == MARK_WORSE and mark(0.9501) == MARK_WORSE  # reverse p' = 1 − p = 0.0499
    assert mark(0.05) == "" and mark(0.5) == "" and mark(0.95) == "" and mark(math.nan) == ""
    assert mark(0.09, alpha=0.1) == MARK_BETTER and mark(0.09) == ""


def test_cells_ratios_and_marks_of_hand_made_summaries():
    summary = _summary("toy", 1000, 100, {
        2.0: ({"train_loss": 1.0, "grad_norm_sq": 3e-5, "test_loss": 2.0},
              {"train_loss": 2.0, "grad_norm_sq": 1e-5, "test_loss": 2.0},
              {"train_loss": 0.01, "grad_norm_sq": 0.995, "test_loss": 0.5}),
        8.0: (_same(1.0), _same(4.0), _same(math.nan))})
    cells = cells_from_summary(summary, "toy.json")
    assert [(c.dataset, c.n, c.epsilon, c.d) for c in cells] == [("toy", 1000, 2.0, 100), ("toy", 1000, 8.0, 100)]
    first = cells[0]
    assert first.x == pytest.approx(1000 * 2.0 / 10.0)
    assert first.ratio("train_loss") == 0.5 and first.ratio("grad_norm_sq") == pytest.approx(3.0)
    assert first.ratio("test_loss") == 1.0
    assert [first.mark(c) for c in CRITERIA] == [MARK_BETTER, MARK_WORSE, ""]
    assert first.p_reverse("grad_norm_sq") == pytest.approx(0.005)
    assert cells[1].ratio("test_loss") == 0.25 and cells[1].mark("test_loss") == ""  # no test: no mark
    result = regime_map(cells)
    assert result["counts"]["train_loss"] == {"diff2_lower": 1, "dpgd_lower": 0, "ratio_below_1": 2, "cells": 2,
                                              "chosen_at_a_grid_edge": 2}
    assert result["counts"]["grad_norm_sq"]["dpgd_lower"] == 1
    row = result["cells"][0]["criteria"]["grad_norm_sq"]
    assert row["mark"] == MARK_WORSE and row["diff2_point"] == {"learning_rate": 0.5, "clip_diff": 1.0}
    # DIFF2-GD's η = 0.5 is the top of its grid [0.25, 0.5] (a one-value axis, clip_diff, has no edge); DP-GD's
    # η = 1 is inside [0.5, 1, 2]
    assert row["grid_edges"] == {"DIFF2-GD": ["learning_rate=0.5 (highest)"]}
    assert result["counts"]["grad_norm_sq"]["chosen_at_a_grid_edge"] == 2


def test_a_diverged_method_gives_an_infinite_ratio_left_out_of_the_fit(tmp_path):
    summary = _summary("toy", 1000, 100, {e: ({**_same(1.0), "train_loss": None}, _same(2.0), _same(0.5))
                                          for e in (1.0, 2.0, 4.0)})
    cells = cells_from_summary(summary, "toy.json")
    assert all(c.ratio("train_loss") == math.inf for c in cells)
    result = regime_map(cells)
    assert result["fits"]["train_loss"]["pooled"] is None  # no finite ratio to fit
    assert result["fits"]["test_loss"]["pooled"]["k"] == 3
    write_regime(cells, tmp_path)  # the heatmap says which method diverged
    assert "| toy | 1000 | 1 | 100 | 100 | inf (0.5) | 0.5 (0.5) | 0.5 (0.5) |" in (tmp_path / "regime.md").read_text()


def _exact_family(constant: float, slope: float, noise: tuple[float, ...] = ()) -> list:
    """Cells on two datasets whose ratios are constant · x^slope · 10^noise_i exactly."""
    cells = []
    grid = [("a", 1000, 1.0), ("a", 1000, 4.0), ("a", 8000, 1.0), ("b", 2000, 2.0), ("b", 16000, 8.0), ("b", 500, 8.0)]
    for i, (ds, n, eps) in enumerate(grid):
        x = n * eps / 10.0  # d = 100
        r = constant * x ** slope * 10 ** (noise[i] if noise else 0.0)
        summary = _summary(ds, n, 100, {eps: (_same(r), _same(1.0), _same(0.5))})
        cells += cells_from_summary(summary, f"{ds}-{n}-{eps}.json")
    return cells


def test_the_fit_recovers_the_slope_of_exactly_constructed_data():
    cells = _exact_family(2.0, THEORY_SLOPE)
    fit = fit_slope([c.x for c in cells], [c.ratio("train_loss") for c in cells])
    assert fit is not None and fit.k == 6
    assert fit.slope == pytest.approx(THEORY_SLOPE, abs=1e-12) and fit.intercept == pytest.approx(math.log10(2.0))
    assert fit.ci_high - fit.ci_low == pytest.approx(0.0, abs=1e-9) and fit.theory_in_ci
    assert fit.crossing == pytest.approx(8.0, rel=1e-9)  # 2 x^(-1/3) = 1 at x = 8
    logs = np.log10([c.x for c in cells])
    assert fit.anchor_log_x == pytest.approx(logs.mean())  # the theory's line goes through the geometric mean
    pooled = regime_map(cells)["fits"]["grad_norm_sq"]
    assert pooled["pooled"]["slope"] == pytest.approx(THEORY_SLOPE) and pooled["pooled"]["theory_in_ci"]
    assert set(pooled["per_dataset"]) == {"a", "b"}
    assert all(f["slope"] == pytest.approx(THEORY_SLOPE) for f in pooled["per_dataset"].values())


def test_the_fit_and_its_interval_with_scatter_match_the_textbook_formulas():
    # residuals orthogonal to 1 and to log x leave the least-squares slope at exactly −0.5
    cells = _exact_family(1.0, -0.5)
    lx = np.log10([c.x for c in cells])
    basis = np.column_stack([np.ones_like(lx), lx])
    e = np.array([0.3, -0.2, 0.1, 0.25, -0.15, 0.05])
    e = e - basis @ np.linalg.lstsq(basis, e, rcond=None)[0]
    cells = _exact_family(1.0, -0.5, tuple(e))
    fit = fit_slope([c.x for c in cells], [c.ratio("test_loss") for c in cells])
    assert fit.slope == pytest.approx(-0.5, abs=1e-12)
    sxx = float(np.sum((lx - lx.mean()) ** 2))
    stderr = math.sqrt(float(np.sum(e ** 2)) / (6 - 2) / sxx)
    q = stats.t.ppf(0.975, 4)
    assert fit.stderr == pytest.approx(stderr, rel=1e-9)
    assert (fit.ci_low, fit.ci_high) == (pytest.approx(-0.5 - q * stderr), pytest.approx(-0.5 + q * stderr))
    assert fit.p_slope_negative == pytest.approx(stats.t.cdf(-0.5 / stderr, 4))
    assert fit.p_theory == pytest.approx(2 * stats.t.sf(abs(-0.5 - THEORY_SLOPE) / stderr, 4))
    assert fit_slope([1.0, 2.0], [1.0, 0.5]) is None  # two points: no interval


def test_p_values_are_computed_from_the_run_files_when_the_summary_has_no_test(tmp_path):
    rng = np.random.default_rng(3)
    summary = _summary("toy", 1000, 100, {3.0: (_same(1.0), _same(2.0), _same(0.5))}, tests=False)
    runs = tmp_path / "runs"
    runs.mkdir()
    mins = {}
    for name, scale in (("DIFF2-GD", 1.0), ("DP-GD", 1.3)):
        for c in CRITERIA:
            ids, per_seed = [], []
            for seed in range(5):
                values = list(scale * (1 + rng.random(4)))
                rid = f"{name}-{c}-{seed}"
                (runs / f"{rid}.json").write_text(json.dumps({c: values}))
                ids.append(rid)
                per_seed.append(min(values))
            summary["epsilons"]["3.0"]["methods"][name]["criteria"][c]["run_ids"] = ids
            mins[name, c] = per_seed
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    (cell,) = read_cells([tmp_path])
    for c in CRITERIA:
        assert cell.p_values[c] == paired_one_sided_ttest(mins["DIFF2-GD", c], mins["DP-GD", c])


def test_unusable_summaries_are_refused_naming_the_file(tmp_path):
    with pytest.raises(RegimeError, match=r"old.json: the summary lacks `dataset.train` and `dataset.parameters`.*"
                                          r"Run `diff2 experiment` on the study again"):
        cells_from_summary({"epsilons": {}}, "old.json")
    two = _summary("toy", 1000, 100, {3.0: (_same(1.0), _same(2.0), _same(0.5))}, extra_diff2=True)
    with pytest.raises(RegimeError, match=r"two.json: expected exactly one diff2 method.*Name one with --diff2"):
        cells_from_summary(two, "two.json")
    assert cells_from_summary(two, "two.json", diff2="DIFF2-GD")[0].diff2 == "DIFF2-GD"
    with pytest.raises(RegimeError, match=r"no method 'nope' \(--control\)"):
        cells_from_summary(two, "two.json", diff2="DIFF2-GD", control="nope")
    for name in ("s1", "s2"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps(
            _summary("toy", 1000, 100, {3.0: (_same(1.0), _same(2.0), _same(0.5))})))
    with pytest.raises(RegimeError, match=r"Two summaries hold dataset toy, n = 1000, ε = 3: .*s1.*s2"):
        read_cells([tmp_path])
    with pytest.raises(RegimeError, match=r"nowhere: no summary.json there nor in its sub-folders"):
        read_cells([tmp_path / "nowhere"])


def _family_study(n: int | None):
    return parse_study({
        "name": f"tiny_n{n or 'full'}", "clients": 4, "rounds": 12, "delta": 1e-5, "epsilons": [2.0, 8.0],
        "eval_every": 4, "seeds": {"tune": [100], "evaluate": [1, 2, 3]},
        "dataset": {"name": "synthetic", "num_samples": 1000, **({"train_samples": n} if n else {})},
        "methods": [{"name": "DP-GD", "method": "dpgd", "grid": {"learning_rate": [0.2, 0.4], "clip_restart": [1.0]}},
                    {"name": "DIFF2-GD", "method": "diff2",
                     "grid": {"restart_every": [4], "learning_rate": [0.2, 0.4], "clip_restart": [1.0],
                              "clip_diff": [3.0]}}]}, f"tiny_{n}.yaml")


@pytest.fixture(scope="module")
def tiny_family(tmp_path_factory):
    root = tmp_path_factory.mktemp("family")
    summaries = {n or 800: run_study(_family_study(n), output_root=root, show_progress=False, make_plots=False)
                 for n in (200, None)}
    return root, summaries


def test_a_real_family_gives_the_studies_own_numbers(tiny_family, tmp_path, capsys):
    root, summaries = tiny_family
    cells = read_cells([root])
    assert [(c.n, c.epsilon, c.d) for c in cells] == [(200, 2.0, 101), (200, 8.0, 101), (800, 2.0, 101),
                                                      (800, 8.0, 101)]
    assert cells[0].train_available == 800 and cells[2].train_available is None
    for cell in cells:
        eps = summaries[cell.n]["epsilons"][str(cell.epsilon)]
        for c in CRITERIA:
            mine, theirs = (eps["methods"][m]["criteria"][c]["min_mean"] for m in ("DIFF2-GD", "DP-GD"))
            assert cell.ratio(c) == mine / theirs
            assert cell.p_values[c] == eps["tests"]["DIFF2-GD vs DP-GD"][c]["p_value"]
            assert cell.mark(c) == mark(cell.p_values[c])
    # the CLI: one JSON object on stdout, the files written, logs on stderr
    out = tmp_path / "map"
    assert main(["regime", str(root / "tiny_n200"), str(root / "tiny_nfull" / "summary.json"), "--out", str(out)]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert "regime map of 4 cell(s)" in captured.err
    assert [(c["n"], c["epsilon"]) for c in result["cells"]] == [(c.n, c.epsilon) for c in cells]
    assert result["cells"][0]["x"] == pytest.approx(200 * 2.0 / math.sqrt(101))
    assert result["cells"][3]["criteria"]["grad_norm_sq"]["ratio"] == pytest.approx(cells[3].ratio("grad_norm_sq"))
    assert set(result["fits"]) == set(CRITERIA) and result["fits"]["train_loss"]["pooled"]["k"] == 4
    for cell in result["cells"]:  # the studies' grids: η ∈ {0.2, 0.4} for both, so every choice is at an edge
        for c in CRITERIA:
            assert set(cell["criteria"][c]["grid_edges"]) == {"DIFF2-GD", "DP-GD"}
    for name in ("heatmap_synthetic.png", "scatter.png", "regime.md", "regime.json"):
        assert (out / name).stat().st_size > 0
    assert json.loads((out / "regime.json").read_text())["cells"] == result["cells"]
    table = (out / "regime.md").read_text()
    assert "| synthetic | 200 | 2 | 101 |" in table and "| min train loss | pooled | 4 |" in table
    assert main(["regime", str(root), "--out", str(out), "--alpha", "2"]) == 2
    assert "--alpha" in capsys.readouterr().err


def test_write_regime_marks_cells_without_a_run(tmp_path):
    cells = []
    for n, eps in ((1000, 1.0), (1000, 4.0), (4000, 4.0)):  # (4000, 1.0) missing, as a refused cell would be
        cells += cells_from_summary(_summary("toy", n, 100, {eps: (_same(1.0), _same(2.0), _same(0.01))}), f"{n}")
    result = write_regime(cells, tmp_path)
    assert [Path(f).name for f in result["files"]["figures"]] == ["heatmap_toy.png", "scatter.png"]
    assert all(c["criteria"]["train_loss"]["mark"] == MARK_BETTER for c in result["cells"])


# ------------------------------------------------------------------------------------ the family's configs

FAMILY = Path(__file__).resolve().parents[1] / "configs" / "regime"
#: Records of the train split of the full datasets (20,640 and 36,733 rows, 20 % held out): n_min = train // 10.
FULL_TRAIN = {"california_housing": 16512, "gas_turbine": 29386}


def test_the_family_runs_the_protocol_with_both_methods_tuned_alike():
    from diff2_flwr.lab.study import load_study

    studies = [load_study(path) for path in sorted(FAMILY.glob("*.yaml"))]
    levels = {(s.dataset["name"], s.dataset.get("train_samples")) for s in studies}
    assert levels == {(d, n) for d in FULL_TRAIN for n in (1000, 4000, None)}
    for s in studies:
        assert (s.clients, s.rounds, s.delta, s.mode, s.eval_every) == (10, 2000, 1e-5, "exact", 50)
        assert (s.tune_seeds, s.eval_seeds) == ((100,), (1, 2, 3, 4, 5))
        assert (s.engine, s.dtype, s.compile, s.workers, s.output_dir) == ("batch", "float32", True, 2, "outputs/regime")
        dpgd, diff2 = s.methods
        assert (dpgd.name, dpgd.method, diff2.name, diff2.method, diff2.u) == ("DP-GD", "dpgd", "DIFF2-GD", "diff2", 1.25)
        g1, g2 = dict(dpgd.grid), dict(diff2.grid)
        assert g2["restart_every"] == (20,) and g2["clip_diff"] == (0.5, 1.0, 2.0)
        assert g1["clip_restart"] == g2["clip_restart"] == (0.5, 1.0, 2.0)  # C1 tuned for both
        assert len(g1["learning_rate"]) == len(g2["learning_rate"]) == 6
        # each learning-rate grid is in octaves, DIFF2-GD's at most one octave below DP-GD's
        for lr in (g1["learning_rate"], g2["learning_rate"]):
            assert np.allclose(np.diff(np.log2(lr)), 1.0)
        assert 0 <= math.log2(g1["learning_rate"][0] / g2["learning_rate"][0]) <= 1
        assert s.epsilons == ((2.0, 8.0) if s.dataset.get("train_samples") == 1000 else (0.5, 2.0, 8.0))


def test_every_cell_of_the_family_passes_the_noise_refusal_rule_and_the_dropped_one_would_not():
    from diff2_flwr.lab.study import load_study
    from diff2_flwr.runtime.shard_report import PartitionRefused, check_shards

    for path in sorted(FAMILY.glob("*.yaml")):
        s = load_study(path)
        n = s.dataset.get("train_samples") or FULL_TRAIN[s.dataset["name"]]
        sizes = [len(part) for part in np.array_split(np.arange(n), s.clients)]
        for eps in s.epsilons:
            for m in s.methods:  # σ depends on the method's T and u and on ε, not on the grid point's η or C
                cfg = s.experiment(m, m.points()[0], eps, 100)
                check_shards(cfg, sizes, cfg.calibration(min(sizes)))  # the study's own check, before any run
        if s.dataset.get("train_samples") == 1000:  # ε = 0.5 is refused at n = 1,000 (the config says so)
            cfg = s.experiment(s.methods[1], s.methods[1].points()[0], 0.5, 100)
            with pytest.raises(PartitionRefused, match=r"σ2 = 1\.37.*above dataset.partitioner.max_sigma = 1"):
                check_shards(cfg, sizes, cfg.calibration(min(sizes)))
