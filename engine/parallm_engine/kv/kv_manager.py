"""The engine's one KV memory budget: the running rows and the prefix cache share it.

Admission, growth and preemption ask this object; the scheduler decides who runs. The running batch
takes what it needs (each sequence's context plus a watermark of decode steps); the prefix cache
(radix tree or mixed-layout snapshots) holds what the rows leave, up to its own cap, and gives way
first: its least recently used unpinned entries are evicted before any running sequence is preempted.
Pinned entries (a prefilling sequence's matched prefix, a shared prefix the batch reads) cannot be
evicted and count against the rows' share.

A shared prefix that is the radix tree's own arrays is counted once, by the tree; so are pages of the
lanes' pools that only the tree holds. Pages rows hold (their own, or a prefix borrowed from the tree)
are the rows', each once however many rows and tree nodes hold it.
"""

from __future__ import annotations


class KVManager:
    def __init__(self, config, bytes_per_token: int, batch, cache):
        self.config = config
        self.bytes_per_token = bytes_per_token
        self.batch = batch
        self.cache = cache  # RadixCache, SnapshotCache or None
        self.cache_cap = int(config.radix_budget_bytes)  # the prefix cache's own limit within the budget
        self.evicted_for_rows = 0  # prefix-cache bytes evicted to make room for running rows
        self.draft_kv_bytes = lambda: 0  # speculative decoding's draft-model KV for the rows (draft_model.py)

    @property
    def budget(self) -> int:
        return self.config.kv_budget_bytes

    # -- what is held ---------------------------------------------------------------------------
    def context_bytes(self, seq) -> int:
        """What admitting ``seq`` takes now: its context plus the watermark (not its max_tokens), less
        what its prompt's row holds already (``paged_prefill``: those pages count with the rows')."""
        row = getattr(seq.cache, "row", None)
        held = row.length if row is not None else 0
        return (seq.total_len + self.config.watermark_tokens - held) * self.bytes_per_token

    def rows_bytes(self, extra: int) -> int:
        """The running rows after ``extra`` more decode steps (pages they share counted once; a shared
        prefix or pages only the prefix cache holds are the cache's)."""
        return self.batch.footprint(extra, self.bytes_per_token) + self.draft_kv_bytes()

    def spare_bytes(self) -> int:
        """Budget nobody holds or will need within the watermark: the running rows' pages (grown by
        the watermark) and the prefix cache taken away."""
        cache = self.cache.total_bytes if self.cache is not None else 0
        return self.budget - self.rows_bytes(self.config.watermark_tokens) - cache

    def pinned_cache_bytes(self) -> int:
        """Prefix-cache bytes that cannot be evicted now."""
        if self.cache is None:
            return 0
        pinned = getattr(self.cache, "pinned_bytes", None)
        return pinned() if pinned is not None else 0

    # -- decisions ------------------------------------------------------------------------------
    def fit_cache(self, reserved: int = 0) -> int:
        """Shrink the prefix cache's limit to what the rows (grown by the watermark) and ``reserved``
        bytes (sequences admitted to prefill) leave, evicting least recently used unpinned entries down
        to it; returns the bytes evicted."""
        if self.cache is None:
            return 0
        room = self.budget - self.rows_bytes(self.config.watermark_tokens) - reserved
        self.cache.max_bytes = max(0, min(self.cache_cap, room))
        freed = self.cache.evict_to_budget()
        self.evicted_for_rows += freed
        return freed

    def rows_over_budget(self) -> bool:
        """Would the running rows, grown by the watermark, exceed what the budget leaves them once the
        prefix cache has given up everything it can?"""
        return self.rows_bytes(self.config.watermark_tokens) + self.pinned_cache_bytes() > self.budget

    def admission_room(self) -> int:
        """Bytes new sequences may take: the budget less the rows (with the watermark) and pinned
        prefix-cache entries (unpinned ones are evicted as rows need the room)."""
        return self.budget - self.rows_bytes(self.config.watermark_tokens) - self.pinned_cache_bytes()

    def stats(self) -> dict:
        return {
            "kv_budget_bytes": self.budget,
            "prefix_cache_cap_bytes": self.cache_cap,
            "prefix_cache_limit_bytes": self.cache.max_bytes if self.cache is not None else 0,
            "prefix_cache_pinned_bytes": self.pinned_cache_bytes(),
            "prefix_cache_evicted_for_rows_bytes": self.evicted_for_rows,
        }
