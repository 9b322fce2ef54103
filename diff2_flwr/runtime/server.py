"""The trusted server of a DIFF2 run: the pure core and the journal, driven together.

:class:`Diff2Server` holds the run's :class:`~diff2_flwr.runtime.server_core.ServerSpec`, its
current :class:`~diff2_flwr.runtime.server_core.ServerState` and its
:class:`~diff2_flwr.runtime.journal.Journal`. Each call hands the state to a pure function of
:mod:`~diff2_flwr.runtime.server_core`, keeps the state it returns, and gives it to the journal to
make durable and visible; a refused round (any exception but a call out of turn) is recorded as the
run's failure and raised, with nothing released. The Flower Strategy and the in-process driver make
the same calls in the same order.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import numpy as np

from ..core.aggregation import Reply
from ..core.estimator import Diff2State, Diverged, Release, RoundPlan
from ..core.local import LocalTask, choose_worker
from ..core.privacy import PrivacyLedger
from . import server_core
from .checkpoint import Checkpoint
from .journal import Journal
from .server_core import OutOfTurn, PendingLocal, Released, ServerSpec, ServerState
from .step_report import WATCH_ROWS, feedback_warning, names_of, radius_feedback, step_gain

__all__ = ["Diff2Server"]


def _spec_field(name: str) -> property:
    """The spec's field ``name``, read-only (the spec is frozen; a test that needs another replaces
    ``spec``)."""
    return property(lambda self: getattr(self.spec, name),
                    doc=f"The run's ``{name}`` (see :class:`ServerSpec`).")


def _journal_field(name: str) -> property:
    return property(lambda self: getattr(self.journal, name), lambda self,
                    value: setattr(self.journal, name, value),
                    doc=f"The journal's ``{name}`` (see :class:`Journal`).")


class Diff2Server:
    """The trusted server's side of DIFF2 (Algorithm 1, server lines), transport-free.

    Args:
        spec: what the server is (:meth:`ServerSpec.of` from an experiment; checked against its
            calibration).
        journal: what it writes and says (:meth:`Journal.of`); None: a silent journal that
            writes nothing.
        x0: the initial iterate (a flat vector of ``spec.layout.dim`` entries).
        seed: the noise key (None: OS entropy).
        resume: a checkpoint of this run to continue from (its state and ledger) instead of x0
            and the seed.

    References:
        Murata & Suzuki (2023), Algorithm 1 (server lines).
    """

    def __init__(self, spec: ServerSpec, journal: Journal | None = None, *, x0: np.ndarray,
                 seed: int | None = None, resume: Checkpoint | None = None) -> None:
        spec = server_core.check_spec(spec)
        self.journal = journal if journal is not None else Journal(spec=spec, progress=None)
        self.journal.spec = spec
        if resume is not None:
            self.core = server_core.resume(spec, x0, resume)
            self.journal.resume(self.core, resume)
        else:
            self.core = server_core.init(spec, x0, seed)
            # the noise key is durable before anything is written or released
            self.journal.start(self.core)

    mechanism = _spec_field("mechanism")
    routine = _spec_field("routine")
    layout = _spec_field("layout")
    rounds = _spec_field("rounds")
    clients = _spec_field("clients")
    n_min = _spec_field("n_min")
    calibration = _spec_field("calibration")
    local = _spec_field("local")
    distributed = _spec_field("distributed")
    settings = _spec_field("settings")
    history = _journal_field("history")
    recorder = _journal_field("recorder")
    run_info = _journal_field("run_info")
    progress = _journal_field("progress")
    evaluator = _journal_field("evaluator")
    eval_every = _journal_field("eval_every")
    clip_stats = _journal_field("clip_stats")
    checkpoint_path = _journal_field("checkpoint_path")
    fingerprint = _journal_field("fingerprint")

    # ---------------------------------------------------------------- the state
    @property
    def spec(self) -> ServerSpec:
        """What the server is (the journal records the same spec)."""
        return self.journal.spec

    @spec.setter
    def spec(self, value: ServerSpec) -> None:
        self.journal.spec = value

    @property
    def state(self) -> Diff2State:
        """The estimator's state: x_r, x_{r-1}, ṽ_r, the routine's state, the noise key."""
        return self.core.estimator

    @state.setter
    def state(self, value: Diff2State) -> None:
        self.core = dataclasses.replace(self.core, estimator=value)

    @property
    def ledger(self) -> PrivacyLedger | None:
        """The noise events released so far, from which ε is composed (None without privacy)."""
        return self.core.ledger

    @ledger.setter
    def ledger(self, value: PrivacyLedger | None) -> None:
        self.core = dataclasses.replace(self.core, ledger=value)

    @property
    def pending(self) -> PendingLocal | None:
        """The round awaiting its local phase (plan, ṽ_r, aggregate, task), if any."""
        return self.core.pending

    @property
    def diverged_at(self) -> int | None:
        """The round at which the optimisation diverged, if it did."""
        return self.core.diverged_at

    @property
    def done(self) -> bool:
        """Whether all R rounds are released."""
        return server_core.is_done(self.spec, self.core)

    @property
    def epsilon_spent(self) -> float:
        """ε spent so far: the exact μ-GDP composition of the ledger's Gaussian events (cheap, every
        round), or with a local routine (subsampled steps, no closed form) dp-accounting's PLD
        accountant."""
        return self.core.epsilon_spent

    @property
    def epsilon_pld(self) -> float:
        """ε spent so far per dp-accounting's PLD accountant (independent; one composition per
        round)."""
        return self.core.epsilon_pld

    @property
    def epsilon_rdp(self) -> float:
        """ε spent so far per dp-accounting's RDP accountant (looser; for comparison)."""
        return self.core.epsilon_rdp

    # ---------------------------------------------------------------- rounds
    def plan(self) -> RoundPlan:
        """The next round's plan (kind, radius, iterates); derived from released values only."""
        try:
            return server_core.next_plan(self.spec, self.core)
        # a radius or noise std that is not finite: nothing to ask the workers
        except Diverged as err:
            self.fail(err)
            raise

    def cohort(self) -> list[int] | None:
        """The next round's cohort: the partition ids to ask (sorted), or None for all P (no client
        sampling). Drawn from the run's cohort key and the round alone
        (:func:`~diff2_flwr.runtime.server_core.cohort`), so asking twice gives the same answer."""
        drawn = server_core.cohort(self.spec, self.core)
        return None if drawn is None else drawn.tolist()

    def local_worker(self, r: int) -> int:
        """p_r, the worker that runs round r's local phase: uniform over the P workers, from the
        noise key.

        The ledger charges every record every local phase, whichever worker runs it (no
        amplification by the choice), so the analysis holds for any p_r; the audit
        (:mod:`diff2_flwr.lab.audit.runner`) overrides this in a subclass of its own to force the
        canary's worker, the worst case. No config reaches that override.
        """
        return choose_worker(self.state.noise_key, r, self.clients)

    def release(self, replies: Sequence[Reply]) -> Release | LocalTask:
        """Check and average the replies, add noise, step: release round r (or nothing, raising).

        With the local routine the round is released in two steps: this returns the
        :class:`LocalTask` for the worker drawn at random (ṽ_r leaves the server, and the ledger is
        charged for the server's round and the local steps), and :meth:`finish_local` takes its y_K
        as x_r.
        """
        out = self._step(server_core.release, replies, self.local_worker)
        return out if isinstance(out, LocalTask) else self._publish(out)

    def release_sum(self, total: np.ndarray, survivors: int) -> Release:
        """Distributed noise: release round r from the secure sum of ``survivors`` clients' messages
        (or nothing, raising; fewer than P - t survivors release nothing)."""
        return self._publish(self._step(server_core.release_sum, total, survivors))

    def finish_local(self, reply: Reply) -> Release:
        """Take the chosen worker's y_K as x_r (after the checks) and release round r."""
        return self._publish(self._step(server_core.finish_local, reply))

    def fail(self, error: BaseException) -> None:
        """Record that the run stopped with ``error`` (nothing more is released)."""
        self.core = server_core.fail(self.core, error)
        self.journal.failed(self.core)

    def summary(self) -> dict:
        """The run's summary now (what ``summary.json`` holds)."""
        return self.journal.summary(self.core)

    def _step(self, step: Callable[..., tuple[ServerState, Any]], *args: Any) -> Any:
        """``step(spec, state, *args)``; its new state is kept, its refusal recorded as the run's
        failure."""
        try:
            self.core, out = step(self.spec, self.core, *args)
        except OutOfTurn:  # no round is due: nothing changed, the run goes on
            raise
        except Exception as err:
            self.fail(err)
            raise
        return out

    def _publish(self, out: Released) -> Release:
        """Round r released: the journal records it; a diverged iterate stops the run, round R
        completes it."""
        self.journal.released(self.core, out)
        self._watch_radius()
        if out.diverged is not None:
            self.fail(out.diverged)
            raise out.diverged
        if self.core.status == "completed":
            self.journal.completed(self.core)
        return out.release

    def _watch_radius(self) -> None:
        """Radius feedback (:func:`~diff2_flwr.runtime.step_report.radius_feedback` on the latest
        rows): said once, the round it is found, with the settings named as the caller gave them,
        and kept in the summary (``radius_feedback``, ``warnings``). It only watches released radii:
        the run goes on, as it would have."""
        found = self.run_info.get("radius_feedback", {})
        if "detected_at" in found:
            return
        feedback = radius_feedback(self.history[-WATCH_ROWS:])
        if feedback is None:
            return
        spec = self.spec
        gain = step_gain(spec.calibration, spec.routine, spec.mechanism.clip_diff, spec.layout.dim,
                         local=spec.local is not None)
        warning = feedback_warning(feedback, eta=spec.routine.learning_rate,
                                   clip_diff=spec.mechanism.clip_diff, gain=gain,
                                   names=names_of(spec.settings))
        self.run_info["radius_feedback"] = {**found, **feedback.as_dict()}
        self.run_info["warnings"] = [*self.run_info.get("warnings", ()), warning]
        self.journal.say(f"[diff2] WARNING: {warning}")
