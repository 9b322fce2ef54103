"""Interleaved A/B of two versions of the fused kernel's source on the jax_peer cells' rounds.

Both sources are built with fused.py's flags for one capability (AVX512, AVX2 or DEFAULT, the
x86-64 baseline) and loaded side by side in this process; each cell's round backend (as ``diff2
bench``'s ``backend_floor`` chooses it: California Housing, 10 clients, the paper MLP, K = 1 or 18
runs, float32 cells with float32 accumulation) runs R rounds with kernel A, then with B (B then A
in odd repetitions), timed in this thread's CPU time (on a core shared with another process only
this thread's share counts). Prints per cell the median seconds per round of each, the ratio of
the medians (B / A) and every repetition's ratio. ``--check`` first compares the two kernels' sums
round by round, bit for bit. DIFF2 cells time difference rounds between two iterates a small step
apart (lab/bench/floors.py).

    git show HEAD:diff2_flwr/core/fused_ghost.cpp > /tmp/old.cpp
    DIFF2_DATA_DIR=../shared/data taskset -c 1 .venv/bin/python benchmarks/kernel_ab.py \\
        /tmp/old.cpp diff2_flwr/core/fused_ghost.cpp --check \\
        [--dtype f64] [--cap AVX2] [--cells dpgd:1,diff2:18] [--reps 7]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diff2_flwr.core import fused  # noqa: E402
from diff2_flwr.lab.backend import Batch, choose_backend  # noqa: E402
from diff2_flwr.lab.bench.floors import STEP  # noqa: E402
from diff2_flwr.lab.bench.jax_cells import Cell, _Project  # noqa: E402, PLC2701
from diff2_flwr.lab.sweep import RunSpec, batch_model  # noqa: E402


def build(source: str, capability: str, into: Path) -> fused.FusedKernel:
    """The kernel built from ``source`` with fused.py's flags for ``capability``."""
    flags = list(fused.FLAGS) + list(fused.ISA.get(capability, ()))
    key = hashlib.sha256(Path(source).read_bytes() + " ".join(flags).encode()).hexdigest()[:16]
    out = into / f"kernel_{key}.so"
    if not out.exists():
        subprocess.run([fused._compiler() or "g++", *flags, source, "-o", str(out)], check=True)
    return fused.FusedKernel(out)


def main() -> None:
    """Parse the arguments, build both kernels, alternate them on each cell."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", help="kernel source A (the reference)")
    ap.add_argument("b", help="kernel source B")
    ap.add_argument("--cells", default="dpgd:1,diff2:1,dpgd:18,diff2:18", help="kind:K, ...")
    ap.add_argument("--dtype", default="f32", choices=("f32", "f64"))
    ap.add_argument("--cap", default="AVX512", choices=("AVX512", "AVX2", "DEFAULT"))
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--check", action="store_true",
                    help="compare the two kernels' sums bit for bit first")
    args = ap.parse_args()
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="kernel_ab_"))
    ka, kb = build(args.a, args.cap, work), build(args.b, args.cap, work)
    project = _Project(os.environ.get("DIFF2_DATA_DIR"), {1: 100, 18: 10})
    dtype = {"f32": torch.float32, "f64": torch.float64}[args.dtype]
    accumulate = {"f32": "float32", "f64": "float64"}[args.dtype]
    for name in args.cells.split(","):
        kind, K = name.split(":")
        runs = [RunSpec(*s) for s in project.specs(Cell(kind, int(K), args.dtype), 100)]
        mlp = batch_model(project.data, init_seed=runs[0].init_seed)[0]
        backend = choose_backend(mlp, Batch(project.data, dtype), len(runs), compile=True,
                                 accumulate=accumulate)
        x = torch.as_tensor(np.stack([project.x0[r.init_seed] for r in runs]))
        gen = torch.Generator().manual_seed(0)
        other = x + STEP * torch.randn(x.shape, generator=gen, dtype=torch.float64)
        diff = kind == "diff2"
        radius = torch.tensor([r.clip_diff if diff else r.clip_restart for r in runs],
                              dtype=torch.float64)
        every = torch.ones(len(runs), dtype=torch.bool)
        restart = ~every if diff else every
        rounds = 40 if len(runs) == 1 else 4

        def timed(kernel, keep_sums=False, *, backend=backend, x=x, other=other,  # noqa: PLR0913
                  radius=radius, every=every, restart=restart, diff=diff, rounds=rounds):
            backend.kernel = kernel
            backend.round(x, every, radius, train=False)
            sums = []
            t = time.thread_time()
            for r in range(rounds):
                out = backend.round(other if r % 2 == 0 else x, restart, radius, train=False,
                                    keep=diff)
                if keep_sums:
                    sums.append(out.sums.clone())
            return (time.thread_time() - t) / rounds, sums

        tag = f"{name} {args.dtype} {args.cap}"
        if args.check:
            sa, sb = timed(ka, True)[1], timed(kb, True)[1]
            same = all(torch.equal(p, q) for p, q in zip(sa, sb))
            print(f"{tag}: sums bit for bit equal over {rounds} rounds: {same}", flush=True)
        timed(ka), timed(kb)
        ta, tb = [], []
        for rep in range(args.reps):
            for kernel in ((ka, kb) if rep % 2 == 0 else (kb, ka)):
                (ta if kernel is ka else tb).append(timed(kernel)[0])
        ma, mb = statistics.median(ta), statistics.median(tb)
        each = " ".join(f"{b / a:.3f}" for a, b in zip(ta, tb))
        print(f"{tag}: A {ma * 1e3:.3f} ms, B {mb * 1e3:.3f} ms per round; B / A {mb / ma:.3f} "
              f"(repetitions: {each})", flush=True)


if __name__ == "__main__":
    main()
