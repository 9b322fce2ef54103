"""Durable server state: a crashed DIFF2 server neither loses the budget it spent nor spends it twice.

After round 0 (initialisation: the noise key is fixed from then on) and after every released
round the server writes one file atomically (temporary file, fsync, rename): the round, x_r,
x_{r-1}, ṽ_r, the noise key, the privacy ledger and a fingerprint of the config. A restarted
server with the same config resumes from it. Because the noise of round r depends only on
(noise key, r), a round that was computed but not yet checkpointed when the server died is
recomputed with the same noise from the same inputs: it releases the same values again, so
the ledger (which counts it once) stays exact.

The checkpoint of round r is durable before anything of round r is written elsewhere (its
metrics row, the summary, the parameters sent to the workers): it also carries round r's release
row (kind, radius, noise std, clip fraction, ε, update norm), so a server that died after the
checkpoint but before the row was written rewrites that row on resume (re-evaluating x_r, which is
deterministic) instead of recomputing round r.

The file holds the secret noise key: protect it like the data (anyone with the key and the
released iterates can subtract the noise).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..core.estimator import Diff2State
from ..core.privacy import GaussianEvent, PrivacyLedger

__all__ = ["CheckpointError", "Checkpoint", "config_fingerprint", "save_checkpoint", "load_checkpoint"]

_FORMAT = "diff2-checkpoint/2"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: unreadable, corrupted, or from another configuration."""


def config_fingerprint(config: dict[str, Any], n_min: int) -> str:
    """A hash of everything that determines the trajectory and the privacy accounting."""
    relevant = {k: config[k] for k in ("method", "dataset", "model", "privacy", "training")}
    relevant["n_min"] = n_min
    return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class Checkpoint:
    fingerprint: str
    state: Diff2State
    ledger: PrivacyLedger | None
    run_dir: str | None
    #: Round ``state.round``'s metrics row without the evaluation (None before format 2).
    release_row: dict[str, Any] | None = None


def save_checkpoint(path: Path, checkpoint: Checkpoint) -> None:
    """Write atomically: a reader sees the previous checkpoint or this one, never a mix."""
    s = checkpoint.state
    if s.routine_state is not None:
        raise CheckpointError("Only routines without state (gd) can be checkpointed so far.")
    meta = {
        "format": _FORMAT, "fingerprint": checkpoint.fingerprint, "round": s.round, "noise_key": str(s.noise_key),
        "noise_seeded": s.noise_seeded, "run_dir": checkpoint.run_dir, "release_row": checkpoint.release_row,
        "ledger": None if checkpoint.ledger is None else {
            "delta": checkpoint.ledger.delta,
            "events": [[e.noise_multiplier, e.kind] for e in checkpoint.ledger.events]},
    }
    arrays = {"x": s.x}
    if s.x_prev is not None:
        arrays["x_prev"] = s.x_prev
    if s.v is not None:
        arrays["v"] = s.v
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as fh:
        np.savez(fh, meta=np.array(json.dumps(meta)), **arrays)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def load_checkpoint(path: Path, fingerprint: str) -> Checkpoint:
    """Read a checkpoint; refuse a corrupted one or one written for another configuration."""
    try:
        with np.load(path, allow_pickle=False) as data:
            meta = json.loads(str(data["meta"]))
            arrays = {k: np.array(data[k]) for k in ("x", "x_prev", "v") if k in data.files}
    except (OSError, ValueError, KeyError, EOFError, json.JSONDecodeError) as exc:
        raise CheckpointError(
            f"Checkpoint {path} is unreadable or corrupted ({type(exc).__name__}: {exc}). Delete it to start over "
            "(the budget it recorded is then spent again), or restore a good copy."
        ) from None
    if meta.get("format") != _FORMAT:
        raise CheckpointError(f"Checkpoint {path} has format {meta.get('format')!r}; expected {_FORMAT!r}.")
    if meta["fingerprint"] != fingerprint:
        raise CheckpointError(
            f"Checkpoint {path} was written for another configuration (fingerprint {meta['fingerprint'][:12]}…, "
            f"this config {fingerprint[:12]}…). Resume with the config that wrote it, or point "
            "`output.checkpoint` elsewhere."
        )
    for key, a in arrays.items():
        a.flags.writeable = False
    ledger = None
    if meta["ledger"] is not None:
        ledger = PrivacyLedger(meta["ledger"]["delta"], tuple(GaussianEvent(float(z), k) for z, k in meta["ledger"]["events"]))
        if len(ledger.events) != meta["round"]:
            raise CheckpointError(f"Checkpoint {path} is inconsistent: round {meta['round']} but "
                                  f"{len(ledger.events)} ledger events.")
    state = Diff2State(round=int(meta["round"]), x=arrays["x"], x_prev=arrays.get("x_prev"), v=arrays.get("v"),
                       routine_state=None, noise_key=int(meta["noise_key"]), noise_seeded=bool(meta["noise_seeded"]))
    row = meta.get("release_row")
    if row is not None and row.get("round") != state.round:
        raise CheckpointError(f"Checkpoint {path} is inconsistent: round {state.round} but its release row is for "
                              f"round {row.get('round')}.")
    return Checkpoint(fingerprint=fingerprint, state=state, ledger=ledger, run_dir=meta["run_dir"], release_row=row)
