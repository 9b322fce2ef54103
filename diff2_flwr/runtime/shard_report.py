"""What the partition does to the noise: shard sizes, n_min and σ said before training, and the
refusal.

DIFF2 calibrates its noise to the smallest shard: one sample replaced at worker p moves the
averaged ClippedMean by at most 2C/(n_p P), so the round's noise std σC needs σ = 2z/(n_min P)
for the multiplier z that (ε, δ, R, T, u) fix. A skewed partition that leaves one client with few
samples raises everyone's noise by the factor n_min(IID)/n_min. The guarantee holds for any
n_min >= 1 (σ grows to match); what is refused is a partition useless at the configured ε:

- a shard with fewer than ``dataset.partitioner.min_samples`` samples (default 1: an empty shard,
  for which no finite σ exists);
- a calibration with σ1 or σ2 above ``privacy.max_sigma`` (default 1): the per-
  coordinate noise std σC would exceed the clipping radius C, the bound on the norm of the whole
  averaged signal, so every coordinate of every release is dominated by noise. ``null`` lifts it.

Each refusal says what would help for this partition: under IID, n_min·P is about the number of
train records whatever P, so fewer clients never lower σ (a larger ε, fewer rounds or more records
do); a skewed partition can also be made milder, in its own keys.
"""

from __future__ import annotations

from typing import Sequence

from ..core.privacy import Calibration
from .config import ExperimentConfig

__all__ = ["PartitionRefused", "shard_lines", "check_shards"]


class PartitionRefused(ValueError):
    """A partition whose smallest shard is too small for the configured privacy budget; the message
    has the numbers."""


def _sigmas(cal: Calibration) -> str:
    s2 = f", σ2 = {cal.sigma2:.4g}" if cal.sigma2 is not None else ""
    z2 = f", z2 = {cal.z2:.4g}" if cal.z2 is not None else ""
    return f"σ1 = {cal.sigma1:.4g}{s2} (z1 = {cal.z1:.4g}{z2}; σ = 2z/(n_min·P))"


def _smallest(sizes: Sequence[int]) -> int:
    return min(range(len(sizes)), key=lambda p: sizes[p])


def shard_lines(cfg: ExperimentConfig, sizes: Sequence[int], n_min: int,
                calibration: Calibration | None, *, available: int | None = None) -> list[str]:
    """The pre-training lines: the partition and its shard sizes, n_min and the σ it forces.

    With ``dataset.train_samples`` the first line says that the train samples are a subsample, its
    seed and (when known, ``available``) how many records the train split held.
    """
    d, p = cfg.dataset, len(sizes)
    sub = ""
    if d.train_samples is not None:
        of = f" of the {available} in the train split" if available is not None else ""
        sub = (f" (dataset.train_samples: a uniform random subsample{of}, subsample_seed "
               f"{d.subsample_seed})")
    lines = [f"[diff2] shards: {d.partitioner.describe(d.split_seed, d.task_kind, p)}; P = {p}, "
             f"{sum(sizes)} train samples{sub}, sizes {list(sizes)}"]
    where = f"client {_smallest(sizes)}" + (", privacy.n_min" if cfg.privacy.n_min else "")
    if calibration is None and cfg.private and cfg.privacy.distributed:
        lines.append(
            f"[diff2] n_min = {n_min} ({where}); distributed noise: each client adds Skellam "
            f"noise, the server learns only the SecAgg+ sum ({cfg.privacy.bits} bits, t = "
            f"{cfg.privacy.tolerated})")
        return lines
    if calibration is None:
        lines.append(f"[diff2] n_min = {n_min} ({where}); method {cfg.method}: no noise")
        return lines
    lines.append(
        f"[diff2] n_min = {n_min} ({where}): {_sigmas(calibration)} for ε = "
        f"{calibration.epsilon:g}, δ = {calibration.delta:g}, R = {calibration.rounds}, T = "
        f"{calibration.restart_every}")
    iid_min = sum(sizes) // p
    if iid_min > n_min:
        iid = cfg.calibration(iid_min)
        assert iid is not None
        lines.append(
            f"[diff2] an IID split of the same {sum(sizes)} samples would give n_min = {iid_min} "
            f"and σ1 = {iid.sigma1:.4g}" + (f", σ2 = {iid.sigma2:.4g}" if iid.sigma2 is not None
                                            else "")
                     + f": this partition adds {iid_min / n_min:.3g}× the noise")
    return lines


def check_shards(cfg: ExperimentConfig, sizes: Sequence[int],
                 calibration: Calibration | None = None) -> None:
    """Refuse shards below ``min_samples`` or a σ above ``max_sigma``, naming client, size, n_min
    and σ.

    Without ``calibration`` only the sizes are checked (σ of the smallest shard is computed for the
    message).
    """
    part = cfg.dataset.partitioner
    what = f"partition {part.describe(cfg.dataset.split_seed, cfg.dataset.task_kind, len(sizes))}"
    small = [q for q, n in enumerate(sizes) if n < part.min_samples]
    if small:
        q = _smallest(sizes)
        n_min = sizes[q]
        sigma = "no finite σ exists (σ = 2z/(n_min·P))"
        if n_min >= 1 and cfg.private:
            cal = cfg.calibration(n_min)
            assert cal is not None
            sigma = _sigmas(cal)
        raise PartitionRefused(
            f"{cfg.source}: the {what} leaves client(s) {small} with fewer than "
            f"dataset.partitioner.min_samples = "
            f"{part.min_samples} samples: client {q} holds {n_min}, so n_min = {n_min} and "
            f"{sigma}. Shard sizes: "
            f"{list(sizes)}. {_fewer_samples_remedy(cfg, sizes)}")
    if calibration is None or cfg.privacy.max_sigma is None:
        return
    worst = max(calibration.sigma1, calibration.sigma2 or 0.0)
    if worst > cfg.privacy.max_sigma:
        q = _smallest(sizes)
        declared = f" (privacy.n_min = {calibration.n_min})" if cfg.privacy.n_min else ""
        raise PartitionRefused(
            f"{cfg.source}: with the {what}, client {q} holds only {sizes[q]} samples; n_min = "
            f"{calibration.n_min}"
            f"{declared} gives {_sigmas(calibration)} at ε = {calibration.epsilon:g}, δ = "
            f"{calibration.delta:g}, "
            f"R = {calibration.rounds}, T = {calibration.restart_every}, P = "
            f"{calibration.clients}. σ = {worst:.4g} is "
            f"above privacy.max_sigma = {cfg.privacy.max_sigma:g}: each coordinate's noise "
            f"would exceed the "
            "clipping radius, the bound on the whole averaged signal. Shard sizes: "
            f"{list(sizes)}. {_sigma_remedy(cfg, sizes, calibration)}")


#: What lowers σ whatever the partition, and what the threshold is (said in every σ refusal).
_ALWAYS = ("a larger privacy.epsilon or fewer training.rounds lower z, hence σ. Or raise "
           "privacy.max_sigma (null: no limit), the threshold of this check: the "
           "(ε, δ) guarantee stays the same, but the noise then swamps each coordinate and the "
           "model may learn nothing.")


def _milder_skew(cfg: ExperimentConfig) -> str:
    """How a non-IID partitioner of ``cfg`` is made milder, in its own keys."""
    name = cfg.dataset.partitioner.name
    shapes = ["iid", "linear", "square", "exponential"]
    milder = " or ".join(reversed(shapes[:shapes.index(name)])) if name in shapes else ""
    knob = {"dirichlet": "a larger dataset.partitioner.alpha or min_partition_size",
            "pathological": "more dataset.partitioner.classes_per_client",
            "size": "more even dataset.partitioner.sizes"}.get(
                name, f"dataset.partitioner.name: {milder}")
    return f"a milder skew ({knob})"


def _more_records(cfg: ExperimentConfig) -> str:
    sub = cfg.dataset.train_samples
    return (f"more records (dataset.train_samples = {sub}: a larger subsample)" if sub is not None
            else "more records")


def _fewer_samples_remedy(cfg: ExperimentConfig, sizes: Sequence[int]) -> str:
    """What gives the smallest shard ``min_samples``: under IID, fewer clients or more records."""
    total, least = sum(sizes), cfg.dataset.partitioner.min_samples
    if cfg.dataset.partitioner.name == "iid":
        return (f"The partition is IID (shards of about {total} / P records): fewer clients (P <= "
                f"{max(total // least, 1)}) or {_more_records(cfg)}.")
    return f"Use {_milder_skew(cfg)}, fewer clients or {_more_records(cfg)}."


def _sigma_remedy(cfg: ExperimentConfig, sizes: Sequence[int], cal: Calibration) -> str:
    """What lowers σ = 2z/(n_min·P) for this partition, then the threshold: under IID n_min·P is
    about the number of records whatever P, so fewer clients do not help."""
    total, spread = sum(sizes), cal.n_min * cal.clients
    declared = cfg.privacy.n_min
    if declared is not None and declared < min(sizes):
        head = (f"privacy.n_min = {declared} is below the smallest shard's {min(sizes)} records: "
                f"the federation's agreed n_min sets σ, and a larger one (at most "
                f"{min(sizes)}) lowers it; else ")
    elif cfg.dataset.partitioner.name == "iid":
        head = (f"The partition is IID: n_min·P = {spread} is about the {total} train records "
                f"whatever P, so fewer clients do not lower σ; {_more_records(cfg)} do, and ")
    else:
        head = (f"This partition gives n_min·P = {spread}; an IID split of the same {total} "
                f"records gives about {total}, so {_milder_skew(cfg)} lowers σ up to "
                f"{total / spread:.3g}×, and fewer clients help only where they raise n_min·P; "
                f"{_more_records(cfg)} help too, and ")
    return head + _ALWAYS
