"""The model's own caches: which layout a model needs, and the decode batch for models that are not
full attention in every layer.

``model.make_cache()`` is the authority on what each layer keeps: full-attention KV (``KVCache``), a
sliding window (``RotatingKVCache``), recurrent / SSM state (``ArraysCache`` and its subclasses),
or a list of those for layers with several parts (``CacheList``). The engine picks one of two layouts:

- ``"attention"``: every layer is plain full attention. The engine's own KV classes (``kv_cache``)
  hold it: radix tree segments shared by reference, grouped prefill over cached prefixes, the shared
  prefix read once per step, native CPU attention.
- ``"mixed"``: anything else mlx-lm can batch. Each sequence is prefilled in its own instances of the
  model's caches (exactly mlx-lm's semantics: window-correct masks, keys beyond the window dropped,
  SSM state carried), then joins a batch built from mlx-lm's batched caches (``BatchKVCache``,
  ``BatchRotatingKVCache``, batched ``ArraysCache``) with their ``merge`` / ``extend`` / ``filter`` /
  ``extract``. Prefixes are reused from whole-state snapshots (:mod:`snapshot_cache`), since neither a
  window nor a recurrent state can be cut at an arbitrary token.

A cache type neither layout can batch correctly (llama4's ``ChunkedKVCache``, a quantized KV cache,
anything unknown) is refused at load with :class:`~parallm_engine.errors.UnsupportedModelError`.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache

from parallm_engine.errors import UnsupportedModelError

# Families whose forward cannot take a batch of rows with different histories in mlx-lm 0.32 even
# through its own batched caches (checked with tiny random models against mlx-lm's own generation).
# model_type -> what is missing.
_UNBATCHABLE: dict[str, str] = {}


def make_cache(model) -> list:
    """The model's own per-layer caches for one sequence."""
    if hasattr(model, "make_cache"):
        return model.make_cache()
    return [KVCache() for _ in model.layers]


def _kind(cache) -> str:
    t = type(cache)
    if t is KVCache:
        return "attention"
    if t is RotatingKVCache:
        return "window"
    if isinstance(cache, ArraysCache):
        return "state"
    if t is CacheList:
        inner = {_kind(c) for c in cache.caches}
        return "list" if not inner & {"unsupported"} else "unsupported"
    return "unsupported"


def cache_layout(model, model_type: str = "") -> str:
    """``"attention"`` or ``"mixed"`` (see the module docstring); raises UnsupportedModelError for a
    model the engine cannot batch correctly."""
    if model_type in _UNBATCHABLE:
        raise UnsupportedModelError(f"model family {model_type!r} is not supported: {_UNBATCHABLE[model_type]}")
    caches = make_cache(model)
    kinds = [_kind(c) for c in caches]
    bad = sorted({type(c).__name__ for c, k in zip(caches, kinds) if k == "unsupported"})
    if bad:
        raise UnsupportedModelError(
            f"model family {model_type or type(model).__module__!r} uses cache type(s) {', '.join(bad)}, "
            "which the engine cannot batch yet (chunked attention and quantized KV caches are not supported)"
        )
    return "attention" if all(k == "attention" for k in kinds) else "mixed"


def layout_rolls_back(layout: str) -> bool:
    """Whether a model with this cache layout has KV that can be cut back to an earlier length
    (speculative decoding's rejected tokens): plain attention; sliding-window or recurrent state cannot."""
    return layout == "attention"


# -- copies of one sequence's caches --------------------------------------------------------------
# MLX arrays are values: a slice or a reference taken now keeps today's contents even after the live
# cache writes into its buffer (MLX copies instead of writing in place while another array refers to
# it). What must be fresh are the Python cache objects and their lists.

def copy_cache(cache):
    """An independent copy of one layer's cache for one sequence (arrays shared by value)."""
    t = type(cache)
    if t is KVCache:
        out = KVCache()
        if cache.keys is not None:
            out.keys = cache.keys[..., : cache.offset, :]
            out.values = cache.values[..., : cache.offset, :]
        out.offset = cache.offset
        return out
    if t is RotatingKVCache:
        out = RotatingKVCache(cache.max_size, cache.keep)
        out.state = cache.state  # keys, values, offset, keep, max_size and the ring's write index
        if cache.keys is not None:
            out.keys, out.values = cache.keys[...], cache.values[...]
        return out
    if isinstance(cache, ArraysCache):
        out = t.__new__(t)
        out.__dict__.update(cache.__dict__)
        out.cache = [None if a is None else a[...] for a in cache.cache]
        return out
    if t is CacheList:
        return CacheList(*(copy_cache(c) for c in cache.caches))
    raise TypeError(f"cannot copy a {t.__name__}")


def copy_caches(caches: list) -> list:
    return [copy_cache(c) for c in caches]


def cache_arrays(caches: list, valid_only: bool = False) -> list[mx.array]:
    """Every array the caches hold (to evaluate them, or count their bytes). ``valid_only``: KV sliced
    to the tokens it holds, not its step-rounded allocation."""
    out = []
    for c in caches:
        if isinstance(c, CacheList):
            out += cache_arrays(list(c.caches), valid_only)
        elif isinstance(c, ArraysCache):
            out += [a for a in c.cache if a is not None]
        elif getattr(c, "keys", None) is not None:
            if valid_only and isinstance(c.offset, int):
                n = min(c.offset, c.keys.shape[2])
                out += [c.keys[..., :n, :], c.values[..., :n, :]]
            else:
                out += [c.keys, c.values]
    return out


def caches_nbytes(caches: list) -> int:
    return sum(a.nbytes for a in cache_arrays(caches))


def _merge(layer_caches: list):
    first = layer_caches[0]
    if isinstance(first, CacheList):
        return CacheList(*(_merge([c.caches[i] for c in layer_caches]) for i in range(len(first.caches))))
    if isinstance(first, ArraysCache):
        return _merge_arrays(layer_caches)
    return type(first).merge(layer_caches)


def _merge_arrays(layer_caches: list) -> ArraysCache:
    """``ArraysCache.merge`` for any subclass (its own builds ``cls(n)``, which subclasses with another
    constructor cannot take): the rows' states stacked, no padding (each row's state is complete)."""
    n = len(layer_caches[0].cache)
    out = ArraysCache(n)
    for e in range(n):
        parts = [c.cache[e] for c in layer_caches]
        ref = next((p for p in parts if p is not None), None)
        if ref is None:
            continue
        out.cache[e] = mx.concatenate([p if p is not None else mx.zeros((1, *ref.shape[1:]), ref.dtype)
                                       for p in parts])
    return out


def _extract(cache, i: int):
    if isinstance(cache, CacheList):
        return CacheList(*(_extract(c, i) for c in cache.caches))
    if isinstance(cache, ArraysCache):
        out = ArraysCache(len(cache.cache))
        out.cache = [None if a is None else a[i : i + 1] for a in cache.cache]
        return out
    return cache.extract(i)


def _filter(cache, keep: mx.array) -> None:
    if isinstance(cache, CacheList):
        for c in cache.caches:
            _filter(c, keep)
    elif isinstance(cache, ArraysCache):
        cache.cache = [None if a is None else a[keep] for a in cache.cache]
        cache.left_padding = cache.lengths = None
    else:
        cache.filter(keep)


def _extend(cache, other) -> None:
    if isinstance(cache, CacheList):
        for c, o in zip(cache.caches, other.caches):
            _extend(c, o)
    elif isinstance(cache, ArraysCache):
        B, Bo = _rows(cache), _rows(other)
        merged = []
        for a, b in zip(cache.cache, other.cache):
            ref = a if a is not None else b
            if ref is None:
                merged.append(None)
                continue
            a = a if a is not None else mx.zeros((B, *ref.shape[1:]), ref.dtype)
            b = b if b is not None else mx.zeros((Bo, *ref.shape[1:]), ref.dtype)
            merged.append(mx.concatenate([a, b]))
        cache.cache = merged
    else:
        cache.extend(other)


def _rows(cache: ArraysCache) -> int:
    return next((a.shape[0] for a in cache.cache if a is not None), 0)


class MixedDecodeBatch:
    """The running batch of a ``"mixed"`` model: one mlx-lm batched cache per layer, rows in
    :attr:`running` order. The same interface as ``decode_batch.DecodeBatch`` where the scheduler
    uses it (one lane, no shared prefix: a window or a state cannot be shared by reference); its forward
    is the runner's (``ModelRunner.decode_forward``)."""

    def __init__(self):
        self.running: list = []
        self.caches: list | None = None
        self.shared = None
        self.lanes = [None]

    def __len__(self) -> int:
        return len(self.running)

    def lane_contexts(self) -> list:
        import contextlib

        return [contextlib.nullcontext()]

    def join(self, seqs: list, shared=None) -> None:
        """Add prefilled sequences (each with ``seq.cache``: its own per-layer caches)."""
        merged = [_merge([s.cache[l] for s in seqs]) for l in range(len(seqs[0].cache))]
        if self.caches is None:
            self.caches = merged
        else:
            for c, m in zip(self.caches, merged):
                _extend(c, m)
        for s in seqs:
            s.cache = None
        self.running.extend(seqs)

    def drop(self, seqs: set[int]) -> None:
        keep = [i for i, s in enumerate(self.running) if id(s) not in seqs]
        if len(keep) == len(self.running):
            return
        self.running = [self.running[i] for i in keep]
        if not keep:
            self.caches = None
            return
        sel = mx.array(keep)
        for c in self.caches:
            _filter(c, sel)

    def clear(self) -> None:
        self.running = []
        self.caches = None

    def row_caches(self, seq) -> list:
        """``seq``'s own per-layer caches, extracted from the batch (for a snapshot)."""
        i = next(i for i, s in enumerate(self.running) if s is seq)
        return [_extract(c, i) for c in self.caches]

    def nbytes(self) -> int:
        return caches_nbytes(self.caches) if self.caches is not None else 0

    def held_nbytes(self) -> int:  # nothing is shared with the snapshot cache: every byte is the batch's
        return self.nbytes()

    def footprint(self, extra: int, bytes_per_token: int) -> int:
        """Bytes after ``extra`` more decode steps (an upper bound: window layers stop growing)."""
        return self.nbytes() + len(self.running) * extra * bytes_per_token
