"""MTP heads in every slot (engine/backend/mtp.py HeadView, issue 53): the heads follow every
slot's sequence of the shared context, and one head decode runs the draft steps of every slot
that drafts in a round. On the tiny MTP model (glm4moe, attention) and the tiny Qwen3.5
replica (hybrid, with its head): four slots under mtp and auto, greedy, each answer equal to
the same request alone, with drafts accepted and rejected; the conversations continued (a
second turn on each slot) still equal alone."""
from __future__ import annotations

import pytest

pytest.importorskip("llama_cpp")

from tandem.engine.backend.context_params import ContextParams  # noqa: E402
from tandem.engine.drafting.drafters import DraftParams  # noqa: E402
from tandem.engine.loop.events import DoneEvent  # noqa: E402
from tandem.engine.loop.speculative import GenParams  # noqa: E402
from tandem.engine.loop.step_loop import StepLoop  # noqa: E402
from tandem.engine.pair import PairSession, SessionOptions  # noqa: E402

from engine_helpers import assert_same_as_plain, session_done  # noqa: E402
from test_slots import run_all  # noqa: E402

CTX = ContextParams(n_ctx=512, n_threads=2)
DRAFT = DraftParams(n_max=4, n_min=0, p_min=0.0)
TEXTS = ["The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return",
         "One, two, three, four, five, six", "Hello"]


@pytest.fixture(scope="module", params=["mtp", "qwen35"])
def sessions(request, tiny_models):
    """(alone, shared): the model with its heads loaded, on one sequence and on four slots."""
    path = tiny_models[request.param]
    opts = SessionOptions(strategy="mtp", draft=DRAFT, target_ctx=CTX)
    alone = PairSession(path, None, opts)
    shared = PairSession(path, None, SessionOptions(strategy="mtp", draft=DRAFT,
                                                    target_ctx=CTX, sequences=4))
    yield alone, shared
    alone.close()
    shared.close()


def together(session, prompts, gen, strategy, slots=None):
    """Each prompt on its own slot (`slots`, default the session's), all at once (one engine
    loop steps them, as serve does); their DoneEvents."""
    done = [None] * len(prompts)

    def keep(i):
        def on_event(ev):
            if isinstance(ev, DoneEvent):
                done[i] = ev
            return True
        return on_event

    run_all(StepLoop(session.batcher),
            [(session.generate(prompts[i], gen, strategy, slot=(slots or session.slots)[i],
                               record=False), keep(i)) for i in range(len(prompts))])
    return done


def _equal_alone(alone, prompts, gen, strategy, done):
    for p, ev in zip(prompts, done):
        ref = session_done(alone, p, gen, strategy)
        assert_same_as_plain(alone.target, p, ref.tokens, ev.tokens)


@pytest.mark.parametrize("strategy", ["mtp", "auto"])
def test_four_slots_draft_with_the_heads_and_each_equals_alone(sessions, strategy):
    alone, shared = sessions
    gen = GenParams(max_tokens=40, ignore_eos=True)
    prompts = [shared.tokenize(t, add_special=True) for t in TEXTS]
    done = together(shared, prompts, gen, strategy)
    _equal_alone(alone, prompts, gen, strategy, done)
    head = shared.target_ctx.follower
    assert head is not None and head.following  # every slot's decodes went to the heads
    assert shared.batcher.figures.widest == 4
    if strategy == "mtp":
        drafted = sum(ev.stats.drafted for ev in done)
        accepted = sum(ev.stats.accepted for ev in done)
        assert 0 < accepted < drafted, (accepted, drafted)  # accepted and rejected
        assert all(ev.stats.drafted > 0 for ev in done)
        # one llama_process ran the draft steps of several slots at once
        assert head.draft_widest == 4 and head.draft_rows > head.draft_calls
    # the conversations go on: each slot's second turn as alone
    again = [p + list(ev.tokens[:5]) + shared.tokenize(" and then", add_special=False)
             for p, ev in zip(prompts, done)]
    done2 = together(shared, again, gen, strategy)
    _equal_alone(alone, again, gen, strategy, done2)
    if strategy == "mtp":
        assert sum(ev.stats.accepted for ev in done2) > 0


def test_each_slot_hands_the_heads_its_own_rows(sessions):
    """Four prompts read in one target batch (several sequences: llama.cpp gives their hidden
    rows back in the batch's order): each slot's first head step gives the logits the same
    prompt gives alone, so each sequence got its own rows; each slot's sequence in the
    heads' cache is where the target's is, and a slot's rollback takes the heads' with it."""
    import numpy as np

    alone, shared = sessions
    gen = GenParams(max_tokens=1, ignore_eos=True)
    prompts = [shared.tokenize(t, add_special=True) for t in TEXTS]
    for slot in shared.slots:  # each prompt read from its start (a row kept for the position
        slot.target.truncate(0)  # after a cached prefix is not the target's: zeros)
    done = together(shared, prompts, gen, "mtp")
    head = shared.target_ctx.follower
    for slot, p, ev in zip(shared.slots, prompts, done):
        state = head.seq(slot.target.seq)
        assert state.n == len(slot.target.tokens) == len(p) and state.base == 0
        head.begin(slot.target.seq)  # its first draft step, alone in a head decode
        got = head.decode_batch([(slot.target.seq, state.n, [ev.tokens[0]], 0)])[0]
        head.end(slot.target.seq)
        alone.target_ctx.truncate(0)  # read from its start, as the slot's was
        assert session_done(alone, p, gen, "mtp").tokens == ev.tokens
        ahead = alone.target_ctx.follower
        # the target's row at the prompt's end (another prompt's: 2.7 to 4.1 apart at most)
        np.testing.assert_allclose(state.pending, ahead._pending, atol=1e-2)
        want = ahead.start(ev.tokens[0])
        ahead.end()
        # a batch's floats move logits by up to 0.02 here (a head that read the prompt with
        # a zero row after its first token: 0.07 to 0.43)
        np.testing.assert_allclose(got, want, atol=0.05)
        assert int(np.argmax(got)) == int(np.argmax(want))
    view = shared.slots[1].target
    view.truncate(len(view.tokens) - 3)
    assert head.seq(view.seq).n == len(view.tokens)
    assert head.seq(shared.slots[0].target.seq).n == len(shared.slots[0].target.tokens)


def test_heads_off_for_a_lone_answer_then_a_slot_they_missed_is_followed_on(sessions):
    """A lone request that does not draft with the heads turns them off (they cost a head
    layer per token); the next mtp request on that slot continues a conversation the heads
    missed: they follow it from its next decode (no re-reading), still drafting, and the
    answer equals the same request alone."""
    alone, shared = sessions
    gen = GenParams(max_tokens=24, ignore_eos=True)
    slot = shared.slots[2]
    slot.target.truncate(0)
    # a prompt no other slot holds (a borrowed prefix brings the heads' cells with it)
    prompt = shared.tokenize("Zebras graze near the river bank at dawn.", add_special=True)
    first = together(shared, [prompt], gen, "none", [slot])[0]
    head = shared.target_ctx.follower
    assert not head.following and head.seq(slot.target.seq).n == 0
    again = prompt + list(first.tokens) + shared.tokenize(" And so", add_special=False)
    second = together(shared, [again], gen, "mtp", [slot])[0]
    state = head.seq(slot.target.seq)
    held = len(prompt) + len(first.tokens) - 1  # all but the answer's last token
    assert head.following and state.base == held
    assert second.stats.n_prompt_eval == len(again) - held  # the new turn only
    assert second.stats.drafted > 0
    ref = session_done(alone, again, gen, "mtp")
    assert_same_as_plain(alone.target, again, ref.tokens, second.tokens)


def test_auto_on_a_slot_prices_the_heads_for_the_batch_and_drafts_with_them(sessions,
                                                                            monkeypatch):
    """auto on a slot: the heads (the slot's HeadView) are its model source, priced as a draft
    model's token in the batch's costs (BatchCosts, a head step measured once); made to pay
    here (the tiny head costs a whole target step), they draft through the slot's batches
    and the answer equals plain decoding."""
    from tandem.engine.backend.mtp import HeadView
    from tandem.engine.drafting import auto
    from tandem.engine.drafting.mtp import MtpDrafter

    alone, shared = sessions
    shared.drafter("auto", slot=shared.slots[3])
    assert shared.costs(True).draft_token > 0  # a head step, measured (MtpHead.step_cost)
    monkeypatch.setattr(auto, "model_draft_gain", lambda costs, n_max, accept: 2.0)
    base = shared.costs(True).plain
    for costs in (shared.costs(False), shared.costs(True)):  # a flat curve, a cheap head
        monkeypatch.setattr(costs, "draft_token", 1e-7)
        monkeypatch.setattr(costs, "verify", {n: base * (1 + 0.001 * n) for n in (1, 8, 64)})
    drafter = shared.drafter("auto", slot=shared.slots[3])
    model = drafter.hybrid.model
    assert isinstance(model, MtpDrafter) and isinstance(model.head, HeadView)
    assert drafter.costs.shared and drafter.costs.draft_token == 1e-7  # the batch's costs
    gen = GenParams(max_tokens=40, ignore_eos=True)
    prompt = shared.tokenize(TEXTS[1], add_special=True)
    done = together(shared, [prompt], gen, "auto", [shared.slots[3]])[0]
    assert_same_as_plain(alone.target, prompt, session_done(alone, prompt, gen, "none").tokens,
                         done.tokens)
    assert done.stats.by_source.get("model", [0, 0])[0] > 0, done.stats.by_source


def test_a_prompt_piece_beside_a_step_leaves_the_steps_rows_as_decoded(sessions):
    """While the heads follow, a target decode writes their hidden rows into the output buffer
    just past its own logits rows (llama.cpp lays the buffer out again each decode): a prompt
    piece decoded after a round's steps overwrote a verify's rows past the fifth (a JSON
    answer's forced tokens and drafts, 13 rows, took a token 12.8 logits below the target's
    own). The round's steps decode last: each row is as decoded alone."""
    import numpy as np

    from tandem.engine.backend.context_params import ALL, NONE
    from tandem.engine.backend.mtp import slot_heads

    alone, shared = sessions
    a, b, c = (slot.target for slot in shared.slots[:3])
    slot_heads(shared.target_ctx, a, shared.batcher)  # the heads follow every slot
    for view in (a, b, c):
        view.truncate(0)
    prompt = shared.tokenize(TEXTS[0], add_special=True)
    step = prompt[-1:] + shared.tokenize(" It runs and runs and runs", add_special=False)
    assert len(step) > shared.target_ctx.n_seq_max  # rows a piece's layout would cover
    c.prefill(prompt[:-1])
    want = np.array(c.decode(step, all_logits=True))  # alone, on another slot
    a.prefill(prompt[:-1])
    steps = a.decode_steps(step, all_logits=True)
    piece = b.prefill_steps(shared.tokenize(TEXTS[2], add_special=True))
    requests = [next(steps), next(piece)]
    assert [r.want for r in requests] == [ALL, NONE]
    shared.batcher.run(requests)
    got = np.array(requests[0].rows)
    for g in (steps, piece):  # each resumed to its end (the views count the tokens held)
        with pytest.raises(StopIteration):
            next(g)
    np.testing.assert_allclose(got, want, atol=1e-4)
