"""Studies: the study file (spec), its plan (run ids, units, the grid's extension), the scheduler
(claims, executors, run files), the analysis (selection, summaries, tests), the statistics (stats:
endpoints and protocols; inference: paired t-tests, Holm, BH; claims), reports and the family across
studies.

Its public face is below, imported on first use (a part's import, such as the CLI's parser's, stays
light); the modules hold the parts."""

from __future__ import annotations

import importlib
from typing import Any

#: The room's public names and the module of each.
_FACE = {'run_family': 'family', 'run_study': 'runner', 'Study': 'spec', 'StudyError': 'spec',
         'load_study': 'spec', 'parse_study': 'spec'}

__all__ = sorted(_FACE)


def __getattr__(name: str) -> Any:
    if name in _FACE:
        return getattr(importlib.import_module(f".{_FACE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
