"""What the LangChain and LlamaIndex embedding classes share: the shared in-process engine (one per model
per process: ``parallm_engine.get_embedding_engine``, the same ``Engine`` chat uses for a decoder model), or
an OpenAI-compatible server's ``/v1/embeddings`` with ``base_url=``. Imports neither the engine nor MLX until
first in-process use.

A call takes any number of texts. In-process, the engine keeps a share of its queue in flight at a time
and waits where other callers fill it (``EmbeddingAPI.embed_results(wait=True)``); with ``base_url`` the
texts go in requests of at most :data:`REMOTE_BATCH` inputs, one after another (a server that allows
fewer per request, ``parallm serve``'s ``too_many_inputs`` / ``too_many_sequences``, gets halves until they fit). A progress bar
(tqdm) shows on calls of :data:`PROGRESS_MIN_TEXTS` texts or more, or always / never as the caller says.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ._common import engine_import, is_default_model

#: Inputs per ``/v1/embeddings`` request: ``parallm serve``'s default share of its queue for one request
#: (a quarter of 1,024), and under OpenAI's 2,048.
REMOTE_BATCH = 256

#: Texts from which a call shows a progress bar when the caller left it unset.
PROGRESS_MIN_TEXTS = 1000


def progress_bar(n: int, show: bool | None):
    """A tqdm bar for ``n`` texts, or None (``show`` None: only from :data:`PROGRESS_MIN_TEXTS` texts)."""
    if not (show if show is not None else n >= PROGRESS_MIN_TEXTS):
        return None
    from tqdm.auto import tqdm

    return tqdm(total=n, desc="Embedding", unit="text")


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
        self._remote_batch = REMOTE_BATCH  # halved while the server refuses requests this large

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

    def embed(self, texts: list[str], input_type: str, progress: bool | None = None) -> list[list[float]]:
        if not texts:
            return []
        bar = progress_bar(len(texts), progress)
        try:
            if self.base_url:
                return self._remote_embed(texts, input_type, bar)
            return self.engine().embed(list(texts), wait=True, on_progress=None if bar is None else bar.update,
                                       **self.options(input_type))
        finally:
            if bar is not None:
                bar.close()

    async def aembed(self, texts: list[str], input_type: str, progress: bool | None = None) -> list[list[float]]:
        if not texts:
            return []
        bar = progress_bar(len(texts), progress)
        try:
            if self.base_url:
                work = self._aremote_embed(texts, input_type, bar)
            else:
                engine = self._engine if self._engine is not None and self._engine.is_alive \
                    else await asyncio.to_thread(self.engine)  # loading (seconds) off the event loop
                work = engine.aembed(list(texts), wait=True, on_progress=None if bar is None else bar.update,
                                     **self.options(input_type))
            return await (asyncio.wait_for(work, self.timeout) if self.timeout and not self.base_url else work)
        finally:
            if bar is not None:
                bar.close()

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

    def _remote_embed(self, texts: list[str], input_type: str, bar=None) -> list[list[float]]:
        client = self.remote()
        try:
            model = client.resolve_model(self.model)
        except Exception as exc:  # noqa: BLE001
            _raise_remote(exc)
        out: list[list[float]] = []
        while len(out) < len(texts):
            part = texts[len(out) : len(out) + self._remote_batch]
            try:
                resp = client.sync_client.embeddings.create(**self._body(part, input_type, model))
            except Exception as exc:  # noqa: BLE001  (openai errors -> the engine's typed errors)
                self._retry_smaller(exc, len(part))
                continue
            out += _vectors(resp, len(part))
            if bar is not None:
                bar.update(len(part))
        return out

    async def _aremote_embed(self, texts: list[str], input_type: str, bar=None) -> list[list[float]]:
        client = self.remote()
        try:
            model = await client.aresolve_model(self.model)
        except Exception as exc:  # noqa: BLE001
            _raise_remote(exc)
        out: list[list[float]] = []
        while len(out) < len(texts):
            part = texts[len(out) : len(out) + self._remote_batch]
            try:
                resp = await client.async_client.embeddings.create(**self._body(part, input_type, model))
            except Exception as exc:  # noqa: BLE001
                self._retry_smaller(exc, len(part))
                continue
            out += _vectors(resp, len(part))
            if bar is not None:
                bar.update(len(part))
        return out

    def _retry_smaller(self, exc: BaseException, sent: int) -> None:
        """Return (the caller sends a smaller request) if the server refused ``sent`` inputs as too many for
        one request; else raise ``exc`` as the engine's typed error."""
        from ._remote_errors import _error_fields

        if sent > 1 and getattr(exc, "status_code", None) == 400 and _error_fields(exc)[2] in (
                "too_many_inputs", "too_many_sequences"):
            self._remote_batch = max(1, min(self._remote_batch, sent) // 2)
            return
        _raise_remote(exc)


def _vectors(resp, sent: int) -> list[list[float]]:
    vectors = [list(d.embedding) for d in sorted(resp.data, key=lambda d: d.index)]
    if len(vectors) != sent:  # the next request would start at the wrong text
        from .errors import ParaLLMError

        raise ParaLLMError(f"the server answered {len(vectors)} embeddings for {sent} inputs")
    return vectors


def _raise_remote(exc: BaseException):
    from ._remote_client import _raise

    _raise(exc)
