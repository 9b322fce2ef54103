"""Every side effect of a run's server, in one object: the checkpoint, the rows, the summary,
curves, the console.

The server's decisions are pure (:mod:`~diff2_flwr.runtime.server_core`); a driver hands the journal
each state they return, and the journal makes it durable and visible, in this order for round r: the
checkpoint (owner-only, before anything else of round r is written), the evaluation of x_r (when
due) and round r's row (``history``, ``metrics.jsonl``, one console line), and at the end of the run
the outcome check, the final parameters, ``summary.json`` and ``curves.png``.

The clip statistics (:data:`CLIP_STATS`) are counted on the private records without noise: the
journal drops them from every row unless the run opts in (``evaluation.clip_stats``).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from ..core.privacy import PLD_DISCRETIZATION
from ..core.routines import describe_routine
from ..core.schedules import describe_schedule
from .checkpoint import Checkpoint, save_checkpoint
from .curves import EXACT_GDP, PLD, SKELLAM_RDP
from .noise_report import loss_rise, loss_rise_warning
from .outputs import RunRecorder, to_json
from .step_report import names_of
from .server_core import Released, ServerSpec, ServerState, is_done

__all__ = ["CLIP_STATS", "Journal", "accountant", "summarize"]

#: Row keys computed from the private records without noise, released only with
#: ``evaluation.clip_stats`` (the server itself uses the workers' clip counts only to check each
#: reply).
CLIP_STATS = ("clip_fraction",)


class Journal:
    """Writes and says what the server's states release; reads nothing back but a resumed run's
    rows.

    Args:
        spec: the server the journal records (rounds, routine, calibration, n_min).
        evaluator: metrics of a released iterate (``evaluator(x) -> {metric: value}``), or None.
        eval_every: evaluate every this many rounds (always rounds 0 and R).
        recorder: the run folder (``metrics.jsonl``, ``summary.json``, ``curves.png``), or None.
        run_info: extra fields of the summary.
        progress: where the console lines go (None: nowhere).
        checkpoint_path: where the state is made durable after every round (None: not at all).
        fingerprint: the run's identity in the checkpoint.
        clip_stats: release :data:`CLIP_STATS` (unaccounted) in the rows.
    """

    def __init__(  # noqa: PLR0913 -- the journal's options, keyword-only (Journal.of reads them)
            self, *, spec: ServerSpec,
            evaluator: Callable[[np.ndarray], dict[str, float]] | None = None,
            eval_every: int = 1, recorder: RunRecorder | None = None,
            run_info: Mapping[str, Any] | None = None,
            progress: Callable[[str], None] | None = print,
            checkpoint_path: Path | None = None, fingerprint: str = "",
            clip_stats: bool = False) -> None:
        self.spec = spec
        self.evaluator, self.eval_every = evaluator, eval_every
        self.recorder, self.progress = recorder, progress
        self.run_info = dict(run_info or {})
        self.checkpoint_path, self.fingerprint = checkpoint_path, fingerprint
        self.clip_stats = clip_stats
        self.history: list[dict[str, Any]] = []
        self._started = time.perf_counter()

    @classmethod
    def of(cls, spec: ServerSpec, *, evaluator: Callable[[np.ndarray], dict[str,
                                                                            float]] | None = None,
           recorder: RunRecorder | None = None, run_info: Mapping[str, Any] | None = None,
           progress: Callable[[str], None] | None = print, checkpoint_path: Path | None = None,
           fingerprint: str = "") -> "Journal":
        """The journal of a server built from an experiment (:meth:`ServerSpec.of`): its options
        (``evaluation.every``, ``evaluation.clip_stats``) read from the spec's settings; what it
        writes to and says given here."""
        if spec.settings is None:
            raise ValueError(
                "Journal.of needs a spec built from an experiment (ServerSpec.of); construct a "
                "Journal for a spec assembled by hand.")
        evaluation = spec.settings.evaluation
        return cls(spec=spec, evaluator=evaluator, eval_every=evaluation.every, recorder=recorder,
                   run_info=run_info, progress=progress, checkpoint_path=checkpoint_path,
                   fingerprint=fingerprint, clip_stats=evaluation.clip_stats)

    def say(self, line: str) -> None:
        """One console line (nothing without ``progress``)."""
        if self.progress:
            self.progress(line)

    # ---------------------------------------------------------------- the run's events
    def start(self, state: ServerState) -> None:
        """Round 0: the noise key is durable before anything is written or released; then x_0's
        row."""
        initial = {"round": 0, "kind": "init"}
        self._checkpoint(state, initial)
        self._record_release(state, initial, True)

    def resume(self, state: ServerState, checkpoint: Checkpoint) -> None:
        """Continue a checkpointed run: its rows so far; round r's row if the server died before
        writing it."""
        self.history = list(self.recorder.kept) if self.recorder else []
        self.say(f"[diff2] resumed from {self.checkpoint_path} after round {state.estimator.round} "
                 f"(ε spent so far {state.epsilon_spent:.4g})")
        recorded = {r["round"] for r in self.history}
        if (self.recorder is not None and checkpoint.release_row is not None
                and state.estimator.round not in recorded):
            # Died after round r's checkpoint, before its row: write the row now (x_r is released
            # already).
            self._record_release(state, dict(checkpoint.release_row),
                                 bool(np.all(np.isfinite(state.estimator.x))))

    def released(self, state: ServerState, out: Released) -> None:
        """Round r: the checkpoint (durable before anything of round r is written elsewhere), then
        its row."""
        row = dict(out.row)
        self._checkpoint(state, row)
        self._record_release(state, row, out.diverged is None)

    def completed(self, state: ServerState) -> None:
        """The end of a completed run: the outcome check, x_R, the summary and the curves."""
        self._check_outcome()
        if self.recorder:
            self.recorder.parameters(state.estimator.x)
        self._write_summary(state)
        self._draw_curves(state)

    def failed(self, state: ServerState) -> None:
        """The end of a run stopped by an error (``state.error``): say it, the summary and the
        curves."""
        self.say(f"[diff2] run failed: {state.error}")
        self._write_summary(state)
        self._draw_curves(state)

    def summary(self, state: ServerState) -> dict:
        """The run's summary now (what ``summary.json`` holds)."""
        return summarize(self.spec, state, self.history, self.run_info,
                         time.perf_counter() - self._started)

    # ---------------------------------------------------------------- helpers
    def _checkpoint(self, state: ServerState, release_row: dict) -> None:
        if self.checkpoint_path is not None:
            run_dir = str(self.recorder.directory) if self.recorder else None
            save_checkpoint(self.checkpoint_path, Checkpoint(self.fingerprint, state.estimator,
                                                             state.ledger, run_dir, to_json(
                                                                 release_row), describe_routine(
                                                                     self.spec.routine)))

    def _record_release(self, state: ServerState, row: dict, finite: bool) -> None:
        """Evaluate x_r (when due and finite) and record round r's row."""
        r = state.estimator.round
        due = is_done(self.spec, state) or r == 0 or r % self.eval_every == 0
        # an exact ledger's PLD: where the run evaluates
        if "epsilon_pld" in row and row["epsilon_pld"] is None:
            if due:
                row["epsilon_pld"] = state.epsilon_pld
            else:
                del row["epsilon_pld"]
        if finite and self.evaluator is not None and due:
            row.update(self.evaluator(state.estimator.x))
        self._record(state, row)

    def _record(self, state: ServerState, row: dict) -> None:
        """Release round r's row: history, metrics.jsonl, the console (without the clip statistics
        unless opted in)."""
        if not self.clip_stats:
            for key in CLIP_STATS:
                row.pop(key, None)
        row["elapsed_s"] = time.perf_counter() - self._started
        self.history.append(row)
        if self.recorder:
            self.recorder.row(row)
            if row["round"] == 0:
                self._write_summary(state)
        if self.progress:
            shown = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k,
                             v in row.items()
                             if k not in ("round", "kind", "elapsed_s"))
            self.progress(
                f"[diff2] round {row['round']}/{self.spec.rounds} ({row['kind']}) {shown}")

    def _check_outcome(self) -> None:
        """A completed run whose loss ended far above x_0's says so (console, summary): completed is
        not learned."""
        rise = loss_rise(self.history)
        if rise is None:
            return
        warning = loss_rise_warning(rise,
                                    private=self.spec.calibration is not None
                                    or self.spec.distributed is not None,
                                    names=names_of(self.spec.settings),
                                    noise=self.run_info.get("noise_to_radius"))
        self.run_info["loss_rise"] = rise.as_dict()
        self.run_info["warnings"] = [*self.run_info.get("warnings", ()), warning]
        self.say(f"[diff2] WARNING: {warning}")

    def _write_summary(self, state: ServerState) -> None:
        if self.recorder:
            self.recorder.summary(self.summary(state))

    def _draw_curves(self, state: ServerState) -> None:
        """``curves.png`` at the end of a run (completed or failed); a drawing failure never fails
        the run."""
        if self.recorder is None or not self.history:
            return
        name = self.run_info.get("name", "run")
        title = (f"{name}: {self.run_info.get('method', '')}, {state.status}, "
                 f"round {state.estimator.round}/{self.spec.rounds}")
        try:
            self.recorder.curves(self.history, title,
                                 {"accountant": accountant(self.spec, state)})
        except Exception as err:  # noqa: BLE001 (a picture must not fail a private run)
            self.say(f"[diff2] WARNING: curves.png not drawn ({type(err).__name__}: {err})")


def summarize(spec: ServerSpec, state: ServerState, history: list[dict[str, Any]],
              run_info: Mapping[str, Any], wall_time_s: float) -> dict:
    """The summary of a run: ``run_info``, how it stands, the privacy spent and the final and best
    metrics.

    Args:
        spec: the run's server.
        state: its state now.
        history: the rows released so far.
        run_info: the run's own fields (name, config, dataset, warnings, ...), first in the summary.
        wall_time_s: seconds since the server started.
    """
    evaluated = [r for r in history if "train_loss" in r or "test_loss" in r]
    final = evaluated[-1] if evaluated else {}
    metric_keys = ("train_loss", "grad_norm_sq", "test_loss")
    accuracy_keys = tuple(k for k in ("train_accuracy",
                                      "test_accuracy") if any(k in r for r in evaluated))
    # Losses and ‖∇f‖²: best = smallest; accuracies: best = largest (each over the evaluated
    # rounds).
    best = {k: min((r[k] for r in evaluated if k in r and math.isfinite(r[k])),
                   default=None) for k in metric_keys}
    best |= {k: max((r[k] for r in evaluated if k in r and math.isfinite(r[k])),
                    default=None) for k in accuracy_keys}
    metric_keys += accuracy_keys
    return {
        **run_info,
        "status": state.status,
        "error": state.error,
        "rounds_planned": spec.rounds,
        "rounds_released": state.estimator.round,
        "diverged_at": state.diverged_at,
        "routine": describe_routine(spec.routine),
        "schedule": describe_schedule(spec.schedule),
        "privacy": _privacy(spec, state),
        "final": {k: final.get(k) for k in metric_keys} | {"round": final.get("round")},
        "best": best,
        "wall_time_s": wall_time_s,
    }


def accountant(spec: ServerSpec, state: ServerState) -> str | None:
    """The accountant behind the run's ``epsilon_spent`` now (the summary's
    ``privacy.accountant``): Skellam RDP under distributed noise; PLD once the ledger holds a local
    phase (subsampled steps: no closed form); else the exact μ-GDP closed form (also under
    ``privacy.mode: rdp``, which only calibrates the noise by zCDP); None without noise."""
    if spec.distributed is not None:
        return SKELLAM_RDP
    if spec.calibration is None:
        return None
    return EXACT_GDP if state.ledger is None or state.ledger.exact else PLD


def _privacy(spec: ServerSpec, state: ServerState) -> dict[str, Any]:
    """The summary's ``privacy`` block: the guarantee, ε by each accountant, the calibration, the
    noise key's kind."""
    cal, ledger, local = spec.calibration, state.ledger, spec.local
    if spec.distributed is not None:
        return _distributed_privacy(spec, state)
    name = accountant(spec, state)
    return {
        "private": cal is not None,
        "guarantee": "record-level (ε, δ)-DP, replace-one adjacency, central DP (trusted server "
                     "adds the noise)"
        if cal else "none (method gd: no clipping, no noise)",
        "epsilon_spent": state.epsilon_spent,
        "accountant": name,
        "epsilon_accountant": ("exact μ-GDP composition (Dong, Roth & Su 2019)" + (
            "; the noise calibrated by zCDP (privacy.mode rdp)"
            if cal is not None and cal.mode == "rdp" else "")) if name != PLD else
        "dp-accounting PLD (local steps: Poisson-subsampled Gaussian, replace-one)",
        "epsilon_pld": state.epsilon_pld if ledger else None,
        "epsilon_pld_accountant": f"dp-accounting PLD, pessimistic, discretisation "
                                  f"{PLD_DISCRETIZATION:g}" + (
                                      ": the accountant of epsilon_spent" if name == PLD else ""),
        "epsilon_rdp": state.epsilon_rdp if ledger else None,
        **({"epsilon_rdp_note": "dp-accounting's RDP accountant has no replace-one Poisson "
                                "subsampling: local steps enter it unamplified (a valid, looser "
                                "bound)"} if local is not None else {}),
        "delta": cal.delta if cal else None,
        "epsilon_target": cal.epsilon if cal else None,
        "calibration": cal.as_dict() if cal else None,
        "noise_key": "seed (reproducible by anyone who knows it)" if state.estimator.noise_seeded
        else "os-entropy",
        "n_min": spec.n_min,
    }


def _distributed_privacy(spec: ServerSpec, state: ServerState) -> dict[str, Any]:
    """The summary's ``privacy`` block under distributed noise: the Skellam accountant, the threat
    parameter."""
    noise = spec.distributed
    assert noise is not None
    cal = noise.calibration
    return {
        "private": True,
        "guarantee": f"record-level (ε, δ)-DP, replace-one adjacency, distributed noise: each "
                     f"client adds Skellam noise, the server sees only the secure sum (Flower "
                     f"SecAgg+); holds if at most t = {noise.tolerated} of the P = "
                     f"{noise.clients} clients drop out or collude with the server",
        "noise": "distributed",
        "epsilon_spent": state.epsilon_spent,
        "accountant": SKELLAM_RDP,
        "epsilon_accountant": "Skellam Rényi DP (Agarwal, Kairouz & Liu 2021, Cor. 3.6) at Δ₂ = "
                              "2ρ, rounding included; dp-accounting's RDP-to-(ε, δ) conversion",
        "epsilon_pld": None,
        "epsilon_pld_accountant": "none: the Skellam RDP ledger is this mechanism's only "
                                  "accountant (the rows' epsilon_pld and epsilon_rdp repeat it)",
        "epsilon_rdp": state.epsilon_spent,
        "delta": cal.delta,
        "epsilon_target": cal.epsilon,
        "calibration": {"z1": cal.z1, "z2": cal.z2, "u": cal.u,
                        "restart_rounds": cal.restart_rounds,
                        "difference_rounds": cal.difference_rounds, "rho": cal.rho,
                        "padded_dim": cal.padded_dim,
                        "bits": noise.bits, "tolerated": noise.tolerated, "wrap": noise.wrap,
                        "epsilon_planned": cal.epsilon_spent},
        "noise_key": "each client's own (OS entropy, or training.seed per client and round)",
        "n_min": spec.n_min,
    }
