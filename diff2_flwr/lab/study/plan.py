"""A study's plan: which runs it needs (their ids), how they are grouped into units, and how a
grid grows.

A run is one (phase, method, grid point, ε, seed); its id is a hash of what identifies it, so a run
file found under that id is the same run and is reused (ids of studies run before a setting existed
stay as they were: :func:`method_key`). Runs are computed in :class:`Unit` s (a batch of the batched
engine, or one run of another engine); :func:`plan_units` makes them, deterministically. The
corrected protocol's grid extension (:class:`GridSearch`) plans the points a pick on an edge adds.

References:
    Murata & Suzuki (2023), Section 6; :mod:`.analysis` (the protocol, the extension's bounds).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import math
import typing
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping, Sequence

from ...core.routines import ROUTINES
from ...runtime.config import ConfigError, ExperimentConfig, ModelConfig, config_keys
from ...runtime.shard_report import check_shards
from .cluster import unit_data
from .stats import MAX_EXTENSIONS
from .spec import CRITERIA, MethodSpec, Study, slug

__all__ = ["GridSearch", "Job", "Unit", "batchable", "check_point", "eval_jobs", "method_key",
           "plan_units", "planned_runs", "run_id", "tune_jobs"]

#: The criteria that pick a grid point (the test loss is read at the train-loss pick).
SELECTING = ("train_loss", "grad_norm_sq")
#: The width a run id names for a study of a factory model (which has none): the paper MLP's, as
#: it always has.
_PAPER_WIDTH = ModelConfig().hidden_units


def method_key(method: MethodSpec) -> dict:
    """What identifies a method's runs: its name, base method, grid, and the settings it fixes,
    grouped as the method entries first named them (``u``, ``routine``, ``schedule``, ``local``,
    ``rounds``, ``privacy``; the others, under ``settings``). A group at its default is left out, so
    the ids of methods that do not set it are as before it existed (a plain-GD method's as before
    routines, a constant-schedule method's as before schedules) and their run files are reused."""
    key: dict[str, Any] = {"name": method.name, "method": method.method,
                           "grid": [[k, list(v)] for k, v in method.grid], "u": method.u}
    if method.routine != "gd" or method.routine_params:
        key.update(routine=method.routine, routine_params=[list(p) for p in method.routine_params])
    if method.schedule != "constant" or method.schedule_params:  # nor are constant-schedule ones
        key.update(schedule=method.schedule,
                   schedule_params=[list(p) for p in method.schedule_params])
    if method.local:  # run ids of methods without a local routine are as before it existed
        key["local"] = [list(p) for p in method.local]
    if method.rounds is not None:  # nor are those of methods that run the study's R
        key["rounds"] = method.rounds
    if method.seed_offset:
        key["seed_offset"] = method.seed_offset
    if method.privacy:  # nor are those of methods with central noise
        key["privacy"] = [list(p) for p in method.privacy]
    grouped = ("privacy.", "training.routine.", "training.schedule.", "local.", "training.rounds")
    others = [[k, v] for k, v in method.settings if not k.startswith(grouped)]
    if others:  # nor are those of methods that fix no other setting
        key["settings"] = others
    return key


def run_id(phase: str, method: MethodSpec, point: Mapping[str, float], epsilon: float, seed: int,
           study: Study) -> str:
    """The id of one run: ``{phase}-{method slug}-{12 hex digits of the hash of what identifies
    it}``."""
    key = json.dumps({"phase": phase, "method": method_key(method), "point": dict(point),
                      "epsilon": epsilon, "seed": seed, "rounds": study.rounds,
                      "delta": study.delta, "mode": study.mode, "dataset": dict(study.dataset),
                      "clients": study.clients, "eval_every": study.eval_every,
                      "hidden": _PAPER_WIDTH if study.hidden is None else study.hidden},
                     sort_keys=True)
    return f"{phase}-{slug(method.name)}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


@dataclass
class Job:
    """One run to compute: its id, what it is, and its validated config."""

    run_id: str
    method: MethodSpec
    point: dict
    epsilon: float
    seed: int
    cfg: ExperimentConfig


def _job(phase: str, study: Study, m: MethodSpec, point: dict, epsilon: float, seed: int) -> Job:
    return Job(run_id(phase, m, point, epsilon, seed, study), m, point, epsilon, seed,
               study.experiment(m, point, epsilon, seed))


def tune_jobs(study: Study, tuned: Mapping[str, Sequence[dict]], epsilon: float) -> list[Job]:
    """The tuning phase at ``epsilon``: every tuned point of every method on every tuning seed."""
    return [_job("tune", study, m, p, epsilon, s) for m in study.methods for p in tuned[m.name]
            for s in study.tune_seeds]


def eval_jobs(study: Study, chosen: Mapping[str, Mapping[str, dict]], epsilon: float) -> list[Job]:
    """The evaluation phase at ``epsilon``: each method's pick per criterion on every evaluation
    seed, each run once (two criteria that picked one point share its runs)."""
    jobs: dict[str, Job] = {}
    for m in study.methods:
        for c in CRITERIA:
            for s in study.eval_seeds:
                if run_id("eval", m, chosen[m.name][c], epsilon, s, study) not in jobs:
                    job = _job("eval", study, m, chosen[m.name][c], epsilon, s)
                    jobs[job.run_id] = job
    return list(jobs.values())


def planned_runs(study: Study) -> tuple[int, int]:
    """(tuning runs, evaluation runs) of the declared grids: every point on the tuning seeds, and
    per method and selecting criterion its pick on the evaluation seeds (a grid extension adds to
    the first)."""
    tune = sum(len(m.points()) for m in study.methods) * len(study.tune_seeds) * len(study.epsilons)
    return tune, len(SELECTING) * len(study.methods) * len(study.eval_seeds) * len(study.epsilons)


def check_point(study: Study, m: MethodSpec, point: Mapping[str, float], epsilon: float,
                data: Any) -> None:
    """Refuse a grid point whose partition or calibration the refusal rule refuses (min_samples,
    max_sigma)."""
    cfg = study.experiment(m, point, epsilon, study.tune_seeds[0])
    check_shards(cfg, data.shard_sizes, cfg.calibration(cfg.privacy.n_min or data.n_min))


# ------------------------------------------------------------------------------- units

@dataclass(frozen=True)
class Unit:
    """Runs computed together, in one process: one batch of the batched engine, or one run of
    another engine."""

    engine: str
    jobs: tuple[Job, ...]


def plan_units(study: Study, jobs: Sequence[Job]) -> list[Unit]:
    """Split ``jobs`` into units, deterministically (the same jobs always give the same units).

    The batched engine takes batches of at most ``study.batch_size`` runs: a batch whose runs all
    restart every round (T = 1) skips the previous iterate's pass, so T = 1 runs never share a
    batch with T > 1 runs, nor client-sampled runs with runs that do not sample (:func:`_group`);
    within a group, batches are balanced (no batch much smaller than the others), sorted by T (and
    sampled runs by sampling rule and seed, so that runs sharing cohorts share batches:
    :func:`_batch_order`), and as many as a multiple of ``study.workers`` where there are runs
    enough, so that every worker process has its share. Runs the batched engine cannot run (a
    model that is not an MLP, a routine that computes on private data, the local routine,
    distributed noise) are units of one ``inprocess`` run. Units are ordered by their cost, largest
    first, so that no worker is left with a big one at the end.
    """
    engine = study.engine
    if engine != "batch":
        return [Unit(engine, (j,)) for j in jobs]
    mlp = bool(jobs) and batchable(study, jobs[0].cfg)  # one model and dataset per study
    fits = [j for j in jobs if mlp and ROUTINES[j.cfg.training.routine.name].post_processing
            and not j.cfg.local.enabled and not j.cfg.privacy.distributed
            and not batch_ignores(j.cfg)]
    units = [Unit("inprocess", (j,)) for j in jobs if j not in fits]
    groups = {_group(j): None for j in fits}  # R shared
    for key in groups:
        group = [j for j in fits if _group(j) == key]
        group.sort(key=_batch_order)
        if group:
            count = -(-len(group) // study.batch_size)
            count = min(len(group), -(-count // study.workers) * study.workers)
            size = -(-len(group) // count)
            units += [Unit(engine, tuple(group[i:i + size])) for i in range(0, len(group), size)]
    return sorted(units, key=unit_cost, reverse=True)  # stable: equal costs keep their order


def _group(job: Job) -> tuple[int, bool, bool]:
    """The batches a run may share: same R; T = 1 or not; client-sampled or not (a batch with one
    run that does not sample computes every client each round, so a sampled run there gains
    nothing from its cohorts: :func:`~diff2_flwr.lab.sweep.run_batch`)."""
    cfg = job.cfg
    return cfg.training.rounds, cfg.restart_every == 1, cfg.training.sampling.enabled


def _batch_order(job: Job) -> tuple:
    """Runs side by side within a group: by T, then (sampled runs) by their sampling and seed, so
    that runs sharing their cohorts (one sampling rule, one seed: one cohort key) share batches and
    a round computes the union of few cohorts. Ties keep the jobs' order."""
    cfg = job.cfg
    s = cfg.training.sampling
    if not s.enabled:
        return (cfg.restart_every,)
    return cfg.restart_every, s.kind, s.rate or 0.0, s.size or 0, cfg.training.seed


def unit_cost(unit: Unit) -> float:
    """Relative cost of a unit, in batched-engine restart rounds of one run: a difference round does
    a little more than a restart round; one run on the per-run path costs about as much as a batch
    of twenty; a batch whose runs all sample computes a round's union of cohorts only
    (:func:`_computed_fraction`)."""
    if unit.engine != "batch":
        return 20.0 * sum(j.cfg.training.rounds for j in unit.jobs)
    return _computed_fraction(unit.jobs) * sum(
        (1.0 if j.cfg.restart_every == 1 else 1.5) * j.cfg.training.rounds for j in unit.jobs)


def _computed_fraction(jobs: Sequence[Job]) -> float:
    """The expected share of the clients a batch's round computes: 1 where a run does not sample;
    else, outside the evaluated rounds (every client), the union of the cohorts of its distinct
    cohort keys (sampling rule, seed), each client in a cohort with probability π (q, or m/P)."""
    if not all(j.cfg.training.sampling.enabled for j in jobs):
        return 1.0
    keys = {(j.cfg.training.sampling.kind, j.cfg.training.sampling.rate,
             j.cfg.training.sampling.size, j.cfg.training.seed, j.cfg.training.clients)
            for j in jobs}
    outside = math.prod(1.0 - (rate if kind == "poisson" else min(1.0, size / clients))
                        for kind, rate, size, _, clients in keys)
    evaluated = 1.0 / max(1, min(j.cfg.evaluation.every for j in jobs))
    return evaluated + (1.0 - evaluated) * (1.0 - outside)


#: The settings the batched engine honours (a key ending in "." stands for its section): it builds
#: each run's server spec (mechanism, routine), seeds, model and data from them. Any other declared
#: setting that a run sets away from its default sends the run to the per-run path, which honours
#: every setting (:func:`batch_ignores`): a setting added later is never silently ignored by the
#: batch. (``privacy.n_min`` is not among them: the batch calibrates for its data's smallest shard;
#: ``privacy.max_sigma`` is, as the study checks every grid point against it before any run.
#: Distributed noise and the local routine are sent to the per-run path by name in
#: :func:`plan_units`.)
BATCH_HONOURS = ("name", "method", "dataset.", "model.", "output.", "privacy.epsilon",
                 "privacy.delta", "privacy.mode", "privacy.u", "privacy.noise", "privacy.bits",
                 "privacy.tolerated", "privacy.wrap", "privacy.max_sigma", "training.rounds",
                 "training.restart_every",
                 "training.clip_restart", "training.clip_diff", "training.learning_rate",
                 "training.clients", "training.seed", "training.routine", "training.routine.",
                 "training.schedule", "training.schedule.", "training.sampling",
                 "training.sampling.",
                 "training.dtype", "training.chunk_size", "training.gradients", "training.threads",
                 "training.round_retries", "training.round_timeout_s", "evaluation.every",
                 "evaluation.train_metrics", "evaluation.test_metrics", "local.")


def batch_ignores(cfg: ExperimentConfig) -> list[str]:
    """The declared settings ``cfg`` sets away from their defaults that the batched engine does not
    honour."""
    default = _flat(_defaults(type(cfg)))
    given = _flat(asdict(cfg))
    return [key for key in config_keys() if given.get(key) != default.get(key)
            and not any(key == h or (h.endswith(".") and key.startswith(h)) for h in BATCH_HONOURS)]


def _defaults(cls: type) -> dict[str, Any]:
    """Each declared setting's default, section by section (the experiment itself has required
    keys)."""
    hints, out = typing.get_type_hints(cls), {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out[f.name] = _defaults(hints[f.name])
        elif f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def _flat(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, Mapping) and not hasattr(value, "as_dict"):  # a section, not Kwargs
            out.update(_flat(value, f"{prefix}{key}."))
        out[f"{prefix}{key}"] = value
    return out


def batchable(study: Study, cfg: ExperimentConfig) -> bool:
    """Whether the batched engine has closed forms for this study's model and loss (an MLP; see
    :func:`~diff2_flwr.task.models.mlp_shape`)."""
    from ..sweep import batch_model  # noqa: PLC0415 -- the batched engine loads where a batch is planned

    try:
        batch_model(unit_data(cfg), model=study.model, hidden=study.hidden,
                    model_kwargs=study.model_kwargs, loss=cfg.loss)
    except ValueError:
        return False
    return True


# ---------------------------------------------------------------------- the grid's extension

def line(points: Sequence[Mapping[str, float]], pick: Mapping[str, float], key: str) -> list[float]:
    """The sorted values of ``key`` among the points that agree with ``pick`` on every other key
    (and have ``key``: a schedule parameter is only in the points whose schedule has it)."""
    return sorted({float(p[key]) for p in points
                   if key in p and len(p) == len(pick)
                   and all(p.get(k, _ABSENT) == v for k, v in pick.items() if k != key)})


#: A key a point does not have (never equal to a value).
_ABSENT = object()
#: Grid keys whose values are integers: a step past an edge is rounded (T, and a schedule's k).
_INTEGER_KEYS = ("restart_every", "every")


def _numeric(value: Any) -> bool:
    """Whether a point's value lies on a line (a number; a schedule's name does not)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def step_out(axis: Sequence[float], side: str, key: str) -> float:
    """One geometric step past an edge of a grid axis: the ratio of its two outermost values on that
    side."""
    if side == "high":
        new = axis[-1] * axis[-1] / axis[-2]
    else:
        new = axis[0] * axis[0] / axis[1]
    if key in _INTEGER_KEYS:
        new = float(round(new))
        if new in axis:
            new = axis[-1] + 1 if side == "high" else axis[0] - 1
    return float(new)


def _edge(points: Sequence[Mapping[str, float]], pick: Mapping[str, float],
          key: str) -> tuple[list[float], str | None]:
    """The pick's line along ``key`` and the edge it lies on (``high``, ``low``, or None: interior
    or a single value)."""
    if not _numeric(pick[key]):
        return [], None
    axis = line(points, pick, key)
    if len(axis) < 2 or pick[key] not in (axis[0], axis[-1]):
        return axis, None
    return axis, "high" if pick[key] == axis[-1] else "low"


@dataclass
class GridSearch:
    """One ε's tuned points per method, grown by the line search of the corrected protocol.

    When a pick's value of a key is the smallest or largest among the tuned points that agree with
    the pick on every other key (its *line*), the point one geometric step further along that key is
    tuned too (within the analysis's ``extend`` bounds, at most ``MAX_EXTENSIONS`` steps per key and
    side). One new point per step: extending the whole product would multiply the cost by every axis
    that moves at once.
    """

    tuned: dict[str, list[dict]]
    made: dict[str, list[dict]]
    count: collections.Counter = field(default_factory=collections.Counter)
    refused: dict[tuple[str, str, str], str] = field(default_factory=dict)

    @classmethod
    def start(cls, study: Study) -> GridSearch:
        """The declared grids, nothing extended."""
        return cls({m.name: m.points() for m in study.methods}, {m.name: [] for m in study.methods})

    def extend(self, study: Study, chosen: Mapping[str, Mapping[str, dict]],
               admit: Callable[[MethodSpec, dict], None]) -> list[dict]:
        """Add the next point of every pick on an edge (``admit`` refuses a point by raising);
        return the new ones."""
        new = []
        for m in study.methods:
            for c in SELECTING:
                for key in chosen[m.name][c]:
                    step = self._step(study, m, c, chosen[m.name][c], key, admit)
                    if step is not None:
                        new.append(step)
        return new

    def _step(self, study: Study, m: MethodSpec, criterion: str, pick: dict, key: str,
              admit: Callable[[MethodSpec, dict], None]) -> dict | None:
        axis, side = _edge(self.tuned[m.name], pick, key)
        bounds = study.analysis.bounds(key)
        if side is None or bounds is None:
            return None
        if self.count[m.name, key, side] >= MAX_EXTENSIONS or (m.name, key, side) in self.refused:
            return None
        if side == "high" and axis[-2] == 0:  # e.g. a cosine floor of [0, 0.1]: no ratio to step by
            self.refused[m.name, key, side] = "no geometric step from 0 (the line's other value)"
            return None
        new = step_out(axis, side, key)
        if not bounds[0] <= new <= bounds[1]:
            bound = bounds[0 if side == "low" else 1]
            self.refused[m.name, key, side] = f"the bound {bound:g} of analysis.extend"
            return None
        point = dict(pick) | {key: new}
        if point in self.tuned[m.name]:
            return None
        try:  # the new point must pass the partition's refusal rule like the declared ones
            admit(m, point)
        except (ConfigError, ValueError) as err:
            self.refused[m.name, key, side] = f"{new:g} is refused: {str(err).splitlines()[0]}"
            return None
        self.tuned[m.name].append(point)
        self.count[m.name, key, side] += 1
        step = {"key": key, "value": new, "side": side, "because": criterion, "point": point}
        self.made[m.name].append(step)
        return {**step, "method": m.name, "from": pick[key]}

    def searched(self, study: Study, chosen: Mapping[str, Mapping[str, dict]]) -> dict[str, dict]:
        """Per method: the values searched per key, the points tuned, the extensions made and the
        picks that stay on an edge (with the reason)."""
        out = {}
        for m in study.methods:
            edges = {}
            for c in SELECTING:
                hits = [self._why(study, m, chosen[m.name][c], key) for key in chosen[m.name][c]]
                if any(hits):
                    edges[c] = [h for h in hits if h]
            values = {k: _searched(self.tuned[m.name], k) for k, _ in m.grid}
            out[m.name] = {"grid": values, "points": len(self.tuned[m.name]),
                           "extensions": self.made[m.name], "edges": edges}
        return out

    def _why(self, study: Study, m: MethodSpec, pick: dict, key: str) -> dict | None:
        """A pick that stays on an edge of ``key``, and why it was not extended further (None:
        interior)."""
        _, side = _edge(self.tuned[m.name], pick, key)
        if side is None:
            return None
        paper = "" if study.analysis.corrected else " (the paper's protocol extends nothing)"
        why = (self.refused.get((m.name, key, side))
               or (f"at most {MAX_EXTENSIONS} extensions per key and side"
                   if self.count[m.name, key, side] >= MAX_EXTENSIONS else
                   "not extended: no bound in analysis.extend" + paper))
        return {"key": key, "value": pick[key], "side": side, "why": why}


def _searched(points: Sequence[Mapping[str, Any]], key: str) -> list[Any]:
    """The values of ``key`` among ``points`` that have it: numbers sorted, names in order."""
    values = [p[key] for p in points if key in p]
    if all(_numeric(v) for v in values):
        return sorted({float(v) for v in values})
    return list(dict.fromkeys(values))
