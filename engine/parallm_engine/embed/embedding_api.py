"""The embedding methods every engine has (``Engine`` for decoder models, ``EncoderEngine`` for BERT-family
models): ``embed`` / ``aembed`` (any number of texts, vectors in input order), ``embed_results`` /
``aembed_results`` (with token counts), ``submit_embedding`` (a handle to cancel).

A call of many texts checks and tokenizes all of them before any is queued, then keeps at most ``window``
of them in flight (default: a quarter of the engine's queue bound, so other callers keep room), shortest
first: texts of similar length then share a prefill forward, which pads its rows to the longest of them.
``wait=True`` (the LangChain / LlamaIndex classes) waits for room where the queue is full instead of
raising QueueFullError, and every such call on the engine together keeps at most a quarter of the queue:
many concurrent batches (LlamaIndex's async batching) leave the rest to other callers too.

::

    eng = get_engine("Qwen/Qwen3-Embedding-0.6B")
    docs = eng.embed(["first passage", "second passage"])          # list of vectors (unit length)
    q = eng.embed("what is in the first passage?", input_type="query")[0]   # the model's query prompt
    h = eng.submit_embedding("a long text", truncate=True); h.abort()      # cancellable

Inputs are strings or lists of token ids. An empty string is refused (InvalidRequestError); a text longer
than the context window is refused (ContextLengthExceededError) unless ``truncate=True``, which keeps its
first tokens (and its final special token, e.g. the EOS a last-token pooler reads).
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from parallm_engine.core.request import Channel, Request
from parallm_engine.core.validation import check_text
from parallm_engine.embed.embedding import (
    EmbeddingHandle,
    EmbeddingResult,
    EmbeddingSpec,
    check_backbone,
    make_spec,
)
from parallm_engine.embed.embedding_config import (
    EmbeddingConfig,
    not_an_embedding_model,
    resolve_embedding_config,
)
from parallm_engine.errors import (
    ContextLengthExceededError,
    EngineDeadError,
    InvalidRequestError,
    NotAnEmbeddingModelError,
    QueueFullError,
)
from parallm_engine.sampling.sampler import SamplingParams

EmbeddingInput = str | Sequence[int]


class EmbeddingAPI:
    """Mixed into an engine that has ``model_info``, ``tokenizer``, ``encode``, ``abort``, ``_dead``
    (``EngineBase``) and ``_queue_embedding(request)``."""

    def embedding_config(self, pooling: str | None = None, normalize: bool | None = None) -> EmbeddingConfig:
        """The model's embedding configuration (``embedding_config.resolve_embedding_config``) with the
        caller's overrides; NotAnEmbeddingModelError for a chat model when ``pooling`` is not given."""
        base = self.__dict__.get("_embedding_config_obj", False)
        if base is False:  # read once (a benign race reads it twice)
            self._check_embedding_model()
            try:
                base = self._resolve_embedding_config(None)
            except NotAnEmbeddingModelError:
                base = None  # a chat model: it embeds only with the caller's pooling=
            self.__dict__["_embedding_config_obj"] = base
        if base is None:
            return self._resolve_embedding_config(pooling, normalize)
        return base.with_overrides(pooling, normalize)

    def _resolve_embedding_config(self, pooling: str | None, normalize: bool | None = None) -> EmbeddingConfig:
        info = self.model_info
        cfg = info.config.get("text_config", info.config)
        dims = int(cfg.get("hidden_size") or cfg.get("d_model") or cfg.get("dim") or 0)
        return resolve_embedding_config(info.path, info.name, dims, pooling=pooling, normalize=normalize)

    def _check_embedding_model(self) -> None:
        """``Engine``: the decoder must have a hidden-state forward (``embedding.check_backbone``), and be causal:
        a bidirectional embedder (EmbeddingGemma) run with the engine's causal attention would give wrong
        vectors, so it is refused."""
        check_backbone(self.model)
        cfg = self.model_info.config.get("text_config", self.model_info.config)
        if cfg.get("use_bidirectional_attention") or cfg.get("is_causal") is False:
            raise not_an_embedding_model(self.model_info.name, "its attention is bidirectional, and the engine runs "
                                         "decoders with causal attention only")

    # -- one request ----------------------------------------------------------------------------
    def submit_embedding(
        self,
        text: EmbeddingInput,
        *,
        loop: asyncio.AbstractEventLoop | None = None,
        input_type: str | None = None,
        instruction: str | None = None,
        pooling: str | None = None,
        normalize: bool | None = None,
        dimensions: int | None = None,
        truncate: bool = False,
        priority: int = 0,
        group=None,
        request_id: str | None = None,
    ) -> EmbeddingHandle:
        """Queue one text; returns a handle (``result()``, ``await aresult()``, ``abort()``).

        ``input_type``: ``"query"`` puts the model's query prompt before the text (Qwen3-Embedding's
        ``Instruct: ...\\nQuery:``, from its ``config_sentence_transformers.json``), ``"document"`` its
        document prompt; ``instruction``: a task description for queries, as ``Instruct: {task}\\nQuery: ``.
        ``pooling`` / ``normalize``: override the model's own configuration (``pooling`` also lets any
        decoder embed). ``dimensions``: Matryoshka truncation (then renormalised), for models trained so.
        ``truncate``: cut a text longer than the context window instead of refusing it."""
        spec, prefix = self._embedding_spec(input_type, instruction, pooling, normalize, dimensions, priority)
        ids, truncated = self._embedding_ids(text, prefix, bool(truncate))
        return self._submit_ids(ids, truncated, spec, loop, priority, group, request_id)

    def _embedding_spec(self, input_type, instruction, pooling, normalize, dimensions,
                        priority) -> tuple[EmbeddingSpec, str]:
        if not self.is_alive:  # EngineBase: the decoder engine's core, or the encoder engine's own thread
            raise EngineDeadError(f"engine is not running: {self._dead}")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidRequestError(f"priority must be an integer, got {type(priority).__name__}", param="priority")
        config = self.embedding_config(pooling, normalize)
        return make_spec(config, pooling, normalize, dimensions), config.prompt_for(input_type, instruction)

    def _submit_ids(self, ids: list[int], truncated: bool, spec: EmbeddingSpec, loop, priority: int, group,
                    request_id: str | None) -> EmbeddingHandle:
        # The Request is made here, not when the text was tokenized: its arrival time orders admission.
        req = Request(ids, SamplingParams(max_tokens=1), Channel(loop), request_id=request_id, priority=priority,
                      group=group)
        req.embedding: EmbeddingSpec = spec
        req.truncated = truncated
        self._queue_embedding(req)
        return EmbeddingHandle(self, req)

    def _embedding_ids(self, text: EmbeddingInput, prefix: str, truncate: bool) -> tuple[list[int], bool]:
        if isinstance(text, str):
            if not text:
                raise InvalidRequestError("cannot embed an empty string", param="input")
            check_text(text, "input")
            ids = list(self.tokenizer.encode(prefix + text, add_special_tokens=True))
        elif isinstance(text, (list, tuple)) and text and all(isinstance(t, int) and not isinstance(t, bool)
                                                              for t in text):
            ids = list(text)
            vocab = self.model_info.vocab_size
            if any(t < 0 or t >= vocab for t in ids):
                raise InvalidRequestError(f"token ids must be in [0, {vocab})", param="input")
        else:
            raise InvalidRequestError(
                f"each input must be a non-empty string or list of token ids, got {type(text).__name__}", param="input")
        ctx = self.model_info.context_window
        if len(ids) <= ctx:
            return ids, False
        if not truncate:
            raise ContextLengthExceededError(
                f"input has {len(ids)} tokens; the model's context window is {ctx} (pass truncate=True to embed "
                "its first tokens)", param="input")
        special = set(getattr(self.tokenizer, "all_special_ids", None) or [])
        return (ids[: ctx - 1] + ids[-1:] if ids[-1] in special else ids[:ctx]), True

    # -- many texts -----------------------------------------------------------------------------
    @staticmethod
    def _embedding_inputs(texts) -> list:
        if isinstance(texts, str):
            return [texts]
        if isinstance(texts, (list, tuple)) and texts and all(isinstance(t, int) and not isinstance(t, bool)
                                                               for t in texts):
            return [list(texts)]  # one token-id input
        if not isinstance(texts, (list, tuple)):
            raise InvalidRequestError(f"texts must be a string or a list, got {type(texts).__name__}", param="input")
        return list(texts)

    def _queue_room(self) -> int:
        """Free places in the queue now (``Engine``: requests in flight or handed over count); a hint, the
        submission itself is the check."""
        return self.max_queue - self.running_count - self.core.pending

    def _many(self, texts, options: dict, loop, wait: bool, window: int | None) -> _Window:
        opts = dict(options)
        priority, group = opts.pop("priority", 0), opts.pop("group", None) or object()  # one call: one group
        request_id, truncate = opts.pop("request_id", None), bool(opts.pop("truncate", False))
        unknown = set(opts) - {"input_type", "instruction", "pooling", "normalize", "dimensions"}
        if unknown:
            raise TypeError(f"unexpected embedding option(s): {', '.join(sorted(unknown))}")
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise InvalidRequestError(f"window must be a positive integer, got {window!r}", param="window")
        inputs = self._embedding_inputs(texts)
        items: list = []
        if inputs:
            spec, prefix = self._embedding_spec(opts.get("input_type"), opts.get("instruction"),
                                                opts.get("pooling"), opts.get("normalize"), opts.get("dimensions"),
                                                priority)
            items = [self._embedding_ids(t, prefix, truncate) for t in inputs]

        def submit(i: int) -> EmbeddingHandle:
            rid = request_id if request_id is None or len(items) == 1 else f"{request_id}-{i}"
            return self._submit_ids(*items[i], spec, loop, priority, group, rid)

        share = max(1, self.max_queue // 4)
        bulk = self.__dict__.setdefault("_embedding_bulk", _BulkShare()) if wait else None
        return _Window(submit, [len(ids) for ids, _ in items], window or share, self._queue_room, bulk, share)

    def embed_results(self, texts: EmbeddingInput | list[EmbeddingInput], *, wait: bool = False,
                      window: int | None = None, on_progress: Callable[[int], Any] | None = None,
                      **options: Any) -> list[EmbeddingResult]:
        """Results in input order, for any number of texts. Options as :meth:`submit_embedding`.

        Every text is checked and tokenized before any is queued (a bad one fails the call before any
        runs); then at most ``window`` are in flight (default: a quarter of ``max_queue``), shortest first.
        ``wait``: where the queue is full, wait for room rather than raise QueueFullError; all waiting
        calls on the engine together keep at most a quarter of ``max_queue`` in flight. ``on_progress(n)``:
        called as ``n`` more texts are done."""
        return self._many(texts, options, None, wait, window).run(on_progress=on_progress)

    async def aembed_results(self, texts: EmbeddingInput | list[EmbeddingInput], *, wait: bool = False,
                             window: int | None = None, on_progress: Callable[[int], Any] | None = None,
                             **options: Any) -> list[EmbeddingResult]:
        """:meth:`embed_results` on the caller's event loop (cancelling the task aborts what is in flight)."""
        return await self._many(texts, options, asyncio.get_running_loop(), wait, window).arun(
            on_progress=on_progress)

    def embed(self, texts: EmbeddingInput | list[EmbeddingInput], **options: Any) -> list[list[float]]:
        """The vectors of ``texts`` (a bare string gives a one-item list); options as :meth:`embed_results`."""
        return [r.embedding for r in self.embed_results(texts, **options)]

    async def aembed(self, texts: EmbeddingInput | list[EmbeddingInput], **options: Any) -> list[list[float]]:
        return [r.embedding for r in await self.aembed_results(texts, **options)]

    # -- the decoder engine's queue ---------------------------------------------------------------
    def _queue_embedding(self, req: Request) -> None:
        """``Engine``: the scheduler takes it like any prompt (``embedding.EmbeddingSequence``)."""
        self.core.take_queue_slot()
        self.core.enqueue_add(req)


class _BulkShare:
    """The texts in flight of every ``wait=True`` call on one engine (they share one quarter of its queue)."""

    def __init__(self):
        self.n = 0
        self._lock = threading.Lock()
        self._wakers: list[Callable[[], None]] = []  # calls waiting for a place of the share

    def take(self, cap: int, room: Callable[[], int]) -> bool:
        with self._lock:
            if self.n >= cap or room() <= 0:  # room: no refused submission (each counts as rejected)
                return False
            self.n += 1
            return True

    def give(self) -> None:
        with self._lock:
            self.n -= 1
            wakers, self._wakers = self._wakers, []
        for wake in wakers:
            wake()

    def waiting(self, wake: Callable[[], None]) -> Callable[[], None]:
        """Call ``wake`` when a place is given back; returns what withdraws it."""
        with self._lock:
            self._wakers.append(wake)

        def withdraw() -> None:
            with self._lock:
                if wake in self._wakers:
                    self._wakers.remove(wake)
        return withdraw


class _Window:
    """One call's texts on their way in: shortest first, at most ``window`` in flight, and with ``bulk``
    (``wait=True``) within the engine's shared share (``cap``), waiting where the queue is full."""

    def __init__(self, submit: Callable[[int], EmbeddingHandle], lengths: list[int], window: int,
                 room: Callable[[], int], bulk: _BulkShare | None, cap: int):
        self.n, self.done = len(lengths), 0
        self.order = sorted(range(self.n), key=lengths.__getitem__)
        self.next = 0
        self.inflight: deque[tuple[int, EmbeddingHandle]] = deque()
        self._submit, self._window, self._room, self._bulk, self._cap = submit, window, room, bulk, cap
        self._backoff = _POLL_FIRST_S

    def fill(self) -> float:
        """Queue what the window and the queue allow; the seconds to wait before trying again (0: a text of
        the call is in flight, wait for it)."""
        bulk = self._bulk
        while self.next < self.n and len(self.inflight) < self._window:
            if bulk is not None and not bulk.take(self._cap, self._room):
                break
            i = self.order[self.next]
            try:
                handle = self._submit(i)
            except QueueFullError:
                if bulk is None:
                    raise
                bulk.give()
                break
            except BaseException:
                if bulk is not None:
                    bulk.give()
                raise
            self.inflight.append((i, handle))
            self.next += 1
        if self.inflight:
            self._backoff = _POLL_FIRST_S
            return 0.0
        delay, self._backoff = self._backoff, min(self._backoff * 2, _POLL_MAX_S)  # the queue or share is full
        return delay

    def pause(self, delay: float) -> None:
        """Wait ``delay`` seconds, or less if another waiting call gives a place of the share back."""
        event = threading.Event()
        withdraw = self._bulk.waiting(event.set) if self._bulk is not None else None
        try:
            event.wait(delay)
        finally:
            if withdraw is not None:
                withdraw()

    async def apause(self, delay: float) -> None:
        loop = asyncio.get_running_loop()
        woken = loop.create_future()

        def wake() -> None:  # from any thread; the loop may have closed since
            try:
                loop.call_soon_threadsafe(lambda: woken.done() or woken.set_result(None))
            except RuntimeError:
                pass

        withdraw = self._bulk.waiting(wake) if self._bulk is not None else None
        try:
            await asyncio.wait_for(woken, delay)
        except TimeoutError:
            pass
        finally:
            if withdraw is not None:
                withdraw()

    def run(self, take: Callable[[int, Any], Any] | None = None, on_progress=None) -> list:
        """Every text through the window, waiting on this thread: results in input order (``take(i, result)``
        maps each one); whatever is still in flight is aborted if the caller stops waiting."""
        results: list = [None] * self.n
        try:
            while self.done < self.n:
                delay = self.fill()
                if delay:
                    self.pause(delay)
                    continue
                i, handle = self.inflight[0]
                r = handle.result()
                results[i] = take(i, r) if take is not None else r
                self.finished(on_progress)
            return results
        finally:
            self.abort()

    async def arun(self, take: Callable[[int, Any], Any] | None = None, on_progress=None) -> list:
        """:meth:`run` on the caller's event loop (cancelling the task aborts what is in flight)."""
        results: list = [None] * self.n
        try:
            while self.done < self.n:
                delay = self.fill()
                if delay:
                    await self.apause(delay)
                    continue
                i, handle = self.inflight[0]
                r = await handle.aresult()
                results[i] = take(i, r) if take is not None else r
                self.finished(on_progress)
            return results
        finally:
            self.abort()

    def finished(self, on_progress) -> None:
        self.inflight.popleft()
        self.done += 1
        if self._bulk is not None:
            self._bulk.give()
        if on_progress is not None:
            on_progress(1)

    def abort(self) -> None:
        while self.inflight:
            _, handle = self.inflight.popleft()
            if self._bulk is not None:
                self._bulk.give()
            if not handle.request.finished:
                handle.abort()


#: Polling while the queue (or the waiting calls' share of it) is full: the first wait and the longest.
_POLL_FIRST_S, _POLL_MAX_S = 0.01, 0.1
