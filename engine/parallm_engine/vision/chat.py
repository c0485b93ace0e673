"""The chat entry points' prompt: token ids for text, a :class:`vision.VisionPrompt` for images."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

from parallm_engine.errors import ImageInputError
from parallm_engine.core.validation import check_text
from parallm_engine.vision.inputs import has_images


def chat_prompt(engine, messages: list[dict], tools: list[dict] | None, sampling: dict) -> Any:
    """What :meth:`Engine.chat` and friends submit. Pops the per-call image options from ``sampling``:
    ``allow_remote_images`` (fetch http(s) image URLs; default off: offline-first)."""
    allow_remote = sampling.pop("allow_remote_images", None)
    if not has_images(messages):
        return engine.apply_chat_template(messages, tools=tools)
    encoder = getattr(engine.model, "vision", None)
    if encoder is None:
        from parallm_engine.vision.vlm import unsupported_vision_reason

        reason = unsupported_vision_reason(getattr(engine.model_info, "path", None))
        if reason:
            raise ImageInputError(
                f"model {engine.model_name!r} is a vision-language model that ParaLLM runs text-only; images "
                f"are refused because the engine cannot batch them exactly yet ({reason})", param="messages")
        raise ImageInputError(
            f"model {engine.model_name!r} has no vision tower: it cannot read images (load a vision-language "
            "model, e.g. a LLaVA or SmolVLM checkpoint, with parallm-engine[vision])", param="messages")
    check_text([{k: v for k, v in m.items() if k != "content"} for m in messages], "messages")
    check_text(tools, "tools")
    for i, m in enumerate(messages):
        for j, part in enumerate(m.get("content") or []):
            if isinstance(part, dict) and part.get("type") == "text":
                check_text(part.get("text"), f"messages[{i}].content[{j}].text")
    return encoder.build_prompt(list(messages), tools, allow_remote_images=allow_remote)


async def achat_prompt(engine, messages: list[dict], tools: list[dict] | None, sampling: dict) -> Any:
    """:func:`chat_prompt` for the async entry points: a chat with images is decoded, hashed and run
    through the processor on a worker thread, so the caller's event loop keeps serving meanwhile."""
    if has_images(messages):
        return await asyncio.to_thread(chat_prompt, engine, messages, tools, sampling)
    return chat_prompt(engine, messages, tools, sampling)


def achat_stream(engine, messages: list[dict], tools: list[dict] | None, sampling: dict) -> AsyncIterator:
    """``Engine.achat_stream``: text chats as before; with images, the prompt is built off the loop
    when iteration starts."""
    if not has_images(messages):
        return engine.astream(chat_prompt(engine, messages, tools, sampling), tools=tools, **sampling)

    async def gen():
        prompt = await achat_prompt(engine, messages, tools, sampling)
        async for delta in engine.astream(prompt, tools=tools, **sampling):
            yield delta

    return gen()
