"""The slots `serve` decodes together, planned once (commands/compose.py) and handed whole to
the engine (SessionOptions.sequences: `total`) and to serve's scheduler (Scheduler(plan=...):
which of them are kept for short requests); and the engine's word on which pairs may have
more than one (one_slot_reason), which serve asks and PairSession holds to."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from tandem.errors import TandemError
from tandem.models import memory_type
from tandem.models.gguf_meta import read_gguf_header


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


def one_slot_reason(*, strategy: str, exact: bool, rpc: bool,
                    models: Sequence[Path | None]) -> str | None:
    """Why a pair decodes one sequence only, not several in one batch; None: it may take
    several. The target on RPC servers, exact mode (`exact`: the target context's), the
    MTP heads, or one of `models` (the target and drafts; None: no draft) whose state goes
    back only from copies (hybrid, recurrent: read from its header; a file whose header
    does not read is left to the loader, which says what is wrong with it)."""
    if rpc:
        return "the target is on RPC servers"
    if exact:
        return ("exact mode (a row decoded beside other sequences' rows is not bit-identical "
                "to the same row alone)")
    if strategy == "mtp":
        return "the MTP heads follow one sequence"
    for path in models:
        try:
            header = read_gguf_header(path) if path is not None else None
        except (TandemError, OSError):
            header = None
        kind = memory_type.describe(header)[0] if header is not None else None
        if kind in (memory_type.HYBRID, memory_type.RECURRENT):
            return f"{path.name} is a {kind} model (its state goes back only from copies)"
    return None
