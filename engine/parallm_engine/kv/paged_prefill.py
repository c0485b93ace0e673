"""A prompt's KV written once, straight into the pages of the lane it will decode in.

A sequence that starts its prefill (attention layout) gets its row at once (:class:`PrefillRow`): a
``PageRow`` in the pool of the decode lane it will join, borrowing the pages of the prefix the radix
tree holds there (read, never copied), or reading the decode batch's shared prefix (held once) when it
continues it. Each prefill forward writes the new tokens' keys and values into the row's own pages as
the model computes them (:class:`PagedPrefillStep`), and attention reads the rows' tokens from the pool.
When the prompt is done the row simply joins the running batch (``PagedLaneKV.adopt``): nothing is
copied, and the radix tree then holds the row's pages by reference. So every KV token is written once
between prompt and decode (``kv_meter`` counts it; tests/test_kv_writes.py asserts it).

A step's rows are laid out as a batched prefill always was (``kv_cache.prefill_layout``): row i's
``p_i`` tokens already held (its borrowed prefix and earlier chunks) right-aligned in columns
``[0, P)``, its ``n_i`` new tokens right-aligned in ``[P, P + L)``; padding queries attend to
themselves only (a padding column reads page 0, which holds zeros: nothing is ever NaN). Only real
positions are written. The new keys are written first and attention then reads the pool through the
step's slot table, so the pool array is updated in place (MLX donates a buffer only its writer holds):
the engine's native CPU kernel reads the pool where it is; elsewhere one gather per array per layer
builds the step's working set, as in a decode step.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from parallm_engine.kv import kv_quant as kvq
from parallm_engine.kv.kv_cache import prefill_layout
from parallm_engine.kv.page_pool import PageRow


class PrefillRow:
    """A prefilling sequence's KV (``seq.cache``): its row in ``lane``'s pool. ``shared``: the length of
    the decode batch's shared prefix the row continues and does not hold (0: none)."""

    __slots__ = ("lane", "kv", "row", "shared")

    def __init__(self, lane, row: PageRow, shared: int):
        self.lane = lane  # a decode_batch.DecodeLane
        self.kv = lane.kv  # its pool's PagedLaneKV (a failed step gives the lane a new one: decode_batch.clear)
        self.row = row
        self.shared = shared


class PagedPrefillStep:
    """One prefill forward's rows of one lane (each ``PrefillRow`` taking ``new[i]`` more tokens): pages
    for the new tokens, the slot table attention reads, RoPE offsets, the mask, and one cache per layer
    (``layers``: what the model is called with)."""

    def __init__(self, lane, rows: list[PrefillRow], new: list[int], shared_kv: list | None, *, native=None,
                 reads_pool: bool = False, mask_5d: bool = False):
        kv = self.lane_kv = lane.kv
        held = [r.row.length for r in rows]
        self.offset, mask, P, L = prefill_layout(held, new)
        if any(r.shared for r in rows):
            self.offset = self.offset + mx.array([r.shared for r in rows])
        self.mask = mask[:, :, None] if mask_5d else mask
        B = len(rows)
        table = np.zeros((B, P + L), dtype=np.int32)  # padding columns read page 0
        writes, real = [], []
        for i, (r, p, n) in enumerate(zip(rows, held, new)):
            if p:
                table[i, P - p : P] = r.row.slots(0, p)
            r.row.grow(kv.pool, n)
            slots = r.row.slots(p, p + n)
            table[i, P + L - n :] = slots
            writes.append(slots)
            real.append(i * L + L - n + np.arange(n, dtype=np.int32))
        self.table = mx.array(table)
        self.write_slots = mx.array(np.concatenate(writes))
        self.padded = sum(new) < B * L
        self.real = mx.array(np.concatenate(real)) if self.padded else None
        self.native = native if kv.fmt is None else None
        self.reads_pool = reads_pool and native is not None
        uses = [bool(r.shared) for r in rows]
        self.shared_kv = shared_kv if any(uses) else None
        self.shared_mask = None if all(uses) else mx.array(uses, dtype=mx.bool_)
        self._index: dict = {}
        self.layers = [PagedPrefillKV(layer, self, l) for l, layer in enumerate(kv.layers)]

    def write(self, layer, keys: mx.array, values: mx.array) -> None:
        """Store this step's (B, KH, L, D) new keys and values (real positions only) in the rows' slots."""
        nat = self.native
        if nat is not None and not self.padded and keys.dtype == mx.float32 and values.dtype == mx.float32:
            layer._ensure(keys, values)
            layer.keys = nat.paged_write(layer.keys, keys, self.write_slots)
            layer.values = nat.paged_write(layer.values, values, self.write_slots)
            self.lane_kv.meter.wrote(keys, values)
            return
        k = keys.transpose(1, 0, 2, 3).reshape(keys.shape[1], -1, keys.shape[-1])
        v = values.transpose(1, 0, 2, 3).reshape(values.shape[1], -1, values.shape[-1])
        if self.padded:
            k, v = k[:, self.real], v[:, self.real]
        layer.write(self.write_slots, kvq.store(k, self.lane_kv.fmt), kvq.store(v, self.lane_kv.fmt))

    def index(self, KH: int, S: int) -> mx.array:
        """(B, KH, P + L) rows of a pool flattened to (KH x S, D): the step's working set."""
        key = (KH, S)
        if key not in self._index:
            heads = mx.arange(KH, dtype=mx.int32)[None, :, None] * S
            self._index[key] = self.table[:, None, :] + heads
        return self._index[key]


class PagedPrefillKV:
    """One layer of a :class:`PagedPrefillStep`, as mlx-lm's models call a cache (``offset``,
    ``update_and_fetch``, ``make_mask``) plus what the engine's attention hook reads (the shared prefix,
    :meth:`native_inputs`)."""

    def __init__(self, layer, step: PagedPrefillStep, index: int):
        self.layer = layer  # the lane's kv_pages.PagedLayerKV: the pool arrays
        self.step = step
        self._l = index

    @property
    def offset(self) -> mx.array:
        return self.step.offset

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self.step.write(self.layer, keys, values)
        if self.native_inputs() is not None:
            return self.layer.keys, self.layer.values  # stand-ins: the native kernel reads the pool
        return self.working_set()

    def working_set(self):
        return self._gather(self.layer.keys), self._gather(self.layer.values)

    def _gather(self, pool):
        KH, S = pool.shape[0], pool.shape[1]
        index = self.step.index(KH, S)
        flat = lambda a: a.reshape(KH * S, a.shape[-1])[index]  # noqa: E731
        if isinstance(pool, kvq.QuantizedKV):
            return pool._like(tuple(flat(p) for p in pool._parts())).dequantize()
        return flat(pool)

    def native_inputs(self):
        if not self.step.reads_pool or isinstance(self.layer.keys, kvq.QuantizedKV):
            return None
        return self.layer.keys[None], self.layer.values[None], self.step.table

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        if window_size is not None:
            raise ValueError("a sliding-window layer got a full-attention cache")  # never run it wrong
        return self.step.mask

    @property
    def shared_keys(self):
        kv = self.step.shared_kv
        return None if kv is None else kvq.as_float(kv[self._l][0])

    @property
    def shared_values(self):
        kv = self.step.shared_kv
        return None if kv is None else kvq.as_float(kv[self._l][1])

    @property
    def shared_mask(self):
        return self.step.shared_mask
