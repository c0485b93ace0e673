"""`parallm bench`: ParaLLM side by side with mlx-lm (and transformers when installed), in one run.

Every baseline runs in this process on the *same* loaded weights, dtype and BLAS as the engine. What
differs is the engine: its scheduling and, on the CPU backend, its decode lanes (``decode_batch``: one
MLX stream per core) and its own attention/SwiGLU kernels (``cpu_kernels``); the baselines call the
same model through mlx-lm's own functions. ``env`` records the lanes and whether the kernels were on.
Workloads (sizes for the full run; ``--quick`` shrinks them):

- throughput: 32 concurrent requests, ~100-token distinct prompts, 128 new tokens each (EOS ignored), greedy.
- fanout:     32 requests sharing a 512-token prefix, distinct 32-token suffixes, 64 new tokens each;
              also run on a second engine with the prefix cache off (``parallm_no_prefix_cache``).
- single:     one request, 128-token prompt, 256 new tokens; three alternating runs of each system,
              the median one reported (``runs_tok_s`` lists all).
- peer:       transformers + torch static batched ``generate`` (fp32 and bf16) on the same weights and
              prompts as `throughput` (only when torch is installed: ``pip install torch==2.13.0``).
- roofline:   decode-step FLOP/s at batch 64 vs numpy fp32 GEMM FLOP/s, and weight bytes/s at batch 1 vs
              measured memory bandwidth, all in this run.
- llamacpp:   llama.cpp's llama-server vs `parallm serve` on the same GGUF, same client, 1/8/32 concurrent
              (``bench_llamacpp``; skipped with the way to build it when llama-server is absent).
- agents:     simulated ReAct agents with Poisson arrivals vs mlx-lm BatchGenerator + its prompt cache and
              llama-server (``bench_agents``; sizes: ``AgentSizes``).
- longctx:    16 questions over one 8,000-token document: cold vs cached TTFT, KV bytes (``bench_longctx``).
- spec:       copy-heavy prompts (edit a JSON block, quote a tool result), greedy, with and without n-gram
              speculative decoding at 1 / 8 / 32 concurrent: tok/s, same tokens, acceptance (``bench_spec``).
- constrained: 32 requests under a JSON schema (no row can finish early) vs the same requests without one,
              and half of them constrained: decode tok/s and their ratios (``bench_constrained``).
- preempt:    the throughput prompts on an engine whose KV budget holds half the batch's final KV (rows are
              preempted and resume) vs the bench's engine and mlx-lm BatchGenerator: tok/s, preemptions, same
              tokens (``bench_preemption``).
- memory:     the fan-out (32 requests on a 2,000-token shared prefix) on ParaLLM and mlx-lm BatchGenerator,
              each in a process of its own: peak KV bytes and peak RSS, KV held vs 1.2 x the ideal
              (``bench_memory``).
- vision:     8 requests on one image with a random VLM at SmolVLM-256M's shapes: cold TTFT (vision encoder
              + prefill) vs the later requests' TTFT, and the encoder-run counter (``bench_vision``).
- embed:      64 texts on a random Qwen3-Embedding-shaped model: texts/s at 1 / 16 / 64 concurrent vs one at a
              time with mlx-lm, and a burst of 1,000 beside 8 decoding chat streams: their ITL during vs alone
              (``bench_embed``).
- rerank:     one query x 64 passages on a random Qwen3-Reranker-shaped model: pairs/s in the batch vs one
              pair at a time with mlx-lm, and the prefill tokens the shared prefix saved (``bench_rerank``).
- restart:    the prefix cache's disk tier across processes: a script with a 3,000-token system prompt and 8
              parallel calls run twice (TTFT, cached tokens, same outputs), and restore vs recompute of
              100 / 1,000 / 8,000-token prefixes with the rule's pick (``restart``).
- sessions:   the agents trace with 2-10 s tool calls under a KV budget a third of its working set, with and
              without sessions (and with the default budget): re-prefilled tokens, TTFT (``sessions``).
- observe:    the throughput and fan-out prompts with the live page watched and OpenTelemetry spans on vs
              both off, alternating: what watching costs (``observe``).
- programs:   agent runs (coding agents, BFCL-like runs with parallel tool calls, Send fan-outs) arriving as a
              Poisson process, with call-level FIFO and no retention vs the defaults (programs and sessions),
              under a third of the working set and with room, and mlx-lm's BatchGenerator: job completion
              time, re-prefilled tokens, the admission bound (``programs``).

``--shape qwen3-4b|llama3-8b|gemma3-4b`` runs the workloads on a random-weight model of that architecture
(layers cut to a budget; ``bench_shapes``); ``--plot DIR`` writes matplotlib PNGs (``bench_plot``).

JSON (``--json PATH``)::

    {"workloads": {"<name>": {"parallm": {...}, "mlx_lm_batch": {...}, "sequential": {...},
                              "ratios": {"vs_mlx_lm_batch": x, "vs_sequential": y}}},
     "env": {...}}

Each system's entry has ``tok_s`` (aggregate generated tokens / wall), ``wall_s``, ``ttft_p50_s``,
``ttft_p95_s``, ``itl_p50_s``, ``itl_p95_s``, ``peak_mem_mb``, ``prefill_tokens``, ``requests``,
``tokens``. Every ParaLLM run starts with an empty prefix cache (no hits on an earlier workload's
prompts); the ``fanout`` shared prefix is computed inside the timed run by every system. The
sequential baseline runs a subset of the requests one after another (all of them would take minutes)
and reports its per-stream rate; ``ratios.vs_sequential`` compares aggregate tok/s.
``peer`` has ``transformers_fp32`` / ``transformers_bf16`` entries and
``ratios.vs_transformers_fp32`` / ``vs_transformers_bf16`` (transformers runs in a process of its
own: ``peer_worker``). ``roofline`` has ``decode_b64_gflops``, ``gemm_gflops``, ``flops_fraction``,
``decode_b1_weight_gbps``, ``memory_gbps``, ``bandwidth_fraction``. ``llamacpp``, ``agents``,
``longctx`` and ``memory`` have the shapes their modules' docstrings give (p99 latencies, ``ratios`` as
above). With ``--shape``, ``env.shape`` says which shape and how many of its layers were kept.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import os
import platform
import random
import time
from dataclasses import dataclass

import mlx.core as mx

from parallm_bench import transformers_peer
from parallm_engine.core.stats import step_breakdown_ms
from parallm_engine.runner.weights_dtype import BF16_WEIGHTS


@dataclass
class Sizes:
    n: int
    prompt_len: int
    new_tokens: int
    prefix_len: int
    suffix_len: int
    fan_new: int
    single_prompt: int
    single_new: int
    seq_subset: int
    roof_batch: int
    single_reps: int


FULL = Sizes(32, 100, 128, 512, 32, 64, 128, 256, 3, 64, 3)
QUICK = Sizes(8, 64, 24, 256, 16, 16, 64, 48, 2, 32, 1)

DEFAULT_WORKLOADS = "throughput,fanout,single,peer,roofline,paths,arrival"
#: With --shape: the workloads whose cost the shape changes; each extra engine of paths / peer would hold
#: another copy of a multi-GB model.
SHAPE_WORKLOADS = "throughput,fanout,single"
ALL_WORKLOADS = ("throughput", "fanout", "single", "peer", "roofline", "llamacpp", "agents", "longctx", "paths",
                 "arrival", "memory", "preempt", "spec", "constrained", "vision", "embed", "rerank", "lora", "restart",
                 "sessions", "programs", "curve", "observe")


def _median_run(runs: list[dict]) -> dict:
    """The run with the median tok/s, with every run's tok/s attached."""
    best = sorted(runs, key=lambda r: r["tok_s"])[len(runs) // 2]
    return {**best, "runs_tok_s": [r["tok_s"] for r in runs]}


def _pct(values, q):
    if not values:
        return 0.0
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q * (len(v) - 1))))]


def _summary(tokens: int, wall: float, ttfts, itls, prefill: int, requests: int, peak: int) -> dict:
    return {
        "requests": requests,
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "tok_s": round(tokens / wall, 2) if wall else 0.0,
        "ttft_p50_s": round(_pct(ttfts, 0.5), 4),
        "ttft_p95_s": round(_pct(ttfts, 0.95), 4),
        "itl_p50_s": round(_pct(itls, 0.5), 4),
        "itl_p95_s": round(_pct(itls, 0.95), 4),
        "peak_mem_mb": round(peak / 2**20, 1),
        "prefill_tokens": prefill,
    }


def _prompts(rng: random.Random, n: int, length: int, vocab: int) -> list[list[int]]:
    # Random ordinary-token ids (ids < 100 include the special tokens of most vocabularies).
    return [[rng.randrange(200, vocab - 1) for _ in range(length)] for _ in range(n)]


# -- ParaLLM ---------------------------------------------------------------------------------------

def run_parallm(engine, prompts: list[list[int]], new_tokens: int, adapters: list | None = None) -> dict:
    """``adapters``: a LoRA adapter (or None) per prompt (``bench_lora``)."""
    engine.clear_prefix_cache()  # every workload starts cold: no hits on an earlier workload's prompts
    start = engine.stats()
    before = start["prefill_tokens"]
    mx.reset_peak_memory()

    async def main():
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        handles = [engine.submit(p, loop=loop, max_tokens=new_tokens, temperature=0.0, ignore_eos=True,
                                 adapter=adapters[i] if adapters else None)
                   for i, p in enumerate(prompts)]

        async def consume(h):
            first, times, n = None, [], 0
            async for d in h:
                now = time.perf_counter()
                if d.token_ids:
                    times.append(now)
                    n += len(d.token_ids)
                    if first is None:
                        first = now - t0
            return first, times, n

        outs = await asyncio.gather(*(consume(h) for h in handles))
        return time.perf_counter() - t0, outs

    wall, outs = asyncio.run(main())
    ttfts = [o[0] for o in outs if o[0] is not None]
    itls = [b - a for o in outs for a, b in zip(o[1], o[1][1:])]
    end = engine.stats()
    prefill = end["prefill_tokens"] - before
    out = _summary(sum(o[2] for o in outs), wall, ttfts, itls, prefill, len(prompts), mx.get_peak_memory())
    out["step_ms"] = _step_ms(start, end)
    release_kv(engine)
    return out


def release_kv(engine) -> None:
    """After a ParaLLM run: its prefix cache dropped, its pools cut to nothing and MLX's buffer cache
    emptied, so the baselines that run next in this process have the memory (and their peak counts only
    their own arrays). Before, the run's KV stayed held through them: at 32 x 4,000-token prompts mlx-lm's
    BatchGenerator was killed for memory beside it, and its peak MB included ParaLLM's pools."""
    engine.clear_prefix_cache()
    mx.clear_cache()


def _step_ms(start: dict, end: dict) -> dict | None:
    """Mean ms per engine step of one run, by part (stats.step_breakdown_ms), from two stats() snapshots."""
    if "step_totals_s" not in start:  # an engine behind base_url= without these counters
        return None
    a, b = start["step_totals_s"], end["step_totals_s"]
    d = {k: b[k] - a[k] for k in a}
    return step_breakdown_ms(d["steps"], d["plan"], d["prefill"], d["decode"], d["device_wait"], d.get("launch", 0.0))


# -- mlx-lm baselines ------------------------------------------------------------------------------

def run_mlx_lm_batch(model, prompts: list[list[int]], new_tokens: int, caches=None, batch=None,
                     prefill_extra: int = 0) -> dict:
    """``caches`` may be a callable building the per-request prompt caches: it runs inside the timed
    region (the shared prefix has to be computed by someone; ``prefill_extra`` counts its tokens)."""
    from mlx_lm.generate import BatchGenerator

    mx.reset_peak_memory()
    batch = batch or len(prompts)
    t0 = time.perf_counter()
    if callable(caches):
        caches = caches()
    gen = BatchGenerator(model, max_tokens=new_tokens, stop_tokens=None,
                         completion_batch_size=batch, prefill_batch_size=_mlx_lm_prefill_rows(prompts, batch))
    uids = gen.insert(prompts, [new_tokens] * len(prompts), caches=caches)
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    itls: list[float] = []
    tokens = 0
    with gen.stats() as st:
        while responses := gen.next_generated():
            now = time.perf_counter()
            for r in responses:
                tokens += 1
                if r.uid not in first:
                    first[r.uid] = now - t0
                else:
                    itls.append(now - last[r.uid])
                last[r.uid] = now
    wall = time.perf_counter() - t0
    gen.close()
    assert set(first) == set(uids)
    return _summary(tokens, wall, list(first.values()), itls, int(st.prompt_tokens) + prefill_extra,
                    len(prompts), mx.get_peak_memory())


#: The most prompt tokens mlx-lm's BatchGenerator prefills in one forward here (its prefill batch is cut to
#: fit): 32 prompts of 2,000 tokens in one forward ran an H100's 80 GB out of memory (its attention scores).
MLX_LM_PREFILL_TOKENS = 16384


def _mlx_lm_prefill_rows(prompts: list[list[int]], batch: int) -> int:
    """Prompts mlx-lm prefills together: all of them (``batch``) while they fit MLX_LM_PREFILL_TOKENS
    (every short-prompt workload), fewer for long prompts (its own default is 8)."""
    longest = max((len(p) for p in prompts), default=1)
    return max(1, min(batch, MLX_LM_PREFILL_TOKENS // max(1, longest)))


def run_sequential(model, tokenizer, prompts: list[list[int]], new_tokens: int, prefix_cache=None,
                   prefix_len: int = 0) -> dict:
    """mlx_lm's own single-stream generation, one request after another (on a subset). A callable
    ``prefix_cache`` is built inside the timed region, once, and copied for every request."""
    from mlx_lm.generate import stream_generate

    mx.reset_peak_memory()
    ttfts, itls, tokens, prefill = [], [], 0, 0
    t0 = time.perf_counter()
    if callable(prefix_cache):
        prefix_cache = prefix_cache()
        prefill += prefix_len
    for p in prompts:
        cache = copy.deepcopy(prefix_cache) if prefix_cache is not None else None
        ids = p[prefix_len:] if cache is not None else p
        prefill += len(ids)
        start = time.perf_counter()
        last = None
        n = 0
        for resp in stream_generate(model, tokenizer, mx.array(ids), max_tokens=new_tokens, prompt_cache=cache):
            now = time.perf_counter()
            if last is None:
                ttfts.append(now - start)
            else:
                itls.append(now - last)
            last = now
            n += 1
            if n >= new_tokens:
                break
        tokens += n
    wall = time.perf_counter() - t0
    return _summary(tokens, wall, ttfts, itls, prefill, len(prompts), mx.get_peak_memory())


def _prefix_cache(model, prefix: list[int]):
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.array(prefix)[None], cache=cache)
    mx.eval([c.state for c in cache])
    return cache


# -- peer: transformers + torch (transformers_peer) ------------------------------------------------

def _torch_available() -> bool:
    return transformers_peer.torch_available()


def run_transformers(model_dir, prompts: list[list[int]], new_tokens: int, dtype: str) -> dict | None:
    out = transformers_peer.generate(model_dir, prompts, new_tokens, dtype)
    if out is None:
        return None
    summary = _summary(out["tokens"], out["wall_s"], [], [], sum(map(len, prompts)), len(prompts), 0)
    summary["torch_threads"] = out["threads"]
    return summary


# -- driver ----------------------------------------------------------------------------------------

def _ratios(entry: dict) -> dict:
    p = entry["parallm"]
    out = {}
    if entry.get("mlx_lm_batch"):
        m = entry["mlx_lm_batch"]
        out["vs_mlx_lm_batch"] = round(p["tok_s"] / m["tok_s"], 2) if m["tok_s"] else None
        out["wall_vs_mlx_lm_batch"] = round(m["wall_s"] / p["wall_s"], 2) if p["wall_s"] else None
        if p["ttft_p50_s"]:
            out["ttft_p50_vs_mlx_lm_batch"] = round(m["ttft_p50_s"] / p["ttft_p50_s"], 2)
    if entry.get("sequential"):
        s = entry["sequential"]
        out["vs_sequential"] = round(p["tok_s"] / s["tok_s"], 2) if s["tok_s"] else None
    if entry.get("parallm_no_prefix_cache"):
        n = entry["parallm_no_prefix_cache"]
        out["ttft_p50_vs_no_prefix_cache"] = round(n["ttft_p50_s"] / p["ttft_p50_s"], 2) if p["ttft_p50_s"] else None
        out["prefill_tokens_vs_no_prefix_cache"] = round(p["prefill_tokens"] / n["prefill_tokens"], 3)
    return out


#: ``--peer-batch N``: N prompts of this many tokens, this many new tokens each (issue 20's batch-64 decode
#: measure: short prompts, so the static batch's decode dominates).
PEER_BATCH_PROMPT, PEER_BATCH_NEW = 32, 48


#: How each engine path is named in the table (the pure-MLX path is what every Mac and GPU user runs).
PATH_TITLES = {"cpu-mlx": "pure-MLX (what Metal and CUDA run), on this CPU",
               "cpu-native": "native CPU kernels (Linux CPUs only)",
               "metal": "pure-MLX on Metal", "cuda": "pure-MLX on CUDA"}


def sizes_for(quick: bool, context: int | None = None, concurrency: int | None = None) -> Sizes:
    """The run's sizes; ``context`` (``--context``) sets the throughput prompts' and the fan-out's shared prefix
    length, ``concurrency`` (``--concurrency``) the requests in flight of both."""
    sz = QUICK if quick else FULL
    if context:
        sz = dataclasses.replace(sz, prompt_len=context, prefix_len=context)
    if concurrency:
        sz = dataclasses.replace(sz, n=concurrency)
    return sz


def run_bench(engine, workloads: list[str], quick: bool = False, progress=None, agent_sizes=None,
              longctx_sizes=None, memory_sizes=None, peer_batch: int | None = None, context: int | None = None,
              concurrency: int | None = None) -> dict:
    sz = sizes_for(quick, context, concurrency)
    vocab = engine.model_info.vocab_size
    rng = random.Random(1234)
    model, tok = engine.model, engine.tokenizer
    result = {"workloads": {}, "env": {**_env(engine, quick), "sizes": dataclasses.asdict(sz)}}
    tick = progress or (lambda msg: None)

    # On a GPU MLX compiles kernels the first time it meets a graph, and the systems share that cache: the one
    # run first would pay for the others (measured on an H100: ParaLLM 1.72 s TTFT cold, 0.18 s warm; mlx-lm
    # 3.96 s / 0.06 s). There each system runs the workload untimed first: mlx-lm once (its graph is the same
    # every run), ParaLLM twice, because its steps follow the measured prefill rate: a second run of the same
    # fan-out split its joins in two waves where the first had one, met the late join onto a shared prefix for
    # the first time and stalled 4.1 s compiling (H200, 2026-11-26; the step trace showed it). The CPU compiles
    # nothing.
    gpu = engine.backend.device != "cpu"
    warm = (lambda fn: (fn(), fn())[1]) if gpu else (lambda fn: fn())
    warm_parallm = (lambda fn: (fn(), fn(), fn())[2]) if gpu else (lambda fn: fn())
    result["env"]["warm_up_runs"] = {"parallm": 2, "baselines": 1} if gpu else 0

    if "throughput" in workloads:
        prompts = [p[: sz.prompt_len - (i % 7)] for i, p in enumerate(_prompts(rng, sz.n, sz.prompt_len, vocab))]
        tick("throughput: parallm")
        entry = {"parallm": warm_parallm(lambda: run_parallm(engine, prompts, sz.new_tokens))}
        tick("throughput: mlx-lm BatchGenerator")
        entry["mlx_lm_batch"] = _on_engine(engine, lambda: warm(lambda: run_mlx_lm_batch(model, prompts, sz.new_tokens)))
        tick("throughput: sequential mlx_lm.generate")
        entry["sequential"] = _on_engine(engine, lambda: warm(lambda: run_sequential(model, tok, prompts[: sz.seq_subset],
                                                                                     sz.new_tokens)))
        entry["ratios"] = _ratios(entry)
        result["workloads"]["throughput"] = entry
        result["_throughput_prompts"] = prompts

    if "fanout" in workloads:
        prefix = _prompts(rng, 1, sz.prefix_len, vocab)[0]
        prompts = [prefix + s for s in _prompts(rng, sz.n, sz.suffix_len, vocab)]
        tick("fanout: parallm")
        entry = {"parallm": warm_parallm(lambda: run_parallm(engine, prompts, sz.fan_new))}
        tick("fanout: parallm, prefix cache off")
        entry["parallm_no_prefix_cache"] = warm(lambda: _without_prefix_cache(engine, prompts, sz.fan_new))

        def mlx_batch_cached():
            # The prefix is prefilled once (timed), then deep-copied into every request's cache: the
            # best mlx-lm's API allows (its BatchKVCache still holds one copy per row).
            def caches():
                cache = _prefix_cache(model, prefix)
                return [copy.deepcopy(cache) for _ in prompts]

            return run_mlx_lm_batch(model, [p[sz.prefix_len:] for p in prompts], sz.fan_new, caches=caches,
                                    prefill_extra=sz.prefix_len)

        tick("fanout: mlx-lm BatchGenerator (+prompt cache)")
        entry["mlx_lm_batch"] = _on_engine(engine, lambda: warm(mlx_batch_cached))
        tick("fanout: sequential (+prompt cache)")
        entry["sequential"] = _on_engine(engine, lambda: warm(lambda: run_sequential(
            model, tok, prompts[: sz.seq_subset], sz.fan_new, prefix_cache=lambda: _prefix_cache(model, prefix),
            prefix_len=sz.prefix_len)))
        entry["ratios"] = _ratios(entry)
        result["workloads"]["fanout"] = entry

    if "single" in workloads:
        # One stream is the most noise-sensitive number (one core's hiccup is a few percent of it):
        # the two systems alternate, and each reports its median run (all runs in ``runs_tok_s``).
        prompt = _prompts(rng, 1, sz.single_prompt, vocab)
        runs: dict[str, list[dict]] = {"parallm": [], "sequential": []}
        for rep in range(sz.single_reps):
            tick(f"single: parallm ({rep + 1}/{sz.single_reps})")
            runs["parallm"].append(run_parallm(engine, prompt, sz.single_new))
            tick(f"single: mlx_lm.generate ({rep + 1}/{sz.single_reps})")
            runs["sequential"].append(_on_engine(engine, lambda: run_sequential(model, tok, prompt, sz.single_new)))
        entry = {system: _median_run(r) for system, r in runs.items()}
        entry["ratios"] = _ratios(entry)
        result["workloads"]["single"] = entry

    if "peer" in workloads:
        prompts = result.pop("_throughput_prompts", None) or _prompts(rng, sz.n, sz.prompt_len, vocab)
        peer_new = sz.new_tokens
        if peer_batch:  # --peer-batch N: N short prompts, the static batch's decode dominates
            prompts, peer_new = _prompts(random.Random(0), peer_batch, PEER_BATCH_PROMPT, vocab), PEER_BATCH_NEW
        prompts = [p[: min(len(q) for q in prompts)] for p in prompts]  # static batching: equal lengths
        if not _torch_available():
            result["workloads"]["peer"] = {"skipped": "torch is not installed (pip install torch==2.13.0, or "
                                                      "PARALLM_PEER_PYTHON=<a python that has torch and transformers>)"}
        else:
            import tempfile

            tick("peer: parallm on equal-length prompts")
            # weights_dtype="bfloat16" (parallm bench --weights-dtype bfloat16): the row says so
            mine = "parallm_bf16" if engine.weights_dtype in BF16_WEIGHTS else "parallm"
            entry = {mine: run_parallm(engine, prompts, peer_new), "prompts": len(prompts),
                     "prompt_tokens": len(prompts[0]), "new_tokens": peer_new}
            with tempfile.TemporaryDirectory() as d:
                hf_dir = _on_engine(engine, lambda: transformers_peer.hf_dir_with_fp32(engine, d))
                for dt in ("fp32", "bf16"):
                    tick(f"peer: transformers {dt}")
                    entry[f"transformers_{dt}"] = run_transformers(hf_dir, prompts, peer_new, dt)
            entry["ratios"] = {
                f"vs_transformers_{dt}": round(entry[mine]["tok_s"] / entry[f"transformers_{dt}"]["tok_s"], 2)
                for dt in ("fp32", "bf16") if entry.get(f"transformers_{dt}")
            }
            result["workloads"]["peer"] = entry
    result.pop("_throughput_prompts", None)

    if "roofline" in workloads:
        from parallm_bench.roofline import run_roofline

        tick("roofline")
        result["workloads"]["roofline"] = run_roofline(engine, sz.roof_batch)

    if "llamacpp" in workloads:
        from parallm_bench.llamacpp import run_llamacpp_workload

        result["workloads"]["llamacpp"] = run_llamacpp_workload(engine, sz.prompt_len, sz.new_tokens, tick=tick)
    if "agents" in workloads:
        from parallm_bench import agents as ba

        agent_sizes = agent_sizes or (ba.QUICK_AGENTS if quick else ba.FULL_AGENTS)
        result["workloads"]["agents"] = ba.run_agents_workload(engine, agent_sizes, tick, lambda f: _on_engine(engine, f))
    if "longctx" in workloads:
        from parallm_bench import longctx as bl

        tick("longctx: parallm")
        longctx_sizes = longctx_sizes or (bl.QUICK_LONGCTX if quick else bl.FULL_LONGCTX)
        result["workloads"]["longctx"] = bl.run_longctx(engine, longctx_sizes)
    if "paths" in workloads:
        from parallm_bench import paths as bp

        tick("paths: fan-out on the native and the pure-MLX path")
        n, prefix, new = (8, 128, 8) if quick else (32, 512, 32)
        result["workloads"]["paths"] = bp.run_paths(engine.model_info.source, engine.model_info.vocab_size,
                                                    n=n, prefix_len=prefix, new_tokens=new)
    if "arrival" in workloads:
        from parallm_bench import paths as bp

        tick("arrival: streams while a long prompt arrives, then short ones")
        streams, long_prompt, new, shorts = (2, 600, 40, 2) if quick else (8, 6000, 160, 4)
        result["workloads"]["arrival"] = bp.run_arrival(engine, streams, long_prompt, new, shorts=shorts)
    if "memory" in workloads:
        from parallm_bench import memory as bm

        result["workloads"]["memory"] = bm.run_memory_workload(
            engine, memory_sizes or (bm.QUICK_MEMORY if quick else bm.FULL_MEMORY), tick)
    if "preempt" in workloads:  # a second engine of the same model under a tight KV budget
        from parallm_bench import preemption as bpre

        result["workloads"]["preempt"] = bpre.run_preempt(engine, bpre.QUICK_PREEMPT if quick else bpre.FULL_PREEMPT,
                                                          tick)
    if "spec" in workloads:
        from parallm_bench import spec as bs

        result["workloads"]["spec"] = bs.run_spec(engine, bs.QUICK_SPEC if quick else bs.FULL_SPEC, tick)
    if "constrained" in workloads:  # grammar-constrained rows in the batch (sampling.constrained)
        from parallm_bench import constrained as bc

        tick("constrained: JSON-schema rows vs free rows")
        n, new = bc.QUICK_CONSTRAINED if quick else bc.FULL_CONSTRAINED
        result["workloads"]["constrained"] = bc.run_constrained_bench(engine, n, new)
    if "vision" in workloads:  # its own random VLM on an engine of its own (the loaded model is not one)
        from parallm_bench import vision as bv

        result["workloads"]["vision"] = bv.run_vision(bv.QUICK_VISION if quick else bv.FULL_VISION, tick)
    if "embed" in workloads:  # its own random embedding model on an engine of its own (bench_embed)
        from parallm_bench import embed as be

        result["workloads"]["embed"] = be.run_embed(be.QUICK_EMBED if quick else be.FULL_EMBED, tick,
                                                    backend=engine.backend.name)

    if "rerank" in workloads:  # its own random decoder reranker on an engine of its own (bench_rerank)
        from parallm_bench import rerank as brr

        result["workloads"]["rerank"] = brr.run_rerank(brr.QUICK_RERANK if quick else brr.FULL_RERANK, tick,
                                                       backend=engine.backend.name)
    if "restart" in workloads:  # the disk tier across processes (fresh processes of the same model)
        from parallm_bench import restart as brs

        result["workloads"]["restart"] = brs.run_restart(engine, brs.QUICK_RESTART if quick else brs.FULL_RESTART,
                                                         tick)
    if "sessions" in workloads:  # fresh engines of the same model under a KV budget a third of the trace's
        from parallm_bench import sessions as bss

        result["workloads"]["sessions"] = bss.run_sessions(engine, bss.QUICK_SESSIONS if quick else bss.FULL_SESSIONS,
                                                           tick)
    if "programs" in workloads:  # fresh engines of the same model, FIFO vs programs; mlx-lm on the loaded weights
        from parallm_bench import programs as bpr

        result["workloads"]["programs"] = bpr.run_programs(
            engine, bpr.QUICK_PROGRAMS if quick else bpr.FULL_PROGRAMS, tick, lambda f: _on_engine(engine, f))
    if "observe" in workloads:  # the live page watched and spans on vs both off, alternating (bench_observe)
        from parallm_bench import observe as bench_observe

        result["workloads"]["observe"] = bench_observe.run_observe(engine, sz, tick)
    if "curve" in workloads:  # TPOT vs aggregate tok/s at concurrency 1..64, ParaLLM (both paths) and mlx-lm
        from parallm_bench import curve as bench_curve

        sizes = bench_curve.QUICK_CURVE if quick else bench_curve.FULL_CURVE
        result["workloads"]["curve"] = bench_curve.run_curve(engine, sizes, tick)
    if "lora" in workloads:  # 4 random adapters on the loaded model, mixed in one batch vs base-only
        from parallm_bench import lora as bench_lora

        result["workloads"]["lora"] = bench_lora.run_lora(engine, bench_lora.QUICK_LORA if quick else bench_lora.FULL_LORA, tick)
    return result


def _without_prefix_cache(engine, prompts, new_tokens) -> dict:
    """The same fan-out on a second engine (same weights) with the radix cache disabled."""
    from parallm_engine.core.engine import Engine

    other = Engine(engine.model_info.path, max_batch_size=engine.config.max_batch_size, enable_prefix_cache=False)
    try:
        other.generate([[300, 301]], max_tokens=2, temperature=0)
        return run_parallm(other, prompts, new_tokens)
    finally:
        other.shutdown()


def _on_engine(engine, fn):
    """Baselines run on the engine thread too (idle meanwhile): same MLX stream, nothing else running. On a
    GPU MLX's buffer cache is emptied first, so the baseline can allocate what the engine freed (on the CPU
    the cache stays: emptying it would make the baseline's first step fault its memory in again)."""
    def run():
        if engine.backend.device != "cpu":
            mx.clear_cache()
        return fn()

    return engine.run_on_engine_thread(run)


def _env(engine, quick: bool) -> dict:
    from parallm_engine.runner.backend import backend_info, cpu_features

    info = backend_info()
    vendor, flags = cpu_features()
    return {
        "backend": info.as_dict(),
        "cpu": {"vendor": vendor, "model": _cpu_model(), "avx512": "avx512f" in flags, "cores": os.cpu_count()},
        "model": engine.model_name,
        "model_dtype": engine.model_info.dtype,
        "weights_dtype": engine.backend.dtype,
        "platform": platform.platform(),
        "processor": platform.processor(),
        "quick": quick,
        "engine_path": engine.backend.name,
        "decode_lanes": engine.config.decode_lanes,
        "cpu_kernels": bool(engine._scheduler.runner.cpu_kernels),
        "native_kernels": engine._scheduler.native_kernels,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor()


_OWN_FORMAT = {"llamacpp": "llamacpp", "agents": "agents", "agents_ray": "ray_agents", "longctx": "longctx",
               "paths": "paths", "arrival": "paths", "memory": "memory", "preempt": "preemption",
               "spec": "spec", "constrained": "constrained", "vision": "vision", "embed": "embed", "lora": "lora",
               "restart": "restart", "sessions": "sessions", "rerank": "rerank",
               "programs": "programs", "curve": "curve", "observe": "observe"}


def format_table(result: dict) -> str:
    from io import StringIO

    from rich.console import Console
    from rich.table import Table

    buf = StringIO()
    console = Console(file=buf, width=140)
    shape = result.get("env", {}).get("shape")
    if shape:
        console.print(f"model: the {shape['name']} shape, random weights, {shape['layers_kept']} of "
                      f"{shape['layers_full']} layers kept", highlight=False)
    env = result.get("env", {})
    path = env.get("engine_path")
    if path:
        sizes = env.get("sizes") or {}
        console.print(f"engine path: {PATH_TITLES.get(path, path)}"
                      + (f"; {sizes['n']} concurrent, {sizes['prompt_len']}-token prompts" if sizes else ""),
                      highlight=False)
    table = Table(title="parallm bench (aggregate tok/s; ratios = ParaLLM / baseline, same run)")
    for col in ("workload", "system", "reqs", "tok/s", "wall s", "TTFT p50", "TTFT p95", "ITL p50", "ITL p95",
                "prefill tok", "peak MB"):
        table.add_column(col, justify="right")
    for name, entry in result["workloads"].items():
        if name in ("roofline", *_OWN_FORMAT) or "skipped" in entry:
            continue
        for system, s in entry.items():
            if system == "ratios" or not isinstance(s, dict) or "tok_s" not in s:  # a system's row only
                continue
            table.add_row(name, system, str(s["requests"]), f"{s['tok_s']:.1f}", f"{s['wall_s']:.1f}",
                          f"{s['ttft_p50_s']:.3f}", f"{s['ttft_p95_s']:.3f}", f"{s['itl_p50_s']:.3f}",
                          f"{s['itl_p95_s']:.3f}", str(s["prefill_tokens"]), f"{s['peak_mem_mb']:.0f}")
    if table.row_count:
        console.print(table)
    for name, module in _OWN_FORMAT.items():  # workloads with shapes of their own: a few lines each
        if name in result["workloads"] and "skipped" not in result["workloads"][name]:
            import importlib

            for line in importlib.import_module(f".{module}", __package__).format_lines(result["workloads"][name]):
                console.print(line, highlight=False, soft_wrap=True)
    for name, entry in result["workloads"].items():
        if entry.get("ratios"):  # below the table: a row would truncate them
            console.print(f"{name} ratios: " + ", ".join(f"{k}={v}x" for k, v in entry["ratios"].items()))
    for name, entry in result["workloads"].items():
        steps = entry.get("parallm", {}).get("step_ms") if isinstance(entry.get("parallm"), dict) else None
        if steps:  # host work per step beside the device wait: what a GPU's short step would expose
            console.print(f"{name} ParaLLM step ms: plan {steps['plan']:.2f}, prefill {steps['prefill']:.1f}, "
                          f"decode host {steps['decode_host']:.1f}, device wait {steps['device_wait']:.1f} "
                          f"(launch {steps.get('launch', 0):.1f}) "
                          f"(host share {steps['host_share']:.0%})", highlight=False)
    for name, entry in result["workloads"].items():
        if "skipped" in entry:
            console.print(f"{name}: skipped ({entry['skipped']})")
    roof = result["workloads"].get("roofline")
    if roof:
        b = [k for k in roof if k.startswith("decode_b") and k.endswith("_gflops") and k != "decode_b1_weight_gbps"][0]
        console.print(
            f"roofline: {b} = {roof[b]} GFLOP/s vs numpy GEMM {roof['gemm_gflops']} GFLOP/s "
            f"({roof['flops_fraction']:.0%}); batch-1 weights {roof['decode_b1_weight_gbps']} GB/s vs memory "
            f"{roof['memory_gbps']} GB/s ({roof['bandwidth_fraction']:.0%})")
    return buf.getvalue()


def main(args) -> int:
    """`parallm bench` (the command line's options: ``bench_cli``)."""
    from parallm_bench.cli import main as bench_main

    return bench_main(args)
