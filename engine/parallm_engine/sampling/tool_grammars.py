"""llguidance (lark) grammars that force tool calls in a model family's own format.

``build(fmt, tools, mode, parallel, special)``: ``mode`` "required" (a call to one of ``tools``),
"auto" (free text, or text then calls: once the call markup starts the call must be valid), "none" (text
that never starts a call). ``special`` maps marker strings that are single special tokens of the model to
their ids: those are written ``<[id]>`` so the model emits its real control token (a special token never
matches a text literal in llguidance, and spelling it out in bytes is out of distribution).

Values follow each tool's JSON schema: ``%json`` wherever the format writes JSON; the XML-ish formats
(qwen3_coder, glm47) write string parameters raw (one line, no ``<``) and other types as JSON; pythonic
writes keyword arguments as JSON literals (which mlx-lm's pythonic parser reads).
"""

from __future__ import annotations

import json
from typing import Any, Callable

# One-line JSON with ", " and ": " separators (json.dumps' defaults, and how chat templates render tool
# calls): with flexible whitespace small models spend their token budget on indentation, and llguidance's
# compact default ("," / ":") is out of distribution for them.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_ANY = "(?s:.*)"


def function_of(tool: dict) -> dict:
    return tool.get("function", tool)


def _params(tool: dict) -> dict:
    return _closed(function_of(tool).get("parameters") or {"type": "object", "properties": {}})


def _tool_schema(tool: dict, args_key: str = "arguments") -> dict:
    """``{"name": <const>, <args_key>: <parameters>}`` as one JSON schema."""
    return {
        "type": "object",
        "properties": {"name": {"const": function_of(tool)["name"]}, args_key: _params(tool)},
        "required": ["name", args_key],
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


def _regex_escape(s: str) -> str:
    """Escape for a /regex/ in llguidance's lark (Rust regex syntax, '/' delimited)."""
    return "".join("\\" + c if c in "\\.+*?()|[]{}^$/&~-#" else c for c in s)


def _lark_escape(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _json(schema: dict) -> str:
    return f"%json {json.dumps({**schema, 'x-guidance': _JSON_OPTIONS})}"


def _q(s: str) -> str:
    return f'"{_lark_escape(s)}"'


def _any_of(schemas: list[dict]) -> dict:
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


# ----------------------------------------------------------------------------------------------
# Assembly
# ----------------------------------------------------------------------------------------------


def build(fmt, tools: list[dict], mode: str, parallel: bool | None, special: dict[str, int]) -> str:
    """The lark grammar text for ``tools`` in ``fmt``'s call format. Raises ValueError where the format
    has no grammar (``fmt.has_grammar`` is False)."""
    lit: Callable[[str], str] = lambda m: f"<[{special[m]}]>" if m in special else _q(m)  # noqa: E731
    name = fmt.name
    if name == "hermes":
        return _hermes(fmt, tools, mode, parallel, lit, special)
    if name == "llama3_json":
        return _llama3(tools, mode, parallel)
    if name == "harmony":
        return _harmony(tools, mode, lit, special)
    builder = _MARKER_BODIES.get(name)
    if builder is None:
        raise ValueError(f"no constrained tool-call grammar for the {name!r} format")
    body, repeat_sep = builder(fmt, tools, parallel, lit)
    return _marker_grammar(fmt.start, body, mode, parallel is True and repeat_sep is not None, lit, special,
                           repeat_sep or '""')


def _marker_grammar(start: str, body: str, mode: str, parallel: bool | None, lit, special,
                    repeat_sep: str = '"\\n"') -> str:
    """Calls that open with a ``start`` marker; ``body`` defines rule ``body`` (everything after the
    marker). Free text never contains the marker: a lexeme that excludes it when it is text, or any text
    when the marker is a special token (free text cannot produce one)."""
    sep = "" if repeat_sep == '""' else f"{repeat_sep} "
    more = f" ({sep}{lit(start)} body)*" if parallel is True else ""
    if start in special:
        free = f"FREE: /{_ANY}/"
        if mode == "none":
            return f"start: FREE\n{free}\n"
        if mode == "auto":
            return f"start: FREE | FREE {lit(start)} body{more}\n{free}\n{body}\n"
    else:
        marker = _regex_escape(start)
        free = f"FREE: /{_ANY}/ & ~/{_ANY}{marker}{_ANY}/"
        if mode == "none":
            return f"start: FREE\n{free}\n"
        if mode == "auto":
            # PRE is free text ending at the first marker (it cannot extend past it, so the lexer hands
            # over to the call there).
            pre = f"PRE: /{_ANY}{marker}/ & ~/{_ANY}{marker}(?s:.)+/"
            return f"start: FREE | PRE body{more}\n{free}\n{pre}\n{body}\n"
    return f"start: {lit(start)} body{more}\n{body}\n"


def _hermes(fmt, tools, mode, parallel, lit, special) -> str:
    schema = _any_of([_tool_schema(t) for t in tools])
    body = f'body: "\\n" %json {json.dumps({**schema, "x-guidance": _JSON_OPTIONS})} "\\n" {lit(fmt.end)}'
    return _marker_grammar(fmt.start, body, mode, parallel, lit, special)


def _llama3(tools, mode, parallel) -> str:
    """No marker: the whole message is the call (or ``;``-separated calls)."""
    call = f"call: {_json(_any_of([_tool_schema(t, 'parameters') for t in tools]))}"
    calls = 'call ("; " call)*' if parallel is True else "call"
    free = f"FREE: /{_ANY}/ & ~/[ \\t\\r\\n]*\\{{{_ANY}/"  # text that does not start like a call
    if mode == "none":
        return f"start: FREE\n{free}\n"
    if mode == "auto":
        return f"start: FREE | {calls}\n{free}\n{call}\n"
    return f"start: {calls}\n{call}\n"


def _harmony(tools, mode, lit, special) -> str:
    """Required: straight to a commentary message addressed to one of the functions. Auto / none: any
    analysis (and, for auto, commentary) messages, then a final answer (or, for auto, a call). Free text
    in a message is any text: the channel tokens are special, so text cannot contain them."""
    if any(m not in special for m in (CHANNEL_, MESSAGE_)) and mode != "required":
        raise ValueError("harmony auto/none grammars need <|channel|> and <|message|> as special tokens")
    alts = " | ".join(f"call_{i}" for i in range(len(tools)))
    rules = [f"tcall: {lit(CHANNEL_)} \"commentary to=functions.\" ({alts})"]
    for i, tool in enumerate(tools):
        rules.append(f"call_{i}: {_q(function_of(tool)['name'] + ' ')} {lit('<|constrain|>')} \"json\" "
                     f"{lit(MESSAGE_)} {_json(_params(tool))} {lit('<|call|>')}")
    if mode == "required":
        return "start: tcall\n" + "\n".join(rules) + "\n"
    channels = '"analysis" | "commentary"' if mode == "auto" else '"analysis"'
    pre = (f"pre: {lit(CHANNEL_)} ({channels}) {lit(MESSAGE_)} TEXT {lit('<|end|>')} "
           f"{lit('<|start|>')} \"assistant\"")
    final = f"final: {lit(CHANNEL_)} \"final\" {lit(MESSAGE_)} TEXT"
    last = "(final | tcall)" if mode == "auto" else "final"
    return f"start: pre* {last}\n{pre}\n{final}\nTEXT: /{_ANY}/\n" + "\n".join(rules) + "\n"


CHANNEL_, MESSAGE_ = "<|channel|>", "<|message|>"


# -- families with a start marker: each gives rule `body` (what follows the marker) and the separator
# -- before a repeated marker when several calls each have their own (None: several calls share one body)


def _alts(rule: str, n: int) -> str:
    return " | ".join(f"{rule}_{i}" for i in range(n))


def _mistral(fmt, tools, parallel, lit):
    if fmt.args_style:  # [TOOL_CALLS]name[ARGS]{...}, repeated for several calls
        rules = [f"body: {_alts('call', len(tools))}"]
        for i, t in enumerate(tools):
            rules.append(f"call_{i}: {_q(function_of(t)['name'])} {lit('[ARGS]')} {_json(_params(t))}")
        return "\n".join(rules), '""'
    # [TOOL_CALLS][{"name": ..., "arguments": ...}, ...]: several calls are one list
    items = {"type": "array", "items": _any_of([_tool_schema(t) for t in tools]), "minItems": 1}
    if parallel is not True:
        items["maxItems"] = 1
    return f"body: {_json(items)}", None


def _kimi_k2(fmt, tools, parallel, lit):
    rules = [f"body: kcall{' kcall*' if parallel is True else ''} {lit(fmt.end)}",
             f"kcall: {lit('<|tool_call_begin|>')} \"functions.\" ({_alts('call', len(tools))}) "
             f"{lit('<|tool_call_end|>')}"]
    for i, t in enumerate(tools):
        rules.append(f"call_{i}: {_q(function_of(t)['name'] + ':')} /[0-9]/ {lit('<|tool_call_argument_begin|>')} "
                     f"{_json(_params(t))}")
    return "\n".join(rules), None


def _pythonic(fmt, tools, parallel, lit):
    """``[name(key=value, ...)]``: values as JSON literals, keywords in schema order."""
    more = ' (", " pcall)*' if parallel is True else ""
    rules = [f'body: "[" pcall{more} "]" {lit(fmt.end)}',
             f"pcall: {_alts('call', len(tools))}"]
    for i, t in enumerate(tools):
        kw, extra = _keywords(f"c{i}", _params(t), lambda k, s: f'"{_lark_escape(k)}=" {_json(s)}', '", "')
        rules.append(f"call_{i}: {_q(function_of(t)['name'] + '(')} {kw} \")\"")
        rules += extra
    return "\n".join(rules), None


def _qwen3_coder(fmt, tools, parallel, lit):
    """``<tool_call>\\n<function=NAME>\\n<parameter=K>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>``"""
    rules = [f"body: \"\\n\" ({_alts('call', len(tools))}) {lit(fmt.end)}"]
    for i, t in enumerate(tools):
        kw, extra = _keywords(
            f"c{i}", _params(t), lambda k, s: f'"<parameter={_lark_escape(k)}>\\n" {_xml_value(s)} "\\n</parameter>\\n"')
        rules.append(f"call_{i}: {_q('<function=' + function_of(t)['name'] + '>')} \"\\n\" {kw} \"</function>\\n\"")
        rules += extra
    return "\n".join(rules), '"\\n"'


def _glm47(fmt, tools, parallel, lit):
    """``<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n...</tool_call>``"""
    rules = [f"body: ({_alts('call', len(tools))}) {lit(fmt.end)}"]
    for i, t in enumerate(tools):
        kw, extra = _keywords(f"c{i}", _params(t), lambda k, s: (
            f'"<arg_key>{_lark_escape(k)}</arg_key>\\n<arg_value>" {_xml_value(s)} "</arg_value>\\n"'))
        rules.append(f"call_{i}: {_q(function_of(t)['name'] + chr(10))} {kw}")
        rules += extra
    return "\n".join(rules), '"\\n"'


_MARKER_BODIES = {"mistral": _mistral, "kimi_k2": _kimi_k2, "pythonic": _pythonic, "qwen3_coder": _qwen3_coder,
                  "glm47": _glm47, "laguna": _glm47}


def _xml_value(schema: dict) -> str:
    """A parameter value written raw between tags: strings as one line of text without '<', other types
    as JSON."""
    if schema.get("type") == "string" and "enum" not in schema and "const" not in schema:
        return "/[^<\\n]*/"
    if schema.get("type") == "string":
        values = schema.get("enum") or [schema.get("const")]
        return "(" + " | ".join(_q(str(v)) for v in values) + ")"
    return _json(schema)


def _keywords(prefix: str, params: dict, item: Callable[[str, dict], str], sep: str = "") -> tuple[str, list[str]]:
    """The parameters of one call in schema order, required ones always and optional ones maybe, each
    rendered by ``item(key, schema)``, with ``sep`` between two that are present. Returns the expression
    for the list and the helper rules it needs (with a separator, one rule per (position, anything
    before it yet) pair)."""
    props = list((params.get("properties") or {}).items())
    required = set(params.get("required") or [])
    if not props:
        return '""', []
    if not sep:
        parts = [item(k, s) if k in required else f"({item(k, s)})?" for k, s in props]
        return " ".join(parts), []
    rules = []
    for i in range(len(props), -1, -1):
        for after in (False, True):
            name = f"{prefix}_{i}_{int(after)}"
            if i == len(props):
                rules.append(f'{name}: ""')
                continue
            key, schema = props[i]
            here = f"{sep + ' ' if after else ''}{item(key, schema)} {prefix}_{i + 1}_1"
            rules.append(f"{name}: {here}" if key in required else f"{name}: {here} | {prefix}_{i + 1}_{int(after)}")
    return f"{prefix}_0_0", rules
