"""Grammar-constrained decoding inside the batch: JSON schemas hold under sampling, constrained rows do
not disturb their unconstrained neighbours, tool choices force valid calls, bad grammars are typed errors."""

from __future__ import annotations

import json

import jsonschema
import pytest

from parallm_engine import GrammarError

from .conftest import chat_ids

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
    },
    "required": ["name", "age", "address"],
    "additionalProperties": False,
}
RF = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}


def test_sampled_outputs_always_match_a_nested_schema(engine):
    prompt = chat_ids(engine, "Describe a fictional person as JSON with name, age, address (city, zip) and tags.")
    results = engine.generate([prompt] * 100, max_tokens=96, temperature=1.0, response_format=RF)
    stopped = [r for r in results if r.finish_reason == "stop"]
    assert len(stopped) >= 60, f"only {len(stopped)} of 100 finished"
    for r in stopped:
        jsonschema.validate(json.loads(r.text), PERSON)
    for r in results:
        if r.finish_reason == "length":
            assert r.choices[0].incomplete


def test_unconstrained_neighbours_are_unchanged(engine):
    qs = ["What is the capital of France?", "Name three colors.", "Why is the sky blue?"]
    plain = [chat_ids(engine, q) for q in qs]
    alone = engine.generate(plain, max_tokens=20, temperature=0)
    handles = [engine.submit(chat_ids(engine, "Give me a person as JSON."), max_tokens=40, temperature=0.8,
                             response_format=RF) for _ in range(3)]
    mixed = engine.generate(plain, max_tokens=20, temperature=0)
    for h in handles:
        list(h)
    for a, b in zip(alone, mixed):
        assert a.token_ids == b.token_ids


def test_required_and_named_tool_choice_force_valid_calls(engine):
    msgs = [{"role": "user", "content": "What's the weather like in Paris right now?"}]
    r = engine.chat(msgs, tools=[WEATHER, TIME], tool_choice="required", max_tokens=60, temperature=0)
    assert r.tool_calls, r.text
    for call in r.tool_calls:
        assert call.name in ("get_weather", "get_time")
        schema = (WEATHER if call.name == "get_weather" else TIME)["function"]["parameters"]
        jsonschema.validate(call.arguments, schema)
    named = engine.chat(msgs, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}},
                        max_tokens=60, temperature=0.7, seed=1)
    assert [c.name for c in named.tool_calls] == ["get_time"]
    jsonschema.validate(named.tool_calls[0].arguments, TIME["function"]["parameters"])


def test_json_object_and_regex(engine):
    r = engine.chat([{"role": "user", "content": "Give me a JSON object about a cat."}], max_tokens=60, temperature=0,
                    response_format={"type": "json_object"})
    if r.finish_reason == "stop":
        assert isinstance(json.loads(r.text), dict)
    r = engine.generate(["The year is"], max_tokens=8, temperature=1.0, response_format={"type": "regex", "regex": "[0-9]{4}"})[0]
    assert len(r.text) == 4 and r.text.isdigit()


@pytest.mark.parametrize("rf", [
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
    {"type": "regex", "regex": "[a-z"},
    {"type": "xml"},
    "json",
])
def test_invalid_grammars_are_typed_errors(engine, rf):
    with pytest.raises(GrammarError):
        engine.submit("hello", response_format=rf, max_tokens=4)
    assert engine.generate(["ok"], max_tokens=2, temperature=0)[0].usage.completion_tokens == 2


def test_unknown_named_tool_is_an_error(engine):
    with pytest.raises(GrammarError):
        engine.submit("hi", tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})
