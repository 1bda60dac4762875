"""The handlers of llama-server's own routes, as its editor plugins and monitors call them
(the table is routes.py's ROUTES; the wire format is llama_api.py's): POST /infill and
/completion (completion_flow.complete), /tokenize, /detokenize, /apply-template, GET /props,
/health and /metrics. Each takes the server's state and the call, its key already checked
(but /health's, which is open) and its body read."""
from __future__ import annotations

from starlette.responses import JSONResponse, PlainTextResponse

from tandem.serve import llama_api, protocol
from tandem.serve.completion_flow import complete, server_drafting
from tandem.serve.metrics import CONTENT_TYPE
from tandem.serve.prompt import check_text_size as prompt_text_check
from tandem.serve.server_state import ApiCall, ServerState


async def infill(state: ServerState, call: ApiCall):
    return await complete(state, call, llama_api.parse_infill(call.body), "cmpl-")


async def completion(state: ServerState, call: ApiCall):
    req = llama_api.parse_completion(call.body, state.facts["n_vocab"])
    return await complete(state, call, req, "cmpl-")


async def tokenize(state: ServerState, call: ApiCall):
    content, add, parse, pieces = llama_api.tokenize_request(call.body)
    prompt_text_check([c for c in (content if isinstance(content, list) else [content])
                       if isinstance(c, str)], state.budget, "content")
    ids = await state.on_pair(lambda pair: llama_api.tokenize_mixed(pair, content, add, parse))
    if not pieces:
        return JSONResponse({"tokens": ids})
    raw = await state.on_pair(lambda pair: pair.pieces(ids))
    return JSONResponse({"tokens": [{"id": t, "piece": llama_api.piece_json(b)}
                                    for t, b in zip(ids, raw)]})


async def detokenize(state: ServerState, call: ApiCall):
    ids = llama_api.token_ids(call.body.get("tokens", []), state.facts["n_vocab"], "tokens")
    raw = await state.on_pair(lambda pair: pair.pieces(ids))
    return JSONResponse({"content": b"".join(raw).decode("utf-8", "replace")})


async def apply_template(state: ServerState, call: ApiCall):
    req = protocol.parse_chat(call.body)
    text = await state.on_pair(lambda pair: pair.template_text(list(req.messages),
                                                               req.template_tools()))
    return JSONResponse({"prompt": text})


async def props(state: ServerState, call: ApiCall):
    defaults = state.config.defaults
    return JSONResponse(llama_api.props(state.config.model_id, state.scheduler, state.facts,
                                        defaults.sampling, defaults.max_tokens,
                                        server_drafting(state.scheduler)))


async def health(state: ServerState, call: ApiCall):
    scheduler = state.scheduler
    cache = scheduler.prompt_cache
    return JSONResponse({"status": "ok", "busy": scheduler.busy, "waiting": scheduler.waiting,
                         "queue": scheduler.capacity, "served": scheduler.served,
                         "cancelled": scheduler.cancelled, "last_cancel": scheduler.last_cancel,
                         "slots": len(scheduler.slots), "processing": scheduler.processing,
                         "prompt_cache": None if cache is None else {
                             "entries": len(cache.entries), "bytes": cache.size,
                             "limit": cache.limit, **vars(cache.figures)}})


async def slots(state: ServerState, call: ApiCall):
    return JSONResponse(state.scheduler.slot_states())


async def metrics(state: ServerState, call: ApiCall):
    scheduler = state.scheduler
    text = scheduler.metrics.prometheus(processing=scheduler.processing,
                                        deferred=scheduler.waiting, batches=scheduler.batches)
    return PlainTextResponse(text, media_type=CONTENT_TYPE)
