"""The node's lifetime ledger: refusal before writing, idempotent admission, crash safety (SIGKILL
at the worst moments, in a child process), no lost update under 4 concurrent processes, file modes,
corrupt files, the CLI.

Every run here is 100 Gaussian rounds of multiplier 20 (μ = 0.5), so k runs are exactly μ = 0.5
√k-GDP: the expected ε comes from the closed form (gdp_epsilon), not from the code under test. The
budget 3.3 admits two runs (ε 2.943) and not three (ε 3.709).

Client-sampled runs (issue 44) are charged their amplified rounds: the ledger's ε is checked against
the PLD built here from dp-accounting's own functions (the Gaussian's PLD mixed with no loss by π,
self-composed, composed), against the run's own ledger and calibration, and a version-1 ledger (from
before sampled runs were charged) is still read.
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
from dp_accounting.pld import privacy_loss_distribution as plds

from diff2_flwr.cli import main
from diff2_flwr.core.estimator import is_restart
from diff2_flwr.core.privacy import PrivacyLedger, RunEvents, calibrate, gdp_epsilon
from diff2_flwr.core.sampling import Sampling
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
    "a later version": (json.dumps({**GOOD, "version": 3}).encode(),
                        "found version 3, keys ['charges', 'format', 'last_admission', 'version'] "
                        "(version 3 is a newer diff2's: upgrade this node's diff2)"),
    "a version 2 charge without sampled rounds": (json.dumps({**GOOD, "version": 2, "charges": [{
        "run_id": "r1", "digest": "d", "node": "n", "time": "t", "epsilon": 1.0,
        "events": {"delta": 1e-5, "gaussian": [[2.0, 3]], "local": []}}]}).encode(),
        "charge 0: `events` must be an object with keys delta, gaussian, local, sampled (version "
        "2)"),
    "a version 1 charge with sampled rounds": (json.dumps({**GOOD, "charges": [{
        "run_id": "r1", "digest": "d", "node": "n", "time": "t", "epsilon": 1.0,
        "events": {"delta": 1e-5, "gaussian": [], "local": [], "sampled": [[2.0, 0.5, 3]]}}]
    }).encode(), "keys delta, gaussian, local (version 1)"),
    "a sampled round of probability 0": (json.dumps({**GOOD, "version": 2, "charges": [{
        "run_id": "r1", "digest": "d", "node": "n", "time": "t", "epsilon": 1.0,
        "events": {"delta": 1e-5, "gaussian": [], "local": [], "sampled": [[2.0, 0.0, 3]]}}]
    }).encode(), "inclusion probability `π` must be in (0, 1]. Found 0.0"),
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
    assert data["format"] == "diff2-node-ledger" and data["version"] == 2
    assert data["last_admission"] == {"budget_epsilon": BUDGET, "budget_delta": DELTA,
                                      "spent": admitted.spent_after}
    assert data["charges"] == [{"run_id": "r1", "digest": "sha256:a", "node": "alice",
                                "time": admitted.charge.time,
                                "epsilon": admitted.charge.epsilon,
                                "events": {"delta": DELTA, "gaussian": [[20.0, 100]], "local": [],
                                           "sampled": []}}]
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


# ------------------------------------------------------------------ client-sampled runs (issue 44)

def _sampled_calibration(epsilon: float = 3.0, rate: float = 0.3):
    """DIFF2, 100 rounds (10 restarts), P = 10 clients, Poisson sampling at ``rate``."""
    return calibrate(epsilon=epsilon, delta=DELTA, rounds=100, restart_every=10, u=1.25,
                     n_min=1651, clients=10, sampling=Sampling("poisson", rate=rate))


def _direct_pld_epsilon(runs: list[RunEvents], delta: float) -> float:
    """ε of the runs' events composed by dp-accounting's PLD, built here from its own functions: a
    sampled round (z, π) is ``from_gaussian_mechanism(z)`` mixed with ``identity()`` by π (the
    SampledGaussianEvent's pair), self-composed by its count; all full-batch rounds together are one
    Gaussian of μ² = Σ count / z² (Dong, Roth & Su 2019, Cor. 3.3). Composed in the opposite order
    to the ledger's (composition commutes)."""
    interval, pld = 1e-4, None
    for run in runs[::-1]:
        for z, pi, count in run.sampled[::-1]:
            one = plds.from_gaussian_mechanism(standard_deviation=z, sensitivity=1.0,
                                               value_discretization_interval=interval)
            one = one.compute_mixture(plds.identity(interval), pi).self_compose(count)
            pld = one if pld is None else pld.compose(one)
    mu_squared = sum(count / z**2 for run in runs for z, count in run.gaussian)
    if mu_squared:
        gauss = plds.from_gaussian_mechanism(
            standard_deviation=1 / math.sqrt(mu_squared), sensitivity=1.0,
            value_discretization_interval=interval)
        pld = gauss if pld is None else pld.compose(gauss)
    return float(pld.get_epsilon_for_delta(delta))


def test_a_sampled_run_is_charged_its_amplified_epsilon_alone_and_with_an_unsampled_one(ledger):
    """The ledger's ε after a sampled run equals dp-accounting's PLD of the same events, the run's
    own ledger's ε (its whole schedule recorded round by round) and its calibration's planned ε, to
    1e-6; after an unsampled run too, it equals dp-accounting's PLD of both runs' events."""
    cal = _sampled_calibration()
    sampled = RunEvents.from_calibration(cal)
    own = PrivacyLedger(DELTA)
    for r in range(1, cal.rounds + 1):
        own = own.record(*cal.round_events(is_restart(r, cal.restart_every)))
    first = ledger.admit(_charge("sampled", events=sampled), budget_epsilon=10.0,
                         budget_delta=DELTA)
    alone = ledger.spent(DELTA)
    assert first.spent_after == alone == first.charge.epsilon
    assert alone == pytest.approx(_direct_pld_epsilon([sampled], DELTA), abs=1e-6)
    assert alone == pytest.approx(own.epsilon, abs=1e-6)
    assert alone == pytest.approx(cal.planned_epsilon, abs=1e-6)
    assert 2.9 < alone <= cal.epsilon  # calibrated to ε (1 - SAMPLING_MARGIN)
    second = ledger.admit(_charge("full", events=EVENTS), budget_epsilon=10.0, budget_delta=DELTA)
    both = NodeLedger(ledger.path).spent(DELTA)  # read back from the file
    assert second.spent_after == both
    assert both == pytest.approx(_direct_pld_epsilon([sampled, EVENTS], DELTA), abs=1e-6)
    # composed, not added: less than the sum of the two, more than either
    assert max(alone, _exact(1)) < both < alone + _exact(1)
    # and at another δ, from the file
    assert NodeLedger(ledger.path).spent(1e-7) == pytest.approx(
        _direct_pld_epsilon([sampled, EVENTS], 1e-7), abs=1e-6)


def test_a_sampled_charge_round_trips_through_the_file(ledger):
    cal = _sampled_calibration()
    events = RunEvents.from_calibration(cal)
    admitted = ledger.admit(_charge("r1", events=events), budget_epsilon=10.0, budget_delta=DELTA)
    data = json.loads(ledger.path.read_text())
    assert data["version"] == 2
    assert data["charges"][0]["events"] == {
        "delta": DELTA, "gaussian": [], "local": [],
        "sampled": [[cal.z1, 0.3, 10], [cal.z2, 0.3, 90]]}
    assert NodeLedger(ledger.path).charges() == (admitted.charge,)


def test_a_sampled_run_past_the_budget_is_refused_and_says_it_was_amplified(ledger):
    _admit(ledger, "r1"), _admit(ledger, "r2")  # ε 2.943 of 3.3
    before = ledger.path.read_bytes()
    events = RunEvents.from_calibration(_sampled_calibration(epsilon=2.0))
    with pytest.raises(BudgetExceeded,
                       match=r"refuses run 'r3' \(rule: lifetime budget\).*this run alone costs "
                             r"ε = 1\.9\d+ \(at its δ = 1e-05, its client-sampled rounds "
                             r"amplified by π = 0\.3\), together ε = 3\.\d+ > the lifetime "
                             r"budget ε_L = 3\.3"):
        ledger.admit(_charge("r3", events=events), budget_epsilon=BUDGET, budget_delta=DELTA)
    assert ledger.path.read_bytes() == before


def test_a_version_1_ledger_is_read_and_written_back_as_version_2(ledger):
    """A node upgraded with its ledger: the file written before sampled runs were charged keeps
    its charges (and the node its spent ε); the next admission writes version 2."""
    v1_charge = {"run_id": "old", "digest": "sha256:a", "node": "alice",
                 "time": "2026-01-01T00:00:00Z", "epsilon": _exact(1),
                 "events": {"delta": DELTA, "gaussian": [[20.0, 100]], "local": []}}
    ledger.path.parent.mkdir()
    ledger.path.write_text(json.dumps({**GOOD, "charges": [v1_charge], "last_admission": {
        "budget_epsilon": 10.0, "budget_delta": DELTA, "spent": _exact(1)}}))
    assert [c.events for c in ledger.charges()] == [EVENTS]
    assert ledger.spent(DELTA) == pytest.approx(_exact(1), rel=1e-3)
    sampled = RunEvents.from_calibration(_sampled_calibration(epsilon=1.0))
    after = ledger.admit(_charge("new", events=sampled), budget_epsilon=10.0, budget_delta=DELTA)
    assert after.spent_before == pytest.approx(_exact(1), rel=1e-3)
    data = json.loads(ledger.path.read_text())
    assert data["version"] == 2 and data["charges"][0] == {
        **v1_charge, "events": {**v1_charge["events"], "sampled": []}}
    assert after.spent_after == pytest.approx(_direct_pld_epsilon([EVENTS, sampled], DELTA),
                                              abs=1e-6)
