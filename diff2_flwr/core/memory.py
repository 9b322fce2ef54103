"""How much memory a pass of per-sample work takes, measured, and the chunk a budget allows (issue
41, item 2).

:func:`peak_bytes` runs a function under a torch dispatch mode that sees every op's outputs and
returns the highest total of the CPU tensor storages they created that were live at once (every
tensor an op makes, autograd's saved ones included; memory held before the call is not counted).
It agrees with ``torch.profiler``'s allocation events to a few MiB on the bench's models, without
the profiler's own output on stderr. :func:`measure_footprint` runs a pass at
a few small probe sizes and fits ``fixed + per_sample × m`` through the last two: each phase of
a pass holds memory linear in its samples (per-sample rows, recorded activations, Gram products
of the positions of one sample), so its peak is convex in m and the last probes' slope is the
closest to that of a large pass. An engine that bounds a buffer whatever the pass (the ghost
engine's re-formed blocks) probes with that buffer at its smallest and adds its bound to the
fixed part. :class:`Footprint` turns a budget into the largest chunk that fits, and
says what one sample needs when none does.

Memory that is not a CPU tensor (Python objects, numpy arrays, the allocator's fragmentation) is
not measured: :data:`MARGIN` covers it, and ``diff2 bench``'s models section reports each side's
peak resident memory next to the pass it planned (its ``diff2/ghost@opacus-memory`` side checks
that a budget holds).
"""

from __future__ import annotations

import ctypes
import dataclasses
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
#: live tensors (freed blocks between live ones that a larger request cannot use; buffers outside
#: tensors). On ``diff2 bench``'s CNN and transformer, ghost clipping's passes of 128 and 256 on a
#: heap just given back (:func:`give_back_freed_memory`) grew the resident set by 1.0-1.74x the
#: peak live tensor bytes this module measures (Opacus' ghost clipping: 1.9x its own); on a heap
#: that earlier passes left resident, by less. A fixed mmap threshold would make it 1.0x, at 1.7x
#: the time (every large tensor's pages faulted in afresh).
MARGIN = 2.0
#: The probe sizes of :func:`measure_footprint` (the smallest also warms the pass up).
PROBES = (2, 4, 16)


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
    """The memory of one pass: ``fixed + per_sample × m`` bytes for m samples (margin included),
    trusted up to ``limit`` samples when given (see :func:`measure_footprint`)."""

    fixed: int
    per_sample: int
    limit: int | None = None

    def bytes_for(self, samples: int) -> int:
        """The bytes a pass of ``samples`` samples needs."""
        return self.fixed + self.per_sample * samples

    def chunk_for(self, budget: int, at_most: int) -> int:
        """The most samples (at most ``at_most`` and ``limit``, a power of two below them
        otherwise) whose pass fits ``budget`` bytes; 0 when not even one does. A power of two, so
        that machines whose budgets differ a little still take the same chunk (and sum in the same
        order)."""
        if self.bytes_for(1) > budget:
            return 0
        top = at_most if self.limit is None else min(at_most, self.limit)
        fits = top if self.per_sample == 0 else (budget - self.fixed) // self.per_sample
        if fits >= top:
            return top
        return 2 ** int(math.floor(math.log2(max(1, fits))))


def _trim() -> Callable[[], Any] | None:
    """glibc's ``malloc_trim`` where the C library has it (Linux), else None."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return None


_MALLOC_TRIM = _trim()


def give_back_freed_memory() -> None:
    """Return the C heap's free pages to the operating system (glibc's ``malloc_trim(0)``; a no-op
    elsewhere). A pass frees its tensors, but glibc keeps the freed heap pages resident, and memory
    freed by one pass is not all reusable by the next (fragmentation): on the bench's transformer
    the resident set held 535 MiB more than before a memory plan's probes, and the rounds after it
    grew from there. Called after each probe and after a plan, so that the process's resident set
    is its model, records and the pass it is computing."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def measure_footprint(run: Callable[[int], Any], available: int,
                      device: torch.device | None = None, budget: int | None = None,
                      at_most: int | None = None,
                      extra: Callable[[], int] = lambda: 0) -> Footprint:
    """The footprint of ``run(m)``, a pass over the first m of ``available`` samples on ``device``
    (the CPU by default): warmed up at the smallest probe, then measured at each of
    :data:`PROBES` (no more than are available; one sample alone when only one is).

    A pass's peak is the largest of its phases' memories, each linear in m, so it is convex in m,
    and small probes see the phases whose fixed part dominates: on the bench's CNN the slope
    between 4 and 16 samples was a third of the slope between 128 and 256 (0.51 against 1.56 MiB
    per sample). With a ``budget`` and ``at_most`` (the largest pass wanted) the probes go on
    doubling (32, 64, ...) while the line through the last two puts the next within the budget,
    up to ``at_most``; the footprint is the line through the last two, exact at both, above the
    peak between them (a chord of a convex function), and trusted no further than the last
    (``limit``, unless it held every available record). A probe's own peak is what the line of
    the two before it predicted, so it may exceed the budget by one doubling's error.
    ``extra()`` bytes, asked once the pass has run, are memory the engine bounds whatever the pass
    and leaves out of the probes of :data:`PROBES` (the ghost engine's re-formed blocks): a line
    through those probes adds it to its fixed part; a line through two larger probes, which hold it
    as it is, adds a quarter of it (the most a chord between m and 2m can miss of a part that stops
    growing between them, min(m, R)·w, is w·R/4).
    """
    sizes = sorted({min(p, available) for p in PROBES})
    run(sizes[0])  # first calls trace (torch.func) and verify (the ghost engine)
    points: list[tuple[int, int]] = []

    def line() -> Footprint:
        bound = extra()
        return _line(points, bound if points[-1][0] <= max(PROBES) else math.ceil(bound / 4))

    def fits(m: int) -> bool:
        return budget is None or len(points) < 2 or line().bytes_for(m) <= budget

    for m in sizes:
        if not fits(m):
            break
        points.append((m, peak_bytes(lambda m=m: run(m), device)[1]))
        give_back_freed_memory()
    if budget is None or at_most is None:
        return line()
    last = points[-1][0]
    while (after := min(2 * last, at_most, available)) > last and fits(after):
        points.append((after, peak_bytes(lambda m=after: run(m), device)[1]))
        give_back_freed_memory()
        last = after
    return dataclasses.replace(line(), limit=None if last == available else last)


def _line(points: list[tuple[int, int]], extra: int = 0) -> Footprint:
    """The footprint (margin included) of peaks measured at (m, bytes) points (see
    :func:`measure_footprint`): the line through the last two, its fixed part the most any point
    needs beyond its slope, plus ``extra``."""
    if len(points) == 1:
        m, peak = points[0]
        return Footprint(extra, math.ceil(MARGIN * peak / m))
    (m1, p1), (m2, p2) = points[-2:]
    per_sample = max(0.0, p2 - p1) / (m2 - m1)
    fixed = max(0.0, max(peak - per_sample * m for m, peak in points))
    return Footprint(math.ceil(MARGIN * fixed) + extra,
                     math.ceil(MARGIN * max(per_sample, 1.0)))
