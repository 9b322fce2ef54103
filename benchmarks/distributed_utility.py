"""What distributed noise costs in utility: central DIFF2 against ``privacy.noise: distributed`` at
the same (ε, δ) (prints one JSON object; progress on stderr).

    DIFF2_DATA_DIR=../shared/data .venv/bin/python benchmarks/distributed_utility.py \
        [--config configs/california.yaml] [--seeds 3] [--bits 16 20 31] [--tolerated 0 2] [--rounds
        N]

Every cell runs the config in process (the same server and worker code as a Flower run; SecAgg+'s
sum is exact, so it changes nothing here) with ``training.seed`` = 1..seeds, and reports the final
round's test loss (the round is fixed by the schedule, not chosen on test data), the final noise std
per coordinate of the released mean on a restart and on the last difference round, the wall time,
and each client's message size per round (central: the float64 clipped mean; distributed: the padded
int64 message SecAgg+ masks). Exploratory: no test of a difference is claimed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from diff2_flwr.runtime.config import load_config
from diff2_flwr.runtime.driver import run_inprocess


def cell(config: str, overrides: dict, seeds: int) -> dict:
    """One cell: ``config`` with ``overrides`` run in process with training.seed 1..``seeds``; its
    final test loss (mean, sd), the noise std of the first restart round and of the last round,
    seconds per run and each client's message size per round."""
    losses, walls, restart_std, last_std, dims = [], [], [], [], None
    for seed in range(1, seeds + 1):
        cfg = load_config(config, {**overrides, "training.seed": seed})
        started = time.perf_counter()
        server = run_inprocess(cfg, record=False, progress=None)
        walls.append(time.perf_counter() - started)
        rows = server.history
        losses.append(rows[-1]["test_loss"])
        restart_std.append(next(r["noise_std"] for r in rows[1:] if r["kind"] == "restart"))
        last_std.append(rows[-1]["noise_std"])
        noise = server.distributed
        dims = (server.layout.dim, noise.code(1, True, 1.0).padded if noise else server.layout.dim)
        print(f"[bench] {overrides} seed {seed}: test_loss {losses[-1]:.5g} in {walls[-1]:.1f} s",
              file=sys.stderr, flush=True)
    return {**overrides, "test_loss_mean": statistics.fmean(losses),
            "test_loss_sd": statistics.stdev(losses) if seeds > 1 else None, "test_losses": losses,
            "noise_std_restart": statistics.fmean(restart_std),
            "noise_std_last_round": statistics.fmean(last_std),
            "wall_s_per_run": statistics.fmean(walls), "dim": dims[0], "message_entries": dims[1],
            "bytes_per_client_per_round": 8 * dims[1]}


def main() -> None:
    """Run the central cell and one distributed cell per (bits, tolerated); print them as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/california.yaml")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--bits", type=int, nargs="+", default=[16, 20, 31])
    parser.add_argument("--tolerated", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--rounds", type=int, default=None,
                        help="override training.rounds (default: the config's)")
    args = parser.parse_args()
    base = {"training.rounds": args.rounds} if args.rounds else {}
    cells = [cell(args.config, {**base, "privacy.noise": "central"}, args.seeds)]
    for bits in args.bits:
        for t in args.tolerated:
            cells.append(cell(args.config, {**base, "privacy.noise": "distributed",
                                            "privacy.bits": bits,
                                            "privacy.tolerated": t}, args.seeds))
    print(json.dumps({"config": args.config, "seeds": args.seeds, "cells": cells}, indent=1))


if __name__ == "__main__":
    main()
