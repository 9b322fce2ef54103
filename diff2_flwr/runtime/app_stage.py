"""The Flower app's shippable files, staged apart from the project folder so that ``flwr run`` need
not walk it.

Flower 1.42 builds a run's FAB by walking *every* file under the app folder
(``flwr/cli/utils.py::collect_files``, resolving each path) and only then filters them by
``fab-include``. In a checkout the app folder holds ``.venv`` (~48,000 files): each ``flwr run``
spent ~9 CPU-s there (``flwr build`` of this project: 9.5 s, 0.6 MB FAB). :func:`stage_app` copies
the files ``fab-include`` can select (a superset: each pattern's literal leading folders and its
file-name pattern) plus ``pyproject.toml`` and ``.gitignore`` into a scratch folder; Flower's own
filter then picks the same files from it, so the FAB is the same, byte for byte
(tests/test_own_code.py builds both).
"""

from __future__ import annotations

import fnmatch
import os
import shutil
import tomllib
from pathlib import Path

__all__ = ["stage_app"]

_GLOB = set("*?[")


def _roots(patterns: list[str]) -> list[tuple[str, str]] | None:
    """(literal leading folder, file-name pattern) per ``fab-include`` pattern (folder "" for one
    top-level file); None when one starts with a glob (it may select anywhere: nothing to gain by
    staging)."""
    out = []
    for pattern in patterns:
        if pattern.startswith("!"):  # a negation only narrows the selection
            continue
        parts = pattern.strip("/").split("/")
        if len(parts) == 1 and not _GLOB & set(parts[0]):  # one top-level file, e.g. "README.md"
            out.append(("", parts[0]))
            continue
        literal = []
        for part in parts[:-1]:
            if _GLOB & set(part):
                break
            literal.append(part)
        if not literal:
            return None
        out.append(("/".join(literal), parts[-1]))
    return out


def stage_app(app_dir: Path, dest: Path) -> Path:
    """``dest`` holding the files of ``app_dir`` that ``flwr run`` could ship, or ``app_dir`` itself
    when its ``pyproject.toml`` has no ``fab-include`` whose patterns start with a folder."""
    app_dir = Path(app_dir)
    try:
        patterns = tomllib.loads((app_dir / "pyproject.toml").read_text())["tool"]["flwr"]["app"][
            "fab-include"]
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return app_dir
    roots = _roots(list(patterns))
    if not roots:
        return app_dir
    dest.mkdir(parents=True, exist_ok=True)
    # Flower reads the
    for name in ("pyproject.toml", ".gitignore", *(name for root, name in roots if not root)):
        entry = app_dir / name  # first two; a top-level file fab-include names is shipped
        if entry.is_file() and not entry.is_symlink():
            shutil.copy2(entry, dest / name)
    for root, name_pattern in roots:
        if not root:
            continue
        top = app_dir / root
        for dirpath, dirnames, filenames in os.walk(top, followlinks=False):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            for filename in filenames:
                source = Path(dirpath) / filename
                if source.is_symlink() or not fnmatch.fnmatchcase(filename, name_pattern):
                    # Flower ships no symlink; a name the pattern cannot match is never shipped
                    continue
                target = dest / source.relative_to(app_dir)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, target)
    return dest
