"""The ``base_url=`` classes in a process where MLX cannot be imported (and, with
``PARALLM_TEST_NO_ENGINE=1``, where ``parallm_engine`` is not installed either).

Not collected by a plain ``pytest`` run (the file name does not start with ``test_``):
``tests/test_remote_without_mlx.py`` runs it in a child process with ``tests/no_mlx`` on PYTHONPATH,
against ``parallm serve`` on the real default model in its own process, and hands over, in
``PARALLM_TEST_REFERENCE``, what the in-process engine answered to the same greedy requests.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys

import openai
import pytest
from llama_index.core.base.llms.types import ChatMessage, MessageRole
from pydantic import BaseModel

from parallm_integrations import ChatParaLLM, ParaLLM
from parallm_integrations.errors import ContextLengthExceededError, EngineNotInstalledError, InvalidRequestError
from parallm_integrations.llama_index import ParaLLMLlamaIndex

from .llama_index_common import check_tool_call, check_usage, tools  # noqa: F401 (tools: a fixture)

BASE_URL = os.environ.get("PARALLM_TEST_BASE_URL", "")
KEY = os.environ.get("PARALLM_TEST_API_KEY", "")
NO_ENGINE = os.environ.get("PARALLM_TEST_NO_ENGINE") == "1"
REF = json.loads(os.environ.get("PARALLM_TEST_REFERENCE", "{}"))
QUESTION = "What is the capital of France?"
STORY = "Once upon a time"

pytestmark = pytest.mark.skipif(not BASE_URL, reason="run by tests/test_remote_without_mlx.py")


def _loaded(prefix: str) -> list[str]:
    return sorted(m for m in sys.modules if m == prefix or m.startswith(prefix + "."))


@pytest.fixture(autouse=True)
def nothing_of_mlx_is_loaded():
    """Before and after every test: MLX cannot be imported and was not; without the engine, neither was it."""
    with pytest.raises(ImportError):
        import mlx.core  # noqa: F401
    yield
    assert _loaded("mlx") == [] and _loaded("mlx_lm") == []
    if NO_ENGINE:
        assert _loaded("parallm_engine") == []


def _chat(**kw) -> ChatParaLLM:
    return ChatParaLLM(base_url=BASE_URL, api_key=KEY, max_retries=0, temperature=0, **{"max_tokens": 10, **kw})


# ----------------------------------------------------------------------------------------------
# LangChain
# ----------------------------------------------------------------------------------------------


def test_chat_model_invoke_stream_and_batch():
    llm = _chat()
    msg = llm.invoke(QUESTION)
    assert msg.content == REF["chat_text"]  # what the in-process engine answered
    assert msg.usage_metadata["output_tokens"] == REF["chat_completion_tokens"]
    assert msg.usage_metadata["input_tokens"] == REF["chat_prompt_tokens"]
    assert msg.response_metadata["model_name"] == REF["model_name"]
    chunks = list(llm.stream(QUESTION))
    assert "".join(c.content for c in chunks) == REF["chat_text"]
    assert chunks[-1].chunk_position == "last" and chunks[-1].usage_metadata["output_tokens"] == msg.usage_metadata[
        "output_tokens"]
    assert [m.content for m in llm.batch([QUESTION] * 3)] == [REF["chat_text"]] * 3


async def test_chat_model_async_and_logprobs():
    llm = _chat(logprobs=True, top_logprobs=2)
    msg = await llm.ainvoke(QUESTION)
    assert msg.content == REF["chat_text"]
    content = msg.response_metadata["logprobs"]["content"]
    assert "".join(t["token"] for t in content) == msg.content
    assert all(math.isfinite(t["logprob"]) and len(t["top_logprobs"]) == 2 for t in content)
    pieces = [c.content async for c in llm.astream(QUESTION)]
    assert "".join(pieces) == REF["chat_text"]


def test_chat_model_tools_and_structured_output():
    weather = {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    msg = _chat(max_tokens=40).bind_tools([weather], tool_choice="any").invoke("What is the weather in Paris?")
    (call,) = msg.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"].get("city"), str) and call["id"]
    assert msg.invalid_tool_calls == [] and msg.response_metadata["finish_reason"] == "tool_calls"

    class Place(BaseModel):
        city: str
        country: str

    place = _chat(max_tokens=40).with_structured_output(Place).invoke("Paris is the capital of France.")
    assert isinstance(place, Place) and place.city


def test_chat_model_tokens_come_from_the_server():
    llm = _chat()
    assert llm.get_token_ids("Hello world") == REF["hello_ids"]
    assert llm.get_num_tokens_from_messages([("human", QUESTION)]) == REF["question_tokens"]


def test_llm_invoke_stream_and_generate():
    llm = ParaLLM(base_url=BASE_URL, api_key=KEY, max_retries=0, temperature=0, max_tokens=6)
    assert llm.invoke(STORY) == REF["completion_text"]
    assert "".join(llm.stream(STORY)) == REF["completion_text"]
    out = llm.generate([STORY, STORY], logprobs=True)
    assert [g[0].text for g in out.generations] == [REF["completion_text"]] * 2
    assert out.llm_output["token_usage"]["completion_tokens"] == 2 * REF["completion_tokens"]
    assert "".join(t["token"] for t in out.generations[0][0].generation_info["logprobs"]["content"]) == REF[
        "completion_text"]


def test_errors_are_the_typed_errors():
    llm = _chat()
    with pytest.raises(InvalidRequestError):  # a 400 from the server (here or on the client, same class)
        llm.invoke(QUESTION, top_k=-7)
    with pytest.raises(ContextLengthExceededError):
        llm.invoke("hello " * (REF["context_window"] + 10))
    with pytest.raises(openai.AuthenticationError):
        ChatParaLLM(base_url=BASE_URL, api_key="wrong", max_retries=0).invoke(QUESTION)
    # In-process use says how to get the engine, as an ImportError.
    with pytest.raises(EngineNotInstalledError, match=r"parallm-integrations\[engine\]") as info:
        ChatParaLLM(max_tokens=2).invoke(QUESTION)
    assert isinstance(info.value, ImportError)
    with pytest.raises(ImportError, match="not installed"):
        ParaLLMLlamaIndex(max_tokens=2).complete(QUESTION)


def test_errors_match_the_engines():
    """Without the engine the error classes are this package's own copy: the same hierarchy, the same
    constructor arguments as the engine's (``REF["errors"]``, read from ``parallm_engine.errors``)."""
    import inspect

    from parallm_integrations import errors

    mine = {}
    for name, cls in vars(errors).items():
        if isinstance(cls, type) and issubclass(cls, errors.ParaLLMError):
            mine[name] = {"mro": [c.__name__ for c in cls.__mro__],
                          "init": list(inspect.signature(cls.__init__).parameters)}
    assert mine == REF["errors"]
    assert (errors.ParaLLMError.__module__ == "parallm_integrations.errors") is NO_ENGINE


# ----------------------------------------------------------------------------------------------
# LlamaIndex
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def li():
    return ParaLLMLlamaIndex(base_url=BASE_URL, api_key=KEY, max_retries=0, temperature=0, max_tokens=10)


def test_llama_index_endpoints(li):
    assert li.metadata.context_window == REF["context_window"] and li.metadata.model_name == REF["model_name"]
    r = li.chat([ChatMessage(role=MessageRole.USER, content=QUESTION)])
    assert r.message.content == REF["chat_text"]
    check_usage(r)
    chunks = list(li.stream_chat([ChatMessage(role=MessageRole.USER, content=QUESTION)]))
    assert "".join(c.delta for c in chunks) == chunks[-1].message.content == REF["chat_text"]
    check_usage(chunks[-1])
    assert li.complete(QUESTION).text == REF["chat_text"]  # the chat template, on the server
    raw = li.complete(STORY, formatted=True, max_tokens=6, logprobs=True)
    assert raw.text == REF["completion_text"]
    assert "".join(row[0].token for row in raw.logprobs) == raw.text
    assert li.get_token_ids("Hello world") == REF["hello_ids"]
    assert li._engine is None


async def test_llama_index_async_and_tools(li, tools):  # noqa: F811 (a fixture)
    r, c = await asyncio.gather(li.achat([ChatMessage(role=MessageRole.USER, content=QUESTION)]),
                                li.acomplete(STORY, formatted=True, max_tokens=6))
    assert (r.message.content, c.text) == (REF["chat_text"], REF["completion_text"])
    resp = await li.achat_with_tools(tools, user_msg="Use multiply to compute 6 times 7.", tool_required=True,
                                     max_tokens=40)
    check_tool_call(li, resp)
    gen = await li.astream_chat_with_tools(tools, user_msg="Use add to compute 2 plus 3.", tool_choice="add",
                                           max_tokens=40)
    chunks = [ch async for ch in gen]
    (call,) = li.get_tool_calls_from_response(chunks[-1])
    assert call.tool_name == "add" and set(call.tool_kwargs) == {"a", "b"}


@pytest.mark.skipif(not NO_ENGINE, reason="the engine's own CLI runs where the engine is installed")
def test_cli_says_how_to_install_the_engine(capsys):
    from parallm_integrations.cli import main

    assert main(["info"]) == 1
    assert "pip install 'parallm-integrations[engine]'" in capsys.readouterr().err
