"""The chat entry points' prompt: token ids for text, a :class:`vision.VisionPrompt` for images."""

from __future__ import annotations

from typing import Any

from .errors import ImageInputError
from .validation import check_text
from .vision_inputs import has_images


def chat_prompt(engine, messages: list[dict], tools: list[dict] | None, sampling: dict) -> Any:
    """What :meth:`Engine.chat` and friends submit. Pops the per-call image options from ``sampling``:
    ``allow_remote_images`` (fetch http(s) image URLs; default off: offline-first)."""
    allow_remote = sampling.pop("allow_remote_images", None)
    if not has_images(messages):
        return engine.apply_chat_template(messages, tools=tools)
    encoder = getattr(engine.model, "vision", None)
    if encoder is None:
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
