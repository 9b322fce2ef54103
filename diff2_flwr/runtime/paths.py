"""Where an experiment file named in the Flower run config is found: anywhere for the run
submitter's own processes (:func:`resolve_config_path`), only inside the app bundle or the node's
own folder on a data owner's node (:func:`resolve_node_experiment`)."""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath
from typing import Any, Mapping

__all__ = ["APP_DIR", "EXPERIMENTS_KEY", "NodePathError", "resolve_config_path",
           "resolve_node_experiment"]

#: The folder holding ``configs/`` next to this package: the project root in a checkout,
#: the installed app's folder inside a Flower run.
APP_DIR = Path(__file__).resolve().parents[2]


def resolve_config_path(value: str | os.PathLike[str], app_dir: Path = APP_DIR) -> Path:
    """An absolute path as given; a relative one in the app folder first, then the working
    directory."""
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


#: Node config key of a data owner's own folder of experiment files (besides the app bundle's).
EXPERIMENTS_KEY = "experiments"
#: What an experiment file's name ends with: a node opens nothing else the run config names.
EXPERIMENT_SUFFIXES = (".yaml", ".yml")


class NodePathError(ValueError):
    """A run config names an experiment file a data owner's node does not open (outside its allowed
    folders)."""


def resolve_node_experiment(value: str, node_config: Mapping[str, Any],
                            app_dir: Path = APP_DIR) -> Path:
    """The experiment file a data owner's node opens for run-config key ``config``: a ``.yaml`` file
    inside the app bundle (``app_dir``) or inside the folder its node config names
    (``experiments``), given relative to one of them or as an absolute path into one, after every
    symlink is resolved. ``..``, another suffix or a file outside those folders is refused, naming
    the rule, never opening the file.

    Raises:
        NodePathError: the path is not one the node opens, or no such file exists in its folders.
    """
    text = str(value)
    path = PurePosixPath(text)
    rule = (
        "a data owner's node opens only a .yaml file inside the app bundle or inside its own node "
            f"config's `{EXPERIMENTS_KEY}` folder")
    if not text or text.startswith("~") or ".." in path.parts or "\\" in text:
        raise NodePathError(
            f"Run-config key `config`: {text!r} is refused: {rule}; give a path such as "
                            "'configs/deploy.yaml'.")
    if path.suffix not in EXPERIMENT_SUFFIXES:
        raise NodePathError(f"Run-config key `config`: {text!r} is refused: its name must end with "
                            f"{' or '.join(EXPERIMENT_SUFFIXES)} ({rule}).")
    bases = [Path(app_dir)]
    if node_config.get(EXPERIMENTS_KEY):
        bases.append(Path(str(node_config[EXPERIMENTS_KEY])))
    for base in bases:
        root = base.resolve()
        candidate = (root / path).resolve()  # an absolute path stays itself
        if candidate.is_relative_to(root) and candidate.is_file():
            return candidate
    raise NodePathError(
        f"Run-config key `config`: experiment file {text!r} is not in this node's app bundle"
                        + (f" or its `{EXPERIMENTS_KEY}` folder" if len(bases) > 1 else "")
                        + f" ({rule}). Use one of the bundle's configs/*.yaml, or ask the node's "
                          f"operator to place the file in its `{EXPERIMENTS_KEY}` folder.")
