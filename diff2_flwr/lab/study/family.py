"""A family of studies tested together: Holm across the primary tests of several finished studies.

A confirmation may span studies (one per dataset, each with its ε): its pre-registered family is the
primary tests of all of them. A *family file* names the studies (paths relative to the file) and
the level::

    name: confirm
    studies: [california.yaml, gas_turbine.yaml]
    alpha: 0.05

``diff2 family FILE`` reads each study's ``summary.json`` (from the study's ``output.dir``, or
``--output``), collects every primary test (each study declares its endpoints in its ``analysis``
block), adjusts their p-values with Holm over the whole family, and writes ``family.json`` and
``family.md`` to ``<output>/<name>/``; it prints the same JSON object on stdout. A primary result
is significant when its family-adjusted p is below α; each study's own report adjusts within
that study only, which is weaker than the family's correction when the family spans studies.

Each result keeps its study's interval fields (:mod:`.intervals`: ``ci95_difference``, ``ratio``,
``ci95_ratio``, two-sided 95 % whatever α), and each study its tuning budgets per ε and method
(``budgets``: configurations and tuning runs); ``family.md`` shows both.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path
from typing import Any, Mapping

from ...runtime.config import ConfigError, read_yaml
from .claims import atomic_write_text
from .inference import holm
from .intervals import LEVEL
from .report import RATIO_LEGEND, _endpoint, format_budgets, with_interval
from .runner import load_study, replay_study

__all__ = ["FamilyError", "run_family", "verdict_markdown"]


class FamilyError(ConfigError):
    """An invalid family file, or a study of it that has not run; the message names the file and
    what to do."""


def _load(path: Path) -> dict[str, Any]:
    data = read_yaml(path, "family", FamilyError)
    keys = {"name", "studies", "alpha"}
    if not isinstance(data, Mapping) or set(data) - keys or "studies" not in data:
        raise FamilyError(f"{path}: expected a mapping with keys name, studies (a list of study "
                          f"files) and optionally alpha. Found {data!r}.")
    studies = data["studies"]
    if not isinstance(studies, list) or not studies or not all(isinstance(s, str) for s in studies):
        raise FamilyError(f"{path}: key `studies`: expected a non-empty list of study files "
                          f"(relative to {path.parent}). Found {studies!r}.")
    alpha = data.get("alpha", 0.05)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not 0 < alpha < 1:
        raise FamilyError(f"{path}: key `alpha`: expected a number in (0, 1). Found {alpha!r}.")
    return {"name": str(data.get("name", path.stem)), "studies": [path.parent / s for s in studies],
            "alpha": float(alpha)}


def run_family(path: str | Path, *, output_root: str | Path | None = None,
               tables: str | Path | None = None) -> dict[str, Any]:
    """Holm across the primary tests of the family's studies; writes family.json and family.md.

    With ``tables`` (a folder of run tables, e.g. the repository's ``results/``) every study is
    first replayed from ``<tables>/<study name>.csv.gz`` alone (:func:`~.runner.run_study` with
    ``table``) into ``output_root`` (a fresh temporary folder by default), and the family is
    computed from those replays: every figure from the committed tables, nothing computed."""
    path = Path(path)
    spec = _load(path)
    if tables is not None and output_root is None:
        output_root = tempfile.mkdtemp(prefix="diff2-family-")
    rows, studies = [], []
    for study_path in spec["studies"]:
        study = load_study(study_path)
        if not study.analysis.primary:
            raise FamilyError(f"{study_path}: the study declares no primary endpoint "
                              "(`analysis.primary`), so it has nothing to contribute to a "
                              "confirmation family. Declare them before it runs.")
        root = Path(output_root or study.output_dir).expanduser().resolve() / study.name
        if tables is not None:
            root = replay_study(study, tables, output_root)[1]
        summary_file = root / "summary.json"
        if not summary_file.is_file():
            raise FamilyError(f"{study_path}: no results at {summary_file}. Run it first: "
                              f"diff2 experiment {study_path}"
                              + (f" --output {output_root}" if output_root else ""))
        summary = json.loads(summary_file.read_text())
        primary = summary.get("inference", {}).get("primary_results")
        if not primary:
            raise FamilyError(f"{summary_file}: no primary results (written by an older diff2, or "
                              "the study's analysis block changed). Run `diff2 experiment` on it "
                              "again: it reuses every run.")
        studies.append({"study": study.name, "source": str(study_path),
                        "summary": str(summary_file),
                        "wall_time_s": summary.get("wall_time_s"),
                        "dataset": summary.get("dataset", {}).get("name"),
                        "budgets": {eps: e["budgets"]
                                    for eps, e in summary.get("epsilons", {}).items()
                                    if "budgets" in e}})
        rows += [dict(r, study=study.name, p_study_adjusted=r["p_adjusted"]) for r in primary]
    for r, p in zip(rows, holm([r["p_value"] for r in rows])):
        r["p_adjusted"] = p
        r["significant"] = bool(math.isfinite(p) and p < spec["alpha"])
    out = {"family": spec["name"], "source": str(path), "alpha": spec["alpha"],
           "adjustment": "holm", "ci_level": LEVEL, "size": len(rows), "studies": studies,
           "results": rows,
           "significant": [f"{r['study']} ε={r['epsilon']:g} {r['pair']} {r['criterion']}@{r['at']}"
                           for r in rows if r["significant"]]}
    root = Path(output_root
                or load_study(spec["studies"][0]).output_dir).expanduser().resolve() / spec["name"]
    root.mkdir(parents=True, exist_ok=True)
    atomic_write_text(root / "family.json", json.dumps(out, indent=2, default=str) + "\n")
    atomic_write_text(root / "family.md", markdown(out))
    return out


#: Significant digits of a ratio and its interval: a ratio near 1 needs four (1.004 is not 1).
RATIO_DIGITS = 4


def _fmt(v: Any, digits: int = 3) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "–"
    return f"{v:.{digits}g}" if isinstance(v, float) else str(v)


def markdown(result: Mapping[str, Any]) -> str:
    """The family's table: every primary test with its mean difference and ratio (each with its 95 %
    interval), its raw, within-study and family (Holm) adjusted p; then each study's tuning
    budgets."""
    lines = [f"# Family `{result['family']}`", "",
             f"Holm over the {result['size']} primary tests of {len(result['studies'])} studies, α "
             f"= {result['alpha']}. {RATIO_LEGEND}",
             "", "| study | ε | comparison | endpoint | alternative | mean difference (treatment − "
             "control) [95 % CI] | ratio [95 % CI] | p | Holm p (study) | Holm p (family) | "
             "result |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["results"]:
        lower = r["treatment"] if r["lower"] == "treatment" else r["control"]
        verdict = f"significant: {lower} lower" if r["significant"] else "not significant"
        lines.append(f"| {r['study']} | {r['epsilon']:g} | {r['pair']} | {_endpoint(r)} | "
                     f"{r['alternative']} | "
                     f"{with_interval(r['mean_difference'], r.get('ci95_difference'))} | "
                     f"{with_interval(r.get('ratio'), r.get('ci95_ratio'), RATIO_DIGITS)} | "
                     f"{_fmt(r['p_value'])} | {_fmt(r['p_study_adjusted'])} | "
                     f"{_fmt(r['p_adjusted'])} | {verdict} |")
    for s in result["studies"]:
        for eps, budgets in (s.get("budgets") or {}).items():
            lines += ["", f"**{s['study']}, ε = {float(eps):g}.** {format_budgets(budgets)}"]
    return "\n".join(lines) + "\n"


def verdict_markdown(result: Mapping[str, Any]) -> str:
    """The family's verdict in a few lines: how many of its tests are significant which way under
    Holm, then every test under its verdict with its ratio, 95 % interval and family Holm p (the
    sentences of a result, generated so that they cannot drift from the tables)."""
    datasets = {s["study"]: s.get("dataset") or s["study"] for s in result["studies"]}
    groups: dict[str, list[str]] = {}
    for r in result["results"]:
        lower = r["treatment"] if r["lower"] == "treatment" else r["control"]
        a = f"{result['alpha']:g}"
        key = (f"{lower} lower (Holm p < {a})" if r["significant"]
               else f"no claim either way (Holm p ≥ {a})")
        groups.setdefault(key, []).append(
            f"{datasets[r['study']]}, ε = {r['epsilon']:g}, {_endpoint(r)}: ratio "
            f"{with_interval(r.get('ratio'), r.get('ci95_ratio'), RATIO_DIGITS)}, Holm p = "
            f"{_fmt(r['p_adjusted'], 2)}")
    pairs = sorted({r["pair"] for r in result["results"]})
    counts = "; ".join(f"{key}: {len(items)}" for key, items in sorted(groups.items()))
    lines = [f"Holm over the family's {result['size']} primary tests (α = {result['alpha']:g}; "
             f"{', '.join(pairs)}; ratio = treatment / control with its 95 % interval): "
             f"{counts}.", ""]
    for key, items in sorted(groups.items()):
        lines += [f"- **{key}** ({len(items)} of {result['size']}):",
                  *(f"  - {item}" for item in items)]
    return "\n".join(lines) + "\n"
