"""Load a target/draft pair once and run generate() with a chosen strategy.

`run`, `chat` and `spec-bench` all go through PairSession.generate, so a benchmark measures
exactly what users run.

Over 400 lines because the session still holds several jobs side by side (loading, the cost
cache and the knowledge kept beside it, RPC attachment, history, templates, the drafter
factory); giving each its own module is open work (issue 22), not done in the same change
that added the RPC and knowledge parts.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterator, Sequence

from tandem.config.schema import STRATEGIES, endpoints
from tandem.engine import template as chat_template
from tandem.engine.auto import BUCKETS, ORDER, AutoDrafter
from tandem.engine.costs import DISAGREE, MAX_BATCH, CostModel, calibrate, disagreement
from tandem.engine.events import DoneEvent, StepEvent
from tandem.engine.history import HistoryStore, Library, read_context_file
from tandem.engine.knowledge import Knowledge
from tandem.engine.drafters import (
    Drafter,
    DraftModelDrafter,
    HybridDrafter,
    NgramDrafter,
    NoDrafter,
)
from tandem.engine.llama import MAX_OUTPUTS, Context, ContextParams, Model
from tandem.engine.speculative import GenParams, generate
from tandem.engine.stats import GenStats
from tandem.errors import UsageError

DRAFT_MAX_LIMIT = MAX_OUTPUTS - 1  # a verify batch: the drafts and the last token
# a calibration during which other processes used more than this share of the CPU was
# measured on a busy machine: it serves the session that measured it and is not saved
BUSY_SHARE = 0.25


class _AfterCache:
    """A context as the cost measurements see it: `prefill(probe)` keeps what the cache holds
    when it holds something (the timings then run after it, and each measurement truncates
    back to it), so a measurement never evicts a conversation. Everything else is the
    context's own."""

    def __init__(self, ctx: Context):
        self._ctx = ctx

    def prefill(self, tokens: Sequence[int], progress=None) -> int:
        return 0 if self._ctx.tokens else self._ctx.prefill(tokens, progress)

    def __getattr__(self, name):
        return getattr(self._ctx, name)


def _after_cache(ctx: Context | None) -> Context | _AfterCache | None:
    """`ctx` wrapped in _AfterCache when its cache leaves room for the largest measured batch
    (else the probe replaces the cache, as a measurement at the context end must)."""
    if ctx is None or not ctx.tokens or len(ctx.tokens) + MAX_BATCH + 1 > ctx.n_ctx:
        return ctx
    return _AfterCache(ctx)


def check_cached_costs(target: Context, cached: CostModel, probe: Sequence[int]) -> float:
    """How far cached costs are from this machine's timings now (1.0: in agreement)."""
    return disagreement(target, cached, probe)


@dataclass(frozen=True)
class DraftParams:
    """The draft length and its stops; PairSession.drafter hands them to the drafter it builds,
    which owns them from there (generate() only bounds each step by the room it has)."""

    n_max: int = 4
    n_min: int = 0
    p_min: float = 0.5

    def __post_init__(self):
        if not 0 <= self.n_max <= DRAFT_MAX_LIMIT:
            raise UsageError(f"draft max must be in 0..{DRAFT_MAX_LIMIT}, got {self.n_max}",
                             "llama.cpp's default is 3; 4-16 are typical")
        if not 0 <= self.n_min <= self.n_max:
            raise UsageError(f"draft min must be in 0..draft max ({self.n_max}), got {self.n_min}",
                             None)
        if not 0.0 <= self.p_min <= 1.0:
            raise UsageError(f"draft p-min must be in [0, 1], got {self.p_min}", None)


@dataclass(frozen=True)
class SessionOptions:
    strategy: str = "draft"
    draft: DraftParams = DraftParams()
    target_ctx: ContextParams = ContextParams()
    draft_ctx: ContextParams | None = None  # None: same as the target's
    target_gpu_layers: int = 0
    draft_gpu_layers: int = 0
    verbose: bool = False
    # Repacked CPU weights are llama.cpp's default and faster, but make verify batches of 4+
    # tokens differ numerically from single-token decoding: exact mode loads the target
    # unrepacked (from_settings). The draft's numerics only affect acceptance.
    repack: bool = True
    draft_repack: bool = True
    # earlier answers of this pair on disk, drafted from by auto and added to after each
    # answer (engine/history.py); off: neither read nor written
    history: bool = False
    # llama.cpp RPC servers (HOST:PORT) that hold the target's layers; the draft stays on
    # this machine. Attaching aborts the process on a bad server: engine/worker.py runs it.
    rpc: tuple[str, ...] = ()
    rpc_timeout: float = 60.0  # seconds without progress before a remote request is stalled
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise UsageError(f"unknown strategy {self.strategy!r}",
                             f"choose one of: {', '.join(STRATEGIES)}")

    @classmethod
    def from_settings(cls, s, plan=None, *, verbose: bool = False,
                      extra: dict | None = None) -> SessionOptions:
        """Options for resolved settings (tandem.config.settings.Settings, read by attribute):
        the draft length and its stops become this session's DraftParams; GPU layers come from
        `plan` (the planner resolves `auto`), else from the settings themselves."""
        exact = s.mode == "exact"
        ctx = ContextParams(n_ctx=s.n_ctx, n_batch=s.n_batch, n_ubatch=s.n_ubatch,
                            n_threads=s.n_threads, n_threads_batch=s.n_threads_batch,
                            flash_attn=s.flash_attn, type_k=s.type_k, type_v=s.type_v)
        if plan is not None:
            layers = (plan.target.gpu_layers, plan.draft.gpu_layers if plan.draft else 0)
        else:
            layers = (gpu_layers_value(s.target_gpu_layers, s.backend),
                      gpu_layers_value(s.draft_gpu_layers, s.backend))
        rpc = endpoints(getattr(s, "rpc", ""))
        if rpc:
            # the offloaded layers go to the servers: all of them, unless the user chose a
            # count (a profile's count describes this machine's GPU, not the servers)
            chosen = s.target_gpu_layers if _source(s, "target_gpu_layers") not in (
                "profile", "default", "detected") else "all"
            layers = (gpu_layers_value(chosen, "rpc"), layers[1])
        return cls(strategy=s.strategy, draft=DraftParams(s.n_max, s.n_min, s.p_min),
                   target_ctx=exact_context(ctx) if exact else ctx, draft_ctx=None,
                   target_gpu_layers=layers[0], draft_gpu_layers=layers[1], verbose=verbose,
                   repack=not exact, history=s.history == "on", rpc=rpc,
                   rpc_timeout=float(getattr(s, "rpc_timeout", 60.0)),
                   extra=dict(extra or {}))


def _source(s, key: str) -> str:
    try:
        return s.source(key)
    except (AttributeError, KeyError):
        return "default"


def gpu_layers_value(value: int | str, backend: str) -> int:
    """llama.cpp's n_gpu_layers for a setting without a plan: all = -1 (every layer)."""
    if value == "all":
        return -1
    if value == "auto":
        return 0 if backend == "cpu" else -1
    return int(value)


def exact_context(ctx: ContextParams) -> ContextParams:
    """What exact mode needs of the target's context on llama.cpp's CPU kernels: flash
    attention on (without it, 2+ rows take other matmul kernels) and a q8_0 KV cache (with
    f16, single-token flash attention switches to a split-KV kernel at 512 cached tokens);
    verify batches then stay within EXACT_BATCH rows (engine/llama.py)."""
    return replace(ctx, flash_attn="on", type_k="q8_0", type_v="q8_0", exact=True)


def check_pair(target_path: Path, draft_path: Path) -> None:
    """llama.cpp's vocabulary rules, from the GGUF headers, before any weights are loaded."""
    from tandem.models.gguf_meta import read_gguf_header
    from tandem.models.vocab import VocabInfo, check_compatible

    target = VocabInfo.from_header(read_gguf_header(target_path))
    draft = VocabInfo.from_header(read_gguf_header(draft_path))
    check_compatible(target, draft, target_path.name, draft_path.name)


class PairSession:
    """A target and one or more drafts, loaded once. Contexts are made per ContextParams on
    demand (spec-bench sweeps batch sizes and threads) and kept for reuse."""

    MAX_CONTEXTS = 4  # per model; older unused contexts are closed

    def __init__(self, target_path: str | Path,
                 draft_path: str | Path | Sequence[str | Path] | None,
                 options: SessionOptions = SessionOptions(), progress=None):
        """`progress(what, fraction)`: called while the models load."""
        self.options = options
        self.target_path = Path(target_path)
        if draft_path is None:
            paths: list[Path] = []
        elif isinstance(draft_path, (str, Path)):
            paths = [Path(draft_path)]
        else:
            paths = [Path(p) for p in draft_path]
        if options.strategy == "draft" and not paths:
            raise UsageError(f"strategy {options.strategy!r} needs a draft model",
                             "pass --model-draft PATH, a pair name, or --strategy ngram")
        for p in paths:
            check_pair(self.target_path, p)
        if options.rpc:
            from tandem.engine.ggml import attach

            attach(options.rpc)

        def loading(label):
            return None if progress is None else (lambda f: progress(label, f))
        self.target = Model(self.target_path, options.target_gpu_layers, verbose=options.verbose,
                            repack=options.repack, progress=loading(self.target_path.name))
        self.drafts: dict[str, Model] = {}
        self.draft_paths: dict[str, Path] = {}
        for p in paths:
            label = p.name if p.name not in self.drafts else f"{p.name}#{len(self.drafts) + 1}"
            self.drafts[label] = Model(p, options.draft_gpu_layers, verbose=options.verbose,
                                       repack=options.draft_repack,
                                       local_only=bool(options.rpc), progress=loading(label))
            self.draft_paths[label] = p
        self._contexts: dict[tuple, Context] = {}
        self._costs: dict[tuple, CostModel] = {}
        self._calibrated: dict[tuple, CostModel] = {}
        self._knowledge: dict[tuple, Knowledge] = {}
        # what paid is kept for the session's next request and, with knowledge_file, beside
        # the cost cache for the next process (engine/knowledge.py)
        self.knowledge_file = True
        self.cost_notes: list[str] = []  # what became of cached costs (for the run's notes)
        self.target_ctx: Context | None = None
        self.draft_ctx: Context | None = None
        self.draft: Model | None = None
        self.draft_label: str | None = None
        self.configure(options.target_ctx, options.draft_ctx or options.target_ctx,
                       next(iter(self.drafts), None))
        # files the user named and earlier answers: what auto drafts from besides the prompt
        self.library = Library(self._history_store() if options.history else None)

    def _history_store(self) -> HistoryStore:
        from tandem.models.store import tandem_home

        return HistoryStore(tandem_home(), self.target_path, n_vocab=self.target.n_vocab)

    def add_context_file(self, path: str | Path, text: str | None = None) -> int:
        """Index a text file for drafting (--context-file, chat /add); its token count.
        `text`: the file's content when the caller has read (and checked) it already."""
        if text is None:
            text = read_context_file(Path(path))
        tokens = self.target.tokenize(text, add_special=False, parse_special=False)
        self.library.add_file(Path(path).name, tokens)
        return len(tokens)

    @property
    def draft_path(self) -> Path | None:
        return self.draft_paths.get(self.draft_label) if self.draft_label else None

    def configure(self, target_ctx: ContextParams | None = None,
                  draft_ctx: ContextParams | None = None, draft: str | None = None) -> None:
        """Make these context settings and this draft model the active ones."""
        target_ctx = target_ctx or self.target_ctx.params
        if draft is not None and draft not in self.drafts:
            raise UsageError(f"no draft model {draft!r} in this session",
                             f"loaded drafts: {', '.join(self.drafts) or 'none'}")
        self.target_ctx = self._context("target", self.target, target_ctx)
        self.draft_label = draft or self.draft_label
        if self.draft_label is not None:
            self.draft = self.drafts[self.draft_label]
            params = draft_ctx or (self.draft_ctx.params if self.draft_ctx else target_ctx)
            self.draft_ctx = self._context(self.draft_label, self.draft, params)

    def _context(self, owner: str, model: Model, params: ContextParams) -> Context:
        key = (owner, params)
        ctx = self._contexts.pop(key, None)
        if ctx is None:
            mine = [k for k in self._contexts if k[0] == owner]
            for old in mine[:max(0, len(mine) - self.MAX_CONTEXTS + 1)]:
                if self._contexts[old] not in (self.target_ctx, self.draft_ctx):
                    self._contexts.pop(old).close()
            ctx = Context(model, params)
        self._contexts[key] = ctx  # re-inserted: most recently used last
        return ctx

    def close(self) -> None:
        for ctx in self._contexts.values():
            ctx.close()
        self._contexts.clear()
        for model in list(self.drafts.values()) + [self.target]:
            model.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def drafter(self, strategy: str | None = None, draft: DraftParams | None = None) -> Drafter:
        strategy = strategy or self.options.strategy
        draft = draft or self.options.draft
        if strategy not in STRATEGIES:
            raise UsageError(f"unknown strategy {strategy!r}",
                             f"choose one of: {', '.join(STRATEGIES)}")
        if strategy == "none":
            return NoDrafter()
        if strategy == "ngram":
            return NgramDrafter(draft.n_max)
        model = None
        if self.draft_ctx is not None:
            model = DraftModelDrafter(self.draft_ctx, draft.n_max, draft.n_min, draft.p_min)
        if strategy == "draft":
            if model is None:
                raise UsageError("strategy 'draft' needs a draft model",
                                 "pass --model-draft PATH, or use --strategy ngram")
            return model
        if strategy == "hybrid":
            return HybridDrafter(model, n_min=draft.n_min, n_max=draft.n_max)
        costs, calibrated = self.costs(), self.costs(calibrated=True)
        notes, self.cost_notes = self.cost_notes, []  # said once, on the request that found it
        return AutoDrafter(model, costs, n_min=draft.n_min, n_max=draft.n_max,
                           verify_limit=self.target_ctx.verify_limit, calibrated=calibrated,
                           notes=notes, library=self.library,
                           knowledge=self.knowledge())

    def _costs_key(self) -> tuple:
        return (self.target_ctx.params, self.draft_label,
                self.draft_ctx.params if self.draft_ctx else None)

    def knowledge(self) -> Knowledge:
        """What earlier requests of the active configuration learnt: this session's, else
        the file beside the cost cache (ignored when stale, of another version or invalid)."""
        key = self._costs_key()
        if key not in self._knowledge:
            kept = (Knowledge.load(self._knowledge_path(), ORDER, BUCKETS)
                    if self.knowledge_file else None)
            self._knowledge[key] = kept if kept is not None else Knowledge()
        return self._knowledge[key]

    def _knowledge_path(self) -> Path:
        path = self._costs_path()
        return path.with_name(path.stem + ".knowledge.json")

    def _learn(self, drafter) -> None:
        """Keep what an auto request measured, in the session and on disk."""
        if not isinstance(drafter, AutoDrafter):
            return
        knowledge = self.knowledge()
        drafter.learnt(knowledge)
        if not self.knowledge_file:
            return
        try:
            knowledge.save(self._knowledge_path())
        except OSError:
            pass  # a read-only home: the next process starts from the priors again

    def costs(self, calibrated: bool = False) -> CostModel:
        """The active configuration's cost model on this machine: cached, else calibrated
        once (a few seconds). A cached model is used only if it is recent and agrees with a
        quick measurement taken now (a busy machine once poisoned every later run); a new
        calibration is saved only if the machine was quiet while it ran. Steps refine it
        during the session (never saved: a refined curve mixes contexts of every length);
        `calibrated=True` gives the calibration itself, whose figures were all measured under
        the same conditions."""
        key = self._costs_key()
        if key not in self._costs:
            path = self._costs_path()
            probe = self.target.tokenize("def main():\n    print('calibrating')\n",
                                         add_special=False, parse_special=False)
            cached = CostModel.load(path)
            if cached is not None and (not cached.plausible() or cached.expired()):
                cached = None
            # measured after what the caches hold: prefilling the probe replaced a chat's
            # conversation, whose next turn then evaluated it all again (40 s on 3,500 tokens)
            target, draft = _after_cache(self.target_ctx), _after_cache(self.draft_ctx)
            if cached is not None:
                off = check_cached_costs(target, cached, probe)
                if not 1 / DISAGREE <= off <= DISAGREE:
                    self.cost_notes.append(f"cached costs were {off:.2f}x this machine's "
                                           "timings now: measured again")
                    cached = None
            if cached is None:
                cached = calibrate(target, draft, probe)
                if self.options.rpc:  # the link's round trips are in every figure
                    cached.source = f"measured over RPC {','.join(self.options.rpc)}"
                if cached.busy is not None and cached.busy > BUSY_SHARE:
                    self.cost_notes.append(
                        f"machine busy while calibrating (other processes used "
                        f"{cached.busy:.0%} of the CPU): costs used for this session only, "
                        "not saved")
                else:
                    try:
                        cached.save(path)
                    except OSError:
                        pass  # a read-only home only costs a recalibration next time
            self._calibrated[key] = cached
            self._costs[key] = cached.copy()
        return (self._calibrated if calibrated else self._costs)[key]

    def _costs_path(self) -> Path:
        import hashlib
        import platform

        from tandem.models.store import tandem_home

        parts = [platform.node(), platform.machine(), repr(self.target_ctx.params),
                 str(self.options.target_gpu_layers), str(self.options.draft_gpu_layers)]
        if self.options.rpc:  # a remote target's costs are the link's, not this machine's
            parts.append("rpc=" + ",".join(self.options.rpc))
        if self.draft_ctx is not None:
            parts.append(repr(self.draft_ctx.params))
        for p in (self.target_path, self.draft_path):
            if p is not None:
                parts += [p.name, str(p.stat().st_size)]
        key = hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]
        return tandem_home() / "costs" / f"{key}.json"

    def prompt_tokens(self, messages: Sequence[dict], raw: bool = False) -> list[int]:
        text = chat_template.plain(messages) if raw else chat_template.render(self.target, messages)
        bos_text = self.target.token_text(self.target.bos) if self.target.bos >= 0 else ""
        # templates often write the BOS themselves; never add a second one
        add_bos = self.target.add_bos and not (bos_text and text.startswith(bos_text))
        tokens = self.target.tokenize(text, add_special=False, parse_special=True)
        if add_bos:
            tokens = [self.target.bos] + tokens
        return tokens

    def generate(self, prompt: Sequence[int], gen: GenParams, strategy: str | None = None,
                 draft: DraftParams | None = None, record: bool = True) -> Iterator:
        """generate() with the drafter for `strategy` built from `draft` (default: the
        session's options). Steps say which source their drafts came from (where the drafter
        knows), and each finished answer joins the library's history (`record`: unless it
        is a measurement, not an answer)."""
        drafter = self.drafter(strategy, draft)
        by_source = getattr(drafter, "step_sources", None) is not None
        inner = generate(self.target_ctx, prompt, drafter, gen)
        sources = GenStats()  # generate()'s own statistics never see the sources: counted here
        try:
            for ev in inner:
                if isinstance(ev, StepEvent) and by_source:
                    ev = replace(ev, sources=drafter.step_sources)
                    drafter.step_sources = ()
                    for source, d, a in ev.sources:
                        sources.add_source(source, d, a)
                elif isinstance(ev, DoneEvent):
                    ev.stats.by_source = sources.by_source
                    if record:
                        self.library.record(ev.tokens)
                        self._learn(drafter)
                yield ev
        finally:
            inner.close()
