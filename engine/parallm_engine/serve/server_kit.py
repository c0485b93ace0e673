"""The request path every API of ``parallm serve`` shares (OpenAI's chat completions, Anthropic Messages,
OpenAI Responses): :class:`ServerKit` prepares a chat, submits it under the queue shares, drains it or
streams it (aborting its engine requests however the response ends), and :func:`output_pieces` is the
one function through which the extra APIs read the model's output as typed pieces.

Each extra API translates its request into a :class:`~parallm_engine.serve.protocol.ChatCompletionRequest`
(:func:`chat_request`), so the chat template, tools, grammar-constrained tool calls, ``tool_choice``,
``response_format``, every validation and hostile-input rule are the chat endpoint's own.
"""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from parallm_engine.formats.chat_format import ContentDelta, ReasoningDelta, ToolCallDelta
from parallm_engine.errors import ContextLengthExceededError, InvalidRequestError, ParaLLMError, QueueFullError
from parallm_engine.serve.openai_format import (APIError, PromptTooLongError, Timing, abort_all, merged, reported,
                                                sum_usage)
from parallm_engine.serve.protocol import ChatCompletionRequest, ChatMessage, ErrorResponse, NamedToolChoice
from parallm_engine.serve.queue_shares import Lease
from parallm_engine.serve.request_identity import identity_fields, identity_kwargs
from parallm_engine.vision.chat import chat_prompt as vision_chat_prompt
from parallm_engine.vision.inputs import IMAGE_PART_TYPES, has_images

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
#: Sent when a stream has been silent this long (a long prompt prefilling), so clients and proxies with idle
#: timeouts keep the connection: an SSE comment, which every SSE parser skips (Anthropic's routes send
#: their ``ping`` event instead). Twice a second, so a client sees one at least every second.
KEEPALIVE_S = 0.5
SSE_KEEPALIVE = ": keep-alive\n\n"
#: Chat prompts longer than this (characters of message text) are rendered and tokenized off the event loop:
#: an agent's 20k-token prompt takes a few hundred ms, which would stall every other stream's events.
LONG_PROMPT_CHARS = 16_384
#: The OpenAI-shaped error answers the routes document.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "Invalid request"},
    401: {"model": ErrorResponse, "description": "Missing or wrong API key"},
    404: {"model": ErrorResponse, "description": "Unknown model"},
    429: {"model": ErrorResponse, "description": "Engine queue full, or this key's share of it (see Retry-After)"},
    503: {"model": ErrorResponse, "description": "Engine not running"},
}


@dataclass
class PreparedChat:
    """A chat request as the engine takes it (before its prompt is rendered and submitted)."""

    model_name: str
    messages: list[dict]
    tools: list[dict] | None
    kwargs: dict[str, Any]  # Engine.submit's keyword arguments
    constrained: bool  # a grammar is compiled on submit (kept off the event loop)
    single_call: bool  # parallel_tool_calls=False: at most one call is reported
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    allow_special_tokens: bool = False
    identity: dict[str, Any] = field(default_factory=dict)  # request_identity.identity_fields of the client's request


@dataclass
class ChatRun:
    """A submitted chat: its engine handles, timing and queue lease."""

    handles: list
    timing: Any
    lease: Lease | None

    def end(self) -> None:
        """Give the lease back unless a stream has taken it (idempotent)."""
        if self.lease is not None:
            self.lease.release()
            self.lease = None


def message_dict(m: ChatMessage) -> dict[str, Any]:
    """A validated chat message as the dict the chat template renders: text, or with ``image_url`` parts
    (for a vision-language model: ``vision_chat``) text and image parts in order."""
    out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role}
    content = m.content
    if isinstance(content, list) and any(p.type in IMAGE_PART_TYPES for p in content):
        content = [p.model_dump(exclude_none=True) if p.type in IMAGE_PART_TYPES
                   else {"type": "text", "text": p.text or ""} for p in content]
    elif isinstance(content, list):
        parts = []
        for part in content:
            if part.type in ("text", "input_text") and part.text is not None:
                parts.append(part.text)
            else:
                raise InvalidRequestError(
                    f"content part of type {part.type!r} is not supported; this model reads text only",
                    param="messages",
                )
        content = "".join(parts)
    out["content"] = content if content is not None else ""
    if m.name:
        out["name"] = m.name
    if m.tool_calls:
        out["tool_calls"] = [tc.model_dump() for tc in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client has gone (the request body has already been read)."""
    while True:
        message = await request.receive()
        if message.get("type") == "http.disconnect":
            return


async def with_keepalive(events: AsyncIterator[str], beat: str, interval: float = KEEPALIVE_S) -> AsyncIterator[str]:
    """``events``, with ``beat`` sent whenever the next event takes longer than ``interval`` seconds."""
    it = events.__aiter__()
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(it.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                yield beat
                continue
            finished, pending = pending, None
            try:
                event = finished.result()
            except StopAsyncIteration:
                return
            yield event
    finally:
        if pending is not None:  # the client went: stop the events' generator before it is closed
            pending.cancel()
            try:
                await pending
            except BaseException:  # its cancellation, or whatever it raised: the response is over
                pass
        close = getattr(it, "aclose", None)
        if close is not None:
            await close()


class EngineStream(StreamingResponse):
    """A streaming response that aborts its engine requests however the response ends (finished,
    client gone, send failed, never started), and keeps a silent stream alive with ``keepalive``
    every :data:`KEEPALIVE_S` seconds."""

    def __init__(self, content, handles: list, on_close: Callable[[bool], None] | None = None,
                 lease: Lease | None = None, keepalive: str = SSE_KEEPALIVE, headers: dict[str, str] | None = None):
        super().__init__(with_keepalive(content, keepalive), media_type="text/event-stream",
                         headers={**SSE_HEADERS, **(headers or {})})
        self._handles = handles
        self._on_close = on_close
        self._lease = lease

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aborted = any(not h.request.finished for h in self._handles)
            abort_all(self._handles)
            if self._lease is not None:
                self._lease.release()
            if self._on_close is not None:
                self._on_close(aborted)


def submit_all(engine, prompts: list, loop, kwargs: dict) -> list:
    """Submit every prompt as one fairness group (the scheduler takes turns across HTTP requests); if
    one is refused, abort the ones already queued and re-raise."""
    handles = []
    group = object()
    try:
        for p in prompts:
            handles.append(engine.submit(p, loop=loop, group=group, **kwargs))
    except BaseException:
        abort_all(handles)
        raise
    return handles


class ServerKit:
    """The chat endpoint's request path, shared by every API's routes (OpenAI's, Anthropic's, Responses): the
    server's state and dependencies, preparing a chat, submitting it under the queue shares, draining it or
    streaming it. :func:`parallm_engine.serve.server.create_app` makes one per app."""

    def __init__(self, state, checked: list, auth: list):
        self.state = state  # server.ServerState
        self.checked = checked  # dependencies: API key, then no lone surrogates anywhere in the body
        self.auth = auth  # dependencies: API key only

    async def run_to_completion(self, request: Request, handles: list, timing: Timing, endpoint: str) -> list:
        """Drain the handles; abort them all if the client goes away first."""
        state = self.state

        async def drain():
            async for _ in merged(handles, timing):
                pass

        work = asyncio.ensure_future(drain())
        watcher = asyncio.ensure_future(wait_for_disconnect(request))
        try:
            await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                state.metrics.count_outcome(endpoint, "client_disconnected")
                raise APIError(499, "client disconnected", code="client_disconnected")
            work.result()  # re-raises an engine error
        except ParaLLMError:
            state.metrics.count_outcome(endpoint, "error")
            raise
        finally:
            watcher.cancel()
            if not work.done():
                work.cancel()
            abort_all(handles)
        results = [h.request.result for h in handles]
        timing.on_done(sum_usage(results))
        state.metrics.count_outcome(endpoint, "finished")
        return results

    def reserve(self, request: Request, cost: int, endpoint: str, param: str) -> Lease:
        """This request's share of the queue (400 / 429 when over a limit); released when it ends."""
        try:
            return self.state.shares.acquire(getattr(request.state, "parallm_key", None), cost, param=param)
        except APIError:
            self.state.metrics.count_outcome(endpoint, "rejected")
            raise

    async def submit(self, prompts: list, kwargs: dict, endpoint: str, offload: bool) -> list:
        eng = self.state.engine_or_503()
        loop = asyncio.get_running_loop()
        try:
            if offload:  # compiling a grammar takes a while: keep the event loop serving others
                return await asyncio.to_thread(submit_all, eng, prompts, loop, kwargs)
            return submit_all(eng, prompts, loop, kwargs)
        except QueueFullError:
            self.state.metrics.count_outcome(endpoint, "rejected")
            raise

    def stream_closed(self, endpoint: str, timing: Timing, handles: list) -> Callable[[bool], None]:
        metrics = self.state.metrics

        def on_close(aborted: bool) -> None:
            if aborted:
                metrics.count_outcome(endpoint, "client_disconnected")
            else:
                results = [h.request.result for h in handles]
                if all(r is not None for r in results):
                    timing.on_done(sum_usage(results))
                    metrics.count_outcome(endpoint, "finished")
                else:
                    metrics.count_outcome(endpoint, "error")
        return on_close

    def submit_kwargs(self, req) -> dict[str, Any]:
        """``Engine.submit``'s keyword arguments for a chat or completion request: its sampling, the LoRA
        adapter its ``model`` names, its ``response_format`` (the session is the request's identity's:
        :func:`~parallm_engine.serve.request_identity.request_session`, at submit)."""
        kwargs = req.sampling_kwargs()
        kwargs["adapter"] = self.state.adapter_for(req.model)
        response_format = req.response_format.to_engine() if req.response_format else None
        if response_format is not None:  # "text" is no constraint
            kwargs["response_format"] = response_format
        return kwargs

    def prepare_chat(self, req: ChatCompletionRequest, template_kwargs: dict | None = None,
                     origin: Any = None) -> PreparedChat:
        """A chat request as the engine takes it: its messages and the submit kwargs (tools, tool_choice,
        grammar). The Anthropic and Responses routes translate their requests onto this too; ``origin`` is
        the request as the client sent it (its identity fields name the session; default ``req``)."""
        state = self.state
        model_name = state.check_model(req.model)
        state.engine_or_503()
        messages = [message_dict(m) for m in req.messages]
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        tool_choice = req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedToolChoice) else req.tool_choice
        if tools is None and tool_choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice requires tools", param="tool_choice")
        if tool_choice == "none":  # nothing may be called: do not even show the tools
            tools, tool_choice = None, None
        kwargs = self.submit_kwargs(req)
        if tools:
            kwargs["tools"] = tools
            if tool_choice is not None:
                kwargs["tool_choice"] = tool_choice
            if req.parallel_tool_calls is not None:
                kwargs["parallel_tool_calls"] = req.parallel_tool_calls
        response_format = kwargs.get("response_format")
        constrained = response_format is not None or bool(tools and tool_choice not in (None, "auto"))
        return PreparedChat(model_name, messages, tools, kwargs, constrained, req.parallel_tool_calls is False,
                            dict(template_kwargs or {}), req.allow_special_tokens,
                            identity_fields(req if origin is None else origin))

    async def chat_prompt(self, p: PreparedChat):
        """The prepared chat's prompt: token ids, or a vision prompt."""
        eng = self.state.engine_or_503()
        if has_images(p.messages):  # decoding, hashing and the image processor: off the event loop
            return await asyncio.to_thread(vision_chat_prompt, eng, p.messages, p.tools, {})  # remote URLs never fetched
        render = functools.partial(eng.apply_chat_template, p.messages, tools=p.tools,
                                   allow_special_tokens=p.allow_special_tokens, **p.template_kwargs)
        if sum(len(m["content"]) for m in p.messages if isinstance(m.get("content"), str)) > LONG_PROMPT_CHARS:
            return await asyncio.to_thread(render)  # a coding agent's prompt: the other streams keep flowing
        return render()

    async def start_chat(self, p: PreparedChat, request: Request, endpoint: str, prompt=None) -> ChatRun:
        """Submit a prepared chat under this request's queue share; the caller ends the lease (or hands
        it to the stream)."""
        prompt = await self.chat_prompt(p) if prompt is None else prompt
        p.kwargs.update(identity_kwargs(request.headers, p.identity))
        timing = Timing(self.state.metrics)
        lease = self.reserve(request, p.kwargs.get("n", 1), endpoint, "n")
        try:
            handles = await self.submit([prompt], p.kwargs, endpoint, offload=p.constrained)
        except ContextLengthExceededError as exc:  # each API's own words for it (PromptTooLongError)
            lease.release()
            raise PromptTooLongError(prompt_length(prompt), self.state.engine_or_503().context_window,
                                     param="input" if endpoint == "responses" else "messages") from exc
        except BaseException:
            lease.release()
            raise
        return ChatRun(handles, timing, lease)

    async def complete_chat(self, p: PreparedChat, request: Request, endpoint: str):
        """Run a prepared chat to its end (aborted if the client goes first): its result."""
        run = await self.start_chat(p, request, endpoint)
        try:
            return (await self.run_to_completion(request, run.handles, run.timing, endpoint))[0]
        finally:
            run.end()

    async def stream_chat(self, p: PreparedChat, request: Request, endpoint: str,
                          events: Callable[[ChatRun], AsyncIterator[str]], keepalive: str = SSE_KEEPALIVE,
                          headers: dict[str, str] | None = None) -> StreamingResponse:
        """Start a prepared chat and answer with ``events(run)`` as server-sent events (``keepalive`` while
        they are silent; ``headers`` besides SSE's); the stream aborts the run's requests and gives its lease
        back when it ends."""
        run = await self.start_chat(p, request, endpoint)
        try:
            return self.engine_stream(events(run), run, endpoint, keepalive, headers)
        finally:
            run.end()  # nothing left to release once the stream holds the lease

    def engine_stream(self, gen, run: ChatRun, endpoint: str, keepalive: str = SSE_KEEPALIVE,
                      headers: dict[str, str] | None = None) -> StreamingResponse:
        """The SSE response for ``gen``; it aborts the run's requests and gives its lease back when it ends."""
        lease, run.lease = run.lease, None
        return EngineStream(gen, run.handles, self.stream_closed(endpoint, run.timing, run.handles), lease,
                            keepalive, headers)


def chat_request(body: dict[str, Any], param_prefix: str = "") -> ChatCompletionRequest:
    """Validate a translated request as the chat endpoint would (a failure is the client's: 400)."""
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first.get("loc", ()))
        raise APIError(400, f"{loc}: {first.get('msg', 'invalid value')}" if loc else first.get("msg", "invalid"),
                       param=(param_prefix + loc) or None)


def prompt_length(prompt) -> int:
    """Token count of a rendered chat prompt (token ids, or a vision prompt's ids)."""
    ids = getattr(prompt, "token_ids", prompt)
    return len(ids)


@dataclass
class Finished:
    """A choice ended: ``finish_reason`` ("stop" / "length" / "abort"), the stop string or id that ended it."""

    finish_reason: str
    stop_reason: Any = None


OutputPiece = ContentDelta | ReasoningDelta | ToolCallDelta | Finished


async def output_pieces(run: ChatRun, single_call: bool) -> AsyncIterator[OutputPiece]:
    """The model's output of a one-choice run as typed pieces: text, reasoning, tool-call pieces (id and
    name first, argument JSON text after), then :class:`Finished`. The engine's own pieces
    (``StreamDelta.pieces``, from ``typed_output``: the one parser of model text), so these streams agree with
    the non-streamed bodies (built from the same ``Choice``) by construction. ``single_call``: only the first
    call's pieces (``parallel_tool_calls=False``, :func:`~parallm_engine.serve.openai_format.reported`)."""
    async for _, delta in merged(run.handles, run.timing):
        for piece in delta.pieces:
            if isinstance(piece, (ContentDelta, ReasoningDelta, ToolCallDelta)) and reported(piece, single_call):
                yield piece  # the engine's Finish is replaced by Finished below (the engine's own reason)
        if delta.finish_reason is not None:
            yield Finished(delta.finish_reason, delta.stop_reason)
