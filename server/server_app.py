"""Flower ServerApp: reads the experiment file named by run-config key ``config`` and runs DIFF2."""

from __future__ import annotations

import os

from flwr.common import Context
from flwr.server import ServerApp, ServerAppComponents, ServerConfig

from diff2_flwr.fl.strategy import Diff2Strategy
from diff2_flwr.runtime.compute import pin_threads
from diff2_flwr.runtime.config import load_config, run_config_overrides
from diff2_flwr.runtime.paths import resolve_config_path
from diff2_flwr.runtime.session import build_server


def server_fn(context: Context) -> ServerAppComponents:
    cfg = load_config(resolve_config_path(str(context.run_config["config"])), run_config_overrides(context.run_config))
    pin_threads(cfg.training.threads)  # the evaluation's reductions add in the same order as the in-process driver's
    server = build_server(cfg)  # resumes from output.checkpoint when it exists
    t = cfg.training
    # Fault injection for crash/resume tests: the server dies right after releasing (and checkpointing) round k.
    crash = os.environ.get("DIFF2_FAULT_CRASH_AFTER_ROUND")
    strategy = Diff2Strategy(server=server, round_retries=t.round_retries,
                             crash_after_round=int(crash) if crash else None)
    # Flower numbers this run's rounds from 1; retried rounds need extra Flower rounds.
    return ServerAppComponents(strategy=strategy,
                               config=ServerConfig(num_rounds=strategy.num_rounds, round_timeout=t.round_timeout_s))


app = ServerApp(server_fn=server_fn)
