"""diff2-flwr: DIFF2 (Murata & Suzuki, ICML 2023) on Flower, with (ε, δ)-differential privacy.

The Python API for your own Flower app is two functions, loaded on first use (``import diff2_flwr``
stays light: no torch, no Flower until you call them):

- :func:`diff2_flwr.make_strategy` — the server's Flower ``Strategy``;
- :func:`diff2_flwr.make_client` — one data owner's Flower ``NumPyClient``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .api import make_client as make_client
    from .api import make_strategy as make_strategy

__all__ = ["make_strategy", "make_client"]


def __getattr__(name: str) -> Any:  # PEP 562: the API is imported when first asked for
    if name in __all__:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'diff2_flwr' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
