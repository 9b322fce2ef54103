"""`diff2 audit`: the empirical audit of the (ε, δ) guarantee through the production path,
`--live`, and `--engines` (the per-sample gradient engines' sensitivity).

Its public face is below, imported on first use (a part's import, such as the CLI's parser's, stays
light); the modules hold the parts."""

from __future__ import annotations

import importlib
from typing import Any

#: The room's public names and the module of each.
_FACE = {'live_audit': 'live', 'AuditSpec': 'runner', 'run_audit': 'runner',
         'EngineAuditSpec': 'spec', 'engine_audit': 'engines'}

__all__ = sorted(_FACE)


def __getattr__(name: str) -> Any:
    if name in _FACE:
        return getattr(importlib.import_module(f".{_FACE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
