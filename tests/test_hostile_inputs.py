"""Hostile and broken inputs not covered case by case elsewhere: each fails closed, says why,
releases nothing.

The Strategy-level cases (client missing or answering twice, wrong number of arrays, shapes, dtype,
NaN, over-norm, failures, wrong round, corrupt bytes) are in ``test_strategy.py::test_fail_closed``;
ε, δ, T, u, YAML and unknown keys in ``test_config.py`` / ``test_privacy.py``; batch-norm in
``test_gradients.py``; the budget guard and δ >= 1/n in ``test_session.py``.
docs/explanation/privacy.md lists them all.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from diff2_flwr.core.aggregation import Reply, RoundRejected, average_contributions
from diff2_flwr.core.clipping import clip_rows
from diff2_flwr.core.estimator import RoundPlan
from diff2_flwr.core.layout import ParameterLayout
from diff2_flwr.runtime.config import parse_config
from diff2_flwr.runtime.session import build_server, build_worker, load_data
from diff2_flwr.task.data import DataError, prepare

import torch

LAYOUT = ParameterLayout(("w", "b"), ((2, 3), (3,)))


def plan(radius: float, restart: bool = True) -> RoundPlan:
    return RoundPlan(round=4, restart=restart, radius=radius, noise_std=0.0,
                     x_current=np.zeros(LAYOUT.dim),
                     x_previous=None if restart else np.zeros(LAYOUT.dim))


def reply(p: int, vector: np.ndarray, n: int = 10) -> Reply:
    return Reply(f"partition {p}", p, LAYOUT.split(vector), n, 0)


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_infinite_or_nan_contribution_is_refused(bad):
    v = np.full(LAYOUT.dim, 0.01)
    v[4] = bad
    with pytest.raises(RoundRejected,
                       match=r"Round 4 released nothing: check 'finite' failed from partition 1: "
                             r"the contribution holds 1 NaN or inf values"):
        average_contributions(plan(1.0), LAYOUT, [reply(0, np.zeros(LAYOUT.dim)), reply(1, v)],
                              clients=2, n_min=10)


def test_zero_radius_difference_round_accepts_only_zero_and_releases_no_noise():
    """x_{r-1} = x_{r-2} makes C_{2,r} = 0: every honest difference is 0, so the round adds no noise
    and any non-zero contribution is over its norm bound (refused). The ledger still charges the
    round (conservative)."""
    zero = average_contributions(plan(0.0, restart=False), LAYOUT, [reply(0, np.zeros(LAYOUT.dim)),
                                                                   reply(1, np.zeros(LAYOUT.dim))],
                                                                   clients=2, n_min=10)
    assert not np.any(zero.mean)
    tiny = np.zeros(LAYOUT.dim)
    tiny[0] = 1e-300
    with pytest.raises(RoundRejected,
                       match=r"check 'norm' failed from partition 1: the contribution's norm "
                             r"1e-300 exceeds the clipping radius 0 of this difference round"):
        average_contributions(plan(0.0, restart=False), LAYOUT, [reply(0, np.zeros(LAYOUT.dim)),
                                                                 reply(1, tiny)],
                              clients=2, n_min=10)


def test_norm_check_neither_underflows_nor_overflows():
    """np.linalg.norm squares the entries: 1e-300 reads as 0 and 1e200 as inf. The server's norm is
    scaled."""
    from diff2_flwr.core.aggregation import robust_norm

    assert np.linalg.norm(np.array([1e-300, 0.0])) == 0.0  # the trap
    assert robust_norm(np.array([1e-300, 0.0])) == 1e-300
    assert robust_norm(np.array([3e-200, 4e-200])) == pytest.approx(5e-200, rel=1e-15)
    assert robust_norm(np.array([3e200, 4e200])) == pytest.approx(5e200, rel=1e-15)
    v = np.full(LAYOUT.dim, 1e-160)  # true norm 1e-160·√9 = 3e-160, above a radius of 2e-160
    with pytest.raises(RoundRejected, match="check 'norm' failed"):
        average_contributions(plan(2e-160), LAYOUT, [reply(0, v), reply(1, np.zeros(LAYOUT.dim))],
                              clients=2, n_min=10)


def test_zero_radius_round_through_the_server_releases_the_previous_estimator():
    cfg = parse_config({"name": "t", "method": "diff2", "dataset": {"name": "synthetic",
                                                                    "num_samples": 300,
                                                                     "num_features": 3},
                        "training": {"rounds": 4, "restart_every": 4, "clients": 2, "seed": 1}})
    server = build_server(cfg, record=False, progress=None)
    workers = [build_worker(cfg, p) for p in range(2)]
    server.release([w.reply(server.plan()) for w in workers])  # round 1: restart
    # as if round 1 had not moved the iterate: x_1 = x_0
    server.state = dataclasses.replace(server.state, x_prev=server.state.x)
    p2 = server.plan()
    assert (p2.kind, p2.radius, p2.noise_std) == ("difference", 0.0, 0.0)
    v1, events = server.state.v.copy(), len(server.ledger.events)
    # the workers' gradient differences at one point are exactly 0
    server.release([w.reply(p2) for w in workers])
    np.testing.assert_array_equal(server.state.v, v1)
    assert len(server.ledger.events) == events + 1 and server.history[-1]["noise_std"] == 0.0


@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_nan_or_inf_in_the_data_is_refused(bad):
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(50, 3)), rng.normal(size=50)
    x[7, 1] = bad
    with pytest.raises(DataError, match="holds NaN or infinite values; clean it first"):
        prepare("mine", x, y, clients=2)
    y[3], x[7, 1] = bad, 0.0
    with pytest.raises(DataError, match="holds NaN or infinite values"):
        prepare("mine", x, y, clients=2)


def test_unequal_shards_calibrate_on_n_min_and_average_over_their_own_size():
    """603 samples → 482 train over 4 shards: 121, 121, 120, 120. The noise is calibrated for n_min
    = 120; each worker's ClippedMean still divides by its own n_p (the algorithm's mean, not a mean
    over n_min)."""
    cfg = parse_config({"name": "t", "method": "diff2", "dataset": {"name": "synthetic",
                                                                    "num_samples": 603,
                                                                     "num_features": 4},
                        "training": {"rounds": 6, "restart_every": 3, "clients": 4, "seed": 2}})
    data = load_data(cfg)
    assert data.shard_sizes == (121, 121, 120, 120) and data.n_min == 120
    server = build_server(cfg, record=False, progress=None)
    assert server.n_min == 120 and server.calibration.n_min == 120
    expected = cfg.calibration(120)
    assert server.calibration.sigma1 == expected.sigma1  # σ = 2z/(n_min P)
    worker = build_worker(cfg, 0)
    plan = server.plan()
    # per-sample gradients by torch.func (independent of the closed form the worker uses)
    from diff2_flwr.runtime.session import _gradients

    torch_grads = _gradients(cfg, 4, 1)
    rows = torch_grads.per_sample(plan.x_current, worker.features, worker.targets)
    clipped, _ = clip_rows(rows.to(torch.float64), plan.radius)
    mean = worker.contribute(plan.radius, plan.x_current, None).mean
    np.testing.assert_allclose(mean, (clipped.sum(0) / 121).numpy(), rtol=1e-12, atol=1e-15)


def test_a_shard_below_the_calibrated_n_min_is_refused():
    with pytest.raises(RoundRejected,
                       match=re.escape("check 'n_min' failed from partition 0: the worker holds 9 "
                                       "samples but the noise was calibrated for at least n_min = "
                                       "10")):
        average_contributions(plan(1.0), LAYOUT, [reply(0, np.zeros(LAYOUT.dim), n=9),
                                                  reply(1, np.zeros(LAYOUT.dim))],
                              clients=2, n_min=10)


# --------------------------------------------------------------------------- mechanism vs
# calibration

def _server_parts():
    cfg = parse_config({"dataset": {"name": "synthetic", "num_samples": 400},
                        "training": {"rounds": 6, "restart_every": 3, "clients": 2, "seed": 1}},
                        "m.yaml")
    server = build_server(cfg, record=False, progress=None)
    return server, dict(routine=server.routine, layout=server.layout, rounds=server.rounds,
                        clients=server.clients, n_min=server.n_min, calibration=server.calibration)


@pytest.mark.parametrize("change, match", [
    ({"mechanism": {"sigma_restart": 0.5}},
     r"sigma_restart \(σ1\) is 0.5, the calibration's 0\.01"),
    ({"mechanism": {"sigma_diff": 1e-9}}, r"sigma_diff \(σ2\) is 1e-09, the calibration's"),
    ({"mechanism": {"restart_every": 2}}, r"restart_every \(T\) is 2, the calibration's 3"),
    ({"mechanism": {"clip_diff": float("inf"), "sigma_diff": 0.0}},
     r"sigma_diff.*a clipping radius is infinite"),
    ({"rounds": 7}, r"rounds is 7, the calibration's 6"),
    ({"clients": 3}, r"clients \(P\) is 3, the calibration's 2"),
    ({"n_min": 100}, r"n_min is 100, the calibration's 160"),
])
def test_a_server_refuses_a_mechanism_that_disagrees_with_its_calibration(change, match):
    """The ledger charges the calibration's z: any other noise, schedule, P or n_min would make ε a
    fiction."""
    from diff2_flwr.runtime.server_core import ServerSpec
    from diff2_flwr.runtime.session import Diff2Server

    server, kwargs = _server_parts()
    change = dict(change)
    mechanism = dataclasses.replace(server.mechanism, **change.pop("mechanism", {}))
    kwargs.update(change)
    with pytest.raises(ValueError,
                       match=r"The mechanism disagrees with the calibration the ledger accounts "
                             r"for: "
                       + match):
        Diff2Server(ServerSpec(mechanism=mechanism, **kwargs), x0=server.state.x, seed=1)


def test_the_calibrated_mechanism_is_accepted():
    from diff2_flwr.runtime.server_core import ServerSpec
    from diff2_flwr.runtime.session import Diff2Server

    server, kwargs = _server_parts()
    assert Diff2Server(ServerSpec(mechanism=server.mechanism, **kwargs), x0=server.state.x,
                       seed=1).state.round == 0
