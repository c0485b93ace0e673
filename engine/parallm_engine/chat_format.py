"""Tool calls in model output: parse finished text, and split a stream into content and call deltas.

The default model's template (see gguf.CHATML_TOOLS_TEMPLATE) uses the Hermes / Qwen convention::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

which is also what mlx-lm's ``json_tools`` parser reads. Several blocks in one message are several
calls. A block whose body is not a JSON object with a string ``name`` stays in the content: a small
model's malformed call is shown to the caller rather than dropped or crashing the parse.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)

    def as_openai(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)},
        }


@dataclass
class ContentDelta:
    text: str


@dataclass
class ToolCallDelta:
    index: int
    id: str | None = None  # set on a call's first delta, with the name
    name: str | None = None
    arguments_delta: str = ""


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _parse_block(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body.strip())
    except (json.JSONDecodeError, ValueError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models emit the arguments as a JSON string
        try:
            args = json.loads(args)
        except (json.JSONDecodeError, ValueError):
            return None
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return None
    return ToolCall(new_call_id(), obj["name"], args)


def parse_tool_calls(text: str, tools: list[dict] | None = None) -> tuple[str, list[ToolCall]]:
    """Split finished output into (content without call markup, calls).

    With ``tools`` given, calls to names that are not among them are left in the content.
    """
    names = {t.get("function", t).get("name") for t in tools} if tools else None
    calls: list[ToolCall] = []
    content: list[str] = []
    pos = 0
    while True:
        start = text.find(TOOL_CALL_START, pos)
        if start == -1:
            content.append(text[pos:])
            break
        end = text.find(TOOL_CALL_END, start + len(TOOL_CALL_START))
        body = text[start + len(TOOL_CALL_START) : end if end != -1 else len(text)]
        if end == -1:  # cut off by max_tokens: the JSON may still be whole, with part of the end tag
            body = body[: len(body) - _partial_suffix(body, TOOL_CALL_END)]
        call = _parse_block(body)
        stop = end + len(TOOL_CALL_END) if end != -1 else len(text)
        if call is not None and (names is None or call.name in names):
            content.append(text[pos:start])
            calls.append(call)
        else:
            content.append(text[pos:stop])
        pos = stop
        if end == -1:
            break
    return "".join(content).strip() if calls else "".join(content), calls


class ToolCallStreamParser:
    """Feed text deltas; get ContentDelta / ToolCallDelta events as soon as they are certain.

    Text that could be the start of ``<tool_call>`` is held back until it is decided, so markup never
    leaks into content deltas. A call's arguments are streamed as the model writes them once the name is
    known (the JSON prefix up to ``"arguments":`` is parsed for it); the final ``finish()`` reports calls
    whose body never became valid JSON as content.
    """

    def __init__(self) -> None:
        self._buf = ""
        self._in_call = False
        self._body = ""
        self._index = -1
        self._name_sent = False
        self._args_sent = 0
        self.calls: list[ToolCall] = []

    def feed(self, delta: str) -> list:
        self._buf += delta
        events: list = []
        while self._buf:
            if not self._in_call:
                start = self._buf.find(TOOL_CALL_START)
                if start == -1:
                    keep = _partial_suffix(self._buf, TOOL_CALL_START)
                    text = self._buf[: len(self._buf) - keep]
                    if text:
                        events.append(ContentDelta(text))
                    self._buf = self._buf[len(self._buf) - keep :]
                    break
                if start:
                    events.append(ContentDelta(self._buf[:start]))
                self._buf = self._buf[start + len(TOOL_CALL_START) :]
                self._in_call, self._body, self._name_sent, self._args_sent = True, "", False, 0
                self._index += 1
            else:
                end = self._buf.find(TOOL_CALL_END)
                if end == -1:
                    keep = _partial_suffix(self._buf, TOOL_CALL_END)
                    self._body += self._buf[: len(self._buf) - keep]
                    self._buf = self._buf[len(self._buf) - keep :]
                    events += self._stream_call(final=False)
                    break
                self._body += self._buf[:end]
                self._buf = self._buf[end + len(TOOL_CALL_END) :]
                events += self._stream_call(final=True)
                self._in_call = False
        return events

    def finish(self) -> list:
        events: list = []
        if self._in_call:
            self._body += self._buf
            self._buf = ""
            events += self._stream_call(final=True)
            self._in_call = False
        elif self._buf:
            events.append(ContentDelta(self._buf))
            self._buf = ""
        return events

    def _stream_call(self, final: bool) -> list:
        events: list = []
        if not self._name_sent:
            name, args_start = _name_and_args_start(self._body)
            if name is None:
                if final:  # not a call after all: hand the block back as text
                    call = _parse_block(self._body)
                    if call is None:
                        self._index -= 1
                        return [ContentDelta(TOOL_CALL_START + self._body + TOOL_CALL_END)]
                    self.calls.append(call)
                    args = json.dumps(call.arguments, ensure_ascii=False)
                    return [ToolCallDelta(self._index, call.id, call.name, args)]
                return events
            self._name_sent = True
            self._args_start = args_start
            self._call_id = new_call_id()
            events.append(ToolCallDelta(self._index, self._call_id, name, ""))
        raw = self._body[self._args_start :]
        if final:
            # Drop the closing brace of the outer object (and whitespace) from the argument text.
            raw = raw.rstrip()
            if raw.endswith("}"):
                raw = raw[:-1].rstrip()
            piece = raw[self._args_sent :]
            if piece:
                events.append(ToolCallDelta(self._index, arguments_delta=piece))
            call = _parse_block(self._body)
            if call is not None:
                call.id = self._call_id
                self.calls.append(call)
            return events
        # Hold back the last few characters: they may be the outer object's closing brace.
        safe = len(raw.rstrip()) - 1
        if safe > self._args_sent:
            events.append(ToolCallDelta(self._index, arguments_delta=raw[self._args_sent : safe]))
            self._args_sent = safe
        return events


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def _name_and_args_start(body: str) -> tuple[str | None, int]:
    """From a partial call body '{"name": "x", "arguments": ...', the name and where arguments start."""
    key = body.find('"arguments"')
    if key == -1:
        return None, 0
    colon = body.find(":", key + len('"arguments"'))
    if colon == -1:
        return None, 0
    head = body[:key].rstrip().rstrip(",")
    try:
        obj = json.loads(head + "}")
    except (json.JSONDecodeError, ValueError):
        return None, 0
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None, 0
    start = colon + 1
    while start < len(body) and body[start] in " \n\t":
        start += 1
    return obj["name"], start
