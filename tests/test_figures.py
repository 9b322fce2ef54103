"""Published figures that recompute themselves (issue 42, item 1): a generated block of a Markdown
file is recomputed from the committed run tables alone, and a number that drifts from them fails
the check."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from diff2_flwr.cli import main
from diff2_flwr.lab.regime.published import render_regime
from diff2_flwr.lab.study.family import run_family
from diff2_flwr.lab.study.figures import RENDERERS, refresh
from diff2_flwr.lab.study.runner import load_study, run_study
from diff2_flwr.lab.study.spec import StudyError

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "smoke.yaml"


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """A one-study family on synthetic data with a primary endpoint, run once; its run table
    committed under tables/ and its results folder deleted (only the table remains)."""
    root = tmp_path_factory.mktemp("repo")
    study = yaml.safe_load(SMOKE.read_text())
    study.update(name="figs", output={"dir": str(root / "outputs")},
                 methods=study["methods"][1:],
                 analysis={"primary": [{"criterion": "grad_norm_sq", "at": "final",
                                        "scale": "log"}]})
    (root / "figs.yaml").write_text(yaml.safe_dump(study))
    (root / "family.yaml").write_text(yaml.safe_dump({"name": "figs", "studies": ["figs.yaml"]}))
    run_study(load_study(root / "figs.yaml"), show_progress=False, make_plots=False)
    (root / "tables").mkdir()
    shutil.copy(root / "outputs" / "figs" / "runs.csv.gz", root / "tables" / "figs.csv.gz")
    shutil.rmtree(root / "outputs")
    return root


def test_a_plot_block_draws_its_figure_from_the_table_and_the_check_finds_a_missing_one(
        published):
    """``plot FILE``: the study's figure per ε drawn from its replay into docs/img/, linked relative
    to the page; ``--check`` writes nothing and names an image that does not exist."""
    root = published
    (root / "docs").mkdir(exist_ok=True)
    page, top = root / "docs" / "plots.md", root / "top.md"
    for p in (page, top):
        p.write_text("<!-- figures: plot figs.yaml -->\n<!-- /figures -->\n")
    image = root / "docs" / "img" / "figs_eps3.png"
    checked = refresh([page], root / "tables", check=True, root=root)
    assert not image.exists()  # the check draws nothing into the repository
    assert {"file": str(page), "block": "plot figs.yaml",
            "missing": ["docs/img/figs_eps3.png"]} in checked["differ"]
    refresh([page, top], root / "tables", check=False, root=root)
    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "](img/figs_eps3.png)" in page.read_text()  # relative to the page's folder
    assert "](docs/img/figs_eps3.png)" in top.read_text()
    assert refresh([page, top], root / "tables", check=True, root=root)["differ"] == []
    image.unlink()
    assert [d.get("missing") for d in refresh([page], root / "tables", check=True,
                                              root=root)["differ"]] == [["docs/img/figs_eps3.png"]]


def test_a_block_is_written_from_the_tables_and_a_drifted_number_fails_the_check(published):
    root = published
    page = root / "page.md"
    page.write_text("# Results\n\n<!-- figures: family family.yaml -->\n<!-- /figures -->\n"
                    "\nEnd.\n")
    written = refresh([page], root / "tables", check=False, root=root)
    assert written["differ"] and written["written"]
    text = page.read_text()
    assert "| figs | 3 | DIFF2-GD (T=4) vs DP-GD |" in text and text.endswith("\nEnd.\n")
    assert "ratio [95 % CI]" in text  # the family table, with its intervals
    assert refresh([page], root / "tables", check=True, root=root)["differ"] == []
    # a number edited by hand (the family Holm p of the one test) no longer matches
    row = next(line for line in text.splitlines() if line.startswith("| figs | 3 |"))
    cells = row.split(" | ")
    cells[-2] = "0.0001"
    page.write_text(text.replace(row, " | ".join(cells)))
    checked = refresh([page], root / "tables", check=True, root=root)
    assert checked["differ"] == [{"file": str(page), "block": "family family.yaml",
                                  "line": text.splitlines().index(row) + 1}]
    assert " | ".join(cells) in page.read_text()  # --check writes nothing


def _written(root: Path, name: str, block: str) -> tuple[Path, str]:
    """A page holding one empty block, written from the tables: the page and its text."""
    page = root / name
    page.write_text(f"<!-- figures: {block} -->\n<!-- /figures -->\n")
    refresh([page], root / "tables", check=False, root=root)
    return page, page.read_text()


def test_a_study_block_holds_the_studys_tables_recomputed_from_its_table(published):
    root = published
    page, text = _written(root, "study.md", "study figs.yaml")
    assert "**Primary endpoints**" in text and "##### ε = 3.0" in text
    assert "| DIFF2-GD (T=4) vs DP-GD | log ‖∇f‖², final | **primary** |" in text
    assert "Wall time" not in text  # nothing a replay does not recompute
    assert refresh([page], root / "tables", check=True, root=root)["differ"] == []
    row = next(line for line in text.splitlines() if "| **primary** |" in line)
    page.write_text(text.replace(row, row.replace("| 19 |", "| 18 |").replace(" | 2 |", " | 1 |")))
    assert refresh([page], root / "tables", check=True, root=root)["differ"]
    page.write_text("<!-- figures: study missing.yaml -->\n<!-- /figures -->\n")
    (root / "missing.yaml").write_text((root / "figs.yaml").read_text().replace("name: figs",
                                                                                "name: gone"))
    with pytest.raises(StudyError, match=r"missing.yaml: no run table .*gone.csv.gz"):
        refresh([page], root / "tables", check=True, root=root)


def test_a_verdict_block_states_the_familys_verdict_from_the_tables(published):
    root = published
    page, text = _written(root, "verdict.md", "verdict family.yaml")
    family = run_family(root / "family.yaml", output_root=root / "fam", tables=root / "tables")
    (row,) = family["results"]
    lower = row["treatment"] if row["lower"] == "treatment" else row["control"]
    key = f"{lower} lower (Holm p < 0.05)" if row["significant"] else \
        "no claim either way (Holm p ≥ 0.05)"
    assert text.startswith("<!-- figures: verdict family.yaml -->\nHolm over the family's 1 "
                           "primary tests (α = 0.05; DIFF2-GD (T=4) vs DP-GD;")
    assert f"{key}: 1." in text and f"- **{key}** (1 of 1):\n  - synthetic, ε = 3, log ‖∇f‖², " \
        "final: ratio " in text
    assert f"{row['ratio']:.4g} [{row['ci95_ratio'][0]:.4g}, {row['ci95_ratio'][1]:.4g}]" in text
    assert refresh([page], root / "tables", check=True, root=root)["differ"] == []


def test_the_command_checks_in_one_line_and_exits_1(published, monkeypatch, capsys):
    root = published
    page = root / "drift.md"
    page.write_text("<!-- figures: family family.yaml -->\n| stale |\n<!-- /figures -->\n")
    monkeypatch.chdir(root)
    assert main(["figures", "--check", "--tables", "tables", "drift.md"]) == 1
    out, err = capsys.readouterr()
    assert json.loads(out)["differ"][0]["line"] == 2
    last = err.splitlines()[-1]  # above it, the replays' own progress lines
    assert last.startswith("diff2 figures: drift.md: the block of family family.yaml differs")
    assert "differs from its recomputation from tables/ (first difference: line 2)" in last
    assert main(["figures", "--tables", "tables", "drift.md"]) == 0
    assert main(["figures", "--check", "--tables", "tables", "drift.md"]) == 0


@pytest.mark.realdata
def test_the_readme_and_the_results_page_agree_with_the_committed_tables(data_dir, monkeypatch):
    """Every generated block of the README and the results page, recomputed from results/ (the
    replays read the datasets for their sizes)."""
    monkeypatch.setenv("DIFF2_DATA_DIR", str(data_dir))
    result = refresh([ROOT / "README.md", ROOT / "docs" / "results.md"], ROOT / "results",
                     check=True, root=ROOT, renderers={**RENDERERS, "regime": render_regime})
    assert result["differ"] == []


def test_every_committed_table_is_listed_with_its_run_count_and_study_file():
    """results/README.md lists every table of results/ with its study file and its number of runs,
    and lists no table that is not there."""
    import re

    from diff2_flwr.lab.study.tables import read_table

    listed = {m["table"]: (m["study"], int(m["runs"])) for m in re.finditer(
        r"^\| `(?P<table>[^`]+\.csv\.gz)` \| `(?P<study>[^`]+)` \| (?P<runs>\d+) \|",
        (ROOT / "results" / "README.md").read_text(encoding="utf-8"), re.M)}
    present = {p.name for p in (ROOT / "results").glob("*.csv.gz")}
    assert set(listed) == present
    for name, (study_file, runs) in listed.items():
        records = read_table(ROOT / "results" / name)
        assert len(records) == runs, name
        assert load_study(ROOT / study_file).name == name.removesuffix(".csv.gz")
