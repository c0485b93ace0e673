"""`parallm bench --quick` on a tiny random model: every workload runs against its baselines in one
process and the JSON has the documented shape. Timings are not asserted (shared, noisy machines)."""

from __future__ import annotations

import json

from parallm_engine import bench


def test_quick_bench_runs_every_workload_with_ratios(tiny_engine, tmp_path):
    ticks = []
    result = bench.run_bench(tiny_engine, ["throughput", "fanout", "single", "roofline"], quick=True,
                             progress=ticks.append)
    work = result["workloads"]
    q = bench.QUICK
    for name, systems in (("throughput", ("parallm", "mlx_lm_batch", "sequential")),
                          ("fanout", ("parallm", "parallm_no_prefix_cache", "mlx_lm_batch", "sequential")),
                          ("single", ("parallm", "sequential"))):
        entry = work[name]
        for system in systems:
            s = entry[system]
            assert s["tokens"] > 0 and s["tok_s"] > 0 and s["wall_s"] > 0, (name, system, s)
            assert s["ttft_p50_s"] <= s["ttft_p95_s"]
        assert entry["ratios"]["vs_sequential"] > 0
    # Every request generated exactly its fixed length (EOS ignored), in each system.
    assert work["throughput"]["parallm"]["tokens"] == q.n * q.new_tokens
    assert work["throughput"]["mlx_lm_batch"]["tokens"] == q.n * q.new_tokens
    assert work["fanout"]["parallm"]["tokens"] == q.n * q.fan_new
    # Each workload starts with an empty prefix cache: the throughput prompts are all computed.
    assert work["throughput"]["parallm"]["prefill_tokens"] == sum(q.prompt_len - (i % 7) - 1 for i in range(q.n))
    assert len(work["single"]["parallm"]["runs_tok_s"]) == q.single_reps
    # The shared prefix is computed once with the radix cache, once per request without it.
    fan = work["fanout"]
    assert fan["parallm"]["prefill_tokens"] < fan["parallm_no_prefix_cache"]["prefill_tokens"]
    assert fan["ratios"]["prefill_tokens_vs_no_prefix_cache"] < 1
    roof = work["roofline"]
    assert roof["gemm_gflops"] > 0 and roof["memory_gbps"] > 0 and 0 < roof["flops_fraction"]
    assert result["env"]["quick"] is True and "blas" in result["env"]["backend"]
    assert ticks, "progress callback was called"

    table = bench.format_table(result)
    assert "throughput ratios: vs_mlx_lm_batch=" in table and "roofline:" in table
    json.dumps(result)  # what --json writes


def test_clear_prefix_cache_frees_what_no_request_uses(tiny_engine):
    tiny_engine.generate([tiny_engine.encode("A prompt to keep in the prefix cache for a while.")], max_tokens=3,
                         temperature=0)
    assert tiny_engine.stats()["prefix_cache"]["bytes"] > 0
    assert tiny_engine.clear_prefix_cache() > 0
    assert tiny_engine.stats()["prefix_cache"]["bytes"] == 0


def test_peer_is_skipped_with_a_reason_without_torch(tiny_engine, monkeypatch):
    monkeypatch.setattr(bench, "_torch_available", lambda: False)
    result = bench.run_bench(tiny_engine, ["peer"], quick=True)
    assert "torch" in result["workloads"]["peer"]["skipped"]
    assert "peer: skipped" in bench.format_table(result)


def test_peer_runs_transformers_in_its_own_process(tiny_engine):
    """Only where the optional `peer` extra (torch) is installed."""
    if not bench._torch_available():
        import pytest

        pytest.skip("torch is not installed (the optional peer extra)")
    result = bench.run_bench(tiny_engine, ["peer"], quick=True)
    peer = result["workloads"]["peer"]
    q = bench.QUICK
    for dt in ("fp32", "bf16"):
        assert peer[f"transformers_{dt}"]["tokens"] == q.n * q.new_tokens
        assert peer["ratios"][f"vs_transformers_{dt}"] > 0
