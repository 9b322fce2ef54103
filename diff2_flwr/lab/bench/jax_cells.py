"""The ``jax_peer`` section of ``diff2 bench``: the batched engine's speed against hand-written JAX,
as ratios measured in the same run.

Both sides do the same work on the same bits: California Housing as the project prepares it, P = 10
clients (the project's shards, padded as :class:`~diff2_flwr.lab.backend.Batch` pads them), the
paper MLP 8 → 10 softplus → 1 with ½-squared error, full-batch rounds, x_0 from the project's init
seeds. A cell is (round kind, K, dtype): DP-GD or DIFF2 (one restart round, then difference rounds),
K = 1 or 18 configurations (η ∈ {0.125, 0.25, 0.5} × C ∈ {0.5, 1, 2} × init seed ∈ {0, 1}), float32
or float64; σ from the project's own calibration for the rounds run.

Sides: ``project`` = ``run_batch(..., compile=True)`` (as ``configs/paper/`` runs; float32 cells
with ``accumulate="float32"``, the fused kernel's sound float32 sums: :data:`ACCUMULATE`),
``project_eager`` = the same with ``compile=False`` (``--jax-eager``), and the JAX variants of
:mod:`diff2_flwr.lab.bench.jax_peer` (``jax_vmap``, ``jax_ghost``, ``jax_ghost_map`` at K = 18), and
``backend_floor``: the project's round backend alone on the cell's runs (:mod:`.floors`: the
kernel's calls for R rounds, no server step; ``backend_floor_over_best_jax``,
``floor_allows_target``: whether even that reaches the target). The JAX side is a subprocess of
an interpreter that has jax (this one, or ``--jax-python`` /
``DIFF2_JAX_PYTHON``): XLA's thread flags must be set before jax starts, and its thread pools stay
out of torch's. The project runs in this process with one torch thread; both are pinned to one core.

Timing: compilation is warmed up first and excluded (JAX: ahead of time, reported; project: its
first call, reported). Then per repetition every side of every cell runs once, A/B/C in even
repetitions and C/B/A in odd ones (drift in the machine's load hits every side alike); a side's rate
is R / median seconds. A ``run_batch`` call also sets up and evaluates the loss at rounds 0 and R,
which the JAX loop does not: each project call is paired with a 1-round call, and the ratios
(``project_over_best_jax``, ``best_jax_over_project``, ``meets_target``) use the marginal rate (R -
1) / median(t_R - t_1), the per-round speed a 2,000-round sweep sees; whole calls' ratio is
``project_over_best_jax_whole_calls`` (at the short default R it understates the project). Before
timing, one round's update (DIFF2: the restart and the first difference round) without noise is
compared between the project and each JAX variant; ``diverged`` names, per side, the runs a timed
call found diverged (or left non-finite).
"""

from __future__ import annotations

import importlib.util
import math
import os
import pickle
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import numpy as np
import torch

from ...core.closed_form import PaperMLPGradients
from ...core.fused import accumulation_error
from ...core.layout import ParameterLayout
from ...runtime.config import parse_config
from ...runtime.session import load_data
from ..backend import Batch, choose_backend
from ..sweep import RunSpec, batch_model, run_batch
from .floors import backend_seconds_per_round
from .pinning import one_core, one_torch_thread

__all__ = ["CELLS", "SKIPPED", "TARGET", "Cell", "JaxPeerPlan", "adversarial_rows",
           "clipping_check", "find_jax_python",
           "jax_peer_section", "measure", "parse_cells", "parse_rounds", "plan_jax_peer",
           "run_jax_peer", "schedule", "summarise"]

#: The project must run at least this many times as many rounds per second as the best JAX variant.
TARGET = 1.5
SKIPPED = "jax is not importable (pip install jax jaxlib, or --jax-python PATH)"
JAX_VARIANTS = ("jax_vmap", "jax_ghost", "jax_ghost_map")
#: The side timing the project's round backend alone (:mod:`diff2_flwr.lab.bench.floors`): the
#: kernel's calls for the cell's rounds, none of the server's step — a floor no ``run_batch``
#: call reaches.
FLOOR = "backend_floor"
DEFAULT_ROUNDS = {1: 100, 18: 10}
LRS, CLIPS, INITS = (0.125, 0.25, 0.5), (0.5, 1.0, 2.0), (0, 1)
#: Largest relative difference of one checked update (project vs JAX) called agreement: float32 sums
#: of 16,512 samples in another order differ by ~√M·ε ≈ 1e-5; float64's by ~1e-14.
AGREEMENT_TOLERANCE = {"f32": 1e-4, "f64": 1e-10}
#: The project's accumulation per cell dtype: its fastest sound one (float32 cells: the fused
#: kernel's float32 sums, clipped at C / (1 + ρ), :mod:`diff2_flwr.core.fused`).
ACCUMULATE = {"f32": "float32", "f64": "float64"}
PEER = Path(__file__).with_name("jax_peer.py")
# seconds of R rounds; of a 1-round call right after (project sides)
Timing = tuple[float, float | None]


class Cell(NamedTuple):
    """One benchmark cell: round kind (``dpgd`` / ``diff2``), K configurations, dtype (``f32`` /
    ``f64``)."""

    kind: str
    K: int
    dtype: str

    @property
    def name(self) -> str:
        """``kind:K:dtype``, as ``--jax-cells`` names the cell and the section's JSON keys it."""
        return f"{self.kind}:{self.K}:{self.dtype}"


CELLS = tuple(Cell(kind, K, dt) for kind in ("dpgd", "diff2") for K in (1, 18) for dt in ("f32",
                                                                                          "f64"))


def parse_cells(text: str | None) -> tuple[Cell, ...]:
    """Cells named as ``kind:K:dtype``, comma-separated (``None`` or ``all``: every cell), in
    :data:`CELLS` order."""
    if text is None or text.strip() == "all":
        return CELLS
    names = {c.name: c for c in CELLS}
    wanted = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [w for w in wanted if w not in names]
    if unknown or not wanted:
        raise ValueError(
            f"--jax-cells: {', '.join(unknown) or repr(text)} is not a cell. Give a "
            f"comma-separated list of {', '.join(names)}, or all.")
    return tuple(c for c in CELLS if c.name in wanted)


def parse_rounds(text: str | None) -> dict[int, int]:
    """``R1,R18``: rounds per timed call at K = 1 and at K = 18 (``None``:
    :data:`DEFAULT_ROUNDS`)."""
    if text is None:
        return dict(DEFAULT_ROUNDS)
    try:
        r1, r18 = (int(part) for part in text.split(","))
    except ValueError:
        r1 = r18 = 0
    if min(r1, r18) < 2:
        raise ValueError(
            f"--jax-rounds: expected two integers ≥ 2, 'R1,R18' (rounds per timed call at K = 1 "
            f"and K = 18; DIFF2 needs a difference round), found {text!r}. E.g. --jax-rounds "
            f"100,10.")
    return {1: r1, 18: r18}


def grid(K: int) -> list[tuple[float, float, int]]:
    """(learning rate, clip, init and noise seed) of the K configurations."""
    if K == 1:
        return [(0.25, 1.0, 0)]
    return [(lr, c, s) for s in INITS for lr in LRS for c in CLIPS]


def specs_for(cell: Cell, rounds: int, sigmas: Mapping[str, tuple[float, float]],
              zero_noise: bool = False) -> list[tuple]:
    """RunSpec fields (T, η, C1, C2, σ1, σ2, noise seed, init seed) of the cell's runs over
    ``rounds`` rounds: DP-GD restarts every round with C1 = C; DIFF2 restarts once (T = rounds) with
    C1 = 1 and C2 = C."""
    s1, s2 = (0.0, 0.0) if zero_noise else sigmas[cell.kind]
    if cell.kind == "dpgd":
        return [(1, lr, c, c, s1, 0.0, s, s) for lr, c, s in grid(cell.K)]
    return [(rounds, lr, 1.0, c, s1, s2, s, s) for lr, c, s in grid(cell.K)]


def sides_of(cell: Cell, eager: bool = False) -> tuple[str, ...]:
    """The sides timed in a cell (at K = 1 there is nothing to map over: no ``jax_ghost_map``)."""
    project = ("project", "project_eager") if eager else ("project",)
    return project + (FLOOR,) + tuple(v for v in JAX_VARIANTS
                                      if not (cell.K == 1 and v.endswith("_map")))


def schedule(cells: Sequence[Cell], reps: int, eager: bool = False) -> list[tuple[int, Cell, str]]:
    """(repetition, cell, side) in timing order: each cell's sides A/B/C in even repetitions, C/B/A
    in odd ones."""
    return [(rep, cell, side) for rep in range(reps) for cell in cells
            for side in (sides_of(cell, eager) if rep % 2 == 0 else sides_of(cell, eager)[::-1])]


def measure(plan: Sequence[tuple[int, Cell, str]], run_one: Callable[[Cell, str], Timing],
            progress: Callable[[str], None] | None = None) -> dict[tuple[str, Cell], list[Timing]]:
    """Run the plan in order; each (side, cell)'s timings in repetition order."""
    times: dict[tuple[str, Cell], list[Timing]] = {}
    for i, (rep, cell, side) in enumerate(plan):
        times.setdefault((side, cell), []).append(run_one(cell, side))
        if progress and (i + 1 == len(plan) or plan[i + 1][0] != rep):
            progress(f"jax_peer: repetition {rep + 1} done (load {os.getloadavg()[0]:.2f})")
    return times


def summarise(cells: Sequence[Cell], times: Mapping[tuple[str, Cell], Sequence[Timing]],
              rounds: Mapping[int, int], eager: bool = False) -> dict[str, dict[str, Any]]:
    """Per cell: each side's rounds/s (R / median seconds), the project's marginal rate ((R - 1) /
    median of t_R - t_1 over the repetitions), the best JAX variant, and the ratios both ways
    against :data:`TARGET`: of the marginal rate (``project_over_best_jax``, the per-round speed a
    2,000-round sweep sees) and of whole calls."""
    out = {}
    for cell in cells:
        R, row = rounds[cell.K], {}
        for side in sides_of(cell, eager):
            ts = times[side, cell]
            row[f"{side}_rounds_per_s"] = R / statistics.median(t for t, _ in ts)
            if side.startswith("project"):
                extra = statistics.median(t - t1 for t, t1 in ts)
                row[f"{side}_marginal_rounds_per_s"] = (R - 1) / extra if extra > 0 else float(
                    "nan")
        best = max((v for v in sides_of(cell, eager) if v.startswith("jax")),
                   key=lambda v: row[f"{v}_rounds_per_s"])
        ratio = row["project_marginal_rounds_per_s"] / row[f"{best}_rounds_per_s"]
        whole = row["project_rounds_per_s"] / row[f"{best}_rounds_per_s"]
        floor = row[f"{FLOOR}_rounds_per_s"] / row[f"{best}_rounds_per_s"]
        out[cell.name] = {"rounds": R, **row, "best_jax": best, "best_jax_over_project": 1 / ratio,
                          "project_over_best_jax": ratio, "target": TARGET,
                          "meets_target": bool(ratio >= TARGET),
                          "project_over_best_jax_whole_calls": whole,
                          "backend_floor_over_best_jax": floor,
                          "floor_allows_target": bool(floor >= TARGET)}
    return out


def find_jax_python(jax_python: str | None = None) -> str | None:
    """The interpreter the JAX side runs in: ``jax_python``, else ``$DIFF2_JAX_PYTHON``, else this
    one when jax is importable here; None when none is."""
    for given, source in ((jax_python, "--jax-python"), (os.environ.get("DIFF2_JAX_PYTHON"),
                                                         "DIFF2_JAX_PYTHON")):
        if given:
            if not os.access(given, os.X_OK) or os.path.isdir(given):
                raise FileNotFoundError(
                    f"{source}: {given!r} is not an executable file. Give a Python interpreter "
                    f"that has jax (e.g. JAXENV/bin/python), or pass --skip-jax.")
            return given
    return sys.executable if importlib.util.find_spec("jax") is not None else None


class _Peer:
    """The JAX side: :mod:`diff2_flwr.lab.bench.jax_peer` in a subprocess of ``python``, pickled
    requests on its stdin."""

    def __init__(self, python: str) -> None:
        env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1",
                   JAX_PLATFORMS="cpu",
                   XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
        code = "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__main__')"
        self.python = python
        self.proc = subprocess.Popen([python, "-c", code, str(PEER)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env)

    def ask(self, *request: Any) -> Any:
        try:
            pickle.dump(request, self.proc.stdin)
            self.proc.stdin.flush()
            return pickle.load(self.proc.stdout)
        except (EOFError, BrokenPipeError, pickle.UnpicklingError) as exc:
            self.proc.kill()
            raise RuntimeError(
                f"The JAX side ({self.python} running {PEER.name}) stopped at {request[0]!r} "
                f"(exit {self.proc.wait()}); its error is above on stderr. Check that "
                f"`{self.python} -c 'import jax'` works, or pass --skip-jax.") from exc

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                pickle.dump(("quit",), self.proc.stdin)
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


class _Project:
    """The project side in this process: California Housing loaded once, σ per round kind, x_0 per
    init seed."""

    def __init__(self, data_dir: str | None, rounds: Mapping[int, int]) -> None:
        def config(method: str, R: int) -> Any:
            training = {"rounds": R, "clip_restart": 1.0, "learning_rate": 0.25, "clients": 10,
                        "seed": 0, **({"restart_every": R,
                                       "clip_diff": 1.0} if method == "diff2" else {})}
            return parse_config({"name": "jax-peer", "method": method, "training": training,
                                 "evaluation": {"every": R},
                                 "dataset": {"name": "california_housing",
                                             **({"dir": data_dir} if data_dir else {})}})

        self.data = load_data(config("dpgd", 2))
        self.sigmas: dict[tuple[str, int], tuple[float, float]] = {}
        for R in sorted(set(rounds.values())):
            for method in ("dpgd", "diff2"):
                cfg = config(method, R)
                mech = cfg.mechanism(cfg.calibration(self.data.n_min))
                self.sigmas[method, R] = (mech.sigma_restart, mech.sigma_diff)
        self.x0 = {s: batch_model(self.data, init_seed=s)[1] for s in INITS}
        self._backends: dict[Cell, tuple[Any, Any]] = {}

    def shards(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A [P, N, F], Y [P, N], mask [P, N], float64: client p's samples first, zeros after
        (Batch's padding)."""
        sizes = self.data.shard_sizes
        P, N, F = len(sizes), max(sizes), self.data.num_features
        A, Y, mask = np.zeros((P, N, F)), np.zeros((P, N)), np.zeros((P, N))
        for p in range(P):
            xs, ys = self.data.shard(p)
            A[p, :len(ys)], Y[p, :len(ys)], mask[p, :len(ys)] = xs, np.asarray(ys).reshape(-1), 1.0
        return A, Y, mask

    def specs(self, cell: Cell, rounds: int, zero_noise: bool = False) -> list[tuple]:
        return specs_for(cell, rounds, {k: self.sigmas[k, rounds] for k in ("dpgd", "diff2")},
                         zero_noise)

    def floor(self, cell: Cell, specs: list[tuple], rounds: int) -> float:
        """Seconds of ``rounds`` rounds of the round backend alone for the cell's runs (the
        :data:`FLOOR` side; :func:`~diff2_flwr.lab.bench.floors.backend_seconds_per_round`), the
        backend chosen as ``run_batch`` chooses it and kept per cell; each run at its own x_0 and
        radius."""
        dtype = {"f32": torch.float32, "f64": torch.float64}[cell.dtype]
        runs = [RunSpec(*s) for s in specs]
        if cell not in self._backends:
            mlp = batch_model(self.data, init_seed=runs[0].init_seed)[0]
            self._backends[cell] = mlp, choose_backend(mlp, Batch(self.data, dtype), len(runs),
                                                       compile=True,
                                                       accumulate=ACCUMULATE[cell.dtype])
        mlp, backend = self._backends[cell]
        x = torch.as_tensor(np.stack([self.x0[r.init_seed] for r in runs]))
        diff = cell.kind == "diff2"
        radius = torch.tensor([r.clip_diff if diff else r.clip_restart for r in runs],
                              dtype=torch.float64)
        return rounds * backend_seconds_per_round(self.data, mlp, x, dtype=dtype,
                                                  accumulate=ACCUMULATE[cell.dtype],
                                                  difference=diff, radius=radius, rounds=rounds,
                                                  reps=1, backend=backend)

    def run(self, cell: Cell, specs: list[tuple], rounds: int,
            compile: bool) -> tuple[float, np.ndarray, list[int]]:
        """Seconds of one ``run_batch`` call, the final iterates [K, d] and the runs it found
        diverged."""
        dtype = {"f32": torch.float32, "f64": torch.float64}[cell.dtype]
        t = time.perf_counter()
        res = run_batch(self.data, [RunSpec(*s) for s in specs], rounds=rounds, eval_every=rounds,
                        dtype=dtype, compile=compile, accumulate=ACCUMULATE[cell.dtype])
        seconds = time.perf_counter() - t
        return seconds, np.stack([r.final_x for r in res]), [k for k, r in enumerate(res)
                                                             if r.diverged_at is not None]


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    """max over rows of max |a - b| / max |b| (normwise per run)."""
    return float(np.max(np.abs(a - b).max(1) / np.abs(b).max(1)))


def _agreement(cell: Cell, project: _Project, peer: _Peer, rounds: int) -> dict[str, Any]:
    """The change of the iterates after DP-GD's round 1 / DIFF2's restart and first difference
    round, noise off, project (compile=True) against each JAX variant; and how many samples the clip
    binds on there (run 0)."""
    checked = 1 if cell.kind == "dpgd" else 2
    specs = project.specs(cell, rounds, zero_noise=True)
    x0 = np.stack([project.x0[s[7]] for s in specs])
    xp = project.run(cell, specs, checked, compile=True)[1]
    out: dict[str, Any] = {}
    variants = [v for v in sides_of(cell) if v.startswith("jax")]
    for v in variants:
        out[f"{v}_max_rel_diff"] = _rel(peer.ask("run", f"{v}@{cell.name}", checked,
                                                 True)["x"] - x0, xp - x0)
    out["clipped_fraction_run0"] = peer.ask("clipped_fraction",
                                            f"jax_ghost@{cell.name}")["fraction"]
    out["tolerance"] = AGREEMENT_TOLERANCE[cell.dtype]
    if ACCUMULATE[cell.dtype] == "float32":  # clipped at C / (1 + ρ): where the clip binds, ρ more
        out["tolerance"] += 2 * accumulation_error(max(project.data.shard_sizes))
    out["project_accumulate"] = ACCUMULATE[cell.dtype]
    out["agrees"] = all(out[f"{v}_max_rel_diff"] <= out["tolerance"] for v in variants)
    return out


def _warm_project(cells: Sequence[Cell], project: _Project, rounds: Mapping[int, int], eager: bool,
                  say: Callable[[str], None]) -> dict[str, dict[str, Any]]:
    """The project's first call per cell and side (``torch.compile`` compiles there): its seconds,
    excluded."""
    warm: dict[str, dict[str, Any]] = {}
    for cell in cells:
        specs = project.specs(cell, rounds[cell.K])
        for side in sides_of(cell, eager):
            if side.startswith("project"):
                seconds = project.run(cell, specs, 3, side == "project")[0]
                warm.setdefault(cell.name, {})[f"{side}_first_call_s"] = seconds
                say(f"jax_peer: {cell.name} {side} ready")
    return warm


def _build_jax(cells: Sequence[Cell], project: _Project, peer: _Peer, rounds: Mapping[int, int],
               warm: dict[str, dict[str, Any]], say: Callable[[str], None]) -> None:
    """Each cell's JAX variants compiled ahead of time (seconds into ``warm``) and run for 3
    rounds."""
    for cell in cells:
        specs = project.specs(cell, rounds[cell.K])
        x0 = np.stack([project.x0[s[7]] for s in specs])
        for side in (v for v in sides_of(cell) if v.startswith("jax")):
            reply = peer.ask("build", f"{side}@{cell.name}", cell.kind, side[4:], cell.dtype, specs,
                             x0)
            peer.ask("run", f"{side}@{cell.name}", 3, False)
            warm.setdefault(cell.name, {})[f"{side}_compile_s"] = sum(reply["compile_s"].values())
            say(f"jax_peer: {cell.name} {side} ready")


@dataclass(frozen=True)
class JaxPeerPlan:
    """What the section runs, validated before ``diff2 bench`` starts measuring
    (:func:`plan_jax_peer`).

    Attributes:
        python: the interpreter the JAX side runs in; None when jax is found nowhere (the
            section is skipped).
        reps: timed repetitions per side and cell (two give one A/B/C and one C/B/A pass).
        cells: the cells timed.
        rounds: rounds per timed call, by K.
        eager: whether ``run_batch(..., compile=False)`` is timed too (``project_eager``).
    """

    python: str | None
    reps: int = 2
    cells: tuple[Cell, ...] = CELLS
    rounds: Mapping[int, int] = field(default_factory=lambda: dict(DEFAULT_ROUNDS))
    eager: bool = False


def plan_jax_peer(*, jax_python: str | None = None, reps: int = 2, cells: str | None = None,
                  rounds: str | None = None, eager: bool = False) -> JaxPeerPlan:
    """The section's plan from ``diff2 bench``'s flags; a ValueError or FileNotFoundError naming the
    flag.

    Args:
        jax_python: ``--jax-python`` (else ``$DIFF2_JAX_PYTHON``, else this interpreter if it
            has jax).
        reps: ``--jax-reps`` (≥ 1).
        cells: ``--jax-cells``, as :func:`parse_cells` reads it.
        rounds: ``--jax-rounds``, as :func:`parse_rounds` reads it.
        eager: ``--jax-eager``: whether ``project_eager`` is timed too.
    """
    if reps < 1:
        raise ValueError(f"--jax-reps must be at least 1. Found {reps}.")
    return JaxPeerPlan(find_jax_python(jax_python), reps, parse_cells(cells), parse_rounds(rounds),
                       eager)


def run_jax_peer(plan: JaxPeerPlan, *, data_dir: str | None = None,
                 progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Time the plan's cells on both sides (see the module docstring) and return the section's JSON.

    Args:
        plan: what to run (its ``python`` must be set).
        data_dir: California Housing's folder (None: ``$DIFF2_DATA_DIR``).
        progress: called with one line per step (stderr in ``diff2 bench``).
    """
    if plan.python is None:
        raise ValueError(f"No interpreter with jax to run the JAX side: {SKIPPED}.")
    cells, rounds, eager, python = plan.cells, dict(plan.rounds), plan.eager, plan.python
    say = progress or (lambda _: None)
    t0 = time.perf_counter()
    project = _Project(data_dir, rounds)
    with one_torch_thread():
        # unpinned: torch.compile's workers use every core
        warm = _warm_project(cells, project, rounds, eager, say)
        run = _pinned_run(plan, project, warm, say)
    table = summarise(cells, run["times"], rounds, eager)
    for name, row in table.items():
        row.update(warm=warm[name], agreement=run["agreement"][name],
                   diverged=run["diverged"][name])
    return {"cells": table, "clipping": run["clipping"], "reps": plan.reps,
            "rounds": {f"K{k}": v for k, v in rounds.items()},
            "core": run["core"],
            "jax": run["setup"]["jax"], "jax_python": python,
            "xla_flags": run["setup"]["xla_flags"],
            "sigmas": {f"{k}_R{R}": v for (k, R), v in project.sigmas.items()}, "target": TARGET,
            "all_cells_meet_target": all(row["meets_target"] for row in table.values()),
            "seconds": time.perf_counter() - t0}


def _pinned_run(plan: JaxPeerPlan, project: _Project, warm: dict[str, dict[str, Any]],
                say: Callable[[str], None]) -> dict[str, Any]:
    """On one core: start the JAX side, compile its cells, check agreement, then the interleaved
    timed calls."""
    rounds = plan.rounds
    with one_core() as core:
        peer = _Peer(str(plan.python))
        try:
            A, Y, mask = project.shards()
            setup = peer.ask("setup", A, Y, mask, list(project.data.shard_sizes), 10)
            say(f"jax_peer: jax {setup['jax']} in {plan.python}, core {core}")
            _build_jax(plan.cells, project, peer, rounds, warm, say)
            agreement = {c.name: _agreement(c, project, peer, rounds[c.K]) for c in plan.cells}
            clipping = clipping_check(peer)
            say("jax_peer: clipping on adversarial rows: " + ", ".join(
                f"{k} peer {v['peer']['outside']}/{v['peer']['checked']} outside (max excess "
                f"{v['peer']['max_excess']:.2g}), project {v['project']['outside']}"
                for k, v in clipping.items()))

            diverged: dict[str, dict[str, list[int]]] = {c.name: {} for c in plan.cells}

            def run_one(cell: Cell, side: str) -> Timing:
                R = rounds[cell.K]
                if side == FLOOR:
                    return project.floor(cell, project.specs(cell, R), R), None
                if side.startswith("jax"):
                    reply = peer.ask("run", f"{side}@{cell.name}", R, False)
                    seconds, x, gone, t1 = reply["s"], reply["x"], [], None
                else:
                    specs, compiled = project.specs(cell, R), side == "project"
                    seconds, x, gone = project.run(cell, specs, R, compiled)
                    t1 = project.run(cell, specs, 1, compiled)[0]
                bad = sorted(set(gone) | {int(k) for k in np.flatnonzero(~np.isfinite(x).all(1))})
                if bad:
                    diverged[cell.name][side] = bad
                return seconds, t1

            times = measure(schedule(plan.cells, plan.reps, plan.eager), run_one, say)
        finally:
            peer.close()
    return {"core": core, "setup": setup, "agreement": agreement, "times": times,
            "diverged": diverged, "clipping": clipping}


def adversarial_rows(features: int = 8, hidden: int = 10, rows: int = 240,
                     seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Rows for the clipping check: features of magnitude 1e-3 to 1e4 (a quarter at 1e4), targets
    up to 1e3, an iterate x of the paper MLP and a previous one 1e-4 away (differences that nearly
    cancel): (A [M, F], Y [M], x [d], xp [d])."""
    rng = np.random.default_rng(seed)
    scale = 10.0 ** rng.choice([-3.0, 0.0, 2.0, 4.0], size=rows)
    A = rng.standard_normal((rows, features)) * scale[:, None]
    Y = rng.standard_normal(rows) * 10.0 ** rng.choice([0.0, 3.0], size=rows)
    d = hidden * features + 2 * hidden + 1
    x = 0.3 * rng.standard_normal(d)
    return A, Y, x, x + 1e-4 * rng.standard_normal(d)


def _exact_sq(a: np.ndarray, dd: np.ndarray, u: np.ndarray, de: float) -> Fraction:
    """‖(dd ⊗ a, dd, u, de)‖² exactly (Fractions of the floats)."""
    def sq(v: Any) -> Fraction:
        return sum((Fraction(float(t)) ** 2 for t in np.ravel(v)), Fraction(0))
    return sq(dd) * (sq(a) + 1) + sq(u) + Fraction(float(de)) ** 2


def clipping_check(peer: Any, *, hidden: int = 10, seed: int = 0) -> dict[str, dict[str, Any]]:
    """Under-clipping of the peer and of the project on the same adversarial rows
    (:func:`adversarial_rows`), per round kind and dtype: each row is clipped at three radii — the
    peer's own computed norm of it (where rounding decides), its exact norm rounded to the dtype,
    and half that — and the exact norm (Fractions) of every clipped row is compared with its
    radius. ``outside`` counts rows above it, ``max_excess`` is the largest ‖c·g‖ / C - 1 (0 when
    none is outside). The project's side is the paper MLP's closed form
    (:class:`~diff2_flwr.core.closed_form.PaperMLPGradients`, one row at a time); the fused kernel
    and the ghost engine are attacked alike in the tests."""
    A, Y, x, xp = adversarial_rows(hidden=hidden, seed=seed)
    M, F = A.shape
    layout = ParameterLayout(("w1", "b1", "w2", "b2"), ((hidden, F), (hidden,), (1, hidden), (1,)))
    out: dict[str, dict[str, Any]] = {}
    for kind, prev in (("dpgd", None), ("diff2", xp)):
        for dtype, tdt, ndt in (("f32", torch.float32, np.float32), ("f64", torch.float64,
                                                                     np.float64)):
            first = peer.ask("clipping", x, prev, A, Y, np.full((1, M), np.inf), dtype)
            exact = [_exact_sq(first["a"][i], first["dd"][:, i], first["u"][:, i],
                               first["de"][i]) for i in range(M)]
            own = first["norm"].astype(ndt).astype(np.float64)
            true = np.array([math.sqrt(float(e)) for e in exact]).astype(ndt).astype(np.float64)
            radii = np.stack([own, true, (true * 0.5).astype(ndt).astype(np.float64)])
            got = peer.ask("clipping", x, prev, A, Y, radii, dtype)
            grads = PaperMLPGradients(layout, dtype=tdt)
            feats, targets = torch.as_tensor(A, dtype=tdt), torch.as_tensor(Y, dtype=tdt)
            peer_excess, ours_out, peer_out, checked = 0.0, 0, 0, 0
            for v in range(len(radii)):
                for i in range(M):
                    r = float(radii[v, i])
                    if not (r > 0 and math.isfinite(r)):
                        continue
                    checked += 1
                    r2 = Fraction(r) ** 2
                    clipped = Fraction(float(got["c"][v, i])) ** 2 * exact[i]
                    if clipped > r2:
                        peer_out += 1
                        peer_excess = max(peer_excess, math.sqrt(float(clipped / r2)) - 1)
                    total = grads._clipped_sum(x, feats[i:i + 1], targets[i:i + 1], r,
                                               prev)[0].numpy()
                    ours_out += _exact_sq(np.zeros(0), np.zeros(0), total, 0.0) > r2
            out[f"{kind}:{dtype}"] = {
                "peer": {"checked": checked, "outside": peer_out, "max_excess": peer_excess},
                "project": {"checked": checked, "outside": int(ours_out)}}
    return out


def jax_peer_section(plan: JaxPeerPlan, *, data_dir: str | None = None,
                     progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """``diff2 bench``'s ``jax_peer`` entry: :func:`run_jax_peer`'s result, or ``{"skipped":
    SKIPPED}`` and one line to ``progress`` when the plan found no interpreter with jax."""
    if plan.python is None:
        if progress:
            progress(f"jax_peer skipped: {SKIPPED}")
        return {"skipped": SKIPPED}
    return run_jax_peer(plan, data_dir=data_dir, progress=progress)
