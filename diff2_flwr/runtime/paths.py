"""Where an experiment file named in the Flower run config is found."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["APP_DIR", "resolve_config_path"]

#: The folder holding ``configs/`` next to this package: the project root in a checkout,
#: the installed app's folder inside a Flower run.
APP_DIR = Path(__file__).resolve().parents[2]


def resolve_config_path(value: str | os.PathLike[str], app_dir: Path = APP_DIR) -> Path:
    """An absolute path as given; a relative one in the app folder first, then the working directory."""
    path = Path(value).expanduser()
    if path.is_absolute():
        candidates = [path]
    else:
        candidates = [app_dir / path, Path.cwd() / path]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    tried = ", ".join(str(c) for c in candidates)
    raise FileNotFoundError(
        f"Run-config key `config`: experiment file {str(value)!r} not found (looked at {tried}). "
        "Pass an existing YAML file, e.g. --run-config \"config='configs/default.yaml'\"."
    )
