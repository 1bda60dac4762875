"""A completion's whole life, shared by every route that generates (/v1/chat/completions,
/v1/completions, llama-server's /infill and /completion, and the chat requests Anthropic's
/v1/messages and OpenAI's /v1/responses become): the cheap checks, the prompt off the
scheduler, the queue, the prompt's verdict before any header, then the answer whole or
streamed in the route's wire format, and the job cancelled however the request ends."""
from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from functools import partial
from typing import Callable, NamedTuple

from starlette.responses import JSONResponse

from tandem.engine.drafting.drafters import DraftParams
from tandem.errors import UsageError
from tandem.serve import llama_api, protocol, responses, structured
from tandem.serve.jobs import GenerationJob
from tandem.serve.scheduler import INTERACTIVE_TOKENS, QueueFull, gen_params, prepare
from tandem.serve.prompt import check_size as prompt_size_check
from tandem.serve.prompt import request_tokens
from tandem.serve.request_flow import (
    EngineStream,
    handoff,
    client_gone,
    disconnected,
    llama_stream,
    next_event,
    openai_stream,
    raise_failure,
    whole_answer,
    whole_text,
)
from tandem.serve.server_state import ApiCall, ServerState

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class Wire(NamedTuple):
    """An API's answer shapes on this one path: `whole(req, rid, created, model, answer)`,
    the object of an answer (chat.answer.Answer), and `stream(req, rid, created, model,
    events, first, log)`, its server-sent events. OpenAI's below; Anthropic's Messages and
    OpenAI's Responses (serve/chat_bridge.py) answer chat requests in their own."""

    whole: Callable[..., dict]
    stream: Callable


def _openai_whole(req, rid: str, created: int, model: str, answer) -> dict:
    return responses.completion(req, rid, created, model, answer.text, answer.reason,
                                answer.stats, responses.returned_tokens(req, answer))


OPENAI = Wire(_openai_whole, openai_stream)


async def complete(state: ServerState, call: ApiCall, req: protocol.Request, id_prefix: str,
                   wire: Wire = OPENAI):
    """The answer to a parsed completion request, in `wire`'s shapes; refusals raise
    (QueueFull, TandemError and ApiError, which the route's shared handling turns into the
    API's errors and logs)."""
    scheduler, defaults, budget = state.scheduler, state.config.defaults, state.budget
    if req.infill is not None and state.fim.missing():
        raise llama_api.refusal_501(state.fim.missing())
    limit = llama_api.Limiter(req.n_indent, req.t_max_predict_ms)
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    log = partial(state.log, call)

    sink = handoff(loop, events)  # the scheduler -> this request's queue, nobody else's

    # cheap checks first, then the tokenizer, never in the scheduler's threads when it can be
    # elsewhere: a long prompt's preparation does not delay the answer being generated
    prompt_size_check(req, budget)
    if scheduler.waiting >= scheduler.capacity:
        raise QueueFull(f"{scheduler.capacity} requests are already waiting")
    req, draft, default = drafting_of(req, scheduler)
    if req.constraint is not None:  # compiled here, so the scheduler only looks up
        await loop.run_in_executor(state.tokenizer, structured.prepare_grammar, req,
                                   scheduler.pair.target if state.aside else None)
    tokens = None
    if state.aside:
        tokens, prediction = await loop.run_in_executor(
            state.tokenizer, request_tokens, scheduler.pair, req, budget)
        gen = gen_params(req, defaults, prediction)
        make = lambda pair: (tokens, gen)  # noqa: E731 - the job's one line
    else:
        make = partial(prepare, req=req, defaults=defaults, budget=budget)
    # an answer that short is an editor's or a title's: queued first, the kept slot may take it
    n_predict = req.max_tokens if req.max_tokens is not None else defaults.max_tokens
    job = call.job = GenerationJob(make=checked(make, req.strategy, draft, default), sink=sink,
                                   limit=limit if limit.active else None,
                                   interactive=n_predict <= INTERACTIVE_TOKENS,
                                   strategy=req.strategy, draft=draft)
    scheduler.submit(job)
    rid = id_prefix + uuid.uuid4().hex[:24]
    now = int(time.time())
    watch = asyncio.ensure_future(disconnected(call.request))
    handed_over = False  # the stream response owns the job from there
    try:
        # wait for the prompt to be evaluated (or refused) before any header goes out, so
        # a prompt too long is a 400 even for a stream
        first = await next_event(events, watch)
        if first is None:
            return client_gone(job, log)
        raise_failure(first)
        if req.native:
            response = await native_answer(state, req, tokens, events, watch, first, log, job)
            handed_over = isinstance(response, EngineStream)  # it cancels at its end
            return response
        model = state.config.model_id
        if req.stream:
            watch.cancel()  # from here the stream response watches the connection
            stream = wire.stream(req, rid, now, model, events, first, log)
            handed_over = True
            return EngineStream(stream, job.cancel, events, media_type="text/event-stream",
                                headers=SSE_HEADERS)
        answer = await whole_answer(events, watch, first)
        if answer is None:
            return client_gone(job, log)
        log(200, answer.stats)
        return JSONResponse(wire.whole(req, rid, now, model, answer))
    finally:
        watch.cancel()
        if not handed_over:  # answered, refused, or this handler cancelled: stop the job
            job.cancel.set()


def server_drafting(scheduler) -> tuple[str, DraftParams]:
    """The server's strategy and draft settings: what a request that does not say runs with
    (GET /props shows them)."""
    pair = scheduler.pair
    return scheduler.strategy or pair.options.strategy, scheduler.draft or pair.options.draft


def drafting_of(req: protocol.Request, scheduler) -> tuple[protocol.Request, DraftParams, str]:
    """The request with its drafting filled in, its own or else the server's (the answer
    says which it ran with), those draft settings, and the server's strategy."""
    default = server_drafting(scheduler)
    strategy, draft = protocol.drafting(req, *default)
    return dataclasses.replace(req, strategy=strategy, n_max=draft.n_max, n_min=draft.n_min,
                               p_min=draft.p_min), draft, default[0]


class StrategyRefused(UsageError):
    """A request's strategy that needs what the server did not load (a draft model, MTP
    heads): a 400 naming `strategy`."""

    param = "strategy"


def checked(make, strategy: str, draft: DraftParams, default: str):
    """The job's `make`, first checking on the engine thread that `strategy` can run with
    what the server loaded (Pair.check_drafter, whose refusal is the engine's own words).
    The server's own strategy was checked when it started, none needs nothing, and auto
    drafts with whatever is loaded (building it to check would calibrate and take its
    notes): those go unchecked."""
    if strategy in (default, "none", "auto"):
        return make

    def make_checked(pair):
        try:
            pair.check_drafter(strategy, draft)
        except UsageError as exc:
            loaded = pair.target_path.name + (f" and the draft model {pair.draft_path.name}"
                                              if pair.draft_path else " and no draft model")
            raise StrategyRefused(f"{exc.message}; this server has {loaded}",
                                  f"leave 'strategy' out for the server's own, {default}") \
                from None
        return make(pair)
    return make_checked


async def native_answer(state: ServerState, req: protocol.Request, tokens, events, watch,
                        first, log, job):
    """/infill and /completion: llama-server's answer object, or its stream of them."""
    n_ctx = state.scheduler.pair.n_ctx
    shown = tokens is not None and (not req.response_fields or "prompt" in req.response_fields)
    prompt_text = b"".join(await state.on_pair(lambda pair: pair.pieces(tokens))).decode(
        "utf-8", "replace") if shown else None

    def last(answer, text):
        return llama_api.final(req, state.config.model_id, text, answer.reason, answer.stats,
                               n_ctx, prompt_text, llama_api.sampling_json(answer.gen.sampling),
                               responses.returned_tokens(req, answer))

    if req.stream:
        watch.cancel()  # from here the stream response watches the connection
        stream = llama_stream(events, first, lambda answer: last(answer, ""), log,
                              len(tokens) if tokens is not None else 0)
        return EngineStream(stream, job.cancel, events, media_type="text/event-stream",
                            headers=SSE_HEADERS)
    outcome = await whole_text(events, watch, first)
    if outcome is None:
        return client_gone(job, log)
    text, answer = outcome
    log(200, answer.stats)
    return JSONResponse(last(answer, text))
