"""The KV cache manager: every KV hand-off of the engine, behind one interface the scheduler calls.

It owns the running rows' KV (the decode batch's lanes and their page pools), the prefix cache (the
radix tree for the "attention" layout, whole-state snapshots for the "mixed" one; ``model_caches``
says which) and the one KV budget (``kv_manager.KVManager``, its base). A sequence's KV goes through
it at every step of its life:

- ``match``: look its context up in the prefix cache and pin the hit until its prefill is done;
  ``peek`` looks without pinning; ``release`` / ``unpin`` let go of the hit (and the prompt's row).
- ``open_rows`` (attention layout): the prompt's row in the pool of the lane it will decode in,
  borrowing the hit's pages; its prefill writes its KV there, once (``paged_prefill``).
  ``prompt_cache`` (mixed layout): the caches its prefill starts from (the snapshot, or empty ones).
- ``commit_prompts``: finished prompts go into the prefix cache and the sequences into the batch
  (attention layout: the rows join as they are, and the tree holds their pages by reference);
  ``join_late``: mixed-layout rows join after the step's prefill; ``commit_split``: after the step, a
  mixed-layout chunk that ended at a prefix other queued prompts share is snapshotted.
- ``prefills_alone`` / ``takes_ragged_steps`` / ``rolls_back`` / ``prefill_lanes``: what this KV can do,
  which the planner and the runner ask instead of naming a layout.
- ``commit_row``: a running row's context into the prefix cache (retiring, preemption);
  ``free_rows`` / ``clear``: its KV goes.
- ``trim`` / ``reserve_decode`` / ``end_reads``: page pools follow the budget around a step.
- ``running_bytes`` / ``held_bytes`` / ``memory_stats``: what is held.
"""

from __future__ import annotations

import numpy as np

from parallm_engine.kv.memory_budget import buffer_cache_bytes
from parallm_engine.kv import kv_quant
from parallm_engine.runner.decode_batch import DecodeBatch
from parallm_engine.kv.kv_manager import KVManager
from parallm_engine.kv.kv_meter import KVWriteMeter
from parallm_engine.kv.kv_pages import PagedLaneKV
from parallm_engine.kv.model_caches import MixedDecodeBatch, cache_arrays, cache_layout, layout_rolls_back, make_cache
from parallm_engine.kv.paged_prefill import PrefillRow
from parallm_engine.kv.prefix_sharing import continues_shared, share_for_prefill, shared_prefix_flags
from parallm_engine.kv.radix_cache import PrefixMatch, RadixCache
from parallm_engine.kv.radix_cache import shared_context_len
from parallm_engine.kv.snapshot_cache import SnapshotCache

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


class KVCacheManager(KVManager):
    def __init__(self, model, model_info, config, family):
        self.model = model  # for the mixed layout's empty caches (mlx-lm's make_cache)
        self.family = family
        self.layout = cache_layout(model, family.model_type)
        self.n_layers = len(make_cache(model))  # caches, not layers: some layers (MLP blocks) take none
        self.kv_format = kv_quant.format_for_model(config.kv_bits, model, self.n_layers, self.layout)
        self.kv_bytes_per_token = kv_quant.bytes_per_token(model, self.n_layers, self.kv_format) \
            if self.kv_format else model_info.kv_bytes_per_token()
        self.meter = KVWriteMeter()  # KV bytes written into the pages (tests/test_kv_writes.py)
        if self.layout == "attention":
            batch = DecodeBatch(self.n_layers, config.decode_lanes, self.kv_format, self.meter)
            batch.working_set_limit = self._working_set_limit(config)
            self.radix = RadixCache(config.radix_budget_bytes) if config.enable_prefix_cache else None
            self.snapshots = None
        else:
            batch = MixedDecodeBatch()
            self.radix = None
            self.snapshots = SnapshotCache(config.radix_budget_bytes) if config.enable_prefix_cache else None
        self.share_prefix = False  # set by use_attention_hook
        if self.radix is not None:  # the tree's paged entries live in the lanes' pools
            self.radix.page_nbytes = PagedLaneKV.page_bytes(self.kv_bytes_per_token)
            self.radix.cached_pages = batch.cached_pages
        super().__init__(config, self.kv_bytes_per_token, batch, self.prefix_cache)
        self._unindexed: list = []  # rows that joined for this step's fused forward (index_fused)

    def use_attention_hook(self, hooked: bool) -> None:
        """The model runner installed the engine's attention hook (``hooked``) or not. Decode rows
        continuing one cached prefix hold it once (cascade attention): that needs the radix tree (where
        the prefix's one copy comes from), the hook, and attention over the cached keys themselves (the
        family adapter); so does a ragged step reading the pool (MLA gets its keys gathered)."""
        if self.layout != "attention":
            return
        reads_pool = self.family.reads_pool(hooked)
        self.share_prefix = bool(self.radix is not None and reads_pool)
        self.batch.attention_reads_pool = reads_pool

    @property
    def prefix_cache(self):
        return self.radix if self.radix is not None else self.snapshots

    @property
    def running(self) -> list:
        """The decoding sequences; row i of the batch's logits is ``running[i]``."""
        return self.batch.running

    @property
    def has_tree(self) -> bool:
        """Prefixes computed are found by later prefills (radix tree), in the next step at the earliest."""
        return self.radix is not None

    @property
    def has_snapshots(self) -> bool:
        return self.snapshots is not None

    # What this KV can do, for the planner and the runner (the layout stays inside kv).
    @property
    def prefills_alone(self) -> bool:
        """A prompt's prefill runs alone through its own caches (mixed layout: mlx-lm's caches, which hold
        one sequence each until it joins the batch); otherwise prompts prefill side by side in pages."""
        return self.layout != "attention"

    @property
    def takes_ragged_steps(self) -> bool:
        """A decode forward can also compute prompts' chunks (rows of different lengths in one step,
        ``kv.fused_step``): the running rows' KV is in pages."""
        return self.layout == "attention"

    @property
    def rolls_back(self) -> bool:
        """A row's KV can be cut back to an earlier length (speculative decoding's rejected tokens)."""
        return layout_rolls_back(self.layout)

    @property
    def prefill_lanes(self) -> int:
        """The decode lanes a prompt's row may be placed in (a prefill forward per lane's stream)."""
        return len(self.batch.lanes) if self.layout == "attention" else 1

    # -- a prompt's prefix ----------------------------------------------------------------------
    def match(self, seq) -> None:
        """Look ``seq``'s context up in the prefix cache and pin what matched until its prefill is done
        (``seq.match``, ``seq.cached_tokens``): the hit's tokens count as computed (its row borrows them)."""
        ids = seq.prefill_ids
        if seq.embedding:  # embedding rows neither read nor fill the prefix cache (embedding.py says why)
            return
        if self.radix is not None:
            seq.match = _without_short_tail(self.radix.match(ids, ns=seq.adapter_key))
            self.radix.pin(seq.match.node)
            seq.cached_tokens = seq.match.length
        elif self.snapshots is not None:
            snap = self.snapshots.match(ids, ns=seq.adapter_key)
            if snap is not None:
                self.snapshots.pin(snap)
                seq.match = snap
                seq.cached_tokens = len(snap.tokens)
        seq.computed = seq.cached_tokens

    def peek(self, seq) -> int:
        """Context tokens the radix tree holds for ``seq`` now (nothing is pinned or counted)."""
        if self.radix is None or seq.embedding:
            return 0
        return self.radix.match(seq.prefill_ids, record=False, ns=seq.adapter_key).length

    def release(self, seq) -> None:
        """A prefilling sequence leaves (abort, failure, an embedding row done): its pin and its row's
        pages (or prefill caches) go."""
        self.unpin(seq)
        row, seq.cache = seq.cache, None
        if isinstance(row, PrefillRow) and row.kv is row.lane.kv:  # (not a pool the lanes dropped: clear)
            row.kv.close_row(row.row)
            if row.shared:
                self.batch.shared_readers -= 1
                self.batch.release_unused_shared()

    def unpin(self, seq) -> None:
        if seq.match is not None:
            if self.radix is not None:
                self.radix.unpin(seq.match.node)
            elif self.snapshots is not None:
                self.snapshots.unpin(seq.match)
        seq.match = None

    def prompt_cache(self, seq) -> list:
        """Mixed layout: a sequence's caches before its first forward (the snapshot hit, or empty ones)."""
        if seq.match is not None:
            return self.snapshots.restore(seq.match)
        return make_cache(self.model)

    def cache_state(self, caches: list) -> list:
        """Mixed layout: the arrays a prefill forward must evaluate to fill ``caches``."""
        return cache_arrays(caches)

    def open_rows(self, seqs: list) -> None:
        """Attention layout: each sequence without one gets its row (``seq.cache``: a ``PrefillRow``) in the
        lane it will decode in, before its first forward. It reads the batch's shared prefix when it
        continues it (a prefill group continuing one cached prefix makes it the batch's shared prefix
        first), borrows the pages the prefix cache holds for the rest of its hit in that lane's pool,
        and stores only cached tokens the pool lacks (a hit held elsewhere) in pages of its own."""
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

    def end_reads(self) -> None:
        """The step's prefill is over: tree pages read for it may be freed again."""
        if self.radix is not None:
            self.radix.end_reads()

    # -- committing -----------------------------------------------------------------------------
    def commit_split(self, seq) -> None:
        """Mixed layout: a chunk that ended at a prefix other queued prompts share snapshots it."""
        if self.snapshots is not None and seq.computed == seq.split:
            self.snapshots.insert(seq.prefill_ids[: seq.computed], seq.cache, ns=seq.adapter_key)

    def commit_prompts(self, seqs: list, fused: bool = False) -> None:
        """Contexts prefilled (all but their last token; ``seq.cache`` their KV): store them in the prefix
        cache (their KV holds their whole context: ``seq.computed``). Attention layout: the sequences
        join the batch now (one write per layer for all of them), each reading the prefix the tree holds in
        its lane's pool from there (borrowed pages) and writing the rest into its own pages, which the tree
        then holds by reference: a prompt's KV is held once, and the next step's prompts find it in the tree
        (in-flight dedup). ``fused``: the step's decode forward has yet to write their new tokens
        (``kv.fused_step``): the rows join as they were prefilled (no shared prefix is chosen from them,
        whose one copy would be read now), and the tree takes them once that forward is built
        (:meth:`index_fused`). Mixed layout: the rows join once the step's prefill is over (``join_late``)."""
        if self.layout == "attention":
            if fused:
                self._join(seqs, as_prefilled=True)
                self._unindexed += seqs
            else:
                self._tree_tokens(seqs)  # read by the join (which rows continue a shared prefix)
                self._join(seqs)
                self._insert(seqs)
        elif self.snapshots is not None:
            for seq in seqs:
                if seq.prefill_ids and seq.cached_tokens < len(seq.prefill_ids):
                    self.snapshots.insert(seq.prefill_ids, seq.cache, ns=seq.adapter_key)

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

    def index_fused(self, built: bool) -> None:
        """The step's fused prompts (``commit_prompts(fused=True)``) into the tree once the forward that
        writes their KV is built (``built``; later steps' graphs read them after its writes). A forward that
        failed wrote nothing: the tree must not hold those pages (the rows' own resumption re-prefills)."""
        seqs, self._unindexed = self._unindexed, []
        if built:
            rows = {id(s) for s in self.batch.running}
            seqs = [s for s in seqs if id(s) in rows]  # a row retired since it joined is gone
            self._tree_tokens(seqs)
            self._insert(seqs)

    def join_late(self, seqs: list) -> None:
        """Mixed layout: the step's prefilled rows join the batch once its prefill is over (attention-
        layout rows joined as their prefill ended, in ``commit_prompts``)."""
        if seqs and self.layout == "mixed":
            self._join(seqs)

    def _join(self, seqs: list, as_prefilled: bool = False) -> None:
        if self.layout == "mixed":
            self.batch.join(seqs, None)
            return
        if as_prefilled:  # each row keeps reading the shared prefix it was prefilled over, or holds its own
            flags = [bool(s.cache.shared) for s in seqs] if self.batch.shared is not None else None
        else:
            flags = shared_prefix_flags(self.batch, self.radix, seqs) if self.share_prefix else None
        self.batch.join(seqs, flags)

    def _lend(self, seq, lane_kv: PagedLaneKV, start: int):
        """Rows read the prefix they hit from the tree's pages in their lane (RadixCache.lendable_slots)."""
        return self.radix.lendable_slots(seq.match, lane_kv, start)

    def commit_row(self, seq) -> None:
        """Keep a running sequence's context in the prefix cache for the next turn or its own
        resumption: KV for every token but the last (which may not have run); a mixed model's whole
        state under exactly the tokens it has taken in (a pipelined step may have run one more: the
        state cannot be rewound, so the snapshot says so)."""
        if self.radix is not None:
            ids = seq.prefill_ids[: seq.computed]  # the tokens its KV holds
            if ids:
                self.radix.insert(ids, self.batch.row_segments(seq), ns=seq.adapter_key)
        elif self.snapshots is not None and seq.computed:
            self.snapshots.insert((seq.prompt_ids + seq.output_ids)[: seq.computed], self.batch.row_caches(seq),
                                  ns=seq.adapter_key)

    # -- freeing --------------------------------------------------------------------------------
    def free_rows(self, rows: set[int]) -> None:
        """The rows whose ``id()`` is in ``rows`` leave the batch."""
        self.batch.drop(rows)

    def evict_freed(self) -> None:
        """Pages rows gave up may now be the tree's alone: back within its budget."""
        if self.radix is not None:
            self.radix.evict_to_budget()

    def clear(self) -> None:
        """Drop every running row and start the lanes' KV afresh; what the prefix cache held in the old
        pools goes with them (a failed step may have left them half-written)."""
        old = self.batch.clear()
        self._unindexed = []
        if self.radix is not None and old:
            self.radix.drop_lanes(old)

    # -- the step's pages -----------------------------------------------------------------------
    def trim(self) -> None:
        """Attention layout: give back pages the prefix cache gave back."""
        if self.layout == "attention":
            self.batch.trim()

    def reserve_decode(self) -> None:
        """Before a decode step: page pools grow only into budget nobody holds; the kept working sets stay
        within theirs (lowered with the KV budget after an allocation failure, ``memory_recovery``)."""
        if self.layout == "attention":
            self.batch.set_spare(self.spare_bytes(), self.kv_bytes_per_token)
            self.batch.working_set_limit = self._working_set_limit(self.config)

    @staticmethod
    def _working_set_limit(config) -> int:
        """Bytes the decode batch's kept working sets may take: ``memory_budget.working_set_bytes``, never
        more than the KV budget in effect, never less than the buffer cache's share."""
        floor = buffer_cache_bytes(config.kv_budget_bytes)
        return max(floor, min(config.working_set_bytes or floor, config.kv_budget_bytes))

    # -- what is held ---------------------------------------------------------------------------
    def running_bytes(self) -> int:
        return self.batch.nbytes()

    def held_bytes(self) -> int:
        """Every KV byte the engine keeps alive, each once: the lanes' page pools (the rows' pages and the
        prefix cache's pages in them), a shared prefix unless it is the prefix cache's own, and the
        prefix cache's own arrays (radix tree) or snapshots."""
        cache = self.prefix_cache
        if self.radix is not None:
            return self.batch.held_nbytes() + self.radix.array_bytes
        return self.batch.held_nbytes() + (cache.total_bytes if cache is not None else 0)

    def memory_stats(self) -> dict:
        cache = self.prefix_cache
        return {
            "layout": self.layout,
            **self.stats(),
            "kv_bytes_running": self.running_bytes(),
            "kv_bytes_prefix_cache": cache.total_bytes if cache is not None else 0,
            "kv_bytes_held": self.held_bytes(),
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_bits": self.kv_format.bits if self.kv_format else None,
            **(self.batch.page_stats() if self.layout == "attention" else {}),
            **self.meter.as_dict(),
        }
