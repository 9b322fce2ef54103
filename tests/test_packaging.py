"""The project's ``requires-python`` against its dependencies': Flower's own per-run install (``uv
sync``) refuses a project whose lower bound is below a dependency's ("requested Python version
(>=3.10) does not satisfy Python>=3.11,<4.0 … unsatisfiable"), so the bound must be at least every
main dependency's."""

from __future__ import annotations

import re
import tomllib
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def lower_bound(spec: SpecifierSet) -> Version:
    """The smallest version ``spec`` admits by its lower-bounding clauses (``>=``, ``>``, ``==``,
    ``~=``); 0 if none.

    ``>3.10`` is taken as 3.10 (a bound no looser than the truth for the check below).
    """
    bounds = [Version(s.version.rstrip(".*")) for s in spec if s.operator in (">=", ">", "==", "~=",
                                                                              "===")]
    return max(bounds, default=Version("0"))


def test_lower_bound_reads_the_clauses():
    assert lower_bound(SpecifierSet(">=3.11, <4.0")) == Version("3.11")
    assert lower_bound(SpecifierSet(">=3.8,!=3.9.0")) == Version("3.8")
    assert lower_bound(SpecifierSet("~=3.10")) == Version("3.10")
    assert lower_bound(SpecifierSet("<4")) == Version("0")


def test_requires_python_is_at_least_every_main_dependencys():
    """Each main dependency as installed in this venv (what the resolver picked): its
    ``Requires-Python`` lower bound must not exceed the project's. An upper bound (flwr's ``<4.0``)
    is not checked: uv ignores those."""
    ours = lower_bound(SpecifierSet(PROJECT["requires-python"]))
    higher, missing = [], []
    for text in PROJECT["dependencies"]:
        name = Requirement(text).name
        try:
            declared = distribution(name).metadata.get("Requires-Python")
        except PackageNotFoundError:
            missing.append(name)
            continue
        if declared and lower_bound(SpecifierSet(declared)) > ours:
            higher.append(f"{name} needs Python {declared}")
    assert not missing, f"main dependencies not installed (run scripts/setup.sh): {missing}"
    assert not higher, (
        f"pyproject.toml declares requires-python = {PROJECT['requires-python']!r}, but "
                        f"{'; '.join(higher)}: raise requires-python to the highest of these.")


def test_flower_is_the_dependency_that_needs_3_11_and_setup_sh_checks_the_same_bound():
    """flwr 1.42 is why the bound is 3.11; scripts/setup.sh refuses an older Python with the same
    bound."""
    flwr = SpecifierSet(distribution("flwr").metadata["Requires-Python"])
    assert lower_bound(flwr) == lower_bound(SpecifierSet(PROJECT["requires-python"])) == Version(
        "3.11")
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    (checked,) = re.findall(r"sys\.version_info < \((\d+), (\d+)\)", setup)
    assert Version(".".join(checked)) == Version("3.11")
    assert "needs Python >= 3.11" in setup
