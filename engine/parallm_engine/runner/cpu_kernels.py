"""Faster attention, SwiGLU and RoPE for MLX's CPU backend, used only inside the engine's own forwards.

MLX's CPU ``exp`` (and so ``softmax``, ``sigmoid``, SiLU and the fused SDPA, which falls back to
them) is scalar and several times slower per element on x86 Linux than ``mx.power(2.0, x)``, which
has the same accuracy. Attention's softmax and the MLP's SiLU are the two places a llama decode step
spends most of its non-GEMM time, so:

- :func:`attention`: scores in log2 units (``q`` pre-scaled by ``scale * log2(e)``), GQA as one
  batched matmul per KV head group, ``2 ** (s - max)``, normalised after the value matmul (one
  divide per output instead of per score). Faster than ``mx.fast.scaled_dot_product_attention`` on the
  CPU for decode and prefill shapes.
- :func:`swiglu`: ``gate / (1 + 2 ** (-gate * log2(e))) * x``, several times faster than ``silu(gate) * x``.
- :class:`RoPETable`: rotary embedding from a cos/sin table built once, instead of ``mx.fast.rope``'s
  per-call scalar trigonometry, for prefill and speculative verification (decode's one position per
  row keeps ``mx.fast.rope`` without the native kernels).
- :func:`cascade_attention`: attention over a prefix held once for the batch plus each row's own keys
  (``kv_cache.SharedPrefix``).

Where ParaLLM's native kernels are built (``native``: MLX primitives compiled with ``-march=native``),
float32 forwards use them instead: fused, vectorised attention for decode and prefill (causal or a
boolean mask, the shared-prefix cascade included) split over the cores, SwiGLU, RoPE from the same
table (one op, bitwise the table's MLX ops), RMSNorm, and a linear that reads the weights in place for
a decode step's few rows (up to ``NATIVE_LINEAR_ROWS``, 16 with AVX2's tiles; a prefill chunk keeps the
BLAS's packed GEMM), speculative verification's few positions per row included. They cut both the decode
step and prefill substantially (docs/benchmarks-archive.md, "This round: the decode GEMMs, prefill
attention, and the graph").

:func:`install` binds them to one model's own module instances, never to mlx-lm's modules: each
attention / MLP instance is switched to a subclass whose methods read the engine's
``scaled_dot_product_attention`` / ``swiglu`` (same code, private globals), each layer's plain
``nn.RoPE`` is wrapped, and plain float32 ``nn.Linear`` / ``nn.RMSNorm`` / tied ``nn.Embedding``
instances get a switched class. The kernels run only while :func:`enabled` is active on the building
thread: the model runner turns it on for its step (``ModelRunner.execute``); anything else calling the
same model (mlx-lm's own generate in ``parallm bench``) gets mlx-lm's functions, and another model in the
process is untouched.
On Metal and CUDA (and the CPU's pure-MLX backend) only the attention hook is bound: it reads a
shared prefix with the MLX-op cascade and otherwise calls mlx-lm's fused attention.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import threading
import types

import mlx.core as mx
import mlx.nn as nn

from parallm_engine.kv.fused_step import fused_attention
from parallm_engine.runner import gpu_attention
from parallm_engine.runner.bf16_embedding import bf16_embedding_class

logger = logging.getLogger("parallm_engine")

LOG2E = 1.4426950408889634

_state = threading.local()


def is_enabled() -> bool:
    return getattr(_state, "on", False)


def _native():
    """The native kernels module, or None (not built here, or off: ``native.load`` logs why)."""
    from parallm_engine import native

    return native.load()


def native_module():
    """The native kernels module while :func:`enabled` is on and they are in use here, else None."""
    return _native() if is_enabled() else None


def native_available() -> bool:
    """Whether the native kernels are in use (builds them on the first call where they can be)."""
    return _native() is not None


def _native_attention(queries, keys, values, scale, mask, shared_keys=None, shared_values=None, shared_mask=None,
                      table=None):
    """The native attention when it applies (float32; no mask, "causal", or a boolean one that is the
    same for every head), else None. ``table``: keys and values are (1, KH, slots, D) page pools and
    row b's column t is slot ``table[b, t]`` (``kv_pages``)."""
    if queries.dtype != mx.float32 or keys.dtype != mx.float32:
        return None
    causal = False
    if isinstance(mask, str):
        if mask != "causal" or queries.shape[2] > (keys.shape[2] if table is None else table.shape[1]):
            return None
        causal, mask = queries.shape[2] > 1, None
    elif mask is not None and (mask.dtype != mx.bool_ or mask.ndim > 4 or (mask.ndim >= 3 and mask.shape[-3] != 1)):
        return None
    nat = _native()
    if nat is None:
        return None
    return nat.attention(queries, keys, values, scale, mask, causal, shared_keys, shared_values, shared_mask, table)


@contextlib.contextmanager
def enabled(on: bool = True):
    """Use the CPU kernels for the graphs built on this thread inside the block."""
    prev = is_enabled()
    _state.on = on
    try:
        yield
    finally:
        _state.on = prev


@contextlib.contextmanager
def solo_lane(on: bool = True):
    """The graphs built on this thread inside the block run on the only busy decode lane: the kernels'
    threads are its alone, so the native linear takes more rows (``NATIVE_LINEAR_ROWS_AVX2_SOLO``)."""
    prev = getattr(_state, "solo", False)
    _state.solo = on
    try:
        yield
    finally:
        _state.solo = prev


def attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask=None) -> mx.array:
    """Softmax attention, same contract as ``mx.fast.scaled_dot_product_attention`` without sinks:
    queries (B, H, L, D), keys/values (B, KH, T, D) with H a multiple of KH, mask None, "causal",
    a boolean (True = attend) or an additive array broadcastable to (B, H, L, T)."""
    B, H, L, D = queries.shape
    KH = keys.shape[1]
    q = (queries * (scale * LOG2E)).reshape(B, KH, (H // KH) * L, D)
    s = _masked_scores(q @ keys.swapaxes(-1, -2), mask, H // KH, L)  # (B, KH, rep * L, T), log2 units
    e = mx.power(2.0, s - mx.max(s, axis=-1, keepdims=True))
    out = (e @ values) / mx.sum(e, axis=-1, keepdims=True)
    return out.reshape(B, H, L, values.shape[-1]).astype(queries.dtype)


def cascade_attention(queries: mx.array, keys: mx.array, values: mx.array, shared_keys: mx.array,
                      shared_values: mx.array, scale: float, mask=None, shared_mask=None) -> mx.array:
    """Attention over a prefix every row shares followed by each row's own keys, reading the
    prefix once for the whole batch.

    Equal to :func:`attention` over ``concatenate([shared, keys])`` per row (the prefix columns
    masked out for rows where the (B,) bool ``shared_mask`` is False; None: every row continues it).
    ``shared_keys``/``shared_values`` are (1, KH, P, D); ``mask`` applies to the rows' own keys only
    (all prefix keys come before every query). The prefix part is one matmul per KV head with all
    rows' queries stacked (M = B * rep * L) instead of B tiny ones, and the two parts are merged with
    a common max, normalised once after both value matmuls."""
    B, H, L, D = queries.shape
    KH, P = keys.shape[1], shared_keys.shape[2]
    M = (H // KH) * L
    q = (queries * (scale * LOG2E)).reshape(B, KH, M, D)
    s = _masked_scores(q @ keys.swapaxes(-1, -2), mask, H // KH, L)  # (B, KH, M, T)
    qs = q.transpose(1, 0, 2, 3).reshape(KH, B * M, D)
    sp = (qs @ shared_keys[0].swapaxes(-1, -2)).reshape(KH, B, M, P)
    if shared_mask is not None:
        sp = mx.where(shared_mask.reshape(1, B, 1, 1), sp, -mx.inf)
    m = mx.maximum(mx.max(s, axis=-1, keepdims=True), mx.max(sp, axis=-1, keepdims=True).transpose(1, 0, 2, 3))
    e = mx.power(2.0, s - m)
    ep = mx.power(2.0, sp - m.transpose(1, 0, 2, 3))  # (KH, B, M, P)
    Dv = values.shape[-1]
    shared_out = (ep.reshape(KH, B * M, P) @ shared_values[0]).reshape(KH, B, M, Dv).transpose(1, 0, 2, 3)
    den = mx.sum(e, axis=-1, keepdims=True) + mx.sum(ep, axis=-1, keepdims=True).transpose(1, 0, 2, 3)
    out = (e @ values + shared_out) / den
    return out.reshape(B, H, L, Dv).astype(queries.dtype)


def _masked_scores(s: mx.array, mask, rep: int, L: int) -> mx.array:
    """Apply an SDPA-style mask (None, "causal", bool or additive, broadcastable to (B, H, L, T)) to
    scores laid out (B, KH, rep * L, T) in log2 units."""
    B, KH, _, T = s.shape
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unsupported mask {mask!r}")
        mask = mx.arange(T)[None, :] <= (mx.arange(L)[:, None] + (T - L)) if L > 1 else None
    if mask is None:
        return s
    s = s.reshape(B, KH, rep, L, T)
    m = _group_heads(mask, KH, rep)
    if m.dtype == mx.bool_:
        s = mx.where(m, s, -mx.inf)
    else:
        s = s + m.astype(s.dtype) * LOG2E
    return s.reshape(B, KH, rep * L, T)


def _group_heads(mask: mx.array, KH: int, rep: int) -> mx.array:
    """A mask broadcastable to (B, H, L, T) as one broadcastable to (B, KH, rep, L, T)."""
    if mask.ndim < 4:
        mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    b, h, l, t = mask.shape
    if h == 1:
        return mask[:, :, None]
    return mask.reshape(b, KH, rep, l, t)


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    if gate.dtype == mx.float32 and x.dtype == mx.float32 and gate.shape == x.shape:
        nat = _native()
        if nat is not None:
            return nat.swiglu(gate, x)
    return gate / (1.0 + mx.power(2.0, gate * -LOG2E)) * x


class RoPETable:
    """Rotary embedding from a precomputed cos/sin table, for positions below ``max_positions``.

    ``mx.fast.rope`` on the CPU computes a cosine and a sine per rotated pair on every call (scalar
    ``std::cos``/``std::sin``); a gather from a table built once is cheaper. Same contract as
    ``nn.RoPE.__call__``: x (B, H, L, D), ``offset`` an int or an array of per-row offsets (B,)."""

    def __init__(self, dims: int, base: float, scale: float, traditional: bool, max_positions: int):
        import numpy as np

        self.dims, self.traditional, self.max_positions = dims, traditional, max_positions
        self.base, self.scale = base, scale
        inv_freq = base ** (-np.arange(0, dims, 2, dtype=np.float64) / dims)
        angles = (np.arange(max_positions, dtype=np.float64) * scale)[:, None] * inv_freq[None, :]
        self.cos = mx.array(np.cos(angles).astype(np.float32))  # (max_positions, dims / 2)
        self.sin = mx.array(np.sin(angles).astype(np.float32))

    def __call__(self, x: mx.array, offset=0) -> mx.array:
        B, H, L, D = x.shape
        if x.dtype == mx.float32:  # one fused op (the same bits as the MLX ops below) where it is built
            nat = _native()
            if nat is not None:
                positions = mx.full((B,), offset, mx.int32) if isinstance(offset, int) else offset
                return nat.rope_rows(x, positions, self.cos, self.sin, self.dims, self.traditional,
                                     self.base, self.scale)
        if isinstance(offset, int):
            pos = mx.arange(offset, offset + L)
            cos, sin = self.cos[pos][None, None], self.sin[pos][None, None]  # (1, 1, L, d/2)
        else:
            pos = offset.astype(mx.int32)[:, None] + mx.arange(L)[None, :]  # (B, L)
            cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]  # (B, 1, L, d/2)
        cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
        half = self.dims // 2
        if self.traditional:
            pairs = x[..., : self.dims].reshape(B, H, L, half, 2)
            x1, x2 = pairs[..., 0], pairs[..., 1]
            rotated = mx.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).reshape(B, H, L, self.dims)
        else:
            x1, x2 = x[..., :half], x[..., half : self.dims]
            rotated = mx.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
        if self.dims < D:
            rotated = mx.concatenate([rotated, x[..., self.dims :]], axis=-1)
        return rotated


class _SwitchedRoPE:
    """Stands in for a layer's ``nn.RoPE``: the table while :func:`enabled` is on (and the positions
    fit), the original otherwise. A plain object, not an ``nn.Module``, so the model's parameter tree
    (saved, counted, compared by the bench) does not change."""

    def __init__(self, original, table: RoPETable):
        self.original, self.table = original, table

    def __call__(self, x: mx.array, offset=0) -> mx.array:
        # Decode (one position per row) uses the table only through the native kernel (one fused op);
        # otherwise it keeps mx.fast.rope, one op where the table takes several. Without the native
        # kernel the table pays off only in prefill, where a call covers many positions.
        L = x.shape[2]
        if is_enabled() and (not isinstance(offset, int) or offset + L <= self.table.max_positions):
            if L > 1 or (x.dtype == mx.float32 and _native() is not None):
                return self.table(x, offset)
        return self.original(x, offset=offset)


# Up to this many rows the native linear beats OpenBLAS's packed GEMM on the decode step's projections,
# whose weights stream from memory; above it the packed GEMM wins (docs/benchmarks-archive.md, "This
# round: the decode GEMMs, prefill attention, and the graph"). Rows up to it are also bitwise independent
# of the batch (see kernels.cpp).
NATIVE_LINEAR_ROWS = 64
# The same limit for the AVX2 build (8-lane tiles), against MKL's single-threaded GEMM per decode lane
# with every lane busy: past it MKL's GEMM is the faster one. Speculative verification (a few positions
# per row) is what needs it: MKL's GEMM for a few rows costs about twice its one-row GEMV
# (docs/benchmarks-archive.md, "Speculative decoding (n-gram prompt lookup): `--workloads spec`").
NATIVE_LINEAR_ROWS_AVX2 = 16
# ... and while one decode lane runs alone (``solo_lane``: the kernel's threads are not shared with a
# second lane's), up to this many: one lane of 32 rows through the native linear decodes faster than two
# lanes of 16 (decode_batch.LANE_FILL_ROWS; docs/benchmarks-archive.md, "What users compare with:
# llama.cpp, agent traces, long context").
NATIVE_LINEAR_ROWS_AVX2_SOLO = 64


def native_linear_rows() -> int:
    """The most rows the native linear takes on this machine: 0 where it is not built or not tuned
    (MLX's matmul everywhere), ``NATIVE_LINEAR_ROWS`` with AVX-512, ``NATIVE_LINEAR_ROWS_AVX2`` with AVX2."""
    nat = _native()
    return 0 if nat is None else _linear_rows(nat)


def _linear_rows(nat) -> int:
    lanes = nat.linear_lanes()
    if lanes == 8:
        return NATIVE_LINEAR_ROWS_AVX2_SOLO if getattr(_state, "solo", False) else NATIVE_LINEAR_ROWS_AVX2
    return NATIVE_LINEAR_ROWS if lanes == 16 else 0


def linear_native(x: mx.array, weight: mx.array, bias: mx.array | None = None) -> mx.array | None:
    """``x @ weight.T (+ bias)`` through the native kernel where it is the faster one: while
    :func:`enabled` is on, for at most :func:`native_linear_rows` float32 rows (the kernels built with
    the AVX-512 or AVX2 tiles it is tuned for). None otherwise (the caller keeps MLX's matmul)."""
    if not is_enabled():
        return None
    if x.dtype != mx.float32 or weight.dtype not in _LINEAR_WEIGHT_DTYPES or (
            bias is not None and bias.dtype != mx.float32):
        return None
    nat = _native()
    if nat is None:
        return None
    if x.size > _linear_rows(nat) * x.shape[-1]:
        if weight.dtype == mx.bfloat16:  # MLX's matmul would widen the whole weight per call: always split
            return nat.gemm_split(x, weight, bias) if nat.has_sgemm() else None
        return _gemm_split(nat, x, weight, bias)
    return nat.linear(x, weight, bias)


# The native linear reads float32 weights, or bfloat16 ones (weights_dtype="bfloat16") widened in
# registers. Above its rows, bfloat16 weights go through gemm_split (a block of weight rows widened
# into a scratch buffer that stays in cache, then the BLAS, on every core): there it beats both the
# native linear and MLX's matmul, which would widen the whole weight per call (docs/benchmarks-archive.md,
# "bf16 on CPU: `weights_dtype="bfloat16"`").
_LINEAR_WEIGHT_DTYPES = (mx.float32, mx.bfloat16)


# Rows from which a GEMM runs on every core (the native gemm_split: output columns over the kernels'
# threads, each a single-threaded BLAS sgemm), with the same bits as one sgemm. Below it a decode lane's
# GEMM stays on its own core: two lanes of up to 32 rows each already use both. A prefill chunk's GEMM
# runs about twice as fast split (docs/benchmarks-archive.md, "Prefill and long-context attention").
GEMM_SPLIT_MIN_ROWS = 48


def _gemm_split(nat, x, weight, bias):
    if x.size < GEMM_SPLIT_MIN_ROWS * x.shape[-1] or not _gemm_split_available(nat):
        return None
    return nat.gemm_split(x, weight, bias)


@functools.lru_cache(maxsize=1)
def _gemm_split_available(nat) -> bool:
    """Where the BLAS runs single-threaded per caller (MKL sequential, ``backend._configure_mkl``) and the
    kernels have threads to split over; a multi-threaded BLAS (OpenBLAS) already uses the cores."""
    return (os.environ.get("MKL_THREADING_LAYER", "").upper() == "SEQUENTIAL" and nat.has_sgemm()
            and nat.threads() > 1)


class _SwitchedLinear(nn.Linear):
    """A model's ``nn.Linear`` with its class swapped (same object, same parameters): the native
    kernel for rows of at most :func:`native_linear_rows` while :func:`enabled` is on, ``nn.Linear``
    otherwise. OpenBLAS packs the weights on every call, which a decode step's few rows do not pay
    back; a large prefill chunk is where its packed GEMM is faster."""

    def __call__(self, x: mx.array) -> mx.array:
        y = linear_native(x, self.weight, self.get("bias"))
        return super().__call__(x) if y is None else y


class _SwitchedEmbedding(nn.Embedding):
    """A model's ``nn.Embedding`` with its class swapped: a tied output head (``as_linear``) through the
    native linear for a decode step's rows while :func:`enabled` is on (the vocabulary-sized projection
    is a fifth of a small model's decode step)."""

    def as_linear(self, x: mx.array) -> mx.array:
        y = linear_native(x, self.weight)
        return super().as_linear(x) if y is None else y


@functools.lru_cache(maxsize=1)
def _bf16_switched_embedding():
    """:class:`_SwitchedEmbedding` for a bfloat16-weight embedding (``bf16_embedding.Bf16Embedding``)."""
    def as_linear(self, x: mx.array) -> mx.array:
        y = linear_native(x, self.weight)
        return nn.Embedding.as_linear(self, x) if y is None else y

    return type("_SwitchedBf16Embedding", (bf16_embedding_class(),), {"as_linear": as_linear, "__module__": __name__})


class _SwitchedRMSNorm(nn.RMSNorm):
    """A model's ``nn.RMSNorm`` with its class swapped: the native kernel (one graph node; MLX's CPU
    ``mx.fast.rms_norm`` is eight) for float32 while :func:`enabled` is on, ``nn.RMSNorm`` otherwise."""

    def __call__(self, x: mx.array) -> mx.array:
        if is_enabled() and x.dtype == mx.float32 and self.weight.dtype == mx.float32:
            nat = _native()
            if nat is not None:
                return nat.rms_norm(x, self.weight, self.eps)
        return super().__call__(x)


def _install_native_modules(model) -> bool:
    """Swap the class of every plain float32 ``nn.Linear`` and ``nn.RMSNorm`` in ``model`` for
    :class:`_SwitchedLinear` / :class:`_SwitchedRMSNorm` (only where the native kernels are built:
    the pure-MLX path keeps MLX's own)."""
    nat = _native()
    if not isinstance(model, nn.Module) or nat is None:
        return False
    swaps = {nn.RMSNorm: _SwitchedRMSNorm}
    if _linear_rows(nat):  # the native linear is tuned (and measured) for AVX-512's and AVX2's registers only
        swaps[nn.Linear] = _SwitchedLinear
        swaps[nn.Embedding] = _SwitchedEmbedding
        swaps[bf16_embedding_class()] = _bf16_switched_embedding()
    done = False
    for _, module in model.named_modules():
        switched = swaps.get(type(module))
        if switched is None:
            continue
        # bfloat16 weights (weights_dtype="bfloat16") for the linear's classes only; norms stay float32
        if module.weight.dtype == mx.float32 or (switched is not _SwitchedRMSNorm and module.weight.dtype == mx.bfloat16):
            module.__class__ = switched
            done = True
    return done


def _install_rope(model, max_positions: int) -> bool:
    layers = getattr(getattr(model, "model", None), "layers", None) or getattr(model, "layers", None) or []
    tables: dict[tuple, RoPETable] = {}
    done = False
    for layer in layers:
        attn = getattr(layer, "self_attn", None)
        rope = getattr(attn, "rope", None)
        if type(rope) is not nn.RoPE:  # scaled variants (llama3, yarn, ...) keep their own
            continue
        key = (rope.dims, float(rope.base), float(rope.scale), bool(rope.traditional))
        if key not in tables:
            tables[key] = RoPETable(*key, max_positions=max_positions)
        attn.rope = _SwitchedRoPE(rope, tables[key])
        done = True
    return done


def handles_shared_prefix(model) -> bool:
    """Whether ``model``'s attention runs through this module's hook (:func:`install`), which is what
    reads a decode batch's shared prefix (without it a batch must hold every row's whole KV)."""
    if not isinstance(model, nn.Module):
        return False
    return any(getattr(type(m), "_parallm_hooked", False) for _, m in model.named_modules())


def _engine_sdpa(orig_sdpa):
    """The engine's attention in place of mlx-lm's ``scaled_dot_product_attention`` for one model's
    modules: the shared-prefix cascade whenever the cache holds a prefix once (every backend: the
    MLX-op cascade where the native kernel does not apply), the CPU kernels while :func:`enabled` is on,
    mlx-lm's own function otherwise."""

    def sdpa(queries, keys, values, cache, scale, mask, sinks=None):
        fused = getattr(cache, "fused", None)
        if fused is not None:  # decode rows and the step's fused prefill in one forward (kv.fused_step)
            return fused_attention(attend, queries, keys, values, fused, scale, sinks)
        ragged = getattr(cache, "ragged", None)
        if ragged is not None:  # a ragged step (kv_pages.PagedLaneKV.begin): the rows' rectangle
            return ragged_attention(attend, queries, keys, values, cache, scale, sinks, ragged)
        return attend(queries, keys, values, cache, scale, mask, sinks)

    def attend(queries, keys, values, cache, scale, mask, sinks=None):
        shared = getattr(cache, "shared_keys", None)
        # Paged rows (kv_pages): the native kernel (CPU) or the CUDA kernel (gpu_attention: a decode step)
        # reads the page pool through the slot table; the working set ``keys`` / ``values`` gathered for
        # other paths is then never computed.
        paged = cache.native_inputs() if hasattr(cache, "native_inputs") else None
        if paged is not None:
            out = None
            if sinks is None and is_enabled():  # the CPU kernel reads (1, KH, slots, D) pools
                out = _native_attention(queries, paged[0][None], paged[1][None], scale, mask, shared,
                                        cache.shared_values if shared is not None else None,
                                        cache.shared_mask if shared is not None else None, table=paged[2])
            elif sinks is None and getattr(cache, "step_starts", None) is not None \
                    and gpu_attention.applies(queries, paged[0]):  # a decode step's rows
                out = gpu_attention.attention(queries, paged[0], paged[1], paged[2], cache.step_starts,
                                              scale, shared, cache.shared_values if shared is not None else None,
                                              cache.shared_mask if shared is not None else None)
            if out is not None:
                return out
            keys, values = cache.working_set()  # update_and_fetch handed out the pools as stand-ins
        if shared is not None:  # an engine cache holding a prefix once (kv_cache.SharedPrefix)
            if sinks is not None:
                raise NotImplementedError("attention sinks with a shared prefix")
            out = _native_attention(queries, keys, values, scale, mask, shared, cache.shared_values,
                                    cache.shared_mask) if is_enabled() and paged is None else None
            if out is not None:
                return out
            return cascade_attention(queries, keys, values, shared, cache.shared_values, scale, mask,
                                     cache.shared_mask)
        if sinks is None and is_enabled() and not hasattr(cache, "bits"):
            out = _native_attention(queries, keys, values, scale, mask)
            return attention(queries, keys, values, scale, mask) if out is None else out
        return orig_sdpa(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    return sdpa


def ragged_attention(attend, queries, keys, values, cache, scale, sinks, ragged):
    """Attention of a ragged step: model row p is one position (queries (N, H, 1, D)) of a decode row
    whose positions are consecutive model rows. The queries are laid out as the rows' (B, H, W, D)
    rectangle (where a row has fewer than W positions, its cells before them repeat another query:
    computed, never read), attended as any multi-position step (the step's left-padded causal mask; each
    row's keys read once for all its positions), and the real cells taken back: the same sums as the
    rectangular step, for only N positions' worth of projections and MLP."""
    N, H, _, D = queries.shape
    W = ragged.width
    B = ragged.fill.shape[0] // W
    rect = queries.reshape(N, H, D)[ragged.fill].reshape(B, W, H, D).transpose(0, 2, 1, 3)
    out = attend(rect, keys, values, cache, scale, ragged.mask, sinks)
    Dv = out.shape[-1]
    return out.transpose(0, 2, 1, 3).reshape(B * W, H, Dv)[ragged.cells].reshape(N, H, 1, Dv)


def _engine_swiglu(orig_swiglu):
    def fast_swiglu(gate, x):
        return swiglu(gate, x) if is_enabled() else orig_swiglu(gate, x)

    return fast_swiglu


_hooked_classes: dict[tuple, type] = {}


def _hooked_class(cls: type, names: tuple[str, ...]) -> type:
    """A subclass of ``cls`` whose methods read the engine's versions of the module-level functions
    ``names`` (the same code, rebound to a private copy of its module's globals). Only instances the
    engine switches to it see the engine's functions: mlx-lm's module, and every other model built from
    it in the process, keep mlx-lm's own."""
    key = (cls, names)
    if key in _hooked_classes:
        return _hooked_classes[key]
    module = sys.modules[cls.__module__]
    from mlx_lm.models import activations, base

    overrides = {}
    if "scaled_dot_product_attention" in names:
        overrides["scaled_dot_product_attention"] = _engine_sdpa(base.scaled_dot_product_attention)
    if "swiglu" in names:
        overrides["swiglu"] = _engine_swiglu(activations.swiglu)
    env = dict(vars(module))
    env.update(overrides)
    methods = {}
    for attr, fn in vars(cls).items():
        if isinstance(fn, types.FunctionType) and set(fn.__code__.co_names) & set(names):
            rebound = types.FunctionType(fn.__code__, env, fn.__name__, fn.__defaults__, fn.__closure__)
            rebound.__kwdefaults__ = fn.__kwdefaults__
            rebound.__qualname__ = fn.__qualname__
            methods[attr] = rebound
    methods["_parallm_hooked"] = "scaled_dot_product_attention" in names
    hooked = type(cls.__name__, (cls,), methods)
    hooked.__module__ = cls.__module__
    _hooked_classes[key] = hooked
    return hooked


def _hook_names(cls: type) -> tuple[str, ...]:
    """Which of mlx-lm's shared functions this class's own methods call by their module-level name
    (only where the module uses mlx-lm's function itself: a module defining its own variant keeps it)."""
    module = sys.modules.get(cls.__module__)
    if module is None or not cls.__module__.startswith("mlx_lm.models."):
        return ()
    from mlx_lm.models import activations, base

    wanted = {"scaled_dot_product_attention": base.scaled_dot_product_attention, "swiglu": activations.swiglu}
    used = set()
    for fn in vars(cls).values():
        if isinstance(fn, types.FunctionType):
            used |= set(fn.__code__.co_names) & set(wanted)
    return tuple(sorted(n for n in used if getattr(module, n, None) is wanted[n]))


def install(model, max_positions: int | None = None, kernels: bool = True) -> bool:
    """Route ``model``'s attention through the engine's hook (the shared-prefix cascade, on every
    backend) and, with ``kernels`` (the CPU backend), its SwiGLU, plain RoPE and, with the native
    kernels, its float32 Linear and RMSNorm modules through this module while :func:`enabled` is on.

    Nothing is patched process-wide: each of the model's own module instances is switched to a
    subclass bound to the engine's functions, so another model in the process (a user's mlx-lm code)
    is untouched. ``max_positions`` sizes the RoPE table. Returns whether the attention hook is in
    place (the shared prefix needs it)."""
    if not isinstance(model, nn.Module):
        return False
    if kernels:
        if max_positions:
            _install_rope(model, int(max_positions))
        _install_native_modules(model)
    hooked = False
    for _, module in model.named_modules():
        cls = type(module)
        if getattr(cls, "_parallm_hooked", None) is not None:  # already switched (a second install)
            hooked = hooked or cls._parallm_hooked
            continue
        names = _hook_names(cls)
        if not kernels:
            names = tuple(n for n in names if n == "scaled_dot_product_attention")
        if names:
            module.__class__ = _hooked_class(cls, names)
            hooked = hooked or "scaled_dot_product_attention" in names
    if hooked:
        logger.debug("engine attention hook installed on %s", type(model).__module__)
    return hooked
