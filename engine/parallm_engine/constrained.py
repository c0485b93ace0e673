"""Grammar-constrained decoding, per request, inside the continuous batch (llguidance).

A request's ``response_format`` (OpenAI shape, plus ``{"type": "regex", "regex": ...}``) or its tools
and ``tool_choice`` (required / named: a call is forced; auto: text or a valid call; none: text that never
starts a call) compile, at submit time on the caller's thread, to an llguidance grammar. Each
sequence gets its own matcher; before sampling, the scheduler asks every constrained row's matcher for
its allowed-token bitmask and masks those rows' logits in one ``mx.where``. Rows without a constraint
are not touched, so an unconstrained request costs nothing extra and samples exactly as it would alone.
"""

from __future__ import annotations

import json
import threading
from typing import Any, Callable

import mlx.core as mx
import numpy as np

from .chat_format import TOOL_CALL_END, TOOL_CALL_START
from .errors import GrammarError

_tokenizers: dict[int, Any] = {}
_tok_lock = threading.Lock()
# Compiled grammars (a matcher in its initial state, copied per sequence), keyed by (tokenizer, grammar):
# a hundred requests with one schema compile it once.
_templates: dict[tuple[int, str], Any] = {}
_MAX_TEMPLATES = 128


def ll_tokenizer(tokenizer, vocab_size: int):
    """llguidance's view of the model tokenizer: built once per tokenizer (~1 s), then cached."""
    import llguidance.hf

    key = id(tokenizer)
    with _tok_lock:
        tok = _tokenizers.get(key)
        if tok is None:
            hf = getattr(tokenizer, "_tokenizer", tokenizer)
            eos = sorted(getattr(tokenizer, "eos_token_ids", None) or [hf.eos_token_id])
            tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size, eos_token=eos[0])
            _tokenizers[key] = tok
        return tok


class GrammarConstraint:
    """One sequence's grammar state."""

    def __init__(self, matcher, words: int):
        self.matcher = matcher
        self.words = words

    def fill_bitmask(self, row: np.ndarray) -> None:
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.size * row.itemsize)

    def advance(self, token: int) -> None:
        self.matcher.consume_token(token)

    def is_done(self) -> bool:
        return self.matcher.is_stopped()


def apply_constraints(logits: mx.array, constraints: list[GrammarConstraint | None]) -> mx.array:
    """Mask the constrained rows of (B, V) logits to the tokens their grammars allow."""
    rows = [i for i, c in enumerate(constraints) if c is not None]
    if not rows:
        return logits
    mx.async_eval(logits)  # the forward runs while the host computes the masks (no-op if already started)
    B, V = logits.shape
    words = constraints[rows[0]].words
    bitmask = np.full((B, words), -1, dtype=np.int32)  # all allowed for unconstrained rows
    for i in rows:
        constraints[i].fill_bitmask(bitmask[i])
    allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :V].astype(bool)
    if allowed.shape[1] < V:  # a model vocabulary padded beyond the tokenizer's
        allowed = np.pad(allowed, ((0, 0), (0, V - allowed.shape[1])))
        allowed[[i for i in range(B) if constraints[i] is None]] = True
    return mx.where(mx.array(allowed), logits, -mx.inf)


# One-line JSON with ", " and ": " separators (json.dumps' defaults, and how chat templates render tool
# calls): with flexible whitespace small models spend their token budget on indentation, and llguidance's
# compact default ("," / ":") is out of distribution for them.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _tool_schema(tool: dict) -> dict:
    fn = tool.get("function", tool)
    params = _closed(fn.get("parameters") or {"type": "object", "properties": {}})
    return {
        "type": "object",
        "properties": {"name": {"const": fn["name"]}, "arguments": params},
        "required": ["name", "arguments"],
        "additionalProperties": False,
        "x-guidance": _JSON_OPTIONS,
    }


def _closed(schema: Any) -> Any:
    """A copy where objects that list ``properties`` and say nothing about other keys allow no others.

    JSON Schema's default lets any extra key through, and a small model fills arguments with junk keys
    ("type", "required", ...) that the function then rejects; every output stays valid for the
    original schema."""
    if isinstance(schema, list):
        return [_closed(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k in ("properties", "patternProperties", "$defs", "definitions") and isinstance(v, dict):
            out[k] = {name: _closed(sub) for name, sub in v.items()}  # a map of schemas, not a schema
        elif k in ("const", "enum", "default", "examples"):
            out[k] = v
        else:
            out[k] = _closed(v)
    if isinstance(schema.get("properties"), dict) and not any(
        k in schema for k in ("additionalProperties", "patternProperties", "unevaluatedProperties")
    ):
        out["additionalProperties"] = False
    return out


def tool_call_grammar(tools: list[dict], tool_choice: Any, parallel: bool | None = None) -> str | None:
    """A lark grammar for tool calls in the Hermes format, or None when decoding stays free.

    "required"/"any": a call to any of the tools (several in a row only with ``parallel=True``: small
    models asked to allow more tend to repeat the same call until max_tokens); a named choice: exactly
    that tool; "auto" (and no tool_choice, OpenAI's default when tools are given): free text, which may
    end in calls; once the model writes the call marker the call must be valid JSON naming one of the
    tools with arguments matching its schema. "none": free text that never starts a call.
    """
    from llguidance import LLMatcher

    if not tools:
        return None
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name") or tool_choice.get("name")
        chosen = [t for t in tools if t.get("function", t).get("name") == name]
        if not chosen:
            raise GrammarError(f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
        parallel = False
    elif tool_choice in ("required", "any", True, None, "auto", "none", False):
        chosen = tools
    else:
        raise GrammarError(f"unsupported tool_choice {tool_choice!r}", param="tool_choice")
    schemas = [_tool_schema(t) for t in chosen]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas, "x-guidance": _JSON_OPTIONS}
    body = f'"\\n" %json {json.dumps(schema)} "\\n{_lark_escape(TOOL_CALL_END)}"'
    more = f' ("\\n{_lark_escape(TOOL_CALL_START)}" body)*' if parallel is True else ""
    # Free text is one lexeme that never contains the call marker; PRE is free text ending at the first
    # marker (it cannot extend past it, so the lexer hands over to the call there).
    marker, anything = _regex_escape(TOOL_CALL_START), "(?s:.*)"
    free = f"FREE: /{anything}/ & ~/{anything}{marker}{anything}/"
    if tool_choice in ("none", False):
        return LLMatcher.grammar_from_lark(f"start: FREE\n{free}\n")
    if tool_choice in (None, "auto"):
        pre = f"PRE: /{anything}{marker}/ & ~/{anything}{marker}(?s:.)+/"
        return LLMatcher.grammar_from_lark(f"start: FREE | PRE body{more}\n{free}\n{pre}\nbody: {body}\n")
    start = f'start: "{_lark_escape(TOOL_CALL_START)}" body{more}'
    return LLMatcher.grammar_from_lark(f"{start}\nbody: {body}\n")


def _regex_escape(s: str) -> str:
    """Escape for a /regex/ in llguidance's lark (Rust regex syntax, '/' delimited)."""
    return "".join("\\" + c if c in "\\.+*?()|[]{}^$/&~-#" else c for c in s)


def _lark_escape(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"')


def response_format_grammar(response_format: dict) -> str | None:
    from llguidance import LLMatcher

    if not isinstance(response_format, dict) or "type" not in response_format:
        raise GrammarError("response_format must be a dict with a 'type'", param="response_format")
    kind = response_format["type"]
    try:
        if kind == "text":
            return None
        if kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
        if kind == "json_schema":
            spec = response_format.get("json_schema") or {}
            schema = spec.get("schema", spec if "properties" in spec or "type" in spec else None)
            if not isinstance(schema, dict):
                raise GrammarError("response_format.json_schema.schema must be a JSON schema object",
                                   param="response_format")
            return LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
        if kind == "regex":
            pattern = response_format.get("regex") or response_format.get("pattern")
            if not isinstance(pattern, str):
                raise GrammarError("response_format.regex must be a string", param="response_format")
            return LLMatcher.grammar_from_regex(pattern)
        if kind == "lark":
            return LLMatcher.grammar_from_lark(response_format.get("grammar", ""))
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"invalid response_format: {exc}", param="response_format") from exc
    raise GrammarError(f"unsupported response_format type {kind!r}", param="response_format")


def compile_constraint(
    tokenizer,
    vocab_size: int,
    response_format: dict | None = None,
    tools: list[dict] | None = None,
    tool_choice: Any = None,
    parallel_tool_calls: bool | None = None,
) -> Callable[[], GrammarConstraint] | None:
    """Validate and compile; returns a factory of per-sequence constraints, or None (unconstrained).
    Raises GrammarError for anything llguidance rejects, before the request is queued."""
    from llguidance import LLMatcher

    grammar, param = None, "response_format"
    if response_format is not None:
        grammar = response_format_grammar(response_format)
    # "auto"/"none" only guard the model's own choice: a tool schema llguidance cannot compile leaves
    # such a request unconstrained instead of failing it. A forced call must compile.
    optional = tool_choice in (None, "auto", "none", False)
    if grammar is None and tools:
        param = "tools"
        try:
            grammar = tool_call_grammar(tools, tool_choice, parallel_tool_calls)
        except GrammarError:
            if optional:
                return None
            raise
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            if optional:
                return None
            raise GrammarError(f"cannot build a tool-call grammar from these tools: {exc!r}", param="tools") from exc
    if grammar is None:
        return None
    tok = ll_tokenizer(tokenizer, vocab_size)
    key = (id(tok), grammar)
    with _tok_lock:
        template = _templates.pop(key, None)
    if template is None:
        error = LLMatcher.validate_grammar(grammar, tok)
        if isinstance(error, tuple):  # (is_error, messages) in some llguidance versions
            error = "; ".join(error[1]) if error[0] else ""
        if not error:
            template = LLMatcher(tok, grammar, log_level=0)
            error = template.get_error() if template.is_error() else ""
        if error:
            if param == "tools" and optional:
                return None
            raise GrammarError(f"grammar rejected: {error}", param=param)
    with _tok_lock:  # most recently used last; the oldest compiled grammars go first
        _templates[key] = template
        while len(_templates) > _MAX_TEMPLATES:
            _templates.pop(next(iter(_templates)))
    words = (vocab_size + 31) // 32

    def factory() -> GrammarConstraint:
        # A copy of the compiled matcher in its initial state: microseconds, on the engine thread.
        return GrammarConstraint(template.deep_copy(), words)

    return factory
