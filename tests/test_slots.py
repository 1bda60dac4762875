"""Several generations in one batch (engine/backend/sequences.py, PairSession slots): each
answer equals the same request alone, whatever the strategy, a grammar or sampling; a
generation that stops leaves the batch and the others go on; drafts are priced for the batch
they join (BatchCosts) with scripted cost curves of a steep host and a flat one."""
from __future__ import annotations

import json

import numpy as np
import pytest

from tandem.engine.backend.context_params import ContextParams
from tandem.engine.backend.memory import RollbackPlan
from tandem.engine.backend.sequences import SeqContext, StepBatcher
from tandem.engine.drafting.adaptive import longest_paying
from tandem.engine.loop.events import DoneEvent, TokenEvent
from tandem.engine.loop.sampling import SamplingParams
from tandem.engine.loop.speculative import GenParams
from tandem.engine.loop.step_loop import Generation, StepLoop
from tandem.engine.pair import PairSession, SessionOptions
from tandem.engine.tuning.costs import BatchCosts, CostModel
from tandem.models.memory_type import ATTENTION

from engine_helpers import assert_same_as_plain

CTX = ContextParams(n_ctx=512, n_threads=2)
PROMPTS = [[1, 5, 17, 99, 3, 42, 7] * 3, [1, 8, 8, 8, 120, 64] * 4,
           [1, 200, 2, 41, 41, 9, 10, 11] * 2, [1, 33, 44, 55]]


def answer(session, prompt, gen, strategy, slot=None):
    if slot is not None:  # a slot's decodes wait for the engine loop's batch
        return together(session, [prompt], [gen], strategy, [slot])[0]
    for ev in session.generate(prompt, gen, strategy, record=False):
        if isinstance(ev, DoneEvent):
            return ev.tokens


def run_all(loop, generations):
    """Step `loop` until the generations ((events, on_event) pairs) are all over, as serve's
    engine thread does; a generation's failure fails the test."""
    errors = []
    for events, on_event in generations:
        loop.add(Generation(events, on_event, lambda error: errors.append(error)))
    while loop.live:
        loop.step()
    assert [e for e in errors if e is not None] == []


def together(session, prompts, gens, strategy, slots=None):
    """Each prompt on its own slot with its GenParams, all at once (one engine loop steps
    them, as serve runs them)."""
    out = [None] * len(prompts)

    def keep(i):
        def on_event(ev):
            if isinstance(ev, DoneEvent):
                out[i] = ev.tokens
            return True
        return on_event

    run_all(StepLoop(session.batcher),
            [(session.generate(prompts[i], gens[i], strategy,
                               slot=(slots or session.slots)[i], record=False), keep(i))
             for i in range(len(prompts))])
    return out


@pytest.fixture(scope="module")
def sessions(tiny_models):
    t, d = tiny_models["target"], tiny_models["draft"]
    alone = PairSession(t, d, SessionOptions(target_ctx=CTX))
    shared = PairSession(t, d, SessionOptions(target_ctx=CTX, sequences=4))
    yield alone, shared
    alone.close()
    shared.close()


@pytest.mark.parametrize("strategy", ["none", "ngram", "draft", "hybrid", "auto"])
def test_four_slots_in_one_batch_each_equal_alone(sessions, strategy):
    """Greedy answers are token-identical, near-ties aside (a row's floats depend a little on
    the batch: assert_same_as_plain allows a top-2 gap below 1e-3 where they part)."""
    alone, shared = sessions
    gen = GenParams(max_tokens=48, ignore_eos=True)
    ref = [answer(alone, p, gen, strategy) for p in PROMPTS]
    before = shared.batcher.figures.calls
    for p, a, b in zip(PROMPTS, ref, together(shared, PROMPTS, [gen] * len(PROMPTS), strategy)):
        assert_same_as_plain(alone.target, p, a, b)
    f = shared.batcher.figures
    assert f.calls > before and f.widest == 4 and f.seconds > 0  # they did share batches


def test_constrained_and_penalised_slots_beside_a_sampled_one_equal_alone(sessions):
    """Each sequence keeps its own grammar state, penalty history and random stream. A
    sampled answer is not compared token for token: a row's floats depend a little on the
    batch it is in (other rows, other kernels), which moves a draw near a boundary."""
    from tandem.engine.constrain.grammar import Constraint

    alone, shared = sessions
    schema = Constraint("json_schema", json.dumps({"type": "object", "properties": {
        "a": {"type": "integer"}}, "required": ["a"]}))
    gens = [GenParams(max_tokens=40, sampling=SamplingParams(temperature=0.8, seed=7),
                      ignore_eos=True),
            GenParams(max_tokens=40, constraint=schema),
            GenParams(max_tokens=40, sampling=SamplingParams(repeat_penalty=1.3)),
            GenParams(max_tokens=40, ignore_eos=True)]
    ref = [answer(alone, p, g, "draft") for p, g in zip(PROMPTS, gens)]
    out = together(shared, PROMPTS, gens, "draft")
    assert len(out[0]) == 40
    for i in (1, 2, 3):
        assert_same_as_plain(alone.target, PROMPTS[i], ref[i], out[i])
    assert "a" in json.loads(b"".join(alone.target.piece(t) for t in out[1]))


def test_a_generation_that_stops_leaves_the_batch(sessions):
    alone, shared = sessions
    gen = GenParams(max_tokens=64, ignore_eos=True)
    ref = answer(alone, PROMPTS[1], gen, "draft")
    got: dict[str, object] = {"stopped": 0}

    def stopped(ev):  # ended after five tokens, as a client that goes away
        got["stopped"] += isinstance(ev, TokenEvent)
        return got["stopped"] < 5

    def whole(ev):
        if isinstance(ev, DoneEvent):
            got["whole"] = ev.tokens
        return True

    run_all(StepLoop(shared.batcher),
            [(shared.generate(PROMPTS[0], gen, "draft", slot=shared.slots[0], record=False),
              stopped),
             (shared.generate(PROMPTS[1], gen, "draft", slot=shared.slots[1], record=False),
              whole)])
    assert got["stopped"] == 5
    assert_same_as_plain(alone.target, PROMPTS[1], ref, got["whole"])
    assert shared.batcher.members == 0


def test_a_prompt_borrows_the_prefix_another_slot_holds(sessions):
    """Slot 0 answered a prompt; two prompts that continue its first 40 tokens, sent at once
    to empty slots, evaluate only what follows (the cells are shared in the unified cache,
    not read again) and answer as they do alone."""
    alone, shared = sessions
    gen = GenParams(max_tokens=24, ignore_eos=True)
    base = PROMPTS[0] + PROMPTS[1]
    answer(shared, base, gen, "draft", shared.slots[0])
    prompts = [base[:40] + [77, 78, 79], base[:40] + [5, 6]]
    for slot in shared.slots[1:3]:
        slot.target.truncate(0)
        slot.draft.truncate(0)
    before = [slot.target.borrowed for slot in shared.slots[1:3]]
    done = [None, None]

    def keep(i):
        def on_event(ev):
            if isinstance(ev, DoneEvent):
                done[i] = ev
            return True
        return on_event

    run_all(StepLoop(shared.batcher),
            [(shared.generate(prompts[i], gen, "draft", slot=shared.slots[i + 1], record=False),
              keep(i)) for i in range(2)])
    for i, p in enumerate(prompts):
        assert done[i].stats.n_prompt_eval == len(p) - 40  # what follows the borrowed
        assert shared.slots[i + 1].target.borrowed - before[i] == 40
        assert_same_as_plain(alone.target, p, answer(alone, p, gen, "draft"),
                             list(done[i].tokens))


class RecordingContext:
    """A context that records each llama_decode's sequences and token counts (StepBatcher's
    side of Context.decode_batch), and gives zero rows."""

    def __init__(self, name, calls):
        self.name, self.calls = name, calls
        self.model, self.notes, self.memory_note, self.reuse_min = None, (), None, 0
        self.params = ContextParams(n_ctx=512)
        self.n_batch = self.n_ubatch = self.verify_limit = 64
        self.rollback = RollbackPlan(ATTENTION)

    def decode_batch(self, entries):
        self.calls.append((self.name, sorted((seq, len(tokens)) for seq, _, tokens, _ in entries)))
        return np.zeros((sum(len(tokens) for _, _, tokens, _ in entries), 8), dtype=np.float32)


def test_draft_decodes_go_first_and_the_target_batch_waits_for_them():
    """Slot 1 drafts three tokens while slot 2 wants a plain step: the three draft decodes run
    while slot 2 waits, then slot 1's verify and slot 2's step go in one target decode (not
    three rounds of slot 2's steps beside the drafts)."""
    calls, batcher = [], StepBatcher()
    target, draft = RecordingContext("target", calls), RecordingContext("draft", calls)
    views = {seq: (SeqContext(target, seq, 256, batcher),
                   SeqContext(draft, seq, 256, batcher, drafts=True)) for seq in (1, 2)}

    def drafting():
        for tok in (5, 6, 7):
            yield from views[1][1].decode_steps([tok])
        yield from views[1][0].decode_steps([1, 5, 6, 7], all_logits=True)

    def plain():
        yield from views[2][0].decode_steps([9])
        yield from views[2][0].decode_steps([10])

    run_all(StepLoop(batcher), [(drafting(), None), (plain(), None)])
    assert calls == [("draft", [(1, 1)])] * 3 + [("target", [(1, 4), (2, 1)]),
                                                 ("target", [(2, 1)])]
    assert views[1][0].others == 1 and views[2][0].tokens == [9, 10]
    assert batcher.members == 0


# Scripted verify curves, seconds for n rows: a CPU where a batch of 4 costs 2 plain steps,
# and a GPU where rows are nearly free up to 64
def steep() -> CostModel:
    return CostModel(verify={n: 0.1 * (1 + (n - 1) / 3) for n in range(1, 66)})


def flat() -> CostModel:
    return CostModel(verify={n: 0.01 * (1 + 0.005 * (n - 1)) for n in range(1, 66)})


def test_batch_costs_are_a_share_of_the_step_plus_the_rows_added():
    others, curve = [0], steep()
    view = BatchCosts(curve, lambda: others[0])
    assert view.verify_cost(5) == curve.verify_cost(5) and view.rows(5) == 5
    others[0] = 3
    assert view.plain == pytest.approx(curve.verify_cost(4) / 4)
    assert view.verify_cost(3) - view.plain == pytest.approx(
        curve.verify_cost(6) - curve.verify_cost(4))
    assert view.rows(3) == 6
    assert view.shared and not curve.shared
    # a step's verify took the wait for the batch as well: the curve learns the decode's own
    assert view.timing(0.9) == 0.9 and BatchCosts(curve, lambda: 3, lambda: 0.21).timing(0.9) == 0.21
    # a whole batch's time is split by the same prices: this sequence's part of it
    assert view.attributed(3, curve.verify_cost(6)) == pytest.approx(view.verify_cost(3))
    view.observe_verify(view.rows(1), 0.5)  # refines the session's curve at the batch size
    assert curve.verify[4] != 0.2 and 4 in curve.spread


def test_drafts_shrink_as_the_batch_grows_only_where_rows_cost():
    """At 90% acceptance a draft's rows must beat the batch's rate (by the timings' spread):
    alone 16 tokens pay on the steep host, beside one other row 6, beside 3 none; on the flat
    one every length pays at every batch size."""
    sizes = (0, 1, 3, 7, 15)
    assert [longest_paying(BatchCosts(steep(), lambda o=o: o)) for o in sizes] == [16, 6, 0, 0, 0]
    assert [longest_paying(BatchCosts(flat(), lambda o=o: o)) for o in sizes] == [16] * 5


def _stream_beside_a_prompt(monkeypatch, ends_by: int = 0, prompt_end: int = 0):
    """Slot 1 streams 30 one-token steps while slot 2's 130-token prompt (one chunk, longer
    than SHORT) arrives, on scripted costs (a step 1 s, a prompt token 0.05 s); the stream's
    and the prompt's `ends_by` / `prompt_end` as given (0: unknown). Returns the calls, as
    (context, [(sequence, tokens)]), and the prompt's view."""
    from tandem.engine.backend import sequences

    clock = [0.0]
    monkeypatch.setattr(sequences.time, "perf_counter", lambda: clock[0])
    calls, batcher = [], StepBatcher()

    class Timed(RecordingContext):
        def decode_batch(self, entries):
            for _, _, tokens, want in entries:
                clock[0] += 1.0 if want != 0 else 0.05 * len(tokens)
            return super().decode_batch(entries)

    target = Timed("target", calls)
    target.n_batch = target.n_ubatch = 256
    stream, newcomer = SeqContext(target, 1, 256, batcher), SeqContext(target, 2, 256, batcher)
    stream.ends_by, newcomer.prompt_end = ends_by, prompt_end

    def streaming():
        for tok in range(30):
            yield from stream.decode_steps([tok])

    def prompt():
        return (yield from newcomer.prefill_steps(list(range(100, 230))))

    run_all(StepLoop(batcher), [(streaming(), None), (prompt(), None)])
    return calls, newcomer


def test_a_prompt_beside_a_stream_takes_its_share_in_pieces(monkeypatch):
    """Slot 2's 130-token prompt chunk arrives while slot 1 streams: the stream's step runs
    every round, and the prompt runs in pieces of at least 16 tokens whose time stays within
    SHARE of the steps' beside it (the first piece measures; its last SHORT tokens at once).
    Scripted costs: a step 1 s, a prompt token 0.05 s."""
    from tandem.engine.backend import prompt_share

    calls, newcomer = _stream_beside_a_prompt(monkeypatch)
    pieces = [n for name, seqs in calls for seq, n in seqs if seq == 2]
    steps_beside = sum(1 for name, seqs in calls for seq, n in seqs if seq == 1)
    assert steps_beside == 30 and sum(pieces) == 130 and newcomer.tokens == list(range(100, 230))
    assert pieces[0] == prompt_share.MIN_PIECE and len(pieces) >= 3  # the first measures
    assert all(n >= prompt_share.MIN_PIECE for n in pieces[:-1])
    assert pieces[-1] <= prompt_share.SHORT  # what is left once short runs at once
    assert 0.05 * sum(pieces[1:-1]) <= prompt_share.SHARE * steps_beside * 1.0


@pytest.mark.parametrize("stream_left,want", [(30, [16, 114]), (200, None)])
def test_a_prompt_its_share_cannot_finish_before_the_stream_ends_waits_for_it(
        monkeypatch, stream_left, want):
    """The same prompt beside a stream due to end within 30 tokens: its share (0.15 of 29
    one-second steps, 4.35 s) cannot finish its 114 tokens left (5.7 s) first, so after the
    measuring piece it waits and runs whole once the stream ended, the stream's steps alone
    meanwhile; beside one due to end 200 tokens on, it goes on in pieces."""
    calls, newcomer = _stream_beside_a_prompt(monkeypatch, stream_left, 130)
    pieces = [n for name, seqs in calls for seq, n in seqs if seq == 2]
    assert sum(pieces) == 130 and newcomer.tokens == list(range(100, 230))
    if want is not None:
        assert pieces == want
        last_step = max(i for i, (name, seqs) in enumerate(calls) if any(q == 1 for q, _ in seqs))
        assert [n for name, seqs in calls[last_step + 1:] for seq, n in seqs] == [114]
    else:
        assert len(pieces) >= 3


def test_only_a_prompt_longer_than_short_waits_for_the_streams():
    """A short prompt (a chat's new turn, a hybrid slot's owed tokens) runs at once beside a
    stream about to end; a longer one its share cannot finish waits; none waits beside a
    stream of no known end, or before a piece measured what a token costs."""
    from types import SimpleNamespace as NS

    from tandem.engine.backend.decode_requests import DecodeRequest
    from tandem.engine.backend.prompt_share import SHORT, PromptShare

    ctx = object()
    stream = NS(ctx=ctx, ends_by=96, tokens=[0] * 95)  # its last token next
    step = DecodeRequest(stream, [1], 1, 95)

    def job(n):
        return DecodeRequest(NS(ctx=ctx, prompt_end=n, tokens=[]), list(range(n)), 0, 0)

    share = PromptShare()
    assert not share.waits(job(SHORT + 1), [step])  # nothing measured yet
    share.spend(id(ctx), 16, 0.16)  # 0.01 s a token
    share.earn(1.0)  # a round of steps: 1 s; one round left: a share of 0.15 s
    assert not share.waits(job(SHORT), [step])  # 0.64 s, but short
    assert share.waits(job(SHORT + 1), [step])  # 0.65 s
    stream.ends_by = 100  # five rounds left: 0.75 s
    assert not share.waits(job(SHORT + 1), [step])
    assert share.waits(job(SHORT + 20), [step])  # 0.84 s
    stream.ends_by = 0  # no known end
    assert not share.waits(job(SHORT + 20), [step])


def test_a_share_piece_waits_for_its_credit():
    from tandem.engine.backend.prompt_share import MIN_PIECE, SHORT, PromptShare

    share = PromptShare()
    assert share.piece(7, 100) == MIN_PIECE  # unmeasured: a piece measures
    share.spend(7, 16, 0.16)  # 0.01 s a token; the credit goes below zero
    share.earn(1.0)
    assert share.piece(7, 100) == 0 and share.piece(7, SHORT) == SHORT  # short: at once
    share.earn(2.0)  # 0.29 s: 29 tokens (28 where the float sum falls short)
    assert share.piece(7, 100) in (28, 29)


class LaggingModel:
    """A draft model on a slot that has read none of the prompt (HybridDrafter's
    prefill_steps skips it there): each draft first catches up what it lacks."""

    catches_up = True

    def __init__(self):
        self.ctx = type("Ctx", (), {"tokens": []})()
        self.last_sync_tokens, self.last_sync_s, self.last_decodes, self.last_decode_s = 0, 0.0, 0, 0.0
        self.drafts = 0

    def draft_steps(self, tokens, k, sampling, rng, sample):
        from tandem.engine.drafting.drafters import Draft

        self.drafts += 1
        self.last_sync_tokens, self.last_sync_s = len(tokens) - 1, 0.002 * (len(tokens) - 1)
        self.ctx.tokens = list(tokens)
        return Draft(list(tokens[-k:]))
        yield  # noqa: unreachable - a step machine


def test_a_slots_probe_reads_the_prompt_only_where_the_probe_budget_covers_it():
    """Alone on a slot (no company) a probe of the draft model first reads the whole prompt,
    which no prompt phase paid for: it is made only where the budget covers that catch-up at
    a draft token's price (then at the rate measured), and the catch-up is charged to it."""
    from tandem.engine.backend.decode_requests import run_now
    from tandem.engine.drafting.adaptive import ProbeBudget
    from tandem.engine.drafting.drafters import DraftParams
    from tandem.engine.drafting.hybrid import HybridDrafter, HybridPolicy
    from tandem.engine.loop.events import StepEvent

    # a flat curve and a cheap draft token (a GPU's shape): a probe could pay
    base = CostModel({1: 0.030, 2: 0.031, 3: 0.032, 4: 0.033, 8: 0.04, 17: 0.06}, 0.004)
    costs = BatchCosts(base, lambda: 0)  # a slot's costs, nobody else in the batch
    model, budget = LaggingModel(), ProbeBudget()
    drafter = HybridDrafter(model, DraftParams(n_max=4, n_min=0), costs,
                            HybridPolicy(name="auto", adaptive=True), sources=None,
                            budget=budget)
    prompt = [1] + list(range(100, 200))  # 101 tokens the model has not read, no repeats

    def propose():
        return run_now(drafter.propose_steps(prompt, 8, None, None, False))

    budget.balance = drafter.model_len.worst_loss(4) + 0.01  # the probe, not the prompt
    assert not propose().tokens and model.drafts == 0 and budget.refused == 1
    budget.balance = 100 * 0.004 + 0.1  # covers 100 tokens at a draft token's 4 ms
    draft = propose()
    assert model.drafts == 1 and draft.tokens and drafter.probing
    before = budget.balance
    # (its draft time holds the catch-up, as DraftModelDrafter.draft_steps times it)
    drafter.observe(StepEvent(0, len(draft.tokens), 0, 8, model.last_sync_s + 0.016, 0.033,
                              0.0))
    assert budget.balance <= before - model.last_sync_s  # the catch-up was paid
    assert drafter._catch_up_token == pytest.approx(0.002)  # its rate, for the next one


def test_a_slots_cache_reuse_moves_its_cells_and_decodes_after_them(sessions):
    """--cache-reuse on a slot: the runs a new prompt holds further on move (their positions
    shifted), and the next decodes go after them (the editors' keystrokes: a position past
    the moved cells once made llama_decode refuse the batch)."""
    from tandem.engine.backend.decode_requests import run_now

    _, shared = sessions
    view = shared.slots[1].target
    a = [1] + list(range(10, 60))
    b = a[:6] + a[8:]  # two tokens deleted: the 43 after them move back
    view.truncate(0)
    view.reuse_min = 8
    try:
        run_now(view.prefill_steps(a))
        before = shared.target_ctx.n_reused
        assert run_now(view.prefill_steps(b)) == 0  # nothing evaluated: it all moved
        assert shared.target_ctx.n_reused - before == 43
        assert view.tokens == b and view.held == len(b)
        run_now(view.decode_steps([7, 8, 9], all_logits=True))
        assert view.tokens == b + [7, 8, 9] and view.held == len(view.tokens)
    finally:
        view.reuse_min = 0
        view.truncate(0)
