#!/usr/bin/env python3
"""Replay n-gram drafting policies offline on recorded greedy outputs.

Greedy output does not depend on the drafter, so whether a drafted token is accepted is a pure
function of plain decoding's output; the time of a step is the calibrated cost of its verify
batch (CostModel) plus a fixed per-step overhead. This predicts, in milliseconds instead of
minutes, what a policy would do on a workload, and bounds what any n-gram policy could do
("oracle": drafts exactly the tokens that will be accepted). Predictions, not measurements:
spec-bench measures.

  .venv/bin/python scripts/ngram_replay.py --record out.json --prompts question.dev.jsonl
  .venv/bin/python scripts/ngram_replay.py --replay out.json --costs ~/.local/share/tandem/costs/X.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def record(prompts_file: Path, out: Path, per_category: int, n: int, threads: int) -> None:
    from tandem.bench.workloads import group_mt_bench, read_file, select
    from tandem.engine.loop.events import DoneEvent
    from tandem.engine.backend.llama import ContextParams
    from tandem.engine.pair import PairSession, SessionOptions
    from tandem.engine.loop.speculative import GenParams
    from tandem.models.catalog import get_pair
    from tandem.models.store import Store

    pair, store = get_pair(), Store()
    prompts = select(group_mt_bench(read_file(prompts_file)), per_category)
    ctx = ContextParams(n_ctx=4096, n_threads=threads, type_k="q8_0", type_v="q8_0")
    items = []
    with PairSession(store.ensure(pair.target), None,
                     SessionOptions(strategy="none", target_ctx=ctx)) as s:
        for p in prompts:
            tokens = s.prompt_tokens([{"role": "user", "content": p.text}])
            for ev in s.generate(tokens, GenParams(max_tokens=n), strategy="none"):
                if isinstance(ev, DoneEvent):
                    items.append({"id": p.id, "cat": p.category, "prompt": tokens,
                                  "out": list(ev.tokens)})
                    print(p.id, p.category, len(tokens), len(ev.tokens), file=sys.stderr)
    out.write_text(json.dumps(items))


def replay(items: list[dict], make, verify_limit: int, costs, overhead: float,
           oracle: bool) -> list[float]:
    """Predicted speedup over plain decoding for each item."""
    from tandem.bench.replay import replay as replay_greedy

    out = []
    for item in items:
        r = replay_greedy(make(), item["out"], costs.verify_cost, prompt=item["prompt"],
                          limit=verify_limit - 1, overhead=overhead, oracle=oracle)
        out.append((len(item["out"]) / r.seconds) * (costs.plain + overhead))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--record", type=Path, help="write plain greedy outputs here")
    ap.add_argument("--prompts", type=Path, default=Path("../shared/spec_bench/question.dev.jsonl"))
    ap.add_argument("--per-category", type=int, default=5)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--replay", type=Path, help="recorded outputs to replay")
    ap.add_argument("--costs", type=Path, help="a calibrated cost model ($TANDEM_HOME/costs/*.json)")
    ap.add_argument("--overhead-ms", type=float, default=4.0, help="per-step time outside verify")
    ns = ap.parse_args()
    if ns.record:
        record(ns.prompts, ns.record, ns.per_category, ns.n, ns.threads)
    if not ns.replay:
        return 0

    from tandem.engine.backend.llama import EXACT_BATCH
    from tandem.engine.drafting.auto import AutoDrafter
    from tandem.engine.drafting.drafters import DraftParams, NgramDrafter
    from tandem.engine.tuning.costs import MAX_BATCH, CostModel

    class WideNgram(NgramDrafter):  # the oracle's n-grams: up to 8 tokens long
        SIZES = (2, 8)

    costs = CostModel.load(ns.costs) if ns.costs else None
    if costs is None or not costs.verify:
        print("error: --costs must name a calibrated cost model", file=sys.stderr)
        return 2
    items = json.loads(ns.replay.read_text())

    def auto():
        return AutoDrafter(None, DraftParams(n_max=3), CostModel(dict(costs.verify)),
                           verify_limit=MAX_BATCH, calibrated=None, notes=(), library=None,
                           knowledge=None)

    cap = EXACT_BATCH - 1
    policies = {"ngram (n_max 4)": (lambda: NgramDrafter(DraftParams(n_max=4)), False),
                "auto": (auto, False),
                f"oracle bound (n_max {cap})": (lambda: WideNgram(DraftParams(n_max=cap)), True)}
    cats = sorted({i["cat"] for i in items})
    print("| policy | " + " | ".join(cats) + " | overall |")
    print("|---" * (len(cats) + 2) + "|")
    for name, (make, oracle) in policies.items():
        cells, every = [], []
        for c in cats:
            r = replay([i for i in items if i["cat"] == c], make, EXACT_BATCH, costs,
                       ns.overhead_ms / 1000, oracle)
            every += r
            cells.append(f"{statistics.median(r):.2f}x")
        print(f"| {name} | " + " | ".join(cells) + f" | {statistics.median(every):.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
