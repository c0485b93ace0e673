"""OpenTelemetry spans per request (core/tracing.py) into the SDK's in-memory exporter: a LangGraph run of 4
agents on ChatParaLLM yields one request span per model call, each a child of the span of the agent that made
it, with queue / prefill / decode children and the cached-token attribute equal to ``usage_metadata``'s; the
same over ``base_url=`` (the client sends ``traceparent``, the server continues it). Off without a provider."""

from __future__ import annotations

import asyncio
import operator
import os
import subprocess
import sys
import time
from typing import Annotated, TypedDict

import pytest

from parallm_engine.serve.server import ServerThread

KEY = "tracing-key"
SYSTEM = "You are one of four agents planning a trip. Answer in one short sentence."


@pytest.fixture(scope="module")
def spans():
    """The process's tracer provider (set here unless a test before set one) with an in-memory exporter; shut
    down after the module, so later tests' spans go nowhere."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    processor = SimpleSpanProcessor(exporter)
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("OTEL_SDK_DISABLED", raising=False)  # a provider made with it set records nothing
        if not isinstance(trace.get_tracer_provider(), TracerProvider):
            trace.set_tracer_provider(TracerProvider())
        provider = trace.get_tracer_provider()
        provider.add_span_processor(processor)
        yield exporter
    processor.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    with ServerThread(engine=engine, api_key=KEY) as srv:
        yield srv


class State(TypedDict):
    agents: list[str]
    answers: Annotated[list, operator.add]


class Agent(TypedDict):
    name: str


def _run_graph(llm, tracer) -> tuple[object, dict]:
    """Four agents in one LangGraph superstep (``Send``), each inside its own span, under a parent span:
    returns the parent span and, per agent, (its span, the model's message)."""
    from langchain_core.messages import HumanMessage, SystemMessage
    from langgraph.graph import END, START, StateGraph
    from langgraph.types import Send

    made: dict = {}

    async def agent(state: Agent) -> dict:
        with tracer.start_as_current_span(f"agent {state['name']}") as span:
            msg = await llm.ainvoke([SystemMessage(SYSTEM), HumanMessage(f"{state['name']}: where to?")])
        made[state["name"]] = (span, msg)
        return {"answers": [msg.content]}

    graph = StateGraph(State)
    graph.add_node("agent", agent)
    graph.add_conditional_edges(START, lambda s: [Send("agent", {"name": a}) for a in s["agents"]], ["agent"])
    graph.add_edge("agent", END)
    app = graph.compile()
    with tracer.start_as_current_span("graph run") as parent:
        out = asyncio.run(app.ainvoke({"agents": ["ana", "ben", "cy", "dee"], "answers": []}))
    assert len(out["answers"]) == 4
    return parent, made


def _request_spans(exporter, trace_id: int) -> list:
    return [s for s in exporter.get_finished_spans()
            if s.context.trace_id == trace_id and s.attributes.get("gen_ai.operation.name")]


@pytest.mark.parametrize("path", ["engine", "base_url"])
def test_a_langgraph_run_has_a_request_span_per_model_call(engine, server, spans, path):
    from opentelemetry import trace

    from parallm_integrations import ChatParaLLM

    remote = {"base_url": server.base_url, "api_key": KEY, "max_retries": 0} if path == "base_url" else {}
    llm = ChatParaLLM(temperature=0, max_tokens=8, **remote)
    llm.invoke(SYSTEM)  # warm: the system prompt's prefix is cached, so the agents read some of it back
    tracer = trace.get_tracer("test")
    parent, made = _run_graph(llm, tracer)
    deadline = time.monotonic() + 10  # the server's spans end on its engine thread as the responses go out
    while len(_request_spans(spans, parent.context.trace_id)) < 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    requests = _request_spans(spans, parent.context.trace_id)
    assert len(requests) == 4
    everything = spans.get_finished_spans()
    for name, (agent_span, msg) in made.items():
        mine = [s for s in requests if s.parent.span_id == agent_span.context.span_id]
        assert len(mine) == 1, name  # one request span per model call, a child of the agent's span
        span = mine[0]
        a = span.attributes
        assert a["gen_ai.system"] == a["gen_ai.provider.name"] == "parallm"
        assert a["gen_ai.request.model"] == engine.model_name
        usage = msg.usage_metadata
        assert a["gen_ai.usage.input_tokens"] == usage["input_tokens"]
        assert a["gen_ai.usage.output_tokens"] == usage["output_tokens"]
        assert a["gen_ai.usage.cache_read.input_tokens"] == usage["input_token_details"]["cache_read"]
        assert tuple(a["gen_ai.response.finish_reasons"]) == (msg.response_metadata["finish_reason"],)
        children = {s.name: s for s in everything if s.parent is not None and s.parent.span_id == span.context.span_id}
        assert set(children) == {"queue", "prefill", "decode"}
        q, p, d = children["queue"], children["prefill"], children["decode"]
        assert span.start_time == q.start_time <= q.end_time == p.start_time <= p.end_time == d.start_time
        assert d.end_time == span.end_time
        assert p.attributes["parallm.prefill.cached_tokens"] == usage["input_token_details"]["cache_read"]
        assert p.attributes["parallm.prefill.computed_tokens"] == \
            usage["input_tokens"] - usage["input_token_details"]["cache_read"]
        # The span's phases are the call's own timings (response_metadata, from the same record).
        assert abs((p.end_time - p.start_time) / 1e9 - msg.response_metadata["prefill_s"]) < 1e-3
    assert sum(s.attributes["gen_ai.usage.cache_read.input_tokens"] for s in requests) > 0


def test_an_aborted_request_ends_its_span_as_an_error(engine, spans):
    from opentelemetry import trace
    from opentelemetry.trace import StatusCode

    with trace.get_tracer("test").start_as_current_span("caller") as caller:
        handle = engine.submit("Count to one hundred:", max_tokens=300, ignore_eos=True, temperature=0)
    next(iter(handle))
    handle.abort()
    deadline = time.monotonic() + 30
    while not _request_spans(spans, caller.context.trace_id) and time.monotonic() < deadline:
        time.sleep(0.02)
    (span,) = _request_spans(spans, caller.context.trace_id)
    assert span.parent.span_id == caller.context.span_id
    assert span.status.status_code == StatusCode.ERROR and span.attributes["error.type"] == "aborted"
    assert tuple(span.attributes["gen_ai.response.finish_reasons"]) == ("abort",)
    assert 1 <= span.attributes["gen_ai.usage.output_tokens"] < 300


def test_parallm_otel_0_keeps_it_off_with_a_provider_set(engine, spans, monkeypatch):
    monkeypatch.setenv("PARALLM_OTEL", "0")
    handle = engine.submit("Hi", max_tokens=2)
    assert handle.request.span is None
    engine._collect(handle)


def test_off_without_a_provider_and_opentelemetry_never_imported():
    code = ("import sys; from parallm_engine.core.tracing import tracer; assert tracer() is None; "
            "assert 'opentelemetry' not in sys.modules, 'imported'; "
            "from opentelemetry import trace; assert tracer() is None; print('off')")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("PARALLM_OTEL", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "off", out.stderr


def test_the_server_continues_a_valid_traceparent_and_ignores_a_bad_one(engine, server, spans):
    import httpx

    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    body = {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    headers = {"Authorization": f"Bearer {KEY}"}
    for bad in ("garbage", "00-" + "0" * 32 + "-" + "0" * 16 + "-01", "ff-" + trace_id + "-" + parent_id + "-zz"):
        r = httpx.post(f"{server.base_url}/chat/completions", json=body, headers={**headers, "traceparent": bad})
        assert r.status_code == 200, (bad, r.text)
    r = httpx.post(f"{server.base_url}/chat/completions", json=body,
                   headers={**headers, "traceparent": f"00-{trace_id}-{parent_id}-01"})
    assert r.status_code == 200
    deadline = time.monotonic() + 10
    while not _request_spans(spans, int(trace_id, 16)) and time.monotonic() < deadline:
        time.sleep(0.02)
    (span,) = _request_spans(spans, int(trace_id, 16))
    assert span.parent.span_id == int(parent_id, 16) and span.parent.is_remote


def test_a_span_processor_that_raises_hurts_no_request(engine, spans, caplog):
    """Spans end on the engine thread: a processor failing there is logged, and the request and the engine
    go on (the next request is served and traced)."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import SpanProcessor

    failing: set = set()

    class Failing(SpanProcessor):
        def on_end(self, span):
            if span.context.trace_id in failing and span.parent is not None:  # the engine's, not the caller's
                raise RuntimeError("exporter down")

    trace.get_tracer_provider().add_span_processor(Failing())
    tracer = trace.get_tracer("test")
    with tracer.start_as_current_span("doomed export") as bad:
        failing.add(bad.context.trace_id)
        result = engine.generate(["Hello"], max_tokens=3, temperature=0)[0]
    assert result.finish_reason in ("length", "stop") and result.usage.completion_tokens >= 1
    assert any("could not end the OpenTelemetry span" in r.getMessage() for r in caplog.records)
    with tracer.start_as_current_span("after") as good:
        engine.generate(["Hello again"], max_tokens=2, temperature=0)
    assert len(_request_spans(spans, good.context.trace_id)) == 1
