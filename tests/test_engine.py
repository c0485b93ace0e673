"""Engine invariants on the real default model: batching does not change results, seeds are batch
invariant, cancellation frees KV, bad input gets typed errors, many threads and loops at once."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from parallm_engine import (
    ContextLengthExceededError,
    Engine,
    InvalidRequestError,
    ModelLoadError,
    QueueFullError,
    RequestCancelledError,
)

from .conftest import chat_ids

QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for staying healthy.",
    "Write a short poem about the sea.",
    "Why is the sky blue?",
    "Name three planets.",
    "What is 12 times 12?",
]


def _wait_idle(engine, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if engine.running_count == 0 and engine.stats()["running"] == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"engine still busy: {engine.stats()}")


def test_default_model_answers_sensibly(engine):
    r = engine.chat([{"role": "user", "content": "What is the capital of France?"}], max_tokens=20, temperature=0)
    assert "Paris" in r.text
    assert r.finish_reason == "stop"
    assert r.usage.prompt_tokens > 10 and 0 < r.usage.completion_tokens <= 20


def test_batched_greedy_equals_sequential(engine):
    prompts = [chat_ids(engine, q) for q in QUESTIONS]
    alone = [engine.generate([p], max_tokens=24, temperature=0)[0] for p in prompts]
    together = engine.generate(prompts, max_tokens=24, temperature=0)
    for a, b in zip(alone, together):
        assert a.token_ids == b.token_ids
        assert a.text == b.text


def test_requests_join_a_running_batch(engine):
    """Continuous batching: a request submitted while others decode joins between steps, and its output
    is still exactly its solo output."""
    p_long, p_late = chat_ids(engine, QUESTIONS[1]), chat_ids(engine, QUESTIONS[3])
    solo_late = engine.generate([p_late], max_tokens=16, temperature=0)[0]
    h_long = engine.submit(p_long, max_tokens=40, temperature=0, ignore_eos=True)
    it = iter(h_long)
    for _ in range(5):
        next(it)
    late = engine.generate([p_late], max_tokens=16, temperature=0)[0]
    rest = list(it)
    assert rest and rest[-1].finish_reason == "length"
    assert late.token_ids == solo_late.token_ids


def test_seeded_sample_is_batch_invariant(engine):
    p = chat_ids(engine, "Tell me a story about a dragon.")
    kw = dict(max_tokens=24, temperature=0.9, top_p=0.95, seed=1234)
    alone = engine.generate([p], **kw)[0]
    others = [chat_ids(engine, q) for q in QUESTIONS[:4]]
    mixed = engine.generate(others[:2] + [p] + others[2:], max_tokens=24, temperature=1.0)
    # Run again inside a batch with different neighbours (greedy and sampled, another seed).
    handles = [engine.submit(o, max_tokens=30, temperature=0.7, seed=7) for o in others]
    again = engine.generate([p], **kw)[0]
    for h in handles:
        list(h)
    assert mixed  # neighbours ran
    assert again.token_ids == alone.token_ids
    both = engine.generate([p, others[0], p], **kw)
    assert both[0].token_ids == alone.token_ids == both[2].token_ids


def test_cancel_one_stream_keeps_others_and_frees_kv(engine):
    prompts = [chat_ids(engine, q) for q in QUESTIONS[:3]]
    solo = engine.generate(prompts, max_tokens=24, temperature=0)
    handles = [engine.submit(p, max_tokens=24, temperature=0) for p in prompts]
    victim = iter(handles[1])
    got = [next(victim) for _ in range(3)]
    assert all(d.finish_reason is None for d in got)
    victim.close()  # closing the iterator aborts the request
    outs = []
    for i in (0, 2):
        text = "".join(d.text for d in handles[i])
        outs.append(text)
    assert outs[0] == solo[0].text and outs[1] == solo[2].text
    _wait_idle(engine)
    assert engine.stats()["kv_bytes"] == 0  # the batch holds no rows, so no KV
    assert handles[1].request.finished
    assert engine.run_on_engine_thread(lambda: len(engine._scheduler.running)) == 0


def test_abort_before_start_raises_cancelled(engine):
    h = engine.submit(chat_ids(engine, "Count to fifty."), max_tokens=200, temperature=0)
    h.abort()
    with pytest.raises(RequestCancelledError):
        list(h)
    _wait_idle(engine)


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -5}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"temperature": "hot"}, "temperature"),
        ({"max_tokens": 3.5}, "max_tokens"),
        ({"stop": [1, 2]}, "stop"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"top_logprobs": 50}, "top_logprobs"),
        ({"n": 0}, "n"),
        ({"frequency_penalty": 3.0}, "frequency_penalty"),
        ({"not_a_param": 1}, "not_a_param"),
    ],
)
def test_bad_sampling_values_raise_typed_errors(engine, kwargs, param):
    with pytest.raises(InvalidRequestError) as ei:
        engine.submit("hello", **kwargs)
    assert ei.value.param == param


def test_bad_prompts_and_context(engine):
    with pytest.raises(InvalidRequestError):
        engine.submit(12345)
    with pytest.raises(InvalidRequestError):
        engine.submit("")
    with pytest.raises(InvalidRequestError):
        engine.submit([1, 2, 10**9])
    with pytest.raises(ContextLengthExceededError):
        engine.submit([42] * (engine.context_window + 5), max_tokens=4)
    # The engine still serves after all of that.
    assert engine.generate(["The sky is"], max_tokens=4, temperature=0)[0].usage.completion_tokens == 4


def test_unknown_model_path():
    with pytest.raises(ModelLoadError):
        Engine("/nonexistent/model/dir")
    with pytest.raises(ModelLoadError):
        Engine("not-a-model-anywhere")


def test_queue_full_is_typed_and_recoverable(tiny_model_dir):
    eng = Engine(str(tiny_model_dir), max_queue=3)
    try:
        handles = [eng.submit("hello there", max_tokens=50, ignore_eos=True, temperature=0) for _ in range(3)]
        with pytest.raises(QueueFullError) as ei:
            eng.submit("one too many", max_tokens=5)
        assert ei.value.retry_after > 0
        for h in handles:
            assert list(h)[-1].finish_reason == "length"
        assert eng.generate(["after"], max_tokens=3, temperature=0)[0].usage.completion_tokens == 3
    finally:
        eng.shutdown()


def test_stop_strings_and_token_ids(engine):
    p = chat_ids(engine, "Give me three tips for staying healthy.")
    full = engine.generate([p], max_tokens=40, temperature=0)[0]
    assert "2." in full.text
    cut = engine.generate([p], max_tokens=40, temperature=0, stop=["2."])[0]
    assert cut.finish_reason == "stop" and cut.choices[0].stop_reason == "2."
    assert "2." not in cut.text and full.text.startswith(cut.text)
    # Streaming never leaks any part of the stop string.
    streamed = "".join(d.text for d in engine.stream(p, max_tokens=40, temperature=0, stop=["2."]))
    assert streamed == cut.text
    first_tok = full.token_ids[2]
    by_id = engine.generate([p], max_tokens=40, temperature=0, stop_token_ids=[first_tok])[0]
    assert by_id.finish_reason == "stop" and by_id.token_ids == full.token_ids[:2]


def test_max_tokens_length_and_ignore_eos(engine):
    r = engine.generate(["Hello"], max_tokens=7, temperature=0, ignore_eos=True)[0]
    assert r.finish_reason == "length" and len(r.token_ids) == 7 and r.usage.completion_tokens == 7


def test_logprobs_and_logit_bias(engine):
    p = chat_ids(engine, "What is the capital of France?")
    r = engine.generate([p], max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)[0]
    assert len(r.logprobs) == 5
    for lp, tid in zip(r.logprobs, r.token_ids):
        assert lp.token_id == tid and lp.logprob <= 0
        assert len(lp.top_logprobs) == 3 and lp.top_logprobs[0][0] == tid  # greedy picks the top one
    forced = engine.encode(" banana", add_special_tokens=False)[0]
    b = engine.generate([p], max_tokens=3, temperature=0, logit_bias={forced: 100})[0]
    assert b.token_ids == [forced] * 3


def test_penalties_change_output_and_n_choices(engine):
    p = chat_ids(engine, "Repeat the word cat ten times.")
    plain = engine.generate([p], max_tokens=20, temperature=0, ignore_eos=True)[0]
    pen = engine.generate([p], max_tokens=20, temperature=0, ignore_eos=True, frequency_penalty=2.0,
                          presence_penalty=1.0, repetition_penalty=1.3)[0]
    assert pen.token_ids != plain.token_ids
    r = engine.generate([p], max_tokens=8, temperature=1.0, n=3, seed=3)[0]
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in r.choices}) > 1  # seeds differ per choice
    assert r.usage.completion_tokens == sum(len(c.token_ids) for c in r.choices) + sum(
        1 for c in r.choices if isinstance(c.stop_reason, int))


def test_streaming_deltas_never_split_characters(engine):
    p = chat_ids(engine, "Write the word 'café' and a smiley emoji 😀 and the Chinese word 你好, three times.")
    deltas = list(engine.stream(p, max_tokens=60, temperature=0))
    assert deltas[-1].finish_reason in ("stop", "length") and deltas[-1].usage is not None
    assert all("\ufffd" not in d.text for d in deltas)
    final = engine.generate([p], max_tokens=60, temperature=0)[0]
    assert "".join(d.text for d in deltas) == final.text
    assert any(ord(ch) > 127 for ch in final.text)


def test_sixteen_threads_and_two_event_loops(engine):
    prompts = [chat_ids(engine, q) for q in QUESTIONS]
    expected = {tuple(p): r.token_ids for p, r in zip(prompts, engine.generate(prompts, max_tokens=12, temperature=0))}
    errors: list[BaseException] = []
    results: list[list[int]] = []
    lock = threading.Lock()
    engine.reset_peaks()

    def sync_worker(i):
        try:
            r = engine.generate([prompts[i % len(prompts)]], max_tokens=12, temperature=0)[0]
            with lock:
                results.append((i % len(prompts), r.token_ids))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def loop_worker(offset):
        async def main():
            outs = await asyncio.gather(
                *(engine.agenerate([prompts[(offset + j) % len(prompts)]], max_tokens=12, temperature=0) for j in range(4))
            )
            return [(offset + j) % len(prompts) for j in range(4)], [o[0].token_ids for o in outs]

        try:
            idx, toks = asyncio.run(main())
            with lock:
                results.extend(zip(idx, toks))
        except BaseException as exc:  # pragma: no cover
            errors.append(exc)

    threads = [threading.Thread(target=sync_worker, args=(i,)) for i in range(16)]
    threads += [threading.Thread(target=loop_worker, args=(k,)) for k in (0, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert len(results) == 16 + 8
    for i, toks in results:
        assert toks == expected[tuple(prompts[i])]
    assert engine.stats()["peak_in_flight"] >= 12


async def test_async_cancellation_aborts_request(engine):
    p = chat_ids(engine, "Write a long essay about the history of Rome.")

    async def consume():
        async for _ in engine.astream(p, max_tokens=200, temperature=0):
            pass

    task = asyncio.create_task(consume())
    await asyncio.sleep(1.0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(200):
        if engine.running_count == 0:
            break
        await asyncio.sleep(0.05)
    assert engine.running_count == 0
    assert engine.stats()["requests_aborted"] >= 1


def test_stats_report_throughput_and_latency(engine):
    engine.generate([chat_ids(engine, q) for q in QUESTIONS[:2]], max_tokens=8, temperature=0)
    s = engine.stats()
    for key in ("generated_tokens", "ttft_p50_s", "itl_p50_s", "mean_batch_occupancy", "peak_kv_bytes",
                "cache_hit_rate", "prefix_cache", "generation_tps_busy"):
        assert key in s
    assert s["generated_tokens"] > 0 and s["ttft_p50_s"] > 0 and s["peak_kv_bytes"] > 0


def test_bad_seed_is_typed_and_engine_survives_a_failing_request(engine, monkeypatch):
    with pytest.raises(InvalidRequestError):
        engine.submit("hi", seed=-1)
    with pytest.raises(InvalidRequestError):
        engine.submit("hi", seed=2**64 - 1, n=2)
    # A request that fails while the engine thread starts it fails alone.
    import parallm_engine.core.sequence as seq_mod

    def boom(*a, **k):
        raise RuntimeError("sampler exploded")

    monkeypatch.setattr(seq_mod, "SeqSampler", boom)
    h = engine.submit("hello", max_tokens=3)
    with pytest.raises(RuntimeError, match="sampler exploded"):
        list(h)
    monkeypatch.undo()
    assert engine.generate(["still serving"], max_tokens=3, temperature=0)[0].usage.completion_tokens == 3
    assert engine.is_alive


def test_completion_keeps_the_first_tokens_leading_space(engine):
    r = engine.generate(["The capital of France is"], max_tokens=4, temperature=0)[0]
    assert r.text == engine.decode(r.token_ids)
    assert r.text.startswith(" ")


def test_pure_mlx_path_gives_the_native_paths_greedy_tokens(engine):
    """The default model, greedy fp32: the engine's native CPU kernels and MLX's own ops (the path Metal
    and CUDA take) give the same tokens."""
    if engine.backend.name == "cpu-mlx":
        pytest.skip("the session engine already runs the pure-MLX path")
    mlx_only = Engine(None, backend="cpu-mlx")
    try:
        prompts = [chat_ids(engine, q) for q in QUESTIONS]
        want = [r.token_ids for r in engine.generate(prompts, max_tokens=24, temperature=0)]
        got = [r.token_ids for r in mlx_only.generate(prompts, max_tokens=24, temperature=0)]
        assert got == want
    finally:
        mlx_only.shutdown()


def test_step_time_breakdown_adds_up(engine):
    """stats()["step_ms"]: each step's wall time split into planning, prefill, decode host work and the
    wait for the device's tokens; the parts are measured, non-negative and the wait sits inside decode."""
    engine.generate(["Count to five:", "Name three colours:"], max_tokens=8, temperature=0)
    totals = engine.stats()["step_totals_s"]
    assert totals["steps"] > 0 and totals["decode"] > 0 and totals["plan"] > 0
    assert 0 < totals["launch"] <= totals["device_wait"] <= totals["decode"] + totals["prefill"]
    parts = engine.stats()["step_ms"]
    assert all(v >= 0 for v in parts.values()) and 0 <= parts["host_share"] <= 1
    assert parts["decode_host"] + parts["device_wait"] > 0


def test_step_trace_has_a_line_per_step_that_adds_up(engine, tmp_path, monkeypatch):
    """PARALLM_STEP_TRACE: one JSON line per engine step whose parts sum to stats()'s totals, so a slow
    step can be found and tied to what it did (prefill, joins, retirements, KV moved)."""
    import json
    from parallm_bench.step_trace import summary
    path = tmp_path / "steps.jsonl"
    monkeypatch.setenv("PARALLM_STEP_TRACE", str(path))
    traced = Engine(None, backend=engine.backend.name)
    try:
        before = traced.stats()["step_totals_s"]
        traced.generate([chat_ids(engine, q) for q in QUESTIONS[:3]], max_tokens=6, temperature=0, ignore_eos=True)
    finally:
        traced.shutdown()
    after = traced.stats()["step_totals_s"]  # after the engine stopped: it may run a step past the last token
    steps = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(steps) == after["steps"] - before["steps"] > 0
    assert sum(s["decode_ms"] for s in steps) == pytest.approx(1e3 * (after["decode"] - before["decode"]), rel=1e-3, abs=0.05)
    assert sum(s["joined"] for s in steps) == 3 and sum(s["finished"] for s in steps) == 3
    assert sum(s["prefill_tokens"] for s in steps) > 0 and max(s["rows"] for s in steps) == 3
    assert all(0 <= s["launch_ms"] <= s["wait_ms"] <= s["decode_ms"] + s["prefill_ms"] + 1e-3 for s in steps)
    assert summary(steps)[0].startswith(f"{len(steps)} steps")


def test_async_deliveries_reach_a_loop_once_per_step(tiny_engine):
    """The engine thread hands each event loop a step's deliveries in one call (core.request.batched_deliveries):
    8 streams on one loop wake it about once per step, not once per row and token, and every stream still gets
    its tokens, in order, equal to a plain generate."""
    calls = []

    class CountingLoop(asyncio.SelectorEventLoop):
        def call_soon_threadsafe(self, callback, *args, **kwargs):
            if threading.current_thread() is not threading.main_thread():
                calls.append(callback)
            return super().call_soon_threadsafe(callback, *args, **kwargs)

    prompts = [[300 + 7 * i + j for j in range(10)] for i in range(8)]
    expected = [r.token_ids for r in tiny_engine.generate(prompts, max_tokens=24, temperature=0, ignore_eos=True)]
    steps0 = tiny_engine.stats()["decode_steps"]

    async def main():
        loop = asyncio.get_running_loop()
        handles = [tiny_engine.submit(p, loop=loop, max_tokens=24, temperature=0, ignore_eos=True) for p in prompts]

        async def collect(h):
            ids = []
            async for d in h:
                ids.extend(d.token_ids)
            return ids

        return await asyncio.gather(*(collect(h) for h in handles))

    loop = CountingLoop()
    try:
        got = loop.run_until_complete(main())
    finally:
        loop.close()
    assert got == expected
    steps = tiny_engine.stats()["decode_steps"] - steps0
    assert 0 < steps < 40
    # one call per engine step that delivered anything (prefill steps included), never one per row
    assert len(calls) <= steps + 8, (len(calls), steps)
    assert len(calls) < 8 * 24 / 3
