"""LangChain document compressor that reranks on the shared ParaLLM engine.

::

    from langchain_classic.retrievers import ContextualCompressionRetriever
    from parallm_integrations import ParaLLMRerank

    rerank = ParaLLMRerank(model="BAAI/bge-reranker-base", top_n=3)   # loads nothing yet
    retriever = ContextualCompressionRetriever(base_compressor=rerank, base_retriever=vectorstore.as_retriever())
    docs = retriever.invoke("what is the capital of France?")   # best 3, metadata["relevance_score"]

A cross-encoder (bge-reranker, ms-marco MiniLM) runs on its own encoder engine; a decoder reranker
(Qwen3-Reranker) on the same engine (and batch, and prefix cache) as every ``ChatParaLLM`` naming that model.
``base_url=`` sends the documents to a server's ``/rerank`` instead (``parallm serve --rerank-model``, vLLM).
As langchain-cohere's ``CohereRerank``: ``compress_documents`` returns copies of the best ``top_n``
documents, best first, each with its ``relevance_score`` in its metadata.
"""

from __future__ import annotations

from collections.abc import Sequence
from copy import deepcopy
from typing import Any

from langchain_core.callbacks import Callbacks
from langchain_core.documents import BaseDocumentCompressor, Document
from langchain_core.utils import from_env, secret_from_env
from pydantic import ConfigDict, Field, PrivateAttr, SecretStr

from ._rerank_client import RerankClient


class ParaLLMRerank(BaseDocumentCompressor):
    """Rerank documents with a local reranker on the shared in-process engine (or a server with ``base_url``)."""

    # forbid: a misspelt or unknown argument is an error, not silently the default model / setting
    model_config = ConfigDict(populate_by_name=True, protected_namespaces=(), extra="forbid")

    model: str | None = Field(default=None, alias="model_name")
    """A reranker: a cross-encoder (BERT / XLM-R ``*ForSequenceClassification``, e.g. BAAI/bge-reranker-base) or a
    decoder reranker (Qwen/Qwen3-Reranker-0.6B): a model directory or a Hugging Face id."""

    top_n: int | None = Field(default=3, ge=1)
    """Documents to keep (the best ``top_n``); None keeps them all, reordered."""

    instruction: str | None = None
    """A decoder reranker's task description (default the card's web-search task); cross-encoders take none."""

    kind: str | None = None
    """``"cross-encoder"`` or ``"decoder"`` for a model whose files do not say which it is."""

    truncate: bool = True
    """Cut a (query, document) pair longer than the context window (default); False: refuse it."""

    engine_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Settings for the shared engine when it is first created (as ``ChatParaLLM.engine_kwargs``)."""

    timeout: float | None = Field(default=None, alias="request_timeout")
    """Seconds an async call (or, with ``base_url``, an HTTP call) may take."""

    max_retries: int | None = 2
    """Retries of failed HTTP calls when ``base_url`` is set."""

    base_url: str | None = Field(default_factory=from_env("PARALLM_BASE_URL", default=None))
    """URL of a server with a ``/rerank`` route (``http://localhost:8000/v1``) to use instead of the engine."""

    api_key: SecretStr | None = Field(default_factory=secret_from_env("PARALLM_API_KEY", default=None))
    """API key for ``base_url``; read from ``PARALLM_API_KEY`` if not given."""

    _client: RerankClient | None = PrivateAttr(default=None)

    @property
    def client(self) -> RerankClient:
        if self._client is None:
            self._client = RerankClient(
                self.model, self.engine_kwargs, base_url=self.base_url,
                api_key=self.api_key.get_secret_value() if self.api_key else None, max_retries=self.max_retries,
                instruction=self.instruction, kind=self.kind, truncate=self.truncate, timeout=self.timeout)
        return self._client

    def rerank(self, documents: Sequence[str | Document], query: str, *,
               top_n: int | None = -1) -> list[dict[str, Any]]:
        """``[{"index", "relevance_score"}]`` best first (``top_n`` -1: the field's)."""
        texts = [d.page_content if isinstance(d, Document) else d for d in documents]
        ranked = self.client.rerank(query, texts, self.top_n if top_n == -1 else top_n)
        return [{"index": i, "relevance_score": s} for i, s in ranked]

    async def arerank(self, documents: Sequence[str | Document], query: str, *,
                      top_n: int | None = -1) -> list[dict[str, Any]]:
        texts = [d.page_content if isinstance(d, Document) else d for d in documents]
        ranked = await self.client.arerank(query, texts, self.top_n if top_n == -1 else top_n)
        return [{"index": i, "relevance_score": s} for i, s in ranked]

    def compress_documents(self, documents: Sequence[Document], query: str,
                           callbacks: Callbacks | None = None) -> Sequence[Document]:
        return _with_scores(documents, self.rerank(documents, query))

    async def acompress_documents(self, documents: Sequence[Document], query: str,
                                  callbacks: Callbacks | None = None) -> Sequence[Document]:
        return _with_scores(documents, await self.arerank(documents, query))


def _with_scores(documents: Sequence[Document], ranked: list[dict[str, Any]]) -> list[Document]:
    out = []
    for r in ranked:
        doc = documents[r["index"]]
        copy = Document(page_content=doc.page_content, metadata=deepcopy(doc.metadata), id=doc.id)
        copy.metadata["relevance_score"] = r["relevance_score"]
        out.append(copy)
    return out
