"""strategy auto: the draft model is used only where this machine's costs say it can pay, and
n-gram acceptance is learnt per match length."""
from __future__ import annotations

import numpy as np
from engine_helpers import hybrid  # noqa: E402
from tandem.engine.backend.llama import ContextParams
from tandem.engine.drafting.adaptive import model_draft_gain
from tandem.engine.drafting.auto import AUTO_MODEL_GAIN
from tandem.engine.drafting.drafters import DraftParams
from tandem.engine.loop.events import DoneEvent, PrefillEvent, StepEvent
from tandem.engine.loop.sampling import SamplingParams
from tandem.engine.loop.speculative import GenParams
from tandem.engine.pair import PairSession, SessionOptions
from tandem.engine.tuning.costs import CostModel

# this CPU's calibrated figures (docs/benchmarks.md): a 0.5B draft token costs 0.43 of a plain step
CPU = CostModel({1: 0.086, 2: 0.123, 3: 0.149, 4: 0.182, 5: 0.211, 8: 0.272, 17: 0.389}, 0.0368)
# an RTX 4090-like profile: verify batches cost about a plain step, the draft ~8% of it
GPU = CostModel({1: 0.0100, 2: 0.0102, 5: 0.0106, 9: 0.0112, 17: 0.0125}, 0.0008)


def test_model_draft_gain_from_costs():
    # CPU: k=2 at 90%: (1 + .9 + .81) / (2 * .0368 + .149) = 12.2 tok/s vs 11.6 plain
    assert 1.0 < model_draft_gain(CPU, 3) < AUTO_MODEL_GAIN
    assert model_draft_gain(GPU, 8) > 3.0
    assert model_draft_gain(CostModel({1: 0.1}, 0.0), 4) == 1.0  # draft cost unknown


def _auto(tiny_models, tmp_path, monkeypatch, costs: CostModel, exact: bool = False):
    import time

    from tandem.engine.tuning import pricing

    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    # as if calibrated on such a machine just now: the tiny models' real timings (which the
    # check against cached costs would measure) are not what these tests are about
    monkeypatch.setattr(pricing, "disagreement", lambda *a: 1.0)
    opts = SessionOptions(strategy="auto", target_ctx=ContextParams(n_ctx=512, n_threads=2,
                                                                    exact=exact), home=tmp_path)
    session = PairSession(tiny_models["target"], tiny_models["draft"], opts)
    CostModel(dict(costs.verify), costs.draft_token, "calibrated", time.time(), 0.05).save(
        session.costs_path())
    return session


def test_auto_drops_the_draft_model_where_it_cannot_pay(tiny_models, tmp_path, monkeypatch):
    with _auto(tiny_models, tmp_path, monkeypatch, CPU) as s:
        drafter = s.drafter("auto")
        assert drafter.model is None
        assert drafter.notes and "draft model off" in drafter.notes[0]
        prompt = s.target.tokenize("one two three one two three one two", add_special=True,
                                   parse_special=False)
        plain = auto = None
        for strategy in ("none", "auto"):
            s.target_ctx.truncate(0)
            for ev in s.generate(prompt, GenParams(max_tokens=24), strategy=strategy):
                if isinstance(ev, DoneEvent):
                    plain, auto = (ev, auto) if strategy == "none" else (plain, ev)
        assert auto.tokens == plain.tokens
        assert "draft model off" in auto.stats.summary()
        assert s.draft_ctx.tokens == []  # never read the prompt: it was never going to draft


def test_auto_keeps_the_draft_model_where_it_pays(tiny_models, tmp_path, monkeypatch):
    with _auto(tiny_models, tmp_path, monkeypatch, GPU) as s:
        drafter = s.drafter("auto")
        assert drafter.model is not None
        assert [n for n in drafter.notes if not n.startswith("costs: ")] == []
        prompt = s.target.tokenize("alpha beta gamma", add_special=True, parse_special=False)
        seen = []
        for ev in s.generate(prompt, GenParams(max_tokens=4), strategy="auto"):
            if isinstance(ev, PrefillEvent):
                seen.append(list(s.draft_ctx.tokens))
        # when the prompt phase ends, the draft has read the prompt too (as llama.cpp does),
        # so its reading is not counted as decoding time
        assert seen[-1] == prompt[:-1]


def test_ngram_acceptance_is_learnt_per_match_length():
    d = hybrid(None, ngram_match=2, costs=CPU, adaptive=True, ngram_n=4, ngram_cap=8)
    sp, rng = SamplingParams(temperature=0.0), np.random.default_rng(0)
    # "5 6" recurs (a 2-token match) but is followed by something else each time
    tokens = [1, 5, 6, 7, 2, 5, 6, 8, 3, 5, 6]
    d.prefill(tokens)
    d.budget.balance = 1.0  # as if earned: a first draft is a probe, paid from the budget
    draft = d.propose(tokens, 8, sp, rng, False)
    assert draft.tokens and draft.tokens[0] == 8
    before4 = list(d.ngram_len[4].tracker.accept)
    d.observe(StepEvent(0, len(draft.tokens), 0, 8, 0.0, 0.12, 0.0))  # rejected at once
    assert d.ngram_len[2].tracker.accept[0] < 0.6
    assert d.ngram_len[4].tracker.accept == before4  # long matches keep their own record


def test_drafts_never_exceed_the_exact_batch(tiny_models, tmp_path, monkeypatch):
    from tandem.engine.backend.llama import EXACT_BATCH

    with _auto(tiny_models, tmp_path, monkeypatch, GPU, exact=True) as s:
        prompt = s.target.tokenize("a b c a b c a b c a b c a b", add_special=True,
                                   parse_special=False)
        steps, done = [], None
        for ev in s.generate(prompt, GenParams(max_tokens=40, ignore_eos=True), strategy="draft",
                             draft=DraftParams(n_max=12, p_min=0.0)):
            if isinstance(ev, StepEvent):
                steps.append(ev.drafted)
            elif isinstance(ev, DoneEvent):
                done = ev
        assert not s.target.on_gpu and s.target_ctx.verify_limit == EXACT_BATCH
        assert max(steps) == EXACT_BATCH - 1
        assert any(f"drafts capped at {EXACT_BATCH - 1}" in n for n in done.stats.notes)


def test_calibration_times_the_same_number_of_draft_tokens_whatever_the_sizes(
        tiny_models, tmp_path, monkeypatch):
    # spec-bench calibrates drafts with sizes=(1,): the draft cost must still be the time of
    # DRAFT_PROBE_TOKENS decodes divided by that count (it once divided one decode by 8)
    from tandem.engine.tuning.costs import DRAFT_PROBE_TOKENS, calibrate

    with _auto(tiny_models, tmp_path, monkeypatch, CPU) as s:
        probe = s.target.tokenize("def f(): pass", add_special=False, parse_special=False)
        for sizes in ((1,), (1, 2, 3, 17)):
            s.draft_ctx.truncate(0)
            calibrate(s.target_ctx, s.draft_ctx, probe, sizes=sizes, reps=1)
            assert s.draft_ctx.n_decoded - len(probe) == DRAFT_PROBE_TOKENS, sizes
            s.draft_ctx.n_decoded = 0


def test_an_implausible_cached_cost_curve_is_measured_again(tiny_models, tmp_path, monkeypatch):
    # a calibration that ran while the cores were busy: 6 tokens "cheaper" than 1
    busy = CostModel({1: 0.43, 2: 0.54, 6: 0.29, 17: 0.26}, 0.33)
    assert not busy.plausible() and CPU.plausible() and GPU.plausible()
    assert not CostModel({}, 0.0).plausible()
    import tandem.engine.tuning.pricing as pricing_module

    calls = []

    def fake_calibrate(target, draft, tokens):
        calls.append(len(tokens))
        return CostModel(dict(CPU.verify), CPU.draft_token, source="calibrated", busy=0.05)

    monkeypatch.setattr(pricing_module, "calibrate", fake_calibrate)
    with _auto(tiny_models, tmp_path, monkeypatch, busy) as s:
        costs = s.costs()
        assert len(calls) == 1 and costs.source == "calibrated"
        costs.observe_verify(1, 0.500)  # a slow step during the session refines the model...
        assert s.costs().verify[1] > CPU.verify[1]
        # ...but neither the calibration the draft-model decision reads nor the cache file
        assert s.costs(calibrated=True).verify == CPU.verify
        path = s.costs_path()
    assert CostModel.load(path).verify == CPU.verify


def test_a_prompt_too_long_for_the_draft_context_decodes_plainly(tiny_models, tmp_path,
                                                                monkeypatch):
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    opts = SessionOptions(strategy="draft", target_ctx=ContextParams(n_ctx=512, n_threads=2),
                          draft_ctx=ContextParams(n_ctx=64, n_threads=2))
    with PairSession(tiny_models["target"], tiny_models["draft"], opts) as s:
        prompt = s.target.tokenize(" ".join(["word"] * 100), add_special=True,
                                   parse_special=False)
        assert s.draft_ctx.n_ctx < len(prompt) < s.target_ctx.n_ctx
        done = [ev for ev in s.generate(prompt, GenParams(max_tokens=8, ignore_eos=True))
                if isinstance(ev, DoneEvent)][0]
        assert done.stats.n_generated == 8 and done.stats.drafted == 0


def test_a_chat_turn_never_reads_the_draft_where_auto_turned_the_model_off(
        tiny_models, tmp_path, monkeypatch):
    from tandem.chat.conversation import ChatSession

    with _auto(tiny_models, tmp_path, monkeypatch, CPU) as s:
        chat = ChatSession(s, gen=GenParams(max_tokens=8), strategy="auto")
        decoded = s.draft_ctx.n_decoded
        done = [ev for ev in chat.send("one two three one two three one two")
                if isinstance(ev, DoneEvent)][0]
        assert "draft model off" in done.stats.summary()
        assert done.stats.n_prompt_eval == done.stats.n_prompt  # the target read the prompt
        # the prompt phase is the engine's: auto's drafter has no model, so the draft reads nothing
        assert s.draft_ctx.n_decoded == decoded and s.draft_ctx.tokens == []
