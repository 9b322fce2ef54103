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

from diff2_flwr.core.aggregation import NORM_RTOL, Reply, RoundRejected, average_contributions
from diff2_flwr.core.estimator import RoundPlan
from diff2_flwr.core.layout import ParameterLayout
from diff2_flwr.fl import protocol
from diff2_flwr.fl.client import Diff2Client
from diff2_flwr.fl.strategy import Diff2Strategy
from diff2_flwr.runtime.config import parse_config
from diff2_flwr.runtime.session import Diff2Server, build_server, build_worker

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
    # Node ids deliberately differ from partition ids, so messages naming one are not mistaken for the other.
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
    """Run the real Diff2Client of each proxy's partition on its FitIns (the proxy's partition from its cid)."""
    out = []
    for proxy, fit_ins in instructions:
        arrays = parameters_to_ndarrays(fit_ins.parameters)
        client = Diff2Client(build_worker(cfg, partition_of(proxy.cid)))
        reply_arrays, n, metrics = client.fit(arrays, dict(fit_ins.config))
        out.append((proxy, reply_arrays, n, metrics))
    return out


def fit_res(arrays, n, metrics, code: Code = Code.OK, message: str = "") -> FitRes:
    return FitRes(status=Status(code=code, message=message), parameters=ndarrays_to_parameters(arrays),
                  num_examples=n, metrics=metrics)


def as_results(replies) -> list[tuple[ClientProxy, FitRes]]:
    return [(proxy, fit_res(arrays, n, metrics)) for proxy, arrays, n, metrics in replies]


def one_round(strategy: Diff2Strategy, manager, cfg, server_round: int):
    """configure_fit -> real clients -> aggregate_fit for one honest round."""
    instructions = strategy.configure_fit(server_round, strategy.initialize_parameters(manager), manager)
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
    assert all("test_loss" in row and "train_loss" in row for row in rows)  # evaluation on, every round
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
    by_partition = {partition_of(proxy.cid): (arrays, n, metrics) for proxy, arrays, n, metrics in replies}
    arrays, n, metrics = by_partition[1]
    tampered = [(proxies[cid_of(0)], *by_partition[0]), (proxies[cid_of(1)], arrays, n, metrics),
                (proxies[cid_of(2)], [a.copy() for a in arrays], n, dict(metrics))]
    return as_results(tampered), []


def case_float32(replies, plan, proxies):
    return as_results(_tamper_array(replies, 1, lambda a: [x.astype(np.float32) for x in a])), []


def case_failure_status(replies, plan, proxies):
    ok = [r for r in replies if partition_of(r[0].cid) != 2]
    bad = next(r for r in replies if partition_of(r[0].cid) == 2)
    failed = fit_res(bad[1], bad[2], bad[3], code=Code.FIT_NOT_IMPLEMENTED, message="worker crashed")
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


# (tamper, expected check, regex the message must match): the regex names the client/partition and check.
FAIL_CASES = {
    "a-missing-client": (case_missing, "all-clients",
                         r"Round \d released nothing: check 'all-clients' failed: .*2 answered; missing partitions \[2\]"),
    "b-reshaped": (case_reshaped, "shape",
                   r"check 'shape' failed from partition 1 \(node cid-101\): array 'hidden.weight' must have "
                   r"shape \(10, 8\), found \(8, 10\)"),
    "b-truncated": (case_truncated, "shape",
                    r"check 'shape' failed from partition 1 \(node cid-101\): array 'hidden.bias' must have "
                    r"shape \(10,\), found \(9,\)"),
    "c-too-few-arrays": (case_too_few_arrays, "arrays",
                         r"check 'arrays' failed from partition 1 \(node cid-101\): expected 4 arrays .*found 3"),
    "c-too-many-arrays": (case_too_many_arrays, "arrays",
                          r"check 'arrays' failed from partition 1 \(node cid-101\): expected 4 arrays .*found 5"),
    "d-nan": (case_nan, "finite",
              r"check 'finite' failed from partition 1 \(node cid-101\): the contribution holds 1 NaN"),
    "e-unclipped": (case_unclipped, "norm",
                    r"check 'norm' failed from partition 1 \(node cid-101\): the contribution's norm .* exceeds "
                    r"the clipping radius"),
    "f-duplicate": (case_duplicate, "duplicate",
                    r"check 'duplicate' failed: partition 1 answered twice \(partition 1 \(node cid-101\) and "
                    r"partition 1 \(node cid-102\)\)"),
    "g-float32": (case_float32, "dtype",
                  r"check 'dtype' failed from partition 1 \(node cid-101\): array 'hidden.weight' must be float64, "
                  r"found float32"),
    "h-failure-status": (case_failure_status, "client-failure",
                         r"check 'client-failure' failed: 1 client\(s\) failed: node cid-102: status "
                         r"FIT_NOT_IMPLEMENTED worker crashed"),
    "h-failure-exception": (case_failure_exception, "client-failure",
                            r"check 'client-failure' failed: 1 client\(s\) failed: TimeoutError: node cid-102"),
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

    instructions = strategy.configure_fit(bad_round, strategy.initialize_parameters(manager), manager)
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
    with pytest.raises(RuntimeError, match="Flower asked for round 2 but the DIFF2 server is at round 1"):
        strategy.configure_fit(2, strategy.initialize_parameters(manager), manager)
    assert summary(server)["status"] == "failed"
    assert server.state.round == 0


# ------------------------------------------------------------------------------ float rounding at the radius

def _rounding_plan(radius: float, dim: int) -> tuple[RoundPlan, ParameterLayout]:
    layout = ParameterLayout(names=("w", "b"), shapes=((dim - 1,), (1,)))
    plan = RoundPlan(round=1, restart=True, radius=radius, noise_std=0.0, x_current=np.zeros(dim), x_previous=None)
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
    # projected back: the 1e-12 excess is gone (up to a few float64 ulps) and the direction is kept
    assert norm < radius * (1 + 1e-14)
    assert norm == pytest.approx(radius, rel=1e-14)
    np.testing.assert_allclose(agg.mean, v * (radius / np.linalg.norm(v)), rtol=1e-14, atol=0)
    assert agg.clip_fraction == 1.0

    # and with P = 3 honest peers the mean's norm stays within the bound of the sum of radii / P
    others = [Reply(f"partition {p}", p, layout.split(_vector_with_norm(rng, 101, radius / 2)), 10, 0) for p in (1, 2)]
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
    assert worst <= 0.0, f"a projected contribution's norm exceeds its radius by a relative {worst:.3g}"


# ------------------------------------------------------------------------------ client count

def test_configure_fit_with_too_few_clients_names_num_supernodes(cfg, tmp_path):
    server = make_server(cfg, tmp_path)
    strategy = Diff2Strategy(server=server, wait_for_clients_s=1)
    manager, _ = make_manager(P - 1)
    with pytest.raises(RoundRejected, match=r"training.clients = 3 but 2 clients are connected.*num-supernodes=3"):
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
    """A proxy of a simulation's virtual SuperNode: it talks to Flower's in-memory grid (as GridClientProxy does)."""

    def __init__(self, cid: str) -> None:
        super().__init__(cid)
        from flwr.superlink.grid.inmemory_grid import InMemoryGrid

        self.grid = object.__new__(InMemoryGrid)  # only its type is read


def test_a_simulation_with_the_wrong_number_of_supernodes_fails_at_once_naming_the_command(cfg, tmp_path):
    server = make_server(cfg, tmp_path)
    strategy = Diff2Strategy(server=server, wait_for_clients_s=120)
    manager = SimpleClientManager()
    for p in range(2):  # `flwr run .` simulates 2 SuperNodes by default
        assert manager.register(SimulatedProxy(cid_of(p)))
    started = time.monotonic()
    with pytest.raises(RoundRejected, match=r"training.clients = 3 but this simulation has 2 SuperNodes") as err:
        strategy.configure_fit(1, strategy.initialize_parameters(manager), manager)
    assert time.monotonic() - started < 10  # not the 120 s a deployment may wait for slow SuperNodes
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
    late = threading.Timer(3.0, lambda: manager.register(FakeProxy(cid_of(P - 1))))  # longer than the settle time
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


# ------------------------------------------------------------------------------ protocol.decode_task

@pytest.fixture(scope="module")
def layout(cfg):
    return build_worker(cfg, 0).gradients.layout


def _task(layout, kind, k_factor=None):
    arrays = layout.split(np.arange(layout.dim, dtype=np.float64))
    k_factor = k_factor if k_factor is not None else (1 if kind == "restart" else 2)
    return arrays * k_factor, {protocol.ROUND: 2, protocol.KIND: kind, protocol.RADIUS: 0.5}


def test_decode_task_accepts_well_formed_messages(layout):
    arrays, config = _task(layout, "difference")
    task = protocol.decode_task(arrays, config, layout)
    assert task.round == 2 and task.radius == 0.5
    np.testing.assert_array_equal(task.x_current, np.arange(layout.dim))
    np.testing.assert_array_equal(task.x_previous, np.arange(layout.dim))
    arrays, config = _task(layout, "restart")
    task = protocol.decode_task(arrays, config, layout)
    assert task.x_previous is None


@pytest.mark.parametrize("key", [protocol.ROUND, protocol.KIND, protocol.RADIUS])
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
    with pytest.raises(ValueError, match=rf"A {kind} round carries {expected} arrays. Found {count}"):
        protocol.decode_task(arrays[:count], config, layout)


@pytest.mark.parametrize("kind, radius, pattern", [
    ("warmup", 0.5, "must be one of"), ("restart", -1.0, "must be >= 0"), ("restart", math.nan, "must be >= 0"),
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
    with pytest.raises(RoundRejected, match=rf"check 'protocol' failed from node {proxy.cid}: cannot decode"):
        strategy.aggregate_fit(1, results, [])
    assert server.state.round == 0 and len(metrics_rows(server)) == 1
    assert summary(server)["status"] == "failed"


# ------------------------------------------------------------------------------ dead nodes and retries

def test_a_silent_node_is_named_and_nothing_is_released(cfg, tmp_path):
    server = make_server(cfg, tmp_path)
    strategy = Diff2Strategy(server=server)
    manager, proxies = make_manager()
    instructions = strategy.configure_fit(1, strategy.initialize_parameters(manager), manager)
    results = as_results(client_replies(cfg, instructions))
    dead = results.pop(1)[0].cid  # its reply never came: Flower reports a bare exception
    with pytest.raises(RoundRejected, match=rf"no reply from node\(s\) {dead} \(died or timed out\)"):
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
    assert params is None and server.state.round == 1 and len(metrics_rows(server)) == 2  # nothing released
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
