"""The batched sweep engine against the reference driver (the code the Flower path runs)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diff2_flwr.runtime.config import parse_config
from diff2_flwr.runtime.driver import run_inprocess
from diff2_flwr.runtime.session import load_data
from diff2_flwr.lab.sweep import RunSpec, run_batch

ROUNDS = 12
BASE = {"dataset": {"name": "synthetic", "num_samples": 1001}, "training": {"clients": 4,
                                                                            "rounds": ROUNDS}}
# (method, T, lr, C1, C2, seed): a mixed batch of GD, DP-GD and DIFF2 with different periods
VARIANTS = [("diff2", 3, 0.2, 1.0, 3.0, 5), ("dpgd", None, 0.3, 0.5, 1.0, 6), ("gd", None, 0.2, 1.0,
                                                                               1.0, 7),
            ("diff2", 5, 0.1, 0.3, 0.5, 8), ("diff2", 2, 0.4, 0.05, 0.2, 9)]
# ... and every routine (a 7th element; the runs above use gd), mixed into the same batch
VARIANTS += [("diff2", 3, 0.1, 1.0, 3.0, 10, {"name": "momentum", "momentum": 0.8}),
             ("dpgd", None, 0.1, 0.5, 1.0, 11, "nesterov"), ("diff2", 4, 0.02, 1.0, 3.0, 12,
                                                             {"name": "adam", "beta1": 0.8}),
             ("gd", None, 0.02, 1.0, 1.0, 13, "adamw"), ("diff2", 2, 0.03, 0.3, 0.5, 14,
                                                         {"name": "adam", "weight_decay": 0.01})]
# ... and every step-size schedule (an 8th element), the first two with the same routine and
# learning rate as the second run above: runs that differ by their schedule alone must not share a
# step
VARIANTS += [("dpgd", None, 0.3, 0.5, 1.0, 6, "gd", {"name": "step", "decay": 0.5, "every": 3}),
             ("dpgd", None, 0.3, 0.5, 1.0, 6, "gd", {"name": "cosine", "floor": 0.1}),
             ("diff2", 3, 0.1, 1.0, 3.0, 15, {"name": "momentum", "momentum": 0.8}, "inverse_sqrt"),
             ("diff2", 4, 0.02, 1.0, 3.0, 16, "adamw", "cosine"),
             ("gd", None, 0.2, 1.0, 1.0, 17, "gd", {"name": "step", "every": 5})]


@pytest.fixture(scope="module")
def reference():
    servers, specs = [], []
    for method, T, lr, c1, c2, seed, *steps in VARIANTS:
        routine, schedule = (*steps, "gd", "constant")[0], (*steps[1:], "constant")[0]
        cfg = parse_config({**BASE, "method": method, "model": {"init_seed": seed},
                            "training": {**BASE["training"], "restart_every": T,
                                         "learning_rate": lr,
                                         "clip_restart": c1, "clip_diff": c2, "seed": seed,
                                         "routine": routine, "schedule": schedule}})
        server = run_inprocess(cfg, record=False, progress=None)
        m, r, s = cfg.mechanism(server.calibration), cfg.training.routine, cfg.training.schedule
        servers.append(server)
        specs.append(RunSpec(m.restart_every, lr, m.clip_restart, m.clip_diff, m.sigma_restart,
                             m.sigma_diff, seed, seed, routine=r.name,
                             routine_params=tuple(sorted(r.params().items())), schedule=s.name,
                             schedule_params=tuple(sorted(s.params().items()))))
    return load_data(cfg), servers, specs


def test_batched_engine_equals_the_reference_driver(reference):
    data, servers, specs = reference
    results = run_batch(data, specs, rounds=ROUNDS, eval_every=1)
    for server, result in zip(servers, results):
        assert np.abs(server.state.x - result.final_x).max() <= 1e-12
        assert list(result.rounds) == [h["round"] for h in server.history]
        for key in ("train_loss", "grad_norm_sq", "test_loss"):
            np.testing.assert_allclose(getattr(result, key), [h[key] for h in server.history],
                                       rtol=1e-11, atol=1e-15)
        assert result.diverged_at is None


def test_batch_composition_does_not_change_a_run(reference):
    data, _, specs = reference
    alone = run_batch(data, specs[:1], rounds=ROUNDS, eval_every=4)[0]
    together = run_batch(data, specs, rounds=ROUNDS, eval_every=4)[0]
    np.testing.assert_allclose(alone.final_x, together.final_x, rtol=0, atol=1e-13)
    assert list(alone.rounds) == [0, 4, 8, 12]


def test_every_routine_runs_alone_as_in_a_mixed_batch(reference):
    data, _, specs = reference
    together = run_batch(data, specs, rounds=ROUNDS, eval_every=ROUNDS)
    assert {s.routine for s in specs} == {"gd", "momentum", "nesterov", "adam", "adamw"}
    assert {s.schedule for s in specs} == {"constant", "step", "cosine", "inverse_sqrt"}
    for k, spec in enumerate(specs):
        if spec.routine != "gd" or spec.schedule != "constant":
            alone = run_batch(data, [spec], rounds=ROUNDS, eval_every=ROUNDS)[0]
            np.testing.assert_allclose(alone.final_x, together[k].final_x, rtol=0, atol=1e-13)


def test_float32_engine_stays_close(reference):
    data, servers, specs = reference
    results = run_batch(data, specs, rounds=ROUNDS, eval_every=ROUNDS, dtype=torch.float32)
    for server, result in zip(servers, results):
        np.testing.assert_allclose(result.final_x, server.state.x, rtol=0, atol=5e-5)


def test_a_diverging_run_is_parked_and_reported(reference):
    data, _, specs = reference
    wild = RunSpec(1, 1e306, 1e6, 1e6, 0.0, 0.0, 1, 1)  # a step so large that x_r overflows to inf
    results = run_batch(data, [specs[0], wild], rounds=ROUNDS, eval_every=1)
    assert results[1].diverged_at is not None and np.isinf(results[1].train_loss[-1])
    assert results[0].diverged_at is None and np.isfinite(results[0].train_loss).all()


def test_a_parked_run_feeds_the_backend_zeros_not_its_overflowing_iterate(reference, monkeypatch):
    """After a run diverges, the backend's passes read zeros in its row, not its last iterate (inf
    in the compute dtype: a pass of inf and NaN cost the kernel 4-5 times a live run's), and the
    live run's results keep their bits."""
    from diff2_flwr.lab import sweep

    data, _, specs = reference
    wild = RunSpec(1, 1e306, 1e6, 1e6, 0.0, 0.0, 1, 1)
    alone = run_batch(data, [specs[0]], rounds=ROUNDS, eval_every=1)[0]
    seen = []
    real = sweep.choose_backend

    def spying(*args, **kwargs):
        backend = real(*args, **kwargs)
        inner = backend.round

        def round_(x, *a, **k):
            seen.append(x.clone())
            return inner(x, *a, **k)

        backend.round = round_
        return backend

    monkeypatch.setattr(sweep, "choose_backend", spying)
    together = run_batch(data, [specs[0], wild], rounds=ROUNDS, eval_every=1)
    r = together[1].diverged_at
    assert r is not None and r < ROUNDS - 1
    assert not np.isfinite(together[1].final_x.astype(np.float32)).all()  # what it used to feed
    for x in seen[r:]:  # the passes of rounds r + 1 .. R (x_r onward)
        assert bool(torch.isfinite(x).all()) and not bool(x[1].any())
    assert together[0].final_x.tobytes() == alone.final_x.tobytes()
    assert together[0].train_loss.tobytes() == alone.train_loss.tobytes()


def test_a_routine_that_is_not_post_processing_is_refused(reference, monkeypatch):
    """A routine that computes on private data (a local phase) cannot be a row update of the
    batch."""
    import dataclasses
    from typing import ClassVar

    from diff2_flwr.core import routines
    from diff2_flwr.core.routines import GD

    @dataclasses.dataclass(frozen=True)
    class Local(GD):
        name: ClassVar[str] = "local"
        post_processing: ClassVar[bool] = False

    monkeypatch.setitem(routines.ROUTINES, "local", Local)
    data, _, specs = reference
    with pytest.raises(ValueError,
                       match=r"Run 1: routine 'local' is not post-processing.*Use the inprocess "
                             r"engine"):
        run_batch(data, [specs[0], dataclasses.replace(specs[0], routine="local")], rounds=2)


# ---------------------------------------------------------------- classification: cross-entropy,
# deeper MLPs

CLS_ROUNDS = 10
# (method, T, lr, C1, C2, seed)
CLS_VARIANTS = [("diff2", 3, 0.5, 1.0, 2.0, 11), ("dpgd", None, 0.5, 0.5, 1.0, 12),
                ("gd", None, 0.5, 1.0, 1.0, 13), ("diff2", 4, 1.0, 0.2, 0.5, 14)]


def _binary_csv(path):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((600, 5))
    label = (x[:, 0] + 0.5 * x[:, 1] * x[:, 2] + 0.3 * rng.standard_normal(600) > 0).astype(int)
    rows = ["a,b,c,d,e,label"] + [",".join(f"{v:.6f}" for v in r) + f",{'yes' if t else 'no'}"
                                  for r, t in zip(x, label)]
    path.write_text("\n".join(rows) + "\n")
    return str(path)


def _classification_case(dataset: dict, model: dict, clients: int):
    servers, specs = [], []
    for method, T, lr, c1, c2, seed in CLS_VARIANTS:
        cfg = parse_config({"dataset": dataset, "method": method, "model": {**model,
                                                                            "init_seed": seed},
                            "training": {"clients": clients, "rounds": CLS_ROUNDS,
                                         "restart_every": T,
                                         "learning_rate": lr, "clip_restart": c1, "clip_diff": c2,
                                         "seed": seed, "dtype": "float64"}})
        # the reference's workers take the generic torch.func path, in the batched engine's float64
        # (auto would compute a factory model in float32)
        assert not cfg.closed_form_gradients
        server = run_inprocess(cfg, record=False, progress=None)
        m = cfg.mechanism(server.calibration)
        servers.append(server)
        specs.append(RunSpec(m.restart_every, lr, m.clip_restart, m.clip_diff, m.sigma_restart,
                             m.sigma_diff, seed, seed))
    return cfg, load_data(cfg), servers, specs


@pytest.fixture(scope="module", params=["digits-10-classes-paper-mlp", "csv-2-classes-tanh-mlp"])
def classification(request, tmp_path_factory):
    if request.param.startswith("digits"):
        return _classification_case({"name": "digits"}, {"hidden": 10}, clients=3)
    path = _binary_csv(tmp_path_factory.mktemp("cls") / "binary.csv")
    return _classification_case({"name": "csv", "path": path, "target": "label",
                                 "task": "classification"},
                                {"name": "diff2_flwr.task.models:TanhMLP", "kwargs": {"hidden": 6}},
                                clients=4)


def test_batched_engine_equals_the_torch_func_reference_on_classification(classification):
    cfg, data, servers, specs = classification
    m = cfg.model
    results = run_batch(data, specs, rounds=CLS_ROUNDS, eval_every=1, model=m.name,
                        hidden=m.hidden_units, model_kwargs=m.kwargs.as_dict())
    n_test = len(data.y_test)
    for server, result in zip(servers, results):
        assert np.abs(server.state.x - result.final_x).max() <= 1e-12
        assert list(result.rounds) == [h["round"] for h in server.history]
        for key in ("train_loss", "grad_norm_sq", "test_loss"):
            np.testing.assert_allclose(getattr(result, key), [h[key] for h in server.history],
                                       rtol=1e-11, atol=1e-15)
        # argmax of float64 logits from two code paths: a tie within rounding may flip one record,
        # no more
        np.testing.assert_allclose(result.test_accuracy,
                                   [h["test_accuracy"] for h in server.history], rtol=0,
                                   atol=1.01 / n_test)
        assert result.diverged_at is None
    # it learns something
    assert any(r.test_accuracy[-1] > r.test_accuracy[0] + 0.05 for r in results)


def test_batched_engine_refuses_a_model_it_has_no_closed_form_for():
    data = load_data(parse_config({"dataset": {"name": "digits"}, "method": "gd",
                                   "training": {"clients": 2}}))
    spec = RunSpec(1, 0.1, 1.0, 1.0, 0.0, 0.0, 0, 0)
    with pytest.raises(ValueError,
                       match=r"model 'diff2_flwr.task.models:DigitsCNN' with loss 'cross_entropy' "
                             r"is not one\. Use engine: inprocess"):
        run_batch(data, [spec], rounds=1, model="diff2_flwr.task.models:DigitsCNN",
                  model_kwargs={"channels": 2})
    # classes need cross-entropy
    with pytest.raises(ValueError, match="loss 'half_squared_error' is not one"):
        run_batch(data, [spec], rounds=1, loss="half_squared_error")


# ------------------------------------------------------------------------------------------- the
# device (issue 24)
CUDA = torch.cuda.is_available()


def test_device_names_resolve_or_are_refused_with_what_torch_sees():
    from diff2_flwr.lab.sweep import resolve_device

    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cuda" if CUDA else "cpu")
    for bad in ("gpu", "tpu:0"):
        with pytest.raises(ValueError, match="device"):
            resolve_device(bad)
    if not CUDA:
        with pytest.raises(ValueError,
                           match=r"'cuda:1' was asked for, but torch sees 0 CUDA device"):
            resolve_device("cuda:1")


def test_a_study_declares_its_device_and_only_the_batched_engine_takes_a_gpu():
    from diff2_flwr.lab.study.spec import StudyFile
    from diff2_flwr.runtime.config import ConfigError, parse_section

    base = {"name": "d", "dataset": {"name": "synthetic"}, "clients": 2, "rounds": 2,
            "epsilons": [3.0],
            "seeds": {"tune": [0, 1, 2], "evaluate": [3]}, "methods": [{"name": "GD",
                                                                        "method": "gd"}]}
    assert parse_section(StudyFile, {**base, "device": "cuda:0"}, "study").device == "cuda:0"
    with pytest.raises(ConfigError, match="device"):
        parse_section(StudyFile, {**base, "device": "gpu"}, "study")
    with pytest.raises(ConfigError, match="device"):
        parse_section(StudyFile, {**base, "device": "cuda", "engine": "inprocess"}, "study")


def test_the_torch_backend_hands_the_server_cpu_tensors(reference):
    """The server's step (radii, noise, routines) reads the backend's sums on the CPU whatever the
    batch's device: the torch backend's outputs are CPU tensors and the engine run through it equals
    the reference driver."""
    from diff2_flwr.lab.backend import Batch, TorchBackend
    from diff2_flwr.lab.sweep import batch_model

    data, servers, specs = reference
    mlp, x0 = batch_model(data, init_seed=0)
    backend = TorchBackend(mlp, Batch(data, torch.float64, "cpu"), 2)
    x = torch.as_tensor(np.stack([x0, x0]))
    out = backend.round(x, torch.tensor([True, True]),
                        torch.tensor([1.0, 2.0], dtype=torch.float64), train=True)
    assert {t.device.type for t in (out.sums, out.overflow, *out.train)} == {"cpu"}
    assert out.sums.shape == (len(data.shard_sizes), 2, len(x0))


@pytest.mark.skipif(not CUDA, reason="no CUDA device: the GPU path runs where torch sees one")
def test_the_engine_runs_on_a_gpu_and_agrees_with_the_cpu(reference):
    """Issue 24, item 4: on a GPU the same engine runs (the torch backend there, the server's step
    on the CPU). Stated tolerance: float64 on the GPU reorders sums (cuBLAS, reductions), so the
    iterates after ROUNDS rounds agree with the CPU's to 1e-9 absolute (the CPU paths agree to
    1e-12), the metrics to 1e-8 relative."""
    data, servers, specs = reference
    cpu = run_batch(data, specs, rounds=ROUNDS, eval_every=4)
    gpu = run_batch(data, specs, rounds=ROUNDS, eval_every=4, device="cuda")
    for a, b in zip(cpu, gpu):
        np.testing.assert_allclose(b.final_x, a.final_x, rtol=0, atol=1e-9)
        for key in ("train_loss", "grad_norm_sq", "test_loss"):
            np.testing.assert_allclose(getattr(b, key), getattr(a, key), rtol=1e-8, atol=1e-15)


# ----------------------------------------------------------------------- the round loop, bit for
# bit: run_batch's bookkeeping (planned radii, workers' projection, noise drawn ahead, routines on
# stacked rows, parking) against the plainest loop over the same backend, one run at a time


@np.errstate(all="ignore")  # runs that diverge overflow
def _loop_one_run_at_a_time(data, specs, *, rounds, eval_every, dtype=torch.float64,
                            accumulate="float64"):
    """run_batch's results by the reference's steps, per run and round and without shortcuts: the
    server's round_scale and round_noise, the worker's onto_ball on every client mean, the run's own
    routine at round r on its own vector; only the backend's pass, torch's sum over the clients and
    the metrics are the engine's (they are not what this checks)."""
    from diff2_flwr.core.clipping import onto_ball
    from diff2_flwr.core.estimator import Diverged, round_noise, round_scale
    from diff2_flwr.core.schedules import routine_at
    from diff2_flwr.lab.backend import Batch, choose_backend
    from diff2_flwr.lab.sweep import _metrics, _results, batch_model

    K = len(specs)
    inits = [batch_model(data, init_seed=s.init_seed) for s in specs]
    mlp, b = inits[0][0], Batch(data, dtype, "cpu")
    backend = choose_backend(mlp, b, K, accumulate=accumulate)
    x = [x0.copy() for _, x0 in inits]
    x_prev, v = [xk.copy() for xk in x], [np.zeros_like(xk) for xk in x]
    routines = [(s.make_routine(), s.make_schedule()) for s in specs]
    states = [rt.init(xk) for (rt, _), xk in zip(routines, x)]
    alive, diverged, evals = [True] * K, [None] * K, []

    def park(k, r):
        diverged[k], alive[k] = r, False
        x[k] = np.nan_to_num(x[k], nan=0.0)
        x_prev[k], v[k] = x[k].copy(), np.zeros_like(x[k])

    for r in range(1, rounds + 1):
        restart = [(r - 1) % s.restart_every == 0 for s in specs]
        live = list(alive)
        radius, std, dead_now = np.zeros(K), np.zeros(K), set()
        for k, s in enumerate(specs):
            if alive[k]:
                try:
                    radius[k], std[k] = round_scale(
                        r, restart[k], s.clip_restart if restart[k] else s.clip_diff,
                        s.sigma_restart if restart[k] else s.sigma_diff, x[k],
                        None if restart[k] else x_prev[k])
                except Diverged:
                    dead_now.add(k)
        evaluated = (r - 1) % eval_every == 0 or r == 1
        keep = not all(r % s.restart_every == 0 for s in specs)
        xs = torch.as_tensor(np.stack(x))
        out = backend.round(xs, torch.tensor(restart), torch.as_tensor(radius), train=evaluated,
                            keep=keep)
        if evaluated:
            evals.append(_metrics(r - 1, mlp, b, xs, torch.tensor(live), out.train))
        means = (out.sums / b.n.reshape(-1, 1, 1)).numpy()  # [P, K, d]
        for k in range(K):
            if not alive[k] or k in dead_now:
                continue
            if bool(out.overflow[:, k].any()) or not np.isfinite(means[:, k]).all():
                dead_now.add(k)
                continue
            for p in range(b.P):
                means[p, k] = onto_ball(means[p, k], float(radius[k]))
        mean = (torch.from_numpy(means).sum(0) / b.P).numpy()  # the engine's averaging
        for k, s in enumerate(specs):
            if not alive[k]:
                continue
            if k in dead_now:
                park(k, r)
                continue
            v[k] = mean[k].copy() if restart[k] else v[k] + mean[k]
            if std[k]:
                v[k] = v[k] + round_noise(s.noise_seed, r, len(v[k]), std[k])
            routine, schedule = routines[k]
            step = routine_at(routine, schedule, r, rounds)
            new, states[k] = step.update(x[k], v[k], states[k])
            if np.isfinite(new).all():
                x_prev[k], x[k] = x[k], new
            else:
                park(k, r)
    xs = torch.as_tensor(np.stack(x))
    evals.append(_metrics(rounds, mlp, b, xs, torch.tensor(alive), backend.train(xs)))
    return _results(specs, evals, xs.numpy(), diverged,
                    classification=mlp.loss == "cross_entropy")


def _assert_bit_identical(results, expected):
    for k, (got, want) in enumerate(zip(results, expected)):
        assert got.diverged_at == want.diverged_at, k
        for key in ("rounds", "train_loss", "grad_norm_sq", "test_loss", "final_x"):
            a, b = getattr(got, key), getattr(want, key)
            assert (a.dtype, a.shape, a.tobytes()) == (b.dtype, b.shape, b.tobytes()), (k, key)


def _identical_rows(P=3, n=200, F=8):
    """Every sample the same: so is every per-sample gradient, each clipped client mean lies on its
    radius up to rounding, and the workers' scalar check runs."""
    from diff2_flwr.task.data import PreparedData

    row = np.random.default_rng(7).normal(size=F)
    return PreparedData(name="identical", x_train=np.tile(row, (P * n, 1)),
                        y_train=np.full(P * n, 0.3), x_test=np.tile(row, (3, 1)),
                        y_test=np.full(3, 0.3),
                        shard_bounds=tuple((p * n, (p + 1) * n) for p in range(P)),
                        target_scale=1.0, task="regression", classes=())


@pytest.mark.parametrize("case", ["mixed-f64", "mixed-f32-accumulate", "diverging",
                                  "projected", "torch-backend"])
def test_run_batch_is_bit_identical_to_the_loop_one_run_at_a_time(reference, case, monkeypatch):
    """The batched round loop's shortcuts (restart radii taken once, difference radii without
    round_scale's layers, normals drawn ahead in blocks — here of 3 rounds, so blocks turn over —
    the workers' scalar check skipped far from the radius, routines on stacked rows, parking)
    change no bit of any result: mixed routines and schedules, float32 accumulation, runs that
    diverge each way (iterate, radius, gradients), means projected onto the ball, the torch
    backend."""
    from diff2_flwr.lab import sweep

    monkeypatch.setattr(sweep._Noise, "ROUNDS", 3)
    data, _, specs = reference
    kw = {"rounds": ROUNDS, "eval_every": 5}
    if case == "mixed-f32-accumulate":
        kw.update(dtype=torch.float32, accumulate="float32")
        specs = specs[:6]
    elif case == "diverging":
        specs = [specs[0],
                 RunSpec(1, 1e305, 1e6, 1e6, 1.0, 0.0, 1, 1),  # x_1 overflows (iterate)
                 RunSpec(2, 1e150, 1.0, 1e300, 0.5, 1e10, 2, 2),  # round 2's radius is inf
                 RunSpec(1, 1e150, 1e6, 1e6, 0.0, 0.0, 3, 3),  # round 2's gradients overflow
                 specs[5]]
        kw["eval_every"] = 1
    elif case == "projected":
        data = _identical_rows()
        specs = [RunSpec(3, 0.01, 1e-3, 1e-2, 0.0, 0.0, 1, 1),
                 RunSpec(1, 0.01, 1e-4, 1e-4, 0.5, 0.0, 2, 2),
                 RunSpec(2, 0.01, 3e-3, 0.1, 0.5, 0.5, 3, 3)]
        projected = []
        real = sweep.onto_ball
        monkeypatch.setattr(sweep, "onto_ball", lambda m, c: projected.append(1) or real(m, c))
    elif case == "torch-backend":
        from diff2_flwr.core import fused

        monkeypatch.setattr(fused, "load", lambda *a, **k: None)
        specs = specs[:8]
    results = run_batch(data, specs, **kw)
    _assert_bit_identical(results, _loop_one_run_at_a_time(data, specs, **kw))
    if case == "diverging":
        assert [r.diverged_at for r in results] == [None, 1, 2, 2, None]
    if case == "projected":
        assert projected  # the scalar path ran


def test_the_planner_is_round_scale_bit_for_bit_at_its_edges():
    """The difference radius without round_scale's layers: equal to it bit for bit, or it hands
    the row to round_scale (norms near 2^-500 and 0, overflowing differences, radii near the floor
    and overflowing stds, C2 = inf, σ = 0), which refuses the same rounds."""
    from diff2_flwr.core.clipping import RADIUS_FLOOR
    from diff2_flwr.core.estimator import Diverged, round_scale
    from diff2_flwr.lab.sweep import _Planner

    rng = np.random.default_rng(5)
    d, rows = 101, []
    for e in (-320, -300, -250, -151, -150, -149, -100, 0, 100, 150, 152, 154, 200, 307):
        for _ in range(6):
            rows.append(rng.normal(size=d) * 10.0 ** (e + rng.uniform(-1, 1)))
    rows += [np.zeros(d), np.full(d, np.inf), np.full(d, np.nan)]
    clips = [(1.0, 2.0), (RADIUS_FLOOR * 2**480, 1.0), (RADIUS_FLOOR * 2**-40, 0.0), (1e300, 1e10),
             (np.inf, 0.0), (0.5, 0.0), (2.0, 1e305)]
    specs = [RunSpec(3, 0.1, 1.0, c, 1.0, s, 0, 0) for c, s in clips]
    planner, refused = _Planner(specs), 0
    for row in rows:
        K = len(specs)
        x = np.tile(row, (K, 1))
        x_prev = -x[:, ::-1].copy() * 0.5
        alive, diverged = np.ones(K, dtype=bool), [None] * K
        with np.errstate(all="ignore"):
            radius, std = planner(2, np.zeros(K, dtype=bool), x, x_prev, alive, diverged)
        for k, (clip, sigma) in enumerate(clips):
            try:
                want = round_scale(2, False, clip, sigma, x[k], x_prev[k])
            except Diverged:
                assert diverged[k] == 2 and not alive[k]
                refused += 1
                continue
            assert alive[k] and diverged[k] is None
            assert (radius[k], std[k]) == want and np.signbit(radius[k]) == np.signbit(want[0])
    assert refused > 0


def test_normals_drawn_ahead_are_round_noise_bit_for_bit():
    """round_noise(key, r, d, σ) = round_normals(key, r, d) · σ, and the engine's block draws are
    those normals, whichever round a block starts at."""
    from diff2_flwr.core.estimator import round_noise, round_normals
    from diff2_flwr.lab.sweep import _Noise

    specs = [RunSpec(3, 0.1, 1.0, 1.0, 0.7, 0.0, 2**100 + 3, 0),  # noise on restarts only
             RunSpec(1, 0.1, 1.0, 1.0, 0.0, 0.0, 5, 0),  # none
             RunSpec(2, 0.1, 1.0, 1.0, 0.3, 2.0, 0, 0)]
    rounds, d = 11, 7
    restarts = np.arange(rounds + 1)[:, None] % np.array([3, 1, 2]) == 0
    noise = _Noise(specs, restarts, d)
    noise.block = 4
    alive = np.ones(3, dtype=bool)
    for r in range(1, rounds + 1):
        for k, s in enumerate(specs):
            if (s.sigma_restart if restarts[r - 1, k] else s.sigma_diff):
                z = noise.normals(r, k, alive)
                assert z.tobytes() == round_normals(s.noise_seed, r, d).tobytes()
                assert (z * 0.37).tobytes() == round_noise(s.noise_seed, r, d, 0.37).tobytes()
