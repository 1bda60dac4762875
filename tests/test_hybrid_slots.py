"""Hybrid and recurrent models in several slots (engine/backend/sequences.py): each sequence
goes back from its own snapshots (n_rs_seq per sequence) or its own copies of the state, so
four answers decoded in one batch each equal the same request alone, under every strategy;
a copy taken while a snapshot rollback is pending, and a copy restored, give the logits of
evaluating the tokens anew."""
from __future__ import annotations

import numpy as np
import pytest

from tandem.engine.backend.context_params import ContextParams
from tandem.engine.loop.speculative import GenParams
from tandem.engine.pair import PairSession, SessionOptions

from engine_helpers import assert_same_as_plain
from test_slots import PROMPTS, answer, together

CTX = ContextParams(n_ctx=512, n_threads=2)


@pytest.fixture(scope="module")
def hybrid_sessions(tiny_models):
    t, d = tiny_models["hybrid"], tiny_models["hybrid_draft"]
    alone = PairSession(t, d, SessionOptions(target_ctx=CTX))
    shared = PairSession(t, d, SessionOptions(target_ctx=CTX, sequences=4))
    yield alone, shared
    alone.close()
    shared.close()


def _count_rollbacks(monkeypatch, session):
    """How each context of `session` went back: {"snapshot": n, "copy": n}."""
    seen = {"snapshot": 0, "copy": 0}
    for ctx in (session.target_ctx, session.draft_ctx):
        back, restore = ctx.seq_back, ctx.restore_copy

        def seq_back(seq, n, _back=back):
            ok = _back(seq, n)
            seen["snapshot"] += ok
            return ok

        def restore_copy(seq, pos, data, _restore=restore):
            seen["copy"] += 1
            return _restore(seq, pos, data)

        monkeypatch.setattr(ctx, "seq_back", seq_back)
        monkeypatch.setattr(ctx, "restore_copy", restore_copy)
    return seen


@pytest.mark.parametrize("strategy", ["none", "ngram", "draft", "hybrid", "auto"])
def test_four_hybrid_slots_in_one_batch_each_equal_alone(hybrid_sessions, strategy,
                                                         monkeypatch):
    alone, shared = hybrid_sessions
    gen = GenParams(max_tokens=40, ignore_eos=True)
    ref = [answer(alone, p, gen, strategy) for p in PROMPTS]
    seen = _count_rollbacks(monkeypatch, shared)
    before = shared.batcher.figures.calls
    out = together(shared, PROMPTS, [gen] * len(PROMPTS), strategy)
    for p, a, b in zip(PROMPTS, ref, out):
        assert_same_as_plain(alone.target, p, a, b)
    assert shared.batcher.figures.calls > before and shared.batcher.figures.widest == 4
    if strategy == "draft":  # rejected drafts went back both ways
        assert seen["snapshot"] > 0 and seen["copy"] > 0, seen
    # the conversations go on: each slot comes back to its prompt's copies
    again = [p + list(a[:5]) + [7, 9] for p, a in zip(PROMPTS, ref)]
    ref2 = [answer(alone, p, gen, strategy) for p in again]
    for p, a, b in zip(again, ref2, together(shared, again, [gen] * len(again), strategy)):
        assert_same_as_plain(alone.target, p, a, b)


def test_a_recurrent_target_decodes_plain_in_every_slot(tiny_models):
    ctx = ContextParams(n_ctx=256, n_threads=2)
    r = tiny_models["recurrent"]
    with PairSession(r, None, SessionOptions(target_ctx=ctx, strategy="none")) as alone, \
            PairSession(r, None, SessionOptions(target_ctx=ctx, strategy="none",
                                                sequences=3)) as shared:
        gen = GenParams(max_tokens=24, ignore_eos=True)
        ref = [answer(alone, p, gen, "none") for p in PROMPTS[:3]]
        for p, a, b in zip(PROMPTS, ref, together(shared, PROMPTS[:3], [gen] * 3, "none")):
            assert_same_as_plain(alone.target, p, a, b)
        again = [p[:-2] + [5, 6, 7] for p in PROMPTS[:3]]  # back past the end: from copies
        ref2 = [answer(alone, p, gen, "none") for p in again]
        for p, a, b in zip(again, ref2, together(shared, again, [gen] * 3, "none")):
            assert_same_as_plain(alone.target, p, a, b)


def _fresh_logits(model, tokens):
    from tandem.engine.backend.llama import Context

    ctx = Context(model, ContextParams(n_ctx=256, n_threads=2))
    try:
        return np.array(ctx.decode(tokens)[0])
    finally:
        ctx.close()


def test_a_slot_goes_back_from_its_snapshots_and_copies_to_the_same_logits(hybrid_sessions):
    """On slot 2 of the shared context: a verify-sized batch undone from its snapshots, a copy
    taken while that rollback is pending, more tokens, then back to the copy with the owed
    tokens evaluated at the next decode: every logits row equals a fresh context's."""
    from tandem.engine.backend.decode_requests import run_now

    _, shared = hybrid_sessions
    view = shared.slots[2].target
    prompt = [1, 5, 17, 99, 3, 42, 7, 8, 9, 10]
    view.truncate(0)
    run_now(view.prefill_steps(prompt))
    run_now(view.decode_steps([11, 12, 13, 14], all_logits=True))
    view.truncate(len(prompt) + 1)  # snapshots undo 3 of the 4
    assert view.rollback.pending and view.held == len(prompt) + 1
    view.checkpoint()  # a copy while llama.cpp has not applied the rollback yet
    run_now(view.decode_steps([20, 21, 22]))
    view.truncate(len(prompt) + 2)  # the last batch's snapshots can undo 2: no copy needed
    view.truncate(len(prompt) + 1)  # pending: from the copy taken above
    assert view.held == len(prompt) + 1
    row = np.array(run_now(view.decode_steps([30]))[0])
    model = shared.target
    np.testing.assert_allclose(row, _fresh_logits(model, prompt + [11, 30]), atol=2e-4)
    view.truncate(len(prompt) - 3)  # before every copy but the prompt's own marks
    assert view.held <= len(prompt) - 3 and len(view.tokens) == len(prompt) - 3
    row = np.array(run_now(view.decode_steps([40]))[0])  # owed tokens first, then 40's row
    np.testing.assert_allclose(row, _fresh_logits(model, prompt[:-3] + [40]), atol=2e-4)
    assert view.tokens == prompt[:-3] + [40] and view.held == len(view.tokens)


def test_a_saved_slot_keeps_its_copies_where_it_is_put_back(hybrid_sessions):
    """save() (the RAM cache's copy) carries the slot's copies of its state: loaded into
    another slot, a prompt that parts before the end comes back to one of them, not to 0."""
    from tandem.engine.backend.decode_requests import run_now

    _, shared = hybrid_sessions
    a, b = shared.slots[1].target, shared.slots[3].target
    prompt = [1, 5, 17, 99, 3, 42, 7, 8, 9, 10, 11, 12]
    a.truncate(0)
    run_now(a.prefill_steps(prompt[:8]))
    a.checkpoint()  # a copy at 8, as a prompt's marks take them
    run_now(a.prefill_steps(prompt))
    saved = a.save()
    assert 8 in saved.copies and len(saved) > len(saved.data)
    assert b.load(prompt, saved) and b.held == len(prompt)
    b.truncate(10)  # back past the state put back: from the copy at 8
    assert b.held == 8
    row = np.array(run_now(b.decode_steps([50]))[0])
    np.testing.assert_allclose(row, _fresh_logits(shared.target, prompt[:10] + [50]),
                               atol=2e-4)
