"""langchain-tests standard integration tests for ChatParaLLM on the real default model
(SmolLM2-135M-Instruct, in-process). About 70 short generations; they share one engine."""

from __future__ import annotations

import pytest
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage
from langchain_tests.integration_tests import ChatModelIntegrationTests

from parallm_integrations import ChatParaLLM

# A long shared prefix, so a second request reads most of its prompt from the radix cache.
_CACHE_PROBE_SYSTEM = "You are a terse assistant. " + " ".join(f"Rule {i}: answer briefly." for i in range(40))


class TestChatParaLLMIntegration(ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[ChatParaLLM]:
        return ChatParaLLM

    @property
    def chat_model_params(self) -> dict:
        # Greedy and short: the suite makes ~70 generations on 2 CPU cores. Structured-output and
        # tool-call tests need room for a whole JSON object, so not less than 64 tokens. Greedy
        # decoding of a 135M model loops ("a cat is a cat, a cat is a cat, ...") until max_tokens,
        # inside JSON strings too; a frequency penalty (over the output only, so copying names and
        # numbers from the prompt into tool arguments is unaffected) is the usual remedy.
        return {"temperature": 0, "max_tokens": 64, "frequency_penalty": 0.8}

    @property
    def model_override_value(self) -> str:
        # The default model by its name: per-call `model=` goes through the override path
        # (resolving the engine for that name) without loading a second model.
        return "SmolLM2-135M-Instruct"

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def supported_usage_metadata_details(self) -> dict:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    @pytest.mark.xfail(
        reason=(
            "json_mode constrains decoding to *a* JSON object (its contract, as in OpenAI's API); the keys "
            "must come from following the prompt's instructions, which SmolLM2-135M does not do reliably "
            "(asked for 'setup' and 'punchline' it writes {\"setup\": \"...\"} and closes the object). With "
            "the schema given (json_schema / function_calling) decoding is constrained to it and the "
            "structured-output tests pass."
        ),
        strict=False,
    )
    def test_json_mode(self, model: BaseChatModel) -> None:
        super().test_json_mode(model)

    @pytest.mark.xfail(
        reason=(
            "The test binds get_weather with tool_choice unset ('auto'), so whether to call a tool is the "
            "model's decision, and SmolLM2-135M answers in prose instead of calling it. Constrained decoding "
            "can only force a call when the caller requires one (tool_choice='any' / a name: those tests pass)."
        ),
        strict=False,
    )
    def test_agent_loop(self, model: BaseChatModel) -> None:
        super().test_agent_loop(model)

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        llm = ChatParaLLM(temperature=0, max_tokens=4)
        messages = [("system", _CACHE_PROBE_SYSTEM), ("human", "Say hi.")]
        llm.invoke(messages)  # fills the prefix cache
        if stream:
            full = None
            for chunk in llm.stream(messages):
                full = chunk if full is None else full + chunk
            assert full is not None
            msg = full
        else:
            msg = llm.invoke(messages)
        assert msg.usage_metadata is not None
        assert msg.usage_metadata["input_token_details"]["cache_read"] > 0
        return msg  # type: ignore[return-value]
