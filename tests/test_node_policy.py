"""A data owner's node policy and the calibration its node recomputes, through the real ClientApp
(``clients.client_app.app`` called with Flower's own Message and Context): every refusal names the
node and the rule, and nothing is computed on the node's records (so nothing can be released)."""

from __future__ import annotations

import importlib
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from diff2_flwr.core.local import LocalMechanism, LocalTask, local_seed, run_local_phase
from diff2_flwr.fl import protocol
from diff2_flwr.runtime.config import load_config
from diff2_flwr.runtime.policy import PolicyError, load_policy
from diff2_flwr.runtime.session import Worker, build_server, build_worker

P = 2
BASE = {
    "name": "policy", "method": "diff2", "dataset": {"name": "synthetic", "num_samples": 600},
    "privacy": {"epsilon": 3.0, "delta": 1e-5},
    "training": {"rounds": 4, "restart_every": 2, "clients": P, "seed": 1, "clip_diff": 2.0},
    "evaluation": {"train_metrics": False},
}
# BASE is seeded (the tests replay the real server's tasks): the nodes' policies allow it
# (`allow_seeded`).
POLICY = {"name": "hospital-a", "max_epsilon": 3.0, "max_delta": 1e-5, "allow_seeded": True}

client_app = importlib.import_module("clients.client_app")
# in-process calls stand for simulated nodes
pytestmark = pytest.mark.usefixtures("simulated_nodes")


def write(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture
def experiment(tmp_path) -> Path:
    return write(tmp_path / "experiment.yaml", {**BASE, "output": {"dir": str(tmp_path / "out")}})


def policy_file(tmp_path: Path, **changes) -> Path:
    return write(tmp_path / f"policy-{len(list(tmp_path.glob('policy-*')))}.yaml", {**POLICY,
                                                                                    **changes})


def call_app(config: Path, arrays, conf, *, node_config: dict | None = None,
             run_config: dict | None = None, run_id: int = 7, partition: int = 0):
    """One train message through the real ClientApp, as Flower's runtime delivers it; returns the
    FitRes."""
    from flwr.app import RecordDict
    from flwr.app.message import Message
    from flwr.common import Context, FitIns, ndarrays_to_parameters
    from flwr.compat.common.recorddict_compat import fitins_to_recorddict, recorddict_to_fitres
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = run_id, 100 + partition, 1
    content = fitins_to_recorddict(FitIns(ndarrays_to_parameters(arrays), dict(conf)),
                                   keep_input=True)
    message = Message(content, dst_node_id=100 + partition, message_type="train")
    nodes = {"partition-id": partition, "num-partitions": P, **(node_config or {})}
    given = str(config)
    # a data owner's node: as a deployment sets it up
    if set(nodes) - {"partition-id", "num-partitions"}:
        nodes, given = deployment_node(config, nodes, partition)
    context = Context(run_id=run_id, node_id=100 + partition, node_config=nodes, state=RecordDict(),
                      run_config={"config": given, **(run_config or {})})
    reply = client_app.app(message, context)
    return recorddict_to_fitres(reply.content, keep_input=True)


def deployment_node(config: Path, nodes: dict, partition: int) -> tuple[dict, str]:
    """A data owner's node config for ``config`` (its folder as the node's ``experiments`` folder,
    its shard file written by `diff2 shard` as ``data-path`` unless the test names one) and the run
    config's relative ``config``."""
    from diff2_flwr.deploy.shards import write_shards
    from diff2_flwr.runtime.shard_files import shard_name

    config = Path(config)
    nodes = {"experiments": str(config.parent), **nodes}
    if "data-path" not in nodes:
        folder = config.parent / f"shards-{config.stem}"
        if not (folder / shard_name(partition, P)).exists():
            write_shards(load_config(config), folder)
        nodes["data-path"] = str(folder / shard_name(partition, P))
    return nodes, config.name


def task_of_round(config: Path, r: int, overrides: dict | None = None):
    """The real server's task for round r (earlier rounds released with the real workers'
    replies)."""
    cfg = load_config(config, overrides)
    server = build_server(cfg, record=False, progress=None)
    while server.plan().round < r:
        plan = server.plan()
        server.release([build_worker(cfg, p).reply(plan) for p in range(P)])
    return server, protocol.encode_task(server.plan(), server.layout, server.n_min)


@pytest.fixture
def no_data(monkeypatch):
    """Fails the test if the ClientApp builds its worker (reads its shard, imports its model)."""
    def forbidden(*args, **kwargs):
        raise AssertionError("the ClientApp loaded its shard for a run its policy refuses")
    monkeypatch.setattr(client_app, "build_worker", forbidden)


@pytest.fixture
def computed(monkeypatch) -> list:
    """Records every clipped mean the worker computes."""
    calls: list = []
    real = Worker.contribute
    monkeypatch.setattr(Worker, "contribute", lambda self, *a: calls.append(a) or real(self, *a))
    return calls


# ------------------------------------------------------------------ the run against the policy

def test_a_run_within_the_policy_is_computed(experiment, tmp_path, computed):
    _, (arrays, conf) = task_of_round(experiment, 1)
    res = call_app(experiment, arrays, conf, node_config={"policy": str(policy_file(tmp_path))})
    assert res.metrics[protocol.ECHO_ROUND] == 1 and len(computed) == 1


REFUSED_RUNS = {
    "epsilon": ({}, {"privacy.epsilon": "8.0"},
                r"rule `max_epsilon`: the run asks ε = 8 \(privacy.epsilon\); this "
                r"node allows at most ε = 3 per run"),
    "delta": ({}, {"privacy.delta": "1.0e-3"}, r"rule `max_delta`: the run asks δ = 0.001"),
    "method": ({"methods": ["diff2"]}, {"method": "dpgd", "training.restart_every": "1"},
               r"rule `methods`: the run asks method 'dpgd'; this node allows \['diff2'\]"),
    "gd": ({}, {"method": "gd", "training.restart_every": "1"},
           r"rule `methods`: the run asks method 'gd'"),
    "rounds": ({"max_rounds": 3}, {},
               r"rule `max_rounds`: the run asks 4 rounds \(training.rounds\); this node "
               r"allows at most 3"),
    "model": ({}, {"model.name": "torch.hub:load",
                   "model.kwargs": "{repo_or_dir: /tmp/hub, model: evil, "
                                                                   "source: local}"},
              r"rule `models`: the run asks model 'torch.hub:load' \(model.name\)"),
    "local": ({"local_routine": False}, {"local.steps": "3"}, r"rule `local_routine`"),
}


@pytest.mark.parametrize("case", list(REFUSED_RUNS))
def test_a_run_outside_the_policy_is_refused_before_the_shard_is_read(experiment, tmp_path,
                                                                      monkeypatch, no_data, case):
    changes, run_config, pattern = REFUSED_RUNS[case]
    import torch.hub

    monkeypatch.setattr(torch.hub, "load", lambda *a,
                        **k: pytest.fail("torch.hub.load ran on a data owner's node"))
    _, (arrays, conf) = task_of_round(experiment, 1)
    policy = policy_file(tmp_path, **changes)
    with pytest.raises(Exception, match=r"node 100 \(hospital-a\) refused: " + pattern) as info:
        call_app(experiment, arrays, conf, node_config={"policy": str(policy)},
                 run_config=run_config)
    assert "Nothing was computed on this node's records; the round releases nothing." in str(
        info.value)


def test_the_simulation_policy_comes_from_the_environment_and_the_node_config_wins(
    experiment, tmp_path, monkeypatch,
                                                                                   no_data):
    _, (arrays, conf) = task_of_round(experiment, 1)
    monkeypatch.setenv("DIFF2_NODE_POLICY", str(policy_file(tmp_path, name="from-env",
                                                            max_epsilon=1.0)))
    with pytest.raises(Exception, match=r"\(from-env\) refused: rule `max_epsilon`"):
        call_app(experiment, arrays, conf)
    strict = policy_file(tmp_path, name="from-node-config", max_epsilon=0.5)
    with pytest.raises(Exception,
                       match=r"\(from-node-config\) refused: rule `max_epsilon`.*at most ε = 0.5"):
        call_app(experiment, arrays, conf, node_config={"policy": str(strict)})


def test_a_deployment_node_without_a_policy_runs_only_builtin_models_and_private_methods(
        experiment, tmp_path, monkeypatch, no_data):
    import torch.hub

    monkeypatch.setattr(torch.hub, "load", lambda *a,
                        **k: pytest.fail("torch.hub.load ran on a data owner's node"))
    _, (arrays, conf) = task_of_round(experiment, 1)
    deployment = {"data-path": str(tmp_path / "shard-0.npz")}  # never read: the refusal comes first
    hub = {"model.name": "torch.hub:load",
           "model.kwargs": "{repo_or_dir: /tmp/hub, model: evil, source: local}"}
    with pytest.raises(Exception,
                       match=r"node 100 \(partition 0\) refused: rule `models`.*no node policy: a "
                             r"data owner's node runs only the built-in models"):
        call_app(experiment, arrays, conf, node_config=deployment, run_config=hub)
    with pytest.raises(Exception, match=r"refused: rule `methods`: the run asks method 'gd'"):
        call_app(experiment, arrays, conf, node_config=deployment,
                 run_config={"method": "gd", "training.restart_every": "1"})


def _own_factory(tmp_path: Path, monkeypatch) -> dict:
    module = tmp_path / "owner_models.py"
    module.write_text("import torch\n\ndef make(*, in_features, out_features):\n    return "
                      "torch.nn.Sequential(torch.nn.Linear(in_features, 4), torch.nn.Tanh(),\n    "
                      "                           torch.nn.Linear(4, out_features))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return {"model.name": "owner_models:make"}


def test_a_factory_runs_only_where_the_policy_lists_it(experiment, tmp_path, monkeypatch, computed):
    own = _own_factory(tmp_path, monkeypatch)
    overrides = {k: yaml.safe_load(v) for k, v in own.items()}
    _, (arrays, conf) = task_of_round(experiment, 1, overrides)
    # A simulation on one's own machine without a policy: the user's config stands.
    assert call_app(experiment, arrays, conf, run_config=own).metrics[protocol.ECHO_ROUND] == 1
    with pytest.raises(Exception,
                       match=r"refused: rule `models`: the run asks model 'owner_models:make'"):
        call_app(experiment, arrays, conf, run_config=own,
                 node_config={"policy": str(policy_file(tmp_path))})
    listed = policy_file(tmp_path, models=["paper_mlp", "owner_models:make"])
    assert call_app(experiment, arrays, conf, run_config=own,
                    node_config={"policy": str(listed)}).metrics
    assert len(computed) == 2


# ------------------------------------------------------------------ each task against the
# recomputed calibration

def _set(key, value):
    return lambda arrays, conf: (arrays, {**conf, key: value})


def _scale_radius(factor):
    return lambda arrays, conf: (arrays, {**conf, protocol.RADIUS: conf[protocol.RADIUS] * factor})


REFUSED_TASKS = {
    "restart-radius-doubled": (1, _scale_radius(2.0),
                               r"rule `radius`: round 1's clipping radius is 2.0; the run "
                               r"config makes it 1.0 \(C1 = training.clip_restart = 1\)"),
    "restart-radius-inf": (1, _set(protocol.RADIUS, math.inf),
                           r"rule `radius`: round 1's clipping radius is inf"),
    "difference-radius-inflated": (2, _scale_radius(1 + 1e-6),
                                   r"rule `radius`: round 2's .* \(C2 \|\|x_\(r-1\) - "
                                   r"x_\(r-2\)\|\| of the iterates sent, C2 = training.clip_diff "
                                   r"= 2\)"),
    "difference-radius-inf": (2, _set(protocol.RADIUS, math.inf),
                              r"rule `radius`: round 2's clipping radius is inf"),
    "round-past-the-end": (1, _set(protocol.ROUND, 5),
                           r"rule `round`: the task is for round 5; the run has rounds "
                           r"1..4"),
    "restart-called-difference": (2, lambda arrays, conf: (arrays[: len(arrays) // 2],
                                                            {**conf, protocol.KIND: "restart"}),
                                  r"rule `round kind`: round 2 is a difference round \(T = 2\); "
                                  r"the task is a restart"),
    # the refusal says n_min exceeds the node's records, never how many it holds (240)
    "n_min-above-n_p": (1, _set(protocol.N_MIN, 10**6),
                        r"rule `n_min`: the task says n_min = 1000000, more records "
                        r"than this node holds: (?!.*240)"),
}


@pytest.mark.parametrize("case", list(REFUSED_TASKS))
def test_a_task_that_disagrees_with_the_calibration_is_refused(experiment, tmp_path, computed,
                                                               case):
    r, tamper, pattern = REFUSED_TASKS[case]
    _, (arrays, conf) = task_of_round(experiment, r)
    # control: untampered, computed
    assert call_app(experiment, arrays, conf).metrics[protocol.ECHO_ROUND] == r
    computed.clear()
    arrays, conf = tamper(arrays, conf)
    with pytest.raises(Exception, match=r"node 100 \(partition 0\) refused: " + pattern):
        # no policy needed: the run config's calibration is always checked
        call_app(experiment, arrays, conf)
    assert computed == []


def test_n_min_must_equal_the_run_configs_when_declared(tmp_path, computed):
    config = write(tmp_path / "declared.yaml", {**BASE, "privacy": {**BASE["privacy"],
                                                                    "n_min": 200},
                                                "output": {"dir": str(tmp_path / "out")}})
    _, (arrays, conf) = task_of_round(config, 1)
    assert conf[protocol.N_MIN] == 200 and call_app(config, arrays, conf).metrics
    with pytest.raises(Exception,
                       match=r"rule `n_min`: the task says n_min = 180; the run config says "
                                        r"privacy.n_min = 200"):
        call_app(config, arrays, {**conf, protocol.N_MIN: 180})
    assert len(computed) == 1


# ------------------------------------------------------------------ the local routine's task

LOCAL = {"local": {"steps": 3, "batch_size": 16, "clip": 2.0, "share": 0.5}}


@pytest.fixture
def local_experiment(tmp_path) -> Path:
    return write(tmp_path / "local.yaml", {**BASE, **LOCAL,
                                           "output": {"dir": str(tmp_path / "out")}})


def _local_task(config: Path, **mechanism) -> tuple[LocalTask, object]:
    cfg = load_config(config)
    n_min = 240
    cal = cfg.calibration(n_min)
    m = cfg.local_mechanism(cal)
    m = LocalMechanism(**{**{f: getattr(m, f) for f in ("steps", "batch_size", "learning_rate",
                                                        "clip", "sigma")},
                          **mechanism})
    layout = build_worker(cfg, 0).gradients.layout
    rng = np.random.default_rng(5)
    task = LocalTask(round=1, partition_id=0, x_start=rng.standard_normal(layout.dim) * 0.1,
                     v=rng.standard_normal(layout.dim) * 0.01, mechanism=m,
                     seed=local_seed(cfg.training.seed, 1), n_min=n_min,
                     sampling_prob=m.batch_size / n_min)
    return task, layout


REFUSED_LOCAL = {
    "sigma-zero": ({"sigma": 0.0},
                   r"rule `local sigma \(σ3\)`: the local task's σ3 = 0.0 is below the calibrated"),
    "sigma-halved": ("half", r"rule `local sigma \(σ3\)`"),
    "steps": ({"steps": 5},
              r"rule `local.steps`: the local task says 5; the run config's calibration says 3"),
    "batch": ({"batch_size": 32}, r"rule `local.batch_size`: the local task says 32"),
    "clip": ({"clip": 9.0}, r"rule `local.clip`: the local task says 9.0"),
}


@pytest.mark.parametrize("case", list(REFUSED_LOCAL))
def test_a_local_task_that_disagrees_with_the_calibration_is_refused(local_experiment, monkeypatch,
                                                                     case):
    changes, pattern = REFUSED_LOCAL[case]
    calls = []
    monkeypatch.setattr(Worker, "local_phase", lambda self, task: calls.append(task))
    honest, layout = _local_task(local_experiment)
    if changes == "half":
        changes = {"sigma": honest.mechanism.sigma / 2}
    task, _ = _local_task(local_experiment, **changes)
    arrays, conf = protocol.encode_local_task(task, layout)
    with pytest.raises(Exception, match=r"node 100 \(partition 0\) refused: " + pattern):
        call_app(local_experiment, arrays, conf)
    assert calls == []


def test_an_honest_local_task_is_computed(local_experiment):
    task, layout = _local_task(local_experiment)
    arrays, conf = protocol.encode_local_task(task, layout)
    res = call_app(local_experiment, arrays, conf)
    assert res.metrics[protocol.ECHO_KIND] == protocol.LOCAL and res.metrics[protocol.OVERFLOW] == 0


def test_the_local_steps_refuse_a_sampling_rate_above_the_accounted_q():
    """core: a worker whose b / n_p exceeds the task's q = b / n_min computes nothing (defence in
    depth)."""
    task = LocalTask(1, 0, np.zeros(3), np.ones(3), LocalMechanism(3, 10, 0.1, 1.0, 0.5), 1,
                     n_min=100, sampling_prob=0.1)
    never = lambda *a: pytest.fail("a record was touched")  # noqa: E731
    with pytest.raises(ValueError,
                       match=r"b / n_p = 10 / 50 = 0.2, above the q = 0.1 \(b / n_min, n_min = "
                             r"100\)"):
        run_local_phase(task, 50, never)
    assert run_local_phase(task, 100, lambda y, yp, batch, radius: (np.zeros(3), 0,
                                                                    False)).y.shape == (3,)


# ------------------------------------------------------------------ the policy file

@pytest.mark.parametrize("data, pattern", [
    ({"max_delta": 1e-5},
     r"key `max_epsilon`: expected a finite number > 0: the largest ε per run this node accepts "
                          r"\(required\). Found None"),
    ({**POLICY, "methods": ["gd", "diff2"]},
     r"key `methods`: expected a non-empty list of \['dpgd', 'diff2'\] \(gd "
                                             r"adds no noise"),
    ({**POLICY, "max_epsilon": "3"}, r"key `max_epsilon`: expected a number or null. Found '3'"),
    ({**POLICY, "lifetime": {"epsilon": 10.0}},
     r"key `lifetime.delta`: expected a value: a lifetime budget needs "
                                                r"epsilon, delta and ledger together"),
    ({**POLICY, "max_epsilion": 3}, r"unknown key max_epsilion"),
    ({**POLICY, "trust_server_sampling": True}, r"unknown key trust_server_sampling"),
    ({**POLICY, "lifetime": {"trust_server_sampling": True}},
     r"key `lifetime.trust_server_sampling`: expected false without a lifetime budget \(epsilon, "
     r"delta, ledger\)"),
    ({**POLICY, "lifetime": {"epsilon": 10.0, "delta": 1e-5, "ledger": "l.json",
                             "trust_server_sampling": "yes"}},
     r"key `lifetime.trust_server_sampling`: expected true/false|key "
     r"`lifetime.trust_server_sampling`: expected .*Found 'yes'"),
    # lifetime.sampled_runs (and its older form, the alias trust_server_sampling)
    ({**POLICY, "lifetime": {"epsilon": 10.0, "delta": 1e-5, "ledger": "l.json",
                             "sampled_runs": "unamplified", "trust_server_sampling": True}},
     r"key `lifetime.sampled_runs`: expected only one of lifetime.sampled_runs and "
     r"lifetime.trust_server_sampling \(its older name: true is amplified, false is refuse\): "
     r"remove lifetime.trust_server_sampling. Found \{'sampled_runs': 'unamplified', "
     r"'trust_server_sampling': True\}\.$"),
    ({**POLICY, "lifetime": {"epsilon": 10.0, "delta": 1e-5, "ledger": "l.json",
                             "sampled_runs": "refuse", "trust_server_sampling": False}},
     r"key `lifetime.sampled_runs`: expected only one of lifetime.sampled_runs and "
     r"lifetime.trust_server_sampling"),
    ({**POLICY, "lifetime": {"epsilon": 10.0, "delta": 1e-5, "ledger": "l.json",
                             "sampled_runs": "trust"}},
     r"key `lifetime.sampled_runs`: expected refuse \(the default: a client-sampled run is "
     r"refused\), unamplified \(charged as if this node were in every round: no trust in the "
     r"server's cohort draws\) or amplified \(charged its amplified ε: trusts the server to draw "
     r"the cohorts as declared\). Found 'trust'\.$"),
    ({**POLICY, "lifetime": {"epsilon": 10.0, "delta": 1e-5, "ledger": "l.json",
                             "sampled_runs": True}},
     r"key `lifetime.sampled_runs`: expected refuse \(the default.* Found True\.$"),
    ({**POLICY, "lifetime": {"sampled_runs": "unamplified"}},
     r"key `lifetime.sampled_runs`: expected refuse without a lifetime budget \(epsilon, delta, "
     r"ledger\): it says how that budget's ledger charges a client-sampled run; set the budget or "
     r"remove the key. Found 'unamplified'\.$"),
    ({**POLICY, "lifetime": {"sampled_runs": "amplified"}},
     r"key `lifetime.sampled_runs`: expected refuse without a lifetime budget"),
])
def test_a_bad_policy_file_names_the_file_and_the_key(tmp_path, data, pattern):
    path = write(tmp_path / "bad-policy.yaml", data)
    with pytest.raises(PolicyError, match=rf"{path}: .*{pattern}") as err:
        load_policy(path)
    assert len(str(err.value).splitlines()) == 1


@pytest.mark.parametrize("lifetime, mode", [
    ({}, "refuse"),
    ({"sampled_runs": "refuse"}, "refuse"),
    ({"sampled_runs": "unamplified"}, "unamplified"),
    ({"sampled_runs": "amplified"}, "amplified"),
    ({"trust_server_sampling": False}, "refuse"),  # the older key, read as an alias
    ({"trust_server_sampling": True}, "amplified"),
])
def test_sampled_runs_and_its_older_alias_read_as_one_mode(tmp_path, lifetime, mode):
    import dataclasses

    budget = {"epsilon": 10.0, "delta": 1e-5, "ledger": "l.json"}
    lifetime_of = load_policy(write(tmp_path / "policy.yaml",
                                    {**POLICY, "lifetime": {**budget, **lifetime}})).lifetime
    assert (lifetime_of.sampled_runs, lifetime_of.trust_server_sampling) == (mode, None)
    assert dataclasses.replace(lifetime_of) == lifetime_of  # rebuilt from its fields: the same
    if mode == "refuse":  # without a budget, only refuse (the default) may be said
        alone = load_policy(write(tmp_path / "alone.yaml", {**POLICY, "lifetime": lifetime}))
        assert not alone.lifetime.enabled and alone.lifetime.sampled_runs == "refuse"


def test_diff2_run_checks_the_policy_file_before_flower_starts(tmp_path, experiment):
    bad = write(tmp_path / "bad-policy.yaml", {"max_delta": 1e-5})
    env = {**os.environ, "FLWR_HOME": str(tmp_path / "home")}
    out = subprocess.run([sys.executable, "-m", "diff2_flwr.cli", "run", str(experiment),
                          "--node-policy", str(bad)],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode != 0 and (
        "key `max_epsilon`") in out.stderr and "Traceback" not in out.stderr
    out = subprocess.run([sys.executable, "-m", "diff2_flwr.cli", "run", str(experiment),
                          "--engine", "inprocess",
                          "--node-policy", str(policy_file(tmp_path))], capture_output=True,
                          text=True, timeout=120,
                         env=env)
    assert out.returncode != 0 and "use it with --engine flower" in out.stderr


# ------------------------------------------------------------------ through `flwr run` (a real
# simulation)

def _diff2_run(tmp_path: Path, config: Path, policy: Path) -> tuple[int, dict, str]:
    import json

    env = {k: v for k, v in os.environ.items() if k != "DIFF2_NODE_POLICY"}
    out = subprocess.run([sys.executable, "-m", "diff2_flwr.cli", "run", str(config),
                          "--node-policy", str(policy)],
                         capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    return out.returncode, json.loads(out.stdout), out.stderr


@pytest.mark.flower
def test_flwr_run_with_a_policy_on_every_simulated_node_completes_and_above_it_fails_at_round_one(
    tmp_path):
    config = write(tmp_path / "sim.yaml", {**BASE, "training": {**BASE["training"], "rounds": 3},
                                           "output": {"dir": str(tmp_path / "out")}})
    ledger = tmp_path / "ledgers" / "ledger.json"
    canaries = tmp_path / "canaries"
    policy = policy_file(tmp_path, lifetime={"epsilon": 8.0, "delta": 1e-5, "ledger": str(ledger)},
                         canaries={"count": 4, "state": str(canaries)})
    code, report, _ = _diff2_run(tmp_path, config, policy)
    assert code == 0 and report["status"] == "completed", report
    ledgers = sorted(p.name for p in ledger.parent.glob("ledger.partition-*.json"))
    # one per simulated node, charged once
    assert ledgers == ["ledger.partition-0.json", "ledger.partition-1.json"]
    # every simulated owner audited the run live through Flower's path: its canaries, its
    # observations, its verdict
    from diff2_flwr.lab.audit.live import live_audit

    folders = sorted(canaries.glob("partition-*/run-*"))
    assert [f.parent.name for f in folders] == ["partition-0", "partition-1"]
    for folder in folders:
        result = live_audit(folder)
        assert result["rounds"]["tasks_seen"] == 3 and result["records"] == 240 and result[
            "canaries"] == 4
        assert result["noise_scale"]["estimate"] > 0 and not result["violation"]
    # issue 40: the launcher holds the policy, so the run is refused before anything starts, in
    # the nodes' words
    strict = policy_file(tmp_path, max_epsilon=1.0)
    folders = sorted((tmp_path / "out").iterdir())  # the completed run's
    code, report, stderr = _diff2_run(tmp_path, config, strict)
    assert code == 2 and report["status"] == "failed" and report["run_id"] is None
    assert report["error"].startswith(
        "every simulated node refused: rule `max_epsilon`: the run asks ε = 3 (privacy.epsilon); "
        "this node allows at most ε = 1"), report["error"]
    assert stderr.splitlines() == [f"diff2 run: error: {report['error']}"]
    # before anything started: no Flower run, no run folder (3.6 s unloaded: the speed is a
    # benchmark's to state, not this test's)
    assert report["output_dir"] is None and sorted((tmp_path / "out").iterdir()) == folders


@pytest.mark.flower
def test_a_node_refusal_at_round_one_is_the_runs_one_error_line(tmp_path):
    """Issue 40, item 2: where the launcher does not hold the policy (here the simulated nodes read
    it from $DIFF2_NODE_POLICY, as under `flwr run .`), every node refuses round 1. The run's error
    is then the first node's own message, whole and first, in the JSON and summary.json, said once
    on stderr with no traceback; every failure in full goes to the log file it names."""
    import json

    config = write(tmp_path / "sim.yaml", {**BASE, "training": {**BASE["training"], "rounds": 3},
                                           "output": {"dir": str(tmp_path / "out")}})
    strict = policy_file(tmp_path, max_epsilon=1.0)
    env = {**os.environ, "DIFF2_NODE_POLICY": str(strict)}
    out = subprocess.run([sys.executable, "-m", "diff2_flwr.cli", "run", str(config)],
                         capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    report = json.loads(out.stdout)
    error = report["error"]
    assert out.returncode == 1 and report["status"] == "failed"
    assert error.startswith("node ") and (
        "(hospital-a) refused: rule `max_epsilon`: the run asks ε = 3 (privacy.epsilon); this node "
        "allows at most ε = 1") in error, error
    assert len(error) < 500
    log = Path(report["output_dir"]) / "round-1-failures.log"
    assert error.endswith("All 2 failure(s) of round 1: round-1-failures.log in the run folder.")
    assert log.is_file() and f"{log.name}" in out.stderr  # the summary's list of the run's files
    assert log.read_text().count("refused: rule `max_epsilon`") >= 2  # both nodes, in full
    summary = json.loads((Path(report["output_dir"]) / "summary.json").read_text())
    assert summary["error"] == error
    assert out.stderr.count("refused: rule") == 1 and "Traceback" not in out.stderr
    assert "Exit Code: 700" not in out.stderr
    rows = [line for line in (Path(report["output_dir"]) / "metrics.jsonl").read_text().splitlines()
            if line]
    assert len(rows) == 1  # round 0 only: the first round released nothing


# ------------------------------------------------------------------ the lifetime budget

_CHILD = """
import sys, importlib
sys.path[:0] = [{tests!r}]
import test_node_policy as t
from pathlib import Path
from diff2_flwr.runtime.session import Worker
import os
if {crash!r}:
    # the node dies after its charge, before it answers
    Worker.contribute = lambda self, *a: os._exit(9)
_, (arrays, conf) = t.task_of_round(Path({config!r}), 1)
try:
    t.call_app(Path({config!r}), arrays, conf, node_config={{"policy": {policy!r}}},
               run_id={run_id}, run_config={run_config!r})
    print("ADMITTED")
except Exception as err:
    print("REFUSED", err)
"""


def _in_a_fresh_process(config: Path, policy: Path, run_id: int, run_config: dict,
                        crash: bool = False) -> tuple[int, str]:
    code = _CHILD.format(tests=str(Path(__file__).parent), config=str(config), policy=str(policy),
                         run_id=run_id, run_config=run_config, crash=crash)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    return out.returncode, out.stdout


def test_the_lifetime_budget_refuses_the_run_that_would_cross_it_and_survives_a_crash_and_a_restart(
        experiment, tmp_path, computed):
    from diff2_flwr.runtime.node_ledger import NodeLedger

    ledger = tmp_path / "node" / "ledger.json"
    policy = policy_file(tmp_path, lifetime={"epsilon": 4.0, "delta": 1e-5, "ledger": str(ledger)})
    nodes = {"policy": str(policy)}
    _, (arrays, conf) = task_of_round(experiment, 1)
    call_app(experiment, arrays, conf, node_config=nodes, run_id=1)  # run 1: ε = 3 of 4, charged
    first = NodeLedger(ledger).spent(1e-5)
    assert 2.9 < first <= 3.0 + 1e-3 and oct(ledger.stat().st_mode & 0o777) == "0o600"
    # its next message: charged once only
    call_app(experiment, arrays, conf, node_config=nodes, run_id=1)
    assert len(NodeLedger(ledger).charges()) == 1 and len(computed) == 2
    before = ledger.read_bytes()
    with pytest.raises(Exception,
                       match=r"Node .node 100 \(hospital-a\). refuses run .2. \(rule: lifetime "
                             r"budget\)"):
        # run 2: another ε = 3 composes to ≈ 4.3 > 4
        call_app(experiment, arrays, conf, node_config=nodes, run_id=2)
    assert ledger.read_bytes() == before and len(computed) == 2  # nothing written, nothing computed
    # the same run with another config
    with pytest.raises(Exception, match=r"rule: lifetime budget"):
        call_app(experiment, arrays, conf, node_config=nodes, run_id=1,
                 run_config={"training.clip_diff": "3.0"})
    # A crash after the charge (the node dies computing run 3's first reply): the charge stands,
    # whole.
    code, out = _in_a_fresh_process(experiment, policy, 3, {"privacy.epsilon": "0.5"}, crash=True)
    assert code == 9 and "ADMITTED" not in out
    assert [c.run_id for c in NodeLedger(ledger).charges()] == ["1", "3"]
    # A restart (a new process) sees the same ledger: run 2 is refused again, run 3 goes on without
    # a new charge.
    assert _in_a_fresh_process(experiment, policy, 2, {})[1].startswith("REFUSED")
    assert _in_a_fresh_process(experiment, policy, 3,
                               {"privacy.epsilon": "0.5"})[1].startswith("ADMITTED")
    assert [c.run_id for c in NodeLedger(ledger).charges()] == ["1", "3"]
    assert NodeLedger(ledger).spent(1e-5) > first


# ------------------------------------------------------------------ client sampling and the
# lifetime budget (issue 44): the server's cohort draws are trusted only where the owner says so

SAMPLING = {"kind": "poisson", "rate": 0.5}


@pytest.fixture
def sampled_experiment(tmp_path) -> Path:
    return write(tmp_path / "sampled.yaml", {
        **BASE, "training": {**BASE["training"], "sampling": SAMPLING},
        "output": {"dir": str(tmp_path / "out-sampled")}})


def _lifetime_policy(tmp_path: Path, epsilon: float, **lifetime) -> tuple[Path, Path]:
    ledger = tmp_path / "node" / "ledger.json"
    return policy_file(tmp_path, lifetime={"epsilon": epsilon, "delta": 1e-5,
                                           "ledger": str(ledger), **lifetime}), ledger


def _refusal(err: pytest.ExceptionInfo) -> str:
    from diff2_flwr.runtime.policy import refusal_in

    found = refusal_in(str(err.value))
    assert found is not None, str(err.value)
    return found


@pytest.mark.parametrize("trust", [{}, {"sampled_runs": "refuse"},
                                   {"trust_server_sampling": False}])
def test_a_node_that_does_not_trust_the_servers_sampling_refuses_a_sampled_run(
        sampled_experiment, tmp_path, no_data, trust):
    """The attack: a server whose cohorts are not drawn as declared (this node in every round)
    would spend the unamplified ε while the ledger charged the amplified one. A node whose policy
    refuses sampled runs (the default; the older key's false alike) refuses the run before reading
    a record, in one line naming the key and what to do, the trust-free option among it; nothing is
    charged."""
    policy, ledger = _lifetime_policy(tmp_path, 10.0, **trust)
    _, (arrays, conf) = task_of_round(sampled_experiment, 1)
    with pytest.raises(Exception) as refused:
        call_app(sampled_experiment, arrays, conf, node_config={"policy": str(policy)})
    message = _refusal(refused)
    assert message.startswith(
        "node 100 (hospital-a) refused: rule `lifetime.sampled_runs`: the run samples "
        "clients (training.sampling: poisson, rate q = 0.5)"), message
    for part in ("which this node cannot check", f"(policy {policy})",
                 "Run without training.sampling, or the node's operator sets "
                 "lifetime.sampled_runs: unamplified (trust-free: the run is charged as if this "
                 "node were in every round, more ε) or amplified", "the round releases nothing."):
        assert part in message, (part, message)
    assert not ledger.exists()


def test_a_node_without_a_lifetime_budget_takes_a_sampled_run(sampled_experiment, tmp_path,
                                                                computed):
    """The rule is the lifetime ledger's: a node that keeps none checks the run's declared ε
    (max_epsilon) as before."""
    _, (arrays, conf) = task_of_round(sampled_experiment, 1)
    res = call_app(sampled_experiment, arrays, conf,
                   node_config={"policy": str(policy_file(tmp_path))})
    assert res.metrics[protocol.ECHO_ROUND] == 1 and len(computed) == 1


def test_a_node_that_trusts_the_servers_sampling_is_charged_the_amplified_epsilon(
        sampled_experiment, tmp_path, computed):
    """Read back from the ledger file: the run's sampled rounds (z, π = q, count) as its calibration
    plans them, and their amplified ε — the server's own (its calibration, and its ledger at the
    end of the run) to 1e-6, and below what the same noise would cost unamplified."""
    import json

    from diff2_flwr.core.privacy import RunEvents, composed_epsilon
    from diff2_flwr.runtime.driver import run_inprocess
    from diff2_flwr.runtime.node_ledger import NodeLedger

    policy, ledger = _lifetime_policy(tmp_path, 4.0, trust_server_sampling=True)
    server, (arrays, conf) = task_of_round(sampled_experiment, 1)
    res = call_app(sampled_experiment, arrays, conf, node_config={"policy": str(policy)}, run_id=1)
    assert res.metrics[protocol.ECHO_ROUND] == 1 and len(computed) == 1
    cal = server.calibration
    assert cal.sampling is not None and cal.n_min == conf[protocol.N_MIN]
    data = json.loads(ledger.read_text())
    assert data["version"] == 2 and len(data["charges"]) == 1
    charge = data["charges"][0]
    assert charge["run_id"] == "1" and charge["events"] == {
        "delta": 1e-5, "gaussian": [], "local": [],
        "sampled": [[cal.z1, 0.5, cal.restart_rounds], [cal.z2, 0.5, cal.difference_rounds]]}
    assert charge["epsilon"] == pytest.approx(cal.planned_epsilon, abs=1e-6)
    assert NodeLedger(ledger).spent(1e-5) == pytest.approx(cal.planned_epsilon, abs=1e-6)
    finished = run_inprocess(load_config(sampled_experiment), record=False, progress=None)
    assert charge["epsilon"] == pytest.approx(finished.ledger.epsilon, abs=1e-6)
    unamplified = RunEvents(delta=1e-5, gaussian=((cal.z1, cal.restart_rounds),
                                                  (cal.z2, cal.difference_rounds)))
    assert 2.9 < charge["epsilon"] <= 3.0 < composed_epsilon([unamplified], 1e-5)


def test_a_sampled_run_past_the_lifetime_budget_is_refused_and_the_ledger_is_unchanged(
        experiment, sampled_experiment, tmp_path, computed):
    """A trusting node charges the amplified ε, and refuses, through the real ClientApp, a sampled
    run whose amplified charge composed with what it spent would cross its lifetime budget: nothing
    computed, not a byte of the ledger changed. A smaller sampled run still fits, composed by PLD
    with the unsampled one."""
    from diff2_flwr.runtime.node_ledger import NodeLedger

    policy, ledger = _lifetime_policy(tmp_path, 4.0, trust_server_sampling=True)
    nodes = {"policy": str(policy)}
    _, (arrays, conf) = task_of_round(experiment, 1)
    call_app(experiment, arrays, conf, node_config=nodes, run_id=1)  # unsampled, ε = 3 of 4
    spent, before = NodeLedger(ledger).spent(1e-5), ledger.read_bytes()
    _, (arrays, conf) = task_of_round(sampled_experiment, 1)
    with pytest.raises(Exception) as refused:
        call_app(sampled_experiment, arrays, conf, node_config=nodes, run_id=2)
    message = _refusal(refused)  # the one line the server makes the run's error
    assert message.startswith(
        "node 100 (hospital-a) refused: rule `lifetime budget`: Node 'node 100 (hospital-a)' "
        f"refuses run '2' (rule: lifetime budget): the node has spent ε = {spent:.6g} over 1 "
        "run(s)"), message
    assert "its client-sampled rounds amplified by π = 0.5), together ε = 4." in message, message
    assert message.endswith("Nothing was computed on this node's records; the round releases "
                            "nothing.")
    assert ledger.read_bytes() == before and len(computed) == 1
    call_app(sampled_experiment, arrays, conf, node_config=nodes, run_id=3,
             run_config={"privacy.epsilon": "0.5"})
    charges = NodeLedger(ledger).charges()
    assert [c.run_id for c in charges] == ["1", "3"] and len(computed) == 2
    assert charges[1].events.sampled and not charges[1].events.gaussian
    assert spent < NodeLedger(ledger).spent(1e-5) < spent + charges[1].epsilon


def _independent_gaussian_epsilon(rounds: list[tuple[float, int]], delta: float,
                                  composed: bool) -> float:
    """ε of full Gaussian rounds (z, count) by dp-accounting's PLDAccountant(REPLACE_ONE) on its
    own (a multiplier z over the replace-one sensitivity is ``GaussianDpEvent(2z)`` in its −1/+1
    reading, tests/test_run_events.py). ``composed``: the rounds as one Gaussian of 1/z² = Σ count /
    z_i², their exact composition (Dong, Roth & Su 2019, Cor. 3.3; the accountant composes one
    event's count the same way); else each kind fed as its own event, the PLDs convolved (each
    discretised on its own: pessimistic, so a little above)."""
    from dp_accounting import NeighboringRelation, dp_event
    from dp_accounting.pld import pld_privacy_accountant

    acc = pld_privacy_accountant.PLDAccountant(neighboring_relation=NeighboringRelation.REPLACE_ONE,
                                               value_discretization_interval=1e-4)
    if composed:
        acc.compose(dp_event.GaussianDpEvent(2 / math.sqrt(sum(m / z**2 for z, m in rounds))))
    else:
        for z, m in rounds:
            acc.compose(dp_event.GaussianDpEvent(2 * z), m)
    return acc.get_epsilon(delta)


def test_a_node_that_does_not_trust_the_draws_is_charged_the_unamplified_epsilon(
        sampled_experiment, tmp_path, computed):
    """The trust-free choice (``lifetime.sampled_runs: unamplified``): the node takes the sampled
    run, and its ledger file records each sampled event [z, π, count] as ``count`` full Gaussian
    rounds of z — as if it were in every round, which bounds its loss whatever cohorts the server
    draws. The ε read back equals dp-accounting's PLD accountant of those Gaussian rounds, composed
    (1e-9 relative), and is strictly above the ε a node trusting the draws (``amplified``) charges
    for the same run."""
    import json

    from diff2_flwr.runtime.node_ledger import NodeLedger

    server, (arrays, conf) = task_of_round(sampled_experiment, 1)
    cal = server.calibration
    assert cal.sampling is not None and cal.n_min == conf[protocol.N_MIN]
    rounds = [(cal.z1, cal.restart_rounds), (cal.z2, cal.difference_rounds)]
    charged, ledgers = {}, {}
    for mode in ("unamplified", "amplified"):
        (tmp_path / mode).mkdir()
        policy, ledgers[mode] = _lifetime_policy(tmp_path / mode, 10.0, sampled_runs=mode)
        res = call_app(sampled_experiment, arrays, conf, node_config={"policy": str(policy)},
                       run_id=1)
        assert res.metrics[protocol.ECHO_ROUND] == 1
        (charged[mode],) = json.loads(ledgers[mode].read_text())["charges"]
    assert len(computed) == 2
    # what was charged: the rounds as full Gaussians (π = 1), not the sampled events
    assert charged["unamplified"]["events"] == {
        "delta": 1e-5, "gaussian": [[z, m] for z, m in rounds], "local": [], "sampled": []}
    assert charged["amplified"]["events"]["sampled"] == [[z, 0.5, m] for z, m in rounds]
    epsilon = charged["unamplified"]["epsilon"]
    assert epsilon == pytest.approx(_independent_gaussian_epsilon(rounds, 1e-5, True), rel=1e-9)
    assert epsilon == pytest.approx(_independent_gaussian_epsilon(rounds, 1e-5, False), rel=1e-7)
    assert NodeLedger(ledgers["unamplified"]).spent(1e-5) == pytest.approx(epsilon, rel=1e-12)
    assert 2.9 < charged["amplified"]["epsilon"] <= 3.0 < epsilon


def test_an_unamplified_node_refuses_a_sampled_run_whose_amplified_charge_would_fit(
        experiment, sampled_experiment, tmp_path, computed):
    """With ``sampled_runs: unamplified`` the budget is checked on the unamplified charge: after an
    unsampled run, a sampled run whose amplified ε would fit the rest of the budget (a node trusting
    the draws admits it, through the same app) but whose unamplified ε does not is refused, nothing
    computed, the ledger file unchanged byte for byte, and the refusal says it was charged
    unamplified."""
    from diff2_flwr.core.privacy import RunEvents, composed_epsilon
    from diff2_flwr.runtime.node_ledger import NodeLedger

    first_run = {"privacy.epsilon": "0.5"}  # the run config's text; the server's file: a number
    first, (arrays, conf) = task_of_round(experiment, 1, {"privacy.epsilon": 0.5})
    sampled, (s_arrays, s_conf) = task_of_round(sampled_experiment, 1)
    done = RunEvents.from_calibration(first.calibration)
    cal = sampled.calibration
    amplified = composed_epsilon([done, RunEvents.from_calibration(cal)], 1e-5)
    unamplified = composed_epsilon([done, RunEvents(delta=1e-5, gaussian=(
        (cal.z1, cal.restart_rounds), (cal.z2, cal.difference_rounds)))], 1e-5)
    budget = (amplified + unamplified) / 2
    assert amplified + 0.1 < budget < unamplified - 0.1, (amplified, unamplified)
    ledgers = {}
    for mode in ("unamplified", "amplified"):
        (tmp_path / mode).mkdir()
        policy, ledgers[mode] = _lifetime_policy(tmp_path / mode, budget, sampled_runs=mode)
        nodes = {"policy": str(policy)}
        call_app(experiment, arrays, conf, node_config=nodes, run_id=1, run_config=first_run)
        if mode == "amplified":  # the premise: its amplified charge fits
            call_app(sampled_experiment, s_arrays, s_conf, node_config=nodes, run_id=2)
            assert [c.run_id for c in NodeLedger(ledgers[mode]).charges()] == ["1", "2"]
            continue
        spent, before, answered = (NodeLedger(ledgers[mode]).spent(1e-5),
                                   ledgers[mode].read_bytes(), len(computed))
        with pytest.raises(Exception) as refused:
            call_app(sampled_experiment, s_arrays, s_conf, node_config=nodes, run_id=2)
        message = _refusal(refused)
        assert message.startswith(
            "node 100 (hospital-a) refused: rule `lifetime budget`: Node 'node 100 (hospital-a)' "
            f"refuses run '2' (rule: lifetime budget): the node has spent ε = {spent:.6g} over 1 "
            "run(s)"), message
        assert ("its client-sampled rounds (π = 0.5) charged unamplified, as if this node were in "
                "every round: its policy does not rely on the server's cohort draws), together ε = "
                f"{unamplified:.6g} > the lifetime budget ε_L = {budget:g}") in message, message
        assert ledgers[mode].read_bytes() == before and len(computed) == answered
