"""Request objects, what they deliver, and how deliveries reach each caller's own thread or loop."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from parallm_engine.sampling.sampler import SamplingParams

_req_ids = itertools.count(1)


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the radix cache
    reasoning_tokens: int = 0  # generated tokens inside reasoning spans (reasoning_budget.py), of completion_tokens
    spec_proposed_tokens: int = 0  # speculative decoding: drafted tokens verified
    spec_accepted_tokens: int = 0  # ... and accepted (each saved a decode step)
    # Seconds in each phase (timeline.request_timings), set when the request ends: queued, prefilling (to the
    # first token), decoding. Not in ``as_dict`` (OpenAI's usage has no such fields).
    queue_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
            **({"speculative": self.speculative_dict()} if self.spec_proposed_tokens else {}),
            **({"timings": self.timings_dict()} if self.queue_s or self.prefill_s or self.decode_s else {}),
        }

    def timings_dict(self) -> dict:
        """ParaLLM's ``usage`` extension: the request's seconds queued, prefilling and decoding."""
        return {"queue_s": self.queue_s, "prefill_s": self.prefill_s, "decode_s": self.decode_s}

    def speculative_dict(self) -> dict:
        """ParaLLM's ``usage`` extension: speculative decoding's drafted / accepted tokens."""
        p, a = self.spec_proposed_tokens, self.spec_accepted_tokens
        return {"proposed_tokens": p, "accepted_tokens": a, "acceptance_rate": a / p if p else 0.0}


@dataclass
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    top_logprobs: list[tuple[int, str, float]] = field(default_factory=list)


@dataclass
class StreamDelta:
    """One increment of one choice. ``finish_reason`` and ``usage`` are set on its last delta only;
    ``usage`` covers the whole request (all choices) and comes on the request's very last delta."""

    request_id: str
    index: int  # choice index (n > 1)
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    usage: Usage | None = None
    logprobs: list[TokenLogprob] | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    error: BaseException | None = None
    # ``text`` as typed pieces (typed_output: content, reasoning, tool-call start / argument pieces, and a
    # Finish on the choice's last delta); front ends map these instead of parsing ``text``.
    pieces: list = field(default_factory=list)


@dataclass
class Choice:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None
    stop_reason: str | int | None = None
    content: str | None = None  # text without tool-call markup (when tools were given)
    tool_calls: list = field(default_factory=list)  # chat_format.ToolCall, parsed when tools were given
    reasoning: str | None = None  # <think> / harmony analysis text, kept out of content (chat_format)
    incomplete: bool = False  # constrained output cut by max_tokens: it does not match its grammar


@dataclass
class GenerationResult:
    """A finished request. ``text`` / ``token_ids`` / ``finish_reason`` are the first choice's."""

    request_id: str
    choices: list[Choice]
    usage: Usage
    prompt_token_ids: list[int]
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def text(self) -> str:
        return self.choices[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.choices[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.choices[0].finish_reason

    @property
    def logprobs(self):
        return self.choices[0].logprobs

    @property
    def tool_calls(self):
        return self.choices[0].tool_calls

    @property
    def content(self) -> str | None:
        return self.choices[0].content


class _Done:
    """Sentinel: the request has ended (normally or with an error)."""

    def __init__(self, error: BaseException | None = None):
        self.error = error


_delivery = threading.local()  # the engine thread's deliveries of the current step, per event loop


@contextlib.contextmanager
def batched_deliveries():
    """Deliveries to async consumers made in the block on this thread reach each event loop in one call at
    its end (the engine thread wraps each step). One ``call_soon_threadsafe`` per row and token would wake
    the consumers' loop once per row; the woken loop then asks for the GIL while the engine thread is still
    delivering, and the engine thread is made to yield it at the next switch interval (5 ms): on a GPU,
    where a step is a few ms of host work, that is a step's length. Once per step, the loop runs while the
    engine thread waits in MLX (which releases the GIL)."""
    pending: dict = {}
    _delivery.pending = pending
    try:
        yield
    finally:
        _delivery.pending = None
        for loop, items in pending.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the caller's loop is closed: nobody is listening any more
                pass


def _put_all(items: list) -> None:
    for q, item in items:
        q.put_nowait(item)


class Channel:
    """Carries deliveries from the engine thread to one consumer.

    Sync consumers block on a thread-safe queue. Async consumers get items pushed into an
    ``asyncio.Queue`` on *their own* running loop via ``call_soon_threadsafe`` (LlamaIndex may run a
    second loop in a helper thread, so there is no single global loop).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None):
        self.loop = loop
        if loop is None:
            self._q: Any = queue.SimpleQueue()
        else:
            self._q = asyncio.Queue()

    def put(self, item) -> None:
        if self.loop is None:
            self._q.put(item)
            return
        pending = getattr(_delivery, "pending", None)
        if pending is not None:  # inside an engine step: handed over with the step's others
            pending.setdefault(self.loop, []).append((self._q, item))
        else:
            try:
                self.loop.call_soon_threadsafe(self._q.put_nowait, item)
            except RuntimeError:  # the caller's loop is closed: nobody is listening any more
                pass

    def get(self, timeout: float | None = None):
        return self._q.get(timeout=timeout)

    async def aget(self):
        return await self._q.get()


class Request:
    """What a caller submitted: a prompt, its sampling settings, and where results go."""

    vision = None  # a vision.VisionPrompt for a prompt with images (its key ids and image inputs)
    embedding = None  # an embedding.EmbeddingSpec for an embedding request (prefill only, no decode)
    adapter = None  # the LoRA adapter its rows run under (lora_adapters.LoRAAdapter); None: the base model

    def __init__(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        channel: Channel,
        grammar: Any = None,
        request_id: str | None = None,
        priority: int = 0,
        tools: list[dict] | None = None,
        group=None,
    ):
        self.id = request_id or f"req-{next(_req_ids)}"
        self.prompt_ids = prompt_ids
        self.params = params
        self.channel = channel
        self.grammar = grammar  # compiled constraint factory, or None
        self.tools = tools  # OpenAI tool dicts: tool calls are parsed from the output
        self.priority = priority
        # Admission is fair across groups (one HTTP request, one caller's batch): see Scheduler._next_fair.
        self.group = group if group is not None else self.id
        self.session: str | None = None  # its context stays pinned between turns (kv/session_pins.py)
        self.arrival = time.monotonic()
        self.admitted_time: float | None = None  # first scheduled for prefill (timeline.Timeline.planned)
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.finished = False
        self.usage = Usage(prompt_tokens=len(prompt_ids))
        self.remaining_choices = params.n
        self.cycle_guard = False  # stop a looping sequence (repetition_guard.py): set no max_tokens
        self.result: GenerationResult | None = None
        self.sequences: list = []  # its choices' scheduler Sequences (set when the scheduler takes it)
        self.span = None  # its OpenTelemetry spans while tracing is on (tracing.RequestSpan), ended with it

    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival


class RequestHandle:
    """What :meth:`Engine.submit` returns: iterate it (sync or async) for deltas; ``abort()`` it."""

    def __init__(self, engine, request: Request):
        self._engine = engine
        self.request = request
        self.id = request.id

    def abort(self) -> None:
        self._engine.abort(self.request)

    # Sync iteration -------------------------------------------------------------------------
    def __iter__(self):
        try:
            while True:
                item = self.request.channel.get()
                if isinstance(item, _Done):
                    if item.error is not None:
                        raise item.error
                    return
                yield item
        finally:
            if not self.request.finished:
                self.abort()

    # Async iteration ------------------------------------------------------------------------
    async def __aiter_impl(self):
        try:
            while True:
                item = await self.request.channel.aget()
                if isinstance(item, _Done):
                    if item.error is not None:
                        raise item.error
                    return
                yield item
        finally:
            if not self.request.finished:
                self.abort()

    def __aiter__(self):
        return self.__aiter_impl()
