"""Fill-in-the-middle without a model: the prompt's layout (llama-server's), the editors'
stopping rules, response_fields, Predicted Outputs' counts and the request checks."""
from __future__ import annotations

import pytest

from tandem.engine.backend.fim import NULL, Chunk, FimTokens, infill_prompt
from tandem.engine.loop.stats import prediction_usage
from tandem.serve.api_errors import ApiError
from tandem.serve.llama_api import Limiter, parse_completion, parse_infill, pick

QWEN = FimTokens(pre=1, suf=2, mid=3, rep=4, sep=5, pad=6)  # ids that read well below


def chars(text: str) -> list[int]:
    """A tokenizer of one token per character, ids 1000 + code point."""
    return [1000 + ord(c) for c in text]


def text(tokens) -> str:
    names = {1: "<PRE>", 2: "<SUF>", 3: "<MID>", 4: "<REP>", 5: "<SEP>", 9: "<BOS>"}
    return "".join(names.get(t) or chr(t - 1000) for t in tokens)


def test_layout_is_llama_servers():
    out = infill_prompt(chars, QWEN, None, "def f(x):\n    ", "\nprint(f(2))\n",
                        [Chunk("import os\n", "a.py"), Chunk("X = 1\n")], chars("ret"))
    assert text(out) == ("<REP>myproject\n<SEP>a.py\nimport os\n<SEP>tmp\nX = 1\n"
                         "<SEP>filename\n<PRE>def f(x):\n    ret<SUF>\nprint(f(2))\n<MID>")


def test_extra_chunks_go_before_the_bos():
    out = infill_prompt(chars, QWEN, 9, "a", "b", [Chunk("c", "f")])
    assert text(out) == "<REP>myproject\n<SEP>f\nc<SEP>filename\n<BOS><PRE>a<SUF>b<MID>"


def test_without_repo_and_file_tokens_chunks_are_separated_by_text():
    fim = FimTokens(pre=1, suf=2, mid=3)
    out = infill_prompt(chars, fim, None, "p", "s", [Chunk("one"), Chunk("two")])
    assert text(out) == ("\n\n--- snippet ---\n\none\n\n--- snippet ---\n\ntwo"
                         "<PRE>p<SUF>s<MID>")


def test_prefix_keeps_its_tail_suffix_its_head_extra_its_tail():
    prefix, suffix = "P" * 50 + "p" * 30, "s" * 10 + "S" * 50
    extra = [Chunk("E" * 100 + "e" * 20, "x")]
    # n_batch 40: prefix 30 tokens, suffix 10 - 2 - prompt(0) = 8
    out = text(infill_prompt(chars, QWEN, None, prefix, suffix, extra, n_ctx=64, n_batch=40))
    pre = out[out.index("<PRE>") + 5:out.index("<SUF>")]
    suf = out[out.index("<SUF>") + 5:out.index("<MID>")]
    assert pre == "p" * 30 and suf == "s" * 8
    # room 0, n_ctx 64: the last 24 extra tokens, 14 of the chunk's, <SEP> and the file name
    out = text(infill_prompt(chars, QWEN, None, prefix, suffix, extra, n_ctx=64, n_batch=40,
                             room=0))
    assert out[:out.index("<PRE>")] == "e" * 14 + "<SEP>filename\n"
    # the answer's room comes out of the extra chunks' share: 10 fewer
    shorter = text(infill_prompt(chars, QWEN, None, prefix, suffix, extra, n_ctx=64,
                                 n_batch=40, room=10))
    assert shorter[:shorter.index("<PRE>")] == "e" * 4 + "<SEP>filename\n"


def test_the_typed_prompt_takes_from_the_suffix_share():
    out = text(infill_prompt(chars, QWEN, None, "a", "s" * 20, prompt=chars("xyz"),
                             n_ctx=128, n_batch=40))
    assert out.endswith("<PRE>axyz<SUF>" + "s" * 5 + "<MID>")  # 40/4 - 2 - 3


def test_small_contexts_scale_the_budgets_down():
    out = infill_prompt(chars, QWEN, None, "p" * 5000, "s" * 5000, n_ctx=1024)
    assert len(out) < 1024  # 3/4 and 1/4 of 512, not of llama-server's 2048


def test_missing_tokens_are_named():
    assert FimTokens(pre=1, suf=NULL, mid=NULL).missing() == ["suffix", "middle"]
    assert QWEN.missing() == []


def test_limiter_n_indent_cuts_a_line_indented_less():
    lim = Limiter(n_indent=4)
    out = "".join(lim.feed(p) for p in ["    x = 1\n", "    y", " = 2\n", "  ", "z\n"])
    assert out == "    x = 1\n    y = 2\n  " and lim.stopped
    assert lim.text == out


def test_limiter_n_indent_first_line_and_empty_line():
    lim = Limiter(n_indent=4)
    assert lim.feed("return x\n") == "return x\n" and not lim.stopped  # the first line: free
    assert lim.feed("\n") == "" and lim.stopped  # an empty line ends it, as llama-server's


def test_limiter_holds_a_lines_indentation_until_decided():
    lim = Limiter(n_indent=2)
    assert lim.feed("a\n  ") == "a\n"
    assert lim.feed("  b") == "    b"
    assert lim.flush() == "" and not lim.stopped
    lim = Limiter(n_indent=8)
    lim.feed("a\n  ")
    assert lim.flush() == "  "  # the answer ended by itself: what was held is released


def test_limiter_t_max_predict_stops_at_a_newline_after_the_time(monkeypatch):
    import tandem.serve.llama_api as llama_api

    now = [100.0]
    monkeypatch.setattr(llama_api.time, "monotonic", lambda: now[0])
    lim = Limiter(t_max_predict_ms=500)
    lim.start()
    assert lim.feed("a\n") == "a\n" and not lim.stopped
    now[0] += 0.6
    assert lim.feed("bc") == "bc" and not lim.stopped  # no newline yet
    assert lim.feed("d\ne") == "d\ne" and lim.stopped
    assert lim.feed("more") == ""
    assert not Limiter().active and Limiter(n_indent=1).active


def test_response_fields_flatten_paths_to_the_top():
    obj = {"content": "x", "timings": {"prompt_n": 3, "predicted_ms": 1.5}, "truncated": False}
    assert pick(obj, ("content", "timings/prompt_n", "timings/nope", "missing")) == {
        "content": "x", "timings/prompt_n": 3}
    assert pick(obj, ()) is obj


def test_prediction_usage_counts_text_not_spelling():
    answer = [b"def", b" f", b"():", b"\n", b"    return", b" 1", b"\n"]
    assert prediction_usage(answer, answer) == (7, 0)
    respelt = [b"de", b"f f", b"():\n", b"    re", b"turn 1\n"]  # the same text
    assert prediction_usage(respelt, answer) == (7, 0)
    other = [b"def", b" f", b"():", b"\n", b"    return", b" 2", b"\n"]
    used, unused = prediction_usage(other, answer)
    assert used == 6 and unused == 1  # " 2" was not used, " 1" is the model's own
    assert prediction_usage([b"zzz"], [b"abc"]) == (0, 1)
    assert prediction_usage([], answer) == (0, 0)


@pytest.mark.parametrize("body, param", [
    ({"input_suffix": ""}, "input_prefix"),
    ({"input_prefix": ""}, "input_suffix"),
    ({"input_prefix": 1, "input_suffix": ""}, "input_prefix"),
    ({"input_prefix": "", "input_suffix": "", "input_extra": {"text": "x"}}, "input_extra"),
    ({"input_prefix": "", "input_suffix": "", "input_extra": [{"text": 3}]}, "input_extra[0]"),
    ({"input_prefix": "", "input_suffix": "", "input_extra": ["x"]}, "input_extra[0]"),
    ({"input_prefix": "", "input_suffix": "", "input_extra": [{"text": "x", "filename": 2}]},
     "input_extra[0].filename"),
    ({"input_prefix": "", "input_suffix": "", "input_extra": [{"text": ""}] * 300},
     "input_extra"),
    ({"input_prefix": "", "input_suffix": "", "n_predict": -2}, "n_predict"),
    ({"input_prefix": "", "input_suffix": "", "n_predict": "8"}, "n_predict"),
    ({"input_prefix": "", "input_suffix": "", "n_indent": -1}, "n_indent"),
    ({"input_prefix": "", "input_suffix": "", "t_max_predict_ms": 1.5}, "t_max_predict_ms"),
    ({"input_prefix": "", "input_suffix": "", "response_fields": "content"}, "response_fields"),
    ({"input_prefix": "", "input_suffix": "", "prompt": ["a"]}, "prompt"),
    ({"input_prefix": "", "input_suffix": "", "temperature": -1}, "temperature"),
    ({"input_prefix": "", "input_suffix": "", "stop": [1]}, "stop"),
])
def test_bad_infill_requests_name_the_field(body, param):
    with pytest.raises(ApiError) as err:
        parse_infill(body)
    assert err.value.status == 400 and err.value.param == param


def test_infill_defaults_and_ignored_fields():
    req = parse_infill({"input_prefix": "a", "input_suffix": "b", "n_predict": 0,
                        "samplers": ["top_k", "infill"], "cache_prompt": True, "id_slot": 0,
                        "t_max_prompt_ms": 500, "response_fields": ["content"]})
    assert req.max_tokens == 0 and req.native and req.response_fields == ("content",)
    assert parse_infill({"input_prefix": "a", "input_suffix": "b", "n_predict": -1}).max_tokens \
        is None


@pytest.mark.parametrize("prompt", [None, "", 5, [], [1, "a"], [-1], [10_000], [1.5]])
def test_bad_completion_prompts(prompt):
    body = {} if prompt is None else {"prompt": prompt}
    with pytest.raises(ApiError) as err:
        parse_completion(body, n_vocab=300)
    assert err.value.status == 400


def test_completion_prompt_forms():
    assert parse_completion({"prompt": "hi"}, 300).prompt == "hi"
    assert parse_completion({"prompt": [1, 2, 3]}, 300).prompt_ids == (1, 2, 3)
    assert parse_completion({"prompt": [[4, 5]]}, 300).prompt_ids == (4, 5)


def test_texts_cut_before_tokenizing_give_the_same_prompt():
    """serve/prompt.py cuts a FIM request's texts to what its prompt can keep before the
    tokenizer sees them (one SPM word of 1 MB took 70 s): the prompt is unchanged."""
    from tandem.serve.prompt import PromptBudget, clip_infill
    from tandem.serve.protocol import Infill

    fim = Infill(prefix="p" * 3000 + "def f(x):\n    ", suffix="\nprint(f(2))\n" + "s" * 4000,
                 extra=tuple(Chunk(f"chunk {i}\n" * 20, f"f{i}.py") for i in range(60)),
                 prompt="re" * 5)
    cut = clip_infill(fim, PromptBudget(n_ctx=256, max_token_bytes=1))
    assert len(cut.prefix) < len(fim.prefix) and len(cut.extra) < len(fim.extra)
    for n_ctx in (256, 200):
        def prompt(f, n_ctx=n_ctx):
            return infill_prompt(chars, QWEN, 9, f.prefix, f.suffix, f.extra,
                                 chars(f.prompt), n_ctx)
        assert prompt(cut) == prompt(fim)
