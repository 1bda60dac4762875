"""`tandem spec-bench`: baseline against speculative decoding on a workload, and tuning."""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rich.table import Table

from tandem.bench.sweep import sweep_help
from tandem.commands import options
from tandem.errors import RemoteError, TandemError, UsageError
from tandem.fsutil import check_input_file
from tandem.machine.load import busy as is_busy

SWEEP_HELP = sweep_help()  # from the sweep table, so a new key cannot be left out


PROMPTS_MAX_BYTES = 64 << 20  # Spec-Bench's question.jsonl is about 1 MB


app = typer.Typer()


def _live_table(report, names) -> Table:
    table = Table(title="speedup over plain decoding (median, measured in this run)")
    table.add_column("category")
    for n in names:
        table.add_column(n, justify="right")
    if report is None:
        return table
    from tandem.bench.report import OVERALL, ratio_text

    for cat in report.categories + [OVERALL]:
        table.add_row(cat, *(ratio_text(report.cell(n, cat)) for n in names))
    cells = [report.cell(n, OVERALL) for n in names]
    if any(c is not None and c.checked for c in cells):
        table.add_row("valid outputs", *(f"{c.valid}/{c.checked}" if c is not None and c.checked
                                         else "-" for c in cells))
    return table


def eta_text(done: int, total: int, elapsed: float) -> str:
    """The time left, from the mean time of the runs so far: "about 3 min left"."""
    if done <= 0 or total <= done:
        return "" if total > done else "done"
    left = elapsed / done * (total - done)
    if left < 60:
        return f"about {max(5, round(left / 5) * 5):.0f} s left"
    if left < 3600:
        return f"about {round(left / 60):.0f} min left"
    return f"about {left / 3600:.1f} h left"


@app.command("spec-bench")
def spec_bench(
    *,
    args: Annotated[Optional[list[str]], typer.Argument(help="[PAIR|MODEL]: a catalog pair name or a model (user/repo:QUANT, user/repo/file.gguf, a .gguf file).", show_default=False)] = None,
    model: options.TargetFile = None, model_draft: options.DraftFile = None,
    hf_repo: options.HfRepo = None, hf_file: options.HfFile = None, hf_repo_draft: options.HfRepoDraft = None,
    drafts: Annotated[Optional[list[str]], typer.Option("--draft", help="A draft to compare (repeatable): catalog name, user/repo:QUANT, user/repo/file.gguf or a path.")] = None,
    calibrate_costs: Annotated[bool, typer.Option("--cost-curve/--no-cost-curve", help="Measure the verify-batch cost curve (k = 1..16) and each draft's token cost.")] = True,
    workload: Annotated[Optional[str], typer.Option("--workload", help="A built-in workload: spec-bench (the default: code, code-edit, json, summarization, qa, writing) or structured (extraction, generation and tool calls, each task under its own JSON schema or tools; outputs checked with jsonschema).", show_default=False)] = None,
    prompts: Annotated[Optional[Path], typer.Option("--prompts", readable=False, help="Spec-Bench JSONL, JSONL with prompt/category, a text file (prompts separated by blank lines), or - for stdin.")] = None,
    per_category: Annotated[Optional[int], typer.Option("--per-category", help="At most this many prompts per category.")] = None,
    category: Annotated[Optional[list[str]], typer.Option("--category", help="Only this category (repeatable).")] = None,
    multi_turn: Annotated[bool, typer.Option("--multi-turn", help="Conversations instead of single prompts: the built-in code-editing conversations, and the two-turn rows of --prompts (Spec-Bench's MT-bench), reported per turn, plus a fresh session that edits an earlier answer from the history.")] = False,
    group_mt_bench: Annotated[bool, typer.Option("--group-mt-bench", help="Report Spec-Bench's eight MT-bench categories as one (as the Spec-Bench paper does).")] = False,
    strategies: Annotated[str, typer.Option("--strategies", help="Comma-separated strategies to compare with plain decoding.")] = "draft,ngram,hybrid,auto",
    sweep: Annotated[Optional[list[str]], typer.Option("--sweep", help=SWEEP_HELP)] = None,
    n_max: options.DraftMax = None, n_min: options.DraftMin = None, p_min: options.DraftPMin = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n", help="Tokens generated per prompt.")] = 128,
    reps: Annotated[int, typer.Option("--reps", help="Repetitions of every (prompt, configuration).")] = 1,
    warmup: Annotated[bool, typer.Option("--warmup/--no-warmup", help="One short unrecorded run first.")] = True,
    quick: Annotated[bool, typer.Option("--quick", help="2 prompts per category, 64 tokens: 12 prompts, each decoded plainly and with every strategy (60 runs with the default --strategies); stderr shows the time left.")] = False,
    out: Annotated[Optional[Path], typer.Option("--out", readable=False, help="Write report.json, runs.csv, report.md and speedup.svg here.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the machine-readable result on stdout.")] = False,
    predict: Annotated[Optional[list[str]], typer.Option("--predict", help="Also predict the speedup on this hardware profile from the measured acceptance (repeatable; labelled as a prediction).")] = None,
    predict_costs: Annotated[Optional[Path], typer.Option("--predict-costs", exists=True, dir_okay=False, help="Also predict the speedup with the costs `tandem hw costs` measured on another machine (its JSON; shapes matched to this pair by file name, else model size).")] = None,
    tune: Annotated[bool, typer.Option("--tune", help="Save the fastest configuration for run, chat and --strategy auto.")] = False,
    n_ctx: options.CtxSize = None, n_threads: options.Threads = None, exact: options.Exact = False,
    target_gpu_layers: options.GpuLayers = None, draft_gpu_layers: options.GpuLayersDraft = None,
    flash_attn: options.FlashAttn = None, n_batch: options.BatchSize = None, n_ubatch: options.UBatchSize = None,
    type_k: options.CacheTypeK = None, type_v: options.CacheTypeV = None, no_mmap: options.NoMmap = False, mlock: options.Mlock = False,
    rpc: options.Rpc = None, rpc_timeout: options.RpcTimeout = None,
    grammar: options.Grammar = None, grammar_file: options.GrammarFile = None,
    json_schema: options.JsonSchema = None, json_schema_file: options.JsonSchemaFile = None,
    json_object: options.JsonObject = False, verbose: options.Verbose = False,
    yes: options.Yes = False,
):
    """Measure plain decoding against speculative strategies on a workload, side by side.

    Examples:

      tandem spec-bench --quick

      tandem spec-bench --prompts cli/tandem/data/spec_bench.jsonl --per-category 5 --out bench-out

      tandem spec-bench --multi-turn --prompts cli/tandem/data/spec_bench.jsonl --strategies auto

      tandem spec-bench --strategies draft --sweep draft-max=2,4,8 --sweep p-min=0,0.5 --tune

      tandem spec-bench --workload structured -n 256 --out bench-structured

      tandem spec-bench -jf person.schema.json --prompts extraction.jsonl
    """
    from tandem.bench.benchmark import BenchRequest, BenchSession
    from tandem.bench.sweep import parse_sweep
    from tandem.commands.constraint import constraint_flags
    from tandem.models.store import tandem_home

    structured = constraint_flags(grammar, grammar_file, json_schema, json_schema_file,
                                  json_object)
    request = BenchRequest(
        strategies=tuple(s.strip() for s in strategies.split(",") if s.strip()),
        max_tokens=max_tokens, reps=reps, warmup=warmup, cost_curve=calibrate_costs,
        predict=tuple(predict or ()), predict_costs=predict_costs, tune=tune, out=out)
    request.check(tandem_home())  # refused now, not after an hour of runs
    if quick:
        per_category = per_category or 2
        request = replace(request, max_tokens=min(max_tokens, 64))
    pair, first, rest = options.split_model_and_prompt(args or [])
    if rest:
        raise UsageError(f"unexpected argument {rest!r}",
                         "spec-bench takes an optional pair name or model")
    refs = options.model_refs(hf_repo, hf_file, hf_repo_draft, first)
    tasks = _structured_tasks(workload, prompts, multi_turn, structured)
    if tasks is not None:
        from tandem.bench import workloads

        items, conversations = workloads.select(tasks, per_category, category), []
    else:
        items, conversations = _workload(prompts, multi_turn, per_category, category,
                                         group_mt_bench)
    grid = parse_sweep(sweep or [])
    # the same settings chain as run and chat (flags > env > config > tuned > profile)
    prepared = options.prepare_pair(
        pair, model, model_draft, options.setting_flags(  # its strategies are its own
            locals(), **structured, strategy="none"), verbose, yes, refs)
    target_path, draft_path, planned = prepared.target, prepared.draft, prepared.options
    request = replace(request, constraint=_bench_constraint(prepared.settings, tasks is not None))
    draft_paths = ([_fetch(ref, yes) for ref in drafts] if drafts
                   else ([draft_path] if draft_path else []))
    bench = BenchSession(request, target_path, draft_paths, planned, items, grid, conversations)
    err = Console(stderr=True, no_color=bool(os.environ.get("NO_COLOR")) or None)
    partial = _run(bench, err, verbose, as_json)
    _show_outcome(bench, bench.report(partial), err, as_json)
    if partial:
        err.print("Interrupted: partial results above (marked partial in the files).")
        raise typer.Exit(130)


def _structured_tasks(workload, prompts, multi_turn: bool, structured: dict):
    """--workload structured's tasks (each with its own constraint, compiled now), None for
    the other workloads; the combinations that cannot mean anything are refused."""
    from tandem.bench import structured_workload as st

    if workload is not None and workload not in st.WORKLOADS:
        raise UsageError(f"unknown workload {workload!r}",
                         f"workloads: {', '.join(st.WORKLOADS)}; or --prompts FILE")
    if workload is not None and prompts is not None:
        raise UsageError("--workload and --prompts cannot be used together",
                         "give a built-in workload or a prompts file")
    if workload != "structured":
        if any(v is not None for v in structured.values()):
            st.need_checker()  # the outputs are checked after the runs: refused now
        return None
    if multi_turn:
        raise UsageError("--workload structured has single prompts, not conversations",
                         "drop --multi-turn")
    if any(v is not None for v in structured.values()):
        raise UsageError("--workload structured runs each task under its own schema or tools; "
                         "a --grammar or --json-schema flag would replace them",
                         "drop the flag, or give it with --prompts FILE or the default workload")
    st.need_checker()
    tasks = st.load()
    st.compile_all(tasks)
    return tasks


def _bench_constraint(settings, own_tasks: bool):
    """The constraint every configuration runs under: the flags' or config.yaml's; none for
    the structured workload, whose tasks bring their own (a configured one is said and left)."""
    from tandem.commands.constraint import settings_constraint

    constraint = settings_constraint(settings)
    if constraint is not None and not own_tasks:
        from tandem.bench.structured_workload import need_checker

        need_checker()
    if constraint is not None and own_tasks:
        print(f"Note: {constraint.origin} is not used: the structured workload's tasks each "
              "bring their own schema or tools", file=sys.stderr)
        return None
    return constraint


def _workload(prompts, multi_turn: bool, per_category, category, group_mt_bench: bool):
    """(prompts, conversations): what the benchmark runs; --multi-turn runs conversations."""
    from tandem.bench.benchmark import load_prompts

    if prompts is not None and str(prompts) != "-" and os.path.lexists(prompts):
        # before a byte is read: a FIFO blocked forever, /dev/zero ran out of memory
        check_input_file(prompts, "prompts file", PROMPTS_MAX_BYTES)
    if not multi_turn:
        return load_prompts(prompts, options.read_stdin, per_category, category,
                            group_mt_bench), []
    from tandem.bench import multiturn

    conversations = multiturn.builtin_conversations() + (
        multiturn.spec_bench_conversations(prompts) if prompts is not None else [])
    return [], multiturn.select(conversations, per_category)


def _run(bench, err: Console, verbose: bool, as_json: bool) -> bool:
    """The benchmark's runs; True when Ctrl-C cut them short. The first Ctrl-C finishes the
    current run and keeps what was measured, a second one stops at once."""
    stop = {"now": False}

    def on_sigint(signum, frame):
        if stop["now"]:
            raise KeyboardInterrupt
        stop["now"] = True

    old = signal.signal(signal.SIGINT, on_sigint)
    try:
        _show_runs(bench, err, verbose, lambda: stop["now"])
    except RemoteError as failed:  # --rpc: the server died or stalled (engine/remote/worker.py)
        _keep_partial(bench, err, as_json)
        raise failed from None
    finally:
        signal.signal(signal.SIGINT, old)
    return stop["now"]


def _keep_partial(bench, err: Console, as_json: bool) -> None:
    """The runs recorded before a remote failure: the report and --out's files, marked
    partial, as after Ctrl-C; nothing when no run was recorded. Never tuned: a benchmark that
    broke off is no basis for the settings run and chat use."""
    if not bench.results:
        return
    bench.request = replace(bench.request, tune=False)
    try:
        _show_outcome(bench, bench.report(True), err, as_json)
    except TandemError as exc:  # the RPC failure is the error to report; this one is said
        err.print(f"partial results not kept: {exc.message}", highlight=False)
        return
    err.print(f"Partial results above ({len(bench.results)} of {bench.total} runs, marked "
              "partial in the files): the benchmark broke off.", highlight=False)


def _show_runs(bench, err: Console, verbose: bool, should_stop) -> None:
    """Run the benchmark with a live table on a terminal, one line per run otherwise."""
    from tandem.bench.runner import BenchProgress

    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.fields[eta]}"), console=err)
    task = progress.add_task("spec-bench", total=bench.total, eta="")
    live = None
    began = time.monotonic()
    try:
        for ev in bench.run(verbose, should_stop):
            if not isinstance(ev, BenchProgress):
                err.print(ev, highlight=False)
                continue
            if ev.result is None:  # the runs begin
                began = time.monotonic()
                err.print(f"{bench.total} runs", highlight=False)
                if err.is_terminal:
                    live = Live(Group(progress, _live_table(None, bench.names)), console=err,
                                refresh_per_second=4, transient=False)
                    live.start()
                continue
            eta = eta_text(ev.done, ev.total, time.monotonic() - began)
            progress.update(task, completed=ev.done, eta=eta)
            if live:
                live.update(Group(progress, _live_table(bench.live_report(), bench.names)))
            else:
                r = ev.result
                busy = " (busy)" if is_busy(r.busy) else ""
                err.print(f"[{ev.done}/{ev.total}] {r.config:<24} {r.category:<14} "
                          f"{r.tokens_per_second:6.2f} tok/s{busy} · {eta}", highlight=False)
    finally:
        if live:
            live.stop()


def _show_outcome(bench, report, err: Console, as_json: bool) -> None:
    """Files, tuning and the report: stderr for what happened, stdout for the result."""
    from dataclasses import asdict

    from tandem.bench import report as rep
    from tandem.bench import tune as tuning
    from tandem.models.store import tandem_home

    warning = rep.load_warning(report)
    if warning:
        err.print(f"Warning: {warning}", highlight=False, soft_wrap=True)
    if bench.request.out is not None:
        files = bench.write_outputs(report)
        err.print(f"wrote {', '.join(str(f) for f in files)}", highlight=False)
    else:
        err.print("Note: the report was not saved (no --out): pass --out DIR to keep "
                  "report.json, runs.csv, report.md and speedup.svg.", highlight=False,
                  soft_wrap=True)
    if bench.tuned is not None:
        path = bench.save_tuned(tandem_home())
        if path is None:
            err.print(f"not tuned: no configuration convinced; {tuning.RULE}. The profile's "
                      "settings stay in force.", highlight=False)
        else:
            o = bench.tuned["overall"]
            err.print(f"tuned: {o['config']} ({o['speedup']:.2f}x overall, 25th percentile "
                      f"{o['speedup_lo']:.2f}x) saved to {path}; {tuning.RULE}", highlight=False)
    if as_json:
        print(json.dumps({**report.to_dict(), "runs": [asdict(r) for r in bench.results]}))
    elif sys.stdout.isatty():
        console = Console(no_color=bool(os.environ.get("NO_COLOR")) or None, highlight=False)
        console.print(rep.verdict(report), style="bold", markup=False)
        console.print(_live_table(report, bench.names))
    else:  # piped: the Markdown report, which does not depend on a terminal width
        sys.stdout.write(rep.to_markdown(report))


def _fetch(ref: str, yes: bool) -> Path:
    """A draft reference as a local file: a path, or pulled through the store (a large
    download only with --yes or a yes at a terminal)."""
    from tandem.commands.progress import download_view
    from tandem.models import pairing
    from tandem.models.store import Store

    store = Store()
    m = pairing.resolve(ref, "draft")
    local = pairing.local_path(m, store)
    if local is not None:
        return local
    view = download_view()
    try:
        options.confirm_download(ref, [m.spec], store.models_dir, yes, view.note)
        return store.ensure(m.spec, progress=view)
    finally:
        view.close()
