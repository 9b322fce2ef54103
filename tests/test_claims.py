"""Claims on a shared study folder: exclusive, taken over only when stale (released, dead, silent),
and atomic result files. Each test drives :class:`ClaimBook` as several drivers would."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import threading

import pytest

from diff2_flwr.lab.study.claims import ClaimBook, Owner, atomic_write_bytes


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def other_host_owner() -> Owner:
    """An owner on another machine: its PID cannot be checked from here, only its heartbeat."""
    return dataclasses.replace(Owner.this_process(), host="elsewhere", boot="another-boot")


def finish(book: ClaimBook, run_id: str) -> None:
    (book.folder / f"{run_id}.json").write_text("{}")
    book.finish(run_id)


def test_a_claim_is_exclusive_and_a_finished_run_is_never_claimed(tmp_path):
    a, b = ClaimBook(tmp_path), ClaimBook(tmp_path)
    assert a.try_claim("r1") and a.held == ("r1",)
    assert not b.try_claim("r1")
    owner = b.held_by_other("r1")
    assert isinstance(owner, Owner) and owner.driver == a.owner.driver and owner.pid == os.getpid()
    finish(a, "r1")
    assert list(tmp_path.glob("r1.claim-*")) == [] and a.held == ()
    b.refresh()
    assert not b.try_claim("r1") and not a.try_claim("r1")


def test_a_run_finished_between_the_check_and_the_claim_is_let_go(tmp_path):
    """The re-check after the exclusive create: a driver whose listing predates the result computes
    nothing."""
    a, b = ClaimBook(tmp_path), ClaimBook(tmp_path)
    assert a.try_claim("r")
    b.refresh()  # b sees a's claim
    (tmp_path / "r.json").write_text("{}")
    a.finish("r")
    # b's first look predates the result (its listing even shows a's claim, now deleted, which reads
    # as stale): it creates the next generation, then the re-check finds the result and lets go
    looks = []

    def done(run_id: str) -> bool:
        looks.append(run_id)
        # the first look is before the result
        return len(looks) > 1 and (tmp_path / f"{run_id}.json").exists()

    b.done = done
    assert not b.try_claim("r")
    assert len(looks) == 2 and b.held == () and list(tmp_path.glob("r.claim-*")) == []


def test_the_claim_of_a_driver_killed_after_writing_its_result_is_swept(tmp_path):
    """A driver killed between writing a result and deleting its claim leaves a claim on a finished
    run: the next driver that finds the run finished deletes it (and no claim of an unfinished
    run)."""
    dead, alive = ClaimBook(tmp_path), ClaimBook(tmp_path)
    assert dead.try_claim("done") and dead.try_claim("open")
    (tmp_path / "done.json").write_text("{}")  # ... and the driver dies before finish("done")
    assert alive.sweep_finished(["done", "open", "other"]) == 1
    assert list(tmp_path.glob("done.claim-*")) == [] and len(list(tmp_path.glob(
        "open.claim-*"))) == 1


def test_racing_drivers_claim_each_run_exactly_once(tmp_path):
    """Eight drivers (threads with their own books) race for 40 runs: every run has exactly one
    winner."""
    books = [ClaimBook(tmp_path) for _ in range(8)]
    runs = [f"run-{i}" for i in range(40)]
    won: dict[int, list[str]] = {}
    barrier = threading.Barrier(len(books))

    def driver(i: int) -> None:
        barrier.wait()
        won[i] = books[i].claim(runs)

    threads = [threading.Thread(target=driver, args=(i,)) for i in range(len(books))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [r for i in won for r in won[i]]
    assert sorted(winners) == sorted(runs)


def test_a_released_claim_is_taken_over_at_once_by_the_next_generation(tmp_path):
    a, b = ClaimBook(tmp_path), ClaimBook(tmp_path)
    assert a.try_claim("r")
    a.release("r")
    assert (tmp_path / "r.claim-1.released").exists()
    b.refresh()
    assert b.held_by_other("r") is False
    assert b.try_claim("r") and (tmp_path / "r.claim-2").exists()
    assert json.loads((tmp_path / "r.claim-2").read_text())["driver"] == b.owner.driver
    c = ClaimBook(tmp_path)
    assert not c.try_claim("r")  # generation 2 is live


def test_a_claim_of_a_dead_process_on_this_machine_is_taken_over_at_once(tmp_path):
    proc = subprocess.Popen(["true"])  # a process that has ended: its PID names no process now
    proc.wait()
    dead = dataclasses.replace(Owner.this_process(), pid=proc.pid)
    assert dead.process_gone()
    ClaimBook(tmp_path, owner=dead).try_claim("r")
    live = ClaimBook(tmp_path, stale_after_s=1e9)
    assert live.held_by_other("r") is False and live.try_claim("r")
    # a PID reused by a process that started at another time is a dead owner too
    reused = dataclasses.replace(Owner.this_process(), pid_start="1")
    assert reused.process_gone() and not Owner.this_process().process_gone()


def test_another_machines_claim_is_taken_over_only_after_its_heartbeat_stops(tmp_path):
    clock = Clock()
    remote = ClaimBook(tmp_path, owner=other_host_owner())
    assert remote.try_claim("r")
    local = ClaimBook(tmp_path, stale_after_s=60, clock=clock)
    assert not local.try_claim("r")  # first sighting
    clock.now += 59
    assert not local.try_claim("r")
    # a heartbeat (the remote driver's utime) moves the modification time
    path = tmp_path / "r.claim-1"
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 1_000_000))
    clock.now += 30
    assert not local.try_claim("r")
    clock.now += 59
    assert not local.try_claim("r")
    clock.now += 1  # 60 s of silence
    assert local.try_claim("r") and (tmp_path / "r.claim-2").exists()


def test_two_drivers_judging_the_same_claim_stale_cannot_both_take_it(tmp_path):
    clock = Clock()
    ClaimBook(tmp_path, owner=other_host_owner()).try_claim("r")
    b, c = ClaimBook(tmp_path, stale_after_s=10, clock=clock), ClaimBook(tmp_path, stale_after_s=10,
                                                                         clock=clock)
    assert not b.try_claim("r") and not c.try_claim("r")
    clock.now += 10
    b.refresh(), c.refresh()  # both see generation 1, silent for 10 s
    assert [b.try_claim("r"), c.try_claim("r")] == [True, False]


def test_the_heartbeat_thread_touches_held_claims_and_exit_releases_them(tmp_path):
    with ClaimBook(tmp_path, heartbeat_s=0.05) as book:
        assert book.try_claim("r")
        path = tmp_path / "r.claim-1"
        before = path.stat().st_mtime_ns
        os.utime(path, ns=(0, 0))
        deadline = 200
        while path.stat().st_mtime_ns == 0 and deadline:
            threading.Event().wait(0.02)
            deadline -= 1
        assert path.stat().st_mtime_ns >= before
    assert (tmp_path / "r.claim-1.released").exists() and book.held == ()


def test_live_foreign_claims_block_fresh_and_dead_ones_do_not(tmp_path):
    me = ClaimBook(tmp_path)
    proc = subprocess.Popen(["true"])
    proc.wait()
    ClaimBook(tmp_path, owner=dataclasses.replace(Owner.this_process(),
                                                  pid=proc.pid)).try_claim("dead")
    assert me.live_foreign_claims() == []
    ClaimBook(tmp_path, owner=other_host_owner()).try_claim("remote")
    live = me.live_foreign_claims()
    assert [p.name for p, _ in live] == ["remote.claim-1"] and live[0][1].host == "elsewhere"


def test_atomic_writes_of_one_path_by_two_writers_never_tear(tmp_path):
    """Two writers replace one file 200 times each while a reader checks that it is always one
    payload whole."""
    path = tmp_path / "run.json"
    payloads = [b"a" * 300_000, b"b" * 200_000]
    atomic_write_bytes(path, payloads[0])
    stop = threading.Event()
    seen: set[bytes] = set()

    errors: list[BaseException] = []

    def writer(payload: bytes) -> None:
        try:
            for _ in range(200):
                atomic_write_bytes(path, payload)
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    def reader() -> None:
        while not stop.is_set():
            data = path.read_bytes()
            seen.add(data[:1] + str(len(data)).encode() + (b"" if data in payloads else b" torn"))

    writers = [threading.Thread(target=writer, args=(p,)) for p in payloads]
    r = threading.Thread(target=reader)
    r.start()
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    stop.set()
    r.join()
    assert errors == [] and path.read_bytes() in payloads and seen <= {b"a300000", b"b200000"}
    # no temporary file left behind
    assert not [p for p in tmp_path.iterdir() if p.name != "run.json"]


@pytest.mark.parametrize("bad", [0, -1.0])
def test_stale_after_must_be_positive(tmp_path, bad):
    with pytest.raises(ValueError, match=r"`stale_after_s` must be > 0. Found"):
        ClaimBook(tmp_path, stale_after_s=bad)
