"""A data owner's live audit of a run: canary records in its own replies, its observations on its
own disk.

A node whose policy has ``canaries: {count: B, state: FOLDER}``
(:class:`~diff2_flwr.runtime.policy.CanaryPolicy`) adds B canary records
(:class:`~diff2_flwr.core.canaries.CanaryFrame`) to each of its gradient replies and, for every
task, appends to ``FOLDER/<run id>/rounds.jsonl`` what it needs to score them: the round, its kind
and radius, the noise std per coordinate the run config's calibration prescribes (σ_r = σ·radius)
and the projections U x_(r-1) of the iterate it received. The canaries' secret seed is ``FOLDER/<run
id>/seed`` (0600 in a 0700 folder), drawn from the OS's secure generator at the run's first task
unless the owner put one there (to reproduce a run); the server never sees it. ``diff2 audit --live
FOLDER/<run id>`` scores the run so far, while it trains (:mod:`diff2_flwr.lab.audit.live`).

Trust (``THREATS.md``): it protects the data owner against a server that adds less noise than the
run config declares — by mistake (a miscalibrated σ, a factor √2, a wrong sensitivity) — measured on
the iterates this node receives, without trusting the server. It cannot catch a server that adds the
declared noise to what it releases and leaks the clipped means some other way, nor noise that is
wrong only in round R (no task follows it). Workers keep no state in memory between messages:
everything lives in the folder.
"""

from __future__ import annotations

import functools
import json
import secrets
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..core.canaries import CanaryFrame
from ..core.gradients import Contribution
from .secret_files import append_private, private_folder, write_private

__all__ = ["CanaryMonitor", "ROUNDS_FILE", "META_FILE", "SEED_FILE", "read_seed"]

ROUNDS_FILE = "rounds.jsonl"
META_FILE = "meta.json"
SEED_FILE = "seed"


@functools.lru_cache(maxsize=4)
def _frame(seed: int, count: int, dim: int) -> CanaryFrame:
    return CanaryFrame(seed, count, dim)


def read_seed(folder: Path) -> int:
    """The canaries' secret seed of the run folder ``folder``."""
    return int((folder / SEED_FILE).read_text().strip())


@dataclass(frozen=True)
class CanaryMonitor:
    """One node's canaries for one run, kept in ``folder`` (see the module)."""

    folder: Path
    frame: CanaryFrame

    @classmethod
    def open(cls, folder: Path, *, count: int, dim: int, meta: dict) -> "CanaryMonitor":
        """The run's folder: its seed made (secret) on the first task, its meta written once and
        then checked."""
        folder = private_folder(folder)
        seed_path = folder / SEED_FILE
        if not seed_path.exists():
            write_private(seed_path, f"{secrets.randbits(128)}\n".encode())
        seed = read_seed(folder)
        meta = {**meta, "count": count, "dim": dim}
        meta_path = folder / META_FILE
        if meta_path.exists():
            old = json.loads(meta_path.read_text())
            if old != meta:
                changed = sorted(k for k in set(old) | set(meta) if old.get(k) != meta.get(k))
                raise ValueError(
                    f"canary folder {folder}: this run's {changed} differ from what its first "
                    f"task recorded ({META_FILE}); one folder holds one run. Move it away, or fix "
                    f"the run.")
        else:
            write_private(meta_path, json.dumps(meta, indent=1).encode())
        return cls(folder, _frame(seed, count, dim))

    def reply(self, r: int, restart: bool, radius: float, noise_std: float, x_current: np.ndarray,
              contribution: Contribution) -> Contribution:
        """Record round r's observation (its kind, radius, the calibrated noise std per coordinate
        and U x_(r-1)), then the reply with the B canary records added (an overflowing reply, which
        carries nothing, is left as it is)."""
        row = {"round": r, "restart": restart, "radius": radius, "noise_std": noise_std,
               "x_max": float(np.max(np.abs(x_current))),
               "projection": self.frame.project(x_current).tolist()}
        append_private(self.folder / ROUNDS_FILE, (json.dumps(row) + "\n").encode())
        if contribution.overflow:
            return contribution
        mean, n = self.frame.add(contribution.mean, contribution.num_samples, radius)
        return Contribution(mean=mean, num_samples=n, num_clipped=contribution.num_clipped,
                            overflow=False)
