"""The fused kernel's float32 accumulation (core/fused.py, ``accumulate="float32"``): its sums
against float64 accumulation's with the same clip factors, within the proved bound ρ·N·C (and far
inside it); replace-one sensitivity at most 2C, checked exactly, wherever the record sits (windows,
product blocks, the tail); the same bits twice, alone or in a batch, on any instruction set; and
teeth: without the radius shrink a crafted window of float32 roundings moves a client sum beyond 2C.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from diff2_flwr.core import fused, ghost
from diff2_flwr.core.ghost import MLP

# P clients of N = 68 blocks of 16 and a tail of 12 (two windows of the lanes: blocks 0-63 and
# 64-68; 17 product blocks of 64 and a partial one of 12), the last 6 samples of each padding
F, H, N, K, P = 7, 10, 1100, 3, 3
M = P * N
CASES = [("half_squared_error", 1, "softplus"), ("cross_entropy", 3, "tanh")]


@pytest.fixture(scope="module")
def kernel() -> fused.FusedKernel:
    k = fused.load()
    if k is None:
        pytest.skip("no C++ compiler here: the kernel cannot be built")
    return k


def _case(loss: str, classes: int, activation: str, seed: int = 0):
    """An MLP, iterates x (close previous ones x_prev: a difference round), float32 inputs and
    targets [F, M], their float64 copy, ‖x‖² and the mask (padding 0)."""
    mlp = MLP((F, H, classes), (activation,), loss)
    gen = torch.Generator().manual_seed(seed)
    x = 0.7 * torch.randn(K, mlp.dim, generator=gen, dtype=torch.float64)
    x_prev = x + torch.tensor([1e-3, 0.3, 1e-2], dtype=torch.float64).unsqueeze(1) * torch.randn(
        K, mlp.dim, generator=gen, dtype=torch.float64)
    feats = (1.5 * torch.randn(F, M, generator=gen, dtype=torch.float64)).float()
    y = (torch.randn(M, generator=gen, dtype=torch.float64) if classes == 1 else
         torch.randint(0, classes, (M,), generator=gen).to(torch.float64)).float()
    mask = torch.ones(P, N, dtype=torch.float64)
    mask[:, -6:] = 0
    return mlp, x, x_prev, feats, y, mask.reshape(-1)


def _parts(mlp: MLP, x: torch.Tensor, feats: torch.Tensor, y: torch.Tensor) -> fused.Parts:
    a, dphi, g, _ = ghost.forward_head(mlp, x, feats, y)
    return fused.Parts(a.contiguous(), dphi.contiguous(), g.contiguous(),
                       mlp.layers(x.to(feats.dtype))[1][0].contiguous())


def _inputs(feats: torch.Tensor):
    x64 = feats.to(torch.float64).contiguous()
    return x64, (x64 * x64).sum(0), x64.T.reshape(-1, N, F).contiguous()


def _sums(kernel, cur, prev, restart, feats, mask, radius, accumulate, product, clients=P):
    """The kernel's clipped sums [P, K, d] in ``accumulate``, W_1's by the block products
    (``product``) or in the kernel's lanes."""
    x64, sq, rows = _inputs(feats)
    x_rows = None
    if product:
        x_rows = fused.product_rows(rows) if accumulate == "float32" else rows
    return fused.clipped_sums(kernel, cur, x64, sq, mask, radius, prev, restart, clients=clients,
                              x_rows=x_rows, accumulate=accumulate)[0]


def _product_rows(feats, product):
    """Float32 accumulation's ``x_rows`` where W_1's sums are block products (its radii shrink for
    a record in two partials), else None."""
    return fused.product_rows(_inputs(feats)[2]) if product else None


ROWS = {"restart": (False, None), "difference": (True, None),
        "mixed": (True, torch.tensor([True, False, False]))}


def _radii(mlp, x, feats, y, mask):
    """Radii that clip every row of run 0, about half of run 1's, none of run 2's (median norm of
    the plain rows)."""
    x64, sq, _ = _inputs(feats)
    norms, _ = ghost.norm_bounds(mlp, ghost.forward(mlp, x, feats, y).to64(), x64.T, sq)
    med = norms[:, mask > 0].median(1).values
    return torch.stack([0.01 * med[0], med[1], 1e3 * med[2]]).contiguous()


@pytest.mark.parametrize("loss,classes,activation", CASES)
@pytest.mark.parametrize("product", [False, True], ids=["lanes", "product"])
def test_float32_sums_are_float64_sums_within_the_proved_bound(kernel, monkeypatch, loss, classes,
                                                               activation, product):
    """Float32 accumulation takes the clip factors that float64 accumulation takes at C' with κ + δ
    (bit for bit), and its sums are within ρ·N·C of float64 accumulation's with those factors, per
    client and run: the proof's bound on a window's or product block's rounding (ρ = 2.4e-4). In
    practice far inside it: below 1e-3 of it here (measured up to 6.2e-5 of it, 1.5e-8·N·C, 6.4e-8
    of the sum's own norm: a partial's roundings cancel on average, and the rows do not all point
    one way)."""
    mlp, x, x_prev, feats, y, mask = _case(loss, classes, activation)
    cur, prev = _parts(mlp, x, feats, y), _parts(mlp, x_prev, feats, y)
    radius = _radii(mlp, x, feats, y, mask)
    shrunk, _ = fused.float32_radii(radius, N, products=product)
    rho = fused.accumulation_error(N, products=product)
    kappa, kappa_s = fused.norm_errors(F, H, classes)
    x64, sq, _ = _inputs(feats)
    for name, (differences, restart) in ROWS.items():
        pv = prev if differences else None
        got = _sums(kernel, cur, pv, restart, feats, mask, radius, "float32", product)
        c32, _ = fused.clip_factors(kernel, cur, x64, sq, mask, radius, pv, restart, clients=P,
                                    accumulate="float32", x_rows=_product_rows(feats, product))
        with monkeypatch.context() as m:  # float64 accumulation with float32's clipping
            m.setattr(fused, "norm_errors", lambda *w: (kappa + fused.FORMING_ERROR,
                                                        kappa_s + fused.FORMING_ERROR))
            ref = _sums(kernel, cur, pv, restart, feats, mask, shrunk, "float64", product)
            c64, _ = fused.clip_factors(kernel, cur, x64, sq, mask, shrunk, pv, restart,
                                        clients=P)
        assert torch.equal(c32, c64), name
        if name == "restart":
            assert float((c32[0, mask > 0] < 1).double().mean()) > 0.9
            assert bool((c32[2] == mask).all())
        gap = (got - ref).norm(dim=-1)  # [P, K]
        bound = rho * N * radius
        assert bool((gap <= bound).all()), (name, gap / bound)
        assert bool((gap <= 1e-3 * bound).all()), (name, gap / bound)
    # κ + δ only ever lowers a factor, by a few ulp at most here
    c_plain, _ = fused.clip_factors(kernel, cur, x64, sq, mask, shrunk, pv, restart, clients=P)
    assert bool((c32 <= c_plain).all())
    torch.testing.assert_close(c32, c_plain, rtol=1e-13, atol=0)


def _replaced(mlp, x, x_prev, feats, y, i, feats_i, y_i):
    """The parts at x and x_prev, and the inputs, of the dataset with record i replaced by (feats_i,
    y_i): every other sample's bits are the original's (spliced)."""
    feats2, y2 = feats.clone(), y.clone()
    feats2[:, i], y2[i] = feats_i, y_i
    out = []
    for xx in (x, x_prev):
        a, b = _parts(mlp, xx, feats, y), _parts(mlp, xx, feats2, y2)
        out.append(fused.Parts(*(torch.where(torch.arange(M) == i, tb, ta).contiguous()
                                 for ta, tb in zip(a[:3], b[:3])), a.w_out))
    return out, feats2


def _moved_sq(after: torch.Tensor, before: torch.Tensor) -> Fraction:
    """‖after - before‖² exactly (Fractions of the float64 entries)."""
    return sum(((Fraction(a) - Fraction(b)) ** 2 for a, b in zip(after.tolist(), before.tolist())),
               Fraction(0))


#: Where the replaced record sits, per client of 1,100: a window's first and last lane samples, a
#: product block's edges, the partial last block and the last real sample.
POSITIONS = [0, 15, 63, 64, 1023, 1024, 1039, 1087, 1088, N - 7]


@pytest.mark.parametrize("product", [False, True], ids=["lanes", "product"])
def test_replacing_one_record_moves_a_client_sum_by_at_most_2C_exactly(kernel, product):
    """Replace-one, the record at each position of POSITIONS (in client 1): replaced by a huge one
    (x ~ 1e4, target ~ 1e6: clipped to C'), or by its antipode (its output gradient negated: its
    row negated) with run 0's radius at the record's own norm bound (both rows on the boundary:
    ‖Δ‖ = 2C' to rounding); plain, difference and restarting rows. The client's sum moves by at most
    2C — checked exactly, in Fractions of the float64 sums — and from float64 accumulation's move
    (same clip factors) by at most 2ρC; the other clients' sums keep their bits."""
    mlp, x, x_prev, feats, y, mask = _case("half_squared_error", 1, "softplus", seed=3)
    radius = _radii(mlp, x, feats, y, mask)
    radius[2] = radius[1]
    rho = fused.accumulation_error(N, products=product)
    z = ghost.forward_head(mlp, x, feats, y)[2][0, 0] + y  # run 0's outputs [M]
    x64, sq, _ = _inputs(feats)
    # each row's bound U': at a radius tiny below every row's norm, clipped at tiny' = tiny / (1 +
    # ρ), a factor is tiny' / U'
    tiny = torch.full((K,), 1e-9, dtype=torch.float64)
    factors = fused.clip_factors(kernel, _parts(mlp, x, feats, y), x64, sq, mask, tiny, clients=P,
                                 accumulate="float32", x_rows=_product_rows(feats, product))[0]
    bounds = fused.float32_radii(tiny, N, products=product)[0][0] / factors
    restart = torch.tensor([False, True, False])
    cur, prev = _parts(mlp, x, feats, y), _parts(mlp, x_prev, feats, y)
    worst = 0.0
    for offset in POSITIONS:
        i = N + offset
        for kind, (f_i, y_i) in (("huge", (1e4 * feats[:, i], torch.tensor(1e6))),
                                 ("antipode", (feats[:, i], (2 * z[i] - y[i]).float()))):
            rad = radius.clone()
            if kind == "antipode":  # run 0 clips at about the record's bound: C' ≈ U'
                rad[0] = (1 + rho) * float(bounds[0, i])
            (cur2, prev2), feats2 = _replaced(mlp, x, x_prev, feats, y, i, f_i, y_i)
            for differences in (False, True):
                pv, pv2 = (prev, prev2) if differences else (None, None)
                rs = restart if differences else None
                after = _sums(kernel, cur2, pv2, rs, feats2, mask, rad, "float32", product)
                before = _sums(kernel, cur, pv, rs, feats, mask, rad, "float32", product)
                assert torch.equal(after[[0, 2]], before[[0, 2]]), (offset, kind)
                delta = after - before
                shrunk, _ = fused.float32_radii(rad, N, products=product)
                ref = (_sums(kernel, cur2, pv2, rs, feats2, mask, shrunk, "float64", product)
                       - _sums(kernel, cur, pv, rs, feats, mask, shrunk, "float64", product))
                for k in range(K):
                    C = float(rad[k])
                    moved = _moved_sq(after[1, k], before[1, k])
                    assert moved <= Fraction(2 * C) ** 2, (offset, kind, differences, k)
                    assert float((delta[1, k] - ref[1, k]).norm()) <= 2 * rho * C
                    worst = max(worst, math.sqrt(moved) / (2 * C))
                if kind == "antipode" and not differences:  # both rows on the boundary
                    moved = _moved_sq(after[1, 0], before[1, 0])
                    assert 1 - 1e-6 < math.sqrt(moved) / (2 * float(shrunk[0]))
    assert worst > 1 - 2 * rho  # the antipodes reach 2C' = 2C / (1 + ρ)


def test_the_bits_do_not_depend_on_the_other_runs_clients_nor_instruction_set(kernel):
    """Float32 accumulation is deterministic: the same inputs give the same bits; a run alone (or
    two of three) gets the bits it gets in the batch, lanes and block products alike (the kernel's
    own float32 products: a BLAS product's bits depend on its shape — MKL's sgemm gives other bits
    for a run's rows with 7 features in a product of 20 rows than of 30); a client alone gets its
    bits; the x86-64 baseline build (SSE2) gives this machine's bits; the kernel's forward pass
    gives the sums of torch's parts to rounding."""
    baseline = fused.FusedKernel(fused.build("DEFAULT"))
    mlp, x, x_prev, feats, y, mask = _case("cross_entropy", 3, "softplus", seed=4)
    cur, prev = _parts(mlp, x, feats, y), _parts(mlp, x_prev, feats, y)
    radius = torch.tensor([0.05, math.inf, 0.5], dtype=torch.float64)
    restart = torch.tensor([False, True, False])
    x64, sq, rows = _inputs(feats)
    for product in (False, True):
        got = _sums(kernel, cur, prev, restart, feats, mask, radius, "float32", product)
        assert torch.equal(got, _sums(kernel, cur, prev, restart, feats, mask, radius, "float32",
                                      product))
        for sub in ([2, 0], [1], [0]):
            pick = lambda p: p._replace(**{f: getattr(p, f)[sub].contiguous()  # noqa: E731
                                           for f in p._fields[:4]})
            alone = _sums(kernel, pick(cur), pick(prev), restart[sub], feats, mask,
                          radius[sub].contiguous(), "float32", product)
            assert torch.equal(alone, got[:, sub]), (product, sub)
        cols = slice(N, 2 * N)
        one = lambda p: fused.Parts(p.a[..., cols].contiguous(),  # noqa: E731
                                    p.dphi[..., cols].contiguous(),
                                    p.grad_out[..., cols].contiguous(), p.w_out)
        client = _sums(kernel, one(cur), one(prev), restart, feats[:, cols].contiguous(),
                       mask[cols].contiguous(), radius, "float32", product, clients=1)
        assert torch.equal(client[0], got[1])
        base, _ = fused.clipped_sums(baseline, cur, x64, sq, mask, radius, prev, restart,
                                     clients=P, accumulate="float32",
                                     x_rows=fused.product_rows(rows) if product else None)
        assert torch.equal(base, got)
    # the kernel's forward pass and the blocked layout: the same sums as from torch's parts
    B = kernel.block
    out = fused.forward_sums(kernel, x.float().contiguous(), fused.to_blocked(feats, P, B), y,
                             "softplus", "cross_entropy", fused.to_blocked(x64, P, B), sq, mask,
                             radius, hidden=H, outputs=3, clients=P, blocked=True,
                             accumulate="float32")
    plain = _sums(kernel, cur, None, None, feats, mask, radius, "float32", False)
    torch.testing.assert_close(out[0], plain, rtol=0, atol=1e-5 * float(plain.abs().max()))


# ------------------------------------------------------------- teeth: the shrink is needed


def _lane_window(v: np.float32, i_block: int = 32, blocks: int = 64, seed: int = 0) -> np.ndarray:
    """Output gradients (float32) of one lane's 64 samples — one window, one float32 partial: v at
    blocks 0 .. i_block (the record at i_block), then values in [-v, v] chosen one by one so that
    the partial's roundings go up with the record and down with its antipode -v."""
    rng = np.random.default_rng(seed)
    g = np.zeros(blocks, np.float32)
    g[:i_block + 1] = v
    with_v = np.float32(0)
    for t in g[:i_block + 1]:
        with_v = np.float32(with_v + t)
    with_anti = np.float32(with_v - np.float32(2) * v)  # exact: the partial 32 v - v
    for b in range(i_block + 1, blocks):
        cand = (rng.uniform(-1, 1, 4096) * float(v)).astype(np.float32)
        up = (with_v + cand).astype(np.float64) - (float(with_v) + cand.astype(np.float64))
        down = (with_anti + cand).astype(np.float64) - (float(with_anti)
                                                        + cand.astype(np.float64))
        g[b] = cand[int(np.argmax(up - down))]
        with_v, with_anti = np.float32(with_v + g[b]), np.float32(with_anti + g[b])
    return g


def _one_lane_sums(kernel, g_lane: np.ndarray, sign_at: int, radius: float):
    """Sums [d] of one client of 1,024 samples (one window) whose rows are their output bias's
    only (a = 0, φ' = 0: ‖row‖ = |g_L|): lane 0 holds g_lane (sign_at's negated if sign_at >= 0),
    the other lanes 0; and the clip factors."""
    n, width = 1024, 2
    gl = torch.zeros(1, 1, n)
    gl[0, 0, ::16] = torch.from_numpy(g_lane)
    if sign_at >= 0:
        gl[0, 0, 16 * sign_at] *= -1
    cur = fused.Parts(torch.zeros(1, width, n), torch.zeros(1, width, n), gl,
                      torch.zeros(1, 1, width))
    zeros, ones = torch.zeros(1, n, dtype=torch.float64), torch.ones(n, dtype=torch.float64)
    rad = torch.tensor([radius], dtype=torch.float64)
    sums, _ = fused.clipped_sums(kernel, cur, zeros, zeros[0], ones, rad, accumulate="float32")
    c, _ = fused.clip_factors(kernel, cur, zeros, zeros[0], ones, rad, accumulate="float32")
    return sums[0, 0], c


@pytest.mark.parametrize("shrink", [True, False])
def test_without_the_shrink_a_crafted_window_exceeds_2C(kernel, monkeypatch, shrink):
    """Teeth. One lane's window: 32 records of norm v ≈ C' (unclipped), the replaced record (v or
    its antipode -v), then 31 records (same in both) chosen so that the float32 partial rounds up
    after the record and down after its antipode, by up to an ulp of the partial (~32 C' u32) each.
    The float32 sums are exactly this simulation's (numpy float32). With C' = C (no shrink: ρ = 0)
    the sum moves by 2C (1 + 3.05e-5) > 2C — 85 times the rows' own float32 rounding (γ_6 = 3.6e-7),
    so the window term m γ_m of ρ is the one needed; with the shrink (ρ = 2.445e-4, 8x the crafted
    excess) it stays within 2C."""
    if not shrink:
        monkeypatch.setattr(fused, "accumulation_error", lambda n, *a, **k: 0.0)
    C = 1.0
    shrunk = float(fused.float32_radii(torch.tensor([C], dtype=torch.float64), 1024)[0][0])
    v = np.float32(shrunk * (1 - 1e-6))
    g = _lane_window(v)
    with_v, c1 = _one_lane_sums(kernel, g, -1, C)
    with_anti, c2 = _one_lane_sums(kernel, g, 32, C)
    assert bool((c1 == 1).all()) and bool((c2 == 1).all())  # nothing clipped: rows ≤ C'
    # the kernel's sums are the float32 lane partial's, bit for bit
    for sums, lane in ((with_v, g), (with_anti, np.where(np.arange(64) == 32, -g, g))):
        partial = np.float32(0)
        for t in lane:
            partial = np.float32(partial + t)
        assert float(sums[-1]) == float(partial) and not bool(sums[:-1].any())
    excess = float(with_v[-1] - with_anti[-1]) / (2 * shrunk) - 1
    assert excess > 2.5e-5
    moved = _moved_sq(with_v, with_anti)
    if shrink:
        assert moved <= Fraction(2 * C) ** 2
        assert excess < fused.accumulation_error(1024) / 5
    else:
        assert moved > Fraction(2 * C) ** 2


def test_bad_arguments_are_refused(kernel):
    mlp, x, _, feats, y, mask = _case("half_squared_error", 1, "softplus")
    cur = _parts(mlp, x, feats, y)
    x64, sq, rows = _inputs(feats)
    radius = torch.ones(K, dtype=torch.float64)
    with pytest.raises(ValueError, match="accumulate must be one of"):
        fused.clipped_sums(kernel, cur, x64, sq, mask, radius, clients=P, accumulate="half")
    cur64 = fused.Parts(*(t.double() for t in cur[:4]))
    with pytest.raises(ValueError, match="accumulate='float32' is for the float32 compute dtype"):
        fused.clipped_sums(kernel, cur64, x64, sq, mask, radius, clients=P, accumulate="float32")
    with pytest.raises(ValueError, match=r"x_rows must be a contiguous float32 tensor of shape "
                                         r"\(3, 1152, 16\) \(fused.product_rows\)"):
        fused.clipped_sums(kernel, cur, x64, sq, mask, radius, clients=P, x_rows=rows.float(),
                           accumulate="float32")
    with pytest.raises(ValueError, match=r"radii 0, inf or in \[2\^-900"):
        fused.clipped_sums(kernel, cur, x64, sq, mask, torch.full((K,), 1e-300,
                                                                  dtype=torch.float64),
                           clients=P, accumulate="float32")
    with pytest.raises(ValueError, match="beyond float32's range"):
        fused.product_rows(torch.full((1, 2, 3), 1e39, dtype=torch.float64))


def test_radii_and_scales():
    """C' = C / (1 + ρ) rounded down (0 and inf kept), S a power of two with S·C' in [2^62, 2^63);
    ρ ≈ 2.445e-4 (m γ_64(2^-24) = 2.441e-4) and grows with N only in its float64 part."""
    radius = torch.tensor([0.0, math.inf, 1.0, 3e-7, 2.0**-900, 1e300], dtype=torch.float64)
    shrunk, scale = fused.float32_radii(radius, 1652)
    rho = fused.accumulation_error(1652)
    assert 2.444e-4 < rho < 2.446e-4 and rho < fused.accumulation_error(400_000) < 2.5e-4
    assert shrunk[0] == 0 and shrunk[1] == math.inf and scale[0] == 1 and scale[1] == 1
    for c, r, s in zip(radius[2:].tolist(), shrunk[2:].tolist(), scale[2:].tolist()):
        assert Fraction(r) * (1 + Fraction(rho)) <= Fraction(c)
        assert r > c * (1 - 2 * rho)
        assert math.frexp(s)[0] == 0.5 and 2.0**62 <= r * s < 2.0**63


def test_the_engine_runs_float32_accumulation_on_request():
    """run_batch(accumulate="float32") on a float32 batch: the same runs as float64 accumulation to
    the radius shrink's size (the iterates move by ~1e-4 of their scale), the lanes and the block
    products alike; refused for a float64 batch."""
    from diff2_flwr.lab import backend
    from diff2_flwr.lab.sweep import RunSpec, run_batch
    from diff2_flwr.runtime.config import parse_config
    from diff2_flwr.runtime.session import load_data

    if fused.load() is None:
        pytest.skip("no C++ compiler here: the kernel cannot be built")
    rounds = 6
    cfg = parse_config({"dataset": {"name": "synthetic", "num_samples": 403}, "method": "diff2",
                        "training": {"clients": 3, "rounds": rounds, "restart_every": 3,
                                     "clip_restart": 1.0, "clip_diff": 0.5, "learning_rate": 0.3,
                                     "seed": 1}})
    data = load_data(cfg)
    m = cfg.mechanism(cfg.calibration(data.n_min))
    specs = [RunSpec(T, 0.3, 1.0, 0.5, m.sigma_restart, m.sigma_diff, s, s)
             for T, s in ((3, 1), (1, 2))]
    f64 = run_batch(data, specs, rounds=rounds, eval_every=rounds, dtype=torch.float32)
    f32 = run_batch(data, specs, rounds=rounds, eval_every=rounds, dtype=torch.float32,
                    accumulate="float32")
    for a, b in zip(f64, f32):
        assert not np.array_equal(a.final_x, b.final_x)
        np.testing.assert_allclose(b.final_x, a.final_x, rtol=0,
                                   atol=1e-3 * np.abs(a.final_x).max())
    old = backend.KERNEL_W1_FEATURES
    try:
        backend.KERNEL_W1_FEATURES = 0  # W_1's sums by the float32 block products
        by_product = run_batch(data, specs, rounds=rounds, eval_every=rounds, dtype=torch.float32,
                               accumulate="float32")
    finally:
        backend.KERNEL_W1_FEATURES = old
    for a, b in zip(f32, by_product):  # the block products clip shorter, by ~1e-4 (√2 m γ_m)
        np.testing.assert_allclose(b.final_x, a.final_x, rtol=0,
                                   atol=1e-3 * np.abs(a.final_x).max())
        assert not np.array_equal(a.final_x, b.final_x)
    with pytest.raises(ValueError, match="accumulate must be 'float64', or 'float32' for a "
                                         "float32 batch"):
        run_batch(data, specs, rounds=1, accumulate="float32")
