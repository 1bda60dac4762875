"""bench/replay.py: greedy decoding replayed over a known output (the simulator of
scripts/ngram_replay.py, scripts/history_replay.py and test_auto_decisions.py)."""
from __future__ import annotations

import pytest
from tandem.bench.replay import accepted_prefix, replay
from tandem.engine.drafting.drafters import Draft

PROMPT = [1, 2]
OUTPUT = [10, 11, 12, 13, 14, 15, 16, 17]
COST = {1: 1.0, 2: 1.5, 3: 2.0, 4: 2.5}.__getitem__  # seconds per verify batch


class Scripted:
    """Proposes the next of `drafts` at each step; keeps what it was asked and told."""

    def __init__(self, drafts, n_max: int = 3):
        self.drafts, self.n_max = list(drafts), n_max
        self.prefilled, self.asked, self.seen = None, [], []

    def prefill(self, prompt):
        self.prefilled = list(prompt)

    def propose(self, tokens, room, sampling, rng, sample):
        self.asked.append((list(tokens), room))
        return Draft(self.drafts.pop(0))

    def observe(self, step):
        self.seen.append(step)


def test_acceptance_is_the_draft_prefix_the_output_continues_with():
    assert accepted_prefix([10, 11, 99], OUTPUT, 0) == 2
    assert accepted_prefix([13, 14, 15], OUTPUT, 3) == 3
    assert accepted_prefix([99, 11], OUTPUT, 0) == 0
    assert accepted_prefix([], OUTPUT, 0) == 0
    assert accepted_prefix([17, 18], OUTPUT, 7) == 1  # the output ends


def test_a_replay_steps_through_the_output():
    # step 0: 2 of 3 accepted, the target's 12 after them; step 1: the draft of 5 is cut at
    # n_max 3, all accepted, then 16; step 2: one token left, no room to draft: a plain step
    drafter = Scripted([[10, 11, 99], [13, 14, 15, 16, 17]])
    run = replay(drafter, OUTPUT, COST, prompt=PROMPT, limit=4, overhead=0.25)
    assert [(s.pos, s.k_cap, s.drafted, s.accepted, s.produced) for s in run.steps] == \
        [(0, 3, 3, 2, 3), (3, 3, 3, 3, 4), (7, 0, 0, 0, 1)]
    assert [s.seconds for s in run.steps] == [2.75, 2.75, 1.25]
    assert (run.tokens, run.drafted, run.accepted) == (8, 6, 5)
    assert run.seconds == pytest.approx(6.75)
    assert run.lengths() == {3: 2, 0: 1}
    # the drafter saw the context as generate() gives it, and each step's verdict
    assert drafter.prefilled == PROMPT
    assert drafter.asked == [(PROMPT, 4), (PROMPT + OUTPUT[:3], 4)]
    assert [(e.step, e.drafted, e.accepted, e.n_max, e.t_verify, e.t_sample)
            for e in drafter.seen] == [(0, 3, 2, 3, 2.5, 0.25), (1, 3, 3, 3, 2.5, 0.25),
                                       (2, 0, 0, 0, 1.0, 0.25)]


def test_the_room_ends_at_the_output_and_at_the_limit():
    drafter = Scripted([[10, 11, 12, 13], [13, 14]], n_max=8)
    run = replay(drafter, OUTPUT[:5], COST, limit=2)
    assert [room for _, room in drafter.asked] == [2, 1]  # limit 2, then 5 - 3 - 1 left
    assert [(s.drafted, s.accepted) for s in run.steps] == [(2, 2), (1, 1)]  # 12, 15 theirs
    assert run.tokens == 5


def test_seen_is_what_the_drafter_observes_and_the_oracle_verifies_only_the_accepted():
    drafter = Scripted([[10, 11, 99], [99], []])
    run = replay(drafter, OUTPUT[:6], COST, limit=3, oracle=True,
                 seen=lambda batch, step: 100.0 * batch + step)
    # the oracle's step 0 verifies 10, 11 (a batch of 3), step 1 nothing (99 is wrong); then
    # an empty draft, and the last token has no room
    assert [(s.k_cap, s.drafted, s.accepted, s.seconds) for s in run.steps] == \
        [(3, 2, 2, 2.0), (2, 0, 0, 1.0), (1, 0, 0, 1.0), (0, 0, 0, 1.0)]
    assert [e.t_verify for e in drafter.seen] == [300.0, 101.0, 102.0, 103.0]
    assert [e.drafted for e in drafter.seen] == [2, 0, 0, 0]
