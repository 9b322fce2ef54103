"""The regime map (`diff2 regime`): cells from the studies' run files, endpoints, adjusted marks,
the fit.

Hand-made studies (a summary.json and its runs/ folder written here) whose per-seed values are known
check what a cell reads (the test loss at the train-best round, never the test minimum), the stall
rule and the sensitivity fit; cells built directly check the dataset-effect fit (exactly constructed
data), its cluster bootstrap (against a slow reference loop, coverage on data of a known slope,
determinism) and Holm's marks on pure noise; a tiny real family (synthetic data, 2 n × 2 ε, through
``run_study``) checks that the map reads what the studies wrote; the CLI prints one JSON object.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from scipy import stats

from diff2_flwr.cli import main
from diff2_flwr.lab.study.inference import benjamini_hochberg, holm, paired_ttest
from diff2_flwr.lab.regime.runner import (ENDPOINTS, MARK_BETTER, MARK_WORSE, PRIMARY,
                                          STALL_PROGRESS, THEORY_SLOPE, Cell,
                                   RegimeError, bootstrap_p, cell_tests, cells_from_summary,
                                   fit_regime, mark, read_cells, regime_map, stall_reason,
                                   write_regime)
from diff2_flwr.lab.regime.published import render_regime
from diff2_flwr.lab.study.figures import RENDERERS, refresh
from diff2_flwr.lab.study.runner import parse_study, run_study

SEEDS = [1, 2, 3, 4, 5]


def _run(train, gns, test=None, diverged_at=None) -> dict:
    """A run file's content: per-round lists (rounds 0, 10, 20, ...)."""
    test = [2 * v for v in train] if test is None else test
    return {"rounds": [10 * i for i in range(len(train))], "train_loss": list(train),
            "grad_norm_sq": list(gns),
            "test_loss": list(test), "diverged_at": diverged_at}


def _progressing(final_gns: float, final_train: float = 0.5) -> dict:
    """A run that makes progress (train loss 1 → final_train) and ends at ‖∇f‖² = final_gns."""
    return _run([1.0, 0.8, final_train], [10 * final_gns, 2 * final_gns, final_gns])


def _write_study(folder: Path, dataset: str, n: int, d: int, cells: dict, seeds=SEEDS,
                 extra_diff2=False) -> Path:
    """A study folder as run_study leaves it, reduced to what the map reads. ``cells``: ε -> method
    -> criterion ("grad_norm_sq" or "train_loss") -> one run per seed; the test_loss criterion
    reuses the train-loss runs (the study picks it at the train-loss-best point)."""
    runs = folder / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    summary = {"dataset": {"name": dataset, "train": n, "parameters": d, "test": 100},
               "eval_seeds": list(seeds),
               "epsilons": {}}
    for eps, methods in cells.items():
        entry = {}
        for name, per in methods.items():
            criteria = {}
            for c in ("grad_norm_sq", "train_loss"):
                ids = []
                for seed, record in zip(seeds, per[c]):
                    rid = f"{name}-{eps}-{c}-{seed}".replace(" ", "_")
                    (runs / f"{rid}.json").write_text(json.dumps({"run_id": rid, **record}))
                    ids.append(rid)
                point = {"learning_rate": 0.5,
                         "clip_diff": 1.0} if name.startswith("DIFF2") else {"learning_rate": 1.0}
                criteria[c] = {"point": point, "run_ids": ids}
            criteria["test_loss"] = criteria["train_loss"]
            entry[name] = {"base_method": "diff2" if name.startswith("DIFF2") else "dpgd",
                           "criteria": criteria,
                           "grid": ({"learning_rate": [0.25, 0.5],
                                     "clip_diff": [1.0]} if name.startswith("DIFF2")
                                    else {"learning_rate": [0.5, 1.0, 2.0]})}
        if extra_diff2:
            entry["DIFF2-GD (T=6)"] = entry["DIFF2-GD"]
        summary["epsilons"][str(eps)] = {"methods": entry}
    (folder / "summary.json").write_text(json.dumps(summary))
    return folder / "summary.json"


def _pair(diff2_final, control_final) -> dict:
    """Both methods of one ε: per seed, progressing runs ending at the given final ‖∇f‖²."""
    return {"DIFF2-GD": {c: [_progressing(v) for v in diff2_final] for c in ("grad_norm_sq",
                                                                             "train_loss")},
            "DP-GD": {c: [_progressing(v) for v in control_final] for c in ("grad_norm_sq",
                                                                            "train_loss")}}


def _cell(dataset: str, n: int, eps: float, diff2, control, *, d: int = 100, seeds=None,
          stalled=()) -> Cell:
    """A cell built directly: every endpoint's per-seed values are the given ones."""
    diff2, control = tuple(map(float, diff2)), tuple(map(float, control))
    return Cell(dataset=dataset, n=n, epsilon=eps, d=d, study=f"{dataset}-{n}", diff2="DIFF2-GD",
                control="DP-GD", seeds=tuple(seeds or range(1, len(diff2) + 1)),
                diff2_values={e: diff2 for e in ENDPOINTS},
                control_values={e: control for e in ENDPOINTS}, stalled=tuple(stalled))


# ------------------------------------------------------------------------------------ cells and
# their tests

def test_marks_read_the_adjusted_p_and_the_direction_of_the_difference():
    assert mark(0.01, -0.3) == MARK_BETTER and mark(0.01, 0.3) == MARK_WORSE
    assert mark(0.05, -0.3) == "" and mark(0.2,
                                           -0.3) == "" and mark(math.nan, -0.3) == "" and mark(
                                               0.01, 0.0) == ""
    assert mark(0.09, 1.0, alpha=0.1) == MARK_WORSE and mark(0.09, 1.0) == ""


def test_a_cell_reads_its_endpoints_from_the_run_files(tmp_path):
    diff2, control = [1.0, 2.0, 1.5, 1.2, 0.9], [3.0, 2.5, 4.0, 2.0, 3.5]
    _write_study(tmp_path, "toy", 1000, 100, {2.0: _pair(diff2, control)})
    (cell,) = read_cells([tmp_path])
    assert (cell.dataset, cell.n, cell.epsilon, cell.d, cell.seeds) == ("toy", 1000, 2.0, 100,
                                                                        tuple(SEEDS))
    assert cell.x == pytest.approx(1000 * 2.0 / 10.0)
    assert cell.diff2_values[PRIMARY] == tuple(diff2) and cell.control_values[
        "grad_norm_sq_min"] == tuple(control)
    assert cell.diff2_values["train_loss_min"] == (0.5,) * 5 and cell.diff2_values[
        "test_loss_at_train_best"] == (1.0,) * 5
    # ‖∇f‖²: the geometric mean of the per-seed ratios, with the t-interval of the log difference
    logs = np.log10(diff2) - np.log10(control)
    assert cell.ratio(PRIMARY) == pytest.approx(10 ** logs.mean())
    half = stats.t.ppf(0.975, 4) * logs.std(ddof=1) / math.sqrt(5)
    assert cell.ratio_interval(PRIMARY) == (pytest.approx(10 ** (logs.mean() - half)),
                                            pytest.approx(10 ** (logs.mean() + half)))
    # a loss: the ratio of the seed means, no interval
    assert cell.ratio("train_loss_min") == pytest.approx(0.5 / 0.5)
    assert cell.ratio_interval("train_loss_min") is None
    # two-sided, on log values for ‖∇f‖²
    assert cell.p_value(PRIMARY) == paired_ttest(np.log10(diff2), np.log10(control), "two-sided")
    assert cell.stalled == ()
    row = regime_map([cell])["cells"][0]
    assert row["eval_seeds"] == SEEDS and row["endpoints"][PRIMARY]["diff2_per_seed"] == diff2
    # a family of one
    assert row["endpoints"][PRIMARY]["p_adjusted"] == row["endpoints"][PRIMARY]["p_value"]
    assert row["endpoints"][PRIMARY]["mark"] == MARK_BETTER and not row["endpoints"][PRIMARY][
        "exploratory"]
    # DIFF2-GD's η = 0.5 is the top of its grid [0.25, 0.5] (a one-value axis, clip_diff, has no
    # edge)
    assert row["endpoints"][PRIMARY]["grid_edges"] == {"DIFF2-GD": ["learning_rate=0.5 (highest)"]}
    assert row["endpoints"]["train_loss_min"]["exploratory"] and row["endpoints"]["train_loss_min"][
        "mark"] == ""


def test_the_test_loss_is_taken_at_the_train_loss_best_round_never_at_its_own_minimum(tmp_path):
    # train loss is smallest at round 10 (index 1); the test loss is smallest at round 20 (index 2)
    diff2 = _run([1.0, 0.5, 0.6, 0.7], [1.0, 0.5, 0.4, 0.3], test=[2.0, 0.9, 0.3, 0.8])
    control = _run([1.0, 0.8, 0.7, 0.75], [1.0, 0.5, 0.4, 0.3], test=[2.0, 1.5, 1.2, 0.1])
    per = {"grad_norm_sq": [control] * 5, "train_loss": [control] * 5}
    _write_study(tmp_path, "toy", 1000, 100, {2.0: {"DIFF2-GD": {"grad_norm_sq": [diff2] * 5,
                                                                 "train_loss": [diff2] * 5},
                                                                 "DP-GD": per}})
    (cell,) = read_cells([tmp_path])
    assert cell.diff2_values["test_loss_at_train_best"] == (0.9,) * 5  # not 0.3, the test minimum
    assert cell.control_values["test_loss_at_train_best"] == (1.2,) * 5  # not 0.1
    assert cell.ratio("test_loss_at_train_best") == pytest.approx(0.9 / 1.2)
    assert cell.diff2_values[PRIMARY] == (0.3,) * 5 and cell.diff2_values["train_loss_min"] == (
        0.5,) * 5


def test_the_endpoints_use_the_runs_of_their_criterion_s_own_point(tmp_path):
    study = _pair([1.0] * 5, [2.0] * 5)
    # another point: other runs
    study["DIFF2-GD"]["train_loss"] = [_progressing(7.0, final_train=0.25)] * 5
    _write_study(tmp_path, "toy", 1000, 100, {2.0: study})
    (cell,) = read_cells([tmp_path])
    assert cell.diff2_values[PRIMARY] == (1.0,) * 5 and cell.diff2_values["grad_norm_sq_min"] == (
        1.0,) * 5
    assert cell.diff2_values["train_loss_min"] == (0.25,) * 5 and cell.diff2_values[
        "test_loss_at_train_best"] == (0.5,) * 5


def test_holm_leaves_no_mark_on_a_family_of_pure_noise_cells():
    rng = np.random.default_rng(1)
    cells = [_cell("noise", 1000 * (i + 1), 2.0, np.exp(rng.normal(0, 0.5, 5)),
                   np.exp(rng.normal(0, 0.5, 5)))
             for i in range(16)]
    tests = cell_tests(cells)
    raw = [t[PRIMARY]["p_value"] for t in tests]
    assert min(raw) < 0.05  # read one by one, some cell would be "significant" by chance
    assert [t[PRIMARY]["p_adjusted"] for t in tests] == holm(raw)
    assert all(t[e]["mark"] == "" for t in tests for e in ENDPOINTS)
    explore = [e for e in ENDPOINTS if not ENDPOINTS[e].primary]
    # one family: every exploratory test
    q = benjamini_hochberg([t[e]["p_value"] for e in explore for t in tests])
    assert [t[e]["p_adjusted"] for e in explore for t in tests] == q
    # a real difference survives the correction, in its direction
    control = np.exp(rng.normal(0, 0.5, 5))
    strong = _cell("noise", 99, 2.0, control * 0.3 * np.exp(rng.normal(0, 0.02, 5)), control)
    weak = _cell("noise", 98, 2.0, control * 3.0 * np.exp(rng.normal(0, 0.02, 5)), control)
    tests = cell_tests([*cells, strong, weak])
    assert tests[-2][PRIMARY]["mark"] == MARK_BETTER and tests[-1][PRIMARY]["mark"] == MARK_WORSE
    assert sum(t[PRIMARY]["mark"] != "" for t in tests) == 2


# ------------------------------------------------------------------------------------ the fit

def _exact_family(slope: float, intercepts: dict, seeds: int = 5, noise: float = 0.0,
                  seed: int = 0) -> list[Cell]:
    """Cells whose per-seed ratio is 10^(a_dataset) · x^slope: per seed, DP-GD's value carries
    a seed effect shared by every cell, DIFF2-GD's is the ratio times it (times log-normal noise
    when ``noise`` > 0)."""
    rng = np.random.default_rng(seed)
    effect = np.exp(rng.normal(0.0, 0.4, seeds))
    grid = [("a", 1000, 1.0), ("a", 1000, 4.0), ("a", 8000, 1.0), ("a", 8000, 8.0),
            ("b", 2000, 2.0), ("b", 16000, 8.0), ("b", 500, 8.0), ("b", 4000, 0.5)]
    cells = []
    for ds, n, eps in grid:
        x = n * eps / 10.0  # d = 100
        control = effect * np.exp(rng.normal(0.0, 0.1, seeds)) if noise else effect
        diff2 = 10 ** intercepts[ds] * x ** slope * control * (np.exp(rng.normal(0.0, noise, seeds))
                                                               if noise else 1)
        cells.append(_cell(ds, n, eps, diff2, control))
    return cells


def test_the_dataset_effect_fit_recovers_a_common_slope_with_different_intercepts():
    intercepts = {"a": math.log10(2.0), "b": math.log10(0.05)}
    cells = _exact_family(THEORY_SLOPE, intercepts)
    fit = fit_regime(cells)
    assert fit is not None and fit.k == 8 and fit.cluster == "seed"
    assert fit.slope == pytest.approx(THEORY_SLOPE, abs=1e-12)
    assert fit.intercepts == {ds: pytest.approx(a, abs=1e-12) for ds, a in intercepts.items()}
    # the ratio is exact under every resample of seeds: the bootstrap interval is the point
    assert (fit.ci_low, fit.ci_high) == (pytest.approx(THEORY_SLOPE, abs=1e-9),
                                         pytest.approx(THEORY_SLOPE, abs=1e-9))
    assert fit.theory_in_ci and fit.p_theory == 1.0 and fit.p_zero == pytest.approx(1 / 2001)
    assert fit.crossing("a") == pytest.approx(8.0, rel=1e-9)  # 2 x^(-1/3) = 1 at x = 8
    # one intercept for both datasets would bend the slope: the dataset effect is what recovers it
    lx = np.log10([c.x for c in cells])
    assert abs(np.polyfit(lx, np.log10([c.ratio(PRIMARY) for c in cells]),
                          1)[0] - THEORY_SLOPE) > 0.05
    fits = regime_map(cells)["fits"]
    assert fits["pooled"]["slope"] == pytest.approx(THEORY_SLOPE) and set(fits["per_dataset"]) == {
        "a", "b"}
    assert all(f["slope"] == pytest.approx(THEORY_SLOPE) for f in fits["per_dataset"].values())
    assert fit_regime(cells[:2]) is None  # two cells: no fit
    # no x varies within a dataset
    assert fit_regime([_cell(ds, 1000, 2.0, [1, 2], [2, 3]) for ds in "abc"]) is None


def test_one_seed_cannot_carry_a_cell_the_other_seeds_contradict():
    """The review's case (issue 42): one seed of DP-GD stalls a thousandfold above the rest. A ratio
    of arithmetic means then says DIFF2-GD is 200x lower; the per-seed log differences say it is
    higher on four seeds of five, and the cell's ratio is their geometric mean."""
    control = [1.0, 1.0, 1000.0, 1.0, 1.0]
    diff2 = [2.0, 2.0, 2.0, 2.0, 2.0]
    cell = _cell("a", 1000, 2.0, diff2, control)
    assert np.mean(diff2) / np.mean(control) < 0.01
    assert cell.ratio(PRIMARY) == pytest.approx(10 ** ((4 * math.log10(2) + math.log10(2e-3)) / 5))
    assert cell.ratio(PRIMARY) > 0.5
    low, high = cell.ratio_interval(PRIMARY)
    assert low < cell.ratio(PRIMARY) < high and high > 1  # no claim either way


def test_the_fit_reports_cell_scatter_beyond_seed_noise():
    cells = _exact_family(THEORY_SLOPE, {"a": 0.0, "b": 0.5})
    fit = fit_regime(cells)
    assert fit.residual_sd == pytest.approx(0.0,
                                            abs=1e-12) and fit.seed_sd == pytest.approx(0.0,
                                                                                        abs=1e-12)
    # one cell off the line by a factor 2 on every seed: the seeds cannot see it, the residuals do
    bent = [Cell(**{**c.__dict__,
                    "diff2_values": {e: tuple(2 * v for v in c.diff2_values[e])
                                     for e in ENDPOINTS}})
            if i == 1 else c for i, c in enumerate(cells)]
    fit = fit_regime(bent)
    lx, ly = np.log10([c.x for c in bent]), np.log10([c.ratio(PRIMARY) for c in bent])
    design = np.column_stack([[c.dataset == "a" for c in bent], [c.dataset == "b" for c in bent],
                              lx]).astype(float)
    resid = ly - design @ np.linalg.lstsq(design, ly, rcond=None)[0]
    assert fit.residual_sd == pytest.approx(math.sqrt(np.sum(resid ** 2) / (
        8 - 3))) and fit.residual_sd > 0.05
    assert fit.seed_sd == pytest.approx(0.0,
                                        abs=1e-12) and fit.ci_high - fit.ci_low == pytest.approx(
                                            0.0, abs=1e-9)
    assert fit.as_dict()["lack_of_fit"] == {"residual_sd_log10": fit.residual_sd,
                                            "seed_sd_log10": fit.seed_sd}


def _slow_bootstrap(cells: list[Cell], replicates: int, seed: int) -> list[float]:
    """The obvious loop: per replicate one draw of seed indices, every cell's mean log10 difference
    over the drawn seeds, and the least-squares slope with one dummy per dataset."""
    idx = np.random.default_rng(seed).integers(0, len(cells[0].seeds), size=(replicates,
                                                                             len(cells[0].seeds)))
    datasets = sorted({c.dataset for c in cells})
    slopes = []
    for draw in idx:
        rows, ys = [], []
        for c in cells:
            treat, ctrl = np.asarray(c.diff2_values[PRIMARY]), np.asarray(c.control_values[PRIMARY])
            ys.append(float(np.mean(np.log10(treat[draw]) - np.log10(ctrl[draw]))))
            rows.append([float(c.dataset == ds) for ds in datasets] + [math.log10(c.x)])
        slopes.append(np.linalg.lstsq(np.array(rows), np.array(ys), rcond=None)[0][-1])
    return slopes


def test_the_cluster_bootstrap_covers_a_known_slope_and_is_deterministic_given_its_seed():
    # coverage over 60 simulated families with 10 seeds each: a percentile interval from 10
    # clusters under-covers a little (0.91 over 200 families); 0.8 is 3 binomial sd below that,
    # and an interval that ignored the seed noise would cover almost never
    covered = [fit.ci_low < THEORY_SLOPE < fit.ci_high
               for fit in (fit_regime(_exact_family(THEORY_SLOPE, {"a": 0.2, "b": -0.3}, seeds=10,
                                                    noise=0.3, seed=s), replicates=1000)
                           for s in range(60))]
    assert np.mean(covered) >= 0.8
    cells = _exact_family(THEORY_SLOPE, {"a": 0.2, "b": -0.3}, seeds=10, noise=0.3, seed=11)
    fit = fit_regime(cells)
    assert fit.ci_high - fit.ci_low > 0.01  # seed noise: an interval, not a point
    assert fit_regime(cells) == fit  # the default seed is fixed
    other = fit_regime(cells, seed=12)
    assert other.slope == fit.slope and (other.ci_low, other.ci_high) != (fit.ci_low, fit.ci_high)
    small = fit_regime(cells, replicates=50, seed=3)
    slopes = np.array(_slow_bootstrap(cells, 50, 3))
    assert (small.ci_low, small.ci_high) == (pytest.approx(np.percentile(slopes, 2.5), abs=1e-12),
                                             pytest.approx(np.percentile(slopes, 97.5), abs=1e-12))
    assert small.p_theory == bootstrap_p(slopes, THEORY_SLOPE)


def test_the_bootstrap_p_value_reads_both_tails_and_is_floored():
    reps = np.array([-0.5, -0.4, -0.3, -0.2, -0.1, 0.0, 0.1, 0.2])
    assert bootstrap_p(reps, -0.35) == pytest.approx(2 * 2 / 8)
    assert bootstrap_p(reps, 0.15) == pytest.approx(2 * 1 / 8)
    assert bootstrap_p(reps, 5.0) == pytest.approx(1 / 9) and bootstrap_p(reps, -0.15) == 1.0


def test_different_seed_lists_are_bootstrapped_by_position_and_different_lengths_refused():
    cells = _exact_family(THEORY_SLOPE, {"a": 0.0, "b": 0.0})
    moved = [Cell(**{**c.__dict__, "seeds": (11, 12, 13, 14,
                                             15)}) if c.dataset == "b" else c for c in cells]
    assert fit_regime(moved).cluster == "seed position"
    short = [*cells[:-1], _cell("b", 4000, 0.5, [1.0, 2.0, 3.0], [1.0, 2.0, 3.0])]
    with pytest.raises(RegimeError,
                       match=r"resamples seed positions, but .* evaluated 5 seeds and .* 3\. "
                             r"Evaluate every study of the map on the same number of seeds"):
        fit_regime(short)


def test_a_diverged_method_gives_an_infinite_ratio_left_out_of_the_fit(tmp_path):
    cells = _exact_family(THEORY_SLOPE, {"a": 0.0, "b": 0.0})
    bad = cells[0]
    gone = Cell(**{**bad.__dict__, "diff2_values": {e: (math.inf, *v[1:]) for e,
                                                    v in bad.diff2_values.items()}})
    cells = [gone, *cells[1:]]
    assert gone.ratio(PRIMARY) == math.inf and math.isnan(gone.p_value(PRIMARY))
    fit = regime_map(cells)["fits"]["pooled"]
    assert fit["k"] == 7 and gone.label not in fit["cells"]
    write_regime(cells, tmp_path)  # the heatmap says which method diverged
    table = (tmp_path / "regime.md").read_text()
    assert "| a | 1000 | 1 | 100 | 100 | inf | – | – |  |  |" in table
    left_out = "Left out of every fit (a method's final ‖∇f‖² not finite and positive on some seed"
    assert left_out in table
    assert json.loads((tmp_path / "regime.json").read_text())["fits"]["not_fitted"] == [
        "a n=1000 ε=1"]


# ------------------------------------------------------------------------------------ stalled runs

def test_the_stall_rule():
    assert stall_reason(_run([1.0, 0.95, 0.9], [1, 1,
                                                1])).startswith(
                                                    f"final train loss 0.9 >= {STALL_PROGRESS:g} "
                                                    f"x 1")
    assert stall_reason(_run([1.0, 0.95, 0.89], [1, 1, 1])) is None
    assert stall_reason(_run([1.0, 0.5, 0.1], [1, 1, 1], diverged_at=30)) == "diverged at round 30"
    assert stall_reason(_run([1.0, 0.5, math.inf], [1, 1, 1])) == "non-finite final train loss"


def test_the_sensitivity_fit_leaves_out_exactly_the_cell_with_a_stalled_run(tmp_path):
    grid = [("a", 1000, 1.0), ("a", 1000, 4.0), ("a", 8000, 1.0), ("b", 2000, 2.0),
            ("b", 16000, 8.0), ("b", 500, 8.0)]
    control = [1.0, 2.0, 1.5, 0.5, 1.2]
    for ds, n, eps in grid:
        ratio = 10 ** (0.3 if ds == "a" else -0.2) * (n * eps / 10.0) ** THEORY_SLOPE
        study = _pair([ratio * v for v in control], control)
        # DP-GD stalls on seed 3: its ‖∇f‖² stays high, the ratio looks good
        if (ds, n, eps) == ("a", 8000, 1.0):
            study = _pair([ratio * v for v in control], control)
            study["DP-GD"]["grad_norm_sq"][2] = _run([1.0, 0.97, 0.95], [60.0, 55.0, 50.0])
        _write_study(tmp_path / f"{ds}-{n}-{eps}", ds, n, 100, {eps: study})
    cells = read_cells([tmp_path])
    assert [c.label for c in cells if c.stalled] == ["a n=8000 ε=1"]
    assert cells[[c.label for c in cells].index("a n=8000 ε=1")].stalled == (
        "DP-GD seed 3: final train loss 0.95 >= 0.9 x 1 at the first recorded round 0",)
    fits = regime_map(cells)["fits"]
    assert fits["pooled"]["k"] == 6 and abs(fits["pooled"]["slope"] - THEORY_SLOPE) > 0.05
    sens = fits["sensitivity"]
    assert [(x["dataset"], x["n"], x["epsilon"]) for x in sens["excluded"]] == [("a", 8000, 1.0)]
    assert sens["excluded"][0]["stalled_runs"] == list(cells[2].stalled) and "stalls" in sens[
        "rule"]
    assert sens["fit"]["k"] == 5 and "a n=8000 ε=1" not in sens["fit"]["cells"]
    assert sens["fit"]["slope"] == pytest.approx(THEORY_SLOPE, abs=1e-9)
    out = tmp_path / "map"
    write_regime(cells, out, plots=False)
    table = (out / "regime.md").read_text()
    assert "- a, n = 8000, ε = 1: DP-GD seed 3: final train loss 0.95" in table
    assert "| sensitivity: without cells with a stalled run | 5 | -0.333 |" in table


# ------------------------------------------------------------------------------------ reading
# errors, the CLI

def test_unusable_studies_are_refused_naming_the_file(tmp_path):
    with pytest.raises(RegimeError,
                       match=r"old.json: the summary lacks `dataset.train` and "
                             r"`dataset.parameters`.*Run `diff2 experiment` on the study again"):
        cells_from_summary({"epsilons": {}}, "old.json")
    path = _write_study(tmp_path / "two", "toy", 1000, 100, {3.0: _pair([1.0] * 5, [2.0] * 5)},
                        extra_diff2=True)
    two = json.loads(path.read_text())
    with pytest.raises(RegimeError,
                       match=r"two.json: expected exactly one diff2 method.*Name one with --diff2"):
        cells_from_summary(two, "two.json", runs_dir=path.parent / "runs")
    assert cells_from_summary(two, str(path), diff2="DIFF2-GD")[0].diff2 == "DIFF2-GD"
    with pytest.raises(RegimeError, match=r"no method 'nope' \(--control\)"):
        cells_from_summary(two, "two.json", diff2="DIFF2-GD", control="nope")
    with pytest.raises(RegimeError,
                       match=r"one.json: expected `eval_seeds`, a list of at least 2 seeds.*Found "
                             r"\[1\]"):
        cells_from_summary({**two, "eval_seeds": [1]}, "one.json")
    for name in ("s1", "s2"):
        _write_study(tmp_path / "dup" / name, "toy", 1000, 100, {3.0: _pair([1.0] * 5, [2.0] * 5)})
    with pytest.raises(RegimeError,
                       match=r"Two summaries hold dataset toy, n = 1000, ε = 3: .*s1.*s2"):
        read_cells([tmp_path / "dup"])
    with pytest.raises(RegimeError, match=r"nowhere: no summary.json there nor in its sub-folders"):
        read_cells([tmp_path / "nowhere"])
    missing = tmp_path / "two" / "runs" / "DP-GD-3.0-grad_norm_sq-4.json"
    missing.unlink()
    with pytest.raises(RegimeError,
                       match=rf"{missing}: run file missing.*keep the study's runs/ folder"):
        read_cells([tmp_path / "two"], diff2="DIFF2-GD")
    missing.write_text(json.dumps({"rounds": [0], "train_loss": [1.0], "grad_norm_sq": []}))
    with pytest.raises(RegimeError,
                       match=r"DP-GD-3.0-grad_norm_sq-4.json: expected non-empty per-round lists .*"
                                          r"missing or empty: grad_norm_sq, test_loss"):
        read_cells([tmp_path / "two"], diff2="DIFF2-GD")


def test_the_cli_prints_one_json_object_and_writes_the_map(tmp_path, capsys):
    for n in (1000, 4000):
        _write_study(tmp_path / "family" / f"toy{n}", "toy", n, 100,
                     {eps: _pair([0.5, 1.0, 0.8, 0.6, 0.9], [1.0, 2.0, 1.5, 1.1,
                                                             1.7]) for eps in (1.0, 4.0)})
    out = tmp_path / "map"
    assert main(["regime", str(tmp_path / "family"), "--out", str(out), "--replicates", "200"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)  # one object, nothing else on stdout
    assert "regime map of 4 cell(s)" in captured.err
    assert set(result) == {"alpha", "theory_slope", "primary_endpoint", "endpoints", "marks",
                           "stall_rule", "cells",
                           "counts", "fits", "files"}
    assert set(result["fits"]) == {"endpoint", "model", "not_fitted", "pooled", "per_dataset",
                                   "sensitivity"}
    assert result["fits"]["pooled"]["bootstrap"] == {"replicates": 200, "seed": 20,
                                                     "cluster": "seed",
                                                     "interval": "percentile"}
    assert json.loads((out / "regime.json").read_text())["cells"] == result["cells"]
    for name in ("heatmap_toy.png", "scatter.png", "regime.md", "regime.json"):
        assert (out / name).stat().st_size > 0
    assert main(["regime", str(tmp_path / "family"), "--out", str(out), "--alpha", "2"]) == 2
    assert "--alpha" in capsys.readouterr().err
    assert main(["regime", str(tmp_path / "family"), "--out", str(out), "--replicates", "0"]) == 2
    assert "--replicates" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ a real family

def _family_study(n: int | None):
    return parse_study(_family_dict(n), f"tiny_{n}.yaml")


def _family_dict(n: int | None) -> dict:
    return {
        "name": f"tiny_n{n or 'full'}", "clients": 4, "rounds": 12, "delta": 1e-5,
        "epsilons": [2.0, 8.0],
        "eval_every": 4, "seeds": {"tune": [100, 101, 102], "evaluate": [1, 2, 3]},
        "dataset": {"name": "synthetic", "num_samples": 1000,
                    **({"train_samples": n} if n else {})},
        "methods": [{"name": "DP-GD", "method": "dpgd", "grid": {"learning_rate": [0.2, 0.4],
                                                                 "clip_restart": [1.0]}},
                    {"name": "DIFF2-GD", "method": "diff2",
                     "grid": {"restart_every": [4], "learning_rate": [0.2, 0.4],
                              "clip_restart": [1.0],
                              "clip_diff": [3.0]}}]}


@pytest.fixture(scope="module")
def tiny_family(tmp_path_factory):
    root = tmp_path_factory.mktemp("family")
    summaries = {n or 800: run_study(_family_study(n), output_root=root, show_progress=False,
                                     make_plots=False)
                 for n in (200, None)}
    return root, summaries


def test_a_real_family_gives_the_studies_own_numbers(tiny_family, tmp_path, capsys):
    root, summaries = tiny_family
    cells = read_cells([root])
    assert [(c.n, c.epsilon, c.d) for c in cells] == [(200, 2.0, 101), (200, 8.0, 101), (800, 2.0,
                                                                                         101),
                                                      (800, 8.0, 101)]
    assert cells[0].train_available == 800 and cells[2].train_available is None
    for cell in cells:
        eps = summaries[cell.n]["epsilons"][str(cell.epsilon)]
        for m, mine in ((cell.diff2, cell.diff2_values), (cell.control, cell.control_values)):
            for e, spec in ENDPOINTS.items():
                runs = [json.loads((
                    root / f"tiny_n{'full' if cell.n == 800 else 200}" / "runs" / f"{rid}.json")
                                   .read_text()) for rid in eps["methods"][m]["criteria"][
                                       spec.criterion]["run_ids"]]
                assert mine[e] == tuple(spec.value({k: [math.inf if v is None else v for v in r[k]]
                                                    if isinstance(r[k], list) else r[k] for k in r})
                                                    for r in runs)
    # the CLI: one JSON object on stdout, the files written, logs on stderr
    out = tmp_path / "map"
    assert main(["regime", str(root / "tiny_n200"), str(root / "tiny_nfull" / "summary.json"),
                 "--out", str(out)]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert "regime map of 4 cell(s)" in captured.err
    assert [(c["n"], c["epsilon"]) for c in result["cells"]] == [(c.n, c.epsilon) for c in cells]
    assert result["cells"][0]["x"] == pytest.approx(200 * 2.0 / math.sqrt(101))
    assert result["cells"][3]["endpoints"][PRIMARY]["ratio"] == pytest.approx(cells[3].ratio(
        PRIMARY))
    pooled = result["fits"]["pooled"]
    assert pooled is None or pooled["bootstrap"]["cluster"] == "seed"
    # the studies' grids: η ∈ {0.2, 0.4} for both, so every choice is at an edge
    for cell in result["cells"]:
        for e in ENDPOINTS:
            assert set(cell["endpoints"][e]["grid_edges"]) == {"DIFF2-GD", "DP-GD"}
    for name in ("heatmap_synthetic.png", "scatter.png", "regime.md", "regime.json"):
        assert (out / name).stat().st_size > 0
    assert json.loads((out / "regime.json").read_text())["cells"] == result["cells"]
    assert "| synthetic | 200 | 2 | 101 |" in (out / "regime.md").read_text()


def test_the_map_from_the_committed_tables_alone_equals_the_map_from_the_runs(
        tiny_family, tmp_path, capsys, monkeypatch):
    """Issue 42, item 4: the studies' run tables and their files are all a reader needs; the map
    recomputed from them is the map of the runs, and a generated block of it fails its check when
    a number is edited."""
    root, _ = tiny_family
    studies, tables = tmp_path / "configs", tmp_path / "results"
    studies.mkdir()
    tables.mkdir()
    for n in (200, None):
        name = f"tiny_n{n or 'full'}"
        (studies / f"{name}.yaml").write_text(yaml.safe_dump(_family_dict(n), sort_keys=False))
        shutil.copy(root / name / "runs.csv.gz", tables / f"{name}.csv.gz")
    assert main(["regime", str(root), "--out", str(tmp_path / "a"), "--no-plots"]) == 0
    from_runs = json.loads(capsys.readouterr().out)
    monkeypatch.setattr("diff2_flwr.lab.study.scheduler.compute_unit",
                        lambda *a, **k: pytest.fail("a replay computed a run"))
    assert main(["regime", "--from-tables", str(tables), str(studies), "--out",
                 str(tmp_path / "b"), "--no-plots"]) == 0
    from_tables = json.loads(capsys.readouterr().out)
    assert from_tables["fits"] == from_runs["fits"]
    for a, b in zip(from_tables["cells"], from_runs["cells"]):
        assert {k: v for k, v in a.items() if k != "study"} == {
            k: v for k, v in b.items() if k != "study"}
    # the block of a page, and a drifted ratio
    page = tmp_path / "page.md"
    page.write_text("<!-- figures: regime configs -->\n<!-- /figures -->\n")
    renderers = {**RENDERERS, "regime": render_regime}
    refresh([page], tables, check=False, root=tmp_path, renderers=renderers)
    text = page.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| synthetic | 200 | 2 |"))
    ratio = from_runs["cells"][0]["endpoints"][PRIMARY]["ratio"]
    assert f"| {ratio:.3g} [" in row and "#### Primary:" in text and "# Regime map" not in text
    assert refresh([page], tables, check=True, root=tmp_path, renderers=renderers)["differ"] == []
    page.write_text(text.replace(row, row.replace(f"| {ratio:.3g} [", "| 0.01 [")))
    assert refresh([page], tables, check=True, root=tmp_path, renderers=renderers)["differ"]
    with pytest.raises(ValueError, match="kind 'regime'; expected one of family"):
        refresh([page], tables, check=True, root=tmp_path)
    # a study without its table: one line that names it
    (tables / "tiny_n200.csv.gz").unlink()
    assert main(["regime", "--from-tables", str(tables), str(studies)]) == 2
    assert "no run table" in capsys.readouterr().err


def test_write_regime_marks_cells_without_a_run(tmp_path):
    cells = [_cell("toy", n, eps, [0.1, 0.12, 0.11, 0.1, 0.13], [1.0, 1.1, 1.3, 0.9, 1.2])
             # (4000, 1.0) missing, as a refused cell would be
             for n, eps in ((1000, 1.0), (1000, 4.0), (4000, 4.0))]
    result = write_regime(cells, tmp_path)
    assert [Path(f).name for f in result["files"]["figures"]] == ["heatmap_toy.png", "scatter.png"]
    assert all(c["endpoints"][PRIMARY]["mark"] == MARK_BETTER for c in result["cells"])


# ------------------------------------------------------------------------------------ the family's
# configs

FAMILY = Path(__file__).resolve().parents[1] / "configs" / "regime"
#: Records of the train split of the full datasets (20,640 and 36,733 rows, 20 % held out): n_min =
#: train // 10.
FULL_TRAIN = {"california_housing": 16512, "gas_turbine": 29386}


def test_the_family_runs_the_protocol_with_both_methods_tuned_alike():
    from diff2_flwr.lab.study.runner import load_study

    studies = [load_study(path) for path in sorted(FAMILY.glob("*.yaml"))]
    levels = {(s.dataset["name"], s.dataset.get("train_samples")) for s in studies}
    assert levels == {(d, n) for d in FULL_TRAIN for n in (1000, 4000, None)}
    for s in studies:
        assert (s.clients, s.rounds, s.delta, s.mode, s.eval_every) == (10, 2000, 1e-5, "exact", 50)
        assert (s.tune_seeds, s.eval_seeds) == ((100, 101, 102), (1, 2, 3, 4, 5))
        assert (s.engine, s.dtype, s.compile, s.workers, s.output_dir) == ("batch", "float32", True,
                                                                           2, "outputs/regime")
        dpgd, diff2 = s.methods
        assert (dpgd.name, dpgd.method, diff2.name, diff2.method,
                diff2.u) == ("DP-GD", "dpgd", "DIFF2-GD", "diff2", 1.25)
        g1, g2 = dict(dpgd.grid), dict(diff2.grid)
        assert g2["restart_every"] == (20,) and g2["clip_diff"] == (0.5, 1.0, 2.0)
        assert g1["clip_restart"] == g2["clip_restart"] == (0.5, 1.0, 2.0)  # C1 tuned for both
        assert len(g1["learning_rate"]) == len(g2["learning_rate"]) == 6
        # each learning-rate grid is in octaves, DIFF2-GD's at most one octave below DP-GD's
        for lr in (g1["learning_rate"], g2["learning_rate"]):
            assert np.allclose(np.diff(np.log2(lr)), 1.0)
        assert 0 <= math.log2(g1["learning_rate"][0] / g2["learning_rate"][0]) <= 1
        assert s.epsilons == ((2.0, 8.0) if s.dataset.get("train_samples") == 1000 else (0.5, 2.0,
                                                                                         8.0))


def test_every_cell_of_the_family_passes_the_noise_refusal_rule_and_the_dropped_one_would_not():
    from diff2_flwr.lab.study.runner import load_study
    from diff2_flwr.runtime.shard_report import PartitionRefused, check_shards

    for path in sorted(FAMILY.glob("*.yaml")):
        s = load_study(path)
        n = s.dataset.get("train_samples") or FULL_TRAIN[s.dataset["name"]]
        sizes = [len(part) for part in np.array_split(np.arange(n), s.clients)]
        for eps in s.epsilons:
            # σ depends on the method's T and u and on ε, not on the grid point's η or C
            for m in s.methods:
                cfg = s.experiment(m, m.points()[0], eps, 100)
                # the study's own check, before any run
                check_shards(cfg, sizes, cfg.calibration(min(sizes)))
        # ε = 0.5 is refused at n = 1,000 (the config says so)
        if s.dataset.get("train_samples") == 1000:
            cfg = s.experiment(s.methods[1], s.methods[1].points()[0], 0.5, 100)
            with pytest.raises(PartitionRefused,
                               match=r"σ2 = 1\.37.*above privacy.max_sigma = 1"):
                check_shards(cfg, sizes, cfg.calibration(min(sizes)))
