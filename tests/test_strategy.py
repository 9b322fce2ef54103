"""Unit tests of the Flower glue (Diff2Strategy, Diff2Client, protocol) without `flwr run`.

The strategy is driven by hand: ``configure_fit`` -> real ``Diff2Client.fit`` per partition ->
``FitRes`` -> ``aggregate_fit``. Client proxies are fakes registered in a real
``SimpleClientManager`` (the strategy only reads their ``cid``).
"""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server.client_manager import SimpleClientManager
from flwr.server.client_proxy import ClientProxy

from exact_norms import inside as exactly_inside
from diff2_flwr.core.aggregation import NORM_RTOL, Reply, RoundRejected, average_contributions
from diff2_flwr.core.estimator import RoundPlan
from diff2_flwr.core.layout import ParameterLayout
from diff2_flwr.fl import protocol
from diff2_flwr.fl.client import Diff2Client
from diff2_flwr.fl.strategy import Diff2Strategy
from diff2_flwr.runtime.config import parse_config
from diff2_flwr.runtime.session import Diff2Server, Worker, build_server, build_worker

P = 3
ROUNDS = 4


# ------------------------------------------------------------------------------ fixtures / helpers

class FakeProxy(ClientProxy):
    """A ClientProxy that is never called: the strategy only reads ``cid``."""

    def get_properties(self, ins, timeout, group_id):
        raise NotImplementedError

    def get_parameters(self, ins, timeout, group_id):
        raise NotImplementedError

    def fit(self, ins, timeout, group_id):
        raise NotImplementedError

    def evaluate(self, ins, timeout, group_id):
        raise NotImplementedError

    def reconnect(self, ins, timeout, group_id):
        raise NotImplementedError


def cid_of(partition: int) -> str:
    # Node ids deliberately differ from partition ids, so messages naming one are not mistaken for
    # the other.
    return f"cid-{100 + partition}"


def partition_of(cid: str) -> int:
    return int(cid.removeprefix("cid-")) - 100


@pytest.fixture(scope="module")
def cfg():
    return parse_config({
        "name": "strategy-test",
        "method": "diff2",
        "dataset": {"name": "synthetic", "num_samples": 400},
        "training": {"rounds": ROUNDS, "restart_every": 2, "clients": P, "seed": 0},
        "evaluation": {"every": 1, "train_metrics": True, "test_metrics": True},
    })


def make_server(cfg, root: Path) -> Diff2Server:
    return build_server(cfg, output_root=root, progress=None)


def make_manager(n: int = P) -> tuple[SimpleClientManager, dict[str, FakeProxy]]:
    manager = SimpleClientManager()
    proxies = {}
    for p in range(n):
        proxy = FakeProxy(cid_of(p))
        assert manager.register(proxy)
        proxies[proxy.cid] = proxy
    return manager, proxies


def run_dir(server: Diff2Server) -> Path:
    return Path(server.run_info["output_dir"])


def metrics_rows(server: Diff2Server) -> list[dict]:
    text = (run_dir(server) / "metrics.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def summary(server: Diff2Server) -> dict:
    return json.loads((run_dir(server) / "summary.json").read_text())


def client_replies(cfg, instructions) -> list[tuple[ClientProxy, list[np.ndarray], int, dict]]:
    """Run the real Diff2Client of each proxy's partition on its FitIns (the proxy's partition from
    its cid)."""
    out = []
    for proxy, fit_ins in instructions:
        arrays = parameters_to_ndarrays(fit_ins.parameters)
        client = Diff2Client(build_worker(cfg, partition_of(proxy.cid)))
        reply_arrays, n, metrics = client.fit(arrays, dict(fit_ins.config))
        out.append((proxy, reply_arrays, n, metrics))
    return out


def fit_res(arrays, n, metrics, code: Code = Code.OK, message: str = "") -> FitRes:
    return FitRes(status=Status(code=code, message=message),
                  parameters=ndarrays_to_parameters(arrays), num_examples=n, metrics=metrics)


def as_results(replies) -> list[tuple[ClientProxy, FitRes]]:
    return [(proxy, fit_res(arrays, n, metrics)) for proxy, arrays, n, metrics in replies]


def one_round(strategy: Diff2Strategy, manager, cfg, server_round: int):
    """configure_fit -> real clients -> aggregate_fit for one honest round."""
    instructions = strategy.configure_fit(server_round, strategy.initialize_parameters(manager),
                                          manager)
    return strategy.aggregate_fit(server_round, as_results(client_replies(cfg, instructions)), [])


def drive_directly(cfg, root: Path) -> Diff2Server:
    """The same run without Flower: Diff2Server.release on Worker.contribute replies."""
    server = make_server(cfg, root)
    workers = [build_worker(cfg, p) for p in range(P)]
    while not server.done:
        plan = server.plan()
        replies = []
        for w in workers:
            c = w.contribute(plan.radius, plan.x_current, plan.x_previous)
            replies.append(Reply(client=f"partition {w.partition_id}", partition_id=w.partition_id,
                                 arrays=server.layout.split(c.mean), num_samples=c.num_samples,
                                 num_clipped=c.num_clipped))
        server.release(replies)
    return server


# ------------------------------------------------------------------------------ happy path

def test_happy_path_four_rounds(cfg, tmp_path):
    server = make_server(cfg, tmp_path / "flower")
    strategy = Diff2Strategy(server=server)
    manager, proxies = make_manager()
    layout = server.layout
    k = len(layout.shapes)

    x0 = layout.flatten(parameters_to_ndarrays(strategy.initialize_parameters(manager)))
    np.testing.assert_array_equal(x0, server.state.x)

    kinds = []
    for r in range(1, ROUNDS + 1):
        before = server.state
        instructions = strategy.configure_fit(r, strategy.initialize_parameters(manager), manager)
        # every connected client, once, in cid order
        assert [proxy.cid for proxy, _ in instructions] == sorted(proxies)
        assert all(proxy is proxies[proxy.cid] for proxy, _ in instructions)
        fit_ins = instructions[0][1]
        assert all(ins is fit_ins or ins == fit_ins for _, ins in instructions)
        config = fit_ins.config
        arrays = parameters_to_ndarrays(fit_ins.parameters)
        assert config[protocol.ROUND] == r
        restart = (r - 1) % 2 == 0
        kinds.append(config[protocol.KIND])
        assert config[protocol.KIND] == ("restart" if restart else "difference")
        if restart:
            assert len(arrays) == k
            np.testing.assert_array_equal(layout.flatten(arrays), before.x)
            assert config[protocol.RADIUS] == cfg.training.clip_restart
        else:
            assert len(arrays) == 2 * k
            np.testing.assert_array_equal(layout.flatten(arrays[:k]), before.x)  # x_{r-1}
            np.testing.assert_array_equal(layout.flatten(arrays[k:]), before.x_prev)  # x_{r-2}
            expected_radius = cfg.training.clip_diff * np.linalg.norm(before.x - before.x_prev)
            assert config[protocol.RADIUS] == pytest.approx(expected_radius, rel=1e-12)
            assert config[protocol.RADIUS] > 0
        for a in arrays:
            assert a.dtype == np.float64

        replies = client_replies(cfg, instructions)
        for proxy, reply_arrays, n, metrics in replies:
            assert metrics[protocol.PARTITION_ID] == partition_of(proxy.cid)
            assert metrics[protocol.ECHO_ROUND] == r
            assert len(reply_arrays) == k
            assert n == build_worker(cfg, partition_of(proxy.cid)).num_samples
        params, agg_metrics = strategy.aggregate_fit(r, as_results(replies), [])
        assert isinstance(agg_metrics, dict)
        assert server.state.round == r
        released = layout.flatten(parameters_to_ndarrays(params))
        np.testing.assert_array_equal(released, server.state.x)
        assert not np.array_equal(released, before.x)

    assert kinds == ["restart", "difference", "restart", "difference"]
    assert server.done

    rows = metrics_rows(server)
    assert [row["round"] for row in rows] == [0, 1, 2, 3, 4]
    assert [row["kind"] for row in rows] == ["init", *kinds]
    # evaluation on, every round
    assert all("test_loss" in row and "train_loss" in row for row in rows)
    s = summary(server)
    assert s["status"] == "completed"
    assert s["error"] is None
    assert s["rounds_released"] == ROUNDS
    assert math.isfinite(s["privacy"]["epsilon_spent"]) and s["privacy"]["epsilon_spent"] > 0

    # Server-side evaluation only: Flower's federated evaluation is a no-op.
    assert strategy.configure_evaluate(1, params, manager) == []
    assert strategy.evaluate(1, params) is None

    # The same seed driven without Flower gives bit-identical iterates.
    direct = drive_directly(cfg, tmp_path / "direct")
    assert direct.state.round == ROUNDS
    np.testing.assert_array_equal(server.state.x, direct.state.x)
    np.testing.assert_array_equal(server.state.x_prev, direct.state.x_prev)
    np.testing.assert_array_equal(server.state.v, direct.state.v)
    assert summary(direct)["status"] == "completed"


# ------------------------------------------------------------------------------ fail closed

def _tamper_array(replies, partition, fn):
    """Apply ``fn(arrays) -> arrays`` to the reply of ``partition``."""
    out = []
    for proxy, arrays, n, metrics in replies:
        if partition_of(proxy.cid) == partition:
            arrays = fn([a.copy() for a in arrays])
        out.append((proxy, arrays, n, metrics))
    return out


def _scale_to(arrays, norm):
    flat = np.concatenate([a.ravel() for a in arrays])
    factor = norm / np.linalg.norm(flat)
    return [a * factor for a in arrays]


def _nan(arrays):
    arrays[2][0, 3] = np.nan
    return arrays


def case_missing(replies, plan, proxies):
    return as_results([r for r in replies if partition_of(r[0].cid) != 2]), []


def case_reshaped(replies, plan, proxies):
    return as_results(_tamper_array(replies, 1, lambda a: [a[0].reshape(8, 10), *a[1:]])), []


def case_truncated(replies, plan, proxies):
    return as_results(_tamper_array(replies, 1, lambda a: [a[0], a[1][:-1], *a[2:]])), []


def case_too_few_arrays(replies, plan, proxies):
    return as_results(_tamper_array(replies, 1, lambda a: a[:-1])), []


def case_too_many_arrays(replies, plan, proxies):
    return as_results(_tamper_array(replies, 1, lambda a: a + [np.zeros(1)])), []


def case_nan(replies, plan, proxies):
    return as_results(_tamper_array(replies, 1, _nan)), []


def case_unclipped(replies, plan, proxies):
    return as_results(_tamper_array(replies, 1, lambda a: _scale_to(a, 2 * plan.radius))), []


def case_duplicate(replies, plan, proxies):
    # node cid-102 answers with partition 1's reply (partition 1 answers twice, partition 2 never)
    by_partition = {partition_of(proxy.cid): (arrays, n, metrics) for proxy, arrays, n,
                    metrics in replies}
    arrays, n, metrics = by_partition[1]
    tampered = [(proxies[cid_of(0)], *by_partition[0]), (proxies[cid_of(1)], arrays, n, metrics),
                (proxies[cid_of(2)], [a.copy() for a in arrays], n, dict(metrics))]
    return as_results(tampered), []


def case_float32(replies, plan, proxies):
    return as_results(_tamper_array(replies, 1, lambda a: [x.astype(np.float32) for x in a])), []


def case_failure_status(replies, plan, proxies):
    ok = [r for r in replies if partition_of(r[0].cid) != 2]
    bad = next(r for r in replies if partition_of(r[0].cid) == 2)
    failed = fit_res(bad[1], bad[2], bad[3], code=Code.FIT_NOT_IMPLEMENTED,
                     message="worker crashed")
    return as_results(ok), [(bad[0], failed)]


def case_failure_exception(replies, plan, proxies):
    # Flower still returns P results here but also reports a failure: any failure rejects the round.
    return as_results(replies), [TimeoutError("node cid-102 did not answer in time")]


def case_wrong_round(replies, plan, proxies):
    out = []
    for proxy, arrays, n, metrics in replies:
        if partition_of(proxy.cid) == 1:
            metrics = {**metrics, protocol.ECHO_ROUND: plan.round - 1}
        out.append((proxy, arrays, n, metrics))
    return as_results(out), []


# (tamper, expected check, regex the message must match): the regex names the client/partition and
# check.
FAIL_CASES = {
    "a-missing-client": (case_missing, "all-clients",
                         r"Round \d released nothing: check 'all-clients' failed: .*2 answered; "
                         r"missing partitions \[2\]"),
    "b-reshaped": (case_reshaped, "shape",
                   r"check 'shape' failed from partition 1 \(node cid-101\): array "
                   r"'hidden.weight' must have shape \(10, 8\), found \(8, 10\)"),
    "b-truncated": (case_truncated, "shape",
                    r"check 'shape' failed from partition 1 \(node cid-101\): array 'hidden.bias' "
                    r"must have shape \(10,\), found \(9,\)"),
    "c-too-few-arrays": (case_too_few_arrays, "arrays",
                         r"check 'arrays' failed from partition 1 \(node cid-101\): expected 4 "
                         r"arrays .*found 3"),
    "c-too-many-arrays": (case_too_many_arrays, "arrays",
                          r"check 'arrays' failed from partition 1 \(node cid-101\): expected 4 "
                          r"arrays .*found 5"),
    "d-nan": (case_nan, "finite",
              r"check 'finite' failed from partition 1 \(node cid-101\): the contribution holds 1 "
              r"NaN"),
    "e-unclipped": (case_unclipped, "norm",
                    r"check 'norm' failed from partition 1 \(node cid-101\): the contribution's "
                    r"norm .* exceeds the clipping radius"),
    "f-duplicate": (case_duplicate, "duplicate",
                    r"check 'duplicate' failed: partition 1 answered twice \(partition 1 \(node "
                    r"cid-101\) and partition 1 \(node cid-102\)\)"),
    "g-float32": (case_float32, "dtype",
                  r"check 'dtype' failed from partition 1 \(node cid-101\): array 'hidden.weight' "
                  r"must be float64, found float32"),
    "h-failure-status": (case_failure_status, "client-failure",
                         r"check 'client-failure' failed: 1 client\(s\) failed: node cid-102: "
                         r"status FIT_NOT_IMPLEMENTED worker crashed"),
    "h-failure-exception": (case_failure_exception, "client-failure",
                            r"check 'client-failure' failed: 1 client\(s\) failed: TimeoutError: "
                            r"node cid-102"),
    "i-wrong-round": (case_wrong_round, "round",
                      r"check 'round' failed from node cid-101: the reply is for round \d"),
}


@pytest.mark.parametrize("bad_round", [1, 2], ids=["restart-round", "difference-round"])
@pytest.mark.parametrize("case", list(FAIL_CASES))
def test_fail_closed(cfg, tmp_path, case, bad_round):
    tamper, check, pattern = FAIL_CASES[case]
    server = make_server(cfg, tmp_path)
    strategy = Diff2Strategy(server=server)
    manager, proxies = make_manager()
    for r in range(1, bad_round):
        one_round(strategy, manager, cfg, r)
    assert summary(server)["status"] == "running"

    instructions = strategy.configure_fit(bad_round, strategy.initialize_parameters(manager),
                                          manager)
    plan = server.plan()
    assert plan.round == bad_round and plan.kind == ("restart" if bad_round == 1 else "difference")
    replies = client_replies(cfg, instructions)
    results, failures = tamper(replies, plan, proxies)

    state_before = server.state
    x_before = server.state.x.copy()
    epsilon_before = server.epsilon_spent
    rows_before = metrics_rows(server)
    assert len(rows_before) == bad_round  # rounds 0 .. bad_round-1

    with pytest.raises(RoundRejected, match=pattern) as info:
        strategy.aggregate_fit(bad_round, results, failures)
    err = info.value
    assert err.check == check
    assert err.round == bad_round

    # nothing released
    assert server.state is state_before
    assert server.state.round == bad_round - 1
    np.testing.assert_array_equal(server.state.x, x_before)
    assert server.epsilon_spent == epsilon_before
    assert metrics_rows(server) == rows_before
    s = summary(server)
    assert s["status"] == "failed"
    assert s["error"] == f"RoundRejected: {err}"
    assert s["rounds_released"] == bad_round - 1


def test_honest_replies_of_the_fail_closed_setup_are_accepted(cfg, tmp_path):
    """Control for test_fail_closed: the untampered replies of the same round are released."""
    server = make_server(cfg, tmp_path)
    strategy = Diff2Strategy(server=server)
    manager, proxies = make_manager()
    instructions = strategy.configure_fit(1, strategy.initialize_parameters(manager), manager)
    replies = client_replies(cfg, instructions)
    # the tolerated form of "exactly at the radius": scaled to the radius itself
    plan = server.plan()
    replies = _tamper_array(replies, 1, lambda a: _scale_to(a, plan.radius))
    strategy.aggregate_fit(1, as_results(replies), [])
    assert server.state.round == 1
    assert len(metrics_rows(server)) == 2


def test_configure_fit_rejects_round_mismatch(cfg, tmp_path):
    server = make_server(cfg, tmp_path)
    strategy = Diff2Strategy(server=server)
    manager, _ = make_manager()
    with pytest.raises(RuntimeError,
                       match="Flower asked for round 2 but the DIFF2 server is at round 1"):
        strategy.configure_fit(2, strategy.initialize_parameters(manager), manager)
    assert summary(server)["status"] == "failed"
    assert server.state.round == 0


# ------------------------------------------------------------------------------ float rounding at
# the radius

def _rounding_plan(radius: float, dim: int) -> tuple[RoundPlan, ParameterLayout]:
    layout = ParameterLayout(names=("w", "b"), shapes=((dim - 1,), (1,)))
    plan = RoundPlan(round=1, restart=True, radius=radius, noise_std=0.0, x_current=np.zeros(dim),
                     x_previous=None)
    return plan, layout


def _vector_with_norm(rng, dim, norm):
    v = rng.standard_normal(dim)
    return v * (norm / np.linalg.norm(v))


def test_norm_rounding_excess_is_accepted_and_projected():
    rng = np.random.default_rng(0)
    radius = 0.7
    plan, layout = _rounding_plan(radius, 101)
    v = _vector_with_norm(rng, 101, radius * (1 + 1e-12))
    assert np.linalg.norm(v) > radius  # really over the radius, but within the float tolerance
    reply = Reply("partition 0", 0, layout.split(v), num_samples=10, num_clipped=10)
    agg = average_contributions(plan, layout, [reply], clients=1, n_min=10)  # accepted: no raise
    norm = float(np.linalg.norm(agg.mean))
    # projected back: the 1e-12 excess is gone — its exact norm is within the radius, below it by
    # the norms' rounding-error bound at most (2γ_105 ≈ 2.3e-14) — and the direction is kept
    assert exactly_inside(agg.mean, radius)
    assert norm == pytest.approx(radius, rel=1e-13)
    np.testing.assert_allclose(agg.mean, v * (radius / np.linalg.norm(v)), rtol=1e-13, atol=0)
    assert agg.clip_fraction == 1.0

    # and with P = 3 honest peers the mean's norm stays within the bound of the sum of radii / P
    others = [Reply(f"partition {p}", p, layout.split(_vector_with_norm(rng, 101, radius / 2)), 10,
                    0) for p in (1, 2)]
    agg3 = average_contributions(plan, layout, [reply, *others], clients=3, n_min=10)
    assert np.linalg.norm(agg3.mean) <= radius * (1 + 1e-14)

    # beyond the tolerance it is a client that did not clip: rejected
    too_big = Reply("partition 0", 0, layout.split(v * (1 + 10 * NORM_RTOL)), 10, 10)
    with pytest.raises(RoundRejected, match=r"check 'norm' failed from partition 0"):
        average_contributions(plan, layout, [too_big], clients=1, n_min=10)


def test_projected_contribution_norm_is_at_most_the_radius_exactly():
    rng = np.random.default_rng(1)
    dim = 101
    worst = 0.0
    for _ in range(64):
        radius = float(rng.uniform(0.01, 3.0))
        plan, layout = _rounding_plan(radius, dim)
        v = _vector_with_norm(rng, dim, radius * (1 + 1e-12))
        reply = Reply("partition 0", 0, layout.split(v), num_samples=5, num_clipped=5)
        agg = average_contributions(plan, layout, [reply], clients=1, n_min=5)
        worst = max(worst, float(np.linalg.norm(agg.mean)) / radius - 1)
        assert exactly_inside(agg.mean, radius)  # the exact norm, not a computed one
    assert worst <= 0.0, (f"a projected contribution's norm exceeds its radius by a relative "
                          f"{worst:.3g}")


# ------------------------------------------------------------------------------ client count

def test_configure_fit_with_too_few_clients_names_num_supernodes(cfg, tmp_path):
    server = make_server(cfg, tmp_path)
    strategy = Diff2Strategy(server=server, wait_for_clients_s=1)
    manager, _ = make_manager(P - 1)
    with pytest.raises(RoundRejected,
                       match=r"training.clients = 3 but 2 clients are connected.*num-supernodes=3"):
        strategy.configure_fit(1, strategy.initialize_parameters(manager), manager)
    assert server.state.round == 0
    s = summary(server)
    assert s["status"] == "failed"
    assert "num-supernodes" in s["error"]


def test_configure_fit_with_too_many_clients_is_rejected(cfg, tmp_path):
    server = make_server(cfg, tmp_path)
    strategy = Diff2Strategy(server=server, wait_for_clients_s=1)
    manager, _ = make_manager(P + 1)
    with pytest.raises(RoundRejected, match=r"but 4 clients are connected.*num-supernodes=3"):
        strategy.configure_fit(1, strategy.initialize_parameters(manager), manager)
    assert summary(server)["status"] == "failed"


class SimulatedProxy(FakeProxy):
    """A proxy of a simulation's virtual SuperNode: it talks to Flower's in-memory grid (as
    GridClientProxy does)."""

    def __init__(self, cid: str) -> None:
        super().__init__(cid)
        from flwr.superlink.grid.inmemory_grid import InMemoryGrid

        self.grid = object.__new__(InMemoryGrid)  # only its type is read


def test_a_simulation_with_the_wrong_number_of_supernodes_fails_at_once_naming_the_command(
    cfg, tmp_path):
    server = make_server(cfg, tmp_path)
    strategy = Diff2Strategy(server=server, wait_for_clients_s=120)
    manager = SimpleClientManager()
    for p in range(2):  # `flwr run .` simulates 2 SuperNodes by default
        assert manager.register(SimulatedProxy(cid_of(p)))
    started = time.monotonic()
    with pytest.raises(RoundRejected,
                       match=r"training.clients = 3 but this simulation has 2 SuperNodes") as err:
        strategy.configure_fit(1, strategy.initialize_parameters(manager), manager)
    # not the 120 s a deployment may wait for slow SuperNodes (a busy CI)
    assert time.monotonic() - started < 60
    assert 'flwr run . --federation-config "num-supernodes=3"' in str(err.value)
    assert summary(server)["status"] == "failed" and "num-supernodes=3" in summary(server)["error"]


def test_a_simulation_with_p_supernodes_starts_the_round(cfg, tmp_path):
    server = make_server(cfg, tmp_path)
    strategy = Diff2Strategy(server=server, wait_for_clients_s=120)
    manager = SimpleClientManager()
    for p in range(P):
        assert manager.register(SimulatedProxy(cid_of(p)))
    instructions = strategy.configure_fit(1, strategy.initialize_parameters(manager), manager)
    assert len(instructions) == P


def test_a_deployment_still_waits_for_slowly_starting_supernodes(cfg, tmp_path):
    server = make_server(cfg, tmp_path)
    strategy = Diff2Strategy(server=server, wait_for_clients_s=60)
    manager, _ = make_manager(P - 1)
    # longer than the settle time
    late = threading.Timer(3.0, lambda: manager.register(FakeProxy(cid_of(P - 1))))
    late.start()
    try:
        instructions = strategy.configure_fit(1, strategy.initialize_parameters(manager), manager)
    finally:
        late.cancel()
    assert sorted(proxy.cid for proxy, _ in instructions) == [cid_of(p) for p in range(P)]


def test_wait_for_clients_must_be_positive(cfg, tmp_path):
    server = make_server(cfg, tmp_path)
    with pytest.raises(ValueError, match="wait_for_clients_s"):
        Diff2Strategy(server=server, wait_for_clients_s=0)


# ------------------------------------------------------------------------------
# protocol.decode_task

@pytest.fixture(scope="module")
def layout(cfg):
    return build_worker(cfg, 0).gradients.layout


def _task(layout, kind, k_factor=None):
    arrays = layout.split(np.arange(layout.dim, dtype=np.float64))
    k_factor = k_factor if k_factor is not None else (1 if kind == "restart" else 2)
    return arrays * k_factor, {protocol.ROUND: 2, protocol.KIND: kind, protocol.RADIUS: 0.5,
                               protocol.N_MIN: 100}


def test_decode_task_accepts_well_formed_messages(layout):
    arrays, config = _task(layout, "difference")
    task = protocol.decode_task(arrays, config, layout)
    assert task.round == 2 and task.radius == 0.5
    np.testing.assert_array_equal(task.x_current, np.arange(layout.dim))
    np.testing.assert_array_equal(task.x_previous, np.arange(layout.dim))
    arrays, config = _task(layout, "restart")
    task = protocol.decode_task(arrays, config, layout)
    assert task.x_previous is None


@pytest.mark.parametrize("key", [protocol.ROUND, protocol.KIND, protocol.RADIUS, protocol.N_MIN])
def test_decode_task_rejects_missing_keys(layout, key):
    arrays, config = _task(layout, "restart")
    del config[key]
    with pytest.raises(ValueError, match=rf"lacks config keys \['{key}'\]"):
        protocol.decode_task(arrays, config, layout)


def test_decode_task_rejects_empty_config(layout):
    arrays, _ = _task(layout, "restart")
    with pytest.raises(ValueError, match="lacks config keys"):
        protocol.decode_task(arrays, {}, layout)


@pytest.mark.parametrize("kind, count", [("restart", 8), ("restart", 3), ("restart", 0),
                                         ("difference", 4), ("difference", 7), ("difference", 9)])
def test_decode_task_rejects_wrong_array_count(layout, kind, count):
    arrays, config = _task(layout, kind, k_factor=3)
    expected = 4 if kind == "restart" else 8
    with pytest.raises(ValueError,
                       match=rf"A {kind} round carries {expected} arrays. Found {count}"):
        protocol.decode_task(arrays[:count], config, layout)


@pytest.mark.parametrize("kind, radius, pattern", [
    ("warmup", 0.5, "must be one of"), ("restart", -1.0, "must be >= 0"), ("restart", math.nan,
                                                                           "must be >= 0"),
])
def test_decode_task_rejects_bad_kind_or_radius(layout, kind, radius, pattern):
    arrays, config = _task(layout, "restart")
    config[protocol.KIND], config[protocol.RADIUS] = kind, radius
    with pytest.raises(ValueError, match=pattern):
        protocol.decode_task(arrays, config, layout)


def test_client_refuses_malformed_task(cfg, layout):
    """The real client surfaces the protocol error instead of computing on a malformed message."""
    client = Diff2Client(build_worker(cfg, 0))
    arrays, config = _task(layout, "difference")
    with pytest.raises(ValueError, match="carries 8 arrays. Found 4"):
        client.fit(arrays[:4], config)


def test_corrupt_reply_bytes_release_nothing_and_are_recorded(cfg, tmp_path):
    server = make_server(cfg, tmp_path)
    strategy = Diff2Strategy(server=server)
    manager, _ = make_manager()
    instructions = strategy.configure_fit(1, strategy.initialize_parameters(manager), manager)
    results = as_results(client_replies(cfg, instructions))
    proxy, res = results[0]
    res.parameters.tensors[0] = b"not a numpy array"
    with pytest.raises(RoundRejected,
                       match=rf"check 'protocol' failed from node {proxy.cid}: cannot decode"):
        strategy.aggregate_fit(1, results, [])
    assert server.state.round == 0 and len(metrics_rows(server)) == 1
    assert summary(server)["status"] == "failed"


# ------------------------------------------------------------------------------ dead nodes and
# retries

def test_a_silent_node_is_named_and_nothing_is_released(cfg, tmp_path):
    server = make_server(cfg, tmp_path)
    strategy = Diff2Strategy(server=server)
    manager, proxies = make_manager()
    instructions = strategy.configure_fit(1, strategy.initialize_parameters(manager), manager)
    results = as_results(client_replies(cfg, instructions))
    dead = results.pop(1)[0].cid  # its reply never came: Flower reports a bare exception
    with pytest.raises(RoundRejected,
                       match=rf"no reply from node\(s\) {dead} \(died or timed out\)"):
        strategy.aggregate_fit(1, results, [ValueError("Expected one Message but got: 0")])
    assert server.state.round == 0 and summary(server)["status"] == "failed"


def test_a_failed_round_is_retried_without_release_then_the_run_continues(cfg, tmp_path):
    server = make_server(cfg, tmp_path)
    strategy = Diff2Strategy(server=server, round_retries=1)
    manager, _ = make_manager()
    one_round(strategy, manager, cfg, 1)
    instructions = strategy.configure_fit(2, strategy.initialize_parameters(manager), manager)
    results = as_results(client_replies(cfg, instructions))
    results.pop(0)
    params, _ = strategy.aggregate_fit(2, results, [TimeoutError("node timed out")])
    # nothing released
    assert params is None and server.state.round == 1 and len(metrics_rows(server)) == 2
    # Flower's next round (3) retries DIFF2 round 2 with the same plan
    instructions = strategy.configure_fit(3, strategy.initialize_parameters(manager), manager)
    assert instructions[0][1].config["diff2.round"] == 2
    strategy.aggregate_fit(3, as_results(client_replies(cfg, instructions)), [])
    assert server.state.round == 2
    # no retries left: the next failure stops the run
    instructions = strategy.configure_fit(4, strategy.initialize_parameters(manager), manager)
    with pytest.raises(RoundRejected, match="client-failure"):
        strategy.aggregate_fit(4, [], [TimeoutError("node timed out")])
    assert summary(server)["status"] == "failed" and server.state.round == 2


# ------------------------------------------------------------------------------ the local routine:
# two Flower rounds

LOCAL_P = 4
# Node ids in another order than the partitions they hold: the local phase must follow the
# partition-id metric of the gradient phase's replies, not the order of the nodes.
LOCAL_NODES = {"cid-203": 0, "cid-201": 1, "cid-200": 2, "cid-202": 3}
NODE_OF = {p: cid for cid, p in LOCAL_NODES.items()}


@pytest.fixture(scope="module")
def local_cfg():
    # The calibration of tests/test_local.py's runs: the PLD search of σ3 (seconds) is cached per
    # process by its arguments, so both files pay for it once.
    return parse_config({
        "name": "strategy-local", "method": "diff2", "dataset": {"name": "synthetic",
                                                                 "num_samples": 2000},
        "training": {"rounds": 12, "restart_every": 4, "clients": LOCAL_P, "learning_rate": 0.1,
                     "seed": 7,
                     "clip_diff": 3.0},
        "local": {"steps": 3, "batch_size": 32, "clip": 3.0, "share": 0.5},
        "evaluation": {"every": 4},
    })


def local_manager() -> tuple[SimpleClientManager, dict[str, FakeProxy]]:
    manager = SimpleClientManager()
    proxies = {}
    for cid in LOCAL_NODES:
        proxy = FakeProxy(cid)
        assert manager.register(proxy)
        proxies[cid] = proxy
    return manager, proxies


def node_replies(cfg, instructions) -> list[tuple[ClientProxy, list[np.ndarray], int, dict]]:
    """The real Diff2Client of each node's partition answers its FitIns (gradient or local phase
    alike)."""
    out = []
    for proxy, fit_ins in instructions:
        client = Diff2Client(build_worker(cfg, LOCAL_NODES[proxy.cid]))
        out.append((proxy, *client.fit(parameters_to_ndarrays(fit_ins.parameters),
                                       dict(fit_ins.config))))
    return out


def gradient_phase(strategy, manager, cfg, server_round: int):
    instructions = strategy.configure_fit(server_round, None, manager)
    assert len(instructions) == LOCAL_P
    return strategy.aggregate_fit(server_round, as_results(node_replies(cfg, instructions)), [])


def strip_elapsed(rows):
    return [{k: v for k, v in r.items() if k != "elapsed_s"} for r in rows]


def test_local_routine_takes_two_flower_rounds_and_equals_the_in_process_driver(local_cfg,
                                                                                tmp_path):
    from diff2_flwr.runtime.compute import pinned_threads

    # as the ServerApp, ClientApps and the driver do
    with pinned_threads(local_cfg.training.threads):
        _two_phase_run_equals_the_driver(local_cfg, tmp_path)


def _two_phase_run_equals_the_driver(local_cfg, tmp_path):
    from diff2_flwr.core.local import choose_worker
    from diff2_flwr.runtime.driver import run_inprocess

    server = make_server(local_cfg, tmp_path)
    strategy = Diff2Strategy(server=server)
    manager, proxies = local_manager()
    layout, k, rounds = server.layout, len(server.layout.shapes), local_cfg.training.rounds
    assert strategy.num_rounds == 2 * rounds
    chosen = []
    for r in range(1, rounds + 1):
        before = server.state
        # gradient phase: Flower round 2r - 1, all P nodes, releases ṽ_r but not x_r
        instructions = strategy.configure_fit(2 * r - 1, None, manager)
        assert sorted(proxy.cid for proxy, _ in instructions) == sorted(LOCAL_NODES)
        assert instructions[0][1].config[protocol.KIND] in ("restart", "difference")
        params, _ = strategy.aggregate_fit(2 * r - 1, as_results(node_replies(local_cfg,
                                                                              instructions)), [])
        assert params is None and server.state is before and server.pending is not None
        # local phase: Flower round 2r, one FitIns, to the node that answered as the chosen
        # partition
        p = choose_worker(before.noise_key, r, LOCAL_P)
        instructions = strategy.configure_fit(2 * r, None, manager)
        assert len(instructions) == 1
        proxy, fit_ins = instructions[0]
        assert proxy is proxies[NODE_OF[p]]
        config, arrays = fit_ins.config, parameters_to_ndarrays(fit_ins.parameters)
        assert config[protocol.KIND] == protocol.LOCAL and config[protocol.ROUND] == r
        assert config[protocol.PARTITION_ID] == p and config[protocol.LOCAL_STEPS] == 3
        assert config[protocol.LOCAL_BATCH_SIZE] == 32 and config[
            protocol.LOCAL_SIGMA] == server.local.sigma
        assert protocol.LOCAL_SEED in config  # a seeded run: the worker's generator is reproducible
        np.testing.assert_array_equal(layout.flatten(arrays[:k]), before.x)  # x_(r-1)
        np.testing.assert_array_equal(layout.flatten(arrays[k:]), server.pending[1])  # ṽ_r
        params, _ = strategy.aggregate_fit(2 * r, as_results(node_replies(local_cfg, instructions)),
                                           [])
        assert server.state.round == r and server.pending is None
        np.testing.assert_array_equal(layout.flatten(parameters_to_ndarrays(params)),
                                      server.state.x)
        chosen.append(p)
    assert server.done and strategy.configure_fit(2 * rounds + 1, None, manager) == []
    assert len(set(chosen)) > 1  # the local phase really moved between nodes
    rows = metrics_rows(server)
    assert [row.get("local_worker") for row in rows] == [None, *chosen]
    assert summary(server)["status"] == "completed"

    # the in-process driver makes the same calls: bit for bit the same rows, iterate and ε
    reference = run_inprocess(local_cfg, record=False, progress=None)
    np.testing.assert_array_equal(server.state.x, reference.state.x)
    assert strip_elapsed(rows) == strip_elapsed(reference.history)
    assert server.epsilon_spent == reference.epsilon_spent


def _chosen_reply(cfg, instructions, **change):
    """The chosen node's honest local reply, with ``change`` applied (arrays / n / metrics)."""
    (proxy, arrays, n, metrics), = node_replies(cfg, instructions)
    arrays = change.get("arrays", lambda a: a)([a.copy() for a in arrays])
    metrics = {**metrics, **change.get("metrics", {})}
    return proxy, arrays, change.get("n", n), metrics


def local_wrong_partition(cfg, instructions, proxies, gradient):
    proxy, arrays, n, metrics = _chosen_reply(cfg, instructions)
    other = (metrics[protocol.PARTITION_ID] + 1) % LOCAL_P
    return as_results([(proxy, arrays, n, {**metrics, protocol.PARTITION_ID: other})]), []


def local_wrong_node(cfg, instructions, proxies, gradient):
    proxy, arrays, n, metrics = _chosen_reply(cfg, instructions)
    stranger = next(p for cid, p in proxies.items() if cid != proxy.cid)
    return as_results([(stranger, arrays, n, metrics)]), []


def local_two_replies(cfg, instructions, proxies, gradient):
    reply = _chosen_reply(cfg, instructions)
    stranger = next(p for cid, p in proxies.items() if cid != reply[0].cid)
    return as_results([reply, (stranger, *reply[1:])]), []


def local_reshaped(cfg, instructions, proxies, gradient):
    return as_results([_chosen_reply(cfg, instructions, arrays=lambda a: [a[0].reshape(8, 10),
                                                                          *a[1:]])]), []


def local_too_few_arrays(cfg, instructions, proxies, gradient):
    return as_results([_chosen_reply(cfg, instructions, arrays=lambda a: a[:-1])]), []


def local_nan(cfg, instructions, proxies, gradient):
    return as_results([_chosen_reply(cfg, instructions, arrays=_nan)]), []


def local_float32(cfg, instructions, proxies, gradient):
    return as_results([_chosen_reply(cfg, instructions,
                                     arrays=lambda a: [x.astype(np.float32) for x in a])]), []


def local_wrong_round(cfg, instructions, proxies, gradient):
    r = instructions[0][1].config[protocol.ROUND]
    return as_results([_chosen_reply(cfg, instructions, metrics={protocol.ECHO_ROUND: r - 1})]), []


def local_gradient_reply(cfg, instructions, proxies, gradient):
    # the chosen node answers with its gradient-phase reply of the same round: same round, same
    # array count
    chosen = instructions[0][0]
    return as_results([next(reply for reply in gradient if reply[0] is chosen)]), []


def local_too_few_samples(cfg, instructions, proxies, gradient):
    return as_results([_chosen_reply(cfg, instructions, n=3)]), []


def local_failure_status(cfg, instructions, proxies, gradient):
    proxy, arrays, n, metrics = _chosen_reply(cfg, instructions)
    return [], [(proxy, fit_res(arrays, n, metrics, code=Code.FIT_NOT_IMPLEMENTED,
                                message="worker crashed"))]


def local_silent(cfg, instructions, proxies, gradient):
    return [], [ValueError("Expected one Message but got: 0")]


# (tamper, expected check, regex: names the node and what failed)
LOCAL_FAIL_CASES = {
    "wrong-partition": (local_wrong_partition, "local-worker",
                        r"check 'local-worker' failed from partition \d \(node {node}\): the "
                        r"local phase was sent to partition {partition}, the reply is from "
                        r"partition \d"),
    "wrong-node": (local_wrong_node, "local-worker",
                   r"check 'local-worker' failed: the local phase was sent to node {node} "
                   r"\(partition {partition}\) only; 1 replies came, from node\(s\) cid-20\d"),
    "two-replies": (local_two_replies, "local-worker",
                    r"sent to node {node} .* only; 2 replies came"),
    "reshaped": (local_reshaped, "shape",
                 r"check 'shape' failed from partition {partition} \(node {node}\): array "
                 r"'hidden.weight' must have shape \(10, 8\), found \(8, 10\)"),
    "too-few-arrays": (local_too_few_arrays, "arrays",
                       r"check 'arrays' failed from partition {partition} \(node {node}\): "
                       r"expected 4 arrays"),
    "nan": (local_nan, "finite",
            r"check 'finite' failed from partition {partition} \(node {node}\): y_K holds 1 NaN"),
    "float32": (local_float32, "dtype",
                r"check 'dtype' failed from partition {partition} \(node {node}\): array "
                r"'hidden.weight' must be float64, found float32"),
    "wrong-round": (local_wrong_round, "round",
                    r"check 'round' failed from node {node}: the reply is for round \d"),
    "gradient-reply": (local_gradient_reply, "phase",
                       r"check 'phase' failed from node {node}: metric 'diff2.kind' "
                       r"must be 'local' in a reply to the local phase"),
    "too-few-samples": (local_too_few_samples, "n_min",
                        r"check 'n_min' failed from partition {partition} \(node {node}\): the "
                        r"worker holds 3 samples"),
    "failure-status": (local_failure_status, "client-failure",
                       r"check 'client-failure' failed: the local phase on partition {partition} "
                       r"\(node {node}\) failed: 1 client\(s\) failed: node {node}: status "
                       r"FIT_NOT_IMPLEMENTED worker crashed\. The local phase is not retried"),
    "silent": (local_silent, "client-failure",
               r"check 'client-failure' failed: the local phase on partition {partition} \(node "
               r"{node}\) failed: 1 client\(s\) failed: no reply from node\(s\) {node} \(died or "
               r"timed out\).*not retried"),
}


@pytest.mark.parametrize("case", list(LOCAL_FAIL_CASES))
def test_a_bad_local_phase_stops_the_run_naming_the_node(local_cfg, tmp_path, case):
    """Round 2's local phase (after a whole round 1: Flower rounds 1-2) gets a bad reply; the local
    phase is the same on restart and difference rounds."""
    tamper, check, pattern = LOCAL_FAIL_CASES[case]
    bad_round = 2
    server = make_server(local_cfg, tmp_path)
    strategy = Diff2Strategy(server=server, round_retries=2)  # retries cover gradient phases only
    manager, proxies = local_manager()
    for f in range(1, 2 * bad_round - 1):
        instructions = strategy.configure_fit(f, None, manager)
        strategy.aggregate_fit(f, as_results(node_replies(local_cfg, instructions)), [])
    gradient_instructions = strategy.configure_fit(2 * bad_round - 1, None, manager)
    gradient = node_replies(local_cfg, gradient_instructions)
    strategy.aggregate_fit(2 * bad_round - 1, as_results(gradient), [])
    state, rows, epsilon = server.state, metrics_rows(server), server.epsilon_spent
    assert state.round == bad_round - 1 and len(rows) == bad_round

    instructions = strategy.configure_fit(2 * bad_round, None, manager)
    (proxy, fit_ins), = instructions
    partition = fit_ins.config[protocol.PARTITION_ID]
    results, failures = tamper(local_cfg, instructions, proxies, gradient)
    with pytest.raises(RoundRejected, match=pattern.format(node=proxy.cid,
                                                           partition=partition)) as info:
        strategy.aggregate_fit(2 * bad_round, results, failures)
    assert info.value.check == check and info.value.round == bad_round
    # x_r is not released, nor anything after it; ṽ_r went to the chosen node and stays charged
    assert server.state is state and metrics_rows(
        server) == rows and server.epsilon_spent == epsilon
    assert strategy.retries_left == 2  # a local phase is never retried
    s = summary(server)
    assert s["status"] == "failed" and s["error"] == f"RoundRejected: {info.value}"
    assert s["rounds_released"] == bad_round - 1
    with pytest.raises(RuntimeError, match="awaits its local phase"):
        server.plan()  # the server itself refuses to go on


def test_honest_local_replies_of_the_fail_closed_setup_are_accepted(local_cfg, tmp_path):
    """Control for the table above: the untampered local reply of the same round is released."""
    server = make_server(local_cfg, tmp_path)
    strategy = Diff2Strategy(server=server)
    manager, proxies = local_manager()
    gradient_phase(strategy, manager, local_cfg, 1)
    instructions = strategy.configure_fit(2, None, manager)
    results, failures = as_results([_chosen_reply(local_cfg, instructions)]), []
    strategy.aggregate_fit(2, results, failures)
    assert server.state.round == 1 and len(metrics_rows(server)) == 2


def test_a_failed_gradient_phase_is_retried_and_the_phases_stay_in_step(local_cfg, tmp_path):
    server = make_server(local_cfg, tmp_path)
    strategy = Diff2Strategy(server=server, round_retries=1)
    manager, _ = local_manager()
    assert strategy.num_rounds == 2 * 12 + 1
    instructions = strategy.configure_fit(1, None, manager)
    results = as_results(node_replies(local_cfg, instructions))[1:]
    assert strategy.aggregate_fit(1, results, [TimeoutError("node timed out")]) == (None, {})
    # nothing released, no local phase due
    assert server.state.round == 0 and server.pending is None
    # Flower round 2 retries round 1's gradient phase, round 3 is its local phase, round 4 round 2's
    # gradient phase
    gradient_phase(strategy, manager, local_cfg, 2)
    instructions = strategy.configure_fit(3, None, manager)
    assert len(instructions) == 1 and instructions[0][1].config[protocol.KIND] == protocol.LOCAL
    strategy.aggregate_fit(3, as_results(node_replies(local_cfg, instructions)), [])
    assert server.state.round == 1
    instructions = strategy.configure_fit(4, None, manager)
    assert len(instructions) == LOCAL_P and instructions[0][1].config[protocol.ROUND] == 2


def test_flower_rounds_out_of_step_with_the_phases_stop_the_run(local_cfg, tmp_path):
    server = make_server(local_cfg, tmp_path)
    strategy = Diff2Strategy(server=server)
    manager, _ = local_manager()
    with pytest.raises(RuntimeError,
                       match=r"Flower asked for round 2, the local phase of DIFF2 round 1, but no "
                             r"local phase of round 1 is due"):
        strategy.configure_fit(2, None, manager)
    assert summary(server)["status"] == "failed" and server.state.round == 0


def test_a_local_phase_that_runs_away_is_divergence_in_flower_too(local_cfg, tmp_path, monkeypatch):
    """The worker's Diverged (a local radius that is not finite) travels as the overflow flag:
    status diverged."""
    from diff2_flwr.core.estimator import Diverged

    server = make_server(local_cfg, tmp_path)
    strategy = Diff2Strategy(server=server)
    manager, _ = local_manager()
    gradient_phase(strategy, manager, local_cfg, 1)
    instructions = strategy.configure_fit(2, None, manager)

    def runs_away(worker, task):
        raise Diverged(task.round, "radius", "local step 1's radius inf is not finite")

    monkeypatch.setattr(Worker, "local_phase", runs_away)
    (proxy, arrays, n, metrics), = node_replies(local_cfg, instructions)
    assert metrics[protocol.OVERFLOW] == 1 and not any(np.any(a) for a in arrays)
    with pytest.raises(Diverged, match="overflow during its local steps"):
        strategy.aggregate_fit(2, as_results([(proxy, arrays, n, metrics)]), [])
    s = summary(server)
    assert s["status"] == "diverged" and s["diverged_at"] == 1 and server.state.round == 0


# ------------------------------------------------------------------------------ protocol of the
# local phase

def _local_task(layout, seed, partition_id=1, **mechanism):
    from diff2_flwr.core.local import LocalMechanism, LocalTask

    rng = np.random.default_rng(3)
    m = {"steps": 3, "batch_size": 32, "learning_rate": 0.1, "clip": 3.0, "sigma": 0.05} | mechanism
    return LocalTask(round=5, partition_id=partition_id, x_start=rng.standard_normal(layout.dim),
                     v=rng.standard_normal(layout.dim), mechanism=LocalMechanism(**m), seed=seed,
                     n_min=100, sampling_prob=m["batch_size"] / 100)


def _over_the_wire(fit_ins):
    """FitIns through Flower 1.42's own message path: RecordDict -> protobuf bytes -> RecordDict ->
    FitIns."""
    from flwr.common import serde
    from flwr.compat.common import recorddict_compat as compat
    from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict

    wire = serde.recorddict_to_proto(compat.fitins_to_recorddict(
        fit_ins, keep_input=True)).SerializeToString()
    proto = ProtoRecordDict()
    proto.ParseFromString(wire)
    return compat.recorddict_to_fitins(serde.recorddict_from_proto(proto), keep_input=True)


@pytest.mark.parametrize("seed", [None, 0, 12345, 2**63 - 1, 2**63, 2**64 - 1])
def test_local_task_round_trips_through_flowers_wire(layout, seed):
    from flwr.common import FitIns

    task = _local_task(layout, seed)
    arrays, config = protocol.encode_local_task(task, layout)
    if seed is not None:  # a uint64 goes as the int64 of the same bits: any sint64 field holds it
        assert -2**63 <= config[protocol.LOCAL_SEED] < 2**63
    received = _over_the_wire(FitIns(parameters=ndarrays_to_parameters(arrays), config=config))
    assert protocol.is_local(received.config)
    decoded = protocol.decode_local_task(parameters_to_ndarrays(received.parameters),
                                         dict(received.config), layout, partition_id=1,
                                         num_samples=400)
    assert decoded.seed == seed and decoded.round == 5 and decoded.partition_id == 1
    assert decoded.mechanism == task.mechanism
    np.testing.assert_array_equal(decoded.x_start, task.x_start)
    np.testing.assert_array_equal(decoded.v, task.v)


def test_local_reply_round_trips_through_flowers_wire(layout):
    from flwr.common import serde
    from flwr.compat.common import recorddict_compat as compat
    from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict

    task = _local_task(layout, 7)
    y = np.random.default_rng(4).standard_normal(layout.dim)
    reply = Reply("partition 1", 1, layout.split(y), num_samples=500, num_clipped=17)
    arrays, n, metrics = protocol.encode_local_reply(task, reply)
    assert set(metrics) == {protocol.PARTITION_ID, protocol.ECHO_ROUND, protocol.ECHO_KIND,
                            protocol.OVERFLOW}
    wire = serde.recorddict_to_proto(compat.fitres_to_recorddict(fit_res(arrays, n, metrics),
                                                                 keep_input=True))
    proto = ProtoRecordDict()
    proto.ParseFromString(wire.SerializeToString())
    res = compat.recorddict_to_fitres(serde.recorddict_from_proto(proto), keep_input=True)
    decoded = protocol.decode_local_reply("node 9", parameters_to_ndarrays(res.parameters),
                                          res.num_examples, res.metrics, 5)
    assert decoded.client == (
        "partition 1 (node 9)") and decoded.partition_id == 1 and decoded.num_samples == 500
    # nothing about the local steps but y_K leaves the worker
    assert decoded.num_clipped == 0 and not decoded.overflow
    np.testing.assert_array_equal(layout.flatten(decoded.arrays), y)


def _set(key, value):
    def change(arrays, config):
        config[key] = value
        return arrays, config
    return change


def _drop(key):
    def change(arrays, config):
        del config[key]
        return arrays, config
    return change


def _array(index, fn):
    def change(arrays, config):
        arrays = [a.copy() for a in arrays]
        arrays[index] = fn(arrays[index])
        return arrays, config
    return change


def _poison(value):
    def fn(a):
        a.flat[0] = value
        return a
    return fn


HOSTILE_LOCAL_TASKS = {
    "missing-steps": (_drop(protocol.LOCAL_STEPS), r"lacks config keys \['diff2.local-steps'\]"),
    "missing-partition": (_drop(protocol.PARTITION_ID),
                          r"lacks config keys \['diff2.partition-id'\]"),
    "unknown-key": (_set("diff2.local-momentum", 0.9),
                    r"unknown config keys \['diff2.local-momentum'\]"),
    "another-partition": (_set(protocol.PARTITION_ID, 2),
                          r"is for partition 2; this worker is partition 1"),
    "one-step": (_set(protocol.LOCAL_STEPS, 1),
                 r"'diff2.local-steps' \(K, the local steps\) must be an integer >= 2"),
    "steps-float": (_set(protocol.LOCAL_STEPS, 3.0),
                    r"'diff2.local-steps' .* must be an integer >= 2. Found 3.0"),
    "batch-zero": (_set(protocol.LOCAL_BATCH_SIZE, 0),
                   r"'diff2.local-batch-size' .* must be an integer >= 1"),
    "batch-over-n_p": (_set(protocol.LOCAL_BATCH_SIZE, 10**6),
                       r"\(b\) = 1000000 exceeds this worker's \d+ records"),
    "learning-rate-nan": (_set(protocol.LOCAL_LEARNING_RATE, math.nan),
                          r"'diff2.local-learning-rate' \(η\) must be "
                          r"a finite number > 0"),
    "clip-zero": (_set(protocol.LOCAL_CLIP, 0.0),
                  r"'diff2.local-clip' \(C3\) must be a finite number > 0"),
    "sigma-negative": (_set(protocol.LOCAL_SIGMA, -1.0),
                       r"'diff2.local-sigma' \(σ3\) must be a finite number >= 0"),
    "sigma-inf": (_set(protocol.LOCAL_SIGMA, math.inf),
                  r"'diff2.local-sigma' \(σ3\) must be a finite number >= 0"),
    "seed-string": (_set(protocol.LOCAL_SEED, "7"),
                    r"'diff2.local-seed' must be a 64-bit signed integer"),
    "seed-too-large": (_set(protocol.LOCAL_SEED, 2**64 - 1),
                       r"'diff2.local-seed' must be a 64-bit signed integer"),
    "round-zero": (_set(protocol.ROUND, 0), r"'diff2.round' \(round\) must be an integer >= 1"),
    "missing-n_min": (_drop(protocol.N_MIN), r"lacks config keys \['diff2.n-min'\]"),
    "missing-q": (_drop(protocol.LOCAL_SAMPLING_PROB),
                  r"lacks config keys \['diff2.local-sampling-prob'\]"),
    "q-not-b-over-n_min": (_set(protocol.LOCAL_SAMPLING_PROB, 0.1),
                           r"\(q\) must be b / n_min = 32 / 100. Found 0.1"),
    "n_min-above-n_p": (lambda arrays, config: (arrays, {**config, protocol.N_MIN: 10**6,
                                                         protocol.LOCAL_SAMPLING_PROB: 32 / 10**6}),
                        r"says n_min = 1000000, but this worker holds \d+ records: it would "
                        r"sample at b / n_p"),
    "x-nan": (_array(0, _poison(math.nan)), r"x_\(r-1\) holds 1 NaN or inf"),
    "v-inf": (_array(4, _poison(math.inf)), r"ṽ_r holds 1 NaN or inf"),
    "x-reshaped": (_array(0, lambda a: a.reshape(8, 10)),
                   r"x_\(r-1\) does not fit the model: Array 'hidden.weight' "
                   r"must have shape \(10, 8\)"),
    "v-float32": (_array(4, lambda a: a.astype(np.float32)),
                  r"ṽ_r array 'hidden.weight' must be float64"),
    "too-few-arrays": (lambda arrays, config: (arrays[:-1], config),
                       r"carries 8 arrays \(x_\(r-1\), then ṽ_r\). "
                       r"Found 7"),
}


@pytest.mark.parametrize("case", list(HOSTILE_LOCAL_TASKS))
def test_the_worker_refuses_a_hostile_local_task_before_touching_its_data(cfg, layout, monkeypatch,
                                                                          case):
    change, pattern = HOSTILE_LOCAL_TASKS[case]
    worker = build_worker(cfg, 1)
    calls = []
    monkeypatch.setattr(Worker, "local_phase", lambda worker, task: calls.append(task))
    arrays, config = protocol.encode_local_task(_local_task(layout, 2**63 + 5), layout)
    arrays, config = change(arrays, dict(config))
    with pytest.raises(ValueError, match=pattern):
        Diff2Client(worker).fit(arrays, config)
    assert calls == []


def test_the_worker_runs_a_well_formed_local_task(cfg, layout):
    """Control for the table above: the same task, untampered, is computed and answered as y_K."""
    worker = build_worker(cfg, 1)
    task = _local_task(layout, 2**63 + 5)
    arrays, config = protocol.encode_local_task(task, layout)
    reply_arrays, n, metrics = Diff2Client(worker).fit(arrays, dict(config))
    assert n == worker.num_samples and metrics[protocol.ECHO_KIND] == protocol.LOCAL and metrics[
        protocol.OVERFLOW] == 0
    expected = layout.flatten(worker.local_phase(task).arrays)  # seeded: the same y_K again
    np.testing.assert_array_equal(layout.flatten(reply_arrays), expected)
    assert not np.array_equal(expected, task.x_start)
