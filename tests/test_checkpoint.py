"""Checkpoint and resume: a restarted server continues the same trajectory and ledger, never counts
twice."""

from __future__ import annotations

import json
import os
import shutil
import stat

import numpy as np
import pytest

from diff2_flwr.runtime.checkpoint import CheckpointError
from diff2_flwr.runtime.config import parse_config
from diff2_flwr.runtime.session import build_server, build_worker

ROUNDS = 7


def config(tmp_path, seed=3, **training):
    return parse_config({
        "name": "ck", "method": "diff2", "dataset": {"name": "synthetic", "num_samples": 500},
        "training": {"rounds": ROUNDS, "restart_every": 3, "learning_rate": 0.2, "clip_diff": 3.0,
                     "clients": 3,
                     "seed": seed, **training},
        "output": {"dir": str(tmp_path / "out"), "checkpoint": str(tmp_path / "state.npz")},
    })


def drive(cfg, server, until):
    workers = [build_worker(cfg, p) for p in range(cfg.training.clients)]
    while server.state.round < until:
        server.release([w.reply(server.plan()) for w in workers])
    return server


def rows(server):
    return [json.loads(line)
            for line in (server.recorder.directory / "metrics.jsonl").read_text().splitlines()]


def strip(history):
    return [{k: v for k, v in r.items() if k != "elapsed_s"} for r in history]


ROUTINES = {"gd": "gd", "momentum": {"name": "momentum", "momentum": 0.8}, "nesterov": "nesterov",
            "adam": {"name": "adam", "beta1": 0.8}, "adamw": {"name": "adamw", "weight_decay": 0.1}}
#: Step-size schedules: the round index of the checkpoint sets round r's step η·s(r) on resume.
SCHEDULES = {"constant": "constant", "step": {"name": "step", "decay": 0.5, "every": 2},
             "cosine": {"name": "cosine", "floor": 0.1}, "inverse_sqrt": "inverse_sqrt"}
CASES = [(3, name, "constant") for name in ROUTINES] + [(None, "gd", "constant"),
                                                        (None, "adam", "constant")]
CASES += [(3, "gd", "step"), (3, "adam", "cosine"), (3, "momentum", "inverse_sqrt"),
          (None, "nesterov", "step")]


@pytest.mark.parametrize("seed,routine,schedule", CASES,
                         ids=[f"{r}-{sc}-seed{s}" for s, r, sc in CASES])
def test_resumed_run_equals_an_uninterrupted_one(tmp_path, seed, routine, schedule):
    """For every routine: its state (momentum buffer, Adam's moments and count) is in the
    checkpoint; for every schedule: the resumed rounds step with their own η·s(r)."""
    lr = {"adam": 0.02, "adamw": 0.02}.get(routine, 0.2)
    steps = {"routine": ROUTINES[routine], "learning_rate": lr, "schedule": SCHEDULES[schedule]}
    # the uninterrupted reference (its own checkpoint file)
    ref_cfg = config(tmp_path / "ref", seed=seed, **steps)
    reference = drive(ref_cfg, build_server(ref_cfg, progress=None), ROUNDS)
    # the interrupted run: 3 rounds, "crash", restart the server from the checkpoint
    cfg = config(tmp_path / "run", seed=seed, **steps)
    first = drive(cfg, build_server(cfg, progress=None), 3)
    if seed is None:  # OS-entropy noise: the resumed part must reuse the checkpointed key
        saved = tmp_path / "copy.npz"
        shutil.copy(tmp_path / "run" / "state.npz", saved)
    second = build_server(cfg, progress=None)
    assert second.state.round == 3 and second.recorder.directory == first.recorder.directory
    # the same buffers, not fresh ones
    assert repr(second.state.routine_state) == repr(first.state.routine_state)
    drive(cfg, second, ROUNDS)
    assert [r["round"] for r in rows(second)] == list(range(ROUNDS + 1))  # each round recorded once
    assert len(second.ledger.events) == ROUNDS
    if seed is not None:
        np.testing.assert_array_equal(second.state.x, reference.state.x)
        assert second.epsilon_spent == reference.epsilon_spent
        assert strip(rows(second)) == strip(rows(reference))
    else:
        # replay rounds 4..7 from the copy: the same noise key gives the same trajectory
        shutil.copy(saved, tmp_path / "run" / "state.npz")
        third = drive(cfg, build_server(cfg, progress=None), ROUNDS)
        np.testing.assert_array_equal(third.state.x, second.state.x)


def test_a_round_lost_in_a_crash_is_recomputed_identically(tmp_path):
    """Released but not checkpointed: the restarted server recomputes the same release, counted
    once."""
    cfg = config(tmp_path)
    server = drive(cfg, build_server(cfg, progress=None), 2)
    saved = (tmp_path / "state.npz").read_bytes()
    drive(cfg, server, 3)
    released_round3 = server.state.x.copy()
    (tmp_path / "state.npz").write_bytes(saved)  # the crash lost round 3's checkpoint
    again = build_server(cfg, progress=None)
    assert again.state.round == 2 and [r["round"] for r in rows(again)] == [0, 1, 2]
    drive(cfg, again, 3)
    np.testing.assert_array_equal(again.state.x, released_round3)
    assert len(again.ledger.events) == 3 and [r["round"] for r in rows(again)] == [0, 1, 2, 3]


def test_a_finished_run_resumes_as_finished(tmp_path):
    cfg = config(tmp_path)
    drive(cfg, build_server(cfg, progress=None), ROUNDS)
    again = build_server(cfg, progress=None)
    assert again.done and again.state.round == ROUNDS


def test_corrupted_checkpoint_is_refused(tmp_path):
    cfg = config(tmp_path)
    drive(cfg, build_server(cfg, progress=None), 1)
    (tmp_path / "state.npz").write_bytes(b"\x00garbage")
    with pytest.raises(CheckpointError, match=r"state.npz is unreadable or corrupted"):
        build_server(cfg, progress=None)


def test_checkpoint_of_another_config_is_refused(tmp_path):
    cfg = config(tmp_path)
    drive(cfg, build_server(cfg, progress=None), 1)
    other = config(tmp_path, learning_rate=0.1)
    with pytest.raises(CheckpointError, match=r"written for another configuration"):
        build_server(other, progress=None)
    # the output folder and evaluation settings do not change the trajectory: still accepted
    same = parse_config({**cfg.to_dict(), "evaluation": {"every": 2}})
    assert build_server(same, progress=None).state.round == 1


def test_a_checkpoint_of_another_routine_is_refused_naming_both(tmp_path):
    cfg = config(tmp_path, routine={"name": "adam", "beta1": 0.8})
    drive(cfg, build_server(cfg, progress=None), 2)
    for other in ("gd", {"name": "adam", "beta1": 0.9}, "adamw"):
        with pytest.raises(CheckpointError,
                           match=r"another configuration .*Its routine is \{'name': 'adam', "
                                                  r"'learning_rate': 0.2, 'beta1': 0.8, "):
            build_server(config(tmp_path, routine=other), progress=None)


def test_a_checkpoint_of_another_schedule_is_refused(tmp_path):
    cfg = config(tmp_path, schedule={"name": "step", "decay": 0.5, "every": 2})
    drive(cfg, build_server(cfg, progress=None), 2)
    for other in ("constant", "cosine", {"name": "step", "decay": 0.5, "every": 3}):
        with pytest.raises(CheckpointError, match=r"written for another configuration"):
            build_server(config(tmp_path, schedule=other), progress=None)
    assert build_server(cfg, progress=None).state.round == 2


def test_a_format_2_checkpoint_is_still_read(tmp_path):
    """Format 2 (before routine state) had the same fields but no routine: it is GD's and resumes as
    before."""
    import io

    cfg = config(tmp_path)
    reference = drive(cfg, build_server(cfg, progress=None), ROUNDS).state.x.copy()
    for f in (tmp_path / "state.npz", *(tmp_path / "out").iterdir()):
        shutil.rmtree(f) if f.is_dir() else f.unlink()
    drive(cfg, build_server(cfg, progress=None), 3)
    path = tmp_path / "state.npz"
    with np.load(path) as data:
        arrays = {k: data[k] for k in data.files}
    meta = json.loads(str(arrays["meta"]))
    assert meta["format"] == "diff2-checkpoint/3" and meta["routine"] == {"name": "gd",
                                                                          "learning_rate": 0.2,
                                                                           "state": {},
                                                                           "arrays": []}
    meta["format"] = "diff2-checkpoint/2"
    del meta["routine"]
    buffer = io.BytesIO()
    np.savez(buffer, **{**arrays, "meta": np.array(json.dumps(meta))})
    path.write_bytes(buffer.getvalue())
    # a GD checkpoint cannot seed a routine with state: the config differs, and the routine is named
    with pytest.raises(CheckpointError,
                       match=r"another configuration .*Its routine is \{'name': 'gd'\}"):
        build_server(config(tmp_path, routine="momentum"), progress=None)
    resumed = build_server(cfg, progress=None)
    assert resumed.state.round == 3
    np.testing.assert_array_equal(drive(cfg, resumed, ROUNDS).state.x, reference)


def test_the_flower_strategy_continues_at_the_resumed_round(tmp_path):
    from flwr.common import parameters_to_ndarrays
    from test_strategy import make_manager

    from diff2_flwr.fl import protocol
    from diff2_flwr.fl.strategy import Diff2Strategy

    cfg = config(tmp_path)
    drive(cfg, build_server(cfg, progress=None), 2)
    strategy = Diff2Strategy(server=build_server(cfg, progress=None))
    manager, _ = make_manager(3)
    instructions = strategy.configure_fit(1, strategy.initialize_parameters(manager), manager)
    fit_ins = instructions[0][1]
    assert fit_ins.config[protocol.ROUND] == 3 and fit_ins.config[protocol.KIND] == "difference"
    assert len(parameters_to_ndarrays(fit_ins.parameters)) == 8  # x_2 and x_1


def test_the_checkpoint_is_durable_before_anything_of_the_round_is_written(tmp_path, monkeypatch):
    """When round r's metrics row or a summary is written, the checkpoint on disk already holds
    round r."""
    from diff2_flwr.runtime import outputs

    cfg = config(tmp_path)
    seen = []
    original_row, original_summary = outputs.RunRecorder.row, outputs.RunRecorder.summary

    def on_disk() -> int:
        with np.load(tmp_path / "state.npz") as data:
            return json.loads(str(data["meta"]))["round"]

    def row(self, values):
        seen.append(("row", values["round"], on_disk()))
        original_row(self, values)

    def summary(self, values):
        seen.append(("summary", values["rounds_released"], on_disk()))
        original_summary(self, values)

    monkeypatch.setattr(outputs.RunRecorder, "row", row)
    monkeypatch.setattr(outputs.RunRecorder, "summary", summary)
    drive(cfg, build_server(cfg, progress=None), ROUNDS)
    assert [r for kind, r, _ in seen if kind == "row"] == list(range(ROUNDS + 1))
    assert all(written == durable for _, written, durable in seen), seen


def test_a_crash_between_checkpoint_and_row_resumes_without_recomputing_the_round(tmp_path,
                                                                                  monkeypatch):
    """The server dies after round 4's checkpoint, before its row: the resumed run writes round 4's
    row once, equal to an uninterrupted run's, and goes on with round 5 (round 4 is not computed
    again)."""
    from diff2_flwr.runtime import outputs

    ref_cfg = config(tmp_path / "ref")
    reference = drive(ref_cfg, build_server(ref_cfg, progress=None), ROUNDS)

    class Crash(BaseException):
        pass

    cfg = config(tmp_path / "run")
    original_row = outputs.RunRecorder.row

    def dying_row(self, values):
        if values["round"] == 4:
            raise Crash()
        original_row(self, values)

    monkeypatch.setattr(outputs.RunRecorder, "row", dying_row)
    first = build_server(cfg, progress=None)
    with pytest.raises(Crash):
        drive(cfg, first, ROUNDS)
    monkeypatch.setattr(outputs.RunRecorder, "row", original_row)
    assert [r["round"] for r in rows(first)] == [0, 1, 2, 3]
    second = build_server(cfg, progress=None)
    assert second.state.round == 4  # round 4 was released and checkpointed: it is not replayed
    drive(cfg, second, ROUNDS)
    assert [r["round"] for r in rows(second)] == list(range(ROUNDS + 1))
    assert strip(rows(second)) == strip(rows(reference))
    np.testing.assert_array_equal(second.state.x, reference.state.x)
    assert len(second.ledger.events) == ROUNDS and second.epsilon_spent == reference.epsilon_spent


# --------------------------------------------------------------------------- the checkpoint is a
# secret

@pytest.fixture
def umask():
    """Set the process umask for one test (restored after)."""
    saved = os.umask(0o022)
    try:
        yield os.umask
    finally:
        os.umask(saved)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def secret_config(tmp_path, seed=None):
    """``config``, with the checkpoint in folders that do not exist yet (created for it)."""
    data = config(tmp_path, seed=seed).to_dict()
    data["output"] = {"dir": str(tmp_path / "out"),
                      "checkpoint": str(tmp_path / "private" / "state" / "ck.npz")}
    return parse_config(data)


@pytest.mark.parametrize("mask", [0o022, 0o002, 0o000, 0o277], ids=lambda m: f"umask-{m:03o}")
def test_the_checkpoint_and_its_folders_are_owner_only_whatever_the_umask(tmp_path, umask, mask):
    """The noise key is the noise: 0600 file, 0700 folders created for it, even under umask 000 (or
    277, which would strip the owner's own bits from a file created with the umask)."""
    umask(mask)
    cfg = secret_config(tmp_path)
    # neither folder exists: both are created for the checkpoint
    path = tmp_path / "private" / "state" / "ck.npz"
    server = drive(cfg, build_server(cfg, progress=None), 2)
    assert mode(path) == 0o600, f"{mode(path):o}"
    assert mode(path.parent) == 0o700 and mode(path.parent.parent) == 0o700
    assert not path.with_name("ck.npz.tmp").exists()
    assert server.state.round == 2 and not server.state.noise_seeded


def test_a_stale_temporary_file_is_replaced_not_reused(tmp_path, umask):
    cfg = secret_config(tmp_path)
    path = tmp_path / "private" / "state" / "ck.npz"
    server = drive(cfg, build_server(cfg, progress=None), 1)
    stale = path.with_name("ck.npz.tmp")
    stale.write_bytes(b"left by a crash")
    os.chmod(stale, 0o666)
    drive(cfg, server, 2)
    assert mode(path) == 0o600 and not stale.exists()


@pytest.mark.parametrize("wide", [0o644, 0o640, 0o604, 0o620], ids=lambda m: f"{m:04o}")
def test_resuming_from_a_checkpoint_others_may_read_or_write_is_refused_until_chmod_600(
    tmp_path, umask, wide):
    cfg = secret_config(tmp_path)
    path = tmp_path / "private" / "state" / "ck.npz"
    drive(cfg, build_server(cfg, progress=None), 2)
    os.chmod(path, wide)  # e.g. a checkpoint written before this fix, or copied with cp
    with pytest.raises(CheckpointError,
                       match=rf"ck.npz has mode {wide:04o}: group or others may read or write it.*"
                                              rf"noise key.*`chmod 600 {path}`"):
        build_server(cfg, progress=None)
    os.chmod(path, 0o600)
    assert build_server(cfg, progress=None).state.round == 2


def test_no_released_file_or_log_line_holds_the_noise_key(tmp_path, umask):
    """The OS-entropy key is only in the checkpoint; never in metrics, summary, curves, parameters,
    logs. (A seeded run's key is its seed: in the config, the run config and the summary by design,
    and warned about.)"""
    cfg = secret_config(tmp_path, seed=None)
    lines = []
    server = drive(cfg, build_server(cfg, progress=lines.append), ROUNDS)
    key = server.state.noise_key
    with np.load(tmp_path / "private" / "state" / "ck.npz") as data:
        # the file that must be a secret
        assert json.loads(str(data["meta"]))["noise_key"] == str(key)
    forms = {str(key), f"{key:x}", f"{key:X}", f"{key:#x}"}
    files = [p for p in server.recorder.directory.iterdir() if p.is_file()]
    assert {p.name for p in files} >= {"metrics.jsonl", "summary.json", "curves.png",
                                       "final_parameters.npy"}
    for p in files:
        content = p.read_bytes()
        assert not any(f.encode() in content for f in forms), p.name
    assert lines and not any(f in line for line in lines for f in forms)


def test_the_images_never_receive_outputs_or_checkpoints():
    """The Dockerfiles copy only the whitelisted build context, and .dockerignore keeps .npz/.npy
    files and output folders out of it even under diff2_flwr/ (a checkpoint there would otherwise
    ship its noise key in an image)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    lines = [x.strip() for x in (root / ".dockerignore").read_text().splitlines() if x.strip()
             and x[0] != "#"]
    allowed = [x[1:] for x in lines if x.startswith("!")]
    assert lines[0] == "*" and allowed == ["pyproject.toml", "README.md", "diff2_flwr/"]
    last_allow = max(i for i, x in enumerate(lines) if x.startswith("!"))
    # after the exceptions: they win
    assert {"**/*.npz", "**/*.npy", "**/outputs"} <= set(lines[last_allow + 1:])
    for dockerfile in ("server/Dockerfile", "clients/Dockerfile"):
        for line in (root / dockerfile).read_text().splitlines():
            if line.split()[:1] in (["COPY"], ["ADD"]):
                sources = [s for s in line.split()[1:-1] if not s.startswith("--")]
                assert all(s.rstrip("/") in ("pyproject.toml", "README.md",
                                             "diff2_flwr") for s in sources), line


def test_a_checkpoint_resumes_across_keys_that_do_not_change_the_run_and_refuses_one_that_does(
    tmp_path):
    """The fingerprint hashes what the declarations say identifies a run (spec.run_identity): the
    name, the evaluation, the output and Flower's timeouts may change across a resume; the learning
    rate may not."""
    cfg = config(tmp_path)
    reference = drive(cfg, build_server(cfg, progress=None), ROUNDS).state.x.copy()
    for f in (tmp_path / "state.npz", *(tmp_path / "out").iterdir()):
        shutil.rmtree(f) if f.is_dir() else f.unlink()
    drive(cfg, build_server(cfg, progress=None), 3)
    data = cfg.to_dict()
    data.update(name="renamed", evaluation={**data["evaluation"], "every": 2})
    data["training"].update(round_timeout_s=30.0, round_retries=2)
    changed = parse_config(data)
    with pytest.raises(CheckpointError, match="another configuration"):
        build_server(parse_config({**data, "training": {**data["training"], "learning_rate": 0.3}}),
                     progress=None)
    resumed = build_server(changed, progress=None)
    assert resumed.state.round == 3
    np.testing.assert_array_equal(drive(changed, resumed, ROUNDS).state.x, reference)


def test_a_checkpoint_written_by_the_earlier_fingerprint_rule_still_resumes(tmp_path):
    """A checkpoint without `fingerprint_rule` (written before it) is compared by the legacy rule:
    an interrupted run of an earlier version resumes; one of another configuration is still
    refused."""
    import hashlib
    import io

    from diff2_flwr.runtime.checkpoint import legacy_config_fingerprint

    cfg = config(tmp_path)
    reference = drive(cfg, build_server(cfg, progress=None), ROUNDS).state.x.copy()
    for f in (tmp_path / "state.npz", *(tmp_path / "out").iterdir()):
        shutil.rmtree(f) if f.is_dir() else f.unlink()
    first = drive(cfg, build_server(cfg, progress=None), 3)
    path = tmp_path / "state.npz"
    with np.load(path) as data:
        arrays = {k: data[k] for k in data.files}
    meta = json.loads(str(arrays["meta"]))
    assert meta.pop("fingerprint_rule") == "declared/1"
    fresh = parse_config({**cfg.to_dict(), "output": {"dir": str(tmp_path / "fresh"),
                                                      "checkpoint": None}})
    x0 = build_server(fresh, progress=None).state.x  # x_0: the state before round 0
    assert first.state.round == 3 and not np.array_equal(x0, first.state.x)
    x0_hash = hashlib.sha256(x0.tobytes()).hexdigest()
    from diff2_flwr.runtime.session import preflight

    # n_min: the fewest records of a shard
    legacy = legacy_config_fingerprint(cfg.to_dict(), preflight(cfg).n_min)
    meta["fingerprint"] = hashlib.sha256((legacy + x0_hash).encode()).hexdigest()
    assert meta["fingerprint"] != json.loads(str(arrays["meta"]))["fingerprint"]  # the rules differ
    buffer = io.BytesIO()
    np.savez(buffer, **{**arrays, "meta": np.array(json.dumps(meta))})
    path.write_bytes(buffer.getvalue())
    with pytest.raises(CheckpointError, match="another configuration"):
        build_server(config(tmp_path, clip_diff=2.0), progress=None)
    resumed = build_server(cfg, progress=None)
    assert resumed.state.round == 3
    np.testing.assert_array_equal(drive(cfg, resumed, ROUNDS).state.x, reference)
