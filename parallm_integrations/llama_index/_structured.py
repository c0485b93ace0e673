"""Streaming structured output for ``ParaLLMLlamaIndex``: ``stream_structured_predict`` /
``astream_structured_predict`` (and so ``as_structured_llm(M).stream_chat`` / ``astream_chat``) on the same
grammar-constrained path as ``structured_predict``: decoding is constrained to the class's JSON schema, the
text streams, and each step yields the object so far (a ``FlexibleModel`` with the fields parsed so far),
then one last, complete, validated instance of the class."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

_OPEN = {"{": "}", "[": "]"}


def partial_json(text: str) -> Any:
    """The value a JSON prefix holds so far: open strings, objects and arrays closed, a dangling key, colon
    or comma dropped; None when nothing parses yet."""
    stack: list[str] = []
    cuts: list[tuple[int, str]] = []  # (end of a prefix that may parse once closed, closers then)
    in_str = esc = False
    for i, ch in enumerate(text):
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
            continue
        if ch == '"':
            in_str = True
        elif ch in _OPEN:
            stack.append(_OPEN[ch])
            cuts.append((i + 1, "".join(reversed(stack))))
        elif ch in "}]":
            if stack:
                stack.pop()
            cuts.append((i + 1, "".join(reversed(stack))))
        elif ch == ",":
            cuts.append((i, "".join(reversed(stack))))
    closers = "".join(reversed(stack))
    tail = text[:-1] if esc else text  # a lone backslash cannot end a string
    candidates = [tail + ('"' if in_str else "") + closers] + [text[:end] + c for end, c in reversed(cuts)]
    for candidate in candidates:
        try:
            return json.loads(candidate)
        except ValueError:
            continue
    return None


class StructuredStream:
    """Accumulates the streamed JSON text; ``partial()`` gives the object so far when it changed."""

    def __init__(self, output_cls):
        from llama_index.core.program.utils import create_flexible_model

        self.output_cls = output_cls
        self.flexible = create_flexible_model(output_cls)
        self.text = ""
        self._last: Any = None

    def add(self, delta: str):
        """The partial object after ``delta``, or None when nothing new parsed."""
        self.text += delta or ""
        value = partial_json(self.text)
        if not isinstance(value, dict) or value == self._last:
            return None
        self._last = value
        try:
            return self.flexible.model_validate(value)
        except Exception:  # a partial value of the wrong type so far (e.g. a number being written)
            return None

    def final(self, finish_reason: str | None):
        if finish_reason == "length":
            raise ValueError(
                f"structured output for {self.output_cls.__name__} was cut off by max_tokens before the JSON was "
                f"complete: {self.text!r}. Raise max_tokens."
            )
        return self.output_cls.model_validate_json(self.text)


def stream_objects(responses: Iterator, output_cls) -> Iterator:
    """Chat stream responses (constrained to ``output_cls``'s schema) -> partial objects, then the whole one."""
    state = StructuredStream(output_cls)
    finish = None
    for r in responses:
        finish = (r.raw or {}).get("finish_reason") or finish
        obj = state.add(r.delta or "")
        if obj is not None:
            yield obj
    yield state.final(finish)


async def astream_objects(responses: AsyncIterator, output_cls) -> AsyncIterator:
    state = StructuredStream(output_cls)
    finish = None
    async for r in responses:
        finish = (r.raw or {}).get("finish_reason") or finish
        obj = state.add(r.delta or "")
        if obj is not None:
            yield obj
    yield state.final(finish)


__all__ = ["StructuredStream", "astream_objects", "partial_json", "stream_objects"]


def structured_messages(messages: list, output_cls: type) -> list:
    """``messages`` with the JSON schema of ``output_cls`` in the system message (added, or appended to)."""
    from llama_index.core.base.llms.types import ChatMessage, MessageRole

    hint = ("Answer with a JSON object that matches this JSON schema:\n"
            + json.dumps(output_cls.model_json_schema(), ensure_ascii=False))
    if messages and messages[0].role == MessageRole.SYSTEM:
        first = messages[0]
        return [ChatMessage(role=MessageRole.SYSTEM, content=f"{first.content or ''}\n\n{hint}"), *messages[1:]]
    return [ChatMessage(role=MessageRole.SYSTEM, content=hint), *messages]


def parse_structured(output_cls: type, response) -> Any:
    """The finished answer as an ``output_cls`` instance; a JSON cut off by max_tokens says so."""
    text = response.message.content or ""
    if (response.raw or {}).get("finish_reason") == "length":
        raise ValueError(
            f"structured output for {output_cls.__name__} was cut off by max_tokens before the JSON was "
            f"complete: {text!r}. Raise max_tokens."
        )
    return output_cls.model_validate_json(text)
