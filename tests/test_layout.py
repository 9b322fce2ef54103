"""The rooms of the package and the direction of their imports (ARCHITECTURE: math ← task ← runtime
← Flower glue / deployment / experiments ← CLI), checked on the source: a new upward import or a
circle between files fails here."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "diff2_flwr"

#: room -> rooms it may import (besides itself).
ALLOWED = {
    "core": set(),
    "task": {"core"},
    "runtime": {"core", "task"},
    "fl": {"core", "task", "runtime"},
    "deploy": {"core", "task", "runtime"},
    # The audit drives the Flower glue on purpose (it audits the production path).
    "lab": {"core", "task", "runtime", "fl"},
    "cli": {"core", "task", "runtime", "fl", "deploy", "lab"},
    # The Python API facade at the package top: the Flower glue built on the runtime.
    "api": {"core", "task", "runtime", "fl"},
}
#: third-party packages a room must not import.
FORBIDDEN_THIRD_PARTY = {"core": {"flwr", "yaml"}, "task": {"flwr", "yaml"}, "runtime": {"flwr"}}


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[str, int]]:
    """Absolute names of every module imported by ``path`` (top level and inside functions)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    me = _module_name(path).split(".")
    package = me if path.name == "__init__.py" else me[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if node.module is None or (node.level and not node.module):
                found += [(f"{mod}.{alias.name}", node.lineno) for alias in node.names]
            else:
                found.append((mod, node.lineno))
    return found


def _room(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "diff2_flwr" or len(parts) < 2:
        return None
    return "cli" if parts[1] == "cli" else parts[1]


FILES = sorted(PKG.rglob("*.py"))


def test_every_module_lives_in_a_known_room():
    rooms = {_room(_module_name(f)) for f in FILES if f != PKG / "__init__.py"}
    assert rooms == set(ALLOWED), rooms


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(PKG)))
def test_imports_run_one_way(path):
    mine = _room(_module_name(path))
    if mine is None:
        return
    bad = []
    for mod, line in _imports(path):
        other = _room(mod)
        if other is not None and other != mine and other not in ALLOWED[mine]:
            bad.append(f"line {line}: {mod} ({other} is above or beside {mine})")
        if mod.split(".")[0] in FORBIDDEN_THIRD_PARTY.get(mine, ()):
            bad.append(f"line {line}: {mod} (not allowed in {mine})")
    assert not bad, f"{path.relative_to(PKG)}: " + "; ".join(bad)


def _private_names_from_other_modules(path: Path) -> list[str]:
    """``from ..x import _name`` lines of ``path`` that take a private name of another module of the
    package."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [f"line {node.lineno}: {alias.name} from {'.' * node.level}{node.module or ''}"
            for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and (node.level or
                                                                               (node.module
                                                                                or "").startswith(
                                                                                    "diff2_flwr"))
            for alias in node.names if alias.name.startswith("_")
            and not alias.name.startswith("__")]


@pytest.mark.parametrize("path", sorted((PKG / "deploy").glob("*.py")), ids=lambda p: p.name)
def test_deployment_code_uses_only_public_names_of_other_modules(path):
    """What deploy/ needs from runtime/launch.py (and from its siblings) is public API (issue 22,
    item 5)."""
    assert not _private_names_from_other_modules(path)


def test_the_private_name_checker_sees_one(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from ..runtime.launch import _tool, flwr_run\n")
    assert _private_names_from_other_modules(bad) == ["line 1: _tool from ..runtime.launch"]


def test_no_circle_between_files():
    known = {_module_name(f) for f in FILES}
    graph: dict[str, set[str]] = {}
    for f in FILES:
        deps = set()
        for mod, _ in _imports(f):
            while mod and mod not in known:
                mod = mod.rpartition(".")[0]
            if mod and mod != _module_name(f) and not mod.count(".") == 0:
                deps.add(mod)
        # A package's __init__ is not an edge of its own modules' imports.
        graph[_module_name(f)] = {d for d in deps if not _module_name(f).startswith(d + ".")}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                raise AssertionError("circle: " + " -> ".join(stack[stack.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_the_checker_sees_an_upward_import(tmp_path):
    """The checker itself: a runtime module importing the Flower glue is caught."""
    fake = PKG / "runtime" / "_layout_probe.py"
    fake.write_text("from ..fl import protocol\n")
    try:
        with pytest.raises(AssertionError, match="fl is above or beside runtime"):
            test_imports_run_one_way(fake)
    finally:
        fake.unlink()


def test_importing_the_package_and_its_rooms_stays_light():
    """`import diff2_flwr` pulls in neither torch nor Flower."""
    code = ("import sys, diff2_flwr; print(sorted(m for m in ('torch', 'flwr', 'scipy') if m in "
            "sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


def test_the_cli_parser_stays_light():
    """`diff2 --help` (and every sub-command's --help) builds its parser without torch, scipy, numpy
    or Flower."""
    code = (
        "import sys; from diff2_flwr.cli import build_parser; p = build_parser(); "
        "p.format_help(); [a.choices[c].format_help() for a in p._subparsers._group_actions for c "
        "in a.choices]; print(sorted(m for m in ('torch', 'flwr', 'scipy', 'numpy', 'matplotlib', "
        "'yaml') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


def test_version():
    from importlib.metadata import version

    out = subprocess.run([sys.executable, "-m", "diff2_flwr.cli", "--version"], capture_output=True,
                         text=True)
    assert out.returncode == 0 and out.stdout.strip() == f"diff2 {version('diff2-flwr')}"


#: lab's rooms by job (issue 39, item 4) -> the rooms each may import; every room may import lab's
#: root modules (the batched sweep engine: sweep.py, backend.py), which import no room.
LAB_ALLOWED = {"study": set(), "audit": set(), "regime": {"study"}, "bench": {"study"}}
LAB = PKG / "lab"


def _lab_room(module: str) -> str | None:
    """``study`` for diff2_flwr.lab.study.plan, ``""`` for lab's root modules, None outside lab."""
    parts = module.split(".")
    if parts[:2] != ["diff2_flwr", "lab"]:
        return None
    return parts[2] if len(parts) > 3 or (len(parts) == 3 and parts[2] in LAB_ALLOWED) else ""


def test_lab_is_in_rooms_by_job():
    rooms = {p.name for p in LAB.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert rooms == set(LAB_ALLOWED)
    assert sorted(p.name for p in LAB.glob("*.py")) == ["__init__.py", "backend.py", "sweep.py"]


@pytest.mark.parametrize("path", sorted(LAB.rglob("*.py")), ids=lambda p: str(p.relative_to(PKG)))
def test_lab_rooms_import_one_way_and_no_private_name_crosses_a_room(path):
    mine = _lab_room(_module_name(path))
    tree = ast.parse(path.read_text(), filename=str(path))
    me = _module_name(path).split(".")
    package = me if path.name == "__init__.py" else me[:-1]
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        base = package[: len(package) - node.level + 1] if node.level else []
        module = ".".join(base + ([node.module] if node.module
                                  else [])) if node.level else (node.module or "")
        theirs = _lab_room(module)
        # outside lab: the package rooms' rule (test_imports_run_one_way) applies
        if theirs is None:
            continue
        if theirs and theirs != mine:
            assert mine != "" and theirs in LAB_ALLOWED[
                mine], f"{path.name}:{node.lineno}: lab/{mine or '.'} -> {theirs}"
            private = [a.name for a in node.names if a.name.startswith("_")]
            assert not private, (f"{path.name}:{node.lineno}: private {private} imported across "
                                 f"rooms")


@pytest.mark.parametrize("room", sorted(LAB_ALLOWED))
def test_each_lab_rooms_public_face_resolves(room):
    import importlib

    package = importlib.import_module(f"diff2_flwr.lab.{room}")
    assert package.__all__ and all(callable(getattr(package, name)) for name in package.__all__)
