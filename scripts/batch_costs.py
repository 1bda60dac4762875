#!/usr/bin/env python3
"""The batch curve of `tandem serve --parallel` on this host: what a draft row costs when b
sequences share one llama_decode, and where `auto` stops drafting (issue 41).

    python scripts/batch_costs.py [-m TARGET.gguf] [-t THREADS] [--reps N] [--json OUT]

The target (default: the default pair's, from the store) in serve's shared context
(engine/pair.py shared_context: a unified KV cache of --ctx tokens per slot for the largest
b, sequences 1..b its slots), each slot holding --prompt-tokens of a built-in workload prompt.
Timed (tandem.bench.hw_costs.time_layouts, medians of --reps, interleaved, rows removed
after each timing): b sequences of 1 + k rows each (k in --drafts), and b sequences of which
one drafts k (1 + k rows, the others 1: the batch one sequence's draft joins), k up to 16.
Printed as Markdown: per b, raw(b) (b plain rows), the marginal cost of one draft row
raw(b + 1) - raw(b) in ms and in plain single-sequence steps raw(1), the longest free draft
auto's length controller takes at each --accept per position (BatchCosts over the curve of
b plain rows and one sequence's 1..16 drafts beside b - 1 plain ones, each timing's spread as
its noise), and the cost of k drafts per sequence. Figures in ms; --json OUT writes them all.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

SEQS = (1, 2, 4, 8)
DRAFTS = (0, 1, 2, 4, 8)  # drafts per sequence, every sequence drafting
ONE_DRAFTS = (1, 2, 4, 8, 16)  # drafts of one sequence beside b - 1 plain ones (auto's cap 16)
ACCEPT = (0.6, 0.8, 0.9)


def build_parser() -> argparse.ArgumentParser:
    doc = __doc__ or ""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(doc.splitlines()[1:]))
    ap.add_argument("-m", "--model", type=Path, help="target GGUF (default: the default pair's)")
    ap.add_argument("-t", "--threads", type=int, default=2, help="threads (default 2)")
    ap.add_argument("--reps", type=int, default=5, help="timings per layout (default 5)")
    ap.add_argument("--prompt-tokens", type=int, default=200,
                    help="tokens each sequence holds before the timed rows (default 200)")
    ap.add_argument("--ctx", type=int, default=4096,
                    help="context per slot, as serve's --ctx-size (default 4096)")
    ap.add_argument("--seqs", default=",".join(map(str, SEQS)),
                    help="sequences per batch (default %(default)s)")
    ap.add_argument("--accept", default=",".join(map(str, ACCEPT)),
                    help="acceptance per draft position priced (default %(default)s)")
    ap.add_argument("--no-repack", action="store_true",
                    help="unrepacked weights, as exact mode loads the target (default: "
                         "repacked, as serve's fast mode does)")
    ap.add_argument("--json", type=Path, metavar="OUT", help="write the figures as JSON")
    return ap


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def target_path(model: Path | None) -> Path:
    if model is not None:
        return model
    from bench_peer import resolve_models

    return resolve_models(argparse.Namespace(model=None, model_draft=None))[0]


def prompts(model, n: int, need: int) -> list[list[int]]:
    """n token lists of at least `need` tokens: built-in workload prompts, each sequence's
    starting at another one, joined until long enough."""
    from tandem.bench.workloads import builtin

    texts = [p.text for p in builtin()]
    out = []
    for i in range(n):
        start = 3 * i % len(texts)
        joined, toks = "", []
        for text in texts[start:] + texts[:start]:
            joined = f"{joined}\n\n{text}" if joined else text
            toks = model.tokenize(joined, add_special=True, parse_special=False)
            if len(toks) >= need:
                break
        else:
            raise RuntimeError(f"the built-in prompts make {len(toks)} tokens, {need} needed")
        out.append(toks)
    return out


def layouts(seqs: list[int]) -> tuple[dict, dict]:
    """({(b, k): every one of b sequences drafting k}, {(b, k): one of b drafting k})."""
    every = {(b, k): (1 + k,) * b for b in seqs for k in DRAFTS}
    one = {(b, k): (1 + k,) + (1,) * (b - 1) for b in seqs for k in ONE_DRAFTS}
    return every, one


def curve(times: dict[tuple[int, ...], list[float]], b: int) -> tuple[dict, dict]:
    """The curve one of b sequences' drafts are priced on, {total rows: seconds} and {total
    rows: spread}: b rows, b plain sequences; b + k rows, one of them drafting k. A timing's
    spread is the mean of |timing / median - 1| (the noise a session's observe_verify
    averages)."""
    verify: dict[int, float] = {}
    spread: dict[int, float] = {}
    for k in (0, *ONE_DRAFTS):
        layout = (1 + k,) + (1,) * (b - 1)
        med = statistics.median(times[layout])
        verify[b + k] = med
        spread[b + k] = statistics.fmean(abs(t / med - 1) for t in times[layout])
    return verify, spread


def figures(times: dict[tuple[int, ...], list[float]], seqs: list[int],
            accept: list[float]) -> dict:
    """The table's figures from the timings (ms, rounded to 4 decimals; ratios to 4)."""
    from tandem.engine.drafting.adaptive import longest_paying
    from tandem.engine.tuning.costs import BatchCosts, CostModel

    every, one = layouts(seqs)

    def ms(layout) -> float:
        return round(1e3 * statistics.median(times[layout]), 4)

    raw1 = ms(every[(1, 0)])
    rows = []
    for b in seqs:
        raw = ms(every[(b, 0)])
        marginal = round(ms(one[(b, 1)]) - raw, 4)
        verify, spread = curve(times, b)
        costs = BatchCosts(CostModel(verify=verify, spread=spread), lambda b=b: b - 1)
        rows.append({
            "b": b, "raw_ms": raw, "share_ms": round(raw / b, 4),
            "row_ms": marginal, "row_plain": round(marginal / raw1, 4),
            "one_drafts_ms": {str(k): ms(one[(b, k)]) for k in ONE_DRAFTS},
            "every_drafts_ms": {str(k): ms(every[(b, k)]) for k in DRAFTS},
            "every_drafts_ratio": {str(k): round(ms(every[(b, k)]) / raw, 4) for k in DRAFTS},
            "spread": {str(n): round(v, 4) for n, v in spread.items()},
            "longest": {str(a): longest_paying(costs, a) for a in accept},
        })
    return {"raw1_ms": raw1, "rows": rows}


def measure(path: Path, threads: int, reps: int, prompt_tokens: int, ctx_per_slot: int,
            seqs: list[int], accept: list[float], repack: bool = True) -> dict:
    from tandem.bench.hw_costs import time_layouts
    from tandem.engine.backend import llama
    from tandem.engine.backend.context_params import ContextParams
    from tandem.engine.pair import shared_context
    from tandem.engine.tuning.costs import cpu_snapshot, others_share

    llama.init_backend()
    every, one = layouts(seqs)
    todo = list(dict.fromkeys([*every.values(), *one.values()]))  # b = 1: the same layouts
    n = max(seqs)
    model = llama.Model(path, repack=repack)  # the weights' layout sets the kernels' costs
    try:
        toks = prompts(model, n, prompt_tokens + 1 + max(ONE_DRAFTS))
        params = shared_context(ContextParams(n_ctx=ctx_per_slot, n_threads=threads,
                                              n_threads_batch=threads), n)
        ctx = llama.Context(model, params)
        try:
            t0, before = time.monotonic(), cpu_snapshot()
            done = iter(range(reps))
            times = time_layouts(ctx, toks, todo, reps, prompt_tokens, first_seq=1,
                                 before_rep=lambda: print(
                                     f"repetition {next(done) + 1}/{reps} at "
                                     f"{time.monotonic() - t0:.0f} s", file=sys.stderr))
            busy = others_share(before, cpu_snapshot())
            seconds = time.monotonic() - t0
            context = {"n_ctx": ctx.n_ctx, "n_seq_max": ctx.n_seq_max, "kv_unified": True,
                       "flash_attn": ctx.params.flash_attn, "type_k": ctx.params.type_k,
                       "type_v": ctx.params.type_v}
        finally:
            ctx.close()
    finally:
        model.close()
    return {"model": path.name, "threads": threads, "reps": reps, "repacked": repack,
            "prompt_tokens": prompt_tokens, "ctx_per_slot": ctx_per_slot, "context": context,
            "when": time.strftime("%Y-%m-%d %H:%M"), "nproc": os.cpu_count(),
            "cpu": cpu_model(), "busy": None if busy is None else round(busy, 3),
            "seconds": round(seconds, 1), "accept": accept,
            "layouts_ms": {"+".join(map(str, lay)): [round(1e3 * t, 4) for t in times[lay]]
                           for lay in todo},
            **figures(times, seqs, accept)}


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def markdown(doc: dict) -> str:
    accept = doc["accept"]
    busy = "" if doc["busy"] is None else f", other processes {doc['busy']:.0%} of the CPU"
    weights = "repacked" if doc["repacked"] else "unrepacked"
    lines = [f"{doc['model']} ({weights}), {doc['threads']} threads, {doc['nproc']} CPUs ({doc['cpu']}), "
             f"{doc['when']}; {doc['prompt_tokens']} tokens per sequence, medians of "
             f"{doc['reps']}, {doc['seconds']} s{busy}", "",
             "| b | raw(b) ms | raw(b)/b | draft row: raw(b+1) - raw(b) ms | x raw(1) | "
             + " | ".join(f"auto's longest at {a}" for a in accept) + " |",
             "|---" * (5 + len(accept)) + "|"]
    for r in doc["rows"]:
        lines.append(f"| {r['b']} | {r['raw_ms']:.2f} | {r['share_ms']:.2f} | "
                     f"{r['row_ms']:.2f} | {r['row_plain']:.2f} | "
                     + " | ".join(str(r["longest"][str(a)]) for a in accept) + " |")
    ks = [k for k in doc["rows"][0]["every_drafts_ms"] if k != "0"]
    lines += ["", "b sequences x (1 + k) rows, ms (x raw(b)):", "",
              "| b | " + " | ".join(f"k = {k}" for k in ks) + " |", "|---" * (1 + len(ks)) + "|"]
    for r in doc["rows"]:
        lines.append(f"| {r['b']} | " + " | ".join(
            f"{r['every_drafts_ms'][k]:.1f} ({r['every_drafts_ratio'][k]:.2f})" for k in ks)
            + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    seqs, accept = _ints(ns.seqs), [float(a) for a in ns.accept.split(",")]
    if not seqs or min(seqs) < 1 or 1 not in seqs:
        raise SystemExit("Error: --seqs must hold 1 (raw(1) is the unit) and positive counts")
    doc = measure(target_path(ns.model), ns.threads, ns.reps, ns.prompt_tokens, ns.ctx,
                  sorted(set(seqs)), accept, repack=not ns.no_repack)
    print(markdown(doc))
    if ns.json:
        ns.json.write_text(json.dumps(doc, indent=1))
        print(f"wrote {ns.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
