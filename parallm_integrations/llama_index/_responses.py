"""Engine-shaped results -> LlamaIndex responses.

Both backends (``parallm_integrations.backends``: the in-process engine and an OpenAI-compatible server) give results and
deltas with the engine's fields (``GenerationResult`` / ``StreamDelta``; a server's are ``RemoteResult`` /
``RemoteDelta``), so the ``ChatResponse`` / ``CompletionResponse`` objects are built here once. Finished
results carry the tool calls the engine (or the server) parsed; nothing is re-parsed here. In streams the
engine's deltas carry typed pieces (``StreamDelta.pieces``: content, reasoning, tool-call pieces, finish),
mapped here; a server sends ``tool_calls`` deltas (``RemoteDelta.tool_calls``) and content without markup.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    CompletionResponse,
    LogProb,
    MessageRole,
    TextBlock,
    ThinkingBlock,
    ToolCallBlock,
)

from parallm_integrations._messages import call_timings, logprobs_to_openai, token_usage_dict

from ._messages import call_to_openai


def usage_kwargs(usage: Any) -> dict[str, int]:
    """Token usage as flat ints for ``additional_kwargs``."""
    if usage is None:
        return {}
    return {"prompt_tokens": int(usage.prompt_tokens), "completion_tokens": int(usage.completion_tokens),
            "total_tokens": int(usage.prompt_tokens + usage.completion_tokens),
            "cached_tokens": int(usage.cached_tokens), "reasoning_tokens": int(getattr(usage, "reasoning_tokens", 0))}


def raw_dict(request_id: str, model: str, finish_reason: str | None, usage: Any,
             tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A response's ``raw``: OpenAI-shaped id, model, finish_reason, usage and tool calls, and the call's
    seconds in the engine's queue, prefill and decode (``queue_s``, ``prefill_s``, ``decode_s``) and
    ``cached_tokens``."""
    raw: dict[str, Any] = {"id": request_id, "model": model, "finish_reason": finish_reason}
    if usage is not None:
        raw["usage"] = token_usage_dict(usage)
        raw.update(call_timings(usage))
    if tool_calls:
        raw["tool_calls"] = tool_calls
    return raw


def logprobs_lists(logprobs: Any) -> list[list[LogProb]] | None:
    """A result's logprobs (the engine's, or the OpenAI dict a server sent) -> LlamaIndex's per-position
    lists (the chosen token, then the alternatives), read from the one OpenAI-shaped formatting
    (``_messages.logprobs_to_openai``: -inf is -9999.0 here as in LangChain metadata)."""
    formatted = logprobs_to_openai(logprobs)
    if not formatted:
        return None
    out = []
    for entry in formatted["content"]:
        token = entry["token"]
        row = [LogProb(token=token, logprob=float(entry["logprob"]), bytes=list(token.encode("utf-8")))]
        for alt in entry.get("top_logprobs") or []:
            if alt["token"] != token:
                row.append(LogProb(token=alt["token"], logprob=float(alt["logprob"]),
                                   bytes=list(alt["token"].encode("utf-8"))))
        out.append(row)
    return out


class ToolCalls:
    """The tool calls of one response, cumulative: ``{"id", "name", "args"}`` with ``args`` the argument
    JSON text while it streams and the parsed dict once the call is complete."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []

    def blocks(self) -> list[ToolCallBlock]:
        return [ToolCallBlock(tool_call_id=c["id"], tool_name=c["name"], tool_kwargs=c["args"]) for c in self.items]

    def openai(self) -> list[dict[str, Any]]:
        return [call_to_openai(c["id"], c["name"], c["args"]) for c in self.items]


def assistant_message(content: str, calls: ToolCalls, reasoning: str | None = None) -> ChatMessage:
    """The answer; reasoning (``<think>`` / harmony analysis) as a ``ThinkingBlock``, never in the text."""
    kwargs: dict[str, Any] = {}
    if calls.items:
        kwargs["tool_calls"] = calls.openai()
    thinking = [ThinkingBlock(content=reasoning)] if reasoning else []
    return ChatMessage(role=MessageRole.ASSISTANT, blocks=[*thinking, TextBlock(text=content), *calls.blocks()],
                       additional_kwargs=kwargs)


class ChatStream:
    """Turns stream deltas into cumulative chat state: content, and tool calls as they stream.

    ``parse_markup`` (in-process): the deltas carry the engine's typed pieces (``StreamDelta.pieces``,
    ``parallm_engine.formats.typed_output``), mapped here; otherwise the deltas' own ``text`` / ``reasoning`` /
    ``tool_calls`` (a server split them). Nothing is parsed here."""

    def __init__(self, tools: list[dict[str, Any]] | None, single_call: bool, parse_markup: bool = True,
                 output_parser: Any = None):
        self.single = single_call
        self.content = ""
        self.reasoning = ""  # cumulative; ``reasoning_delta`` is the last update's part
        self.reasoning_delta = ""
        self.calls = ToolCalls()
        self._typed = parse_markup
        self._final_calls: list | None = None  # the engine's finished calls (its Finish piece)
        self._by_index: dict[int, dict[str, Any]] = {}
        self._finished = False
        self._cut = False  # the choice ended by max_tokens: its last call may be partial

    def update(self, delta: Any) -> str | None:
        """Feed one delta; returns the content delta of the chunk to emit, or None when nothing changed
        (no text, no tool-call progress, no usage). The delta that ends the choice completes the calls."""
        self.reasoning_delta = ""
        self._cut = self._cut or getattr(delta, "finish_reason", None) == "length"
        text, changed = self.feed(delta)
        if delta.usage is not None or delta.finish_reason is not None:
            tail, changed2 = self.finish()
            text, changed = text + tail, changed or changed2
        changed = changed or bool(self.reasoning_delta)
        return text if (text or changed or delta.usage is not None) else None

    def feed(self, delta: Any) -> tuple[str, bool]:
        """Returns (content delta, whether the tool calls changed)."""
        if self._typed:
            pieces = list(getattr(delta, "pieces", None) or [])
            for p in pieces:
                if hasattr(p, "calls") and hasattr(p, "reason"):  # typed_output.Finish
                    self._final_calls = list(p.calls)
            return self._apply([p for p in pieces if not hasattr(p, "calls")])
        events: list[Any] = [_Reasoning(delta.reasoning)] if getattr(delta, "reasoning", None) else []
        if delta.text:
            events.append(_Text(delta.text))
        events.extend(getattr(delta, "tool_calls", None) or [])
        return self._apply(events)

    def finish(self) -> tuple[str, bool]:
        """The calls are complete: their arguments become parsed dicts (a call whose arguments never
        became a JSON object, or that max_tokens cut off, is dropped: LlamaIndex has no invalid calls)."""
        if self._finished:
            return "", False
        self._finished = True
        before = [(c["id"], c["args"]) for c in self.calls.items]
        if self._final_calls is not None:
            parsed = [c for c in self._final_calls if not c.error]
            if self.single:
                parsed = parsed[:1]
            self.calls.items = [{"id": c.id, "name": c.name, "args": dict(c.arguments)} for c in parsed]
        elif self.calls.items:
            items = []
            for i, c in enumerate(self.calls.items):
                if self._cut and i == len(self.calls.items) - 1 and not c["args"].strip():
                    continue  # cut off before its arguments (as the engine reports it: not a usable call)
                try:
                    args = json.loads(c["args"]) if c["args"].strip() else {}
                except (ValueError, TypeError):
                    continue
                if isinstance(args, dict):
                    items.append({**c, "args": args})
            self.calls.items = items
        return "", before != [(c["id"], c["args"]) for c in self.calls.items]

    def _apply(self, events: list) -> tuple[str, bool]:
        """Events are content (``.text``) or tool-call pieces (``.index``, ``.id``, ``.name``,
        ``.arguments_delta``): the engine parser's ``ContentDelta`` / ``ToolCallDelta``, or a server's."""
        delta, changed = [], False
        for ev in events:
            if getattr(ev, "reasoning", None):  # chat_format.ReasoningDelta
                self.reasoning += ev.reasoning
                self.reasoning_delta += ev.reasoning
            elif not hasattr(ev, "arguments_delta"):
                delta.append(ev.text)
            else:
                if self.single and ev.index > 0:
                    continue
                call = self._by_index.get(ev.index)
                if call is None:
                    call = {"id": ev.id or f"call_{uuid.uuid4().hex[:24]}", "name": ev.name or "", "args": ""}
                    self._by_index[ev.index] = call
                    self.calls.items.append(call)
                if ev.arguments_delta:
                    call["args"] += ev.arguments_delta
                changed = True
        text = "".join(delta)
        self.content += text
        return text, changed


class _Text:
    """A content event (what ``chat_format.ContentDelta`` is to the engine's stream parser)."""

    __slots__ = ("text",)

    def __init__(self, text: str):
        self.text = text


class _Reasoning:
    """A server's reasoning_content piece (what ``chat_format.ReasoningDelta`` is to the stream parser)."""

    __slots__ = ("reasoning",)

    def __init__(self, reasoning: str):
        self.reasoning = reasoning


# --------------------------------------------------------------------------------------------
# Whole responses and stream chunks
# --------------------------------------------------------------------------------------------


def chat_response(result: Any, tools: list[dict[str, Any]] | None, single_call: bool,
                  model_name: str) -> ChatResponse:
    """A finished chat request (its first choice) as a ``ChatResponse``."""
    choice = result.choices[0]
    calls = ToolCalls()
    content = choice.content if choice.content is not None else choice.text
    if tools:
        # The engine (given the tools) or the server parsed the calls once; nothing is re-parsed here.
        parsed = [c for c in choice.tool_calls if not getattr(c, "error", None)]  # unparsable arguments
        if single_call:
            parsed = parsed[:1]
        calls.items = [{"id": c.id, "name": c.name, "args": dict(c.arguments)} for c in parsed]
    finish = "tool_calls" if calls.items and choice.finish_reason == "stop" else choice.finish_reason
    return ChatResponse(
        message=assistant_message(content, calls, getattr(choice, "reasoning", None)),
        raw=raw_dict(result.request_id, model_name, finish, result.usage, calls.openai()),
        additional_kwargs=usage_kwargs(result.usage),
        logprobs=logprobs_lists(choice.logprobs),
    )


def completion_response(result: Any, model_name: str) -> CompletionResponse:
    choice = result.choices[0]
    return CompletionResponse(
        text=choice.text,
        raw=raw_dict(result.request_id, model_name, choice.finish_reason, result.usage),
        additional_kwargs=usage_kwargs(result.usage),
        logprobs=logprobs_lists(choice.logprobs),
    )


def chat_chunk(state: ChatStream, delta_text: str, item: Any, model_name: str) -> ChatResponse:
    """One streamed chat chunk: the cumulative message, this step's ``delta``; finish reason and usage on
    the deltas that carry them."""
    usage = getattr(item, "usage", None)
    raw: dict[str, Any] = {"id": item.request_id, "model": model_name}
    if getattr(item, "finish_reason", None):
        finish = item.finish_reason
        raw["finish_reason"] = "tool_calls" if state.calls.items and finish == "stop" else finish
    if usage is not None:
        raw["usage"] = token_usage_dict(usage)
        raw.update(call_timings(usage))
    extra = {"thinking_delta": state.reasoning_delta} if state.reasoning_delta else {}
    return ChatResponse(
        message=assistant_message(state.content, state.calls, state.reasoning),
        delta=delta_text,
        raw=raw,
        additional_kwargs={**usage_kwargs(usage), **extra},
        logprobs=logprobs_lists(getattr(item, "logprobs", None)),
    )


def completion_chunk(text: str, item: Any, model_name: str) -> CompletionResponse:
    """One streamed completion chunk: the cumulative ``text`` and this step's ``delta``."""
    raw: dict[str, Any] = {"id": item.request_id, "model": model_name}
    if item.finish_reason:
        raw["finish_reason"] = item.finish_reason
    if item.usage is not None:
        raw["usage"] = token_usage_dict(item.usage)
        raw.update(call_timings(item.usage))
    return CompletionResponse(text=text, delta=item.text, raw=raw, additional_kwargs=usage_kwargs(item.usage),
                              logprobs=logprobs_lists(item.logprobs))


__all__ = [
    "ChatStream", "ToolCalls", "assistant_message", "chat_chunk", "chat_response", "completion_chunk",
    "completion_response", "logprobs_lists", "raw_dict", "usage_kwargs",
]
