"""LangChain <-> OpenAI conversions used by ChatParaLLM (no model needed)."""

from __future__ import annotations

import json

import pytest
from langchain_core.messages import AIMessage, ChatMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from pydantic import BaseModel, Field

from parallm_integrations import ChatParaLLM, ParaLLM
from parallm_integrations._messages import (
    messages_to_dicts,
    normalize_response_format,
    normalize_tool_choice,
    schema_response_format,
    tools_to_openai,
)


@tool
def get_weather(city: str) -> str:
    """Get the weather in a city."""
    return "sunny"


class Joke(BaseModel):
    """A joke."""

    setup: str = Field(description="the setup")
    punchline: str


def test_history_with_tool_calls_and_tool_messages():
    history = [
        SystemMessage("Be brief."),
        HumanMessage("Weather in Paris and Rome?", name="alice"),
        AIMessage(
            [{"type": "text", "text": "Checking."}, {"type": "tool_use", "id": "a", "name": "get_weather", "input": {}}],
            tool_calls=[
                {"name": "get_weather", "args": {"city": "Paris"}, "id": "a", "type": "tool_call"},
                {"name": "get_weather", "args": {"city": "Rome"}, "id": "b", "type": "tool_call"},
            ],
        ),
        ToolMessage("sunny", tool_call_id="a", name="get_weather"),
        ToolMessage([{"type": "text", "text": "rainy"}], tool_call_id="b"),
        ChatMessage(role="user", content="Thanks"),
    ]
    d = messages_to_dicts(history)
    assert [m["role"] for m in d] == ["system", "user", "assistant", "tool", "tool", "user"]
    assert d[2]["content"] == "Checking."
    assert [c["id"] for c in d[2]["tool_calls"]] == ["a", "b"]
    assert json.loads(d[2]["tool_calls"][1]["function"]["arguments"]) == {"city": "Rome"}
    assert d[3] == {"role": "tool", "tool_call_id": "a", "content": "sunny", "name": "get_weather"}
    assert d[4]["content"] == "rainy"


def test_history_renders_through_the_chat_template(engine):
    history = [
        HumanMessage("Weather in Paris?"),
        AIMessage("", tool_calls=[{"name": "get_weather", "args": {"city": "Paris"}, "id": "a", "type": "tool_call"}]),
        ToolMessage("sunny", tool_call_id="a"),
    ]
    text = engine.apply_chat_template(
        messages_to_dicts(history), tools=tools_to_openai([get_weather]), tokenize=False
    )
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text
    assert '{"type": "function", "function": {"name": "get_weather"' in text


def test_non_text_inputs_are_rejected_not_dropped():
    # Images travel as OpenAI image_url parts (a vision model reads them; a text model's engine refuses them
    # with ImageInputError: tests/test_vision.py); other attachments are refused here.
    assert messages_to_dicts([HumanMessage([{"type": "image", "url": "http://x/y.png"}])])[0]["content"] == [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
    with pytest.raises(ValueError, match="text only"):
        messages_to_dicts([HumanMessage([{"type": "audio", "url": "http://x/y.wav"}])])


def test_tool_choice_spellings():
    names = ["get_weather", "search"]
    assert normalize_tool_choice(None, names) is None
    assert normalize_tool_choice(False, names) is None
    assert normalize_tool_choice("auto", names) == "auto"
    assert normalize_tool_choice("none", names) == "none"
    for required in ("any", "required", True, {"type": "any"}):
        assert normalize_tool_choice(required, names) == "required"
    named = {"type": "function", "function": {"name": "search"}}
    assert normalize_tool_choice("search", names) == named
    assert normalize_tool_choice(named, names) == named
    assert normalize_tool_choice({"type": "tool", "name": "search"}, names) == named
    with pytest.raises(ValueError, match="bound tool"):
        normalize_tool_choice("nope", names)
    with pytest.raises(ValueError):
        normalize_tool_choice({"type": "function", "function": {"name": "nope"}}, names)


def test_response_format_spellings():
    rf = schema_response_format(Joke, strict=True)
    assert rf["type"] == "json_schema"
    assert rf["json_schema"]["name"] == "Joke" and rf["json_schema"]["strict"] is True
    assert rf["json_schema"]["schema"]["required"] == ["setup", "punchline"]
    assert normalize_response_format(Joke)["json_schema"]["name"] == "Joke"
    assert normalize_response_format({"type": "json_object"}) == {"type": "json_object"}
    assert normalize_response_format({"type": "text"}) is None
    assert normalize_response_format(Joke.model_json_schema())["json_schema"]["name"] == "Joke"
    with pytest.raises(ValueError):
        normalize_response_format({"type": "yaml"})


def test_bind_tools_normalises_everything():
    llm = ChatParaLLM()
    bound = llm.bind_tools([get_weather, Joke], tool_choice="any", parallel_tool_calls=False, strict=True)
    kw = bound.kwargs
    assert [t["function"]["name"] for t in kw["tools"]] == ["get_weather", "Joke"]
    assert kw["tool_choice"] == "required" and kw["parallel_tool_calls"] is False
    assert kw["tools"][0]["function"]["strict"] is True
    bound = llm.bind_tools([get_weather], tool_choice="get_weather", response_format=Joke)
    assert bound.kwargs["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert bound.kwargs["response_format"]["type"] == "json_schema"
    with pytest.raises(ValueError):
        llm.bind_tools([get_weather], tool_choice="search")
    assert llm._engine is None  # binding loads nothing


def test_fields_aliases_and_ls_params():
    llm = ChatParaLLM(model_name="SmolLM2-135M-Instruct", request_timeout=5, temperature=0.2, max_tokens=7)
    assert llm.model == "SmolLM2-135M-Instruct" and llm.timeout == 5
    ls = llm._get_ls_params(stop=["x"])
    assert ls == {
        "ls_provider": "parallm", "ls_model_name": "SmolLM2-135M-Instruct", "ls_model_type": "chat",
        "ls_temperature": 0.2, "ls_max_tokens": 7, "ls_stop": ["x"],
    }
    assert llm._get_ls_params(model="other")["ls_model_name"] == "other"
    assert ParaLLM()._get_ls_params()["ls_model_type"] == "llm"
    with pytest.raises(ValueError, match="streaming"):
        ChatParaLLM(n=2, streaming=True)


def test_base_url_never_touches_the_local_engine(monkeypatch):
    """With base_url set, every path goes to the server's client (through ``backends.RemoteBackend``), with
    OpenAI-shaped input."""
    from parallm_integrations._remote_client import RemoteChoice, RemoteClient, RemoteResult

    seen = {}

    def fake_chat(self, messages, **params):
        seen["chat_generate"] = (messages, params)
        return RemoteResult("r", [RemoteChoice(0, "remote", "stop", content="remote")])

    monkeypatch.setattr(RemoteClient, "chat", fake_chat)
    llm = ChatParaLLM(base_url="http://127.0.0.1:9/v1", temperature=0, max_tokens=5)
    msg = llm.bind_tools([get_weather], tool_choice="any").invoke("hi", stop=["x"])
    assert msg.content == "remote" and llm._engine is None
    messages, params = seen["chat_generate"]
    assert messages == [{"role": "user", "content": "hi"}]
    assert params["tool_choice"] == "required" and params["tools"][0]["function"]["name"] == "get_weather"
    assert params["stop"] == ["x"] and params["max_tokens"] == 5 and params["model"] == "SmolLM2-135M-Instruct"
