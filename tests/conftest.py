"""Shared test fixtures: where the paper's datasets are (DIFF2_DATA_DIR or ../shared/data)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings

# Property tests draw the same examples on every run and machine (a red CI must be reproducible); set
# HYPOTHESIS_PROFILE=explore to search with fresh random examples instead (do it when changing the maths).
settings.register_profile("fixed", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "fixed"))

_SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


def shared_data_dir() -> Path | None:
    env = os.environ.get("DIFF2_DATA_DIR")
    for candidate in ([Path(env)] if env else []) + [_SHARED]:
        if (candidate / "california_housing").is_dir() or (candidate / "cal_housing.csv").is_file():
            return candidate
    return None


@pytest.fixture
def data_dir() -> Path:
    found = shared_data_dir()
    if found is None:
        pytest.skip("the paper's datasets are not available (set DIFF2_DATA_DIR or put shared/ beside the clone)")
    return found


# The full suite runs in parallel processes (pytest-xdist, `--dist loadgroup`: scripts/test.sh). Most slow tests
# wait on Flower's processes (SuperLink start, heartbeats, round trips) more than they compute, and each one has
# its own FLWR_HOME, free ports and tmp_path. Three kinds run one at a time, each kind in one worker: the compose
# tests (they share Podman's images, networks and project names), the native deployments (a SuperLink, P SuperNodes,
# P + 1 SuperExecs and a ClientApp process per message each: two at once starve each other's heartbeats on 2 cores)
# and the Ray cluster tests (a head and a worker node each).
_SERIAL_GROUPS = {"compose": "podman", "deployment": "native-deployment", "cluster": "ray-cluster"}
# Slowest first, so the long tests start at once and the short ones fill the gaps at the end.
_ORDER = ("compose", "deployment", "flower", "cluster", "realdata")


def _rank(item: pytest.Item) -> int:
    names = {m.name for m in item.iter_markers()}
    return next((i for i, name in enumerate(_ORDER) if name in names), len(_ORDER))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items if config.pluginmanager.hasplugin("xdist") else ():
        names = {m.name for m in item.iter_markers()}
        for marker, group in _SERIAL_GROUPS.items():
            if marker in names:
                item.add_marker(pytest.mark.xdist_group(group))
                break
    items.sort(key=_rank)  # stable: the collection order within a rank
