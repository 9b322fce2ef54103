"""The fused kernel's two-valued columns (core/fused.py, ``two_valued``): the first layer's sums of
the columns that take two values from per-record minority sums. Against the dense path: float64
mode to rounding, float32 mode within its proved bound; the same bits twice, alone or in a batch,
on any instruction set; replace-one sensitivity at most 2C in float32 mode, checked exactly,
wherever the record sits and whichever columns it is in the minority of (or outside the layout: an
exception); teeth; the engine on one-hot data as ``prepare`` standardises it, its refusals, the
study key; and one round on KDD Cup 99's real shapes (``realdata``)."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from diff2_flwr.core import fused, ghost
from diff2_flwr.core.ghost import MLP

# P clients of N = 68 blocks of 16 and a tail of 12: two lane windows (blocks 0-63, 64-68), 17
# product blocks of 64 and a partial one; the last 6 samples of each client padding. F = 40: 22
# two-valued columns (20 binary of several frequencies, one constant 0, one constant 1.3), 18 dense.
F, H, N, K, P = 40, 6, 1100, 3, 3
M = P * N
TWO = 22
CASES = [("half_squared_error", 1, "softplus"), ("cross_entropy", 3, "tanh")]


@pytest.fixture(scope="module")
def kernel() -> fused.FusedKernel:
    k = fused.load()
    if k is None:
        pytest.skip("no C++ compiler here: the kernel cannot be built")
    return k


def _features(gen: torch.Generator) -> torch.Tensor:
    """[F, M] float32: 20 standardised binary columns (minority frequencies 2 % .. 50 %), a constant
    0 and a constant 1.3 column, then dense normal columns."""
    feats = 1.5 * torch.randn(F, M, generator=gen, dtype=torch.float64)
    for j in range(20):
        bit = (torch.rand(M, generator=gen, dtype=torch.float64) < 0.02 + 0.024 * j).double()
        feats[j] = (bit - bit.mean()) / bit.std(unbiased=False)
    feats[20], feats[21] = 0.0, 1.3
    return feats.float()


def _case(loss: str, classes: int, activation: str, seed: int = 0):
    """An MLP, iterates x and x_prev, inputs [F, M] float32, targets, mask (padding 0)."""
    mlp = MLP((F, H, classes), (activation,), loss)
    gen = torch.Generator().manual_seed(seed)
    x = 0.4 * torch.randn(K, mlp.dim, generator=gen, dtype=torch.float64)
    x_prev = x + torch.tensor([1e-3, 0.3, 1e-2], dtype=torch.float64).unsqueeze(1) * torch.randn(
        K, mlp.dim, generator=gen, dtype=torch.float64)
    feats = _features(gen)
    y = (torch.randn(M, generator=gen, dtype=torch.float64) if classes == 1 else
         torch.randint(0, classes, (M,), generator=gen).to(torch.float64)).float()
    mask = torch.ones(P, N, dtype=torch.float64)
    mask[:, -6:] = 0
    return mlp, x, x_prev, feats, y, mask.reshape(-1)


def _parts(mlp: MLP, x: torch.Tensor, feats: torch.Tensor, y: torch.Tensor) -> fused.Parts:
    a, dphi, g, _ = ghost.forward_head(mlp, x, feats, y)
    return fused.Parts(a.contiguous(), dphi.contiguous(), g.contiguous(),
                       mlp.layers(x.to(feats.dtype))[1][0].contiguous())


def _layout(feats: torch.Tensor, mask: torch.Tensor):
    x64 = feats.to(torch.float64).contiguous()
    return fused.two_valued_columns(x64.T[mask > 0])


def _sums(kernel, cur, prev, restart, feats, mask, radius, accumulate, layout=None, clients=P):
    """The kernel's clipped sums [P, K, d] with W_1's by products: dense (layout None) or with the
    two-valued columns of ``layout`` (cols, base, minor)."""
    x64 = feats.to(torch.float64).contiguous()
    rows = x64.T.reshape(clients, -1, F).contiguous()
    tv = None
    if layout is not None:
        tv = fused.two_valued(rows, mask, *layout)
        rows = rows[..., tv.dense].contiguous()
    x_rows = fused.product_rows(rows) if accumulate == "float32" else rows
    return fused.clipped_sums(kernel, cur, x64, (x64 * x64).sum(0), mask, radius, prev, restart,
                              clients=clients, x_rows=x_rows, accumulate=accumulate,
                              two_valued=tv)[0]


def _radii(mlp, x, feats, y, mask):
    """Radii that clip every row of run 0, about half of run 1's, none of run 2's."""
    x64 = feats.to(torch.float64).contiguous()
    norms, _ = ghost.norm_bounds(mlp, ghost.forward(mlp, x, feats, y).to64(), x64.T,
                                 (x64 * x64).sum(0))
    med = norms[:, mask > 0].median(1).values
    return torch.stack([0.01 * med[0], med[1], 1e3 * med[2]]).contiguous()


ROWS = {"restart": (False, None), "difference": (True, None),
        "mixed": (True, torch.tensor([True, False, False]))}


def _entries(tv: fused.TwoValued, N: int) -> dict[int, list[tuple[int, float]]]:
    """Record (of the group's P·N) -> its entries (slot, -1 - slot for an exception; value), from
    the layout's blocks and groups, checking their order: groups by signed slot within a block, rows
    ascending within a group."""
    nb = -(-N // fused.TWO_VALUED_BLOCK)
    out: dict[int, list[tuple[int, float]]] = {}
    for b in range(tv.blocks.numel() - 1):
        p, blk = divmod(b, nb)
        keys = []
        for g in range(int(tv.blocks[b]), int(tv.blocks[b + 1])):
            s = int(tv.groups[g])
            keys.append(s)
            rows = tv.rows[tv.starts[g]:tv.starts[g + 1]].tolist()
            assert rows == sorted(rows) and len(rows) > 0
            for r, v in zip(rows, tv.value[tv.starts[g]:tv.starts[g + 1]].tolist()):
                out.setdefault(p * N + blk * fused.TWO_VALUED_BLOCK + r, []).append((s, v))
        assert keys == sorted(keys)
    return {r: sorted(e, key=lambda sv: sv[0] if sv[0] >= 0 else -1 - sv[0])
            for r, e in out.items()}


def test_the_layout_and_its_entries():
    """Detection over the records: the binary and constant columns, not the dense ones; the base
    is the value of smaller magnitude, which after centring is the majority's; per record its
    non-base columns, none for padding, grouped by block of 256 samples and column; a record outside
    the layout (a third value) is an exception entry with its own value; ‖base‖ rounded up."""
    gen = torch.Generator().manual_seed(0)
    feats = _features(gen).to(torch.float64)
    mask = torch.ones(M, dtype=torch.float64)
    mask[-6:] = 0
    cols, base, minor = fused.two_valued_columns(feats.T[mask > 0].contiguous())
    assert cols.tolist() == list(range(TWO))
    for j in range(20):
        col = feats[j, mask > 0]
        assert int((col == base[j]).sum()) > int((col == minor[j]).sum())
        assert abs(float(base[j])) < abs(float(minor[j]))
    assert base[20] == minor[20] == 0 and base[21] == minor[21] == np.float32(1.3)
    rows = feats.T.reshape(P, N, F).contiguous()
    rows[1, 5, 3] = 7.0  # a third value: an exception
    tv = fused.two_valued(rows, mask, cols, base, minor)
    got = _entries(tv, N)
    flat = rows.reshape(M, F)
    for r in range(M):
        want = ([] if mask[r] == 0 else
                [(t, float(flat[r, t])) for t in range(TWO) if flat[r, t] != base[t]])
        want = [(t if v == minor[t] else -1 - t, v) for t, v in want]
        assert got.get(r, []) == want, r
    assert (-4, 7.0) in got[N + 5]
    assert tv.dense.tolist() == list(range(TWO, F))
    sq = sum(Fraction(b) ** 2 for b in base.tolist())
    assert Fraction(tv.spread) ** 2 >= sq > Fraction(math.nextafter(tv.spread, 0)) ** 2


@pytest.mark.parametrize("loss,classes,activation", CASES)
def test_float64_mode_equals_the_dense_path_to_rounding(kernel, loss, classes, activation):
    """Float64 accumulation: the same clip factors and overflow flags; the sums equal the dense
    path's (a float64 matrix product) to 1e-12 of their terms' scale Σ_n |x_nj| C per entry (the
    combination b (S - S_min) + m S_min rounds relative to the totals; the dense columns' product
    has another shape), every other entry the same bits."""
    mlp, x, x_prev, feats, y, mask = _case(loss, classes, activation)
    cur, prev = _parts(mlp, x, feats, y), _parts(mlp, x_prev, feats, y)
    radius = _radii(mlp, x, feats, y, mask)
    radius[2] = math.inf
    layout = _layout(feats, mask)
    absx = (feats.to(torch.float64).abs() * mask).reshape(F, P, N).sum(-1).T  # [P, F]
    for name, (differences, restart) in ROWS.items():
        pv = prev if differences else None
        ref = _sums(kernel, cur, pv, restart, feats, mask, radius, "float64")
        got = _sums(kernel, cur, pv, restart, feats, mask, radius, "float64", layout)
        w1 = slice(0, H * F)
        assert torch.equal(got[..., H * F:], ref[..., H * F:]), name
        gap = (got[..., w1] - ref[..., w1]).reshape(P, K, H, F).abs()
        for k in range(2):  # clipped runs: |u| <= C
            bound = 1e-12 * float(radius[k]) * absx[:, None, :]
            assert bool((gap[:, k] <= bound).all()), (name, k)
        scale = float(ref[:, 2, w1].abs().max())
        assert float(gap[:, 2].max()) <= 1e-12 * scale * N, name
        assert float(gap.max()) > 0  # another order of operations: not the same bits


@pytest.mark.parametrize("loss,classes,activation", CASES)
def test_float32_mode_is_within_its_proved_bound(kernel, monkeypatch, loss, classes, activation):
    """Float32 accumulation with the path: its clip factors are float64 mode's at its own C' (ρ
    with B = ‖base‖) with κ + δ, and its sums are within ρ·N·C of float64 accumulation's with those
    factors (in practice far inside: below 1e-3 of it); the two-valued entries closer still (below
    1e-5 of it: their sums are float64, only c S dg_1 is rounded to float32)."""
    mlp, x, x_prev, feats, y, mask = _case(loss, classes, activation, seed=1)
    cur, prev = _parts(mlp, x, feats, y), _parts(mlp, x_prev, feats, y)
    radius = _radii(mlp, x, feats, y, mask)
    layout = _layout(feats, mask)
    x64 = feats.to(torch.float64).contiguous()
    rows = x64.T.reshape(P, N, F).contiguous()
    tv = fused.two_valued(rows, mask, *layout)
    rho = fused.accumulation_error(N, tv.spread)
    assert fused.accumulation_error(N) < rho < 3.46e-4
    shrunk, _ = fused.float32_radii(radius, N, tv.spread)
    kappa, kappa_s = fused.norm_errors(F, H, classes)
    for name, (differences, restart) in ROWS.items():
        pv = prev if differences else None
        got = _sums(kernel, cur, pv, restart, feats, mask, radius, "float32", layout)
        c32, _ = fused.clip_factors(kernel, cur, x64, (x64 * x64).sum(0), mask, radius, pv,
                                    restart, clients=P, accumulate="float32",
                                    x_rows=fused.product_rows(rows[..., tv.dense].contiguous()),
                                    two_valued=tv)
        with monkeypatch.context() as m:
            m.setattr(fused, "norm_errors", lambda *w: (kappa + fused.FORMING_ERROR,
                                                        kappa_s + fused.FORMING_ERROR))
            ref = _sums(kernel, cur, pv, restart, feats, mask, shrunk, "float64")
            c64, _ = fused.clip_factors(kernel, cur, x64, (x64 * x64).sum(0), mask, shrunk, pv,
                                        restart, clients=P)
        assert torch.equal(c32, c64), name
        gap = (got - ref).norm(dim=-1)
        bound = rho * N * radius
        assert bool((gap[:, :2] <= 1e-3 * bound[:2]).all()), (name, gap / bound)
        two = (got - ref)[..., :H * F].reshape(P, K, H, F)[..., :TWO].norm(dim=(-2, -1))
        assert bool((two[:, :2] <= 1e-5 * bound[:2]).all()), (name, two / bound)


def test_the_bits_do_not_depend_on_the_other_runs_clients_nor_instruction_set(kernel):
    """Both modes: the same inputs give the same bits; a run alone (or two of three) gets its bits
    in the batch; a client alone (its own entries, the same layout) gets its bits; the x86-64
    baseline build (SSE2) gives this machine's. (Float64 mode's dense columns are a BLAS product,
    whose bits may depend on its shape, as without the path: every other entry is compared.)"""
    baseline = fused.FusedKernel(fused.build("DEFAULT"))
    mlp, x, x_prev, feats, y, mask = _case("cross_entropy", 3, "softplus", seed=4)
    cur, prev = _parts(mlp, x, feats, y), _parts(mlp, x_prev, feats, y)
    radius = torch.tensor([0.05, math.inf, 0.5], dtype=torch.float64)
    restart = torch.tensor([False, True, False])
    layout = _layout(feats, mask)
    for acc in ("float64", "float32"):
        got = _sums(kernel, cur, prev, restart, feats, mask, radius, acc, layout)
        assert torch.equal(got, _sums(kernel, cur, prev, restart, feats, mask, radius, acc,
                                      layout))
        keep = torch.ones(got.shape[-1], dtype=torch.bool)
        if acc == "float64":
            keep[:H * F] = (torch.arange(H * F) % F < TWO)
        for sub in ([2, 0], [1], [0]):
            pick = lambda p: p._replace(**{f: getattr(p, f)[sub].contiguous()  # noqa: E731
                                           for f in p._fields[:4]})
            alone = _sums(kernel, pick(cur), pick(prev), restart[sub], feats, mask,
                          radius[sub].contiguous(), acc, layout)
            assert torch.equal(alone[..., keep], got[:, sub][..., keep]), (acc, sub)
        cols = slice(N, 2 * N)
        one = lambda p: fused.Parts(p.a[..., cols].contiguous(),  # noqa: E731
                                    p.dphi[..., cols].contiguous(),
                                    p.grad_out[..., cols].contiguous(), p.w_out)
        client = _sums(kernel, one(cur), one(prev), restart, feats[:, cols].contiguous(),
                       mask[cols].contiguous(), radius, acc, layout, clients=1)
        assert torch.equal(client[0][..., keep], got[1][..., keep]), acc
        x64 = feats.to(torch.float64).contiguous()
        rows = x64.T.reshape(P, N, F).contiguous()
        tv = fused.two_valued(rows, mask, *layout)
        dense = rows[..., tv.dense].contiguous()
        base, _ = fused.clipped_sums(baseline, cur, x64, (x64 * x64).sum(0), mask, radius, prev,
                                     restart, clients=P, accumulate=acc, two_valued=tv,
                                     x_rows=fused.product_rows(dense) if acc == "float32"
                                     else dense)
        assert torch.equal(base, got), acc


def _replaced(mlp, x, x_prev, feats, y, i, feats_i, y_i):
    """The parts at x and x_prev and the inputs of the dataset with record i replaced (every other
    sample's bits the original's)."""
    feats2, y2 = feats.clone(), y.clone()
    feats2[:, i], y2[i] = feats_i, y_i
    out = []
    for xx in (x, x_prev):
        a, b = _parts(mlp, xx, feats, y), _parts(mlp, xx, feats2, y2)
        out.append(fused.Parts(*(torch.where(torch.arange(M) == i, tb, ta).contiguous()
                                 for ta, tb in zip(a[:3], b[:3])), a.w_out))
    return out, feats2


def _moved_sq(after: torch.Tensor, before: torch.Tensor) -> Fraction:
    return sum(((Fraction(a) - Fraction(b)) ** 2 for a, b in zip(after.tolist(), before.tolist())),
               Fraction(0))


#: Where the replaced record sits in client 1: lane windows' and product blocks' edges (blocks of
#: 64 are also the two-valued partials' fixed positions), the partial last block, the last sample.
POSITIONS = [0, 15, 63, 64, 1023, 1024, 1039, 1087, 1088, N - 7]


def test_replacing_one_record_moves_a_client_sum_by_at_most_2C_exactly(kernel):
    """Float32 mode with the path, the layout fixed (the neighbour's records need not fit it):
    the record at each position, first put in the minority of several two-valued columns and the
    majority of the others, replaced by a huge record (x ~ 1e4 in the dense columns, the other value
    of every binary column, an exception 5.5 in two of them; clipped to C'), or by its antipode
    (output gradient negated, run 0 clipping at its bound: ‖Δ‖ ≈ 2C'); plain, difference and
    restarting rows. The client's sum moves by at most 2C, exactly in Fractions, and from float64
    mode's move by at most 2ρC; the other clients keep their bits."""
    mlp, x, x_prev, feats, y, mask = _case("half_squared_error", 1, "softplus", seed=3)
    layout = _layout(feats, mask)
    cols, base, minor = layout
    radius = _radii(mlp, x, feats, y, mask)
    radius[2] = radius[1]
    rows = feats.to(torch.float64).T.reshape(P, N, F).contiguous()
    spread = fused.two_valued(rows, mask, *layout).spread
    rho = fused.accumulation_error(N, spread)
    restart = torch.tensor([False, True, False])
    tiny = torch.full((K,), 1e-9, dtype=torch.float64)
    worst = 0.0
    for offset in POSITIONS:
        i = N + offset
        f0 = feats.clone()  # record i: minority in columns 0, 3, 7, 12, majority elsewhere
        f0[:20, i] = base[:20].float()
        f0[[0, 3, 7, 12], i] = minor[[0, 3, 7, 12]].float()
        cur0, prev0 = _parts(mlp, x, f0, y), _parts(mlp, x_prev, f0, y)
        x0 = f0.to(torch.float64)
        factors = fused.clip_factors(kernel, cur0, x0, (x0 * x0).sum(0), mask, tiny,
                                     clients=P)[0]
        bound = (float(tiny[0]) / factors[0, i]).item()  # row i's norm bound U (κ, float64 mode)
        z = ghost.forward_head(mlp, x, f0, y)[2][0, 0] + y
        huge = 1e4 * f0[:, i]
        huge[:20] = torch.where(f0[:20, i] == base[:20].float(), minor[:20].float(),
                                base[:20].float())
        huge[[5, 9]] = 5.5  # exceptions
        for kind, (f_i, y_i) in (("huge", (huge, torch.tensor(1e6))),
                                 ("antipode", (f0[:, i], (2 * z[i] - y[i]).float()))):
            rad = radius.clone()
            if kind == "antipode":
                rad[0] = (1 + 2 * rho) * bound
            (cur2, prev2), f2 = _replaced(mlp, x, x_prev, f0, y, i, f_i, y_i)
            for differences in (False, True):
                pv, pv2 = (prev0, prev2) if differences else (None, None)
                rs = restart if differences else None
                after = _sums(kernel, cur2, pv2, rs, f2, mask, rad, "float32", layout)
                before = _sums(kernel, cur0, pv, rs, f0, mask, rad, "float32", layout)
                assert torch.equal(after[[0, 2]], before[[0, 2]]), (offset, kind)
                shrunk, _ = fused.float32_radii(rad, N, spread)
                ref = (_sums(kernel, cur2, pv2, rs, f2, mask, shrunk, "float64")
                       - _sums(kernel, cur0, pv, rs, f0, mask, shrunk, "float64"))
                for k in range(K):
                    C = float(rad[k])
                    moved = _moved_sq(after[1, k], before[1, k])
                    assert moved <= Fraction(2 * C) ** 2, (offset, kind, differences, k)
                    assert float(((after - before)[1, k] - ref[1, k]).norm()) <= 2 * rho * C
                    worst = max(worst, math.sqrt(moved) / (2 * C))
    assert worst > 1 - 3 * rho  # the antipodes reach about 2C' = 2C / (1 + ρ)


def _lane_window(v: np.float32, i_block: int = 32, blocks: int = 64, seed: int = 0) -> np.ndarray:
    """test_fused_f32's crafted window: one lane's 64 output gradients whose float32 partial rounds
    up after the record (v) and down after its antipode."""
    rng = np.random.default_rng(seed)
    g = np.zeros(blocks, np.float32)
    g[:i_block + 1] = v
    with_v = np.float32(0)
    for t in g[:i_block + 1]:
        with_v = np.float32(with_v + t)
    with_anti = np.float32(with_v - np.float32(2) * v)
    for b in range(i_block + 1, blocks):
        cand = (rng.uniform(-1, 1, 4096) * float(v)).astype(np.float32)
        up = (with_v + cand).astype(np.float64) - (float(with_v) + cand.astype(np.float64))
        down = (with_anti + cand).astype(np.float64) - (float(with_anti)
                                                        + cand.astype(np.float64))
        g[b] = cand[int(np.argmax(up - down))]
        with_v, with_anti = np.float32(with_v + g[b]), np.float32(with_anti + g[b])
    return g


@pytest.mark.parametrize("shrink", [True, False])
def test_without_the_shrink_a_crafted_window_exceeds_2C(kernel, monkeypatch, shrink):
    """Teeth, through the path: a client of 1,024 samples whose inputs have 16 binary and 4 dense
    columns and whose rows are their output bias's only (a = 0, φ' = 0: the W_1 sums, two-valued
    and dense, are 0), one lane holding test_fused_f32's crafted window. With ρ = 0 the record's
    replacement by its antipode moves the sum by 2C (1 + 3e-5) > 2C; with the path's ρ (3.45e-4)
    within 2C. (The path's widening over ρ — √2 on the partials' term, (3 + 2B) N γ_G(u64) — covers
    worst cases that no crafted window reaches: the crafted excess is 1/8 of m γ_m.)"""
    if not shrink:
        monkeypatch.setattr(fused, "accumulation_error", lambda n, spread=None: 0.0)
    n, width, feats_n = 1024, 2, 20
    C = 1.0
    gen = torch.Generator().manual_seed(5)
    xs = torch.randn(n, feats_n, generator=gen, dtype=torch.float64).float().double()
    xs[:, :16] = (torch.rand(n, 16, generator=gen) < 0.2).double()
    rows = xs.reshape(1, n, feats_n).contiguous()
    ones = torch.ones(n, dtype=torch.float64)
    cols, base, minor = fused.two_valued_columns(xs)
    tv = fused.two_valued(rows, ones, cols, base, minor)
    shrunk = float(fused.float32_radii(torch.tensor([C], dtype=torch.float64), n,
                                       tv.spread)[0][0])
    v = np.float32(shrunk * (1 - 1e-6))
    g = _lane_window(v)
    x_t = xs.T.contiguous()
    sq = (x_t * x_t).sum(0)

    def sums(sign_at):
        gl = torch.zeros(1, 1, n)
        gl[0, 0, ::16] = torch.from_numpy(g)
        if sign_at >= 0:
            gl[0, 0, 16 * sign_at] *= -1
        cur = fused.Parts(torch.zeros(1, width, n), torch.zeros(1, width, n), gl,
                          torch.zeros(1, 1, width))
        return fused.clipped_sums(kernel, cur, x_t, sq, ones, torch.tensor([C],
                                  dtype=torch.float64), accumulate="float32",
                                  x_rows=fused.product_rows(rows[..., tv.dense].contiguous()),
                                  two_valued=tv)[0][0, 0]

    with_v, with_anti = sums(-1), sums(32)
    assert not bool(with_v[:-1].any()) and not bool(with_anti[:-1].any())
    excess = float(with_v[-1] - with_anti[-1]) / (2 * shrunk) - 1
    assert excess > 2.5e-5
    moved = _moved_sq(with_v, with_anti)
    if shrink:
        assert moved <= Fraction(2 * C) ** 2
    else:
        assert moved > Fraction(2 * C) ** 2


# ------------------------------------------------------------------- the engine and the study key


def _onehot_data(clients: int = 3, n: int = 1500, seed: int = 0):
    """A classification dataset prepared as ``prepare`` prepares one: three categorical features
    one-hot (5 + 8 + 6 columns), 3 binary flags and 14 numbers — 36 features, 22 of them two-valued
    after standardisation — split, standardised and sharded."""
    from diff2_flwr.task.data import prepare

    rng = np.random.default_rng(seed)
    blocks = []
    for k, p in ((5, [0.5, 0.2, 0.15, 0.1, 0.05]), (8, None), (6, [0.7] + [0.06] * 5)):
        idx = rng.choice(k, size=n, p=p)
        blocks.append(np.eye(k)[idx])
    blocks.append((rng.random((n, 3)) < [0.1, 0.3, 0.5]).astype(float))
    blocks.append(rng.standard_normal((n, 14)))
    x = np.concatenate(blocks, axis=1)
    y = (x @ rng.standard_normal(36) > 0).astype(float)
    return prepare("onehot", x, y, clients=clients, classes=("a", "b"))


def _specs():
    from diff2_flwr.lab.sweep import RunSpec

    return [RunSpec(T, 0.3, 1.0, 0.5, 0.8, 0.9, s, s) for T, s in ((3, 1), (1, 2))]


@pytest.mark.parametrize("accumulate", ["float64", "float32"])
def test_the_engine_runs_the_path_on_request(kernel, accumulate):
    """run_batch(two_valued=True) on one-hot data as prepare standardises it (layout from the test
    split: 22 columns, the rare categories' absent ones exceptions if any): the same runs as without
    it — float64 accumulation to rounding, float32 to its radius shrink's size (~1e-4)."""
    from diff2_flwr.lab import backend
    from diff2_flwr.lab.sweep import run_batch

    data = _onehot_data()
    b = backend.Batch(data, torch.float32)
    assert b.two_valued_columns()[0].numel() >= 22
    rounds = 6
    kw = dict(rounds=rounds, eval_every=3, dtype=torch.float32, accumulate=accumulate)
    off = run_batch(data, _specs(), **kw)
    on = run_batch(data, _specs(), two_valued=True, **kw)
    tol = 1e-9 if accumulate == "float64" else 2e-3
    for a, c in zip(off, on):
        np.testing.assert_allclose(c.final_x, a.final_x, rtol=0,
                                   atol=tol * np.abs(a.final_x).max())
        np.testing.assert_allclose(c.train_loss, a.train_loss, rtol=tol)


def test_the_path_is_refused_where_it_cannot_apply(kernel, monkeypatch):
    """Refused in one line, naming two_valued and what to do: with the kernel's forward (few
    features), with fewer two-valued columns than pay, with a deeper MLP (the torch backend); the
    study key must be a boolean and needs engine batch."""
    from diff2_flwr.lab import backend
    from diff2_flwr.lab.study.spec import StudyError, parse_study
    from diff2_flwr.lab.sweep import run_batch

    data = _onehot_data()
    with pytest.raises(ValueError, match=r"two_valued needs at least 40 columns .* found 2\d of "
                                         r"36\. Drop two_valued"):
        monkeypatch.setattr(fused, "TWO_VALUED_MIN_COLUMNS", 40)
        run_batch(data, _specs(), rounds=1, two_valued=True)
    monkeypatch.undo()
    monkeypatch.setattr(backend, "KERNEL_W1_FEATURES", 64)
    with pytest.raises(ValueError, match=r"two_valued is for torch's forward with more than 64 "
                                         r"features .* found 36 features and the kernel's forward"):
        run_batch(data, _specs(), rounds=1, two_valued=True)
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"two_valued is the fused kernel's .* found widths "
                                         r"\(36, 10, 10, 2\)"):
        backend.choose_backend(MLP((36, 10, 10, 2), ("softplus", "softplus"), "cross_entropy"),
                               backend.Batch(data, torch.float32), 2, two_valued=True)
    from test_study_methods import DIFF2, _smoke

    with pytest.raises(StudyError, match=r"key `two_valued`: expected false unless engine is "
                                         r"'batch'"):
        parse_study(_smoke(DIFF2, two_valued=True, engine="inprocess"), "s.yaml")
    with pytest.raises(StudyError, match=r"key `two_valued`"):
        parse_study(_smoke(DIFF2, two_valued="yes"), "s.yaml")
    assert parse_study(_smoke(DIFF2, two_valued=True), "s.yaml").two_valued is True
    assert parse_study(_smoke(DIFF2), "s.yaml").two_valued is False


@pytest.mark.realdata  # reads the whole KDD Cup 99 10 % file (≈ 10 s) and runs one round (≈ 20 s)
def test_one_kdd_round_equals_the_dense_paths(kernel, data_dir):
    """KDD Cup 99's real shapes (10 clients of 39,522 records, 118 features, 86-87 two-valued from
    the test split, the paper MLP, K = 4 runs): one difference round's sums with the path against
    without — float64 accumulation to 1e-11 of the sums' scale, float32 within its ρ·N·C bound; the
    same overflow flags."""
    from diff2_flwr.lab import backend
    from diff2_flwr.lab.sweep import batch_model
    from diff2_flwr.runtime.config import parse_config
    from diff2_flwr.runtime.session import load_data

    if not (data_dir / "kddcup99").is_dir():
        pytest.skip("no KDD Cup 99 beside the other datasets")
    cfg = parse_config({"dataset": {"name": "kddcup99", "dir": str(data_dir)}, "method": "gd",
                        "training": {"clients": 10, "rounds": 1}})
    data = load_data(cfg)
    runs = 4
    inits = [batch_model(data, init_seed=s) for s in range(runs)]
    mlp = inits[0][0]
    x = torch.stack([torch.as_tensor(x0) for _, x0 in inits]).to(torch.float64)
    other = x + 1e-3 * torch.randn(x.shape, generator=torch.Generator().manual_seed(0),
                                   dtype=torch.float64)
    b = backend.Batch(data, torch.float32)
    assert b.two_valued_columns()[0].numel() >= 86
    radius = torch.tensor([0.05, 0.5, 2.0, math.inf], dtype=torch.float64)
    every, none = torch.ones(runs, dtype=torch.bool), torch.zeros(runs, dtype=torch.bool)
    rho = None
    for acc in ("float64", "float32"):
        outs = []
        for tv in (False, True):
            be = backend.FusedBackend(kernel, mlp, b, runs, accumulate=acc, two_valued=tv)
            be.round(x, every, radius, train=False)
            outs.append(be.round(other, none, radius, train=False))
            if tv:
                rho = fused.accumulation_error(b.N, be.groups[0].two_valued.spread)
        (off, on) = outs
        assert torch.equal(off.overflow, on.overflow)
        gap = (on.sums - off.sums).norm(dim=-1)  # [P, K]
        if acc == "float64":
            assert float(gap.max()) <= 1e-11 * float(off.sums.norm(dim=-1).max())
        else:  # both within ρ N C of the float64 sums at their C': of each other within 2 ρ N C
            bound = 2 * rho * b.N * radius[:3]
            assert bool((gap[:, :3] <= bound).all()), gap[:, :3] / bound
