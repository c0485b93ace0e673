"""The ``roofline`` workload of `parallm bench`: how close the engine's decode step comes to this machine's
limits, all measured in the same run: decode-step FLOP/s at batch 64 vs numpy's fp32 GEMM FLOP/s, and
the weight bytes/s of a batch-1 step vs a measured memory copy."""

from __future__ import annotations

import random
import time

import mlx.core as mx
import numpy as np


def _numpy_gemm_gflops(n: int = 2048, reps: int = 3) -> float:
    a = np.random.rand(n, n).astype(np.float32)
    b = np.random.rand(n, n).astype(np.float32)
    a @ b
    best = 1e9
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


def _memory_gbps(nbytes: int = 512 << 20, reps: int = 3) -> float:
    src = np.ones(nbytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    best = 1e9
    for _ in range(reps):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best / 1e9  # read + write


def _decode_step_time(engine, batch: int, context: int, steps: int = 8) -> float:
    """Seconds per decode step of the engine's own batch path (its lanes and kernels) at this batch
    size and context."""
    from parallm_engine.runner import cpu_kernels
    from parallm_engine.kv.decode_batch import DecodeBatch
    from parallm_engine.runner.batch_forward import BatchForward
    from parallm_bench.sequence_kv import SequenceKV
    from parallm_engine.kv.paged_prefill import PrefillRow

    class _Row:  # a sequence as DecodeBatch places and joins it
        cache = None

    def work():
        model = engine.model
        n_layers = len(model.layers)
        rng = random.Random(batch)
        seq = [SequenceKV() for _ in range(n_layers)]
        model(mx.array([[rng.randrange(200, 40000) for _ in range(context)]]), cache=seq)
        kv = [(c.keys[..., : c.offset, :], c.values[..., : c.offset, :]) for c in seq]
        mx.eval(kv)
        rows = DecodeBatch(n_layers, engine.config.decode_lanes)
        joining = [_Row() for _ in range(batch)]
        for r in joining:  # each row's context written into its lane's pages, as a prefill does
            lane = rows.place(r, 0)
            with lane.context():
                r.cache = PrefillRow(lane, lane.kv.open_row(np.zeros(0, dtype=np.int32), kv), 0)
        rows.join(joining)
        forwards = BatchForward(rows)
        toks = mx.array([5] * batch)
        best = 1e9
        with cpu_kernels.enabled(bool(engine._scheduler.runner.cpu_kernels)):
            for i in range(steps + 2):
                t = time.perf_counter()
                y = mx.argmax(forwards.forward(model, toks), axis=-1)
                mx.eval(y)
                y.tolist()
                if i >= 2:
                    best = min(best, time.perf_counter() - t)
        return best

    return engine.run_on_engine_thread(work)


def run_roofline(engine, batch: int) -> dict:
    from mlx.utils import tree_flatten

    params = sum(v.size for _, v in tree_flatten(engine.model.parameters()))
    nbytes = sum(v.nbytes for _, v in tree_flatten(engine.model.parameters()))
    t64 = _decode_step_time(engine, batch, 128)
    t1 = _decode_step_time(engine, 1, 128)
    gemm = _numpy_gemm_gflops()
    bw = _memory_gbps()
    flops = 2 * params * batch / t64 / 1e9
    wbps = nbytes / t1 / 1e9
    return {
        "params": params,
        "weight_bytes": nbytes,
        f"decode_b{batch}_step_s": round(t64, 4),
        f"decode_b{batch}_gflops": round(flops, 1),
        "gemm_gflops": round(gemm, 1),
        "flops_fraction": round(flops / gemm, 3),
        "decode_b1_step_s": round(t1, 4),
        "decode_b1_weight_gbps": round(wbps, 2),
        "memory_gbps": round(bw, 2),
        "bandwidth_fraction": round(wbps / bw, 3),
    }
