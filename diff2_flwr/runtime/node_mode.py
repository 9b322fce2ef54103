"""Whether a ClientApp runs as a simulated node (every party one person) or as a data owner's
SuperNode.

The answer decides what the node lets the run config do: in a simulation the run submitter owns
every node, so the experiment file may lie anywhere on the machine, a ``training.seed`` may fix
every party's noise, and the data may be prepared from the run config's dataset settings. A data
owner's node (a deployment) reads the experiment only from the app bundle or from a folder its own
node config names, reads its records only from its node config's ``data-path``, and refuses a seed
unless its policy allows seeds (``allow_seeded``).

The decision uses only what the node's own side controls, never the run config or a message: a node
is simulated when Flower's simulation engine runs it (its Ray actor module is loaded in this
process) and its node config holds exactly the keys that engine sets (``partition-id``,
``num-partitions``). Anything else — a SuperNode started with ``flower-supernode``, or any node
config key its operator added (``data-path``, ``policy``) — is a deployment. Failing closed: a node
whose mode is unclear is a deployment.

Trust (``THREATS.md``): protects a data owner's node against a run submitter or server that would
have it treated as a simulation (to read files by run-config paths or to fix its noise by a seed). A
data owner who runs Flower's simulation engine on its own records is, by that choice, the only
party.
"""

from __future__ import annotations

import sys
from typing import Any, Mapping

__all__ = ["SIMULATION_ENGINE_MODULES", "SIMULATION_NODE_KEYS", "simulation_engine_running",
           "simulated_node"]

#: The module whose actor runs ClientApps in Flower 1.42's simulation engine (Ray backend).
SIMULATION_ENGINE_MODULES = ("flwr.simulation.ray_transport.ray_actor",)
#: The node config keys Flower's simulation engine gives each simulated node
#: (``vce_api._register_node_info_stores``).
SIMULATION_NODE_KEYS = frozenset({"partition-id", "num-partitions"})


def simulation_engine_running() -> bool:
    """Whether this process is one of Flower's simulation engine's workers."""
    return any(name in sys.modules for name in SIMULATION_ENGINE_MODULES)


def simulated_node(node_config: Mapping[str, Any]) -> bool:
    """True for a node of Flower's simulation engine with the engine's node config only; False
    otherwise."""
    return set(node_config) <= SIMULATION_NODE_KEYS and simulation_engine_running()
