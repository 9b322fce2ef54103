"""A study's methods: each a base method with overrides of the experiment's settings, fixed or on
a grid.

A method entry (``methods[i]`` of a study file) names itself and its base method and sets any
experiment key that the study leaves to its methods (:data:`STUDY_SETS`: the keys the study sets for
every run), either fixed or as a grid of values the study tunes::

    - {name: DIFF2-Adam, method: diff2, routine: adam, training.clip_diff: 2.0, privacy: {bits: 16},
       grid: {restart_every: [10, 20], training.learning_rate: [0.01, 0.03]}}

A key is written dotted (``training.learning_rate``), nested (``privacy: {noise: distributed}``), or
by the short name study files have always used: a key of ``training``, a routine parameter or a
schedule parameter by its own name (``learning_rate``, ``restart_every``, ``rounds``, ``beta1``,
``decay``; ``routine`` and ``schedule`` for their names) and ``u`` for ``privacy.u``. Both
spellings make the same runs, with the same run ids: a grid point names a key by its short name
where it has one. Which keys exist, their types and their casts come from the experiment's
declarations (:mod:`diff2_flwr.runtime.config_training`): a value is checked against its field's
type with the experiment file's checks and message ("file: key `x`: expected …. Found ….") and cast
to it (a whole number to an ``int`` field, a number to a ``float`` one); :func:`~.spec.parse_study`
then validates every grid point's run config whole with
:func:`~diff2_flwr.runtime.config.parse_config`.

A grid ranges over numbers, and over step-size schedules by name (``schedule: [constant, cosine]``).
A schedule parameter, fixed or on the grid, applies to the points whose schedule has it: with
``grid: {schedule: [constant, cosine], floor: [0.0, 0.1]}`` the points are ``{schedule: constant}``,
``{schedule: cosine, floor: 0.0}`` and ``{schedule: cosine, floor: 0.1}`` (a parameter that none of
the method's schedules has is refused).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import itertools
import typing
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ...core.routines import ROUTINES, routine_parameters
from ...core.schedules import SCHEDULES, schedule_parameters
from ...runtime.config import ExperimentConfig, Method, config_keys, require
from ...runtime.spec import describe_type, is_int, type_ok

__all__ = ["STUDY_SETS", "MethodSpec", "cast", "declared", "dotted", "parse_methods", "point_key"]

#: The experiment keys the study sets for every run, which a method may not set, and the study's key
#: that sets each (a key ending in "." stands for its section).
STUDY_SETS = {"name": "name", "dataset.": "dataset", "model.": "model (and hidden)",
              "privacy.epsilon": "epsilons", "privacy.delta": "delta", "privacy.mode": "mode",
              "privacy.n_min": "dataset (n_min is its smallest shard)",
              "training.clients": "clients", "training.seed": "seeds", "training.dtype": "dtype",
              "training.threads": "threads",
              "evaluation.": "eval_every (every run is measured alike)", "output.": "output"}
#: A method entry's own keys (the others set the experiment).
OWN_KEYS = ("name", "method", "grid", "seed_offset")
#: Where a routine's parameters live; ``routine`` names the routine (its section's shorthand).
_ROUTINE = "training.routine."
#: Where a schedule's parameters live; ``schedule`` names the schedule (its section's shorthand).
_SCHEDULE = "training.schedule."
#: The grid key of the schedule's name (its values are names, not numbers).
SCHEDULE_AXIS = "schedule"


@functools.cache
def _keys() -> tuple[str, ...]:
    return tuple(config_keys())


@functools.cache
def _short_names() -> dict[str, str]:
    """Short name -> dotted key: a key of ``training``, of its routine or of its schedule by its
    own name, ``u``."""
    out = {"u": "privacy.u"}
    for key in _keys():
        for section in ("training.", _ROUTINE, _SCHEDULE):
            rest = key.removeprefix(section)
            if key.startswith(section) and "." not in rest and rest != "name":
                out.setdefault(rest, key)
    return out


def dotted(key: str) -> str:
    """The experiment key a method's key stands for (``learning_rate``: training.learning_rate)."""
    return _short_names().get(key, key)


def _named(full: str) -> str:
    """The key a section that a name stands for sets (``training.schedule``: its ``.name``)."""
    return full + ".name" if full + "." in (_ROUTINE, _SCHEDULE) else full


@functools.cache
def point_key(key: str) -> str:
    """The name a grid point gives the experiment key ``key``: its short name if it has one."""
    return next((short for short, full in _short_names().items() if full == key), key)


@functools.cache
def declared(key: str) -> tuple[Any, Any]:
    """(type, default) of the dotted experiment ``key`` as its section declares it."""
    cls: Any = ExperimentConfig
    *sections, last = key.split(".")
    for section in sections:
        cls = typing.get_type_hints(cls)[section]
    default = {f.name: f.default for f in dataclasses.fields(cls)}[last]
    return typing.get_type_hints(cls)[last], default


def _kinds(hint: Any) -> tuple[Any, ...]:
    union = typing.get_origin(hint) in (typing.Union, type(int | None))
    return typing.get_args(hint) if union else (hint,)


def cast(key: str, value: Any) -> Any:
    """``value`` as the declared type of ``key`` takes it: a whole number for an ``int`` field
    (T = 20.0, as a grid's extension makes it, is 20), a number for a ``float`` one; anything else
    as it is."""
    kinds = _kinds(declared(key)[0])
    if _is_number(value):
        if int in kinds and float(value).is_integer():
            return int(value)
        if float in kinds:
            return float(value)
    return value


def _number(key: str) -> Any:
    """The numeric type ``key`` is declared with (None: not a number)."""
    return next((k for k in _kinds(declared(key)[0]) if k in (int, float)), None)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class MethodSpec:
    """One compared method: a base method, the experiment keys it fixes and its grid of the others.

    ``settings`` are dotted experiment keys and their values as written; ``grid`` names each key as
    a grid point does (:func:`point_key`). The properties read the settings the study's reports and
    run ids name.
    """

    name: str
    method: Method
    grid: tuple[tuple[str, tuple[Any, ...]], ...] = ()
    settings: tuple[tuple[str, Any], ...] = ()
    #: added to every seed of this method (noise, sampling, initialisation): an independent
    #: replicate arm, e.g. the second arm of an A/A (null) study; 0 pairs the methods by seed
    #: (common random numbers)
    seed_offset: int = 0

    def _under(self, section: str) -> tuple[tuple[str, Any], ...]:
        return tuple((k.removeprefix(section), v) for k, v in self.settings
                     if k.startswith(section))

    @property
    def u(self) -> float:
        """The budget split ``privacy.u`` of its runs."""
        return cast("privacy.u", dict(self.settings).get("privacy.u", declared("privacy.u")[1]))

    @property
    def routine(self) -> str:
        """The name of its routine (``training.routine.name``)."""
        return str(dict(self.settings).get(_ROUTINE + "name", declared(_ROUTINE + "name")[1]))

    @property
    def routine_params(self) -> tuple[tuple[str, Any], ...]:
        """The routine's parameters it fixes; its grid may range over the others."""
        return tuple((k, v) for k, v in self._under(_ROUTINE) if k != "name")

    @property
    def schedule(self) -> str:
        """The name of the schedule it fixes (``training.schedule.name``; constant by default)."""
        return str(dict(self.settings).get(_SCHEDULE + "name", declared(_SCHEDULE + "name")[1]))

    @property
    def schedule_params(self) -> tuple[tuple[str, Any], ...]:
        """The schedule parameters it fixes (each applies to the points whose schedule has it)."""
        return tuple((k, v) for k, v in self._under(_SCHEDULE) if k != "name")

    @property
    def schedules(self) -> tuple[str, ...]:
        """The schedules of its runs: those its grid ranges over, else the one it fixes."""
        return tuple(dict(self.grid).get(SCHEDULE_AXIS, (self.schedule,)))

    @property
    def local(self) -> tuple[tuple[str, Any], ...]:
        """The keys of the local routine it fixes (``local.*``; empty: off unless gridded)."""
        return self._under("local.")

    @property
    def rounds(self) -> int | None:
        """Its own R (None: the study's); ε is the same for every R."""
        return cast("training.rounds", dict(self.settings).get("training.rounds"))

    @property
    def privacy(self) -> tuple[tuple[str, Any], ...]:
        """Its ``privacy.*`` keys but u: who adds the noise, the secure sum's settings (none:
        central noise)."""
        return tuple((k, v) for k, v in self._under("privacy.") if k != "u")

    @property
    def distributed(self) -> bool:
        """Whether its clients add the noise (``privacy.noise: distributed``)."""
        return dict(self.privacy).get("noise") == "distributed"

    def overrides(self, point: Mapping[str, Any]) -> dict[str, Any]:
        """The experiment keys its run at ``point`` sets, dotted, cast to their declared types (the
        schedule parameters only where the point's schedule has them)."""
        given = dict(self.settings) | {_named(dotted(k)): v for k, v in point.items()}
        own = schedule_parameters(given.get(_SCHEDULE + "name", self.schedule))
        return {k: cast(k, v) for k, v in given.items()
                if not k.startswith(_SCHEDULE) or k.removeprefix(_SCHEDULE) in ("name", *own)}

    def routine_of(self, point: Mapping[str, Any]) -> dict[str, Any]:
        """The routine of one grid point as ``training.routine``: the fixed parameters, then the
        point's."""
        searched = {k: v for k, v in self.overrides(point).items()
                    if k.startswith(_ROUTINE) and point_key(k) in point}
        return {"name": self.routine, **dict(self.routine_params),
                **{k.removeprefix(_ROUTINE): v for k, v in searched.items()}}

    def schedule_of(self, point: Mapping[str, Any]) -> dict[str, Any]:
        """The schedule of one grid point as ``training.schedule``: its name, then its parameters
        (fixed and the point's)."""
        given = {k.removeprefix(_SCHEDULE): v for k, v in self.overrides(point).items()
                 if k.startswith(_SCHEDULE)}
        return {"name": self.schedule, **given}

    def schedules_fixed(self) -> dict[str, Any]:
        """Its schedule as the method declares it: the name (or the names its grid ranges over)
        and the parameters it fixes."""
        names = dict(self.grid).get(SCHEDULE_AXIS)
        return {"name": list(names) if names else self.schedule, **dict(self.schedule_params)}

    def describe_routine(self) -> str:
        """``adam(beta1=0.9)``, or ``gd``."""
        params = ", ".join(f"{k}={v:g}" for k, v in self.routine_params)
        return f"{self.routine}({params})" if params else self.routine

    def points(self, grid: Mapping[str, Sequence[Any]] | None = None) -> list[dict[str, Any]]:
        """The grid's points (of ``grid``, e.g. the grid as the analysis extended it, else of the
        declared one)."""
        items = list(grid.items()) if grid is not None else list(self.grid)
        keys = [k for k, _ in items]
        points: dict[str, dict[str, Any]] = {}
        for values in itertools.product(*(v for _, v in items)):
            point = self._applies(dict(zip(keys, values)))
            points.setdefault(repr(sorted(point.items())), point)
        return list(points.values())

    def _applies(self, point: dict[str, Any]) -> dict[str, Any]:
        """``point`` without the schedule parameters its schedule does not have (points that differ
        only in those are one run)."""
        own = schedule_parameters(point.get(SCHEDULE_AXIS, self.schedule))
        return {k: v for k, v in point.items()
                if not dotted(k).startswith(_SCHEDULE) or dotted(k).removeprefix(_SCHEDULE) in own}


# ------------------------------------------------------------------------------- parsing

def parse_methods(raw: Any, rounds: int) -> tuple[MethodSpec, ...]:
    """A study's ``methods``: a non-empty list of method entries with distinct names (parsed ones
    stay as they are). ``rounds`` is the study's R: it bounds a method's T unless it has its own."""
    if isinstance(raw, tuple) and all(isinstance(m, MethodSpec) for m in raw):
        return raw
    require(isinstance(raw, list) and bool(raw), "methods", "a non-empty list of methods", raw)
    methods = tuple(_method(f"methods[{i}]", m, rounds) for i, m in enumerate(raw))
    names = [m.name for m in methods]
    require(len(set(names)) == len(names), "methods", "distinct method names", names)
    return methods


def _method(where: str, m: Any, rounds: int) -> MethodSpec:
    """``methods[i]``: its name, base method, fixed settings, grid and seed offset."""
    require(isinstance(m, Mapping) and "name" in m and "method" in m, where,
            "a mapping with name, method, and optionally grid, seed_offset and experiment keys", m)
    ok, method = type_ok(m["method"], declared("method")[0])
    require(ok, f"{where}.method", describe_type(declared("method")[0]), m["method"])
    offset = m.get("seed_offset", 0)
    require(is_int(offset) and offset >= 0, f"{where}.seed_offset",
            "an integer >= 0 (added to every seed of this method)", offset)
    written: dict[str, str] = {}  # dotted key -> as the entry wrote it
    fixed: dict[str, Any] = {}
    for key, value in m.items():
        if key not in OWN_KEYS:
            _setting(where, str(key), value, written, fixed)
    own_rounds = fixed.get("training.rounds")
    require(own_rounds is None or own_rounds >= 1, f"{where}.{written.get('training.rounds')}",
            "an integer >= 1 (this method's R; the same ε is spent over it)", own_rounds)
    routine = _routine(where, fixed, written)
    grid = _grid(where, m.get("grid") or {}, routine, fixed, written)
    _schedules(where, grid, fixed, written)
    _restarts(where, method, grid, fixed, written, own_rounds or rounds)
    return MethodSpec(name=str(m["name"]), method=method, grid=tuple(grid.items()),
                      settings=tuple(sorted(fixed.items())), seed_offset=offset)


def _setting(where: str, name: str, value: Any, written: dict[str, str], fixed: dict[str, Any],
             parent: str = "") -> None:
    """One fixed setting, written ``name`` (under the section ``parent``), or each key of a nested
    block."""
    full = f"{parent}.{name}" if parent else dotted(name)
    shown = f"{written[parent]}.{name}" if parent else name
    sections = {k.rsplit(".", 1)[0] for k in _keys() if k.startswith(full + ".")}
    if full in sections and (isinstance(value, Mapping) or full not in _keys()):
        value = {} if value is None else value  # ``local:`` with nothing under it
        require(isinstance(value, Mapping), f"{where}.{shown}", f"a mapping of keys of {full}",
                value)
        written[full] = shown
        for key, item in value.items():
            _setting(where, str(key), item, written, fixed, full)
        return
    full = _named(full)  # ``routine: adam`` names the routine, ``schedule: cosine`` the schedule
    _check_key(f"{where}.{shown}", full, value)
    hint = declared(full)[0]
    require(type_ok(cast(full, value), hint)[0], f"{where}.{shown}", describe_type(hint), value)
    require(full not in fixed, f"{where}.{shown}",
            f"{full} once (it is also given as {written.get(full)})", value)
    written[full], fixed[full] = shown, value


def _check_key(where: str, full: str, value: Any) -> None:
    """Refuse a key the experiment does not declare, or one the study sets for every run."""
    if full not in _keys():
        close = difflib.get_close_matches(full, [*_keys(), *_short_names()], n=1, cutoff=0.75)
        hint = f"; did you mean {close[0]}?" if close else ""
        require(False, where, "a key of the experiment, dotted (e.g. training.clip_diff) or by a "
                f"short name (e.g. clip_diff, u){hint}", value)
    owner = next((v for k, v in STUDY_SETS.items()
                  if full == k or (k.endswith(".") and full.startswith(k))), None)
    require(owner is None, where, f"a key the study leaves to its methods ({full} is set for "
            f"every run by the study's {owner})", value)


def _routine(where: str, fixed: Mapping[str, Any], written: Mapping[str, str]) -> str:
    """A method's routine (``routine``): a name, and the parameters it fixes are that routine's."""
    name = fixed.get(_ROUTINE + "name", declared(_ROUTINE + "name")[1])
    shown = written.get(_ROUTINE + "name", "routine").removesuffix(".name")
    require(name in ROUTINES, f"{where}.{shown}",
            "a routine name or a mapping with name and its parameters, name one of "
            + ", ".join(repr(n) for n in ROUTINES), name)
    own = routine_parameters(name)
    given = {k.removeprefix(_ROUTINE) for k in fixed if k.startswith(_ROUTINE)} - {"name"}
    require(not given - set(own), f"{where}.{shown}", f"parameters of routine {name} among "
            f"{', '.join(own) or 'none (its step is the learning rate)'}", sorted(given - set(own)))
    return str(name)


def _grid(where: str, grid: Any, routine: str, fixed: Mapping[str, Any],
          written: Mapping[str, str]) -> dict[str, tuple[Any, ...]]:
    """A method's grid: lists of values of the numeric experiment keys it does not fix, keyed as
    the points name them."""
    require(isinstance(grid, Mapping), f"{where}.grid",
            "a mapping of experiment key -> list of values", grid)
    own = routine_parameters(routine)
    fulls = {str(k): dotted(str(k)) for k in grid}
    ranged = sorted(point_key(f) for f in fulls.values()
                    if f.startswith(_ROUTINE) and point_key(f) not in own and f in _keys())
    require(not ranged, f"{where}.grid", "experiment keys and the parameters of its routine "
            f"{routine}: {', '.join(own) or 'none'}; {', '.join(ranged)} belong to another "
            "routine: set routine", ranged)
    twice = sorted(k for k, f in fulls.items() if _named(f) in fixed)
    by_routine = all(fulls[k].startswith(_ROUTINE) for k in twice)
    fixer, fixed_as = ((f"{where}.routine", "") if by_routine else
                       (where, f" ({', '.join(written[_named(fulls[k])] for k in twice)})"))
    require(not twice, f"{where}.grid", f"no key that {fixer} already fixes{fixed_as}", twice)
    out: dict[str, tuple[Any, ...]] = {}
    for key, values in grid.items():
        full, shown = fulls[str(key)], f"{where}.grid.{key}"
        _check_key(shown, full, values)
        named = _named(full) == _SCHEDULE + "name"
        require((SCHEDULE_AXIS if named else point_key(full)) not in out, shown,
                f"{_named(full)} once in the grid", values)
        if named:
            require(isinstance(values, list) and bool(values) and all(
                isinstance(v, str) and v in SCHEDULES for v in values) and len(set(values)) == len(
                values), shown, "a non-empty list of distinct schedule names among "
                + ", ".join(repr(n) for n in SCHEDULES), values)
            out[SCHEDULE_AXIS] = tuple(values)
            continue
        require(_number(full) is not None and full != "training.rounds", shown,
                "a key whose values are numbers, or schedule names for `schedule` (a grid ranges "
                "over numbers; set the others, and a method's rounds, beside the grid)", values)
        require(isinstance(values, list) and bool(values), shown,
                "a non-empty list (an empty grid runs nothing)", values)
        hint = declared(full)[0]
        require(all(_is_number(v) and type_ok(cast(full, v), hint)[0] for v in values), shown,
                f"a list of values of {full}, each {describe_type(_number(full))}", values)
        out[point_key(full)] = tuple(values)
    return out


def _schedules(where: str, grid: Mapping[str, Sequence[Any]], fixed: Mapping[str, Any],
               written: Mapping[str, str]) -> None:
    """A method's schedules (``schedule``: fixed, or a grid axis of names) and their parameters,
    fixed or on the grid: each parameter must belong to one of them at least."""
    name = fixed.get(_SCHEDULE + "name", declared(_SCHEDULE + "name")[1])
    shown = written.get(_SCHEDULE + "name", "schedule").removesuffix(".name")
    require(name in SCHEDULES, f"{where}.{shown}",
            "a schedule name or a mapping with name and its parameters, name one of "
            + ", ".join(repr(n) for n in SCHEDULES), name)
    names = grid.get(SCHEDULE_AXIS, (name,))
    own = {k for n in names for k in schedule_parameters(n)}
    given = {k.removeprefix(_SCHEDULE): (f"{where}.{written[k]}", v) for k, v in fixed.items()
             if k.startswith(_SCHEDULE) and k != _SCHEDULE + "name"}
    given |= {point_key(dotted(k)): (f"{where}.grid.{k}", list(v)) for k, v in grid.items()
              if dotted(k).startswith(_SCHEDULE)}
    which = (f"its schedule {names[0]}" if len(names) == 1 else
             f"one of its schedules {', '.join(names)}")
    has = ", ".join(sorted(own)) or "none: s(r) = 1"
    for key, (at, value) in sorted(given.items()):
        require(key in own, at, f"a parameter of {which} ({has}); {key} needs a schedule that has "
                "it: set schedule", value)


def _restarts(where: str, method: str, grid: Mapping[str, Sequence[Any]], fixed: Mapping[str, Any],
              written: Mapping[str, str], rounds: int) -> None:
    """T: searched (or fixed) by a diff2 method, at most its R; none for the others (T = 1)."""
    key = "training.restart_every"
    shown = f"{where}.{written[key]}" if key in fixed else f"{where}.grid.restart_every"
    values = list(grid.get(point_key(key), [fixed[key]] if fixed.get(key) is not None else []))
    if method == "diff2":
        require(bool(values), shown, "a list of T values for a diff2 method", None)
    else:
        require(not values, shown, f"no T for method {method} (T = 1)", values)
    require(all(v <= rounds and int(v) == v for v in values), shown,
            f"integers T <= rounds = {rounds}", values)
