"""Step-size schedules (issue 42, item 2): round r steps with η·s(r), on every method, from every
front door, at no privacy cost."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import yaml

from diff2_flwr.core.estimator import Mechanism, init_state, plan_round, server_step
from diff2_flwr.core.routines import GD, Adam, Momentum
from diff2_flwr.core.schedules import (CONSTANT, SCHEDULES, Constant, Cosine, InverseSqrt,
                                       ScheduleError, StepDecay, factors, make_schedule,
                                       routine_at, schedule_parameters)
from diff2_flwr.runtime import server_core
from diff2_flwr.runtime.config import (ConfigError, load_config, load_run_config, parse_config)
from diff2_flwr.runtime.session import build_server, build_worker

# ------------------------------------------------------------------------------- the factors


def test_each_schedules_factors_are_its_formula_at_chosen_rounds():
    # γ^⌊(r-1)/k⌋, γ = 0.5, k = 3
    assert factors(make_schedule("step", decay=0.5, every=3), 8).tolist() == [
        1, 1, 1, 0.5, 0.5, 0.5, 0.25, 0.25]
    assert StepDecay(every=2).factor(5, 9) == pytest.approx(0.01, rel=1e-15)  # default γ = 0.1
    # f + (1 - f)·½(1 + cos(π (r-1)/R)), R = 10, f = 0.2: 1 at r = 1, f + (1-f)/2 = 0.6 at r = 6
    cosine = Cosine(floor=0.2)
    assert cosine.factor(1, 10) == 1.0  # exactly: round 1 steps with η
    assert cosine.factor(6, 10) == pytest.approx(0.6, abs=1e-15)
    assert cosine.factor(10, 10) == pytest.approx(0.2 + 0.4 * (1 + math.cos(0.9 * math.pi)),
                                                  abs=1e-15)
    assert Cosine().factor(3, 4) == pytest.approx(0.5, abs=1e-15)  # f = 0: ½(1 + cos(π/2))
    # 1/√(1 + (r-1)/k): k = 1 is 1/√r, k = 4 halves the step at r = 13
    assert factors(InverseSqrt(), 4).tolist() == [1.0, 1 / math.sqrt(2), 1 / math.sqrt(3), 0.5]
    assert InverseSqrt(every=4).factor(13, 20) == 0.5
    assert factors(CONSTANT, 5).tolist() == [1.0] * 5
    for name in SCHEDULES:  # every schedule starts at η and never increases
        params = {"every": 2} if name == "step" else {}
        s = factors(make_schedule(name, **params), 50)
        assert s[0] == 1.0 and np.all(np.diff(s) <= 0) and np.all(s > 0)


@pytest.mark.parametrize("build, match", [
    (lambda: make_schedule("linear"), r"`name` must be one of 'constant', 'step', 'cosine', "
                                      r"'inverse_sqrt'\. Found 'linear'\."),
    (lambda: make_schedule("step", decay=0.5), r"`every` must be a value for schedule 'step' "
                                               r"\(it has no default\)\. Found None\."),
    (lambda: make_schedule("cosine", decay=0.5), r"`decay` must be absent for schedule 'cosine' "
                                                 r"\(its parameters: floor\)\. Found 0\.5\."),
    (lambda: StepDecay(every=3, decay=0.0), r"`decay` must be a number in \(0, 1\]\. Found 0\.0\."),
    (lambda: StepDecay(every=3, decay=1.5), r"`decay` must be a number in \(0, 1\]\. Found 1\.5\."),
    (lambda: StepDecay(every=0), r"`every` must be an integer >= 1 \(rounds\)\. Found 0\."),
    (lambda: InverseSqrt(every=2.5), r"`every` must be an integer >= 1 \(rounds\)\. Found 2\.5\."),
    (lambda: InverseSqrt(every=True), r"`every` must be an integer >= 1 \(rounds\)\. Found True\."),
    (lambda: Cosine(floor=1.0), r"`floor` must be a number in \[0, 1\)\. Found 1\.0\."),
    (lambda: Cosine(floor=math.nan), r"`floor` must be a number in \[0, 1\)\. Found nan\."),
    (lambda: Cosine().factor(0, 10), r"`r` must be a round in 1\.\.10\. Found 0\."),
    (lambda: Cosine().factor(11, 10), r"`r` must be a round in 1\.\.10\. Found 11\."),
    (lambda: Constant().factor(1, 0), r"`rounds` must be an integer >= 1\. Found 0\."),
])
def test_bad_parameters_are_refused_naming_key_expectation_and_finding(build, match):
    with pytest.raises(ScheduleError, match=match):
        build()


def test_the_registry_lists_each_schedules_parameters():
    assert {n: list(schedule_parameters(n)) for n in SCHEDULES} == {
        "constant": [], "step": ["every", "decay"], "cosine": ["floor"], "inverse_sqrt": ["every"]}


# ------------------------------------------------------------------------------- round r's routine

def test_round_r_steps_with_eta_s_r_and_the_routines_state_carries_over():
    step = make_schedule("step", decay=0.5, every=2)
    adam = Adam(0.1, beta1=0.8)
    assert routine_at(adam, CONSTANT, 7, 10) is adam  # s = 1: the routine itself, bit for bit
    assert routine_at(adam, step, 2, 10) is adam
    assert routine_at(adam, step, 3, 10) == Adam(0.05, beta1=0.8)
    assert routine_at(Momentum(0.4, momentum=0.5), step, 5, 10) == Momentum(0.1, momentum=0.5)
    # Adam's moments and count, the momentum buffer: as without a schedule (they never read η);
    # the step of round r: s(r) times the unscheduled one from the same state
    vs = np.random.default_rng(0).standard_normal((6, 4))
    for routine in (Adam(0.1, beta1=0.8), Momentum(0.4, momentum=0.5)):
        x, state = np.zeros(4), routine.init(np.zeros(4))
        for r, v in enumerate(vs, start=1):
            unscheduled, plain = routine.update(x, v, state)
            x_new, state = routine_at(routine, step, r, len(vs)).update(x, v, state)
            assert repr(state) == repr(plain)
            np.testing.assert_allclose(x_new - x, step.factor(r, 6) * (unscheduled - x),
                                       rtol=1e-13)
            x = x_new


# f(x) = ½ ||A x - b||² / n: GD on a quadratic, its gradient by hand, no noise and no clipping
RNG = np.random.default_rng(7)
A, B = RNG.standard_normal((40, 5)), RNG.standard_normal(40)
NO_PRIVACY = Mechanism(1, math.inf, math.inf, 0.0, 0.0)


def grad_f(x):
    return A.T @ (A @ x - B) / len(B)


@pytest.mark.parametrize("schedule", [make_schedule("step", decay=0.5, every=3), Cosine(0.1),
                                      InverseSqrt(2)], ids=lambda s: s.name)
def test_gd_on_a_quadratic_takes_the_steps_eta_s_r_bit_for_bit(schedule):
    rounds, lr = 12, 0.3
    state = init_state(np.zeros(5), GD(lr), seed=0)
    x = np.zeros(5)
    for r in range(1, rounds + 1):
        plan = plan_round(state, NO_PRIVACY)
        state, _ = server_step(state, NO_PRIVACY, routine_at(GD(lr), schedule, r, rounds),
                               grad_f(plan.x_current))
        x = x - (lr * schedule.factor(r, rounds)) * grad_f(x)
        np.testing.assert_array_equal(state.x, x)


# ------------------------------------------------------------------------------- the server

def _cfg(method="diff2", schedule="constant", rounds=6, **training):
    return parse_config({
        "name": "sched", "method": method, "dataset": {"name": "synthetic", "num_samples": 400},
        "training": {"rounds": rounds, "restart_every": 3 if method == "diff2" else None,
                     "learning_rate": 0.3, "clip_diff": 3.0, "clients": 2, "seed": 5,
                     "schedule": schedule, **training}}, "sched.yaml")


def _drive(cfg, server=None):
    server = server or build_server(cfg, record=False, progress=None)
    workers = [build_worker(cfg, p) for p in range(cfg.clients)]
    releases = []
    while not server.done:
        releases.append(server.release([w.reply(server.plan()) for w in workers]))
    return server, releases


STEP = {"name": "step", "decay": 0.5, "every": 2}


def _rows(server):
    """The run's rows without their wall-clock times."""
    return [{k: v for k, v in h.items() if k != "elapsed_s"} for h in server.history]


@pytest.mark.parametrize("method", ["gd", "dpgd", "diff2"])
def test_a_server_run_with_a_step_schedule_steps_eta_s_r_on_every_method(method):
    cfg = _cfg(method, STEP)
    server, releases = _drive(cfg)
    assert server.spec.schedule == StepDecay(every=2, decay=0.5)
    x = releases[0].plan.x_current
    for r, rel in enumerate(releases, start=1):
        lr = 0.3 * 0.5 ** ((r - 1) // 2)
        np.testing.assert_array_equal(rel.x, x - lr * rel.v)  # x_r = x_(r-1) - η s(r) ṽ_r
        x = rel.x
    assert server.summary()["schedule"] == {"name": "step", "every": 2, "decay": 0.5}


def test_the_constant_schedule_takes_the_steps_it_took_before_schedules(monkeypatch):
    """A constant-schedule run equals, bit for bit, the run whose server steps with its routine
    as before schedules existed (``server_step(..., spec.routine, ...)``)."""
    cfg = _cfg("diff2", "constant", routine={"name": "adam", "beta1": 0.8}, learning_rate=0.02)
    scheduled, _ = _drive(cfg)
    monkeypatch.setattr(server_core.ServerSpec, "routine_at", lambda self, r: self.routine)
    before, _ = _drive(cfg)
    np.testing.assert_array_equal(scheduled.state.x, before.state.x)
    assert _rows(scheduled) == _rows(before)
    # and a schedule that is not constant changes the trajectory (the wiring is live)
    monkeypatch.undo()
    cosine, _ = _drive(_cfg("diff2", "cosine", routine={"name": "adam", "beta1": 0.8},
                            learning_rate=0.02))
    assert not np.array_equal(cosine.state.x, scheduled.state.x)


@pytest.mark.parametrize("method", ["dpgd", "diff2"])
def test_a_schedule_spends_exactly_the_constant_schedules_privacy(method):
    constant, _ = _drive(_cfg(method, "constant"))
    cosine, _ = _drive(_cfg(method, {"name": "cosine", "floor": 0.1}))
    assert cosine.calibration == constant.calibration  # the same σ1, σ2, z1, z2
    assert cosine.ledger.events == constant.ledger.events
    assert [h.get("epsilon_spent") for h in cosine.history] == [
        h.get("epsilon_spent") for h in constant.history]
    assert len([h for h in cosine.history if "epsilon_spent" in h]) == 6
    assert cosine.epsilon_spent == constant.epsilon_spent
    assert not np.array_equal(cosine.state.x, constant.state.x)


def test_the_difference_radius_follows_the_smaller_steps():
    """DIFF2: C2 ||x_(r-1) - x_(r-2)|| is computed from the released iterates, so a decaying step
    gives its difference rounds a radius of C2 η s(r-1) ||ṽ_(r-1)|| with GD."""
    server, releases = _drive(_cfg("diff2", STEP))
    for r in range(2, len(releases) + 1):
        plan, previous = releases[r - 1].plan, releases[r - 2]
        if not plan.restart:
            step = 0.3 * 0.5 ** ((r - 2) // 2) * np.linalg.norm(previous.v)
            assert plan.radius == pytest.approx(3.0 * step, rel=1e-12)


# ------------------------------------------------------------------------------- front doors

def test_yaml_set_and_the_run_config_reach_the_server(tmp_path):
    path = tmp_path / "e.yaml"
    data = {"name": "s", "method": "dpgd", "dataset": {"name": "synthetic", "num_samples": 400},
            "training": {"rounds": 4, "clients": 2, "seed": 1}}
    path.write_text(yaml.safe_dump({**data, "training": {**data["training"], "schedule": {
        "name": "step", "every": 2, "decay": 0.5}}}))

    def arrived(cfg):
        return build_server(cfg, record=False, progress=None).spec.schedule

    assert arrived(load_config(path)) == StepDecay(every=2, decay=0.5)  # the file
    assert load_config(path).to_dict()["training"]["schedule"] == {"name": "step", "every": 2,
                                                                   "decay": 0.5}
    path.write_text(yaml.safe_dump(data))
    assert arrived(load_config(path)) == CONSTANT  # the default
    assert load_config(path).to_dict()["training"]["schedule"] == "constant"
    assert arrived(load_config(path, {"training.schedule.name": "cosine",
                                      "training.schedule.floor": 0.1})) == Cosine(0.1)  # --set
    assert arrived(load_config(path, {"training.schedule": "inverse_sqrt"})) == InverseSqrt()
    assert arrived(load_run_config({"config": str(path), "training.schedule.name": "cosine",
                                    "training.schedule.floor": "0.25"})) == Cosine(0.25)


@pytest.mark.parametrize("schedule, key, expected, found", [
    ("linear", "training.schedule.name",
     "one of 'constant', 'step', 'cosine', 'inverse_sqrt'", "'linear'"),
    ({"name": "cosine", "decay": 0.5}, "training.schedule.decay",
     r"nothing for schedule cosine \(its keys: floor\)", "0.5"),
    ({"name": "step"}, "training.schedule.every",
     r"a value for schedule 'step' \(it has no default\)", "None"),
    ({"name": "step", "every": 2, "decay": 2}, "training.schedule.decay",
     r"a number in \(0, 1\]", "2.0"),
    ({"name": "inverse_sqrt", "every": 0.5}, "training.schedule.every", "an integer or null",
     "0.5"),
])
def test_bad_schedules_are_refused_in_one_line_from_yaml_and_the_api(tmp_path, schedule, key,
                                                                     expected, found):
    import diff2_flwr
    from diff2_flwr.task.models import build_model

    path = tmp_path / "e.yaml"
    path.write_text(yaml.safe_dump({"training": {"restart_every": 2, "schedule": schedule}}))
    with pytest.raises(ConfigError, match=rf"e\.yaml: key `{key}`: expected {expected}\. "
                                          rf"Found {found}\.$") as err:
        load_config(path)
    assert "\n" not in str(err.value)
    argument = key.removeprefix("training.")
    model = build_model("paper_mlp", in_features=3, out_features=1, hidden=4, init_seed=0)
    with pytest.raises(ConfigError, match=rf"^diff2_flwr\.make_strategy: argument `{argument}`: "
                                          rf"expected {expected}\. Found {found}\.$") as err:
        diff2_flwr.make_strategy(epsilon=3.0, delta=1e-5, rounds=4, restart_every=2, clients=2,
                                 n_min=100, clip_restart=1.0, clip_diff=1.0, learning_rate=0.1,
                                 model=model, schedule=schedule, progress=None)
    assert "\n" not in str(err.value)


def test_the_api_takes_a_schedule():
    import diff2_flwr
    from diff2_flwr.task.models import build_model

    model = build_model("paper_mlp", in_features=3, out_features=1, hidden=4, init_seed=0)
    strategy = diff2_flwr.make_strategy(epsilon=3.0, delta=1e-5, rounds=4, restart_every=2,
                                        clients=2, n_min=100, clip_restart=1.0, clip_diff=1.0,
                                        learning_rate=0.1, model=model, progress=None,
                                        schedule={"name": "step", "every": 2})
    assert strategy.server.spec.schedule == StepDecay(every=2)


def test_what_no_schedule_reaches_is_refused_with_the_reason():
    local = (r"key `training\.schedule`: expected constant with local\.steps > 0 \(the chosen "
             r"worker takes x_r's local steps with η = training\.learning_rate.*Found 'cosine'")
    with pytest.raises(ConfigError, match=local):
        parse_config({"training": {"restart_every": 2, "schedule": "cosine"},
                      "local": {"steps": 2, "batch_size": 8}}, "e.yaml")
    underflow = (r"key `training\.schedule`: expected a schedule whose step η·s\(r\) stays > 0 "
                 r"over the R = 2000 rounds \(its last, η·s\(R\), underflows to 0\.0")
    with pytest.raises(ConfigError, match=underflow):
        parse_config({"training": {"rounds": 2000, "restart_every": 2, "schedule": {
            "name": "step", "decay": 0.5, "every": 1}}}, "e.yaml")
    # a server assembled by hand is refused as well
    spec = build_server(_cfg("diff2", "constant"), record=False, progress=None).spec
    local = build_server(parse_config({
        "name": "l", "dataset": {"name": "synthetic", "num_samples": 400},
        "training": {"rounds": 4, "restart_every": 2, "clients": 2, "seed": 1},
        "local": {"steps": 2, "batch_size": 8}}), record=False, progress=None).spec
    assert spec.local is None
    with pytest.raises(ValueError, match=r"The local routine takes its steps with η as its task "
                                         r"says .*a schedule \(cosine\) cannot reach them"):
        server_core.check_spec(dataclasses.replace(local, schedule=Cosine()))


def test_a_node_that_audits_with_canaries_refuses_a_schedule():
    from diff2_flwr.runtime.policy import Refused, _check_auditable

    _check_auditable(_cfg("dpgd"), "node-0", "(policy p.yaml)")
    with pytest.raises(Refused, match=r"training\.schedule 'cosine' \(the audit reads ṽ_r from "
                                      r"x_\(r-1\) - x_r = η ṽ_r, which a schedule makes "
                                      r"η·s\(r\) ṽ_r\)"):
        _check_auditable(_cfg("dpgd", "cosine"), "node-0", "(policy p.yaml)")


def test_a_constant_schedule_leaves_the_checkpoints_fingerprint_as_before_schedules():
    from diff2_flwr.runtime.checkpoint import config_fingerprint

    plain = _cfg("diff2").to_dict()
    before = {**plain, "training": {k: v for k, v in plain["training"].items() if k != "schedule"}}
    assert config_fingerprint(plain, 100) == config_fingerprint(before, 100)
    explicit = _cfg("diff2", {"name": "constant"}).to_dict()
    assert config_fingerprint(explicit, 100) == config_fingerprint(before, 100)
    assert config_fingerprint(_cfg("diff2", "cosine").to_dict(), 100) != config_fingerprint(
        before, 100)
