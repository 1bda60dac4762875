"""Helpers for engine tests: run generate() and compare against plain decoding."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
from tandem.engine.backend.llama import Context, ContextParams, Model
from tandem.engine.drafting.auto import AutoDrafter
from tandem.engine.drafting.drafters import DraftModelDrafter, DraftParams, NgramDrafter, NoDrafter
from tandem.engine.drafting.hybrid import HybridDrafter, HybridPolicy
from tandem.engine.loop.events import DoneEvent, StepEvent
from tandem.engine.loop.speculative import GenParams, generate
from tandem.engine.tuning.costs import MAX_BATCH, CostModel


def run(ctx, prompt, drafter, **kw):
    """Returns (DoneEvent, [StepEvent])."""
    steps, done = [], None
    for ev in generate(ctx, prompt, drafter, GenParams(**kw)):
        if isinstance(ev, StepEvent):
            steps.append(ev)
        elif isinstance(ev, DoneEvent):
            done = ev
    return done, steps


def top2_gap(model: Model, tokens, params: ContextParams | None = None) -> tuple[float, int, int]:
    """Single-token (plain) logits after `tokens`: gap of the two best and their ids, in the
    context configuration under test (`params`: KV type, flash attention, threads)."""
    params = replace(params or ContextParams(), n_ctx=max(512, len(tokens) + 8))
    ctx = Context(model, params)
    try:
        logits = np.array(ctx.sync(tokens))
    finally:
        ctx.close()
    a, b = np.argsort(-logits)[:2]
    return float(logits[a] - logits[b]), int(a), int(b)


def assert_same_as_plain(model, prompt, plain_tokens, spec_tokens, tol=1e-3, params=None):
    """Token-identical, except where batched and single-token logits legitimately pick
    different tokens: then the plain logits' two best must be within `tol` there (measured
    with the context settings under test, `params`)."""
    plain_tokens, spec_tokens = list(plain_tokens), list(spec_tokens)
    if plain_tokens == spec_tokens:
        return
    n = min(len(plain_tokens), len(spec_tokens))
    i = next((j for j in range(n) if plain_tokens[j] != spec_tokens[j]), n)
    assert i < n, f"lengths differ without a token difference: {len(plain_tokens)} vs {len(spec_tokens)}"
    gap, a, b = top2_gap(model, list(prompt) + plain_tokens[:i], params)
    assert {a, b} == {plain_tokens[i], spec_tokens[i]} and gap < tol, (
        f"divergence at token {i}: plain {plain_tokens[i]} vs speculative {spec_tokens[i]}, "
        f"top-2 gap {gap:.5f} ({a}, {b})")


def drafter_for(ctx, n_min=0, p_min=0.0, n_max=4):
    return draft_model(ctx, n_max, n_min, p_min) if ctx is not None else NoDrafter()


# The drafters with the lengths a test names and the rest fixed here: the product's
# constructors take every value (a DraftParams from the settings), these shorten the tests.
def draft_model(ctx, n_max=4, n_min=0, p_min=0.0) -> DraftModelDrafter:
    return DraftModelDrafter(ctx, DraftParams(n_max, n_min, p_min))


def ngram_drafter(n_max=4) -> NgramDrafter:
    return NgramDrafter(DraftParams(n_max=n_max))


def hybrid(model, *, n_max=8, n_min=0, costs=None, sources=None, budget=None,
           **policy) -> HybridDrafter:
    return HybridDrafter(model, DraftParams(n_max, n_min), costs or CostModel(),
                         HybridPolicy(**policy), sources=sources, budget=budget)


def auto_drafter(model, costs, *, n_max=4, n_min=0, verify_limit=MAX_BATCH, calibrated=None,
                 notes=(), library=None, knowledge=None) -> AutoDrafter:
    return AutoDrafter(model, DraftParams(n_max, n_min), costs, verify_limit=verify_limit,
                       calibrated=calibrated, notes=notes, library=library,
                       knowledge=knowledge)


def assert_same_first_tokens(plain, spec, label: str, positions=(0, 1)) -> None:
    """The tokens at `positions` of sampled runs (lists of token lists), plain against
    speculative, are drawn from one distribution: chi-square per position, categories seen at
    least 10 times, p > 0.01."""
    from scipy.stats import chi2_contingency

    for pos in positions:
        a, b = [t[pos] for t in plain], [t[pos] for t in spec]
        cats = sorted(set(a) | set(b))
        table = np.array([[a.count(c) for c in cats], [b.count(c) for c in cats]])
        table = table[:, table.sum(axis=0) >= 10]
        assert table.shape[1] >= 2, "a degenerate distribution tests nothing"
        pvalue = chi2_contingency(table)[1]
        assert pvalue > 0.01, f"{label} position {pos}: p={pvalue:.4f}\n{table}"


def sampled_first_tokens(ctx, prompt, drafter, seeds, n: int = 2, top_k: int = 8):
    """The first n tokens of runs at T=1 with top-k (one run per seed), and how many tokens
    were drafted and rejected in all: the samples assert_same_first_tokens compares."""
    from tandem.engine.loop.sampling import SamplingParams

    out, drafted, rejected = [], 0, 0
    for seed in seeds:
        done, _ = run(ctx, prompt, drafter, max_tokens=n + 1, ignore_eos=True,
                      sampling=SamplingParams(temperature=1.0, top_k=top_k, seed=seed))
        out.append(done.tokens[:n])
        drafted += done.stats.drafted
        rejected += done.stats.drafted - done.stats.accepted
    return out, drafted, rejected


def session_done(session, prompt, gen, strategy):
    """The DoneEvent of one PairSession.generate() with `strategy`, recorded nowhere."""
    return [ev for ev in session.generate(prompt, gen, strategy=strategy, record=False)
            if isinstance(ev, DoneEvent)][0]
