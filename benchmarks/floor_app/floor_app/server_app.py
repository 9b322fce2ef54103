"""FedAvg over all clients of a 101-float model; prints a timestamp after every round."""

import time

import numpy as np
from flwr.common import Context, ndarrays_to_parameters
from flwr.server import ServerApp, ServerAppComponents, ServerConfig
from flwr.server.strategy import FedAvg


class TimedFedAvg(FedAvg):
    def aggregate_fit(self, server_round, results, failures):
        out = super().aggregate_fit(server_round, results, failures)
        print(f"[floor] round {server_round} t={time.perf_counter():.6f}", flush=True)
        return out


def server_fn(context: Context) -> ServerAppComponents:
    n = int(context.run_config["num-server-rounds"])
    strategy = TimedFedAvg(fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=2,
                           min_available_clients=2,
                           initial_parameters=ndarrays_to_parameters([np.zeros(101)]))
    return ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=n))


app = ServerApp(server_fn=server_fn)
