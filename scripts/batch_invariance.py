#!/usr/bin/env python3
"""How far verify-batch logits are from single-token decoding's, per mode and batch size.

For each mode (fast: llama.cpp's defaults, repacked weights; exact: tandem's exact context),
context length and batch size k, decodes the same tokens one by one and as one batch with
logits on every row, and prints the largest |difference| of any logit and of the winning
token's logit. Greedy speculation equals plain decoding exactly where these are 0; elsewhere a
near tie (top-2 gap below twice the difference) may flip. spec-bench's NEAR_TIE_GAP is chosen
from this table (docs/benchmarks.md).

  .venv/bin/python scripts/batch_invariance.py                 # default pair from the store
  .venv/bin/python scripts/batch_invariance.py -m target.gguf --ks 2,4,8,17 --at 100,700
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from tandem.bench.hw_costs import PROBE_TEXT


TEXT = PROBE_TEXT  # the text `tandem hw costs` times its batches on


def compare(ctx, tokens, ats, ks) -> list[dict]:
    """At each context length, the largest |difference| between the logits of a batch of k
    tokens (logits on every row) and those of the same tokens decoded one by one."""
    rows = []
    for at in ats:
        seq = tokens[:at + max(ks)]
        ctx.prefill(seq[:at])
        single = [np.array(ctx.decode([t])[0]) for t in seq[at:]]
        for k in ks:
            ctx.truncate(at)
            batch = np.array(ctx.decode(seq[at:at + k], all_logits=True))
            diff = max(float(np.max(np.abs(batch[j] - single[j]))) for j in range(k))
            top = max(float(abs(batch[j][single[j].argmax()] - single[j].max()))
                      for j in range(k))
            rows.append({"context": at, "k": k, "max_abs_diff": diff, "top_logit_diff": top})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", type=Path, help="target GGUF (default: the default pair's)")
    ap.add_argument("--ks", default="2,3,4,5,7,8,9,12,17", help="batch sizes")
    ap.add_argument("--at", default="100,700", help="context lengths to test at")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    ns = ap.parse_args()

    from tandem.engine.backend.llama import exact_context
    from tandem.engine.backend.llama import Context, ContextParams, Model

    path = ns.model
    if path is None:
        from tandem.models.catalog import get_pair
        from tandem.models.store import Store

        path = Store().ensure(get_pair().target)
    ks = [int(k) for k in ns.ks.split(",")]
    ats = [int(a) for a in ns.at.split(",")]
    rows = []
    for mode, repack in (("fast", True), ("exact", False)):
        model = Model(path, repack=repack)
        tokens = model.tokenize(TEXT, add_special=True, parse_special=False)
        base_params = ContextParams(n_ctx=max(ats) + max(ks) + 8, n_threads=ns.threads)
        params = exact_context(base_params) if mode == "exact" else \
            ContextParams(**{**base_params.__dict__, "flash_attn": "auto"})
        ctx = Context(model, params)
        rows += [{"mode": mode, **r} for r in compare(ctx, tokens, ats, ks)]
        ctx.close()
        model.close()
    if ns.json:
        print(json.dumps(rows))
        return
    print(f"model {path.name}, {ns.threads} threads\n")
    print("| mode | context | k | max abs logit diff | winning logit diff |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['context']} | {r['k']} | {r['max_abs_diff']:.4f} | "
              f"{r['top_logit_diff']:.4f} |")


if __name__ == "__main__":
    main()
