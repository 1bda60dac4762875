#!/usr/bin/env python3
"""Replay zero-cost drafting on recorded multi-turn conversations: acceptance and tokens per
step per turn, and the speedup the calibrated verify costs predict.

Greedy output does not depend on the drafter, so which drafts would be accepted is a function
of plain decoding's output (as scripts/ngram_replay.py does for single prompts). `--record`
runs spec-bench's multi-turn workloads (bench/multiturn.py: the built-in code-editing
conversations and Spec-Bench's MT-bench rows) with plain decoding on the default pair and
keeps every turn's prompt and output tokens; `--replay` runs drafting policies over them with
the real drafter classes, the draft model off (as auto keeps it on this CPU), each step
priced at the calibrated verify cost of its batch. Predictions, not measurements:
`tandem spec-bench --multi-turn` measures.

  .venv/bin/python scripts/history_replay.py --record turns.json [--mt-bench question.jsonl]
  .venv/bin/python scripts/history_replay.py --replay turns.json --costs ~/.local/share/tandem/costs/X.json

Policies: `ngram` is auto's prompt lookup before the suffix index (NgramIndex, latest match,
n <= 8); `auto` is auto now (suffix index over the prompt, files and history); `auto-no-history`
is auto with an empty history (what --no-history gives on the fresh sessions); `oracle`
drafts exactly what would be accepted of what auto's indexes hold (a bound, not a policy).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def record(out: Path, mt_bench: Path | None, per_group: int, n: int, threads: int) -> None:
    from tandem.bench import multiturn
    from tandem.bench.runner import BenchConfig
    from tandem.engine.backend.llama import ContextParams
    from tandem.engine.pair import PairSession, SessionOptions
    from tandem.engine.loop.speculative import GenParams
    from tandem.models.catalog import get_pair
    from tandem.models.store import Store

    convs = multiturn.builtin_conversations() + (
        multiturn.spec_bench_conversations(mt_bench) if mt_bench else [])
    convs = multiturn.select(convs, per_group)
    pair, store = get_pair(), Store()
    ctx = ContextParams(n_ctx=4096, n_threads=threads)
    rows = []
    with PairSession(store.ensure(pair.target), None,
                     SessionOptions(strategy="none", target_ctx=ctx)) as s:
        prompts: dict[str, list[int]] = {}
        real = s.generate

        def keep(tokens, gen, strategy=None, draft=None, record=True):
            prompts["last"] = list(tokens)
            return real(tokens, gen, strategy, draft, record)

        s.generate = keep
        for ev in multiturn.run_conversations(s, convs, [BenchConfig("plain", "none")],
                                              GenParams(max_tokens=n)):
            r = ev.result
            rows.append({"id": r.prompt_id, "category": r.category, "prompt": prompts["last"],
                         "output": r.tokens})
            print(f"{r.prompt_id:24} {r.category:16} {r.n_generated:4} tokens "
                  f"{r.tokens_per_second:5.1f} tok/s", file=sys.stderr)
            out.write_text(json.dumps(rows))


def simulate(drafter, prompt: list[int], output: list[int], costs, cap: int = 16):
    """(steps, drafted, accepted, predicted seconds) of greedy decoding with `drafter`."""
    import numpy as np

    from tandem.bench.replay import replay as replay_greedy

    r = replay_greedy(drafter, output, costs.verify_cost, prompt=prompt, limit=cap,
                      rng=np.random.default_rng(0))
    return len(r.steps), r.drafted, r.accepted, r.seconds


class Oracle:
    """Knows the output: of the tokens auto's indexes propose (every source, up to 16), drafts
    exactly the accepted ones, cut where this machine's verify costs say the batch pays best.
    No policy over these indexes can do better: it bounds what drafting from them gives."""

    name = "oracle"
    notes = ()  # the Drafter protocol (engine/drafting/drafters.py): nothing to say, no sources
    step_sources = ()

    def __init__(self, auto, costs, output_of):
        self.auto, self.costs, self.output_of = auto, costs, output_of
        self.n_max = 16

    def prefill(self, prompt):
        self.auto.prefill(prompt)

    def propose(self, tokens, room, sampling, rng, sample):
        from tandem.engine.drafting.drafters import Draft

        want = self.output_of(len(tokens))
        best: list[int] = []
        for _, cont, _ in self.auto.candidates(tokens, min(room, 16)):
            n = 0
            while n < len(cont) and n < len(want) and cont[n] == want[n]:
                n += 1
            best = cont[:n] if n > len(best) else best
        # the length with the most tokens per second of verify time (0: a plain step)
        k = max(range(len(best) + 1),
                key=lambda j: (j + 1) / self.costs.verify_cost(j + 1))
        return Draft(best[:k])

    def observe(self, step):
        pass


def policy(name: str, costs, history: list[list[int]]):
    from tandem.engine.drafting.auto import AutoDrafter
    from tandem.engine.drafting.drafters import DraftParams
    from tandem.engine.drafting.hybrid import HybridDrafter, HybridPolicy
    from tandem.engine.drafting.history import Library
    from tandem.engine.tuning.costs import CostModel

    costs = CostModel(dict(costs.verify), 0.0)
    draft = DraftParams(n_max=4, n_min=0)
    if name == "ngram":  # auto's n-gram drafting before the suffix index
        policy = HybridPolicy(name="auto", ngram_match=2, ngram_n=8, ngram_cap=16,
                              adaptive=True, guard=False)
        return HybridDrafter(None, draft, costs, policy, sources=None, budget=None)
    library = Library(None, remember=False)
    if name in ("auto", "oracle"):
        library.history.add_many(history)
    d = AutoDrafter(None, draft, costs, verify_limit=17, calibrated=None, notes=(),
                    library=library, knowledge=None)
    d.guard = None  # the replay has no wall clock to fall back on
    return d


def replay(path: Path, costs_path: Path, policies: list[str]) -> None:
    from tandem.engine.tuning.costs import CostModel

    costs = CostModel.load(costs_path)
    if costs is None:
        sys.exit(f"Error: cannot read costs from {costs_path}")
    rows = json.loads(path.read_text())
    # the fresh sessions' history: every answer of a turn before them, as run_conversations
    answers = [r["output"] for r in rows if not r["category"].endswith("fresh")]
    table: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        for name in policies:
            history = answers if r["category"].endswith("fresh") else []
            drafter = policy(name, costs, history)
            if name == "oracle":
                start = len(r["prompt"])
                drafter = Oracle(drafter, costs, lambda n, o=r["output"], b=start: o[n - b:])
            s, d, a, t = simulate(drafter, r["prompt"], r["output"], costs)
            plain = len(r["output"]) * costs.verify_cost(1)
            acc = table.setdefault((name, r["category"]), [0, 0, 0, 0, 0.0, 0.0])
            for i, v in enumerate((s, d, a, len(r["output"]), t, plain)):
                acc[i] += v
    print("| policy | turns | tokens | tokens/step | acceptance | predicted speedup |")
    print("|---|---|---|---|---|---|")
    for (name, cat), (s, d, a, n, t, plain) in sorted(table.items(), key=lambda x: (x[0][1], x[0][0])):
        print(f"| {name} | {cat} | {int(n)} | {n / s:.2f} | {a / max(d, 1):.0%} | "
              f"{plain / t:.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--record", type=Path)
    ap.add_argument("--replay", type=Path)
    ap.add_argument("--mt-bench", type=Path, help="Spec-Bench question.jsonl (two-turn rows)")
    ap.add_argument("--per-group", type=int, default=None)
    ap.add_argument("-n", type=int, default=256, help="tokens per turn when recording")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--costs", type=Path)
    ap.add_argument("--policies", default="ngram,auto-no-history,auto,oracle")
    args = ap.parse_args()
    if args.record:
        record(args.record, args.mt_bench, args.per_group, args.n, args.threads)
    if args.replay:
        if args.costs is None:
            sys.exit("Error: --replay needs --costs (a calibrated cost file)")
        replay(args.replay, args.costs, args.policies.split(","))


if __name__ == "__main__":
    main()
