"""Render chat messages into prompt text with the model's own (GGUF) chat template, and into
the prompt's tokens (prompt_tokens: the BOS handled once).

Templates are Jinja run in a sandbox, as transformers does; llama.cpp's built-in renderer
is the fallback for templates the sandbox cannot run, and a plain layout the last resort.
Tools (OpenAI's `tools`, assistant `tool_calls`, `role: "tool"` results) go to a template
that declares the `<tool_call>` format itself (Qwen2.5's); any other gets them as text in
that format (engine/constrain/tools.py, generic_messages).
"""
from __future__ import annotations

import json
import re
import weakref
from datetime import datetime
from typing import Protocol, Sequence

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tandem.errors import UsageError


class TemplateModel(Protocol):
    def chat_template(self) -> str | None: ...
    def apply_builtin_template(self, template: str, messages: Sequence[dict]) -> str | None: ...
    def token_text(self, token: int) -> str: ...
    def is_special(self, token: int) -> bool: ...
    def tokenize(self, text: str, add_special: bool = True,
                 parse_special: bool = True) -> list[int]: ...

    bos: int
    eos: int


def _raise(message: str):
    raise jinja2.TemplateError(message)


def _env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    # transformers' tojson (templates were written for it): plain json.dumps, not Jinja's
    # HTML-escaping, key-sorting one, so a tool's schema reads as the client wrote it
    env.filters["tojson"] = lambda value, indent=None, separators=None, sort_keys=False, \
        ensure_ascii=False: json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                                       separators=separators, sort_keys=sort_keys)
    return env


def render(model: TemplateModel, messages: Sequence[dict], add_generation_prompt: bool = True,
           tools: Sequence[dict] | None = None) -> str:
    template = model.chat_template()
    simple = not tools and all(isinstance(m.get("content"), str) and m["role"] != "tool"
                               and not m.get("tool_calls") for m in messages)
    if template:
        try:
            # `tools` only when there are some: templates test `tools is defined`
            extra = {"tools": list(tools)} if tools else {}
            return _env().from_string(template).render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=_text(model, model.bos),
                eos_token=_text(model, model.eos),
                **extra,
            )
        except (jinja2.TemplateError, TypeError, ValueError) as exc:
            if not simple:  # llama.cpp's renderer knows no tools: say why it failed
                raise UsageError(f"the model's chat template failed on this conversation: "
                                 f"{str(exc)[:200]}", "check the messages' roles and order") from None
            builtin = model.apply_builtin_template(template, messages)
            if builtin is not None:
                return builtin
    return plain(messages)


_PROBE = "tandem_probe_fn"
_FORMATS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def tool_format(model: TemplateModel) -> str:
    """"native" when the model's template renders tools, tool calls and tool results in the
    `<tool_call>` format itself (Qwen2.5's), else "generic". Found by rendering a probe."""
    try:
        return _FORMATS[model]
    except (KeyError, TypeError):
        pass
    template = model.chat_template() or ""
    found = "generic"
    if "<tool_call>" in template:
        call = {"id": "c0", "type": "function",
                "function": {"name": _PROBE + "_call", "arguments": {"a": 1}}}
        msgs = [{"role": "user", "content": "x"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c0", "content": _PROBE + "_result"}]
        tools = [{"type": "function", "function": {
            "name": _PROBE, "description": "", "parameters": {"type": "object"}}}]
        try:
            text = _env().from_string(template).render(
                messages=msgs, tools=tools, add_generation_prompt=True,
                bos_token=_text(model, model.bos), eos_token=_text(model, model.eos))
        except (jinja2.TemplateError, TypeError, ValueError):
            text = ""
        if all(p in text for p in (_PROBE, _PROBE + "_call", _PROBE + "_result")):
            found = "native"
    try:
        _FORMATS[model] = found
    except TypeError:  # a model that cannot be weakly referenced: found again next time
        pass
    return found


def for_template(model: TemplateModel, messages: Sequence[dict],
                 tools: Sequence[dict] | None) -> tuple[list[dict], list[dict] | None]:
    """The messages and tools as this model's template takes them: unchanged for a template
    with the tool format, written as text (tools.generic_messages) for any other."""
    uses = tools or any(m["role"] == "tool" or m.get("tool_calls") for m in messages)
    if not uses or tool_format(model) == "native":
        return list(messages), list(tools) if tools else None
    from tandem.engine.constrain.tools import generic_messages

    return generic_messages(messages, tools), None


def plain(messages: Sequence[dict]) -> str:
    """A template-free layout for models without a chat template (base models)."""
    return "\n\n".join(m["content"] for m in messages)


def _text(model: TemplateModel, token: int) -> str:
    return model.token_text(token) if token >= 0 else ""


# Private-use code points around each message's content while the template renders: where they
# land tells which characters of the prompt are the user's (they never reach the tokenizer).
OPEN, CLOSE = "\U000F0000", "\U000F0001"


def _marked(value, keys: bool = True):
    """`value` with each non-empty string (and each key, with `keys`) between OPEN and CLOSE."""
    if isinstance(value, str):
        return OPEN + value + CLOSE if value else value
    if isinstance(value, dict):
        return {(_marked(k) if keys and isinstance(k, str) else k): _marked(v, keys)
                for k, v in value.items()}
    if isinstance(value, list):
        return [_marked(v, keys) for v in value]
    return value


def _mark_message(m: dict) -> dict:
    """A message with what its sender wrote marked: the content, and a call's id, name and
    arguments, a result's call id. Roles and types stay as they are (templates test them)."""
    out = dict(m)
    if isinstance(m.get("content"), str):
        out["content"] = OPEN + m["content"] + CLOSE
    for key in ("tool_call_id", "name"):
        if isinstance(m.get(key), str):
            out[key] = _marked(m[key])
    if m.get("tool_calls"):
        out["tool_calls"] = [{**c, "id": _marked(c.get("id")), "function": {
            "name": _marked(c["function"]["name"]),
            "arguments": _marked(c["function"]["arguments"])}} for c in m["tool_calls"]]
    return out


def _mark_tool(tool: dict) -> dict:
    return {**tool, "function": _marked(tool["function"], keys=False) | {
        "parameters": _marked(tool["function"].get("parameters"))}}


def user_strings(messages: Sequence[dict], tools: Sequence[dict] | None = None) -> list[str]:
    """Every string a request brought (contents, calls, results, tool definitions), keys too."""
    found: list[str] = []

    def walk(value):
        if isinstance(value, str):
            found.append(value)
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(k)
                walk(v)
        elif isinstance(value, list):
            for v in value:
                walk(v)

    for m in messages:
        walk([m.get("content"), m.get("tool_call_id"), m.get("name"), m.get("tool_calls")])
    walk(list(tools or []))
    return found


def regions(model: TemplateModel, messages: Sequence[dict],
            tools: Sequence[dict] | None = None) -> list[tuple[str, bool]] | None:
    """The rendered prompt as (text, is_content) runs: content is what the messages brought,
    the rest is the template's own text. Found by rendering each content between OPEN and
    CLOSE (each string of a tool call, a result and a tool definition too); None when that
    cannot be traced: the template moved, repeated or dropped a mark, or changed the content
    (a trim, a split), so that the marked rendering, marks removed, is not the plain one."""
    if any(OPEN in t or CLOSE in t for t in user_strings(messages, tools)):
        return None
    try:
        marked = render(model, [_mark_message(m) for m in messages],
                        tools=[_mark_tool(t) for t in tools] if tools else None)
    except UsageError:  # the template tests what the marks changed: not traceable
        return None
    runs: list[tuple[str, bool]] = []
    inside = False
    for i, part in enumerate(re.split(f"([{OPEN}{CLOSE}])", marked)):
        if i % 2:  # a mark: it must open outside and close inside
            if (part == OPEN) == inside:
                return None
            inside = not inside
        elif part:
            runs.append((part, inside))
    if inside or "".join(t for t, _ in runs) != render(model, messages, tools=tools):
        return None
    return runs


def _specials(model, text: str) -> list[tuple[int, int, int]]:
    """(start, end, token) of each special token llama.cpp's parser finds in `text` alone."""
    found, cursor = [], 0
    for tok in model.tokenize(text, add_special=False, parse_special=True):
        if model.is_special(tok):
            piece = model.token_text(tok)
            at = text.find(piece, cursor)
            if at < 0:
                continue
            found.append((at, at + len(piece), tok))
            cursor = at + len(piece)
    return found


def tokens_as_data(model, runs: Sequence[tuple[str, bool]]) -> list[int]:
    """The tokens of the whole prompt, special tokens parsed only in the template's runs.

    llama.cpp's own parser splits a text at its special tokens and tokenizes each piece of
    raw text between them on its own; this does the same with the specials of the template
    runs only, so a prompt without special-token text in its content gets exactly the tokens
    it got before, and special-token text in content stays text."""
    text = "".join(t for t, _ in runs)
    cuts: list[tuple[int, int, int]] = []
    offset = 0
    for run, is_content in runs:
        if not is_content:
            cuts += [(a + offset, b + offset, tok) for a, b, tok in _specials(model, run)]
        offset += len(run)
    tokens: list[int] = []
    pos = 0
    for a, b, tok in cuts:
        if a > pos:
            tokens += model.tokenize(text[pos:a], add_special=False, parse_special=False)
        tokens.append(tok)
        pos = b
    if pos < len(text):
        tokens += model.tokenize(text[pos:], add_special=False, parse_special=False)
    return tokens


def prompt_tokens(model, messages: Sequence[dict], raw: bool = False,
                  tools: Sequence[dict] | None = None) -> list[int]:
    """The prompt's tokens: the messages rendered with the model's template (`raw`: the
    plain layout), with the model's BOS in front where it wants one and the template did not
    write it already (never a second one).

    With a template, message content is data: special-token text in it ("<|im_end|>",
    "</s>") is tokenized as text, never as control tokens. `raw` is a prompt the caller
    wrote whole (run --raw, /v1/completions): its special tokens are parsed, as llama.cpp's
    tools parse a raw prompt. `tools`: OpenAI's tool definitions, for the template (or the
    generic format's system message); their text is data as the content is."""
    if raw:
        text = plain(messages)
        tokens = model.tokenize(text, add_special=False, parse_special=True)
    else:
        messages, tools = for_template(model, messages, tools)
        runs = regions(model, messages, tools)
        if runs is None:
            text = render(model, messages, tools=tools)
            if any(_specials(model, t) for t in user_strings(messages, tools)):
                raise UsageError(
                    "a message holds special-token text (such as the template's own "
                    "markers), and this model's chat template changes message content in a "
                    "way tandem cannot keep apart from its own",
                    "remove the special-token text from the message, or use --raw to write "
                    "the whole prompt yourself")
            tokens = model.tokenize(text, add_special=False, parse_special=True)
        else:
            text = "".join(t for t, _ in runs)
            tokens = tokens_as_data(model, runs)
    bos_text = _text(model, model.bos)
    add_bos = model.add_bos and not (bos_text and text.startswith(bos_text)
                                     and tokens[:1] == [model.bos])
    return [model.bos] + tokens if add_bos else tokens
