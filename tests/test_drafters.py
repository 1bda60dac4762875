"""n-gram index, adaptive draft length, fallback guard, and every strategy staying lossless."""
from __future__ import annotations

import pytest
from tandem.engine.drafting.adaptive import AcceptanceTracker, FallbackGuard, LengthController
from tandem.engine.tuning.costs import CostModel
from tandem.engine.drafting.ngram import NgramIndex


def test_ngram_index_proposes_the_latest_continuation():
    idx = NgramIndex(2, 3)
    idx.sync([1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 1, 2, 3])
    # longest suffix (1, 2, 3) last occurred before 5 7
    assert idx.lookup(3) == ([5, 7, 1], 3)
    idx.sync([1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 1, 2, 3, 8])
    assert idx.lookup(2) == ([], 0)  # (3, 8) and (2, 3, 8) never occurred before


def test_ngram_index_is_incremental_and_rebuilds_on_rewrite():
    idx = NgramIndex(2, 2)
    idx.sync([5, 6, 7, 5])
    idx.sync([5, 6, 7, 5, 6])
    assert idx.lookup(2) == ([7, 5], 2)
    idx.sync([9, 9, 9])  # a different history: rebuilt, not appended
    assert idx.lookup(1) == ([9], 2)
    assert idx.lookup(4, extra=[]) == ([9], 2)


def test_ngram_lookup_with_uncommitted_extra_tokens():
    idx = NgramIndex(2, 3)
    idx.sync([10, 11, 12, 13, 14, 10])
    assert idx.lookup(2, extra=[11, 12]) == ([13, 14], 3)


def test_acceptance_tracker_counts_positions_reached():
    t = AcceptanceTracker(n_max=4, prior=0.5, weight=0.5)
    t.update(drafted=4, accepted=1)  # position 0 accepted, 1 rejected, 2-3 never reached
    # never-reached positions follow the deepest measured one, not the prior
    assert t.accept == [0.75, 0.25, 0.25, 0.25]
    t.update(drafted=4, accepted=4)  # all four reached and accepted
    assert t.accept == [0.875, 0.625, 0.625, 0.625]
    t.update(drafted=2, accepted=0)  # only position 0 reached: deeper estimates are kept
    assert t.accept == [0.4375, 0.625, 0.625, 0.625]


def _costs(verify, draft):
    return CostModel(verify={n: v for n, v in verify.items()}, draft_token=draft)


def test_length_controller_picks_the_rate_maximising_length():
    # a GPU-like curve: verifying 9 tokens costs little more than 1
    gpu = _costs({1: 0.010, 2: 0.0102, 5: 0.0105, 9: 0.011}, draft=0.0005)
    ctl = LengthController(gpu, n_min=0, n_max=8, tracker=AcceptanceTracker(8, prior=0.9))
    assert ctl.choose(8) == 8
    # a CPU-like curve with an expensive draft: speculation cannot pay, choose plain
    cpu = _costs({1: 0.084, 2: 0.123, 4: 0.127, 8: 0.211}, draft=0.035)
    ctl = LengthController(cpu, n_min=0, n_max=8, tracker=AcceptanceTracker(8, prior=0.5))
    assert ctl.choose(8) == 0


def test_length_controller_probes_after_a_run_of_plain_choices():
    cpu = _costs({1: 0.084, 2: 0.123, 4: 0.127, 8: 0.211}, draft=0.035)
    cpu.spread = {n: 0.02 for n in cpu.verify}
    ctl = LengthController(cpu, n_min=0, n_max=8, probe_every=3, probe_len=2,
                           tracker=AcceptanceTracker(8, prior=0.2))
    # probes that keep confirming plain decoding back off: after 3, then 6 plain choices;
    # each drafts the length with the best rate at 90% acceptance (3: 14.8 tok/s against 13.9
    # for 2 and 11.9 plain)
    assert [ctl.choose(8) for _ in range(10)] == [0, 0, 3, 0, 0, 0, 0, 0, 3, 0]


def test_expected_rate_arithmetic():
    c = _costs({1: 0.1, 3: 0.2}, draft=0.01)
    # k=2, a=[0.5, 0.5]: tokens 1 + 0.5 + 0.25; cost 2*0.01 + 0.2
    assert c.expected_rate(2, [0.5, 0.5]) == pytest.approx(1.75 / 0.22)
    assert c.verify_cost(2) == pytest.approx(0.15)


def test_cost_model_round_trip(tmp_path):
    c = _costs({1: 0.1, 4: 0.2}, draft=0.02)
    c.save(tmp_path / "c.json")
    back = CostModel.load(tmp_path / "c.json")
    assert back.verify == c.verify and back.draft_token == c.draft_token
    (tmp_path / "bad.json").write_text("{not json")
    assert CostModel.load(tmp_path / "bad.json") is None


def test_fallback_guard_switches_to_plain_when_speculation_measures_slower():
    g = FallbackGuard(min_spec_steps=2, initial_backoff=3)
    g.observe(1, 0.1, speculative=False)  # plain: 10 tok/s
    for _ in range(2):
        g.observe(2, 0.4, speculative=True)  # speculative: 5 tok/s
    assert g.fallbacks == 1
    assert [g.want_plain() for _ in range(4)] == [True, True, True, False]
    g.observe(1, 0.1, speculative=False)
    for _ in range(2):
        g.observe(4, 0.2, speculative=True)  # 20 tok/s: keeps speculating
    assert g.fallbacks == 1
