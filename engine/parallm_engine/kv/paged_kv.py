"""The KV cache manager of the "attention" layout (every layer full attention: ``model_caches``).

Every row's KV is in pages of its decode lane's pool (``decode_batch``, ``kv_pages``); the prefix cache is
a radix tree (``radix_cache``) whose entries are those pages, held by reference. A prompt's row is opened in
the lane it will decode in, borrowing the pages of its hit; its prefill writes the rest once
(``paged_prefill``); it joins the batch as it is, and the tree takes its pages (in-flight dedup: the next
step's prompts find them). The batch may hold one prefix every row continuing it reads once (cascade
attention: ``prefix_sharing``).
"""

from __future__ import annotations

import logging
import time
import weakref

import numpy as np

from parallm_engine.kv.decode_batch import DecodeBatch
from parallm_engine.kv.disk_tier import MIN_TAIL_TOKENS, DiskTier, kv_fingerprint
from parallm_engine.kv.kv_cache_manager import KVCacheManager
from parallm_engine.kv.kv_pages import PagedLaneKV, PagedSegment
from parallm_engine.kv.memory_budget import buffer_cache_bytes
from parallm_engine.kv.paged_prefill import PrefillRow
from parallm_engine.kv.prefix_sharing import continues_shared, share_for_prefill, shared_prefix_flags
from parallm_engine.kv.radix_cache import PrefixMatch, RadixCache, segment_layers, shared_context_len
from parallm_engine.kv.session_pins import SessionPins

logger = logging.getLogger("parallm_engine")

# A match whose last node adds only a few tokens (a fan-out's " Question 1" reaching into the sibling
# " Question 12") stops at the node before: those tokens are prefilled again, and the prefix is the same
# for every prompt of the fan-out, so a prefill group can read it once as the batch's shared prefix
# (prefix_sharing.share_for_prefill). At most 7 tokens are recomputed.
SHORT_TAIL_TOKENS = 8


def _without_short_tail(match: PrefixMatch) -> PrefixMatch:
    nodes = match.nodes()
    if len(nodes) > 1 and len(nodes[-1].tokens) < SHORT_TAIL_TOKENS:
        return PrefixMatch(nodes[-2], match.length - len(nodes[-1].tokens))
    return match


class PagedKVManager(KVCacheManager):
    takes_ragged_steps = True
    rolls_back = True

    def __init__(self, model, model_info, config, family, layout: str):
        self.radix = RadixCache(config.radix_budget_bytes) if config.enable_prefix_cache else None
        super().__init__(model, model_info, config, family, layout, None, self.radix)
        self.batch = DecodeBatch(self.n_layers, config.decode_lanes, self.kv_format, self.meter,
                                 keep_working_sets=config.decode_working_set,
                                 micro_batches=getattr(config, "micro_batches", False))
        self.batch.working_set_limit = self._working_set_limit(config)
        if self.radix is not None:  # the tree's paged entries live in the lanes' pools
            self.radix.page_nbytes = PagedLaneKV.page_bytes(self.kv_bytes_per_token)
            self.radix.cached_pages = self.batch.cached_pages
            self.radix.pinned_cached_pages = self.batch.pinned_cached_pages
        self._unindexed: list = []  # rows that joined for this step's fused forward (index_fused)
        self.sessions = SessionPins(self.radix, config.session_ttl_s, self._session_bytes(), self.kv_bytes_per_token) \
            if self.radix is not None else None
        # The radix tree's disk tier (kv/disk_tier.py): float KV only.
        self.disk: DiskTier | None = None
        # sequence -> (the writer's blocks_queued when it was looked up, the reads started for it)
        self._disk_reads: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.prefill_rate: float | None = None  # the scheduler's measured prefill rate (prefetch gives it)
        self.events = None  # the block events' publisher (kv/kv_events.py)
        events = getattr(config, "kv_events", None)
        if events is not None and self.radix is not None:
            from parallm_engine.kv.kv_events import KVEventLog

            self.radix.events = KVEventLog(events.block_size)
            self.events = events.publisher()
        disk = getattr(config, "kv_disk", None)
        if disk is not None and disk.cap_bytes > 0 and self.radix is not None and self.kv_format is None:
            try:
                self.disk = DiskTier(disk, kv_fingerprint(disk.model_files, n_layers=self.n_layers,
                                                          kv_bytes_per_token=self.kv_bytes_per_token))
            except OSError:
                logger.warning("the prefix cache's disk tier is off: could not use %s", disk.root, exc_info=True)
            else:
                self.radix.on_evict = self._save_evicted

    def use_attention_hook(self, hooked: bool) -> None:
        """Decode rows continuing one cached prefix hold it once (cascade attention): that needs the radix
        tree (where the prefix's one copy comes from), the hook, and attention over the cached keys
        themselves (the family adapter); so does a ragged step reading the pool (MLA gets its keys gathered)."""
        reads_pool = self.family.reads_pool(hooked)
        self.share_prefix = bool(self.radix is not None and reads_pool)
        self.batch.attention_reads_pool = reads_pool

    @property
    def has_tree(self) -> bool:
        return self.radix is not None

    @property
    def prefill_lanes(self) -> int:
        return 1 if self.batch.micro_batches else len(self.batch.lanes)  # micro-batches share one stream

    # -- sessions (kv/session_pins.py) ----------------------------------------------------------
    def _session_bytes(self) -> int:
        return int(self.config.session_share * self.config.kv_budget_bytes)

    def keep_session(self, session: str, seq) -> None:
        if self.sessions is not None and not seq.embedding:
            self.sessions.keep(session, seq.prefill_ids[: seq.computed], seq.adapter_key)

    def expire_sessions(self, waiting=()) -> None:
        if self.sessions is not None and self.sessions.pins:
            self.sessions.max_bytes = self._session_bytes()  # (the budget may have been lowered: memory_recovery)
            self.sessions.expire(waiting=waiting)
            self.sessions.bound()
            self.radix.evict_to_budget()  # what they let go is an ordinary entry: within the tree's limit

    def release_session(self, session: str | None) -> int:
        if self.sessions is None:
            return 0
        released = self.sessions.release(session)
        self.radix.evict_to_budget()
        return released

    def yield_session(self, keep: str | None, nbytes: int = 0) -> bool:
        if self.sessions is None or not self.sessions.give_way(keep, nbytes):
            return False
        self.radix.evict_to_budget()
        return True

    def holds_kept_context(self, seq) -> bool:
        return self.sessions is not None and self.sessions.holds_own(seq.request.session) \
            and self.held_prefix_tokens(seq) > 0

    def yield_sessions_to_rows(self) -> None:
        """Kept sessions give way (in ``SessionPins`` order) while the rows do not fit, before any row is
        preempted: a pin keeps memory no running work needs (measured on the programs trace under a third of its
        working set: pins that stayed while rows were preempted cost 78 preemptions and 5x the job completion
        time of admission by program alone; docs/programs.md)."""
        if self.sessions is None or not self.sessions.pins:
            return
        # (each by what the rows lack: a row grown past its watermark should not cost an agent all its context)
        while self.rows_over_budget() and self.yield_session(None, self._rows_lack()):
            self.fit_cache()

    def _rows_lack(self) -> int:
        return self.rows_bytes(self.config.watermark_tokens) + self.pinned_cache_bytes() - self.budget

    # -- the disk tier --------------------------------------------------------------------------
    def prefetch(self, seq, prefill_rate: float | None) -> None:
        """A request arrived: start reading what the disk holds past what the tree holds (if reading is
        estimated faster than computing it); :meth:`match` takes it."""
        self.prefill_rate = prefill_rate
        if self._disk_eligible(seq):
            self._disk_reads[seq] = (self.disk.blocks_queued, self._disk_read(seq, prefill_rate))

    def _disk_eligible(self, seq) -> bool:
        return self.disk is not None and not seq.embedding and len(seq.prefill_ids) >= MIN_TAIL_TOKENS

    def _disk_read(self, seq, prefill_rate: float | None) -> list:
        ids = seq.prefill_ids
        held = self.radix.match(ids, record=False, ns=seq.adapter_key).length
        return self.disk.prefetch(seq.adapter_key, ids, held, self.kv_bytes_per_token, prefill_rate)

    def _restore(self, seq) -> None:
        """What was read for ``seq`` into the tree, past what it holds now (parts another prompt's restore
        put there already are skipped unwaited). Where nothing was found when it arrived and this process has
        written blocks since (the tree evicted them meanwhile), the disk is asked again now."""
        looked, reads = self._disk_reads.pop(seq, (None, []))
        if not reads and self._disk_eligible(seq) and looked != self.disk.blocks_queued:
            reads = self._disk_read(seq, self.prefill_rate)
        ids, ns = seq.prefill_ids, seq.adapter_key
        for read in reads:
            held = self.radix.match(ids, record=False, ns=ns).length
            end = min(read.start + read.n, len(ids))
            if held >= end:
                continue
            if held < read.start:
                return  # the part before it is missing (evicted meanwhile): computed instead
            try:
                restore = read.future.result()  # read in the background since the request arrived
            except Exception:  # noqa: BLE001  (a disk error costs a recompute, never the request)
                logger.warning("could not read KV blocks from disk", exc_info=True)
                return
            if restore is None:
                return
            end = min(restore.start + restore.n, len(ids))  # (what was read whole: a damaged file ends it)
            if held >= end:
                return
            # Written once into pages of the lane the prompt will decode in, held by the tree alone: the
            # prompt and every later one borrow them as they borrow any cached prefix.
            layers = self.disk.device_layers(restore, held, end)
            if layers[0][0].shape[2] != end - held:  # never a node whose KV is not its tokens'
                return
            lane = self.batch.place(seq, 0)
            with lane.context():
                row = lane.kv.open_row(np.zeros(0, dtype=np.int32), layers)
                lane.kv.flush_writes()
                segment = PagedSegment(lane.kv, row.slots(0))
                lane.kv.close_row(row)
            self.radix.insert(ids[:end], lambda a, b: segment, ns=ns)
            self.disk.hit_tokens += end - held

    def _save_evicted(self, ns, nodes: list) -> None:
        """A leaf leaves the tree for room: the blocks it completes go to disk (write-behind)."""
        try:
            self.disk.save(ns, nodes, lambda nd: segment_layers(nd.kv), only_last=True)
        except Exception:  # noqa: BLE001  (the disk tier never fails a step)
            logger.warning("could not save an evicted prefix to disk", exc_info=True)

    def publish_events(self) -> None:
        if self.events is not None:
            self.events.publish(self.radix.events.take())

    def close(self) -> None:
        if self.events is not None:
            self.publish_events()
            self.events.close()
            self.events = None

    def persist(self, timeout: float = 8.0) -> None:
        """The blocks the tree holds to disk, most recently used first, within ``timeout`` seconds in all
        (shutdown: the engine thread must end before the interpreter does)."""
        if self.disk is None:
            return
        deadline = time.monotonic() + timeout / 2
        try:
            for leaf in sorted(self.radix.leaves(), key=lambda n: -n.last_used):
                if time.monotonic() > deadline:
                    break
                ns, nodes = self.radix.path(leaf)
                self.disk.save(ns, nodes, lambda nd: segment_layers(nd.kv), only_last=False)
        except Exception:  # noqa: BLE001
            logger.warning("could not save the prefix cache to disk", exc_info=True)
        self.disk.close(max(0.0, deadline + timeout / 2 - time.monotonic()))
        self.disk = None
        self.radix.on_evict = None

    # -- 1. a prompt's prefix -------------------------------------------------------------------
    def match(self, seq) -> None:
        """Pin the longest prefix of ``seq``'s context the tree holds (``seq.match``); its tokens are computed
        (the row borrows their pages). Blocks read from disk for it join the tree first."""
        if self.radix is not None and not seq.embedding:  # embedding rows neither read nor fill it (embedding.py)
            if self.disk is not None:
                self._restore(seq)
            seq.match = _without_short_tail(self.radix.match(seq.prefill_ids, ns=seq.adapter_key))
            self.radix.pin(seq.match.node)
            seq.cached_tokens = seq.match.length
        seq.computed = seq.cached_tokens

    def held_prefix_tokens(self, seq) -> int:
        """A sequence holding its match pinned (admitted, its row not opened yet) borrows all of it; a waiting
        one, what pinned nodes hold of its context (a kept session's, a prefix being prefilled): the bytes
        ``pinned_bytes`` counts already, so a session's next turn is not charged for its context twice."""
        if self.radix is None or seq.embedding:
            return 0
        if seq.match is not None:
            return seq.match.length
        return self.radix.pinned_prefix(seq.prefill_ids, ns=seq.adapter_key)

    def peek(self, seq) -> int:
        if self.radix is None or seq.embedding:
            return 0
        return self.radix.match(seq.prefill_ids, record=False, ns=seq.adapter_key).length

    def release(self, seq) -> None:
        row = seq.cache
        super().release(seq)
        if isinstance(row, PrefillRow) and row.kv is row.lane.kv:  # (not a pool the lanes dropped: clear)
            row.kv.close_row(row.row)
            if row.shared:
                self.batch.shared_readers -= 1
                self.batch.release_unused_shared()

    def unpin(self, seq) -> None:
        if seq.match is not None and self.radix is not None:
            self.radix.unpin(seq.match.node)
        seq.match = None

    # -- 2. a prompt's row ----------------------------------------------------------------------
    def open_rows(self, seqs: list) -> None:
        """Each sequence without one gets its row (``seq.cache``: a ``PrefillRow``) in the lane it will decode
        in, before its first forward. It reads the batch's shared prefix when it continues it (a prefill
        group continuing one cached prefix makes it the batch's shared prefix first), borrows the pages the
        prefix cache holds for the rest of its hit in that lane's pool, and stores only cached tokens the
        pool lacks (a hit held elsewhere) in pages of its own."""
        fresh = [s for s in seqs if s.cache is None]
        if self.share_prefix and len(fresh) > 1:
            share_for_prefill(self.batch, self.radix, fresh)
        lend = self._lend if self.radix is not None else None
        for seq in fresh:
            shared = self.batch.shared
            S = shared.length if shared is not None and continues_shared(seq, shared, seq.cached_tokens) else 0
            lane = self.batch.place(seq, S, lend)
            lent = lend(seq, lane.kv, S)[: max(0, seq.cached_tokens - S)] if lend is not None \
                else np.zeros(0, dtype=np.int32)
            copied = None
            if S + len(lent) < seq.cached_tokens:
                a, b = S + len(lent), seq.cached_tokens
                copied = [(k[..., a:b, :], v[..., a:b, :]) for k, v in self.radix.gather(seq.match)]
            with lane.context():
                row = lane.kv.open_row(lent, copied)
            seq.cache = PrefillRow(lane, row, S)
            if S:
                self.batch.shared_readers += 1

    def _lend(self, seq, lane_kv: PagedLaneKV, start: int):
        """Rows read the prefix they hit from the tree's pages in their lane (RadixCache.lendable_slots)."""
        return self.radix.lendable_slots(seq.match, lane_kv, start)

    def end_reads(self) -> None:
        if self.radix is not None:
            self.radix.end_reads()

    # -- 3. committing prompts ------------------------------------------------------------------
    def commit_prompts(self, seqs: list, fused: bool = False) -> None:
        """Contexts prefilled (all but their last token; ``seq.cache`` their row): the sequences join the batch
        now (one write per layer for all of them), each reading the prefix the tree holds in its lane's pool
        from there (borrowed pages) and writing the rest into its own pages, which the tree then holds by
        reference: a prompt's KV is held once, and the next step's prompts find it in the tree. ``fused``:
        the step's decode forward has yet to write their new tokens (``kv.fused_step``): the rows join as
        they were prefilled (no shared prefix is chosen from them, whose one copy would be read now), and
        the tree takes them once that forward is built (:meth:`index_fused`)."""
        if fused:
            self._join(seqs, as_prefilled=True)
            self._unindexed += seqs
        else:
            self._tree_tokens(seqs)  # read by the join (which rows continue a shared prefix)
            self._join(seqs)
            self._insert(seqs)

    def index_fused(self, built: bool) -> None:
        """A forward that failed wrote nothing: the tree must not hold those pages (the rows' own resumption
        re-prefills). Later steps' graphs read the pages after the built forward's writes."""
        seqs, self._unindexed = self._unindexed, []
        if built:
            rows = {id(s) for s in self.batch.running}
            seqs = [s for s in seqs if id(s) in rows]  # a row retired since it joined is gone
            self._tree_tokens(seqs)
            self._insert(seqs)

    def _tree_tokens(self, seqs: list) -> None:
        """Each sequence's leading tokens whose KV is bitwise the tree's copy, were it inserted now."""
        if self.radix is None:
            return
        # The tree keeps the copy that got there first: a sequence's KV is bitwise the tree's for what it
        # read from the tree and what it inserts, unless someone else inserted tokens it also computed
        # (then only the part it read): the tree now, or a sequence before it here (each inserts its whole
        # context).
        for i, seq in enumerate(seqs):
            ids = seq.prefill_ids
            held = self.radix.match(ids, record=False, ns=seq.adapter_key).length if ids else 0
            held = max([held] + [shared_context_len(seq, s) for s in seqs[:i]])
            seq.tree_tokens = len(ids) if held <= seq.cached_tokens else seq.cached_tokens

    def _insert(self, seqs: list) -> None:
        """Joined rows' contexts into the radix tree (their pages by reference)."""
        if self.radix is None:
            return
        for seq in seqs:
            if seq.prefill_ids:
                self.radix.insert(seq.prefill_ids, self.batch.row_segments(seq), ns=seq.adapter_key)

    def _join(self, seqs: list, as_prefilled: bool = False) -> None:
        if as_prefilled:  # each row keeps reading the shared prefix it was prefilled over, or holds its own
            flags = [bool(s.cache.shared) for s in seqs] if self.batch.shared is not None else None
        else:
            flags = shared_prefix_flags(self.batch, self.radix, seqs) if self.share_prefix else None
        self.batch.join(seqs, flags)

    # -- 4. a running row -----------------------------------------------------------------------
    def commit_row(self, seq) -> None:
        """Keep a running sequence's KV for every token but the last (which may not have run) in the tree."""
        if self.radix is not None:
            ids = seq.prefill_ids[: seq.computed]  # the tokens its KV holds
            if ids:
                self.radix.insert(ids, self.batch.row_segments(seq), ns=seq.adapter_key)

    # -- 5. freeing -----------------------------------------------------------------------------
    def evict_freed(self) -> None:
        if self.radix is not None:
            self.radix.evict_to_budget()

    def clear(self) -> None:
        """What the prefix cache held in the old pools goes with them (a failed step may have left them
        half-written)."""
        old = self.batch.clear()
        self._unindexed = []
        if self.radix is not None and old:
            self.radix.drop_lanes(old)

    # -- the step's pages -----------------------------------------------------------------------
    def trim(self) -> None:
        self.batch.trim()

    def reserve_decode(self) -> None:
        """Page pools grow only into budget nobody holds; the kept working sets stay within theirs (lowered
        with the KV budget after an allocation failure, ``memory_recovery``)."""
        self.batch.set_spare(self.spare_bytes(), self.kv_bytes_per_token)
        self.batch.working_set_limit = self._working_set_limit(self.config)

    @staticmethod
    def _working_set_limit(config) -> int:
        """Bytes the decode batch's kept working sets may take: ``memory_budget.working_set_bytes``, never
        more than the KV budget in effect, never less than the buffer cache's share."""
        floor = buffer_cache_bytes(config.kv_budget_bytes)
        return max(floor, min(config.working_set_bytes or floor, config.kv_budget_bytes))

    # -- what is held ---------------------------------------------------------------------------
    def held_bytes(self) -> int:
        """The lanes' page pools (the rows' pages and the tree's pages in them), a shared prefix unless it is
        the tree's own, and the tree's own arrays."""
        if self.radix is not None:
            return self.batch.held_nbytes() + self.radix.array_bytes
        return self.batch.held_nbytes()

    def memory_stats(self) -> dict:
        disk = self.disk.stats() if self.disk is not None else {}
        sessions = self.sessions.stats() if self.sessions is not None else {}
        return {**super().memory_stats(), **self.batch.page_stats(), **disk, **sessions}
