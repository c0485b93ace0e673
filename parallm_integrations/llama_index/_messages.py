"""LlamaIndex chat messages, tools and ``tool_choice`` -> the OpenAI shapes the engine (and any
OpenAI-compatible server) takes: message dicts for the model's chat template, OpenAI tool dicts, the
``tool_choice`` spellings, and ``response_format`` for structured output."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from llama_index.core.base.llms.types import (
    CachePoint,
    ChatMessage,
    CitableBlock,
    CitationBlock,
    ImageBlock,
    MessageRole,
    TextBlock,
    ThinkingBlock,
    ToolCallBlock,
)
from llama_index.core.bridge.pydantic import BaseModel
from llama_index.core.llms.llm import ToolSelection

from parallm_integrations._messages import close_schema, close_tool_schemas

_ROLE_MAP = {"developer": "system", "chatbot": "assistant", "model": "assistant", "function": "tool"}


def _block_text(block: Any, role: str) -> str | None:
    """Text of one content block; None for blocks that carry nothing for the model to re-read."""
    if isinstance(block, TextBlock):
        return block.text
    if isinstance(block, (ThinkingBlock, CachePoint, ToolCallBlock)):
        return None
    if isinstance(block, CitableBlock):
        return "".join(t for t in (_block_text(b, role) for b in block.content) if t)
    if isinstance(block, CitationBlock):
        return _block_text(block.cited_content, role)
    raise ValueError(
        f"ParaLLM models accept text only; a {role} message has a {getattr(block, 'block_type', type(block).__name__)!r} "
        "content block. Pass text, or describe the attachment in words."
    )


def _image_part(block: ImageBlock) -> dict[str, Any]:
    """An ``ImageBlock`` as an OpenAI ``image_url`` part: its bytes (or file) as a base64 data URL; a
    URL-only block stays a URL (the local engine fetches it only with remote images allowed)."""
    if block.image is None and block.path is None and block.url is not None:
        return {"type": "image_url", "image_url": {"url": str(block.url)}}
    data = block.resolve_image(as_base64=True).read().decode()
    return {"type": "image_url", "image_url": {"url": f"data:{block.image_mimetype or 'image/png'};base64,{data}"}}


def call_to_openai(call_id: str | None, name: str, arguments: Any) -> dict[str, Any]:
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments if arguments is not None else {}, ensure_ascii=False)
    return {"id": call_id or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def legacy_tool_call(tc: Any) -> dict[str, Any] | None:
    """One entry of ``additional_kwargs["tool_calls"]`` (OpenAI dict or object, ToolSelection) as a dict."""
    if isinstance(tc, ToolSelection):
        return call_to_openai(tc.tool_id, tc.tool_name, tc.tool_kwargs)
    if hasattr(tc, "model_dump"):
        tc = tc.model_dump()
    if not isinstance(tc, Mapping):
        return None
    fn = tc.get("function") or tc
    name = fn.get("name")
    if not isinstance(name, str):
        return None
    return call_to_openai(tc.get("id"), name, fn.get("arguments", fn.get("args", {})))


def message_to_dict(message: ChatMessage) -> dict[str, Any]:
    """A LlamaIndex ``ChatMessage`` as the OpenAI-shaped dict a chat template renders (the engine's in-process,
    the server's with ``base_url``)."""
    role = message.role.value if isinstance(message.role, MessageRole) else str(message.role)
    role = _ROLE_MAP.get(role, role)
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []  # text and image parts, for a message with images
    for block in message.blocks:
        if isinstance(block, ImageBlock):
            parts += [{"type": "text", "text": "\n".join(texts)}] if texts else []
            texts = []
            parts.append(_image_part(block))
            continue
        if isinstance(block, ToolCallBlock):
            calls.append(call_to_openai(block.tool_call_id, block.tool_name, block.tool_kwargs))
            continue
        text = _block_text(block, role)
        if text is not None:
            texts.append(text)
    if not calls and role == "assistant":
        for tc in message.additional_kwargs.get("tool_calls") or []:
            d = legacy_tool_call(tc)
            if d is not None:
                calls.append(d)
    out: dict[str, Any] = {"role": role, "content": "\n".join(texts)}
    if parts:
        out["content"] = parts + ([{"type": "text", "text": "\n".join(texts)}] if texts else [])
    if calls:
        out["tool_calls"] = calls
    if role == "tool":
        call_id = message.additional_kwargs.get("tool_call_id")
        if call_id:
            out["tool_call_id"] = call_id
        name = message.additional_kwargs.get("name") or message.additional_kwargs.get("tool_name")
        if name:
            out["name"] = name
    return out


def messages_to_dicts(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    return [message_to_dict(m) for m in messages]


def tool_to_openai(tool: Any) -> dict[str, Any]:
    if isinstance(tool, Mapping):
        if tool.get("type") == "function" and isinstance(tool.get("function"), Mapping):
            return dict(tool)
        if "name" in tool:  # a bare function spec
            return {"type": "function", "function": dict(tool)}
        raise ValueError(f"unsupported tool: {dict(tool)!r}")
    metadata = getattr(tool, "metadata", None)
    if metadata is not None and hasattr(metadata, "to_openai_tool"):
        return metadata.to_openai_tool(skip_length_check=True)
    raise ValueError(f"unsupported tool {tool!r}: pass LlamaIndex tools or OpenAI tool dicts")


# The same closing as the LangChain classes (one definition of what "closed" means for the engine).
close_tools = close_tool_schemas


def resolve_tool_choice(tool_choice: Any, tool_required: bool, names: list[str]) -> Any:
    """LlamaIndex spellings (None, "auto", "none", "required"/"any", a tool name, an OpenAI dict)
    -> the engine's ("auto" | "none" | "required" | {"type": "function", "function": {"name"}})."""
    if tool_choice is None:
        return "required" if tool_required else "auto"
    if tool_choice is True or tool_choice in ("any", "required"):
        return "required"
    if tool_choice is False:
        return "none"
    if tool_choice in ("auto", "none"):
        return tool_choice
    if isinstance(tool_choice, Mapping):
        name = (tool_choice.get("function") or {}).get("name") or tool_choice.get("name")
    elif isinstance(tool_choice, str):
        name = tool_choice
    else:
        raise TypeError(f"unsupported tool_choice: {tool_choice!r}")
    if name not in names:
        raise ValueError(f"tool_choice names {name!r}, which is not among the tools {names}")
    return {"type": "function", "function": {"name": name}}


def json_schema_format(output_cls: type[BaseModel]) -> dict[str, Any]:
    schema = output_cls.model_json_schema()
    return {"type": "json_schema",
            "json_schema": {"name": schema.get("title") or output_cls.__name__, "schema": close_schema(schema),
                            "strict": True}}


async def amessages_to_dicts(messages) -> list[dict[str, Any]]:
    """``messages_to_dicts`` for the async paths: messages with image blocks (read and base64-encoded)
    are converted on a worker thread, never on the event loop."""
    if any(isinstance(b, ImageBlock) for m in messages for b in (getattr(m, "blocks", None) or [])):
        return await asyncio.to_thread(messages_to_dicts, messages)
    return messages_to_dicts(messages)


__all__ = [
    "amessages_to_dicts", "call_to_openai", "close_schema", "close_tools", "json_schema_format", "legacy_tool_call",
    "message_to_dict", "messages_to_dicts", "resolve_tool_choice", "tool_to_openai",
]
