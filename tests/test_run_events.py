"""A node's charge (RunEvents) and the composition of several runs, checked against dp-accounting on
its own.

The independent reference is ``PLDAccountant(REPLACE_ONE)`` fed each run's events by counts: a
server round of multiplier z (std over the replace-one sensitivity) is ``GaussianDpEvent(2z)`` in
the accountant's −1/+1 reading of replace-one (see tests/test_local_privacy.py), a local step
``PoissonSampledDpEvent(q, GaussianDpEvent(z3))``, composed steps × phases times.
"""

from __future__ import annotations

import math

import pytest
from dp_accounting import NeighboringRelation, dp_event
from dp_accounting.pld import pld_privacy_accountant

from diff2_flwr.core.privacy import RunEvents, calibrate, composed_epsilon

COMMON = dict(u=1.25, n_min=1651, clients=10)


def _independent(runs, delta: float) -> float:
    acc = pld_privacy_accountant.PLDAccountant(neighboring_relation=NeighboringRelation.REPLACE_ONE,
                                               value_discretization_interval=1e-4)
    for run in runs:
        for z, count in run.gaussian:
            acc.compose(dp_event.GaussianDpEvent(2 * z), count)
        for z3, q, steps, phases in run.local:
            acc.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(z3)),
                        steps * phases)
    return acc.get_epsilon(delta)


def _diff2(epsilon: float, rounds: int, period: int):
    return calibrate(epsilon=epsilon, delta=1e-5, rounds=rounds, restart_every=period, **COMMON)


def _local(epsilon: float, rounds: int, period: int, n_min: int, steps: int, b: int, share: float):
    return calibrate(epsilon=epsilon, delta=1e-5, rounds=rounds, restart_every=period, u=1.25,
                     n_min=n_min, clients=4, local_steps=steps, local_batch_size=b,
                     local_share=share)


@pytest.fixture(scope="module")
def server_mix():
    """DIFF2-GD at ε = 3, DP-GD at ε = 1, and a hand-made run of 300 rounds: Gaussian events
    only."""
    return [RunEvents.from_calibration(_diff2(3.0, 2000, 20)),
            RunEvents.from_calibration(_diff2(1.0, 500, 1)), RunEvents(delta=1e-6,
                                                                       gaussian=((40.0, 300),))]


@pytest.fixture(scope="module")
def local_mix():
    """Two runs with a local routine (q = 0.08 and 0.5) and a DP-GD run."""
    return [RunEvents.from_calibration(_local(3.0, 10, 5, 100, 3, 8, 0.5)),
            RunEvents.from_calibration(_local(2.0, 4, 2, 16, 2, 8, 0.98)),
            RunEvents.from_calibration(_diff2(1.0, 200, 1))]


@pytest.mark.parametrize("delta", [1e-5, 1e-7])
def test_server_mix_agrees_with_an_independent_pld_accountant(server_mix, delta):
    ours = composed_epsilon(server_mix, delta)
    assert ours == pytest.approx(_independent(server_mix, delta), rel=0.01)
    # and the mix costs more than any of its runs
    assert ours > max(composed_epsilon([run], delta) for run in server_mix) + 0.5


@pytest.mark.parametrize("delta", [1e-5, 1e-7])
def test_local_mix_agrees_with_an_independent_pld_accountant(local_mix, delta):
    assert local_mix[0].local and local_mix[1].local
    assert composed_epsilon(local_mix, delta) == pytest.approx(_independent(local_mix, delta),
                                                               rel=0.01)


def test_a_calibrated_run_costs_its_calibrated_epsilon():
    """An ``exact`` calibration is calibrated to ε: the charge is ε, never above it by more than the
    PLD's pessimism (1e-3), and within 2 % (a local routine is calibrated to ε (1 - 0.5 %))."""
    for cal in (_diff2(3.0, 2000, 20), _diff2(5.0, 2000, 1), _local(3.0, 10, 5, 100, 3, 8, 0.5)):
        charged = composed_epsilon([RunEvents.from_calibration(cal)], cal.delta)
        assert charged <= cal.epsilon * (1 + 1e-3)
        assert charged == pytest.approx(cal.epsilon, rel=0.02)
        assert RunEvents.from_calibration(cal).epsilon == charged


def test_from_calibration_counts_every_event():
    cal = _local(3.0, 10, 5, 100, 3, 8, 0.5)
    events = RunEvents.from_calibration(cal)
    assert events.delta == cal.delta
    assert events.gaussian == ((cal.z1, 2), (cal.z2, 8))
    assert events.local == ((cal.local.z3, 0.08, 2, 10),)
    assert RunEvents.from_calibration(_diff2(3.0, 50, 1)).gaussian == ((_diff2(3.0, 50, 1).z1, 50),)


def test_composition_is_monotone_and_order_free(server_mix, local_mix):
    runs = server_mix + local_mix
    prefixes = [composed_epsilon(runs[:k], 1e-5) for k in range(len(runs) + 1)]
    assert prefixes[0] == 0.0
    assert all(b > a for a, b in zip(prefixes, prefixes[1:])), prefixes
    assert composed_epsilon(runs[::-1], 1e-5) == pytest.approx(prefixes[-1], rel=1e-12)


def test_twice_one_run_is_one_run_of_twice_the_rounds():
    """Composition by counts: two charges of m rounds equal one of 2m (Gaussian: exactly μ√2)."""
    one = RunEvents(delta=1e-5, gaussian=((20.0, 100),), local=((2.0, 0.1, 3, 5),))
    two = RunEvents(delta=1e-5, gaussian=((20.0, 200),), local=((2.0, 0.1, 3, 10),))
    assert composed_epsilon([one, one], 1e-5) == pytest.approx(composed_epsilon([two], 1e-5),
                                                               rel=1e-9)


def test_degenerate_cases():
    assert composed_epsilon([], 1e-5) == 0.0
    assert composed_epsilon([RunEvents(delta=1e-5)], 1e-5) == 0.0
    assert composed_epsilon([RunEvents(delta=1e-5, gaussian=((0.0, 1),))], 1e-5) == math.inf
    assert composed_epsilon([RunEvents(delta=1e-5, local=((0.0, 0.5, 1, 1),))], 1e-5) == math.inf


@pytest.mark.parametrize("kwargs, match", [
    (dict(delta=0.0), r"`delta` must be in \(0, 1\). Found 0.0"),
    (dict(delta=1e-5, gaussian=((-1.0, 3),)),
     "noise multiplier must be a finite number >= 0. Found -1.0"),
    (dict(delta=1e-5, gaussian=((math.inf, 3),)),
     "noise multiplier must be a finite number >= 0. Found inf"),
    (dict(delta=1e-5, gaussian=((2.0, 0),)), "`count` must be an integer >= 1. Found 0"),
    (dict(delta=1e-5, local=((2.0, 1.5, 1, 1),)), r"`q` must be in \(0, 1\]. Found 1.5"),
    (dict(delta=1e-5, local=((2.0, 0.5, 0, 1),)), "`steps` must be an integer >= 1. Found 0"),
    (dict(delta=1e-5, local=((2.0, 0.5, 1, 2.5),)), "`phases` must be an integer >= 1. Found 2.5"),
])
def test_invalid_events_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RunEvents(**kwargs)


def test_invalid_delta_of_the_composition_is_refused():
    with pytest.raises(ValueError, match=r"`delta` must be in \(0, 1\). Found 1.0"):
        composed_epsilon([], 1.0)
