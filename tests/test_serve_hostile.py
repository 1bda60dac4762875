"""A replayable hostile-input suite against a live `tandem serve` on 127.0.0.1 (tiny models):
malformed fields, unencodable text, oversized prompts, HTTP framing errors, slow and idle
connections, connection floods, bearer keys. Each case checks its status and OpenAI's error
shape; after each class, /health answers and a normal request is answered within a bound
that catches blocking (not a speed threshold); the log never holds a traceback."""
from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from serve_helpers import Server, tiny_args

pytest.importorskip("openai")

TIMEOUT = 2  # the server's --timeout for these tests: headers, then body, each
NORMAL = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    srv = Server([*tiny_args(tiny_models), "--strategy", "none", "--timeout", str(TIMEOUT),
                  "--max-tokens", "8"], tmp_path_factory.mktemp("hostile-home"))
    yield srv
    srv.stop()
    log = "".join(srv.log)
    assert "Traceback" not in log, log


def _error_shape(reply) -> bool:
    err = reply.get("error") if isinstance(reply, dict) else None
    return isinstance(err, dict) and bool(err.get("message")) and \
        {"type", "param", "code"} <= set(err)


def _still_serving(srv: Server) -> None:
    assert srv.health()["status"] == "ok"
    # answered at all (a server held up by the case before would time the request out)
    status, reply, _ = srv.raw("POST", "/v1/chat/completions", json.dumps(NORMAL))
    assert status == 200, reply
    assert reply["choices"][0]["message"]["content"] is not None


def _check_cases(srv: Server, cases) -> None:
    failures = []
    for path, body, want, param in cases:
        raw = body if isinstance(body, (bytes, str)) else json.dumps(body)
        status, reply, _ = srv.raw("POST", path, raw)
        ok = status == want and _error_shape(reply) and len(json.dumps(reply)) < 2000
        if ok and param is not None:
            ok = reply["error"]["param"] == param
        if not ok:
            failures.append((str(body)[:200], status, str(reply)[:300]))
    assert failures == []


def _chat(**fields):
    return {"messages": [{"role": "user", "content": "x"}], **fields}


CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
SUR = '"a\\ud800b"'  # a lone surrogate, as JSON escapes carry it
FIELDS = [
    # roles that are not strings: 400s naming the field (a TypeError once)
    (CHAT, {"messages": [{"role": ["user"], "content": "x"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": [{"role": {"a": 1}, "content": "x"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": [{"role": 5, "content": "x"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": [{"role": True, "content": "x"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": [{"role": None, "content": "x"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": [{"role": "x" * 100000, "content": "x"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}, {"role": [], "content": "y"}]},
     400, "messages[1].role"),
    # unencodable text in every text field of every route: one check, the path named
    (CHAT, '{"messages": [{"role": "user", "content": ' + SUR + '}]}', 400,
     "messages[0].content"),
    (CHAT, '{"messages": [{"role": "user", "content": [{"type": "text", "text": ' + SUR
     + '}]}]}', 400, "messages[0].content[0].text"),
    (CHAT, '{"messages": [{"role": ' + SUR + ', "content": "x"}]}', 400, "messages[0].role"),
    (CHAT, '{"messages": [{"role": "user", "content": "x"}], "stop": [' + SUR + ']}', 400,
     "stop[0]"),
    (CHAT, '{"messages": [{"role": "user", "content": "x"}], "model": ' + SUR + '}', 400,
     "model"),
    (CHAT, '{"messages": [{"role": "user", "content": "x"}], "user": ' + SUR + '}', 400, "user"),
    (CHAT, '{"messages": [{"role": "user", "content": "x"}], "metadata": {"k": ' + SUR + '}}',
     400, "metadata.k"),
    (CHAT, '{"messages": [{"role": "user", "content": "x", "name": ' + SUR + '}]}', 400,
     "messages[0].name"),
    (CHAT, '{"messages": [{"role": "user", "content": "x"}], "\\udc00": 1}', 400, None),
    (TEXT, '{"prompt": ' + SUR + '}', 400, "prompt"),
    (TEXT, '{"prompt": ' + SUR + ', "stream": true}', 400, "prompt"),
    (TEXT, '{"prompt": [' + SUR + ']}', 400, "prompt[0]"),
    (TEXT, '{"prompt": "x", "stop": ' + SUR + '}', 400, "stop"),
    (TEXT, '{"prompt": "x", "suffix": ' + SUR + '}', 400, "suffix"),
    # other malformed fields
    (CHAT, {"messages": [{"role": "user", "content": {"text": "x"}}]}, 400,
     "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, 400,
     "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": [1, 2]}]}, 400, "messages[0].content"),
    (CHAT, _chat(n=[1] * 10000), 400, "n"),
    (CHAT, _chat(response_format="x" * 100000), 400, "response_format"),
    (CHAT, _chat(max_tokens=1e300), 400, "max_tokens"),
    (CHAT, _chat(seed=2 ** 70), 400, "seed"),
    (CHAT, _chat(temperature=True), 400, "temperature"),
    (CHAT, _chat(stream_options=[]), 400, "stream_options"),
    (CHAT, _chat(stop=[["x"]]), 400, "stop"),
    (TEXT, {"prompt": None}, 400, "prompt"),
    (TEXT, {"prompt": {"a": 1}}, 400, "prompt"),
    (TEXT, {"prompt": [1, 2, 3]}, 400, "prompt"),
]


def test_malformed_fields_are_400s_naming_them(server):
    assert len(FIELDS) >= 30
    _check_cases(server, FIELDS)
    status, reply, _ = server.raw("POST", CHAT, '{"messages": [{"role": "user", "content": '
                                  '"x"}], "top_p": NaN}')
    assert status == 400 and _error_shape(reply)
    _still_serving(server)


SIZES = [
    (CHAT, {"messages": [{"role": "user", "content": "word " * 900000}]}, 413, None),
    (CHAT, {"messages": [{"role": "user", "content": "fox " * 900000}]}, 400, None),
    (TEXT, {"prompt": "fox " * 900000}, 400, None),
    (CHAT, {"messages": [{"role": "user", "content": "a"}] * 20000}, 400, None),
    (CHAT, {"messages": [{"role": "user", "content": "\u4e2d" * 600000}]}, 400, None),
]


def test_oversized_prompts_are_refused_at_once_and_block_nobody(server):
    _check_cases(server, SIZES)
    # a normal request sent right behind a ~4 MB one is answered
    big = json.dumps({"messages": [{"role": "user", "content": "fox " * 1000000}]})
    results = {}

    def send_big():
        results["big"] = server.raw("POST", CHAT, big)[0]

    t = threading.Thread(target=send_big)
    t.start()
    time.sleep(0.05)
    _still_serving(server)
    t.join(120)
    assert results.get("big") in (400, 413)


def _chain(n: int) -> str:
    return "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(n)) + \
        f'r{n} ::= "z"\n'


def _ref_chain(n: int) -> dict:
    defs = {f"a{i}": {"$ref": f"#/$defs/a{i + 1}"} for i in range(n)}
    defs[f"a{n}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/a0"}


def _deep(n: int) -> str:
    return '{"type": "object", "properties": {"k": ' * n + '{"type": "integer"}' + "}}" * n


def _tool(params: dict, name: str = "f") -> dict:
    return {"type": "function", "function": {"name": name, "parameters": params}}


def _with_call(arguments: str) -> list[dict]:
    return [{"role": "user", "content": "x"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "f", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"}]


DEEP = "[" * 10000 + "]" * 10000
RF = "response_format.json_schema.schema"
# requests that once killed the server (a native stack overflow in the grammar compiler),
# answered a 500 (RecursionError), echoed megabytes of grammar in a 400, or were let through
STRUCTURED = [
    (CHAT, _chat(grammar=_chain(5000)), "grammar"),
    ("/completion", {"prompt": "x", "n_predict": 4, "grammar": _chain(5000)}, "grammar"),
    (CHAT, _chat(json_schema=_ref_chain(3000)), "json_schema"),
    (CHAT, _chat(tools=[_tool({"type": "object", "properties": {"a": _ref_chain(3000)}})],
                 tool_choice="required"), "tools[0].function.parameters"),
    (CHAT, _chat(json_schema=_deep(10000)), "json_schema"),
    (CHAT, _chat(json_schema=DEEP), "json_schema"),
    (CHAT, _chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": _deep(10000)}}), RF),
    (CHAT, {"messages": _with_call(DEEP)}, "messages[1].tool_calls[0].function.arguments"),
    ("/apply-template", {"messages": _with_call(DEEP)},
     "messages[1].tool_calls[0].function.arguments"),
    (CHAT, _chat(json_schema={"enum": [{"k": i} for i in range(5000)]}), "json_schema"),
    (CHAT, _chat(grammar='root ::= "a"{1000000}'), "grammar"),
    (CHAT, _chat(grammar="root ::= " + " | ".join(f'"a{i}"' for i in range(50000))),
     "grammar"),
    (CHAT, _chat(tools=[_tool({"type": "object", "properties": {}}, "f\n")],
                 tool_choice="required"), "tools[0].function.name"),
    # compiles, then the parser gives up at the first token (Earley rows past 2,000 items)
    (CHAT, _chat(json_schema={"type": "object", "properties": {
        f"p{i}": {"type": "integer"} for i in range(3000)}}), "json_schema"),
]


def test_structured_inputs_at_their_limits_are_short_400s(server):
    failures = []
    for path, body, param in STRUCTURED:
        for stream in (False, True):
            sent = {**body, "stream": True} if stream else body
            status, reply, _ = server.raw("POST", path, json.dumps(sent))
            err = reply.get("error") if isinstance(reply, dict) else None
            if status != 400 or not _error_shape(reply) or err["param"] != param \
                    or len(err["message"]) >= 500 or "bug in tandem" in err["message"]:
                failures.append((path, param, stream, status, str(reply)[:300]))
        assert server.proc.poll() is None, f"the server died on {param}"
    assert failures == []
    _still_serving(server)
    status, reply, _ = server.raw("POST", "/v1/chat/completions", json.dumps(_chat(
        json_schema='{"type": "object"' + "}" * 2)))  # a schema's text that is not JSON
    assert status == 400 and reply["error"]["param"] == "json_schema"


HELD = 30  # s: a normal request's timeout behind a big one (held 70 s before), not a speed


def _answered_beside(srv: Server, path: str, body: dict) -> int:
    """Send `body` and, right behind it, a normal request that must be answered within
    HELD seconds (its socket times out otherwise): the big one's status."""
    results: dict = {}
    big = threading.Thread(target=lambda: results.update(
        big=srv.raw("POST", path, json.dumps(body))[0]))
    big.start()
    time.sleep(0.05)
    status, reply, _ = srv.raw("POST", CHAT, json.dumps(NORMAL), timeout=HELD)
    assert status == 200, reply
    big.join(300)
    return results["big"]


def test_a_megabyte_to_tokenize_holds_back_nobody(server):
    # one word of 1 MB: the tiny SPM vocabulary took 70 s on it, and every request waited
    word = "x" * 1000000
    cases = [(CHAT, {**NORMAL, "prediction": {"type": "content", "content": word}}, 200),
             ("/tokenize", {"content": word}, 400),
             ("/tokenize", {"content": ["a", word]}, 400)]
    for path, body, want in cases:
        assert _answered_beside(server, path, body) == want


FRAMING = [
    b"GARBAGE\r\n\r\n",
    b"GET\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1, 2\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nab\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n",
    b"GET /health HTTP/1.1\r\n\r\n",  # HTTP/1.1 without Host
    b"GET /health HTTP/1.1\r\nHost: x\r\nBad Name: y\r\n\r\n",
    b"GET /he alth HTTP/1.1\r\nHost: x\r\n\r\n",
]
# h11 accepts, and so does the server (docs/serve.md): a folded header line (joined to the
# one before, as RFC 9112 lets a server do) and an HTTP/1.x-shaped version such as 9.9


def _socket_exchange(srv: Server, data: bytes, wait: float = 10.0) -> bytes:
    """Send `data` on a fresh connection; everything the server sends until it closes."""
    s = socket.create_connection(("127.0.0.1", srv.port))
    s.settimeout(wait)
    out = b""
    try:
        if data:
            s.sendall(data)
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            out += chunk
    except socket.timeout:
        out += b"<no close>"
    finally:
        s.close()
    return out


def _json_reply(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    assert b"content-type: application/json" in head.lower(), raw[:300]
    return status, json.loads(body)


def test_framing_errors_get_the_json_error(server):
    failures = []
    for data in FRAMING:
        raw = _socket_exchange(server, data)
        try:
            status, reply = _json_reply(raw)
            if status != 400 or not _error_shape(reply):
                failures.append((data[:60], raw[:200]))
        except (AssertionError, ValueError, IndexError):
            failures.append((data[:60], raw[:200]))
    assert failures == []
    _still_serving(server)


def test_idle_and_slow_connections_are_closed(server):
    # nothing sent, part of the headers, part of the body: each closed after the timeout
    for data, code in [(b"", 408), (b"GET /health HTTP/1.1\r\nHo", 408),
                       (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                        b"application/json\r\nContent-Length: 100\r\n\r\n{\"pro", 408)]:
        raw = _socket_exchange(server, data, wait=TIMEOUT * 10)
        assert not raw.endswith(b"<no close>"), raw
        status, reply = _json_reply(raw)
        assert status == code and reply["error"]["code"] == "request_timeout"
        assert f"within {TIMEOUT} s" in reply["error"]["message"]  # the documented timeout
    # a slowloris: one header byte at a time, never finishing: closed all the same
    s = socket.create_connection(("127.0.0.1", server.port))
    s.settimeout(TIMEOUT * 10)
    closed = False
    try:
        for ch in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100:
            s.sendall(bytes([ch]))
            time.sleep(0.1)
    except OSError:
        closed = True
    if not closed:
        closed = s.recv(65536).startswith(b"HTTP/1.1 408")
    s.close()
    assert closed
    _still_serving(server)


def test_a_connection_flood_is_refused_beyond_the_bound(server):
    from tandem.serve.connection import MAX_CONNECTIONS

    socks = [socket.create_connection(("127.0.0.1", server.port))
             for _ in range(MAX_CONNECTIONS + 6)]
    try:
        refused = 0
        for s in socks[-6:]:
            s.settimeout(10)
            data = s.recv(65536)
            if data.startswith(b"HTTP/1.1 503"):
                status, reply = _json_reply(data)
                refused += reply["error"]["code"] == "too_many_connections"
        assert refused == 6
    finally:
        for s in socks:
            s.close()
    time.sleep(0.5)
    _still_serving(server)


ROUTES = [
    ("GET", "/" + "a" * 10000, 404),
    ("GET", "/v1/" + "b" * 5000, 404),
    ("PUT", "/v1/chat/completions", 405),
    ("PATCH", "/v1/completions", 405),
    ("POST", "/health", 405),
    ("POST", "/v1/models", 405),
]


def test_routes_answer_short_json_errors(server):
    for method, path, want in ROUTES:
        status, reply, _ = server.raw(method, path, None)
        assert status == want and _error_shape(reply)
        assert len(reply["error"]["message"]) < 200
    _still_serving(server)


def test_bearer_keys_are_compared_exactly(tiny_models, tmp_path):
    srv = Server([*tiny_args(tiny_models), "--strategy", "none", "--api-key", "s3cret"],
                 tmp_path / "home")
    try:
        cases = [None, "s3cret", "Bearer", "Bearer ", "Bearer s3cre", "Bearer s3cret2",
                 "Bearer  s3cret", "Basic s3cret", "Bearer S3CRET", "Bearer s3cret x"]
        for header in cases:
            headers = {"Authorization": header} if header is not None else {}
            status, reply, hdrs = srv.raw("GET", "/v1/models", None, headers)
            assert status == 401 and _error_shape(reply), (header, status)
            assert {k.lower(): v for k, v in hdrs.items()}["www-authenticate"].startswith(
                "Bearer")
        status, _, _ = srv.raw("GET", "/v1/models", None, {"Authorization": "Bearer s3cret"})
        assert status == 200
        status, _, _ = srv.raw("GET", "/v1/models", None, {"Authorization": "bearer s3cret"})
        assert status == 200  # the scheme is case-insensitive (RFC 9110), the key is not
    finally:
        srv.stop()
    assert "Traceback" not in "".join(srv.log)


def test_the_suite_is_large_enough():
    n = len(FIELDS) + len(SIZES) + len(FRAMING) + 4 + 6 + len(ROUTES) + 10 + len(STRUCTURED)
    assert n >= 60
