"""The RAM prompt cache (llama-server's --cache-ram): conversations a slot held before it
took another prompt, kept as copies of both models' sequences within a bound in bytes, and
put back into a slot when a later prompt continues one further than the slot's own cache
does (a chat's next turn after the editors took its slot)."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

from tandem.engine.backend.context_params import common_prefix

if TYPE_CHECKING:
    from tandem.engine.backend.sequences import SavedSequence


@dataclass(eq=False)
class CachedPrompt:
    tokens: list[int]
    target: SavedSequence
    draft_tokens: list[int] = field(default_factory=list)
    draft: SavedSequence | None = None
    used: float = field(default_factory=time.monotonic)

    @property
    def size(self) -> int:
        return len(self.target) + (len(self.draft) if self.draft is not None else 0)

    def shared(self, tokens: Sequence[int]) -> int:
        return common_prefix(self.tokens, tokens)


@dataclass
class CacheFigures:
    kept: int = 0
    restored: int = 0
    evicted: int = 0
    too_large: int = 0  # copies larger than the whole bound, not kept


class PromptCache:
    """Copies of slots' sequences (engine.pair.Slot) up to `limit` bytes; the least recently
    used go first. 0: nothing is kept."""

    def __init__(self, limit: int):
        self.limit = max(0, limit)
        self.entries: list[CachedPrompt] = []
        self.figures = CacheFigures()
        self._lock = threading.RLock()  # size is read inside keep()

    @property
    def size(self) -> int:
        with self._lock:  # (read by /health on HTTP's thread while the engine's changes it)
            return sum(e.size for e in self.entries)

    def best(self, tokens: Sequence[int]) -> CachedPrompt | None:
        """The copy that shares most of `tokens` (None: none shares any)."""
        with self._lock:
            best = max(self.entries, key=lambda e: e.shared(tokens), default=None)
        return best if best is not None and best.shared(tokens) > 0 else None

    def keep(self, slot) -> bool:
        """Copy what `slot` holds; False where the bound does not allow it."""
        if self.limit <= 0 or not slot.target.tokens:
            return False
        data = slot.target.save()  # first: what it holds may be fewer tokens (SeqContext.save)
        entry = CachedPrompt(list(slot.target.tokens), data)
        if slot.draft is not None and slot.draft.tokens:
            data = slot.draft.save()
            entry.draft_tokens, entry.draft = list(slot.draft.tokens), data
        if entry.size > self.limit:
            self.figures.too_large += 1
            return False
        with self._lock:
            # a copy this one extends says nothing more
            self.entries = [e for e in self.entries
                            if e.shared(entry.tokens) < len(e.tokens)]
            while self.entries and self.size + entry.size > self.limit:
                self.entries.remove(min(self.entries, key=lambda e: e.used))
                self.figures.evicted += 1
            self.entries.append(entry)
            self.figures.kept += 1
        return True

    def clear(self, slots: Sequence) -> int:
        """Each of `slots` (idle ones, as a request starts on another) kept here and emptied:
        attention spans every cell of the unified KV cache in use, so idle conversations
        slowed every step of the others (measured on the CPU: 1.6-5% a step beside 2,800
        idle tokens), as llama-server's --cache-idle-slots (on by default) avoids; one this
        cache cannot take stays. The number emptied."""
        emptied = 0
        for slot in slots:
            if slot.target.tokens and self.keep(slot):
                slot.target.truncate(0)
                if slot.draft is not None:
                    slot.draft.truncate(0)
                emptied += 1
        return emptied

    def restore(self, entry: CachedPrompt, slot) -> bool:
        """Put `entry` into `slot`, a copy staying here: a prompt that shares only its start
        (a system prompt) cuts the slot's, not the conversation (keep() drops it once the
        slot's extends it); False where llama.cpp found no room, the slot then empty."""
        entry.used = time.monotonic()
        ok = slot.target.load(entry.tokens, entry.target)
        if ok and slot.draft is not None:
            if entry.draft is None or not slot.draft.load(entry.draft_tokens, entry.draft):
                slot.draft.truncate(0)
        if ok:
            self.figures.restored += 1
        return ok
