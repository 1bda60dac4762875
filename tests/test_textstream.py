"""TextStream: token bytes to released text, with UTF-8 split across tokens and stop strings
held back until decided."""
from __future__ import annotations

import pytest
from engine_helpers import draft_model, run
from scripted import ScriptedContext, ScriptedModel, one_hot
from tandem.engine.drafting.drafters import NoDrafter
from tandem.engine.loop.textstream import TextStream


def feed_all(stream: TextStream, chunks) -> list[str]:
    return [stream.feed(c) for c in chunks] + [stream.flush()]


def test_multibyte_characters_split_across_tokens_come_out_whole():
    text = "héllo ✓ wörld 🙂"
    chunks = [bytes([b]) for b in text.encode()]  # one byte a token
    s = TextStream()
    out = feed_all(s, chunks)
    assert "".join(out) == text == s.text
    assert all("\ufffd" not in piece for piece in out)
    # a piece is released only once its character is complete
    assert out[:2] == ["h", ""] and out[2] == "é"


def test_invalid_bytes_become_replacement_characters_not_errors():
    s = TextStream()
    assert "".join(feed_all(s, [b"a", b"\xff", b"b", b"\xe2\x9c"])) == "a\ufffdb\ufffd"


def test_stop_string_across_tokens_is_held_back_then_cut():
    s = TextStream(stop=("END",))
    out = feed_all(s, [b"abc E", b"N", b"D tail"])
    assert out == ["abc ", "", "", ""] and s.stopped and s.text == "abc "


def test_held_back_prefix_is_released_when_it_turns_out_not_to_be_a_stop():
    s = TextStream(stop=("END",))
    assert s.feed(b"xE") == "x"
    assert s.feed(b"N") == ""
    assert s.feed(b"o") == "ENo"
    assert s.flush() == "" and s.text == "xENo" and not s.stopped


def test_stop_string_with_a_multibyte_character_split_across_tokens():
    stop = "ö!"
    data = "abö!cd".encode()
    s = TextStream(stop=(stop,))
    out = feed_all(s, [bytes([b]) for b in data])
    assert "".join(out) == "ab" and s.stopped


def test_earliest_of_several_stops_wins_and_flush_releases_a_pending_prefix():
    s = TextStream(stop=("zz", "b"))
    assert "".join(feed_all(s, [b"aaz", b"b", b"zz"])) == "aaz"
    t = TextStream(stop=("xyz",))
    assert t.feed(b"abx") == "ab"
    assert t.flush() == "x"  # the end of the text: a stop prefix is just text


def test_empty_stop_strings_are_ignored():
    s = TextStream(stop=("",))
    assert "".join(feed_all(s, [b"abc"])) == "abc" and not s.stopped


# --------------------------------------------- through generate(): greedy identity with UTF-8

TEXT = "héllo ✓ wörld 🙂 ok"
SEQ = list(TEXT.encode())  # token id = byte value


def _fn(prefix):
    # greedy continuation spells TEXT one byte a token (the prompt is token 256)
    pos = len(prefix) - 1
    return one_hot(SEQ[pos] if pos < len(SEQ) else ord("."), 257)


@pytest.mark.parametrize("stop", [(), ("✓ w",), ("🙂",)])
def test_speculative_text_equals_plain_with_multibyte_tokens_and_stops(stop):
    model = ScriptedModel(257, pieces=[bytes([b]) for b in range(256)] + [b""])
    outs = []
    for drafter in (NoDrafter(), draft_model(ScriptedContext(model, _fn), n_max=5)):
        pieces = []
        from tandem.engine.loop.events import TokenEvent
        from tandem.engine.loop.speculative import GenParams, generate

        done = None
        for ev in generate(ScriptedContext(model, _fn), [256], drafter,
                           GenParams(max_tokens=len(SEQ), stop=stop, ignore_eos=True)):
            if isinstance(ev, TokenEvent):
                pieces.append(ev.text)
            done = ev
        assert "".join(pieces) == done.text
        outs.append(done)
    plain, spec = outs
    assert spec.stats.drafted > 0
    assert spec.text == plain.text and spec.tokens == plain.tokens
    want = TEXT if not stop else TEXT[:TEXT.index(stop[0])]
    assert plain.text == want
    done, _ = run(ScriptedContext(model, _fn), [256], NoDrafter(), max_tokens=len(SEQ))
    assert done.text == TEXT
