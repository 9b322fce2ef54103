"""The Python API: DIFF2 in your own Flower app, as one strategy and one client.

:func:`make_strategy` builds the Flower ``Strategy`` from the privacy budget, the schedule and
x_0 (a model or its arrays); :func:`make_client` builds the Flower ``NumPyClient`` of one data
owner from a model, a per-sample loss and its records. Both validate every argument at once with
the experiment file's checks and messages (the keyword arguments are named as its keys), and
both are thin: the YAML path builds the same server and worker with the same runtime functions
(:func:`~diff2_flwr.runtime.session.make_server`, :func:`~diff2_flwr.runtime.session.make_worker`).

Example (a ServerApp and a ClientApp; see docs/tutorials/own-model-and-data.md)::

    strategy = diff2_flwr.make_strategy(epsilon=3.0, delta=1e-5, rounds=20, restart_every=5,
    clients=3,
                                        n_min=200, clip_restart=1.0, clip_diff=3.0,
                                        learning_rate=0.2, model=make_model(), seed=None)
    client = diff2_flwr.make_client(model=make_model(), loss=per_sample_loss, data=dataset,
    partition_id=0)

References:
    Murata & Suzuki (2023), "DIFF2: Differential Private Optimization via Gradient Differences for
    Nonconvex Distributed Learning", Algorithm 1.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
from flwr.common import Parameters, parameters_to_ndarrays

from .core.gradients import LossFn
from .core.memory import MemoryRefusal
from .fl.client import Diff2Client
from .fl.secagg import run_secure, secure_sum_mod
from .fl.strategy import Diff2Strategy
from .runtime.config import experiment_from_arguments
from .runtime.policy import Refused
from .runtime.preflight_checks import preflight_strategy
from .runtime.session import make_server, make_worker
from .runtime.spec import argument_error

__all__ = ["make_strategy", "make_client", "run_secure", "secure_sum_mod"]

#: make_strategy's arguments that set no key of the experiment: x_0, callables, where the run
#: writes, the Strategy's patience. Every other argument is a setting, validated and named by its
#: declaration (:func:`~diff2_flwr.runtime.spec.argument_names`): a new setting is a new keyword
#: argument, no new plumbing.
_NOT_SETTINGS = frozenset({"model", "initial_parameters", "evaluate_fn", "output_dir", "checkpoint",
                           "progress",
                           "wait_for_clients_s"})

#: The declared settings that are not make_strategy arguments, and why (a key ending in "." stands
#: for its section). Both ways are checked (tests/test_wiring.py): every other declared setting is
#: an argument, every argument but :data:`_NOT_SETTINGS` a declared setting; a new setting fails
#: that test until it is one or is listed here.
NOT_ARGUMENTS: dict[str, str] = {
    "method": "make_strategy runs DIFF2 (restart_every=1 is DP-GD)",
    "dataset.": "the records are the clients' (make_client's `data`)",
    "model.": "x_0 is the `model` or `initial_parameters` argument; the loss is make_client's",
    "output.": "the `output_dir` and `checkpoint` arguments",
    "evaluation.train_metrics": "the server evaluates with `evaluate_fn`, on data it may see",
    "evaluation.test_metrics": "the server evaluates with `evaluate_fn`, on data it may see",
    "training.routine.": "the `routine` argument takes the whole section",
    "training.schedule.": "the `schedule` argument takes the whole section",
    "training.dtype": "the clients' compute (make_client's `dtype`)",
    "training.chunk_size": "the clients' compute (make_client's `chunk_size`)",
    "training.gradients": "the clients' compute (make_client's `gradients`)",
    "training.memory_budget_mb": "the clients' compute (make_client's `memory_budget_mb`)",
    "training.device": "the clients' compute (make_client's `device`)",
    "training.threads": "the caller's process (pin it before starting Flower)",
    "training.round_timeout_s": "Flower's ServerConfig(round_timeout=...)",
}


def make_strategy(  # noqa: PLR0913 -- public API: keyword arguments mirror the declared settings
    *,
    epsilon: float,
    delta: float,
    rounds: int,
    restart_every: int,
    clients: int,
    n_min: int,
    clip_restart: float,
    clip_diff: float,
    learning_rate: float,
    routine: str | Mapping[str, Any] = "gd",
    schedule: str | Mapping[str, Any] = "constant",
    model: torch.nn.Module | None = None,
    initial_parameters: Sequence[np.ndarray] | Parameters | None = None,
    u: float = 1.25,
    max_sigma: float | None = 1.0,
    mode: str = "exact",
    seed: int | None = None,
    evaluate_fn: Callable[[list[np.ndarray]], Mapping[str, float]] | None = None,
    eval_every: int = 1,
    output_dir: str | Path | None = None,
    name: str = "diff2",
    checkpoint: str | Path | None = None,
    round_retries: int = 0,
    wait_for_clients_s: int = 300,
    local_steps: int = 0,
    local_batch_size: int = 64,
    local_clip: float = 1.0,
    local_share: float = 0.5,
    clip_stats: bool = False,
    noise: str = "central",
    bits: int = 20,
    tolerated: int = 0,
    wrap: float = 1e-6,
    sampling: str = "none",
    sampling_rate: float | None = None,
    sampling_size: int | None = None,
    progress: Callable[[str], None] | None = print,
) -> Diff2Strategy:
    """A Flower ``Strategy`` that runs DIFF2 with (ε, δ)-DP for ``rounds`` rounds over all
    ``clients``.

    Args:
        epsilon, delta: the privacy budget of the whole run (record-level, replace-one, central DP).
        rounds: R, the number of rounds; the ServerApp runs ``strategy.num_rounds`` Flower rounds.
        restart_every: T; a restart round every T rounds, difference rounds between (1: DP-GD).
        clients: P; every round needs exactly P clients, each replying once (else nothing is
            released).
        n_min: the fewest records any client holds; the noise is calibrated for it, and a reply with
            fewer records is refused.
        clip_restart, clip_diff: C₁ and C₂, the clipping radii of restart and difference rounds.
        learning_rate: η of the routine's step.
        routine: how x_r is computed from the released ṽ_r: "gd" (x_r = x_{r-1} - η ṽ_r), or a
            name or mapping as the experiment file's ``training.routine`` ("momentum", "nesterov",
            "adam", "adamw", e.g. ``{"name": "adam", "beta1": 0.9}``). Post-processing: no privacy
            cost.
        schedule: the step-size schedule s(r), round r stepping with η·s(r): "constant" (s = 1),
            or a name or mapping as the experiment file's ``training.schedule`` ("step", "cosine",
            "inverse_sqrt", e.g. ``{"name": "step", "decay": 0.5, "every": 500}``).
            Post-processing: no privacy cost.
        model, initial_parameters: x₀, exactly one of them: a ``torch.nn.Module`` (its trainable
            parameters) or one array per tensor (a list, or Flower ``Parameters``).
        u: the paper's u > 1 (noise split between restart and difference rounds; 1.25 in the paper).
        max_sigma: refuse a budget whose noise std per coordinate, σ₁ or σ₂ in clipping radii,
            exceeds this (the noise would drown any signal; the (ε, δ) guarantee holds either
            way); None: no limit. As the experiment file's ``privacy.max_sigma``.
        mode: "exact" (GDP composition, the paper's Theorem) or "rdp".
        seed: an integer makes the noise reproducible (research only); None draws it from the OS.
        evaluate_fn: ``evaluate_fn(arrays) -> {metric: value}`` on each released iterate (every
            ``eval_every`` rounds and always rounds 0 and R), on data the server may see.
        output_dir: if given, per-round metrics and a summary go to a new folder under it
            (``name``-…).
        checkpoint: if given, a file of the server's state, durable after every round; an existing
            checkpoint of the same run is resumed.
        round_retries: rounds whose clients failed are retried (releasing nothing) this many
            times in all.
        wait_for_clients_s: how long each round waits for all P clients to connect.
        local_steps, local_batch_size, local_clip, local_share: DIFF2's private BVR-L-SGD local
            routine, as the experiment file's ``local.*`` (0 steps: off;
            docs/how-to/local-routine.md). Each round then takes two Flower rounds: all P clients,
            then the one drawn for the K - 1 local steps.
        clip_stats: release each round's ``clip_fraction`` (the share of records clipped) in the
            history, metrics and progress lines. Off by default: it is counted on the private data
            without noise, is not covered by ε, and is announced with a warning when on.
        noise, bits, tolerated, wrap: who adds the noise, as the experiment file's
            ``privacy.*``: "central" (this server, trusted with each client's clipped mean) or
            "distributed" (each client adds a Skellam share and this server decodes only their
            SecAgg+ sum; ``bits`` per coordinate, t = ``tolerated`` clients may drop out or collude,
            ``wrap`` bounds a round's wrap-around probability). With "distributed" the ServerApp
            runs the rounds with :func:`diff2_flwr.run_secure` and every ClientApp has
            :func:`diff2_flwr.secure_sum_mod` and a :func:`make_client` given the same
            ``distributed`` settings.
        sampling, sampling_rate, sampling_size: client sampling, as the experiment file's
            ``training.sampling``: "none" (every round asks all P clients), "poisson" (each client
            with probability ``sampling_rate``) or "fixed" (``sampling_size`` clients without
            replacement); the round's sum is divided by the expected cohort and the noise is
            calibrated for sampled rounds (docs/explanation/algorithm.md). The strategy asks each
            node once which partition it holds (``get_properties``, answered by
            :func:`make_client`'s client). Not with the local routine or distributed noise.
        progress: where progress lines go (None: silent).

    Returns:
        A :class:`~diff2_flwr.fl.strategy.Diff2Strategy`; give
            ``ServerConfig(num_rounds=strategy.num_rounds)``.

    Raises:
        ConfigError: an argument is invalid (the message names it, what was expected and what
            was found), or the schedule cannot meet the budget.
    """
    given = dict(locals())  # first: the keyword arguments as called, and nothing else
    function = "diff2_flwr.make_strategy"
    spec = experiment_from_arguments(function, {k: v for k,
                                                v in given.items() if k not in _NOT_SETTINGS},
                                     method="diff2")
    if isinstance(initial_parameters, Parameters):
        initial_parameters = parameters_to_ndarrays(initial_parameters)
    # the YAML path's pre-flight, as far as the arguments allow: before any Flower round
    preflight_strategy(spec, model, initial_parameters, function, progress)
    # round_retries is the Strategy's: left out of the server's spec (and so of a checkpoint's
    # fingerprint), so that a resumed run may retry more or less than the run it resumes.
    server_spec = dataclasses.replace(spec, training=dataclasses.replace(spec.training,
                                                                         round_retries=0))
    server = make_server(server_spec, model=model, initial_parameters=initial_parameters,
                         evaluate_fn=evaluate_fn, output_dir=output_dir, checkpoint=checkpoint,
                         progress=progress, source=function)
    return Diff2Strategy(server=server, round_retries=spec.training.round_retries,
                         wait_for_clients_s=wait_for_clients_s)


def make_client(  # noqa: PLR0913 -- public API: keyword-only, one argument per client setting
    *,
    model: torch.nn.Module,
    loss: LossFn | str,
    data: Any,
    partition_id: int,
    dtype: str = "auto",
    chunk_size: int | str = "auto",
    gradients: str = "auto",
    memory_budget_mb: float | str = "auto",
    device: str = "cpu",
    distributed: Mapping[str, Any] | None = None,
    seed: int | None = None,
    n_min: int | None = None,
) -> Diff2Client:
    """A Flower ``NumPyClient`` for one data owner: ClippedMean of its per-sample gradients
    (differences).

    Args:
        model: the same architecture as the server's x₀ (copied; its values come from the server
            each round). Modules that mix the samples of a batch (batch-norm) are refused.
        loss: ``loss(output[n, ...], target[n]) -> losses[n]``, one loss per record (no
            reduction), or "half_squared_error" / "cross_entropy".
        data: this client's records: ``(features, targets)`` tensors or arrays, or a map-style torch
            ``Dataset`` of ``(features, target)`` pairs (read ``chunk_size`` records at a time,
            every record once per round; pass ``loader.dataset``, not a DataLoader).
        partition_id: this client's number (in replies and error messages).
        dtype: the compute dtype of the per-sample gradients: "auto" (float64 for the paper MLP,
            float32 for any other model), "float64" or "float32" (norms, clip factors and sums are
            float64 whatever it is).
        chunk_size: samples per pass of per-sample work: "auto" (the most, up to 1024, whose
            measured memory fits ``memory_budget_mb``, per round kind) or a number (checked
            against the budget).
        memory_budget_mb: MiB this client's per-sample work may take on top of its model and
            records: "auto" (half of the machine's memory over the workers computing on it at once,
            at most 80% of what is available) or a number. A model of which one sample does not
            fit is refused on the first records, before any round.
        device: where the per-sample work runs: "cpu", "cuda", "cuda:N" or "auto" (the first
            GPU torch sees, else the CPU). The model moves there; the records stay in host memory
            and each pass's samples are copied over.
        gradients: "auto" (the paper MLP: closed form with ½-squared error, else ``torch.func``;
            any other model: "ghost", or ``torch.func`` where ghost's first-call check refuses
            it), "torch_func", "closed_form", or "ghost" (norms and clipped sums per layer without
            per-sample gradients; ``torch.func`` for parameters no rule covers).
        distributed: for a strategy with ``noise="distributed"``: the same run settings as its
            :func:`make_strategy` call, from which this client computes its own noise share:
            ``epsilon``, ``delta``, ``rounds``, ``restart_every``, ``clients`` and optionally ``u``,
            ``bits``, ``tolerated``, ``wrap`` (its defaults). None: central noise (the reply is the
            clipped mean).
        seed: with ``distributed``, reproducible noise shares from (seed, partition, round)
            (tests only; None: OS entropy).
        n_min: the strategy's ``n_min`` (its noise is calibrated for clients holding at least
            that many records): given, a client holding fewer is refused here, at once, instead of
            by the server at round 1. None: the server's check only.

    Returns:
        A :class:`~diff2_flwr.fl.client.Diff2Client`; a ClientApp's ``client_fn`` returns
            ``.to_client()`` of it.

    Raises:
        ConfigError, ValueError: an argument is invalid (the message names it and says what to do).
    """
    function = "diff2_flwr.make_client"
    noise = None if distributed is None else _distributed_settings(function, distributed)
    if n_min is not None and (not isinstance(n_min, int) or isinstance(n_min, bool) or n_min < 1):
        raise argument_error(function, "n_min", "None or an integer >= 1 (the strategy's n_min)",
                             n_min)
    try:
        worker = make_worker(model=model, loss=loss, data=data, partition_id=partition_id,
                             dtype=dtype, chunk_size=chunk_size, gradients=gradients,
                             memory_budget_mb=memory_budget_mb, device=device,
                             _function=function)
    except MemoryRefusal as err:  # in a ClientApp: the server shows it as one line
        raise Refused(f"node of partition {partition_id}", "training.memory_budget_mb",
                      str(err)) from None
    if n_min is not None and worker.num_samples < n_min:
        raise argument_error(
            function, "data", f"at least n_min = {n_min} records (partition {partition_id}): the "
            "noise is calibrated for clients holding n_min or more, and the server refuses a reply "
            "from fewer; lower the strategy's n_min to the smallest client's count",
            f"{worker.num_samples} records")
    return Diff2Client(worker, noise=noise, seed=seed, partition_id=partition_id)


_DISTRIBUTED_REQUIRED = ("epsilon", "delta", "rounds", "restart_every", "clients")
_DISTRIBUTED_OPTIONAL = ("u", "bits", "tolerated", "wrap")


def _distributed_settings(function: str, given: Mapping[str, Any]) -> Callable[[int, int], Any]:
    """``make_client(distributed=...)``: the run's settings checked as the strategy's are (by the
    experiment file's checks, named as the caller wrote them); the client's ``noise(n_min,
    dim)``."""
    if not isinstance(given,
                      Mapping) or set(given) - set(_DISTRIBUTED_REQUIRED + _DISTRIBUTED_OPTIONAL):
        raise argument_error(function, "distributed", "a mapping of the strategy's " + ", ".join(
            _DISTRIBUTED_REQUIRED + _DISTRIBUTED_OPTIONAL), given)
    missing = [k for k in _DISTRIBUTED_REQUIRED if k not in given]
    if missing:
        raise argument_error(function, "distributed",
                             f"the strategy's {', '.join(missing)} as well", dict(given))
    spec = experiment_from_arguments(function, {**given, "noise": "distributed", "n_min": 1,
                                                "clip_restart": 1.0,
                                                "clip_diff": 1.0, "learning_rate": 1.0},
                                                method="diff2")
    return functools.lru_cache(maxsize=8)(spec.distributed_noise)
