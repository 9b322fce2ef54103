"""Per-sample gradients (torch.func) against an obviously-correct one-sample-at-a-time loop."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from diff2_flwr.core.gradients import PerSampleGradients
from diff2_flwr.core.layout import ParameterLayout
from diff2_flwr.task.losses import half_squared_error
from diff2_flwr.task.models import PaperMLP, build_model


def make(n=37, features=6, seed=0, dtype=torch.float64, chunk_size=8):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=gen, dtype=torch.float64)
    y = torch.randn(n, generator=gen, dtype=torch.float64)
    model = build_model("paper_mlp", in_features=features, out_features=1, hidden=10,
                        init_seed=seed)
    psg = PerSampleGradients(model, half_squared_error, dtype=dtype, chunk_size=chunk_size)
    x0 = np.concatenate([p.detach().reshape(-1).numpy() for p in model.parameters()])
    return psg, x.to(dtype), y.to(dtype), x0


def loop_gradients(psg: PerSampleGradients, x_vec: np.ndarray, x: torch.Tensor,
                   y: torch.Tensor) -> torch.Tensor:
    """One backward pass per sample through a fresh copy of the model: the slow obvious way."""
    layout = psg.layout
    rows = []
    for i in range(x.shape[0]):
        model = PaperMLP(x.shape[1], 10).to(x.dtype)
        with torch.no_grad():
            for p, a in zip(model.parameters(), layout.split(x_vec)):
                p.copy_(torch.as_tensor(a, dtype=x.dtype))
        loss = half_squared_error(model(x[i:i + 1]), y[i:i + 1]).sum()
        grads = torch.autograd.grad(loss, list(model.parameters()))
        rows.append(torch.cat([g.reshape(-1) for g in grads]))
    return torch.stack(rows)


def test_per_sample_gradients_equal_a_loop():
    psg, x, y, x0 = make()
    torch.testing.assert_close(psg.per_sample(x0, x, y), loop_gradients(psg, x0, x, y), rtol=1e-12,
                               atol=1e-14)


def clipped_mean_loop(rows: torch.Tensor, radius: float) -> np.ndarray:
    out = torch.zeros(rows.shape[1], dtype=torch.float64)
    for row in rows.double():
        norm = float(torch.linalg.vector_norm(row))
        out += row * min(1.0, radius / norm) if norm > 0 else row
    return (out / rows.shape[0]).numpy()


@pytest.mark.parametrize("radius", [0.05, 0.3, math.inf])
def test_clipped_mean_of_gradients_and_of_differences_equal_a_loop(radius):
    psg, x, y, x0 = make()
    x1 = x0 + 0.1 * np.random.default_rng(1).standard_normal(x0.size)
    restart = psg.clipped_mean(x0, x, y, radius)
    np.testing.assert_allclose(restart.mean, clipped_mean_loop(loop_gradients(psg, x0, x, y),
                                                               radius), rtol=1e-11, atol=1e-14)
    diffs = loop_gradients(psg, x1, x, y) - loop_gradients(psg, x0, x, y)
    difference = psg.clipped_mean(x1, x, y, radius, x_previous=x0)
    np.testing.assert_allclose(difference.mean, clipped_mean_loop(diffs, radius), rtol=1e-11,
                               atol=1e-14)
    expected_clipped = int((torch.linalg.vector_norm(diffs, dim=1) > radius).sum())
    assert difference.num_clipped == expected_clipped and difference.num_samples == 37
    if radius < math.inf:
        assert 0 < restart.num_clipped <= 37


def test_chunk_size_does_not_change_the_result():
    a = make(chunk_size=1)
    b = make(chunk_size=1000)
    np.testing.assert_allclose(a[0].clipped_mean(a[3], a[1], a[2], 0.2).mean,
                               b[0].clipped_mean(b[3], b[1], b[2], 0.2).mean, rtol=1e-12,
                               atol=1e-15)


def test_float32_compute_still_respects_the_radius_in_float64():
    psg, x, y, x0 = make(dtype=torch.float32, n=500, chunk_size=64)
    c = psg.clipped_mean(x0, x, y, 1e-3)
    assert c.mean.dtype == np.float64
    assert np.linalg.norm(c.mean) <= 1e-3 * (1 + 1e-12)


def test_full_loss_and_gradient_is_the_mean_of_per_sample_ones():
    psg, x, y, x0 = make()
    loss, grad = psg.loss_and_gradient(x0, x, y)
    np.testing.assert_allclose(grad, psg.per_sample(x0, x, y).mean(0).numpy(), rtol=1e-12,
                               atol=1e-15)
    assert loss == pytest.approx(psg.mean_loss(x0, x, y), rel=1e-14)


def test_batch_norm_is_refused_with_an_explanation():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    with pytest.raises(ValueError, match="BatchNorm1d.*per-sample gradients.*GroupNorm"):
        PerSampleGradients(model, half_squared_error)


def test_works_for_a_generic_module_with_layer_norm():
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Tanh(), nn.Linear(4, 1)).double()
    psg = PerSampleGradients(model, half_squared_error, chunk_size=4)
    x = torch.randn(9, 3, dtype=torch.float64)
    y = torch.randn(9, dtype=torch.float64)
    x0 = np.concatenate([p.detach().reshape(-1).numpy() for p in model.parameters()])
    rows = psg.per_sample(x0, x, y)
    for i in (0, 8):
        model.zero_grad()
        half_squared_error(model(x[i:i + 1]), y[i:i + 1]).sum().backward()
        expected = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        torch.testing.assert_close(rows[i], expected, rtol=1e-12, atol=1e-14)


def test_paper_mlp_initialisation_is_uniform_in_plus_minus_one_over_sqrt_fan_in():
    model = PaperMLP(8, 10, init_seed=3)
    assert ParameterLayout.of(model).dim == 8 * 10 + 10 + 10 + 1
    for layer in (model.hidden, model.out):
        bound = 1 / math.sqrt(layer.in_features)
        for p in (layer.weight, layer.bias):
            assert float(p.detach().abs().max()) <= bound
    # deterministic by seed, different across seeds
    assert torch.equal(PaperMLP(8, init_seed=3).hidden.weight, model.hidden.weight)
    assert not torch.equal(PaperMLP(8, init_seed=4).hidden.weight, model.hidden.weight)
    # spread over the whole interval (not e.g. PyTorch's default, which is ±1/sqrt(fan_in) too but
    # seeded differently)
    w = PaperMLP(1000, 10, init_seed=0).hidden.weight
    w = w.detach()
    assert float(w.max()) > 0.9 / math.sqrt(1000) and float(w.min()) < -0.9 / math.sqrt(1000)


def test_empty_shard_is_refused():
    psg, x, y, x0 = make()
    with pytest.raises(ValueError, match="empty"):
        psg.clipped_mean(x0, x[:0], y[:0], 1.0)


@pytest.mark.parametrize("radius", [0.0, 1e-3, 0.05, 0.3, math.inf])
@pytest.mark.parametrize("difference", [False, True])
def test_closed_form_path_equals_the_generic_torch_func_path(radius, difference):
    from diff2_flwr.core.closed_form import PaperMLPGradients

    psg, x, y, x0 = make(n=301, features=8, seed=4, chunk_size=64)
    # larger targets and a far second iterate so that some rows clip and some do not
    y = y * 3
    x1 = x0 + 0.2 * np.random.default_rng(5).standard_normal(x0.size)
    fast = PaperMLPGradients(psg.layout)
    args = (x1, x, y, radius, x0) if difference else (x0, x, y, radius)
    slow_c, fast_c = psg.clipped_mean(*args), fast.clipped_mean(*args)
    np.testing.assert_allclose(fast_c.mean, slow_c.mean, rtol=1e-11, atol=1e-15)
    assert fast_c.num_clipped == slow_c.num_clipped and fast_c.num_samples == slow_c.num_samples
    if radius < math.inf:
        assert np.linalg.norm(fast_c.mean) <= radius * (1 + 1e-12)


def test_closed_form_matches_softplus_in_its_linear_region():
    """Pre-activations above torch's softplus threshold (20): both paths must use derivative 1
    there."""
    from diff2_flwr.core.closed_form import PaperMLPGradients

    psg, x, y, x0 = make(n=50, features=8, seed=2)
    x_big = x0.copy()
    x_big[80:90] += 30.0  # hidden biases: pre-activations ~30
    fast = PaperMLPGradients(psg.layout)
    np.testing.assert_allclose(fast.clipped_mean(x_big, x, y, math.inf).mean,
                               psg.clipped_mean(x_big, x, y, math.inf).mean, rtol=1e-12, atol=1e-14)


def test_closed_form_refuses_another_layout():
    from diff2_flwr.core.closed_form import PaperMLPGradients

    with pytest.raises(ValueError, match="paper MLP layout"):
        PaperMLPGradients(ParameterLayout(("w",), ((3, 4),)))
