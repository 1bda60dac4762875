"""The target model's multi-token-prediction heads as a draft source (MtpHead): a llama.cpp
context of type MTP made against the target's context, which follows its decodes, and the
calls of llama.cpp's staging API (src/llama-ext.h) that carry the target's hidden rows to it.

A binding module beside llama.py and model.py (tests/test_structure.py names them): it
builds on llama.py's Context and context parameters, and neither imports it.
"""
from __future__ import annotations

import ctypes
import time
from typing import Sequence

import llama_cpp as _lc
import numpy as np

from tandem.engine.backend.llama import Context, decode_failed, llama_context_params
from tandem.engine.backend.model import LLAMA_CPP_VERSION
from tandem.errors import ModelError

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


class MtpHead:
    """The model's multi-token-prediction head (its first nextn layer) in an MTP context of
    its own, made against the target's context as llama-server makes it
    (common_speculative_init_result: ctx_type MTP, ctx_other the target, n_ctx the target's)
    and driven as common/speculative.cpp's draft-mtp drives a single head. It is the target
    Context's follower (llama.py's Follower):

    - decoded(): after each target decode while following, the same tokens at the same positions, each paired
      with the target's hidden row (h_nextn, before the output norm) of the position before
      it; the first with the row kept from the batch before (pending). The head's KV cache
      then holds what the target's holds.
    - truncated(n): the target went back to n tokens: so does the head's cache, and the pending
      row becomes the target's row at position n - 1 (llama.cpp's accept()); one from an
      earlier batch is not kept (zeros, as for a sequence's first token: drafts only degrade).
    - start(token) / step(token): a draft, one head step per token: the target's last sampled
      token with the pending row, then each drafted token with the head's own hidden row;
      end() removes the draft's positions again.
    Chained heads (step35's) and a memory shared with the target (Gemma 4's assistants) are
    not driven: the first head drafts every position, as llama.cpp's default path does."""

    def __init__(self, target: Context):
        model = target.model
        if not model.mtp_loaded:
            raise ModelError(f"{model.path.name} was loaded without its MTP heads",
                             "load it with --strategy mtp")
        ext = staging_calls()
        cp = llama_context_params(target.params)
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
        ext.llama_set_embeddings_nextn(ptr, True, True)  # its own rows: output rows only
        self._mem = _lc.llama_get_memory(ptr)
        self._batch = _lc.llama_batch_ext_init(ptr)
        self.n = 0  # positions its cache holds: the target's first n
        self._rows = np.zeros((0, self.n_embd), dtype=np.float32)  # the last batch's rows
        self._rows_pos0 = 0
        self._pending = np.zeros(self.n_embd, dtype=np.float32)
        self._h = self._pending  # the head's latest hidden row (the next draft step's input)
        self._pos = 0  # the next draft step's position
        self._pos_buf = (_lc.llama_pos * 1)()
        self.following = False  # the target's decodes come here (follow())
        self.t_mirror = 0.0  # seconds the head spent following the target (its cost)
        self.n_mirrored = 0

    def follow(self, on: bool) -> None:
        """Have the target output its hidden rows (every row of a batch: unmasked) and send
        its decodes here, or not."""
        self._ext.llama_set_embeddings_nextn(self._target._ptr, on, False)
        self.following = on

    def set_threads(self, n: int) -> None:
        _lc.llama_set_n_threads(self._ptr, n, n)

    def _add(self, token: int, pos: int, h: np.ndarray, output: bool) -> None:
        idx = _lc.llama_batch_ext_add_token(self._batch, 0, token)
        self._pos_buf[0] = pos
        _lc.llama_batch_ext_set_pos(self._batch, idx, self._pos_buf)
        embd = _lc.llama_embd(h.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, self.n_embd)
        if idx < 0 or not _lc.llama_batch_ext_set_embd_token(self._batch, idx, embd):
            raise ModelError("llama.cpp refused a row of the MTP head's batch",
                             "run with --verbose to see llama.cpp's log")
        if output:
            _lc.llama_batch_ext_set_output_logits(self._batch, idx, True)

    def _process(self) -> None:
        rc = _lc.llama_process(self._ptr, _lc.LLAMA_PROCESS_TYPE_DECODE, self._batch)
        if rc != 0:
            decode_failed(rc)

    def decoded(self, tokens: Sequence[int], pos0: int) -> None:
        """The target just decoded `tokens` at pos0..: the same into the head's cache."""
        t0 = time.perf_counter()
        if pos0 < self.n:
            self.truncated(pos0)
        n = len(tokens)
        ptr = self._ext.llama_get_embeddings_nextn(self._target._ptr)
        if pos0 != self.n or not ptr:  # the head missed decodes: use_mtp() brings it back
            return
        rows = np.ctypeslib.as_array(ptr, shape=(n, self.n_embd)).copy()
        _lc.llama_batch_ext_clear(self._batch)
        for k, tok in enumerate(tokens):
            self._add(tok, pos0 + k, self._pending if k == 0 else rows[k - 1], False)
        self._process()
        self._rows, self._rows_pos0, self._pending = rows, pos0, rows[-1]
        self.n = pos0 + n
        self.n_mirrored += n
        self.t_mirror += time.perf_counter() - t0

    def truncated(self, n: int) -> None:
        """Forget positions n.. (the target went back to n tokens)."""
        if n >= self.n:
            return
        _lc.llama_memory_seq_rm(self._mem, 0, n, -1)
        self.n = n
        i = n - 1 - self._rows_pos0
        self._pending = (self._rows[i] if 0 <= i < len(self._rows)
                         else np.zeros(self.n_embd, dtype=np.float32))

    def start(self, token: int) -> np.ndarray:
        """The first draft step: `token` (the target's last, not yet decoded by it) at the
        position after the cached ones; the head's logits for the token after it."""
        self._pos, self._h = self.n, self._pending
        return self.step(token)

    def step(self, token: int) -> np.ndarray:
        """One more draft step: the logits (a copy) for the token after `token`."""
        _lc.llama_batch_ext_clear(self._batch)
        self._add(token, self._pos, self._h, True)
        self._process()
        self._pos += 1
        h = self._ext.llama_get_embeddings_nextn_ith(self._ptr, 0)
        self._h = np.ctypeslib.as_array(h, shape=(self.n_embd,)).copy()
        logits = _lc.llama_get_logits_ith(self._ptr, 0)
        return np.ctypeslib.as_array(logits, shape=(self.n_vocab,)).copy()

    def end(self) -> None:
        """Remove the draft's positions (the target's verify batch is mirrored next)."""
        _lc.llama_memory_seq_rm(self._mem, 0, self.n, -1)

    def step_cost(self, steps: int = 8) -> float:
        """Seconds per draft step, timed now over `steps` steps after the cached tokens (what
        auto prices the heads by, as it prices a draft model's token)."""
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


def use_mtp(ctx: Context, on: bool) -> MtpHead | None:
    """Let the model's MTP heads follow `ctx` (on: every decode's tokens and hidden rows go to
    them, as llama-server's draft-mtp; off: decoding costs what it did). A head that missed
    decodes while off makes the context go back to where it stopped. None when off."""
    head = ctx.follower
    if on and head is None:
        head = ctx.follower = MtpHead(ctx)
    if head is None:
        return None
    head.follow(on)
    if on and head.n != len(ctx.tokens):
        ctx.truncate(min(head.n, len(ctx.tokens)))
    return head if on else None
