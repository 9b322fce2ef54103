"""The trusted server of a DIFF2 run from plain arguments (the Python API; the YAML path ends here
too): :func:`make_server` takes a validated experiment, x_0 (a model or per-tensor arrays, see
:func:`initial_point`) and what the server writes (run folder, checkpoint), and says the warnings of
the server's own settings. Importable from :mod:`diff2_flwr.runtime.session` as well.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from ..core.layout import ParameterLayout
from ..core.privacy import Calibration
from .checkpoint import Checkpoint, config_fingerprint, legacy_config_fingerprint, load_checkpoint
from .config import ConfigError, ExperimentConfig, argument_error
from .outputs import RunRecorder, new_run_dir
from .journal import Journal
from .noise_report import noise_summary
from .server import Diff2Server
from .server_core import ServerSpec, check_planned_budget
from .step_report import gain_warning, names_of, step_gain

__all__ = ["CLIP_STATS_WARNING", "SEED_WARNING", "initial_point", "make_server"]


CLIP_STATS_WARNING = (
    "evaluation.clip_stats is on: each round's clip_fraction (the share of the private training "
    "records whose gradient or gradient difference was clipped) is counted on the private data "
    "without noise; it leaks and is NOT covered by ε. Research only: set evaluation.clip_stats: "
    "false for anything deployed.")


SEED_WARNING = (
    "training.seed is set, so the noise is reproducible by anyone who knows the seed; use seeds "
    "for research only. The seed is the noise key: whoever knows it (from the config, the run "
    "config, the summary or the checkpoint) can subtract the noise from the released iterates.")


def initial_point(function: str, model: torch.nn.Module | None,
                   initial_parameters: Sequence[np.ndarray] | None) -> tuple[ParameterLayout,
                                                                             np.ndarray]:
    """x_0 and its layout from a model (its trainable parameters) or from per-tensor arrays."""
    if (model is None) == (initial_parameters is None):
        raise ConfigError(
            f"{function}: give exactly one of `model` (a torch.nn.Module: x_0 is its parameters) "
            f"and "
                          "`initial_parameters` (x_0 as a list of arrays, one per model tensor). "
                          "Found "
                          f"{'both' if model is not None else 'neither'}.")
    if model is not None:
        if not isinstance(model, torch.nn.Module):
            raise argument_error(function, "model", "a torch.nn.Module", type(model).__name__)
        layout = ParameterLayout.of(model)
        tensors = [p for _, p in model.named_parameters() if p.requires_grad]
        x0 = np.concatenate([p.detach().to(torch.float64).reshape(-1).numpy()
                             for p in tensors]) if tensors else np.zeros(0)
    else:
        try:
            arrays = [np.asarray(a) for a in initial_parameters]  # type: ignore[union-attr]
        except TypeError:
            raise argument_error(function, "initial_parameters",
                                 "a list of numpy arrays (one per model tensor)",
                                  type(initial_parameters).__name__) from None
        if not all(np.issubdtype(a.dtype, np.floating) for a in arrays):
            raise argument_error(function, "initial_parameters", "floating-point arrays",
                                  [str(a.dtype) for a in arrays])
        layout = ParameterLayout(tuple(f"parameter_{i}" for i in range(len(arrays))),
                                 tuple(a.shape for a in arrays))
        x0 = layout.flatten(arrays)
    if layout.dim == 0:
        raise ConfigError(
            f"{function}: the model has no trainable parameters: there is nothing to train.")
    if not np.all(np.isfinite(x0)):
        raise ConfigError(
            f"{function}: x_0 (the initial parameters) has non-finite entries; initialise the "
            f"model "
                          "with finite values.")
    return layout, x0


def make_server(  # noqa: PLR0913 -- the Python API's options, keyword-only, documented below
    spec: ExperimentConfig,
    *,
    model: torch.nn.Module | None = None,
    initial_parameters: Sequence[np.ndarray] | None = None,
    evaluate_fn: Callable[[list[np.ndarray]], Mapping[str, float]] | None = None,
    output_dir: str | Path | None = None,
    checkpoint: str | Path | None = None,
    progress: Callable[[str], None] | None = print,
    run_info: Mapping[str, Any] | None = None,
    source: str = "diff2_flwr.make_server",
    section: str = "",
) -> Diff2Server:
    """The trusted server of a DIFF2 run of ``spec`` (validated:
    :func:`~diff2_flwr.runtime.config.from_arguments` on the Python API's path, the experiment file
    on the YAML path); x_0 and what the server writes are given here.

    ``spec.privacy.n_min`` is the fewest records any client holds: the noise is calibrated for it
    and every reply with fewer is refused. x_0 is ``model``'s trainable parameters or
    ``initial_parameters`` (one array per tensor). ``evaluate_fn(arrays) -> {metric: value}``
    evaluates each released iterate (every ``evaluation.every`` rounds, and always rounds 0 and R).
    With ``output_dir`` each round's row and a summary go into a new folder
    ``output_dir/<spec.name>-<time>-<random>``. With ``checkpoint`` the server's state is durable
    after every round, and an existing checkpoint of the same run is resumed. ``run_info``: extra
    fields of the summary; its ``"config"`` (the experiment file, on the YAML path) also identifies
    the run for a checkpoint. Errors name ``source`` and the budget's keys with ``section``
    (``"privacy."`` on the YAML path).

    References:
        Murata & Suzuki (2023), Algorithm 1 (server lines); Theorem 4.1 (the noise for (ε, δ)).
    """
    _check_server_arguments(spec, source, evaluate_fn)
    layout, x0 = initial_point(source, model, initial_parameters)
    n_min = spec.privacy.n_min
    server_spec = ServerSpec.of(spec, layout=layout, n_min=n_min)
    if server_spec.calibration is not None:
        check_planned_budget(server_spec.calibration, source, section)
    evaluator = None
    if evaluate_fn is not None:
        def evaluator(x: np.ndarray) -> dict[str, float]:
            return {str(k): float(v) for k, v in evaluate_fn(layout.split(x)).items()}

    info = dict(run_info or {})
    info.setdefault("name", spec.name)
    info.setdefault("method", spec.method)
    described = info.get("config") or spec.to_dict()
    x0_hash = hashlib.sha256(x0.tobytes()).hexdigest()
    fingerprint, legacy = (hashlib.sha256((rule(described, n_min) + x0_hash).encode()).hexdigest()
                           for rule in (config_fingerprint, legacy_config_fingerprint))
    checkpoint_path = Path(checkpoint).expanduser().resolve() if checkpoint else None
    resume = None
    if checkpoint_path is not None and checkpoint_path.exists():
        resume = load_checkpoint(checkpoint_path, fingerprint, legacy_fingerprint=legacy,
                                 routine=server_spec.routine, x0=x0)
    recorder = _recorder(output_dir, spec.name, resume, info, progress)
    warnings = _announce(spec, server_spec.calibration, progress)
    warnings += _predict_feedback(server_spec, info, progress)
    if warnings:
        info["warnings"] = [*info.get("warnings", ()), *warnings]
    journal = Journal.of(server_spec, evaluator=evaluator, recorder=recorder, run_info=info,
                         progress=progress, checkpoint_path=checkpoint_path,
                         fingerprint=fingerprint)
    return Diff2Server(server_spec, journal, x0=x0, seed=spec.training.seed, resume=resume)


def _check_server_arguments(spec: ExperimentConfig, source: str, evaluate_fn: Any) -> None:
    """What :func:`make_server` needs beyond a valid experiment: n_min, a callable."""
    if spec.privacy.n_min is None:
        raise argument_error(source, "n_min",
                             "an integer >= 1 (the fewest records any client holds; the noise "
                             "is calibrated for it)", None)
    if evaluate_fn is not None and not callable(evaluate_fn):
        raise argument_error(source, "evaluate_fn",
                             "None or a callable evaluate_fn(arrays) -> {metric: value}",
                             type(evaluate_fn).__name__)


def _recorder(output_dir: str | Path | None, name: str, resume: Checkpoint | None, info: dict[str,
                                                                                              Any],
              progress: Callable[[str], None] | None) -> RunRecorder | None:
    """The run folder's writer (None without ``output_dir``); a resumed run continues in its own
    folder."""
    if output_dir is None:
        return None
    if resume is not None and resume.run_dir:
        run_dir = Path(resume.run_dir)
        recorder = RunRecorder(run_dir, keep_through_round=resume.state.round)
    else:
        run_dir = new_run_dir(output_dir, name)
        recorder = RunRecorder(run_dir)
    info["output_dir"] = str(run_dir)
    if progress:
        progress(f"[diff2] writing per-round metrics and summary to {run_dir}")
    return recorder


def _predict_feedback(spec: ServerSpec, info: dict[str, Any],
                      progress: Callable[[str], None] | None) -> list[str]:
    """Before the run, from the spec alone: the noise estimate for the summary
    (``noise_to_radius``, when the YAML path's pre-flight did not give it) and the step's gain g
    against its own noise (``radius_feedback``; :mod:`~diff2_flwr.runtime.step_report`), said when
    it exceeds the limit, with the settings named as the caller gave them. Returns the warning."""
    if spec.calibration is None:
        return []
    info.setdefault("noise_to_radius", noise_summary(spec.calibration, spec.layout.dim))
    gain = step_gain(spec.calibration, spec.routine, spec.mechanism.clip_diff, spec.layout.dim,
                     local=spec.local is not None)
    if gain is None:
        return []
    info["radius_feedback"] = gain.as_dict()
    warning = gain_warning(gain, names_of(spec.settings))
    if warning is None:
        return []
    if progress:
        progress(f"[diff2] WARNING: {warning}")
    return [warning]


def _announce(spec: ExperimentConfig, calibration: Calibration | None,
              progress: Callable[[str], None] | None) -> list[str]:
    """Say where the noise key comes from, and return (and say) the warnings of the server's own
    settings: clip statistics released (outside ε), a seeded noise key (the seed is the key). They
    go into the summary too."""
    warnings = [CLIP_STATS_WARNING] if spec.evaluation.clip_stats else []
    if calibration is not None and spec.training.seed is not None:
        warnings.append(SEED_WARNING)
    if progress and calibration is not None and spec.training.seed is None:
        progress(
            "[diff2] noise key drawn from OS entropy (no training.seed): the noise is not "
            "reproducible.")
    for warning in warnings:
        if progress:
            progress(f"[diff2] WARNING: {warning}")
    return warnings
