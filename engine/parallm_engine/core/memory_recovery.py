"""An allocation failure inside a step fails no request that could still run.

MLX raises when the device cannot allocate (``RuntimeError("[metal::malloc] Unable to allocate ...")``,
CUDA's and the CPU allocator's equivalents, or Python's ``MemoryError``). The step that failed may have
left the batch's KV half-written, so nothing of it is kept: every running and prefilling sequence is
preempted without caching its KV (its tokens, sampler and detokeniser state stay; a draw whose token
was never delivered is rewound, ``SeqSampler.rewind_to``, so seeded rows resume on the same key), the unpinned prefix cache and MLX's
buffer cache are emptied, and the KV budget shrinks to three quarters of what was held when it failed,
so admission re-fills the batch more carefully. Sequences resume from their tokens and produce what they
would have produced (greedy and seeded). Only when allocations keep failing with one sequence alone is
that request failed, with :class:`~parallm_engine.errors.OutOfMemoryError`.
"""

from __future__ import annotations

import logging
import time

import mlx.core as mx

from parallm_engine.errors import OutOfMemoryError

logger = logging.getLogger("parallm_engine")

_MESSAGES = ("unable to allocate", "out of memory", "bad_alloc", "outofmemory", "failed to allocate",
             "insufficient memory")
#: Consecutive failed steps (no step in between succeeded) after which the least urgent request fails.
MAX_STREAK = 3


def is_allocation_failure(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc).lower() for m in _MESSAGES)


def recover(sched, exc: BaseException) -> None:
    """Engine thread, after ``sched.step()`` raised an allocation failure: preempt everything in flight
    (KV dropped), free caches, lower the budget; fail only the least urgent request when even a batch of
    one keeps failing."""
    sched.allocation_failures += 1
    sched.stats.allocation_failures = sched.allocation_failures
    sched.failure_streak += 1
    held = sched.kv_bytes_held()
    sched.runner.clear()
    # Every unfinished choice of every live request, wherever the failed step left it (a prefill group or
    # a joining list may have held some outside the scheduler's queues when it raised).
    started = {id(s) for s in [*sched.running, *sched.prefilling]}
    seqs = [s for req in list(sched.out.requests.values()) if not req.finished for s in req.sequences]
    for s in seqs:
        sched.kv.release(s)
    sched.waiting.clear()
    sched.prefilling.clear()
    sched.kv.clear()
    cache = sched.prefix_cache
    if cache is not None:
        cache.clear_unpinned()
    mx.clear_cache()
    if sched.kv_budget_configured is None:
        sched.kv_budget_configured = sched.config.kv_budget_bytes
    floor = sched.kv_bytes_per_token * 64
    sched.config.kv_budget_bytes = max(floor, min(sched.config.kv_budget_bytes, int(held * 0.75)))
    alive = [s for s in seqs if s.finish_reason is None]  # seqs holds live requests' choices only
    if sched.failure_streak >= MAX_STREAK and alive:
        victim = max(alive, key=lambda s: s.urgency)
        logger.error("allocation failed %d steps in a row; failing request %s (%s)",
                     sched.failure_streak, victim.request.id, exc)
        sched.failure_streak = 0
        doomed = victim.request
        alive = [s for s in alive if s.request is not doomed]
        sched.stats.on_abort(doomed)
        sched.out.end(doomed, OutOfMemoryError(
            f"out of memory for request {doomed.id} even with nothing else running ({exc}); "
            "shorten the prompt or max_tokens, or give the engine more memory"))
    else:
        logger.warning("allocation failed in a step (%s): %d sequences requeued, KV budget now %.1f MiB",
                       exc, len(alive), sched.config.kv_budget_bytes / 2**20)
    for s in alive:
        s.sampler.rewind_to(len(s.output_ids))  # a draw whose token was never delivered did not happen
        s._reset_prefill()
        if id(s) in started or s.output_ids:
            s.preemptions += 1
            sched.preemptions += 1
            sched.stats.timeline.preempted(s.request, time.monotonic())
    sched._enqueue(alive)  # by urgency: they arrived before anyone still waiting at their priority
    sched.stats.preemptions = sched.preemptions
    sched.stats.running = 0
    sched.stats.kv_bytes = sched.batch_kv_bytes()


def step_succeeded(sched) -> None:
    """After a step that allocated fine: the failure streak ends, and a budget lowered by a failure grows
    back towards the configured one by 1/64 of it per step (the failure may have been another process's
    peak), so it is restored within a few seconds of healthy steps and lowered again if it was real."""
    sched.failure_streak = 0
    configured = sched.kv_budget_configured
    if configured is not None:
        sched.config.kv_budget_bytes = min(configured, sched.config.kv_budget_bytes + configured // 64)
        if sched.config.kv_budget_bytes >= configured:
            sched.kv_budget_configured = None
