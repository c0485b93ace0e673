"""A decode lane's working set kept from step to step where attention cannot read the page pool.

Where no kernel reads the pool through the slot table (MLX's SDPA on Metal, the CPU's MLX backend, MLA's
latents), attention takes each layer's keys and values laid out ``(B, KV heads, T, D)``, left-padded, and
``kv_pages`` gathers that working set from the pool: a copy of every row's KV, per layer, every step, a
noticeable share of a CPU decode step (docs/benchmarks-archive.md, "The working set kept between decode steps").
Between two plain decode steps of the same rows the working set changes by one column, each row's newest
token (the left-padded table grows by a column on the right and keeps the rest), so this keeps it and writes
that column: one ``(B, KH, 1, D)`` write per layer per step, as mlx-lm's ``BatchKVCache`` does, with room for
``ROOM`` more columns. Any other change (rows joining or leaving, a rollback, a multi-position step, a shared
prefix set, pages renumbered) invalidates it (``kv_pages`` calls :meth:`invalidate`) and the next plain step
gathers; the step after it, if the rows are unchanged, rebuilds the kept arrays with one gather (into the
wider array directly), and the steps after that append.

The pool stays the KV's home (the prefix cache's pages, prefills, preemption read it, and the KV budget counts
it); these arrays are a read copy of the running rows' own tokens (a shared prefix is not in them), which the
gather path builds one layer at a time: kept, they hold it for every layer at once. So they are bounded by
``limit`` bytes per lane (the decode batch's share of ``memory_budget.working_set_bytes``: memory the KV budget
leaves free, at most the budget itself, as mlx-lm's batch caches hold the rows' tokens once), reported as
``kv_working_set_bytes`` beside the KV budget's figures; above the limit, and for quantized KV (whose working
set is dequantized), every step gathers. ``PARALLM_DECODE_WORKING_SET=0`` turns it off.

An append step does not write its column into the pool: the kept arrays hold it, and the columns the pool
lacks (``PagedLayerKV.ws_pending``) are written in one scatter per array per layer when anything else is about to
happen to the lane (:meth:`flush`: the arrays invalidated or rebuilt, rows joining or leaving, the prefix
cache taking a row's pages, a row read). Why: on a GPU, and for a small model on a CPU, a decode step costs
what its operations cost to dispatch, and a pool write every step would be 2 scatters (and 2 copies into the
pool's layout) per layer per step that mlx-lm's caches do not have, a visible share of such a step
(docs/benchmarks-archive.md, "The pool written at a flush, not every append step"). Between two such events
the pool's copy of those columns is never read: only the running rows' own attention reads them, from the
kept arrays.
"""

from __future__ import annotations


import mlx.core as mx
import numpy as np

from parallm_engine.kv.table_reads import by_slot, read_table, table_index

#: Columns a rebuilt working set has room for beyond the step's, at least (a rebuild every ROOM steps at most;
#: the capacity is rounded up to a multiple of it, so runner/compiled_decode sees few shapes).
ROOM = 64


class DecodeWorkingSet:
    """What a lane's layers keep (``PagedLayerKV.ws``) and how this step updates it (``mode``)."""

    def __init__(self):
        self.enabled = True  # kept at all (the engine's ``decode_working_set`` option)
        self.table: np.ndarray | None = None  # the (B, T) slot table the layers' arrays hold
        self.capacity = 0  # columns the arrays have
        self.mode: str | None = None  # this step: "append", "rebuild", or None (gather, keep nothing)
        self.limit: int | None = None  # bytes the arrays may take (None: no limit)
        self._padded: np.ndarray | None = None  # the table widened to the capacity (padding: slot 0)
        self.padded: mx.array | None = None  # the same on the device, made when a layer gathers
        self._index: dict = {}
        self.appends = 0
        self.rebuilds = 0

    def invalidate(self, layers) -> None:
        """The rows' KV is about to change other than by a decode step's column: the columns the pool lacks
        are written to it, and the arrays dropped."""
        if self.table is None and not self.capacity:  # nothing kept (a layer keeps arrays only with a capacity)
            return
        self.flush(layers)
        self.table = None
        self.capacity = 0
        self._padded = self.padded = None
        self._index = {}
        for layer in layers:
            layer.ws = None

    def plan(self, table: np.ndarray, extends: bool, eligible: bool, slot_bytes: int, layers) -> None:
        """Before a step whose left-padded slot table is ``table``: append its last column if the arrays
        hold the table less that column, else rebuild them. ``extends``: ``table`` is the previous step's
        table plus a column (the lane knows: :meth:`PagedLaneKV._table`); ``eligible``: a plain one-position
        step of float KV that attention reads as a working set; ``slot_bytes``: one slot's KV over all layers."""
        B, T = table.shape
        self.mode = None
        eligible = eligible and B > 0 and self.enabled
        prev = self.table  # the previous step's table where it was eligible too (else invalidated: None)
        grew = eligible and extends and prev is not None and prev.shape == (B, T - 1)
        if grew and T <= self.capacity:
            self.mode = "append"
            self.appends += 1
            self._padded[:, T - 1] = table[:, T - 1]
            self.padded, self._index, self.table = None, {}, table
            return
        self.invalidate(layers)
        if not eligible:
            return
        # Rows that changed (joined, left, rolled back) gather this step as without a kept working set (one
        # built now would be thrown away at the next change of a churning batch); the table is remembered so
        # the next step can tell. The second step of the same rows (or one out of room) gathers once, with
        # room to append, within the limit.
        self.table = table
        capacity = -(-(T + ROOM) // ROOM) * ROOM  # a multiple of ROOM: the compiled step's shapes recur
        if grew and (self.limit is None or B * capacity * slot_bytes <= self.limit):
            self.capacity = capacity
            self._padded = np.zeros((B, capacity), dtype=np.int32)
            self._padded[:, :T] = table
            self.mode = "rebuild"
            self.rebuilds += 1

    def index(self, KH: int, S: int) -> mx.array:
        """A rebuild's (B, KH, capacity) gather index into a pool of KH x S slots (built once per step)."""
        key = (KH, S)
        if key not in self._index:
            if self.padded is None:
                self.padded = mx.array(self._padded)
            self._index[key] = table_index(self.padded, KH, S)
        return self._index[key]

    def fetch(self, layer, keys: mx.array, values: mx.array):
        """The layer's working set for this step, (B, KH, T, D) views of its arrays: this step's new keys and
        values (B, KH, 1, D) written as the last column (append: the pool takes it at :meth:`flush`), or the
        arrays gathered from the layer's pool (which holds this step's column already)."""
        T = self.table.shape[1]
        if self.defers(layer):
            K, V = layer.ws
            K[:, :, T - 1 : T] = keys
            V[:, :, T - 1 : T] = values
            self.appended(layer, K, V)
        else:
            K = read_table(layer.keys, self.index(layer.keys.shape[0], layer.keys.shape[1]))
            V = read_table(layer.values, self.index(layer.values.shape[0], layer.values.shape[1]))
            layer.ws, layer.ws_pending = (K, V), (T, T)
        return K[:, :, :T], V[:, :, :T]

    def defers(self, layer) -> bool:
        """Whether this step's new column of ``layer`` goes only to its kept arrays (the pool later: :meth:`flush`)."""
        return self.mode == "append" and layer.ws is not None

    def appended(self, layer, K: mx.array, V: mx.array) -> None:
        """``layer``'s kept arrays are now ``K``, ``V``, with this step's column, which the pool lacks. The
        meter counts the column now, once (the pool's copy at the flush is not counted again)."""
        layer.ws, layer.ws_pending = (K, V), (layer.ws_pending[0], self.table.shape[1])
        layer.lane.meter.written += (K.nbytes + V.nbytes) // K.shape[2]

    def flush(self, layers) -> None:
        """Write each layer's columns the pool lacks (``ws_pending``: appended since it was last written) into
        it, one scatter per array per layer for all of them; lazily, so in graph order a later write or read
        of the pool sees them. Only columns a forward computed count: a flush between a step's ``plan`` and
        its forward writes what the earlier steps appended."""
        slots = {}
        for layer in layers:
            a, b = layer.ws_pending
            if layer.ws is None or a >= b:
                continue
            if (a, b) not in slots:  # row by row, as by_slot lays the columns out
                slots[a, b] = mx.array(np.ascontiguousarray(self.table[:, a:b]).ravel())
            K, V = layer.ws
            layer.write(slots[a, b], by_slot(K[:, :, a:b]), by_slot(V[:, :, a:b]), counted=True)
            layer.ws_pending = (b, b)

    def nbytes(self, layers) -> int:
        return sum(a.nbytes for layer in layers if layer.ws is not None for a in layer.ws)
