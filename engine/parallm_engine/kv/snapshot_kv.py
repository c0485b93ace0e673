"""The KV cache manager of the "mixed" layout (sliding-window or recurrent layers: ``model_caches``).

Each prompt is prefilled alone in its own instances of the model's caches (mlx-lm's semantics exactly),
joins the running batch's mlx-lm batched caches once the step's prefill is over, and leaves a whole-state
snapshot (``snapshot_cache``) as its prefix: neither a window nor a recurrent state can be cut at an
arbitrary token, so a later prompt resumes from the longest snapshot its context starts with. A first chunk
that ends where another queued prompt's context diverges is snapshotted there (``commit_split``), so the
others restore it instead of computing it again.
"""

from __future__ import annotations

from parallm_engine.kv.kv_cache_manager import KVCacheManager
from parallm_engine.kv.model_caches import MixedDecodeBatch, cache_arrays, make_cache
from parallm_engine.kv.snapshot_cache import SnapshotCache


class SnapshotKVManager(KVCacheManager):
    prefills_alone = True  # rolls_back stays False: a window or a recurrent state cannot be cut back

    def __init__(self, model, model_info, config, family, layout: str):
        self.snapshots = SnapshotCache(config.radix_budget_bytes) if config.enable_prefix_cache else None
        super().__init__(model, model_info, config, family, layout, MixedDecodeBatch(), self.snapshots)

    @property
    def has_snapshots(self) -> bool:
        return self.snapshots is not None

    # -- a prompt's prefix ----------------------------------------------------------------------
    def match(self, seq) -> None:
        """Pin the longest snapshot ``seq``'s context starts with (``seq.match``); its tokens are computed."""
        if self.snapshots is not None and not seq.embedding:
            snap = self.snapshots.match(seq.prefill_ids, ns=seq.adapter_key)
            if snap is not None:
                self.snapshots.pin(snap)
                seq.match = snap
                seq.cached_tokens = len(snap.tokens)
        seq.computed = seq.cached_tokens

    def unpin(self, seq) -> None:
        if seq.match is not None and self.snapshots is not None:
            self.snapshots.unpin(seq.match)
        seq.match = None

    def open_rows(self, seqs: list) -> None:
        """Each sequence without them gets its own caches (``seq.cache``) before its first forward: the
        snapshot it hit, restored, or empty ones."""
        for seq in seqs:
            if seq.cache is None:
                seq.cache = self.snapshots.restore(seq.match) if seq.match is not None else make_cache(self.model)

    def cache_state(self, caches: list) -> list:
        """The arrays a prefill forward must evaluate to fill ``caches``."""
        return cache_arrays(caches)

    # -- committing -----------------------------------------------------------------------------
    def commit_split(self, seq) -> None:
        """A chunk that ended at a prefix other queued prompts share snapshots it."""
        if self.snapshots is not None and seq.computed == seq.split:
            self.snapshots.insert(seq.prefill_ids[: seq.computed], seq.cache, ns=seq.adapter_key)

    def commit_prompts(self, seqs: list, fused: bool = False) -> None:
        """Contexts prefilled (``seq.cache`` their whole state): snapshotted where the hit did not cover them;
        the rows join once the step's prefill is over (:meth:`join_late`). This layout never fuses."""
        if self.snapshots is None:
            return
        for seq in seqs:
            if seq.prefill_ids and seq.cached_tokens < len(seq.prefill_ids):
                self.snapshots.insert(seq.prefill_ids, seq.cache, ns=seq.adapter_key)

    def join_late(self, seqs: list) -> None:
        if seqs:
            self.batch.join(seqs, None)

    def commit_row(self, seq) -> None:
        """A running row's whole state under exactly the tokens it has taken in (a pipelined step may have run
        one more than it delivered: the state cannot be rewound, so the snapshot says so)."""
        if self.snapshots is not None and seq.computed:
            self.snapshots.insert((seq.prompt_ids + seq.output_ids)[: seq.computed], self.batch.row_caches(seq),
                                  ns=seq.adapter_key)
