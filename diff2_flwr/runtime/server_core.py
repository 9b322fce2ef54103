"""The trusted server's decisions as pure functions of a frozen state, optax-style: plan → release →
finish.

One DIFF2 round, as data::

    spec       = ServerSpec(mechanism=..., routine=..., layout=..., rounds=R, clients=P, n_min=...,
    calibration=...) state      = init(spec, x0, seed)                      # or resume(spec, x0,
    checkpoint) plan       = next_plan(spec, state)                    # restart or difference,
    radius, iterates state, out = release(spec, state, replies)             # Released (x_r), or
    with the local routine a LocalTask state, out = finish_local(spec, state, reply)          # the
    local routine's second step: y_K becomes x_r state      = fail(state, error)
    # the run stops; nothing more is released

The budget guard (:func:`charge`), the two-phase release of the local routine (the ledger charged
and ṽ_r out in :func:`release`, x_r in :func:`finish_local`), the fail-closed checks and the round's
release row are all here; nothing here writes, prints or reads a clock.
:class:`~diff2_flwr.runtime.journal.Journal` does every side effect, and
:class:`~diff2_flwr.runtime.server.Diff2Server` drives the two (as :mod:`diff2_flwr.core.estimator`
is driven by this module).

References:
    Murata & Suzuki (2023), Algorithm 1 (server lines) and Section 5 (the local routine).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
from dataclasses import dataclass
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import numpy as np

from ..core.aggregation import (
    Aggregate, NodeRefused, Reply, RoundRejected, average_contributions, check_local_reply,
)
from ..core.distributed import DistributedNoise, SkellamLedger
from ..core.estimator import (DIVERGENCE_ADVICE, Diff2State, Diverged, Mechanism, Release,
                              RoundPlan, advance, estimate, init_state, plan_round, server_step)
from ..core.layout import ParameterLayout
from ..core.local import LocalMechanism, LocalTask, choose_worker, local_seed
from ..core.privacy import Calibration, PrivacyLedger
from ..core.routines import Routine
from ..core.sampling import Sampling, cohort_key, denominator, round_cohort
from ..core.schedules import CONSTANT, Schedule, routine_at
from .checkpoint import Checkpoint, CheckpointError
from .config_experiment import ExperimentConfig
from .step_report import names_of

__all__ = ["BUDGET_RTOL", "PLD_RTOL", "OutOfTurn", "PendingLocal", "Released", "ServerSpec",
           "ServerState", "charge",
           "check_mechanism", "check_planned_budget", "check_spec", "cohort", "fail",
           "finish_local", "init",
           "is_done", "next_plan",
           "release", "release_sum", "resume"]


#: Relative slack of the budget guard: the exact composition may exceed the target by float rounding
#: only.
BUDGET_RTOL = 1e-9
#: ... and the PLD accountant by its (pessimistic) discretisation only.
PLD_RTOL = 0.01


class OutOfTurn(RuntimeError):
    """A call the state does not allow now (no round left, or a local phase due): it changes nothing
    and fails nothing, unlike a refused round."""


def check_mechanism(mechanism: Mechanism, calibration: Calibration, *, rounds: int, clients: int,
                    n_min: int, local: LocalMechanism | None = None) -> None:
    """Refuse a server whose mechanism is not the one its calibration (and so its ledger) describes.

    The ledger charges each round the calibration's multiplier z; that is the truth only if the
    noise actually added is σ·radius with the calibration's σ, for the schedule, P and n_min it was
    computed for.
    """
    problems = []
    for what, have, want in (("rounds", rounds, calibration.rounds), ("clients (P)", clients,
                                                                      calibration.clients),
                             ("n_min", n_min, calibration.n_min),
                             ("restart_every (T)", mechanism.restart_every,
                              calibration.restart_every),
                             ("sigma_restart (σ1)", mechanism.sigma_restart, calibration.sigma1)):
        if have != want:
            problems.append(f"{what} is {have!r}, the calibration's {want!r}")
    if calibration.difference_rounds and mechanism.sigma_diff != calibration.sigma2:
        problems.append(
            f"sigma_diff (σ2) is {mechanism.sigma_diff!r}, the calibration's "
            f"{calibration.sigma2!r}")
    if not math.isfinite(mechanism.clip_restart) or (calibration.difference_rounds
                                                     and not math.isfinite(mechanism.clip_diff)):
        problems.append("a clipping radius is infinite (the sensitivity would be unbounded)")
    cl = calibration.local
    if (local is None) != (cl is None):
        problems.append(
            f"the local routine is {'on' if local else 'off'}, the calibration's "
            f"{'on' if cl else 'off'}")
    elif local is not None and cl is not None:
        for what, have, want in (("local steps (K)", local.steps, cl.steps),
                                 ("local batch size (b)", local.batch_size, cl.batch_size),
                                 ("local sigma (σ3)", local.sigma, cl.sigma3)):
            if have != want:
                problems.append(f"{what} is {have!r}, the calibration's {want!r}")
    if problems:
        raise ValueError(
            "The mechanism disagrees with the calibration the ledger accounts for: " + "; ".join(
                problems)
                         + ". The ε reported would not be the ε spent: build the mechanism from "
                           "this calibration (ExperimentConfig.mechanism) or calibrate for this "
                           "mechanism.")


def check_planned_budget(calibration: Calibration, source: str, section: str = "") -> None:
    """Refuse a schedule whose planned ε exceeds the target (float rounding aside): the run would
    not start."""
    planned = calibration.planned_epsilon
    if planned > calibration.epsilon * (1 + BUDGET_RTOL):
        raise ValueError(
            f"{source}: the planned schedule would spend ε = {planned:.6g}, above the target "
                         f"{section}epsilon = {calibration.epsilon:g} by "
                         f"{planned - calibration.epsilon:.3g}; the run "
                         "does not start.")


@dataclass(frozen=True)
class ServerSpec:
    """What a run's server is, fixed for the whole run: the mechanism its calibration (if any)
    accounts for.

    Args:
        mechanism: T, C1, C2, σ1, σ2 of the server's rounds.
        routine: the update x_r = Routine(x_{r-1}, ṽ_r).
        layout: the model's tensors (shapes of the replies).
        rounds: R, the rounds to release.
        clients: P, the workers every round needs.
        n_min: the fewest records a worker may hold (the noise is calibrated for it).
        calibration: the noise for (ε, δ), which the ledger charges; None for method gd (no
            privacy).
        local: the local routine's K, b, η, C3, σ3 (None: off); needs a calibration.
        distributed: ``privacy.noise: distributed``: the clients add Skellam noise shares, the
            server receives their modular sum (:func:`release_sum`) and adds none; its ledger is a
            :class:`SkellamLedger`.
        sampling: client sampling (None: every round takes all P clients): round r's cohort is
            :func:`cohort`'s, only it answers, and its sum is divided by E|S|; the calibration must
            be for it.
        schedule: s(r): round r steps with the routine's learning rate η·s(r)
            (:meth:`routine_at`); constant by default. Post-processing: the ledger is the same.
        settings: the validated experiment the spec was built from (:meth:`of`): every declared
            setting, as the YAML file, ``--set``, the run config or the Python API gave it; None for
            a spec assembled by hand (the audit's). A new server setting is read from here where it
            is used: no field, no plumbing.

    :func:`check_spec` checks that the mechanism is the calibration's (the server's constructor
    calls it).
    """

    mechanism: Mechanism
    routine: Routine
    layout: ParameterLayout
    rounds: int
    clients: int
    n_min: int
    calibration: Calibration | None
    local: LocalMechanism | None = None
    distributed: DistributedNoise | None = None
    schedule: Schedule = CONSTANT
    settings: ExperimentConfig | None = dataclasses.field(default=None, repr=False)
    sampling: Sampling | None = None

    @classmethod
    def of(cls, settings: ExperimentConfig, *, layout: ParameterLayout, n_min: int) -> "ServerSpec":
        """The one place a server is built from an experiment: its calibration for ``n_min``, the
        mechanism, the routine, the schedule, the local routine and the distributed noise, all from
        ``settings``; checked."""
        calibration = settings.calibration(n_min)
        distributed = settings.private and settings.privacy.distributed
        return check_spec(cls(
            mechanism=settings.mechanism(calibration),
            routine=settings.training.routine.build(settings.training.learning_rate),
            layout=layout, rounds=settings.training.rounds, clients=settings.clients, n_min=n_min,
            calibration=calibration, local=settings.local_mechanism(calibration),
            distributed=settings.distributed_noise(n_min, layout.dim) if distributed else None,
            schedule=settings.training.schedule.build(), settings=settings,
            sampling=settings.training.sampling.build()))

    def routine_at(self, r: int) -> Routine:
        """Round r's routine: :attr:`routine` with learning rate η·s(r) of :attr:`schedule` over
        :attr:`rounds`; its state carries over unchanged
        (:func:`~diff2_flwr.core.schedules.routine_at`)."""
        return routine_at(self.routine, self.schedule, r, self.rounds)


def check_spec(spec: ServerSpec) -> ServerSpec:
    """``spec`` if its ledger would account for its mechanism (see :func:`check_mechanism`), else
    ``ValueError``."""
    if spec.distributed is not None:
        m = spec.mechanism
        if (spec.calibration is not None or spec.local is not None or m.sigma_restart
                or m.sigma_diff):
            raise ValueError(
                "With distributed noise the server adds none: no central calibration, no local "
                "routine, σ1 = σ2 = 0.")
        if spec.distributed.clients != spec.clients or spec.distributed.n_min != spec.n_min:
            raise ValueError(
                f"The distributed noise is for P = {spec.distributed.clients}, n_min = "
                f"{spec.distributed.n_min}; the server has P = {spec.clients}, n_min = "
                f"{spec.n_min}.")
    if spec.local is not None and spec.schedule.name != "constant":
        raise ValueError(
            f"The local routine takes its steps with η as its task says (the node checks it "
            f"against the run config); a schedule ({spec.schedule.name}) cannot reach them.")
    if spec.sampling is not None and (spec.local is not None or spec.distributed is not None):
        raise ValueError("Client sampling runs without the local routine and distributed noise: "
                         "neither is accounted for a sampled cohort.")
    if spec.calibration is not None and spec.calibration.sampling != spec.sampling:
        raise ValueError(
            f"The server samples {spec.sampling or 'no clients'} but its calibration is for "
            f"{spec.calibration.sampling or 'no sampling'}: the ε reported would not be the ε "
            "spent. Calibrate for the server's sampling.")
    if spec.calibration is not None:
        check_mechanism(spec.mechanism, spec.calibration, rounds=spec.rounds, clients=spec.clients,
                        n_min=spec.n_min, local=spec.local)
    elif spec.local is not None:
        raise ValueError(
            "A local routine needs a calibration: its steps touch private data and must be "
            "accounted.")
    return spec


class PendingLocal(NamedTuple):
    """A round whose ṽ_r is out (and charged) and whose x_r awaits the chosen worker's local
    phase."""

    plan: RoundPlan
    v: np.ndarray
    aggregate: Aggregate
    task: LocalTask


@dataclass(frozen=True)
class ServerState:
    """The server after ``estimator.round`` released rounds: the estimator, the ledger, a local
    phase due, and how the run stands (``running``, ``completed``, ``failed`` or ``diverged``, with
    the error's text)."""

    estimator: Diff2State
    ledger: PrivacyLedger | SkellamLedger | None
    pending: PendingLocal | None = None
    status: str = "running"
    error: str | None = None
    diverged_at: int | None = None

    @property
    def epsilon_spent(self) -> float:
        """ε spent so far: the exact μ-GDP composition, or with a local routine dp-accounting's PLD
        accountant."""
        return self.ledger.epsilon if self.ledger else math.inf

    @property
    def epsilon_pld(self) -> float:
        """ε spent so far per dp-accounting's PLD accountant (independent; one composition per
        round)."""
        return self.ledger.epsilon_pld if self.ledger else math.inf

    @property
    def epsilon_rdp(self) -> float:
        """ε spent so far per dp-accounting's RDP accountant (looser; for comparison)."""
        return self.ledger.epsilon_rdp if self.ledger else math.inf


@dataclass(frozen=True)
class Released:
    """What releasing round r hands the journal: x_r and ṽ_r, the round's row, and (x_r not finite)
    the divergence to record after the row."""

    release: Release
    row: Mapping[str, Any]
    diverged: Diverged | None = None


def init(spec: ServerSpec, x0: np.ndarray, seed: int | None) -> ServerState:
    """The state before round 1: x_0, the noise key (``seed``, or OS entropy when None) and an empty
    ledger."""
    if spec.layout.dim != x0.size:
        raise ValueError(
            f"x0 has {x0.size} entries but the model has {spec.layout.dim} parameters.")
    ledger = PrivacyLedger(spec.calibration.delta) if spec.calibration else None
    if spec.distributed is not None:
        ledger = SkellamLedger(spec.distributed.calibration.delta)
    return ServerState(init_state(x0, spec.routine, seed), ledger)


def resume(spec: ServerSpec, x0: np.ndarray, checkpoint: Checkpoint) -> ServerState:
    """The state a checkpoint holds (its estimator and ledger), if it fits the model."""
    if spec.layout.dim != x0.size:
        raise ValueError(
            f"x0 has {x0.size} entries but the model has {spec.layout.dim} parameters.")
    if spec.local is not None:
        raise CheckpointError("Checkpoints of the local routine are not supported yet.")
    if checkpoint.state.x.shape != x0.shape:
        raise CheckpointError(
            f"The checkpoint's iterate has shape {checkpoint.state.x.shape}, the model {x0.shape}.")
    return ServerState(checkpoint.state, checkpoint.ledger)


def is_done(spec: ServerSpec, state: ServerState) -> bool:
    """Whether all R rounds are released."""
    return state.estimator.round >= spec.rounds


def next_plan(spec: ServerSpec, state: ServerState) -> RoundPlan:
    """Round r's plan (kind, radius, iterates), derived from released values only; :class:`Diverged`
    when its radius or noise std is not finite, :class:`OutOfTurn` when no round is due."""
    if is_done(spec, state):
        raise OutOfTurn(
            f"All {spec.rounds} rounds are released; there is no round "
            f"{state.estimator.round + 1}.")
    if state.pending is not None:
        raise OutOfTurn(
            f"Round {state.pending.plan.round} awaits its local phase (finish_local) before the "
            f"next plan.")
    return plan_round(state.estimator, spec.mechanism)


def cohort(spec: ServerSpec, state: ServerState, r: int | None = None) -> np.ndarray | None:
    """Round r's cohort (the next round's by default): the sorted partition ids that take part,
    drawn from the run's cohort key (:func:`~diff2_flwr.core.sampling.cohort_key` of its noise key:
    one way, so the cohorts may be public) and r alone; None without sampling (all P)."""
    if spec.sampling is None:
        return None
    r = state.estimator.round + 1 if r is None else r
    return round_cohort(cohort_key(state.estimator.noise_key), r, spec.sampling, spec.clients)


def charge(spec: ServerSpec, state: ServerState, plan: RoundPlan) -> PrivacyLedger | None:
    """The budget guard: the ledger after this round, or :class:`RoundRejected` ('budget') if it
    would exceed ε.

    The exact GDP composition must stay within the target (float rounding aside); dp-accounting's
    PLD accountant, computed independently, must agree within its discretisation (1 %).
    """
    if spec.distributed is not None:
        return _charge_distributed(spec.distributed, state, plan)
    if state.ledger is None or spec.calibration is None:
        return None
    after = state.ledger.record(*spec.calibration.round_events(plan.restart))
    target = spec.calibration.epsilon
    checks = ((("exact GDP", after.epsilon, BUDGET_RTOL), ("dp-accounting PLD",
                                                           _pld_check(spec.calibration, after),
                                                          PLD_RTOL))
              if after.exact else (("dp-accounting PLD, local steps included", after.epsilon_pld,
                                    BUDGET_RTOL),))
    for name, spent, slack in checks:
        if spent > target * (1 + slack):
            raise RoundRejected(plan.round, "budget",
                                f"releasing it would bring ε spent ({name} accountant) to "
                                f"{spent:.6g}, above the target ε = {target:g} by "
                                f"{spent - target:.3g}; the run "
                                "stops here.")
    return after


def _pld_check(calibration: Calibration, after: PrivacyLedger) -> float:
    """The PLD figure the budget guard compares with the target for an exact ledger ``after``.

    A ledger within the calibrated schedule (no event beyond the planned counts) is part of the
    planned mechanism, so by post-processing its true ε is at most the plan's, and dp-accounting's
    pessimistic PLD of the whole plan (composed by counts, once per calibration) bounds it: when
    that bound is within the target's 1 % this round passes without composing the ledger. Otherwise
    (the plan's bound is above it, or the ledger goes beyond the plan) the ledger's own PLD decides,
    composed round by round as :attr:`PrivacyLedger.epsilon_pld` — the composition a round used to
    pay for every round (≈ 15–40 ms each on a 2-core machine, growing with the run).
    """
    plan = _planned_ledger(calibration)
    if after.within(plan):
        bound = plan.epsilon_pld_by_counts
        if bound <= calibration.epsilon * (1 + PLD_RTOL):
            return bound
    return after.epsilon_pld


@functools.lru_cache(maxsize=32)
def _planned_ledger(calibration: Calibration) -> PrivacyLedger:
    """The ledger of the whole calibrated schedule: m1 restart and m2 difference rounds (order
    aside)."""
    events = calibration.round_events(True) * calibration.restart_rounds
    if calibration.difference_rounds:
        events += calibration.round_events(False) * calibration.difference_rounds
    return PrivacyLedger(calibration.delta, events)


def release(spec: ServerSpec, state: ServerState, replies: Sequence[Reply],
            local_worker: Callable[[int], int] | None = None) -> tuple[ServerState,
                                                                       Released | LocalTask]:
    """Check and average the replies, add noise, step: round r released, or an exception and
    nothing.

    With the local routine the round is released in two steps: this returns the :class:`LocalTask`
    for worker ``local_worker(r)`` (default: uniform over the P workers, from the noise key), with
    ṽ_r out and the ledger charged for the server's round and the local steps; :func:`finish_local`
    takes its y_K as x_r.
    """
    plan = next_plan(spec, state)
    ledger = charge(spec, state, plan)
    ledger = ledger if ledger is not None else state.ledger
    drawn = cohort(spec, state, plan.round)
    aggregate = average_contributions(
        plan, spec.layout, replies, clients=spec.clients, n_min=spec.n_min,
        **({} if drawn is None else {"cohort": drawn.tolist(),
                                     "denominator": denominator(spec.sampling, spec.clients)}))
    if spec.local is None:
        estimator, out = server_step(state.estimator, spec.mechanism, spec.routine_at(plan.round),
                                     aggregate.mean)
        return _released(spec, dataclasses.replace(state, estimator=estimator, ledger=ledger), plan,
                         aggregate, out, {} if drawn is None else {"cohort": drawn.tolist()})
    # check_spec checked it
    assert spec.calibration is not None and spec.calibration.local is not None
    plan, v = estimate(state.estimator, spec.mechanism, aggregate.mean)
    key, seeded = state.estimator.noise_key, state.estimator.noise_seeded
    worker = (local_worker or (lambda r: choose_worker(key, r, spec.clients)))(plan.round)
    task = LocalTask(round=plan.round, partition_id=worker, x_start=state.estimator.x, v=v,
                     mechanism=spec.local, seed=local_seed(key, plan.round) if seeded else None,
                     n_min=spec.n_min, sampling_prob=spec.calibration.local.sampling_prob)
    return dataclasses.replace(state, ledger=ledger, pending=PendingLocal(plan, v, aggregate,
                                                                          task)), task


def _charge_distributed(noise: DistributedNoise, state: ServerState,
                        plan: RoundPlan) -> SkellamLedger:
    """The Skellam ledger after this round, or :class:`RoundRejected` ('budget') past the target
    ε."""
    after = state.ledger.record(noise.event(plan.restart))  # type: ignore[union-attr]
    target, spent = noise.calibration.epsilon, after.epsilon
    if spent > target * (1 + BUDGET_RTOL):
        raise RoundRejected(plan.round, "budget",
                            f"releasing it would bring ε spent (Skellam RDP accountant) to "
                            f"{spent:.6g}, above the target ε = {target:g}; the run stops here.")
    return after


def release_sum(spec: ServerSpec, state: ServerState, total: np.ndarray,
                survivors: int) -> tuple[ServerState, Released]:
    """Round r from the secure sum of the clients' messages (distributed noise): decoded, stepped,
    released.

    ``total`` is Σ_p message_p mod 2**bits over the ``survivors`` clients SecAgg+ unmasked. Fewer
    than P - t survivors carry less than the calibrated noise: :class:`RoundRejected` ('survivors')
    and nothing released. The server cannot check a client's clipping or noise here (it sees only
    the sum): see THREATS.md.
    """
    noise = spec.distributed
    if noise is None:
        raise OutOfTurn(
            "release_sum is for distributed noise; this server adds the noise itself (release).")
    plan = next_plan(spec, state)
    if not noise.threshold <= survivors <= spec.clients:
        raise RoundRejected(plan.round, "survivors",
                            f"{survivors} of P = {spec.clients} clients' messages are in the "
                            f"secure sum; the noise needs at least P - t = {noise.threshold} "
                            f"honest shares (privacy.tolerated = {noise.tolerated}).")
    total = np.asarray(total)
    if total.shape != (noise.code(plan.round, plan.restart,
                                  plan.radius).padded,) or total.dtype.kind not in "iu":
        raise RoundRejected(plan.round, "secure-sum",
                            f"the secure sum must be {noise.code(1, True, 1.0).padded} "
                            f"integers. Found shape {total.shape}, dtype {total.dtype}.")
    ledger = charge(spec, state, plan)
    mean = noise.decode(total, plan.round, plan.restart, plan.radius, survivors)
    estimator, out = server_step(state.estimator, spec.mechanism, spec.routine_at(plan.round), mean)
    after = dataclasses.replace(state, estimator=estimator, ledger=ledger)
    plan = dataclasses.replace(plan, noise_std=noise.noise_std(plan.round, plan.restart,
                                                               plan.radius, survivors))
    out = dataclasses.replace(out, plan=plan)
    return _released(spec, after, plan, Aggregate(mean=mean, clip_fraction=math.nan), out,
                     {"survivors": survivors})


def finish_local(spec: ServerSpec, state: ServerState, reply: Reply) -> tuple[ServerState,
                                                                              Released]:
    """Take the chosen worker's y_K as x_r (after the checks: its partition, this round, shapes,
    finite, n_p)."""
    if state.pending is None:
        raise OutOfTurn("No round awaits a local phase.")
    plan, v, aggregate, task = state.pending
    y = check_local_reply(task, spec.layout, reply, spec.n_min)
    estimator, out = advance(state.estimator, plan, v, y, state.estimator.routine_state)
    after = dataclasses.replace(state, estimator=estimator, pending=None)
    return _released(spec, after, plan, aggregate, out, {"local_worker": task.partition_id})


def _released(spec: ServerSpec, state: ServerState, plan: RoundPlan, aggregate: Aggregate,
              out: Release, extra: Mapping[str, Any]) -> tuple[ServerState, Released]:
    """Round r's row; a run whose x_r is not finite diverged (after its row), one at round R
    completed.

    With an exact ledger the row's ``epsilon_pld`` is None, for the journal to fill where it
    evaluates (the round-by-round PLD composition is a cross-check of the exact ``epsilon_spent``,
    and costs more than the rest of a round) and drop elsewhere."""
    exact = isinstance(state.ledger, PrivacyLedger) and state.ledger.exact
    row = {
        "round": plan.round, "kind": plan.kind, "radius": plan.radius, "noise_std": plan.noise_std,
        "clip_fraction": aggregate.clip_fraction, "epsilon_spent": state.epsilon_spent,
        "epsilon_pld": None if exact else state.epsilon_pld, "epsilon_rdp": state.epsilon_rdp,
        "update_norm": float(np.linalg.norm(out.x - plan.x_current)), **extra,
    }
    diverged = None
    if not np.all(np.isfinite(out.x)):
        diverged = Diverged(plan.round, "iterate",
                            "the iterate is no longer finite. " + _divergence_advice(spec))
    elif is_done(spec, state):
        state = dataclasses.replace(state, status="completed")
    return state, Released(out, types.MappingProxyType(row), diverged)


def _divergence_advice(spec: ServerSpec) -> str:
    """:data:`~diff2_flwr.core.estimator.DIVERGENCE_ADVICE` in the names of the path the run came
    from (``learning_rate=`` on the Python API's, ``training.learning_rate`` on the YAML path)."""
    if spec.settings is None:
        return DIVERGENCE_ADVICE
    names = names_of(spec.settings)
    return (f"Lower {names('training.learning_rate')} (or {names('training.restart_every')}: noise "
            "enlarges ||x_r - x_(r-1)|| and so the next noise).")


def fail(state: ServerState, error: BaseException) -> ServerState:
    """The state of a run stopped by ``error``: ``diverged`` (at its round) for :class:`Diverged`,
    else ``failed``."""
    # a node's refusal is said in the node's own words, first (no exception name before it)
    text = str(error) if isinstance(error, NodeRefused) else f"{type(error).__name__}: {error}"
    if isinstance(error, Diverged):
        return dataclasses.replace(state, status="diverged", error=text, diverged_at=error.round)
    return dataclasses.replace(state, status="failed", error=text)
