"""Edges of the private path: float32 clipping, radii that overflow, gradients that overflow, and
the batched engine's radius and projection against the server's (issue 9, item 2)."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch

from diff2_flwr.core.aggregation import Reply, RoundRejected, average_contributions, robust_norm
from diff2_flwr.core.closed_form import PaperMLPGradients
from diff2_flwr.core.ghost import MLP
from diff2_flwr.core.estimator import (
    Diff2State, Diverged, Mechanism, RoundPlan, difference_radius, plan_round,
)
from diff2_flwr.core.gradients import PerSampleGradients
from diff2_flwr.core.layout import ParameterLayout
from diff2_flwr.fl import protocol
from diff2_flwr.lab import backend, sweep
from diff2_flwr.lab.study.runner import parse_study, run_study
from diff2_flwr.runtime.config import parse_config
from diff2_flwr.runtime.driver import run_inprocess
from diff2_flwr.runtime.session import build_server, build_worker, load_data
from diff2_flwr.task.losses import get_loss
from diff2_flwr.task.models import build_model

F, H = 8, 10


def _norms(v: np.ndarray) -> float:
    """The larger of the two float64 norms (the server's scaled one and numpy's)."""
    return max(robust_norm(v), float(np.linalg.norm(v)))


def _gradients(kind: str):
    model = build_model("paper_mlp", in_features=F, out_features=1, hidden=H, init_seed=0)
    if kind == "closed_form":
        return PaperMLPGradients(ParameterLayout.of(model), dtype=torch.float32)
    return PerSampleGradients(model, get_loss("half_squared_error"), dtype=torch.float32,
                              chunk_size=128)


# ------------------------------------------------------------------ 1. float32 clipping


@pytest.mark.parametrize("kind", ["closed_form", "torch_func"])
def test_float32_clipping_never_exceeds_the_radius(kind):
    """500 identical samples, all clipped, in float32: the worker's ClippedMean has norm <= radius
    with no tolerance (by both float64 norms), and the server accepts every round. With float32 clip
    factors and sums the closed form exceeded the radius by ~1e-6 (and the server rejected some
    rounds); float64 sums without a final projection exceeded it by an ulp."""
    g = _gradients(kind)
    rng = np.random.default_rng(20261130)
    for trial in range(60):
        x = rng.normal(size=g.layout.dim)
        row = rng.normal(size=F) * rng.uniform(0.1, 3.0)
        features = torch.tensor(np.tile(row, (500, 1)), dtype=torch.float32)
        targets = torch.full((500,), float(rng.normal()), dtype=torch.float32)
        radius = float(rng.uniform(1e-4, 1e-2))
        restart = trial % 2 == 0
        x_prev = None if restart else x + rng.normal(size=g.layout.dim)
        c = g.clipped_mean(x, features, targets, radius, x_prev)
        assert c.num_clipped == 500
        assert _norms(
            c.mean) <= radius, f"trial {trial}: norm/radius - 1 = {_norms(c.mean) / radius - 1:.3g}"
        plan = RoundPlan(round=trial + 1, restart=restart, radius=radius, noise_std=0.0,
                         x_current=x, x_previous=x_prev)
        agg = average_contributions(plan, g.layout, [Reply("partition 0", 0, g.layout.split(c.mean),
                                                           500, 500)],
                                    clients=1, n_min=500)
        np.testing.assert_array_equal(agg.mean, c.mean)  # accepted, and not projected by the server


@pytest.mark.parametrize("kind", ["closed_form", "torch_func"])
@pytest.mark.parametrize("residual,radius", [(1e-170, 1e-200), (1e200, 1.0)])
def test_per_sample_norms_neither_underflow_nor_overflow(kind, residual, radius):
    """Output weights 0 and targets -residual: every per-sample gradient is residual·(0, 0,
    softplus(h), 1), of norm ~1e-170 (its squares underflow: it passed radius 1e-200 unclipped) or
    ~1e200 (its squares overflow: an overflow report). Both per-sample paths (and so the local
    routine's steps, which call them) clip every row onto the ball, report no overflow, and reply a
    mean of norm <= radius, ~radius (identical samples)."""
    model = build_model("paper_mlp", in_features=F, out_features=1, hidden=H, init_seed=0)
    layout = ParameterLayout.of(model)
    g = (PaperMLPGradients(layout) if kind == "closed_form" else
         PerSampleGradients(model, get_loss("half_squared_error"), chunk_size=64))
    x = np.concatenate([p.detach().double().reshape(-1).numpy() for p in model.parameters()])
    x[-(H + 1):] = 0.0  # w_2, b_2
    features = torch.tensor(np.tile(np.linspace(-1, 1, F), (40, 1)), dtype=torch.float64)
    c = g.clipped_mean(x, features, torch.full((40,), -residual, dtype=torch.float64), radius)
    assert not c.overflow and c.num_clipped == 40
    assert radius * (1 - 1e-12) <= robust_norm(c.mean) <= radius


ROUNDS = 12
BASE = {"dataset": {"name": "synthetic", "num_samples": 1001}, "training": {"clients": 4,
                                                                            "rounds": ROUNDS}}
VARIANTS = [("diff2", 3, 0.2, 1.0, 3.0, 5), ("dpgd", None, 0.3, 0.5, 1.0, 6), ("diff2", 5, 0.1, 0.3,
                                                                               0.5, 8),
            ("diff2", 2, 0.4, 0.05, 0.2, 9)]


def test_float32_batched_engine_clips_as_the_per_run_path():
    """In float32 both engines run only the forward pass in float32 and clip, project and sum in
    float64, at the calibrated radius: they agree to 1e-8 after 12 rounds (the forward passes round
    differently). The batched engine used to clip to a radius shrunk by 2^-20 and sum in float32
    (3e-8 .. 1e-7 apart)."""
    for method, T, lr, c1, c2, seed in VARIANTS:
        cfg = parse_config({**BASE, "method": method, "model": {"init_seed": seed},
                            "training": {**BASE["training"], "restart_every": T,
                                         "learning_rate": lr, "dtype": "float32",
                                         "clip_restart": c1, "clip_diff": c2, "seed": seed}})
        server = run_inprocess(cfg, record=False, progress=None)
        m = cfg.mechanism(server.calibration)
        spec = sweep.RunSpec(m.restart_every, lr, m.clip_restart, m.clip_diff, m.sigma_restart,
                             m.sigma_diff, seed, seed)
        result = sweep.run_batch(load_data(cfg), [spec], rounds=ROUNDS, eval_every=ROUNDS,
                                 dtype=torch.float32)[0]
        assert np.abs(result.final_x - server.state.x).max() <= 1e-8, method


@pytest.mark.parametrize("path", ["torch", "fused"])
def test_float32_batched_client_means_never_exceed_the_radius(path):
    """The batched engine's clipped means of identical, all-clipped samples in float32, after the
    workers' last step, have norm <= radius with no tolerance, for every run and client: on the
    torch path and through the fused kernel (core/fused.py)."""
    from diff2_flwr.core import fused
    from diff2_flwr.task.data import PreparedData

    kernel = fused.load() if path == "fused" else None
    if path == "fused" and kernel is None:
        pytest.skip("no C++ compiler here: the fused kernel cannot be built")

    rng = np.random.default_rng(7)
    P, n, K = 2, 500, 16
    row = rng.normal(size=F)
    data = PreparedData(name="identical", x_train=np.tile(row, (P * n, 1)), y_train=np.full(P * n,
                                                                                            0.3),
                        x_test=np.tile(row, (3, 1)), y_test=np.full(3, 0.3),
                        shard_bounds=((0, n), (n, 2 * n)), target_scale=1.0, task="regression",
                        classes=())
    b = backend.Batch(data, torch.float32)
    mlp = MLP((F, H, 1), ("softplus",), "half_squared_error")
    for _ in range(5):
        x = torch.as_tensor(rng.normal(size=(K, mlp.dim)))
        radius = rng.uniform(1e-4, 1e-2, size=K)
        restart = torch.ones(K, dtype=torch.bool)
        if kernel is None:
            sums, overflow, *_ = backend._round_core(mlp, b.a_t, b.a64, b.y, b.sq_a, b.mask, x, (),
                                                     (), restart,
                                                   torch.as_tensor(radius), False)
        else:
            sums, overflow, *_ = backend._fused_rounds(kernel, backend._head(mlp, False), mlp,
                                                       b.groups(K, H), x, None,
                                                     None, torch.as_tensor(radius))
        means = sums / b.n.reshape(P, 1, 1)
        alive, diverged = torch.ones(K, dtype=torch.bool), [None] * K
        sweep._workers_finish(means, overflow, radius, alive, diverged, 1)
        assert bool(alive.all()) and not bool(overflow.any())
        for p in range(P):
            for k in range(K):
                assert _norms(means[p, k].numpy()) <= radius[k]


# ------------------------------------------------------------------ 2. radius and noise std


def test_the_radius_norm_neither_overflows_nor_underflows():
    big = np.zeros(101)
    big[3] = 1e160  # np.linalg.norm squares it: inf
    assert difference_radius(2.0, big, np.zeros(101)) == 2e160
    tiny = np.zeros(101)
    tiny[0] = 1e-200  # squares to 0
    assert difference_radius(1.0, tiny, np.zeros(101)) == 1e-200
    assert difference_radius(1.0, np.zeros(101), np.zeros(101)) == 0.0
    # in the ordinary range it is np.linalg.norm, bit for bit (the float64 path is unchanged)
    rng = np.random.default_rng(3)
    for _ in range(500):
        d = rng.normal(size=101) * 10.0 ** rng.uniform(-100, 100)
        assert difference_radius(0.7, d, np.zeros(101)) == 0.7 * float(np.linalg.norm(d))


def _diff2_cfg(**training):
    return parse_config({"dataset": {"name": "synthetic", "num_samples": 1001}, "method": "diff2",
                         "training": {"clients": 4, "rounds": 6, "restart_every": 3,
                                      "learning_rate": 0.2, "seed": 1, **training}})


def test_a_private_round_with_an_infinite_radius_releases_nothing():
    """x_{r-1} - x_{r-2} so large that C2 ||.|| overflows: the round is refused before any worker is
    asked (an infinite radius would skip the clipping and the norm check), named 'radius', and the
    run is marked diverged; nothing is released or charged."""
    scale = 1e307
    server = build_server(_diff2_cfg(), record=False, progress=None)
    workers = [build_worker(_diff2_cfg(), p) for p in range(4)]
    server.release([w.reply(server.plan()) for w in workers])  # round 1 (restart), honest
    d = server.state.x.size
    state = dataclasses.replace(server.state, x=np.full(d, scale), x_prev=np.full(d, -scale))
    server.state = state
    history, epsilon = list(server.history), server.epsilon_spent
    with pytest.raises(Diverged,
                       match=r"Round 2 released nothing: check 'radius' failed: the difference "
                             r"round's clipping radius .* or noise std .* is not finite") as info:
        server.plan()
    assert info.value.check == "radius" and info.value.round == 2
    assert server.state is state and server.history == history and server.epsilon_spent == epsilon
    summary = server.summary()
    assert summary["status"] == "diverged" and summary[
        "diverged_at"] == 2 and "check 'radius'" in summary["error"]


def test_plan_round_never_returns_a_private_plan_with_an_infinite_radius():
    mech = Mechanism(restart_every=3, clip_restart=1.0, clip_diff=1.0, sigma_restart=2.0,
                     sigma_diff=5.0)
    state = Diff2State(round=1, x=np.full(5, 1e200), x_prev=np.full(5, -1e200), v=np.zeros(5),
                       routine_state=None, noise_key=1, noise_seeded=True)
    # ||Δx|| = 4.5e200: finite with the scaled norm (inf with np.linalg.norm)
    plan = plan_round(state, mech)
    assert math.isfinite(plan.radius) and math.isfinite(plan.noise_std) and plan.radius > 1e200
    with pytest.raises(Diverged,
                       match=r"check 'radius' failed: the difference round's clipping radius inf"):
        plan_round(dataclasses.replace(state, x=np.full(5, 1e308), x_prev=np.full(5, -1e308)), mech)
    # a finite radius (1.3e308) whose noise std σ2 · radius (x 5) overflows is refused too
    with pytest.raises(Diverged,
                       match=r"check 'radius' failed: .* radius 1.34e\+308 or noise std inf"):
        plan_round(dataclasses.replace(state, x=np.full(5, 3e307), x_prev=np.full(5, -3e307)), mech)
    # GD (no clipping, no noise) keeps its infinite radius
    gd = Mechanism(restart_every=1, clip_restart=math.inf, clip_diff=math.inf, sigma_restart=0.0,
                   sigma_diff=0.0)
    assert plan_round(dataclasses.replace(state, round=0, x_prev=None, v=None),
                      gd).radius == math.inf


# ------------------------------------------------------------------ 3. overflowing gradients


def _diverging_cfg(method: str):
    extra = {"restart_every": 3} if method == "diff2" else {}
    return parse_config({"dataset": {"name": "synthetic", "num_samples": 1001}, "method": method,
                         "training": {"clients": 4, "rounds": 6, "learning_rate": 1e200, "seed": 1,
                                      **extra}})


@pytest.mark.parametrize("method", ["gd", "dpgd", "diff2"])
def test_gradients_that_overflow_at_a_finite_iterate_are_divergence(method):
    """lr = 1e200: x_1 is finite but the gradients at x_1 overflow. Every worker says so; the server
    reports divergence (not a privacy rejection), releases nothing, and the driver can stop
    there."""
    cfg = _diverging_cfg(method)
    with pytest.raises(Diverged,
                       match=r"Round 2 released nothing: check 'gradients' failed: partition 0, .* "
                                       r"per-sample gradients overflow at x_1"):
        run_inprocess(cfg, record=False, progress=None)
    server = run_inprocess(cfg, record=False, progress=None, stop_on_divergence=True)
    assert server.diverged_at == 2 and server.state.round == 1 and np.all(np.isfinite(
        server.state.x))
    assert server.summary()["status"] == "diverged"
    # round 1 only
    assert server.ledger is None if method == "gd" else len(server.ledger.events) == 1


def test_an_unexplained_nan_is_still_rejected_and_an_overflow_report_is_divergence():
    layout = ParameterLayout(("w", "b"), ((2, 3), (3,)))
    plan = RoundPlan(round=4, restart=True, radius=1.0, noise_std=0.0, x_current=np.zeros(9),
                     x_previous=None)
    nan = np.full(9, 0.01)
    nan[2] = np.nan
    overflow = Reply("partition 0", 0, layout.split(np.zeros(9)), 10, 0, overflow=True)
    hostile = Reply("partition 1", 1, layout.split(nan), 10, 0)
    with pytest.raises(RoundRejected, match=r"check 'finite' failed from partition 1"):
        average_contributions(plan, layout, [overflow, hostile], clients=2, n_min=10)
    honest = Reply("partition 1", 1, layout.split(np.zeros(9)), 10, 0)
    with pytest.raises(Diverged,
                       match=r"Round 4 released nothing: check 'gradients' failed: partition 0 "
                             r"report"):
        average_contributions(plan, layout, [overflow, honest], clients=2, n_min=10)
    # the report must still be a well-formed reply: a short shard is refused as before
    short = Reply("partition 0", 0, layout.split(np.zeros(9)), 5, 0, overflow=True)
    with pytest.raises(RoundRejected, match="check 'n_min'"):
        average_contributions(plan, layout, [short, honest], clients=2, n_min=10)


def test_the_overflow_flag_travels_on_the_wire_and_must_be_0_or_1():
    cfg = _diverging_cfg("gd")
    worker = build_worker(cfg, 0)
    layout = worker.gradients.layout
    task = protocol.WorkerTask(round=2, radius=math.inf, x_current=np.full(layout.dim, 1e200),
                               x_previous=None,
                                n_min=1)
    contribution = worker.contribute(task.radius, task.x_current, None)
    assert contribution.overflow and not np.any(contribution.mean)
    arrays, n, metrics = protocol.encode_reply(task, contribution, 0, layout)
    assert protocol.decode_reply("node a", arrays, n, metrics, 2).overflow
    with pytest.raises(RoundRejected,
                       match=r"check 'protocol' failed from node a: metric 'diff2.overflow' must "
                             r"be 0 or 1"):
        protocol.decode_reply("node a", arrays, n, {**metrics, protocol.OVERFLOW: 2}, 2)


def _diverging_study(engine: str, tmp_path, methods=None):
    methods = methods or [
        {"name": "GD", "method": "gd", "grid": {"learning_rate": [0.2, 1e200]}},
        {"name": "DP-GD", "method": "dpgd", "grid": {"learning_rate": [0.2, 1e200],
                                                     "clip_restart": [1.0]}},
    ]
    study = parse_study({"name": f"diverging-{engine}", "dataset": {"name": "synthetic",
                                                                    "num_samples": 1001},
                         "clients": 4, "rounds": 6, "epsilons": [3.0], "eval_every": 2,
                         "engine": engine,
                         "seeds": {"tune": [1], "evaluate": [2, 3]},
                         "analysis": {"protocol": "paper"}, "methods": methods})
    summary = run_study(study, output_root=tmp_path, show_progress=False, make_plots=False)
    runs = [json.loads(f.read_text()) for f in (tmp_path / study.name / "runs").glob("*.json")]
    return summary, runs


@pytest.mark.parametrize("engine", ["inprocess", "batch"])
def test_a_study_with_a_diverging_grid_point_completes(engine, tmp_path):
    summary, runs = _diverging_study(engine, tmp_path)
    tuned = [r for r in runs if r["run_id"].startswith("tune")]
    assert len(tuned) == 4
    for r in tuned:
        if r["point"]["learning_rate"] == 1e200:
            assert r["diverged_at"] == 2 and r["train_loss"][-1] is None  # inf on disk
        else:
            assert r["diverged_at"] is None and all(v is not None for v in r["train_loss"])
    for method in ("GD", "DP-GD"):  # the finite point is chosen, and evaluated without divergence
        info = summary["epsilons"]["3.0"]["methods"][method]["criteria"]["train_loss"]
        assert info["point"]["learning_rate"] == 0.2 and info["diverged"] == 0


# ------------------------------------------------------------------ 4. the batched engine's radius


def test_the_batched_engine_plans_the_servers_radii_bit_for_bit():
    """2,000 random (x_{r-1}, x_{r-2}) over 1e-200 .. 1e200 (and some that overflow): the batched
    engine's radius and noise std equal the server's plan bit for bit, and both refuse the same
    rounds."""
    rng = np.random.default_rng(11)
    d, K = 101, 50
    specs = [sweep.RunSpec(2, 0.1, float(rng.uniform(0.1, 5)), float(rng.uniform(0.1, 5)),
                           float(rng.uniform(0, 3)), float(rng.uniform(0, 300)), k,
                           k) for k in range(K)]
    refused = 0
    for r in (2, 3, 4, 5, 6, 7, 8, 9, 10, 12) * 4:
        scale = 10.0 ** rng.uniform(-200, 200, size=(K, 1))
        x = torch.as_tensor(rng.normal(size=(K, d)) * scale)
        x_prev = torch.as_tensor(rng.normal(size=(K, d)) * scale)
        if r == 12:
            x[: K // 2] *= 1e120  # some overflow
        restart = torch.tensor([(r - 1) % s.restart_every == 0 for s in specs])
        alive, diverged = torch.ones(K, dtype=torch.bool), [None] * K
        radius, std = sweep._plan_radii(r, specs, restart, x, x_prev, alive, diverged)
        for k, s in enumerate(specs):
            mech = Mechanism(s.restart_every, s.clip_restart, s.clip_diff, s.sigma_restart,
                             s.sigma_diff)
            state = Diff2State(round=r - 1, x=x[k].numpy(), x_prev=x_prev[k].numpy(), v=np.zeros(d),
                               routine_state=None, noise_key=0, noise_seeded=True)
            try:
                plan = plan_round(state, mech)
            except Diverged:
                assert diverged[k] == r and not alive[k]
                refused += 1
                continue
            assert alive[k] and radius[k] == plan.radius and std[k] == plan.noise_std
    assert 0 < refused < 2000


@pytest.mark.flower
def test_a_flower_study_records_a_diverged_point(tmp_path):
    """Through `flwr run`: the ServerApp's run ends as failed, the launcher sees the summary's
    ``status: diverged`` and says so (SimulationDiverged), and the study records ``diverged_at`` and
    goes on."""
    methods = [{"name": "GD", "method": "gd", "grid": {"learning_rate": [1e200]}}]
    study = parse_study({"name": "diverging-flower", "dataset": {"name": "synthetic",
                                                                 "num_samples": 1001},
                         "clients": 2, "rounds": 3, "epsilons": [3.0], "eval_every": 1,
                         "engine": "flower",
                         "seeds": {"tune": [1], "evaluate": [2]}, "analysis": {"protocol": "paper"},
                         "methods": methods})
    summary = run_study(study, output_root=tmp_path, show_progress=False, make_plots=False)
    runs = [json.loads(f.read_text()) for f in (tmp_path / study.name / "runs").glob("*.json")]
    assert len(runs) == 2 and all(r["engine"] == "flower" and r["diverged_at"] == 2 for r in runs)
    assert summary["epsilons"]["3.0"]["methods"]["GD"]["criteria"]["train_loss"]["diverged"] == 1


def test_the_workers_step_marks_divergence_and_projects_in_place():
    """The batched engine's worker step (numpy on views of the round's tensors): a run with an
    overflowed client or a non-finite mean diverges at this round — the caller's ``alive`` tensor
    and ``diverged`` list say so — and a mean just over its radius is projected, in the caller's
    tensor, onto the ball; the others are untouched."""
    P, K, d = 3, 4, 7
    rng = np.random.default_rng(11)
    means = torch.as_tensor(rng.normal(size=(P, K, d)))
    radius = np.array([10.0, 10.0, 10.0, 0.0])
    # a mean whose norm exceeds run 2's radius by float rounding only; run 2's others well inside
    over = 1.0 + 1e-14
    means[0, 2] *= 0.1
    means[2, 2] *= 0.1
    radius[2] = float(np.linalg.norm(means[1, 2].numpy())) / over
    overflow = torch.zeros(P, K, dtype=torch.bool)
    overflow[2, 0] = True  # run 0: a client's per-sample norm overflowed
    means[0, 1, 3] = math.nan  # run 1: a client's mean is not finite
    radius[3] = math.inf  # run 3: no clipping, never projected
    before = means.clone()
    alive, diverged = torch.ones(K, dtype=torch.bool), [None] * K
    sweep._workers_finish(means, overflow, radius, alive, diverged, 5)
    assert alive.tolist() == [False, False, True, True] and diverged == [5, 5, None, None]
    assert _norms(means[1, 2].numpy()) <= radius[2] < float(np.linalg.norm(before[1, 2].numpy()))
    untouched = torch.ones(P, K, dtype=torch.bool)
    untouched[1, 2] = False
    assert torch.equal(means[untouched].nan_to_num(7.0), before[untouched].nan_to_num(7.0))
