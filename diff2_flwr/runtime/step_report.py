"""Whether the step feeds the noise (radius feedback): said before a run (the gain g) and during it
(the difference rounds' radius, watched round by round).

A difference round clips at, and adds noise in proportion to, its radius C2·‖x_(r-1) - x_(r-2)‖:
the noise ξ_r has expected norm σ2·χ̄_d·C2·‖x_(r-1) - x_(r-2)‖ (σ2 per unit radius, χ̄_d ≈ √d,
:func:`~diff2_flwr.core.privacy.expected_noise_norm`). With the GD routine the step x_r - x_(r-1) =
-η ṽ_r carries η ξ_r, so the noise alone lengthens the next step by

    g = η · C2 · σ2 · χ̄_d     (the previous step's length → the noise's share of the next),

and, the noise being independent of the step, ‖x_r - x_(r-1)‖ grows by about √(1 + g²) per
difference round (√((1 - ηλ)² + g²) along a direction of curvature λ): above g ≈ 1 the radius grows
geometrically until the next restart round sets it back to C2·η·‖ṽ_restart‖, and then grows again
(measured on scikit-learn's wine, g from 0.44 to 4.4: within 10 % of √(1 + g²) per step). The loss
need not come back: the iterate has wandered by the sum of those steps. This is not the
noise drowning the signal (:mod:`~diff2_flwr.runtime.noise_report`: noise long against the radius,
whatever the step); it is the step too large for its own noise, and lowering η or C2 (or restarting
more often) fixes it at no privacy cost. (Without noise the same loop is plain GD's instability,
|1 - ηλ| > 1: the same fix.)

Before the run, :func:`step_gain` computes g from the calibration (GD only: another routine scales
the step otherwise) and :data:`GAIN_LIMIT` warns. During it, :func:`radius_feedback` watches the
released radii, whatever the routine or the noise: :data:`FEEDBACK_STEPS` growth steps in a row
(each a difference round after a difference round; a restart between two steps does not break the
streak, since the loop that comes back after every restart is the one to catch) of at least
:data:`FEEDBACK_GROWTH`× each. Healthy runs stay far below: the paper's California Housing setting
(400 rounds, η from 0.25 to 2, T = 6 and 20; measured) never grows more than 1.42× in one step, nor
1.23× in two steps in a row. The radius is computed from released iterates only, so watching it
costs no privacy.

Messages name each setting as the caller gave it (:func:`~diff2_flwr.runtime.spec.key_namer`):
``learning_rate=`` on the Python API's path, ``training.learning_rate`` on the YAML path.

References:
    Murata & Suzuki (2023), Algorithm 1 (C_{2,r} = C_2·‖x_{r-1} - x_{r-2}‖) and Algorithm 3 (the GD
    routine); DIFF2.md, "With large T and a large learning rate DIFF2 diverges: noise enters ṽ,
    enlarges ‖x_{r−1} − x_{r−2}‖, which enlarges the next noise".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from ..core.privacy import Calibration, expected_noise_norm
from ..core.routines import GD, Routine
from .config_experiment import ExperimentConfig
from .spec import key_namer

__all__ = ["FEEDBACK_GROWTH", "FEEDBACK_STEPS", "WATCH_ROWS", "GAIN_LIMIT", "gain_target",
           "Feedback", "StepGain", "Names", "names_of", "given", "radius_steps", "radius_feedback",
           "step_gain", "gain_warning", "feedback_warning", "feedback_cause"]

#: A step of the radius (a difference round's over the difference round before it) at least this
#: large counts towards feedback: √(1 + g²) ≥ 1.5 for g ≥ 1.12.
FEEDBACK_GROWTH = 1.5
#: Feedback: this many such steps in a row (≥ 1.5³ = 3.4× in all).
FEEDBACK_STEPS = 3
#: The rows a streak can span (T = 3: one step per restart period of three rows), so the tail to
#: watch after each round.
WATCH_ROWS = 3 * FEEDBACK_STEPS + 1
#: Warn before the run when the gain g exceeds this: the noise alone then lengthens each step.
GAIN_LIMIT = 1.0

#: How the caller names a dotted key (``key_namer``): ``"learning_rate="`` or the key itself.
Names = Callable[[str], str]


def names_of(settings: ExperimentConfig | None) -> Names:
    """The naming of the run whose settings are ``settings``: its Python API's arguments when it
    came from one (:class:`~diff2_flwr.runtime.spec.ArgumentSource`), else the experiment's keys
    (also for a server assembled by hand, ``settings`` None)."""
    return key_namer(ExperimentConfig, None if settings is None else settings.source)


def given(names: Names, key: str, value: float) -> str:
    """``key`` at ``value`` as the caller writes it: ``learning_rate=0.5`` or
    ``training.learning_rate = 0.5``."""
    name = names(key)
    return f"{name}{value:.3g}" if name.endswith("=") else f"{name} = {value:.3g}"


# ---------------------------------------------------------------- during the run
@dataclass(frozen=True)
class Feedback:
    """Radius feedback found: at difference round ``round`` the radius had grown ``growth`` (one
    factor per step, oldest first) in :data:`FEEDBACK_STEPS` steps in a row, to ``radius``."""

    round: int
    growth: tuple[float, ...]
    radius: float

    @property
    def per_round(self) -> float:
        """The geometric mean of the steps: the radius's growth per difference round."""
        return math.exp(sum(map(math.log, self.growth)) / len(self.growth))

    def as_dict(self) -> dict[str, Any]:
        """The summary's ``radius_feedback`` detection: round, steps, radius and the rule."""
        return {"detected_at": self.round, "growth": list(self.growth), "radius": self.radius,
                "rule": f"{FEEDBACK_STEPS} steps in a row of >= {FEEDBACK_GROWTH:g}x"}


def radius_steps(rows: Sequence[Mapping[str, Any]]) -> list[tuple[int, float]]:
    """(round r, radius_r / radius_(r-1)) for each difference round r that follows a difference
    round, both radii finite and positive, in order (the rows of a run: ``kind``, ``radius``)."""
    out: list[tuple[int, float]] = []
    for before, row in zip(rows, rows[1:]):
        if before.get("kind") != "difference" or row.get("kind") != "difference":
            continue
        a, b = before.get("radius"), row.get("radius")
        if _positive(a) and _positive(b):
            out.append((int(row["round"]), float(b) / float(a)))
    return out


def _positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def radius_feedback(rows: Sequence[Mapping[str, Any]]) -> Feedback | None:
    """The first radius feedback in ``rows``: :data:`FEEDBACK_STEPS` radius steps in a row (see
    :func:`radius_steps`; restart rounds between them do not break the streak) each at least
    :data:`FEEDBACK_GROWTH`; None if there is none.

    Args:
        rows: a run's released rows in order (``round``, ``kind``, ``radius``); a tail of them is
            enough to watch the latest round (the last :data:`WATCH_ROWS`).
    """
    radius = {int(r["round"]): r.get("radius") for r in rows if "round" in r}
    streak: list[float] = []
    for r, step in radius_steps(rows):
        streak = [*streak, step] if step >= FEEDBACK_GROWTH else []
        if len(streak) >= FEEDBACK_STEPS:
            return Feedback(r, tuple(streak[-FEEDBACK_STEPS:]), float(radius[r]))
    return None


# ---------------------------------------------------------------- before the run
def gain_target(restart_every: int) -> float:
    """The gain the advice aims at, g ≤ min(1/2, 1/√T): at most √(1 + 1/4) = 1.12× per difference
    round, and at most (1 + 1/T)^((T-2)/2) < e^(1/2) ≈ 1.65× over a restart period of any length
    T.

    Args:
        restart_every: T.
    """
    return min(0.5, 1.0 / math.sqrt(restart_every))


@dataclass(frozen=True)
class StepGain:
    """g = η·C2·σ2·χ̄_d of a GD run, with what it was computed from."""

    gain: float
    learning_rate: float
    clip_diff: float
    sigma2: float
    dim: int
    restart_every: int

    @property
    def per_round(self) -> float:
        """The radius's expected growth per difference round from the noise alone, √(1 + g²)."""
        return math.hypot(1.0, self.gain)

    @property
    def per_period(self) -> float:
        """... over a restart period (T - 2 steps between its T - 1 difference rounds)."""
        try:
            return self.per_round ** max(self.restart_every - 2, 0)
        except OverflowError:  # an absurd step (η = 1e308): the growth is beyond any float
            return math.inf

    @property
    def target(self) -> float:
        """The gain to aim at (:func:`gain_target`)."""
        return gain_target(self.restart_every)

    def as_dict(self) -> dict[str, Any]:
        """The summary's ``radius_feedback`` prediction (with :data:`GAIN_LIMIT` and the target)."""
        return {"gain": self.gain, "per_round": self.per_round, "limit": GAIN_LIMIT,
                "target": self.target}


def step_gain(calibration: Calibration | None, routine: Routine, clip_diff: float, dim: int,
              local: bool = False) -> StepGain | None:
    """g of a run with these settings; None when there is nothing to predict: no calibration or no
    difference rounds, another routine than GD, or a local routine (its steps move x_r too).

    Args:
        calibration: the run's noise (σ2 per unit radius), or None without privacy.
        routine: the update rule (its ``learning_rate`` is η).
        clip_diff: C2.
        dim: d, the model's parameters.
        local: whether the run has a local routine.
    """
    if (calibration is None or not calibration.difference_rounds or calibration.sigma2 is None
            or not isinstance(routine, GD) or local):
        return None
    eta = routine.learning_rate
    gain = eta * clip_diff * expected_noise_norm(calibration.sigma2, dim)
    return StepGain(gain, eta, clip_diff, calibration.sigma2, dim, calibration.restart_every)


def _fix(names: Names, eta: float, c2: float, gain: StepGain | None) -> str:
    """What to do about radius feedback: lower η or C2 (to the values that bring g to its target
    when g is known), restart more often, or a larger ε."""
    if gain is not None and gain.gain > gain.target:
        scale = gain.target / gain.gain
        lower = (f"set {given(names, 'training.learning_rate', eta * scale)} or lower, or "
                 f"{given(names, 'training.clip_diff', c2 * scale)} or lower (either brings g to "
                 f"{gain.target:.3g})")
    else:
        lower = (f"lower {names('training.learning_rate')} (now {eta:.3g}) or "
                 f"{names('training.clip_diff')} (now {c2:.3g})")
    return (f"{lower}; or restart more often (a smaller {names('training.restart_every')}: each "
            f"restart sets the radius back); a larger {names('privacy.epsilon')} lowers σ2 and so "
            f"g too")


def gain_warning(gain: StepGain, names: Names = str) -> str | None:
    """One line before the run when g exceeds :data:`GAIN_LIMIT`, else None."""
    if gain.gain <= GAIN_LIMIT:
        return None
    return (
        f"the step will feed the noise (radius feedback): with "
        f"{given(names, 'training.learning_rate', gain.learning_rate)} and "
        f"{given(names, 'training.clip_diff', gain.clip_diff)}, a difference round's noise moves "
        f"x by g = η·C2·σ2·χ̄_d = {gain.gain:.3g}× the step before it (σ2 = {gain.sigma2:.3g} per "
        f"coordinate, d = {gain.dim} parameters), so the radius C2·‖x_(r-1) - x_(r-2)‖ is expected "
        f"to grow ≈ √(1 + g²) = {gain.per_round:.3g}× per difference round, {gain.per_period:.3g}× "
        f"over a restart period of {given(names, 'training.restart_every', gain.restart_every)}; "
        f"above g = {GAIN_LIMIT:g} the noise, not the gradient, sets each step (the radius is "
        f"watched each round). To fix: {_fix(names, gain.learning_rate, gain.clip_diff, gain)}.")


def feedback_cause(feedback: Feedback) -> str:
    """What was seen, in one clause: the steps, their round and the radius they reached."""
    steps = ", ".join(f"{s:.3g}×" for s in feedback.growth)
    return (f"the difference rounds' radius C2·‖x_(r-1) - x_(r-2)‖ grew {steps} per round in the "
            f"{len(feedback.growth)} steps to round {feedback.round}, to {feedback.radius:.4g} "
            f"(feedback: {FEEDBACK_STEPS} steps in a row of at least {FEEDBACK_GROWTH:g}× each)")


def feedback_warning(feedback: Feedback, *, eta: float, clip_diff: float,
                     gain: StepGain | None = None, names: Names = str) -> str:
    """The line said when :func:`radius_feedback` finds feedback during the run.

    Args:
        feedback: what was found.
        eta: the routine's learning rate η.
        clip_diff: C2.
        gain: the pre-flight g (GD runs), to explain the growth with; None: not known.
        names: how the caller names the settings (:func:`names_of`).
    """
    why = (f" A difference round's noise is proportional to the step before it, and the step "
           f"carries it into the next radius: g = η·C2·σ2·χ̄_d = {gain.gain:.3g} predicts "
           f"≈ {gain.per_round:.3g}× per round.") if gain is not None else (
        " A difference round's noise (and its clipped gradient difference) is proportional to the "
        "step before it, and the step carries both into the next radius.")
    return (f"radius feedback, the step feeds the noise: {feedback_cause(feedback)}.{why} The step "
            f"is too large for its own noise (restart rounds set the radius back, and it grows "
            f"again): whatever the noise's level, a smaller step fixes this at no privacy cost. To "
            f"fix: {_fix(names, eta, clip_diff, gain)}.")
