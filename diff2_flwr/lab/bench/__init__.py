"""`diff2 bench`: speed (rounds/s, the protocol's wall time, Flower's overhead, the JAX peer).

Its public face is below, imported on first use (a part's import, such as the CLI's parser's, stays
light); the modules hold the parts."""

from __future__ import annotations

import importlib
from typing import Any

#: The room's public names and the module of each.
_FACE = {'run_bench': 'runner'}

__all__ = sorted(_FACE)


def __getattr__(name: str) -> Any:
    if name in _FACE:
        return getattr(importlib.import_module(f".{_FACE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
