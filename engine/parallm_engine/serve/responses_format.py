"""OpenAI's Responses API for ``parallm serve``: request models, their translation onto the chat
request the engine's chat endpoint runs, the response object and the server-sent event stream
(:mod:`parallm_engine.serve.responses_routes` has the endpoints and the stored responses).

Translation: ``instructions`` is the system message (with the ``system`` / ``developer`` messages the input
starts with: one system prompt); ``input`` (a string, or items) the turns: message
items (``input_text`` / ``output_text`` parts, ``input_image`` parts for a vision model),
``function_call`` items the assistant's tool calls, ``function_call_output`` items tool messages;
``reasoning`` items a client sends back are dropped. ``tools`` are function tools, ``tool_choice`` as
on chat completions (``required`` / a named function constrain decoding to a valid call),
``text.format`` (``json_schema`` / ``json_object``) the response format; ``reasoning.effort`` the template's
reasoning switches and a thinking-token budget (``protocol.EFFORT_BUDGETS``; vLLM's ``thinking_token_budget``
sets one exactly). The output is ``reasoning``
(for reasoning models), ``message`` and ``function_call`` items. A call's ``arguments`` are the text the
model wrote; a call cut off by ``max_output_tokens`` is a ``function_call`` item with ``status: "incomplete"``
and the partial arguments text as generated (streamed and non-streamed alike) in an ``incomplete`` response.
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator, Literal

from pydantic import BaseModel, ConfigDict, Field

from parallm_engine.formats.chat_format import ContentDelta, ReasoningDelta, ToolCallDelta
from parallm_engine.formats.typed_output import TRUNCATED_CALL
from parallm_engine.serve.agent_tools import OfferedTools, offered_name
from parallm_engine.serve.openai_format import APIError, dumps, reported_calls, stream_error
from parallm_engine.serve.protocol import ReasoningEffort, effort_template_kwargs, new_id, now
from parallm_engine.serve.server_kit import ChatRun, Finished, output_pieces


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True, protected_namespaces=(), allow_inf_nan=False)


# ----------------------------------------------------------------------------------------------
# Requests
# ----------------------------------------------------------------------------------------------


class InputPart(_Model):
    """A content part: ``input_text`` / ``output_text`` (``text``), ``input_image`` (``image_url``)."""

    type: str
    text: str | None = None
    image_url: str | None = None
    detail: str | None = None


class InputItem(_Model):
    """An input item: a message (``role``, ``content``), a ``function_call`` or a ``function_call_output``."""

    type: str | None = None  # absent: a message
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[InputPart] | None = None
    id: str | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    namespace: str | None = None  # a function_call's, for a namespaced function
    output: str | list[InputPart] | None = None


class ResponsesTool(_Model):
    """A tool: ``function``; ``namespace`` (``name``, ``description`` and function ``tools``); or a hosted
    or built-in tool (any other ``type``: not offered, :mod:`~parallm_engine.serve.agent_tools`)."""

    type: str = "function"
    name: str | None = Field(default=None, min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    tools: list[ResponsesTool] | None = None  # a namespace's functions


class FunctionToolChoice(_Model):
    type: Literal["function"]
    name: str = Field(min_length=1)
    namespace: str | None = None


class TextFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Model):
    format: TextFormat | None = None
    verbosity: str | None = None


class ReasoningConfig(_Model):
    """``effort``: the template's reasoning switches and a thinking-token budget (``protocol.EFFORT_BUDGETS``)."""

    effort: ReasoningEffort | None = None
    summary: str | None = None


class ResponsesRequest(_Model):
    """``POST /v1/responses``."""

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    thinking_token_budget: int | None = Field(default=None, ge=0)  # vLLM's extension; wins over reasoning.effort's
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = Field(default=None, max_length=200)
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    # Accepted as OpenAI documents them; what they ask of OpenAI's servers does not apply here:
    include: list[str] | None = None  # no encrypted reasoning to include (reasoning items carry text)
    prompt_cache_key: str | None = None  # names the session (request_identity.py); caching is automatic
    client_metadata: dict[str, Any] | None = None  # its thread_id / session_id name the session


class DeletedResponse(_Model):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True


# ----------------------------------------------------------------------------------------------
# Translation onto the chat request
# ----------------------------------------------------------------------------------------------


def _parts(content: str | list[InputPart] | None, param: str) -> str | list[dict]:
    if content is None or isinstance(content, str):
        return content or ""
    parts: list[dict] = []
    for i, part in enumerate(content):
        if part.type in ("input_text", "output_text", "text", "refusal"):
            parts.append({"type": "text", "text": part.text or ""})
        elif part.type == "input_image" and part.image_url:
            parts.append({"type": "image_url", "image_url": {"url": part.image_url}})
        else:
            raise APIError(400, f"{param}[{i}]: content part {part.type!r} is not supported",
                           param=f"{param}[{i}].type")
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def input_messages(req: ResponsesRequest) -> list[dict]:
    """``input`` as chat messages (no instructions: they are not carried to a follow-up)."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    out: list[dict] = []
    for i, item in enumerate(req.input):
        param = f"input[{i}]"
        kind = item.type or "message"
        if kind == "message":
            if item.role is None:
                raise APIError(400, f"{param}: a message needs a role", param=f"{param}.role")
            role = "system" if item.role == "developer" else item.role
            out.append({"role": role, "content": _parts(item.content, f"{param}.content")})
        elif kind == "function_call":
            if not item.call_id or not item.name:
                raise APIError(400, f"{param}: a function_call needs call_id and name", param=param)
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": offered_name(item.name, item.namespace), "arguments": item.arguments or "{}"}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not item.call_id:
                raise APIError(400, f"{param}: a function_call_output needs call_id", param=f"{param}.call_id")
            output = _parts(item.output, f"{param}.output")
            if not isinstance(output, str):
                raise APIError(400, f"{param}.output: only text is supported", param=f"{param}.output")
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
        elif kind == "reasoning":
            continue  # earlier reasoning is not shown to the model again
        else:
            raise APIError(400, f"{param}: input item type {kind!r} is not supported", param=f"{param}.type")
    return out


def _one_system_prompt(messages: list[dict]) -> list[dict]:
    """The instructions and the system / developer messages the input starts with (Codex CLI sends two) as one
    system message: many chat templates take one system message, first, and refuse a second."""
    lead = 0
    while lead < len(messages) and messages[lead]["role"] == "system" and isinstance(messages[lead]["content"], str):
        lead += 1
    if lead < 2:
        return messages
    system = "\n\n".join(m["content"] for m in messages[:lead] if m["content"])
    return [{"role": "system", "content": system}, *messages[lead:]]


def chat_body(req: ResponsesRequest, history: list[dict], tools: OfferedTools) -> dict[str, Any]:
    """The chat-completions request body ``req`` means, after the stored ``history`` of its
    ``previous_response_id``, offering ``tools`` (``responses_tools(req.tools)``; for
    :func:`server_kit.chat_request`)."""
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + history
    messages = _one_system_prompt(messages + input_messages(req))
    if not messages:
        raise APIError(400, "input must not be empty", param="input")
    body: dict[str, Any] = {"model": req.model, "messages": messages}
    if tools.tools:
        body["tools"] = tools.tools
    if isinstance(req.tool_choice, FunctionToolChoice):
        name = offered_name(req.tool_choice.name, req.tool_choice.namespace)
        body["tool_choice"] = {"type": "function", "function": {"name": name}}
    elif req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice
    fmt = req.text.format if req.text else None
    if fmt is not None and fmt.type == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}}
    elif fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    if req.reasoning is not None and req.reasoning.effort is not None:  # its thinking-token budget
        body["reasoning_effort"] = req.reasoning.effort
    for src, dst in (("parallel_tool_calls", "parallel_tool_calls"), ("max_output_tokens", "max_tokens"),
                     ("temperature", "temperature"), ("top_p", "top_p"), ("user", "user"),
                     ("thinking_token_budget", "thinking_token_budget")):
        if getattr(req, src) is not None:
            body[dst] = getattr(req, src)
    return body


def template_kwargs(req: ResponsesRequest) -> dict[str, Any]:
    """``reasoning.effort`` as the chat template's switches (``enable_thinking`` for Qwen3-style templates,
    ``reasoning_effort`` for gpt-oss's)."""
    return effort_template_kwargs(req.reasoning.effort if req.reasoning is not None else None)


# ----------------------------------------------------------------------------------------------
# Response objects
# ----------------------------------------------------------------------------------------------


def responses_usage(usage) -> dict[str, Any]:
    """The Responses API's usage, with ParaLLM's ``timings`` extension (seconds queued / prefilling / decoding)."""
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
            "total_tokens": usage.total_tokens, **usage.timings_extension()}


def response_shell(rid: str, req: ResponsesRequest, model_name: str, status: str) -> dict[str, Any]:
    """The response object around its output (what ``response.created`` carries, and the final one)."""
    fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else \
        {"type": "text"}
    tool_choice = req.tool_choice.model_dump() if isinstance(req.tool_choice, FunctionToolChoice) else \
        (req.tool_choice or "auto")
    return {"id": rid, "object": "response", "created_at": now(), "status": status, "model": model_name,
            "output": [], "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "previous_response_id": req.previous_response_id,
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []], "tool_choice": tool_choice,
            "parallel_tool_calls": req.parallel_tool_calls is not False, "temperature": req.temperature,
            "top_p": req.top_p, "text": {"format": fmt}, "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
            "store": req.store is not False, "metadata": req.metadata or {}, "error": None,
            "incomplete_details": None, "usage": None, "user": req.user}


def reasoning_item(text: str, item_id: str | None = None, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": item_id or new_id("rs"), "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if text else []}


def output_text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(text: str | None, item_id: str | None = None, status: str = "completed") -> dict:
    return {"type": "message", "id": item_id or new_id("msg"), "status": status, "role": "assistant",
            "content": [] if text is None else [output_text_part(text)]}


def function_call_item(call_id: str, offered: str, arguments: str, tools: OfferedTools, item_id: str | None = None,
                       status: str = "completed") -> dict:
    """A ``function_call`` item for a call of the tool offered as ``offered`` (its namespace split off)."""
    name, namespace = tools.reported(offered)
    item = {"type": "function_call", "id": item_id or new_id("fc"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}
    if namespace is not None:
        item["namespace"] = namespace
    return item


def call_status(call) -> str:
    """A function_call item's status: ``incomplete`` for the call max_tokens cut off (its ``arguments`` are
    the partial text as generated, streamed or not), else ``completed``."""
    return "incomplete" if getattr(call, "error", None) == TRUNCATED_CALL else "completed"


def call_arguments(call) -> str:
    """A call's ``arguments`` as the stream sent them: the model's text (not re-serialised)."""
    raw = getattr(call, "raw_arguments", None)
    return raw if raw is not None else json.dumps(call.arguments, ensure_ascii=False)


def finish_response(body: dict, output: list[dict], finish_reason: str | None, usage) -> dict:
    body["output"] = output
    body["usage"] = responses_usage(usage)
    if finish_reason == "length":
        body["status"], body["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
    else:
        body["status"] = "completed"
    return body


def response_body(result, req: ResponsesRequest, rid: str, model_name: str, single_call: bool,
                  tools: OfferedTools) -> dict:
    c = result.choices[0]
    calls = reported_calls(c.tool_calls, single_call)
    output: list[dict] = []
    if c.reasoning:
        output.append(reasoning_item(c.reasoning))
    text = c.content if c.content is not None else c.text
    if text or not calls:
        output.append(message_item(text or ""))
    for call in calls:
        output.append(function_call_item(call.id, call.name, call_arguments(call), tools, status=call_status(call)))
    return finish_response(response_shell(rid, req, model_name, "in_progress"), output, c.finish_reason,
                           result.usage)


def history_of(messages: list[dict], output: list[dict]) -> list[dict]:
    """A stored response's conversation for a follow-up: its input turns, then its output as the
    assistant's turn (text and tool calls; reasoning is not shown again)."""
    text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": offered_name(item["name"], item.get("namespace")), "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    turn: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        turn["tool_calls"] = calls
    return [*messages, turn]


# ----------------------------------------------------------------------------------------------
# The event stream
# ----------------------------------------------------------------------------------------------


class _Events:
    """Numbered Responses events (``sequence_number`` counts from 0 in each stream)."""

    def __init__(self):
        self.seq = 0

    def __call__(self, kind: str, **data: Any) -> str:
        out = f"event: {kind}\ndata: {dumps({'type': kind, 'sequence_number': self.seq, **data})}\n\n"
        self.seq += 1
        return out


async def response_stream(run: ChatRun, req: ResponsesRequest, rid: str, model_name: str, single_call: bool,
                          tools: OfferedTools, on_done) -> AsyncIterator[str]:
    """``response.created`` and ``response.in_progress``; per output item ``response.output_item.added``,
    its deltas (``response.reasoning_text.delta``, ``response.content_part.added`` +
    ``response.output_text.delta``, ``response.function_call_arguments.delta``) and ``...done`` events,
    ``response.output_item.done``; then ``response.completed`` (``response.incomplete`` when cut by
    ``max_output_tokens``) with usage. ``on_done(body)`` is called with the final response (to store it)."""
    event = _Events()
    body = response_shell(rid, req, model_name, "in_progress")
    yield event("response.created", response=dict(body))
    yield event("response.in_progress", response=dict(body))
    output: list[dict] = []
    current: dict | None = None  # the open item (its text accumulates in it)
    call_statuses: dict[str, str] = {}  # call id -> status, from the finished calls (the last item closes after)

    def close() -> list[str]:
        nonlocal current
        if current is None:
            return []
        item, current = current, None
        oi, out = len(output), []
        item["status"] = call_statuses.get(item["call_id"], "completed") if item["type"] == "function_call" \
            else "completed"
        if item["type"] == "message":
            text = item["content"][0]["text"]
            out.append(event("response.output_text.done", item_id=item["id"], output_index=oi, content_index=0,
                             text=text, logprobs=[]))
            out.append(event("response.content_part.done", item_id=item["id"], output_index=oi, content_index=0,
                             part=output_text_part(text)))
        elif item["type"] == "reasoning":
            text = item["content"][0]["text"] if item["content"] else ""
            out.append(event("response.reasoning_text.done", item_id=item["id"], output_index=oi, content_index=0,
                             text=text))
        else:
            out.append(event("response.function_call_arguments.done", item_id=item["id"], output_index=oi,
                             name=item["name"], arguments=item["arguments"]))
        out.append(event("response.output_item.done", output_index=oi, item=item))
        output.append(item)
        return out

    def open_item(item: dict) -> list[str]:
        nonlocal current
        out = close()
        current = item
        oi = len(output)
        out.append(event("response.output_item.added", output_index=oi, item={**item, "status": "in_progress"}))
        if item["type"] == "message":
            out.append(event("response.content_part.added", item_id=item["id"], output_index=oi, content_index=0,
                             part=output_text_part("")))
        return out

    try:
        finished = None
        called = False
        async for piece in output_pieces(run, single_call):
            if isinstance(piece, ToolCallDelta):
                called = True
                if piece.id is not None:
                    for ev in open_item(function_call_item(piece.id, piece.name or "", "", tools)):
                        yield ev
                if piece.arguments_delta and current is not None:
                    current["arguments"] += piece.arguments_delta
                    yield event("response.function_call_arguments.delta", item_id=current["id"],
                                output_index=len(output), delta=piece.arguments_delta)
            elif isinstance(piece, ReasoningDelta):
                if current is None or current["type"] != "reasoning":
                    for ev in open_item(reasoning_item("")):
                        yield ev
                    current["content"] = [{"type": "reasoning_text", "text": ""}]
                current["content"][0]["text"] += piece.reasoning
                yield event("response.reasoning_text.delta", item_id=current["id"], output_index=len(output),
                            content_index=0, delta=piece.reasoning)
            elif isinstance(piece, ContentDelta) and piece.text:
                if current is None or current["type"] != "message":
                    for ev in open_item(message_item("")):
                        yield ev
                current["content"][0]["text"] += piece.text
                yield event("response.output_text.delta", item_id=current["id"], output_index=len(output),
                            content_index=0, delta=piece.text, logprobs=[])
            elif isinstance(piece, Finished):
                finished = piece
        if not called and not any(i["type"] == "message" for i in output) and \
                (current is None or current["type"] != "message"):  # as the full response: a message item
            for ev in open_item(message_item("")):
                yield ev
        result = run.handles[0].request.result
        call_statuses.update({c.id: call_status(c) for c in result.choices[0].tool_calls or []})
        for ev in close():
            yield ev
        final = finish_response(body, output, finished.finish_reason if finished else None, result.usage)
        on_done(final)
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        yield event(kind, response=final)
    except Exception as exc:  # the response has started: report in-band
        err = stream_error(exc)
        yield event("error", code=err.code, message=err.message, param=err.param, error=err.body()["error"])
