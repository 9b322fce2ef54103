#!/usr/bin/env bash
# Run a long study so that it survives the machine: its run files are tarred into results/wip/<name>.runs.tar.gz
# and committed to this repository every INTERVAL seconds, and restored from there before the study starts (the
# studies' scheduler then computes only the runs that have no file). results/wip/ holds a study in progress only;
# its tarball is deleted when the study's run table is published in results/.
# Usage: scripts/study_checkpoint.sh STUDY.yaml [INTERVAL_S]   (from a clone whose code runs the study; REPO, the
# repository the checkpoints are committed to, defaults to this clone; OUT defaults to /tmp/diff2-studies)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
study="$1"; interval="${2:-1200}"
repo="${REPO:-$here}"; out="${OUT:-/tmp/diff2-studies}"
diff2="${DIFF2:-$here/.venv/bin/diff2}"
# the study's name, read by the Python beside diff2 (it has PyYAML; the system's python3 may not)
py="$(dirname "$diff2")/python"; [[ -x "$py" ]] || py=python3
name="$("$py" -c 'import sys,yaml; print(yaml.safe_load(open(sys.argv[1]))["name"])' "$study")"
tarball="results/wip/$name.runs.tar.gz"
mkdir -p "$out/$name/runs"
if [[ -f "$repo/$tarball" ]]; then
  tar -xzf "$repo/$tarball" -C "$out/$name"
  echo "[checkpoint] restored $(ls "$out/$name/runs" | wc -l) run files from $repo/$tarball" >&2
fi
checkpoint() {
  local n; n="$(ls "$out/$name/runs" | grep -c '\.json$' || true)"
  [[ "$n" -gt 0 ]] || return 0
  mkdir -p "$repo/results/wip"
  (cd "$out/$name" && ls runs | grep '\.json$' | sed 's|^|runs/|' \
     | tar --sort=name --mtime=@0 --owner=0 --group=0 -czf "$repo/$tarball.tmp" -T -)
  mv "$repo/$tarball.tmp" "$repo/$tarball"
  git -C "$repo" add "$tarball"
  git -C "$repo" commit -q -m "checkpoint: study $name in progress, $n run files" -- "$tarball" || true
  echo "[checkpoint] $(date -u +%H:%M:%S) $n run files committed to $repo/$tarball" >&2
}
cd "$here"
PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" "$diff2" experiment "$study" --output "$out" &
pid=$!
while kill -0 "$pid" 2>/dev/null; do
  for _ in $(seq "$interval"); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
  checkpoint
done
wait "$pid"; rc=$?
checkpoint
exit "$rc"
