"""The audit on the code that really runs over Flower: ``diff2 audit --path flower --canaries B``.

One Flower simulation (:func:`flwr.simulation.run_simulation`: Flower's ``InMemoryGrid`` and its Ray
backend, the same simulation runtime as ``flwr run``'s) runs the audit's two apps:

* the **ServerApp** runs the runs of the B-canary federation (:mod:`.canaries`) one after another;
  each is the real :class:`~diff2_flwr.fl.strategy.Diff2Strategy` around the audited production
  server, driven by Flower's own round loop (``start_grid``: ``configure_fit`` -> messages to the
  SuperNodes -> ``aggregate_fit``), with a fresh noise key per run. It only *observes* the strategy
  (:class:`_ObservedStrategy`: the kind and radius each round announces, and the ṽ_r it released)
  and scores it with the in-process audit's :class:`Scorer`;
* the **ClientApp** on SuperNode ``partition-id`` p is the real
  :class:`~diff2_flwr.fl.client.Diff2Client` of worker p of that federation: client 0 holds the B
  canaries. Its replies travel as Flower messages.

Seeded, the Flower path computes what the in-process path computes, bit for bit (the same server
seed per run, one torch thread in every process, the wire exact on float64 arrays):
``tests/test_audit_flower.py`` checks the scores equal and the verdicts agree. Unseeded, every run
draws its noise key from OS entropy, as production does.

What it is not: the project's ``flwr run`` app with its real model and data (a real loss cannot make
a gradient *difference* that is ±K·e every round, the worst case the analysis covers: the canary
records here are gradient oracles), nor a deployment over the network (the simulation runtime's grid
and backend, not a SuperLink's gRPC).
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import time
from contextlib import contextmanager
from typing import Callable, Iterator

import numpy as np

from ...core.privacy import Calibration
from .canaries import _seed, canary_runs, canary_spec, canary_workers, check_canaries, split_scores
from .spec import AuditSpec
from .trials import Scorer, audited_server

__all__ = ["flower_apps", "flower_canary_scores"]


@functools.lru_cache(maxsize=4)
def _worker(spec: AuditSpec, partition_id: int):
    """Worker ``partition_id`` of the B-canary federation, built once per process (Flower calls
    ``client_fn`` for every message)."""
    return canary_workers(spec)[partition_id]


def flower_apps(spec: AuditSpec, calibration: Calibration,
                progress: Callable[[str], None] | None = None):
    """The audit's ServerApp and ClientApp, and the list the ServerApp appends each run's B scores
    to (and an exception to, if a run failed)."""
    # Here, not at the top: `diff2 audit` imports this module whatever --path says, and these
    # (torch, Flower's server and client, the Strategy) are only the Flower path's.
    import torch  # noqa: PLC0415 -- see above
    from flwr.client import ClientApp  # noqa: PLC0415 -- see above
    from flwr.common import Context  # noqa: PLC0415 -- see above
    from flwr.server import Grid, ServerApp, ServerConfig  # noqa: PLC0415 -- see above
    from flwr.server.compat import start_grid  # noqa: PLC0415 -- see above

    from ...fl import protocol  # noqa: PLC0415 -- see above
    from ...fl.client import Diff2Client  # noqa: PLC0415 -- see above
    from ...fl.strategy import Diff2Strategy  # noqa: PLC0415 -- see above

    run = canary_spec(spec)
    runs = canary_runs(spec)
    out: list = []

    class _ObservedStrategy(Diff2Strategy):
        """The real strategy; after each released round the adversary's view of it goes to the
        scorer."""

        def __init__(self, *, server, scorer: Scorer) -> None:
            super().__init__(server=server)
            self.scorer, self._announced = scorer, None

        def configure_fit(self, server_round, parameters, client_manager):
            instructions = super().configure_fit(server_round, parameters, client_manager)
            if instructions:
                config = instructions[0][1].config
                self._announced = (config[protocol.KIND] == "restart",
                                   float(config[protocol.RADIUS]))
            return instructions

        def aggregate_fit(self, server_round, results, failures):
            before = self.server.state.round
            aggregated = super().aggregate_fit(server_round, results, failures)
            # a round was released: what the adversary sees
            if self.server.state.round == before + 1:
                self.scorer.add(*self._announced, self.server.state.v)
            return aggregated

    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        torch.set_num_threads(1)
        from ...core.layout import ParameterLayout  # noqa: PLC0415 -- in the ServerApp's process

        layout = ParameterLayout(("w",), ((run.dim,),))
        started = time.perf_counter()
        try:
            for i in range(runs):
                server = audited_server(run, calibration, layout, _seed(spec, i))
                strategy = _ObservedStrategy(
                    server=server, scorer=Scorer(run, calibration, layout.dim, spec.canaries))
                start_grid(grid=grid, strategy=strategy,
                           config=ServerConfig(num_rounds=strategy.num_rounds))
                if server.state.round != run.rounds or strategy.scorer.rounds != run.rounds:
                    raise RuntimeError(f"audited Flower run {i + 1}: {server.state.round} of "
                                       f"{run.rounds} rounds released ({strategy.scorer.rounds} "
                                       "scored); see Flower's log above")
                out.append(strategy.scorer.score)
                if progress:
                    elapsed = time.perf_counter() - started
                    progress(f"[audit] Flower run {i + 1}/{runs} ({spec.canaries} canaries), "
                             f"ETA {elapsed / (i + 1) * (runs - i - 1):.0f} s")
        # run_simulation logs a ServerApp's exception; the audit must raise it
        except BaseException as err:
            out.append(err)

    def client_fn(context: Context):
        torch.set_num_threads(1)  # the in-process audit's reductions, in the same order
        return Diff2Client(_worker(spec, int(context.node_config["partition-id"]))).to_client()

    return server_app, ClientApp(client_fn=client_fn), out


@contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Flower's and Ray's output goes to stderr while the simulation runs: stdout carries the
    audit's JSON only."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def flower_canary_scores(spec: AuditSpec, progress: Callable[[str], None] | None = None,
                         calibration: Calibration | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The LR scores of ``spec.trials`` canaries on D and on D′ from one Flower simulation (module
    docstring)."""
    check_canaries(spec)
    calibration = calibration if calibration is not None else canary_spec(spec).calibration()
    server_app, client_app, out = flower_apps(spec, calibration, progress)
    from flwr.simulation import run_simulation  # noqa: PLC0415 -- the Flower path's (Ray)

    # A Ray instance of its own (address "local": never a cluster some other job started on this
    # machine), shut down afterwards; Flower's Ray backend rewrites $PYTHONPATH for its workers:
    # restored afterwards.
    backend = {"client_resources": {"num_cpus": 1},
               "init_args": {"address": "local", "num_cpus": max(1, spec.workers),
                             "include_dashboard": False}}
    flower_log = logging.getLogger("flwr")
    level, pythonpath = flower_log.level, os.environ.get("PYTHONPATH")
    # not Flower's lines for every round of every run: the audit's progress
    flower_log.setLevel(logging.WARNING)
    try:
        with _stdout_to_stderr():
            run_simulation(server_app=server_app, client_app=client_app,
                           num_supernodes=spec.clients, backend_config=backend)
    finally:
        flower_log.setLevel(level)
        if pythonpath is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = pythonpath
        import ray  # noqa: PLC0415 -- the Flower path's (run_simulation started it)

        if ray.is_initialized():
            ray.shutdown()
    failures = [x for x in out if isinstance(x, BaseException)]
    if failures:
        raise RuntimeError(f"the Flower-path audit failed: {failures[0]!r}") from failures[0]
    if len(out) != canary_runs(spec):
        raise RuntimeError(f"the Flower-path audit made {len(out)} of {canary_runs(spec)} runs: "
                           "see Flower's log above")
    d, d_prime = split_scores(np.stack(out))
    return d.reshape(-1)[:spec.trials], d_prime.reshape(-1)[:spec.trials]
