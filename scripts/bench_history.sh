#!/usr/bin/env bash
# The history-drafting benchmark of docs/benchmarks.md section 7, as one command: plain
# decoding against the default `auto` on the default pair, interleaved prompt by prompt.
#
#   scripts/bench_history.sh [OUT_DIR]     # default: bench-history-out
#
#   1. multi-turn: the built-in code-editing conversations (tune and hold-out sets, per turn,
#      plus a fresh session editing an earlier answer from the history) and Spec-Bench's
#      MT-bench two-turn rows (PER_GROUP of them, default 16), TOKENS per turn (default 256);
#   2. single prompts: every Spec-Bench category (MT-bench grouped), PER_CATEGORY prompts each
#      (default 5), 128 tokens;
#   3. the suffix index's memory and time per token.
# Run it on a quiet machine (scripts checks with /work/shared/bin/quiet-check when present).
# SPEC_BENCH: Spec-Bench's question file (default /work/shared/spec_bench/question.dev.jsonl).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${1:-bench-history-out}"
Q="${SPEC_BENCH:-/work/shared/spec_bench/question.dev.jsonl}"
TANDEM="$ROOT/.venv/bin/tandem"
PY="$ROOT/.venv/bin/python"
if [ -x /work/shared/bin/quiet-check ]; then
  /work/shared/bin/quiet-check || echo "Warning: the machine is busy: speeds below are not measurements of it" >&2
fi
mkdir -p "$OUT"
echo "## multi-turn (per turn; plain vs auto)"
"$TANDEM" spec-bench --multi-turn --prompts "$Q" --per-category "${PER_GROUP:-16}" \
  --strategies auto -n "${TOKENS:-256}" --out "$OUT/multi-turn" | cat
echo
echo "## single prompts, every Spec-Bench category (plain vs auto)"
"$TANDEM" spec-bench --prompts "$Q" --group-mt-bench --per-category "${PER_CATEGORY:-5}" \
  --strategies auto -n 128 --out "$OUT/single" | cat
echo
echo "## suffix index cost"
"$PY" "$ROOT/scripts/suffix_index_cost.py"
