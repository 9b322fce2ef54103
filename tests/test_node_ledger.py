"""The node's lifetime ledger: refusal before writing, idempotent admission, crash safety (SIGKILL
at the worst moments, in a child process), no lost update under 4 concurrent processes, file modes,
corrupt files, the CLI.

Every run here is 100 Gaussian rounds of multiplier 20 (μ = 0.5), so k runs are exactly μ = 0.5
√k-GDP: the expected ε comes from the closed form (gdp_epsilon), not from the code under test. The
budget 3.3 admits two runs (ε 2.943) and not three (ε 3.709).
"""

from __future__ import annotations

import json
import math
import os
import stat
import subprocess
import sys
import textwrap
from datetime import datetime, timezone
from pathlib import Path

import pytest

from diff2_flwr.cli import main
from diff2_flwr.core.privacy import RunEvents, gdp_epsilon
from diff2_flwr.runtime.node_ledger import (
    BudgetExceeded,
    Charge,
    LedgerError,
    NodeLedger,
    RunChanged,
    config_digest,
)

DELTA = 1e-5
EVENTS = RunEvents(delta=DELTA, gaussian=((20.0, 100),))
BUDGET = 3.3
REPO = Path(__file__).resolve().parents[1]

#: What every child process runs first: a charge like the parent's, and the budget.
CHILD_PRELUDE = """
import json, os, signal, sys, time
from diff2_flwr.core.privacy import RunEvents
from diff2_flwr.runtime import node_ledger as nl
ledger = nl.NodeLedger(sys.argv[1])
charge = nl.Charge.new(run_id=sys.argv[2], digest="sha256:a", node="alice",
                       events=RunEvents(delta=1e-5, gaussian=((20.0, 100),)))
"""


def _exact(runs: int, delta: float = DELTA) -> float:
    return gdp_epsilon(0.5 * math.sqrt(runs), delta)


def _charge(run_id: str, digest: str = "sha256:a", events: RunEvents = EVENTS) -> Charge:
    return Charge.new(run_id=run_id, digest=digest, node="alice", events=events)


def _admit(ledger: NodeLedger, run_id: str, digest: str = "sha256:a"):
    return ledger.admit(_charge(run_id, digest), budget_epsilon=BUDGET, budget_delta=DELTA)


def _child(script: str, *args: str) -> subprocess.CompletedProcess:
    code = CHILD_PRELUDE + textwrap.dedent(script)
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          cwd=REPO, timeout=120)


def _spent_in_a_new_process(path: Path) -> float:
    out = _child("print(repr(ledger.spent(1e-5)))", str(path), "unused")
    assert out.returncode == 0, out.stderr
    return float(out.stdout)


@pytest.fixture
def ledger(tmp_path) -> NodeLedger:
    return NodeLedger(tmp_path / "node" / "ledger.json")


def test_admission_charges_and_a_restart_sees_the_same_spent_epsilon(ledger):
    first, second = _admit(ledger, "r1"), _admit(ledger, "r2")
    assert first.new and second.new
    assert first.spent_before == 0.0 and first.spent_after == pytest.approx(_exact(1), rel=1e-3)
    assert second.spent_before == first.spent_after
    assert second.spent_after == pytest.approx(_exact(2), rel=1e-3)
    assert second.charge.epsilon == pytest.approx(_exact(1), rel=1e-3)
    restarted = NodeLedger(ledger.path)
    assert restarted.charges() == (first.charge, second.charge)
    assert restarted.spent(DELTA) == second.spent_after == _spent_in_a_new_process(ledger.path)
    assert restarted.spent(1e-7) == pytest.approx(_exact(2, 1e-7), rel=1e-3)


def test_a_run_over_the_budget_is_refused_before_anything_is_written(ledger):
    _admit(ledger, "r1"), _admit(ledger, "r2")
    before = ledger.path.read_bytes()
    with pytest.raises(BudgetExceeded) as refused:
        _admit(ledger, "r3")
    message = str(refused.value)
    for part in ("Node 'alice' refuses run 'r3'", "rule: lifetime budget",
                 f"ε = {_exact(2):.6g} over 2 run(s)",
                 f"alone costs ε = {_exact(1):.6g}", f"together ε = {_exact(3):.6g}",
                 f"ε_L = {BUDGET:g}", str(ledger.path), "Nothing was charged", "smaller ε"):
        assert part in message, (part, message)
    assert isinstance(refused.value, ValueError)
    assert ledger.path.read_bytes() == before
    assert sorted(p.name for p in ledger.path.parent.iterdir()) == ["ledger.json",
                                                                    "ledger.json.lock"]


def test_a_first_run_over_the_budget_leaves_no_ledger(ledger):
    big = RunEvents(delta=DELTA, gaussian=((1.0, 100),))
    with pytest.raises(BudgetExceeded, match="over 0 run"):
        ledger.admit(_charge("r1", events=big), budget_epsilon=BUDGET, budget_delta=DELTA)
    assert not ledger.path.exists() and ledger.charges() == ()


def test_a_noise_free_run_is_refused_whatever_the_budget(ledger):
    noise_free = RunEvents(delta=DELTA, gaussian=((20.0, 100), (0.0, 1)))
    with pytest.raises(BudgetExceeded,
                       match="alone costs ε = inf .* together ε = inf > the lifetime budget ε_L = "
                             "1e"):
        ledger.admit(_charge("r1", events=noise_free), budget_epsilon=1e9, budget_delta=DELTA)
    assert not ledger.path.exists()


def test_every_message_of_a_run_is_admitted_on_its_one_charge(ledger, monkeypatch):
    """A deployment starts a ClientApp process per message: each admits again, without a second
    charge, even when the ledger is full (the run was charged for its whole schedule at its first
    message), and without paying a PLD composition (ε spent is the number the admission stored)."""
    _admit(ledger, "r1")
    full = _admit(ledger, "r2")
    before = ledger.path.read_bytes()
    for where in ("diff2_flwr.runtime.node_ledger", "diff2_flwr.core.privacy"):
        monkeypatch.setattr(f"{where}.composed_epsilon", lambda *a: pytest.fail("composed"))
    again = _admit(ledger, "r2")
    assert not again.new and again.charge == full.charge
    assert again.spent_before == again.spent_after == full.spent_after
    assert ledger.path.read_bytes() == before
    assert [c.run_id for c in ledger.charges()] == ["r1", "r2"]


def test_a_run_whose_config_changed_is_refused(ledger):
    _admit(ledger, "r1")
    before = ledger.path.read_bytes()
    with pytest.raises(RunChanged,
                       match=r"refuses run 'r1'.*config digest sha256:a, and now comes with "
                             r"sha256:b"):
        _admit(ledger, "r1", digest="sha256:b")
    assert ledger.path.read_bytes() == before


# How the child dies while admitting r2 (r1 already charged): os-level hooks in the child process
# only.
CRASHES = {
    # half of the temporary file on disk, then killed before its fsync returns
    "torn-temp-file": """
        def fsync(fd):
            os.ftruncate(fd, os.fstat(fd).st_size // 2)
            os.kill(os.getpid(), signal.SIGKILL)
        os.fsync = fsync
    """,
    # the temporary file complete and fsynced, killed before the rename
    "before-rename": """
        os.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL)
    """,
    # renamed, killed before the folder's fsync
    "after-rename": """
        real_replace = os.replace
        def replace(*a):
            real_replace(*a)
            os.kill(os.getpid(), signal.SIGKILL)
        os.replace = replace
    """,
}


@pytest.mark.parametrize("moment", CRASHES)
def test_a_node_killed_while_charging_leaves_a_whole_ledger(ledger, moment):
    _admit(ledger, "r1")
    out = _child(textwrap.dedent(CRASHES[
        moment]) + "ledger.admit(charge, budget_epsilon=3.3, budget_delta=1e-5)\n",
                 str(ledger.path), "r2")
    assert out.returncode == -9, (out.returncode, out.stderr)
    runs = [c.run_id for c in NodeLedger(ledger.path).charges()]
    assert runs == (["r1", "r2"] if moment == "after-rename" else ["r1"])
    assert _spent_in_a_new_process(ledger.path) == pytest.approx(_exact(len(runs)), rel=1e-3)
    # the node carries on: the next admission (the run retried, or another) works and sweeps the
    # dead temp file
    assert _admit(ledger, "r2").new == (moment != "after-rename")
    assert [c.run_id for c in ledger.charges()] == ["r1", "r2"]
    assert sorted(p.name for p in ledger.path.parent.iterdir()) == ["ledger.json",
                                                                    "ledger.json.lock"]


def test_concurrent_admissions_lose_no_update(ledger, tmp_path):
    """Four processes admit four runs at the same instant (a barrier of files once their imports are
    done); reading is slowed by 1 s so that their read-check-write windows overlap. The budget fits
    two runs: exactly two are admitted, and the ledger holds exactly those (without the lock all
    four pass, or writers collide)."""
    script = f"""
        real_read = nl.NodeLedger._read
        def slow_read(self):
            state = real_read(self)
            time.sleep(1.0)
            return state
        nl.NodeLedger._read = slow_read
        open(os.path.join({str(tmp_path)!r}, "ready-" + sys.argv[2]), "w").close()
        while len([f for f in os.listdir({str(tmp_path)!r}) if f.startswith("ready-")]) < 4:
            time.sleep(0.001)
        began = time.time()
        try:
            ledger.admit(charge, budget_epsilon=3.3, budget_delta=1e-5)
            print("admitted", began)
        except nl.BudgetExceeded:
            print("refused", began)
    """
    code = CHILD_PRELUDE + textwrap.dedent(script)
    procs = [subprocess.Popen([sys.executable, "-c", code, str(ledger.path), f"r{i}"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=REPO) for i in range(4)]
    results = {f"r{i}": p.communicate(timeout=120) for i, p in enumerate(procs)}
    assert all(p.returncode == 0 for p in procs), [err for _, err in results.values()]
    outcome = {run: out.split() for run, (out, _) in results.items()}
    began = [float(words[1]) for words in outcome.values()]
    assert max(began) - min(began) < 0.8, began  # their windows overlapped
    admitted = sorted(run for run, words in outcome.items() if words[0] == "admitted")
    refused = sorted(run for run, words in outcome.items() if words[0] == "refused")
    assert len(admitted) == 2 and len(refused) == 2
    assert sorted(c.run_id for c in ledger.charges()) == admitted
    assert ledger.spent(DELTA) == pytest.approx(_exact(2), rel=1e-3)


@pytest.mark.parametrize("umask", [0o022, 0o000])
def test_files_are_owner_only_whatever_the_umask(tmp_path, umask):
    ledger = NodeLedger(tmp_path / "var" / "diff2" / "ledger.json")
    old = os.umask(umask)
    try:
        _admit(ledger, "r1")
    finally:
        os.umask(old)
    mode = lambda p: stat.S_IMODE(p.stat().st_mode)  # noqa: E731
    assert mode(ledger.path) == 0o600 and mode(ledger.lock_path) == 0o600
    assert mode(tmp_path / "var") == 0o700 and mode(tmp_path / "var" / "diff2") == 0o700


def test_a_failed_write_is_an_error_and_leaves_the_old_ledger(ledger, monkeypatch):
    _admit(ledger, "r1")
    before = ledger.path.read_bytes()

    def full_disk(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(LedgerError,
                       match=r"could not be written \(\[Errno 28\] No space left on device\); "
                             r"nothing was charged and the old ledger stands"):
        _admit(ledger, "r2")
    assert ledger.path.read_bytes() == before
    assert sorted(p.name for p in ledger.path.parent.iterdir()) == ["ledger.json",
                                                                    "ledger.json.lock"]


def test_a_ledger_whose_folder_cannot_be_made_is_an_error(tmp_path):
    (tmp_path / "file").write_text("")
    ledger = NodeLedger(tmp_path / "file" / "ledger.json")
    with pytest.raises(LedgerError,
                       match="cannot create its folder or its lock file .*nothing was charged"):
        _admit(ledger, "r1")


GOOD = {"format": "diff2-node-ledger", "version": 1, "charges": [],
        "last_admission": {"budget_epsilon": 3.3, "budget_delta": 1e-5, "spent": 0.0}}
CORRUPT = {
    "empty": (b"", "Expecting value"),
    "truncated JSON": (b'{"format": "diff2-node-ledger", "vers', "Unterminated string"),
    "not UTF-8": (b"\xff\xfe\x00", "cannot be read"),
    "another file": (b'{"name": "x"}', 'expected a JSON object with "format"'),
    "a later version": (json.dumps({**GOOD, "version": 2}).encode(), "found version 2"),
    "a bad charge": (json.dumps({**GOOD, "charges": [{"run_id": "r1"}]}).encode(),
                     "charge 0: expected an object"),
    "a negative multiplier": (json.dumps({**GOOD, "charges": [{
        "run_id": "r1", "digest": "d", "node": "n", "time": "t", "epsilon": 1.0,
        "events": {"delta": 1e-5, "gaussian": [[-2.0, 3]], "local": []}}]}).encode(), "Found -2.0"),
    "a bad last admission": (json.dumps({**GOOD,
                                         "last_admission": {"budget_epsilon": 3.3}}).encode(),
                             "`last_admission` must be null or an object of numbers"),
    "a list of charges that is not one": (json.dumps({**GOOD, "charges": {}}).encode(),
                                          "`charges` must be a list"),
}


@pytest.mark.parametrize("name", CORRUPT)
def test_a_corrupt_ledger_is_an_error_never_an_empty_ledger(ledger, name):
    content, found = CORRUPT[name]
    ledger.path.parent.mkdir()
    ledger.path.write_bytes(content)
    for call in (ledger.charges, lambda: _admit(ledger, "r9")):
        with pytest.raises(LedgerError) as err:
            call()
        assert str(ledger.path) in str(err.value) and found in str(err.value)
        assert "restore the file from a backup" in str(err.value) and "\n" not in str(err.value)
    assert ledger.path.read_bytes() == content


def test_the_written_file_is_the_documented_format(ledger):
    admitted = _admit(ledger, "r1")
    data = json.loads(ledger.path.read_text())
    assert data["format"] == "diff2-node-ledger" and data["version"] == 1
    assert data["last_admission"] == {"budget_epsilon": BUDGET, "budget_delta": DELTA,
                                      "spent": admitted.spent_after}
    assert data["charges"] == [{"run_id": "r1", "digest": "sha256:a", "node": "alice",
                                "time": admitted.charge.time,
                                "epsilon": admitted.charge.epsilon,
                                "events": {"delta": DELTA, "gaussian": [[20.0, 100]], "local": []}}]
    stamped = datetime.fromisoformat(admitted.charge.time.replace("Z", "+00:00"))
    assert admitted.charge.time.endswith("Z") and abs(stamped - datetime.now(
        timezone.utc)).total_seconds() < 60
    assert _charge("r2").epsilon is None and _charge("r2").time is None  # priced when charged


@pytest.mark.parametrize("kwargs, match", [
    (dict(budget_epsilon=math.inf, budget_delta=1e-5),
     r"`budget_epsilon` .* finite number > 0. Found inf"),
    (dict(budget_epsilon=0.0, budget_delta=1e-5),
     r"`budget_epsilon` .* finite number > 0. Found 0.0"),
    (dict(budget_epsilon=3.0, budget_delta=0.0), r"`budget_delta` .* in \(0, 1\). Found 0.0"),
])
def test_an_invalid_budget_is_refused(ledger, kwargs, match):
    with pytest.raises(ValueError, match=match):
        ledger.admit(_charge("r1"), **kwargs)
    assert not ledger.path.parent.exists()


def test_a_charge_needs_its_names_and_the_digest_is_canonical():
    with pytest.raises(ValueError, match="`run_id` must be a non-empty string. Found ''"):
        Charge.new(run_id="", digest="d", node="n", events=EVENTS)
    assert config_digest({"a": 1, "b": [1, 2]}) == config_digest({"b": [1, 2], "a": 1})
    assert config_digest({"a": 1}) != config_digest({"a": 2})
    assert config_digest({"a": 1}).startswith("sha256:") and len(config_digest({})) == 7 + 64


def test_cli_prints_the_ledger_as_one_json_object(ledger, capsys):
    _admit(ledger, "r1"), _admit(ledger, "r2")
    assert main(["ledger", str(ledger.path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ledger"] == str(ledger.path) and out["delta"] == DELTA and out["runs"] == 2
    assert [c["run_id"] for c in out["charges"]] == ["r1", "r2"]
    assert out["charges"][0]["epsilon"] == pytest.approx(_exact(1), rel=1e-3)
    assert out["epsilon_spent"] == pytest.approx(_exact(2), rel=1e-3)
    assert main(["ledger", str(ledger.path), "--delta", "1e-7"]) == 0
    assert json.loads(capsys.readouterr().out)["epsilon_spent"] == pytest.approx(_exact(2, 1e-7),
                                                                                 rel=1e-3)


def test_cli_a_missing_or_corrupt_ledger_is_one_line_on_stderr_and_exit_2(ledger, capsys):
    assert main(["ledger", str(ledger.path)]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1
    assert out.err.startswith(f"diff2 ledger: error: No node ledger at {ledger.path}")
    ledger.path.parent.mkdir()
    ledger.path.write_text("{")
    assert main(["ledger", str(ledger.path)]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1 and str(ledger.path) in out.err


def test_cli_through_the_installed_command(ledger):
    _admit(ledger, "r1")
    diff2 = Path(sys.executable).with_name("diff2")
    out = subprocess.run([str(diff2), "ledger", str(ledger.path)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["charges"][0]["run_id"] == "r1"
