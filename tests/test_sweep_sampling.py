"""Client sampling in the batched engine (issue 44): a sampled run's round sums its cohort's clipped
means and divides by the expected cohort; the cohort of (key, r) is core.sampling.round_cohort's."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from diff2_flwr.core.sampling import Sampling, round_cohort
from diff2_flwr.lab import sweep
from diff2_flwr.lab.sweep import RunSpec, run_batch
from diff2_flwr.runtime.config import parse_config
from diff2_flwr.runtime.session import load_data

P = 4


@pytest.fixture(scope="module")
def data():
    return load_data(parse_config({"dataset": {"name": "synthetic", "num_samples": 801},
                                   "method": "diff2",
                                   "training": {"clients": P, "rounds": 4, "restart_every": 2}}))


def _spec(T=1, lr=0.1, sigma=0.0, sampling=None, cohort_seed=0, noise_seed=3, clip=1.0):
    return RunSpec(T, lr, clip, clip, sigma, sigma, noise_seed, 0, sampling=sampling,
                   cohort_seed=cohort_seed)


def _bytes(results):
    return [(r.final_x.tobytes(), r.train_loss.tobytes(), r.diverged_at) for r in results]


def _seeds(want, rounds, sampling, count=1, limit=20_000):
    """The first cohort seeds whose cohorts in rounds 1.. are ``want`` (a list of sets)."""
    found = []
    for seed in range(limit):
        if all(set(round_cohort(seed, r, sampling, P).tolist()) == w
               for r, w in enumerate(want, start=1)):
            found.append(seed)
            if len(found) == count:
                return found
    raise AssertionError(f"no cohort seed gives {want} in {limit} tries")


@pytest.mark.parametrize("sampling", [Sampling("poisson", rate=1.0), Sampling("fixed", size=P)])
def test_everyone_sampled_is_full_participation_bit_for_bit(data, sampling):
    """π = 1: every cohort is all P clients and E|S| = P, so the runs are the unsampled ones' bits,
    noise included, whatever the cohort key."""
    plain = [_spec(T=2, sigma=0.3, noise_seed=s) for s in (1, 2)]
    sampled = [dataclasses.replace(s, sampling=sampling, cohort_seed=11 * k)
               for k, s in enumerate(plain)]
    assert _bytes(run_batch(data, sampled, rounds=4)) == _bytes(run_batch(data, plain, rounds=4))


def test_a_restart_round_sums_its_cohort_over_the_expected_cohort(data):
    """One noiseless round with a fixed cohort of one client: x_1 = x_0 − η ClippedMean_p for the
    drawn p. The four clients' means, averaged, are what the unsampled run steps by (to rounding);
    and a Poisson cohort {0, 2} at q = 1/2 steps by (mean_0 + mean_2) / (q P)."""
    one = Sampling("fixed", size=1)
    seeds = [_seeds([{p}], 1, one)[0] for p in range(P)]
    poisson = Sampling("poisson", rate=0.5)
    pair = _seeds([{0, 2}], 1, poisson)[0]
    specs = [_spec(sampling=one, cohort_seed=s) for s in seeds]
    specs += [_spec(), _spec(sampling=poisson, cohort_seed=pair)]
    x0 = sweep.batch_model(data, init_seed=0)[1]
    res = run_batch(data, specs, rounds=1)
    means = [(x0 - r.final_x) / 0.1 for r in res]  # ṽ_1 of each run
    full = means[P]
    assert np.abs(np.mean(means[:P], axis=0) - full).max() <= 1e-13 * np.abs(full).max()
    # the clients differ: a sampled round is not the full mean
    assert np.abs(means[0] - full).max() > 1e-3 * np.abs(full).max()
    np.testing.assert_allclose(means[P + 1], (means[0] + means[2]) / (0.5 * P), rtol=1e-12,
                               atol=1e-15)


def test_a_difference_round_adds_its_own_cohort_differences(data):
    """DIFF2 (T = 2), noiseless: round 1's cohort is everyone (Poisson q = 1/2, so ṽ_1 = Σ_p
    mean_p / (qP)), round 2's is {p}: ṽ_2 − ṽ_1 = Δ_p / (qP), client p's clipped mean of
    differences at (x_1, x_0). An unsampled run with η' = η / q reaches the same x_1, and its
    ṽ_2 − ṽ_1 is the four clients' Δ_p averaged."""
    q, lr = 0.5, 0.1
    poisson = Sampling("poisson", rate=q)
    seeds = [_seeds([set(range(P)), {p}], 2, poisson)[0] for p in range(P)]
    specs = [_spec(T=2, lr=lr, sampling=poisson, cohort_seed=s, clip=50.0) for s in seeds]
    specs.append(_spec(T=2, lr=lr / q, clip=50.0))
    x0 = sweep.batch_model(data, init_seed=0)[1]
    one = run_batch(data, specs, rounds=1)
    x1 = one[0].final_x
    for r in one:  # every run reaches the same x_1
        np.testing.assert_allclose(r.final_x, x1, rtol=1e-13, atol=1e-15)
    v1_sampled, v1_full = (x0 - x1) / lr, (x0 - x1) / (lr / q)
    two = run_batch(data, specs, rounds=2)
    deltas = [((x1 - r.final_x) / lr - v1_sampled) * q * P for r in two[:P]]  # Δ_p
    full = (x1 - two[P].final_x) / (lr / q) - v1_full  # mean_p Δ_p
    scale = np.abs(full).max()
    assert scale > 0
    assert np.abs(np.mean(deltas, axis=0) - full).max() <= 1e-8 * np.abs(v1_full).max()
    assert np.abs(deltas[0] - full).max() > 1e-3 * scale


def test_a_sampled_run_is_the_same_alone_and_in_a_mixed_batch(data):
    s = _spec(T=2, sigma=0.2, sampling=Sampling("poisson", rate=0.5), cohort_seed=5)
    others = [_spec(T=3, sigma=0.1, noise_seed=9), _spec(sampling=Sampling("fixed", size=2),
                                                           cohort_seed=1, sigma=0.4)]
    alone = run_batch(data, [s], rounds=6)[0]
    mixed = run_batch(data, [others[0], s, others[1]], rounds=6)[1]
    np.testing.assert_allclose(alone.final_x, mixed.final_x, rtol=0, atol=1e-13)


def test_an_overflow_outside_the_cohort_is_not_the_runs():
    """A client whose mean is not finite diverges a run only if it is in that run's cohort."""
    means = torch.zeros(3, 2, 4, dtype=torch.float64)
    means[1, :, 0] = float("nan")
    overflow = torch.zeros(3, 2, dtype=torch.bool)
    mask = np.array([[True, True], [False, True], [True, True]])
    alive, diverged = np.ones(2, dtype=bool), [None, None]
    sweep._workers_finish(means, overflow, np.ones(2), alive, diverged, 7, mask)
    assert diverged == [None, 7] and alive.tolist() == [True, False]
    overflow[2, 0] = True  # an overflow report of a sampled client
    sweep._workers_finish(means, overflow, np.ones(2), alive, diverged, 8, mask)
    assert diverged == [8, 7]


def test_an_empty_poisson_cohort_releases_noise_only(data):
    """q small: a round with no client sums nothing; the run steps by its noise alone."""
    poisson = Sampling("poisson", rate=0.05)
    seed = _seeds([set()], 1, poisson)[0]
    quiet = run_batch(data, [_spec(sampling=poisson, cohort_seed=seed)], rounds=1)[0]
    x0 = sweep.batch_model(data, init_seed=0)[1]
    assert np.array_equal(quiet.final_x, x0)  # no noise (σ = 0), no client: no step


def test_a_cohort_larger_than_the_federation_is_refused_before_anything_runs(data, monkeypatch):
    monkeypatch.setattr(sweep, "Batch", lambda *a, **k: pytest.fail("built a batch"))
    with pytest.raises(ValueError, match=r"Run 1: `sampling.size` \(m\) must be at most the "
                                         r"number of clients P = 4"):
        run_batch(data, [_spec(), _spec(sampling=Sampling("fixed", size=5))], rounds=1)
