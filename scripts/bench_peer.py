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
import json
import math
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from tandem.bench.accounting import server_counts, tandem_counts
from tandem.bench.native import native_bin  # noqa: F401 - bench_serve takes it from here
from tandem.bench.workloads import Prompt as BenchPrompt  # spec-bench's prompt record

ROOT = Path(__file__).resolve().parents[1]
# the Spec-Bench questions beside the checkout (../shared/spec_bench), as tests/test_bench.py
DEFAULT_PROMPTS = ROOT.parent / "shared" / "spec_bench" / "question.dev.jsonl"
BASELINE = "plain"

# Base arguments of every server configuration; -m, --host and --port are added by Server.
BASE_SERVER_ARGS = "-t {threads} -c {ctx} -np 1 --jinja"
SERVER_CONFIGS = {
    # llama-server's own defaults (repacked weights, f16 KV cache, flash attention auto)
    "plain": "",
    # In this llama.cpp `-md` alone loads the draft but does not speculate: --spec-type does.
    # Draft length: llama-server's default (--spec-draft-n-max); p-min as tandem's profile.
    "draft": "--spec-type draft-simple -md {draft} -td {threads} --spec-draft-p-min 0.75",
    # ngram-mod's defaults (n-min 48) target long repeated code; short n-grams suit 128 tokens.
    "ngram": ("--spec-type ngram-mod --spec-ngram-mod-n-min 1 --spec-ngram-mod-n-max 8 "
              "--spec-ngram-mod-n-match 3"),
}
DEFAULT_SERVERS = ["plain", "draft", "ngram"]

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


# ----------------------------------------------------------------------------- data

@dataclass
class Row:
    """One prompt through one configuration."""
    prompt_id: str
    category: str
    config: str
    kind: str  # "server" | "tandem"
    tok_s: float = 0.0  # decode tok/s, end-of-text counted as llama-server counts it
    n_generated: int = 0
    drafted: int = 0
    accepted: int = 0
    text: str = ""
    error: str | None = None
    extra: dict = field(default_factory=dict)  # strategy, notes, prompt tokens, ...
    e2e_s: float = 0.0  # prompt + decode seconds
    step_ms: float = 0.0  # decode time per decode step

    @property
    def ok(self) -> bool:
        return self.error is None and self.tok_s > 0


@dataclass
class Summary:
    config: str
    n: int  # prompts with a ratio
    median: float
    geomean: float
    lo: float
    hi: float
    median_tok_s: float
    acceptance: float | None  # accepted / drafted over all prompts, None when nothing drafted
    same: int  # greedy outputs equal to the baseline's text
    compared: int  # prompts where both texts exist
    e2e: float = float("nan")  # median ratio of the baseline's end-to-end time to this one's
    per_step: float = float("nan")  # median ratio of the baseline's time per step to this one's


def same_text(a: str, b: str) -> bool:
    """Greedy outputs agree when their texts match after stripping surrounding whitespace."""
    return a.strip() == b.strip()


def geomean(xs: list[float]) -> float:
    xs = [x for x in xs if x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def summarize(rows: list[Row], configs: list[str], baseline: str = BASELINE) -> dict[str, Summary]:
    """Per configuration: per-prompt ratios of decode tok/s to the baseline's on the same
    prompt (median, geometric mean, range), acceptance, and outputs equal to the baseline's."""
    base = {r.prompt_id: r for r in rows if r.config == baseline}
    out: dict[str, Summary] = {}
    for config in configs:
        mine = [r for r in rows if r.config == config]
        ratios, speeds, same, compared = [], [], 0, 0
        e2e, per_step = [], []
        drafted = accepted = 0
        for r in mine:
            b = base.get(r.prompt_id)
            if r.ok:
                speeds.append(r.tok_s)
                drafted += r.drafted
                accepted += r.accepted
            if b is None or b.error is not None or r.error is not None:
                continue
            compared += 1
            same += same_text(r.text, b.text)
            if r.ok and b.ok:
                ratios.append(r.tok_s / b.tok_s)
                if r.e2e_s > 0 and b.e2e_s > 0:
                    e2e.append(b.e2e_s / r.e2e_s)
                if r.step_ms > 0 and b.step_ms > 0:
                    per_step.append(b.step_ms / r.step_ms)
        nan = float("nan")
        out[config] = Summary(
            config=config, n=len(ratios),
            median=statistics.median(ratios) if ratios else nan,
            geomean=geomean(ratios),
            lo=min(ratios) if ratios else nan, hi=max(ratios) if ratios else nan,
            median_tok_s=statistics.median(speeds) if speeds else nan,
            acceptance=accepted / drafted if drafted else None,
            same=same, compared=compared,
            e2e=statistics.median(e2e) if e2e else nan,
            per_step=statistics.median(per_step) if per_step else nan)
    return out


def _f(x: float, fmt: str = "{:.2f}") -> str:
    return "" if x is None or math.isnan(x) else fmt.format(x)


def render_table(title: str, summaries: dict[str, Summary], baseline: str = BASELINE) -> str:
    """Markdown table of one category's summaries, in the order given."""
    n_prompts = max((s.compared for s in summaries.values()), default=0)
    lines = [f"### {title} ({n_prompts} prompt{'s' if n_prompts != 1 else ''})", "",
             f"| configuration | median ratio to {baseline} | geomean | range | end to end "
             f"| per step | median tok/s | acceptance | same output as {baseline} |",
             "|---|---|---|---|---|---|---|---|---|"]
    for s in summaries.values():
        rng = f"{_f(s.lo)}-{_f(s.hi)}" if s.n else ""
        acc = f"{100 * s.acceptance:.1f}%" if s.acceptance is not None else ""
        lines.append(f"| {s.config} | {_f(s.median)} | {_f(s.geomean)} | {rng} | {_f(s.e2e)} | "
                     f"{_f(s.per_step)} | {_f(s.median_tok_s, '{:.1f}')} | {acc} | "
                     f"{s.same}/{s.compared} |")
    return "\n".join(lines)


def render_overview(per_category: dict[str, dict[str, Summary]], configs: list[str]) -> str:
    """One line per configuration, one column per category: the median ratio to plain."""
    cats = list(per_category)
    lines = ["| configuration | " + " | ".join(cats) + " |",
             "|---|" + "---|" * len(cats)]
    for c in configs:
        cells = [_f(per_category[cat][c].median) if c in per_category[cat] else "" for cat in cats]
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report(rows: list[Row], configs: list[str], categories: list[str]) -> str:
    parts, per_cat = [], {}
    for cat in categories:
        cat_rows = [r for r in rows if r.category == cat]
        if not cat_rows:
            continue
        per_cat[cat] = summarize(cat_rows, configs)
        parts.append(render_table(cat, per_cat[cat]))
    if len(per_cat) > 1:
        parts.append("### median ratio to plain, per category\n\n"
                     + render_overview(per_cat, configs))
    return "\n\n".join(parts)


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


# ----------------------------------------------------------------------------- prompts

def load_prompts(path: Path | None, per_category: int | None, categories: list[str] | None,
                 group: bool, coding: int, skip: int = 0) -> list[BenchPrompt]:
    """Spec-Bench's first turns, `per_category` per category after the first `skip` of each
    (a second run on other prompts), then `coding` built-in coding prompts."""
    out: list[BenchPrompt] = []
    if path is not None:
        from tandem.bench import workloads

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
    out += [BenchPrompt(f"code-{i + 1}", "code", t) for i, t in enumerate(CODING_PROMPTS[:coding])]
    return out


def pool(files: list[Path]) -> str:
    """One report over several --out files (runs at different times): each prompt's ratio is
    still taken within its own run."""
    rows: list[Row] = []
    names: list[str] = []
    for i, f in enumerate(files):
        for d in json.loads(Path(f).read_text(encoding="utf-8"))["rows"]:
            r = Row(**d)
            r.prompt_id = f"{i + 1}:{r.prompt_id}"  # a prompt run twice pairs within its run
            rows.append(r)
            if r.config not in names:
                names.append(r.config)
    categories = list(dict.fromkeys(r.category for r in rows))
    return (f"# pooled: {len(files)} runs ({', '.join(str(f) for f in files)})\n\n"
            + report(rows, names, categories))


def messages_for(p: BenchPrompt) -> list[dict]:
    return ([{"role": "system", "content": p.system}] if p.system else []) + [
        {"role": "user", "content": p.text}]


# ----------------------------------------------------------------------------- llama-server

class ServerError(RuntimeError):
    pass


def _die_with_parent() -> None:  # pragma: no cover - runs in the child, Linux only
    """Best effort: the server gets SIGTERM when this script dies, even by SIGKILL."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def post_json(port: int, path: str, body: dict,
              timeout: float = 1800.0) -> tuple[dict, float]:
    """POST `body` to 127.0.0.1:port/path: (the JSON answer, seconds until it was read); any
    failure as a ServerError."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read()), time.perf_counter() - t0
    except urllib.error.HTTPError as exc:
        raise ServerError(f"HTTP {exc.code}: {exc.read().decode(errors='replace')[:500]}") from exc
    except (urllib.error.URLError, OSError) as exc:
        raise ServerError(str(exc)) from exc


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One llama-server process on 127.0.0.1, its log in log_dir/NAME.log."""

    def __init__(self, name: str, binary: Path, model: Path, args: list[str], log_dir: Path):
        self.name, self.binary, self.model, self.args = name, binary, model, args
        self.log_path = log_dir / f"server-{name}.log"
        self.proc: subprocess.Popen | None = None
        self.port = 0

    @property
    def cmd(self) -> list[str]:
        return [str(self.binary), "-m", str(self.model), "--host", "127.0.0.1",
                "--port", str(self.port), *self.args]

    def log_tail(self, n: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def start(self, timeout: float = 600.0) -> None:
        self.port = free_port()
        log = open(self.log_path, "wb")
        try:
            self.proc = subprocess.Popen(
                self.cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
        except OSError as exc:
            raise ServerError(f"cannot start llama-server ({self.binary}): {exc}") from exc
        finally:
            log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rc = self.proc.poll()
            if rc is not None:
                raise ServerError(
                    f"llama-server '{self.name}' exited with code {rc} while starting.\n"
                    f"command: {shlex.join(self.cmd)}\nlast lines of {self.log_path}:\n"
                    f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass  # 503 while loading, or not listening yet
            time.sleep(0.25)
        raise ServerError(f"llama-server '{self.name}' not ready after {timeout:.0f}s; "
                          f"last lines of {self.log_path}:\n{self.log_tail()}")

    def chat(self, messages: list[dict], n: int, seed: int, timeout: float = 900.0) -> dict:
        body = {"messages": messages, "max_tokens": n, "n_predict": n, "temperature": 0.0,
                "seed": seed, "cache_prompt": False, "stream": False}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/chat/completions",
                                     data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:500]
            raise ServerError(f"llama-server '{self.name}': HTTP {exc.code}: {detail}") from exc
        except (urllib.error.URLError, OSError) as exc:
            rc = self.proc.poll() if self.proc else None
            why = f" (it exited with code {rc}; log:\n{self.log_tail()})" if rc is not None else ""
            raise ServerError(f"llama-server '{self.name}': {exc}{why}") from exc

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


def server_row(server: Server, p: BenchPrompt, n: int, seed: int) -> Row:
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

def tandem_command(tandem: list[str], p: BenchPrompt, n: int, threads: int | None, ctx: int,
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


def tandem_row(name: str, cmd: list[str], p: BenchPrompt, env: dict | None = None) -> Row:
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


# ----------------------------------------------------------------------------- main

def save_rows(out: Path, meta: dict, rows: list) -> None:
    """Every row (dataclasses) with the run's meta, as one JSON file: --out of the bench scripts."""
    out.write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1,
                              ensure_ascii=False), encoding="utf-8")
    print(f"rows written to {out}", file=sys.stderr)




def log_folder(path: Path | None, prefix: str) -> Path:
    """--log-dir, made if missing, else a new temporary folder named by the script."""
    if path is None:
        import tempfile

        path = Path(tempfile.mkdtemp(prefix=prefix))
    path.mkdir(parents=True, exist_ok=True)
    return path


def run_rows(servers, body: Callable[[], None], rows: list, out: Path | None,
             meta: dict) -> bool | None:
    """A bench run's frame: start `servers` one after another (only one thing computes at a
    time), run `body` (it appends to `rows`), then stop them and keep the rows (--out) whatever
    happened. False: it ran through; True: Ctrl-C (the rows so far are still reported); None:
    a server failed (said on stderr). SIGTERM counts as Ctrl-C: a run started in the
    background ignores SIGINT, and its rows would otherwise be lost with it."""
    def stop(signum, frame):  # noqa: ARG001 - signal handler signature
        raise KeyboardInterrupt
    main = threading.current_thread() is threading.main_thread()  # where handlers may be set
    previous = signal.signal(signal.SIGTERM, stop) if main else None
    try:
        for s in servers:
            t0 = time.monotonic()
            s.start()
            print(f"{s.name} ready on 127.0.0.1:{s.port} ({time.monotonic() - t0:.1f}s)",
                  file=sys.stderr, flush=True)
        body()
        return False
    except KeyboardInterrupt:
        print("\ninterrupted: stopping the servers; results so far follow", file=sys.stderr)
        return True
    except ServerError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return None
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
        for s in servers:
            s.stop()
        if out is not None:
            save_rows(out, meta, rows)


def exit_status(rows, interrupted: bool) -> int:
    """A bench script's exit code: 130 when interrupted, 1 when a run failed (said on stderr)."""
    errors = [r for r in rows if r.error]
    if errors:
        print(f"\n{len(errors)} run(s) failed; see stderr / --out", file=sys.stderr)
    return 130 if interrupted else (1 if errors else 0)


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
    import signal

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
    servers = [Server(name, server_bin, target, shlex.split(f"{base} {args.format(**fmt)}"),
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
            warm = BenchPrompt("warmup", "warmup", "Say hello.")
            for name in names:
                r = run_config(name, warm, 8)
                if r.error and r.kind == "server":
                    print(f"warning: llama-server '{name}' failed the warm-up: {r.error}",
                          file=sys.stderr)
                elif r.error:
                    raise ServerError(f"tandem '{name}' failed on the warm-up prompt: {r.error}")
        for i, p in enumerate(prompts, 1):
            load = os.getloadavg()[0]
            line = []
            # every other prompt in reverse order: a machine that speeds up or slows down
            # within a prompt then favours no configuration
            done = [run_config(name, p, ns.n_predict) for name in (names if i % 2 else names[::-1])]
            done.sort(key=lambda r: names.index(r.config))  # a prompt counts once all have run it
            rows.extend(done)
            for r in done:
                r.extra["loadavg"] = load
                line.append(f"{r.config} {'ERROR' if r.error else f'{r.tok_s:.1f}'}")
                if r.error:
                    print(f"  {r.config} on {p.id}: {r.error}", file=sys.stderr)
            print(f"[{i}/{len(prompts)}] {p.category} {p.id}: {', '.join(line)} "
                  f"(load {load:.2f})", file=sys.stderr, flush=True)

    interrupted = run_rows(servers, body, rows, ns.out, meta)
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
    return exit_status(rows, interrupted)


if __name__ == "__main__":
    sys.exit(main())
