"""Whether the noise drowns the signal: said before a run (the noise against the clipping radius)
and after (a loss that ended far above x_0's).

Before. A released round adds N(0, (σC)² I_d) to the average of the workers' ClippedMeans, whose
norm is at most the round's radius C (C1 in restart rounds, C2·‖x_(r-1) - x_(r-2)‖ in difference
rounds: every ClippedMean lies in the ball of radius C, so their mean does too). The noise's
expected norm is σC·χ̄_d, with χ̄_d ≈ √d the chi mean
(:func:`~diff2_flwr.core.privacy.expected_noise_norm`), so

    E‖noise‖ / C = σ χ̄_d   (σ: the calibration's σ1 or σ2, per unit radius; d: the model's
    parameters),

whatever C is. Above :data:`NOISE_RATIO_LIMIT` = 1 the noise is longer than the longest signal the
round can carry, whatever the data: each release then points more along the noise than along the
gradient (an unclipped mean is usually much shorter than C, so the real ratio is worse).
``privacy.max_sigma`` refuses σ > 1 per coordinate; this warns at the much lower σ >
1/χ̄_d, where the whole vector drowns.

After. A run whose final loss exceeds :data:`LOSS_RISE_LIMIT` × its round-0 loss (x_0's) made the
model worse: it ends ``completed``, with a warning in the console, ``summary.json`` and ``diff2
run``'s JSON that says why: radius feedback when the released radii grew geometrically
(:mod:`~diff2_flwr.runtime.step_report`: the step feeds its own noise), else the noise drowning the
signal when a round's expected noise norm exceeds its radius, else the step. Each fix names the
settings as the caller gave them (``learning_rate=`` on the Python API's path, ``training.
learning_rate`` on the YAML path).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ..core.privacy import Calibration, expected_noise_norm
from .step_report import Feedback, Names, feedback_cause, radius_feedback

__all__ = ["NOISE_RATIO_LIMIT", "LOSS_RISE_LIMIT", "NoiseRatio", "noise_ratios", "noise_summary",
           "noise_warning",
           "LossRise", "loss_rise", "loss_rise_warning"]

#: Warn when a round's expected noise norm exceeds this many clipping radii (the longest signal it
#: can carry).
NOISE_RATIO_LIMIT = 1.0
#: "Far above x_0's": a final loss more than this many times the round-0 loss.
LOSS_RISE_LIMIT = 2.0


def _what_to_do(names: Names) -> str:
    """The fixes of drowned noise, named as the caller names the settings."""
    return (f"raise {names('privacy.epsilon')}, train on more records (σ ∝ 1/(n_min·P), about 1/n; "
            f"a skewed partition's small n_min raises it), train a smaller model (fewer parameters "
            f"d), or plan fewer rounds ({names('training.rounds')})")


@dataclass(frozen=True)
class NoiseRatio:
    """One kind of round's expected noise norm per unit clipping radius, σ χ̄_d."""

    kind: str  # "restart" or "difference"
    sigma: float  # σ1 or σ2: noise std per coordinate per unit radius
    ratio: float  # E‖noise‖ / C


def noise_ratios(calibration: Calibration, dim: int) -> tuple[NoiseRatio, ...]:
    """E‖noise‖ / C of the restart rounds and (when there are any) of the difference rounds."""
    kinds = [("restart", calibration.sigma1)]
    if calibration.difference_rounds and calibration.sigma2 is not None:
        kinds.append(("difference", calibration.sigma2))
    return tuple(NoiseRatio(kind, sigma, expected_noise_norm(sigma, dim)) for kind, sigma in kinds)


def noise_summary(calibration: Calibration, dim: int) -> dict[str, float | int]:
    """The estimate as data for the summary: ``{"parameters": d, "limit": 1, "restart": ...,
    "difference": ...}``."""
    return {"parameters": dim, "limit": NOISE_RATIO_LIMIT,
            **{r.kind: r.ratio for r in noise_ratios(calibration, dim)}}


#: Said with a warning that the difference rounds' ratio tops: their radius follows the step.
_DIFFERENCE_NOTE = (
    " In difference rounds the radius is C2·‖x_(r-1) - x_(r-2)‖, so their noise shrinks with the "
    "step: what decides there is the gain g = η·C2·σ2·χ̄_d, this ratio times η·C2 (below 1/2 the "
    "step keeps that noise small; above 1 the step feeds it, and the radius grows round after "
    "round: lower {lr} or {c2}).")


def noise_warning(calibration: Calibration, dim: int, names: Names = str) -> str | None:
    """One line when a round's expected noise norm exceeds :data:`NOISE_RATIO_LIMIT` clipping radii,
    else None (``names``: how the caller names the settings, see
    :func:`~diff2_flwr.runtime.step_report.names_of`)."""
    ratios = noise_ratios(calibration, dim)
    worst = max(ratios, key=lambda r: r.ratio)
    if worst.ratio <= NOISE_RATIO_LIMIT:
        return None
    index = "1" if worst.kind == "restart" else "2"
    each = ", ".join(f"{r.ratio:.3g}× in {r.kind} rounds" for r in ratios)
    return (
        f"the noise drowns the signal: each release adds noise of expected norm {each} the "
        f"clipping radius (σ{index} = {worst.sigma:.3g} per coordinate over d = {dim} parameters: "
        f"≈ σ√d; ε = {calibration.epsilon:g}, n_min = {calibration.n_min}, P = "
        f"{calibration.clients}, R = {calibration.rounds}). Above {NOISE_RATIO_LIMIT:g} the noise "
        f"is longer than the longest signal a round can carry: each step points more along the "
        f"noise than along the gradient, so training may not learn and the loss may grow (x_0's "
        f"loss is compared with the final one at the end). To fix: {_what_to_do(names)}."
        + (_DIFFERENCE_NOTE.format(lr=names("training.learning_rate"),
                                   c2=names("training.clip_diff"))
           if worst.kind == "difference" else ""))


@dataclass(frozen=True)
class LossRise:
    """A loss that ended far above x_0's: which metric, round 0's value, the final value and their
    ratio; and the radius feedback the rows show, if any (:func:`~diff2_flwr.runtime.step_report.
    radius_feedback`)."""

    metric: str
    initial: float
    final: float
    ratio: float
    feedback: Feedback | None = None

    def as_dict(self) -> dict[str, float | str]:
        """The rise as the summary's ``loss_rise`` entry, with :data:`LOSS_RISE_LIMIT`."""
        cause = "radius_feedback" if self.feedback is not None else None
        return {"metric": self.metric, "initial": self.initial, "final": self.final,
                "ratio": self.ratio,
                "limit": LOSS_RISE_LIMIT, **({"cause": cause} if cause else {})}


def loss_rise(history: Sequence[Mapping[str, object]]) -> LossRise | None:
    """The train loss (else the test loss) at the last evaluated round against round 0's, when it
    ended more than :data:`LOSS_RISE_LIMIT` times higher (or not finite), with the radius feedback
    the rows show; None when it did not, or when it was not evaluated."""
    for metric in ("train_loss", "test_loss"):
        rows = [r for r in history if isinstance(r.get(metric), (int, float))]
        if len(rows) < 2 or rows[0].get("round") != 0:
            continue
        initial, final = float(rows[0][metric]), float(rows[-1][metric])
        if not math.isfinite(initial) or initial <= 0:
            return None
        ratio = final / initial if math.isfinite(final) else math.inf
        if ratio <= LOSS_RISE_LIMIT:
            return None
        return LossRise(metric, initial, final, ratio, radius_feedback(history))
    return None


def loss_rise_warning(rise: LossRise, *, private: bool = True, names: Names = str,
                      noise: Mapping[str, Any] | None = None) -> str:
    """The post-run line for :func:`loss_rise`'s finding, with its cause: radius feedback (seen in
    the rows), else drowned noise (a ratio of ``noise`` above :data:`NOISE_RATIO_LIMIT`), else the
    step.

    Args:
        rise: the finding.
        private: the run added noise.
        names: how the caller names the settings (:func:`~diff2_flwr.runtime.step_report.names_of`).
        noise: the pre-flight estimate (:func:`noise_summary`, the summary's ``noise_to_radius``);
            None: not known, and the cause between noise and step is left open.
    """
    lr = names("training.learning_rate")
    head = (
        f"the run completed but made the model worse: the final {rise.metric} {rise.final:.4g} is "
        f"{rise.ratio:.3g}× x_0's {rise.initial:.4g} (round 0; 'far above' means more than "
        f"{LOSS_RISE_LIMIT:g}×).")
    ratios = {k: v for k, v in (noise or {}).items()
              if k in ("restart", "difference") and isinstance(v, (int, float))}
    each = ", ".join(f"{v:.3g}× in {k} rounds" for k, v in ratios.items())
    if rise.feedback is not None:
        also = ""
        if ratios.get("restart", 0.0) > NOISE_RATIO_LIMIT:
            also = (f" The restart rounds' noise is also {ratios['restart']:.3g}× their radius, so "
                    f"it drowns the signal there too: {_what_to_do(names)}.")
        return (
            f"{head} Cause: radius feedback, the step fed its own noise: "
            f"{feedback_cause(rise.feedback)}; see the warning at round {rise.feedback.round}. "
            f"To fix, at no privacy cost: lower {lr} or {names('training.clip_diff')}, or restart "
            f"more often ({names('training.restart_every')}); a larger {names('privacy.epsilon')} "
            f"helps too.{also}")
    if not private:
        return f"{head} Without noise, that is the step: lower {lr}."
    if not ratios:
        return (f"{head} The radius did not feed back; the noise probably drowned the signal (see "
                f"the pre-flight noise estimate, summary.json's noise_to_radius), or {lr} is too "
                f"large. To fix: {_what_to_do(names)}, or lower {lr}.")
    if max(ratios.values()) > NOISE_RATIO_LIMIT:
        return (f"{head} Cause: the noise drowned the signal (its expected norm is {each} the "
                f"clipping radius; the radius did not feed back). To fix: {_what_to_do(names)}, or "
                f"lower {lr}.")
    return (f"{head} Cause: neither drowned noise (its expected norm is only {each} the clipping "
            f"radius) nor radius feedback: the step overshoots. To fix: lower {lr}.")
