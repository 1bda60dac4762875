"""`auto`: hybrid drafting tuned to this machine, as one named drafter.

It drafts n-gram continuations when a match of 2+ tokens exists (up to AUTO_NGRAM_CAP tokens,
within the verify limit: they cost no draft time) and the draft model otherwise, each with an
adaptive length from its measured acceptance and this machine's costs, and falls back to plain
decoding while speculation measures slower (adaptive.py). The draft model is used at all only
where the calibrated costs predict it can pay; the decision and the costs used are its notes.
"""
from __future__ import annotations

from typing import Sequence

from tandem.engine.adaptive import model_draft_gain
from tandem.engine.costs import MAX_BATCH, CostModel
from tandem.engine.drafters import DraftModelDrafter, HybridDrafter

# the draft model is used only where the calibrated costs predict at least this speedup at
# this acceptance per position: measured overheads (syncs, sampling) eat a gain this small
AUTO_MODEL_GAIN = 1.15
AUTO_MODEL_ACCEPT = 0.9
AUTO_NGRAM_CAP = MAX_BATCH - 1  # within the verify limit (exact mode on a CPU: EXACT_BATCH - 1)


class AutoDrafter(HybridDrafter):
    """`costs`: this machine's cost model, refined by the steps; `calibrated`: the calibration
    it started from, which the draft-model decision reads (its draft and verify figures share
    one context, while refinement moves only the verify costs: the draft is not run when off).
    `n_max` is the draft model's longest draft; `notes` are said once, after the decision."""

    def __init__(self, model: DraftModelDrafter | None, costs: CostModel, *, n_min: int = 0,
                 n_max: int = 4, verify_limit: int = MAX_BATCH,
                 calibrated: CostModel | None = None, notes: Sequence[str] = ()):
        decided: list[str] = []
        if model is not None:
            gain = model_draft_gain(calibrated or costs, n_max, AUTO_MODEL_ACCEPT)
            if gain < AUTO_MODEL_GAIN:
                model = None
                decided.append(f"draft model off: this machine's costs predict {gain:.2f}x at "
                               f"{AUTO_MODEL_ACCEPT:.0%} acceptance "
                               f"(needs {AUTO_MODEL_GAIN:.2f}x)")
        super().__init__(model, ngram_match=2, costs=costs, n_min=n_min, n_max=n_max,
                         adaptive=True, guard=True, name="auto",
                         ngram_cap=min(AUTO_NGRAM_CAP, verify_limit - 1), ngram_n=8)
        self.notes += decided + [costs.describe()] + list(notes)
