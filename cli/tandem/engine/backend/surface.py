"""DecodingSurface: what generate() and every drafter use of a context.

Two classes implement it: Context (engine/backend/llama.py), a whole llama.cpp context that
run, chat and spec-bench decode on, and SeqContext (engine/backend/sequences.py), one slot's
sequence of a shared context that serve's engine loop batches. tests/test_structure.py checks
that both have every member, so a change to one cannot leave the other behind.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Sequence

import numpy as np

from tandem.engine.backend.decode_requests import Steps

if TYPE_CHECKING:
    from tandem.engine.backend.context_params import ContextParams
    from tandem.engine.backend.model import Model


class DecodingSurface(Protocol):
    model: Model  # the vocabulary and metadata
    params: ContextParams
    tokens: list[int]  # what the cache holds, in order
    n_ctx: int
    n_batch: int  # the most tokens one decode takes
    verify_limit: int  # the most rows one verify batch may ask logits for
    notes: list[str]  # what the context decided that a report shows
    memory_note: str | None  # why drafts are capped by the model's memory (None: they are not)
    reuse_min: int
    n_decoded: int

    @property
    def n_threads(self) -> int: ...

    def decode(self, tokens: Sequence[int], all_logits: bool = False,
               checkpoint: bool = False) -> np.ndarray:
        """At once: the rows after `tokens` (views into llama.cpp's buffer)."""

    def decode_steps(self, tokens: Sequence[int], all_logits: bool = False,
                     checkpoint: bool = False) -> Steps[np.ndarray]:
        """decode() as steps (engine/backend/decode_requests.py): what generate() calls."""

    def prefill(self, tokens: Sequence[int]) -> int:
        """Hold exactly `tokens` (the common prefix kept); how many were evaluated."""

    def prefill_steps(self, tokens: Sequence[int]) -> Steps[int]:
        """prefill() as steps."""

    def truncate(self, n: int) -> None:
        """Keep the first n tokens."""

    def reuse(self, tokens: Sequence[int]) -> int:
        """Move cached runs that `tokens` shares (cache reuse); how many tokens moved."""

    def checkpoint(self) -> None:
        """Keep a copy of the state to go back to (a recurrent model's; attention: nothing)."""

    def copy_marks(self, n: int, start: int = 0) -> tuple[int, ...]:
        """Where a prefill of n tokens from `start` should stop to keep a copy."""


SURFACE = ("model", "params", "tokens", "n_ctx", "n_batch", "verify_limit", "notes", "memory_note", "reuse_min",
           "n_decoded", "n_threads", "decode", "decode_steps", "prefill", "prefill_steps",
           "truncate", "reuse", "checkpoint", "copy_marks")
