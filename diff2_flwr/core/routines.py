"""Routines: how an iterate is updated from the released estimator ṽ_r.

A routine is a pair of pure functions in the style of optax: ``init(x0) -> state`` and
``update(x, v, state) -> (x_new, state)``, with ``state`` an immutable value (``None`` or a
``NamedTuple`` of read-only float64 arrays and scalars). The routines here only read the released
ṽ_r and the released iterate x_{r-1}: they are post-processing of an (ε, δ)-DP output and cost no
privacy (``post_processing = True``). A routine that touches private data (a local phase on a
worker) is not post-processing and must say so (``post_processing = False``) and be accounted for.

Every update here is elementwise, so the same ``update`` applied to a stack of runs ``[K, d]``
(the batched sweep engine) gives, row by row, exactly what it gives one run ``[d]``.

The registry :data:`ROUTINES` maps a name to a frozen dataclass whose fields are the routine's
parameters (``learning_rate`` plus its own, with defaults); :func:`routine_parameters` lists the
latter, :func:`make_routine` builds one by name. Adding a routine is adding a class here.

References:
    Murata & Suzuki (2023), Algorithm 1 line 17 ("a general sub-routine") and Algorithm 3
    (GD-Routine): x_r = x_{r-1} - η ṽ_r; its conclusion ("accelerated gradient methods, adaptive
    gradient methods and so on can be incorporated into DIFF2 framework").
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Protocol

import numpy as np

__all__ = [
    "Routine",
    "RoutineError",
    "GD",
    "Momentum",
    "MomentumState",
    "Nesterov",
    "Adam",
    "AdamState",
    "AdamW",
    "ROUTINES",
    "make_routine",
    "routine_parameters",
    "describe_routine",
]


class RoutineError(ValueError):
    """An invalid routine parameter; ``key``, ``expected`` and ``found`` hold the parts of the
    message."""

    def __init__(self, key: str, expected: str, found: Any) -> None:
        super().__init__(f"`{key}` must be {expected}. Found {found!r}.")
        self.key, self.expected, self.found = key, expected, found


class Routine(Protocol):
    """Update rule x_r = Routine(x_{r-1}, ṽ_r)."""

    name: ClassVar[str]
    post_processing: ClassVar[bool]
    learning_rate: float

    def init(self, x0: np.ndarray) -> Any:
        """Return the routine's initial state for iterate ``x0``."""
        ...

    def update(self, x: np.ndarray, v: np.ndarray, state: Any) -> tuple[np.ndarray, Any]:
        """Return the next iterate and the next routine state."""
        ...


def _frozen(a: np.ndarray) -> np.ndarray:
    out = np.array(a, dtype=np.float64, copy=True)
    out.flags.writeable = False
    return out


def _check_learning_rate(lr: Any) -> None:
    if isinstance(lr, bool) or not isinstance(lr, (int,
                                                   float)) or not (math.isfinite(lr) and lr > 0):
        raise RoutineError("learning_rate", "a finite number > 0", lr)


def _check_unit(key: str, value: Any) -> None:
    """A decay rate in [0, 1) (1 would never forget, and Adam's bias correction 1 - β^t would be
    0)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 <= value < 1):
        raise RoutineError(key, "a number in [0, 1)", value)


def _check_positive(key: str, value: Any, zero: bool) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not zero):
        raise RoutineError(key, "a finite number >= 0" if zero else "a finite number > 0", value)


@dataclass(frozen=True)
class GD:
    """Plain gradient step with a fixed learning rate: x_r = x_{r-1} - η ṽ_r.

    References:
        Murata & Suzuki (2023), Algorithm 3 (GD-Routine).
    """

    learning_rate: float
    name: ClassVar[str] = "gd"
    post_processing: ClassVar[bool] = True

    def __post_init__(self) -> None:
        _check_learning_rate(self.learning_rate)

    def init(self, x0: np.ndarray) -> None:
        """No state: GD keeps nothing between rounds."""
        return None

    def update(self, x: np.ndarray, v: np.ndarray, state: None) -> tuple[np.ndarray, None]:
        """x_r = x_{r-1} - η ṽ_r; the state stays None."""
        return x - self.learning_rate * v, None


class MomentumState(NamedTuple):
    """The momentum buffer b_r (zeros at x_0)."""

    buffer: np.ndarray


@dataclass(frozen=True)
class Momentum:
    """Heavy-ball momentum: b_r = μ b_{r-1} + ṽ_r, x_r = x_{r-1} - η b_r, b_0 = 0.

    μ = 0 is :class:`GD` exactly. This is PyTorch's ``SGD(momentum=μ)`` (dampening 0), whose first
    buffer is ṽ_1 = μ·0 + ṽ_1.

    References:
        Polyak (1964), "Some methods of speeding up the convergence of iteration methods", eq. (9);
        PyTorch ``torch.optim.SGD`` (nesterov=False).
    """

    learning_rate: float
    momentum: float = 0.9
    name: ClassVar[str] = "momentum"
    post_processing: ClassVar[bool] = True

    def __post_init__(self) -> None:
        _check_learning_rate(self.learning_rate)
        _check_unit("momentum", self.momentum)

    def init(self, x0: np.ndarray) -> MomentumState:
        """The zero buffer b_0, shaped as ``x0``."""
        return MomentumState(_frozen(np.zeros_like(x0, dtype=np.float64)))

    def update(self, x: np.ndarray, v: np.ndarray, state: MomentumState) -> tuple[np.ndarray,
                                                                                  MomentumState]:
        """b_r = μ b_{r-1} + ṽ_r, then x_r = x_{r-1} - η b_r; the state holds b_r."""
        buffer = self.momentum * state.buffer + v
        return x - self.learning_rate * buffer, MomentumState(_frozen(buffer))


@dataclass(frozen=True)
class Nesterov(Momentum):
    """Nesterov momentum: b_r = μ b_{r-1} + ṽ_r, x_r = x_{r-1} - η (ṽ_r + μ b_r), b_0 = 0.

    The form of Sutskever et al. rewritten so that the gradient is taken at the iterate itself
    (here ṽ_r estimates ∇f(x_{r-1})), as PyTorch's ``SGD(momentum=μ, nesterov=True)`` does.

    References:
        Nesterov (1983); Sutskever, Martens, Dahl & Hinton (2013), "On the importance of
        initialization and momentum in deep learning", eq. (3)-(4); Bengio, Boulanger-Lewandowski &
        Pascanu (2013), eq. (7); PyTorch ``torch.optim.SGD`` (nesterov=True).

    Momentum's parameters, checks and state; only the step differs.
    """

    name: ClassVar[str] = "nesterov"

    def update(self, x: np.ndarray, v: np.ndarray, state: MomentumState) -> tuple[np.ndarray,
                                                                                  MomentumState]:
        """b_r = μ b_{r-1} + ṽ_r, then x_r = x_{r-1} - η (ṽ_r + μ b_r); the state holds b_r."""
        buffer = self.momentum * state.buffer + v
        return x - self.learning_rate * (v + self.momentum * buffer), MomentumState(_frozen(buffer))


class AdamState(NamedTuple):
    """Adam's step count t and its first and second moment estimates m_t, s_t (zeros at x_0)."""

    count: int
    mu: np.ndarray
    nu: np.ndarray


def _adam_step(x: np.ndarray, g: np.ndarray, state: AdamState, lr: float, beta1: float,
               beta2: float, eps: float) -> tuple[np.ndarray, AdamState]:
    """One bias-corrected Adam step on gradient ``g`` (Kingma & Ba, Algorithm 1), in PyTorch's
    order."""
    t = state.count + 1
    mu = beta1 * state.mu + (1 - beta1) * g
    nu = beta2 * state.nu + (1 - beta2) * (g * g)
    correction1 = 1 - beta1 ** t
    correction2 = 1 - beta2 ** t
    denominator = np.sqrt(nu) / math.sqrt(correction2) + eps
    return x - (lr / correction1) * (mu / denominator), AdamState(t, _frozen(mu), _frozen(nu))


@dataclass(frozen=True)
class Adam:
    """Adam on ṽ_r: m_t = β₁ m_{t-1} + (1-β₁) g, s_t = β₂ s_{t-1} + (1-β₂) g², and
    x_r = x_{r-1} - η m̂_t / (√ŝ_t + eps) with m̂_t = m_t/(1-β₁ᵗ), ŝ_t = s_t/(1-β₂ᵗ), where
    g = ṽ_r + λ x_{r-1} (λ = ``weight_decay``, an L2 penalty added to the gradient; 0 by default).

    The first step moves every coordinate by η ṽ/(|ṽ| + eps) ≈ η: Adam's step size is about η
    whatever the scale of ṽ_r (so η is chosen much smaller than GD's). Defaults are PyTorch's.

    References:
        Kingma & Ba (2015), "Adam: A method for stochastic optimization", Algorithm 1;
        PyTorch ``torch.optim.Adam`` (amsgrad=False; weight_decay as L2 on the gradient).
    """

    learning_rate: float
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    name: ClassVar[str] = "adam"
    post_processing: ClassVar[bool] = True

    def __post_init__(self) -> None:
        _check_learning_rate(self.learning_rate)
        _check_unit("beta1", self.beta1)
        _check_unit("beta2", self.beta2)
        _check_positive("eps", self.eps, zero=False)
        _check_positive("weight_decay", self.weight_decay, zero=True)

    def init(self, x0: np.ndarray) -> AdamState:
        """Step count t = 0 and zero moments m_0 = s_0 = 0, shaped as ``x0``."""
        zeros = _frozen(np.zeros_like(x0, dtype=np.float64))
        return AdamState(0, zeros, zeros)

    def update(self, x: np.ndarray, v: np.ndarray, state: AdamState) -> tuple[np.ndarray,
                                                                              AdamState]:
        """One bias-corrected Adam step on g = ṽ_r + λ x_{r-1}; the state counts it (t + 1)."""
        g = v + self.weight_decay * x if self.weight_decay else v
        return _adam_step(x, g, state, self.learning_rate, self.beta1, self.beta2, self.eps)


@dataclass(frozen=True)
class AdamW(Adam):
    """AdamW: decoupled weight decay, x ← x_{r-1}(1 - η λ), then the Adam step on ṽ_r alone (Adam's
    parameters and checks; only the decay's place and its default differ).

    References:
        Loshchilov & Hutter (2019), "Decoupled weight decay regularization", Algorithm 2 (with the
        schedule multiplier η_t = 1 and the decay scaled by the learning rate, as PyTorch does);
        PyTorch ``torch.optim.AdamW`` (defaults: β = (0.9, 0.999), eps = 1e-8, weight_decay = 0.01).
    """

    weight_decay: float = 0.01
    name: ClassVar[str] = "adamw"

    def update(self, x: np.ndarray, v: np.ndarray, state: AdamState) -> tuple[np.ndarray,
                                                                              AdamState]:
        """x_{r-1}(1 - η λ), then one bias-corrected Adam step on ṽ_r alone; the state counts it."""
        decayed = x * (1 - self.learning_rate * self.weight_decay) if self.weight_decay else x
        return _adam_step(decayed, v, state, self.learning_rate, self.beta1, self.beta2, self.eps)


#: Every routine by name. Each is a frozen dataclass: ``learning_rate`` then its own parameters.
ROUTINES: dict[str, type] = {cls.name: cls for cls in (GD, Momentum, Nesterov, Adam, AdamW)}


def routine_parameters(name: str) -> dict[str, Any]:
    """The parameters of routine ``name`` beyond the learning rate, with their defaults."""
    cls = _routine_class(name)
    return {f.name: f.default for f in dataclasses.fields(cls) if f.name != "learning_rate"}


def _routine_class(name: str) -> type:
    try:
        return ROUTINES[name]
    except KeyError:
        raise RoutineError("name", f"one of {', '.join(repr(n) for n in ROUTINES)}", name) from None


def make_routine(name: str, learning_rate: float, **params: Any) -> Routine:
    """Build routine ``name`` (see :data:`ROUTINES`) with ``learning_rate`` and its own parameters.

    A parameter the routine does not have is refused, naming the ones it has.
    """
    cls = _routine_class(name)
    allowed = routine_parameters(name)
    for key, value in params.items():
        if key not in allowed:
            has = ", ".join(allowed) or "none beyond learning_rate"
            raise RoutineError(key, f"absent for routine {name!r} (its parameters: {has})", value)
    return cls(learning_rate, **params)


def describe_routine(routine: Routine) -> dict[str, Any]:
    """``{"name": ..., "learning_rate": ..., <its parameters>}``: what identifies a routine's
    trajectory."""
    return {"name": routine.name, **dataclasses.asdict(routine)}  # type: ignore[call-overload]
