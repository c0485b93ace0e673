"""Anthropic's Messages API for ``parallm serve``: request models, their translation onto the chat
request the engine's chat endpoint runs, response bodies, the server-sent event stream and the error
shape (:mod:`parallm_engine.serve.anthropic_routes` has the endpoints).

Translation: ``system`` (a string or text blocks) is the system message; ``text`` blocks are text,
``image`` blocks (base64, or a URL, which is never fetched) image parts for a vision model, ``tool_use``
blocks the assistant's tool calls, ``tool_result`` blocks tool messages; ``thinking`` blocks a client
sends back are dropped (the chat template renders past turns without them). ``thinking``: ``enabled`` /
``disabled`` is the template's switch; ``budget_tokens`` (below ``max_tokens``; no 1,024 minimum here) is the
engine's thinking-token budget: the model's reasoning is closed after that many tokens and the answer
follows. A ``thinking`` block's ``signature`` is a digest of its text, not an attestation (none is checked
on the way back in). ``tools`` are function
tools; ``tool_choice`` ``auto`` / ``any`` / ``tool`` / ``none`` are ``auto`` / ``required`` / named / none
(``any`` and ``tool`` constrain decoding to a valid call, as on chat completions).

Usage follows Anthropic's convention: ``input_tokens`` are the prompt tokens NOT read from the prefix
cache, ``cache_read_input_tokens`` those that were (their sum is the prompt).

A tool call cut off by ``max_tokens`` (``stop_reason: "max_tokens"``) is still a ``tool_use`` block, and its
``input`` is what the stream gave: the stream sends the partial argument text as generated
(``input_json_delta`` pieces), and the non-streamed block's ``input`` is that text parsed as the anthropic SDK's
stream accumulator parses it (jiter's partial mode, the same parser as ``pydantic_core.from_json(...,
allow_partial=True)``: an unfinished string, number or literal is left out; ``{}`` before any argument text),
so ``messages.create`` and ``messages.stream(...).get_final_message()`` give the same message.
"""

from __future__ import annotations

import datetime
import hashlib
import json
from typing import Any, AsyncIterator, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from pydantic_core import from_json

from parallm_engine.formats.chat_format import ContentDelta, ReasoningDelta, ToolCallDelta
from parallm_engine.serve.agent_tools import OfferedTools
from parallm_engine.serve.openai_format import APIError, PromptTooLongError, dumps, reported_calls, stream_error
from parallm_engine.serve.protocol import MAX_STOP, ModelCard, new_id
from parallm_engine.serve.server_kit import ChatRun, Finished, output_pieces

ANTHROPIC_PREFIX = "/v1/messages"

#: Anthropic's error type for each HTTP status.
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


# ----------------------------------------------------------------------------------------------
# Requests
# ----------------------------------------------------------------------------------------------


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True, protected_namespaces=(), allow_inf_nan=False)


class ImageSource(_Model):
    type: Literal["base64", "url"]
    media_type: str | None = None
    data: str | None = None
    url: str | None = None


class TextBlock(_Model):
    """A block inside a ``tool_result`` (text)."""

    type: str
    text: str | None = None


class ContentBlock(_Model):
    """One content block: ``text``, ``image``, ``tool_use``, ``tool_result``, ``thinking``."""

    type: str
    text: str | None = None
    source: ImageSource | None = None
    id: str | None = None  # tool_use
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None  # tool_result
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None


class AnthropicMessage(_Model):
    role: Literal["user", "assistant", "system"]  # system: a mid-conversation system message (Claude Code's)
    content: str | list[ContentBlock]


class AnthropicTool(_Model):
    type: str | None = None  # absent or "custom"; Anthropic's server tools are not offered (agent_tools.py)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})


class AnthropicToolChoice(_Model):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(_Model):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=0)


class OutputFormat(_Model):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Model):
    """``output_config``: ``format`` (a JSON schema the answer follows, grammar-constrained); ``effort``
    is accepted and ignored."""

    format: OutputFormat | None = None
    effort: str | None = None


class CountTokensRequest(_Model):
    """``POST /v1/messages/count_tokens``: the prompt part of a Messages request."""

    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[ContentBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    # Accepted and ignored: earlier thinking is never shown to the model again, so there is none to clear,
    # and tool results are kept whole.
    context_management: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages``."""

    max_tokens: int = Field(ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    stop_sequences: list[str] | None = Field(default=None, max_length=MAX_STOP)
    stream: bool | None = False
    metadata: dict[str, Any] | None = None


class CountTokensResponse(_Model):
    input_tokens: int


class AnthropicErrorDetail(_Model):
    type: str
    message: str


class AnthropicErrorResponse(_Model):
    type: Literal["error"] = "error"
    error: AnthropicErrorDetail


# ----------------------------------------------------------------------------------------------
# Translation onto the chat request
# ----------------------------------------------------------------------------------------------


def _text_of(content: str | list[ContentBlock] | list[TextBlock] | None, param: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for i, block in enumerate(content):
        if block.type != "text":
            raise APIError(400, f"{param}[{i}]: only text blocks are supported here, not {block.type!r}",
                           param=f"{param}[{i}].type")
        texts.append(block.text or "")
    return "\n".join(texts)


def _image_part(block: ContentBlock, param: str) -> dict:
    src = block.source
    if src is None:
        raise APIError(400, f"{param}: an image block needs a source", param=f"{param}.source")
    if src.type == "base64":
        if not src.data or not src.media_type:
            raise APIError(400, f"{param}: a base64 image needs media_type and data", param=f"{param}.source")
        url = f"data:{src.media_type};base64,{src.data}"
    else:
        if not src.url:
            raise APIError(400, f"{param}: a url image needs a url", param=f"{param}.source.url")
        url = src.url
    return {"type": "image_url", "image_url": {"url": url}}


#: Claude Code's first system block: billing metadata for Anthropic's servers, not prompt text, and different
#: in every session (it would end the prefix that sessions' identical system prompts share at its first tokens).
BILLING_HEADER = "x-anthropic-billing-header:"


def _system_prompt(req: CountTokensRequest) -> str | None:
    """``system`` (without the billing block), then each system message in ``messages`` in order: one system
    prompt (chat templates take one, first)."""
    system = req.system
    if isinstance(system, list):
        system = [b for b in system if not (b.type == "text" and (b.text or "").startswith(BILLING_HEADER))]
    texts = [_text_of(system, "system")] if system else []
    texts += [_text_of(m.content, f"messages[{i}].content") for i, m in enumerate(req.messages) if m.role == "system"]
    texts = [t for t in texts if t]
    return "\n\n".join(texts) if texts else None


def _chat_messages(req: CountTokensRequest) -> list[dict]:
    out: list[dict] = []
    system = _system_prompt(req)
    if system:
        out.append({"role": "system", "content": system})
    for i, m in enumerate(req.messages):
        param = f"messages[{i}].content"
        if m.role == "system":
            continue  # in the system prompt
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        parts: list[dict] = []
        calls: list[dict] = []
        for j, block in enumerate(m.content):
            where = f"{param}[{j}]"
            if block.type == "text":
                parts.append({"type": "text", "text": block.text or ""})
            elif block.type == "image" and m.role == "user":
                parts.append(_image_part(block, where))
            elif block.type == "tool_use" and m.role == "assistant":
                if not block.id or not block.name:
                    raise APIError(400, f"{where}: tool_use needs id and name", param=where)
                calls.append({"id": block.id, "type": "function",
                              "function": {"name": block.name, "arguments": json.dumps(block.input or {})}})
            elif block.type == "tool_result" and m.role == "user":
                if not block.tool_use_id:
                    raise APIError(400, f"{where}: tool_result needs tool_use_id", param=f"{where}.tool_use_id")
                text = _text_of(block.content, f"{where}.content")
                out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                            "content": f"Error: {text}" if block.is_error else text})
            elif block.type in ("thinking", "redacted_thinking") and m.role == "assistant":
                continue  # earlier reasoning is not shown to the model again
            else:
                raise APIError(400, f"{where}: content block type {block.type!r} is not supported in a "
                               f"{m.role} message", param=f"{where}.type")
        if not parts and not calls:
            continue
        if any(p["type"] != "text" for p in parts):
            content: Any = parts
        else:
            content = "".join(p["text"] for p in parts)
        msg: dict[str, Any] = {"role": m.role, "content": content}
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    if not any(m["role"] != "system" for m in out):
        raise APIError(400, "messages: at least one non-empty message is required", param="messages")
    return out


def _tool_fields(req: CountTokensRequest, tools: OfferedTools) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if tools.tools:
        out["tools"] = tools.tools
    choice = req.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise APIError(400, "tool_choice: type 'tool' needs a name", param="tool_choice.name")
            if not any(t["function"]["name"] == choice.name for t in tools.tools):
                raise APIError(400, f"tool_choice: no custom tool named {choice.name!r}", param="tool_choice.name")
            out["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        if choice.disable_parallel_tool_use:
            out["parallel_tool_calls"] = False
    return out


def chat_body(req: CountTokensRequest, tools: OfferedTools) -> dict[str, Any]:
    """The chat-completions request body ``req`` means, offering ``tools`` (``anthropic_tools(req.tools)``;
    for :func:`server_kit.chat_request`). Its session is read from ``req`` itself (request_identity.py)."""
    body: dict[str, Any] = {"model": req.model, "messages": _chat_messages(req), **_tool_fields(req, tools)}
    fmt = req.output_config.format if req.output_config else None
    if fmt is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "response", "schema": fmt.schema_}}
    if isinstance(req, MessagesRequest):
        body["max_tokens"] = req.max_tokens
        for name in ("temperature", "top_p"):
            if getattr(req, name) is not None:
                body[name] = getattr(req, name)
        if req.top_k:  # 0 is "unset" for Anthropic
            body["top_k"] = req.top_k
        if req.stop_sequences:
            body["stop"] = req.stop_sequences
        thinking = req.thinking
        if thinking is not None and thinking.type == "enabled" and thinking.budget_tokens is not None:
            if thinking.budget_tokens >= req.max_tokens:
                raise APIError(400, "thinking.budget_tokens must be less than max_tokens",
                               param="thinking.budget_tokens")
            body["thinking_token_budget"] = thinking.budget_tokens
    return body


def template_kwargs(req: CountTokensRequest) -> dict[str, Any]:
    """``thinking`` as the chat template's switch (Qwen3-style templates read ``enable_thinking``)."""
    if req.thinking is None or req.thinking.type == "adaptive":
        return {}
    return {"enable_thinking": req.thinking.type == "enabled"}


# ----------------------------------------------------------------------------------------------
# Responses
# ----------------------------------------------------------------------------------------------


def anthropic_usage(usage, prompt_tokens: int | None = None) -> dict:
    """Anthropic's usage, with ParaLLM's ``timings`` extension (seconds queued / prefilling / decoding)."""
    prompt = usage.prompt_tokens if prompt_tokens is None else prompt_tokens
    return {"input_tokens": prompt - usage.cached_tokens, "output_tokens": usage.completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": usage.cached_tokens,
            **usage.timings_extension()}


def _stop(finish: str | None, stop_reason: Any, stops: list[str], called: bool) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` for an engine finish."""
    if called and finish == "stop":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if finish == "stop" and isinstance(stop_reason, str) and stop_reason in stops:
        return "stop_sequence", stop_reason
    return "end_turn", None


def tool_input(call) -> dict:
    """A tool_use block's ``input``: the call's arguments; for a call that is not whole (cut off by
    max_tokens) its partial argument text parsed as the anthropic SDK's stream accumulator parses the
    streamed ``partial_json`` (see the module docstring), so streamed and non-streamed agree."""
    if not getattr(call, "error", None):
        return call.arguments
    raw = call.raw_arguments or ""
    if not raw.strip():
        return {}
    try:
        parsed = from_json(raw, allow_partial=True)
    except ValueError:  # not even a JSON prefix (an unconstrained model's text); the SDK's stream raises here
        return {}
    return parsed if isinstance(parsed, dict) else {}


def message_response(result, model_name: str, single_call: bool, stops: list[str]) -> dict:
    c = result.choices[0]
    calls = reported_calls(c.tool_calls, single_call)
    content: list[dict] = []
    if c.reasoning:
        content.append({"type": "thinking", "thinking": c.reasoning, "signature": thinking_signature(c.reasoning)})
    text = c.content if c.content is not None else c.text
    if text or not calls:
        content.append({"type": "text", "text": text or ""})
    for call in calls:
        content.append({"type": "tool_use", "id": call.id, "name": call.name, "input": tool_input(call)})
    stop_reason, stop_sequence = _stop(c.finish_reason, c.stop_reason, stops, bool(calls))
    return {"id": new_id("msg"), "type": "message", "role": "assistant", "model": model_name, "content": content,
            "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": anthropic_usage(result.usage)}


def thinking_signature(thinking: str) -> str:
    """A ``thinking`` block's ``signature``: a digest of its text (the anthropic SDK expects one; nothing checks it)."""
    return hashlib.sha256(thinking.encode("utf-8", "surrogatepass")).hexdigest()


def _event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {dumps({'type': name, **data})}\n\n"


#: Anthropic's keep-alive event, sent while a stream is silent (a long prompt prefilling; server_kit.KEEPALIVE_S).
PING = _event("ping", {})


async def message_stream(run: ChatRun, model_name: str, single_call: bool,
                         stops: list[str]) -> AsyncIterator[str]:
    """Anthropic's event sequence: ``message_start``, ``ping``, per content block ``content_block_start`` /
    ``content_block_delta`` (``thinking_delta``, ``text_delta``, ``input_json_delta``) / ``content_block_stop``,
    ``message_delta`` (stop reason, usage), ``message_stop``; a thinking block gets its ``signature_delta`` right
    before it stops. An error after the start is an ``error`` event."""
    request = run.handles[0].request
    prompt_tokens = len(request.prompt_ids)
    start_usage = {"input_tokens": prompt_tokens, "output_tokens": 0, "cache_creation_input_tokens": 0,
                   "cache_read_input_tokens": 0}
    yield _event("message_start", {"message": {
        "id": new_id("msg"), "type": "message", "role": "assistant", "model": model_name, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": start_usage}})
    yield _event("ping", {})
    index = -1
    open_kind: Any = None  # "thinking", "text", or the open tool call's index
    called = False
    thinking = ""  # the open thinking block's text (its signature is of it)

    def stop_block() -> list[str]:
        out = []
        if open_kind == "thinking":
            out.append(delta({"type": "signature_delta", "signature": thinking_signature(thinking)}))
        return out + [_event("content_block_stop", {"index": index})]

    def open_block(kind: Any, block: dict) -> list[str]:
        nonlocal index, open_kind
        out = stop_block() if open_kind is not None else []
        index += 1
        open_kind = kind
        return out + [_event("content_block_start", {"index": index, "content_block": block})]

    def delta(d: dict) -> str:
        return _event("content_block_delta", {"index": index, "delta": d})

    try:
        finished = None
        async for piece in output_pieces(run, single_call):
            if isinstance(piece, ToolCallDelta):
                called = True
                if piece.id is not None:
                    for ev in open_block(("tool", piece.index),
                                         {"type": "tool_use", "id": piece.id, "name": piece.name, "input": {}}):
                        yield ev
                if piece.arguments_delta:
                    yield delta({"type": "input_json_delta", "partial_json": piece.arguments_delta})
            elif isinstance(piece, ReasoningDelta):
                if open_kind != "thinking":
                    for ev in open_block("thinking", {"type": "thinking", "thinking": "", "signature": ""}):
                        yield ev
                    thinking = ""
                thinking += piece.reasoning
                yield delta({"type": "thinking_delta", "thinking": piece.reasoning})
            elif isinstance(piece, ContentDelta):
                if not piece.text:
                    continue
                if open_kind != "text":
                    for ev in open_block("text", {"type": "text", "text": ""}):
                        yield ev
                yield delta({"type": "text_delta", "text": piece.text})
            elif isinstance(piece, Finished):
                finished = piece
        if open_kind is None or (not called and open_kind == "thinking"):  # as the full response: a text block
            for ev in open_block("text", {"type": "text", "text": ""}):
                yield ev
        for ev in stop_block():
            yield ev
        result = request.result
        stop_reason, stop_sequence = _stop(finished.finish_reason if finished else None,
                                           finished.stop_reason if finished else None, stops, called)
        yield _event("message_delta", {"delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                       "usage": anthropic_usage(result.usage, prompt_tokens)})
        yield _event("message_stop", {})
    except Exception as exc:  # the response has started: report in-band
        err = stream_error(exc)
        yield _event("error", {"error": _error_detail(err)})


# ----------------------------------------------------------------------------------------------
# Errors and models
# ----------------------------------------------------------------------------------------------


def is_anthropic_path(path: str) -> bool:
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


def _error_detail(err: APIError) -> dict:
    kind = _ERROR_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    if isinstance(err, PromptTooLongError):  # Anthropic's words, which Claude Code recognises
        return {"type": kind, "message": f"prompt is too long: {err.prompt_tokens} tokens > "
                                         f"{err.context_window - 1} maximum"}
    return {"type": kind, "message": err.message}


def anthropic_error(err: APIError) -> JSONResponse:
    """``err`` in Anthropic's shape: ``{"type": "error", "error": {"type", "message"}}``."""
    return JSONResponse({"type": "error", "error": _error_detail(err)}, status_code=err.status, headers=err.headers)


def anthropic_model_card(card: ModelCard) -> dict:
    created = datetime.datetime.fromtimestamp(card.created, datetime.timezone.utc)
    limit = card.max_model_len - 1 if card.max_model_len else None  # one token is left to generate
    return {"type": "model", "id": card.id, "display_name": card.id,
            "created_at": created.isoformat().replace("+00:00", "Z"), "lifecycle": "active",
            "max_input_tokens": limit, "max_tokens": limit}


def anthropic_model_list(cards: list[ModelCard]) -> dict:
    data = [anthropic_model_card(c) for c in cards]
    return {"data": data, "has_more": False, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None}
