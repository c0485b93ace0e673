"""``ParaLLMEmbedding``: a LlamaIndex ``BaseEmbedding`` on the shared ParaLLM engine (or ``base_url=``).

::

    from llama_index.core import Settings, VectorStoreIndex
    from parallm_integrations.llama_index import ParaLLMEmbedding, ParaLLMLlamaIndex

    Settings.embed_model = ParaLLMEmbedding(model="Qwen/Qwen3-Embedding-0.6B")   # or model_name=
    Settings.llm = ParaLLMLlamaIndex()
    index = VectorStoreIndex.from_documents(docs)   # the nodes' texts: embedded in batches of 256

Every method is native: the batch methods put their texts on the engine together (``embed_batch_size``
defaults to 256 so LlamaIndex hands over large batches), the async ones wait on the caller's own loop.
``get_text_embedding_batch`` takes any number of texts and shows LlamaIndex's progress bar from 1,000
texts on unless told otherwise (``show_progress``).
"""

from __future__ import annotations

from typing import Any

from llama_index.core.base.embeddings.base import BaseEmbedding, Embedding
from llama_index.core.bridge.pydantic import ConfigDict, Field, PrivateAttr

from parallm_integrations._embedding_client import PROGRESS_MIN_TEXTS, EmbeddingClient

#: Texts LlamaIndex hands over per batch call (its own default is 10: one call per 10 nodes).
EMBED_BATCH_SIZE = 256


class ParaLLMEmbedding(BaseEmbedding):
    """Embeddings from a local model on the shared in-process engine (or an OpenAI-compatible server)."""

    # forbid: a misspelt or unknown argument is an error, not silently the default model / setting
    model_config = ConfigDict(extra="forbid")

    model_name: str | None = Field(default=None, description="An embedding model (as ParaLLMEmbeddings.model); "
                                   "``model=`` is accepted too.")
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="Shared engine settings.")
    query_instruction: str | None = Field(default=None, description="Task description for queries.")
    pooling: str | None = Field(default=None, description="Override the pooling: last / mean / cls.")
    normalize: bool | None = Field(default=None, description="Override the normalisation.")
    dimensions: int | None = Field(default=None, description="Matryoshka truncation (renormalised).")
    truncate: bool = Field(default=False, description="Cut texts over the context window (default: refuse).")
    timeout: float | None = Field(default=None, description="Seconds an async or HTTP call may take.")
    base_url: str | None = Field(default=None, description="An OpenAI-compatible server instead of the engine.")
    api_key: str | None = Field(default=None, description="API key for base_url.")
    max_retries: int | None = Field(default=2, description="HTTP retries with base_url.")
    show_progress: bool | None = Field(
        default=None, description=f"Progress bar of the batch methods; None: from {PROGRESS_MIN_TEXTS} texts on.")

    _client: EmbeddingClient = PrivateAttr()

    def __init__(self, embed_batch_size: int = EMBED_BATCH_SIZE, **kwargs: Any):
        if "model" in kwargs:  # ParaLLMLlamaIndex's and LangChain's spelling
            model = kwargs.pop("model")
            if kwargs.get("model_name") not in (None, model):
                raise ValueError(f"model={model!r} and model_name={kwargs['model_name']!r} differ: give one")
            kwargs["model_name"] = model
        super().__init__(embed_batch_size=embed_batch_size, **kwargs)
        self._client = EmbeddingClient(
            self.model_name, self.engine_kwargs, base_url=self.base_url, api_key=self.api_key,
            max_retries=self.max_retries, instruction=self.query_instruction, pooling=self.pooling,
            normalize=self.normalize, dimensions=self.dimensions, truncate=self.truncate, timeout=self.timeout)

    @classmethod
    def class_name(cls) -> str:
        return "ParaLLMEmbedding"

    def _progress(self, n: int, asked: bool) -> bool:
        if asked or self.show_progress is not None:
            return asked or bool(self.show_progress)
        return n >= PROGRESS_MIN_TEXTS

    def get_text_embedding_batch(self, texts: list[str], show_progress: bool = False,
                                 **kwargs: Any) -> list[Embedding]:
        return super().get_text_embedding_batch(texts, self._progress(len(texts), show_progress), **kwargs)

    async def aget_text_embedding_batch(self, texts: list[str], show_progress: bool = False,
                                        **kwargs: Any) -> list[Embedding]:
        return await super().aget_text_embedding_batch(texts, self._progress(len(texts), show_progress), **kwargs)

    # LlamaIndex draws the batch methods' bar; the client's own stays off (progress=False).
    def _get_query_embedding(self, query: str) -> list[float]:
        return self._client.embed([query], "query", False)[0]

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return (await self._client.aembed([query], "query", False))[0]

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._client.embed([text], "document", False)[0]

    async def _aget_text_embedding(self, text: str) -> list[float]:
        return (await self._client.aembed([text], "document", False))[0]

    def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        return self._client.embed(list(texts), "document", False)

    async def _aget_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        return await self._client.aembed(list(texts), "document", False)
