"""DIFF2 in your own Flower app: a ServerApp and a ClientApp built with diff2_flwr's Python API.

Three clients each hold 400 records of a regression task; the model is a small tanh network
(any torch.nn.Module without batch-norm will do). The run is (ε = 3, δ = 1e-5)-DP at the record
level over 20 rounds of DIFF2 (a restart every 5 rounds).

Run it as a Flower simulation:  python examples/python_api.py
It ends with the run's summary (status, rounds, ε spent, test loss from x_0 to x_R).

Flower 1.42 has no in-process simulation that is not deprecated: `flwr.simulation.run_simulation` (used
below; it prints a deprecation warning) and `start_simulation` both point to `flwr run`, which runs an app
folder. In your own Flower project, point `[tool.flwr.app.components]` at `server_app` and `client_app`
and type `flwr run .`.
"""

import torch
from flwr.client import ClientApp
from flwr.common import Context
from flwr.server import ServerApp, ServerAppComponents, ServerConfig
from torch.utils.data import TensorDataset

import diff2_flwr

CLIENTS, RECORDS, FEATURES = 3, 400, 8


def make_model() -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):  # the same x_0 on every run
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()


def per_sample_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return 0.5 * (output.squeeze(-1) - target) ** 2  # one loss per record: no mean, no sum


def records(seed: int, n: int = RECORDS) -> TensorDataset:
    """A client's own data (here made up; in your app, whatever the client holds)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=g, dtype=torch.float64)
    noise = 0.1 * torch.randn(n, generator=g, dtype=torch.float64)
    y = torch.tanh(x @ torch.linspace(-1, 1, FEATURES, dtype=torch.float64)) + noise
    return TensorDataset(x, y)


TEST = records(seed=1000, n=1000).tensors  # data the server may see, for evaluation only


def evaluate(arrays) -> dict[str, float]:
    """The test loss of a released iterate (one array per model tensor)."""
    model = make_model()
    with torch.no_grad():
        for parameter, array in zip(model.parameters(), arrays):
            parameter.copy_(torch.from_numpy(array))
        return {"test_loss": float(per_sample_loss(model(TEST[0]), TEST[1]).mean())}


STRATEGIES = []  # those server_fn built (one per run): each one's server holds its run's summary


def server_fn(context: Context) -> ServerAppComponents:
    strategy = diff2_flwr.make_strategy(
        epsilon=3.0, delta=1e-5, rounds=20, restart_every=5, clients=CLIENTS, n_min=RECORDS,
        clip_restart=1.0, clip_diff=3.0, learning_rate=0.5, model=make_model(), evaluate_fn=evaluate,
    )
    STRATEGIES.append(strategy)
    return ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=strategy.num_rounds))


def summary_line(strategy) -> str:
    """The run's key figures (all of them: ``strategy.server.summary()``, as summary.json has them)."""
    s = strategy.server.summary()
    privacy, losses = s["privacy"], [r["test_loss"] for r in strategy.server.history if "test_loss" in r]
    line = (f"[diff2] run {s['status']}: {s['rounds_released']}/{s['rounds_planned']} rounds, "
            f"ε spent {privacy['epsilon_spent']:.4g} of {privacy['epsilon_target']:g} (δ = {privacy['delta']:g})")
    if losses:
        line += f", test_loss {losses[0]:.4g} (x_0) -> {losses[-1]:.4g} (last released)"
    return line + (f"; {s['error']}" if s["error"] else "")


def client_fn(context: Context):
    partition_id = int(context.node_config["partition-id"])
    client = diff2_flwr.make_client(model=make_model(), loss=per_sample_loss, data=records(seed=partition_id),
                                    partition_id=partition_id, chunk_size=128)
    return client.to_client()


server_app = ServerApp(server_fn=server_fn)
client_app = ClientApp(client_fn=client_fn)

if __name__ == "__main__":
    from flwr.simulation import run_simulation

    run_simulation(server_app=server_app, client_app=client_app, num_supernodes=CLIENTS)
    for strategy in STRATEGIES:  # none if the ServerApp failed before building its strategy
        print(summary_line(strategy))
