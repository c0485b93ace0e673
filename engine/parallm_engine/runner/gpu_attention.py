"""Decode attention that reads the page pool through the slot table on CUDA (``mx.fast.cuda_kernel``).

Without it, a decode step on Metal / CUDA gathers every row's keys and values from the pool into a
(B, KV heads, T, D) working set per layer (``table_reads.read_table``) and hands that to MLX's fused SDPA:
one more read and write of all the rows' KV per step beside attention's own read, where decode is
memory-bound. This kernel reads each key and value once, where it is:

- one thread block per (row, KV head): the head's ``R`` query heads (GQA) are scored against each key
  in one pass, so a key is read once for all of them;
- the block's warps take the row's tokens in turn; a warp's 32 lanes each hold ``D / 32`` elements of a
  key (one coalesced load per token), the dot product is a warp reduction, the softmax is online (a
  running max, sum and weighted value per warp), and the warps' partial results are merged at the end;
- a row that continues the batch's shared prefix (``kv_cache.SharedPrefix``, contiguous (KH, P, D) arrays)
  reads its P keys first in the same loop: a fan-out's attention is one launch per layer. With
  ``PARALLM_GPU_SHARED_PREFIX=cascade`` the kernel covers only the rows' own keys and returns the
  log2-sum-exp per (row, head), and the prefix, read once for all rows by MLX ops (:func:`shared_part`),
  merges with it exactly (:func:`merge`): a dozen launches per layer more (``parallm_bench.gpu_attention
  --part shared`` times both).

It runs only for one position per row (a decode step: no ragged or multi-position step, where the
gathered working set and MLX's SDPA stay) on float pools (float32 / float16 / bfloat16; quantized KV
keeps the gather). It is on where MLX runs on CUDA unless ``PARALLM_GPU_PAGED_ATTENTION=0``; anywhere else
it is never used (MLX's Metal build has no ``cuda_kernel``; Metal would need its own kernel, untested).
The CUDA device check (``scripts/gpu_check``) compares it with the gather + SDPA on fresh random data
and times both; the numbers are in docs/benchmarks-archive.md.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np

from parallm_engine import settings

LOG2E = 1.4426950408889634
WARPS = 8  # warps per block: each takes every WARPS-th token of the row
# Head sizes the device check verified on an H100 (32, 64, 128, 256: float32 within 1e-5 of a float64
# reference, float16 / bfloat16 within their rounding, with and without a shared prefix). Larger heads keep
# the gathered path (the kernel holds D / 32 floats per lane and query head in registers).
MAX_HEAD_DIM = 256

_SOURCE = r"""
    constexpr int E = D / 32;
    const float QS = __int_as_float(QSCALE);  // the softmax scale times log2(e): scores in log2 units
    const int bk = blockIdx.x;
    const int b = bk / KH;
    const int kh = bk % KH;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int H = KH * R;
    const int Tm = table_shape[1];
    const long S = kpool_shape[1];
    const int start = starts[b];
    const float NEG_INF = __int_as_float(0xff800000);

    float qv[R][E];
    float m[R], l[R], acc[R][E];
    #pragma unroll
    for (int r = 0; r < R; ++r) {
        m[r] = NEG_INF;
        l[r] = 0.0f;
        #pragma unroll
        for (int e = 0; e < E; ++e) {
            qv[r][e] = static_cast<float>(q[((long)(b * H + kh * R + r)) * D + lane * E + e]) * QS;
            acc[r][e] = 0.0f;
        }
    }
    const T* kbase = kpool + (long)kh * S * D + lane * E;
    const T* vbase = vpool + (long)kh * S * D + lane * E;
    const int* trow = table + (long)b * Tm;
    //SHARED_SETUP
    const int n = P + Tm - start;  // the row's keys: the shared prefix's P (if it continues it), then its own
    for (int i = warp; i < n; i += NW) {
        const T* kp;
        const T* vp;
        //SHARED_PICK
        {
            const long slot = trow[start + i - P];
            kp = kbase + slot * D;
            vp = vbase + slot * D;
        }
        float kf[E], vf[E];
        #pragma unroll
        for (int e = 0; e < E; ++e) {
            kf[e] = static_cast<float>(kp[e]);
            vf[e] = static_cast<float>(vp[e]);
        }
        #pragma unroll
        for (int r = 0; r < R; ++r) {
            float s = 0.0f;
            #pragma unroll
            for (int e = 0; e < E; ++e) s += qv[r][e] * kf[e];
            #pragma unroll
            for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffff, s, o);
            const float mn = fmaxf(m[r], s);
            const float c = exp2f(m[r] - mn);
            const float p = exp2f(s - mn);
            l[r] = l[r] * c + p;
            #pragma unroll
            for (int e = 0; e < E; ++e) acc[r][e] = acc[r][e] * c + p * vf[e];
            m[r] = mn;
        }
    }

    __shared__ float sm_m[NW][R];
    __shared__ float sm_l[NW][R];
    __shared__ float sm_acc[NW][D];
    if (lane == 0) {
        #pragma unroll
        for (int r = 0; r < R; ++r) { sm_m[warp][r] = m[r]; sm_l[warp][r] = l[r]; }
    }
    __syncthreads();
    #pragma unroll
    for (int r = 0; r < R; ++r) {
        float M = NEG_INF;
        for (int w = 0; w < NW; ++w) M = fmaxf(M, sm_m[w][r]);
        const float cw = (m[r] == NEG_INF) ? 0.0f : exp2f(m[r] - M);
        #pragma unroll
        for (int e = 0; e < E; ++e) sm_acc[warp][lane * E + e] = acc[r][e] * cw;
        __syncthreads();
        for (int d = threadIdx.x; d < D; d += blockDim.x) {
            float L = 0.0f, a = 0.0f;
            for (int w = 0; w < NW; ++w) {
                if (sm_m[w][r] != NEG_INF) L += sm_l[w][r] * exp2f(sm_m[w][r] - M);
                a += sm_acc[w][d];
            }
            const long o = (long)(b * H + kh * R + r);
            out[o * D + d] = static_cast<TO>(a / L);
            if (d == 0) lse[o] = M + log2f(L);
        }
        __syncthreads();
    }
"""

# The shared prefix inside the kernel: a row that continues it (``sflag``) reads its P keys first, from the
# contiguous (KH, P, D) arrays, then its own through the table: one launch per layer, no merge. Every such
# row's block reads the prefix (from L2 after the first: it is a few MB per layer); the MLX-op cascade
# (``shared_part`` + ``merge``) reads it once from memory but costs a dozen launches per layer.
_SHARED_SETUP = """
    const int P = sflag[b] ? (int)sk_shape[1] : 0;
    const T* skbase = sk + (long)kh * sk_shape[1] * D + lane * E;
    const T* svbase = sv + (long)kh * sk_shape[1] * D + lane * E;"""
_SHARED_PICK = """
        if (i < P) {
            kp = skbase + (long)i * D;
            vp = svbase + (long)i * D;
        } else"""


def _source(shared: bool) -> str:
    if shared:
        return _SOURCE.replace("    //SHARED_SETUP", _SHARED_SETUP.strip("\n")).replace(
            "        //SHARED_PICK", _SHARED_PICK.strip("\n"))
    return _SOURCE.replace("    //SHARED_SETUP", "    const int P = 0;").replace("        //SHARED_PICK\n", "")


def enabled_by_env() -> bool:
    return settings.gpu_paged_attention()


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """Whether MLX runs on CUDA here (the kernel's only home) and the kernel is not turned off."""
    if not enabled_by_env():
        return False
    cuda = getattr(mx, "cuda", None)
    try:
        return bool(cuda is not None and cuda.is_available() and mx.default_device() == mx.gpu
                    and hasattr(mx.fast, "cuda_kernel"))
    except Exception:  # an MLX build without the CUDA backend
        return False


@functools.lru_cache(maxsize=2)
def _kernel(shared: bool):
    return mx.fast.cuda_kernel(
        name="parallm_paged_decode_shared" if shared else "parallm_paged_decode",
        input_names=["q", "kpool", "vpool", "table", "starts"] + (["sk", "sv", "sflag"] if shared else []),
        output_names=["out", "lse"],
        source=_source(shared),
    )


def shared_in_kernel() -> bool:
    """Whether a shared prefix is read inside the kernel (default) or by the MLX-op cascade
    (``PARALLM_GPU_SHARED_PREFIX=cascade``)."""
    return settings.gpu_shared_prefix() == "kernel"


def applies(queries: mx.array, kpool) -> bool:
    """Whether the kernel can take this call: one position per row, float pools, head size a multiple
    of 32 (each lane holds D / 32 elements) up to ``MAX_HEAD_DIM``."""
    return (queries.ndim == 4 and queries.shape[2] == 1 and isinstance(kpool, mx.array)
            and kpool.dtype in (mx.float32, mx.float16, mx.bfloat16) and queries.shape[-1] % 32 == 0
            and queries.shape[-1] <= MAX_HEAD_DIM and queries.shape[1] % kpool.shape[-3] == 0)


@functools.lru_cache(maxsize=16)
def _float_bits(x: float) -> int:
    """A float32's bits as an int (a template argument); cached: every layer of every step asks for one."""
    return int(np.array([x], dtype=np.float32).view(np.int32)[0])


def paged_decode(queries: mx.array, kpool: mx.array, vpool: mx.array, table: mx.array, starts: mx.array,
                 scale: float, shared: tuple | None = None, out_dtype=mx.float32) -> tuple[mx.array, mx.array]:
    """(out (B, H, 1, D) in ``out_dtype``, lse (B, H) float32 in log2 units) of each row's query over its own
    keys: row b reads pool slots ``table[b, starts[b]:]``. ``kpool`` / ``vpool``: (KH, slots, D) or
    (1, KH, slots, D). ``shared``: (keys, values (1, KH, P, D) in the pools' dtype, rows (B,) bool or None:
    all): the batch's shared prefix, read first by the rows that continue it."""
    B, H, _, D = queries.shape
    if kpool.ndim == 4:
        kpool, vpool = kpool[0], vpool[0]
    KH = kpool.shape[0]
    inputs = [queries.reshape(B, H, D), kpool, vpool, table if table.dtype == mx.int32 else table.astype(mx.int32),
              starts if starts.dtype == mx.int32 else starts.astype(mx.int32)]
    if shared is not None:
        sk, sv, rows = shared
        sk, sv = sk.astype(kpool.dtype), sv.astype(kpool.dtype)  # the kernel reads both as the pools' type
        inputs += [sk.reshape(sk.shape[-3:]), sv.reshape(sv.shape[-3:]),
                   rows if rows is not None else mx.ones((B,), dtype=mx.bool_)]
    out, lse = _kernel(shared is not None)(
        inputs=inputs,
        template=[("T", kpool.dtype), ("TO", out_dtype), ("D", D), ("R", H // KH), ("KH", KH), ("NW", WARPS),
                  ("QSCALE", _float_bits(scale * LOG2E))],
        grid=(B * KH * 32 * WARPS, 1, 1),
        threadgroup=(32 * WARPS, 1, 1),
        output_shapes=[(B, H, D), (B, H)],
        output_dtypes=[out_dtype, mx.float32],
    )
    return out.reshape(B, H, 1, D), lse


def shared_part(queries: mx.array, shared_keys: mx.array, shared_values: mx.array, scale: float,
                shared_mask=None) -> tuple[mx.array, mx.array]:
    """(out (B, H, 1, D) float32, lse (B, H) log2 units) of each row's query over the batch's shared prefix
    ((1, KH, P, D) keys and values), read once for every row: one matmul per KV head with all rows' queries
    stacked. Rows not continuing it (``shared_mask`` False) get lse -inf (weight 0 in :func:`merge`)."""
    B, H, _, D = queries.shape
    KH = shared_keys.shape[1]
    rep = H // KH
    q = (queries.reshape(B, KH, rep, D).astype(mx.float32) * (scale * LOG2E)).transpose(1, 0, 2, 3)
    s = q.reshape(KH, B * rep, D) @ shared_keys[0].astype(mx.float32).swapaxes(-1, -2)  # (KH, B*rep, P)
    m = mx.max(s, axis=-1, keepdims=True)
    e = mx.power(2.0, s - m)
    den = mx.sum(e, axis=-1, keepdims=True)
    out = (e @ shared_values[0].astype(mx.float32)) / den  # (KH, B*rep, Dv)
    lse = (m + mx.log2(den))[..., 0].reshape(KH, B, rep).transpose(1, 0, 2).reshape(B, H)
    if shared_mask is not None:
        lse = mx.where(shared_mask.reshape(B, 1), lse, -mx.inf)
    Dv = out.shape[-1]
    return out.reshape(KH, B, rep, Dv).transpose(1, 0, 2, 3).reshape(B, H, 1, Dv), lse


def merge(a: tuple[mx.array, mx.array], b: tuple[mx.array, mx.array]) -> mx.array:
    """Two normalised partial attentions over disjoint keys, (out, lse) each, as one (B, H, 1, D)."""
    (oa, la), (ob, lb) = a, b
    M = mx.maximum(la, lb)
    wa, wb = mx.power(2.0, la - M), mx.power(2.0, lb - M)
    w = (wa / (wa + wb))[..., None, None]
    return oa * w + ob * (1.0 - w)


def attention(queries, kpool, vpool, table, starts, scale, shared_keys=None, shared_values=None,
              shared_mask=None) -> mx.array:
    """The decode step's attention over the page pool (and the shared prefix, if any), in the queries' dtype."""
    pool_dtype = kpool.dtype
    if shared_keys is None or (shared_in_kernel() and shared_keys.dtype == pool_dtype
                               and shared_values.dtype == pool_dtype):
        shared = None if shared_keys is None else (shared_keys, shared_values, shared_mask)
        return paged_decode(queries, kpool, vpool, table, starts, scale, shared, out_dtype=queries.dtype)[0]
    own = paged_decode(queries, kpool, vpool, table, starts, scale)
    return merge(own, shared_part(queries, shared_keys, shared_values, scale, shared_mask)).astype(queries.dtype)
