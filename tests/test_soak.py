"""A two-minute soak (bench_soak.py, the same harness as `parallm bench --workloads soak --minutes N`): the
in-process engine behind the real HTTP app on loopback, a seeded mix of agent loops, fan-outs, streams, tools,
JSON schemas, n > 1, seeded and speculative requests, Anthropic Messages and Responses (streamed and not, with
tools), embeddings, a LoRA adapter served as its own model, disconnects, cancellations, bad inputs and bursts
past the queue, under a KV budget small enough to evict all the time. Asserts what must hold however slow the machine:
no 5xx, every status the one its kind expects, the probes' text unchanged, and a clean end (no request, page or
pin left once the load stops and the prefix cache is cleared)."""

from __future__ import annotations

import pytest

from collections import Counter

from parallm_bench.soak import SoakConfig, format_lines, run_soak
from parallm_bench.soak_traffic import MIX


@pytest.mark.timeout(900)
def test_two_minute_soak_on_every_route_ends_clean_with_probes_unchanged():
    # Two minutes in eight 15 s intervals; the long soak runs for an hour: `parallm bench --workloads soak`
    # (docs/benchmarks.md).
    result = run_soak(SoakConfig(minutes=2, interval_s=15, workers=6, target="inproc", seed=7))
    report = "\n".join(format_lines(result))
    assert len(result.intervals) == 8, report
    answered = sum((Counter(r["answered_kinds"]) for r in result.intervals), Counter())
    routes = {"agent", "messages", "responses", "embeddings", "lora"}  # every route and the adapter answered
    assert routes <= set(answered) <= set(MIX) | {"burst"}, (dict(answered), report)
    assert result.server_errors == 0, report
    assert not result.probe_mismatches, (result.probe_mismatches, report)
    assert sum(r["unexpected"] for r in result.intervals) == 0, (result.errors, report)
    assert result.clean, report
    assert sum(r["requests"] for r in result.intervals) > 20, report
    statuses = {s for r in result.intervals for s in r["status"]}
    assert {"200", "400"} <= statuses, report  # answers and refusals of bad input both happened
    assert result.intervals[-1]["evictions"] > 0, report  # the small budget made the prefix cache churn
    assert result.end_state["in_flight"] == 0 and result.end_state["pages_used"] == 0
