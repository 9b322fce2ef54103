"""The DIFF2 estimator (Algorithm 1) as a pure state transition on the server.

One round r, as data::

    plan  = plan_round(state, mechanism)          # restart or difference, radius, iterates
    mean  = (1/P) * sum_p ClippedMean_p(...)      # computed by the workers (clients)
    state, release = server_step(state, mechanism, routine, mean)

A restart round ((r-1) mod T == 0) releases ṽ_r = mean + N(0, σ1² C1² I); a difference round
releases ṽ_r = ṽ_{r-1} + mean + N(0, σ2² C_{2,r}² I) with C_{2,r} = C2 ||x_{r-1} - x_{r-2}||.
Then x_r = Routine(x_{r-1}, ṽ_r). T = 1 is DP-GD; σ = 0 with C = inf is plain GD: the three
methods share this one code path.

Noise for round r is drawn from a generator derived from (noise key, r) only, so the state
carries no mutable RNG: the same state and inputs give the same output, a state can be
checkpointed as plain data, and with no seed configured the key comes from the OS's secure
entropy source.

References:
    Murata & Suzuki (2023), Algorithm 1 (DIFF2) and Algorithm 3 (GD-Routine).
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .clipping import RADIUS_FLOOR, radius_norm
from .routines import Routine

__all__ = [
    "Diverged",
    "Mechanism",
    "RoundPlan",
    "Diff2State",
    "Release",
    "is_restart",
    "difference_radius",
    "advance",
    "estimate",
    "init_state",
    "plan_round",
    "round_noise",
    "round_normals",
    "round_scale",
    "server_step",
]

# Domain tag mixed into the noise generator's seed, so that a seed shared with other
# consumers (data split, initialisation) never yields the same stream.
_NOISE_DOMAIN = 0xD1FF2


class Diverged(RuntimeError):
    """The optimisation diverged: a training failure, not a privacy one.

    ``check`` names what is no longer finite: ``iterate`` (x_r overflowed in the update; the
    round was recorded), ``radius`` (a difference round's radius or noise std, from released
    iterates that ran away) or ``gradients`` (a worker reports that its per-sample gradients
    overflow at a finite iterate). For ``radius`` and ``gradients`` the round releases nothing.
    """

    def __init__(self, round: int, check: str, detail: str, client: str | None = None) -> None:
        self.round, self.check, self.client = round, check, client
        who = f" from {client}" if client else ""
        prefix = f"Round {round}:" if check == "iterate" else (f"Round {round} released nothing: "
                                                               f"check '{check}' failed{who}:")
        super().__init__(f"{prefix} {detail}")


#: What a diverging run should change, for the messages of :class:`Diverged`.
DIVERGENCE_ADVICE = (
    "Lower training.learning_rate (or training.restart_every: noise enlarges ||x_r - x_(r-1)|| "
                     "and so the next noise).")


def _frozen(a: np.ndarray) -> np.ndarray:
    out = np.array(a, dtype=np.float64, copy=True)
    out.flags.writeable = False
    return out


@dataclass(frozen=True)
class Mechanism:
    """The mechanism's parameters: T, C1, C2, σ1, σ2 (σ = noise std per unit radius).

    ``clip_* = inf`` disables clipping; ``sigma_* = 0`` disables noise. Noise without
    clipping has unbounded sensitivity and is refused.
    """

    restart_every: int
    clip_restart: float
    clip_diff: float
    sigma_restart: float
    sigma_diff: float

    def __post_init__(self) -> None:
        if not isinstance(self.restart_every, int) or isinstance(self.restart_every,
                                                                 bool) or self.restart_every < 1:
            raise ValueError(
                f"`restart_every` (T) must be an integer >= 1. Found {self.restart_every!r}.")
        for name in ("clip_restart", "clip_diff"):
            value = getattr(self, name)
            if math.isnan(value) or value <= 0:
                raise ValueError(f"`{name}` must be > 0 (inf for no clipping). Found {value}.")
        for name, clip in (("sigma_restart", self.clip_restart), ("sigma_diff", self.clip_diff)):
            sigma = getattr(self, name)
            if not (math.isfinite(sigma) and sigma >= 0):
                raise ValueError(f"`{name}` must be a finite number >= 0. Found {sigma}.")
            if sigma > 0 and math.isinf(clip):
                raise ValueError(
                    f"`{name}` = {sigma} needs a finite clipping radius: without clipping the "
                    "sensitivity is unbounded and no noise makes the round private."
                )


@dataclass(frozen=True)
class RoundPlan:
    """What round ``round`` needs from the workers, derived from released values only."""

    round: int
    restart: bool
    radius: float
    noise_std: float
    x_current: np.ndarray
    x_previous: np.ndarray | None

    @property
    def kind(self) -> str:
        """The round's kind as the run's records name it: "restart" or "difference"."""
        return "restart" if self.restart else "difference"


@dataclass(frozen=True)
class Diff2State:
    """Server state after ``round`` released rounds: x_r, x_{r-1}, ṽ_r, routine state, noise key.

    ``noise_key`` is secret (it determines all noise); it must never be released.
    """

    round: int
    x: np.ndarray
    x_prev: np.ndarray | None
    v: np.ndarray | None
    routine_state: Any
    noise_key: int = field(repr=False)
    noise_seeded: bool


@dataclass(frozen=True)
class Release:
    """What round r releases: ṽ_r and x_r (plus the plan it followed)."""

    plan: RoundPlan
    v: np.ndarray
    x: np.ndarray


def is_restart(r: int, restart_every: int) -> bool:
    """Round r (1-based) restarts the estimator iff (r - 1) mod T == 0 (Algorithm 1)."""
    if r < 1:
        raise ValueError(f"Rounds are numbered from 1. Found {r}.")
    return (r - 1) % restart_every == 0


def difference_radius(clip_diff: float, x_current: np.ndarray, x_previous: np.ndarray) -> float:
    """C_{2,r} = C2 * ||x_{r-1} - x_{r-2}||; inf when C2 = inf (no clipping), 0 when x_{r-1} =
    x_{r-2}.

    The norm is :func:`~diff2_flwr.core.clipping.radius_norm` (no overflow of the squares); the
    result is still inf when the product overflows, which :func:`round_scale` refuses.
    """
    if math.isinf(clip_diff):
        return math.inf
    with np.errstate(over="ignore"):  # x_{r-1} - x_{r-2} may overflow: inf, refused by round_scale
        step = x_current - x_previous
    return float(clip_diff * radius_norm(step))


def round_scale(
    r: int, restart: bool, clip: float, sigma: float, x_current: np.ndarray,
    x_previous: np.ndarray | None
) -> tuple[float, float]:
    """Round r's clipping radius and noise std (σ · radius), or :class:`Diverged` ('radius').

    A round with a finite clipping parameter needs a finite radius and a finite noise std: an
    infinite radius would skip the clipping and the norm check, and an infinite std releases
    nothing meaningful; such a round releases nothing.
    """
    radius = clip if restart else difference_radius(clip, x_current, x_previous)
    noise_std = 0.0 if sigma == 0 or radius == 0 else sigma * radius
    if not math.isinf(clip) and not (math.isfinite(radius) and math.isfinite(noise_std)):
        what = "restart round's" if restart else "difference round's"
        step = "" if restart else f" (C2 = {clip:g}, ||x_(r-1) - x_(r-2)|| = {radius / clip:.3g})"
        raise Diverged(r, "radius",
                       f"the {what} clipping radius {radius:.3g} or noise std {noise_std:.3g} is "
                       f"not finite{step}; a private round needs both finite, so the iterates "
                       f"have run away. "
                       + DIVERGENCE_ADVICE)
    if 0 < radius < RADIUS_FLOOR:
        what = "restart round's" if restart else "difference round's"
        raise Diverged(r, "radius",
                       f"the {what} clipping radius {radius:.3g} is below {RADIUS_FLOOR:.3g}: "
                       "clipped values that small round by more than their size (subnormal "
                       "floats), so no sensitivity bound holds; the round releases nothing. "
                       "Raise clip_restart / clip_diff.")
    return radius, noise_std


def init_state(x0: np.ndarray, routine: Routine, seed: int | None = None) -> Diff2State:
    """Initial state at x_0. With ``seed=None`` the noise key comes from OS entropy."""
    x0 = np.asarray(x0)
    if x0.ndim != 1 or not np.all(np.isfinite(x0)):
        raise ValueError(f"`x0` must be a finite flat vector. Found shape {x0.shape}.")
    if seed is None:
        key, seeded = secrets.randbits(128), False
    else:
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise ValueError(f"`seed` must be an integer >= 0 or None. Found {seed!r}.")
        key, seeded = seed, True
    return Diff2State(
        round=0, x=_frozen(x0), x_prev=None, v=None,
        routine_state=routine.init(x0), noise_key=key, noise_seeded=seeded,
    )


def plan_round(state: Diff2State, mechanism: Mechanism) -> RoundPlan:
    """Plan round r = state.round + 1: its kind, radius and noise std, and the iterates to ship."""
    r = state.round + 1
    if is_restart(r, mechanism.restart_every):
        clip, sigma, x_previous = mechanism.clip_restart, mechanism.sigma_restart, None
    else:
        assert state.x_prev is not None and state.v is not None  # r >= 2 here
        clip, sigma, x_previous = mechanism.clip_diff, mechanism.sigma_diff, state.x_prev
    radius, noise_std = round_scale(r, x_previous is None, clip, sigma, state.x, x_previous)
    return RoundPlan(
        round=r, restart=x_previous is None, radius=radius, noise_std=noise_std,
        x_current=state.x, x_previous=x_previous,
    )


def round_noise(noise_key: int, r: int, dim: int, std: float) -> np.ndarray:
    """ξ_r ~ N(0, std² I_dim) from a generator derived from (noise_key, r) alone:
    :func:`round_normals` times ``std``.

    ``std = 0`` returns exact zeros (no sampling).
    """
    if std == 0:
        return np.zeros(dim)
    return round_normals(noise_key, r, dim) * std


def round_normals(noise_key: int, r: int, dim: int) -> np.ndarray:
    """The standard normals [dim] behind round r's noise: a fresh PCG64 from the SeedSequence of
    (noise_key, (domain tag, r)). ``round_noise(key, r, dim, std)`` is this times ``std``, bit for
    bit (the batched engine draws these ahead and multiplies when it knows the std)."""
    seq = np.random.SeedSequence(entropy=noise_key, spawn_key=(_NOISE_DOMAIN, r))
    return np.random.Generator(np.random.PCG64(seq)).standard_normal(dim)


def estimate(state: Diff2State, mechanism: Mechanism, mean: np.ndarray) -> tuple[RoundPlan,
                                                                                 np.ndarray]:
    """Round r's plan and released estimator ṽ_r from the workers' averaged clipped means ``mean``.

    ``mean`` is (1/P) Σ_p ClippedMean_p: of gradients on restart rounds, of gradient
    differences on difference rounds.

    References:
        Murata & Suzuki (2023), Algorithm 1, server lines.
    """
    plan = plan_round(state, mechanism)
    mean = np.asarray(mean)
    if mean.shape != state.x.shape:
        raise ValueError(
            f"The averaged contribution must have shape {state.x.shape}. Found {mean.shape}.")
    if not np.all(np.isfinite(mean)):
        raise ValueError(
            f"Round {plan.round}: the averaged contribution is not finite; nothing released.")
    xi = round_noise(state.noise_key, plan.round, mean.size, plan.noise_std)
    v = mean + xi if plan.restart else state.v + mean + xi
    return plan, v


def advance(state: Diff2State, plan: RoundPlan, v: np.ndarray, x: np.ndarray,
            routine_state: Any) -> tuple[Diff2State, Release]:
    """The state after round r released ṽ_r = ``v`` and x_r = ``x``."""
    new_state = Diff2State(
        round=plan.round, x=_frozen(x), x_prev=state.x, v=_frozen(v),
        routine_state=routine_state, noise_key=state.noise_key, noise_seeded=state.noise_seeded,
    )
    return new_state, Release(plan=plan, v=new_state.v, x=new_state.x)


def server_step(
    state: Diff2State, mechanism: Mechanism, routine: Routine, mean: np.ndarray
) -> tuple[Diff2State, Release]:
    """Release round r from the workers' averaged clipped means ``mean``: ṽ_r, then x_r =
    Routine(x_{r-1}, ṽ_r).

    ``routine`` is round r's: with a step-size schedule, the run's routine with learning rate
    η·s(r) (:func:`~diff2_flwr.core.schedules.routine_at`), its state carried over as is.

    References:
        Murata & Suzuki (2023), Algorithm 1, server lines.
    """
    plan, v = estimate(state, mechanism, mean)
    x, routine_state = routine.update(state.x, v, state.routine_state)
    return advance(state, plan, v, x, routine_state)
