"""The running batch's membership and KV, split into lanes that decode in parallel on the CPU (its
forwards are the runner's: ``runner/batch_forward.py``).

MLX's CPU backend runs one stream's operations on one thread, and its elementwise kernels (``exp`` in
the softmax and SiLU, RoPE, the KV writes) are scalar. On a CPU with several cores one batch therefore
leaves all but one core idle for most of a step. Each lane holds a share of the running sequences,
with its own KV (:class:`~parallm_engine.kv.kv_pages.PagedLaneKV`: a page pool per layer, a page table per
row; lanes never write one array, so MLX does not serialise their graphs) and its own MLX stream, so the
lanes' forwards run at the same time on different cores; the BLAS runs single-threaded inside each
lane (see ``backend.cpu_lanes``), and a step over several lanes takes markedly less time than over one
(docs/benchmarks-archive.md). On Metal and CUDA there is one lane.

Rows are ordered lane by lane: :attr:`DecodeBatch.running` is lane 0's sequences, then lane 1's, and
the logits of the batch's forwards follow that order. Joining sequences fill the first
lane up to ``LANE_FILL_ROWS`` rows before the next lane gets any, then go to the lane with the fewest
rows: each lane reads all the weights every step, and while one lane runs alone the native kernels
(linear, attention) spread its work over every core anyway. A joining row whose prefix the prefix cache
holds in a running lane's pool (with room) goes to that lane, where it borrows the pages instead of
storing a copy. Up to ``LANE_FILL_ROWS`` rows one lane decodes faster than two half-full ones, and past
it two full lanes beat one (docs/benchmarks-archive.md, "What users compare with: llama.cpp, agent
traces, long context"). Streams are created lazily because MLX streams belong to the thread that made
them (the engine thread).

The batch may hold one :class:`~parallm_engine.kv.kv_cache.SharedPrefix` (chosen by the KV cache manager
through ``kv/prefix_sharing.py``): rows that continue it keep only their later tokens, every lane reads
the same prefix arrays, and it is released when the last such row leaves.
"""

from __future__ import annotations

import contextlib

import mlx.core as mx

from parallm_engine.kv.kv_cache import SharedPrefix
from parallm_engine.kv.kv_meter import KVWriteMeter
from parallm_engine.kv.kv_pages import PAGE, PagedLaneKV, PagedSegment

#: Rows a lane takes before the next lane gets any (see the module docstring).
LANE_FILL_ROWS = 32


class DecodeLane:
    """A share of the running sequences with its KV and (when there are several lanes) its stream."""

    def __init__(self, n_layers: int, fmt=None, meter=None):
        self.seqs: list = []
        self.kv = PagedLaneKV(n_layers, fmt, meter)
        self.stream = None

    def context(self):
        return mx.stream(self.stream) if self.stream is not None else contextlib.nullcontext()


class DecodeBatch:
    def __init__(self, n_layers: int, n_lanes: int = 1, fmt=None, meter: KVWriteMeter | None = None,
                 keep_working_sets: bool = True, micro_batches: bool = False):
        """``fmt``: the KV storage format (``kv_quant.KVFormat``; None: floats); ``meter``: where the lanes
        count the KV bytes they write; ``keep_working_sets``: lanes keep their decode working sets between
        plain steps (``decode_working_set``); ``micro_batches``: the lanes are a distributed pipeline's
        micro-batches: rows spread evenly over them (no lane fills first, no lane is a prompt's home for its
        cached prefix) and no lane has a stream of its own (the ranks' collectives run in one order)."""
        if n_lanes < 1:
            raise ValueError(f"n_lanes must be >= 1, got {n_lanes}")
        self.n_layers = n_layers
        self.fmt = fmt
        self.meter = meter if meter is not None else KVWriteMeter()
        self.keep_working_sets = keep_working_sets
        self.lanes = [DecodeLane(n_layers, fmt, self.meter) for _ in range(n_lanes)]
        for lane in self.lanes:
            lane.kv.ws.enabled = keep_working_sets
        self.fill_rows = 1 if micro_batches else LANE_FILL_ROWS  # rows a lane takes before the next gets any
        self.micro_batches = micro_batches

        self._streams_made = n_lanes == 1 or micro_batches
        self.shared: SharedPrefix | None = None
        self.shared_readers = 0  # prompts being prefilled that read the shared prefix (paged_prefill)
        # The model's attention takes the layer's keys and values only into the engine's attention hook,
        # whose native kernel can read the page pool (set by the KV cache manager): no working set is gathered.
        self.attention_reads_pool = False
        # Bytes the lanes' decode working sets kept between steps may take (kv/decode_working_set.py; set by
        # the KV cache manager: the MLX buffer cache the engine sets); None: no limit.
        self.working_set_limit: int | None = None

    def _ensure_streams(self) -> None:
        if not self._streams_made:
            device = mx.default_device()
            for lane in self.lanes:
                lane.stream = mx.new_stream(device)
            self._streams_made = True

    def lane_contexts(self) -> list:
        """Context managers that make each lane's stream the default (for work split by lane)."""
        self._ensure_streams()
        return [lane.context() for lane in self.lanes]

    # -- membership -----------------------------------------------------------------------------
    @property
    def running(self) -> list:
        """Every running sequence, in row order (lane by lane)."""
        if len(self.lanes) == 1:
            return self.lanes[0].seqs
        return [s for lane in self.lanes for s in lane.seqs]

    def __len__(self) -> int:
        return sum(len(lane.seqs) for lane in self.lanes)

    def set_shared(self, prefix: SharedPrefix) -> None:
        """Hold ``prefix`` once for the rows that will join continuing it (none may use one now)."""
        if self.shared is not None:
            raise RuntimeError("the batch already holds a shared prefix")
        self._ensure_streams()
        self.shared = prefix
        for lane in self.lanes:
            with lane.context():
                lane.kv.set_shared(prefix.kv)

    def _release_shared(self) -> None:
        prefix, self.shared = self.shared, None
        for lane in self.lanes:
            with lane.context():
                lane.kv.set_shared(None)
        prefix.release()

    def place(self, seq, start: int, lend=None) -> DecodeLane:
        """The lane whose pool a prompt's row is opened in (``paged_prefill``: it is prefilled there and
        decodes there). ``lend(seq, lane_kv, start)``: slots of ``lane_kv``'s pool holding the sequence's
        tokens from ``start`` on that the prefix cache holds (the row borrows them instead of a copy)."""
        self._ensure_streams()
        counts = [len(lane.seqs) + len(lane.kv.pending) for lane in self.lanes]
        g = self._home_lane(seq, counts, start, lend)
        if g is None:
            g = next((i for i, c in enumerate(counts) if c < self.fill_rows), None)
        if g is None:
            g = counts.index(min(counts))
        return self.lanes[g]

    def join(self, seqs: list, shared: list[bool] | None = None) -> None:
        """Add prefilled sequences: each ``seq.cache`` is its ``paged_prefill.PrefillRow``, whose pages in
        its lane's pool hold its KV already (nothing is copied). Those flagged in ``shared`` continue the
        batch's shared prefix (rows that hold it drop those tokens)."""
        flags = shared or [False] * len(seqs)
        items = [(s, f, s.cache.lane) for s, f in zip(seqs, flags)]
        for lane in self.lanes:
            mine = [(s, f) for s, f, home in items if home is lane]
            if not mine:
                continue
            with lane.context():
                lane.kv.adopt([s.cache.row for s, _ in mine], [f for _, f in mine],
                              [bool(s.cache.shared) for s, _ in mine])
            for s, _ in mine:
                if s.cache.shared:
                    self.shared_readers -= 1
                s.cache = None
            lane.seqs.extend(s for s, _ in mine)

    def _home_lane(self, seq, counts: list[int], start: int, lend) -> int | None:
        """A running lane with room whose pool holds the longest prefix of ``seq`` the prefix cache can
        lend (a row reads only its own lane's pool: elsewhere it would store a copy), or None. Idle lanes
        are not woken for it (each running lane reads all the weights every step)."""
        if lend is None or len(self.lanes) == 1:
            return None
        best, best_len = None, 0
        for g, lane in enumerate(self.lanes):
            if 0 < counts[g] < self.fill_rows:
                n = len(lend(seq, lane.kv, start))
                if n > best_len:
                    best, best_len = g, n
        return best

    def adopt_shared(self, seqs: set[int]) -> None:
        """Running sequences (``id()`` in ``seqs``) that joined with their whole KV and continue the
        shared prefix just set (bitwise) read it from now on: their own copy of it is dropped."""
        for lane in self.lanes:
            rows = [i for i, s in enumerate(lane.seqs) if id(s) in seqs]
            if rows:
                with lane.context():
                    lane.kv.share_rows(rows)

    def drop(self, seqs: set[int]) -> None:
        """Remove the sequences whose ``id()`` is in ``seqs``."""
        for lane in self.lanes:
            if not any(id(s) in seqs for s in lane.seqs):
                continue
            keep = [i for i, s in enumerate(lane.seqs) if id(s) not in seqs]
            with lane.context():
                lane.kv.keep(keep)
            lane.seqs = [lane.seqs[i] for i in keep]
        self.release_unused_shared()

    def release_unused_shared(self) -> None:
        """The shared prefix goes when no running row and no prefilling prompt reads it."""
        if self.shared is not None and not self.shared_readers \
                and not any(any(lane.kv.shared_rows) for lane in self.lanes):
            self._release_shared()

    def clear(self) -> list[PagedLaneKV]:
        """Forget every row and start the lanes' KV afresh; returns the old lanes' KV (the prefix cache
        must drop what it held in their pools)."""
        old = [lane.kv for lane in self.lanes]
        for lane in self.lanes:
            lane.seqs = []
            lane.kv = PagedLaneKV(self.n_layers, self.fmt, self.meter)
            lane.kv.ws.enabled = self.keep_working_sets
        self.shared_readers = 0
        if self.shared is not None:
            self._release_shared()
        return old

    # -- KV of the rows' positions ---------------------------------------------------------------
    def rollback_rows(self, widths: int | list[int], keeps: list[int]) -> None:
        """After a block forward of ``widths`` positions per row (or a ragged one, a list:
        row i's own), row i (row order) keeps its first ``keeps[i]`` (each row's table just ends there:
        rows end where they end)."""
        start = 0
        for lane in self.lanes:
            n = len(lane.seqs)
            if n:
                part = widths if isinstance(widths, int) else widths[start : start + n]
                lane.kv.rollback_rows(part, keeps[start : start + n])
            start += n

    # -- KV access ------------------------------------------------------------------------------
    def row_segments(self, seq):
        """A function (start, end) -> ``seq``'s KV of tokens [start, end) for the radix tree: the pages
        they are in, held by reference (``PagedSegment``), or private copies where part of them is the
        batch's shared prefix."""
        for lane in self.lanes:
            for i, s in enumerate(lane.seqs):
                if s is seq:
                    kv = lane.kv
                    kv.flush_writes()  # the tree reads these pages from now on
                    P = kv.shared_len if kv.shared_rows[i] else 0

                    def segment(a: int, b: int):
                        if a < P:
                            return kv.row(i, a, b)
                        return PagedSegment(kv, kv.rows[i].slots(a - P, b - P))

                    return segment
        raise KeyError("sequence is not in the batch")

    def footprint(self, extra: int, bytes_per_token: int) -> int:
        """KV bytes the batch's rows need after ``extra`` more decode steps: each lane's pages (every row
        its own length, rounded up to a page) and the shared prefix once. The pool arrays may be larger
        only by budget nobody else holds (:meth:`set_spare`); :meth:`nbytes` is what they hold."""
        pages = sum(lane.kv.pages_after(extra) for lane in self.lanes if lane.seqs)
        own = pages * PagedLaneKV.page_bytes(bytes_per_token)
        return own + (self.shared.held_nbytes() if self.shared is not None else 0)

    def set_spare(self, spare_bytes: int, bytes_per_token: int) -> None:
        """The KV budget left free (the rows with their watermark and the prefix cache taken): what the
        lanes' page pools may grow into beyond their rows' pages, shared between the lanes."""
        pages = max(0, spare_bytes) // PagedLaneKV.page_bytes(bytes_per_token) // len(self.lanes)
        for lane in self.lanes:
            lane.kv.pool.spare = pages

    def page_stats(self) -> dict:
        """The lanes' pages: tokens per page, pages the rows hold, and pages allocated but free."""
        return {
            "kv_page_tokens": PAGE,
            "kv_pages_used": sum(lane.kv.pool.used for lane in self.lanes),
            "kv_pages_cached": self.cached_pages(),
            "kv_pages_free": sum(len(lane.kv.pool.free) for lane in self.lanes if lane.kv.layers[0].keys is not None),
            # the decode working sets kept between steps: a read copy of the rows' own tokens (not KV budget)
            "kv_working_set_bytes": sum(lane.kv.ws.nbytes(lane.kv.layers) for lane in self.lanes),
            "kv_working_set_rebuilds": sum(lane.kv.ws.rebuilds for lane in self.lanes),
            "kv_working_set_appends": sum(lane.kv.ws.appends for lane in self.lanes),
        }

    def cached_pages(self) -> int:
        """Pages of the lanes' pools that only the prefix cache holds."""
        return sum(lane.kv.pool.cached for lane in self.lanes)

    def pinned_cached_pages(self) -> int:
        """Of those, the pages pinned prefix-cache entries hold (it cannot give them back now)."""
        return sum(lane.kv.pool.pinned_cached for lane in self.lanes)

    def trim(self) -> None:
        """Lanes whose pools hold much more than their pages in use shrink (see PagedLaneKV.trim)."""
        for lane in self.lanes:
            with lane.context():
                lane.kv.trim()

    def nbytes(self) -> int:
        """KV bytes of the running batch: the pages its rows hold (each once), and the shared prefix once."""
        rows = sum(lane.kv.rows_nbytes() for lane in self.lanes)
        return rows + (self.shared.nbytes() if self.shared is not None else 0)

    def held_nbytes(self) -> int:
        """KV bytes the lanes' arrays and the shared prefix keep alive, each once: the pools (the rows'
        pages, the prefix cache's pages in them, free pages) and a shared prefix unless it is the radix
        tree's own arrays (counted there)."""
        pools = sum(lane.kv.nbytes() for lane in self.lanes)
        return pools + (self.shared.held_nbytes() if self.shared is not None else 0)

