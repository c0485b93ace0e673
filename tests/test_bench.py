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
    # Each workload starts with an empty prefix cache: the throughput prompts are all computed (the
    # prefill covers all but each prompt's last token, which the first decode step runs).
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


# -- llamacpp / agents / longctx (issue 20) ------------------------------------------------------------

TINY_AGENTS = dict(agents=2, min_turns=2, max_turns=2, system_tokens=120, tool_min=30, tool_max=60, reply_tokens=4,
                   rate=20.0)


def test_agent_trace_is_seeded_and_has_the_asked_shape(tiny_engine):
    from parallm_engine.bench_agents import AgentSizes, build_trace

    def encode(s):
        return tiny_engine.encode(s, add_special_tokens=False)

    sz = AgentSizes(agents=5, min_turns=4, max_turns=6, system_tokens=300, tool_min=200, tool_max=250, seed=7)
    a, b = build_trace(encode, sz), build_trace(encode, sz)
    assert a.digest() == b.digest() and a.arrivals == b.arrivals
    assert build_trace(encode, AgentSizes(**{**sz.__dict__, "seed": 8})).digest() != a.digest()
    assert len(a.system) == 300 and a.arrivals[0] == 0.0 and a.arrivals == sorted(a.arrivals)
    assert all(4 <= t <= 6 for t in a.turns) and len(a.turns) == 5
    im_start = encode("<|im_start|>")
    for tools in a.tools:
        for result in tools:  # the tool's message between the chat markers: 200-250 tokens of output
            assert 200 + 2 * len(im_start) <= len(result) <= 250 + 20
    assert a.describe()["requests"] == sum(a.turns)


def test_agents_workload_runs_the_same_trace_on_parallm_and_mlx_lm(tiny_engine):
    from parallm_engine.bench_agents import AgentSizes

    sz = AgentSizes(**TINY_AGENTS)
    result = bench.run_bench(tiny_engine, ["agents"], agent_sizes=sz)
    entry = result["workloads"]["agents"]
    assert entry["trace"]["requests"] == 4 and entry["trace"]["agents"] == 2
    for system in ("parallm", "mlx_lm_batch"):
        s = entry[system]
        assert s["completed_runs"] == 2 and s["requests"] == 4, (system, s)
        assert s["tokens"] == 4 * sz.reply_tokens  # EOS ignored: every reply is reply_tokens long
        # Turn 2 extends turn 1's conversation and agent 2 shares the system prompt: both caches hit.
        assert 0 < s["prefix_hit_rate"] < 1 and s["prefill_tokens"] < s["prompt_tokens"], (system, s)
        assert s["goodput_runs_per_min"] > 0 and s["makespan_s"] > 0
        assert 0 < s["ttft_p50_s"] <= s["ttft_p99_s"] and s["itl_p50_s"] <= s["itl_p99_s"]
        assert s["agent_latency_p50_s"] <= s["agent_latency_p99_s"]
    # The tiny model is no GGUF: llama.cpp is never tried on it, and says why.
    assert "skipped" in entry["llama_cpp"]
    assert entry["ratios"]["goodput_vs_mlx_lm_batch"] > 0 and entry["ratios"]["ttft_p99_vs_mlx_lm_batch"] > 0
    table = bench.format_table(result)
    assert "agents: 2 agents" in table and "goodput_vs_mlx_lm_batch=" in table
    json.dumps(result)


def test_longctx_workload_reuses_the_document(tiny_engine):
    from parallm_engine.bench_longctx import LongctxSizes

    sz = LongctxSizes(requests=4, doc_tokens=400, new_tokens=4)
    result = bench.run_bench(tiny_engine, ["longctx"], longctx_sizes=sz)
    entry = result["workloads"]["longctx"]
    p = entry["parallm"]
    assert p["requests"] == 4 and p["tokens"] == 4 * 4 and 0 < p["doc_tokens"] <= 400
    # The document is computed once (by the cold request); the 3 others compute only their question.
    assert p["doc_tokens"] < p["prefill_tokens"] < p["prompt_tokens"] - 2 * p["doc_tokens"], p
    assert p["ttft_cold_s"] > 0 and 0 < p["ttft_p50_s"] <= p["ttft_p99_s"]
    assert p["peak_kv_bytes"] > 0 and p["kv_bytes_private"] > p["peak_kv_bytes"]
    assert p["memory"]["kv_bytes_per_token"] > 0 and p["process_peak_rss_mb"] > 0
    assert entry["ratios"]["ttft_cold_vs_warm_p50"] > 0 and entry["ratios"]["kv_private_vs_peak"] > 1
    assert "longctx: 4 questions" in bench.format_table(result)
    json.dumps(result)


def test_longctx_document_is_cut_to_the_context_window(tiny_engine):
    from parallm_engine.bench_longctx import LongctxSizes, build_prompts

    prompts, doc_tokens = build_prompts(tiny_engine, LongctxSizes(requests=3, doc_tokens=100_000, new_tokens=4))
    assert doc_tokens < tiny_engine.context_window
    assert all(len(p) + 4 < tiny_engine.context_window for p in prompts)


def test_llamacpp_is_skipped_with_the_way_to_build_it(tiny_engine, monkeypatch):
    from parallm_engine import bench_llamacpp

    monkeypatch.setattr(bench_llamacpp, "find_llama_server", lambda: None)
    result = bench.run_bench(tiny_engine, ["llamacpp"], quick=True)
    assert "bench_llamacpp build" in result["workloads"]["llamacpp"]["skipped"]
    assert "llamacpp: skipped" in bench.format_table(result)


def test_the_http_client_measures_a_parallm_server(tiny_engine):
    """The client both servers are driven with, against `parallm serve` (in-process here)."""
    from parallm_engine.bench_llamacpp import SERVED_NAME, run_load
    from parallm_engine.server import ServerThread

    prompts = [[300 + i, 400 + i, 500 + i] for i in range(3)]
    with ServerThread(engine=tiny_engine, served_model_name=SERVED_NAME) as srv:
        out = run_load(srv.url, prompts, 5)
    assert out["requests"] == 3 and out["tokens"] == 15 and out["chunks"] >= 3
    assert 0 < out["ttft_p50_s"] <= out["ttft_p99_s"] and out["tok_s"] > 0


def test_llamacpp_peer_against_parallm_serve(engine):
    """Only where llama.cpp's llama-server is found (never in CI): both servers on the default GGUF."""
    import pytest

    from parallm_engine import bench_llamacpp

    if bench_llamacpp.find_llama_server() is None:
        pytest.skip(bench_llamacpp.SKIP_HINT)
    entry = bench_llamacpp.run_llamacpp_workload(engine, prompt_len=16, new_tokens=8, concurrency=(1, 4))
    assert "Q4_1" in entry["dtypes"]["llama_cpp"] and "float32" in entry["dtypes"]["parallm"]
    for c in (1, 4):
        level = entry["levels"][str(c)]
        for system in ("parallm", "llama_cpp"):
            assert level[system]["tokens"] == c * 8 and level[system]["tok_s"] > 0, (c, system, level)
        assert level["ratios"]["tok_s"] > 0
    assert entry["ratios"]["tok_s_vs_llama_cpp_at_4"] > 0


def test_paths_and_arrival_workloads(tiny_engine, tiny_model_dir):
    """The fan-out on the native and the pure-MLX path gives the same tokens (and both hold the prefix
    once); the arrival workload measures running streams before and during a long prompt's prefill."""
    from parallm_engine import bench, bench_paths

    paths = bench_paths.run_paths(str(tiny_model_dir), tiny_engine.model_info.vocab_size, n=6, prefix_len=96,
                                  new_tokens=6)
    assert paths["same_tokens"] and paths["cpu-mlx"]["backend"] == "cpu-mlx"
    assert paths["mlx_vs_native_wall"] > 0
    # Both paths hold the same KV (the prefix once: test_shared_prefix checks the layout itself).
    assert paths["cpu-mlx"]["peak_kv_bytes"] == paths["cpu-native"]["peak_kv_bytes"] > 0
    arrival = bench_paths.run_arrival(tiny_engine, streams=2, long_prompt=300, new_tokens=30)
    assert arrival["long_ttft_s"] > 0 and arrival["itl_before_p50_s"] > 0
    assert arrival["itl_during_max_s"] >= arrival["itl_during_p50_s"] >= 0
    lines = bench_paths.format_lines(paths) + bench_paths.format_lines(arrival)
    assert "pure-MLX / native wall" in lines[0] and "during its prefill" in lines[1]
    assert "paths" in bench._OWN_FORMAT and "arrival" in bench._OWN_FORMAT
