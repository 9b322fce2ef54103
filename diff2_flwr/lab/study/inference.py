"""Tests and multiplicity corrections for study reports: paired t-tests, Holm, Benjamini–Hochberg.

A report that reads many p-values at 0.05 finds "significant" differences by chance. Every study
therefore declares its *family* of tests up front (its ``analysis:`` block, :mod:`.study`), and
every report gives, beside each raw p:

* **Holm** (1979) adjusted p over the family of *primary* tests: controls the family-wise error
  rate (the chance of any false positive) at α under any dependence between the tests;
* **Benjamini–Hochberg** (1995) q over the family of *exploratory* tests: controls the expected
  share of false positives among the rejections (valid for independent or positively dependent
  tests; reported as exploratory, never as a confirmed result).

A test whose p is NaN (a diverged run made the difference undefined) still counts in its family
(``m`` is the family's size: dropping it would make the others' correction weaker) and keeps a NaN
adjusted value.

References:
    Holm (1979), "A simple sequentially rejective multiple test procedure", Scand. J. Statist. 6;
    Benjamini & Hochberg (1995), "Controlling the false discovery rate", JRSS B 57;
    scipy.stats.ttest_rel (the paired t-test, n − 1 degrees of freedom).
"""

from __future__ import annotations

import math
from typing import Literal, Sequence

import numpy as np

__all__ = ["ALTERNATIVES", "Alternative", "benjamini_hochberg", "holm", "paired_ttest", "two_sided"]

Alternative = Literal["less", "greater", "two-sided"]
#: ``less``: H1 mean(treatment − control) < 0; ``greater``: > 0; ``two-sided``: ≠ 0.
ALTERNATIVES: tuple[str, ...] = ("less", "greater", "two-sided")


def paired_ttest(treatment: Sequence[float], control: Sequence[float],
                 alternative: Alternative = "less") -> float:
    """p of the paired t-test of ``treatment`` against ``control`` (pairs by position; n − 1 degrees
    of freedom).

    NaN when a difference is not finite. With zero variance of the differences the test is
    degenerate: p is 0 when every difference lies strictly in the direction of H1 and 1 otherwise.
    """
    from scipy import stats  # noqa: PLC0415 -- scipy loads only where a test is computed

    if alternative not in ALTERNATIVES:
        raise ValueError(f"alternative must be one of {', '.join(ALTERNATIVES)}. Found "
                         f"{alternative!r}.")
    t = np.asarray(treatment, dtype=float)
    c = np.asarray(control, dtype=float)
    if t.shape != c.shape or t.ndim != 1 or t.size < 2:
        raise ValueError(f"A paired t-test needs two samples of equal size >= 2. Found {t.size} "
                         f"and {c.size}.")
    d = t - c
    if not np.all(np.isfinite(d)):
        return math.nan
    if np.all(d == d[0]):
        hit = {"less": d[0] < 0, "greater": d[0] > 0, "two-sided": d[0] != 0}[alternative]
        return 0.0 if hit else 1.0
    return float(stats.ttest_rel(t, c, alternative=alternative).pvalue)


def two_sided(p_one_sided: float) -> float:
    """The two-sided p of a test whose one-sided p is given (both tails read: 2·min(p, 1 − p), at
    most 1)."""
    if not math.isfinite(p_one_sided):
        return math.nan
    return min(1.0, 2.0 * min(p_one_sided, 1.0 - p_one_sided))


def _clean(pvalues: Sequence[float]) -> np.ndarray:
    p = np.asarray([math.nan if v is None else float(v) for v in pvalues], dtype=float)
    if np.any((p < 0) | (p > 1)):
        raise ValueError(f"p-values must lie in [0, 1]. Found {p[(p < 0) | (p > 1)].tolist()}.")
    return p


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the input order (NaN stays NaN; m counts every test).

    Reject the hypotheses whose adjusted p is < α: the family-wise error rate is at most α.
    """
    p = _clean(pvalues)
    m = p.size
    out = np.full(m, math.nan)
    finite = np.flatnonzero(np.isfinite(p))
    order = finite[np.argsort(p[finite], kind="stable")]
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p[i]))
        out[i] = running
    return out.tolist()


def benjamini_hochberg(pvalues: Sequence[float]) -> list[float]:
    """Benjamini–Hochberg q-values (step-up adjusted p), in the input order (NaN stays NaN; m counts
    every test)."""
    p = _clean(pvalues)
    m = p.size
    out = np.full(m, math.nan)
    finite = np.flatnonzero(np.isfinite(p))
    order = finite[np.argsort(p[finite], kind="stable")]
    running = 1.0
    for rank in range(len(order) - 1, -1, -1):
        i = order[rank]
        running = min(running, m * p[i] / (rank + 1))
        out[i] = min(1.0, running)
    return out.tolist()
