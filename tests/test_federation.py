"""`training.clients: auto`: P from the federation that runs the config (fl/federation.py, the
ServerApp, the ClientApp).

The grids here are stand-ins named as Flower 1.42's (``InMemoryGrid`` for a simulation, anything
else for a deployment), as :func:`diff2_flwr.fl.federation.is_simulation` matches them by class
name; the real grid runs in tests/test_plain_flwr_run.py.
"""

from __future__ import annotations

import importlib
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from flwr.app import RecordDict
from flwr.common import Context

from diff2_flwr.fl.federation import FederationError, is_simulation, simulation_supernodes
from diff2_flwr.runtime.config import load_config
from diff2_flwr.runtime.session import PreflightError, load_data

REPO = Path(__file__).resolve().parents[1]


class InMemoryGrid:
    """Nodes registered by another thread, ``ids`` at a time, ``gap_s`` apart (as Flower's
    simulation does)."""

    def __init__(self, batches: list[int], gap_s: float = 0.0) -> None:
        self.nodes: list[int] = []
        self.batches, self.gap_s = batches, gap_s

    def start(self) -> InMemoryGrid:
        def register() -> None:
            for n in self.batches:
                time.sleep(self.gap_s)
                self.nodes.extend(range(len(self.nodes), len(self.nodes) + n))

        threading.Thread(target=register, daemon=True).start()
        return self

    def get_node_ids(self):
        return list(self.nodes)


class GrpcGrid:
    def get_node_ids(self):
        return [1, 2, 3]


def _tiny(tmp_path: Path, **training) -> Path:
    cfg = {"name": "auto", "dataset": {"name": "synthetic", "num_samples": 900},
           "training": {"rounds": 2, "restart_every": 2, "clients": "auto", "seed": 1, **training},
           "output": {"dir": str(tmp_path / "out")}}
    path = tmp_path / "auto.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_a_simulations_supernodes_are_counted_once_their_number_holds():
    assert is_simulation(InMemoryGrid([])) and not is_simulation(GrpcGrid()) and not is_simulation(
        None)
    grid = InMemoryGrid([2, 3], gap_s=0.3).start()  # 2 nodes, then 3 more 0.3 s later: 5, not 2
    started = time.monotonic()
    assert simulation_supernodes(grid, settle_s=0.6) == 5
    assert time.monotonic() - started >= 0.9
    with pytest.raises(FederationError,
                       match=r"no SuperNode of this simulation registered within 1 s"):
        simulation_supernodes(InMemoryGrid([]), timeout_s=1.0)


def test_a_deployment_must_declare_p():
    with pytest.raises(FederationError,
                       match=r"key `training.clients`: expected the number of clients P in a "
                       r"deployment\. Found 'auto', .* --run-config \"training.clients=3\""):
        simulation_supernodes(GrpcGrid())


def test_the_server_app_takes_p_from_the_simulation_and_says_it(tmp_path, capsys):
    server_app = importlib.import_module("server.server_app")
    path = _tiny(tmp_path)
    cfg, checked = server_app.checked_config({"config": str(path)}, InMemoryGrid([3]).start())
    assert cfg.clients == 3 and len(checked.data.shard_bounds) == 3
    assert checked.calibration == load_config(path).with_clients(3).calibration(checked.n_min)
    resolved = "[diff2] training.clients: auto -> P = 3, the SuperNodes of this simulation"
    assert resolved in capsys.readouterr().out
    components = server_app.server_fn(Context(run_id=1, node_id=0, node_config={},
                                              state=RecordDict(), run_config={"config": str(path)}),
                                              InMemoryGrid([4]).start())
    assert components.strategy.server.clients == 4


def test_the_server_app_of_a_deployment_refuses_auto_in_one_line(tmp_path, capsys):
    server_app = importlib.import_module("server.server_app")
    with pytest.raises(PreflightError) as caught:
        server_app.checked_config({"config": str(_tiny(tmp_path))}, GrpcGrid())
    assert capsys.readouterr().out.splitlines() == [f"[diff2] pre-flight failed: {caught.value}"]
    assert "expected the number of clients P in a deployment" in str(caught.value)
    # A declared P (the run config's key, as the deployment launchers pass it) needs no federation.
    cfg, _ = server_app.checked_config({"config": str(_tiny(tmp_path)), "training.clients": 3},
                                       GrpcGrid())
    assert cfg.clients == 3


def test_each_client_app_takes_p_from_num_partitions_and_holds_that_shard(tmp_path,
                                                                          simulated_nodes):
    client_app = importlib.import_module("clients.client_app")
    path = _tiny(tmp_path)
    expected = load_data(load_config(path).with_clients(3))
    for p in range(3):
        client = client_app.client_fn(Context(run_id=1, node_id=10 + p, state=RecordDict(),
                                              node_config={"partition-id": p, "num-partitions": 3},
                                              run_config={"config": str(path)}))
        worker = client.numpy_client.worker  # type: ignore[attr-defined]
        features, _ = expected.shard(p)
        assert worker.partition_id == p
        np.testing.assert_array_equal(worker.features.numpy(), features)


def test_diff2_run_and_the_in_process_driver_make_ten_workers_of_auto(tmp_path):
    from diff2_flwr.runtime.driver import run_inprocess

    server = run_inprocess(load_config(_tiny(tmp_path)), record=False, progress=None)
    assert server.clients == 10 and server.done


def test_the_server_app_ends_with_the_runs_summary_and_never_masks_the_runs_error(tmp_path, capsys):
    """`flwr log` ends with the run's summary block (what `flwr run .` users read); an unreadable
    summary.json is one line, never an exception in place of the run's own (print_outcome runs in a
    `finally`)."""
    from types import SimpleNamespace

    from diff2_flwr.runtime.driver import run_inprocess

    server_app = importlib.import_module("server.server_app")
    cfg = load_config(_tiny(tmp_path)).with_clients(3)
    run_inprocess(cfg, progress=None)
    (run_dir,) = [p for p in (tmp_path / "out").iterdir() if p.is_dir()]
    strategy = SimpleNamespace(server=SimpleNamespace(recorder=SimpleNamespace(directory=run_dir)))
    capsys.readouterr()
    server_app.print_outcome(strategy)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("[diff2] summary: run completed: ") and lines[-1].startswith(
        f"  files        {run_dir}: ")
    (run_dir / "summary.json").write_text("{not json")
    server_app.print_outcome(strategy)
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("[diff2] summary.json not readable for the summary: ")
    (run_dir / "summary.json").unlink()
    server_app.print_outcome(strategy)  # a run that wrote no summary: nothing to say
    assert capsys.readouterr().out == ""
