"""The vision encoder off the engine thread: a new image's features are computed before its request
reaches the scheduler, so running streams keep decoding while a picture is encoded.

One worker thread per model (started on first use, gone after a few idle seconds) with its own MLX
stream: MLX streams belong to the thread that made them, so the worker never hands the engine thread
an unevaluated array. Everything it returns is evaluated (``mx.eval``) on its own stream; the engine
thread only reads the finished arrays (and concatenates a prompt's images itself).

Jobs run one at a time in arrival order, so concurrent requests on one image encode it once: the
first computes and caches the features, the later ones find them in the cache when their turn comes.
A request whose images are all cached skips the worker (a dictionary lookup on the caller's thread).
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

from parallm_engine.errors import ImageInputError

logger = logging.getLogger(__name__)

#: Seconds an idle worker waits for another job before its thread (and its MLX stream) ends.
IDLE_EXIT_S = 5.0


class VisionWorker:
    """Runs :meth:`VisionEncoder.encode_prompt` for queued prompts on its own thread."""

    def __init__(self, encoder):
        self.encoder = encoder
        self._jobs: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.jobs_run = 0

    def submit(self, prompt, done: Callable[[BaseException | None], None]) -> None:
        """Encode ``prompt``'s images on the worker; then ``done(None)``, or ``done(error)`` if it failed
        (called on the worker thread)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the vision worker is shut down")
            self._jobs.put((prompt, done))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="parallm-vision", daemon=True)
                self._thread.start()

    def close(self, timeout: float = 10.0) -> None:
        with self._lock:
            self._closed = True
            thread = self._thread
            self._jobs.put(None)
        if thread is not None:
            thread.join(timeout)

    def _run(self) -> None:
        import mlx.core as mx

        stream = mx.new_stream(mx.default_device())
        try:
            while True:
                try:
                    job = self._jobs.get(timeout=IDLE_EXIT_S)
                except queue.Empty:
                    with self._lock:  # exit only if nothing arrived meanwhile (submit starts a new thread)
                        if self._jobs.empty():
                            self._thread = None
                            return
                    continue
                if job is None:
                    return
                prompt, done = job
                error = None
                try:
                    with mx.stream(stream):
                        self.encoder.encode_prompt(prompt)
                except Exception as exc:  # this request fails alone, typed where the input was at fault
                    logger.exception("vision encoder failed")
                    error = exc
                self.jobs_run += 1
                try:
                    done(error)
                except Exception:
                    logger.exception("vision worker callback failed")
        finally:
            # MLX aborts at exit on streams whose thread did not clear them (see Engine._loop).
            mx.synchronize()
            mx.clear_streams()


# -- the engine's side (Engine.submit / Engine.abort call these) ---------------------------------------
class _Pending:
    """Requests waiting on the worker, and those of them aborted meanwhile (one per engine)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.waiting: dict[str, object] = {}
        self.aborted: set[str] = set()


def _pending(engine) -> _Pending:
    p = engine.__dict__.get("_vision_pending")
    if p is None:
        p = engine.__dict__.setdefault("_vision_pending", _Pending())
    return p


def submit_after_encoding(engine, req) -> bool:
    """For a request with images: if one is not in the feature cache, encode it on the worker and queue
    the request for the scheduler only then (True); else False (the caller queues it now)."""
    encoder = getattr(engine.model, "vision", None)
    prompt = req.vision
    if encoder is None or not prompt.images or not encoder.needs_encoding(prompt):
        return False
    pending = _pending(engine)
    with pending.lock:
        pending.waiting[req.id] = req

    def done(error: BaseException | None) -> None:
        with pending.lock:  # held while queueing, so an abort seen after this is queued after the add
            pending.waiting.pop(req.id, None)
            aborted = req.id in pending.aborted
            pending.aborted.discard(req.id)
            if error is None:
                engine.core.enqueue_add(req)
                if aborted:
                    engine.core.enqueue_abort(req.id)
            else:
                err = error if isinstance(error, ImageInputError) else ImageInputError(
                    f"the vision encoder failed on this request's image: {error}", param="messages")
                engine.core.reject_queued(req, err)

    encoder.encode_async(prompt, done)
    return True


def note_abort(engine, request_id: str) -> None:
    """An abort of a request still at the encoder takes effect once it reaches the scheduler."""
    pending = engine.__dict__.get("_vision_pending")
    if pending is not None:
        with pending.lock:
            if request_id in pending.waiting:
                pending.aborted.add(request_id)
