"""engine/slot_plan.py: the slot plan serve hands the engine and the scheduler, and the
engine's word on which pairs take one slot only, each reason worded as `serve` says it."""
from __future__ import annotations

from dataclasses import replace

import pytest

from tandem.engine.slot_plan import SlotPlan, one_slot_reason


def test_a_plan_counts_its_kept_slots_in_its_total():
    assert SlotPlan(4, kept=1).total == 5 and SlotPlan(1).total == 1
    for regular, kept in ((0, 0), (2, -1)):
        with pytest.raises(ValueError):
            SlotPlan(regular, kept)


def _reason(strategy="draft", exact=False, rpc=False):
    return one_slot_reason(strategy=strategy, exact=exact, rpc=rpc)


def test_each_reason_for_one_slot():
    assert _reason() is None  # a pair batches, whatever its models' memory
    assert _reason(strategy="none") is None
    assert _reason(rpc=True) == "the target is on RPC servers"
    assert _reason(exact=True) == (
        "exact mode (a row decoded beside other sequences' rows is not bit-identical to the "
        "same row alone)")
    assert _reason(strategy="mtp") is None  # the heads follow every sequence
    # the first that applies: the server before the mode
    assert _reason(exact=True, rpc=True) == "the target is on RPC servers"
    assert _reason(strategy="mtp", exact=True).startswith("exact mode")


def test_the_engine_refuses_several_sequences_it_cannot_batch(tiny_models):
    """PairSession itself refuses `sequences > 1` for a pair one_slot_reason names (serve
    asks first; any other caller hears it from the engine), and takes a plain pair."""
    from tandem.engine.backend.context_params import ContextParams
    from tandem.engine.pair import PairSession, SessionOptions
    from tandem.errors import UsageError

    ctx = ContextParams(n_ctx=256, n_threads=1)
    with pytest.raises(UsageError, match="3 sequences in one batch: exact mode") as info:
        PairSession(tiny_models["target"], tiny_models["draft"],
                    SessionOptions(target_ctx=replace(ctx, exact=True), sequences=3,
                                   strategy="draft"))
    assert "--parallel 1" in info.value.hint
    with PairSession(tiny_models["target"], tiny_models["draft"],
                     SessionOptions(target_ctx=ctx, sequences=3, strategy="draft")) as s:
        assert len(s.slots) == 3
