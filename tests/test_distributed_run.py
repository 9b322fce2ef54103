"""``privacy.noise: distributed`` through the server, the strategy and the client glue, in process
(no `flwr run`): the ledger, fail-closed rounds, the client's refusals, the config's refusals,
checkpoints.

The Flower runs are in tests/test_distributed_flower.py; the mechanism's privacy in
test_distributed.py and test_skellam.py; SecAgg+ itself in test_secagg.py."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays

from diff2_flwr.core.aggregation import RoundRejected
from diff2_flwr.core.distributed import SkellamLedger, schedule_epsilon
from diff2_flwr.core.skellam import modular_sum
from diff2_flwr.fl import protocol
from diff2_flwr.fl.secagg import check_setup, secagg_settings, secure_sum_mod, to_secagg
from diff2_flwr.fl.strategy import Diff2Strategy
from diff2_flwr.runtime.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from diff2_flwr.runtime.config import ConfigError, parse_config
from diff2_flwr.runtime.driver import run_inprocess, secure_sum
from diff2_flwr.runtime.session import build_server, build_worker

CONFIG = {
    "name": "distributed", "method": "diff2",
    "dataset": {"name": "synthetic", "num_samples": 1500},
    "privacy": {"epsilon": 3.0, "delta": 1e-5, "noise": "distributed"},
    "training": {"rounds": 6, "restart_every": 3, "clip_restart": 1.0, "clip_diff": 3.0,
                 "learning_rate": 0.2,
                 "clients": 3, "seed": 5},
}


def config(**privacy):
    data = {**CONFIG, "privacy": {**CONFIG["privacy"], **privacy}}
    return parse_config(data)


def test_an_inprocess_run_releases_every_round_and_its_ledger_is_the_schedules():
    cfg = config()
    server = run_inprocess(cfg, record=False, progress=None)
    noise = server.distributed
    rows = server.history[1:]
    assert [r["kind"] for r in rows] == ["restart", "difference", "difference"] * 2
    assert all(r["survivors"] == 3 and r["noise_std"] > 0 for r in rows)
    assert isinstance(server.ledger, SkellamLedger) and len(server.ledger.events) == 6
    expected = schedule_epsilon(noise.calibration.events(), 1e-5)
    assert server.epsilon_spent == pytest.approx(expected,
                                                 rel=1e-12) and expected == pytest.approx(3.0,
                                                                                          rel=1e-9)
    spent = [r["epsilon_spent"] for r in rows]
    assert spent == sorted(spent) and spent[0] == pytest.approx(schedule_epsilon([noise.event(
        True)], 1e-5))
    summary = server.summary()["privacy"]
    assert summary["noise"] == "distributed" and summary["calibration"]["tolerated"] == 0
    assert server.history[-1]["train_loss"] < server.history[0]["train_loss"]
    # the server added no noise of its own: its mechanism has σ = 0, the clients' shares are all
    # there is
    assert server.mechanism.sigma_restart == server.mechanism.sigma_diff == 0.0
    # the same seed reproduces the clients' shares, hence the run
    again = run_inprocess(cfg, record=False, progress=None)
    np.testing.assert_array_equal(again.state.x, server.state.x)


def test_the_noise_std_is_the_honest_clients_shares_over_the_scale_and_t_costs_noise():
    """Each client adds (zΔ₂)²/(P - t): with t = 1 of P = 3 the P survivors add 3/2 of what carries
    the guarantee."""
    cfg0, cfg1 = config(), config(tolerated=1)
    s0, s1 = (build_server(c, record=False, progress=None) for c in (cfg0, cfg1))
    n0, n1 = s0.distributed, s1.distributed
    assert n1.calibration == n0.calibration and n1.threshold == 2 and n0.threshold == 3
    code = n0.code(1, True, 1.0)
    z, rho = n0.calibration.z1, n0.calibration.rho
    # rounding's 2ρ is in the sensitivity, hence in the noise
    delta2 = code.scale * 2 * 1.0 / s0.n_min + 2 * rho
    assert n0.total_variance(code, True, 1.0) == pytest.approx((z * delta2) ** 2, rel=1e-12)
    assert n0.noise_std(1, True, 1.0, 3) == pytest.approx(z * delta2 / code.scale / 3, rel=1e-12)
    assert n1.noise_std(1, True, 1.0,
                        3) == pytest.approx(math.sqrt(3 / 2) * n0.noise_std(1, True, 1.0, 3),
                                            rel=1e-12)


def test_fewer_survivors_than_p_minus_t_release_nothing():
    cfg = config(tolerated=1)
    server = build_server(cfg, record=False, progress=None)
    workers = [build_worker(cfg, p) for p in range(3)]
    plan = server.plan()
    # one survivor; P - t = 2 needed
    total = secure_sum(server, plan, workers[:1], cfg.training.seed)
    with pytest.raises(RoundRejected, match=r"check 'survivors'.*1 of P = 3.*P - t = 2"):
        server.release_sum(total, 1)
    assert server.state.round == 0 and server.ledger.events == () and server.core.status == "failed"
    # two survivors are enough: the round is released, over their mean
    server = build_server(cfg, record=False, progress=None)
    released = server.release_sum(secure_sum(server, server.plan(), workers[:2], cfg.training.seed),
                                  2)
    assert released.plan.round == 1 and server.history[-1]["survivors"] == 2


class _Proxy:
    def __init__(self, cid: str) -> None:
        self.cid = cid


class _Manager:
    def __init__(self, n: int) -> None:
        self.proxies = {str(100 + p): _Proxy(str(100 + p)) for p in range(n)}

    def wait_for(self, num_clients: int, timeout: float) -> bool:
        return True

    def all(self):
        return self.proxies


def _secure_results(strategy: Diff2Strategy, cfg, survivors: int, *, echo_round: int | None = None,
                    partitions=None):
    """What SecAggPlusWorkflow hands ``aggregate_fit``: one (proxy, FitRes) per survivor, each
    carrying the mean of the survivors' centred messages and its own metrics."""
    server = strategy.server
    plan = server.plan()
    noise = server.distributed
    workers = [build_worker(cfg, p) for p in range(cfg.clients)]
    messages = [w.message(noise, plan.round, plan.radius, plan.x_current, plan.x_previous,
                          1) for w in workers]
    mean = np.mean([to_secagg(m, noise.bits) for m in messages[:survivors]], axis=0)
    partitions = partitions or list(range(survivors))
    return [(_Proxy(str(100 + p)), FitRes(Status(Code.OK, ""), ndarrays_to_parameters([mean]), 1,
                                          {protocol.PARTITION_ID: p,
                                           protocol.ECHO_ROUND: echo_round or plan.round}))
            for p in partitions], modular_sum(messages[:survivors], noise.bits)


def test_the_strategy_decodes_what_secagg_hands_over_and_refuses_a_malformed_sum():
    cfg = config()
    strategy = Diff2Strategy(server=build_server(cfg, record=False, progress=None))
    strategy.configure_fit(1, None, _Manager(3))
    results, total = _secure_results(strategy, cfg, 3)
    named = [(p.cid, parameters_to_ndarrays(r.parameters), r.metrics) for p, r in results]
    decoded, k = protocol.decode_secure_sum(named, 1, 3, 20)
    np.testing.assert_array_equal(decoded, total)  # the modular sum, exactly
    assert k == 3
    strategy.aggregate_fit(1, results, [])
    assert strategy.server.state.round == 1

    for bad, match in ((dict(echo_round=7), "check 'round'"), (dict(partitions=[0, 0, 1]),
                                                               "answered twice")):
        s = Diff2Strategy(server=build_server(cfg, record=False, progress=None))
        s.configure_fit(1, None, _Manager(3))
        res, _ = _secure_results(s, cfg, 3, **bad)
        with pytest.raises(RoundRejected, match=match):
            s.aggregate_fit(1, res, [])
        assert s.server.state.round == 0 and s.server.core.status == "failed"
    # a mean over 2 messages announced by 3 survivors is not the sum of 3: nothing is decoded from
    # it
    s = Diff2Strategy(server=build_server(cfg, record=False, progress=None))
    s.configure_fit(1, None, _Manager(3))
    res, _ = _secure_results(s, cfg, 2)
    res.append((_Proxy("102"), FitRes(Status(Code.OK, ""), res[0][1].parameters, 1,
                                      {protocol.PARTITION_ID: 2, protocol.ECHO_ROUND: 1})))
    with pytest.raises(RoundRejected, match="secure-sum"):
        s.aggregate_fit(1, res, [])


@pytest.mark.parametrize("retries", [0, 1])
def test_a_round_whose_secure_aggregation_halted_releases_nothing(retries):
    cfg = config()
    strategy = Diff2Strategy(server=build_server(cfg, record=False, progress=None),
                             round_retries=retries)
    assert strategy.configure_fit(1, None, _Manager(3))
    if retries == 0:
        with pytest.raises(RoundRejected, match=r"check 'secure-aggregation'.*SecAgg\+ halted"):
            strategy.secure_round_ended(1)  # SecAgg+ never called aggregate_fit
        assert strategy.server.core.status == "failed" and strategy.server.state.round == 0
        return
    strategy.secure_round_ended(1)  # retried: the next Flower round is DIFF2 round 1 again
    assert strategy.retries_left == 0 and strategy.server.state.round == 0
    strategy.configure_fit(2, None, _Manager(3))
    results, _ = _secure_results(strategy, cfg, 3)
    strategy.aggregate_fit(2, results, [])
    strategy.secure_round_ended(2)  # released: nothing to say
    assert strategy.server.state.round == 1 and strategy.server.core.status == "running"


class _Message:
    """A Flower ``Message`` as the mod reads it: a type and config records."""

    def __init__(self, configs: dict | None, message_type: str = "train") -> None:
        self.metadata = type("Metadata", (), {"message_type": message_type})()
        records = {} if configs is None else {"secaggplus_configs": configs}
        self.content = type("Content", (), {"config_records": records})()


def test_a_distributed_node_answers_only_inside_secagg_and_checks_its_setup():
    called = []
    mod = secure_sum_mod(lambda ctxt: (3, 1, 20), round_key=protocol.ROUND)
    with pytest.raises(ValueError, match="only inside Flower's SecAgg\\+"):
        mod(_Message(None), None, lambda m, c: called.append(m))
    assert not called  # the worker never ran
    # central noise: untouched
    passthrough = secure_sum_mod(lambda ctxt: None, round_key=protocol.ROUND)
    passthrough(_Message(None), None, lambda m, c: called.append(m))
    assert len(called) == 1
    q = secagg_settings(20, 3)
    good = {"sample_num": 3, "share_num": 3, "threshold": 2, "clipping_range": q.clipping_range,
            "target_range": q.quantization_range, "mod_range": q.modulus_range, "max_weight": 1.0}
    check_setup(good, clients=3, tolerated=1, bits=20)
    with pytest.raises(ValueError, match="threshold is 1, below P - t = 2"):
        check_setup({**good, "threshold": 1}, clients=3, tolerated=1, bits=20)
    with pytest.raises(ValueError, match="`mod_range` is 1024"):
        check_setup({**good, "mod_range": 1024}, clients=3, tolerated=1, bits=20)
    with pytest.raises(ValueError, match="`sample_num` is 2"):
        check_setup({**good, "sample_num": 2}, clients=3, tolerated=1, bits=20)


@pytest.mark.parametrize("change, key", [
    ({"method": "gd", "training": {**CONFIG["training"], "restart_every": None}}, "privacy.noise"),
    ({"local": {"steps": 2, "batch_size": 10}}, "local.steps"),
    ({"privacy": {**CONFIG["privacy"], "tolerated": 2}}, "privacy.tolerated"),
    ({"privacy": {**CONFIG["privacy"], "bits": 32}}, "privacy.bits"),
    ({"evaluation": {"clip_stats": True}}, "evaluation.clip_stats"),
])
def test_the_config_refuses_what_distributed_noise_cannot_do(change, key):
    with pytest.raises(ConfigError) as err:
        parse_config({**CONFIG, **change})
    assert err.value.key == key


def test_too_few_bits_for_the_noise_are_refused_before_the_run():
    with pytest.raises(ConfigError, match="privacy.noise: distributed: `bits` = 4 cannot hold"):
        build_server(config(bits=4), record=False, progress=None)


def test_a_checkpoint_keeps_the_skellam_ledger(tmp_path: Path):
    cfg = config()
    server = run_inprocess(cfg, record=False, progress=None)
    path = tmp_path / "ckpt.npz"
    save_checkpoint(path, Checkpoint("f" * 64, server.state, server.ledger, None))
    loaded = load_checkpoint(path, "f" * 64,
                             routine=cfg.training.routine.build(cfg.training.learning_rate))
    assert loaded.ledger == server.ledger and loaded.ledger.epsilon == server.epsilon_spent
    assert dataclasses.astuple(loaded.ledger.events[1]) == dataclasses.astuple(server.ledger.events[
        1])


def test_a_data_owner_who_distrusts_the_server_refuses_central_noise_and_too_few_honest_clients():
    from diff2_flwr.runtime.policy import NodePolicy, Refused, check_run

    policy = NodePolicy(max_epsilon=5.0, max_delta=1e-4, noise=("distributed",), min_honest=3)
    central = parse_config({**CONFIG, "privacy": {"epsilon": 3.0, "delta": 1e-5}})
    with pytest.raises(Refused,
                       match="privacy.noise = 'central'.*does not trust the server") as err:
        check_run(policy, central, "node 7")
    assert err.value.rule == "noise"
    check_run(policy, config(), "node 7")  # P - t = 3 honest clients: admitted
    with pytest.raises(Refused, match=r"P - t = 3 - 1 = 2 honest clients") as err:
        check_run(policy, config(tolerated=1), "node 7")
    assert err.value.rule == "min_honest"
    from diff2_flwr.runtime.spec import Invalid

    with pytest.raises(Invalid, match="key `noise`"):
        NodePolicy(max_epsilon=5.0, max_delta=1e-4, noise=("server",))


def test_a_study_compares_central_and_distributed_noise_and_runs_the_distributed_arm_in_process(
    tmp_path):
    """A method's ``privacy:`` block reaches its runs; on the batch engine its runs are in-process
    units (the batch engine adds central Gaussian noise), which equal a single in-process run of the
    same config."""
    from diff2_flwr.lab.study.runner import run_study
    from diff2_flwr.lab.study.spec import parse_study

    grid = {"restart_every": [3], "learning_rate": [0.2], "clip_restart": [1.0], "clip_diff": [3.0]}
    data = {"name": "noise", "dataset": {"name": "synthetic", "num_samples": 1500}, "clients": 3,
            "rounds": 6,
            "epsilons": [3.0], "eval_every": 3, "seeds": {"tune": [7], "evaluate": [1]},
            "engine": "batch",
            "analysis": {"protocol": "paper"},
            "methods": [{"name": "central", "method": "diff2", "grid": grid},
                        {"name": "distributed", "method": "diff2", "grid": grid,
                         "privacy": {"noise": "distributed", "tolerated": 1}}]}
    study = parse_study(data, "noise.yaml")
    cfg = study.experiment(study.methods[1], study.methods[1].points()[0], 3.0, 1)
    assert cfg.privacy.distributed and cfg.privacy.tolerated == 1
    result = run_study(study, output_root=tmp_path, show_progress=False, make_plots=False)
    assert set(result["epsilons"]["3.0"]["methods"]) == {"central", "distributed"}
    runs = [json.loads(r.read_text()) for r in (tmp_path / "noise" / "runs").glob("*.json")]
    assert {(r["method"], r["engine"]) for r in runs} == {("central", "batch"), ("distributed",
                                                                                 "inprocess")}
    (run,) = [r for r in runs if r["method"] == "distributed" and r["run_id"].startswith("eval")]
    # the same config, seed and shares: the same run
    single = run_inprocess(cfg, record=False, progress=None)
    assert run["train_loss"] == [r["train_loss"] for r in single.history
                                 if r["round"] in run["rounds"]]


def test_the_python_api_with_distributed_noise_is_the_yaml_run_bit_for_bit():
    """make_strategy(noise="distributed") and make_client(distributed=...) through a secure sum as
    SecAgg+ hands it over (the mean of the survivors' centred messages) equal the in-process driver
    of the same config."""
    import diff2_flwr
    from diff2_flwr.runtime.loading import load_data
    from diff2_flwr.task.losses import half_squared_error
    from diff2_flwr.task.models import PaperMLP

    cfg = config(tolerated=1)
    reference = run_inprocess(cfg, record=False, progress=None)
    data = load_data(cfg)
    settings = dict(epsilon=3.0, delta=1e-5, rounds=6, restart_every=3, clients=3)
    strategy = diff2_flwr.make_strategy(**settings, n_min=data.n_min, clip_restart=1.0,
                                        clip_diff=3.0, learning_rate=0.2,
                                        model=PaperMLP(data.num_features, 10, 1,
                                                       init_seed=0).double(), noise="distributed",
                                                       tolerated=1, seed=5, progress=None)
    clients = [diff2_flwr.make_client(model=PaperMLP(data.num_features, 10, 1).double(),
                                      loss=half_squared_error, data=data.shard(p), partition_id=p,
                                      distributed={**settings, "tolerated": 1},
                                      seed=5) for p in range(3)]
    for r in range(1, 7):
        instructions = strategy.configure_fit(r, None, _Manager(3))
        replies = [clients[int(proxy.cid) - 100].fit(parameters_to_ndarrays(ins.parameters),
                                                     ins.config)
                   for proxy, ins in instructions]
        mean = np.mean([arrays[0] for arrays, _, _ in replies], axis=0)
        strategy.aggregate_fit(r, [(proxy, FitRes(Status(Code.OK, ""),
                                                  ndarrays_to_parameters([mean]), n, metrics))
                                   for (proxy, _), (_, n, metrics) in zip(instructions, replies)],
                                   [])
    np.testing.assert_array_equal(strategy.server.state.x, reference.state.x)
    assert strategy.server.epsilon_spent == reference.epsilon_spent
