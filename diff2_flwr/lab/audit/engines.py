"""``diff2 audit --engines``: attack the per-sample gradient engines with real models and
adversarial records, and check each worker's ClippedMean against its replace-one sensitivity.

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

What it protects, in the terms of the threat model (docs/explanation/privacy.md): the data owner's
records against the server and anyone who sees the released sums (the SuperLink operator, the
ServerApp, the public): the noise is calibrated to 2C/n, so an engine that under-clips one record
(a norm computed too small, a layer left out of it) leaks more than the accountant charges. What it
cannot do: it checks the engines' sensitivity on these models, records and iterates, not every
model (one outside :data:`~.engine_models.MODELS` may take a path none of them takes), and neither
the noise nor the accounting, which the statistical regimes audit.

References:
    Murata & Suzuki (2023), Algorithm 1 (worker lines), Algorithm 2 (ClippedMean).
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from dataclasses import dataclass
from typing import Callable

import numpy as np
from torch import nn

from ...core.clipping import NORM_RTOL, radius_norm, robust_norm
from ...core.ghost_layers import supported_modules
from ...core.gradients import Contribution
from ...core.layout import ParameterLayout
from ...runtime.compute import pinned_threads
from ...runtime.workers import Worker, make_worker
from .engine_models import MODELS, PADDING, ModelKind, weighted_half_squared_error
from .spec import EngineAuditSpec

__all__ = ["ATTACKS", "Attack", "DEFAULT_ATTACKS", "ROUNDS", "engine_audit",
           "engine_summary_line"]

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

    def applies(self, kind: ModelKind) -> bool:
        """Whether the attack fits the model's features."""
        return not (self.inputs and kind.tokens) and not (self.tokens and not kind.tokens)

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
    """What in one case exceeds the claim: a ratio above 1 + NORM_RTOL, a mean outside its ball, a
    non-finite mean released."""
    found = []
    for check in ("sensitivity", "contribution"):
        value = case.get(check)
        if value is not None and not value <= 1 + NORM_RTOL:
            found.append({**_name(case), "check": check, "ratio": value, "bound": 1 + NORM_RTOL})
    if case.get("mean") is not None and not case["mean"] <= 1.0:
        found.append({**_name(case), "check": "mean norm", "ratio": case["mean"], "bound": 1.0})
    if case.get("finite") is False:
        found.append({**_name(case), "check": "non-finite mean released", "ratio": None,
                      "bound": None})
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
    names, attacks = spec.models or tuple(MODELS), spec.attacks or DEFAULT_ATTACKS
    for key, given, known in (("models", names, MODELS), ("attacks", attacks, ATTACKS)):
        unknown = [m for m in given if m not in known]
        if unknown:
            raise ValueError(f"`{key}` must be names of {sorted(known)}. Found {unknown}.")
    cases: list[dict] = []
    means: dict = {}
    coverage = {}
    with pinned_threads(1), warnings.catch_warnings():  # one thread: the same sums everywhere
        # torch.func's note that vmap over CPU attention has no batching rule: speed, not results
        warnings.filterwarnings("ignore", message="There is a performance drop")
        for index, name in enumerate(names):
            coverage[name] = _attack_model(spec, (index, name, attacks), cases, means, progress)
    return _result(spec, cases, _agreement(means, spec.samples), coverage,
                   time.perf_counter() - started)


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
            wall_time: float) -> dict:
    """The result's keys in their order."""
    findings = [f for case in cases for f in _findings(case)]
    for case in cases:
        case["engine, dtype"] = f"{case['engine']} {case['dtype']}"
    clipped = [c["sensitivity"] for c in cases if c.get("clipped") and c["sensitivity"] is not None]
    overflowed: dict[tuple, set] = {}
    for c in cases:
        if any(c.get("overflow", ())):
            overflowed.setdefault((c["model"], c["dtype"], c["round"], c["attack"]),
                                  set()).add(c["engine"])
    return {
        "regime": "engines",
        "violation": bool(findings),
        "findings": findings[:100],
        "findings_total": len(findings),
        "claim": {"sensitivity": "n·‖ClippedMean(D) − ClippedMean(D′)‖ <= 2C (1 + NORM_RTOL)",
                  "contribution": "n·‖ClippedMean(D) − ClippedMean(D⁰)‖ <= C (1 + NORM_RTOL)",
                  "mean": "‖ClippedMean‖ <= C", "norm_rtol": NORM_RTOL,
                  "ratios": "realised / claimed (1: at the bound)"},
        "sensitivity": _largest(cases, "sensitivity", ("engine", "dtype")),
        "contribution": _largest(cases, "contribution", ("engine", "dtype")),
        "table": _largest(cases, "sensitivity", ("model", "round", "engine, dtype")),
        "tight": {"clipped_cases": len(clipped), "sensitivity_min": min(clipped, default=None),
                  "sensitivity_max": max(clipped, default=None)},
        "agreement": agreement,
        "overflow": {"cases": sum(len(v) for v in overflowed.values()),
                     "engines_differ": [", ".join(k) for k, v in overflowed.items()
                                        if len(v) < len(spec.engines)]},
        "refusals": [{**_name(c), "error": c["refused"]} for c in cases if "refused" in c],
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
    return (f"diff2 audit --engines ({result['cases']} cases, {len(result['coverage'])} models): "
            f"{verdict}; largest realised sensitivity / 2C: {worst}; "
            f"{len(result['refusals'])} refusal(s)")
