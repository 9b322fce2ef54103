"""Issue 40, item 1: the Python API checks what the YAML path checks, when it is called.

The three mistakes a new user made through the API ran into Flower before anything refused them: a
BatchNorm model (refused only inside the ClientApp at round 1), ε = 0.01 (ran to `completed` with a
test loss of 9.3e10) and float labels 0.5/1.5 with ``loss="cross_entropy"`` (silently truncated to
classes 0 and 1). Each is now refused by the call itself, in one line that names the argument, in
well under the 5 s the issue allows; and no label is ever cast to another class.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

import diff2_flwr
from diff2_flwr.runtime.config import ConfigError
from diff2_flwr.task.losses import class_label_problem

STRATEGY = dict(epsilon=3.0, delta=1e-5, rounds=20, restart_every=5, clients=3, n_min=400,
                clip_restart=1.0, clip_diff=3.0, learning_rate=0.5)


def _model(batch_norm: bool = False, outputs: int = 1) -> torch.nn.Module:
    layers = [torch.nn.Linear(8, 16), *([torch.nn.BatchNorm1d(16)] if batch_norm else []),
              torch.nn.Tanh(), torch.nn.Linear(16, outputs)]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return torch.nn.Sequential(*layers).double()


def _refused(call, **kwargs) -> str:
    """The one-line message of the ConfigError ``call(**kwargs)`` raises, checked to come fast."""
    started = time.perf_counter()
    with pytest.raises(ConfigError) as caught:
        call(**kwargs)
    assert time.perf_counter() - started < 5.0
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_a_batch_norm_model_is_refused_by_make_strategy():
    message = _refused(diff2_flwr.make_strategy, **STRATEGY, model=_model(batch_norm=True),
                       progress=None)
    assert message.startswith("diff2_flwr.make_strategy: argument `model`: expected a model whose "
                              "samples do not mix within a batch (no batch-norm).")
    assert "BatchNorm1d" in message and "GroupNorm or LayerNorm" in message


def test_a_batch_norm_model_is_refused_by_make_client():
    x, y = torch.randn(20, 8, dtype=torch.float64), torch.randn(20, dtype=torch.float64)
    message = _refused(diff2_flwr.make_client, model=_model(batch_norm=True),
                       loss="half_squared_error", data=(x, y), partition_id=0)
    assert message.startswith("diff2_flwr.make_client: argument `model`: expected a model whose "
                              "samples do not mix")


def test_a_budget_whose_noise_exceeds_the_clipping_radius_is_refused_by_make_strategy():
    message = _refused(diff2_flwr.make_strategy, **{**STRATEGY, "epsilon": 0.01}, model=_model(),
                       progress=None)
    assert message.startswith("diff2_flwr.make_strategy: epsilon = 0.01 (delta = 1e-05, rounds = "
                              "20, restart_every = 5, clients = 3, n_min = 400) gives σ1 = ")
    assert "above 1, each coordinate's noise would exceed the clipping radius" in message
    assert "Raise epsilon or n_min" in message and "pass max_sigma=None" in message
    # ε = 3 passes, and says its noise estimate before any round
    said: list[str] = []
    diff2_flwr.make_strategy(**STRATEGY, model=_model(), progress=said.append)
    estimate = [line for line in said if line.startswith("[diff2] pre-flight: expected noise")]
    assert len(estimate) == 1 and "d = 161 parameters" in estimate[0]


def test_the_noise_estimate_warns_on_the_api_path_when_the_noise_drowns_the_signal():
    said: list[str] = []
    # σ below 1 per coordinate, but over d = 161 coordinates the noise norm is several radii
    diff2_flwr.make_strategy(**{**STRATEGY, "epsilon": 0.3}, model=_model(), progress=said.append)
    assert any(line.startswith("[diff2] WARNING: the noise drowns the signal") for line in said)


@pytest.mark.parametrize("labels,found", [
    ([0.5, 1.5], "target 0.5 of record 0, which is not a whole number"),
    ([0.0, 1.5], "target 1.5 of record 1, which is not a whole number"),
    ([0, 3], "target 3 of record 1, outside 0..2 (the model has 3 outputs, one per class)"),
    ([0.0, -1.0], "target -1.0 of record 1, outside 0..2"),
    ([0.0, float("nan")], "target nan of record 1, which is not a whole number"),
])
@pytest.mark.parametrize("as_dataset", [False, True])
def test_labels_a_cross_entropy_loss_cannot_take_are_refused_not_truncated(labels, found,
                                                                           as_dataset):
    x = torch.randn(40, 8, dtype=torch.float64)
    y = torch.tensor(labels * 20)
    data = TensorDataset(x, y) if as_dataset else (x, y)
    message = _refused(diff2_flwr.make_client, model=_model(outputs=3), loss="cross_entropy",
                       data=data, partition_id=2)
    assert message.startswith("diff2_flwr.make_client: argument `data`: expected class labels for "
                              "loss 'cross_entropy' (partition 2): whole numbers in 0..2")
    assert found in message


def test_a_bad_label_in_a_later_chunk_of_a_dataset_stops_the_round():
    """A Dataset is read in chunks: the first is checked when the client is made, each of the
    others as a round reads it; the round then fails (nothing is released) with the same line."""
    x = torch.randn(40, 8, dtype=torch.float64)
    y = torch.cat([torch.zeros(30), torch.full((10,), 0.5)]).double()
    client = diff2_flwr.make_client(model=_model(outputs=3), loss="cross_entropy",
                                    data=TensorDataset(x, y), partition_id=0, chunk_size=16)
    x0 = np.concatenate([p.detach().numpy().ravel() for p in _model(outputs=3).parameters()])
    with pytest.raises(ConfigError, match=r"target 0.5 of record 30, which is not a whole number"):
        client.worker.contribute(1.0, x0, None)


def test_whole_number_float_labels_train_exactly_as_integer_labels():
    x = torch.randn(40, 8, dtype=torch.float64)
    labels = torch.arange(40) % 3
    x0 = np.concatenate([p.detach().numpy().ravel() for p in _model(outputs=3).parameters()])
    means = []
    for y in (labels, labels.double()):
        client = diff2_flwr.make_client(model=_model(outputs=3), loss="cross_entropy", data=(x, y),
                                        partition_id=0)
        means.append(client.worker.contribute(0.5, x0, None).mean)
    np.testing.assert_array_equal(means[0], means[1])


def test_class_label_problem_accepts_class_indices_only():
    assert class_label_problem(torch.tensor([0, 1, 2]), 3) is None
    assert class_label_problem(torch.tensor([0.0, 2.0]), 3) is None
    assert class_label_problem(torch.tensor([2.0, 2.5]), 3, first=10) == (
        "target 2.5 of record 11, which is not a whole number (a class label is an index, never a "
        "fraction)")
    assert class_label_problem(torch.tensor([[0, 1], [1, 4]]), 4) == (
        "target 4 of record 3, outside 0..3 (the model has 4 outputs, one per class)")


def test_a_client_holding_fewer_than_the_strategys_n_min_is_refused_when_given_n_min():
    x, y = torch.randn(30, 8, dtype=torch.float64), torch.randn(30, dtype=torch.float64)
    message = _refused(diff2_flwr.make_client, model=_model(), loss="half_squared_error",
                       data=(x, y), partition_id=4, n_min=40)
    assert message == (
        "diff2_flwr.make_client: argument `data`: expected at least n_min = 40 records (partition "
        "4): the noise is calibrated for clients holding n_min or more, and the server refuses a "
        "reply from fewer; lower the strategy's n_min to the smallest client's count. Found '30 "
        "records'.")
    assert diff2_flwr.make_client(model=_model(), loss="half_squared_error", data=(x, y),
                                  partition_id=4, n_min=30).worker.num_samples == 30
    assert "argument `n_min`" in _refused(diff2_flwr.make_client, model=_model(),
                                          loss="half_squared_error", data=(x, y), partition_id=4,
                                          n_min=0)


def test_max_sigma_none_lifts_the_limit_as_privacy_max_sigma_does_in_a_file():
    strategy = diff2_flwr.make_strategy(**{**STRATEGY, "epsilon": 0.01}, max_sigma=None,
                                        model=_model(), progress=None)
    assert strategy.server.calibration.sigma2 > 1
    message = _refused(diff2_flwr.make_strategy, **{**STRATEGY, "epsilon": 0.3}, max_sigma=0.1,
                       model=_model(), progress=None)
    assert "above 0.1, each coordinate's noise" in message


def test_a_diverged_iterate_is_advised_in_the_names_of_the_path_used():
    from diff2_flwr.runtime import server_core
    from diff2_flwr.runtime.config import parse_config
    from diff2_flwr.runtime.session import build_server

    strategy = diff2_flwr.make_strategy(**STRATEGY, model=_model(), progress=None)
    assert server_core._divergence_advice(strategy.server.spec) == (
        "Lower learning_rate= (or restart_every=: noise enlarges ||x_r - x_(r-1)|| and so the next "
        "noise).")
    cfg = parse_config({"name": "d", "method": "diff2", "dataset": {"name": "synthetic",
                                                                    "num_samples": 300},
                        "training": {"rounds": 4, "restart_every": 2, "clients": 3}}, "e.yaml")
    server = build_server(cfg, record=False, progress=None)
    assert server_core._divergence_advice(server.spec).startswith(
        "Lower training.learning_rate (or training.restart_every:")
