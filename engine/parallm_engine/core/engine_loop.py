"""The engine thread's loop (``Engine`` takes it in): drain the callers' commands (submit, abort, calls
run between steps), publish the statistics other threads read, and run steps while there is work
(``Scheduler.step``: the scheduler's plan, ``Scheduler.schedule``; the model runner's execution of it,
``ModelRunner.execute``; the scheduler's ``update``). An allocation failure in a step preempts and
resumes (``memory_recovery``); any other error fails the requests in flight, and the engine keeps serving.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

from parallm_engine.runner import lora

from parallm_engine.core import memory_recovery
from parallm_engine.errors import EngineDeadError
from parallm_engine.core.memory_recovery import is_allocation_failure
from parallm_engine.core.request import batched_deliveries

logger = logging.getLogger("parallm_engine")


class EngineLoop:
    """Mixed into ``Engine``: uses its ``_scheduler``, ``_stats``, ``_commands``, ``_wake``, ``_lock``,
    ``_pending``, ``_aborting``, ``_stop``, ``_dead`` and ``model``."""

    def _publish_stats(self) -> None:
        """Engine thread only (between steps): publish what :meth:`stats` may not walk from another thread.
        Read defensively: a monitoring snapshot must never stop the engine."""
        sched = self._scheduler
        gauges: dict[str, Any] = {"waiting": len(getattr(sched, "waiting", ())),
                                  "prefilling": len(getattr(sched, "prefilling", ()))}
        cache = getattr(sched, "prefix_cache", None)
        if cache is not None:
            try:
                gauges["prefix_cache"] = cache.stats()
            except Exception:  # noqa: BLE001
                if not getattr(self, "_stats_warned", False):
                    self._stats_warned = True
                    logger.warning("could not read the prefix cache's stats", exc_info=True)
        gauges["memory"] = sched.memory_stats()
        rt = lora.runtime(self.model)
        if rt is not None:  # the stacks resident in the batch (engine thread's view)
            gauges["lora"] = rt.stats()
        self._stats.publish(gauges)

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd == "add":
                with self._lock:
                    self._pending -= 1
                try:
                    self._scheduler.add(arg)
                except Exception as exc:  # one bad request fails alone; the engine keeps serving
                    logger.exception("could not start request %s", arg.id)
                    self._scheduler.reject(arg, exc)
            elif cmd == "abort":
                with self._lock:  # counted as in flight again until the scheduler has dropped it
                    self._aborting.discard(arg)
                self._scheduler.abort(arg)
            elif cmd == "call":
                fn, box, done = arg
                try:
                    box.append(fn())
                except BaseException as exc:  # handed back to the caller
                    box.append(exc)
                self._publish_stats()  # what the call changed (e.g. a cleared prefix cache) shows at once
                done.set()

    # -- the way in: commands the engine thread takes between steps (``_drain_commands``) -------------
    def enqueue_add(self, req) -> None:
        """Hand a request whose queue slot is taken (``_take_queue_slot``) to the scheduler."""
        self._commands.put(("add", req))
        self._wake.set()

    def enqueue_abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wake.set()

    def reject_queued(self, req, error: BaseException) -> None:
        """End a request whose queue slot is taken but that will never reach the scheduler (its image
        failed to encode) with ``error``, from the engine thread; its slot is free at once."""
        with self._lock:
            self._pending -= 1
        self._commands.put(("call", (lambda: self._scheduler.reject(req, error), [], threading.Event())))
        self._wake.set()

    def run_on_engine_thread(self, fn, timeout: float | None = None):
        """Run ``fn()`` between steps on the engine thread (for tests and maintenance)."""
        box: list = []
        done = threading.Event()
        self._commands.put(("call", (fn, box, done)))  # answered by _drain_commands, or _fail_waiting
        self._wake.set()
        if not done.wait(timeout):
            raise TimeoutError("engine thread did not answer")
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # the thread is dying: nobody may be left waiting on it
            logger.critical("engine thread died", exc_info=True)
            self._dead = self._dead or EngineDeadError(f"engine thread died: {exc!r}")
            self._fail_waiting(self._dead)  # logged above; the thread then ends
        finally:
            # However the thread ends, later submits must fail fast instead of waiting forever.
            self._dead = self._dead or EngineDeadError("engine thread stopped")

    def _fail_waiting(self, error: EngineDeadError) -> None:
        """End every request in flight and every one still queued, and answer pending calls, with
        ``error`` (the engine thread is dying; best effort: each part on its own)."""
        try:
            self._scheduler.fail_all(error)
        except BaseException:  # noqa: BLE001  (the scheduler may be what broke)
            logger.exception("could not fail the scheduler's requests; ending each on its own")
            out = self._scheduler.out
            for req in list(out.requests.values()):
                try:
                    out.end(req, error)
                except BaseException:  # noqa: BLE001
                    logger.exception("could not end request %s", req.id)
        while True:
            try:
                cmd, arg = self._commands.get_nowait()
            except queue.Empty:
                break
            if cmd == "add":
                with self._lock:
                    self._pending -= 1
                try:
                    self._scheduler.reject(arg, error)
                except BaseException:  # noqa: BLE001
                    logger.exception("could not fail queued request %s", arg.id)
            elif cmd == "call":
                _, box, done = arg
                box.append(error)
                done.set()

    def _loop(self) -> None:
        sched = self._scheduler
        while not self._stop:
            self._drain_commands()
            self._publish_stats()
            if not sched.has_work():
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            t0 = time.monotonic()
            try:
                with batched_deliveries():  # each consumer loop gets the step's deliveries at once
                    sched.step()  # schedule() -> runner.execute(plan) -> update(plan, out)
            except Exception as exc:
                if is_allocation_failure(exc):  # preempt and resume; fails no request that can still run
                    memory_recovery.recover(sched, exc)
                else:  # a bug or another MLX error: fail what is in flight, keep serving
                    logger.exception("engine step failed; failing the requests in flight")
                    sched.fail_all(exc)
            self._stats.busy_time += time.monotonic() - t0
            self._publish_stats()
        sched.fail_all(EngineDeadError("engine was shut down"))
        # MLX keeps per-thread streams whose destructors abort the process at exit unless the owning
        # thread destroys them itself (mlx issue #3126 / PR #4110: call clear_streams per thread).
        import mlx.core as mx

        mx.synchronize()
        mx.clear_streams()
