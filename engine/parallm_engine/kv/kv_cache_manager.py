"""The KV cache manager: every KV hand-off of the engine, behind one interface the scheduler and the runner
call, with two implementations chosen by the model's cache layout (``kv_layouts.make_kv_cache_manager``):

- ``paged_kv.PagedKVManager`` ("attention"): rows in the decode lanes' page pools, prefixes in a radix
  tree that holds their pages by reference.
- ``snapshot_kv.SnapshotKVManager`` ("mixed": sliding windows, recurrent state): each prompt prefilled in
  mlx-lm's own caches, the running rows in its batched caches, prefixes kept as whole-state snapshots.

Both own the running rows' KV (``batch``), the prefix cache and the one KV budget (``memory_budget.KVBudget``,
the base). A sequence's KV goes through the verbs in this order:

1. ``match``: look its context up in the prefix cache and pin the hit until its prefill is done (its tokens
   count as computed); ``peek`` looks without pinning.
2. ``open_rows``: the row (paged) or the caches (snapshots) its prefill writes into, its KV handle
   (``seq.cache``), which only kv sets.
3. ``commit_split`` / ``commit_prompts`` / ``join_late`` / ``index_fused``: prefilled prompts go into the
   prefix cache and join the running batch.
4. ``commit_row``: a running row's context into the prefix cache (retiring, preemption).
5. ``release`` / ``unpin`` (a prompt leaving), ``free_rows`` / ``evict_freed`` / ``clear``: its KV goes.

Around a step: ``trim``, ``reserve_decode``, ``end_reads``; the budget: ``fit_cache``, ``rows_over_budget``,
``admission_room``, ``context_bytes``; what is held: ``running_bytes``, ``held_bytes``, ``memory_stats``.
What this KV can do is asked, never a layout named: ``prefills_alone``, ``takes_ragged_steps``,
``rolls_back``, ``prefill_lanes``, ``has_tree``, ``has_snapshots``.
"""

from __future__ import annotations

from parallm_engine.kv import kv_quant
from parallm_engine.kv.kv_meter import KVWriteMeter
from parallm_engine.kv.memory_budget import KVBudget
from parallm_engine.kv.model_caches import make_cache


class KVCacheManager(KVBudget):
    """What both implementations share; the verbs one of them lacks do nothing here."""

    # What this KV can do (the planner and the runner ask these instead of naming a layout).
    prefills_alone = False  # a prompt's prefill runs alone through its own caches
    takes_ragged_steps = False  # a decode forward can also compute prompts' chunks (kv.fused_step)
    rolls_back = False  # a row's KV can be cut back (speculative decoding's rejected tokens)
    has_snapshots = False  # prefixes are whole-state snapshots (a first chunk may stop at a shared prefix)
    radix = None  # the paged implementation's radix tree (read by tests and stats)
    snapshots = None  # the snapshot implementation's snapshot cache

    def __init__(self, model, model_info, config, family, layout: str, batch, prefix_cache):
        self.model = model
        self.family = family
        self.layout = layout
        self.n_layers = len(make_cache(model))  # caches, not layers: some layers (MLP blocks) take none
        self.kv_format = kv_quant.format_for_model(config.kv_bits, model, self.n_layers, layout)
        self.kv_bytes_per_token = kv_quant.bytes_per_token(model, self.n_layers, self.kv_format) \
            if self.kv_format else model_info.kv_bytes_per_token()
        self.meter = KVWriteMeter()  # KV bytes written into the pages (tests/test_kv_writes.py)
        self.share_prefix = False  # rows read one shared prefix copy (paged: use_attention_hook)
        super().__init__(config, self.kv_bytes_per_token, batch, prefix_cache)

    @property
    def prefix_cache(self):
        """The radix tree, the snapshot cache, or None (prefix caching off)."""
        return self.cache

    @property
    def running(self) -> list:
        """The decoding sequences; row i of the batch's logits is ``running[i]``."""
        return self.batch.running

    @property
    def has_tree(self) -> bool:
        """Prefixes computed are found by later prefills (radix tree), in the next step at the earliest."""
        return False

    @property
    def prefill_lanes(self) -> int:
        """The decode lanes a prompt's row may be placed in (a prefill forward per lane's stream)."""
        return 1

    def use_attention_hook(self, hooked: bool) -> None:
        """The model runner installed the engine's attention hook (``hooked``) or not."""

    # -- 1. a prompt's prefix -------------------------------------------------------------------
    def prefetch(self, seq, prefill_rate: float | None) -> None:
        """A request arrived: start reading what a lower tier holds of its prefix (the disk tier)."""

    def persist(self, timeout: float = 30.0) -> None:
        """Shutdown: what the prefix cache holds to its lower tier (the disk tier), writes finished."""

    def publish_events(self) -> None:
        """After a step: the prefix cache's block events of the step to outside routers (``kv_events``)."""

    def close(self) -> None:
        """Shutdown: what the manager runs beside the engine (the event publisher) stops."""

    def keep_session(self, session: str, seq) -> None:
        """A turn of ``session`` ended (``seq`` retired, its context committed): keep it for the next turn."""

    def expire_sessions(self, waiting=()) -> None:
        """Sessions whose time is up let go of what they kept, except those in ``waiting`` (a turn of theirs
        is queued)."""

    def yield_session(self, keep: str | None, nbytes: int = 0) -> bool:
        """Memory is short (by ``nbytes``; 0: unknown): a kept session (other than ``keep``) gives way; False if
        none could."""
        return False

    def holds_kept_context(self, seq) -> bool:
        """A kept session holds ``seq``'s own context (its pin, not only the prefix it shares with others)."""
        return False

    def yield_sessions_to_rows(self) -> None:
        """The running rows are over budget: kept sessions give way, where that spares every preemption."""

    def release_session(self, session: str | None) -> int:
        """``session`` (None: every session) lets go of what it kept; returns how many let go."""
        return 0

    def peek(self, seq) -> int:
        """Context tokens the prefix cache holds for ``seq`` now, where a later step would find them
        (nothing is pinned or counted)."""
        return 0

    def release(self, seq) -> None:
        """A prefilling sequence leaves (abort, failure, an embedding row done): its pin and its row's
        pages (or prefill caches) go."""
        self.unpin(seq)
        seq.cache = None

    def end_reads(self) -> None:
        """The step's prefill is over: prefix-cache pages read for it may be freed again."""

    # -- 3. committing prompts ------------------------------------------------------------------
    def commit_split(self, seq) -> None:
        """After the step: a chunk that ended at a prefix other queued prompts share is kept."""

    def join_late(self, seqs: list) -> None:
        """The step's prefilled rows that join once its prefill is over."""

    def index_fused(self, built: bool) -> None:
        """The step's fused prompts into the prefix cache once their forward is built."""

    # -- 5. freeing -----------------------------------------------------------------------------
    def free_rows(self, rows: set[int]) -> None:
        """The rows whose ``id()`` is in ``rows`` leave the batch."""
        self.batch.drop(rows)

    def evict_freed(self) -> None:
        """KV rows gave up may now be the prefix cache's alone: back within its budget."""

    def clear(self) -> None:
        """Drop every running row and start the batch's KV afresh."""
        self.batch.clear()

    # -- the step's pages -----------------------------------------------------------------------
    def trim(self) -> None:
        """Give back pages the prefix cache gave back."""

    def reserve_decode(self) -> None:
        """Before a decode step: memory the step's growth may take."""

    # -- what is held ---------------------------------------------------------------------------
    def running_bytes(self) -> int:
        return self.batch.nbytes()

    def held_bytes(self) -> int:
        """Every KV byte the engine keeps alive, each once."""
        cache = self.cache
        return self.batch.held_nbytes() + (cache.total_bytes if cache is not None else 0)

    def memory_stats(self) -> dict:
        cache = self.cache
        return {
            "layout": self.layout,
            **self.stats(),
            "kv_bytes_running": self.running_bytes(),
            "kv_bytes_prefix_cache": cache.total_bytes if cache is not None else 0,
            "kv_bytes_held": self.held_bytes(),
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_bits": self.kv_format.bits if self.kv_format else None,
            **self.meter.as_dict(),
        }
