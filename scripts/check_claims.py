#!/usr/bin/env python3
"""The claims rule (issue 20, "Claims that hold"): a line of prose on a page that states a
significance ("p =", "p ≤", "significant", …) also names Holm, BH, "adjusted" or "exploratory".

``python scripts/check_claims.py [FILE ...]`` (default: README.md and every page under docs/) prints
one JSON object on stdout (the unqualified lines per file) and exits 1 when there is one;
tests/test_published_claims.py runs the rule on every page. The numbers themselves are recomputed
from the committed run tables (``diff2 figures --check``, tests/test_figures.py).

Until issue 42 this script was ``adjust_published.py``, which re-adjusted the p-values printed in
docs/results.md; those studies kept no runs and their numbers are withdrawn, so that part is gone
(``git show c4f6f68:scripts/adjust_published.py``).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLAIM = re.compile(r"(\bp′?\s*[=≈≤<≥]|[Ss]ignifican)")
QUALIFIED = re.compile(r"(Holm|\bBH\b|\badjusted\b|exploratory)")


def unqualified_claim_lines(text: str) -> list[tuple[int, str]]:
    """Lines of prose that state a significance ("p =", "p ≤", "significant", …) without an adjusted
    p or "exploratory".

    Table rows (lines starting with "|") and fenced code are exempt: every t-test table carries its
    adjusted columns.
    """
    out = []
    fenced = False
    for n, line in enumerate(text.splitlines(), start=1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced or line.lstrip().startswith("|"):
            continue
        if CLAIM.search(line) and not QUALIFIED.search(line):
            out.append((n, line))
    return out


def main(argv: list[str] | None = None) -> int:
    """Check the files named (default: the README and the docs); 1 if a line breaks the rule."""
    files = [Path(a) for a in (sys.argv[1:] if argv is None else argv)] or [
        ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    found = {str(f): unqualified_claim_lines(f.read_text(encoding="utf-8")) for f in files}
    found = {f: lines for f, lines in found.items() if lines}
    print(json.dumps({"files": len(files), "unqualified": found}))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
