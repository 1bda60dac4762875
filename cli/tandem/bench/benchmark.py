"""spec-bench's work without a terminal: what to measure, the measuring, what it concluded.

`tandem.commands.bench` parses the options into a BenchRequest, shows BenchSession's progress
and renders its report; BenchSession loads the pair, calibrates, runs every configuration
through the same generate() users run, and writes and tunes. Like the chat's core, it yields
data and never prints.

The measuring itself (`measure`) runs where the pair is: in this process, or, with the target
on RPC servers, whole in the supervised worker process that holds it (engine/remote/worker.py,
RemotePair.stream; it needs the session's contexts, which cannot cross a pipe), its items
streamed back; a dead or stalled server then ends it with a RemoteError and the results so far.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterator, Sequence

from tandem.bench import report as rep
from tandem.bench import tune as tuning
from tandem.config import tuned as tuned_file
from tandem.config.schema import check_max_tokens
from tandem.bench import workloads
from tandem.bench.multiturn import Conversation, count_runs, run_conversations
from tandem.bench.runner import BenchProgress, RunResult, classify_divergences, run_bench
from tandem.bench.sweep import build_configs
from tandem.bench.workloads import Prompt
from tandem.engine.drafting.history import Library
from tandem.engine.loop.sampling import SamplingParams
from tandem.engine.pair import Pair, PairSession, SessionOptions
from tandem.engine.loop.speculative import GenParams
from tandem.errors import StorageError, UsageError
from tandem.fsutil import blocking_file, storage_error


@dataclass(frozen=True)
class BenchRequest:
    """What spec-bench was asked to measure and to do with the result."""

    strategies: tuple[str, ...] = ("draft", "ngram", "hybrid", "auto")
    max_tokens: int = 128
    reps: int = 1
    warmup: bool = True
    cost_curve: bool = True  # measure the verify-batch cost curve and each draft's token cost
    predict: tuple[str, ...] = ()  # hardware profiles to predict the speedup on
    predict_costs: Path | None = None  # `tandem hw costs`' JSON: costs measured elsewhere
    tune: bool = False
    out: Path | None = None
    # every configuration runs under it (engine.constrain.grammar.Constraint; None: free text,
    # or the structured workload's tasks, which carry their own)
    constraint: object | None = None

    def check(self, home: Path) -> None:
        """Everything that can be refused is refused before the benchmark, not after an hour
        of it."""
        from tandem.machine.profiles import get_profile

        if self.reps < 1:
            raise UsageError(f"--reps must be >= 1, got {self.reps}", "pass --reps 1 or more")
        check_max_tokens(self.max_tokens)
        if self.out is not None:
            _check_out_dir(self.out)
        for name in self.predict:
            get_profile(name, force=True)
        if self.predict_costs is not None:
            from tandem.bench.predict import load_costs_file

            load_costs_file(self.predict_costs)
        if self.tune:
            _check_tuned_dir(home)


def load_prompts(source: Path | None, read_stdin: Callable[[], str], per_category: int | None,
                 categories: Sequence[str] | None, group_mt_bench: bool) -> list[Prompt]:
    """The workload: the built-in suite, a file, or stdin (`-`: JSONL when it starts with `{`,
    else text), optionally grouped and narrowed; refused when nothing is left."""
    if source is None:
        items = workloads.builtin()
    elif str(source) == "-":
        data = read_stdin()
        items = (workloads.parse_jsonl(data.splitlines(), "stdin") if data.lstrip().startswith("{")
                 else workloads.parse_text(data, "stdin"))
    else:
        items = workloads.read_file(source)
    if group_mt_bench:
        items = workloads.group_mt_bench(items)
    items = workloads.select(items, per_category, categories)
    if not items:
        raise UsageError("no prompts selected", "check --category and --per-category")
    return items


def draft_labels(paths: Sequence[Path]) -> list[str]:
    """A name for each draft file; the same name twice gets #N."""
    out: list[str] = []
    for p in paths:
        out.append(p.name if p.name not in out else f"{p.name}#{len(out) + 1}")
    return out


@dataclass(frozen=True)
class Work:
    """What `measure` needs besides the session: sent whole to the worker for a remote target."""

    configs: tuple
    prompts: tuple[Prompt, ...]
    conversations: tuple[Conversation, ...]
    gen: GenParams
    reps: int
    warmup: bool
    cost_curve: bool
    total: int


@dataclass(frozen=True)
class Costs:
    """measure_costs' figures, an item of `measure`."""

    figures: dict


@dataclass(frozen=True)
class Divergences:
    """classify_divergences' findings, an item of `measure`: (index among its results, the
    divergence). Set on the caller's own RunResults (a remote worker's are copies)."""

    found: tuple[tuple[int, dict], ...]


class BenchSession:
    """One spec-bench run: its configurations, the results so far, and what they conclude."""

    def __init__(self, request: BenchRequest, target_path: Path, draft_paths: Sequence[Path],
                 planned: SessionOptions, prompts: Sequence[Prompt], grid: dict[str, list],
                 conversations: Sequence[Conversation] = ()):
        self.request = request
        self.target_path = target_path
        self.draft_paths = list(draft_paths)
        self.labels = draft_labels(self.draft_paths)
        self.prompts = list(prompts)
        # multi-turn workloads (bench/multiturn.py): measured instead of `prompts`
        self.conversations = list(conversations)
        self.planned = planned
        self.threads = planned.target_ctx.n_threads
        self.configs = build_configs(request.strategies, planned.draft, grid,
                                     drafts=self.labels if len(self.labels) > 1 else (),
                                     ctx=planned.target_ctx)
        self.gen = GenParams(max_tokens=request.max_tokens, sampling=SamplingParams(),
                             constraint=request.constraint)
        self.results: list[RunResult] = []
        self.tuned: dict | None = None
        self.meta = {"target": target_path.name, "drafts": self.labels,
                     "max_tokens": request.max_tokens, "reps": request.reps,
                     "prompts": len(self.prompts), "greedy": True,
                     "threads": self.threads or os.cpu_count()}
        if request.constraint is not None:
            self.meta["constraint"] = request.constraint.origin or request.constraint.kind
        elif any(p.structure is not None for p in self.prompts):
            self.meta["constraint"] = "each task's own schema or tools (structured workload)"

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.configs]

    @property
    def total(self) -> int:
        if self.conversations:
            return count_runs(self.conversations, self.configs)
        return len(self.prompts) * len(self.configs) * self.request.reps

    def run(self, verbose: bool = False,
            should_stop: Callable[[], bool] = lambda: False) -> Iterator[str | BenchProgress]:
        """Load the pair, then yield a line before the cost curve is measured, a BenchProgress
        without a result when the runs begin, and one after every recorded run. should_stop()
        ends it early, keeping the results so far (a partial report).
        A remote target's server that dies or stalls raises RemoteError (exit 6) from here
        within the stall limit; self.results keeps the runs recorded until then."""
        # never the user's history: each run's library is what the workload says it is
        # the target's MTP heads are loaded only where a strategy drafts with them
        heads = next((s for s in self.request.strategies if s in ("mtp", "auto")), "none")
        opts = replace(self.planned, strategy=heads, verbose=verbose, history=False)
        work = Work(tuple(self.configs), tuple(self.prompts), tuple(self.conversations),
                    self.gen, self.request.reps, self.request.warmup, self.request.cost_curve,
                    self.total)
        open_pair: Callable[..., Pair] = PairSession
        if opts.rpc:  # measured whole in the worker that holds the pair
            from tandem.engine.remote.worker import RemotePair

            open_pair = RemotePair
        with open_pair(self.target_path, self.draft_paths, opts) as session:
            yield from self._absorb(session.stream(measure, work, should_stop=should_stop))

    def _absorb(self, items) -> Iterator[str | BenchProgress]:
        """measure's items into this session's results and meta; lines and progress on."""
        first = len(self.results)
        for item in items:
            if isinstance(item, Costs):
                self.meta["costs"] = item.figures
            elif isinstance(item, Divergences):
                for i, divergence in item.found:
                    self.results[first + i].divergence = divergence
            else:
                if isinstance(item, BenchProgress) and item.result is not None:
                    self.results.append(item.result)
                yield item

    def live_report(self) -> rep.Report:
        """The figures so far, for a live table."""
        return rep.aggregate(self.results, self.configs, meta=self.meta)

    def report(self, partial: bool) -> rep.Report:
        """The final report, with --predict's predictions and --tune's choice in its meta."""
        exact = self.planned.target_ctx.exact
        self.meta["mode"] = ("exact: greedy output must be identical to plain decoding" if exact
                             else "fast: llama.cpp's kernels; greedy divergences at a logit gap "
                             f"under {rep.NEAR_TIE_GAP} are near-tie flips, wider ones mismatches")
        report = rep.aggregate(self.results, self.configs, partial=partial, meta=self.meta,
                               exact=exact)
        if self.request.predict:
            from tandem.bench.predict import predict
            from tandem.machine.profiles import get_profile

            self.meta["predictions"] = {name: predict(
                report, get_profile(name, force=True)[0].cost_for(), self.target_path.name,
                self.labels[0] if self.labels else "")
                for name in self.request.predict}
        if self.request.predict_costs is not None:  # measured on another machine
            from tandem.bench.predict import load_costs_file, predict

            draft = self.labels[0] if self.labels else ""
            costs = load_costs_file(self.request.predict_costs, self.target_path.name, draft)
            self.meta.setdefault("predictions", {})[
                f"{self.request.predict_costs.name}: {costs['source']}"] = predict(
                report, costs, self.target_path.name, draft)
        self.tuned = tuning.choose(report) if self.request.tune and self.results else None
        if self.tuned is not None:
            o = self.tuned["overall"]
            self.meta["tuning"] = (f"{o['config']} chosen ({o['speedup']:.2f}x, 25th percentile "
                                   f"{o['speedup_lo']:.2f}x)" if o else "profile kept"
                                   ) + f"; {tuning.RULE}"
        return report

    def write_outputs(self, report: rep.Report) -> list[Path]:
        """report.json, runs.csv, report.md and speedup.svg under --out."""
        out = self.request.out
        try:
            return rep.write_outputs(report, self.results, out)
        except OSError as exc:
            raise storage_error(exc, "the benchmark report", Path(exc.filename or out)) from None

    def save_tuned(self, home: Path) -> Path | None:
        """Save --tune's choice for run, chat and auto to find; None when nothing convinced."""
        if self.tuned is None or self.tuned["overall"] is None:
            return None
        winner = self.tuned["overall"].get("draft_model")
        chosen = (self.draft_paths[self.labels.index(winner)] if winner in self.labels
                  else (self.draft_paths[0] if self.draft_paths else None))
        path = tuned_file.tuned_path(home, self.target_path, chosen, self.threads)
        try:
            tuned_file.save(path, self.tuned, self.meta)
        except OSError as exc:
            raise storage_error(exc, "the tuned settings", path, home_hint=True) from None
        return path


def measure(session, work: Work, should_stop: Callable[[], bool] = lambda: False,
            tick: Callable[[], None] | None = None) -> Iterator:
    """The benchmark on a loaded session: a line before the cost curve, Costs, a
    BenchProgress without a result when the runs begin and one after every recorded run, and
    Divergences at the end. Module-level and picklable in and out: a remote target's worker
    runs it (RemotePair.stream; `tick()` there is progress for its stall limit)."""
    session.library = Library(None, remember=False)
    if work.cost_curve:
        yield "measuring the verify-batch cost curve..."
        yield Costs(measure_costs(session, work.configs, tick))
    yield BenchProgress(0, work.total, None)
    results: list[RunResult] = []
    if work.conversations:
        turns: dict[str, list[int]] = {}
        for ev in run_conversations(session, work.conversations, work.configs, work.gen,
                                    should_stop, turns):
            results.append(ev.result)
            yield ev
        if results and not should_stop():
            classify_divergences(session, [], work.configs, results, turns.get)
            yield _divergences(results)
        return
    for ev in run_bench(session, work.prompts, work.configs, work.gen, work.reps, work.warmup,
                        should_stop):
        if ev.result is not None:
            results.append(ev.result)
            yield ev
    if results and not should_stop():
        # each divergence from plain output: the logit gap there, in its own context
        classify_divergences(session, work.prompts, work.configs, results)
        yield _divergences(results)


def _divergences(results: Sequence[RunResult]) -> Divergences:
    return Divergences(tuple((i, r.divergence) for i, r in enumerate(results)
                             if r.divergence is not None))


class _Ticking:
    """A context whose truncate() also calls tick(): calibrate truncates after each timed
    decode, so the timings stay clean and a remote calibration shows progress."""

    def __init__(self, ctx, tick: Callable[[], None]):
        self._ctx, self._tick = ctx, tick

    def truncate(self, n: int):
        out = self._ctx.truncate(n)
        self._tick()
        return out

    def __getattr__(self, name):
        return getattr(self._ctx, name)


def measure_costs(session: PairSession, configs, tick: Callable[[], None] | None = None) -> dict:
    """Verify cost of batches of 1..17 tokens for each target context setting benchmarked,
    and each draft's token cost relative to a plain target token."""
    from tandem.engine.tuning.costs import calibrate

    def ticking(ctx):
        return _Ticking(ctx, tick) if tick is not None and ctx is not None else ctx

    probe = session.target.tokenize("def main():\n    print('calibrating costs')\n",
                                    add_special=False, parse_special=False)
    default = session.options.target_ctx
    curves, drafts = {}, {}
    for c in configs:
        if c.is_plain:
            session.configure(c.target_ctx or default, c.draft_ctx or c.target_ctx or default)
            cm = calibrate(ticking(session.target_ctx), None, probe, sizes=range(1, 18),
                           reps=2)
            curves[c.name] = {n: round(1000 * t, 2) for n, t in sorted(cm.verify.items())}
    for label in session.drafts:
        session.configure(default, default, label)
        cm = calibrate(ticking(session.target_ctx), session.draft_ctx, probe, sizes=(1,),
                       reps=3)
        drafts[label] = {"ms_per_token": round(1000 * cm.draft_token, 2),
                         "relative_to_target": round(cm.draft_token / cm.plain, 3)}
    return {"verify_ms": curves, "drafts": drafts}


def _check_out_dir(out: Path) -> None:
    """--out must be a directory, or a path where one can be created."""
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
    tuned = home / tuned_file.TUNED_DIR
    blocker = blocking_file(tuned)
    if blocker is not None:
        raise StorageError(f"--tune cannot save into {tuned}: {blocker} is a file, "
                           "not a directory",
                           "set TANDEM_HOME to a directory (or move that file out of the way)")
