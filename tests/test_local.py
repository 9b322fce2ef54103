"""DIFF2's private BVR-L-SGD local routine: the local steps, the server's two-step release, the
checks."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest

from diff2_flwr.core.aggregation import Reply, RoundRejected
from diff2_flwr.core.estimator import Diverged
from diff2_flwr.core.local import (
    LocalMechanism, LocalTask, choose_worker, local_seed, run_local_phase,
)
from diff2_flwr.core.privacy import calibrate
from diff2_flwr.runtime.config import ConfigError, parse_config
from diff2_flwr.runtime.driver import run_inprocess
from diff2_flwr.runtime.session import build_server, build_worker


def _linear_sum(points: np.ndarray):
    """Clipped sums for ℓ(y, z) = ½||y - z||²: ∇ℓ(y, z) - ∇ℓ(y', z) = y - y' for every record
    (data-free)."""
    calls = []

    def clipped_sum(y, y_prev, batch, radius):
        calls.append((y.copy(), y_prev.copy(), batch.copy(), radius))
        d = y - y_prev
        n = np.linalg.norm(d)
        factor = min(1.0, radius / n) if n > 0 else 1.0
        return d * factor * batch.size, int(n > radius) * batch.size, False

    return clipped_sum, calls


def _task(mech, seed=5, dim=3, r=1):
    rng = np.random.default_rng(0)
    return LocalTask(round=r, partition_id=0, x_start=rng.standard_normal(dim),
                     v=rng.standard_normal(dim), mechanism=mech, seed=seed)


def test_noise_free_local_steps_follow_the_recursion():
    """σ3 = 0, b = n (every record sampled, sum / b = mean): the BVR recursion written out by
    hand."""
    mech = LocalMechanism(steps=4, batch_size=10, learning_rate=0.3, clip=2.0, sigma=0.0)
    task = _task(mech)
    clipped_sum, calls = _linear_sum(np.zeros((10, 3)))
    result = run_local_phase(task, 10, clipped_sum)
    y_prev, w = task.x_start, task.v
    y = y_prev - 0.3 * w
    for _ in range(3):
        d = y - y_prev  # C3 = 2 > 1: never clipped for this loss
        w = w + d
        y_prev, y = y, y - 0.3 * w
    np.testing.assert_allclose(result.y, y, rtol=1e-14, atol=0)
    assert len(calls) == 3 and all(c[2].size == 10 for c in calls)
    assert [c[3] for c in calls] == pytest.approx([2.0 * np.linalg.norm(c[0] - c[1])
                                                   for c in calls])
    assert result.batch_sizes == (10, 10, 10)


def test_the_local_steps_clip_at_c3_times_the_step():
    """C3 < 1 on ½||y - z||²: every difference y_k - y_(k-1) is clipped to C3 ||y_k - y_(k-1)||."""
    mech = LocalMechanism(steps=3, batch_size=4, learning_rate=0.5, clip=0.25, sigma=0.0)
    task = _task(mech)
    clipped_sum, _ = _linear_sum(np.zeros((4, 3)))
    result = run_local_phase(task, 4, clipped_sum)
    y_prev, w = task.x_start, task.v
    y = y_prev - 0.5 * w
    for _ in range(2):
        w = w + 0.25 * (y - y_prev)
        y_prev, y = y, y - 0.5 * w
    np.testing.assert_allclose(result.y, y, rtol=1e-14)
    assert result.num_clipped == 8


def test_poisson_batches_have_mean_b_and_are_fresh_each_step():
    mech = LocalMechanism(steps=401, batch_size=20, learning_rate=1e-6, clip=1.0, sigma=0.0)
    clipped_sum, calls = _linear_sum(np.zeros((200, 2)))
    result = run_local_phase(_task(mech, dim=2), 200, clipped_sum)
    sizes = np.array(result.batch_sizes)
    # Binomial(200, 0.1): mean 20, std 4.24; over 400 steps the mean's std is 0.21 (5 std = 1.06).
    assert abs(sizes.mean() - 20) < 1.1
    assert 3.0 < sizes.std() < 5.5
    batches = [set(c[2].tolist()) for c in calls]
    assert sum(a == b for a, b in zip(batches, batches[1:])) == 0  # not one batch reused
    assert all(0 <= i < 200 for b in batches for i in b)


def test_local_noise_has_std_sigma3_times_the_radius():
    """With data-free sums of zeros, w_k - w_(k-1) is the noise alone: std σ3 C3 ||y_k -
    y_(k-1)||."""
    dim = 20000
    mech = LocalMechanism(steps=2, batch_size=5, learning_rate=0.1, clip=3.0, sigma=0.7)
    task = _task(mech, dim=dim)
    result = run_local_phase(task, 50, lambda y, yp, b, r: (np.zeros(dim), 0, False))
    y1 = task.x_start - 0.1 * task.v
    w1 = (y1 - result.y) / 0.1
    noise = w1 - task.v
    expected = 0.7 * 3.0 * np.linalg.norm(y1 - task.x_start)
    assert abs(noise.std() / expected - 1) < 0.03  # 20,000 draws: std error of the std ≈ 0.5 %
    assert abs(noise.mean()) < 4 * expected / math.sqrt(dim)


def test_seeded_local_phases_repeat_and_unseeded_ones_do_not():
    mech = LocalMechanism(steps=3, batch_size=5, learning_rate=0.1, clip=1.0, sigma=0.5)
    clipped_sum, _ = _linear_sum(np.zeros((50, 3)))
    a = run_local_phase(_task(mech, seed=11), 50, clipped_sum).y
    b = run_local_phase(_task(mech, seed=11), 50, clipped_sum).y
    c = run_local_phase(_task(mech, seed=12), 50, clipped_sum).y
    d = run_local_phase(_task(mech, seed=None), 50, clipped_sum).y
    e = run_local_phase(_task(mech, seed=None), 50, clipped_sum).y
    assert np.array_equal(a, b) and not np.array_equal(a, c) and not np.array_equal(d, e)
    assert local_seed(3, 1) == local_seed(3, 1) != local_seed(3, 2)


def test_the_chosen_worker_is_uniform_and_a_function_of_key_and_round():
    picks = np.array([choose_worker(1234, r, 5) for r in range(1, 5001)])
    counts = np.bincount(picks, minlength=5)
    # chi-square with 4 degrees of freedom; 18.47 is its 0.999 quantile.
    assert ((counts - 1000) ** 2 / 1000).sum() < 18.47
    assert choose_worker(1234, 7, 5) == choose_worker(1234, 7, 5)


def test_the_worker_refuses_a_task_that_does_not_fit():
    mech = LocalMechanism(steps=2, batch_size=60, learning_rate=0.1, clip=1.0, sigma=0.5)
    clipped_sum, _ = _linear_sum(np.zeros((50, 3)))
    with pytest.raises(ValueError, match="b = 60 exceeds this worker's 50 records"):
        run_local_phase(_task(mech), 50, clipped_sum)
    bad = LocalTask(1, 0, np.array([0.0, np.nan]), np.zeros(2), LocalMechanism(2, 5, 0.1, 1.0, 0.5),
                    None)
    with pytest.raises(ValueError, match="NaN or inf"):
        run_local_phase(bad, 50, clipped_sum)
    with pytest.raises(ValueError, match="steps"):
        LocalMechanism(steps=1, batch_size=5, learning_rate=0.1, clip=1.0, sigma=0.5)


def test_run_away_local_iterates_are_divergence_not_a_release():
    mech = LocalMechanism(steps=3, batch_size=5, learning_rate=1e300, clip=1e10, sigma=0.5)
    task = LocalTask(1, 0, np.ones(2), np.full(2, 1e300), mech, 3)
    with pytest.raises(Diverged, match="local step 1"):
        run_local_phase(task, 50, lambda y, yp, b, r: (np.zeros(2), 0, False))


# ---------------------------------------------------------------- the server's two-step release,
# end to end

def _cfg(**local):
    data = {"name": "b", "method": "diff2", "dataset": {"name": "synthetic", "num_samples": 2000},
            "training": {"rounds": 12, "restart_every": 4, "clients": 4, "learning_rate": 0.1,
                         "seed": 7,
                         "clip_diff": 3.0}, "evaluation": {"every": 4}}
    if local:
        data["local"] = {"steps": 3, "batch_size": 32, "clip": 3.0, "share": 0.5} | local
    return parse_config(data)


def test_a_local_run_is_reproducible_spends_at_most_epsilon_and_charges_every_step():
    cfg = _cfg(steps=3)
    a = run_inprocess(cfg, record=False, progress=None)
    b = run_inprocess(cfg, record=False, progress=None)
    assert np.array_equal(a.state.x, b.state.x)
    rows = a.history[1:]
    assert [r["local_worker"] for r in rows] == [choose_worker(7, r["round"], 4) for r in rows]
    cal = a.calibration
    assert cal.local is not None and cal.local.steps == 3
    assert len(a.ledger.events) == 2 * 12 and sum(getattr(e, "steps",
                                                          0) for e in a.ledger.events) == 2 * 12
    eps = a.summary()["privacy"]["epsilon_spent"]
    assert eps == a.ledger.epsilon_pld <= cal.epsilon
    # the calibration uses the budget (margin 0.5 % + discretisation)
    assert eps > 0.98 * cal.epsilon
    assert a.ledger.epsilon_rdp > eps  # RDP without amplification: looser


def test_local_steps_make_more_progress_per_round_than_the_gd_routine():
    """Seeded: K = 3 local steps per round reach a lower train loss after 12 rounds than DIFF2-GD (ε
    = 8)."""
    def loss(cfg):
        server = run_inprocess(cfg, record=False, progress=None)
        return server.history[-1]["train_loss"]

    with_local, without = _cfg(steps=3), _cfg()
    with_local = parse_config(with_local.to_dict() | {"privacy": with_local.to_dict()["privacy"] | {
        "epsilon": 8.0}})
    without = parse_config(without.to_dict() | {"privacy": without.to_dict()["privacy"] | {
        "epsilon": 8.0}})
    assert loss(with_local) < 0.8 * loss(without)


def _pending():
    cfg = _cfg(steps=3)
    server = build_server(cfg, record=False, progress=None)
    workers = [build_worker(cfg, p) for p in range(4)]
    task = server.release([w.reply(server.plan()) for w in workers])
    assert isinstance(task, LocalTask)
    return server, workers, task


def _reply_like(reply: Reply, **changes) -> Reply:
    fields = {"client": reply.client, "partition_id": reply.partition_id,
              "arrays": list(reply.arrays),
              "num_samples": reply.num_samples, "num_clipped": reply.num_clipped,
              "overflow": reply.overflow}
    return Reply(**(fields | changes))


@pytest.mark.parametrize("change, check", [
    ("partition", "local-worker"), ("arrays", "arrays"), ("shape", "shape"), ("dtype", "dtype"),
    ("nan", "finite"), ("n_min", "n_min"),
])
def test_the_server_rejects_a_bad_local_reply_and_releases_nothing(change, check):
    server, workers, task = _pending()
    good = workers[task.partition_id].local_phase(task)
    arrays = list(good.arrays)
    bad = {
        "partition": {"partition_id": (task.partition_id + 1) % 4},
        "arrays": {"arrays": arrays[:-1]},
        "shape": {"arrays": [arrays[0].reshape(-1)] + arrays[1:]},
        "dtype": {"arrays": [arrays[0].astype(np.float32)] + arrays[1:]},
        "nan": {"arrays": [np.full_like(arrays[0], np.nan)] + arrays[1:]},
        "n_min": {"num_samples": 3},
    }[change]
    before = server.state
    with pytest.raises(RoundRejected, match=f"check '{check}' failed"):
        server.finish_local(_reply_like(good, **bad))
    assert server.state is before and server.summary()["status"] == "failed"
    assert server.history[-1]["round"] == 0  # no row of round 1


def test_an_overflowing_local_phase_is_divergence():
    server, workers, task = _pending()
    good = workers[task.partition_id].local_phase(task)
    with pytest.raises(Diverged, match="local steps"):
        server.finish_local(_reply_like(good, overflow=True))
    assert server.summary()["status"] == "diverged"


def test_the_next_round_waits_for_the_local_phase_and_the_wrong_worker_refuses_it():
    server, workers, task = _pending()
    with pytest.raises(RuntimeError, match="awaits its local phase"):
        server.plan()
    other = workers[(task.partition_id + 1) % 4]
    with pytest.raises(ValueError, match=f"for partition {task.partition_id}"):
        other.local_phase(task)
    server.finish_local(workers[task.partition_id].local_phase(task))
    assert server.state.round == 1 and server.plan().round == 2


def test_a_server_whose_local_noise_disagrees_with_the_calibration_is_refused():
    from dataclasses import replace

    from diff2_flwr.runtime.server_core import ServerSpec
    from diff2_flwr.runtime.session import Diff2Server
    server, _, _ = _pending()
    weaker = replace(server.local, sigma=server.local.sigma / 4)
    with pytest.raises(ValueError, match="local sigma"):
        Diff2Server(ServerSpec(mechanism=server.mechanism, routine=server.routine,
                               layout=server.layout, rounds=server.rounds, clients=4,
                               n_min=server.n_min, calibration=server.calibration, local=weaker),
                               x0=np.zeros(server.layout.dim), seed=1)
    with pytest.raises(ValueError, match="local routine is off"):
        Diff2Server(ServerSpec(mechanism=server.mechanism, routine=server.routine,
                               layout=server.layout, rounds=server.rounds, clients=4,
                               n_min=server.n_min, calibration=server.calibration, local=None),
                               x0=np.zeros(server.layout.dim), seed=1)


def test_the_budget_guard_counts_the_local_steps():
    """With a target between ε after the next server round alone and ε after it and its local steps,
    the round is refused: a guard that forgot the local steps would let it through."""
    from dataclasses import replace

    server, workers, task = _pending()
    server.finish_local(workers[task.partition_id].local_phase(task))
    gaussian, local = server.calibration.round_events(False)
    without, with_local = server.ledger.record(gaussian).epsilon_pld, server.ledger.record(
        gaussian, local).epsilon_pld
    assert without < with_local
    server.spec = replace(server.spec, calibration=replace(server.calibration,
                                                           epsilon=(without + with_local) / 2))
    before = server.state
    with pytest.raises(RoundRejected, match="local steps included"):
        server.release([w.reply(server.plan()) for w in workers])
    assert server.state is before and server.pending is None


@pytest.mark.parametrize("data, key, found", [
    ({"method": "dpgd", "training": {"restart_every": None}}, "local.steps", "3"),
    ({"privacy": {"mode": "rdp"}}, "privacy.mode", "rdp"),
    ({"output": {"checkpoint": "ck.npz"}}, "output.checkpoint", "ck.npz"),
    ({"local": {"steps": 1}}, "local.steps", "1"),
    ({"local": {"share": 1.0}}, "local.share", "1.0"),
])
def test_local_routine_config_errors_name_the_key(data, key, found):
    base = _cfg(steps=3).to_dict()
    merged = copy.deepcopy(base)
    for section, values in data.items():
        if isinstance(values, dict):
            merged[section] = {**merged[section], **values}
        else:
            merged[section] = values
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as err:
        parse_config(merged, "exp.yaml")
    assert found in str(err.value)


def test_a_batch_larger_than_the_smallest_shard_is_refused():
    cfg = _cfg(batch_size=1000)
    with pytest.raises(ConfigError, match=r"local\.batch_size.*at most n_min = 400"):
        build_server(cfg, record=False, progress=None)


def test_calibration_of_the_local_steps_uses_the_budget():
    cal = calibrate(epsilon=3.0, delta=1e-5, rounds=200, restart_every=20, u=1.25, n_min=1000,
                    clients=10, local_steps=4, local_batch_size=50, local_share=0.4)
    server_only = calibrate(epsilon=3.0, delta=1e-5, rounds=200, restart_every=20, u=1.25,
                            n_min=1000, clients=10)
    # the server's rounds leave 40 % of μ²
    assert cal.budget == pytest.approx(0.6 * server_only.budget)
    assert cal.z1 == pytest.approx(server_only.z1 / math.sqrt(0.6))
    assert 0.99 * 3.0 < cal.planned_epsilon <= 3.0
    assert cal.local.sigma3 == pytest.approx(cal.local.z3 / 50) and cal.local.sampling_prob == 0.05
    with pytest.raises(ValueError, match="mode 'exact'"):
        calibrate(epsilon=3.0, delta=1e-5, rounds=200, restart_every=20, u=1.25, n_min=1000,
                  clients=10, mode="rdp", local_steps=4, local_batch_size=50, local_share=0.4)
