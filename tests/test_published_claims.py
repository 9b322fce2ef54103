"""The published results survive multiplicity correction only where docs/results.md, the README and
the docs say so (issue 20).

No training: scripts/adjust_published.py reads the published one-sided p-values and the regime cell
table, and these tests pin the facts of the statistical review that can be checked from them, by
hand as well (see the comments).
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results.md"
README = ROOT / "README.md"
#: Every page that may state a result: the README and the documentation site's pages (results.md
#: among them).
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]


def _load():
    spec = importlib.util.spec_from_file_location("adjust_published",
                                                  ROOT / "scripts" / "adjust_published.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


ap = _load()


@pytest.fixture(scope="module")
def text() -> str:
    return RESULTS.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def rep(text) -> dict:
    return ap.report(text)


def test_every_published_ttest_row_is_parsed(rep):
    # 4 paper studies × 12 + rdp 6 + routines 2 × 24 + KDD subsample 2 × 16 + digits 2 × 4 = 142
    # rows, each with a min/best-over-rounds and a final p.
    assert rep["rows_parsed"] == 142
    assert rep["tests_parsed"] == 284
    counts = {s: v["m"] for s, v in rep["per_study"].items()}
    assert sorted(counts.values()) == sorted([24] * 4 + [12] + [48] * 2 + [32] * 2 + [8] * 2)
    # 16 best-round p below 0.05 in the declared direction (the review's count).
    assert rep["best_round_one_sided_below_0.05"] == 16


def test_headline_family_survives_neither_holm_nor_two_sided_bh(rep):
    h = rep["headline"]
    assert h["m"] == 16
    # Holm, one-sided as the paper declared: 16 × 0.00403 = 0.0645 (Gas Turbine ε = 3, T = 6).
    assert h["min_holm_one_sided"] == pytest.approx(16 * 0.00403, rel=1e-9)
    assert h["survivors_holm_one_sided_0.05"] == []
    # BH, one-sided: the three Gas Turbine ε = 3 tests (T = 6, 20, 60) at q = 16 × 0.00553 / 3 =
    # 0.0295.
    assert h["min_bh_one_sided"] == pytest.approx(16 * 0.00553 / 3, rel=1e-9)
    assert all(s.startswith("Gas Turbine, ε = 3:") for s in h["survivors_bh_one_sided_0.05"])
    assert len(h["survivors_bh_one_sided_0.05"]) == 3
    # Both tails were read: two-sided, nothing survives either correction (Holm 0.129, BH 0.059).
    assert h["min_holm_two_sided"] == pytest.approx(2 * 16 * 0.00403, rel=1e-9)
    assert h["min_bh_two_sided"] == pytest.approx(2 * 16 * 0.00553 / 3, rel=1e-9)
    assert h["survivors_holm_two_sided_0.05"] == [] and h["survivors_bh_two_sided_0.05"] == []
    # At the final round every ‖∇f‖² p where DIFF2 leads lies in 0.053–0.094.
    lo, hi = rep["headline_final"]["p_one_sided_range_where_diff2_leads"]
    assert (lo, hi) == (0.0532, 0.0941)


def test_no_test_in_diff2s_favour_survives_its_study_family(rep):
    assert rep["survivors_favouring_diff2_study_family"] == 0
    assert not rep["any_holm_pooled_survivor"] and not rep["any_bh_pooled_survivor"]
    # The rdp follow-up's "significant wins on the losses" (0.019, 0.045 one-sided): Holm ≥ 0.26 in
    # its family of 12.
    rdp = next(v for s, v in rep["per_study"].items() if "`rdp`" in s)
    assert rdp["min_holm"] == pytest.approx(12 * two(0.0109),
                                            rel=1e-9) and rdp["survivors_bh_0.05"] == []
    # Study-family Holm survivors all favour DP-GD and all hang on the rounding of a published 0.999
    # / 0.997: California ε = 3, T = 60, train and test loss (24 × 0.002 = 0.048, [0.024, 0.072]);
    # digits ε = 8 train loss.
    survivors = [t for t in rep["tests"] if t["holm_study"] < 0.05]
    assert len(survivors) == 3
    assert all(t["p_one_sided"] > 0.5 and t["holm_study_interval"][1] > 0.05 for t in survivors)
    # BH q < 0.05 in the study family: 21 tests, all in DP-GD's favour (California ε = 3: 2, KDD ε =
    # 5: 15, digits ε = 8: 4).
    bh = [t for t in rep["tests"] if t["bh_study"] < 0.05]
    assert len(bh) == 21 and all(t["p_one_sided"] > 0.5 for t in bh)
    assert min(t["bh_pooled"] for t in rep["tests"]) > 0.1


def two(p: float) -> float:
    return min(1.0, 2 * min(p, 1 - p))


def test_regime_refits(rep):
    r = rep["regime"]
    assert r["cells"] == 16
    pooled = r["fit_grad_pooled"]  # published: −0.305 [−0.920, 0.310]
    assert pooled["slope"] == pytest.approx(-0.305, abs=0.002)
    assert pooled["ci95"] == pytest.approx([-0.920, 0.310], abs=0.002)
    ds = r["fit_grad_dataset_effect"]  # review: −0.26 [−0.75, 0.23]
    assert ds["slope"] == pytest.approx(-0.26, abs=0.01)
    assert ds["ci95"] == pytest.approx([-0.75, 0.23], abs=0.01)
    ex = r["fit_grad_without_stalled"]  # review: −0.036 [−0.245, 0.174], −1/3 rejected p = 0.010
    assert len(ex["excluded"]) == 4 and all(e.startswith("California") for e in ex["excluded"])
    assert "exploratory" in ex["exploratory"]
    assert ex["slope"] == pytest.approx(-0.036, abs=0.002)
    assert ex["ci95"] == pytest.approx([-0.245, 0.174], abs=0.002)
    assert ex["p_slope_eq_minus_third"] == pytest.approx(0.010, abs=0.001)
    # The cell tests: 16 × the smaller published two-sided p (0.034) = 0.54 under Holm.
    assert r["grad_column_family"]["holm_min_two_sided"] == pytest.approx(0.544, abs=1e-9)
    assert r["train_loss_ratio_above_1_cells"] == 16


def test_published_tables_carry_the_adjusted_values(text):
    # The t-test tables of docs/results.md are what `adjust_published.py --annotate` writes (rerun
    # it after editing).
    assert ap.annotate(text) == text
    assert text.count("Holm, study family (min / final)") == 11


def _confirmation_rows(text: str) -> list[list[str]]:
    section = text.split("## The pre-registered confirmation study", 1)[1].split("\n## ", 1)[0]
    return [[c.strip() for c in line.strip("|").split("|")] for line in section.splitlines()
            if line.startswith("| California |") or line.startswith("| Gas Turbine |")][:8]


def test_the_confirmation_table_is_holm_of_its_own_p_values(text):
    # The published table of configs/confirm/ (8 primary tests): its two Holm columns follow from
    # its raw p (the run files stay in outputs/, not in the repository), within the 3 significant
    # digits printed, its verdicts from the family column at α = 0.05, and the summary sentence
    # names exactly the significant cells.
    from diff2_flwr.lab.study.inference import holm

    rows = _confirmation_rows(text)
    assert len(rows) == 8 and {(r[0], r[1]) for r in rows} == {(d, e) for d in ("California",
                                                                                "Gas Turbine")
                                                               for e in ("3", "8")}
    raw = [float(r[6]) for r in rows]
    for got, want in zip([float(r[8]) for r in rows], holm(raw)):
        assert got == pytest.approx(want, rel=0.02)
    for dataset in ("California", "Gas Turbine"):
        mine = [r for r in rows if r[0] == dataset]
        for got, want in zip([float(r[7]) for r in mine], holm([float(r[6]) for r in mine])):
            assert got == pytest.approx(want, rel=0.02)
    for r in rows:
        lower = "DIFF2-GD lower" if float(r[5]) < 1 else "DP-GD lower"
        assert r[9] == (lower if float(r[8]) < 0.05 else "not significant"), r
    assert "<!-- CONFIRMATION STUDY SECTION -->" not in text


@pytest.mark.parametrize("path", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_significance_claim_is_adjusted_or_exploratory(path):
    # Rule: a prose line with "p =", "p ≤", "p′", "significant(ly)", … also names Holm, BH,
    # "adjusted" or "exploratory".
    bad = ap.unqualified_claim_lines(path.read_text(encoding="utf-8"))
    assert bad == [], "\n".join(f"{path.name}:{n}: {line}" for n, line in bad)


def test_the_claims_rule_catches_an_unqualified_claim():
    assert ap.unqualified_claim_lines("DIFF2 beats DP-GD (p = 0.02).\n") == [(
        1, "DIFF2 beats DP-GD (p = 0.02).")]
    assert ap.unqualified_claim_lines("significantly lower (exploratory, p = 0.02)\n") == []
    assert ap.unqualified_claim_lines("unadjusted p = 0.02\n") != []
    assert ap.unqualified_claim_lines("| a | p = 0.02 |\n") == []
    assert not math.isnan(ap.two_sided(0.3))
