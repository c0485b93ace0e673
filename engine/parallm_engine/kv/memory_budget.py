"""One memory budget per engine: its size, read from the device; how the running rows and the prefix
cache share it (``KVBudget``); and MLX's own allocator limits.

``kv_memory`` (an ``Engine`` option) is the KV budget the running rows and the prefix cache share
(``KVBudget``): a fraction of what the device offers (Metal's recommended working set, CUDA's
memory, RAM on the CPU; ``backend.device_memory``) or a number of bytes. Default: a quarter.

MLX keeps freed buffers in a cache for reuse and, on Metal, lets allocations run past the working
set into swap (its default limit is 1.5x the working set) until the OS kills the process: the abort
users of every MLX server report. The engine bounds both: the buffer cache to a share of the KV
budget, and on a GPU the allocation limit to the device's memory, so running out raises an error
the engine recovers from (``memory_recovery``: requests are requeued, never lost) instead of
swapping. On Metal the weights plus the budget are wired (kept resident), as mlx-lm's generate does.
These are process-wide MLX settings: with several engines in one process the largest wins.

How the budget is shared (``KVBudget``): admission, growth and preemption ask it; the scheduler decides who runs. The running batch
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

import logging

from parallm_engine.errors import InvalidRequestError

logger = logging.getLogger("parallm_engine")

DEFAULT_KV_FRACTION = 0.25
MIN_KV_BYTES = 64 << 20
CACHE_LIMIT_FLOOR = 512 << 20  # below this, a decode step's intermediates reallocate every step

_applied: dict[str, int] = {}  # the largest limits set so far in this process


def resolve_kv_memory(kv_memory, device_bytes: int) -> int:
    """``kv_memory`` (None, a fraction in (0, 1], or bytes) as bytes."""
    if kv_memory is None:
        return max(256 << 20, int(device_bytes * DEFAULT_KV_FRACTION))
    if isinstance(kv_memory, bool) or not isinstance(kv_memory, (int, float)):
        raise InvalidRequestError(f"kv_memory must be a fraction of device memory or a number of bytes, "
                                  f"got {type(kv_memory).__name__}", param="kv_memory")
    if isinstance(kv_memory, float):
        if not 0.0 < kv_memory <= 1.0:
            raise InvalidRequestError(f"kv_memory as a fraction must be in (0, 1], got {kv_memory}",
                                      param="kv_memory")
        return max(MIN_KV_BYTES, int(device_bytes * kv_memory))
    if kv_memory < MIN_KV_BYTES:
        raise InvalidRequestError(f"kv_memory must be at least {MIN_KV_BYTES} bytes (64 MiB), got {kv_memory}",
                                  param="kv_memory")
    return int(kv_memory)


def buffer_cache_bytes(kv_budget: int) -> int:
    """MLX's buffer cache for an engine with this KV budget: a step's intermediates (the decode working sets
    among them) are reused from it instead of allocated anew. The decode batch's kept working sets may take at
    least as much (:func:`working_set_bytes`)."""
    return max(CACHE_LIMIT_FLOOR, kv_budget // 4)


#: Memory kept free beside the weights, the KV budget and the kept working sets: a step's intermediates
#: (activations, logits, a prefill chunk's attention scores) and the rest of the process.
WORKING_SET_HEADROOM = 0.125


def working_set_bytes(device_bytes: int, kv_budget: int, weight_bytes: int) -> int:
    """Bytes the decode batch may keep as its working sets where attention cannot read the page pool
    (``kv/decode_working_set.py``): a second copy of the running rows' own tokens, as mlx-lm's batch caches
    are their only copy. They take memory the KV budget leaves free (the device's, less the weights, the
    budget and a headroom of ``WORKING_SET_HEADROOM``), never more than the budget itself (the rows they copy
    never hold more), never less than the buffer cache's share the engine always allowed."""
    free = int(device_bytes * (1 - WORKING_SET_HEADROOM)) - weight_bytes - kv_budget
    return max(buffer_cache_bytes(kv_budget), min(kv_budget, free))


def mlx_limits(device: str, device_bytes: int, kv_budget: int, weight_bytes: int) -> dict[str, int]:
    """The MLX limits an engine wants: ``cache`` (buffer cache) everywhere; on a GPU ``memory`` (the
    allocation limit) and on Metal ``wired``."""
    limits = {"cache": buffer_cache_bytes(kv_budget)}
    if device in ("gpu", "cuda"):
        limits["memory"] = int(device_bytes)
    if device == "gpu":
        limits["wired"] = min(int(device_bytes), weight_bytes + kv_budget)
    return limits


def apply_mlx_limits(limits: dict[str, int], mx=None) -> dict[str, int]:
    """Set ``limits`` (never lowering one a previous engine in this process raised); returns what is in
    effect. Builds without a setter (older MLX, wired limits off Metal) are skipped."""
    if mx is None:
        import mlx.core as mx
    setters = {"cache": "set_cache_limit", "memory": "set_memory_limit", "wired": "set_wired_limit"}
    for key, value in limits.items():
        value = max(value, _applied.get(key, 0))
        setter = getattr(mx, setters[key], None)
        if setter is None:
            continue
        try:
            setter(value)
        except (RuntimeError, ValueError) as exc:  # e.g. a wired limit above what the OS allows
            logger.warning("could not set MLX %s limit to %d bytes: %s", key, value, exc)
            continue
        _applied[key] = value
    return dict(_applied)


def mlx_memory() -> dict[str, int]:
    """MLX's allocator now: active, cached and peak bytes."""
    import mlx.core as mx

    return {"mlx_active_bytes": mx.get_active_memory(), "mlx_cache_bytes": mx.get_cache_memory(),
            "mlx_peak_bytes": mx.get_peak_memory()}


class KVBudget:
    """The engine's one KV budget, which the running rows and the prefix cache share (this module's
    docstring); the KV cache manager's base."""

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
        what its prompt's row holds already (``paged_prefill``: those pages count with the rows') or, before
        it has one, the prefix the budget counts as taken already (:meth:`held_prefix_tokens`)."""
        row = getattr(seq.cache, "row", None)
        held = row.length if row is not None else self.held_prefix_tokens(seq)
        return (seq.total_len + self.config.watermark_tokens - held) * self.bytes_per_token

    def held_prefix_tokens(self, seq) -> int:
        """Leading context tokens of ``seq`` (without a row yet) whose KV the budget already counts as held
        (pinned prefix-cache entries, which its row will borrow): admitting it takes only the rest."""
        return 0

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
