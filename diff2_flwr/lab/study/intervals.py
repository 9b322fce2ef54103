"""Confidence intervals of a paired comparison: the mean difference and the ratio treatment/control.

Every paired test of a study (:func:`~.analysis.summarise`) carries, beside its p, the two-sided
95 % interval of what it tests, whatever the study's α and whatever the test's alternative (a
one-sided test still gets the two-sided interval: the interval says how large the effect is, the
test whether it is there):

* ``ci95_difference``: the t-interval of the mean paired difference d̄ = mean(treatment − control)
  on the endpoint's scale, d̄ ± t₀.₉₇₅,ₙ₋₁ · s_d / √n (n evaluation seeds, s_d the sample standard
  deviation of the differences);
* ``ratio`` and ``ci95_ratio``, treatment / control:

  - on the **log** scale the differences are log ratios, so the ratio is exp(d̄), the ratio of the
    geometric means, and its interval is exp of ``ci95_difference`` (exact: exp is monotone);
  - on the **linear** scale the ratio is that of the means, T̄ / C̄, and its interval is Fieller's
    for paired data: the ρ whose paired t-test of tᵢ − ρ·cᵢ against 0 keeps H0 at 5 %, i.e. the ρ
    with (T̄ − ρC̄)² ≤ t₀.₉₇₅,ₙ₋₁² · (s_TT − 2ρ s_TC + ρ² s_CC) / n. When the control's own mean is
    not distinguishable from 0 at that level (C̄² ≤ t² s_CC / n) that set is unbounded, and the
    interval is ``None`` with the reason in ``ci95_note``. (Dividing the difference's interval by
    C̄ would ignore C̄'s own noise: not valid.)

A comparison with a value that is not finite (a diverged run: inf; a log of a value ≤ 0: −inf; a
missing accuracy: NaN) has no p (:func:`~.inference.paired_ttest` gives NaN), and no interval nor
ratio either: all three are ``None`` and ``ci95_note`` says how many pairs were not finite.

References:
    Student's paired t-interval (n − 1 degrees of freedom; scipy.stats.t); Fieller (1954), "Some
    problems in interval estimation", JRSS B 16, 175–185 (the interval of a ratio of means); Franz
    (2007), "Ratios: a short guide to confidence limits and proper use", arXiv:0710.2024 (Fieller
    for paired, correlated data).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

__all__ = ["LEVEL", "difference_interval", "fieller_interval", "paired_intervals"]

#: The level of every interval (two-sided), whatever the study's α.
LEVEL = 0.95


def _pairs(treatment: Sequence[float], control: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    t = np.asarray(treatment, dtype=float)
    c = np.asarray(control, dtype=float)
    if t.shape != c.shape or t.ndim != 1 or t.size < 2:
        raise ValueError(f"A paired interval needs two samples of equal size >= 2. Found {t.size} "
                         f"and {c.size}.")
    return t, c


def _quantile(n: int, level: float) -> float:
    """t_{(1 + level)/2, n − 1}: the two-sided quantile of Student's t with n − 1 degrees of
    freedom."""
    from scipy import stats  # noqa: PLC0415 -- scipy loads only where an interval is computed

    if not 0 < level < 1:
        raise ValueError(f"`level` must be in (0, 1). Found {level!r}.")
    return float(stats.t.ppf(0.5 + level / 2, n - 1))


def difference_interval(treatment: Sequence[float], control: Sequence[float],
                        level: float = LEVEL) -> tuple[float, float] | None:
    """The two-sided t-interval of mean(treatment − control) (pairs by position; None: a difference
    is not finite). With zero spread of the differences it is the point [d̄, d̄]."""
    t, c = _pairs(treatment, control)
    d = t - c
    if not np.all(np.isfinite(d)):
        return None
    half = _quantile(d.size, level) * float(np.std(d, ddof=1)) / math.sqrt(d.size)
    return float(d.mean()) - half, float(d.mean()) + half


def fieller_interval(treatment: Sequence[float], control: Sequence[float],
                     level: float = LEVEL) -> tuple[tuple[float, float] | None, str | None]:
    """Fieller's interval of mean(treatment) / mean(control) for paired samples, and why there is
    none.

    The set of ρ with (T̄ − ρC̄)² ≤ q² · var(tᵢ − ρcᵢ) / n, q the t quantile: the roots of
    a ρ² + b ρ + c = 0 with a = C̄² − q² s_CC / n, b = −2 (T̄C̄ − q² s_TC / n), c = T̄² − q² s_TT / n.
    Bounded only when a > 0 (the control's mean is distinguishable from 0); else ``(None,
    reason)``.
    """
    t, c = _pairs(treatment, control)
    if not (np.all(np.isfinite(t)) and np.all(np.isfinite(c))):
        return None, "a value is not finite"
    n = t.size
    q2 = _quantile(n, level) ** 2 / n
    cov = np.cov(t, c, ddof=1)
    tm, cm = float(t.mean()), float(c.mean())
    a = cm * cm - q2 * cov[1, 1]
    if a <= 0:
        return None, (f"Fieller's set is unbounded: the control's mean {cm:.3g} is not "
                      f"distinguishable from 0 at {level:.0%} (C̄² ≤ t²·s²_C/n)")
    b = -2.0 * (tm * cm - q2 * cov[0, 1])
    cc = tm * tm - q2 * cov[0, 0]
    # T̄/C̄ lies in the set, so the discriminant is >= 0 but for rounding
    root = math.sqrt(max(b * b - 4.0 * a * cc, 0.0))
    return (float((-b - root) / (2 * a)), float((-b + root) / (2 * a))), None


def paired_intervals(treatment: Sequence[float], control: Sequence[float],
                     scale: str = "linear", level: float = LEVEL) -> dict[str, Any]:
    """The interval fields of one paired test (see the module's docstring).

    Args:
        treatment: the treatment's endpoint values, one per evaluation seed, on ``scale``.
        control: the control's, paired by position.
        scale: ``log`` (the values are logs: the ratio is exp of the mean difference) or
            ``linear`` (the ratio of the means, Fieller's interval).
        level: the two-sided level (0.95 in every study: the fields are named for it).

    Returns:
        ``ci95_difference`` ([lo, hi] or None), ``ratio`` (treatment / control or None),
        ``ratio_kind`` (``geometric-mean ratio`` or ``ratio of means``), ``ci95_ratio`` ([lo, hi]
        or None), ``ci95_ratio_method`` and ``ci95_note`` (why an interval is None; else None).
    """
    if scale not in ("linear", "log"):
        raise ValueError(f"`scale` must be 'linear' or 'log'. Found {scale!r}.")
    t, c = _pairs(treatment, control)
    log = scale == "log"
    out: dict[str, Any] = {
        "ci95_difference": None, "ratio": None,
        "ratio_kind": "geometric-mean ratio" if log else "ratio of means", "ci95_ratio": None,
        "ci95_ratio_method": "exp of ci95_difference" if log else "Fieller (paired)",
        "ci95_note": None}
    bad = int(np.sum(~np.isfinite(t - c)))
    if bad:
        out["ci95_note"] = (f"{bad} of {t.size} paired differences not finite (a diverged run, a "
                            "log of a value <= 0, or a missing accuracy): no interval, as no p")
        return out
    diff = difference_interval(t, c, level)
    out["ci95_difference"] = list(diff)  # finite: every difference is
    if log:
        with np.errstate(over="ignore"):
            out["ratio"] = float(np.exp(np.mean(t - c)))
            out["ci95_ratio"] = [float(np.exp(diff[0])), float(np.exp(diff[1]))]
        return out
    if float(c.mean()) == 0.0:
        out["ci95_note"] = "the control's mean is 0: no ratio"
        return out
    out["ratio"] = float(t.mean()) / float(c.mean())
    ratio, why = fieller_interval(t, c, level)
    out["ci95_ratio"], out["ci95_note"] = (list(ratio) if ratio else None), why
    return out
