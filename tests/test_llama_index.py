"""Conformance suite for the LlamaIndex integration (``ParaLLMLlamaIndex``).

LlamaIndex ships no standard integration test suite, so this covers what its framework code relies on:
every endpoint sync and async, streaming chunks (cumulative message/text + delta), token usage, tool
calling (``chat_with_tools``, ``get_tool_calls_from_response``, cumulative tool calls on streamed chunks,
history with tool turns), a ``FunctionAgent``, structured output, and the concurrency facts: async paths
become concurrent engine requests, from any event loop, and cancelled callers free the engine.

All on the real default model (SmolLM2-135M-Instruct) with greedy decoding and short generations.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from pathlib import Path

import pytest
from llama_index.core.base.llms.types import ChatMessage, MessageRole, TextBlock, ToolCallBlock
from pydantic import BaseModel

from parallm_integrations.llama_index import ParaLLMLlamaIndex
from parallm_integrations.llama_index.base import message_to_dict

from .llama_index_common import (  # noqa: F401 (tools: a fixture)
    add, answer_tool_call, check_streamed_tool_calls, check_tool_call, check_usage, multiply, tools,
)

DATA = Path(__file__).resolve().parent.parent / "cookbook" / "data"
USER_Q = [ChatMessage(role=MessageRole.USER, content="What is the capital of France?")]


@pytest.fixture(scope="module")
def llm(engine):
    return ParaLLMLlamaIndex(temperature=0, max_tokens=16)


@pytest.fixture(scope="module")
def texts():
    files = sorted(DATA.glob("*.txt"))
    assert len(files) == 12
    return [f.read_text().strip() for f in files]


async def _wait_idle(engine, timeout: float = 10.0) -> None:
    t0 = time.monotonic()
    while engine.running_count and time.monotonic() - t0 < timeout:
        await asyncio.sleep(0.02)
    assert engine.running_count == 0


# --------------------------------------------------------------------------------------------
# Construction, metadata, engine sharing (no generation)
# --------------------------------------------------------------------------------------------


def test_is_a_function_calling_llm():
    from llama_index.core.llms.custom import CustomLLM
    from llama_index.core.llms.function_calling import FunctionCallingLLM

    assert issubclass(ParaLLMLlamaIndex, FunctionCallingLLM)
    assert not issubclass(ParaLLMLlamaIndex, CustomLLM)  # its async methods block the loop


def test_lazy_construction_and_metadata(engine):
    llm = ParaLLMLlamaIndex(max_tokens=64)
    assert llm._engine is None  # constructing loads nothing
    md = llm.metadata
    assert llm._engine is None  # nor does reading metadata (LlamaIndex reads it all the time)
    assert md.is_chat_model and md.is_function_calling_model
    assert md.context_window == engine.context_window
    assert md.num_output == 64
    assert md.model_name == engine.model_name
    assert ParaLLMLlamaIndex(context_window=1024).metadata.context_window == 1024
    # Field descriptions are there for users / docs.
    assert "default" in ParaLLMLlamaIndex.model_fields["model"].description


def test_shares_the_engine_with_langchain(engine):
    from parallm_integrations import ChatParaLLM

    llm = ParaLLMLlamaIndex()
    assert llm.engine is engine
    assert ParaLLMLlamaIndex(model="SmolLM2-135M-Instruct").engine is engine
    assert ChatParaLLM()._get_engine() is engine


def test_message_conversion_for_tool_history():
    assistant = ChatMessage(
        role=MessageRole.ASSISTANT,
        blocks=[TextBlock(text=""), ToolCallBlock(tool_call_id="call_1", tool_name="add", tool_kwargs={"a": 1, "b": 2})],
    )
    tool = ChatMessage(role=MessageRole.TOOL, content="3", additional_kwargs={"tool_call_id": "call_1"})
    legacy = ChatMessage(
        role=MessageRole.ASSISTANT, content="",
        additional_kwargs={"tool_calls": [{"id": "c2", "type": "function",
                                           "function": {"name": "multiply", "arguments": '{"a": 2, "b": 3}'}}]},
    )
    assert message_to_dict(assistant) == {
        "role": "assistant", "content": "",
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}],
    }
    assert message_to_dict(tool) == {"role": "tool", "content": "3", "tool_call_id": "call_1"}
    assert message_to_dict(legacy)["tool_calls"][0]["function"]["name"] == "multiply"
    assert message_to_dict(ChatMessage(role=MessageRole.DEVELOPER, content="x"))["role"] == "system"
    from llama_index.core.base.llms.types import ImageBlock

    # Images become OpenAI image_url parts (the engine decides whether it can use them: tests/test_vision.py);
    # other non-text blocks are still refused.
    assert message_to_dict(ChatMessage(role=MessageRole.USER, blocks=[ImageBlock(url="http://x/y.png")])) == {
        "role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}
    from llama_index.core.base.llms.types import AudioBlock

    with pytest.raises(ValueError, match="text only"):
        message_to_dict(ChatMessage(role=MessageRole.USER, blocks=[AudioBlock(url="http://x/y.wav")]))


def test_completion_prompt_modes(engine):
    from parallm_integrations._common import EngineRequest
    from parallm_integrations.backends import EngineBackend

    llm = ParaLLMLlamaIndex(system_prompt="Be brief.")
    msgs = llm._completion_input("Hi there", formatted=False)  # one user turn of the chat template
    assert msgs == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    text = engine.decode(EngineBackend(engine)._engine_prompt(msgs, EngineRequest({})))  # what the engine runs
    assert "<|im_start|>system\nBe brief." in text and "<|im_start|>user\nHi there" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert llm._completion_input("Hi there", formatted=True) == "Hi there"
    assert ParaLLMLlamaIndex(complete_with_chat_template=False)._completion_input("Hi", False) == "Hi"
    custom = ParaLLMLlamaIndex(completion_to_prompt=lambda p: f"Q: {p}\nA:")
    assert custom._completion_input("Hi", False) == "Q: Hi\nA:"


# --------------------------------------------------------------------------------------------
# The eight endpoints
# --------------------------------------------------------------------------------------------


def test_sync_endpoints(llm):
    r = llm.chat(USER_Q)
    assert r.message.role == MessageRole.ASSISTANT and "Paris" in r.message.content
    check_usage(r)
    assert r.raw["finish_reason"] in ("stop", "length")

    c = llm.complete("What is the capital of France?")
    assert "Paris" in c.text
    check_usage(c)
    assert c.additional_kwargs["cached_tokens"] > 0  # same prompt as the chat: served from the prefix cache

    chunks = list(llm.stream_chat(USER_Q))
    assert len(chunks) > 1
    assert "".join(ch.delta for ch in chunks) == chunks[-1].message.content == r.message.content
    for prev, cur in itertools.pairwise(chunks):  # cumulative message
        assert cur.message.content.startswith(prev.message.content)
    check_usage(chunks[-1])

    chunks = list(llm.stream_complete("Count: 1, 2, 3,", formatted=True))
    assert len(chunks) > 1
    assert "".join(ch.delta for ch in chunks) == chunks[-1].text
    assert chunks[-1].text.strip().startswith("4")
    check_usage(chunks[-1])


async def test_async_endpoints(llm, engine):
    async def stream_chat():
        gen = await llm.astream_chat(USER_Q)
        return [ch async for ch in gen]

    async def stream_complete():
        gen = await llm.astream_complete("Count: 1, 2, 3,", formatted=True)
        return [ch async for ch in gen]

    engine.reset_peaks()
    r, c, sc, sx = await asyncio.gather(llm.achat(USER_Q), llm.acomplete("What is the capital of France?"),
                                        stream_chat(), stream_complete())
    assert engine.stats()["peak_in_flight"] >= 3  # all four were batched together, not run one by one
    assert "Paris" in r.message.content and "Paris" in c.text
    check_usage(r)
    check_usage(c)
    assert "".join(ch.delta for ch in sc) == sc[-1].message.content == r.message.content
    check_usage(sc[-1])
    assert "".join(ch.delta for ch in sx) == sx[-1].text and sx[-1].text.strip().startswith("4")
    check_usage(sx[-1])
    # predict / apredict go through chat (is_chat_model)
    from llama_index.core.prompts import PromptTemplate

    assert "Paris" in await llm.apredict(PromptTemplate("What is the capital of {country}?"), country="France")


def test_sampling_fields_and_kwargs(llm):
    r = llm.chat(USER_Q, max_tokens=3)
    assert r.raw["usage"]["completion_tokens"] == 3 and r.raw["finish_reason"] == "length"
    r = llm.chat(USER_Q, stop=["Paris"])
    assert "Paris" not in r.message.content
    with pytest.raises(ValueError):  # the engine's InvalidRequestError is a ValueError
        llm.chat(USER_Q, temperature=-1.0)
    seeded = ParaLLMLlamaIndex(temperature=1.0, seed=7, max_tokens=8, top_k=50)
    assert seeded.chat(USER_Q).message.content == seeded.chat(USER_Q).message.content


# --------------------------------------------------------------------------------------------
# Tools
# --------------------------------------------------------------------------------------------


def test_tool_call_round_trip(llm, tools):
    ask = "Use multiply to compute 6 times 7."
    r = llm.chat_with_tools(tools, user_msg=ask, tool_required=True, max_tokens=40)
    final = answer_tool_call(llm, tools, ask, r, check_tool_call(llm, r))
    with pytest.raises(ValueError, match="tool call"):
        llm.get_tool_calls_from_response(final)


async def test_streamed_tool_calls_are_cumulative(llm, tools):
    await check_streamed_tool_calls(llm, tools)


async def test_function_agent_with_two_tools(engine):
    from llama_index.core.agent.workflow import AgentStream, FunctionAgent, ToolCallResult

    agent_llm = ParaLLMLlamaIndex(temperature=0, max_tokens=40)  # room for a whole call

    async def run(tool_name: str, question: str):
        agent = FunctionAgent(tools=[multiply, add], llm=agent_llm, initial_tool_choice=tool_name,
                              system_prompt="You are a calculator. Use the tools.")
        handler = agent.run(user_msg=question, max_iterations=6)
        results, streamed = [], 0
        async for ev in handler.stream_events():
            if isinstance(ev, ToolCallResult):
                results.append(ev)
            elif isinstance(ev, AgentStream):
                streamed += 1
        return results, streamed, await handler

    engine.reset_peaks()
    (r1, s1, out1), (r2, s2, out2) = await asyncio.gather(
        run("multiply", "Use multiply to compute 6 times 7."), run("add", "Use add to compute 2 plus 3."))
    assert engine.stats()["peak_in_flight"] >= 2  # two agents at once, batched
    for results, streamed, out, name, fn in ((r1, s1, out1, "multiply", multiply), (r2, s2, out2, "add", add)):
        assert streamed > 1  # FunctionAgent streams by default
        assert results and results[0].tool_name == name  # the forced first call
        first = results[0]
        assert not first.tool_output.is_error
        assert first.tool_output.content == str(fn(**first.tool_kwargs))  # the tool really ran on the args
        assert str(out.response.content)  # and the agent finished with an answer


def test_structured_predict(llm):
    from llama_index.core.prompts import PromptTemplate

    class Place(BaseModel):
        city: str
        country: str

    prompt = PromptTemplate("Extract the city and the country from this text: {text}")
    out = llm.structured_predict(Place, prompt, llm_kwargs={"max_tokens": 40}, text="Paris is the capital of France.")
    assert isinstance(out, Place) and out.city

    async def both():
        return await asyncio.gather(
            llm.astructured_predict(Place, prompt, llm_kwargs={"max_tokens": 40}, text="Rome is in Italy."),
            llm.astructured_predict(Place, prompt, llm_kwargs={"max_tokens": 40}, text="Tokyo is in Japan."),
        )

    a, b = asyncio.run(both())
    assert isinstance(a, Place) and isinstance(b, Place)

    # LlamaIndex's own FunctionCallingProgram (tool_required -> a constrained tool call) parses too.
    from llama_index.core.types import PydanticProgramMode

    fc = ParaLLMLlamaIndex(temperature=0, max_tokens=48, pydantic_program_mode=PydanticProgramMode.FUNCTION)
    out = fc.structured_predict(Place, prompt, text="Berlin is the capital of Germany.")
    assert isinstance(out, Place)


# --------------------------------------------------------------------------------------------
# Concurrency
# --------------------------------------------------------------------------------------------


def test_tree_summarize_use_async_fans_out(llm, engine, texts):
    from llama_index.core.indices.prompt_helper import PromptHelper
    from llama_index.core.response_synthesizers import TreeSummarize

    # Chunks of at most 70 tokens: the 12 documents repack into 12 chunks (one request each).
    helper = PromptHelper(context_window=engine.context_window, num_output=8, chunk_size_limit=70,
                          chunk_overlap_ratio=0.0)
    small = ParaLLMLlamaIndex(temperature=0, max_tokens=8)
    ts = TreeSummarize(llm=small, use_async=True, prompt_helper=helper)
    engine.reset_peaks()
    t0 = time.monotonic()
    answer = ts.get_response("What do these notes describe?", texts)
    elapsed = time.monotonic() - t0
    peak = engine.stats()["peak_in_flight"]
    print(f"TreeSummarize(use_async=True): peak_in_flight={peak}, {elapsed:.1f} s")
    assert isinstance(answer, str) and answer
    assert peak >= 6


async def test_asyncio_run_helper_thread_loop(llm, engine):
    """Sync LlamaIndex code called from inside a running loop: ``asyncio_run`` runs a second loop in a
    helper thread, and the engine must deliver to that loop."""
    from llama_index.core.async_utils import run_async_tasks
    from llama_index.core.prompts import PromptTemplate

    prompt = PromptTemplate("Say hello to {name}.")
    engine.reset_peaks()
    outs = run_async_tasks([llm.apredict(prompt, name=n) for n in ("Ann", "Bob", "Cy")])  # blocks this loop
    assert len(outs) == 3 and all(outs)
    assert engine.stats()["peak_in_flight"] >= 3


async def test_aquery_from_two_loops_overlap(llm, engine, texts):
    from llama_index.core import Document, VectorStoreIndex
    from llama_index.core.embeddings import MockEmbedding

    embed = MockEmbedding(embed_dim=8)
    index = VectorStoreIndex.from_documents([Document(text=t) for t in texts[:4]], embed_model=embed)
    small = ParaLLMLlamaIndex(temperature=0, max_tokens=8)
    qe = index.as_query_engine(llm=small, similarity_top_k=1)
    questions = [f"Question {i}: when was Riverton founded?" for i in range(12)]

    other: dict = {}

    def second_loop() -> None:
        async def main():
            return await asyncio.gather(*(qe.aquery(q) for q in questions[8:]))

        try:
            other["responses"] = asyncio.run(main())
        except BaseException as exc:  # noqa: BLE001  (surfaced below)
            other["error"] = exc

    engine.reset_peaks()
    thread = threading.Thread(target=second_loop)
    thread.start()
    mine = await asyncio.gather(*(qe.aquery(q) for q in questions[:8]))
    await asyncio.to_thread(thread.join, 300)
    assert "error" not in other, other.get("error")
    assert len(mine) == 8 and len(other["responses"]) == 4
    assert all(str(r) for r in [*mine, *other["responses"]])
    peak = engine.stats()["peak_in_flight"]
    print(f"8 + 4 aquery from two loops: peak_in_flight={peak}")
    assert peak >= 9  # more than either loop alone has: requests from both loops were batched together
    await _wait_idle(engine)


async def test_cancelling_achat_frees_the_engine(llm, engine):
    await _wait_idle(engine)
    msgs = [ChatMessage(role=MessageRole.USER, content="Write a very long story about a dragon.")]
    task = asyncio.create_task(llm.achat(msgs, max_tokens=2000, ignore_eos=True))
    t0 = time.monotonic()
    while engine.running_count == 0 and time.monotonic() - t0 < 30:
        await asyncio.sleep(0.02)
    assert engine.running_count == 1
    await asyncio.sleep(0.3)
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await _wait_idle(engine)

    # A stream the consumer leaves early, and a timeout, free it too.
    gen = await llm.astream_chat(msgs, max_tokens=2000, ignore_eos=True)
    async for _ in gen:
        break
    await gen.aclose()
    await _wait_idle(engine)
    sync_gen = llm.stream_complete("Once upon a time", max_tokens=2000, ignore_eos=True)
    next(sync_gen)
    sync_gen.close()
    await _wait_idle(engine)
    with pytest.raises(TimeoutError):
        await llm.achat(msgs, max_tokens=2000, ignore_eos=True, timeout=0.5)
    await _wait_idle(engine)
