"""Agent frameworks against ``parallm serve`` on the default model, each through its own OpenAI-compatible
model class: openai-agents (Responses and Chat Completions models, a streamed run, a forced tool through
``ModelSettings(tool_choice=...)``), pydantic-ai (a tool output and ``NativeOutput``) and smolagents'
``ToolCallingAgent``. Greedy, few tokens, few turns; tracing and telemetry off (no network)."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import BaseModel

from parallm_engine.serve.server import ServerThread


@pytest.fixture(scope="module", autouse=True)
def _no_telemetry():
    """The frameworks' tracing off while this module runs, and only then: set at import, xdist's collection
    would turn OpenTelemetry's SDK off in every worker (tests/test_tracing.py needs it)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")
        mp.setenv("OTEL_SDK_DISABLED", "true")
        yield

KEY = "test-key"
MODEL = "SmolLM2-135M-Instruct"


class City(BaseModel):
    name: str
    country: str


@pytest.fixture(scope="module")
def server(engine):
    with ServerThread(engine=engine, api_key=[KEY]) as srv:
        yield srv


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
def test_openai_agents_forced_tool_and_streamed_run(server, api):
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        calls.append(city)
        return f"It is sunny in {city}."

    async def run():
        client = AsyncOpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)
        cls = agents.OpenAIResponsesModel if api == "responses" else agents.OpenAIChatCompletionsModel
        model = cls(model=MODEL, openai_client=client)
        forced = agents.Agent(
            name="weather", instructions="You answer weather questions.", model=model, tools=[get_weather],
            model_settings=agents.ModelSettings(tool_choice="get_weather", max_tokens=48, temperature=0),
            tool_use_behavior="stop_on_first_tool")
        result = await agents.Runner.run(forced, "What is the weather in Paris?", max_turns=2)
        plain = agents.Agent(name="greeter", instructions="Answer in one short sentence.", model=model,
                             model_settings=agents.ModelSettings(max_tokens=96, temperature=0))
        streamed = agents.Runner.run_streamed(plain, "Say hello.", max_turns=1)
        deltas = [ev async for ev in streamed.stream_events() if ev.type == "raw_response_event"]
        await client.close()
        return result, streamed, deltas

    result, streamed, deltas = asyncio.run(run())
    assert calls and calls[0].strip()  # the forced call ran the tool with a city
    assert result.final_output == f"It is sunny in {calls[0]}."
    assert isinstance(streamed.final_output, str) and streamed.final_output
    assert len(deltas) > 2  # token deltas, not one final blob


def test_pydantic_ai_tool_output_and_native_output(server):
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent, NativeOutput, ToolOutput
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.settings import ModelSettings

    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=server.base_url, api_key=KEY))
    settings = ModelSettings(max_tokens=64, temperature=0)
    for output in (ToolOutput(City), NativeOutput(City)):
        result = Agent(model, output_type=output, model_settings=settings, retries=0).run_sync(
            "What is the capital of France?")
        assert isinstance(result.output, City) and result.output.name and result.output.country
        assert result.usage.input_tokens > 0 and result.usage.output_tokens > 0


def test_smolagents_tool_calling_agent(server):
    smolagents = pytest.importorskip("smolagents")
    from smolagents import tool

    calls: list[str] = []

    @tool  # spelled this way: smolagents reads the decorator from the source
    def weather(city: str) -> str:
        """Get the current weather in a city.

        Args:
            city: the city name
        """
        calls.append(city)
        return f"It is sunny in {city}."

    model = smolagents.OpenAIServerModel(model_id=MODEL, api_base=server.base_url, api_key=KEY, max_tokens=64,
                                         temperature=0)
    agent = smolagents.ToolCallingAgent(tools=[weather], model=model, max_steps=2, verbosity_level=0)
    answer = agent.run("What is the weather in Paris?")
    assert answer is not None
    assert calls and all(isinstance(c, str) and c for c in calls)  # valid calls, run by the agent
    steps = [s for s in agent.memory.steps if getattr(s, "tool_calls", None)]
    assert steps[0].tool_calls[0].name == "weather" and calls[0] == "Paris"
