"""Drafters propose tokens for the target to verify. generate() only knows this interface.

none:   plain decoding through the same loop (no drafts).
draft:  a draft model, as llama.cpp's draft-simple (fixed n_max, p_min, n_min).
ngram:  prompt lookup over the prompt and the output so far (no model).
hybrid: n-gram tokens when a long match exists, the draft model otherwise; a draft-model
        draft that stops early is continued with n-gram tokens.
auto:   hybrid with adaptive draft lengths and a measured fallback to plain decoding.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

import numpy as np

from tandem.engine.adaptive import AcceptanceTracker, FallbackGuard, LengthController
from tandem.engine.costs import CostModel
from tandem.engine.events import StepEvent
from tandem.engine.llama import Context
from tandem.engine.ngram import NgramIndex
from tandem.engine.sampling import Dist, SamplingParams, distribution, draft_top, greedy_token


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)
    # q for each token when it was sampled from the draft model (temperature > 0 with rejection
    # sampling); None, or a None entry, marks a deterministic token (verified as a point mass).
    dists: list[Dist | None] | None = None
    n_model: int = 0  # leading tokens that came from the draft model (the rest: n-gram)


class Drafter(Protocol):
    name: str

    def propose(self, tokens: Sequence[int], n_max: int, sampling: SamplingParams,
                rng: np.random.Generator, sample: bool) -> Draft:
        """Up to n_max tokens to follow `tokens`; `sample`: draw from q instead of argmax."""
        ...

    def prefill(self, prompt: Sequence[int]) -> None:
        """Read the prompt while the target reads it (prompt time, as in llama.cpp)."""
        ...

    def observe(self, step: StepEvent) -> None:
        """Feedback after verification: what was drafted, accepted, and what it cost."""
        ...


class NoDrafter:
    name = "none"

    def propose(self, tokens, n_max, sampling, rng, sample) -> Draft:
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
    dropped. Its KV cache is kept across steps; only rejected positions are removed."""

    name = "draft"

    def __init__(self, ctx: Context, n_min: int = 0, p_min: float = 0.0):
        self.ctx = ctx
        self.n_min = n_min
        self.p_min = p_min

    def propose(self, tokens, n_max, sampling, rng, sample) -> Draft:
        # the draft evaluates tokens + d1..d(k-1), all of which must fit its context
        n_max = min(n_max, self.ctx.n_ctx - len(tokens) + 1)
        if n_max <= 0 or n_max < self.n_min:
            return Draft()
        logits = self.ctx.sync(tokens)
        out: list[int] = []
        dists: list[Dist | None] | None = [] if sample else None
        while True:
            hist = recent(tokens, out, sampling)
            if sample:
                q = distribution(logits, hist, sampling)
                tok = q.sample(rng)
                if self.p_min > 0.0 and q.prob(tok) < self.p_min:
                    break
                dists.append(q)
            elif self.p_min > 0.0:
                tok, p = draft_top(logits, hist, sampling)
                if p < self.p_min:
                    break
            else:
                tok = greedy_token(logits, hist, sampling)
            out.append(tok)
            if len(out) >= n_max:
                break
            logits = self.ctx.decode([tok])[0]
        if len(out) < self.n_min:
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
    """Prompt lookup: the continuation of the latest earlier occurrence of the last n tokens."""

    name = "ngram"

    def __init__(self, n_min: int = 2, n_max: int = 4, min_match: int = 2):
        self.index = NgramIndex(n_min, n_max)
        self.min_match = min_match

    def propose(self, tokens, n_max, sampling, rng, sample) -> Draft:
        if n_max <= 0:
            return Draft()
        self.index.sync(tokens)
        cont, match = self.index.lookup(n_max)
        return Draft(cont) if match >= self.min_match else Draft()

    def prefill(self, prompt: Sequence[int]) -> None:
        self.index.sync(prompt)

    def observe(self, step: StepEvent) -> None:
        pass


class HybridDrafter:
    """n-gram tokens when a match of at least `ngram_match` tokens exists, the draft model
    otherwise; when the model stops early (p_min), n-gram tokens continue its draft.

    With `adaptive`, each source's draft length is chosen per step from its measured
    acceptance and this machine's costs (see adaptive.py); n-gram acceptance is tracked per
    match length, since a 4-token match predicts far better than a 2-token one. With `guard`,
    speculation that measures slower than plain decoding on this request is switched off for
    a while.
    """

    name = "hybrid"

    def __init__(self, model: DraftModelDrafter | None, ngram_match: int = 3,
                 costs: CostModel | None = None, n_min: int = 0, n_max: int = 8,
                 adaptive: bool = False, guard: bool = False, name: str = "hybrid",
                 ngram_cap: int | None = None, ngram_n: int = 4):
        self.name = name
        self.model = model
        self.ngram = NgramDrafter(min(2, ngram_n), ngram_n, min_match=1)
        self.ngram_match = ngram_match
        self.max_probe_lag = 8
        self.costs = costs or CostModel()
        self.adaptive = adaptive
        self.n_max = n_max
        # n-gram drafts may be longer than the model's: they cost no draft time
        self.ngram_cap = max(n_max, ngram_cap or n_max)
        self.model_len = LengthController(self.costs, n_min, n_max, True,
                                          tracker=AcceptanceTracker(max(n_max, 1)))
        # n-gram drafts cost no model time, so their probes are cheap: probe often
        self.ngram_len = {
            n: LengthController(self.costs, 1, self.ngram_cap, False, probe_every=4,
                                probe_len=1, max_probe_every=32,
                                tracker=AcceptanceTracker(self.ngram_cap, prior=0.6))
            for n in range(min(ngram_match, ngram_n), ngram_n + 1)}
        self.guard = FallbackGuard() if guard else None
        self.notes: list[str] = []  # decisions a report may show (e.g. why the model is off)
        self._last: Draft = Draft()
        self._last_ngram: LengthController | None = None
        self._last_model_decodes = 0

    def prefill(self, prompt: Sequence[int]) -> None:
        self.ngram.prefill(prompt)
        if self.model is not None:
            self.model.prefill(prompt)

    def propose(self, tokens, n_max, sampling, rng, sample) -> Draft:
        self._last, self._last_ngram, self._last_model_decodes = Draft(), None, 0
        if n_max <= 0 or (self.guard is not None and self.guard.want_plain()):
            return self._last
        idx = self.ngram.index
        idx.sync(tokens)
        cont, match = idx.lookup(min(n_max, self.ngram_cap))
        if match >= self.ngram_match and cont:
            k = len(cont)
            if self.adaptive:
                self._last_ngram = self.ngram_len[min(match, idx.n_max)]
                k = self._last_ngram.choose(k)
            if k > 0:
                cont = cont[:k]
                self._last = Draft(cont, [None] * len(cont) if sample else None, n_model=0)
                return self._last
        if self.model is None:
            return self._last
        k = self.model_len.choose(n_max) if self.adaptive else min(n_max, self.n_max)
        lag = len(tokens) - len(self.model.ctx.tokens)
        if self.model_len.last_was_probe and lag > self.max_probe_lag:
            # a probe would first re-read every token since the draft was last used, which
            # costs more than the probe can tell us: stay plain
            k = 0
        if k <= 0:
            return self._last
        before = self.model.ctx.n_decoded
        draft = self.model.propose(tokens, k, sampling, rng, sample)
        self._last_model_decodes = self.model.ctx.n_decoded - before
        if len(draft.tokens) < k:
            extra, match = idx.lookup(k - len(draft.tokens), extra=draft.tokens)
            if draft.tokens and match >= self.ngram_match:
                draft = Draft(draft.tokens + extra,
                              (draft.dists or []) + [None] * len(extra) if sample else None,
                              n_model=len(draft.tokens))
        self._last = draft
        return draft

    def observe(self, step: StepEvent) -> None:
        d = self._last
        self.costs.observe_verify(step.drafted + 1, step.t_verify)
        if self._last_model_decodes:
            self.costs.observe_draft(self._last_model_decodes, step.t_draft)
        n_model = min(d.n_model, step.drafted)
        if n_model:
            self.model_len.tracker.update(n_model, min(step.accepted, n_model))
        n_ng = step.drafted - n_model
        if n_ng and step.accepted >= n_model and self._last_ngram is not None:
            self._last_ngram.tracker.update(n_ng, step.accepted - n_model)
        if self.guard is not None:
            produced = step.accepted + 1
            self.guard.observe(produced, step.t_draft + step.t_verify + step.t_sample,
                               speculative=step.drafted > 0)
