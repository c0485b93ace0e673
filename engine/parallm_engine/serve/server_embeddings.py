"""``POST /v1/embeddings`` (OpenAI's shape) for ``parallm serve``.

``input``: a string, a list of strings, a list of token ids, or a list of token-id lists, at most
``MAX_INPUTS`` (OpenAI's limit); a request's inputs are queued together, shortest first, at most one request's
share of the engine queue in flight at a time (a quarter by default: a longer list waits for its own rows, it
is not refused), batched with whatever else the engine runs. ``encoding_format``: ``float``
(default) or ``base64`` (little-endian float32, as OpenAI's). ``dimensions``: Matryoshka truncation,
renormalised, for models trained so (400 otherwise). ``usage``: the tokens embedded. ParaLLM's extensions
(``extra_body`` with the openai client): ``input_type`` (``"query"`` / ``"document"``: the model's prompt),
``instruction`` (a query task description), ``truncate`` (cut inputs over the context window; default: 400).

The served model embeds when it is an embedding model (or with ``pooling`` in the request); a server started
with ``embedding_model=`` (``parallm serve --embedding-model``) embeds with that model instead, which may be
an encoder (mlx-embeddings), named by its own model id.
"""

from __future__ import annotations

import asyncio
import base64
import os
from typing import Literal

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from parallm_engine.serve.openai_format import APIError
from parallm_engine.serve.server_kit import wait_for_disconnect
from parallm_engine.core.validation import safe_text


#: Inputs one request may carry (OpenAI's own limit; clients such as LangChain's OpenAIEmbeddings chunk to it).
MAX_INPUTS = 2048


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    input_type: Literal["query", "document"] | None = None
    instruction: str | None = None
    truncate: bool = False
    pooling: Literal["last", "mean", "cls"] | None = None
    normalize: bool | None = None

    def inputs(self) -> list:
        data = self.input
        if isinstance(data, str) or (data and all(isinstance(t, int) for t in data)):
            return [data]
        if not data:
            raise APIError(400, "input must not be empty", param="input")
        if len(data) > MAX_INPUTS:
            raise APIError(400, f"input has {len(data)} items; at most {MAX_INPUTS} per request: split it",
                           param="input", code="too_many_inputs")
        return list(data)

    def options(self) -> dict:
        opts = {"input_type": self.input_type, "instruction": self.instruction, "truncate": self.truncate,
                "dimensions": self.dimensions, "pooling": self.pooling, "normalize": self.normalize}
        return {k: v for k, v in opts.items() if v is not None}


def _encode(vector: list[float], fmt: str):
    if fmt == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


def add_embedding_routes(app: FastAPI, state, dependencies: list, embedding_model=None,
                         engine_config: dict | None = None) -> None:
    """Add ``/v1/embeddings`` to ``app`` (``server.create_app``): the served engine (``state``), or the
    shared engine of ``embedding_model`` (loaded on first use)."""
    holder: dict = {}

    def embedding_engine():
        if embedding_model is None:
            return state.engine_or_503()
        if "engine" not in holder:
            from parallm_engine.core.registry import get_embedding_engine

            holder["engine"] = get_embedding_engine(embedding_model, **(engine_config or {}))
        return holder["engine"]

    def model_name(requested: str | None) -> str:
        if embedding_model is None:
            return state.check_model(requested)
        name = str(embedding_model)
        if requested not in (None, "", name, os.path.basename(os.path.normpath(name))):
            return state.check_model(requested)  # the chat model's name: 404 unless it is served
        return name

    @app.post("/v1/embeddings", dependencies=dependencies)
    async def embeddings(req: EmbeddingRequest, request: Request):
        name = model_name(req.model)
        eng = await asyncio.to_thread(embedding_engine) if embedding_model is not None else embedding_engine()
        inputs = req.inputs()
        # In flight at a time: the request's share (aembed_results keeps the rest waiting, shortest first)
        window = min(len(inputs), state.shares.request_limit())
        lease = state.shares.acquire(getattr(request.state, "parallm_key", None), window, param="input")
        work = asyncio.ensure_future(eng.aembed_results(inputs, window=window, **req.options()))
        watcher = asyncio.ensure_future(wait_for_disconnect(request))
        try:
            await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():  # the client went away: aembed_results aborts what is still queued
                work.cancel()
                raise APIError(499, "client disconnected", code="client_disconnected")
            results = work.result()
        finally:
            watcher.cancel()
            lease.release()
        tokens = sum(r.prompt_tokens for r in results)
        return JSONResponse({
            "object": "list",
            "data": [{"object": "embedding", "index": i, "embedding": _encode(r.embedding, req.encoding_format)}
                     for i, r in enumerate(results)],
            "model": safe_text(name, 200),
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        })
