"""A single sequence's KV cache for the benchmarks' own forwards (roofline, KV quantization): one
layer, shape (1, H, T, D), in the engine's KV storage format (``kv_quant``). The engine itself prefills
into pages (``parallm_engine.kv.paged_prefill``)."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask

from parallm_engine.kv import kv_quant as kvq

STEP = 256  # the largest capacity step (mlx-lm grows every cache by 256)
MIN_STEP = 32


def _round_up(n: int) -> int:
    """Capacity for ``n`` columns: the step grows with the length (32 up to 256 columns, then an
    eighth of the length, at most 256), so appends reallocate rarely while a batch of short rows, e.g.
    a fan-out's own tokens after a shared prefix, does not hold 256 columns per row."""
    step = min(STEP, max(MIN_STEP, 1 << max(0, n.bit_length() - 3)))
    return ((n + step - 1) // step) * step


class SequenceKV:
    """One sequence's cache for one layer. Shape (1, H, T, D)."""

    def __init__(self, keys: mx.array | None = None, values: mx.array | None = None, fmt=None):
        self.fmt = fmt
        self.keys = None
        self.values = None
        self.offset = 0
        if keys is not None and keys.shape[2] > 0:
            n = keys.shape[2]
            cap = _round_up(n + 1)
            pad = [(0, 0), (0, 0), (0, cap - n), (0, 0)]
            self.keys = kvq.pad(keys, pad)
            self.values = kvq.pad(values, pad)
            self.offset = n

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        keys, values = kvq.store(keys, self.fmt), kvq.store(values, self.fmt)
        prev = self.offset
        n = keys.shape[2]
        if self.keys is None or prev + n > self.keys.shape[2]:
            cap = _round_up(prev + n)
            B, H, _, D = keys.shape
            new_k = kvq.zeros((B, H, cap, D), keys)
            new_v = kvq.zeros((B, H, cap, values.shape[3]), values)
            if self.keys is not None:
                new_k[..., :prev, :] = self.keys[..., :prev, :]
                new_v[..., :prev, :] = self.values[..., :prev, :]
            self.keys, self.values = new_k, new_v
        self.keys[..., prev : prev + n, :] = keys
        self.values[..., prev : prev + n, :] = values
        self.offset = prev + n
        return kvq.as_float(self.keys[..., : self.offset, :]), kvq.as_float(self.values[..., : self.offset, :])

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        if window_size is not None:
            raise ValueError("a sliding-window layer got a full-attention cache")  # never run it wrong
        if N == 1:
            return None
        if self.offset == 0 and not return_array:
            return "causal"
        return create_causal_mask(N, offset=self.offset)
