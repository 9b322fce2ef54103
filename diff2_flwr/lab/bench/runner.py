"""``diff2 bench``: where the time goes, as one JSON object (a benchmark, not a test).

- ``diff2_rounds_per_s``: DIFF2-GD on California Housing, 10 clients, T = 20, one configuration,
  one thread, rounds per second of the fast in-process engine (and of the reference driver,
  which runs exactly the Flower path's code, for comparison);
- ``protocol_wall_s``: wall seconds of the full California ε = 3 study of ``configs/paper/`` (its
  ``workers`` processes, one thread each on a 2-core machine), with ``protocol_gflops``: the matrix
  products' arithmetic of the batched engine over the study
  (:meth:`~diff2_flwr.core.ghost.MLP.matmul_flops` for every run and round) per wall second, against
  ``matmul_gflops``: a plain torch matrix product's (float32 and float64, 1,024², one thread, and on
  all cores) on the same machine — the floor; ``load_average``: the machine's 1-minute load before
  and after (other work skews every figure);
- ``protocol_floor`` (with the protocol): a lower bound on that study's wall time from its round
  backend alone (:mod:`.floors`: the fused kernel's calls, timed at the study's batch size, dtype
  and accumulation, none of the server's step, evaluation or set-up), its runs' restart and
  difference rounds counted from its run files, spread perfectly over its workers — against the
  60-second target (``floor_allows_target``);
- ``kdd_floor`` (with the protocol): a lower bound on the full KDD Cup 99 ε = 3 study's wall time on
  this machine from its first layer's float64 clipped sums alone at the float64 matmul peak
  (:func:`first_layer_floor`), against the 30-minute target; ``{"skipped": ...}`` without the data;
- ``flower_round_s`` / ``flower_floor_round_s``: median seconds per round (rounds 2..N) of a
  10-client ``flwr run`` simulation of DIFF2-GD, and of a do-nothing NumPyClient app
  (``benchmarks/floor_app``) measured in the same run: the framework's own floor;
- ``flower_sampled`` (issue 44, item 6): the same two apps on a federation of 1,000 SuperNodes
  (``--flower-clients``), DIFF2-GD with Poisson client sampling at q = 0.05 (``--flower-rate``) on
  the embedded synthetic data (100 records a client), against the floor app's FedAvg over a cohort
  of the same expected size (``fraction_fit = q``): median seconds per round (rounds 2..N), their
  ratio against the target of 1.5, and each app's seconds from its start to its first round's end
  (DIFF2's includes its one-off query of every node's partition);
- ``jax_peer``: the batched engine (``compile=True``) against hand-written JAX on the same work, per
  cell (DP-GD / DIFF2 × K = 1 / 18 × float32 / float64): rounds/s of each side and the ratios,
  against the target of 1.5 (:mod:`.jax_cells`); ``{"skipped": ...}`` when no interpreter with jax
  is found;
- ``models`` (issue 41): DIFF2's per-sample clipping on a CIFAR-sized CNN and a small transformer
  against Opacus 1.6 (per-sample hooks and ghost clipping) in the same run, samples/s of restart
  and difference rounds and peak memory per side, with the ratios (:mod:`.models`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import re
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import yaml

from ...runtime.config import parse_config
from ...runtime.driver import run_inprocess
from ...runtime.launch import run_simulation
from ...runtime.paths import APP_DIR
from ...runtime.session import load_data
from ...task.data import DataError
from ..study.runner import load_study, run_study
from ..backend import Batch, choose_backend
from ..sweep import RunSpec, batch_model, run_batch
from .floors import backend_seconds_per_round, protocol_floor
from .jax_cells import JaxPeerPlan, jax_peer_section
from .models import models_section
from .pinning import one_torch_thread

__all__ = ["run_bench"]

FLOOR_APP = APP_DIR / "benchmarks" / "floor_app"
PAPER_STUDY = APP_DIR / "configs" / "paper" / "california_eps3.yaml"
KDD_STUDY = APP_DIR / "configs" / "paper" / "kddcup99_eps3.yaml"
KDD_TARGET_S = 1800  # issue 24: the full KDD Cup 99 protocol per ε in 30 minutes on two cores
PROTOCOL_TARGET_S = 60  # issue 24 (it was 150 before)


def _machine() -> dict[str, Any]:
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__,
            "python": platform.python_version(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def _california(data_dir: str | None) -> dict:
    return {"name": "california_housing", **({"dir": data_dir} if data_dir else {})}


def _diff2_config(data_dir: str | None, rounds: int, out: str) -> dict:
    return {"name": "bench", "method": "diff2", "dataset": _california(data_dir),
            "training": {"rounds": rounds, "restart_every": 20, "clip_restart": 1.0,
                         "clip_diff": 1.0,
                         "learning_rate": 0.25, "clients": 10, "seed": 0},
            "evaluation": {"every": 50}, "output": {"dir": out}}


def _matmul_gflops(dtype: torch.dtype, threads: int, size: int = 1024,
                   seconds: float = 1.0) -> float:
    """GFLOP/s of a plain ``a @ b`` of two size × size matrices: the floor an engine's arithmetic is
    measured against."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(0)
        a, b = (torch.randn(size, size, generator=gen, dtype=dtype) for _ in range(2))
        for _ in range(3):
            a @ b  # warm-up
        count, t = 0, time.perf_counter()
        while time.perf_counter() - t < seconds:
            a @ b
            count += 1
        return 2 * size ** 3 * count / (time.perf_counter() - t) / 1e9
    finally:
        torch.set_num_threads(before)


def _paper_study(path: Path, data_dir: str | None):
    """The study of ``path`` (a paper config), its data read from ``data_dir`` when given."""
    study = load_study(path)
    if data_dir:
        study = dataclasses.replace(study, dataset={**study.dataset, "dir": data_dir})
    return study


def _study_data(study):
    """The study's prepared data and MLP, the same for all its runs (the data depend on the
    dataset's settings, not on a run's seed); a ``DataError`` if its files are missing."""
    probe = study.experiment(study.methods[0], study.methods[0].points()[0], study.epsilons[0],
                             study.tune_seeds[0])
    data = load_data(probe)
    mlp, _ = batch_model(data, model=study.model, hidden=study.hidden,
                         model_kwargs=study.model_kwargs, loss=probe.loss)
    return data, mlp


def _study_flops(study, runs_dir: Path, mlp, n_samples: int) -> int:
    """Matrix-product arithmetic of every run file of a batched study (rounds × per-round FLOPs;
    evaluation not counted)."""
    total = 0
    for path in runs_dir.glob("*.json"):
        record = json.loads(path.read_text())
        T = int(record["point"].get("restart_every", 1)) if record["base_method"] == "diff2" else 1
        restarts = -(-study.rounds // T)
        total += restarts * mlp.matmul_flops(n_samples, difference=False)
        total += (study.rounds - restarts) * mlp.matmul_flops(n_samples, difference=True)
    return total


def first_layer_floor(study, records: int, features: int, hidden: int,
                      float64_gflops_1_thread: float, cores: int,
                      target_s: float = KDD_TARGET_S) -> dict[str, Any]:
    """A lower bound on a batched study's wall time from its first layer's float64 clipped sums
    alone: every run sums c_i · δ_i x_iᵀ over its ``records`` samples each round (2 · hidden ·
    features · records FLOP, float64, as the engine keeps every sum), at this machine's float64
    matrix-product peak (``float64_gflops_1_thread``, a 1,024² product) on ``min(workers, cores)``
    cores. The runs counted are the fewest the study computes: every tuning configuration once per
    tuning seed, and one evaluation run per method and evaluation seed (a criterion choosing another
    point adds runs). Nothing else of a round is counted (forward pass, norms, evaluation): the
    study cannot be faster than this on this machine while its sums stay float64 and dense.
    ``target_s``: the wall time the study should take, for the budget per configuration-round it
    leaves."""
    tuning = sum(len(m.points()) for m in study.methods) * len(study.tune_seeds)
    evaluation = len(study.methods) * len(study.eval_seeds)
    flop = 2 * hidden * features * records
    cores_used = max(1, min(study.workers, cores))
    run_rounds = (tuning + evaluation) * study.rounds
    return {"study": study.name, "records": records, "features": features, "hidden": hidden,
            "runs_at_least": tuning + evaluation, "rounds": study.rounds, "cores": cores_used,
            "float64_sums_gflop_per_configuration_round": flop / 1e9,
            "floor_s": run_rounds * flop / (float64_gflops_1_thread * 1e9 * cores_used),
            "budget_ms_per_configuration_round": target_s * cores_used / run_rounds * 1e3,
            "target_s": target_s}


def _kdd_floor(data_dir: str | None, float64_gflops_1_thread: float) -> dict[str, Any]:
    """:func:`first_layer_floor` of the full KDD Cup 99 ε = 3 study, or ``{"skipped": why}`` without
    its data."""
    study = _paper_study(KDD_STUDY, data_dir)
    try:
        data, mlp = _study_data(study)
    except DataError as exc:
        return {"skipped": f"no KDD Cup 99 data ({exc})"}
    return first_layer_floor(study, len(data.y_train), mlp.sizes[0], mlp.sizes[1],
                             float64_gflops_1_thread, os.cpu_count() or 1, KDD_TARGET_S)


def _protocol_floor(study, data, mlp, records: list[dict[str, Any]]) -> dict[str, Any]:
    """:func:`~.floors.protocol_floor` of a batched study whose run files are ``records``: the
    backend floor measured here (one torch thread, as each of the study's workers) at the study's
    batch size, dtype and accumulation, on x_0 of init seeds 0..K-1, against the protocol's
    target."""
    K = study.batch_size
    x = torch.as_tensor(np.stack([
        batch_model(data, model=study.model, hidden=study.hidden, model_kwargs=study.model_kwargs,
                    loss=mlp.loss, init_seed=s)[1] for s in range(K)]))
    dtype = torch.float32 if study.dtype == "float32" else torch.float64
    with one_torch_thread():
        backend = choose_backend(mlp, Batch(data, dtype), K, compile=study.compile,
                                 accumulate=study.accumulate)
        seconds = {kind: backend_seconds_per_round(data, mlp, x, dtype=dtype,
                                                   accumulate=study.accumulate,
                                                   difference=kind == "difference",
                                                   backend=backend)
                   for kind in ("restart", "difference")}
    floor = protocol_floor(records, study.rounds, K, study.workers, os.cpu_count() or 1, seconds)
    return {**floor, "accumulate": study.accumulate, "target_s": PROTOCOL_TARGET_S,
            "floor_allows_target": bool(floor["floor_s"] <= PROTOCOL_TARGET_S)}


def _rounds_per_s(data_dir: str | None, rounds: int) -> dict[str, float]:
    cfg = parse_config(_diff2_config(data_dir, rounds, "unused"))
    data = load_data(cfg)
    cal = cfg.calibration(data.n_min)
    mech = cfg.mechanism(cal)
    spec = RunSpec(20, 0.25, 1.0, 1.0, mech.sigma_restart, mech.sigma_diff, 0, 0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_batch(data, [spec], rounds=5, eval_every=rounds)  # warm-up
        t = time.perf_counter()
        run_batch(data, [spec], rounds=rounds, eval_every=rounds)
        fast = rounds / (time.perf_counter() - t)
        t = time.perf_counter()
        run_inprocess(cfg, record=False, progress=None)
        reference = rounds / (time.perf_counter() - t)
    finally:
        torch.set_num_threads(threads)
    return {"diff2_rounds_per_s": fast, "reference_driver_rounds_per_s": reference}


def _flower(data_dir: str | None, rounds: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="diff2-bench-") as tmp:
        path = Path(tmp) / "bench.yaml"
        path.write_text(yaml.safe_dump(_diff2_config(data_dir, rounds, tmp)))
        result = run_simulation(str(path), echo=False)
        rows = [json.loads(line)
                for line in (result.output_dir / "metrics.jsonl").read_text().splitlines()]
    elapsed = [r["elapsed_s"] for r in rows[1:]]  # rows[i] is round i
    diff2 = _median_step(elapsed)  # rounds 2..N
    floor = run_simulation(None, app_dir=FLOOR_APP, clients=10,
                           run_config={"num-server-rounds": rounds}, echo=False)
    floor_s = _median_step(_floor_stamps(floor.log, rounds))
    return {"flower_round_s": diff2, "flower_floor_round_s": floor_s,
            "flower_ratio": diff2 / floor_s,
            "flower_rounds": rounds}


def _sampled_config(clients: int, rate: float, rounds: int, out: str) -> dict:
    return {"name": "bench_sampled", "method": "diff2",
            "dataset": {"name": "synthetic", "num_samples": 100 * clients, "num_features": 8},
            "training": {"rounds": rounds, "restart_every": min(20, rounds), "clip_restart": 1.0,
                         "clip_diff": 1.0, "learning_rate": 0.25, "clients": clients, "seed": 0,
                         "sampling": {"kind": "poisson", "rate": rate}},
            "evaluation": {"every": 10 * rounds, "train_metrics": False},
            "output": {"dir": out}}


def _median_step(stamps: list[float]) -> float:
    """The median time between consecutive stamps (rounds 2..N of N stamps)."""
    return statistics.median(b - a for a, b in zip(stamps, stamps[1:]))


def _floor_stamps(log: str, rounds: int) -> list[float]:
    """The floor app's ``[floor] round <r> t=<seconds>`` stamps, one per round."""
    stamps = [float(t) for t in re.findall(r"\[floor\] round \d+ t=([0-9.]+)", log)]
    if len(stamps) != rounds:
        raise RuntimeError(f"The floor app logged {len(stamps)} of {rounds} rounds.")
    return stamps


def _flower_sampled(clients: int, rate: float, rounds: int) -> dict[str, Any]:
    """DIFF2 with Poisson client sampling on ``clients`` SuperNodes against the floor app's FedAvg
    over a cohort of the same expected size, both through ``flwr run`` (the module docstring)."""
    with tempfile.TemporaryDirectory(prefix="diff2-bench-sampled-") as tmp:
        path = Path(tmp) / "bench_sampled.yaml"
        path.write_text(yaml.safe_dump(_sampled_config(clients, rate, rounds, tmp)))
        t = time.perf_counter()
        result = run_simulation(str(path), echo=False)
        wall = time.perf_counter() - t
        rows = [json.loads(line)
                for line in (result.output_dir / "metrics.jsonl").read_text().splitlines()]
    elapsed = [r["elapsed_s"] for r in rows[1:]]  # rows[i] is round i
    cohorts = [len(r["cohort"]) for r in rows[1:]]
    t = time.perf_counter()
    floor = run_simulation(None, app_dir=FLOOR_APP, clients=clients,
                           run_config={"num-server-rounds": rounds, "fraction-fit": rate,
                                       "min-available-clients": clients}, echo=False)
    floor_wall = time.perf_counter() - t
    stamps = _floor_stamps(floor.log, rounds)
    diff2, floor_s = _median_step(elapsed), _median_step(stamps)
    return {"clients": clients, "rate": rate, "rounds": rounds,
            "mean_cohort": statistics.fmean(cohorts),
            "floor_cohort": max(int(clients * rate), 2),
            "round_s": diff2, "floor_round_s": floor_s, "ratio": diff2 / floor_s,
            "target_ratio": 1.5,
            "first_round_end_s": wall - (elapsed[-1] - elapsed[0]),
            "floor_first_round_end_s": floor_wall - (stamps[-1] - stamps[0])}


def run_bench(*, data_dir: str | None = None, protocol: bool = True, flower: bool = True,  # noqa: PLR0913 -- keyword-only, one per section of the bench
              rounds: int = 300, flower_rounds: int = 30, flower_clients: int = 1000,
              flower_rate: float = 0.05, jax_peer: JaxPeerPlan | None = None,
              models: dict[str, Any] | None = None,
              progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Measure and return the figures (see the module docstring).

    Args:
        data_dir: the datasets' folder (None: ``$DIFF2_DATA_DIR``).
        protocol: time the full California ε = 3 study.
        flower: run the Flower simulations (10 clients, and the sampled federation).
        rounds: rounds timed for ``diff2_rounds_per_s``.
        flower_rounds: rounds of each Flower simulation.
        flower_clients: SuperNodes of the sampled federation (``flower_sampled``).
        flower_rate: its Poisson sampling rate q.
        jax_peer: the ``jax_peer`` section's plan
            (:func:`~diff2_flwr.lab.bench.jax_cells.plan_jax_peer`); None: no section.
        models: the ``models`` section's options (:func:`~.models.models_section`: records,
            batch, reps); None: no section.
        progress: called with one line per step of the ``jax_peer`` and ``models`` sections, and
            with the skip line.
    """
    out: dict[str, Any] = {"machine": _machine(), "load_average_before": os.getloadavg()[0]}
    out["matmul_gflops"] = {f"{name}_{label}": _matmul_gflops(dtype, threads)
                            for name, dtype in (("float32", torch.float32), ("float64",
                                                                             torch.float64))
                            for label, threads in (("1_thread", 1), ("all_cores",
                                                                     os.cpu_count() or 1))}
    out.update(_rounds_per_s(data_dir, rounds))
    if protocol:
        study = _paper_study(PAPER_STUDY, data_dir)
        with tempfile.TemporaryDirectory(prefix="diff2-bench-study-") as tmp:
            t = time.perf_counter()
            run_study(study, output_root=tmp, fresh=True, make_plots=False)
            wall = time.perf_counter() - t
            data, mlp = _study_data(study)
            runs_dir = Path(tmp) / study.name / "runs"
            flops = _study_flops(study, runs_dir, mlp, len(data.y_train))
            records = [json.loads(p.read_text()) for p in runs_dir.glob("*.json")]
        out["protocol_wall_s"] = wall
        out["protocol_workers"] = study.workers
        out["protocol_tuning_configurations"] = sum(len(m.points()) for m in study.methods)
        out["protocol_target_s"] = PROTOCOL_TARGET_S
        out["protocol_matmul_tflop"] = flops / 1e12
        out["protocol_gflops"] = flops / wall / 1e9
        dtype = "float32" if study.dtype == "float32" else "float64"
        floor = out["matmul_gflops"][f"{dtype}_1_thread"] * min(study.workers, os.cpu_count() or 1)
        out["protocol_fraction_of_matmul_floor"] = out["protocol_gflops"] / floor
        out["protocol_floor"] = _protocol_floor(study, data, mlp, records)
        out["kdd_floor"] = _kdd_floor(data_dir, out["matmul_gflops"]["float64_1_thread"])
    if flower:
        out.update(_flower(data_dir, flower_rounds))
        out["flower_target_ratio"] = 1.5
        out["flower_sampled"] = _flower_sampled(flower_clients, flower_rate, flower_rounds)
    if jax_peer is not None:
        out["jax_peer"] = jax_peer_section(jax_peer, data_dir=data_dir, progress=progress)
    if models is not None:
        out["models"] = models_section(**models, progress=progress)
    out["load_average_after"] = os.getloadavg()[0]
    rounded = lambda v: float(np.round(v, 4)) if isinstance(v, float) else v  # noqa: E731
    return {k: ({a: rounded(b) for a,
                 b in v.items()} if isinstance(v, dict) and k != "machine" else rounded(v))
            for k, v in out.items()}
