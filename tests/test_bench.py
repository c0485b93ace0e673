"""`parallm bench --quick` on a tiny random model: every workload runs against its baselines in one
process and the JSON has the documented shape. Timings are not asserted (shared, noisy machines)."""

from __future__ import annotations

import json

from parallm_bench import bench

from .conftest import settled_stats


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

    # Where each ParaLLM step's time went: host parts and the device wait, every part measured.
    steps = work["throughput"]["parallm"]["step_ms"]
    assert steps["decode_host"] + steps["device_wait"] > 0 and steps["plan"] > 0
    assert 0 <= steps["host_share"] <= 1
    table = bench.format_table(result)
    assert "throughput ratios: vs_mlx_lm_batch=" in table and "roofline:" in table
    assert "throughput ParaLLM step ms: plan" in table
    json.dumps(result)  # what --json writes


def test_clear_prefix_cache_frees_what_no_request_uses(tiny_engine):
    tiny_engine.generate([tiny_engine.encode("A prompt to keep in the prefix cache for a while.")], max_tokens=3,
                         temperature=0)
    assert settled_stats(tiny_engine)["prefix_cache"]["bytes"] > 0
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
    # --peer-batch N: N short prompts, PEER_BATCH_NEW tokens each, for every system
    peer = bench.run_bench(tiny_engine, ["peer"], quick=True, peer_batch=5)["workloads"]["peer"]
    assert (peer["prompts"], peer["prompt_tokens"], peer["new_tokens"]) == (5, bench.PEER_BATCH_PROMPT, bench.PEER_BATCH_NEW)
    for system in ("parallm", "transformers_fp32", "transformers_bf16"):
        assert peer[system]["tokens"] == 5 * bench.PEER_BATCH_NEW, system
    assert "peer ratios" in bench.format_table({"workloads": {"peer": peer}, "env": {}})


# -- llamacpp / agents / longctx (issue 20) ------------------------------------------------------------

TINY_AGENTS = dict(agents=2, min_turns=2, max_turns=2, system_tokens=120, tool_min=30, tool_max=60, reply_tokens=4,
                   rate=20.0)


def test_agent_trace_is_seeded_and_has_the_asked_shape(tiny_engine):
    from parallm_bench.agents import AgentSizes, build_trace

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
    from parallm_bench.agents import AgentSizes

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
    from parallm_bench.longctx import LongctxSizes

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
    from parallm_bench.longctx import LongctxSizes, build_prompts

    prompts, doc_tokens = build_prompts(tiny_engine, LongctxSizes(requests=3, doc_tokens=100_000, new_tokens=4))
    assert doc_tokens < tiny_engine.context_window
    assert all(len(p) + 4 < tiny_engine.context_window for p in prompts)


def test_llamacpp_is_skipped_with_the_way_to_build_it(tiny_engine, monkeypatch):
    from parallm_bench import llamacpp as bench_llamacpp

    monkeypatch.setattr(bench_llamacpp, "find_llama_server", lambda: None)
    result = bench.run_bench(tiny_engine, ["llamacpp"], quick=True)
    assert "parallm_bench.llamacpp build" in result["workloads"]["llamacpp"]["skipped"]
    assert "llamacpp: skipped" in bench.format_table(result)


def test_the_http_client_measures_a_parallm_server(tiny_engine):
    """The client both servers are driven with, against `parallm serve` (in-process here)."""
    from parallm_bench.llamacpp import SERVED_NAME, run_load
    from parallm_engine.serve.server import ServerThread

    prompts = [[300 + i, 400 + i, 500 + i] for i in range(3)]
    with ServerThread(engine=tiny_engine, served_model_name=SERVED_NAME) as srv:
        out = run_load(srv.url, prompts, 5)
    assert out["requests"] == 3 and out["tokens"] == 15 and out["chunks"] >= 3
    assert 0 < out["ttft_p50_s"] <= out["ttft_p99_s"] and out["tok_s"] > 0


def test_llamacpp_peer_against_parallm_serve(engine):
    """Only where llama.cpp's llama-server is found (never in CI): both servers on the default GGUF."""
    import pytest

    from parallm_bench import llamacpp as bench_llamacpp

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
    from parallm_bench import bench
    from parallm_bench import paths as bench_paths

    paths = bench_paths.run_paths(str(tiny_model_dir), tiny_engine.model_info.vocab_size, n=6, prefix_len=96,
                                  new_tokens=6)
    assert paths["same_tokens"] and paths["cpu-mlx"]["backend"] == "cpu-mlx"
    assert paths["mlx_vs_native_wall"] > 0
    # Both paths hold the same KV (the prefix once: test_shared_prefix checks the layout itself).
    assert paths["cpu-mlx"]["peak_kv_bytes"] == paths["cpu-native"]["peak_kv_bytes"] > 0
    arrival = bench_paths.run_arrival(tiny_engine, streams=2, long_prompt=300, new_tokens=30, shorts=2,
                                      short_tokens=20, short_delay_s=0.0)
    assert arrival["long_ttft_s"] > 0 and arrival["itl_before_p50_s"] > 0
    assert arrival["itl_during_max_s"] >= arrival["itl_during_p50_s"] >= 0
    assert arrival["short_ttft_max_s"] >= arrival["short_ttft_p50_s"] > 0
    lines = bench_paths.format_lines(paths) + bench_paths.format_lines(arrival)
    assert "pure-MLX / native wall" in lines[0] and "during its prefill" in lines[1]
    assert "2 short prompts sent after it" in lines[1]
    assert "paths" in bench._OWN_FORMAT and "arrival" in bench._OWN_FORMAT


def test_scheduling_probe_runs_the_burst_the_arrival_and_agents(tiny_engine):
    """parallm_bench.scheduling: the three workloads a prefill policy trades between, one line."""
    from parallm_bench import scheduling

    r = scheduling.run(tiny_engine, burst=6, burst_tokens=6, arrival_tokens=300, streams=2,
                       agents=dict(agents=2, min_turns=1, max_turns=2, system_tokens=60, tool_min=10, tool_max=30,
                                   reply_tokens=4, rate=20.0))
    assert r["burst"]["requests"] == 6 and r["burst"]["tokens"] == 36
    assert r["arrival"]["long_ttft_s"] > 0 and r["agents"]["completed_runs"] == 2
    line = scheduling.format_line(r)
    assert line.startswith("burst ") and "| arrival TTFT" in line and "runs/min" in line
    assert r["arrival"]["shorts"] == 4 and "4 short prompts after it" in line


# -- --shape, --plot, memory (issue 20) ------------------------------------------------------------------

def _lazy_model(cfg):
    """mlx-lm's own model class for ``cfg``: parameters are lazy arrays, never evaluated here."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(cfg)
    return model_class(args_class.from_dict(cfg))


def test_shape_configs_are_the_published_architectures():
    from mlx.utils import tree_flatten

    from parallm_bench import shapes as bs

    q = bs.shape_config("qwen3-4b")
    assert (q["num_hidden_layers"], q["hidden_size"], q["num_attention_heads"], q["num_key_value_heads"],
            q["head_dim"], q["intermediate_size"], q["vocab_size"], q["max_position_embeddings"]) == \
        (36, 2560, 32, 8, 128, 9728, 151936, 40960)
    assert q["rope_theta"] == 1e6 and q["tie_word_embeddings"] is True
    l3 = bs.shape_config("llama3-8b")
    assert (l3["hidden_size"], l3["num_attention_heads"], l3["num_key_value_heads"], l3["intermediate_size"],
            l3["vocab_size"], l3["rope_scaling"]["rope_type"]) == (4096, 32, 8, 14336, 128256, "llama3")
    g = bs.shape_config("gemma3-4b")
    assert (g["num_hidden_layers"], g["num_attention_heads"], g["num_key_value_heads"], g["head_dim"],
            g["sliding_window"], g["sliding_window_pattern"], g["vocab_size"]) == (34, 8, 4, 256, 1024, 6, 262208)

    # Built through mlx-lm's classes (one layer; lazy), the shapes are the real ones: qwen3's q/k norms and
    # GQA projections, gemma3's pattern (layer 6 of each group global), the parameter count we plan with.
    model = _lazy_model(bs.shape_config("qwen3-4b", 1))
    attn = model.model.layers[0].self_attn
    assert attn.k_proj.weight.shape == (8 * 128, 2560) and attn.q_proj.weight.shape == (32 * 128, 2560)
    assert attn.q_norm.weight.shape == (128,) and attn.k_norm.weight.shape == (128,)
    for name in bs.SHAPES:
        plan = bs.plan(name, layers=1)
        params = dict(tree_flatten(_lazy_model(bs.shape_config(name, 1)).parameters()))
        untied_head = params.pop("lm_head.weight", None) if name == "gemma3-4b" else None  # saved tied
        assert untied_head is None or untied_head.shape == (262208, 2560)
        assert sum(v.size for v in params.values()) == plan.total_params(), name
    assert round(bs.plan("qwen3-4b", layers=36).total_params() / 1e9, 2) == 4.02  # Qwen3-4B: "4.0B"
    assert round(bs.plan("llama3-8b", layers=32).total_params() / 1e9, 2) == 8.03
    gemma = _lazy_model(bs.shape_config("gemma3-4b", 6))
    assert [layer.self_attn.is_sliding for layer in gemma.model.layers] == [True] * 5 + [False]


def test_shape_layers_fit_the_budget_and_bad_sizes_are_typed_errors():
    import pytest

    from parallm_bench import shapes as bs
    from parallm_engine.errors import InvalidRequestError

    small, large = bs.plan("qwen3-4b", budget_gb=2.5), bs.plan("qwen3-4b", budget_gb=6.0)
    assert 2 <= small.layers_kept < large.layers_kept < 36
    assert large.step_weight_bytes() <= 6.0e9 < large.step_weight_bytes(large.layers_kept + 1)
    assert bs.plan("qwen3-4b", budget_gb=1000).layers_kept == 36
    # Gemma 3 keeps whole groups of 5 sliding + 1 global layers.
    assert bs.plan("gemma3-4b", budget_gb=0.1).layers_kept == 6 and bs.plan("gemma3-4b", budget_gb=9).layers_kept % 6 == 0
    assert "3 of 36 layers kept" in bs.plan("qwen3-4b", layers=3).describe()
    for bad in (dict(name="qwen9"), dict(name="qwen3-4b", layers=37), dict(name="qwen3-4b", layers=0),
                dict(name="qwen3-4b", budget_gb=-1)):
        with pytest.raises(InvalidRequestError):
            bs.plan(**bad)


def test_shape_model_loads_through_the_engine_with_a_padded_tokenizer(engine, tmp_path):
    """The build path at toy dimensions: qwen3 with a vocab larger than the tokenizer's. Encoding is the
    default model's; ids past its vocabulary (which a random model generates) decode to placeholders."""
    from parallm_engine import Engine
    from parallm_bench import shapes as bs

    plan = bs.plan("qwen3-4b", layers=2)
    toy = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               vocab_size=engine.model_info.vocab_size + 300, max_position_embeddings=1024)
    path = bs.build_shape_model(plan, engine.model_info.path, tmp_path / "q3", overrides=toy)
    eng = Engine(str(path))
    try:
        assert eng.model_info.vocab_size == toy["vocab_size"] and eng.model_info.num_layers == 2
        text = "The shapes keep the default model's tokenizer."
        assert eng.encode(text) == engine.encode(text)
        pad_id = engine.model_info.vocab_size + 7
        assert eng.tokenizer.decode([pad_id]) == bs.PAD_TOKEN.format(pad_id)
        out = eng.generate([eng.encode(text)], max_tokens=6, temperature=0, ignore_eos=True)[0]
        assert len(out.token_ids) == 6 and isinstance(out.text, str)
    finally:
        eng.shutdown()


def _fake_result() -> dict:
    sys_level = lambda tok_s: {"tok_s": tok_s, "ttft_p50_s": 0.1, "ttft_p99_s": 0.2}
    return {
        "env": {"model": "fake", "shape": {"name": "qwen3-4b", "layers_kept": 3, "layers_full": 36}},
        "workloads": {
            "throughput": {"parallm": {"tok_s": 40.0}, "ratios": {"vs_mlx_lm_batch": 2.1, "vs_sequential": 9.0}},
            "llamacpp": {"levels": {str(c): {"parallm": sys_level(10.0 * c), "llama_cpp": sys_level(8.0 * c),
                                             "ratios": {"tok_s": 1.25}} for c in (1, 8, 32)},
                         "ratios": {"tok_s_vs_llama_cpp_at_32": 1.25}},
            "agents": {"parallm": {"ttfts_s": [0.1, 0.3, 0.2]}, "mlx_lm_batch": {"ttfts_s": [0.5, 0.9]},
                       "llama_cpp": {"skipped": "no GGUF"}, "ratios": {"goodput_vs_mlx_lm_batch": 1.4}},
            "memory": {"parallm": {"peak_kv_bytes": 2**20, "peak_rss_after_load_mb": 900.0, "rss_after_load_mb": 800.0},
                       "mlx_lm_batch": {"peak_kv_bytes": 5 * 2**20, "peak_rss_after_load_mb": 1200.0,
                                        "rss_after_load_mb": 800.0},
                       "kv_bound_bytes": 2 * 2**20, "ratios": {"kv_mlx_lm_vs_parallm": 5.0}},
            "peer": {"skipped": "torch is not installed"},
            "spec": {"new_tokens": 8, "batch_1": {"plain_tok_s": 9.0, "ngram_tok_s": 14.0},
                     "batch_8": {"plain_tok_s": 40.0, "ngram_tok_s": 52.0}},
        },
    }


def test_plot_writes_a_png_per_workload(tmp_path):
    import matplotlib  # noqa: F401  (the test extra installs it)
    from parallm_bench import plot as bench_plot

    result_path = tmp_path / "result.json"
    result_path.write_text(json.dumps(_fake_result()))
    assert bench_plot.main([str(result_path), str(tmp_path / "plots")]) == 0
    names = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert names == ["agents_ratios.png", "agents_ttft_cdf.png", "llamacpp_tok_s.png", "memory.png",
                     "spec_tok_s.png", "throughput_ratios.png"]
    for name in names:
        data = (tmp_path / "plots" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name


def test_plot_without_matplotlib_is_a_clear_error(monkeypatch, tmp_path):
    import sys

    import pytest

    from parallm_bench import plot as bench_plot

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what `import matplotlib` sees when it is absent
    with pytest.raises(bench_plot.PlotUnavailableError, match="pip install matplotlib"):
        bench_plot.write_plots(_fake_result(), tmp_path)


def test_bench_cli_takes_the_new_options_and_rejects_unknown_workloads():
    import pytest

    from parallm_engine import cli
    from parallm_engine.errors import ParaLLMError

    args = cli.build_parser().parse_args(["bench", "--shape", "gemma3-4b", "--shape-layers", "6", "--plot", "d",
                                          "--workloads", "memory"])
    assert (args.shape, args.shape_layers, args.plot, args.workloads) == ("gemma3-4b", 6, "d", "memory")
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["bench", "--shape", "qwen9"])
    bad = cli.build_parser().parse_args(["bench", "--workloads", "throughput,nonsense"])
    with pytest.raises(ParaLLMError, match="nonsense"):
        bench.main(bad)


def test_memory_workload_runs_each_system_in_its_own_process(tiny_engine):
    from parallm_bench.memory import MemorySizes

    sz = MemorySizes(requests=3, prefix_tokens=96, suffix_tokens=4, new_tokens=3)
    result = bench.run_bench(tiny_engine, ["memory"], memory_sizes=sz)
    entry = result["workloads"]["memory"]
    p, m = entry["parallm"], entry["mlx_lm_batch"]
    for s in (p, m):
        assert s["tokens"] == 3 * 3 and s["peak_kv_bytes"] > 0 and s["peak_rss_after_load_mb"] > 0, s
    # Greedy on the same fp32 weights: the same tokens, so the same work was measured.
    assert entry["same_tokens"]
    # The prefix was computed once: 96 tokens + 4 own per request (less the last token, run by decode).
    assert p["prefill_tokens"] < 3 * (96 + 4)
    per_token = entry["bytes_per_token"]
    assert entry["kv_bound_bytes"] == int(1.2 * (96 + 3 * (4 + 3)) * per_token)
    assert entry["ratios"]["kv_vs_bound"] == round(p["peak_kv_bytes"] / entry["kv_bound_bytes"], 3)
    assert entry["ratios"]["kv_mlx_lm_vs_parallm"] > 0
    if p.get("peak_kv_bytes_held"):  # the engine's gauge of running + prefix cache, each byte once
        assert entry["ratios"]["kv_held_vs_bound"] == round(p["peak_kv_bytes_held"] / entry["kv_bound_bytes"], 3)
    lines = bench.format_table(result)
    assert "memory: 3 requests over a 96-token shared prefix" in lines and "KV bound 1.2 x" in lines
    # The tiny model's head size (16) cannot be quantized: the KV-quantization rows say so, nothing fails.
    assert "divisible by 32" in entry["kv_quant"]["kv8"]["error"] and "parallm_kv8" not in entry
    assert "KV 8-bit: not run" in lines
    json.dumps(result)


def test_context_and_concurrency_knobs_and_the_path_heading(tiny_engine):
    """--context / --concurrency set the throughput prompts and requests in flight; the table opens with the
    engine path it measured (pure-MLX is what Metal and CUDA run)."""
    result = bench.run_bench(tiny_engine, ["throughput"], quick=True, context=40, concurrency=3)
    entry = result["workloads"]["throughput"]
    assert entry["parallm"]["requests"] == 3 == entry["mlx_lm_batch"]["requests"]
    assert entry["parallm"]["tokens"] == 3 * bench.QUICK.new_tokens
    assert result["env"]["sizes"]["prompt_len"] == 40 and result["env"]["sizes"]["n"] == 3
    table = bench.format_table(result)
    assert f"engine path: {bench.PATH_TITLES[tiny_engine.backend.name]}; 3 concurrent, 40-token prompts" in table


def test_launch_probe_times_mlx_lm_s_decode_step_in_three_parts(tiny_engine):
    """parallm_bench.launch_probe's replay of mlx-lm's batched decode step: its parts add up to the step, and
    the replay's greedy tokens are mlx-lm's own (what the probe times is the real step)."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator

    from parallm_bench.launch_probe import mlx_lm_steps

    prompts = [[200 + (i * 37 + j * 11) % 500 for j in range(12)] for i in range(4)]
    got = mlx_lm_steps(tiny_engine.model, prompts, 12, tokens=True)
    assert all(got[k] >= 0 for k in ("build", "launch", "wait"))
    assert abs(got["build"] + got["launch"] + got["wait"] - got["step"]) < 0.01  # ms, each rounded to 0.001
    gen = BatchGenerator(tiny_engine.model, max_tokens=13, stop_tokens=None, completion_batch_size=4,
                         prefill_batch_size=4)
    uids = gen.insert(prompts, [13] * 4)
    ref = {u: [] for u in uids}
    while responses := gen.next_generated():
        for r in responses:
            ref[r.uid].append(r.token)
    gen.close()
    assert got["tokens"] == [ref[u] for u in uids]
    mx.clear_cache()


def test_constrained_workload(tiny_engine):
    """`parallm bench --workloads constrained`: rows under a JSON schema decode beside free rows in one
    batch, none finishes early (the schema forbids it), and the table prints the ratios."""
    from parallm_bench import bench
    from parallm_bench import constrained as bench_constrained

    result = bench.run_bench(tiny_engine, ["constrained"], quick=True, progress=lambda msg: None)
    entry = result["workloads"]["constrained"]
    n, new = bench_constrained.QUICK_CONSTRAINED
    for name in ("unconstrained", "constrained", "mixed"):
        assert entry[name]["tokens"] == n * new and entry[name]["finished_early"] == 0, (name, entry[name])
        assert entry[name]["decode_tok_s"] > 0
    assert entry["constrained"]["constrained"] == n and entry["mixed"]["constrained"] == n // 2
    assert entry["ratio"] > 0 and entry["ratio_mixed"] > 0
    assert "constrained" in bench._OWN_FORMAT
    assert "half constrained" in bench.format_table({"workloads": {"constrained": entry}})


def test_preempt_workload(tiny_engine):
    """`parallm bench --workloads preempt`: under a budget of half the batch's final KV rows are preempted
    and resume with the same greedy tokens, and the KV held stays near the budget."""
    from parallm_bench import bench
    from parallm_bench import preemption as bench_preemption

    entry = bench_preemption.run_preempt(tiny_engine, (8, 48, 40, 0.5))
    tight = entry["parallm_tight"]
    assert tight["preemptions"] > 0 and entry["parallm"]["preemptions"] == 0
    assert entry["same_tokens"]
    assert tight["peak_kv_held_vs_budget"] <= 1.25, tight
    assert entry["ratios"]["tight_vs_unlimited"] > 0 and entry["ratios"]["tight_vs_mlx_lm_batch"] > 0
    assert "preemptions" in bench.format_table({"workloads": {"preempt": entry}})
