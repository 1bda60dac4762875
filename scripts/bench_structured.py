#!/usr/bin/env python3
"""Structured outputs: tandem serve against llama-server on the structured workload (issue 30).

The tasks are spec-bench's structured workload (cli/tandem/data/structured.yaml: extraction
from a given text, generation to a schema, tool calls). Every configuration is an
OpenAI-compatible server on 127.0.0.1, loaded once, and gets the same request body for a
task: its messages, greedy, a fixed seed, and its constraint through the API,
`response_format: {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}` for a
schema task, `tools` with `tool_choice: "required"` and `parallel_tool_calls: false` for a
tool task (llama-server takes only auto/none/required, so a task that names its tool is sent
as "required" with the tools narrowed to that one, to both sides). Configurations:

- llama-server (built by scripts/build_native.sh from the llama.cpp llama-cpp-python vendors):
  `llama plain` (its defaults), `llama draft` (its draft-simple mode) and `llama ngram` (its
  ngram-mod mode), with scripts/bench_peer.py's settings for those modes;
- `tandem serve`: `tandem none` (--strategy none: plain decoding under the grammar) and
  `tandem default` (its default strategy, the grammar's forced tokens as free drafts).

Why `tandem serve` rather than `tandem run -j`: the same request reaches both tools through
the same client and HTTP path, tool tasks exist only there (run has no tools), and both
servers keep their KV cache between requests the same way (by prefix, llama-server's
cache_prompt is left on), so each evaluates the same prompt tokens: every row records
prompt_n, and the end-to-end ratios are taken only over prompts where both sides evaluated
as many prompt tokens (as spec-bench's report does). Both sides' timings are counted by
tandem.bench.accounting: llama-server's `timings` (predicted_n counts end-of-text), tandem's
the same fields plus its verify steps (`tandem.verify_steps`), end-of-text counted when the
answer stopped by itself. A `stop` finish means end-of-text here: no request has stop strings.
Once its grammar is complete tandem ends without the step llama-server spends on sampling the
forced end-of-text: both count that token (tok/s), only llama-server pays its step (end to
end), which is why end to end is the figure to compare.

Tasks go one at a time, interleaved: each task goes to every configuration before the next
task, the order reversed every other task, so drift on the machine favours none of them.
Every answer is checked with jsonschema (tandem.bench.structured_workload.check_message):
the content against the task's schema, a tool call's arguments against its tool's parameters.

Per configuration: valid/total, median end to end (prompt + decode, server timings), median
ms per decode step, median decode tok/s, median client latency, acceptance, and the median
per-task ratios to `llama plain` (end to end and tok/s). --out writes every row (JSON).

  .venv/bin/python scripts/bench_structured.py --out structured.json      # the default pair
  .venv/bin/python scripts/bench_structured.py -m t.gguf -md d.gguf --prompts 1 -n 16
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from bench_peer import default_tandem, log, pair_parser, resolve_models
from bench_serve import TandemServer, find_server_bin
from tandem.bench.accounting import response_counts, server_counts
from tandem.bench.llama_server import (
    BASE_SERVER_ARGS,
    SERVER_CONFIGS,
    LlamaServer,
    ServerError,
    post_json,
)
from tandem.bench.peer_runs import exit_status, log_folder, run_rows
from tandem.bench.structured_workload import check_message, load

BASELINE = "llama plain"
LLAMA = {"llama plain": SERVER_CONFIGS["plain"], "llama draft": SERVER_CONFIGS["draft"],
         "llama ngram": SERVER_CONFIGS["ngram"]}
TANDEM = {"tandem none": ["--strategy", "none"], "tandem default": []}


@dataclass
class Row:
    task: str
    kind: str
    config: str
    valid: bool = False
    invalid: str = ""
    e2e_s: float = 0.0  # prompt + decode, the server's own timings (bench/accounting.py)
    step_ms: float = 0.0  # decode time per decode step
    tok_s: float = 0.0  # decode tok/s, end-of-text counted as llama-server counts it
    latency_s: float = 0.0  # request sent -> answer read, on the client
    prompt_n: int = 0  # prompt tokens evaluated (the rest came from the KV cache)
    predicted_n: int = 0
    drafted: int = 0
    accepted: int = 0
    finish_reason: str | None = None
    text: str = ""
    error: str | None = None
    extra: dict = field(default_factory=dict)


def request_body(task, n: int, seed: int) -> dict:
    """The one body both sides get for a task (module docstring)."""
    body = {"messages": [{"role": "user", "content": task.text}], "max_tokens": n,
            "temperature": 0.0, "seed": seed, "stream": False, "cache_prompt": True}
    s = task.structure
    if s.tools:
        tools = [t for t in s.tools if s.tool_choice in ("required", t.name)]
        body.update(tools=[t.as_openai() for t in tools], tool_choice="required",
                    parallel_tool_calls=False)
    else:
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": task.id.replace("-", "_"), "schema": s.schema, "strict": True}}
    return body


def post(port: int, body: dict, timeout: float = 1800.0) -> tuple[dict, float]:
    return post_json(port, "/v1/chat/completions", body, timeout)


def run_task(server, task, ns) -> Row:
    row = Row(task.id, task.category, server.name)
    try:
        resp, row.latency_s = post(server.port, request_body(task, ns.n_predict, ns.seed))
    except ServerError as exc:
        row.error, row.invalid = str(exc), "request failed"
        return row
    t = resp.get("timings") or {}
    choice = (resp.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    row.finish_reason = choice.get("finish_reason")
    row.text = message.get("content") or json.dumps(message.get("tool_calls") or [])
    row.valid, row.invalid = check_message(task.structure, message, row.finish_reason)
    row.prompt_n, row.predicted_n = int(t.get("prompt_n") or 0), int(t.get("predicted_n") or 0)
    row.drafted, row.accepted = int(t.get("draft_n") or 0), int(t.get("draft_n_accepted") or 0)
    own = resp.get("tandem")
    if own is not None:
        row.extra["by_source"] = own.get("by_source")
    counted = response_counts(resp) or server_counts(0, 0.0, 0.0)
    row.e2e_s, row.step_ms, row.tok_s = counted.t_e2e, 1000 * counted.step_s, counted.tokens_per_second
    row.extra["cache_n"] = t.get("cache_n")
    if not t:
        row.error = "no timings in the response"
    return row


def _median(xs) -> float:
    xs = list(xs)
    return statistics.median(xs) if xs else float("nan")


def _f(x: float, spec: str = ".2f") -> str:
    return "-" if x != x else format(x, spec)  # NaN: nothing to show


def report(rows: list[Row], names: list[str]) -> str:
    base = {r.task: r for r in rows if r.config == BASELINE and not r.error}
    lines = [f"| configuration | valid | e2e s (median) | ms/step (median) | decode tok/s "
             f"(median) | client latency s | acceptance | e2e vs `{BASELINE}` | tok/s vs "
             f"`{BASELINE}` | same prompt work |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name in names:
        mine = [r for r in rows if r.config == name]
        ok = [r for r in mine if not r.error]
        pairs = [(base[r.task], r) for r in ok if r.task in base]
        same = [(b, r) for b, r in pairs if b.prompt_n == r.prompt_n]
        e2e = [b.e2e_s / r.e2e_s for b, r in same if r.e2e_s > 0 and b.e2e_s > 0]
        tps = [r.tok_s / b.tok_s for b, r in pairs if b.tok_s > 0 and r.tok_s > 0]
        drafted = sum(r.drafted for r in ok)
        acc = f"{100 * sum(r.accepted for r in ok) / drafted:.1f}%" if drafted else "-"
        lines.append(
            f"| {name} | {sum(r.valid for r in mine)}/{len(mine)} | {_f(_median(r.e2e_s for r in ok))} "
            f"| {_f(_median(r.step_ms for r in ok), '.1f')} | {_f(_median(r.tok_s for r in ok), '.1f')} "
            f"| {_f(_median(r.latency_s for r in ok))} | {acc} | {_f(_median(e2e))}x "
            f"| {_f(_median(tps))}x | {len(same)}/{len(pairs)} |")
    bad = [f"- {r.config} {r.task}: {r.error or r.invalid}" for r in rows if not r.valid]
    if bad:
        lines += ["", "Invalid or failed:", *bad[:40]]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = pair_parser(__doc__)
    ap.add_argument("--prompts", type=int, default=None, metavar="N",
                    help="the first N tasks, taken in turn from each kind (default: all)")
    ap.add_argument("--kind", action="append", choices=["extraction", "generation", "tools"],
                    help="only this kind of task (repeatable)")
    ap.add_argument("-n", "--n-predict", type=int, default=256, help="max tokens per answer")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-c", "--ctx", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--config", action="append", choices=[*LLAMA, *TANDEM],
                    help=f"only these configurations (repeatable; {BASELINE} always runs)")
    ap.add_argument("--tandem-bin", help="tandem command (default: .venv/bin/tandem)")
    ap.add_argument("--server-bin", type=Path, help="llama-server binary")
    ap.add_argument("--build-native", action="store_true",
                    help="build llama-server with scripts/build_native.sh if needed")
    ap.add_argument("--history", action="store_true",
                    help="let tandem draft from the user's earlier answers on disk")
    ap.add_argument("--log-dir", type=Path, help="server logs (default: a temporary directory)")
    ap.add_argument("--out", type=Path, help="write every per-task row here (JSON)")
    return ap


def pick_tasks(kinds, n: int | None) -> list:
    """The workload's tasks, kinds interleaved, so that the first N sample every kind."""
    from itertools import zip_longest

    tasks = [t for t in load() if not kinds or t.category in kinds]
    groups = [[t for t in tasks if t.category == k] for k in dict.fromkeys(t.category for t in tasks)]
    mixed = [t for row in zip_longest(*groups) for t in row if t is not None]
    return mixed[:n] if n is not None else mixed


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    tasks = pick_tasks(ns.kind, ns.prompts)
    if not tasks:
        raise SystemExit("Error: no tasks selected")
    wanted = [BASELINE] + [c for c in (ns.config or [*LLAMA, *TANDEM]) if c != BASELINE]
    server_bin = find_server_bin(ns)
    if server_bin is None:
        raise SystemExit("Error: no llama-server binary (scripts/build_native.sh; "
                         "--server-bin or --build-native)")
    target, draft, model_args, pair_name = resolve_models(ns)
    log_dir = log_folder(ns.log_dir, "bench-structured-")
    fmt = {"threads": ns.threads, "ctx": ns.ctx, "draft": shlex.quote(str(draft))}
    base = BASE_SERVER_ARGS.format(**fmt)
    tandem = shlex.split(ns.tandem_bin) if ns.tandem_bin else default_tandem()
    env = dict(os.environ) if ns.history else {**os.environ, "TANDEM_HISTORY": "off"}
    servers: list = []
    for name in wanted:
        if name in LLAMA:
            servers.append(LlamaServer(name.replace(" ", "-"), server_bin, target,
                                       shlex.split(f"{base} {LLAMA[name].format(**fmt)}"), log_dir))
        else:
            cmd = [*tandem, "serve", *([pair_name] if pair_name else model_args), "--port", "0",
                   "-t", str(ns.threads), "-c", str(ns.ctx), *TANDEM[name]]
            servers.append(TandemServer(cmd, env, log_dir / f"{name.replace(' ', '-')}.log"))
        servers[-1].name = name
    meta = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "argv": sys.argv,
            "target": str(target), "draft": str(draft), "n_predict": ns.n_predict,
            "threads": ns.threads, "ctx": ns.ctx, "seed": ns.seed, "tasks": len(tasks),
            "configs": {s.name: getattr(s, "args", None) or s.cmd for s in servers},
            "history": ns.history, "loadavg_start": os.getloadavg()}
    print(f"# structured outputs: tandem serve vs llama-server ({target.name} + {draft.name}; "
          f"greedy, {ns.n_predict} tokens max, {ns.threads} threads, context {ns.ctx}; "
          f"{len(tasks)} tasks)\n", flush=True)
    for s in servers:
        print(f"- `{s.name}`: {shlex.join(getattr(s, 'args', None) or s.cmd)}", flush=True)
    print(f"- logs: {log_dir}\n", flush=True)

    rows: list[Row] = []

    def body() -> None:  # the servers are loaded one after another, then kept
        # untimed: pages the weights in, tandem calibrates its costs; another text than the
        # tasks', so that no task finds its own prompt in a cache
        warm = replace(tasks[0], text="Say hello.")
        for s in servers:
            post(s.port, request_body(warm, 8, ns.seed))
        for i, task in enumerate(tasks, 1):
            order = servers if i % 2 else servers[::-1]
            done = [run_task(s, task, ns) for s in order]
            done.sort(key=lambda r: wanted.index(r.config))
            rows.extend(done)
            print(f"[{i}/{len(tasks)}] {task.category} {task.id}: " + ", ".join(
                f"{r.config} {'ERROR' if r.error else ('ok' if r.valid else 'INVALID')} "
                f"{r.e2e_s:.2f}s" for r in done), file=sys.stderr, flush=True)

    interrupted = run_rows(servers, body, rows, ns.out, meta, log)
    if interrupted is None:
        return 1
    if rows:
        print(report(rows, wanted))
        print(f"\nvalid: answers that validate with jsonschema; e2e: prompt + decode from the "
              f"server's timings; ratios: per task over `{BASELINE}`, then the median (e2e only "
              "over tasks where both evaluated as many prompt tokens: same prompt work).")
    return exit_status(rows, interrupted, log)


if __name__ == "__main__":
    sys.exit(main())
