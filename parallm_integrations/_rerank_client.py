"""What the LangChain and LlamaIndex rerank classes share: the shared in-process rerank engine
(``parallm_engine.get_rerank_engine``: a cross-encoder's engine, or the ``Engine`` chat uses for a decoder
reranker such as Qwen3-Reranker), or a server's ``/rerank`` with ``base_url=`` (``parallm serve
--rerank-model``, vLLM, Jina-compatible servers). Imports neither the engine nor MLX until first in-process use.

A call takes a query and any number of documents and returns ``(index, relevance_score)`` pairs, best first.
With ``base_url`` the documents go in requests of at most :data:`REMOTE_BATCH` (each document's score does
not depend on the others), halved while the server refuses that many in one request.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ._common import engine_import, is_default_model

#: Documents per ``/rerank`` request: ``parallm serve``'s default share of its queue for one request.
REMOTE_BATCH = 256


class RerankClient:
    """``rerank(query, texts, top_n)`` / ``arerank`` on the shared engine or a server (``base_url``)."""

    def __init__(self, model: str | None, engine_kwargs: dict | None = None, *, base_url: str | None = None,
                 api_key: str | None = None, max_retries: int | None = 2, instruction: str | None = None,
                 kind: str | None = None, truncate: bool = True, timeout: float | None = None):
        self.model = model
        self.engine_kwargs = dict(engine_kwargs or {})
        self.base_url = base_url
        self.api_key = api_key
        self.max_retries = max_retries
        self.instruction, self.kind, self.truncate, self.timeout = instruction, kind, truncate, timeout
        self._engine = None
        self._remote = None
        self._remote_batch = REMOTE_BATCH

    # -- in-process -----------------------------------------------------------------------------
    def engine(self):
        if self._engine is None or not self._engine.is_alive:
            with engine_import("ParaLLM rerank without base_url="):
                from parallm_engine import get_rerank_engine

                self._engine = get_rerank_engine(None if is_default_model(self.model) else self.model,
                                                 kind=self.kind, **self.engine_kwargs)
        return self._engine

    def _options(self) -> dict[str, Any]:
        opts: dict[str, Any] = {"truncate": self.truncate, "kind": self.kind}
        if self.instruction is not None:
            opts["instruction"] = self.instruction
        return opts

    def rerank(self, query: str, texts: list[str], top_n: int | None = None) -> list[tuple[int, float]]:
        if not texts:
            return []
        if self.base_url:
            return _top(self._remote_scores(query, texts), top_n)
        results = self.engine().rerank(query, list(texts), top_n=top_n, wait=True, **self._options())
        return [(r.index, r.relevance_score) for r in results]

    async def arerank(self, query: str, texts: list[str], top_n: int | None = None) -> list[tuple[int, float]]:
        if not texts:
            return []
        if self.base_url:
            return _top(await self._aremote_scores(query, texts), top_n)
        engine = self._engine if self._engine is not None and self._engine.is_alive \
            else await asyncio.to_thread(self.engine)  # loading (seconds) off the event loop
        work = engine.arerank(query, list(texts), top_n=top_n, wait=True, **self._options())
        results = await (asyncio.wait_for(work, self.timeout) if self.timeout else work)
        return [(r.index, r.relevance_score) for r in results]

    # -- base_url -------------------------------------------------------------------------------
    def remote(self):
        if self._remote is None:
            from ._remote_client import RemoteClient

            self._remote = RemoteClient(self.base_url, self.api_key, max_retries=self.max_retries)
        return self._remote

    def _body(self, query: str, part: list[str], model: str) -> dict[str, Any]:
        body: dict[str, Any] = {"model": model, "query": query, "documents": part}
        if self.instruction is not None:
            body["instruction"] = self.instruction  # ParaLLM's extension (a decoder reranker's task)
        if not self.truncate:
            body["truncate"] = False
        return body

    def _remote_scores(self, query: str, texts: list[str]) -> list[float]:
        client = self.remote()
        try:
            model = client.resolve_model(self.model)
        except Exception as exc:  # noqa: BLE001
            _raise_remote(exc)
        scores: list[float] = []
        while len(scores) < len(texts):
            part = texts[len(scores) : len(scores) + self._remote_batch]
            try:
                resp = client.sync_client.post("/rerank", body=self._body(query, part, model), cast_to=object,
                                               options={"timeout": self.timeout} if self.timeout else {})
            except Exception as exc:  # noqa: BLE001  (openai errors -> the engine's typed errors)
                self._retry_smaller(exc, len(part))
                continue
            scores += _scores(resp, len(part))
        return scores

    async def _aremote_scores(self, query: str, texts: list[str]) -> list[float]:
        client = self.remote()
        try:
            model = await client.aresolve_model(self.model)
        except Exception as exc:  # noqa: BLE001
            _raise_remote(exc)
        scores: list[float] = []
        while len(scores) < len(texts):
            part = texts[len(scores) : len(scores) + self._remote_batch]
            try:
                resp = await client.async_client.post("/rerank", body=self._body(query, part, model),
                                                      cast_to=object,
                                                      options={"timeout": self.timeout} if self.timeout else {})
            except Exception as exc:  # noqa: BLE001
                self._retry_smaller(exc, len(part))
                continue
            scores += _scores(resp, len(part))
        return scores

    def _retry_smaller(self, exc: BaseException, sent: int) -> None:
        """Return (the caller sends fewer documents) if the server refused ``sent`` as too many for one
        request; else raise ``exc`` as the engine's typed error."""
        from ._remote_errors import _error_fields

        if sent > 1 and getattr(exc, "status_code", None) == 400 and _error_fields(exc)[2] in (
                "too_many_documents", "too_many_sequences"):
            self._remote_batch = max(1, min(self._remote_batch, sent) // 2)
            return
        _raise_remote(exc)


def _scores(resp, sent: int) -> list[float]:
    """Each document's score in input order from a ``/rerank`` answer (all documents: no top_n was sent)."""
    from .errors import ParaLLMError

    results = resp.get("results") if isinstance(resp, dict) else None
    if not isinstance(results, list) or len(results) != sent:
        raise ParaLLMError(f"the server answered {len(results) if isinstance(results, list) else 'no'} rerank "
                           f"results for {sent} documents")
    scores: list = [None] * sent
    for r in results:
        scores[int(r["index"])] = float(r["relevance_score"])
    if any(s is None for s in scores):
        raise ParaLLMError("the server's rerank results do not cover every document")
    return scores


def _top(scores: list[float], top_n: int | None) -> list[tuple[int, float]]:
    ranked = sorted(enumerate(scores), key=lambda p: (-p[1], p[0]))
    return ranked if top_n is None else ranked[:top_n]


def _raise_remote(exc: BaseException):
    from ._remote_client import _raise

    _raise(exc)
