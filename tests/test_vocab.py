"""Draft/target vocabulary compatibility, mirroring llama.cpp's speculative-decoding rules."""
from __future__ import annotations

from dataclasses import replace

import pytest
from tandem.errors import GGUFFormatError, VocabMismatchError
from tandem.models.gguf_meta import GGUFHeader, read_gguf_header
from tandem.models.vocab import (
    TOKEN_NULL,
    VOCAB_BPE,
    VOCAB_NONE,
    VOCAB_SPM,
    VOCAB_UGM,
    VOCAB_WPM,
    VocabInfo,
    check_compatible,
    compatibility_problems,
)


def vocab(n: int = 300, **changes) -> VocabInfo:
    base = VocabInfo(
        tokenizer_model="llama",
        vocab_type=VOCAB_SPM,
        n_tokens=n,
        tokens=tuple(f"t{i}" for i in range(n)),
        bos_id=1,
        eos_id=2,
        add_bos=True,
        add_eos=False,
    )
    return replace(base, **changes)


def with_token(v: VocabInfo, i: int, text: str) -> VocabInfo:
    tokens = list(v.tokens)
    tokens[i] = text
    return replace(v, tokens=tuple(tokens))


def from_metadata(model=None, tokens=None, extra=None, **tokenizer_keys) -> VocabInfo:
    """VocabInfo from metadata alone; tokenizer_keys are tokenizer.ggml.* keys without prefix."""
    md = {"general.architecture": "llama", **(extra or {})}
    if model is not None:
        md["tokenizer.ggml.model"] = model
    if tokens is not None:
        md["tokenizer.ggml.tokens"] = tokens
    md.update({f"tokenizer.ggml.{k}": v for k, v in tokenizer_keys.items()})
    return VocabInfo.from_header(GGUFHeader(version=3, metadata=md, tensors=[], header_bytes=0))


# --- tiny models --------------------------------------------------------------------------


def test_target_and_drafts_are_compatible(tiny_models):
    target = VocabInfo.from_header(read_gguf_header(tiny_models["target"]))
    for name in ("draft", "draft_weak"):
        draft = VocabInfo.from_header(read_gguf_header(tiny_models[name]))
        assert compatibility_problems(target, draft) == []
        check_compatible(target, draft, "target.gguf", f"{name}.gguf")


def test_mismatch_is_incompatible(tiny_models):
    target = VocabInfo.from_header(read_gguf_header(tiny_models["target"]))
    other = VocabInfo.from_header(read_gguf_header(tiny_models["mismatch"]))
    problems = compatibility_problems(target, other)
    assert len(problems) == 2
    assert "sizes differ by 240" in problems[0]
    assert "token 5 differs" in problems[1]
    with pytest.raises(VocabMismatchError) as exc:
        check_compatible(target, other, "target.gguf", "mismatch.gguf")
    assert "mismatch.gguf" in exc.value.message and "target.gguf" in exc.value.message
    assert "sizes differ" in exc.value.message
    assert "tandem pairs suggest" in exc.value.hint
    assert exc.value.exit_code == 3


# --- each rule ----------------------------------------------------------------------------


def test_identical_is_compatible():
    assert compatibility_problems(vocab(), vocab()) == []


def test_vocab_type():
    problems = compatibility_problems(vocab(), vocab(vocab_type=VOCAB_BPE, tokenizer_model="gpt2"))
    assert len(problems) == 1 and "types differ" in problems[0]


@pytest.mark.parametrize("extra, ok", [(0, True), (1, True), (128, True), (129, False)])
def test_size_difference(extra, ok):
    small, large = vocab(1000), vocab(1000 + extra)
    for a, b in ((small, large), (large, small)):
        problems = compatibility_problems(a, b)
        assert (problems == []) is ok, problems
        if not ok:
            assert "differ by 129" in problems[0]


def test_bos():
    assert "BOS token ids differ" in compatibility_problems(vocab(), vocab(bos_id=7))[0]
    # the id only matters when BOS is added
    assert compatibility_problems(vocab(add_bos=False), vocab(add_bos=False, bos_id=7)) == []
    problems = compatibility_problems(vocab(), vocab(add_bos=False))
    assert problems == ["the target adds the BOS token to prompts but the draft does not"]


def test_eos():
    assert compatibility_problems(vocab(), vocab(eos_id=9)) == []  # add_eos is off
    problems = compatibility_problems(vocab(add_eos=True), vocab(add_eos=True, eos_id=9))
    assert problems == ["EOS token ids differ (target 2, draft 9)"]
    problems = compatibility_problems(vocab(), vocab(add_eos=True))
    assert problems == ["the draft adds the EOS token to prompts but the target does not"]


def test_token_texts_checked_from_id_5():
    assert compatibility_problems(vocab(), with_token(vocab(), 4, "other")) == []
    assert compatibility_problems(vocab(), with_token(vocab(), 0, "other")) == []
    problems = compatibility_problems(vocab(), with_token(vocab(), 5, "other"))
    assert len(problems) == 1 and problems[0].startswith("token 5 differs")
    assert "1 of 295" in problems[0]


def test_token_texts_only_up_to_the_smaller_vocab():
    larger = replace(vocab(350), tokens=vocab().tokens + tuple("x" * 50))
    assert compatibility_problems(vocab(), larger) == []


def test_token_texts_compare_like_strcmp():
    a = with_token(vocab(), 10, "ab\x00c")
    b = with_token(vocab(), 10, "ab\x00d")
    assert compatibility_problems(a, b) == []
    assert compatibility_problems(a, with_token(vocab(), 10, "abd")) != []


def test_all_problems_are_reported():
    other = with_token(vocab(500, bos_id=3, vocab_type=VOCAB_BPE), 6, "x")
    assert len(compatibility_problems(vocab(), other)) == 4


def test_large_vocab_comparison():
    n = 152_064
    a = vocab(n)
    b = replace(a, tokens=tuple(list(a.tokens)))  # equal content, different objects
    assert compatibility_problems(a, b) == []
    assert compatibility_problems(a, with_token(b, n - 1, "z"))


# --- defaults mirrored from llama_vocab::impl::load ---------------------------------------

TOKENS = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]


def test_spm_defaults():
    v = from_metadata("llama", TOKENS)
    assert (v.vocab_type, v.bos_id, v.eos_id) == (VOCAB_SPM, 1, 2)
    assert (v.add_bos, v.add_eos) == (True, False)
    assert v.n_tokens == 259 and v.tokens == tuple(TOKENS)


@pytest.mark.parametrize(
    "pre, add_bos, bos",
    [(None, False, 11), ("gpt-2", False, 11), ("llama-bpe", True, 11), ("qwen2", False, 11),
     ("glm4", False, TOKEN_NULL), ("gemma4", True, 11)],
)
def test_bpe_defaults(pre, add_bos, bos):
    v = from_metadata("gpt2", TOKENS, **({"pre": pre} if pre else {}))
    assert (v.vocab_type, v.add_bos, v.add_eos, v.bos_id, v.eos_id) == (
        VOCAB_BPE, add_bos, False, bos, 11
    )


def test_explicit_keys_override_defaults():
    v = from_metadata(
        "gpt2", TOKENS, pre="gemma4", bos_token_id=3, eos_token_id=100000,
        add_bos_token=False, add_eos_token=True,
    )
    # gemma4 forces add_bos on; an out-of-range EOS id keeps the default
    assert (v.bos_id, v.eos_id, v.add_bos, v.add_eos) == (3, 11, True, True)


def test_other_tokenizers():
    t5 = from_metadata("t5", TOKENS)
    assert (t5.vocab_type, t5.bos_id, t5.eos_id, t5.add_bos, t5.add_eos) == (
        VOCAB_UGM, TOKEN_NULL, 1, False, True
    )
    bert = from_metadata("bert", TOKENS)
    # default BOS 101 is inside this 259-token vocab; EOS has no default
    assert (bert.vocab_type, bert.bos_id, bert.eos_id, bert.add_bos) == (
        VOCAB_WPM, 101, TOKEN_NULL, True
    )
    assert from_metadata("bert", TOKENS[:50]).bos_id == TOKEN_NULL  # default outside the vocab
    none = from_metadata("no_vocab", extra={"llama.vocab_size": 10})
    assert (none.vocab_type, none.n_tokens, none.add_bos) == (VOCAB_NONE, 10, False)
    assert compatibility_problems(none, none) == []


def test_empty_token_texts_are_renamed_like_llama_cpp():
    assert from_metadata("llama", ["a", "", "b"]).tokens == ("a", "[EMPTY_1]", "b")


def test_missing_or_unknown_tokenizer():
    with pytest.raises(GGUFFormatError, match="no tokenizer"):
        from_metadata()
    with pytest.raises(GGUFFormatError, match="unknown tokenizer"):
        from_metadata("sentencepiece", TOKENS)
    with pytest.raises(GGUFFormatError, match="tokens"):
        from_metadata("llama")


# --- cross-check against llama.cpp itself -------------------------------------------------

PRE = "tokenizer.ggml.pre"
CROSS_CHECK = {
    "spm-explicit": ("llama", TOKENS, {
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.add_bos_token": True,
    }),
    "spm-defaults": ("llama", TOKENS, {}),
    "spm-bad-bos": ("llama", TOKENS, {
        "tokenizer.ggml.bos_token_id": 70000, "tokenizer.ggml.eos_token_id": 0,
    }),
    "spm-empty-token": ("llama", TOKENS[:5] + [""] + TOKENS[6:], {}),
    "gpt2-nopre": ("gpt2", TOKENS, {}),
    "gpt2-llama-bpe": ("gpt2", TOKENS, {PRE: "llama-bpe"}),
    "gpt2-glm4": ("gpt2", TOKENS, {PRE: "glm4"}),
    "gpt2-gemma4": ("gpt2", TOKENS, {PRE: "gemma4", "tokenizer.ggml.add_bos_token": False}),
    "gpt2-qwen2-flags": ("gpt2", TOKENS, {
        PRE: "qwen2", "tokenizer.ggml.add_eos_token": True, "tokenizer.ggml.eos_token_id": 3,
    }),
    "t5": ("t5", TOKENS, {}),
    "bert": ("bert", TOKENS, {}),
}


def _write_vocab_only(path, model, tokens, extra):
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(4096)
    w.add_embedding_length(64)
    w.add_block_count(2)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model(model)
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    if model == "gpt2":
        w.add_token_merges(["< 0"])
    for key, value in extra.items():
        vtype = (gguf.GGUFValueType.BOOL if isinstance(value, bool)
                 else gguf.GGUFValueType.UINT32 if isinstance(value, int)
                 else gguf.GGUFValueType.STRING)
        w.add_key_value(key, value, vtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _llama_cpp_vocab(path) -> dict:
    llama_cpp = pytest.importorskip("llama_cpp")
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    assert model, f"llama.cpp could not load {path}"
    try:
        v = llama_cpp.llama_model_get_vocab(model)
        n = llama_cpp.llama_vocab_n_tokens(v)
        return {
            "vocab_type": llama_cpp.llama_vocab_type(v),
            "n_tokens": n,
            "bos_id": llama_cpp.llama_vocab_bos(v),
            "eos_id": llama_cpp.llama_vocab_eos(v),
            "add_bos": bool(llama_cpp.llama_vocab_get_add_bos(v)),
            "add_eos": bool(llama_cpp.llama_vocab_get_add_eos(v)),
            "tokens": tuple(
                llama_cpp.llama_vocab_get_text(v, i).decode("utf-8", "replace") for i in range(n)
            ),
        }
    finally:
        llama_cpp.llama_model_free(model)


@pytest.mark.parametrize("case", sorted(CROSS_CHECK))
def test_matches_llama_cpp(tmp_path, case):
    pytest.importorskip("gguf")
    pytest.importorskip("llama_cpp")
    path = tmp_path / f"{case}.gguf"
    _write_vocab_only(path, *CROSS_CHECK[case])
    mine = VocabInfo.from_header(read_gguf_header(path))
    theirs = _llama_cpp_vocab(path)
    assert {k: getattr(mine, k) for k in theirs} == theirs


def test_tiny_models_match_llama_cpp(tiny_models):
    pytest.importorskip("llama_cpp")
    for path in tiny_models.values():
        mine = VocabInfo.from_header(read_gguf_header(path))
        theirs = _llama_cpp_vocab(path)
        assert {k: getattr(mine, k) for k in theirs} == theirs
