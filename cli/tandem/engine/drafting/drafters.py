"""Drafters propose tokens for the target to verify. generate() only knows this interface.

none:   plain decoding through the same loop (no drafts).
draft:  a draft model, as llama.cpp's draft-simple (fixed n_max, p_min, n_min).
ngram:  prompt lookup over the prompt and the output so far (no model).
hybrid: n-gram tokens on a long match, else the draft model (an early stop continued by n-grams).
auto:   hybrid with adaptive lengths and a measured fallback to plain (engine/drafting/auto.py).
mtp:    the target's own multi-token-prediction heads (engine/drafting/mtp.py).

Each drafter owns its draft length, `n_max`; generate() only says how much room a step has
(the context end, max_tokens and the verify batch the target may decode).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, Sequence

import numpy as np

from tandem.config.schema import FIELDS_BY_KEY
from tandem.engine.backend.decode_requests import Steps, run_now
from tandem.engine.loop.events import StepEvent
from tandem.engine.drafting.ngram import NgramIndex
from tandem.errors import UsageError
from tandem.engine.loop.sampling import Dist, SamplingParams, distribution, draft_top, greedy_token

if TYPE_CHECKING:
    from tandem.engine.backend.surface import DecodingSurface


@dataclass(frozen=True)
class DraftParams:
    """The draft length and its stops; the drafter built from them owns them from there
    (generate() only bounds each step by the room it has). The ranges are the settings'
    (config.schema: n_max, n_min, p_min), whoever sets them: flags, files, chat, spec-bench."""

    n_max: int = FIELDS_BY_KEY["n_max"].default
    n_min: int = FIELDS_BY_KEY["n_min"].default
    p_min: float = FIELDS_BY_KEY["p_min"].default

    def __post_init__(self):
        for key in ("n_max", "n_min", "p_min"):
            setting = FIELDS_BY_KEY[key]
            _, problem = setting.check(getattr(self, key))
            if problem:
                raise UsageError(f"{setting.label} {problem}",
                                 "llama.cpp's default is 3; 4-16 are typical"
                                 if key == "n_max" else None)
        if self.n_min > self.n_max:
            raise UsageError(f"draft min must be in 0..draft max ({self.n_max}), got {self.n_min}",
                             None)


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)
    # q for each token when it was sampled from the draft model (temperature > 0 with rejection
    # sampling); None, or a None entry, marks a deterministic token (verified as a point mass).
    dists: list[Dist | None] | None = None
    n_model: int = 0  # leading tokens that came from the draft model (the rest: n-gram)
    source: str = "prompt"  # where the tokens after the model's came from (DRAFT_SOURCES)


# (source, drafted, accepted) of one step's drafts (config.schema.DRAFT_SOURCES)
StepSources = tuple[tuple[str, int, int], ...]


class Drafter(Protocol):
    """Everything generate() and PairSession read from a drafter."""

    name: str
    n_max: int  # the longest draft this drafter proposes (0: it never drafts)
    # decisions a report may show (why the model is off, the costs used); generate() reads
    # them once the request is done
    notes: Sequence[str]
    # the latest observed step's drafts by source; () where the drafter does not tell them
    # apart (generate() puts them into the StepEvent)
    step_sources: StepSources

    def propose(self, tokens: Sequence[int], room: int, sampling: SamplingParams,
                rng: np.random.Generator, sample: bool) -> Draft:
        """Up to min(n_max, room) tokens to follow `tokens`; `sample`: draw from q instead of
        argmax."""
        ...

    def prefill(self, prompt: Sequence[int]) -> None:
        """Read the prompt while the target reads it (prompt time, as in llama.cpp)."""
        ...

    def propose_steps(self, tokens: Sequence[int], room: int, sampling: SamplingParams,
                      rng: np.random.Generator, sample: bool) -> Steps[Draft]:
        """propose() as steps (engine/backend/decode_requests.py): what generate() calls, so
        that a draft model's decodes on a slot join the engine loop's batches."""
        ...

    def prefill_steps(self, prompt: Sequence[int]) -> Steps[None]:
        """prefill() as steps."""
        ...

    def observe(self, step: StepEvent) -> None:
        """Feedback after verification: what was drafted, accepted, and what it cost."""
        ...


class Immediate:
    """The steps of a drafter that never decodes on a shared context: its propose() and
    prefill(), at once."""

    def propose_steps(self, tokens, room, sampling, rng, sample) -> Steps[Draft]:
        return self.propose(tokens, room, sampling, rng, sample)
        yield  # noqa: unreachable - makes this a generator

    def prefill_steps(self, prompt: Sequence[int]) -> Steps[None]:
        self.prefill(prompt)
        return
        yield  # noqa: unreachable - makes this a generator


class Stepped:
    """propose() and prefill() of a drafter that decodes: its steps, each decode at once
    (a caller that owns the contexts: run, chat, spec-bench, a test)."""

    def propose(self, tokens, room, sampling, rng, sample) -> Draft:
        return run_now(self.propose_steps(tokens, room, sampling, rng, sample))

    def prefill(self, prompt: Sequence[int]) -> None:
        run_now(self.prefill_steps(prompt))


class NoDrafter(Immediate):
    name = "none"
    n_max = 0
    notes: Sequence[str] = ()
    step_sources: StepSources = ()

    def propose(self, tokens, room, sampling, rng, sample) -> Draft:
        return Draft()

    def prefill(self, prompt: Sequence[int]) -> None:
        pass

    def observe(self, step: StepEvent) -> None:
        pass


def one_source(source: str, step: StepEvent) -> StepSources:
    """A step's own drafts (the grammar's forced ones aside) as one source's."""
    own = step.drafted - step.forced
    return ((source, own, min(max(step.accepted - step.forced, 0), own)),) if own > 0 else ()


def recent(tokens: Sequence[int], extra: Sequence[int], sampling: SamplingParams) -> list[int]:
    """The history the repetition penalty looks at (empty when the penalty is off)."""
    if sampling.repeat_penalty == 1.0:
        return []
    n = sampling.repeat_last_n if sampling.repeat_last_n > 0 else len(tokens) + len(extra)
    return (list(tokens[-n:]) + list(extra))[-n:]


def draft_tokens(logits: np.ndarray, step, k: int, tokens: Sequence[int],
                 sampling: SamplingParams, rng: np.random.Generator, sample: bool,
                 p_min: float, n_min: int) -> Steps[Draft]:
    """A model's draft of up to k tokens from the logits after `tokens` (`step(tok)`: steps
    returning the logits after one more token), as llama.cpp's draft-simple takes them: greedy top-1 of a
    top-10 softmax, stopping below p_min, dropped below n_min; or sampled from q with the stop
    read before drawing (the class docstring below says why)."""
    out: list[int] = []
    dists: list[Dist | None] | None = [] if sample else None
    while True:
        hist = recent(tokens, out, sampling)
        if sample:
            q = distribution(logits, hist, sampling)
            if p_min > 0.0 and len(out) >= n_min and q.top < p_min:
                break
            tok = q.sample(rng)
            dists.append(q)
        elif p_min > 0.0:
            tok, p = draft_top(logits, hist, sampling)
            if p < p_min:
                break
        else:
            tok = greedy_token(logits, hist, sampling)
        out.append(tok)
        if len(out) >= k:
            break
        logits = yield from step(tok)
    if len(out) < n_min:  # greedy only: a sampled draft is never shorter than n_min
        return Draft()
    return Draft(out, dists, n_model=len(out))


class DraftModelDrafter(Stepped):
    """llama.cpp's draft-simple: a small model drafts greedily (top-1 of a top-10 softmax),
    stopping when that token's probability is below p_min; drafts shorter than n_min are
    dropped. Its KV cache is kept across steps; only rejected positions are removed.

    When drafts are sampled (temperature > 0, rejection rule), a token that was drawn from q
    is never taken back: which tokens are proposed must not depend on the tokens drawn, or
    the proposals are no longer distributed as q and verification is biased. So the p_min
    stop reads q's top probability *before* drawing, and only from position n_min on: a
    sampled draft is at least n_min tokens long instead of being dropped when short.
    """

    name = "draft"
    label = "draft model"  # what drafts, in auto's notes
    catches_up = True  # a draft first reads what its context lacks (draft_steps' prefill)
    notes: Sequence[str] = ()
    step_sources: StepSources = ()

    def __init__(self, ctx: DecodingSurface, draft: DraftParams):
        self.ctx = ctx
        self.n_max, self.n_min, self.p_min = draft.n_max, draft.n_min, draft.p_min
        # the latest propose(): catch-up tokens re-read by sync() and its time, then the
        # draft tokens decoded one by one and their time (the draft-token cost)
        self.last_sync_tokens = 0
        self.last_sync_s = 0.0
        self.last_decodes = 0
        self.last_decode_s = 0.0

    def propose_steps(self, tokens, room, sampling, rng, sample) -> Steps[Draft]:
        return (yield from self.draft_steps(tokens, min(self.n_max, room), sampling, rng,
                                            sample))

    def draft_steps(self, tokens, k, sampling, rng, sample) -> Steps[Draft]:
        """Up to k tokens, whatever n_max says: a HybridDrafter chooses k by its own policy."""
        self.last_sync_tokens, self.last_sync_s, self.last_decodes, self.last_decode_s = 0, 0.0, 0, 0.0
        # the draft evaluates tokens + d1..d(k-1), all of which must fit its context
        k = min(k, self.ctx.n_ctx - len(tokens) + 1)
        if k <= 0 or k < self.n_min:
            return Draft()
        t0 = time.perf_counter()
        self.last_sync_tokens = yield from self.ctx.prefill_steps(tokens[:-1])
        t1 = time.perf_counter()
        # the last token is always re-evaluated (a past decode's logits are gone): a draft decode
        # (single-token steps follow: a copy to go back to)
        logits = (yield from self.ctx.decode_steps(tokens[-1:], checkpoint=k > 1))[0]

        def step(tok: int) -> Steps[np.ndarray]:
            self.last_decodes += 1
            return (yield from self.ctx.decode_steps([tok]))[0]

        self.last_decodes = 1
        draft = yield from draft_tokens(logits, step, k, tokens, sampling, rng, sample,
                                        self.p_min, self.n_min)
        self.last_sync_s = t1 - t0
        self.last_decode_s = time.perf_counter() - t1
        return draft

    def draft(self, tokens, k, sampling, rng, sample) -> Draft:
        return run_now(self.draft_steps(tokens, k, sampling, rng, sample))

    def prefill_steps(self, prompt: Sequence[int]) -> Steps[None]:
        # propose() re-evaluates the last token for its logits; everything before it goes now.
        # A prompt the draft's context cannot hold is not an error: propose() then drafts nothing
        if len(prompt) <= self.ctx.n_ctx:
            yield from self.ctx.prefill_steps(prompt[:-1])

    def observe(self, step: StepEvent) -> None:
        self.step_sources = one_source("model", step)


class NgramDrafter(Immediate):
    """Prompt lookup: the continuation of the latest earlier occurrence of the last n tokens,
    for n in SIZES (longest first), taken on a match of at least MIN_MATCH tokens."""

    name = "ngram"
    notes: Sequence[str] = ()
    step_sources: StepSources = ()
    SIZES = (2, 4)
    MIN_MATCH = 2

    def __init__(self, draft: DraftParams):
        self.n_max = draft.n_max
        self.index = NgramIndex(*self.SIZES)
        self.min_match = self.MIN_MATCH

    def propose(self, tokens, room, sampling, rng, sample) -> Draft:
        k = min(self.n_max, room)
        if k <= 0:
            return Draft()
        self.index.sync(tokens)
        cont, match = self.index.lookup(k)
        return Draft(cont) if match >= self.min_match else Draft()

    def prefill(self, prompt: Sequence[int]) -> None:
        self.index.sync(prompt)

    def observe(self, step: StepEvent) -> None:
        self.step_sources = one_source("prompt", step)
