"""What a run costs in per-sample gradient evaluations (the paper's unit of computation).

Round r of DIFF2 (Algorithm 1) evaluates every training sample's gradient once at x_{r-1} if it
restarts ((r - 1) mod T = 0) and at both x_{r-1} and x_{r-2} otherwise: n or 2n evaluations, n the
number of training samples over all clients. DP-GD and GD are T = 1: n per round. The private
local routine (BVR-L-SGD, :mod:`~diff2_flwr.core.local`) adds K - 1 steps on one worker, each with
the gradients of its minibatch I_k at y_k and y_{k-1}: 2|I_k| evaluations, and E|I_k| = b under
Poisson sampling with probability b/n_p, so 2b(K - 1) expected per round.

These are the algorithm's counts, whatever an engine saves by caching (the batched engine keeps
the pass at x_{r-2} from the previous round; an evaluation pass for the metrics is not counted).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["gradient_evaluations", "round_evaluations"]


def round_evaluations(r: int, restart_every: int, n: int, local_steps: int = 1,
                      local_batch: int = 0) -> float:
    """Expected per-sample gradient evaluations of round r (r >= 1)."""
    if r < 1 or restart_every < 1 or n < 0 or local_steps < 1 or local_batch < 0:
        raise ValueError(f"round_evaluations: expected r >= 1, T >= 1, n >= 0, K >= 1, b >= 0. "
                         f"Found r={r}, T={restart_every}, n={n}, K={local_steps}, "
                         f"b={local_batch}.")
    server = n if (r - 1) % restart_every == 0 else 2 * n
    return float(server + 2 * local_batch * (local_steps - 1))


def gradient_evaluations(*, rounds: int, restart_every: int, n: int, local_steps: int = 1,
                         local_batch: int = 0, at: Sequence[int] | None = None) -> np.ndarray:
    """Cumulative expected evaluations after r rounds, for every r in ``at`` (default 0 … rounds); 0
    at r = 0.

    ``local_steps`` is K (K - 1 local steps per round; 1: no local routine), ``local_batch`` b.
    """
    per_round = np.array([0.0] + [round_evaluations(r, restart_every, n, local_steps, local_batch)
                                  for r in range(1, rounds + 1)])
    total = np.cumsum(per_round)
    at_idx = np.arange(rounds + 1) if at is None else np.asarray(at, dtype=int)
    if at_idx.size and (at_idx.min() < 0 or at_idx.max() > rounds):
        raise ValueError(
            f"gradient_evaluations: rounds to report must lie in 0 … {rounds}. Found "
            f"{at_idx.tolist()}.")
    return total[at_idx]
