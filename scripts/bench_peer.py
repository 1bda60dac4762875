#!/usr/bin/env python3
"""tandem against the llama-server a user already runs: same pair, prompts and settings.

Starts llama.cpp's llama-server (built by scripts/build_native.sh from the llama.cpp that
llama-cpp-python vendors, with our wheel's CMake flags) on 127.0.0.1 in several named
configurations, one server process each, loaded once. Then, prompt by prompt, it sends the
prompt to every server through /v1/chat/completions (the model's own chat template via
--jinja; greedy, fixed seed, cache_prompt false) and runs `tandem run --json` on the same
prompt, so every configuration sees the same machine state. Only one thing computes at a
time, and every other prompt runs the configurations in reverse order (drift within a prompt
then favours none of them). Both tools' timings are counted by one function,
tandem.bench.accounting (spec-bench uses it too): llama-server evaluates the whole prompt in
its prompt time and counts end-of-text in predicted_n; tandem's prefill stops one prompt token
short, so its decode time holds that token's step, and its own tok/s leaves end-of-text out.
So each row has three figures: end to end (prompt + decode: the same work on both sides),
time per decode step, and decode tok/s with end-of-text counted as llama-server counts it;
--out keeps tandem's own tok/s too (extra.tok_s_own). tandem runs with TANDEM_HISTORY=off
unless --history: a user's earlier answers (and a rerun's answers to these very prompts)
would otherwise be drafted from.

The harness lives in the package, for the other benchmarks against llama-server too:
tandem.bench.llama_server (the server processes), tandem.bench.peer_runs (a row per prompt
and configuration, the warm-up, the interleaved loop, the run's frame) and
tandem.bench.peer_report (summaries and tables); this script is their command line.

Prints, per category, a Markdown table: for each configuration the median and geometric mean
of the per-prompt ratio of decode tok/s to llama-server `plain` (its defaults), the median
ratios end to end and per decode step (plain's time over the configuration's), the draft
acceptance where there is one, and how many greedy outputs equal llama-server plain's text
(after stripping). Raw per-prompt rows go to --out (JSON).

  .venv/bin/python scripts/bench_peer.py --per-category 3 --coding --out peer.json
  .venv/bin/python scripts/bench_peer.py -m target.gguf -md draft.gguf --per-category 1 -n 16
  .venv/bin/python scripts/bench_peer.py --no-spec-bench --coding \\
      --tandem default= --tandem none="--strategy none" --tandem draft="--strategy draft"
  .venv/bin/python scripts/bench_peer.py --server plain --server \\
      exact="--no-repack -fa on -ctk q8_0 -ctv q8_0" --per-category 2

Server configurations (--server, repeatable; `plain` is always run, as the baseline): a
built-in name (plain, draft, ngram) or NAME="extra llama-server args", appended to
`-t T -c C -np 1 --jinja`; {draft} and {threads} in them are replaced by the draft path and
-t. Tandem configurations (--tandem NAME="extra tandem run args", repeatable; default: one,
`default=`, tandem's own defaults).
"""
from __future__ import annotations

import argparse
import os
import shlex
import signal
import statistics
import sys
import time
from pathlib import Path

from native_tools import native_bin
from tandem.bench.llama_server import (
    BASE_SERVER_ARGS,
    BASELINE,
    DEFAULT_SERVERS,
    SERVER_CONFIGS,
    LlamaServer,
)
from tandem.bench.peer_report import Row, pool, report
from tandem.bench.peer_runs import (
    CODING_PROMPTS,
    exit_status,
    interleaved,
    load_prompts,
    log_folder,
    parse_named,
    run_rows,
    server_row,
    tandem_command,
    tandem_row,
    warm_up,
)
from tandem.bench.workloads import Prompt as BenchPrompt  # spec-bench's prompt record

ROOT = Path(__file__).resolve().parents[1]
# the Spec-Bench questions beside the checkout (../shared/spec_bench), as tests/test_bench.py
DEFAULT_PROMPTS = ROOT.parent / "shared" / "spec_bench" / "question.dev.jsonl"


def log(msg: str) -> None:
    """Progress, warnings and errors of a bench script: stderr, at once."""
    print(msg, file=sys.stderr, flush=True)


def default_tandem() -> list[str]:
    exe = ROOT / ".venv" / "bin" / "tandem"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "tandem"]


def resolve_models(ns) -> tuple[Path, Path, list[str], str | None]:
    """(target, draft, model options for tandem run, pair name for tandem run): -m/-md, else
    the catalog's default pair from the store, which tandem run is then told by name."""
    if ns.model is not None:
        if ns.model_draft is None:
            raise SystemExit("Error: -m needs -md too (the draft configurations use it)")
        return ns.model, ns.model_draft, ["-m", str(ns.model), "-md", str(ns.model_draft)], None
    from tandem.models.catalog import get_pair
    from tandem.models.store import Store, tandem_home

    pair, store = get_pair(), Store(tandem_home())
    for spec in (pair.target, pair.draft):
        if not store.is_present(spec):
            print(f"fetching {spec.key} into {store.home} (once)", file=sys.stderr)
    return store.ensure(pair.target), store.ensure(pair.draft), [], pair.name


def pair_parser(doc: str) -> argparse.ArgumentParser:
    """A bench script's parser: its docstring as the help, and -m/-md (resolve_models reads
    them; neither: the default pair)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(doc.splitlines()[1:]))
    ap.add_argument("-m", "--model", type=Path, help="target GGUF (default: the default pair)")
    ap.add_argument("-md", "--model-draft", type=Path, help="draft GGUF (with -m)")
    return ap


def build_parser() -> argparse.ArgumentParser:
    ap = pair_parser(__doc__)
    ap.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS,
                    help="Spec-Bench JSONL (first turn of each question; default: %(default)s)")
    ap.add_argument("--no-spec-bench", action="store_true", help="no prompts from --prompts")
    ap.add_argument("--per-category", type=int, default=3, help="prompts per category (default 3)")
    ap.add_argument("--category", action="append", help="only these categories (repeatable)")
    ap.add_argument("--no-group-mt-bench", action="store_true",
                    help="keep MT-bench's eight categories apart (default: one, mt-bench)")
    ap.add_argument("--coding", type=int, nargs="?", const=len(CODING_PROMPTS), default=0,
                    metavar="N",
                    help=f"add N built-in coding prompts (default all {len(CODING_PROMPTS)})")
    ap.add_argument("--server", action="append", metavar="NAME[=ARGS]",
                    help="llama-server configuration (repeatable; default: "
                         f"{' '.join(DEFAULT_SERVERS)})")
    ap.add_argument("--tandem", action="append", metavar="NAME=ARGS",
                    help="tandem run configuration (repeatable; default: default=)")
    ap.add_argument("-n", "--n-predict", type=int, default=128, help="new tokens (default 128)")
    ap.add_argument("-t", "--threads", type=int, default=2, help="threads (default 2)")
    ap.add_argument("-c", "--ctx", type=int, default=4096, help="context size (default 4096)")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--server-bin", type=Path,
                    help="llama-server binary (default: built by scripts/build_native.sh)")
    ap.add_argument("--tandem-bin", help="tandem command (default: .venv/bin/tandem)")
    ap.add_argument("--tandem-cmd", action="append", metavar="NAME=COMMAND", default=[],
                    help="the tandem command of one configuration (repeatable; e.g. another "
                         "checkout with its own TANDEM_HOME: 'env TANDEM_HOME=h PYTHONPATH=c "
                         "python -m tandem'), to compare two versions side by side")
    ap.add_argument("--no-warmup", action="store_true",
                    help="skip the untimed warm-up request per configuration")
    ap.add_argument("--skip", type=int, default=0,
                    help="skip the first N prompts of each Spec-Bench category (a second run "
                         "on other prompts)")
    ap.add_argument("--pool", type=Path, nargs="+", metavar="JSON",
                    help="run nothing: one report over these --out files")
    ap.add_argument("--history", action="store_true",
                    help="let tandem draft from the user's earlier answers (default: "
                         "TANDEM_HISTORY=off, as for a new user)")
    ap.add_argument("--log-dir", type=Path, help="server logs (default: a temporary directory)")
    ap.add_argument("--out", type=Path, help="write every per-prompt row here (JSON)")
    return ap


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops the servers as Ctrl-C does
    try:
        server_specs = [parse_named(s, SERVER_CONFIGS) for s in (ns.server or DEFAULT_SERVERS)]
        tandem_specs = [parse_named(s) for s in (ns.tandem or ["default="])]
    except ValueError as exc:
        raise SystemExit(f"Error: {exc}") from None
    if BASELINE not in [n for n, _ in server_specs]:
        server_specs.insert(0, (BASELINE, SERVER_CONFIGS[BASELINE]))
    tandem_specs = [(n if n.startswith("tandem") else f"tandem {n}", a) for n, a in tandem_specs]
    names = [n for n, _ in server_specs] + [n for n, _ in tandem_specs]
    if len(set(names)) != len(names):
        raise SystemExit(f"Error: configuration names must differ: {names}")

    if ns.pool:
        print(pool(ns.pool))
        return 0
    prompts = load_prompts(None if ns.no_spec_bench else ns.prompts, ns.per_category,
                           ns.category, not ns.no_group_mt_bench, ns.coding, ns.skip)
    if not prompts:
        raise SystemExit("Error: no prompts (use --prompts and/or --coding)")
    categories = list(dict.fromkeys(p.category for p in prompts))
    target, draft, model_args, pair_name = resolve_models(ns)
    server_bin = ns.server_bin or native_bin() / "llama-server"
    if not server_bin.exists():
        raise SystemExit(f"Error: {server_bin} not found (build it with scripts/build_native.sh)")
    tandem = shlex.split(ns.tandem_bin) if ns.tandem_bin else default_tandem()
    log_dir = log_folder(ns.log_dir, "bench-peer-")

    fmt = {"threads": ns.threads, "ctx": ns.ctx, "draft": shlex.quote(str(draft))}
    base = BASE_SERVER_ARGS.format(**fmt)
    servers = [LlamaServer(name, server_bin, target, shlex.split(f"{base} {args.format(**fmt)}"),
                           log_dir) for name, args in server_specs]
    tandem_cmds = {name: shlex.split(args) for name, args in tandem_specs}
    own_cmds = {}
    for spec in ns.tandem_cmd:
        name, _, command = spec.partition("=")
        name = name if name.startswith("tandem") else f"tandem {name}"
        if name not in tandem_cmds or not command.strip():
            raise SystemExit(f"Error: --tandem-cmd {spec!r} names no --tandem configuration")
        own_cmds[name] = shlex.split(command)
    env = None if ns.history else {**os.environ, "TANDEM_HISTORY": "off"}

    meta = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "argv": sys.argv,
            "target": str(target), "draft": str(draft), "n_predict": ns.n_predict,
            "threads": ns.threads, "ctx": ns.ctx, "seed": ns.seed, "server_bin": str(server_bin),
            "servers": {s.name: s.args for s in servers},
            "tandem": {n: [*own_cmds.get(n, tandem), "run", *model_args, *a,
                           *([pair_name] if pair_name else [])]
                       for n, a in tandem_cmds.items()},
            "loadavg_start": os.getloadavg(), "history": bool(ns.history)}
    print(f"# tandem vs llama-server ({target.name} + {draft.name}; greedy, {ns.n_predict} "
          f"tokens, {ns.threads} threads, context {ns.ctx}; {len(prompts)} prompts in "
          f"{len(categories)} categor{'y' if len(categories) == 1 else 'ies'})\n", flush=True)
    for s in servers:
        print(f"- `{s.name}`: llama-server {shlex.join(s.args)}", flush=True)
    for n, a in tandem_cmds.items():
        print(f"- `{n}`: tandem run {shlex.join(a) or '(its defaults)'}", flush=True)
    print(f"- server logs: {log_dir}\n", flush=True)

    load0 = os.getloadavg()[0]
    if load0 > 0.5 * (os.cpu_count() or 1):
        print(f"warning: load average {load0:.2f} on {os.cpu_count()} CPUs before the run: other "
              "work competes for the cores and the speeds will be noisy", file=sys.stderr)
    by_server = {s.name: s for s in servers}

    def run_config(name: str, p: BenchPrompt, n: int) -> Row:
        if name in by_server:
            return server_row(by_server[name], p, n, ns.seed)
        return tandem_row(name, tandem_command(own_cmds.get(name, tandem), p, n, ns.threads,
                                               ns.ctx, ns.seed,
                                               model_args, tandem_cmds[name], pair_name), p, env)

    rows: list[Row] = []

    def body() -> None:
        if not ns.no_warmup:  # page the weights in, let tandem calibrate once, untimed
            warm_up(names, run_config, log)
        for done in interleaved(prompts, names, run_config, ns.n_predict, log):
            rows.extend(done)

    interrupted = run_rows(servers, body, rows, ns.out, meta, log)
    if interrupted is None:
        return 1
    if rows:
        print(report(rows, names, categories))
        loads = [r.extra["loadavg"] for r in rows if "loadavg" in r.extra]
        if loads:
            print(f"\nload average (1 min) before each prompt: median "
                  f"{statistics.median(loads):.2f}, max {max(loads):.2f} on {os.cpu_count()} "
                  f"CPUs (this run itself adds about {min(ns.threads, os.cpu_count() or 1)})")
        print(f"\nratio: decode tok/s (end-of-text counted as llama-server counts it) over "
              f"llama-server `{BASELINE}`'s on the same prompt; end to end: `{BASELINE}`'s "
              "prompt + decode time over the configuration's; per step: its time per decode "
              f"step over the configuration's; same output: greedy text equal to "
              f"`{BASELINE}`'s after stripping.")
    return exit_status(rows, interrupted, log)


if __name__ == "__main__":
    sys.exit(main())
