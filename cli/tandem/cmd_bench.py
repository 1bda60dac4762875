"""`tandem spec-bench`: baseline against speculative decoding on a workload, and tuning."""
from __future__ import annotations

import json
import os
from dataclasses import replace
import signal
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from tandem.app import (DraftMaxOpt, DraftMinOpt, DraftOpt, DraftPMinOpt, ModelOpt, OptCtxOpt,
                        OptThreadsOpt, VerboseOpt, ExactOpt)
from tandem.errors import StorageError, UsageError
from tandem.fsutil import storage_error


def register(app: typer.Typer) -> None:
    app.command("spec-bench")(spec_bench)


def _live_table(report, names) -> Table:
    table = Table(title="speedup over plain decoding (median, measured in this run)")
    table.add_column("category")
    for n in names:
        table.add_column(n, justify="right")
    if report is None:
        return table
    from tandem.bench.report import OVERALL

    for cat in report.categories + [OVERALL]:
        row = []
        for n in names:
            c = report.cell(n, cat)
            row.append("-" if c is None or c.speedup is None else f"{c.speedup:.2f}x")
        table.add_row(cat, *row)
    return table


def spec_bench(
    args: Annotated[Optional[list[str]], typer.Argument(help="[PAIR]: a catalog pair name.", show_default=False)] = None,
    model: ModelOpt = None,
    model_draft: DraftOpt = None,
    drafts: Annotated[Optional[list[str]], typer.Option("--draft", help="A draft to compare (repeatable): catalog name, user/repo:QUANT, user/repo/file.gguf or a path.")] = None,
    calibrate_costs: Annotated[bool, typer.Option("--cost-curve/--no-cost-curve", help="Measure the verify-batch cost curve (k = 1..16) and each draft's token cost.")] = True,
    prompts: Annotated[Optional[Path], typer.Option("--prompts", readable=False, help="Spec-Bench JSONL, JSONL with prompt/category, a text file (prompts separated by blank lines), or - for stdin.")] = None,
    per_category: Annotated[Optional[int], typer.Option("--per-category", help="At most this many prompts per category.")] = None,
    category: Annotated[Optional[list[str]], typer.Option("--category", help="Only this category (repeatable).")] = None,
    group_mt_bench: Annotated[bool, typer.Option("--group-mt-bench", help="Report Spec-Bench's eight MT-bench categories as one (as the Spec-Bench paper does).")] = False,
    strategies: Annotated[str, typer.Option("--strategies", help="Comma-separated strategies to compare with plain decoding.")] = "draft,ngram,hybrid,auto",
    sweep: Annotated[Optional[list[str]], typer.Option("--sweep", help="KEY=V1,V2 grid: draft-max, draft-min, p-min (repeatable).")] = None,
    draft_max: DraftMaxOpt = None,
    draft_min: DraftMinOpt = None,
    draft_p_min: DraftPMinOpt = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n", help="Tokens generated per prompt.")] = 128,
    reps: Annotated[int, typer.Option("--reps", help="Repetitions of every (prompt, configuration).")] = 1,
    warmup: Annotated[bool, typer.Option("--warmup/--no-warmup", help="One short unrecorded run first.")] = True,
    quick: Annotated[bool, typer.Option("--quick", help="A few minutes on a CPU: 2 prompts per category, 64 tokens.")] = False,
    out: Annotated[Optional[Path], typer.Option("--out", readable=False, help="Write report.json, runs.csv, report.md and speedup.svg here.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the machine-readable result on stdout.")] = False,
    predict: Annotated[Optional[list[str]], typer.Option("--predict", help="Also predict the speedup on this hardware profile from the measured acceptance (repeatable; labelled as a prediction).")] = None,
    predict_costs: Annotated[Optional[Path], typer.Option("--predict-costs", exists=True, dir_okay=False, help="Also predict the speedup with the costs scripts/gpu_check.sh measured on a machine (its JSON; shapes matched to this pair by model size).")] = None,
    tune: Annotated[bool, typer.Option("--tune", help="Save the fastest configuration for run, chat and --strategy auto.")] = False,
    ctx_size: OptCtxOpt = None,
    threads: OptThreadsOpt = None,
    exact: ExactOpt = False,
    verbose: VerboseOpt = False,
):
    """Measure plain decoding against speculative strategies on a workload, side by side.

    Examples:

      tandem spec-bench --quick

      tandem spec-bench --prompts question.dev.jsonl --per-category 5 --out bench-out

      tandem spec-bench --strategies draft --sweep draft-max=2,4,8 --sweep p-min=0,0.5 --tune
    """
    from tandem import app as app_module
    from tandem.bench import report as rep
    from tandem.bench import tune as tuning
    from tandem.bench import workloads
    from tandem.bench.runner import classify_divergences, run_bench
    from tandem.bench.sweep import build_configs, parse_sweep
    from tandem.engine.sampling import SamplingParams
    from tandem.engine.speculative import GenParams
    from tandem.session import PairSession
    from tandem.store import tandem_home

    if reps < 1:
        raise UsageError(f"--reps must be >= 1, got {reps}", "pass --reps 1 or more")
    if max_tokens < 1:
        raise UsageError(f"max tokens must be >= 1, got {max_tokens}",
                         "pass -n with a positive number of tokens")
    # everything that can be refused is refused before the benchmark, not after an hour of it
    if out is not None:
        _check_out_dir(out)
    for name in predict or ():
        from tandem.profiles import get_profile

        get_profile(name, force=True)
    if predict_costs is not None:
        from tandem.bench.predict import load_gpu_check

        load_gpu_check(predict_costs)
    if tune:
        _check_tuned_dir(tandem_home())
    if quick:
        per_category = per_category or 2
        max_tokens = min(max_tokens, 64)
    pair, rest = app_module._split_pair_and_prompt(args or [])
    if rest:
        raise UsageError(f"unexpected argument {rest!r}", "spec-bench takes an optional pair name")
    if prompts is None:
        items = workloads.builtin()
    elif str(prompts) == "-":
        data = app_module._read_stdin()
        items = (workloads.parse_jsonl(data.splitlines(), "stdin") if data.lstrip().startswith("{")
                 else workloads.parse_text(data, "stdin"))
    else:
        items = workloads.read_file(prompts)
    if group_mt_bench:
        items = workloads.group_mt_bench(items)
    items = workloads.select(items, per_category, category)
    if not items:
        raise UsageError("no prompts selected", "check --category and --per-category")
    grid = parse_sweep(sweep or [])
    gen = GenParams(max_tokens=max_tokens, sampling=SamplingParams())
    # the same settings chain as run and chat (flags > env > config > tuned > profile)
    target_path, draft_path, planned = app_module.load_plan(
        pair, model, model_draft, "none", draft_max, draft_min, draft_p_min, ctx_size, threads,
        verbose, exact=exact)
    base = planned.draft
    threads = planned.target_ctx.n_threads
    draft_paths = [_fetch(ref) for ref in drafts] if drafts else ([draft_path] if draft_path else [])
    labels = _labels(draft_paths)
    configs = build_configs([s.strip() for s in strategies.split(",") if s.strip()], base, grid,
                            drafts=labels if len(labels) > 1 else (), ctx=planned.target_ctx)
    opts = replace(planned, strategy="none", verbose=verbose)
    err = Console(stderr=True, no_color=bool(os.environ.get("NO_COLOR")) or None)
    names = [c.name for c in configs]
    results = []
    stop = {"now": False}

    def on_sigint(signum, frame):  # first Ctrl-C: finish the current run, keep what we have
        if stop["now"]:
            raise KeyboardInterrupt
        stop["now"] = True

    old = signal.signal(signal.SIGINT, on_sigint)
    report = None
    meta = {"target": target_path.name, "drafts": labels,
            "max_tokens": max_tokens, "reps": reps, "prompts": len(items),
            "greedy": True, "threads": threads or os.cpu_count()}
    try:
        with PairSession(target_path, draft_paths, opts) as session:
            if calibrate_costs:
                err.print("measuring the verify-batch cost curve...", highlight=False)
                meta["costs"] = measure_costs(session, configs)
            progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TimeRemainingColumn(), console=err)
            task = progress.add_task("spec-bench", total=len(items) * len(configs) * reps)
            live = Live(Group(progress, _live_table(None, names)), console=err,
                        refresh_per_second=4, transient=False) if err.is_terminal else None
            if live:
                live.start()
            try:
                for ev in run_bench(session, items, configs, gen, reps, warmup, lambda: stop["now"]):
                    if ev.result is None:
                        continue
                    results.append(ev.result)
                    progress.update(task, completed=ev.done)
                    if live:
                        report = rep.aggregate(results, configs, meta=meta)
                        live.update(Group(progress, _live_table(report, names)))
                    else:
                        r = ev.result
                        err.print(f"[{ev.done}/{ev.total}] {r.config:<24} {r.category:<14} "
                                  f"{r.tokens_per_second:6.2f} tok/s", highlight=False)
            finally:
                if live:
                    live.stop()
            if results and not stop["now"]:
                # each divergence from plain output: the logit gap there, in its own context
                classify_divergences(session, items, configs, results)
    finally:
        signal.signal(signal.SIGINT, old)
    partial = stop["now"]
    exact_mode = planned.target_ctx.exact
    meta["mode"] = ("exact: greedy output must be identical to plain decoding" if exact_mode else
                    "fast: llama.cpp's kernels; greedy divergences at a logit gap under "
                    f"{rep.NEAR_TIE_GAP} are near-tie flips, wider ones mismatches")
    report = rep.aggregate(results, configs, partial=partial, meta=meta, exact=exact_mode)
    if predict:
        from tandem.bench.predict import predict as predict_speedups
        from tandem.profiles import get_profile

        meta["predictions"] = {name: predict_speedups(
            report, get_profile(name, force=True)[0].cost_for(), target_path.name,
            labels[0] if labels else "")
                               for name in predict}
    if predict_costs is not None:  # costs measured on another machine by scripts/gpu_check.py
        from tandem.bench.predict import load_gpu_check, predict as predict_speedups

        draft_name = labels[0] if labels else ""
        costs = load_gpu_check(predict_costs, target_path.name, draft_name)
        meta.setdefault("predictions", {})[f"{predict_costs.name}: {costs['source']}"] = \
            predict_speedups(report, costs, target_path.name, draft_name)
    tuned = tuning.choose(report) if tune and results else None
    if tuned is not None:
        o = tuned["overall"]
        meta["tuning"] = (f"{o['config']} chosen ({o['speedup']:.2f}x, 25th percentile "
                          f"{o['speedup_lo']:.2f}x)" if o else "profile kept") + f"; {tuning.RULE}"
    if out is not None:
        try:
            files = rep.write_outputs(report, results, out)
        except OSError as exc:
            raise storage_error(exc, "the benchmark report", Path(exc.filename or out)) from None
        err.print(f"wrote {', '.join(str(f) for f in files)}", highlight=False)
    if tuned is not None and tuned["overall"] is None:
        err.print(f"not tuned: no configuration convinced; {tuning.RULE}. The profile's "
                  "settings stay in force.", highlight=False)
    if tuned is not None and tuned["overall"] is not None:
        winner = (tuned["overall"] or {}).get("draft_model")
        chosen = draft_paths[labels.index(winner)] if winner in labels else (draft_paths[0] if draft_paths else None)
        path = tuning.tuned_path(tandem_home(), target_path, chosen, threads)
        try:
            tuning.save(path, tuned, meta)
        except OSError as exc:
            raise storage_error(exc, "the tuned settings", path, home_hint=True) from None
        o = tuned["overall"]
        err.print(f"tuned: {o['config']} ({o['speedup']:.2f}x overall, 25th percentile "
                  f"{o['speedup_lo']:.2f}x) saved to {path}; {tuning.RULE}", highlight=False)
    if as_json:
        print(json.dumps({**report.to_dict(), "runs": [_run_dict(r) for r in results]}))
    elif sys.stdout.isatty():
        Console(no_color=bool(os.environ.get("NO_COLOR")) or None).print(_live_table(report, names))
    else:  # piped: the Markdown report, which does not depend on a terminal width
        sys.stdout.write(rep.to_markdown(report))
    if partial:
        err.print("Interrupted: partial results above (marked partial in the files).")
        raise typer.Exit(130)


def _check_out_dir(out: Path) -> None:
    """--out must be a directory, or a path where one can be created."""
    from tandem.fsutil import blocking_file

    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file; the report needs a directory",
                         "pass a directory (it is created if missing)")
    blocker = blocking_file(out)
    if blocker is not None:
        raise UsageError(f"--out {out} cannot be created: {blocker} is a file",
                         "pass a directory (it is created if missing)")
    existing = next(p for p in (out, *out.parents) if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        raise StorageError(f"cannot write the report: {existing} is not writable",
                           f"check the permissions of {existing}, or pass another --out")


def _check_tuned_dir(home: Path) -> None:
    """--tune writes <home>/tuned/: refused up front when that cannot work."""
    from tandem.fsutil import blocking_file
    from tandem.settings import tuned_dir

    blocker = blocking_file(tuned_dir(home))
    if blocker is not None:
        raise StorageError(f"--tune cannot save into {tuned_dir(home)}: {blocker} is a file, "
                           "not a directory",
                           "set TANDEM_HOME to a directory (or move that file out of the way)")


def _fetch(ref: str) -> Path:
    """A draft reference as a local file: a path, or pulled through the store."""
    from tandem import pairing
    from tandem.store import Store

    from tandem.app import download_view

    store = Store()
    m = pairing.resolve(ref, "draft")
    local = pairing.local_path(m, store)
    if local is not None:
        return local
    view = download_view()
    try:
        return store.ensure(m.spec, progress=view)
    finally:
        view.close()


def _labels(paths) -> list[str]:
    out: list[str] = []
    for p in paths:
        out.append(p.name if p.name not in out else f"{p.name}#{len(out) + 1}")
    return out


def measure_costs(session, configs) -> dict:
    """Verify cost of batches of 1..17 tokens for each target context setting benchmarked,
    and each draft's token cost relative to a plain target token."""
    from tandem.engine.costs import calibrate

    probe = session.target.tokenize("def main():\n    print('calibrating costs')\n",
                                    add_special=False, parse_special=False)
    default = session.options.target_ctx
    curves, drafts = {}, {}
    for c in configs:
        if c.is_plain:
            session.configure(c.target_ctx or default, c.draft_ctx or c.target_ctx or default)
            cm = calibrate(session.target_ctx, None, probe, sizes=range(1, 18), reps=2)
            curves[c.name] = {n: round(1000 * t, 2) for n, t in sorted(cm.verify.items())}
    for label in session.drafts:
        session.configure(default, default, label)
        cm = calibrate(session.target_ctx, session.draft_ctx, probe, sizes=(1,), reps=3)
        drafts[label] = {"ms_per_token": round(1000 * cm.draft_token, 2),
                         "relative_to_target": round(cm.draft_token / cm.plain, 3)}
    return {"verify_ms": curves, "drafts": drafts}


def _run_dict(r) -> dict:
    from dataclasses import asdict

    return asdict(r)
