"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: Anthropic's Messages API on the chat
endpoint's request path (:mod:`parallm_engine.serve.anthropic_format` translates; errors answer in Anthropic's
shape, chosen by path in :mod:`parallm_engine.serve.server`). The same API keys (``x-api-key`` as the
Anthropic SDK sends it, or ``Authorization: Bearer``), queue shares and input checks as chat completions."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from parallm_engine.serve.agent_tools import anthropic_tools
from parallm_engine.serve.anthropic_format import (
    PING,
    AnthropicErrorResponse,
    CountTokensRequest,
    CountTokensResponse,
    MessagesRequest,
    chat_body,
    message_response,
    message_stream,
    template_kwargs,
)
from parallm_engine.serve.server_kit import ServerKit, chat_request, prompt_length

ENDPOINT = "messages"


def anthropic_router(kit: ServerKit) -> APIRouter:
    router = APIRouter()
    errors = {status: {"model": AnthropicErrorResponse} for status in (400, 401, 404, 413, 429, 503)}

    @router.post("/v1/messages", dependencies=kit.checked,
                 responses={**errors, 200: {"content": {"text/event-stream": {}}}})
    async def create_message(req: MessagesRequest, request: Request):
        tools = anthropic_tools(req.tools)
        p = kit.prepare_chat(chat_request(chat_body(req, tools)), template_kwargs(req), origin=req)
        stops = list(req.stop_sequences or [])
        if req.stream:
            return await kit.stream_chat(p, request, ENDPOINT,
                                         lambda run: message_stream(run, p.model_name, p.single_call, stops),
                                         keepalive=PING, headers=tools.headers())
        result = await kit.complete_chat(p, request, ENDPOINT)
        return JSONResponse(message_response(result, p.model_name, p.single_call, stops), headers=tools.headers())

    @router.post("/v1/messages/count_tokens", response_model=CountTokensResponse, dependencies=kit.checked,
                 responses=errors)
    async def count_tokens(req: CountTokensRequest):
        p = kit.prepare_chat(chat_request(chat_body(req, anthropic_tools(req.tools))), template_kwargs(req))
        return CountTokensResponse(input_tokens=prompt_length(await kit.chat_prompt(p)))

    return router
