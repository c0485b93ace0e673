"""Model output -> (content, reasoning, tool calls): parse finished text, and split a stream into deltas.

The engine-facing API is one object per engine and one stream per request::

    output_parser = parser_for(tokenizer)              # once per engine: the family's tool-call format
    content, reasoning, calls = output_parser.parse(text, tools, prompt_ids)   # a finished choice
    stream = output_parser.stream(tools, prompt_ids)   # per request, never shared between requests
    stream.feed(delta_text) -> [ContentDelta | ReasoningDelta | ToolCallDelta]; stream.finish() -> [...]

Front ends do not call these directly: ``typed_output.TypedOutput`` wraps one stream per choice and is
the one entry point (the engine runs it and sends its pieces on ``StreamDelta.pieces``).

The format comes from the chat template / tokenizer (``tool_formats.detect_format``: Hermes / Qwen
``<tool_call>``, Llama 3.x JSON, Mistral ``[TOOL_CALLS]``, gpt-oss harmony, and every family mlx-lm ships
a parser for). Reasoning is ``<think>...</think>`` style text (the markers mlx-lm finds in the vocabulary)
or harmony's analysis channel.

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
import re
import threading
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


# ----------------------------------------------------------------------------------------------
# Reasoning and the per-engine output parser
# ----------------------------------------------------------------------------------------------


class ThinkSplitter:
    """Splits a stream at ``<think>`` / ``</think>`` style markers into ("reasoning" | "content", text)
    pieces. A marker's possible beginning at the end of a delta is held back until it is decided, so a
    marker never leaks into either side; the whitespace a template puts right after a marker is dropped."""

    def __init__(self, start: str, end: str, in_reasoning: bool = False):
        self.start, self.end = start, end
        self.in_reasoning = in_reasoning
        self._buf = ""
        self._trim = True  # drop leading whitespace of the next piece (after a marker, or at the start)

    def feed(self, delta: str) -> list[tuple[str, str]]:
        self._buf += delta
        out: list[tuple[str, str]] = []
        while self._buf:
            if self.in_reasoning:
                at, marker = self._buf.find(self.end), self.end
                markers = (self.end,)
            else:  # a start marker opens reasoning; a stray end marker is dropped from the answer
                found = [(i, m) for i, m in ((self._buf.find(self.start), self.start),
                                              (self._buf.find(self.end), self.end)) if i != -1]
                at, marker = min(found) if found else (-1, "")
                markers = (self.start, self.end)
            kind = "reasoning" if self.in_reasoning else "content"
            if at == -1:
                keep = max(_partial_suffix(self._buf, m) for m in markers)
                self._piece(out, kind, self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep :]
                break
            self._piece(out, kind, self._buf[:at])
            self._buf = self._buf[at + len(marker) :]
            self.in_reasoning = marker == self.start
            self._trim = True
        return out

    def finish(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        self._piece(out, "reasoning" if self.in_reasoning else "content", self._buf)
        self._buf = ""
        return out

    def _piece(self, out: list, kind: str, text: str) -> None:
        if self._trim:
            text = text.lstrip()
            if not text:
                return
            self._trim = False
        if text:
            out.append((kind, text))


class OutputStream:
    """One request's stream parser: feed text deltas, get ContentDelta / ReasoningDelta / ToolCallDelta.
    ``calls`` holds the complete, valid calls once ``finish()`` has run. State is this object's own: make
    one per request (and per choice), never share one between requests."""

    def __init__(self, tool_format, tools: list[dict] | None, think: tuple[str, str] | None, in_reasoning: bool):
        self._tools = tool_format.stream(tools) if (tools or tool_format.handles_reasoning) else None
        self._think = ThinkSplitter(*think, in_reasoning) if think and not tool_format.handles_reasoning else None
        self.content = ""
        self.reasoning = ""

    @property
    def calls(self) -> list[ToolCall]:
        return list(self._tools.calls) if self._tools is not None else []

    def feed(self, delta: str) -> list:
        pieces = self._think.feed(delta) if self._think is not None else [("content", delta)]
        return self._route(pieces)

    def finish(self, truncated: bool = False) -> list:
        events = self._route(self._think.finish()) if self._think is not None else []
        if self._tools is not None:
            events += self._track(self._tools.finish(truncated=truncated))
        return events

    def _route(self, pieces) -> list:
        events: list = []
        for kind, text in pieces:
            if not text:
                continue
            if kind == "reasoning":
                events.append(ReasoningDelta(text))
            elif self._tools is not None:
                events += self._tools.feed(text)
            else:
                events.append(ContentDelta(text))
        return self._track(events)

    def _track(self, events: list) -> list:
        for ev in events:
            if isinstance(ev, ContentDelta):
                self.content += ev.text
            elif isinstance(ev, ReasoningDelta):
                self.reasoning += ev.reasoning
        return events


class OutputParser:
    """The output parser of one model: its tool-call format and reasoning markers. Stateless (safe to
    share between threads and requests); per-request state lives in the ``OutputStream`` it makes."""

    def __init__(self, tool_format=None, think: tuple[str, str] | None = None,
                 think_ids: tuple[tuple[int, ...], tuple[int, ...]] | None = None):
        if tool_format is None:
            from .tool_formats import HermesFormat

            tool_format = HermesFormat()
        self.tool_format = tool_format
        self.think = think
        self._think_ids = think_ids

    @property
    def name(self) -> str:
        return self.tool_format.name

    @property
    def splits_reasoning(self) -> bool:
        """Whether outputs may hold reasoning to take out of the answer (even with no tools)."""
        return self.think is not None or self.tool_format.handles_reasoning

    def starts_in_reasoning(self, prompt_ids) -> bool | None:
        """Whether the prompt leaves the model inside a reasoning block (a ``<think>`` the template
        opened and did not close); None when it cannot be told (no prompt ids, no markers)."""
        if self.think is None or prompt_ids is None or self._think_ids is None:
            return None
        ids = list(prompt_ids)
        return _rfind(ids, self._think_ids[0]) > _rfind(ids, self._think_ids[1])

    def stream(self, tools: list[dict] | None = None, prompt_ids=None) -> OutputStream:
        return OutputStream(self.tool_format, tools, self.think, bool(self.starts_in_reasoning(prompt_ids)))

    def parse(self, text: str, tools: list[dict] | None = None, prompt_ids=None
              ) -> tuple[str, str | None, list[ToolCall]]:
        """(content, reasoning or None, calls) of a finished output. Calls are only looked for when
        ``tools`` are given (to those tools' names); reasoning is always taken out of the content."""
        fmt = self.tool_format
        if fmt.handles_reasoning:
            return fmt.parse_all(text, tools)
        reasoning = ""
        content = text
        if self.think is not None:
            start = self.starts_in_reasoning(prompt_ids)
            if start is None:  # no prompt: an end marker before any start marker means it began inside
                end_at, start_at = text.find(self.think[1]), text.find(self.think[0])
                start = end_at != -1 and (start_at == -1 or end_at < start_at)
            splitter = ThinkSplitter(*self.think, start)
            pieces = splitter.feed(text) + splitter.finish()
            reasoning = "".join(t for k, t in pieces if k == "reasoning")
            content = "".join(t for k, t in pieces if k == "content")
        calls: list[ToolCall] = []
        if tools:
            content, calls = fmt.parse(content, tools)
        return content, reasoning.strip() or None, calls


def _rfind(ids: list[int], seq: tuple[int, ...]) -> int:
    n = len(seq)
    if not n:
        return -1
    if n == 1:  # the usual case (single-token markers): list.index runs in C
        try:
            return len(ids) - 1 - ids[::-1].index(seq[0])
        except ValueError:
            return -1
    for i in range(len(ids) - n, -1, -1):
        if tuple(ids[i : i + n]) == seq:
            return i
    return -1


_parsers: dict[int, tuple[Any, OutputParser]] = {}
_parsers_lock = threading.Lock()


def parser_for(tokenizer) -> OutputParser:
    """The output parser for a model's tokenizer (detected once per tokenizer, then cached)."""
    if tokenizer is None:
        return default_parser()
    key = id(tokenizer)
    with _parsers_lock:
        hit = _parsers.get(key)
        if hit is not None and hit[0] is tokenizer:
            return hit[1]
    from .tool_formats import detect_format, detect_thinking

    think, think_ids = detect_thinking(tokenizer)
    parser = OutputParser(detect_format(tokenizer), think, think_ids)
    with _parsers_lock:
        _parsers[key] = (tokenizer, parser)  # holds the tokenizer, so its id is never reused meanwhile
    return parser


_DEFAULT: OutputParser | None = None


def default_parser() -> OutputParser:
    """Hermes ``<tool_call>`` and no reasoning markers: for callers that have no tokenizer at hand."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = OutputParser()
    return _DEFAULT
