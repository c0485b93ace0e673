"""gpt-oss's harmony output format: messages on channels, tool calls addressed to functions.

The generation prompt ends with ``<|start|>assistant``; the model then writes messages such as::

    <|channel|>analysis<|message|>The user wants the weather; call the tool.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

or, when it answers, ``...<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>``. The
recipient may also sit in the role header (``<|start|>assistant to=functions.get_weather<|channel|>
commentary json<|message|>``). ``analysis`` is reasoning; ``final`` (and ``commentary`` without a
recipient: a preamble meant for the user) is content; a message to ``functions.NAME`` is a call whose
body is its JSON arguments. ``<|call|>`` and ``<|return|>`` are stop tokens, so a finished output usually
ends without them. Text outside any message (a model ignoring the format) is content.
"""

from __future__ import annotations

import json
import re

from parallm_engine.formats.tool_calls import ContentDelta, ReasoningDelta, ToolCall, ToolCallDelta, _partial_suffix, new_call_id, tool_names
from parallm_engine.formats.tool_formats import ToolFormat

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
_OPENERS = (START, CHANNEL)  # begin a message header
_TERMINATORS = (END, RETURN, CALL, START, CHANNEL)  # end a message body (the last two: a new header)
_MAX_HEADER = 512  # a "header" longer than this without <|message|> is text, not a header

_CHANNEL_RE = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_RECIPIENT_RE = re.compile(r"\bto=([^\s<]+)")


class HarmonyFormat(ToolFormat):
    name = "harmony"
    handles_reasoning = True
    has_grammar = True
    markers = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)

    def stream(self, tools=None):
        return HarmonyStreamParser(tools)

    def parse_all(self, text: str, tools=None) -> tuple[str, str | None, list[ToolCall]]:
        parser = self.stream(tools)
        events = parser.feed(text) + parser.finish()
        content = "".join(e.text for e in events if isinstance(e, ContentDelta))
        reasoning = "".join(e.reasoning for e in events if isinstance(e, ReasoningDelta))
        return (content.strip() if parser.calls else content), reasoning.strip() or None, list(parser.calls)

    def parse(self, text, tools=None):
        content, _, calls = self.parse_all(text, tools)
        return content, calls


class HarmonyStreamParser:
    """Per-request state machine over harmony text: outside a message -> header -> body -> ..."""

    def __init__(self, tools: list[dict] | None = None):
        self.names = tool_names(tools)
        self.calls: list[ToolCall] = []
        self._buf = ""
        self._mode = "text"  # "text" | "header" | "body"
        self._header = ""
        self._kind = "content"  # the body's destination: "reasoning" | "content" | "call" | "raw"
        self._call: dict | None = None
        self._index = -1

    def feed(self, delta: str) -> list:
        self._buf += delta
        events: list = []
        while self._buf:
            if self._mode == "text":
                at = _first(self._buf, _OPENERS)
                if at is None:
                    keep = max(_partial_suffix(self._buf, m) for m in _OPENERS)
                    self._emit_text(events, self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    break
                self._emit_text(events, self._buf[: at[0]])
                self._buf = self._buf[at[0] :]
                self._mode, self._header = "header", ""
            elif self._mode == "header":
                pos = self._buf.find(MESSAGE)
                if pos == -1:
                    keep = _partial_suffix(self._buf, MESSAGE)
                    self._header += self._buf[: len(self._buf) - keep]
                    self._buf = self._buf[len(self._buf) - keep :]
                    if len(self._header) > _MAX_HEADER:  # not a header after all
                        events.append(ContentDelta(self._header))
                        self._mode, self._header = "text", ""
                        continue
                    break
                self._header += self._buf[:pos]
                self._buf = self._buf[pos + len(MESSAGE) :]
                events += self._begin_body()
            else:
                at = _first(self._buf, _TERMINATORS)
                if at is None:
                    keep = max(_partial_suffix(self._buf, m) for m in _TERMINATORS)
                    events += self._body_text(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    break
                pos, marker = at
                events += self._body_text(self._buf[:pos])
                events += self._end_body()
                # <|end|> / <|return|> / <|call|> are consumed; <|start|> / <|channel|> open the next header.
                self._buf = self._buf[pos + len(marker) :] if marker in (END, RETURN, CALL) else self._buf[pos:]
                self._mode = "text"
        return events

    def finish(self, truncated: bool = False) -> list:
        """A call cut off inside its body keeps its streamed arguments (``TypedOutput`` flags it)."""
        events: list = []
        if self._mode == "body":
            events += self._body_text(self._buf)
            events += self._end_body()
        elif self._mode == "text":
            self._emit_text(events, self._buf)
        # An unfinished header is markup with no message: nothing to show.
        self._buf, self._mode = "", "text"
        return events

    # -- messages ---------------------------------------------------------------------------------
    def _begin_body(self) -> list:
        self._mode = "body"
        header = self._header
        channel = _CHANNEL_RE.search(header)
        recipient = _RECIPIENT_RE.search(header)
        if recipient is not None:
            name = recipient.group(1)
            name = name[len("functions."):] if name.startswith("functions.") else name
            if self.names is None or name not in self.names:
                self._kind = "raw"  # a call to no offered tool: shown as the text it is
                return [ContentDelta(header + MESSAGE)]
            self._kind = "call"
            self._index += 1
            self._call = {"index": self._index, "id": new_call_id(), "name": name, "args": ""}
            return [ToolCallDelta(self._index, self._call["id"], name, "")]
        self._kind = "reasoning" if channel is not None and channel.group(1) == "analysis" else "content"
        return []

    def _body_text(self, text: str) -> list:
        if not text:
            return []
        if self._kind == "reasoning":
            return [ReasoningDelta(text)]
        if self._kind == "call":
            self._call["args"] += text
            return [ToolCallDelta(self._call["index"], arguments_delta=text)]
        return [ContentDelta(text)]

    def _end_body(self) -> list:
        if self._kind == "call" and self._call is not None:
            call, self._call = self._call, None
            try:
                args = json.loads(call["args"]) if call["args"].strip() else {}
            except ValueError:
                args = None
            if isinstance(args, dict):
                self.calls.append(ToolCall(call["id"], call["name"], args))
        self._kind, self._header = "content", ""
        return []

    def _emit_text(self, events: list, text: str) -> None:
        if text:
            events.append(ContentDelta(text))


def _first(text: str, markers: tuple[str, ...]) -> tuple[int, str] | None:
    found = [(i, m) for m in markers if (i := text.find(m)) != -1]
    return min(found) if found else None
