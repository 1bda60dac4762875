"""What paid is kept beside the cost cache (engine/tuning/knowledge.py): a new request or process
starts from it; the file is bounded, versioned, ignored when stale, checked on read."""
from __future__ import annotations

import json
import math
import time

import numpy as np
import pytest
from engine_helpers import auto_drafter  # noqa: E402
from tandem.engine.drafting.auto import BUCKETS, ORDER, AutoDrafter
from tandem.engine.loop.events import DoneEvent, StepEvent
from tandem.engine.loop.sampling import SamplingParams
from tandem.engine.tuning.costs import CostModel
from tandem.engine.tuning.knowledge import MAX_BYTES, VERSION, Knowledge
from tandem.errors import TandemWarning

# a batch of n tokens costs 10% more per extra token: drafts are not free, probes have a price
GENTLE = CostModel({n: 0.1 * (1 + 0.1 * (n - 1)) for n in range(1, 18)}, spread={1: 0.02})


def _auto(knowledge=None):
    return auto_drafter(None, GENTLE.copy(), n_max=4, knowledge=knowledge)


def _copying_request(auto: AutoDrafter, steps: int = 6) -> None:
    """A request whose 8+-token prompt matches are always right."""
    rng, sp = np.random.default_rng(0), SamplingParams(temperature=0.0)
    auto.candidates = lambda tokens, k: [("prompt", [7] * k, 9)]
    for i in range(steps):
        n = len(auto.propose([0] * 20, 8, sp, rng, False).tokens)
        auto.observe(StepEvent(i, n, n, 8, 0.0, 0.1, 0.0))


def test_a_second_request_starts_from_the_first_ones_acceptance(tmp_path):
    first = _auto()
    first.budget.balance = 1.0
    _copying_request(first)
    kept = Knowledge()
    first.learnt(kept)
    rec = kept.sources[("prompt", 8)]
    assert rec.n == first.source_len[("prompt", 8)].tracker.steps >= 3
    assert rec.accept[0] > 0.8  # from the prior 0.6, after all-accepted drafts
    path = tmp_path / "costs" / "k.knowledge.json"
    kept.save(path)
    loaded = Knowledge.load(path, ORDER, BUCKETS)
    second = _auto(loaded)
    ctl = second.source_len[("prompt", 8)]
    assert ctl.tracker.accept[:len(rec.accept)] == pytest.approx(rec.accept)
    # informed at once, but not by this request: its drafts are probes until confirmed
    assert ctl.informed and ctl.on_trial
    assert any("kept from earlier requests" in n for n in second.notes)
    rng, sp = np.random.default_rng(0), SamplingParams(temperature=0.0)
    second.candidates = lambda tokens, k: [("prompt", [7] * k, 9)]
    # nothing earned yet: the kept estimate may not spend what the request has not
    assert second.budget.balance == 0.0
    assert second.propose([0] * 20, 8, sp, rng, False).tokens == []
    # once the budget covers it, the kept estimate chooses the length, paid as a probe
    second.budget.balance = 1.0
    probes = second.budget.probes
    assert len(second.propose([0] * 20, 8, sp, rng, False).tokens) > 0
    assert second._probe and second.budget.probes == probes + 1
    # three drafts of this request accepted in full confirm it: chosen, not probes
    _copying_request(second, steps=3)
    assert not ctl.on_trial
    assert len(second.propose([0] * 20, 8, sp, rng, False).tokens) > 0
    assert not second._probe
    # a fresh drafter without it has only the prior and no budget yet: no draft at once
    fresh = _auto()
    fresh.candidates = second.candidates
    assert fresh.propose([0] * 20, 8, sp, rng, False).tokens == []
    # counts add up across requests (bounded)
    second.learnt(loaded)
    assert loaded.sources[("prompt", 8)].n >= rec.n


def test_a_trial_that_falls_short_keeps_the_kept_estimate_on_trial():
    """A kept estimate is confirmed by MIN_EVIDENCE of the request's drafts accepted in
    full in a row; one that falls short restarts the count (its drafts stay probes)."""
    from tandem.engine.drafting.adaptive import MIN_EVIDENCE

    kept = Knowledge()
    kept.learn(("prompt", 8), [1.0] * 8, 50)
    auto = _auto(kept)
    auto.budget.balance = 1.0
    ctl = auto.source_len[("prompt", 8)]
    ctl.choose(8)
    assert ctl.last_was_probe
    ctl.feedback(8, 2)  # this prompt is not the kind the estimate came from
    for _ in range(MIN_EVIDENCE - 1):
        ctl.feedback(4, 4)
    assert ctl.on_trial
    ctl.feedback(4, 4)
    assert not ctl.on_trial
    # a controller without kept verdicts is never on trial (its own rule: probes until informed)
    assert not _auto().source_len[("prompt", 8)].on_trial


def _write(path, data):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(data if isinstance(data, str) else json.dumps(data))


def _good(when=None):
    return {"version": VERSION, "when": time.time() if when is None else when,
            "sources": [{"source": "prompt", "bucket": 8, "accept": [0.9, 0.8], "n": 5}],
            "model": {"accept": [0.7], "n": 3}, "noise": {"1": 0.05, "4": 0.1}}


@pytest.mark.parametrize("bad", [
    "{not json", "[]", "null", '"text"', "1e999",
    {**_good(), "version": VERSION + 1},  # another version: ignored
    {**_good(), "version": "1"},
    {**_good(), "when": time.time() - 8 * 24 * 3600},  # stale
    {**_good(), "when": time.time() + 86400},  # from the future
    {**_good(), "when": "yesterday"},
    {**_good(), "when": None},
])
def test_a_corrupt_stale_or_foreign_file_is_ignored(tmp_path, bad):
    path = tmp_path / "k.knowledge.json"
    _write(path, bad)
    assert Knowledge.load(path, ORDER, BUCKETS) is None


def test_bad_entries_are_dropped_and_the_rest_kept(tmp_path):
    data = _good()
    data["sources"] += [
        {"source": "prompt", "bucket": 3, "accept": [1.5], "n": 2},  # out of [0, 1]
        {"source": "prompt", "bucket": 4, "accept": [float("nan")], "n": 2},
        {"source": "prompt", "bucket": 5, "accept": [0.5], "n": -1},
        {"source": "prompt", "bucket": 6, "accept": [0.5], "n": 10 ** 12},
        {"source": "prompt", "bucket": 7, "accept": [0.5] * 99, "n": 2},  # too long
        {"source": "prompt", "bucket": 99, "accept": [0.5], "n": 2},  # unknown bucket
        {"source": "model", "bucket": 8, "accept": [0.5], "n": 2},  # unknown source
        {"source": "prompt", "bucket": True, "accept": [0.5], "n": 2},
        {"source": "history", "bucket": 2, "accept": [0.5], "n": 2.5},
        "junk", None, [],
    ]
    data["noise"] = {"1": 0.05, "x": 0.1, "0": 0.1, "99": 0.1, "2": -1, "3": float("inf")}
    data["model"] = {"accept": ["a"], "n": 1}
    path = tmp_path / "k.knowledge.json"
    path.write_text(json.dumps(data))  # json writes NaN/Infinity, which json.loads reads
    k = Knowledge.load(path, ORDER, BUCKETS)
    assert k is not None and set(k.sources) == {("prompt", 8)}
    assert k.noise == {1: 0.05} and k.model is None
    for v in k.sources[("prompt", 8)].accept:
        assert math.isfinite(v) and 0 <= v <= 1


def test_an_oversized_file_is_not_read(tmp_path):
    path = tmp_path / "k.knowledge.json"
    path.write_text(json.dumps(_good()) + " " * MAX_BYTES)
    assert Knowledge.load(path, ORDER, BUCKETS) is None
    assert Knowledge.load(tmp_path / "missing.json", ORDER, BUCKETS) is None
    assert Knowledge.load(tmp_path, ORDER, BUCKETS) is None  # a directory


def test_the_file_is_written_atomically_and_bounded(tmp_path):
    k = Knowledge()
    for src in ORDER:
        for b in BUCKETS:
            k.learn((src, b), [0.5] * 99, 10 ** 9)
    path = tmp_path / "costs" / "x.knowledge.json"
    k.save(path)
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no *.tmp left
    assert path.stat().st_size < MAX_BYTES
    back = Knowledge.load(path, ORDER, BUCKETS)
    assert len(back.sources) == len(ORDER) * len(BUCKETS)
    assert all(len(r.accept) <= 16 and r.n <= 1_000_000 for r in back.sources.values())


def test_a_second_session_starts_from_the_first_ones_file(tiny_models, tmp_path, monkeypatch):
    from tandem.engine.backend.llama import ContextParams
    from tandem.engine.loop.speculative import GenParams
    from tandem.engine.pair import PairSession, SessionOptions
    from tandem.engine.tuning import pricing

    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    monkeypatch.setattr(pricing, "disagreement", lambda *a: 1.0)
    opts = SessionOptions(strategy="auto", target_ctx=ContextParams(n_ctx=256, n_threads=1),
                          home=tmp_path)
    gen = GenParams(max_tokens=8, ignore_eos=True)
    with PairSession(tiny_models["target"], None, opts) as s:
        # what this session's earlier requests measured (tiny models draft too little in a
        # few tokens to learn from): kept on disk after its next request
        s.knowledge().learn(("prompt", 5), [0.95, 0.9], 7)
        done = [ev for ev in s.generate([1, 20, 21, 22], gen) if isinstance(ev, DoneEvent)][0]
        assert done.stats.n_generated == 8
        path = s.knowledge_path()
    assert path.is_file() and path.parent.name == "costs"
    assert path.name.endswith(".knowledge.json")
    with PairSession(tiny_models["target"], None, opts) as s:
        auto = s.drafter("auto")
        ctl = auto.source_len[("prompt", 5)]
        assert ctl.tracker.accept[:2] == pytest.approx([0.95, 0.9]) and ctl.informed
        # a corrupt file: said once (statefile's policy), the next session starts from the priors
        path.write_text("{\"version\": 1, \"when\": NaN")
    with PairSession(tiny_models["target"], None, opts) as s, \
            pytest.warns(TandemWarning, match="ignored the kept knowledge"):
        auto = s.drafter("auto")
        assert auto.source_len[("prompt", 5)].tracker.accept[0] == pytest.approx(0.6)
        done = [ev for ev in s.generate([1, 20, 21, 22], gen) if isinstance(ev, DoneEvent)][0]
        assert done.stats.n_generated == 8
    assert Knowledge.load(path, ORDER, BUCKETS) is not None  # rewritten clean
