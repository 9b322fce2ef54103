"""Where a study's units run: in the driver's process, or as tasks of a Ray cluster.

A *unit* (:class:`~diff2_flwr.lab.study.plan.Unit`) is a batch of runs of the batched engine or one
run of another engine; :func:`~diff2_flwr.lab.study.scheduler.compute_unit` computes it in whatever
process calls it, with every thread pool pinned to the study's ``threads``. The driver claims the
runs of a unit (:mod:`~diff2_flwr.lab.study.claims`), hands the unit to an executor, and writes the
results it gets back. Two executors share one small interface (``has_capacity``, ``submit``,
``completed``, ``in_flight``, ``close``):

* :class:`LocalExecutor` computes each unit at once, in this process;
* :class:`PoolExecutor` computes units side by side in N spawned processes of this machine (a
  study's ``workers``);
* :class:`RayExecutor` submits units as tasks of a running Ray cluster (``ray.init(address=...)``),
  as many at a time as the cluster has CPUs for (``num_cpus = threads`` per task), and checks that
  every node that answers runs the same diff2-flwr source and read the same data as the driver:
  a node with other code or other data would silently mix results.

The nodes read the data themselves (``dataset.dir`` of the study or their own ``DIFF2_DATA_DIR``,
as the process that ran ``ray start`` there saw it); nothing but the unit's description and the
per-round metrics crosses the network.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import multiprocessing
import os
import socket
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any, Callable

import numpy as np

__all__ = ["ClusterError", "LocalExecutor", "PoolExecutor", "RayExecutor", "code_fingerprint",
           "data_digest", "node_report", "unit_data"]


class ClusterError(RuntimeError):
    """The cluster cannot run the study as the driver would (unreachable, other code, other
    data)."""


@functools.cache
def code_fingerprint() -> str:
    """A hash of the installed diff2_flwr source (every ``.py`` file and the fused kernel's
    ``.cpp``, by relative path)."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted([*root.rglob("*.py"), *root.rglob("*.cpp")]):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def data_digest(data: Any) -> str:
    """A hash of a prepared dataset's arrays and shard bounds: equal digests, equal data."""
    h = hashlib.sha256()
    for name in ("x_train", "y_train", "x_test", "y_test"):
        array = np.ascontiguousarray(getattr(data, name))
        h.update(name.encode() + str(array.dtype).encode() + str(array.shape).encode()
                 + array.tobytes())
    h.update(repr(tuple(data.shard_bounds)).encode())
    return h.hexdigest()[:16]


# dataset settings -> (prepared data, digest), this process's
_DATA: dict[str, tuple[Any, str]] = {}


def unit_data(cfg: Any) -> Any:
    """The prepared dataset of ``cfg``, loaded once per process for all runs that share it.

    (``load_data`` caches by the whole config, which differs from run to run; the data depend only
    on the dataset settings, P and the folder the files are read from.)
    """
    return _unit_data(cfg)[0]


def _unit_data(cfg: Any) -> tuple[Any, str]:
    from ...runtime.session import load_data  # noqa: PLC0415 -- the data path loads where data are

    key = json.dumps({"dataset": cfg.to_dict()["dataset"], "clients": cfg.clients}, sort_keys=True,
                     default=str)
    if key not in _DATA:
        if len(_DATA) >= 2:  # a study uses one dataset; keep memory bounded all the same
            _DATA.pop(next(iter(_DATA)))
        data = load_data(cfg)
        _DATA[key] = (data, data_digest(data))
    return _DATA[key]


def node_report(cfg: Any) -> dict[str, str]:
    """What a node tells the driver with each result: its host, its code and its data (cached per
    process)."""
    return {"host": socket.gethostname(), "code": code_fingerprint(), "data": _unit_data(cfg)[1]}


Compute = Callable[..., list]  # compute(study, unit, progress=None) -> one outcome per run


def _run_unit_task(compute: Compute, study: Any, unit: Any) -> tuple[list[dict], dict[str, str]]:
    """The body of a Ray task: compute one unit on the node, and say which code and data did it."""
    import ray  # noqa: PLC0415 -- optional: only a Ray cluster's task needs it

    report = {**node_report(unit.jobs[0].cfg), "node": ray.get_runtime_context().get_node_id()}
    outcomes = compute(study, unit)
    for outcome in outcomes:
        outcome["host"] = report["host"]
    return outcomes, report


_HOW_TO_START = ("Start one with `ray start --head --port 6379` on the head node and `ray start "
                 "--address <head>:6379` on each other node (with diff2-flwr installed), then pass "
                 "`--ray <head>:6379`.")


def _check_reachable(address: str, timeout_s: float = 10.0) -> None:
    """Fail at once if ``host:port`` takes no TCP connection (``auto``, ``local`` and ``ray://`` are
    Ray's to resolve)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        return
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except OSError as err:
        raise ClusterError(
            f"No Ray cluster answers at {address!r} ({err}). {_HOW_TO_START}") from None


class LocalExecutor:
    """Computes each unit in the driver's own process, one at a time."""

    name = "local"

    def __init__(self, compute: Compute) -> None:
        self._compute = compute
        self._done: list[tuple[Any, list[dict]]] = []

    @property
    def in_flight(self) -> int:
        """Units submitted and not yet collected."""
        return len(self._done)

    def has_capacity(self) -> bool:
        """Whether another unit may be submitted now."""
        return not self._done

    def submit(self, study: Any, unit: Any,
               progress: Callable[[int, int], None] | None = None) -> None:
        """Start computing ``unit`` of ``study``."""
        self._done.append((unit, self._compute(study, unit, progress)))

    def completed(self, timeout: float) -> list[tuple[Any, list[dict]]]:
        """The units finished within ``timeout`` seconds, each with its outcomes."""
        done, self._done = self._done, []
        return done

    def close(self) -> None:
        """Stop: abandon what still computes and free the workers."""
        self._done = []

    def describe(self) -> dict[str, Any]:
        """What the study's summary says of this executor."""
        return {"executor": self.name}


class PoolExecutor:
    """Computes units in ``workers`` spawned processes of this machine, as many at a time as there
    are workers.

    Spawned, not forked: torch's thread pools do not survive a fork. Each unit pins its own thread
    pools to the study's ``threads`` (:func:`~diff2_flwr.lab.study.scheduler.compute_unit`), so a
    unit gives the same bits in a worker as in the driver. Progress within a unit is not reported
    across processes; the driver reports runs as units finish.
    """

    name = "pool"

    def __init__(self, compute: Compute, workers: int, source: str = "the study") -> None:
        self._compute, self.workers, self._source = compute, int(workers), source
        self._pool = ProcessPoolExecutor(self.workers,
                                         mp_context=multiprocessing.get_context("spawn"))
        self._futures: dict[Any, Any] = {}

    @property
    def in_flight(self) -> int:
        """Units submitted and not yet collected."""
        return len(self._futures)

    def has_capacity(self) -> bool:
        """Whether another unit may be submitted now."""
        return len(self._futures) < self.workers

    def submit(self, study: Any, unit: Any,
               progress: Callable[[int, int], None] | None = None) -> None:
        """Start computing ``unit`` of ``study``."""
        self._futures[self._pool.submit(self._compute, study, unit)] = unit

    def completed(self, timeout: float) -> list[tuple[Any, list[dict]]]:
        """The units finished within ``timeout`` seconds, each with its outcomes."""
        done, _ = wait(list(self._futures), timeout=timeout, return_when=FIRST_COMPLETED)
        out = []
        for future in done:
            unit = self._futures.pop(future)
            try:
                out.append((unit, future.result()))
            except BrokenProcessPool as err:
                raise RuntimeError(
                    f"{self._source}: a worker process of the study died (workers: "
                    f"{self.workers}); the runs finished so far are kept and a rerun resumes. "
                    "Worker processes are spawned and import the main module: a script that calls "
                    "run_study must do so under `if __name__ == \"__main__\":`. Out of memory? "
                    "Lower batch_size or workers.") from err
        return out

    def close(self) -> None:
        """Stop: abandon what still computes and free the workers."""
        # stopped early (an error, Ctrl-C): the units still computing are abandoned, not awaited
        if self._futures:
            for process in list(getattr(self._pool, "_processes", {}).values()):
                process.terminate()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._futures = {}

    def describe(self) -> dict[str, Any]:
        """What the study's summary says of this executor."""
        return {"executor": self.name, "workers": self.workers}


class RayExecutor:
    """Runs units as tasks of the Ray cluster at ``address`` (e.g. ``10.0.0.5:6379``, or ``auto``).

    Args:
        address: what ``ray.init(address=...)`` takes; ``auto`` is the cluster of ``RAY_ADDRESS`` or
            the one started on this machine.
        compute: ``compute(study, unit)``, a module-level function every node imports (by
        reference). threads: CPUs each task asks for and threads it pins (the study's ``threads``).
        expect: the driver's ``{"code": ..., "data": ...}``; a node that answers with other values
            stops the study.
    """

    name = "ray"

    def __init__(self, address: str, compute: Compute, *, threads: int,
                 expect: dict[str, str]) -> None:
        if not address:
            raise ClusterError("`--ray`: expected a Ray cluster address such as 10.0.0.5:6379 or "
                               "'auto'. Found ''.")
        # no GPU here: silences a FutureWarning
        os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
        try:
            import ray  # noqa: PLC0415 -- optional: only `--ray` needs it
        except ImportError as err:  # pragma: no cover - Ray comes with flwr[simulation]
            raise ClusterError(f"`--ray {address}` needs Ray on the driver (pip install "
                               f"'flwr[simulation]'): {err}")
        self._ray = ray
        self.address, self.threads, self._compute = address, int(threads), compute
        self.expect = dict(expect)
        self._owns_connection = not ray.is_initialized()
        if self._owns_connection:
            _check_reachable(address)  # ray.init retries an unreachable head for minutes, silently
            try:
                ray.init(address=address, logging_level=logging.WARNING, configure_logging=False)
            except (ConnectionError, RuntimeError, ValueError) as err:
                raise ClusterError(f"Cannot connect to the Ray cluster at {address!r}: {err}. "
                                   f"{_HOW_TO_START}") from None
        cpus = int(ray.cluster_resources().get("CPU", 0))
        if cpus < self.threads:
            self.close()
            raise ClusterError(f"The Ray cluster at {address!r} has {cpus} CPU(s); each unit "
                               f"needs threads = {self.threads}. Add nodes, or lower the study's "
                               "`threads`.")
        self.capacity = cpus // self.threads
        self._task = ray.remote(num_cpus=self.threads, max_retries=2)(_run_unit_task)
        self._refs: dict[Any, Any] = {}
        self.nodes: dict[str, int] = {}  # Ray node id -> units computed there

    @property
    def in_flight(self) -> int:
        """Units submitted and not yet collected."""
        return len(self._refs)

    def has_capacity(self) -> bool:
        """Whether another unit may be submitted now."""
        return len(self._refs) < self.capacity

    def submit(self, study: Any, unit: Any,
               progress: Callable[[int, int], None] | None = None) -> None:
        """Start computing ``unit`` of ``study``."""
        self._refs[self._task.remote(self._compute, study, unit)] = unit

    def completed(self, timeout: float) -> list[tuple[Any, list[dict]]]:
        """The units finished within ``timeout`` seconds, each with its outcomes."""
        ray = self._ray
        ready, _ = ray.wait(list(self._refs), num_returns=1, timeout=timeout)
        out = []
        for ref in ready:
            unit = self._refs.pop(ref)
            try:
                outcomes, report = ray.get(ref)
            # the unit's own error (e.g. a privacy rejection), as raised
            except ray.exceptions.RayTaskError as err:
                raise err.as_instanceof_cause() from None
            for key, what, fix in (("code", "diff2-flwr source",
                                    "install the driver's version on every node"),
                                   ("data", "data",
                                    "give every node the same data files (dataset.dir or its "
                                    "DIFF2_DATA_DIR when `ray start` ran)")):
                if report[key] != self.expect[key]:
                    raise ClusterError(
                        f"Ray node {report['host']} computed with other {what} than the driver "
                        f"(fingerprint {report[key]}, driver {self.expect[key]}): {fix}, restart "
                        "its `ray start`, and run the study again (finished runs are kept).")
            self.nodes[report["node"]] = self.nodes.get(report["node"], 0) + 1
            out.append((unit, outcomes))
        return out

    def close(self) -> None:
        """Stop: abandon what still computes and free the workers."""
        ray = self._ray
        for ref in list(getattr(self, "_refs", {})):
            ray.cancel(ref, force=True)
        self._refs = {}
        if self._owns_connection and ray.is_initialized():
            ray.shutdown()

    def describe(self) -> dict[str, Any]:
        """What the study's summary says of this executor."""
        return {"executor": self.name, "ray_address": self.address, "ray_capacity": self.capacity,
                "ray_nodes": dict(self.nodes)}
