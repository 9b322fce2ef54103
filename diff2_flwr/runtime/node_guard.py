"""What a data owner's node checks before it computes anything: the run against its policy, every
task against the calibration it recomputes from the run config and its own record count, and its
lifetime budget.

The server's messages carry what the worker must compute (round, kind, radius, n_min; for the local
routine K, b, η, C3, σ3, q). The worker does not take them on trust: it knows the run config (the
same file and overrides the ServerApp read), so it recomputes

- the round kind: restart iff (r - 1) mod T == 0, and 1 <= r <= R;
- the radius: C1 on a restart round, C2 ||x_(r-1) - x_(r-2)|| of the two iterates it was sent on a
  difference round (relative tolerance 1e-9: the server may run on another CPU, whose norm may round
  differently), finite for a private method, infinite only for method gd;
- n_min: at most this node's n_p (else its records would be sampled, and their sensitivity bounded,
  with a smaller n than the analysis took) and equal to ``privacy.n_min`` when the run config fixes
  it;
- the calibration (z1, z2; σ3 and q = b / n_min for the local routine) from (ε, δ, R, T, u, n_min,
  P);
- the local routine's K, b, η, C3 as configured, q = b / n_min, and σ3 at least the recomputed one;

and refuses (:class:`~diff2_flwr.runtime.policy.Refused`, naming the node and the rule) a task that
disagrees, before it touches its shard. With a lifetime budget, the run's whole planned schedule is
charged to the node's durable ledger (:mod:`~diff2_flwr.runtime.node_ledger`) at its first task,
before anything is released, and a run that would cross the budget is refused. A client-sampled
run reaches the charge only where the policy says how to charge it (``lifetime.sampled_runs``;
refused at admission otherwise, :func:`~diff2_flwr.runtime.policy.check_run`): ``amplified``
charges the :class:`~diff2_flwr.core.accounting.SampledGaussianEvent` s of its calibration (trusting
the server's draws), ``unamplified`` each of them as full Gaussian rounds of the same multiplier, as
if the node were in every round
(:meth:`~diff2_flwr.runtime.node_ledger.Charge.without_amplification`), in full, at the first task.

Trust: protects this node's records against a run config that asks too much and a server whose tasks
disagree with the declared mechanism. It does not see the server's noise (central noise: the server
is trusted to add it), unless the policy has ``canaries``: the node then adds canary records to its
replies and records what it receives, so that the noise can be checked
(:mod:`~diff2_flwr.runtime.canary_monitor`). Nor does it see how the server draws a sampled run's
cohorts: a node asked in more rounds than π R cannot tell a targeted draw from chance, so the
amplified charge is only as good as the server's draws, and the policy says whether to rely on them
(the unamplified charge does not).
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass

import numpy as np

from ..core.estimator import difference_radius, is_restart
from ..core.gradients import Contribution
from ..core.local import LocalTask, local_seed
from ..core.privacy import Calibration, RunEvents
from .answer_log import AnswerLog, AnswerLogError, Replayed
from .canary_monitor import CanaryMonitor
from .config import ExperimentConfig
from .node_ledger import (BudgetExceeded, Charge, LedgerError, NodeLedger, RunChanged,
                          config_digest)
from .policy import BUILTIN_MODELS, NodePolicy, Refused, check_model, check_run

__all__ = ["NodeGuard", "check_deployment_run"]

#: Relative tolerance of the difference radius (the server's norm may come from another CPU's SIMD
#: path).
RADIUS_RTOL = 1e-9


@functools.lru_cache(maxsize=32)
def _calibration(cfg: ExperimentConfig, n_min: int) -> Calibration | None:
    return cfg.calibration(n_min)


@dataclass(frozen=True)
class NodeGuard:
    """One node's checks for one run (see the module). Build it with :meth:`admit_run` before
    loading data."""

    cfg: ExperimentConfig
    node: str
    partition_id: int
    run_id: str
    policy: NodePolicy | None
    shared_policy: bool  # simulated nodes reading one policy: one ledger file per partition
    # the node's record of the tasks it answered (its policy's `answers` file)
    answers: AnswerLog | None = None

    @classmethod
    def admit_run(cls, cfg: ExperimentConfig, *, node: str, partition_id: int, run_id: int | str,
                  policy: NodePolicy | None, deployment: bool,
                  shared_policy: bool = False) -> "NodeGuard":
        """Check the run config against the policy (a deployment node without one: built-in models
        and private methods only) and, on a data owner's node (``deployment``), the rules no run
        config may bend — no seed unless the policy allows seeds, a declared n_min under distributed
        noise, a record of the rounds answered where the node draws noise of its own — before any
        record is read or any model factory imported; raise :class:`Refused`.

        ``shared_policy``: the policy serves several simulated nodes (``$DIFF2_NODE_POLICY``): each
        keeps its own ledger file, ``<ledger>.partition-<i>``."""
        if policy is not None:
            check_run(policy, cfg, node)
        elif deployment:
            where = ("(no node policy: a data owner's node runs only the built-in models; its "
                     "operator may list others)")
            check_model(cfg, BUILTIN_MODELS, node, where)
            if not cfg.private:
                raise Refused(node, "methods",
                              "the run asks method 'gd', which releases unnoised means; a data "
                              "owner's node runs only private methods (dpgd, diff2).")
        shared = shared_policy and not deployment
        answers = None if policy is None else AnswerLog(policy.answers_path(partition_id, shared))
        if deployment:
            check_deployment_run(cfg, node, policy, keeps_record=answers is not None)
        return cls(cfg, node, partition_id, str(run_id), policy, shared_policy=shared,
                   answers=answers)

    # ------------------------------------------------------------------ gradient rounds
    def check_task(self, r: int, radius: float, x_current: np.ndarray,
                   x_previous: np.ndarray | None, n_min: int, num_samples: int) -> None:
        """Refuse a gradient task whose round, kind, radius or n_min disagrees with the run
        config."""
        self._admit(n_min, num_samples)
        t, kind = self.cfg.training, "restart" if x_previous is None else "difference"
        if not 1 <= r <= t.rounds:
            self._refuse("round",
                         f"the task is for round {r}; the run has rounds 1..{t.rounds} "
                         f"(training.rounds).")
        want = "restart" if is_restart(r, self.cfg.restart_every) else "difference"
        if kind != want:
            self._refuse("round kind",
                         f"round {r} is a {want} round (T = {self.cfg.restart_every}); the task "
                         f"is a {kind} round.")
        expected = self._radius(r, x_current, x_previous)
        ok = radius == expected or (math.isfinite(expected) and math.isclose(radius, expected,
                                                                             rel_tol=RADIUS_RTOL))
        if not ok or (self.cfg.private and not math.isfinite(radius)):
            self._refuse("radius",
                         f"round {r}'s clipping radius is {radius!r}; the run config makes it "
                         f"{expected!r} ({self._radius_rule(want)}).")
        # last, once every check passed: a share draws noise (never twice); a clipped mean is the
        # same for the same task
        if self.answers is not None:  # (no record kept: no digest to compute)
            distributed = self.cfg.private and self.cfg.privacy.distributed
            self._claim(r, "train", None if distributed else _task_digest(r, radius, n_min,
                                                                          x_current, x_previous))

    def _radius(self, r: int, x_current: np.ndarray, x_previous: np.ndarray | None) -> float:
        t = self.cfg.training
        if not self.cfg.private:
            return math.inf
        if x_previous is None:
            return float(t.clip_restart)
        return difference_radius(t.clip_diff, x_current, x_previous)

    def _radius_rule(self, kind: str) -> str:
        t = self.cfg.training
        if not self.cfg.private:
            return "method gd clips nothing"
        if kind == "restart":
            return f"C1 = training.clip_restart = {t.clip_restart:g}"
        return (f"C2 ||x_(r-1) - x_(r-2)|| of the iterates sent, C2 = training.clip_diff = "
                f"{t.clip_diff:g}")

    # ------------------------------------------------------------------ the owner's canaries
    def with_canaries(self, r: int, radius: float, x_current: np.ndarray,
                      x_previous: np.ndarray | None, n_min: int, contribution: Contribution,
                      dim: int, num_samples: int) -> Contribution:
        """The reply to a checked gradient task: with the policy's canary records added and round r
        observed (:mod:`~diff2_flwr.runtime.canary_monitor`); without canaries in the policy,
        ``contribution`` itself."""
        if self.policy is None or not self.policy.canaries.enabled:
            return contribution
        t = self.cfg.training
        folder = self.policy.canary_folder(self.partition_id,
                                           self.shared_policy) / _folder_name(self.run_id)
        meta = {"run_id": self.run_id, "node": self.node, "partition_id": self.partition_id,
                "method": self.cfg.method,
                "epsilon": self.cfg.privacy.epsilon, "delta": self.cfg.privacy.delta,
                "rounds": t.rounds,
                "restart_every": self.cfg.restart_every, "clients": self.cfg.clients,
                "n_min": n_min,
                "num_samples": num_samples, "learning_rate": t.learning_rate}
        monitor = CanaryMonitor.open(folder, count=self.policy.canaries.count, dim=dim, meta=meta)
        cal = _calibration(self.cfg, n_min)
        assert cal is not None  # a policy allows private methods only
        restart = x_previous is None
        sigma = cal.sigma1 if restart else cal.sigma2
        return monitor.reply(r, restart, radius, float(sigma) * radius, x_current, contribution)

    # ------------------------------------------------------------------ the local routine
    def check_local_task(self, task: LocalTask, num_samples: int) -> None:
        """Refuse a local task whose K, b, η, C3, σ3, q or n_min disagrees with the run config's
        calibration."""
        # the protocol requires both
        assert task.n_min is not None and task.sampling_prob is not None
        cal = self._admit(task.n_min, num_samples)
        loc, m = self.cfg.local, task.mechanism
        if not 1 <= task.round <= self.cfg.training.rounds:
            self._refuse("round", f"the local task is for round {task.round}; the run has rounds "
                         f"1..{self.cfg.training.rounds}.")
        if not loc.enabled or cal is None or cal.local is None:
            self._refuse("local.steps",
                         "the run config has no local routine (local.steps = 0); the server sent a "
                         "local task.")
        for rule, have, want in (("local.steps", m.steps, loc.steps),
                                 ("local.batch_size", m.batch_size, loc.batch_size),
                                 ("local.clip", m.clip, loc.clip),
                                 ("training.learning_rate", m.learning_rate,
                                  self.cfg.training.learning_rate),
                                  ("local sampling rate q", task.sampling_prob,
                                   cal.local.sampling_prob)):
            if have != want:
                self._refuse(rule,
                             f"the local task says {have!r}; the run config's calibration says "
                             f"{want!r}.")
        if not m.sigma >= cal.local.sigma3 * (1 - 1e-9):
            self._refuse("local sigma (σ3)",
                         f"the local task's σ3 = {m.sigma!r} is below the calibrated σ3 = "
                         f"{cal.local.sigma3!r} (ε = {self.cfg.privacy.epsilon:g}, n_min = "
                         f"{task.n_min}).")
        seed = self.cfg.training.seed
        if task.seed != (None if seed is None else local_seed(seed, task.round)):
            self._refuse("seed",
                         "the local task carries a seed for this node's batches and σ3 noise that "
                         "the run config does not make (" + (
                             "an unseeded run: the node draws them from its own entropy, so "
                         "that nobody else knows its noise" if seed is None
                         else "training.seed derives another")
                         + ").")
        self._claim(task.round, "local", None)  # the local steps draw noise: answered once

    # ------------------------------------------------------------------ shared
    def _admit(self, n_min: int, num_samples: int) -> Calibration | None:
        """n_min against this node's records and the run config; the calibration; the lifetime
        budget."""
        declared = self.cfg.privacy.n_min
        if n_min > num_samples:  # the message says that, not how many records the node holds
            self._refuse("n_min",
                         f"the task says n_min = {n_min}, more records than this node holds: its "
                         f"records' "
                         "sensitivity and sampling rate would exceed what the calibration "
                         "accounted.")
        if declared is not None and n_min != declared:
            self._refuse("n_min",
                         f"the task says n_min = {n_min}; the run config says privacy.n_min = "
                         f"{declared}.")
        try:
            cal = _calibration(self.cfg, n_min)
        except ValueError as err:
            self._refuse("calibration",
                         f"the run config cannot be calibrated with n_min = {n_min}: {err}")
        if self.policy is not None and self.policy.lifetime.enabled:
            if self.cfg.privacy.distributed:
                self._refuse("lifetime budget",
                             "this node keeps a lifetime budget, whose ledger composes central "
                             "Gaussian runs; a run with privacy.noise: distributed (Skellam) is "
                             "not charged to it yet, so it is refused.")
            # a client-sampled run gets here only if the policy says how to charge it
            # (lifetime.sampled_runs, policy.check_run at admit_run)
            self._charge(cal)
        return cal

    def _charge(self, cal: Calibration | None) -> None:
        """The run's whole planned schedule, charged once to the node's durable ledger (refused past
        the budget)."""
        assert cal is not None  # a policy allows private methods only
        path = self.policy.ledger_path(self.partition_id,
                                       self.shared_policy)  # type: ignore[union-attr]
        budget = self.policy.lifetime  # type: ignore[union-attr]
        charge = Charge.new(run_id=self.run_id, digest=config_digest(self.cfg.to_dict()),
                            node=self.node, events=RunEvents.from_calibration(cal))
        # client-sampled rounds are charged amplified only where the owner trusts the server's
        # draws; anywhere else (``unamplified``: a ``refuse`` node never charges one), as full
        # Gaussian rounds, as if the node were in every round
        if budget.sampled_runs != "amplified":
            charge = charge.without_amplification()
        try:
            NodeLedger(path).admit(charge, budget_epsilon=budget.epsilon, budget_delta=budget.delta)
        # in a refusal's one shape (``<node> refused: rule `lifetime budget`: ...``), which the
        # server finds in Flower's failure text (policy.refusal_in) and makes the run's error line;
        # the ledger's own message names the run, the ε spent and the ledger file
        except (BudgetExceeded, RunChanged) as err:
            raise Refused(self.node, "lifetime budget", str(err)) from None
        # unreadable or unwritable: no run is admitted until the ledger is restored
        except LedgerError as err:
            self._refuse("lifetime ledger", str(err))

    def _claim(self, r: int, stage: str, digest: str | None) -> None:
        """Record in the node's answer log that it answers round r's ``stage`` now (refused if
        answered before)."""
        if self.answers is None:
            return
        try:
            self.answers.claim(self.run_id, r, stage, digest=digest, node=self.node)
        except Replayed as err:
            raise Refused(self.node, "replay", str(err), message=str(err)) from None
        except AnswerLogError as err:
            self._refuse("answer log", str(err))

    def _refuse(self, rule: str, detail: str) -> None:
        raise Refused(self.node, rule, detail)


def check_deployment_run(cfg: ExperimentConfig, node: str, policy: NodePolicy | None, *,
                         keeps_record: bool) -> None:
    """What a data owner's node refuses whatever its policy says about ε (issue 38): a seed, an
    undeclared n_min under distributed noise, one that differs from the n_min the policy pins,
    node-side noise without a record of the rounds answered (``keeps_record``: the node has an
    answer log). ``diff2 deploy-local`` asks it too, before anything starts, for the policy it hands
    every node. Raises :class:`Refused`."""
    where = "" if policy is None else f" (policy {policy.source})"
    if cfg.training.seed is not None and not (policy is not None and policy.allow_seeded):
        raise Refused(node, "seed",
                      "the run config sets training.seed: a seed in the run config is known to "
                      "every "
                      "party, so it would fix this node's noise (its share, its rounding, its "
                      "local steps) and the "
                      "server's for whoever reads it; a data owner's node draws its noise from "
                      "its own entropy. Run "
                      "with training.seed: null (seeds are for simulations and tests, or a policy "
                      "with "
                      f"allow_seeded: true){where}.")
    private = cfg.private
    distributed = private and cfg.privacy.distributed
    if distributed and cfg.privacy.n_min is None:
        raise Refused(node, "n_min",
                      "under distributed noise n_min is a federation constant: the run config "
                      "must declare privacy.n_min (the smallest shard's record count, agreed by "
                      "the data owners). Each node calibrates its share from it: a server that "
                      "sent each node its own n_min would shrink every share.")
    if (private and policy is not None and policy.n_min is not None
            and cfg.privacy.n_min != policy.n_min):
        raise Refused(node, "n_min",
                      f"the run declares privacy.n_min = {cfg.privacy.n_min}; this node's policy "
                      f"pins the federation's n_min = {policy.n_min}{where}. Declare "
                      f"privacy.n_min: {policy.n_min}.")
    if not keeps_record and (distributed or cfg.local.enabled):
        raise Refused(node, "answers", "the run has this node draw noise of its own ("
                      + ("its distributed-noise share" if distributed
                         else "the local routine's σ3") + "), and the node keeps no record of the "
                                                          "rounds it answered (it has no node "
                                                          "policy, whose `answers` file holds "
                                                          "it): a replayed round would draw that "
                                                          "noise again. Its operator gives it a "
                                                          "policy (--node-config "
                                                          "\"policy='/path/policy.yaml'\").")


def _task_digest(r: int, radius: float, n_min: int, x_current: np.ndarray,
                 x_previous: np.ndarray | None) -> str:
    """A digest of what a gradient task carries: the same digest is the same clipped mean, answered
    again."""
    h = hashlib.sha256(repr((int(r), float(radius).hex(), int(n_min))).encode())
    for x in (x_current, x_previous):
        h.update(b"none" if x is None else np.ascontiguousarray(x, dtype=np.float64).tobytes())
    return h.hexdigest()


def _folder_name(run_id: str) -> str:
    """The run's folder name: its id, with anything but letters, digits, '-' and '_' replaced."""
    return "run-" + "".join(c if c.isalnum() or c in "-_" else "_" for c in run_id)
