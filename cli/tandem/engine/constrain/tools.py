"""Tool calls in one format: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
one block per call (Qwen2.5's and Hermes' own format, which many models were trained on).

Here: the grammar that constrains a call to the tools' names and parameter schemas (llguidance's
Lark-like syntax with inline %json schemas), the reading of an output back into calls, as a
whole or piece by piece while it streams, and the generic prompt for a chat template that
declares no tool format (the tools described in a system message, earlier calls and their
results written as text in that same format), as llama-server falls back to its own.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Iterator, Sequence

from tandem.engine.constrain.grammar import JSON_OPTIONS, Constraint

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
# OpenAI's rule for function names (and '.'); fullmatch it ('$' matches before a final "\n")
NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")


@dataclass(frozen=True)
class Tool:
    """One function the model may call: its name, its description, and the JSON schema of
    its arguments (an object schema)."""

    name: str
    description: str | None = None
    parameters: dict = field(default_factory=lambda: {"type": "object", "properties": {}})

    def as_openai(self) -> dict:
        """The tool as the OpenAI API spells it: what chat templates take as `tools`."""
        function: dict = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: dict

    def as_openai(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function",
               "function": {"name": self.name,
                            "arguments": json.dumps(self.arguments, ensure_ascii=False)}}
        return out if index is None else {"index": index, **out}


def _call_schema(tool: Tool) -> dict:
    # "name" first: the model writes {"name": ..., "arguments": ...}, every key forced.
    # The arguments' schema is a resource of its own ($id), so its "#/$defs/..." references
    # (pydantic's and zod's output) resolve in it, not in the call's schema around it
    arguments = tool.parameters if "$id" in tool.parameters else \
        {**tool.parameters, "$id": f"urn:tandem:tool:{tool.name}"}
    return {"type": "object", "properties": {"name": {"const": tool.name},
                                             "arguments": arguments},
            "required": ["name", "arguments"], "additionalProperties": False}


def call_grammar(tools: Sequence[Tool], choice: str, parallel: bool = True) -> Constraint:
    """The output's grammar for `choice`: "required" (one call or more of any tool), a tool's
    name (exactly one call of it) or "auto" (free text, in which every call, once its
    `<tool_call>` is written, follows the schemas). Without `parallel`, at most one call."""
    chosen = [t for t in tools if t.name == choice] if choice not in ("auto", "required") \
        else list(tools)
    schema = {"anyOf": [_call_schema(t) for t in chosen], "x-guidance": JSON_OPTIONS}
    if len(chosen) == 1:
        schema = {**_call_schema(chosen[0]), "x-guidance": JSON_OPTIONS}
    body = "body: %json " + json.dumps(schema, ensure_ascii=False)
    open_, close = json.dumps(OPEN_TAG + "\n"), json.dumps("\n" + CLOSE_TAG)
    many = parallel and choice in ("auto", "required")
    if choice == "auto":
        # text runs free until it writes <tool_call> (a lazy lexeme ends there); from there
        # the call follows the schemas. Text after the last call is free again, and never
        # holds another <tool_call> that the schemas did not check
        lines = ["start: " + ("call* tail" if many else "call? tail"),
                 "tail: TEXT",
                 f"TEXT: /(.|\\n)*/ & ~/(?s:.*){re.escape(OPEN_TAG)}(?s:.*)/",
                 f"call_hd[lazy]: TEXT {json.dumps(OPEN_TAG)}",
                 f"call: call_hd \"\\n\" body {close}"]
    else:
        lines = ["start: call" + (" (\"\\n\" call)*" if many else ""),
                 f"call: {open_} body {close}"]
    return Constraint("lark", "\n".join(["%llguidance {}", *lines, body]), "tools")


class CallReader:
    """Reads an output into text and tool calls as it arrives: `feed` gives the events the
    new text completes, ("text", str) and ("call", ToolCall); `finish` the rest. Text that
    may be the start of `<tool_call>` is held back until it is known not to be; a block that
    does not parse as a call of one of the tools is text. Whitespace between and around calls
    is dropped once a call was read (the format's own newlines)."""

    def __init__(self, names: Sequence[str], ids: Iterator[str]):
        self.names = set(names)
        self._ids = ids
        self._buf = ""
        self._inside = False
        self._space = ""  # whitespace held until it is known not to border a call
        self._after_call = False
        self.calls: list[ToolCall] = []
        self.complete = True  # no call is left open

    def feed(self, text: str) -> list[tuple[str, object]]:
        self._buf += text
        out: list[tuple[str, object]] = []
        while True:
            if not self._inside:
                at = self._buf.find(OPEN_TAG)
                if at < 0:
                    keep = _partial_tag(self._buf)
                    self._text(self._buf[:len(self._buf) - keep], out)
                    self._buf = self._buf[len(self._buf) - keep:]
                    return out
                self._text(self._buf[:at], out)
                self._space = ""  # the whitespace before a call is the format's
                self._buf, self._inside = self._buf[at + len(OPEN_TAG):], True
            else:
                at = self._buf.find(CLOSE_TAG)
                if at < 0:
                    return out
                body, self._buf = self._buf[:at], self._buf[at + len(CLOSE_TAG):]
                self._inside = False
                call = self._call(body)
                if call is None:
                    self._text(OPEN_TAG + body + CLOSE_TAG, out)
                else:
                    self.calls.append(call)
                    self._after_call = True
                    out.append(("call", call))

    def finish(self) -> list[tuple[str, object]]:
        """The held text: an unfinished call's block is text, and `complete` is False."""
        out: list[tuple[str, object]] = []
        rest = (OPEN_TAG if self._inside else "") + self._buf
        self.complete = not self._inside
        self._buf, self._inside = "", False
        self._text(rest, out)
        if self._space and not self.calls:
            out.append(("text", self._space))
        self._space = ""
        return out

    def _text(self, text: str, out: list) -> None:
        if not text:
            return
        if not text.strip():  # whitespace waits: it may border a call
            self._space += text
            return
        text, self._space = self._space + text, ""
        if self._after_call:
            text, self._after_call = text.lstrip(), False
        out.append(("text", text))

    def _call(self, body: str) -> ToolCall | None:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or obj.get("name") not in self.names:
            return None
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        return ToolCall(next(self._ids), obj["name"], args)


def _partial_tag(text: str) -> int:
    """How many characters at the end of `text` could begin OPEN_TAG."""
    for n in range(min(len(text), len(OPEN_TAG) - 1), 0, -1):
        if OPEN_TAG.startswith(text[-n:]):
            return n
    return 0


def read_calls(text: str, names: Sequence[str], ids: Iterator[str]):
    """(content, calls, complete) of a whole output; content None when only calls."""
    reader = CallReader(names, ids)
    events = reader.feed(text) + reader.finish()
    content = "".join(v for k, v in events if k == "text")
    if reader.calls:
        content = content.strip() or None
    return content, reader.calls, reader.complete


# ----- the generic prompt: for a template that declares no tool format

GENERIC_INSTRUCTIONS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    "{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>")


def call_text(name: str, arguments) -> str:
    """One call as the model writes it in this format."""
    return (f"{OPEN_TAG}\n" + json.dumps({"name": name, "arguments": arguments},
                                         ensure_ascii=False) + f"\n{CLOSE_TAG}")


def generic_messages(messages: Sequence[dict], tools: Sequence[dict] | None) -> list[dict]:
    """The conversation with its tool parts written as text, for any chat template: the tools
    in a system message (the first one's text, then them), an assistant's calls as call
    blocks after its text, and consecutive tool results as one user message of
    <tool_response> blocks."""
    out: list[dict] = []
    for m in messages:
        if m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
        elif m.get("tool_calls"):
            parts = [m["content"]] if m.get("content") else []
            parts += [call_text(c["function"]["name"], c["function"]["arguments"])
                      for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(parts)})
        else:
            out.append({"role": m["role"], "content": m["content"] or ""})
    out = [{"role": m["role"], "content": m["content"]} for m in out]
    if tools:
        listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        text = GENERIC_INSTRUCTIONS.format(tools=listed)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out
