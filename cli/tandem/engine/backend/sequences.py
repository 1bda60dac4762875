"""Several sequences in one pair of contexts, decoded together (`tandem serve --parallel`).

Each slot's answer runs generate() unchanged, in a thread of its own, on SeqContexts: one
sequence of a shared Context each, which the loop and the drafters use as they use a Context.
Their decodes meet in the StepBatcher: a decode waits until every generation in progress waits
on one too, then the last to arrive runs them all, one llama_decode per context (more where
they pass n_batch); the draft model's steps first, the rest waiting until none is left. So
the slots' draft steps share one draft batch, every slot's step and its drafts' verification
one target batch, a long prompt's chunks (n_ubatch) ride between the streaming slots' steps,
and a generation that starts or ends joins or leaves the next batch: continuous batching,
each sequence with its own sampler, grammar, stops and drafter.

The rows a sequence gets are views into llama.cpp's buffer, as Context.decode's: no batch runs
before every member has asked for its next decode, by which time it has read them (rows of a
context's earlier calls in one round, overwritten by its later ones, are copied).
Attention memory only: a sequence goes back by removing its positions (Context.seq_rm).
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Iterator, Sequence

import numpy as np

from tandem.engine.backend.context_params import (ALL, LAST, MAX_OUTPUTS, NONE, ContextParams,
                                                   common_prefix, prefill_in_chunks)
from tandem.errors import ContextOverflowError

if TYPE_CHECKING:
    from tandem.engine.backend.llama import Context


@dataclass(eq=False)
class _Decode:
    view: SeqContext
    tokens: Sequence[int]
    want: int
    rows: np.ndarray | None = None
    error: BaseException | None = None
    done: bool = False

    @property
    def outputs(self) -> int:
        return len(self.tokens) if self.want == ALL else (1 if self.want == LAST else 0)


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
    """The meeting point of every generation in progress on the shared contexts. A thread
    that generates is a member (member()); a decode() returns once the batch holding it ran.
    exclusive() runs other llama.cpp calls on the contexts (a rollback, a state copy, a
    calibration) while no batch runs."""

    def __init__(self):
        self._cond = threading.Condition()
        self._members = 0
        self._waiting: list[_Decode] = []
        self.figures = BatchFigures()

    @property
    def members(self) -> int:
        return self._members

    @contextmanager
    def member(self) -> Iterator[None]:
        with self._cond:
            self._members += 1
        try:
            yield
        finally:
            with self._cond:
                self._members -= 1
                self._run_if_all_wait()  # the others may have been waiting for this one

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            yield

    def decode(self, view: SeqContext, tokens: Sequence[int], want: int) -> np.ndarray:
        job = _Decode(view, tokens, want)
        with self._cond:
            self._waiting.append(job)
            self._run_if_all_wait()
            while not job.done:
                self._cond.wait()
        if job.error is not None:
            raise job.error
        return job.rows

    def _run_if_all_wait(self) -> None:
        """Under the lock: when every member waits (or no one is a member), run the batch."""
        if not self._waiting or len(self._waiting) < self._members:
            return
        # the draft model's steps go first, the rest wait for them: a slot's k draft steps
        # then cost the others k draft decodes, not k rounds of their own steps, and its
        # verify joins theirs (llama-server's draft-all-then-verify, PR 22838). Its prompt
        # chunks (no logits) ride with the round, as the target's do
        drafts = [job for job in self._waiting if job.view.drafts and job.want != NONE]
        if drafts:
            jobs = drafts
            self._waiting = [job for job in self._waiting if job not in drafts]
        else:
            jobs, self._waiting = self._waiting, []
        by_ctx: dict[int, list[_Decode]] = {}
        for job in jobs:
            by_ctx.setdefault(id(job.view.ctx), []).append(job)
        try:
            for group in by_ctx.values():
                self._run(group)
        finally:
            for job in jobs:
                job.done = True
            self._cond.notify_all()

    def _run(self, jobs: list[_Decode]) -> None:
        ctx = jobs[0].view.ctx
        calls: list[list[_Decode]] = [[]]
        n = outs = 0
        for job in jobs:  # packed into calls of at most n_batch tokens and the rows limit
            if calls[-1] and (n + len(job.tokens) > ctx.n_batch
                              or outs + job.outputs > ctx.params.n_outputs_max):
                calls.append([])
                n = outs = 0
            calls[-1].append(job)
            n += len(job.tokens)
            outs += job.outputs
        for i, call in enumerate(calls):
            t0 = time.perf_counter()
            try:
                rows = ctx.decode_batch([(j.view.seq, len(j.view.tokens), j.tokens, j.want)
                                         for j in call])
            except BaseException as exc:  # noqa: BLE001 - each member raises it in its own thread
                for job in call:
                    job.error = exc
                continue
            seconds = time.perf_counter() - t0
            if i < len(calls) - 1:  # the next call on this context overwrites the buffer
                rows = np.array(rows)
            total = sum(len(j.tokens) for j in call)
            at = 0
            for job in call:
                job.rows = rows[at:at + job.outputs]
                at += job.outputs
                job.view.others = total - len(job.tokens)
                job.view.decode_s = seconds
            f = self.figures
            f.calls += 1
            f.tokens += total
            f.seconds += seconds
            f.widest = max(f.widest, len(call))
            f.by_width[len(call)] = f.by_width.get(len(call), 0) + 1
            if not call[0].view.drafts:
                f.steps += 1
                f.busy += len(call)


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

    def decode(self, tokens: Sequence[int], all_logits: bool = False,
               checkpoint: bool = False) -> np.ndarray:  # noqa: ARG002 - attention: no copies
        return self._decode(tokens, ALL if all_logits else LAST)

    def _decode(self, tokens: Sequence[int], want: int) -> np.ndarray:
        if not tokens:
            raise ValueError("decode() needs at least one token")
        if len(self.tokens) + len(tokens) > self.n_ctx:
            raise ContextOverflowError(
                f"{len(self.tokens) + len(tokens)} tokens do not fit the slot's context of "
                f"{self.n_ctx}", "shorten the prompt or raise --ctx-size")
        rows = self.batcher.decode(self, tokens, want)
        self.tokens.extend(tokens)
        self.n_decoded += len(tokens)
        return rows

    def truncate(self, n: int) -> None:
        if n < len(self.tokens):
            with self.batcher.exclusive():  # the tokens too: a peer may be reading them
                self.ctx.seq_rm(self.seq, n)
                del self.tokens[n:]

    def reuse(self, tokens: Sequence[int]) -> int:
        """A longer prefix of `tokens` borrowed from a peer, then cache reuse (moved runs)."""
        with self.batcher.exclusive():
            self._borrow(tokens)
            if self.reuse_min <= 0:
                return 0
            return self.ctx.reuse_seq(self.seq, self.tokens, tokens, self.reuse_min)

    # fewer tokens are evaluated here: borrowed cells were computed in the donor's prompt
    # chunks, whose shape moves the kernels' last bits (an answer then equals itself alone up
    # to near ties, as after a chat's cached turn); a short prefix costs little to evaluate
    BORROW_MIN = 32

    def _borrow(self, tokens: Sequence[int]) -> None:
        """Under the lock: where another slot holds a prefix of `tokens` at least BORROW_MIN
        tokens longer than this one's, hold its cells too (shared in the unified cache, never
        evaluated again): a long system prompt, or an agent's conversation that parallel
        requests continue, is read once."""
        own = common_prefix(self.tokens, tokens)
        best, donor = own + self.BORROW_MIN - 1, None
        for peer in self.peers:
            n = common_prefix(peer.tokens, tokens)
            if n > best:
                best, donor = n, peer
        if donor is None:
            return
        self.ctx.seq_rm(self.seq, 0)
        self.ctx.seq_cp(donor.seq, self.seq, best)
        self.tokens[:] = tokens[:best]
        self.borrowed += best

    def prefill(self, tokens: Sequence[int], progress=None) -> int:
        # no logits: a prompt chunk's rows are never read
        return prefill_in_chunks(self, tokens, lambda chunk: self._decode(chunk, NONE), progress)

    def sync(self, tokens: Sequence[int]) -> np.ndarray:
        self.prefill(tokens[:-1])
        return self.decode(tokens[-1:])[0]

    def checkpoint(self) -> None:
        """Attention memory goes back anywhere: no copies to keep."""

    def copy_marks(self, n: int, start: int = 0) -> tuple[int, ...]:  # noqa: ARG002
        return ()

    def save(self) -> bytes:
        """This sequence's cache, to put back later (the server's RAM prompt cache)."""
        with self.batcher.exclusive():
            return self.ctx.seq_state(self.seq)

    def load(self, tokens: Sequence[int], data: bytes) -> bool:
        """Hold `tokens` from a copy save() made of them; False (and empty) where it did
        not fit."""
        with self.batcher.exclusive():
            ok = self.ctx.set_seq_state(self.seq, data)
            if not ok:
                self.ctx.seq_rm(self.seq, 0)
            self.tokens[:] = list(tokens) if ok else []
        return ok


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
