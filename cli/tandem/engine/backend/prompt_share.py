"""How much of the engine's time a new prompt takes while other answers stream.

A prompt evaluated whole between two steps of a streaming answer stops that stream for the
whole prompt: on this CPU a prompt token costs about a third of a step (~10 ms), so an
editor's 950-token prompt froze a chat for half a minute. While other sequences decode, a
prompt's chunks therefore get at most SHARE of the time those steps take, earned round by
round and spent in pieces of at least MIN_PIECE tokens, each timed (a prompt token's cost
depends on the model, the device and the piece's size); what is left of a prompt once it is
SHORT runs at once; one whose share cannot finish it before the streams beside it are due to
end waits for them whole (waits()). A prompt with no stream beside it runs whole chunks
(StepBatcher). On a GPU, where a prompt token costs a small part of a step,
one round's share holds hundreds of tokens; on this CPU it holds a few.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from tandem.engine.backend.decode_requests import DecodeRequest

SHARE = 0.15  # the streams then take at most ~1.15x as long while a prompt waits
MIN_PIECE = 16  # tokens: smaller pieces waste the matrix kernels' width
# a prompt with no more than this left runs at once: a chat's new turn, requests sent
# together (the first to stream must not hold back the others' short prompts)
SHORT = 64


class PromptShare:
    """The credit (seconds) prompts have earned beside streaming steps, the measured seconds
    a prompt token takes in a piece, per context, and the latest round's steps' seconds."""

    def __init__(self):
        self.credit = 0.0
        self.token_s: dict[int, float] = {}
        self.round_s: float | None = None

    def earn(self, seconds: float, pieces: bool = True) -> None:
        """A round's streaming steps took `seconds` while a prompt waited (none is earned
        where every prompt waits for the streams to end: no long piece once one may run)."""
        self.credit += SHARE * seconds if pieces else 0.0
        self.round_s = seconds

    def waits(self, job: DecodeRequest, steps: Sequence[DecodeRequest]) -> bool:
        """Whether a prompt's piece waits whole for the streams beside it to end: where its
        share cannot finish the prompt before they are due to end (each ends by its slot's
        `ends_by`, a token a step at least), pieces would only slow them (a piece's token
        costs more than a whole chunk's: 13-17 ms against 10 for the 1.5B target here) and
        the prompt would still run whole after them, as llama-server runs it."""
        per, view = self.token_s.get(id(job.view.ctx)), job.view
        ends = [getattr(s.view, "ends_by", 0) for s in steps]
        if per is None or self.round_s is None or min(ends, default=0) <= 0:
            return False  # unmeasured, or a stream of no known end
        rounds = max(end - len(s.view.tokens) for end, s in zip(ends, steps))
        left = max(view.prompt_end - job.start, len(job.tokens)) - job.ran
        # a short prompt (a new turn, a hybrid slot's owed tokens) runs at once all the same
        return left > SHORT and left * per > SHARE * rounds * self.round_s

    def piece(self, ctx_key: int, remaining: int) -> int:
        """How many of a prompt's `remaining` tokens may run now (0: it waits a round). The
        first piece on a context runs at once: it measures what a token costs there."""
        if remaining <= SHORT:
            return remaining
        smallest = min(MIN_PIECE, remaining)
        per = self.token_s.get(ctx_key)
        if per is None:
            return smallest
        n = int(self.credit / per) if per > 0 else remaining
        return min(n, remaining) if n >= smallest else 0

    def spend(self, ctx_key: int, tokens: int, seconds: float) -> None:
        self.credit -= seconds
        per = seconds / tokens
        old = self.token_s.get(ctx_key)
        self.token_s[ctx_key] = per if old is None else 0.7 * old + 0.3 * per
