#!/usr/bin/env bash
# The whole suite on a fresh clone, several times in a row, while other processes keep every
# core busy: a test that only passes on a quiet machine fails here (issue 29).
#
#   scripts/test_under_load.sh [RUNS] [LOOPS]     # default: 3 runs, one busy loop per core
#
# Each run is `make test` in a fresh clone of this checkout's HEAD (the venv is rebuilt from the
# cached wheel each time, as CI does); prints one line per run: its exit code, the suite's last
# line and its wall time. The loops are killed on exit, Ctrl-C included.
set -euo pipefail

runs=${1:-3}
loops=${2:-$(nproc)}
repo=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)
head=$(git -C "$repo" rev-parse --short HEAD)
work=$(mktemp -d "${TMPDIR:-/tmp}/tandem-load.XXXXXX")
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

for _ in $(seq "$loops"); do
  python3 -c "while 1: pass" &
  pids+=($!)
done
echo "commit $head, $runs runs, $loops busy loops on $(nproc) cores" >&2

failed=0
for i in $(seq "$runs"); do
  git clone -q "$repo" "$work/run$i"
  git -C "$work/run$i" checkout -q "$head"
  start=$(date +%s)
  set +e
  make -C "$work/run$i" test >"$work/run$i.log" 2>&1
  rc=$?
  set -e
  secs=$(( $(date +%s) - start ))
  summary=$(grep -E "passed|failed|error" "$work/run$i.log" | tail -1)
  echo "run $i: rc=$rc, ${secs} s: $summary"
  if [ "$rc" -ne 0 ]; then
    failed=1
    grep -E "^(FAILED|ERROR) " "$work/run$i.log" | head -20 || true
    cp "$work/run$i.log" "${TMPDIR:-/tmp}/tandem-load-run$i.log"
    echo "log kept: ${TMPDIR:-/tmp}/tandem-load-run$i.log" >&2
  fi
  rm -rf "$work/run$i"
done
exit "$failed"
