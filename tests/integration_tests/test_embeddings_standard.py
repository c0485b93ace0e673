"""langchain-tests standard integration tests for ParaLLMEmbeddings, in-process, on a tiny random-weight
qwen3 "Qwen3-Embedding" (sentence-transformers files: last-token pooling, normalised) built once."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

from langchain_tests.integration_tests import EmbeddingsIntegrationTests

from parallm_integrations import ParaLLMEmbeddings


@functools.lru_cache(maxsize=1)
def tiny_embedder() -> str:
    from tests.embedding_models import build_decoder_embedder

    return str(build_decoder_embedder(Path(tempfile.mkdtemp(prefix="parallm-emb-")) / "qwen3-embedding-tiny"))


class TestParaLLMEmbeddingsIntegration(EmbeddingsIntegrationTests):
    @property
    def embeddings_class(self) -> type[ParaLLMEmbeddings]:
        return ParaLLMEmbeddings

    @property
    def embedding_model_params(self) -> dict:
        return {"model": tiny_embedder(), "engine_kwargs": {"decode_lanes": 1}}
