"""OpenAI's wire format for ``parallm serve``: error bodies, response bodies and server-sent event
streams, built from the engine's results and deltas (:mod:`parallm_engine.serve.server` has the endpoints).

Streams follow OpenAI's chunk shapes: a first chunk per choice with the assistant role, content
deltas, tool calls as ``delta.tool_calls`` pieces (id and name first, argument JSON text after; the
engine's typed pieces, :mod:`typed_output`, mapped one to one; reasoning as ``delta.reasoning_content``), a chunk with the choice's ``finish_reason``,
then, with ``stream_options.include_usage``, one chunk with empty ``choices`` and the request's usage,
and ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from typing import Any, AsyncIterator

from fastapi.responses import JSONResponse

from parallm_engine.errors import (
    AdapterNotFoundError,
    ContextLengthExceededError,
    EngineDeadError,
    RankLostError,
    InvalidRequestError,
    OutOfMemoryError,
    ParaLLMError,
    QueueFullError,
    RequestCancelledError,
)
from parallm_engine.sampling.logprobs import chat_logprobs, completion_logprobs  # noqa: F401  (the one formatter)
from parallm_engine.serve.metrics import ServerMetrics
from parallm_engine.serve.protocol import new_id, now
from parallm_engine.core.request import Usage
from parallm_engine.formats.tool_calls import ToolCallDelta
from parallm_engine.core.validation import safe_text

logger = logging.getLogger("parallm_engine.serve.server")


class APIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        # Messages and params may quote the request (a model name, a dict key): escape lone surrogates
        # (which no UTF-8 body can carry) and cap their length.
        message = safe_text(str(message))
        param = None if param is None else safe_text(str(param), 200)
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class PromptTooLongError(APIError):
    """A prompt the context cannot hold: 400 ``context_length_exceeded`` in OpenAI's words (the message
    Codex CLI, aider and LiteLLM recognise); :mod:`anthropic_format` words it as Anthropic does."""

    def __init__(self, prompt_tokens: int, context_window: int, param: str = "messages"):
        super().__init__(400, f"This model's maximum context length is {context_window} tokens. However, your "
                         f"messages resulted in {prompt_tokens} tokens (at least one token must be left to "
                         "generate). Please reduce the length of the messages.", param=param,
                         code="context_length_exceeded")
        self.prompt_tokens, self.context_window = prompt_tokens, context_window


def api_error_from(exc: BaseException) -> APIError:
    """Map an engine error (or anything else) onto the HTTP error a client should see."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, AdapterNotFoundError):  # a LoRA adapter is a model to clients (vLLM's convention)
        return APIError(404, str(exc), param="model", code="model_not_found")
    if isinstance(exc, ContextLengthExceededError):
        return APIError(400, str(exc), param=exc.param or "messages", code="context_length_exceeded")
    if isinstance(exc, InvalidRequestError):  # GrammarError included
        return APIError(400, str(exc), param=_param_str(exc.param))
    if isinstance(exc, QueueFullError):
        retry = max(1, math.ceil(exc.retry_after or 1))
        return APIError(429, str(exc), type="rate_limit_error", code="queue_full", headers={"Retry-After": str(retry)})
    if isinstance(exc, RankLostError):
        return APIError(503, str(exc), type="server_error", code="rank_lost")
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), type="server_error", code="engine_dead")
    if isinstance(exc, RequestCancelledError):
        return APIError(503, str(exc), type="server_error", code="request_cancelled")
    if isinstance(exc, OutOfMemoryError):
        return APIError(507, str(exc), type="server_error", code="out_of_memory")
    if isinstance(exc, ParaLLMError):
        return APIError(500, str(exc), type="server_error")
    return APIError(500, f"internal error ({type(exc).__name__}); see the server log", type="server_error")


def _param_str(param: Any) -> str | None:
    return None if param is None else str(param)


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def sse(obj: Any) -> str:
    return f"data: {dumps(obj)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class Timing:
    """Per-request timing for the server's histograms (TTFT, inter-token latency, end-to-end)."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics
        self.t0 = time.monotonic()
        self.first: float | None = None
        self.last: dict[int, float] = {}

    def on_delta(self, delta) -> None:
        if not delta.token_ids:
            return
        t = time.monotonic()
        if self.first is None:
            self.first = t
            self.metrics.ttft.observe(t - self.t0)
        prev = self.last.get(delta.index)
        if prev is not None:
            self.metrics.itl.observe(t - prev)
        self.last[delta.index] = t

    def on_done(self, usage) -> None:
        self.metrics.e2e.observe(time.monotonic() - self.t0)
        if usage is not None:
            self.metrics.prompt_tokens.observe(usage.prompt_tokens)
            self.metrics.generation_tokens.observe(usage.completion_tokens)


async def merged(handles: list, timing: Timing) -> AsyncIterator[tuple[int, Any]]:
    """Deltas of several engine requests as they arrive, tagged with the request's position."""
    if len(handles) == 1:
        async for delta in handles[0]:
            timing.on_delta(delta)
            yield 0, delta
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, handle) -> None:
        try:
            async for delta in handle:
                queue.put_nowait((i, delta, None))
            queue.put_nowait((i, None, None))
        except Exception as exc:
            queue.put_nowait((i, None, exc))

    tasks = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
    try:
        remaining = len(handles)
        while remaining:
            i, delta, exc = await queue.get()
            if exc is not None:
                raise exc
            if delta is None:
                remaining -= 1
                continue
            timing.on_delta(delta)
            yield i, delta
    finally:
        for t in tasks:
            t.cancel()
        abort_all(handles)


def abort_all(handles: list) -> None:
    for h in handles:
        if not h.request.finished:
            h.abort()


def sum_usage(results) -> Usage:
    total = Usage()
    for r in results:
        if r is None:
            continue
        total.prompt_tokens += r.usage.prompt_tokens
        total.completion_tokens += r.usage.completion_tokens
        total.cached_tokens += r.usage.cached_tokens
        total.reasoning_tokens += r.usage.reasoning_tokens
        total.spec_proposed_tokens += r.usage.spec_proposed_tokens
        total.spec_accepted_tokens += r.usage.spec_accepted_tokens
        # The call's timings: each phase as long as its longest request's (they ran together).
        total.queue_s = max(total.queue_s, r.usage.queue_s)
        total.prefill_s = max(total.prefill_s, r.usage.prefill_s)
        total.decode_s = max(total.decode_s, r.usage.decode_s)
    return total


def reported_calls(calls, single_call: bool) -> list:
    """A choice's tool calls as a response reports them: all, or with ``parallel_tool_calls=False``
    (``single_call``) the first only."""
    return list(calls or [])[: 1 if single_call else None]


def reported(piece, single_call: bool) -> bool:
    """Whether a stream sends this piece: with ``single_call`` the pieces of calls after the first are
    dropped, as :func:`reported_calls` drops those calls from a full response."""
    return not (single_call and isinstance(piece, ToolCallDelta) and piece.index > 0)


def chat_response(result, model_name: str, single_call: bool) -> dict:
    choices = []
    for c in result.choices:
        calls = reported_calls(c.tool_calls, single_call)
        content = c.content if c.content is not None else c.text
        finish = c.finish_reason
        if calls and finish == "stop":
            finish = "tool_calls"
        message: dict[str, Any] = {"role": "assistant", "content": content if (content or not calls) else None}
        if getattr(c, "reasoning", None):  # <think> / harmony analysis, as vLLM and DeepSeek send it
            message["reasoning_content"] = c.reasoning
        if calls:
            message["tool_calls"] = [tc.as_openai() for tc in calls]
        choices.append({"index": c.index, "message": message, "finish_reason": finish,
                        "logprobs": chat_logprobs(c.logprobs)})
    u = result.usage
    return {"id": new_id("chatcmpl"), "object": "chat.completion", "created": now(), "model": model_name,
            "choices": choices, "usage": u.as_dict(),
            "system_fingerprint": None}


def completion_response(results, model_name: str, n: int, echoes: list[str], want_logprobs: bool) -> dict:
    choices = []
    for pi, r in enumerate(results):
        for c in r.choices:
            text = echoes[pi] + c.text
            lp = completion_logprobs(c.logprobs, len(echoes[pi])) if want_logprobs else None
            choices.append({"index": pi * n + c.index, "text": text, "finish_reason": c.finish_reason, "logprobs": lp})
    u = sum_usage(results)
    return {"id": new_id("cmpl"), "object": "text_completion", "created": now(), "model": model_name,
            "choices": choices, "usage": u.as_dict(),
            "system_fingerprint": None}


def stream_error(exc: BaseException) -> APIError:
    """An error after a stream has started, as the in-band error each API sends; an unexpected one is logged."""
    err = api_error_from(exc)
    if err.status >= 500 and not isinstance(exc, ParaLLMError):
        logger.exception("stream failed", exc_info=exc)
    return err


def _error_event(exc: BaseException) -> str:
    return sse(stream_error(exc).body())


async def chat_stream(handles: list, timing: Timing, model_name: str, single_call: bool,
                      include_usage: bool) -> AsyncIterator[str]:
    """The engine's typed pieces (``StreamDelta.pieces``, :mod:`typed_output`) as chat.completion.chunk
    events; nothing is parsed here, so the joined stream is the non-streamed body."""
    from parallm_engine.formats.typed_output import Finish

    rid, created = new_id("chatcmpl"), now()
    extra = {"usage": None} if include_usage else {}
    n = handles[0].request.params.n

    def chunk(index: int, delta: dict, finish: str | None = None, logprobs: dict | None = None) -> str:
        choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        return sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_name,
                     "choices": [choice], "system_fingerprint": None, **extra})

    def pieces_to_chunks(index: int, pieces: list, logprobs: dict | None) -> list[str]:
        out, text = [], ""
        for ev in pieces:
            if isinstance(ev, Finish) or not reported(ev, single_call):
                continue
            if isinstance(ev, ToolCallDelta):
                if text:
                    out.append(chunk(index, {"content": text}))
                    text = ""
                call: dict[str, Any] = {"index": ev.index}
                if ev.id is not None:
                    call.update(id=ev.id, type="function",
                                function={"name": ev.name or "", "arguments": ev.arguments_delta or ""})
                else:
                    call["function"] = {"arguments": ev.arguments_delta}
                out.append(chunk(index, {"tool_calls": [call]}))
            elif getattr(ev, "reasoning", None):  # ReasoningDelta
                if text:
                    out.append(chunk(index, {"content": text}))
                    text = ""
                out.append(chunk(index, {"reasoning_content": ev.reasoning}))
            elif ev.text:
                text += ev.text
        if text or logprobs:
            out.append(chunk(index, {"content": text}, logprobs=logprobs))
        return out

    try:
        for i in range(n):
            yield chunk(i, {"role": "assistant", "content": ""})
        async for _, delta in merged(handles, timing):
            for piece in pieces_to_chunks(delta.index, delta.pieces, chat_logprobs(delta.logprobs)):
                yield piece
            if delta.finish_reason is not None:
                finish = next((p.reason for p in delta.pieces if isinstance(p, Finish)), delta.finish_reason)
                yield chunk(delta.index, {}, finish=finish)
        if include_usage:
            u = sum_usage([h.request.result for h in handles])
            yield sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_name,
                        "choices": [], "system_fingerprint": None,
                        "usage": u.as_dict()})
    except Exception as exc:  # the response has started: report in-band
        yield _error_event(exc)
    yield SSE_DONE


async def completion_stream(handles: list, timing: Timing, model_name: str, n: int, echoes: list[str],
                             want_logprobs: bool, include_usage: bool) -> AsyncIterator[str]:
    rid, created = new_id("cmpl"), now()
    extra = {"usage": None} if include_usage else {}
    offsets: dict[int, int] = {}

    def chunk(index: int, text: str, finish: str | None = None, logprobs: dict | None = None) -> str:
        choice = {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}
        return sse({"id": rid, "object": "text_completion", "created": created, "model": model_name,
                     "choices": [choice], "system_fingerprint": None, **extra})

    try:
        for pi, echo in enumerate(echoes):
            if echo:
                for c in range(n):
                    offsets[pi * n + c] = len(echo)
                    yield chunk(pi * n + c, echo)
        async for pi, delta in merged(handles, timing):
            index = pi * n + delta.index
            lp = None
            if want_logprobs and delta.logprobs:
                lp = completion_logprobs(delta.logprobs, offsets.get(index, 0))
            offsets[index] = offsets.get(index, 0) + len(delta.text)
            if delta.text or lp or delta.finish_reason is not None:
                yield chunk(index, delta.text, finish=delta.finish_reason, logprobs=lp)
        if include_usage:
            u = sum_usage([h.request.result for h in handles])
            yield sse({"id": rid, "object": "text_completion", "created": created, "model": model_name,
                        "choices": [], "system_fingerprint": None,
                        "usage": u.as_dict()})
    except Exception as exc:
        yield _error_event(exc)
    yield SSE_DONE
