"""Drafters propose tokens for the target to verify. generate() only knows this interface.

none:   plain decoding through the same loop (no drafts).
draft:  a draft model, as llama.cpp's draft-simple (fixed n_max, p_min, n_min).
ngram:  prompt lookup over the prompt and the output so far (no model).
hybrid: n-gram tokens on a long match, else the draft model (an early stop continued by n-grams).
auto:   hybrid with adaptive lengths and a measured fallback to plain (engine/drafting/auto.py).

Each drafter owns its draft length, `n_max`; generate() only says how much room a step has
(the context end, max_tokens and the verify batch the target may decode).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol, Sequence

import numpy as np

from tandem.engine.drafting.adaptive import AcceptanceTracker, FallbackGuard, LengthController, ProbeBudget
from tandem.engine.tuning.costs import DISAGREE, CostModel
from tandem.engine.loop.events import StepEvent
from tandem.engine.drafting.ngram import NgramIndex
from tandem.engine.loop.sampling import Dist, SamplingParams, distribution, draft_top, greedy_token

if TYPE_CHECKING:
    from tandem.engine.backend.llama import Context


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

    def observe(self, step: StepEvent) -> None:
        """Feedback after verification: what was drafted, accepted, and what it cost."""
        ...


class NoDrafter:
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


def recent(tokens: Sequence[int], extra: Sequence[int], sampling: SamplingParams) -> list[int]:
    """The history the repetition penalty looks at (empty when the penalty is off)."""
    if sampling.repeat_penalty == 1.0:
        return []
    n = sampling.repeat_last_n if sampling.repeat_last_n > 0 else len(tokens) + len(extra)
    return (list(tokens[-n:]) + list(extra))[-n:]


class DraftModelDrafter:
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
    notes: Sequence[str] = ()
    step_sources: StepSources = ()

    def __init__(self, ctx: Context, n_max: int = 4, n_min: int = 0, p_min: float = 0.0):
        self.ctx = ctx
        self.n_max = n_max
        self.n_min = n_min
        self.p_min = p_min
        # the latest propose(): catch-up tokens re-read by sync() and its time, then the
        # draft tokens decoded one by one and their time (the draft-token cost)
        self.last_sync_tokens = 0
        self.last_sync_s = 0.0
        self.last_decodes = 0
        self.last_decode_s = 0.0

    def propose(self, tokens, room, sampling, rng, sample) -> Draft:
        return self.draft(tokens, min(self.n_max, room), sampling, rng, sample)

    def draft(self, tokens, k, sampling, rng, sample) -> Draft:
        """Up to k tokens, whatever n_max says: a HybridDrafter chooses k by its own policy."""
        self.last_sync_tokens, self.last_sync_s, self.last_decodes, self.last_decode_s = 0, 0.0, 0, 0.0
        # the draft evaluates tokens + d1..d(k-1), all of which must fit its context
        k = min(k, self.ctx.n_ctx - len(tokens) + 1)
        if k <= 0 or k < self.n_min:
            return Draft()
        t0 = time.perf_counter()
        self.last_sync_tokens = self.ctx.prefill(tokens[:-1])
        t1 = time.perf_counter()
        # the last token is always re-evaluated (a past decode's logits are gone): a draft decode
        logits = self.ctx.decode(tokens[-1:], checkpoint=k > 1)[0]  # single-token steps follow
        self.last_decodes = 1
        out: list[int] = []
        dists: list[Dist | None] | None = [] if sample else None
        while True:
            hist = recent(tokens, out, sampling)
            if sample:
                q = distribution(logits, hist, sampling)
                if self.p_min > 0.0 and len(out) >= self.n_min and q.top < self.p_min:
                    break
                tok = q.sample(rng)
                dists.append(q)
            elif self.p_min > 0.0:
                tok, p = draft_top(logits, hist, sampling)
                if p < self.p_min:
                    break
            else:
                tok = greedy_token(logits, hist, sampling)
            out.append(tok)
            if len(out) >= k:
                break
            logits = self.ctx.decode([tok])[0]
            self.last_decodes += 1
        self.last_sync_s = t1 - t0
        self.last_decode_s = time.perf_counter() - t1
        if len(out) < self.n_min:  # greedy only: a sampled draft is never shorter than n_min
            return Draft()
        return Draft(out, dists, n_model=len(out))

    def prefill(self, prompt: Sequence[int]) -> None:
        # propose() re-evaluates the last token for its logits; everything before it goes now.
        # A prompt the draft's context cannot hold is not an error: propose() then drafts nothing
        if len(prompt) <= self.ctx.n_ctx:
            self.ctx.prefill(prompt[:-1])

    def observe(self, step: StepEvent) -> None:
        pass


class NgramDrafter:
    """Prompt lookup: the continuation of the latest earlier occurrence of the last n tokens,
    for n in `sizes` (longest first)."""

    name = "ngram"
    notes: Sequence[str] = ()
    step_sources: StepSources = ()

    def __init__(self, n_max: int = 4, sizes: tuple[int, int] = (2, 4), min_match: int = 2):
        self.n_max = n_max
        self.index = NgramIndex(*sizes)
        self.min_match = min_match

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
        pass


class ZeroCostSources(Protocol):
    """The drafts a HybridDrafter tries before its draft model: tokens that cost no model
    time (the hybrid's n-grams: NgramSources; auto's suffix indexes: AutoDrafter)."""

    def read_prompt(self, prompt: Sequence[int]) -> None: ...

    def pick(self, tokens: Sequence[int], k: int) -> tuple[list[int], str,
                                                          LengthController | None]:
        """Up to k tokens to follow `tokens`, their source, and the length controller that
        chose them (fed back after the step); no tokens: the draft model drafts."""

    def continue_draft(self, tokens: Sequence[int], drafted: list[int],
                       k: int) -> tuple[list[int], int]:
        """Up to k tokens after a model draft that stopped early, and their match length."""

    def split(self, draft: Draft, step: StepEvent) -> StepSources:
        """The step's drafts by source; () where they are not told apart."""


class NgramSources:
    """Prompt lookup over n-grams of 2..ngram_n tokens; with `adaptive`, a length controller
    per match length (a 4-token match predicts far better than a 2-token one)."""

    def __init__(self, costs: CostModel, n_max: int, budget: ProbeBudget | None,
                 min_match: int, ngram_n: int, adaptive: bool):
        self.min_match, self.adaptive = min_match, adaptive
        self.ngram = NgramDrafter(n_max, (min(2, ngram_n), ngram_n), min_match=1)
        # n-gram drafts cost no model time, so their probes are cheap: probe often
        self.lengths = {
            n: LengthController(costs, 1, n_max, False, probe_every=4, probe_len=1,
                                max_probe_every=32,
                                tracker=AcceptanceTracker(n_max, prior=0.6), budget=budget)
            for n in range(min(min_match, ngram_n), ngram_n + 1)}

    def read_prompt(self, prompt: Sequence[int]) -> None:
        self.ngram.prefill(prompt)

    def pick(self, tokens, k):
        idx = self.ngram.index
        idx.sync(tokens)
        cont, match = idx.lookup(k)
        if match < self.min_match or not cont:
            return [], "prompt", None
        if not self.adaptive:
            return cont, "prompt", None
        ctl = self.lengths[min(match, idx.n_max)]
        return cont[:ctl.choose(len(cont))], "prompt", ctl

    def continue_draft(self, tokens, drafted, k):
        # the index follows `tokens` already: pick() synced it
        return self.ngram.index.lookup(k, extra=drafted)

    def split(self, draft: Draft, step: StepEvent) -> StepSources:
        return ()


class HybridDrafter:
    """Zero-cost tokens (`sources`; by default n-grams with a match of at least
    `ngram_match` tokens) when they match, the draft model otherwise; when the model stops
    early (p_min), zero-cost tokens continue its draft.

    `n_max` is the draft model's longest draft and `ngram_cap` the n-gram source's (at least
    n_max: n-gram drafts cost no draft time); the attribute `n_max`, the longest draft of
    either, is what generate() reads.

    With `adaptive`, each source's draft length is chosen per step from its measured
    acceptance and this machine's costs (see adaptive.py), paid from `budget` when it probes.
    With `guard`, speculation that measures slower than plain decoding on this request is
    switched off for a while.
    """

    def __init__(self, model: DraftModelDrafter | None, ngram_match: int = 3,
                 costs: CostModel | None = None, n_min: int = 0, n_max: int = 8,
                 adaptive: bool = False, guard: bool = False, name: str = "hybrid",
                 ngram_cap: int | None = None, ngram_n: int = 4,
                 sources: ZeroCostSources | None = None, budget: ProbeBudget | None = None):
        self.name = name
        self.model = model
        self.model_max = n_max
        self.n_max = max(n_max, ngram_cap or n_max)
        self.ngram_match = ngram_match
        self.costs = costs or CostModel()
        self.adaptive = adaptive
        # what speculation cost this request against plain decoding: probes are paid from it
        self.budget = budget if budget is not None else ProbeBudget() if adaptive else None
        self.model_len = LengthController(self.costs, n_min, n_max, True,
                                          tracker=AcceptanceTracker(max(n_max, 1)),
                                          budget=self.budget)
        self.ngram_len: dict[int, LengthController] = {}  # the default n-grams' controllers
        if sources is None:
            sources = NgramSources(self.costs, self.n_max, self.budget, ngram_match, ngram_n,
                                   adaptive)
            self.ngram_len = sources.lengths
        self.sources = sources
        self.step_sources: StepSources = ()  # the latest step's, as the sources tell them
        self.guard = FallbackGuard() if guard else None
        self.notes: list[str] = []  # decisions a report may show (e.g. why the model is off)
        # the request's own first verify timings (batch size, seconds) against the cost
        # model's: far apart, the verify curve is rebuilt from them (see _check_costs)
        self._check: list[tuple[int, float]] | None = [] if adaptive else None
        self._reference: CostModel | None = None
        self._new_step()

    def _new_step(self) -> None:
        """Forget the latest draft: before each propose(), and after its step is observed
        (generate() skips propose() when no draft fits: that step must not look like this one)."""
        self._last: Draft = Draft()
        self._last_ngram: LengthController | None = None  # chose the zero-cost tokens
        self._model_ran = False  # the draft model was run in the latest propose()
        self._probe = False  # the latest draft was a probe (chosen to measure, not to gain)

    @property
    def probing(self) -> bool:
        """The latest draft was a probe."""
        return self._probe

    def prefill(self, prompt: Sequence[int]) -> None:
        self.sources.read_prompt(prompt)
        if self.model is not None:
            self.model.prefill(prompt)

    def propose(self, tokens, room, sampling, rng, sample) -> Draft:
        self._new_step()
        k = min(room, self.n_max)
        if k <= 0 or (self.guard is not None and self.guard.want_plain()):
            return self._last
        cont, source, ctl = self.sources.pick(tokens, k)
        if ctl is not None:
            self._last_ngram, self._probe = ctl, ctl.last_was_probe
        if cont:
            self._last = Draft(cont, [None] * len(cont) if sample else None, n_model=0,
                               source=source)
            return self._last
        return self.model_draft(tokens, room, sampling, rng, sample)

    def model_draft(self, tokens, room, sampling, rng, sample) -> Draft:
        """The draft model's draft (adaptive length), continued with zero-cost tokens
        (continue_draft) when the model stops early."""
        if self.model is None:
            return self._last
        k = self.model_len.choose(room) if self.adaptive else min(room, self.model_max)
        self._probe = self.adaptive and self.model_len.last_was_probe
        if k <= 0:
            return self._last
        # a probe after a plain stretch first re-reads the lagged tokens in one batch; that
        # catch-up is timed apart (model.last_sync_s) and never priced as draft tokens
        draft = self.model.draft(tokens, k, sampling, rng, sample)
        self._model_ran = True
        if draft.tokens and len(draft.tokens) < k:
            extra, match = self.sources.continue_draft(tokens, draft.tokens,
                                                        k - len(draft.tokens))
            if extra and match >= self.ngram_match:
                draft = Draft(draft.tokens + extra,
                              (draft.dists or []) + [None] * len(extra) if sample else None,
                              n_model=len(draft.tokens))
        self._last = draft
        return draft

    def observe(self, step: StepEvent) -> None:
        d = self._last
        batch, produced = step.drafted + 1, step.accepted + 1  # forced tokens included
        if step.forced:  # the grammar's tokens went first: only the rest were this drafter's
            step = replace(step, drafted=step.drafted - step.forced,
                           accepted=max(step.accepted - step.forced, 0), forced=0)
        self.step_sources = self.sources.split(d, step)
        self._check_costs(batch, step.t_verify)
        self.costs.observe_verify(batch, step.t_verify)
        model_ran = self._model_ran and self.model is not None
        if model_ran and self.model.last_decodes:
            self.costs.observe_draft(self.model.last_decodes, self.model.last_decode_s)
        n_model = min(d.n_model, step.drafted)
        if n_model:
            self.model_len.feedback(n_model, min(step.accepted, n_model))
        n_ng = step.drafted - n_model
        if n_ng and step.accepted >= n_model and self._last_ngram is not None:
            self._last_ngram.feedback(n_ng, step.accepted - n_model)
        seconds = step.t_draft + step.t_verify + step.t_sample
        if model_ran:
            # re-reading tokens decoded while the model was off is the price of the pause,
            # not of speculation: counted, it would make every resumption look slow
            seconds -= self.model.last_sync_s
        speculative = step.drafted > 0 or model_ran  # the model ran: its cost, drafts or not
        if self.budget is not None:
            plain = self.costs.plain
            self.budget.earn(produced, plain)
            if speculative:
                self.budget.settle(seconds, produced, plain)
        # probes are exploration the length controllers pay for knowingly; the guard judges
        # the drafts that were chosen because they were predicted to pay
        if self.guard is not None and not self._probe:
            self.guard.observe(produced, seconds, speculative=speculative)
        self._new_step()

    CHECK_STEPS = 3

    def _check_costs(self, n: int, seconds: float) -> None:
        if self._check is None or len(self._check) >= self.CHECK_STEPS or seconds <= 0:
            return
        if not self._check:  # judge against the curve as it was, not as refined since
            self._reference = CostModel(dict(self.costs.verify), self.costs.draft_token)
        self._check.append((n, seconds))
        if len(self._check) < self.CHECK_STEPS:
            return
        ref = self._reference
        ratios = sorted(t / ref.verify_cost(k) for k, t in self._check if ref.verify_cost(k) > 0)
        off = ratios[len(ratios) // 2] if ratios else 1.0
        if not 1 / DISAGREE <= off <= DISAGREE:
            # the cached curve is not this machine now: its shape cannot be trusted either (a
            # busy calibration flattens it, so long drafts look free). Start the verify curve
            # over from this request's own steps; sizes not yet seen are extrapolated from them
            self.costs.verify = {}
            for k, t in self._check[:-1]:  # the latest is observed by the caller
                self.costs.observe_verify(k, t, weight=1.0)
            self.costs.draft_token *= off
            self.notes.append(f"cached costs were {off:.2f}x this request's timings: "
                              "measured afresh")
