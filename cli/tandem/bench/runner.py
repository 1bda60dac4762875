"""Run configurations over prompts, interleaved, through the same generate() users run."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Iterator, Sequence

from tandem.bench.accounting import tandem_counts
from tandem.bench.structured_workload import check
from tandem.bench.workloads import Prompt
from tandem.engine.loop.events import DoneEvent
from tandem.engine.backend.context_params import ContextParams
from tandem.engine.drafting.drafters import DraftParams
from tandem.engine.loop.speculative import GenParams
from tandem.machine.load import LoadMeter


@dataclass(frozen=True)
class BenchConfig:
    name: str
    strategy: str
    draft: DraftParams = DraftParams()
    draft_model: str | None = None  # a draft label of the session (None: the session's first)
    target_ctx: ContextParams | None = None  # None: the session's own settings
    draft_ctx: ContextParams | None = None

    @property
    def is_plain(self) -> bool:
        return self.strategy == "none"

    def to_dict(self) -> dict:
        out = {"name": self.name, "strategy": self.strategy, **asdict(self.draft),
               "draft_model": self.draft_model}
        for key in ("target_ctx", "draft_ctx"):
            value = getattr(self, key)
            out[key] = asdict(value) if value is not None else None
        return out


@dataclass
class RunResult:
    config: str
    prompt_id: str
    category: str
    rep: int
    n_generated: int
    # decode tok/s with end-of-text counted as llama-server counts it (bench/accounting.py);
    # tokens_per_second_own below is GenStats' own figure, which leaves it out
    tokens_per_second: float
    t_decode: float
    drafted: int
    accepted: int
    n_steps: int
    n_steps_drafted: int
    drafted_at: list[int]
    accepted_at: list[int]
    t_draft: float
    t_verify: float
    t_sample: float
    reason: str
    tokens: list[int] = field(repr=False, default_factory=list)
    text: str = field(repr=False, default="")
    notes: list[str] = field(default_factory=list)  # the drafter's decisions (GenStats.notes)
    # where greedy output first left plain decoding's: {"at", "plain", "other", "gap"} with the
    # target's logit gap between the two tokens there (see classify_divergences)
    divergence: dict | None = None
    tokens_per_second_own: float = 0.0
    t_prefill: float = 0.0
    t_e2e: float = 0.0  # prompt + decode
    step_s: float = 0.0  # decode time per decode step
    n_prompt_eval: int = 0  # prompt tokens evaluated (the rest came from the KV cache)
    busy: float | None = None  # share of the CPU other processes took during it (None: unknown)
    # under a constraint: whether the output validates (bench/structured_workload.py), why not
    valid: bool | None = None
    invalid: str = ""

    @classmethod
    def from_done(cls, config: str, prompt: Prompt, rep: int, done: DoneEvent,
                  busy: float | None = None) -> "RunResult":
        s = done.stats
        c = tandem_counts(s.n_generated, done.reason == "eos", s.n_steps, s.t_prefill,
                          s.t_decode)
        return cls(config, prompt.id, prompt.category, rep, s.n_generated, c.tokens_per_second,
                   s.t_decode, s.drafted, s.accepted, s.n_steps, s.n_steps_drafted,
                   list(s.drafted_at), list(s.accepted_at), s.t_draft, s.t_verify, s.t_sample,
                   done.reason, list(done.tokens), done.text, list(s.notes),
                   tokens_per_second_own=s.tokens_per_second, t_prefill=s.t_prefill,
                   t_e2e=c.t_e2e, step_s=c.step_s, n_prompt_eval=s.n_prompt_eval, busy=busy)


@dataclass(frozen=True)
class BenchProgress:
    done: int
    total: int
    result: RunResult | None  # None for warm-up runs


def plan(prompts: Sequence[Prompt], configs: Sequence[BenchConfig], reps: int):
    """(rep, prompt, config) in an order that rotates configs per prompt and rep, so that
    machine drift (thermal, other load) hits every configuration alike."""
    order = []
    for rep in range(reps):
        for i, prompt in enumerate(prompts):
            shift = (i + rep) % len(configs)
            for config in list(configs[shift:]) + list(configs[:shift]):
                order.append((rep, prompt, config))
    return order


def run_bench(session, prompts: Sequence[Prompt], configs: Sequence[BenchConfig],
              gen: GenParams, reps: int = 1, warmup: bool = True,
              should_stop: Callable[[], bool] | None = None) -> Iterator[BenchProgress]:
    """Yield a BenchProgress after each run. Stops early (partial results) on should_stop()."""
    order = plan(prompts, configs, reps)
    total = len(order)
    tokens_cache: dict[str, list[int]] = {}

    def prompt_tokens(p: Prompt) -> list[int]:
        if p.id not in tokens_cache:
            tokens_cache[p.id] = tokens_of(session, p)
        return tokens_cache[p.id]

    if warmup and prompts:
        # pages the weights in and settles caches; not recorded
        _run_one(session, prompt_tokens(prompts[0]), configs[0],
                 GenParams(**{**asdict_gen(gen_for(gen, prompts[0])),
                              "max_tokens": min(gen.max_tokens, 16)}))
        yield BenchProgress(0, total, None)
    for n, (rep, prompt, config) in enumerate(order, 1):
        if should_stop is not None and should_stop():
            return
        # cold: every run evaluates its whole prompt, as `tandem run` does, so that end-to-end
        # times compare the same work (the previous configuration left this prompt cached)
        mine = gen_for(gen, prompt)
        done, busy = measured_run(session, prompt_tokens(prompt), config, mine, cold=True)
        result = RunResult.from_done(config.name, prompt, rep, done, busy)
        result.valid, result.invalid = check(prompt.structure, mine.constraint, done.text,
                                             done.complete, done.reason)
        yield BenchProgress(n, total, result)


def tokens_of(session, p: Prompt) -> list[int]:
    """A prompt's tokens as a single user message (with its system prompt, and a structured
    task's tools rendered by the chat template)."""
    msgs = ([{"role": "system", "content": p.system}] if p.system else []) + [
        {"role": "user", "content": p.text}]
    tools = p.structure.template_tools() if p.structure is not None else None
    return session.prompt_tokens(msgs, tools=tools) if tools else session.prompt_tokens(msgs)


def gen_for(gen: GenParams, p: Prompt) -> GenParams:
    """The generation parameters of one prompt: a structured task's own constraint."""
    return gen if p.structure is None else replace(gen, constraint=p.structure.constraint())


def classify_divergences(session, prompts: Sequence[Prompt], configs: Sequence[BenchConfig],
                         results: Sequence[RunResult],
                         turn_tokens: Callable[[str], list[int]] | None = None) -> int:
    """For each greedy run whose tokens differ from plain decoding's on the same prompt and
    rep: the target's logits at the first differing position, computed as plain decoding
    computes them (one token at a time, in that run's context configuration), and the gap
    between plain's token and the other. A small gap is a near tie that batched kernels may
    round the other way (fast mode); a large one is a bug. Returns how many were measured.
    `turn_tokens(prompt_id)`: the prompt's tokens where they are not a single user message (a
    conversation's turn)."""
    import numpy as np

    by_config = {c.name: c for c in configs}
    plain_name = next((c.name for c in configs if c.is_plain), None)
    plain = {(r.prompt_id, r.rep): r for r in results if r.config == plain_name}
    texts = {p.id: p for p in prompts}
    n = 0
    for r in results:
        base = plain.get((r.prompt_id, r.rep))
        if r.config == plain_name or base is None or (
                turn_tokens is None and r.prompt_id not in texts):
            continue
        at = first_difference(base.tokens, r.tokens)
        if at is None or at >= min(len(base.tokens), len(r.tokens)):
            continue  # identical, or one is a prefix of the other (an EOS decision)
        if turn_tokens is not None:
            prompt = turn_tokens(r.prompt_id)
        else:
            prompt = tokens_of(session, texts[r.prompt_id])
        config = by_config[r.config]
        session.configure(config.target_ctx or session.options.target_ctx)
        logits = np.array(session.target_ctx.sync(prompt + base.tokens[:at]))
        a, b = base.tokens[at], r.tokens[at]
        r.divergence = {"at": at, "plain": a, "other": b, "gap": float(logits[a] - logits[b])}
        n += 1
    return n


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where two token lists differ (a prefix differs at its end); None if equal."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), None if len(a) == len(b) else n)


def asdict_gen(gen: GenParams) -> dict:
    return {f: getattr(gen, f) for f in gen.__dataclass_fields__}


def measured_run(session, tokens: list[int], config: BenchConfig, gen: GenParams,
                 cold: bool = False) -> tuple[DoneEvent, float | None]:
    """One recorded run and the share of the CPU other processes took meanwhile (a ratio
    measured on a busy machine is marked busy in the report)."""
    load = LoadMeter().start()
    done = _run_one(session, tokens, config, gen, cold)
    return done, load.share()


def _run_one(session, tokens: list[int], config: BenchConfig, gen: GenParams,
             cold: bool = False) -> DoneEvent:
    session.configure(config.target_ctx or session.options.target_ctx,
                      config.draft_ctx or session.options.draft_ctx or config.target_ctx
                      or session.options.target_ctx, config.draft_model)
    if cold:
        for ctx in (getattr(session, "target_ctx", None), getattr(session, "draft_ctx", None)):
            if ctx is not None:
                ctx.truncate(0)
    done = None
    for ev in session.generate(tokens, gen, strategy=config.strategy, draft=config.draft):
        if isinstance(ev, DoneEvent):
            done = ev
    return done


