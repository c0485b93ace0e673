"""LangChain messages <-> OpenAI-shaped message dicts, and tool / tool_choice / response_format helpers.

The engine takes OpenAI-shaped chat messages (``{"role", "content"}``; assistant ``tool_calls``; role
``"tool"`` with ``tool_call_id``) and renders them with the model's own chat template, so everything
LangChain can put in a history is first turned into that shape here.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    ChatMessage,
    FunctionMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
    convert_to_messages,
)
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool

# --------------------------------------------------------------------------------------------
# LangChain messages -> OpenAI dicts
# --------------------------------------------------------------------------------------------

_TEXT_BLOCK_TYPES = ("text", "input_text", "output_text")
# Blocks an assistant message may carry that are not text for the model to re-read: tool calls
# are taken from ``AIMessage.tool_calls`` instead, reasoning is dropped (as OpenAI does).
_SKIPPED_AI_BLOCK_TYPES = (
    "tool_use", "tool_call", "tool_call_chunk", "function_call", "server_tool_call",
    "server_tool_result", "reasoning", "thinking", "invalid_tool_call", "non_standard",
)


def content_to_text(content: str | list[Any], *, role: str, skip: tuple[str, ...] = ()) -> str:
    """Flatten LangChain message content (a string or a list of blocks) into plain text.

    Text blocks are concatenated. Blocks of the types in ``skip`` are ignored. Any other block
    (image, audio, file, ...) raises ``ValueError``: the local text models ParaLLM runs cannot
    see them, and silently dropping an input would give confidently wrong answers.
    """
    if isinstance(content, str):
        return content
    parts: list[str] = []
    for block in content:
        if isinstance(block, str):
            parts.append(block)
            continue
        if not isinstance(block, Mapping):
            raise TypeError(f"unsupported content block in a {role} message: {block!r}")
        btype = block.get("type")
        if btype in _TEXT_BLOCK_TYPES:
            parts.append(str(block.get("text", "")))
        elif btype in skip:
            continue
        else:
            raise ValueError(
                f"ParaLLM models accept text only; a {role} message has a {btype!r} content block. "
                "Pass text, or describe the attachment in words."
            )
    return "".join(parts)


_IMAGE_BLOCK_TYPES = ("image_url", "image", "input_image")


def _image_block(block: Mapping[str, Any]) -> dict[str, Any]:
    """A LangChain image block (v0 ``source_type``/``data``, v1 ``base64``/``url``, OpenAI ``image_url``) as
    an OpenAI ``image_url`` part: the shape both the local engine and a ParaLLM / OpenAI server read."""
    btype = block.get("type")
    if btype in ("image_url", "input_image"):
        ref = block.get("image_url")
        url = ref.get("url") if isinstance(ref, Mapping) else (ref or block.get("url"))
    else:
        mime = block.get("mime_type") or "image/png"
        data = block.get("base64")
        if data is None and block.get("source_type", "base64") == "base64":
            data = block.get("data")
        url = f"data:{mime};base64,{data}" if data is not None else block.get("url")
    if not isinstance(url, str):
        raise ValueError(f"image content block without base64 data or a url: keys {sorted(block)}")
    return {"type": "image_url", "image_url": {"url": url}}


def user_content(content: str | list[Any], *, role: str) -> str | list[dict[str, Any]]:
    """A user (or system) message's content: plain text, or, when it carries images, OpenAI content
    parts (text parts and ``image_url`` parts, in order) for a vision-language model."""
    if isinstance(content, str) or not any(
            isinstance(b, Mapping) and b.get("type") in _IMAGE_BLOCK_TYPES for b in content):
        return content_to_text(content, role=role)
    parts: list[dict[str, Any]] = []
    for block in content:
        if isinstance(block, Mapping) and block.get("type") in _IMAGE_BLOCK_TYPES:
            parts.append(_image_block(block))
        else:
            parts.append({"type": "text", "text": content_to_text([block], role=role)})
    return parts


def _tool_content_to_text(content: str | list[Any]) -> str:
    if isinstance(content, str):
        return content
    try:
        return content_to_text(content, role="tool")
    except ValueError:
        return json.dumps(content, ensure_ascii=False, default=str)


def _ai_tool_calls(message: AIMessage) -> list[dict[str, Any]]:
    calls = []
    for tc in message.tool_calls:
        calls.append(
            {
                "id": tc.get("id") or "",
                "type": "function",
                "function": {"name": tc["name"], "arguments": json.dumps(tc.get("args") or {}, ensure_ascii=False)},
            }
        )
    for itc in message.invalid_tool_calls:  # keep what the model said, even if it did not parse
        calls.append(
            {
                "id": itc.get("id") or "",
                "type": "function",
                "function": {"name": itc.get("name") or "", "arguments": itc.get("args") or "{}"},
            }
        )
    return calls


def message_to_dict(message: BaseMessage) -> dict[str, Any]:
    """One LangChain message as an OpenAI-shaped dict."""
    if isinstance(message, SystemMessage):
        return {"role": "system", "content": content_to_text(message.content, role="system")}
    if isinstance(message, HumanMessage):
        return {"role": "user", "content": user_content(message.content, role="user")}
    if isinstance(message, AIMessage):
        out: dict[str, Any] = {
            "role": "assistant",
            "content": content_to_text(message.content, role="assistant", skip=_SKIPPED_AI_BLOCK_TYPES),
        }
        calls = _ai_tool_calls(message)
        if calls:
            out["tool_calls"] = calls
        return out
    if isinstance(message, ToolMessage):
        return {
            "role": "tool",
            "tool_call_id": message.tool_call_id,
            "content": _tool_content_to_text(message.content),
            **({"name": message.name} if message.name else {}),
        }
    if isinstance(message, FunctionMessage):
        return {"role": "tool", "name": message.name, "content": _tool_content_to_text(message.content)}
    if isinstance(message, ChatMessage):
        role = {"human": "user", "ai": "assistant"}.get(message.role, message.role)
        return {"role": role, "content": content_to_text(message.content, role=role)}
    raise TypeError(f"unsupported message type {type(message).__name__}")


def messages_to_dicts(messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
    """A LangChain history as OpenAI-shaped dicts, ready for ``Engine.apply_chat_template``
    (``("human", "hi")`` tuples, strings and dicts are accepted too)."""
    if any(not isinstance(m, BaseMessage) for m in messages):
        messages = convert_to_messages(messages)
    return [message_to_dict(m) for m in messages]


# --------------------------------------------------------------------------------------------
# Tools
# --------------------------------------------------------------------------------------------

ToolLike = dict[str, Any] | type | Callable | BaseTool


def tools_to_openai(tools: Sequence[ToolLike], *, strict: bool | None = None) -> list[dict[str, Any]]:
    """LangChain tools (BaseTool, pydantic class, TypedDict, function, OpenAI / JSON-schema dict) as
    OpenAI tool dicts ``{"type": "function", "function": {"name", "description", "parameters"}}``."""
    return [convert_to_openai_tool(t, strict=strict) for t in tools]


def tool_names(openai_tools: Sequence[Mapping[str, Any]]) -> list[str]:
    return [t["function"]["name"] for t in openai_tools if t.get("type") == "function" and "function" in t]


def normalize_tool_choice(
    tool_choice: str | bool | Mapping[str, Any] | None, names: Sequence[str]
) -> str | dict[str, Any] | None:
    """Map every LangChain / OpenAI / Anthropic spelling of ``tool_choice`` onto the engine's:
    ``"auto" | "none" | "required" | {"type": "function", "function": {"name": ...}}`` (None = not set).

    - ``"auto"``, ``"none"``: as they are.
    - ``"any"``, ``"required"``, ``True``: ``"required"`` (one tool must be called).
    - a tool's name: that tool must be called.
    - ``{"type": "function", "function": {"name": N}}`` (OpenAI), ``{"type": "tool", "name": N}``
      (Anthropic), ``{"name": N}``: that tool; ``{"type": "any"|"auto"|"none"}`` as the strings.
    - ``None`` / ``False``: not set (the model decides; "auto" when tools are bound).
    """
    if tool_choice is None or tool_choice is False:
        return None
    if tool_choice is True:
        return "required"
    if isinstance(tool_choice, str):
        if tool_choice in ("auto", "none", "required"):
            return tool_choice
        if tool_choice == "any":
            return "required"
        if tool_choice in names:
            return {"type": "function", "function": {"name": tool_choice}}
        raise ValueError(
            f"tool_choice {tool_choice!r} is neither 'auto', 'none', 'any', 'required' nor the name of a "
            f"bound tool ({', '.join(names) or 'no tools bound'})"
        )
    if isinstance(tool_choice, Mapping):
        name = None
        if isinstance(tool_choice.get("function"), Mapping):
            name = tool_choice["function"].get("name")
        elif "name" in tool_choice:
            name = tool_choice["name"]
        elif tool_choice.get("type") in ("auto", "none", "any", "required"):
            return normalize_tool_choice(tool_choice["type"], names)
        if not name:
            raise ValueError(f"tool_choice dict has no tool name: {dict(tool_choice)!r}")
        if names and name not in names:
            raise ValueError(f"tool_choice names {name!r}, which is not a bound tool ({', '.join(names)})")
        return {"type": "function", "function": {"name": name}}
    raise ValueError(f"unsupported tool_choice: {tool_choice!r}")


def close_schema(schema: Any) -> Any:
    """A copy of a JSON schema where every object that does not say otherwise has
    ``additionalProperties: false`` (OpenAI's strict mode). Constrained decoding with an open schema
    lets a small model invent extra keys until it runs out of tokens; closed, it writes exactly the
    declared fields and stops."""
    if isinstance(schema, list):
        return [close_schema(s) for s in schema]
    if not isinstance(schema, Mapping):
        return schema
    out = {k: close_schema(v) for k, v in schema.items()}
    for key in ("properties", "$defs", "definitions", "patternProperties"):
        if isinstance(schema.get(key), Mapping):
            out[key] = {name: close_schema(sub) for name, sub in schema[key].items()}
    is_object = schema.get("type") == "object" or (isinstance(schema.get("type"), list) and "object" in schema["type"])
    if (is_object or "properties" in schema) and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


def close_tool_schemas(openai_tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI tool dicts whose parameter schemas are closed (see :func:`close_schema`)."""
    out = []
    for t in openai_tools:
        t = dict(t)
        if isinstance(t.get("function"), Mapping) and t["function"].get("strict") is not False:
            fn = dict(t["function"])
            fn["parameters"] = close_schema(fn.get("parameters") or {"type": "object", "properties": {}})
            t["function"] = fn
        out.append(t)
    return out


# --------------------------------------------------------------------------------------------
# response_format
# --------------------------------------------------------------------------------------------


def _is_pydantic_class(obj: Any) -> bool:
    from pydantic import BaseModel
    from pydantic.v1 import BaseModel as BaseModelV1

    return isinstance(obj, type) and issubclass(obj, (BaseModel, BaseModelV1))


def schema_response_format(schema: Any, *, strict: bool | None = None) -> dict[str, Any]:
    """An OpenAI ``{"type": "json_schema", "json_schema": {...}}`` response format for a pydantic class,
    TypedDict or JSON schema dict (an OpenAI tool / function dict is accepted too)."""
    if isinstance(schema, Mapping) and schema.get("type") == "function" and "function" in schema:
        fn = schema["function"]
        name, description, json_schema = fn["name"], fn.get("description"), fn.get("parameters") or {}
    elif isinstance(schema, Mapping) and "parameters" in schema and "name" in schema:
        name, description, json_schema = schema["name"], schema.get("description"), schema["parameters"]
    else:
        json_schema = convert_to_json_schema(schema)
        name = json_schema.get("title") or getattr(schema, "__name__", None) or "response"
        description = json_schema.get("description")
    json_schema = dict(json_schema)
    if strict is not False:  # decode exactly the declared fields (see close_schema)
        json_schema = close_schema(json_schema)
    spec: dict[str, Any] = {"name": name, "schema": json_schema}
    if description:
        spec["description"] = description
    if strict is not None:
        spec["strict"] = strict
    return {"type": "json_schema", "json_schema": spec}


def normalize_response_format(response_format: Any) -> dict[str, Any] | None:
    """Accept what LangChain callers pass as ``response_format``: an OpenAI dict (``json_object``,
    ``json_schema``, ``text``, ParaLLM's ``regex``), or a pydantic class / TypedDict / JSON schema."""
    if response_format is None:
        return None
    if isinstance(response_format, Mapping):
        rtype = response_format.get("type")
        if rtype == "text":
            return None
        if rtype == "json_schema" and isinstance(response_format.get("json_schema"), Mapping):
            spec = dict(response_format["json_schema"])
            if spec.get("strict") is not False and isinstance(spec.get("schema"), Mapping):
                spec["schema"] = close_schema(spec["schema"])
            return {**response_format, "json_schema": spec}
        if rtype in ("json_object", "json_schema", "regex", "lark"):
            return dict(response_format)
        if rtype in (None, "object") and ("properties" in response_format or "title" in response_format):
            return schema_response_format(response_format)  # a bare JSON schema
        raise ValueError(f"unsupported response_format: {dict(response_format)!r}")
    if _is_pydantic_class(response_format) or isinstance(response_format, type):
        return schema_response_format(response_format, strict=True)
    raise ValueError(f"unsupported response_format: {response_format!r}")


# --------------------------------------------------------------------------------------------
# Output helpers
# --------------------------------------------------------------------------------------------


def usage_metadata(usage: Any) -> dict[str, Any] | None:
    """Engine ``Usage`` -> LangChain ``UsageMetadata`` (cache hits from the radix cache)."""
    if usage is None:
        return None
    return {
        "input_tokens": int(usage.prompt_tokens),
        "output_tokens": int(usage.completion_tokens),
        "total_tokens": int(usage.prompt_tokens + usage.completion_tokens),
        "input_token_details": {"cache_read": int(usage.cached_tokens)},
        "output_token_details": {"reasoning": int(getattr(usage, "reasoning_tokens", 0))},
    }


def token_usage_dict(usage: Any) -> dict[str, Any]:
    """Engine ``Usage`` in OpenAI's ``usage`` shape (for ``llm_output["token_usage"]``), with ParaLLM's
    ``speculative`` extension (drafted / accepted tokens) when speculative decoding ran."""
    out = {
        "prompt_tokens": int(usage.prompt_tokens),
        "completion_tokens": int(usage.completion_tokens),
        "total_tokens": int(usage.prompt_tokens + usage.completion_tokens),
        "prompt_tokens_details": {"cached_tokens": int(usage.cached_tokens)},
        "completion_tokens_details": {"reasoning_tokens": int(getattr(usage, "reasoning_tokens", 0))},
    }
    if getattr(usage, "spec_proposed_tokens", 0):
        out["speculative"] = usage.speculative_dict()
    return out


def call_timings(usage: Any) -> dict[str, Any]:
    """A call's seconds queued / prefilling / decoding in the engine (``queue_s``, ``prefill_s``,
    ``decode_s``) and its cached prompt tokens (``cached_tokens``); {} without usage."""
    if usage is None:
        return {}
    timings = usage.timings_dict() if hasattr(usage, "timings_dict") else {}
    return {**timings, "cached_tokens": int(usage.cached_tokens)}


def logprobs_to_openai(logprobs: Any) -> dict[str, Any] | None:
    """A result's or delta's logprobs as OpenAI's chat ``{"content": [{"token", "logprob", "bytes",
    "top_logprobs": [...]}, ...]}`` (None when there are none), for metadata.

    Formatted once, by the engine's formatter (``parallm_engine.sampling.logprobs``, the one ``parallm serve`` answers
    with, so -inf is reported as -9999.0 there and here): the in-process engine's ``TokenLogprob`` lists go
    through it; a server's results (``base_url=``) carry the dict it sent, passed on as it is."""
    if not logprobs:
        return None
    if isinstance(logprobs, Mapping):
        return dict(logprobs) if logprobs.get("content") else None
    from parallm_engine.sampling.logprobs import chat_logprobs

    return chat_logprobs(logprobs)


__all__ = [
    "close_schema",
    "close_tool_schemas",
    "content_to_text",
    "logprobs_to_openai",
    "message_to_dict",
    "messages_to_dicts",
    "normalize_response_format",
    "normalize_tool_choice",
    "schema_response_format",
    "token_usage_dict",
    "tool_names",
    "tools_to_openai",
    "usage_metadata",
]
