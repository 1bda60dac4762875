"""The handlers of OpenAI's Responses API (the table is routes.py's ROUTES): POST
/v1/responses, a chat request on the chat completions path (completion_flow.complete)
answered as a `response` or its events (responses_api.py), and POST
/v1/responses/input_tokens, the prompt's tokens as that request would evaluate them."""
from __future__ import annotations

from starlette.responses import JSONResponse

from tandem.serve import chat_bridge, responses_api
from tandem.serve.completion_flow import complete
from tandem.serve.server_state import ApiCall, ServerState


async def responses(state: ServerState, call: ApiCall):
    return await complete(state, call, responses_api.parse(call.body), "resp_",
                          responses_api.wire(call.body))


async def input_tokens(state: ServerState, call: ApiCall):
    req = responses_api.parse(call.body)
    return JSONResponse({"object": "response.input_tokens",
                         "input_tokens": await chat_bridge.count_tokens(state, req)})
