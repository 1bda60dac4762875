"""The handlers of OpenAI's routes (the table is routes.py's ROUTES): POST /v1/chat/completions
and /v1/completions (completion_flow.complete, answered in OpenAI's wire format: protocol.py,
responses.py) and GET /v1/models. Each takes the server's state and the call, its key already
checked and its body read."""
from __future__ import annotations

from starlette.responses import JSONResponse

from tandem.serve import protocol
from tandem.serve.completion_flow import complete
from tandem.serve.server_state import ApiCall, ServerState


async def chat_completions(state: ServerState, call: ApiCall):
    return await complete(state, call, protocol.parse_chat(call.body), "chatcmpl-")


async def completions(state: ServerState, call: ApiCall):
    return await complete(state, call, protocol.parse_text(call.body), "cmpl-")


async def models(state: ServerState, call: ApiCall):
    return JSONResponse({"object": "list", "data": [
        {"id": state.config.model_id, "object": "model", "created": state.created,
         "owned_by": "tandem"}]})
