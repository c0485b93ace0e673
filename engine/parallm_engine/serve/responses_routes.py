"""``POST /v1/responses``, ``GET`` / ``DELETE /v1/responses/{id}``: OpenAI's Responses API on the chat
endpoint's request path (:mod:`parallm_engine.serve.responses_format` translates), with the same API keys,
queue shares and input checks as chat completions.

Stored responses (``store``, default true) live in memory, per API key, in a bounded LRU: a
``previous_response_id`` continues that conversation (its turns, then its output as the assistant's
turn, then the new input), so the follow-up's prompt starts with the previous prompt and its answer
and is read from the radix prefix cache. A response id is only visible to the key that made it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Hashable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from parallm_engine.serve.agent_tools import responses_tools
from parallm_engine.serve.openai_format import APIError
from parallm_engine.serve.protocol import ErrorResponse, new_id
from parallm_engine.serve.responses_format import (
    DeletedResponse,
    ResponsesRequest,
    chat_body,
    history_of,
    input_messages,
    response_body,
    response_stream,
    template_kwargs,
)
from parallm_engine.serve.server_kit import ServerKit, chat_request

ENDPOINT = "responses"
#: Stored responses kept per API key (least recently used dropped first).
MAX_STORED_PER_KEY = 512


@dataclass
class StoredResponse:
    body: dict[str, Any]
    history: list[dict]  # the conversation a follow-up continues (chat messages, no instructions)


class ResponseStore:
    """Bounded, per-key LRU of finished responses."""

    def __init__(self, max_per_key: int = MAX_STORED_PER_KEY):
        self.max_per_key = max_per_key
        self._by_key: dict[Hashable, OrderedDict[str, StoredResponse]] = {}
        self._lock = threading.Lock()

    def put(self, key: Hashable, rid: str, stored: StoredResponse) -> None:
        with self._lock:
            entries = self._by_key.setdefault(key, OrderedDict())
            entries[rid] = stored
            while len(entries) > self.max_per_key:
                entries.popitem(last=False)

    def get(self, key: Hashable, rid: str) -> StoredResponse | None:
        with self._lock:
            entries = self._by_key.get(key)
            if entries is None or rid not in entries:
                return None
            entries.move_to_end(rid)
            return entries[rid]

    def delete(self, key: Hashable, rid: str) -> bool:
        with self._lock:
            entries = self._by_key.get(key)
            return entries is not None and entries.pop(rid, None) is not None


def _not_found(rid: str, param: str | None = None) -> APIError:
    from parallm_engine.core.validation import safe_text

    return APIError(404 if param is None else 400, f"Response with id '{safe_text(rid, 200)}' not found.",
                    param=param, code="not_found" if param is None else "previous_response_not_found")


def responses_router(kit: ServerKit, store: ResponseStore | None = None) -> APIRouter:
    router = APIRouter()
    store = store if store is not None else ResponseStore()
    errors = {status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 429, 503)}

    def key_of(request: Request) -> Hashable:
        return getattr(request.state, "parallm_key", None)

    @router.post("/v1/responses", dependencies=kit.checked,
                 responses={**errors, 200: {"content": {"text/event-stream": {}}}})
    async def create_response(req: ResponsesRequest, request: Request):
        key = key_of(request)
        history: list[dict] = []
        if req.previous_response_id is not None:
            prev = store.get(key, req.previous_response_id)
            if prev is None:
                raise _not_found(req.previous_response_id, "previous_response_id")
            history = prev.history
        tools = responses_tools(req.tools)
        p = kit.prepare_chat(chat_request(chat_body(req, history, tools)), template_kwargs(req), origin=req)
        rid = new_id("resp")
        turns = history + input_messages(req)

        def keep(body: dict) -> None:
            if req.store is not False:
                store.put(key, rid, StoredResponse(body, history_of(turns, body["output"])))

        if req.stream:
            return await kit.stream_chat(p, request, ENDPOINT, lambda run: response_stream(
                run, req, rid, p.model_name, p.single_call, tools, keep), headers=tools.headers())
        result = await kit.complete_chat(p, request, ENDPOINT)
        body = response_body(result, req, rid, p.model_name, p.single_call, tools)
        keep(body)
        return JSONResponse(body, headers=tools.headers())

    @router.get("/v1/responses/{response_id}", dependencies=kit.auth, responses=errors)
    async def get_response(response_id: str, request: Request):
        stored = store.get(key_of(request), response_id)
        if stored is None:
            raise _not_found(response_id)
        return JSONResponse(stored.body)

    @router.delete("/v1/responses/{response_id}", response_model=DeletedResponse, dependencies=kit.auth,
                   responses=errors)
    async def delete_response(response_id: str, request: Request):
        if not store.delete(key_of(request), response_id):
            raise _not_found(response_id)
        return DeletedResponse(id=response_id)

    return router
