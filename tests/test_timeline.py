"""The engine's lifecycle recorder (``Engine.timeline()``, core/timeline.py): its records match what happened
for a fan-out, an aborted request and preempted requests; each call's timings add up to its latency."""

from __future__ import annotations

import json
import time

import parallm_engine  # noqa: F401  (preloads BLAS before mlx)

from .model_zoo import prompt_ids


def _records(engine, ids, since=0.0) -> dict:
    engine.run_on_engine_thread(lambda: None)  # the step that delivered the last tokens has ended
    snap = engine.timeline(since)
    json.dumps(snap)  # JSON-able as it is
    return {r["id"]: r for r in snap["requests"] if r["id"] in ids}, snap


def test_a_fan_out_is_recorded_request_by_request_and_step_by_step(tiny_engine):
    vocab = tiny_engine.model_info.vocab_size
    shared = prompt_ids(40, vocab, seed=7)
    start = time.monotonic()
    handles = [tiny_engine.submit(shared + prompt_ids(4, vocab, seed=i), max_tokens=6, ignore_eos=True,
                                  temperature=0, session=f"agent-{i}") for i in range(8)]
    results = [tiny_engine._collect(h) for h in handles]
    records, snap = _records(tiny_engine, {h.id for h in handles}, since=start)
    assert len(records) == 8
    assert abs(snap["wall_offset"] - (time.time() - time.monotonic())) < 1.0
    for h, res in zip(handles, results):
        r = records[h.id]
        assert r["program"] == r["session"] == h.request.session
        assert start <= r["arrival"] <= r["admitted"] <= r["first_token"] <= r["finish"] <= snap["now"]
        assert r["finish_reason"] == "length" and not r["aborted"] and r["preemptions"] == []
        assert r["prompt_tokens"] == 44 and r["output_tokens"] == 6
        assert r["cached_tokens"] == res.usage.cached_tokens
        assert res.metrics["cached_tokens"] == res.usage.cached_tokens
        # The call's own timings are the record's phases, and add up to its latency.
        assert abs(res.metrics["queue_s"] - (r["admitted"] - r["arrival"])) < 1e-6
        assert abs(res.metrics["prefill_s"] - (r["first_token"] - r["admitted"])) < 1e-6
        assert abs(res.metrics["decode_s"] - (r["finish"] - r["first_token"])) < 1e-6
        total = res.metrics["queue_s"] + res.metrics["prefill_s"] + res.metrics["decode_s"]
        assert abs(total - res.metrics["latency"]) < 1e-6
    assert sum(r["cached_tokens"] for r in records.values()) > 0  # the shared prefix was computed once
    steps = [s for s in snap["steps"] if s["t0"] >= start]
    assert steps and all(s["t0"] <= s["t1"] for s in steps)
    assert all(a["t1"] <= b["t0"] + 1e-6 for a, b in zip(steps, steps[1:]))  # one step after another
    # Every prompt token was computed or cached; every sampled token came from a decode row.
    assert sum(s["prefill_tokens"] for s in steps) >= 8 * 43 - sum(r["cached_tokens"] for r in records.values())
    assert sum(s["decode_rows"] for s in steps) >= 8 * 6
    assert max(s["decode_rows"] for s in steps) > 1  # they decoded as one batch


def test_an_aborted_request_ends_as_aborted(tiny_engine):
    vocab = tiny_engine.model_info.vocab_size
    handle = tiny_engine.submit(prompt_ids(12, vocab, seed=3), max_tokens=400, ignore_eos=True, temperature=0)
    stream = iter(handle)
    next(stream)  # it has its first token
    live, _ = _records(tiny_engine, {handle.id})
    assert live[handle.id]["finish"] is None and live[handle.id]["output_tokens"] >= 1
    handle.abort()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        records, _ = _records(tiny_engine, {handle.id})
        if records[handle.id]["finish"] is not None:
            break
    r = records[handle.id]
    assert r["aborted"] and r["finish_reason"] == "abort"
    assert r["first_token"] <= r["finish"] and 1 <= r["output_tokens"] < 400
    assert r["program"] is None  # no session, no program


def test_preempted_requests_record_each_preemption(tiny_engine, tiny_model_dir):
    """A KV budget far too small for 24 concurrent requests (as tests/test_memory.py provokes preemption):
    the preemptions the records list are the engine's count, each inside its request's run."""
    from parallm_engine import Engine

    vocab = tiny_engine.model_info.vocab_size
    per_token = tiny_engine.model_info.kv_bytes_per_token()
    small = Engine(str(tiny_model_dir), kv_budget_bytes=per_token * 300, decode_lanes=1)
    try:
        handles = [small.submit(prompt_ids(8 + i % 5, vocab, seed=i), max_tokens=24, ignore_eos=True,
                                temperature=0) for i in range(24)]
        for h in handles:
            small._collect(h)
        records, snap = _records(small, {h.id for h in handles})
        preempted = [r for r in records.values() if r["preemptions"]]
        assert preempted
        assert sum(len(r["preemptions"]) for r in records.values()) == small.stats()["preemptions"]
        for r in preempted:
            assert all(r["admitted"] < t < r["finish"] for t in r["preemptions"])
            assert r["finish_reason"] == "length" and r["output_tokens"] == 24 and not r["aborted"]
        assert len(snap["steps"]) == small.stats()["steps"]
    finally:
        small.shutdown()
