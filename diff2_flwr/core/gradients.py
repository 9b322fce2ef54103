"""Per-sample gradients and their clipped means, for any ``torch.nn.Module`` without batch-norm.

Per-sample gradients come from ``torch.func``: ``vmap(grad(loss of one sample))`` over a
chunk of samples, with the parameters passed through ``functional_call``. Chunks bound the
memory to ``chunk_size × d`` numbers; with a memory budget (:mod:`.memory`) each round kind's
pass size is the most samples whose measured pass fits it (or a fixed chunk is checked against
it), planned on the first records before any round is computed. A worker's contribution is
ClippedMean of the per-sample gradients (restart rounds) or of per-sample gradient differences
∇ℓ(x_{r-1}, z) - ∇ℓ(x_{r-2}, z) (difference rounds).

References:
    Murata & Suzuki (2023), Algorithm 1, worker lines; Algorithm 2 (ClippedMean).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np
import torch
from torch.func import functional_call, grad, vmap

from .clipping import ClippedSum, check_radius, clipped_sum, onto_ball
from .layout import ParameterLayout
from .memory import Budget, Footprint, MemoryRefusal, measure_footprint, size_text

__all__ = ["LossFn", "Contribution", "PerSampleGradients", "check_per_sample_safe",
           "finish_contribution"]

#: ``loss(prediction[n, ...], target[n]) -> per-sample losses[n]``.
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

_BATCH_COUPLED = (torch.nn.modules.batchnorm._BatchNorm,)


def check_per_sample_safe(model: torch.nn.Module) -> None:
    """Refuse modules that couple the samples of a batch (batch-norm).

    With batch-norm one sample's output depends on the others', so a "per-sample" gradient
    is not one sample's contribution and the sensitivity analysis fails.
    """
    for name, module in model.named_modules():
        if isinstance(module, _BATCH_COUPLED):
            raise ValueError(
                f"Module {name or type(module).__name__!r} ({type(module).__name__}) mixes "
                f"samples within a "
                "batch, so per-sample gradients and the DP guarantee would be wrong. Replace it "
                "with "
                "GroupNorm or LayerNorm (per-sample normalisation), or remove it."
            )


@dataclass(frozen=True)
class Contribution:
    """A worker's ClippedMean and how many of its samples were clipped (a diagnostic).

    ``overflow``: a per-sample gradient (difference) or the sum was not finite at this iterate.
    The mean then carries nothing (zeros) and the server reports the round as diverged.
    """

    mean: np.ndarray
    num_samples: int
    num_clipped: int
    overflow: bool = False

    @property
    def clip_fraction(self) -> float:
        """The share of the worker's samples whose gradient (difference) was clipped, in [0, 1]."""
        return self.num_clipped / self.num_samples


class PerSampleGradients:
    """Per-sample gradients of ``loss(model(x), y)`` at given flat parameter vectors."""

    #: ``training.gradients``' name of this engine (messages).
    engine = "torch_func"

    def __init__(
        self, model: torch.nn.Module, loss: LossFn, *, dtype: torch.dtype = torch.float64,
        chunk_size: int = 1024, budget: Budget | None = None, fit_chunk: bool = False,
        device: torch.device | str = "cpu"
    ) -> None:
        check_per_sample_safe(model)
        if chunk_size < 1:
            raise ValueError(f"`chunk_size` must be >= 1. Found {chunk_size}.")
        #: where the model, each pass's samples and the float64 sums live (records stay in host
        #: memory; each pass's samples are copied over)
        self.device = torch.device(device)
        self.model = model.to(device=self.device, dtype=dtype)
        self.loss = loss
        self.dtype = dtype
        self.chunk_size = chunk_size
        #: with ``fit_chunk`` the pass sizes are the most samples (up to ``chunk_size``) whose pass
        #: fits ``budget``; otherwise ``chunk_size`` is checked against it
        self.budget, self.fit_chunk = budget, fit_chunk
        #: samples per pass of a restart (False) and a difference round (True)
        self.passes = {False: chunk_size, True: chunk_size}
        #: the measured footprints (by round kind) once planned
        self.footprints: dict[bool, Footprint] = {}
        self.layout = ParameterLayout.of(model)
        self._buffers = {n: b for n, b in self.model.named_buffers()}

        def one_sample_loss(params: dict[str, torch.Tensor], x: torch.Tensor,
                            y: torch.Tensor) -> torch.Tensor:
            out = functional_call(self.model, (params, self._buffers), (x.unsqueeze(0),))
            return self.loss(out, y.unsqueeze(0)).sum()

        self._per_sample = vmap(grad(one_sample_loss), in_dims=(None, 0, 0))

    def _flat(self, grads: dict[str, torch.Tensor], n: int) -> torch.Tensor:
        return torch.cat([grads[name].reshape(n, -1) for name in self.layout.names], dim=1)

    def per_sample(self, x_vec: np.ndarray, features: torch.Tensor,
                   targets: torch.Tensor) -> torch.Tensor:
        """All per-sample gradients at ``x_vec`` as one [n, d] tensor (for tests and small
        shards)."""
        params = self._params(x_vec)
        return torch.cat(
            [self._flat(self._per_sample(params, *self._on_device(xc, yc)), xc.shape[0])
             for xc, yc in _chunks(features, targets, self.chunk_size)]
        ).cpu()

    def _params(self, x_vec: np.ndarray) -> dict[str, torch.Tensor]:
        """The flat vector as the model's tensors, in the compute dtype, on the device."""
        return self.layout.to_torch(x_vec, self.dtype, self.device)

    def _on_device(self, features: torch.Tensor,
                   targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Records on the engine's device (a no-op on the CPU)."""
        return features.to(self.device), targets.to(self.device)

    def clipped_mean(
        self,
        x_current: np.ndarray,
        features: torch.Tensor,
        targets: torch.Tensor,
        radius: float,
        x_previous: np.ndarray | None = None,
    ) -> Contribution:
        """ClippedMean of per-sample gradients at ``x_current`` or, when ``x_previous`` is given,
        of per-sample differences ∇ℓ(x_current, z) - ∇ℓ(x_previous, z)."""
        return self.clipped_mean_of(x_current, _chunks(features, targets, self.chunk_size), radius,
                                    x_previous)

    def clipped_mean_of(
        self,
        x_current: np.ndarray,
        chunks: Iterable[tuple[torch.Tensor, torch.Tensor]],
        radius: float,
        x_previous: np.ndarray | None = None,
    ) -> Contribution:
        """:meth:`clipped_mean` over a shard given as chunks of (features, targets), read once, in
        order.

        n is the number of samples read. Chunks of ``chunk_size`` give the same floating-point sums,
        and so the same result bit for bit, as :meth:`clipped_mean` on the concatenated tensors.
        """
        return self._clipped_mean(x_current, chunks, radius, x_previous, plan=True)

    def _clipped_mean(self, x_current: np.ndarray,
                      chunks: Iterable[tuple[torch.Tensor, torch.Tensor]], radius: float,
                      x_previous: np.ndarray | None, *, plan: bool) -> Contribution:
        """:meth:`clipped_mean_of`, planning the passes on the first chunk (``plan``) or not (the
        probes of :meth:`measure_footprints`, which measure this whole path)."""
        check_radius(radius)
        current = self._params(x_current)
        previous = None if x_previous is None else self._params(x_previous)
        total = torch.zeros(self.layout.dim, dtype=torch.float64, device=self.device)
        n = clipped = nonfinite = 0
        for xc, yc in chunks:
            if xc.shape[0] == 0:
                continue
            xc, yc = self._on_device(xc, yc)
            if plan and self.budget is not None and not self.footprints:
                self.plan_memory(x_current, xc, yc)
            size = self.passes[previous is not None] if plan else int(xc.shape[0])
            for start in range(0, int(xc.shape[0]), size):
                part = self._chunk_sum(x_current, current, previous, xc[start:start + size],
                                       yc[start:start + size], radius)
                total += part.total
                clipped += part.clipped
                nonfinite += part.nonfinite
            n += int(xc.shape[0])
        if n == 0:
            raise ValueError(
                "The shard is empty: a worker with no samples cannot compute a ClippedMean.")
        return finish_contribution((total / n).cpu().numpy(), n, clipped, nonfinite, radius)

    def plan_memory(self, x_vec: np.ndarray, features: torch.Tensor,
                    targets: torch.Tensor) -> None:
        """Measure a pass of each round kind on these records at ``x_vec`` and set the
        pass sizes the budget allows (:meth:`use_footprints`). A no-op without a budget or once
        planned."""
        if self.budget is None or self.footprints:
            return
        self.use_footprints(self.measure_footprints(x_vec, features, targets))

    def measure_footprints(self, x_vec: np.ndarray, features: torch.Tensor,
                           targets: torch.Tensor) -> dict[bool, Footprint]:
        """The memory of a pass of a restart (False) and a difference round (True, against a nearby
        iterate) on these records at ``x_vec`` (the first chunk: up to 16 for the small probes, then
        the pass the budget allows), measured (:func:`~.memory.measure_footprint`)."""
        nearby = x_vec * (1 + 2.0**-10) + 2.0**-20
        n = int(features.shape[0])
        footprints = {}
        for difference in (False, True):
            previous = nearby if difference else None

            def run(m: int, previous=previous) -> Contribution:
                return self._clipped_mean(x_vec, [(features[:m], targets[:m])], 1.0, previous,
                                          plan=False)

            footprints[difference] = measure_footprint(
                run, n, self.device, None if self.budget is None else self.budget.bytes,
                self.chunk_size, self._bounded_bytes)
        return footprints

    def _bounded_bytes(self) -> int:
        """Memory a pass holds whatever its size that the small probes leave out (none here)."""
        return 0

    def use_footprints(self, footprints: dict[bool, Footprint]) -> None:
        """Set each round kind's pass size from its footprint and the budget, or raise
        :class:`~.memory.MemoryRefusal` in one line: one sample does not fit, or the fixed
        ``chunk_size`` does not."""
        passes = {kind: self._pass_size(fp, kind) for kind, fp in footprints.items()}
        self.footprints, self.passes = dict(footprints), passes

    def _pass_size(self, fp: Footprint, difference: bool) -> int:
        """The samples per pass the budget allows for one round kind (see :meth:`plan_memory`)."""
        budget = self.budget
        kind = "a difference round (two iterates)" if difference else "a restart round"
        setup = (f"training.gradients {self.engine}, {str(self.dtype).removeprefix('torch.')}, "
                 f"{self.layout.dim:,} parameters")
        if self.fit_chunk:
            size = fp.chunk_for(budget.bytes, self.chunk_size)
            if size == 0:
                raise MemoryRefusal(
                    f"training.memory_budget_mb: one sample of {kind} needs "
                    f"{size_text(fp.bytes_for(1))} ({setup}), more than the budget of "
                    f"{size_text(budget.bytes)} ({budget.source}); raise "
                    f"training.memory_budget_mb, or take {self._lighter()}.")
            return size
        if fp.bytes_for(self.chunk_size) > budget.bytes:
            fits = fp.chunk_for(budget.bytes, self.chunk_size)
            raise MemoryRefusal(
                f"training.chunk_size {self.chunk_size}: a pass of {kind} needs "
                f"{size_text(fp.bytes_for(self.chunk_size))} ({setup}), more than the budget of "
                f"{size_text(budget.bytes)} ({budget.source}); set training.chunk_size: auto "
                + (f"(the most that fits: {fits})" if fits else "(not even one sample fits)")
                + " or raise training.memory_budget_mb.")
        return self.chunk_size

    def _lighter(self) -> str:
        """The lighter settings a refusal may suggest: those not already taken."""
        options = ([] if self.engine == "ghost" else ["training.gradients: ghost"]) + (
            [] if self.dtype == torch.float32 else ["training.dtype: float32"])
        return " or ".join(options + ["a smaller model"])

    def _chunk_sum(self, x_current: np.ndarray, current: dict[str, torch.Tensor],
                   previous: dict[str, torch.Tensor] | None, xc: torch.Tensor, yc: torch.Tensor,
                   radius: float) -> ClippedSum:
        """One chunk's clipped sum (float64 [d]) and its counts, at ``current`` (the parameters of
        ``x_current``) or of the differences with ``previous``."""
        rows = self._flat(self._per_sample(current, xc, yc), xc.shape[0])
        if previous is not None:
            rows = rows - self._flat(self._per_sample(previous, xc, yc), xc.shape[0])
        # Clip and sum in float64 whatever the compute dtype: the result's norm then exceeds
        # the radius by float64 rounding at most, which `finish_contribution` projects away.
        return clipped_sum(rows.to(torch.float64), radius)

    def loss_and_gradient(self, x_vec: np.ndarray, features: torch.Tensor,
                          targets: torch.Tensor) -> tuple[float, np.ndarray]:
        """Mean loss and its (unclipped) gradient over all samples: evaluation only."""
        params = {k: v.requires_grad_(True) for k, v in self._params(x_vec).items()}
        features, targets = self._on_device(features, targets)
        out = functional_call(self.model, (params, self._buffers), (features,))
        loss = self.loss(out, targets).mean()
        grads = torch.autograd.grad(loss, [params[n] for n in self.layout.names])
        flat = torch.cat([g.reshape(-1) for g in grads]).detach().to(torch.float64).cpu().numpy()
        return float(loss.detach()), flat

    def outputs(self, x_vec: np.ndarray, features: torch.Tensor) -> torch.Tensor:
        """The model's outputs at ``x_vec`` for all samples (no gradient): evaluation only."""
        with torch.no_grad():
            return functional_call(self.model, (self._params(x_vec), self._buffers),
                                   (features.to(self.device),)).cpu()

    def mean_loss(self, x_vec: np.ndarray, features: torch.Tensor, targets: torch.Tensor) -> float:
        """Mean loss over all samples (no gradient): evaluation only."""
        with torch.no_grad():
            features, targets = self._on_device(features, targets)
            out = functional_call(self.model, (self._params(x_vec), self._buffers), (features,))
            return float(self.loss(out, targets).mean())


def finish_contribution(mean: np.ndarray, n: int, clipped: int, nonfinite: int,
                        radius: float) -> Contribution:
    """A worker's reply from its ClippedMean: projected onto the ball when it exceeds the radius by
    float rounding (so its norm is <= radius exactly), or an explicit overflow report (zeros) when a
    per-sample gradient or the mean is not finite."""
    if nonfinite or not np.all(np.isfinite(mean)):
        return Contribution(mean=np.zeros_like(mean), num_samples=n, num_clipped=clipped,
                            overflow=True)
    return Contribution(mean=onto_ball(mean, radius), num_samples=n, num_clipped=clipped)


def _chunks(features: torch.Tensor, targets: torch.Tensor, size: int):
    for start in range(0, features.shape[0], size):
        yield features[start:start + size], targets[start:start + size]
