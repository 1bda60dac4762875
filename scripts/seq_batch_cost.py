"""What one step of several sequences costs: gpu_check's `seq_batch` section.

The several-sequence engine (docs/architecture.md) gathers every active sequence's rows, 1 for a
plain step or 1 + its drafts for a verify step, into one decode. This times such a decode for
N = 1, 2, 4, 8 sequences, with logits on every row as verification needs, against one
sequence's single-token step in the same context: the cost curve that says what serving N
requests at once costs per step.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

SEQS = (1, 2, 4, 8)
SHIFT = 4  # each sequence's prompt starts this many tokens after the previous one's


def measure_seq_batch(path: Path, ns, prompt_tokens: int) -> dict:
    """ms and ratio[rows per sequence][N]: rows 1 (plain) and 1 + ns.n_max (a verify step);
    ratio 1.0 is one sequence's single-token step. Every sequence first holds prompt_tokens
    tokens; the timed rows are removed again after each timing. one_seq_context_ms: the same
    single-token step in a context of one sequence, as tandem decodes today (what a context
    of several costs a lone request). ns: ngl, threads, n_max, reps."""
    from batch_invariance import TEXT
    from tandem.engine.backend import llama

    widths = (1, 1 + ns.n_max)
    n = max(SEQS)
    model = llama.Model(path, n_gpu_layers=ns.ngl)
    try:
        tokens = model.tokenize(TEXT, add_special=True, parse_special=False)
        # llama.cpp splits n_ctx evenly between the sequences (kv_unified off, its default)
        per_seq = -(-(prompt_tokens + max(widths)) // 256) * 256
        params = llama.ContextParams(n_ctx=n * per_seq, n_threads=ns.threads, n_seq_max=n,
                                     n_outputs_max=max(llama.MAX_OUTPUTS, n * max(widths)))
        ctx = llama.Context(model, params)
        alone = llama.Context(model, llama.ContextParams(n_ctx=per_seq, n_threads=ns.threads))
        try:
            alone.prefill(tokens[:prompt_tokens])
            starts = [SHIFT * s for s in range(n)]
            for s, a in enumerate(starts):
                ctx.decode_seqs({s: tokens[a:a + prompt_tokens]}, all_logits=False)
            clock = time.perf_counter

            def step(seqs: int, width: int) -> float:
                rows = {s: tokens[starts[s] + prompt_tokens:starts[s] + prompt_tokens + width]
                        for s in range(seqs)}
                t0 = clock()
                ctx.decode_seqs(rows)  # returns once the logits are on the host
                took = clock() - t0
                for s in rows:
                    ctx.truncate_seq(s, prompt_tokens)
                return took

            def lone() -> float:
                t0 = clock()
                alone.decode(tokens[prompt_tokens:prompt_tokens + 1])
                took = clock() - t0
                alone.truncate(prompt_tokens)
                return took

            step(n, max(widths))  # warm-up: first-use costs of the largest batch
            lone()
            times: dict[int, dict[int, list[float]]] = {w: {k: [] for k in SEQS} for w in widths}
            lone_times = []
            for _ in range(ns.reps):  # interleaved: a load change touches every size alike
                lone_times.append(lone())
                for w in widths:
                    for k in SEQS:
                        times[w][k].append(step(k, w))
            context = {"n_seq_max": ctx.n_seq_max, "n_ctx_seq": ctx.n_ctx_seq,
                       "flash_attn": ctx.params.flash_attn, "type_k": ctx.params.type_k}
        finally:
            ctx.close()
            alone.close()
    finally:
        model.close()
    ms = {str(w): {str(k): round(1e3 * statistics.median(v), 4) for k, v in by_n.items()}
          for w, by_n in times.items()}
    base = ms["1"]["1"]
    return {"ms": ms, "ratio": {w: {k: round(v / base, 4) for k, v in by_n.items()}
                                for w, by_n in ms.items()},
            "one_seq_context_ms": round(1e3 * statistics.median(lone_times), 4),
            "seqs": list(SEQS), "rows_per_seq": list(widths), "prompt_tokens": prompt_tokens,
            "reps": ns.reps, "context": context}


def seq_batch_line(name: str, s: dict) -> str:
    """One summary line: each width's ratio at every N."""
    parts = [f"{w} row{'s' if w != '1' else ''}/seq " + "/".join(f"{r[k]:.2f}" for k in r)
             for w, r in s["ratio"].items()]
    return (f"  seq_batch {name}: x one sequence's token at {'/'.join(map(str, s['seqs']))} "
            f"sequences: " + "; ".join(parts) + f" (that token {s['ms']['1']['1']:.3f} ms, "
            f"{s['one_seq_context_ms']:.3f} in a context of one sequence)")
