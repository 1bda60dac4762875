"""Cached costs cannot poison later runs: a cache far from this machine's timings now, an old
one, or one measured on a busy machine is not used (issue: a busy first run once recorded
3.59 s per plain step for a 0.074 s step, and auto then ran at 0.55x of plain decoding)."""
from __future__ import annotations

import time

import pytest
from tandem.engine.tuning import costs as costs_mod
from tandem.engine.tuning.costs import CostModel, calibrate
from tandem.engine.backend.llama import ContextParams
from tandem.engine.pair import PairSession, SessionOptions

pytest.importorskip("llama_cpp")


def _session(tiny_models):
    from tandem.models.store import tandem_home

    opts = SessionOptions(strategy="auto", target_ctx=ContextParams(n_ctx=512, n_threads=1),
                          home=tandem_home())
    return PairSession(tiny_models["target"], tiny_models["draft"], opts)


def _probe(s):
    return s.target.tokenize("def main():\n    print('calibrating')\n", add_special=False,
                             parse_special=False)


def _poisoned(true: CostModel, factor: float = 40.0, **kw) -> CostModel:
    return CostModel({n: v * factor for n, v in true.verify.items()}, true.draft_token * factor,
                     "calibrated", kw.get("when", time.time()), kw.get("busy", 0.05))


def test_a_poisoned_cache_is_detected_and_measured_again(tiny_models, tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    # a quiet machine by construction: the busy case has its own test below
    monkeypatch.setattr(costs_mod, "others_share", lambda before, after: 0.0)
    with _session(tiny_models) as s:
        true = calibrate(s.target_ctx, s.draft_ctx, _probe(s))
        path = s.costs_path()
        _poisoned(true).save(path)
    with _session(tiny_models) as s:  # the next run
        costs = s.costs(calibrated=True)
        assert costs.verify[1] < 10 * true.verify[1]  # the poisoned figures are not used
        assert any("measured again" in n for n in s.pricing.notes)
        notes = s.drafter("auto").notes
        assert any("measured again" in n for n in notes)
        assert s.pricing.notes == []  # said once
    saved = CostModel.load(path)
    assert saved.verify[1] < 10 * true.verify[1] and saved.when > 0  # replaced on disk


def test_an_agreeing_cache_is_used_as_is(tiny_models, tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    # a quiet machine by construction: the busy case has its own test below
    monkeypatch.setattr(costs_mod, "others_share", lambda before, after: 0.0)
    with _session(tiny_models) as s:
        s.costs()
        path = s.costs_path()
    before = CostModel.load(path)
    from tandem.engine.tuning import pricing

    seen = []
    # sub-millisecond timings of the tiny models are too noisy to agree on their own here:
    # the check is stubbed to report agreement, and must have been asked
    monkeypatch.setattr(pricing, "disagreement", lambda *a: seen.append(a) or 1.3)
    with _session(tiny_models) as s:
        assert s.costs(calibrated=True).verify == before.verify
        assert s.pricing.notes == [] and len(seen) == 1


def test_an_old_cache_expires(tiny_models, tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    # a quiet machine by construction: the busy case has its own test below
    monkeypatch.setattr(costs_mod, "others_share", lambda before, after: 0.0)
    with _session(tiny_models) as s:
        true = calibrate(s.target_ctx, s.draft_ctx, _probe(s))
        path = s.costs_path()
    old = _poisoned(true, 1.0, when=time.time() - 8 * 24 * 3600)
    old.save(path)
    with _session(tiny_models) as s:
        assert s.costs(calibrated=True).when > old.when
    assert CostModel.load(path).when > old.when


def test_a_calibration_on_a_busy_machine_is_not_saved(tiny_models, tmp_path, monkeypatch):

    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    monkeypatch.setattr(costs_mod, "others_share", lambda before, after: 0.6)
    with _session(tiny_models) as s:
        c = s.costs()
        assert c.busy == 0.6
        assert any("machine busy" in n and "60%" in n for n in s.pricing.notes)
        assert not s.costs_path().exists()
        notes = s.drafter("auto").notes
        assert any("other processes 60% of the CPU" in n for n in notes)  # when, under what load


def test_cpu_share_of_other_processes_from_proc(tmp_path):
    from tandem.engine.tuning.costs import cpu_snapshot, others_share

    a = cpu_snapshot()
    if a is None:
        pytest.skip("no /proc here")
    # 1000 jiffies passed, 600 busy, 200 of them ours: others used 40%
    assert others_share((100, 50, 1000), (700, 250, 2000)) == pytest.approx(0.4)
    assert others_share((100, 50, 1000), (105, 52, 1005)) is None  # too short to tell
    assert others_share(None, a) is None


def test_cost_files_keep_when_and_load(tmp_path):
    c = CostModel({1: 0.1}, 0.02, "calibrated", when=1_700_000_000.0, busy=0.25)
    c.save(tmp_path / "c.json")
    back = CostModel.load(tmp_path / "c.json")
    assert (back.when, back.busy) == (1_700_000_000.0, 0.25)
    assert "other processes 25% of the CPU" in back.describe()
    assert back.expired()  # 2023
    assert [p.name for p in tmp_path.iterdir()] == ["c.json"]
