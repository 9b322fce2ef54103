"""DIFF2 as a Flower ``Strategy``: thin glue around :class:`~diff2_flwr.runtime.server.Diff2Server`
(its pure core, :mod:`~diff2_flwr.runtime.server_core`, decides; its journal records).

Every round uses all P clients, or with ``training.sampling`` the round's cohort of partitions
(drawn by the server; the strategy learns once which node holds which partition by
``get_properties``, and a round whose cohort is empty is released without Flower).
``configure_fit`` ships x_{r-1} (and x_{r-2} and the radius on difference rounds); ``aggregate_fit``
requires exactly the asked clients' successful replies and hands them to the server, which checks
each one (shape, dtype, finiteness, norm <= radius, n_p >= n_min) and releases nothing if any
check fails: the run then stops with an error naming the client and the check.

With the local routine (``local.steps`` = K > 0) a DIFF2 round takes two Flower rounds: the
gradient phase above (all P clients), whose release is ṽ_r and the worker p_r drawn by the server,
then the local phase: one ``FitIns`` with x_{r-1} and ṽ_r to the node that answered as partition
p_r in the gradient phase, whose y_K (checked: that partition, this round, the model's shapes,
finite) becomes x_r. A failure in the local phase stops the run: it is never retried, since its
steps were charged to the budget when ṽ_r was released and a second attempt would run (and
spend) them again. ``round_retries`` covers gradient phases only.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from flwr.common import (EvaluateIns, EvaluateRes, FitIns, FitRes, GetPropertiesIns, Parameters,
                         Scalar)
from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import Strategy

from ..core.aggregation import NodeRefused, RoundRejected
from ..core.estimator import Release
from ..core.local import LocalTask
from ..runtime.policy import refusal_in
from ..runtime.server import Diff2Server
from . import protocol
from .federation import SIMULATION_SETTLE_S, is_simulation

__all__ = ["Diff2Strategy", "SIMULATION_SETTLE_S"]

_POLL_S = 0.25
#: Partition queries in flight at once (each a thread blocked on its node's reply, as Flower's own
#: fit_clients does).
QUERY_THREADS = 64


class Diff2Strategy(Strategy):
    """Runs DIFF2 rounds over Flower; the math lives in the wrapped :class:`Diff2Server`."""

    def __init__(self, *, server: Diff2Server, wait_for_clients_s: int = 300,
                 round_retries: int = 0, crash_after_round: int | None = None) -> None:
        """``round_retries``: how many times in the whole run a round whose clients failed or timed
        out is retried (releasing nothing) once all P clients are connected again, before the run
        stops (with the local routine: a gradient phase; a local phase is never retried)."""
        super().__init__()
        if wait_for_clients_s < 1:
            raise ValueError(f"`wait_for_clients_s` must be >= 1. Found {wait_for_clients_s}.")
        if round_retries < 0:
            raise ValueError(f"`round_retries` must be >= 0. Found {round_retries}.")
        self.server = server
        self.wait_for_clients_s = wait_for_clients_s
        self.retries_left = round_retries
        # fault injection (tests): die after releasing this round
        self.crash_after_round = crash_after_round
        self._asked: set[str] = set()
        # client sampling: which partition each connected node holds (asked once, get_properties)
        self._partitions: dict[str, int] = {}
        # A resumed server continues at its next round; Flower numbers this run's rounds from 1.
        self.offset = server.state.round
        # Flower rounds per DIFF2 round: the gradient phase, and with the local routine the local
        # phase.
        self.phases = 1 if server.local is None else 2
        self._retried = 0  # Flower rounds spent on retried (gradient) phases
        # the local phase due, and the chosen node
        self._local: tuple[LocalTask, ClientProxy] | None = None
        # distributed noise: whether this Flower round's secure sum was released
        self._secure_released = False

    @property
    def num_rounds(self) -> int:
        """The Flower rounds to run (``ServerConfig(num_rounds=...)``): the DIFF2 rounds still to
        release (fewer after a resume; two Flower rounds each with the local routine) plus the
        retries a failed round may take."""
        return self.phases * (self.server.rounds - self.server.state.round) + self.retries_left

    def _position(self, server_round: int) -> tuple[int, bool]:
        """The DIFF2 round Flower round ``server_round`` belongs to, and whether it is that round's
        local phase."""
        f = server_round - self._retried
        return self.offset + (f + self.phases - 1) // self.phases, self.phases == 2 and f % 2 == 0

    def __repr__(self) -> str:
        return f"Diff2Strategy(clients={self.server.clients}, rounds={self.server.rounds})"

    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        """The server's current iterate (x_0, or a resumed run's last x_r) as Flower parameters."""
        return ndarrays_to_parameters(self.server.layout.split(self.server.state.x))

    def configure_fit(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, FitIns]]:
        """The gradient task of the next DIFF2 round to all P clients (once connected), or the local
        phase's task to the chosen node; stops the run if the rounds or the clients do not match."""
        if self.server.done:  # Flower rounds reserved for retries that were not needed
            return []
        r, local = self._position(server_round)
        if local:
            return self._configure_local(server_round, r)
        plan = self.server.plan()
        if r != plan.round:
            resumed = f" (+{self.offset} resumed)" if self.offset else ""
            phase = f", the gradient phase of DIFF2 round {r}," if self.phases == 2 else ""
            self._stop(RuntimeError(
                f"Flower asked for round {server_round}{resumed}{phase} but the DIFF2 server is at "
                                    f"round {plan.round}."))
        p = self.server.clients
        available = self._await_clients(client_manager, p)
        if len(available) != p:
            self._stop(RoundRejected(plan.round, "all-clients", _client_count_problem(p,
                                                                                      available)))
        arrays, config = protocol.encode_task(plan, self.server.layout, self.server.n_min)
        fit_ins = FitIns(parameters=ndarrays_to_parameters(arrays), config=config)
        chosen = sorted(available.items())
        cohort = self.server.cohort()  # None: every client (no sampling)
        if cohort is not None:
            nodes = self._partitions_of(available, plan.round)
            chosen = [(cid, available[cid]) for cid in sorted(available) if nodes[cid] in cohort]
            if not chosen:  # nobody drawn: the round releases its noise alone, without Flower
                self._empty_round(plan.round)
                return []
        self._asked = {cid for cid, _ in chosen}
        return [(proxy, fit_ins) for _, proxy in chosen]

    def _partitions_of(self, available: dict[str, ClientProxy], r: int) -> dict[str, int]:
        """Which partition each connected node holds (client sampling addresses partitions): asked
        once per node with ``get_properties`` (the node answers from its node config, before
        reading any record) and kept; a federation whose nodes do not hold partitions 0..P-1 once
        each stops the run (nothing released). The queries go out together (a round trip each,
        ~0.1 s in a simulation: one by one, 1,000 nodes took two minutes) and are read in node
        order, so the first node that fails to answer is the one named."""
        def ask(proxy: ClientProxy) -> int:
            res = proxy.get_properties(GetPropertiesIns(config=protocol.PARTITION_QUERY),
                                       timeout=float(self.wait_for_clients_s), group_id=r)
            return int(res.properties[protocol.PARTITION_KEY])

        new = sorted((cid, proxy) for cid, proxy in available.items()
                     if cid not in self._partitions)
        if new:
            with ThreadPoolExecutor(max_workers=min(QUERY_THREADS, len(new))) as pool:
                answers = [(cid, pool.submit(ask, proxy)) for cid, proxy in new]
            for cid, answer in answers:
                try:
                    self._partitions[cid] = answer.result()
                except Exception as err:  # no answer, or not ours: the cohort cannot be addressed
                    self._stop(RoundRejected(
                        r, "partitions", f"node {cid} did not say which partition it holds "
                        f"({type(err).__name__}: {err}); client sampling addresses partitions.",
                        f"node {cid}"))
        held = sorted(self._partitions[cid] for cid in available)
        if held != list(range(self.server.clients)):
            self._stop(RoundRejected(
                r, "partitions", f"the {len(available)} connected nodes hold partitions {held}; "
                f"client sampling needs partitions 0..{self.server.clients - 1} once each."))
        return {cid: self._partitions[cid] for cid in available}

    def _empty_round(self, r: int) -> None:
        """Release round r with an empty cohort (its noise alone): Flower skips a round with no
        client, so the server releases it here; the next Flower round is round r + 1."""
        try:
            released = self.server.release([])
        except Exception as err:
            self._stop(err)
        self._asked = set()
        self._released(released)  # type: ignore[arg-type]

    def _configure_local(self, server_round: int, r: int) -> list[tuple[ClientProxy, FitIns]]:
        """The local phase of round r: x_{r-1} and ṽ_r to the chosen worker's node only."""
        if self._local is None or self._local[0].round != r:
            self._stop(RuntimeError(
                f"Flower asked for round {server_round}, the local phase of DIFF2 round {r}, but "
                f"no local phase of round {r} is due."))
        task, proxy = self._local  # type: ignore[misc]
        arrays, config = protocol.encode_local_task(task, self.server.layout)
        self._asked = {proxy.cid}
        return [(proxy, FitIns(parameters=ndarrays_to_parameters(arrays), config=config))]

    def aggregate_fit(
        self,
        server_round: int,
        results: list[tuple[ClientProxy, FitRes]],
        failures: list[tuple[ClientProxy, FitRes] | BaseException],
    ) -> tuple[Parameters | None, dict[str, Scalar]]:
        """Hand the round's replies to the server: the released iterate, or None while a local
        phase is due or a failed round is retried; a rejected reply stops the run."""
        r, local = self._position(server_round)
        if local:
            return self._aggregate_local(r, results, failures)
        if self.server.distributed is not None:
            return self._aggregate_secure(r, results, failures)
        if failures:
            refused = self._refused(r, results, failures)
            if refused is not None:  # a node's rule: asking again gets the same answer
                self._stop(refused)
            error = RoundRejected(r, "client-failure", self._describe_failures(results, failures))
            if self.retries_left > 0:
                self.retries_left -= 1
                # the next Flower round retries this DIFF2 round; nothing was released
                self._retried += 1
                self.server.journal.say(
                    f"[diff2] {error} Retrying the round ({self.retries_left} retries left).")
                return None, {}
            self._stop(error)
        replies = []
        for proxy, res in results:
            arrays = self._arrays(r, proxy, res)
            try:
                replies.append(protocol.decode_reply(f"node {proxy.cid}", arrays, res.num_examples,
                                                     res.metrics, r))
            except RoundRejected as err:
                self._stop(err)
        released = self.server.release(replies)  # records and raises on a failed check
        # ṽ_r is out; x_r comes from the chosen worker's local phase
        if isinstance(released, LocalTask):
            # release() checked that the replies' partitions are exactly 0..P-1, once each.
            nodes = {reply.partition_id: proxy for (proxy, _), reply in zip(results, replies)}
            self._local = (released, nodes[released.partition_id])
            return None, {}
        return self._released(released), {}

    def _aggregate_secure(
        self, r: int, results: list[tuple[ClientProxy, FitRes]],
        failures: list[tuple[ClientProxy, FitRes] | BaseException]
    ) -> tuple[Parameters | None, dict[str, Scalar]]:
        """Distributed noise: SecAgg+ hands over the unmasked sum (as a mean, with each survivor's
        metrics); the server decodes it and releases round r, or nothing with fewer than P - t
        survivors."""
        noise = self.server.distributed
        assert noise is not None
        named = [(f"node {proxy.cid}", self._arrays(r, proxy, res), res.metrics) for proxy,
                 res in results]
        try:
            total, survivors = protocol.decode_secure_sum(named, r, self.server.clients, noise.bits)
        except RoundRejected as err:
            self._stop(err)
        if failures:
            self.server.journal.say(
                f"[diff2] round {r}: {self._describe_failures(results, failures)}; the secure sum "
                f"holds {survivors} of P = {self.server.clients} clients' messages.")
        self._secure_released = True
        return self._released(self.server.release_sum(total, survivors)), {}

    def secure_round_ended(self, server_round: int, refusals: tuple[str, ...] = ()) -> None:
        """Called by the SecAgg+ workflow after each Flower round: a round whose secure aggregation
        halted (too few clients to reconstruct the sum, or a client's error) never reached
        :meth:`aggregate_fit` and released nothing; it is retried while ``round_retries`` allow,
        else the run stops with the reason."""
        released, self._secure_released = self._secure_released, False
        if released or self.server.done or not self._asked:
            return
        r, _ = self._position(server_round)
        noise = self.server.distributed
        assert noise is not None
        if refusals:  # a node's rule: the run's one error line, and no retry
            self._asked = set()
            self._stop(NodeRefused(r, refusals))
        error = RoundRejected(r, "secure-aggregation",
                              f"Flower's SecAgg+ halted before the sum was unmasked (fewer "
                              f"than P - t = {noise.threshold} clients took part to the end, or a "
                              f"client failed: see "
                              "the ServerApp's log); nothing was released.")
        self._asked = set()
        if self.retries_left > 0:
            self.retries_left -= 1
            self._retried += 1
            self.server.journal.say(
                f"[diff2] {error} Retrying the round ({self.retries_left} retries left).")
            return
        self._stop(error)

    def _aggregate_local(
        self, r: int, results: list[tuple[ClientProxy, FitRes]],
        failures: list[tuple[ClientProxy, FitRes] | BaseException]
    ) -> tuple[Parameters | None, dict[str, Scalar]]:
        """y_K of the chosen node, checked, becomes x_r; any failure stops the run (no retry: see
        the module)."""
        assert self._local is not None
        task, proxy = self._local
        who = f"node {proxy.cid}"
        if failures:
            refused = self._refused(r, results, failures)
            if refused is not None:
                self._stop(refused)
            self._stop(RoundRejected(r, "client-failure",
                                     f"the local phase on partition {task.partition_id} ({who}) "
                                     f"failed: {self._describe_failures(results, failures)}. The "
                                     f"local phase is not "
                                     "retried (its steps were charged to the budget when ṽ_r was "
                                     "released; a second "
                                     "attempt would spend them again): the run stops."))
        if len(results) != 1 or results[0][0].cid != proxy.cid:
            self._stop(RoundRejected(r, "local-worker",
                                     f"the local phase was sent to {who} (partition "
                                     f"{task.partition_id}) only; {len(results)} replies came, "
                                     f"from node(s) "
                                     f"{', '.join(p.cid for p, _ in results) or 'none'}."))
        _, res = results[0]
        arrays = self._arrays(r, proxy, res)
        try:
            reply = protocol.decode_local_reply(who, arrays, res.num_examples, res.metrics, r)
        except RoundRejected as err:
            self._stop(err)
        # checks partition, shapes, finiteness, n_p; raises on failure
        release = self.server.finish_local(reply)
        self._local = None
        return self._released(release), {}

    def _released(self, release: Release) -> Parameters:
        if release.plan.round == self.crash_after_round:
            raise RuntimeError(
                f"fault injection: the server crashes after releasing round {release.plan.round}")
        return ndarrays_to_parameters(self.server.layout.split(release.x))

    def _arrays(self, r: int, proxy: ClientProxy, res: FitRes) -> list[np.ndarray]:
        try:
            return parameters_to_ndarrays(res.parameters)
        except Exception as err:  # corrupt bytes: nothing usable, nothing released
            self._stop(RoundRejected(r, "protocol", f"cannot decode the reply's arrays: {err}.",
                                     f"node {proxy.cid}"))

    def _refused(self, r: int, results: list[tuple[ClientProxy, FitRes]],
                 failures: list[tuple[ClientProxy, FitRes] | BaseException]) -> NodeRefused | None:
        """The round's first node refusal as the run's one error line (None: no node refused);
        every failure of the round in full goes to ``round-<r>-failures.log`` in the run folder,
        named in that line."""
        texts = [str(f) if isinstance(f, BaseException) else
                 f"node {f[0].cid}: status {f[1].status.code.name} {f[1].status.message}"
                 for f in failures]
        refusals = list(dict.fromkeys(m for m in map(refusal_in, texts) if m is not None))
        if not refusals:
            return None
        folder = self.server.run_info.get("output_dir")
        if folder:
            log = Path(folder) / f"round-{r}-failures.log"
            detail = self._describe_failures(results, failures)
            log.write_text(detail + "\n\n" + "\n\n".join(texts) + "\n", encoding="utf-8")
            more = f" All {len(failures)} failure(s) of round {r}: {log.name} in the run folder."
        else:
            more = f" All {len(failures)} failure(s) of round {r} are in the ServerApp's log."
        return NodeRefused(r, refusals, more)

    def _describe_failures(self, results: list[tuple[ClientProxy, FitRes]],
                           failures: list[tuple[ClientProxy, FitRes] | BaseException]) -> str:
        described, named = [], set()
        for failure in failures:
            if isinstance(failure, BaseException):
                described.append(f"{type(failure).__name__}: {failure}")
            else:
                proxy, res = failure
                named.add(proxy.cid)
                described.append(
                    f"node {proxy.cid}: status {res.status.code.name} {res.status.message}")
        silent = sorted(self._asked - {proxy.cid for proxy, _ in results} - named)
        if silent:  # a dead or timed-out node leaves no reply at all: name it from what was asked
            # Flower names no node for a ClientApp's error (flwr.server.compat.grid_client_proxy's
            # ValueError)
            raised = any(isinstance(f,
                                    BaseException) and "Message contains an Error" in str(f)
                                    for f in failures)
            why = ("died, timed out, or raised one of the errors below" if raised
                   else "died or timed out")
            described.insert(0, f"no reply from node(s) {', '.join(silent)} ({why})")
        return f"{len(failures)} client(s) failed: " + "; ".join(described)

    def configure_evaluate(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, EvaluateIns]]:
        """No client evaluates (an empty list): the server evaluates on data it is given."""
        return []  # evaluation happens on the server, on data it is given for evaluation

    def aggregate_evaluate(
        self,
        server_round: int,
        results: list[tuple[ClientProxy, EvaluateRes]],
        failures: list[tuple[ClientProxy, EvaluateRes] | BaseException],
    ) -> tuple[float | None, dict[str, Scalar]]:
        """Nothing to aggregate: clients never evaluate (``(None, {})``)."""
        return None, {}

    def evaluate(self, server_round: int,
                 parameters: Parameters) -> tuple[float, dict[str, Scalar]] | None:
        """None: the :class:`Diff2Server` evaluates each released iterate itself (metrics.jsonl)."""
        # the Diff2Server evaluates each released iterate and records it in metrics.jsonl
        return None

    def _await_clients(self, client_manager: ClientManager, p: int) -> dict[str, ClientProxy]:
        """The connected clients once P are, or once waiting cannot help.

        A deployment's SuperNodes may start slowly: wait up to ``wait_for_clients_s``. A
        simulation's virtual SuperNodes (Flower's in-memory grid) all register at once, so when
        their number has held for ``SIMULATION_SETTLE_S`` it is final: return at once instead of
        waiting in silence.
        """
        deadline = time.monotonic() + self.wait_for_clients_s
        count, since = -1, time.monotonic()
        while True:
            # Flower's compat layer refreshes the node list on this call
            available = client_manager.all()
            now = time.monotonic()
            if len(available) != count:
                count, since = len(available), now
            if count >= p or now >= deadline:
                return available
            if count and _simulated(available) and now - since >= SIMULATION_SETTLE_S:
                return available
            client_manager.wait_for(p, timeout=max(0.0, min(_POLL_S,
                                                            deadline - now)))  # type: ignore[arg-type]

    def _stop(self, error: BaseException):
        self.server.fail(error)
        raise error


def _simulated(available: dict[str, ClientProxy]) -> bool:
    """Whether the nodes are a simulation's virtual SuperNodes: their proxies talk to Flower's
    in-memory grid."""
    return any(is_simulation(getattr(proxy, "grid", None)) for proxy in available.values())


def _client_count_problem(p: int, available: dict[str, ClientProxy]) -> str:
    """Why the round cannot start with ``len(available)`` clients, and the command that fixes it."""
    n = len(available)
    if _simulated(available):
        return (
            f"the config has training.clients = {p} but this simulation has {n} SuperNodes (`flwr "
            f"run` "
                f"simulates 2 unless told otherwise). Every round needs exactly P = {p} workers. "
                f"Run it again with\n"
                f"    flwr run . --federation-config \"num-supernodes={p}\"\n"
                "(keep any other options you gave), or use ./scripts/run.sh / `diff2 run CONFIG`, "
                "which set it, or "
                "let P follow the simulation: --run-config \"training.clients='auto'\".")
    return (
        f"the config has training.clients = {p} but {n} clients are connected. Every round needs "
        f"exactly P = {p}; in a simulation pass --federation-config \"num-supernodes={p}\", in a "
        f"deployment start one SuperNode per data owner ({p}).")
