"""The real default pair: speculative greedy output equals plain greedy output."""
from __future__ import annotations

import pytest

pytest.importorskip("llama_cpp")

from engine_helpers import assert_same_as_plain  # noqa: E402

from tandem.engine.events import DoneEvent  # noqa: E402
from tandem.engine.llama import ContextParams  # noqa: E402
from tandem.engine.speculative import GenParams  # noqa: E402
from tandem.session import DraftParams, PairSession, SessionOptions  # noqa: E402

pytestmark = pytest.mark.slow

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Explain what a hash map is in two sentences.",
    "Write a JSON object describing a book with title, author and year.",
    "Translate 'good morning, how are you?' into French and German.",
    "Summarize: The mitochondria is the powerhouse of the cell. It produces ATP through "
    "oxidative phosphorylation, and has its own DNA inherited from the mother.",
]


@pytest.fixture(scope="module")
def session(real_pair):
    target, draft = real_pair
    opts = SessionOptions(strategy="draft", target_ctx=ContextParams(n_ctx=1024))
    with PairSession(target, draft, opts) as s:
        yield s


def _generate(session, tokens, strategy, draft=None, n=40):
    for ev in session.generate(tokens, GenParams(max_tokens=n, ignore_eos=True), strategy, draft):
        if isinstance(ev, DoneEvent):
            return ev


@pytest.mark.parametrize("prompt", PROMPTS)
def test_real_pair_speculative_equals_plain(session, prompt):
    tokens = session.prompt_tokens([{"role": "user", "content": prompt}])
    plain = _generate(session, tokens, "none")
    spec = _generate(session, tokens, "draft", DraftParams(n_max=6, n_min=0, p_min=0.0))
    assert spec.stats.drafted > 0 and spec.stats.accepted > 0
    assert_same_as_plain(session.target, tokens, plain.tokens, spec.tokens)


def test_real_pair_draft_equal_to_target_accepts_all(real_pair):
    _, draft = real_pair
    with PairSession(draft, draft, SessionOptions(target_ctx=ContextParams(n_ctx=512))) as s:
        tokens = s.prompt_tokens([{"role": "user", "content": PROMPTS[0]}])
        done = _generate(s, tokens, "draft", DraftParams(n_max=4, n_min=0, p_min=0.0), n=24)
    assert done.stats.drafted > 0
    # batched verification may flip a near-tie; on this prompt it does not
    assert done.stats.accepted == done.stats.drafted


@pytest.mark.parametrize("strategy", ["ngram", "hybrid", "auto"])
def test_real_pair_every_strategy_equals_plain(session, strategy):
    for prompt in (PROMPTS[0], PROMPTS[4]):
        tokens = session.prompt_tokens([{"role": "user", "content": prompt}])
        plain = _generate(session, tokens, "none")
        spec = _generate(session, tokens, strategy, DraftParams(n_max=6, n_min=0, p_min=0.5))
        assert spec.stats.strategy == strategy
        assert_same_as_plain(session.target, tokens, plain.tokens, spec.tokens)


def test_real_pair_verify_batches_up_to_the_exact_limit_match_single_decoding(session):
    """The premise of EXACT_BATCH: after a long context (past the 512-token point where f16 KV
    changes kernels), batches of 2..EXACT_BATCH rows give the logits of one-by-one decoding."""
    import numpy as np

    from tandem.engine.llama import EXACT_BATCH, Context

    text = " ".join(f"item {i} costs {i * 7 % 13} dollars;" for i in range(120))
    tokens = session.target.tokenize(text, add_special=True, parse_special=False)[:700]
    ctx = Context(session.target, ContextParams(n_ctx=1024, n_threads=2, type_k="q8_0",
                                                type_v="q8_0"))
    try:
        base = len(tokens) - EXACT_BATCH
        ctx.prefill(tokens[:base])
        single = [np.array(ctx.decode([t])[0]) for t in tokens[base:]]
        for k in range(2, EXACT_BATCH + 1):
            ctx.truncate(base)
            rows = np.array(ctx.decode(tokens[base:base + k], all_logits=True))
            for j in range(k):
                assert np.array_equal(rows[j], single[j]), f"batch {k}, row {j}"
    finally:
        ctx.close()
