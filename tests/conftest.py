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
