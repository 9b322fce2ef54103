"""The in-process driver: the same server and worker code as the Flower path, minus the transport.

Each round makes exactly the calls the Flower Strategy and NumPyClient make, in the same order:
``server.plan()`` -> each worker's ``contribute`` -> the reply arrays as the wire would carry
them -> ``server.release(replies)`` (with the local routine, then the chosen worker's
``local_phase`` -> ``server.finish_local(reply)``). With the same config and seed it reproduces a Flower
simulation's trajectory bit for bit: both pin every thread pool to ``training.threads``
(:mod:`~diff2_flwr.runtime.compute`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from ..core.local import LocalTask
from .compute import pinned_threads
from .config import AUTO_CLIENTS_DEFAULT, ExperimentConfig
from .server import Diff2Server
from .session import Diverged, Preflight, build_server, build_worker

__all__ = ["run_inprocess"]


def run_inprocess(
    cfg: ExperimentConfig, *, output_root: str | Path | None = None, record: bool = True,
    progress: Callable[[str], None] | None = print, stop_on_divergence: bool = False, checked: Preflight | None = None,
) -> Diff2Server:
    """Run ``cfg`` to completion in this process; return the server (state, history, ledger).

    A diverging run (the iterate, the radius or the workers' gradients no longer finite) raises
    :class:`Diverged`, or with ``stop_on_divergence`` returns the server stopped at the round that
    diverged (``server.diverged_at``; its summary says so). Privacy rejections always raise. ``checked``: the
    :func:`~diff2_flwr.runtime.session.preflight` of this ``cfg`` when the caller ran it already. With
    ``training.clients: auto`` this driver, which makes the workers, makes :data:`AUTO_CLIENTS_DEFAULT` of them.
    """
    if cfg.clients_auto:
        cfg = cfg.with_clients(AUTO_CLIENTS_DEFAULT, "the in-process driver's workers")
    with pinned_threads(cfg.training.threads):  # as the ServerApp and every ClientApp
        server = build_server(cfg, output_root=output_root, record=record, progress=progress, checked=checked)
        workers = [build_worker(cfg, p) for p in range(cfg.clients)]
        while not server.done:
            try:
                plan = server.plan()
                released = server.release([worker.reply(plan) for worker in workers])
                if isinstance(released, LocalTask):  # the local routine: the chosen worker's private steps
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
