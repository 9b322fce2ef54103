#!/usr/bin/env bash
# The reproducibility proof: the whole test suite under every thread/kernel combination
#   OMP_NUM_THREADS (and MKL_NUM_THREADS) in {1, 2}  x  ATEN_CPU_CAPABILITY in {avx2, default}
# plus, per combination, the fingerprint of a 10-round in-process run (final x_r and every metric),
# compared across combinations.
#
# Usage: scripts/determinism.sh [PYTEST ARGS...]     e.g. scripts/determinism.sh -m "not deployment"
# Prints one JSON object on stdout (per combination: the kernel torch reports, the pytest summary line,
# its exit code, the run's fingerprint; and which fingerprints agree); pytest's output goes to stderr.
# Exits 0 only if every combination passed.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup.sh" || exit 1
cd "$root"
py="$root/.venv/bin/python"
logdir="$(mktemp -d)"
trap 'rm -rf "$logdir"' EXIT
status=0
results=()
for threads in 1 2; do
  for cap in avx2 default; do
    tag="threads=${threads} kernel=${cap}"
    echo "[determinism] ${tag}: running the suite..." >&2
    envs=(OMP_NUM_THREADS="$threads" MKL_NUM_THREADS="$threads" ATEN_CPU_CAPABILITY="$cap")
    used="$(env "${envs[@]}" "$py" -c 'import torch; print(torch.backends.cpu.get_cpu_capability())')"
    start=$(date +%s)
    env "${envs[@]}" "$py" -m pytest -q -p no:cacheprovider "$@" > "$logdir/out.txt" 2>&1
    rc=$?
    cat "$logdir/out.txt" >&2
    wall=$(( $(date +%s) - start ))
    line="$(grep -E '^(=+ )?[0-9]+ (passed|failed)' "$logdir/out.txt" | tail -1 | sed -E 's/^=+ //; s/ =+$//')"
    fp="$(env "${envs[@]}" "$py" - <<'EOF'
import hashlib, json
from diff2_flwr.runtime.config import parse_config
from diff2_flwr.runtime.driver import run_inprocess
cfg = parse_config({"name": "determinism", "dataset": {"name": "synthetic", "num_samples": 3000},
                    "training": {"rounds": 10, "restart_every": 3, "clip_diff": 3.0, "learning_rate": 0.2,
                                 "clients": 3, "seed": 11}}, "determinism")
server = run_inprocess(cfg, record=False, progress=None)
rows = [{k: v for k, v in r.items() if k != "elapsed_s"} for r in server.history]
h = hashlib.sha256(server.state.x.tobytes() + json.dumps(rows, sort_keys=True).encode()).hexdigest()[:16]
print(json.dumps({"fingerprint": h, "x": server.state.x.tolist(), "grad_norm_sq": rows[-1]["grad_norm_sq"]}))
EOF
)"
    [[ $rc -eq 0 ]] || status=1
    results+=("$(printf '{"threads": %s, "kernel_requested": "%s", "kernel_used": "%s", "pytest_exit": %s, "pytest": "%s", "wall_s": %s, "run": %s}' \
      "$threads" "$cap" "$used" "$rc" "$line" "$wall" "${fp:-null}")")
  done
done
joined="$(IFS=,; echo "${results[*]}")"
"$py" - "$status" <<EOF
import json, sys
import numpy as np
combos = json.loads('[${joined}]')
by_kernel = {}
for c in combos:
    by_kernel.setdefault(c["kernel_used"], []).append(c)
agree = {}
for kernel, cs in by_kernel.items():
    agree[kernel] = len({c["run"]["fingerprint"] for c in cs if c["run"]}) == 1
xs = [np.array(c["run"]["x"]) for c in combos if c["run"]]
spread = max(float(np.max(np.abs(x - xs[0]) / np.maximum(np.abs(xs[0]), 1e-300))) for x in xs) if xs else None
for c in combos:
    if c["run"]:
        c["run"] = c["run"]["fingerprint"]
print(json.dumps({"combinations": combos,
                  "same_run_within_kernel": agree,
                  "max_relative_difference_of_x_across_kernels": spread,
                  "all_passed": sys.argv[1] == "0"}, indent=1))
EOF
exit $status
