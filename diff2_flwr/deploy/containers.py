"""Podman itself, for :mod:`.podman`: the environment podman runs with (this project's
containers.conf), running podman and podman-compose (a failure or a timeout is a
:class:`PodmanError` carrying the command and its output), the images' official names, whether one
exists and its labels, the script that finds files' bytes inside a container; and, on the host,
whether a port is free and the copy of the project a compose build starts from.
"""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import subprocess
from pathlib import Path

from ..runtime.launch import tool
from ..runtime.paths import APP_DIR
from .compose import FLWR_VERSION

__all__ = ["CONTAINERS_CONF", "FIND_FILES_PROBE", "PROJECT_FILES", "STANDIN_DIR", "PodmanError",
           "copy_project",
           "image_exists", "image_label", "official_name", "podman", "podman_compose_tool",
           "podman_env", "port_free",
           "run_tool"]

STANDIN_DIR = APP_DIR / "scripts" / "standin"
#: runc instead of crun, no default ulimits: what these machines need (see the file).
CONTAINERS_CONF = STANDIN_DIR / "containers.conf"
#: What the build context and the compose files need, copied into a scratch project folder.
PROJECT_FILES = ("docker-compose.yml", "docker-compose.tls.yml", ".dockerignore", "pyproject.toml",
                 "README.md",
                 "server", "clients", "diff2_flwr", "configs")
#: Run inside a container as ``python3 -c FIND_FILES_PROBE WANTED SIZES`` (JSON: {SHA-256: file
#: name}, [sizes]): prints {file name: [paths]} of every file of those bytes (by size, then
#: SHA-256); /proc, /sys, /dev skipped.
FIND_FILES_PROBE = (
    "import hashlib, json, os, sys\n"
    "wanted, sizes = json.loads(sys.argv[1]), set(json.loads(sys.argv[2]))\n"
    "found = {}\n"
    "for root, dirs, names in os.walk('/'):\n"
    "    dirs[:] = [d for d in dirs if os.path.join(root, d) not in ('/proc', '/sys', '/dev')]\n"
    "    for name in names:\n"
    "        path = os.path.join(root, name)\n"
    "        try:\n"
    "            if os.path.islink(path) or os.path.getsize(path) not in sizes:\n"
    "                continue\n"
    "            with open(path, 'rb') as handle:\n"
    "                digest = hashlib.sha256(handle.read()).hexdigest()\n"
    "        except OSError:\n"
    "            continue\n"
    "        if digest in wanted:\n"
    "            found.setdefault(wanted[digest], []).append(path)\n"
    "print(json.dumps(found))\n"
)


class PodmanError(RuntimeError):
    """A podman or podman-compose command failed; the message carries the command and its output."""


def podman_env() -> dict[str, str]:
    """The environment for podman: ``CONTAINERS_CONF`` = this project's file unless already set."""
    env = dict(os.environ)
    env.setdefault("CONTAINERS_CONF", str(CONTAINERS_CONF))
    return env


def run_tool(cmd: list[str], *, timeout: float = 600, check: bool = True, cwd: Path | None = None,
             input: str | bytes | None = None, text: bool = True) -> subprocess.CompletedProcess:
    """``cmd`` (podman, podman-compose, debootstrap) run with :func:`podman_env`, its output
    captured; a timeout, or with ``check`` a non-zero exit, is a :class:`PodmanError`."""
    try:
        done = subprocess.run(cmd, cwd=cwd, env=podman_env(), capture_output=True, text=text,
                              timeout=timeout, input=input)
    except subprocess.TimeoutExpired as err:
        raise PodmanError(f"`{shlex.join(cmd)}` did not finish within {timeout:.0f} s.") from err
    if check and done.returncode != 0:
        out = (done.stdout or "") + (done.stderr or "") if text else ""
        raise PodmanError(f"`{shlex.join(cmd)}` failed with code {done.returncode}:\n{out[-4000:]}")
    return done


def podman(*args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
    """``podman ARGS`` run by :func:`run_tool` (this project's containers.conf, output captured)."""
    return run_tool(["podman", *args], timeout=timeout, check=check)


def podman_compose_tool() -> str | None:
    """The path of ``podman-compose`` (beside this Python first, else on PATH), or None."""
    try:
        return tool("podman-compose")
    except FileNotFoundError:
        return None


def official_name(target: str) -> str:
    """Flower's official image name of ``target`` (``superlink``, ...) at the pinned version."""
    return f"docker.io/flwr/{target}:{FLWR_VERSION}"


def image_exists(name: str) -> bool:
    """Whether podman holds the image ``name`` (pulled or built)."""
    return podman("image", "exists", name, check=False, timeout=60).returncode == 0


def image_label(name: str, label: str) -> str | None:
    """The value of image ``name``'s label ``label``, or None (no such image or label)."""
    done = podman("image", "inspect", "--format", f'{{{{index .Labels "{label}"}}}}', name,
                  check=False, timeout=60)
    value = done.stdout.strip()
    return value if done.returncode == 0 and value and value != "<no value>" else None


def port_free(port: int) -> bool:
    """Whether 127.0.0.1:``port`` can be bound (nothing listens there)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def copy_project(dest: Path, source: Path = APP_DIR) -> Path:
    """The compose files and the build context (no caches, no venv) copied into ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in PROJECT_FILES:
        src = source / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
                            dirs_exist_ok=True)
        elif src.is_file():
            shutil.copy2(src, dest / name)
    return dest
