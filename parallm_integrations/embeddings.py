"""LangChain ``Embeddings`` on the shared ParaLLM engine.

::

    from parallm_integrations import ParaLLMEmbeddings

    emb = ParaLLMEmbeddings(model="Qwen/Qwen3-Embedding-0.6B")   # loads nothing yet
    vectors = emb.embed_documents(["first passage", "second passage"])   # any number, batched
    q = emb.embed_query("what is in the first passage?")   # with the model's query prompt

A decoder embedding model runs on the same engine (and batch) as every ``ChatParaLLM`` naming that model;
an encoder model (bge, e5, all-MiniLM) on an mlx-embeddings engine. ``base_url=`` sends the texts to an
OpenAI-compatible server's ``/v1/embeddings`` instead (``parallm serve``, vLLM, Ollama, LM Studio).
``embed_documents`` takes any number of texts (a corpus of thousands: a share of the engine's queue in
flight at a time, or requests of a few hundred inputs to a server), with a progress bar on long runs.
"""

from __future__ import annotations

from typing import Any

from langchain_core.embeddings import Embeddings
from langchain_core.utils import from_env, secret_from_env
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SecretStr

from ._embedding_client import EmbeddingClient


class ParaLLMEmbeddings(BaseModel, Embeddings):
    """Embeddings from a local model on the shared in-process engine (or a server with ``base_url``)."""

    # forbid: a misspelt or unknown argument is an error, not silently the default model / setting
    model_config = ConfigDict(populate_by_name=True, protected_namespaces=(), extra="forbid")

    model: str | None = Field(default=None, alias="model_name")
    """An embedding model: a model directory, a repo id in the local Hugging Face cache, or a .gguf file,
    resolved as for the chat models. Decoder models need an embedding configuration (sentence-transformers
    ``modules.json``, as Qwen3-Embedding ships) or ``pooling``; BERT-family encoders need mlx-embeddings."""

    engine_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Settings for the shared engine when it is first created (as ``ChatParaLLM.engine_kwargs``)."""

    query_instruction: str | None = None
    """A task description for queries (``Instruct: {task}\\nQuery: {query}``, the Qwen3-Embedding card's
    format). None: the model's own query prompt (``config_sentence_transformers.json``), if any."""

    pooling: str | None = None
    """Override the model's pooling: ``"last"``, ``"mean"`` or ``"cls"`` (lets any decoder embed)."""

    normalize: bool | None = None
    """Override the model's normalisation (unit-length vectors)."""

    dimensions: int | None = None
    """Keep the first ``dimensions`` values, renormalised (Matryoshka models only, e.g. Qwen3-Embedding)."""

    truncate: bool = False
    """Cut texts longer than the model's context window (default: refuse them with
    ``ContextLengthExceededError``)."""

    timeout: float | None = Field(default=None, alias="request_timeout")
    """Seconds an async call (or, with ``base_url``, an HTTP call) may take."""

    max_retries: int | None = 2
    """Retries of failed HTTP calls when ``base_url`` is set."""

    base_url: str | None = Field(default_factory=from_env("PARALLM_BASE_URL", default=None))
    """URL of an OpenAI-compatible server (``http://localhost:8000/v1``) to use instead of the engine."""

    api_key: SecretStr | None = Field(default_factory=secret_from_env("PARALLM_API_KEY", default=None))
    """API key for ``base_url``; read from ``PARALLM_API_KEY`` if not given."""

    show_progress_bar: bool | None = None
    """A tqdm progress bar for ``embed_documents``: None shows it for calls of 1,000 texts or more."""

    _client: EmbeddingClient | None = PrivateAttr(default=None)

    @property
    def client(self) -> EmbeddingClient:
        if self._client is None:
            self._client = EmbeddingClient(
                self.model, self.engine_kwargs, base_url=self.base_url,
                api_key=self.api_key.get_secret_value() if self.api_key else None, max_retries=self.max_retries,
                instruction=self.query_instruction, pooling=self.pooling, normalize=self.normalize,
                dimensions=self.dimensions, truncate=self.truncate, timeout=self.timeout)
        return self._client

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return self.client.embed(list(texts), "document", self.show_progress_bar)

    def embed_query(self, text: str) -> list[float]:
        return self.client.embed([text], "query")[0]

    async def aembed_documents(self, texts: list[str]) -> list[list[float]]:
        return await self.client.aembed(list(texts), "document", self.show_progress_bar)

    async def aembed_query(self, text: str) -> list[float]:
        return (await self.client.aembed([text], "query"))[0]
