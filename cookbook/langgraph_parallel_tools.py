"""A LangGraph research agent whose tool calls run in parallel on one shared ParaLLM engine.

    question --plan--> [city, city, city, city] --Send--> 4 x create_agent(get_weather) --> report

1. ``plan``: ``with_structured_output`` (decoding constrained to the schema) pulls the cities out of
   the question.
2. ``Send`` fans out one branch per city. Each branch is a ``langchain.agents.create_agent`` agent:
   the model calls ``get_weather`` (its first turn is forced to call a tool, and constrained decoding
   makes the 135M default model's call valid), the tool runs (an I/O-bound call, simulated with
   ``asyncio.sleep``), then the model reads the result and answers. The branches run concurrently, so
   the tool calls overlap and so do the model calls: the engine decodes them as one batch.
3. ``report``: one model call combines the answers.

The script runs the same graph with ``max_concurrency=1`` and prints the engine's peak concurrency, the
tools' peak concurrency and the speedup.

    .venv/bin/python cookbook/langgraph_parallel_tools.py
    .venv/bin/python cookbook/langgraph_parallel_tools.py --tool-latency 2 --question "..."
"""

from __future__ import annotations

import argparse
import asyncio
import operator
import time
from typing import Annotated

from langchain.agents import create_agent
from langchain.agents.middleware import ModelRequest, wrap_model_call
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langgraph.graph import END, START, StateGraph
from langgraph.types import Send
from pydantic import BaseModel, Field
from typing_extensions import TypedDict

from parallm_integrations import ChatParaLLM

TOOL_LATENCY = 1.0
FAKE_WEATHER = {"paris": "light rain, 14 C", "tokyo": "sunny, 22 C", "lima": "overcast, 18 C", "oslo": "snow, -3 C"}
_tool_stats = {"now": 0, "peak": 0, "calls": 0}


@tool
async def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    _tool_stats["now"] += 1
    _tool_stats["calls"] += 1
    _tool_stats["peak"] = max(_tool_stats["peak"], _tool_stats["now"])
    try:
        await asyncio.sleep(TOOL_LATENCY)  # stands in for a real API call
        return f"The weather in {city} is {FAKE_WEATHER.get(city.strip().lower(), 'mild, 17 C')}."
    finally:
        _tool_stats["now"] -= 1


@wrap_model_call
async def call_a_tool_first(request: ModelRequest, handler):
    """Small models rarely decide to call a tool on their own: require one on the agent's first turn
    (constrained decoding then guarantees a valid call); later turns are free to answer."""
    if not any(isinstance(m, ToolMessage) for m in request.messages):
        request = request.override(tool_choice="any")
    return await handler(request)


class Cities(BaseModel):
    """The cities a question is about."""

    cities: list[str] = Field(description="names of the cities mentioned in the question")


class State(TypedDict):
    question: str
    cities: list[str]
    findings: Annotated[list[str], operator.add]
    report: str


class Branch(TypedDict):
    city: str


def build_graph(llm: ChatParaLLM):
    planner = llm.with_structured_output(Cities)
    researcher = create_agent(
        llm,
        tools=[get_weather],
        system_prompt="You answer weather questions. Use the get_weather tool, then answer in one sentence.",
        middleware=[call_a_tool_first],
    )

    async def plan(state: State) -> dict:
        found = await planner.ainvoke(f"List the cities in this question: {state['question']}")
        return {"cities": found.cities[:8]}

    def fan_out(state: State) -> list[Send]:
        return [Send("research", {"city": c}) for c in state["cities"]]

    async def research(branch: Branch) -> dict:
        out = await researcher.ainvoke({"messages": [HumanMessage(f"What is the weather in {branch['city']}?")]})
        answer = out["messages"][-1].content
        # Small models tend to echo the template's <tool_response> markup around what they read.
        answer = answer.replace("<tool_response>", "").replace("</tool_response>", "").strip()
        return {"findings": [f"{branch['city']}: {answer}"]}

    async def report(state: State) -> dict:
        notes = "\n".join(state["findings"])
        msg = await llm.ainvoke(f"Write a one-paragraph weather report from these notes:\n{notes}")
        return {"report": msg.content}

    graph = StateGraph(State)
    graph.add_node("plan", plan)
    graph.add_node("research", research)
    graph.add_node("report", report)
    graph.add_edge(START, "plan")
    graph.add_conditional_edges("plan", fan_out, ["research"])
    graph.add_edge("research", "report")
    graph.add_edge("report", END)
    return graph.compile()


async def run(app, question: str, engine, max_concurrency: int | None) -> tuple[float, dict, dict]:
    engine.reset_peaks()
    _tool_stats.update(now=0, peak=0, calls=0)
    config = {"max_concurrency": max_concurrency} if max_concurrency else {}
    t0 = time.perf_counter()
    out = await app.ainvoke({"question": question, "cities": [], "findings": [], "report": ""}, config=config)
    return time.perf_counter() - t0, out, dict(_tool_stats, engine_peak=engine.stats()["peak_in_flight"])


async def main() -> None:
    global TOOL_LATENCY
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--question", default="What is the weather like today in Paris, Tokyo, Lima and Oslo?")
    parser.add_argument("--tool-latency", type=float, default=TOOL_LATENCY, help="seconds per tool call")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    TOOL_LATENCY = args.tool_latency

    # frequency_penalty: greedy decoding of a small model otherwise tends to loop.
    llm = ChatParaLLM(model=args.model, temperature=0, max_tokens=args.max_tokens, frequency_penalty=0.8)
    await llm.ainvoke("Hi", max_tokens=1)  # load the model once
    engine = llm._get_engine()
    app = build_graph(llm)

    t_par, out, stats = await run(app, args.question, engine, None)
    print(f"cities: {out['cities']}")
    for line in out["findings"]:
        print(f"  {line}")
    print(f"report: {out['report'].strip()}\n")
    print(f"parallel         : {t_par:6.1f} s  engine peak concurrency {stats['engine_peak']}, "
          f"{stats['calls']} tool calls, tool peak concurrency {stats['peak']}")
    t_seq, _, seq = await run(app, args.question, engine, 1)
    print(f"max_concurrency=1: {t_seq:6.1f} s  engine peak concurrency {seq['engine_peak']}, "
          f"{seq['calls']} tool calls, tool peak concurrency {seq['peak']}")
    print(f"speedup {t_seq / t_par:.2f}x")


if __name__ == "__main__":
    asyncio.run(main())
