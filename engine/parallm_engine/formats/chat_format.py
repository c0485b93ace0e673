"""Model output -> (content, reasoning, tool calls): parse finished text, and split a stream into deltas.

The engine-facing API is one object per engine and one stream per request::

    output_parser = parser_for(tokenizer)              # once per engine: the family's tool-call format
    content, reasoning, calls = output_parser.parse(text, tools, prompt_ids)   # a finished choice
    stream = output_parser.stream(tools, prompt_ids)   # per request, never shared between requests
    stream.feed(delta_text) -> [ContentDelta | ReasoningDelta | ToolCallDelta]; stream.finish() -> [...]

Front ends do not call these directly: ``typed_output.TypedOutput`` wraps one stream per choice and is
the one entry point (the engine runs it and sends its pieces on ``StreamDelta.pieces``).

The format comes from the chat template / tokenizer (``detect_format`` below: Hermes / Qwen
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

import threading
from typing import Any

from parallm_engine.formats.harmony import HarmonyFormat

# The typed pieces and the Hermes parser live in ``tool_calls``; re-exported: front ends import them from here.
from parallm_engine.formats.tool_calls import (  # noqa: F401
    ContentDelta,
    ReasoningDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallStreamParser,
    _partial_suffix,
    parse_tool_calls,
)
from parallm_engine.formats.tool_formats import HermesFormat, Llama3JsonFormat, MlxLmFormat, ToolFormat

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
            tool_format = HermesFormat()
        self.tool_format = tool_format
        self.think = think
        self._think_ids = think_ids

    @property
    def name(self) -> str:
        return self.tool_format.name

    @property
    def think_ids(self) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """The token ids of the reasoning markers (start, end), or None."""
        return self._think_ids

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


# ----------------------------------------------------------------------------------------------
# Detection
# ----------------------------------------------------------------------------------------------


def _template_text(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates ("default", "tool_use")
        return "\n".join(t for t in template.values() if isinstance(t, str))
    return template if isinstance(template, str) else ""


def _vocab(tokenizer) -> dict[str, int]:
    try:
        return tokenizer.get_vocab()
    except Exception:
        return {}


def _mlx_parser_name(tokenizer) -> str | None:
    """The parser mlx-lm picked when it loaded this tokenizer, else the one it would infer."""
    try:
        name = (getattr(tokenizer, "init_kwargs", None) or {}).get("tool_parser_type")
    except Exception:
        name = None
    if not name:
        fn = getattr(tokenizer, "tool_parser", None)
        module = getattr(fn, "__module__", "") or ""
        if module.startswith("mlx_lm.tool_parsers."):
            name = module.rsplit(".", 1)[1]
    if not name:
        try:
            from mlx_lm.tokenizer_utils import _infer_tool_parser

            name = _infer_tool_parser(tokenizer)
        except Exception:
            name = None
    return name or None


def is_llama3_template(template: str) -> bool:
    return "<|python_tag|>" in template or ('"parameters"' in template and "<|start_header_id|>" in template)


def detect_format(tokenizer) -> ToolFormat:
    """The tool-call format of the model whose tokenizer this is."""
    template = _template_text(tokenizer)
    vocab = _vocab(tokenizer)
    fmt: ToolFormat
    if ("<|channel|>" in vocab and "<|message|>" in vocab) or "<|channel|>" in template:
        fmt = HarmonyFormat()
    else:
        name = _mlx_parser_name(tokenizer)
        if name == "json_tools":
            fmt = HermesFormat()
        elif name:
            try:
                fmt = MlxLmFormat(name, template)
            except ImportError:
                fmt = HermesFormat()
        elif is_llama3_template(template):
            fmt = Llama3JsonFormat()
        else:
            fmt = HermesFormat()
    fmt.marker_ids = {m: vocab[m] for m in fmt.markers if m and m in vocab}
    return fmt


def detect_thinking(tokenizer) -> tuple[tuple[str, str] | None, tuple[tuple[int, ...], tuple[int, ...]] | None]:
    """The reasoning markers (``<think>``, ``</think>`` and kin, as mlx-lm's TokenizerWrapper finds them in
    the vocabulary) and their token ids; (None, None) for models without them."""
    start, end = getattr(tokenizer, "think_start", None), getattr(tokenizer, "think_end", None)
    if isinstance(start, str) and isinstance(end, str):
        ids = (tuple(getattr(tokenizer, "think_start_tokens", None) or ()),
               tuple(getattr(tokenizer, "think_end_tokens", None) or ()))
        return (start, end), (ids if ids[0] and ids[1] else None)
    vocab = _vocab(tokenizer)
    if "<think>" in vocab and "</think>" in vocab:  # a bare Hugging Face tokenizer
        return ("<think>", "</think>"), ((vocab["<think>"],), (vocab["</think>"],))
    return None, None
