"""Step-size schedules: the learning rate of round r is η_r = η·s(r), r = 1..R.

A schedule is a frozen dataclass with one pure method, ``factor(r, rounds) -> s(r)``: the factor of
round r of a run of ``rounds`` rounds (R). Round r's server step is the run's routine with learning
rate η·s(r) (:func:`routine_at`): x_r = Routine_{η s(r)}(x_{r-1}, ṽ_r). The routine's state (a
momentum buffer, Adam's moments and step count) carries over from round to round as without a
schedule; only the learning rate changes.

    constant       s(r) = 1
    step           s(r) = γ^⌊(r-1)/k⌋                            (γ = ``decay``, k = ``every``)
    cosine         s(r) = f + (1 - f)·½(1 + cos(π (r-1)/R))     (f = ``floor``)
    inverse_sqrt   s(r) = 1/√(1 + (r-1)/k)                       (k = ``every``; k = 1: 1/√r)

Every schedule starts at s(1) = 1 (round 1 steps with η) and never increases. A schedule reads
the round index and R only, both public: the step is post-processing of the released ṽ_r and costs
no privacy. For DIFF2 the difference rounds' radius C2‖x_{r-1} - x_{r-2}‖ follows the smaller steps
by itself.

The registry :data:`SCHEDULES` maps a name to its class; :func:`schedule_parameters` lists a
schedule's parameters with their defaults (:data:`REQUIRED` for one without), :func:`make_schedule`
builds one by name. Adding a schedule is adding a class here (and its parameters'
fields to ``training.schedule``: :class:`~diff2_flwr.runtime.config_training.ScheduleConfig`).

References:
    Murata & Suzuki (2023), Algorithm 1 line 17 (x_r = Routine(x_{r-1}, ṽ_r): any post-processing
    of ṽ_r); Loshchilov & Hutter (2017), "SGDR: Stochastic gradient descent with warm restarts",
    eq. (5) (cosine annealing, one period, η_min = f·η); PyTorch ``torch.optim.lr_scheduler.StepLR``
    (γ = 0.1 by default) and ``CosineAnnealingLR``; Zinkevich (2003), Theorem 1 (η_t = t^(-1/2)).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import numpy as np

from .routines import Routine

__all__ = [
    "Schedule",
    "ScheduleError",
    "Constant",
    "StepDecay",
    "Cosine",
    "InverseSqrt",
    "CONSTANT",
    "REQUIRED",
    "SCHEDULES",
    "make_schedule",
    "schedule_parameters",
    "describe_schedule",
    "factors",
    "routine_at",
]


class ScheduleError(ValueError):
    """An invalid schedule parameter; ``key``, ``expected`` and ``found`` hold the parts of the
    message."""

    def __init__(self, key: str, expected: str, found: Any) -> None:
        super().__init__(f"`{key}` must be {expected}. Found {found!r}.")
        self.key, self.expected, self.found = key, expected, found


class Schedule(Protocol):
    """s(r), the factor of round r's learning rate η·s(r)."""

    name: ClassVar[str]

    def factor(self, r: int, rounds: int) -> float:
        """s(r) for round ``r`` of a run of ``rounds`` rounds (1 <= r <= rounds)."""
        ...


#: The default of a parameter that has none (step's ``every``): it must be given.
REQUIRED: Any = dataclasses.MISSING


def _check_round(r: Any, rounds: Any) -> None:
    if not _is_int(rounds) or rounds < 1:
        raise ScheduleError("rounds", "an integer >= 1", rounds)
    if not _is_int(r) or not 1 <= r <= rounds:
        raise ScheduleError("r", f"a round in 1..{rounds}", r)


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_every(value: Any) -> None:
    if not _is_int(value) or value < 1:
        raise ScheduleError("every", "an integer >= 1 (rounds)", value)


@dataclass(frozen=True)
class Constant:
    """s(r) = 1: every round steps with η (the default; no schedule)."""

    name: ClassVar[str] = "constant"

    def factor(self, r: int, rounds: int) -> float:
        """1 for every round."""
        _check_round(r, rounds)
        return 1.0


@dataclass(frozen=True)
class StepDecay:
    """Step decay: s(r) = γ^⌊(r-1)/k⌋, the step multiplied by γ every k rounds.

    References:
        PyTorch ``torch.optim.lr_scheduler.StepLR`` (``step_size`` = k, ``gamma`` = γ, 0.1 by
        default), counted in rounds from round 1.
    """

    every: int = REQUIRED
    decay: float = 0.1
    name: ClassVar[str] = "step"

    def __post_init__(self) -> None:
        _check_every(self.every)
        if not _is_number(self.decay) or not 0 < self.decay <= 1:
            raise ScheduleError("decay", "a number in (0, 1]", self.decay)

    def factor(self, r: int, rounds: int) -> float:
        """γ^⌊(r-1)/k⌋."""
        _check_round(r, rounds)
        return float(self.decay ** ((r - 1) // self.every))


@dataclass(frozen=True)
class Cosine:
    """Cosine annealing over the run: s(r) = f + (1 - f)·½(1 + cos(π (r-1)/R)), from 1 at round 1
    towards the floor f (reached at r = R + 1, one round after the last).

    Computed as 1 - (1 - f)·½(1 - cos(π (r-1)/R)), the same value, so that s(1) = 1 exactly.

    References:
        Loshchilov & Hutter (2017), eq. (5), one period of T_i = R rounds, η_min = f·η; PyTorch
        ``torch.optim.lr_scheduler.CosineAnnealingLR`` (``T_max`` = R, ``eta_min`` = f·η).
    """

    floor: float = 0.0
    name: ClassVar[str] = "cosine"

    def __post_init__(self) -> None:
        if not _is_number(self.floor) or not 0 <= self.floor < 1:
            raise ScheduleError("floor", "a number in [0, 1)", self.floor)

    def factor(self, r: int, rounds: int) -> float:
        """1 - (1 - f)·½(1 - cos(π (r-1)/R))."""
        _check_round(r, rounds)
        return 1.0 - (1.0 - self.floor) * 0.5 * (1.0 - math.cos(math.pi * (r - 1) / rounds))


@dataclass(frozen=True)
class InverseSqrt:
    """Inverse square root decay: s(r) = 1/√(1 + (r-1)/k); k = 1 gives s(r) = 1/√r.

    References:
        Zinkevich (2003), "Online convex programming and generalized infinitesimal gradient
        ascent", Theorem 1 (the step η_t = t^(-1/2)), here stretched over k rounds.
    """

    every: int = 1
    name: ClassVar[str] = "inverse_sqrt"

    def __post_init__(self) -> None:
        _check_every(self.every)

    def factor(self, r: int, rounds: int) -> float:
        """1/√(1 + (r-1)/k)."""
        _check_round(r, rounds)
        return 1.0 / math.sqrt(1.0 + (r - 1) / self.every)


#: The default schedule.
CONSTANT = Constant()

#: Every schedule by name. Each is a frozen dataclass whose fields are its parameters.
SCHEDULES: dict[str, type] = {cls.name: cls for cls in (Constant, StepDecay, Cosine, InverseSqrt)}


def _schedule_class(name: Any) -> type:
    try:
        return SCHEDULES[name]
    except (KeyError, TypeError):
        raise ScheduleError("name", f"one of {', '.join(repr(n) for n in SCHEDULES)}",
                            name) from None


def schedule_parameters(name: str) -> dict[str, Any]:
    """The parameters of schedule ``name`` with their defaults (:data:`REQUIRED`: none)."""
    return {f.name: f.default for f in dataclasses.fields(_schedule_class(name))}


def make_schedule(name: str, **params: Any) -> Schedule:
    """Build schedule ``name`` (see :data:`SCHEDULES`) with its parameters.

    A parameter the schedule does not have is refused, naming the ones it has; one it requires and
    is not given is refused, naming it.
    """
    allowed = schedule_parameters(name)
    for key, value in params.items():
        if key not in allowed:
            has = ", ".join(allowed) or "none"
            raise ScheduleError(key, f"absent for schedule {name!r} (its parameters: {has})", value)
    for key, default in allowed.items():
        if default is REQUIRED and key not in params:
            raise ScheduleError(key, f"a value for schedule {name!r} (it has no default)", None)
    return SCHEDULES[name](**params)


def describe_schedule(schedule: Schedule) -> dict[str, Any]:
    """``{"name": ..., <its parameters>}``: what identifies a schedule."""
    return {"name": schedule.name, **dataclasses.asdict(schedule)}  # type: ignore[call-overload]


def factors(schedule: Schedule, rounds: int) -> np.ndarray:
    """[s(1), ..., s(R)] of ``schedule`` over a run of ``rounds`` rounds."""
    return np.array([schedule.factor(r, rounds) for r in range(1, rounds + 1)])


def routine_at(routine: Routine, schedule: Schedule, r: int, rounds: int) -> Routine:
    """Round r's routine: ``routine`` with learning rate η·s(r) (its other parameters, and the state
    it is given, unchanged); ``routine`` itself when s(r) = 1, so that the constant schedule takes
    the very steps it took before schedules existed.

    References:
        Murata & Suzuki (2023), Algorithm 1 line 17, with the routine's η replaced by η·s(r).
    """
    s = schedule.factor(r, rounds)
    if s == 1.0:
        return routine
    return dataclasses.replace(routine, learning_rate=routine.learning_rate * s)  # type: ignore[type-var]
