#!/usr/bin/env python3
"""tandem's host overhead per token, and its tokens/s against llama.cpp's native tools.

On the tiny synthetic pair a llama_decode costs well under a millisecond, so whatever the
Python loop does per token shows. For plain (`none`), draft-model and n-gram decoding this
measures (a) the host overhead: decode-phase wall time minus the time spent inside llama.cpp's
calls (Context.time_llama), per generated token, and (b) tokens/s against native tools with
the same settings (threads, greedy, n_predict, n_max / p_min, context, flash attention, no
weight repacking), interleaved run by run, median over --reps:

- plain: `llama-completion -t N` (llama-simple has no thread option: it runs 4 threads,
  which on a 2-core machine measures contention, not the loop). Its decode time is its loop's
  wall time from the log's timestamps, less the prompt's evaluation; the eval plus sampling
  time it reports is shown too, a stricter bar that leaves out its loop and printing.
  `llama-bench` tg is shown too: bare decodes, no sampling, from an empty context.
- draft model: `llama-speculative-simple --spec-type draft-simple`, its "decoded N tokens in
  S seconds" (the decode loop's wall time, draft's prompt outside, as tandem's).
- `auto` (draft model plus the suffix index of prompt and output, with its controllers) has
  no native counterpart: its row shows what its per-step bookkeeping costs.

  .venv/bin/python scripts/bench_host.py                     # tiny models, made on the fly
  .venv/bin/python scripts/bench_host.py --reps 7 -n 512 --json host.json
  .venv/bin/python scripts/bench_host.py --pool round-*.json   # rounds taken at other times
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from native_tools import native_bin

PROMPT = "Hello world, this is a test of the tiny model. The quick brown fox jumps over"




def _run(cmd: list[str], expect: str) -> str:
    """The tool's log (stderr), run again while it lacks `expect`: this llama.cpp's logger
    sometimes drops every line after some point (after "loading draft model" or "generate:",
    in the log file too) in a run that otherwise completes with status 0: here 1 to 6 runs in
    30, up to 3 in a row on a loaded machine."""
    for attempt in range(1, 7):
        # the generated text goes to stdout, and random weights write bytes that are not UTF-8
        res = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=600)
        if res.returncode != 0:
            raise RuntimeError(f"{Path(cmd[0]).name} failed ({res.returncode}):\n"
                               f"{res.stderr[-2000:]}")
        if expect in res.stderr:
            return res.stderr
        print(f"{Path(cmd[0]).name}: log cut short (attempt {attempt}), running it again",
              file=sys.stderr)
    raise RuntimeError(f"{Path(cmd[0]).name} printed no {expect!r}:\n{res.stderr[-2000:]}")


def _common(ns) -> list[str]:
    gpu = ["-ngl", str(ns.ngl)] if ns.ngl else []  # on a CPU build -ngl only adds warnings
    return ["-t", str(ns.threads), "-c", str(ns.ctx), "--temp", "0", "-s", "1",
            "--no-repack", "-fa", "on", *gpu]


def _stamp(err: str, marker: str) -> float:
    """Seconds of the log timestamp (minutes.seconds.ms.us) on the first line with marker."""
    m = re.search(r"^(\d+)\.(\d+)\.(\d+)\.(\d+) \w " + re.escape(marker), err, re.M)
    if not m:
        raise RuntimeError(f"no log line with {marker!r}:\n{err[-2000:]}")
    mins, secs, ms, us = (int(g) for g in m.groups())
    return 60 * mins + secs + ms / 1e3 + us / 1e6


def native_plain(bin_dir: Path, ns) -> dict:
    """llama-completion's tokens/s: over its decode loop's wall time (from the log's timestamps,
    the prompt's evaluation taken out), and over its eval + sampling time alone."""
    err = _run([str(bin_dir / "llama-completion"), "-m", str(ns.target), "-p", ns.prompt,
                "-n", str(ns.n), "-no-cnv", "--ignore-eos", *_common(ns)], "common_perf_print")
    ev = re.search(r"\beval time =\s+([\d.]+) ms /\s+(\d+) runs", err)
    sm = re.search(r"sampling time =\s+([\d.]+) ms", err)
    pe = re.search(r"prompt eval time =\s+([\d.]+) ms", err)
    if not ev or not sm or not pe:
        raise RuntimeError(f"llama-completion printed no timings:\n{err[-2000:]}")
    n = int(ev.group(2))
    loop = _stamp(err, "common_perf_print") - _stamp(err, "generate:") - float(pe.group(1)) / 1e3
    return {"tok_s": n / loop, "tok_s_eval": n / ((float(ev.group(1)) + float(sm.group(1))) / 1e3),
            "eval_us": 1e3 * float(ev.group(1)) / n, "sampling_us": 1e3 * float(sm.group(1)) / n}


def native_draft(bin_dir: Path, ns) -> dict:
    """llama-speculative-simple's tokens/s and acceptance rate."""
    gpu = ["-ngld", str(ns.ngl)] if ns.ngl else []
    err = _run([str(bin_dir / "llama-speculative-simple"), "-m", str(ns.target),
                "-md", str(ns.draft), "-p", ns.prompt, "-n", str(ns.n),
                "--spec-type", "draft-simple", "--spec-draft-n-max", str(ns.n_max),
                "--spec-draft-p-min", str(ns.p_min), "-td", str(ns.threads), *gpu,
                *_common(ns)], "common_perf_print")
    m = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", err)
    acc = re.search(r"accept\s+=\s+([\d.]+)%", err)
    if not m:
        raise RuntimeError(f"llama-speculative-simple printed no speed:\n{err[-2000:]}")
    return {"tok_s": int(m.group(1)) / float(m.group(2)),
            "accept": float(acc.group(1)) / 100 if acc else float("nan")}


def native_bench(bin_dir: Path, ns) -> dict:
    """llama-bench tg: bare single-token decodes, no sampling (the kernels' floor)."""
    res = subprocess.run([str(bin_dir / "llama-bench"), "-m", str(ns.target), "-p", "0",
                          "-n", str(ns.n), "-t", str(ns.threads), "-r", "1", "--repack", "0",
                          "-fa", "1", "-ngl", str(ns.ngl), "-o", "json"],
                         capture_output=True, text=True, timeout=600, check=True)
    return {"tok_s": float(json.loads(res.stdout)[-1]["avg_ts"])}


def row_costs(n_vocab: int, reps: int = 200) -> dict:
    """Host microseconds per logits row at a real vocabulary (the tiny models' is 260): the
    greedy choice of every verified row and the draft model's top-k stop test (p_min)."""
    import numpy as np

    from tandem.engine.loop.sampling import SamplingParams, draft_top, greedy_token

    rows = np.random.default_rng(0).standard_normal((8, n_vocab)).astype(np.float32)
    sp = SamplingParams()
    out = {}
    for name, fn in (("greedy_token", greedy_token), ("draft_top", draft_top)):
        best = float("inf")
        for _ in range(5):  # the least disturbed of five passes
            t0 = time.perf_counter()
            for i in range(reps):
                fn(rows[i % 8], [], sp)
            best = min(best, (time.perf_counter() - t0) / reps)
        out[name] = 1e6 * best
    return out


class Tandem:
    """The engine with the pair loaded once; every run starts from empty KV caches, as a
    native process does."""

    def __init__(self, ns):
        from tandem.engine.backend.llama import Context, ContextParams, Model

        params = ContextParams(n_ctx=ns.ctx, n_threads=ns.threads, flash_attn="on")
        self.target = Model(ns.target, n_gpu_layers=ns.ngl, repack=False)
        self.draft = Model(ns.draft, n_gpu_layers=ns.ngl, repack=False)
        self.tctx, self.dctx = Context(self.target, params), Context(self.draft, params)
        for ctx in (self.tctx, self.dctx):
            ctx.time_llama()
        self.prompt = self.target.tokenize(ns.prompt, add_special=True, parse_special=True)
        self.ns = ns

    def run(self, strategy: str) -> dict:
        from tandem.engine.drafting.drafters import DraftParams, NgramDrafter, NoDrafter
        from tandem.engine.loop.events import DoneEvent, PrefillEvent
        from tandem.engine.loop.speculative import GenParams, generate

        ns = self.ns
        # each drafter owns its draft length; generate() only bounds a step by the room left
        drafter = {"none": NoDrafter, "ngram": lambda: NgramDrafter(DraftParams(n_max=ns.n_max)),
                   "draft": self._model, "auto": self._auto}[strategy]()
        params = GenParams(max_tokens=ns.n, ignore_eos=True)
        self.tctx.truncate(0)
        self.dctx.truncate(0)
        clock = time.perf_counter
        t0 = llama0 = None
        for ev in generate(self.tctx, self.prompt, drafter, params):
            # the decode phase starts when the prompt is read: the last PrefillEvent (after
            # the target's chunks, once the drafter has read the prompt too)
            if isinstance(ev, PrefillEvent) and ev.done == ev.total:
                llama0, perf0, t0 = self._llama(), self.tctx.perf(), clock()
            elif isinstance(ev, DoneEvent):
                wall, llama, perf1 = clock() - t0, self._llama() - llama0, self.tctx.perf()
                stats = ev.stats
        n = stats.n_generated
        # llama.cpp's own account of its single-token decodes (what llama-completion's "eval
        # time" reports): less than the calls' wall time, the rest being work it does not count
        evals = perf1["n_eval"] - perf0["n_eval"]
        eval_us = 1e3 * (perf1["t_eval_ms"] - perf0["t_eval_ms"]) / evals if evals else None
        return {"tokens": n, "tok_s": n / wall, "host_us": 1e6 * (wall - llama) / n,
                "eval_us": eval_us,
                "llama_us": 1e6 * llama / n, "accept": stats.acceptance_rate}

    def _auto(self):
        """`auto` with the draft model and the suffix index of prompt and output, its
        controllers and guard, on GPU-like costs (a verify batch as cheap as a step, a draft
        token a twentieth of one) so that it drafts and its per-step work shows."""
        from tandem.engine.drafting.auto import AutoDrafter
        from tandem.engine.drafting.drafters import DraftParams
        from tandem.engine.tuning.costs import MAX_BATCH, CostModel

        costs = CostModel({n: 1e-3 * (1 + 0.01 * n) for n in (1, 2, 4, 8, 17)}, 5e-5)
        return AutoDrafter(self._model(), DraftParams(n_max=self.ns.n_max), costs,
                           verify_limit=MAX_BATCH, calibrated=None, notes=(), library=None,
                           knowledge=None)

    def _model(self):
        from tandem.engine.drafting.drafters import DraftModelDrafter, DraftParams

        return DraftModelDrafter(self.dctx, DraftParams(self.ns.n_max, 0, self.ns.p_min))

    def _llama(self) -> float:
        return self.tctx.t_llama + self.dctx.t_llama

    def close(self) -> None:
        for obj in (self.tctx, self.dctx, self.target, self.draft):
            obj.close()


def report(runs: dict[str, list], rows: list[dict], title: str) -> None:
    """The tables on stdout: medians over the runs, tandem/native ratios paired run by run."""
    def med(name, key="tok_s"):
        return statistics.median(r[key] for r in runs[name])

    def ratio(name, native, key="tok_s"):
        return statistics.median(a["tok_s"] / b[key] for a, b in zip(runs[name], runs[native]))

    print(f"# {title}\n")
    print("| strategy | tandem tok/s | host us/token | llama.cpp us/token | accept | "
          "native | native tok/s | tandem/native |")
    print("|---|---|---|---|---|---|---|---|")
    natives = {"none": [("llama-completion (loop wall)", "completion", "tok_s"),
                        ("llama-completion (eval + sampling only)", "completion", "tok_s_eval"),
                        ("llama-bench tg (bare decodes)", "bench", "tok_s")],
               "draft": [("llama-speculative-simple", "spec-simple", "tok_s")],
               "ngram": [("", None, None)], "auto": [("", None, None)]}
    for s in [s for s in ("none", "draft", "ngram", "auto") if runs.get(s)]:  # older --json: no auto
        head = (f"| {s} | {med(s):.0f} | {med(s, 'host_us'):.1f} | {med(s, 'llama_us'):.1f} | "
                f"{100 * med(s, 'accept'):.1f}% |")
        for tool, name, key in natives[s]:
            tail = f" {tool} | {med(name, key):.0f} | {ratio(s, name, key):.3f} |" if name \
                else " | | |"
            print(head + tail)
            head = "| | | | | |"
    print(f"\nnative draft acceptance {100 * med('spec-simple', 'accept'):.1f}%; plain: llama.cpp "
          f"counts {med('none', 'eval_us'):.1f} us/token of eval time inside tandem's "
          f"{med('none', 'llama_us'):.1f} us of llama.cpp calls; llama-completion: eval "
          f"{med('completion', 'eval_us'):.1f} us, sampling {med('completion', 'sampling_us'):.1f} "
          "us/token")
    for key in ("greedy_token", "draft_top"):
        vals = [r[key] for r in rows if r]
        if vals:
            print(f"host cost of one logits row at {rows[0]['vocab']} tokens, {key}: "
                  f"{statistics.median(vals):.1f} us")


def pool(files: list[Path]) -> int:
    """One report over the runs of several --json files (rounds taken at different times)."""
    runs: dict[str, list] = {}
    rows = []
    for f in files:
        data = json.loads(f.read_text())
        for name, vals in data["runs"].items():
            runs.setdefault(name, []).extend(vals)
        rows.append(data.get("row_costs_us"))
    report(runs, rows, f"pooled: {len(files)} files, {len(runs['none'])} runs each "
                       f"({data['settings']['n']} tokens, n_max {data['settings']['n_max']})")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", type=Path, help="target GGUF (default: the tiny synthetic one)")
    ap.add_argument("--draft", type=Path, help="draft GGUF (default: the tiny synthetic one)")
    ap.add_argument("-n", type=int, default=512, help="tokens to generate")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--n-max", type=int, default=4)
    ap.add_argument("--p-min", type=float, default=0.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--ngl", type=int, default=0, help="layers on the GPU, both models (99: all)")
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--row-vocab", type=int, default=151936,
                    help="vocabulary of the per-row cost line (Qwen2.5's by default)")
    ap.add_argument("--json", type=Path, help="also write the per-run figures here")
    ap.add_argument("--pool", type=Path, nargs="+", metavar="JSON",
                    help="measure nothing: one report over these --json files' runs")
    ns = ap.parse_args()
    if ns.pool:
        return pool(ns.pool)

    tmp = None
    if ns.target is None or ns.draft is None:
        from make_tiny_models import make_tiny_models

        tmp = tempfile.TemporaryDirectory(prefix="bench-host-")
        models = make_tiny_models(Path(tmp.name))
        ns.target, ns.draft = ns.target or models["target"], ns.draft or models["draft"]
    bin_dir = native_bin()
    tandem = Tandem(ns)
    for strategy in ("none", "draft", "ngram", "auto"):  # warm-up: page weights and code in
        tandem.run(strategy)
    runs: dict[str, list] = {k: [] for k in ("none", "draft", "ngram", "auto", "completion",
                                             "spec-simple", "bench")}
    for rep in range(ns.reps):
        jobs = [("none", lambda: tandem.run("none")),
                ("completion", lambda: native_plain(bin_dir, ns)),
                ("draft", lambda: tandem.run("draft")),
                ("spec-simple", lambda: native_draft(bin_dir, ns)),
                ("ngram", lambda: tandem.run("ngram")),
                ("auto", lambda: tandem.run("auto")),
                ("bench", lambda: native_bench(bin_dir, ns))]
        for name, job in (jobs if rep % 2 == 0 else jobs[::-1]):  # who goes first alternates
            runs[name].append(job())
        print(f"rep {rep + 1}/{ns.reps} done", file=sys.stderr)

    rc = {"vocab": ns.row_vocab, **row_costs(ns.row_vocab)}
    report(runs, [rc], f"tandem host overhead and tokens/s vs native ({ns.target.name} + "
           f"{ns.draft.name}, greedy, {ns.n} tokens, {ns.threads} thread(s), n_max {ns.n_max}, "
           f"p_min {ns.p_min}, ctx {ns.ctx}, median of {ns.reps})")
    if ns.json:
        ns.json.write_text(json.dumps({"settings": {k: str(v) for k, v in vars(ns).items()},
                                       "runs": runs, "row_costs_us": rc}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
