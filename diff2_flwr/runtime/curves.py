"""Pictures of runs: ``curves.png`` in every run folder, and ``diff2 plot RUN_DIR…`` for several runs.

One panel per quantity against the round: train and test loss, ‖∇f(x_r)‖², accuracy (when the
run measured it), ε spent (exact GDP and dp-accounting PLD), and the noise std and clipping radius
of each round. Losses, ‖∇f‖², noise and radius span orders of magnitude: log scales.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Sequence

__all__ = ["CURVES_FILE", "read_rows", "run_label", "panels", "plot_runs"]

CURVES_FILE = "curves.png"

#: (panel title, [(metric key, legend suffix)], log scale)
_PANELS: tuple[tuple[str, tuple[tuple[str, str], ...], bool], ...] = (
    ("loss", (("train_loss", "train"), ("test_loss", "test")), True),
    ("‖∇f(x_r)‖²", (("grad_norm_sq", ""),), True),
    ("accuracy", (("train_accuracy", "train"), ("test_accuracy", "test")), False),
    ("ε spent", (("epsilon_spent", "exact GDP"), ("epsilon_pld", "PLD")), False),
    ("noise std per round", (("noise_std", ""),), True),
    ("clipping radius", (("radius", ""),), True),
)


def read_rows(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The per-round rows of a run folder (``metrics.jsonl``); a clear error when it is not one."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} is not a run folder: it has no metrics.jsonl. Give the folder a run "
                                "printed ('results in …'), e.g. outputs/default-20261130-101500-ab12cd.")
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}, line {number}: not a JSON object ({exc.msg}).") from None
    return rows


def run_label(run_dir: str | os.PathLike[str]) -> str:
    """``name (method)`` from the run's summary, else the folder's name."""
    try:
        summary = json.loads((Path(run_dir) / "summary.json").read_text())
        return f"{summary['name']} ({summary['method']})"
    except (OSError, ValueError, KeyError, TypeError):
        return Path(run_dir).name


def panels(runs: Sequence[tuple[str, Sequence[dict[str, Any]]]]) -> list[str]:
    """The titles of the panels drawn for ``runs``: those quantities some run has a finite value of."""
    return [p[0] for p in _PANELS if any(_series(rows, key, p[2])[0] for _, rows in runs for key, _ in p[1])]


def _series(rows: Sequence[dict[str, Any]], key: str, log: bool) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for row in rows:
        value = row.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value) and (value > 0 or not log):
            xs.append(int(row["round"]))
            ys.append(float(value))
    return xs, ys


def plot_runs(runs: Sequence[tuple[str, Sequence[dict[str, Any]]]], out: str | os.PathLike[str],
              title: str | None = None) -> Path:
    """Draw ``(label, rows)`` runs into one figure (one panel per quantity that any run has) at ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chosen = [p for p in _PANELS if p[0] in panels(runs)]
    if not chosen:
        raise ValueError("Nothing to plot: the runs have no finite per-round metrics yet.")
    cols = min(3, len(chosen))
    nrows = math.ceil(len(chosen) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.2 * cols, 3.6 * nrows), squeeze=False)
    for ax, (name, keys, log) in zip(axes.flat, chosen):
        for index, (label, rows) in enumerate(runs):
            color = f"C{index % 10}"
            for style, (key, suffix) in zip(("-", "--", ":"), keys):
                xs, ys = _series(rows, key, log)
                if xs:
                    parts = [p for p in ((label if len(runs) > 1 else ""), suffix) if p]
                    ax.plot(xs, ys, style, color=color, lw=1.4, marker="." if len(xs) < 30 else None,
                            label=" ".join(parts) or None)
        ax.set_title(name)
        ax.set_xlabel("round")
        if log:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(chosen):]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.stem + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, out)
    return out
