"""The ``base_url=`` path (``parallm_integrations._remote``) against ``parallm serve`` running in this
process on loopback: results have the engine's shapes and the engine's values, errors are the
engine's errors, an abandoned stream aborts the server-side request."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from types import SimpleNamespace

import openai
import pytest

from parallm_engine import (
    Choice,
    ContextLengthExceededError,
    GenerationResult,
    InvalidRequestError,
    ModelLoadError,
    QueueFullError,
    StreamDelta,
    Usage,
)
from parallm_engine.formats.chat_format import ToolCall, ToolCallDelta
from parallm_engine.serve.server import ServerThread
from parallm_integrations import _remote
from parallm_integrations._remote import (
    RemoteChoice,
    RemoteClient,
    RemoteDelta,
    RemoteResult,
    RemoteToolCall,
    RemoteToolCallDelta,
    get_client,
)

KEY = "remote-key"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def server(engine):
    with ServerThread(engine=engine, api_key=KEY) as srv:
        yield srv


@pytest.fixture
def remote(server) -> RemoteClient:
    return get_client(server.base_url, KEY, max_retries=0)


@pytest.fixture
def llm(server):
    """What the LangChain adapters read from a ChatParaLLM / ParaLLM."""
    from pydantic import SecretStr

    return SimpleNamespace(base_url=server.base_url, api_key=SecretStr(KEY), max_retries=0, model=None)


def wait_idle(engine, timeout: float = 30.0) -> None:
    t0 = time.monotonic()
    while engine.running_count and time.monotonic() - t0 < timeout:
        time.sleep(0.05)
    assert engine.running_count == 0, engine.stats()


def collect(deltas) -> tuple[str, str | None, object, list]:
    text, finish, usage, calls = "", None, None, []
    for d in deltas:
        assert isinstance(d, RemoteDelta)
        assert usage is None, "usage comes on the very last delta"
        text += d.text
        finish = d.finish_reason or finish
        usage = d.usage
        calls += d.tool_calls
    return text, finish, usage, calls


# ----------------------------------------------------------------------------------------------
# Engine-shaped layer
# ----------------------------------------------------------------------------------------------


def test_chat_has_engine_shape_and_values(remote, engine):
    ref = engine.chat(QUESTION, max_tokens=12, temperature=0)
    # No model / the default model's name: resolved to what the server serves.
    for model in (None, "SmolLM2-135M-Instruct", engine.model_name):
        r = remote.chat(QUESTION, model=model, max_tokens=12, temperature=0)
        assert isinstance(r, RemoteResult)
        assert r.text == r.content == ref.text
        assert r.finish_reason == ref.finish_reason
        assert r.tool_calls == []
        assert r.model == engine.model_name
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (ref.usage.prompt_tokens,
                                                                       ref.usage.completion_tokens)
        assert r.usage.cached_tokens > 0  # the prompt is in the server's prefix cache by now


def test_chat_logprobs_n_and_extra_sampling(remote):
    r = remote.chat(QUESTION, max_tokens=6, temperature=0.8, seed=3, n=2, logprobs=True, top_logprobs=2,
                    top_k=20, min_p=0.01, repetition_penalty=1.1)  # vLLM-style extras go in extra_body
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:  # OpenAI's chat logprobs, as the server sent them
        assert "".join(t["token"] for t in c.logprobs["content"]) == c.text
        assert all(len(t["top_logprobs"]) == 2 for t in c.logprobs["content"])
    again = remote.chat(QUESTION, max_tokens=6, temperature=0.8, seed=3, n=2, top_k=20, min_p=0.01,
                        repetition_penalty=1.1)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]


def test_chat_stream_matches_chat(remote):
    full = remote.chat(QUESTION, max_tokens=12, temperature=0)
    text, finish, usage, calls = collect(remote.chat_stream(QUESTION, max_tokens=12, temperature=0))
    assert text == full.text and finish == full.finish_reason and not calls
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens


async def test_async_chat_and_stream(remote):
    full = await remote.achat(QUESTION, max_tokens=12, temperature=0)
    deltas = [d async for d in remote.achat_stream(QUESTION, max_tokens=12, temperature=0)]
    text, finish, usage, _ = collect(deltas)
    assert text == full.text and finish == full.finish_reason
    assert usage.completion_tokens == full.usage.completion_tokens


def test_async_client_per_event_loop(remote):
    """LlamaIndex may drive a second event loop in a helper thread: each loop gets its own client."""
    outs = []

    def in_thread():
        outs.append(asyncio.run(remote.achat(QUESTION, max_tokens=4, temperature=0)).text)

    outs.append(asyncio.run(remote.achat(QUESTION, max_tokens=4, temperature=0)).text)
    t = threading.Thread(target=in_thread)
    t.start()
    t.join(120)
    assert len(outs) == 2 and outs[0] == outs[1]


def test_tool_calls(remote):
    messages = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    r = remote.chat(messages, tools=[WEATHER_TOOL], tool_choice="required", max_tokens=40, temperature=0)
    assert r.finish_reason == "tool_calls"
    (call,) = r.tool_calls
    assert isinstance(call, RemoteToolCall) and call.error is None
    assert call.name == "get_weather" and isinstance(call.arguments.get("city"), str)
    assert json.loads(call.raw_arguments) == call.arguments
    # "any" (LangChain's spelling) is sent as "required".
    text, finish, usage, deltas = collect(remote.chat_stream(messages, tools=[WEATHER_TOOL], tool_choice="any",
                                                             max_tokens=40, temperature=0))
    assert finish == "tool_calls" and usage is not None
    assert deltas[0].id and deltas[0].name == "get_weather"
    assert json.loads("".join(d.arguments_delta for d in deltas)) == call.arguments


def test_completions(remote, engine):
    prompts = ["The capital of France is", "Once upon a time", "1, 2, 3,"]
    refs = engine.generate(prompts, max_tokens=6, temperature=0)
    results = remote.generate(prompts, max_tokens=6, temperature=0, logprobs=True, top_logprobs=1)
    assert [r.text for r in results] == [r.text for r in refs]
    assert sum(r.usage.completion_tokens for r in results) == sum(r.usage.completion_tokens for r in refs)
    assert all(len(r.logprobs["content"]) == ref.usage.completion_tokens for r, ref in zip(results, refs))
    assert all("".join(t["token"] for t in r.logprobs["content"]) == r.text for r in results)
    text, finish, usage, _ = collect(remote.stream(prompts[0], max_tokens=6, temperature=0))
    assert text == refs[0].text and finish == refs[0].finish_reason and usage is not None


async def test_async_completions(remote, engine):
    refs = engine.generate(["Once upon a time"], max_tokens=6, temperature=0)
    (r,) = await remote.agenerate(["Once upon a time"], max_tokens=6, temperature=0)
    assert r.text == refs[0].text
    text, _, usage, _ = collect([d async for d in remote.astream("Once upon a time", max_tokens=6, temperature=0)])
    assert text == refs[0].text and usage.completion_tokens == refs[0].usage.completion_tokens


def test_errors_are_engine_errors(remote, server, engine):
    with pytest.raises(ContextLengthExceededError):
        remote.chat([{"role": "user", "content": "hello " * (engine.context_window + 10)}], max_tokens=2)
    with pytest.raises(InvalidRequestError) as info:
        remote.chat(QUESTION, max_tokens=2, temperature=-1)
    assert isinstance(info.value.__cause__, openai.BadRequestError)
    with pytest.raises(InvalidRequestError):
        remote.generate(["x"], max_tokens=2, top_k=-7)
    with pytest.raises(ModelLoadError):
        remote.chat(QUESTION, model="no-such-model", max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        RemoteClient(server.base_url, "wrong", max_retries=0).chat(QUESTION, max_tokens=2)
    old = engine.max_queue
    hold = remote.chat_stream(QUESTION, max_tokens=100, temperature=0, ignore_eos=True)
    try:
        next(hold)  # one request in flight
        engine.max_queue = 1
        with pytest.raises(QueueFullError) as full:
            remote.chat(QUESTION, max_tokens=2)
        assert full.value.retry_after >= 1
    finally:
        engine.max_queue = old
        hold.close()
    wait_idle(engine)


def test_leaving_a_stream_aborts_the_server_request(remote, engine):
    before = engine.stats()["requests_aborted"]
    stream = remote.chat_stream(QUESTION, max_tokens=300, temperature=0, ignore_eos=True)
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    wait_idle(engine)
    assert engine.stats()["requests_aborted"] > before


def test_models_and_context_window(remote, engine):
    assert remote.models() == [engine.model_name]
    assert remote.context_window() == engine.context_window
    assert remote.context_window("default") == engine.context_window


def test_tokenize(remote, llm, engine):
    assert remote.tokenize("Hello world") == engine.encode("Hello world", add_special_tokens=False)
    ids = remote.tokenize_messages(QUESTION, tools=[WEATHER_TOOL])
    assert ids == list(engine.apply_chat_template(QUESTION, tools=[WEATHER_TOOL], add_generation_prompt=False))
    assert _remote.get_num_tokens_from_messages(llm, QUESTION) == len(
        engine.apply_chat_template(QUESTION, add_generation_prompt=False))


def test_api_key_from_environment_is_never_sent(server, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    with pytest.raises(openai.AuthenticationError):  # no key given: "EMPTY" is sent, not OPENAI_API_KEY
        RemoteClient(server.base_url, None, max_retries=0).models()


# ----------------------------------------------------------------------------------------------
# LangChain adapters
# ----------------------------------------------------------------------------------------------


def test_langchain_chat_adapters(llm, engine):
    from langchain_core.messages import AIMessage, AIMessageChunk
    from langchain_core.outputs import ChatResult

    ref = engine.chat(QUESTION, max_tokens=10, temperature=0)
    params = {"model": "SmolLM2-135M-Instruct", "max_tokens": 10, "temperature": 0}
    result = _remote.chat_generate(llm, QUESTION, params)
    assert isinstance(result, ChatResult)
    msg = result.generations[0].message
    assert isinstance(msg, AIMessage) and msg.content == ref.text
    assert msg.response_metadata["finish_reason"] == ref.finish_reason
    assert msg.response_metadata["model_name"] == engine.model_name
    assert msg.response_metadata["model_provider"] == "parallm"
    assert msg.usage_metadata["input_tokens"] == ref.usage.prompt_tokens
    assert msg.usage_metadata["input_token_details"]["cache_read"] > 0

    chunks = list(_remote.chat_stream(llm, QUESTION, params))
    merged = chunks[0]
    for c in chunks[1:]:
        merged = merged + c
    assert isinstance(merged.message, AIMessageChunk)
    assert merged.message.content == ref.text
    assert chunks[-1].message.chunk_position == "last"
    assert merged.message.usage_metadata["output_tokens"] == ref.usage.completion_tokens

    tool_params = {**params, "max_tokens": 40, "tools": [WEATHER_TOOL], "tool_choice": "required"}
    called = _remote.chat_generate(llm, [{"role": "user", "content": "Weather in Paris?"}], tool_params)
    tc = called.generations[0].message.tool_calls
    assert tc and tc[0]["name"] == "get_weather" and tc[0]["type"] == "tool_call" and tc[0]["id"]
    assert called.generations[0].message.response_metadata["finish_reason"] == "tool_calls"
    streamed = list(_remote.chat_stream(llm, [{"role": "user", "content": "Weather in Paris?"}], tool_params))
    total = streamed[0]
    for c in streamed[1:]:
        total = total + c
    assert total.message.tool_calls[0]["name"] == "get_weather"
    assert total.message.tool_calls[0]["args"] == tc[0]["args"]


async def test_langchain_async_adapters(llm, engine):
    ref = engine.chat(QUESTION, max_tokens=10, temperature=0)
    params = {"model": None, "max_tokens": 10, "temperature": 0}
    result = await _remote.achat_generate(llm, QUESTION, params)
    assert result.generations[0].message.content == ref.text
    chunks = [c async for c in _remote.achat_stream(llm, QUESTION, params)]
    assert "".join(c.message.content for c in chunks) == ref.text
    refs = engine.generate(["Once upon a time"], max_tokens=6, temperature=0)
    out = await _remote.acompletion_generate(llm, ["Once upon a time"], {"max_tokens": 6, "temperature": 0})
    assert out.generations[0][0].text == refs[0].text
    pieces = [c async for c in _remote.acompletion_stream(llm, "Once upon a time", {"max_tokens": 6, "temperature": 0})]
    assert "".join(c.text for c in pieces) == refs[0].text
    assert pieces[-1].generation_info["token_usage"]["completion_tokens"] == refs[0].usage.completion_tokens


def test_langchain_completion_adapters(llm, engine):
    from langchain_core.outputs import LLMResult

    prompts = ["The capital of France is", "Once upon a time"]
    refs = engine.generate(prompts, max_tokens=6, temperature=0)
    out = _remote.completion_generate(llm, prompts, {"max_tokens": 6, "temperature": 0, "logprobs": True})
    assert isinstance(out, LLMResult)
    assert [g[0].text for g in out.generations] == [r.text for r in refs]
    assert out.generations[0][0].generation_info["logprobs"]["content"]
    usage = out.llm_output["token_usage"]
    assert usage["completion_tokens"] == sum(r.usage.completion_tokens for r in refs)
    assert "cached_tokens" in usage["prompt_tokens_details"]
    pieces = list(_remote.completion_stream(llm, prompts[0], {"max_tokens": 6, "temperature": 0}))
    assert "".join(p.text for p in pieces) == refs[0].text
    assert pieces[-1].generation_info["finish_reason"] == refs[0].finish_reason
    assert _remote.get_token_ids(llm, "Hello world") == engine.encode("Hello world", add_special_tokens=False)


def test_chat_model_class_with_base_url(server, engine):
    """End to end through the LangChain class: same answer as the in-process engine."""
    from parallm_integrations import ChatParaLLM

    ref = engine.chat(QUESTION, max_tokens=10, temperature=0)
    llm = ChatParaLLM(base_url=server.base_url, api_key=KEY, temperature=0, max_tokens=10, max_retries=0)
    msg = llm.invoke(QUESTION[0]["content"])
    assert msg.content == ref.text
    assert msg.usage_metadata["output_tokens"] == ref.usage.completion_tokens
    assert "".join(c.content for c in llm.stream(QUESTION[0]["content"])) == ref.text


def test_chat_model_counts_tokens_with_the_server(server, engine, monkeypatch):
    """get_num_tokens_from_messages with base_url: the server's template and tokenizer (/tokenize), so the
    count is the in-process count; a server without /tokenize gets LangChain's estimate."""
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage, get_buffer_string

    from parallm_integrations import ChatParaLLM

    messages = [
        SystemMessage("Be brief."),
        HumanMessage("What is the weather like in Paris today?"),
        AIMessage("", tool_calls=[{"name": "get_weather", "args": {"city": "Paris"}, "id": "call_1"}]),
        ToolMessage("Sunny, 21 C", tool_call_id="call_1"),
    ]
    local = ChatParaLLM()
    remote_llm = ChatParaLLM(base_url=server.base_url, api_key=KEY, max_retries=0)
    counts = []
    for tools in (None, [WEATHER_TOOL]):
        n = remote_llm.get_num_tokens_from_messages(messages, tools=tools)
        assert n == local.get_num_tokens_from_messages(messages, tools=tools)
        counts.append(n)
    assert counts[1] > counts[0]  # the tool schemas are counted
    assert remote_llm._engine is None

    def no_tokenize(self, body, timeout):
        raise NotImplementedError("no /tokenize")

    monkeypatch.setattr(RemoteClient, "_tokenize", no_tokenize)
    expected = sum(len(get_buffer_string([m]).split()) for m in messages)
    # A server without /tokenize: LangChain's default estimate (GPT-2 from the hub, so stood in for here).
    import langchain_core.language_models.base as lc_base

    monkeypatch.setattr(lc_base, "_get_token_ids_default_method", lambda s: s.split())
    assert ChatParaLLM(base_url=server.base_url, api_key=KEY).get_num_tokens_from_messages(messages) == expected
    # A user's own counter is used first, without asking the server.
    estimate = ChatParaLLM(base_url=server.base_url, api_key=KEY, custom_get_token_ids=lambda s: s.split())
    assert estimate.get_num_tokens_from_messages(messages) == expected


def test_remote_types_have_the_engines_fields():
    """Code reads a result the same whichever path made it: the remote types (which import nothing of the
    engine) have every field of the engine's."""
    from dataclasses import fields

    def names(cls):
        return {f.name for f in fields(cls)} | {n for n, v in vars(cls).items() if isinstance(v, property)}

    for engine_type, remote_type in [(GenerationResult, RemoteResult), (Choice, RemoteChoice),
                                     (StreamDelta, RemoteDelta), (Usage, _remote.Usage),
                                     (ToolCall, RemoteToolCall), (ToolCallDelta, RemoteToolCallDelta)]:
        assert names(engine_type) <= names(remote_type), remote_type


def test_stream_retiming_without_a_server():
    """Servers that report usage on every chunk (vLLM's continuous_usage_stats) and n > 1: usage still
    arrives once, on the very last delta; every choice's finish_reason is kept."""
    from openai.types.chat import ChatCompletionChunk

    def chunk(choices, usage=None):
        return ChatCompletionChunk.model_validate({
            "id": "c1", "object": "chat.completion.chunk", "created": 0, "model": "m", "choices": choices,
            "usage": usage})

    def usage(n):
        return {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n,
                "prompt_tokens_details": {"cached_tokens": 3}}

    state = _remote._StreamState()
    out = []
    for c in [
        chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}}], usage(0)),
        chunk([{"index": 0, "delta": {"content": "Hi"}}], usage(1)),
        chunk([{"index": 1, "delta": {"content": "Yo"}}], usage(2)),
        chunk([{"index": 0, "delta": {}, "finish_reason": "stop"}], usage(2)),
        chunk([{"index": 1, "delta": {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                                      "function": {"name": "f", "arguments": ""}}]}}], usage(3)),
        chunk([{"index": 1, "delta": {}, "finish_reason": "tool_calls"}], usage(3)),
        chunk([], usage(3)),
    ]:
        out += state.feed(c, completion=False)
    out += state.flush()
    assert [(d.index, d.text, d.finish_reason) for d in out] == [
        (0, "Hi", None), (1, "Yo", None), (0, "", "stop"), (1, "", None), (1, "", "tool_calls")]
    assert [d.usage is not None for d in out] == [False, False, False, False, True]
    assert out[-1].usage.completion_tokens == 3 and out[-1].usage.cached_tokens == 3
    assert out[3].tool_calls[0].id == "call_1" and out[3].tool_calls[0].name == "f"
    assert all(d.model == "m" for d in out)
