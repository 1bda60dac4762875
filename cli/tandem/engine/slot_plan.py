"""The slots `serve` decodes together, planned once (commands/compose.py) and handed whole to
the engine (SessionOptions.sequences: `total`) and to serve's scheduler (Scheduler(plan=...):
which of them are kept for short requests)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SlotPlan:
    """`regular` slots any request may take, and `kept` more for short requests only (an
    editor's keystroke while long answers hold the others): the first `regular` of the
    pair's sequences are the regular ones."""

    regular: int
    kept: int = 0

    def __post_init__(self):
        if self.regular < 1 or self.kept < 0:
            raise ValueError(f"a slot plan of {self.regular} + {self.kept} slots")

    @property
    def total(self) -> int:
        """The sequences the pair holds: one per slot, kept ones included."""
        return self.regular + self.kept
