"""Write the run-config keys of pyproject.toml's [tool.flwr.app.config] from the config's
declaration.

Flower refuses a run-config key the app does not declare, so every settable key of the experiment
file (``diff2_flwr.runtime.config.config_keys()``) is declared there with the default "" (= as in
the file). The list is derived, never edited by hand: after declaring a new setting, run

    .venv/bin/python scripts/run_config_keys.py

(``--check`` exits 1 if the file is not up to date; tests/test_config.py checks it too).
"""

from __future__ import annotations

import sys
from pathlib import Path

from diff2_flwr.runtime.config import config_keys

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
#: The last line before the generated keys, and the first line after them.
START = ("# (strings are read as YAML). Generated from the config's declaration: "
         "scripts/run_config_keys.py.\n")
END = "\n# ---------------------------------------------------------------- tools\n"


def render(text: str) -> str:
    """``text`` (pyproject.toml) with the generated keys between :data:`START` and :data:`END`."""
    head, start, rest = text.partition(START)
    _, end, tail = rest.partition(END)
    if not start or not end:
        raise SystemExit(
            f"{PYPROJECT}: cannot find the run-config list ({START.strip()!r} ... {END.strip()!r})")
    keys = "".join(f'"{key}" = ""\n' for key in config_keys())
    return head + start + keys + end + tail


def main(argv: list[str]) -> int:
    """Rewrite pyproject.toml's run-config keys when they are stale; with ``--check``, write
    nothing and return 1 if they are stale (else 0)."""
    text = PYPROJECT.read_text()
    new = render(text)
    if "--check" in argv:
        return 0 if new == text else 1
    if new != text:
        PYPROJECT.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
