"""What the extra API routers of ``parallm serve`` (Anthropic Messages, OpenAI Responses) share with the
chat-completions endpoint: its prepared request, its submission under the queue shares, its stream
response, and the one function through which they read the model's output as typed pieces.

Each extra API translates its request into a :class:`~parallm_engine.protocol.ChatCompletionRequest`
(:func:`chat_request`), so the chat template, tools, grammar-constrained tool calls, ``tool_choice``,
``response_format``, every validation and hostile-input rule are the chat endpoint's own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI
from pydantic import ValidationError

from .chat_format import ContentDelta, ReasoningDelta, ToolCallDelta
from .openai_format import APIError, merged
from .protocol import ChatCompletionRequest
from .queue_shares import Lease


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


@dataclass
class ServerKit:
    """The chat endpoint's parts, as :func:`parallm_engine.server.create_app` builds them."""

    state: Any  # server.ServerState
    checked: list  # dependencies: API key, then no lone surrogates anywhere in the body
    auth: list  # dependencies: API key only
    prepare_chat: Callable[..., PreparedChat]  # (ChatCompletionRequest, template_kwargs=None)
    chat_prompt: Callable  # async (PreparedChat) -> the prompt (token ids, or a vision prompt)
    start_chat: Callable  # async (PreparedChat, Request, endpoint, prompt=None) -> ChatRun
    run_to_completion: Callable  # async (Request, handles, timing, endpoint) -> results
    engine_stream: Callable  # (async generator of SSE text, ChatRun, endpoint) -> StreamingResponse


def include_api_routers(app: FastAPI, kit: ServerKit) -> None:
    from .anthropic_routes import anthropic_router
    from .responses_routes import responses_router

    app.include_router(anthropic_router(kit))
    app.include_router(responses_router(kit))


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


async def output_pieces(run: ChatRun, with_tools: bool) -> AsyncIterator[OutputPiece]:
    """The model's output of a one-choice run as typed pieces: text, reasoning, tool-call pieces (id and
    name first, argument JSON text after), then :class:`Finished`. The engine's own pieces
    (``StreamDelta.pieces``, from ``typed_output``: the one parser of model text), so these streams agree with
    the non-streamed bodies (built from the same ``Choice``) by construction. ``with_tools``: whether the
    request offered tools (the engine already parses calls only then)."""
    async for _, delta in merged(run.handles, run.timing):
        for piece in delta.pieces:
            if isinstance(piece, (ContentDelta, ReasoningDelta, ToolCallDelta)):
                yield piece  # the engine's Finish is replaced by Finished below (the engine's own reason)
        if delta.finish_reason is not None:
            yield Finished(delta.finish_reason, delta.stop_reason)
