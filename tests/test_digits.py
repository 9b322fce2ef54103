"""The digits example: scikit-learn's bundled 8×8 digits, the DigitsCNN, accuracy metrics, its
config and study."""

from __future__ import annotations

import builtins
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from diff2_flwr.core.gradients import PerSampleGradients
from diff2_flwr.lab.study.runner import ACCURACY, load_study, parse_study, run_study
from diff2_flwr.runtime.config import ConfigError, load_config, parse_config
from diff2_flwr.runtime.driver import run_inprocess
from diff2_flwr.runtime.session import load_data
from diff2_flwr.task.data import DataError, load_digits, prepare
from diff2_flwr.task.evaluation import Evaluator
from diff2_flwr.task.losses import get_loss
from diff2_flwr.task.models import DigitsCNN, build_model

ROOT = Path(__file__).resolve().parents[1]
CNN = "diff2_flwr.task.models:DigitsCNN"


def test_the_loader_gives_1797_images_of_64_pixels_in_0_1_and_10_classes():
    x, y, classes = load_digits()
    assert x.shape == (1797, 64) and y.shape == (1797,)
    assert classes == tuple("0123456789")
    # intensities 0..16, / 16
    assert x.min() == 0.0 and x.max() == 1.0 and np.all(x * 16 == np.round(x * 16))
    assert set(np.unique(y)) == set(range(10))


def test_digits_are_not_standardised_and_the_split_is_deterministic():
    cfg = parse_config({"method": "gd", "dataset": {"name": "digits"}, "training": {"clients": 3}})
    assert cfg.dataset.task_kind == "classification" and cfg.loss == "cross_entropy"
    data = load_data(cfg)
    assert data.task == "classification" and data.num_outputs == 10 and data.num_features == 64
    assert data.x_test.shape == (359, 64) and sum(data.shard_sizes) == 1438
    assert data.x_train.min() >= 0 and data.x_train.max() <= 1  # pixels / 16, no standardisation
    np.testing.assert_array_equal(data.feature_mean, np.zeros(64))
    x, y, classes = load_digits()
    again = prepare("digits", x, y, clients=3, classes=classes)
    np.testing.assert_array_equal(again.x_test, data.x_test)
    np.testing.assert_array_equal(again.y_train, data.y_train)
    other = prepare("digits", x, y, clients=3, classes=classes, split_seed=1)
    assert not np.array_equal(other.y_test, data.y_test)
    assert not np.allclose(prepare("digits", x, y, clients=3, classes=classes,
                                   standardise=True).x_train.std(0)[
        x.std(0) > 0], data.x_train.std(0)[x.std(0) > 0])


def test_a_missing_scikit_learn_names_the_extra(monkeypatch):
    real_import = builtins.__import__

    def no_sklearn(name, *args, **kwargs):
        if name.startswith("sklearn"):
            raise ImportError("No module named 'sklearn'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_sklearn)
    with pytest.raises(DataError, match=r"pip install 'diff2-flwr\[examples\]'"):
        load_digits()


class _Fixed(torch.nn.Module):
    """Outputs one-hot at a given class per record (the record's first feature), whatever the
    parameters."""

    def __init__(self, *, in_features: int, out_features: int) -> None:
        super().__init__()
        self.out_features = out_features
        self.scale = torch.nn.Parameter(torch.ones(1, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.one_hot(x[:, 0].long(),
                                           self.out_features).to(x.dtype) * self.scale


def test_accuracy_counts_the_records_whose_largest_output_is_the_true_class():
    grads = PerSampleGradients(_Fixed(in_features=2, out_features=3), get_loss("cross_entropy"))
    x = np.ones(1)  # the parameter `scale`
    # predictions 0, 1, 2, 2, 1
    predicted = np.array([[0, 0], [1, 0], [2, 0], [2, 0], [1, 0]], dtype=float)
    truth = np.array([0, 1, 0, 2, 2], dtype=float)  # 3 of 5 right on the test split
    # train: 2/2 and 1/3 right: pooled 3/5
    shards = [(predicted[:2], truth[:2]), (predicted[2:], truth[2:])]
    out = Evaluator(grads, shards=shards, test=(predicted, truth), classification=True)(x)
    assert out["test_accuracy"] == pytest.approx(3 / 5) and out["train_accuracy"] == pytest.approx(
        3 / 5)
    out = Evaluator(grads, shards=[], test=(predicted[:3], np.array([0, 1, 2.0])),
                    classification=True)(x)
    assert out == {"test_loss": pytest.approx(out["test_loss"]), "test_accuracy": 1.0}
    # regression: no accuracy
    assert "test_accuracy" not in Evaluator(grads, test=(predicted, truth))(x)


def test_digits_cnn_per_sample_gradients_equal_a_loop_and_it_is_accepted():
    model = build_model(CNN, in_features=64, out_features=10, kwargs={"channels": 3})
    assert not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    # refuses batch-norm; this one is accepted
    grads = PerSampleGradients(model, get_loss("cross_entropy"))
    x_vec = grads.layout.flatten([p.detach().numpy() for p in model.parameters()])
    rng = np.random.default_rng(0)
    features = torch.as_tensor(rng.uniform(0, 1, (5, 64)))
    targets = torch.as_tensor(rng.integers(0, 10, 5).astype(np.float64))
    batched = grads.per_sample(x_vec, features, targets)
    for i in range(5):
        model.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(features[i:i + 1]), targets[i:i + 1].long())
        loss.backward()
        loop = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        torch.testing.assert_close(batched[i], loop, rtol=1e-10, atol=1e-12)
    assert sum(p.numel() for p in DigitsCNN(in_features=64, out_features=10).parameters()) == 1370
    with pytest.raises(ValueError,
                       match="reads 8×8 images as rows of 64 pixels, but the data has 8 features"):
        DigitsCNN(in_features=8, out_features=10)


def test_a_short_in_process_digits_run_reports_accuracy(tmp_path):
    raw = yaml.safe_load((ROOT / "configs" / "digits.yaml").read_text())
    raw["training"].update(rounds=4, restart_every=2, seed=3)
    raw["output"] = {"dir": str(tmp_path)}
    server = run_inprocess(parse_config(raw, "digits-short"), progress=None)
    rows = [r for r in server.history if "test_loss" in r]
    assert [r["round"] for r in rows] == [0, 1, 2, 3, 4]
    assert all(0 <= r["test_accuracy"] <= 1 and 0 <= r["train_accuracy"] <= 1 for r in rows)
    summary = json.loads((server.recorder.directory / "summary.json").read_text())
    assert summary["status"] == "completed"
    accuracies = [r["test_accuracy"] for r in rows]
    assert summary["final"]["test_accuracy"] == accuracies[-1]
    assert summary["best"]["test_accuracy"] == max(accuracies)  # best accuracy is the largest
    # best loss the smallest
    assert summary["best"]["test_loss"] == min(r["test_loss"] for r in rows)
    assert summary["privacy"]["epsilon_spent"] == pytest.approx(3.0, rel=1e-6)


def test_the_digits_config_and_study_parse_and_the_study_reports_accuracy(tmp_path):
    cfg = load_config(ROOT / "configs" / "digits.yaml")
    assert cfg.dataset.partitioner.name == (
        "dirichlet") and cfg.model.name == CNN and cfg.method == "diff2"
    study = load_study(ROOT / "configs" / "digits_study.yaml")
    assert study.engine == "inprocess" and study.epsilons == (3.0,
                                                              8.0) and len(study.eval_seeds) >= 3
    assert not set(study.tune_seeds) & set(study.eval_seeds)
    assert {m.method for m in study.methods} == {"gd", "dpgd", "diff2"}
    raw = yaml.safe_load((ROOT / "configs" / "digits_study.yaml").read_text())
    raw.update(rounds=2, eval_every=1, epsilons=[3.0], seeds={"tune": [9], "evaluate": [1, 2]},
               analysis={"protocol": "paper"})
    raw["model"]["kwargs"] = {"channels": 2}
    raw["methods"] = [{"name": "DP-GD", "method": "dpgd", "grid": {"learning_rate": [1.0],
                                                                   "clip_restart": [1.0]}},
                      {"name": "DIFF2-GD", "method": "diff2",
                       "grid": {"restart_every": [2], "learning_rate": [1.0], "clip_restart": [1.0],
                                "clip_diff": [0.1]}}]
    summary = run_study(parse_study(raw, "tiny"), output_root=tmp_path, show_progress=False,
                        make_plots=False)
    eps = summary["epsilons"]["3.0"]
    for name in ("DP-GD", "DIFF2-GD"):
        acc = eps["methods"][name]["accuracy"]
        assert acc["at_point"] == "train_loss"
        assert acc["point"] == eps["methods"][name]["criteria"]["train_loss"]["point"]
        # the paper's protocol
        best, final = acc["at"]["best"]["per_seed"], acc["at"]["final"]["per_seed"]
        assert acc["best_mean"] == pytest.approx(np.mean(best)) and acc["reported"]["at"] == "best"
        assert all(b >= f for b, f in zip(best, final))
    test = eps["tests"]["DIFF2-GD vs DP-GD"][ACCURACY]
    assert 0 <= test["p_value"] <= 1 and test["df"] == 1
    assert "Test accuracy at the train-loss-best grid point" in (
        tmp_path / "digits" / "report.md").read_text()


def test_a_study_model_is_validated():
    base = {"name": "s", "dataset": {"name": "digits"}, "rounds": 2, "epsilons": [3.0],
            "seeds": {"tune": [1], "evaluate": [2]}, "analysis": {"protocol": "paper"},
            "methods": [{"name": "GD", "method": "gd", "grid": {"learning_rate": [1.0]}}]}
    with pytest.raises(ConfigError, match="key `model`"):
        parse_study({**base, "model": {"name": CNN, "width": 3}}, "s.yaml")
    with pytest.raises(ConfigError, match="key `hidden`"):
        parse_study({**base, "model": {"name": CNN}, "hidden": 4}, "s.yaml")
    assert math.isfinite(parse_study({**base, "model": {"name": CNN}}, "s.yaml").rounds)
