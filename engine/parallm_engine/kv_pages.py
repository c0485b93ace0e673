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
if the kernel declines). The measured cost of the gather is in docs/benchmarks.md. On the CPU a step's
new KV is written by the native ``paged_write`` (in place); elsewhere by MLX's scatter.

Page 0 is never handed out: padding columns of the table point at it, so a gathered working set holds
finite values everywhere (masked columns must not be NaN: 0 x NaN poisons a weighted sum).

A prefix every row may continue (``kv_cache.SharedPrefix``) stays outside the pool, held once and read
once per step by the cascade attention; rows that continue it store only their later tokens.
"""

from __future__ import annotations

import numpy as np
import mlx.core as mx
from mlx_lm.models.base import create_causal_mask

from . import kv_quant as kvq

PAGE = 8  # tokens per page (allocation granularity; attention reads the table token by token)
_GROW = 1.25  # pool arrays grow geometrically (each growth is one copy of the pool) ...
_SHRINK_SLACK = 2  # ... and shrink (one gather) to _GROW x the pages in use when they hold more than twice that
_MIN_PAGES = 32


class PagePool:
    """Which pages of a lane are free and who holds each used page: ``refs`` counts the rows holding it
    (their own pages, or a prefix they borrow from the prefix cache), ``tree`` the prefix cache's
    entries holding it (:class:`PagedSegment`). A page is free when neither holds it; ``cached`` pages
    are held by the prefix cache alone. Page 0 is reserved (padding target) and is neither free nor
    used. Pure accounting: the arrays live in the layers."""

    def __init__(self, capacity: int = 0):
        self.capacity = max(1, capacity)  # pages the arrays are sized for (page 0 included)
        self.refs = [0] * self.capacity
        self.tree = [0] * self.capacity
        self.free = list(range(self.capacity - 1, 0, -1))  # popped from the end: lowest ids first
        self.cached = 0
        # Spare pages the arrays may hold beyond what is used after a growth (set from the free KV
        # budget: growth slack never takes memory the budget does not have); None: no limit.
        self.spare: int | None = None

    @property
    def used(self) -> int:
        """Pages held by anyone (rows or the prefix cache)."""
        return self.capacity - 1 - len(self.free)

    @property
    def row_pages(self) -> int:
        """Pages at least one row holds."""
        return self.used - self.cached

    def alloc(self, n: int) -> list[int]:
        """``n`` pages with one holder each; the capacity grows (geometrically) when too few are free."""
        if n > len(self.free):
            exact = self.capacity + n - len(self.free)
            new = max(int(self.capacity * _GROW), _MIN_PAGES)
            if self.spare is not None:
                new = min(new, exact + self.spare)
            new = max(new, exact)
            self.refs += [0] * (new - self.capacity)
            self.tree += [0] * (new - self.capacity)
            self.free = list(range(new - 1, self.capacity - 1, -1)) + self.free
            self.capacity = new
        pages = [self.free.pop() for _ in range(n)]
        for p in pages:
            self.refs[p] = 1
        return pages

    def retain(self, pages: list[int]) -> None:
        """One more row holds these (held) pages: a prefix it borrows from the prefix cache."""
        for p in pages:
            assert self.refs[p] or self.tree[p], f"page {p} borrowed while free"
            if not self.refs[p]:
                self.cached -= 1
            self.refs[p] += 1

    def release(self, pages: list[int]) -> None:
        for p in pages:
            assert self.refs[p] > 0, f"page {p} released more often than held"
            self.refs[p] -= 1
            if self.refs[p] == 0:
                if self.tree[p]:
                    self.cached += 1
                else:
                    self.free.append(p)

    def tree_retain(self, pages: list[int]) -> None:
        """A prefix-cache entry holds these (held) pages too."""
        for p in pages:
            assert self.refs[p] or self.tree[p], f"page {p} cached while free"
            self.tree[p] += 1

    def tree_release(self, pages: list[int]) -> None:
        for p in pages:
            assert self.tree[p] > 0, f"page {p} released by the prefix cache more often than held"
            self.tree[p] -= 1
            if self.tree[p] == 0 and self.refs[p] == 0:
                self.cached -= 1
                self.free.append(p)

    def remap(self) -> dict[int, int]:
        """Renumber the used pages 1..used (the arrays are then gathered to match); returns old -> new."""
        live = [p for p in range(1, self.capacity) if self.refs[p] or self.tree[p]]
        mapping = {p: i + 1 for i, p in enumerate(live)}
        capacity = max(int((len(live) + 1) * _GROW), _MIN_PAGES)
        refs, tree = [0] * capacity, [0] * capacity
        for p, q in mapping.items():
            refs[q], tree[q] = self.refs[p], self.tree[p]
        self.refs, self.tree, self.capacity = refs, tree, capacity
        self.free = list(range(capacity - 1, len(live), -1))
        return mapping


def pages_of(slots: np.ndarray) -> list[int]:
    """The distinct pages ``slots`` lie in, in order of first appearance."""
    return list(dict.fromkeys((slots // PAGE).tolist()))


def remap_slots(slots: np.ndarray, mapping: dict[int, int]) -> np.ndarray:
    if not len(slots):
        return slots
    pages = np.asarray([mapping[p] for p in (slots // PAGE).tolist()], dtype=np.int32)
    return pages * PAGE + slots % PAGE


_NO_SLOTS = np.zeros(0, dtype=np.int32)


class PageRow:
    """One row's pages and where its tokens sit in them. Its first ``len(borrowed)`` tokens are read from
    slots of pages the prefix cache holds (``borrowed``; read-only: the row holds one reference on each of
    their pages, ``borrowed_pages``); the rest, its own tokens, occupy the slots ``head .. head + own`` of
    its own pages, which only it writes."""

    __slots__ = ("pages", "head", "length", "borrowed", "borrowed_pages")

    def __init__(self):
        self.pages: list[int] = []
        self.head = 0
        self.length = 0
        self.borrowed = _NO_SLOTS
        self.borrowed_pages: list[int] = []

    @property
    def own(self) -> int:
        return self.length - len(self.borrowed)

    def borrow(self, slots: np.ndarray, pool: PagePool) -> None:
        """Start the (empty) row with tokens read from these slots of pages the prefix cache holds."""
        assert not self.length, "only an empty row borrows a prefix"
        if len(slots):
            self.borrowed = np.asarray(slots, dtype=np.int32)
            self.borrowed_pages = pages_of(self.borrowed)
            pool.retain(self.borrowed_pages)
            self.length = len(slots)

    def slots(self, start: int = 0, end: int | None = None) -> np.ndarray:
        """The pool slots of tokens [start, end)."""
        end = self.length if end is None else end
        if end <= start:
            return np.zeros(0, dtype=np.int32)
        B = len(self.borrowed)
        if end <= B:
            return self.borrowed[start:end]
        own = self._own_slots(max(start, B) - B, end - B)
        return own if start >= B else np.concatenate([self.borrowed[start:], own])

    def _own_slots(self, start: int, end: int) -> np.ndarray:
        first, last = (self.head + start) // PAGE, (self.head + end - 1) // PAGE + 1
        base = np.asarray(self.pages[first:last], dtype=np.int32)[:, None] * PAGE
        run = (base + np.arange(PAGE, dtype=np.int32)).ravel()
        a = self.head + start - first * PAGE
        return run[a : a + end - start]

    def pages_for(self, length: int) -> int:
        """Own pages the row needs at ``length`` tokens."""
        own = length - len(self.borrowed)
        return (self.head + own + PAGE - 1) // PAGE if own > 0 else 0

    def grow(self, pool: PagePool, n: int) -> None:
        """Room for ``n`` more tokens (pages allocated as needed); the length grows by n."""
        need = self.pages_for(self.length + n) - len(self.pages)
        if need > 0:
            self.pages += pool.alloc(need)
        self.length += n

    def truncate(self, n: int, pool: PagePool) -> None:
        """Forget the last ``n`` (own) tokens; pages left empty are freed."""
        assert n <= self.own, "a row never forgets borrowed tokens from the end"
        self.length -= n
        keep = self.pages_for(self.length)
        if keep < len(self.pages):
            pool.release(self.pages[keep:])
            del self.pages[keep:]
        if not self.own:
            self.head = 0

    def drop_front(self, n: int, pool: PagePool) -> None:
        """Forget the first ``n`` tokens (they are read from a shared prefix from now on)."""
        B = len(self.borrowed)
        if B:
            kept = self.borrowed[min(n, B):]
            pages = pages_of(kept)
            still = set(pages)
            pool.release([p for p in self.borrowed_pages if p not in still])
            self.borrowed, self.borrowed_pages = kept, pages
            self.length -= min(n, B)
            n -= min(n, B)
        if not n:
            return
        own = self.own - n
        self.head += n
        self.length -= n
        gone = self.head // PAGE if own else len(self.pages)
        if gone:
            pool.release(self.pages[:gone])
            del self.pages[:gone]
        self.head = self.head - gone * PAGE if own else 0

    def remap(self, mapping: dict[int, int]) -> None:
        self.pages = [mapping[p] for p in self.pages]
        self.borrowed = remap_slots(self.borrowed, mapping)
        self.borrowed_pages = [mapping[p] for p in self.borrowed_pages]

    def clear(self, pool: PagePool) -> None:
        pool.release(self.pages)
        pool.release(self.borrowed_pages)
        self.pages, self.head, self.length = [], 0, 0
        self.borrowed, self.borrowed_pages = _NO_SLOTS, []


class PagedSegment:
    """A prefix-cache entry's KV held by reference: slots of a lane's pool (one reference on each page
    they touch, counted in ``PagePool.tree``). Nothing is copied to make one: a row's own pages become
    the cache's when it is inserted, and a later row borrows them back (``PageRow.borrow``)."""

    __slots__ = ("lane", "slots", "pages")

    def __init__(self, lane: "PagedLaneKV", slots: np.ndarray):
        self.lane = lane
        self.slots = np.asarray(slots, dtype=np.int32)
        self.pages = pages_of(self.slots)
        lane.pool.tree_retain(self.pages)
        lane.segments.add(self)

    def __len__(self) -> int:
        return len(self.slots)

    def split(self, k: int) -> tuple["PagedSegment", "PagedSegment"]:
        """Two segments for the first ``k`` tokens and the rest; this one is released."""
        upper, lower = PagedSegment(self.lane, self.slots[:k]), PagedSegment(self.lane, self.slots[k:])
        self.release()
        return upper, lower

    def release(self) -> None:
        if self.lane is not None:
            self.lane.pool.tree_release(self.pages)
            self.lane.segments.discard(self)
            self.lane = None

    def layers(self) -> list[tuple]:
        """Per layer (1, KH, n, D) keys and values (lazy gathers from the pool)."""
        return self.lane.read(self.slots)

    def cached_pages(self) -> int:
        """Pages of this segment no row holds."""
        refs = self.lane.pool.refs
        return sum(1 for p in self.pages if not refs[p])

    def remap(self, mapping: dict[int, int]) -> None:
        self.slots = remap_slots(self.slots, mapping)
        self.pages = [mapping[p] for p in self.pages]


class PagedLayerKV:
    """One layer of a lane, as mlx-lm's models call a cache (``offset``, ``update_and_fetch``,
    ``make_mask``) plus what the engine's attention hook reads (the shared prefix, :meth:`native_inputs`)."""

    def __init__(self, lane: "PagedLaneKV"):
        self.lane = lane
        self.keys = None  # (KH, capacity x PAGE, D) as stored (float, or kv_quant.QuantizedKV)
        self.values = None
        self.offset = mx.array([], dtype=mx.int32)
        self._shared_k = self._shared_v = None

    @property
    def mask_5d(self) -> bool:
        return self.lane.mask_5d

    # -- storage --------------------------------------------------------------------------------
    def _ensure(self, like_k, like_v) -> None:
        """Arrays sized for the lane's page capacity (created on the first write, grown with the pool)."""
        slots = self.lane.pool.capacity * PAGE
        if self.keys is None:
            KH = like_k.shape[-3]
            self.keys = kvq.zeros((KH, slots, like_k.shape[-1]), like_k)
            self.values = kvq.zeros((like_v.shape[-3], slots, like_v.shape[-1]), like_v)
        elif self.keys.shape[1] < slots:
            grow = [(0, 0), (0, slots - self.keys.shape[1]), (0, 0)]
            self.keys, self.values = kvq.pad(self.keys, grow), kvq.pad(self.values, grow)

    def write(self, slots: mx.array, keys, values) -> None:
        """Store (KH, n, D) keys and values (storage format) at ``slots`` (n,)."""
        self._ensure(keys, values)
        self.keys[:, slots] = keys
        self.values[:, slots] = values

    def remap(self, gather: mx.array) -> None:
        """The arrays rebuilt as ``gather`` (new slot -> old slot) picks them (the pool was renumbered)."""
        if self.keys is not None:
            self.keys, self.values = self.keys[:, gather], self.values[:, gather]

    def set_shared(self, keys, values) -> None:
        self._shared_k, self._shared_v = keys, values

    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    # -- the cache protocol ---------------------------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Write this step's (B, KH, n, D) keys and values to the slots :meth:`PagedLaneKV.begin` chose;
        return the step's working set (B, KH, T, D) gathered from the pool, or, when the engine's native
        attention reads the pool itself (``lane.native_reads``), the pools as stand-ins: the attention hook
        then builds the working set only if the native kernel declines (:meth:`working_set`)."""
        lane = self.lane
        nat = lane.native
        if nat is not None and lane.fmt is None and keys.dtype == mx.float32 and values.dtype == mx.float32:
            self._ensure(keys, values)
            self.keys = nat.paged_write(self.keys, keys, lane.step_write)
            self.values = nat.paged_write(self.values, values, lane.step_write)
        else:
            k = kvq.store(keys.transpose(1, 0, 2, 3).reshape(keys.shape[1], -1, keys.shape[-1]), lane.fmt)
            v = kvq.store(values.transpose(1, 0, 2, 3).reshape(values.shape[1], -1, values.shape[-1]), lane.fmt)
            self.write(lane.step_write, k, v)
        self.offset = self.offset + keys.shape[2]
        if self.native_inputs() is not None:
            return self.keys, self.values
        return self.working_set()

    def working_set(self):
        """This step's (B, KH, T, D) keys and values as attention reads them: one gather per array from
        the pool seen as (KH x slots) rows, straight into that layout (no transposing copy after it)."""
        return self._gather(self.keys), self._gather(self.values)

    def _gather(self, pool):
        KH, S = pool.shape[0], pool.shape[1]
        index = self.lane.step_index(KH, S)
        flat = lambda a: a.reshape(KH * S, a.shape[-1])[index]  # noqa: E731
        if isinstance(pool, kvq.QuantizedKV):
            return pool._like(tuple(flat(p) for p in pool._parts())).dequantize()
        return flat(pool)

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        if window_size is not None:
            raise ValueError("a sliding-window layer got a full-attention cache")  # never run it wrong
        mask = self.lane.step_mask
        if mask is None or not self.mask_5d:
            return mask
        return mask[:, :, None]

    def native_inputs(self):
        """(keys pool, values pool, slot table) for the native kernel, each pool (1, KH, slots, D), or
        None where it must not read them: quantized KV, or a model whose attention is not just the
        layer's keys and values into the engine's hook (MLA attends over its latents as keys and values)."""
        if not self.lane.native_reads or self.keys is None or isinstance(self.keys, kvq.QuantizedKV):
            return None
        return self.keys[None], self.values[None], self.lane.step_table

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

    def __init__(self, n_layers: int, fmt=None):
        self.fmt = fmt
        self.pool = PagePool()
        self.rows: list[PageRow] = []
        self.layers = [PagedLayerKV(self) for _ in range(n_layers)]
        self.segments: set[PagedSegment] = set()  # the prefix cache's entries on this pool
        self.mask_5d = False
        # The shared prefix (kv_cache.SharedPrefix): its length and which rows continue it.
        self.shared_len = 0
        self.shared_rows: list[bool] = []
        self.shared_mask: mx.array | None = None  # (B,) bool; None: every row continues it (or none is set)
        # The step being built (begin): where each row's new positions go, the left-padded table, the mask.
        self.step_write: mx.array | None = None
        self.step_table: mx.array | None = None
        self.step_mask = None
        self._step_index: dict = {}  # (KH, slots) -> the working set's gather index (step_index)
        self.native = None  # the native kernels module when it writes this step's KV (begin)
        self.native_reads = False  # the model's attention hook reads the pool through the native kernel

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
        assert not any(self.shared_rows), "rows still continue the current shared prefix"
        for layer, kv in zip(self.layers, per_layer or [(None, None)] * len(self.layers)):
            layer.set_shared(*kv)
        self.shared_len = 0 if not per_layer else per_layer[0][0].shape[2]
        self._sync()

    def add(self, per_layer: list[list], shared: list[bool] | None = None,
            borrowed: list[np.ndarray] | None = None) -> None:
        """Append rows: ``per_layer[layer][r]`` is row r's (1, KH, L, D) keys and values (the tokens after
        the shared prefix for rows flagged in ``shared``, and after the ones it borrows; (None, None) for
        none). ``borrowed[r]``: slots of this pool's prefix-cache pages row r starts with (read, not
        copied). Each row gets its own pages for the rest; one scatter per layer writes every joining row."""
        n = len(per_layer[0])
        shared = shared or [False] * n
        if any(shared) and not self.shared_len:
            raise ValueError("rows continue a shared prefix but none is set")
        lengths = [0 if k is None else k.shape[2] for k, _ in per_layer[0]]
        new = []
        for r, L in enumerate(lengths):
            row = PageRow()
            if borrowed is not None:
                row.borrow(borrowed[r], self.pool)
            row.grow(self.pool, L)
            new.append(row)
        if any(lengths):
            slots = mx.array(np.concatenate([r.slots(len(r.borrowed)) for r in new]))
            for layer, rows in zip(self.layers, per_layer):
                parts = [(k, v) for k, v in rows if k is not None and k.shape[2]]
                k = kvq.concatenate([kvq.store(p[0], self.fmt)[0] for p in parts], axis=1)
                v = kvq.concatenate([kvq.store(p[1], self.fmt)[0] for p in parts], axis=1)
                layer.write(slots, k, v)
        self.rows += new
        self.shared_rows += list(shared)
        self._sync()

    def share_rows(self, indices: list[int]) -> None:
        """Rows ``indices`` hold their whole context and their first ``shared_len`` tokens are bitwise the
        shared prefix: they drop those tokens (their pages are freed) and read the prefix instead."""
        P = self.shared_len
        assert P
        for i in indices:
            assert not self.shared_rows[i] and self.rows[i].length >= P, "row cannot share the prefix"
            self.rows[i].drop_front(P, self.pool)
            self.shared_rows[i] = True
        self._shrink_if_slack()
        self._sync()

    def keep(self, indices: list[int]) -> None:
        """Keep only these rows (in this order); the others' pages are freed."""
        kept = set(indices)
        for i, row in enumerate(self.rows):
            if i not in kept:
                row.clear(self.pool)
        self.rows = [self.rows[i] for i in indices]
        self.shared_rows = [self.shared_rows[i] for i in indices]
        if not self.rows and not self.pool.used:  # an idle lane holds no memory (but the cache's pages)
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
        elif not self.rows and self.layers[0].keys is not None:
            self.keep([])

    def _shrink_if_slack(self) -> None:
        if self.pool.capacity > max(_MIN_PAGES, _SHRINK_SLACK * (self.pool.used + 1)):
            self._shrink()

    def _shrink(self) -> None:
        """Renumber the used pages to the front and cut the arrays to match (one gather per array)."""
        mapping = self.pool.remap()
        order = [0] + sorted(mapping, key=mapping.get)
        gather = (np.asarray(order, dtype=np.int32)[:, None] * PAGE + np.arange(PAGE, dtype=np.int32)).ravel()
        pad = self.pool.capacity * PAGE - len(gather)
        gather = mx.array(np.concatenate([gather, np.zeros(pad, dtype=np.int32)]))  # spare pages: copies of 0
        for layer in self.layers:
            layer.remap(gather)
        for row in self.rows:
            row.remap(mapping)
        for seg in self.segments:
            seg.remap(mapping)

    def rollback_rows(self, width: int, keeps: list[int]) -> None:
        """After a forward that wrote ``width`` positions per row, row i keeps its first ``keeps[i]``."""
        for row, k in zip(self.rows, keeps):
            if width - k:
                row.truncate(width - k, self.pool)
        self._sync()

    # -- a step ---------------------------------------------------------------------------------
    def begin(self, n: int, native=None, native_reads: bool = False) -> None:
        """Before a forward of ``n`` positions per row: pages for them, where they are written, each
        layer's RoPE offsets, the left-padded slot table and the mask every layer reads. ``native``: the
        native kernels module (it writes the new KV); ``native_reads``: the model's attention goes through
        the engine's hook, whose native kernel reads the pool (no working set is gathered)."""
        self.native, self.native_reads = native, native_reads and native is not None
        before = self.positions()
        write = []
        for row in self.rows:
            start = row.length
            row.grow(self.pool, n)
            write.append(row.slots(start))
        lengths = self.lengths()
        T = max(lengths, default=0)
        table = np.zeros((len(self.rows), T), dtype=np.int32)  # padding reads page 0
        for i, row in enumerate(self.rows):
            if row.length:
                table[i, T - row.length :] = row.slots()
        self._step_index = {}
        self.step_write = mx.array(np.concatenate(write) if write else np.zeros(0, dtype=np.int32))
        self.step_table = mx.array(table)
        if n == 1 and len(set(lengths)) <= 1:
            self.step_mask = None  # every row sees every column: SDPA's unmasked path
        else:
            pad = mx.array([T - L for L in lengths], dtype=mx.int32)
            self.step_mask = create_causal_mask(n, offset=T - n, left_padding=pad)
        offset = mx.array(before, dtype=mx.int32)
        for layer in self.layers:
            layer.offset = offset

    def step_index(self, KH: int, S: int) -> mx.array:
        """(B, KH, T) rows of a pool flattened to (KH x S, D) that make this step's working set (built once
        per step and pool shape, shared by the layers)."""
        key = (KH, S)
        if key not in self._step_index:
            heads = mx.arange(KH, dtype=mx.int32)[None, :, None] * S
            self._step_index[key] = self.step_table[:, None, :] + heads
        return self._step_index[key]

    def _sync(self) -> None:
        self.step_write = self.step_table = self.step_mask = None
        self._step_index = {}
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
        slots = mx.array(self.rows[i].slots(max(start, P) - P, end - P)) if end > P else None
        out = []
        for layer in self.layers:
            ks, vs = [], []
            if start < P:
                ks.append(layer._shared_k[..., start : min(end, P), :])
                vs.append(layer._shared_v[..., start : min(end, P), :])
            if slots is not None:
                ks.append(layer.keys[:, slots][None])
                vs.append(layer.values[:, slots][None])
            cat = lambda parts: parts[0] if len(parts) == 1 else kvq.concatenate(parts, axis=2)  # noqa: E731
            out.append((kvq.contiguous(cat(ks)), kvq.contiguous(cat(vs))))
        return out

    def read(self, slots: np.ndarray) -> list[tuple]:
        """Per layer, the (1, KH, n, D) keys and values at ``slots`` (lazy gathers: copies once evaluated)."""
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
        after rows leave (_SHRINK_SLACK)."""
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
