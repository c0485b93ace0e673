"""Generated text -> typed pieces: the ONE place a request's output is split into answer, reasoning and
tool calls. Every front end (``parallm serve``'s chat streams and bodies, ``ChatParaLLM``, LlamaIndex)
maps these pieces; none parses model text itself::

    out = TypedOutput(parser_for(tokenizer), tools, prompt_ids)   # one per request choice
    pieces = out.feed(text_delta)          # [ContentDelta | ReasoningDelta | ToolCallDelta]
    pieces = out.finish(finish_reason)     # the last pieces, then a Finish
    out.content, out.reasoning, out.calls  # the finished message: exactly what the pieces concatenate to

The engine runs one per choice (``output_processor``) and sends the pieces on ``StreamDelta.pieces``; the
finished ``Choice`` carries ``out.content`` / ``out.reasoning`` / ``out.calls``, so a stream and the whole
result agree by construction.

Pieces (``chat_format``'s types):

* ``ContentDelta(text)``: answer text, never tool-call markup.
* ``ReasoningDelta(reasoning)``: ``<think>`` / harmony analysis text.
* ``ToolCallDelta(index, id, name, "")``: a call starts (id and name); ``ToolCallDelta(index,
  arguments_delta=...)``: a piece of its argument JSON text.
* ``Finish(reason, calls)``: ``reason`` is "tool_calls" when the model stopped after making calls, else the
  engine's ("stop", "length"); ``calls`` the finished ``ToolCall`` list. A call cut off by max_tokens is
  still a call (its partial argument text in ``raw_arguments``) with ``error`` set, as is a call whose
  arguments are not a JSON object.

Whitespace between the answer and a call (the newline a model writes between two ``<tool_call>`` blocks)
is not content: trailing whitespace of the answer is held until the next piece decides.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from parallm_engine.formats.chat_format import ContentDelta, ReasoningDelta, ToolCall, ToolCallDelta

TRUNCATED_CALL = "the tool call was cut off by max_tokens (finish_reason 'length') before it was complete"


@dataclass
class Finish:
    reason: str
    calls: list[ToolCall] = field(default_factory=list)


class TypedOutput:
    """One choice's output stream as typed pieces (see the module docstring). Not thread-safe: one per
    choice, fed in order."""

    def __init__(self, output_parser=None, tools: list[dict] | None = None, prompt_ids=None):
        if output_parser is None:
            from parallm_engine.formats.chat_format import default_parser

            output_parser = default_parser()
        wanted = tools or output_parser.splits_reasoning
        self._stream = output_parser.stream(tools, prompt_ids) if wanted else None
        self._calls_possible = bool(tools) or output_parser.tool_format.handles_reasoning
        self.content = ""
        self.reasoning = ""
        self.calls: list[ToolCall] = []
        self.finish_reason: str | None = None
        self._parts: dict[int, dict] = {}  # call index -> {"id", "name", "args"}
        self._space = ""  # answer whitespace held back: it may sit next to a call
        self._after_call = False
        self._reasoning_space = ""

    def feed(self, text: str) -> list:
        if not text:
            return []
        if self._stream is None:
            self.content += text
            return [ContentDelta(text)]
        return self._shape(self._stream.feed(text))

    def finish(self, reason: str) -> list:
        """The last pieces and the :class:`Finish` (``reason``: the engine's finish_reason)."""
        pieces = self._shape(self._stream.finish(truncated=reason == "length")) if self._stream is not None else []
        if self._space and not self._parts:
            pieces += self._text(self._space, flush=True)
        self._space = self._reasoning_space = ""
        last = max(self._parts, default=None)
        self.calls = [self._call(part, reason == "length" and i == last) for i, part in sorted(self._parts.items())]
        self.finish_reason = "tool_calls" if self.calls and reason == "stop" else reason
        pieces.append(Finish(self.finish_reason, list(self.calls)))
        return pieces

    # -- shaping ----------------------------------------------------------------------------------
    def _shape(self, events: list) -> list:
        out: list = []
        for ev in events:
            if isinstance(ev, ToolCallDelta):
                part = self._parts.get(ev.index)
                if part is None or ev.id is not None:
                    self._space = ""  # whitespace before a call is not content
                    part = self._parts[ev.index] = {"id": ev.id, "name": ev.name, "args": ""}
                part["args"] += ev.arguments_delta or ""
                self._after_call = True
                out.append(ev)
            elif isinstance(ev, ReasoningDelta):
                out += self._reason(ev.reasoning)
            elif ev.text:
                out += self._text(ev.text)
        return out

    def _text(self, text: str, flush: bool = False) -> list:
        if not self._calls_possible:
            self.content += text
            return [ContentDelta(text)]
        text = self._space + text if not flush else text
        if self._after_call:
            text = text.lstrip()  # whitespace after a call is not content
        body = text if flush else text.rstrip()
        self._space = text[len(body):]
        if not body:
            return []
        self._after_call = False
        self.content += body
        return [ContentDelta(body)]

    def _reason(self, text: str) -> list:
        text = self._reasoning_space + text
        body = text.rstrip()  # reasoning's trailing whitespace is dropped when it ends
        self._reasoning_space = text[len(body):]
        if not body:
            return []
        self.reasoning += body
        return [ReasoningDelta(body)]

    @staticmethod
    def _call(part: dict, truncated: bool) -> ToolCall:
        """A finished call; ``truncated``: it is the last one and the output was cut off by max_tokens."""
        raw = part["args"]
        call = ToolCall(part["id"] or "", part["name"] or "", {}, raw_arguments=raw)
        try:
            args = json.loads(raw) if raw.strip() else (None if truncated else {})
        except ValueError:
            args = None
        if isinstance(args, dict) and part["name"]:
            call.arguments = args
        elif truncated:
            call.error = TRUNCATED_CALL
        else:
            call.error = "the tool call's arguments are not a JSON object"
        return call


__all__ = ["Finish", "TypedOutput", "TRUNCATED_CALL"]
