"""One request's side of its exchange with the scheduler, under Starlette: the body read
within limits, the client's disconnect watched, the job's events read (an answer whole, or as
server-sent events), and the engine's failures turned into the API's errors.
serve/completion_flow.py and serve/routes.py compose these into the routes."""
from __future__ import annotations

import asyncio
from collections import deque
from functools import partial

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, StreamingResponse

from tandem.errors import ContextOverflowError, RemoteError, TandemError, UsageError
from tandem.serve import llama_api, protocol, responses, structured
from tandem.serve.api_errors import ApiError
from tandem.serve.connection import REQUEST_TIMEOUT
from tandem.serve.job_events import (Cancelled, Done, Dropped, Failed, JobEvent, Prefilled,
                                     Refused, Text)
from tandem.serve.scheduler import QueueFull


PARSE_INLINE = 64 << 10  # bytes: a body this small is parsed in the event loop


class EngineStream(StreamingResponse):
    """An SSE response that cancels its job however it ends: finished, or the client gone
    (Starlette then cancels the stream; this still runs). The chunks made while more of the
    job's `events` wait go out in one write (joined())."""

    def __init__(self, content, cancel, events: asyncio.Queue, **kwargs):
        super().__init__(joined(content, events), **kwargs)
        self._cancel = cancel

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._cancel.set()


def handoff(loop: asyncio.AbstractEventLoop, events: asyncio.Queue):
    """A job's sink: the engine thread's events into `events`, on the event loop's thread,
    with one wake-up for all that came while the loop had not yet taken the previous ones
    (a token each from several slots: one self-pipe write, not one per event)."""
    pending: deque = deque()
    woken = [False]

    def drain():
        woken[0] = False  # first: an event added from here on wakes the loop again
        while pending:
            events.put_nowait(pending.popleft())

    def sink(event) -> None:
        pending.append(event)
        if not woken[0]:
            woken[0] = True
            loop.call_soon_threadsafe(drain)
    return sink


async def joined(chunks, events: asyncio.Queue):
    """A stream's chunks, those made while more events wait joined into one write: where the
    engine runs ahead of this thread, each write (Starlette, h11, a send) carries several
    tokens instead of one, and the client's text is the same bytes."""
    held: list[bytes] = []
    async for chunk in chunks:
        held.append(chunk)
        if events.empty():  # the stream would wait for the engine: send what it made
            yield b"".join(held)
            held = []
    if held:
        yield b"".join(held)


def busy(exc: QueueFull) -> ApiError:
    return ApiError(429, f"the server is busy: {exc}; retry later", type="rate_limit_error",
                    code="queue_full", headers={"Retry-After": "1"})


async def whole_answer(events: asyncio.Queue, watch, first: JobEvent):
    """A whole answer (chat.answer.Answer), once the text is through; None when the client
    went away meanwhile."""
    event = first
    while isinstance(event, (Prefilled, Text)):
        event = await next_event(events, watch)
        if event is None:
            return None
    raise_failure(cut(event))
    return event.answer


def cut(event: JobEvent) -> JobEvent:
    """An end as a client still waiting for it sees it: only the server's stop cancels
    such an answer (a client that went away was not waiting), and a part of an answer is
    not given as if it were whole."""
    return Dropped() if isinstance(event, Cancelled) else event


async def read_json(request: Request, limit: int, timeout: float = REQUEST_TIMEOUT,
                    stopping: asyncio.Event | None = None) -> dict:
    """The body as a JSON object, read up to `limit` bytes (413 beyond, before parsing)
    within `timeout` seconds (408 after: a body trickled in holds a connection), or until
    `stopping` is set (503: the server's stop does not wait for a body)."""
    ctype = request.headers.get("content-type")
    if ctype is not None and ctype.split(";")[0].strip().lower() != "application/json":
        raise ApiError(415, f"the body must be application/json, got {ctype!r} (curl: add "
                       "-H 'Content-Type: application/json')", code="unsupported_media_type")
    declared = request.headers.get("content-length")
    too_big = ApiError(413, f"the request body is over {limit >> 20} MiB",
                       code="request_too_large")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks: list[bytes] = []

    async def read() -> None:
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_big
            chunks.append(chunk)

    try:
        await asyncio.wait_for(unless_stopping(read(), stopping), timeout)
    except ClientDisconnect:
        raise ApiError(400, "the client went away while sending the body") from None
    except asyncio.TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout:g} s",
                       code="request_timeout", headers={"Connection": "close"}) from None
    raw = b"".join(chunks)
    if len(raw) <= PARSE_INLINE:
        return protocol.parse_json(raw)
    # a large body is parsed beside the event loop (a hostile one can take a second or two)
    return await asyncio.get_running_loop().run_in_executor(None, protocol.parse_json, raw)


async def unless_stopping(work, stopping: asyncio.Event | None):
    """`work`'s value, or the 503 of the server's stop once `stopping` is set first."""
    if stopping is None:
        return await work
    task, stop = asyncio.ensure_future(work), asyncio.ensure_future(stopping.wait())
    try:
        await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        raise stopping_error()
    return task.result()


async def disconnected(request: Request) -> None:
    """Returns once the client has closed the connection (the body is read by then)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def next_event(events: asyncio.Queue, watch: asyncio.Future) -> JobEvent | None:
    """The job's next event, or None once the client is gone."""
    if not events.empty():  # the engine is ahead: no task and no wait (a token each)
        return events.get_nowait()
    get = asyncio.ensure_future(events.get())
    await asyncio.wait({get, watch}, return_when=asyncio.FIRST_COMPLETED)
    if get.done():
        return get.result()
    get.cancel()
    return None


def raise_failure(event: JobEvent) -> None:
    """A job's end that is no answer (Refused, Failed, Dropped) raised as the API's error;
    any other event passes."""
    if isinstance(event, Refused):
        raise refusal(event.error)
    if isinstance(event, Failed):
        raise ApiError(500, f"internal error ({type(event.error).__name__}); the server "
                       "logged it", type="server_error", code="internal_error")
    if isinstance(event, Dropped):
        raise stopping_error()


def refusal(exc: TandemError) -> ApiError:
    """A TandemError as the API's error: the request's fault a 400, the target's RPC
    server gone a 502, anything else a 500."""
    code = "context_length_exceeded" if isinstance(exc, ContextOverflowError) else None
    if isinstance(exc, (UsageError, ContextOverflowError)):
        message = exc.message + (f" ({exc.hint})" if exc.hint else "")
        return ApiError(400, message, code=code or "invalid_value",
                        param=getattr(exc, "param", None))
    if isinstance(exc, RemoteError):  # the target's RPC server is gone: a bad gateway
        return ApiError(502, f"{exc.message} ({exc.hint})", type="server_error",
                        code="remote_unavailable")
    return ApiError(500, exc.message, type="server_error")


def stopping_error(detail: str = "") -> ApiError:
    return ApiError(503, "the server is stopping" + detail, type="server_error",
                    code="stopping", headers={"Retry-After": "1"})


async def openai_stream(req, rid: str, created: int, model: str, events: asyncio.Queue, first,
                  log=lambda status, stats=None: None):
    """Server-sent events: a role chunk (chat), a chunk per piece of text, the finish chunk
    with timings, the usage chunk if asked, then [DONE]. `log` gets the outcome (the status
    is 200 once the headers are out). Cut by the server's stop, the answer so far ends the
    same way with an error event before [DONE] (logged as a 503)."""
    chunk = partial(responses.chunk, req, rid, created, model)
    if req.kind == "chat":
        yield responses.sse(chunk(role=True, text=""))
    calls = structured.reader(req)  # tool calls are read out of the text as it comes
    event = first
    while True:
        if isinstance(event, Text):
            for delta in structured.deltas(calls, event.piece):
                yield responses.sse(chunk(**delta))
        elif isinstance(event, (Done, Cancelled)):
            answer = event.answer
            log(200 if isinstance(event, Done) else 503, answer.stats)
            for delta in structured.deltas(calls, None):
                yield responses.sse(chunk(**delta))
            reason = structured.stream_finish(calls, answer.reason, responses.FINISH)
            yield responses.sse(chunk(reason=reason, stats=answer.stats,
                                      tokens=responses.returned_tokens(req, answer)))
            if req.include_usage:
                yield responses.sse(chunk(stats=answer.stats, usage_only=True))
            if isinstance(event, Cancelled):
                yield stopped_event(answer)
            break
        elif isinstance(event, (Refused, Failed)):  # after the headers: in the stream
            yield failure_event(event, log)
            break
        event = await events.get()
    yield responses.SSE_DONE


async def llama_stream(events: asyncio.Queue, first, final, log, n_prompt: int):
    """llama-server's native stream (/completion, /infill): `data: {"content", "stop":
    false}` per piece of text, then `final(outcome)` with "stop": true, and no [DONE]; cut
    by the server's stop, an error event after it."""
    event, n = first, 0
    while True:
        if isinstance(event, Text):
            n += 1
            yield responses.sse(llama_api.partial(event.piece, n_prompt, n))
        elif isinstance(event, (Done, Cancelled)):
            log(200 if isinstance(event, Done) else 503, event.answer.stats)
            yield responses.sse(final(event.answer))
            if isinstance(event, Cancelled):
                yield stopped_event(event.answer)
            return
        elif isinstance(event, (Refused, Failed)):
            yield failure_event(event, log)
            return
        event = await events.get()


async def whole_text(events: asyncio.Queue, watch, first: JobEvent) -> tuple[str, object] | None:
    """An answer's released text and the answer (chat.answer.Answer), once it is through;
    None when the client went away meanwhile."""
    pieces: list[str] = []
    event = first
    while isinstance(event, (Prefilled, Text)):
        if isinstance(event, Text):
            pieces.append(event.piece)
        event = await next_event(events, watch)
        if event is None:
            return None
    raise_failure(cut(event))
    return "".join(pieces), event.answer


def stopped_event(answer) -> bytes:
    """The error event of a stream the server's stop cut: a stream is only ever cancelled so
    while its client reads it (a client that goes away ends the stream's task first)."""
    n = answer.stats.n_generated
    return responses.sse(stopping_error(f": the answer was cut after {n} tokens").body())


def failure_event(event: JobEvent, log) -> bytes:
    """A failure once the headers are out: its error object as the stream's last event."""
    try:
        raise_failure(event)
    except ApiError as exc:
        log(exc.status)
        return responses.sse(exc.body())
    return b""


def client_gone(job, log) -> JSONResponse:
    """The answer to nobody: the job stopped, the request logged as a 499."""
    job.cancel.set()
    log(499)
    return JSONResponse({}, status_code=499)


