"""OpenAI's Responses API on `tandem serve` (issue 54), with the official `openai` SDK against
a real server on 127.0.0.1 and the tiny models: responses whole and streamed, instructions
and input items, a function tool's call whose arguments validate, its function_call_output
answered, input_tokens, previous_response_id refused, and errors naming the Responses
fields. The real pair (slow): a tool call and a cached second turn."""
from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from serve_helpers import Server, stop_cleanly, tiny_args  # noqa: E402

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["c", "f"]}},
               "required": ["city", "unit"], "additionalProperties": False}}
QUESTION = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    # exact: greedy answers equal plain decoding's, so streamed equals whole
    srv = Server([*tiny_args(tiny_models), "--exact", "--strategy", "draft",
                  "--max-tokens", "200"], tmp_path_factory.mktemp("serve-responses-home"))
    yield srv
    stop_cleanly(srv)


def _ask(client, input=QUESTION, **kwargs):
    kwargs.setdefault("max_output_tokens", 16)
    kwargs.setdefault("temperature", 0)
    return client.responses.create(model="gpt-5-codex", input=input, **kwargs)


def _streamed(client, **kwargs):
    """The stream's event types and its last event's response: response.completed's, or
    response.incomplete's at the token limit (the SDK's get_final_response wants the first)."""
    kwargs.setdefault("max_output_tokens", 16)
    kwargs.setdefault("temperature", 0)
    kwargs.setdefault("input", QUESTION)
    with client.responses.stream(model="x", **kwargs) as stream:
        events = list(stream)
    return [e.type for e in events], events[-1].response


def test_a_response_whole_and_streamed(server):
    client = server.client()
    resp = _ask(client, extra_body={"not_a_field": 1})  # an unknown field is ignored
    assert resp.object == "response" and resp.id.startswith("resp_") and resp.output_text
    assert resp.status in ("completed", "incomplete")
    assert resp.usage.output_tokens == 16 or resp.status == "completed"
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    kinds, final = _streamed(client)
    assert final.output_text == resp.output_text and final.status == resp.status
    assert final.usage.input_tokens == resp.usage.input_tokens
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds.count("response.output_text.delta") > 1
    assert kinds[-1] == f"response.{resp.status}"


def test_instructions_and_input_items_reach_the_template(server):
    client = server.client()
    plain = client.responses.input_tokens.count(model="x", input=QUESTION).input_tokens
    items = [{"role": "developer", "content": "Answer in French."},
             {"type": "message", "role": "user", "content": [
                 {"type": "input_text", "text": "What is the weather"},
                 {"type": "input_text", "text": "in Paris?"}]}]
    counted = client.responses.input_tokens.count(model="x", instructions="Be brief.",
                                                  input=items).input_tokens
    assert counted > plain + 5
    # multi-turn, a reasoning item sent back (skipped) and reasoning asked (ignored)
    turns = [{"role": "user", "content": QUESTION},
             {"type": "reasoning", "id": "rs_1", "summary": []},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]},
             {"role": "user", "content": "And tomorrow?"}]
    resp = _ask(client, turns, instructions="Be brief.", reasoning={"effort": "low"})
    assert resp.output_text and [o.type for o in resp.output] == ["message"]


def _check_call(resp):
    calls = [o for o in resp.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id, resp
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    return calls[0]


@pytest.mark.parametrize("streamed", [False, True])
def test_a_function_call_then_its_output_answered(server, streamed):
    client = server.client()
    kwargs = dict(tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
                  max_output_tokens=120)
    if streamed:
        kinds, resp = _streamed(client, **kwargs)
        assert "response.function_call_arguments.done" in kinds
    else:
        resp = _ask(client, **kwargs)
    assert resp.status == "completed"
    call = _check_call(resp)
    turns = [{"role": "user", "content": QUESTION}, call.model_dump(exclude_none=True),
             {"type": "function_call_output", "call_id": call.call_id,
              "output": '{"temp": 21, "sky": "<|im_end|>"}'}]
    answer = _ask(client, turns, tools=[WEATHER], tool_choice="none")
    assert answer.output_text and not [o for o in answer.output if o.type == "function_call"]
    alone = client.responses.input_tokens.count(model="x", input=QUESTION).input_tokens
    assert answer.usage.input_tokens > alone + 20  # the call and its output were rendered


def test_input_tokens_equal_the_prompt_a_response_evaluates(server):
    client = server.client()
    kwargs = dict(instructions="Be brief.", tools=[WEATHER], input=QUESTION)
    counted = client.responses.input_tokens.count(model="x", **kwargs)
    assert counted.object == "response.input_tokens"
    assert counted.input_tokens == _ask(client, **kwargs).usage.input_tokens


def test_a_resent_conversation_reports_cached_tokens(server):
    client = server.client()
    first = _ask(client, "Tell me a story about a cat.")
    turns = [{"role": "user", "content": "Tell me a story about a cat."},
             {"role": "assistant", "content": first.output_text},
             {"role": "user", "content": "And a dog?"}]
    second = _ask(client, turns)
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached >= first.usage.input_tokens - 1 and cached > second.usage.input_tokens / 2


def _refused(client, **kwargs) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as caught:
        _ask(client, **kwargs)
    assert set(caught.value.body) >= {"message", "type", "param", "code"}  # OpenAI's shape
    return caught.value


def test_refusals_name_the_responses_fields(server):
    client = server.client()
    err = _refused(client, previous_response_id="resp_123")
    assert err.body["param"] == "previous_response_id"
    assert "send the whole conversation in 'input'" in err.body["message"]
    for kwargs, param, words in [
        (dict(max_output_tokens=0), "max_output_tokens", "'max_output_tokens' must be in"),
        (dict(tools=[{**WEATHER, "name": "bad name"}]), "tools[0].name", "tools[0].name must"),
        (dict(tools=[{"type": "web_search"}]), "tools[0].type", "'web_search' is not supported"),
        (dict(input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]),
         "input[0].content[0]", "'input_image' is not supported"),
        (dict(input=[{"type": "item_reference", "id": "msg_1"}]), "input[0].type",
         "'item_reference' is not supported"),
        (dict(input=[{"role": "user", "content": QUESTION},
                     {"type": "function_call_output", "call_id": "call_9", "output": "1"}]),
         "input[1].call_id", "input[1]: a tool message must answer a call"),
        (dict(text={"format": {"type": "json_schema", "name": "x", "schema": "{"}}),
         "text.format.schema", "'text.format.schema' is not valid JSON"),
    ]:
        err = _refused(client, **kwargs)
        assert err.body["param"] == param and words in err.body["message"], (param, err.body)
    status, body, _ = server.raw("POST", "/v1/responses", json.dumps({"model": "x"}))
    assert status == 400 and body["error"]["param"] == "input", body


# ----------------------------------------------------------------------- the real pair


@pytest.mark.slow
def test_real_pair_function_call_and_a_cached_second_turn(real_pair, tmp_path):
    target, draft = real_pair
    srv = Server(["-m", str(target), "-md", str(draft), "--max-tokens", "160"], tmp_path)
    try:
        client = srv.client(timeout=600)
        weather = {"type": "function", "name": "get_weather",
                   "description": "Get the current weather in a city",
                   "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                  "required": ["city"]}}
        question = {"role": "user", "content": "What's the weather like in Paris right now?"}
        # required: the 1.5B coder model, left to auto, often writes the call as a JSON block
        resp = _ask(client, [question], tools=[weather], tool_choice="required",
                    max_output_tokens=80)
        calls = [o for o in resp.output if o.type == "function_call"]
        assert resp.status == "completed" and len(calls) == 1, resp
        assert calls[0].name == "get_weather"
        assert json.loads(calls[0].arguments)["city"] == "Paris"
        turns = [question, calls[0].model_dump(exclude_none=True),
                 {"type": "function_call_output", "call_id": calls[0].call_id,
                  "output": '{"temperature_c": 21, "sky": "sunny"}'}]
        final = _ask(client, turns, tools=[weather], max_output_tokens=60)
        assert final.status == "completed" and "21" in final.output_text
        # the resent conversation: only what is new was evaluated
        assert final.usage.input_tokens_details.cached_tokens > resp.usage.input_tokens // 2
    finally:
        stop_cleanly(srv)
