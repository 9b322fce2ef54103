#!/usr/bin/env bash
# A native loopback deployment for a newcomer without Docker: one SuperLink, one SuperNode per
# data owner (each reading only its own shard file), `flwr run` of the app; then everything is
# stopped. Exits 0 only if the run completed. Everything binds to 127.0.0.1 only. SuperExec
# authentication is always on: the SuperLink and each SuperNode accept runtime requests only signed
# with a fresh per-run secret (<run folder>/secrets/*.secret, 0600), which only the SuperExecs this
# script starts hold.
# Usage: scripts/deploy_local.sh [--tls] [--no-node-auth] [--resume] [--rounds N] [--clients P]
#                                [--workdir DIR] [CONFIG.yaml]
#   --tls           TLS with a throw-away CA, and SuperNode authentication: one key pair per data
#                   owner, the SuperLink accepts only the P registered public keys
#   --no-node-auth  with --tls: accept any SuperNode (not recommended)
#   --resume        continue from the checkpoint a previous run left in the run folder; without
#                   it a repeated run starts fresh
#   --workdir DIR   run folder (default ./deploy-local/<config name>): shards, certificates and
#                   keys, logs, outputs; container paths in the config (/outputs/...) map into it
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
config="configs/default.yaml"
args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --tls|--no-node-auth|--resume) args+=("$1"); shift ;;
    --rounds|--clients|--workdir) args+=("$1" "$2"); shift 2 ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) config="$1"; shift ;;
  esac
done
"$root/scripts/setup.sh"
cd "$root"
has_rounds=0
for a in "${args[@]+"${args[@]}"}"; do [[ "$a" == "--rounds" ]] && has_rounds=1; done
if [[ $has_rounds -eq 0 ]]; then args+=(--rounds "${DIFF2_DEPLOY_ROUNDS:-3}"); fi
exec "$root/.venv/bin/diff2" deploy-local "$config" "${args[@]}"
