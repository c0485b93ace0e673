"""A forced tool call cut off by max_tokens, at EVERY max_tokens from 1 to the whole call (and one past it), on
the default model, greedy: on every route of ``parallm serve`` (chat completions, Responses, Messages, through
the real ``openai`` / ``anthropic`` SDKs against a server in this process) and in every class (``ChatParaLLM``
in-process and ``base_url=``, ``ParaLLMLlamaIndex``), the streamed answer equals the non-streamed one, and a cut
call never looks like a complete call with empty or made-up arguments:

* chat completions: ``finish_reason: "length"`` and the partial arguments text;
* Responses: the ``function_call`` item ``status: "incomplete"`` with the partial arguments text, the response
  ``incomplete`` (``max_output_tokens``);
* Messages: ``stop_reason: "max_tokens"``, the ``tool_use`` input the SDK's stream accumulator makes of the
  partial text (``jiter`` partial mode), the same non-streamed;
* ChatParaLLM: an ``invalid_tool_calls`` entry from invoke and from the added-up stream, never ``tool_calls``;
* LlamaIndex: no tool call at all (it has no invalid calls), streamed and not.

Each sweep runs its cuts concurrently (one batch; the prompt is read from the prefix cache).
"""

from __future__ import annotations

import asyncio
import json

import pytest
from langchain_core.tools import tool

from parallm_engine.serve.server import ServerThread
from parallm_integrations import ChatParaLLM
from parallm_integrations._lc_results import cut_call_args

KEY = "cut-key"
QUESTION = "Weather in Paris?"
DESCRIPTION = "Weather in a city."
# Two arguments: a cut after the first leaves a partial object that parses (partially) to something.
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
          "required": ["city", "days"]}
NAME = "get_weather"
WHOLE_KEYS = {"city", "days"}  # each route's whole call (greedy) is read from its own full answer


@tool
def get_weather(city: str, days: int) -> str:
    """Weather in a city."""
    return f"Sunny in {city}."


@pytest.fixture(scope="module")
def server(engine):
    with ServerThread(engine=engine, api_key=KEY) as srv:
        yield srv


def _cuts(full: int) -> range:
    """Every max_tokens from 1 to the whole call, and one past it."""
    return range(1, full + 2)


def _whole(args_text: str) -> bool:
    try:
        return isinstance(json.loads(args_text), dict)
    except ValueError:
        return False


def _check_partial_call(name: str, args_text: str, m: int, full_args_text: str) -> None:
    """A call as the model wrote it so far: a prefix of the whole call's name and arguments text."""
    assert NAME.startswith(name) and full_args_text.startswith(args_text), (m, name, args_text)


def _run(coro_fn, cuts: range) -> list:
    async def all_cuts():
        return await asyncio.gather(*(coro_fn(m) for m in cuts))

    return asyncio.run(all_cuts())


def _sweep(client_fn, first, one) -> tuple:
    """On one event loop (an SDK client's connections belong to the loop that made them): ``client =
    client_fn()``, the whole call ``full = await first(client)``, then ``await one(client, m)`` for every cut
    (:func:`_cuts` of ``full``'s output tokens, all at once). Returns (full, cuts, results)."""
    async def main():
        client = client_fn()
        full = await first(client)
        usage = full.usage
        cuts = _cuts(getattr(usage, "completion_tokens", None) or usage.output_tokens)
        return full, cuts, await asyncio.gather(*(one(client, m) for m in cuts))

    return asyncio.run(main())


# -- chat completions ---------------------------------------------------------------------------------


def test_chat_completions_stream_equals_body_at_every_cut(server):
    import openai

    tools = [{"type": "function", "function": {"name": NAME, "description": DESCRIPTION, "parameters": PARAMS}}]
    kw = dict(model="default", messages=[{"role": "user", "content": QUESTION}], tools=tools,
              tool_choice={"type": "function", "function": {"name": NAME}}, temperature=0)

    async def one(client, m: int):
        whole = (await client.chat.completions.create(**kw, max_tokens=m)).choices[0]
        content, calls, finish = "", {}, None
        async for chunk in await client.chat.completions.create(**kw, max_tokens=m, stream=True):
            for ch in chunk.choices:
                content += ch.delta.content or ""
                for tc in ch.delta.tool_calls or []:
                    name, args = calls.get(tc.index, ("", ""))
                    calls[tc.index] = (name + (tc.function.name or ""), args + (tc.function.arguments or ""))
                finish = ch.finish_reason or finish
        body = (whole.message.content or "", [(t.function.name, t.function.arguments)
                                              for t in whole.message.tool_calls or []], whole.finish_reason)
        return body, (content, [calls[i] for i in sorted(calls)], finish)

    full, cuts, results = _sweep(
        lambda: openai.AsyncOpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=300),
        lambda client: client.chat.completions.create(**kw, max_tokens=64), one)
    assert full.choices[0].finish_reason == "tool_calls"
    full_args = full.choices[0].message.tool_calls[0].function.arguments
    whole = json.loads(full_args)
    assert set(whole) == WHOLE_KEYS
    for m, (body, streamed) in zip(cuts, results):
        assert body == streamed, (m, body, streamed)
        content, calls, finish = body
        assert content == "" and len(calls) <= 1, (m, body)
        if m < cuts[-2]:
            assert finish == "length", (m, body)
        for name, args in calls:
            _check_partial_call(name, args, m, full_args)
            if finish != "length":  # a call the response presents as whole is whole
                assert name == NAME and json.loads(args) == whole, (m, body)
    assert body[2] == "tool_calls"


# -- Responses ----------------------------------------------------------------------------------------


def _response_view(resp) -> dict:
    """What a client reads of a response (no ids: each request has its own)."""
    items = []
    for item in resp.output:
        if item.type == "function_call":
            items.append(("function_call", item.name, item.arguments, item.status))
        elif item.type == "message":
            items.append(("message", "".join(p.text for p in item.content), item.status))
        else:
            items.append((item.type,))
    details = resp.incomplete_details.reason if resp.incomplete_details else None
    return {"status": resp.status, "incomplete": details, "output": items}


def test_responses_stream_equals_body_at_every_cut(server):
    import openai

    kw = dict(model="default", input=QUESTION, temperature=0, store=False,
              tools=[{"type": "function", "name": NAME, "description": DESCRIPTION, "parameters": PARAMS}],
              tool_choice={"type": "function", "name": NAME})

    async def one(client, m: int):
        whole = await client.responses.create(**kw, max_output_tokens=m)
        final, args_deltas, done_items = None, {}, {}
        async for ev in await client.responses.create(**kw, max_output_tokens=m, stream=True):
            if ev.type == "response.function_call_arguments.delta":
                args_deltas[ev.output_index] = args_deltas.get(ev.output_index, "") + ev.delta
            elif ev.type == "response.output_item.done":
                done_items[ev.output_index] = ev.item
            elif ev.type in ("response.completed", "response.incomplete"):
                final = ev.response
        for i, item in done_items.items():  # each item as its deltas built it
            assert item == final.output[i]
            if item.type == "function_call":
                assert item.arguments == args_deltas.get(i, ""), (m, item, args_deltas)
        return _response_view(whole), _response_view(final)

    full, cuts, results = _sweep(
        lambda: openai.AsyncOpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=300),
        lambda client: client.responses.create(**kw, max_output_tokens=64), one)
    assert full.status == "completed" and full.output[-1].type == "function_call"
    full_args = full.output[-1].arguments
    whole = json.loads(full_args)
    assert set(whole) == WHOLE_KEYS
    views = list(zip(cuts, results))
    for m, (body, streamed) in views:
        assert body == streamed, (m, body, streamed)
        if m < cuts[-2]:
            assert body["status"] == "incomplete" and body["incomplete"] == "max_output_tokens", (m, body)
        for item in body["output"]:
            if item[0] != "function_call":
                continue
            _, name, args, status = item
            _check_partial_call(name, args, m, full_args)
            if _whole(args) and name == NAME:
                assert status == "completed" and json.loads(args) == whole, (m, body)
            else:  # cut off: flagged, with the partial text as generated
                assert status == "incomplete" and body["status"] == "incomplete", (m, body)
    assert body["status"] == "completed"
    # Cuts inside the name and inside the arguments keep them as generated (never "{}").
    calls = [body["output"][-1] for _, (body, _) in views if body["output"][-1][0] == "function_call"]
    assert any(c[3] == "incomplete" and c[1] != NAME and NAME.startswith(c[1]) and c[1] for c in calls), calls
    assert any(c[3] == "incomplete" and c[2].startswith('{"city') for c in calls), calls


# -- Anthropic Messages -------------------------------------------------------------------------------


def _message_view(msg) -> dict:
    blocks = []
    for b in msg.content:
        if b.type == "tool_use":
            blocks.append(("tool_use", b.name, b.input))
        elif b.type == "text":
            blocks.append(("text", b.text))
        else:
            blocks.append((b.type,))
    return {"stop_reason": msg.stop_reason, "content": blocks}


def test_messages_stream_equals_body_at_every_cut(server):
    anthropic = pytest.importorskip("anthropic")
    from jiter import from_json  # the parser the SDK's stream accumulator uses (a dependency of the SDK)
    kw = dict(model="default", messages=[{"role": "user", "content": QUESTION}], extra_body={"temperature": 0},
              tools=[{"name": NAME, "description": DESCRIPTION, "input_schema": PARAMS}],
              tool_choice={"type": "tool", "name": NAME})

    async def one(client, m: int):
        whole = await client.messages.create(**kw, max_tokens=m)
        partial_json = ""
        async with client.messages.stream(**kw, max_tokens=m) as stream:
            async for ev in stream:
                if ev.type == "content_block_delta" and ev.delta.type == "input_json_delta":
                    partial_json += ev.delta.partial_json
            final = await stream.get_final_message()
        return _message_view(whole), _message_view(final), partial_json

    full, cuts, results = _sweep(
        lambda: anthropic.AsyncAnthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=300),
        lambda client: client.messages.create(**kw, max_tokens=64), one)
    assert full.stop_reason == "tool_use" and set(full.content[-1].input) == WHOLE_KEYS
    whole, full_args = full.content[-1].input, results[-1][2]  # the whole call's input, its streamed text
    assert json.loads(full_args) == whole
    for m, (body, streamed, partial_json) in zip(cuts, results):
        assert body == streamed, (m, body, streamed)
        if m < cuts[-2]:
            assert body["stop_reason"] == "max_tokens", (m, body)
        uses = [b for b in body["content"] if b[0] == "tool_use"]
        assert len(uses) <= 1, (m, body)
        for _, name, tool_input in uses:
            _check_partial_call(name, partial_json, m, full_args)
            # the input is what the SDK's accumulator makes of the partial text, streamed or not
            assert tool_input == (from_json(partial_json.encode(), partial_mode=True) if partial_json else {})
            if body["stop_reason"] == "tool_use":
                assert name == NAME and tool_input == whole, (m, body)
    assert body["stop_reason"] == "tool_use"
    # a cut between the arguments: the input has the whole ones so far, streamed and not
    assert any(b["stop_reason"] == "max_tokens" and ("tool_use", NAME, {"city": whole["city"]}) in b["content"]
               for b, _, _ in results)


# -- ChatParaLLM --------------------------------------------------------------------------------------


def _lc_view(msg) -> dict:
    """An AIMessage as a caller reads it (no call ids: each request has its own; an invalid call's ``error``
    is ``invoke``'s: LangChain's adding-up of chunks leaves it None)."""
    return {"content": msg.content, "finish": msg.response_metadata.get("finish_reason"),
            "tool_calls": [(c["name"], c["args"]) for c in msg.tool_calls],
            "invalid": [(c["name"], c["args"]) for c in msg.invalid_tool_calls]}


def _lc_sweep(llm: ChatParaLLM) -> list[tuple]:
    """Every cut: (max_tokens, the view of invoke's message, the added-up stream, invoke's message)."""
    full = llm.bind_tools([get_weather], tool_choice=NAME).invoke(QUESTION)
    ((name, whole),) = [(c["name"], c["args"]) for c in full.tool_calls]
    assert name == NAME and set(whole) == WHOLE_KEYS and full.invalid_tool_calls == []
    full_args = json.dumps(whole)  # the model writes it as json.dumps does (checked on the last cut below)
    cuts = _cuts(full.usage_metadata["output_tokens"])

    async def one(m: int):
        bound = llm.bind_tools([get_weather], tool_choice=NAME, max_tokens=m)
        msg = await bound.ainvoke(QUESTION)
        chunks = [c async for c in bound.astream(QUESTION)]
        added = chunks[0]
        for c in chunks[1:]:
            added = added + c
        return msg, added

    out = []
    for m, (msg, added) in zip(cuts, _run(one, cuts)):
        inv, st = _lc_view(msg), _lc_view(added)
        assert inv == st, (m, inv, st)
        if m < cuts[-2]:
            assert inv["finish"] == "length", (m, inv)
        for name, args in inv["tool_calls"]:  # a valid call is the whole call, never a cut one
            assert (name, args) == (NAME, whole), (m, inv)
        for c in msg.invalid_tool_calls:  # a cut call: invalid, the text as generated then what ends it
            assert "max_tokens" in c["error"] and inv["finish"] == "length", (m, c)
            assert NAME.startswith(c["name"] or ""), (m, c)
            assert any(cut_call_args(c["args"][:-k]) == c["args"] and full_args.startswith(c["args"][:-k])
                       for k in (1, 2, 3)), (m, c)
        assert len(inv["tool_calls"]) + len(inv["invalid"]) <= 1, (m, inv)
        out.append((m, inv, added, msg))
    assert out[-1][1]["finish"] == "tool_calls" and out[-1][1]["tool_calls"] == [(NAME, whole)]
    assert [c["args"] for c in out[-1][2].tool_call_chunks] == [full_args]
    return out


def test_cut_call_args_never_add_up_to_a_valid_call():
    """Every prefix of argument text (strings with escapes, arrays, nesting, numbers), ended by
    ``cut_call_args``, is an invalid call once LangChain adds the chunks up, and it starts with the prefix."""
    from langchain_core.messages import AIMessageChunk
    from langchain_core.messages.tool import tool_call_chunk

    doc = '{"q": "a \\"b\\" \\\\ c\\u00e9", "l": [1, [2, {"x": -3.5e2}], "]}"], "t": true, "n": null}'
    assert isinstance(json.loads(doc), dict)
    for i in range(len(doc)):
        raw = doc[:i]
        ended = cut_call_args(raw)
        assert ended.startswith(raw)
        pieces = [raw[: i // 2], raw[i // 2:], ended[len(raw):]]  # as a stream sends it: the end comes last
        first = tool_call_chunk(name=NAME, args=pieces[0], id="c", index=0)
        added = AIMessageChunk(content="", tool_call_chunks=[first])
        for piece in pieces[1:]:
            added = added + AIMessageChunk(content="", tool_call_chunks=[tool_call_chunk(args=piece, index=0)])
        assert added.tool_calls == [] and [c["args"] for c in added.invalid_tool_calls] == [ended], (raw, ended)


@pytest.fixture(scope="module")
def in_process_sweep(engine):
    return _lc_sweep(ChatParaLLM(temperature=0, max_tokens=64))


def test_chat_parallm_stream_equals_invoke_at_every_cut_in_process(in_process_sweep):
    views = in_process_sweep
    # Cut inside the name and inside the arguments: invalid calls, never a valid-looking empty call.
    names = {inv["invalid"][0][0] for _, inv, _, _ in views if inv["invalid"]}
    assert None in names and any(n and n != NAME and NAME.startswith(n) for n in names), names
    assert any(inv["invalid"] and inv["invalid"][0][1].startswith('{"city"') for _, inv, _, _ in views)


def test_chat_parallm_stream_equals_invoke_at_every_cut_through_the_server(server, in_process_sweep):
    remote = _lc_sweep(ChatParaLLM(base_url=server.base_url, api_key=KEY, temperature=0, max_tokens=64,
                                   max_retries=0))
    assert len(remote) == len(in_process_sweep)
    for (m, inv, _, _), (_, local_inv, _, _) in zip(remote, in_process_sweep):
        assert inv == local_inv, (m, inv, local_inv)


# -- ParaLLMLlamaIndex --------------------------------------------------------------------------------


def _li_view(llm, resp) -> dict:
    from llama_index.core.base.llms.types import ToolCallBlock

    return {"content": resp.message.content, "finish": resp.raw.get("finish_reason"),
            "blocks": [(b.tool_name, b.tool_kwargs) for b in resp.message.blocks if isinstance(b, ToolCallBlock)],
            "kwargs_calls": [(c["function"]["name"], c["function"]["arguments"])
                             for c in resp.message.additional_kwargs.get("tool_calls") or []],
            "selections": [(s.tool_name, s.tool_kwargs)
                           for s in llm.get_tool_calls_from_response(resp, error_on_no_tool_call=False)]}


@pytest.mark.parametrize("where", ["in_process", "parallm_serve"])
def test_llama_index_stream_equals_chat_at_every_cut(where, request):
    from llama_index.core.tools import FunctionTool

    from parallm_integrations.llama_index import ParaLLMLlamaIndex

    def weather(city: str, days: int) -> str:
        """Weather in a city."""
        return f"Sunny in {city}."

    tools = [FunctionTool.from_defaults(weather, name=NAME)]
    kw = dict(temperature=0, max_tokens=64)
    if where == "parallm_serve":
        llm = ParaLLMLlamaIndex(base_url=request.getfixturevalue("server").base_url, api_key=KEY, **kw)
    else:
        request.getfixturevalue("engine")
        llm = ParaLLMLlamaIndex(**kw)
    full = llm.chat_with_tools(tools, user_msg=QUESTION, tool_choice=NAME)
    ((name, whole),) = _li_view(llm, full)["selections"]
    assert name == NAME and set(whole) == WHOLE_KEYS
    cuts = _cuts(full.raw["usage"]["completion_tokens"])

    async def one(m: int):
        resp = await llm.achat_with_tools(tools, user_msg=QUESTION, tool_choice=NAME, max_tokens=m)
        gen = await llm.astream_chat_with_tools(tools, user_msg=QUESTION, tool_choice=NAME, max_tokens=m)
        chunks = [c async for c in gen]
        return resp, chunks[-1]

    for m, (resp, last) in zip(cuts, _run(one, cuts)):
        body, streamed = _li_view(llm, resp), _li_view(llm, last)
        assert body == streamed, (m, body, streamed)
        if m < cuts[-2]:
            assert body["finish"] == "length", (m, body)
        # LlamaIndex has no invalid calls: a call is presented only when whole
        for name, args in body["selections"] + body["blocks"]:
            assert (name, args) == (NAME, whole), (m, body)
        if body["finish"] == "length" and not body["selections"]:
            with pytest.raises(ValueError, match="max_tokens"):
                llm.get_tool_calls_from_response(resp)
    assert body["finish"] == "tool_calls" and body["selections"] == [(NAME, whole)]
