"""The one output parser (``parallm_engine.formats.typed_output.TypedOutput``), without a model: streamed pieces
concatenate exactly to the finished message at every cut and in every delta size, calls cut off by
max_tokens are calls flagged incomplete, markup never reaches the content, and no whitespace appears
between parallel calls. Plus LlamaIndex's partial-JSON reader for streamed structured output."""

from __future__ import annotations

import pytest

from parallm_engine.formats.chat_format import ContentDelta, ReasoningDelta, ToolCallDelta
from parallm_engine.formats.typed_output import TRUNCATED_CALL, Finish, TypedOutput

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TWO_CALLS = ('Let me check. \n' + CALL + '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}'
             '\n</tool_call>\n')


def _run(text: str, reason: str, step: int, tools=TOOLS) -> tuple[TypedOutput, list]:
    out = TypedOutput(None, tools)
    pieces: list = []
    for i in range(0, len(text), step):
        pieces += out.feed(text[i : i + step])
    pieces += out.finish(reason)
    return out, pieces


def _joined(pieces: list) -> tuple[str, dict[int, tuple[str | None, str]]]:
    """What a client that concatenates the pieces sees: content, and per call (name, argument text)."""
    content, calls = "", {}
    for p in pieces:
        if isinstance(p, ContentDelta):
            content += p.text
        elif isinstance(p, ToolCallDelta):
            name, args = calls.get(p.index, (None, ""))
            calls[p.index] = (p.name if p.id is not None else name, args + p.arguments_delta)
    return content, calls


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_pieces_concatenate_to_the_finished_message_at_every_cut(step):
    for cut in range(len(TWO_CALLS) + 1):
        text = TWO_CALLS[:cut]
        reason = "length" if cut < len(TWO_CALLS) else "stop"
        out, pieces = _run(text, reason, step)
        whole, _ = _run(text, reason, 10_000)
        content, calls = _joined(pieces)
        assert content == out.content == whole.content, cut
        assert "<tool" not in out.content and "</tool_call>" not in out.content, cut
        assert {i: (c.name, c.raw_arguments) for i, c in enumerate(out.calls)} == calls, cut
        assert [(c.name, c.raw_arguments, c.error) for c in out.calls] == \
               [(c.name, c.raw_arguments, c.error) for c in whole.calls], cut
        assert isinstance(pieces[-1], Finish) and pieces[-1].reason == out.finish_reason
        assert pieces[-1].calls == out.calls


def test_a_call_cut_off_is_a_call_flagged_incomplete():
    out, _ = _run(CALL[: CALL.index('"arguments"') + 5], "length", 3)  # ... "get_weather", "argu
    assert out.content == "" and out.finish_reason == "length"
    [call] = out.calls
    assert call.name == "get_weather" and call.error == TRUNCATED_CALL and call.raw_arguments == ""
    out, _ = _run(CALL[: CALL.index("Paris") + 3], "length", 4)  # inside the arguments
    [call] = out.calls
    assert call.raw_arguments == '{"city": "Par' and call.error == TRUNCATED_CALL
    assert call.as_openai()["function"]["arguments"] == '{"city": "Par'  # what a server sends, as OpenAI does
    out, _ = _run(CALL[: CALL.index("get_w") + 5], "length", 1)  # inside the name: the name so far
    assert [c.name for c in out.calls] == ["get_w"] and out.calls[0].error
    # The arguments are whole, only the wrapper was cut: a valid call (finish_reason stays "length").
    out, _ = _run(CALL[:-12], "length", 7)
    assert out.calls[0].arguments == {"city": "Paris"} and out.calls[0].error is None
    assert out.finish_reason == "length"


def test_no_whitespace_between_or_around_parallel_calls():
    out, pieces = _run(TWO_CALLS, "stop", 1)
    assert out.content == "Let me check." and [c.arguments for c in out.calls] == [{"city": "Paris"}, {"city": "Rome"}]
    assert "".join(p.text for p in pieces if isinstance(p, ContentDelta)) == "Let me check."
    assert out.finish_reason == "tool_calls"
    out, _ = _run(CALL + "\n" + CALL, "stop", 2)
    assert out.content == "" and len(out.calls) == 2


def test_text_without_calls_is_kept_exactly():
    text = "  Hello,\n\nworld. \n"
    assert _run(text, "stop", 1, tools=None)[0].content == text
    assert _run(text, "stop", 1)[0].content == text  # tools offered, none called: nothing held back is lost


def test_a_block_that_is_not_a_call_stays_as_the_text_the_model_wrote():
    other = '<tool_call>\n{"name": "not_offered", "arguments": {}}'
    out, _ = _run(other, "stop", 3)  # ended by EOS without the closing tag: none is invented
    assert out.content == other and out.calls == []
    out, _ = _run(other + "\n</tool_call>", "stop", 3)
    assert out.content == other + "\n</tool_call>" and out.calls == []


def test_invalid_arguments_are_an_invalid_call_in_stream_and_result_alike():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>'
    out, pieces = _run(text, "stop", 2)
    [call] = out.calls
    assert call.error and call.raw_arguments == '{"city": Paris}'
    assert _joined(pieces)[1] == {0: ("get_weather", '{"city": Paris}')}


def test_reasoning_pieces_concatenate_to_the_reasoning():
    from parallm_engine.formats.chat_format import OutputParser

    parser = OutputParser(think=("<think>", "</think>"))
    text = "<think>\nFirst, \n\nsecond. \n</think>\n\nThe answer."
    for step in (1, 3, 100):
        out = TypedOutput(parser, None)
        pieces = []
        for i in range(0, len(text), step):
            pieces += out.feed(text[i : i + step])
        pieces += out.finish("stop")
        assert "".join(p.reasoning for p in pieces if isinstance(p, ReasoningDelta)) == out.reasoning
        assert out.reasoning == "First, \n\nsecond." and out.content == "The answer."


def test_partial_json_for_streamed_structured_output():
    from parallm_integrations.llama_index._structured import partial_json

    assert partial_json("") is None
    assert partial_json("{") == {}
    assert partial_json('{"na') == {}
    assert partial_json('{"name": "Al') == {"name": "Al"}
    assert partial_json('{"name": "Al", ') == {"name": "Al"}
    assert partial_json('{"name": "Al", "age": 3') == {"name": "Al", "age": 3}
    assert partial_json('{"a": [1, {"b": "c\\') == {"a": [1, {"b": "c"}]}
    assert partial_json('{"a": {"b": 1}, "c": [tr') == {"a": {"b": 1}, "c": []}


def test_remote_client_says_a_cut_call_the_same_way():
    from parallm_integrations import _remote_client

    assert _remote_client.TRUNCATED_CALL == TRUNCATED_CALL  # the client imports nothing of the engine
