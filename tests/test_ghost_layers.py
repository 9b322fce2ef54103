"""Ghost clipping for common layers (issue 41, item 1) against the ``torch.func`` path, float64."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from diff2_flwr.core import ghost_layers, ghost_parts
from diff2_flwr.core.clipping import row_norms
from diff2_flwr.core.ghost_layers import GhostGradients, GhostUnsupported, supported_modules
from diff2_flwr.core.gradients import PerSampleGradients
from diff2_flwr.runtime.config import TrainingConfig
from diff2_flwr.runtime.workers import make_worker
from diff2_flwr.task.losses import cross_entropy, half_squared_error
from exact_norms import inside

N, CLASSES = 13, 3


class SeqLinear(nn.Module):
    """Linear layers on sequences [n, T, in], mean-pooled."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 12), nn.Linear(12, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[n, T, 16] -> [n, 3]."""
        return self.b(torch.tanh(self.a(x))).mean(dim=1)


class EmbedLinear(nn.Module):
    """Embedding (small vocabulary: ids repeat) with a padding id, then a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(7, 4, padding_idx=0), nn.Linear(4, CLASSES)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """[n, T] ids -> [n, 3]."""
        return self.head(torch.tanh(self.embed(ids)).sum(dim=1))


class Block(nn.Module):
    """A pre-norm transformer block from nn.Linear and nn.LayerNorm, embeddings, a head."""

    def __init__(self, width: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.embed, self.pos = nn.Embedding(9, width), nn.Embedding(5, width)
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(),
                                 nn.Linear(2 * width, width))
        self.head = nn.Linear(width, CLASSES)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """[n, T] ids -> [n, 3]."""
        n, t = ids.shape
        x = self.embed(ids) + self.pos(torch.arange(t, device=ids.device).expand(n, -1))
        h = self.norm1(x)
        q, k, v = (f(h).reshape(n, t, self.heads, -1).transpose(1, 2)
                   for f in (self.q, self.k, self.v))
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)
        x = x + self.o((att @ v).transpose(1, 2).reshape(n, t, -1))
        x = x + self.mlp(self.norm2(x))
        return self.head(x.mean(dim=1))


class Scale(nn.Module):
    """A parametrised op no rule covers: x ⊙ s."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.linspace(0.5, 1.5, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ⊙ s."""
        return x * self.s


class Attention(nn.Module):
    """nn.MultiheadAttention (its fused in-projection takes the fallback), mean-pooled."""

    def __init__(self) -> None:
        super().__init__()
        self.att, self.head = nn.MultiheadAttention(4, 2, batch_first=True), nn.Linear(4, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[n, T, 4] -> [n, 3]."""
        return self.head(self.att(x, x, x, need_weights=False)[0].mean(dim=1))


class Tied(nn.Module):
    """An embedding whose weight the output layer shares (both take the fallback)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.out = nn.Embedding(CLASSES, 4), nn.Linear(4, CLASSES, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """[n, T] ids -> [n, 3]."""
        return self.out(torch.tanh(self.embed(ids)).mean(dim=1))


def _ids(gen: torch.Generator, vocab: int, t: int) -> torch.Tensor:
    return torch.randint(0, vocab, (N, t), generator=gen)


#: name -> (model factory, features factory).
CASES = {
    "linear": (lambda: nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, CLASSES)),
               lambda g: torch.randn(N, 5, generator=g)),
    "linear_sequence": (SeqLinear, lambda g: torch.randn(N, 3, 16, generator=g)),
    "conv1d": (lambda: nn.Sequential(nn.Conv1d(3, 4, 3, stride=2, padding=1), nn.Tanh(),
                                     nn.Conv1d(4, 2, 2, dilation=2), nn.Flatten(),
                                     nn.Linear(2 * 3, CLASSES)),
               lambda g: torch.randn(N, 3, 9, generator=g)),
    "conv2d": (lambda: nn.Sequential(nn.Conv2d(2, 4, 3, stride=2, padding=1), nn.Tanh(),
                                     nn.Conv2d(4, 3, 2, bias=False), nn.Flatten(),
                                     nn.Linear(3 * 3 * 3, CLASSES)),
               lambda g: torch.randn(N, 2, 8, 8, generator=g)),
    "embedding": (EmbedLinear, lambda g: _ids(g, 7, 6)),
    "layernorm": (lambda: nn.Sequential(nn.Linear(5, 8), nn.LayerNorm(8), nn.Tanh(),
                                        nn.Linear(8, CLASSES)),
                  lambda g: torch.randn(N, 5, generator=g)),
    "groupnorm": (lambda: nn.Sequential(nn.Conv2d(2, 4, 3), nn.GroupNorm(2, 4), nn.Tanh(),
                                        nn.Flatten(), nn.Linear(4 * 4 * 4, CLASSES)),
                  lambda g: torch.randn(N, 2, 6, 6, generator=g)),
    "transformer_block": (Block, lambda g: _ids(g, 9, 5)),
    "fallback": (lambda: nn.Sequential(nn.Linear(5, 6), nn.PReLU(6), Scale(6),
                                       nn.Linear(6, CLASSES)),
                 lambda g: torch.randn(N, 5, generator=g)),
    "multihead_attention": (Attention, lambda g: torch.randn(N, 3, 4, generator=g)),
    "tied_weights": (Tied, lambda g: _ids(g, CLASSES, 4)),
}


def flat(model: nn.Module, ghost: GhostGradients) -> np.ndarray:
    params = dict(model.named_parameters())
    return np.concatenate([params[n].detach().double().reshape(-1).numpy()
                           for n in ghost.layout.names])


def setup(name: str, seed: int = 0, loss=cross_entropy, chunk_size: int = 1024):
    torch.manual_seed(seed)
    make, data = CASES[name]
    model = make().double()
    gen = torch.Generator().manual_seed(seed + 1)
    x = data(gen)
    x = x.double() if x.is_floating_point() else x
    y = torch.randint(0, CLASSES, (N,), generator=gen)
    ghost = GhostGradients(copy.deepcopy(model), loss, chunk_size=chunk_size)
    ref = PerSampleGradients(copy.deepcopy(model), loss, chunk_size=chunk_size)
    x1 = flat(model, ghost)
    x2 = x1 + 0.05 * np.random.default_rng(seed).standard_normal(x1.size)
    return ghost, ref, x, y, x1, x2


def ref_rows(ref: PerSampleGradients, x, y, x1, x2=None) -> torch.Tensor:
    rows = ref.per_sample(x1, x, y)
    return rows if x2 is None else rows - ref.per_sample(x2, x, y)


def between(norms: torch.Tensor) -> float:
    """A radius half-way between the middle norms: no sample sits on it, about half are over."""
    s = norms.sort().values
    return float(s[N // 2 - 1] + s[N // 2]) / 2


def test_every_layer_kind_takes_its_rule_and_the_rest_the_fallback():
    kinds = {}
    for name in CASES:
        ghost = setup(name)[0]
        kinds[name] = (sorted({k for _, k, _ in ghost.rules.values()}), ghost.fallback_names)
    assert kinds["conv2d"] == (["conv", "linear"], ())
    assert kinds["embedding"] == (["embedding", "linear"], ())
    assert kinds["transformer_block"] == (["embedding", "linear", "norm"], ())
    assert kinds["fallback"][1] == ("1.weight", "2.s")
    assert set(kinds["multihead_attention"][1]) == {"att.in_proj_weight", "att.in_proj_bias",
                                                    "att.out_proj.weight", "att.out_proj.bias"}
    assert kinds["tied_weights"] == ([], ("embed.weight",))


#: ghost_parts.GRAM_COST per form: the default choice, the Gram form for every Linear and
#: convolution, every one materialised.
FORMS = {"auto": ghost_parts.GRAM_COST, "gram": 0, "materialised": math.inf}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("difference", [False, True])
@pytest.mark.parametrize("form", list(FORMS))
def test_norms_equal_torch_func(name, difference, form, monkeypatch):
    monkeypatch.setattr(ghost_parts, "GRAM_COST", FORMS[form])
    ghost, ref, x, y, x1, x2 = setup(name)
    x_prev = x2 if difference else None
    want = row_norms(ref_rows(ref, x, y, x1, x_prev))
    got = ghost.norms(x1, x, y, x_prev)
    assert float(((got - want).abs() / want).max()) <= 1e-10


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("difference", [False, True])
@pytest.mark.parametrize("form", ["auto", "gram"])
def test_clipped_means_equal_torch_func(name, difference, form, monkeypatch):
    monkeypatch.setattr(ghost_parts, "GRAM_COST", FORMS[form])
    ghost, ref, x, y, x1, x2 = setup(name)
    x_prev = x2 if difference else None
    radius = between(row_norms(ref_rows(ref, x, y, x1, x_prev)))
    want = ref.clipped_mean(x1, x, y, radius, x_prev)
    got = ghost.clipped_mean(x1, x, y, radius, x_prev)
    assert got.num_clipped == want.num_clipped > 0 and not got.overflow and not want.overflow
    scale = np.abs(want.mean).max()
    assert np.abs(got.mean - want.mean).max() <= 1e-10 * scale


@pytest.mark.parametrize("name", ["conv2d", "transformer_block", "fallback"])
def test_chunks_and_radii_edges_equal_torch_func(name):
    ghost, ref, x, y, x1, x2 = setup(name, seed=3, chunk_size=4)
    for radius in (0.0, 1e-3, math.inf):
        for x_prev in (None, x2):
            want = ref.clipped_mean(x1, x, y, radius, x_prev)
            got = ghost.clipped_mean(x1, x, y, radius, x_prev)
            assert got.num_clipped == want.num_clipped
            np.testing.assert_allclose(got.mean, want.mean, rtol=0,
                                       atol=1e-10 * max(np.abs(want.mean).max(), 1e-300))


class Opposite(nn.Module):
    """One linear map at two positions whose contributions cancel: ŷ = Σ (W x₀ - W x₁)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Linear(8, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[n, 2, 8] -> [n, 1]."""
        h = self.w(x)
        return (h[:, 0] - h[:, 1]).sum(1, keepdim=True)


def _cancelling_case():
    """Dyadic data: every product and sum of the forward and backward passes and of the rows is
    exact in float64, while the Gram entries ‖x₁‖², x₀·x₁ (~70 bits) are not, and the gradient
    e 1 (x₀ - x₁)ᵀ is 2⁻³⁰ of its terms."""
    gen = torch.Generator().manual_seed(5)
    x0 = torch.randint(-8, 9, (N, 8), generator=gen).double()
    delta = torch.randint(1, 9, (N, 8), generator=gen).double()
    x = torch.stack([x0, x0 + 2.0**-30 * delta], dim=1)
    y = torch.randint(-4, 5, (N,), generator=gen).double()
    model = Opposite().double()
    with torch.no_grad():
        model.w.weight.copy_(torch.randint(-4, 5, (4, 8), generator=gen).double() * 2.0**20)
    ghost = GhostGradients(copy.deepcopy(model), half_squared_error)
    ref = PerSampleGradients(copy.deepcopy(model), half_squared_error)
    return ghost, ref, x, y, flat(model, ghost)


def test_cancellation_safeguard_never_under_clips(monkeypatch):
    monkeypatch.setattr(ghost_parts, "GRAM_COST", 0)  # the Gram form for the layer
    ghost, ref, x, y, x1 = _cancelling_case()
    rows = ref_rows(ref, x, y, x1)
    true = row_norms(rows)
    radius = float(true.min()) / 2  # every sample clipped
    got = ghost.norms(x1, x, y)
    assert float(((got - true).abs() / true).max()) <= 1e-12
    factors = []
    real = ghost_layers.clip_factors
    monkeypatch.setattr(ghost_layers, "clip_factors",
                        lambda upper, r: factors.append(real(upper, r)) or factors[-1])
    want = ref.clipped_mean(x1, x, y, radius)
    mean = ghost.clipped_mean(x1, x, y, radius)
    assert mean.num_clipped == want.num_clipped == N
    # the rows are exact (dyadic data): each clipped row, as the engine's factor rounds it, is
    # inside the ball exactly
    clipped = rows * factors[0].unsqueeze(1)
    assert all(inside(row, radius) for row in clipped.tolist())
    np.testing.assert_allclose(mean.mean, want.mean, rtol=1e-12, atol=0)
    # without the safeguard the Gram identity alone is wrong by far more than the norm itself
    monkeypatch.setattr(ghost_parts, "KEEP_MARGIN", 0.0)
    gram = ghost.norms(x1, x, y)
    assert float(((gram - true).abs() / true).max()) > 1.0


def test_near_iterates_difference_rounds_take_the_small_difference_form(monkeypatch):
    monkeypatch.setattr(ghost_parts, "GRAM_COST", 0)
    ghost, ref, x, y, x1, _ = setup("linear_sequence", seed=7)
    x2 = x1 + 1e-9 * np.random.default_rng(7).standard_normal(x1.size)
    want = row_norms(ref_rows(ref, x, y, x1, x2))
    # torch.func's G₁ - G₂ itself is only good to ~u/1e-9 of its norm here
    got = ghost.norms(x1, x, y, x2)
    assert float(((got - want).abs() / want).max()) <= 1e-5
    monkeypatch.setattr(ghost_parts, "KEEP_MARGIN", 1.0)  # the Gram form, bounded loosely
    assert float(((ghost.norms(x1, x, y, x2) - want).abs() / want).max()) <= 1e-5
    radius = between(want)
    a, b = ghost.clipped_mean(x1, x, y, radius, x2), ref.clipped_mean(x1, x, y, radius, x2)
    assert a.num_clipped == b.num_clipped
    np.testing.assert_allclose(a.mean, b.mean, rtol=0, atol=1e-5 * np.abs(b.mean).max())


@pytest.mark.parametrize("scale", [1e-100, 1e100])
@pytest.mark.parametrize("form", ["auto", "gram"])
def test_norms_whose_squares_underflow_or_overflow_equal_torch_func(scale, form, monkeypatch):
    """Per-sample gradients ~scale² (1e-200: squares underflow; 1e200: they overflow)."""
    monkeypatch.setattr(ghost_parts, "GRAM_COST", FORMS[form])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7, bias=False), nn.Linear(7, 1, bias=False)).double()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(N, 3, 5, generator=gen, dtype=torch.float64) * scale
    y = torch.zeros(N, 3, dtype=torch.float64)

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return half_squared_error(out, target.reshape(out.shape)).sum((1, 2))

    ghost, ref = GhostGradients(copy.deepcopy(model), loss), PerSampleGradients(model, loss)
    x1 = flat(model, ghost)
    x2 = x1 * (1 + 1e-3 * np.random.default_rng(0).standard_normal(x1.size))
    for x_prev in (None, x2):
        want = row_norms(ref_rows(ref, x, y, x1, x_prev))
        got = ghost.norms(x1, x, y, x_prev)
        assert torch.isfinite(want).all() and float(((got - want).abs() / want).max()) <= 1e-10
        radius = between(want)
        a, b = ghost.clipped_mean(x1, x, y, radius, x_prev), ref.clipped_mean(x1, x, y, radius,
                                                                              x_prev)
        assert a.num_clipped == b.num_clipped and not a.overflow
        np.testing.assert_allclose(a.mean, b.mean, rtol=0, atol=1e-10 * np.abs(b.mean).max())


@pytest.mark.parametrize("name", ["linear_sequence", "conv2d", "transformer_block"])
def test_non_finite_samples_are_reported_as_torch_func_does(name):
    ghost, ref, x, y, x1, x2 = setup(name)
    if not x.is_floating_point():
        x1 = x1.copy()
        x1[0] = np.nan  # the first embedding's first entry: every sample that uses it
    else:
        x = x.clone()
        x[2].view(-1)[0] = math.nan
    for x_prev in (None, x2):
        want = ref.clipped_mean(x1, x, y, 0.1, x_prev)
        got = ghost.clipped_mean(x1, x, y, 0.1, x_prev)
        assert got.overflow and want.overflow
        assert got.num_clipped == want.num_clipped
        assert not np.any(got.mean)


class Reused(nn.Module):
    """A covered Linear's weight also used outside its own call."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """fc(x) + x Wᵀ."""
        return self.fc(x) + F.linear(x, self.fc.weight)


def test_a_parameter_used_outside_its_module_is_refused():
    model = Reused().double()
    ghost = GhostGradients(model, cross_entropy)
    x = torch.randn(N, 5, dtype=torch.float64)
    y = torch.randint(0, CLASSES, (N,))
    x1 = flat(model, ghost)
    with pytest.raises(ValueError, match="used outside that module's own call"):
        ghost.clipped_mean(x1, x, y, 1.0)


def test_auto_takes_torch_func_for_a_model_ghost_refuses_and_ghost_refuses_it():
    torch.manual_seed(0)
    model = Reused()
    data = (torch.randn(N, 5), torch.randint(0, CLASSES, (N,)))
    auto = make_worker(model=model, loss="cross_entropy", data=data, partition_id=0)
    assert type(auto.gradients) is PerSampleGradients
    # also where no memory is planned (a deployment's server pre-flight): the check is its own
    unplanned = make_worker(model=model, loss="cross_entropy", data=data, partition_id=0,
                            _plan_memory=False)
    assert type(unplanned.gradients) is PerSampleGradients
    with pytest.raises(GhostUnsupported, match="is used outside that module's own call"):
        make_worker(model=model, loss="cross_entropy", data=data, partition_id=0,
                    gradients="ghost")


def test_supported_modules_leave_out_subclasses_and_shared_weights():
    model = Attention()
    assert "att.out_proj" not in supported_modules(model)  # NonDynamicallyQuantizableLinear
    assert "head" in supported_modules(model)
    assert supported_modules(Tied()) == {}


def test_training_gradients_ghost_builds_the_ghost_engine():
    assert TrainingConfig(gradients="ghost").gradients == "ghost"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))
    data = (torch.randn(10, 4), torch.randint(0, 2, (10,)))
    worker = make_worker(model=model, loss="cross_entropy", data=data, partition_id=0,
                         gradients="ghost")
    assert isinstance(worker.gradients, GhostGradients)
    auto = make_worker(model=model, loss="cross_entropy", data=data, partition_id=0)
    assert type(auto.gradients) is GhostGradients  # auto: a model other than the paper MLP
    ref = make_worker(model=model, loss="cross_entropy", data=data, partition_id=0,
                      gradients="torch_func")
    assert type(ref.gradients) is PerSampleGradients
    x1 = flat(model.double(), worker.gradients)
    got = worker.contribute(0.1, x1, None)
    want = ref.contribute(0.1, x1, None)
    assert got.num_clipped == want.num_clipped
    np.testing.assert_allclose(got.mean, want.mean, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", ["conv2d", "groupnorm", "transformer_block", "fallback"])
def test_float32_compute_equals_torch_func_to_float32_rounding(name):
    torch.manual_seed(0)
    make, data = CASES[name]
    model = make().float()
    gen = torch.Generator().manual_seed(1)
    x, y = data(gen), torch.randint(0, CLASSES, (N,), generator=gen)
    ghost = GhostGradients(copy.deepcopy(model), cross_entropy, dtype=torch.float32)
    ref = PerSampleGradients(copy.deepcopy(model), cross_entropy, dtype=torch.float32)
    x1 = flat(model, ghost)
    x2 = x1 + 0.05 * np.random.default_rng(0).standard_normal(x1.size)
    for x_prev in (None, x2):
        radius = between(row_norms(ref_rows(ref, x, y, x1, x_prev).double()))
        a, b = ghost.clipped_mean(x1, x, y, radius, x_prev), ref.clipped_mean(x1, x, y, radius,
                                                                              x_prev)
        assert a.num_clipped == b.num_clipped and inside(a.mean, radius)
        np.testing.assert_allclose(a.mean, b.mean, rtol=0, atol=1e-5 * np.abs(b.mean).max())


class Switch(nn.Module):
    """A layer (and an embedding) that runs only when the first bias sums to more than 0."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.extra, self.head = nn.Linear(5, 4), nn.Linear(4, 4), nn.Linear(4, CLASSES)
        self.embed = nn.Embedding(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[n, 5] -> [n, 3]."""
        h = torch.tanh(self.a(x))
        if float(self.a.bias.sum()) > 0:
            h = h + torch.tanh(self.extra(h)) + self.embed((x[:, :2].abs() * 2).long() % 6).sum(1)
        return self.head(h)


@pytest.mark.parametrize("on_now", [True, False])
def test_a_layer_called_at_one_iterate_only(on_now):
    torch.manual_seed(0)
    model = Switch().double()
    ghost = GhostGradients(copy.deepcopy(model), cross_entropy)
    ref = PerSampleGradients(copy.deepcopy(model), cross_entropy)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(N, 5, generator=gen, dtype=torch.float64)
    y = torch.randint(0, CLASSES, (N,), generator=gen)
    x1 = flat(model, ghost)
    bias = slice(20, 24)  # a.bias in the layout (a.weight is 4 x 5)
    x1[bias] = 0.1 if on_now else -0.1
    x2 = x1.copy()
    x2[bias] = -x1[bias]
    want = row_norms(ref_rows(ref, x, y, x1, x2))
    got = ghost.norms(x1, x, y, x2)
    assert float(((got - want).abs() / want).max()) <= 1e-10
    radius = between(want)
    a, b = ghost.clipped_mean(x1, x, y, radius, x2), ref.clipped_mean(x1, x, y, radius, x2)
    assert a.num_clipped == b.num_clipped
    np.testing.assert_allclose(a.mean, b.mean, rtol=0, atol=1e-10 * np.abs(b.mean).max())
