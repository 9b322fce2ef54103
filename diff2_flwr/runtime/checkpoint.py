"""Durable server state: a crashed DIFF2 server neither loses the budget it spent nor spends it
twice.

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
deterministic) instead of recomputing round r. (The row is released as any other: without the clip
fraction unless the resumed run sets ``evaluation.clip_stats``.)

The routine's state (momentum buffer, Adam's moments and step count) is part of the server's
state and is saved with it (format ``diff2-checkpoint/3``: the routine's name and parameters in
the metadata, its arrays beside x_r); a checkpoint is resumed only by the same routine with the
same parameters. Format 2 (no routine state: GD only) is still read. A step-size schedule keeps no
state: round r's factor s(r) is a function of r (the checkpoint's round) and R, so a resumed run
steps as the uninterrupted one; the schedule is part of the config's fingerprint (the constant
one, at its declared ``before`` value, is not: checkpoints written before schedules still resume).

The file holds the secret noise key (or, in a seeded run, the seed it is derived from): anyone
with it and the released iterates subtracts the noise. It is therefore written owner-only whatever
the umask — the temporary file is created with mode 0600 (``os.open``, then ``fchmod`` before a
byte is written) and renamed over the checkpoint, and the folders created for it are 0700 — and a
checkpoint that others can read or write is refused on resume: the key may have leaked, or the file
been replaced.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..core.estimator import Diff2State
from ..core.routines import Routine, describe_routine
from ..core.distributed import SkellamEvent, SkellamLedger
from ..core.privacy import GaussianEvent, PrivacyLedger
from .config_experiment import ExperimentConfig
from .secret_files import fsync_folder
from .spec import run_identity

__all__ = ["CheckpointError", "Checkpoint", "config_fingerprint", "legacy_config_fingerprint",
           "FINGERPRINT_RULE",
           "save_checkpoint", "load_checkpoint", "check_owner_only", "OWNER_ONLY", "PRIVATE_DIR"]

_FORMAT = "diff2-checkpoint/3"
#: Formats still read: 2 had no routine state (it refused to write any, so it is always GD's).
_READABLE = ("diff2-checkpoint/2", _FORMAT)
_ROUTINE_ARRAY = "routine."  # prefix of the routine state's arrays in the file
#: The mode of a checkpoint (and of its temporary file): it holds the noise key, a secret.
OWNER_ONLY = 0o600
#: The mode of the folders created for a checkpoint.
PRIVATE_DIR = 0o700


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: unreadable, corrupted, or from another configuration."""


#: The rule a checkpoint's fingerprint was made by, in its metadata (``fingerprint_rule``); a
#: checkpoint without it was written by :func:`legacy_config_fingerprint`'s rule and is still
#: resumed by it.
FINGERPRINT_RULE = "declared/1"


def config_fingerprint(config: dict[str, Any], n_min: int) -> str:
    """A hash of everything that determines the trajectory and the privacy accounting: the
    experiment's keys as their declarations say (:func:`~diff2_flwr.runtime.spec.run_identity`: not
    the name, the evaluation, the output or Flower's timeouts; a key added later only once it leaves
    its ``before`` value), and n_min."""
    relevant = run_identity(ExperimentConfig, config)
    relevant["n_min"] = n_min
    return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()


def legacy_config_fingerprint(config: dict[str, Any], n_min: int) -> str:
    """The fingerprint of checkpoints written before :data:`FINGERPRINT_RULE` (five sections hashed
    whole): an interrupted run of an earlier version still resumes."""
    relevant = {k: config[k] for k in ("method", "dataset", "model", "privacy", "training")}
    dataset = relevant["dataset"]
    # no subsample: as before the keys existed
    if isinstance(dataset, dict) and dataset.get("train_samples") is None:
        relevant["dataset"] = {k: v for k, v in dataset.items() if k not in ("train_samples",
                                                                             "subsample_seed")}
    relevant["n_min"] = n_min
    return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class Checkpoint:
    """What :func:`save_checkpoint` writes after each released round: the server's state (x_r,
    x_{r-1}, ṽ_r, the noise key), its privacy ledger, the fingerprint of the config a resume must
    match, and the run folder."""

    fingerprint: str
    state: Diff2State
    ledger: PrivacyLedger | SkellamLedger | None
    run_dir: str | None
    #: Round ``state.round``'s metrics row without the evaluation (None before format 2).
    release_row: dict[str, Any] | None = None
    #: The routine that produced ``state.routine_state`` (:func:`describe_routine`; None before
    #: format 3).
    routine: dict[str, Any] | None = None


def _ledger_meta(ledger: PrivacyLedger | SkellamLedger) -> dict[str, Any]:
    """The ledger as JSON: Gaussian events as [z, kind]; distributed noise's Skellam events as [z,
    ρ, D, kind]."""
    if isinstance(ledger, SkellamLedger):
        return {"delta": ledger.delta, "mechanism": "skellam",
                "events": [[e.noise_multiplier, e.rho, e.padded_dim,
                            e.kind] for e in ledger.events]}
    return {"delta": ledger.delta, "events": [[e.noise_multiplier, e.kind] for e in ledger.events]}


def _ledger_of(meta: dict[str, Any]) -> PrivacyLedger | SkellamLedger:
    if meta.get("mechanism") == "skellam":
        return SkellamLedger(meta["delta"], tuple(SkellamEvent(float(z), float(rho), int(d), k)
                                                  for z, rho, d, k in meta["events"]))
    return PrivacyLedger(meta["delta"], tuple(GaussianEvent(float(z), k) for z,
                                              k in meta["events"]))


def save_checkpoint(path: Path, checkpoint: Checkpoint) -> None:
    """Write atomically: a reader sees the previous checkpoint or this one, never a mix."""
    s = checkpoint.state
    routine_scalars, routine_arrays = _split_routine_state(s.routine_state)
    meta = {
        "format": _FORMAT, "fingerprint": checkpoint.fingerprint,
        "fingerprint_rule": FINGERPRINT_RULE, "round": s.round, "noise_key": str(s.noise_key),
        "noise_seeded": s.noise_seeded, "run_dir": checkpoint.run_dir,
        "release_row": checkpoint.release_row,
        "ledger": None if checkpoint.ledger is None else _ledger_meta(checkpoint.ledger),
        "routine": None if checkpoint.routine is None else {
            **checkpoint.routine, "state": routine_scalars, "arrays": sorted(routine_arrays)},
    }
    arrays = {"x": s.x}
    if s.x_prev is not None:
        arrays["x_prev"] = s.x_prev
    if s.v is not None:
        arrays["v"] = s.v
    arrays |= {_ROUTINE_ARRAY + k: a for k, a in routine_arrays.items()}
    _private_folders(path.parent)
    tmp = path.with_name(path.name + ".tmp")
    with _owner_only(tmp) as fh:
        np.savez(fh, meta=np.array(json.dumps(meta)), **arrays)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_folder(path.parent)


def _private_folders(folder: Path) -> None:
    """Create ``folder`` and its missing parents owner-only (0700 whatever the umask); leave
    existing ones alone."""
    missing = []
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    for created in reversed(missing):
        created.mkdir(mode=PRIVATE_DIR)
        # the umask may have removed owner bits; the folder is still empty
        os.chmod(created, PRIVATE_DIR)


def _owner_only(tmp: Path):
    """A new file opened for writing with mode 0600 set before anything is written, whatever the
    umask.

    A temporary file left by a crash is removed first: ``O_EXCL`` then creates a fresh one (never
    follows a link planted there, never inherits a wider mode).
    """
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), OWNER_ONLY)
    try:
        if hasattr(os, "fchmod"):
            os.fchmod(fd, OWNER_ONLY)  # the umask may have removed the owner's bits
        return os.fdopen(fd, "wb")
    except BaseException:
        os.close(fd)
        raise


def check_owner_only(path: Path) -> None:
    """Refuse a checkpoint that others may read or write: its noise key may have leaked, or the file
    been replaced."""
    if os.name != "posix":
        return
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return  # np.load says what is wrong with a file that cannot be read
    if mode & 0o077:
        raise CheckpointError(
            f"Checkpoint {path} has mode {mode:04o}: group or others may read or write it, but it "
            f"holds the run's secret "
            "noise key (whoever reads it can subtract the noise from every released iterate). "
            "Resuming is refused. "
            f"If nobody else could have read or replaced it, make it owner-only with `chmod 600 "
            f"{path}` and run "
            "again; otherwise treat this run's released outputs as not private and start over "
            "(delete the file)."
        )


def _split_routine_state(state: Any) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """A routine state (None or a NamedTuple of arrays and numbers) as JSON scalars and named
    arrays."""
    if state is None:
        return {}, {}
    if not hasattr(state, "_asdict"):
        raise CheckpointError(
            f"The routine state {type(state).__name__} cannot be checkpointed: a routine's state "
                              "must be None or a NamedTuple of arrays and numbers.")
    scalars, arrays = {}, {}
    for key, value in state._asdict().items():
        if isinstance(value, np.ndarray):
            arrays[key] = value
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            scalars[key] = value
        else:
            raise CheckpointError(
                f"The routine state's field {key!r} is a {type(value).__name__}: only arrays and "
                                  "numbers can be checkpointed.")
    return scalars, arrays


def _stored_routine(meta: dict) -> dict[str, Any]:
    """The routine that wrote the file (format 2 refused any routine state: it is GD's, learning
    rate unrecorded)."""
    stored = meta.get("routine")
    return {"name": "gd"} if stored is None else {k: v for k,
                                                  v in stored.items() if k not in ("state",
                                                                                   "arrays")}


def _routine_state(path: Path, meta: dict, stored_arrays: dict[str, np.ndarray], routine: Routine,
                   x: np.ndarray) -> Any:
    """The routine state stored in the file, checked against ``routine`` (same name, parameters,
    fields, shapes)."""
    template = routine.init(x)
    have, want = _stored_routine(meta), describe_routine(routine)
    if meta.get("routine") is None:  # format 2
        if want["name"] != "gd" or template is not None:
            raise CheckpointError(
                f"Checkpoint {path} was written by routine gd (format {meta['format']}), but this "
                f"run "
                                  f"uses routine {want['name']}: resume with training.routine: "
                                  f"gd, or point "
                                  "`output.checkpoint` elsewhere.")
        return None
    if have != want:
        raise CheckpointError(
            f"Checkpoint {path} was written by the routine {have}, but this run uses {want}: the "
                              "routine's state would not match. Resume with the routine that "
                              "wrote it (training.routine "
                              "and training.learning_rate), or point `output.checkpoint` "
                              "elsewhere.")
    if template is None:
        return None
    fields: dict[str, Any] = {}
    for key, value in template._asdict().items():
        if isinstance(value, np.ndarray):
            a = stored_arrays.get(key)
            if a is None:
                raise CheckpointError(
                    f"Checkpoint {path} is inconsistent: routine {want['name']}'s array {key!r} "
                    f"is missing.")
            if a.shape != value.shape or a.dtype != np.float64:
                raise CheckpointError(
                    f"Checkpoint {path} is inconsistent: routine array {key!r} has shape "
                    f"{a.shape} and dtype {a.dtype}, expected {value.shape} float64.")
            a.flags.writeable = False
            fields[key] = a
        else:
            if key not in meta["routine"]["state"]:
                raise CheckpointError(
                    f"Checkpoint {path} is inconsistent: routine {want['name']}'s {key!r} is "
                    f"missing.")
            fields[key] = type(value)(meta["routine"]["state"][key])
    return type(template)(**fields)


def load_checkpoint(path: Path, fingerprint: str, *, routine: Routine | None = None,
                    x0: np.ndarray | None = None,
                    legacy_fingerprint: str | None = None) -> Checkpoint:
    """Read a checkpoint; refuse a corrupted one or one written for another configuration.

    ``fingerprint`` identifies this run by :data:`FINGERPRINT_RULE`; a checkpoint written before
    that rule (no ``fingerprint_rule`` in its metadata) is compared with ``legacy_fingerprint``
    instead, when given.

    ``routine`` is the run's routine: the checkpoint must have been written by the same routine with
    the same parameters, and its state is rebuilt (shaped like ``routine.init(x0)``). Without
    ``routine`` only a checkpoint of a stateless routine can be read. A checkpoint that group or
    others may read or write is refused (:func:`check_owner_only`).
    """
    check_owner_only(path)
    try:
        with np.load(path, allow_pickle=False) as data:
            meta = json.loads(str(data["meta"]))
            arrays = {k: np.array(data[k]) for k in ("x", "x_prev", "v") if k in data.files}
            stored_arrays = {k[len(_ROUTINE_ARRAY):]: np.array(data[k]) for k in data.files
                             if k.startswith(_ROUTINE_ARRAY)}
    except (OSError, ValueError, KeyError, EOFError, json.JSONDecodeError) as exc:
        raise CheckpointError(
            f"Checkpoint {path} is unreadable or corrupted ({type(exc).__name__}: {exc}). Delete "
            f"it to start over "
            "(the budget it recorded is then spent again), or restore a good copy."
        ) from None
    if meta.get("format") not in _READABLE:
        raise CheckpointError(
            f"Checkpoint {path} has format {meta.get('format')!r}; expected one of "
            f"{list(_READABLE)}.")
    if "fingerprint_rule" not in meta and legacy_fingerprint is not None:
        fingerprint = legacy_fingerprint
    if meta["fingerprint"] != fingerprint:
        have = _stored_routine(meta)
        want = None if routine is None else describe_routine(routine)
        differs = want is not None and (have != want if meta.get("routine")
                                        else have["name"] != want["name"])
        routines = f" Its routine is {have}; this run's is {want}." if differs else ""
        raise CheckpointError(
            f"Checkpoint {path} was written for another configuration (fingerprint "
            f"{meta['fingerprint'][:12]}…, "
            f"this config {fingerprint[:12]}…).{routines} Resume with the config that wrote it, "
            f"or point "
            "`output.checkpoint` elsewhere."
        )
    if "x" not in arrays:
        raise CheckpointError(f"Checkpoint {path} is inconsistent: it holds no iterate x.")
    if routine is not None:
        routine_state = _routine_state(path, meta, stored_arrays, routine,
                                       arrays["x"] if x0 is None else x0)
    elif stored_arrays or (meta.get("routine") or {}).get("state"):
        raise CheckpointError(
            f"Checkpoint {path} holds the state of routine {_stored_routine(meta)['name']}: load "
            f"it "
                              "with that routine.")
    else:
        routine_state = None
    for key, a in arrays.items():
        a.flags.writeable = False
    ledger = None
    if meta["ledger"] is not None:
        ledger = _ledger_of(meta["ledger"])
        if len(ledger.events) != meta["round"]:
            raise CheckpointError(f"Checkpoint {path} is inconsistent: round {meta['round']} but "
                                  f"{len(ledger.events)} ledger events.")
    state = Diff2State(round=int(meta["round"]), x=arrays["x"], x_prev=arrays.get("x_prev"),
                       v=arrays.get("v"), routine_state=routine_state,
                       noise_key=int(meta["noise_key"]), noise_seeded=bool(meta["noise_seeded"]))
    row = meta.get("release_row")
    if row is not None and row.get("round") != state.round:
        raise CheckpointError(
            f"Checkpoint {path} is inconsistent: round {state.round} but its release row is for "
                              f"round {row.get('round')}.")
    stored = meta.get("routine")
    described = None if stored is None else {k: v for k, v in stored.items() if k not in ("state",
                                                                                          "arrays")}
    return Checkpoint(fingerprint=fingerprint, state=state, ledger=ledger, run_dir=meta["run_dir"],
                      release_row=row, routine=described)
