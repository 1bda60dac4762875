"""The handlers of Anthropic's Messages API (the table is routes.py's ROUTES, whose entries
for these routes answer every refusal in Anthropic's error shape): POST /v1/messages, a chat
request on the chat completions path (completion_flow.complete) answered as a `message` or
its events (anthropic_api.py), and POST /v1/messages/count_tokens, the prompt's tokens as
that request would evaluate them."""
from __future__ import annotations

from starlette.responses import JSONResponse

from tandem.serve import anthropic_api, chat_bridge
from tandem.serve.completion_flow import complete
from tandem.serve.server_state import ApiCall, ServerState


async def messages(state: ServerState, call: ApiCall):
    return await complete(state, call, anthropic_api.parse(call.body), "msg_",
                          anthropic_api.WIRE)


async def count_tokens(state: ServerState, call: ApiCall):
    req = anthropic_api.parse(call.body, counting=True)
    return JSONResponse({"input_tokens": await chat_bridge.count_tokens(state, req)})
