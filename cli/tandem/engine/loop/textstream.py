"""Token bytes -> text, incrementally: UTF-8 split across tokens, and stop strings held back."""
from __future__ import annotations

import codecs
from typing import Sequence


class TextStream:
    """Feed token bytes, get the text that is safe to release.

    Text that could be the start of a stop string is held back until it is decided.
    """

    def __init__(self, stop: Sequence[str] = ()):
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = [s for s in stop if s]
        self._pending = ""
        self._parts: list[str] = []  # released text, joined when read (not once a token)
        self.stopped = False

    @property
    def text(self) -> str:
        """Everything released so far."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def feed(self, data: bytes) -> str:
        if self.stopped:
            return ""
        if not self._stop:  # nothing to hold back: the decoder's output is released as is
            out = self._decoder.decode(data)
            self._parts.append(out)
            return out
        self._pending += self._decoder.decode(data)
        return self._release(final=False)

    def flush(self) -> str:
        if self.stopped:
            return ""
        self._pending += self._decoder.decode(b"", final=True)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        hits = [(self._pending.find(s), s) for s in self._stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if hits:
            cut = min(i for i, _ in hits)
            out = self._pending[:cut]
            self._pending = ""
            self.stopped = True
        elif final or not self._stop:
            out, self._pending = self._pending, ""
        else:
            hold = self._holdback()
            out = self._pending[:len(self._pending) - hold]
            self._pending = self._pending[len(self._pending) - hold:]
        self._parts.append(out)
        return out

    def _holdback(self) -> int:
        """Length of the longest suffix of pending text that is a prefix of a stop string."""
        best = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(self._pending)), best, -1):
                if self._pending.endswith(s[:n]):
                    best = n
                    break
        return best
