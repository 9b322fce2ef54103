"""The in-process driver: the same server and worker code as the Flower path, minus the transport.

Each round makes exactly the calls the Flower Strategy and NumPyClient make, in the same order:
``server.plan()`` -> each worker's ``contribute`` -> the reply arrays as the wire would carry
them -> ``server.release(replies)`` (with the local routine, then the chosen worker's
``local_phase`` -> ``server.finish_local(reply)``). With the same config and seed it reproduces a
Flower simulation's trajectory bit for bit: both pin every thread pool to ``training.threads``
(:mod:`~diff2_flwr.runtime.compute`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ..core.estimator import RoundPlan
from ..core.local import LocalTask
from ..core.skellam import modular_sum
from .compute import pinned_threads
from .config import AUTO_CLIENTS_DEFAULT, ExperimentConfig
from .server import Diff2Server
from .session import Diverged, Preflight, build_server, build_worker
from .workers import Worker

__all__ = ["run_inprocess", "secure_sum"]


def secure_sum(server: Diff2Server, plan: RoundPlan, workers: Sequence[Worker],
               seed: int | None) -> np.ndarray:
    """Σ_p message_p mod 2**bits of the workers' round messages: what SecAgg+ unmasks (distributed
    noise)."""
    noise = server.distributed
    assert noise is not None
    try:
        messages = [w.message(noise, plan.round, plan.radius, plan.x_current, plan.x_previous,
                              seed) for w in workers]
    except Exception as err:
        server.fail(err)
        raise
    return modular_sum(messages, noise.bits)


def run_inprocess(
    cfg: ExperimentConfig, *, output_root: str | Path | None = None, record: bool = True,
    progress: Callable[[str], None] | None = print, stop_on_divergence: bool = False,
    checked: Preflight | None = None,
) -> Diff2Server:
    """Run ``cfg`` to completion in this process; return the server (state, history, ledger).

    A diverging run (the iterate, the radius or the workers' gradients no longer finite) raises
    :class:`Diverged`, or with ``stop_on_divergence`` returns the server stopped at the round that
    diverged (``server.diverged_at``; its summary says so). Privacy rejections always raise.
    ``checked``: the :func:`~diff2_flwr.runtime.session.preflight` of this ``cfg`` when the caller
    ran it already. With ``training.clients: auto`` this driver, which makes the workers, makes
    :data:`AUTO_CLIENTS_DEFAULT` of them.
    """
    if cfg.clients_auto:
        cfg = cfg.with_clients(AUTO_CLIENTS_DEFAULT, "the in-process driver's workers")
    with pinned_threads(cfg.training.threads):  # as the ServerApp and every ClientApp
        server = build_server(cfg, output_root=output_root, record=record, progress=progress,
                              checked=checked)
        workers = [build_worker(cfg, p) for p in range(cfg.clients)]
        while not server.done:
            try:
                plan = server.plan()
                if server.distributed is not None:  # the secure sum, as SecAgg+ hands it over
                    server.release_sum(secure_sum(server, plan, workers, cfg.training.seed),
                                       cfg.clients)
                    continue
                asked = server.cohort()  # None: all P (no client sampling)
                released = server.release([workers[p].reply(plan) for p in (
                    range(len(workers)) if asked is None else asked)])
                # the local routine: the chosen worker's private steps
                if isinstance(released, LocalTask):
                    try:
                        reply = workers[released.partition_id].local_phase(released)
                    except Exception as err:
                        server.fail(err)
                        raise
                    server.finish_local(reply)
            except Diverged:
                if not stop_on_divergence:
                    raise
                break
        return server
