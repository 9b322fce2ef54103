"""Measured floors of the batched engine for ``diff2 bench`` (issue 43): what a figure cannot beat
while the engine computes what it computes now.

The *backend floor* of a round is the batched engine's round backend alone
(:meth:`~diff2_flwr.lab.backend.RoundBackend.round`: the forward pass, the sound norms and clip
factors and the clipped sums — for a one-hidden-layer MLP, the fused kernel's calls), timed on its
own: none of the server's step (the radius plan, the noise, the update), the evaluation, the set-up
or the process around it. A ``run_batch`` call runs exactly these rounds and more, so its rate per
round is below the floor's; a figure whose floor already misses its target cannot meet it by
removing overhead, only by a faster kernel.

Difference rounds alternate between two iterates a small step apart (x and x + 10⁻³ ξ, ξ standard
normal with a fixed seed), as training moves: two equal consecutive iterates would send every
difference through the ghost identity's cancelling branch, a path real runs do not take each round.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any, Mapping

import torch

from ...core.ghost import MLP
from ...task.data import PreparedData
from ..backend import Batch, choose_backend

__all__ = ["backend_seconds_per_round", "protocol_floor"]

#: Size of the step between the two iterates a floor's difference rounds alternate between.
STEP = 1e-3


def backend_seconds_per_round(  # noqa: PLR0913 -- keyword-only: what the engine would be given
        data: PreparedData, mlp: MLP, x: torch.Tensor, *, dtype: torch.dtype, accumulate: str,
        difference: bool, radius: torch.Tensor | None = None, rounds: int = 10, reps: int = 3,
        compile: bool = True, backend: Any = None) -> float:
    """Median seconds of one round of the backend alone for the K runs at iterates ``x`` [K, d]
    (float64): plain-gradient rounds (DP-GD, GD, restarts), or with ``difference`` difference rounds
    after one restart. ``radius`` [K] float64 (default 1 for every run); ``rounds`` per timed
    repetition; ``backend`` (else chosen as ``run_batch`` chooses it, compiled): reuse one across
    calls. The first repetition's round is a warm-up and not timed."""
    K = x.shape[0]
    if backend is None:
        backend = choose_backend(mlp, Batch(data, dtype), K, compile=compile,
                                 accumulate=accumulate)
    radius = torch.ones(K, dtype=torch.float64) if radius is None else radius
    gen = torch.Generator().manual_seed(0)
    other = x + STEP * torch.randn(x.shape, generator=gen, dtype=torch.float64)
    every, none = torch.ones(K, dtype=torch.bool), torch.zeros(K, dtype=torch.bool)
    restart = none if difference else every
    backend.round(x, every, radius, train=False)  # warm-up, and the pass difference rounds read
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for r in range(rounds):
            backend.round(other if r % 2 == 0 else x, restart, radius, train=False,
                          keep=difference)
        times.append((time.perf_counter() - t) / rounds)
    return statistics.median(times)


def protocol_floor(records: list[Mapping[str, Any]], rounds: int, batch_size: int, workers: int,
                   cores: int, seconds: Mapping[str, float]) -> dict[str, Any]:
    """A lower bound on a batched study's wall time from its runs' backend rounds alone.

    ``records``: the study's run files (their ``base_method`` and ``point``); ``seconds``: the
    backend floor's seconds per round of ``batch_size`` runs, for ``"restart"`` (plain-gradient)
    and ``"difference"`` rounds. Every run's rounds are counted by kind (GD and DP-GD restart every
    round, DIFF2 every T-th); a configuration-round costs its kind's seconds / ``batch_size`` (the
    study's largest batch, where a round's cost per run is lowest), spread perfectly over ``min
    (workers, cores)`` processes."""
    restarts = differences = 0
    for record in records:
        T = int(record["point"].get("restart_every", 1)) if record["base_method"] == "diff2" else 1
        r = math.ceil(rounds / T)
        restarts, differences = restarts + r, differences + rounds - r
    cores_used = max(1, min(workers, cores))
    per_run = {kind: s / batch_size for kind, s in seconds.items()}
    floor = (restarts * per_run["restart"] + differences * per_run["difference"]) / cores_used
    return {"runs": len(records), "restart_configuration_rounds": restarts,
            "difference_configuration_rounds": differences, "batch_size": batch_size,
            "cores": cores_used,
            "ms_per_configuration_round": {k: v * 1e3 for k, v in per_run.items()},
            "floor_s": floor}
