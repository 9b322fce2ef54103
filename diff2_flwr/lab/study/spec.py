"""A study's spec: its YAML file, validated by the experiment file's machinery into frozen values.

The file is read as a :class:`StudyFile` by :func:`~diff2_flwr.runtime.config.parse_section` (unknown keys,
types, and each key's check, with the one message shape "file: key `x`: expected …. Found …."); its
nested blocks (seeds, methods, tests, model, output, analysis) are checked with
:func:`~diff2_flwr.runtime.config.require` and become :class:`MethodSpec` and :class:`Study`. Every grid
point's run config is validated once, up front, so a bad value fails before hours of compute.

References:
    Murata & Suzuki (2023), Section 6; DIFF2.md, "The paper's experiments".
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

from ...core.routines import ROUTINES, routine_parameters
from ...runtime.config import ConfigError, ExperimentConfig, parse_config, parse_section, read_yaml, require
from .stats import Analysis, parse_analysis

__all__ = ["ACCURACY", "CRITERIA", "GRID_KEYS", "LOCAL_KEYS", "MethodSpec", "ROUTINE_GRID_KEYS", "Study",
           "StudyError", "StudyFile", "load_study", "parse_study", "slug", "test_pairs"]

CRITERIA = ("train_loss", "grad_norm_sq", "test_loss")
#: Reported, never selected on: larger is better, taken at the train-loss-best point (classification only).
ACCURACY = "test_accuracy"
GRID_KEYS = ("learning_rate", "clip_restart", "clip_diff", "restart_every", "local.steps", "local.clip", "local.share")
#: Grid keys that are a routine's parameters (``training.routine.<key>``); each routine takes some of them.
ROUTINE_GRID_KEYS = tuple(dict.fromkeys(k for name in ROUTINES for k in routine_parameters(name)))
#: A method's fixed settings of the local routine (``local:`` beside ``grid``; see ExperimentConfig.local).
LOCAL_KEYS = ("steps", "batch_size", "clip", "share")
METHOD_KEYS = ("name", "method", "grid", "u", "routine", "local", "rounds", "seed_offset", "privacy")
#: A method's own privacy keys (``privacy:`` beside ``grid``): who adds the noise, and the secure sum's settings.
PRIVACY_KEYS = ("noise", "bits", "tolerated", "wrap")
Engine = Literal["batch", "inprocess", "flower"]


class StudyError(ConfigError):
    """An invalid study file; the message names the file, the key, and what was found."""


@dataclass(frozen=True)
class MethodSpec:
    """One compared method: a base method, its routine and its hyper-parameter grid.

    ``routine`` names the routine and ``routine_params`` fixes some of its parameters; the grid may
    range over the others (``grid: {beta1: [0.8, 0.9]}``).
    """

    name: str
    method: Literal["gd", "dpgd", "diff2"]
    grid: tuple[tuple[str, tuple[float, ...]], ...]
    u: float = 1.25
    routine: str = "gd"
    routine_params: tuple[tuple[str, float], ...] = ()
    local: tuple[tuple[str, float], ...] = ()  # fixed keys of the local routine (empty: off unless gridded)
    rounds: int | None = None  # this method's R (None: the study's); ε is the same for every R
    #: added to every seed of this method (noise, sampling, initialisation): an independent replicate arm, e.g. the
    #: second arm of an A/A (null) study; 0 pairs the methods by seed (common random numbers)
    seed_offset: int = 0
    #: this method's ``privacy.noise`` and the secure sum's settings (empty: central noise)
    privacy: tuple[tuple[str, Any], ...] = ()

    @property
    def distributed(self) -> bool:
        return dict(self.privacy).get("noise") == "distributed"

    def routine_of(self, point: Mapping[str, float]) -> dict[str, Any]:
        """The routine of one grid point, as ``training.routine`` (fixed parameters, then the point's)."""
        params = dict(self.routine_params) | {k: float(v) for k, v in point.items() if k not in GRID_KEYS}
        return {"name": self.routine, **params}

    def describe_routine(self) -> str:
        """``adam(beta1=0.9)``, or ``gd``."""
        params = ", ".join(f"{k}={v:g}" for k, v in self.routine_params)
        return f"{self.routine}({params})" if params else self.routine

    def points(self, grid: Mapping[str, Sequence[float]] | None = None) -> list[dict[str, float]]:
        """The grid's points (of ``grid``, e.g. the grid as extended by the analysis, else the declared one)."""
        items = list(grid.items()) if grid is not None else list(self.grid)
        keys = [k for k, _ in items]
        return [dict(zip(keys, values)) for values in itertools.product(*(v for _, v in items))]


@dataclass(frozen=True)
class Study:
    name: str
    dataset: Mapping[str, Any]
    clients: int
    rounds: int
    delta: float
    epsilons: tuple[float, ...]
    mode: Literal["exact", "rdp"]
    eval_every: int
    tune_seeds: tuple[int, ...]
    eval_seeds: tuple[int, ...]
    methods: tuple[MethodSpec, ...]
    hidden: int = 10
    model: str = "paper_mlp"  # or a factory "package.module:callable" (then model_kwargs, not hidden)
    model_kwargs: Mapping[str, Any] = field(default_factory=dict)
    engine: Engine = "batch"
    dtype: Literal["float64", "float32"] = "float64"
    compile: bool = False
    #: where the batched engine's rounds run: "cpu", "cuda", "cuda:N" or "auto" (a GPU if torch sees one)
    device: str = "cpu"
    batch_size: int = 32
    threads: int = 1  # torch/BLAS threads of every unit (training.threads of every run): results depend on it
    workers: int = 1  # processes that compute units side by side on this machine (runs are independent)
    #: (treatment, control) method names of the one-sided paired t-tests; empty: every diff2 method vs the first dpgd
    tests: tuple[tuple[str, str], ...] = ()
    #: the method whose utility the cost report measures the others' rounds and gradient evaluations against
    reference: str | None = None
    #: the analysis plan (protocol, primary endpoints, grid extension), declared before the study runs
    analysis: Analysis = field(default_factory=Analysis)
    output_dir: str = "outputs/studies"
    source: str = field(default="<memory>", compare=False)

    def rounds_of(self, method: MethodSpec) -> int:
        """R of ``method``: its own ``rounds`` or the study's."""
        return method.rounds or self.rounds

    def experiment(self, method: MethodSpec, point: Mapping[str, float], epsilon: float, seed: int) -> ExperimentConfig:
        """The single-run config of one (method, grid point, ε, seed); the run uses seed + the method's seed_offset."""
        seed = seed + method.seed_offset
        training = {"rounds": self.rounds_of(method), "clients": self.clients, "seed": seed, "dtype": "float64",
                    "threads": self.threads,
                    **{k: (int(v) if k == "restart_every" else float(v)) for k, v in point.items()
                       if k in GRID_KEYS and not k.startswith("local.")},
                    "routine": method.routine_of(point)}
        local = dict(method.local) | {k.removeprefix("local."): v for k, v in point.items() if k.startswith("local.")}
        local = {k: (int(v) if k in ("steps", "batch_size") else float(v)) for k, v in local.items()}
        return parse_config({
            "name": f"{self.name}-{slug(method.name)}", "method": method.method, "dataset": dict(self.dataset),
            "model": ({"hidden": self.hidden} if self.model == "paper_mlp" else
                      {"name": self.model, "kwargs": dict(self.model_kwargs)}) | {"init_seed": seed},
            "privacy": {"epsilon": epsilon, "delta": self.delta, "mode": self.mode, "u": method.u,
                        **dict(method.privacy)},
            "training": training, "evaluation": {"every": self.eval_every}, **({"local": local} if local else {}),
        }, source=f"{self.source} (method {method.name!r}, point {dict(point)})")


def slug(text: str) -> str:
    """``DIFF2-GD (T=4)`` -> ``diff2-gd--t-4``: a method name as part of a file name."""
    return "".join(c if c.isalnum() else "-" for c in text).strip("-").lower()


def test_pairs(study: Study) -> list[tuple[str, str]]:
    """The (treatment, control) pairs of the study's t-tests: its ``tests``, or every diff2 method vs the first dpgd."""
    return _pairs(study.tests, study.methods)


def _pairs(tests: Sequence[tuple[str, str]], methods: Sequence[MethodSpec]) -> list[tuple[str, str]]:
    if tests:
        return list(tests)
    controls = [m for m in methods if m.method == "dpgd"]
    return [(m.name, controls[0].name) for m in methods if controls and m.method == "diff2"]


# ------------------------------------------------------------------------------- the file

def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _Refused(ValueError):
    """A check of :func:`~.analysis.parse_analysis` (which reports through a callable), turned into ``require``'s."""

    def __init__(self, key: str, expected: str, found: Any) -> None:
        super().__init__(key)
        self.key, self.expected, self.found = key, expected, found


#: The default of a key the file must give (the parser type-checks only given values; a missing one stays this).
REQUIRED: Any = None


@dataclass(frozen=True)
class StudyFile:
    """A study file's keys, as written (``object``: a nested block, checked and parsed in ``__post_init__``;
    :data:`REQUIRED`: a key without a default).

    Parsed by :func:`~diff2_flwr.runtime.config.parse_section`; after it, ``seeds`` is ``(tune, evaluate)``,
    ``methods`` a tuple of :class:`MethodSpec`, ``tests`` a tuple of pairs and ``analysis`` an
    :class:`~.analysis.Analysis`.
    """

    name: str = REQUIRED
    dataset: object = REQUIRED
    clients: int = 10
    rounds: int = REQUIRED
    delta: float = 1e-5
    epsilons: tuple[float, ...] = REQUIRED
    mode: Literal["exact", "rdp"] = "exact"
    eval_every: int = 1
    seeds: object = REQUIRED
    methods: object = REQUIRED
    hidden: int | None = None
    model: object = None
    engine: Engine = "batch"
    dtype: Literal["float64", "float32"] = "float64"
    compile: bool = False
    device: str = "cpu"
    batch_size: int = 32
    output: object = None
    threads: int = 1
    workers: int = 1
    tests: object = None
    reference: str | None = None
    analysis: object = None

    def __post_init__(self) -> None:
        for key in ("name", "dataset", "rounds", "epsilons", "methods", "seeds"):
            require(getattr(self, key) is not REQUIRED, key, "a value (required)", None)
        require(isinstance(self.dataset, Mapping), "dataset", "a mapping of the dataset's keys", self.dataset)
        object.__setattr__(self, "seeds", _seeds(self.seeds))
        require(bool(self.epsilons) and all(e > 0 for e in self.epsilons), "epsilons",
                "a non-empty list of numbers > 0", list(self.epsilons))
        require(self.rounds >= 1, "rounds", "an integer >= 1", self.rounds)
        raw = self.methods
        require(isinstance(raw, list) and bool(raw), "methods", "a non-empty list of methods", raw)
        methods = tuple(_method(i, m, self.rounds) for i, m in enumerate(raw))
        names = [m.name for m in methods]
        require(len(set(names)) == len(names), "methods", "distinct method names", names)
        object.__setattr__(self, "methods", methods)
        object.__setattr__(self, "tests", _tests(self.tests, names))
        require(self.reference is None or self.reference in names, "reference", f"a method name among {names}",
                self.reference)
        self._check_model_and_output()
        self._check_execution()
        object.__setattr__(self, "analysis", self._analysis())
        if self.analysis.corrected:
            _check_symmetric(methods, _pairs(self.tests, methods))

    def _analysis(self) -> Analysis:
        try:
            return parse_analysis(self.analysis, _Refused, tune_seeds=len(self.seeds[0]), rounds=self.rounds)
        except _Refused as err:
            require(False, err.key, err.expected, err.found)
            raise

    def _check_model_and_output(self) -> None:
        model = self.model or {}
        require(isinstance(model, Mapping) and not set(model) - {"name", "kwargs"}
                and isinstance(model.get("kwargs") or {}, Mapping), "model",
                "a mapping with name (a factory 'package.module:callable') and optionally kwargs", model)
        require(self.hidden is None or model.get("name", "paper_mlp") == "paper_mlp", "hidden",
                f"nothing with model {model.get('name')!r} (pass its sizes in model.kwargs)", self.hidden)
        output = self.output or {}
        require(isinstance(output, Mapping) and not set(output) - {"dir"}, "output", "a mapping with key dir", output)

    def _check_execution(self) -> None:
        require(self.threads >= 1, "threads",
                "an integer >= 1 (threads of each computing process; results depend on it)", self.threads)
        require(self.workers >= 1, "workers", "an integer >= 1 (processes that compute runs side by side; 2 uses "
                "both cores of a 2-core machine with threads: 1)", self.workers)
        require(self.workers == 1 or self.engine != "flower", "workers",
                "1 with engine 'flower' (each run is a Flower simulation with its own SuperLink; use engine "
                "'inprocess', which equals it bit for bit, to run several at once)", self.workers)
        require(self.batch_size >= 1, "batch_size", "an integer >= 1", self.batch_size)
        require(self.device == "cpu" or self.engine == "batch", "device",
                "'cpu' unless engine is 'batch' (only the batched engine runs on a GPU)", self.device)
        require(self.device in ("cpu", "cuda", "auto") or (self.device.startswith("cuda:")
                                                          and self.device[5:].isdigit()),
                "device", "'cpu', 'cuda', 'cuda:N' or 'auto'", self.device)

    def study(self, source: str) -> Study:
        """The :class:`Study` this file declares."""
        model, tune, evaluate = self.model or {}, *self.seeds
        return Study(
            name=self.name, dataset=dict(self.dataset), clients=self.clients, rounds=self.rounds, delta=self.delta,
            epsilons=tuple(float(e) for e in self.epsilons), mode=self.mode, eval_every=self.eval_every,
            tune_seeds=tune, eval_seeds=evaluate, methods=self.methods,
            hidden=10 if self.hidden is None else self.hidden, model=str(model.get("name", "paper_mlp")),
            model_kwargs=dict(model.get("kwargs") or {}), engine=self.engine, dtype=self.dtype, compile=self.compile,
            device=self.device, batch_size=self.batch_size, output_dir=str((self.output or {}).get("dir", "outputs/studies")),
            source=source, threads=self.threads, workers=self.workers, tests=self.tests, reference=self.reference,
            analysis=self.analysis)


def _seeds(seeds: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``seeds: {tune: [...], evaluate: [...]}``: two disjoint lists of distinct integers >= 0."""
    require(isinstance(seeds, Mapping) and not set(seeds) - {"tune", "evaluate"}, "seeds",
            "a mapping with keys tune and evaluate", seeds)
    tune, evaluate = seeds.get("tune", []), seeds.get("evaluate", [])
    for key, values in (("seeds.tune", tune), ("seeds.evaluate", evaluate)):
        require(isinstance(values, list) and bool(values) and all(_is_int(v) and v >= 0 for v in values), key,
                "a non-empty list of integers >= 0", values)
        require(len(set(values)) == len(values), key, "distinct seeds", values)
    both = sorted(set(tune) & set(evaluate))
    require(not both, "seeds.evaluate",
            "seeds disjoint from seeds.tune (selection must not see the evaluation noise)", both)
    return tuple(tune), tuple(evaluate)


def _tests(tests: Any, names: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """``tests: [{treatment: NAME, control: NAME}, ...]`` (or one mapping): pairs of two different methods."""
    tests = tests or []
    pairs = []
    for i, pair in enumerate(tests if isinstance(tests, list) else [tests]):
        require(isinstance(pair, Mapping) and set(pair) == {"treatment", "control"}
                and {pair["treatment"], pair["control"]} <= set(names) and pair["treatment"] != pair["control"],
                f"tests[{i}]" if isinstance(tests, list) else "tests",
                f"a mapping {{treatment: NAME, control: NAME}} of two different method names among {list(names)}", pair)
        pairs.append((str(pair["treatment"]), str(pair["control"])))
    return tuple(pairs)


def _method(i: int, m: Any, rounds: int) -> MethodSpec:
    """``methods[i]``: a base method, its routine, its fixed local routine and its grid."""
    where = f"methods[{i}]"
    require(isinstance(m, Mapping) and not set(m) - set(METHOD_KEYS) and "name" in m and "method" in m, where,
            "a mapping with name, method, grid (and optionally u, routine, local, rounds, seed_offset)", m)
    offset = m.get("seed_offset", 0)
    require(_is_int(offset) and offset >= 0, f"{where}.seed_offset",
            "an integer >= 0 (added to every seed of this method)", offset)
    own_rounds = m.get("rounds")
    require(own_rounds is None or (_is_int(own_rounds) and own_rounds >= 1), f"{where}.rounds",
            "an integer >= 1 (this method's R; the same ε is spent over it)", own_rounds)
    privacy = m.get("privacy") or {}
    require(isinstance(privacy, Mapping) and not set(privacy) - set(PRIVACY_KEYS), f"{where}.privacy",
            f"a mapping with keys among {', '.join(PRIVACY_KEYS)} (the run config's privacy.*)", privacy)
    local = m.get("local") or {}
    require(isinstance(local, Mapping) and not set(local) - set(LOCAL_KEYS)
            and all(_is_number(v) for v in local.values()), f"{where}.local",
            f"a mapping of numbers with keys among {', '.join(LOCAL_KEYS)}", local)
    require(m["method"] in ("gd", "dpgd", "diff2"), f"{where}.method", "one of 'gd', 'dpgd', 'diff2'", m["method"])
    routine, fixed = _routine(where, m.get("routine", "gd"))
    grid = _grid(where, m.get("grid") or {}, routine, fixed, own_rounds or rounds)
    if m["method"] == "diff2":
        require("restart_every" in grid, f"{where}.grid.restart_every", "a list of T values for a diff2 method", None)
    else:
        require("restart_every" not in grid, f"{where}.grid.restart_every", f"no T for method {m['method']} (T = 1)",
                grid.get("restart_every"))
    return MethodSpec(name=str(m["name"]), method=m["method"], grid=tuple((k, tuple(v)) for k, v in grid.items()),
                      u=float(m.get("u", 1.25)), routine=routine, routine_params=tuple(sorted(fixed.items())),
                      local=tuple(sorted((str(k), v) for k, v in local.items())), rounds=own_rounds,
                      seed_offset=offset, privacy=tuple(sorted(privacy.items())))


def _routine(where: str, given: Any) -> tuple[str, dict[str, Any]]:
    """A method's routine: its name and the parameters it fixes."""
    routine = {"name": given} if isinstance(given, str) else given
    require(isinstance(routine, Mapping) and routine.get("name") in ROUTINES, f"{where}.routine",
            "a routine name or a mapping with name and its parameters, name one of "
            + ", ".join(repr(n) for n in ROUTINES), given)
    own = routine_parameters(routine["name"])
    fixed = {str(k): v for k, v in routine.items() if k != "name"}
    require(not set(fixed) - set(own), f"{where}.routine", f"parameters of routine {routine['name']} among "
            f"{', '.join(own) or 'none (its step is the learning rate)'}", sorted(set(fixed) - set(own)))
    return str(routine["name"]), fixed


def _grid(where: str, grid: Any, routine: str, fixed: Mapping[str, Any], rounds: int) -> dict[str, list]:
    """A method's grid: lists of values of the grid keys and of its routine's parameters that it does not fix."""
    require(isinstance(grid, Mapping), f"{where}.grid", "a mapping of hyper-parameter -> list of values", grid)
    own = routine_parameters(routine)
    bad = sorted(set(grid) - set(GRID_KEYS) - set(own))
    ranged = [k for k in bad if k in ROUTINE_GRID_KEYS]
    extra = (f" (and the parameters of its routine {routine}: {', '.join(own) or 'none'}; "
             f"{', '.join(ranged)} belong to another routine: set routine)") if ranged else \
        (f" and the parameters of its routine {routine}: {', '.join(own)}" if own else "")
    require(not bad, f"{where}.grid", f"keys among {', '.join(GRID_KEYS)}{extra}", bad)
    twice = sorted(set(grid) & set(fixed))
    require(not twice, f"{where}.grid", f"no key that {where}.routine already fixes", twice)
    for key, values in grid.items():
        require(isinstance(values, list) and bool(values), f"{where}.grid.{key}",
                "a non-empty list (an empty grid runs nothing)", values)
        low, what = (0, ">= 0") if key in own else (None, "> 0")  # momentum 0 is GD, weight decay 0 none
        require(all(_is_number(v) and (v > 0 or v == low) for v in values), f"{where}.grid.{key}",
                f"numbers {what}", values)
        if key == "restart_every":
            require(all(v <= rounds and int(v) == v for v in values), f"{where}.grid.restart_every",
                    f"integers T <= rounds = {rounds}", values)
    return dict(grid)


#: Hyper-parameters that both methods of a pair can tune (a shared routine parameter is added per pair).
_SHARED_KEYS = ("learning_rate", "clip_restart", "local.steps", "local.clip", "local.share")


def _check_symmetric(methods: Sequence[MethodSpec], pairs: Sequence[tuple[str, str]]) -> None:
    """The corrected protocol's symmetric grids: the two methods of a tested pair tune every hyper-parameter both
    have (learning rate; C₁ unless one of them has no clipping, i.e. GD; a shared routine's parameters) with grids of
    the same size. A hyper-parameter one method tunes and the other holds fixed gives the first more chances."""
    by_name = {m.name: m for m in methods}
    for treat, control in pairs:
        a, b = by_name[treat], by_name[control]
        keys = [k for k in _SHARED_KEYS if not (k == "clip_restart" and "gd" in (a.method, b.method))]
        keys += [k for k in routine_parameters(a.routine) if k in routine_parameters(b.routine)]
        ga, gb = dict(a.grid), dict(b.grid)
        for k in keys:
            require(len(ga.get(k, (None,))) == len(gb.get(k, (None,))), "methods",
                    f"symmetric grids under the corrected protocol: {treat!r} and {control!r} are compared, so both "
                    f"tune `{k}` with grids of the same size (or set `analysis: {{protocol: paper}}`)",
                    {treat: list(ga.get(k, ["fixed"])), control: list(gb.get(k, ["fixed"]))})


def parse_study(data: Any, source: str = "<memory>") -> Study:
    """Validate a study mapping; every error names the file and the key."""
    if not isinstance(data, Mapping):
        raise StudyError(f"{source}: a study must be a mapping of keys to values. Found {data!r}.")
    try:
        study = parse_section(StudyFile, data, source).study(source)
    except ConfigError as err:
        raise StudyError(str(err), key=err.key, expected=err.expected, found=err.found) from None
    # Validate every run config once, up front: bad values fail before hours of compute.
    for method in study.methods:
        for point in method.points():
            try:
                study.experiment(method, point, study.epsilons[0], study.tune_seeds[0])
            except ConfigError as err:
                raise StudyError(f"{source}: method {method.name!r}: {err}") from None
    return study


def load_study(path: str | Path) -> Study:
    """Read and validate a study YAML file."""
    return parse_study(read_yaml(path, "study", StudyError), str(path))
