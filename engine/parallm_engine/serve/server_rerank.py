"""``POST /v1/rerank``, ``/rerank`` (vLLM's and Jina's shape) and ``/v2/rerank`` (Cohere's) for ``parallm serve``.

Request (all three): ``query``, ``documents`` (strings, or objects with a ``text`` string; at most
``MAX_DOCUMENTS``), ``top_n`` (the best n; more than there are documents gives all), ``return_documents``
(each result carries its ``document: {"text": ...}``), ``model``; ParaLLM's extensions ``instruction`` (a
decoder reranker's task) and ``truncate`` (default true: a pair over the context window has its document cut;
false: 400 ``context_length_exceeded``). Response: ``results`` best first, each ``index`` (into
``documents``) and ``relevance_score``; usage as ``usage`` (vLLM / Jina) or ``meta.tokens`` (Cohere).

The served model reranks when it is a decoder reranker (Qwen3-Reranker); a server started with
``rerank_model=`` (``parallm serve --rerank-model``) reranks with that model instead, a cross-encoder or a
decoder reranker (``registry.get_rerank_engine``), loaded on first use. A request's pairs are queued together,
at most its share of the engine queue in flight at a time, as embedding inputs are.
"""

from __future__ import annotations

import asyncio
import os
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from parallm_engine.core.validation import safe_text
from parallm_engine.serve.openai_format import APIError
from parallm_engine.serve.server_kit import wait_for_disconnect

#: Documents one request may carry (Cohere's recommended most; a longer list: split it).
MAX_DOCUMENTS = 1000


class RerankDocument(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text: StrictStr


class RerankRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    query: StrictStr
    documents: list[StrictStr | RerankDocument]
    model: str | None = None
    top_n: StrictInt | None = Field(default=None, ge=1, le=MAX_DOCUMENTS)
    return_documents: StrictBool = False
    instruction: StrictStr | None = None
    truncate: StrictBool = True
    user: str | None = None

    def texts(self) -> list[str]:
        if not self.query:
            raise APIError(400, "query must not be empty", param="query")
        if not self.documents:
            raise APIError(400, "documents must not be empty", param="documents")
        if len(self.documents) > MAX_DOCUMENTS:
            raise APIError(400, f"documents has {len(self.documents)} items; at most {MAX_DOCUMENTS} per request: "
                           "split it", param="documents", code="too_many_documents")
        return [d if isinstance(d, str) else d.text for d in self.documents]


def add_rerank_routes(app: FastAPI, state, dependencies: list, rerank_model=None,
                      engine_config: dict | None = None) -> None:
    """Add the rerank routes to ``app`` (``server.create_app``): the served engine (``state``), or the shared
    rerank engine of ``rerank_model`` (loaded on first use)."""
    holder: dict = {}

    def rerank_engine():
        if rerank_model is None:
            return state.engine_or_503()
        if "engine" not in holder:
            from parallm_engine.core.registry import get_rerank_engine

            holder["engine"] = get_rerank_engine(rerank_model, **(engine_config or {}))
        return holder["engine"]

    def model_name(requested: str | None) -> str:
        if rerank_model is None:
            return state.check_model(requested)
        name = str(rerank_model)
        if requested not in (None, "", name, os.path.basename(os.path.normpath(name))):
            return state.check_model(requested)  # the chat model's name: 404 unless it is served
        return name

    async def run(req: RerankRequest, request: Request):
        name = model_name(req.model)
        texts = req.texts()
        eng = await asyncio.to_thread(rerank_engine) if rerank_model is not None else rerank_engine()
        window = min(len(texts), state.shares.request_limit())
        lease = state.shares.acquire(getattr(request.state, "parallm_key", None), window, param="documents")
        work = asyncio.ensure_future(eng.arerank(req.query, texts, instruction=req.instruction,
                                                 truncate=req.truncate, window=window))
        watcher = asyncio.ensure_future(wait_for_disconnect(request))
        try:
            await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():  # the client went away: arerank aborts what is still queued
                work.cancel()
                raise APIError(499, "client disconnected", code="client_disconnected")
            ranked = work.result()
        finally:
            watcher.cancel()
            lease.release()
        top = ranked[: req.top_n] if req.top_n is not None else ranked
        results = []
        for r in top:
            item = {"index": r.index, "relevance_score": r.relevance_score}
            if req.return_documents:
                item["document"] = {"text": texts[r.index]}
            results.append(item)
        return name, results, sum(r.tokens for r in ranked)

    @app.post("/v1/rerank", dependencies=dependencies)
    @app.post("/rerank", dependencies=dependencies)
    async def rerank(req: RerankRequest, request: Request):
        """vLLM's / Jina's rerank."""
        name, results, tokens = await run(req, request)
        return JSONResponse({"id": f"rerank-{uuid.uuid4().hex}", "object": "rerank", "model": safe_text(name, 200),
                             "results": results, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    @app.post("/v2/rerank", dependencies=dependencies)
    async def rerank_v2(req: RerankRequest, request: Request):
        """Cohere's v2 rerank."""
        _, results, tokens = await run(req, request)
        return JSONResponse({"id": str(uuid.uuid4()), "results": results,
                             "meta": {"api_version": {"version": "2"}, "billed_units": {"search_units": 1},
                                      "tokens": {"input_tokens": tokens, "output_tokens": 0}}})
