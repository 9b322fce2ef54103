#!/usr/bin/env bash
# Stand-ins for Flower's images flwr/base, flwr/superlink, flwr/supernode, flwr/superexec,
# flwr/serverapp and flwr/clientapp 1.42.0, built with Podman on a local Debian 12 base
# (debootstrap), for a machine that cannot pull them from Docker Hub: same user (app, UID 49999),
# working directory (/app), ENV and entrypoints as the official images (scripts/standin/Containerfile),
# tagged docker.io/flwr/<name>:1.42.0 so that docker-compose*.yml and server|clients/Dockerfile use them
# unchanged. Builds only what is missing or out of date; official images already present are kept.
# Needs root, podman (runc here: scripts/standin/containers.conf) and debootstrap.
# Usage: scripts/standin_images.sh [--force]      prints one JSON object (what was built, seconds)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup.sh"
exec "$root/.venv/bin/python" -m diff2_flwr.deploy.podman images "$@"
