"""Routines (post-processing of ṽ_r): each against torch.optim, degenerate cases, purity,
validation.

The independent reference is PyTorch's own optimisers (``SGD`` with momentum / nesterov, ``Adam``,
``AdamW``) driven on the same closed-loop gradient sequence in float64: they share no code with
ours, and their kernels may fuse operations differently (``add_(alpha=…)``, ``addcdiv_``), so the
comparison is to rounding, stated below, not bit for bit.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from diff2_flwr.core.routines import (
    GD,
    ROUTINES,
    Adam,
    AdamW,
    Momentum,
    Nesterov,
    RoutineError,
    make_routine,
    routine_parameters,
)

# f(x) = ½ ||A x - b||² / n plus a fixed perturbation sequence (the noise of ṽ_r): a closed loop in
# which each gradient depends on the iterate, so an error in the update would feed back.
RNG = np.random.default_rng(11)
A = RNG.standard_normal((30, 6))
B = RNG.standard_normal(30)
NOISE = RNG.standard_normal((60, 6)) * 0.3
X0 = RNG.standard_normal(6)
STEPS = 60
#: Largest |ours - torch| after 60 steps (measured ≤ 2e-15 here; iterates are O(1)).
TOLERANCE = 1e-12


def gradient(x: np.ndarray, step: int) -> np.ndarray:
    return A.T @ (A @ x - B) / len(B) + NOISE[step]


def ours(routine) -> np.ndarray:
    x, state = X0.copy(), routine.init(X0)
    path = []
    for t in range(STEPS):
        x, state = routine.update(x, gradient(x, t), state)
        path.append(x)
    return np.array(path)


def torchs(make) -> np.ndarray:
    p = torch.nn.Parameter(torch.tensor(X0, dtype=torch.float64))
    opt = make([p])
    path = []
    for t in range(STEPS):
        opt.zero_grad()
        p.grad = torch.as_tensor(gradient(p.detach().numpy().copy(), t))
        opt.step()
        path.append(p.detach().numpy().copy())
    return np.array(path)


CASES = [
    ("gd", GD(0.3), lambda ps: torch.optim.SGD(ps, lr=0.3)),
    ("momentum", Momentum(0.1, momentum=0.9), lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)),
    ("momentum-0.5", Momentum(0.2, momentum=0.5), lambda ps: torch.optim.SGD(ps, lr=0.2,
                                                                             momentum=0.5)),
    ("nesterov", Nesterov(0.1, momentum=0.9), lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9,
                                                                         nesterov=True)),
    ("adam", Adam(0.05), lambda ps: torch.optim.Adam(ps, lr=0.05)),
    ("adam-betas", Adam(0.02, beta1=0.5, beta2=0.9, eps=1e-6),
     lambda ps: torch.optim.Adam(ps, lr=0.02, betas=(0.5, 0.9), eps=1e-6)),
    ("adam-l2", Adam(0.05, weight_decay=0.1), lambda ps: torch.optim.Adam(ps, lr=0.05,
                                                                          weight_decay=0.1)),
    ("adamw", AdamW(0.05), lambda ps: torch.optim.AdamW(ps, lr=0.05)),
    ("adamw-decay", AdamW(0.05, beta1=0.8, weight_decay=0.5),
     lambda ps: torch.optim.AdamW(ps, lr=0.05, betas=(0.8, 0.999), weight_decay=0.5)),
]


@pytest.mark.parametrize("name,routine,make", CASES, ids=[c[0] for c in CASES])
def test_each_routine_follows_torch_optim(name, routine, make):
    mine, reference = ours(routine), torchs(make)
    assert np.abs(mine - reference).max() <= TOLERANCE
    # the trajectory went somewhere: the comparison means something
    assert np.abs(mine[-1] - X0).max() > 0.1


def test_the_routines_differ_from_each_other():
    """The torch comparison would be hollow if every routine computed the same thing."""
    finals = {name: ours(routine)[-1] for name, routine, _ in CASES}
    names = list(finals)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert np.abs(finals[a] - finals[b]).max() > 1e-6, (a, b)


@pytest.mark.parametrize("cls", [Momentum, Nesterov])
def test_momentum_zero_is_gd_bit_for_bit(cls):
    np.testing.assert_array_equal(ours(cls(0.3, momentum=0.0)), ours(GD(0.3)))


def test_adamw_without_decay_is_adam_bit_for_bit_and_decay_is_decoupled():
    np.testing.assert_array_equal(ours(AdamW(0.05, weight_decay=0.0)), ours(Adam(0.05)))
    # decoupled (AdamW) and L2-coupled (Adam) decay are different methods
    assert np.abs(ours(AdamW(0.05,
                             weight_decay=0.1))[-1] - ours(Adam(0.05,
                                                                weight_decay=0.1))[-1]).max() > 1e-4


@pytest.mark.parametrize("scale", [1e-6, 1e-2, 1.0, 1e3])
@pytest.mark.parametrize("cls", [Adam, AdamW])
def test_adams_first_step_is_about_the_learning_rate_whatever_the_scale(cls, scale):
    v = np.array([3.0, -0.5, 1.0, -2.0]) * scale
    x0 = np.zeros(4)
    routine = cls(0.01)
    x1, state = routine.update(x0, v, routine.init(x0))
    # m̂ = v, ŝ = v²: the step is η |v|/(|v| + eps), i.e. η up to eps/|v|
    np.testing.assert_allclose(np.abs(x1 - x0), 0.01 * np.abs(v) / (np.abs(v) + 1e-8), rtol=1e-14)
    # 0.1 %: rounding
    assert np.all(np.abs(np.abs(x1 - x0) - 0.01) <= 1.001 * 0.01 * 1e-8 / np.abs(v))
    assert np.all(np.sign(x1 - x0) == -np.sign(v))
    assert state.count == 1


def test_momentum_accumulates_a_constant_gradient_geometrically():
    """Heavy ball on a constant ṽ = g: step r moves η g (1 - μ^r)/(1 - μ) (worked by hand)."""
    g, mu, lr = np.array([1.0, -2.0]), 0.5, 0.1
    routine, x = Momentum(lr, momentum=mu), np.zeros(2)
    state = routine.init(x)
    for r in range(1, 6):
        x_new, state = routine.update(x, g, state)
        np.testing.assert_allclose(x - x_new, lr * g * (1 - mu ** r) / (1 - mu), rtol=1e-15)
        x = x_new


@pytest.mark.parametrize("name", list(ROUTINES))
def test_updates_are_pure_and_states_immutable(name):
    routine = make_routine(name, 0.1)
    x0, v = np.arange(4.0), np.array([0.5, -1.0, 2.0, 0.0])
    state = routine.init(x0)
    a = routine.update(x0, v, state)
    b = routine.update(x0, v, state)
    np.testing.assert_array_equal(a[0], b[0])
    assert repr(a[1]) == repr(b[1])
    if state is not None:
        for field in state:
            if isinstance(field, np.ndarray):
                assert not field.flags.writeable
        for field in a[1]:
            if isinstance(field, np.ndarray):
                assert not field.flags.writeable
                with pytest.raises(ValueError):
                    field[0] = 1.0


@pytest.mark.parametrize("name", list(ROUTINES))
def test_a_stack_of_runs_steps_row_by_row_exactly(name):
    """What the batched sweep engine relies on: update on [K, d] = update on each [d], bit for
    bit."""
    params = {"gd": {}, "momentum": {"momentum": 0.7}, "nesterov": {"momentum": 0.6},
              "adam": {"beta1": 0.8, "weight_decay": 0.01}, "adamw": {"weight_decay": 0.2}}[name]
    routine = make_routine(name, 0.05, **params)
    rng = np.random.default_rng(5)
    xs, vs = rng.standard_normal((3, 7)), rng.standard_normal((4, 3, 7))
    stacked, state = xs, routine.init(xs)
    rows = [(xs[k], routine.init(xs[k])) for k in range(3)]
    for step in range(4):
        stacked, state = routine.update(stacked, vs[step], state)
        rows = [routine.update(x, vs[step][k], s) for k, (x, s) in enumerate(rows)]
    for k in range(3):
        np.testing.assert_array_equal(stacked[k], rows[k][0])


def test_every_routine_is_post_processing():
    assert all(cls.post_processing for cls in ROUTINES.values())


def test_parameters_and_defaults_are_torchs():
    assert routine_parameters("gd") == {}
    assert routine_parameters("momentum") == {"momentum": 0.9}
    assert routine_parameters("adam") == {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8,
                                          "weight_decay": 0.0}
    assert routine_parameters("adamw")["weight_decay"] == 0.01  # torch.optim.AdamW's default
    adamw = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))]).defaults
    assert (adamw["betas"], adamw["eps"], adamw["weight_decay"]) == ((0.9, 0.999), 1e-8, 0.01)
    assert dataclasses.asdict(make_routine("nesterov", 0.2)) == {"learning_rate": 0.2,
                                                                 "momentum": 0.9}


@pytest.mark.parametrize("name,kwargs,match", [
    ("gd", {"learning_rate": 0.0}, r"`learning_rate` must be a finite number > 0. Found 0.0"),
    ("momentum", {"learning_rate": 0.1, "momentum": 1.0},
     r"`momentum` must be a number in \[0, 1\). Found 1.0"),
    ("nesterov", {"learning_rate": 0.1, "momentum": -0.1},
     r"`momentum` must be a number in \[0, 1\)"),
    ("adam", {"learning_rate": 0.1, "beta1": 1.0}, r"`beta1` must be a number in \[0, 1\)"),
    ("adam", {"learning_rate": 0.1, "beta2": float("nan")},
     r"`beta2` must be a number in \[0, 1\)"),
    ("adam", {"learning_rate": 0.1, "eps": 0.0}, r"`eps` must be a finite number > 0. Found 0.0"),
    ("adamw", {"learning_rate": 0.1, "weight_decay": -1.0},
     r"`weight_decay` must be a finite number >= 0"),
    ("adamw", {"learning_rate": float("inf")}, r"`learning_rate` must be a finite number > 0"),
    ("gd", {"learning_rate": 0.1, "momentum": 0.9},
     r"`momentum` must be absent for routine 'gd' \(its parameters: "
                                                    r"none beyond learning_rate\). Found 0.9"),
    ("momentum", {"learning_rate": 0.1, "beta1": 0.9},
     r"`beta1` must be absent for routine 'momentum' \(its "
                                                       r"parameters: momentum\)"),
    ("sgd", {"learning_rate": 0.1},
     r"`name` must be one of 'gd', 'momentum', 'nesterov', 'adam', 'adamw'. Found 'sgd'"),
])
def test_invalid_parameters_are_refused_naming_them(name, kwargs, match):
    with pytest.raises(RoutineError, match=match):
        make_routine(name, **kwargs)


# ------------------------------------------------------------------------------ through the server
# (runtime)

def _cfg(method: str, routine, restart_every=None, lr=0.2, rounds=8):
    from diff2_flwr.runtime.config import parse_config

    return parse_config({
        "method": method, "dataset": {"name": "synthetic", "num_samples": 600},
        "training": {"rounds": rounds, "restart_every": restart_every, "learning_rate": lr,
                     "clip_diff": 3.0,
                     "clients": 3, "seed": 4, "routine": routine},
        "evaluation": {"every": 1},
    })


def _drive(cfg):
    """The in-process driver's calls, keeping every release (ṽ_r, x_r)."""
    from diff2_flwr.runtime.session import build_server, build_worker

    server = build_server(cfg, record=False, progress=None)
    workers = [build_worker(cfg, p) for p in range(cfg.training.clients)]
    releases = []
    while not server.done:
        plan = server.plan()
        releases.append(server.release([w.reply(plan) for w in workers]))
    return server, releases


def _strip(history):
    return [{k: v for k, v in row.items() if k != "elapsed_s"} for row in history]


def test_diff2_with_T1_and_momentum_is_dpgd_with_momentum():
    """T = 1 with momentum is DP-GD with momentum: the same iterates, noise, ledger and ε, round by
    round."""
    momentum = {"name": "momentum", "momentum": 0.7}
    dpgd, dpgd_releases = _drive(_cfg("dpgd", momentum))
    diff2, diff2_releases = _drive(_cfg("diff2", momentum, restart_every=1))
    assert _strip(diff2.history) == _strip(dpgd.history)
    for a, b in zip(dpgd_releases, diff2_releases):
        np.testing.assert_array_equal(a.x, b.x)
        np.testing.assert_array_equal(a.v, b.v)
    assert diff2.epsilon_spent == dpgd.epsilon_spent and diff2.ledger == dpgd.ledger
    # ... and it is momentum on the released ṽ_r (torch's SGD fed the same ṽ's), not GD
    p = torch.nn.Parameter(torch.tensor(dpgd_releases[0].plan.x_current.copy()))  # x_0
    sgd = torch.optim.SGD([p], lr=0.2, momentum=0.7)
    for release in dpgd_releases:
        p.grad = torch.tensor(release.v.copy())
        sgd.step()
        np.testing.assert_allclose(p.detach().numpy(), release.x, rtol=0, atol=1e-13)
    gd, _ = _drive(_cfg("dpgd", "gd"))
    assert np.abs(gd.state.x - dpgd.state.x).max() > 1e-3


@pytest.mark.parametrize("routine", ["momentum", "nesterov", {"name": "adam", "beta1": 0.8},
                                     "adamw"],
                         ids=["momentum", "nesterov", "adam", "adamw"])
def test_a_routine_costs_no_privacy(routine):
    """Post-processing: the same calibration, ledger events and ε as GD; only the iterates
    differ."""
    lr = 0.02 if isinstance(routine, dict) or routine == "adamw" else 0.2
    gd, _ = _drive(_cfg("diff2", "gd", restart_every=3, lr=lr))
    other, _ = _drive(_cfg("diff2", routine, restart_every=3, lr=lr))
    assert other.calibration == gd.calibration and other.ledger == gd.ledger
    assert [r.get("epsilon_spent") for r in other.history] == [r.get("epsilon_spent")
                                                               for r in gd.history]
    assert np.abs(other.state.x - gd.state.x).max() > 1e-4
    assert other.summary()["routine"]["name"] == (routine["name"] if isinstance(routine,
                                                                                dict) else routine)


def test_momentum_zero_through_the_server_is_gd_bit_for_bit():
    gd, _ = _drive(_cfg("diff2", "gd", restart_every=3))
    zero, _ = _drive(_cfg("diff2", {"name": "momentum", "momentum": 0.0}, restart_every=3))
    np.testing.assert_array_equal(zero.state.x, gd.state.x)
    assert [r["train_loss"] for r in zero.history] == [r["train_loss"] for r in gd.history]


def test_the_adam_example_is_the_default_run_with_adam():
    """configs/adam.yaml differs from configs/default.yaml only by its name, η and routine: the same
    calibration."""
    from pathlib import Path

    from diff2_flwr.runtime.config import load_config
    from diff2_flwr.runtime.driver import run_inprocess

    configs = Path(__file__).resolve().parents[1] / "configs"
    adam, default = load_config(configs / "adam.yaml"), load_config(configs / "default.yaml")
    a, d = adam.to_dict(), default.to_dict()
    assert a["training"].pop("routine") == {"name": "adam", "beta1": 0.9, "beta2": 0.999,
                                            "eps": 1e-8,
                                            "weight_decay": 0.0}
    assert d["training"].pop("routine") == "gd"
    for c in (a, d):
        c.pop("name"), c["training"].pop("learning_rate")
    assert a == d and adam.with_clients(10).calibration(900) == default.with_clients(
        10).calibration(900)
    server = run_inprocess(load_config(configs / "adam.yaml", {"training.rounds": 12,
                                                               "training.seed": 1}),
                           record=False, progress=None)
    assert server.done and server.history[-1]["train_loss"] < server.history[0]["train_loss"]
