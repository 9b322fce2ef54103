"""DIFF2 as a Flower ``Strategy``: thin glue around :class:`~diff2_flwr.runtime.session.Diff2Server`.

Every round uses all P clients. ``configure_fit`` ships x_{r-1} (and x_{r-2} and the radius
on difference rounds); ``aggregate_fit`` requires exactly P successful replies and hands them
to the server, which checks each one (shape, dtype, finiteness, norm <= radius, n_p >= n_min)
and releases nothing if any check fails: the run then stops with an error naming the client
and the check.
"""

from __future__ import annotations

import time

from flwr.common import EvaluateIns, EvaluateRes, FitIns, FitRes, Parameters, Scalar
from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import Strategy

from ..core.aggregation import RoundRejected
from ..runtime.session import Diff2Server
from . import protocol

__all__ = ["Diff2Strategy", "SIMULATION_SETTLE_S"]

#: A simulation registers all its virtual SuperNodes at once, before the first round: once their
#: number has held for this long it is final, and a wrong number fails the run at once.
SIMULATION_SETTLE_S = 1.0
_POLL_S = 0.25


class Diff2Strategy(Strategy):
    """Runs DIFF2 rounds over Flower; the math lives in the wrapped :class:`Diff2Server`."""

    def __init__(self, *, server: Diff2Server, wait_for_clients_s: int = 300, round_retries: int = 0,
                 crash_after_round: int | None = None) -> None:
        """``round_retries``: how many times in the whole run a round whose clients failed or timed out
        is retried (releasing nothing) once all P clients are connected again, before the run stops."""
        super().__init__()
        if wait_for_clients_s < 1:
            raise ValueError(f"`wait_for_clients_s` must be >= 1. Found {wait_for_clients_s}.")
        if round_retries < 0:
            raise ValueError(f"`round_retries` must be >= 0. Found {round_retries}.")
        self.server = server
        self.wait_for_clients_s = wait_for_clients_s
        self.retries_left = round_retries
        self.crash_after_round = crash_after_round  # fault injection (tests): die after releasing this round
        self._asked: set[str] = set()
        # A resumed server continues at its next round; Flower numbers this run's rounds from 1.
        self.offset = server.state.round

    @property
    def num_rounds(self) -> int:
        """The Flower rounds to run (``ServerConfig(num_rounds=...)``): the DIFF2 rounds still to release
        (fewer after a resume) plus the retries a failed round may take."""
        return self.server.rounds - self.server.state.round + self.retries_left

    def __repr__(self) -> str:
        return f"Diff2Strategy(clients={self.server.clients}, rounds={self.server.rounds})"

    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        return ndarrays_to_parameters(self.server.layout.split(self.server.state.x))

    def configure_fit(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, FitIns]]:
        if self.server.done:  # Flower rounds reserved for retries that were not needed
            return []
        plan = self.server.plan()
        if server_round + self.offset != plan.round:
            resumed = f" (+{self.offset} resumed)" if self.offset else ""
            self._stop(RuntimeError(f"Flower asked for round {server_round}{resumed} but the DIFF2 server is at "
                                    f"round {plan.round}."))
        p = self.server.clients
        available = self._await_clients(client_manager, p)
        if len(available) != p:
            self._stop(RoundRejected(plan.round, "all-clients", _client_count_problem(p, available)))
        arrays, config = protocol.encode_task(plan, self.server.layout)
        fit_ins = FitIns(parameters=ndarrays_to_parameters(arrays), config=config)
        self._asked = set(available)
        return [(proxy, fit_ins) for _, proxy in sorted(available.items())]

    def aggregate_fit(
        self,
        server_round: int,
        results: list[tuple[ClientProxy, FitRes]],
        failures: list[tuple[ClientProxy, FitRes] | BaseException],
    ) -> tuple[Parameters | None, dict[str, Scalar]]:
        if failures:
            described, named = [], set()
            for failure in failures:
                if isinstance(failure, BaseException):
                    described.append(f"{type(failure).__name__}: {failure}")
                else:
                    proxy, res = failure
                    named.add(proxy.cid)
                    described.append(f"node {proxy.cid}: status {res.status.code.name} {res.status.message}")
            silent = sorted(self._asked - {proxy.cid for proxy, _ in results} - named)
            if silent:  # a dead or timed-out node leaves no reply at all: name it from what was asked
                described.insert(0, f"no reply from node(s) {', '.join(silent)} (died or timed out)")
            error = RoundRejected(server_round + self.offset, "client-failure",
                                  f"{len(failures)} client(s) failed: " + "; ".join(described))
            if self.retries_left > 0:
                self.retries_left -= 1
                self.offset -= 1  # the next Flower round retries this DIFF2 round; nothing was released
                if self.server.progress:
                    self.server.progress(f"[diff2] {error} Retrying the round ({self.retries_left} retries left).")
                return None, {}
            self._stop(error)
        replies = []
        for proxy, res in results:
            try:
                arrays = parameters_to_ndarrays(res.parameters)
            except Exception as err:  # corrupt bytes: nothing usable, nothing released
                self._stop(RoundRejected(server_round + self.offset, "protocol", f"cannot decode the reply's arrays: {err}.",
                                         f"node {proxy.cid}"))
            try:
                replies.append(protocol.decode_reply(f"node {proxy.cid}", arrays, res.num_examples, res.metrics,
                                                     server_round + self.offset))
            except RoundRejected as err:
                self._stop(err)
        release = self.server.release(replies)  # records and raises on a failed check
        if release.plan.round == self.crash_after_round:
            raise RuntimeError(f"fault injection: the server crashes after releasing round {release.plan.round}")
        return ndarrays_to_parameters(self.server.layout.split(release.x)), {}

    def configure_evaluate(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, EvaluateIns]]:
        return []  # evaluation happens on the server, on data it is given for evaluation

    def aggregate_evaluate(
        self,
        server_round: int,
        results: list[tuple[ClientProxy, EvaluateRes]],
        failures: list[tuple[ClientProxy, EvaluateRes] | BaseException],
    ) -> tuple[float | None, dict[str, Scalar]]:
        return None, {}

    def evaluate(self, server_round: int, parameters: Parameters) -> tuple[float, dict[str, Scalar]] | None:
        return None  # the Diff2Server evaluates each released iterate and records it in metrics.jsonl

    def _await_clients(self, client_manager: ClientManager, p: int) -> dict[str, ClientProxy]:
        """The connected clients once P are, or once waiting cannot help.

        A deployment's SuperNodes may start slowly: wait up to ``wait_for_clients_s``. A simulation's
        virtual SuperNodes (Flower's in-memory grid) all register at once, so when their number has
        held for ``SIMULATION_SETTLE_S`` it is final: return at once instead of waiting in silence.
        """
        deadline = time.monotonic() + self.wait_for_clients_s
        count, since = -1, time.monotonic()
        while True:
            available = client_manager.all()  # Flower's compat layer refreshes the node list on this call
            now = time.monotonic()
            if len(available) != count:
                count, since = len(available), now
            if count >= p or now >= deadline:
                return available
            if count and _simulated(available) and now - since >= SIMULATION_SETTLE_S:
                return available
            client_manager.wait_for(p, timeout=max(0.0, min(_POLL_S, deadline - now)))  # type: ignore[arg-type]

    def _stop(self, error: BaseException):
        self.server.fail(error)
        raise error


def _simulated(available: dict[str, ClientProxy]) -> bool:
    """Whether the nodes are a simulation's virtual SuperNodes: their proxies talk to Flower's in-memory grid.

    ``flwr run`` runs a simulation's ServerApp on an ``InMemoryGrid`` and a deployment's on an
    ``HttpGrid`` (Flower 1.42); the class is matched by name so that no private module is imported.
    """
    for proxy in available.values():
        grid = getattr(proxy, "grid", None)
        if grid is not None and any(cls.__name__ == "InMemoryGrid" for cls in type(grid).__mro__):
            return True
    return False


def _client_count_problem(p: int, available: dict[str, ClientProxy]) -> str:
    """Why the round cannot start with ``len(available)`` clients, and the command that fixes it."""
    n = len(available)
    if _simulated(available):
        return (f"the config has training.clients = {p} but this simulation has {n} SuperNodes (`flwr run` "
                f"simulates 2 unless told otherwise). Every round needs exactly P = {p} workers. Run it again with\n"
                f"    flwr run . --federation-config \"num-supernodes={p}\"\n"
                "(keep any other options you gave), or use ./scripts/run.sh / `diff2 run CONFIG`, which set it.")
    return (f"the config has training.clients = {p} but {n} clients are connected. Every round needs exactly "
            f"P = {p}; in a simulation pass --federation-config \"num-supernodes={p}\", in a deployment start "
            f"one SuperNode per data owner ({p}).")
