"""A study's report: a Markdown table of the summary, and plots in the style of the paper's Figure 2."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from .claims import atomic_write_bytes, atomic_write_text

__all__ = ["write_report", "format_table"]

_LABELS = {"train_loss": "train loss", "grad_norm_sq": "‖∇f‖²", "test_loss": "test loss",
           "test_accuracy": "test accuracy"}


def _fmt(value: Any, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "diverged" if value == math.inf else "–"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def _routine(entry: dict) -> str:
    """``adam(beta1=0.9)`` for a method's routine (its fixed parameters; grid ones are in the point), or ``gd``."""
    routine = dict(entry.get("routine") or {"name": "gd"})
    name = routine.pop("name")
    return f"{name}({', '.join(f'{k}={_fmt(v)}' for k, v in routine.items())})" if routine else name


def format_table(eps_summary: dict) -> str:
    """One Markdown table: per method and criterion, the routine, the chosen point and mean ± std of min and final."""
    lines = ["| method | routine | criterion | chosen hyper-parameters | min over rounds (mean ± std) | final (mean ± std) | σ₁ / σ₂ | z₁ / z₂ |",
             "|---|---|---|---|---|---|---|---|"]
    for name, entry in eps_summary["methods"].items():
        for c, info in entry["criteria"].items():
            point = ", ".join(f"{k}={_fmt(v)}" for k, v in info["point"].items()) or "–"
            cal = info["calibration"]
            sig = "–" if cal is None else f"{_fmt(cal['sigma1'])} / {_fmt(cal['sigma2'])}"
            zs = "–" if cal is None else f"{_fmt(cal['z1'])} / {_fmt(cal['z2'])}"
            lines.append(
                f"| {name} | {_routine(entry)} | {_LABELS[c]} | {point} | {_fmt(info['min_mean'])} ± {_fmt(info['min_std'], 2)} | "
                f"{_fmt(info['final_mean'])} ± {_fmt(info['final_std'], 2)} | {sig} | {zs} |"
            )
    accuracy = {name: e["accuracy"] for name, e in eps_summary["methods"].items() if "accuracy" in e}
    if accuracy:
        lines += ["", "Test accuracy at the train-loss-best point (reported, not selected on):", "",
                  "| method | chosen hyper-parameters | best over rounds (mean ± std) | final (mean ± std) |",
                  "|---|---|---|---|"]
        for name, info in accuracy.items():
            point = ", ".join(f"{k}={_fmt(v)}" for k, v in info["point"].items()) or "–"
            lines.append(f"| {name} | {point} | {_fmt(info['best_mean'])} ± {_fmt(info['best_std'], 2)} | "
                         f"{_fmt(info['final_mean'])} ± {_fmt(info['final_std'], 2)} |")
    if eps_summary["tests"]:
        lines += ["", "One-sided paired t-tests, H1: the DIFF2 method's value < DP-GD's (min over rounds: the "
                  "protocol's test; final value: for comparison); for test accuracy H1: > DP-GD's (best over "
                  "rounds):", "",
                  "| comparison | criterion | p (min/best over rounds) | p (final) | df |", "|---|---|---|---|---|"]
        for pair, tests in eps_summary["tests"].items():
            for c, t in tests.items():
                lines.append(f"| {pair} | {_LABELS[c]} | {_fmt(t['p_value'], 3)} | "
                             f"{_fmt(t.get('p_value_final'), 3)} | {t['df']} |")
    return "\n".join(lines)


def _records(summary: dict) -> str:
    """`` (n = 1000 training records: a uniform subsample, seed 0, of the train split's 16512; d = 101)``."""
    info = summary.get("dataset")
    if not info:
        return ""
    sub = (f": a uniform subsample (`train_samples`, seed {info['subsample_seed']}) of the train split's "
           f"{info['train_available']}" if "train_samples" in info else "")
    return f" (n = {info['train']} training records{sub}; {info['test']} test records; d = {info['parameters']} parameters)"


def write_report(study, summary: dict, root: Path, runs_dir: Path, *, make_plots: bool = True) -> None:
    """Write ``report.md`` and one PNG per ε (three panels, one per criterion) into ``root``."""
    parts = [f"# Study `{study.name}`", "",
             f"Dataset `{study.dataset.get('name')}`{_records(summary)}, P = {study.clients}, R = {study.rounds}, "
             f"δ = {study.delta}, "
             f"calibration `{study.mode}`, n_min = {summary['n_min']}, tuning seeds {list(study.tune_seeds)}, "
             f"evaluation seeds {list(study.eval_seeds)}, engine `{study.engine}` ({study.dtype}). "
             "Criteria are evaluated every "
             f"{study.eval_every} rounds; each is reported at its own best grid point, the test loss at the "
             "train-loss-best point. Evaluation metrics are outside the private protocol.", ""]
    for eps, eps_summary in summary["epsilons"].items():
        parts += [f"## ε = {eps}", "", format_table(eps_summary), ""]
        if make_plots:
            png = _plot(study, float(eps), eps_summary, root, runs_dir)
            parts += [f"![ε = {eps}]({png.name})", ""]
    parts += [f"Wall time: {summary['wall_time_s']:.0f} s.", ""]
    atomic_write_text(root / "report.md", "\n".join(parts))  # drivers sharing a folder each write it whole


def _plot(study, epsilon: float, eps_summary: dict, root: Path, runs_dir: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 5))
    tests = eps_summary["tests"]
    for ax, c in zip(axes, ("train_loss", "grad_norm_sq", "test_loss")):
        for name, entry in eps_summary["methods"].items():
            info = entry["criteria"][c]
            runs = [json.loads((runs_dir / f"{rid}.json").read_text()) for rid in info["run_ids"]]
            rounds = np.array(runs[0]["rounds"])
            values = np.array([[math.inf if v is None else v for v in r[c]] for r in runs], dtype=float)
            if not np.all(np.isfinite(values)):
                continue
            mean, std = values.mean(0), values.std(0)
            ax.plot(rounds, mean, label=name)
            ax.fill_between(rounds, np.maximum(mean - std, mean / 10), mean + std, alpha=0.2)
        ax.set_yscale("log")
        ax.set_xlabel("round")
        ax.set_ylabel(_LABELS[c])
        ps = [f"{pair.split(' vs ')[0].replace('DIFF2-GD ', '')}: p={_fmt(t[c]['p_value'], 2)}"
              for pair, t in tests.items()]
        lines = ["; ".join(ps[i:i + 2]) for i in range(0, len(ps), 2)]
        ax.set_title("\n".join([f"{_LABELS[c]} (ε={epsilon:g}), one-sided p vs DP-GD"] + lines), fontsize=8)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path = root / f"figure_eps{epsilon:g}.png"
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=110)
    plt.close(fig)
    atomic_write_bytes(path, png.getvalue())
    return path
