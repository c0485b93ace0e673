"""A prompt's KV written once, straight into the pages of the lane it will decode in.

A sequence that starts its prefill (attention layout) gets its row at once (:class:`PrefillRow`): a
``PageRow`` in the pool of the decode lane it will join, borrowing the pages of the prefix the radix
tree holds there (read, never copied), or reading the decode batch's shared prefix (held once) when it
continues it. Each prefill forward computes the new tokens' keys and values and the step then writes
them into the row's own pages (:meth:`PagedPrefillStep.commit`). When the prompt is done the row simply
joins the running batch (``PagedLaneKV.adopt``): nothing is copied, and the radix tree then holds the
row's pages by reference. So every KV token is written once between prompt and decode (``kv_meter``
counts it; tests/test_kv_writes.py asserts it).

A step's rows are laid out as a batched prefill always was (``kv_cache.prefill_layout``): row i's
``p_i`` tokens already held (its borrowed prefix and earlier chunks) right-aligned in columns
``[0, P)``, its ``n_i`` new tokens right-aligned in ``[P, P + L)``; padding columns read page 0 (zeros),
padding queries attend to themselves only (nothing is ever a NaN), and only real positions are written.

MLX writes a pool array in place only when nothing still to run reads it (else the scatter copies the
whole array), so a step writes in one of two ways:

- in the forward (one share per pool: Metal, CUDA, the native CPU path): each layer writes its new
  tokens into the pages first and attention then reads the pool through the slot table, where it is
  (the native CPU kernel) or as one gather per array (MLX ops), as a decode step does;
- after it (``deferred``: a pool's rows split into shares that run at the same time on several lanes'
  streams, the pure-MLX path on a multi-core CPU): attention reads the held tokens from the pool and
  the new ones as computed, and :meth:`PagedPrefillStep.commit` writes them once every share's forward is
  evaluated (a share's write while another share still reads the pool would copy it).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from parallm_engine.kv import kv_quant as kvq
from parallm_engine.kv.kv_cache import prefill_layout
from parallm_engine.kv.table_reads import read_table, table_index
from parallm_engine.kv.page_pool import PageRow
from parallm_engine.kv.pipeline_tie import PipelineTie


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
    """One prefill forward's rows, all in one lane's pool (each ``PrefillRow`` taking ``new[i]`` more
    tokens): pages for the new tokens, the held tokens' slot table, RoPE offsets, the mask, and one cache
    per layer (``layers``: what the model is called with). Evaluate :meth:`arrays`, then :meth:`commit`
    (deferred: the writes; otherwise the forward made them)."""

    def __init__(self, lane_kv, rows: list[PrefillRow], new: list[int], shared_kv: list | None, *,
                 native=None, reads_pool: bool = False, deferred: bool = False,
                 grown: bool = False):
        """``grown``: the rows hold pages for their ``new`` tokens already (a fused step's rows that joined
        the batch before its forward: ``kv.fused_step``)."""
        self.lane_kv = lane_kv
        held = [r.row.length - (n if grown else 0) for r, n in zip(rows, new)]
        self.starts = [h + r.shared for h, r in zip(held, rows)]  # each row's first new position
        self.offset, mask, P, L = prefill_layout(held, new)
        if any(r.shared for r in rows):
            self.offset = self.offset + mx.array([r.shared for r in rows])
        self.mask = mask
        B = len(rows)
        self.deferred = deferred
        width = P if deferred else P + L  # deferred: attention reads only the held tokens from the pool
        table = np.zeros((B, width), dtype=np.int32)  # padding columns read page 0 (zeros)
        writes, real = [], []
        for i, (r, p, n) in enumerate(zip(rows, held, new)):
            if p:
                table[i, P - p : P] = r.row.slots(0, p)
            if not grown:
                r.row.grow(lane_kv.pool, n)
            writes.append(r.row.slots(p, p + n))
            if not deferred:
                table[i, P + L - n :] = writes[-1]
            real.append(i * L + L - n + np.arange(n, dtype=np.int32))
        self.table = mx.array(table) if width else None
        self.write_slots = mx.array(np.concatenate(writes))
        # a padded step: which of the B x L positions are real (only they are written)
        self.real = mx.array(np.concatenate(real)) if sum(new) < B * L else None
        self.native = native
        self.reads_pool = reads_pool and native is not None and not deferred
        uses = [bool(r.shared) for r in rows]
        self.shared_kv = shared_kv if any(uses) else None
        self.shared_mask = None if all(uses) else mx.array(uses, dtype=mx.bool_)
        self._index: dict = {}  # (KH, slots) -> the table's gather index, shared by the layers
        self.layers = [PagedPrefillKV(layer, self, l) for l, layer in enumerate(lane_kv.layers)]

    def arrays(self) -> list[mx.array]:
        """What evaluating the forward must compute: the pools written (deferred: the new keys and
        values, for :meth:`commit`)."""
        if self.deferred:
            return [a for c in self.layers for x in (c.new_k, c.new_v) for a in kvq.arrays(x)]
        return self._pools()

    def _pools(self) -> list[mx.array]:
        return [a for layer in self.lane_kv.layers for x in (layer.keys, layer.values) for a in kvq.arrays(x)]

    def write(self, layer, keys, values) -> None:
        """Store (B, KH, L, D) new keys and values (real positions only) in the rows' slots."""
        layer.write_new(keys, values, self.write_slots, self.native, self.real)

    def read(self, pool):
        """(B, KH, T, D) of the step's slot table from ``pool``, as stored."""
        key = pool.shape[:2]
        if key not in self._index:
            self._index[key] = table_index(self.table, *key)
        return read_table(pool, self._index[key])

    def commit(self) -> list[mx.array]:
        """Deferred: write the evaluated new keys and values into the rows' pages; the pool arrays to
        evaluate (nothing where the forward wrote them)."""
        if not self.deferred:
            return []
        for c in self.layers:
            self.write(c.layer, c.new_k, c.new_v)
            c.new_k = c.new_v = None
        return self._pools()


class PagedPrefillKV(PipelineTie):
    """One layer of a :class:`PagedPrefillStep`, as mlx-lm's models call a cache (``offset``,
    ``update_and_fetch``, ``make_mask``) plus the shared prefix the engine's attention hook reads."""

    def __init__(self, layer, step: PagedPrefillStep, index: int):
        self.layer = layer  # the lane's kv_pages.PagedLayerKV: the pool arrays
        self.step = step
        self._l = index
        self.new_k = self.new_v = None

    @property
    def offset(self) -> mx.array:
        return self.step.offset

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """The new (B, KH, L, D) keys and values go into the rows' pages (deferred: kept for
        :meth:`PagedPrefillStep.commit`); returns the step's keys and values as attention reads them: the
        pools themselves where the native kernel reads them (:meth:`native_inputs`), else the held tokens
        from the pool followed by the new ones."""
        step = self.step
        if not step.deferred:
            self.write(keys, values)
            return self.fetch()
        fmt = step.lane_kv.fmt
        self.new_k, self.new_v = kvq.store(keys, fmt), kvq.store(values, fmt)
        k, v = self.new_k, self.new_v
        if step.table is not None:
            k = kvq.concatenate([step.read(self.layer.keys), k], axis=2)
            v = kvq.concatenate([step.read(self.layer.values), v], axis=2)
        return kvq.as_float(k), kvq.as_float(v)

    def write(self, keys: mx.array, values: mx.array) -> None:
        """Not deferred: the new (B, KH, L, D) keys and values into the rows' pages now."""
        self.step.write(self.layer, keys, values)

    def fetch(self):
        """Not deferred, after :meth:`write`: the keys and values attention reads (the pools as stand-ins
        where the native kernel reads them)."""
        if self.native_inputs() is not None:
            return self.layer.keys, self.layer.values
        return self.working_set()

    def working_set(self):
        return kvq.as_float(self.step.read(self.layer.keys)), kvq.as_float(self.step.read(self.layer.values))

    def native_inputs(self):
        if not self.step.reads_pool or isinstance(self.layer.keys, kvq.QuantizedKV):
            return None
        return self.layer.keys, self.layer.values, self.step.table

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
