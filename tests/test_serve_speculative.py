"""Speculation per request (docs/serve.md): the generating routes take llama-server's draft
settings (flat "speculative.n_max" keys or a "speculative" object) and tandem's `strategy`,
within what the server loaded. Each answer's `tandem` object says what it ran with and how
long its drafts were; greedy answers are the same whatever the request asks; bad values and a
strategy the server cannot run are a 400 naming the field; /props shows the defaults."""
from __future__ import annotations

import json

import pytest

from serve_helpers import Server, stop_cleanly
from tandem.engine.drafting.drafters import DraftParams
from tandem.serve import protocol
from tandem.serve.api_errors import ApiError

# a prompt the tiny draft model continues well: its drafts run long unless told otherwise
PROMPT = "one two three four five one two three four five one two three four five one two"
LONG_DRAFTS = {"n_max": 8, "p_min": 0.0}


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    # exact mode: greedy answers are bit-identical to plain decoding, so answers under
    # different drafting must be equal token for token
    srv = Server(["-m", str(tiny_models["target"]), "-md", str(tiny_models["draft"]), "-t",
                  "1", "--exact", "--strategy", "draft", "--max-tokens", "64"],
                 tmp_path_factory.mktemp("spec-home"))
    yield srv
    stop_cleanly(srv)


@pytest.fixture(scope="module")
def plain_server(tiny_models, tmp_path_factory):
    """A server without a draft model (the target's n-grams draft)."""
    srv = Server(["-m", str(tiny_models["target"]), "-t", "1", "--strategy", "ngram"],
                 tmp_path_factory.mktemp("spec-plain-home"))
    yield srv
    stop_cleanly(srv)


def _complete(srv: Server, path: str = "/completion", **fields) -> dict:
    body = {"prompt": PROMPT, "temperature": 0, "return_tokens": True, **fields}
    if path == "/completion":
        body["n_predict"] = 40
    else:
        body["max_tokens"] = 40
    status, reply, _ = srv.raw("POST", path, json.dumps(body))
    assert status == 200, reply
    return reply


def _refusal(srv: Server, path: str, body: dict) -> dict:
    status, reply, _ = srv.raw("POST", path, json.dumps(body))
    assert status == 400, reply
    return reply["error"]


def _defaults(srv: Server) -> tuple:
    """The server's drafting as GET /props says it: (strategy, n_max, n_min, p_min)."""
    status, props, _ = srv.raw("GET", "/props")
    assert status == 200
    spec = props["default_generation_settings"]["speculative"]
    return spec["strategy"], spec["n_max"], spec["n_min"], spec["p_min"]


def test_n_max_1_drafts_at_most_one_token_a_step(server):
    """The draft length a request asks for bounds every step's draft, given flat or as an
    object, on llama-server's route and OpenAI's; the next request drafts as the server does."""
    long = _complete(server, speculative=LONG_DRAFTS)["tandem"]
    assert long["longest_draft"] > 1 and long["n_max"] == 8  # the bound below can fail
    for path, fields in (("/completion", {"speculative.n_max": 1, "speculative.p_min": 0.0}),
                         ("/v1/completions", {"speculative": {"n_max": 1, "p_min": 0.0}})):
        reply = _complete(server, path, **fields)
        t = reply["tandem"]
        assert (t["strategy"], t["n_max"], t["n_min"], t["p_min"]) == ("draft", 1, 0, 0.0)
        assert t["drafted_steps"] > 0 and t["longest_draft"] == 1
        assert reply["timings"]["draft_n"] == t["drafted_steps"]  # one token each
    after = _complete(server)["tandem"]  # nothing stays behind: the server's own settings
    assert (after["n_max"], after["n_min"], after["p_min"]) == _defaults(server)[1:]
    assert _complete(server, speculative=LONG_DRAFTS)["tandem"]["longest_draft"] > 1


def test_strategy_none_drafts_nothing_and_every_setting_answers_the_same(server):
    """Lossless: greedy answers are the same tokens whatever drafting the request asks for;
    `strategy: none` drafts nothing, `ngram` drafts from the prompt."""
    base = _complete(server, speculative=LONG_DRAFTS)
    assert base["timings"]["draft_n"] > 0
    none = _complete(server, strategy="none")
    assert none["tandem"]["strategy"] == "none" and none["timings"]["draft_n"] == 0
    assert none["tandem"]["drafted_steps"] == 0 and none["tandem"]["longest_draft"] == 0
    ngram = _complete(server, strategy="ngram")
    assert ngram["tandem"]["strategy"] == "ngram"
    short = _complete(server, **{"speculative.n_max": 1})
    assert base["tokens"]
    for other in (none, ngram, short):
        assert other["tokens"] == base["tokens"] and other["content"] == base["content"]


def test_a_stream_ends_with_the_settings_it_ran_with(server):
    client = server.client()
    chunks = list(client.chat.completions.create(
        model="target", messages=[{"role": "user", "content": PROMPT}], temperature=0,
        max_tokens=24, stream=True, extra_body={"speculative": {"n_max": 1, "p_min": 0.0}}))
    last = [c for c in chunks if c.choices and c.choices[0].finish_reason][-1]
    t = last.model_extra["tandem"]
    assert t["n_max"] == 1 and t["longest_draft"] <= 1 and t["strategy"] == "draft"
    whole = client.chat.completions.create(
        model="target", messages=[{"role": "user", "content": PROMPT}], temperature=0,
        max_tokens=24, extra_body={"strategy": "none"})
    assert whole.model_extra["tandem"]["strategy"] == "none"
    assert whole.model_extra["timings"]["draft_n"] == 0
    assert whole.choices[0].message.content == "".join(
        c.choices[0].delta.content or "" for c in chunks if c.choices)


@pytest.mark.parametrize("fields,param,code", [
    ({"speculative.n_max": -1}, "speculative.n_max", "invalid_value"),
    ({"speculative": {"n_max": 65}}, "speculative.n_max", "invalid_value"),
    ({"speculative": {"p_min": 1.5}}, "speculative.p_min", "invalid_value"),
    ({"speculative.p_min": "high"}, "speculative.p_min", "invalid_type"),
    ({"speculative.n_max": True}, "speculative.n_max", "invalid_type"),
    ({"speculative": {"n_max": 2, "n_min": 3}}, "speculative.n_min", "invalid_value"),
    ({"speculative": {"n_min": 9}}, "speculative.n_min", "invalid_value"),  # above the server's max
    ({"speculative": 3}, "speculative", "invalid_type"),
    ({"speculative": {"nmax": 2}}, "speculative.nmax", "unsupported_parameter"),
    ({"speculative": {"n_max": 2}, "speculative.n_max": 3}, "speculative.n_max",
     "conflicting_parameters"),
    ({"strategy": "fastest"}, "strategy", "invalid_value"),
    ({"strategy": 1}, "strategy", "invalid_type"),
])
def test_bad_values_are_a_400_naming_the_field(server, fields, param, code):
    for path, body in (("/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "hi"}], **fields}),
                       ("/completion", {"prompt": "hi", **fields})):
        error = _refusal(server, path, body)
        assert (error["param"], error["code"]) == (param, code), error


def test_a_strategy_the_server_did_not_load_is_a_400(server, plain_server):
    """`draft` on a server without a draft model, `mtp` on a target without MTP heads: the
    engine's refusal, naming what the server has, streamed or not; the server goes on."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for stream in (False, True):
        error = _refusal(plain_server, "/v1/chat/completions",
                         {**chat, "strategy": "draft", "stream": stream})
        assert error["param"] == "strategy"
        assert "no draft model" in error["message"] and "ngram" in error["message"], error
    error = _refusal(server, "/completion", {"prompt": "hi", "strategy": "mtp"})
    assert error["param"] == "strategy" and "MTP" in error["message"], error
    assert "the draft model" in error["message"], error
    reply = _complete(plain_server, strategy="none")  # the refusals left it serving
    assert reply["tandem"]["strategy"] == "none" and reply["timings"]["draft_n"] == 0
    assert _complete(plain_server)["tandem"]["strategy"] == "ngram"


def test_props_show_the_servers_defaults(server, plain_server, tiny_models):
    """/props says what a request that does not say runs with (its answer's `tandem` object
    agrees), in llama-server's keys and tandem's object, with the draft model it has."""
    for srv, strategy, draft_model in ((server, "draft", tiny_models["draft"].name),
                                       (plain_server, "ngram", None)):
        status, props, _ = srv.raw("GET", "/props")
        assert status == 200
        settings = props["default_generation_settings"]
        spec = settings["speculative"]
        assert (spec["strategy"], spec["draft_model"]) == (strategy, draft_model)
        params = settings["params"]
        assert (params["speculative.n_max"], params["speculative.n_min"],
                params["speculative.p_min"]) == (spec["n_max"], spec["n_min"], spec["p_min"])
        answer = _complete(srv)
        t = answer["tandem"]
        assert (t["strategy"], t["n_max"], t["n_min"], t["p_min"]) == _defaults(srv)
        assert answer["generation_settings"]["speculative.n_max"] == spec["n_max"]
    final = _complete(server, **{"speculative.n_max": 2})
    assert final["generation_settings"]["speculative.n_max"] == 2


def test_the_request_fields_resolve_against_the_servers():
    """Parsing alone (no server): what the request leaves out is the server's; a draft min
    the request leaves to the server is held at the max it asks for, as llama-server does."""
    msgs = [{"role": "user", "content": "x"}]
    req = protocol.parse_chat({"messages": msgs, "speculative.n_max": 2.0, "strategy": "NGRAM"})
    assert (req.strategy, req.n_max, req.n_min, req.p_min) == ("ngram", 2, None, None)
    server = DraftParams(n_max=6, n_min=3, p_min=0.4)
    assert protocol.drafting(req, "draft", server) == ("ngram", DraftParams(2, 2, 0.4))
    plain = protocol.parse_chat({"messages": msgs})
    assert protocol.drafting(plain, "auto", server) == ("auto", server)
    same = protocol.parse_chat({"messages": msgs, "speculative": {"n_max": 3},
                                "speculative.n_max": 3})
    assert same.n_max == 3
    with pytest.raises(ApiError) as exc:
        protocol.drafting(protocol.parse_chat({"messages": msgs, "speculative.n_min": 7}),
                          "draft", server)
    assert exc.value.param == "speculative.n_min"


@pytest.mark.parametrize("path,body", [
    ("/v1/messages", {"model": "m", "max_tokens": 8,
                      "messages": [{"role": "user", "content": PROMPT}]}),
    ("/v1/responses", {"model": "m", "max_output_tokens": 8, "input": PROMPT}),
])
def test_the_other_apis_pass_the_drafting_fields_on(server, path, body):
    """Anthropic's Messages and OpenAI's Responses requests reach the chat path with their
    drafting fields: a bad one is refused as on the chat route, a good one answers."""
    status, reply, _ = server.raw("POST", path, json.dumps({**body, "strategy": "bogus"}))
    assert status == 400 and "strategy" in json.dumps(reply), reply
    status, reply, _ = server.raw("POST", path, json.dumps(
        {**body, "strategy": "none", "speculative": {"n_max": 1}}))
    assert status == 200, reply
