"""The Python API (diff2_flwr.make_strategy / make_client) through the real Flower Strategy and
NumPyClient.

A run built from plain arguments must be the YAML run with the same settings, bit for bit (the YAML
path is built on the same functions); bad arguments fail at once with the YAML path's messages; a
torch Dataset is read in chunks with the same result as tensors; the tutorial's example
(docs/tutorials/own-model-and-data.md) is the file we test and it runs.
"""

from __future__ import annotations

import copy
import importlib.util
import inspect
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from flwr.common import FitIns, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server.client_manager import SimpleClientManager
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

import diff2_flwr
from diff2_flwr.core.aggregation import RoundRejected
from diff2_flwr.core.closed_form import PaperMLPGradients
from diff2_flwr.core.gradients import PerSampleGradients
from diff2_flwr.core.sampling import Sampling
from diff2_flwr.fl import protocol
from diff2_flwr.fl.client import Diff2Client
from diff2_flwr.fl.strategy import Diff2Strategy
from diff2_flwr.runtime.checkpoint import CheckpointError
from diff2_flwr.runtime.compute import pinned_threads
from diff2_flwr.runtime.config import ConfigError, parse_config
from diff2_flwr.runtime.driver import run_inprocess
from diff2_flwr.runtime.session import load_data
from diff2_flwr.task.losses import cross_entropy, half_squared_error
from diff2_flwr.task.models import PaperMLP, TanhMLP, build_model
from diff2_flwr.task.records import DatasetRecords
from test_strategy import FakeProxy as Proxy  # the never-called ClientProxy of the strategy tests

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "python_api.py"

ARGS = dict(epsilon=3.0, delta=1e-5, rounds=4, restart_every=2, clients=3, clip_restart=1.0,
            clip_diff=3.0, learning_rate=0.2)


def drive(strategy: Diff2Strategy, clients, rounds: int | None = None) -> list[np.ndarray]:
    """Run the Flower rounds (all, or the first ``rounds``): configure_fit -> each client's Flower
    ``Client.fit`` -> aggregate_fit. ``clients[p]`` is a NumPyClient or a Client; returns the
    released iterates as flat vectors."""
    manager = SimpleClientManager()
    for p in range(len(clients)):
        manager.register(Proxy(f"cid-{p}"))
    released = []
    for r in range(1, (rounds or strategy.num_rounds) + 1):
        instructions = strategy.configure_fit(r, strategy.initialize_parameters(manager), manager)
        results = []
        for proxy, fit_ins in instructions:
            client = clients[int(proxy.cid.removeprefix("cid-"))]
            client = client.to_client() if isinstance(client, Diff2Client) else client
            res = client.fit(FitIns(parameters=fit_ins.parameters, config=dict(fit_ins.config)))
            results.append((proxy, res))
        params, _ = strategy.aggregate_fit(r, results, [])
        released.append(strategy.server.layout.flatten(parameters_to_ndarrays(params)))
    return released


def yaml_config(model: dict | None = None, **training):
    data = {"name": "api-vs-yaml", "method": "diff2", "dataset": {"name": "synthetic",
                                                                  "num_samples": 400},
            "privacy": {"epsilon": ARGS["epsilon"], "delta": ARGS["delta"]},
            "training": {k: ARGS[k] for k in ("rounds", "restart_every", "clients", "clip_restart",
                                              "clip_diff",
                                              "learning_rate")} | {"seed": 7} | training,
            "evaluation": {"train_metrics": False, "test_metrics": True, "clip_stats": True}}
    if model is not None:
        data["model"] = model
    return parse_config(data)


# ------------------------------------------------------------------------------ API run == YAML run

@pytest.mark.parametrize("model", [None, {"name": "diff2_flwr.task.models:TanhMLP",
                                          "kwargs": {"hidden": 6},
                                          "init_seed": 3}], ids=["paper_mlp-closed_form",
                                                                 "factory-torch_func"])
def test_api_run_is_the_yaml_run_bit_for_bit(model):
    cfg = yaml_config(model)
    with pinned_threads(cfg.training.threads):
        reference = run_inprocess(cfg, record=False, progress=None)
        data = load_data(cfg)

        def net():
            if model is None:
                return PaperMLP(data.num_features, 10, 1, init_seed=0).double()
            return build_model("diff2_flwr.task.models:TanhMLP", in_features=data.num_features,
                               out_features=1, init_seed=3, kwargs={"hidden": 6})

        test = tuple(torch.as_tensor(a) for a in (data.x_test, data.y_test))

        def evaluate(arrays):  # the user's own evaluation: a plain torch forward pass
            m = net()
            with torch.no_grad():
                for p, a in zip(m.parameters(), arrays):
                    p.copy_(torch.from_numpy(a))
                return {"test_loss": float(half_squared_error(m(test[0]), test[1]).mean())}

        strategy = diff2_flwr.make_strategy(**ARGS, n_min=data.n_min, seed=7, model=net(),
                                            evaluate_fn=evaluate, progress=None, clip_stats=True)
        clients = [diff2_flwr.make_client(model=net(), loss=half_squared_error, data=data.shard(p),
                                          partition_id=p)
                   for p in range(3)]
        kind = PaperMLPGradients if model is None else PerSampleGradients
        assert all(isinstance(c.worker.gradients, kind) for c in clients)
        released = drive(strategy, clients)
    assert strategy.server.done and len(released) == ARGS["rounds"]
    np.testing.assert_array_equal(strategy.server.state.x, reference.state.x)
    for mine, theirs in zip(strategy.server.history, reference.history):
        for key in ("round", "kind", "radius", "noise_std", "clip_fraction", "epsilon_spent",
                    "update_norm"):
            assert key in theirs or mine["round"] == 0, key  # both opted in to clip_fraction
            assert mine.get(key) == theirs.get(key), key
        # the YAML server evaluates in the clients' dtype (auto: float32 for a factory model), the
        # user's evaluate_fn in float64
        rel = 1e-12 if model is None else 1e-6
        assert mine["test_loss"] == pytest.approx(theirs["test_loss"], rel=rel)
    assert strategy.server.epsilon_spent == pytest.approx(ARGS["epsilon"], rel=1e-9)


def test_initial_parameters_as_flower_parameters_and_num_rounds():
    model = TanhMLP(in_features=4, out_features=1).double()
    arrays = [p.detach().numpy().copy() for p in model.parameters()]
    strategy = diff2_flwr.make_strategy(**ARGS, n_min=10,
                                        initial_parameters=ndarrays_to_parameters(arrays),
                                        round_retries=2, progress=None)
    np.testing.assert_array_equal(strategy.server.state.x,
                                  np.concatenate([a.ravel() for a in arrays]))
    assert strategy.num_rounds == ARGS["rounds"] + 2
    assert strategy.server.layout.shapes == tuple(a.shape for a in arrays)


@pytest.mark.parametrize("routine", ["gd", {"name": "adam", "beta1": 0.8}], ids=["gd", "adam"])
def test_a_strategy_with_a_checkpoint_resumes_the_same_trajectory(tmp_path, routine):
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(90, 4, generator=g, dtype=torch.float64), torch.randn(90, generator=g,
                                                                             dtype=torch.float64)
    model = TanhMLP(in_features=4, out_features=1)
    clients = [diff2_flwr.make_client(model=model, loss=half_squared_error,
                                      data=(x[30 * p:30 * p + 30], y[30 * p:30 * p + 30]),
                                      partition_id=p) for p in range(3)]
    args = dict(ARGS, rounds=6, n_min=30, model=model, seed=5, progress=None, routine=routine)
    reference = diff2_flwr.make_strategy(**args)
    drive(reference, clients)
    checkpoint, out = tmp_path / "server.ckpt", tmp_path / "runs"
    first = diff2_flwr.make_strategy(**args, checkpoint=checkpoint, output_dir=out)
    drive(first, clients, rounds=2)  # the server process dies here
    second = diff2_flwr.make_strategy(**args, checkpoint=checkpoint, output_dir=out)
    assert second.server.state.round == 2 and second.num_rounds == 4
    assert second.server.run_info["output_dir"] == first.server.run_info["output_dir"]
    drive(second, clients)
    np.testing.assert_array_equal(second.server.state.x, reference.server.state.x)
    assert second.server.epsilon_spent == reference.server.epsilon_spent
    with pytest.raises(CheckpointError):  # another run's checkpoint is refused, not continued
        diff2_flwr.make_strategy(**{**args, "learning_rate": 0.1}, checkpoint=checkpoint)
    with pytest.raises(CheckpointError, match=r"another configuration .*Its routine is \{'name': "):
        diff2_flwr.make_strategy(**{**args, "routine": "momentum" if routine == "gd" else "gd"},
                                 checkpoint=checkpoint)
    other = copy.deepcopy(model)
    with torch.no_grad():
        next(other.parameters())[0, 0] += 1.0  # another x_0, the same arguments
    with pytest.raises(CheckpointError):
        diff2_flwr.make_strategy(**{**args, "model": other}, checkpoint=checkpoint)


def test_a_client_below_n_min_fails_the_round_and_nothing_is_released():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(30, 4, generator=g, dtype=torch.float64), torch.randn(30, generator=g,
                                                                             dtype=torch.float64)
    model = TanhMLP(in_features=4, out_features=1)
    strategy = diff2_flwr.make_strategy(**ARGS, n_min=20, model=model, seed=0, progress=None)
    sizes = (30, 25, 12)  # the last holds fewer records than the noise was calibrated for
    clients = [diff2_flwr.make_client(model=model, loss=half_squared_error, data=(x[:n], y[:n]),
                                      partition_id=p)
               for p, n in enumerate(sizes)]
    x0 = strategy.server.state.x.copy()
    with pytest.raises(RoundRejected,
                       match=r"check 'n_min' failed from partition 2 .*holds 12 samples"):
        drive(strategy, clients)
    assert strategy.server.state.round == 0
    np.testing.assert_array_equal(strategy.server.state.x, x0)
    assert strategy.server.summary()["status"] == "failed"


# ------------------------------------------------------------------------------ validation: YAML's
# messages

BAD = [  # (section, key, value)
    ("training", "rounds", 0), ("training", "rounds", 2.5), ("privacy", "epsilon", -1.0),
    ("privacy", "epsilon", float("inf")), ("privacy", "delta", 1.5), ("training", "clip_restart",
                                                                      0.0),
    ("training", "clip_diff", float("inf")), ("training", "learning_rate", float("nan")),
    ("training", "restart_every", 0), ("training", "restart_every", 9), ("training", "clients", 0),
    ("training", "seed", -3), ("privacy", "mode", "zcdp"), ("privacy", "u", 1.0), ("privacy",
                                                                                   "n_min", 0),
]


@pytest.mark.parametrize("section,key,value", BAD, ids=[f"{k}={v}" for _, k, v in BAD])
def test_bad_arguments_fail_at_once_with_the_yaml_message(section, key, value):
    data = {"method": "diff2", "privacy": {"n_min": 10}, "training": {k: ARGS[k] for k in (
        "rounds", "restart_every", "clients", "clip_restart", "clip_diff", "learning_rate")}}
    data[section] = {**data[section], key: value}
    with pytest.raises(ConfigError) as yaml_error:
        parse_config(data, "exp.yaml")
    with pytest.raises(ConfigError) as api_error:
        diff2_flwr.make_strategy(**{**ARGS, "n_min": 10, key: value}, model=TanhMLP(in_features=2,
                                                                                    out_features=1),
                                 progress=None)
    yaml_message, api_message = str(yaml_error.value), str(api_error.value)
    assert yaml_message.startswith(f"exp.yaml: key `{section}.{key}`: expected ")
    assert api_message.startswith(f"diff2_flwr.make_strategy: argument `{key}`: expected ")
    # expected ... Found ...
    assert api_message.split("`: ", 1)[1] == yaml_message.split("`: ", 1)[1]


def test_arguments_named_apart_from_their_yaml_key_are_named_as_the_caller_wrote_them():
    model = TanhMLP(in_features=2, out_features=1)
    with pytest.raises(ConfigError) as yaml_error:
        parse_config({"evaluation": {"every": 0}, "training": {"restart_every": 2}}, "exp.yaml")
    with pytest.raises(ConfigError) as api_error:
        diff2_flwr.make_strategy(**ARGS, n_min=10, model=model, eval_every=0, progress=None)
    assert str(
        yaml_error.value) == "exp.yaml: key `evaluation.every`: expected an integer >= 1. Found 0."
    assert str(
        api_error.value) == ("diff2_flwr.make_strategy: argument `eval_every`: expected an "
                             "integer >= 1. Found 0.")
    with pytest.raises(ConfigError,
                       match=r"^diff2_flwr.make_strategy: argument `round_retries`: expected an "
                             r"integer >= 0. Found -1.$"):
        diff2_flwr.make_strategy(**ARGS, n_min=10, model=model, round_retries=-1, progress=None)
    with pytest.raises(ConfigError,
                       match=r"^diff2_flwr.make_strategy: argument `routine.beta1`: expected a "
                             r"number in \[0, 1\). Found 1.5.$"):
        diff2_flwr.make_strategy(**ARGS, n_min=10, model=model,
                                 routine={"name": "adam", "beta1": 1.5}, progress=None)
    with pytest.raises(ConfigError,
                       match=r"argument `routine.name`: expected one of 'gd', 'momentum'"):
        diff2_flwr.make_strategy(**ARGS, n_min=10, model=model, routine="lion", progress=None)
    with pytest.raises(ConfigError,
                       match=r"argument `name`: expected a non-empty string without path "
                             r"separators"):
        diff2_flwr.make_strategy(**ARGS, n_min=10, model=model, name="../x", progress=None)


def test_strategy_needs_exactly_one_initial_point_and_n_min():
    with pytest.raises(ConfigError,
                       match=r"exactly one of `model` .* and `initial_parameters` .*Found neither"):
        diff2_flwr.make_strategy(**ARGS, n_min=10, progress=None)
    model = TanhMLP(in_features=2, out_features=1)
    with pytest.raises(ConfigError, match=r"Found both"):
        diff2_flwr.make_strategy(**ARGS, n_min=10, model=model, initial_parameters=[np.zeros(3)],
                                 progress=None)
    with pytest.raises(ConfigError,
                       match=r"argument `n_min`: expected an integer >= 1 \(the fewest records"):
        diff2_flwr.make_strategy(**ARGS, n_min=None, model=model, progress=None)
    with pytest.raises(ConfigError,
                       match=r"argument `initial_parameters`: expected floating-point arrays"):
        diff2_flwr.make_strategy(**ARGS, n_min=10, initial_parameters=[np.zeros(3, dtype=int)],
                                 progress=None)
    with pytest.raises(ConfigError, match=r"argument `evaluate_fn`: expected None or a callable"):
        diff2_flwr.make_strategy(**ARGS, n_min=10, model=model, evaluate_fn="loss", progress=None)


class Mixing(torch.nn.Module):
    def __init__(self, in_features: int = 3, out_features: int = 1) -> None:
        super().__init__()
        self.fc, self.norm = torch.nn.Linear(in_features,
                                             out_features), torch.nn.BatchNorm1d(out_features)

    def forward(self, x):
        return self.norm(self.fc(x))


def make_mixing(*, in_features: int, out_features: int) -> torch.nn.Module:
    return Mixing(in_features, out_features)


BATCH_NORM = r"Module 'norm' \(BatchNorm1d\) mixes samples within a batch.*GroupNorm or LayerNorm"


def test_client_argument_errors_name_the_argument():
    x, y = torch.zeros(5, 3), torch.zeros(5)
    model = TanhMLP(in_features=3, out_features=1)
    ok = dict(model=model, loss=half_squared_error, data=(x, y), partition_id=0)
    cases = [
        ({"dtype": "float16"},
         r"diff2_flwr.make_client: argument `dtype`: expected one of 'auto', 'float64', "
         r"'float32'. Found 'float16'."),
        ({"chunk_size": 0}, r"argument `chunk_size`: expected an integer >= 1, or auto. Found 0."),
        ({"memory_budget_mb": 0},
         r"argument `memory_budget_mb`: expected a number of MiB > 0, or auto. Found 0."),
        ({"memory_budget_mb": "lots"},
         r"argument `memory_budget_mb`: expected a number or 'auto'. Found 'lots'."),
        ({"gradients": "closed_form"},
         r"argument `gradients`: expected 'auto' or 'torch_func' unless the model is "
                                       r"the paper MLP"),
        ({"partition_id": -1}, r"argument `partition_id`: expected an integer >= 0. Found -1."),
        ({"loss": "mse"}, r"argument `loss`: expected a callable .* or one of \['cross_entropy', "
                          r"'half_squared_error'\]. Found 'mse'."),
        ({"model": "mlp"}, r"argument `model`: expected a torch.nn.Module. Found 'str'."),
        ({"data": DataLoader(TensorDataset(x, y), batch_size=2)},
         r"`data` is a DataLoader; pass its dataset"),
        ({"data": (x, y[:4])}, r"one target per record. Found 5 feature rows and 4 targets"),
        ({"data": [1, 2, 3]}, r"`data` must be a pair \(features, targets\)"),
        ({"data": (x[:0], y[:0])}, r"Partition 0 holds no samples"),
        ({"model": Mixing()}, BATCH_NORM),
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            diff2_flwr.make_client(**{**ok, **change})

    class Stream(IterableDataset):
        def __iter__(self):
            yield from zip(x, y)

    with pytest.raises(ValueError, match=r"Stream without a length: a worker must know n_p"):
        diff2_flwr.make_client(**{**ok, "data": Stream()})


def test_a_loss_that_cannot_take_float_class_labels_fails_at_once_naming_the_fix():
    """Issue 21: float labels (0.0, 1.0) with one's own cross-entropy failed in every round with
    `gather(): Expected dtype int32/int64 for index` (1,460 log lines); now make_client refuses in
    one line and says what to do."""
    x = torch.randn(6, 3, dtype=torch.float64)
    labels = (x[:, 0] > 0).to(torch.float64)
    model = TanhMLP(in_features=3, out_features=2)

    def own(output, target):
        return torch.nn.functional.cross_entropy(output, target, reduction="none")

    with pytest.raises(ConfigError,
                       match=r"^diff2_flwr.make_client: argument `loss`: expected a loss that "
                             r"takes this client's targets \(floating-point targets arrive as "
                             r"torch.float32, .*y.astype\(int\), or convert in the loss with "
                             r"target.long\(\)\)\. Found 'RuntimeError: [^\n]*'\.$"):
        diff2_flwr.make_client(model=model, loss=own, data=(x, labels), partition_id=0)
    x0 = np.concatenate([p.detach().numpy().ravel() for p in model.parameters()]).astype(np.float64)
    for loss, targets in ((own, labels.long()), (cross_entropy, labels), ("cross_entropy", labels)):
        client = diff2_flwr.make_client(model=model, loss=loss, data=(x, targets), partition_id=0)
        assert np.isfinite(client.worker.contribute(1.0, x0, None).mean).all()


def test_the_clients_model_is_copied_not_changed():
    model = TanhMLP(in_features=3, out_features=1)  # float32
    before = [p.detach().clone() for p in model.parameters()]
    client = diff2_flwr.make_client(model=model, loss=half_squared_error, data=(torch.zeros(4, 3),
                                                                                torch.zeros(4)),
                                    partition_id=0, dtype="float64")
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert client.worker.gradients.model is not model


# ------------------------------------------------------------------------------ Dataset records, in
# chunks

class Logged(Dataset):
    """A map-style dataset that counts how often each record is read."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y, self.reads = x, y, np.zeros(len(y), dtype=int)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        self.reads[i] += 1
        return self.x[i], self.y[i]


@pytest.mark.parametrize("model_kind", ["tanh-torch_func", "paper_mlp-closed_form", "classifier"])
def test_a_dataset_read_in_chunks_equals_the_tensors(model_kind):
    g = torch.Generator().manual_seed(1)
    n, d = 53, 4
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    if model_kind == "classifier":
        model, loss = TanhMLP(in_features=d, out_features=3), cross_entropy
        y = torch.randint(0, 3, (n,), generator=g)  # integer class indices stay integers
    else:
        model = TanhMLP(in_features=d,
                        out_features=1) if model_kind.startswith("tanh") else PaperMLP(d)
        loss, y = half_squared_error, torch.randn(n, generator=g, dtype=torch.float64)
    dataset = Logged(x, y)
    chunked = diff2_flwr.make_client(model=model, loss=loss, data=dataset, partition_id=0,
                                     chunk_size=7)
    whole = diff2_flwr.make_client(model=model, loss=loss, data=(x, y), partition_id=0,
                                   chunk_size=7)
    assert chunked.worker.num_samples == n
    assert [int(c[0].shape[0]) for c in chunked.worker.records.chunks()] == [7] * 7 + [4]
    layout = whole.worker.gradients.layout
    x_cur = layout.flatten([p.detach().double().numpy() for p in model.parameters()])
    x_prev = x_cur + 0.05 * np.random.default_rng(0).standard_normal(x_cur.shape)
    dataset.reads[:] = 0
    for radius, previous in ((0.3, None), (0.02, x_prev)):
        a = chunked.worker.contribute(radius, x_cur, previous)
        b = whole.worker.contribute(radius, x_cur, previous)
        assert a.num_samples == b.num_samples == n and a.num_clipped == b.num_clipped
        # the closed form sums whole shards: equal up to rounding
        if model_kind == "paper_mlp-closed_form":
            assert isinstance(chunked.worker.gradients, PaperMLPGradients)
            np.testing.assert_allclose(a.mean, b.mean, rtol=1e-12, atol=1e-15)
        else:
            np.testing.assert_array_equal(a.mean, b.mean)
    assert np.all(dataset.reads == 2)  # every record once per round, never more


def test_a_dataset_whose_length_lies_fails_the_reply():
    class Short(TensorDataset):
        def __len__(self):
            return super().__len__() + 1

        def __getitem__(self, i):
            if i >= self.tensors[0].shape[0]:
                raise IndexError(i)
            return super().__getitem__(i)

    x, y = torch.randn(10, 2, dtype=torch.float64), torch.randn(10, dtype=torch.float64)
    client = diff2_flwr.make_client(model=TanhMLP(in_features=2, out_features=1),
                                    loss=half_squared_error, data=Short(x, y), partition_id=0,
                                    chunk_size=4)
    params = client.worker.gradients.model.parameters()
    x0 = client.worker.gradients.layout.flatten([p.detach().double().numpy() for p in params])
    with pytest.raises(IndexError):
        client.worker.contribute(1.0, x0, None)
    records = DatasetRecords(TensorDataset(x, y), torch.float64, 4)
    assert sum(int(c[0].shape[0]) for c in records.chunks()) == 10


# ------------------------------------------------------------------------------ models from YAML

def test_a_factory_model_from_yaml_runs_privately_and_learns():
    cfg = yaml_config({"name": "diff2_flwr.task.models:TanhMLP", "kwargs": {"hidden": 8}},
                      rounds=12, restart_every=4, learning_rate=0.5)
    assert not cfg.closed_form_gradients
    server = run_inprocess(cfg, record=False, progress=None)
    assert server.done and server.epsilon_spent == pytest.approx(3.0, rel=1e-9)
    assert server.history[-1]["test_loss"] < server.history[0]["test_loss"]
    assert server.layout.names[0] == "layers.0.weight" and server.layout.shapes[2] == (8, 8)


def test_a_factory_model_is_reproducible_from_init_seed_and_leaves_the_global_generator_alone():
    def x0(seed):
        m = build_model("diff2_flwr.task.models:TanhMLP", in_features=5, out_features=2,
                        init_seed=seed, kwargs={"hidden": 4})
        return torch.cat([p.detach().reshape(-1) for p in m.parameters()])

    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    first = x0(1)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert first.dtype == torch.float64 and torch.equal(first, x0(1)) and not torch.equal(first,
                                                                                          x0(2))


def test_a_factory_model_with_batch_norm_is_refused(tmp_path):
    cfg = yaml_config({"name": "test_api:make_mixing"})
    with pytest.raises(ValueError, match=BATCH_NORM):
        run_inprocess(cfg, record=False, progress=None)


@pytest.mark.parametrize("model,message", [
    ({"name": "no_such_package.models:make"},
     r"key `model.name`: cannot import module 'no_such_package.models' of the model factory .*put "
     r"the module in the app's custom/ folder"),
    ({"name": "diff2_flwr.task.models:Nope"},
     r"key `model.name`: module 'diff2_flwr.task.models' has no attribute "
                                              r"'Nope'"),
    ({"name": "diff2_flwr.task.models:__doc__"}, r"key `model.name`: .* is a str, not a callable"),
    ({"name": "diff2_flwr.task.models:TanhMLP", "kwargs": {"width": 3}},
     r"key `model.kwargs`: the model factory .* is called as factory\(in_features=..., "
     r"out_features=..., \*\*model.kwargs\) with \['in_features', 'out_features', 'width'\]"),
    ({"name": "diff2_flwr.task.losses:get_loss"}, r"key `model.kwargs`: the model factory"),
])
def test_a_bad_factory_says_which_key_what_was_tried_and_what_to_do(model, message):
    with pytest.raises((ValueError, TypeError), match=message):
        run_inprocess(yaml_config(model), record=False, progress=None)


@pytest.mark.parametrize("model,message", [
    ({"name": "mlp"},
     r"key `model.name`: expected 'paper_mlp' or a model factory as an import path "
                      r"'package.module:callable'. Found 'mlp'."),
    ({"name": "diff2_flwr.task.models:TanhMLP", "hidden": 4},
     r"key `model.hidden`: expected nothing for a model "
                                                               r"factory"),
    ({"kwargs": {"hidden": 4}}, r"key `model.kwargs`: expected nothing for model paper_mlp"),
    ({"name": "a.b:c", "kwargs": {"in_features": 4}},
     r"key `model.kwargs`: expected no in_features"),
    ({"name": "a.b:c", "kwargs": [1]},
     r"key `model.kwargs`: expected a mapping of names to values. Found \[1\]."),
    ({"name": "a.b:c"}, None),
])
def test_model_keys_are_checked_when_the_file_is_read(model, message):
    data = {"model": model, "training": {"restart_every": 2, "rounds": 4}}
    if message is None:
        cfg = parse_config({**data, "training": {**data["training"], "gradients": "auto"}})
        with pytest.raises(ConfigError,
                           match=r"key `training.gradients`: expected 'auto' or 'torch_func' "
                                 r"unless"):
            parse_config({**data, "training": {**data["training"], "gradients": "closed_form"}},
                         "exp.yaml")
        assert not cfg.closed_form_gradients
        return
    with pytest.raises(ConfigError, match=message):
        parse_config(data, "exp.yaml")


def test_factory_kwargs_round_trip_and_keep_the_config_hashable():
    cfg = parse_config({"model": {"name": "pkg.mod:make", "kwargs": {"layers": [8, 4],
                                                                     "act": {"name": "tanh"}}},
                        "training": {"restart_every": 2}})
    assert cfg.model.kwargs.as_dict() == {"act": {"name": "tanh"}, "layers": [8, 4]}
    assert parse_config(cfg.to_dict()) == cfg and hash(cfg) == hash(parse_config(cfg.to_dict()))
    assert cfg.to_dict()["model"]["kwargs"] == {"act": {"name": "tanh"}, "layers": [8, 4]}


# ------------------------------------------------------------------------------ the tutorial's
# example

#: The tutorial that shows the Python API (it was the README's "Python API" section).
TUTORIAL = ROOT / "docs" / "tutorials" / "own-model-and-data.md"


def load_example():
    spec = importlib.util.spec_from_file_location("python_api_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_docs_quote_the_tested_example():
    page = TUTORIAL.read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, flags=re.S)
    assert EXAMPLE.read_text() in blocks, (f"{TUTORIAL.relative_to(ROOT)} must quote "
                                           f"examples/python_api.py verbatim")


def _tutorial_signatures() -> dict[str, list[tuple[str, object]]]:
    """The tutorial's ``diff2_flwr.make_*(...) -> T`` lines, parsed as Python: name -> [(parameter,
    default)]."""
    import ast

    page = TUTORIAL.read_text()
    found = {}
    for name, params in re.findall(r"diff2_flwr\.(make_\w+)\((\*,.*?)\) ->", page, flags=re.S):
        (fn,) = ast.parse(f"def {name}({params}): pass").body
        defaults = [None] * (len(fn.args.kwonlyargs) - len(
            fn.args.kw_defaults)) + fn.args.kw_defaults
        found[name] = [(a.arg, inspect.Parameter.empty if d is None else
                        d.id if isinstance(d, ast.Name) else ast.literal_eval(d))
                       for a, d in zip(fn.args.kwonlyargs, defaults)]
    return found


def test_the_tutorials_signatures_are_the_functions():
    """Every keyword argument of make_strategy and make_client, in order, with its default (a name
    such as ``print`` by its name), as the tutorial lists them."""
    listed = _tutorial_signatures()
    assert set(listed) == {"make_strategy", "make_client"}
    for name, params in listed.items():
        signature = inspect.signature(getattr(diff2_flwr, name)).parameters.values()
        actual = [(p.name,
                   p.default.__name__ if callable(p.default) and p.default is not p.empty
                   else p.default)
                  for p in signature]
        assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in signature)
        assert params == actual, (f"{TUTORIAL.relative_to(ROOT)}'s {name} signature differs from "
                                  f"the function's")


def test_the_example_runs_through_its_server_fn_and_client_fn():
    example = load_example()
    lines = []
    components = example.server_fn(SimpleNamespace(run_config={}, node_config={}))
    strategy = components.strategy
    strategy.server.progress = lines.append
    assert components.config.num_rounds == strategy.num_rounds == 20
    clients = [example.client_fn(SimpleNamespace(node_config={"partition-id": p}))
               for p in range(example.CLIENTS)]
    drive(strategy, clients)
    rows = strategy.server.history
    assert strategy.server.done and rows[-1]["round"] == 20
    assert rows[-1]["test_loss"] < 0.5 * rows[0]["test_loss"]
    assert strategy.server.epsilon_spent == pytest.approx(3.0, rel=1e-9)
    assert lines[-1].startswith("[diff2] round 20/20 (difference)")
    # what `python examples/python_api.py` prints last: the summary of the run server_fn built
    assert example.STRATEGIES == [strategy]
    assert example.summary_line(strategy) == (
        "[diff2] run completed: 20/20 rounds, ε spent 3 of 3 (δ = 1e-05), "
        f"test_loss {rows[0]['test_loss']:.4g} (x_0) -> {rows[-1]['test_loss']:.4g} (last "
        f"released)")


@pytest.mark.flower
def test_the_example_runs_as_a_flower_simulation():
    out = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True,
                         timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout + out.stderr
    assert "[diff2] round 20/20 (difference)" in text and "epsilon_spent=3 " in text
    assert any(line.startswith(
        "[diff2] run completed: 20/20 rounds, ε spent 3 of 3 (δ = 1e-05), test_loss ")
               for line in out.stdout.splitlines()), out.stdout[-3000:]


def test_the_api_is_loaded_lazily_at_the_package_top():
    code = ("import sys, diff2_flwr; before = 'torch' in sys.modules or 'flwr' in sys.modules; "
            "f = diff2_flwr.make_strategy; print(before, 'flwr' in sys.modules, f.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["False", "True", "diff2_flwr.api"]
    assert {"make_strategy", "make_client"} <= set(dir(diff2_flwr))
    with pytest.raises(AttributeError, match="has no attribute 'make_model'"):
        diff2_flwr.make_model  # noqa: B018


def test_make_strategy_takes_the_local_routine_and_checks_its_arguments():
    """``local_*`` reach the server: the calibration covers the local steps and each DIFF2 round is
    two Flower rounds; a bad value is refused naming the argument."""
    model = PaperMLP(3, hidden=4)
    strategy = diff2_flwr.make_strategy(**ARGS, n_min=50, model=model, seed=1, progress=None,
                                        local_steps=3, local_batch_size=10, local_share=0.3)
    cal = strategy.server.calibration
    assert strategy.server.local is not None and strategy.server.local.steps == 3
    assert cal.local is not None and cal.local.sampling_prob == 10 / 50 and cal.local.share == 0.3
    assert strategy.num_rounds == 2 * ARGS["rounds"]
    with pytest.raises(ConfigError, match="local_steps"):
        diff2_flwr.make_strategy(**ARGS, n_min=50, model=model, progress=None, local_steps=1)
    with pytest.raises(ValueError, match="local_batch_size"):
        diff2_flwr.make_strategy(**ARGS, n_min=50, model=model, progress=None, local_steps=3,
                                 local_batch_size=60)


def test_make_strategy_releases_clip_statistics_only_when_asked_and_warns():
    """Off by default (not covered by ε); ``clip_stats=True`` puts clip_fraction in the history with
    a warning; a non-bool is refused with the YAML key's message, named as the caller wrote it."""
    data = load_data(yaml_config())
    model = lambda: PaperMLP(data.num_features, 10).double()  # noqa: E731
    clients = [diff2_flwr.make_client(model=model(), loss=half_squared_error, data=data.shard(p),
                                      partition_id=p)
               for p in range(3)]
    for clip_stats in (False, True):
        lines: list[str] = []
        strategy = diff2_flwr.make_strategy(**ARGS, n_min=data.n_min, seed=7, model=model(),
                                            clip_stats=clip_stats, progress=lines.append)
        drive(strategy, clients)
        history = strategy.server.history[1:]
        assert all(("clip_fraction" in row) is clip_stats for row in history)
        assert any("WARNING: evaluation.clip_stats is on" in line for line in lines) is clip_stats
        assert any("clip_fraction=" in line for line in lines) is clip_stats
    with pytest.raises(ConfigError,
                       match=r"^diff2_flwr.make_strategy: argument `clip_stats`: expected "
                             r"true/false. Found 'yes'\.$"):
        diff2_flwr.make_strategy(**ARGS, n_min=10, model=model(), clip_stats="yes", progress=None)


def test_client_sampling_through_the_api_refuses_as_the_file_does():
    """make_strategy's sampling arguments build the sampled server (its calibration for the
    cohort), and refuse a bad value naming the argument, as `training.sampling.*` is refused."""
    model = TanhMLP(in_features=2, out_features=1)
    strategy = diff2_flwr.make_strategy(**{**ARGS, "clients": 4}, n_min=10, model=model,
                                        sampling="fixed", sampling_size=2, progress=None)
    server = strategy.server
    assert server.spec.sampling == Sampling("fixed", size=2)
    assert server.calibration.sampling_prob == 0.5
    assert len(server.cohort()) == 2
    with pytest.raises(ConfigError, match=r"argument `sampling_rate`: expected a number in \(0, "
                                          r"1\] with kind poisson"):
        diff2_flwr.make_strategy(**ARGS, n_min=10, model=model, sampling="poisson",
                                 sampling_rate=1.5, progress=None)
    with pytest.raises(ConfigError, match=r"argument `sampling_size`: expected at most the P"):
        diff2_flwr.make_strategy(**{**ARGS, "clients": 4}, n_min=10, model=model,
                                 sampling="fixed", sampling_size=5, progress=None)
    # make_client's client tells a sampling strategy its partition, and nothing else
    x = np.random.default_rng(0).normal(size=(12, 2))
    client = diff2_flwr.make_client(model=model, loss=half_squared_error, data=(x, x[:, :1]),
                                    partition_id=3)
    assert client.get_properties(protocol.PARTITION_QUERY) == {protocol.PARTITION_KEY: 3}
    assert client.get_properties({}) == {}
