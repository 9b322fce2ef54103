"""Published figures that recompute themselves (issue 42, item 1): the blocks of the README and the
documentation that a command generates from the committed run tables, and the check that they
agree.

A generated block is written between two comments::

    <!-- figures: family configs/confirm2/family.yaml -->
    | study | ε | ... |
    <!-- /figures -->

``family FILE`` (the path from the repository's root) is the family's table
(:func:`~.family.markdown`: every primary test with its ratio and 95 % interval, raw p, the
within-study and the family's Holm p, then each study's tuning budgets), recomputed by replaying
each study of the family from its run
table ``results/<study name>.csv.gz`` (:func:`~.family.run_family` with ``tables``). ``diff2 figures
FILES`` rewrites the blocks; ``diff2 figures --check FILES`` writes nothing and fails when one
differs, which a test runs on the README and the results page: a number in a block cannot drift
from its tables.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Any

from .family import markdown, run_family

__all__ = ["BLOCK", "refresh", "render"]

#: A generated block: its opening comment (kind and argument), its body, its closing comment.
BLOCK = re.compile(r"(?P<open><!-- figures: (?P<kind>[a-z]+) (?P<arg>\S+) -->\n)(?P<body>.*?)"
                   r"(?P<close><!-- /figures -->)", re.S)
_KINDS = ("family",)


def render(kind: str, arg: str, tables: Path, root: Path, work: Path) -> str:
    """The body of a block of ``kind`` for ``arg`` (a path from ``root``), from the run tables in
    ``tables``."""
    if kind not in _KINDS:
        raise ValueError(f"a figures block of kind {kind!r}: expected one of {', '.join(_KINDS)}")
    result = run_family(root / arg, output_root=work, tables=tables)
    table = markdown(result).split("\n")
    first = next(i for i, line in enumerate(table) if line.startswith("|"))
    return "\n".join(table[first:]).rstrip("\n") + "\n"


def refresh(files: list[Path], tables: Path, *, check: bool, root: Path | None = None
            ) -> dict[str, Any]:
    """Recompute every block of ``files``: rewrite them, or with ``check`` only compare. Returns
    the blocks seen and those that differ (file, block, first differing line)."""
    root = root or Path.cwd()
    seen, differ = [], []
    with tempfile.TemporaryDirectory(prefix="diff2-figures-") as work:
        for path in files:
            text = path.read_text(encoding="utf-8")
            out, at, changed = [], 0, False
            for m in BLOCK.finditer(text):
                body = render(m["kind"], m["arg"], tables, root, Path(work))
                block = f"{m['kind']} {m['arg']}"
                seen.append({"file": str(path), "block": block})
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
