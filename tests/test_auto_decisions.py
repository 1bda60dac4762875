"""auto's decisions on scripted costs of both shapes issue 25 measured, and the acceptance
patterns of the Spec-Bench categories: never more than 2% slower than plain decoding where
nothing pays, faster where copies pay. Arithmetic on simulated time, not wall-clock.

The simulation is bench/replay.py's greedy replay driving the real AutoDrafter (propose /
observe: its length controllers, probe budget, fallback guard and online cost refinement) over
an answer of known tokens; only what the context offers is scripted:
at each position, whether a source matches the context's end, how long the match is and how
many of the drafted tokens the target would accept. Each step's timing, as the drafter
observes it, moves through the measured range of its batch size (noise); the time charged is
the range's midpoint (the expected cost), for auto as for plain decoding.
"""
from __future__ import annotations

import itertools
import random
from collections import Counter
from dataclasses import dataclass

import numpy as np
import pytest
from engine_helpers import auto_drafter  # noqa: E402
from tandem.bench.replay import replay
from tandem.engine.drafting.adaptive import PROBE_ACCEPT, LengthController
from tandem.engine.drafting.auto import AutoDrafter
from tandem.engine.tuning.costs import CostModel
from tandem.engine.tuning.knowledge import Knowledge

# verify batch of n tokens, in plain steps: (fastest, slowest) seen. STEEP: issue 25's host
# (plain 33 ms; 2 rows 1.75-2.07, 3 rows 2.4-2.6, 4 rows 2.8-3.1, 8 rows 6.8-8.1). FLAT: the
# host of docs/benchmarks.md section 0 (plain 104 ms; 2 rows 1.57, 3 rows 2.16, 4 rows 2.0-2.1,
# 5 rows 2.71, 8 rows 5.2), with a plain step's own spread of 3% on both.
STEEP = (0.033, {1: (1.0, 1.03), 2: (1.75, 2.07), 3: (2.4, 2.6), 4: (2.8, 3.1),
                 8: (6.8, 8.1), 17: (15.0, 17.5)})
FLAT = (0.104, {1: (1.0, 1.03), 2: (1.57, 1.62), 3: (2.16, 2.22), 4: (2.0, 2.1),
                5: (2.71, 2.78), 8: (5.2, 5.35), 17: (8.5, 8.8)})
SHAPES = {"steep": STEEP, "flat": FLAT}
N_TOKENS = 128  # as bench_peer's requests


def calibrated(shape) -> CostModel:
    """What calibrate() records from two repetitions that hit both ends of each range: the
    fastest as the cost, (slowest - fastest) / fastest as the spread."""
    c1, curve = shape
    return CostModel({n: lo * c1 for n, (lo, _) in curve.items()}, 0.0, "calibrated",
                     spread={n: hi / lo - 1 for n, (lo, hi) in curve.items()})


def _curve(shape, end: int) -> CostModel:
    c1, curve = shape
    return CostModel({n: r[end] * c1 for n, r in curve.items()})


@dataclass(frozen=True)
class Match:
    source: str
    length: int  # match length at the context's end
    agree: int  # tokens of its continuation the target would produce


def script(category: str, n: int, seed: int) -> list[Match | None]:
    """What the prompt offers at each answer position, by Spec-Bench category."""
    rng = random.Random(f"{category}-{seed}")
    out: list[Match | None] = []

    def chance(p: float, agree: tuple[int, ...]):
        if rng.random() >= p:
            return None
        return Match("prompt", rng.choice((2, 2, 3)), rng.choice(agree))

    while len(out) < n:
        if category == "translation":  # matches rare and mostly wrong
            out.append(chance(0.10, (0, 0, 0, 0, 1)))
        elif category == "qa":
            out.append(chance(0.15, (0, 0, 0, 1, 2)))
        elif category == "math":  # short matches (numbers, variables), half right
            out.append(chance(0.35, (0, 0, 1, 1, 2)))
        elif category == "restating":  # math restating its problem: matches of every length
            m = chance(0.35, (0, 0, 1, 1, 2))  # in the buckets copies fill, then new numbers
            out.append(m and Match("prompt", rng.choice((2, 3, 4, 6, 8, 9, 12)), m.agree))
        else:  # copies of the prompt between stretches of new text
            copy, gap, p = {"summarization": ((15, 40), (3, 10), 0.2),
                            "rag": ((8, 25), (5, 20), 0.3),
                            "code": ((4, 12), (5, 15), 0.25)}[category]
            for _ in range(rng.randint(*gap)):
                out.append(chance(p, (0, 0, 0, 1)))
            if category == "code" and rng.random() < 0.6:
                continue  # most code is new, not copied
            length = rng.randint(*copy)
            # the match is found two tokens into the copy and grows with it
            out += [None, None] + [Match("prompt", min(i + 2, 32), length - i)
                                   for i in range(length - 2)]
    return out[:n]


ANSWER, WRONG = 1, 2  # every answer token is ANSWER; a scripted draft is WRONG past agree


def _offer(match: Match | None, k: int) -> list[tuple[str, list[int], int]]:
    """What auto's sources offer for a draft of up to k tokens: the scripted match, its
    continuation right for `agree` tokens of the answer and wrong after."""
    if match is None or k <= 0:
        return []
    right = min(match.agree, k)
    return [(match.source, [ANSWER] * right + [WRONG] * (k - right), match.length)]


def simulate(shape, pattern: list[Match | None], knowledge: Knowledge | None = None,
             n: int = N_TOKENS) -> tuple[float, Counter, AutoDrafter]:
    """(auto's expected time / plain decoding's, drafts by length, the drafter): the greedy
    replay (bench/replay.py) of an n-token answer, each step charged its batch's expected cost
    and observed at a point of the batch's measured range."""
    calib = calibrated(shape)
    auto = auto_drafter(None, calib.copy(), n_max=4, calibrated=calib, knowledge=knowledge)
    lo, hi = _curve(shape, 0), _curve(shape, 1)
    noise = itertools.cycle((0.0, 1.0, 0.5, 0.25, 0.75))
    prompt = [0]
    auto.candidates = lambda tokens, k: _offer(pattern[len(tokens) - len(prompt)], k)

    def seen(batch: int, step: int) -> float:
        f = next(noise)
        return lo.verify_cost(batch) * (1 - f) + hi.verify_cost(batch) * f

    run = replay(auto, [ANSWER] * n, lambda b: (lo.verify_cost(b) + hi.verify_cost(b)) / 2,
                 prompt=prompt, limit=16, seen=seen, rng=np.random.default_rng(0))
    assert run.tokens == n
    plain = n * (lo.plain + hi.plain) / 2
    return run.seconds / plain, Counter(run.lengths()), auto


def _learnt(shape, category: str, requests: int = 8) -> Knowledge:
    """What `requests` earlier requests of a category leave in the kept knowledge (each
    pays for a probe or two; the buckets fill over several requests)."""
    kept = Knowledge()
    for seed in range(100, 100 + requests):
        _, _, auto = simulate(shape, script(category, N_TOKENS, seed), Knowledge(
            sources=dict(kept.sources), model=kept.model, noise=dict(kept.noise)))
        auto.learnt(kept)
    return kept


NOTHING_PAYS = ("translation", "qa", "math")
COPIES = ("summarization", "rag")
CATEGORIES = NOTHING_PAYS + ("restating", "code") + COPIES


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("category", NOTHING_PAYS + ("code",) + COPIES)
def test_auto_is_never_more_than_2_percent_slower_than_plain(shape, category):
    """First requests (priors only) and requests that start from kept knowledge, 4 prompts
    each: every one within the probe budget of plain decoding."""
    kept = _learnt(SHAPES[shape], category)
    for seed in range(4):
        pattern = script(category, N_TOKENS, seed)
        first, _, auto = simulate(SHAPES[shape], pattern)
        later, _, _ = simulate(SHAPES[shape], pattern, kept)
        assert first <= 1.02, (shape, category, seed, first, auto.budget)
        assert later <= 1.02, (shape, category, seed, later)


# RAG on the steep host gained only by drafting from kept acceptance before the request had
# earned its worst case (a draft of 3 risks 1.8 plain steps: 90 tokens of a 2% budget); since
# kept acceptance is paid as a probe until confirmed, that gain (0.96x) is gone (1.01x): there
# the bar is the never-lose one, within the 2% budget of plain decoding
@pytest.mark.parametrize("shape,gain,category", [
    ("steep", 0.97, "summarization"), ("steep", 1.02, "rag"),
    ("flat", 0.9, "summarization"), ("flat", 0.9, "rag")])
def test_auto_gains_where_copies_pay(shape, category, gain):
    """Long copies (summarization, RAG): with what earlier requests learnt, auto needs at most
    `gain` of plain decoding's time (median of 4 prompts), on either shape; a first request
    is never slower than plain by more than the budget and already gains on the flat host."""
    kept = _learnt(SHAPES[shape], category)
    later = sorted(simulate(SHAPES[shape], script(category, N_TOKENS, s), kept)[0]
                   for s in range(4))
    first = sorted(simulate(SHAPES[shape], script(category, N_TOKENS, s))[0] for s in range(4))
    assert np.median(later) <= gain, (shape, category, later)
    assert np.median(first) <= (1.0 if shape == "flat" else 1.02), (shape, category, first)
    assert np.median(later) <= np.median(first)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("category", ("restating", "math"))
def test_acceptance_kept_from_copies_does_not_cost_a_math_request(shape, category):
    """Knowledge is per source and match length, not per kind of prompt: after summarization
    (copies accepted in full) the same prompt-lookup buckets come back on math, where few
    drafts are right. Until the request's own verdicts confirm it, the kept acceptance only
    chooses drafts its probe budget covers (docs/benchmarks.md section 0: 0.91x on math)."""
    kept = _learnt(SHAPES[shape], "summarization")
    for seed in range(8):
        ratio, _, auto = simulate(SHAPES[shape], script(category, N_TOKENS, seed), kept)
        assert ratio <= 1.02, (shape, category, seed, ratio, auto.budget)


@pytest.mark.parametrize("shape", SHAPES)
def test_knowledge_from_any_category_never_costs_another(shape):
    """Learnt on one category, applied to each (itself included): within the budget."""
    kept = {c: _learnt(SHAPES[shape], c) for c in CATEGORIES}
    worst = max((simulate(SHAPES[shape], script(run, N_TOKENS, seed), kept[learnt])[0],
                 learnt, run, seed)
                for learnt in CATEGORIES for run in CATEGORIES for seed in range(4))
    assert worst[0] <= 1.02, (shape, worst)


def test_short_drafts_that_cost_nearly_two_steps_are_never_worth_a_probe():
    steep, flat = calibrated(STEEP), calibrated(FLAT)
    for costs, one_pays in ((steep, False), (flat, True)):
        ctl = LengthController(costs, 1, 16, False)
        # 2 rows at 1.75 plain steps (spread 18%): even 90% acceptance yields 1.9 tokens, a
        # 1.09x that the spread (18% + 3%) does not cover; at 1.57 (flat) it would
        assert ctl.pays(1, [PROBE_ACCEPT]) is one_pays
    # ...and on the steep host, over every category, auto never drafts a single token
    for category in NOTHING_PAYS + ("code",) + COPIES:
        for seed in range(2):
            _, lengths, _ = simulate(STEEP, script(category, N_TOKENS, seed))
            assert lengths[1] == 0, (category, lengths)


def test_probes_are_paid_from_a_budget_of_2_percent():
    """Matches everywhere and never right: the probes' total loss stays within 2% of the
    request's plain time, and probing goes on only as the budget is earned again."""
    for shape in SHAPES.values():
        pattern = [Match("prompt", 2 + i % 5, 0) for i in range(512)]
        ratio, lengths, auto = simulate(shape, pattern, n=512)
        assert ratio <= 1.02, ratio
        assert auto.budget.probes >= 2  # it kept trying, as the budget allowed
        assert sum(v for k, v in lengths.items() if k) == auto.budget.probes


def test_the_margin_comes_from_the_measured_spread():
    costs = calibrated(FLAT)
    ctl = LengthController(costs, 1, 16, False)
    assert ctl.margin(3) == pytest.approx(costs.spread[4] + costs.spread[1])
    # sizes never measured take the larger spread of their measured neighbours
    assert costs.spread_of(6) == max(costs.spread[5], costs.spread[8])
    # observed noise moves it: a step 30% off its expected cost widens the margin
    before = ctl.margin(3)
    costs.observe_verify(4, costs.verify[4] * 1.3)
    assert ctl.margin(3) > before


@pytest.mark.parametrize("shape", SHAPES)
def test_a_calibration_that_underreports_its_spread_stays_within_the_budget(shape, monkeypatch):
    """Two repetitions may land close together (3% apart) although the batch's cost wanders
    over its whole range: auto then probes short drafts it should not, and learns the noise
    from the steps (the margin widens), but the budget still bounds what it loses."""
    import test_auto_decisions as me

    real = me.calibrated

    def narrow(s):
        c = real(s)
        c.spread = {n: 0.03 for n in c.spread}
        return c

    monkeypatch.setattr(me, "calibrated", narrow)
    for category in NOTHING_PAYS + ("code",):
        for seed in range(4):
            ratio, _, auto = simulate(SHAPES[shape], script(category, N_TOKENS, seed))
            assert ratio <= 1.02, (shape, category, seed, ratio)
            if shape == "steep":
                # 2 rows wander over 1.75-2.07 plain steps: the probes' timings widened it
                assert auto.costs.spread_of(2) > 0.03
