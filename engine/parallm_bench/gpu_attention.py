"""Device microbenchmarks for the pure-MLX path on a GPU: `python -m parallm_bench.gpu_attention`.

1. Decode attention over page pools: the CUDA kernel (``runner/gpu_attention``: reads each key where it is)
   vs what the engine does without it (gather each row's working set from the pool, then MLX's fused SDPA)
   vs MLX's SDPA alone on an already-contiguous working set (the floor the gather adds to). Head shapes of
   Qwen3-4B (32 query / 8 KV heads of 128) and the default model (9 / 3 of 64), bf16, 8 / 32 / 64 rows x
   1,000 / 4,000 tokens, pages in shuffled order. Each time is the median of 5 evaluations of 20 calls.
2. Does a write into a page pool copy the pool while a step that reads it is still in flight
   (``mx.async_eval``)? MLX writes in place only when nothing pending reads the array; the engine's
   pipelined decode relies on the in-flight step not counting. Times a 64-slot write into a 1 GiB pool
   alone, behind an in-flight reader, and behind a lazy (unevaluated) reader (the reader's own time,
   ``reader_alone``, is part of the middle one: the write waits for it on the same stream).

Prints one table per part; ``--json`` writes the numbers. Needs MLX's CUDA backend for part 1's kernel
column (elsewhere that column is skipped); part 2 runs on any backend.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


def _time(fn, reps: int = 5) -> float:
    import mlx.core as mx

    mx.eval(fn())  # warm-up: compilation, allocation
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def attention_table(calls: int = 20, rows=(8, 32, 64), tokens=(1000, 4000)) -> list[dict]:
    import mlx.core as mx

    from parallm_engine.kv.table_reads import read_table, table_index
    from parallm_engine.runner import gpu_attention

    table_rows = []
    kernel = gpu_attention.available()
    for name, (H, KH, D) in (("qwen3-4b", (32, 8, 128)), ("smollm2-135m", (9, 3, 64))):
        for B in rows:
            for T in tokens:
                rng = np.random.default_rng(B * T)
                page = 16
                S = B * T + page
                order = rng.permutation(np.arange(1, S // page))[: B * T // page]
                table = (order[:, None] * page + np.arange(page)).reshape(B, T).astype(np.int32)
                k = mx.random.normal((KH, S, D)).astype(mx.bfloat16)
                v = mx.random.normal((KH, S, D)).astype(mx.bfloat16)
                qs = [mx.random.normal((B, H, 1, D)).astype(mx.bfloat16) for _ in range(calls)]
                tab = mx.array(table)
                starts = mx.zeros((B,), dtype=mx.int32)
                idx = table_index(tab, KH, S)
                kw, vw = read_table(k, idx), read_table(v, idx)
                mx.eval(k, v, qs, kw, vw)
                scale = D ** -0.5

                def gather_sdpa():
                    out = []
                    for q in qs:
                        i = table_index(tab, KH, S)
                        out.append(mx.fast.scaled_dot_product_attention(q, read_table(k, i), read_table(v, i),
                                                                        scale=scale))
                    return out

                def sdpa_only():
                    return [mx.fast.scaled_dot_product_attention(q, kw, vw, scale=scale) for q in qs]

                def paged_kernel():
                    return [gpu_attention.attention(q, k, v, tab, starts, scale) for q in qs]

                entry = {"shape": name, "rows": B, "tokens": T,
                         "gather_sdpa_ms": _time(gather_sdpa) / calls * 1e3,
                         "sdpa_only_ms": _time(sdpa_only) / calls * 1e3}
                if kernel:
                    ref = mx.fast.scaled_dot_product_attention(qs[0], kw, vw, scale=scale).astype(mx.float32)
                    got = gpu_attention.attention(qs[0], k, v, tab, starts, scale).astype(mx.float32)
                    entry["rel_err"] = float(mx.sqrt(mx.sum((got - ref) ** 2) / mx.sum(ref ** 2)).item())
                    entry["kernel_ms"] = _time(paged_kernel) / calls * 1e3
                    kv_bytes = 2 * B * T * KH * D * 2
                    entry["kernel_GBps"] = kv_bytes / (entry["kernel_ms"] / 1e3) / 1e9
                    entry["speedup_vs_gather"] = entry["gather_sdpa_ms"] / entry["kernel_ms"]
                table_rows.append(entry)
    return table_rows


def shared_prefix_table(calls: int = 20, rows=(8, 32, 64), prefixes=(512, 2000), own: int = 128) -> list[dict]:
    """A fan-out's decode attention (Qwen3-4B heads, bf16): every row continues a shared prefix of P tokens
    and has ``own`` tokens of its own in the pool. The kernel reading the prefix itself (one launch) vs the
    kernel for the own part merged with the prefix read once by MLX ops (the cascade) vs what the engine does
    without the kernel (gather the own part, the MLX-op cascade)."""
    import os

    import mlx.core as mx

    from parallm_engine.kv.table_reads import read_table, table_index
    from parallm_engine.runner import cpu_kernels, gpu_attention

    H, KH, D = 32, 8, 128
    out = []
    for B in rows:
        for P in prefixes:
            rng = np.random.default_rng(B * P)
            page = 16
            S = B * own + page
            order = rng.permutation(np.arange(1, S // page))[: B * own // page]
            tab = mx.array((order[:, None] * page + np.arange(page)).reshape(B, own).astype(np.int32))
            k = mx.random.normal((KH, S, D)).astype(mx.bfloat16)
            v = mx.random.normal((KH, S, D)).astype(mx.bfloat16)
            sk = mx.random.normal((1, KH, P, D)).astype(mx.bfloat16)
            sv = mx.random.normal((1, KH, P, D)).astype(mx.bfloat16)
            qs = [mx.random.normal((B, H, 1, D)).astype(mx.bfloat16) for _ in range(calls)]
            starts = mx.zeros((B,), dtype=mx.int32)
            mx.eval(k, v, sk, sv, qs)
            scale = D ** -0.5

            def with_env(how):
                def run():
                    os.environ["PARALLM_GPU_SHARED_PREFIX"] = how
                    return [gpu_attention.attention(q, k, v, tab, starts, scale, sk, sv, None) for q in qs]
                return run

            def gather_cascade():
                res = []
                for q in qs:
                    i = table_index(tab, KH, S)
                    res.append(cpu_kernels.cascade_attention(q, read_table(k, i), read_table(v, i), sk, sv, scale,
                                                             None, None))
                return res

            entry = {"rows": B, "prefix": P, "own": own,
                     "gather_cascade_ms": _time(gather_cascade) / calls * 1e3}
            if gpu_attention.available():
                entry["kernel_cascade_ms"] = _time(with_env("cascade")) / calls * 1e3
                entry["kernel_shared_ms"] = _time(with_env("kernel")) / calls * 1e3
                a = with_env("kernel")()[0].astype(mx.float32)
                b = with_env("cascade")()[0].astype(mx.float32)
                entry["rel_diff"] = float(mx.sqrt(mx.sum((a - b) ** 2) / mx.sum(b ** 2)).item())
            os.environ.pop("PARALLM_GPU_SHARED_PREFIX", None)
            out.append(entry)
    return out


def pool_write_check() -> dict:
    import mlx.core as mx

    KH, S, D = 8, 1 << 19, 128  # 1 GiB of bf16
    pool = mx.random.normal((KH, S, D)).astype(mx.bfloat16)
    mx.eval(pool)
    slots = mx.array(np.arange(64, dtype=np.int32) * 97)
    new = mx.ones((KH, 64, D), dtype=mx.bfloat16)
    idx = mx.array(np.random.default_rng(0).integers(0, S, size=(S // 4,)).astype(np.int32))
    out = {}

    def write():
        pool[:, slots] = new
        t0 = time.perf_counter()
        mx.eval(pool)
        mx.synchronize()
        return time.perf_counter() - t0

    def reader_alone():
        t0 = time.perf_counter()
        mx.eval((pool[:, idx].astype(mx.float32) * 2).sum())
        mx.synchronize()
        return time.perf_counter() - t0

    out["reader_alone_ms"] = statistics.median([reader_alone() for _ in range(5)]) * 1e3
    for label in ("alone", "behind_in_flight_reader", "behind_lazy_reader"):
        times = []
        for _ in range(5):
            reader = None
            if label == "behind_in_flight_reader":
                reader = (pool[:, idx].astype(mx.float32) * 2).sum()
                mx.async_eval(reader)
            elif label == "behind_lazy_reader":
                reader = (pool[:, idx].astype(mx.float32) * 2).sum()
            times.append(write())
            if reader is not None:
                mx.eval(reader)
        out[f"{label}_ms"] = statistics.median(times) * 1e3
    return out


def main() -> int:
    import parallm_engine  # noqa: F401  (preloads BLAS before mlx)
    import mlx.core as mx

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the numbers here")
    ap.add_argument("--part", choices=("all", "attention", "shared", "write"), default="all")
    args = ap.parse_args()
    result = {"device": str(mx.default_device())}
    if args.part in ("all", "write"):
        result["pool_write"] = pool_write_check()
        print("pool write (64 slots into a 1 GiB pool), ms:", json.dumps({k: round(v, 3) for k, v in result["pool_write"].items()}))
    if args.part in ("all", "attention"):
        result["attention"] = attention_table()
        print(f"{'shape':13} {'rows':>4} {'tokens':>6} {'gather+sdpa':>11} {'sdpa only':>9} {'kernel':>8} {'GB/s':>6} {'x gather':>8} {'rel err':>8}")
        for e in result["attention"]:
            print(f"{e['shape']:13} {e['rows']:4d} {e['tokens']:6d} {e['gather_sdpa_ms']:9.3f}ms {e['sdpa_only_ms']:7.3f}ms "
                  f"{e.get('kernel_ms', float('nan')):6.3f}ms {e.get('kernel_GBps', float('nan')):6.0f} "
                  f"{e.get('speedup_vs_gather', float('nan')):8.2f} {e.get('rel_err', float('nan')):8.1e}")
    if args.part in ("all", "shared"):
        result["shared_prefix"] = shared_prefix_table()
        print(f"{'rows':>4} {'prefix':>6} {'gather+cascade':>14} {'kernel+cascade':>14} {'kernel, prefix in it':>20} {'rel diff':>8}")
        for e in result["shared_prefix"]:
            print(f"{e['rows']:4d} {e['prefix']:6d} {e['gather_cascade_ms']:12.3f}ms "
                  f"{e.get('kernel_cascade_ms', float('nan')):12.3f}ms {e.get('kernel_shared_ms', float('nan')):18.3f}ms "
                  f"{e.get('rel_diff', float('nan')):8.1e}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
