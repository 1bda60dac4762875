"""Other APIs on the chat completions path: Anthropic's Messages (anthropic_api.py) and
OpenAI's Responses (responses_api.py). Each translates its request into a chat completion's
body, which protocol.parse_chat checks as it checks /v1/chat/completions (a refusal names
the field as the client sent it), and completion_flow.complete answers it in the API's own
shapes (a Wire): a whole answer's text and tool calls read as the chat route reads them
(structured.py), a stream read here as parts any wire writes: text, whole tool calls, the
end. So there is one generation path: the same scheduler, prompt cache, grammars and drafts.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Protocol, Sequence

from tandem.serve import protocol, structured
from tandem.serve.api_errors import ApiError
from tandem.serve.completion_flow import Wire
from tandem.serve.job_events import Cancelled, Done, Dropped, Failed, Refused, Text
from tandem.serve.prompt import check_size, prompt_tokens
from tandem.serve.request_flow import raise_failure, stopping_error
from tandem.serve.responses import FINISH, sse

_MESSAGE = re.compile(r"messages\[(\d+)\]")


def parse(body: dict, field: Callable[[str], str]) -> protocol.Request:
    """A translated request checked as a chat completion; `field` names a chat body's path
    as the client sent it (`messages[3].content` -> `input[2].output`)."""
    try:
        return protocol.parse_chat(body)
    except ApiError as exc:
        raise renamed(exc, field) from None


def field_namer(origins: Sequence[str], subs: Sequence[tuple[str, str]]) -> Callable[[str], str]:
    """`field` for parse(): chat message i came from `origins[i]` (a message, a block, the
    system prompt), then each (regex, replacement) of `subs` in turn."""

    def name(path: str) -> str:
        m = _MESSAGE.match(path)
        if m and int(m[1]) < len(origins):
            path = origins[int(m[1])] + path[m.end():]
        for pattern, repl in subs:
            path = re.sub(pattern, repl, path)
        return path

    return name


def renamed(exc: ApiError, field: Callable[[str], str]) -> ApiError:
    """The refusal with its field, in `param` and in the message, as the client sent it. A
    bare name is replaced only quoted ('stop'), a path (messages[3], tools[0].function.name)
    wherever it is written."""
    if exc.param is None or field(exc.param) == exc.param:
        return exc
    head = re.match(r"[^.\[]+(\[\d+\])?", exc.param)[0]

    def spelled(path: str) -> str:
        return path if "[" in path or "." in path else f"'{path}'"

    news = {spelled(old): spelled(field(old)) for old in (exc.param, head)}
    pattern = "|".join(re.escape(old) for old in sorted(news, key=len, reverse=True))
    message = re.sub(pattern, lambda m: news[m[0]], exc.message)
    return ApiError(exc.status, message, type=exc.type, param=field(exc.param), code=exc.code,
                    headers=exc.headers)


async def count_tokens(state, req: protocol.Request) -> int:
    """The prompt's tokens, as the request would evaluate them (template, tools and all),
    tokenized where a completion's prompt is (serve/prompt.py), its checks first."""
    check_size(req, state.budget)
    tokens = await state.on_pair(
        lambda pair: prompt_tokens(pair, req, state.budget, local=state.aside))
    return len(tokens)


def content(req: protocol.Request, answer) -> tuple[str | None, list[dict], str]:
    """A whole answer's text, its tool calls (OpenAI's shape: id, function name and
    arguments as JSON text) and OpenAI's finish reason (stop, length, tool_calls)."""
    message, finish = structured.message(req, answer.text, FINISH.get(answer.reason, "stop"))
    return message["content"], message.get("tool_calls", []), finish


@dataclass(frozen=True)
class End:
    """How a streamed answer ended: the engine's outcome (chat.answer.Answer: text, reason,
    stats) and OpenAI's finish reason (stop, length, tool_calls)."""

    answer: object
    finish: str


class Writer(Protocol):
    """An API's stream: the events (SSE bytes) for its start and for each part."""

    def start(self) -> list[bytes]: ...
    def text(self, text: str) -> list[bytes]: ...
    def call(self, call: dict) -> list[bytes]: ...
    def end(self, end: End) -> list[bytes]: ...
    def error(self, exc: ApiError) -> list[bytes]: ...


def wire(whole: Callable[..., dict], writer: Callable[..., Writer]) -> Wire:
    """The Wire of an API: its whole answer's object, and its stream written by
    `writer(req, rid, created, model)` part by part."""

    async def stream(req, rid: str, created: int, model: str, events, first, log):
        w = writer(req, rid, created, model)
        for chunk in w.start():
            yield chunk
        async for kind, value in parts(req, events, first, log):
            write = {"text": w.text, "call": w.call, "end": w.end, "error": w.error}[kind]
            for chunk in write(value):
                yield chunk

    return Wire(whole, stream)


async def parts(req, events, first, log) -> AsyncIterator[tuple[str, object]]:
    """An answer's events as ("text", str), ("call", OpenAI's tool call with its index),
    then ("end", End) or ("error", ApiError); a stream the server's stop cut ends with both.
    `log` gets the outcome, as the OpenAI stream logs it (request_flow.openai_stream)."""
    calls = structured.reader(req)  # tool calls are read out of the text as it comes
    event = first
    while True:
        if isinstance(event, Text):
            for part in _parts(calls, event.piece):
                yield part
        elif isinstance(event, (Done, Cancelled)):
            answer = event.answer
            log(200 if isinstance(event, Done) else 503, answer.stats)
            for part in _parts(calls, None):
                yield part
            reason = structured.stream_finish(calls, answer.reason, FINISH)
            yield "end", End(answer, FINISH.get(reason, reason))
            if isinstance(event, Cancelled):
                n = answer.stats.n_generated
                yield "error", stopping_error(f": the answer was cut after {n} tokens")
            return
        elif isinstance(event, (Refused, Failed, Dropped)):
            try:
                raise_failure(event)
            except ApiError as exc:
                log(exc.status)
                yield "error", exc
            return
        event = await events.get()


def sse_event(name: str, obj: dict) -> bytes:
    """A named server-sent event (`event:` then `data:`), as both APIs stream them."""
    return b"event: " + name.encode() + b"\n" + sse(obj)


def _parts(calls, text: str | None) -> list[tuple[str, object]]:
    """A piece of text (None: the end) as parts: text as it comes, or, with a tool-call
    reader, the text around the calls and each call whole (structured.deltas)."""
    out = []
    for delta in structured.deltas(calls, text):
        part = ("call", delta["calls"][0]) if "calls" in delta else ("text", delta["text"])
        if part[1]:
            out.append(part)
    return out
