"""ChatParaLLM / ParaLLM really fan out on the shared engine, and every way of giving up on a request
(cancelled task, closed stream, timeout) aborts it in the engine."""

from __future__ import annotations

import asyncio
import operator
import time
from typing import Annotated, Any

import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import HumanMessage
from langgraph.graph import END, START, StateGraph
from langgraph.types import Send
from typing_extensions import TypedDict

from parallm_integrations import ChatParaLLM, ParaLLM

N = 32
# Runs until it is aborted: cancellation tests must find it still running.
ENDLESS = {"max_tokens": 4000, "ignore_eos": True}


def _wait_idle(engine, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if engine.running_count == 0:
            return
        time.sleep(0.02)
    raise AssertionError(f"engine still has requests in flight: {engine.stats()}")


async def _await_running(engine, n: int = 1, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.running_count < n:
        if time.monotonic() > deadline:
            raise AssertionError(f"requests never started: {engine.stats()}")
        await asyncio.sleep(0.02)


class _TokenCounter(BaseCallbackHandler):
    def __init__(self) -> None:
        self.tokens: list[str] = []

    def on_llm_new_token(self, token: str, **kwargs: Any) -> None:
        self.tokens.append(token)


@pytest.fixture()
def idle_engine(engine):
    _wait_idle(engine)
    engine.reset_peaks()
    yield engine
    _wait_idle(engine)


# -- construction ---------------------------------------------------------------------------------


def test_construction_is_lazy_and_shares_the_engine(engine):
    bogus = ChatParaLLM(model="/nonexistent/model.gguf")  # nothing is loaded, so nothing fails yet
    assert bogus._engine is None
    with pytest.raises(Exception, match="not found|unknown model|neither"):
        bogus.invoke("hi")
    a, b = ChatParaLLM(), ParaLLM(model_name="SmolLM2-135M-Instruct")
    assert a._engine is None and b._engine is None
    assert a._get_engine() is engine and b._get_engine() is engine


def test_profile_and_tokenizer(engine):
    llm = ChatParaLLM()
    assert llm.profile["max_input_tokens"] == engine.context_window
    assert llm.profile["tool_calling"] and llm.profile["structured_output"]
    assert llm.get_token_ids("Hello world") == engine.encode("Hello world", add_special_tokens=False)
    assert llm.get_num_tokens("Hello world") == 2
    n = llm.get_num_tokens_from_messages([("system", "Be brief."), ("human", "Hello world")])
    assert 5 < n < 40
    # A user's own counter wins, as LangChain's convention has it.
    assert ChatParaLLM(custom_get_token_ids=lambda s: list(s)).get_num_tokens("Hello world") == 11
    assert ParaLLM(custom_get_token_ids=lambda s: s.split()).get_token_ids("a b c") == ["a", "b", "c"]
    by_words = ChatParaLLM(custom_get_token_ids=lambda s: s.split())
    assert by_words.get_num_tokens_from_messages([("human", "one two three")]) == len("Human: one two three".split())


# -- fan-out --------------------------------------------------------------------------------------


async def test_abatch_32_all_in_flight(idle_engine):
    llm = ChatParaLLM(temperature=0, max_tokens=4)
    out = await llm.abatch([f"Say the number {i}." for i in range(N)])
    assert len(out) == N and all(m.content for m in out)
    assert idle_engine.stats()["peak_in_flight"] >= N


def test_batch_32_all_in_flight(idle_engine):
    llm = ChatParaLLM(temperature=0, max_tokens=4)
    out = llm.batch([f"Say the number {i}." for i in range(N)])
    assert len(out) == N and all(m.content for m in out)
    assert idle_engine.stats()["peak_in_flight"] >= N


def test_batch_as_completed_and_max_concurrency(idle_engine):
    llm = ChatParaLLM(temperature=0, max_tokens=4)
    done = dict(llm.batch_as_completed([f"Say {i}." for i in range(8)]))
    assert sorted(done) == list(range(8))
    assert idle_engine.stats()["peak_in_flight"] >= 8
    idle_engine.reset_peaks()
    llm.batch([f"Say {i}." for i in range(6)], config={"max_concurrency": 2})
    assert idle_engine.stats()["peak_in_flight"] <= 2


def test_generate_runs_conversations_concurrently(idle_engine):
    llm = ChatParaLLM(temperature=0, max_tokens=4)
    result = llm.generate([[HumanMessage(f"Say {i}.")] for i in range(6)])
    assert len(result.generations) == 6 and len(result.run) == 6
    assert idle_engine.stats()["peak_in_flight"] >= 6


def test_llm_batch_and_abatch_32_in_flight(idle_engine):
    llm = ParaLLM(temperature=0, max_tokens=4)
    out = llm.batch([f"{i} + {i} =" for i in range(N)])
    assert len(out) == N
    assert idle_engine.stats()["peak_in_flight"] >= N
    idle_engine.reset_peaks()
    out = asyncio.run(llm.abatch([f"{i} * 2 =" for i in range(N)]))
    assert len(out) == N
    assert idle_engine.stats()["peak_in_flight"] >= N
    result = llm.generate(["The capital of France is", "1, 2, 3,"])
    assert result.llm_output["token_usage"]["completion_tokens"] > 0
    assert result.llm_output["model_name"] == "SmolLM2-135M-Instruct"


# -- streaming, callbacks, usage ------------------------------------------------------------------


def test_stream_usage_once_on_last_chunk_and_callbacks_once_per_chunk(engine):
    llm = ChatParaLLM(temperature=0, max_tokens=12)
    counter = _TokenCounter()
    chunks = list(llm.stream("Count from one to ten.", config={"callbacks": [counter]}))
    assert chunks[-1].chunk_position == "last"
    with_usage = [c for c in chunks if c.usage_metadata]
    assert with_usage == [chunks[-1]]
    usage = chunks[-1].usage_metadata
    assert usage["output_tokens"] == 12 and usage["input_tokens"] > 0
    assert "cache_read" in usage["input_token_details"]
    assert chunks[-1].response_metadata["finish_reason"] == "length"
    # one token callback per chunk (the base class fires them; _stream must not fire them again)
    assert len(counter.tokens) == len(chunks)

    streaming = ChatParaLLM(temperature=0, max_tokens=6, streaming=True)
    counter = _TokenCounter()
    msg = streaming.invoke("Count from one to ten.", config={"callbacks": [counter]})
    assert "".join(counter.tokens) == msg.content and len(counter.tokens) > 2

    # ParaLLM (BaseLLM) fires the callbacks itself in _stream
    counter = _TokenCounter()
    text = "".join(ParaLLM(temperature=0, max_tokens=6).stream("1, 2, 3,", config={"callbacks": [counter]}))
    assert "".join(counter.tokens) == text and len(counter.tokens) >= 3


def test_prefix_cache_shows_up_as_cache_read(engine):
    llm = ChatParaLLM(temperature=0, max_tokens=2)
    system = "You are a meticulous librarian. " * 20
    llm.invoke([("system", system), ("human", "First question?")])
    msg = llm.invoke([("system", system), ("human", "Second question?")])
    details = msg.usage_metadata["input_token_details"]
    assert details["cache_read"] >= 100
    assert msg.usage_metadata["input_tokens"] > details["cache_read"]


def test_sampling_fields_and_call_kwargs_reach_the_engine(engine):
    llm = ChatParaLLM(temperature=0, max_tokens=30, stop=["Paris"])
    msg = llm.invoke("What is the capital of France?")
    assert "Paris" not in msg.content
    assert msg.response_metadata["finish_reason"] == "stop"
    msg = llm.invoke("What is the capital of France?", max_tokens=3, stop=None)
    assert msg.usage_metadata["output_tokens"] == 3
    msg = ChatParaLLM(temperature=0, max_tokens=3, logprobs=True, top_logprobs=2).invoke("Hi")
    content = msg.response_metadata["logprobs"]["content"]
    assert len(content) == 3 and len(content[0]["top_logprobs"]) == 2
    result = ChatParaLLM(temperature=1.0, seed=1, max_tokens=3, n=2).generate([[HumanMessage("Hi")]])
    assert len(result.generations[0]) == 2
    with pytest.raises(ValueError):
        ChatParaLLM(max_tokens=0).invoke("Hi")


# -- cancellation ---------------------------------------------------------------------------------


async def test_cancelled_ainvoke_aborts_engine_request(idle_engine):
    llm = ChatParaLLM(temperature=0, **ENDLESS)
    aborted = idle_engine.stats()["requests_aborted"]
    task = asyncio.create_task(llm.ainvoke("Tell me a very long story."))
    await _await_running(idle_engine)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    _wait_idle(idle_engine, 10)
    assert idle_engine.stats()["requests_aborted"] == aborted + 1


async def test_cancelled_abatch_aborts_every_request(idle_engine):
    llm = ChatParaLLM(temperature=0, **ENDLESS)
    task = asyncio.create_task(llm.abatch([f"Story {i}" for i in range(8)]))
    await _await_running(idle_engine, 8)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    _wait_idle(idle_engine, 10)


async def test_astream_aclose_aborts_engine_request(idle_engine):
    llm = ChatParaLLM(temperature=0, **ENDLESS)
    stream = llm.astream("Tell me a very long story.")
    async for _chunk in stream:
        break
    assert idle_engine.running_count == 1
    await stream.aclose()
    _wait_idle(idle_engine, 10)


def test_closed_stream_aborts_engine_request(idle_engine):
    for llm in (ChatParaLLM(temperature=0, **ENDLESS), ParaLLM(temperature=0, **ENDLESS)):
        stream = llm.stream("Once upon a time")
        next(stream)
        assert idle_engine.running_count == 1
        stream.close()
        _wait_idle(idle_engine, 10)


def test_timeout_aborts_engine_request(idle_engine):
    llm = ChatParaLLM(temperature=0, timeout=0.5, **ENDLESS)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        llm.invoke("Tell me a very long story.")
    assert time.monotonic() - t0 < 10
    _wait_idle(idle_engine, 10)
    with pytest.raises(TimeoutError):
        asyncio.run(llm.ainvoke("Tell me a very long story."))
    _wait_idle(idle_engine, 10)
    with pytest.raises(TimeoutError):
        ParaLLM(temperature=0, timeout=0.5, **ENDLESS).invoke("Once upon a time")
    _wait_idle(idle_engine, 10)


# -- LangGraph ------------------------------------------------------------------------------------


class State(TypedDict):
    topics: list[str]
    answers: Annotated[list[str], operator.add]


class Branch(TypedDict):
    topic: str



async def test_langgraph_send_fan_out_overlaps_model_calls(idle_engine):
    llm = ChatParaLLM(temperature=0, max_tokens=6)

    async def answer(state: Branch) -> dict:
        msg = await llm.ainvoke(f"One word about {state['topic']}.")
        return {"answers": [msg.content]}

    def fan_out(state: State) -> list[Send]:
        return [Send("answer", {"topic": t}) for t in state["topics"]]

    graph = StateGraph(State)
    graph.add_node("answer", answer)
    graph.add_conditional_edges(START, fan_out, ["answer"])
    graph.add_edge("answer", END)
    app = graph.compile()
    out = await app.ainvoke({"topics": ["cats", "dogs", "rain", "tea"], "answers": []})
    assert len(out["answers"]) == 4
    assert idle_engine.stats()["peak_in_flight"] >= 4

    # the sync graph runs its branches on threads: still overlapping
    idle_engine.reset_peaks()

    def answer_sync(state: Branch) -> dict:
        return {"answers": [llm.invoke(f"One word about {state['topic']}.").content]}

    graph = StateGraph(State)
    graph.add_node("answer", answer_sync)
    graph.add_conditional_edges(START, fan_out, ["answer"])
    graph.add_edge("answer", END)
    out = await asyncio.to_thread(graph.compile().invoke, {"topics": ["a", "b", "c", "d"], "answers": []})
    assert len(out["answers"]) == 4
    assert idle_engine.stats()["peak_in_flight"] >= 4


class _Ends(BaseCallbackHandler):
    """Records when each of a run's model calls ends."""

    def __init__(self, log: list, label: str):
        self.log, self.label = log, label

    def on_llm_end(self, response, **kwargs: Any) -> None:
        self.log.append(self.label)


@pytest.mark.parametrize("method", ["batch", "abatch"])
def test_a_batch_is_one_fairness_group(method):
    """The engine admits round-robin over fairness groups. A batch's inputs are one group, so another
    caller's invoke sent while most of the batch waits in the queue is admitted as soon as a decode slot
    frees (two slots here), not after every input queued before it (each input its own group: it would end
    after all of them). Measured by the order the calls end."""
    import threading

    llm = ChatParaLLM(engine_kwargs={"max_batch_size": 2}, max_tokens=16, temperature=0)
    engine = llm._get_engine(None)
    submitted = engine.stats()["requests_submitted"]
    ends: list[str] = []
    prompts = [f"Count from {i} to {i + 20}." for i in range(8)]
    config = {"callbacks": [_Ends(ends, "batch")], "max_concurrency": len(prompts)}  # all queued at once
    if method == "batch":
        worker = threading.Thread(target=lambda: llm.batch(prompts, config=config))
    else:
        worker = threading.Thread(target=lambda: asyncio.run(llm.abatch(prompts, config=config)))
    worker.start()
    deadline = time.monotonic() + 30
    while engine.stats()["requests_submitted"] < submitted + len(prompts):
        assert time.monotonic() < deadline, engine.stats()
        time.sleep(0.005)
    ends.append("sent")
    llm.invoke("Say hi.", config={"callbacks": [_Ends(ends, "other")]})
    worker.join(60)
    assert sorted(ends) == ["batch"] * len(prompts) + ["other", "sent"]
    sent, other = ends.index("sent"), ends.index("other")
    assert len(prompts) - sent >= 5, ends  # most of the batch still waiting when the invoke was sent
    assert other - sent - 1 <= 3, ends  # the two running and the one admitted beside it, at most
