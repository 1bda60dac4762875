"""Lossless in every configuration: the real generate() and drafters driven by scripted
contexts (tests/scripted.py), where the target's distribution is known exactly and costs run
on a simulated clock. Each test names the finding it guards against."""
from __future__ import annotations

import time
from collections import Counter

import numpy as np
import pytest
from engine_helpers import auto_drafter, draft_model, hybrid, ngram_drafter, run  # noqa: E402
from scripted import FakeClock, ScriptedContext, ScriptedModel, logits_of, one_hot
from tandem.engine.drafting.adaptive import FallbackGuard
from tandem.engine.drafting.drafters import (
    NoDrafter,
)
from tandem.engine.loop.sampling import SamplingParams, distribution
from tandem.engine.tuning.costs import CostModel

V = 6
BOS = 5


def _target_fn(prefix):
    # position 0: (0.6, 0.4); position 1 depends on the first token
    if len(prefix) == 1:
        return logits_of([0.6, 0.4], V)
    return logits_of([0.3, 0.7] if prefix[1] == 0 else [0.6, 0.4], V)


def _draft_fn(prefix):
    # confident at position 0 (top 0.8); after token 0 confident again (0.9), after token 1
    # not (0.5): whether a draft reaches n_min = 2 depends on the token drawn first
    if len(prefix) == 1:
        return logits_of([0.8, 0.2], V)
    last = prefix[-1]
    return logits_of([0.9, 0.1] if last == 0 else [0.5, 0.5], V)


def _expected(sp: SamplingParams) -> dict[tuple[int, int], float]:
    """The target's own distribution of the first two tokens, as plain decoding samples it."""
    out = {}
    p0 = distribution(_target_fn([BOS]), [], sp)
    for a in range(V):
        pa = p0.prob(a)
        if pa <= 0:
            continue
        p1 = distribution(_target_fn([BOS, a]), [], sp)
        for b in range(V):
            if p1.prob(b) > 0:
                out[(a, b)] = pa * p1.prob(b)
    return out


def _assert_distribution(samples: list[tuple[int, int]], expected: dict, label: str):
    from scipy.stats import chisquare

    counts = Counter(samples)
    assert set(counts) <= set(expected), f"{label}: impossible tokens {set(counts) - set(expected)}"
    keys = sorted(expected)
    n = len(samples)
    obs = np.array([counts.get(k, 0) for k in keys], dtype=float)
    exp = np.array([expected[k] * n for k in keys])
    exp *= obs.sum() / exp.sum()
    pvalue = chisquare(obs, exp).pvalue
    shares = {k: round(counts.get(k, 0) / n, 3) for k in keys}
    want = {k: round(v, 3) for k, v in expected.items()}
    assert pvalue > 0.01, f"{label}: p={pvalue:.2e}, observed {shares}, expected {want}"
    # position 0 on its own, the place a biased draft shows first
    first = sum(c for (a, _), c in counts.items() if a == 0) / n
    assert abs(first - sum(v for (a, _), v in expected.items() if a == 0)) < 0.03, label


def _drafter(kind: str, dctx, clock):
    model = draft_model(dctx, n_max=3, n_min=2, p_min=0.75) if kind != "pmin" else \
        draft_model(dctx, n_max=3, n_min=0, p_min=0.75)
    if kind in ("pmin", "draft"):
        return model
    if kind == "hybrid":
        return hybrid(model, n_min=2, n_max=3)
    # auto with the draft model forced on; cheap draft tokens on the simulated clock so the
    # adaptive length keeps drafting
    costs = CostModel(verify={1: 0.1, 2: 0.1, 3: 0.1, 4: 0.1}, draft_token=0.001)
    auto = hybrid(model, ngram_match=2, costs=costs, n_min=2, n_max=3, adaptive=True,
                  guard=True, name="auto", ngram_cap=6, ngram_n=8)
    auto.budget.balance = 1.0  # as if earned: the first step's draft is a probe paid from it
    return auto


@pytest.mark.parametrize("kind,temperature,filters", [
    ("pmin", 1.0, {"top_k": 0}),  # finding 1: the p_min stop read the sampled token's q
    ("draft", 0.8, {"top_k": 3, "top_p": 0.95}),  # finding 1: drafts under n_min were dropped
    ("draft", 1.0, {"top_k": 0}),
    ("hybrid", 1.0, {"top_k": 4, "top_p": 0.99}),
    ("auto", 0.8, {"top_k": 3, "top_p": 0.95}),
])
def test_sampled_drafts_keep_the_target_distribution(kind, temperature, filters, monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(time, "perf_counter", clock)
    model = ScriptedModel(V)
    samples, drafted = [], 0
    for seed in range(3000):
        tctx = ScriptedContext(model, _target_fn, clock=clock, cost=lambda n: 0.1)
        dctx = ScriptedContext(model, _draft_fn, clock=clock, cost=lambda n: 0.001)
        sp = SamplingParams(temperature=temperature, seed=seed, **filters)
        done, _ = run(tctx, [BOS], _drafter(kind, dctx, clock), max_tokens=3, ignore_eos=True,
                      sampling=sp)
        samples.append(tuple(done.tokens[:2]))
        drafted += done.stats.drafted
    # every request drafted (n_min 2: at least two tokens) in its first step
    assert drafted >= 3000 * (1 if kind == "pmin" else 2)
    _assert_distribution(samples, _expected(SamplingParams(temperature=temperature, **filters)),
                         f"{kind} T={temperature}")


def test_sampled_draft_is_never_shorter_than_n_min():
    model = ScriptedModel(V)
    rng = np.random.default_rng(0)
    sp = SamplingParams(temperature=1.0, top_k=0)
    lengths = Counter()
    for _ in range(300):
        dctx = ScriptedContext(model, _draft_fn)
        d = draft_model(dctx, n_min=2, p_min=0.75).propose([BOS], 3, sp, rng, True)
        lengths[len(d.tokens)] += 1
        assert d.dists is not None and len(d.dists) == len(d.tokens)
    assert set(lengths) <= {2, 3} and lengths[2] > 0 and lengths[3] > 0


# ------------------------------------------------------------------ finding 2: context end

def _cycle_fn(prefix):
    return one_hot((prefix[-1] + 1) % 5, V)


@pytest.mark.parametrize("n_max", [1, 4, 8])
def test_speculation_stops_at_the_context_end_like_plain_decoding(n_max):
    model = ScriptedModel(V)
    outs = []
    for drafter_kind in ("none", "draft"):
        tctx = ScriptedContext(model, _cycle_fn, n_ctx=40)
        if drafter_kind == "none":
            drafter = NoDrafter()
        else:
            drafter = draft_model(ScriptedContext(model, _cycle_fn, n_ctx=40), n_max)
        done, _ = run(tctx, [0, 1, 2], drafter, max_tokens=500, ignore_eos=True)
        assert done.reason == "context"
        outs.append(done)
    plain, spec = outs
    assert spec.stats.drafted > 0
    assert len(plain.tokens) == len(spec.tokens) == 40 - 3
    assert plain.tokens == spec.tokens


# ------------------------------------------------------------------ finding 3: n_batch

def test_draft_length_respects_n_batch():
    model = ScriptedModel(V)
    tctx = ScriptedContext(model, _cycle_fn, n_batch=4)
    prompt = [0, 1, 2, 3, 4] * 6  # repetitive: the n-gram drafter finds long matches
    done, steps = run(tctx, prompt, ngram_drafter(n_max=16), max_tokens=60, ignore_eos=True)
    assert done.stats.n_generated == 60
    assert max(s.drafted for s in steps) == 3  # one row for the last token, three drafts
    assert max(b for b in tctx.batches[1:]) <= 4
    assert any("n_batch 4" in n for n in done.stats.notes)


def test_calibration_measures_only_batches_that_fit(tiny_models):
    pytest.importorskip("llama_cpp")
    from tandem.engine.backend.llama import Context, ContextParams, Model
    from tandem.engine.tuning.costs import calibrate

    m = Model(tiny_models["target"])
    ctx = Context(m, ContextParams(n_ctx=256, n_batch=4, n_ubatch=4, n_threads=1))
    try:
        costs = calibrate(ctx, None, m.tokenize("def f(x):"), reps=1)
    finally:
        ctx.close()
        m.close()
    assert sorted(costs.verify) == [1, 2, 3, 4]


# ------------------------------------------- findings 4 and 5: probes and the fallback guard

VERIFY_S = 0.1
DRAFT_S = 0.075


def _costed(model, fn, clock, target: bool):
    if target:
        return ScriptedContext(model, fn, clock=clock, cost=lambda n: VERIFY_S)
    # a draft decode: 75 ms a token; a catch-up batch of n tokens costs 75 ms + 5 ms a token
    return ScriptedContext(model, fn, clock=clock,
                           cost=lambda n: DRAFT_S if n == 1 else DRAFT_S + 0.005 * n)


def _auto(dctx):
    # GPU-like flat verify; at the prior acceptance (0.7) drafting does not pay, at 0.8 it does
    costs = CostModel(verify={n: VERIFY_S for n in range(1, 10)}, draft_token=DRAFT_S)
    return hybrid(draft_model(dctx), ngram_match=99, costs=costs, n_min=0,
                  n_max=4, adaptive=True, guard=True, name="auto", ngram_n=4)


def test_auto_probes_run_after_a_long_plain_stretch(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(time, "perf_counter", clock)
    model = ScriptedModel(V)
    tctx = _costed(model, _cycle_fn, clock, True)
    dctx = _costed(model, _cycle_fn, clock, False)  # the draft always agrees
    drafter = _auto(dctx)
    done, steps = run(tctx, [0, 1, 2], drafter, max_tokens=300, ignore_eos=True)
    first = next(i for i, s in enumerate(steps) if s.drafted)
    # the first probe (2 drafts: the best rate at 90% acceptance) comes as soon as the probe
    # budget (2% of each plain step earned) covers its worst case, 2 draft tokens and a
    # verify batch no dearer than a plain step: 0.15 s = 75 steps' 2 ms; it runs despite
    # the draft's 75-token lag
    assert 70 <= first <= 76
    late = steps[len(steps) // 2:]
    assert sum(1 for s in late if s.drafted) >= 0.9 * len(late)  # drafting pays: it stays on
    assert drafter.guard.fallbacks == 0
    # draft-token cost learned from single-token decodes only, not diluted by catch-up batches
    assert drafter.costs.draft_token == pytest.approx(DRAFT_S)
    assert done.tokens == tuple((3 + i) % 5 for i in range(300))


def test_guard_resumes_after_a_slump_without_flapping(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(time, "perf_counter", clock)
    model = ScriptedModel(V)

    def draft_fn(prefix):  # wrong for the first 150 positions, then right
        good = (prefix[-1] + 1) % 5
        return one_hot(good if len(prefix) > 150 else (good + 2) % 5, V)

    tctx = _costed(model, _cycle_fn, clock, True)
    dctx = _costed(model, draft_fn, clock, False)
    drafter = _auto(dctx)
    drafter.model_len.tracker.accept = [0.95] * 4  # starts out believing in the draft
    done, steps = run(tctx, [0, 1, 2], drafter, max_tokens=600, ignore_eos=True)
    pos, late = 3, []
    for s in steps:
        if pos > 450:
            late.append(s)
        pos += s.accepted + 1
    assert sum(1 for s in late if s.drafted) >= 0.8 * len(late), "never resumed"
    assert drafter.guard.fallbacks <= 2, "flapping"


def test_guard_counts_model_steps_that_proposed_nothing_as_speculation(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(time, "perf_counter", clock)
    model = ScriptedModel(V)
    tctx = _costed(model, _cycle_fn, clock, True)
    # an unsure draft: top probability 0.4 < p_min, so it never proposes, yet it costs time
    dctx = _costed(model, lambda p: logits_of([0.4, 0.3, 0.3], V), clock, False)
    drafter = hybrid(draft_model(dctx, p_min=0.5), ngram_match=99, n_max=4,
                     guard=True)
    done, steps = run(tctx, [0, 1, 2], drafter, max_tokens=30, ignore_eos=True)
    assert done.stats.drafted == 0
    # steps where the model ran for nothing were measured as speculation (0.175 s a token),
    # slower than the plain steps (0.1 s): the guard switched the drafting off
    assert drafter.guard.spec_rate == pytest.approx(1 / (VERIFY_S + DRAFT_S))
    assert drafter.guard.plain_rate == pytest.approx(1 / VERIFY_S)
    assert drafter.guard.fallbacks >= 1
    assert sum(1 for s in steps if s.t_draft > 0) <= 10


def test_guard_backoff_starts_over_once_speculation_pays_again():
    g = FallbackGuard(min_spec_steps=2, initial_backoff=4)
    g.observe(1, 0.1, speculative=False)  # plain 10 tok/s
    for _ in range(2):
        g.observe(1, 0.2, speculative=True)  # 5 tok/s: fall back for 4
    assert g.fallbacks == 1 and g.backoff == 8
    while g.want_plain():
        pass
    for _ in range(2):
        g.observe(3, 0.2, speculative=True)  # 15 tok/s: clearly faster
    assert g.backoff == 0
    for _ in range(10):  # a later slump
        g.observe(1, 0.2, speculative=True)
        if g.fallbacks == 2:
            break
    assert g.fallbacks == 2
    assert [g.want_plain() for _ in range(5)] == [True] * 4 + [False]  # short again, not 8


# ------------------------------------------------------------------ finding 9: statistics

def test_stats_do_not_count_accepted_drafts_cut_by_eos_or_a_stop_string():
    eos = 4
    model = ScriptedModel(V, pieces=[b"a", b"b", b"c", b"d", b"", b"^"], eog=[eos])

    def fn(prefix):  # 0 1 2 3 <eos> ...
        return one_hot(min(prefix[-1] + 1, eos) if prefix[-1] != BOS else 0, V)

    tctx = ScriptedContext(model, fn)
    done, steps = run(tctx, [BOS], draft_model(ScriptedContext(model, fn), n_max=8),
                      max_tokens=20)
    assert done.reason == "eos" and done.tokens == (0, 1, 2, 3)
    # the draft proposed 0 1 2 3 <eos> 4 4 4, all accepted; only the first four reached the output
    assert steps[0].accepted == 8
    assert done.stats.accepted == 4 and done.stats.n_generated == 4
    tctx = ScriptedContext(model, fn)
    done, _ = run(tctx, [BOS], draft_model(ScriptedContext(model, fn), n_max=8),
                  max_tokens=20, stop=("bc",))
    assert done.reason == "stop" and done.text == "a"
    assert done.stats.accepted == 3  # "a", "b", "c" were emitted; the stop string ends there


def test_draft_strategy_is_reproducible_with_a_seed():
    model = ScriptedModel(V)
    outs = set()
    for _ in range(3):
        tctx = ScriptedContext(model, _target_fn)
        dctx = ScriptedContext(model, _draft_fn)
        done, _ = run(tctx, [BOS], draft_model(dctx, n_max=3, n_min=2, p_min=0.75),
                      max_tokens=2, ignore_eos=True,
                      sampling=SamplingParams(temperature=1.0, seed=7))
        outs.add(done.tokens)
    assert len(outs) == 1


def test_unfiltered_distributions_cost_one_float32_row():
    logits = np.random.default_rng(0).standard_normal(152_064).astype(np.float32)
    q = distribution(logits, [], SamplingParams(temperature=0.8, top_k=0))
    assert q.ids is None and q.probs.dtype == np.float32
    assert q.probs.nbytes == logits.nbytes
    assert sum(q.prob(t) for t in range(5)) == pytest.approx(q.dense(152_064)[:5].sum())
    assert q.dense(152_064).sum() == pytest.approx(1.0)
    sparse = distribution(logits, [], SamplingParams(temperature=0.8, top_k=40))
    assert len(sparse.ids) == 40


# ------------------------------------------------ a poisoned cost model within one request

PROMPT_LEN = 200
CPU_TRUE = {1: 0.086, 2: 0.123, 3: 0.149, 4: 0.182, 5: 0.211, 8: 0.272, 17: 0.389}


def _rag_sequence(n: int = 600) -> list[int]:
    """A long prompt over a small alphabet, so that short n-gram matches are everywhere and
    mostly wrong (as in retrieved documents), and an answer that now and then quotes it."""
    rng = np.random.default_rng(3)
    seq = [int(t) for t in rng.integers(0, 6, size=n)]
    for start in range(PROMPT_LEN + 30, n - 30, 70):  # quote 24 prompt tokens
        src = int(rng.integers(0, PROMPT_LEN - 24))
        seq[start:start + 24] = seq[src:src + 24]
    return seq


def _simulated_rate(clock, costs: CostModel, check: bool, monkeypatch,
                    guard: bool = True) -> tuple[float, object]:
    seq = _rag_sequence()
    model = ScriptedModel(13)
    true = CostModel(dict(CPU_TRUE))
    tctx = ScriptedContext(model, lambda p: one_hot(seq[len(p)] if len(p) < len(seq) else 0, 13),
                           clock=clock, cost=true.verify_cost)
    drafter = (NoDrafter() if costs is None else
               hybrid(None, ngram_match=2, costs=costs, n_max=3, adaptive=True,
                      guard=True, name="auto", ngram_cap=16, ngram_n=8))
    if not check and costs is not None:
        monkeypatch.setattr(drafter, "CHECK_STEPS", 0)
    if not guard and costs is not None:
        drafter.guard = None
    prompt = seq[:PROMPT_LEN]
    t0 = clock()
    done, _ = run(tctx, prompt, drafter, max_tokens=300, ignore_eos=True)
    assert list(done.tokens) == seq[PROMPT_LEN:PROMPT_LEN + 300]
    return 300 / (clock() - t0), done


def test_a_poisoned_cost_model_cannot_make_auto_slower_than_plain(monkeypatch):
    """The observed case: a calibration on a busy machine, 40x too slow and flat (long drafts
    look free). It once made auto draft long n-grams that fail and run far slower than plain
    decoding. Now every defence alone keeps auto within the probe budget (2%) of plain: the
    request's own check (the curve is measured afresh), the guard, and the margin itself (a
    curve that disagrees with every step shows as noise, which widens the margin until
    nothing qualifies)."""
    clock = FakeClock()
    monkeypatch.setattr(time, "perf_counter", clock)
    poisoned = {n: 3.59 + 0.02 * n for n in CPU_TRUE}
    plain, _ = _simulated_rate(clock, None, True, monkeypatch)
    good, _ = _simulated_rate(clock, CostModel(dict(CPU_TRUE)), True, monkeypatch)
    # neither the request's cost check nor the guard's plain measurement: what once happened
    blind, _ = _simulated_rate(clock, CostModel(dict(poisoned), 3.09), False, monkeypatch,
                               guard=False)
    checked, done = _simulated_rate(clock, CostModel(dict(poisoned), 3.09), True, monkeypatch,
                                    guard=False)
    guarded, _ = _simulated_rate(clock, CostModel(dict(poisoned), 3.09), False, monkeypatch)
    fixed, _ = _simulated_rate(clock, CostModel(dict(poisoned), 3.09), True, monkeypatch)
    ratios = {k: round(v / plain, 3) for k, v in
              dict(good=good, blind=blind, checked=checked, guarded=guarded, fixed=fixed).items()}
    print(ratios)
    # rates: 0.98 of plain's rate is the probe budget's bound on the time (1 / 1.02)
    assert all(r >= 0.98 for r in ratios.values()), ratios
    assert any("measured afresh" in n for n in done.stats.notes)


# ------------------------------------------------------- drafts from history and context files

HIST_PROMPT = [BOS, 2, 3]


def _hist_target_fn(prefix):
    # as _target_fn, after a three-token prompt: (0.6, 0.4), then by the first token
    if len(prefix) <= len(HIST_PROMPT):  # shorter: the prompt's own rows, never sampled
        return logits_of([0.6, 0.4], V)
    return logits_of([0.3, 0.7] if prefix[len(HIST_PROMPT)] == 0 else [0.6, 0.4], V)


def _history_auto(source: str):
    from tandem.engine.drafting.history import Library

    lib = Library(None, remember=False)
    # the earlier answers disagree with each other and with the target's likeliest tokens:
    # point-mass drafts that are often wrong, the case where a bias would show
    for doc in ([BOS, 2, 3, 1, 1, 4], [BOS, 2, 3, 0, 0, 4]):
        (lib.history if source == "history" else lib.files).add(doc)
    costs = CostModel(verify={n: 0.1 for n in range(1, 18)})
    auto = auto_drafter(None, costs, n_max=3, library=lib)
    auto.guard = None  # never fall back to plain: every request must draft
    return auto


@pytest.mark.parametrize("source", ["history", "file"])
def test_history_drafts_keep_the_target_distribution(source, monkeypatch):
    """Drafts from earlier answers or files are deterministic: verified as point masses, the
    output is distributed exactly as plain decoding's (chi-square, as above)."""
    clock = FakeClock()
    monkeypatch.setattr(time, "perf_counter", clock)
    model = ScriptedModel(V)
    sp_args = {"temperature": 0.8, "top_k": 3, "top_p": 0.95}
    samples, by_source = [], Counter()
    for seed in range(3000):
        tctx = ScriptedContext(model, _hist_target_fn, clock=clock, cost=lambda n: 0.1)
        done, steps = run(tctx, HIST_PROMPT, _history_auto(source), max_tokens=3,
                          ignore_eos=True, sampling=SamplingParams(seed=seed, **sp_args))
        samples.append(tuple(done.tokens[:2]))
        by_source[source] += steps[0].drafted
    assert by_source[source] >= 3000 * 2
    sp = SamplingParams(**sp_args)
    expected = {}
    p0 = distribution(_hist_target_fn(HIST_PROMPT), [], sp)
    for a in range(V):
        if p0.prob(a) > 0:
            p1 = distribution(_hist_target_fn(HIST_PROMPT + [a]), [], sp)
            expected.update({(a, b): p0.prob(a) * p1.prob(b) for b in range(V) if p1.prob(b) > 0})
    _assert_distribution(samples, expected, f"auto from {source}")


def test_greedy_with_history_is_identical_to_plain_in_exact_mode(tiny_models, monkeypatch):
    """Exact mode, greedy: auto drafting from history and files gives plain decoding's tokens."""
    from tandem.engine.backend.llama import ContextParams, exact_context
    from tandem.engine.drafting.adaptive import LengthController
    from tandem.engine.loop.events import DoneEvent
    from tandem.engine.loop.speculative import GenParams
    from tandem.engine.pair import PairSession, SessionOptions

    ctx = exact_context(ContextParams(n_ctx=512, n_threads=1))
    opts = SessionOptions(strategy="auto", target_ctx=ctx, repack=False)
    gen = GenParams(max_tokens=40, ignore_eos=True)
    with PairSession(tiny_models["target"], tiny_models["draft"], opts) as s:
        s.pricing.keep_knowledge = False  # nothing on disk; as if earlier requests of this session
        kept = s.knowledge()  # had learnt that copies from these sources are accepted:
        for src in ("history", "file"):
            for b in range(3, 9):
                kept.learn((src, b), [1.0] * 16, 10)
        # ...and that these requests confirmed it (else its drafts wait for the probe budget)
        monkeypatch.setattr(LengthController, "on_trial", property(lambda self: False))
        prompts = [[1, 30 + i, 31 + i, 32, 33] for i in range(4)]
        plain = [[ev for ev in s.generate(p, gen, strategy="none", record=False)
                  if isinstance(ev, DoneEvent)][0].tokens for p in prompts]
        for answer in plain:
            s.library.record(answer)  # earlier answers, as a history would hold them
        s.library.add_file("notes", list(plain[0][5:]) + list(plain[2]))
        drafted_from = Counter()
        for p, want in zip(prompts, plain):
            done = [ev for ev in s.generate(p, gen) if isinstance(ev, DoneEvent)][0]
            assert done.tokens == want
            for src, (d, _) in done.stats.by_source.items():
                drafted_from[src] += d
    assert drafted_from["history"] + drafted_from["file"] > 0, drafted_from
