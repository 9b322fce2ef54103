"""The fused ghost-clipping kernel (core/fused.py, fused_ghost.cpp) against the torch path
(core/ghost.py): clipped sums and overflow flags for restart, difference and mixed rows, padding,
non-finite inputs, both losses, float64 and float32; bits independent of the instruction set and of
the other runs of a batch; and the batched engine's fallback to the torch path when the kernel
cannot be built."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from diff2_flwr.core import fused, ghost
from diff2_flwr.core.clipping import clip_factors, scaled_row_norms
from diff2_flwr.core.ghost import MLP
from diff2_flwr.lab.sweep import RunSpec, run_batch
from diff2_flwr.runtime.config import parse_config
from diff2_flwr.runtime.session import load_data
from exact_norms import rank_two_sq_norm
from test_ghost import BIG, big_activation_case

# P clients of N = 4 blocks of 16 and a tail of 11, the last 6 of each padding
F, H, N, K, P = 7, 10, 75, 4, 3
M = P * N
CASES = [("half_squared_error", 1, "softplus"), ("cross_entropy", 2, "tanh"), ("cross_entropy", 5,
                                                                               "softplus")]


@pytest.fixture(scope="module")
def kernel() -> fused.FusedKernel:
    k = fused.load()
    if k is None:
        pytest.skip(
            "no C++ compiler here: the kernel cannot be built (test_the_engine_falls_back_... "
            "covers this)")
    return k


def _case(loss: str, classes: int, activation: str, dtype: torch.dtype, seed: int = 0):
    mlp = MLP((F, H, classes), (activation,), loss)
    gen = torch.Generator().manual_seed(seed)
    x = 0.7 * torch.randn(K, mlp.dim, generator=gen, dtype=torch.float64)
    # previous iterates: close (a difference round) for some runs, far for others
    x_prev = x + torch.tensor([1e-3, 0.3, 1e-2, 0.5],
                              dtype=torch.float64).unsqueeze(1) * torch.randn(
        K, mlp.dim, generator=gen, dtype=torch.float64)
    feats = (1.5 * torch.randn(F, M, generator=gen, dtype=torch.float64)).to(dtype)
    y = (torch.randn(M, generator=gen, dtype=torch.float64) if classes == 1 else
         torch.randint(0, classes, (M,), generator=gen).to(torch.float64)).to(dtype)
    mask = torch.ones(P, N, dtype=torch.float64)
    mask[:, -6:] = 0
    mask = mask.reshape(-1)
    x64 = feats.to(torch.float64).contiguous()
    return mlp, x, x_prev, feats, y, x64, (x64 * x64).sum(0), mask


def _parts(mlp: MLP, x: torch.Tensor, feats: torch.Tensor, y: torch.Tensor) -> fused.Parts:
    a, dphi, g, _ = ghost.forward_head(mlp, x, feats, y)
    return fused.Parts(a.contiguous(), dphi.contiguous(), g.contiguous(),
                       mlp.layers(x.to(feats.dtype))[1][0].contiguous())


def _torch_path(mlp, x, x_prev, feats, y, x64, sq, mask, radius, restart, differences: bool):
    """Clipped sums and overflow flags as the batched engine's torch path takes them
    (sweep._round_core)."""
    cur = ghost.forward(mlp, x, feats, y).to64()
    prev = None
    if differences:
        prev = ghost.forward(mlp, x_prev, feats, y).to64()
        if restart is not None:
            prev = prev.restarting(cur, restart)
    norms, upper = ghost.norm_bounds(mlp, cur, x64.T, sq, prev)
    c = clip_factors(upper, radius.unsqueeze(-1)) * mask
    sums = ghost.clipped_sums(cur, x64.T.reshape(P, N, F).contiguous(), c, prev)  # [P, K, d]
    return sums, ((~torch.isfinite(norms)) & (mask > 0)).reshape(K, P, N).any(-1).T, norms


ROWS = {"restart": (False, None), "difference": (True, None),
        "mixed": (True, torch.tensor([True, False, False, True]))}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("loss,classes,activation", CASES)
def test_the_kernel_equals_the_torch_path(kernel, loss, classes, activation, dtype):
    """Clipped sums to 1e-13 of their scale (the sums over samples are added in another order), in
    float64 and in float32 (both paths take the same compute-dtype forward quantities and the
    backward to the hidden layer in the compute dtype, then float64), at radii that clip every row,
    some rows and none; no overflow. In float32 with more than two classes, the backward's sum over
    the outputs rounds in another order than torch's reduction (one float32 ulp of g_1): 1e-6
    there."""
    mlp, x, x_prev, feats, y, x64, sq, mask = _case(loss, classes, activation, dtype)
    tol = 1e-6 if dtype == torch.float32 and classes > 2 else 1e-13
    cur, prev = _parts(mlp, x, feats, y), _parts(mlp, x_prev, feats, y)
    for name, (differences, restart) in ROWS.items():
        _, _, norms = _torch_path(mlp, x, x_prev, feats, y, x64, sq, mask, torch.full((K,),
                                                                                      math.inf,
                                  dtype=torch.float64), restart, differences)
        some = norms[:, mask > 0].median(1).values
        for radius in (torch.zeros(K, dtype=torch.float64), 0.3 * some, some,
                       torch.full((K,), math.inf, dtype=torch.float64)):
            ref, ref_over, _ = _torch_path(mlp, x, x_prev, feats, y, x64, sq, mask, radius, restart,
                                           differences)
            got, over = fused.clipped_sums(kernel, cur, x64, sq, mask, radius.contiguous(),
                                           prev if differences else None, restart, clients=P)
            scale = float(ref.abs().max()) or 1.0
            torch.testing.assert_close(got, ref, rtol=0, atol=tol * scale,
                                       msg=f"{name} rows, radius {radius}")
            assert not over.any() and not ref_over.any()
    # a restarting row of a mixed batch is its plain gradient's row; a differencing row its
    # difference's
    radius = norms[:, mask > 0].median(1).values.contiguous()
    plain, _ = fused.clipped_sums(kernel, cur, x64, sq, mask, radius, clients=P)
    diff, _ = fused.clipped_sums(kernel, cur, x64, sq, mask, radius, prev,
                                 torch.zeros(K, dtype=torch.bool), clients=P)
    mixed, _ = fused.clipped_sums(kernel, cur, x64, sq, mask, radius, prev, ROWS["mixed"][1],
                                  clients=P)
    assert torch.equal(mixed[:, [0, 3]], plain[:, [0, 3]]) and torch.equal(mixed[:, [1, 2]],
                                                                           diff[:, [1, 2]])
    assert not torch.allclose(diff, plain)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_non_finite_value_on_a_real_sample_is_an_overflow_and_on_padding_is_not(kernel, dtype):
    mlp, x, x_prev, feats, y, x64, sq, mask = _case("half_squared_error", 1, "softplus", dtype)
    radius = torch.ones(K, dtype=torch.float64)
    clean = torch.zeros(P, K, dtype=torch.bool)
    for where, bad in (("a", math.inf), ("grad_out", math.nan), ("dphi", -math.inf)):
        # client 1's samples: a real one in a block, one of its padding, a real one in its tail
        for sample, expected in ((N + 3, True), (2 * N - 2, False), (2 * N - 7, True)):
            cur = _parts(mlp, x, feats, y)
            getattr(cur, where)[1, 0, sample] = bad
            prev = _parts(mlp, x_prev, feats, y)
            _, over = fused.clipped_sums(kernel, cur, x64, sq, mask, radius, prev,
                                         torch.zeros(K, dtype=torch.bool), clients=P)
            want = clean.clone()
            want[1, 1] = expected
            assert torch.equal(over, want), (where, sample)
    # in the previous pass too (client 2, run 2)
    prev = _parts(mlp, x_prev, feats, y)
    prev.a[2, 4, 2 * N + 7] = math.inf
    _, over = fused.clipped_sums(kernel, _parts(mlp, x, feats, y), x64, sq, mask, radius, prev,
                                 torch.tensor([False, False, False, True]), clients=P)
    want = clean.clone()
    want[2, 2] = True
    assert torch.equal(over, want)
    # ... unless that run restarts (its previous pass is not read)
    _, over = fused.clipped_sums(kernel, _parts(mlp, x, feats, y), x64, sq, mask, radius, prev,
                                 torch.tensor([False, False, True, False]), clients=P)
    assert not over.any()


def test_the_bits_do_not_depend_on_the_other_runs_nor_on_the_instruction_set(kernel):
    """Each run's sums are its own (a batch's composition changes nothing), the same inputs give the
    same bits, and a build for the x86-64 baseline (SSE2) gives the bits of this machine's build
    (AVX2 / AVX-512): the kernel's arithmetic is IEEE in a fixed order (-ffp-contract=off, no
    fast-math)."""
    baseline = fused.FusedKernel(fused.build("DEFAULT"))
    for dtype in (torch.float64, torch.float32):
        mlp, x, x_prev, feats, y, x64, sq, mask = _case("cross_entropy", 3, "softplus", dtype,
                                                        seed=4)
        cur, prev = _parts(mlp, x, feats, y), _parts(mlp, x_prev, feats, y)
        radius = torch.tensor([0.05, 0.5, math.inf, 2.0], dtype=torch.float64)
        restart = torch.tensor([False, True, False, False])
        got, _ = fused.clipped_sums(kernel, cur, x64, sq, mask, radius, prev, restart, clients=P)
        again, _ = fused.clipped_sums(kernel, cur, x64, sq, mask, radius, prev, restart, clients=P)
        base, _ = fused.clipped_sums(baseline, cur, x64, sq, mask, radius, prev, restart, clients=P)
        assert torch.equal(got, again) and torch.equal(got, base)
        sub = [2, 1]
        pick = lambda p: p._replace(**{f: getattr(p,
                                                  f)[sub].contiguous()
                                                  for f in p._fields[:4]})  # noqa: E731
        alone, _ = fused.clipped_sums(kernel, pick(cur), x64, sq, mask, radius[sub].contiguous(),
                                      pick(prev), restart[sub], clients=P)
        assert torch.equal(alone, got[:, sub])
        # a client alone (its own samples only) gets its bits too
        cols = slice(N, 2 * N)
        one = lambda p: fused.Parts(p.a[..., cols].contiguous(),
                                    p.dphi[..., cols].contiguous(),  # noqa: E731
                                    p.grad_out[..., cols].contiguous(), p.w_out)
        client, _ = fused.clipped_sums(kernel, one(cur), x64[:, cols].contiguous(),
                                       sq[cols].contiguous(), mask[cols].contiguous(), radius,
                                       one(prev), restart)
        assert torch.equal(client[0], got[1])


def test_the_first_layer_sums_by_a_matrix_product_equal_the_kernels(kernel):
    """With ``x_rows`` the kernel leaves Σ c dg_1 xᵀ to one batched product of its c·dg_1 (many
    features): the same sums to 1e-13 of their scale, and the same overflow flags."""
    for dtype in (torch.float64, torch.float32):
        mlp, x, x_prev, feats, y, x64, sq, mask = _case("cross_entropy", 3, "tanh", dtype, seed=2)
        cur, prev = _parts(mlp, x, feats, y), _parts(mlp, x_prev, feats, y)
        cur.a[3, 2, 2 * N + 1] = math.inf
        radius = torch.tensor([0.05, 0.5, math.inf, 2.0], dtype=torch.float64)
        restart = torch.tensor([False, True, False, False])
        rows = x64.T.reshape(P, N, F).contiguous()
        got, over = fused.clipped_sums(kernel, cur, x64, sq, mask, radius, prev, restart, clients=P)
        by_product, over2 = fused.clipped_sums(kernel, cur, x64, sq, mask, radius, prev, restart,
                                               clients=P, x_rows=rows)
        keep = [0, 1, 2]  # run 3 is not finite
        scale = float(got[:, keep].abs().max())
        torch.testing.assert_close(by_product[:, keep], got[:, keep], rtol=0, atol=1e-13 * scale)
        # only W_1 is taken otherwise
        assert torch.equal(by_product[:, keep, H * F:], got[:, keep, H * F:])
        assert torch.equal(over, over2) and over[2, 3] and int(over.sum()) == 1


def test_bad_arguments_are_refused_with_the_name_and_the_expected_shape(kernel):
    mlp, x, _, feats, y, x64, sq, mask = _case("half_squared_error", 1, "softplus", torch.float32)
    cur = _parts(mlp, x, feats, y)
    radius = torch.ones(K, dtype=torch.float64)
    with pytest.raises(ValueError,
                       match=r"prev.a must be a contiguous torch.float32 tensor of shape \(4, 10, "
                             r"225\)"):
        fused.clipped_sums(kernel, cur, x64, sq, mask, radius, cur._replace(a=cur.a.double()))
    with pytest.raises(ValueError,
                       match=r"radius must be a contiguous float64 tensor of shape \(4,\)"):
        fused.clipped_sums(kernel, cur, x64, sq, mask, radius.float())
    with pytest.raises(ValueError,
                       match=r"dphi must be .* shape \(4, 10, 225\)\. Found .*, not contiguous"):
        fused.clipped_sums(kernel,
                           cur._replace(dphi=cur.dphi.transpose(1, 2).contiguous().transpose(1, 2)),
                           x64, sq, mask, radius)
    with pytest.raises(ValueError, match="225 samples do not split into 4 clients of equal size"):
        fused.clipped_sums(kernel, cur, x64, sq, mask, radius, clients=4)
    with pytest.raises(ValueError,
                       match=r"x_rows must be a contiguous float64 tensor of shape \(3, 75, 7\)"):
        fused.clipped_sums(kernel, cur, x64, sq, mask, radius, clients=P, x_rows=x64.T.contiguous())


# ---------------------------------------------------------------- the engine: fused path and its
# fallback

ROUNDS = 8


def _specs():
    cfg = parse_config({"dataset": {"name": "synthetic", "num_samples": 403}, "method": "diff2",
                        "training": {"clients": 3, "rounds": ROUNDS, "restart_every": 3,
                                     "clip_restart": 1.0,
                                     "clip_diff": 0.5, "learning_rate": 0.3, "seed": 1}})
    data = load_data(cfg)
    m = cfg.mechanism(cfg.calibration(data.n_min))
    return data, [RunSpec(T, 0.3, 1.0, 0.5, m.sigma_restart, m.sigma_diff, s, s) for T,
                  s in ((3, 1), (1, 2), (4, 3))]


# ------------------------------------------------------------ the forward pass in the kernel (issue
# 24, item 1)

ACTIVATION_CASES = CASES + [("half_squared_error", 1, "sigmoid"), ("cross_entropy", 3, "relu"),
                            ("half_squared_error", 1, "identity"), ("half_squared_error", 1,
                                                                    "tanh")]


def _forward(kernel, mlp, x, feats, y, x64, sq, mask, radius, prev=None, restart=None, **kw):
    return fused.forward_sums(kernel, x.to(feats.dtype).contiguous(), feats, y, mlp.activations[0],
                              mlp.loss, x64, sq, mask, radius, prev, restart, hidden=mlp.sizes[1],
                              outputs=mlp.sizes[2], clients=P, **kw)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("loss,classes,activation", ACTIVATION_CASES)
def test_the_kernels_forward_pass_equals_torchs_to_rounding(kernel, loss, classes, activation,
                                                            dtype):
    """forward_sums: a, φ', g_L and ℓ of the real samples equal ghost.forward_head's to a few units
    in the last place of their scale (the kernel's exp and log1p are its own: 2e-15 in float64, 2e-6
    in float32), the clipped sums (restart, difference and mixed rows) to 1e-13 / 5e-6 of theirs;
    and the parts it returns, given back to the backward-only entry, give its sums bit for bit (one
    pass, the same blocks)."""
    mlp, x, x_prev, feats, y, x64, sq, mask = _case(loss, classes, activation, dtype)
    tol, sums_tol = (2e-15, 1e-13) if dtype == torch.float64 else (2e-6, 5e-6)
    real = mask > 0
    radius = torch.tensor([0.05, 0.5, math.inf, 2.0], dtype=torch.float64)
    cur, prev = _parts(mlp, x, feats, y), _parts(mlp, x_prev, feats, y)
    _, _, _, ref_loss = ghost.forward_head(mlp, x, feats, y)
    kprev = _forward(kernel, mlp, x_prev, feats, y, x64, sq, mask, radius)[2]
    for restart in (None, torch.tensor([False, True, False, False]), torch.zeros(K,
                                                                                 dtype=torch.bool)):
        previous = None if restart is None else (prev, kprev)
        ref, ref_over = fused.clipped_sums(kernel, cur, x64, sq, mask, radius,
                                           previous and previous[0], restart, clients=P)
        got, over, parts, losses = _forward(kernel, mlp, x, feats, y, x64, sq, mask, radius,
                                            previous and previous[1], restart)
        for name, a, b in (("a", parts.a, cur.a), ("dphi", parts.dphi, cur.dphi),
                           ("grad_out", parts.grad_out, cur.grad_out), ("loss", losses, ref_loss)):
            a, b = a[..., real], b[..., real]
            torch.testing.assert_close(a, b, rtol=0, atol=tol * max(float(b.abs().max()), 1.0),
                                       msg=name)
        assert torch.equal(parts.w_out, cur.w_out)
        torch.testing.assert_close(got, ref, rtol=0, atol=sums_tol * float(ref.abs().max()))
        assert torch.equal(over, ref_over) and not over.any()
        again, _ = fused.clipped_sums(kernel, parts, x64, sq, mask, radius,
                                      previous and previous[1], restart, clients=P)
        assert torch.equal(again, got)


def _mp_reference(name: str, h: float) -> tuple[float, float]:
    import mpmath

    with mpmath.workdps(60):
        v = mpmath.mpf(h)
        if name == "softplus":
            if h > 20:
                return h, 1.0
            e = mpmath.exp(v)
            return float(mpmath.log1p(e)), float(e / (1 + e))
        if name == "tanh":
            t = mpmath.tanh(v)
            return float(t), float(1 - t * t)
        s = 1 / (1 + mpmath.exp(-v))
        return float(s), float(s * (1 - s))


@pytest.mark.parametrize("name", ["softplus", "tanh", "sigmoid"])
def test_the_kernels_activations_are_within_three_ulp_of_the_exact_values(kernel, name):
    """φ and φ' of the kernel's forward pass against 60-digit values (mpmath) on 3,000 arguments
    from 1e-300 to 800 in magnitude, both signs: within 3 units in the last place of float64 (and of
    float32, for float32 inputs), relative to the value (to 1 for φ' of tanh and sigmoid, whose 1 -
    t² and s(1 - s) cancel as torch's do) and with results below 2^-960 (2^-100) counted from there:
    a process whose floating-point unit flushes subnormals to zero (some native libraries set it)
    gives the same verdict. NaN stays NaN, ±inf gives the limits."""
    gen = np.random.default_rng(24)
    mags = np.concatenate([10.0 ** gen.uniform(-300, 0, 800), gen.uniform(0, 40, 1400),
                           gen.uniform(40, 800, 300), [0.0, 1e-310, 20.0, np.nextafter(20.0, 21.0),
                                                       708.0, 709.8, 745.0, 760.0]])
    hs = np.concatenate([mags, -mags])
    for dtype, floor in ((np.float64, 2.0 ** -960), (np.float32, 2.0 ** -100)):
        h = hs.astype(dtype)
        a, d = (t.numpy().astype(np.float64) for t in fused.activation(kernel, name,
                                                                       torch.from_numpy(h)))
        ref = np.array([_mp_reference(name, float(v)) for v in h])
        eps = float(np.finfo(dtype).eps)
        ua = np.abs(a - ref[:, 0]) / np.maximum(np.abs(ref[:, 0]), floor) / eps
        d_floor = 1.0 if name in ("tanh", "sigmoid") else floor
        ud = np.abs(d - ref[:, 1]) / np.maximum(np.abs(ref[:, 1]), d_floor) / eps
        assert ua.max() <= 3 and ud.max() <= 3, (dtype, h[ua.argmax()], ua.max(), h[ud.argmax()],
                                                 ud.max())
        a, d = fused.activation(kernel, name, torch.tensor([math.nan, -math.inf, math.inf],
                                                           dtype=torch.from_numpy(h).dtype))
        assert math.isnan(a[0]) and math.isnan(d[0])
        limits = {"softplus": (0.0, math.inf, 0.0, 1.0), "tanh": (-1.0, 1.0, 0.0, 0.0),
                  "sigmoid": (0.0, 1.0, 0.0, 0.0)}
        assert (float(a[1]), float(a[2]), float(d[1]), float(d[2])) == limits[name]


def test_the_kernels_forward_bits_do_not_depend_on_the_other_runs_nor_on_the_instruction_set(
    kernel):
    """As the backward's: forward_sums on the baseline build (SSE2) gives the bits of this machine's
    build, parts and losses included; a run alone, and a client alone, get their bits of the
    batch."""
    baseline = fused.FusedKernel(fused.build("DEFAULT"))
    for dtype in (torch.float64, torch.float32):
        mlp, x, x_prev, feats, y, x64, sq, mask = _case("cross_entropy", 3, "softplus", dtype,
                                                        seed=4)
        radius = torch.tensor([0.05, 0.5, math.inf, 2.0], dtype=torch.float64)
        restart = torch.tensor([False, True, False, False])
        outs = {}
        for name, kern in (("native", kernel), ("baseline", baseline)):
            prev = _forward(kern, mlp, x_prev, feats, y, x64, sq, mask, radius)[2]
            outs[name] = (prev, _forward(kern, mlp, x, feats, y, x64, sq, mask, radius, prev,
                                         restart))
        (p1, (s1, o1, c1, l1)), (p2, (s2, o2, c2, l2)) = outs["native"], outs["baseline"]
        assert torch.equal(s1, s2) and torch.equal(o1, o2) and torch.equal(l1, l2)
        assert all(torch.equal(u, v) for u, v in zip(c1[:4],
                                                     c2[:4])) and all(torch.equal(u, v) for u,
                                                                      v in zip(p1[:4], p2[:4]))
        sub = [2, 1]
        pick = lambda p: p._replace(**{f: getattr(p,
                                                  f)[sub].contiguous()
                                                  for f in p._fields[:4]})  # noqa: E731
        alone = fused.forward_sums(kernel, x[sub].to(dtype).contiguous(), feats, y, "softplus",
                                   "cross_entropy", x64, sq, mask, radius[sub].contiguous(),
                                   pick(p1), restart[sub], hidden=H, outputs=3, clients=P)
        assert torch.equal(alone[0], s1[:, sub]) and torch.equal(alone[3], l1[sub])
        cols = slice(N, 2 * N)
        one = lambda p: fused.Parts(p.a[..., cols].contiguous(),
                                    p.dphi[..., cols].contiguous(),  # noqa: E731
                                    p.grad_out[..., cols].contiguous(), p.w_out)
        client = fused.forward_sums(kernel, x.to(dtype).contiguous(), feats[:, cols].contiguous(),
                                    y[cols].contiguous(), "softplus", "cross_entropy",
                                    x64[:, cols].contiguous(), sq[cols].contiguous(),
                                    mask[cols].contiguous(), radius, one(p1), restart, hidden=H,
                                    outputs=3, clients=1)
        assert torch.equal(client[0][0], s1[1]) and torch.equal(client[3], l1[:, cols])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_pass_not_kept_gives_the_same_bits_and_no_parts(kernel, dtype):
    """keep=False (a round of plain gradients that no later round reads): the sums, overflow flags
    and losses are the bits of the kept pass (padding and a partial last block included), no parts
    are returned, and a difference round cannot ask for it; the engine, which passes keep=False
    before a round that restarts every run, gives the runs it gave when every pass was kept."""
    from diff2_flwr.lab import backend

    for loss, classes in (("half_squared_error", 1), ("cross_entropy", 3)):
        mlp, x, x_prev, feats, y, x64, sq, mask = _case(loss, classes, "softplus", dtype, seed=7)
        radius = torch.tensor([0.05, 0.5, math.inf, 2.0], dtype=torch.float64)
        kept = _forward(kernel, mlp, x, feats, y, x64, sq, mask, radius)
        lean = _forward(kernel, mlp, x, feats, y, x64, sq, mask, radius, keep=False)
        assert lean[2] is None and kept[2] is not None
        assert torch.equal(lean[0],
                           kept[0]) and torch.equal(lean[1], kept[1]) and torch.equal(lean[3],
                                                                                      kept[3])
        with pytest.raises(ValueError, match="keep=False is for a pass of plain gradients"):
            _forward(kernel, mlp, x, feats, y, x64, sq, mask, radius, kept[2],
                     torch.zeros(K, dtype=torch.bool), keep=False)
    data, specs = _specs()
    round_ = backend.FusedBackend.round
    for batch in ([s for s in specs if s.restart_every == 1],
                  [s for s in specs if s.restart_every == 1] + specs[:1]):
        lean_calls = []

        def counted(self, *a, **kw):
            lean_calls.append(not kw.get("keep", True))
            return round_(self, *a, **kw)
        try:
            backend.FusedBackend.round = lambda self, *a, **kw: round_(self, *a, **{**kw,
                                                                                    "keep": True})
            kept_runs = run_batch(data, batch, rounds=ROUNDS, eval_every=3, dtype=dtype)
            backend.FusedBackend.round = counted
            lean_runs = run_batch(data, batch, rounds=ROUNDS, eval_every=3, dtype=dtype)
        finally:
            backend.FusedBackend.round = round_
        # keep=False was asked for (every round, or every third)
        assert sum(lean_calls) >= ROUNDS // 3, lean_calls
        for a, b in zip(lean_runs, kept_runs):
            assert np.array_equal(a.final_x, b.final_x) and np.array_equal(a.train_loss,
                                                                           b.train_loss)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_pass_written_into_given_tensors_gives_the_same_bits(kernel, dtype):
    """forward_sums(out=...): a pass written into the tensors of one no one reads any more gives
    the sums, flags, losses and parts of a pass into fresh tensors (restart and difference rounds,
    the float32 accumulation too); tensors that are the previous pass's, or of the wrong shape, are
    refused (the kernel reads prev while it writes the pass)."""
    mlp, x, x_prev, feats, y, x64, sq, mask = _case("half_squared_error", 1, "softplus", dtype,
                                                    seed=9)
    radius = torch.tensor([0.05, 0.5, math.inf, 2.0], dtype=torch.float64)
    restart = torch.tensor([False, True, False, False])
    modes = ("float64", "float32") if dtype == torch.float32 else ("float64",)
    for accumulate in modes:
        first = _forward(kernel, mlp, x_prev, feats, y, x64, sq, mask, radius,
                         accumulate=accumulate)
        spare = _forward(kernel, mlp, x, feats, y, x64, sq, mask, radius)[2]
        for t in (spare.a, spare.dphi, spare.grad_out):
            t.fill_(float("nan"))  # whatever a spare pass holds is overwritten
        for prev, rs in ((None, None), (first[2], restart)):
            fresh = _forward(kernel, mlp, x, feats, y, x64, sq, mask, radius, prev, rs,
                             accumulate=accumulate)
            into = _forward(kernel, mlp, x, feats, y, x64, sq, mask, radius, prev, rs,
                            accumulate=accumulate, out=spare)
            assert into[2].a is spare.a and into[2].grad_out is spare.grad_out
            for i in (0, 1, 3):
                assert torch.equal(into[i], fresh[i])
            for name in ("a", "dphi", "grad_out", "w_out"):
                assert torch.equal(getattr(into[2], name), getattr(fresh[2], name))
        with pytest.raises(ValueError, match="shares memory with prev"):
            _forward(kernel, mlp, x, feats, y, x64, sq, mask, radius, first[2], restart,
                     accumulate=accumulate, out=first[2])
        bad = fused.Parts(spare.a[:, :, :-1], spare.dphi, spare.grad_out, spare.w_out)
        with pytest.raises(ValueError, match="out.a must be a contiguous"):
            _forward(kernel, mlp, x, feats, y, x64, sq, mask, radius, out=bad)
        with pytest.raises(ValueError, match="with keep=False no pass is written"):
            _forward(kernel, mlp, x, feats, y, x64, sq, mask, radius, keep=False, out=spare)


def test_the_engine_with_the_kernels_forward_equals_the_torch_forward(monkeypatch):
    """The batched engine's default (the forward pass in the kernel) against the forward pass in
    torch, the same runs otherwise: final iterates within 1e-12 (float64) and 1e-6 (float32) after
    the test's rounds, the evaluation's losses and ‖∇f‖² to 1e-10 / 1e-5 relative: the claims
    docs/how-to/studies.md makes for the kernel's forward."""
    import functools

    from diff2_flwr.lab import backend

    if fused.load() is None:
        pytest.skip("no C++ compiler here: the kernel cannot be built")
    data, specs = _specs()
    init = backend.FusedBackend.__init__
    for dtype, tol, rtol in ((torch.float64, 1e-12, 1e-10), (torch.float32, 1e-6, 1e-5)):
        monkeypatch.setattr(backend.FusedBackend, "__init__",
                            functools.partialmethod(init, forward="kernel"))
        kernel_runs = run_batch(data, specs, rounds=ROUNDS, eval_every=2, dtype=dtype)
        monkeypatch.setattr(backend.FusedBackend, "__init__",
                            functools.partialmethod(init, forward="torch"))
        torch_runs = run_batch(data, specs, rounds=ROUNDS, eval_every=2, dtype=dtype)
        monkeypatch.setattr(backend.FusedBackend, "__init__", init)
        for a, b in zip(kernel_runs, torch_runs):
            np.testing.assert_allclose(a.final_x, b.final_x, rtol=0, atol=tol)
            # two paths, not one
            assert not np.array_equal(a.final_x, b.final_x) or dtype == torch.float32
            for key in ("train_loss", "grad_norm_sq", "test_loss"):
                np.testing.assert_allclose(getattr(a, key), getattr(b, key), rtol=rtol)


def test_the_forward_pass_is_the_kernels_for_few_features_and_torchs_for_many():
    """The default forward pass: the kernel's (its W_1 x in lane loops, in the caches) up to
    KERNEL_W1_FEATURES input features, torch's matrix product above (KDD Cup 99's 118: 2.4x faster
    per round)."""
    from diff2_flwr.lab.backend import KERNEL_W1_FEATURES, Batch, FusedBackend
    from diff2_flwr.lab.sweep import batch_model
    from diff2_flwr.task.data import prepare, synthetic_regression

    kernel = fused.load()
    if kernel is None:
        pytest.skip("no C++ compiler here: the kernel cannot be built")
    for features, head in ((KERNEL_W1_FEATURES, False), (KERNEL_W1_FEATURES + 1, True)):
        x, y = synthetic_regression(64, features, 0)
        data = prepare("synthetic", x, y, clients=2)
        mlp, _ = batch_model(data)
        chosen = FusedBackend(kernel, mlp, Batch(data, torch.float32), 1)
        assert (chosen.head is not None) == head, features


def test_the_engine_falls_back_to_the_torch_path_with_one_warning(monkeypatch, capsys):
    """Without a compiler, load() warns once on stderr and returns None, and the batched engine
    takes the torch path: the same runs as the fused path to 1e-12 (float64) and 1e-8 (float32: an
    iterate 1e-16 apart may round to another float32, as in test_private_edges)."""
    data, specs = _specs()
    monkeypatch.setattr(fused, "_LOADED", [])
    if fused.load() is None:
        pytest.skip("no C++ compiler here: only the fallback runs")
    capsys.readouterr()
    runs = {dtype: run_batch(data, specs, rounds=ROUNDS, eval_every=2, dtype=dtype)
            for dtype in (torch.float64, torch.float32)}
    monkeypatch.setattr(fused, "_LOADED", [])
    monkeypatch.setattr(fused, "_compiler", lambda: None)
    assert fused.load() is None and fused.load() is None
    err = capsys.readouterr().err
    assert err.count("warning") == 1 and "no C++ compiler found" in err and "torch path" in err
    for dtype, tol, rtol in ((torch.float64, 1e-12, 1e-10), (torch.float32, 1e-8, 1e-6)):
        for with_kernel, without in zip(runs[dtype], run_batch(data, specs, rounds=ROUNDS,
                                                               eval_every=2, dtype=dtype)):
            np.testing.assert_allclose(with_kernel.final_x, without.final_x, rtol=0, atol=tol)
            for key in ("train_loss", "grad_norm_sq", "test_loss"):
                np.testing.assert_allclose(getattr(with_kernel, key), getattr(without, key),
                                           rtol=rtol)
    # a compiler that fails names itself and the source
    monkeypatch.setattr(fused, "_LOADED", [])
    monkeypatch.setattr(fused, "_compiler", lambda: "false")
    with pytest.raises(RuntimeError,
                       match="cannot run the C\\+\\+ compiler|false failed on .*fused_ghost.cpp"):
        fused.build()


def test_clients_in_groups_give_the_runs_of_one_group(monkeypatch):
    """The engine forwards and clips clients in groups whose tensors stay under 32 MB (one group for
    the paper's studies): one client per group, with the first layer's sums by a matrix product (as
    for many features), gives the same runs, to 1e-12 (float64; the forward's matrix product may add
    in another order for another number of samples)."""
    from diff2_flwr.lab import backend

    if fused.load() is None:
        pytest.skip("no C++ compiler here: the kernel cannot be built")
    data, specs = _specs()
    whole = run_batch(data, specs, rounds=ROUNDS, eval_every=4)
    groups = backend.Batch.groups
    seen = []

    def one_client_each(self, runs, width, cap=32 << 20):
        out = groups(self, runs, width, cap=1)
        seen.append(len(out))
        return out

    monkeypatch.setattr(backend.Batch, "groups", one_client_each)
    # and the first layer's sums by a matrix product
    monkeypatch.setattr(backend, "KERNEL_W1_FEATURES", 0)
    for a, b in zip(whole, run_batch(data, specs, rounds=ROUNDS, eval_every=4)):
        np.testing.assert_allclose(a.final_x, b.final_x, rtol=0, atol=1e-12)
        np.testing.assert_allclose(a.grad_norm_sq, b.grad_norm_sq, rtol=1e-10)
    assert seen == [3]


# ---------------------------------------------------------------- norms that never under-clip
# (issue 19, item 5)

def _one_sample_clients(engine: str, request, mlp: MLP, x, xp, feats, y,
                        radius: float) -> torch.Tensor:
    """The batched engine's clipped sums [n, d] of the difference rows with every sample a client of
    its own (so each sum is one clipped row), from the fused kernel or from the torch path
    (sweep._round_core), float64."""
    n = feats.shape[0]
    x, xp = torch.as_tensor(x), torch.as_tensor(xp)
    x64, mask, rad = feats.T.contiguous(), torch.ones(n,
                                                      dtype=torch.float64), torch.tensor([
                                                          radius], dtype=torch.float64)
    sq = (x64 * x64).sum(0)
    if engine == "torch":
        from diff2_flwr.lab.backend import _round_core

        prev = ghost.forward(mlp, xp, x64, y)
        sums, over, *_ = _round_core(mlp, x64, feats.reshape(n, 1, -1), y, sq, mask, x, prev.inputs,
                                     prev.grads, torch.tensor([False]), rad, False)
    elif engine == "fused":
        kernel = request.getfixturevalue("kernel")
        sums, over = fused.clipped_sums(kernel, _parts(mlp, x, x64, y), x64, sq, mask, rad,
                                        _parts(mlp, xp, x64, y), clients=n)
    else:  # the kernel's own forward pass too
        kernel = request.getfixturevalue("kernel")
        H, O = mlp.sizes[1], mlp.sizes[2]
        prev = fused.forward_sums(kernel, xp.contiguous(), x64, y, mlp.activations[0], mlp.loss,
                                  x64, sq, mask, rad, hidden=H, outputs=O, clients=n)[2]
        sums, over, _, _ = fused.forward_sums(kernel, x.contiguous(), x64, y, mlp.activations[0],
                                              mlp.loss, x64, sq, mask, rad, prev, hidden=H,
                                              outputs=O, clients=n)
    assert not over.any()
    return sums[:, 0]


@pytest.mark.parametrize("engine", ["fused", "fused-forward", "torch"])
@pytest.mark.parametrize("loss,classes,kind", [(loss, c, kind) for loss, c, depth,
                                               kind in BIG if depth == 1])
def test_clipped_difference_rows_never_exceed_the_radius_with_activations_1e4(engine, request, loss,
                                                                              classes, kind):
    """Hidden activations ~1e4 and close iterates (test_ghost's table, one hidden layer): without
    clipping each row is torch.func's difference row; clipped at half the smallest norm, each row's
    norm is the radius to 1e-8 relative (the engine's norm equals torch.func's to 1e-9; the clip
    factor is C over an upper bound of the true norm, above it by up to κ (√A + 4√B) in the QR form,
    ~3e-9 of the norm at this conditioning: ghost.norm_bounds) and never above it beyond float64
    rounding: 1e-11, as in test_ghost (a written-out row's entries round to
    ε of its two terms, ~ε√((A + B)/‖·‖²) ≈ 3e-12 of its norm at this conditioning; measured
    8.5e-13; the workers' projection takes it off before release). The expanded A + B + X alone left
    rows 5e-7 above the radius on the cancelling cases."""
    mlp, x, xp, feats, y, rows = big_activation_case(loss, classes, 1, kind)
    want = torch.linalg.vector_norm(rows, dim=1)
    free = _one_sample_clients(engine, request, mlp, x, xp, feats, y, math.inf)
    torch.testing.assert_close(scaled_row_norms(free), want, rtol=1e-9, atol=0)
    radius = 0.5 * float(want.min())
    got = scaled_row_norms(_one_sample_clients(engine, request, mlp, x, xp, feats, y, radius))
    assert float(got.max()) <= radius * (
        1 + 1e-11), f"max clipped norm / C = {float(got.max()) / radius!r}"
    torch.testing.assert_close(got, torch.full_like(got, radius), rtol=1e-8, atol=0)


@pytest.mark.parametrize("engine", ["fused", "torch"])
@pytest.mark.parametrize("power,radius", [(-565, 1e-200), (665, 1.0)])
def test_rows_of_extreme_norms_are_clipped_not_lost_to_underflow_or_overflow(engine, request, power,
                                                                             radius):
    """Every gradient of a float64 pass times 2^power (exact): difference rows of norm ~1e-170 at
    radius 1e-200 (their squares underflow to 0: they passed unclipped) and of norm ~1e197 at radius
    1 (their squares overflow: the runs were reported diverged). Each sample a client of its own:
    unclipped, each row's norm is 2^power times the unscaled row's (to 1e-13); clipped, every row is
    clipped, to the radius within float64 rounding, and nothing overflows."""
    mlp, x, x_prev, feats, y, x64, sq, _ = _case("cross_entropy", 3, "softplus", torch.float64)
    mask, scale = torch.ones(M, dtype=torch.float64), 2.0 ** power

    def sums(rad: float, s: float) -> torch.Tensor:
        radii = torch.full((K,), rad, dtype=torch.float64)
        if engine == "fused":
            up = lambda p: p._replace(grad_out=(p.grad_out * s).contiguous())  # noqa: E731
            out, over = fused.clipped_sums(request.getfixturevalue("kernel"),
                                           up(_parts(mlp, x, feats, y)), x64, sq, mask, radii,
                                           up(_parts(mlp, x_prev, feats, y)), clients=M)
        else:  # what backend._round_core does: ghost.norm_bounds, then ghost.clipped_sums
            up = lambda p: ghost.Pass(p.inputs, tuple(g * s for g in p.grads), p.loss,
                                      p.outputs)  # noqa: E731
            cur, prev = up(ghost.forward(mlp, x, feats,
                                         y).to64()), up(ghost.forward(mlp, x_prev, feats, y).to64())
            norms, upper = ghost.norm_bounds(mlp, cur, x64.T, sq, prev)
            over = ~torch.isfinite(norms)
            c = clip_factors(upper, rad)
            out = ghost.clipped_sums(cur, x64.T.reshape(M, 1, F).contiguous(), c, prev)
        assert not over.any()
        return out

    plain = scaled_row_norms(sums(math.inf, 1.0).reshape(M * K, -1))
    free = scaled_row_norms(sums(math.inf, scale).reshape(M * K, -1))
    torch.testing.assert_close(free, plain * scale, rtol=1e-13, atol=0)
    clipped = scaled_row_norms(sums(radius, scale).reshape(M * K, -1))
    assert float(clipped.max()) <= radius * (1 + 1e-12)
    torch.testing.assert_close(clipped, torch.full_like(clipped, radius), rtol=1e-12, atol=0)


# ---------------------------------------------------------------- clip factors from a sound bound:
# no clipped row ever exceeds its radius, checked exactly

#: The adversarial samples of _adversarial_parts (one client of 70: four blocks and a tail of 6).
ADVERSARIAL = {"cancelling": range(0, 32), "plain": range(32, 48), "underflow": range(48, 56),
               "overflow": range(56, 64), "huge": range(64, 70)}


def _floor_sqrt(q: Fraction) -> float:
    """The largest float r with r² <= q (q > 0, any magnitude)."""
    k = (q.numerator.bit_length() - q.denominator.bit_length()) // 2
    r = math.ldexp(math.sqrt(float(q / Fraction(2) ** (2 * k))), k)
    while Fraction(r) ** 2 > q:
        r = math.nextafter(r, 0.0)
    while Fraction(math.nextafter(r, math.inf)) ** 2 <= q:
        r = math.nextafter(r, math.inf)
    return r


def _adversarial_parts():
    """Float64 parts at x and x' of one MLP 3 -> 8 -> 2 (one client of 70 samples, the same in every
    run) built against a clip bound, and the exact squared norm of each sample's difference row
    [70] (Fractions, from the float64 dg_1, x̃, dg_L, ã, g_L', da the kernel forms): rank-two terms
    that nearly cancel (dg_L = -μ g_L' + e, da = μ a + w, small e, w: A + B up to ~3e8 times the
    bracket) with activations ~1e4 ("cancelling"); well-conditioned rows ("plain"); cancelling rows
    whose gradients are scaled by 2^-560 (squares underflow) and 2^600 (they overflow); cancelling
    rows with activations ~1e125 (multipliers above 2^400: taken by scaling, the rank-two matrix
    written out, its own cancellation, A + B up to ~1e11 times the bracket, within κ_s·width)."""
    rng = np.random.default_rng(7)
    Fd, Hd, Od, n = 3, 8, 2, 70
    x = rng.standard_normal((Fd, n))
    a = rng.uniform(1e4, 2e4, (Hd, n))
    plain, huge = ADVERSARIAL["plain"], ADVERSARIAL["huge"]
    a[:, plain] = rng.uniform(-2.0, 2.0, (Hd, len(plain)))
    a[:, huge] = rng.uniform(1e125, 2e125, (Hd, len(huge)))
    gp = rng.standard_normal((Od, n))
    mu = 10.0 ** rng.uniform(-6, -2, n)
    da = mu * a + 10.0 ** rng.uniform(-9, -3, n) * rng.standard_normal((Hd, n))
    dg = -mu * gp + 10.0 ** rng.uniform(-9, -3, n) * rng.standard_normal((Od, n))
    da[:, plain] = 0.3 * rng.standard_normal((Hd, len(plain)))
    dg[:, plain] = rng.standard_normal((Od, len(plain)))
    g, ap = gp + dg, a - da
    for name, power in (("underflow", -560), ("overflow", 600)):
        cols = ADVERSARIAL[name]
        g[:, cols], gp[:, cols] = g[:, cols] * 2.0 ** power, gp[:, cols] * 2.0 ** power
    dphi = rng.uniform(0.5, 1.0, (Hd, n))
    w2 = rng.standard_normal((Od, Hd))

    def hidden(gl):  # the kernel's backward to the hidden layer: Σ_o in order, then ⊙ φ'
        return (w2[0][:, None] * gl[0] + w2[1][:, None] * gl[1]) * dphi

    dg1, dgl, dav = hidden(g) - hidden(gp), g - gp, a - ap  # as the kernel forms them (float64)
    exact = [rank_two_sq_norm(dg1[:, m], np.append(x[:, m], 1.0))
             + rank_two_sq_norm(dgl[:, m], np.append(a[:, m], 1.0), gp[:, m],
                                np.append(dav[:, m], 0.0)) for m in range(n)]
    return (x, a, ap, g, gp, dphi, w2, hidden), exact


def _adversarial_factors(kernel, arrays, radius: torch.Tensor) -> torch.Tensor:
    """The kernel's clip factors [K, 70] of the difference rows of _adversarial_parts' arrays."""
    x, a, ap, g, gp, dphi, w2, _ = arrays
    K = len(radius)

    def runs(v):
        return torch.from_numpy(np.ascontiguousarray(v)).expand(K, *v.shape).contiguous()

    cur = fused.Parts(runs(a), runs(dphi), runs(g), runs(w2))
    prev = fused.Parts(runs(ap), runs(dphi), runs(gp), runs(w2))
    x64 = torch.from_numpy(x).contiguous()
    c, over = fused.clip_factors(kernel, cur, x64, (x64 * x64).sum(0), torch.ones(x.shape[1],
                                 dtype=torch.float64), radius, prev)
    assert not over.any()
    return c


def test_no_clipped_row_exceeds_its_radius_even_adversarially_checked_exactly(kernel, monkeypatch):
    """The kernel's clip factors c = C / U (rounded down) from an upper bound U of each true norm
    (ghost.norm_bounds: κ (A + B + |X|) on the bracket, κ (√A + 4√B) on its QR form, κ_s · width on
    a lane taken by scaling): on rows built to break it (_adversarial_parts: cancelling rank-two
    terms at activations 1e4 and 1e125, squares that underflow or overflow, and radii just below a
    row's true norm) every clipped row's TRUE norm — exact, in Fractions — is within its radius:
    c² ‖row‖² <= C², no tolerance. The bound costs little: clipped rows keep their length to 1e-6
    (measured 5e-9 at worst, on the 1e125 rows), and the factors are the torch path's (norm_bounds,
    clip_factors) to 1e-14 (measured 2 ulp). With the bound's κ set to 0 (the computed norm,
    rounded up by a few ulps only) rows of every cancelling group exceed their radius (50 of 630,
    by up to 7e-13; the former factor C / N̂: 110, the plain rows too): the test has teeth."""
    arrays, exact = _adversarial_parts()
    groups = {name: [exact[m] for m in cols] for name, cols in ADVERSARIAL.items()}
    # runs 0-3: half the smallest norm of a group (all its rows clipped); 4-8: just below the true
    # norm of one row of each group (its computed norm may read at or below the radius)
    radius = torch.tensor([0.5 * _floor_sqrt(min(groups[name])) for name in
                           ("cancelling", "underflow", "overflow", "huge")]
                          + [_floor_sqrt(exact[m]) for m in (3, 40, 50, 60, 66)],
                          dtype=torch.float64)

    def excess(c: torch.Tensor) -> list[tuple[int, int]]:  # (run, sample) of rows above the radius
        return [(k, m) for k in range(len(radius)) for m in range(len(exact))
                if Fraction(float(c[k, m])) ** 2 * exact[m] > Fraction(float(radius[k])) ** 2]

    c = _adversarial_factors(kernel, arrays, radius)
    assert excess(c) == []
    for k, name in enumerate(("cancelling", "underflow", "overflow", "huge")):
        for m in ADVERSARIAL[name]:
            assert 1 - 1e-6 < float(c[k, m]) * math.sqrt(
                float(exact[m] / Fraction(float(radius[k])) ** 2)) <= 1.0, (name, m)
    assert bool((c[4:, [3, 40, 50, 60, 66]].diagonal() < 1).all())
    # the torch path's factors for the same rows
    x, a, ap, g, gp, dphi, w2, hidden = arrays
    K = len(radius)

    def ghost_pass(act, gl):
        t = lambda v: torch.from_numpy(np.ascontiguousarray(v)).expand(K, *v.shape)  # noqa: E731
        return ghost.Pass((t(act),), (t(hidden(gl)), t(gl)), torch.zeros(K, x.shape[1]), t(gl))

    x64 = torch.from_numpy(x)
    _, upper = ghost.norm_bounds(MLP((3, 8, 2), ("softplus",), "cross_entropy"),
                                 ghost_pass(a, g), x64.T, (x64 * x64).sum(0), ghost_pass(ap, gp))
    torch.testing.assert_close(c, clip_factors(upper, radius.unsqueeze(-1)), rtol=1e-14, atol=0)
    # teeth: without the bound's κ the computed norms' rounding shows through
    monkeypatch.setattr(fused, "norm_errors", lambda F, H, O: (0.0, 0.0))
    over = excess(_adversarial_factors(kernel, arrays, radius))
    hit = {name for name, cols in ADVERSARIAL.items() for _, m in over if m in cols}
    assert {"cancelling", "underflow", "overflow", "huge"} <= hit, over


def test_the_blocked_layout_puts_each_blocks_rows_together_and_back():
    """to_blocked: per client, each block's R rows one after another, then the tail's; from_blocked
    undoes it (any N: below, at and above a block, with and without a tail; leading dimensions
    kept)."""
    # R = 2 rows, P = 2 clients of N = 20: one block of 16, a tail of 4
    t = torch.arange(2 * 40).reshape(2, 40)
    want = ([*range(0, 16), *range(40, 56), *range(16, 20), *range(56, 60)]
            + [*range(20, 36), *range(60, 76), *range(36, 40), *range(76, 80)])
    assert fused.to_blocked(t, 2, 16).reshape(-1).tolist() == want
    gen = torch.Generator().manual_seed(3)
    for shape, clients in (((3, 5, 3 * 75), 3), ((2, 7, 48), 1), ((1, 9), 9), ((4, 2, 64), 2)):
        u = torch.randn(shape, generator=gen, dtype=torch.float64)
        b = fused.to_blocked(u, clients, 16)
        assert b.shape == u.shape and not torch.equal(b, u) or shape[-1] // clients < 16
        assert torch.equal(fused.from_blocked(b, clients, 16), u)
    with pytest.raises(ValueError, match="do not split into 28 clients"):
        fused.to_blocked(t, 28, 16)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_blocked_layout_gives_the_natural_layouts_bits(kernel, dtype):
    """The kernel's forward with its inputs and parts in the blocked layout (the engine's default)
    computes the same operations on the same values: sums, overflow flags, losses and parts (back in
    rows) are the natural layout's bits — restart and difference rows, a partial last block,
    padding, a pass not kept, the unclipped sums of the evaluation, an overflow in the previous pass
    — on this machine's build and the x86-64 baseline's. A pass in one layout is refused as the
    previous pass of the other."""
    baseline = fused.FusedKernel(fused.build("DEFAULT"))
    B = kernel.block
    for loss, classes in (("half_squared_error", 1), ("cross_entropy", 3)):
        mlp, x, x_prev, feats, y, x64, sq, mask = _case(loss, classes, "softplus", dtype, seed=11)
        fb, xb = fused.to_blocked(feats, P, B), fused.to_blocked(x64, P, B)
        radius = torch.tensor([0.05, 0.5, math.inf, 2.0], dtype=torch.float64)
        restart = torch.tensor([False, True, False, False])
        prev_n = _forward(kernel, mlp, x_prev, feats, y, x64, sq, mask, radius)[2]
        want = _forward(kernel, mlp, x, feats, y, x64, sq, mask, radius, prev_n, restart)
        for kern in (kernel, baseline):
            prev_b = _forward(kern, mlp, x_prev, fb, y, xb, sq, mask, radius, blocked=True)[2]
            assert prev_b.blocked and torch.equal(fused.from_blocked(prev_b.a, P, B), prev_n.a)
            got = _forward(kern, mlp, x, fb, y, xb, sq, mask, radius, prev_b, restart, blocked=True)
            assert torch.equal(got[0],
                               want[0]) and torch.equal(got[1], want[1]) and torch.equal(got[3],
                                                                                         want[3])
            for name in ("a", "dphi", "grad_out"):
                assert torch.equal(fused.from_blocked(getattr(got[2], name), P, B),
                                   getattr(want[2], name)), name
        lean = _forward(kernel, mlp, x, fb, y, xb, sq, mask, radius, keep=False, blocked=True)
        assert torch.equal(lean[0], _forward(kernel, mlp, x, feats, y, x64, sq, mask, radius,
                                             keep=False)[0])
        # the evaluation's unclipped sums read a kept pass by clipped_sums
        free = torch.full((K,), math.inf, dtype=torch.float64)
        assert torch.equal(fused.clipped_sums(kernel, got[2], xb, sq, mask, free, clients=P)[0],
                           fused.clipped_sums(kernel, want[2], x64, sq, mask, free, clients=P)[0])
        # an overflow in the previous pass is found at its sample (client 2, run 2, in the tail of
        # its samples)
        for at in (2 * N + 7, 2 * N + 66):
            bad_n = prev_n._replace(a=prev_n.a.clone())
            bad_n.a[2, 4, at] = math.inf
            bad_b = prev_b._replace(a=fused.to_blocked(bad_n.a, P, B))
            over_n = _forward(kernel, mlp, x, feats, y, x64, sq, mask, radius, bad_n, restart)[1]
            over_b = _forward(kernel, mlp, x, fb, y, xb, sq, mask, radius, bad_b, restart,
                              blocked=True)[1]
            assert over_n[2, 2] and torch.equal(over_b, over_n), at
        with pytest.raises(ValueError, match="prev is in the blocked layout and this pass is not"):
            _forward(kernel, mlp, x, feats, y, x64, sq, mask, radius, prev_b, restart)


def test_the_engine_runs_the_kernels_forward_in_the_blocked_layout_with_the_same_bits(monkeypatch):
    """The batched engine's kernel-forward groups are in the blocked layout; the runs (iterates,
    evaluations) are the bits they are with the groups left in rows."""
    from diff2_flwr.lab import backend

    if fused.load() is None:
        pytest.skip("no C++ compiler here: the kernel cannot be built")
    data, specs = _specs()
    made = []
    init = backend.FusedBackend.__init__

    def spy(self, *a, **kw):
        init(self, *a, **kw)
        made.append(self)
    monkeypatch.setattr(backend.FusedBackend, "__init__", spy)
    for dtype in (torch.float64, torch.float32):
        made.clear()
        blocked = run_batch(data, specs, rounds=ROUNDS, eval_every=2, dtype=dtype)
        assert made and all(g.blocked for b in made for g in b.groups)
        with monkeypatch.context() as m:
            m.setattr(backend.ClientGroup, "to_blocked", lambda self, block: self)
            rows = run_batch(data, specs, rounds=ROUNDS, eval_every=2, dtype=dtype)
        assert not made[-1].groups[0].blocked
        for a, b in zip(blocked, rows):
            assert np.array_equal(a.final_x, b.final_x)
            for key in ("train_loss", "grad_norm_sq", "test_loss"):
                assert np.array_equal(getattr(a, key), getattr(b, key), equal_nan=True), key


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_exactly_zero_rows_are_exact_and_agree_with_the_torch_path(kernel, dtype):
    """A saturated softmax makes a record's output gradient exactly 0 (at both iterates): its row is
    exactly zero, so its squares lost nothing to underflow, and the kernel takes it without the
    rescaled pass (its norm 0 and width 0, what that pass gives: the same factors). Two runs'
    output weights x 1e4 (logit gaps of thousands): their rows of well-classified records are zero,
    unclipped at any positive radius; the clipped sums equal the torch path's, which rescales them,
    to 1e-13."""
    mlp, x, x_prev, feats, y, x64, sq, mask = _case("cross_entropy", 2, "tanh", dtype)
    w2 = slice(H * F + H, H * F + H + 2 * H)  # the output layer's weights
    x, x_prev = x.clone(), x_prev.clone()
    for v in (x, x_prev):  # runs 0 and 2 saturated: g_L exactly 0
        v[[0, 2], w2] *= 1e4
    cur, prev = _parts(mlp, x, feats, y), _parts(mlp, x_prev, feats, y)
    zero = (cur.grad_out == 0).all(1) & (prev.grad_out == 0).all(1)  # [K, M]
    assert float(zero[[0, 2]].double().mean()) > 0.3 and not bool(zero[[1, 3]].any())
    radius = torch.full((K,), 0.05, dtype=torch.float64)
    for differences in (False, True):
        pv = prev if differences else None
        factors, _ = fused.clip_factors(kernel, cur, x64, sq, mask, radius, pv, clients=P)
        assert bool((factors[zero] == mask.expand(K, -1)[zero]).all())
        got, over = fused.clipped_sums(kernel, cur, x64, sq, mask, radius, pv, clients=P)
        ref, ref_over, _ = _torch_path(mlp, x, x_prev, feats, y, x64, sq, mask, radius, None,
                                       differences)
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-13 * float(ref.abs().max()))
        assert not over.any() and not ref_over.any()
