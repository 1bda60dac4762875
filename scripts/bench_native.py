#!/usr/bin/env python3
"""tandem against llama.cpp's native tools, side by side, same pair, prompt and settings.

Runs llama-speculative-simple and tandem's draft strategy with the same n_max / p_min /
threads / greedy sampling on the same rendered prompts, then plain decoding against
llama-bench (tg) and llama-simple; prints tokens/s and the tandem/native ratio (Markdown).
Native tools come from scripts/build_native.sh (same vendored llama.cpp, same CMake flags).

  .venv/bin/python scripts/bench_native.py                  # default pair from the store
  .venv/bin/python scripts/bench_native.py --n-max 3 --n-max 8 --reps 2 -n 128
"""
from __future__ import annotations

import argparse
import csv
import io
import re
import statistics
import subprocess
import sys
from pathlib import Path

from native_tools import native_bin

ROOT = Path(__file__).resolve().parents[1]

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Write a Python class implementing a stack with push, pop and peek, with docstrings.",
    "Write a bash script that finds the ten largest files under a directory.",
    "Implement binary search in C and explain its complexity.",
    "Write a SQL query that returns the top 5 customers by total order value, then explain it.",
]




def run_native_spec(bin_dir: Path, target: Path, draft: Path, prompt: str, n: int, n_max: int,
                    p_min: float, threads: int, ctx: int, repack: bool) -> tuple[float, str]:
    cmd = [str(bin_dir / "llama-speculative-simple"), "-m", str(target), "-md", str(draft),
           "-p", prompt, "-n", str(n), "--spec-type", "draft-simple",
           "--spec-draft-n-max", str(n_max), "--spec-draft-p-min", str(p_min),
           "-t", str(threads), "-td", str(threads), "--temp", "0", "-c", str(ctx), "-s", "1"]
    if not repack:
        cmd.append("--no-repack")
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    m = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+)", res.stderr)
    if res.returncode != 0 or not m:
        raise RuntimeError(f"llama-speculative-simple failed:\n{res.stderr[-2000:]}")
    acc = re.search(r"accept\s+=\s+([\d.]+)%", res.stderr)
    return float(m.group(3)), (acc.group(1) + "%") if acc else "?"


def run_llama_bench(bin_dir: Path, model: Path, n: int, threads: int, reps: int,
                    repack: bool) -> float:
    cmd = [str(bin_dir / "llama-bench"), "-m", str(model), "-p", "0", "-n", str(n),
           "-t", str(threads), "-r", str(reps), "-o", "csv", "--repack", "1" if repack else "0"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=True)
    rows = list(csv.DictReader(io.StringIO(res.stdout)))
    return float(rows[-1]["avg_ts"])


def run_llama_simple(bin_dir: Path, model: Path, prompt: str, n: int) -> float:
    res = subprocess.run([str(bin_dir / "llama-simple"), "-m", str(model), "-n", str(n), prompt],
                         capture_output=True, text=True, timeout=900)
    m = re.search(r"decoded (\d+) tokens in ([\d.]+) s, speed: ([\d.]+) t/s", res.stderr)
    if not m:
        raise RuntimeError(f"llama-simple failed:\n{res.stderr[-2000:]}")
    return float(m.group(3))


MODES = {
    # mode: (tandem target repack, tandem draft repack, native repack, what it compares)
    "exact": (False, False, False, "both without weight repacking (tandem's exact mode)"),
    "repack": (True, True, True, "both with repacking (llama.cpp's default; not batch-invariant)"),
    "default": (False, True, False, "tandem's defaults (draft repacked) vs native without repacking"),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", type=Path)
    ap.add_argument("--draft", type=Path)
    ap.add_argument("--n-max", type=int, action="append", help="draft lengths (repeatable)")
    ap.add_argument("--mode", choices=sorted(MODES), action="append",
                    help="weight repacking on each side (repeatable; default: exact and repack)")
    ap.add_argument("--p-min", type=float, default=0.75)
    ap.add_argument("-n", type=int, default=128, help="tokens to generate")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--no-plain", action="store_true", help="skip the plain-decoding rows")
    ap.add_argument("--auto", action="store_true",
                    help="add tandem's auto (its own adaptive choices) against the best native n_max")
    ns = ap.parse_args()
    n_maxes = ns.n_max or [3]
    modes = ns.mode or ["exact", "repack"]

    from tandem.engine.backend import template as chat_template
    from tandem.engine.loop.events import DoneEvent
    from tandem.engine.backend.llama import ContextParams
    from tandem.engine.pair import PairSession, SessionOptions
    from tandem.engine.drafting.drafters import DraftParams
    from tandem.engine.loop.speculative import GenParams

    if ns.target is None:
        from tandem.models.catalog import get_pair
        from tandem.models.store import Store

        pair, store = get_pair(), Store()
        ns.target, ns.draft = store.ensure(pair.target), store.ensure(pair.draft)
    bin_dir = native_bin()
    prompts = PROMPTS[:ns.prompts]
    print(f"# tandem vs native llama.cpp ({ns.target.name} + {ns.draft.name}, greedy, "
          f"{ns.n} tokens, {ns.threads} threads, p_min {ns.p_min}, {len(prompts)} prompts)\n")
    print("| mode | config | native tok/s | tandem tok/s | ratio | native accept | tandem accept |")
    print("|---|---|---|---|---|---|---|")
    for mode in modes:
        t_repack, d_repack, n_repack, _ = MODES[mode]
        opts = SessionOptions(strategy="draft", repack=t_repack, draft_repack=d_repack,
                              target_ctx=ContextParams(n_ctx=ns.ctx, n_threads=ns.threads))
        session = PairSession(ns.target, ns.draft, opts)

        def tandem_run(tokens, strategy, draft=None):
            session.target_ctx.truncate(0)
            session.draft_ctx.truncate(0)
            for ev in session.generate(tokens, GenParams(max_tokens=ns.n), strategy=strategy,
                                       draft=draft):
                if isinstance(ev, DoneEvent):
                    return ev
            raise RuntimeError("no DoneEvent")

        rendered = [chat_template.render(session.target, [{"role": "user", "content": p}])
                    for p in prompts]
        token_lists = [session.target.tokenize(r, add_special=True, parse_special=True)
                       for r in rendered]
        tandem_run(token_lists[0], "none")  # warm-up: page the weights in
        native_best: dict[int, float] = {}
        for n_max in n_maxes:
            nat, tan, nacc, tacc = [], [], [], []
            for rep in range(ns.reps):
                for text, toks in zip(rendered, token_lists):
                    # alternate who goes first, so drift hits both alike
                    for which in ((0, 1) if rep % 2 == 0 else (1, 0)):
                        if which == 0:
                            tps, acc = run_native_spec(bin_dir, ns.target, ns.draft, text, ns.n,
                                                       n_max, ns.p_min, ns.threads, ns.ctx,
                                                       n_repack)
                            nat.append(tps)
                            nacc.append(acc)
                        else:
                            done = tandem_run(toks, "draft", DraftParams(n_max, 0, ns.p_min))
                            tan.append(done.stats.tokens_per_second)
                            tacc.append(f"{100 * done.stats.acceptance_rate:.1f}%")
            a, b = statistics.mean(nat), statistics.mean(tan)
            native_best[n_max] = a
            print(f"| {mode} | draft n_max={n_max} | {a:.2f} | {b:.2f} | {b / a:.3f} | "
                  f"{', '.join(nacc)} | {', '.join(tacc)} |")
            sys.stdout.flush()
        if ns.auto:
            best_n = max(native_best, key=native_best.get)
            auto = [tandem_run(t, "auto").stats.tokens_per_second
                    for _ in range(ns.reps) for t in token_lists]
            a, b = native_best[best_n], statistics.mean(auto)
            print(f"| {mode} | tandem auto vs best native (n_max={best_n}) | {a:.2f} | {b:.2f} | "
                  f"{b / a:.3f} | | |")
            sys.stdout.flush()
        if not ns.no_plain:
            plain = [tandem_run(t, "none").stats.tokens_per_second for t in token_lists]
            tp = statistics.mean(plain)
            bench = run_llama_bench(bin_dir, ns.target, ns.n, ns.threads, max(ns.reps, 3), t_repack)
            print(f"| {mode} | plain vs llama-bench tg{ns.n} | {bench:.2f} | {tp:.2f} | "
                  f"{tp / bench:.3f} | | |")
            if t_repack:  # llama-simple has no repacking switch: compare it in repack mode only
                simple = statistics.mean(run_llama_simple(bin_dir, ns.target, r, ns.n)
                                         for r in rendered[:2])
                print(f"| {mode} | plain vs llama-simple | {simple:.2f} | {tp:.2f} | "
                      f"{tp / simple:.3f} | | |")
            sys.stdout.flush()
        session.close()
    print("\nmodes: " + "; ".join(f"{m} = {MODES[m][3]}" for m in modes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
