"""Drafters propose tokens for the target to verify. generate() only knows this interface."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

import numpy as np

from tandem.engine.llama import Context
from tandem.engine.sampling import Dist, SamplingParams, distribution, draft_top, greedy_token


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)
    # q, the draft's distribution for each token, when the tokens were sampled (temperature > 0
    # with rejection sampling); None for deterministic drafts, which verify by exact match.
    dists: list[Dist] | None = None


class Drafter(Protocol):
    name: str

    def propose(self, tokens: Sequence[int], n_max: int, sampling: SamplingParams,
                rng: np.random.Generator, sample: bool) -> Draft:
        """Up to n_max tokens to follow `tokens`; `sample`: draw from q instead of argmax."""
        ...

    def observe(self, drafted: int, accepted: int) -> None:
        """Feedback after verification (adaptive drafters use it)."""
        ...


class NoDrafter:
    """Plain decoding: every step verifies just the last token, through the same loop."""

    name = "none"

    def propose(self, tokens, n_max, sampling, rng, sample) -> Draft:
        return Draft()

    def observe(self, drafted: int, accepted: int) -> None:
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
        dists: list[Dist] | None = [] if sample else None
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
        return Draft(out, dists)

    def observe(self, drafted: int, accepted: int) -> None:
        pass
