"""A worker's memory budget (``training.memory_budget_mb``) and what it allows (issue 41, item 2).

``auto`` is half of this machine's memory (the smaller of ``MemTotal`` and the cgroup's limit: a
container's), divided among the workers that compute on it at once (a Flower simulation's Ray
actors on this node: its CPUs over each actor's; one elsewhere), and never more than 80 % of the
memory available when the worker is built. Taken from the machine's size rather than its momentary
free memory, so that the chunk it allows (a power of two, :class:`~diff2_flwr.core.memory.
Footprint`) and so the float64 sums are the same run after run on one machine; only when memory
is short does what is available decide.

Several SuperNodes on one host (``diff2 deploy-local``) each see the whole machine: give each a
budget (``--set training.memory_budget_mb=...``). The budget covers a round's per-sample work, on
top of what the worker already holds (its model and records).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from ..core.memory import Budget

__all__ = ["AUTO_SHARE", "CGROUP_FILES", "co_located_workers", "machine_memory", "resolve_budget"]

#: ``auto``: this share of the machine's memory, divided among co-located workers.
AUTO_SHARE = 0.5
#: ``auto`` never takes more than this share of the memory available at the time.
AVAILABLE_SHARE = 0.8
_MB = 2**20
#: Where a container's memory limit is read (cgroup v2, then v1).
CGROUP_FILES = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def _meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes ({} where there is none)."""
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return {}
    out = {}
    for line in lines:
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


def _cgroup_limit() -> int | None:
    """This process's cgroup memory limit (v2 ``memory.max``, v1 ``memory.limit_in_bytes``)."""
    for path in CGROUP_FILES:
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 2**60:
            return int(text)
    return None


def machine_memory() -> tuple[int, int]:
    """(this machine's memory: the smaller of its RAM and its cgroup limit, the memory available
    now) in bytes."""
    info = _meminfo()
    total = info.get("MemTotal")
    if total is None:
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            total = 8 * 2**30
    limit = _cgroup_limit()
    if limit is not None:
        total = min(total, limit)
    return total, min(total, info.get("MemAvailable", total))


def _ray():
    """Ray's module when this process has it imported and initialised, else None (a module still
    being imported has no ``is_initialized`` yet: Flower's simulation imports Ray lazily)."""
    ray = sys.modules.get("ray")
    is_initialized = getattr(ray, "is_initialized", None)
    try:
        return ray if callable(is_initialized) and is_initialized() else None
    except Exception:  # noqa: BLE001 -- a half-imported or shut-down Ray: no actor to ask
        return None


def co_located_workers() -> int:
    """The workers computing on this machine at once, as far as this process can tell: in a Ray
    actor (Flower's simulation engine, a study's cluster), this node's CPUs over the actor's;
    otherwise 1."""
    ray = _ray()
    if ray is None:
        return 1
    try:
        context = ray.get_runtime_context()
        mine = float(context.get_assigned_resources().get("CPU", 0.0))
        node = context.get_node_id()
        cpus = next(float(n["Resources"].get("CPU", 0.0)) for n in ray.nodes()
                    if n["NodeID"] == node)
    except Exception:  # noqa: BLE001 -- not in an actor, or a Ray without these calls: one worker
        return 1
    return max(1, int(cpus // mine)) if mine > 0 else 1


def _gpu_share(device: torch.device) -> int:
    """The workers sharing this GPU, as far as this process can tell: in a Ray actor given a
    fraction of a GPU, one over it; otherwise 1."""
    ray = _ray()
    if ray is None:
        return 1
    try:
        mine = float(ray.get_runtime_context().get_assigned_resources().get("GPU", 0.0))
    except Exception:  # noqa: BLE001 -- not in an actor: one worker
        return 1
    return max(1, int(1 / mine)) if 0 < mine < 1 else 1


def resolve_budget(setting: float | str, device: torch.device | None = None) -> Budget:
    """``training.memory_budget_mb`` in bytes: a number of MiB as given, or ``auto`` (see the
    module's docstring; on a GPU the same rule over that GPU's memory)."""
    if setting != "auto":
        return Budget(int(float(setting) * _MB), f"training.memory_budget_mb = {setting}")
    if device is not None and device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        available = torch.cuda.mem_get_info(device)[0]
        workers, owner = _gpu_share(device), str(device)
    else:
        total, available = machine_memory()
        workers, owner = co_located_workers(), "this machine"
    share = int(AUTO_SHARE * total / workers)
    if share <= AVAILABLE_SHARE * available:
        shared = f", shared by {workers} workers" if workers > 1 else ""
        return Budget(share, f"auto: half of {owner}'s {total / 2**30:.1f} GiB{shared}")
    return Budget(int(AVAILABLE_SHARE * available),
                  f"auto: 80% of the {available / 2**30:.1f} GiB {owner} has available now")
