"""Client sampling through the Flower Strategy (issue 44): the strategy learns once which node holds
which partition (get_properties, answered by the real client from its node config), asks only the
round's cohort, releases an empty round without Flower, and equals the in-process driver bit for
bit; a federation whose nodes do not hold 0..P-1 once each stops the run."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.server.client_manager import SimpleClientManager

from diff2_flwr.core.aggregation import RoundRejected
from diff2_flwr.fl import protocol
from diff2_flwr.fl.client import Diff2Client
from diff2_flwr.fl.strategy import Diff2Strategy
from diff2_flwr.runtime.config import parse_config
from diff2_flwr.runtime.driver import run_inprocess
from diff2_flwr.runtime.session import build_server
from test_strategy import FakeProxy, as_results, cid_of, client_replies, partition_of

P, ROUNDS = 4, 12


def _cfg(sampling):
    return parse_config({
        "name": "sampled-strategy", "method": "diff2",
        "dataset": {"name": "synthetic", "num_samples": 400},
        "training": {"rounds": ROUNDS, "restart_every": 3, "clients": P, "seed": 5,
                     "sampling": sampling}})


class PartitionProxy(FakeProxy):
    """A proxy whose node answers get_properties as the real client does (from its partition)."""

    def __init__(self, cid, partition, cfg):
        super().__init__(cid)
        self.client = Diff2Client(lambda: pytest.fail("the query built the worker"),
                                  partition_id=partition)
        self.asked = 0

    def get_properties(self, ins, timeout, group_id):
        from flwr.common import Code, GetPropertiesRes, Status

        self.asked += 1
        return GetPropertiesRes(status=Status(code=Code.OK, message=""),
                                properties=self.client.get_properties(dict(ins.config)))


def _manager(cfg, partitions=None):
    manager, proxies = SimpleClientManager(), {}
    for p in range(P):
        proxy = PartitionProxy(cid_of(p), p if partitions is None else partitions[p], cfg)
        manager.register(proxy)
        proxies[proxy.cid] = proxy
    return manager, proxies


@pytest.mark.parametrize("sampling", [{"kind": "poisson", "rate": 0.5},
                                      {"kind": "fixed", "size": 2}])
def test_the_strategy_asks_only_the_cohort_and_equals_the_driver(sampling, tmp_path):
    cfg = _cfg(sampling)
    server = build_server(cfg, output_root=tmp_path, progress=None)
    strategy = Diff2Strategy(server=server)
    manager, proxies = _manager(cfg)
    empty = 0
    for r in range(1, ROUNDS + 1):
        cohort = server.cohort()
        instructions = strategy.configure_fit(r, strategy.initialize_parameters(manager), manager)
        assert sorted(partition_of(p.cid) for p, _ in instructions) == cohort
        if not cohort:  # released without Flower
            empty += 1
            assert instructions == [] and server.state.round == r
            continue
        strategy.aggregate_fit(r, as_results(client_replies(cfg, instructions)), [])
        assert server.state.round == r
    assert server.done and all(p.asked == 1 for p in proxies.values())  # asked once, kept
    direct = run_inprocess(cfg, record=False, progress=None)
    np.testing.assert_array_equal(server.state.x, direct.state.x)
    assert [h.get("cohort") for h in server.history[1:]] == [h["cohort"] for h in
                                                            direct.history[1:]]


def test_an_empty_cohort_is_released_without_flower(tmp_path):
    """q small: some rounds draw nobody; configure_fit releases them itself (noise alone)."""
    cfg = _cfg({"kind": "poisson", "rate": 0.05})
    server = build_server(cfg, output_root=tmp_path, progress=None)
    strategy = Diff2Strategy(server=server)
    manager, _ = _manager(cfg)
    assert server.cohort() == []  # this seed's first cohort is empty (checked here)
    assert strategy.configure_fit(1, strategy.initialize_parameters(manager), manager) == []
    assert server.state.round == 1 and server.history[1]["cohort"] == []


@pytest.mark.parametrize("partitions, found", [([0, 1, 1, 3], r"\[0, 1, 1, 3\]"),
                                               ([0, 1, 2, 7], r"\[0, 1, 2, 7\]")])
def test_nodes_that_do_not_hold_each_partition_once_stop_the_run(partitions, found, tmp_path):
    cfg = _cfg({"kind": "fixed", "size": 2})
    server = build_server(cfg, output_root=tmp_path, progress=None)
    strategy = Diff2Strategy(server=server)
    manager, _ = _manager(cfg, partitions)
    with pytest.raises(RoundRejected, match=f"check 'partitions' failed.*hold partitions {found}"):
        strategy.configure_fit(1, strategy.initialize_parameters(manager), manager)
    assert server.summary()["status"] == "failed" and server.state.round == 0


def test_a_client_tells_its_partition_and_nothing_else():
    client = Diff2Client(lambda: pytest.fail("built the worker"), partition_id=3)
    assert client.get_properties(protocol.PARTITION_QUERY) == {protocol.PARTITION_KEY: 3}
    assert client.get_properties({"anything": "else"}) == {}
