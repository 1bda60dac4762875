#!/usr/bin/env python3
"""What tandem needs to know about a machine's kernels, measured on synthetic models, in one JSON.

scripts/gpu_check.sh builds llama.cpp (CUDA, or the cached CPU build) and runs this; it also
runs alone wherever tandem's engine imports:

  python scripts/gpu_check.py --shapes tiny --bin-dir BIN --out /tmp/gc.json        # CPU
  python scripts/gpu_check.py --shapes 0.5b,1.5b,7b --bin-dir BIN --ngl 99 --out gc.json

Sections (SECTIONS, in order; each saved as it finishes). Per shape (scripts/synthetic_gguf.py:
Qwen2.5's dimensions, random weights, Q4_K_M): `shapes`: what `tandem hw costs` measures
(tandem.bench.hw_costs: plain decode ms/token, the verify-batch cost curve for k = 1..17 tokens
with logits on every row, the host's argmax and draft_top cost on one row), and this
checkout's extras: llama-bench's tg figure, and whether verify batches are bit-identical to
single-token decoding up to which k, in tandem's exact-mode context and with llama.cpp's
defaults (scripts/batch_invariance.py); `seq_batch`: one decode of 1, 2, 4, 8 sequences' rows
(1, or 1 + n_max each) against one sequence's token (tandem.bench.hw_costs too). For the pair
(largest shape as target, smallest as draft): `offload`: where each model's layers went
against `tandem hw`'s plan; `pair`: tandem's loop against llama-completion and llama-speculative-simple with the
same settings; `serve_host`: host work per token in `tandem serve` against llama-server
(scripts/bench_host_work.py, the target alone and four at once). Acceptance between random
models means nothing; costs are what this measures.

Results go to --out after every section (a run cut short keeps what it measured), a summary
to stdout, progress to stderr. A section that erred makes the exit status 1, and is named on
stderr with its error's first line. `tandem spec-bench --predict-costs FILE` prices
acceptance measured elsewhere with these costs, as it prices a `tandem hw costs` file.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

from tandem.bench import hw_costs as costs
from tandem.engine.backend.context_params import ContextParams

ROOT = Path(__file__).resolve().parents[1]
# tandem's exact-mode target context (settings.exact_context): flash attention, q8_0 KV cache
EXACT = {"flash_attn": "on", "type_k": "q8_0", "type_v": "q8_0", "exact": True}


def log(msg: str) -> None:
    print(f"gpu_check: {msg}", file=sys.stderr, flush=True)


def parse_ks(text: str) -> list[int]:
    """'1-17' or '1,2,4,8'."""
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return sorted(set(out))


def cost_plan(ns) -> costs.CostPlan:
    """How the package's measurement (tandem.bench.hw_costs) runs here: the flags' offload,
    threads, batch sizes and repetitions; llama.cpp's default context otherwise."""
    return costs.CostPlan(gpu_layers=ns.ngl, ctx=ContextParams(n_threads=ns.threads),
                          ks=tuple(ns.ks), reps=ns.reps, n_decode=ns.n_decode, drafted=ns.n_max)


def measure_shape(path: Path, ns) -> dict:
    """One model's costs as `tandem hw costs` measures them, and this checkout's extras:
    whether verify batches are bit-identical to single-token decoding (exact-mode context and
    llama.cpp's defaults; scripts/batch_invariance.py), and llama-bench's tg figure."""
    from batch_invariance import compare
    from tandem.engine.backend import llama

    plan = cost_plan(ns)
    model, where = costs.load_model(path, plan)
    try:
        out = {**costs.measure_shape(model, plan), "placement": where, "exactness": {}}
        need = max(ns.contexts) + max(ns.ks) + 8
        tokens = costs.probe_tokens(model, need)
        params = replace(plan.ctx, n_ctx=need)
        for mode, extra in (("exact", EXACT), ("fast", {"flash_attn": "auto"})):
            ctx = llama.Context(model, replace(params, **extra))
            try:
                rows = compare(ctx, tokens, ns.contexts, ns.ks)
                notes = list(ctx.notes)
                used = {k: getattr(ctx.params, k) for k in ("flash_attn", "type_k", "type_v")}
            finally:
                ctx.close()
            diff = {str(k): max(r["max_abs_diff"] for r in rows if r["k"] == k) for k in ns.ks}
            same = {k: d == 0.0 for k, d in diff.items()}
            up_to = 0
            for k in ns.ks:  # the largest k below which every batch size was identical
                if not same[str(k)]:
                    break
                up_to = k
            out["exactness"][mode] = {"identical": same, "max_abs_diff": diff,
                                      "exact_up_to": up_to, "contexts": ns.contexts,
                                      "context": used, "notes": notes}
    finally:
        model.close()
    if ns.bin_dir is not None:
        out["native_tg_ms"] = native_tg_ms(path, ns)
    return out


def measure_seq_batch(path: Path, ns) -> dict:
    """One decode of several sequences against one sequence's token (tandem.bench.hw_costs)."""
    plan = cost_plan(ns)
    model, _ = costs.load_model(path, plan)
    try:
        return costs.measure_seq_batch(model, plan)
    finally:
        model.close()


def native_tg_ms(path: Path, ns) -> float:
    res = subprocess.run([str(ns.bin_dir / "llama-bench"), "-m", str(path), "-p", "0",
                          "-n", str(ns.n_decode), "-r", "2", "-ngl", str(ns.ngl), "-fa", "1",
                          "--repack", "0", *(["-t", str(ns.threads)] if ns.threads else []),
                          "-o", "json"], capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        raise RuntimeError(f"llama-bench failed:\n{res.stderr[-1500:]}")
    return round(1e3 / float(json.loads(res.stdout)[-1]["avg_ts"]), 4)


def planned(target: Path, draft: Path) -> dict:
    """`tandem hw`'s plan for the pair on this machine (its profile decides the offload)."""
    res = subprocess.run([sys.executable, "-m", "tandem", "hw", "-m", str(target),
                          "-md", str(draft), "--json"], capture_output=True, text=True,
                         timeout=300)
    if res.returncode != 0:  # the traceback's last line first: the one a summary shows
        last = (res.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"tandem hw failed: {last}\n{res.stderr[-1500:]}")
    data = json.loads(res.stdout)
    return {"profile": (data.get("profile") or {}).get("name"), "plan": data["plan"]}


def check_offload(target: Path, draft: Path) -> dict:
    """Load each model as planned and compare where llama.cpp put its layers with the plan."""
    from tandem.engine.backend import llama

    plan = planned(target, draft)
    out = {"profile": plan["profile"], "status": plan["plan"].get("status"), "models": {}}
    ok = True
    for role, path in (("target", target), ("draft", draft)):
        want = plan["plan"][role]
        lines = llama.capture_log()
        model = llama.Model(path, n_gpu_layers=int(want["gpu_layers"]))
        llama.capture_log(False)
        got = costs.placement(lines)
        total = model.n_layer + 1  # llama.cpp counts the output layer as one more
        model.close()
        expect_gpu = min(max(int(want["gpu_layers"]), 0), total)
        on_gpu = sum(n for dev, n in got["layers_by_device"].items() if dev != "CPU")
        match = on_gpu == expect_gpu and sum(got["layers_by_device"].values()) in (0, total)
        ok = ok and match
        out["models"][role] = {"planned_gpu_layers": want["gpu_layers"],
                               "planned_buffers": want.get("buffers"),
                               "layers_on_gpu": on_gpu, "layers": total, "placement": got,
                               "as_planned": match}
    out["as_planned"] = ok
    return out


def measure_pair(target: Path, draft: Path, ns) -> dict:
    """tandem's loop against the native tools, interleaved, as scripts/bench_host.py does."""
    import bench_host

    bns = SimpleNamespace(target=target, draft=draft, n=ns.n_gen, n_max=ns.n_max, p_min=0.0,
                          threads=ns.threads or os.cpu_count(), ctx=2048, ngl=ns.ngl,
                          prompt=bench_host.PROMPT)
    runner = bench_host.Tandem(bns)
    runs: dict[str, list] = {k: [] for k in ("none", "draft", "completion", "spec-simple")}
    errors: list[str] = []
    try:
        runner.run("none")  # warm-up
        for rep in range(ns.pair_reps):
            jobs = [("none", lambda: runner.run("none")), ("draft", lambda: runner.run("draft"))]
            if ns.bin_dir is not None:
                jobs += [("completion", lambda: bench_host.native_plain(ns.bin_dir, bns)),
                         ("spec-simple", lambda: bench_host.native_draft(ns.bin_dir, bns))]
            for name, job in (jobs if rep % 2 == 0 else jobs[::-1]):
                try:
                    runs[name].append(job())
                except RuntimeError as exc:  # a native tool's failure: keep tandem's figures
                    errors.append(f"{name}: {str(exc)[:300]}")
    finally:
        runner.close()

    def med(name, key="tok_s"):
        return round(statistics.median(r[key] for r in runs[name]), 3) if runs[name] else None

    out = {"target": target.name, "draft": draft.name, "n_gen": ns.n_gen, "n_max": ns.n_max,
           "p_min": 0.0, "threads": bns.threads, "ngl": ns.ngl, "reps": ns.pair_reps}
    for name, native in (("none", "completion"), ("draft", "spec-simple")):
        tps, nat = med(name), med(native)
        out[name] = {"tandem_tok_s": tps, "host_us_per_token": med(name, "host_us"),
                     "llama_us_per_token": med(name, "llama_us"),
                     "tandem_accept": med(name, "accept"), "native_tok_s": nat,
                     "ratio": round(tps / nat, 3) if nat else None}
    if runs["spec-simple"]:
        out["draft"]["native_accept"] = med("spec-simple", "accept")
    out["native_errors"] = errors
    return out


def measure_serve_host(target: Path, ns) -> dict:
    """Host work per token in `tandem serve` against llama-server on this device, the
    target's layers offloaded on both sides (scripts/bench_host_work.py: --strategy none, one
    request alone and four at once, the medians of their ms a token / a 4-slot step)."""
    import bench_host_work

    if ns.bin_dir is None or not (ns.bin_dir / "llama-server").exists():
        return {"skipped": "no llama-server in --bin-dir"}
    out = ns.out.with_name(ns.out.stem + "_serve_host.json")
    ngl = [] if ns.ngl is None else ["-ngl", str(ns.ngl)]
    bench_host_work.main(["-m", str(target), "--server-bin", str(ns.bin_dir / "llama-server"),
                          "--reps", str(ns.pair_reps), "--no-run", "--no-quiet-check",
                          "-t", str(ns.threads or os.cpu_count()), "-c", "2048",
                          "--tandem-args=" + " ".join(ngl), "--llama-args=" + " ".join(ngl),
                          "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    result: dict = {"target": target.name, "ngl": ns.ngl, "reps": ns.pair_reps}
    for scenario in ("alone", "four"):
        ms = {server: [r["ms"] for r in rows if r.get("scenario") == scenario
                       and r.get("server") == server and r.get("ms") is not None
                       and not r.get("error")]
              for server in ("tandem", "llama-server")}
        med = {k: round(statistics.median(v), 4) if v else None for k, v in ms.items()}
        result[scenario] = {"tandem_ms": med["tandem"], "llama_ms": med["llama-server"],
                            "beyond_ms": round(med["tandem"] - med["llama-server"], 4)
                            if None not in med.values() else None}
    return result


def serve_host_line(_: str, h: dict) -> str:
    return (f"  serve host work: beyond llama-server {h['alone']['beyond_ms']} ms a token "
            f"alone, {h['four']['beyond_ms']} ms a 4-slot step")


def shape_line(name: str, s: dict) -> str:
    """The package's summary of a shape, with llama-bench's figure and the exactness."""
    ex = s["exactness"]
    native = f"; llama-bench {s['native_tg_ms']:.3f} ms/token" if s.get("native_tg_ms") else ""
    return (f"  {costs.shape_summary(name, s)}{native}; bit-identical up to "
            f"k={ex['exact']['exact_up_to']} (exact mode), k={ex['fast']['exact_up_to']} (fast)")


def offload_line(_: str, off: dict) -> str:
    return (f"  offload ({off['profile']}): " + ", ".join(
        f"{role} {m['layers_on_gpu']}/{m['layers']} layers on GPU (planned "
        f"{m['planned_gpu_layers']})" for role, m in off["models"].items())
        + (" - as planned" if off["as_planned"] else " - NOT as planned"))


def pair_line(_: str, pair: dict) -> str:
    lines = []
    for name in ("none", "draft"):
        p = pair[name]
        ratio = f", {p['ratio']:.3f}x native" if p["ratio"] else ""
        lines.append(f"  pair {name}: tandem {p['tandem_tok_s']:.1f} tok/s{ratio}, host "
                     f"{p['host_us_per_token']:.1f} us/token")
    return "\n".join(lines)


@dataclass(frozen=True)
class Section:
    """One key of the result, measured and saved on its own, so that a run cut short keeps
    what finished. per "shape": one entry per shape, result[name][shape], measure(ns, path);
    per "pair": one entry, result[name], measure(ns, target, draft); per "once": one entry,
    result[name], measure(ns) (a synthetic model of its own)."""
    name: str
    per: str
    measure: Callable[..., dict]
    line: Callable[[str, dict], str]  # the summary of a measured entry


def measure_mtp(ns) -> dict:
    """The synthetic MTP model's head against its body on this device (scripts/mtp_costs.py:
    a head step, verify batches with the heads following, acceptance per position) and the
    speedups they predict; and greedy `--strategy mtp` output equal to plain decoding."""
    import mtp_costs
    from tiny_mtp_models import make_mtp_models

    ns.models_dir.mkdir(parents=True, exist_ok=True)
    path = make_mtp_models(ns.models_dir)["mtp"]
    measured = mtp_costs.measure(path, max(ns.reps, 20), ns.ngl, ns.threads or 1)
    return {"measured": measured, "predicted": mtp_costs.predict(measured),
            "greedy_equal": mtp_costs.greedy_equal(path, ns.ngl, ns.threads or 1)}


def mtp_line(_: str, m: dict) -> str:
    p = m["predicted"]
    through = ", ".join(f"{a:.2f}" for a in p["accepted_through"])
    return (f"  mtp: head step {p['head_over_t1']:.2f} t1, heads reading a 5-row batch "
            f"{p['mirror_over_t1'][5]:.2f} t1, accepted through 1-4: {through}, greedy = "
            f"plain: {m['greedy_equal']}")


# In the order they run ("once": one entry, no model from the shapes). Pending, once its
# synthetic model exists (docs/benchmarks.md, section 9): a hybrid model's rollback.
SECTIONS = (
    Section("shapes", "shape", lambda ns, path: measure_shape(path, ns), shape_line),
    Section("seq_batch", "shape", lambda ns, path: measure_seq_batch(path, ns),
            lambda name, s: "  seq_batch " + costs.seq_batch_summary(name, s)),
    Section("offload", "pair", lambda ns, target, draft: check_offload(target, draft),
            offload_line),
    Section("pair", "pair", lambda ns, target, draft: measure_pair(target, draft, ns), pair_line),
    Section("serve_host", "pair", lambda ns, target, draft: measure_serve_host(target, ns),
            serve_host_line),
    Section("mtp", "once", lambda ns: measure_mtp(ns), mtp_line),
)


def entries(result: dict, section: Section) -> list[tuple[str, dict]]:
    data = result.get(section.name)
    if section.per == "shape":
        return list((data or {}).items())
    return [("", data)] if data is not None else []


def first_error(entry: dict) -> str | None:
    """An entry's error (a native tool's failure in the pair loop counts), its first line."""
    errors = [entry["error"]] if "error" in entry else list(entry.get("native_errors") or [])
    return (str(errors[0]).strip().splitlines() or [""])[0] if errors else None


def failures(result: dict) -> list[str]:
    """'section (shape): first error line' for every entry that erred."""
    out = []
    for section in SECTIONS:
        for key, entry in entries(result, section):
            err = first_error(entry)
            if err is not None:
                out.append(f"{section.name}{f' ({key})' if key else ''}: {err}")
    return out


def summary(result: dict) -> str:
    lines = [f"gpu_check ({result['backend']}): {', '.join(result['environment']['gpus']) or 'CPU'}"]
    for section in SECTIONS:
        for key, entry in entries(result, section):
            where = f"{section.name} {key}".strip()
            if "error" in entry:
                lines.append(f"  {where}: error: {first_error(entry)}")
            elif "skipped" in entry:
                lines.append(f"  {where}: skipped ({entry['skipped']})")
            else:
                lines.append(section.line(key, entry))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from synthetic_gguf import make, parse_shapes

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="0.5b,1.5b,7b",
                    help="synthetic shapes to make and measure (tiny: two small ones)")
    ap.add_argument("--model", action="append", default=[], metavar="NAME=PATH",
                    help="measure this GGUF as shape NAME instead of making one (repeatable)")
    ap.add_argument("--models-dir", type=Path, default=ROOT / ".gpu-check" / "models")
    ap.add_argument("--ftype", default="Q4_K_M")
    ap.add_argument("--bin-dir", type=Path, help="llama.cpp's tools (llama-quantize, llama-bench, "
                    "llama-completion, llama-speculative-simple); without it: no native figures")
    ap.add_argument("--backend", default="auto", choices=["auto", "cuda", "cpu"])
    ap.add_argument("--ngl", type=int, help="layers on the GPU (default: all where offload works)")
    ap.add_argument("--threads", type=int, help="CPU threads (default: 1 for tiny shapes, "
                    "else llama.cpp's choice)")
    ap.add_argument("--ks", default="1-17", help="verify batch sizes, e.g. 1-17 or 1,2,4,8")
    ap.add_argument("--contexts", default="100,700", help="context lengths for batch invariance")
    ap.add_argument("--reps", type=int, default=5, help="timings per verify batch size")
    ap.add_argument("--n-decode", type=int, default=64, help="single-token decodes timed")
    ap.add_argument("--n-gen", type=int, default=128, help="tokens per pair run")
    ap.add_argument("--n-max", type=int, default=4, help="draft length in the pair runs")
    ap.add_argument("--pair-reps", type=int, default=3)
    ap.add_argument("--pair", metavar="TARGET,DRAFT",
                    help="shapes of the pair (default: the largest file and the smallest)")
    ap.add_argument("--no-pair", action="store_true", help="skip the offload and loop checks")
    ap.add_argument("--deadline-s", type=float, default=0.0,
                    help="skip what is left after this many seconds (0: no limit)")
    ap.add_argument("--build-info", type=Path, help="JSON from the build step, kept in the result")
    ap.add_argument("--out", type=Path,
                    default=Path(os.environ["OUT"]) / "gpu_check.json" if os.environ.get("OUT")
                    else Path("gpu_check.json"))
    ns = ap.parse_args(argv)
    t_start = time.monotonic()
    ns.ks = parse_ks(ns.ks)
    ns.contexts = [int(c) for c in ns.contexts.split(",")]

    from tandem.engine.backend import llama

    llama.init_backend()
    offload = llama.supports_gpu_offload()
    backend = ns.backend if ns.backend != "auto" else ("cuda" if offload else "cpu")
    if ns.ngl is None:
        ns.ngl = 99 if offload else 0
    given = dict(item.split("=", 1) for item in ns.model)
    shapes = list(given) if given and ns.shapes == ap.get_default("shapes") else \
        parse_shapes(ns.shapes)
    if ns.threads is None:
        ns.threads = 1 if all(s.startswith("tiny") for s in shapes) else 0
    result: dict = {"schema": costs.SCHEMA, "backend": backend, "started": time.strftime(
        "%Y-%m-%dT%H:%M:%S%z"), "environment": costs.environment(),
        "build": json.loads(ns.build_info.read_text()) if ns.build_info else None,
        "argv": argv if argv is not None else sys.argv[1:],
        "settings": {"ngl": ns.ngl, "threads": ns.threads, "ks": ns.ks,
                     "contexts": ns.contexts, "reps": ns.reps, "n_decode": ns.n_decode,
                     "n_max": ns.n_max},
        "models": {}, **{s.name: {} if s.per == "shape" else None for s in SECTIONS}}
    ns.out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        tmp = ns.out.with_name(ns.out.name + ".part")
        tmp.write_text(json.dumps(result, indent=1))
        tmp.replace(ns.out)

    def late() -> bool:
        return ns.deadline_s > 0 and time.monotonic() - t_start > ns.deadline_s

    def run(section: Section, key: str, *paths: Path) -> dict:
        """One entry of a section; a failure is kept as its error, the other entries go on."""
        if late():
            return {"skipped": "deadline"}
        log(f"{section.name}: {key or ' + '.join(p.name for p in paths)}")
        try:
            return section.measure(ns, *paths)
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}

    paths = {name: Path(p) for name, p in given.items()}
    result["models"].update({n: {"path": str(p), "given": True} for n, p in given.items()})
    quantize = ns.bin_dir / "llama-quantize" if ns.bin_dir else None
    save()
    want_pair = not ns.no_pair and len(shapes) >= 2
    pair_shapes = ns.pair.split(",") if ns.pair else None
    by_shape = [s for s in SECTIONS if s.per == "shape"]

    def check_pair() -> None:
        t_shape, d_shape = pair_shapes
        for section in (s for s in SECTIONS if s.per == "pair"):
            result[section.name] = {"target_shape": t_shape, "draft_shape": d_shape,
                                    **run(section, "", paths[t_shape], paths[d_shape])}
            save()

    # shape by shape, in the order given: a run cut short keeps whole shapes; a --pair of
    # early shapes is checked as soon as both are measured, before larger shapes are made
    for name in shapes:
        if name not in paths and not late():
            try:
                result["models"].update(make(ns.models_dir, [name], quantize, ns.ftype, log=log))
                paths[name] = Path(result["models"][name]["path"])
            except Exception as exc:  # no model: each of its sections says why
                for section in by_shape:
                    result[section.name][name] = {"error": f"{type(exc).__name__}: {exc}"}
                save()
                continue
        for section in by_shape:
            result[section.name][name] = (run(section, name, paths[name]) if name in paths
                                          else {"skipped": "deadline"})
            save()
        if want_pair and pair_shapes and result["pair"] is None \
                and all(s in paths for s in pair_shapes):
            check_pair()
    if want_pair and result["pair"] is None:
        made = [s for s in shapes if s in paths]
        if len(made) >= 2:
            by_size = sorted(made, key=lambda s: paths[s].stat().st_size)
            pair_shapes = pair_shapes or [by_size[-1], by_size[0]]
            if all(s in paths for s in pair_shapes):
                check_pair()
    for section in (s for s in SECTIONS if s.per == "once"):
        result[section.name] = run(section, section.name)
        save()
    result["seconds"] = round(time.monotonic() - t_start, 1)
    save()
    print(summary(result))
    print(f"wrote {ns.out}", file=sys.stderr)
    # loud: a section that erred fails the run, named with its error's first line
    failed = failures(result)
    for line in failed:
        print(f"gpu_check: FAILED {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
