"""What every route of `tandem serve` reads: the server's configuration (ServeConfig, the
command's), ServerState (built once by routes.build_app: the scheduler, the prompt budget,
the vocabulary's facts, the tokenizer and utility threads, the API key check, the stderr line
per request) and ApiCall (one request as its handler sees it): every handler of
openai_routes.py, llama_routes.py and completion_flow.py takes these two."""
from __future__ import annotations

import asyncio
import hmac
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from tandem.serve import responses
from tandem.serve.api_errors import ApiError
from tandem.serve.connection import REQUEST_TIMEOUT
from tandem.serve.jobs import CallJob, GenerationJob
from tandem.serve.scheduler import Defaults, Scheduler
from tandem.serve.prompt import PromptBudget
from tandem.serve.request_flow import raise_failure

if TYPE_CHECKING:
    from starlette.requests import Request

    from tandem.engine.backend.fim import FimTokens

MAX_BODY = 4 << 20  # bytes: a whole conversation with files fits; a flood does not


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
    webui: bool = True  # the chat page at / (--no-webui: none)
    # after an answer: a note for stderr, once (the command's: where answers are kept)
    notice: Callable[[], str | None] | None = None


@dataclass
class ApiCall:
    """One request as its handler sees it: Starlette's request, its JSON body (read by the
    route's shared handling; None on a GET), and when it arrived (for its line on stderr)."""

    request: Request
    body: dict | None = None
    started: float = field(default_factory=time.monotonic)
    job: GenerationJob | None = None  # a completion's job (its slot, for the log line)


@dataclass
class ServerState:
    """The server's one state, built once before the first request (ServerState.open)."""

    scheduler: Scheduler
    config: ServeConfig
    budget: PromptBudget
    created: int  # /v1/models' timestamp: when the server started
    aside: bool  # pair.tokenizes_aside: prompts are tokenized off the scheduler
    fim: FimTokens
    facts: dict  # the vocabulary's, read once (n_vocab ...)
    # one thread tokenizes prompts while the scheduler generates (serve/prompt.py); the
    # utility routes (/tokenize, /detokenize, /apply-template) have their own, so a client's
    # bulk tokenizing never holds back a completion's prompt
    tokenizer: ThreadPoolExecutor
    utility: ThreadPoolExecutor
    # set once the server stops: what waits for a client (a body) gives up (routes.serve)
    stopping: asyncio.Event = field(default_factory=asyncio.Event)

    @classmethod
    def open(cls, scheduler: Scheduler, config: ServeConfig) -> ServerState:
        # read now, before the scheduler runs: a remote pair's pipe is the engine's then
        pair = scheduler.pair
        return cls(
            scheduler=scheduler, config=config, budget=config.budget or PromptBudget(pair.n_ctx),
            created=int(time.time()), aside=pair.tokenizes_aside, fim=pair.fim_tokens,
            facts=pair.props(),
            tokenizer=ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-tokenizer"),
            utility=ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-utility"))

    def close(self) -> None:
        for executor in (self.tokenizer, self.utility):
            executor.shutdown(wait=False, cancel_futures=True)

    def authorize(self, request: Request) -> None:
        key = self.config.api_key
        if key is None:
            return
        # the key exactly, compared in constant time (HTTP itself drops the header's outer
        # whitespace: a key cannot end in a space, and --api-key refuses one that does), as
        # a bearer token or in Anthropic's x-api-key header
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = [token] if scheme.lower() == "bearer" else []
        given += request.headers.getlist("x-api-key")
        if not any(hmac.compare_digest(t.encode("utf-8", "surrogateescape"), key.encode())
                   for t in given):
            raise ApiError(401, "invalid or missing API key: send 'Authorization: Bearer KEY' "
                           "(or 'x-api-key: KEY')",
                           type="authentication_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": 'Bearer realm="tandem"'})

    async def on_pair(self, fn):
        """`fn(pair)` where it may run: the utility thread for a local pair, the scheduler
        thread (between answers) for a remote one, whose engine process takes one call at a
        time. The queue full is QueueFull, which the route's shared handling answers."""
        loop = asyncio.get_running_loop()
        if self.aside:
            return await loop.run_in_executor(self.utility, fn, self.scheduler.pair)
        done: asyncio.Future = loop.create_future()

        def sink(event):
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(event))
        self.scheduler.submit(CallJob(fn, sink))
        event = await done
        raise_failure(event)  # Refused, Failed or Dropped; else it Returned
        return event.value

    def log(self, call: ApiCall, status: int, stats=None) -> None:
        """A completion's one line on stderr (unless --quiet), and the command's notice after
        the first answer."""
        config = self.config
        if not config.quiet:
            print(responses.log_line(call.request.method, call.request.url.path, status,
                                     time.monotonic() - call.started, stats,
                                     call.job.slot if call.job is not None else None),
                  file=sys.stderr, flush=True)
        if status == 200 and config.notice is not None:
            note = config.notice()
            if note:
                config.notice = None  # said once
                print(f"Note: {note}", file=sys.stderr, flush=True)
