"""The console of ``diff2 run``: our lines and real warnings, Flower's per-round chatter off, a
summary at the end.

``flwr run --stream`` relays every log line of the simulation: five Flower INFO lines a round
(``[ROUND r]``, ``configure_fit: ...``, ``configure_evaluate: no clients selected, skipping
evaluation``, ...) around each of ours. :class:`RunConsole` keeps ours, Flower's WARNING and ERROR
records, tracebacks and anything it does not know, and drops Flower's INFO/DEBUG records and a few
known, harmless messages we cannot fix (:data:`KNOWN_NOISE`). The per-round ``[diff2] round r/R``
lines become a live bar on a terminal or one short line per round otherwise, with ε spent, the
losses and the time. ``--verbose`` or ``DIFF2_VERBOSE=1`` shows every line as it came.

Everything goes to stderr; stdout is left for the one JSON object of the command.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Mapping, TextIO

from .policy import refusal_in
from .curves import EXACT_GDP, epsilon_accountants
from .progress import ProgressReporter

__all__ = ["VERBOSE_ENV", "KNOWN_NOISE", "RunConsole", "verbose_from_env", "parse_round_line",
           "run_report",
           "summary_block", "server_summary_block"]

VERBOSE_ENV = "DIFF2_VERBOSE"
#: The ETA of the rounds is extrapolated from at least this many seconds of them.
ETA_MEASURE_S = 3.0

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_RECORD = re.compile(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL)\s*:")
_RAY_ACTOR = re.compile(r"^\(\w+ pid=\d+(?:, ip=[^)]*)?\)\s*")  # Ray prefixes what its actors print
_ROUND = re.compile(r"^\[diff2\] round (\d+)/(\d+) \((\w+)\)\s*(.*)$")
_PAIR = re.compile(r"(\w+)=(\S+)")
_RUN_DIR = re.compile(r"^\[diff2\] writing per-round metrics and summary to (\S+)")
# the head of the summary block the ServerApp prints at its end
_SERVER_SUMMARY = "[diff2] summary: "
# the ServerApp's line when its run stops with an error (runtime/journal.py)
_SERVER_FAILED = "[diff2] run failed: "
# Flower's notice that the simulation ended with an exception (the ServerApp's own error)
_EXIT_CODE = re.compile(r"^ERROR\s*:\s*Exit Code: 700\b")

#: Messages we cannot fix and that say nothing about this run (matched after colours are stripped).
KNOWN_NOISE: tuple[re.Pattern[str], ...] = (
    # Flower 1.42 logs this in every simulation, even when num-supernodes is given (our launcher
    # always gives it).
    re.compile(
        r"^WARNING\s*:\s*Since flwr 1\.32, default simulated SuperNodes changed from 10 to 2\.$"),
    # Flower's Ray backend logs this for every ClientApp actor it stops at the normal end of a
    # simulation.
    re.compile(r"^WARNING\s*:\s*Manually terminating ClientAppActor$"),
    # Ray's FutureWarning about a future default on GPU visibility (this app uses no GPU); its
    # source line follows.
    re.compile(
        r"ray/_private/worker\.py:\d+: FutureWarning: Tip: In future versions of Ray, Ray will no "
        r"longer override accelerator visible devices"),
    # `flwr run` chatter before the stream: the connection, the run id (the summary names it), the
    # FAB install.
    re.compile(r"^Using SuperLink: "),
    re.compile(r"^Successfully started run \d+"),
    re.compile(r"^Successfully installed \S+ to "),
)


def verbose_from_env(env: Mapping[str, str] | None = None) -> bool:
    """``DIFF2_VERBOSE`` set to 1/true/yes/on: show every line of Flower's log."""
    value = (os.environ if env is None else env).get(VERBOSE_ENV, "")
    return value.strip().lower() in ("1", "true", "yes", "on")


def parse_round_line(line: str) -> tuple[int, int, str, dict[str, str]] | None:
    """``(round, rounds, kind, {key: value text})`` of a ``[diff2] round r/R (kind) k=v ...`` line,
    else None."""
    found = _ROUND.match(line.strip())
    if not found:
        return None
    return int(found.group(1)), int(found.group(2)), found.group(3), dict(_PAIR.findall(found.group(
        4)))


def _round_status(kind: str, values: dict[str, str]) -> str:
    parts = [kind]
    eps = values.get("epsilon_spent")
    if eps is not None and eps not in ("inf", "nan"):
        parts.append(f"ε {eps}")
    for key in ("train_loss", "test_loss"):
        if key in values:
            parts.append(f"{key} {values[key]}")
    parts += [f"{key} {value}" for key, value in values.items() if "accuracy" in key]
    return ", ".join(parts)


class RunConsole:
    """Where the lines of a run go: filtered and condensed on ``stream`` (stderr), or all of them
    when verbose."""

    def __init__(self, *, verbose: bool = False, stream: TextIO | None = None) -> None:
        self.verbose = verbose
        self.stream = sys.stderr if stream is None else stream
        self.output_dir: Path | None = None
        self.dropped = 0
        self._keep_continuation = True
        self._progress: ProgressReporter | None = None
        self._rounds_seen = 0
        self._said: set[str] = set()
        # Flower's lines held until their block ends (the next record or line of ours): a block
        # that quotes a node's refusal is dropped (the run's error line says it once)
        self._block: list[str] = []
        self._refused = False  # a node refused: the run's error line says why
        self.server_error: str | None = None  # the ServerApp's error, as it said it

    # ---------------------------------------------------------------- input
    def feed(self, line: str) -> None:
        """One line of ``flwr run --stream`` (or of our own progress); shown, condensed or
        dropped."""
        text = line.rstrip("\r\n")
        plain = _ANSI.sub("", text)
        if (found := _RUN_DIR.match(plain)) and self.output_dir is None:
            self.output_dir = Path(found.group(1))
        if self.verbose:
            self._write(text)
            return
        record = _RECORD.match(_RAY_ACTOR.sub("", plain))
        # a block: Flower's WARNING and ERROR records in a row, with their tracebacks
        if plain.startswith("[diff2] ") or (record and record.group(1) in ("DEBUG", "INFO")):
            self._flush_block()
        # the ServerApp's error: `diff2 run`'s summary says it (once), from summary.json
        if plain.startswith(_SERVER_FAILED):
            self.server_error = plain[len(_SERVER_FAILED):]
            self.dropped += 1
            return
        # the ServerApp's block: dropped with its lines, `diff2 run` prints its own
        if plain.startswith(_SERVER_SUMMARY):
            self._keep_continuation = False
            self.dropped += 1
            return
        if plain.startswith("[diff2] "):
            self._keep_continuation = True
            parsed = parse_round_line(plain)
            if parsed is None:
                # Once each: `diff2 run`'s pre-flight said the shard report and the warnings before
                # Flower started, and the ServerApp says them again.
                if plain in self._said:
                    self.dropped += 1
                else:
                    self._said.add(plain)
                    self._write(plain)
            else:
                self._round(*parsed)
            return
        if self.keep(plain):
            self._block.append(text)
        else:
            self.dropped += 1

    message = feed  # the progress callback of an in-process run

    def _flush_block(self) -> None:
        """Show the held lines of Flower's last block, unless they quote a node's refusal: the
        node's message is then the run's one error line (the server's ``run failed`` line and the
        summary), and the tracebacks around it go to the run folder's failure log."""
        block, self._block = self._block, []
        plain = [_ANSI.sub("", line) for line in block]
        refused = any(refusal_in(line) for line in plain)
        self._refused = self._refused or refused
        # after a refusal, Flower's exit-code notice says nothing more than the refusal
        if refused or (self._refused and any(_EXIT_CODE.search(line) for line in plain)):
            self.dropped += len(block)
            return
        for line in block:
            self._write(line)

    def keep(self, plain: str) -> bool:
        """Whether a line that is not ours is shown (colours stripped). Updates the continuation
        state."""
        plain = _RAY_ACTOR.sub("", plain)
        if any(pattern.search(plain) for pattern in KNOWN_NOISE):
            self._keep_continuation = False
            return False
        record = _RECORD.match(plain)
        if record:  # a new log record: INFO/DEBUG are Flower's chatter, WARNING and above are kept
            self._keep_continuation = record.group(1) not in ("DEBUG", "INFO")
            return self._keep_continuation
        # a record's continuation (traceback frame, wrapped text)
        if not plain.strip() or plain[:1].isspace():
            return self._keep_continuation
        self._keep_continuation = True  # something we do not know (a traceback, a print): show it
        return True

    # ---------------------------------------------------------------- output
    def _round(self, r: int, rounds: int, kind: str, values: dict[str, str]) -> None:
        if self._progress is None or self._progress.total != rounds:
            self._finish_progress()
            self._progress = ProgressReporter(rounds, label="round", stream=self.stream,
                                              interval_s=0.0)
            self._rounds_seen = 0
        # the first round released paid for starting Ray and the workers: pace from it,
        if self._rounds_seen == 1:
            # over a few seconds: Flower relays the log in batches, so lines arrive in bursts
            self._progress.pace_from_here(done=r, measure_s=ETA_MEASURE_S)
        self._progress.update(r, status=_round_status(kind, values))
        self._rounds_seen += 1

    def _write(self, text: str) -> None:
        if self._progress is not None:
            self._progress.write(text)
        else:
            self.stream.write(text + "\n")
            self.stream.flush()

    def _finish_progress(self) -> None:
        if self._progress is not None:
            if self._progress.is_live:  # plain mode wrote a line per round already: no closing line
                self._progress.finish()
            self._progress = None

    def close(self) -> None:
        """Show what is held, stop the live bar (it stays on screen); later lines print below
        it."""
        self._flush_block()
        self._finish_progress()


# -------------------------------------------------------------------- end of run

def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    return str(value)


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.1f} s" if value < 120 else f"{value / 60:.1f} min"


_LABELS = {"train_loss": "train_loss", "test_loss": "test_loss", "grad_norm_sq": "‖∇f‖²",
           "test_accuracy": "test acc",
           "train_accuracy": "train acc"}


def run_report(output_dir: str | os.PathLike[str] | None, *, run_id: int | None = None,
               engine: str = "flower", wall_time_s: float | None = None) -> dict:
    """The key figures of a run from its ``summary.json`` (machine-readable; see
    :func:`summary_block`)."""
    # Flower's run ids exceed 2**53 (and JSON readers' exact integers): a string, as `flwr ls
    # --format json` has it.
    report: dict = {"engine": engine, "run_id": None if run_id is None else str(run_id),
                    "output_dir": None if output_dir is None else str(output_dir),
                    "wall_time_s": wall_time_s}
    path = None if output_dir is None else Path(output_dir) / "summary.json"
    if path is None or not path.is_file():
        report.update(status="unknown",
                      error=f"no summary.json in {output_dir}" if output_dir else "no run folder")
        return report
    summary = json.loads(path.read_text())
    privacy = summary.get("privacy") or {}
    final = {k: v for k, v in (summary.get("final") or {}).items() if k != "round"}
    report.update(
        name=summary.get("name"), method=summary.get("method"), status=summary.get("status"),
        error=summary.get("error"), rounds_released=summary.get("rounds_released"),
        rounds_planned=summary.get("rounds_planned"),
        final_round=(summary.get("final") or {}).get("round"), final=final,
        best=summary.get("best") or {}, private=privacy.get("private"),
        epsilon_spent=privacy.get("epsilon_spent"), epsilon_pld=privacy.get("epsilon_pld"),
        # who computed each ε figure (none without noise)
        **dict(zip(("accountant", "epsilon_pld_accountant"),
                   epsilon_accountants(privacy) if privacy.get("private") else (None, None))),
        calibration_mode=(privacy.get("calibration") or {}).get("mode"),
        epsilon_target=privacy.get("epsilon_target"), delta=privacy.get("delta"),
        training_time_s=summary.get("wall_time_s"), summary_file=str(path),
        files=sorted(p.name for p in Path(output_dir).iterdir() if p.is_file()
                     and not p.name.endswith(".tmp")),
    )
    clients = ((summary.get("config") or {}).get("training") or {}).get("clients")
    report["clients"] = clients
    report["routine"] = summary.get("routine")
    report["schedule"] = summary.get("schedule")
    report["warnings"] = list(summary.get("warnings") or ())
    if summary.get("loss_rise"):
        report["loss_rise"] = summary["loss_rise"]
    return report


def server_summary_block(report: dict) -> str:
    """:func:`summary_block` as the ServerApp ends its log with it (``[diff2] summary: run
    completed: ...``): a head that :class:`RunConsole` knows, so that `diff2 run` drops this copy
    and prints its own."""
    return summary_block(report, head=_SERVER_SUMMARY + "run")


def _epsilon_text(report: dict) -> str:
    """ε spent named by its accountant (``2.99 exact μ-GDP, 3.01 PLD``, ``2.98 Skellam RDP``); the
    PLD cross-check only where it is one, the zCDP calibration of ``privacy.mode: rdp`` said."""
    name = report.get("accountant") or EXACT_GDP  # an old report: central, exact
    text = f"{_fmt(report.get('epsilon_spent'))} {name}"
    cross = report.get("epsilon_pld_accountant", "PLD" if name == EXACT_GDP else None)
    if cross and report.get("epsilon_pld") is not None:
        text += f", {_fmt(report['epsilon_pld'])} {cross}"
    if report.get("calibration_mode") == "rdp":
        text += " (σ calibrated by zCDP: privacy.mode rdp)"
    return text


def summary_block(report: dict, *, head: str = "[diff2] run") -> str:
    """A short human-readable block: status, final and best metrics, ε by both accountants, time,
    files."""
    status = report.get("status", "unknown")
    head = f"{head} {status}"
    if report.get("name"):
        routine = (report.get("routine") or {}).get("name")
        schedule = (report.get("schedule") or {}).get("name")
        head += f": {report['name']} ({report.get('method')}" + (f" + {routine}" if routine not in (
            None, "gd") else "") + (f", {schedule} step" if schedule not in (None, "constant")
                                    else "")
        if report.get("clients"):
            head += f", P = {report['clients']}"
        head += f", {report.get('rounds_released')}/{report.get('rounds_planned')} rounds)"
    if report.get("run_id") is not None:
        head += f", Flower run {report['run_id']}"
    lines = [head]
    if report.get("error"):
        lines.append(f"  error        {report['error']}")
    rise = report.get("loss_rise")
    if rise:
        lines.append(
            f"  WARNING      {rise['metric']} ended at {_fmt(rise['final'])}, "
            f"{_fmt(rise['ratio'])}× x_0's {_fmt(rise['initial'])}: the model got worse (see the "
            f"WARNING above; warnings in the JSON)")
    final, best = report.get("final") or {}, report.get("best") or {}
    keys = [k for k in ("train_loss", "test_loss", "grad_norm_sq") if k in final or k in best]
    keys += sorted(k for k in {*final, *best} if k not in keys)
    for key in keys:
        if final.get(key) is None and best.get(key) is None:
            continue
        best_text = f"   best {_fmt(best.get(key))}" if key in best else ""
        lines.append(f"  {_LABELS.get(key, key):<12} final {_fmt(final.get(key)):<11}{best_text}")
    if report.get("private") is False:
        lines.append("  ε            none: this method adds no noise (no privacy guarantee)")
    elif report.get("epsilon_spent") is not None or report.get("epsilon_pld") is not None:
        target = ""
        if report.get("epsilon_target") is not None:
            target = (f"   (target ε = {_fmt(report['epsilon_target'])}, δ = "
                      f"{_fmt(report.get('delta'))})")
        lines.append(f"  ε spent      {_epsilon_text(report)}{target}")
    if report.get("wall_time_s") is not None:
        training = f" (training {_seconds(report.get('training_time_s'))})" if report.get(
            "training_time_s") else ""
        lines.append(f"  wall time    {_seconds(report.get('wall_time_s'))}{training}")
    # the ServerApp's own block: it does not know the launch time
    elif report.get("training_time_s") is not None:
        lines.append(f"  training     {_seconds(report['training_time_s'])}")
    if report.get("output_dir"):
        files = f": {', '.join(report['files'])}" if report.get("files") else ""
        lines.append(f"  files        {report['output_dir']}{files}")
    return "\n".join(lines)
