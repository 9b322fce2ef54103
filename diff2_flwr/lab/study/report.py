"""A study's report: a Markdown table of the summary, and plots in the style of the paper's Figure
2."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from .claims import atomic_write_bytes, atomic_write_text

__all__ = ["RATIO_LEGEND", "aligned_metric", "format_budgets", "format_cost", "format_inference",
           "format_table", "with_interval", "write_report"]

_LABELS = {"train_loss": "train loss", "grad_norm_sq": "‖∇f‖²", "test_loss": "test loss",
           "test_accuracy": "test accuracy"}


def _fmt(value: Any, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "diverged" if value == math.inf else "–"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def _routine(entry: dict) -> str:
    """``adam(beta1=0.9)`` for a method's routine (its fixed parameters; grid ones are in the
    point), or ``gd``; then its step-size schedule unless constant (``gd, cosine(floor=0.1)``)."""
    routine = dict(entry.get("routine") or {"name": "gd"})
    name = routine.pop("name")
    text = f"{name}({', '.join(f'{k}={_fmt(v)}' for k, v in routine.items())})" if routine else name
    schedule = dict(entry.get("schedule") or {"name": "constant"})
    names = schedule.pop("name")
    if names == "constant":
        return text
    names = "/".join(names) if isinstance(names, list) else names
    params = ", ".join(f"{k}={_fmt(v)}" for k, v in schedule.items())
    return f"{text}, {names}({params})" if params else f"{text}, {names}"


#: How to read the ratio columns (the interval fields of a test row: :mod:`.intervals`).
RATIO_LEGEND = ("Intervals are two-sided 95 % (whatever α; t with n − 1 df). Ratio = treatment / "
                "control: on a log scale the ratio of geometric means, exp of the mean difference, "
                "with exp of its interval; on a linear scale the ratio of means with Fieller's "
                "interval for paired data. Either ratio interval excludes 1 exactly when the raw "
                "two-sided paired t-test has p < 0.05 (raw, not adjusted); – : no interval (a run "
                "diverged, or Fieller's set is unbounded: `ci95_note` in the JSON).")


def with_interval(value: Any, interval: Any, digits: int = 3) -> str:
    """``0.82 [0.71, 0.95]``: a value and its 95 % interval; the value alone where there is no
    interval (``diverged`` for inf, – where there is no value)."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return _fmt(value)
    if not interval:
        return f"{value:.{digits}g}"
    lo, hi = ("–" if v is None else f"{v:.{digits}g}" for v in interval)
    return f"{value:.{digits}g} [{lo}, {hi}]"


def _intervals(row: dict) -> str:
    """The mean difference and the ratio of a test row, each with its interval, as two cells."""
    return (f"{with_interval(row['mean_difference'], row.get('ci95_difference'))} | "
            f"{with_interval(row.get('ratio'), row.get('ci95_ratio'))}")


_AT = {"best": "best over rounds", "final": "final", "train_best": "at the train-loss-best round"}


def _endpoint(row: dict) -> str:
    scale = "log " if row.get("scale") == "log" else ""
    return f"{scale}{_LABELS[row['criterion']]}, {_AT[row['at']]}"


def format_table(eps_summary: dict) -> str:
    """Markdown tables of one ε: per method and criterion the chosen point and mean ± std of its
    reported endpoint and of the final value; the choices left on a grid edge; every test with its
    raw and adjusted p."""
    lines = ["| method | routine | criterion | chosen hyper-parameters | reported (mean ± std) | "
             "final (mean ± std) | σ₁ / σ₂ | z₁ / z₂ |", "|---|---|---|---|---|---|---|---|"]
    for name, entry in eps_summary["methods"].items():
        for c, info in entry["criteria"].items():
            point = ", ".join(f"{k}={_fmt(v)}" for k, v in info["point"].items()) or "–"
            cal = info["calibration"]
            sig = "–" if cal is None else f"{_fmt(cal['sigma1'])} / {_fmt(cal['sigma2'])}"
            zs = "–" if cal is None else f"{_fmt(cal['z1'])} / {_fmt(cal['z2'])}"
            rep = info["reported"]
            lines.append(
                f"| {name} | {_routine(entry)} | {_LABELS[c]} | {point} | {_fmt(rep['mean'])} ± "
                f"{_fmt(rep['std'], 2)} ({_AT[rep['at']]}) | {_fmt(info['final_mean'])} ± "
                f"{_fmt(info['final_std'], 2)} | {sig} | {zs} |"
            )
    accuracy = {name: e["accuracy"] for name, e in eps_summary["methods"].items()
                if "accuracy" in e}
    if accuracy:
        lines += ["", "Test accuracy at the train-loss-best grid point (reported, never "
                  "selected on):", "",
                  "| method | chosen hyper-parameters | reported (mean ± std) "
                  "| final (mean ± std) |", "|---|---|---|---|"]
        for name, info in accuracy.items():
            point = ", ".join(f"{k}={_fmt(v)}" for k, v in info["point"].items()) or "–"
            rep = info["reported"]
            lines.append(f"| {name} | {point} | {_fmt(rep['mean'])} ± {_fmt(rep['std'], 2)} "
                         f"({_AT[rep['at']]}) | {_fmt(info['final_mean'])} ± "
                         f"{_fmt(info['final_std'], 2)} |")
    edges = [(name, c, h) for name, e in eps_summary["methods"].items()
             for c, hits in e.get("edges", {}).items() for h in hits]
    grown = [(name, x) for name, e in eps_summary["methods"].items()
             for x in e.get("extensions", [])]
    if grown:
        lines += ["", "Grid extensions (a pick on the edge of its line on the tuning seeds: the "
                  "point one step further along that key was tuned too): "
                  + "; ".join(f"{name}: {x['key']} → {_fmt(x['value'])} ({x['because']})"
                              for name, x in grown) + "."]
    if edges:
        lines += ["", "**Picks still on a grid edge** (the grid may be too narrow there): "
                  + "; ".join(f"{name}, {_LABELS[c]}: {h['key']} = {_fmt(h['value'])} "
                              f"({h['side']}; {h['why']})"
                              for name, c, h in edges) + "."]
    if eps_summary.get("budgets"):
        lines += ["", format_budgets(eps_summary["budgets"])]
    if eps_summary["tests"]:
        lines += ["", "Paired t-tests by evaluation seed (alternative said of treatment − "
                  "control). **Primary** tests: Holm-adjusted p over the study's primary family; "
                  "exploratory tests: Benjamini–Hochberg q over its exploratory family (never a "
                  "confirmed result).", "",
                  RATIO_LEGEND, "",
                  "| comparison | endpoint | family | alternative | mean difference [95 % CI] | "
                  "ratio [95 % CI] | p | adjusted | df |", "|---|---|---|---|---|---|---|---|---|"]
        for pair, tests in eps_summary["tests"].items():
            for c, t in tests.items():
                for row in t["rows"].values():
                    adj = row.get("p_adjusted")
                    family = "**primary**" if row["family"] == "primary" else "exploratory"
                    how = "Holm" if row.get("adjustment") == "holm" else "BH q"
                    lines.append(f"| {pair} | {_endpoint(row)} | {family} | {row['alternative']} | "
                                 f"{_intervals(row)} | {_fmt(row['p_value'], 3)} | "
                                 f"{_fmt(adj, 3)} ({how}) | {row['df']} |")
    return "\n".join(lines)


def format_budgets(budgets: dict) -> str:
    """The tuning budgets of one ε: per method its grid configurations (declared, tuned) and tuning
    runs."""
    rule = ("equal: both methods of a tested pair tune as many configurations, none extended"
            if budgets["rule"] == "equal" else "unconstrained")
    lines = [f"Tuning budgets (`analysis.budgets`: {rule}; {budgets['tune_seeds']} tuning seeds):",
             "", "| method | configurations declared | configurations tuned | tuning runs |",
             "|---|---|---|---|"]
    for name, b in budgets["methods"].items():
        lines.append(f"| {name} | {b['configurations_declared']} | {b['configurations_tuned']} | "
                     f"{b['tuning_runs']} |")
    return "\n".join(lines)


def format_inference(summary: dict) -> str:
    """The study's analysis plan and its primary results, for the top of the report."""
    inf = summary.get("inference")
    if not inf:
        return ""
    lines = [f"**Protocol:** {inf['label']}."]
    if inf["primary"]:
        lines += ["", "**Primary endpoints** (declared in the study file; Holm over "
                  f"{inf['families']['primary']['size']} tests, α = {inf['alpha']}):", "",
                  RATIO_LEGEND, "",
                  "| ε | comparison | endpoint | alternative | mean difference [95 % CI] | "
                  "ratio [95 % CI] | p | Holm p | result |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in inf["primary_results"]:
            lower = r["treatment"] if r["lower"] == "treatment" else r["control"]
            verdict = (f"significant: {lower} lower" if r["significant"] else
                       "not significant (no claim either way)")
            lines.append(f"| {r['epsilon']:g} | {r['pair']} | {_endpoint(r)} | {r['alternative']} "
                         f"| {_intervals(r)} | {_fmt(r['p_value'], 3)} | "
                         f"{_fmt(r['p_adjusted'], 3)} | {verdict} |")
    else:
        lines += ["", "No primary endpoint is declared: every test below is **exploratory**."]
    lines += ["", f"Exploratory tests: {inf['families']['exploratory']['size']}, of which "
              f"{inf['exploratory_raw_below_alpha']} have raw p < {inf['alpha']} and "
              f"{inf['exploratory_below_alpha']} BH q < {inf['alpha']}."]
    return "\n".join(lines)


def aligned_metric(runs: list[dict], criterion: str) -> tuple[np.ndarray, np.ndarray]:
    """The runs' values of ``criterion`` on one round axis [runs, rounds]: the longest run's rounds,
    inf where a run has no value (it diverged before: the per-run path stops there, the batched
    engine records inf)."""
    axis = max((r["rounds"] for r in runs), key=len)
    values = np.full((len(runs), len(axis)), math.inf)
    for i, r in enumerate(runs):
        by_round = {t: (math.inf if v is None else v) for t, v in zip(r["rounds"], r[criterion])}
        values[i] = [by_round.get(t, math.inf) for t in axis]
    return np.asarray(axis), values


def _count(value: Any) -> str:
    return "–" if value is None else (f"{value:.3g}" if value >= 1e4 else f"{value:g}")


def format_cost(eps_summary: dict) -> str:
    """The cost table: per method and criterion, R, gradient evaluations, and what it took to reach
    the reference."""
    cost = eps_summary.get("cost")
    if not cost:
        return ""
    ref, slack = cost["reference"], cost["target_slack"]
    lines = [f"Cost (n = {cost['n_train']} training samples; per-sample gradient evaluations as "
             "the algorithm counts them: n per restart round, 2n per difference round, 2b(K − 1) "
             "expected per local phase). "
             + (f"\"To {ref}'s utility\": the first evaluated round at which the method's "
                f"seed-mean running minimum is within {slack:.0%} of {ref}'s mean minimum, and "
                "the evaluations spent by then (– : never)." if ref else ""), "",
             "| method | criterion | R | local exchanges | gradient evaluations "
             "| min over rounds (mean) |"
             + (" round to reference | evaluations to reference |" if ref else ""),
             "|---|---|---|---|---|---|" + ("---|---|" if ref else "")]
    for name, entry in cost["methods"].items():
        for c, info in entry["criteria"].items():
            row = (f"| {name} | {_LABELS[c]} | {entry['rounds']} | {info['local_exchanges']} | "
                   f"{_count(info['gradient_evaluations'][-1])} | "
                   f"{_fmt(eps_summary['methods'][name]['criteria'][c]['min_mean'])} |")
            if ref:
                row += (f" {_count(info.get('round_to_target'))} | "
                        f"{_count(info.get('evaluations_to_target'))} |")
            lines.append(row)
    return "\n".join(lines)


def _records(summary: dict) -> str:
    """`` (n = 1000 training records: a uniform subsample, seed 0, of the train split's 16512; d =
    101)``."""
    info = summary.get("dataset")
    if not info:
        return ""
    sub = (f": a uniform subsample (`train_samples`, seed {info['subsample_seed']}) of the train "
           f"split's {info['train_available']}" if "train_samples" in info else "")
    return (f" (n = {info['train']} training records{sub}; {info['test']} test records; "
            f"d = {info['parameters']} parameters)")


def write_report(study, summary: dict, root: Path, runs_dir: Path, *,
                 make_plots: bool = True) -> None:
    """Write ``report.md`` and one PNG per ε (three panels, one per criterion) into ``root``."""
    parts = [f"# Study `{study.name}`", "",
             f"Dataset `{study.dataset.get('name')}`{_records(summary)}, P = {study.clients}, R = "
             f"{study.rounds} (unless a method sets its own), δ = {study.delta}, "
             f"calibration `{study.mode}`, n_min = {summary['n_min']}, tuning seeds "
             f"{list(study.tune_seeds)}, "
             f"evaluation seeds {list(study.eval_seeds)}, engine `{study.engine}` ({study.dtype}). "
             "Criteria are evaluated every "
             f"{study.eval_every} rounds; each training criterion is reported at its own grid "
             "point (chosen on the tuning seeds), the test metrics at the train-loss point. "
             "Evaluation metrics are outside the private "
             "protocol.", "", format_inference(summary), ""]
    for eps, eps_summary in summary["epsilons"].items():
        parts += [f"## ε = {eps}", "", format_table(eps_summary), ""]
        if make_plots:
            png = _plot(study, float(eps), eps_summary, root, runs_dir)
            parts += [f"![ε = {eps}]({png.name})", ""]
        if eps_summary.get("cost"):
            parts += [format_cost(eps_summary), ""]
            if make_plots:
                png = _plot_cost(float(eps), eps_summary, root)
                parts += [f"![cost, ε = {eps}]({png.name})", ""]
    parts += [f"Wall time: {summary['wall_time_s']:.0f} s.", ""]
    # drivers sharing a folder each write it whole
    atomic_write_text(root / "report.md", "\n".join(parts))


def _save(fig: Any, path: Path) -> Path:
    """Write ``fig`` as a PNG at ``path`` whole (drivers sharing a folder each write it) and close
    it."""
    import matplotlib.pyplot as plt  # noqa: PLC0415 -- matplotlib loads only to draw

    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=110)
    plt.close(fig)
    atomic_write_bytes(path, png.getvalue())
    return path


def _plot_cost(epsilon: float, eps_summary: dict, root: Path) -> Path:
    """Two rows of three panels: the seed-mean running minimum of each criterion against
    communication rounds, and against per-sample gradient evaluations."""
    import matplotlib  # noqa: PLC0415 -- matplotlib loads only to draw

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 -- matplotlib loads only to draw

    cost = eps_summary["cost"]
    criteria = [c for c in ("train_loss", "grad_norm_sq", "test_loss")
                if all(c in e["criteria"] for e in cost["methods"].values())]
    fig, axes = plt.subplots(2, len(criteria), figsize=(5.4 * len(criteria), 9), squeeze=False)
    for col, c in enumerate(criteria):
        for name, entry in cost["methods"].items():
            info = entry["criteria"][c]
            curve = np.asarray([math.inf if v is None else v for v in info["running_min_mean"]],
                               dtype=float)
            if not np.all(np.isfinite(curve)):
                continue
            axes[0, col].plot(info["rounds"], curve, label=name)
            axes[1, col].plot(info["gradient_evaluations"], curve, label=name)
        ref = cost["reference"]
        target = next((e["criteria"][c].get("target") for e in cost["methods"].values()), None)
        for row, xlabel in ((0, "communication round"), (1, "per-sample gradient evaluations")):
            ax = axes[row, col]
            if ref and target:
                ax.axhline(target, color="grey", linestyle=":", linewidth=1)
            ax.set_yscale("log")
            ax.set_xlabel(xlabel)
            ax.set_ylabel(f"{_LABELS[c]}: running min, mean over seeds")
            ax.set_title(f"{_LABELS[c]} (ε={epsilon:g})"
                         + (f"; dotted: {ref}'s min + {cost['target_slack']:.0%}"
                                                          if ref else ""), fontsize=8)
    axes[0, 0].legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, root / f"cost_eps{epsilon:g}.png")


def _plot(study, epsilon: float, eps_summary: dict, root: Path, runs_dir: Path) -> Path:
    import matplotlib  # noqa: PLC0415 -- matplotlib loads only to draw

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 -- matplotlib loads only to draw

    fig, axes = plt.subplots(1, 3, figsize=(16, 5))
    tests = eps_summary["tests"]
    for ax, c in zip(axes, ("train_loss", "grad_norm_sq", "test_loss")):
        for name, entry in eps_summary["methods"].items():
            info = entry["criteria"][c]
            runs = [json.loads((runs_dir / f"{rid}.json").read_text()) for rid in info["run_ids"]]
            rounds, values = aligned_metric(runs, c)
            if not np.all(np.isfinite(values)):
                continue
            mean, std = values.mean(0), values.std(0)
            ax.plot(rounds, mean, label=name)
            ax.fill_between(rounds, np.maximum(mean - std, mean / 10), mean + std, alpha=0.2)
        ax.set_yscale("log")
        ax.set_xlabel("round")
        ax.set_ylabel(_LABELS[c])
        ps = []
        for pair, t in tests.items():
            if c in t:
                row = next(iter(t[c]["rows"].values()))
                how = "Holm p" if row.get("adjustment") == "holm" else "BH q"
                short = pair.replace("DIFF2-GD ", "")
                ps.append(f"{short}: {how}={_fmt(row.get('p_adjusted'), 2)}")
        lines = ["; ".join(ps[i:i + 2]) for i in range(0, len(ps), 2)]
        ax.set_title("\n".join([
            f"{_LABELS[c]} (ε={epsilon:g}), adjusted p of the reported endpoint"] + lines),
                     fontsize=8)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, root / f"figure_eps{epsilon:g}.png")
