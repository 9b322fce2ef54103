#!/usr/bin/env bash
# Run the test suite (sets up ./.venv first when needed). Extra arguments go to pytest,
# e.g. scripts/test.sh -m "not flower" for the fast tests only.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup.sh"
cd "$root"
exec "$root/.venv/bin/python" -m pytest --durations=15 "$@"
