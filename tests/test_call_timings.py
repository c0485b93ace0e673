"""Every call's engine timings reach its caller: ``queue_s`` / ``prefill_s`` / ``decode_s`` and
``cached_tokens`` in LangChain's ``response_metadata`` (ChatParaLLM; ``generation_info`` of ParaLLM), in
LlamaIndex's ``raw``, in-process and over ``base_url=`` (the server's ``usage.timings`` extension)."""

from __future__ import annotations

import pytest

from parallm_engine.serve.server import ServerThread

KEY = "timings-key"
QUESTION = [("system", "You are a terse assistant. Answer in one word."), ("user", "Capital of France?")]


@pytest.fixture(scope="module")
def server(engine):
    with ServerThread(engine=engine, api_key=KEY) as srv:
        yield srv


def _check(meta: dict, cache_read: int | None = None) -> None:
    for key in ("queue_s", "prefill_s", "decode_s"):
        assert isinstance(meta[key], float) and meta[key] >= 0.0, (key, meta)
    assert meta["prefill_s"] > 0.0 and meta["decode_s"] > 0.0  # it prefilled and decoded
    if cache_read is not None:
        assert meta["cached_tokens"] == cache_read


@pytest.mark.parametrize("path", ["engine", "base_url"])
def test_chat_model_metadata_carries_the_timings(engine, server, path):
    from parallm_integrations import ChatParaLLM

    remote = {"base_url": server.base_url, "api_key": KEY, "max_retries": 0} if path == "base_url" else {}
    llm = ChatParaLLM(temperature=0, max_tokens=5, **remote)
    llm.invoke(QUESTION)  # the system prompt is cached from here on
    msg = llm.invoke(QUESTION)
    _check(msg.response_metadata, msg.usage_metadata["input_token_details"]["cache_read"])
    assert msg.response_metadata["cached_tokens"] > 0
    streamed = None
    for chunk in llm.stream(QUESTION):
        streamed = chunk if streamed is None else streamed + chunk
    _check(streamed.response_metadata, streamed.usage_metadata["input_token_details"]["cache_read"])


@pytest.mark.parametrize("path", ["engine", "base_url"])
def test_text_llm_generation_info_carries_the_timings(engine, server, path):
    from parallm_integrations import ParaLLM

    remote = {"base_url": server.base_url, "api_key": KEY, "max_retries": 0} if path == "base_url" else {}
    llm = ParaLLM(temperature=0, max_tokens=4, **remote)
    result = llm.generate(["The capital of France is", "The capital of Spain is"])
    for gens in result.generations:
        _check(gens[0].generation_info)
    streamed = None
    for chunk in llm._stream("The capital of Italy is"):
        streamed = chunk if streamed is None else streamed + chunk
    _check(streamed.generation_info)


@pytest.mark.parametrize("path", ["engine", "base_url"])
def test_llama_index_raw_carries_the_timings(engine, server, path):
    from llama_index.core.base.llms.types import ChatMessage

    from parallm_integrations.llama_index import ParaLLMLlamaIndex

    remote = {"base_url": server.base_url, "api_key": KEY, "max_retries": 0} if path == "base_url" else {}
    llm = ParaLLMLlamaIndex(temperature=0, max_tokens=4, **remote)
    messages = [ChatMessage(role="user", content="Capital of France?")]
    resp = llm.chat(messages)
    _check(resp.raw, resp.raw["usage"]["prompt_tokens_details"]["cached_tokens"])
    last = None
    for last in llm.stream_chat(messages):
        pass
    _check(last.raw)
    _check(llm.complete("The capital of France is").raw)


def test_the_server_sends_timings_in_usage(engine, server):
    import openai

    client = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)
    resp = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=3)
    timings = resp.usage.model_dump()["timings"]
    assert set(timings) == {"queue_s", "prefill_s", "decode_s"} and timings["decode_s"] > 0
