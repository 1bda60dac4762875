"""Anthropic's Messages API in its wire format, without any HTTP: a request (`system`,
`messages` of content blocks, `tools`, `tool_choice`, `stop_sequences`, `output_config`)
translated into a chat completion's body (chat_bridge.py checks and answers it on the chat
path), the answer as a `message` object or its stream of events (`message_start`,
`content_block_*`, `message_delta`, `message_stop`), usage as Anthropic counts it, stop
reasons, and Anthropic's error object.

What the model cannot do is refused naming the field: image and document blocks, server
tools (and `mcp_servers`, `container`), an assistant turn to continue (prefill). `thinking` is accepted and ignored (the answer
has no thinking blocks), as are thinking blocks sent back, `cache_control` and `metadata`.
"""
from __future__ import annotations

import json

from tandem.serve import chat_bridge
from tandem.serve.api_errors import ApiError, bad, clip, kind_of
from tandem.serve.protocol import DRAFTING_KEYS

# chat body paths -> this API's (chat_bridge.field_namer)
FIELDS = (
    (r"^(messages\[\d+\]\.content\[\d+\])\.tool_call_id", r"\1.tool_use_id"),
    (r"^tools\[(\d+)\]\.function\.parameters", r"tools[\1].input_schema"),
    (r"^tools\[(\d+)\]\.function\.", r"tools[\1]."),
    (r"^tools\[(\d+)\]\.function$", r"tools[\1]"),
    (r"^stop$", "stop_sequences"),
    (r"^response_format\.json_schema\.schema", "output_config.format.schema"),
    (r"^response_format\b.*", "output_config.format"),
)
CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # and {"type": "tool"}
SERVER_SIDE = ("mcp_servers", "container")  # tools that run on Anthropic's servers
# HTTP status -> Anthropic's error type
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}


class AnthropicError(ApiError):
    """An ApiError in Anthropic's shape: {"type": "error", "error": {"type", "message"}}."""

    def body(self) -> dict:
        kind = ERROR_TYPES.get(self.status,
                               "invalid_request_error" if self.status < 500 else "api_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}


def as_anthropic(exc: ApiError) -> AnthropicError:
    return AnthropicError(exc.status, exc.message, type=exc.type, param=exc.param,
                          code=exc.code, headers=exc.headers)


def parse(body: dict, counting: bool = False):
    """A Messages request (or count_tokens', which has no max_tokens) as a checked chat
    request (protocol.Request)."""
    chat, origins = chat_body(body, counting)
    return chat_bridge.parse(chat, chat_bridge.field_namer(origins, FIELDS))


def chat_body(body: dict, counting: bool = False) -> tuple[dict, list[str]]:
    """The chat completion's body, and where each of its messages came from."""
    if not counting and body.get("max_tokens") is None:
        raise bad("'max_tokens' is required: a Messages request says how long its answer "
                  "may be", "max_tokens", "missing_required_parameter")
    for key in SERVER_SIDE:
        if body.get(key):
            raise bad(f"'{key}' is not supported by tandem serve: its tools run on Anthropic's "
                      "servers (client tools only)", key, "unsupported_parameter")
    messages, origins = [], []
    if body.get("system") is not None:
        messages.append({"role": "system", "content": _texts(body["system"], "system")})
        origins.append("system")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad("'messages' must be a non-empty array of messages", "messages",
                  "missing_required_parameter" if raw is None else "invalid_type")
    for i, m in enumerate(raw):
        for msg, origin in _message(m, f"messages[{i}]"):
            messages.append(msg)
            origins.append(origin)
    if raw[-1].get("role") == "assistant":
        raise bad(f"messages[{len(raw) - 1}]: continuing an assistant turn (prefill) is not "
                  "supported by tandem serve; end with a user turn",
                  f"messages[{len(raw) - 1}]", "unsupported_value")
    chat = {"messages": messages, "model": body.get("model")}
    for key in ("max_tokens", "temperature", "top_p", "top_k", "stream", *DRAFTING_KEYS):
        if key in body:
            chat[key] = body[key]
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    _tools(body, chat)
    fmt = _output_format(body.get("output_config"))
    if fmt is not None:
        chat["response_format"] = fmt
    return chat, origins


def _texts(value, where: str) -> str:
    """A string, or an array of text blocks (the system prompt, a tool result's content)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad(f"{where} must be a string or an array of text blocks, got "
                  f"{kind_of(value)}", where, "invalid_type")
    texts = []
    for j, block in enumerate(value):
        texts.append(_text_block(block, f"{where}[{j}]"))
    return "\n".join(texts)


def _text_block(block, where: str) -> str:
    kind = block.get("type") if isinstance(block, dict) else None
    if kind in ("image", "document"):
        raise bad(f"{where}: {kind} blocks are not supported by tandem serve (the model reads "
                  "text)", where, "unsupported_value")
    if kind != "text" or not isinstance(block.get("text"), str):
        raise bad(f"{where} must be a text block ({{\"type\": \"text\", \"text\": ...}}), got "
                  f"{clip(repr(kind)) if kind else kind_of(block)}", where, "invalid_type")
    return block["text"]


def _blocks(m: dict, where: str) -> list:
    content = m.get("content")
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad(f"{where}.content must be a string or an array of content blocks, got "
                  f"{kind_of(content)}", f"{where}.content",
                  "missing_required_parameter" if content is None else "invalid_type")
    return content


def _message(m, where: str) -> list[tuple[dict, str]]:
    """One Anthropic message as chat messages: a user turn's tool results first (each a
    `tool` message answering its call), then its text; an assistant turn with its calls."""
    if not isinstance(m, dict):
        raise bad(f"{where} must be an object, got {kind_of(m)}", where, "invalid_type")
    role = m.get("role")
    if role not in ("user", "assistant"):
        raise bad(f"{where}.role must be 'user' or 'assistant' (the system prompt is the "
                  f"top-level 'system'), got {clip(repr(role))}", f"{where}.role")
    blocks = _blocks(m, where)
    texts, calls, results = [], [], []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # an earlier answer's thinking: this server writes none, and needs none
        if kind == "tool_use" and role == "assistant":
            calls.append(_call(block))
        elif kind == "tool_result" and role == "user":
            results.append(({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                              "content": _texts(block.get("content", ""), f"{at}.content")},
                             at))
        else:
            texts.append(_text_block(block, at))
    if role == "assistant":
        msg: dict = {"role": "assistant", "content": "".join(texts)}
        if calls:
            msg["tool_calls"] = calls
            msg["content"] = msg["content"] or None
        return [(msg, where)]
    out = results
    if texts or not results:
        out = out + [({"role": "user", "content": "\n".join(texts)}, where)]
    return out


def _call(block: dict) -> dict:
    """An assistant's tool_use block as the chat's tool call (checked there)."""
    return {"id": block.get("id"), "type": "function",
            "function": {"name": block.get("name"), "arguments": block.get("input", {})}}


def _tools(body: dict, chat: dict) -> None:
    """`tools` (client tools: name, description, input_schema) and `tool_choice` into the
    chat's; server tools are refused by name."""
    raw = body.get("tools")
    if raw is not None:
        if not isinstance(raw, list):
            raise bad(f"'tools' must be an array, got {kind_of(raw)}", "tools", "invalid_type")
        chat["tools"] = [_tool(t, f"tools[{i}]") for i, t in enumerate(raw)]
    choice = body.get("tool_choice")
    if choice is None:
        return
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in (*CHOICES, "tool"):
        raise bad("'tool_choice' must be {\"type\": \"auto\" | \"any\" | \"tool\" | \"none\"}"
                  f", got {clip(repr(choice))}", "tool_choice", "invalid_value")
    single = choice.get("disable_parallel_tool_use", False)
    if not isinstance(single, bool):
        raise bad("tool_choice.disable_parallel_tool_use must be a boolean",
                  "tool_choice.disable_parallel_tool_use", "invalid_type")
    if not raw and kind in ("auto", "none"):
        return  # nothing to choose from: the answer is text either way
    chat["tool_choice"] = CHOICES.get(kind) or {"type": "function",
                                                 "function": {"name": choice.get("name")}}
    chat["parallel_tool_calls"] = not single


def _tool(t, where: str) -> dict:
    if not isinstance(t, dict):
        raise bad(f"{where} must be an object, got {kind_of(t)}", where, "invalid_type")
    if t.get("type") not in (None, "custom"):
        raise bad(f"{where}: the server tool {clip(repr(t.get('type')))} is not supported by "
                  "tandem serve (client tools only: name, description, input_schema)",
                  f"{where}.type", "unsupported_value")
    if "input_schema" not in t:
        raise bad(f"{where}.input_schema is required", f"{where}.input_schema",
                  "missing_required_parameter")
    function = {"name": t.get("name"), "parameters": t["input_schema"]}
    if t.get("description") is not None:
        function["description"] = t["description"]
    return {"type": "function", "function": function}


def _output_format(config) -> dict | None:
    """`output_config.format` ({"type": "json_schema", "schema"}) as the chat's
    response_format; `effort` is ignored."""
    if config is None:
        return None
    fmt = config.get("format") if isinstance(config, dict) else None
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise bad("output_config.format must be {\"type\": \"json_schema\", \"schema\": ...}",
                  "output_config.format", "invalid_value")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.get("schema")}}


# ----- answers

def usage(stats) -> dict:
    """Anthropic's usage: input_tokens are the prompt tokens evaluated, the ones the KV cache
    held are cache_read_input_tokens (together the prompt)."""
    cached = max(stats.n_prompt - stats.n_prompt_eval, 0)
    return {"input_tokens": stats.n_prompt - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": stats.n_generated}


def stop(req, finish: str, reason: str) -> tuple[str, str | None]:
    """stop_reason and stop_sequence. Which stop string ended an answer the engine does not
    say: named when the request gave one, null when it gave several."""
    if finish == "tool_calls":
        return "tool_use", None
    if reason == "context":
        return "model_context_window_exceeded", None
    if finish == "length":
        return "max_tokens", None
    if reason == "stop":
        return "stop_sequence", req.stop[0] if len(req.stop) == 1 else None
    return "end_turn", None


def tool_use(call: dict) -> dict:
    fn = call["function"]
    return {"type": "tool_use", "id": call["id"], "name": fn["name"],
            "input": json.loads(fn["arguments"])}


def message(req, rid: str, created: int, model: str, answer) -> dict:
    """The whole answer: a `message` with a text block and a tool_use block per call."""
    text, calls, finish = chat_bridge.content(req, answer)
    blocks = ([{"type": "text", "text": text}] if text else []) + [tool_use(c) for c in calls]
    reason, sequence = stop(req, finish, answer.reason)
    return {"id": rid, "type": "message", "role": "assistant", "model": model,
            "content": blocks, "stop_reason": reason, "stop_sequence": sequence,
            "usage": usage(answer.stats)}


class MessageStream:
    """The stream's events: message_start, a text block per run of text, a tool_use block
    per call (its input whole in one input_json_delta), message_delta with the stop reason
    and usage, message_stop; a failure is an `error` event."""

    def __init__(self, req, rid: str, created: int, model: str):
        self.req, self.rid, self.model = req, rid, model
        self.index = -1  # the latest block's
        self.in_text = False

    def start(self) -> list[bytes]:
        message = {"id": self.rid, "type": "message", "role": "assistant", "model": self.model,
                   "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": 0, "output_tokens": 0}}
        return [_event("message_start", message=message), _event("ping")]

    def text(self, text: str) -> list[bytes]:
        out = []
        if not self.in_text:
            out.append(self._open({"type": "text", "text": ""}))
            self.in_text = True
        out.append(_event("content_block_delta", index=self.index,
                          delta={"type": "text_delta", "text": text}))
        return out

    def call(self, call: dict) -> list[bytes]:
        block = tool_use(call)
        out = self._close() + [self._open({**block, "input": {}})]
        out.append(_event("content_block_delta", index=self.index, delta={
            "type": "input_json_delta", "partial_json": call["function"]["arguments"]}))
        return out + [_event("content_block_stop", index=self.index)]

    def end(self, end: chat_bridge.End) -> list[bytes]:
        reason, sequence = stop(self.req, end.finish, end.answer.reason)
        return self._close() + [
            _event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                   usage=usage(end.answer.stats)),
            _event("message_stop")]

    def error(self, exc: ApiError) -> list[bytes]:
        return [chat_bridge.sse_event("error", as_anthropic(exc).body())]

    def _open(self, block: dict) -> bytes:
        self.index += 1
        return _event("content_block_start", index=self.index, content_block=block)

    def _close(self) -> list[bytes]:
        if not self.in_text:
            return []
        self.in_text = False
        return [_event("content_block_stop", index=self.index)]


def _event(kind: str, **fields) -> bytes:
    return chat_bridge.sse_event(kind, {"type": kind, **fields})


WIRE = chat_bridge.wire(message, MessageStream)
