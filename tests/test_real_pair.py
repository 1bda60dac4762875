"""The real default pair: speculative greedy output equals plain greedy output."""
from __future__ import annotations

import pytest

pytest.importorskip("llama_cpp")

from tandem.engine.backend.llama import ContextParams  # noqa: E402
from tandem.engine.drafting.drafters import DraftParams  # noqa: E402
from tandem.engine.loop.events import DoneEvent  # noqa: E402
from tandem.engine.loop.speculative import GenParams  # noqa: E402
from tandem.engine.pair import PairSession, SessionOptions  # noqa: E402

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
    """Exact mode's engine settings (what `--exact` gives): these tests check identity."""
    from tandem.engine.backend.llama import exact_context

    target, draft = real_pair
    opts = SessionOptions(strategy="draft", target_ctx=exact_context(ContextParams(n_ctx=1024)),
                          repack=False)
    with PairSession(target, draft, opts) as s:
        yield s


@pytest.fixture(scope="module")
def shipped(real_pair, tmp_path_factory):
    """The session `tandem run --exact` builds on this machine: profile, settings chain and
    all (CPU profile: auto, q8_0 KV, flash attention, unrepacked target, drafts <= 6)."""
    from tandem.commands.compose import resolve, session_options

    home = tmp_path_factory.mktemp("home")
    resolved = resolve({"mode": "exact", "n_ctx": 2048}, env={}, home=home)
    opts = session_options(resolved.settings, backend=resolved.backend, home=home)
    assert opts.target_ctx.exact and not opts.repack and opts.target_ctx.type_k == "q8_0"
    with PairSession(*real_pair, opts) as s:
        yield s


LONG = ("Here is a module. Explain what each function does, then rewrite it with type "
        "hints.\n\n```python\n" + "\n".join(
            f"def f{i}(x, y):\n    total = x * {i} + y\n    if total > {i * 3}:\n"
            f"        return total - {i}\n    return total + {i}\n" for i in range(30)) + "```")


@pytest.mark.parametrize("strategy", ["draft", "auto"])
def test_shipped_exact_configuration_equals_plain_past_512_tokens(shipped, strategy):
    tokens = shipped.prompt_tokens([{"role": "user", "content": LONG}])
    assert len(tokens) > 600
    plain = _generate(shipped, tokens, "none", n=48)
    spec = _generate(shipped, tokens, strategy, n=48)
    if strategy == "draft":
        assert spec.stats.drafted > 0
    assert spec.tokens == plain.tokens and spec.text == plain.text


def test_shipped_exact_configuration_at_the_context_end_and_with_a_stop(shipped):
    from dataclasses import replace

    tokens = shipped.prompt_tokens([{"role": "user", "content": PROMPTS[0]}])
    short = replace(shipped.options.target_ctx, n_ctx=len(tokens) + 24)
    shipped.configure(short, short)
    n_ctx = shipped.target_ctx.n_ctx  # llama.cpp rounds the size up (to 256)
    try:
        plain = _generate(shipped, tokens, "none", n=400)
        spec = _generate(shipped, tokens, "draft", DraftParams(n_max=6, p_min=0.0), n=400)
    finally:
        shipped.configure(shipped.options.target_ctx, shipped.options.target_ctx)
    assert plain.reason == spec.reason == "context"
    assert spec.tokens == plain.tokens and len(tokens) + len(plain.tokens) == n_ctx
    # a stop string that spans a token boundary, somewhere inside the plain text
    full = _generate(shipped, tokens, "none", n=40)
    pieces = [shipped.target.piece(t).decode("utf-8", "replace") for t in full.tokens]
    i = next(i for i in range(5, len(pieces) - 1) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 1)
    stop = pieces[i][-2:] + pieces[i + 1][:1]
    outs = []
    for strategy in ("none", "draft"):
        for ev in shipped.generate(tokens, GenParams(max_tokens=40, stop=(stop,)), strategy,
                                   DraftParams(n_max=6, p_min=0.0)):
            if isinstance(ev, DoneEvent):
                outs.append(ev)
    assert outs[0].reason == outs[1].reason == "stop"
    assert outs[0].text == outs[1].text == full.text[:full.text.index(stop)]


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
    assert spec.tokens == plain.tokens  # exact mode: identity, not "up to a near tie"


def test_real_pair_draft_equal_to_target_accepts_all(real_pair):
    _, draft = real_pair
    from tandem.engine.backend.llama import exact_context

    opts = SessionOptions(target_ctx=exact_context(ContextParams(n_ctx=512)), repack=False)
    with PairSession(draft, draft, opts) as s:
        tokens = s.prompt_tokens([{"role": "user", "content": PROMPTS[0]}])
        done = _generate(s, tokens, "draft", DraftParams(n_max=4, n_min=0, p_min=0.0), n=24)
    assert done.stats.drafted > 0
    assert done.stats.accepted == done.stats.drafted  # exact mode: no near-tie flips


@pytest.mark.parametrize("strategy", ["ngram", "hybrid", "auto"])
def test_real_pair_every_strategy_equals_plain(session, strategy):
    for prompt in (PROMPTS[0], PROMPTS[4]):
        tokens = session.prompt_tokens([{"role": "user", "content": prompt}])
        plain = _generate(session, tokens, "none")
        spec = _generate(session, tokens, strategy, DraftParams(n_max=6, n_min=0, p_min=0.5))
        assert spec.stats.strategy == strategy
        assert spec.tokens == plain.tokens


def test_real_pair_verify_batches_up_to_the_exact_limit_match_single_decoding(session):
    """The premise of EXACT_BATCH: after a long context (past the 512-token point where f16 KV
    changes kernels), batches of 2..EXACT_BATCH rows give the logits of one-by-one decoding."""
    import numpy as np
    from tandem.engine.backend.llama import EXACT_BATCH, Context, exact_context

    text = " ".join(f"item {i} costs {i * 7 % 13} dollars;" for i in range(120))
    full = session.target.tokenize(text, add_special=True, parse_special=False)
    # at more than one context length and thread count (finding 6 of the lossless issue)
    for n_tokens, threads in ((100, 2), (700, 2), (700, 1)):
        tokens = full[:n_tokens]
        ctx = Context(session.target, exact_context(ContextParams(n_ctx=1024, n_threads=threads)))
        try:
            base = len(tokens) - EXACT_BATCH
            ctx.prefill(tokens[:base])
            single = [np.array(ctx.decode([t])[0]) for t in tokens[base:]]
            for k in range(2, EXACT_BATCH + 1):
                ctx.truncate(base)
                rows = np.array(ctx.decode(tokens[base:base + k], all_logits=True))
                for j in range(k):
                    assert np.array_equal(rows[j], single[j]), \
                        f"{n_tokens} tokens, {threads} threads: batch {k}, row {j}"
        finally:
            ctx.close()
