"""The running rows' KV in pages: a page pool per decode lane and a page table per row.

Every layer of a lane stores its keys and values in one pool array ``(KV heads, pages x PAGE, D)``
(head-major, so a row's tokens of one head lie in runs of PAGE consecutive rows of D). A row holds a list
of pages; its tokens fill them in order from ``head`` (the offset of its first token in its first page).
All layers of a lane share the page tables: a row's token t sits in the same slot of every layer's pool.

What this buys over one left-padded ``(B, H, longest, D)`` array per layer:

- a row costs the pages of its own length: a 6,000-token row joining 8 short ones allocates its own
  pages, not 6,000 columns for each of the 9 rows;
- joining writes only the joining rows' KV; a row leaving frees its pages (nothing else is copied);
- rows end where they end: a speculative step in which rows keep different numbers of verified
  positions just shortens each row's table (no holes, no compaction);
- admission counts the rows' pages (``PagedLaneKV.pages_after``); the arrays grow (by a quarter, one copy)
  only into KV budget nobody holds (``PagePool.spare``) and shrink when rows leave.

Attention reads the tables. On the CPU the engine's native kernel takes the pool and the ``(B, T)``
slot table and reads each visible key where it is (``cpu_kernels``; no copy). Everywhere else (MLX's
SDPA on Metal and CUDA, the MLX-ops attention, quantized KV) a layer's ``update_and_fetch`` hands back
the step's working set gathered from the pool, ``(B, KV heads, T, D)``, left-padded as mlx-lm's models
expect: one gather per array per layer per step. Where the native kernel reads the pool, none is built
(``update_and_fetch`` hands out the pools as stand-ins; the attention hook gathers the working set only
if the kernel declines). The measured cost of the gather is in docs/benchmarks-archive.md. On the CPU a step's
new KV is written by the native ``paged_write`` (in place); elsewhere by MLX's scatter, except in a step that
appends to the decode working set kept between steps: that leaves the pool's copy to the working set's next
flush (``decode_working_set``; :meth:`PagedLaneKV.flush_writes` before anything else reads or changes the
rows' pages).

Page 0 is never handed out: padding columns of the table point at it, so a gathered working set holds
finite values everywhere (masked columns must not be NaN: 0 x NaN poisons a weighted sum).

The radix tree holds pages too, by reference (:class:`PagedSegment`): when a prompt's prefill ends its
row writes it into its own pages and the tree holds those; a row retiring leaves its pages to the tree;
a later row borrows the tree's pages for the prefix it hits (``PageRow.borrow``: read-only) and writes
only its own tokens, always into pages of its own. Each page counts its row holders and its tree holders
(:class:`PagePool`); it is free when it has neither. So a prefix is held once however many rows and
tree nodes use it, and nothing is copied to share it.

A prefix every row may continue (``kv_cache.SharedPrefix``) stays outside the pool, held once and read
once per step by the cascade attention; rows that continue it store only their later tokens.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import mlx.core as mx
from mlx_lm.models.base import create_causal_mask

from parallm_engine.kv import kv_quant as kvq
from parallm_engine.kv.decode_working_set import DecodeWorkingSet
from parallm_engine.kv.table_reads import by_slot, read_table, table_index
from parallm_engine.kv.kv_meter import KVWriteMeter
from parallm_engine.runner import gpu_attention
from parallm_engine.kv.page_pool import MIN_PAGES, PAGE, SHRINK_SLACK, PagedSegment, PagePool, PageRow  # noqa: F401 (re-exported)


class RaggedStep(NamedTuple):
    """Where a ragged step's model rows (one position each) sit in the rows' attention rectangle."""

    cells: mx.array  # (N,) model row p -> its cell of the flattened (B x W) rectangle
    fill: mx.array  # (B x W,) cell -> the model row in it (a padding cell: 0, its output never read)
    width: int  # W
    mask: mx.array | None  # the rectangle's (B, 1, W, T) mask (left padding, causal, cells no row fills
    # see nothing); None: every cell sees every column


class PagedLayerKV:
    """One layer of a lane, as mlx-lm's models call a cache (``offset``, ``update_and_fetch``,
    ``make_mask``) plus what the engine's attention hook reads (the shared prefix, :meth:`native_inputs`)."""

    def __init__(self, lane: "PagedLaneKV"):
        self.lane = lane
        self.keys = None  # (KH, capacity x PAGE, D) as stored (float, or kv_quant.QuantizedKV)
        self.values = None
        self.offset = mx.array([], dtype=mx.int32)
        self._shared_k = self._shared_v = None
        self.ws = None  # the decode working set kept between steps (decode_working_set), if any
        self.ws_pending = (0, 0)  # its columns [a, b) the pool lacks (append steps' own; written at a flush)

    # -- storage --------------------------------------------------------------------------------
    def _ensure(self, like_k, like_v) -> None:
        """Arrays sized for the lane's page capacity (created on the first write, grown with the pool)."""
        slots = self.lane.pool.capacity * PAGE
        if self.keys is None:
            KH = like_k.shape[-3]
            self.keys = kvq.zeros((KH, slots, like_k.shape[-1]), like_k)
            self.values = kvq.zeros((like_v.shape[-3], slots, like_v.shape[-1]), like_v)
        elif self.keys.shape[1] < slots:
            self.lane.meter.moved += self.nbytes()  # one copy of the pool
            grow = [(0, 0), (0, slots - self.keys.shape[1]), (0, 0)]
            self.keys, self.values = kvq.pad(self.keys, grow), kvq.pad(self.values, grow)

    def write(self, slots: mx.array, keys, values, counted: bool = False) -> None:
        """Store (KH, n, D) keys and values (storage format) at ``slots`` (n,). ``counted``: the meter counted
        them already (decode columns, when the kept working set took them)."""
        self._ensure(keys, values)
        self.keys[:, slots] = keys
        self.values[:, slots] = values
        if not counted:
            self.lane.meter.wrote(keys, values)

    def write_new(self, keys: mx.array, values: mx.array, slots: mx.array, native=None, real=None) -> None:
        """Store a forward's (B, KH, n, D) new keys and values at ``slots`` (one per position, row by row).
        ``real``: the positions of the flattened B x n to keep (a padded prefill; None: all). The native
        kernel writes in place where it applies (``native``: its module; float32, unquantized, every
        position), else MLX's scatter (in place too when nothing still to run reads the pool)."""
        fmt = self.lane.fmt
        if native is not None and real is None and fmt is None \
                and keys.dtype == mx.float32 and values.dtype == mx.float32:
            self._ensure(keys, values)
            self.keys = native.paged_write(self.keys, keys, slots)
            self.values = native.paged_write(self.values, values, slots)
            self.lane.meter.wrote(keys, values)
            return
        k, v = by_slot(kvq.store(keys, fmt)), by_slot(kvq.store(values, fmt))
        if real is not None:
            k, v = k[:, real], v[:, real]
        self.write(slots, k, v)

    def remap(self, gather: mx.array) -> None:
        """The arrays rebuilt as ``gather`` (new slot -> old slot) picks them (the pool was renumbered)."""
        if self.keys is not None:
            self.lane.meter.moved += self.nbytes()
            self.keys, self.values = self.keys[:, gather], self.values[:, gather]

    def set_shared(self, keys, values) -> None:
        self._shared_k, self._shared_v = keys, values

    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    # -- the cache protocol ---------------------------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Write this step's (B, KH, n, D) keys and values to the slots :meth:`PagedLaneKV.begin` chose (an
        append step of the kept working set leaves that to its flush); return the step's working set (B, KH,
        T, D) kept or gathered from the pool, or, when the engine's native
        attention reads the pool itself (``lane.native_reads``), the pools as stand-ins: the attention hook
        then builds the working set only if the native kernel declines (:meth:`working_set`)."""
        ws = self.lane.ws
        self.offset = self.offset + keys.shape[2]
        if ws.defers(self):  # an append step: the kept arrays take the column, the pool later (ws.flush)
            return ws.fetch(self, keys, values)
        self.write_new(keys, values, self.lane.step_write, self.lane.native)
        if self.native_inputs() is not None:
            return self.keys, self.values
        if ws.mode is not None:  # rebuilt from the pool, this step's column in it
            return ws.fetch(self, keys, values)
        return self.working_set()

    def working_set(self):
        """This step's (B, KH, T, D) keys and values as attention reads them (:func:`read_table`)."""
        return self._gather(self.keys), self._gather(self.values)

    def _gather(self, pool):
        return kvq.as_float(read_table(pool, self.lane.step_index(pool.shape[0], pool.shape[1])))

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        if window_size is not None:
            raise ValueError("a sliding-window layer got a full-attention cache")  # never run it wrong
        return self.lane.step_mask

    def native_inputs(self):
        """(keys pool, values pool, slot table) for the kernel reading the pool, each pool (KH, slots, D),
        or None where it must not read them: quantized KV, or a model whose attention is not just the
        layer's keys and values into the engine's hook (MLA attends over its latents as keys and values).
        Called for every layer of every step: no MLX op here (host time a short GPU step waits for)."""
        if not self.lane.native_reads or self.keys is None or isinstance(self.keys, kvq.QuantizedKV):
            return None
        return self.keys, self.values, self.lane.step_table

    @property
    def ragged(self) -> "RaggedStep | None":
        return self.lane.ragged

    @property
    def step_starts(self) -> mx.array | None:
        """(B,) each row's first column of the step's slot table (the kernel reading the pool skips the rest)."""
        return self.lane.step_starts

    @property
    def shared_keys(self):
        return kvq.as_float(self._shared_k)

    @property
    def shared_values(self):
        return kvq.as_float(self._shared_v)

    @property
    def shared_mask(self):
        return self.lane.shared_mask


class PagedLaneKV:
    """A decode lane's KV: the page pool, each row's pages, and one :class:`PagedLayerKV` per layer
    (``layers``: what the model is called with)."""

    VERIFY_TABLE = False  # tests set it: every step's kept slot table is checked against a full build

    def __init__(self, n_layers: int, fmt=None, meter: KVWriteMeter | None = None):
        self.fmt = fmt
        self.meter = meter if meter is not None else KVWriteMeter()
        self.pool = PagePool()
        self.rows: list[PageRow] = []
        self.pending: list[PageRow] = []  # rows of prompts being prefilled into this pool (paged_prefill)
        self.layers = [PagedLayerKV(self) for _ in range(n_layers)]
        self.segments: set[PagedSegment] = set()  # the prefix cache's entries on this pool
        # The shared prefix (kv_cache.SharedPrefix): its length and which rows continue it.
        self.shared_len = 0
        self.shared_rows: list[bool] = []
        self.shared_mask: mx.array | None = None  # (B,) bool; None: every row continues it (or none is set)
        # The step being built (begin): where each row's new positions go, the left-padded table, the mask.
        self.step_write: mx.array | None = None
        self.step_table: mx.array | None = None
        self.step_mask = None
        self.step_starts: mx.array | None = None  # (B,) the table's first real column per row
        self._step_index: dict = {}  # (KH, slots) -> the working set's gather index (step_index)
        self.ragged: RaggedStep | None = None  # a ragged step's layout (begin)
        self.native = None  # the native kernels module when it writes this step's KV (begin)
        self.ws = DecodeWorkingSet()  # the working set kept between plain decode steps (decode_working_set)
        self.native_reads = False  # the model's attention hook reads the pool (native CPU kernel, gpu_attention)
        self._kept_table: np.ndarray | None = None  # the last plain step's slot table (_table)
        self._kept_lengths: list[int] = []

    def flush_writes(self) -> None:
        """The pool takes the decode columns only the kept working set holds (``DecodeWorkingSet.flush``):
        before anything but the running rows' next append step reads or changes the rows' pages."""
        self.ws.flush(self.layers)

    def lengths(self) -> list[int]:
        """Each row's own tokens (after the shared prefix when it continues one)."""
        return [r.length for r in self.rows]

    def positions(self) -> list[int]:
        """Each row's position: its tokens, the shared prefix's included."""
        return [r.length + (self.shared_len if u else 0) for r, u in zip(self.rows, self.shared_rows)]

    # -- membership -----------------------------------------------------------------------------
    def set_shared(self, per_layer: list | None) -> None:
        """Hold a prefix once ((1, KH, P, D) keys and values per layer; None: none) for rows that will
        continue it. Only while no row uses one."""
        self.flush_writes()
        assert not any(self.shared_rows), "rows still continue the current shared prefix"
        for layer, kv in zip(self.layers, per_layer or [(None, None)] * len(self.layers)):
            layer.set_shared(*kv)
        self.shared_len = 0 if not per_layer else per_layer[0][0].shape[2]
        self._sync()

    def add(self, per_layer: list[list], shared: list[bool] | None = None,
            borrowed: list[np.ndarray] | None = None) -> None:
        """Append rows whose KV was computed elsewhere (tests, benchmarks): ``per_layer[layer][r]`` is row r's
        (1, KH, L, D) keys and values (the tokens after the shared prefix for rows flagged in ``shared``, and
        after the ones it borrows; (None, None) for none). ``borrowed[r]``: slots of this pool's
        prefix-cache pages row r starts with (read, not copied). Each row is opened as a prompt's row is
        (:meth:`open_row`: its own tokens written once into its own pages) and joins (:meth:`adopt`)."""
        n = len(per_layer[0])
        shared = list(shared or [False] * n)
        if any(shared) and not self.shared_len:
            raise ValueError("rows continue a shared prefix but none is set")
        rows = []
        for r in range(n):
            kv = [layer_rows[r] for layer_rows in per_layer]
            lent = borrowed[r] if borrowed is not None else np.zeros(0, dtype=np.int32)
            rows.append(self.open_row(lent, None if kv[0][0] is None else kv))
        self.adopt(rows, shared, shared)

    def share_rows(self, indices: list[int]) -> None:
        """Rows ``indices`` hold their whole context and their first ``shared_len`` tokens are bitwise the
        shared prefix: they drop those tokens (their pages are freed) and read the prefix instead."""
        self.flush_writes()
        P = self.shared_len
        assert P
        for i in indices:
            assert not self.shared_rows[i] and self.rows[i].length >= P, "row cannot share the prefix"
            self.rows[i].drop_front(P, self.pool)
            self.shared_rows[i] = True
        self._shrink_if_slack()
        self._sync()

    def open_row(self, borrowed: np.ndarray, copied: list | None = None) -> PageRow:
        """A prompt's row before its prefill (``paged_prefill``): it borrows ``borrowed`` (slots of the prefix
        cache's pages in this pool) and stores ``copied`` (per layer (1, KH, n, D) keys and values of cached
        tokens this pool does not hold: a prefix the tree holds elsewhere) in pages of its own."""
        row = PageRow()
        row.borrow(borrowed, self.pool)
        if copied is not None and copied[0][0].shape[2]:
            # Evaluated first: a lazy read of this pool pending while it is written would make MLX copy
            # the whole pool array instead of writing it in place (it donates only unread buffers).
            mx.eval([a for k, v in copied for x in (k, v) for a in kvq.arrays(x)])
            start = row.length
            row.grow(self.pool, copied[0][0].shape[2])
            slots = mx.array(row.slots(start))
            for layer, (k, v) in zip(self.layers, copied):
                layer.write(slots, kvq.store(k, self.fmt)[0], kvq.store(v, self.fmt)[0])
        self.pending.append(row)
        return row

    def close_row(self, row: PageRow) -> None:
        """A prompt's row given up before it joined (abort, failure): its pages are freed."""
        self.pending.remove(row)
        row.clear(self.pool)

    def adopt(self, rows: list[PageRow], uses: list[bool], reads_shared: list[bool]) -> None:
        """Prefilled rows join the running rows as they are (their KV is in the pages already). ``uses[i]``:
        row i continues the shared prefix from now on; ``reads_shared[i]``: it was prefilled reading it
        (it holds only its later tokens) rather than holding it (then it drops those tokens now)."""
        self.flush_writes()
        for row, u, r in zip(rows, uses, reads_shared):
            assert u or not r, "a row prefilled over the shared prefix must keep reading it"
            self.pending.remove(row)
            if u and not r:
                row.drop_front(self.shared_len, self.pool)
        self.rows += rows
        self.shared_rows += list(uses)
        self._sync()

    def keep(self, indices: list[int]) -> None:
        """Keep only these rows (in this order); the others' pages are freed."""
        self.flush_writes()
        kept = set(indices)
        for i, row in enumerate(self.rows):
            if i not in kept:
                row.clear(self.pool)
        self.rows = [self.rows[i] for i in indices]
        self.shared_rows = [self.shared_rows[i] for i in indices]
        if not self.rows and not self.pending and not self.pool.used:  # an idle lane holds no memory
            self.pool = PagePool()
            for layer in self.layers:
                layer.keys = layer.values = None
        else:
            self._shrink_if_slack()
        self._sync()

    def trim(self) -> None:
        """Shrink the arrays when they hold much more than the pages in use (the prefix cache may have
        given pages back)."""
        if self.pool.used:
            self._shrink_if_slack()
        elif not self.rows and not self.pending and self.layers[0].keys is not None:
            self.keep([])

    def _shrink_if_slack(self) -> None:
        if self.pool.capacity > max(MIN_PAGES, SHRINK_SLACK * (self.pool.used + 1)):
            self._shrink()

    def _shrink(self) -> None:
        """Renumber the used pages to the front and cut the arrays to match (one gather per array)."""
        self.ws.invalidate(self.layers)
        self._kept_table = None
        mapping = self.pool.remap()
        order = [0] + sorted(mapping, key=mapping.get)
        gather = (np.asarray(order, dtype=np.int32)[:, None] * PAGE + np.arange(PAGE, dtype=np.int32)).ravel()
        pad = self.pool.capacity * PAGE - len(gather)
        gather = mx.array(np.concatenate([gather, np.zeros(pad, dtype=np.int32)]))  # spare pages: copies of 0
        for layer in self.layers:
            layer.remap(gather)
        for row in self.rows + self.pending:
            row.remap(mapping)
        for seg in self.segments:
            seg.remap(mapping)

    def rollback_rows(self, widths: int | list[int], keeps: list[int]) -> None:
        """After a forward that wrote ``widths`` positions per row (a list: row i's own), row i keeps its
        first ``keeps[i]`` of them."""
        self.flush_writes()
        widths = [widths] * len(self.rows) if isinstance(widths, int) else widths
        for row, w, k in zip(self.rows, widths, keeps):
            if w - k:
                row.truncate(w - k, self.pool)
        self._sync()

    # -- a step ---------------------------------------------------------------------------------
    def begin(self, n: int | list[int], native=None, native_reads: bool = False) -> None:
        """Before a forward of ``n`` positions per row (a list: row i's own count, a ragged step): pages
        for them, where they are written, each layer's RoPE offsets, the left-padded slot table and the
        mask every layer reads. ``native``: the native kernels module (it writes the new KV);
        ``native_reads``: the model's attention goes through the engine's hook, whose native kernel reads
        the pool (no working set is gathered).

        A ragged step's forward takes one position per model row (N = the counts' sum, row by row): the
        projections and MLP compute only real positions. Its attention runs on the rows as a rectangle of
        width max(n) (``ragged``: where each model row sits in it), through the engine's hook
        (:func:`cpu_kernels.ragged_attention`), so a row's keys are read once for all its positions."""
        widths = [n] * len(self.rows) if isinstance(n, int) else list(n)
        assert len(widths) == len(self.rows)
        self.native = native
        self.native_reads = native_reads and (native is not None or gpu_attention.available())
        before = self.positions()
        starts = [row.length for row in self.rows]
        for row, w in zip(self.rows, widths):
            row.grow(self.pool, w)
        first = self.layers[0].keys
        if first is not None and first.shape[1] < self.pool.capacity * PAGE:  # the arrays keep the pool's size
            for layer in self.layers:  # (an append step writes none: it would have grown them)
                layer._ensure(layer.keys, layer.values)
        lengths = self.lengths()
        T = max(lengths, default=0)
        W = max(widths, default=0)
        table, write, extends = self._table(T, starts, widths)
        self._step_index = {}
        self.step_write = mx.array(write)
        self.step_table = mx.array(table)
        self.step_starts = mx.array([T - L for L in lengths], dtype=mx.int32)  # each row's first column
        keys = self.layers[0].keys
        held = self.ws.table
        if self.VERIFY_TABLE and extends and held is not None and held.shape == (len(self.rows), T - 1):
            assert np.array_equal(table[:, :-1], held), "the working set holds another table"
        self.ws.plan(table, extends, isinstance(n, int) and n == 1 and not self.native_reads and self.fmt is None
                     and isinstance(keys, mx.array), self.nbytes() // keys.shape[1] if keys is not None else 0,
                     self.layers)
        if W == 1 and len(set(lengths)) <= 1:
            self.step_mask = None  # every row sees every column: SDPA's unmasked path
        else:
            pad = mx.array([T - L for L in lengths], dtype=mx.int32)
            self.step_mask = create_causal_mask(W, offset=T - W, left_padding=pad)
        self.ragged = None
        if isinstance(n, int):
            offset = mx.array(before, dtype=mx.int32)
        else:
            # Model row p is row i's position j: the rectangle's cell (i, W - w_i + j) (right-aligned, as
            # the row's new keys are in the table), at RoPE position before_i + j.
            cells = np.concatenate([i * W + W - w + np.arange(w) for i, w in enumerate(widths)]).astype(np.int32)
            fill = np.zeros(len(widths) * W, dtype=np.int32)  # a cell no model row fills repeats row 0's query
            fill[cells] = np.arange(len(cells), dtype=np.int32)
            mask = self.step_mask
            if mask is not None:  # the cells no row fills see nothing: the native kernel skips them
                filled = np.zeros(len(widths) * W, dtype=bool)
                filled[cells] = True
                mask = mx.logical_and(mask, mx.array(filled.reshape(len(widths), 1, W, 1)))
            self.ragged = RaggedStep(mx.array(cells), mx.array(fill), W, mask)
            offset = mx.array(np.concatenate([b + np.arange(w) for b, w in zip(before, widths)]).astype(np.int32))
        for layer in self.layers:
            layer.offset = offset

    def _table(self, T: int, starts: list[int], widths: list[int]) -> tuple[np.ndarray, np.ndarray, bool]:
        """The step's left-padded (B, T) slot table, the slots its new positions are written to, and whether
        the table extends the last step's by a column. After a plain decode step of the same rows (nothing
        else changed them: :meth:`_sync` and :meth:`_shrink` forget the kept table) it does, and is built
        from the rows' new slots alone (the full build walks every row's pages: host time a short GPU step
        waits for)."""
        kept, self._kept_table = self._kept_table, None
        B = len(self.rows)
        plain = all(w == 1 for w in widths)
        extends = kept is not None and kept.shape == (B, T - 1) and plain and self._kept_lengths == starts and B > 0
        if extends:
            write = np.fromiter((row.slot(row.length - 1) for row in self.rows), dtype=np.int32, count=B)
            table = np.concatenate([kept, write[:, None]], axis=1)
            if self.VERIFY_TABLE:  # tests: the kept table equals the full build
                assert np.array_equal(table, self._full_table(T)), "kept slot table differs from the rows' pages"
        else:
            table = self._full_table(T)
            parts = [row.slots(s) for row, s in zip(self.rows, starts)]
            write = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
        if plain:
            self._kept_table, self._kept_lengths = table, [row.length for row in self.rows]
        return table, write, extends

    def _full_table(self, T: int) -> np.ndarray:
        table = np.zeros((len(self.rows), T), dtype=np.int32)  # padding reads page 0
        for i, row in enumerate(self.rows):
            if row.length:
                table[i, T - row.length :] = row.slots()
        return table

    def step_index(self, KH: int, S: int) -> mx.array:
        """(B, KH, T) rows of a pool flattened to (KH x S, D) that make this step's working set (built once
        per step and pool shape, shared by the layers)."""
        key = (KH, S)
        if key not in self._step_index:
            self._step_index[key] = table_index(self.step_table, KH, S)
        return self._step_index[key]

    def _sync(self) -> None:
        self.ws.invalidate(self.layers)  # the rows changed other than by a decode step's column
        self._kept_table = None
        self.step_write = self.step_table = self.step_mask = self.step_starts = None
        self._step_index = {}
        self.ragged = None
        offset = mx.array(self.positions(), dtype=mx.int32)
        for layer in self.layers:
            layer.offset = offset
        uses = self.shared_rows
        self.shared_mask = None if not self.shared_len or all(uses) else mx.array(uses, dtype=mx.bool_)

    # -- reading a row --------------------------------------------------------------------------
    def row(self, i: int, start: int, end: int) -> list[tuple]:
        """Row i's tokens [start, end) (counted from the sequence's first token, the shared prefix
        included when the row continues it), per layer as private (1, KH, end - start, D) copies."""
        P = self.shared_len if self.shared_rows[i] else 0
        own = self.read(self.rows[i].slots(max(start, P) - P, end - P)) if end > P else None
        out = []
        for l, layer in enumerate(self.layers):
            ks, vs = [], []
            if start < P:
                ks.append(layer._shared_k[..., start : min(end, P), :])
                vs.append(layer._shared_v[..., start : min(end, P), :])
            if own is not None:
                ks.append(own[l][0])
                vs.append(own[l][1])
            cat = lambda parts: parts[0] if len(parts) == 1 else kvq.concatenate(parts, axis=2)  # noqa: E731
            out.append((kvq.contiguous(cat(ks)), kvq.contiguous(cat(vs))))
        return out

    def read(self, slots: np.ndarray) -> list[tuple]:
        """Per layer, the (1, KH, n, D) keys and values at ``slots`` (lazy gathers: copies once evaluated)."""
        self.flush_writes()
        index = mx.array(slots)
        return [(layer.keys[:, index][None], layer.values[:, index][None]) for layer in self.layers]

    # -- memory ---------------------------------------------------------------------------------
    @staticmethod
    def page_bytes(bytes_per_token: int) -> int:
        return PAGE * bytes_per_token

    def pages_after(self, extra: int) -> int:
        """Pages the rows hold after ``extra`` more positions each (what admission and preemption count):
        every page a row holds, once however many rows hold it (a borrowed prefix), and the own pages
        the rows grow into. Pages only the prefix cache holds are the cache's. The arrays may hold more: a
        growth step taken only from free budget (``PagePool.spare``), or up to twice the pages in use
        after rows leave (SHRINK_SLACK)."""
        growth = sum(r.pages_for(r.length + extra) - len(r.pages) for r in self.rows)
        return self.pool.row_pages + growth + 1

    def rows_nbytes(self) -> int:
        """Bytes of the pages the rows hold (the rest of the arrays: the cache's pages, free pages)."""
        if not self.rows or self.layers[0].keys is None:
            return 0
        slot_bytes = self.nbytes() // self.layers[0].keys.shape[1]
        return self.pool.row_pages * PAGE * slot_bytes

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)
