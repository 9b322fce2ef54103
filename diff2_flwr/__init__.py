"""diff2-flwr: DIFF2 (Murata & Suzuki, ICML 2023) on Flower, with (ε, δ)-differential privacy.

The Python API for your own Flower app is two functions, loaded on first use (``import diff2_flwr``
stays light: no torch, no Flower until you call them):

- :func:`diff2_flwr.make_strategy` — the server's Flower ``Strategy``;
- :func:`diff2_flwr.make_client` — one data owner's Flower ``NumPyClient``;

and, for distributed noise (the server sees only the clients' SecAgg+ sum),
:func:`diff2_flwr.run_secure` (the ServerApp's rounds) and :func:`diff2_flwr.secure_sum_mod` (every
ClientApp's mod).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .api import make_client as make_client
    from .api import make_strategy as make_strategy
    from .api import run_secure as run_secure
    from .api import secure_sum_mod as secure_sum_mod

__all__ = ["make_strategy", "make_client", "run_secure", "secure_sum_mod"]


def __getattr__(name: str) -> Any:  # PEP 562: the API is imported when first asked for
    if name in __all__:
        from . import api  # noqa: PLC0415 -- lazy on purpose: `import diff2_flwr` stays light

        return getattr(api, name)
    raise AttributeError(f"module 'diff2_flwr' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
