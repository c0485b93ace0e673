"""Long prompts keep their streams alive: while a prompt prefills, every streaming route sends a keep-alive at
least every second (an SSE comment on OpenAI's routes, Anthropic's ``ping`` event on ``/v1/messages``), so
agents' and proxies' idle timeouts never drop the connection (llama.cpp does the same, PR #25241)."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import httpx
import pytest

from parallm_engine.serve.server import ServerThread
from parallm_engine.serve.server_kit import KEEPALIVE_S, SSE_KEEPALIVE, with_keepalive

WATCH_S = 5.5  # each client reads this long while the prompt prefills (over 5 s)
WORDS = ("alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa")


def test_with_keepalive_beats_while_events_wait_and_closes_them():
    closed = []

    async def slow_events():
        try:
            yield "a"
            await asyncio.sleep(0.35)
            yield "b"
            await asyncio.sleep(10)  # never reached: the client goes
            yield "c"
        finally:
            closed.append(True)

    async def run():
        got = []
        stream = with_keepalive(slow_events(), "beat", interval=0.05)
        async for event in stream:
            got.append(event)
            if got.count("beat") >= 2 and "b" in got and got[-1] == "beat":
                break  # two beats after "b" while "c" waits: the client goes
        await stream.aclose()
        return got

    got = asyncio.run(run())
    assert got[0] == "a" and "b" in got and set(got) == {"a", "b", "beat"}
    assert got[1:got.index("b")].count("beat") >= 2  # beats while "b" was 0.35 s away, every 0.05 s
    assert closed == [True]  # the events' generator was stopped and closed, not left running


def _long_text(n_words: int) -> str:
    rng = random.Random()
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


@pytest.fixture(scope="module")
def slow_prefill_engine(tiny_32k_model_dir):
    """The tiny 32k-context model prefilling one token per step: its prompts prefill for seconds."""
    from parallm_engine import Engine

    eng = Engine(str(tiny_32k_model_dir), kv_disk=0, prefill_chunk=1, prefill_budget=1)
    yield eng
    eng.shutdown()


def _filling_text(eng) -> str:
    """A user message as long as the context holds: one token per step, it prefills for over 15 s here."""
    sample = _long_text(1000)
    per_word = len(eng.apply_chat_template([{"role": "user", "content": sample}])) / 1000
    return _long_text(int((eng.context_window - 256) / per_word))


def test_every_streaming_route_keeps_a_long_prefill_alive(slow_prefill_engine):
    """The four streaming routes at once (the three chat routes' prompt is one, prefilled once for them all;
    the completion's is its text alone); each client reads for :data:`WATCH_S` seconds, its prompt still
    prefilling, then goes (which aborts its request)."""
    eng = slow_prefill_engine
    messages = [{"role": "user", "content": _filling_text(eng)}]
    routes = {
        "/v1/chat/completions": ({"messages": messages, "max_tokens": 1, "stream": True}, SSE_KEEPALIVE.strip()),
        "/v1/completions": ({"prompt": messages[0]["content"], "max_tokens": 1, "stream": True},
                            SSE_KEEPALIVE.strip()),
        "/v1/responses": ({"input": messages, "max_output_tokens": 1, "stream": True}, SSE_KEEPALIVE.strip()),
        "/v1/messages": ({"messages": messages, "max_tokens": 1, "stream": True}, "event: ping"),
    }
    ends = ("data: [DONE]", "event: message_stop", "event: response.completed")
    seen: dict[str, list[tuple[float, str]]] = {}
    errors: list[BaseException] = []

    def read(url: str, path: str, body: dict) -> None:
        try:
            t0 = time.monotonic()
            lines = []
            with httpx.stream("POST", url + path, json=body, timeout=120) as r:
                assert r.status_code == 200, r.read()
                opened = time.monotonic()
                lines.append((opened - t0, "(headers)"))  # the gaps count from here: the stream is open
                for line in r.iter_lines():
                    if line:
                        lines.append((time.monotonic() - t0, line))
                    if time.monotonic() - opened > WATCH_S:
                        break
            seen[path] = lines
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)

    with ServerThread(engine=eng) as srv:
        threads = [threading.Thread(target=read, args=(srv.url, path, body)) for path, (body, _) in routes.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    assert not errors, errors
    # The gaps count from when the last of the four streams opened: before that the server is still taking the
    # other three 32k-token requests in (parsing, rendering), which on a loaded 2-core CI machine held the
    # first beat of an open stream ~1.2 s once; the prefill that follows is what the beats are for.
    all_open = max(seen[path][0][0] for path in routes)
    for path, (_, beat) in routes.items():
        lines = seen[path]
        assert not any(line in ends for _, line in lines), (path, "the prompt had finished prefilling")
        beats = [t for t, line in lines if line == beat]
        times = [all_open] + [t for t, _ in lines if t > all_open]
        gaps = [b - a for a, b in zip(times, times[1:])]
        assert beats[-1] - lines[0][0] > 5.0 and max(gaps) < 1.0, (path, lines[0][0], beats, max(gaps), KEEPALIVE_S)
