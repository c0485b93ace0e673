"""A one-minute soak (bench_soak.py, the same harness as `parallm bench --workloads soak --minutes N`): the
in-process engine behind the real HTTP app on loopback, a seeded mix of agent loops, fan-outs, streams, tools,
JSON schemas, n > 1, seeded and speculative requests, disconnects, cancellations, bad inputs and bursts past the
queue, under a KV budget small enough to evict all the time. Asserts what must hold however slow the machine:
no 5xx, every status the one its kind expects, the probes' text unchanged, and a clean end (no request, page or
pin left once the load stops and the prefix cache is cleared)."""

from __future__ import annotations

import pytest

from parallm_bench.soak import SoakConfig, format_lines, run_soak


@pytest.mark.timeout(900)
def test_one_minute_soak_ends_clean_with_probes_unchanged():
    # One minute in four 15 s intervals (two minutes cost the CI run more than they found; the long soak
    # runs for 30 minutes and more: `parallm bench --workloads soak`, docs/benchmarks-archive.md).
    result = run_soak(SoakConfig(minutes=1, interval_s=15, workers=6, target="inproc", seed=7))
    report = "\n".join(format_lines(result))
    assert len(result.intervals) == 4, report
    assert result.server_errors == 0, report
    assert not result.probe_mismatches, (result.probe_mismatches, report)
    assert sum(r["unexpected"] for r in result.intervals) == 0, (result.errors, report)
    assert result.clean, report
    assert sum(r["requests"] for r in result.intervals) > 20, report
    statuses = {s for r in result.intervals for s in r["status"]}
    assert {"200", "400"} <= statuses, report  # answers and refusals of bad input both happened
    assert result.intervals[-1]["evictions"] > 0, report  # the small budget made the prefix cache churn
    assert result.end_state["in_flight"] == 0 and result.end_state["pages_used"] == 0
