"""Faster attention and SwiGLU for MLX's CPU backend, used only inside the engine's own forwards.

MLX's CPU ``exp`` (and so ``softmax``, ``sigmoid``, SiLU and the fused SDPA, which falls back to
them) runs at ~25 ns per element on x86 Linux, while ``mx.power(2.0, x)`` runs at ~9 ns with the
same accuracy (max relative error ~1e-6 vs numpy's exp on the measured range). Attention's softmax
and the MLP's SiLU are the two places a llama decode step spends most of its non-GEMM time, so:

- :func:`attention`: scores in log2 units (``q`` pre-scaled by ``scale * log2(e)``), GQA as one
  batched matmul per KV head group, ``2 ** (s - max)``, normalised after the value matmul (one
  divide per output instead of per score). 1.35-1.7x faster than ``mx.fast.scaled_dot_product_attention``
  on this machine for decode (batch 16-32, 160-600 keys) and prefill (32-512 queries) shapes.
- :func:`swiglu`: ``gate / (1 + 2 ** (-gate * log2(e))) * x``, 2.8-4.5x faster than ``silu(gate) * x``.

:func:`install` swaps them into an mlx-lm model's module (its names ``scaled_dot_product_attention``
and ``swiglu``) behind a thread-local switch, so they run only while :func:`enabled` is active on the
building thread: the scheduler's forwards turn it on; anything else calling the same model (mlx-lm's
own generate in ``parallm bench``, a user's code) gets mlx-lm's functions unchanged. On Metal and CUDA
nothing is installed: their fused kernels are the fast path there.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading

import mlx.core as mx

logger = logging.getLogger("parallm_engine")

LOG2E = 1.4426950408889634

_state = threading.local()


def is_enabled() -> bool:
    return getattr(_state, "on", False)


@contextlib.contextmanager
def enabled(on: bool = True):
    """Use the CPU kernels for the graphs built on this thread inside the block."""
    prev = is_enabled()
    _state.on = on
    try:
        yield
    finally:
        _state.on = prev


def attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask=None) -> mx.array:
    """Softmax attention, same contract as ``mx.fast.scaled_dot_product_attention`` without sinks:
    queries (B, H, L, D), keys/values (B, KH, T, D) with H a multiple of KH, mask None, "causal",
    a boolean (True = attend) or an additive array broadcastable to (B, H, L, T)."""
    B, H, L, D = queries.shape
    KH, T = keys.shape[1], keys.shape[2]
    rep = H // KH
    q = (queries * (scale * LOG2E)).reshape(B, KH, rep * L, D)
    s = q @ keys.swapaxes(-1, -2)  # (B, KH, rep * L, T) in log2 units
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unsupported mask {mask!r}")
        if L > 1:
            mask = mx.arange(T)[None, :] <= (mx.arange(L)[:, None] + (T - L))
        else:
            mask = None
    if mask is not None:
        s = s.reshape(B, KH, rep, L, T)
        m = _group_heads(mask, KH, rep)
        if m.dtype == mx.bool_:
            s = mx.where(m, s, -mx.inf)
        else:
            s = s + m.astype(s.dtype) * LOG2E
        s = s.reshape(B, KH, rep * L, T)
    e = mx.power(2.0, s - mx.max(s, axis=-1, keepdims=True))
    out = (e @ values) / mx.sum(e, axis=-1, keepdims=True)
    return out.reshape(B, H, L, values.shape[-1]).astype(queries.dtype)


def _group_heads(mask: mx.array, KH: int, rep: int) -> mx.array:
    """A mask broadcastable to (B, H, L, T) as one broadcastable to (B, KH, rep, L, T)."""
    if mask.ndim < 4:
        mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    b, h, l, t = mask.shape
    if h == 1:
        return mask[:, :, None]
    return mask.reshape(b, KH, rep, l, t)


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    return gate / (1.0 + mx.power(2.0, gate * -LOG2E)) * x


def install(model) -> bool:
    """Route ``model``'s attention and SwiGLU through this module while :func:`enabled` is on.
    Returns whether anything was installed (False for a model module that names neither)."""
    module = sys.modules.get(type(model).__module__)
    if module is None:
        return False
    done = False
    orig_sdpa = getattr(module, "scaled_dot_product_attention", None)
    if orig_sdpa is not None and not getattr(orig_sdpa, "_parallm", False):

        def sdpa(queries, keys, values, cache, scale, mask, sinks=None):
            if sinks is None and is_enabled() and not hasattr(cache, "bits"):
                return attention(queries, keys, values, scale, mask)
            return orig_sdpa(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

        sdpa._parallm = True
        module.scaled_dot_product_attention = sdpa
        done = True
    orig_swiglu = getattr(module, "swiglu", None)
    if orig_swiglu is not None and not getattr(orig_swiglu, "_parallm", False):

        def fast_swiglu(gate, x):
            return swiglu(gate, x) if is_enabled() else orig_swiglu(gate, x)

        fast_swiglu._parallm = True
        module.swiglu = fast_swiglu
        done = True
    if done:
        logger.debug("CPU attention/SwiGLU kernels installed in %s", module.__name__)
    return done
