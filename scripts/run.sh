#!/usr/bin/env bash
# Run an experiment as a Flower simulation (`flwr run .` on a private local SuperLink).
# Usage: scripts/run.sh [CONFIG.yaml]      default: configs/default.yaml (synthetic data, 10 clients)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup.sh"
exec "$root/.venv/bin/diff2" run "${1:-configs/default.yaml}" "${@:2}"
