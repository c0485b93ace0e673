"""What the in-process and the remote (``base_url``) LlamaIndex suites share: the same two tools, the
fixture that wraps them, and the usage check every response must pass, so both suites hold the two
backends to one standard."""

from __future__ import annotations

import pytest


def multiply(a: int, b: int) -> int:
    """Multiply two integers and return the product."""
    return a * b


def add(a: int, b: int) -> int:
    """Add two integers and return the sum."""
    return a + b


@pytest.fixture(scope="module")
def tools():
    from llama_index.core.tools import FunctionTool

    return [FunctionTool.from_defaults(multiply), FunctionTool.from_defaults(add)]


def check_usage(resp) -> None:
    usage = resp.raw["usage"]
    assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0
    assert "cached_tokens" in usage["prompt_tokens_details"]
    for key in ("prompt_tokens", "completion_tokens", "cached_tokens", "total_tokens"):
        assert isinstance(resp.additional_kwargs[key], int)
    assert resp.additional_kwargs["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def check_tool_call(llm, r):
    """``r`` (a ``chat_with_tools`` response with the call required) holds exactly one well-formed call
    of one of the two tools; returns it."""
    from llama_index.core.llms.llm import ToolSelection

    calls = llm.get_tool_calls_from_response(r)
    assert len(calls) == 1 and isinstance(calls[0], ToolSelection)
    call = calls[0]
    assert call.tool_name in ("multiply", "add") and call.tool_id.startswith("call_")
    assert set(call.tool_kwargs) == {"a", "b"}
    assert r.raw["finish_reason"] == "tool_calls"
    assert r.message.additional_kwargs["tool_calls"][0]["function"]["name"] == call.tool_name
    check_usage(r)
    return call


def answer_tool_call(llm, tools, ask: str, r, call):
    """Feed the call and its result back: the history with tool turns renders and the model answers in
    text, calling nothing. Returns the final response."""
    from llama_index.core.base.llms.types import ChatMessage, MessageRole

    fn = {"multiply": multiply, "add": add}[call.tool_name]
    history = [
        ChatMessage(role=MessageRole.USER, content=ask),
        r.message,
        ChatMessage(role=MessageRole.TOOL, content=str(fn(**call.tool_kwargs)),
                    additional_kwargs={"tool_call_id": call.tool_id}),
    ]
    final = llm.chat_with_tools(tools, chat_history=history, tool_choice="none")
    assert final.message.content and not llm.get_tool_calls_from_response(final, error_on_no_tool_call=False)
    return final


async def check_streamed_tool_calls(llm, tools) -> None:
    """Streamed tool calls are cumulative (once a call appears every later chunk carries it: a
    FunctionAgent reads each), parsed on the last chunk, and the sync stream gives the same call."""
    from llama_index.core.base.llms.types import ToolCallBlock

    gen = await llm.astream_chat_with_tools(tools, user_msg="Use add to compute 2 plus 3.", tool_choice="add",
                                            max_tokens=40)
    chunks = [ch async for ch in gen]
    seen = [llm.get_tool_calls_from_response(ch, error_on_no_tool_call=False) for ch in chunks]
    first = next(i for i, s in enumerate(seen) if s)
    for sel in seen[first:]:
        assert len(sel) == 1 and sel[0].tool_name == "add" and sel[0].tool_id == seen[first][0].tool_id
    final = chunks[-1]
    block = next(b for b in final.message.blocks if isinstance(b, ToolCallBlock))
    assert isinstance(block.tool_kwargs, dict) and set(block.tool_kwargs) == {"a", "b"}  # parsed at the end
    assert final.raw["finish_reason"] == "tool_calls"
    check_usage(final)
    sync_chunks = list(llm.stream_chat_with_tools(tools, user_msg="Use add to compute 2 plus 3.",
                                                  tool_choice="add", max_tokens=40))
    assert llm.get_tool_calls_from_response(sync_chunks[-1])[0].tool_kwargs == block.tool_kwargs
