#!/usr/bin/env python3
"""What a grammar costs per token on a model's real vocabulary (docs/structured.md): the
llguidance tokenizer's build, a schema's compile, the mask of each position along a valid
output, the masked greedy pick on a logits row, a draft check, a rollback.

  .venv/bin/python scripts/grammar_costs.py PATH/TO/target.gguf
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "born": {"type": "integer"},
    "works": {"type": "array", "items": {"type": "string"}},
    "kind": {"enum": ["poet", "playwright", "novelist"]}},
    "required": ["name", "born", "works", "kind"]}
OUTPUT = ('{"name": "William Shakespeare", "born": 1564, "works": ["Hamlet", "Macbeth", '
          '"Othello", "King Lear"], "kind": "playwright"}')


def _ms(xs):
    xs = sorted(xs)
    return {"median": round(1000 * statistics.median(xs), 4),
            "p90": round(1000 * xs[int(0.9 * (len(xs) - 1))], 4),
            "max": round(1000 * xs[-1], 4)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--reps", type=int, default=5, help="passes over the output")
    args = ap.parse_args(argv)
    import numpy as np

    t = time.perf_counter()
    import llguidance  # noqa: F401 - timed: what a first grammar adds to a run
    t_import = time.perf_counter() - t
    from tandem.engine.backend.llama import Model
    from tandem.engine.constrain.grammar import Constraint, GrammarState, tokenizer_for

    model = Model(args.model)
    t = time.perf_counter()
    tokenizer_for(model)
    t_tok = time.perf_counter() - t
    constraint = Constraint("json_schema", json.dumps(SCHEMA))
    t = time.perf_counter()
    constraint.compiled()
    state = GrammarState(constraint, model)
    t_compile = time.perf_counter() - t
    ids = model.tokenize(OUTPUT, add_special=False, parse_special=False)
    rng = np.random.default_rng(0)
    row = rng.standard_normal(model.n_vocab).astype(np.float32)
    mask_s, greedy_s, masked_s, check_s, rollback_s, forced = [], [], [], [], [], 0
    for _ in range(args.reps):
        state.rollback(state.n_committed)
        for tok in ids:
            t0 = time.perf_counter()
            state.allowed(tok)  # computes this position's mask (once per state)
            t1 = time.perf_counter()
            state.greedy(row)  # an argmax the grammar refuses most of the time: the slow path
            t2 = time.perf_counter()
            state.masked(row)
            t3 = time.perf_counter()
            forced += len(state.forced())
            mask_s.append(t1 - t0)
            greedy_s.append(t2 - t1)
            masked_s.append(t3 - t2)
            state.commit(tok)
        t0 = time.perf_counter()
        state.rollback(4)
        rollback_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        state.valid_prefix(ids[-4:])
        check_s.append(time.perf_counter() - t0)
        for tok in ids[-4:]:
            state.commit(tok)
    print(json.dumps({
        "model": args.model.name, "n_vocab": model.n_vocab, "output_tokens": len(ids),
        "llguidance_import_s": round(t_import, 3), "tokenizer_build_s": round(t_tok, 3),
        "schema_compile_s": round(t_compile, 4),
        "mask_ms": _ms(mask_s), "masked_greedy_slow_path_ms": _ms(greedy_s),
        "masked_row_ms": _ms(masked_s), "rollback_4_ms": _ms(rollback_s),
        "check_4_drafts_ms": _ms(check_s),
        "forced_tokens_per_position": round(forced / (len(ids) * args.reps), 2)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
