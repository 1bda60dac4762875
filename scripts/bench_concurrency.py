#!/usr/bin/env python3
"""Several clients at once (issue 41): `tandem serve` against llama-server, side by side.

Three scenarios, each on every server, greedy, fixed seed:

- `infill-during-chat`: a streaming chat request asking for a 200-token answer (max_tokens
  200, end-of-text not ignored); 2.0 s after sending it, an editor's `/infill` request (a
  held-out fill-in-the-middle hole of tandem.bench.editor_workload, cut to a prompt of about
  800-1,100 tokens: input_prefix / input_suffix / one input_extra chunk, n_predict 128 as
  llama.vim sends). Measured: the /infill's latency (sent -> answer) and the chat's total time
  (sent -> last chunk); the chat's decode tok/s (its server's timings).
- `four-at-once`: four different chat requests (96 tokens each) sent at the same instant
  (threads behind a barrier). Measured: aggregate tok/s = the four answers' generated tokens
  (timings.predicted_n) / (first send -> last completion), and their mean latency.
- `alone`: four other chat requests (96 tokens each), one at a time. Measured: median
  latency and median decode tok/s (timings.predicted_per_second).

The chat prompts are bench_peer.py's held-out coding prompts (tandem.bench.peer_runs
CODING_PROMPTS, never tuned on); each is sent once per server start, so no answer comes from a
prompt cache of an earlier scenario (tandem's cache cannot be turned off: `cache_prompt` is
always on there; llama-server keeps its default, on).

Servers (each started fresh on 127.0.0.1, one at a time; same pair, same -t, same context per
slot, C = -c):
- `llama defaults`: llama-server with its defaults: auto slots (no -np: 4 slots sharing one
  unified KV cache), so `-c 4*C`; the baseline of every ratio;
- `llama -np 1`: one slot, `-c C` (the others' reference: requests wait their turn);
- `llama draft`: its draft-simple mode (tandem.bench.llama_server SERVER_CONFIGS["draft"])
  with auto slots, `-c 4*C`;
- `tandem`: `tandem serve --ctx-size C` plus `--parallel N` (--tandem-parallel, default 4)
  when `tandem serve --help` lists --parallel (each of its sequences gets its own C); without
  that flag it serves one request at a time;
- `tandem -np 1`: `tandem serve --parallel 1`, one request at a time as tandem served before
  --parallel: the reference of "one request alone" (--no-tandem-one leaves it out).

Interleaving: restarting a server per scenario costs more than the scenarios, so a server is
started once per repetition, warmed up untimed, runs every scenario of that repetition, and is
stopped; the servers' order changes per repetition (reversed every other repetition, rotated
every two), so drift on the machine favours none of them. --reps (default 2) repetitions;
the table shows medians over them, and ratios to `llama defaults` taken within a repetition,
then their median. /work/shared/bin/quiet-check runs first (a busy machine is said); every
scenario's run records the share of the CPU that processes other than this script and the
server under test took, and figures measured above tandem.machine.load.BUSY_SHARE are marked
busy. tandem runs with TANDEM_HISTORY=off. --together starts every server of a repetition
first (an idle one takes memory, no CPU) and runs each scenario on each in turn, in the
repetition's order: the servers' runs of a scenario are then seconds apart instead of minutes
(a server start and the other scenarios), which this 2-vCPU host's drift needs: llama-server's
own four-at-once aggregate went from 24.0 to 30.5 tok/s across four repetitions of one run.

Prints a Markdown table (one row per server and scenario) and writes every row (one per
server, scenario and repetition, with each request's figures) to --out (JSON).

The measurement (the default pair, 2 threads, context 4096 per slot, 2 repetitions: 10 server
starts of about two minutes each, so about 20 minutes of both cores (18 on 2026-12-03), plus
up to 2 of quiet-check's waiting; run it alone on the machine):

  .venv/bin/python scripts/bench_concurrency.py --out concurrency.json \
      --log-dir bench-concurrency-logs

  .venv/bin/python scripts/bench_concurrency.py -m t.gguf -md d.gguf --reps 1 --no-llama
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shlex
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench_editors import infill
from bench_peer import ROOT, default_tandem, log, pair_parser, resolve_models
from bench_serve import TandemServer, chat, llama_server_or_warn, server_options
from tandem.bench.accounting import response_counts
from tandem.bench.editor_workload import Completion, fim_cases
from tandem.bench.llama_server import BASE_SERVER_ARGS, SERVER_CONFIGS, LlamaServer, ServerError
from tandem.bench.peer_runs import (
    CODING_PROMPTS,
    exit_status,
    load_prompts,
    log_folder,
    messages_for,
    run_rows,
)
from tandem.engine.tuning.costs import cpu_snapshot, others_share
from tandem.machine.load import BUSY_SHARE, busy

BASELINE = "llama defaults"
TANDEM = "tandem"
ONE_SLOT = "tandem -np 1"  # one slot: tandem as it served before --parallel
AUTO_SLOTS = 4  # llama-server's slots when no -np is given (this llama.cpp: 4, unified KV)
INFILL, FOUR, ALONE = "infill-during-chat", "four-at-once", "alone"
SCENARIOS = (INFILL, FOUR, ALONE)
LLAMA_CONFIGS = {"defaults": BASELINE, "np1": "llama -np 1", "draft": "llama draft"}
# the held-out coding prompts (peer_runs.CODING_PROMPTS) each scenario takes, none twice
CHAT_PROMPT = "code-3"  # a thread-safe queue in Java: a long answer
FOUR_PROMPTS = ("code-1", "code-2", "code-4", "code-5")
ALONE_PROMPTS = ("code-6", "code-7", "code-8", "code-9")
# the /infill's hole (editor_workload.fim_cases' id: one line of csv.py's DictReader) and the
# characters of its prefix + suffix + chunk: about 950 tokens of the prompt llama-server builds
# from them with Qwen2.5-Coder's tokenizer (the rows keep the servers' timings.prompt_n)
HOLE, INFILL_CHARS = "csv.py:126-126", 3800
QUIET_CHECK = ROOT.parent / "shared" / "bin" / "quiet-check"


@dataclass
class Row:
    """One scenario on one server in one repetition. latency_s: the /infill's latency
    (infill-during-chat), the mean latency (four-at-once), the median latency (alone);
    tok_s: the chat's decode tok/s, the aggregate tok/s, the median decode tok/s."""

    server: str
    scenario: str
    rep: int  # 0-based
    position: int = 0  # the server's place in its repetition's order
    latency_s: float = 0.0
    chat_total_s: float | None = None  # infill-during-chat: the chat's send -> last chunk
    tok_s: float = 0.0
    tokens: int = 0  # generated tokens (timings.predicted_n), all chat answers together
    wall_s: float = 0.0  # first send -> last completion
    prompt_n: int | None = None  # infill-during-chat: the /infill's prompt tokens
    overlapped: bool | None = None  # infill-during-chat: the chat still ran at the /infill
    busy: float | None = None  # share of the CPU other processes took during it
    step_ms: float | None = None  # the requests' median decode time per step
    requests: list[dict] = field(default_factory=list)
    error: str | None = None
    extra: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------- the work

def chat_prompts():
    """{id: Prompt} of the held-out coding prompts."""
    return {p.id: p for p in load_prompts(None, None, None, False, len(CODING_PROMPTS))}


def _first(lines: list[str], budget: int) -> list[str]:
    """The first of `lines` that fit in `budget` characters together."""
    out, n = [], 0
    for line in lines:
        if n + len(line) > budget:
            break
        out.append(line)
        n += len(line)
    return out


def head(text: str, budget: int) -> str:
    """The first whole lines of `text` within `budget` characters."""
    return "".join(_first(text.splitlines(keepends=True), budget))


def tail(text: str, budget: int) -> str:
    """The last whole lines of `text` within `budget` characters."""
    return "".join(reversed(_first(text.splitlines(keepends=True)[::-1], budget)))


def infill_hole(chars: int = INFILL_CHARS, hole: str = HOLE) -> Completion:
    """The held-out hole of editor_workload.fim_cases named `hole`, its file cut around the
    hole (55% of `chars` above, 20% below) and one chunk of another file (25%), as an editor
    sends a window of the file."""
    c = next(c for c in fim_cases(n_extra=1) if c.id == hole)
    b = c.body
    extra = [{**ch, "text": head(ch["text"], chars * 25 // 100)} for ch in b["input_extra"]]
    body = {**b, "input_prefix": tail(b["input_prefix"], chars * 55 // 100),
            "input_suffix": head(b["input_suffix"], chars * 20 // 100), "input_extra": extra}
    return dataclasses.replace(c, body=body)


def _request(kind: str, pid: str, start: float, end: float, resp: dict | None,
             t0: float) -> dict:
    t = (resp or {}).get("timings") or {}
    counted = response_counts(resp or {})
    return {"kind": kind, "id": pid, "sent_s": round(start - t0, 4), "latency_s": end - start,
            "predicted_n": int(t.get("predicted_n") or 0),
            "prompt_n": int(t.get("prompt_n") or 0),
            "tok_s": float(t.get("predicted_per_second") or 0.0),
            # its decode time per step, counted alike on both servers (bench/accounting.py)
            "step_ms": round(1000 * counted.step_s, 2) if counted else None,
            "has_timings": bool(t)}


def _finish(row: Row, errors: list[str]) -> Row:
    """The row's figures from its requests' (step_ms), and its error where one failed."""
    row.step_ms = _median([r["step_ms"] for r in row.requests if r.get("step_ms")])
    if errors:
        row.error = errors[0]
    elif any(not r["has_timings"] for r in row.requests):
        row.error = "no timings in a response"
    return row


def scenario_infill(server, rep: int, prompt, hole: Completion, n_chat: int, delay: float,
                    seed: int) -> Row:
    """A streaming chat, and `delay` seconds after sending it an /infill."""
    row = Row(server.name, INFILL, rep)
    got: dict = {}

    def run_chat() -> None:
        got["start"] = time.perf_counter()
        try:
            got["resp"] = chat(server.port, messages_for(prompt), n_chat, seed, True)[0]
        except ServerError as exc:
            got["error"] = f"chat: {exc}"
        got["end"] = time.perf_counter()

    t0 = time.perf_counter()
    th = threading.Thread(target=run_chat, daemon=True)
    th.start()
    time.sleep(max(0.0, t0 + delay - time.perf_counter()))
    row.overlapped = th.is_alive()
    errors = []
    start = time.perf_counter()
    try:
        resp = infill(server.port, hole.body)[0]
    except ServerError as exc:
        errors.append(f"infill: {exc}")
        resp = None
    end = time.perf_counter()
    th.join()
    if "error" in got:
        errors.insert(0, got["error"])
    chat_req = _request("chat", prompt.id, got["start"], got["end"], got.get("resp"), t0)
    fill = _request("infill", hole.id, start, end, resp, t0)
    row.requests = [chat_req, fill]
    row.latency_s, row.prompt_n = fill["latency_s"], fill["prompt_n"]
    row.chat_total_s, row.tok_s = chat_req["latency_s"], chat_req["tok_s"]
    row.tokens = chat_req["predicted_n"]
    row.wall_s = max(got["end"], end) - t0
    return _finish(row, errors)


def scenario_four(server, rep: int, prompts: list, n: int, seed: int) -> Row:
    """len(prompts) chats sent at the same instant: aggregate tok/s and mean latency."""
    row = Row(server.name, FOUR, rep)
    barrier = threading.Barrier(len(prompts))
    done: list = [None] * len(prompts)

    def one(i: int) -> None:
        barrier.wait()
        start, resp, error = time.perf_counter(), None, None
        try:
            resp = chat(server.port, messages_for(prompts[i]), n, seed, False)[0]
        except ServerError as exc:
            error = f"{prompts[i].id}: {exc}"
        done[i] = (start, time.perf_counter(), resp, error)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(prompts))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    t0 = min(d[0] for d in done)
    row.requests = [_request("chat", p.id, s, e, r, t0) for p, (s, e, r, _) in zip(prompts, done)]
    row.wall_s = max(d[1] for d in done) - t0
    row.tokens = sum(r["predicted_n"] for r in row.requests)
    row.tok_s = row.tokens / row.wall_s if row.wall_s > 0 else 0.0
    row.latency_s = statistics.fmean(r["latency_s"] for r in row.requests)
    return _finish(row, [d[3] for d in done if d[3]])


def scenario_alone(server, rep: int, prompts: list, n: int, seed: int) -> Row:
    """The chats one at a time: median latency and median decode tok/s (server timings)."""
    row = Row(server.name, ALONE, rep)
    errors = []
    t0 = time.perf_counter()
    for p in prompts:
        start, resp = time.perf_counter(), None
        try:
            resp = chat(server.port, messages_for(p), n, seed, False)[0]
        except ServerError as exc:
            errors.append(f"{p.id}: {exc}")
        row.requests.append(_request("chat", p.id, start, time.perf_counter(), resp, t0))
    row.wall_s = time.perf_counter() - t0
    row.tokens = sum(r["predicted_n"] for r in row.requests)
    row.latency_s = statistics.median(r["latency_s"] for r in row.requests)
    row.tok_s = statistics.median(r["tok_s"] for r in row.requests)
    return _finish(row, errors)


# ----------------------------------------------------------------------------- load

def _snapshot(pid: int | None):
    """cpu_snapshot with the server process's jiffies counted as this script's own."""
    snap = cpu_snapshot()
    if snap is None or pid is None:
        return snap
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return snap[0], snap[1] + int(fields[11]) + int(fields[12]), snap[2]
    except (OSError, ValueError, IndexError):
        return None


def others_during(pid: int | None, fn, *args):
    """(fn(*args), the share of the CPU that processes other than this one and `pid` took
    meanwhile)."""
    before = _snapshot(pid)
    result = fn(*args)
    return result, others_share(before, _snapshot(pid))


def start_warm(server, label: str, seed: int) -> None:
    """Start `server`, say it is ready, and ask it one short chat, untimed: it pages the
    weights in and tandem calibrates its costs. The caller stops it, on a failure too."""
    t0 = time.monotonic()
    server.start()
    log(f"{label} ready on 127.0.0.1:{server.port} ({time.monotonic() - t0:.1f}s)")
    chat(server.port, [{"role": "user", "content": "Say hello."}], 8, seed, False)


def quiet_check() -> tuple[bool | None, str]:
    """/work/shared/bin/quiet-check's verdict (None: no such script here) and its words."""
    if not QUIET_CHECK.exists():
        return None, f"{QUIET_CHECK} not found: load not checked before the run"
    res = subprocess.run([str(QUIET_CHECK)], capture_output=True, text=True)
    return res.returncode == 0, (res.stdout + res.stderr).strip()


# ----------------------------------------------------------------------------- the report

def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _fmt(x: float | None, spec: str, mark: bool = False) -> str:
    return "-" if x is None else f"{x:{spec}}" + (" busy" if mark else "")


def report(rows: list[Row], names: list[str]) -> str:
    """Medians per server and scenario; ratios to BASELINE within each repetition (latency:
    the baseline's over the server's, >1 faster; tok/s: the server's over the baseline's)."""
    ok = [r for r in rows if not r.error]
    base = {(r.scenario, r.rep): r for r in ok if r.server == BASELINE}
    out = ["| scenario | server | reps | latency s | x latency | chat total s | x chat total "
           "| tok/s | x tok/s | ms/step | x step | tokens | busy |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for scen in SCENARIOS:
        for name in names:
            mine = [r for r in ok if r.server == name and r.scenario == scen]
            if not mine:
                continue
            pairs = [(base[(r.scenario, r.rep)], r) for r in mine if (r.scenario, r.rep) in base]
            hot = any(busy(r.busy) or busy(b.busy) for b, r in pairs)
            x_lat = _median([b.latency_s / r.latency_s for b, r in pairs if r.latency_s > 0])
            x_chat = _median([b.chat_total_s / r.chat_total_s for b, r in pairs
                              if r.chat_total_s and b.chat_total_s])
            x_tok = _median([r.tok_s / b.tok_s for b, r in pairs if b.tok_s > 0])
            x_step = _median([b.step_ms / r.step_ms for b, r in pairs if r.step_ms and b.step_ms])
            n_busy = sum(busy(r.busy) for r in mine)
            chat_s = [r.chat_total_s for r in mine if r.chat_total_s is not None]
            out.append(
                f"| {scen} | {name} | {len(mine)} "
                f"| {_fmt(_median([r.latency_s for r in mine]), '.2f')} "
                f"| {_fmt(x_lat, '.2f', hot)} | {_fmt(_median(chat_s), '.2f')} "
                f"| {_fmt(x_chat, '.2f', hot)} | {_fmt(_median([r.tok_s for r in mine]), '.1f')} "
                f"| {_fmt(x_tok, '.2f', hot)} "
                f"| {_fmt(_median([r.step_ms for r in mine if r.step_ms]), '.1f')} "
                f"| {_fmt(x_step, '.2f', hot)} | {_fmt(_median([r.tokens for r in mine]), '.0f')} "
                f"| {f'{n_busy}/{len(mine)}' if n_busy else '-'} |")
    return "\n".join(out)


def notes(rows: list[Row]) -> list[str]:
    ok = [r for r in rows if not r.error]
    lines = []
    prompt_n = {r.server: r.prompt_n for r in ok if r.scenario == INFILL}
    if prompt_n:
        lines.append("- the /infill's prompt: " + ", ".join(
            f"{s} {n} tokens" for s, n in prompt_n.items()) + " (timings.prompt_n)")
    missed = [f"{r.server} rep {r.rep + 1}" for r in ok
              if r.scenario == INFILL and r.overlapped is False]
    if missed:
        lines.append("- the chat had ended before the /infill was sent (no overlap): "
                     + ", ".join(missed))
    hot = [r for r in rows if busy(r.busy)]
    if hot:
        shares = [r.busy for r in hot]
        lines.append(f"- busy: {len(hot)} of {len(rows)} scenario runs were measured while other "
                     f"processes took over {BUSY_SHARE:.0%} of the CPU (median "
                     f"{statistics.median(shares):.0%}, up to {max(shares):.0%}; their ratios "
                     "are marked busy): rerun on a quiet machine before relying on them")
    return lines


# ----------------------------------------------------------------------------- servers

def one_slot(server: TandemServer) -> TandemServer:
    """The one-slot tandem, named apart from the other in the rows and the table."""
    server.name = ONE_SLOT
    return server


def without_np(args: list[str]) -> list[str]:
    """llama-server arguments with any -np N removed: auto slots."""
    if "-np" not in args:
        return args
    i = args.index("-np")
    return args[:i] + args[i + 2:]


def llama_args(cfg: str, threads: int, ctx: int, draft: Path) -> list[str]:
    """A configuration's llama-server arguments (-m, --host, --port aside): same context
    per slot, so the auto-slot ones get AUTO_SLOTS times it as their unified KV cache."""
    auto = cfg != "np1"
    fmt = {"threads": threads, "ctx": ctx * AUTO_SLOTS if auto else ctx,
           "draft": shlex.quote(str(draft))}
    extra = SERVER_CONFIGS["draft"] if cfg == "draft" else ""
    args = shlex.split(f"{BASE_SERVER_ARGS.format(**fmt)} {extra.format(**fmt)}")
    return without_np(args) if auto else args


def tandem_has_parallel(tandem: list[str]) -> bool:
    """`tandem serve --help` lists --parallel (issue 41's several sequences)."""
    res = subprocess.run([*tandem, "serve", "--help"], capture_output=True, text=True,
                         env={**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}, timeout=300)
    return re.search(r"--parallel(?![\w-])", res.stdout) is not None


def rep_order(names: list[str], rep: int) -> list[str]:
    """The servers' order in repetition `rep`: reversed every other one, rotated every two."""
    k = (rep // 2) % len(names)
    order = names[k:] + names[:k]
    return order[::-1] if rep % 2 else order


def build_parser() -> argparse.ArgumentParser:
    ap = pair_parser(__doc__)
    ap.add_argument("--reps", type=int, default=2, help="repetitions (default 2)")
    ap.add_argument("--scenario", action="append", choices=SCENARIOS,
                    help="only these scenarios (repeatable; default all three)")
    ap.add_argument("-n", "--n-predict", type=int, default=96,
                    help="max tokens of the four-at-once and alone chats (default 96)")
    ap.add_argument("--chat-tokens", type=int, default=200,
                    help="max tokens of the chat the /infill interrupts (default 200)")
    ap.add_argument("--infill-delay", type=float, default=2.0,
                    help="seconds from the chat's send to the /infill's (default 2.0)")
    ap.add_argument("--infill-chars", type=int, default=INFILL_CHARS,
                    help="characters of the /infill's code (default %(default)s: 800-1,100 "
                         "tokens with Qwen2.5-Coder)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-c", "--ctx", type=int, default=4096,
                    help=f"context per slot (llama-server with auto slots: -c {AUTO_SLOTS}x it)")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--tandem-parallel", type=int, default=AUTO_SLOTS,
                    help="tandem serve --parallel N, when it has that flag (default %(default)s)")
    ap.add_argument("--no-tandem-one", action="store_true",
                    help="leave out `tandem -np 1` (tandem serve --parallel 1: one request at a "
                         "time, the reference for the one request alone)")
    server_options(ap)
    ap.add_argument("--llama", action="append", choices=tuple(LLAMA_CONFIGS),
                    help="llama-server configurations (default: defaults, np1, draft)")
    ap.add_argument("--together", action="store_true",
                    help="every server up at once in a repetition, each scenario run on each "
                         "in turn: seconds between the servers' runs of a scenario, not minutes")
    ap.add_argument("--no-quiet-check", action="store_true",
                    help=f"skip {QUIET_CHECK} before the run")
    ap.add_argument("--log-dir", type=Path, help="server logs (default: a temporary directory)")
    ap.add_argument("--out", type=Path, help="write every row here (JSON)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    if ns.reps < 1:
        raise SystemExit("Error: --reps must be at least 1")
    scenarios = [s for s in SCENARIOS if s in (ns.scenario or SCENARIOS)]
    prompts = chat_prompts()
    hole = infill_hole(ns.infill_chars)
    target, draft, model_args, pair_name = resolve_models(ns)
    log_dir = log_folder(ns.log_dir, "bench-concurrency-")
    tandem = shlex.split(ns.tandem_bin) if ns.tandem_bin else default_tandem()
    parallel = tandem_has_parallel(tandem)
    if not parallel:
        log("note: `tandem serve --help` lists no --parallel: tandem serves one request at a "
            "time")
    base = [*tandem, "serve", *([pair_name] if pair_name else model_args), "--port", "0",
            "-t", str(ns.threads), "--ctx-size", str(ns.ctx)]
    cmd = [*base, *(["--parallel", str(ns.tandem_parallel)] if parallel else []),
           *shlex.split(ns.tandem_args)]
    env = {**os.environ, "TANDEM_HISTORY": "off"}
    makers = {TANDEM: lambda d: TandemServer(cmd, env, d / "tandem-serve.log")}
    one = [*base, "--parallel", "1", *shlex.split(ns.tandem_args)]
    if parallel and not ns.no_tandem_one:
        makers[ONE_SLOT] = lambda d: one_slot(TandemServer(one, env, d / "tandem-np1-serve.log"))
    server_bin = llama_server_or_warn(ns)
    llama = {}
    if server_bin is not None:
        for cfg in ns.llama or tuple(LLAMA_CONFIGS):
            llama[LLAMA_CONFIGS[cfg]] = llama_args(cfg, ns.threads, ns.ctx, draft)
    for name, args in llama.items():
        makers[name] = (lambda d, name=name, args=args:
                        LlamaServer(name, server_bin, target, args, d))
    names = [n for n in (BASELINE, "llama -np 1", "llama draft", TANDEM, ONE_SLOT)
             if n in makers]

    quiet, said = (None, "skipped (--no-quiet-check)") if ns.no_quiet_check else quiet_check()
    if quiet is False:
        log(f"warning: the machine is busy before the run: the figures below are not "
            f"measurements of it\n{said}")
    meta = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "argv": sys.argv,
            "target": str(target), "draft": str(draft), "threads": ns.threads,
            "ctx_per_slot": ns.ctx, "n_predict": ns.n_predict, "chat_tokens": ns.chat_tokens,
            "infill_delay_s": ns.infill_delay, "infill_hole": hole.id, "reps": ns.reps,
            "scenarios": scenarios, "tandem": cmd, "tandem_parallel": parallel,
            "servers": llama, "quiet_check": {"quiet": quiet, "said": said},
            "loadavg_start": os.getloadavg()}
    print(f"# Several clients at once ({target.name} + {draft.name}; greedy, {ns.threads} "
          f"threads, context {ns.ctx} per slot; {ns.reps} "
          f"repetition{'s' if ns.reps > 1 else ''})\n", flush=True)
    print(f"- `{TANDEM}`: {shlex.join(cmd)}", flush=True)
    if ONE_SLOT in makers:
        print(f"- `{ONE_SLOT}`: {shlex.join(one)}", flush=True)
    for name, args in llama.items():
        print(f"- `{name}`: llama-server {shlex.join(args)}", flush=True)
    print(f"- quiet-check: {said.splitlines()[0] if said else '-'}", flush=True)
    print(f"- logs: {log_dir}\n", flush=True)

    four = [prompts[i] for i in FOUR_PROMPTS]
    alone = [prompts[i] for i in ALONE_PROMPTS]
    run = {INFILL: lambda s, rep: scenario_infill(s, rep, prompts[CHAT_PROMPT], hole,
                                                  ns.chat_tokens, ns.infill_delay, ns.seed),
           FOUR: lambda s, rep: scenario_four(s, rep, four, ns.n_predict, ns.seed),
           ALONE: lambda s, rep: scenario_alone(s, rep, alone, ns.n_predict, ns.seed)}
    rows: list[Row] = []

    def start(name: str, rep: int):
        s = makers[name](log_folder(log_dir / f"rep{rep + 1}", ""))
        try:
            start_warm(s, f"[rep {rep + 1}/{ns.reps}] {name}", ns.seed)
            if INFILL in scenarios:
                infill(s.port, {"input_prefix": "def f(", "input_suffix": ")\n",
                                "n_predict": 4, "temperature": 0})
        except BaseException:
            s.stop()
            raise
        return s

    def measure(s, name: str, scen: str, pos: int, rep: int) -> None:
        row, share = others_during(s.proc.pid, run[scen], s, rep)
        row.position, row.busy = pos, share
        row.extra["loadavg"] = os.getloadavg()[0]
        rows.append(row)
        log(f"  {name} {scen}: " + (f"ERROR {row.error}" if row.error else
            f"latency {row.latency_s:.2f}s, {row.tok_s:.1f} tok/s, "
            f"{row.tokens} tokens in {row.wall_s:.2f}s"
            + (f", others {share:.0%}" if share is not None else "")))

    def body() -> None:
        for rep in range(ns.reps):
            order = rep_order(names, rep)
            if not ns.together:  # one server up at a time, every scenario on it
                for pos, name in enumerate(order):
                    s = start(name, rep)
                    try:
                        for scen in scenarios:
                            measure(s, name, scen, pos, rep)
                    finally:
                        s.stop()
                continue
            up = {}
            try:  # every server up (idle ones take no CPU), each scenario on each in turn
                for name in order:
                    up[name] = start(name, rep)
                for scen in scenarios:
                    for pos, name in enumerate(order):
                        measure(up[name], name, scen, pos, rep)
            finally:
                for s in up.values():
                    s.stop()

    interrupted = run_rows([], body, rows, ns.out, meta, log)
    if interrupted is None:
        return 1
    if rows:
        print(report(rows, names))
        for line in notes(rows):
            print(line)
        print(f"\nlatency: infill-during-chat: the /infill's, sent -> answer; four-at-once: the "
              f"mean of the four; alone: the median. chat total: the streamed chat's sent -> "
              f"last chunk. tok/s: infill-during-chat: the chat's decode tok/s (its server's "
              f"timings); four-at-once: aggregate = the four answers' tokens / (first send -> "
              f"last completion); alone: the median decode tok/s (server's timings). ms/step: "
              f"the requests' median decode time per step, each server's own timings counted "
              f"alike (tandem.bench.accounting). x: per repetition over `{BASELINE}` (latency, "
              f"ms/step: its over the server's, >1 faster; tok/s: the server's over its), then "
              f"the median; medians over the repetitions.")
    return exit_status(rows, interrupted, log)


if __name__ == "__main__":
    sys.exit(main())
