"""serve/responses.py's server-sent events: the bytes of a chunk are its compact JSON with
non-ASCII text as is (what json.dumps gave before sse() kept one encoder), whatever the text."""
from __future__ import annotations

import json
import threading

import pytest

from tandem.serve import protocol, responses

TEXTS = ["", " hello", "naïve ünïcödé 漢字 🙂", 'quote " backslash \\ tab \t newline \n',
         "\x00\x1f control", "\u2028 line separator", "\ud800 lone surrogate"]


def _reference(obj) -> bytes:
    return (b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode(
        "utf-8", "surrogatepass") + b"\n\n")


@pytest.fixture
def chunk():
    req = protocol.parse_chat({"messages": [{"role": "user", "content": "hi"}], "stream": True,
                               "stream_options": {"include_usage": True}})
    return lambda **kw: responses.chunk(req, "chatcmpl-x", 1733450000, "model.gguf", **kw)


@pytest.mark.parametrize("text", TEXTS)
def test_a_text_chunk_is_its_compact_json(chunk, text):
    for piece in (text, responses.Piece(text, True), responses.Piece(text, False)):
        obj = chunk(text=piece)
        if "\ud800" in text:  # not UTF-8: refused as before, never sent half-written
            with pytest.raises(UnicodeEncodeError):
                responses.sse(obj)
            continue
        data = responses.sse(obj)
        assert data == _reference(obj)
        assert data.startswith(b"data: {") and data.endswith(b"}\n\n")
        back = json.loads(data[len(b"data: "):])
        assert back["choices"][0]["delta"]["content"] == text
        assert back.get("tandem") == ({"from_draft": 1} if getattr(piece, "from_draft", False)
                                      else None)


def test_role_finish_and_error_events(chunk):
    for obj in (chunk(role=True, text=""), chunk(reason="length"), chunk(reason="tool_calls"),
                {"error": {"message": "the server is stopping", "type": "server_error",
                           "param": None, "code": "stopping"}}):
        assert responses.sse(obj) == _reference(obj)


def test_threads_encoding_at_once_get_their_own_bytes(chunk):
    """The one encoder keeps no state between calls: several threads' events stay whole."""
    objs = [chunk(text=f"piece {i} " + "é" * i) for i in range(64)]
    want = [_reference(o) for o in objs]
    got: list[list[bytes]] = [[] for _ in range(4)]

    def run(k: int) -> None:
        for _ in range(50):
            got[k].append(b"".join(responses.sse(o) for o in objs))

    threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(g == [b"".join(want)] * 50 for g in got)
