#!/usr/bin/env bash
# Create ./.venv and install diff2-flwr (with the test, partitions, examples, docs and bench extras) when missing or when pyproject.toml changed.
# Usage: scripts/setup.sh            (idempotent; prints nothing when already set up)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
stamp="$venv/.diff2-installed"
want="$(sha256sum "$root/pyproject.toml" | cut -d' ' -f1)"
# `source .venv/bin/activate` also sets FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 (unless the shell has it
# already) and `deactivate` unsets it again: this venv holds every dependency of the app, and Flower 1.42 would
# otherwise `uv sync` a second copy of them for every run (on Linux, a multi-GB CUDA torch from PyPI). bash/zsh;
# fish and csh users export the variable themselves. Idempotent: a venv made before this line got it on the next call.
offline_activation() {
  local act="$venv/bin/activate"
  [[ -f "$act" ]] || return 0
  grep -q "^# diff2-flwr: runtime dependency installation" "$act" && return 0
  cat >> "$act" <<'ACT'

# diff2-flwr: runtime dependency installation (added by scripts/setup.sh). This venv holds every dependency of the
# app, so Flower's per-run `uv sync` is turned off while it is active; `deactivate` restores the shell.
if [ -z "${FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION+x}" ]; then
    export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
    _DIFF2_FLWR_OFFLINE_SET=1
fi
eval "_diff2_venv_$(declare -f deactivate)"
deactivate () {
    if [ -n "${_DIFF2_FLWR_OFFLINE_SET:-}" ]; then
        unset FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION _DIFF2_FLWR_OFFLINE_SET
    fi
    _diff2_venv_deactivate "$@"
}
ACT
}
if [[ -x "$venv/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  offline_activation
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
"$venv/bin/python" -m pip install --quiet -e "$root[test,partitions,examples,docs,bench]" >&2
offline_activation
echo "$want" > "$stamp"
echo "[setup] done. For Flower's own commands (flwr run ., flwr ls, ...): source .venv/bin/activate" >&2
