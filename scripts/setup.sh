#!/usr/bin/env bash
# Create ./.venv and install diff2-flwr (with the test, partitions and examples extras) when missing or when pyproject.toml changed.
# Usage: scripts/setup.sh            (idempotent; prints nothing when already set up)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
stamp="$venv/.diff2-installed"
want="$(sha256sum "$root/pyproject.toml" | cut -d' ' -f1)"
if [[ -x "$venv/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  exit 0
fi
python="${PYTHON:-python3}"
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "diff2-flwr needs Python >= 3.11 (as pyproject.toml's requires-python; Flower 1.42 needs 3.11); found $("$python" --version 2>&1). Set PYTHON=/path/to/python3.11 (or newer)." >&2
  exit 1
fi
echo "[setup] creating $venv and installing diff2-flwr (first time: a few minutes)..." >&2
[[ -x "$venv/bin/python" ]] || "$python" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip >&2
# Pin torch first: 2.13.0 is the CPU build on these machines; an unpinned torch pulls a multi-GB CUDA build.
"$venv/bin/python" -m pip install --quiet "torch==2.13.0" >&2
"$venv/bin/python" -m pip install --quiet -e "$root[test,partitions,examples]" >&2
echo "$want" > "$stamp"
echo "[setup] done." >&2
