"""langchain-tests standard unit tests for ChatParaLLM (no model is loaded: construction is lazy)."""

from __future__ import annotations

from langchain_tests.unit_tests import ChatModelUnitTests

from parallm_integrations import ChatParaLLM


class TestChatParaLLMUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[ChatParaLLM]:
        return ChatParaLLM

    @property
    def chat_model_params(self) -> dict:
        # No max_tokens / stop here: test_standard_params passes its own.
        return {"temperature": 0}

    @property
    def init_from_env_params(self) -> tuple[dict, dict, dict]:
        return (
            {"PARALLM_API_KEY": "secret-key", "PARALLM_BASE_URL": "http://localhost:8000/v1"},
            {},
            {"api_key": "secret-key", "base_url": "http://localhost:8000/v1"},
        )
