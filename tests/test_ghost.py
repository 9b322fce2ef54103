"""Ghost clipping for MLPs (core/ghost.py) against the generic torch.func path: per-sample norms of gradients
and of gradient differences, and clipped sums, for ½-squared error and cross-entropy (2 and more classes), MLPs
of one to three hidden layers, many runs at once."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from diff2_flwr.core.ghost import MLP, Pass, clipped_sums, forward, sq_norms
from diff2_flwr.core.clipping import clipped_sum
from diff2_flwr.core.gradients import PerSampleGradients
from diff2_flwr.task.losses import get_loss
from diff2_flwr.task.models import PaperMLP, TanhMLP, mlp_shape

F = 7


def _models(classes: int) -> dict[str, nn.Module]:
    torch.manual_seed(3)
    with torch.random.fork_rng():
        return {
            "paper": PaperMLP(F, 10, classes, init_seed=1).double(),
            "tanh2": TanhMLP(in_features=F, out_features=classes, hidden=6).double(),
            "deep3": nn.Sequential(nn.Linear(F, 9), nn.ReLU(), nn.Linear(9, 5), nn.Sigmoid(), nn.Linear(5, 4),
                                   nn.Softplus(), nn.Linear(4, classes)).double(),
        }


CASES = [(loss, classes, name) for loss, classes in (("half_squared_error", 1), ("cross_entropy", 2),
                                                      ("cross_entropy", 5))
         for name in ("paper", "tanh2", "deep3")]


def _data(n: int, classes: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = 1.5 * torch.randn(n, F, generator=gen, dtype=torch.float64)
    if classes == 1:
        y = 2 * torch.randn(n, generator=gen, dtype=torch.float64)
    else:
        y = torch.randint(0, classes, (n,), generator=gen).to(torch.float64)
    return x, y


def _setup(loss: str, classes: int, name: str, runs: int = 3, n: int = 60):
    model = _models(classes)[name]
    mlp = mlp_shape(model, loss)
    assert mlp is not None
    psg = PerSampleGradients(model, get_loss(loss), chunk_size=64)
    x0 = np.concatenate([p.detach().reshape(-1).numpy() for p in model.parameters()])
    rng = np.random.default_rng(7)
    # the runs' iterates, and previous iterates nearby (as in a difference round) or far
    xs = np.stack([x0 + 0.5 * rng.standard_normal(x0.size) for _ in range(runs)])
    prevs = np.stack([x + (0.01 if k % 2 else 0.3) * rng.standard_normal(x0.size) for k, x in enumerate(xs)])
    feats, y = _data(n, classes)
    return mlp, psg, xs, prevs, feats, y


def _pass(mlp, xs, feats, y) -> Pass:
    return forward(mlp, torch.as_tensor(xs), feats.T.contiguous(), y).to64()


@pytest.mark.parametrize("loss,classes,name", CASES)
def test_norms_and_clipped_means_equal_torch_func(loss, classes, name):
    """Per-sample losses and squared norms of gradients and of differences equal the torch.func path's; per client
    and run, Σ c ∇ℓ / n equals the torch.func path's ClippedMean (its per-sample rows clipped and
    summed by core.clipping, as PerSampleGradients.clipped_mean does, before the projection onto the ball), for
    gradients (restart) and differences, at radii that clip all, some and none of the rows; two clients of 30."""
    mlp, psg, xs, prevs, feats, y = _setup(loss, classes, name)
    P, N = 2, 30
    sq_a = (feats * feats).sum(1)
    cur, prev = _pass(mlp, xs, feats, y), _pass(mlp, prevs, feats, y)
    a_shared = feats.reshape(P, N, F)
    for previous in (None, prev):
        rows = [psg.per_sample(xs[k], feats, y) - (0 if previous is None else psg.per_sample(prevs[k], feats, y))
                for k in range(len(xs))]
        sq = sq_norms(cur, sq_a, previous)
        for k in range(len(xs)):  # relative to the norms' own size, not the gradients' (see the close-iterates test)
            torch.testing.assert_close(sq[k], (rows[k] * rows[k]).sum(1), rtol=1e-11, atol=0)
        norms = torch.sqrt(sq)
        some = float(norms.median())
        for radius in (0.0, 0.3 * some, some, math.inf):
            c = torch.ones_like(norms) if math.isinf(radius) else torch.where(
                norms > radius, radius / torch.where(norms > radius, norms, 1.0), 1.0)
            means = clipped_sums(cur, a_shared, c, previous) / N
            for k in range(len(xs)):
                for p in range(P):
                    ref = clipped_sum(rows[k][p * N:(p + 1) * N], radius).total.numpy() / N
                    scale = max(np.abs(ref).max(), 1e-300)
                    np.testing.assert_allclose(means[p, k].numpy(), ref, rtol=1e-10, atol=1e-12 * scale)
    for k in range(len(xs)):
        with torch.no_grad():
            out = psg.outputs(xs[k], feats)
        torch.testing.assert_close(cur.loss[k], get_loss(loss)(out, y), rtol=1e-13, atol=1e-15)
    # and the reference's own entry point, once
    ref = psg.clipped_mean(xs[1], feats[:N], y[:N], some, prevs[1]).mean
    c = torch.where(norms > some, some / torch.where(norms > some, norms, 1.0), 1.0)
    np.testing.assert_allclose((clipped_sums(cur, a_shared, c, prev) / N)[0, 1].numpy(), ref, rtol=1e-10,
                               atol=1e-12 * np.abs(ref).max())


def test_a_restarting_run_in_a_batch_of_differences_gets_its_plain_gradient_exactly():
    mlp, _, xs, prevs, feats, y = _setup("cross_entropy", 5, "deep3")
    sq_a = (feats * feats).sum(1)
    cur, prev = _pass(mlp, xs, feats, y), _pass(mlp, prevs, feats, y)
    mixed = prev.restarting(cur, torch.tensor([True, False, True]))
    c = torch.full((3, 60), 0.5, dtype=torch.float64)
    a_shared = feats.reshape(2, 30, F)
    plain, both = clipped_sums(cur, a_shared, c), clipped_sums(cur, a_shared, c, mixed)
    diff = clipped_sums(cur, a_shared, c, prev)
    for k in (0, 2):
        assert torch.equal(both[:, k], plain[:, k])
        assert torch.equal(sq_norms(cur, sq_a, mixed)[k], sq_norms(cur, sq_a)[k])
    assert torch.equal(both[:, 1], diff[:, 1]) and not torch.allclose(both[:, 1], plain[:, 1])


def test_difference_norms_keep_their_digits_when_the_iterates_are_close():
    """x' = x + 1e-7 · noise: the difference norms are ~1e-7 of the gradients' and must still agree to ~1e-8
    (the expanded form ‖a‖²‖g‖² + ‖a'‖²‖g'‖² - 2(ã·ã')(g·g') would keep almost none of their digits)."""
    mlp, psg, xs, _, feats, y = _setup("cross_entropy", 5, "tanh2")
    prevs = xs + 1e-7 * np.random.default_rng(9).standard_normal(xs.shape)
    sq_a = (feats * feats).sum(1)
    got = sq_norms(_pass(mlp, xs, feats, y), sq_a, _pass(mlp, prevs, feats, y))
    for k in range(len(xs)):
        rows = psg.per_sample(xs[k], feats, y) - psg.per_sample(prevs[k], feats, y)
        torch.testing.assert_close(got[k], (rows * rows).sum(1), rtol=1e-7, atol=0)


def test_mlp_shape_knows_only_mlps():
    assert mlp_shape(PaperMLP(F, 10, 1), "half_squared_error") == MLP((F, 10, 1), ("softplus",), "half_squared_error")
    assert mlp_shape(TanhMLP(in_features=F, out_features=3, hidden=4), "cross_entropy") == \
        MLP((F, 4, 4, 3), ("tanh", "tanh"), "cross_entropy")
    assert mlp_shape(PaperMLP(F, 10, 3), "half_squared_error") is None  # ½-squared error needs one output
    assert mlp_shape(PaperMLP(F, 10, 1), "cross_entropy") is None
    assert mlp_shape(nn.Sequential(nn.Linear(F, 3), nn.GELU(), nn.Linear(3, 2)), "cross_entropy") is None
    assert mlp_shape(nn.Sequential(nn.Linear(F, 3), nn.Softplus(beta=2), nn.Linear(3, 2)), "cross_entropy") is None
    assert mlp_shape(nn.Sequential(nn.Linear(F, 3), nn.Tanh()), "cross_entropy") is None
    assert mlp_shape(nn.Sequential(nn.Linear(F, 3, bias=False), nn.Tanh(), nn.Linear(3, 2)), "cross_entropy") is None
    assert mlp_shape(nn.Sequential(nn.Linear(F, 3), nn.LayerNorm(3), nn.Linear(3, 2)), "cross_entropy") is None

    class Residual(nn.Module):  # its forward is not a plain chain: never guessed from its parts
        def __init__(self):
            super().__init__()
            self.layers = nn.Sequential(nn.Linear(F, F), nn.Tanh(), nn.Linear(F, 2))

        def forward(self, x):
            return self.layers(x) + x[:, :2]

    assert mlp_shape(Residual(), "cross_entropy") is None


def test_mlp_refuses_bad_shapes():
    with pytest.raises(ValueError, match="needs 1 activation"):
        MLP((3, 4, 2), (), "cross_entropy")
    with pytest.raises(ValueError, match="Unknown activation"):
        MLP((3, 4, 2), ("gelu",), "cross_entropy")
    with pytest.raises(ValueError, match="one output"):
        MLP((3, 4, 2), ("tanh",), "half_squared_error")
    with pytest.raises(ValueError, match="Expected parameters of shape"):
        MLP((3, 4, 1), ("tanh",), "half_squared_error").layers(torch.zeros(2, 5))


def test_matmul_flops_count_the_products_of_a_round():
    # paper MLP 8 -> 10 -> 1: forward 8·10 + 10·1, backward 10·1, sums (8+1)·10 + (10+1)·1 (+ 10·1 in a difference round)
    mlp = MLP((8, 10, 1), ("softplus",), "half_squared_error")
    assert mlp.matmul_flops(100, difference=False) == 2 * 100 * (90 + 10 + 101)
    assert mlp.matmul_flops(100, difference=True) == 2 * 100 * (90 + 10 + 111)
    assert mlp.dim == 8 * 10 + 10 + 10 + 1
