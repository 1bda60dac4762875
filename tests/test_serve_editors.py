"""The editors' routes end to end: llama-server's /infill, /completion, /tokenize, /detokenize,
/apply-template and /props on `tandem serve`, with the tiny FIM pair; the requests of llama.vim,
llama.vscode, Continue, Tabby and twinny replayed as their sources send them
(tests/data/clients/, README there); Predicted Outputs; --cors; and malformed requests."""
from __future__ import annotations

import http.client
import json
import re
import threading
import time
import signal
from pathlib import Path

import pytest

pytest.importorskip("openai")

from serve_helpers import Server, tiny_args  # noqa: E402

CLIENTS = Path(__file__).parent / "data" / "clients"
# llama.vim reads it but never asks for it (README.md there): absent from llama-server too
NEVER_SENT = {"timings/truncated"}


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    srv = Server(["-m", str(tiny_models["fim"]), "-md", str(tiny_models["fim_draft"]), "-t", "1",
                  "--exact", "--strategy", "auto", "--max-tokens", "48", "-c", "1024", "--cors",
                  "http://localhost:3000"], tmp_path_factory.mktemp("editors-home"))
    yield srv
    srv.stop()
    assert srv.proc.returncode in (0, 130, -signal.SIGINT), "".join(srv.log)
    assert "Traceback" not in "".join(srv.log), "".join(srv.log)


def post(srv, path: str, body: dict, headers: dict | None = None) -> tuple[int, dict | str, dict]:
    status, parsed, hdrs = srv.raw("POST", path, json.dumps(body), headers)
    return status, parsed, hdrs


def raw_post(srv, path: str, body: dict, headers: dict | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=120)
    try:
        conn.request("POST", path, body=json.dumps(body),
                     headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def sse_objects(data: bytes) -> list:
    out = []
    for line in data.decode().splitlines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def resolve(obj: dict, path: str):
    """A client's read: a flat key ("timings/prompt_n" under response_fields) or a path."""
    if path in obj:
        return obj[path]
    for key in path.split("/"):
        assert isinstance(obj, dict) and key in obj, (path, obj)
        obj = obj[key]
    return obj


def client_request(name: str) -> dict:
    return json.loads((CLIENTS / f"{name}.json").read_text())


@pytest.mark.parametrize("name", ["llama_vim_infill", "llama_vscode_infill"])
def test_editor_plugins_infill_as_they_send_it(server, name):
    req = client_request(name)
    # llama.vim's key guard sends an empty bearer token; llama.vscode none
    status, data = raw_post(server, req["path"], req["body"], {"Authorization": "Bearer "})
    assert status == 200, data
    assert b"\n" not in data.strip()  # classic Vim reads stdout line by line
    assert re.search(rb'"content"\s*:"', data)  # llama.vim's own check of the body
    answer = json.loads(data)
    for path in req["reads"]:
        if path in NEVER_SENT or path.startswith("[]"):
            continue
        value = resolve(answer, path)
        if path.startswith("timings/"):
            assert isinstance(value, (int, float)) and not isinstance(value, bool), path
    assert isinstance(answer["content"], str)
    if req["body"].get("response_fields"):  # only what was asked, flattened
        assert set(answer) <= set(req["body"]["response_fields"])
    else:
        assert answer["generation_settings"]["n_ctx"] == resolve(answer, "generation_settings/n_ctx")
        assert answer["stop"] is True and answer["stop_type"] in ("eos", "limit", "word")


@pytest.mark.parametrize("name", ["llama_vim_warmup", "llama_vscode_warmup"])
def test_warmups_fill_the_cache_and_answer_nothing(server, name):
    req = client_request(name)
    status, answer, _ = post(server, req["path"], req["body"])
    assert status == 200, answer
    if req["body"].get("response_fields"):
        assert answer == {}  # llama.vim asks for [""]: nothing
        return
    assert answer["content"] == "" and answer["tokens_predicted"] == 0
    # the same prompt with an answer now reuses what the warm-up evaluated
    body = dict(req["body"], n_predict=4, t_max_predict_ms=0)
    status, again, _ = post(server, req["path"], body)
    assert status == 200, again
    assert again["timings"]["cache_n"] >= again["tokens_evaluated"] - 2, again["timings"]
    assert again["tokens_cached"] >= again["tokens_evaluated"]


def test_continue_completion_stream_parses(server):
    req = client_request("continue_completion")
    status, data = raw_post(server, req["path"], req["body"],
                            {"Authorization": "Bearer undefined"})
    assert status == 200, data
    objs = sse_objects(data)
    assert objs and "[DONE]" not in objs  # llama-server's native stream has no [DONE]
    assert all(isinstance(o["content"], str) for o in objs)
    assert objs[-1]["stop"] is True and all(o["stop"] is False for o in objs[:-1])
    # greedy, streamed and not: the same text
    greedy = dict(req["body"], temperature=0, n_predict=24)
    streamed = sse_objects(raw_post(server, req["path"], greedy)[1])
    status, whole, _ = post(server, req["path"], dict(greedy, stream=False))
    assert whole["content"] == "".join(o["content"] for o in streamed)
    # the FIM tokens Continue writes into the prompt are parsed as tokens (a raw prompt)
    tokens = post(server, "/tokenize", {"content": req["body"]["prompt"],
                                        "add_special": True})[1]["tokens"]
    assert whole["tokens_evaluated"] == len(tokens)  # the BOS too, as llama-server adds it
    assert {260, 261, 262} <= set(tokens)  # <|fim_prefix|>, <|fim_suffix|>, <|fim_middle|>


def test_twinny_completion_with_max_tokens(server):
    req = client_request("twinny_completion")
    status, data = raw_post(server, req["path"], req["body"], {"Authorization": ""})
    assert status == 200, data
    objs = sse_objects(data)
    assert objs[-1]["stop"] and objs[-1]["tokens_predicted"] <= req["body"]["max_tokens"]


def test_tabby_completions_with_suffix_stream(server):
    req = client_request("tabby_completions")
    status, data = raw_post(server, req["path"], req["body"])
    assert status == 200, data
    objs = sse_objects(data)
    assert objs[-1] == "[DONE]"
    chunks = objs[:-1]
    assert all(isinstance(c["choices"][0]["text"], str) for c in chunks)
    finished = [i for i, c in enumerate(chunks) if c["choices"][0]["finish_reason"]]
    assert finished == [len(chunks) - 1]  # a finish chunk, then [DONE]
    # the suffix goes through the FIM prompt: the same answer as /infill's
    body = req["body"]
    status, infill, _ = post(server, "/infill", {
        "input_prefix": body["prompt"], "input_suffix": body["suffix"], "temperature": 0,
        "n_predict": body["max_tokens"]})
    status, plain, _ = post(server, "/v1/completions", dict(body, stream=False, temperature=0))
    assert plain["choices"][0]["text"] == infill["content"]
    assert plain["usage"]["prompt_tokens"] == infill["tokens_evaluated"]


def test_infill_greedy_equals_the_same_prompt_sent_as_tokens(server):
    fim = {"input_prefix": "def add(a, b):\n", "input_suffix": "\n\nprint(add(1, 2))\n",
           "input_extra": [{"filename": "m.py", "text": "X = 1\n"}], "temperature": 0,
           "n_predict": 16}
    status, a, _ = post(server, "/infill", fim)
    assert status == 200, a
    # llama-server's layout: the extra chunks, then the BOS (the tiny model adds one)
    ids = post(server, "/tokenize", {"content": [
        "<|repo_name|>myproject\n<|file_sep|>m.py\nX = 1\n<|file_sep|>filename\n", 1,
        "<|fim_prefix|>def add(a, b):\n<|fim_suffix|>\n\nprint(add(1, 2))\n<|fim_middle|>"]}
        )[1]["tokens"]
    status, b, _ = post(server, "/completion", {"prompt": ids, "temperature": 0,
                                                "n_predict": 16})
    assert a["content"] == b["content"] and a["tokens_evaluated"] == len(ids)
    # user text is data: FIM markers inside the code are text, not tokens
    status, c, _ = post(server, "/infill", dict(fim, input_prefix="s = '<|fim_middle|>'\n"))
    assert status == 200 and c["tokens_evaluated"] > len(ids) - 16 + 10


def test_n_indent_and_n_predict_limits(server):
    body = {"input_prefix": "if x:\n", "input_suffix": "", "temperature": 0, "n_predict": 40}
    free = post(server, "/infill", body)[1]
    cut = post(server, "/infill", dict(body, n_indent=8, return_tokens=True))[1]
    # return_tokens: the ids it generated, cut by the rule or not, cover its content
    assert free["tokens"] == [] and cut["tokens"]
    assert post(server, "/detokenize", {"tokens": cut["tokens"]})[1]["content"].startswith(
        cut["content"])
    lines = free["content"].split("\n")
    if len(lines) > 1:  # the rule applies from the second line on
        assert cut["content"] == free["content"][:len(cut["content"])]
        for line in cut["content"].split("\n")[1:-1]:
            assert len(line) - len(line.lstrip(" \t")) >= 8
    assert free["tokens_predicted"] <= 40 and free["stop_type"] in ("eos", "limit")


def test_tokenize_detokenize_apply_template_props(server):
    toks = post(server, "/tokenize", {"content": "hi <|fim_pad|>"})[1]["tokens"]
    assert 263 in toks  # parse_special is llama-server's default
    plain = post(server, "/tokenize", {"content": "hi <|fim_pad|>", "parse_special": False})[1]
    assert 263 not in plain["tokens"]
    assert post(server, "/detokenize", {"tokens": toks})[1]["content"] == "hi <|fim_pad|>"
    pieces = post(server, "/tokenize", {"content": "h\u00e9", "with_pieces": True})[1]["tokens"]
    assert pieces[0] == {"id": pieces[0]["id"], "piece": "h"}
    assert all(isinstance(p["piece"], (str, list)) for p in pieces)
    status, body, _ = post(server, "/apply-template",
                           {"messages": [{"role": "user", "content": "hello"}]})
    assert status == 200 and body["prompt"] == "<|user|>\nhello\n<|assistant|>\n"
    status, props, _ = server.raw("GET", "/props")
    assert status == 200 and props["default_generation_settings"]["n_ctx"] > 0
    assert props["infill"] is True and "message['role']" in props["chat_template"]
    status, err, _ = post(server, "/detokenize", {"tokens": [0, 99999]})
    assert status == 400 and "token id" in err["error"]["message"]


def test_prediction_is_a_free_draft_and_never_changes_the_answer(server):
    client = server.client()
    messages = [{"role": "user", "content": "write a loop"}]

    def ask(**extra):
        return client.chat.completions.create(model="m", messages=messages, temperature=0,
                                              max_tokens=32, **extra)

    alone = ask()
    text = alone.choices[0].message.content
    same = ask(prediction={"type": "content", "content": text})
    assert same.choices[0].message.content == text
    details = same.usage.completion_tokens_details
    assert details.accepted_prediction_tokens == same.usage.completion_tokens
    assert details.rejected_prediction_tokens == 0
    # whether auto drafts from it is this machine's costs' call (test_auto.py checks it
    # with scripted costs); what it drafted from it was accepted
    source = same.model_extra["tandem"]["by_source"].get("prediction")
    assert source is None or source["accepted"] == source["drafted"]
    wrong = ask(prediction={"type": "content", "content": "zzzz qqqq " * 8})
    assert wrong.choices[0].message.content == text
    assert wrong.usage.completion_tokens_details.rejected_prediction_tokens > 0
    assert getattr(alone.usage.completion_tokens_details, "accepted_prediction_tokens",
                   None) in (None, 0)


def test_cors_preflight_for_the_named_origin_only(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        for origin, allowed in (("http://localhost:3000", True), ("http://evil.test", False)):
            conn.request("OPTIONS", "/v1/chat/completions", headers={
                "Origin": origin, "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization,content-type"})
            resp = conn.getresponse()
            resp.read()
            assert (resp.getheader("access-control-allow-origin") == origin) is allowed
            assert resp.status == (200 if allowed else 400)
    finally:
        conn.close()
    status, _, hdrs = server.raw("GET", "/v1/models", headers={"Origin": "http://localhost:3000"})
    assert status == 200 and hdrs.get("access-control-allow-origin") == "http://localhost:3000"


MALFORMED = [
    ("/infill", {"input_suffix": "x"}),
    ("/infill", {"input_prefix": "x"}),
    ("/infill", {"input_prefix": ["x"], "input_suffix": ""}),
    ("/infill", {"input_prefix": "", "input_suffix": None}),
    ("/infill", {"input_prefix": "", "input_suffix": "", "input_extra": "x"}),
    ("/infill", {"input_prefix": "", "input_suffix": "", "input_extra": [1]}),
    ("/infill", {"input_prefix": "", "input_suffix": "", "input_extra": [{"filename": "a"}]}),
    ("/infill", {"input_prefix": "", "input_suffix": "", "input_extra": [{"text": ["a"]}]}),
    ("/infill", {"input_prefix": "", "input_suffix": "", "n_predict": -5}),
    ("/infill", {"input_prefix": "", "input_suffix": "", "n_predict": True}),
    ("/infill", {"input_prefix": "", "input_suffix": "", "n_indent": "4"}),
    ("/infill", {"input_prefix": "", "input_suffix": "", "t_max_predict_ms": -1}),
    ("/infill", {"input_prefix": "", "input_suffix": "", "response_fields": [1]}),
    ("/infill", {"input_prefix": "", "input_suffix": "", "top_p": 7}),
    ("/infill", {"input_prefix": "", "input_suffix": "", "prompt": 3}),
    ("/completion", {}),
    ("/completion", {"prompt": ""}),
    ("/completion", {"prompt": {"a": 1}}),
    ("/completion", {"prompt": [1, "x", 3]}),
    ("/completion", {"prompt": [-3]}),
    ("/completion", {"prompt": [1 << 40]}),
    ("/completion", {"prompt": "hi", "stream": "yes"}),
    ("/completion", {"prompt": "hi", "stop": "x" * 2000}),
    ("/completion", {"prompt": "hi", "prediction": "text"}),
    ("/completion", {"prompt": "x" * 100 + " " * (3 << 20)}),
    ("/v1/completions", {"prompt": "a", "suffix": 3}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                              "prediction": {"type": "other"}}),
    ("/tokenize", {"content": 5}),
    ("/tokenize", {"content": "a", "with_pieces": "yes"}),
    ("/detokenize", {"tokens": "abc"}),
    ("/detokenize", {"tokens": [1.5]}),
    ("/apply-template", {"messages": []}),
]


def test_malformed_completion_requests_get_a_4xx_and_the_server_stays_up(server):
    assert len(MALFORMED) >= 20
    for path, body in MALFORMED:
        status, answer, _ = post(server, path, body)
        assert 400 <= status < 500, (path, body, status, answer)
        assert isinstance(answer.get("error", {}).get("message"), str), (path, answer)
    status, answer, _ = server.raw("POST", "/infill", b"{not json")
    assert status == 400 and answer["error"]["code"] == "invalid_json"
    assert server.health()["status"] == "ok"
    status, again, _ = post(server, "/infill", {"input_prefix": "a", "input_suffix": "b",
                                                "n_predict": 2})
    assert status == 200, again


def test_a_model_without_fim_tokens_answers_501(tiny_models, tmp_path):
    srv = Server([*tiny_args(tiny_models), "--strategy", "none"], tmp_path)
    try:
        status, answer, _ = post(srv, "/infill", {"input_prefix": "a", "input_suffix": "b"})
        assert status == 501, answer
        assert "prefix token is missing" in answer["error"]["message"]
        status, answer, _ = post(srv, "/v1/completions", {"prompt": "a", "suffix": "b"})
        assert status == 501
        status, answer, _ = post(srv, "/completion", {"prompt": "ab", "n_predict": 3})
        assert status == 200 and answer["tokens_predicted"] <= 3
        assert srv.raw("GET", "/props")[1]["infill"] is False
    finally:
        srv.stop()


def test_a_cancelled_completion_frees_the_engine_and_keeps_the_cache(server):
    """An editor drops its request on a keystroke: the engine stops within a step, and the
    next request with the same prefix still reuses what the cancelled one evaluated."""
    import socket

    before = server.health()["cancelled"]
    body = json.dumps({"input_prefix": "def long(x):\n" * 20, "input_suffix": "",
                       "n_predict": 400, "temperature": 0, "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    sock.sendall(b"POST /infill HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    seen = b""
    while b"data: " not in seen:  # the headers, then the answer's first piece
        seen += sock.recv(65536)
    sock.close()
    for _ in range(100):
        health = server.health()
        if health["cancelled"] > before and not health["busy"]:
            break
        time.sleep(0.1)
    assert health["cancelled"] == before + 1 and not health["busy"], health
    status, again, _ = post(server, "/infill", {"input_prefix": "def long(x):\n" * 20,
                                                "input_suffix": "", "n_predict": 2,
                                                "temperature": 0})
    assert status == 200 and again["timings"]["cache_n"] > 100, again["timings"]


def test_a_megabyte_word_to_fill_in_holds_back_nobody(server):
    """One word of 1 MB as the prefix, the suffix and an extra chunk: cut before the tokenizer
    sees it (the tiny SPM vocabulary took 70 s on it whole, and every request waited)."""
    word = "x" * 1000000
    results: dict = {}
    for fields in ({"input_prefix": word, "input_suffix": ""},
                   {"input_prefix": "", "input_suffix": word},
                   {"input_prefix": "", "input_suffix": "",
                    "input_extra": [{"filename": "a", "text": word}]}):
        big = threading.Thread(target=lambda f=fields: results.update(big=post(
            server, "/infill", {**f, "n_predict": 2, "temperature": 0})[0]))
        big.start()
        time.sleep(0.05)
        # answered within 30 s or its socket times out: held 70 s before (not a speed bound)
        status, answer, _ = server.raw("POST", "/completion", json.dumps(
            {"prompt": "def f", "n_predict": 2}), timeout=30)
        assert status == 200, answer
        big.join(300)
        assert results["big"] == 200


def test_huge_input_extra_is_cut_to_the_contexts_share(server):
    """200 chunks of 2 kB: tokenized, their tail kept within the context's share, and the
    answer comes; a file far longer than the context as the prefix keeps its tail too."""
    chunk = {"filename": "big.py", "text": "x = 1\n" * 340}
    status, answer, _ = post(server, "/infill", {
        "input_prefix": "def f():\n" * 3000, "input_suffix": "", "input_extra": [chunk] * 200,
        "n_predict": 4, "temperature": 0})
    assert status == 200, answer
    assert answer["tokens_evaluated"] < answer["generation_settings"]["n_ctx"]
    assert answer["truncated"] is False
