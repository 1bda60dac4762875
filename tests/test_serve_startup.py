"""What `tandem serve` measures before its first answer (issue 51): auto's drafting costs
(and, with one sequence, the thread count) are measured before the server listens, each
said on stderr with what it took and what the costs are based on, so the first request
waits for nothing the second does not. A busy machine's calibration never replaces a quiet
one's figures; where there are none it is kept apart, so the next busy start does not
calibrate again, and a quiet start measures again."""
from __future__ import annotations

import json

import pytest

from serve_helpers import Server, tiny_args
from tandem.engine.backend.context_params import ContextParams
from tandem.engine.pair import PairSession, SessionOptions, warm_up
from tandem.engine.tuning import costs as costs_mod
from tandem.engine.tuning import pricing
from tandem.engine.tuning.costs import CostModel
from tandem.engine.tuning.pricing import busy_path

pytest.importorskip("llama_cpp")


def _cost_files(home) -> dict[str, int]:
    """The cost files (not the knowledge kept beside them) and when each was written."""
    return {p.name: p.stat().st_mtime_ns for p in (home / "costs").glob("*.json")
            if not p.name.endswith(".knowledge.json")}


def _chat(srv: Server, prompt: str) -> dict:
    status, body, _ = srv.raw("POST", "/v1/chat/completions", json.dumps(
        {"messages": [{"role": "user", "content": prompt}], "max_tokens": 16,
         "temperature": 0}))
    assert status == 200, body
    return body


def test_a_fresh_server_measures_its_costs_before_it_listens(tiny_models, tmp_path):
    home = tmp_path / "home"
    srv = Server([*tiny_args(tiny_models), "--strategy", "auto"], home)
    try:
        started = list(srv.log)  # up to the ready line: Server returns once it is out
        kept = _cost_files(home)
        _chat(srv, "hello there")
        _chat(srv, "write a loop")
        after = _cost_files(home)
    finally:
        srv.stop()
    ready = next(i for i, ln in enumerate(started) if "http://127.0.0.1:" in ln)
    said = [i for i, ln in enumerate(started)
            if ln.startswith("tandem serve: drafting costs in ")]
    assert len(said) == 1 and said[0] < ready, started
    line = started[said[0]]
    assert " s: calibrated now" in line, line
    assert started[said[0] - 1].startswith("tandem serve: measuring the drafting costs"), started
    # saved before any request: as this machine's costs (quiet), or kept apart (busy)
    assert len(kept) == 1, kept
    name = next(iter(kept))
    assert name.endswith(".busy.json") == ("busy machine" in line), (name, line)
    assert after == kept  # the first request measured nothing again: no file rewritten
    assert "Traceback" not in "".join(srv.log)


def test_a_server_without_auto_measures_no_costs(tiny_models, tmp_path):
    home = tmp_path / "home"
    srv = Server([*tiny_args(tiny_models), "--strategy", "draft"], home)
    try:
        _chat(srv, "hello there")
    finally:
        srv.stop()
    assert not any("drafting costs" in ln for ln in srv.log), srv.log
    assert not (home / "costs").exists() or _cost_files(home) == {}


# -- the start-up's steps and the calibration policy, in one process (the load is scripted:
# the tiny models' sub-millisecond timings cannot make a machine busy or quiet on purpose)

def _session(tiny_models, home, strategy="auto", threads=1):
    opts = SessionOptions(strategy=strategy, home=home, adapt_threads=threads == 0,
                          target_ctx=ContextParams(n_ctx=512, n_threads=threads))
    return PairSession(tiny_models["target"], tiny_models["draft"], opts)


def _steps(session, strategy="auto"):
    return list(warm_up(session, strategy, should_stop=lambda: False))


def _no_calibration(*args):
    raise AssertionError("calibrated again")


def test_warm_up_says_what_it_measured(tiny_models, tmp_path, monkeypatch):
    monkeypatch.setattr(costs_mod, "others_share", lambda before, after: 0.0)
    with _session(tiny_models, tmp_path, threads=0) as s:  # the thread count is the engine's
        steps = _steps(s)
        chooses = s.threads.active  # (a one-core machine has no count to choose)
        assert [(st.what, st.seconds is None) for st in steps] == [
            ("thread count", False)] * chooses + [("drafting costs", True),
                                                  ("drafting costs", False)]
        if chooses:
            assert steps[0].result.startswith(f"{s.threads.tuner.current} of ")
        assert steps[-1].result == "calibrated now, saved for later starts"
        assert s.costs_path().exists()
        monkeypatch.setattr(pricing, "calibrate", _no_calibration)
        s.drafter("auto")  # the first request's drafter: the costs measured at start-up
    with _session(tiny_models, tmp_path, strategy="draft") as s:
        assert _steps(s, "draft") == []  # no strategy but auto reads the costs


def test_a_busy_start_keeps_its_costs_apart_until_a_quiet_one(tiny_models, tmp_path,
                                                               monkeypatch):
    load = {"share": 0.6}
    monkeypatch.setattr(costs_mod, "others_share", lambda before, after: load["share"])
    # the check's sub-millisecond timings are noise on the tiny models: it agrees here
    monkeypatch.setattr(pricing, "disagreement", lambda *a: 1.2)
    with _session(tiny_models, tmp_path) as s:
        basis = _steps(s)[-1].result
        path = s.costs_path()
    assert basis.startswith("calibrated now on a busy machine (other processes used 60%")
    assert "kept apart for later busy starts" in basis
    assert not path.exists() and busy_path(path).exists()  # never as this machine's costs
    with monkeypatch.context() as m, _session(tiny_models, tmp_path) as s:  # busy again
        m.setattr(pricing, "calibrate", _no_calibration)
        basis = _steps(s)[-1].result
        assert s.costs(calibrated=True).busy == 0.6
    assert basis.startswith("the costs a busy start measured (calibrated ")
    assert "checked now (1.20x); a quiet start measures them again" in basis
    load["share"] = 0.0  # quiet: measured again, saved, the busy figures gone
    with _session(tiny_models, tmp_path) as s:
        assert _steps(s)[-1].result == "calibrated now, saved for later starts"
    assert CostModel.load(path).busy == 0.0 and not busy_path(path).exists()


def test_a_busy_start_scales_a_quiet_machines_costs(tiny_models, tmp_path, monkeypatch):
    """Saved quiet figures that a busy machine's check finds 3x off: their curve, scaled to
    the timings now, for this session; not a busy calibration at every start."""
    monkeypatch.setattr(costs_mod, "others_share", lambda before, after: 0.0)
    with _session(tiny_models, tmp_path) as s:
        s.costs()
        path = s.costs_path()
    saved = CostModel.load(path)
    written = path.stat().st_mtime_ns
    monkeypatch.setattr(costs_mod, "others_share", lambda before, after: 0.7)
    monkeypatch.setattr(pricing, "disagreement", lambda *a: 3.0)
    monkeypatch.setattr(pricing, "calibrate", _no_calibration)
    with _session(tiny_models, tmp_path) as s:
        basis = _steps(s)[-1].result
        used = s.costs(calibrated=True)
        notes = s.pricing.take_notes()
    assert basis.startswith("the saved costs (calibrated ") and "scaled by 3.00x" in basis
    assert "other processes use 70% of the CPU" in basis
    assert used.verify[1] == pytest.approx(3.0 * saved.verify[1])
    assert any("not measured again" in n for n in notes), notes
    assert path.stat().st_mtime_ns == written and not busy_path(path).exists()
