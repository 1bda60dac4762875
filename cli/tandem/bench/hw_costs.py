"""This machine's costs for a pair, measured: what `tandem hw costs` writes and `tandem
spec-bench --predict-costs` reads elsewhere (schema 1, the `shapes` and `seq_batch` sections
that scripts/gpu_check.py writes too, with its checkout-only extras beside them).

Per model: plain decode ms per token (one token, logits on the host), the verify-batch curve
(k = 1..17 tokens after a 128-token prompt, logits on every row, as a verify step needs them),
the host's argmax and draft_top on one row, and the seq_batch curve (one decode holding 1, 2,
4, 8 sequences' rows, 1 each for plain steps or 1 + `drafted` for verify steps, against one
sequence's single-token step). Costs depend on the shapes and kernels, not the weights, so
synthetic models measure a machine as well as real ones. Data out; nothing printed (progress
goes to the caller's callback).
"""
from __future__ import annotations

import os
import platform
import re
import shutil
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Sequence

from tandem.engine.backend.context_params import ALL, NONE, ContextParams

SCHEMA = 1
PROMPT_TOKENS = 128  # context before the decode and verify timings (a short chat prompt)
# a text that tokenizes to enough tokens in any vocabulary (numbers and short words)
PROBE_TEXT = " ".join(f"item {i} costs {i * 7 % 13} dollars and weighs {i % 5} kg;"
                      for i in range(200))
SEQS = (1, 2, 4, 8)
SHIFT = 4  # each sequence's prompt starts this many tokens after the previous one's


@dataclass(frozen=True)
class CostPlan:
    """How a model is measured: where its layers go, its context (threads, flash attention,
    KV types), and how much is timed."""
    gpu_layers: int = 0
    ctx: ContextParams = field(default_factory=ContextParams)
    repack: bool = False
    ks: tuple[int, ...] = tuple(range(1, 18))  # verify batch sizes
    reps: int = 5  # timings per verify batch size, and per seq_batch step
    n_decode: int = 64  # single-token decodes timed
    drafted: int = 4  # seq_batch's verify steps: 1 + drafted rows per sequence


def environment() -> dict:
    """What the figures were measured on: Python, CPU count, llama-cpp-python's version and
    build (GPU offload, system info), the GPUs nvidia-smi lists."""
    from tandem.engine.backend import llama

    env = {"python": platform.python_version(), "machine": platform.machine(),
           "cpu_count": os.cpu_count(), "llama_cpp_python": llama.LLAMA_CPP_VERSION,
           "gpu_offload": llama.supports_gpu_offload(), "system_info": llama.system_info(),
           "gpus": []}
    if shutil.which("nvidia-smi"):
        res = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True)
        env["gpus"] = [line.strip() for line in res.stdout.splitlines() if line.strip()]
    return env


def placement(lines: list[str]) -> dict:
    """Where llama.cpp put a model, from its load log: layers per device, buffer sizes."""
    text = "".join(lines)
    devices: dict[str, int] = {}
    for dev in re.findall(r"layer\s+\d+ assigned to device (\S+?),", text):
        devices[dev] = devices.get(dev, 0) + 1
    buffers = {name: float(mib) for name, mib in
               re.findall(r"load_tensors:\s+(\S+) model buffer size =\s+([\d.]+) MiB", text)}
    m = re.search(r"offloaded (\d+)/(\d+) layers to GPU", text)
    return {"layers_by_device": devices, "buffers_mib": buffers,
            "offloaded": [int(m.group(1)), int(m.group(2))] if m else None}


def _median_ms(times: list[float]) -> float:
    return round(1e3 * statistics.median(times), 4)


def load_model(path: Path, plan: CostPlan):
    """(the model, where llama.cpp put it)."""
    from tandem.engine.backend import llama

    lines = llama.capture_log()
    try:
        model = llama.Model(path, n_gpu_layers=plan.gpu_layers, repack=plan.repack)
    finally:
        llama.capture_log(False)
    return model, placement(lines)


def probe_tokens(model, need: int) -> list[int]:
    tokens = model.tokenize(PROBE_TEXT, add_special=True, parse_special=False)
    if len(tokens) < need:
        raise RuntimeError(f"the probe text has {len(tokens)} tokens, {need} needed")
    return tokens


def measure_shape(model, plan: CostPlan) -> dict:
    """A loaded model's decode cost, verify curve and host row costs: the `shapes` entry
    that spec-bench --predict-costs prices with."""
    from tandem.engine.backend import llama
    from tandem.engine.loop.sampling import SamplingParams, draft_top

    kmax = max(plan.ks)
    need = PROMPT_TOKENS + max(plan.n_decode, kmax) + 8
    tokens = probe_tokens(model, need)
    out: dict = {"n_vocab": model.n_vocab, "n_layer": model.n_layer,
                 "bytes": model.path.stat().st_size}
    ctx = llama.Context(model, replace(plan.ctx, n_ctx=max(need, 256)))
    out["context"] = asdict(ctx.params)
    clock = time.perf_counter
    try:
        ctx.prefill(tokens[:PROMPT_TOKENS])
        ctx.decode(tokens[PROMPT_TOKENS:PROMPT_TOKENS + 1])  # warm-up: first-use costs
        ctx.truncate(PROMPT_TOKENS)
        decode, argmax, top = [], [], []
        sp = SamplingParams()
        for t in tokens[PROMPT_TOKENS:PROMPT_TOKENS + plan.n_decode]:
            t0 = clock()
            row = ctx.decode([t], all_logits=True)[0]  # returns once the logits are on the host
            t1 = clock()
            int(row.argmax())
            t2 = clock()
            draft_top(row, [], sp)
            t3 = clock()
            decode.append(t1 - t0)
            argmax.append(t2 - t1)
            top.append(t3 - t2)
        out["decode_ms"] = _median_ms(decode)
        out["host_argmax_us"] = round(1e3 * _median_ms(argmax), 2)
        out["host_draft_top_us"] = round(1e3 * _median_ms(top), 2)
        curve = {}
        for k in plan.ks:
            times = []
            for _ in range(plan.reps):
                ctx.truncate(PROMPT_TOKENS)
                t0 = clock()
                ctx.decode(tokens[PROMPT_TOKENS:PROMPT_TOKENS + k], all_logits=True)
                times.append(clock() - t0)
            curve[str(k)] = _median_ms(times)
    finally:
        ctx.close()
    base = curve.get("1") or out["decode_ms"]
    out["verify"] = {"ms": curve, "ratio": {k: round(v / base, 4) for k, v in curve.items()},
                     "prompt_tokens": PROMPT_TOKENS, "reps": plan.reps}
    return out


def time_layouts(ctx, prompts: Sequence[Sequence[int]], layouts: Sequence[tuple[int, ...]],
                 reps: int, prompt_tokens: int = PROMPT_TOKENS, first_seq: int = 0,
                 before_rep: Callable[[], None] = lambda: None) -> dict[tuple[int, ...], list[float]]:
    """Seconds of one llama_decode per layout, `reps` each: a layout is the rows per sequence
    (sequence first_seq + i decodes layout[i] rows, logits on every one, as a verify step).
    Sequence first_seq + i first holds prompt_tokens of prompts[i]; its timed rows are the
    tokens after them and are removed again after each timing, so positions stay put. The
    largest layout is decoded once first (first-use costs); then each repetition runs
    before_rep and every layout in turn (interleaved: a load change touches every size
    alike)."""
    n = max(len(layout) for layout in layouts)
    width = max(max(layout) for layout in layouts)
    if len(prompts) < n or any(len(p) < prompt_tokens + width for p in prompts[:n]):
        raise RuntimeError(f"{n} prompts of {prompt_tokens + width} tokens needed")
    for i in range(n):
        ctx.decode_batch([(first_seq + i, 0, prompts[i][:prompt_tokens], NONE)])
    clock = time.perf_counter

    def step(layout: tuple[int, ...]) -> float:
        rows = [(first_seq + i, prompt_tokens, prompts[i][prompt_tokens:prompt_tokens + w], ALL)
                for i, w in enumerate(layout)]
        t0 = clock()
        ctx.decode_batch(rows)  # returns once the logits are on the host
        took = clock() - t0
        for seq, *_ in rows:
            ctx.seq_rm(seq, prompt_tokens)
        return took

    step(max(layouts, key=sum))
    times: dict[tuple[int, ...], list[float]] = {layout: [] for layout in layouts}
    for _ in range(reps):
        before_rep()
        for layout in layouts:
            times[layout].append(step(layout))
    return times


def measure_seq_batch(model, plan: CostPlan) -> dict:
    """ms and ratio[rows per sequence][N]: rows 1 (plain) and 1 + plan.drafted (a verify
    step); ratio 1.0 is one sequence's single-token step. Every sequence first holds
    PROMPT_TOKENS tokens; the timed rows are removed again after each timing.
    one_seq_context_ms: the same single-token step in a context of one sequence, as tandem
    decodes today (what a context of several costs a lone request)."""
    from tandem.engine.backend import llama

    widths = (1, 1 + plan.drafted)
    n = max(SEQS)
    tokens = probe_tokens(model, SHIFT * n + PROMPT_TOKENS + max(widths))
    # llama.cpp splits n_ctx evenly between the sequences (kv_unified off, its default)
    per_seq = -(-(PROMPT_TOKENS + max(widths)) // 256) * 256
    ctx = llama.Context(model, replace(plan.ctx, n_ctx=n * per_seq, n_seq_max=n,
                                       n_outputs_max=max(llama.MAX_OUTPUTS, n * max(widths))))
    alone = llama.Context(model, replace(plan.ctx, n_ctx=per_seq))
    clock = time.perf_counter
    try:
        alone.prefill(tokens[:PROMPT_TOKENS])

        def lone() -> float:
            t0 = clock()
            alone.decode(tokens[PROMPT_TOKENS:PROMPT_TOKENS + 1])
            took = clock() - t0
            alone.truncate(PROMPT_TOKENS)
            return took

        lone()  # warm-up
        lone_times: list[float] = []
        # each sequence's prompt starts SHIFT tokens after the previous one's
        times = time_layouts(ctx, [tokens[SHIFT * s:] for s in range(n)],
                             [(w,) * k for w in widths for k in SEQS], plan.reps,
                             before_rep=lambda: lone_times.append(lone()))
        context = {"n_seq_max": ctx.n_seq_max, "n_ctx_seq": ctx.n_ctx_seq,
                   "flash_attn": ctx.params.flash_attn, "type_k": ctx.params.type_k}
    finally:
        ctx.close()
        alone.close()
    ms = {str(w): {str(k): _median_ms(times[(w,) * k]) for k in SEQS} for w in widths}
    base = ms["1"]["1"]
    return {"ms": ms, "ratio": {w: {k: round(v / base, 4) for k, v in by_n.items()}
                                for w, by_n in ms.items()},
            "one_seq_context_ms": _median_ms(lone_times),
            "seqs": list(SEQS), "rows_per_seq": list(widths), "prompt_tokens": PROMPT_TOKENS,
            "reps": plan.reps, "context": context}


def shape_keys(target: Path, draft: Path) -> tuple[str, str]:
    """The shapes' keys in the file: the model files' names, which spec-bench --predict-costs
    matches first (two files of the same name: suffixed by their role)."""
    if target.name != draft.name:
        return target.name, draft.name
    return f"{target.name} (target)", f"{draft.name} (draft)"


def settings_of(plan: CostPlan) -> dict:
    return {"ngl": plan.gpu_layers, "threads": plan.ctx.n_threads, "ks": list(plan.ks),
            "reps": plan.reps, "n_decode": plan.n_decode, "n_max": plan.drafted,
            "repack": plan.repack, "flash_attn": plan.ctx.flash_attn,
            "type_k": plan.ctx.type_k, "type_v": plan.ctx.type_v}


def measure_pair_costs(target: Path, draft: Path, plan: CostPlan, draft_plan: CostPlan,
                       progress: Callable[[str], None] = lambda _msg: None) -> dict:
    """The schema-1 costs file of a pair on this machine: `shapes` and `seq_batch` for both
    models, keyed by file name, and the pair's keys where spec-bench looks for them when its
    own files are named otherwise (`pair`: target_shape, draft_shape)."""
    from tandem.engine.backend import llama

    llama.init_backend()
    t0 = time.monotonic()
    keys = dict(zip(("target", "draft"), shape_keys(target, draft)))
    doc: dict = {"schema": SCHEMA, "source": "tandem hw costs",
                 "backend": "gpu" if plan.gpu_layers and llama.supports_gpu_offload() else "cpu",
                 "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "environment": environment(),
                 "settings": {"target": settings_of(plan), "draft": settings_of(draft_plan)},
                 "models": {}, "shapes": {}, "seq_batch": {},
                 "pair": {"target_shape": keys["target"], "draft_shape": keys["draft"]}}
    for role, path, p in (("target", target, plan), ("draft", draft, draft_plan)):
        key = keys[role]
        progress(f"{role}: loading {path.name}")
        model, where = load_model(path, p)
        try:
            doc["models"][key] = {"path": str(path), "role": role, "placement": where}
            progress(f"{role}: decode and verify batches of {min(p.ks)}..{max(p.ks)} tokens")
            doc["shapes"][key] = measure_shape(model, p)
            progress(f"{role}: {', '.join(map(str, SEQS))} sequences in one decode")
            doc["seq_batch"][key] = measure_seq_batch(model, p)
        finally:
            model.close()
    doc["seconds"] = round(time.monotonic() - t0, 1)
    return doc


def shape_summary(name: str, s: dict) -> str:
    """One line of a `shapes` entry: decode, the verify curve against one token, host costs."""
    r = s["verify"]["ratio"]
    curve = " ".join(f"k={k}:{r[k]:.2f}" for k in ("2", "4", "8", "16") if k in r)
    return (f"{name}: decode {s['decode_ms']:.3f} ms/token; verify/plain {curve}; host argmax "
            f"{s['host_argmax_us']:.1f} us, draft_top {s['host_draft_top_us']:.1f} us")


def seq_batch_summary(name: str, s: dict) -> str:
    """One line of a `seq_batch` entry: each width's ratio at every N."""
    parts = [f"{w} row{'s' if w != '1' else ''}/seq " + "/".join(f"{r[k]:.2f}" for k in r)
             for w, r in s["ratio"].items()]
    return (f"{name}: x one sequence's token at {'/'.join(map(str, s['seqs']))} sequences: "
            + "; ".join(parts) + f" (that token {s['ms']['1']['1']:.3f} ms, "
            f"{s['one_seq_context_ms']:.3f} in a context of one sequence)")
