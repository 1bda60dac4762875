"""OpenAI's Responses API in its wire format, without any HTTP: a request (`instructions`,
`input` items: messages, `function_call`, `function_call_output`; `tools`, `tool_choice`,
`max_output_tokens`, `text.format`) translated into a chat completion's body (chat_bridge.py
checks and answers it on the chat path), the answer as a `response` object with `message`
and `function_call` output items, or its stream of `response.*` events; usage as the
Responses API counts it. Errors keep OpenAI's error object (api_errors.py).

tandem keeps no responses: `previous_response_id`, `conversation`, `background`, stored
prompts and `item_reference` items are refused naming the field (the whole conversation goes
in `input`, where the prompt cache makes a resent one cheap); `store`, `reasoning`, `include`,
`truncation`, `metadata` are accepted and ignored, reasoning items sent back are skipped.
"""
from __future__ import annotations

import uuid
from functools import partial

from tandem.serve import chat_bridge
from tandem.serve.api_errors import ApiError, bad, clip, kind_of
from tandem.serve.protocol import DRAFTING_KEYS

# chat body paths -> this API's (chat_bridge.field_namer)
FIELDS = (
    (r"^(input\[\d+\])\.tool_call_id", r"\1.call_id"),
    (r"^tools\[(\d+)\]\.function\.", r"tools[\1]."),
    (r"^tools\[(\d+)\]\.function$", r"tools[\1]"),
    (r"^max_tokens$", "max_output_tokens"),
    (r"^response_format\.json_schema\.schema", "text.format.schema"),
    (r"^response_format\b.*", "text.format"),
)
# fields that need responses kept on the server, which tandem does not keep
STORED = {"previous_response_id": "responses", "conversation": "conversations",
          "prompt": "prompts"}
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repeat_penalty", "seed", "stream",
            "parallel_tool_calls")
TEXT_PARTS = ("input_text", "output_text", "text")


def parse(body: dict):
    """A Responses request (or input_tokens') as a checked chat request."""
    chat, origins = chat_body(body)
    return chat_bridge.parse(chat, chat_bridge.field_namer(origins, FIELDS))


def chat_body(body: dict) -> tuple[dict, list[str]]:
    """The chat completion's body, and where each of its messages came from."""
    for key, what in STORED.items():
        if body.get(key) is not None:
            raise bad(f"'{key}' is not supported: tandem serve keeps no {what}; send the "
                      "whole conversation in 'input' (the prompt cache evaluates only what is "
                      "new)", key, "unsupported_parameter")
    if body.get("background"):
        raise bad("'background' is not supported by tandem serve: stream the answer instead",
                  "background", "unsupported_parameter")
    messages, origins = [], []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad(f"'instructions' must be a string, got {kind_of(instructions)}",
                      "instructions", "invalid_type")
        messages.append({"role": "system", "content": instructions})
        origins.append("instructions")
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad("'input' must be a string or a non-empty array of items", "input",
                  "missing_required_parameter" if items is None else "invalid_type")
    for i, item in enumerate(items):
        _item(item, f"input[{i}]", messages, origins)
    chat = {"messages": messages, "model": body.get("model"),
            **{key: body[key] for key in DRAFTING_KEYS if key in body}}
    chat.update({key: body[key] for key in SAMPLING if key in body})
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    _tools(body, chat)
    fmt = _text_format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    return chat, origins


def _item(item, where: str, messages: list, origins: list) -> None:
    """One input item onto the chat messages: a message; a function_call joins the
    assistant turn before it (or starts one); a function_call_output is a `tool` message."""
    if not isinstance(item, dict):
        raise bad(f"{where} must be an object, got {kind_of(item)}", where, "invalid_type")
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise bad(f"{where}.role must be one of user, system, developer, assistant; got "
                      f"{clip(repr(role))}", f"{where}.role")
        messages.append({"role": role, "content": _text(item.get("content"),
                                                        f"{where}.content")})
    elif kind == "function_call":
        call = {"id": item.get("call_id"), "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}}
        if messages and messages[-1]["role"] == "assistant":
            turn = messages[-1]
            turn.setdefault("tool_calls", []).append(call)
            turn["content"] = turn["content"] or None
            return
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                         "content": _text(item.get("output"), f"{where}.output")})
    elif kind == "reasoning":
        return  # an earlier answer's reasoning: this server writes none, and needs none
    else:
        raise bad(f"{where}.type {clip(repr(kind))} is not supported by tandem serve "
                  "(message, function_call, function_call_output)", f"{where}.type",
                  "unsupported_value")
    origins.append(where)


def _text(content, where: str) -> str:
    """A string, or an array of text parts (input_text, output_text)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{where} must be a string or an array of text parts, got "
                  f"{kind_of(content)}", where,
                  "missing_required_parameter" if content is None else "invalid_type")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        elif kind in TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            raise bad(f"{where}[{j}] must be a text part (input_text, output_text); "
                      f"{clip(repr(kind))} is not supported by tandem serve (the model reads "
                      "text)", f"{where}[{j}]", "unsupported_value")
    return "\n".join(texts)


def _tools(body: dict, chat: dict) -> None:
    """Function tools ({"type": "function", "name", "description", "parameters"}) and
    tool_choice into the chat's; built-in tools are refused by name."""
    raw = body.get("tools")
    if raw is not None:
        if not isinstance(raw, list):
            raise bad(f"'tools' must be an array, got {kind_of(raw)}", "tools", "invalid_type")
        chat["tools"] = [_tool(t, f"tools[{i}]") for i, t in enumerate(raw)]
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise bad("'tool_choice' must be auto, none, required or {\"type\": \"function\", "
                      f"\"name\": ...}}, got type {clip(repr(choice.get('type')))}",
                      "tool_choice", "unsupported_value")
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if choice is not None and (raw or choice not in ("auto", "none")):
        chat["tool_choice"] = choice


def _tool(t, where: str) -> dict:
    if not isinstance(t, dict):
        raise bad(f"{where} must be an object, got {kind_of(t)}", where, "invalid_type")
    if t.get("type") != "function":
        raise bad(f"{where}: the tool type {clip(repr(t.get('type')))} is not supported by "
                  "tandem serve (function tools only)", f"{where}.type", "unsupported_value")
    function = {key: t[key] for key in ("name", "description", "parameters", "strict")
                if t.get(key) is not None}
    return {"type": "function", "function": function}


def _text_format(text) -> dict | None:
    """`text.format` (text, json_object, json_schema with name, schema, strict) as the
    chat's response_format."""
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad(f"text.format must be an object, got {kind_of(fmt)}", "text.format",
                  "invalid_type")
    if fmt.get("type") != "json_schema":
        return fmt  # text, json_object: the chat's own spelling
    spec = {key: fmt[key] for key in ("name", "schema", "strict") if key in fmt}
    return {"type": "json_schema", "json_schema": spec}


# ----- answers

def usage(stats) -> dict:
    """The Responses API's usage: input_tokens the whole prompt, of which cached_tokens the
    KV cache already held."""
    cached = max(stats.n_prompt - stats.n_prompt_eval, 0)
    return {"input_tokens": stats.n_prompt, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": stats.n_generated,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": stats.n_prompt + stats.n_generated}


def response(body: dict, rid: str, created: int, model: str, output: list,
             status: str = "in_progress", stats=None) -> dict:
    """The `response` object: the request's settings echoed, the output items, usage."""
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {"id": rid, "object": "response", "created_at": created, "status": status,
            "error": None, "incomplete_details": incomplete,
            "instructions": body.get("instructions"), "model": model, "output": output,
            "max_output_tokens": body.get("max_output_tokens"),
            "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
            "previous_response_id": None, "reasoning": {"effort": None, "summary": None},
            "store": False, "temperature": body.get("temperature"),
            "text": body.get("text") or {"format": {"type": "text"}},
            "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
            "top_p": body.get("top_p"), "truncation": "disabled", "metadata": {},
            "usage": usage(stats) if stats is not None else None}


def _id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(text: str | None, item_id: str, status: str = "completed") -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [output_text(text)] if text is not None else []}


def call_item(call: dict, item_id: str, status: str = "completed") -> dict:
    fn = call["function"]
    return {"type": "function_call", "id": item_id, "call_id": call["id"], "name": fn["name"],
            "arguments": fn["arguments"] if status == "completed" else "", "status": status}


def whole(body: dict, req, rid: str, created: int, model: str, answer) -> dict:
    """The whole answer: a message item with the text, a function_call item per call."""
    text, calls, finish = chat_bridge.content(req, answer)
    output = ([message_item(text, _id("msg_"))] if text else []) + [
        call_item(c, _id("fc_")) for c in calls]
    return response(body, rid, created, model, output,
                    "incomplete" if finish == "length" else "completed", answer.stats)


class ResponseStream:
    """The stream's events, each with its sequence_number: response.created and
    .in_progress, per run of text a message item (output_item.added, content_part.added,
    output_text.delta..., output_text.done, content_part.done, output_item.done), per call
    a function_call item (its arguments whole in one delta), then response.completed (or
    response.incomplete at the token limit); a failure is an `error` event."""

    def __init__(self, body: dict, req, rid: str, created: int, model: str):
        self.body, self.rid, self.created, self.model = body, rid, created, model
        self.seq = 0
        self.output: list[dict] = []  # the items done
        self.item: dict | None = None  # the message item being written
        self.pieces: list[str] = []

    def start(self) -> list[bytes]:
        resp = self._response("in_progress")
        return [self._event("response.created", response=resp),
                self._event("response.in_progress", response=resp)]

    def text(self, text: str) -> list[bytes]:
        out = []
        if self.item is None:
            self.item = message_item(None, _id("msg_"), "in_progress")
            out += [self._event("response.output_item.added", output_index=len(self.output),
                                item=self.item),
                    self._event("response.content_part.added", **self._at(),
                                part=output_text(""))]
        self.pieces.append(text)
        return out + [self._event("response.output_text.delta", **self._at(), delta=text,
                                  logprobs=[])]

    def call(self, call: dict) -> list[bytes]:
        out = self._close()
        item_id, index = _id("fc_"), len(self.output)
        args = call["function"]["arguments"]
        item = call_item(call, item_id)
        self.output.append(item)
        return out + [
            self._event("response.output_item.added", output_index=index,
                        item=call_item(call, item_id, "in_progress")),
            self._event("response.function_call_arguments.delta", item_id=item_id,
                        output_index=index, delta=args),
            self._event("response.function_call_arguments.done", item_id=item_id,
                        output_index=index, name=item["name"], arguments=args),
            self._event("response.output_item.done", output_index=index, item=item)]

    def end(self, end: chat_bridge.End) -> list[bytes]:
        out = self._close()
        status = "incomplete" if end.finish == "length" else "completed"
        return out + [self._event(f"response.{status}",
                                  response=self._response(status, end.answer.stats))]

    def error(self, exc: ApiError) -> list[bytes]:
        return [self._event("error", code=exc.code, message=exc.message, param=exc.param)]

    def _response(self, status: str, stats=None) -> dict:
        return response(self.body, self.rid, self.created, self.model, list(self.output),
                        status, stats)

    def _at(self) -> dict:
        return {"item_id": self.item["id"], "output_index": len(self.output),
                "content_index": 0}

    def _close(self) -> list[bytes]:
        if self.item is None:
            return []
        text, at = "".join(self.pieces), self._at()
        part = output_text(text)
        item = {**self.item, "status": "completed", "content": [part]}
        self.output.append(item)
        self.item, self.pieces = None, []
        return [self._event("response.output_text.done", **at, text=text, logprobs=[]),
                self._event("response.content_part.done", **at, part=part),
                self._event("response.output_item.done", output_index=at["output_index"],
                            item=item)]

    def _event(self, kind: str, **fields) -> bytes:
        self.seq += 1
        return chat_bridge.sse_event(kind, {"type": kind, "sequence_number": self.seq - 1,
                                            **fields})


def wire(body: dict):
    """This request's Wire: its answers echo the request's settings."""
    return chat_bridge.wire(partial(whole, body), partial(ResponseStream, body))
