"""What a ServerApp can learn of the federation it runs on: simulation or deployment, and a
simulation's SuperNodes.

``flwr run`` runs a simulation's ServerApp on Flower's ``InMemoryGrid`` and a deployment's on a grid
that talks to a SuperLink over the network (Flower 1.42); the class is matched by name so that no
private module is imported. A simulation registers all its virtual SuperNodes at once, right after
the ServerApp starts and before the first round, and none comes or goes afterwards: once their
number has held for :data:`SIMULATION_SETTLE_S` it is final. This is how ``training.clients: auto``
becomes P.
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["SIMULATION_SETTLE_S", "FederationError", "is_simulation", "simulation_supernodes"]

#: How long the number of a simulation's SuperNodes must hold before it is taken as final.
SIMULATION_SETTLE_S = 1.0
_POLL_S = 0.1


class FederationError(ValueError):
    """P cannot be learnt from this federation; the message says what to set instead."""


def is_simulation(grid: Any) -> bool:
    """Whether ``grid`` is a Flower simulation's in-memory grid."""
    return grid is not None and any(cls.__name__ == "InMemoryGrid" for cls in type(grid).__mro__)


def simulation_supernodes(grid: Any, *, timeout_s: float = 120.0,
                          settle_s: float = SIMULATION_SETTLE_S) -> int:
    """The number of SuperNodes of the simulation behind ``grid``, once it has held for
    ``settle_s``.

    Raises :class:`FederationError` for a deployment's grid (its SuperNodes may still be starting,
    or come and go: P must be declared there) and when no SuperNode registered within ``timeout_s``.
    """
    if not is_simulation(grid):
        raise FederationError(
            "key `training.clients`: expected the number of clients P in a deployment. Found "
            "'auto', which only a simulation resolves (its SuperNodes all register at once; a "
            "deployment's may still be starting). Set training.clients to the number of data "
            "owners' SuperNodes, e.g. --run-config \"training.clients=3\".")
    deadline = time.monotonic() + timeout_s
    count, since = -1, time.monotonic()
    while True:
        now = time.monotonic()
        n = len(list(grid.get_node_ids()))
        if n != count:
            count, since = n, now
        if count > 0 and now - since >= settle_s:
            return count
        if now >= deadline:
            raise FederationError(
                f"key `training.clients`: auto, but no SuperNode of this simulation registered "
                                  f"within {timeout_s:.0f} s. Set training.clients to a number, "
                                  f"or check the "
                                  "federation's num-supernodes.")
        time.sleep(_POLL_S)
