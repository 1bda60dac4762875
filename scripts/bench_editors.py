#!/usr/bin/env python3
"""`tandem serve` against llama-server on the editors' completion route, request by request.

Replays two workloads of tandem.bench.editor_workload through `POST /infill`: fill-in-the-
middle holes cut from real code (`fim`), and a typing session as llama.vim sends it (`typing`:
a completion at each line's start and halfway through it, warm-ups with the ring of chunks
every few requests). Servers: `tandem serve` (its defaults: --cache-reuse 256) and llama.cpp's
llama-server from the same source (scripts/build_native.sh), started as llama.vscode's README
advises (`--cache-reuse 256`; `plain`, and with its draft model or n-gram mode). Requests go in
order, each to every server in turn (the order rotates), greedy, one at a time; each server
keeps its own cache, as an editor's server does.

Per request: latency (request sent -> answer, on the client), tokens the server evaluated for
the prompt (timings.prompt_n), and whether the completion's first line is the true rest of the
line (first-line agreement). The table: medians per server and workload, the median ratio of
llama-server plain's latency to each server's (>1: faster than it), also over the requests
whose true line repeats text of the file or the chunks.

  .venv/bin/python scripts/bench_editors.py --out editors.json          # the default pair
  .venv/bin/python scripts/bench_editors.py -m t.gguf -md d.gguf --no-llama --limit 6
  .venv/bin/python scripts/bench_editors.py --workload typing --record session.json
  .venv/bin/python scripts/bench_editors.py --replay session.json --out editors.json
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench_peer import default_tandem, log, pair_parser, resolve_models
from bench_serve import TandemServer, _median, llama_server_or_warn, server_options
from tandem.bench.editor_workload import Completion, agrees, fim_cases, typing_session
from tandem.bench.llama_server import (
    BASE_SERVER_ARGS,
    SERVER_CONFIGS,
    LlamaServer,
    ServerError,
    post_json,
)
from tandem.bench.peer_runs import exit_status, log_folder, run_rows

BASELINE = "llama plain"
REUSE = "--cache-reuse 256"  # llama.vscode's advice for llama-server


@dataclass
class Row:
    server: str
    id: str
    kind: str
    latency_s: float = 0.0
    prompt_n: int = 0
    cache_n: int = 0
    predicted_n: int = 0
    agrees: bool | None = None
    repeats: bool = False
    content: str = ""
    error: str | None = None
    extra: dict = field(default_factory=dict)


def infill(port: int, body: dict, timeout: float = 900.0) -> tuple[dict, float]:
    return post_json(port, "/infill", body, timeout)


def run_request(server, c) -> Row:
    row = Row(server.name, c.id, c.kind, repeats=c.repeats)
    try:
        resp, row.latency_s = infill(server.port, c.body)
    except ServerError as exc:
        row.error = str(exc)
        return row
    t = resp.get("timings") or {}
    row.prompt_n = int(t.get("prompt_n") or 0)
    row.cache_n = int(t.get("cache_n") or 0)
    row.predicted_n = int(t.get("predicted_n") or 0)
    row.content = resp.get("content") or ""
    if c.kind != "warmup":
        row.agrees = agrees(row.content, c.expected)
        if not t:
            row.error = "no timings in the response"
    return row


def report(rows: list[Row], names: list[str]) -> str:
    """Medians per server and workload; ratios per request over llama-server plain's."""
    base = {(r.id, r.kind): r for r in rows if r.server == BASELINE and not r.error}
    out = ["| workload | server | requests | median latency s | x llama plain | x on repeats "
           "| median prompt_n | first-line agreement |", "|---|---|---|---|---|---|---|---|"]
    for kind in ("fim", "typing", "warmup"):
        for name in names:
            mine = [r for r in rows if r.server == name and r.kind == kind and not r.error]
            if not mine:
                continue
            ratios = [base[(r.id, r.kind)].latency_s / r.latency_s for r in mine
                      if (r.id, r.kind) in base and r.latency_s > 0]
            rep = [base[(r.id, r.kind)].latency_s / r.latency_s for r in mine
                   if r.repeats and (r.id, r.kind) in base and r.latency_s > 0]
            judged = [r.agrees for r in mine if r.agrees is not None]
            out.append(f"| {kind} | {name} | {len(mine)} | "
                       f"{_median([r.latency_s for r in mine]):.3f} | "
                       f"{_median(ratios):.2f} | {_median(rep):.2f} ({len(rep)}) | "
                       f"{_median([r.prompt_n for r in mine]):.0f} | "
                       + (f"{sum(judged) / len(judged):.0%} |" if judged else "- |"))
    return "\n".join(out)


def build_parser() -> argparse.ArgumentParser:
    ap = pair_parser(__doc__)
    ap.add_argument("--workload", choices=("fim", "typing", "both"), default="both")
    ap.add_argument("--limit", type=int, help="at most this many requests per workload")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-c", "--ctx", type=int, default=8192)
    server_options(ap)
    ap.add_argument("--llama", action="append", choices=("plain", "draft", "ngram"),
                    help="llama-server configurations (default: plain, draft, ngram)")
    ap.add_argument("--record", type=Path,
                    help="write the requests to this file (JSON) and stop: a session to replay")
    ap.add_argument("--replay", type=Path, help="send the requests of a --record file instead")
    ap.add_argument("--log-dir", type=Path, help="server logs (default: a temporary directory)")
    ap.add_argument("--out", type=Path, help="write every per-request row here (JSON)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    work = []
    if ns.replay is not None:
        work = [Completion(**c) for c in json.loads(ns.replay.read_text(encoding="utf-8"))]
    if ns.workload in ("fim", "both") and ns.replay is None:
        work += fim_cases()[:ns.limit]
    if ns.workload in ("typing", "both") and ns.replay is None:
        work += typing_session()[:ns.limit]
    if ns.record is not None:
        ns.record.write_text(json.dumps([asdict(c) for c in work], indent=1), encoding="utf-8")
        print(f"{len(work)} requests written to {ns.record}", file=sys.stderr)
        return 0
    target, draft, model_args, pair_name = resolve_models(ns)
    log_dir = log_folder(ns.log_dir, "bench-editors-")
    tandem = shlex.split(ns.tandem_bin) if ns.tandem_bin else default_tandem()
    cmd = [*tandem, "serve", *([pair_name] if pair_name else model_args), "--port", "0",
           "-t", str(ns.threads), "-c", str(ns.ctx), *shlex.split(ns.tandem_args)]
    env = {**os.environ, "TANDEM_HISTORY": "off"}
    servers: list = [TandemServer(cmd, env, log_dir / "tandem-serve.log")]
    server_bin = llama_server_or_warn(ns)
    if server_bin is not None:
        fmt = {"threads": ns.threads, "ctx": ns.ctx, "draft": shlex.quote(str(draft))}
        base = f"{BASE_SERVER_ARGS.format(**fmt)} {REUSE}"
        for cfg in ns.llama or ("plain", "draft", "ngram"):
            servers.append(LlamaServer(f"llama {cfg}", server_bin, target,
                                       shlex.split(f"{base} {SERVER_CONFIGS[cfg].format(**fmt)}"),
                                       log_dir))
    names = [s.name for s in servers]
    meta = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "argv": sys.argv,
            "target": str(target), "draft": str(draft), "threads": ns.threads, "ctx": ns.ctx,
            "tandem": cmd, "servers": {s.name: getattr(s, "args", None) for s in servers[1:]},
            "loadavg_start": os.getloadavg(), "requests": len(work)}
    print(f"# tandem serve vs llama-server on /infill ({target.name} + {draft.name}; greedy, "
          f"{ns.threads} threads, context {ns.ctx}; {len(work)} requests)\n", flush=True)
    print(f"- `tandem`: {shlex.join(cmd)}", flush=True)
    for s in servers[1:]:
        print(f"- `{s.name}`: llama-server {shlex.join(s.args)}", flush=True)
    print(f"- logs: {log_dir}\n", flush=True)
    rows: list[Row] = []

    def body() -> None:
        for s in servers:  # untimed: pages the weights in, tandem calibrates its costs
            infill(s.port, {"input_prefix": "def f(", "input_suffix": ")\n", "n_predict": 4,
                            "temperature": 0})
        for i, c in enumerate(work):
            for s in servers[i % len(servers):] + servers[:i % len(servers)]:
                row = run_request(s, c)
                row.extra["loadavg"] = os.getloadavg()[0]
                rows.append(row)
                if row.error:
                    print(f"  {s.name} {c.id}: {row.error}", file=sys.stderr)
            print(f"[{i + 1}/{len(work)}] {c.kind} {c.id}: " + ", ".join(
                f"{r.server} {r.latency_s:.2f}s p{r.prompt_n}" for r in rows[-len(servers):]),
                file=sys.stderr, flush=True)

    interrupted = run_rows(servers, body, rows, ns.out, meta, log)
    if interrupted is None:
        return 1
    if rows:
        print(report(rows, names))
        print("\nlatency: request sent -> answer, on the client; x llama plain: the median of "
              f"`{BASELINE}`'s latency over the server's, request by request (>1: faster); "
              "on repeats: the requests whose true line is already in the file or the chunks; "
              "prompt_n: prompt tokens the server evaluated.")
    return exit_status(rows, interrupted, log)


if __name__ == "__main__":
    sys.exit(main())
