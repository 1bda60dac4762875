"""Anthropic's Messages API on `tandem serve` (issue 54), with the official `anthropic` SDK
against a real server on 127.0.0.1 and the tiny models: answers whole and streamed, system
prompts and content blocks, a forced tool call whose input validates, the tool_result turn,
count_tokens, stop sequences, the prompt cache, the API key in x-api-key, and Anthropic's
error shape for every refusal. The real pair (slow): a tool call and a cached second turn."""
from __future__ import annotations

import json

import pytest

anthropic = pytest.importorskip("anthropic")
jsonschema = pytest.importorskip("jsonschema")

from serve_helpers import Server, stop_cleanly, tiny_args  # noqa: E402

# short strings: the tiny models spell every character as one token
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["c", "f"]}},
               "required": ["city", "unit"], "additionalProperties": False}}
QUESTION = {"role": "user", "content": "What is the weather in Paris?"}


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    # exact: greedy answers equal plain decoding's, so streamed equals whole
    srv = Server([*tiny_args(tiny_models), "--exact", "--strategy", "draft",
                  "--max-tokens", "200"], tmp_path_factory.mktemp("serve-anthropic-home"))
    yield srv
    stop_cleanly(srv)


def _client(srv: Server, **kwargs):
    kwargs.setdefault("api_key", "unused")
    kwargs.setdefault("timeout", 120)
    return anthropic.Anthropic(base_url=f"http://127.0.0.1:{srv.port}", max_retries=0,
                               **kwargs)


# greedy: this SDK has no sampling fields any more; the server takes them as extra fields
GREEDY = {"temperature": 0}


def _ask(client, messages=None, **kwargs):
    kwargs.setdefault("max_tokens", 16)
    kwargs["extra_body"] = {**GREEDY, **kwargs.get("extra_body", {})}
    return client.messages.create(model="claude-sonnet-4-5", messages=messages or [QUESTION],
                                  **kwargs)


def _text(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_a_message_whole_and_streamed(server):
    client = _client(server)
    # a model name the server does not have and a field it does not know: both ignored
    msg = _ask(client, extra_body={"not_a_field": {"x": 1}})
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert msg.stop_reason in ("end_turn", "max_tokens") and _text(msg)
    assert msg.usage.output_tokens == 16 or msg.stop_reason == "end_turn"
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens > 10
    with client.messages.stream(model="claude-x", max_tokens=16, extra_body=GREEDY,
                                messages=[QUESTION]) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == _text(final) == _text(msg) and len(pieces) > 1
    assert final.stop_reason == msg.stop_reason
    assert final.usage.output_tokens == msg.usage.output_tokens
    # the events in Anthropic's order
    kinds = [e.type for e in _ask(client, stream=True)]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1


def test_system_prompt_and_content_blocks_reach_the_template(server):
    client = _client(server)
    plain = client.messages.count_tokens(model="x", messages=[QUESTION]).input_tokens
    system = [{"type": "text", "text": "You answer in French."},
              {"type": "text", "text": "Briefly.", "cache_control": {"type": "ephemeral"}}]
    blocks = [{"role": "user", "content": [{"type": "text", "text": "What is the weather"},
                                           {"type": "text", "text": "in Paris?"}]}]
    with_system = client.messages.count_tokens(model="x", system=system, messages=blocks)
    assert with_system.input_tokens > plain + 5
    # multi-turn, with a thinking block sent back (dropped) and thinking asked (ignored)
    turns = [QUESTION, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "hmm", "signature": "x"},
        {"type": "text", "text": "Sunny."}]}, {"role": "user", "content": "And tomorrow?"}]
    msg = _ask(client, turns, system="Be brief.",
               thinking={"type": "enabled", "budget_tokens": 1024})
    assert _text(msg) and all(b.type == "text" for b in msg.content)


def _check_tool_use(msg) -> object:
    assert msg.stop_reason == "tool_use", msg
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].id
    jsonschema.validate(uses[0].input, WEATHER["input_schema"])
    return uses[0]


@pytest.mark.parametrize("streamed", [False, True])
def test_a_forced_tool_call_then_its_result_answered(server, streamed):
    client = _client(server)
    kwargs = dict(max_tokens=120, tools=[WEATHER],
                  tool_choice={"type": "tool", "name": "get_weather"})
    if streamed:
        with client.messages.stream(model="x", messages=[QUESTION], extra_body=GREEDY,
                                    **kwargs) as stream:
            events = [e.type for e in stream]
            msg = stream.get_final_message()
        assert "input_json" in events  # the SDK parsed the input_json_delta
    else:
        msg = _ask(client, **kwargs)
    use = _check_tool_use(msg)
    follow = [QUESTION, {"role": "assistant", "content": [b.model_dump() for b in msg.content]},
              {"role": "user", "content": [
                  {"type": "tool_result", "tool_use_id": use.id,
                   "content": [{"type": "text", "text": '{"temp": 21, "sky": "</s>"}'}]}]}]
    answer = _ask(client, follow, tools=[WEATHER], tool_choice={"type": "none"})
    assert answer.stop_reason in ("end_turn", "max_tokens") and _text(answer)
    # the template renders the call and its result (tool_choice none: not the tools)
    alone = client.messages.count_tokens(model="x", messages=[QUESTION]).input_tokens
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens > alone + 20


def test_count_tokens_equals_the_prompt_a_message_evaluates(server):
    client = _client(server)
    kwargs = dict(system="Be brief.", tools=[WEATHER], messages=[QUESTION])
    counted = client.messages.count_tokens(model="x", **kwargs).input_tokens
    msg = _ask(client, kwargs.pop("messages"), **kwargs)
    assert counted == msg.usage.input_tokens + msg.usage.cache_read_input_tokens


def test_a_resent_conversation_reads_its_prompt_from_the_cache(server):
    client = _client(server)
    first = _ask(client, [{"role": "user", "content": "Tell me a story about a cat."}])
    turns = [{"role": "user", "content": "Tell me a story about a cat."},
             {"role": "assistant", "content": _text(first)},
             {"role": "user", "content": "And a dog?"}]
    second = _ask(client, turns)
    # the first prompt (all but its last token, which the engine always evaluates) came
    # from the cache; the answer's tokens too, where they tokenize the same way
    first_prompt = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert second.usage.cache_read_input_tokens >= first_prompt - 1
    assert second.usage.input_tokens < second.usage.cache_read_input_tokens


def test_a_stop_sequence_is_named(server):
    client = _client(server)
    text = _text(_ask(client, max_tokens=12))
    assert len(text) >= 7, text
    stop = text[5:7]
    msg = _ask(client, max_tokens=12, stop_sequences=[stop])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    assert _text(msg) == text[:text.index(stop)]


def _error(srv: Server, body: dict, path: str = "/v1/messages", headers=None):
    status, got, _ = srv.raw("POST", path, json.dumps(body), headers)
    assert got["type"] == "error" and set(got["error"]) == {"type", "message"}, got
    return status, got["error"]


def test_refusals_in_anthropics_error_shape(server):
    status, err = _error(server, {"model": "x", "messages": [QUESTION]})
    assert status == 400 and err["type"] == "invalid_request_error"
    assert "max_tokens" in err["message"]
    base = {"model": "x", "max_tokens": 8}
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "AAAA"}}
    for body, words in [
        ({**base, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is this?"}, image]}]},
         "messages[0].content[1]: image blocks are not supported"),
        ({**base, "messages": [QUESTION], "tools": [
            {"type": "web_search_20250305", "name": "web_search"}]},
         "tools[0]: the server tool 'web_search_20250305'"),
        ({**base, "messages": [QUESTION], "mcp_servers": [{"type": "url", "url": "x"}]},
         "'mcp_servers' is not supported"),
        ({**base, "messages": [QUESTION, {"role": "assistant", "content": "It is"}]},
         "messages[1]: continuing an assistant turn (prefill)"),
        ({**base, "messages": [QUESTION], "stop_sequences": 5},  # checked by the chat path
         "'stop_sequences' must be a string or an array"),
        ({**base, "messages": [QUESTION], "tools": [{**WEATHER, "name": "bad name"}]},
         "tools[0].name must be"),
        ({**base, "messages": [QUESTION, {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2",
                                          "content": "x"}]}]},
         "messages[2].content[0]: a tool message must answer a call"),
    ]:
        status, err = _error(server, body)
        assert status == 400 and words in err["message"], (words, err)
    # refused before any handler (the body is not JSON): the same shape
    status, got, _ = server.raw("POST", "/v1/messages", "{not json")
    assert status == 400 and got["type"] == "error", got
    # the SDK reads the shape as its own
    with pytest.raises(anthropic.BadRequestError) as caught:
        _ask(_client(server), [{"role": "user", "content": [image]}])
    assert caught.value.body["error"]["type"] == "invalid_request_error"


def test_the_api_key_in_x_api_key_or_as_a_bearer(tiny_models, tmp_path):
    srv = Server([*tiny_args(tiny_models), "--api-key", "s3cret", "--max-tokens", "8"],
                 tmp_path)
    try:
        assert _text(_ask(_client(srv, api_key="s3cret"), max_tokens=4))  # x-api-key
        assert _text(_ask(_client(srv, api_key=None, auth_token="s3cret"), max_tokens=4))
        with pytest.raises(anthropic.AuthenticationError) as caught:
            _ask(_client(srv, api_key="wrong"), max_tokens=4)
        assert caught.value.body["error"]["type"] == "authentication_error"
        status, err = _error(srv, {"model": "x"}, "/v1/messages/count_tokens")
        assert status == 401 and "x-api-key" in err["message"]
        # the OpenAI routes take the x-api-key header too
        status, _, _ = srv.raw("GET", "/v1/models", headers={"x-api-key": "s3cret"})
        assert status == 200
    finally:
        stop_cleanly(srv)


# ----------------------------------------------------------------------- the real pair


@pytest.mark.slow
def test_real_pair_tool_call_and_a_cached_second_turn(real_pair, tmp_path):
    target, draft = real_pair
    srv = Server(["-m", str(target), "-md", str(draft), "--max-tokens", "160"], tmp_path)
    try:
        client = _client(srv, timeout=600)
        weather = {"name": "get_weather", "description": "Get the current weather in a city",
                   "input_schema": {"type": "object", "properties": {
                       "city": {"type": "string"}}, "required": ["city"]}}
        question = {"role": "user", "content": "What's the weather like in Paris right now?"}
        # any: the 1.5B coder model, left to auto, often writes the call as a JSON code block
        msg = client.messages.create(model="x", max_tokens=80, extra_body=GREEDY,
                                     messages=[question], tools=[weather],
                                     tool_choice={"type": "any"})
        assert msg.stop_reason == "tool_use", msg
        use = next(b for b in msg.content if b.type == "tool_use")
        assert use.name == "get_weather" and use.input["city"] == "Paris"
        result = {"type": "tool_result", "tool_use_id": use.id,
                  "content": '{"temperature_c": 21, "sky": "sunny"}'}
        follow = [question, {"role": "assistant", "content": [b.model_dump() for b in msg.content]},
                  {"role": "user", "content": [result]}]
        final = client.messages.create(model="x", max_tokens=60, extra_body=GREEDY,
                                       messages=follow, tools=[weather])
        assert final.stop_reason == "end_turn" and "21" in _text(final)
        # the resent conversation: only what is new was evaluated
        assert final.usage.cache_read_input_tokens > msg.usage.input_tokens // 2
    finally:
        stop_cleanly(srv)
