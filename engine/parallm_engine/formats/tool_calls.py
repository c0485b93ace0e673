"""The typed pieces of model output and the Hermes / Qwen ``<tool_call>`` parser the formats build on.

``ToolCall`` (a parsed call), ``ContentDelta`` / ``ReasoningDelta`` / ``ToolCallDelta`` (a stream's pieces), and
:func:`parse_tool_calls` / :class:`ToolCallStreamParser` for ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``
blocks. The lowest layer of output parsing: ``tool_formats`` (the families' formats) and ``harmony`` build on it,
and ``chat_format`` (the per-engine parser, which also re-exports these names) on them.
"""

from __future__ import annotations

import json
import re
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
    raw_arguments: str | None = None  # the argument text as streamed (exactly what the pieces concatenate to)
    error: str | None = None  # set for a call that is not whole: cut off by max_tokens, or arguments not JSON

    def as_openai(self) -> dict:
        args = self.raw_arguments if self.raw_arguments is not None else json.dumps(self.arguments, ensure_ascii=False)
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": args}}


@dataclass
class ContentDelta:
    text: str


@dataclass
class ReasoningDelta:
    """Reasoning text (``<think>`` / harmony analysis). Its field is not called ``text`` so that code which
    only knows content deltas (``getattr(ev, "text")``) never mistakes it for the answer."""

    reasoning: str


@dataclass
class ToolCallDelta:
    index: int
    id: str | None = None  # set on a call's first delta, with the name
    name: str | None = None
    arguments_delta: str = ""


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_names(tools: list[dict] | None) -> set[str] | None:
    """The names of OpenAI tool dicts (or of objects with a ``name``, such as LangChain tools); None (no
    filter) when no tools are given."""
    if not tools:
        return None
    return {t.get("function", t).get("name") if isinstance(t, dict) else getattr(t, "name", None) for t in tools}


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
    names = tool_names(tools)
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

    def __init__(self, tools: list[dict] | None = None) -> None:
        self._names = tool_names(tools)  # None: any name is a call
        self._rejected = False  # the current block names a tool that is not offered: it is content
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
                self._rejected = False
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

    def finish(self, truncated: bool = False) -> list:
        """The output ended. ``truncated`` (finish_reason "length"): a call region still open is a call cut
        off by max_tokens, reported as a call with what it has (``TypedOutput`` flags it incomplete)."""
        events: list = []
        if self._in_call:
            body = self._body + self._buf
            self._body = body[: len(body) - _partial_suffix(body, TOOL_CALL_END)] if truncated else body
            self._buf = ""
            events += self._stream_call(final=True, closed=False, truncated=truncated)
            self._in_call = False
        elif self._buf and not truncated:  # held back as a possible start tag: cut off, it is markup
            events.append(ContentDelta(self._buf))
        self._buf = ""
        return events

    def _as_text(self, closed: bool) -> list:
        """The block is not a call: hand it back as the text the model wrote (the end tag only if written)."""
        self._index -= 1
        return [ContentDelta(TOOL_CALL_START + self._body + (TOOL_CALL_END if closed else ""))]

    def _stream_call(self, final: bool, closed: bool = True, truncated: bool = False) -> list:
        events: list = []
        if self._rejected:
            return self._as_text(closed) if final else events
        if not self._name_sent:
            name, args_start = _name_and_args_start(self._body)
            if name is not None and self._names is not None and name not in self._names:
                self._rejected = True
                return self._stream_call(final, closed, truncated)
            if name is None:
                if not final:
                    return events
                call = _parse_block(self._body)
                if call is not None and (self._names is None or call.name in self._names):
                    self.calls.append(call)
                    args = json.dumps(call.arguments, ensure_ascii=False)
                    return [ToolCallDelta(self._index, call.id, call.name, args)]
                partial = _partial_name(self._body) if truncated and not closed else None
                if partial is None or (partial[1] and self._names is not None and partial[0] not in self._names):
                    return self._as_text(closed)  # not a call after all
                # Cut off before the arguments began: a call with the name so far and no arguments.
                return [ToolCallDelta(self._index, new_call_id(), partial[0], "")]
            self._name_sent = True
            self._args_start = args_start
            self._call_id = new_call_id()
            events.append(ToolCallDelta(self._index, self._call_id, name, ""))
        if not self._args_sent:  # whitespace before the arguments may arrive after the colon was seen
            while self._args_start < len(self._body) and self._body[self._args_start] in " \n\t\r":
                self._args_start += 1
        raw = self._body[self._args_start :]
        if final:
            call = _parse_block(self._body)
            if closed or call is not None:
                # Drop the closing brace of the outer object (and whitespace) from the argument text.
                raw = raw.rstrip()
                if raw.endswith("}"):
                    raw = raw[:-1].rstrip()
            piece = raw[self._args_sent :]
            if piece:
                events.append(ToolCallDelta(self._index, arguments_delta=piece))
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


_NAME_RE = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)(")?')


def _partial_name(body: str) -> tuple[str, bool] | None:
    """(the name so far, whether it is complete) of a call body cut off before its arguments; ("", False)
    when not even the name began; None when the body is not the start of a JSON object."""
    text = body.strip()
    if text and not text.startswith("{"):
        return None
    match = _NAME_RE.search(text)
    if match is None:
        return "", False
    try:
        name = json.loads('"' + match.group(1) + '"')
    except ValueError:
        name = match.group(1)
    return name, match.group(2) is not None


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
