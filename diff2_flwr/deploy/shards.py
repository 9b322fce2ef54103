"""Writing shard files for a deployment (``diff2 shard CONFIG --out DIR``).

The dataset of CONFIG is prepared exactly as a simulation would prepare it;
``DIR/shard-<i>-of-<P>.npz`` holds worker i's train samples only, ``DIR/server.npz`` the test split,
the normalisation statistics and the shard sizes (no training sample). The reading side lives in
``runtime/shard_files.py``.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..runtime.config import ExperimentConfig
from ..runtime.session import load_data
from ..runtime.shard_report import check_shards
from ..runtime.shard_files import FORMAT, SERVER_FILE, data_fingerprint, save_npz, shard_name

__all__ = ["write_shards"]


def write_shards(cfg: ExperimentConfig, out: str | os.PathLike[str]) -> list[Path]:
    """Write the P worker files and the server file; return their paths."""
    data = load_data(cfg)
    check_shards(cfg, data.shard_sizes,
                 cfg.calibration(cfg.privacy.n_min or data.n_min) if data.n_min else None)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    fp, p_total = data_fingerprint(cfg), len(data.shard_bounds)
    paths = []
    for p in range(p_total):
        x, y = data.shard(p)
        path = out / shard_name(p, p_total)
        save_npz(path, {"format": FORMAT, "kind": "worker", "partition_id": p,
                        "num_partitions": p_total,
                     "fingerprint": fp, "num_samples": int(len(y)), "classes": list(data.classes)},
              features=x, targets=y)
        paths.append(path)
    path = out / SERVER_FILE
    save_npz(path, {"format": FORMAT, "kind": "server", "num_partitions": p_total,
                    "fingerprint": fp,
                 "shard_sizes": list(data.shard_sizes), "target_scale": data.target_scale,
                 "task": data.task,
                 "classes": list(data.classes)},
          x_test=data.x_test, y_test=data.y_test, feature_mean=data.feature_mean,
          feature_std=data.feature_std)
    paths.append(path)
    return paths
