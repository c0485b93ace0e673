"""langchain-tests standard unit tests for ParaLLMEmbeddings (no model is loaded: construction is lazy)."""

from __future__ import annotations

from langchain_tests.unit_tests import EmbeddingsUnitTests

from parallm_integrations import ParaLLMEmbeddings


class TestParaLLMEmbeddingsUnit(EmbeddingsUnitTests):
    @property
    def embeddings_class(self) -> type[ParaLLMEmbeddings]:
        return ParaLLMEmbeddings

    @property
    def embedding_model_params(self) -> dict:
        return {"model": "Qwen/Qwen3-Embedding-0.6B"}

    @property
    def init_from_env_params(self) -> tuple[dict, dict, dict]:
        return (
            {"PARALLM_API_KEY": "secret-key", "PARALLM_BASE_URL": "http://localhost:8000/v1"},
            {},
            {"api_key": "secret-key", "base_url": "http://localhost:8000/v1"},
        )
