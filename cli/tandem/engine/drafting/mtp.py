"""Drafting with the target's own multi-token-prediction heads (`--strategy mtp`, and auto's
model source where a target has them and no draft model is loaded).

Models trained with MTP layers ("nextn": GLM-4.5, Qwen3.5/3.6, step35...) predict the token
after next from the token and the target's last hidden row. llama.cpp runs such a head in a
context of its own against the target model (engine/backend/mtp.py MtpHead), which follows
every target decode; this drafter asks it for a draft, one head step per token, and takes the
tokens as llama.cpp's draft-simple takes a draft model's (drafters.draft_tokens): greedy top-1
of a top-10 softmax with p_min and n_min, or sampled from the head's q at temperature > 0, which
the rejection rule verifies like any model's. No second model, vocabulary or KV of a whole
model: the head costs one layer per drafted token, plus one layer over every token the target
decodes (the head's cache follows the target's). On serve's slots the head follows every
slot's sequence, and one head decode runs the draft steps of every slot drafting in a round.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Sequence

from tandem.config.schema import MAX_DRAFT
from tandem.engine.backend.decode_requests import Steps, run_now
from tandem.engine.drafting.drafters import (Draft, DraftParams, Stepped, StepSources,
                                             draft_tokens, one_source)
from tandem.engine.loop.events import StepEvent

if TYPE_CHECKING:
    from tandem.engine.backend.mtp import HeadView, MtpHead


class MtpDrafter(Stepped):
    """Drafts from the target's MTP head (llama.cpp's draft-mtp, single-head mode): on a
    whole Context from sequence 0 of the MtpHead, whose steps run at once; on a slot from
    its HeadView, whose steps are DecodeRequests the engine loop batches with the other
    slots' (one head decode for every slot drafting in a round)."""

    name = "mtp"
    label = "MTP heads"  # what drafts, in auto's notes
    notes: Sequence[str] = ()
    step_sources: StepSources = ()
    # what a HybridDrafter (auto) reads of its model: the head never lags the target, so there
    # is no catch-up to time apart
    last_sync_tokens = 0
    catches_up = False  # nothing to read before a draft (HybridDrafter._catch_up_covered)
    last_sync_s = 0.0

    def __init__(self, head: MtpHead | HeadView, draft: DraftParams):
        self.head = head
        self.ctx = head  # what the head holds of the sequence (auto's catch-up check)
        self.n_max, self.n_min, self.p_min = draft.n_max, draft.n_min, draft.p_min
        self.last_decodes = 0  # head steps of the latest draft
        self.last_decode_s = 0.0

    def propose_steps(self, tokens, room, sampling, rng, sample) -> Steps[Draft]:
        return (yield from self.draft_steps(tokens, min(self.n_max, room), sampling, rng,
                                            sample))

    def draft(self, tokens, k, sampling, rng, sample) -> Draft:
        return run_now(self.draft_steps(tokens, k, sampling, rng, sample))

    def draft_steps(self, tokens, k, sampling, rng, sample) -> Steps[Draft]:
        """Up to k tokens, whatever n_max says: auto's HybridDrafter chooses k by its policy."""
        head = self.head
        # the head follows the target, which holds every token but the last and those a
        # grammar forced after it: the head reads them as draft steps before drafting on
        unread = tokens[head.n:]
        self.last_decodes, self.last_decode_s = 0, 0.0
        if k <= 0 or k < self.n_min or not 0 < len(unread) <= 1 + MAX_DRAFT:
            return Draft()  # (more unread: a head that does not follow; never one step each)
        t0 = time.perf_counter()
        self.last_decodes = len(unread)
        try:
            logits = yield from head.start_steps(unread[0])
            for tok in unread[1:]:
                logits = yield from head.step_steps(tok)

            def step(tok: int) -> Steps:
                self.last_decodes += 1
                return (yield from head.step_steps(tok))

            draft = yield from draft_tokens(logits, step, k, tokens, sampling, rng, sample,
                                            self.p_min, self.n_min)
        finally:
            head.end()
        self.last_decode_s = time.perf_counter() - t0
        return draft

    def prefill_steps(self, prompt: Sequence[int]) -> Steps[None]:
        return  # the head read the prompt while the target did
        yield  # noqa: unreachable - makes this a generator

    def observe(self, step: StepEvent) -> None:
        self.step_sources = one_source("model", step)  # the heads are auto's model source too
