#!/usr/bin/env bash
# A native loopback deployment for a newcomer without Docker: one SuperLink, one SuperNode per
# data owner (each reading only its own shard file), `flwr run` of the app; then everything is
# stopped. Exits 0 only if the run completed.
# Usage: scripts/deploy_local.sh [--tls] [--rounds N] [--clients P] [CONFIG.yaml]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup.sh"
config="configs/default.yaml"
args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --tls) args+=(--tls); shift ;;
    --rounds|--clients) args+=("$1" "$2"); shift 2 ;;
    -h|--help) sed -n '2,6p' "$0"; exit 0 ;;
    *) config="$1"; shift ;;
  esac
done
cd "$root"
exec "$root/.venv/bin/diff2" deploy-local "$config" --rounds "${DIFF2_DEPLOY_ROUNDS:-3}" "${args[@]}"
