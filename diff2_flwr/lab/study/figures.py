"""Published figures that recompute themselves (issue 42, item 1): the blocks of the README and the
documentation that a command generates from the committed run tables, and the check that they
agree.

A generated block is written between two comments::

    <!-- figures: family configs/confirm2/family.yaml -->
    | study | ε | ... |
    <!-- /figures -->

Kinds: ``family FILE`` (the path from the repository's root) is the family's table
(:func:`~.family.markdown`: every primary test with its ratio and 95 % interval, raw p, the
within-study and the family's Holm p, then each study's tuning budgets), recomputed by replaying
each study of the family from its run table ``results/<study name>.csv.gz``
(:func:`~.family.run_family` with ``tables``); ``study FILE`` is one study's tables
(:func:`render_study`: its primary results, then per ε its chosen points, budgets and tests), from
its replay; ``verdict FILE`` is the family's verdict in words (:func:`render_verdict`); ``plot
FILE`` is one study's figure per ε (:func:`render_plot`: each criterion's seed mean over rounds,
the report's ``figure_eps<ε>.png``), drawn from its replay into ``docs/img/<study>_eps<ε>.png``
and linked from the page. Another
room adds its own kind by passing its
renderer to :func:`refresh` (the regime map's ``regime FOLDER``:
:func:`diff2_flwr.lab.regime.published.render_regime`; study/ imports no room above it).
``diff2 figures FILES`` rewrites the blocks; ``diff2 figures --check FILES`` writes nothing and
fails when one differs, which a test runs on the README and the results page: a number in a block
cannot drift from its tables. A figure's pixels are not compared (matplotlib's PNG bytes change
with its version and fonts): ``--check`` checks that every image a block links exists, and
``diff2 figures`` draws them again.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Mapping

from .family import markdown, run_family, verdict_markdown
from .report import format_inference, format_table
from .runner import load_study, replay_study

__all__ = ["BLOCK", "IMAGES", "RENDERERS", "Renderer", "refresh", "render_family", "render_plot",
           "render_study", "render_verdict"]

#: A generated block: its opening comment (kind and argument), its body, its closing comment.
BLOCK = re.compile(r"(?P<open><!-- figures: (?P<kind>[a-z]+) (?P<arg>\S+) -->\n)(?P<body>.*?)"
                   r"(?P<close><!-- /figures -->)", re.S)
#: A renderer: (argument, tables folder, repository root, scratch folder) -> the block's body.
Renderer = Callable[[str, Path, Path, Path], str]


def render_family(arg: str, tables: Path, root: Path, work: Path) -> str:
    """The body of a ``family`` block: the family table of ``arg`` (a family file, a path from
    ``root``) from the run tables in ``tables``."""
    result = run_family(root / arg, output_root=work, tables=tables)
    table = markdown(result).split("\n")
    first = next(i for i, line in enumerate(table) if line.startswith("|"))
    return "\n".join(table[first:]).rstrip("\n") + "\n"


def render_verdict(arg: str, tables: Path, root: Path, work: Path) -> str:
    """The body of a ``verdict`` block: the family ``arg``'s verdict in words
    (:func:`~.family.verdict_markdown`), from the run tables in ``tables``."""
    return verdict_markdown(run_family(root / arg, output_root=work, tables=tables))


def render_study(arg: str, tables: Path, root: Path, work: Path) -> str:
    """The body of a ``study`` block: the report's tables of the study file ``arg`` (a path from
    ``root``), replayed from its run table in ``tables``: its protocol and primary results, then
    per ε the chosen points with their means, the picks on a grid edge, the tuning budgets and
    every test with its interval (no wall time, no plots: nothing a replay does not recompute)."""
    summary, _ = replay_study(load_study(root / arg), tables, work)
    parts = [format_inference(summary), ""]
    for eps, eps_summary in summary["epsilons"].items():
        parts += [f"##### ε = {eps}", "", format_table(eps_summary), ""]
    return "\n".join(parts).rstrip("\n") + "\n"


#: Where a ``plot`` block's images go (from the repository's root), and the folder of ``work`` a
#: renderer leaves the files it makes in, by their path from the root: :func:`refresh` moves them
#: there (or, with ``check``, only checks that they exist).
IMAGES, MADE = "docs/img", "made"


def render_plot(arg: str, tables: Path, root: Path, work: Path) -> str:
    """The body of a ``plot`` block: the study file ``arg``'s figure per ε (its report's
    ``figure_eps<ε>.png``: each criterion's mean over the evaluation seeds by round, per method),
    drawn from its replay of the run table in ``tables`` and left in ``work`` for :func:`refresh`
    as ``docs/img/<study name>_eps<ε>.png``; one image link per ε, from the root (refresh makes it
    relative to the page)."""
    study = load_study(root / arg)
    _, folder = replay_study(study, tables, work / f"plot-{study.name}", make_plots=True)
    lines = []
    for eps in study.epsilons:
        name = f"figure_eps{eps:g}.png"
        target = f"{IMAGES}/{study.name}_eps{eps:g}.png"
        made = work / MADE / target
        made.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(folder / name, made)
        lines.append(f"![{study.name}, ε = {eps:g}: each method's mean over the evaluation seeds "
                     f"by round, replayed from its run table]({target})")
    return "\n\n".join(lines) + "\n"


#: The kinds this room renders.
RENDERERS: dict[str, Renderer] = {"family": render_family, "plot": render_plot,
                                  "study": render_study, "verdict": render_verdict}

#: An image link of a block's body, its target a path from the repository's root.
_LINK = re.compile(r"(!\[[^\]]*\]\()([^)\s]+)(\))")


def _linked_from(body: str, page: Path, root: Path) -> str:
    """``body`` with each image link made relative to ``page``'s folder."""
    return _LINK.sub(lambda m: m[1] + Path(os.path.relpath(root / m[2], page.parent)).as_posix()
                     + m[3], body)


def refresh(files: list[Path], tables: Path, *, check: bool, root: Path | None = None,
            renderers: Mapping[str, Renderer] | None = None) -> dict[str, Any]:
    """Recompute every block of ``files`` with ``renderers`` (default :data:`RENDERERS`): rewrite
    them, or with ``check`` only compare. Returns the blocks seen and those that differ (file,
    block, first differing line). A block of a kind no renderer knows stops it in one line."""
    root = root or Path.cwd()
    renderers = RENDERERS if renderers is None else renderers
    seen, differ = [], []
    with tempfile.TemporaryDirectory(prefix="diff2-figures-") as work:
        for path in files:
            text = path.read_text(encoding="utf-8")
            out, at, changed = [], 0, False
            for m in BLOCK.finditer(text):
                if m["kind"] not in renderers:
                    raise ValueError(
                        f"{path}: a figures block of kind {m['kind']!r}; expected one of "
                        f"{', '.join(sorted(renderers))}")
                body = renderers[m["kind"]](m["arg"], tables, root, Path(work))
                body = _linked_from(body, path, root)
                block = f"{m['kind']} {m['arg']}"
                seen.append({"file": str(path), "block": block})
                missing = _place(Path(work) / MADE, root, check=check)
                if missing:
                    differ.append({"file": str(path), "block": block, "missing": missing})
                if body != m["body"]:
                    old, new = m["body"].split("\n"), body.split("\n")
                    line = text.count("\n", 0, m.start("body")) + 1 + next(
                        (i for i, (a, b) in enumerate(zip(old, new)) if a != b),
                        min(len(old), len(new)))
                    differ.append({"file": str(path), "block": block, "line": line})
                    changed = True
                out += [text[at:m.start("body")], body]
                at = m.end("body")
            out.append(text[at:])
            if not check and changed:
                path.write_text("".join(out), encoding="utf-8")
    return {"tables": str(tables), "blocks": seen, "differ": differ, "written": not check}


def _place(made: Path, root: Path, *, check: bool) -> list[str]:
    """Move the files a renderer made (under ``made``, by their path from the root) into ``root``;
    with ``check``, move nothing and return those that do not exist there. ``made`` is emptied."""
    missing = []
    for src in sorted(p for p in made.rglob("*") if p.is_file()) if made.is_dir() else []:
        rel = src.relative_to(made)
        dest = root / rel
        if check:
            if not dest.is_file():
                missing.append(rel.as_posix())
        else:
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(src), dest)
    shutil.rmtree(made, ignore_errors=True)
    return missing
