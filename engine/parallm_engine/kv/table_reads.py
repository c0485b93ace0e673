"""Reading a page pool through a slot table with MLX ops: the gather behind every working set that attention
takes as ``(B, KV heads, T, D)`` (``kv_pages``, ``decode_working_set``, ``paged_prefill``)."""

from __future__ import annotations

import mlx.core as mx

from parallm_engine.kv import kv_quant as kvq


def table_index(table: mx.array, KH: int, S: int) -> mx.array:
    """(B, KH, T) rows of a pool flattened to (KH x S, D) that read a (B, T) slot table."""
    return table[:, None, :] + mx.arange(KH, dtype=mx.int32)[None, :, None] * S


def read_table(pool, index: mx.array):
    """(B, KH, T, D) KV as stored (float or ``kv_quant.QuantizedKV``) at ``index`` (:func:`table_index`):
    one gather per array from the pool seen as (KH x slots) rows, straight into that layout."""
    KH, S = pool.shape[0], pool.shape[1]
    flat = lambda a: a.reshape(KH * S, a.shape[-1])[index]  # noqa: E731
    if isinstance(pool, kvq.QuantizedKV):
        return pool._like(tuple(flat(p) for p in pool._parts()))
    return flat(pool)


def by_slot(x):
    """A forward's (B, KH, n, D) keys or values (float or quantized) as (KH, B x n, D): one slot per
    position, row by row (how a pool is written)."""
    if isinstance(x, kvq.QuantizedKV):
        return x._like(tuple(by_slot(p) for p in x._parts()))
    return x.transpose(1, 0, 2, 3).reshape(x.shape[1], -1, x.shape[-1])
