"""The server (and the run submitter) as the adversary of a data owner's node, through the real
ClientApp (issue 38): a run config reads no file on the node, a seed strips no noise, n_min is one
federation constant, a round is answered once. Each test is a reproduction of an attack from the
security review of main a53757f; each fails if the protection it names is removed."""

from __future__ import annotations

import importlib
import sys
import traceback
from pathlib import Path

import numpy as np
import pytest

from diff2_flwr.core import distributed
from diff2_flwr.core.distributed import client_rng
from diff2_flwr.core.skellam import decode
from diff2_flwr.fl import protocol
from diff2_flwr.runtime.answer_log import AnswerLog
from diff2_flwr.runtime.config import load_config
from diff2_flwr.runtime.loading import build_worker
from diff2_flwr.runtime.node_mode import simulated_node
from diff2_flwr.runtime.workers import Worker

sys.path.insert(0, str(Path(__file__).parent))
from test_node_policy import BASE, P, POLICY, call_app, deployment_node, task_of_round, write  # noqa: E402

client_app = importlib.import_module("clients.client_app")
server_app = importlib.import_module("server.server_app")

# ------------------------------------------------------------------ the node's secrets a run config
# might name

SEED = "1203858192292812017313580008727545364\n"  # a canary seed file
PEM = (
    "-----BEGIN OPENSSH PRIVATE "
    "KEY-----\nb3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQAAAAAAAAABAAAAaAAAABNlY2RzYS1zaGEy"
    "LW5pc3RwMjU2AAAACG5pc3RwMjU2AAAAQQR9WZPeBSvixkhjQOh9yCXXlEx5CTRERTBVvNUrbwcgxB9HsQt3"
    "\n-----END "
    "OPENSSH PRIVATE KEY-----\n")
HEX = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08\n"  # a SuperExec secret
CSV = "age,income,diagnosis\n34,52000,1\n61,38000,0\n"  # records
# a mapping with unknown keys
YAMLISH = "password: hunter2-very-secret\ntoken: ZXhhbXBsZS1zZWNyZXQtdG9rZW4\n"
SECRETS = {"seed": SEED, "pem": PEM, "hex": HEX, "csv": CSV, "yaml": YAMLISH}


def _pieces(text: str) -> list[str]:
    """The secret's tell-tale substrings (every token of 6+ characters): none may appear
    anywhere."""
    return [w for w in text.replace(",", " ").replace(":",
                                                      " ").split() if len(w) >= 6
                                                      and not w.startswith("-----")]


@pytest.fixture
def secrets_on_node(tmp_path_factory) -> dict[str, Path]:
    """The node's secret files, outside the node's experiments folder (each test's tmp_path)."""
    folder = tmp_path_factory.mktemp("node-secrets")
    out = {}
    for name, text in SECRETS.items():
        out[name] = folder / (f"secret-{name}.yaml" if name == "yaml" else f"secret-{name}")
        out[name].write_text(text)
    return out


@pytest.fixture
def opened(secrets_on_node) -> list[str]:
    """Every path this process opens while the test runs, after the secrets were written (a Python
    audit hook; it stays installed, reporting into the list of whichever test is running)."""
    paths: list[str] = []
    _HOOK_SINK[0] = paths
    yield paths
    _HOOK_SINK[0] = None


_HOOK_SINK: list = [None]


def _audit(event: str, args: tuple) -> None:
    if event == "open" and _HOOK_SINK[0] is not None and args and isinstance(args[0], (str, bytes,
                                                                                       Path)):
        _HOOK_SINK[0].append(str(args[0]))


sys.addaudithook(_audit)


@pytest.fixture
def experiment(tmp_path) -> Path:
    return write(tmp_path / "experiment.yaml", {**BASE, "output": {"dir": str(tmp_path / "out")}})


def _policy(tmp_path: Path, **changes) -> Path:
    return write(tmp_path / f"policy-{len(list(tmp_path.glob('policy-*')))}.yaml", {**POLICY,
                                                                                    **changes})


def _everything(info, capsys, caplog) -> str:
    """All a failed ClientApp call shows anyone: the error (its text is what Flower relays to the
    server), its traceback, the process's output and log records."""
    err = info.value
    text = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    captured = capsys.readouterr()
    return "\n".join([str(err), repr(err), text, captured.out, captured.err, caplog.text])


# ------------------------------------------------------------------ 1. a run config reads no file
# on the node

@pytest.mark.parametrize("secret", list(SECRETS))
def test_config_naming_a_node_file_reads_nothing_and_quotes_nothing(experiment, tmp_path,
                                                                    secrets_on_node, secret, opened,
                                                                    capsys, caplog):
    _, (arrays, conf) = task_of_round(experiment, 1)
    nodes, _ = deployment_node(experiment, {"partition-id": 0, "num-partitions": P,
                                            "policy": str(_policy(tmp_path))}, 0)
    path = secrets_on_node[secret]
    tries = [str(path),  # absolute
             f"../{path.parent.name}/{path.name}",  # out of the experiments folder
             "configs/../../" + str(path)]  # out of the app bundle
    # a .yaml inside the node's experiments folder that leads elsewhere
    link = tmp_path / "linked.yaml"
    link.symlink_to(path)
    tries.append(link.name)
    for given in tries:
        with pytest.raises(Exception) as info:
            _app(arrays, conf, nodes, {"config": given})
        shown = _everything(info, capsys, caplog)
        assert "Run-config key `config`" in str(info.value)
        for piece in _pieces(SECRETS[secret]):
            assert piece not in shown, (f"{given!r}: a piece of the node's {secret} file reached "
                                        f"the error")
    assert not [p for p in opened
                if Path(p).resolve() == path.resolve()], "the node opened the file"


def test_a_yaml_file_in_the_bundle_that_is_not_an_experiment_is_reported_without_its_content(
    experiment, tmp_path,
                                                                                            capsys,
                                                                                            caplog):
    """The node's own experiments folder holds a YAML that is not an experiment (its operator's):
    the error names the file and what is wrong, quoting no key and no value of it."""
    _, (arrays, conf) = task_of_round(experiment, 1)
    nodes, _ = deployment_node(experiment, {"partition-id": 0, "num-partitions": P,
                                            "policy": str(_policy(tmp_path))}, 0)
    (tmp_path / "notes.yaml").write_text(YAMLISH)
    (tmp_path / "bad.yaml").write_text("training:\n  rounds: hunter2-very-secret\n")
    (tmp_path / "broken.yaml").write_text("training: [hunter2-very-secret\n")
    for name, pattern in (("notes.yaml",
                           r"not a valid experiment file \(its content is not shown\)"),
                          ("bad.yaml",
                           r"key `training.rounds`: expected an integer \(the value found is not "
                           r"shown\)"),
                          ("broken.yaml",
                           r"not valid YAML at line \d+, column \d+ \(the line is not shown\)")):
        with pytest.raises(Exception, match=pattern) as info:
            _app(arrays, conf, nodes, {"config": name})
        shown = _everything(info, capsys, caplog)
        for piece in ("hunter2", "password", "ZXhhbXBsZS1zZWNyZXQtdG9rZW4"):
            assert piece not in shown


PATH_KEYS = {"dataset.dir": None, "dataset.path": {"dataset.name": "csv", "dataset.target": "age"},
             "dataset.shards": None, "output.dir": None, "output.checkpoint": None}


@pytest.mark.parametrize("key", list(PATH_KEYS))
def test_path_valued_settings_are_never_opened_by_a_data_owners_node(experiment, tmp_path,
                                                                     secrets_on_node, key, opened,
                                                                     capsys, caplog):
    """Every other path-valued key at the node's secret files: the node reads its records only from
    its node config's data-path, so the task is computed or refused, and no byte of any secret file
    reaches the reply, the error or the logs; none of them is opened."""
    _, (arrays, conf) = task_of_round(experiment, 1)
    nodes, given = deployment_node(experiment, {"partition-id": 0, "num-partitions": P,
                                                "policy": str(_policy(tmp_path))}, 0)
    for secret, path in secrets_on_node.items():
        run_config = {"config": given, key: str(path), **{k: str(v) for k,
                                                          v in (PATH_KEYS[key] or {}).items()}}
        try:
            res = _app(arrays, conf, nodes, run_config)
            shown = repr(res.metrics) + b"".join(res.parameters.tensors).hex() + "".join(
                capsys.readouterr())
        except Exception as err:  # noqa: BLE001 - a refusal is fine, as long as it quotes nothing
            shown = "".join(traceback.format_exception(type(err), err,
                                                       err.__traceback__)) + "".join(
                capsys.readouterr())
        shown += caplog.text
        for piece in _pieces(SECRETS[secret]):
            assert piece not in shown and piece.encode().hex() not in shown
    assert not any(Path(p).resolve() in {s.resolve() for s in secrets_on_node.values()}
                   for p in opened)


def test_a_deployment_node_without_data_path_reads_nothing_the_run_config_names(
    experiment, tmp_path, monkeypatch):
    """A SuperNode outside the simulation engine is a data owner's node even without data-path
    (review finding 6): it refuses rather than prepare data from the run config's dataset
    settings."""
    from diff2_flwr.runtime import node_mode

    _, (arrays, conf) = task_of_round(experiment, 1)
    monkeypatch.setattr(client_app, "build_worker", lambda *a,
                        **k: pytest.fail("the node loaded data"))
    # outside the engine (this test process may have imported the engine's module for another test)
    monkeypatch.setattr(node_mode, "simulation_engine_running", lambda: False)
    # exactly the simulation engine's keys, outside the engine
    nodes = {"partition-id": 0, "num-partitions": P}
    assert not simulated_node(nodes)
    with pytest.raises(Exception,
                       match=r"refused: rule `data-path`: this SuperNode runs outside Flower's "
                             r"simulation engine"):
        _app(arrays, conf, nodes, {"config": experiment.name})


def test_the_server_app_quotes_no_file_a_run_config_names(secrets_on_node, capsys):
    """The ServerApp's pre-flight line goes to the run submitter (`flwr log`): a config naming a
    server-side file is reported without its content."""
    for secret, path in secrets_on_node.items():
        with pytest.raises(Exception) as info:
            server_app.checked_config({"config": str(path)})
        shown = str(info.value) + capsys.readouterr().out
        assert "[diff2] pre-flight failed: Run-config key `config`" in shown
        for piece in _pieces(SECRETS[secret]):
            assert piece not in shown


def _app(arrays, conf, nodes: dict, run_config: dict, run_id: int = 7):
    """One train message through the real ClientApp with exactly this node config and run config."""
    from flwr.app import RecordDict
    from flwr.app.message import Message
    from flwr.common import Context, FitIns, ndarrays_to_parameters
    from flwr.compat.common.recorddict_compat import fitins_to_recorddict, recorddict_to_fitres
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = run_id, 100, 1
    content = fitins_to_recorddict(FitIns(ndarrays_to_parameters(arrays), dict(conf)),
                                   keep_input=True)
    message = Message(content, dst_node_id=100, message_type="train")
    context = Context(run_id=run_id, node_id=100, node_config=nodes, state=RecordDict(),
                      run_config=run_config)
    return recorddict_to_fitres(client_app.app(message, context).content, keep_input=True)


# ------------------------------------------------------------------ 2. a seed strips no noise

DISTRIBUTED = {**BASE, "privacy": {**BASE["privacy"], "noise": "distributed", "n_min": 240},
               "training": {**BASE["training"], "seed": 7}}


def _distributed(tmp_path: Path, seed: int | None) -> Path:
    return write(tmp_path / f"dist-{seed}.yaml",
                 {**DISTRIBUTED, "training": {**DISTRIBUTED["training"], "seed": seed},
                                                  "output": {"dir": str(tmp_path / "out")}})


def _share(config: Path, nodes: dict, arrays, conf, run_id: int = 7) -> np.ndarray:
    """The node's message for the secure sum, from the real ClientApp's client (the SecAgg+ mod only
    masks it)."""
    from flwr.app import RecordDict
    from flwr.common import Context, FitIns, ndarrays_to_parameters, parameters_to_ndarrays

    context = Context(run_id=run_id, node_id=100, node_config=nodes, state=RecordDict(),
                      run_config={"config": config.name})
    res = client_app.client_fn(context).fit(FitIns(ndarrays_to_parameters(arrays), dict(conf)))
    return np.concatenate([a.ravel()
                           for a in parameters_to_ndarrays(res.parameters)]).astype(np.int64)


def test_a_seeded_run_is_refused_by_a_data_owners_node_unless_its_policy_allows_seeds(tmp_path,
                                                                                      monkeypatch):
    config = _distributed(tmp_path, 7)
    _, (arrays, conf) = task_of_round(config, 1)
    monkeypatch.setattr(client_app, "build_worker", lambda *a,
                        **k: pytest.fail("the node loaded data"))
    strict = _policy(tmp_path, noise=["distributed"], min_honest=2, allow_seeded=False)
    nodes, _ = deployment_node(config, {"partition-id": 0, "num-partitions": P,
                                        "policy": str(strict)}, 0)
    with pytest.raises(Exception,
                       match=r"refused: rule `seed`: the run config sets training.seed: a seed in "
                             r"the run config is known to every party"):
        _share(config, nodes, arrays, conf)
    central = write(tmp_path / "central-seeded.yaml", {**BASE,
                                                       "output": {"dir": str(tmp_path / "out")}})
    nodes, _ = deployment_node(central, {"partition-id": 0, "num-partitions": P,
                                         "policy": str(_policy(tmp_path, allow_seeded=False))}, 0)
    # central: the seed is the server's noise key
    with pytest.raises(Exception, match=r"refused: rule `seed`"):
        _app(arrays, conf, nodes, {"config": central.name})


def test_stripping_the_shares_with_the_seed_recovers_the_clipped_means_only_where_seeds_are_allowed(
    tmp_path,
                                                                                                 monkeypatch):
    """The review's attack: rebuild each node's rounding and Skellam share from (seed, partition,
    round) and remove it. Where seeds are allowed (a simulation, or allow_seeded) it works to the
    rounding (that is what a seed is); an unseeded data owner's node draws from its own entropy, and
    the rebuilt message misses by the noise."""
    seeded, unseeded = _distributed(tmp_path, 7), _distributed(tmp_path, None)
    server, (arrays, conf) = task_of_round(seeded, 1)
    cfg = load_config(seeded)
    noise = cfg.distributed_noise(240, server.layout.dim)
    radius = conf[protocol.RADIUS]
    code = noise.code(1, True, radius)
    worker = build_worker(cfg, 0)
    mean = worker.contribute(radius, server.plan().x_current, None).mean
    # the attacker's rebuild of partition 0's message with seed 7, given even its exact clipped mean
    rebuilt = noise.encode(mean, 1, True, radius, client_rng(7, 0, 1))
    allowed = _policy(tmp_path, noise=["distributed"], min_honest=2, allow_seeded=True)
    nodes, _ = deployment_node(seeded, {"partition-id": 0, "num-partitions": P,
                                        "policy": str(allowed)}, 0)
    # the attack, where seeds are allowed: the wire carries the message centred, mod M it is the
    # rebuilt one
    np.testing.assert_array_equal(np.mod(_share(seeded, nodes, arrays, conf), code.modulus),
                                  rebuilt)

    policy = _policy(tmp_path, noise=["distributed"], min_honest=2)
    nodes, _ = deployment_node(unseeded, {"partition-id": 0, "num-partitions": P,
                                          "policy": str(policy)}, 0)
    # the node's OS entropy, fixed for this test (a statistical test with a fixed seed): 128 bits
    # the attacker lacks
    monkeypatch.setattr(distributed.secrets, "randbits",
                        lambda bits: 0x5D2A_91C4_7E3B_0F68_A4C1_2B9E_6F70_D853)
    message = _share(unseeded, nodes, arrays, conf, run_id=8)
    # what stripping with the seed leaves
    error = decode(np.mod(message - rebuilt, code.modulus), code)
    declared = noise.noise_std(1, True, radius, 1)  # one share's noise std on the mean's scale
    # two independent shares' difference: std √2 × the share's (plus rounding); over d coordinates
    # the sample std is within ±25 % of it (its standard error is about 1/√(2d) = 7 % here)
    assert code.dim >= 100 and np.std(error) == pytest.approx(np.sqrt(2) * declared, rel=0.25)


def test_iterates_a_hair_apart_that_make_the_radius_subnormal_are_refused_before_any_clipping(
        tmp_path, monkeypatch):
    """The server sends a difference round whose x_(r-1) and x_(r-2) differ by 1e-300 in one
    coordinate (0 in one, 1e-300 in the other): the radius rule C2 ||x_(r-1) - x_(r-2)|| then gives
    2e-300, which the node's guard recomputes and accepts, and under which clipped values and noise
    scaled to the radius would be subnormal (no sensitivity bound holds). The node computes
    nothing, central or distributed."""
    config = _distributed(tmp_path, None)
    _, (arrays, conf) = task_of_round(config, 2)
    assert conf[protocol.KIND] == "difference"
    k = len(arrays) // 2
    current = [a.copy() for a in arrays[:k]]
    current[0].flat[0] = 0.0
    previous = [a.copy() for a in current]
    previous[0].flat[0] = 1e-300
    crafted = current + previous
    radius = 2.0 * 1e-300  # C2 = 2 (BASE) times the one coordinate that differs
    assert 0 < radius < 2.0**-900
    sneaky = {**conf, protocol.RADIUS: radius}
    for name in ("contribute", "message"):
        monkeypatch.setattr(Worker, name, lambda *a, **k: pytest.fail("the node clipped records"))
    policy = _policy(tmp_path, noise=["distributed"], min_honest=2)
    nodes, _ = deployment_node(config, {"partition-id": 0, "num-partitions": P,
                                        "policy": str(policy)}, 0)
    with pytest.raises(ValueError, match=r"'diff2\.radius' is 2e-300, below 1\.18e-271 "
                                         r"\(2\^-900\).*this node computes nothing"):
        _share(config, nodes, crafted, sneaky)
    central = write(tmp_path / "central.yaml", {**BASE, "training": {**BASE["training"],
                                                                     "seed": None},
                                                "output": {"dir": str(tmp_path / "out")}})
    nodes, _ = deployment_node(central, {"partition-id": 0, "num-partitions": P,
                                         "policy": str(_policy(tmp_path))}, 0)
    with pytest.raises(Exception, match=r"below 1\.18e-271"):
        _app(crafted, sneaky, nodes, {"config": central.name})


def test_a_seed_sent_by_the_server_for_the_local_steps_of_an_unseeded_run_is_refused(tmp_path,
                                                                                     monkeypatch):
    from diff2_flwr.core.local import LocalMechanism, LocalTask
    from diff2_flwr.runtime.session import Worker

    config = write(tmp_path / "local.yaml", {**BASE, "training": {**BASE["training"], "seed": None},
                                             "local": {"steps": 3, "batch_size": 16, "clip": 2.0,
                                                       "share": 0.5},
                                             "output": {"dir": str(tmp_path / "out")}})
    cfg = load_config(config)
    cal = cfg.calibration(240)
    m = cfg.local_mechanism(cal)
    layout = build_worker(cfg, 0).gradients.layout
    calls = []
    monkeypatch.setattr(Worker, "local_phase", lambda self, task: calls.append(task))
    task = LocalTask(round=1, partition_id=0, x_start=np.zeros(layout.dim), v=np.zeros(layout.dim),
                     mechanism=LocalMechanism(m.steps, m.batch_size, m.learning_rate, m.clip,
                                              m.sigma), seed=12345,
                     n_min=240, sampling_prob=m.batch_size / 240)
    arrays, conf = protocol.encode_local_task(task, layout)
    nodes, _ = deployment_node(config, {"partition-id": 0, "num-partitions": P,
                                        "policy": str(_policy(tmp_path))}, 0)
    with pytest.raises(Exception,
                       match=r"refused: rule `seed`: the local task carries a seed for this "
                             r"node's batches and σ3 noise that the run config does not make \(an "
                             r"unseeded run"):
        _app(arrays, conf, nodes, {"config": config.name})
    assert calls == []


def test_the_servers_noise_key_is_in_no_message_it_sends(tmp_path):
    """Central noise, unseeded: the key is drawn from OS entropy on the server and no task carries
    it."""
    config = write(tmp_path / "unseeded.yaml", {**BASE, "training": {**BASE["training"],
                                                                     "seed": None},
                                                "output": {"dir": str(tmp_path / "out")}})
    from diff2_flwr.runtime.session import build_server

    cfg = load_config(config)
    server = build_server(cfg, record=False, progress=None)
    key = server.core.estimator.noise_key
    assert not server.core.estimator.noise_seeded and key.bit_length() > 64
    tells = [str(key), key.to_bytes(16, "little").hex(), key.to_bytes(16, "big").hex(),
             str(key & (2**64 - 1)), str(key >> 64)]
    sent = []
    for _ in range(3):
        plan = server.plan()
        arrays, conf = protocol.encode_task(plan, server.layout, server.n_min)
        sent.append(repr(conf) + "".join(a.tobytes().hex() for a in arrays))
        server.release([build_worker(cfg, p).reply(plan) for p in range(P)])
    for tell in tells:
        assert all(tell not in text for text in sent)


# ------------------------------------------------------------------ 3. n_min is a federation
# constant

def test_a_distributed_run_without_a_declared_n_min_is_refused_and_a_pinned_one_must_match(
    tmp_path, monkeypatch):
    """The review's attack: a server that sends every node its own n_p as n_min shrinks every share.
    Under distributed noise the run must declare privacy.n_min (each task must carry it); a policy
    may pin it."""
    monkeypatch.setattr(client_app, "build_worker",
                        lambda *a, **k: pytest.fail("the node loaded data"))
    undeclared = write(tmp_path / "undeclared.yaml", {**DISTRIBUTED,
                                                      "privacy": {**BASE["privacy"],
                                                                  "noise": "distributed"},
                                                      "training": {**BASE["training"],
                                                                   "seed": None},
                                                      "output": {"dir": str(tmp_path / "out")}})
    _, (arrays, conf) = task_of_round(_distributed(tmp_path, 7), 1)
    policy = _policy(tmp_path, noise=["distributed"], min_honest=2)
    nodes, _ = deployment_node(undeclared, {"partition-id": 0, "num-partitions": P,
                                            "policy": str(policy)}, 0)
    with pytest.raises(Exception,
                       match=r"refused: rule `n_min`: under distributed noise n_min is a "
                             r"federation constant: the run config must declare privacy.n_min"):
        _share(undeclared, nodes, arrays, conf)
    pinned = _policy(tmp_path, noise=["distributed"], min_honest=2, n_min=200)
    config = _distributed(tmp_path, None)  # declares n_min = 240
    nodes, _ = deployment_node(config, {"partition-id": 0, "num-partitions": P,
                                        "policy": str(pinned)}, 0)
    with pytest.raises(Exception,
                       match=r"refused: rule `n_min`: the run declares privacy.n_min = 240; this "
                             r"node's policy pins the federation's n_min = 200"):
        _share(config, nodes, arrays, conf)


def test_a_task_with_another_n_min_than_the_declared_one_is_refused(tmp_path, monkeypatch):
    config = _distributed(tmp_path, None)
    _, (arrays, conf) = task_of_round(_distributed(tmp_path, 7), 1)
    policy = _policy(tmp_path, noise=["distributed"], min_honest=2)
    nodes, _ = deployment_node(config, {"partition-id": 0, "num-partitions": P,
                                        "policy": str(policy)}, 0)
    with pytest.raises(Exception,
                       match=r"rule `n_min`: the task says n_min = 100; the run config says "
                                        r"privacy.n_min = 240"):
        _share(config, nodes, arrays, {**conf, protocol.N_MIN: 100})


# ------------------------------------------------------------------ 4. a round is answered once

def test_a_replayed_distributed_round_is_refused_also_after_a_restart(tmp_path):
    config = _distributed(tmp_path, None)
    _, (arrays, conf) = task_of_round(_distributed(tmp_path, 7), 1)
    policy = _policy(tmp_path, noise=["distributed"], min_honest=2)
    nodes, _ = deployment_node(config, {"partition-id": 0, "num-partitions": P,
                                        "policy": str(policy)}, 0)
    first = _share(config, nodes, arrays, conf)
    # a new ClientApp process: nothing in memory, the record on disk
    client_app._config.cache_clear()
    with pytest.raises(Exception,
                       match=r"refused: rule `replay`: it has already answered round 1 \(train\) "
                             r"of run 7"):
        _share(config, nodes, arrays, conf)
    assert first.size and (tmp_path / "answers.log").read_text().count("\t") == 3
    assert _share(config, nodes, arrays, conf, run_id=9).size  # another run is another record


def test_a_central_round_retried_with_the_same_task_is_answered_and_with_other_iterates_refused(
    experiment, tmp_path):
    """Central noise: the reply is the clipped mean of what the task carries, so the same task again
    (a retried round) gets the same answer; the same round at other iterates (a reused run id) is
    refused."""
    _, (arrays, conf) = task_of_round(experiment, 1)
    policy = str(_policy(tmp_path))
    first = call_app(experiment, arrays, conf, node_config={"policy": policy})
    again = call_app(experiment, arrays, conf, node_config={"policy": policy})
    assert b"".join(first.parameters.tensors) == b"".join(again.parameters.tensors)
    moved = [a + 0.01 for a in arrays]
    with pytest.raises(Exception, match=r"refused: rule `replay`"):
        call_app(experiment, moved, conf, node_config={"policy": policy})
    assert len(AnswerLog(tmp_path / "answers.log").answered()) == 1


def test_a_node_is_simulated_only_inside_the_engine_and_with_the_engines_node_config(monkeypatch):
    from diff2_flwr.runtime import node_mode

    engine = {"partition-id": 0, "num-partitions": 2}
    monkeypatch.delitem(sys.modules, node_mode.SIMULATION_ENGINE_MODULES[0], raising=False)
    assert not node_mode.simulated_node(engine)  # a SuperNode's process: no engine loaded
    monkeypatch.setitem(sys.modules, node_mode.SIMULATION_ENGINE_MODULES[0], object())
    assert node_mode.simulated_node(engine)
    # any key of an operator's: a data owner's node
    for operator_key in ("data-path", "policy", "experiments"):
        assert not node_mode.simulated_node({**engine, operator_key: "x"})


@pytest.mark.parametrize("policy_changes, run, pattern", [
    (None, {"training": {**BASE["training"], "seed": 4}},
     r"every data owner's node refused: rule `seed`"),
    ({"allow_seeded": False}, {"training": {**BASE["training"], "seed": 4}}, r"rule `seed`"),
    ({"allow_seeded": True, "n_min": 100}, {"training": {**BASE["training"], "seed": 4}},
     r"rule `n_min`: the run declares privacy.n_min = None; this node's policy pins the "
     r"federation's n_min = 100"),
    (None, {"training": {**BASE["training"], "seed": None}, "local": {"steps": 2, "batch_size": 8}},
     r"rule `answers`: the run has this node draw noise of its own \(the local routine's σ3\)"),
])
def test_deploy_local_says_what_every_node_would_refuse_before_anything_starts(
    tmp_path, monkeypatch, policy_changes,
                                                                             run, pattern):
    from diff2_flwr.deploy import native

    monkeypatch.setattr(native, "start_superlink", lambda *a,
                        **k: pytest.fail("a process was started"))
    config = write(tmp_path / "dep.yaml", {**BASE, **run, "output": {"dir": str(tmp_path / "out")}})
    policy = None if policy_changes is None else _policy(tmp_path, **policy_changes)
    with pytest.raises(Exception, match=pattern):
        native.run_local_deployment(config, workdir=tmp_path / "work", echo=False,
                                    node_policy=policy)
