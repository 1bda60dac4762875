"""From a strategy name (config.schema.STRATEGIES) and the draft length to a drafter.

PairSession supplies what the drafters draw on (the draft model's context, the cost model,
the library, the kept knowledge) through `DrafterParts`; this module alone decides which
drafter a strategy is and what it needs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

from tandem.config.schema import FIELDS_BY_KEY, check_strategy
from tandem.engine.drafting.auto import AutoDrafter
from tandem.engine.tuning.costs import CostModel
from tandem.engine.drafting.drafters import Drafter, DraftModelDrafter, HybridDrafter, NgramDrafter, NoDrafter
from tandem.engine.drafting.history import Library
from tandem.engine.tuning.knowledge import Knowledge
from tandem.errors import UsageError

if TYPE_CHECKING:
    from tandem.engine.backend.llama import Context


@dataclass(frozen=True)
class DraftParams:
    """The draft length and its stops; the drafter built from them owns them from there
    (generate() only bounds each step by the room it has). The ranges are the settings'
    (config.schema: n_max, n_min, p_min), whoever sets them: flags, files, chat, spec-bench."""

    n_max: int = 4
    n_min: int = 0
    p_min: float = 0.5

    def __post_init__(self):
        for key in ("n_max", "n_min", "p_min"):
            field = FIELDS_BY_KEY[key]
            _, problem = field.check(getattr(self, key))
            if problem:
                raise UsageError(f"{field.label} {problem}",
                                 "llama.cpp's default is 3; 4-16 are typical"
                                 if key == "n_max" else None)
        if self.n_min > self.n_max:
            raise UsageError(f"draft min must be in 0..draft max ({self.n_max}), got {self.n_min}",
                             None)


def need_draft_model(strategy: str) -> UsageError:
    """The one refusal of a strategy that needs a draft model where there is none."""
    return UsageError(f"strategy {strategy!r} needs a draft model",
                      "pass --model-draft PATH, a pair name, or --strategy ngram")


@dataclass
class DrafterParts:
    """What a session lends its drafters: the draft model's context (None: no draft model)
    and, for auto, the costs (the refined model and the calibration), the notes to say once,
    the library and the kept knowledge, each fetched only when auto is built."""

    draft_ctx: Context | None
    verify_limit: int
    costs: Callable[[bool], CostModel]  # calibrated -> the cost model
    notes: Callable[[], Sequence[str]]
    library: Library
    knowledge: Callable[[], Knowledge]


def make_drafter(strategy: str, draft: DraftParams, parts: DrafterParts) -> Drafter:
    check_strategy(strategy)
    if strategy == "none":
        return NoDrafter()
    if strategy == "ngram":
        return NgramDrafter(draft.n_max)
    model = None
    if parts.draft_ctx is not None:
        model = DraftModelDrafter(parts.draft_ctx, draft.n_max, draft.n_min, draft.p_min)
    if strategy == "draft":
        if model is None:
            raise need_draft_model(strategy)
        return model
    if strategy == "hybrid":
        return HybridDrafter(model, n_min=draft.n_min, n_max=draft.n_max)
    costs, calibrated = parts.costs(False), parts.costs(True)
    return AutoDrafter(model, costs, n_min=draft.n_min, n_max=draft.n_max,
                       verify_limit=parts.verify_limit, calibrated=calibrated,
                       notes=parts.notes(), library=parts.library, knowledge=parts.knowledge())
