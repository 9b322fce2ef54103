"""Issue 40, item 2: a node's refusal is the run's one error line, first.

A run that ten nodes refused used to end with a 32,905-character error that opened with Flower's
"no reply from node(s) …" and hid the node's message among 235 tracebacks. Now: the strategy finds
the node's own message in what Flower reports (:func:`~diff2_flwr.runtime.policy.refusal_in`),
stops with it first and whole (:class:`~diff2_flwr.core.aggregation.NodeRefused`, said as is in
the summary), writes every failure in full to the run folder's failure log named in that line, and
`diff2 run`'s console drops the tracebacks that quote it. The Flower runs are in
tests/test_node_policy.py.
"""

from __future__ import annotations

import io
import json
from types import SimpleNamespace

import pytest

from diff2_flwr.core.aggregation import NodeRefused
from diff2_flwr.fl.strategy import Diff2Strategy
from diff2_flwr.runtime.console import RunConsole
from diff2_flwr.runtime.policy import Refused, refusal_in
import test_strategy
from test_strategy import as_results, client_replies, make_manager, make_server, summary

@pytest.fixture(scope="module")
def cfg():
    """The strategy tests' experiment (P = 3, seeded)."""
    return test_strategy.cfg.__wrapped__()


REFUSAL = Refused("node 77 (hospital-a)", "max_epsilon",
                  "the run asks ε = 3 (privacy.epsilon); this node allows at most ε = 2 per run.")


def _as_flower_reports_it(message: str) -> str:
    """A ClientApp's exception as the strategy receives it from Flower's Ray backend: the reason
    carries the actor's whole traceback, the node's message on its last line."""
    return ("Message contains an Error (reason: <class 'ray.exceptions.RayTaskError("
            "ClientAppException)'>:<'\x1b[36mray::ClientAppActor.run()\x1b[39m (pid=1, "
            "ip=192.0.2.2)"
            "\n  File \"flwr/clientapp/client_app.py\", line 144, in __call__\n"
            "    return self._call(message, context)\n"
            f"diff2_flwr.runtime.policy.Refused: {message}\n\n"
            "During handling of the above exception, another exception occurred:\n\n"
            "flwr.clientapp.client_app.ClientAppException: \n"
            f"Exception ClientAppException occurred. Message: {message}'>). It originated during "
            "client-side execution of a message.")


def test_the_nodes_message_is_found_whole_in_what_flower_reports():
    message = str(REFUSAL)
    assert refusal_in(_as_flower_reports_it(message)) == message
    # a deployment node's report (Flower's gRPC runtime): the exception's class, then the message
    assert refusal_in(f"Message contains an Error (reason: <class 'diff2_flwr.runtime.policy."
                      f"Refused'>:<'{message}'>). It originated ...") == message
    every = str(Refused("every simulated node", "methods", "the run asks method 'gd'."))
    assert refusal_in(f"diff2 run: error: {every}") == every
    assert refusal_in("TimeoutError: node cid-102 did not answer in time") is None


def test_a_round_the_nodes_refused_stops_with_the_first_refusal_and_logs_every_failure(cfg,
                                                                                        tmp_path):
    server = make_server(cfg, tmp_path)
    strategy = Diff2Strategy(server=server, round_retries=3)
    manager, _ = make_manager()
    instructions = strategy.configure_fit(1, strategy.initialize_parameters(manager), manager)
    results = as_results(client_replies(cfg, instructions))
    other = str(Refused("node 78 (hospital-b)", "max_epsilon", "the run asks ε = 3."))
    failures = [ValueError(_as_flower_reports_it(str(REFUSAL))),
                ValueError(_as_flower_reports_it(other)), TimeoutError("node 79 timed out")]
    with pytest.raises(NodeRefused) as caught:
        strategy.aggregate_fit(1, results[:1], failures)
    log = tmp_path.glob("**/round-1-failures.log")
    log = next(log)
    error = str(caught.value)
    assert error == (f"{REFUSAL} (1 other node(s) refused too.) All 3 failure(s) of round 1: "
                     "round-1-failures.log in the run folder.")
    assert log.parent == tmp_path.joinpath(*log.parent.relative_to(tmp_path).parts)
    assert "\n" not in error and len(error) < 500
    assert strategy.retries_left == 3  # a refusal is not retried: the node would say it again
    written = log.read_text()
    assert "TimeoutError: node 79 timed out" in written and written.count("Traceback") == 0
    assert written.count(str(REFUSAL)) >= 2 and "hospital-b" in written
    assert summary(server)["error"] == error and summary(server)["status"] == "failed"
    assert server.state.round == 0


def test_a_failure_without_a_refusal_is_reported_as_before(cfg, tmp_path):
    server = make_server(cfg, tmp_path)
    strategy = Diff2Strategy(server=server)
    manager, _ = make_manager()
    instructions = strategy.configure_fit(1, strategy.initialize_parameters(manager), manager)
    with pytest.raises(Exception, match=r"check 'client-failure' failed: 1 client\(s\) failed: "
                                        r"TimeoutError: node 79"):
        strategy.aggregate_fit(1, as_results(client_replies(cfg, instructions)),
                               [TimeoutError("node 79 timed out")])
    assert not list(tmp_path.glob("**/round-1-failures.log"))


def _console_of(lines: list[str]) -> str:
    out = io.StringIO()
    console = RunConsole(stream=out)
    for line in lines:
        console.feed(line)
    console.close()
    return out.getvalue()


def test_the_console_drops_the_tracebacks_that_quote_a_refusal_and_keeps_other_errors():
    message = str(REFUSAL)
    flower = ["\x1b[91mERROR \x1b[0m:     An exception was raised when processing a message by "
              "RayBackend",
              "\x1b[91mERROR \x1b[0m:     Traceback (most recent call last):",
              '  File "flwr/server/superlink/fleet/vce/vce_api.py", line 132, in worker',
              f"diff2_flwr.runtime.policy.Refused: {message}"] * 3
    shown = _console_of(["[diff2] round 0/4 (init) train_loss=0.12", *flower,
                         f"[diff2] run failed: {message}",
                         "\x1b[91mERROR \x1b[0m:     Exit Code: 700", "",
                         "An unhandled exception occurred when running the simulation."])
    assert "refused" not in shown and "Traceback" not in shown and "Exit Code" not in shown
    # an error that quotes no refusal is shown whole, as before
    other = ["\x1b[91mERROR \x1b[0m:     Traceback (most recent call last):",
             '  File "x.py", line 1, in f', "ZeroDivisionError: division by zero"]
    shown = _console_of(["[diff2] round 0/4 (init) train_loss=0.12", *other,
                         "\x1b[91mERROR \x1b[0m:     Exit Code: 700"])
    assert "ZeroDivisionError: division by zero" in shown and "Traceback" in shown
    assert "Exit Code: 700" in shown


def test_the_console_keeps_the_servers_error_for_the_end_of_run_summary():
    console = RunConsole(stream=io.StringIO())
    console.feed(f"[diff2] run failed: {REFUSAL}")
    assert console.server_error == str(REFUSAL)
    assert json.dumps(console.server_error)  # plain text, one line


# ------------------------------------------------------------------ under SecAgg+

class _ErrorReply:
    """A reply as Flower's grid returns it for a ClientApp that raised: an error, its reason."""

    def __init__(self, reason: str) -> None:
        self.error = SimpleNamespace(reason=reason)

    def has_error(self) -> bool:
        return True


def test_under_secagg_the_relay_collects_the_nodes_refusals_from_every_stage():
    from diff2_flwr.fl import secagg

    other = str(Refused("node 78 (hospital-b)", "noise", "the run asks privacy.noise = 'x'."))
    grid = SimpleNamespace(send_and_receive=lambda messages, timeout=None: [
        _ErrorReply(_as_flower_reports_it(str(REFUSAL))), _ErrorReply("TimeoutError"),
        _ErrorReply(_as_flower_reports_it(str(REFUSAL))), _ErrorReply(other)])
    refusals: list[str] = []
    relay = secagg._SignatureRelay(grid, {}, collect=None, refusals=refusals)
    assert len(relay.send_and_receive([])) == 4
    assert refusals == [str(REFUSAL), other]  # once each, in order


def test_a_secure_round_the_nodes_refused_stops_with_the_refusal_and_no_retry():
    from test_distributed_run import _Manager, config

    from diff2_flwr.runtime.session import build_server

    strategy = Diff2Strategy(server=build_server(config(), record=False, progress=None),
                             round_retries=2)
    strategy.configure_fit(1, None, _Manager(3))
    with pytest.raises(NodeRefused) as caught:
        strategy.secure_round_ended(1, (str(REFUSAL), "node 78 refused: rule `x`: y."))
    assert str(caught.value) == f"{REFUSAL} (1 other node(s) refused too.)"
    assert strategy.retries_left == 2 and strategy.server.core.status == "failed"
    assert strategy.server.core.error == str(caught.value)
