"""``diff2 audit --engines``: attack the per-sample gradient engines with real models and
adversarial records, and check each worker's ClippedMean, and each client sum of the batched
engine, against its replace-one sensitivity.

The statistical regimes (:mod:`.runner`) drive the server with gradient canaries, records whose
per-sample gradient is handed to the worker ready-made: they never run a real model through an
engine. This regime does, through the client's own path. For each model of
:data:`~.engine_models.MODELS` (one per rule of the ghost engine,
:mod:`~diff2_flwr.core.ghost_layers`, and one whose parameters only its ``torch.func`` fallback
covers), each engine of ``training.gradients`` (``torch_func``, :mod:`~diff2_flwr.core.gradients`;
``ghost``) and each compute dtype, workers are built by
:func:`~diff2_flwr.runtime.workers.make_worker` on three shards of n records that differ in their
last record only:

- D: the attacked record z (:data:`ATTACKS`: inputs scaled by 1e3 or 1e8 so that its gradient is
  far above the radius, a target of 1e8, all padding tokens, a weight of 1e-250 with a radius below
  its norm (squares that underflow), a weight of 1e300, an infinite input, a NaN target);
- D′: z with its loss weight negated, whose gradient (difference) is exactly −z's: the replace-one
  neighbour that moves the clipped sum furthest, by exactly 2C when z is clipped;
- D⁰: a record of weight 0, whose clipped contribution is exactly 0.

Every worker's :meth:`~diff2_flwr.runtime.workers.Worker.contribute` runs at four rounds
(:data:`ROUNDS`): a restart at x₁ (radius C1), and difference rounds at (x₁, x₂) with radius
C2·‖x₁ − x₂‖ (the worker's rule), x₂ at 1 % of ‖x₁‖ from x₁, very near it (1e-9 of ‖x₁‖ in
float64, 1e-5 in float32: per-sample differences tiny against the gradients, where a difference
norm computed from the gradients' large terms cancels and under-clips), and as near along the last
coordinate alone (the head's bias: the gradients move only through the residual). Measured per
case, as ratios to the claim (1: at the bound):

- the realised sensitivity n·‖ClippedMean(D) − ClippedMean(D′)‖ / 2C (Algorithm 2: replacing one
  element moves the mean by at most 2C/n);
- the attacked record's clipped contribution n·‖ClippedMean(D) − ClippedMean(D⁰)‖ / C (D′'s too);
- each released mean's norm / C (the worker projects a mean within
  :data:`~diff2_flwr.core.clipping.NORM_RTOL` of its radius onto the ball: at most C exactly);
- whether a non-finite gradient is reported as an overflow (the round releases nothing).

The tolerance is the code's own, :data:`~diff2_flwr.core.clipping.NORM_RTOL` (float64 rounding of a
clipped sum; the ghost engine's Gram form keeps its error below it). A ratio above 1 + NORM_RTOL, a
mean outside its ball or a non-finite mean released is a **finding**: the audit fails. The ghost
engine's agreement with ``torch_func`` on the same D (n·‖mean_ghost − mean_tf‖ / 2C) is reported,
not judged: at near-cancellation ``torch_func`` subtracts two large gradients in the compute dtype
while the ghost engine subtracts the small differences first, and on ill-conditioned records
(inputs × 1e8 through attention) batched and per-sample forwards round differently; each engine
clips what it computed, which is what the sensitivity checks.

The claim holds where C/n is a normal float: with clipped entries subnormal (below 2.2e-308) the
shared clipping and the division by n rounded a record's contribution to 5x C on both engines, so
every path now refuses a radius below :data:`~diff2_flwr.core.clipping.RADIUS_FLOOR` (2^-900) and
releases nothing. :data:`ATTACKS` holds such a record ("radius x1e-322", outside
:data:`DEFAULT_ATTACKS`): it must come back a refusal.

**The batched engine** (:mod:`diff2_flwr.lab.backend`, which studies run: ``batch``, its float64
clipped sums, in float64 and float32; ``batch_f32sums``, its ``accumulate="float32"`` mode,
:mod:`diff2_flwr.core.fused`, float32 only — with float64 it is listed as ``not_applicable``, not
run) takes MLPs with an unweighted loss, so it has its own models
(:data:`~.engine_models.BATCH_MODELS`: the paper MLP on 8 features, the kernel's forward and W_1's
sums in its lanes; on 118, torch's forward and W_1's sums by products) and neighbours, each shard
the first client of its own batch beside the same filler client (torch's batched forward rounds a
sample by its position in the batch, and a difference round amplifies that to ~1e-7 of C: the
three shards must differ in the attacked record alone, at the same position):

- D: n − 1 benign records (n − 1 = ``samples`` rounded up to a multiple of 64), then z, at a window
  edge (the first sample of a product block and of a lane's block); the attacks of
  :data:`ATTACKS` without weights or tokens, and the float32 window
  (:func:`~.engine_models.float32_window`): at an iterate where f ≡ 0, 64 (product blocks) or 1,024
  (lanes) copies of one record of norm C (1 − 2^-22) whose float32 partial of 63 copies rounds up
  most when the 64th, z, closes its window;
- D′: z reflected through the model's output at x₁, (x, 2 f(x₁; x) − y): its residual, hence its
  gradient (f − y)∇f, is −z's at x₁ (to the compute dtype's rounding of f), so a clipped z moves
  the sum by ~2C at the restarts (by construction no data can make its difference at x₂ exactly
  −z's: the ratio is an inequality there, near 1 for huge records, 0 when only b_2 moves);
- D⁰: the benign records alone (z's place padding): ‖Σ(D) − Σ(D⁰)‖ is z's contribution as
  summed.

Each goes through the backend's own round API (:func:`~diff2_flwr.lab.backend.choose_backend`,
``round``): a restart of every run at x₁ (radius C1), then one round in which a run per difference
round of :data:`ROUNDS` takes its difference at its x₂ (radius C2·‖x₁ − x₂‖) and one more run
restarts beside them (:data:`BESIDE`). Checked per client sum Σ (not a mean): ‖Σ(D) − Σ(D′)‖ ≤ 2C
and ‖Σ(D) − Σ(D⁰)‖, ‖Σ(D′) − Σ(D⁰)‖ ≤ C — for ``batch`` within 1 + NORM_RTOL (float64 sums: its
own rounding, as the worker's), for ``batch_f32sums`` exactly (its claim: the kernel clips at C /
(1 + ρ), ρ ≈ 2.445e-4, so that a client sum's replace-one sensitivity is at most 2C), each decided
in rational arithmetic where the float64 norm is too close to tell (:func:`_measured`); a client
with a non-finite record (an infinite input, a NaN target) must be flagged as an overflow, and no
client not flagged may hold a non-finite sum. For float32 accumulation the remove-one check at C
exactly is the audit's own, stricter than the kernel's proof (which bounds replace-one; by the same
argument a remove-one contribution is within about C (1 + ρ)): measured at most 0.99976 C, the
float32 window 2.7e-6 above C / (1 + ρ). Float32 accumulation refuses an infinite input where
W_1's sums are products (a refusal: nothing released).

What it protects, in the terms of the threat model (docs/explanation/privacy.md): the data owner's
records against the server and anyone who sees the released sums (the SuperLink operator, the
ServerApp, the public): the noise is calibrated to 2C/n, so an engine that under-clips one record
(a norm computed too small, a layer left out of it, a float32 window's rounding not shrunk for)
leaks more than the accountant charges. What it cannot do: it checks the engines' sensitivity on
these models, records and iterates, not every model (one outside :data:`~.engine_models.MODELS`
or :data:`~.engine_models.BATCH_MODELS` may take a path none of them takes: the batched engine's
torch backend, deeper MLPs, cross-entropy), not every position of z in a window nor every crafted
window (the float32 window is one construction, at a restart), and neither the noise nor the
accounting, which the statistical regimes audit. A radius below RADIUS_FLOOR is refused by the
batched engine's backends themselves (and before them by run_batch's radius plan): the attack
"radius x1e-322" must come back a refusal there too.

References:
    Murata & Suzuki (2023), Algorithm 1 (worker lines), Algorithm 2 (ClippedMean).
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, NamedTuple

import numpy as np
import torch
from torch import nn

from ...core import fused
from ...core.clipping import NORM_RTOL, radius_norm, robust_norm
from ...core.ghost import MLP
from ...core.ghost_layers import supported_modules
from ...core.gradients import Contribution
from ...core.layout import ParameterLayout
from ...runtime.compute import pinned_threads
from ...runtime.workers import Worker, make_worker
from ...task.data import PreparedData
from ..backend import KERNEL_W1_FEATURES, Batch, FusedBackend, RoundBackend, choose_backend
from .engine_models import (
    BATCH_MODELS, MODELS, PADDING, BatchModelKind, ModelKind, float32_window, mlp_outputs,
    mlp_rows, weighted_half_squared_error,
)
from .spec import WORKER_ENGINES, EngineAuditSpec

__all__ = ["ATTACKS", "Attack", "BATCH_ACCUMULATE", "BATCH_ROUNDS", "DEFAULT_ATTACKS", "ROUNDS",
           "engine_audit", "engine_summary_line"]

#: Progress lines (stderr), or None.
Progress = Callable[[str], None] | None

#: Each difference round's step from x₁ to x₂ relative to ‖x₁‖, per compute dtype (None: restart).
ROUNDS = {"restart": None, "difference": {"float64": 1e-2, "float32": 1e-2},
          "near": {"float64": 1e-9, "float32": 1e-5},
          "near, last coordinate": {"float64": 1e-9, "float32": 1e-5}}


@dataclass(frozen=True)
class Attack:
    """How the attacked record differs from a benign one: its features scaled (or all set to
    ``value``), its target y, its loss weight, all its tokens the padding id; ``radius_scale``
    multiplies the round's radius; ``inputs``: for real-valued features only, ``tokens``: for token
    ids only."""

    scale: float = 1.0
    value: float | None = None
    target: float | None = None
    weight: float = 1.0
    padding: bool = False
    radius_scale: float = 1.0
    inputs: bool = False
    tokens: bool = False
    #: the batched engine's float32 window (:func:`~.engine_models.float32_window`: its own
    #: iterate and records)
    window: bool = False

    def applies(self, kind: ModelKind) -> bool:
        """Whether the attack fits the model's features."""
        return (not (self.inputs and kind.tokens) and not (self.tokens and not kind.tokens)
                and not self.window)

    def batch_applies(self) -> bool:
        """Whether the attack fits the batched engine's MLPs: real-valued features, no loss
        weights."""
        return not (self.padding or self.tokens or self.weight != 1.0)

    def record(self, features: np.ndarray, target: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The attacked record made from a benign one (copies)."""
        x, y = np.array(features), np.array(target, dtype=np.float64)
        if self.padding:
            x[...] = PADDING
        elif self.value is not None:
            x = np.full(x.shape, self.value)
        elif self.scale != 1.0:
            x = x * self.scale
        if self.target is not None:
            y[:-1] = self.target
        y[-1] = self.weight
        return x, y


#: Every attacked record, by name.
ATTACKS = {
    "benign": Attack(),
    "input x1e3": Attack(scale=1e3, inputs=True),
    "input x1e8": Attack(scale=1e8, inputs=True),
    "target 1e8": Attack(target=1e8),
    "all padding": Attack(padding=True, target=1e4, tokens=True),
    # squares that underflow (1e-500) under a radius just above core.clipping.RADIUS_FLOOR
    "weight 1e-250, radius x1e-253": Attack(weight=1e-250, radius_scale=1e-253),
    "weight 1e300": Attack(weight=1e300),
    "input inf": Attack(value=math.inf, inputs=True),
    "target nan": Attack(target=math.nan),
    # the batched engine's float32 accumulation: the rounding of one window at its largest
    "float32 window": Attack(window=True),
    # outside the claim's domain: C/n subnormal (see the module's docstring)
    "radius x1e-322": Attack(radius_scale=1e-322),
}
#: The attacks an audit runs by default: every one whose radius keeps C/n a normal float.
DEFAULT_ATTACKS = tuple(name for name in ATTACKS if name != "radius x1e-322")

#: A model's shards: the null record's ("null": D⁰), then (attack, "D") and (attack, "D′").
_Shards = dict[object, tuple[np.ndarray, np.ndarray]]


def _shards(kind: ModelKind, base: tuple[np.ndarray, np.ndarray], attacks: tuple[str, ...]
            ) -> _Shards:
    """D⁰ and each applicable attack's D and D′ (the last record differs)."""
    features, targets = base

    def shard(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        fx, ty = np.array(features, dtype=np.result_type(features, x)), np.array(targets)
        fx[-1], ty[-1] = x, y
        return fx, ty

    null = np.array(targets[-1])
    null[-1] = 0.0
    out: _Shards = {"null": shard(features[-1], null)}
    for name in attacks:
        if ATTACKS[name].applies(kind):
            x, y = ATTACKS[name].record(features[-1], targets[-1])
            negated = np.array(y)
            negated[-1] = -y[-1]
            out[name, "D"], out[name, "D′"] = shard(x, y), shard(x, negated)
    return out


def _rounds(x1: np.ndarray, dtype: str, spec: EngineAuditSpec, rng: np.random.Generator
            ) -> dict[str, tuple[np.ndarray | None, float]]:
    """Round name -> (x₂, or None at the restart; the radius: C1, or C2·‖x₁ − x₂‖)."""
    direction = rng.normal(size=x1.shape)
    direction /= np.linalg.norm(direction)
    last = np.zeros_like(x1)
    last[-1] = 1.0
    out: dict[str, tuple[np.ndarray | None, float]] = {}
    for name, steps in ROUNDS.items():
        if steps is None:
            out[name] = (None, spec.clip_restart)
            continue
        step = steps[dtype] * float(np.linalg.norm(x1))
        x2 = x1 + step * (last if name.endswith("coordinate") else direction)
        out[name] = (x2, spec.clip_diff * radius_norm(x1 - x2))
    return out


def _refusal(err: Exception) -> str:
    return f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:300]}"


def _contribute(worker: Worker, radius: float, x1: np.ndarray,
                x2: np.ndarray | None) -> Contribution | str:
    """The worker's contribution, or the error it refused with (nothing released)."""
    try:
        return worker.contribute(radius, x1, x2)
    except (ValueError, RuntimeError) as err:
        return _refusal(err)


def _ratio(value: float, bound: float) -> float:
    return value / bound if bound > 0 else (0.0 if value == 0 else math.inf)


def _measure(n: int, radius: float, d: Contribution, d_prime: Contribution,
             null: Contribution) -> dict:
    """One case's ratios to the claim: the sensitivity (to 2C), the contributions and the means
    (to C); which side overflowed; whether the attacked record was clipped."""
    sides = (d, d_prime)
    released = [c for c in (*sides, null) if not c.overflow]
    row = {"overflow": [d.overflow, d_prime.overflow],
           "clipped": d.num_clipped > null.num_clipped and not d.overflow,
           "sensitivity": None, "contribution": None,
           "mean": max((_ratio(robust_norm(c.mean), radius) for c in released), default=None),
           "finite": all(bool(np.all(np.isfinite(c.mean))) for c in released)}
    if not d.overflow and not d_prime.overflow:
        row["sensitivity"] = _ratio(n * robust_norm(d.mean - d_prime.mean), 2 * radius)
    if not null.overflow and any(not c.overflow for c in sides):
        row["contribution"] = max(_ratio(n * robust_norm(c.mean - null.mean), radius)
                                  for c in sides if not c.overflow)
    return row


def _name(case: dict) -> dict:
    return {k: case[k] for k in ("model", "engine", "dtype", "round", "attack")}


def _findings(case: dict) -> list[dict]:
    """What in one case exceeds the claim: a ratio above its bound (1 + NORM_RTOL, or the batched
    engine's, decided exactly: ``exceeds``), a mean outside its ball, a non-finite mean or sum
    released, a non-finite record not reported as an overflow."""
    found = []
    bound, exceeds = case.get("bound", 1 + NORM_RTOL), case.get("exceeds")
    for check in ("sensitivity", "contribution"):
        value = case.get(check)
        if value is not None and (exceeds[check] if exceeds is not None else not value <= bound):
            found.append({**_name(case), "check": check, "ratio": value, "bound": bound})
    if case.get("mean") is not None and not case["mean"] <= 1.0:
        found.append({**_name(case), "check": "mean norm", "ratio": case["mean"], "bound": 1.0})
    if case.get("finite") is False:
        found.append({**_name(case), "check": f"non-finite {case.get('released', 'mean')} "
                                              f"released", "ratio": None, "bound": None})
    if case.get("unreported"):
        found.append({**_name(case), "check": "non-finite record not reported as an overflow",
                      "ratio": None, "bound": None})
    return found


def _workers(model: nn.Module, shards: _Shards, engine: str, dtype: str
             ) -> dict[object, Worker] | str:
    """One worker per shard through the client's own path, or the error it refused with."""
    try:
        return {key: make_worker(model=model, loss=weighted_half_squared_error, data=shard,
                                 partition_id=0, dtype=dtype, gradients=engine)
                for key, shard in shards.items()}
    except (ValueError, RuntimeError) as err:
        return _refusal(err)


def _attack_engine(name: str, model: nn.Module, shards: _Shards, run: tuple[str, str, np.ndarray,
                                                                           dict]
                   ) -> tuple[list[dict], dict, Worker | None]:
    """Every case of one model on one engine and dtype: the cases, each D's released mean (for the
    agreement), and the null record's worker (for the coverage)."""
    engine, dtype, x1, rounds = run
    workers = _workers(model, shards, engine, dtype)
    n = len(shards["null"][0])
    cases, means = [], {}
    for round_name, (x2, radius) in rounds.items():
        nulls: dict[float, Contribution | str] = {}
        for attack in dict.fromkeys(key[0] for key in shards if key != "null"):
            r = radius * ATTACKS[attack].radius_scale
            case = {"model": name, "engine": engine, "dtype": dtype, "round": round_name,
                    "attack": attack, "radius": r}
            cases.append(case)
            if isinstance(workers, str):
                case["refused"] = workers
                continue
            if r not in nulls:
                nulls[r] = _contribute(workers["null"], r, x1, x2)
            got = [_contribute(workers[attack, side], r, x1, x2) for side in ("D", "D′")]
            errors = [c for c in (*got, nulls[r]) if isinstance(c, str)]
            if errors:
                case["refused"] = errors[0]
                continue
            case.update(_measure(n, r, got[0], got[1], nulls[r]))
            means[round_name, attack] = (None if got[0].overflow else got[0].mean, r)
    return cases, means, None if isinstance(workers, str) else workers["null"]


def _coverage(kind: ModelKind, model: nn.Module, ghost: Worker | None) -> dict:
    """What the model exercises: the ghost engine's rule per covered module, and the parameters
    only its torch.func fallback covers."""
    out = {"exercises": kind.exercises,
           "ghost_rules": {m: rule for m, (_, rule, _) in supported_modules(model).items()}}
    if ghost is not None:
        out["fallback"] = list(getattr(ghost.gradients, "fallback_names", ()))
    return out


def _agreement(means: dict, n: int) -> dict:
    """Per dtype and round, the largest n·‖mean_ghost(D) − mean_torch_func(D)‖ / 2C over the cases
    both engines released, and its case."""
    out: dict = {}
    for (model, dtype, round_name, attack), by_engine in means.items():
        if {"ghost", "torch_func"} - set(by_engine):
            continue
        (g, radius), (t, _) = by_engine["ghost"], by_engine["torch_func"]
        if g is None or t is None:
            continue
        value = _ratio(n * robust_norm(g - t), 2 * radius)
        best = out.setdefault(dtype, {}).setdefault(round_name, {"max": -1.0})
        if value > best["max"]:
            best.update(max=value, case=f"{model}, {attack}")
    return out


def engine_audit(spec: EngineAuditSpec, progress: Progress = None) -> dict:
    """Run the engine audit (see the module's docstring) and return its JSON-able result.

    Args:
        spec: the engines, dtypes, models, attacks, n, radii and seed.
        progress: called with one line per model, engine and dtype (e.g. to stderr), or None.

    Returns:
        ``violation`` (any finding) and ``findings``; the largest ratios to the claim per engine
        and dtype (``sensitivity``, ``contribution``) and per model, round, engine and dtype
        (``table``); the clipped cases' sensitivities (``tight``); the engines' ``agreement``;
        ``overflow`` and ``refusals``; each model's ``coverage``; the claim, the spec, the wall
        time.
    """
    started = time.perf_counter()
    attacks = spec.attacks or DEFAULT_ATTACKS
    unknown = [m for m in attacks if m not in ATTACKS]
    if unknown:
        raise ValueError(f"`attacks` must be names of {sorted(ATTACKS)}. Found {unknown}.")
    worker = tuple(e for e in spec.engines if e in WORKER_ENGINES)
    batch = tuple(e for e in spec.engines if e in BATCH_ACCUMULATE)
    names, batch_names = _models(spec, worker, batch)
    cases: list[dict] = []
    means: dict = {}
    coverage = {}
    with pinned_threads(1), warnings.catch_warnings():  # one thread: the same sums everywhere
        # torch.func's note that vmap over CPU attention has no batching rule: speed, not results
        warnings.filterwarnings("ignore", message="There is a performance drop")
        if worker:
            worker_spec = dataclasses.replace(spec, engines=worker)
            for index, name in enumerate(names):
                coverage[name] = _attack_model(worker_spec, (index, name, attacks), cases, means,
                                               progress)
        skipped = _not_applicable(batch, spec.dtypes)
        runs = [(e, d) for d in spec.dtypes for e in batch
                if not any(s["engine"] == e and s["dtype"] == d for s in skipped)]
        for index, name in enumerate(batch_names):
            coverage[name] = _attack_batch_model(spec, (index, name, attacks), runs, cases,
                                                 progress)
    return _result(spec, cases, _agreement(means, spec.samples), coverage, skipped,
                   time.perf_counter() - started)


def _models(spec: EngineAuditSpec, worker: tuple[str, ...], batch: tuple[str, ...]
            ) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The models of the worker's engines and of the batched engine's that ``spec`` attacks: every
    one by default; else the named ones, each a model of some engine attacked."""
    if spec.models is None:
        return tuple(MODELS) if worker else (), tuple(BATCH_MODELS) if batch else ()
    known = {**MODELS, **BATCH_MODELS}
    unknown = [m for m in spec.models if m not in known]
    if unknown:
        raise ValueError(f"`models` must be names of {sorted(known)}. Found {unknown}.")
    names = tuple(m for m in spec.models if m in MODELS) if worker else ()
    batch_names = tuple(m for m in spec.models if m in BATCH_MODELS) if batch else ()
    idle = [m for m in spec.models if m not in names + batch_names]
    missing = [e for e, got in ((worker, names), (batch, batch_names)) if e and not got]
    if idle or missing:
        raise ValueError(
            f"`models` must name, for each engine attacked, models it runs: the worker's engines "
            f"{list(WORKER_ENGINES)} run {sorted(MODELS)}, the batched engine's "
            f"{list(BATCH_ACCUMULATE)} run {sorted(BATCH_MODELS)}. Found {list(spec.models)} for "
            f"engines {list(spec.engines)}; name a model of each engine, or attack fewer engines.")
    return names, batch_names


def _attack_model(spec: EngineAuditSpec, which: tuple[int, str, tuple[str, ...]],
                  cases: list[dict], means: dict, progress: Progress) -> dict:
    """Every case of one model, added to ``cases`` (and its released means to ``means``); its
    coverage."""
    index, name, attacks = which
    kind = MODELS[name]
    model = kind.model(spec.seed)
    shards = _shards(kind, kind.records(np.random.default_rng([spec.seed, index]), spec.samples),
                     attacks)
    layout = ParameterLayout.of(model)
    params = dict(model.named_parameters())
    x1 = layout.flatten([params[n].detach().numpy() for n in layout.names])
    ghost = None
    for dtype in spec.dtypes:
        rounds = _rounds(x1, dtype, spec, np.random.default_rng([spec.seed, index, 1]))
        for engine in spec.engines:
            got, released, null = _attack_engine(name, model, shards, (engine, dtype, x1, rounds))
            cases += got
            for (round_name, attack), mean in released.items():
                means.setdefault((name, dtype, round_name, attack), {})[engine] = mean
            ghost = null if engine == "ghost" else ghost
            if progress:
                worst = max((c.get("sensitivity") or 0.0 for c in got), default=0.0)
                progress(f"[engines] {name} ({kind.exercises}): {engine} {dtype}: {len(got)} "
                         f"cases, largest realised sensitivity {worst:.12g} x 2C")
    return _coverage(kind, model, ghost)


def _largest(cases: list[dict], key: str, by: tuple[str, ...]) -> dict:
    """The largest ``key`` over the cases, nested by the case fields ``by``."""
    out: dict = {}
    for case in cases:
        value = case.get(key)
        if value is None:
            continue
        node = out
        for field in by[:-1]:
            node = node.setdefault(case[field], {})
        node[case[by[-1]]] = max(value, node.get(case[by[-1]], -math.inf))
    return out


def _result(spec: EngineAuditSpec, cases: list[dict], agreement: dict, coverage: dict,
            skipped: list[dict], wall_time: float) -> dict:
    """The result's keys in their order."""
    findings = [f for case in cases for f in _findings(case)]
    for case in cases:
        case["engine, dtype"] = f"{case['engine']} {case['dtype']}"
    clipped = [c["sensitivity"] for c in cases if c.get("clipped") and c["sensitivity"] is not None
               and c["engine"] in WORKER_ENGINES]
    overflowed: dict[tuple, set] = {}
    ran: dict[tuple, set] = {}
    for c in cases:
        key = (c["model"], c["dtype"], c["round"], c["attack"])
        ran.setdefault(key, set()).add(c["engine"])
        if any(c.get("overflow", ())):
            overflowed.setdefault(key, set()).add(c["engine"])
    return {
        "regime": "engines",
        "violation": bool(findings),
        "findings": findings[:100],
        "findings_total": len(findings),
        "claim": {"sensitivity": "n·‖ClippedMean(D) − ClippedMean(D′)‖ <= 2C (1 + NORM_RTOL)",
                  "contribution": "n·‖ClippedMean(D) − ClippedMean(D⁰)‖ <= C (1 + NORM_RTOL)",
                  "mean": "‖ClippedMean‖ <= C", "norm_rtol": NORM_RTOL,
                  "ratios": "realised / claimed (1: at the bound)",
                  "batch": _BATCH_CLAIM},
        "sensitivity": _largest(cases, "sensitivity", ("engine", "dtype")),
        "contribution": _largest(cases, "contribution", ("engine", "dtype")),
        "table": _largest(cases, "sensitivity", ("model", "round", "engine, dtype")),
        "tight": {"clipped_cases": len(clipped), "sensitivity_min": min(clipped, default=None),
                  "sensitivity_max": max(clipped, default=None)},
        "tight_batch": _tight_batch(cases),
        "agreement": agreement,
        "overflow": {"cases": sum(len(v) for v in overflowed.values()),
                     "engines_differ": [", ".join(k) for k, v in overflowed.items()
                                        if v != ran[k]]},
        "refusals": [{**_name(c), "error": c["refused"]} for c in cases if "refused" in c],
        "not_applicable": skipped,
        "coverage": coverage,
        "cases": len(cases),
        "spec": dataclasses.asdict(spec),
        "wall_time_s": wall_time,
    }


def engine_summary_line(result: dict) -> str:
    """The engine audit's verdict in one line for a person."""
    worst = ", ".join(f"{engine} {dtype} {value:.12g}"
                      for engine, by_dtype in result["sensitivity"].items()
                      for dtype, value in by_dtype.items())
    first = result["findings"][0] if result["findings"] else None
    verdict = (f"VIOLATION: {result['findings_total']} finding(s), the first {first}" if first
               else "no violation")
    skipped = "".join(f"; {s['engine']} {s['dtype']} not applicable"
                      for s in result.get("not_applicable", ()))
    return (f"diff2 audit --engines ({result['cases']} cases, {len(result['coverage'])} models): "
            f"{verdict}; largest realised sensitivity / 2C: {worst}; "
            f"{len(result['refusals'])} refusal(s){skipped}")


# ------------------------------------------------------------------------- the batched engine

#: The batched engine's names (:data:`~.spec.BATCH_ENGINES`) -> its accumulation.
BATCH_ACCUMULATE = {"batch": "float64", "batch_f32sums": "float32"}
#: The batched engine's rounds: a restart of every run at x₁, then one round in which a run per
#: difference round of :data:`ROUNDS` takes its difference at its x₂ and one more run restarts at x₁
#: beside them (the kernel's restarting rows).
BESIDE = "restart, beside differences"
BATCH_ROUNDS = (*ROUNDS, BESIDE)
#: The batched engine's claim, per client sum Σ (the module's docstring).
_BATCH_CLAIM = {
    "sensitivity": "‖Σ(D) − Σ(D′)‖ <= 2C: batch within (1 + NORM_RTOL), batch_f32sums exactly "
                   "(decided in rational arithmetic)",
    "contribution": "‖Σ(D) − Σ(D⁰)‖ <= C, the same bounds",
    "overflow": "a client with a non-finite record is flagged (it releases nothing); no "
                "non-finite sum is released",
}
#: Not applicable, and why: float32 accumulation in a float64 compute dtype.
_F32_ONLY = ("accumulate='float32' is for the float32 compute dtype only (the engine refuses it "
             "for float64)")
#: ... and without the fused kernel, which alone accumulates in float32.
_NO_KERNEL = ("the fused kernel is unavailable here (no C++ compiler): the torch backend takes its "
              "place and sums in float64")


class _Sides(NamedTuple):
    """One round of one case: the client sums Σ [3, d] of D, D′ and D⁰, their overflow flags [3]
    and the radius."""

    sums: np.ndarray
    overflow: np.ndarray
    radius: float


def _not_applicable(batch: tuple[str, ...], dtypes: tuple[str, ...]) -> list[dict]:
    """The batched engine's (engine, dtype) that do not run, and why: float32 accumulation in
    float64, or anywhere without the fused kernel (the torch backend sums in float64)."""
    if "batch_f32sums" not in batch:
        return []
    no_kernel = fused.load() is None
    reasons = {dtype: _F32_ONLY if dtype != "float32" else _NO_KERNEL if no_kernel else None
               for dtype in dtypes}
    return [{"engine": "batch_f32sums", "dtype": dtype, "reason": reason}
            for dtype, reason in reasons.items() if reason]


def _batch_shards(kind: BatchModelKind, mlp: MLP, attack: str,
                  benign: tuple[np.ndarray, np.ndarray], x1: np.ndarray, radius: float
                  ) -> tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray]]]:
    """One attack's iterate x₁ and its shards D, D′, D⁰ and the filler: D the benign records then
    the attacked record z (last), D′ the same with z reflected through f(x₁) (its residual
    negated), D⁰ the benign records alone (z's place padding), the filler D with z benign (the
    window attack's: D)."""
    if ATTACKS[attack].window:
        x1, features, targets = float32_window(kind, radius)
        filler = (features, targets)
    else:
        filler = benign
        x, y = ATTACKS[attack].record(benign[0][-1], np.array([benign[1][-1], 1.0]))
        features, targets = np.array(benign[0]), np.array(benign[1])
        features[-1], targets[-1] = x, y[0]
    reflected = np.array(targets)
    reflected[-1] = 2 * mlp_outputs(mlp, x1, features[-1:])[0] - targets[-1]
    return x1, [(features, targets), (features, reflected), (features[:-1], targets[:-1]), filler]


def _prepared(clients: list[tuple[np.ndarray, np.ndarray]]) -> PreparedData:
    """The clients as one dataset's shards (the batch pads the shorter ones)."""
    ends = np.cumsum([len(y) for _, y in clients])
    bounds = tuple((int(end) - len(y), int(end)) for end, (_, y) in zip(ends, clients))
    features = np.concatenate([x for x, _ in clients])
    targets = np.concatenate([y for _, y in clients])
    return PreparedData("engine audit", features, targets, clients[-1][0][:1], clients[-1][1][:1],
                        bounds, 1.0)


def _batch_rounds(mlp: MLP, clients: list[tuple[np.ndarray, np.ndarray]], run: tuple[str, str],
                  x1: np.ndarray, rounds: dict) -> tuple[list, list, str]:
    """One shard's every round through the backend's own round API, as client 0 of a batch whose
    client 1 is the filler (``clients``): a restart of every run at x₁, then one round of the
    difference runs and one restarting run. Client 0's sums [runs of both rounds, d], overflow
    flags, and the backend's path."""
    engine, dtype = run
    diffs = [name for name, (x2, _) in rounds.items() if x2 is not None]
    c1, runs = rounds["restart"][1], len(diffs) + 1
    batch = Batch(_prepared(clients), getattr(torch, dtype))
    backend = choose_backend(mlp, batch, runs, accumulate=BATCH_ACCUMULATE[engine])
    first = backend.round(torch.from_numpy(np.tile(x1, (runs, 1))),
                          torch.ones(runs, dtype=torch.bool),
                          torch.full((runs,), c1, dtype=torch.float64), train=False)
    radius = torch.tensor([rounds[name][1] for name in diffs] + [c1], dtype=torch.float64)
    second = backend.round(torch.from_numpy(np.stack([rounds[n][0] for n in diffs] + [x1])),
                           torch.arange(runs) == runs - 1, radius, train=False)
    sums = [first.sums[0, 0].numpy(), *second.sums[0].numpy()]
    overflow = [bool(first.overflow[0, 0]), *second.overflow[0].tolist()]
    return sums, overflow, _backend_path(backend, mlp)


def _batch_sums(mlp: MLP, shards: list[tuple[np.ndarray, np.ndarray]], run: tuple[str, str],
                x1: np.ndarray, rounds: dict) -> tuple[dict[str, _Sides], str] | str:
    """Every round of one case: D, D′ and D⁰ each in its own batch at the same position (client
    0, beside the same filler: torch's batched forward rounds a sample by its position, and a
    difference round amplifies that to ~1e-7 of C, so the three shards must differ in z alone);
    and the backend's path; or the error it refused with (nothing released)."""
    try:
        got = [_batch_rounds(mlp, [shard, shards[3]], run, x1, rounds) for shard in shards[:3]]
    except (ValueError, RuntimeError) as err:
        return _refusal(err)
    names = ["restart", *(n for n, (x2, _) in rounds.items() if x2 is not None), BESIDE]
    radii = [rounds["restart"][1], *(rounds[n][1] for n in names[1:-1]), rounds["restart"][1]]
    out = {name: _Sides(np.stack([g[0][k] for g in got]), np.array([g[1][k] for g in got]),
                        radii[k]) for k, name in enumerate(names)}
    return out, got[0][2]


def _backend_path(backend: RoundBackend, mlp: MLP) -> str:
    """Which backend and which of its paths ran."""
    if not isinstance(backend, FusedBackend):
        return f"{type(backend).__name__} (the closed forms in torch, float64 sums)"
    products = mlp.sizes[0] > KERNEL_W1_FEATURES
    w1 = ("the kernel's float32 block products" if backend.accumulate == "float32" else
          "a float64 product") if products else "the kernel's lanes"
    return (f"FusedBackend (forward: {'kernel' if backend.head is None else 'torch'}; "
            f"{backend.accumulate} accumulation; W_1's sums: {w1})")


def _measured(a: np.ndarray, b: np.ndarray, scale: float, factor: Fraction) -> tuple[float, bool]:
    """‖a − b‖ / scale (float64, robust), and whether ‖a − b‖ > factor·scale, decided exactly: the
    float64 estimate is within (d + 16)·2^-52 of the truth relative (a − b and the scaled norm
    round (d/2 + 4)·u at most), so outside that band it decides; inside, the exact sum of squares of
    the differences (Fractions of the float64 entries) does."""
    with np.errstate(all="ignore"):
        diff = a - b
    estimate = robust_norm(diff) if bool(np.all(np.isfinite(diff))) else math.inf
    ratio, bound, band = _ratio(estimate, scale), float(factor), (a.size + 16) * 2.0**-52
    if ratio <= bound * (1 - band):
        return ratio, False
    if math.isfinite(estimate) and ratio >= bound * (1 + band):
        return ratio, True
    moved = sum(((Fraction(p) - Fraction(q)) ** 2 for p, q in zip(a.tolist(), b.tolist())),
                Fraction(0))
    return ratio, moved > (factor * Fraction(scale)) ** 2


def _batch_measure(sides: _Sides, factor: Fraction, record: tuple[bool, bool]) -> dict:
    """One case's ratios to the claim (the sensitivity to 2C, the contributions of z and z′ to C)
    and whether each exceeds it (exactly); which side overflowed; whether a non-finite record went
    unreported or a released sum is not finite. ``record``: whether z was clipped (its float64
    norm above the radius), whether it is not finite."""
    sums, over, radius = sides
    clipped, nonfinite = record
    row = {"overflow": [bool(over[0]), bool(over[1])], "clipped": clipped and not over[0],
           "sensitivity": None, "contribution": None, "mean": None, "released": "sum",
           "finite": all(bool(np.all(np.isfinite(sums[i]))) for i in range(3) if not over[i]),
           "unreported": nonfinite and not bool(over[0]), "bound": float(factor), "exceeds": {}}
    if not row["finite"]:
        return row
    if not over[0] and not over[1]:
        row["sensitivity"], row["exceeds"]["sensitivity"] = _measured(sums[0], sums[1],
                                                                      2 * radius, factor)
    kept = [i for i in (0, 1) if not over[i]]  # D and D′ as released
    if not over[2] and kept:
        got = [_measured(sums[i], sums[2], radius, factor) for i in kept]
        row["contribution"] = max(r for r, _ in got)
        row["exceeds"]["contribution"] = any(e for _, e in got)
    return row


def _z_norms(mlp: MLP, z: tuple[np.ndarray, np.ndarray], x1: np.ndarray, rounds: dict
             ) -> dict[str, float]:
    """The attacked record's (difference) gradient norm per round, in float64 from the float64
    iterates: what an exact engine would clip (NaN or inf: not finite)."""
    at_1 = mlp_rows(mlp, x1, *z)[0]
    out = {"restart": robust_norm(at_1), BESIDE: robust_norm(at_1)}
    with np.errstate(all="ignore"):
        for name, (x2, _) in rounds.items():
            if x2 is not None:
                row = mlp_rows(mlp, x2, *z)[0] - at_1
                out[name] = robust_norm(row) if bool(np.all(np.isfinite(row))) else math.nan
    return out


def _attack_batch(name: str, mlp: MLP, run: tuple, attack: str) -> tuple[list[dict], str | None]:
    """Every round of one attack on one model, accumulation and dtype: the cases, and the backend's
    path (None if refused)."""
    spec, engine, dtype, x1, benign, rng_key = run
    kind, scale = BATCH_MODELS[name], ATTACKS[attack].radius_scale
    base = {"model": name, "engine": engine, "dtype": dtype, "attack": attack}
    try:
        x1, clients = _batch_shards(kind, mlp, attack, benign, x1, spec.clip_restart * scale)
    except ValueError as err:
        return [{**base, "round": r, "refused": _refusal(err)} for r in BATCH_ROUNDS], None
    rounds = {r: (x2, radius * scale) for r, (x2, radius) in
              _rounds(x1, dtype, spec, np.random.default_rng(rng_key)).items()}
    got = _batch_sums(mlp, clients, (engine, dtype), x1, rounds)
    if isinstance(got, str):
        return [{**base, "round": r, "refused": got} for r in BATCH_ROUNDS], None
    sides, path = got
    z = (clients[0][0][-1:], clients[0][1][-1:])
    norms = _z_norms(mlp, z, x1, rounds)
    nonfinite = not (bool(np.all(np.isfinite(z[0]))) and bool(np.all(np.isfinite(z[1]))))
    factor = Fraction(1) if engine == "batch_f32sums" else 1 + Fraction(NORM_RTOL)
    cases = []
    for round_name in BATCH_ROUNDS:
        side, norm = sides[round_name], norms[round_name]
        case = {**base, "round": round_name, "radius": side.radius}
        clipped = math.isfinite(norm) and norm > 1.01 * side.radius
        case.update(_batch_measure(side, factor, (clipped, nonfinite)))
        cases.append(case)
    return cases, path


def _attack_batch_model(spec: EngineAuditSpec, which: tuple[int, str, tuple[str, ...]],
                        runs: list[tuple[str, str]], cases: list[dict], progress: Progress
                        ) -> dict:
    """Every case of one batched engine's model, added to ``cases``; its coverage (the backend's
    path per accumulation and dtype)."""
    index, name, attacks = which
    kind = BATCH_MODELS[name]
    mlp = kind.mlp()
    n = 64 * -(-spec.samples // 64) + 1  # z at index n − 1, a product block's and a lane's start
    benign = kind.records(np.random.default_rng([spec.seed, index, 2]), n)
    x1 = kind.iterate(spec.seed)
    paths = {}
    for engine, dtype in runs:
        got = []
        for attack in (a for a in attacks if ATTACKS[a].batch_applies()):
            more, path = _attack_batch(name, mlp, (spec, engine, dtype, x1, benign,
                                                   [spec.seed, index, 3]), attack)
            got += more
            paths[f"{engine} {dtype}"] = path or paths.get(f"{engine} {dtype}")
        cases += got
        if progress:
            worst = max((c.get("sensitivity") or 0.0 for c in got), default=0.0)
            progress(f"[engines] {name} ({kind.exercises}): {engine} {dtype}: {len(got)} cases, "
                     f"largest realised sensitivity {worst:.12g} x 2C")
    return {"exercises": kind.exercises, "backend": paths}


def _tight_batch(cases: list[dict]) -> dict:
    """Per batched engine and dtype, over the restarts (where z′'s gradient is −z's, to the rounding
    of f) whose attacked record was clipped: how many, and their smallest and largest sensitivity
    (batch_f32sums clips at C / (1 + ρ): 2.4e-4 below the bound, 3.5e-4 with block products)."""
    out: dict = {}
    for c in cases:
        if (c["engine"] in BATCH_ACCUMULATE and c["round"] in ("restart", BESIDE)
                and c.get("clipped") and c["sensitivity"] is not None):
            out.setdefault(c["engine, dtype"], []).append(c["sensitivity"])
    return {key: {"clipped_restarts": len(v), "sensitivity_min": min(v),
                  "sensitivity_max": max(v)} for key, v in out.items()}
