"""PairSession: a target/draft pair loaded once, and generate() with a chosen strategy.

`run`, `chat`, `serve` and `spec-bench` all go through PairSession.generate, so a benchmark
measures exactly what users run. The session is the composition of parts that live in their
own modules: loading and the contexts kept for reuse (engine/backend/loading.py), the cost models
and the knowledge kept beside them (engine/tuning/pricing.py), the drafter for a strategy
(engine/drafting/strategies.py), the prompt's tokens (engine/backend/template.py) and the library auto
drafts from (engine/drafting/history.py).

`Pair` is what the callers (run, chat, serve, spec-bench) use of a loaded pair: PairSession
here, RemotePair (engine/remote/worker.py) when the target's layers are on RPC servers.

Over 400 lines because the protocol and its one local implementation are read together: each
method of Pair is answered by PairSession's a few lines below, and `serve`'s slots
(engine/backend/sequences.py) are one more way into the same generate().
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol, Sequence

from tandem.config.schema import FIELDS_BY_KEY, check_strategy
from tandem.engine.backend import template
from tandem.engine.backend.fim import Chunk, FimTokens, infill_prompt
from tandem.engine.drafting.auto import BUCKETS, ORDER, AutoDrafter
from tandem.engine.tuning.costs import BatchCosts, CostModel
from tandem.engine.drafting.drafters import Drafter
from tandem.engine.loop.events import DoneEvent, PrefillEvent, StepEvent, TokenEvent
from tandem.engine.drafting.history import HistoryStore, Library, read_context_file
from tandem.engine.tuning.knowledge import Knowledge
from tandem.engine.backend.context_params import ContextParams, default_threads
from tandem.engine.slot_plan import one_slot_reason
from tandem.engine.backend.sequences import SeqContext, Slot, StepBatcher, shared_context
from tandem.engine.backend.loading import ContextCache, check_pair, draft_paths, load_drafts
from tandem.engine.tuning.pricing import PROBE_TEXT, Pricing, busy_path, cost_key
from tandem.engine.loop.speculative import GenParams, generate
from tandem.engine.drafting.drafters import DraftParams
from tandem.engine.drafting.strategies import (DrafterParts, make_drafter, need_draft_model,
                                               need_mtp_heads)
from tandem.engine.tuning.threads import NO_THREADS, ThreadControl, ThreadTuner, cpu_load
from tandem.errors import TandemError, UsageError

if TYPE_CHECKING:
    from tandem.engine.backend.llama import Context, Model
    from tandem.engine.backend.mtp import HeadView, MtpHead


@dataclass(frozen=True)
class SessionOptions:
    strategy: str = FIELDS_BY_KEY["strategy"].default
    draft: DraftParams = DraftParams()
    target_ctx: ContextParams = ContextParams()
    draft_ctx: ContextParams | None = None  # None: same as the target's
    target_gpu_layers: int = 0
    draft_gpu_layers: int = 0
    # both models' weights mapped from their files (off: read into memory, llama.cpp's
    # --no-mmap) and locked in RAM (--mlock; llama.cpp warns where it may not lock)
    mmap: bool = FIELDS_BY_KEY["mmap"].default == "on"
    mlock: bool = FIELDS_BY_KEY["mlock"].default == "on"
    verbose: bool = False
    # Repacked CPU weights are llama.cpp's default and faster, but make verify batches of 4+
    # tokens differ numerically from single-token decoding: exact mode loads the target
    # unrepacked. The draft's numerics only affect acceptance.
    repack: bool = True
    draft_repack: bool = True
    # earlier answers of this pair on disk, drafted from by auto and added to after each
    # answer (engine/drafting/history.py); off: neither read nor written
    history: bool = False
    # llama.cpp RPC servers (HOST:PORT) that hold the target's layers; the draft stays on
    # this machine. Attaching aborts the process on a bad server: engine/remote/worker.py runs it.
    rpc: tuple[str, ...] = ()
    # seconds without progress before a remote request is stalled (the schema's default)
    rpc_timeout: float = FIELDS_BY_KEY["rpc_timeout"].default
    # the directory tandem keeps its files in (the app's home, passed in by the command):
    # costs/ (calibrations and kept knowledge) and history/; None: nothing is read or written
    home: Path | None = None
    # choose the thread count that is fastest now (engine/tuning/threads.py) for contexts without a
    # count of their own (ContextParams.n_threads 0); off: llama.cpp's count, as given.
    # commands/compose.py turns it off when the user set -t / threads
    adapt_threads: bool = False
    # move cached runs of at least this many tokens that a new prompt holds elsewhere
    # (llama-server's --cache-reuse; Context.reuse): a server's editors; 0 off, and exact
    # mode never (a moved run's keys are not bit-identical to evaluating them)
    cache_reuse: int = 0
    # sequences both contexts hold for `serve`'s slots, decoded in one batch per step
    # (engine/backend/sequences.py); 1: the one sequence run, chat and spec-bench use
    sequences: int = 1

    def __post_init__(self):
        check_strategy(self.strategy)


Event = PrefillEvent | TokenEvent | StepEvent | DoneEvent


class Pair(Protocol):
    """A loaded pair as run, chat, serve and spec-bench use it, wherever it is loaded: in
    this process (PairSession) or in a supervised worker (RemotePair). Only plain values
    cross a worker's pipe, so what callers read of the contexts is here as values."""

    options: SessionOptions
    target_path: Path
    # prompts may be tokenized in another thread while this pair generates (serve/prompt.py)
    tokenizes_aside: bool

    @property
    def draft_path(self) -> Path | None: ...

    @property
    def n_ctx(self) -> int:
        """The target context's size in tokens."""

    @property
    def cached_tokens(self) -> Sequence[int]:
        """The tokens in the target's KV cache (what a next prompt's prefix may reuse)."""

    @property
    def context_files(self) -> tuple[str, ...]:
        """The names of the files indexed for drafting (add_context_file)."""

    @property
    def fim_tokens(self) -> FimTokens:
        """The target vocabulary's fill-in-the-middle tokens."""

    def tokenize(self, text: str, add_special: bool = False,
                 parse_special: bool = False) -> list[int]:
        """Text's tokens: plain text by default (no special tokens parsed, no BOS)."""

    def pieces(self, tokens: Sequence[int]) -> list[bytes]:
        """Each token's bytes, control tokens as their text (llama-server's /detokenize);
        every id must be below props()["n_vocab"]."""

    def props(self) -> dict:
        """Plain facts of the target's vocabulary: n_vocab, bos_token, eos_token (texts) and
        chat_template (None: the GGUF has none)."""

    def prompt_tokens(self, messages: Sequence[dict], raw: bool = False,
                      tools: Sequence[dict] | None = None) -> list[int]: ...

    def template_text(self, messages: Sequence[dict],
                      tools: Sequence[dict] | None = None) -> str:
        """The messages rendered with the chat template, as prompt text."""

    def infill_tokens(self, prefix: str, suffix: str, extra: Sequence[Chunk] = (),
                      prompt: str = "") -> list[int]:
        """A fill-in-the-middle prompt (engine/backend/fim.py), every text as data."""

    def add_context_file(self, path: str | Path, text: str | None = None) -> int: ...

    def check_drafter(self, strategy: str, draft: DraftParams | None = None) -> None:
        """Raise the UsageError of a strategy that cannot run with this pair."""

    def generate(self, prompt: Sequence[int], gen: GenParams, strategy: str | None = None,
                 draft: DraftParams | None = None, record: bool = True,
                 slot: Slot | None = None) -> Iterator[Event]:
        """The answer's events; `slot`: one of the pair's slots (serve --parallel), whose
        sequences it decodes in the batch the others share."""

    def stream(self, func: Callable[..., Iterator[Any]], *args: Any,
               should_stop: Callable[[], bool] | None = None) -> Iterator[Any]:
        """`func(session, *args, should_stop=..., tick=...)` on the loaded PairSession, its
        items as they come: work that needs the session itself (spec-bench's measurements)."""

    def close(self) -> None: ...

    def __enter__(self) -> Pair: ...

    def __exit__(self, *exc: object) -> None: ...


class PairSession:
    """A target and one or more drafts, loaded once. Contexts are made per ContextParams on
    demand (spec-bench sweeps batch sizes and threads) and kept for reuse."""

    MAX_CONTEXTS = 4  # per model; older unused contexts are closed
    tokenizes_aside = True  # llama_tokenize reads the vocabulary only

    def __init__(self, target_path: str | Path,
                 draft_path: str | Path | Sequence[str | Path] | None,
                 options: SessionOptions = SessionOptions(), progress=None):
        """`progress(what, fraction)`: called while the models load and at every event
        generate() yields (a supervising process's sign of life)."""
        self.options = options
        self._progress = progress
        self.target_path = Path(target_path)
        paths = draft_paths(draft_path)
        if options.strategy == "draft" and not paths:
            raise need_draft_model(options.strategy)
        for p in paths:
            check_pair(self.target_path, p)
        _check_sequences(options)
        if options.rpc:
            from tandem.engine.remote.ggml import attach

            attach(options.rpc)
        # made before the models load: its first look at the machine's load starts here
        self.threads: ThreadControl | None = None
        if options.adapt_threads and not options.rpc:
            self.threads = ThreadControl(ThreadTuner(default_threads()),
                                         lambda: (self.target_ctx, self.draft_ctx), cpu_load())


        def load(path: Path, label: str, **how) -> Model:
            return Model(path, verbose=options.verbose, use_mmap=options.mmap,
                         use_mlock=options.mlock, **how,
                         progress=None if progress is None else (lambda f: progress(label, f)))

        from tandem.engine.backend.llama import Model  # the backend, loaded here
        from tandem.engine.backend.mtp import staging_calls

        # the MTP heads' weights only where they may draft (llama-server: --spec-type
        # draft-mtp): mtp, or auto where this library can drive them
        mtp = options.strategy == "mtp"
        if mtp:
            staging_calls()  # a library without them: a ModelError naming it, before the load
        self.target = load(self.target_path, self.target_path.name,
                           n_gpu_layers=options.target_gpu_layers, repack=options.repack,
                           load_mtp=mtp or (options.strategy == "auto" and _drives_mtp(
                               staging_calls)))
        if mtp and not self.target.mtp_loaded:
            heads = self.target.n_layer_nextn
            self.target.close()
            raise need_mtp_heads(self.target_path.name,
                                 arch=self.target.arch if heads else None)
        if self.target.fully_on_gpu:
            self.threads = None  # the CPU's threads do not compute the target's steps
        self.drafts, self.draft_paths = load_drafts(paths, lambda p, label: load(
            p, label, n_gpu_layers=options.draft_gpu_layers, repack=options.draft_repack,
            local_only=bool(options.rpc)))
        self.target_ctx: Context | None = None
        self.draft_ctx: Context | None = None
        self._contexts = ContextCache(self.MAX_CONTEXTS, lambda: (self.target_ctx, self.draft_ctx))
        self.pricing = Pricing(options.home / "costs" if options.home else None, options.rpc)
        self._cost_key = ""
        self.draft: Model | None = None
        self.draft_label: str | None = None
        slots = options.sequences if options.sequences > 1 else 0
        target_params = options.target_ctx
        draft_params = options.draft_ctx or options.target_ctx
        if slots:
            target_params = shared_context(target_params, slots)
            draft_params = shared_context(draft_params, slots)
        self.configure(target_params, draft_params, next(iter(self.drafts), None))
        # the slots' views of both contexts, and where their decodes meet
        self.batcher = StepBatcher()
        per_slot = (options.target_ctx.n_ctx, (options.draft_ctx or options.target_ctx).n_ctx)
        self.slots = [Slot(i, SeqContext(self.target_ctx, i + 1, per_slot[0], self.batcher),
                           SeqContext(self.draft_ctx, i + 1, per_slot[1], self.batcher,
                                      drafts=True)
                           if self.draft_ctx is not None else None)
                      for i in range(slots)]
        for slot in self.slots:  # a prompt's prefix another slot holds is borrowed, not read
            slot.target.peers = [s.target for s in self.slots if s is not slot]
            if slot.draft is not None:
                slot.draft.peers = [s.draft for s in self.slots if s is not slot]
        # files the user named and earlier answers: what auto drafts from besides the prompt
        self.library = Library(
            HistoryStore(options.home, self.target_path, n_vocab=self.target.n_vocab)
            if options.history and options.home else None)

    def add_context_file(self, path: str | Path, text: str | None = None) -> int:
        """Index a text file for drafting (--context-file, chat /add); its token count.
        `text`: the file's content when the caller has read (and checked) it already."""
        if text is None:
            text = read_context_file(Path(path))
        tokens = self.tokenize(text)
        self.library.add_file(Path(path).name, tokens)
        return len(tokens)

    @property
    def draft_path(self) -> Path | None:
        return self.draft_paths.get(self.draft_label) if self.draft_label else None

    @property
    def n_ctx(self) -> int:
        """A generation's context: the target context's, or one slot's."""
        return self.slots[0].target.n_ctx if self.slots else self.target_ctx.n_ctx

    @property
    def cached_tokens(self) -> Sequence[int]:
        return self.target_ctx.tokens

    @property
    def context_files(self) -> tuple[str, ...]:
        return tuple(self.library.file_names)

    @property
    def fim_tokens(self) -> FimTokens:
        return self.target.fim_tokens()

    def tokenize(self, text: str, add_special: bool = False,
                 parse_special: bool = False) -> list[int]:
        return self.target.tokenize(text, add_special=add_special, parse_special=parse_special)

    def pieces(self, tokens: Sequence[int]) -> list[bytes]:
        return self.target.rendered_pieces(tokens)

    def props(self) -> dict:
        model = self.target
        return {"n_vocab": model.n_vocab, "chat_template": model.chat_template(),
                "bos_token": model.token_text(model.bos) if model.bos >= 0 else "",
                "eos_token": model.token_text(model.eos) if model.eos >= 0 else ""}

    def template_text(self, messages: Sequence[dict],
                      tools: Sequence[dict] | None = None) -> str:
        messages, tools = template.for_template(self.target, messages, tools)
        return template.render(self.target, messages, tools=tools)

    def infill_tokens(self, prefix: str, suffix: str, extra: Sequence[Chunk] = (),
                      prompt: str = "") -> list[int]:
        model = self.target
        return infill_prompt(self.tokenize, model.fim_tokens(),
                             model.bos if model.add_bos else None, prefix, suffix, extra,
                             self.tokenize(prompt), self.n_ctx)

    def configure(self, target_ctx: ContextParams | None = None,
                  draft_ctx: ContextParams | None = None, draft: str | None = None) -> None:
        """Make these context settings and this draft model the active ones."""
        target_ctx = target_ctx or self.target_ctx.params
        if draft is not None and draft not in self.drafts:
            raise UsageError(f"no draft model {draft!r} in this session",
                             f"loaded drafts: {', '.join(self.drafts) or 'none'}")
        self.target_ctx = self._contexts.get("target", self.target, target_ctx)
        self.draft_label = draft or self.draft_label
        if self.draft_label is not None:
            self.draft = self.drafts[self.draft_label]
            params = draft_ctx or (self.draft_ctx.params if self.draft_ctx else target_ctx)
            self.draft_ctx = self._contexts.get(self.draft_label, self.draft, params)
        self._cost_key = cost_key(self.target_ctx, self.draft_ctx, self.target_path,
                                  self.draft_path, (self.options.target_gpu_layers,
                                                    self.options.draft_gpu_layers),
                                  self.options.rpc)
        for ctx in (self.target_ctx, self.draft_ctx):
            if ctx is not None:
                ctx.reuse_min = 0 if ctx.params.exact else self.options.cache_reuse
        if self.threads is not None:
            self.threads.apply()  # a context just made has llama.cpp's default count

    def close(self) -> None:
        self._contexts.close()
        for model in list(self.drafts.values()) + [self.target]:
            model.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def check_drafter(self, strategy: str, draft: DraftParams | None = None) -> None:
        self.drafter(strategy, draft)  # built and dropped: its refusal is the check

    def stream(self, func: Callable[..., Iterator[Any]], *args: Any,
               should_stop: Callable[[], bool] | None = None) -> Iterator[Any]:
        yield from func(self, *args, should_stop=should_stop or (lambda: False), tick=None)

    def drafter(self, strategy: str | None = None, draft: DraftParams | None = None,
                slot: Slot | None = None) -> Drafter:
        """The drafter for `strategy` and `draft` (default: the session's options) over the
        active configuration, or over one slot's sequences: priced for the batch it joins
        (BatchCosts), its MTP heads the slot's view of them (they follow every slot)."""
        if slot is None:
            parts = DrafterParts(self.draft_ctx, self.target_ctx.verify_limit,
                                 lambda calibrated: self.costs(calibrated),
                                 self.pricing.take_notes, self.library, self.knowledge,
                                 self._mtp, self.target.mtp_loaded)
        else:
            parts = DrafterParts(slot.draft, slot.target.verify_limit,
                                 lambda calibrated: self._slot_costs(slot, calibrated),
                                 self.pricing.take_notes, self.library, self.knowledge,
                                 lambda on: self._slot_mtp(slot, on), self.target.mtp_loaded)
        return make_drafter(strategy or self.options.strategy, draft or self.options.draft,
                            parts)

    def _slot_costs(self, slot: Slot, calibrated: bool) -> CostModel:
        """costs() as one slot's drafter sees it: the calibration, run on sequence 0 where
        the generation starts (the engine loop's thread, between batches), and the refined
        model priced for the slot's batch."""
        model = self.costs(calibrated)
        view, batcher = slot.target, self.batcher
        return model if calibrated else BatchCosts(model, lambda: view.others,
                                                   lambda: view.decode_s,
                                                   lambda: max(batcher.members - 1, 0))

    def _mtp(self, on: bool) -> MtpHead | None:
        """The target's MTP heads following the active target context (on), or not (where
        it has slots, they go on following: a slot may be drafting with them)."""
        ctx = self.target_ctx
        if on and not self.target.mtp_loaded:
            raise need_mtp_heads(self.target_path.name, loaded=self.target.n_layer_nextn > 0)
        if not on and self.slots:
            return None
        from tandem.engine.backend.mtp import use_mtp

        return use_mtp(ctx, on)

    def _slot_mtp(self, slot: Slot, on: bool) -> HeadView | None:
        """One slot's view of the MTP heads, which follow every slot's decodes from the first
        that drafts with them on (on). Off (auto found they do not pay): None, and they stop
        following only where no other generation is in progress (it may draft with them);
        a slot whose decodes they missed is followed again from its next decode on."""
        if not on:
            head = self.target_ctx.follower
            if head is not None and head.following and self.batcher.members <= 1:
                head.follow(False)
            return None
        if not self.target.mtp_loaded:
            raise need_mtp_heads(self.target_path.name, loaded=self.target.n_layer_nextn > 0)
        from tandem.engine.backend.mtp import slot_heads

        return slot_heads(self.target_ctx, slot.target, self.batcher)

    def costs(self, calibrated: bool = False) -> CostModel:
        """The active configuration's cost model (engine/tuning/pricing.py: cached on disk, else
        calibrated once; `calibrated=True`: the calibration itself, unrefined)."""
        def probe() -> list[int]:
            return self.tokenize(PROBE_TEXT)

        # a calibration with fewer threads than the key's default is not kept for later runs
        reduced = self.threads is not None and self.threads.tuner.current < \
            self.threads.tuner.default
        return self.pricing.costs(self._cost_key, self.target_ctx, self.draft_ctx, probe,
                                  calibrated, save=not reduced)

    def knowledge(self) -> Knowledge:
        """What earlier requests of the active configuration learnt (engine/tuning/knowledge.py)."""
        return self.pricing.knowledge(self._cost_key, ORDER, BUCKETS)

    def costs_path(self) -> Path | None:
        """The active configuration's cost file (None: nothing kept on disk)."""
        return self.pricing.costs_path(self._cost_key)

    def knowledge_path(self) -> Path | None:
        return self.pricing.knowledge_path(self._cost_key)

    def prompt_tokens(self, messages: Sequence[dict], raw: bool = False,
                      tools: Sequence[dict] | None = None) -> list[int]:
        return template.prompt_tokens(self.target, messages, raw, tools)

    def generate(self, prompt: Sequence[int], gen: GenParams, strategy: str | None = None,
                 draft: DraftParams | None = None, record: bool = True,
                 slot: Slot | None = None) -> Iterator[Event]:
        """generate() with the drafter for `strategy` built from `draft` (default: the
        session's options). Each finished answer joins the library's history, and what an
        auto request learnt is kept (`record`: unless it is a measurement, not an answer)."""
        # the thread count first: a busy core stalls the prompt and auto's calibration too
        # (several slots decode in one batch: the thread count stays as it is)
        threads = self.threads.begin() if self.threads is not None and slot is None \
            else NO_THREADS
        drafter = self.drafter(strategy, draft, slot)
        if gen.prediction and isinstance(drafter, AutoDrafter):  # a source of auto's only
            drafter.expect(gen.prediction)
        # on a slot the events come with DecodeRequests, for the engine loop that steps every
        # slot's generation (engine/loop/step_loop.py)
        target = self.target_ctx if slot is None else slot.target
        if slot is not None:
            target.prompt_end, target.ends_by = len(prompt), len(prompt) + gen.max_tokens
        yield from self._generate(generate(target, prompt, drafter, gen, threads), drafter,
                                  record)

    def _generate(self, inner: Iterator[Event], drafter: Drafter,
                  record: bool) -> Iterator[Event]:
        try:
            for ev in inner:
                if self._progress is not None:
                    self._progress("generate", 0.0)
                if isinstance(ev, DoneEvent) and record:
                    # (slots finish on the engine loop's thread: one at a time)
                    self.library.record(ev.tokens)
                    self._learn(drafter)
                yield ev
        finally:
            inner.close()

    def _learn(self, drafter: Drafter) -> None:
        """Keep what an auto request measured, in the session and beside the cost cache."""
        if isinstance(drafter, AutoDrafter):
            knowledge = self.knowledge()
            drafter.learnt(knowledge)
            self.pricing.keep(self._cost_key, knowledge)


def _check_sequences(options: SessionOptions) -> None:
    """The engine refuses several sequences it cannot batch (serve asks it first:
    commands/compose.py serve_slots)."""
    why = options.sequences > 1 and one_slot_reason(
        strategy=options.strategy, exact=options.target_ctx.exact, rpc=bool(options.rpc))
    if why:
        raise UsageError(f"{options.sequences} sequences in one batch: {why}",
                         "decode one sequence (serve: --parallel 1)")


@dataclass(frozen=True)
class StartupStep:
    """One measurement warm_up() takes: `what`, the `seconds` it took (None: it starts now,
    and may take long) and what came of it."""

    what: str
    seconds: float | None
    result: str = ""


def warm_up(session: PairSession, strategy: str, unsaved_only: bool = False, *,
            should_stop: Callable[[], bool],
            tick: Callable[[], None] | None = None) -> Iterator[StartupStep]:  # noqa: ARG001
    """What the first answer of `strategy` would otherwise measure while its client waits,
    measured now (`tandem serve`, before it listens; `tandem run`, saying so; Pair.stream
    runs it where the session is): the thread count that is fastest now (one sequence whose
    count is the engine's: the slots' batches keep theirs), then auto's cost model at that
    count (cached and checked, else calibrated: engine/tuning/pricing.py, which `basis`
    tells). The costs' first step says "saved" where a cost file is on disk (checked, not
    calibrated: no wait to announce); `unsaved_only`: nothing at all then (a run's answer
    probes its threads at its start, and says so as the first request's)."""
    path = session.costs_path() if strategy == "auto" else None
    saved = path is not None and (path.exists() or busy_path(path).exists())
    if unsaved_only and (saved or strategy != "auto"):
        return
    threads = session.threads
    if threads is not None and threads.active and not session.slots:
        t0 = time.perf_counter()
        threads.begin()  # the start's probe, as a first request's would be
        tuner, said = threads.tuner, threads.notes
        result = said[0].removeprefix("threads: ") if said else (
            f"{tuner.current} of {tuner.default}, "
            + ("fewer were not faster" if tuner.last_times else
               "the machine was quiet while the models loaded"))
        yield StartupStep("thread count", time.perf_counter() - t0, result)
    if strategy == "auto" and not should_stop():  # the one that prices drafts (make_drafter)
        yield StartupStep("drafting costs", None, "saved" if saved else "")
        t0 = time.perf_counter()
        session.costs()
        yield StartupStep("drafting costs", time.perf_counter() - t0, session.pricing.basis)


def _drives_mtp(staging_calls: Callable[[], Any]) -> bool:
    """Whether this libllama has the calls MTP heads need (auto then loads them where the
    model has some; --strategy mtp says why not instead)."""
    try:
        staging_calls()
    except TandemError:
        return False
    return True
