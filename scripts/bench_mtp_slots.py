#!/usr/bin/env python3
"""What the MTP heads cost a step of `tandem serve` when they follow 1 slot and 4 (issue 53).

    python scripts/bench_mtp_slots.py [MODEL.gguf] [--reps N] [-n TOKENS] [--json OUT]

On a model with nextn layers (default: the tiny Qwen3.5 replica of
scripts/tiny_qwen35_models.py, written to a temporary folder; its compute is so small that
what is measured is mostly host work), greedy, one thread. Each configuration runs the
engine as serve runs it: one whole context for 1 slot (`--parallel 1`), a shared context of
4 slots + the kept one for 4, every answer stepped by the engine loop (StepLoop), -n tokens
each from the same four prompts (one at a time for 1 slot, together for 4).
Configurations: `none` (the heads neither follow nor draft: the reference) and `mtp` (they
follow every decode and draft). Per configuration, the medians over --reps interleaved
repetitions of: wall seconds per target step (a round: one target decode for every slot in
it), the seconds inside llama.cpp's target decodes per step (Context.time_llama), and the
rest, host work and the heads' own decodes. Printed as Markdown.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

PROMPTS = ("The quick brown fox jumps over the lazy dog.", "def main():\n    print('hello')",
           "Once upon a time", "A list of prime numbers: 2, 3, 5, 7,")


def run_config(path: Path, slots: int, strategy: str, n: int) -> dict:
    """One server-shaped session: its four answers, their target steps and times."""
    from tandem.engine.backend.context_params import ContextParams
    from tandem.engine.loop.events import DoneEvent
    from tandem.engine.loop.speculative import GenParams
    from tandem.engine.loop.step_loop import Generation, StepLoop
    from tandem.engine.pair import PairSession, SessionOptions

    ctx = ContextParams(n_ctx=1024, n_threads=1, n_threads_batch=1)
    opts = SessionOptions(strategy=strategy, target_ctx=ctx,
                          sequences=slots + 1 if slots > 1 else 1)
    gen = GenParams(max_tokens=n, ignore_eos=True)
    with PairSession(path, None, opts) as pair:
        prompts = [pair.tokenize(p, add_special=True) for p in PROMPTS]
        target = pair.target_ctx
        target.time_llama(True)
        steps = drafted = accepted = 0
        t0 = time.perf_counter()
        if slots == 1:
            for p in prompts:
                for ev in pair.generate(p, gen, strategy, record=False):
                    if isinstance(ev, DoneEvent):
                        steps += ev.stats.n_steps
                        drafted, accepted = drafted + ev.stats.drafted, accepted + ev.stats.accepted
        else:
            loop, done = StepLoop(pair.batcher), []
            for i, p in enumerate(prompts):
                loop.add(Generation(pair.generate(p, gen, strategy, slot=pair.slots[i],
                                                  record=False),
                                    lambda ev: done.append(ev) or True
                                    if isinstance(ev, DoneEvent) else True, lambda e: None))
            while loop.live:
                loop.step()
            steps = pair.batcher.figures.steps
            drafted = sum(ev.stats.drafted for ev in done)
            accepted = sum(ev.stats.accepted for ev in done)
        wall = time.perf_counter() - t0
        return {"steps": steps, "wall_s": wall, "llama_s": target.t_llama,
                "drafted": drafted, "accepted": accepted}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", type=Path, help="a GGUF with nextn layers")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("-n", type=int, default=64, help="tokens per answer (default 64)")
    ap.add_argument("--json", type=Path, help="write the rows here")
    ns = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = ns.model
        if path is None:
            from make_tiny_models import make_tiny_models
            path = make_tiny_models(Path(tmp))["qwen35"]
        configs = [(s, k) for s in (1, 4) for k in ("none", "mtp")]
        got: dict = {c: [] for c in configs}
        for rep in range(ns.reps):
            for c in configs if rep % 2 == 0 else configs[::-1]:
                got[c].append(run_config(path, c[0], c[1], ns.n))
    rows = []
    print(f"# MTP heads following 1 and 4 slots ({path.name}; greedy, 1 thread, "
          f"{len(PROMPTS)} answers of {ns.n} tokens, medians of {ns.reps})\n")
    print("| slots | strategy | target steps | ms a step | in llama.cpp's target decode "
          "| the rest (host, heads) | accepted / drafted |")
    print("|---|---|---|---|---|---|---|")
    for (slots, strategy), runs in got.items():
        ms = statistics.median(r["wall_s"] / r["steps"] for r in runs) * 1e3
        llama = statistics.median(r["llama_s"] / r["steps"] for r in runs) * 1e3
        r0 = runs[0]
        rows.append({"slots": slots, "strategy": strategy, "ms_step": ms, "llama_ms": llama,
                     "steps": r0["steps"], "drafted": r0["drafted"], "accepted": r0["accepted"]})
        print(f"| {slots} | {strategy} | {r0['steps']} | {ms:.3f} | {llama:.3f} | "
              f"{ms - llama:.3f} | {r0['accepted']} / {r0['drafted']} |")
    if ns.json:
        ns.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
