"""The HTTP side of `tandem serve`: Starlette routes on uvicorn, in front of the engine thread.

Routes: POST /v1/chat/completions and /v1/completions (server-sent events or one JSON object),
GET /v1/models, GET /health (the /v1-less paths too, as llama-server has them), and
llama-server's own for editors: POST /infill, /completion, /tokenize, /detokenize,
/apply-template, GET /props (serve/llama_api.py). Every refusal
is an OpenAI error object with a 4xx status; a bug is a 500 with the same shape (and a traceback
on stderr), and the server stays up. Starlette and uvicorn are imported only here, in
serve/request_flow.py (a request's side of the engine thread) and serve/connection.py
(uvicorn's protocol, with header deadlines and JSON framing errors), which only `tandem serve`
imports: `tandem run` starts as fast as before.
"""
from __future__ import annotations

import asyncio
import hmac
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
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from tandem.errors import TandemError
from tandem.serve import llama_api, protocol, responses, structured
from tandem.serve.connection import IDLE_TIMEOUT, REQUEST_TIMEOUT, guarded
from tandem.serve.protocol import ApiError
from tandem.serve.metrics import CONTENT_TYPE
from tandem.serve.engine_thread import (
    Defaults,
    EngineThread,
    GenerationJob,
    QueueFull,
    gen_params,
    prepare,
)
from tandem.serve.prompt import PromptBudget, request_tokens
from tandem.serve.prompt import check_size as prompt_size_check
from tandem.serve.prompt import check_text_size as prompt_text_check
from tandem.serve.request_flow import (
    EngineStream,
    busy,
    client_gone,
    disconnected,
    llama_stream,
    next_event,
    openai_stream,
    raise_failure,
    read_json,
    whole_answer,
    whole_text,
)

MAX_BODY = 4 << 20  # bytes: a whole conversation with files fits; a flood does not
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass
class ServeConfig:
    model_id: str
    defaults: Defaults
    api_key: str | None = None
    max_body: int = MAX_BODY
    budget: PromptBudget | None = None  # None: the target context's size, the longest token unknown
    timeout: float = REQUEST_TIMEOUT  # s for a request's headers, and again for its body
    quiet: bool = False  # no per-request line on stderr
    cors: tuple[str, ...] = ()  # origins a browser page may call from (--cors)
    # after an answer: a note for stderr, once (the command's: where answers are kept)
    notice: Callable[[], str | None] | None = None


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


def build_app(engine: EngineThread, config: ServeConfig) -> Starlette:
    """The routes, as closures over the engine thread and the server's configuration.

    Over 80 lines because the routes share those two and `authorize`: complete(), the long
    one, is a request's whole life (queue, prompt verdict, stream or answer, cancellation),
    which reads best in one place."""
    created = int(time.time())
    budget = config.budget or PromptBudget(engine.pair.n_ctx)
    # one thread tokenizes prompts while the engine thread generates (serve/prompt.py); the
    # utility routes (/tokenize, /detokenize, /apply-template) have their own, so a client's
    # bulk tokenizing never holds back a completion's prompt
    tokenizer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-tokenizer")
    utility = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-utility")
    aside = engine.pair.tokenizes_aside
    # read once, before the engine thread runs: a remote pair's pipe is the engine's then
    fim, facts = engine.pair.fim_tokens, engine.pair.props()
    sampling = config.defaults.sampling

    async def on_pair(fn):
        """`fn(pair)` where it may run: the utility thread for a local pair, the engine
        thread (between answers) for a remote one, whose engine process takes one call at a time."""
        loop = asyncio.get_running_loop()
        if aside:
            return await loop.run_in_executor(utility, fn, engine.pair)
        done: asyncio.Future = loop.create_future()

        def sink(what, value):
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result((what, value)))
        try:
            engine.submit(GenerationJob(make=None, sink=sink, call=fn))
        except QueueFull as exc:
            raise busy(exc) from None
        what, value = await done
        raise_failure((what, value))
        return value

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
        return JSONResponse({"status": "ok", "busy": engine.busy, "waiting": engine.waiting,
                             "queue": engine.capacity, "served": engine.served,
                             "cancelled": engine.cancelled, "last_cancel": engine.last_cancel})

    async def metrics(request: Request):
        authorize(request)
        text = engine.metrics.prometheus(processing=int(engine.busy), deferred=engine.waiting)
        return PlainTextResponse(text, media_type=CONTENT_TYPE)

    async def models(request: Request):
        authorize(request)
        return JSONResponse({"object": "list", "data": [
            {"id": config.model_id, "object": "model", "created": created,
             "owned_by": "tandem"}]})

    async def chat(request: Request):
        return await complete(request, "chat")

    async def text(request: Request):
        return await complete(request, "text")

    async def infill(request: Request):
        return await complete(request, "infill")

    async def native_completion(request: Request):
        return await complete(request, "native")

    async def tokenize(request: Request):
        authorize(request)
        body = await read_json(request, config.max_body, config.timeout)
        content, add, parse, pieces = llama_api.tokenize_request(body)
        try:
            prompt_text_check([c for c in (content if isinstance(content, list) else [content])
                               if isinstance(c, str)], budget, "content")
        except TandemError as exc:
            raise_failure(("error", exc))
        ids = await on_pair(lambda pair: llama_api.tokenize_mixed(pair, content, add, parse))
        if not pieces:
            return JSONResponse({"tokens": ids})
        raw = await on_pair(lambda pair: pair.pieces(ids))
        return JSONResponse({"tokens": [{"id": t, "piece": llama_api.piece_json(b)}
                                        for t, b in zip(ids, raw)]})

    async def detokenize(request: Request):
        authorize(request)
        body = await read_json(request, config.max_body, config.timeout)
        ids = llama_api.token_ids(body.get("tokens", []), facts["n_vocab"], "tokens")
        raw = await on_pair(lambda pair: pair.pieces(ids))
        return JSONResponse({"content": b"".join(raw).decode("utf-8", "replace")})

    async def apply_template(request: Request):
        authorize(request)
        body = await read_json(request, config.max_body, config.timeout)
        req = protocol.parse_chat(body)
        text = await on_pair(lambda pair: pair.template_text(list(req.messages),
                                                             req.template_tools()))
        return JSONResponse({"prompt": text})

    async def props(request: Request):
        authorize(request)
        return JSONResponse(llama_api.props(config.model_id, engine.pair, facts, sampling,
                                         config.defaults.max_tokens))

    async def complete(request: Request, kind: str):
        started = time.monotonic()

        def log(status: int, stats=None) -> None:  # one line per request, on stderr
            if not config.quiet:
                print(responses.log_line(request.method, request.url.path, status,
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
        if kind == "chat":
            req = protocol.parse_chat(body)
        elif kind == "text":
            req = protocol.parse_text(body)
        elif kind == "infill":
            req = llama_api.parse_infill(body)
        else:
            req = llama_api.parse_completion(body, facts["n_vocab"])
        if req.infill is not None and fim.missing():
            raise llama_api.refusal_501(fim.missing())
        limit = llama_api.Limiter(req.n_indent, req.t_max_predict_ms)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def sink(what, value):  # the engine thread -> this request's queue, nobody else's
            loop.call_soon_threadsafe(events.put_nowait, (what, value))

        # cheap checks first, then the tokenizer, never in the engine thread when it can be
        # elsewhere: a long prompt's preparation does not delay the answer being generated
        try:
            prompt_size_check(req, budget)
            if engine.waiting >= engine.capacity:
                raise QueueFull(f"{engine.capacity} requests are already waiting")
            if req.constraint is not None:  # compiled here, so the engine thread only looks up
                await loop.run_in_executor(tokenizer, structured.prepare_grammar, req,
                                           engine.pair.target if aside else None)
            tokens = None
            if aside:
                tokens, prediction = await loop.run_in_executor(
                    tokenizer, request_tokens, engine.pair, req, budget)
                gen = gen_params(req, config.defaults, prediction)
                make = lambda pair: (tokens, gen)  # noqa: E731 - the job's one line
            else:
                make = partial(prepare, req=req, defaults=config.defaults, budget=budget)
            job = GenerationJob(make=make, sink=sink, limit=limit if limit.active else None)
            engine.submit(job)
        except QueueFull as exc:
            raise busy(exc) from None
        except TandemError as exc:
            raise_failure(("error", exc))
            raise
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        now = int(time.time())
        watch = asyncio.ensure_future(disconnected(request))
        handed_over = False  # the stream response owns the job from there
        try:
            # wait for the prompt to be evaluated (or refused) before any header goes out, so
            # a prompt too long is a 400 even for a stream
            first = await next_event(events, watch)
            if first is None:
                return client_gone(job, log)
            raise_failure(first)
            if req.native:
                response = await native_answer(req, tokens, events, watch, first, log, job)
                handed_over = isinstance(response, EngineStream)  # it cancels at its end
                return response
            if req.stream:
                watch.cancel()  # from here the stream response watches the connection
                stream = openai_stream(req, rid, now, config.model_id, events, first, log)
                handed_over = True
                return EngineStream(stream, job.cancel, media_type="text/event-stream",
                                    headers=SSE_HEADERS)
            answer = await whole_answer(events, watch, first)
            if answer is None:
                return client_gone(job, log)
            log(200, answer.stats)
            return JSONResponse(responses.completion(req, rid, now, config.model_id,
                                                    answer.text, answer.reason, answer.stats))
        finally:
            watch.cancel()
            if not handed_over:  # answered, refused, or this handler cancelled: stop the job
                job.cancel.set()

    async def native_answer(req, tokens, events, watch, first, log, job):
        """/infill and /completion: llama-server's answer object, or its stream of them."""
        n_ctx = engine.pair.n_ctx
        shown = tokens is not None and (not req.response_fields or "prompt" in req.response_fields)
        prompt_text = b"".join(await on_pair(lambda pair: pair.pieces(tokens))).decode(
            "utf-8", "replace") if shown else None

        def last(answer, text):
            return llama_api.final(req, config.model_id, text, answer.reason, answer.stats,
                                   n_ctx, prompt_text,
                                   llama_api.sampling_json(answer.gen.sampling))

        if req.stream:
            watch.cancel()  # from here the stream response watches the connection
            stream = llama_stream(events, first, lambda answer: last(answer, ""), log,
                                  len(tokens) if tokens is not None else 0)
            return EngineStream(stream, job.cancel, media_type="text/event-stream",
                                headers=SSE_HEADERS)
        outcome = await whole_text(events, watch, first)
        if outcome is None:
            return client_gone(job, log)
        text, answer = outcome
        log(200, answer.stats)
        return JSONResponse(last(answer, text))

    routes = []
    for prefix in ("/v1", ""):
        routes += [Route(prefix + "/chat/completions", chat, methods=["POST"]),
                   Route(prefix + "/completions", text, methods=["POST"]),
                   Route(prefix + "/models", models, methods=["GET"])]
    routes += [Route("/health", health, methods=["GET"]),
               Route("/v1/health", health, methods=["GET"]),
               # llama-server's own routes, as its editor plugins call them
               Route("/infill", infill, methods=["POST"]),
               Route("/completion", native_completion, methods=["POST"]),
               Route("/tokenize", tokenize, methods=["POST"]),
               Route("/detokenize", detokenize, methods=["POST"]),
               Route("/apply-template", apply_template, methods=["POST"]),
               Route("/props", props, methods=["GET"]),
               Route("/metrics", metrics, methods=["GET"])]
    middleware = []
    if config.cors:
        from starlette.middleware import Middleware
        from starlette.middleware.cors import CORSMiddleware

        middleware.append(Middleware(
            CORSMiddleware, allow_origins=list(config.cors), allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"], max_age=600))
    app = Starlette(routes=routes, middleware=middleware, exception_handlers={
        ApiError: api_error, HTTPException: http_error, Exception: server_error})
    app.state.executors = (tokenizer, utility)
    return app


# ----- running it -----

def serve(engine: EngineThread, config: ServeConfig, sock: socket.socket,
          verbose: bool = False) -> None:
    """Run uvicorn on `sock` until Ctrl-C / SIGTERM; the engine thread is stopped after."""
    import uvicorn

    app = build_app(engine, config)
    server = uvicorn.Server(uvicorn.Config(
        app, http=guarded(config.timeout), loop="asyncio", lifespan="off",
        log_level="info" if verbose else "warning", access_log=verbose,
        timeout_keep_alive=IDLE_TIMEOUT, timeout_graceful_shutdown=5, server_header=False))
    engine.start()
    try:
        server.run(sockets=[sock])
    finally:
        for executor in app.state.executors:
            executor.shutdown(wait=False, cancel_futures=True)
        engine.stop()
        sock.close()
    if not server.started:
        raise TandemError("the HTTP server did not start", "rerun with --verbose for its log")
