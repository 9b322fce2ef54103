"""Thread pinning: the condition of every bit-for-bit claim
(docs/explanation/reproducibility.md)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import yaml

from diff2_flwr.runtime.compute import compute_threads, pin_threads, pinned_threads
from diff2_flwr.runtime.config import ConfigError, parse_config
from diff2_flwr.runtime.driver import run_inprocess


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=None)


def test_pinned_threads_pins_every_pool_and_restores_the_callers(restore_threads):
    torch.set_num_threads(2)
    with pinned_threads(1):
        inside = compute_threads()
    assert inside["torch"] == 1
    assert all(n == 1 for n in inside.values()), inside
    # numpy's OpenBLAS (or MKL) is seen and pinned
    assert any(k.startswith("blas") for k in inside), inside
    assert torch.get_num_threads() == 2


def test_pin_threads_refuses_zero():
    with pytest.raises(ValueError, match=r"`threads` must be an integer >= 1. Found 0."):
        pin_threads(0)


def test_training_threads_is_validated():
    with pytest.raises(ConfigError, match=r"training.threads.*an integer >= 1.*Found 0"):
        parse_config({"training": {"restart_every": 2, "threads": 0}}, "t.yaml")


def _config(**training):
    return parse_config({"name": "pin", "dataset": {"name": "synthetic", "num_samples": 12000},
                         "training": {"rounds": 4, "restart_every": 2, "clip_diff": 3.0,
                                      "learning_rate": 0.2,
                                      "clients": 2, "seed": 3, **training}}, "pin.yaml")


def test_the_in_process_driver_does_not_depend_on_the_callers_thread_count(restore_threads):
    """The evaluation reduces over 9,600 samples: split over 2 threads it would add in another
    order."""
    torch.set_num_threads(2)
    a = run_inprocess(_config(), record=False, progress=None)
    torch.set_num_threads(1)
    b = run_inprocess(_config(), record=False, progress=None)
    strip = lambda rows: [{k: v for k,
                           v in r.items() if k != "elapsed_s"} for r in rows]  # noqa: E731
    np.testing.assert_array_equal(a.state.x, b.state.x)
    assert strip(a.history) == strip(b.history)


def test_threads_two_on_both_sides_is_reproducible_too(restore_threads):
    torch.set_num_threads(1)
    a = run_inprocess(_config(threads=2), record=False, progress=None)
    torch.set_num_threads(2)
    b = run_inprocess(_config(threads=2), record=False, progress=None)
    strip = lambda rows: [{k: v for k,
                           v in r.items() if k != "elapsed_s"} for r in rows]  # noqa: E731
    assert strip(a.history) == strip(b.history)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_server_app_and_client_app_pin_their_process(tmp_path, restore_threads, threads,
                                                         simulated_nodes):
    """server_fn and client_fn pin the process to training.threads before they compute."""
    from flwr.app import RecordDict
    from flwr.common import Context

    cfg = {"name": "pin", "dataset": {"name": "synthetic", "num_samples": 600},
           "training": {"rounds": 2, "restart_every": 2, "clients": 2, "seed": 1,
                        "threads": threads},
           "output": {"dir": str(tmp_path / "out")}}
    path = tmp_path / "pin.yaml"
    path.write_text(yaml.safe_dump(cfg))
    server_app = importlib.import_module("server.server_app")
    client_app = importlib.import_module("clients.client_app")
    torch.set_num_threads(3)
    server_app.server_fn(Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                                 run_config={"config": str(path)}))
    assert torch.get_num_threads() == threads
    assert set(compute_threads().values()) == {threads}
    torch.set_num_threads(3)
    client_app.client_fn(Context(run_id=1, node_id=1, node_config={"partition-id": 0,
                                                                   "num-partitions": 2},
                                 state=RecordDict(), run_config={"config": str(path)}))
    assert torch.get_num_threads() == threads


def test_pinning_again_rescans_only_after_an_import_and_pins_the_new_pool():
    """client_fn pins on every message: the pools are found again (threadpoolctl's scan) only when a
    module was imported since, and a BLAS loaded with it (scipy's own OpenBLAS) is pinned too; pools
    changed by someone else in between are pinned back without a scan."""
    code = """
import json
import threadpoolctl
import numpy, torch
from diff2_flwr.runtime import compute
scans = []
real = threadpoolctl.ThreadpoolController.__init__
def counting(self, *args, **kwargs):
    scans.append(1)
    real(self, *args, **kwargs)
threadpoolctl.ThreadpoolController.__init__ = counting
compute.pin_threads(1)
compute.pin_threads(1)
first = len(scans)
threadpoolctl.threadpool_limits(limits=2)  # someone else changes the pools (its own scan, counted)
moved = len(scans)
compute.pin_threads(1)
pinned_back = len(scans)
after_change = {p["filepath"]: p["num_threads"] for p in threadpoolctl.threadpool_info()}
before_scipy = len(scans)
import scipy.linalg  # loads scipy's own OpenBLAS, whose pool starts at OPENBLAS_NUM_THREADS = 2
compute.pin_threads(1)
scipy_scans = len(scans) - before_scipy
pools = {p["filepath"]: p["num_threads"] for p in threadpoolctl.threadpool_info()}
print(json.dumps({"first": first, "moved": moved, "pinned_back": pinned_back,
                  "scipy_scans": scipy_scans, "after_change": after_change, "pools": pools,
                  "torch": torch.get_num_threads()}))
"""
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "2", "OMP_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["first"] == 1, "the second pin with nothing loaded scanned again"
    assert got["pinned_back"] == got["moved"], "pinning back after a change scanned again"
    assert set(got["after_change"].values()) == {1}
    assert got["scipy_scans"] == 1, "scipy was imported and the pools were not scanned again"
    scipy_pools = [path for path in got["pools"] if "scipy.libs" in path or "scipy/" in path]
    assert scipy_pools, f"scipy's OpenBLAS was not found among the pools: {sorted(got['pools'])}"
    assert set(got["pools"].values()) == {1} and got["torch"] == 1
