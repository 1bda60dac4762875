"""Structured outputs in the OpenAI wire format, without any HTTP: `response_format`
(json_object, json_schema), llama-server's top-level `grammar` (GBNF) and `json_schema`,
`tools` / `tool_choice` / `parallel_tool_calls`, the tool parts of messages (an assistant's
`tool_calls`, `role: "tool"` results), and the tool calls of an answer, whole or streamed.

Every field is checked here into a Constraint (engine/constrain/grammar.py) or tools
(engine/constrain/tools.py), with a 400 naming the field for anything wrong; compiling the
grammar is left to the caller's thread (routes: the tokenizer thread, never the engine's).
"""
from __future__ import annotations

import json
import uuid
from typing import Iterator

from tandem.engine.constrain import bounds
from tandem.engine.constrain.grammar import (
    ANY_OBJECT,
    LIMITS_HINT,
    Constraint,
    GrammarError,
    GrammarState,
    tokenizer_for,
)
from tandem.engine.constrain.tools import NAME_RE, CallReader, Tool, call_grammar, read_calls
from tandem.serve.api_errors import ApiError, bad, clip, kind_of, loads_field

CHOICES = ("none", "auto", "required")


def constraint_of(body: dict) -> tuple[Constraint | None, str | None]:
    """The output constraint a body asks for and the field it came from; at most one."""
    given: list[tuple[Constraint, str]] = []
    fmt = body.get("response_format")
    if fmt is not None:
        found = _response_format(fmt)
        if found is not None:
            given.append(found)
    grammar = body.get("grammar")
    if grammar is not None:
        if not isinstance(grammar, str):
            raise bad(f"'grammar' must be a string (a GBNF grammar), got {kind_of(grammar)}",
                      "grammar", "invalid_type")
        if grammar:  # llama-server's rule: an empty grammar is none
            given.append((Constraint("gbnf", grammar, "grammar"), "grammar"))
    schema = body.get("json_schema")
    if schema is not None:
        given.append((_schema(schema, "json_schema"), "json_schema"))
    if len(given) > 1:
        names = " and ".join(f"'{p}'" for _, p in given)
        raise bad(f"{names} cannot be used together: the output follows one grammar",
                  given[1][1], "conflicting_parameters")
    return given[0] if given else (None, None)


def _response_format(fmt) -> tuple[Constraint, str] | None:
    if not isinstance(fmt, dict):
        raise bad(f"'response_format' must be an object, got {kind_of(fmt)}",
                  "response_format", "invalid_type")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_schema", ANY_OBJECT, "response_format"), "response_format"
    if kind != "json_schema":
        raise bad(f"response_format.type must be one of text, json_object, json_schema; got "
                  f"{clip(repr(kind))}", "response_format.type",
                  "invalid_type" if not isinstance(kind, str) else "invalid_value")
    spec = fmt.get("json_schema")
    where = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise bad(f"'{where}' must be an object ({{\"name\", \"schema\", \"strict\"}}), got "
                  f"{kind_of(spec)}", where, "invalid_type")
    name = spec.get("name")
    if name is not None and not isinstance(name, str):
        raise bad(f"{where}.name must be a string, got {kind_of(name)}", f"{where}.name",
                  "invalid_type")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad(f"{where}.strict must be a boolean, got {kind_of(strict)}",
                  f"{where}.strict", "invalid_type")
    if "schema" not in spec or spec["schema"] is None:  # optional in OpenAI's API
        return Constraint("json_schema", ANY_OBJECT, where), "response_format"
    return _schema(spec["schema"], f"{where}.schema"), f"{where}.schema"


def _schema(schema, where: str) -> Constraint:
    if isinstance(schema, str):  # llama-server's clients sometimes send the schema's text
        schema = loads_field(schema, where)
    if not isinstance(schema, (dict, bool)):
        raise bad(f"'{where}' must be a JSON schema (an object), got {kind_of(schema)}", where,
                  "invalid_type")
    return Constraint("json_schema", json.dumps(schema, ensure_ascii=False), where)


# ----- tools

def tools_of(body: dict) -> tuple[tuple[Tool, ...], str, bool]:
    """(tools, tool_choice, parallel_tool_calls), checked. tool_choice is "none", "auto",
    "required" or a tool's name."""
    for key in ("functions", "function_call"):  # the API's older spelling
        if body.get(key) is not None:
            raise bad(f"'{key}' is not supported by tandem serve: use 'tools' and "
                      "'tool_choice'", key, "unsupported_parameter")
    raw = body.get("tools")
    tools: list[Tool] = []
    if raw is not None:
        if not isinstance(raw, list):
            raise bad(f"'tools' must be an array, got {kind_of(raw)}", "tools", "invalid_type")
        tools = [_tool(t, f"tools[{i}]") for i, t in enumerate(raw)]
        names = [t.name for t in tools]
        for i, name in enumerate(names):
            if name in names[:i]:
                raise bad(f"tools[{i}]: the function name {name!r} is used twice",
                          f"tools[{i}].function.name")
        # one grammar holds every tool: the limits count them together too
        _within_limits({"anyOf": [t.parameters for t in tools]}, "tools")
    choice = _choice(body.get("tool_choice"), tools)
    parallel = body.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise bad(f"'parallel_tool_calls' must be a boolean, got {kind_of(parallel)}",
                  "parallel_tool_calls", "invalid_type")
    return tuple(tools), choice, parallel


def _tool(t, where: str) -> Tool:
    if not isinstance(t, dict):
        raise bad(f"{where} must be an object, got {kind_of(t)}", where, "invalid_type")
    if t.get("type") != "function":
        raise bad(f"{where}.type must be 'function', got {clip(repr(t.get('type')))}",
                  f"{where}.type")
    fn = t.get("function")
    if not isinstance(fn, dict):
        raise bad(f"{where}.function must be an object, got {kind_of(fn)}",
                  f"{where}.function", "invalid_type")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise bad(f"{where}.function.name must be 1 to 64 letters, digits, '_', '-' or '.', "
                  f"got {clip(repr(name))}", f"{where}.function.name")
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise bad(f"{where}.function.description must be a string, got "
                  f"{kind_of(description)}", f"{where}.function.description", "invalid_type")
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad(f"{where}.function.strict must be a boolean", f"{where}.function.strict",
                  "invalid_type")
    params = fn.get("parameters")
    if params is None:  # a function without arguments
        params = {"type": "object", "properties": {}}
    pwhere = f"{where}.function.parameters"
    if not isinstance(params, dict):
        raise bad(f"{pwhere} must be a JSON schema object, got {kind_of(params)}", pwhere,
                  "invalid_type")
    if params.get("type", "object") != "object":
        raise bad(f"{pwhere} must describe an object (\"type\": \"object\"): a call's "
                  f"arguments are named, got type {clip(repr(params.get('type')))}", pwhere)
    _within_limits(params, pwhere)
    return Tool(name, description, params)


def _within_limits(schema, where: str) -> None:
    """A 400 naming the grammar limit a schema passes (before anything compiles it)."""
    over = bounds.in_schema(schema)
    if over:
        raise bad(f"{where} {over.says()} ({LIMITS_HINT})", where, "grammar_limit")


def _choice(choice, tools: list[Tool]) -> str:
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise bad(f"'tool_choice' must be one of {', '.join(CHOICES)} or a function, got "
                      f"{clip(repr(choice))}", "tool_choice")
        name = choice
    elif isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str):
            raise bad("'tool_choice' as an object must be {\"type\": \"function\", "
                      "\"function\": {\"name\": ...}}", "tool_choice", "invalid_type")
        name = fn["name"]
        if name not in {t.name for t in tools}:
            raise bad(f"tool_choice names the function {clip(repr(name))}, which 'tools' does "
                      "not define", "tool_choice")
    else:
        raise bad(f"'tool_choice' must be a string or an object, got {kind_of(choice)}",
                  "tool_choice", "invalid_type")
    if name != "none" and not tools:
        raise bad(f"tool_choice {clip(repr(name))} needs 'tools'", "tool_choice")
    return name


def tool_constraint(tools, choice: str, parallel: bool) -> Constraint | None:
    return None if choice == "none" else call_grammar(tools, choice, parallel)


def compile_check(tools, constraint: Constraint | None, param: str | None) -> None:
    """Compile the request's grammar (cached by its text), or a 400 naming the field. A tool
    grammar that fails is compiled tool by tool to name the tool whose schema is at fault."""
    if constraint is None:
        return
    try:
        constraint.compiled()
        return
    except GrammarError as exc:
        failure = exc
    if constraint.kind == "lark":
        for i, tool in enumerate(tools):
            try:
                Constraint("json_schema", json.dumps(tool.parameters)).compiled()
            except GrammarError as exc:
                raise _refusal(exc, f"tools[{i}].function.parameters", "cannot be used: ") \
                    from None
        param = "tools"
    raise _refusal(failure, param) from None


def prepare_grammar(req, model=None) -> None:
    """Before a request is queued (in the tokenizer thread): its grammar compiled, the
    grammar library's tokenizer for `model` built (once per model, ~1 s for 152k tokens),
    and the grammar's first step taken on a throwaway state: a grammar that compiles but
    fails at once is a 400 here, before a stream's 200 goes out."""
    compile_check(req.tools, req.constraint, req.constraint_param)
    if req.constraint is not None and model is not None:
        tokenizer_for(model)
        try:
            GrammarState(req.constraint, model).first_step()
        except GrammarError as exc:
            raise _refusal(exc, req.constraint_param) from None


def _refusal(exc: GrammarError, param: str | None, lead: str = "") -> ApiError:
    if exc.limit is not None:
        code = "grammar_limit"
    else:
        code = "invalid_grammar" if param == "grammar" else "invalid_schema"
    what = f"{param} {lead}" if lead else ""
    return bad(f"{what}{exc.message}" + (f" ({exc.hint})" if exc.hint else ""), param, code)


# ----- tool parts of messages

def tool_calls_of(calls, where: str) -> list[dict]:
    """An assistant message's `tool_calls`, for the template: arguments as JSON objects."""
    if not isinstance(calls, list) or not calls:
        raise bad(f"{where}.tool_calls must be a non-empty array", f"{where}.tool_calls",
                  "invalid_type")
    out = []
    for j, c in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad(f"{at} must be {{\"id\", \"type\": \"function\", \"function\": "
                      "{\"name\", \"arguments\"}}", at, "invalid_type")
        if c.get("type", "function") != "function":
            raise bad(f"{at}.type must be 'function'", f"{at}.type")
        cid = c.get("id")
        if not isinstance(cid, str) or not cid:
            raise bad(f"{at}.id must be a non-empty string", f"{at}.id", "invalid_type")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            args = loads_field(args, f"{at}.function.arguments") if args.strip() else {}
        if not isinstance(args, dict):
            raise bad(f"{at}.function.arguments must be a JSON object (as a string)",
                      f"{at}.function.arguments", "invalid_type")
        out.append({"id": cid, "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})
    return out


def check_tool_message(m: dict, where: str, open_ids: set[str]) -> str:
    """A `role: "tool"` message's tool_call_id, which must answer a call of the assistant
    message before it."""
    cid = m.get("tool_call_id")
    if not isinstance(cid, str) or not cid:
        raise bad(f"{where}.tool_call_id must be a non-empty string", f"{where}.tool_call_id",
                  "invalid_type" if cid is not None else "missing_required_parameter")
    if cid not in open_ids:
        raise bad(f"{where}: a tool message must answer a call of the assistant message "
                  f"before it; {clip(repr(cid))} is not one of its calls' ids",
                  f"{where}.tool_call_id")
    return cid


# ----- answers

def call_ids() -> Iterator[str]:
    while True:
        yield "call_" + uuid.uuid4().hex[:24]


def reader(req) -> CallReader | None:
    """A stream's reader of tool calls, when the request may get some."""
    if req.kind != "chat" or req.tool_choice == "none":
        return None
    return CallReader([t.name for t in req.tools], call_ids())


def deltas(calls: CallReader | None, text: str | None) -> list[dict]:
    """The stream chunks' fields for a piece of text (None: the end): the text as it comes,
    or, with a tool-call reader, the content and each call whole (with its index) once read."""
    if calls is None:
        return [] if text is None else [{"text": text}]
    out = []
    for kind, value in calls.feed(text) if text is not None else calls.finish():
        # a call's index: its place among the answer's calls (ids are unique)
        out.append({"text": value} if kind == "text" else
                   {"calls": [value.as_openai(calls.calls.index(value))]})
    return out


def stream_finish(calls: CallReader | None, reason: str, finish: dict) -> str:
    """A stream's finish reason: "tool_calls" once calls were read, unless the limit cut it."""
    if calls is not None and calls.calls and finish.get(reason) != "length":
        return "tool_calls"
    return reason


def message(req, text: str, finish: str) -> tuple[dict, str]:
    """A chat answer's message and finish reason: with tools, the calls read out of the text
    (content null when there are only calls, finish_reason "tool_calls"); a call cut by the
    token limit is never a call (its text stays in content, finish_reason "length")."""
    if req.tool_choice == "none":
        return {"role": "assistant", "content": text}, finish
    content, calls, _complete = read_calls(text, [t.name for t in req.tools], call_ids())
    out: dict = {"role": "assistant", "content": content}
    if calls:
        out["tool_calls"] = [c.as_openai() for c in calls]
        if finish != "length":
            finish = "tool_calls"
    return out, finish
