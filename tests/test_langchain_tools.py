"""Tool calling and structured output through ChatParaLLM on the real default model (constrained
decoding makes even the 135M model emit valid calls), plus LangGraph / create_agent end to end."""

from __future__ import annotations

import asyncio
import operator
import time
from typing import Annotated

import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langgraph.graph import END, START, StateGraph
from langgraph.types import Send
from parallm_engine import Choice, StreamDelta, Usage
from pydantic import BaseModel, Field
from typing_extensions import TypedDict

from parallm_integrations import ChatParaLLM
from parallm_integrations.chat_models import _ChunkBuilder


@tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return f"It is sunny in {city}."


@tool
def get_time(timezone: str) -> str:
    """Get the current time in a timezone."""
    return "12:00"


class Person(BaseModel):
    """A person."""

    name: str = Field(description="the person's first name")
    age: int = Field(description="age in years")


class PersonDict(TypedDict):
    """A person."""

    name: str
    age: int


@pytest.fixture()
def idle_engine(engine):
    deadline = time.monotonic() + 20
    while engine.running_count and time.monotonic() < deadline:
        time.sleep(0.02)
    engine.reset_peaks()
    return engine


def _llm(**kw) -> ChatParaLLM:
    return ChatParaLLM(temperature=0, max_tokens=kw.pop("max_tokens", 48), **kw)


TWO_CALLS = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
)


# -- parsing and streaming of tool calls (no model) ------------------------------------------------


def test_several_calls_in_one_message_get_unique_ids():
    from parallm_engine.formats.chat_format import parse_tool_calls

    from parallm_integrations._common import chat_generation

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    content, calls = parse_tool_calls(TWO_CALLS, tools)  # what the engine puts on a Choice when given tools
    choice = Choice(0, TWO_CALLS, [], "stop", content=content, tool_calls=calls)
    msg = chat_generation(choice, Usage(10, 5, 0), "m").message
    assert [c["args"] for c in msg.tool_calls] == [{"city": "Paris"}, {"city": "Rome"}]
    assert len({c["id"] for c in msg.tool_calls}) == 2
    assert msg.content.strip() == "Let me check."
    assert msg.response_metadata["finish_reason"] == "tool_calls"
    assert len(chat_generation(choice, None, "m", single_call=True).message.tool_calls) == 1


@pytest.mark.parametrize("piece", [1, 3, 7])
def test_streamed_tool_calls_become_tool_call_chunks(piece):
    from parallm_engine.formats.typed_output import TypedOutput

    builder = _ChunkBuilder("m", None)
    typed = TypedOutput(None, [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}])
    chunks = []
    pieces = [TWO_CALLS[i : i + piece] for i in range(0, len(TWO_CALLS), piece)]
    for i, text in enumerate(pieces):
        last = i == len(pieces) - 1
        typed_pieces = typed.feed(text) + (typed.finish("stop") if last else [])
        delta = StreamDelta("r", 0, text, [], finish_reason="stop" if last else None,
                            usage=Usage(9, 40, 0) if last else None, pieces=typed_pieces)
        chunks.extend(builder.feed(delta))
    chunks.extend(builder.finish())
    full = chunks[0].message
    for c in chunks[1:]:
        full = full + c.message
    assert "<tool_call>" not in full.content and full.content.strip() == "Let me check."
    assert [c["args"] for c in full.tool_calls] == [{"city": "Paris"}, {"city": "Rome"}]
    assert len({c["id"] for c in full.tool_calls}) == 2
    assert [c for c in chunks if c.message.usage_metadata] == [chunks[-1]]
    assert chunks[-1].message.chunk_position == "last"
    assert full.response_metadata["finish_reason"] == "tool_calls"


# -- on the model ---------------------------------------------------------------------------------


def test_required_and_named_tool_choice_give_valid_calls(engine):
    llm = _llm()
    msg = llm.bind_tools([get_weather], tool_choice="any").invoke("What is the weather like in Paris?")
    assert len(msg.tool_calls) >= 1
    call = msg.tool_calls[0]
    assert call["name"] == "get_weather" and isinstance(call["args"].get("city"), str)
    assert call["id"].startswith("call_") and call["type"] == "tool_call"
    assert msg.response_metadata["finish_reason"] == "tool_calls"

    named = llm.bind_tools([get_weather, get_time], tool_choice="get_time").invoke("Weather in Paris?")
    assert named.tool_calls and named.tool_calls[0]["name"] == "get_time"
    assert isinstance(named.tool_calls[0]["args"].get("timezone"), str)


def test_streamed_tool_call_matches_invoke(engine):
    bound = _llm().bind_tools([get_weather], tool_choice="get_weather")
    question = "What is the weather like in Tokyo?"
    invoked = bound.invoke(question)
    chunks = list(bound.stream(question))
    assert any(c.tool_call_chunks for c in chunks)
    full = chunks[0]
    for c in chunks[1:]:
        full = full + c
    assert [c["args"] for c in full.tool_calls] == [c["args"] for c in invoked.tool_calls]
    assert full.tool_calls[0]["name"] == "get_weather"


def test_penalties_keep_constrained_output_valid(engine):
    # Penalties are applied after the grammar mask; masked tokens must stay masked (no NaN logits).
    llm = _llm(max_tokens=8, repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.5)
    msg = llm.bind(response_format={"type": "json_object"}).invoke("Tell me a joke about cats.")
    assert msg.content.startswith('{"')


def test_tool_history_round_trip(engine):
    llm = _llm(max_tokens=24).bind_tools([get_weather])
    history = [
        HumanMessage("What is the weather in Paris?"),
        AIMessage("", tool_calls=[{"name": "get_weather", "args": {"city": "Paris"}, "id": "call_1", "type": "tool_call"}]),
        ToolMessage("It is sunny in Paris.", tool_call_id="call_1"),
    ]
    msg = llm.invoke(history)
    assert isinstance(msg, AIMessage) and msg.content


async def test_structured_output_every_method(engine):
    llm = _llm(max_tokens=64)
    prompt = "Alice is 30 years old. Extract the person."
    pyd, typed, mode, raw = await asyncio.gather(
        llm.with_structured_output(Person).ainvoke(prompt),
        llm.with_structured_output(PersonDict, method="function_calling").ainvoke(prompt),
        llm.with_structured_output(method="json_mode").ainvoke(prompt + " Answer in JSON."),
        llm.with_structured_output(Person.model_json_schema(), include_raw=True).ainvoke(prompt),
    )
    assert isinstance(pyd, Person)
    assert set(typed) == {"name", "age"} and isinstance(typed["age"], int)
    assert isinstance(mode, dict)
    assert raw["parsing_error"] is None and set(raw["parsed"]) == {"name", "age"}
    assert isinstance(raw["raw"], AIMessage)


def test_create_agent_provider_strategy_uses_response_format(engine):
    from langchain.agents import create_agent

    agent = create_agent(_llm(max_tokens=40), tools=[], response_format=Person)
    out = agent.invoke({"messages": [HumanMessage("Bob is 41 years old. Extract the person.")]})
    assert isinstance(out["structured_response"], Person)


# -- LangGraph: 4 parallel tool calls whose follow-up model calls overlap ------------------------


class TripState(TypedDict):
    cities: list[str]
    reports: Annotated[list[str], operator.add]


class CityTask(TypedDict):
    city: str


async def test_langgraph_four_parallel_tool_calls_overlap(idle_engine):
    llm = _llm(max_tokens=24)
    caller = llm.bind_tools([get_weather], tool_choice="get_weather", max_tokens=48)
    active = {"now": 0, "peak": 0, "tools": 0, "tool_peak": 0}

    async def run_tool(call: dict) -> ToolMessage:
        active["tools"] += 1
        active["tool_peak"] = max(active["tool_peak"], active["tools"])
        await asyncio.sleep(1.5)  # an I/O-bound tool (long enough for all four branches to reach it)
        active["tools"] -= 1
        return ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])

    async def worker(task: CityTask) -> dict:
        history = [HumanMessage(f"What is the weather in {task['city']}?")]
        ai = await caller.ainvoke(history)  # constrained: a valid get_weather call
        assert ai.tool_calls and ai.tool_calls[0]["name"] == "get_weather"
        tool_msg = await run_tool(ai.tool_calls[0])
        active["now"] += 1
        active["peak"] = max(active["peak"], active["now"])
        try:
            answer = await llm.ainvoke([*history, ai, tool_msg])  # the follow-up model call
        finally:
            active["now"] -= 1
        return {"reports": [answer.content]}

    def fan_out(state: TripState) -> list[Send]:
        return [Send("worker", {"city": c}) for c in state["cities"]]

    graph = StateGraph(TripState)
    graph.add_node("worker", worker)
    graph.add_conditional_edges(START, fan_out, ["worker"])
    graph.add_edge("worker", END)
    app = graph.compile()

    t0 = time.perf_counter()
    out = await app.ainvoke({"cities": ["Paris", "Rome", "Oslo", "Lima"], "reports": []})
    elapsed = time.perf_counter() - t0
    assert len(out["reports"]) == 4
    assert active["tool_peak"] == 4  # the four tool calls ran at the same time
    assert active["peak"] >= 2  # follow-up model calls from different branches overlapped
    assert idle_engine.stats()["peak_in_flight"] >= 4
    assert elapsed < 120
