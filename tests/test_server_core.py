"""The server's pure core (runtime/server_core.py): a function of a frozen state, and the facade
only drives it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from diff2_flwr.core.aggregation import RoundRejected
from diff2_flwr.core.estimator import Diverged
from diff2_flwr.core.local import LocalTask
from diff2_flwr.runtime import server_core
from diff2_flwr.runtime.config import parse_config
from diff2_flwr.runtime.session import build_server, build_worker


def _cfg(**local):
    return parse_config({"name": "core", "dataset": {"name": "synthetic", "num_samples": 400,
                                                     "num_features": 3},
                         "training": {"rounds": 4, "restart_every": 2, "clients": 2, "seed": 7},
                         **({"local": local} if local else {})}, "core.yaml")


def _replies(cfg, plan):
    return [build_worker(cfg, p).reply(plan) for p in range(cfg.clients)]


def test_release_is_a_function_of_the_state():
    """The same state and replies give the same x_r and row, the state passed in is left as it was,
    and the facade keeps exactly what the function returns."""
    cfg = _cfg()
    server = build_server(cfg, record=False, progress=None)
    spec, before = server.spec, server.core
    replies = _replies(cfg, server.plan())
    first, out1 = server_core.release(spec, before, replies)
    second, out2 = server_core.release(spec, before, replies)
    assert before.estimator.round == 0 and before.ledger.events == ()
    np.testing.assert_array_equal(out1.release.x, out2.release.x)
    assert dict(out1.row) == dict(out2.row) and first.ledger.events == second.ledger.events
    with pytest.raises(TypeError):
        out1.row["round"] = 9  # the row handed to the journal is read-only
    server.release(replies)
    np.testing.assert_array_equal(server.state.x, out1.release.x)
    assert server.history[-1]["epsilon_spent"] == out1.row["epsilon_spent"]


def test_the_budget_guard_refuses_a_round_over_the_target():
    cfg = _cfg()
    server = build_server(cfg, record=False, progress=None)
    spec, state = server.spec, server.core
    ledger = state.ledger
    for r in range(1, spec.rounds + 1):  # the whole schedule already spent
        ledger = ledger.record(*spec.calibration.round_events((r - 1) % 2 == 0))
    spent = dataclasses.replace(state, ledger=ledger)
    with pytest.raises(RoundRejected,
                       match=r"check 'budget' failed: releasing it would bring ε spent") as err:
        server_core.release(spec, spent, _replies(cfg, server.plan()))
    assert err.value.round == 1


def test_a_call_out_of_turn_changes_nothing_and_fails_nothing():
    cfg = _cfg()
    server = build_server(cfg, record=False, progress=None)
    before = server.core
    with pytest.raises(server_core.OutOfTurn, match="No round awaits a local phase"):
        server.finish_local(None)
    assert server.core is before and server.core.status == "running"


def test_the_local_routine_releases_in_two_steps():
    """ṽ_r and the ledger's charge in release (a LocalTask; the round is pending), x_r in
    finish_local."""
    cfg = _cfg(steps=2, batch_size=8)
    server = build_server(cfg, record=False, progress=None)
    spec = server.spec
    state, task = server_core.release(spec, server.core, _replies(cfg, server.plan()), lambda r: 1)
    assert isinstance(task, LocalTask) and task.partition_id == 1 and state.pending.task is task
    assert state.estimator is server.core.estimator and len(state.ledger.events) > len(
        server.core.ledger.events)
    with pytest.raises(server_core.OutOfTurn, match="Round 1 awaits its local phase"):
        server_core.next_plan(spec, state)
    done, out = server_core.finish_local(spec, state, build_worker(cfg, 1).local_phase(task))
    assert done.pending is None and done.estimator.round == 1 and out.row["local_worker"] == 1


def test_fail_names_the_status():
    state = build_server(_cfg(), record=False, progress=None).core
    diverged = server_core.fail(state, Diverged(3, "radius", "ran away"))
    assert (diverged.status, diverged.diverged_at) == ("diverged", 3)
    failed = server_core.fail(state, ValueError("bad"))
    assert (failed.status, failed.error, failed.diverged_at) == ("failed", "ValueError: bad", None)
    assert state.status == "running"
