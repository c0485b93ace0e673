"""What the LangChain and LlamaIndex embedding classes share: the shared in-process engine (one per model
per process: ``parallm_engine.get_embedding_engine``, the same ``Engine`` chat uses for a decoder model), or
an OpenAI-compatible server's ``/v1/embeddings`` with ``base_url=``. Every text of one call is in flight at
once. Imports neither the engine nor MLX until first in-process use.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ._common import engine_import, is_default_model


def _options(input_type: str, instruction: str | None, pooling: str | None, normalize: bool | None,
             dimensions: int | None, truncate: bool) -> dict[str, Any]:
    opts: dict[str, Any] = {"input_type": input_type, "truncate": truncate}
    if input_type == "query" and instruction:
        opts["instruction"] = instruction
    for name, value in (("pooling", pooling), ("normalize", normalize), ("dimensions", dimensions)):
        if value is not None:
            opts[name] = value
    return opts


class EmbeddingClient:
    """``embed(texts, input_type)`` / ``aembed`` on the shared engine or a server (``base_url``)."""

    def __init__(self, model: str | None, engine_kwargs: dict | None = None, *, base_url: str | None = None,
                 api_key: str | None = None, max_retries: int | None = 2, instruction: str | None = None,
                 pooling: str | None = None, normalize: bool | None = None, dimensions: int | None = None,
                 truncate: bool = False, timeout: float | None = None):
        self.model = model
        self.engine_kwargs = dict(engine_kwargs or {})
        self.base_url = base_url
        self.api_key = api_key
        self.max_retries = max_retries
        self.instruction = instruction
        self.pooling, self.normalize, self.dimensions, self.truncate = pooling, normalize, dimensions, truncate
        self.timeout = timeout
        self._engine = None
        self._remote = None

    def options(self, input_type: str) -> dict[str, Any]:
        return _options(input_type, self.instruction, self.pooling, self.normalize, self.dimensions, self.truncate)

    # -- in-process -----------------------------------------------------------------------------
    def engine(self):
        if self._engine is None or not self._engine.is_alive:
            with engine_import("ParaLLM embeddings without base_url="):
                from parallm_engine import get_embedding_engine

                self._engine = get_embedding_engine(None if is_default_model(self.model) else self.model,
                                                    **self.engine_kwargs)
        return self._engine

    def embed(self, texts: list[str], input_type: str) -> list[list[float]]:
        if not texts:
            return []
        if self.base_url:
            return self._remote_embed(texts, input_type)
        return self.engine().embed(list(texts), **self.options(input_type))

    async def aembed(self, texts: list[str], input_type: str) -> list[list[float]]:
        if not texts:
            return []
        if self.base_url:
            return await self._aremote_embed(texts, input_type)
        engine = self._engine if self._engine is not None and self._engine.is_alive \
            else await asyncio.to_thread(self.engine)  # loading (seconds) off the event loop
        work = engine.aembed(list(texts), **self.options(input_type))
        return await (asyncio.wait_for(work, self.timeout) if self.timeout else work)

    # -- base_url -------------------------------------------------------------------------------
    def remote(self):
        if self._remote is None:
            from ._remote_client import RemoteClient

            self._remote = RemoteClient(self.base_url, self.api_key, max_retries=self.max_retries)
        return self._remote

    def _body(self, texts: list[str], input_type: str, model: str) -> dict[str, Any]:
        opts = self.options(input_type)
        body: dict[str, Any] = {"model": model, "input": list(texts), "encoding_format": "float"}
        if "dimensions" in opts:
            body["dimensions"] = opts.pop("dimensions")
        body["extra_body"] = opts  # ParaLLM's extensions; other servers ignore unknown fields
        if self.timeout:
            body["timeout"] = self.timeout
        return body

    def _remote_embed(self, texts: list[str], input_type: str) -> list[list[float]]:
        from ._remote_client import _raise

        client = self.remote()
        try:
            resp = client.sync_client.embeddings.create(**self._body(texts, input_type, client.resolve_model(self.model)))
        except Exception as exc:  # noqa: BLE001  (openai errors -> the engine's typed errors)
            _raise(exc)
        return [list(d.embedding) for d in sorted(resp.data, key=lambda d: d.index)]

    async def _aremote_embed(self, texts: list[str], input_type: str) -> list[list[float]]:
        from ._remote_client import _raise

        client = self.remote()
        try:
            model = await client.aresolve_model(self.model)
            resp = await client.async_client.embeddings.create(**self._body(texts, input_type, model))
        except Exception as exc:  # noqa: BLE001
            _raise(exc)
        return [list(d.embedding) for d in sorted(resp.data, key=lambda d: d.index)]
