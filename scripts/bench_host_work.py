#!/usr/bin/env python3
"""Host work per token (issue 52): `tandem serve --parallel 4 --strategy none` against
`llama-server -np 4`, and `tandem run --strategy none` against llama-server alone.

Plain decoding on both sides, so what differs is the work around llama_decode: on the tiny
test models a decode costs well under a millisecond and host work is most of what is
measured; on a model with a large vocabulary (Gemma 3 270M: 262,144 tokens a row) the
per-row work shows at a real step time. Per model, both servers get the same GGUF, threads
and context per slot (llama-server `-np 4 -c 4*C`, tandem `--parallel 4 --ctx-size C`), are
started one at a time (the order reversed every other repetition), warmed up untimed, and
asked greedy streaming chats of --n-predict tokens (default 128):

- `alone`: one request (tok/s: its decode tok/s from the server's own timings, counted
  alike on both sides by tandem.bench.accounting; ms a token: its decode time per step);
- `four`: four requests sent together (threads behind a barrier; tok/s: aggregate = the
  four answers' predicted tokens / first send -> last completion on the client; ms a 4-slot
  step: the median of the four's decode time per step from the server's timings).

Each of those also from the client's clock alone: the streamed text chunks' spacing (first
text chunk -> last, over the chunks between), which holds the HTTP side as well. "beyond"
is tandem's ms minus llama-server's in the same repetition; every figure is the median over
--reps (default 3). Then, unless --no-run, `tandem run --strategy none` (a process per
prompt) against llama-server -np 1 on --run-prompts held-out coding prompts, interleaved
(tandem.bench.peer_runs), the median of the per-prompt tok/s ratios.

Models (-m, repeatable): default the tiny test target (scripts/make_tiny_models.py, made in
a temporary folder) and Gemma 3 270M from the store (`tandem pull gemma3-270m` first; left
out with a warning when it is not there). tandem runs with TANDEM_HISTORY=off.

  .venv/bin/python scripts/bench_host_work.py --out host-work.json     # run it alone
  .venv/bin/python scripts/bench_host_work.py -m model.gguf --reps 1 -n 16 --no-llama
"""
from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench_concurrency import quiet_check, rep_order, start_warm
from bench_peer import default_tandem, log
from bench_serve import TandemServer, chat, llama_server_or_warn, server_options
from tandem.bench.accounting import response_counts
from tandem.bench.llama_server import LlamaServer, ServerError
from tandem.bench.peer_report import Row as PeerRow
from tandem.bench.peer_runs import (
    CODING_PROMPTS,
    exit_status,
    interleaved,
    load_prompts,
    log_folder,
    messages_for,
    run_rows,
    server_row,
    tandem_command,
    tandem_row,
    warm_up,
)

LLAMA, TANDEM = "llama-server", "tandem"
ALONE, FOUR = "alone", "four"
GEMMA = "gemma3-270m"  # the catalog's pair whose target is the default's second model
ALONE_PROMPT = "code-6"  # a prompt none of the four takes: no prompt cache helps it
FOUR_PROMPTS = ("code-1", "code-2", "code-3", "code-4")


@dataclass
class Row:
    """One scenario on one server and model in one repetition. tok_s: alone, the request's
    decode tok/s (server timings); four, the aggregate over the client's wall time. ms: the
    time per decode step from the server's timings (four: the median of the requests');
    client_ms: the streamed text chunks' spacing on the client (four: their median)."""

    model: str
    server: str
    scenario: str
    rep: int  # 0-based
    tok_s: float = 0.0
    ms: float | None = None
    client_ms: float | None = None
    tokens: int = 0
    wall_s: float = 0.0
    requests: list[dict] = field(default_factory=list)
    error: str | None = None


# ----------------------------------------------------------------------------- the work

def one_request(port: int, prompt, n: int, seed: int) -> dict:
    """A greedy streaming chat's figures: its server's decode figures (accounting's count)
    and the spacing of its text chunks on the client."""
    start = time.perf_counter()
    resp, wall, decode_ms = chat(port, messages_for(prompt), n, seed, True)
    counted = response_counts(resp)
    chunks = int(resp.get("chunks") or 0)
    return {"id": prompt.id, "start": start, "end": start + wall, "wall_s": wall,
            "predicted_n": int((resp.get("timings") or {}).get("predicted_n") or 0),
            "tok_s": counted.tokens_per_second if counted else 0.0,
            "step_ms": 1000 * counted.step_s if counted else None,
            "chunks": chunks,
            "client_ms": decode_ms / (chunks - 1) if decode_ms and chunks > 1 else None,
            "text": (resp["choices"][0]["message"]["content"] or "")}


def scenario_alone(model: str, server, rep: int, prompt, n: int, seed: int) -> Row:
    row = Row(model, server.name, ALONE, rep)
    try:
        r = one_request(server.port, prompt, n, seed)
    except ServerError as exc:
        row.error = f"{prompt.id}: {exc}"
        return row
    row.requests = [r]
    row.tok_s, row.ms, row.client_ms = r["tok_s"], r["step_ms"], r["client_ms"]
    row.tokens, row.wall_s = r["predicted_n"], r["wall_s"]
    if not r["step_ms"]:
        row.error = "no timings in the response"
    return row


def scenario_four(model: str, server, rep: int, prompts: list, n: int, seed: int) -> Row:
    row = Row(model, server.name, FOUR, rep)
    barrier = threading.Barrier(len(prompts))
    done: list = [None] * len(prompts)

    def one(i: int) -> None:
        barrier.wait()
        try:
            done[i] = one_request(server.port, prompts[i], n, seed)
        except ServerError as exc:
            done[i] = f"{prompts[i].id}: {exc}"

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(prompts))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    errors = [d for d in done if isinstance(d, str)]
    if errors:
        row.error = errors[0]
        return row
    row.requests = done
    row.wall_s = max(r["end"] for r in done) - min(r["start"] for r in done)
    row.tokens = sum(r["predicted_n"] for r in done)
    row.tok_s = row.tokens / row.wall_s if row.wall_s > 0 else 0.0
    row.ms = _median([r["step_ms"] for r in done if r["step_ms"]])
    row.client_ms = _median([r["client_ms"] for r in done if r["client_ms"]])
    if row.ms is None:
        row.error = "no timings in the responses"
    return row


# ----------------------------------------------------------------------------- the report

def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _f(x: float | None, spec: str) -> str:
    return "-" if x is None else f"{x:{spec}}"


def summary(rows: list, model: str, scenario: str) -> dict:
    """The medians of one model's scenario: each side's tok/s and ms, and per repetition
    tandem over llama-server (tok/s) and tandem minus llama-server (ms), then their median."""
    ok = [r for r in rows if isinstance(r, Row) and not r.error and r.model == model
          and r.scenario == scenario]
    mine = {s: [r for r in ok if r.server == s] for s in (LLAMA, TANDEM)}
    pairs = [(b, t) for t in mine[TANDEM] for b in mine[LLAMA] if b.rep == t.rep]
    out = {"reps": len(mine[TANDEM])}
    for s in (LLAMA, TANDEM):
        out[s] = {"tok_s": _median([r.tok_s for r in mine[s]]),
                  "ms": _median([r.ms for r in mine[s] if r.ms]),
                  "client_ms": _median([r.client_ms for r in mine[s] if r.client_ms])}
    out["ratio"] = _median([t.tok_s / b.tok_s for b, t in pairs if b.tok_s > 0])
    out["beyond_ms"] = _median([t.ms - b.ms for b, t in pairs if t.ms and b.ms])
    out["beyond_client_ms"] = _median([t.client_ms - b.client_ms for b, t in pairs
                                       if t.client_ms and b.client_ms])
    return out


def run_summary(rows: list, model: str) -> dict | None:
    """`tandem run` over llama-server alone on one model: per prompt, then the median."""
    ok = [r for r in rows if isinstance(r, PeerRow) and not r.error
          and r.extra.get("model") == model]
    by = {}
    for r in ok:
        by.setdefault(r.prompt_id, {})[r.kind] = r
    ratios = [d["tandem"].tok_s / d["server"].tok_s for d in by.values()
              if "tandem" in d and "server" in d and d["server"].tok_s > 0]
    if not ok:
        return None
    return {"prompts": len(by), "ratio": _median(ratios),
            "range": (min(ratios), max(ratios)) if ratios else None,
            LLAMA: _median([r.tok_s for r in ok if r.kind == "server"]),
            TANDEM: _median([r.tok_s for r in ok if r.kind == "tandem"])}


def report(rows: list, models: list[str]) -> str:
    out = ["| model | scenario | reps | llama-server tok/s | tandem tok/s | x tok/s "
           "| llama-server ms | tandem ms | beyond ms (server timings) "
           "| llama-server client ms | tandem client ms | beyond ms (client) |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for model in models:
        for scen, label in ((ALONE, "one alone (ms a token)"),
                            (FOUR, "four at once (aggregate; ms a 4-slot step)")):
            s = summary(rows, model, scen)
            if not s["reps"] and not s[LLAMA]["tok_s"]:
                continue
            b, t = s[LLAMA], s[TANDEM]
            out.append(f"| {model} | {label} | {s['reps']} | {_f(b['tok_s'], '.1f')} "
                       f"| {_f(t['tok_s'], '.1f')} | {_f(s['ratio'], '.2f')} "
                       f"| {_f(b['ms'], '.3f')} | {_f(t['ms'], '.3f')} "
                       f"| {_f(s['beyond_ms'], '.3f')} | {_f(b['client_ms'], '.3f')} "
                       f"| {_f(t['client_ms'], '.3f')} | {_f(s['beyond_client_ms'], '.3f')} |")
        r = run_summary(rows, model)
        if r is not None:
            spread = f" ({r['range'][0]:.2f}-{r['range'][1]:.2f})" if r["range"] else ""
            out.append(f"| {model} | tandem run vs llama-server -np 1 ({r['prompts']} prompts) "
                       f"| 1 | {_f(r[LLAMA], '.1f')} | {_f(r[TANDEM], '.1f')} "
                       f"| {_f(r['ratio'], '.2f')}{spread} | | | | | | |")
    return "\n".join(out)


# ----------------------------------------------------------------------------- models

def default_models(work: Path) -> list[Path]:
    """The tiny test target, made in `work`, and Gemma 3 270M where the store has it."""
    from make_tiny_models import make_tiny_models
    from tandem.models.catalog import get_pair
    from tandem.models.store import Store, tandem_home

    models = [make_tiny_models(work)["target"]]
    store, spec = Store(tandem_home()), get_pair(GEMMA).target
    if store.is_present(spec):
        models.append(store.path_for(spec))
    else:
        log(f"warning: {GEMMA} is not in {store.home}: `tandem pull {GEMMA}` first; "
            "the tiny models only")
    return models


def vocab_size(path: Path) -> int | None:
    from tandem.models.gguf_meta import read_gguf_header
    from tandem.models.vocab import VocabInfo

    try:
        return VocabInfo.from_header(read_gguf_header(path, tensors=False)).n_tokens
    except Exception:  # noqa: BLE001 - a label only
        return None


# ----------------------------------------------------------------------------- the run

def build_parser() -> argparse.ArgumentParser:
    doc = __doc__
    ap = argparse.ArgumentParser(description=doc.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(doc.splitlines()[1:]))
    ap.add_argument("-m", "--model", type=Path, action="append",
                    help="a GGUF (repeatable; default: the tiny test target and Gemma 3 270M)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions (default 3)")
    ap.add_argument("-n", "--n-predict", type=int, default=128,
                    help="max tokens of every chat (default 128)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-c", "--ctx", type=int, default=4096,
                    help="context per slot (llama-server: -c slots x it)")
    ap.add_argument("--slots", type=int, default=4,
                    help="tandem serve --parallel N, llama-server -np N (default 4)")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--no-run", action="store_true",
                    help="leave out `tandem run --strategy none` against llama-server alone")
    ap.add_argument("--run-prompts", type=int, default=4,
                    help="held-out coding prompts of the `tandem run` comparison (default 4)")
    server_options(ap)
    ap.add_argument("--llama-args", default="",
                    help="extra llama-server arguments (e.g. \"-ngl 99\" on a GPU; tandem's "
                         "own go in --tandem-args)")
    ap.add_argument("--no-quiet-check", action="store_true",
                    help="skip ../shared/bin/quiet-check before the run")
    ap.add_argument("--log-dir", type=Path, help="server logs (default: a temporary directory)")
    ap.add_argument("--out", type=Path, help="write every row here (JSON)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    if ns.reps < 1 or ns.slots < 1 or ns.n_predict < 2:
        raise SystemExit("Error: --reps and --slots must be at least 1, -n at least 2")
    log_dir = log_folder(ns.log_dir, "bench-host-work-")
    models = ns.model or default_models(Path(tempfile.mkdtemp(prefix="bench-host-work-")))
    tandem = shlex.split(ns.tandem_bin) if ns.tandem_bin else default_tandem()
    server_bin = llama_server_or_warn(ns)
    env = {**os.environ, "TANDEM_HISTORY": "off"}
    prompts = {p.id: p for p in load_prompts(None, None, None, False, len(CODING_PROMPTS))}
    alone, four = prompts[ALONE_PROMPT], [prompts[i] for i in FOUR_PROMPTS]
    run_prompts = list(prompts.values())[:ns.run_prompts]
    label = {m: f"{m.name} ({vocab_size(m) or '?'} tokens)" for m in models}

    def serve_cmd(model: Path) -> list[str]:
        return [*tandem, "serve", "-m", str(model), "--strategy", "none", "--port", "0",
                "-t", str(ns.threads), "--ctx-size", str(ns.ctx), "--parallel", str(ns.slots),
                "--quiet", *shlex.split(ns.tandem_args)]

    def llama_args(slots: int) -> list[str]:
        return ["-t", str(ns.threads), "-c", str(ns.ctx * slots), "-np", str(slots), "--jinja",
                *shlex.split(ns.llama_args)]

    quiet, said = (None, "skipped (--no-quiet-check)") if ns.no_quiet_check else quiet_check()
    if quiet is False:
        log(f"warning: the machine is busy before the run: the figures below are not "
            f"measurements of it\n{said}")
    meta = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "argv": sys.argv,
            "models": [str(m) for m in models], "threads": ns.threads, "ctx_per_slot": ns.ctx,
            "slots": ns.slots, "n_predict": ns.n_predict, "reps": ns.reps,
            "tandem": serve_cmd(Path("MODEL")),
            "llama_server": llama_args(ns.slots) if server_bin else None,
            "quiet_check": {"quiet": quiet, "said": said}, "loadavg_start": os.getloadavg()}
    print(f"# Host work per token: tandem serve --parallel {ns.slots} --strategy none vs "
          f"llama-server -np {ns.slots} (greedy, {ns.n_predict} tokens, {ns.threads} threads, "
          f"context {ns.ctx} per slot, {ns.reps} repetition{'s' if ns.reps > 1 else ''})\n",
          flush=True)
    print(f"- tandem: {shlex.join(serve_cmd(Path('MODEL')))}", flush=True)
    if server_bin is not None:
        print(f"- llama-server: {server_bin} -m MODEL {shlex.join(llama_args(ns.slots))}",
              flush=True)
    print(f"- quiet-check: {said.splitlines()[0] if said else '-'}", flush=True)
    print(f"- logs: {log_dir}\n", flush=True)

    rows: list = []  # Rows of the servers, then peer_report.Rows of `tandem run`

    def serve_rounds(model: Path) -> None:
        name = label[model]
        makers = {TANDEM: lambda d: TandemServer(serve_cmd(model), env, d / "tandem-serve.log")}
        if server_bin is not None:
            makers[LLAMA] = lambda d: LlamaServer(LLAMA, server_bin, model,
                                                  llama_args(ns.slots), d)
        for rep in range(ns.reps):
            for name_s in rep_order(list(makers), rep):
                s = makers[name_s](log_folder(log_dir / model.stem / f"rep{rep + 1}", ""))
                try:
                    start_warm(s, f"[{model.name} rep {rep + 1}/{ns.reps}] {name_s}", ns.seed)
                    for row in (scenario_alone(name, s, rep, alone, ns.n_predict, ns.seed),
                                scenario_four(name, s, rep, four[:ns.slots], ns.n_predict,
                                              ns.seed)):
                        rows.append(row)
                        log(f"  {name_s} {row.scenario}: " + (
                            f"ERROR {row.error}" if row.error else
                            f"{row.tok_s:.1f} tok/s, {_f(row.ms, '.3f')} ms (server), "
                            f"{_f(row.client_ms, '.3f')} ms (client), {row.tokens} tokens"))
                finally:
                    s.stop()

    def run_rounds(model: Path) -> None:
        """`tandem run --strategy none` against llama-server -np 1, prompt by prompt."""
        server = LlamaServer(LLAMA, server_bin, model, llama_args(1),
                             log_folder(log_dir / model.stem, ""))

        def run_config(which: str, p, n: int):
            if which == LLAMA:
                row = server_row(server, p, n, ns.seed)
            else:
                row = tandem_row(TANDEM, tandem_command(
                    tandem, p, n, ns.threads, ns.ctx, ns.seed, ["-m", str(model)],
                    ["--strategy", "none"]), p, env)
            row.extra["model"] = label[model]
            return row

        server.start()
        try:
            log(f"[{model.name} run] llama-server -np 1 ready on 127.0.0.1:{server.port}")
            warm_up([LLAMA, TANDEM], run_config, log)
            for done in interleaved(run_prompts, [LLAMA, TANDEM], run_config, ns.n_predict,
                                    log, f"{model.name} run "):
                rows.extend(done)
        finally:
            server.stop()

    def body() -> None:
        for model in models:
            serve_rounds(model)
            if server_bin is not None and not ns.no_run:
                run_rounds(model)

    interrupted = run_rows([], body, rows, ns.out, meta, log)
    if interrupted is None:
        return 1
    if rows:
        print(report(rows, [label[m] for m in models]))
        print("\ntok/s: one alone, the request's decode tok/s (each server's own timings, "
              "counted alike: tandem.bench.accounting); four at once, the aggregate = the "
              "answers' tokens / first send -> last completion (client's clock). ms: decode "
              "time per step from the server's timings (four: the median of the four "
              "requests', each step holding every slot's token). client ms: the streamed text "
              "chunks' spacing on the client (first -> last text chunk over the chunks "
              "between; four: the median), HTTP included. beyond: tandem's minus "
              "llama-server's in the same repetition. x tok/s: tandem over llama-server per "
              "repetition (tandem run: per prompt, its range in brackets). Medians over the "
              "repetitions.")
    return exit_status(rows, interrupted, log)


if __name__ == "__main__":
    sys.exit(main())
