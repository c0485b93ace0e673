"""Grammar-constrained decoding, per request, inside the continuous batch (llguidance).

A request's ``response_format`` (OpenAI shape, plus ``{"type": "regex", "regex": ...}``) or its tools
and ``tool_choice`` (required / named: a call is forced; auto: text or a valid call; none: text that never
starts a call; calls in the model family's own format, see :mod:`tool_grammars`) compile, at submit time
on the caller's thread, to an llguidance grammar. Each
sequence gets its own matcher; before sampling, the scheduler asks every constrained row's matcher for
its allowed-token bitmask and masks those rows' logits in one ``mx.where``. Rows without a constraint
are not touched, so an unconstrained request costs nothing extra and samples exactly as it would alone.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import mlx.core as mx
import numpy as np

from parallm_engine.sampling import tool_grammars
from parallm_engine.errors import GrammarError
from parallm_engine.sampling.tool_grammars import _JSON_OPTIONS

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


def tool_call_grammar(tools: list[dict], tool_choice: Any, parallel: bool | None = None, fmt=None,
                      special: dict[str, int] | None = None) -> str | None:
    """A lark grammar for tool calls in the model family's format (``fmt``, a ``tool_formats`` format;
    Hermes ``<tool_call>`` when None), or None when decoding stays free.

    "required"/"any": a call to any of the tools (several in a row only with ``parallel=True``: small
    models asked to allow more tend to repeat the same call until max_tokens); a named choice: exactly
    that tool; "auto" (and no tool_choice, OpenAI's default when tools are given): free text, which may
    end in calls; once the model writes the call markup the call must be valid, naming one of the
    tools with arguments matching its schema. "none": free text that never starts a call. ``special``:
    the format's markers that are single special tokens (see ``tool_grammars.build``).
    """
    from llguidance import LLMatcher

    from parallm_engine.formats.tool_formats import HermesFormat

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
    fmt = fmt if fmt is not None else HermesFormat()
    mode = "none" if tool_choice in ("none", False) else "auto" if tool_choice in (None, "auto") else "required"
    if not fmt.has_grammar:
        raise GrammarError(f"tool_choice={tool_choice!r} cannot be enforced for the {fmt.name!r} tool-call format "
                           "(no grammar for it yet); use tool_choice='auto'", param="tool_choice")
    try:
        lark = tool_grammars.build(fmt, chosen, mode, parallel, special or {})
    except ValueError as exc:
        raise GrammarError(f"cannot build a {fmt.name!r} tool-call grammar: {exc}", param="tools") from exc
    return LLMatcher.grammar_from_lark(lark)


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


def _tool_format(tokenizer):
    from parallm_engine.formats.chat_format import parser_for

    return parser_for(tokenizer).tool_format


def _special_markers(fmt, tokenizer, vocab_size: int) -> dict[str, int]:
    """The format's markers that are one special token of this model (llguidance's view)."""
    if not fmt.marker_ids:
        return {}
    tok = ll_tokenizer(tokenizer, vocab_size)
    return {m: i for m, i in fmt.marker_ids.items() if i < vocab_size and tok.is_special_token(i)}


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
            fmt = _tool_format(tokenizer)
            special = _special_markers(fmt, tokenizer, vocab_size)
            grammar = tool_call_grammar(tools, tool_choice, parallel_tool_calls, fmt=fmt, special=special)
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
    return compile_grammar(tokenizer, vocab_size, grammar, param=param, optional=optional)


def compile_grammar(tokenizer, vocab_size: int, grammar: str, param: str = "response_format",
                    optional: bool = False) -> Callable[[], GrammarConstraint] | None:
    """The per-sequence constraint factory of an llguidance ``grammar`` (cached by grammar); its ``source``
    is the grammar, which another rank of a distributed engine compiles again. None where an optional
    tool grammar does not compile."""
    from llguidance import LLMatcher

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

    factory.source = grammar
    return factory
