"""The regime map as a generated block of the documentation (``<!-- figures: regime FOLDER -->``,
:mod:`diff2_flwr.lab.study.figures`): the map's tables and fits recomputed from the committed run
tables of the family's studies alone."""

from __future__ import annotations

from pathlib import Path

from .read import read_cells, replay_tables
from .report import markdown
from .runner import regime_map

__all__ = ["render_regime"]


def render_regime(arg: str, tables: Path, root: Path, work: Path) -> str:
    """The body of a ``regime`` block: the map of the study files in ``arg`` (a folder or a file,
    a path from ``root``), every study replayed from its table in ``tables``; the map's title
    dropped and its sections as level-4 headings, to sit inside a page."""
    cells = read_cells(replay_tables([root / arg], tables, work))
    lines = markdown(cells, regime_map(cells)).split("\n")
    body = [f"####{line[2:]}" if line.startswith("## ") else line
            for line in lines if not line.startswith("# ")]
    while body and not body[0]:
        body.pop(0)
    return "\n".join(body).rstrip("\n") + "\n"
