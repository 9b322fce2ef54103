#!/usr/bin/env bash
# docker-compose.yml (or, with --tls, docker-compose.tls.yml) brought up with Podman on this
# machine, unchanged: builds the stand-ins for Flower's images if they are missing
# (scripts/standin_images.sh), shards the config into ./deploy/shards, makes ./deploy/outputs
# (owned by UID 49999), the SuperExec secrets in ./deploy/secrets (0600, owned by 49999), each data
# owner's node folder ./deploy/node-<i> (its policy.yaml, copied from configs/policy.yaml when missing,
# and its lifetime ledger; 0700, owned by 49999) and,
# with --tls, ./deploy/certs (CA, SuperLink certificate, one key pair per
# data owner), builds the app images, `up -d`, registers the SuperNodes' public keys (--tls), runs
# `flwr run` against 127.0.0.1:8000, and brings the project down, also on failure. Exits 0 only if
# the run completed. Needs root, podman, runc and debootstrap (Debian: apt-get install podman runc
# debootstrap); podman-compose is installed into ./.venv when missing.
# Usage: scripts/deploy_compose.sh [--tls] [--resume] [--set KEY=VALUE ...] [CONFIG]
#   CONFIG    a config inside the app folder (default configs/deploy.yaml, the one the compose files
#             are written for: P = 3, shards under /data/shards, outputs under /outputs)
#   --set     override keys of CONFIG, as in `diff2 run`: one --set takes several
#             (--set training.rounds=40 privacy.epsilon=8), repeating --set works too, and a last
#             word without `=` after --set is CONFIG when none other was given; checked (unknown
#             keys, types, ranges) before anything is built: a mistake is one line, exit 2
#   --resume  continue from ./deploy/outputs/checkpoint.npz; without it a left checkpoint is removed
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup.sh"
if [[ ! -x "$root/.venv/bin/podman-compose" ]] && ! command -v podman-compose >/dev/null; then
  "$root/.venv/bin/python" -m pip install --quiet "podman-compose==1.6.0" >&2
fi
cd "$root"
exec "$root/.venv/bin/python" -m diff2_flwr.deploy.podman run "$@"
