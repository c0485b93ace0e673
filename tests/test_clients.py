"""What real clients found (issue 39), on the default model: in-process, through ``base_url=`` against
``parallm serve`` (in this process, on loopback), against llama.cpp's wire shapes (``llamacpp_wire``), and
against a real llama.cpp ``llama-server`` where one is found (skipped otherwise, never built here).

1. a tool call cut off by max_tokens: stream == invoke at every max_tokens, no markup in content,
   finish_reason "length", the partial call as an invalid call with its partial arguments;
2. LlamaIndex streaming structured output (partial objects, a whole valid final object);
3. no stray content between parallel calls;
4. token counting over base_url (llama.cpp's /tokenize shape; an empty answer is a TokenizeError);
5. another server's context overflow is ContextLengthExceededError;
6. a forced tool_choice the server ignores: a warning, or an error where structured output needs the call;
7. response_metadata id / token_usage / system_fingerprint; 8. bounded default batch concurrency.
"""

from __future__ import annotations

import asyncio
import json
import warnings

import pytest
from langchain_core.exceptions import OutputParserException
from langchain_core.tools import tool
from pydantic import BaseModel, Field

from parallm_engine import ContextLengthExceededError, TokenizeError
from parallm_engine.serve.server import ServerThread
from parallm_integrations import ChatParaLLM

from .llamacpp_wire import LlamaCppWire

KEY = "clients-key"
WEATHER_Q = "What is the weather like in Paris?"


@tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return f"It is sunny in {city}."


@tool
def get_time(timezone: str) -> str:
    """Get the current time in a timezone."""
    return "12:00"


class Person(BaseModel):
    """A person."""

    name: str = Field(description="the person's first name")
    age: int = Field(description="age in years")


@pytest.fixture(scope="module")
def server(engine):
    with ServerThread(engine=engine, api_key=KEY) as srv:
        yield srv


@pytest.fixture(scope="module")
def llamacpp(engine):
    """A real llama.cpp llama-server on the default GGUF, only where one is found."""
    from parallm_bench import llamacpp as bench_llamacpp

    binary = bench_llamacpp.find_llama_server()
    gguf = bench_llamacpp.engine_gguf(engine)
    if binary is None or gguf is None:
        pytest.skip(bench_llamacpp.SKIP_HINT)
    import tempfile

    log = tempfile.NamedTemporaryFile(prefix="llama-server-", suffix=".log", delete=False).name
    with bench_llamacpp.llama_server(binary, gguf, slots=2, ctx_per_slot=1024, log_path=log) as proc:
        yield proc.url + "/v1"


def _message_view(msg) -> dict:
    """What a caller reads: content, finish reason, and each call's name and arguments (a dict for a valid
    call; the argument text so far for an invalid one)."""
    calls = [(c["name"], c["args"]) for c in msg.tool_calls] + \
            [(c["name"] or "", c["args"] or "") for c in msg.invalid_tool_calls]
    return {"content": msg.content, "finish": msg.response_metadata.get("finish_reason"), "calls": calls}


def _stream_view(chunks) -> dict:
    full = chunks[0]
    for c in chunks[1:]:
        full = full + c
    calls = []
    for c in full.tool_call_chunks:  # the raw pieces, joined by index
        try:
            args = json.loads(c["args"]) if c["args"] else None
        except ValueError:
            args = None
        calls.append((c["name"] or "", args if isinstance(args, dict) else (c["args"] or "")))
    return {"content": full.content, "finish": full.response_metadata.get("finish_reason"), "calls": calls}


def _full_call_length(llm) -> int:
    bound = llm.bind_tools([get_weather], tool_choice="any")
    msg = bound.invoke(WEATHER_Q)
    assert msg.tool_calls, msg
    return msg.usage_metadata["output_tokens"]


async def _invoke_and_stream(llm, max_tokens: int) -> tuple[dict, dict]:
    bound = llm.bind_tools([get_weather], tool_choice="any", max_tokens=max_tokens)

    async def stream():
        return [c async for c in bound.astream(WEATHER_Q)]

    msg, chunks = await asyncio.gather(bound.ainvoke(WEATHER_Q), stream())
    return _message_view(msg), _stream_view(chunks)


def _check_cut(max_tokens: int, full: int, inv: dict, st: dict) -> None:
    assert inv == st, (max_tokens, inv, st)
    assert "<tool_call" not in inv["content"] and "</tool_call>" not in inv["content"], (max_tokens, inv)
    if max_tokens < full:
        assert inv["finish"] == "length", (max_tokens, inv)


# -- 1 + 3: truncated and parallel tool calls -------------------------------------------------------


def test_tool_call_stream_equals_invoke_at_every_max_tokens_in_process(engine):
    """The property, greedy on the default model: at every max_tokens from 1 to the whole call, the
    streamed chunks add up to what invoke returns; a cut call is an invalid call with its partial text."""
    llm = ChatParaLLM(temperature=0, max_tokens=64)
    full = _full_call_length(llm)

    async def all_cuts():
        return await asyncio.gather(*(_invoke_and_stream(llm, m) for m in range(1, full + 1)))

    views = asyncio.run(all_cuts())
    for m, (inv, st) in zip(range(1, full + 1), views):
        _check_cut(m, full, inv, st)
    # Cuts inside the arguments keep the call with its partial argument text (an invalid call).
    inside = [m for m, (inv, _) in zip(range(1, full + 1), views)
              if inv["calls"] and isinstance(inv["calls"][0][1], str) and inv["calls"][0][1].startswith("{")]
    assert inside, views
    msg = ChatParaLLM(temperature=0, max_tokens=inside[-1]).bind_tools([get_weather], tool_choice="any").invoke(WEATHER_Q)
    assert not msg.tool_calls and msg.invalid_tool_calls and msg.content == ""
    assert "max_tokens" in msg.invalid_tool_calls[0]["error"]
    assert msg.invalid_tool_calls[0]["args"].startswith("{")  # its partial arguments
    assert views[-1][0]["finish"] == "tool_calls" and views[-1][0]["calls"][0][0] == "get_weather"


def test_tool_call_stream_equals_non_stream_at_every_max_tokens_on_parallm_serve(server, engine):
    """The same property on the wire: ``parallm serve``'s stream joined == its non-streamed body."""
    import openai

    client = openai.AsyncOpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city.",
                                               "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                              "required": ["city"]}}}]
    messages = [{"role": "user", "content": WEATHER_Q}]

    async def one(max_tokens: int):
        kw = dict(model="default", messages=messages, tools=tools, tool_choice="required", temperature=0,
                  max_tokens=max_tokens)
        whole = (await client.chat.completions.create(**kw)).choices[0]
        content, calls, finish = "", {}, None
        async for chunk in await client.chat.completions.create(**kw, stream=True):
            for ch in chunk.choices:
                content += ch.delta.content or ""
                for tc in ch.delta.tool_calls or []:
                    name, args = calls.get(tc.index, ("", ""))
                    calls[tc.index] = (tc.function.name or name, args + (tc.function.arguments or ""))
                finish = ch.finish_reason or finish
        body = (whole.message.content or "", [(t.function.name, t.function.arguments) for t in whole.message.tool_calls or []],
                whole.finish_reason)
        return body, (content, [calls[i] for i in sorted(calls)], finish)

    async def all_cuts(n):
        return await asyncio.gather(*(one(m) for m in range(1, n + 1)))

    full = _full_call_length(ChatParaLLM(temperature=0, max_tokens=64))
    for m, (body, streamed) in enumerate(asyncio.run(all_cuts(full)), start=1):
        assert body == streamed, (m, body, streamed)
        assert "<tool_call" not in body[0], (m, body)
        if m < full:
            assert body[2] == "length", (m, body)
    # ChatParaLLM through the server: the same message as in-process, stream == invoke.
    remote = ChatParaLLM(base_url=server.base_url, api_key=KEY, temperature=0, max_tokens=64, max_retries=0)
    local = ChatParaLLM(temperature=0, max_tokens=64)
    for m in (3, full // 2, full - 1):
        inv, st = asyncio.run(_invoke_and_stream(remote, m))
        _check_cut(m, full, inv, st)
        assert inv == asyncio.run(_invoke_and_stream(local, m))[0], m


@pytest.mark.parametrize("where", ["in_process", "parallm_serve"])
def test_parallel_calls_stream_no_stray_content(where, server, engine):
    kw = dict(temperature=0, max_tokens=96)
    llm = ChatParaLLM(**kw) if where == "in_process" else \
        ChatParaLLM(base_url=server.base_url, api_key=KEY, max_retries=0, **kw)
    bound = llm.bind_tools([get_weather, get_time], tool_choice="any", parallel_tool_calls=True)
    q = "What is the weather in Paris, and the time in Tokyo?"
    msg = bound.invoke(q)
    chunks = list(bound.stream(q))
    assert _stream_view(chunks) == _message_view(msg)
    assert "".join(c.content for c in chunks) == msg.content
    assert msg.tool_calls


# -- 6: structured output that needs the forced call ----------------------------------------------


def test_function_calling_structured_output_cut_off_raises_not_none(engine):
    llm = ChatParaLLM(temperature=0, max_tokens=6)
    with pytest.raises(OutputParserException, match="max_tokens"):
        llm.with_structured_output(Person, method="function_calling").invoke("Alice is 30.")
    out = llm.with_structured_output(Person, method="function_calling", include_raw=True).invoke("Alice is 30.")
    assert out["parsed"] is None and isinstance(out["parsing_error"], OutputParserException)
    ok = ChatParaLLM(temperature=0, max_tokens=64).with_structured_output(Person, method="function_calling")
    assert isinstance(ok.invoke("Alice is 30 years old."), Person)


def test_forced_tool_choice_ignored_by_the_server_warns_once_or_raises(engine):
    with LlamaCppWire(engine) as wire:
        llm = ChatParaLLM(base_url=wire.base_url, max_retries=0, max_tokens=16)
        bound = llm.bind_tools([get_weather], tool_choice="any")
        with pytest.warns(UserWarning, match="ignores tool_choice"):
            msg = bound.invoke(WEATHER_Q)
        assert msg.content == "It is sunny." and not msg.tool_calls
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            list(bound.stream(WEATHER_Q))  # said once per server
            llm.bind_tools([get_weather]).invoke(WEATHER_Q)  # auto: prose is a fine answer
        with pytest.raises(OutputParserException, match="ignored tool_choice"):
            llm.with_structured_output(Person, method="function_calling").invoke("Alice is 30.")


def test_forced_tool_choice_on_parallm_serve_gives_a_call_and_no_warning(server):
    llm = ChatParaLLM(base_url=server.base_url, api_key=KEY, temperature=0, max_tokens=64, max_retries=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        msg = llm.bind_tools([get_weather], tool_choice="any").invoke(WEATHER_Q)
    assert msg.tool_calls


# -- 2: LlamaIndex streaming structured output ----------------------------------------------------


def _check_structured_stream(objs: list) -> None:
    assert len(objs) >= 2, objs
    final = objs[-1]
    assert isinstance(final, Person) and final.name and isinstance(final.age, int)
    assert all(not isinstance(o, Person) for o in objs[:-1])  # partial objects (FlexibleModel) before it
    assert any(getattr(o, "name", None) for o in objs[:-1]), objs  # the fields fill in as they stream


@pytest.mark.parametrize("where", ["in_process", "parallm_serve"])
def test_llama_index_stream_structured_predict(where, server, engine):
    from llama_index.core.llms import ChatMessage
    from llama_index.core.prompts import PromptTemplate

    from parallm_integrations.llama_index import ParaLLMLlamaIndex

    kw = dict(temperature=0, max_tokens=64)
    llm = ParaLLMLlamaIndex(**kw) if where == "in_process" else \
        ParaLLMLlamaIndex(base_url=server.base_url, api_key=KEY, max_retries=0, **kw)
    prompt = PromptTemplate("Extract the person: {text}")
    _check_structured_stream(list(llm.stream_structured_predict(Person, prompt, text="Alice is 30 years old.")))

    async def astream():
        return [o async for o in await llm.astream_structured_predict(Person, prompt, text="Alice is 30 years old.")]

    _check_structured_stream(asyncio.run(astream()))
    sllm = llm.as_structured_llm(Person)
    responses = list(sllm.stream_chat([ChatMessage(role="user", content="Alice is 30 years old.")]))
    assert isinstance(responses[-1].raw, Person) and Person.model_validate_json(responses[-1].message.content)
    assert responses[0].raw is not None and not isinstance(responses[0].raw, Person)


def test_llama_index_stream_structured_predict_cut_off_raises(engine):
    from llama_index.core.prompts import PromptTemplate

    from parallm_integrations.llama_index import ParaLLMLlamaIndex

    llm = ParaLLMLlamaIndex(temperature=0, max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens"):
        list(llm.stream_structured_predict(Person, PromptTemplate("{text}"), text="Alice is 30."))


# -- 4 + 5: token counting and context overflow over base_url ------------------------------------


def test_token_counting_against_llama_cpp_shapes(engine):
    from langchain_core.messages import HumanMessage, SystemMessage

    from parallm_integrations.llama_index import ParaLLMLlamaIndex

    text = "The quick brown fox jumps over the lazy dog."
    messages = [SystemMessage("You are terse."), HumanMessage("Hello there!")]
    local = ChatParaLLM()
    with LlamaCppWire(engine) as wire:
        remote = ChatParaLLM(base_url=wire.base_url, max_retries=0)
        assert remote.get_num_tokens(text) == local.get_num_tokens(text) > 0
        counted = remote.get_num_tokens_from_messages(messages)
        assert counted > remote.get_num_tokens("You are terse. Hello there!")
        # llama.cpp's /apply-template renders the assistant's generation prompt too
        dicts = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there!"}]
        assert counted == len(engine.apply_chat_template(dicts, add_generation_prompt=True))
        assert counted > local.get_num_tokens_from_messages(messages)
        assert ParaLLMLlamaIndex(base_url=wire.base_url, max_retries=0).get_token_ids(text) == \
            list(engine.encode(text, add_special_tokens=False))
    with LlamaCppWire(engine, mode="no_tokens") as wire:
        remote = ChatParaLLM(base_url=wire.base_url, max_retries=0)
        with pytest.raises(TokenizeError):
            remote.get_num_tokens(text)
        with pytest.raises(TokenizeError):
            remote.get_num_tokens_from_messages(messages)
        assert remote.get_num_tokens("") == 0  # empty text is 0 tokens, honestly


def test_token_counting_on_parallm_serve_matches_in_process(server):
    remote = ChatParaLLM(base_url=server.base_url, api_key=KEY, max_retries=0)
    assert remote.get_num_tokens("Hello there, world.") == ChatParaLLM().get_num_tokens("Hello there, world.")


@pytest.mark.parametrize("mode", ["llama.cpp", "vllm_errors"])
def test_context_overflow_from_other_servers_is_context_length_exceeded(mode, engine):
    from parallm_integrations.llama_index import ParaLLMLlamaIndex
    from llama_index.core.llms import ChatMessage

    long_text = "word " * 2000
    with LlamaCppWire(engine, mode=mode) as wire:
        llm = ChatParaLLM(base_url=wire.base_url, max_retries=0, max_tokens=4)
        with pytest.raises(ContextLengthExceededError):
            llm.invoke(long_text)
        with pytest.raises(ContextLengthExceededError):
            list(llm.stream(long_text))
        with pytest.raises(ContextLengthExceededError):
            ParaLLMLlamaIndex(base_url=wire.base_url, max_retries=0).chat([ChatMessage(role="user", content=long_text)])


def test_context_overflow_in_process_and_on_parallm_serve(server, engine):
    long_text = "word " * (engine.context_window + 100)
    for llm in (ChatParaLLM(max_tokens=4), ChatParaLLM(base_url=server.base_url, api_key=KEY, max_retries=0, max_tokens=4)):
        with pytest.raises(ContextLengthExceededError):
            llm.invoke(long_text)


# -- 7: response metadata ---------------------------------------------------------------------------


def test_response_metadata_has_id_token_usage_and_fingerprint(server, engine):
    local = ChatParaLLM(temperature=0, max_tokens=4)
    msg = local.invoke("Hi")
    meta = msg.response_metadata
    assert meta["id"] and meta["token_usage"]["completion_tokens"] == msg.usage_metadata["output_tokens"]
    chunks = list(local.stream("Hi"))
    last = chunks[-1].response_metadata
    assert last["id"] and last["token_usage"]["total_tokens"] > 0
    from langchain_core.messages import HumanMessage

    result = local.generate([[HumanMessage("Hi")], [HumanMessage("Hello")]])
    assert result.llm_output["token_usage"]["completion_tokens"] == sum(
        g[0].message.usage_metadata["output_tokens"] for g in result.generations)

    remote = ChatParaLLM(base_url=server.base_url, api_key=KEY, temperature=0, max_tokens=4, max_retries=0)
    rmsg = remote.invoke("Hi")
    assert rmsg.response_metadata["id"].startswith("chatcmpl") and rmsg.response_metadata["token_usage"]
    rchunks = list(remote.stream("Hi"))
    assert rchunks[-1].response_metadata["id"].startswith("chatcmpl")
    with LlamaCppWire(engine) as wire:
        wmsg = ChatParaLLM(base_url=wire.base_url, max_retries=0).invoke("Hi")
        assert wmsg.response_metadata["id"] == "chatcmpl-llamacpp-7"  # the server's id, kept
        assert wmsg.response_metadata["system_fingerprint"] == "b6000-wire"
        wchunks = list(ChatParaLLM(base_url=wire.base_url, max_retries=0).stream("Hi"))
        assert wchunks[-1].response_metadata["id"] == "chatcmpl-llamacpp-7"
        assert wchunks[-1].response_metadata["system_fingerprint"] == "b6000-wire"


# -- 8: batch concurrency ---------------------------------------------------------------------------


def test_default_batch_concurrency_is_bounded(engine, server):
    from parallm_integrations.chat_models import DEFAULT_REMOTE_BATCH_CONCURRENCY, _fan_out_config

    llm = ChatParaLLM(temperature=0, max_tokens=2)
    limit = llm._default_batch_concurrency()
    assert limit == 2 * engine.config.max_batch_size
    assert _fan_out_config(None, 1000, limit) == {"max_concurrency": limit}
    assert _fan_out_config(None, 3, limit) == {"max_concurrency": 3}
    assert _fan_out_config({"max_concurrency": 5}, 1000, limit) == {"max_concurrency": 5}
    remote = ChatParaLLM(base_url=server.base_url, api_key=KEY, max_retries=0)
    assert remote._default_batch_concurrency() == DEFAULT_REMOTE_BATCH_CONCURRENCY
    assert len(llm.batch(["a", "b", "c"])) == 3


# -- a real llama.cpp server (only where one is found) ----------------------------------------------


def test_against_a_real_llama_server(llamacpp, engine):
    text = "The quick brown fox jumps over the lazy dog."
    remote = ChatParaLLM(base_url=llamacpp, max_retries=0, temperature=0, max_tokens=8)
    assert remote.get_num_tokens(text) == ChatParaLLM().get_num_tokens(text)
    assert remote.get_num_tokens_from_messages([("user", "Hello there!")]) > 0
    with pytest.raises(ContextLengthExceededError):
        remote.invoke("word " * 3000)
    bound = remote.bind_tools([get_weather], tool_choice="any")
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        msg = bound.invoke(WEATHER_Q)
    assert msg.tool_calls or msg.invalid_tool_calls or msg.content  # a call, or prose (with the warning)
    for m in (3, 6):
        inv, st = asyncio.run(_invoke_and_stream(remote, m))
        assert inv == st, (m, inv, st)
