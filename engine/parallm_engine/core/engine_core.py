"""The engine thread and the one way onto it (``EngineCore``, which ``Engine`` holds as ``core``).

Other threads hand it commands (submit, abort, calls run between steps); the thread drains them,
publishes the statistics other threads read, and runs steps while there is work (``Scheduler.step``: the
scheduler's plan, ``Scheduler.schedule``; the model runner's execution of it, ``ModelRunner.execute``; the
scheduler's ``update``). An allocation failure in a step preempts and resumes (``memory_recovery``); any
other error fails the requests in flight, and the engine keeps serving.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

from parallm_engine.runner import lora

from parallm_engine.core import memory_recovery
from parallm_engine.errors import EngineDeadError, QueueFullError
from parallm_engine.core.memory_recovery import is_allocation_failure
from parallm_engine.core.request import batched_deliveries

logger = logging.getLogger("parallm_engine")


class EngineCore:
    """The engine thread of one ``Engine`` and the one way onto it. Any thread may call
    :meth:`take_queue_slot`, :meth:`enqueue_add`, :meth:`enqueue_abort`, :meth:`reject_queued`,
    :meth:`call` and :meth:`shutdown`; the scheduler (``scheduler``) is touched by the engine thread only.
    ``dead`` is None while the thread runs, else the error every later caller gets."""

    def __init__(self, scheduler, stats, model, max_queue: int, sync=None):
        self.scheduler = scheduler
        # Rank 0 of a distributed engine: what the other ranks must hear (core/distributed_core.py).
        self.sync = sync
        self.stats = stats
        self.model = model
        self.max_queue = max_queue
        self.dead: BaseException | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self._pending = 0  # submitted, not yet picked up by the engine thread
        self._aborting: set[str] = set()  # aborted by their caller, not yet dropped by the engine thread
        self._lock = threading.Lock()
        self._stats_warned = False
        self.thread = threading.Thread(target=self._run, name="parallm-engine", daemon=True)
        self.thread.start()
        if sync is not None:
            from parallm_engine.core.distributed_core import StepWatchdog

            StepWatchdog(self, sync).start()

    @property
    def stopping(self) -> bool:
        """Shutdown was asked for (or the group of a distributed engine broke): the thread is ending."""
        return self._stop

    @property
    def pending(self) -> int:
        """Requests submitted that the engine thread has not picked up yet."""
        return self._pending

    # -- the way in ---------------------------------------------------------------------------------
    def take_queue_slot(self) -> None:
        """Count one more request as pending, or refuse it (QueueFullError) when the queue is full."""
        with self._lock:
            # Requests a caller has aborted no longer count, though the engine thread frees them only
            # between steps: their slots are free again at once.
            if self.stats.in_flight + self._pending - len(self._aborting) >= self.max_queue:
                self.stats.requests_rejected += 1
                raise QueueFullError(
                    f"engine queue is full ({self.max_queue} requests in flight); retry later", retry_after=1.0
                )
            self._pending += 1

    def enqueue_add(self, req) -> None:
        """Hand a request whose queue slot is taken (:meth:`take_queue_slot`) to the scheduler."""
        self._commands.put(("add", req))
        self._wake.set()

    def enqueue_abort(self, request_id: str, req=None) -> None:
        """Abort a request between steps; given its ``Request`` (``req``), its queue slot is free at once."""
        if req is not None:
            with self._lock:
                if not req.finished:
                    self._aborting.add(req.id)
        self._commands.put(("abort", request_id))
        self._wake.set()

    def reject_queued(self, req, error: BaseException) -> None:
        """End a request whose queue slot is taken but that will never reach the scheduler (its image
        failed to encode) with ``error``, from the engine thread; its slot is free at once."""
        with self._lock:
            self._pending -= 1
        self._commands.put(("call", (lambda: self.scheduler.reject(req, error), [], threading.Event(), None)))
        self._wake.set()

    def call(self, fn, timeout: float | None = None, mirror: tuple | None = None):
        """Run ``fn()`` between steps on the engine thread and return what it returns (or raise what it
        raised). ``mirror``: ``(name, args)`` of the same maintenance on every rank of a distributed engine
        (``distributed_core.MIRRORED_CALLS``)."""
        if self.dead is not None:
            raise self.dead
        box: list = []
        done = threading.Event()
        self._commands.put(("call", (fn, box, done, mirror)))  # answered by _drain_commands, or _fail_waiting
        self._wake.set()
        if not done.wait(timeout):
            raise TimeoutError("engine thread did not answer")
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread: the requests in flight end with EngineDeadError."""
        self.dead = self.dead or EngineDeadError("engine was shut down")
        self._stop = True
        self._wake.set()
        self.thread.join(timeout)

    # -- the engine thread ----------------------------------------------------------------------------
    def _publish_stats(self) -> None:
        """Engine thread only (between steps): publish what :meth:`stats` may not walk from another thread.
        Read defensively: a monitoring snapshot must never stop the engine."""
        sched = self.scheduler
        gauges: dict[str, Any] = {"waiting": len(getattr(sched, "waiting", ())),
                                  "prefilling": len(getattr(sched, "prefilling", ()))}
        cache = getattr(sched, "prefix_cache", None)
        if cache is not None:
            try:
                gauges["prefix_cache"] = cache.stats()
            except Exception:  # noqa: BLE001
                if not self._stats_warned:
                    self._stats_warned = True
                    logger.warning("could not read the prefix cache's stats", exc_info=True)
        gauges["memory"] = sched.memory_stats()
        rt = lora.runtime(self.model)
        if rt is not None:  # the stacks resident in the batch (engine thread's view)
            gauges["lora"] = rt.stats()
        self.stats.publish(gauges)

    def _queued_commands(self):
        """The commands queued now, each taken off the queue as it is yielded."""
        while True:
            try:
                yield self._commands.get_nowait()
            except queue.Empty:
                return

    def _drain_commands(self) -> None:
        sync = self.sync
        for cmd, arg in self._queued_commands():
            if cmd == "add":
                with self._lock:
                    self._pending -= 1
                try:
                    if sync is not None:
                        sync.record_add(arg)  # before the scheduler: a follower adds (or rejects) it alike
                    self.scheduler.add(arg)
                except Exception as exc:  # one bad request fails alone; the engine keeps serving
                    logger.exception("could not start request %s", arg.id)
                    self.scheduler.reject(arg, exc)
            elif cmd == "abort":
                with self._lock:  # counted as in flight again until the scheduler has dropped it
                    self._aborting.discard(arg)
                if sync is not None:
                    sync.record("abort", arg)
                self.scheduler.abort(arg)
            elif cmd == "call":
                fn, box, done, mirror = arg
                if sync is not None and mirror is not None:
                    sync.record("call", mirror)
                try:
                    box.append(fn())
                except BaseException as exc:  # handed back to the caller
                    box.append(exc)
                self._publish_stats()  # what the call changed (e.g. a cleared prefix cache) shows at once
                done.set()

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # the thread is dying: nobody may be left waiting on it
            logger.critical("engine thread died", exc_info=True)
            self.dead = self.dead or EngineDeadError(f"engine thread died: {exc!r}")
            self._fail_waiting(self.dead)  # logged above; the thread then ends
        finally:
            # However the thread ends, later submits must fail fast instead of waiting forever.
            self.dead = self.dead or EngineDeadError("engine thread stopped")

    def _fail_waiting(self, error: EngineDeadError) -> None:
        """End every request in flight and every one still queued, and answer pending calls, with
        ``error`` (the engine thread is dying; best effort: each part on its own)."""
        try:
            self.scheduler.fail_all(error)
        except BaseException:  # noqa: BLE001  (the scheduler may be what broke)
            logger.exception("could not fail the scheduler's requests; ending each on its own")
            out = self.scheduler.out
            for req in list(out.requests.values()):
                try:
                    out.end(req, error)
                except BaseException:  # noqa: BLE001
                    logger.exception("could not end request %s", req.id)
        for cmd, arg in self._queued_commands():
            if cmd == "add":
                with self._lock:
                    self._pending -= 1
                try:
                    self.scheduler.reject(arg, error)
                except BaseException:  # noqa: BLE001
                    logger.exception("could not fail queued request %s", arg.id)
            elif cmd == "call":
                _, box, done, _ = arg
                box.append(error)
                done.set()

    def _distributed_step(self) -> None:
        """A step of rank 0 of a distributed engine: the plan goes to the other ranks before its forwards."""
        sync = self.sync
        sync.step_started = time.monotonic()
        try:
            self.scheduler.step(on_plan=lambda plan: sync.send_plan(self.scheduler, plan))
        finally:
            sync.step_started = None

    def group_lost(self, error) -> None:
        """A distributed engine's group broke (a rank died, hung or diverged): every request ends with
        ``error`` and the engine takes no more. Any thread (the watchdog's while this one is blocked)."""
        with self._lock:
            if self.dead is not None:
                return
            self.dead = error
        self._stop = True
        self.sync.stopped = True  # nobody is left to hear a stop message
        self._fail_waiting(error)
        self._wake.set()

    def _loop(self) -> None:
        sched = self.scheduler
        while not self._stop:
            self._drain_commands()
            sched.kv.publish_events()  # a command may have changed the cache (clear_prefix_cache)
            self._publish_stats()
            if not sched.has_work():
                if self.sync is not None:
                    try:
                        self.sync.park()  # the other ranks of a distributed engine wait without polling
                    except Exception as exc:
                        from parallm_engine.core.distributed_core import lost_rank_error

                        self.group_lost(lost_rank_error(self.sync.dist, exc))
                        return
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            t0 = time.monotonic()
            try:
                with batched_deliveries():  # each consumer loop gets the step's deliveries at once
                    if self.sync is None:
                        sched.step()  # schedule() -> runner.execute(plan) -> update(plan, out)
                    else:
                        self._distributed_step()
            except Exception as exc:
                if self.sync is not None:  # the ranks no longer step together: the group is over
                    from parallm_engine.core.distributed_core import lost_rank_error

                    logger.critical("distributed step failed", exc_info=True)
                    self.group_lost(lost_rank_error(self.sync.dist, exc))
                    return  # the group's collectives are broken: nothing at the end below may run on them
                if is_allocation_failure(exc):  # preempt and resume; fails no request that can still run
                    memory_recovery.recover(sched, exc)
                else:  # a bug or another MLX error: fail what is in flight, keep serving
                    logger.exception("engine step failed; failing the requests in flight")
                    sched.fail_all(exc)
            self.stats.busy_time += time.monotonic() - t0
            sched.kv.publish_events()
            self._publish_stats()
        if self.sync is not None:
            self.sync.stop("shutdown")
        try:  # what the prefix cache holds outlives the process (kv/disk_tier.py)
            sched.kv.persist()
        except Exception:  # noqa: BLE001
            logger.warning("could not persist the prefix cache", exc_info=True)
        try:
            sched.kv.close()
        except Exception:  # noqa: BLE001
            logger.warning("could not stop the KV event publisher", exc_info=True)
        sched.fail_all(EngineDeadError("engine was shut down"))
        # MLX keeps per-thread streams whose destructors abort the process at exit unless the owning
        # thread destroys them itself (mlx issue #3126 / PR #4110: call clear_streams per thread).
        import mlx.core as mx

        mx.synchronize()
        mx.clear_streams()
