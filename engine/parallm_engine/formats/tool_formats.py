"""Tool-call formats per model family: which one a tokenizer speaks, and how to read it.

A format knows the markup of a call in model output, parses finished text into (content, calls) and
makes per-request stream parsers (``feed(text) -> events``, ``finish() -> events``, ``calls``). Its
grammar for constrained calls is in :mod:`tool_grammars`. Families:

* ``hermes``: ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` (Qwen 2.5/3, Hermes, SmolLM,
  the default model); arguments stream as the model writes them (``tool_calls.ToolCallStreamParser``).
* ``llama3_json``: Llama 3.x custom tools: the message is ``{"name": ..., "parameters": ...}``, possibly
  after ``<|python_tag|>``, several calls separated by ``;``.
* ``harmony``: gpt-oss (:mod:`harmony`): analysis / commentary / final channels, calls addressed
  ``to=functions.NAME``.
* every parser mlx-lm ships in ``mlx_lm.tool_parsers`` (mistral, pythonic, qwen3_coder, glm47, kimi_k2,
  gemma4, function_gemma, minimax_m2, longcat, minicpm5, muse_spark, kimi_k3, laguna): the region between
  the module's ``tool_call_start`` and ``tool_call_end`` goes to its ``parse_tool_call``, as mlx-lm's
  own server does. Those calls are reported whole once their region closes.

Detection (``chat_format.detect_format``): harmony tokens, then the parser mlx-lm chose for the tokenizer (its
``tool_parser_type`` or its inference from the template), then the Llama 3 template, then Hermes.
"""

from __future__ import annotations

import importlib
import json
from typing import Any

from parallm_engine.formats.tool_calls import (
    ContentDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallStreamParser,
    _partial_suffix,
    new_call_id,
    parse_tool_calls,
    tool_names,
)

# Extra markers (besides a format's start / end) the tool-call grammar of a family names, per mlx-lm parser
# module (sampling/tool_grammars.py writes them; the output parser must know them too).
GRAMMAR_MARKERS: dict[str, tuple[str, ...]] = {
    "mistral": ("[ARGS]",),
    "pythonic": (),
    "kimi_k2": ("<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"),
    "qwen3_coder": (),
    "glm47": (),
    "laguna": (),
}



class ToolFormat:
    """A family's call markup. ``start`` opens a call region and ``end`` closes it (``""``: the region runs
    to the end of the output, as Mistral's ``[TOOL_CALLS]`` does)."""

    name = "base"
    start = ""
    end = ""
    handles_reasoning = False  # harmony: reasoning is part of the format, not <think> markers
    has_grammar = False  # tool_grammars can force a call in this format
    markers: tuple[str, ...] = ()  # strings the grammar uses that may be single special tokens

    def __init__(self) -> None:
        self.marker_ids: dict[str, int] = {}  # filled by detect_format from the vocabulary

    def parse_block(self, body: str, tools: list[dict] | None) -> list[ToolCall] | None:
        raise NotImplementedError

    def stream(self, tools: list[dict] | None = None):
        return BlockStreamParser(self, tools)

    def parse(self, text: str, tools: list[dict] | None = None) -> tuple[str, list[ToolCall]]:
        """(content without call markup, calls) of finished text: the stream parser run over all of it, so
        streamed and whole results always agree."""
        parser = self.stream(tools)
        events = parser.feed(text) + parser.finish()
        content = "".join(e.text for e in events if isinstance(e, ContentDelta))
        return (content.strip() if parser.calls else content), list(parser.calls)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


def calls_from_parsed(parsed: Any, names: set[str] | None) -> list[ToolCall] | None:
    """mlx-lm parser output (a dict or a list of dicts with ``name`` / ``arguments`` / maybe ``id``) as
    ToolCalls; None if any of them is malformed or names a tool that was not offered."""
    items = parsed if isinstance(parsed, list) else [parsed]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        args = item.get("arguments", item.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if args is None:
            args = {}
        if not isinstance(args, dict) or (names is not None and item["name"] not in names):
            return None
        call_id = item.get("id") if isinstance(item.get("id"), str) and item.get("id") else new_call_id()
        calls.append(ToolCall(call_id, item["name"], args))
    return calls or None


class BlockStreamParser:
    """Content until the format's start marker, then the call region until its end marker (or the end of
    the output), parsed whole when it closes. A region that does not parse is given back as content."""

    def __init__(self, fmt: ToolFormat, tools: list[dict] | None):
        self.fmt = fmt
        self.tools = tools
        self.calls: list[ToolCall] = []
        self._buf = ""
        self._in_call = False
        self._opener = fmt.start  # the text that opened the current region ("" when implicit)
        self._body = ""

    def feed(self, delta: str) -> list:
        self._buf += delta
        events: list = []
        start, end = self.fmt.start, self.fmt.end
        while self._buf:
            if not self._in_call:
                at = self._buf.find(start)
                if at == -1:
                    keep = _partial_suffix(self._buf, start)
                    if len(self._buf) > keep:
                        events.append(ContentDelta(self._buf[: len(self._buf) - keep]))
                    self._buf = self._buf[len(self._buf) - keep :]
                    break
                if at:
                    events.append(ContentDelta(self._buf[:at]))
                self._buf = self._buf[at + len(start) :]
                self._open(start)
            elif not end:  # the region runs to the end of the output
                self._body += self._buf
                self._buf = ""
            else:
                at = self._buf.find(end)
                if at == -1:
                    keep = _partial_suffix(self._buf, end)
                    self._body += self._buf[: len(self._buf) - keep]
                    self._buf = self._buf[len(self._buf) - keep :]
                    break
                self._body += self._buf[:at]
                self._buf = self._buf[at + len(end) :]
                events += self._close(closed=True)
        return events

    def finish(self, truncated: bool = False) -> list:
        if self._in_call:
            self._body += self._buf
            self._buf = ""
            return self._close(closed=False, truncated=truncated)
        events = [ContentDelta(self._buf)] if self._buf else []
        self._buf = ""
        return events

    def _open(self, opener: str) -> None:
        self._in_call, self._opener, self._body = True, opener, ""

    def _close(self, closed: bool, truncated: bool = False) -> list:
        self._in_call = False
        calls = self.fmt.parse_block(self._body, self.tools)
        if not calls and truncated:  # cut off by max_tokens inside the region: a call, flagged incomplete
            return [ToolCallDelta(len(self.calls), new_call_id(), None, self._body.strip())]
        if not calls:
            return [ContentDelta(self._opener + self._body + (self.fmt.end if closed else ""))]
        events = []
        for call in calls:
            index = len(self.calls)
            self.calls.append(call)
            events.append(ToolCallDelta(index, call.id, call.name, json.dumps(call.arguments, ensure_ascii=False)))
        return events


# ----------------------------------------------------------------------------------------------
# Families
# ----------------------------------------------------------------------------------------------


class HermesFormat(ToolFormat):
    """``<tool_call>{json}</tool_call>``; arguments are streamed while the model writes them."""

    name = "hermes"
    start, end = "<tool_call>", "</tool_call>"
    has_grammar = True
    markers = ("<tool_call>", "</tool_call>")

    def parse(self, text, tools=None):
        return parse_tool_calls(text, tools)

    def stream(self, tools=None):
        return ToolCallStreamParser(tools)


class Llama3JsonFormat(ToolFormat):
    """Llama 3.1 / 3.2 / 3.3 JSON tool calls: the whole message is ``{"name": ..., "parameters": {...}}``
    (``;``-separated when several), optionally after ``<|python_tag|>``."""

    name = "llama3_json"
    start, end = "<|python_tag|>", ""
    has_grammar = True
    markers = ("<|python_tag|>",)

    def stream(self, tools=None):
        return _Llama3StreamParser(self, tools)

    def parse_block(self, body, tools):
        names = tool_names(tools)
        decoder = json.JSONDecoder()
        items, pos, text = [], 0, body.strip()
        while pos < len(text):
            while pos < len(text) and text[pos] in " \t\r\n;":
                pos += 1
            if pos >= len(text):
                break
            try:
                obj, pos = decoder.raw_decode(text, pos)
            except ValueError:
                return None
            items.append(obj)
        if not items or any(not isinstance(o, dict) or ("parameters" not in o and "arguments" not in o)
                            for o in items):
            return None
        return calls_from_parsed(items, names)


class _Llama3StreamParser(BlockStreamParser):
    """A message that begins (after whitespace) with ``{`` is a call region to the end of the output;
    so is everything after ``<|python_tag|>``. Anything else is content."""

    def __init__(self, fmt, tools):
        super().__init__(fmt, tools)
        self._head: str | None = ""  # text held until the message's first character decides; None once decided

    def feed(self, delta: str) -> list:
        if self._head is None:
            return super().feed(delta)
        self._head += delta
        lead = self._head.lstrip()
        if not lead or (self.fmt.start.startswith(lead) and lead != self.fmt.start):
            return []
        text, self._head = self._head, None
        if lead.startswith("{"):
            self._open("")
            self._body = text
            return []
        return super().feed(text)

    def finish(self, truncated: bool = False) -> list:
        if self._head is not None:
            text, self._head = self._head, None
            return super().feed(text) + super().finish(truncated)
        return super().finish(truncated)


class MlxLmFormat(ToolFormat):
    """A family mlx-lm ships a parser for (``mlx_lm.tool_parsers.<name>``): markers and parsing are its."""

    def __init__(self, module_name: str, template: str = ""):
        super().__init__()
        self.module = importlib.import_module(f"mlx_lm.tool_parsers.{module_name}")
        self.name = module_name
        self.start = self.module.tool_call_start
        self.end = self.module.tool_call_end or ""
        self.has_grammar = module_name in GRAMMAR_MARKERS
        self.markers = (self.start, self.end, *GRAMMAR_MARKERS.get(module_name, ()))
        # Mistral: tokenizers v11+ write `[TOOL_CALLS]name[ARGS]{...}`; older ones a JSON list.
        self.args_style = module_name == "mistral" and "[ARGS]" in template

    def parse_block(self, body, tools):
        try:
            parsed = self.module.parse_tool_call(body, tools)
        except Exception:  # each parser raises its own kinds (ValueError, JSONDecodeError, SyntaxError...)
            return None
        return calls_from_parsed(parsed, tool_names(tools))
