"""How much memory a pass of per-sample work takes, measured, and the chunk a budget allows (issue
41, item 2).

:func:`peak_bytes` runs a function under a torch dispatch mode that sees every op's outputs and
returns the highest total of the CPU tensor storages they created that were live at once (every
tensor an op makes, autograd's saved ones included; memory held before the call is not counted).
It agrees with ``torch.profiler``'s allocation events to a few MiB on the bench's models, without
the profiler's own output on stderr. :func:`measure_footprint` runs a pass at
two probe sizes m₁ < m₂ and fits ``fixed + per_sample × m``: the engines' memory is linear in the
samples of a pass (per-sample rows, recorded activations, Gram products of the positions of one
sample), and a slope taken at small m is an over-estimate where an engine bounds a buffer (the
re-formed rows' blocks). :class:`Footprint` turns a budget into the largest chunk that fits, and
says what one sample needs when none does.

Memory that is not a CPU tensor (Python objects, numpy arrays, the allocator's fragmentation) is
not measured: :data:`MARGIN` covers it, and ``diff2 bench``'s models section reports each side's
peak resident memory next to the pass it planned (its ``diff2/ghost@opacus-memory`` side checks
that a budget holds).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
# torch's extension point for seeing every op (documented in its dispatcher notes; no public path)
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: PLC2701 -- see above

__all__ = ["Budget", "Footprint", "MARGIN", "MemoryRefusal", "measure_footprint", "peak_bytes",
           "size_text"]

#: The measured bytes are multiplied by this: a process's resident memory grows by more than its
#: live tensors (the C allocator keeps freed blocks it cannot return; buffers outside tensors). On
#: ``diff2 bench``'s CNN and transformer, ghost clipping's passes of 256 grew the resident set by
#: 1.26-1.45x the peak live tensor bytes this module measures (oneDNN on or off alike).
MARGIN = 1.6
#: The probe sizes of :func:`measure_footprint` (the smaller also warms the pass up).
PROBES = (2, 4)


class _Allocations(TorchDispatchMode):
    """Counts the bytes of the CPU tensor storages that ops create while it is active, until each
    storage is freed (a finalizer on the storage's Python object, which torch keeps for as long as
    the storage lives: autograd's saved tensors included), and their peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: dict[int, weakref.finalize] = {}

    def _free(self, key: int, size: int) -> None:
        self.live -= size
        self._seen.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if getattr(func, "is_view", False):  # a view allocates nothing
            return out
        for t in _tensors(out):
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            storage = t.untyped_storage()
            key = id(storage)
            if key in self._seen:
                continue
            size = storage.nbytes()
            self._seen[key] = weakref.finalize(storage, self._free, key, size)
            self.live += size
            self.peak = max(self.peak, self.live)
        return out


def _tensors(out: Any):
    """The tensors of an op's output (a tensor, or nested tuples and lists of them)."""
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (tuple, list)):
        for item in out:
            yield from _tensors(item)


def peak_bytes(fn: Callable[[], Any], device: torch.device | None = None) -> tuple[Any, int]:
    """``fn()`` and the peak of the tensor memory its ops allocated that was live at once, in
    bytes: on the CPU by a torch dispatch mode that sees every op's outputs (:class:`_Allocations`),
    on a GPU by its caching allocator's own peak (``torch.cuda.max_memory_allocated``). Memory held
    before the call is not counted; an op that writes into an existing tensor allocates nothing."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        result = fn()
        torch.cuda.synchronize(device)
        return result, max(0, torch.cuda.max_memory_allocated(device) - before)
    with _Allocations() as allocations:
        result = fn()
    return result, allocations.peak


@dataclass(frozen=True)
class Budget:
    """A worker's memory budget in bytes and where it came from (for messages)."""

    bytes: int
    source: str


class MemoryRefusal(ValueError):
    """A model (or a fixed chunk) whose pass does not fit the memory budget: refused before it is
    computed, in one line that says what it needs."""


def size_text(size: float) -> str:
    """Bytes as a short human figure: GiB, MiB or KiB, three significant digits or more."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if size >= scale:
            value = size / scale
            return f"{value:.3g} {unit}" if value < 100 else f"{value:.0f} {unit}"
    return f"{size / 1024:.3g} KiB"


@dataclass(frozen=True)
class Footprint:
    """The memory of one pass: ``fixed + per_sample × m`` bytes for m samples (margin included)."""

    fixed: int
    per_sample: int

    def bytes_for(self, samples: int) -> int:
        """The bytes a pass of ``samples`` samples needs."""
        return self.fixed + self.per_sample * samples

    def chunk_for(self, budget: int, at_most: int) -> int:
        """The most samples (at most ``at_most``, a power of two below it otherwise) whose pass
        fits ``budget`` bytes; 0 when not even one does. A power of two, so that machines whose
        budgets differ a little still take the same chunk (and sum in the same order)."""
        if self.bytes_for(1) > budget:
            return 0
        fits = at_most if self.per_sample == 0 else (budget - self.fixed) // self.per_sample
        if fits >= at_most:
            return at_most
        return 2 ** int(math.floor(math.log2(max(1, fits))))


def measure_footprint(run: Callable[[int], Any], available: int,
                      device: torch.device | None = None) -> Footprint:
    """The footprint of ``run(m)``, a pass over the first m of ``available`` samples on ``device``
    (the CPU by default): warmed up at the smaller probe, then measured at both (one sample alone
    when only one is available)."""
    small, large = (min(p, available) for p in PROBES)
    run(small)  # first calls trace (torch.func) and verify (the ghost engine)
    _, at_small = peak_bytes(lambda: run(small), device)
    if large == small:
        per_sample = at_small // small
        return Footprint(0, math.ceil(MARGIN * per_sample))
    _, at_large = peak_bytes(lambda: run(large), device)
    per_sample = max(0, at_large - at_small) / (large - small)
    # the slope bounds a pass's growth; what it does not explain is the fixed part
    fixed = max(0.0, max(at_small, at_large) - per_sample * large)
    return Footprint(math.ceil(MARGIN * fixed), math.ceil(MARGIN * max(per_sample, 1.0)))
