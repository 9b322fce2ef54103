"""Rounds of the cohorts' union (issue 44, item 4): where every run of a batch samples its clients,
a round of the batched engine computes only the clients of some run's cohort, and every result is
the bits of computing every client each round — DIFF2 (a returning client's pass at the previous
iterate computed late), DP-GD and GD, Poisson and fixed cohorts, an empty union, both backends and
both forward passes of the fused one."""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
import pytest
import torch

from diff2_flwr.core import fused
from diff2_flwr.core.sampling import Sampling
from diff2_flwr.lab import backend, sweep
from diff2_flwr.lab.sweep import RunSpec, run_batch
from diff2_flwr.runtime.config import parse_config
from diff2_flwr.runtime.session import load_data
from diff2_flwr.task.data import PreparedData

P, ROUNDS, EVAL_EVERY = 6, 12, 4
KERNEL = fused.load() is not None
POISSON, FIXED = Sampling("poisson", rate=0.3), Sampling("fixed", size=2)
RARE = Sampling("poisson", rate=0.2)


def _uneven(x: np.ndarray, y: np.ndarray, name: str, task: str = "regression",
            classes: tuple[str, ...] = ()) -> PreparedData:
    """P shards of unequal sizes (the batch pads them), a test split of 40 records."""
    sizes = np.array([70, 95, 60, 110, 80, 85])
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    n = int(bounds[-1])
    return PreparedData(name=name, x_train=x[:n], y_train=y[:n], x_test=x[n:n + 40],
                        y_test=y[n:n + 40],
                        shard_bounds=tuple(zip(bounds[:-1].tolist(), bounds[1:].tolist())),
                        target_scale=1.0, task=task, classes=classes)


@functools.lru_cache(maxsize=None)
def _data(name: str) -> PreparedData:
    """``regression``: the synthetic set, 8 features; ``classes``: 12 features, 7 classes (the
    output layer a matrix product: torch's bits then depend on a sample's place in a call);
    ``wide``: 40 features, 20 of them binary (first-layer sums by products; two-valued columns)."""
    rng = np.random.default_rng(44)
    if name == "regression":
        return load_data(parse_config({"dataset": {"name": "synthetic", "num_samples": 700},
                                       "method": "gd", "training": {"clients": P}}))
    if name == "classes":
        x = rng.normal(size=(540, 12))
        y = (np.abs(x[:, :3].sum(1) * 2.3 + rng.normal(size=540)) % 7).astype(np.int64)
        return _uneven(x, y.astype(np.float64), name, "classification",
                       tuple(str(c) for c in range(7)))
    x = np.concatenate([rng.normal(size=(540, 20)), rng.integers(0, 2, size=(540, 20))], 1)
    y = np.tanh(x[:, :4].sum(1)) + 0.3 * x[:, 25]
    return _uneven(x, y, name)


def _specs(kind: str, seeds: list[int]) -> list[RunSpec]:
    """``mixed``: DIFF2 (T = 3, Poisson), DIFF2 (T = 2, fixed m = 2), DP-GD (Poisson), GD (fixed);
    ``empty``: DIFF2, DP-GD and GD, all Poisson at q = 0.2 (an empty union is possible)."""
    inf = math.inf
    if kind == "mixed":
        return [RunSpec(3, 0.2, 1.0, 3.0, 0.4, 0.6, 5, 5, sampling=POISSON, cohort_seed=seeds[0]),
                RunSpec(2, 0.1, 0.5, 1.0, 0.3, 0.5, 6, 6, sampling=FIXED, cohort_seed=seeds[1]),
                RunSpec(1, 0.3, 0.5, 0.5, 0.7, 0.7, 7, 7, sampling=POISSON, cohort_seed=seeds[2]),
                RunSpec(1, 0.2, inf, inf, 0.0, 0.0, 8, 8, sampling=FIXED, cohort_seed=seeds[3])]
    return [RunSpec(3, 0.2, 1.0, 3.0, 0.4, 0.6, 5, 5, sampling=RARE, cohort_seed=seeds[0]),
            RunSpec(1, 0.3, 0.5, 0.5, 0.7, 0.7, 7, 7, sampling=RARE, cohort_seed=seeds[1]),
            RunSpec(1, 0.2, inf, inf, 0.0, 0.0, 8, 8, sampling=RARE, cohort_seed=seeds[2])]


def _schedule(specs: list[RunSpec]) -> list[tuple[bool, bool, np.ndarray | None, np.ndarray]]:
    """Per round r = 1..ROUNDS: (every run restarts, evaluated, the union the engine computes or
    None, the cohorts' mask [P, K]) — as run_batch decides them."""
    cohorts = sweep._Cohorts(specs, P)
    T = np.array([s.restart_every for s in specs])
    out = []
    for r in range(1, ROUNDS + 1):
        mask = cohorts.mask(r)
        evaluated = (r - 1) % EVAL_EVERY == 0 or r == 1
        out.append((bool(((r - 1) % T == 0).all()), evaluated,
                    sweep._round_clients(mask, evaluated), mask))
    return out


def _returns(schedule) -> bool:
    """Some difference round computes a client the round before did not."""
    return any(not every and union is not None and before is not None
               and set(union.tolist()) - set(before.tolist())
               for (every, _, union, _), (_, _, before, _) in zip(schedule[1:], schedule))


def _empty_run_cohort(schedule) -> bool:
    """Some run's cohort is empty in a round the engine computes on the union."""
    return any(union is not None and not mask.any(0).all() for _, _, union, mask in schedule)


def _empty_union_then_difference(schedule) -> bool:
    """A round with no client at all, then a difference round of some clients (their passes at
    the empty round's iterate computed late)."""
    return any(union is not None and len(union) == 0 and not every_next and nxt is not None
               and len(nxt) for (_, _, union, _), (every_next, _, nxt, _)
               in zip(schedule, schedule[1:]))


@functools.lru_cache(maxsize=None)
def _seeds(kind: str) -> list[int]:
    """The first cohort seeds whose schedule has what the test needs (checked again by the test)."""
    count = 4 if kind == "mixed" else 3
    for s in range(5000):
        seeds = [1000 * k + s for k in range(count)]
        schedule = _schedule(_specs(kind, seeds))
        if not _returns(schedule):
            continue
        if kind == "mixed" and _empty_run_cohort(schedule):
            return seeds
        if kind == "empty" and _empty_union_then_difference(schedule):
            return seeds
    raise AssertionError(f"no cohort seeds for {kind}")


# (data, dtype, run_batch options, the fused backend's forward; None: the torch backend)
ENGINES = {
    "torch-backend": ("regression", torch.float64, {}, None),
    "torch-backend-classes": ("classes", torch.float64, {}, None),
    "kernel-forward": ("regression", torch.float64, {}, "kernel"),
    "kernel-forward-classes-f32": ("classes", torch.float32, {}, "kernel"),
    "torch-forward-classes": ("classes", torch.float64, {}, "torch"),
    "torch-forward-products-f32": ("wide", torch.float32, {"accumulate": "float32"}, "torch"),
    "torch-forward-two-valued-f32": ("wide", torch.float32,
                                     {"accumulate": "float32", "two_valued": True}, "torch"),
}


def _engine(monkeypatch: pytest.MonkeyPatch, forward: str | None) -> None:
    """The backend run_batch chooses: the torch backend (no kernel), or the fused one with this
    forward pass."""
    if forward is None:
        monkeypatch.setattr(fused, "load", lambda *a, **k: None)
        return
    if not KERNEL:
        pytest.skip("no C++ compiler here: the kernel cannot be built")
    monkeypatch.setattr(backend.FusedBackend, "__init__",
                        functools.partialmethod(backend.FusedBackend.__init__, forward=forward))


def _record(monkeypatch: pytest.MonkeyPatch) -> list[tuple[bool, np.ndarray | None]]:
    """Every backend round's (every run restarts, clients), as the backends are asked."""
    calls: list[tuple[bool, np.ndarray | None]] = []
    for cls in (backend.TorchBackend, backend.FusedBackend):
        def spy(self, x, restart, radius, *, _round=cls.round, **kw):
            calls.append((bool(restart.all()), kw.get("clients")))
            return _round(self, x, restart, radius, **kw)
        monkeypatch.setattr(cls, "round", spy)
    return calls


def _bits(results) -> list[tuple]:
    return [(r.diverged_at, *(None if a is None else (a.dtype, a.shape, a.tobytes())
                              for a in (r.rounds, r.train_loss, r.grad_norm_sq, r.test_loss,
                                        r.test_accuracy, r.final_x)))
            for r in results]


@pytest.mark.parametrize("kind", ["mixed", "empty"])
@pytest.mark.parametrize("engine", list(ENGINES))
def test_a_round_of_the_union_is_a_round_of_every_client_bit_for_bit(engine, kind, monkeypatch):
    """A batch whose runs all sample, run on the cohorts' union (the engine's rounds) and with
    every client each round: every metric and final iterate bit for bit, on each backend, forward
    pass and dtype; the union rounds were the schedule's (a client back in a difference round, an
    empty cohort; with ``empty``, a round of no client then a difference round). Teeth: a backend
    that drops a returning client's late pass, reads a stale one, or whose forward pass depends on
    which clients share a call changes some bit here (measured: each of the three does)."""
    name, dtype, options, forward = ENGINES[engine]
    data, specs = _data(name), _specs(kind, _seeds(kind))
    schedule = _schedule(specs)
    _engine(monkeypatch, forward)
    calls = _record(monkeypatch)
    kw = {"rounds": ROUNDS, "eval_every": EVAL_EVERY, "dtype": dtype, **options}
    union = run_batch(data, specs, **kw)
    asked = list(calls)
    calls.clear()
    monkeypatch.setattr(sweep, "_round_clients", lambda mask, evaluated: None)
    every = run_batch(data, specs, **kw)
    assert all(clients is None for _, clients in calls)
    assert _bits(union) == _bits(every)
    # what the union run computed: the schedule the test asked for
    assert [(a, None if c is None else c.tolist()) for a, c in asked] == [
        (a, None if u is None else u.tolist()) for a, _, u, _ in schedule]
    assert _returns(schedule)
    assert _empty_run_cohort(schedule) if kind == "mixed" else (
        _empty_union_then_difference(schedule))
    assert sum(len(u) for _, _, u, _ in schedule if u is not None) < P * sum(
        u is not None for _, _, u, _ in schedule)
    assert all(r.diverged_at is None for r in union)


@pytest.mark.skipif(not KERNEL, reason="no C++ compiler here: the kernel cannot be built")
def test_the_kernels_forward_gives_the_union_the_bits_of_the_full_layout():
    """The kernel's bits for a client do not depend on the other clients of its call: the sampled
    runs computed on their union (alone) end where they end in a batch with a run that does not
    sample (every client, the groups of Batch.groups) — bit for bit."""
    data = _data("regression")
    specs = _specs("mixed", _seeds("mixed"))
    alone = run_batch(data, specs, rounds=ROUNDS, eval_every=EVAL_EVERY)
    plain = dataclasses.replace(specs[0], sampling=None, cohort_seed=None)
    mixed = run_batch(data, [*specs, plain], rounds=ROUNDS, eval_every=EVAL_EVERY)
    for a, b in zip(alone, mixed):
        assert a.final_x.tobytes() == b.final_x.tobytes()


def _backends(forward: str | None, dtype: torch.dtype, data: PreparedData, runs: int,
              compile: bool):
    """Two backends of the same kind: one asked for client subsets, one for every client."""
    mlp = sweep.batch_model(data)[0]
    if forward is None:
        return [backend.TorchBackend(mlp, backend.Batch(data, dtype), runs, compile=compile)
                for _ in range(2)]
    kernel = fused.load()
    return [backend.FusedBackend(kernel, mlp, backend.Batch(data, dtype), runs, forward=forward,
                                 subsets=True, compile=compile) for _ in range(2)]


@pytest.mark.parametrize(("forward", "compile"), [
    (None, False), ("kernel", False), ("torch", False),
    pytest.param("torch", True, marks=pytest.mark.slow)])
def test_each_client_of_a_subset_round_gets_its_every_client_rows(forward, compile):
    """Backends directly, round by round: a subset round's clipped sums and overflow flags are, row
    for row, the every-client round's — after an empty round, for a client back after two rounds
    away, in rounds where some runs restart, after a round where all restart; an evaluated round
    takes every client."""
    if forward is not None and not KERNEL:
        pytest.skip("no C++ compiler here: the kernel cannot be built")
    data = _data("classes")
    K = 3
    part, full = _backends(forward, torch.float64, data, K, compile)
    d = sweep.batch_model(data)[1].size
    rng = np.random.default_rng(1)
    x = torch.as_tensor(rng.normal(scale=0.3, size=(K, d)))
    radius = torch.tensor([0.5, 2.0, math.inf], dtype=torch.float64)
    # (restart per run, clients): client 4 is away in rounds 3-4 and back in 5
    rounds = [([1, 1, 1], [0, 2, 4]), ([0, 1, 0], [1, 4]), ([0, 0, 1], []), ([0, 0, 0], [0, 5]),
              ([1, 0, 0], [2, 3, 4, 5]), ([0, 0, 0], None), ([0, 1, 0], [4]),
              ([1, 1, 1], [1]), ([0, 0, 0], [0, 1, 2, 3, 4, 5])]
    for i, (restart, clients) in enumerate(rounds):
        x = x + torch.as_tensor(rng.normal(scale=0.05, size=(K, d)))
        flags = torch.tensor(restart, dtype=torch.bool)
        members = None if clients is None else np.array(clients, dtype=np.int64)
        got = part.round(x, flags, radius, train=clients is None, clients=members)
        want = full.round(x, flags, radius, train=clients is None)
        rows = torch.arange(P) if clients is None else torch.as_tensor(clients, dtype=torch.long)
        assert got.sums.shape == (len(rows), K, d), i
        assert torch.equal(got.sums, want.sums[rows]), i
        assert torch.equal(got.overflow, want.overflow[rows]), i
        if clients is None:
            assert all(torch.equal(a, b) for a, b in zip(got.train, want.train))


def test_a_subset_round_is_refused_where_it_cannot_be_honoured():
    data = _data("regression")
    mlp = sweep.batch_model(data)[0]
    b = backend.Batch(data, torch.float64)
    torch_backend = backend.TorchBackend(mlp, b, 2)
    x, every = torch.zeros(2, mlp.dim, dtype=torch.float64), torch.ones(2, dtype=torch.bool)
    radius = torch.ones(2, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"an evaluated round \(train=True\) reads every client"):
        torch_backend.round(x, every, radius, train=True, clients=np.array([0, 1]))
    with pytest.raises(ValueError, match=r"clients must be sorted distinct indices in 0\.\.5"):
        torch_backend.round(x, every, radius, train=False, clients=np.array([3, 1]))
    with pytest.raises(ValueError, match=r"clients must be sorted distinct indices"):
        torch_backend.round(x, every, radius, train=False, clients=np.array([6]))
    if not KERNEL:
        return
    fused_backend = backend.FusedBackend(fused.load(), mlp, b, 2)
    with pytest.raises(ValueError, match="needs a backend built with subsets=True"):
        fused_backend.round(x, every, radius, train=False, clients=np.array([0]))



@pytest.mark.slow
def test_compiled_rounds_of_the_union_are_rounds_of_every_client_bit_for_bit(monkeypatch):
    """Compiled (torch.compile), torch's forward pass still runs one client a call: the union's
    bits are every client's (the torch backend's compiled late passes:
    test_each_client_of_a_subset_round_gets_its_every_client_rows)."""
    name, dtype, options, forward = ENGINES["torch-forward-classes"]
    data, specs = _data(name), _specs("mixed", _seeds("mixed"))
    _engine(monkeypatch, forward)
    kw = {"rounds": ROUNDS, "eval_every": EVAL_EVERY, "dtype": dtype, "compile": True, **options}
    union = run_batch(data, specs, **kw)
    monkeypatch.setattr(sweep, "_round_clients", lambda mask, evaluated: None)
    assert _bits(union) == _bits(run_batch(data, specs, **kw))


@pytest.mark.parametrize("name", ["classes", "wide"])
def test_a_gathered_group_of_consecutive_clients_is_the_batchs_group(name):
    """Batch.gather of the clients of one of Batch.groups' groups holds the same tensors, in rows
    and in the kernel's blocked layout, with the float64 rows and two-valued entries of many
    features; a subset holds each client's own slices."""
    b = backend.Batch(_data(name), torch.float32)
    two = name == "wide"
    fields = ("a_t", "y", "x64_t", "sq_a", "mask", "x_rows")
    for group in b.groups(2, 10, cap=2 * 10 * b.N * 4 * 2, two_valued=two):  # two clients each
        for got, want in ((b.gather(group.members, two_valued=two), group),
                          (b.gather(group.members, blocked=16, two_valued=two),
                           group.to_blocked(16))):
            assert got.clients == want.clients and got.blocked == want.blocked
            for f in fields:
                assert (getattr(got, f) is None) == (getattr(want, f) is None), f
                if getattr(want, f) is not None:
                    assert torch.equal(getattr(got, f), getattr(want, f)), f
            if two:
                assert all(torch.equal(u, v) for u, v in zip(got.two_valued, want.two_valued)
                           if isinstance(u, torch.Tensor))
    some = b.gather(np.array([1, 4]))
    N = b.N
    for j, p in enumerate((1, 4)):
        assert torch.equal(some.a_t[:, j * N:(j + 1) * N], b.a_t[:, p * N:(p + 1) * N])
        assert torch.equal(some.mask[j * N:(j + 1) * N], b.mask[p * N:(p + 1) * N])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_kernels_forward_writes_its_pass_into_the_one_two_rounds_back_with_the_same_bits(
        dtype):
    """Every-client rounds of the kernel's forward write each kept pass into the pass it replaced
    a round earlier (read by no one: ``forward_sums``' ``out``) instead of fresh memory: the same
    sums, flags and evaluations, bit for bit, as a backend that allocates a fresh pass each round —
    through restarts, difference rounds, an evaluated round and a round that keeps no pass."""
    if not KERNEL:
        pytest.skip("no C++ compiler here: the kernel cannot be built")
    data = _data("regression")
    K, kernel, mlp = 3, fused.load(), sweep.batch_model(data)[0]
    reuse, fresh = [backend.FusedBackend(kernel, mlp, backend.Batch(data, dtype), K,
                                         forward="kernel") for _ in range(2)]
    d = sweep.batch_model(data)[1].size
    rng = np.random.default_rng(3)
    x = torch.as_tensor(rng.normal(scale=0.3, size=(K, d)))
    radius = torch.tensor([0.5, 2.0, 1.0], dtype=torch.float64)
    # (restart per run, evaluated, keep)
    rounds = [([1, 1, 1], True, True), ([0, 0, 0], False, True), ([0, 1, 0], False, True),
              ([0, 0, 0], False, True), ([1, 1, 1], False, False), ([1, 1, 1], False, True),
              ([0, 0, 0], True, True), ([0, 0, 1], False, True)]
    pointers = []
    for i, (restart, train, keep) in enumerate(rounds):
        x = x + torch.as_tensor(rng.normal(scale=0.05, size=(K, d)))
        flags = torch.tensor(restart, dtype=torch.bool)
        fresh._spare = None  # never a pass to write into
        got = reuse.round(x, flags, radius, train=train, keep=keep)
        want = fresh.round(x, flags, radius, train=train, keep=keep)
        assert torch.equal(got.sums, want.sums) and torch.equal(got.overflow, want.overflow), i
        if train:
            assert all(torch.equal(a, b) for a, b in zip(got.train, want.train)), i
        kept = reuse._prev[0]
        pointers.append(None if kept is None else kept.a.data_ptr())
    # the pass of round 4 (index 3) went into round 2's memory, round 3's into round 1's
    assert pointers[3] == pointers[1] and pointers[2] == pointers[0]
