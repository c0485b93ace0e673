"""``parallm serve``'s OpenAI Responses API through the official ``openai`` SDK and
``ChatOpenAI(use_responses_api=True)``, on the shared default-model engine (greedy, few tokens)."""

from __future__ import annotations

import json

import httpx
import pytest
from openai import OpenAI

from parallm_engine.serve.server import ServerThread

from .test_server import assert_error_body

KEY, OTHER_KEY = "test-key", "other-key"
QUESTION = "What is the capital of France?"
WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CITY_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "country": {"type": "string"}},
               "required": ["name", "country"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(engine):
    with ServerThread(engine=engine, api_key=[KEY, OTHER_KEY]) as srv:
        yield srv


@pytest.fixture
def client(server):
    return OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=120)


def test_plain_matches_engine(client, engine):
    ref = engine.chat([{"role": "user", "content": QUESTION}], max_tokens=16, temperature=0)
    r = client.responses.create(model="default", input=QUESTION, max_output_tokens=16, temperature=0)
    assert r.object == "response" and r.model == engine.model_name
    assert r.output_text == ref.text and "Paris" in r.output_text
    assert [item.type for item in r.output] == ["message"]
    assert r.status == ("incomplete" if ref.finish_reason == "length" else "completed")
    assert r.usage.input_tokens == ref.usage.prompt_tokens
    assert r.usage.output_tokens == ref.usage.completion_tokens
    # Instructions are the system message; items work like the string.
    ref2 = engine.chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}],
                       max_tokens=16, temperature=0)
    r2 = client.responses.create(model="default", instructions="Be brief.", max_output_tokens=16, temperature=0,
                                 input=[{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}])
    assert r2.output_text == ref2.text


def test_function_tools_and_outputs(client):
    r = client.responses.create(model="default", input="What is the weather in Paris?", tools=[WEATHER],
                                tool_choice="required", max_output_tokens=48, temperature=0)
    calls = [item for item in r.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and "city" in json.loads(calls[0].arguments)
    named = client.responses.create(model="default", input="What is the weather in Paris?", tools=[WEATHER],
                                    tool_choice={"type": "function", "name": "get_weather"},
                                    max_output_tokens=48, temperature=0)
    assert named.output[-1].type == "function_call" and named.output[-1].name == "get_weather"
    # The call and its output go back as items.
    follow = client.responses.create(model="default", tools=[WEATHER], max_output_tokens=16, temperature=0, input=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 21 C"}])
    assert follow.status in ("completed", "incomplete") and follow.output


def test_json_schema_format(client):
    r = client.responses.create(model="default", input="Paris is a city in France. Give it as JSON.",
                                max_output_tokens=48, temperature=0,
                                text={"format": {"type": "json_schema", "name": "city", "schema": CITY_SCHEMA,
                                                 "strict": True}})
    data = json.loads(r.output_text)
    assert set(data) == {"name", "country"}


def test_stream_reassembles_to_create(client):
    kw = dict(model="default", input=QUESTION, max_output_tokens=16, temperature=0)
    full = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed" if full.status == "completed" else "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == full.output_text
    final = events[-1].response
    assert final.output_text == full.output_text and final.usage.output_tokens == full.usage.output_tokens
    assert final.usage.input_tokens_details.cached_tokens > 0


def test_stream_function_call_arguments(client):
    kw = dict(model="default", input="What is the weather in Paris?", tools=[WEATHER], tool_choice="required",
              max_output_tokens=48, temperature=0)
    full = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    full_call = next(i for i in full.output if i.type == "function_call")
    assert done and json.loads(done[0].arguments) == json.loads(args) == json.loads(full_call.arguments)


def test_previous_response_id_hits_the_prefix_cache(client, server):
    first = client.responses.create(model="default", input="My name is Ada. Say hello.", max_output_tokens=12,
                                    temperature=0)
    follow = client.responses.create(model="default", input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=12, temperature=0)
    # The follow-up's prompt starts with the first prompt and its answer: read from the radix cache.
    assert follow.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert follow.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    assert follow.previous_response_id == first.id
    # Stored, per key: the other key cannot see it; delete removes it.
    assert client.responses.retrieve(first.id).output_text == first.output_text
    other = OpenAI(base_url=server.base_url, api_key=OTHER_KEY, max_retries=0)
    with pytest.raises(Exception) as err:
        other.responses.retrieve(first.id)
    assert getattr(err.value, "status_code", None) == 404
    client.responses.delete(first.id)
    r = httpx.get(f"{server.base_url}/responses/{first.id}", headers={"Authorization": f"Bearer {KEY}"})
    assert_error_body(r, 404, code="not_found")
    bad = httpx.post(f"{server.base_url}/responses", headers={"Authorization": f"Bearer {KEY}"},
                     json={"input": "hi", "previous_response_id": first.id})
    assert_error_body(bad, 400, param="previous_response_id")
    unstored = client.responses.create(model="default", input="hi", max_output_tokens=2, store=False)
    r = httpx.get(f"{server.base_url}/responses/{unstored.id}", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 404


def test_errors_have_openai_shape(server):
    url, auth = f"{server.base_url}/responses", {"Authorization": f"Bearer {KEY}"}
    assert_error_body(httpx.post(url, json={"input": "hi"}), 401, code="invalid_api_key")
    assert_error_body(httpx.post(url, headers=auth, json={}), 400, param="input")
    assert_error_body(httpx.post(url, headers=auth, json={"input": "hi", "tools": [{"type": "custom", "name": "x"}]}),
                      400, param="tools[0].type")
    assert_error_body(httpx.post(url, headers=auth, json={"input": [{"type": "item_reference", "id": "x"}]}), 400)
    assert_error_body(httpx.post(url, headers=auth, json={"input": "hi", "model": "gpt-9"}), 404)
    r = httpx.post(url, headers={**auth, "Content-Type": "application/json"}, content='{"input": "a\\udc00"}')
    assert "surrogate" in assert_error_body(r, 400)["message"]


# ----------------------------------------------------------------------------------------------
# LangChain
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def chat_openai(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    return langchain_openai.ChatOpenAI(model="default", base_url=server.base_url, api_key=KEY, max_tokens=48,
                                       temperature=0, max_retries=0, use_responses_api=True)


def test_langchain_responses_invoke_stream_tools(chat_openai, engine):
    ref = engine.chat([{"role": "user", "content": QUESTION}], max_tokens=48, temperature=0)
    msg = chat_openai.invoke(QUESTION)
    assert msg.text == ref.text
    assert msg.usage_metadata["input_tokens"] == ref.usage.prompt_tokens
    chunks = list(chat_openai.stream(QUESTION))
    assert "".join(c.text for c in chunks) == ref.text

    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return "sunny"

    call = chat_openai.bind_tools([get_weather], tool_choice="get_weather").invoke("Weather in Paris?")
    assert call.tool_calls and call.tool_calls[0]["name"] == "get_weather"
    assert isinstance(call.tool_calls[0]["args"].get("city"), str)
