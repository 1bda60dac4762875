"""How a context's memory goes back to an earlier position, by its type, without llama.cpp.

attention       the KV cache drops the positions (llama_memory_seq_rm), anywhere.
sliding window  the same: llama.cpp's default cache for it is full-size (swa_full), so it
                still holds what a position far back attends to (measured).
hybrid          recurrent layers beside attention ones (LFM2, Qwen3.5, Nemotron-H): llama.cpp
                keeps snapshots of the recurrent state for the last tokens of the LAST batch
                only (n_rs_seq), and a removal outside them fails or, after single-token
                decodes, leaves a wrong state; elsewhere a saved copy of the recurrent state
                is restored and the tokens after it evaluated again.
recurrent       Mamba, RWKV: no snapshots; only saved copies.

engine/backend/llama.py makes the calls; this module decides which one a rollback takes
(RollbackPlan) and keeps the copies (StateCopies). The type names and their words are
models/memory_type.py's, which tells them from a GGUF header before a model loads."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tandem.config.schema import FIELDS_BY_KEY
from tandem.models.memory_type import ATTENTION, HYBRID, RECURRENT, SLIDING

Buffer = Any  # the bytes llama.cpp wrote (a ctypes array, handed back as it is)

# copies of the recurrent state a context keeps by default (the setting ctx_checkpoints,
# llama-server's --ctx-checkpoints, whose default is 32; per context, the oldest go first)
MAX_COPIES = FIELDS_BY_KEY["ctx_checkpoints"].default


def memory_type(is_hybrid: bool, is_recurrent: bool, n_swa: int) -> str:
    """The type from llama.cpp's own answers (llama_model_is_hybrid / _is_recurrent /
    llama_model_n_swa)."""
    if is_hybrid:
        return HYBRID
    if is_recurrent:
        return RECURRENT
    return SLIDING if n_swa > 0 else ATTENTION


# Exact mode on CPU kernels: the most rows a verify batch may have and still give the logits
# of single-token decoding bit for bit, where a memory type needs fewer than attention's
# EXACT_BATCH (scripts/batch_invariance.py, exact context, 2 threads). A hybrid decodes plain:
# the tiny LFM2 differs from 2 rows on (0.0002 at 100 cached tokens) where the tiny llama
# model is identical at 2 rows (both f32, f16 KV); no real hybrid weights were at hand.
# Sliding windows keep EXACT_BATCH: the real Gemma 3 270M is identical up to 7 rows at 100,
# 400 and 700 tokens (past its 512-token window) and differs from 8, as attention does.
EXACT_ROWS = {HYBRID: 1}


def keeps_copies(kind: str) -> bool:
    """Whether going back may need a saved copy of the state (the recurrent part)."""
    return kind in (HYBRID, RECURRENT)


@dataclass
class StateCopies:
    """Saved copies of a context's recurrent state by position: copy p is the state after
    the cache's first p tokens. A copy past a rollback's position is dropped (its tokens are
    gone); beyond `limit` the oldest taken goes."""

    limit: int = MAX_COPIES
    by_pos: dict[int, Buffer] = field(default_factory=dict)

    def keep(self, pos: int, data: Buffer) -> None:
        self.by_pos.pop(pos, None)
        self.by_pos[pos] = data  # insertion order: the oldest first
        while len(self.by_pos) > self.limit:
            self.by_pos.pop(next(iter(self.by_pos)))

    def nearest(self, n: int) -> tuple[int, Buffer | None]:
        """The copy at the largest position <= n; (0, None): none, start from nothing."""
        best = max((p for p in self.by_pos if p <= n), default=None)
        return (0, None) if best is None else (best, self.by_pos[best])

    def drop_after(self, n: int) -> None:
        for p in [p for p in self.by_pos if p > n]:
            del self.by_pos[p]

    def clear(self) -> None:
        self.by_pos.clear()


@dataclass
class RollbackPlan:
    """Which way a context of memory type `kind` goes back to position n. `depth`: the
    tokens llama.cpp keeps snapshots for (llama_n_rs_seq; 0 for most models)."""

    kind: str
    depth: int = 0
    # where the last decode began: its snapshots cover a removal back to batch_start + 1
    # (llama.cpp writes none for the state before the batch); None: no decode since the
    # last rollback (snapshots are single-use)
    batch_start: int | None = None
    # a snapshot rollback not yet applied: llama.cpp applies it at the next decode, and until
    # then a copy would read the state before it
    pending: bool = False

    def decoded(self, start: int) -> None:
        self.batch_start, self.pending = start, False

    def by_snapshot(self, n: int, length: int) -> bool:
        """Whether removing positions n..length-1 is one llama.cpp's snapshots undo exactly."""
        return (self.kind == HYBRID and self.batch_start is not None
                and self.batch_start < n and length - n <= self.depth)

    def rolled_back(self) -> None:
        self.batch_start, self.pending = None, True

    def restored(self) -> None:
        self.batch_start, self.pending = None, False
