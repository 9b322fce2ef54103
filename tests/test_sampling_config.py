"""``training.sampling`` (issue 44) through the front doors: the experiment file and ``--set`` build
and refuse it alike, its calibration is the core's, studies run it on the batched engine, and the
per-run server refuses it before round 1 (it does not sample clients yet)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from diff2_flwr.core.calibration import calibrate
from diff2_flwr.core.sampling import Sampling
from diff2_flwr.runtime.config import ConfigError, ExperimentConfig, apply_overrides, parse_config
from diff2_flwr.runtime.spec import run_identity

BASE = {"method": "diff2", "dataset": {"name": "synthetic", "num_samples": 600},
        "training": {"restart_every": 5, "rounds": 40, "clients": 6, "seed": 3}}


def _with(sampling):
    return {**BASE, "training": {**BASE["training"], "sampling": sampling}}


def test_the_file_and_set_build_the_same_sampling():
    from_file = parse_config(_with({"kind": "poisson", "rate": 0.5}))
    from_set = parse_config(apply_overrides(BASE, {"training.sampling.kind": "poisson",
                                                   "training.sampling.rate": 0.5}))
    assert from_file.training.sampling == from_set.training.sampling
    assert from_file.training.sampling.build() == Sampling("poisson", rate=0.5)
    assert parse_config(BASE).training.sampling.build() is None


@pytest.mark.parametrize("sampling, key, expected", [
    ({"kind": "poisson"}, "training.sampling.rate", "a number in (0, 1]"),
    ({"kind": "poisson", "rate": 1.5}, "training.sampling.rate", "a number in (0, 1]"),
    ({"kind": "fixed", "size": 7}, "training.sampling.size", "at most the P = 6 clients"),
    ({"kind": "fixed", "size": 2, "rate": 0.5}, "training.sampling.rate", "null with kind fixed"),
    ({"rate": 0.5}, "training.sampling.kind", "poisson (with rate) or fixed"),
])
def test_a_bad_sampling_is_refused_the_same_way_by_the_file_and_by_set(sampling, key, expected):
    with pytest.raises(ConfigError) as by_file:
        parse_config(_with(sampling))
    overrides = {f"training.sampling.{k}": v for k, v in sampling.items()}
    with pytest.raises(ConfigError) as by_set:
        parse_config(apply_overrides(BASE, overrides))
    for err in (by_file.value, by_set.value):
        assert f"key `{key}`" in str(err) and expected in str(err)
        assert len(str(err).splitlines()) == 1


@pytest.mark.parametrize("patch, key", [
    ({"local": {"steps": 3}}, "local.steps"),
    ({"privacy": {"noise": "distributed"}}, "privacy.noise"),
    ({"privacy": {"mode": "rdp"}}, "privacy.mode"),
])
def test_what_sampling_does_not_combine_with_is_named(patch, key):
    with pytest.raises(ConfigError, match=f"key `{key}`: expected .*training.sampling"):
        parse_config({**_with({"kind": "fixed", "size": 3}), **patch})


def test_the_config_calibrates_with_the_cores_sampled_calibration():
    cfg = parse_config(_with({"kind": "fixed", "size": 3}))
    cal = cfg.calibration(100)
    want = calibrate(epsilon=3.0, delta=1e-5, rounds=40, restart_every=5, u=1.25, n_min=100,
                     clients=6, sampling=Sampling("fixed", size=3))
    assert (cal.z1, cal.z2, cal.sigma1, cal.sigma2) == (want.z1, want.z2, want.sigma1, want.sigma2)
    assert cal.sampling_prob == 0.5
    mech = cfg.mechanism(cal)
    assert (mech.sigma_restart, mech.sigma_diff) == (cal.sigma1, cal.sigma2)
    # more noise per unit radius than full participation: the sum is divided by m, not P
    assert cal.sigma1 > parse_config(BASE).calibration(100).sigma1


def test_a_run_without_sampling_keeps_its_identity():
    """The key came later: at its default it is left out of a run's identity (checkpoints, shard
    files and run tables made before it still match); set, it is in."""
    plain = run_identity(ExperimentConfig, parse_config(BASE).to_dict())
    assert "sampling" not in plain["training"]
    sampled = run_identity(ExperimentConfig,
                           parse_config(_with({"kind": "poisson", "rate": 0.5})).to_dict())
    assert sampled["training"]["sampling"] == {"kind": "poisson", "rate": 0.5, "size": None}


@pytest.mark.parametrize("mode", ["refuse", "unamplified", "amplified"])
def test_a_node_with_a_lifetime_budget_takes_a_sampled_run_only_as_its_policy_says(tmp_path,
                                                                                  mode):
    """The data owner's side: a node keeping a lifetime budget refuses a sampled run at admission,
    before its ledger is written or any record used, unless its policy says how to charge it
    (``lifetime.sampled_runs``): ``unamplified``, its first task charges the run's rounds as full
    Gaussian rounds (as if the node were in every round); ``amplified``, its amplified rounds.
    Without the sampling the same node admits and charges the run either way."""
    from diff2_flwr.core.privacy import RunEvents
    from diff2_flwr.runtime.node_guard import NodeGuard
    from diff2_flwr.runtime.node_ledger import NodeLedger
    from diff2_flwr.runtime.policy import NodePolicy, Refused
    from diff2_flwr.runtime.spec import parse_section

    ledger = tmp_path / "ledger.json"
    policy = parse_section(NodePolicy, {"max_epsilon": 3.0, "max_delta": 1e-5,
                                        "allow_seeded": True,
                                        "answers": str(tmp_path / "answers.log"),
                                        "lifetime": {"epsilon": 100.0, "delta": 1e-3,
                                                     "ledger": str(ledger),
                                                     "sampled_runs": mode}},
                           "policy.yaml")

    def first_task(cfg, run_id):
        guard = NodeGuard.admit_run(cfg, node="node 1", partition_id=0, run_id=run_id,
                                    policy=policy, deployment=False)
        guard.check_task(1, 1.0, np.zeros(3), None, 100, 100)

    sampled = parse_config(_with({"kind": "poisson", "rate": 0.5}))
    if mode == "refuse":
        with pytest.raises(Refused, match=r"rule `lifetime.sampled_runs`: the run samples "
                                          r"clients \(training.sampling: poisson, rate q = 0.5\)"):
            first_task(sampled, 1)
        assert not ledger.exists()
    else:
        first_task(sampled, 1)
        (charge,) = NodeLedger(ledger).charges()
        planned = RunEvents.from_calibration(sampled.calibration(100))
        if mode == "amplified":
            assert charge.events == planned and charge.events.sampled
        else:
            assert charge.events == RunEvents(delta=planned.delta, gaussian=tuple(
                (z, count) for z, _, count in planned.sampled))
            assert charge.epsilon > planned.epsilon
    first_task(parse_config(BASE), 2)
    assert [c.run_id for c in NodeLedger(ledger).charges()] == (
        ["2"] if mode == "refuse" else ["1", "2"])


def test_the_in_process_engine_samples_as_the_batched_engine_does():
    """The per-run server (the code the Flower path runs) draws the same cohorts from the same noise
    key as the batched engine, asks only them, and divides by E|S|: the same trajectory (to the
    engines' usual 1e-12); its journal rows name each round's cohort, and its ledger ends at the
    calibration's planned ε."""
    from diff2_flwr.lab.sweep import RunSpec, run_batch
    from diff2_flwr.runtime.driver import run_inprocess
    from diff2_flwr.runtime.session import load_data

    for sampling in ({"kind": "poisson", "rate": 0.5}, {"kind": "fixed", "size": 2}):
        cfg = parse_config(_with(sampling))
        server = run_inprocess(cfg, record=False, progress=None)
        data = load_data(cfg)
        mech = cfg.mechanism(server.calibration)
        spec = RunSpec(5, 0.25, 1.0, 1.0, mech.sigma_restart, mech.sigma_diff, 3, 0,
                       sampling=cfg.training.sampling.build())
        batch = run_batch(data, [spec], rounds=40, eval_every=40)[0]
        assert np.abs(server.state.x - batch.final_x).max() <= 1e-12
        cohorts = [tuple(h["cohort"]) for h in server.history[1:]]
        assert len(cohorts) == 40 and len(set(cohorts)) > 3  # drawn anew each round
        if sampling["kind"] == "fixed":
            assert {len(c) for c in cohorts} == {2}
        assert server.epsilon_spent == pytest.approx(server.calibration.planned_epsilon,
                                                     rel=1e-9)
        assert server.epsilon_spent <= 3.0


def _study(tmp_path, engine="batch"):
    from diff2_flwr.lab.study.runner import load_study

    path = tmp_path / "s.yaml"
    grid = {"learning_rate": [0.2], "clip_restart": [1.0]}
    path.write_text(json.dumps({
        "name": "sampled", "dataset": {"name": "synthetic", "num_samples": 600}, "clients": 6,
        "rounds": 20, "delta": 1e-5, "epsilons": [3.0], "seeds": {"tune": [7], "evaluate": [1]},
        "engine": engine, "analysis": {"protocol": "paper"},
        "methods": [{"name": "DP-GD", "method": "dpgd", "grid": grid},
                    {"name": "DP-GD q", "method": "dpgd", "training.sampling.kind": "poisson",
                     "training.sampling.rate": 0.5, "grid": grid}],
        "output": {"dir": str(tmp_path / "out")}}))
    return load_study(path)


def test_a_study_runs_sampled_methods_on_the_batched_engine(tmp_path):
    from diff2_flwr.lab.study.runner import run_study

    study = _study(tmp_path)
    run_study(study, output_root=str(tmp_path / "out"), fresh=True, make_plots=False)
    runs = [json.loads(p.read_text()) for p in (tmp_path / "out" / "sampled" / "runs").glob(
        "*.json")]
    by = {(r["method"], r["seed"]): r for r in runs}
    assert {r["engine"] for r in runs} == {"batch"}
    plain, sampled = by["DP-GD", 7], by["DP-GD q", 7]  # the tuning runs
    # same seed, same x_0 and round-0 loss; the sampled rounds (other cohorts, more noise) differ
    assert plain["train_loss"][0] == sampled["train_loss"][0]
    assert plain["train_loss"][1:] != sampled["train_loss"][1:]
    # the sampled run is run_batch's with the config's sampling and its seed as the cohort key
    from diff2_flwr.lab.sweep import RunSpec, run_batch
    from diff2_flwr.runtime.session import load_data

    method = next(m for m in study.methods if m.name == "DP-GD q")
    cfg = study.experiment(method, method.points()[0], 3.0, 7)
    data = load_data(cfg)
    mech = cfg.mechanism(cfg.calibration(data.n_min))
    spec = RunSpec(1, 0.2, 1.0, 1.0, mech.sigma_restart, mech.sigma_diff, 7, 7,
                   sampling=Sampling("poisson", rate=0.5))  # cohort key: cohort_key(7)
    direct = run_batch(data, [spec], rounds=20, eval_every=cfg.evaluation.every)[0]
    assert direct.train_loss.tolist() == sampled["train_loss"]


def test_only_the_cohort_answers_and_its_sum_is_divided_by_the_expected_cohort():
    """The server's average with a cohort: a reply from outside it, or a cohort member missing, is
    refused (nothing released); the mean is Σ over the cohort / E|S|; an empty cohort, zeros."""
    from diff2_flwr.core.aggregation import Reply, RoundRejected, average_contributions
    from diff2_flwr.core.estimator import RoundPlan
    from diff2_flwr.core.layout import ParameterLayout

    layout = ParameterLayout(("w",), ((3,),))
    plan = RoundPlan(round=4, restart=True, radius=10.0, noise_std=0.0, x_current=np.zeros(3),
                     x_previous=None)

    def reply(p, value):
        return Reply(f"partition {p}", p, layout.split(np.full(3, value)), 10, 0)

    kw = {"clients": 4, "n_min": 10, "cohort": [1, 3], "denominator": 2.5}
    agg = average_contributions(plan, layout, [reply(3, 2.0), reply(1, 1.0)], **kw)
    np.testing.assert_array_equal(agg.mean, np.full(3, 3.0 / 2.5))
    with pytest.raises(RoundRejected, match=r"check 'cohort' failed.*partition\(s\) \[0\] "
                                            r"answered but are not in round 4's cohort \[1, 3\]"):
        average_contributions(plan, layout, [reply(0, 1.0), reply(1, 1.0), reply(3, 1.0)], **kw)
    with pytest.raises(RoundRejected, match=r"check 'cohort' failed.*missing partitions \[3\]"):
        average_contributions(plan, layout, [reply(1, 1.0)], **kw)
    empty = average_contributions(plan, layout, [], **{**kw, "cohort": []})
    np.testing.assert_array_equal(empty.mean, np.zeros(3))
