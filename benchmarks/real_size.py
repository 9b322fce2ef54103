"""Issue 41's model at real size: ResNet-18 with GroupNorm (d = 11,173,962) trained by DIFF2 on 4
Flower clients × 1,000 records for 3 rounds, every client setting at its default (dtype, chunk,
memory budget, gradients: auto = float32 ghost clipping with passes sized by the measured
footprint), through the Python API in a Flower simulation.

    python benchmarks/real_size.py [--records 1000] [--clients 4] [--rounds 3]

The records are made up (32×32×3 images whose class shifts a fixed pattern: CIFAR-shaped, no
download). Progress goes to stderr; one JSON object on stdout: the run's summary, seconds per
round, and the machine's peak memory in use during the run beyond what was in use before it
(``MemTotal - MemAvailable``, sampled every 0.2 s: the Ray workers' memory included).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

import torch
from flwr.client import ClientApp
from flwr.common import Context
from flwr.server import ServerApp, ServerAppComponents, ServerConfig

import diff2_flwr
from diff2_flwr.lab.bench.models import make_resnet18
from diff2_flwr.runtime.memory_budget import machine_memory

CLASSES = 10


def make_model() -> torch.nn.Module:
    """The same x_0 in every process."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return make_resnet18(CLASSES)


def records(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n images [3, 32, 32] whose class c adds c/10 of a fixed pattern to Gaussian pixels."""
    g = torch.Generator().manual_seed(seed)
    pattern = torch.randn(3, 32, 32, generator=torch.Generator().manual_seed(12345))
    y = torch.randint(0, CLASSES, (n,), generator=g)
    x = torch.randn(n, 3, 32, 32, generator=g) + 0.1 * y.float()[:, None, None, None] * pattern
    return x, y


def main() -> None:
    """Run it and print its JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=1000)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    test_x, test_y = records(10_000, 500)
    strategies, round_ends = [], []

    def evaluate(arrays) -> dict[str, float]:
        round_ends.append(time.perf_counter())
        model = make_model()
        with torch.no_grad():
            for p, a in zip(model.parameters(), arrays):
                p.copy_(torch.from_numpy(a))
            out = model(test_x)
        accuracy = float((out.argmax(1) == test_y).float().mean())
        print(f"[real-size] evaluated x_{len(round_ends) - 1}: test accuracy {accuracy:.3f}",
              file=sys.stderr, flush=True)
        return {"test_loss": float(torch.nn.functional.cross_entropy(out, test_y)),
                "test_accuracy": accuracy}

    def server_fn(context: Context) -> ServerAppComponents:
        strategy = diff2_flwr.make_strategy(
            epsilon=3.0, delta=1e-5, rounds=args.rounds, restart_every=args.rounds,
            clients=args.clients, n_min=args.records, clip_restart=1.0, clip_diff=3.0,
            learning_rate=0.5, model=make_model(), evaluate_fn=evaluate,
            progress=lambda line: print(line, file=sys.stderr, flush=True))
        strategies.append(strategy)
        return ServerAppComponents(strategy=strategy,
                                   config=ServerConfig(num_rounds=strategy.num_rounds))

    def client_fn(context: Context):
        p = int(context.node_config["partition-id"])
        return diff2_flwr.make_client(model=make_model(), loss="cross_entropy",
                                      data=records(p, args.records), partition_id=p).to_client()

    total, available = machine_memory()
    before = total - available
    peak = [before]
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            t, a = machine_memory()
            peak[0] = max(peak[0], t - a)
            time.sleep(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    started = time.perf_counter()
    from flwr.simulation import run_simulation  # noqa: PLC0415 -- deprecated import, warns once

    run_simulation(server_app=ServerApp(server_fn=server_fn),
                   client_app=ClientApp(client_fn=client_fn), num_supernodes=args.clients)
    done.set()
    watcher.join()
    summary = strategies[-1].server.summary() if strategies else {"status": "not started"}
    marks = [started] + round_ends
    print(json.dumps({
        "model": "resnet18-groupnorm", "parameters": sum(p.numel() for p in
                                                          make_model().parameters()),
        "clients": args.clients, "records_per_client": args.records, "rounds": args.rounds,
        "status": summary.get("status"), "rounds_released": summary.get("rounds_released"),
        "error": summary.get("error"), "seconds": time.perf_counter() - started,
        "seconds_per_evaluated_round": [b - a for a, b in zip(marks[1:], marks[2:])],
        "machine_memory_gib": total / 2**30,
        "peak_memory_in_use_beyond_start_gib": (peak[0] - before) / 2**30,
        "history": [{k: r[k] for k in ("round", "kind", "test_accuracy") if k in r}
                    for r in (strategies[-1].server.history if strategies else [])]}))


if __name__ == "__main__":
    main()
