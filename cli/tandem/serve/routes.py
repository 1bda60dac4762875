"""The HTTP side of `tandem serve`: every route in one table (ROUTES: path, method, handler),
the shared handling around each handler (the API key, the JSON body, the engine's refusals as
the API's errors, the completions' line on stderr), the error objects, and uvicorn running it.

The handlers are named module-level functions over one ServerState (server_state.py):
openai_routes.py (OpenAI's routes), llama_routes.py (llama-server's own, for editors and
monitors), both generating through completion_flow.py. The /v1-less OpenAI paths and /v1/health
are there too, as llama-server has them. Every refusal is an OpenAI error object with a 4xx
status; a bug is a 500 with the same shape (and a traceback on stderr), and the server stays up.
Starlette and uvicorn are imported only by these serve/ modules, which only `tandem serve`
imports: `tandem run` starts as fast as before.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import socket
from typing import Awaitable, Callable, NamedTuple

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tandem.errors import TandemError
from tandem.serve import (anthropic_api, anthropic_routes, llama_routes, openai_routes,
                          protocol, responses_routes, webui)
from tandem.serve.api_errors import ApiError
from tandem.serve.connection import IDLE_TIMEOUT, guarded
from tandem.serve.scheduler import Scheduler, QueueFull
from tandem.serve.request_flow import busy, read_json, refusal
from tandem.serve.server_state import ApiCall, ServeConfig, ServerState

Handler = Callable[[ServerState, ApiCall], Awaitable[Response]]


class Endpoint(NamedTuple):
    path: str
    method: str  # GET (no body) or POST (a JSON object)
    handler: Handler
    keyed: bool = True  # the API key is asked (--api-key); /health answers probes without it
    logged: bool = False  # a line on stderr per request: the routes that generate
    # the API's own error shape, for every refusal (Anthropic's); None: OpenAI's
    shape: Callable[[ApiError], ApiError] | None = None


# Every route of `tandem serve`: adding one is a line here and its handler.
ROUTES: tuple[Endpoint, ...] = (
    # OpenAI's API, under /v1 and without it
    Endpoint("/v1/chat/completions", "POST", openai_routes.chat_completions, logged=True),
    Endpoint("/v1/completions", "POST", openai_routes.completions, logged=True),
    Endpoint("/v1/models", "GET", openai_routes.models),
    Endpoint("/chat/completions", "POST", openai_routes.chat_completions, logged=True),
    Endpoint("/completions", "POST", openai_routes.completions, logged=True),
    Endpoint("/models", "GET", openai_routes.models),
    # llama-server's own, as its editor plugins and monitors call them
    Endpoint("/health", "GET", llama_routes.health, keyed=False),
    Endpoint("/v1/health", "GET", llama_routes.health, keyed=False),
    Endpoint("/infill", "POST", llama_routes.infill, logged=True),
    Endpoint("/completion", "POST", llama_routes.completion, logged=True),
    Endpoint("/tokenize", "POST", llama_routes.tokenize),
    Endpoint("/detokenize", "POST", llama_routes.detokenize),
    Endpoint("/apply-template", "POST", llama_routes.apply_template),
    Endpoint("/props", "GET", llama_routes.props),
    Endpoint("/metrics", "GET", llama_routes.metrics),
    Endpoint("/slots", "GET", llama_routes.slots),
    # Anthropic's Messages API (Claude Code: ANTHROPIC_BASE_URL) and OpenAI's Responses API
    # (Codex CLI), both on the chat completions path
    Endpoint("/v1/messages", "POST", anthropic_routes.messages, logged=True,
             shape=anthropic_api.as_anthropic),
    Endpoint("/v1/messages/count_tokens", "POST", anthropic_routes.count_tokens,
             shape=anthropic_api.as_anthropic),
    Endpoint("/v1/responses", "POST", responses_routes.responses, logged=True),
    Endpoint("/v1/responses/input_tokens", "POST", responses_routes.input_tokens),
    Endpoint("/responses", "POST", responses_routes.responses, logged=True),
    # the chat page (--no-webui: none)
    Endpoint("/", "GET", webui.page, keyed=False),
)


def endpoint(state: ServerState, route: Endpoint) -> Callable[[Request], Awaitable[Response]]:
    """The route's Starlette endpoint: its handler inside the handling every route shares.
    It carries the handler's name (and the handler as __wrapped__)."""

    @functools.wraps(route.handler)
    async def run(request: Request) -> Response:
        call = ApiCall(request)
        try:
            if route.keyed:
                state.authorize(request)
            if route.method == "POST":
                call.body = await read_json(request, state.config.max_body,
                                            state.config.timeout, state.stopping)
            try:
                return await route.handler(state, call)
            except QueueFull as exc:
                raise busy(exc) from None
            except TandemError as exc:  # a refusal of the request: 400, or the remote's 502
                raise refusal(exc) from exc
        except ApiError as exc:
            if route.logged:
                state.log(call, exc.status)
            if route.shape is not None:
                raise route.shape(exc) from None
            raise

    return run


# ----- the error objects -----

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


def build_app(scheduler: Scheduler, config: ServeConfig) -> Starlette:
    """The app: ROUTES over one ServerState, the error objects, CORS when asked."""
    state = ServerState.open(scheduler, config)
    routes = [Route(r.path, endpoint(state, r), methods=[r.method]) for r in ROUTES]
    middleware = []
    if config.cors:
        from starlette.middleware import Middleware
        from starlette.middleware.cors import CORSMiddleware

        middleware.append(Middleware(
            CORSMiddleware, allow_origins=list(config.cors), allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"], max_age=600))
    app = Starlette(routes=routes, middleware=middleware, exception_handlers={
        ApiError: api_error, HTTPException: http_error, Exception: server_error})
    app.state.server = state
    return app


# ----- running it -----

class StopCuts(logging.Filter):
    """What uvicorn logs of the requests still running STOP_GRACE_S after Ctrl-C (a prompt's
    chunk longer than that): one line instead of its message and a CancelledError traceback
    per request, a stop that was asked for and not a bug."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], asyncio.CancelledError):
            return False
        if "timeout graceful shutdown exceeded" in str(record.msg):
            record.msg = f"tandem serve: cut %s request(s) still running {STOP_GRACE_S:g} s " \
                "after Ctrl-C"
        return True


# seconds uvicorn waits after Ctrl-C for the responses in flight, which the scheduler's halt
# ends within a step (a prompt's chunk at most); beyond, what is left is cut
STOP_GRACE_S = 1.0


def serve(scheduler: Scheduler, config: ServeConfig, sock: socket.socket,
          verbose: bool = False) -> None:
    """Run uvicorn on `sock` until Ctrl-C / SIGTERM; the scheduler is stopped after. Once
    uvicorn starts its shutdown the scheduler halts: every answer in flight ends at its next
    step, a stream with its finish chunk and an error event, so no connection is left for
    uvicorn to cancel (its tracebacks) and the process ends within about a second."""
    import uvicorn

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            scheduler.halt()
            app.state.server.stopping.set()  # a body still arriving: 503, not a wait
            await super().shutdown(sockets)

    app = build_app(scheduler, config)
    logging.getLogger("uvicorn.error").addFilter(StopCuts())
    server = Server(uvicorn.Config(
        app, http=guarded(config.timeout), loop="asyncio", lifespan="off",
        log_level="info" if verbose else "warning", access_log=verbose,
        timeout_keep_alive=IDLE_TIMEOUT, timeout_graceful_shutdown=STOP_GRACE_S,
        server_header=False))
    scheduler.start()
    try:
        server.run(sockets=[sock])
    finally:
        app.state.server.close()
        scheduler.stop()
        sock.close()
    if not server.started:
        raise TandemError("the HTTP server did not start", "rerun with --verbose for its log")
