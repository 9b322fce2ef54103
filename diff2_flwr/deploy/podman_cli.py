"""The command line of ``python -m diff2_flwr.deploy.podman`` (its ``_main`` runs the commands): the
parser (``images``, ``run``, ``down``) and ``run``'s CONFIG and overrides, settled and checked as
``diff2 run`` does.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..runtime.config import load_config, set_assignments
from ..runtime.paths import APP_DIR

__all__ = ["DEPLOY_CONFIG", "build_parser", "run_request"]

#: The config of ``run`` when none is given: the one the compose files are written for.
DEPLOY_CONFIG = "configs/deploy.yaml"


def build_parser(description: str) -> argparse.ArgumentParser:
    """The parser of ``python -m diff2_flwr.deploy.podman`` (``description``: its first help
    line)."""
    parser = argparse.ArgumentParser(prog="python -m diff2_flwr.deploy.podman",
                                     description=description)
    sub = parser.add_subparsers(dest="command", required=True)
    images = sub.add_parser("images", help="build the stand-ins for Flower's images unless present")
    images.add_argument("--force", action="store_true", help="rebuild them (and the Debian base)")
    run = sub.add_parser("run",
                         help="bring the compose file up, run CONFIG with flwr run, bring it down")
    run.add_argument("config", nargs="?", default=None,
                     help=f"a config inside the app folder (default: {DEPLOY_CONFIG})")
    run.add_argument("--tls", action="store_true",
                     help="docker-compose.tls.yml (TLS, SuperNode authentication)")
    run.add_argument("--resume", action="store_true",
                     help="continue from deploy/outputs/checkpoint.npz")
    run.add_argument("--set", action="extend", nargs="+", metavar="KEY=VALUE",
                     help="override keys of CONFIG, e.g. --set training.rounds=40 "
                          "privacy.epsilon=8 (or --set once per key; each value is read as YAML; "
                          "validated like the file)")
    sub.add_parser("down", help="bring a leftover project down")
    return parser


def run_request(args: argparse.Namespace, project_dir: Path = APP_DIR) -> tuple[str, dict[str,
                                                                                          Any]]:
    """CONFIG and the overrides of ``run``, settled as ``diff2 run`` settles them (``--set a=1
    CONFIG``) and checked the same way (malformed assignments, unknown keys, types, ranges) before
    any podman command."""
    config, overrides = set_assignments(args.set, args.config, DEPLOY_CONFIG)
    load_config(Path(project_dir) / config, overrides)
    return config, overrides
