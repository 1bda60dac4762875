"""The synthetic test models load in llama.cpp and behave as the other tests assume."""
from __future__ import annotations

import numpy as np
import pytest

llama_cpp = pytest.importorskip("llama_cpp")

PRINTABLE = [3 + b for b in range(0x20, 0x7F)] + [3 + 0x0A, 259]  # byte tokens, "▁"


def load(path, **kw):
    return llama_cpp.Llama(model_path=str(path), verbose=False, n_ctx=512, **kw)


def test_deterministic(tiny_models, tmp_path):
    from make_tiny_models import make_tiny_models

    again = make_tiny_models(tmp_path)
    for name, path in tiny_models.items():
        assert again[name].read_bytes() == path.read_bytes(), name


@pytest.mark.parametrize("name", ["target", "draft", "draft_weak", "mismatch", "fim"])
def test_loads_and_generates(tiny_models, name):
    llm = load(tiny_models[name])
    assert llm.n_ctx() == 512
    assert llm.detokenize(llm.tokenize(b"Hello, world!\n", add_bos=False)) == b"Hello, world!\n"
    out = llm.create_completion("Hello", max_tokens=24, temperature=0.0)
    text = out["choices"][0]["text"]
    assert len(text) >= 12 and len(set(text)) >= 6, text  # varied, not one repeated byte
    assert text.isprintable() or "\n" in text


def test_chat_template(tiny_models):
    llm = load(tiny_models["target"])
    out = llm.create_chat_completion(
        messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0.0
    )
    assert out["choices"][0]["message"]["content"]


def greedy_agreement(target, draft, n_seqs: int = 3, length: int = 96) -> float:
    """Share of positions where the draft's argmax equals the target's, on random contexts."""
    rng = np.random.default_rng(7)
    same = total = 0
    for _ in range(n_seqs):
        seq = [1] + [int(t) for t in rng.choice(PRINTABLE, length - 1)]
        picks = []
        for llm in (target, draft):
            llm.reset()
            llm.eval(seq)
            picks.append(np.argmax(llm.scores[: len(seq)], axis=-1))
        same += int((picks[0] == picks[1]).sum())
        total += len(seq)
    return same / total


def test_draft_agreement_rates(tiny_models):
    target = load(tiny_models["target"], logits_all=True)
    draft = greedy_agreement(target, load(tiny_models["draft"], logits_all=True))
    weak = greedy_agreement(target, load(tiny_models["draft_weak"], logits_all=True))
    assert 0.5 <= draft <= 0.9, draft
    assert 0.15 <= weak <= 0.5, weak
    assert weak < draft - 0.15


@pytest.mark.parametrize("name,hybrid,recurrent", [
    ("hybrid", True, False), ("hybrid_draft", True, False), ("recurrent", False, True),
    ("sliding", False, False)])
def test_recurrent_models_load_with_their_memory_type(tiny_models, name, hybrid, recurrent):
    llm = load(tiny_models[name], logits_all=True)
    assert llama_cpp.llama_model_is_hybrid(llm.model) is hybrid
    assert llama_cpp.llama_model_is_recurrent(llm.model) is recurrent
    seq = llm.tokenize(b"The quick brown fox jumps over the lazy dog.\n")
    llm.eval(seq)
    scores = np.array(llm.scores[: len(seq)])
    assert np.isfinite(scores).all()
    assert len(set(scores.argmax(-1))) >= len(seq) // 3  # context moves the choice
    out = llm.create_completion("Hello", max_tokens=24, temperature=0.0)["choices"][0]["text"]
    assert len(set(out)) >= 6, out


def test_hybrid_draft_agreement(tiny_models):
    target = load(tiny_models["hybrid"], logits_all=True)
    rate = greedy_agreement(target, load(tiny_models["hybrid_draft"], logits_all=True))
    assert 0.5 <= rate <= 0.95, rate
