"""Flower ServerApp: reads the experiment file named by run-config key ``config`` and runs DIFF2.

First thing, it builds and checks everything that needs no transport (``session.preflight``, as
``diff2 run`` does before Flower starts): a mistake is one ``[diff2] pre-flight failed: ...`` line
at the top of the ServerApp's log (Flower's traceback follows it) and the run's status details.

With ``training.clients: auto`` (the embedded default) P is the number of SuperNodes the simulation
registered (``flwr run .`` simulates 2 unless ``--federation-config "num-supernodes=N"``); the
shards and the calibration follow from it. A deployment must declare P.

At the end, completed or failed, it prints the run's summary block (``[diff2] summary: run
completed: ...``), so ``flwr log`` ends with the outcome and where the files are.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from flwr.common import Context
from flwr.server import Grid, ServerApp, ServerAppComponents, ServerConfig
from flwr.server.compat import start_grid

from diff2_flwr.fl.federation import simulation_supernodes
from diff2_flwr.fl.secagg import run_secure
from diff2_flwr.fl.strategy import Diff2Strategy
from diff2_flwr.runtime.compute import pin_threads
from diff2_flwr.runtime.config import ExperimentConfig, load_run_config
from diff2_flwr.runtime.console import run_report, server_summary_block
from diff2_flwr.runtime.session import Preflight, PreflightError, build_server, preflight


def checked_config(run_config: Mapping[str, Any],
                   grid: Grid | None = None) -> tuple[ExperimentConfig, Preflight]:
    """The run config's experiment (P resolved from ``grid`` when it is ``auto``) and its
    pre-flight; the first mistake in one line, then raised."""
    try:
        # its log goes to the run submitter: no file is quoted
        cfg = load_run_config(run_config, quote=False)
        if cfg.clients_auto:
            p = simulation_supernodes(grid)
            cfg = cfg.with_clients(p, "the simulation's SuperNodes")
            # the first line of ours a user sees: plain `flwr run .` simulates 2 SuperNodes
            print(f"[diff2] training.clients: auto -> P = {p}, the SuperNodes of this simulation "
                  f"(another P: flwr run . --federation-config \"num-supernodes=N\")", flush=True)
        # the evaluation's reductions add in the same order as the in-process driver's
        pin_threads(cfg.training.threads)
        return cfg, preflight(cfg)
    # FederationError and ConfigError are ValueErrors
    except (ValueError, FileNotFoundError) as err:
        message = " ".join(str(err).split())
        print(f"[diff2] pre-flight failed: {message}", flush=True)
        raise PreflightError(message) from None


def server_fn(context: Context, grid: Grid | None = None) -> ServerAppComponents:
    """The strategy and the server config of this run (``grid`` resolves ``training.clients:
    auto``)."""
    cfg, checked = checked_config(context.run_config, grid)
    server = build_server(cfg, checked=checked)  # resumes from output.checkpoint when it exists
    t = cfg.training
    # Fault injection for crash/resume tests: the server dies right after releasing (and
    # checkpointing) round k.
    crash = os.environ.get("DIFF2_FAULT_CRASH_AFTER_ROUND")
    strategy = Diff2Strategy(server=server, round_retries=t.round_retries,
                             crash_after_round=int(crash) if crash else None)
    # Flower numbers this run's rounds from 1; retried rounds need extra Flower rounds.
    return ServerAppComponents(strategy=strategy,
                               config=ServerConfig(num_rounds=strategy.num_rounds,
                                                   round_timeout=t.round_timeout_s))


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """What ``ServerApp(server_fn=...)`` does (Flower's ``start_grid`` with the strategy), with the
    grid known before the strategy is built: a simulation's SuperNodes give P for
    ``training.clients: auto``."""
    components = server_fn(context, grid)
    try:
        if components.strategy.server.distributed is not None:
            run_secure(grid, context, components.strategy, components.config)
        else:
            start_grid(grid=grid, strategy=components.strategy, config=components.config)
    # `flwr log` ends with the outcome, completed or not (`diff2 run` prints its own from
    # summary.json)
    finally:
        print_outcome(components.strategy)


def print_outcome(strategy: Diff2Strategy) -> None:
    """The run's summary block (status, final metrics, ε spent, files) from its ``summary.json``,
    when it has one."""
    recorder = strategy.server.recorder
    if recorder is None or not (recorder.directory / "summary.json").is_file():
        return
    try:
        block = server_summary_block(run_report(recorder.directory))
    # never in place of the run's own error (this runs in a `finally`)
    except (OSError, ValueError) as err:
        print(f"[diff2] summary.json not readable for the summary: {err}", flush=True)
        return
    print(block, flush=True)


__all__ = ["app", "checked_config", "print_outcome", "server_fn"]
