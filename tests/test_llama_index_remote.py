"""``ParaLLMLlamaIndex(base_url=...)`` against ``parallm serve`` running in this process on loopback: every
endpoint gives what the in-process class gives for the same greedy request (same model, the server runs
the session's engine), tool calls and structured output work through the server, the context window comes
from the server, errors are the engine's typed errors, and nothing is loaded in-process."""

from __future__ import annotations

import asyncio
import itertools
import socket
import time

import openai
import pytest
from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.constants import DEFAULT_CONTEXT_WINDOW
from pydantic import BaseModel

from parallm_engine import ContextLengthExceededError, InvalidRequestError
from parallm_engine.serve.server import ServerThread
from parallm_integrations.llama_index import ParaLLMLlamaIndex

from .llama_index_common import (  # noqa: F401 (tools: a fixture)
    answer_tool_call, check_streamed_tool_calls, check_tool_call, check_usage, tools,
)

KEY = "li-remote-key"
QUESTION = "What is the capital of France?"
USER_Q = [ChatMessage(role=MessageRole.USER, content=QUESTION)]
COUNT = "Count: 1, 2, 3,"


@pytest.fixture(scope="module")
def server(engine):
    with ServerThread(engine=engine, api_key=KEY) as srv:
        yield srv


@pytest.fixture(scope="module")
def local(engine):
    return ParaLLMLlamaIndex(temperature=0, max_tokens=12)


@pytest.fixture(scope="module")
def remote(server):
    return ParaLLMLlamaIndex(base_url=server.base_url, api_key=KEY, temperature=0, max_tokens=12, max_retries=0)


def _same_usage(a, b) -> None:
    for key in ("prompt_tokens", "completion_tokens"):
        assert a.raw["usage"][key] == b.raw["usage"][key], key


def _wait_idle(engine, timeout: float = 30.0) -> None:
    t0 = time.monotonic()
    while engine.running_count and time.monotonic() - t0 < timeout:
        time.sleep(0.05)
    assert engine.running_count == 0, engine.stats()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------------------------
# Construction and metadata
# --------------------------------------------------------------------------------------------


def test_construction_reads_the_environment_and_loads_nothing(monkeypatch):
    monkeypatch.setenv("PARALLM_BASE_URL", "http://127.0.0.1:1/v1")
    monkeypatch.setenv("PARALLM_API_KEY", "env-key")
    llm = ParaLLMLlamaIndex()
    assert llm.base_url == "http://127.0.0.1:1/v1"
    assert llm.api_key.get_secret_value() == "env-key"
    assert "env-key" not in repr(llm) and "api_key" not in llm.to_dict()  # never printed or serialised
    explicit = ParaLLMLlamaIndex(base_url="http://127.0.0.1:2/v1", api_key="mine")
    assert (explicit.base_url, explicit.api_key.get_secret_value()) == ("http://127.0.0.1:2/v1", "mine")
    with pytest.raises(RuntimeError, match="base_url"):  # no in-process engine behind a base_url
        llm.engine
    assert llm._engine is None
    monkeypatch.delenv("PARALLM_BASE_URL")
    monkeypatch.delenv("PARALLM_API_KEY")
    assert ParaLLMLlamaIndex().base_url is None and ParaLLMLlamaIndex().api_key is None
    assert "not available" not in ParaLLMLlamaIndex.model_fields["base_url"].description


def test_metadata_comes_from_the_server(server, engine):
    llm = ParaLLMLlamaIndex(base_url=server.base_url, api_key=KEY, max_tokens=64, max_retries=0)
    md = llm.metadata
    assert md.context_window == engine.context_window  # /v1/models max_model_len
    assert md.model_name == engine.model_name
    assert md.num_output == 64 and md.is_chat_model and md.is_function_calling_model
    assert llm._engine is None
    assert ParaLLMLlamaIndex(base_url=server.base_url, api_key=KEY, context_window=1024).metadata.context_window == 1024


# --------------------------------------------------------------------------------------------
# The eight endpoints: same answers as in-process
# --------------------------------------------------------------------------------------------


def test_sync_endpoints_match_in_process(local, remote, engine):
    ref = local.chat(USER_Q)
    r = remote.chat(USER_Q)
    assert r.message.role == MessageRole.ASSISTANT
    assert r.message.content == ref.message.content and r.message.content
    assert r.raw["finish_reason"] == ref.raw["finish_reason"]
    assert r.raw["model"] == engine.model_name
    check_usage(r)
    _same_usage(r, ref)

    chunks = list(remote.stream_chat(USER_Q))
    assert len(chunks) > 1
    assert "".join(ch.delta for ch in chunks) == chunks[-1].message.content == ref.message.content
    for prev, cur in itertools.pairwise(chunks):  # cumulative message
        assert cur.message.content.startswith(prev.message.content)
    assert chunks[-1].raw["finish_reason"] == ref.raw["finish_reason"]
    check_usage(chunks[-1])

    # complete() with the chat template: through /v1/chat/completions, the same as the in-process template.
    ref_c = local.complete(QUESTION)
    c = remote.complete(QUESTION)
    assert c.text == ref_c.text and c.text
    check_usage(c)
    _same_usage(c, ref_c)
    # Raw text: through /v1/completions.
    ref_raw = local.complete(COUNT, formatted=True)
    raw = remote.complete(COUNT, formatted=True)
    assert raw.text == ref_raw.text and raw.text.strip().startswith("4")
    _same_usage(raw, ref_raw)

    pieces = list(remote.stream_complete(COUNT, formatted=True))
    assert len(pieces) > 1
    assert "".join(p.delta for p in pieces) == pieces[-1].text == ref_raw.text
    check_usage(pieces[-1])
    pieces = list(remote.stream_complete(QUESTION))
    assert pieces[-1].text == ref_c.text


async def test_async_endpoints_match_in_process(local, remote, engine):
    ref = await local.achat(USER_Q)
    ref_raw = await local.acomplete(COUNT, formatted=True)

    async def stream_chat():
        gen = await remote.astream_chat(USER_Q)
        return [ch async for ch in gen]

    async def stream_complete():
        gen = await remote.astream_complete(COUNT, formatted=True)
        return [ch async for ch in gen]

    engine.reset_peaks()
    r, c, sc, sx = await asyncio.gather(remote.achat(USER_Q), remote.acomplete(COUNT, formatted=True),
                                        stream_chat(), stream_complete())
    assert engine.stats()["peak_in_flight"] >= 2  # concurrent calls are batched by the server's engine
    assert r.message.content == ref.message.content
    check_usage(r)
    assert c.text == ref_raw.text
    check_usage(c)
    assert "".join(ch.delta for ch in sc) == sc[-1].message.content == ref.message.content
    check_usage(sc[-1])
    assert "".join(ch.delta for ch in sx) == sx[-1].text == ref_raw.text
    check_usage(sx[-1])
    assert (await remote.acomplete(QUESTION)).text == (await local.acomplete(QUESTION)).text


def test_token_ids_from_the_server(remote, engine):
    assert remote.get_token_ids("Hello world") == engine.encode("Hello world", add_special_tokens=False)


# --------------------------------------------------------------------------------------------
# Tools and structured output
# --------------------------------------------------------------------------------------------


def test_tool_call_round_trip(local, remote, tools):
    ask = "Use multiply to compute 6 times 7."
    r = remote.chat_with_tools(tools, user_msg=ask, tool_required=True, max_tokens=40)
    call = check_tool_call(remote, r)
    ref = local.get_tool_calls_from_response(local.chat_with_tools(tools, user_msg=ask, tool_required=True,
                                                                   max_tokens=40))
    assert [(c.tool_name, c.tool_kwargs) for c in ref] == [(call.tool_name, call.tool_kwargs)]
    answer_tool_call(remote, tools, ask, r, call)


async def test_streamed_tool_calls_are_cumulative(remote, tools):
    await check_streamed_tool_calls(remote, tools)


def test_structured_predict(remote):
    from llama_index.core.prompts import PromptTemplate

    class Place(BaseModel):
        city: str
        country: str

    prompt = PromptTemplate("Extract the city and the country from this text: {text}")
    out = remote.structured_predict(Place, prompt, llm_kwargs={"max_tokens": 40},
                                    text="Paris is the capital of France.")
    assert isinstance(out, Place) and out.city
    out = asyncio.run(remote.astructured_predict(Place, prompt, llm_kwargs={"max_tokens": 40},
                                                 text="Rome is in Italy."))
    assert isinstance(out, Place)


# --------------------------------------------------------------------------------------------
# Errors, aborts, unreachable servers
# --------------------------------------------------------------------------------------------


async def test_errors_are_typed(remote, server, engine):
    long = "hello " * (engine.context_window + 10)
    with pytest.raises(ContextLengthExceededError):
        remote.chat([ChatMessage(role=MessageRole.USER, content=long)])
    with pytest.raises(ContextLengthExceededError):
        await remote.acomplete(long, formatted=True)
    with pytest.raises(InvalidRequestError):  # a ValueError, as in-process
        remote.chat(USER_Q, temperature=-1.0)
    with pytest.raises(ValueError):
        remote.complete(COUNT, formatted=True, top_k=-7)
    bad_key = ParaLLMLlamaIndex(base_url=server.base_url, api_key="wrong", max_tokens=2, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.chat(USER_Q)
    with pytest.raises(openai.AuthenticationError):
        await bad_key.acomplete(QUESTION)
    with pytest.raises(TimeoutError):
        await remote.achat(USER_Q, max_tokens=2000, ignore_eos=True, timeout=0.5)
    await asyncio.to_thread(_wait_idle, engine)  # the server aborted the request when the client went away


async def test_leaving_a_stream_aborts_the_server_request(remote, engine):
    await asyncio.to_thread(_wait_idle, engine)
    before = engine.stats()["requests_aborted"]
    gen = await remote.astream_chat(USER_Q, max_tokens=300, ignore_eos=True)
    async for _ in gen:
        break
    await gen.aclose()
    sync_gen = remote.stream_complete("Once upon a time", formatted=True, max_tokens=300, ignore_eos=True)
    next(sync_gen)
    sync_gen.close()
    await asyncio.to_thread(_wait_idle, engine)
    assert engine.stats()["requests_aborted"] >= before + 2


async def test_unreachable_server_fails_fast_and_clearly():
    url = f"http://127.0.0.1:{_closed_port()}/v1"
    llm = ParaLLMLlamaIndex(base_url=url, max_retries=0, max_tokens=4)
    t0 = time.monotonic()
    md = llm.metadata  # LlamaIndex reads it everywhere: never raises, falls back
    assert md.context_window == DEFAULT_CONTEXT_WINDOW
    with pytest.raises(openai.APIConnectionError, match=r"cannot reach .*127\.0\.0\.1"):
        llm.chat(USER_Q)
    with pytest.raises(openai.APIConnectionError, match="cannot reach"):
        await llm.acomplete(QUESTION)
    with pytest.raises(openai.APIConnectionError, match="cannot reach"):
        list(llm.stream_complete(QUESTION, formatted=True))
    assert time.monotonic() - t0 < 20
    assert llm._engine is None
