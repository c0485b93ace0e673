"""Which KV cache manager a model gets: the one for its cache layout (``model_caches.cache_layout``)."""

from __future__ import annotations

from parallm_engine.kv.kv_cache_manager import KVCacheManager
from parallm_engine.kv.model_caches import cache_layout
from parallm_engine.kv.paged_kv import PagedKVManager
from parallm_engine.kv.snapshot_kv import SnapshotKVManager


def make_kv_cache_manager(model, model_info, config, family) -> KVCacheManager:
    """``PagedKVManager`` for a model whose every layer is full attention, ``SnapshotKVManager`` for the rest
    mlx-lm can batch (raises ``UnsupportedModelError`` for a model no layout batches correctly)."""
    layout = cache_layout(model, family.model_type)
    cls = PagedKVManager if layout == "attention" else SnapshotKVManager
    return cls(model, model_info, config, family, layout)
