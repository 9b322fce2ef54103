"""Pictures of runs: ``curves.png`` in every run folder, and ``diff2 plot RUN_DIR…`` for several
runs.

One panel per quantity against the round: train and test loss, ‖∇f(x_r)‖², accuracy (when the
run measured it), ε spent (each series named by its accountant: :func:`epsilon_accountants`), and
the noise std and clipping radius of each round. Losses, ‖∇f‖², noise and radius span orders of
magnitude: log scales.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

__all__ = ["CURVES_FILE", "EXACT_GDP", "PLD", "SKELLAM_RDP", "epsilon_accountants",
           "epsilon_series", "read_rows", "read_privacy", "run_label", "run_labels",
           "run_settings", "panels", "plot_runs"]

CURVES_FILE = "curves.png"

#: The accountants a run's ε can come from (a summary's ``privacy.accountant``): central noise with
#: full-batch rounds, the exact μ-GDP closed form; with the local routine's subsampled steps,
#: dp-accounting's PLD; distributed noise, the Skellam Rényi DP ledger.
EXACT_GDP, PLD, SKELLAM_RDP = "exact μ-GDP", "PLD", "Skellam RDP"

#: (panel title, [(metric key, legend suffix)], log scale)
_PANELS: tuple[tuple[str, tuple[tuple[str, str], ...], bool], ...] = (
    ("loss", (("train_loss", "train"), ("test_loss", "test")), True),
    ("‖∇f(x_r)‖²", (("grad_norm_sq", ""),), True),
    ("accuracy", (("train_accuracy", "train"), ("test_accuracy", "test")), False),
    # the legends are the run's accountants (epsilon_series)
    ("ε spent", (("epsilon_spent", ""), ("epsilon_pld", "")), False),
    ("noise std per round", (("noise_std", ""),), True),
    ("clipping radius", (("radius", ""),), True),
)


def epsilon_accountants(privacy: Mapping[str, Any] | None) -> tuple[str, str | None]:
    """Who computed a run's ε figures: (the accountant of ``epsilon_spent``, that of
    ``epsilon_pld`` when it is a separate cross-check, else None).

    Central noise, full-batch rounds: the exact μ-GDP closed form, dp-accounting's PLD beside it.
    With the local routine: PLD, which ``epsilon_pld`` repeats. Distributed noise: the Skellam RDP
    ledger, the mechanism's only accountant (the rows' ``epsilon_pld`` repeats it). A summary
    written before ``privacy.accountant`` existed is read from its other fields; without one (or
    for a run without noise) the row keys name the series.

    Args:
        privacy: the ``privacy`` block of the run's ``summary.json``, or None.
    """
    privacy = privacy or {}
    name = privacy.get("accountant")
    if name is None and privacy.get("noise") == "distributed":
        name = SKELLAM_RDP
    elif name is None and str(privacy.get("epsilon_accountant", "")).startswith("dp-accounting"):
        name = PLD
    elif name is None and privacy.get("private"):
        name = EXACT_GDP
    if name is None:
        return "epsilon_spent", "epsilon_pld"
    return name, PLD if name == EXACT_GDP else None


def epsilon_series(privacy: Mapping[str, Any] | None) -> tuple[tuple[str, str], ...]:
    """The ε panel's series of a run: (row key, legend) for each figure its accountants give (see
    :func:`epsilon_accountants`)."""
    spent, cross = epsilon_accountants(privacy)
    return (("epsilon_spent", spent),) + ((("epsilon_pld", cross),) if cross else ())


def read_privacy(run_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The ``privacy`` block of a run folder's ``summary.json``; None without a readable one."""
    try:
        privacy = json.loads((Path(run_dir) / "summary.json").read_text()).get("privacy")
    except (OSError, ValueError, AttributeError):
        return None
    return privacy if isinstance(privacy, dict) else None


def read_rows(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The per-round rows of a run folder (``metrics.jsonl``); a clear error when it is not one."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(
            f"{run_dir} is not a run folder: it has no metrics.jsonl. Give the folder a run "
                                "printed ('results in …'), e.g. "
                                "outputs/default-20261130-101500-ab12cd.")
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


#: Settings a legend names briefly (dotted keys of the experiment file), first in this order.
_SHORT = {
    "method": "", "privacy.epsilon": "ε", "privacy.delta": "δ", "training.restart_every": "T",
    "training.learning_rate": "η", "training.clip_restart": "C₁", "training.clip_diff": "C₂",
    "training.rounds": "R", "training.clients": "P", "training.routine.name": "routine",
    "training.schedule.name": "schedule",
    "local.steps": "K",
    "training.seed": "seed", "dataset.name": "data",
}
#: At most this many differing settings in a label (then "…").
_MAX_SETTINGS = 4


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists as JSON text (comparable, hashable)."""
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in _flatten(item,
                                                                         f"{prefix}{key}.").items()}
    return {prefix[:-1]: json.dumps(value, sort_keys=True) if isinstance(value, list) else value}


def run_settings(run_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """What a run ran, as dotted keys of the experiment file, from its ``summary.json``; {} without
    one.

    A YAML run's summary has its whole config; a Python API run's
    (``make_strategy(output_dir=...)``) has the method, the calibration and the routine, read into
    the same keys.
    """
    try:
        summary = json.loads((Path(run_dir) / "summary.json").read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(summary, dict):
        return {}
    if isinstance(summary.get("config"), dict):
        settings = _flatten(summary["config"])
    else:
        calibration = (summary.get("privacy") or {}).get("calibration") or {}
        routine = summary.get("routine") or {}
        settings = {"method": summary.get("method"), "privacy.epsilon": calibration.get("epsilon"),
                    "privacy.delta": calibration.get("delta"),
                    "training.rounds": calibration.get("rounds"),
                    "training.restart_every": calibration.get("restart_every"),
                    "training.clients": calibration.get("clients"),
                    "training.learning_rate": routine.get("learning_rate")}
        settings |= {f"training.routine.{k}": v for k, v in routine.items() if k != "learning_rate"}
        schedule = summary.get("schedule") or {}
        settings |= {f"training.schedule.{k}": v for k, v in schedule.items()}
    for section in ("training.routine", "training.schedule"):
        # `routine: adam` is `routine.name: adam`, `schedule: cosine` is `schedule.name: cosine`
        if not isinstance(settings.get(f"{section}.name"),
                          str) and isinstance(settings.get(section), str):
            settings[f"{section}.name"] = settings.pop(section)
    # The name and the output keys say where a run was written, not what it ran.
    return {k: v for k, v in settings.items() if k != "name" and not k.startswith("output.")}


def _show(key: str, value: Any) -> str:
    """``ε=8``, ``η=0.25``; a method by its name alone."""
    text = f"{value:g}" if isinstance(value, float) else str(value)
    short = _SHORT.get(key, key)
    return text if key == "method" else f"{short}={text}"


def run_labels(run_dirs: Sequence[str | os.PathLike[str]]) -> list[str]:
    """A legend label per run: the settings in which the runs differ (``diff2, ε=8``), else the
    run's name and method; runs still alike get their folder's id (``tiny (diff2) 2ae21b``).

    One run is labelled by :func:`run_label`.
    """
    dirs = [Path(d) for d in run_dirs]
    names = [run_label(d) for d in dirs]
    if len(dirs) < 2:
        return names
    settings = [run_settings(d) for d in dirs]
    # A setting differs when the runs whose summaries have it disagree (one unknown is not a
    # difference).
    keys = list(dict.fromkeys(k for s in settings for k in s))
    differ = [k for k in keys if len({json.dumps(s[k], sort_keys=True,
                                                 default=str) for s in settings if k in s}) > 1]
    differ.sort(key=lambda k: list(_SHORT).index(k) if k in _SHORT else len(_SHORT))
    labels = []
    for name, s in zip(names, settings):
        shown = [_show(k, s[k]) for k in differ if k in s]
        more = ", …" if len(shown) > _MAX_SETTINGS else ""
        labels.append(", ".join(shown[:_MAX_SETTINGS]) + more if shown else name)
    # alike in everything the summaries say: tell them apart by folder
    if len(set(labels)) < len(labels):
        labels = [f"{label} {d.name.rsplit('-', 1)[-1]}" if labels.count(label) > 1 else label
                  for label, d in zip(labels, dirs)]
    return labels


def panels(runs: Sequence[tuple[str, Sequence[dict[str, Any]]]]) -> list[str]:
    """The titles of the panels drawn for ``runs``: those quantities some run has a finite value
    of."""
    return [p[0] for p in _PANELS if any(_series(rows, key, p[2])[0] for _, rows in runs for key,
                                         _ in p[1])]


def _series(rows: Sequence[dict[str, Any]], key: str, log: bool) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for row in rows:
        value = row.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value) and (value > 0 or not log):
            xs.append(int(row["round"]))
            ys.append(float(value))
    return xs, ys


def plot_runs(runs: Sequence[tuple[str, Sequence[dict[str, Any]]]], out: str | os.PathLike[str],
              title: str | None = None, *,
              privacy: Sequence[Mapping[str, Any] | None] | None = None) -> Path:
    """Draw ``(label, rows)`` runs into one figure (one panel per quantity that any run has) at
    ``out``.

    Args:
        runs: (legend label, per-round rows) of each run.
        out: the PNG's path.
        title: the figure's title.
        privacy: each run's summary ``privacy`` block (or None): its ε series are named by the
            accountants that computed them (:func:`epsilon_series`).
    """
    # matplotlib's object API, not pyplot: no global figure state (a ServerApp draws in a thread of
    # Flower's simulation process) and no GUI backend to import (~0.5 s less in every ServerApp);
    # imported here, when a figure is drawn: `diff2 --help` imports this module (via outputs.py)
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415 -- see above
    from matplotlib.figure import Figure  # noqa: PLC0415 -- see above

    chosen = [p for p in _PANELS if p[0] in panels(runs)]
    if not chosen:
        raise ValueError("Nothing to plot: the runs have no finite per-round metrics yet.")
    cols = min(3, len(chosen))
    nrows = math.ceil(len(chosen) / cols)
    fig = Figure(figsize=(5.2 * cols, 3.6 * nrows))
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, cols, squeeze=False)
    blocks = list(privacy) if privacy is not None else [None] * len(runs)
    if len(blocks) != len(runs):
        raise ValueError(f"`privacy` must have one block (or None) per run: {len(runs)} runs. "
                         f"Found {len(blocks)}.")
    for ax, (name, keys, log) in zip(axes.flat, chosen):
        for index, ((label, rows), block) in enumerate(zip(runs, blocks)):
            color = f"C{index % 10}"
            shown = epsilon_series(block) if name == "ε spent" else keys
            for style, (key, suffix) in zip(("-", "--", ":"), shown):
                xs, ys = _series(rows, key, log)
                if xs:
                    parts = [p for p in ((label if len(runs) > 1 else ""), suffix) if p]
                    ax.plot(xs, ys, style, color=color, lw=1.4,
                            marker="." if len(xs) < 30 else None, label=" ".join(parts) or None)
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
    os.replace(tmp, out)
    return out
