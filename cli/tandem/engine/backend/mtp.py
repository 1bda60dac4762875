"""The target model's multi-token-prediction heads as a draft source (MtpHead): a llama.cpp
context of type MTP made against the target's context, which follows its decodes of every
sequence, and the calls of llama.cpp's staging API (src/llama-ext.h) that carry the target's
hidden rows to it; HeadView, one slot's sequence of the heads, whose draft steps join the
engine loop's batches.

A binding module beside llama.py and model.py (tests/test_structure.py names them): it
builds on llama.py's Context and context parameters, and neither imports it.
"""
from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import llama_cpp as _lc
import numpy as np

from tandem.engine.backend.context_params import LAST
from tandem.engine.backend.decode_requests import DecodeRequest, Steps, at_once
from tandem.engine.backend.llama import Context, decode_failed, llama_context_params
from tandem.engine.backend.model import LLAMA_CPP_VERSION
from tandem.errors import ModelError

if TYPE_CHECKING:
    from tandem.engine.backend.sequences import SeqContext, StepBatcher

# The hidden-row calls an MTP draft needs (common/speculative.cpp's draft-mtp), llama.cpp's
# "staging API" (src/llama-ext.h), which libllama exports as C++ functions only: the binding's
# llama_cpp_ext finds each by its plain, Itanium or MSVC name. It has every call the head
# makes (llama_set_embeddings_nextn, llama_get_embeddings_nextn(_ith)): tandem binds none.
_ext = None


def staging_calls():
    """llama_cpp.llama_cpp_ext, imported once. A binding without it, or a libllama without one
    of its calls (the module then fails to import), is a ModelError naming the
    llama-cpp-python version (MTP drafting is then unavailable), never a crash."""
    global _ext
    if _ext is None:
        try:
            import llama_cpp.llama_cpp_ext as ext
        except (ImportError, AttributeError) as exc:
            raise ModelError(
                f"llama-cpp-python {LLAMA_CPP_VERSION} lacks llama.cpp's staging calls, which "
                f"MTP drafting needs ({exc})",
                "install llama-cpp-python 0.3.36, whose llama.cpp has MTP heads; or draft "
                "with --strategy ngram, or a draft model (-md)") from exc
        _ext = ext
    return _ext


@dataclass(eq=False)
class HeadSeq:
    """What the heads hold of one sequence: its positions base..n-1 in their cache (base > 0
    only after a jump: the head had none of the sequence and the target was further on), the
    target's hidden rows of its latest batch (rows_pos0: the first one's position), the
    pending row (the target's at n - 1, for the token at n) and a draft's next input row and
    position (h, pos)."""

    n_embd: int
    n: int = 0
    base: int = 0
    rows: np.ndarray = field(init=False)
    rows_pos0: int = 0
    pending: np.ndarray = field(init=False)
    h: np.ndarray = field(init=False)
    pos: int = 0

    def __post_init__(self):
        self.rows = np.zeros((0, self.n_embd), dtype=np.float32)
        self.pending = self.h = np.zeros(self.n_embd, dtype=np.float32)

    def row_before(self, n: int) -> np.ndarray:
        """The target's row at n - 1 where the latest batch has it, else zeros (as for a
        sequence's first token: drafts only degrade)."""
        i = n - 1 - self.rows_pos0
        return (self.rows[i] if 0 <= i < len(self.rows)
                else np.zeros(self.n_embd, dtype=np.float32))


class MtpHead:
    """The model's multi-token-prediction head (its first nextn layer) in an MTP context of
    its own, made against the target's context as llama-server makes it
    (common_speculative_init_result: ctx_type MTP, ctx_other the target, n_ctx, n_seq_max and
    the unified cache the target's) and driven as common/speculative.cpp's draft-mtp drives
    a single head, per sequence (HeadSeq). It is the target Context's follower (llama.py's
    Follower):

    - decoded() / decoded_batch(): after each target decode while following, one
      llama_process of the same tokens at the same positions in the same sequences, each
      paired with the target's hidden row (h_nextn, before the output norm) of the position
      before it; a sequence's first with its pending row. The head's cache then holds what
      the target's holds.
    - truncated(n, seq): the target's sequence went back to n tokens: so does the head's, and
      the pending row becomes the target's row at n - 1 (llama.cpp's accept()); one from an
      earlier batch is not kept (zeros). copied(): a slot borrowed a peer's prefix.
    - start(token) / step(token) / end() on sequence 0 (a whole Context's draft), and
      decode_batch(): the draft steps of several slots in one llama_process (HeadView's).
    Chained heads (step35's) and a memory shared with the target (Gemma 4's assistants) are
    not driven: the first head drafts every position, as llama.cpp's default path does."""

    def __init__(self, target: Context):
        model = target.model
        if not model.mtp_loaded:
            raise ModelError(f"{model.path.name} was loaded without its MTP heads",
                             "load it with --strategy mtp")
        ext = staging_calls()
        cp = llama_context_params(target.params)  # n_seq_max, kv_unified: the target's
        cp.n_ctx = target.n_ctx
        cp.ctx_type = _lc.LLAMA_CONTEXT_TYPE_MTP
        cp.ctx_other = target._ptr
        cp.n_rs_seq = 0
        ptr = _lc.llama_init_from_model(model._ptr, cp)
        if not ptr:
            raise ModelError(f"llama.cpp could not create the MTP context of {model.path.name}",
                             "run with --verbose to see llama.cpp's reason")
        self._ptr, self._target, self._ext = ptr, target, ext
        self.n_embd = _lc.llama_model_n_embd_out(model._ptr)
        self.n_vocab = model.n_vocab
        # what the StepBatcher reads of a context it packs draft steps for
        self.params, self.n_batch = target.params, target.n_batch
        ext.llama_set_embeddings_nextn(ptr, True, True)  # its own rows: output rows only
        self._mem = _lc.llama_get_memory(ptr)
        self._batch = _lc.llama_batch_ext_init(ptr)
        self.seqs: dict[int, HeadSeq] = {}
        self._pos_buf = (_lc.llama_pos * 1)()
        self.following = False  # the target's decodes come here (follow())
        self.t_mirror = 0.0  # seconds the head spent following the target (its cost)
        self.n_mirrored = 0
        self.draft_calls = 0  # llama_process calls of draft steps (decode_batch)
        self.draft_rows = 0  # the draft steps they ran
        self.draft_widest = 0  # the most sequences one of them drafted for

    def seq(self, seq: int) -> HeadSeq:
        state = self.seqs.get(seq)
        if state is None:
            state = self.seqs[seq] = HeadSeq(self.n_embd)
        return state

    # sequence 0's state, as a whole Context's drafter and its tests read it
    @property
    def n(self) -> int:
        return self.seq(0).n

    @property
    def _pending(self) -> np.ndarray:
        return self.seq(0).pending

    @_pending.setter
    def _pending(self, row: np.ndarray) -> None:
        self.seq(0).pending = row

    @property
    def tokens(self) -> Sequence[int]:
        """The target's tokens the head holds (sequence 0)."""
        return self._target.tokens[:self.n]

    def follow(self, on: bool) -> None:
        """Have the target output its hidden rows (every row of a batch: unmasked) and send
        its decodes here, or not."""
        self._ext.llama_set_embeddings_nextn(self._target._ptr, on, False)
        self.following = on

    def set_threads(self, n: int) -> None:
        _lc.llama_set_n_threads(self._ptr, n, n)

    def _add(self, seq: int, token: int, pos: int, h: np.ndarray, output: bool) -> int:
        idx = _lc.llama_batch_ext_add_token(self._batch, seq, token)
        self._pos_buf[0] = pos
        _lc.llama_batch_ext_set_pos(self._batch, idx, self._pos_buf)
        embd = _lc.llama_embd(h.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, self.n_embd)
        if idx < 0 or not _lc.llama_batch_ext_set_embd_token(self._batch, idx, embd):
            raise ModelError("llama.cpp refused a row of the MTP head's batch",
                             "run with --verbose to see llama.cpp's log")
        if output:
            _lc.llama_batch_ext_set_output_logits(self._batch, idx, True)
        return idx

    def _process(self) -> None:
        rc = _lc.llama_process(self._ptr, _lc.LLAMA_PROCESS_TYPE_DECODE, self._batch)
        if rc != 0:
            decode_failed(rc)

    def decoded(self, tokens: Sequence[int], pos0: int) -> None:
        """The target just decoded `tokens` at pos0.. of sequence 0 (Context.decode)."""
        self.decoded_batch(((0, pos0, tokens, LAST),))

    def decoded_batch(self, entries: Sequence[tuple[int, int, Sequence[int], int]]) -> None:
        """The target just decoded `entries` (Context.decode_batch's: sequence, first
        position, tokens, rows wanted) in one llama_decode: the same into the head's cache, in
        one llama_process. The target's rows come in the batch's order (llama.cpp's
        output_reorder puts unmasked nextn rows back in it, whatever ubatches it split)."""
        t0 = time.perf_counter()
        ptr = self._ext.llama_get_embeddings_nextn(self._target._ptr)
        if not ptr:
            return
        rows = np.ctypeslib.as_array(ptr, shape=(sum(len(e[2]) for e in entries),
                                                 self.n_embd)).copy()
        _lc.llama_batch_ext_clear(self._batch)
        taken, at = [], 0
        for seq, start, toks, _ in entries:
            state, k = self.seq(seq), len(toks)
            if start < state.n:
                self.truncated(start, seq)
            if start > state.n:  # it missed decodes (a cache loaded, heads off): it jumps
                self._jump(seq, state, start)
            for j, tok in enumerate(toks):
                self._add(seq, tok, start + j, state.pending if j == 0 else rows[at + j - 1],
                          False)
            taken.append((state, start, rows[at:at + k]))
            at += k
        self._process()
        for state, start, part in taken:
            state.rows, state.rows_pos0, state.pending = part, start, part[-1]
            state.n = start + len(part)
        self.n_mirrored += at
        self.t_mirror += time.perf_counter() - t0

    def _jump(self, seq: int, state: HeadSeq, start: int) -> None:
        """Follow sequence `seq` from position `start` on, without what came before it: its
        cells dropped (llama.cpp takes a sequence's positions consecutively, or from any
        position when it holds none) and zeros for its pending row. Its drafts attend to
        the positions from `start` only, as llama-server's head after a restored prompt."""
        _lc.llama_memory_seq_rm(self._mem, seq, -1, -1)
        state.base = state.n = start
        state.pending = np.zeros(self.n_embd, dtype=np.float32)
        state.rows = state.rows[:0]

    def truncated(self, n: int, seq: int = 0) -> None:
        """Forget positions n.. of sequence `seq` (the target's went back to n tokens)."""
        state = self.seq(seq)
        if n >= state.n:
            return
        _lc.llama_memory_seq_rm(self._mem, seq, n, -1)
        state.n = n
        state.base = min(state.base, n)  # below its first position: it holds none
        state.pending = state.row_before(n)
        state.rows = state.rows[:max(n - state.rows_pos0, 0)]  # rows of what it holds only

    def copied(self, src: int, dst: int, n: int) -> None:
        """Sequence `dst` now holds the target's positions 0..n-1 of `src` (a slot borrowed
        them): the head's cells too where it holds them from 0, else none (it jumps)."""
        self.truncated(0, dst)
        donor, state = self.seq(src), self.seq(dst)
        if donor.base == 0 and donor.n >= n > 0:
            _lc.llama_memory_seq_cp(self._mem, src, dst, 0, n)
            state.n, state.rows = n, state.rows[:0]
            state.pending = donor.row_before(n)

    def begin(self, seq: int = 0) -> None:
        """A draft on `seq` starts after its cached positions, from its pending row."""
        state = self.seq(seq)
        state.pos, state.h = state.n, state.pending

    def start(self, token: int) -> np.ndarray:
        """The first draft step on sequence 0: `token` (the target's last, not yet decoded by
        it) at the position after the cached ones; the head's logits for the token after it."""
        self.begin(0)
        return self.step(token)

    def step(self, token: int) -> np.ndarray:
        """One more draft step on sequence 0: the logits (a copy) for the token after `token`."""
        return self.decode_batch(((0, self.seq(0).pos, (token,), LAST),))[0]

    def start_steps(self, token: int) -> Steps[np.ndarray]:
        return at_once(self.start(token))  # a whole Context's: at once

    def step_steps(self, token: int) -> Steps[np.ndarray]:
        return at_once(self.step(token))

    def decode_batch(self, entries: Sequence[tuple[int, int, Sequence[int], int]]) -> np.ndarray:
        """Draft steps of several sequences in one llama_process, as the StepBatcher calls a
        context's decode_batch: entries of (sequence, position, [token], LAST), each token
        paired with its sequence's latest row (begin(): the pending one). Returns one logits
        row per entry (a copy) and keeps each sequence's new row for its next step."""
        _lc.llama_batch_ext_clear(self._batch)
        idx = []
        for seq, pos, toks, _ in entries:
            if len(toks) != 1:
                raise ValueError("a draft step of the MTP heads takes one token per sequence")
            idx.append(self._add(seq, toks[0], pos, self.seq(seq).h, True))
        self._process()
        out = np.empty((len(entries), self.n_vocab), dtype=np.float32)
        for k, (seq, pos, _, _) in enumerate(entries):
            state = self.seq(seq)
            h = self._ext.llama_get_embeddings_nextn_ith(self._ptr, idx[k])
            state.h = np.ctypeslib.as_array(h, shape=(self.n_embd,)).copy()
            state.pos = pos + 1
            out[k] = np.ctypeslib.as_array(_lc.llama_get_logits_ith(self._ptr, idx[k]),
                                           shape=(self.n_vocab,))
        self.draft_calls += 1
        self.draft_rows += len(entries)
        self.draft_widest = max(self.draft_widest, len(entries))
        return out

    def end(self, seq: int = 0) -> None:
        """Remove the draft's positions (the target's verify batch is mirrored next)."""
        _lc.llama_memory_seq_rm(self._mem, seq, self.seq(seq).n, -1)

    def step_cost(self, steps: int = 8) -> float:
        """Seconds per draft step, timed now over `steps` steps after the cached tokens of
        sequence 0 (what auto prices the heads by, as it prices a draft model's token)."""
        token = self._target.tokens[-1] if self._target.tokens else 0
        t0 = time.perf_counter()
        self.start(token)
        for _ in range(steps - 1):
            self.step(token)
        took = time.perf_counter() - t0
        self.end()
        return took / steps

    def close(self) -> None:
        if getattr(self, "_ptr", None):
            self.follow(False)
            _lc.llama_batch_ext_free(self._batch)
            _lc.llama_free(self._ptr)
            self._ptr = None


class HeadView:
    """One slot's sequence of the heads, as MtpDrafter drafts with it: each draft step is a
    DecodeRequest (engine/backend/decode_requests.py) that the engine loop batches with the
    other slots' (the StepBatcher groups them by `ctx`, the MtpHead, and calls its
    decode_batch: one llama_process for every slot drafting in that round; `drafts`: before
    the target's batch, as a draft model's steps)."""

    drafts = True

    def __init__(self, head: MtpHead, target: SeqContext, batcher: StepBatcher):
        self.ctx, self.seq, self.target, self.batcher = head, target.seq, target, batcher
        self.others = 0  # what the StepBatcher notes of each request's batch
        self.decode_s = 0.0

    @property
    def n(self) -> int:
        return self.ctx.seq(self.seq).n

    @property
    def tokens(self) -> Sequence[int]:
        """The slot's tokens the head holds (a HybridDrafter's catch-up check: none lags)."""
        return self.target.tokens[:self.n]

    def start_steps(self, token: int) -> Steps[np.ndarray]:
        self.ctx.begin(self.seq)
        return (yield from self.step_steps(token))

    def step_steps(self, token: int) -> Steps[np.ndarray]:
        request = DecodeRequest(self, (token,), LAST, self.ctx.seq(self.seq).pos)
        yield request
        if not request.done:
            raise RuntimeError("a slot's generation must be stepped by engine/loop/step_loop.py")
        if request.error is not None:
            raise request.error
        return request.rows[0]

    def end(self) -> None:
        self.ctx.end(self.seq)

    def run_alone(self, request: DecodeRequest) -> None:
        self.batcher.run([request])

    def step_cost(self) -> float:
        return self.ctx.step_cost()


def use_mtp(ctx: Context, on: bool) -> MtpHead | None:
    """Let the model's MTP heads follow `ctx` (on: every decode's tokens and hidden rows go to
    them, as llama-server's draft-mtp; off: decoding costs what it did). A head that missed
    decodes of sequence 0 while off makes the context go back to where it stopped. None when
    off."""
    head = ctx.follower
    if on and head is None:
        head = ctx.follower = MtpHead(ctx)
    if head is None:
        return None
    head.follow(on)
    if on and head.n != len(ctx.tokens):
        ctx.truncate(min(head.n, len(ctx.tokens)))
    return head if on else None


def slot_heads(ctx: Context, target: SeqContext, batcher: StepBatcher) -> HeadView:
    """The heads following the shared context `ctx` (every slot's decodes go to them from
    now on), seen from one slot (`target`, its view of ctx). A slot's sequence the heads
    missed decodes of is not evaluated again: they follow it from its next decode on."""
    head = ctx.follower
    if head is None:
        head = ctx.follower = MtpHead(ctx)
    if not head.following:
        head.follow(True)
    return HeadView(head, target, batcher)
