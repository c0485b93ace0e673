"""``ParaLLMRerank``: a LlamaIndex node postprocessor that reranks on the shared ParaLLM engine (or ``base_url=``).

::

    from parallm_integrations.llama_index import ParaLLMRerank

    query_engine = index.as_query_engine(similarity_top_k=10,
                                         node_postprocessors=[ParaLLMRerank(model="BAAI/bge-reranker-base", top_n=3)])

As LlamaIndex's ``CohereRerank`` / ``SentenceTransformerRerank``: each node's content (``MetadataMode.EMBED``)
is scored against the query, and the best ``top_n`` come back best first with the relevance as their score.
The async path waits on the caller's own loop (no thread).
"""

from __future__ import annotations

from typing import Any

from llama_index.core.bridge.pydantic import ConfigDict, Field, PrivateAttr
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle

from parallm_integrations._rerank_client import RerankClient


class ParaLLMRerank(BaseNodePostprocessor):
    """Rerank nodes with a local reranker on the shared in-process engine (or a server's ``/rerank``)."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    model_name: str | None = Field(default=None, description="A reranker (cross-encoder or Qwen3-Reranker); "
                                   "``model=`` is accepted too.")
    top_n: int | None = Field(default=2, ge=1, description="Nodes to keep (None: all, reordered).")
    instruction: str | None = Field(default=None, description="A decoder reranker's task description.")
    kind: str | None = Field(default=None, description="'cross-encoder' or 'decoder' where the files do not say.")
    truncate: bool = Field(default=True, description="Cut a pair over the context window (False: refuse it).")
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="Shared engine settings.")
    timeout: float | None = Field(default=None, description="Seconds an async or HTTP call may take.")
    base_url: str | None = Field(default=None, description="A server with /rerank instead of the engine.")
    api_key: str | None = Field(default=None, description="API key for base_url.")
    max_retries: int | None = Field(default=2, description="HTTP retries with base_url.")

    _client: RerankClient = PrivateAttr()

    def __init__(self, **kwargs: Any):
        if "model" in kwargs:  # ParaLLMLlamaIndex's and LangChain's spelling
            model = kwargs.pop("model")
            if kwargs.get("model_name") not in (None, model):
                raise ValueError(f"model={model!r} and model_name={kwargs['model_name']!r} differ: give one")
            kwargs["model_name"] = model
        super().__init__(**kwargs)
        self._client = RerankClient(
            self.model_name, self.engine_kwargs, base_url=self.base_url, api_key=self.api_key,
            max_retries=self.max_retries, instruction=self.instruction, kind=self.kind, truncate=self.truncate,
            timeout=self.timeout)

    @classmethod
    def class_name(cls) -> str:
        return "ParaLLMRerank"

    @staticmethod
    def _inputs(nodes: list[NodeWithScore], query_bundle: QueryBundle | None) -> tuple[str, list[str]]:
        if query_bundle is None:
            raise ValueError("ParaLLMRerank needs the query (query_bundle or query_str)")
        return query_bundle.query_str, [n.node.get_content(metadata_mode=MetadataMode.EMBED) for n in nodes]

    @staticmethod
    def _reordered(nodes: list[NodeWithScore], ranked: list[tuple[int, float]]) -> list[NodeWithScore]:
        return [NodeWithScore(node=nodes[i].node, score=score) for i, score in ranked]

    def _postprocess_nodes(self, nodes: list[NodeWithScore],
                           query_bundle: QueryBundle | None = None) -> list[NodeWithScore]:
        if not nodes:
            return []
        query, texts = self._inputs(nodes, query_bundle)
        return self._reordered(nodes, self._client.rerank(query, texts, self.top_n))

    async def _apostprocess_nodes(self, nodes: list[NodeWithScore],
                                  query_bundle: QueryBundle | None = None) -> list[NodeWithScore]:
        if not nodes:
            return []
        query, texts = self._inputs(nodes, query_bundle)
        return self._reordered(nodes, await self._client.arerank(query, texts, self.top_n))
