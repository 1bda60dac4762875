"""The HTTP side of `tandem serve`: Starlette routes on uvicorn, in front of the engine thread.

Routes: POST /v1/chat/completions and /v1/completions (server-sent events or one JSON object),
GET /v1/models, GET /health (the /v1-less paths too, as llama-server has them). Every refusal
is an OpenAI error object with a 4xx status; a bug is a 500 with the same shape (and a traceback
on stderr), and the server stays up. Starlette and uvicorn are imported only here and in
serve/connection.py (uvicorn's protocol, with header deadlines and JSON framing errors), which
only `tandem serve` imports: `tandem run` starts as fast as before.
"""
from __future__ import annotations

import asyncio
import hmac
import ipaddress
import socket
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from tandem.errors import ContextOverflowError, RemoteError, TandemError, UsageError
from tandem.serve import protocol, structured
from tandem.serve.connection import IDLE_TIMEOUT, REQUEST_TIMEOUT, guarded
from tandem.serve.protocol import ApiError
from tandem.serve.engine_thread import (
    Defaults,
    EngineWorker,
    Job,
    QueueFull,
    gen_params,
    prepare,
)
from tandem.serve.prompt import Budget, prompt_tokens
from tandem.serve.prompt import check_size as prompt_size_check

MAX_BODY = 4 << 20  # bytes: a whole conversation with files fits; a flood does not
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass
class ServeConfig:
    model_id: str
    defaults: Defaults
    api_key: str | None = None
    max_body: int = MAX_BODY
    budget: Budget | None = None  # None: the target context's size, the longest token unknown
    timeout: float = REQUEST_TIMEOUT  # s for a request's headers, and again for its body
    quiet: bool = False  # no per-request line on stderr
    # after an answer: a note for stderr, once (the command's: where answers are kept)
    notice: Callable[[], str | None] | None = None


class EngineStream(StreamingResponse):
    """An SSE response that cancels its job however it ends: finished, or the client gone
    (Starlette then cancels the stream; this still runs)."""

    def __init__(self, content, cancel, **kwargs):
        super().__init__(content, **kwargs)
        self._cancel = cancel

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._cancel.set()


async def api_error(request: Request, exc: ApiError):
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

async def http_error(request: Request, exc: HTTPException):
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    path = protocol.clip(request.url.path)  # a 100 kB path is not echoed back whole
    message = {404: f"no route {path}",
               405: f"{request.method} is not allowed on {path}"}.get(
        exc.status_code, str(exc.detail))
    err = ApiError(exc.status_code, message, type=kind)
    return JSONResponse(err.body(), status_code=exc.status_code, headers=exc.headers)

async def server_error(request: Request, exc: Exception):
    # Starlette re-raises after this response, so uvicorn logs the traceback on stderr
    err = ApiError(500, f"internal error ({type(exc).__name__}); the server logged it",
                   type="server_error", code="internal_error")
    return JSONResponse(err.body(), status_code=500)


def build_app(worker: EngineWorker, config: ServeConfig) -> Starlette:
    """The routes, as closures over the engine worker and the server's configuration.

    Over 80 lines because the routes share those two and `authorize`: complete(), the long
    one, is a request's whole life (queue, prompt verdict, stream or answer, cancellation),
    which reads best in one place."""
    created = int(time.time())
    budget = config.budget or Budget(worker.pair.n_ctx)
    # one thread tokenizes prompts while the engine thread generates (serve/prompt.py)
    tokenizer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-tokenizer")
    aside = worker.pair.tokenizes_aside

    def authorize(request: Request) -> None:
        if config.api_key is None:
            return
        # the key exactly, compared in constant time (HTTP itself drops the header's outer
        # whitespace: a key cannot end in a space, and --api-key refuses one that does)
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
                token.encode("utf-8", "surrogateescape"), config.api_key.encode()):
            raise ApiError(401, "invalid or missing API key: send 'Authorization: Bearer KEY'",
                           type="authentication_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": 'Bearer realm="tandem"'})

    async def health(request: Request):
        return JSONResponse({"status": "ok", "busy": worker.busy, "waiting": worker.waiting,
                             "queue": worker.capacity, "served": worker.served,
                             "cancelled": worker.cancelled, "last_cancel": worker.last_cancel})

    async def models(request: Request):
        authorize(request)
        return JSONResponse({"object": "list", "data": [
            {"id": config.model_id, "object": "model", "created": created,
             "owned_by": "tandem"}]})

    async def chat(request: Request):
        return await complete(request, "chat")

    async def text(request: Request):
        return await complete(request, "text")

    async def complete(request: Request, kind: str):
        started = time.monotonic()

        def log(status: int, stats=None) -> None:  # one line per request, on stderr
            if not config.quiet:
                print(protocol.log_line(request.method, request.url.path, status,
                                        time.monotonic() - started, stats),
                      file=sys.stderr, flush=True)
            if status == 200 and config.notice is not None:
                note = config.notice()
                if note:
                    config.notice = None  # said once
                    print(f"Note: {note}", file=sys.stderr, flush=True)

        try:
            return await respond(request, kind, log)
        except ApiError as exc:
            log(exc.status)
            raise

    async def respond(request: Request, kind: str, log):
        authorize(request)
        body = await read_json(request, config.max_body, config.timeout)
        req = protocol.parse_chat(body) if kind == "chat" else protocol.parse_text(body)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def sink(what, value):  # the engine thread -> this request's queue, nobody else's
            loop.call_soon_threadsafe(events.put_nowait, (what, value))

        # cheap checks first, then the tokenizer, never in the engine thread when it can be
        # elsewhere: a long prompt's preparation does not delay the answer being generated
        try:
            prompt_size_check(req, budget)
            if worker.waiting >= worker.capacity:
                raise QueueFull(f"{worker.capacity} requests are already waiting")
            if req.constraint is not None:  # compiled here, so the engine thread only looks up
                await loop.run_in_executor(tokenizer, structured.prepare_grammar, req,
                                           worker.pair.target if aside else None)
            if aside:
                tokens = await loop.run_in_executor(
                    tokenizer, prompt_tokens, worker.pair, req, budget)
                gen = gen_params(req, config.defaults)
                make = lambda pair: (tokens, gen)  # noqa: E731 - the job's one line
            else:
                make = partial(prepare, req=req, defaults=config.defaults, budget=budget)
            job = Job(make=make, sink=sink)
            worker.submit(job)
        except QueueFull as exc:
            raise ApiError(429, f"the server is busy: {exc}; retry later",
                           type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": "1"}) from None
        except TandemError as exc:
            _raise_failure(("error", exc))
            raise
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        now = int(time.time())
        watch = asyncio.ensure_future(_disconnected(request))
        handed_over = False  # the stream response owns the job from there
        try:
            # wait for the prompt to be evaluated (or refused) before any header goes out, so
            # a prompt too long is a 400 even for a stream
            first = await _next(events, watch)
            if first is None:
                job.cancel.set()
                log(499)
                return JSONResponse({}, status_code=499)  # nobody is listening
            _raise_failure(first)
            if req.stream:
                watch.cancel()  # from here the stream response watches the connection
                stream = _stream(req, rid, now, config.model_id, events, first, log)
                handed_over = True
                return EngineStream(stream, job.cancel, media_type="text/event-stream",
                                    headers=SSE_HEADERS)
            answer = await _answer(events, watch, first)
            if answer is None:
                job.cancel.set()
                log(499)
                return JSONResponse({}, status_code=499)  # nobody is listening
            log(200, answer.stats)
            return JSONResponse(protocol.completion(req, rid, now, config.model_id,
                                                    answer.text, answer.reason, answer.stats))
        finally:
            watch.cancel()
            if not handed_over:  # answered, refused, or this handler cancelled: stop the job
                job.cancel.set()

    routes = []
    for prefix in ("/v1", ""):
        routes += [Route(prefix + "/chat/completions", chat, methods=["POST"]),
                   Route(prefix + "/completions", text, methods=["POST"]),
                   Route(prefix + "/models", models, methods=["GET"])]
    routes += [Route("/health", health, methods=["GET"]),
               Route("/v1/health", health, methods=["GET"])]
    app = Starlette(routes=routes, exception_handlers={
        ApiError: api_error, HTTPException: http_error, Exception: server_error})
    app.state.tokenizer = tokenizer
    return app


async def _answer(events: asyncio.Queue, watch, first):
    """A whole answer's last event value (the engine's outcome), once the text is through;
    None when the client went away meanwhile."""
    item = first
    while item[0] in ("prefilled", "text"):
        item = await _next(events, watch)
        if item is None:
            return None
    _raise_failure(item)
    return item[1]


async def read_json(request: Request, limit: int, timeout: float = REQUEST_TIMEOUT) -> dict:
    """The body as a JSON object, read up to `limit` bytes (413 beyond, before parsing)
    within `timeout` seconds (408 after: a body trickled in holds a connection)."""
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
        await asyncio.wait_for(read(), timeout)
    except ClientDisconnect:
        raise ApiError(400, "the client went away while sending the body") from None
    except asyncio.TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout:g} s",
                       code="request_timeout", headers={"Connection": "close"}) from None
    return protocol.parse_json(b"".join(chunks))


async def _disconnected(request: Request) -> None:
    """Returns once the client has closed the connection (the body is read by then)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _next(events: asyncio.Queue, watch: asyncio.Future):
    """The job's next item, or None once the client is gone."""
    get = asyncio.ensure_future(events.get())
    await asyncio.wait({get, watch}, return_when=asyncio.FIRST_COMPLETED)
    if get.done():
        return get.result()
    get.cancel()
    return None


def _raise_failure(item) -> None:
    what, value = item
    if what == "error":
        code = "context_length_exceeded" if isinstance(value, ContextOverflowError) else None
        if isinstance(value, (UsageError, ContextOverflowError)):
            message = value.message + (f" ({value.hint})" if value.hint else "")
            raise ApiError(400, message, code=code or "invalid_value")
        if isinstance(value, RemoteError):  # the target's RPC server is gone: a bad gateway
            raise ApiError(502, f"{value.message} ({value.hint})", type="server_error",
                           code="remote_unavailable")
        raise ApiError(500, value.message, type="server_error")
    if what == "failed":
        raise ApiError(500, f"internal error ({type(value).__name__}); the server logged it",
                       type="server_error", code="internal_error")
    if what == "cancelled" and value is None:
        raise ApiError(503, "the server is stopping", type="server_error", code="stopping",
                       headers={"Retry-After": "1"})


async def _stream(req, rid: str, created: int, model: str, events: asyncio.Queue, first,
                  log=lambda status, stats=None: None):
    """Server-sent events: a role chunk (chat), a chunk per piece of text, the finish chunk
    with timings, the usage chunk if asked, then [DONE]. `log` gets the outcome (the status
    is 200 once the headers are out; a client gone mid-stream is a 499)."""
    chunk = partial(protocol.chunk, req, rid, created, model)
    if req.kind == "chat":
        yield protocol.sse(chunk(role=True, text=""))
    calls = structured.reader(req)  # tool calls are read out of the text as it comes
    item = first
    while True:
        what, value = item
        if what == "text":
            for delta in structured.deltas(calls, value):
                yield protocol.sse(chunk(**delta))
        elif what in ("done", "cancelled"):
            log(200 if what == "done" else 499, value.stats)
            for delta in structured.deltas(calls, None):
                yield protocol.sse(chunk(**delta))
            reason = structured.stream_finish(calls, value.reason, protocol.FINISH)
            yield protocol.sse(chunk(reason=reason, stats=value.stats))
            if req.include_usage:
                yield protocol.sse(chunk(stats=value.stats, usage_only=True))
            break
        elif what in ("error", "failed"):  # after the headers: the error goes in the stream
            try:
                _raise_failure(item)
            except ApiError as exc:
                log(exc.status)
                yield protocol.sse(exc.body())
            break
        item = await events.get()
    yield protocol.SSE_DONE


# ----- running it -----

def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind(host: str, port: int) -> socket.socket:
    """A listening socket: a port in use or a host that does not resolve is a UsageError
    with a hint, not uvicorn's log line and exit."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise UsageError(f"cannot listen on {host!r}: {exc.strerror}",
                         "pass --host with an address of this machine, e.g. 127.0.0.1") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port}: {exc.strerror or exc}",
                         "pick another --port (0: any free port), or stop what uses it") from None
    sock.set_inheritable(True)
    return sock


def serve(worker: EngineWorker, config: ServeConfig, sock: socket.socket,
          verbose: bool = False) -> None:
    """Run uvicorn on `sock` until Ctrl-C / SIGTERM; the engine thread is stopped after."""
    import uvicorn

    app = build_app(worker, config)
    server = uvicorn.Server(uvicorn.Config(
        app, http=guarded(config.timeout), loop="asyncio", lifespan="off",
        log_level="info" if verbose else "warning", access_log=verbose,
        timeout_keep_alive=IDLE_TIMEOUT, timeout_graceful_shutdown=5, server_header=False))
    worker.start()
    try:
        server.run(sockets=[sock])
    finally:
        app.state.tokenizer.shutdown(wait=False, cancel_futures=True)
        worker.stop()
        sock.close()
    if not server.started:
        raise TandemError("the HTTP server did not start", "rerun with --verbose for its log")


def listen_note(host: str, sock: socket.socket) -> str:
    port = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/v1"


def warn(message: str) -> None:
    print(f"Warning: {message}", file=sys.stderr)
