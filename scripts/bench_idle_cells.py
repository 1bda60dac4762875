#!/usr/bin/env python3
"""What idle slots' conversations cost the others' steps (issue 52; serve's idle slots go
to the RAM prompt cache for this: serve/prompt_cache.py PromptCache.clear).

Two contexts of the layout `tandem serve --parallel N` builds (one unified KV cache for
its N slots and the one kept for short requests: engine/backend/sequences.py
shared_context), side by side in one process. In both, sequence 1 holds a prompt of
--prompt tokens; in the second, the other N sequences also hold --idle-tokens tokens each
(an idle slot's conversation), placed before sequence 1's cells (`before`, a request that
starts after the others) or after them (`after`).
Then 1-token steps of sequence 1 alternate between the two contexts (--steps each), and
the medians are compared: llama.cpp's attention spans every cell in use
(llama_kv_cache::get_n_kv), so the idle cells cost each step their mask's share.

  .venv/bin/python scripts/bench_idle_cells.py                    # run it alone
  .venv/bin/python scripts/bench_idle_cells.py --idle-tokens 0    # the control: 1.00
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from tandem.engine.backend.context_params import LAST, NONE, ContextParams
from tandem.engine.backend.llama import Context, Model
from tandem.engine.backend.sequences import shared_context
from tandem.models.catalog import get_pair
from tandem.models.store import Store, tandem_home


def fill(ctx: Context, seq: int, n: int) -> None:
    """n tokens of filler in `seq`, a ubatch at a time (their values do not matter)."""
    for i in range(0, n, ctx.n_ubatch):
        ctx.decode_batch([(seq, i, list(range(1000 + i, 1000 + min(n, i + ctx.n_ubatch))),
                           NONE)])


def measure(model: Model, slots: int, ctx_size: int, threads: int, prompt: int, idle: int,
            where: str, steps: int) -> dict:
    params = shared_context(ContextParams(n_ctx=ctx_size, n_threads=threads,
                                          n_threads_batch=threads), slots + 1)
    empty, busy = Context(model, params), Context(model, params)
    others = range(2, slots + 2)
    for seq in others if where == "before" else ():
        fill(busy, seq, idle)
    fill(empty, 1, prompt)
    fill(busy, 1, prompt)
    for seq in others if where == "after" else ():
        fill(busy, seq, idle)
    times: dict[str, list[float]] = {"empty": [], "idle": []}
    for k in range(steps):
        pairs = [("empty", empty), ("idle", busy)]
        for name, ctx in pairs if k % 2 == 0 else pairs[::-1]:  # neither always goes first
            t0 = time.perf_counter()
            ctx.decode_batch([(1, prompt + k, [5], LAST)])
            times[name].append(time.perf_counter() - t0)
    empty.close()
    busy.close()
    ms = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
    return {"where": where, "idle_tokens": idle * slots, "empty_ms": round(ms["empty"], 2),
            "idle_ms": round(ms["idle"], 2), "ratio": round(ms["idle"] / ms["empty"], 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", help="GGUF (default: the default pair's target)")
    ap.add_argument("--slots", type=int, default=4, help="serve's --parallel (default 4)")
    ap.add_argument("--ctx-size", type=int, default=4096, help="per slot (default 4096)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=300, help="sequence 1's tokens")
    ap.add_argument("--idle-tokens", type=int, default=700, help="per idle sequence")
    ap.add_argument("--steps", type=int, default=150, help="1-token steps per context")
    ap.add_argument("--json", action="store_true", help="rows as JSON on stdout")
    ns = ap.parse_args(argv)
    path = ns.model or str(Store(tandem_home()).ensure(get_pair().target))
    model = Model(path)
    rows = [measure(model, ns.slots, ns.ctx_size, ns.threads, ns.prompt, ns.idle_tokens,
                    where, ns.steps) for where in ("before", "after")]
    if ns.json:
        json.dump(rows, sys.stdout, indent=1)
        return 0
    print(f"{path}: {ns.slots} idle sequences beside one of {ns.prompt} tokens, "
          f"{ns.steps} 1-token steps each, medians")
    print("| idle cells | placed | step, no idle cells | step, idle cells | ratio |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['idle_tokens']} | {r['where']} | {r['empty_ms']} ms | {r['idle_ms']} ms "
              f"| {r['ratio']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
