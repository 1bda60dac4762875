"""One prompt through llama-server or `tandem run`, and a side-by-side run's frame: the rows
tandem.bench.peer_report summarizes, for scripts/bench_peer.py and the benchmarks built on it
(bench_serve, bench_editors, bench_structured, bench_contention, bench_rpc).

A row is one prompt through one configuration: a llama-server configuration
(tandem.bench.llama_server) asked over /v1/chat/completions, or `tandem run --json` in a
subprocess, each counted by tandem.bench.accounting (end to end, per decode step, and decode
tok/s with end-of-text counted as llama-server counts it). A run starts its servers one after
another, warms every configuration up untimed, then runs prompt by prompt, every
configuration on the same prompt before the next, every other prompt in reverse order (drift
within a prompt then favours none of them), and keeps its rows whatever happens (Ctrl-C,
SIGTERM, a server that dies). Messages go to the caller's `log`; nothing is printed here.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Iterator

from tandem.bench import workloads
from tandem.bench.accounting import server_counts, tandem_counts
from tandem.bench.llama_server import LlamaServer, ServerError
from tandem.bench.peer_report import Row
from tandem.bench.workloads import Prompt

Log = Callable[[str], None]  # where progress and warnings go (a script: stderr)
RunConfig = Callable[[str, Prompt, int], Row]  # (configuration, prompt, tokens) -> its row


# ----------------------------------------------------------------------------- prompts

# Held-out coding prompts: none of them is in scripts/bench_native.py or the built-in suite
# (cli/tandem/data/workloads.yaml), so nothing was tuned on them.
CODING_PROMPTS = [
    "Write a Python function that parses a duration string such as '1h30m15s' into a number "
    "of seconds and raises ValueError on malformed input.",
    "Write a Go function that reverses the order of the words in a sentence, with a "
    "table-driven test.",
    "Implement a thread-safe bounded blocking queue in Java using a ReentrantLock and two "
    "Conditions.",
    "Write a Rust function that counts word frequencies in a string and returns the N most "
    "frequent words, sorted by count.",
    "Write a TypeScript function that deep-merges two plain objects without mutating either "
    "of them, with a precise type signature.",
    "Write a Python script that reads a CSV file of date,amount rows and prints the total "
    "amount per month, using only the standard library.",
    "Implement Dijkstra's shortest-path algorithm in Python with heapq, for a graph given as "
    "a dict of adjacency lists of (neighbour, weight) pairs.",
    "Write a C function that removes duplicates from a sorted int array in place and returns "
    "the new length, with a small main() that tests it.",
    "Write a regular expression that matches valid IPv4 addresses and a Python function that "
    "uses it, with a few test cases.",
    "Write a Dockerfile for a small Flask app that installs requirements.txt, runs as a "
    "non-root user and serves on port 8000 with gunicorn.",
]


def load_prompts(path: Path | None, per_category: int | None, categories: list[str] | None,
                 group: bool, coding: int, skip: int = 0) -> list[Prompt]:
    """Spec-Bench's first turns, `per_category` per category after the first `skip` of each
    (a second run on other prompts), then `coding` built-in coding prompts."""
    out: list[Prompt] = []
    if path is not None:
        items = workloads.read_file(path)  # Spec-Bench: the first turn of each question
        if group:
            items = workloads.group_mt_bench(items)
        items = workloads.select(items, None if per_category is None else per_category + skip,
                                 categories)
        seen: dict[str, int] = {}
        for p in items:
            seen[p.category] = seen.get(p.category, 0) + 1
            if seen[p.category] > skip:
                out.append(p)
    out += [Prompt(f"code-{i + 1}", "code", t) for i, t in enumerate(CODING_PROMPTS[:coding])]
    return out


def messages_for(p: Prompt) -> list[dict]:
    return ([{"role": "system", "content": p.system}] if p.system else []) + [
        {"role": "user", "content": p.text}]


def parse_named(spec: str, builtins: dict[str, str] | None = None) -> tuple[str, str]:
    """"NAME=ARGS" -> (NAME, ARGS); a bare built-in NAME -> (NAME, its built-in ARGS)."""
    if "=" in spec:
        name, args = spec.split("=", 1)
        name = name.strip()
        if not name:
            raise ValueError(f"configuration {spec!r} has no name (NAME=ARGS)")
        return name, args.strip()
    if builtins is not None and spec in builtins:
        return spec, builtins[spec]
    known = ", ".join(sorted(builtins)) if builtins else "none"
    raise ValueError(f"unknown configuration {spec!r}: use NAME=\"ARGS\" (built-in: {known})")


# ----------------------------------------------------------------------------- llama-server

def server_row(server: LlamaServer, p: Prompt, n: int, seed: int) -> Row:
    row = Row(p.id, p.category, server.name, "server")
    try:
        resp = server.chat(messages_for(p), n, seed)
    except ServerError as exc:
        row.error = str(exc)
        return row
    return parse_server_response(row, resp)


def parse_server_response(row: Row, resp: dict) -> Row:
    timings = resp.get("timings") or {}
    choice = (resp.get("choices") or [{}])[0]
    row.text = (choice.get("message") or {}).get("content") or ""
    row.n_generated = int(timings.get("predicted_n") or 0)
    row.drafted = int(timings.get("draft_n") or 0)
    row.accepted = int(timings.get("draft_n_accepted") or 0)
    counted = server_counts(row.n_generated, float(timings.get("predicted_ms") or 0.0),
                            float(timings.get("prompt_ms") or 0.0), row.accepted)
    row.tok_s = counted.tokens_per_second
    row.e2e_s, row.step_ms = counted.t_e2e, 1000 * counted.step_s
    row.extra = {"finish_reason": choice.get("finish_reason"),
                 "prompt_n": timings.get("prompt_n"), "predicted_ms": timings.get("predicted_ms"),
                 "prompt_ms": timings.get("prompt_ms"),
                 "predicted_per_second": timings.get("predicted_per_second"),
                 "prompt_per_second": timings.get("prompt_per_second")}
    if row.tok_s <= 0:
        row.error = ("no timings.predicted_n / predicted_ms in the response: "
                     f"{json.dumps(resp)[:300]}")
    return row


# ----------------------------------------------------------------------------- tandem

def tandem_command(tandem: list[str], p: Prompt, n: int, threads: int | None, ctx: int,
                   seed: int, model_args: list[str], extra: list[str],
                   pair: str | None = None) -> list[str]:
    """`tandem run --json ...`; the pair by name (`tandem run PAIR PROMPT`, so tuned settings
    and profiles apply as for a user) or by paths in model_args (-m/-md). `threads` None: no
    -t, tandem chooses (scripts/bench_contention.py)."""
    cmd = [*tandem, "run", "--json", "-n", str(n),
           *(["-t", str(threads)] if threads is not None else []), "-c", str(ctx),
           "--temp", "0", "--seed", str(seed), *model_args, *extra]
    if p.system:
        cmd += ["-s", p.system]
    return cmd + ["--", *([pair] if pair else []), p.text]


def parse_tandem_output(row: Row, stdout: str) -> Row:
    lines = [ln for ln in stdout.splitlines() if ln.lstrip().startswith("{")]
    if not lines:
        row.error = f"no JSON on tandem's stdout: {stdout[-300:]!r}"
        return row
    obj = json.loads(lines[-1])
    stats = obj.get("stats") or {}
    row.text = obj.get("text") or ""
    own = float(stats.get("tokens_per_second") or 0.0)
    row.n_generated = int(stats.get("n_generated") or 0)
    row.drafted = int(stats.get("drafted") or 0)
    row.accepted = int(stats.get("accepted") or 0)
    t_decode = float(stats.get("t_decode") or 0.0)
    t_prefill = float(stats.get("t_prefill") or 0.0)
    n_steps = int(stats.get("n_steps") or 0)
    row.extra = {"finish_reason": obj.get("finish_reason"), "strategy": stats.get("strategy"),
                 "notes": stats.get("notes"), "prompt_n": stats.get("n_prompt"),
                 "t_decode": t_decode, "t_prefill": t_prefill, "n_steps": n_steps,
                 "tok_s_own": own}
    # llama.cpp's count: the end-of-text token is a predicted token (module docstring)
    counted = tandem_counts(row.n_generated, obj.get("finish_reason") == "eos", n_steps,
                            t_prefill, t_decode)
    row.tok_s = counted.tokens_per_second
    row.e2e_s, row.step_ms = counted.t_e2e, 1000 * counted.step_s
    if row.tok_s <= 0:
        row.error = "tandem reported no decode speed"
    return row


def tandem_row(name: str, cmd: list[str], p: Prompt, env: dict | None = None) -> Row:
    row = Row(p.id, p.category, name, "tandem")
    try:
        res = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                             timeout=1800, env=env)
    except (OSError, subprocess.TimeoutExpired) as exc:
        row.error = f"tandem did not run: {exc}"
        return row
    if res.returncode != 0:
        row.error = f"tandem exited with code {res.returncode}: {res.stderr.strip()[-800:]}"
        return row
    try:
        return parse_tandem_output(row, res.stdout)
    except (json.JSONDecodeError, ValueError, TypeError) as exc:
        row.error = f"cannot read tandem's JSON: {exc}"
        return row


# ----------------------------------------------------------------------------- a run

def save_rows(out: Path, meta: dict, rows: list) -> None:
    """Every row (dataclasses) with the run's meta, as one JSON file: --out of the bench scripts."""
    out.write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1,
                              ensure_ascii=False), encoding="utf-8")


def log_folder(path: Path | None, prefix: str) -> Path:
    """--log-dir, made if missing, else a new temporary folder named by the script."""
    if path is None:
        import tempfile

        path = Path(tempfile.mkdtemp(prefix=prefix))
    path.mkdir(parents=True, exist_ok=True)
    return path


def run_rows(servers, body: Callable[[], None], rows: list, out: Path | None,
             meta: dict, log: Log) -> bool | None:
    """A bench run's frame: start `servers` one after another (only one thing computes at a
    time), run `body` (it appends to `rows`), then stop them and keep the rows (--out) whatever
    happened. False: it ran through; True: Ctrl-C (the rows so far are still reported); None:
    a server failed (said through `log`). SIGTERM counts as Ctrl-C: a run started in the
    background ignores SIGINT, and its rows would otherwise be lost with it."""
    def stop(signum, frame):  # noqa: ARG001 - signal handler signature
        raise KeyboardInterrupt
    main = threading.current_thread() is threading.main_thread()  # where handlers may be set
    previous = signal.signal(signal.SIGTERM, stop) if main else None
    try:
        for s in servers:
            t0 = time.monotonic()
            s.start()
            log(f"{s.name} ready on 127.0.0.1:{s.port} ({time.monotonic() - t0:.1f}s)")
        body()
        return False
    except KeyboardInterrupt:
        log("\ninterrupted: stopping the servers; results so far follow")
        return True
    except ServerError as exc:
        log(f"Error: {exc}")
        return None
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
        for s in servers:
            s.stop()
        if out is not None:
            save_rows(out, meta, rows)
            log(f"rows written to {out}")


def exit_status(rows, interrupted: bool, log: Log) -> int:
    """A bench script's exit code: 130 when interrupted, 1 when a run failed (said in `log`)."""
    errors = [r for r in rows if r.error]
    if errors:
        log(f"\n{len(errors)} run(s) failed; see stderr / --out")
    return 130 if interrupted else (1 if errors else 0)


WARMUP = Prompt("warmup", "warmup", "Say hello.")


def warm_up(names: list[str], run_config: RunConfig, log: Log) -> None:
    """One short untimed request per configuration: the weights paged in, tandem's costs
    calibrated once. A llama-server that fails it is said (its prompts will say more); a
    tandem configuration that fails it ends the run (ServerError): every prompt would fail."""
    for name in names:
        r = run_config(name, WARMUP, 8)
        if r.error and r.kind == "server":
            log(f"warning: llama-server '{name}' failed the warm-up: {r.error}")
        elif r.error:
            raise ServerError(f"tandem '{name}' failed on the warm-up prompt: {r.error}")


def interleaved(prompts: list[Prompt], names: list[str], run_config: RunConfig, n: int,
                log: Log, label: str = "") -> Iterator[list[Row]]:
    """Prompt by prompt, every configuration's row on that prompt (in `names`' order), each
    with the load average before the prompt (extra["loadavg"]). Every other prompt runs the
    configurations in reverse order: a machine that speeds up or slows down within a prompt
    then favours none of them. Errors and one progress line per prompt go to `log`."""
    for i, p in enumerate(prompts, 1):
        load = os.getloadavg()[0]
        done = [run_config(name, p, n) for name in (names if i % 2 else names[::-1])]
        done.sort(key=lambda r: names.index(r.config))  # a prompt counts once all have run it
        for r in done:
            r.extra["loadavg"] = load
            if r.error:
                log(f"  {r.config} on {p.id}: {r.error}")
        line = ", ".join(f"{r.config} {'ERROR' if r.error else f'{r.tok_s:.1f}'}" for r in done)
        log(f"[{label}{i}/{len(prompts)}] {p.category} {p.id}: {line} (load {load:.2f})")
        yield done
