#!/usr/bin/env python3
"""tandem's thread count on a busy machine: its defaults against fixed counts and llama-server.

Issue 32: llama.cpp's threads wait for the slowest at every barrier, so one core that another
program keeps busy stalls every step; tandem's engine chooses the thread count that is fastest
now (engine/tuning/threads.py) when the user did not fix one. This measures it on the default pair
(or -m/-md) in three conditions, one after another:

  quiet   nothing else runs
  loops   two CPU-bound loops of another program (`python -c "while 1: pass"` x2)
  llama   another llama.cpp process decoding on every core (llama-bench -t <cores> -p 0,
          repeated; built by scripts/build_native.sh; --rival tandem: a loop of
          `tandem run -t <cores> --strategy none` instead)

In each condition, prompt by prompt and interleaved (every other prompt in reverse order),
these configurations generate the same greedy answer: `tandem run` with its defaults (no -t),
`tandem run -t N` for each fixed count (--fixed-threads, default 1,2: issue 51 holds the
defaults to 0.9x of the better of the two under `loops`), and llama-server with its defaults
(no -t; one server process for the whole run, idle between its requests; --no-server leaves it
out). The llama-server and tandem plumbing, the warm-up and the interleaved loop are
bench_peer's (tandem.bench.peer_runs); decode tok/s is counted as there (end-of-text counted as
llama-server counts it). Prints per condition the median decode tok/s of each configuration
and the medians of the per-prompt ratios, beside the issue's bars, and which thread count
tandem's defaults chose (from its notes); --out keeps every row (JSON).

  .venv/bin/python scripts/bench_contention.py --prompts 8 --out contention.json
  .venv/bin/python scripts/bench_contention.py --prompts 1 -n 32 --conditions quiet,loops
  .venv/bin/python scripts/bench_contention.py --prompts 4 -n 48 --conditions loops --no-server
"""
from __future__ import annotations

import argparse
import math
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_peer import DEFAULT_PROMPTS, default_tandem, log, pair_parser, resolve_models
from native_tools import native_bin
from tandem.bench.llama_server import LlamaServer
from tandem.bench.peer_report import Row
from tandem.bench.peer_runs import (
    CODING_PROMPTS,
    exit_status,
    interleaved,
    load_prompts,
    log_folder,
    run_rows,
    server_row,
    tandem_command,
    tandem_row,
    warm_up,
)
from tandem.bench.workloads import Prompt as BenchPrompt

CONDITIONS = ("quiet", "loops", "llama")
DEFAULTS, FIXED, SERVER, BEST = "tandem defaults", "tandem -t {n}", "llama-server", "best -t"
# the issues' bars: condition -> {(numerator, denominator): minimum}; FIXED's {n} is the
# machine's core count (issue 32: against llama.cpp's own count), BEST the better of the fixed
# counts measured on the run's medians (issue 51: the default within 10% of the best fixed)
BARS = {"quiet": {(DEFAULTS, FIXED): 1.0},
        "loops": {(DEFAULTS, FIXED): 1.5, (DEFAULTS, SERVER): 1.0, (DEFAULTS, BEST): 0.9},
        "llama": {(DEFAULTS, FIXED): 5.0, (DEFAULTS, SERVER): 1.0}}
THREADS_NOTE = re.compile(r"threads: (\d+)(?: of \d+| -> (\d+) at step)")


# ----------------------------------------------------------------------------- rivals

def start_rivals(condition: str, ns, model: Path, tandem: list[str], model_args: list[str],
                 pair: str | None) -> list[subprocess.Popen]:
    """The other program of a condition, started in its own process group."""
    cores = os.cpu_count() or 2
    if condition == "quiet":
        return []
    if condition == "loops":
        cmds = [[sys.executable, "-c", "while 1: pass"]] * ns.loops
    elif ns.rival == "llama-bench":
        rival_bin = ns.rival_bin or native_bin() / "llama-bench"
        if not Path(rival_bin).exists():
            raise SystemExit(f"Error: {rival_bin} not found (scripts/build_native.sh builds it; "
                             "or --rival tandem)")
        cmds = [[str(rival_bin), "-m", str(ns.rival_model or model), "-t", str(cores),
                 "-p", "0", "-n", "256", "-r", "1000000"]]
    else:
        run = [*tandem, "run", "-t", str(cores), "--strategy", "none", "-n", "512",
               "--temp", "0", *model_args, "--", *([pair] if pair else []),
               "Write a long story about a lighthouse keeper."]
        cmds = [["bash", "-c", f"while :; do {shlex.join(run)} >/dev/null 2>&1; done"]]
    procs = [subprocess.Popen(c, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True) for c in cmds]
    time.sleep(ns.rival_warmup)  # a model to load before it decodes
    for p in procs:
        if p.poll() is not None:
            stop_rivals(procs)
            raise SystemExit(f"Error: the {condition} rival exited with code {p.returncode}: "
                             f"{shlex.join(p.args)}")
    return procs


def stop_rivals(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)  # its own group: the loop and its children
            except ProcessLookupError:
                pass
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)


# ----------------------------------------------------------------------------- report

def ratio_median(rows: list[Row], num: str, den: str) -> tuple[float, int]:
    """Median over prompts of num's decode tok/s over den's on the same prompt (and how many
    prompts both measured)."""
    by = {(r.prompt_id, r.config): r for r in rows if r.ok}
    ratios = [by[(p, num)].tok_s / by[(p, den)].tok_s
              for p in dict.fromkeys(r.prompt_id for r in rows)
              if (p, num) in by and (p, den) in by]
    return (statistics.median(ratios) if ratios else float("nan")), len(ratios)


def threads_chosen(rows: list[Row]) -> str:
    """The thread count tandem's defaults ended each request with, from its notes: `2 (3
    prompts), 1 (5)`; without a threads note the count is the default (all cores)."""
    counts: dict[str, int] = {}
    for r in rows:
        if r.config != DEFAULTS or not r.ok:
            continue
        last = "default"
        for note in r.extra.get("notes") or []:
            m = THREADS_NOTE.match(note)
            if m:
                last = m.group(2) or m.group(1)
        counts[last] = counts.get(last, 0) + 1
    return ", ".join(f"{k} ({v})" for k, v in counts.items()) or "-"


def _median_speed(rows: list[Row], config: str) -> float | None:
    speeds = [r.tok_s for r in rows if r.config == config and r.ok]
    return statistics.median(speeds) if speeds else None


def best_fixed(rows: list[Row], fixed: list[str]) -> str | None:
    """The fixed thread count with the highest median decode tok/s in `rows`."""
    speeds = {f: _median_speed(rows, f) for f in fixed}
    measured = [f for f in fixed if speeds[f] is not None]
    return max(measured, key=lambda f: speeds[f]) if measured else None


def render(rows: list[Row], conditions: list[str], fixed: list[str], server: bool = True,
           cores: int | None = None) -> str:
    """The table: median tok/s per configuration, the defaults' per-prompt ratio medians
    against each fixed count, the better of them and llama-server, and the bars."""
    cores = cores or os.cpu_count() or 2
    others = [*fixed, *([SERVER] if server else [])]
    head = (["condition", "prompts", f"{DEFAULTS} tok/s"] + [f"{o} tok/s" for o in others]
            + [f"defaults / {o}" for o in others] + [f"defaults / {BEST}", "bars", "threads chosen"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for cond in conditions:
        mine = [r for r in rows if r.extra.get("condition") == cond]
        if not mine:
            continue
        speeds = [_median_speed(mine, c) for c in (DEFAULTS, *others)]
        ratios = {o: ratio_median(mine, DEFAULTS, o) for o in others}
        best = best_fixed(mine, fixed)
        r_best = ratio_median(mine, DEFAULTS, best) if best else (float("nan"), 0)
        n = max([n for _, n in ratios.values()] + [r_best[1]])
        got = {FIXED: ratios.get(FIXED.format(n=cores), (float("nan"), 0))[0],
               SERVER: ratios.get(SERVER, (float("nan"), 0))[0], BEST: r_best[0]}
        bars = []
        for (_, b), need in BARS.get(cond, {}).items():
            if b == SERVER and not server:
                continue
            label = {FIXED: f"-t {cores}", SERVER: "server", BEST: "best -t"}[b]
            value = got[b]
            met = "met" if not math.isnan(value) and round(value, 2) >= need else "not met"
            bars.append(f"{label} >= {need:g}x: {met}")
        cells = ([cond, str(n)] + ["" if v is None else f"{v:.1f}" for v in speeds]
                 + [f"{ratios[o][0]:.2f}" for o in others]
                 + [f"{r_best[0]:.2f} ({best or '-'})", "; ".join(bars), threads_chosen(mine)])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main

def build_parser() -> argparse.ArgumentParser:
    ap = pair_parser(__doc__)
    ap.add_argument("--prompts", type=int, default=8, metavar="N",
                    help=f"prompts per condition (default 8): the {len(CODING_PROMPTS)} "
                         "held-out coding prompts of bench_peer.py, then Spec-Bench's")
    ap.add_argument("--spec-bench", type=Path, default=DEFAULT_PROMPTS,
                    help="Spec-Bench JSONL beyond the coding prompts (default: %(default)s)")
    ap.add_argument("--conditions", default=",".join(CONDITIONS),
                    help=f"comma-separated, in order (default {','.join(CONDITIONS)})")
    ap.add_argument("--loops", type=int, default=2, help="CPU-bound loops in `loops` (default 2)")
    ap.add_argument("--rival", choices=("llama-bench", "tandem"), default="llama-bench",
                    help="the other llama.cpp program of `llama` (default llama-bench)")
    ap.add_argument("--rival-bin", type=Path, help="llama-bench binary (default: build_native.sh's)")
    ap.add_argument("--rival-model", type=Path, help="the rival's GGUF (default: the target)")
    ap.add_argument("--rival-warmup", type=float, default=5.0,
                    help="seconds between starting the rival and the first prompt (default 5)")
    ap.add_argument("--fixed-threads", default="1,2",
                    help="the fixed tandem configurations' -t, comma-separated (default 1,2)")
    ap.add_argument("--no-server", action="store_true",
                    help="leave llama-server out (no native build needed; its bars are skipped)")
    ap.add_argument("-n", "--n-predict", type=int, default=128, help="new tokens (default 128)")
    ap.add_argument("-c", "--ctx", type=int, default=4096, help="context size (default 4096)")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--server-bin", type=Path,
                    help="llama-server binary (default: built by scripts/build_native.sh)")
    ap.add_argument("--tandem-bin", help="tandem command (default: .venv/bin/tandem)")
    ap.add_argument("--no-warmup", action="store_true",
                    help="skip the untimed warm-up request per configuration")
    ap.add_argument("--log-dir", type=Path, help="server log (default: a temporary directory)")
    ap.add_argument("--out", type=Path, help="write every per-prompt row here (JSON)")
    return ap


def pick_prompts(n: int, spec_bench: Path) -> list[BenchPrompt]:
    coding = min(n, len(CODING_PROMPTS))
    rest = n - coding
    extra: list[BenchPrompt] = []
    if rest > 0 and spec_bench.is_file():
        pool = load_prompts(spec_bench, rest, None, True, 0)
        by_cat: dict[str, list[BenchPrompt]] = {}
        for p in pool:
            by_cat.setdefault(p.category, []).append(p)
        while len(extra) < rest and any(by_cat.values()):  # one category after another
            for items in by_cat.values():
                if items and len(extra) < rest:
                    extra.append(items.pop(0))
    if len(extra) < rest:
        print(f"warning: only {coding + len(extra)} prompts ({spec_bench} has no more)",
              file=sys.stderr)
    return load_prompts(None, None, None, False, coding) + extra


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops the rivals and the server too
    conditions = [c.strip() for c in ns.conditions.split(",") if c.strip()]
    unknown = [c for c in conditions if c not in CONDITIONS]
    if unknown or not conditions:
        raise SystemExit(f"Error: unknown condition(s) {unknown}: use {', '.join(CONDITIONS)}")
    prompts = pick_prompts(ns.prompts, ns.spec_bench)
    if not prompts:
        raise SystemExit("Error: no prompts (--prompts N with N >= 1)")
    target, _draft, model_args, pair = resolve_models(ns)
    try:
        counts = [int(x) for x in ns.fixed_threads.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"Error: --fixed-threads {ns.fixed_threads!r}: use counts like 1,2")
    if not counts or min(counts) < 1:
        raise SystemExit("Error: --fixed-threads needs at least one count >= 1")
    server_bin = ns.server_bin or native_bin() / "llama-server"
    if not ns.no_server and not server_bin.exists():
        raise SystemExit(f"Error: {server_bin} not found (build it with scripts/build_native.sh, "
                         "or --no-server)")
    tandem = shlex.split(ns.tandem_bin) if ns.tandem_bin else default_tandem()
    log_dir = log_folder(ns.log_dir, "bench-contention-")
    fixed = [FIXED.format(n=c) for c in counts]
    # llama-server's own defaults: no -t (its default thread count), the bench_peer base rest
    server = None if ns.no_server else LlamaServer(
        SERVER, server_bin, target, ["-c", str(ns.ctx), "-np", "1", "--jinja"], log_dir)
    threads = {DEFAULTS: None, **dict(zip(fixed, counts))}
    env = {**os.environ, "TANDEM_HISTORY": "off"}  # as a new user: no earlier answers
    names = [DEFAULTS, *fixed, *([] if server is None else [SERVER])]

    def run_config(name: str, p: BenchPrompt, n: int) -> Row:
        if name == SERVER:
            return server_row(server, p, n, ns.seed)
        cmd = tandem_command(tandem, p, n, threads[name], ns.ctx, ns.seed, model_args, [], pair)
        return tandem_row(name, cmd, p, env)

    meta = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "argv": sys.argv,
            "target": str(target), "n_predict": ns.n_predict, "ctx": ns.ctx, "seed": ns.seed,
            "cpus": os.cpu_count(), "conditions": conditions, "rival": ns.rival,
            "fixed_threads": counts,
            "server": server.args if server else None, "server_bin": str(server_bin),
            "loadavg_start": os.getloadavg()}
    print(f"# tandem's threads on a busy machine ({target.name}; greedy, {ns.n_predict} tokens, "
          f"{len(prompts)} prompt{'s' if len(prompts) != 1 else ''} per condition, "
          f"{os.cpu_count()} CPUs)\n", flush=True)
    print(f"- `{DEFAULTS}`: tandem run (no -t)", flush=True)
    for f, c in zip(fixed, counts):
        print(f"- `{f}`: tandem run -t {c}")
    if server is not None:
        print(f"- `{SERVER}`: llama-server {shlex.join(server.args)} (its default threads)")
    print(f"- conditions: {', '.join(conditions)}; server log: {log_dir}\n", flush=True)
    rows: list[Row] = []

    def body() -> None:
        if not ns.no_warmup:  # page the weights in, let tandem calibrate once, untimed
            warm_up(names, run_config, log)
        for cond in conditions:
            rivals = start_rivals(cond, ns, target, tandem, model_args, pair)
            try:
                for done in interleaved(prompts, names, run_config, ns.n_predict, log,
                                        label=f"{cond} "):
                    for r in done:
                        r.extra["condition"] = cond
                    rows.extend(done)
            finally:
                stop_rivals(rivals)

    interrupted = run_rows([] if server is None else [server], body, rows, ns.out, meta, log)
    if interrupted is None:
        return 1
    if rows:
        print(render(rows, conditions, fixed, server is not None))
        print(f"\ntok/s: median decode tok/s (end-of-text counted as llama-server counts it); "
              f"ratios: median over prompts of the per-prompt ratio, measured interleaved; "
              f"threads chosen: the count tandem's defaults ended each request with (its notes; "
              f"'default': all {os.cpu_count()} cores).")
    return exit_status(rows, interrupted, log)


if __name__ == "__main__":
    sys.exit(main())
