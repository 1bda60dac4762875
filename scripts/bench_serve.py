#!/usr/bin/env python3
"""`tandem serve` against llama-server, conversation by conversation, through the HTTP API.

Sends the built-in multi-turn code-editing conversations (cli/tandem/data/conversations.yaml,
as spec-bench's multi-turn workload) and Spec-Bench's two-turn MT-bench rows
(../shared/spec_bench/question.dev.jsonl) to `tandem serve` and to llama.cpp's llama-server
(the native build of scripts/build_native.sh: `plain` = its defaults with its prompt cache on,
and `ngram` = its n-gram speculative mode, bench_peer.py's `--spec-type ngram-mod` settings).
Each conversation's turns go in order, every server getting its own previous answer appended
(as a chat client does), greedy, one request at a time; the servers take turns per
conversation (the order rotates), so drift on the machine favours none of them. Per turn:
end-to-end latency (request sent -> answer complete, on the client) and decode tok/s from the
server's own `timings` (llama-server's fields; tandem serve fills the same ones), plus
prompt_n / cache_n (how much of the prompt each server evaluated).

Prints a Markdown table (median per group and turn kind: t1 = first turns, t2+ = later ones;
ratios are per turn over llama-server `plain` on the same conversation and turn, then the
median) and writes every row to --out (JSON). Below it, what each server's own timings leave
out (HTTP, JSON, tokenizing, the template): end-to-end latency minus prompt_ms and
predicted_ms, per request and per generated token; with --stream every answer streams (one
server-sent event a token) and rows also get the client's first-to-last-chunk time.

  .venv/bin/python scripts/bench_serve.py --out serve.json              # the default pair
  .venv/bin/python scripts/bench_serve.py -m t.gguf -md d.gguf --per-group 1 -n 32 --no-llama

The llama-server part is skipped when no llama-server binary is found (--server-bin, else
scripts/build_native.sh's bin directory if it was built; --build-native builds it).
tandem runs with TANDEM_HISTORY=off unless --history (no earlier answers of the user's store).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from bench_peer import DEFAULT_PROMPTS, default_tandem, log, pair_parser, resolve_models
from native_tools import native_bin
from tandem.bench.llama_server import BASE_SERVER_ARGS, SERVER_CONFIGS, LlamaServer, ServerError
from tandem.bench.multiturn import builtin_conversations, select, spec_bench_conversations
from tandem.bench.peer_runs import exit_status, log_folder, run_rows

BASELINE = "llama plain"
TANDEM = "tandem"


@dataclass
class Row:
    server: str
    conv: str
    group: str
    turn: int  # 1-based
    latency_s: float = 0.0
    tok_s: float = 0.0
    prompt_n: int = 0
    cache_n: int | None = None
    prompt_ms: float = 0.0
    predicted_n: int = 0
    predicted_ms: float = 0.0
    draft_n: int = 0
    draft_n_accepted: int = 0
    finish_reason: str | None = None
    client_decode_ms: float | None = None  # --stream: first text chunk -> last chunk
    text: str = ""
    error: str | None = None
    extra: dict = field(default_factory=dict)


class TandemServer:
    """`tandem serve` on a free port of 127.0.0.1 (it prints the address it took)."""

    def __init__(self, cmd: list[str], env: dict, log_path: Path):
        self.name = TANDEM
        self.cmd, self.env, self.log_path = cmd, env, log_path
        self.proc: subprocess.Popen | None = None
        self.port = 0

    def start(self, timeout: float = 900.0) -> None:
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True, env=self.env)
        found = threading.Event()
        log = open(self.log_path, "w", encoding="utf-8")

        def drain():
            for line in self.proc.stderr:
                log.write(line)
                log.flush()
                m = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
                if m and not self.port:
                    self.port = int(m.group(1))
                    found.set()
            log.close()
            found.set()

        threading.Thread(target=drain, daemon=True).start()
        if not found.wait(timeout) or not self.port:
            self.stop()
            raise ServerError(f"tandem serve did not start; log: {self.log_path}\n"
                              + self.log_path.read_text(errors="replace")[-2000:])

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def chat(port: int, messages: list[dict], n: int, seed: int, stream: bool,
         timeout: float = 1800.0) -> tuple[dict, float, float | None]:
    """(the response as one object, end-to-end seconds, client decode ms when streamed: first
    text chunk -> last, over the object's `chunks` text chunks, a count only a stream has)."""
    body = {"messages": messages, "max_tokens": n, "temperature": 0.0, "seed": seed,
            "stream": stream, "cache_prompt": True}
    if stream:
        body["stream_options"] = {"include_usage": True}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
                                 data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            if not stream:
                resp = json.loads(r.read())
                return resp, time.perf_counter() - t0, None
            text, out, first, last = [], {}, None, None
            for raw in r:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                for choice in obj.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        first = first or time.perf_counter()
                        last = time.perf_counter()
                        text.append(piece)
                    if choice.get("finish_reason"):
                        out["finish_reason"] = choice["finish_reason"]
                for key in ("timings", "usage", "tandem"):
                    if obj.get(key):
                        out[key] = obj[key]
            wall = time.perf_counter() - t0
            resp = {"choices": [{"message": {"content": "".join(text)},
                                 "finish_reason": out.get("finish_reason")}],
                    "timings": out.get("timings"), "usage": out.get("usage"),
                    "chunks": len(text)}
            if "tandem" in out:  # tandem's own figures (verify steps: bench/accounting.py)
                resp["tandem"] = out["tandem"]
            decode_ms = (last - first) * 1000 if first is not None else None
            return resp, wall, decode_ms
    except urllib.error.HTTPError as exc:
        raise ServerError(f"HTTP {exc.code}: {exc.read().decode(errors='replace')[:500]}") from exc
    except (urllib.error.URLError, OSError) as exc:
        raise ServerError(str(exc)) from exc


def run_turn(server, conv, turn: int, messages: list[dict], ns) -> Row:
    row = Row(server.name, conv.id, conv.group, turn)
    try:
        resp, wall, decode_ms = chat(server.port, messages, ns.n_predict, ns.seed, ns.stream)
    except ServerError as exc:
        row.error = str(exc)
        return row
    t = resp.get("timings") or {}
    choice = (resp.get("choices") or [{}])[0]
    row.latency_s = wall
    row.text = (choice.get("message") or {}).get("content") or ""
    row.finish_reason = choice.get("finish_reason")
    row.tok_s = float(t.get("predicted_per_second") or 0.0)
    row.prompt_n = int(t.get("prompt_n") or 0)
    row.cache_n = t.get("cache_n")
    row.predicted_n = int(t.get("predicted_n") or 0)
    row.predicted_ms = float(t.get("predicted_ms") or 0.0)
    row.prompt_ms = float(t.get("prompt_ms") or 0.0)
    row.draft_n = int(t.get("draft_n") or 0)
    row.draft_n_accepted = int(t.get("draft_n_accepted") or 0)
    row.client_decode_ms = decode_ms
    if not t:
        row.error = "no timings in the response"
    return row


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def report(rows: list[Row], names: list[str]) -> str:
    ok = [r for r in rows if not r.error]
    by_key = {(r.server, r.conv, r.turn): r for r in ok}
    groups = list(dict.fromkeys(r.group for r in ok))
    lines = ["| group | turns | server | n | latency s (median) | decode tok/s (median) | "
             f"prompt_n (median) | speed vs `{BASELINE}` (median of per-turn latency ratios) "
             "| tok/s vs baseline | acceptance |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for g in groups:
        for kind, pick in (("t1", lambda t: t == 1), ("t2+", lambda t: t >= 2)):
            for name in names:
                rs = [r for r in ok if r.server == name and r.group == g and pick(r.turn)]
                if not rs:
                    continue
                base = [(by_key.get((BASELINE, r.conv, r.turn)), r) for r in rs]
                lat = [b.latency_s / r.latency_s for b, r in base if b and r.latency_s > 0]
                spd = [r.tok_s / b.tok_s for b, r in base if b and b.tok_s > 0]
                drafted = sum(r.draft_n for r in rs)
                acc = f"{sum(r.draft_n_accepted for r in rs) / drafted:.2f}" if drafted else "-"
                lines.append(
                    f"| {g} | {kind} | {name} | {len(rs)} | {_median([r.latency_s for r in rs]):.2f} "
                    f"| {_median([r.tok_s for r in rs]):.1f} "
                    f"| {_median([r.prompt_n for r in rs]):.0f} "
                    f"| {f'{_median(lat):.2f}x' if lat else '-'} "
                    f"| {f'{_median(spd):.2f}x' if spd else '-'} | {acc} |")
    lines.append("")
    for name in names:
        # what the server's own timings leave out: HTTP, JSON, queueing, tokenizing, template
        over = [(r.latency_s * 1000 - r.prompt_ms - r.predicted_ms, r.predicted_n)
                for r in ok if r.server == name and r.predicted_n > 0]
        if over:
            lines.append(f"- `{name}`: end-to-end latency minus the server's prompt_ms + "
                         f"predicted_ms: median {_median([o for o, _ in over]):.1f} ms a request, "
                         f"{_median([o / n for o, n in over]):.3f} ms per generated token"
                         + (" (streamed)" if any(r.client_decode_ms is not None for r in ok)
                            else ""))
    return "\n".join(lines)


def find_server_bin(ns) -> Path | None:
    if ns.server_bin is not None:
        return ns.server_bin
    if ns.build_native:
        return native_bin() / "llama-server"
    # where scripts/build_native.sh puts its build, without building (minutes on a CPU)
    found = native_bin(build=False)
    return found / "llama-server" if found and (found / "llama-server").exists() else None


def llama_server_or_warn(ns) -> Path | None:
    """The llama-server binary to compare with, or None after saying on stderr why not."""
    server_bin = None if ns.no_llama else find_server_bin(ns)
    if not ns.no_llama and server_bin is None:
        print("warning: no llama-server binary (scripts/build_native.sh not built; "
              "--server-bin or --build-native): tandem serve only", file=sys.stderr)
    return server_bin


def server_options(ap: argparse.ArgumentParser) -> None:
    """The options of a benchmark of `tandem serve` against llama-server: the tandem command
    and its extra arguments, the llama-server binary (llama_server_or_warn reads them)."""
    ap.add_argument("--tandem-args", default="",
                    help="extra `tandem serve` arguments (e.g. \"--strategy auto\")")
    ap.add_argument("--tandem-bin", help="tandem command (default: .venv/bin/tandem)")
    ap.add_argument("--server-bin", type=Path, help="llama-server binary")
    ap.add_argument("--build-native", action="store_true",
                    help="build llama-server with scripts/build_native.sh if needed")
    ap.add_argument("--no-llama", action="store_true", help="tandem serve only")


def build_parser() -> argparse.ArgumentParser:
    ap = pair_parser(__doc__)
    ap.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS,
                    help="Spec-Bench JSONL; its two-turn rows are used (default: %(default)s)")
    ap.add_argument("--no-mt-bench", action="store_true", help="only the code-edit conversations")
    ap.add_argument("--per-group", type=int, default=None,
                    help="conversations per group (code-edit, holdout, mt-bench; default all)")
    ap.add_argument("-n", "--n-predict", type=int, default=256, help="max tokens per answer")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-c", "--ctx", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=42)
    server_options(ap)
    ap.add_argument("--no-ngram", action="store_true", help="no llama-server n-gram config")
    ap.add_argument("--stream", action="store_true",
                    help="stream every answer (then the overhead line is per streamed token)")
    ap.add_argument("--history", action="store_true",
                    help="let tandem draft from the user's earlier answers on disk")
    ap.add_argument("--log-dir", type=Path, help="server logs (default: a temporary directory)")
    ap.add_argument("--out", type=Path, help="write every per-turn row here (JSON)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    convs = builtin_conversations()
    if not ns.no_mt_bench:
        if ns.prompts.exists():
            convs += spec_bench_conversations(ns.prompts)
        else:
            print(f"warning: {ns.prompts} not found: MT-bench rows skipped", file=sys.stderr)
    convs = select(convs, ns.per_group)
    target, draft, model_args, pair_name = resolve_models(ns)
    log_dir = log_folder(ns.log_dir, "bench-serve-")

    tandem = shlex.split(ns.tandem_bin) if ns.tandem_bin else default_tandem()
    cmd = [*tandem, "serve", *([pair_name] if pair_name else model_args), "--port", "0",
           "-t", str(ns.threads), "-c", str(ns.ctx), *shlex.split(ns.tandem_args)]
    env = dict(os.environ) if ns.history else {**os.environ, "TANDEM_HISTORY": "off"}
    servers: list = [TandemServer(cmd, env, log_dir / "tandem-serve.log")]
    server_bin = llama_server_or_warn(ns)
    if server_bin is not None:
        fmt = {"threads": ns.threads, "ctx": ns.ctx, "draft": shlex.quote(str(draft))}
        base = BASE_SERVER_ARGS.format(**fmt)
        configs = {BASELINE: ""}  # its defaults: the prompt cache is on by default
        if not ns.no_ngram:
            configs["llama ngram"] = SERVER_CONFIGS["ngram"]
        servers += [LlamaServer(name, server_bin, target, shlex.split(f"{base} {args}"), log_dir)
                    for name, args in configs.items()]
    names = [s.name for s in servers]
    meta = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "argv": sys.argv,
            "target": str(target), "draft": str(draft), "n_predict": ns.n_predict,
            "threads": ns.threads, "ctx": ns.ctx, "stream": ns.stream,
            "tandem": cmd, "servers": {s.name: getattr(s, "args", None) for s in servers[1:]},
            "history": ns.history, "loadavg_start": os.getloadavg()}
    print(f"# tandem serve vs llama-server ({target.name} + {draft.name}; greedy, "
          f"{ns.n_predict} tokens max, {ns.threads} threads, context {ns.ctx}; "
          f"{len(convs)} conversations)\n", flush=True)
    print(f"- `{TANDEM}`: {shlex.join(cmd)}", flush=True)
    for s in servers[1:]:
        print(f"- `{s.name}`: llama-server {shlex.join(s.args)}", flush=True)
    print(f"- logs: {log_dir}\n", flush=True)

    rows: list[Row] = []

    def body() -> None:  # the servers are loaded one after another, then kept
        for s in servers:  # untimed: pages the weights in, tandem calibrates its costs
            chat(s.port, [{"role": "user", "content": "Say hello."}], 8, ns.seed, False)
        for i, conv in enumerate(convs):
            order = servers[i % len(servers):] + servers[:i % len(servers)]
            for s in order:
                messages: list[dict] = []
                for turn, text in enumerate(conv.turns, 1):
                    messages.append({"role": "user", "content": text})
                    row = run_turn(s, conv, turn, messages, ns)
                    row.extra["loadavg"] = os.getloadavg()[0]
                    rows.append(row)
                    if row.error:
                        print(f"  {s.name} {conv.id} t{turn}: {row.error}", file=sys.stderr)
                        break
                    messages.append({"role": "assistant", "content": row.text})
                    print(f"[{i + 1}/{len(convs)}] {conv.group} {conv.id} t{turn} {s.name}: "
                          f"{row.latency_s:.2f}s, {row.tok_s:.1f} tok/s, prompt_n "
                          f"{row.prompt_n}", file=sys.stderr, flush=True)

    interrupted = run_rows(servers, body, rows, ns.out, meta, log)
    if interrupted is None:
        return 1
    if rows:
        print(report(rows, names))
        print("\nlatency: request sent -> answer complete, on the client; decode tok/s: the "
              "server's timings.predicted_per_second; ratios: per conversation and turn over "
              f"`{BASELINE}`, then the median.")
    return exit_status(rows, interrupted, log)


if __name__ == "__main__":
    sys.exit(main())
