"""Several sequences in one pair of contexts, decoded together (`tandem serve --parallel`).

Each slot's answer runs generate() unchanged on SeqContexts: one sequence of a shared Context
each, which the loop and the drafters use as they use a Context. Their decodes are
DecodeRequests (engine/backend/decode_requests.py) that the engine loop
(engine/loop/step_loop.py) gathers from every live generation and hands to the StepBatcher:
one llama_decode per context (more where they pass n_batch), the draft model's steps first,
the rest waiting until none is left. So the slots' draft steps share one draft batch, every
slot's step and its drafts' verification one target batch, a long prompt's chunks (n_ubatch)
ride between the streaming slots' steps, and a generation that starts or ends joins or leaves
the next batch: continuous batching, each sequence with its own sampler, grammar, stops and
drafter. One thread (the engine loop's) runs all of it: nothing here locks.

The rows a sequence gets are views into llama.cpp's buffer, as Context.decode's: the loop
resumes every generation a batch served before it runs the next (rows of a context's earlier
calls in one round, overwritten by its later ones, are copied). MTP heads follow every
sequence (decode_batch's Follower; each view tells them its rollbacks), their draft steps
(engine/backend/mtp.py HeadView) going first, as a draft model's.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from tandem.engine.backend.context_params import (ALL, LAST, MAX_OUTPUTS, NONE, ContextParams,
                                                   common_prefix, prefill_in_chunks)
from tandem.engine.backend.decode_requests import DecodeRequest, Steps, run_now
from tandem.engine.backend.memory import RollbackPlan, StateCopies, keeps_copies
from tandem.engine.backend.prompt_share import PromptShare
from tandem.errors import ContextOverflowError

if TYPE_CHECKING:
    from tandem.engine.backend.llama import Context


@dataclass
class BatchFigures:
    """What the batches were: llama_decode calls, their tokens, and the most sequences one
    call held (serve's /metrics and /slots)."""

    calls: int = 0
    tokens: int = 0
    seconds: float = 0.0  # inside llama_decode
    widest: int = 0
    by_width: dict[int, int] = field(default_factory=dict)  # sequences in a call -> calls
    steps: int = 0  # the calls on the target's context (the draft model's aside)
    busy: int = 0  # the sequences in those, summed (llama-server's busy slots per decode)


class StepBatcher:
    """Runs a round's DecodeRequests on the shared contexts, for the engine loop's thread.
    `members`: the generations in progress (the loop keeps it), which a slot's cost model
    prices its batch by (BatchCosts.company)."""

    def __init__(self):
        self.members = 0
        self.figures = BatchFigures()
        self.share = PromptShare()

    def run(self, waiting: Sequence[DecodeRequest]) -> None:
        """Run the requests of this round: the draft model's that want logits, when there are
        any, else all of them; those run are marked done. Beside streaming steps a prompt
        chunk runs only as far as its share of the time allows (prompt_share.py)."""
        # the draft model's steps go first, the rest wait for them: a slot's k draft steps
        # then cost the others k draft decodes, not k rounds of their own steps, and its
        # verify joins theirs (llama-server's draft-all-then-verify, PR 22838)
        jobs = [r for r in waiting if r.view.drafts and r.want != NONE] or list(waiting)
        steps = [r for r in jobs if r.want != NONE]
        prompts = [r for r in jobs if r.want == NONE] if steps else []
        # prompt pieces first, on what earlier rounds earned: the steps' rows must be from
        # their context's last decode (a later one lays its buffer out again, following MTP
        # heads' hidden rows then over the logits rows past its own)
        ready = [j for j in prompts if not self.share.waits(j, steps)]
        for job in ready:
            self._run_piece(job)
        seconds = self._run_all(steps if prompts else jobs)
        if prompts:
            self.share.earn(seconds, bool(ready))

    def _run_all(self, jobs: list[DecodeRequest]) -> float:
        """Run `jobs` whole, one group per context; the seconds inside llama_decode."""
        by_ctx: dict[int, list[DecodeRequest]] = {}
        for job in jobs:
            by_ctx.setdefault(id(job.view.ctx), []).append(job)
        seconds = 0.0
        try:
            for group in by_ctx.values():
                seconds += self._run(group)
        finally:
            for job in jobs:
                job.done = True
        return seconds

    def _run_piece(self, job: DecodeRequest) -> None:
        """As much of a prompt chunk as its share allows now, in a llama_decode of its own
        (timed apart: what a prompt token costs); done once all of it ran."""
        view, key = job.view, id(job.view.ctx)
        n = self.share.piece(key, len(job.tokens) - job.ran)
        if n <= 0:
            return
        t0 = time.perf_counter()
        try:
            view.ctx.decode_batch([(view.seq, job.start + job.ran,
                                    job.tokens[job.ran:job.ran + n], NONE)])
        except Exception as exc:  # noqa: BLE001 - its generation raises it
            job.error, job.done = exc, True
            return
        seconds = time.perf_counter() - t0
        self.share.spend(key, n, seconds)
        job.ran += n
        job.done = job.ran == len(job.tokens)
        self._count([job], n, seconds)

    def _run(self, jobs: list[DecodeRequest]) -> float:
        ctx = jobs[0].view.ctx
        calls: list[list[DecodeRequest]] = [[]]
        n = outs = 0
        for job in jobs:  # packed into calls of at most n_batch tokens and the rows limit
            size = len(job.tokens) - job.ran  # (the rest of a prompt chunk run in pieces)
            if calls[-1] and (n + size > ctx.n_batch
                              or outs + job.outputs > ctx.params.n_outputs_max):
                calls.append([])
                n = outs = 0
            calls[-1].append(job)
            n, outs = n + size, outs + job.outputs
        spent = 0.0
        for i, call in enumerate(calls):
            t0 = time.perf_counter()
            try:
                rows = ctx.decode_batch([(j.view.seq, j.start + j.ran,
                                          j.tokens[j.ran:] if j.ran else j.tokens, j.want)
                                         for j in call])
            except Exception as exc:  # noqa: BLE001 - each member's generation raises it
                for job in call:
                    job.error = exc
                continue
            seconds = time.perf_counter() - t0
            spent += seconds
            if i < len(calls) - 1:  # the next call on this context overwrites the buffer
                rows = np.array(rows)
            total = sum(len(j.tokens) - j.ran for j in call)
            at = 0
            for job in call:
                job.rows = rows[at:at + job.outputs]
                at += job.outputs
                job.view.others = total - len(job.tokens)
                job.view.decode_s = seconds
            self._count(call, total, seconds)
        return spent

    def _count(self, call: list[DecodeRequest], tokens: int, seconds: float) -> None:
        f = self.figures
        f.calls, f.tokens, f.seconds = f.calls + 1, f.tokens + tokens, f.seconds + seconds
        f.widest = max(f.widest, len(call))
        f.by_width[len(call)] = f.by_width.get(len(call), 0) + 1
        if not call[0].view.drafts:
            f.steps, f.busy = f.steps + 1, f.busy + len(call)


class SeqContext:
    """One sequence of a shared Context, as generate() and the drafters use a Context: the
    tokens it holds, decode, prefill, truncate, cache reuse. Prompt chunks are n_ubatch
    tokens (n_batch here), so that another slot's step waits for one chunk at most."""

    def __init__(self, ctx: Context, seq: int, n_ctx: int, batcher: StepBatcher,
                 drafts: bool = False):
        """`drafts`: the draft model's view, whose decodes run before the target's."""
        self.ctx, self.seq, self.batcher, self.drafts = ctx, seq, batcher, drafts
        self.model, self.params = ctx.model, ctx.params
        self.n_ctx = n_ctx
        self.n_batch = ctx.n_ubatch
        self.verify_limit = min(ctx.verify_limit, MAX_OUTPUTS)
        self.notes: list[str] = list(ctx.notes)
        self.memory_note = ctx.memory_note
        self.reuse_min = ctx.reuse_min
        self.tokens: list[int] = []
        self.prompt_end = self.ends_by = 0  # its generation's (PromptShare.waits; 0: unknown)
        # a recurrent state (hybrid, recurrent model) goes back per sequence as a Context's
        # does: from its last batch's snapshots, else from this slot's own copies, after which
        # the tokens from the copy on are owed: `held` counts those the sequence holds now, and
        # the next decode evaluates the rest first (a decode now would overwrite the rows of
        # the generations this round has not resumed yet)
        self.keeps_copies = keeps_copies(ctx.rollback.kind)
        self.rollback = RollbackPlan(ctx.rollback.kind, ctx.rollback.depth)
        self.copies = StateCopies(max(1, ctx.params.checkpoints))
        self.held = 0
        self.copy_at: set[int] = set()  # owed positions to take a copy at once evaluated
        # the other slots' views of this context: prefixes to borrow (reuse())
        self.peers: Sequence[SeqContext] = ()
        self.borrowed = 0  # prompt tokens taken from peers, never evaluated here
        self.others = 0  # tokens of other sequences in this one's latest llama_decode
        # that llama_decode's own seconds: what decode() took less the wait for the others
        # (their host work, the other model's decodes), which the cost model must not learn
        self.decode_s = 0.0
        self.n_decoded = 0

    @property
    def n_threads(self) -> int:
        """The shared context's CPU threads (every slot's rows decode in its batches)."""
        return self.ctx.n_threads

    def decode_steps(self, tokens: Sequence[int], all_logits: bool = False,
                     checkpoint: bool = False) -> Steps[np.ndarray]:
        rows = yield from self._decode_steps(tokens, ALL if all_logits else LAST)
        if checkpoint:
            self.checkpoint()
        return rows

    def _decode_steps(self, tokens: Sequence[int], want: int) -> Steps[np.ndarray]:
        if not tokens:
            raise ValueError("decode() needs at least one token")
        if len(self.tokens) + len(tokens) > self.n_ctx:
            raise ContextOverflowError(
                f"{len(self.tokens) + len(tokens)} tokens do not fit the slot's context of "
                f"{self.n_ctx}", "shorten the prompt or raise --ctx-size")
        if self.copy_at:  # owed up to each copy's position first, then the copy
            for pos in sorted(self.copy_at):
                yield from self._settle(pos)
                self.copy_at.discard(pos)
                self.copies.keep(self.held, self.ctx.state_copy(self.seq))
        owed = self.tokens[self.held:]
        if owed and (want == ALL or len(owed) + len(tokens) > self.n_batch):
            yield from self._settle(len(self.tokens))  # alone: the rows are for `tokens`
            owed = []
        return (yield from self._run([*owed, *tokens] if owed else tokens, want))

    def _settle(self, pos: int) -> Steps[None]:
        """The owed tokens before position `pos` evaluated, n_batch at a time."""
        while self.held < pos:
            yield from self._run(self.tokens[self.held:min(pos, self.held + self.n_batch)],
                                 NONE)

    def _run(self, tokens: Sequence[int], want: int) -> Steps[np.ndarray]:
        """One request of `tokens` at the held position; `held` then counts them."""
        request = DecodeRequest(self, tokens, want, self.held)
        try:
            yield request
        except GeneratorExit:  # ended while it waited: drop what the batch wrote of it
            if request.ran or request.done:
                self._forget_past(request)
            raise
        if not request.done:  # iterated by hand: only a StepLoop runs a slot's decodes
            raise RuntimeError("a slot's generation must be stepped by engine/loop/step_loop.py")
        if request.error is not None:
            raise request.error
        self.held += len(tokens)
        if self.held > len(self.tokens):
            self.tokens.extend(tokens[len(tokens) - (self.held - len(self.tokens)):])
        self.n_decoded += len(tokens)
        if self.keeps_copies:  # pieces: the last one's start is not kept, so no snapshots
            self.rollback.decoded(request.start if not request.ran else self.held - 1)
        return request.rows

    def _forget_past(self, request: DecodeRequest) -> None:
        """What a batch wrote of a request whose generation ended undone."""
        if not self.keeps_copies:
            self.ctx.seq_rm(self.seq, self.held)
        else:
            self.held = request.start + (len(request.tokens) if request.done else request.ran)
            self._restore(len(self.tokens))
        self._head_back(self.held)

    def _head_back(self, n: int) -> None:
        """The MTP heads following the shared context (its Follower) go back to n here too."""
        follower = getattr(self.ctx, "follower", None)
        if follower is not None:
            follower.truncated(n, self.seq)

    def prefill_steps(self, tokens: Sequence[int]) -> Steps[int]:
        # no logits: a prompt chunk's rows are never read
        return (yield from prefill_in_chunks(self, tokens, lambda c: self._decode_steps(c, NONE)))

    def run_alone(self, request: DecodeRequest) -> None:
        """`request` decoded now, in a batch of its own (decode(), prefill(): run_now)."""
        self.batcher.run([request])

    def decode(self, tokens: Sequence[int], all_logits: bool = False,
               checkpoint: bool = False) -> np.ndarray:
        """decode_steps() at once, alone: for the loop's thread between rounds."""
        return run_now(self.decode_steps(tokens, all_logits, checkpoint))

    def prefill(self, tokens: Sequence[int]) -> int:
        return run_now(self.prefill_steps(tokens))

    def truncate(self, n: int) -> None:
        if n >= len(self.tokens):
            return
        self._head_back(n)
        if not self.keeps_copies:
            self.ctx.seq_rm(self.seq, n)
        elif n < self.held:
            self.copies.drop_after(n)
            if self.rollback.by_snapshot(n, self.held) and self.ctx.seq_back(self.seq, n):
                self.rollback.rolled_back()
            else:
                self._restore(n)
        del self.tokens[n:]
        self.held = min(self.held, n)
        self.copy_at = {p for p in self.copy_at if p <= n}

    def _restore(self, n: int) -> None:
        """Back at the nearest copy at or before position n; the tokens after it are owed."""
        pos, data = self.copies.nearest(min(n, self.held))
        self.ctx.restore_copy(self.seq, pos, data)
        self.held = pos
        self.copies.drop_after(pos)
        self.rollback.restored()

    def reuse(self, tokens: Sequence[int]) -> int:
        """A longer prefix of `tokens` borrowed from a peer, then cache reuse (moved runs)."""
        self._borrow(tokens)
        follower = getattr(self.ctx, "follower", None)  # following: it must see every position
        if self.reuse_min <= 0 or follower is not None and follower.following:
            return 0
        start = common_prefix(self.tokens, tokens)
        moved = self.ctx.reuse_seq(self.seq, self.tokens, tokens, self.reuse_min)
        if moved:  # (attention only: a recurrent state cannot shift, and may owe tokens)
            self.held = len(self.tokens)
        self._head_back(start if moved else len(self.tokens))  # moved: not what heads saw
        return moved

    # fewer tokens are evaluated here: borrowed cells were computed in the donor's prompt
    # chunks, whose shape moves the kernels' last bits (an answer then equals itself alone up
    # to near ties, as after a chat's cached turn); a short prefix costs little to evaluate
    BORROW_MIN = 32

    def lender(self, tokens: Sequence[int]) -> tuple[SeqContext | None, int]:
        """The peer holding a prefix of `tokens` at least BORROW_MIN tokens longer than this
        one's, and its length; (None, 0): none (a recurrent state is not shared by cells)."""
        best, donor = common_prefix(self.tokens, tokens) + self.BORROW_MIN - 1, None
        for peer in () if self.keeps_copies else self.peers:
            n = common_prefix(peer.tokens, tokens)
            if n > best:
                best, donor = n, peer
        return (donor, best) if donor is not None else (None, 0)

    def _borrow(self, tokens: Sequence[int]) -> None:
        """Hold the lender's prefix of `tokens` (its cells, shared in the unified cache): a
        long system prompt, or an agent's conversation parallel requests continue, read once."""
        donor, best = self.lender(tokens)
        if donor is None:
            return
        self.ctx.seq_rm(self.seq, 0)
        self.ctx.seq_cp(donor.seq, self.seq, best)
        if getattr(self.ctx, "follower", None) is not None:  # the heads' cells too, if held
            self.ctx.follower.copied(donor.seq, self.seq, best)
        self.tokens[:] = tokens[:best]
        self.held = best
        self.borrowed += best

    def checkpoint(self) -> None:
        """A copy of this sequence's recurrent state where it is now (Context.checkpoint);
        nothing for attention memory, which goes back anywhere."""
        if not self.keeps_copies or not self.tokens:
            return
        if self.held < len(self.tokens):  # owed: taken once the next decode evaluates them
            self.copy_at.add(len(self.tokens))
        else:
            self.copies.keep(self.held, self.ctx.state_copy(self.seq))

    def copy_marks(self, n: int, start: int = 0) -> tuple[int, ...]:
        return self.ctx.copy_marks(n, start)

    def save(self) -> SavedSequence:
        """This sequence's cache, to put back later (the server's RAM prompt cache), with its
        copies of a recurrent state (a later prompt that parts before the end comes back to
        one, as in its slot): of the tokens it holds, owed ones forgotten first."""
        del self.tokens[self.held:]
        self.copy_at.clear()
        return SavedSequence(self.ctx.seq_state(self.seq), dict(self.copies.by_pos))

    def load(self, tokens: Sequence[int], saved: SavedSequence) -> bool:
        """Hold `tokens` from a copy save() made of them; False (and empty) where it did
        not fit."""
        ok = self.ctx.set_seq_state(self.seq, saved.data)
        if not ok:
            self.ctx.seq_rm(self.seq, 0)
        self._head_back(0)  # the heads hold none of it: they follow from its next decode
        self.tokens[:] = list(tokens) if ok else []
        self.held = len(self.tokens)
        self.copy_at.clear()
        self.copies.clear()  # of the conversation the sequence held before
        if ok:
            self.copies.by_pos.update(saved.copies)
        self.rollback.restored()
        return ok


@dataclass(frozen=True, eq=False)
class SavedSequence:
    """SeqContext.save(): the sequence's cache (llama_state_seq_get_data) and its copies of a
    recurrent state by position; len() counts the bytes of both."""

    data: bytes
    copies: dict[int, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.data) + sum(len(c) for c in self.copies.values())


@dataclass(eq=False)
class Slot:
    """One of a session's sequences (SessionOptions.sequences > 1): the target's and the
    draft model's views of it, which a generation on this slot decodes through."""

    index: int
    target: SeqContext
    draft: SeqContext | None


def shared_context(params: ContextParams, sequences: int) -> ContextParams:
    """A context that holds `sequences` slots of params.n_ctx tokens each in one unified KV
    cache (llama-server's layout), plus sequence 0, the session's own (a calibration's
    probe: one ubatch), with logits rows for every slot's verify batch."""
    return replace(params, n_ctx=params.n_ctx * sequences + params.n_ubatch,
                   n_seq_max=sequences + 1, kv_unified=True,
                   n_outputs_max=MAX_OUTPUTS * sequences)
