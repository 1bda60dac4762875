"""`tandem hw`: detected hardware, the chosen profile, settings with their sources, and the
offload/memory plan for a pair; `tandem hw costs`: this machine's decode and verify costs for
a pair, measured, as the JSON `tandem spec-bench --predict-costs` reads. The core (hardware,
profiles, settings, planner, bench/hw_costs.py) computes; this module only renders, as Rich
tables, lines or one JSON object, on stdout.

Over 400 lines because `tandem hw` renders seven tables (hardware, profile, settings, the plan,
the slots of --parallel, recommended pairs, a remote target) and `hw costs` is its subcommand;
nothing is computed here.
"""
import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from tandem.bench.hw_costs import CostPlan
from tandem.commands import options
from tandem.commands.options import DraftFile, TargetFile, setting_flag

app = typer.Typer(name="hw", invoke_without_command=True, no_args_is_help=False)


@app.callback()
def hw(
    ctx: typer.Context,
    profile: Annotated[Optional[str], typer.Option("--profile", help="Use this profile instead of the detected one.")] = None,
    pair: Annotated[Optional[str], typer.Option("--pair", help="Plan for this catalog pair (default: the configured or default pair).")] = None,
    model: TargetFile = None,
    model_draft: DraftFile = None,
    ctx_size: setting_flag("n_ctx", "-c", help="Plan for this context size.") = None,
    target_gpu_layers: options.GpuLayers = None, draft_gpu_layers: options.GpuLayersDraft = None,
    force_profile: Annotated[bool, typer.Option("--force-profile", help="Use --profile even if it does not match this machine.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")] = False,
    rpc: setting_flag("rpc", help="Also plan the target over these llama.cpp RPC servers, HOST:PORT[,HOST:PORT...] (asks each for its free memory).") = None,
    parallel: setting_flag("parallel", "-np", help="Plan N slots as `tandem serve --parallel N` holds them (and the one it keeps for short requests where N >= 2; -1 or 0: auto, 4): per slot its KV cache, recurrent state (1 + n_rs_seq copies), context checkpoints (RAM) and MTP context KV; exit 3 when they do not fit. Not set: no slots table.") = None,
):
    """Show the detected hardware, the chosen profile and the offload/memory plan.

    The plan places the draft fully on the GPU first, then as many target layers as still
    fit, and counts weights, KV caches and compute buffers of both models.

    Examples:

      tandem hw

      tandem hw --pair qwen2.5-coder-7b --ctx-size 16384

      tandem hw --profile rtx-4090 --force-profile --json

      tandem hw --rpc 192.168.1.20:50052    # layers and bytes per device, link traffic

      tandem hw --pair qwen3.6-27b-mtp --parallel 4    # four slots: state, checkpoints, MTP KV

      tandem hw costs --out costs.json      # this machine's decode and verify costs
    """
    if ctx.invoked_subcommand is not None:
        return
    report = build_report(profile=profile, pair=pair, model=model, model_draft=model_draft,
                          ctx_size=ctx_size, force_profile=force_profile, rpc=rpc,
                          layers=(target_gpu_layers, draft_gpu_layers), parallel=parallel)
    if as_json:
        print(json.dumps(report_json(report), indent=2))
    else:
        render(report)
    if report["slots"] is not None:  # after the plan that says why: exit 3, Error/Hint
        from tandem.machine.slots import require_slots_fit

        require_slots_fit(report["slots"], report["pair"] or "the pair")


@app.command("costs")
def costs(
    pair: Annotated[Optional[str], typer.Option("--pair", help="Measure this catalog pair (default: the configured or default pair).")] = None,
    model: TargetFile = None,
    model_draft: DraftFile = None,
    n_threads: options.Threads = None,
    exact: options.Exact = False,
    reps: Annotated[Optional[int], typer.Option("--reps", min=1, max=100, help=f"Timings per verify batch size and per several-sequence step; their median counts (default {CostPlan.reps}).", show_default=False)] = None,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", readable=False, help="Write the JSON here and a summary on stdout (default: the JSON on stdout).")] = None,
    verbose: options.Verbose = False,
    yes: options.Yes = False,
):
    """Measure this machine's costs for a pair, for `tandem spec-bench --predict-costs`.

    Each model's plain decode time per token, the verify-batch curve (1..17 tokens, logits on
    every row) against it, the host's cost per row, and one decode of 1, 2, 4 and 8
    sequences against one sequence's token: with the threads, offload and context settings
    `tandem run` uses here. On a machine without a benchmark of its own, spec-bench prices the
    acceptance it measures with these costs (shapes matched to its pair by file name or
    size). Progress goes to stderr, a line per model and step.

    Examples:

      tandem hw costs --out costs.json

      tandem hw costs -m target.gguf -md draft.gguf -t 8 --out gpu-costs.json

      tandem spec-bench --quick --predict-costs gpu-costs.json    # then, on another machine
    """
    from dataclasses import replace

    from tandem.bench.hw_costs import measure_pair_costs, seq_batch_summary, shape_summary
    from tandem.errors import UsageError
    from tandem.fsutil import atomic_write_text, blocking_file, storage_error

    if out is not None and (out.is_dir() or blocking_file(out.parent) is not None):
        raise UsageError(f"--out {out} cannot be written as a file",
                         "pass a file path in an existing directory, such as costs.json")
    prepared = options.prepare_pair(pair, model, model_draft,
                                    options.setting_flags(locals(), strategy="draft"),
                                    verbose, yes)
    if prepared.draft is None:
        raise UsageError("costs are measured for a target and its draft: spec-bench "
                         "prices a draft token against a target token",
                         "pass --model-draft, or a pair with a draft")
    opts = prepared.options
    given = {} if reps is None else {"reps": reps}
    plan = CostPlan(gpu_layers=opts.target_gpu_layers, ctx=opts.target_ctx,
                    repack=opts.repack, **given)
    draft_plan = replace(plan, gpu_layers=opts.draft_gpu_layers,
                         ctx=opts.draft_ctx or opts.target_ctx, repack=opts.draft_repack)
    doc = measure_pair_costs(prepared.target, prepared.draft, plan, draft_plan,
                             lambda msg: print(f"costs: {msg}", file=sys.stderr, flush=True))
    text = json.dumps(doc, indent=1)
    if out is None:
        print(text)
        return
    try:
        atomic_write_text(out, text + "\n")
    except OSError as exc:
        raise storage_error(exc, "the costs file", out) from None
    for key, entry in doc["shapes"].items():
        print(shape_summary(key, entry))
    for key, entry in doc["seq_batch"].items():
        print(seq_batch_summary(key, entry))
    print(f"wrote {out} in {doc['seconds']:.0f} s: pass it to `tandem spec-bench "
          "--predict-costs`", file=sys.stderr)


# ------------------------------------------------------------------------------ collect


def build_report(profile=None, pair=None, model=None, model_draft=None, ctx_size=None,
                 force_profile=False, hardware=None, rpc=None, layers=(None, None),
                 parallel=None) -> dict:
    """Everything `tandem hw` shows, as objects (the renderers only format); `layers`: the
    -ngl and -ngld flags (None: not given); `parallel`: the slots to plan (None: those the
    settings give, none unless set)."""
    from tandem.commands.options import check_model_path, check_pair_or_files
    from tandem.commands.compose import files_on_disk, resolve
    from tandem.errors import UsageError
    from tandem.machine import hardware as hwmod
    from tandem.machine.fit import plan_for_settings, recommended_pairs, slots_for_settings
    from tandem.models import catalog
    from tandem.models.store import Store

    if model_draft is not None and model is None:
        raise UsageError("--model-draft needs --model", "pass the target GGUF with --model")
    check_pair_or_files(pair, model, model_draft)
    if model is not None:
        check_model_path(model, "target")
        if model_draft is not None:
            check_model_path(model_draft, "draft")
    hw = hardware or hwmod.detect()
    store = Store()
    chosen = {}

    def files(pair_name: str):
        """The pair's files when on disk: spec-bench --tune's results for them then apply."""
        if model is not None:
            chosen.update(name=None, target=model, draft=model_draft,
                          label=(model.name, model_draft.name if model_draft else None))
        else:
            spec = catalog.get_pair(pair_name)
            chosen.update(name=spec.name, target=spec.target, draft=spec.draft, mtp=spec.mtp,
                          label=(spec.target.name, spec.draft.name if spec.draft else None))
        chosen["paths"] = files_on_disk(store, chosen["target"], chosen["draft"])
        return chosen["paths"]

    resolved = resolve({"profile": profile, "pair": pair, "n_ctx": ctx_size, "rpc": rpc,
                        "parallel": parallel,
                        "target_gpu_layers": layers[0], "draft_gpu_layers": layers[1],
                        "force_profile": force_profile or None}, files, hardware=hw)
    settings, machine = resolved.settings, dict(hardware=hw, backend=resolved.backend)
    target, draft, pair_name, label = (chosen["target"], chosen["draft"], chosen["name"],
                                       chosen["label"])
    # the heads' own context is planned where they draft: an MTP pair, or --strategy mtp
    mtp = chosen.get("mtp", False) or settings.strategy == "mtp"
    plan = plan_for_settings(settings, target, draft, store=store, mtp=mtp, **machine)
    slots = None
    if settings.source("parallel") != "default":  # a flag, TANDEM_PARALLEL or the config
        from tandem.commands.compose import AUTO_SLOTS

        n = settings.parallel if settings.parallel > 0 else AUTO_SLOTS  # serve's auto
        slots = slots_for_settings(settings, plan, n, target, draft, store=store, mtp=mtp,
                                   **machine)
    remote = None
    if settings.rpc:
        from tandem.config.schema import endpoints
        from tandem.engine.remote.rpc import server_info
        from tandem.machine.fit import remote_plan_for_settings

        servers = [server_info(ep) for ep in endpoints(settings.rpc)]
        remote = remote_plan_for_settings(settings, target, servers, store=store)
    return {"hardware": hw, "resolved": resolved, "pair": pair_name, "labels": label,
            "plan": plan, "slots": slots, "remote": remote, "memory": _memory_types(chosen.get("paths")),
            "recommended": recommended_pairs(settings, resolved.profile, store=store, **machine)}


def state_line(m, checkpoints: int) -> str:
    """The memory a model's recurrent state takes, in words (planner.ModelPlan)."""
    from tandem.fsutil import fmt_bytes

    per_copy = m.copies // checkpoints if checkpoints else 0
    snaps = (f", {fmt_bytes(m.snapshots)} of it llama.cpp's snapshots for rolling drafts back "
             "(n_rs_seq)") if m.snapshots else ""
    return (f"Recurrent state of the {m.role}: {fmt_bytes(m.state)} beside the KV cache{snaps}; "
            f"context checkpoints: up to {checkpoints} copies of {fmt_bytes(per_copy)} in RAM, "
            f"{fmt_bytes(m.copies)} (--ctx-checkpoints)")


def _memory_types(paths) -> dict:
    """Each model's memory type and how its drafts go back, from the headers of the files
    on disk (models/memory_type.py), and its MTP heads (nextn layers: planned with its
    layers, `--strategy mtp` drafts with them); {} when they are not there yet."""
    from tandem.models.gguf_meta import read_gguf_header
    from tandem.models.memory_type import describe

    out = {}
    for role, p in zip(("target", "draft"), paths or ()):
        if p is not None:
            header = read_gguf_header(p)
            heads = header.arch_get("nextn_predict_layers", 0)
            out[role] = {**dict(zip(("type", "rollback"), describe(header, role))),
                         "mtp_heads": heads if isinstance(heads, int) else 0}
    return out


def report_json(r: dict) -> dict:
    res, hw, plan = r["resolved"], r["hardware"], r["plan"]
    s, prof = res.settings, res.profile
    return {
        "hardware": hw.to_dict(),
        "profile": {"name": prof.name, "description": prof.description,
                    "reason": res.profile_reason, "source": s.source("profile"),
                    "origin": prof.origin, "path": prof.path, "backend": prof.backend,
                    "cost": prof.cost_for(hw)},
        "backend": res.backend,
        "settings": s.to_dict(),
        "pair": r["pair"],
        "plan": plan.to_dict(),
        "slots": r["slots"].to_dict() if r.get("slots") is not None else None,
        "remote_target": r["remote"].to_dict() if r.get("remote") else None,
        "memory": r.get("memory", {}),
        "recommended_pairs": [{"name": a.name, "status": a.status, "note": a.note,
                               "exact": a.exact,
                               "total": _needs(a.plan)}
                              for a in r["recommended"]],
        "warnings": list(res.warnings),
        "notes": list(hw.notes),
    }


# ------------------------------------------------------------------------------- render


def _needs(plan) -> int | None:
    from tandem.commands.compose import needs

    return needs(plan)


def _b(n) -> str:
    from tandem.fsutil import fmt_bytes

    return fmt_bytes(n) if n else "-"


def render(r: dict, console=None) -> None:
    """`tandem hw`'s report: hardware, profile, settings, the plan, recommended pairs."""
    from rich.console import Console

    console = console or Console(highlight=False)
    hw, res = r["hardware"], r["resolved"]
    _render_hardware(hw, console)
    _render_profile(res, hw, console)
    _render_settings(res.settings, console)
    _render_plan(r, console)
    if r.get("slots") is not None:
        _render_slots(r["slots"], console)
    _render_recommended(r, res.profile, console)
    for w in res.warnings:
        console.print(f"[yellow]Warning:[/yellow] {w}")
    for n in hw.notes:
        console.print(f"Note: {n}")


def _render_hardware(hw, console) -> None:
    from rich.table import Table

    t = Table(title="Hardware", title_justify="left", show_header=False, box=None, pad_edge=False)
    t.add_column(style="bold")
    t.add_column()
    os_name = {"linux": "Linux", "darwin": "macOS", "windows": "Windows"}.get(hw.os, hw.os)
    t.add_row("OS", f"{os_name} {hw.os_release} ({hw.cpu.arch})")
    t.add_row("CPU", f"{hw.cpu.model}, {hw.cpu.physical_cores} cores / {hw.cpu.logical_cores} "
                     f"threads; {' '.join(hw.cpu.simd) or 'no SIMD flags read'}")
    avail = f" ({_b(hw.ram_available)} available)" if hw.ram_available is not None else ""
    t.add_row("RAM", f"{_b(hw.ram_total)}{avail}")
    if hw.gpus:
        for g in hw.gpus:
            if g.unified:
                t.add_row("GPU", f"{g.name}: unified memory, Metal may use {_b(g.memory_free)}")
            else:
                t.add_row("GPU", f"{g.name}: {_b(g.memory_total)} ({_b(g.memory_free)} free)")
    else:
        t.add_row("GPU", "none")
    b = hw.backend
    if b is not None:
        what = {"cpu": "CPU only (no GPU offload)", "unknown": "not loadable"}.get(b.name,
                                                                                 b.name.upper())
        t.add_row("llama.cpp", f"llama-cpp-python {b.llama_cpp_version}, {what}")
    console.print(t)
    console.print()


def _render_profile(res, hw, console) -> None:
    from rich.table import Table

    s, prof = res.settings, res.profile
    pt = Table(title="Profile", title_justify="left", show_header=False, box=None,
               pad_edge=False)
    pt.add_column(style="bold")
    pt.add_column()
    pt.add_row("Name", f"{prof.name}: {prof.description}"
               + (f" ({prof.origin})" if prof.origin != "builtin" else ""))
    chosen = "detected" if s.source("profile") == "detected" else f"set by {s.origin('profile')}"
    pt.add_row("Chosen", f"{chosen}; {res.profile_reason}")
    tier = prof.tier_for(hw.accelerator_memory)
    if tier is not None:
        pt.add_row("Tier", f">= {tier.min_memory_gib:g} GiB" + (f" ({tier.note})" if tier.note
                                                               else ""))
    pt.add_row("Backend", res.backend + ("" if res.backend == prof.backend else
                                         f" (the profile asks for {prof.backend})"))
    console.print(pt)
    console.print()


def _render_settings(s, console) -> None:
    from rich.table import Table

    st = Table(title="Settings", title_justify="left")
    st.add_column("Setting")
    st.add_column("Value")
    st.add_column("Source")
    for key, setting in s.sources.items():
        st.add_row(key, str(setting.shown), setting.describe())
    console.print(st)
    console.print()


def _render_plan(r: dict, console) -> None:
    from rich.table import Table

    plan = r["plan"]
    target_label, draft_label = r["labels"]
    title = f"Plan for {r['pair']}" if r["pair"] else "Plan"
    exact = all(m.exact for m in plan.models)
    title += " (GGUF files on disk)" if exact else " (sizes from the catalog, estimated)"
    if r.get("remote") is not None:
        title += ", all on this machine (with --rpc: see Target over RPC below)"
    pt = Table(title=title, title_justify="left",
               caption=f"target: {target_label}" + (f", draft: {draft_label}" if draft_label
                                                     else ""), caption_justify="left")
    # a recurrent state (hybrid, recurrent models): its snapshots and checkpoint copies
    state = any(m.state or m.copies for m in plan.models)
    cols = ("Model", "Layers on GPU", "Weights", "KV cache") + (
        ("Recurrent state", "Checkpoints") if state else ()) + (
        "Compute", "On GPU", "In RAM", "Total")
    for col in cols:
        pt.add_column(col, justify="left" if col == "Model" else "right")
    for m in plan.models:
        layers = f"{m.gpu_layers}/{m.max_layers}" if plan.backend != "cpu" else "0 (CPU)"
        pt.add_row(m.role, layers, _b(m.weights), _b(m.kv),
                   *((_b(m.state), _b(m.copies)) if state else ()), _b(m.compute),
                   _b(m.gpu_total), _b(m.cpu_total), _b(m.total))
    pt.add_row("both", "", _b(sum(m.weights for m in plan.models)),
               _b(sum(m.kv for m in plan.models)),
               *((_b(sum(m.state for m in plan.models)), _b(sum(m.copies for m in plan.models)))
                 if state else ()),
               _b(sum(m.compute for m in plan.models)),
               _b(plan.gpu_used if plan.gpu_budget is not None else 0),
               _b(sum(m.cpu_total for m in plan.models)),
               _b(_needs(plan)), style="bold")
    console.print(pt)
    left = []
    if plan.gpu_budget is not None:
        left.append(f"GPU {_b(plan.gpu_left)} of {_b(plan.gpu_budget)}"
                    f" (after keeping {_b(plan.gpu_reserve)} free)")
    ram_kind = "unified memory" if plan.unified else "RAM"
    left.append(f"{ram_kind} {_b(plan.ram_left)} of {_b(plan.ram_budget)} available")
    console.print("Free memory left: " + "; ".join(left))
    status = {"fits": "[green]fits[/green]", "partial": "[yellow]partial offload[/yellow]",
              "does-not-fit": "[red]does not fit[/red]"}[plan.status]
    console.print(f"Status: {status}")
    for role, m in r.get("memory", {}).items():
        console.print(f"Memory of the {role}: {m['type']}; {m['rollback']}")
        if m.get("mtp_heads"):
            console.print(f"MTP heads of the {role}: {m['mtp_heads']} nextn layer(s), planned "
                          "with its layers; `--strategy mtp` drafts with them")
    for m in plan.models:
        if m.state or m.copies:
            console.print(state_line(m, plan.ctx.checkpoints))
        if m.mtp_kv:
            console.print(f"MTP context of the {m.role}: its heads' KV cache, {_b(m.mtp_kv)} "
                          "(in the totals)")
    _render_problems(plan.problems, plan.advice, console)
    if r.get("remote") is not None:
        _render_remote(r["remote"], console)


def _render_slots(sp, console) -> None:
    """`--parallel N`: what each slot adds per model, and every slot's plan in all."""
    from rich.table import Table

    exact = all(m.exact for m in sp.models)
    title = (f"Slots: {sp.parallel}" + (f" and {sp.kept} kept for short requests" if sp.kept
                                        else "")
             + (" (GGUF files on disk)" if exact else " (sizes from the catalog, estimated)"))
    own = (" and the session's own sequence (one ubatch of KV, one state)" if sp.slots > 1
           else "")
    t = Table(title=title, title_justify="left", caption="Per slot: what each slot holds; "
              f"All {sp.slots}: the model holding every slot{own}, weights and compute "
              "buffers included", caption_justify="left")
    for col in ("Model", "KV cache", "Recurrent state", "Checkpoints (RAM)", "MTP context KV",
                "Per slot", f"All {sp.slots}"):
        t.add_column(col, justify="left" if col == "Model" else "right")
    for c, m in zip(sp.per_slot, sp.models):
        state = f"{_b(c.state)} ({c.state_rows} x {_b(c.one_state)})" if c.state else "-"
        t.add_row(c.role, _b(c.kv), state, _b(c.checkpoints), _b(c.mtp_kv), _b(c.total),
                  _b(m.total))
    t.add_row("both", *(_b(sum(getattr(c, k) for c in sp.per_slot))
                        for k in ("kv", "state", "checkpoints", "mtp_kv", "total")),
              _b(sp.total), style="bold")
    console.print(t)
    for c in sp.per_slot:
        if c.state:
            console.print(f"Recurrent state of the {c.role} per slot: {c.state_rows} copies "
                          f"(1 + n_rs_seq {c.state_rows - 1}) of {_b(c.one_state)}; "
                          f"checkpoints: up to {c.n_checkpoints} copies in RAM")
    def left(n: int, of: int) -> str:
        return (f"{_b(n)} of {_b(of)} left" if n >= 0 else f"{_b(-n)} more than the "
                f"{_b(of)} there")

    where = [f"GPU {left(sp.gpu_left, sp.base.gpu_budget)}"] if sp.gpu_left is not None else []
    where.append(f"{'unified memory' if sp.base.unified else 'RAM'} "
                 f"{left(sp.ram_left, sp.base.ram_budget)}")
    console.print("With every slot: " + "; ".join(where))
    console.print("Status: " + ("[green]fits[/green]" if sp.fits else
                                "[red]does not fit[/red]"))
    _render_problems([f"they {p}" for p in sp.problems], sp.advice, console)


def _render_problems(problems, advice, console) -> None:
    """A plan's problems, then what to change, a line each."""
    for p in problems:
        console.print(f"  - {p}")
    if advice:
        console.print("What to change:")
        for a in advice:
            console.print(f"  - {a}")
    console.print()


def _render_recommended(r: dict, prof, console) -> None:
    from rich.table import Table

    if r["recommended"]:
        rt = Table(title=f"Recommended pairs for {prof.name}", title_justify="left")
        rt.add_column("Pair")
        rt.add_column("Status")
        rt.add_column("Needs", justify="right")
        rt.add_column("Note")
        for a in r["recommended"]:
            needs = _b(_needs(a.plan)) if a.plan else "-"
            note = a.note or ("exact (on disk)" if a.exact else "estimated")
            rt.add_row(a.name, a.status, needs, note)
        console.print(rt)


def _layer_span(layers, output: bool) -> str:
    """0-13, 20 (+output): a device's layers, compactly."""
    parts, run = [], []
    for il in list(layers) + [None]:
        if run and (il is None or il != run[-1] + 1):
            parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        if il is not None:
            run.append(il)
    text = ", ".join(parts) or "-"
    return text + (" + output" if output else "")


def _small(n: int) -> str:
    return f"{n} B" if n < 10240 else _b(n)


def _render_remote(rp, console) -> None:
    from rich.table import Table

    n_layers = sum(len(d.layers) for d in rp.devices)
    t = Table(title="Target over RPC", title_justify="left",
              caption="the draft model and its KV cache stay on this machine",
              caption_justify="left")
    for col in ("Device", "Where", "Layers", "Weights", "KV cache", "Compute", "Total", "Free"):
        t.add_column(col, justify="left" if col in ("Device", "Where", "Layers") else "right")
    for d in rp.devices:
        t.add_row(d.device, d.endpoint or "this machine",
                  f"{len(d.layers)}/{n_layers}: {_layer_span(d.layers, d.output)}",
                  _b(d.weights), _b(d.kv), _b(d.compute), _b(d.total),
                  _b(d.free) if d.free is not None else "")
    console.print(t)
    console.print("With --rpc, this machine holds the draft (its row above) and the CPU row "
                  "here.")
    console.print(f"Across the link per token: {rp.crossings} transfer(s), "
                  f"{_small(rp.link_up)} up and {_small(rp.link_down)} down (hidden states"
                  + (" and the logits row, once per verified token" if any(
                      d.output and d.endpoint for d in rp.devices) else "")
                  + "; llama.cpp's graph messages come on top)")
    for p in rp.problems:
        console.print(f"  - [red]{p}[/red]")
    console.print()
