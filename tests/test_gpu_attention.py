"""The CUDA paged decode attention (runner/gpu_attention.py) against the gather + softmax it replaces.

On CUDA (the device check, scripts/gpu_check) the kernel itself is compared with a float64 reference
(numpy, on the host: MLX's GPU matmul may round float32 to TF32) on fresh random pools, tables and lengths,
for the head shapes of the default model (64-dim heads, 3 query heads per KV head), Qwen3-4B (128, 4) and
Gemma 3 (256, 2), in every float dtype, with and without a shared prefix. Everywhere the exact merge of a
row's own part with the shared prefix's part is checked against the float64 reference and the engine's
MLX-op cascade, and the engine's decode steps run through the same seam with the kernel's contract computed
by MLX ops (the kernel is skipped off CUDA)."""

from __future__ import annotations

import numpy as np
import pytest

import parallm_engine  # noqa: F401  (preloads BLAS before mlx)
import mlx.core as mx

from parallm_engine.runner import cpu_kernels, gpu_attention
from parallm_engine.kv.table_reads import read_table, table_index

LOG2E = gpu_attention.LOG2E


def _case(rng, B, H, KH, D, dtype, P=0):
    """Random pools of 4x the slots the rows need, a shuffled slot table (left-padded: padding reads slot 0),
    lengths 1..T, queries; a shared prefix of P tokens when P."""
    lengths = rng.integers(1, 70, size=B)
    lengths[rng.integers(0, B)] = 70  # the longest row fills the table
    T = int(lengths.max())
    S = 4 * int(lengths.sum()) + 16
    slots = rng.permutation(np.arange(1, S))[: int(lengths.sum())]
    table = np.zeros((B, T), dtype=np.int32)
    at = 0
    for b, L in enumerate(lengths):
        table[b, T - L:] = slots[at: at + L]
        at += L
    k = mx.array(rng.standard_normal((KH, S, D)).astype(np.float32)).astype(dtype)
    v = mx.array(rng.standard_normal((KH, S, D)).astype(np.float32)).astype(dtype)
    q = mx.array(rng.standard_normal((B, H, 1, D)).astype(np.float32)).astype(dtype)
    starts = mx.array((T - lengths).astype(np.int32))
    shared = None
    if P:
        sk = mx.array(rng.standard_normal((1, KH, P, D)).astype(np.float32)).astype(dtype)
        sv = mx.array(rng.standard_normal((1, KH, P, D)).astype(np.float32)).astype(dtype)
        use = rng.random(B) < 0.7
        use[0] = True
        shared = (sk, sv, mx.array(use))
    return q, k, v, mx.array(table), starts, lengths, shared


def _f64(x) -> np.ndarray:
    return np.array(x.astype(mx.float32)).astype(np.float64)


def _reference(q, k, v, table, lengths, scale, shared=None):
    """Attention in float64 (numpy, on the CPU: a GPU matmul may round float32 inputs to TF32) over each
    row's own keys read through its table row (left padding skipped), after the shared prefix where the row
    continues it. (B, H, 1, D) float64."""
    q, k, v, table = _f64(q), _f64(k), _f64(v), np.array(table)
    B, H, _, D = q.shape
    KH, T = k.shape[0], table.shape[1]
    rep = H // KH
    out = np.zeros((B, H, 1, v.shape[-1]))
    for b in range(B):
        cols = table[b, T - int(lengths[b]):]
        for h in range(H):
            keys, vals = k[h // rep, cols], v[h // rep, cols]
            if shared is not None and bool(np.array(shared[2])[b]):
                keys = np.concatenate([_f64(shared[0])[0, h // rep], keys])
                vals = np.concatenate([_f64(shared[1])[0, h // rep], vals])
            s = keys @ q[b, h, 0] * scale
            p = np.exp(s - s.max())
            out[b, h, 0] = p @ vals / p.sum()
    return out


def _own_reference(q, k, v, table, lengths, scale):
    """(out, lse in log2 units) over each row's own keys: the kernel's contract, in MLX ops."""
    B, H, _, D = q.shape
    KH = k.shape[0]
    T = table.shape[1]
    idx = table_index(table, KH, k.shape[1])
    kw, vw = read_table(k.astype(mx.float32), idx), read_table(v.astype(mx.float32), idx)
    qs = (q.astype(mx.float32) * (scale * LOG2E)).reshape(B, KH, H // KH, D)
    s = qs @ kw.swapaxes(-1, -2)  # (B, KH, rep, T)
    valid = (mx.arange(T)[None, :] >= mx.array(T - lengths)[:, None])[:, None, None, :]
    s = mx.where(valid, s, -mx.inf)
    m = mx.max(s, axis=-1, keepdims=True)
    e = mx.power(2.0, s - m)
    den = mx.sum(e, axis=-1, keepdims=True)
    out = (e @ vw) / den
    return out.reshape(B, H, 1, D), (m + mx.log2(den)).reshape(B, H)


def _rel(a, b) -> float:
    a = _f64(a) if isinstance(a, mx.array) else a
    b = _f64(b) if isinstance(b, mx.array) else b
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _lse_reference(q, k, table, lengths, scale, shared=None) -> np.ndarray:
    """(B, H) log2-sum-exp of each row's scores (the shared prefix's first where the row continues it), float64."""
    q, k, table = _f64(q), _f64(k), np.array(table)
    B, H = q.shape[:2]
    KH, T = k.shape[0], table.shape[1]
    out = np.zeros((B, H))
    for b in range(B):
        cols = table[b, T - int(lengths[b]):]
        for h in range(H):
            keys = k[h // (H // KH), cols]
            if shared is not None and bool(np.array(shared[2])[b]):
                keys = np.concatenate([_f64(shared[0])[0, h // (H // KH)], keys])
            s = keys @ q[b, h, 0] * scale * LOG2E
            out[b, h] = s.max() + np.log2(np.exp2(s - s.max()).sum())
    return out


@pytest.mark.parametrize("P", [0, 37])
@pytest.mark.parametrize("heads", [(9, 3, 64), (32, 8, 128), (8, 4, 256)])
def test_merge_with_shared_prefix_equals_cascade(heads, P):
    """The kernel's contract (own part as out + log2-sum-exp) merged with the shared prefix read once is
    the engine's cascade attention over prefix + own keys."""
    H, KH, D = heads
    rng = np.random.default_rng(H * 1000 + P)
    q, k, v, table, starts, lengths, shared = _case(rng, 5, H, KH, D, mx.float32, P)
    scale = D ** -0.5
    own = _own_reference(q, k, v, table, lengths, scale)
    out = own[0] if shared is None else gpu_attention.merge(own, gpu_attention.shared_part(q, *shared[:2], scale, shared[2]))
    assert _rel(out, _reference(q, k, v, table, lengths, scale, shared)) < 1e-5
    if shared is not None:  # and the engine's own MLX-op cascade over the gathered working set agrees
        idx = table_index(table, KH, k.shape[1])
        mask = (mx.arange(table.shape[1])[None, :] >= mx.array(table.shape[1] - lengths)[:, None])[:, None, None, :]
        cascade = cpu_kernels.cascade_attention(q, read_table(k, idx), read_table(v, idx), shared[0], shared[1],
                                                scale, mask, shared[2])
        assert _rel(out, cascade) < 1e-5


def test_off_the_gpu_it_is_never_used():
    if gpu_attention.available():
        pytest.skip("MLX runs on CUDA here")
    from parallm_engine.kv.kv_pages import PagedLaneKV

    lane = PagedLaneKV(1)
    lane.add([[(mx.ones((1, 2, 3, 32)), mx.ones((1, 2, 3, 32)))]])
    lane.begin(1, native=None, native_reads=True)
    assert not lane.native_reads  # the working set is gathered (MLX's SDPA reads it)


needs_cuda = pytest.mark.skipif(not gpu_attention.available(), reason="the kernel runs on MLX's CUDA backend only")

TOL = {mx.float32: 1e-5, mx.float16: 2e-3, mx.bfloat16: 1e-2}


@needs_cuda
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("P", [0, 53])
@pytest.mark.parametrize("heads", [(9, 3, 64), (32, 8, 128), (8, 4, 256), (4, 4, 32)])
def test_kernel_matches_attention(heads, P, dtype, monkeypatch):
    H, KH, D = heads
    for trial in range(3):  # fresh inputs each time: the same function on any valid input
        rng = np.random.default_rng([H, D, P, trial])
        q, k, v, table, starts, lengths, shared = _case(rng, int(rng.integers(1, 12)), H, KH, D, dtype, P)
        scale = D ** -0.5
        ref = _reference(q, k, v, table, lengths, scale, shared)
        for how in ("kernel", "cascade") if shared else ("kernel",):  # the prefix in the kernel or merged after
            monkeypatch.setenv("PARALLM_GPU_SHARED_PREFIX", how)
            out = gpu_attention.attention(q, k, v, table, starts, scale, *(shared or (None, None, None)))
            assert out.shape == q.shape and out.dtype == q.dtype
            assert not np.isnan(np.array(out.astype(mx.float32))).any()
            assert _rel(out, ref) < TOL[dtype], (heads, P, dtype, trial, how)
        # the log2-sum-exp the merge relies on (with the prefix: the whole row's)
        _, lse = gpu_attention.paged_decode(q, k, v, table, starts, scale)
        assert _rel(lse, _lse_reference(q, k, table, lengths, scale)) < TOL[dtype]
        if shared is not None:
            _, lse = gpu_attention.paged_decode(q, k, v, table, starts, scale, shared)
            assert _rel(lse, _lse_reference(q, k, table, lengths, scale, shared)) < TOL[dtype]


def _float32_model(root):
    """A 2-layer float32 llama with 64-dim heads (2 query heads per KV head)."""
    from .conftest import write_tiny_llama

    return write_tiny_llama(root / "m64", hidden_size=256, intermediate_size=512, head_dim=64,
                            max_position_embeddings=1024)


def _engine_tokens(model_dir) -> list[list[int]]:
    """Greedy tokens of unrelated prompts, then of a fan-out of six over a cached 150-token prefix (the batch
    then holds it once as its shared prefix: the seam's merge runs) beside an unrelated prompt."""
    from parallm_engine import Engine

    prefix = [400 + (i * 7) % 300 for i in range(150)]
    eng = Engine(str(model_dir), max_batch_size=8, decode_lanes=1)
    try:
        out = [r.token_ids for r in eng.generate([[300 + i for i in range(n)] for n in (5, 17, 40, 3)],
                                                 max_tokens=12, temperature=0, ignore_eos=True)]
        eng.generate([prefix + [9]], max_tokens=2, temperature=0, ignore_eos=True)
        fan = [prefix + [20 + i, 30 + i] for i in range(6)] + [[700, 701, 702]]
        out += [r.token_ids for r in eng.generate(fan, max_tokens=10, temperature=0, ignore_eos=True)]
        assert eng.stats()["memory"].get("kv_written_bytes", 1) >= 0
        return out
    finally:
        eng.shutdown()


def test_engine_through_the_pool_reading_seam(tmp_path, monkeypatch):
    """The engine's decode steps through the seam the CUDA kernel takes (the attention hook reads the pool
    through the slot table, each row from its first column, merged with the shared prefix), with the kernel's
    contract computed by MLX ops, give the same greedy tokens as the gathered working set. Runs on any
    backend: it checks the wiring (tables, first columns, the merge, the pools as stand-ins), the kernel
    itself is checked on CUDA below."""
    monkeypatch.setenv("PARALLM_BACKEND", "cpu-mlx")
    model_dir = _float32_model(tmp_path)
    monkeypatch.setattr(gpu_attention, "available", lambda: False)  # the gathered working set
    expected = _engine_tokens(model_dir)
    calls = []

    def contract(queries, kpool, vpool, table, starts, scale, shared=None, out_dtype=mx.float32):
        calls.append((queries.shape[0], shared is not None))
        B, T = table.shape
        own = _own_reference(queries, kpool[0] if kpool.ndim == 4 else kpool,
                             vpool[0] if vpool.ndim == 4 else vpool, table, T - starts, scale)
        if shared is None:
            return own[0].astype(out_dtype), own[1]
        part = gpu_attention.shared_part(queries, shared[0], shared[1], scale, shared[2])
        both = mx.maximum(own[1], part[1])
        lse = both + mx.log2(mx.power(2.0, own[1] - both) + mx.power(2.0, part[1] - both))
        return gpu_attention.merge(own, part).astype(out_dtype), lse

    monkeypatch.setattr(gpu_attention, "available", lambda: True)
    monkeypatch.setattr(gpu_attention, "paged_decode", contract)
    for how in ("kernel", "cascade"):  # the shared prefix inside the kernel's call, or merged by MLX ops
        monkeypatch.setenv("PARALLM_GPU_SHARED_PREFIX", how)
        calls.clear()
        assert _engine_tokens(model_dir) == expected, how
        assert calls and max(n for n, _ in calls) >= 6  # the fan-out's rows decoded through it
        assert any(with_shared for _, with_shared in calls) == (how == "kernel")


@needs_cuda
def test_engine_decode_uses_the_kernel_and_matches_the_gather(tmp_path, monkeypatch):
    """Greedy tokens with the kernel equal those with the gathered working set (same engine and weights, kernel
    off), and the kernel did run."""
    model_dir = _float32_model(tmp_path)
    calls = []
    real = gpu_attention.paged_decode
    monkeypatch.setattr(gpu_attention, "paged_decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    outs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("PARALLM_GPU_PAGED_ATTENTION", flag)
        gpu_attention.available.cache_clear()
        outs[flag] = _engine_tokens(model_dir)
        if flag == "1":
            assert calls, "the decode steps did not use the kernel"
            used = len(calls)
    assert len(calls) == used  # off means off
    gpu_attention.available.cache_clear()
    assert outs["1"] == outs["0"]
