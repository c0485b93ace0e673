"""Tool-call parsing of finished text and of streams split at every possible point."""

from __future__ import annotations

import json

import pytest

from parallm_engine.formats.chat_format import (
    ContentDelta,
    ToolCallDelta,
    ToolCallStreamParser,
    parse_tool_calls,
)

TWO_CALLS = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)


def test_parse_several_calls_with_unique_ids():
    content, calls = parse_tool_calls(TWO_CALLS)
    assert content == "Let me check."
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert calls[0].arguments == {"city": "Paris", "days": [1, 2]} and calls[1].arguments == {}
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    assert json.loads(calls[0].as_openai()["function"]["arguments"]) == {"city": "Paris", "days": [1, 2]}


def test_malformed_or_unknown_calls_stay_content():
    text = "<tool_call>\n{not json}\n</tool_call> after"
    content, calls = parse_tool_calls(text)
    assert calls == [] and content == text
    content, calls = parse_tool_calls(TWO_CALLS, tools=[{"type": "function", "function": {"name": "get_time"}}])
    assert [c.name for c in calls] == ["get_time"] and "get_weather" in content
    assert parse_tool_calls("plain answer") == ("plain answer", [])
    # arguments given as a JSON string, and a call cut off before its end tag
    _, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}')
    assert calls[0].arguments == {"x": 1}
    _, calls = parse_tool_calls('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_')
    assert [c.name for c in calls] == ["f"]


def _run_stream(text, cut):
    parser = ToolCallStreamParser()
    events = []
    for i in range(0, len(text), cut):
        events += parser.feed(text[i : i + cut])
    events += parser.finish()
    return parser, events


@pytest.mark.parametrize("cut", [1, 2, 3, 5, 7, 13, 1000])
def test_stream_parser_matches_final_parse(cut):
    parser, events = _run_stream(TWO_CALLS, cut)
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    assert "<tool" not in content and content.strip() == "Let me check."
    calls = {}
    for e in events:
        if isinstance(e, ToolCallDelta):
            c = calls.setdefault(e.index, {"id": None, "name": None, "args": ""})
            if e.id:
                c["id"], c["name"] = e.id, e.name
            c["args"] += e.arguments_delta
    assert [calls[i]["name"] for i in sorted(calls)] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["args"]) == {"city": "Paris", "days": [1, 2]}
    assert json.loads(calls[1]["args"]) == {}
    assert [c.name for c in parser.calls] == ["get_weather", "get_time"]
    assert [calls[i]["id"] for i in sorted(calls)] == [c.id for c in parser.calls]


@pytest.mark.parametrize("cut", [1, 4, 100])
def test_stream_parser_plain_text_and_lookalikes(cut):
    text = "a < b and <tool is not a call; <tool_call>{bad}</tool_call> end"
    parser, events = _run_stream(text, cut)
    assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == text
    assert parser.calls == []
