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
``dataset.partitioner.max_sigma`` refuses σ > 1 per coordinate; this warns at the much lower σ >
1/χ̄_d, where the whole vector drowns.

After. A run whose final loss exceeds :data:`LOSS_RISE_LIMIT` × its round-0 loss (x_0's) made the
model worse: it ends ``completed``, with a warning in the console, ``summary.json`` and ``diff2
run``'s JSON.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from ..core.privacy import Calibration, expected_noise_norm

__all__ = ["NOISE_RATIO_LIMIT", "LOSS_RISE_LIMIT", "NoiseRatio", "noise_ratios", "noise_summary",
           "noise_warning",
           "LossRise", "loss_rise", "loss_rise_warning"]

#: Warn when a round's expected noise norm exceeds this many clipping radii (the longest signal it
#: can carry).
NOISE_RATIO_LIMIT = 1.0
#: "Far above x_0's": a final loss more than this many times the round-0 loss.
LOSS_RISE_LIMIT = 2.0

_WHAT_TO_DO = (
    "raise privacy.epsilon, train on more records (σ ∝ 1/(n_min·P), about 1/n; a skewed "
    "partition's small n_min raises it), train a smaller model (fewer parameters d), or plan "
    "fewer rounds (training.rounds)")


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


def noise_warning(calibration: Calibration, dim: int) -> str | None:
    """One line when a round's expected noise norm exceeds :data:`NOISE_RATIO_LIMIT` clipping radii,
    else None."""
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
        f"loss is compared with the final one at the end). To fix: {_WHAT_TO_DO}.")


@dataclass(frozen=True)
class LossRise:
    """A loss that ended far above x_0's: which metric, round 0's value, the final value and their
    ratio."""

    metric: str
    initial: float
    final: float
    ratio: float

    def as_dict(self) -> dict[str, float | str]:
        """The rise as the summary's ``loss_rise`` entry, with :data:`LOSS_RISE_LIMIT`."""
        return {"metric": self.metric, "initial": self.initial, "final": self.final,
                "ratio": self.ratio,
                "limit": LOSS_RISE_LIMIT}


def loss_rise(history: Sequence[Mapping[str, object]]) -> LossRise | None:
    """The train loss (else the test loss) at the last evaluated round against round 0's, when it
    ended more than :data:`LOSS_RISE_LIMIT` times higher (or not finite); None when it did not, or
    when it was not evaluated."""
    for metric in ("train_loss", "test_loss"):
        rows = [r for r in history if isinstance(r.get(metric), (int, float))]
        if len(rows) < 2 or rows[0].get("round") != 0:
            continue
        initial, final = float(rows[0][metric]), float(rows[-1][metric])
        if not math.isfinite(initial) or initial <= 0:
            return None
        ratio = final / initial if math.isfinite(final) else math.inf
        return LossRise(metric, initial, final, ratio) if ratio > LOSS_RISE_LIMIT else None
    return None


def loss_rise_warning(rise: LossRise, *, private: bool = True) -> str:
    """The post-run line for :func:`loss_rise`'s finding (``private``: the run added noise)."""
    head = (
        f"the run completed but made the model worse: the final {rise.metric} {rise.final:.4g} is "
        f"{rise.ratio:.3g}× x_0's {rise.initial:.4g} (round 0; 'far above' means more than "
        f"{LOSS_RISE_LIMIT:g}×).")
    if not private:
        return f"{head} Without noise, that is the step: lower training.learning_rate."
    return (
        f"{head} The noise probably drowned the signal (see the pre-flight noise estimate, "
        f"summary.json's "
            f"noise_to_radius), or training.learning_rate is too large. To fix: {_WHAT_TO_DO}, or "
            f"lower "
            "training.learning_rate.")
