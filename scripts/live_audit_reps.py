"""Repetitions of the live canary audit (docs/checks.md, "A live run, audited by a data owner"):
one JSON line per run.

    .venv/bin/python scripts/live_audit_reps.py [CONFIG] --canaries 64 --scales 1,0.7,0.5 --seeds
    101-120 .venv/bin/python scripts/live_audit_reps.py --fraction CONFIG...   # the updates'
    projections against the noise

Each run: the production server of CONFIG (default: the results' synthetic schedule, 100 rounds)
adding `scale` times the calibrated noise, 3 owners through the real Diff2Client and NodeGuard
(tests/test_audit_live.py's harness), owner 0 holding the canaries with a fresh secret frame; then
`live_audit` of its folder. Run from the checkout.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_audit_live import config, run  # noqa: E402

from diff2_flwr.lab.audit.live import live_audit  # noqa: E402
from diff2_flwr.runtime.compute import pinned_threads  # noqa: E402
from diff2_flwr.runtime.config import load_config  # noqa: E402
from diff2_flwr.runtime.session import build_server, build_worker  # noqa: E402


def _seeds(text: str) -> list[int]:
    lo, _, hi = text.partition("-")
    return list(range(int(lo), int(hi) + 1)) if hi else [int(x) for x in text.split(",")]


def fraction(path: str) -> dict:
    """One run of CONFIG (no canaries): per round, the run's own update projected on a random unit
    direction, ‖update‖/√d, against the noise std along it; and the μ an optimal random-direction
    canary reaches over the calibrated μ, were those projections Gaussian noise of that size."""
    cfg = load_config(path)
    cfg = cfg.with_clients(3, "live_audit_reps") if cfg.clients_auto else cfg
    rows = []
    with pinned_threads(cfg.training.threads):
        server = build_server(cfg, record=False, progress=None)
        workers = [build_worker(cfg, p) for p in range(cfg.clients)]
        n_min, clients, d = server.n_min, server.clients, server.layout.dim
        while not server.done:
            plan = server.plan()
            replies = [w.reply(plan) for w in workers]
            update = np.mean([server.layout.flatten(r.arrays) for r in replies], axis=0)
            server.release(replies)
            if plan.radius > 0 and math.isfinite(plan.radius):
                rows.append((plan.radius, plan.noise_std, float(np.linalg.norm(update))))
    claimed = sum((2 * c / (n_min * clients * s)) ** 2 for c, s, _ in rows)
    reached = sum((2 * c / (n_min * clients)) ** 2 / (s**2 + a**2 / d) for c, s, a in rows)
    return {"config": path, "d": d, "rounds": len(rows),
            "median_update_projection_over_noise": float(np.median([a / math.sqrt(d) / s for _, s,
                                                                    a in rows])),
            "fraction_of_calibrated_mu": math.sqrt(reached / claimed)}


def main() -> int:
    """Print one JSON line per (noise scale, seed): the live audit of a run with canaries, scored
    from its folder (``--fraction``: instead :func:`fraction` of each config); 0."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default=None,
                        help="an experiment YAML (default: the results' schedule)")
    parser.add_argument("--canaries", type=int, default=64)
    parser.add_argument("--scales", default="1,0.7,0.5")
    parser.add_argument("--seeds", default="101-120", help="training.seed values: 'a-b' or 'a,b,c'")
    parser.add_argument("--fraction", nargs="+", metavar="CONFIG", default=None,
                        help="instead: how far the runs' own updates along random directions are "
                             "above the noise")
    args = parser.parse_args()
    if args.fraction:
        for path in args.fraction:
            print(json.dumps(fraction(path)), flush=True)
        return 0
    for scale in (float(x) for x in args.scales.split(",")):
        for seed in _seeds(args.seeds):
            if args.config is None:
                cfg = config(rounds=100, restart_every=10, seed=seed)
                cfg = dataclasses.replace(cfg, dataset=dataclasses.replace(cfg.dataset,
                                                                           num_samples=10000))
            else:
                cfg = load_config(args.config)
                cfg = cfg.with_clients(3, "live_audit_reps") if cfg.clients_auto else cfg
                cfg = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training,
                                                                            seed=seed),
                                          evaluation=dataclasses.replace(cfg.evaluation,
                                                                         test_metrics=False,
                                                                         train_metrics=False))
            start = time.monotonic()
            folder, _ = run(Path(tempfile.mkdtemp(prefix="live-audit-")), scale,
                            count=args.canaries, cfg=cfg)
            r = live_audit(folder)
            print(json.dumps({"scale": scale, "seed": seed, "canaries": args.canaries,
                              "rounds_scored": r["rounds"]["scored"],
                              "k_hat": r["noise_scale"]["estimate"],
                              "k_upper": r["noise_scale"]["upper"], "mu": r["mu"],
                              "mu_interval": r["mu_interval"],
                              "mu_if_calibrated": r["mu_if_calibrated"],
                              "violation": r["violation"],
                              "seconds": round(time.monotonic() - start, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
