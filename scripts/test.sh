#!/usr/bin/env bash
# Run the test suite (sets up ./.venv first when needed). Extra arguments go to pytest.
#   scripts/test.sh           the full suite (what CI runs), in parallel processes; prints the 15 slowest tests
#   scripts/test.sh --fast    the developer's tier (a few minutes on 2 cores): no Flower processes, no
#                             deployments, no Ray cluster, no real datasets; the privacy path end to end in-process
# DIFF2_TEST_WORKERS sets the number of processes (default 3: the slow tests wait on Flower's processes part of
# the time; 0 runs in this process, which `pytest --pdb` needs).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup.sh"
cd "$root"
workers="${DIFF2_TEST_WORKERS:-3}"
tier=()
dist=(--dist loadfile --no-loadscope-reorder)  # a file per worker, in tests/conftest.py's order (longest first)
if [[ "${1:-}" == "--fast" ]]; then
  shift
  tier=(-m "not (flower or deployment or compose or cluster or realdata or slow)")
  workers="${DIFF2_TEST_WORKERS:-2}"
  dist=(--dist load)  # no module-wide fixture worth keeping on one worker here: test by test balances best
fi
parallel=()
[[ "$workers" != 0 ]] && parallel=(-n "$workers" "${dist[@]}")
# The linter first ([tool.ruff] in pyproject.toml): a finding fails the run before any test starts.
if ! "$root/.venv/bin/ruff" check --quiet diff2_flwr server clients tests scripts benchmarks; then
  echo "[test] ruff found the problems above (pyproject.toml [tool.ruff]); fix them, then run the tests again" >&2
  exit 1
fi
exec "$root/.venv/bin/python" -m pytest --durations=15 "${parallel[@]}" "${tier[@]}" "$@"
