"""Progress of long jobs on stderr: a live bar on a terminal, plain periodic lines in a log.

A bar redrawn with carriage returns turns a CI or ``nohup`` log into one endless line, so the bar
(``rich``) is drawn only when the stream is a terminal; otherwise a plain line is written at
start, at most every ``interval_s`` seconds, and at the end.
"""

from __future__ import annotations

import math
import sys
import time
from typing import TextIO

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)

__all__ = ["ProgressReporter"]


class ProgressReporter:
    """``done`` of ``total`` units (fractions allowed), with elapsed time, an ETA and an optional
    status text."""

    def __init__(self, total: float, *, label: str = "runs", stream: TextIO | None = None,
                 enabled: bool = True, interval_s: float = 10.0) -> None:
        self.total, self.label, self.enabled, self.interval_s = total, label, enabled, interval_s
        self.stream = sys.stderr if stream is None else stream
        self.done = 0.0
        self.started = time.perf_counter()
        # the ETA extrapolates the pace since this (time, done) ...
        self._eta_from = (self.started, 0.0)
        self._eta_after_s = 0.0  # ... once it has been measured for this long
        self._last_line = -math.inf
        self.status = ""
        self._bar = None
        self._task = None
        if enabled and _is_terminal(self.stream):
            console = Console(file=self.stream, force_terminal=True)
            self._bar = Progress(TextColumn(f"[diff2] {label}", markup=False), BarColumn(),
                                 MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("ETA"),
                                 TimeRemainingColumn(), TextColumn("{task.fields[status]}",
                                                                   markup=False), console=console)
            self._task = self._bar.add_task(label, total=total, status="")
            self._bar.start()

    @property
    def is_live(self) -> bool:
        """Whether a live bar is drawn (a terminal), rather than plain periodic lines."""
        return self._bar is not None

    def set_total(self, total: float) -> None:
        """The job turned out smaller or larger than announced."""
        self.total = total
        if self._bar is not None:
            self._bar.update(self._task, total=total)

    def update(self, done: float, status: str | None = None) -> None:
        """Set the units done so far (monotone) and, optionally, a short status (e.g. the latest
        metrics)."""
        self.done = done
        if status is not None:
            self.status = status
        if not self.enabled or self.total <= 0:
            return
        if self._bar is not None:
            self._bar.update(self._task, completed=done, status=self.status)
            return
        now = time.perf_counter()
        if now - self._last_line >= self.interval_s or done >= self.total:
            self._last_line = now
            self.stream.write(self._line(now) + "\n")
            self.stream.flush()

    def pace_from_here(self, done: float | None = None, *, measure_s: float = 0.0) -> None:
        """Base the ETA on the pace from now and ``done`` units (default: those done so far) on,
        and show none until it has been measured for ``measure_s`` seconds.

        For jobs whose first unit pays for start-up (its pace would make the ETA far too long), or
        whose updates arrive in bursts.
        """
        self._eta_from = (time.perf_counter(), self.done if done is None else done)
        self._eta_after_s = measure_s

    def _line(self, now: float) -> str:
        elapsed = now - self.started
        since, base = self._eta_from
        measured = self.done > base and now - since >= self._eta_after_s
        eta = (now - since) / (self.done - base) * (
            self.total - self.done) if measured else math.nan
        eta_text = f"{eta:.0f} s" if math.isfinite(eta) else "?"
        shown = int(self.done) if float(self.done).is_integer() else round(self.done, 1)
        status = f", {self.status}" if self.status else ""
        return (
            f"[diff2] {self.label} {shown}/{self.total:g} ({100 * self.done / self.total:.0f} "
            f"%){status}, {elapsed:.0f} s elapsed, ETA {eta_text}")

    def write(self, line: str) -> None:
        """Print a line of text without breaking the bar (above it while it is live)."""
        if self._bar is not None:
            self._bar.console.print(line, markup=False, highlight=False, soft_wrap=True)
        else:
            self.stream.write(line + "\n")
            self.stream.flush()

    def finish(self) -> None:
        """Stop the bar, or write the last line of an unfinished job (a finished one wrote it)."""
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        elif self.enabled and self.total > 0 and self.done < self.total:
            self.stream.write(self._line(time.perf_counter()) + "\n")
            self.stream.flush()


def _is_terminal(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False
