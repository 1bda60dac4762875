"""The binding to llama.cpp (llama_cpp): contexts, batched decode, KV rollback; the models
they run come from model.py, re-exported here with the process-wide set-up, so callers import
the backend from this module.

Logits are returned as zero-copy numpy views of llama.cpp's output buffer; a view is valid
until the next decode on the same context. Each context requests logits only for the rows
that need them, so llama.cpp's host buffer never exceeds (rows of the largest batch) x n_vocab.

Over 400 lines because every ctypes call of a context (batches, logits views, rollback,
sequence copies, the opt-in timer) stays here, behind a small API. A Context's one hook for
what follows its decodes is its Follower: the MTP heads' context (engine/backend/mtp.py)
binds its own calls beside this module.
"""
from __future__ import annotations

import ctypes
import time
from dataclasses import replace
from typing import Callable, Protocol, Sequence

import numpy as np

from tandem.engine.backend.context_params import (  # noqa: F401 - re-exported: the backend's API
    ALL, EXACT_BATCH, LAST, MAX_OUTPUTS, ContextParams, common_prefix, default_threads,
    exact_context, prefill_in_chunks)
from tandem.engine.backend.decode_requests import DecodesAtOnce, run_now
from tandem.engine.backend.memory import (EXACT_ROWS, HYBRID, RECURRENT, RollbackPlan, StateCopies,
                                          keeps_copies)
# first: model.py says what a missing llama_cpp means (a ModelError with the rebuild hint)
from tandem.engine.backend.model import (  # noqa: F401 - re-exported: the backend's API
    LLAMA_CPP_VERSION, Model, capture_log, init_backend, supports_gpu_offload, system_info)
from tandem.errors import ContextOverflowError, ModelError

import llama_cpp as _lc  # (after model.py, which reports it missing)

# llama_get_logits returning the buffer's address as an int: the binding's pointer result
# costs an object and a ctypes.addressof() per decode to turn into the key of a cached view
_logits_address = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)(
    ctypes.cast(_lc.llama_get_logits, ctypes.c_void_p).value)

# copies of the recurrent state only: the attention KV of a hybrid is truncated as usual
_PARTIAL = _lc.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
_NO_ROWS = np.empty((0, 0), dtype=np.float32)  # a batch that asked for no logits
KV_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "bf16": 30}
FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}


def llama_context_params(params: ContextParams):
    """llama.cpp's context parameters for ContextParams (a Context's, an MtpHead's)."""
    cp = _lc.llama_context_default_params()
    cp.n_ctx = params.n_ctx
    cp.n_batch = params.n_batch
    cp.n_ubatch = min(params.n_ubatch, params.n_batch)
    cp.n_seq_max = params.n_seq_max
    cp.kv_unified = params.kv_unified
    cp.n_outputs_max = params.n_outputs_max
    threads = params.n_threads or default_threads()
    cp.n_threads = threads
    cp.n_threads_batch = params.n_threads_batch or threads
    cp.flash_attn_type = FLASH_ATTN[params.flash_attn]
    cp.type_k = KV_TYPES[params.type_k]
    cp.type_v = KV_TYPES[params.type_v]
    cp.no_perf = False
    return cp


class Follower(Protocol):
    """What follows a Context's decodes (MtpHead, engine/backend/mtp.py), of sequence 0 and
    of every slot's (decode_batch): told of every rollback and thread count, closed before
    the context. It gets decodes only while `following` (off, decoding costs what it did).
    Cache reuse is off while it follows (moved runs are positions it would not see); a reuse
    while it does not is a rollback to where the moved runs start. A slot's view
    (engine/backend/sequences.py SeqContext) tells it of its own sequence's rollbacks."""

    following: bool

    def decoded(self, tokens: Sequence[int], pos0: int) -> None:
        """The context just evaluated `tokens` at positions pos0.. of sequence 0."""

    def decoded_batch(self, entries: Sequence[tuple[int, int, Sequence[int], int]]) -> None:
        """The context just evaluated decode_batch's `entries` in one llama_decode."""

    def truncated(self, n: int, seq: int = 0) -> None:
        """Sequence `seq` went back to its first n positions."""

    def copied(self, src: int, dst: int, n: int) -> None:
        """Sequence `dst` holds positions 0..n-1 of `src` now, and nothing else (seq_cp)."""

    def set_threads(self, n: int) -> None:
        """The context decodes with n threads from now on."""

    def close(self) -> None:
        """The context is closing (it reads from it until then)."""


class Context(DecodesAtOnce):
    """A llama.cpp context on one sequence, which remembers the tokens its KV cache holds."""

    def __init__(self, model: Model, params: ContextParams = ContextParams()):
        self.model = model
        self.params = params
        cp = llama_context_params(params)
        # snapshots of a batch's last recurrent states (0 where the architecture has none)
        cp.n_rs_seq = params.rollback if model.memory == HYBRID else 0
        # the counts decoding uses now (set_threads changes them on the live context)
        self.n_threads, self.n_threads_batch = cp.n_threads, cp.n_threads_batch
        ptr = _lc.llama_init_from_model(model._ptr, cp)
        self.notes: list[str] = []  # what this context could not do as asked (run statistics)
        if not ptr and (params.type_k, params.type_v) != ("f16", "f16"):
            # a quantized KV cache needs head sizes that are a multiple of its block (32);
            # models that do not have them get the f16 cache instead
            cp.type_k = cp.type_v = KV_TYPES["f16"]
            ptr = _lc.llama_init_from_model(model._ptr, cp)
            self.notes.append(
                f"KV cache {params.type_k}/{params.type_v} does not fit {model.path.name}'s "
                "attention heads: f16 used instead"
                + (", with which verify batches are bit-identical to single-token decoding "
                   "only below 512 cached tokens" if params.exact and not model.fully_on_gpu
                   else ""))
            params = replace(params, type_k="f16", type_v="f16")
            self.params = params
        if not ptr:
            raise ModelError(f"llama.cpp could not create a context for {model.path.name}",
                             "try a smaller --ctx-size, or f16 KV cache types")
        self._ptr = ptr
        self.n_ctx = _lc.llama_n_ctx(ptr)
        # several sequences split the context: each holds n_ctx_seq positions (decode_batch)
        self.n_seq_max, self.n_ctx_seq = _lc.llama_n_seq_max(ptr), _lc.llama_n_ctx_seq(ptr)
        self.n_batch, self.n_ubatch = _lc.llama_n_batch(ptr), _lc.llama_n_ubatch(ptr)  # <= n_ctx
        # the largest verify batch generate() may send: one llama_decode call (n_batch) with
        # logits on every row, and within EXACT_BATCH where exact mode runs CPU kernels
        limit = min(params.n_outputs_max, self.n_batch)
        if params.exact and not model.fully_on_gpu:
            limit = min(limit, EXACT_BATCH)
        if params.exact and model.remote:
            self.notes.append("exact mode with the target on RPC servers: bit-identity is "
                              "tested with CPU rpc-servers (unrepacked weights there); GPU "
                              "servers' kernels were not measured")
        elif params.exact and model.fully_on_gpu:
            self.notes.append("exact mode on a GPU target: batch invariance of GPU kernels was "
                              "not measured, so greedy output may differ from plain decoding "
                              "at near ties")
        self.verify_limit = max(self._plan_rollback(model, ptr, limit), 1)
        self._mem = _lc.llama_get_memory(ptr)
        self._batch = _lc.llama_batch_init(max(self.n_batch, 1), 0, 1)
        for i in range(self.n_batch):
            self._batch.n_seq_id[i] = 1
            self._batch.seq_id[i][0] = 0
        # the batch's arrays, read once: each read of a ctypes Structure field builds a new
        # pointer object, which in the decode loop costs more than the assignments themselves
        self._tok, self._pos, self._want = self._batch.token, self._batch.pos, self._batch.logits
        self._max_rows = min(self.n_batch, params.n_outputs_max)
        # logits views by (buffer address, rows): building one costs microseconds per decode,
        # and llama.cpp keeps its output buffer until it needs a larger one
        self._views: dict[tuple[int, int], np.ndarray] = {}
        self.tokens: list[int] = []  # what the KV cache holds, position i -> tokens[i]
        # llama-server's --cache-reuse: cached runs of at least this many tokens that a new
        # prompt holds at another position are moved there (their positions shifted), not
        # evaluated again; 0: off. Not bit-identical to evaluating them, so exact mode keeps 0
        self.reuse_min = 0
        self.n_reused = 0  # tokens moved rather than evaluated, since creation
        self.max_logit_rows = 0  # the largest number of logits rows ever requested
        self.n_decoded = 0  # tokens evaluated since creation (prompt + generated)
        self.t_llama = 0.0  # seconds inside llama.cpp's loop calls, while time_llama() is on
        self.time_llama(False)
        # what follows this context's decodes: the model's MTP heads (engine/backend/mtp.py)
        self.follower: Follower | None = None

    def _plan_rollback(self, model: Model, ptr, limit: int) -> int:
        """How this context goes back (engine/backend/memory.py), and the verify batch it
        allows: a rejected draft is undone from the verify batch's snapshots, so drafts are
        no longer than they reach; a model without any decodes plain (a copy and a second
        decode of the accepted tokens every step was not measured to pay)."""
        self.rollback = RollbackPlan(model.memory, _lc.llama_n_rs_seq(ptr))
        self.copies = StateCopies(max(1, self.params.checkpoints))
        self._tracks_batches = keeps_copies(model.memory)  # decode() notes where a batch began
        # why drafts are capped below what the batch allows (generate() says it when they are)
        self.memory_note: str | None = None
        if keeps_copies(model.memory) and limit > self.rollback.depth + 1:
            limit = self.rollback.depth + 1
            self.memory_note = _memory_note(model, self.rollback.depth)
        exact_rows = EXACT_ROWS.get(model.memory)
        if self.params.exact and not model.fully_on_gpu and exact_rows and limit > exact_rows:
            limit = exact_rows
            self.notes.append(
                f"exact mode on a {model.memory} model: llama.cpp's batch kernels give other "
                f"floats than single tokens from {exact_rows + 1} rows on, so "
                + ("it decodes plain" if exact_rows == 1
                   else f"drafts are capped at {exact_rows - 1}") + " to stay bit-identical")
        return limit

    def time_llama(self, on: bool = True) -> None:
        """Opt-in: add the time spent inside llama.cpp's decode, logits and KV-removal calls to
        t_llama, so that wall time minus it is the host's own cost (scripts/bench_host.py).
        Off, the loop calls llama.cpp's functions directly and reads no clock."""
        calls = (_lc.llama_decode, _logits_address, _lc.llama_memory_seq_rm)
        if on:
            calls = tuple(self._timed(fn) for fn in calls)
        self._llama_decode, self._get_logits, self._seq_rm = calls

    def _timed(self, fn):
        clock = time.perf_counter

        def call(*args):
            t0 = clock()
            try:
                return fn(*args)
            finally:
                self.t_llama += clock() - t0
        return call

    def set_threads(self, n: int) -> None:
        """Decode with `n` threads from now on, single tokens and batches alike (engine/tuning/threads.py
        chooses n); llama.cpp takes it on the live context, nothing is reallocated."""
        if (n, n) != (self.n_threads, self.n_threads_batch):
            _lc.llama_set_n_threads(self._ptr, n, n)
            if self.follower is not None:  # it decodes beside this context, on its cores
                self.follower.set_threads(n)
            self.n_threads = self.n_threads_batch = n

    def close(self) -> None:
        if getattr(self, "follower", None) is not None:  # (none where init failed)
            self.follower.close()  # before the context it reads from
            self.follower = None
        if getattr(self, "_ptr", None):
            _lc.llama_batch_free(self._batch)
            _lc.llama_free(self._ptr)
            self._ptr = None

    def __del__(self):
        self.close()

    @property
    def n_vocab(self) -> int:
        return self.model.n_vocab

    def truncate(self, n: int) -> None:
        """Forget cache positions n.. (rollback of rejected drafts, a shorter prefix): the KV
        cache truncated; a hybrid's recurrent state from the last batch's snapshots, else
        from the nearest saved copy (checkpoint()) with the tokens after it evaluated again."""
        length = len(self.tokens)
        if n >= length:
            return
        if self.follower is not None:
            self.follower.truncated(n)
        plan = self.rollback
        if not keeps_copies(plan.kind):
            if not self._seq_rm(self._mem, 0, n, -1):
                raise ModelError("llama.cpp could not roll back the KV cache",
                                 f"{self.model.path.name} has {plan.kind} memory; run with "
                                 "--verbose to see llama.cpp's log")
            del self.tokens[n:]  # a sliding window's cache is full-size (swa_full): the same
            return
        self.copies.drop_after(n)
        if plan.by_snapshot(n, length) and self.seq_back(0, n):
            plan.rolled_back()
            del self.tokens[n:]
            return
        self._restore(n)

    def checkpoint(self) -> None:
        """Save a copy of the state here when a rollback to here may need one (a hybrid or
        recurrent model: before decodes that are undone whole, such as a draft model's
        single-token steps or a timing probe); nothing for attention-only memory."""
        if not keeps_copies(self.rollback.kind) or not self.tokens:
            return
        if self.rollback.pending:  # the copy would read the state before that rollback
            self._restore(len(self.tokens))
        self.copies.keep(len(self.tokens), self.state_copy(0))

    def state_copy(self, seq: int):
        """A copy of sequence `seq`'s recurrent state (checkpoint(), a slot's copies)."""
        size = _lc.llama_state_seq_get_size_ext(self._ptr, seq, _PARTIAL)
        buf = (ctypes.c_uint8 * size)()
        if _lc.llama_state_seq_get_data_ext(self._ptr, buf, size, seq, _PARTIAL) != size:
            raise ModelError("llama.cpp could not copy the recurrent state",
                             "run with --verbose to see llama.cpp's log")
        return buf

    def restore_copy(self, seq: int, pos: int, data) -> None:
        """Sequence `seq` back at position `pos` from a state_copy() taken there (None: at 0,
        from nothing): its recurrent state put back, its attention cells past `pos` removed."""
        if data is None:
            ok = self._seq_rm(self._mem, seq, 0, -1)  # removing everything always works
        else:
            ok = _lc.llama_state_seq_set_data_ext(self._ptr, data, len(data), seq, _PARTIAL) > 0
            ok = ok and self._seq_rm(self._mem, seq, pos, -1)  # the attention part past it
        if not ok:
            raise ModelError("llama.cpp could not restore the saved state",
                             "run with --verbose to see llama.cpp's log")

    def seq_back(self, seq: int, n: int) -> bool:
        """Remove positions n.. of sequence `seq` where llama.cpp can (always for attention;
        a recurrent state only inside its last batch's snapshots); False where it cannot."""
        return bool(self._seq_rm(self._mem, seq, n, -1))

    def copy_marks(self, n: int, start: int = 0) -> tuple[int, ...]:
        """Where a prompt of n tokens, `start` of them cached, keeps copies of the state besides
        its end, so that a next prompt that differs shortly before this one's end starts from
        one: llama-server's context checkpoints, 4 + n_ubatch and 4 tokens before the end
        (server-context.cpp), and `start`, where this prompt parts from the last one (an
        editor's next keystroke parts a little further on: it then evaluates what was typed
        since, not the last n_ubatch tokens). None for attention, which truncates anywhere."""
        if not keeps_copies(self.rollback.kind):
            return ()
        return tuple(sorted({p for p in (start, n - 4 - self.n_ubatch, n - 4)
                             if start <= p < n and p > 0}))

    def _restore(self, n: int) -> None:
        """Go back to position n from the nearest saved copy at or before it (none: from
        nothing), evaluating the tokens between again."""
        pos, data = self.copies.nearest(n)
        again = self.tokens[pos:n]
        self.restore_copy(0, pos, data)
        del self.tokens[pos:]
        self.copies.drop_after(pos)
        self.rollback.restored()
        for start in range(0, len(again), self.n_batch):
            self.decode(again[start:start + self.n_batch])

    def decode(self, tokens: Sequence[int], all_logits: bool = False,
               checkpoint: bool = False) -> np.ndarray:
        """Evaluate tokens after the cached ones; logits of the last row, or of every row.
        `checkpoint`: then save a copy of the state (checkpoint()), for decodes that follow
        one token at a time and may be undone (a draft model's steps).

        Returns a (rows, n_vocab) float32 view into llama.cpp's buffer (no copy).
        """
        n = len(tokens)
        if n == 0:
            raise ValueError("decode() needs at least one token")
        if len(self.tokens) + n > self.n_ctx:
            raise ContextOverflowError(
                f"{len(self.tokens) + n} tokens do not fit the context of {self.n_ctx}",
                "shorten the prompt or raise --ctx-size")
        if all_logits and n > self._max_rows:
            raise ValueError("all_logits decode is limited to n_batch and n_outputs_max rows")
        follower = self.follower
        if follower is not None and not follower.following:
            follower = None
        if self._tracks_batches:
            self.rollback.decoded(len(self.tokens) + (n - 1) // self.n_batch * self.n_batch)
        if n <= self.n_batch:  # one llama_decode call: the loop's case
            self._fill(tokens, len(self.tokens), all_logits, True)
            rc = self._llama_decode(self._ptr, self._batch)
            if rc != 0:
                decode_failed(rc)
            if follower is not None:
                follower.decoded(tokens, len(self.tokens))
            self.tokens.extend(tokens)
        else:
            for start in range(0, n, self.n_batch):
                chunk = tokens[start:start + self.n_batch]
                self._fill(chunk, len(self.tokens), all_logits, start + len(chunk) == n)
                rc = self._llama_decode(self._ptr, self._batch)
                if rc != 0:
                    decode_failed(rc)
                if follower is not None:
                    follower.decoded(chunk, len(self.tokens))
                self.tokens.extend(chunk)
        self.n_decoded += n
        rows = n if all_logits else 1
        if rows > self.max_logit_rows:
            self.max_logit_rows = rows
        if checkpoint:
            self.checkpoint()
        return self._logits_view(rows)

    def _logits_view(self, rows: int) -> np.ndarray:
        key = (self._get_logits(self._ptr), rows)  # the address also synchronises a GPU
        view = self._views.get(key)
        if view is None:
            if len(self._views) >= 4 * MAX_OUTPUTS:  # buffers that were replaced
                self._views.clear()
            ptr = ctypes.cast(key[0], ctypes.POINTER(ctypes.c_float))
            view = self._views[key] = np.ctypeslib.as_array(ptr, shape=(rows, self.n_vocab))
        return view

    def decode_batch(self, entries: Sequence[tuple[int, int, Sequence[int], int]]) -> np.ndarray:
        """The one llama_decode of several sequences' tokens: entries of (sequence, position
        of the first token, tokens, which rows want logits: NONE, LAST or ALL). Positions are
        the caller's to keep (engine/backend/sequences.py); returns the wanted rows in the
        entries' order, a view as decode()'s."""
        n = sum(len(e[2]) for e in entries)
        out = sum(len(e[2]) if e[3] == ALL else (1 if e[3] == LAST else 0) for e in entries)
        if not 0 < n <= self.n_batch or out > self._max_rows:
            raise ValueError("a batch takes 1 to n_batch tokens, logits on at most "
                             "n_outputs_max rows")
        tok, pos, want, seq_id = self._tok, self._pos, self._want, self._batch.seq_id
        i = 0
        try:  # (a refusal half-way resets the ids written before it too)
            for seq, start, toks, rows in entries:
                if not 0 <= seq < self.n_seq_max or not toks:
                    raise ValueError(f"sequence {seq}: ids go from 0 to {self.n_seq_max - 1} "
                                     "(n_seq_max), each with at least one token")
                last = len(toks) - 1
                for j, t in enumerate(toks):
                    tok[i], pos[i], seq_id[i][0] = t, start + j, seq
                    want[i] = 1 if rows == ALL or (rows == LAST and j == last) else 0
                    i += 1
            self._batch.n_tokens = n
            rc = self._llama_decode(self._ptr, self._batch)
        finally:
            for i in range(n):  # decode() writes tokens and positions only: sequence 0's
                seq_id[i][0] = 0
        if rc != 0:
            decode_failed(rc)
        follower = self.follower
        if follower is not None and follower.following:
            follower.decoded_batch(entries)
        self.n_decoded += n
        if out > self.max_logit_rows:
            self.max_logit_rows = out
        return self._logits_view(out) if out else _NO_ROWS

    def seq_rm(self, seq: int, n: int) -> None:
        """Remove positions n.. of a sequence whose positions the caller keeps (attention
        memory: engine/backend/sequences.py)."""
        if not self._seq_rm(self._mem, seq, n, -1):
            raise ModelError("llama.cpp could not roll back the KV cache",
                             "this model's memory type does not support partial removal")

    def seq_cp(self, src: int, dst: int, n: int) -> None:
        """Sequence `dst` holds positions 0..n-1 of `src` as well (a unified KV cache shares
        the cells: nothing is computed or copied)."""
        _lc.llama_memory_seq_cp(self._mem, src, dst, 0, n)

    def seq_state(self, seq: int) -> bytes:
        """A copy of one sequence's cache (llama-server's --cache-ram keeps them)."""
        size = _lc.llama_state_seq_get_size(self._ptr, seq)
        buf = (ctypes.c_uint8 * size)()
        if _lc.llama_state_seq_get_data(self._ptr, buf, size, seq) != size:
            raise ModelError("llama.cpp could not copy a sequence's cache",
                             "run with --verbose to see llama.cpp's log")
        return bytes(buf)

    def set_seq_state(self, seq: int, data: bytes) -> bool:
        """Put a copy from seq_state() into sequence `seq` (emptied first); False where
        llama.cpp found no room for it."""
        self._seq_rm(self._mem, seq, 0, -1)
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        return _lc.llama_state_seq_set_data(self._ptr, buf, len(data), seq) > 0

    def _fill(self, chunk: Sequence[int], pos0: int, all_logits: bool, last_chunk: bool) -> None:
        tok, pos, want = self._tok, self._pos, self._want
        self._batch.n_tokens = len(chunk)
        flag = 1 if all_logits else 0
        for i, t in enumerate(chunk):
            tok[i] = t
            pos[i] = pos0 + i
            want[i] = flag
        if last_chunk:
            want[len(chunk) - 1] = 1

    def reuse(self, tokens: Sequence[int]) -> int:
        """Past the common prefix, move the cached runs that `tokens` holds further on
        (reuse_min tokens or more) to their new positions, as llama-server's cache reuse
        does (server-context.cpp): a keystroke that changes the prefix's end then costs the
        changed span, not the suffix and the chunks after it. Returns how many tokens moved;
        the cache then holds a longer common prefix with `tokens`."""
        follower = self.follower  # one that follows must see every position evaluated
        if self.reuse_min <= 0 or follower is not None and follower.following:
            return 0
        start = common_prefix(self.tokens, tokens)
        moved = self.reuse_seq(0, self.tokens, tokens, self.reuse_min)
        if moved and follower is not None:  # positions from `start` on are not what it saw
            follower.truncated(start)
        return moved

    def reuse_seq(self, seq: int, cache: list[int], tokens: Sequence[int], min_run: int) -> int:
        """reuse() on sequence `seq`, whose tokens `cache` lists (updated in place)."""
        if not _lc.llama_memory_can_shift(self._mem):
            return 0
        head_c = head_p = common_prefix(cache, tokens)
        moved = 0
        while head_c < len(cache) and head_p < len(tokens):
            n = 0
            while (head_c + n < len(cache) and head_p + n < len(tokens)
                   and cache[head_c + n] == tokens[head_p + n]):
                n += 1
            if n >= min_run:
                self._seq_rm(self._mem, seq, head_p, head_c)
                _lc.llama_memory_seq_add(self._mem, seq, head_c, head_c + n, head_p - head_c)
                cache[head_p:head_p + n] = cache[head_c:head_c + n]
                head_c += n
                head_p += n
                moved += n
            else:
                head_c += 1
        if moved:
            self._seq_rm(self._mem, seq, head_p, -1)
            del cache[head_p:]
            self.n_reused += moved
        return moved

    def prefill(self, tokens: Sequence[int],
                progress: Callable[[int, int], None] | None = None) -> int:
        """Make the cache hold exactly `tokens`, reusing the common prefix (and moved runs,
        reuse()); no logits needed.

        Returns how many tokens were evaluated (0 when the cache already held them all),
        those a recurrent state restored from a copy evaluated again included.
        """
        return run_now(prefill_in_chunks(self, tokens, self.decode_steps, progress))

    def sync(self, tokens: Sequence[int]) -> np.ndarray:
        """Make the cache hold exactly `tokens` and return the last one's logits.

        The last token is always (re)evaluated, since a past decode's logits are gone.
        """
        if not tokens:
            raise ValueError("sync() needs at least one token")
        self.prefill(tokens[:-1])
        return self.decode(tokens[-1:])[0]

    def perf(self) -> dict:
        data = _lc.llama_perf_context(self._ptr)
        return {"t_p_eval_ms": data.t_p_eval_ms, "t_eval_ms": data.t_eval_ms,
                "n_p_eval": data.n_p_eval, "n_eval": data.n_eval}


def _memory_note(model: Model, depth: int) -> str:
    if model.memory == RECURRENT or depth == 0:
        return (f"no drafting: {model.path.name} is a {model.memory} model whose state "
                "llama.cpp cannot roll back (no snapshots); it decodes plain")
    return (f"drafts capped at {depth}: {model.path.name} is a hybrid model whose recurrent "
            f"state llama.cpp rolls back only over its last {depth} tokens (n_rs_seq)")


def decode_failed(rc: int) -> None:
    if rc == 1:
        raise ContextOverflowError("no room left in the KV cache",
                                   "raise --ctx-size or shorten the prompt")
    raise ModelError(f"llama_decode failed with code {rc}",
                     "run with --verbose to see llama.cpp's log")
