"""The slots `serve` decodes together, planned once (commands/compose.py) and handed whole to
the engine (SessionOptions.sequences: `total`) and to serve's scheduler (Scheduler(plan=...):
which of them are kept for short requests); and the engine's word on which pairs may have
more than one (one_slot_reason), which serve asks and PairSession holds to."""
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


def one_slot_reason(*, strategy: str, exact: bool, rpc: bool) -> str | None:
    """Why a pair decodes one sequence only, not several in one batch; None: it may take
    several. The target on RPC servers, or exact mode (`exact`: the target context's). A
    hybrid or recurrent model takes several: each sequence goes back from its own snapshots
    and copies (engine/backend/sequences.py); so do MTP heads, which follow every sequence
    (engine/backend/mtp.py). No `strategy` needs one slot now; it is asked for the one
    that would."""
    if rpc:
        return "the target is on RPC servers"
    if exact:
        return ("exact mode (a row decoded beside other sequences' rows is not bit-identical "
                "to the same row alone)")
    return None
