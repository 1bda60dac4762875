"""From a strategy name (config.schema.STRATEGIES) and the draft length to a drafter.

PairSession supplies what the drafters draw on (the draft model's context, the cost model,
the library, the kept knowledge, the target's MTP heads) through `DrafterParts`; this module
alone decides which drafter a strategy is and what it needs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

from tandem.config.schema import check_strategy
from tandem.engine.drafting.auto import AutoDrafter
from tandem.engine.tuning.costs import CostModel
from tandem.engine.drafting.drafters import Drafter, DraftModelDrafter, DraftParams, NgramDrafter, NoDrafter
from tandem.engine.drafting.hybrid import HybridDrafter, HybridPolicy
from tandem.engine.drafting.history import Library
from tandem.engine.drafting.mtp import MtpDrafter
from tandem.engine.tuning.knowledge import Knowledge
from tandem.errors import UsageError

if TYPE_CHECKING:
    from tandem.engine.backend.llama import Context
    from tandem.engine.backend.mtp import MtpHead


def need_draft_model(strategy: str) -> UsageError:
    """The one refusal of a strategy that needs a draft model where there is none."""
    return UsageError(f"strategy {strategy!r} needs a draft model",
                      "pass --model-draft PATH, a pair name, or --strategy ngram")


def need_mtp_heads(model: str, loaded: bool = False, arch: str | None = None) -> UsageError:
    """The one refusal of --strategy mtp where the target has no MTP heads (or they were not
    loaded: a chat started with another strategy; or llama.cpp runs no head for its
    architecture, `arch`)."""
    others = ("use --strategy ngram or auto with this model, or a draft model (-md DRAFT "
              "--strategy draft); `tandem pairs` lists models with MTP heads")
    if arch is not None:
        return UsageError(f"{model} has MTP layers, but llama.cpp runs no MTP head for its "
                          f"architecture ({arch})", others)
    if loaded:
        return UsageError(f"{model} was loaded without its MTP heads",
                          "start with --strategy mtp to load them")
    return UsageError(f"strategy 'mtp' needs a model with MTP heads (nextn layers); {model} "
                      "has none", others)


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
    # the target's MTP heads made to follow it (True) or not (False): None where it has none
    mtp: Callable[[bool], MtpHead | None] = lambda on: None
    mtp_loaded: bool = False  # the target was loaded with its heads: auto may draft with them


def make_drafter(strategy: str, draft: DraftParams, parts: DrafterParts) -> Drafter:
    check_strategy(strategy)
    head = parts.mtp(strategy == "mtp")  # heads that no drafter reads cost nothing
    if strategy == "mtp":
        return MtpDrafter(head, draft)
    if strategy == "none":
        return NoDrafter()
    if strategy == "ngram":
        return NgramDrafter(draft)
    model = None
    if parts.draft_ctx is not None:
        model = DraftModelDrafter(parts.draft_ctx, draft)
    if strategy == "draft":
        if model is None:
            raise need_draft_model(strategy)
        return model
    if strategy == "hybrid":  # fixed lengths: its costs are only recorded, never read
        return HybridDrafter(model, draft, CostModel(), HybridPolicy(), sources=None, budget=None)
    costs, calibrated = parts.costs(False), parts.costs(True)
    heads = None
    if model is None and parts.mtp_loaded:  # no draft model: the target's heads draft
        heads = MtpDrafter(parts.mtp(True), draft)
        # priced as a draft model's token: a head step measured now (this configuration has
        # no draft model whose token cost the calibration would hold)
        if calibrated.draft_token <= 0:
            calibrated.draft_token = heads.head.step_cost()
        if costs.draft_token <= 0:
            costs.draft_token = calibrated.draft_token
    auto = AutoDrafter(heads or model, draft, costs, verify_limit=parts.verify_limit,
                       calibrated=calibrated, notes=parts.notes(), library=parts.library,
                       knowledge=parts.knowledge())
    if heads is not None and auto.model is None:  # they do not pay: they stop following
        parts.mtp(False)
    return auto
