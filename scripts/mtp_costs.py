#!/usr/bin/env python3
"""What an MTP head costs next to its model's body, and what that predicts (issue 42).

    python scripts/mtp_costs.py [MODEL.gguf] [--repeats N] [--json]

On a model with nextn layers (default: the tiny glm4moe model of scripts/tiny_mtp_models.py,
written to a temporary folder), measured with the engine's own calls: the target's
single-token decode (t1) and verify batches of N rows (t(N)) with the heads following and
without, one head draft step, and the acceptance per draft position of a greedy
`--strategy mtp` run at --draft-max 4 on three prompts. Medians of --repeats timings, one
thread. From them: the predicted speedup per draft length k on this CPU, and with a GPU's
verify-cost ratios r(N) (/work/shared/HARDWARE.md 4.4: RTX 3090, RTX 4090) in place of this
CPU's, the head's cost kept at its measured share of t1. A prediction, not a measurement.
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
           "Once upon a time")
# verify-cost ratios r(N): GPUs from HARDWARE.md 4.4 (interpolated for N = 3, 5); this CPU's
# from REFERENCE.md's Qwen2.5-Coder-1.5B batch costs (2: 123 ms, 4: 127, 8: 211 over 84)
R = {"this CPU (1.5B's r)": {2: 1.46, 3: 1.49, 4: 1.51, 5: 1.76},
     "RTX 3090": {2: 1.12, 3: 1.22, 4: 1.32, 5: 1.51},
     "RTX 4090": {2: 1.12, 3: 1.20, 4: 1.27, 5: 1.32}}
K_MAX = 4


def _median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(path: Path, repeats: int, n_gpu_layers: int = 0, threads: int = 1) -> dict:
    from tandem.engine.backend.context_params import ContextParams
    from tandem.engine.backend.llama import Context, Model
    from tandem.engine.backend.mtp import use_mtp
    from tandem.engine.drafting.drafters import DraftParams
    from tandem.engine.drafting.mtp import MtpDrafter
    from tandem.engine.loop.events import DoneEvent
    from tandem.engine.loop.speculative import GenParams, generate

    model = Model(path, load_mtp=True, n_gpu_layers=n_gpu_layers)
    ctx = Context(model, ContextParams(n_ctx=1024, n_threads=threads))
    prompt = model.tokenize(PROMPTS[0], add_special=True)
    base = len(prompt)

    def verify(n: int):
        def run():
            ctx.decode(prompt[:n] if n <= base else prompt, all_logits=True)
            ctx.truncate(base)
        return run

    ctx.prefill(prompt)
    plain = {n: _median_s(verify(n), repeats) for n in range(1, K_MAX + 2)}
    head = use_mtp(ctx, True)
    following = {n: _median_s(verify(n), repeats) for n in range(1, K_MAX + 2)}

    def head_step():
        head.start(prompt[-1])
        head.end()

    t_head = _median_s(head_step, repeats)
    drafter = MtpDrafter(head, DraftParams(n_max=K_MAX, n_min=0, p_min=0.0))
    drafted_at, accepted_at = [0] * K_MAX, [0] * K_MAX
    for text in PROMPTS:
        for ev in generate(ctx, model.tokenize(text, add_special=True), drafter,
                           GenParams(max_tokens=80, ignore_eos=True)):
            if isinstance(ev, DoneEvent):
                for i, (d, a) in enumerate(zip(ev.stats.drafted_at, ev.stats.accepted_at)):
                    drafted_at[i] += d
                    accepted_at[i] += a
    ctx.close()
    model.close()
    return {"t1_s": plain[1], "verify_s": plain, "verify_following_s": following,
            "head_step_s": t_head, "drafted_at": drafted_at, "accepted_at": accepted_at}


def greedy_equal(path: Path, n_gpu_layers: int = 0, threads: int = 1) -> bool:
    """Whether greedy `--strategy mtp` output equals plain decoding on the three prompts."""
    from tandem.engine.backend.context_params import ContextParams
    from tandem.engine.backend.llama import Context, Model
    from tandem.engine.backend.mtp import use_mtp
    from tandem.engine.drafting.drafters import DraftParams, NoDrafter
    from tandem.engine.drafting.mtp import MtpDrafter
    from tandem.engine.loop.events import DoneEvent
    from tandem.engine.loop.speculative import GenParams, generate

    model = Model(path, load_mtp=True, n_gpu_layers=n_gpu_layers)
    ctx = Context(model, ContextParams(n_ctx=1024, n_threads=threads))
    try:
        out = []
        for drafter in (NoDrafter(), None):
            if drafter is None:
                drafter = MtpDrafter(use_mtp(ctx, True), DraftParams(n_max=K_MAX, n_min=0,
                                                                    p_min=0.0))
            out.append([[ev.tokens for ev in generate(
                ctx, model.tokenize(text, add_special=True), drafter,
                GenParams(max_tokens=80, ignore_eos=True)) if isinstance(ev, DoneEvent)]
                for text in PROMPTS])
        return out[0] == out[1]
    finally:
        ctx.close()
        model.close()


def predict(m: dict, head_share: float | None = None,
            mirror_share: float | None = None) -> dict:
    """Speedup per draft length k: tokens per step (1 + the drafts accepted through each
    position, every step drafting k at p_min 0) over a step's cost in t1 units: the verify
    batch (measured here with the heads following; else r(k+1) of R) plus the heads reading
    it and k head steps. The heads' shares are the measured ones unless given (a real model's,
    from its weights: docs/benchmarks.md)."""
    t1 = m["t1_s"]
    through = [a / d if d else 0.0 for a, d in zip(m["accepted_at"], m["drafted_at"])]
    c_head = m["head_step_s"] / t1 if head_share is None else head_share
    extra = {n: (m["verify_following_s"][n] - m["verify_s"][n]) / t1 if mirror_share is None
             else mirror_share for n in m["verify_s"]}
    out: dict = {"head_over_t1": c_head, "mirror_over_t1": extra,
                 "accepted_through": through, "by_k": {}}
    for k in range(1, K_MAX + 1):
        tokens = 1.0 + sum(through[:k])
        row = {"tokens_per_step": tokens,
               "measured here": tokens / (m["verify_s"][k + 1] / t1 + extra[k + 1]
                                          + k * c_head)}
        for device, r in R.items():
            row[device] = tokens / (r[k + 1] + extra[k + 1] + k * c_head)
        out["by_k"][k] = row
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", type=Path)
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--head-share", type=float, help="a head step's cost in t1 (default: measured)")
    ap.add_argument("--mirror-share", type=float,
                    help="the heads reading a verify batch, in t1 (default: measured)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model
        if path is None:
            from tiny_mtp_models import make_mtp_models

            path = make_mtp_models(Path(tmp))["mtp"]
        m = measure(path, args.repeats)
    pred = predict(m, args.head_share, args.mirror_share)
    if args.json:
        print(json.dumps({"measured": m, "predicted": pred}, indent=1))
        return 0
    t1 = m["t1_s"]
    print(f"t1 {t1 * 1e3:.3f} ms; head step {m['head_step_s'] * 1e3:.3f} ms "
          f"({pred['head_over_t1']:.2f} t1)")
    for n in sorted(m["verify_s"]):
        print(f"t({n}) {m['verify_s'][n] / t1:.2f} t1 plain, "
              f"{m['verify_following_s'][n] / t1:.2f} t1 with the heads following")
    print("drafts accepted through position i: "
          + ", ".join(f"{a:.2f}" for a in pred["accepted_through"]))
    print(f"predicted speedup with a head step of {pred['head_over_t1']:.3f} t1 "
          "(k: tokens/step, measured here, " + ", ".join(R) + ")")
    for k, row in pred["by_k"].items():
        print(f"  k={k}: {row['tokens_per_step']:.2f}, {row['measured here']:.2f}x, "
              + ", ".join(f"{row[g]:.2f}x" for g in R))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
