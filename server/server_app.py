"""Flower ServerApp: reads the experiment file named by run-config key ``config`` and runs DIFF2.

First thing, it builds and checks everything that needs no transport (``session.preflight``, as ``diff2 run``
does before Flower starts): a mistake is one ``[diff2] pre-flight failed: ...`` line at the top of the
ServerApp's log (Flower's traceback follows it) and the run's status details.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from flwr.common import Context
from flwr.server import ServerApp, ServerAppComponents, ServerConfig

from diff2_flwr.fl.strategy import Diff2Strategy
from diff2_flwr.runtime.compute import pin_threads
from diff2_flwr.runtime.config import ExperimentConfig, load_run_config
from diff2_flwr.runtime.session import Preflight, PreflightError, build_server, preflight


def checked_config(run_config: Mapping[str, Any]) -> tuple[ExperimentConfig, Preflight]:
    """The run config's experiment and its pre-flight; the first mistake in one line, then raised."""
    try:
        cfg = load_run_config(run_config)
        pin_threads(cfg.training.threads)  # the evaluation's reductions add in the same order as the in-process driver's
        return cfg, preflight(cfg)
    except (ValueError, FileNotFoundError) as err:
        message = " ".join(str(err).split())
        print(f"[diff2] pre-flight failed: {message}", flush=True)
        raise PreflightError(message) from None


def server_fn(context: Context) -> ServerAppComponents:
    cfg, checked = checked_config(context.run_config)
    server = build_server(cfg, checked=checked)  # resumes from output.checkpoint when it exists
    t = cfg.training
    # Fault injection for crash/resume tests: the server dies right after releasing (and checkpointing) round k.
    crash = os.environ.get("DIFF2_FAULT_CRASH_AFTER_ROUND")
    strategy = Diff2Strategy(server=server, round_retries=t.round_retries,
                             crash_after_round=int(crash) if crash else None)
    # Flower numbers this run's rounds from 1; retried rounds need extra Flower rounds.
    return ServerAppComponents(strategy=strategy,
                               config=ServerConfig(num_rounds=strategy.num_rounds, round_timeout=t.round_timeout_s))


app = ServerApp(server_fn=server_fn)
