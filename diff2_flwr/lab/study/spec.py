"""A study's spec: its YAML file, validated by the experiment file's machinery into one value.

The file is read into a :class:`Study` by :func:`~diff2_flwr.runtime.config.parse_section` (unknown
keys, types, and each key's check, with the one message shape "file: key `x`: expected …. Found
…."); its nested blocks (seeds, methods, tests, model, output, analysis) are checked with
:func:`~diff2_flwr.runtime.config.require` and become values in ``__post_init__`` (a value already
parsed stays as it is, so ``dataclasses.replace`` checks a changed study again). A method is a base
method with overrides of the experiment's settings, fixed or on a grid (:mod:`.methods`). Every grid
point's run config is validated once, up front, so a bad value fails before hours of compute.

References:
    Murata & Suzuki (2023), Section 6; DIFF2.md, "The paper's experiments".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

from ...core.routines import routine_parameters
from ...core.schedules import schedule_parameters
from ...runtime.config import (PAPER_MLP, ConfigError, ExperimentConfig, ModelConfig, parse_config,
                               parse_section, read_yaml, require)
from .methods import SCHEDULE_AXIS, MethodSpec, declared, dotted, parse_methods, point_key
from .registration import Registration, RegistrationError, registration_of
from .stats import Analysis, parse_analysis

__all__ = ["ACCURACY", "CRITERIA", "MethodSpec", "Seeds", "Study", "StudyError", "StudyFile",
           "load_study", "parse_study", "slug", "test_pairs"]

CRITERIA = ("train_loss", "grad_norm_sq", "test_loss")
#: Reported, never selected on: larger is better, taken at the train-loss-best point
#: (classification only).
ACCURACY = "test_accuracy"
Engine = Literal["batch", "inprocess", "flower"]
#: The default of a key the file must give (the parser type-checks only given values; a missing
#: one stays this).
REQUIRED: Any = None


class StudyError(ConfigError):
    """An invalid study file; the message names the file, the key, and what was found."""


@dataclass(frozen=True)
class Seeds:
    """``seeds: {tune: [...], evaluate: [...]}``: two disjoint lists of distinct integers >= 0."""

    tune: tuple[int, ...] = ()
    evaluate: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for key in ("tune", "evaluate"):
            values = list(getattr(self, key))
            require(bool(values) and all(v >= 0 for v in values), key,
                    "a non-empty list of integers >= 0", values)
            require(len(set(values)) == len(values), key, "distinct seeds", values)
        both = sorted(set(self.tune) & set(self.evaluate))
        require(not both, "evaluate", "seeds disjoint from seeds.tune (selection must not see the "
                "evaluation noise)", both)


@dataclass(frozen=True)
class Study:
    """A study: its file's keys (:data:`REQUIRED`: a key without a default), parsed and checked.

    After ``__post_init__``, ``methods`` is a tuple of :class:`~.methods.MethodSpec`, ``tests`` a
    tuple of (treatment, control) pairs, ``analysis`` an :class:`~.stats.Analysis`, ``model`` the
    model's name (the file gives it alone or as ``{name, kwargs}``, whose kwargs become
    ``model_kwargs``) and ``hidden`` the paper MLP's width (None for a factory model).
    """

    name: str = REQUIRED
    dataset: object = REQUIRED  # the run configs' dataset section, as written
    clients: int = declared("training.clients")[1]
    rounds: int = REQUIRED
    delta: float = declared("privacy.delta")[1]
    epsilons: tuple[float, ...] = REQUIRED
    mode: Literal["exact", "rdp"] = declared("privacy.mode")[1]
    eval_every: int = declared("evaluation.every")[1]
    seeds: Seeds = REQUIRED
    methods: object = REQUIRED
    hidden: int | None = None
    model: object = None  # "paper_mlp", a factory "package.module:callable", or {name, kwargs}
    #: a factory model's keyword arguments, from ``model.kwargs`` in the file (not a key of it)
    model_kwargs: object = field(default=None, metadata={"derived": True})
    engine: Engine = "batch"
    dtype: Literal["float64", "float32"] = "float64"
    #: the fused kernel's clipped sums: "float64", or "float32" (dtype float32, engine batch:
    #: float32 windows summed in float64, clipped at a radius shorter by ρ ≈ 2.4e-4 so that the
    #: sensitivity stays 2C; :mod:`diff2_flwr.core.fused`)
    accumulate: Literal["float64", "float32"] = "float64"
    #: the fused kernel's two-valued columns path for the first layer's sums (engine batch, more
    #: than 32 features, at least 16 columns taking two values: one-hot columns;
    #: :class:`~diff2_flwr.lab.backend.FusedBackend`)
    two_valued: bool = False
    compile: bool = False
    #: where the batched engine's rounds run: "cpu", "cuda", "cuda:N" or "auto" (a GPU if torch
    #: sees one)
    device: str = "cpu"
    batch_size: int = 32
    output: object = None  # {dir: ...}
    #: torch/BLAS threads of every unit (training.threads of every run): results depend on it
    threads: int = 1
    #: processes that compute units side by side on this machine (runs are independent)
    workers: int = 1
    #: (treatment, control) method names of the one-sided paired t-tests; empty: every diff2
    #: method vs the first dpgd
    tests: object = None
    #: the method whose utility the cost report measures the others' rounds and gradient
    #: evaluations against
    reference: str | None = None
    #: the analysis plan (protocol, primary endpoints, grid extension), declared before the study
    #: runs
    analysis: object = None
    #: the registration file that fixes this study before it runs (a file beside it, see
    #: :mod:`.registration`); after ``__post_init__`` a :class:`~.registration.Registration` or
    #: None
    registration: object = None
    source: str = field(default="<memory>", compare=False)

    def __post_init__(self) -> None:
        for key in ("name", "dataset", "rounds", "epsilons", "methods", "seeds"):
            require(getattr(self, key) is not REQUIRED, key, "a value (required)", None)
        require(isinstance(self.dataset, Mapping), "dataset", "a mapping of the dataset's keys",
                self.dataset)
        require(bool(self.epsilons) and all(e > 0 for e in self.epsilons), "epsilons",
                "a non-empty list of numbers > 0", list(self.epsilons))
        require(self.rounds >= 1, "rounds", "an integer >= 1", self.rounds)
        methods = parse_methods(self.methods, self.rounds)
        names = [m.name for m in methods]
        self._set(methods=methods, tests=_tests(self.tests, names))
        require(self.reference is None or self.reference in names, "reference",
                f"a method name among {names}", self.reference)
        self._check_model_and_output()
        self._check_execution()
        self._set(analysis=self._analysis())
        if not isinstance(self.registration, Registration):
            try:
                self._set(registration=registration_of(self.registration, self.source))
            except RegistrationError as err:
                raise StudyError(str(err)) from None
        pairs = _pairs(self.tests, methods)
        _check_symmetric(methods, pairs, self.analysis)
        # the paired t-tests need two seeds a side: refused here, not after every run is computed
        if pairs and len(self.eval_seeds) < 2:
            (treat, control), more = pairs[0], ", ..." if len(pairs) > 1 else ""
            require(False, "seeds.evaluate",
                    f"at least 2 evaluation seeds: the study compares {len(pairs)} pair(s) of "
                    f"methods ({treat!r} vs {control!r}{more}) with paired t-tests across the "
                    "evaluation seeds; add seeds", list(self.eval_seeds))

    def _set(self, **values: Any) -> None:
        for key, value in values.items():
            object.__setattr__(self, key, value)

    def _analysis(self) -> Analysis:
        if isinstance(self.analysis, Analysis):
            return self.analysis
        raw = self.analysis
        if isinstance(raw, Mapping) and isinstance(raw.get("extend"), Mapping):
            extend = {point_key(dotted(str(k))): v for k, v in raw["extend"].items()}  # as points
            require(len(extend) == len(raw["extend"]), "analysis.extend", "each key once",
                    list(raw["extend"]))
            raw = {**raw, "extend": extend}
        try:
            return parse_analysis(raw, _Refused, tune_seeds=len(self.tune_seeds),
                                  rounds=self.rounds)
        except _Refused as err:
            require(False, err.key, err.expected, err.found)
            raise

    def _check_model_and_output(self) -> None:
        model = {"name": self.model} if isinstance(self.model, str) else self.model or {}
        require(isinstance(model, Mapping) and not set(model) - {"name", "kwargs"}
                and isinstance(model.get("name", PAPER_MLP), str)
                and isinstance(model.get("kwargs") or {}, Mapping),
                "model", "a mapping with name (a factory 'package.module:callable') and optionally "
                "kwargs", model)
        require(self.model_kwargs is None or isinstance(self.model_kwargs, Mapping), "model_kwargs",
                "a mapping of the factory model's keyword arguments", self.model_kwargs)
        require(not (model.get("kwargs") and self.model_kwargs), "model_kwargs",
                "nothing beside model.kwargs (give the kwargs once)", self.model_kwargs)
        name = model.get("name", PAPER_MLP)
        require(self.hidden is None or name == PAPER_MLP, "hidden",
                f"nothing with model {name!r} (pass its sizes in model.kwargs)", self.hidden)
        output = self.output or {}
        require(isinstance(output, Mapping) and not set(output) - {"dir"}, "output",
                "a mapping with key dir", output)
        hidden = ModelConfig(hidden=self.hidden).hidden_units if name == PAPER_MLP else None
        self._set(model=name, model_kwargs=dict(model.get("kwargs") or self.model_kwargs or {}),
                  hidden=hidden)

    def _check_execution(self) -> None:
        require(self.threads >= 1, "threads",
                "an integer >= 1 (threads of each computing process; results depend on it)",
                self.threads)
        require(self.workers >= 1, "workers",
                "an integer >= 1 (processes that compute runs side by side; 2 uses both cores of a "
                "2-core machine with threads: 1)", self.workers)
        require(self.workers == 1 or self.engine != "flower", "workers",
                "1 with engine 'flower' (each run is a Flower simulation with its own SuperLink; "
                "use engine 'inprocess', which equals it bit for bit, to run several at once)",
                self.workers)
        require(self.batch_size >= 1, "batch_size", "an integer >= 1", self.batch_size)
        require(self.accumulate in ("float64", "float32"), "accumulate", "'float64' or 'float32'",
                self.accumulate)
        require(self.accumulate == "float64" or (self.dtype == "float32"
                                                 and self.engine == "batch"), "accumulate",
                "'float64' unless dtype is 'float32' and engine is 'batch' (float32 sums are the "
                "fused kernel's)", self.accumulate)
        require(isinstance(self.two_valued, bool), "two_valued", "true or false",
                self.two_valued)
        require(not self.two_valued or self.engine == "batch", "two_valued",
                "false unless engine is 'batch' (the two-valued columns path is the fused "
                "kernel's)", self.two_valued)
        require(self.device == "cpu" or self.engine == "batch", "device",
                "'cpu' unless engine is 'batch' (only the batched engine runs on a GPU)",
                self.device)
        require(self.device in ("cpu", "cuda", "auto")
                or (self.device.startswith("cuda:") and self.device[5:].isdigit()),
                "device", "'cpu', 'cuda', 'cuda:N' or 'auto'", self.device)

    @property
    def tune_seeds(self) -> tuple[int, ...]:
        """The seeds the grid is tuned on."""
        return tuple(self.seeds.tune)

    @property
    def eval_seeds(self) -> tuple[int, ...]:
        """The seeds each method's picks are evaluated on (disjoint from the tuning seeds)."""
        return tuple(self.seeds.evaluate)

    @property
    def output_dir(self) -> str:
        """The folder the study's own folder goes into (``output.dir``)."""
        return str((self.output or {}).get("dir", "outputs/studies"))

    def rounds_of(self, method: MethodSpec) -> int:
        """R of ``method``: its own ``rounds`` or the study's."""
        return method.rounds or self.rounds

    def experiment(self, method: MethodSpec, point: Mapping[str, Any], epsilon: float,
                   seed: int) -> ExperimentConfig:
        """The single-run config of one (method, grid point, ε, seed): what the study sets for every
        run, then the method's settings and the point's values as overrides (the run uses seed + the
        method's seed_offset)."""
        seed = seed + method.seed_offset
        model = ({"hidden": self.hidden} if self.model == PAPER_MLP else
                 {"name": self.model, "kwargs": dict(self.model_kwargs)})
        data = {"name": f"{self.name}-{slug(method.name)}", "method": method.method,
                "dataset": dict(self.dataset), "model": model | {"init_seed": seed},
                "privacy": {"epsilon": epsilon, "delta": self.delta, "mode": self.mode},
                "training": {"rounds": self.rounds, "clients": self.clients, "seed": seed,
                             "dtype": "float64", "threads": self.threads},
                "evaluation": {"every": self.eval_every}}
        for key, value in method.overrides(point).items():  # declared keys, checked on reading
            *sections, last = key.split(".")
            node = data
            for section in sections:
                node = node.setdefault(section, {})
            node[last] = value
        return parse_config(data, f"{self.source} (method {method.name!r}, point {dict(point)})")


#: The study file's former parser, now the study itself: ``parse_section(StudyFile, ...)``.
StudyFile = Study


def slug(text: str) -> str:
    """``DIFF2-GD (T=4)`` -> ``diff2-gd--t-4``: a method name as part of a file name."""
    return "".join(c if c.isalnum() else "-" for c in text).strip("-").lower()


def test_pairs(study: Study) -> list[tuple[str, str]]:
    """The (treatment, control) pairs of the study's t-tests: its ``tests``, or every diff2 method
    vs the first dpgd."""
    return _pairs(study.tests, study.methods)


def _pairs(tests: Sequence[tuple[str, str]],
           methods: Sequence[MethodSpec]) -> list[tuple[str, str]]:
    if tests:
        return list(tests)
    controls = [m for m in methods if m.method == "dpgd"]
    return [(m.name, controls[0].name) for m in methods if controls and m.method == "diff2"]


# ------------------------------------------------------------------------------- the file's blocks

class _Refused(ValueError):
    """A check of :func:`~.stats.parse_analysis` (which reports through a callable) as a
    ``require``."""

    def __init__(self, key: str, expected: str, found: Any) -> None:
        super().__init__(key)
        self.key, self.expected, self.found = key, expected, found


def _tests(tests: Any, names: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """``tests: [{treatment: NAME, control: NAME}, ...]`` (or one mapping): pairs of two different
    methods."""
    if isinstance(tests, tuple):  # parsed already
        return tests
    tests = tests or []
    pairs = []
    for i, pair in enumerate(tests if isinstance(tests, list) else [tests]):
        require(isinstance(pair, Mapping) and set(pair) == {"treatment", "control"}
                and {pair["treatment"], pair["control"]} <= set(names)
                and pair["treatment"] != pair["control"],
                f"tests[{i}]" if isinstance(tests, list) else "tests",
                "a mapping {treatment: NAME, control: NAME} of two different method names among "
                f"{list(names)}", pair)
        pairs.append((str(pair["treatment"]), str(pair["control"])))
    return tuple(pairs)


#: Hyper-parameters that both methods of a pair can tune (a shared routine parameter is added
#: per pair).
_SHARED_KEYS = ("learning_rate", "clip_restart", "local.steps", "local.clip", "local.share")


def _check_symmetric(methods: Sequence[MethodSpec], pairs: Sequence[tuple[str, str]],
                     analysis: Analysis) -> None:
    """The fairness rules of the tested pairs' grids.

    Under the corrected protocol, symmetric grids: the two methods of a tested pair tune every
    hyper-parameter both have (learning rate; C₁ unless one of them has no clipping, i.e. GD; a
    shared routine's parameters; the schedule, and the parameters of schedules both run) with grids
    of the same size. A hyper-parameter one method tunes and the other holds fixed gives the first
    more chances. Under ``budgets: equal`` (any protocol) the two tune the same number of grid
    points instead, and the schedule is then one method's own axis, like DIFF2's T and C₂: the
    shared hyper-parameters still have grids of the same size.
    """
    by_name = {m.name: m for m in methods}
    equal = analysis.budgets == "equal"
    for treat, control in pairs:
        a, b = by_name[treat], by_name[control]
        ga, gb = dict(a.grid), dict(b.grid)
        for k in _shared_keys(a, b, schedule=not equal) if analysis.corrected else ():
            require(len(ga.get(k, (None,))) == len(gb.get(k, (None,))), "methods",
                    f"symmetric grids under the corrected protocol: {treat!r} and {control!r} are "
                    f"compared, so both tune `{k}` with grids of the same size (or set "
                    "`analysis: {protocol: paper}`)",
                    {treat: list(ga.get(k, ["fixed"])), control: list(gb.get(k, ["fixed"]))})
        if equal:
            _check_budget(a, b)


def _shared_keys(a: MethodSpec, b: MethodSpec, *, schedule: bool) -> list[str]:
    """The grid keys two compared methods both have: learning rate, C₁ (unless one is GD), the local
    routine's, a shared routine's parameters, and (``schedule``) the schedule and the parameters of
    schedules both run."""
    clipped = "gd" not in (a.method, b.method)
    keys = [k for k in _SHARED_KEYS if clipped or k != "clip_restart"]
    keys += [k for k in routine_parameters(a.routine) if k in routine_parameters(b.routine)]
    if schedule:
        keys += [SCHEDULE_AXIS, *sorted(_schedule_keys(a) & _schedule_keys(b))]
    return keys


def _check_budget(a: MethodSpec, b: MethodSpec) -> None:
    """``budgets: equal``: ``a`` and ``b`` tune the same number of grid points, counted as the
    planner builds them (schedule parameters merge where a point's schedule lacks them)."""
    counts = {a.name: len(a.points()), b.name: len(b.points())}
    require(counts[a.name] == counts[b.name], "methods",
            f"equal tuning budgets (`analysis.budgets: equal`): {a.name!r} and {b.name!r} are "
            "compared, so both tune the same number of grid configurations (counted after "
            "schedule parameters merge); change a grid, or drop `budgets: equal`", counts)


def _schedule_keys(method: MethodSpec) -> set[str]:
    """The parameters of the schedules a method runs."""
    return {k for name in method.schedules for k in schedule_parameters(name)}


def parse_study(data: Any, source: str = "<memory>") -> Study:
    """Validate a study mapping; every error names the file and the key."""
    if not isinstance(data, Mapping):
        raise StudyError(f"{source}: a study must be a mapping of keys to values. Found {data!r}.")
    try:
        study = parse_section(Study, data, source)
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
