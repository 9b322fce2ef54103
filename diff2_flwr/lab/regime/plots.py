"""The regime map's figures: one heatmap per dataset (the ratios over n × ε) and the scatter against
nε/√d.

matplotlib is imported when a figure is drawn, never at import.
"""

from __future__ import annotations

import io
import math
from typing import Any, Mapping, Sequence

import numpy as np

from .cells import ENDPOINTS, LEGEND, Cell
from .fit import THEORY_SLOPE

__all__ = ["MAX_SPAN_DECADES", "heatmap_png", "scatter_png"]


def _png(fig: Any) -> bytes:
    import matplotlib.pyplot as plt  # noqa: PLC0415 -- matplotlib loads when a figure is drawn

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def _cell_text(cell: Cell, endpoint: str, mark_: str) -> str:
    """``0.77*``, or which method diverged (on some seed: its mean is infinite)."""
    r = cell.ratio(endpoint)
    if math.isfinite(r) and r > 0:
        return f"{r:.2f}{mark_}"
    gone = [name for name, m in (("DIFF2-GD", cell.diff2), ("DP-GD", cell.control))
            if not math.isfinite(cell.mean(endpoint, m))]
    return f"{' and '.join(gone)}\ndiverged" if gone else "–"


#: The colour scale of a heatmap panel saturates at this factor either way (the cell's text gives
#: the exact ratio).
MAX_SPAN_DECADES = 1.0


def _ticks(span: float) -> list[float]:
    """Colour-bar ticks inside [10^-span, 10^span]: decades and halves for a wide span, finer steps
    near 1."""
    wide = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100)
    narrow = (0.25, 0.33, 0.5, 0.67, 0.8, 0.9, 1, 1.1, 1.25, 1.5, 2, 3, 4)
    return [v for v in (wide if span > 0.45 else narrow)
            if 10 ** -span <= v * (1 + 1e-9) and v <= 10 ** span * (1 + 1e-9)]


def heatmap_png(cells: Sequence[Cell], result: Mapping[str, Any], dataset: str,
                alpha: float) -> bytes:
    """The PNG of ``dataset``'s heatmaps, one panel per endpoint: DIFF2-GD / DP-GD over n × ε, each
    cell's ratio marked where its adjusted p < ``alpha`` (``result``: the regime map's)."""
    import matplotlib  # noqa: PLC0415 -- matplotlib loads when a figure is drawn (on Agg)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 -- once the Agg backend is chosen
    from matplotlib.colors import LogNorm  # noqa: PLC0415 -- loaded when a figure is drawn

    marks = {(row["n"], row["epsilon"]): {e: v["mark"] for e, v in row["endpoints"].items()}
             for row in result["cells"] if row["dataset"] == dataset}
    mine = [cell for cell in cells if cell.dataset == dataset]
    ns = sorted({cell.n for cell in mine})
    eps = sorted({cell.epsilon for cell in mine})
    by = {(cell.n, cell.epsilon): cell for cell in mine}
    fig, axes = plt.subplots(1, len(ENDPOINTS), figsize=(4.6 * len(ENDPOINTS), 0.9 * len(ns) + 2.4),
                             layout="constrained")
    for ax, (e, spec) in zip(axes, ENDPOINTS.items()):
        grid = np.full((len(ns), len(eps)), np.nan)
        for (i, n), (j, ep) in ((a, b) for a in enumerate(ns) for b in enumerate(eps)):
            cell = by.get((n, ep))
            if cell is not None and math.isfinite(cell.ratio(e)) and cell.ratio(e) > 0:
                grid[i, j] = cell.ratio(e)
        # one scale per panel (the endpoints differ by orders of magnitude), symmetric in log so
        # that a ratio of 1 is the centre colour, saturating at MAX_SPAN_DECADES
        finite = grid[np.isfinite(grid)]
        span = float(np.max(np.abs(np.log10(finite)))) if finite.size else 0.05
        span = min(max(span, 0.05), MAX_SPAN_DECADES)
        cmap = matplotlib.colormaps["RdBu_r"].with_extremes(bad="0.85")
        image = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, norm=LogNorm(vmin=10 ** -span,
                                                                              vmax=10 ** span),
                          origin="lower", aspect="auto")
        for i, n in enumerate(ns):
            for j, ep in enumerate(eps):
                cell = by.get((n, ep))
                text = "no run" if cell is None else _cell_text(cell, e, marks[n, ep][e])
                if cell is not None and cell.stalled and spec.criterion == "grad_norm_sq":
                    text += f"\n{len(cell.stalled)} run(s) stalled"
                dark = cell is not None and math.isfinite(grid[i, j]) and abs(math.log10(grid[
                    i, j])) > 0.6 * span
                ax.text(j, i, text, ha="center", va="center", fontsize=10,
                        color="white" if dark else "black")
        ax.set_xticks(range(len(eps)), [f"{v:g}" for v in eps])
        ax.set_yticks(range(len(ns)), [f"{n:,}" for n in ns])
        ax.set_xlabel("ε")
        ax.set_title(f"{spec.label}{'' if spec.primary else ' (exploratory)'}: DIFF2-GD / DP-GD",
                     fontsize=10)
        bar = fig.colorbar(image, ax=ax, shrink=0.9,
                           extend="both" if span >= MAX_SPAN_DECADES else "neither")
        bar.ax.minorticks_off()
        ticks = _ticks(span)
        bar.set_ticks(ticks, labels=[f"{v:g}" for v in ticks])
        if e == list(ENDPOINTS)[-1]:
            bar.set_label("DIFF2-GD / DP-GD (< 1: DIFF2-GD lower)", fontsize=8)
    axes[0].set_ylabel("n (training records)")
    fig.suptitle(f"{dataset}: {LEGEND} (α = {alpha:g}); grey: no cell", fontsize=9)
    return _png(fig)


def scatter_png(cells: Sequence[Cell], result: Mapping[str, Any], alpha: float) -> bytes:
    """The PNG of the ratios against nε/√d, one panel per endpoint, filled where significant, with
    the primary endpoint's pooled fit and the theory's slope −1/3 drawn through its anchor."""
    import matplotlib  # noqa: PLC0415 -- matplotlib loads when a figure is drawn (on Agg)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 -- once the Agg backend is chosen
    from matplotlib.ticker import (  # noqa: PLC0415 -- matplotlib loads when a figure is drawn
        FuncFormatter, LogLocator, NullFormatter, NullLocator,
    )

    datasets = sorted({cell.dataset for cell in cells})
    markers = dict(zip(datasets, "osD^v<>p"))
    colours = dict(zip(datasets, ("tab:blue", "tab:orange", "tab:green", "tab:purple",
                                  "tab:brown")))
    marks = [{e: v["mark"] for e, v in row["endpoints"].items()} for row in result["cells"]]
    fig, axes = plt.subplots(1, len(ENDPOINTS), figsize=(5.2 * len(ENDPOINTS), 4.8))
    for ax, (e, spec) in zip(axes, ENDPOINTS.items()):
        if not any(math.isfinite(cell.ratio(e)) and cell.ratio(e) > 0 for cell in cells):
            ax.text(0.5, 0.5, f"{spec.label}: no finite ratio\n(a method diverged in every cell)",
                    ha="center", va="center", transform=ax.transAxes)
            ax.set_axis_off()
            continue
        for ds in datasets:
            for cell, m in zip(cells, marks):
                r = cell.ratio(e)
                if cell.dataset != ds or not (math.isfinite(r) and r > 0):
                    continue
                ax.scatter(cell.x, r, marker=markers[ds], s=40, edgecolors=colours[ds],
                           facecolors=colours[ds] if m[e] else "none", zorder=3)
                if m[e]:
                    ax.annotate(m[e], (cell.x, r), textcoords="offset points", xytext=(5, 3),
                                fontsize=10)
            ax.scatter([], [], marker=markers[ds], edgecolors=colours[ds], facecolors="none",
                       label=ds)
        stalled = [cell for cell in cells if cell.stalled and math.isfinite(cell.ratio(e))
                   and cell.ratio(e) > 0]
        if spec.primary and stalled:
            ax.scatter([c.x for c in stalled], [c.ratio(e) for c in stalled], marker="x", s=90,
                       color="k", lw=1.0, zorder=4,
                       label="a run stalled (out of the sensitivity fit)")
        ax.axhline(1.0, color="0.5", lw=0.8, ls=":")
        ax.set_xscale("log")
        ax.set_yscale("log")
        title = spec.label if spec.primary else f"{spec.label} (exploratory, no fit)"
        fit = result["fits"]["pooled"] if spec.primary else None
        if fit is not None:
            lx = np.linspace(math.log10(min(c.x for c in cells)) - 0.1,
                             math.log10(max(c.x for c in cells)) + 0.1, 50)
            for ds, a in fit["intercepts"].items():
                ax.plot(10 ** lx, 10 ** (a + fit["slope"] * lx), color=colours[ds], lw=1.2)
            ax.plot([], [], color="k", lw=1.2,
                    label=f"fit: slope {fit['slope']:.2f} [{fit['ci95'][0]:.2f}, "
                          f"{fit['ci95'][1]:.2f}]")
            ax0, ay0 = math.log10(fit["theory_line_through"]["x"]), math.log10(fit[
                "theory_line_through"]["ratio"])
            ax.plot(10 ** lx, 10 ** (ay0 + THEORY_SLOPE * (lx - ax0)), color="tab:red", lw=1.0,
                    ls="--", label="slope −1/3 (theory)")
            title += f" (k = {fit['k']} cells)"
        # plain numbers at 1, 2, 5 × 10^k (matplotlib's minor labels overlap)
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            axis.set_minor_locator(NullLocator())
            axis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("nε/√d")
        ax.set_ylabel("DIFF2-GD / DP-GD (‖∇f‖²: geometric mean over seeds)")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7)
    fig.suptitle(f"Filled: adjusted p < α = {alpha:g} ({LEGEND})", fontsize=8)
    fig.tight_layout()
    return _png(fig)
