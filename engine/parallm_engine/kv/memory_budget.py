"""One memory budget per engine, read from the device, and MLX's own allocator limits.

``kv_memory`` (an ``Engine`` option) is the KV budget the running rows and the prefix cache share
(``kv_manager``): a fraction of what the device offers (Metal's recommended working set, CUDA's
memory, RAM on the CPU; ``backend.device_memory``) or a number of bytes. Default: a quarter.

MLX keeps freed buffers in a cache for reuse and, on Metal, lets allocations run past the working
set into swap (its default limit is 1.5x the working set) until the OS kills the process: the abort
users of every MLX server report. The engine bounds both: the buffer cache to a share of the KV
budget, and on a GPU the allocation limit to the device's memory, so running out raises an error
the engine recovers from (``memory_recovery``: requests are requeued, never lost) instead of
swapping. On Metal the weights plus the budget are wired (kept resident), as mlx-lm's generate does.
These are process-wide MLX settings: with several engines in one process the largest wins.
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
