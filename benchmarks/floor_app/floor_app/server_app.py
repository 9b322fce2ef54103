"""FedAvg over a cohort of the clients (all by default) of a 101-float model; prints a timestamp
after every round."""

import time

import numpy as np
from flwr.common import Context, ndarrays_to_parameters
from flwr.server import ServerApp, ServerAppComponents, ServerConfig
from flwr.server.strategy import FedAvg


class TimedFedAvg(FedAvg):
    """FedAvg that prints a ``[floor] round <r> t=<seconds>`` line after each round's aggregation:
    the timestamps ``diff2 bench`` reads the floor from."""

    def aggregate_fit(self, server_round, results, failures):
        """FedAvg's aggregation of the round, then its timestamp line (``time.perf_counter``)."""
        out = super().aggregate_fit(server_round, results, failures)
        print(f"[floor] round {server_round} t={time.perf_counter():.6f}", flush=True)
        return out


def server_fn(context: Context) -> ServerAppComponents:
    """TimedFedAvg of a 101-float zero model for the run config's ``num-server-rounds`` rounds,
    over a cohort of ``fraction-fit`` of the clients each round (FedAvg's: that fraction of the
    connected nodes, at least 2), once ``min-available-clients`` nodes are connected."""
    n = int(context.run_config["num-server-rounds"])
    fraction = float(context.run_config.get("fraction-fit", 1.0))
    available = int(context.run_config.get("min-available-clients", 2))
    strategy = TimedFedAvg(fraction_fit=fraction, fraction_evaluate=0.0, min_fit_clients=2,
                           min_available_clients=available,
                           initial_parameters=ndarrays_to_parameters([np.zeros(101)]))
    return ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=n))


app = ServerApp(server_fn=server_fn)
