"""``parallm serve``: the official ``openai`` client against the server running in this process on
loopback (uvicorn in a thread, a free port), on the shared default-model engine.

Covers chat / completions / streaming / models / tools / structured output, 64 concurrent streaming
clients (every response complete and equal to the greedy in-process result), 16 clients disconnecting
mid-stream (their engine requests are aborted, the others finish), 401 / 429 / 400 / 404 bodies, the
Prometheus page, and schemathesis fuzzing of the OpenAPI schema (no 5xx).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import time

import httpx
import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from parallm_engine.serve.server import ServerThread, create_app

from .conftest import chat_ids

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def server(engine):
    with ServerThread(engine=engine, api_key=KEY) as srv:
        yield srv


@pytest.fixture
def client(server):
    return OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=120)


def wait_idle(engine, timeout: float = 60.0) -> float:
    """Seconds until the engine has nothing in flight (fails after ``timeout``)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if engine.running_count == 0:
            return time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError(f"engine still busy after {timeout} s: {engine.stats()}")


def assert_error_body(resp: httpx.Response, status: int, code: str | None = None, param: str | None = None):
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    return err


# ----------------------------------------------------------------------------------------------
# Basic endpoints through the openai client
# ----------------------------------------------------------------------------------------------


def test_models_health_version(server, client, engine):
    models = client.models.list().data
    assert [m.id for m in models] == [engine.model_name]
    assert client.models.retrieve(engine.model_name).id == engine.model_name
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
    assert httpx.get(f"{server.url}/version").json()["version"]


def test_chat_matches_engine_and_reports_cache_hits(client, engine):
    ref = engine.chat(QUESTION, max_tokens=16, temperature=0)
    r = client.chat.completions.create(model=engine.model_name, messages=QUESTION, max_tokens=16, temperature=0)
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == ref.text
    assert "Paris" in choice.message.content
    assert choice.finish_reason == ref.finish_reason
    assert r.object == "chat.completion" and r.model == engine.model_name
    assert r.usage.prompt_tokens == ref.usage.prompt_tokens
    assert r.usage.completion_tokens == ref.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # The same prompt again: served from the radix cache, reported like OpenAI does.
    assert r.usage.prompt_tokens_details.cached_tokens > 0
    # The default model's other spellings are accepted too.
    r2 = client.chat.completions.create(model="default", messages=QUESTION, max_tokens=16, temperature=0)
    assert r2.choices[0].message.content == ref.text


def test_chat_stream_equals_non_stream(client, engine):
    full = client.chat.completions.create(model="default", messages=QUESTION, max_tokens=16, temperature=0)
    chunks = list(client.chat.completions.create(
        model="default", messages=QUESTION, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == full.usage.completion_tokens
    assert last.usage.prompt_tokens_details.cached_tokens >= 0
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_sampling_options(client):
    kw = dict(model="default", messages=QUESTION, max_tokens=8, temperature=0.9, seed=1234)
    a = client.chat.completions.create(n=2, logprobs=True, top_logprobs=2, **kw)
    b = client.chat.completions.create(n=2, **kw)
    assert [c.index for c in a.choices] == [0, 1]
    # A seed makes sampling reproducible, choice by choice.
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    for c in a.choices:
        lps = c.logprobs.content
        assert lps and "".join(t.token for t in lps) == c.message.content
        assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in lps)
    assert a.usage.completion_tokens == sum(len(c.logprobs.content) for c in a.choices) or a.usage.completion_tokens > 0
    # A negative seed is a valid 64-bit seed (the engine gets it reduced to its own range).
    assert client.chat.completions.create(model="default", messages=QUESTION, max_tokens=2, seed=-5).choices
    # Stop strings end the text before the first match.
    greedy = client.chat.completions.create(model="default", messages=QUESTION, max_tokens=16, temperature=0)
    text = greedy.choices[0].message.content
    stop = text[8:12]
    cut = client.chat.completions.create(model="default", messages=QUESTION, max_tokens=16, temperature=0, stop=[stop])
    assert cut.choices[0].message.content == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_completions_match_engine(client, engine):
    prompts = ["The capital of France is", "1, 2, 3, 4,"]
    refs = engine.generate(prompts, max_tokens=8, temperature=0)
    r = client.completions.create(model="default", prompt=prompts, max_tokens=8, temperature=0, n=2, logprobs=2)
    assert r.object == "text_completion"
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for c in r.choices:
        ref = refs[c.index // 2]
        assert c.text == ref.text and c.finish_reason == ref.finish_reason
        assert "".join(c.logprobs.tokens) == engine.decode(ref.token_ids)
        assert len(c.logprobs.token_logprobs) == len(c.logprobs.tokens) == len(c.logprobs.text_offset)
        assert all(len(t) <= 2 for t in c.logprobs.top_logprobs)
    assert r.usage.prompt_tokens == sum(ref.usage.prompt_tokens for ref in refs)
    assert r.usage.completion_tokens == 2 * sum(ref.usage.completion_tokens for ref in refs)
    # Token-id prompts and echo.
    ids = engine.encode(prompts[0])
    e = client.completions.create(model="default", prompt=ids, max_tokens=8, temperature=0, echo=True)
    assert e.choices[0].text == engine.decode(ids) + refs[0].text


def test_completions_stream(client, engine):
    prompts = ["The capital of France is", "Once upon a time"]
    full = client.completions.create(model="default", prompt=prompts, max_tokens=8, temperature=0)
    texts = {0: "", 1: ""}
    finish = {}
    usage = None
    for chunk in client.completions.create(model="default", prompt=prompts, max_tokens=8, temperature=0,
                                           stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert [texts[i] for i in (0, 1)] == [c.text for c in full.choices]
    assert finish == {0: full.choices[0].finish_reason, 1: full.choices[1].finish_reason}
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens


def test_tool_calls(client, engine):
    messages = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    kw = dict(model="default", messages=messages, tools=[WEATHER_TOOL], max_tokens=48, temperature=0)
    r = client.chat.completions.create(tool_choice="required", **kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert isinstance(args.get("city"), str) and args["city"]

    # The same call streamed: id and name first, then the argument text in pieces.
    names, ids, pieces, finishes = [], [], [], []
    for chunk in client.chat.completions.create(tool_choice="required", stream=True, **kw):
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                assert tc.index == 0
                if tc.id:
                    ids.append(tc.id)
                    names.append(tc.function.name)
                pieces.append(tc.function.arguments or "")
            if c.finish_reason:
                finishes.append(c.finish_reason)
    assert names == ["get_weather"] and len(ids) == 1
    assert json.loads("".join(pieces)) == args
    assert finishes == ["tool_calls"]

    # A named tool_choice, and a conversation that carries the call and its result back.
    named = client.chat.completions.create(tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           **kw)
    assert named.choices[0].message.tool_calls[0].function.name == "get_weather"
    follow = messages + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 C"},
    ]
    r3 = client.chat.completions.create(model="default", messages=follow, tools=[WEATHER_TOOL], max_tokens=16,
                                        temperature=0)
    assert r3.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # tool_choice="none": the tools are not offered, no calls come back.
    r4 = client.chat.completions.create(tool_choice="none", **{**kw, "max_tokens": 8})
    assert not r4.choices[0].message.tool_calls


def test_response_format(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
              "required": ["city"], "additionalProperties": False}
    r = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Name a city in France as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}},
        max_tokens=24, temperature=0,
    )
    assert r.choices[0].finish_reason == "stop"
    obj = json.loads(r.choices[0].message.content)
    assert set(obj) == {"city"} and isinstance(obj["city"], str)
    r2 = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Reply with a JSON object."}],
        response_format={"type": "json_object"}, max_tokens=24, temperature=0,
    )
    if r2.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r2.choices[0].message.content), dict)


# ----------------------------------------------------------------------------------------------
# Load: 64 concurrent streaming clients; 16 of them hanging up mid-way
# ----------------------------------------------------------------------------------------------

_TOPICS = ["the sea", "a cat", "the moon", "bread", "rain", "a tree", "music", "snow",
           "a river", "coffee", "the sun", "a book", "a bird", "mountains", "a city", "the wind"]
_ASKS = ["Write one sentence about {}.", "Describe {} in three words.", "Give a fun fact about {}.",
         "What colour is {}?"]


async def test_64_concurrent_streaming_clients(server, engine):
    questions = [a.format(t) for t in _TOPICS for a in _ASKS]
    assert len(questions) == 64
    max_tokens = 8
    refs = await engine.agenerate([chat_ids(engine, q) for q in questions], max_tokens=max_tokens, temperature=0)
    aclient = AsyncOpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=300)

    async def one(q: str):
        text, finish, usage, chunks = "", None, None, 0
        stream = await aclient.chat.completions.create(
            model="default", messages=[{"role": "user", "content": q}], max_tokens=max_tokens, temperature=0,
            stream=True, stream_options={"include_usage": True})
        async for chunk in stream:
            chunks += 1
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                text += c.delta.content or ""
                finish = c.finish_reason or finish
        return text, finish, usage, chunks

    engine.reset_peaks()
    t0 = time.monotonic()
    try:
        outs = await asyncio.wait_for(asyncio.gather(*(one(q) for q in questions)), timeout=400)
    finally:
        await aclient.close()
    wall = time.monotonic() - t0
    assert engine.stats()["peak_in_flight"] >= 32, "the clients were not batched together"
    for (text, finish, usage, chunks), ref in zip(outs, refs):
        assert text == ref.text  # complete and correct: the greedy in-process result
        assert finish == ref.finish_reason
        assert usage is not None and usage.completion_tokens == ref.usage.completion_tokens
        assert chunks >= 3
    print(f"64 streaming clients x {max_tokens} tokens: {wall:.1f} s")
    wait_idle(engine)


async def test_16_disconnecting_streams_are_aborted(server, engine):
    aclient = AsyncOpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=300)
    before = engine.stats()["requests_aborted"]
    started = asyncio.Event()
    n_started = 0

    async def quitter(i: int):
        nonlocal n_started
        stream = await aclient.chat.completions.create(
            model="default", messages=[{"role": "user", "content": f"Tell me a long story about {_TOPICS[i]}."}],
            max_tokens=400, temperature=0, stream=True)
        got = 0
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                got += 1
                if got == 2:
                    break
        n_started += 1
        if n_started == 16:
            started.set()
        await stream.close()  # hang up mid-way
        return got

    async def stayer(i: int):
        r = await aclient.chat.completions.create(
            model="default", messages=[{"role": "user", "content": _ASKS[1].format(_TOPICS[i])}],
            max_tokens=8, temperature=0, stream=True)
        text, finish = "", None
        async for chunk in r:
            for c in chunk.choices:
                text += c.delta.content or ""
                finish = c.finish_reason or finish
        return text, finish

    try:
        results = await asyncio.wait_for(
            asyncio.gather(*(quitter(i) for i in range(16)), *(stayer(i) for i in range(8))), timeout=300)
    finally:
        await aclient.close()
    assert all(got == 2 for got in results[:16])
    for text, finish in results[16:]:
        assert text and finish in ("stop", "length")
    # The 16 abandoned requests (400 tokens each) are aborted, not generated to the end.
    idle_after = await asyncio.to_thread(wait_idle, engine, 60.0)
    assert engine.stats()["requests_aborted"] - before >= 16
    assert engine.running_count == 0
    print(f"engine idle {idle_after:.2f} s after the last client finished")


def test_non_streaming_client_timeout_aborts(server, engine):
    before = engine.stats()["requests_aborted"]
    body = {"model": "default", "messages": [{"role": "user", "content": "Write a very long essay about the sea."}],
            "max_tokens": 500, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/chat/completions", json=body, headers=AUTH, timeout=1.5)
    wait_idle(engine, 30.0)
    assert engine.stats()["requests_aborted"] - before >= 1


# ----------------------------------------------------------------------------------------------
# Auth, backpressure, bad input
# ----------------------------------------------------------------------------------------------


def test_api_key_required(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        err = assert_error_body(httpx.get(f"{server.base_url}/models", headers=headers), 401, code="invalid_api_key")
        assert err["type"] == "invalid_request_error"
        r = httpx.post(f"{server.base_url}/chat/completions", json={"messages": QUESTION, "max_tokens": 2},
                       headers=headers)
        assert_error_body(r, 401)
    assert httpx.get(f"{server.base_url}/models", headers={"x-api-key": KEY}).status_code == 200
    assert httpx.get(f"{server.url}/health").status_code == 200  # open for load balancers
    with pytest.raises(openai.AuthenticationError):
        OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0).models.list()


def test_queue_full_answers_429(server, client, engine):
    old = engine.max_queue
    stream = client.chat.completions.create(model="default", messages=QUESTION, max_tokens=200, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
    try:
        next(iter(stream))  # the first request is in flight
        engine.max_queue = 1
        r = httpx.post(f"{server.base_url}/chat/completions", json={"messages": QUESTION, "max_tokens": 2},
                       headers=AUTH)
        err = assert_error_body(r, 429, code="queue_full")
        assert err["type"] == "rate_limit_error"
        assert int(r.headers["Retry-After"]) >= 1
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model="default", prompt=["a"], max_tokens=2)
    finally:
        engine.max_queue = old
        stream.close()
    wait_idle(engine)
    # Refused requests left nothing behind: the server takes requests again.
    assert client.chat.completions.create(model="default", messages=QUESTION, max_tokens=2).choices


def test_error_bodies(server, engine):
    url = server.base_url
    chat = f"{url}/chat/completions"
    ok_msgs = [{"role": "user", "content": "hi"}]

    def post(path, **kw):
        return httpx.post(path, headers={**AUTH, **kw.pop("headers", {})}, timeout=60, **kw)

    assert_error_body(post(chat, content=b'{"messages": [', headers={"Content-Type": "application/json"}), 400,
                      code="invalid_json")
    assert_error_body(post(chat, content=b"not json"), 400)
    assert_error_body(post(chat, json=[1, 2]), 400)
    assert_error_body(post(chat, json={"max_tokens": 2}), 400, param="messages")
    assert_error_body(post(chat, json={"messages": []}), 400, param="messages")
    assert_error_body(post(chat, json={"messages": ok_msgs, "temperature": "hot"}), 400, param="temperature")
    assert_error_body(post(chat, json={"messages": ok_msgs, "max_tokens": 0}), 400, param="max_tokens")
    assert_error_body(post(chat, json={"messages": ok_msgs, "n": 10_000}), 400, param="n")
    assert_error_body(post(chat, json={"messages": ok_msgs, "top_logprobs": 50, "logprobs": True}), 400,
                      param="top_logprobs")
    assert_error_body(post(chat, json={"messages": [{"role": "wizard", "content": "x"}]}), 400)
    assert_error_body(post(chat, json={"messages": ok_msgs, "tool_choice": "required"}), 400, param="tool_choice")
    assert_error_body(post(chat, json={"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}), 400, param="messages")
    assert_error_body(post(chat, json={"messages": ok_msgs, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}}), 400)
    assert_error_body(post(chat, json={"messages": ok_msgs, "tools": [WEATHER_TOOL], "tool_choice": {
        "type": "function", "function": {"name": "not_a_tool"}}}), 400)
    assert_error_body(post(chat, json={"messages": ok_msgs, "model": "gpt-9"}), 404, code="model_not_found",
                      param="model")
    long_text = "hello " * (engine.context_window + 10)
    assert_error_body(post(chat, json={"messages": [{"role": "user", "content": long_text}], "max_tokens": 2}), 400,
                      code="context_length_exceeded")
    comp = f"{url}/completions"
    assert_error_body(post(comp, json={"prompt": [1] * (engine.context_window + 1), "max_tokens": 2}), 400,
                      code="context_length_exceeded")
    assert_error_body(post(comp, json={"prompt": [], "max_tokens": 2}), 400, param="prompt")
    assert_error_body(post(comp, json={"prompt": [10 ** 9], "max_tokens": 2}), 400)
    assert_error_body(post(comp, json={"prompt": "x", "best_of": 3}), 400, param="best_of")
    assert_error_body(post(comp, json={"prompt": "x", "suffix": "y"}), 400, param="suffix")
    assert_error_body(httpx.get(chat, headers=AUTH), 405)
    assert_error_body(httpx.get(f"{url}/no/such/path", headers=AUTH), 404)
    # Nothing above hurt the server or the engine.
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
    assert post(chat, json={"messages": ok_msgs, "max_tokens": 2}).status_code == 200
    assert engine.running_count == 0


def test_request_body_limit(engine):
    big = {"messages": [{"role": "user", "content": "x" * 5000}], "max_tokens": 2}
    with ServerThread(create_app(engine=engine, max_body_bytes=2048)) as srv:
        url = f"{srv.base_url}/chat/completions"
        assert_error_body(httpx.post(url, json=big), 413, code="request_too_large")

        def chunks():  # no Content-Length: the limit is enforced while the body streams in
            data = json.dumps(big).encode()
            for i in range(0, len(data), 1000):
                yield data[i:i + 1000]

        assert_error_body(httpx.post(url, content=chunks(), headers={"Content-Type": "application/json"}), 413)
        assert httpx.post(url, json={"messages": QUESTION, "max_tokens": 2}).status_code == 200


def test_tokenize_detokenize(server, engine):
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello world", "add_special_tokens": False},
                   headers=AUTH)
    assert r.status_code == 200, r.text
    ids = r.json()["tokens"]
    assert ids == engine.encode("Hello world", add_special_tokens=False)
    assert r.json()["max_model_len"] == engine.context_window
    back = httpx.post(f"{server.url}/detokenize", json={"tokens": ids}, headers=AUTH).json()
    assert back["prompt"] == "Hello world"
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": QUESTION}, headers=AUTH).json()
    assert chat["tokens"] == list(engine.apply_chat_template(QUESTION))


_METRIC_LINE = re.compile(r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{([a-zA-Z_][a-zA-Z0-9_]*="([^"\\]|\\.)*",?)*\})? '
                          r'(-?[0-9.]+(e[-+]?[0-9]+)?|NaN|[+-]Inf)$')


def test_metrics(server, client):
    client.chat.completions.create(model="default", messages=QUESTION, max_tokens=4, temperature=0)
    r = httpx.get(f"{server.url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    values: dict[str, float] = {}
    for line in r.text.strip().splitlines():
        if line.startswith("#"):
            assert re.match(r"^# (HELP|TYPE) [a-zA-Z_:][a-zA-Z0-9_:]* .+$", line), line
            continue
        assert _METRIC_LINE.match(line), line
        name, value = line.rsplit(" ", 1)
        values[name] = float(value)

    def value(prefix: str) -> float:
        hits = [v for k, v in values.items() if k == prefix or k.startswith(prefix + "{")]
        assert hits, f"{prefix} missing"
        return sum(hits)

    for name in ("parallm_engine_requests_submitted_total", "parallm_generation_tokens_total",
                 "parallm_prompt_tokens_total", "parallm_cached_prompt_tokens_total", "parallm_batch_size",
                 "parallm_batch_occupancy_mean", "parallm_kv_cache_bytes", "parallm_prefix_cache_hit_rate",
                 "parallm_prefix_cache_bytes", "parallm_requests_in_flight"):
        value(name)
    assert value("parallm_up") == 1
    assert value("parallm_generation_tokens_total") > 0
    assert value("parallm_time_to_first_token_seconds_count") >= 1
    assert value("parallm_inter_token_latency_seconds_count") >= 1
    assert value("parallm_e2e_request_latency_seconds_count") >= 1
    assert 0 <= value("parallm_prefix_cache_hit_rate") <= 1
    ok = [v for k, v in values.items()
          if k.startswith("parallm_http_requests_total{") and 'endpoint="/v1/chat/completions"' in k
          and 'status="200"' in k]
    assert ok and ok[0] >= 1


# ----------------------------------------------------------------------------------------------
# Fuzzing the OpenAPI schema
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fuzz_engine(tiny_model_dir, tmp_path_factory):
    """A 2-layer random model with a 64-token context: every fuzzed request generates little."""
    import shutil

    from parallm_engine import get_engine

    out = tmp_path_factory.mktemp("tiny-ctx64")
    for f in tiny_model_dir.iterdir():
        shutil.copy(f, out / f.name)
    cfg = json.loads((out / "config.json").read_text())
    cfg["max_position_embeddings"] = 64
    (out / "config.json").write_text(json.dumps(cfg))
    return get_engine(str(out), max_batch_size=16)


def _bound_generation(body) -> None:
    """Keep each fuzzed request cheap (a few tokens, a few choices) without touching what the
    server must reject: values of the wrong type or out of range stay as generated."""
    if not isinstance(body, dict):
        return
    for key, cap in (("max_tokens", 4), ("max_completion_tokens", 4), ("n", 2), ("best_of", 2)):
        value = body.get(key)
        if key not in body and key == "max_tokens":
            body[key] = cap
        elif type(value) is int and cap < value <= 128:
            body[key] = cap
    if body.get("ignore_eos") is True:
        body["ignore_eos"] = False


def _string_paths(body, path=()) -> list[tuple]:
    """Where the strings are in a JSON body (dict keys and list indexes)."""
    if isinstance(body, str):
        return [path]
    if isinstance(body, dict):
        return [p for k, v in body.items() for p in _string_paths(v, path + (k,))]
    if isinstance(body, list):
        return [p for i, v in enumerate(body) for p in _string_paths(v, path + (i,))]
    return []


def _with_surrogate(body, path: tuple):
    """A copy of ``body`` whose string at ``path`` starts with a lone UTF-16 surrogate."""
    if not path:
        return "\ud800" + body
    body = json.loads(json.dumps(body))
    parent = body
    for step in path[:-1]:
        parent = parent[step]
    parent[path[-1]] = "\ud800" + parent[path[-1]]
    return body


def test_openapi_fuzz_finds_no_server_errors(fuzz_engine):
    """Every operation of the server's own OpenAPI schema, through the real server on loopback (with an
    API key), with schema-valid and invalid inputs, answers below 500; a schema-valid body with a lone
    UTF-16 surrogate put into one of its strings answers 400. Bounded: 40 positive and 40 negative
    examples per POST, 8 per GET, generation capped at a few tokens, and 45 s in all (an operation whose
    share of the time is spent stops early)."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode

    budget = 45.0
    with ServerThread(create_app(engine=fuzz_engine, api_key=KEY)) as srv, \
            httpx.Client(base_url=srv.url, headers=AUTH, timeout=60) as http:
        schema = schemathesis.openapi.from_url(f"{srv.url}/openapi.json", headers=AUTH)
        operations = [result.ok() for result in schema.get_all_operations()]
        # The Anthropic and Responses routes are fuzzed in test_server_apis_hostile.py (their own error shapes).
        operations = [op for op in operations if not op.path.startswith(("/v1/messages", "/v1/responses"))]
        assert {"/v1/chat/completions", "/v1/completions"} <= {op.path for op in operations}
        pairs = list(itertools.product(operations, (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)))
        failures: list = []
        t0 = time.monotonic()
        cases = surrogates = 0
        for i, (op, mode) in enumerate(pairs):
            examples = 40 if op.method.upper() == "POST" else 8
            deadline = t0 + budget * (i + 1) / len(pairs)

            @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(mode))
            def run(case):
                nonlocal cases, surrogates
                if time.monotonic() > deadline:
                    return
                cases += 1
                _bound_generation(case.body)
                resp = case.call(base_url=srv.url, headers=AUTH, timeout=60)
                if resp.status_code >= 500:
                    failures.append((op.method, op.path, case.body, resp.status_code, resp.text[:300]))
                if resp.status_code >= 400:
                    body = resp.json()
                    assert set(body["error"]) == {"message", "type", "param", "code"}, body
                strings = _string_paths(case.body) if op.method.upper() == "POST" else []
                if strings:  # hypothesis draws no surrogates: put one in, in a different string each time
                    surrogates += 1
                    bad = _with_surrogate(case.body, strings[cases % len(strings)])
                    r = http.post(op.path, content=json.dumps(bad), headers={"Content-Type": "application/json"})
                    if r.status_code >= 500 or (mode is GenerationMode.POSITIVE and r.status_code != 400):
                        failures.append((op.method, op.path, bad, r.status_code, r.text[:300]))

            try:
                run()
            except Unsatisfiable:  # negative mode on an operation that takes no input
                assert mode is GenerationMode.NEGATIVE
        wall = time.monotonic() - t0
    assert not failures, failures[:3]
    assert cases >= 3 * len(pairs) and surrogates > 0
    wait_idle(fuzz_engine, 30.0)
    print(f"fuzzed {len(operations)} operations with {cases} requests (+{surrogates} with a surrogate) "
          f"in {wall:.1f} s")
