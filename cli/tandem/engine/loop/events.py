"""What generate() yields: plain data for the CLI, the chat view and the benchmark recorder."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # stats.py folds these events, so it imports this module
    from tandem.engine.loop.stats import GenStats


@dataclass(frozen=True)
class PrefillEvent:
    """Prompt evaluation progress: `done` of `total` new prompt tokens evaluated."""

    done: int
    total: int
    n_prompt: int


# TokenEvent and StepEvent come once a token / a step: slots and no frozen-ness make them 4x
# cheaper to build (a frozen dataclass sets each field through object.__setattr__)
@dataclass(slots=True)
class TokenEvent:
    token: int
    text: str  # text released with this token (may be empty while a stop string is pending)
    from_draft: bool  # proposed by the drafter and accepted by the target
    step: int


@dataclass(slots=True)
class StepEvent:
    """One draft -> verify round."""

    step: int
    drafted: int
    accepted: int
    n_max: int  # draft length asked of the drafter this step
    t_draft: float
    t_verify: float
    t_sample: float
    # (source, drafted, accepted) per draft source of this step (config.schema.DRAFT_SOURCES),
    # where the drafter says (PairSession.generate adds it); empty otherwise
    sources: tuple[tuple[str, int, int], ...] = ()
    # the first `forced` drafted tokens were the grammar's (free), the rest the drafter's
    forced: int = 0


@dataclass(frozen=True)
class DoneEvent:
    stats: GenStats
    reason: str  # "eos", "length", "stop", "context"
    text: str
    tokens: tuple[int, ...]
    # under a grammar: whether the output is a complete match (False: cut by max tokens, the
    # context or a stop string before the grammar was done); None without a grammar
    complete: bool | None = None
