"""The Anthropic Messages and OpenAI Responses routes of ``parallm serve`` under load and attack: 16
Anthropic streams, 16 Responses streams and chat-completions streams at once are batched together;
a key over its share gets 429 on the new routes too (in each API's error shape) while another key is
served; schemathesis fuzzing of the new routes finds no 5xx, and a lone surrogate anywhere in a
schema-valid body is a 400."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import pytest

from parallm_engine.serve.server import ServerThread, create_app

from .test_server import (  # noqa: F401  (fuzz_engine is a fixture)
    KEY, _bound_generation, _string_paths, _with_surrogate, assert_error_body, fuzz_engine, wait_idle)
from .test_server_hostile import AUTH_A, AUTH_B, KEY_A, KEY_B, engine_held, tiny64, two_keys, wait_for  # noqa: F401

anthropic = pytest.importorskip("anthropic")

NEW_PATHS = {"/v1/messages", "/v1/messages/count_tokens", "/v1/responses", "/v1/responses/{response_id}"}
HI = [{"role": "user", "content": "hi"}]


def _peak_running(metrics_text: str) -> float:
    match = re.search(r"^parallm_batch_size_peak(?:\{[^}]*\})? ([0-9.e+]+)$", metrics_text, re.M)
    assert match, "no batch_size_peak gauge on /metrics"
    return float(match.group(1))


@pytest.fixture(scope="module")
def tiny_wide(tiny_model_dir):
    """The tiny random model with room for 64 rows in one batch."""
    from parallm_engine import get_engine

    return get_engine(str(tiny_model_dir), max_batch_size=64)


async def test_anthropic_responses_and_chat_streams_batch_together(tiny_wide):
    """16 Anthropic streams + 16 Responses streams + 8 chat-completions streams, all queued while the
    engine is held, then run as one batch: every stream completes and the peak batch is over 16."""
    from openai import AsyncOpenAI

    with ServerThread(engine=tiny_wide, api_key=KEY) as srv:
        claude = anthropic.AsyncAnthropic(base_url=srv.url, api_key=KEY, max_retries=0, timeout=120)
        oai = AsyncOpenAI(base_url=srv.base_url, api_key=KEY, max_retries=0, timeout=120)

        async def messages_stream(i: int) -> str:
            async with claude.messages.stream(model=tiny_wide.model_name, max_tokens=6, messages=[
                    {"role": "user", "content": f"Story {i}:"}], extra_body={"temperature": 0}) as stream:
                kinds = [event.type async for event in stream]
                final = await stream.get_final_message()
            assert kinds[0] == "message_start" and kinds[-1] == "message_stop", kinds
            return final.stop_reason

        async def responses_stream(i: int) -> str:
            stream = await oai.responses.create(model=tiny_wide.model_name, input=f"Poem {i}:", max_output_tokens=6, temperature=0,
                                                stream=True)
            kinds = [event.type async for event in stream]
            assert kinds[0] == "response.created", kinds
            return kinds[-1]

        async def chat_stream(i: int) -> str:
            stream = await oai.chat.completions.create(model=tiny_wide.model_name, messages=[{"role": "user", "content": f"Q{i}"}],
                                                       max_tokens=6, temperature=0, stream=True)
            finishes = [c.choices[0].finish_reason async for c in stream if c.choices and c.choices[0].finish_reason]
            return finishes[-1]

        tiny_wide.reset_peaks()
        with engine_held(tiny_wide):
            tasks = [asyncio.ensure_future(f(i)) for f in (messages_stream, responses_stream) for i in range(16)]
            tasks += [asyncio.ensure_future(chat_stream(i)) for i in range(8)]
            await wait_for(lambda: tiny_wide.stats()["waiting"] >= 40, timeout=60)
        results = await asyncio.gather(*tasks)
        assert set(results[:16]) <= {"end_turn", "max_tokens"}
        assert set(results[16:32]) <= {"response.completed", "response.incomplete"}
        assert set(results[32:]) <= {"stop", "length"}
        peak = _peak_running(httpx.get(f"{srv.url}/metrics").text)
        assert peak > 16, peak
        counted = httpx.get(f"{srv.url}/metrics").text
        assert 'endpoint="/v1/messages"' in counted and 'endpoint="/v1/responses"' in counted
    wait_idle(tiny_wide)


async def test_key_share_429_on_the_new_routes(two_keys, tiny64):
    """Key A fills its share of the queue; its Anthropic and Responses requests get 429 (each in its
    API's shape, with Retry-After) while key B's are served."""
    limits = two_keys.app.state.parallm.shares
    async with httpx.AsyncClient(base_url=two_keys.base_url, timeout=120) as http:
        big = {"prompt": [f"Story {i}:" for i in range(256)], "max_tokens": 2, "temperature": 0}  # 512: all of A's share
        with engine_held(tiny64):
            a1 = asyncio.ensure_future(http.post("/completions", headers=AUTH_A, json=big))
            a2 = asyncio.ensure_future(http.post("/completions", headers=AUTH_A, json=big))
            await wait_for(lambda: tiny64.stats()["waiting"] >= 512)
            assert limits.held(0) == limits.key_limit() == 512
            msg = {"max_tokens": 2, "messages": HI}
            over = await http.post("/messages", headers={"x-api-key": KEY_A}, json=msg)
            assert over.status_code == 429 and int(over.headers["Retry-After"]) >= 1
            assert over.json() == {"type": "error", "error": {"type": "rate_limit_error",
                                                              "message": over.json()["error"]["message"]}}
            over = await http.post("/responses", headers=AUTH_A, json={"input": "hi", "max_output_tokens": 2})
            assert assert_error_body(over, 429, code="key_share_exceeded")["type"] == "rate_limit_error"
            b1 = asyncio.ensure_future(http.post("/messages", headers={"x-api-key": KEY_B}, json=msg))
            b2 = asyncio.ensure_future(http.post("/responses", headers=AUTH_B, json={"input": "hi",
                                                                                    "max_output_tokens": 2}))
            await wait_for(lambda: limits.held(1) == 2)
        rb1, rb2, r1, r2 = await asyncio.gather(b1, b2, a1, a2)
        assert rb1.status_code == 200 and rb1.json()["type"] == "message", rb1.text
        assert rb2.status_code == 200 and rb2.json()["object"] == "response", rb2.text
        assert r1.status_code == r2.status_code == 200
        assert limits.held(0) == 0 and limits.held(1) == 0
    wait_idle(tiny64)


def _cap_generation(body) -> None:
    _bound_generation(body)
    if isinstance(body, dict) and type(body.get("max_output_tokens")) is int and 4 < body["max_output_tokens"]:
        body["max_output_tokens"] = 4
    if isinstance(body, dict) and type(body.get("max_tokens")) is int and 4 < body["max_tokens"]:
        body["max_tokens"] = 4


def _error_shape_ok(path: str, body) -> bool:
    if path.startswith("/v1/messages"):
        return body.get("type") == "error" and set(body["error"]) == {"type", "message"}
    return set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}


def test_fuzz_new_routes_finds_no_server_errors(fuzz_engine):  # noqa: F811
    """The new routes of the OpenAPI schema, schema-valid and invalid inputs, through the real server
    with a key: every answer below 500 and in its API's error shape; a schema-valid body with a lone
    surrogate in one of its strings answers 400. Bounded: 12 examples per POST, 5 per GET/DELETE, 8 s each."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode

    auth = {"Authorization": f"Bearer {KEY}"}
    per_operation = 8.0  # seconds of requests per (operation, mode); generating bodies adds to it
    with ServerThread(create_app(engine=fuzz_engine, api_key=KEY)) as srv, \
            httpx.Client(base_url=srv.url, headers=auth, timeout=60) as http:
        schema = schemathesis.openapi.from_url(f"{srv.url}/openapi.json", headers=auth)
        operations = [r.ok() for r in schema.get_all_operations()]
        operations = [op for op in operations if op.path in NEW_PATHS]
        assert {op.path for op in operations} == NEW_PATHS
        pairs = [(op, mode) for op in operations for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)]
        failures: list = []
        t0 = time.monotonic()
        cases = surrogates = 0
        for op, mode in pairs:
            deadline = time.monotonic() + per_operation

            @settings(max_examples=12 if op.method.upper() == "POST" else 5, deadline=None, database=None,
                      derandomize=True, suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(mode))
            def run(case):
                nonlocal cases, surrogates
                if time.monotonic() > deadline:
                    return
                cases += 1
                _cap_generation(case.body)
                resp = case.call(base_url=srv.url, headers=auth, timeout=60)
                if resp.status_code >= 500:
                    failures.append((op.method, op.path, case.body, resp.status_code, resp.text[:300]))
                if resp.status_code >= 400:
                    if not _error_shape_ok(op.path, resp.json()):
                        failures.append((op.method, op.path, case.body, resp.status_code, resp.text[:300]))
                strings = _string_paths(case.body) if op.method.upper() == "POST" else []
                if strings:
                    surrogates += 1
                    bad = _with_surrogate(case.body, strings[cases % len(strings)])
                    r = http.post(op.path, content=json.dumps(bad), headers={"Content-Type": "application/json"})
                    if r.status_code >= 500 or (mode is GenerationMode.POSITIVE and r.status_code != 400):
                        failures.append((op.method, op.path, bad, r.status_code, r.text[:300]))

            try:
                run()
            except Unsatisfiable:
                assert mode is GenerationMode.NEGATIVE
    assert not failures, failures[:3]
    assert cases >= len(pairs) and surrogates > 0
    print(f"fuzzed {len(operations)} operations with {cases} requests (+{surrogates} with a surrogate) "
          f"in {time.monotonic() - t0:.1f} s")
    wait_idle(fuzz_engine, 30.0)
