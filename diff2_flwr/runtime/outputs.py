"""A run's output folder: per-round metrics (JSON lines) and a summary (JSON), written as they
come."""

from __future__ import annotations

import json
import math
import os
import secrets
import time
from pathlib import Path
from typing import Any, Mapping

from .curves import CURVES_FILE, plot_runs

__all__ = ["RunRecorder", "new_run_dir", "to_json"]


def to_json(value: Any) -> Any:
    """Plain JSON values: non-finite floats become null (JSON has no inf/NaN), numpy scalars become
    numbers."""
    if isinstance(value, dict):
        return {str(k): to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 1) == 0:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def new_run_dir(root: str | os.PathLike[str], name: str) -> Path:
    """A fresh folder ``root/<name>-<UTC time>-<random>`` (never reuses an existing one)."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    path = Path(root).expanduser().resolve() / f"{name}-{stamp}-{secrets.token_hex(3)}"
    path.mkdir(parents=True, exist_ok=False)
    return path


class RunRecorder:
    """Appends one JSON line per round to ``metrics.jsonl`` and rewrites ``summary.json``
    atomically."""

    METRICS = "metrics.jsonl"
    SUMMARY = "summary.json"
    PARAMETERS = "final_parameters.npy"

    def __init__(self, directory: Path, *, keep_through_round: int | None = None) -> None:
        """Open (or create) a run folder; with ``keep_through_round`` (a resumed run) drop later
        rows."""
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.kept: list[dict[str, Any]] = []
        metrics = self.directory / self.METRICS
        if keep_through_round is not None and metrics.exists():
            rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
            self.kept = [r for r in rows if r["round"] <= keep_through_round]
            tmp = metrics.with_name(metrics.name + ".tmp")
            tmp.write_text("".join(json.dumps(r, allow_nan=False) + "\n" for r in self.kept))
            os.replace(tmp, metrics)
        self._metrics = metrics.open("a", buffering=1)

    def row(self, values: dict[str, Any]) -> None:
        """Append one round's metrics to ``metrics.jsonl`` (a line, flushed; non-finite as null)."""
        self._metrics.write(json.dumps(to_json(values), allow_nan=False) + "\n")

    def summary(self, values: dict[str, Any]) -> None:
        """Replace ``summary.json`` with ``values`` atomically (a reader never sees half a file)."""
        tmp = self.directory / (self.SUMMARY + ".tmp")
        tmp.write_text(json.dumps(to_json(values), indent=2, allow_nan=False) + "\n")
        os.replace(tmp, self.directory / self.SUMMARY)

    def parameters(self, x) -> None:
        """The released final iterate x_R (a flat float64 vector; public output of the run)."""
        import numpy as np  # noqa: PLC0415 -- keeps `diff2 --help` light (the CLI imports this)

        tmp = self.directory / (self.PARAMETERS + ".tmp.npy")
        np.save(tmp, np.asarray(x, dtype=np.float64))
        os.replace(tmp, self.directory / self.PARAMETERS)

    def curves(self, rows: list[dict[str, Any]], title: str,
               privacy: Mapping[str, Any] | None = None) -> Path:
        """``curves.png``: the run's per-round metrics against the round (see :mod:`.curves`), its
        ε named by the accountants of ``privacy`` (the summary's block)."""
        return plot_runs([(title, rows)], self.directory / CURVES_FILE, title=title,
                         privacy=[privacy])

    def close(self) -> None:
        """Close ``metrics.jsonl`` (every row was flushed as it was written)."""
        self._metrics.close()
