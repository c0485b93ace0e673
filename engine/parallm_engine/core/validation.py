"""Checks on caller-supplied text before it reaches the tokenizer, the grammar compiler or an error message.

JSON can carry lone UTF-16 surrogates (``"\\ud800x"``); ``json.loads`` turns them into Python strings that
no UTF-8 encoder takes, so the tokenizer raises ``TypeError`` and an error body echoing them cannot be
encoded. Such strings are refused up front with a typed 400-class error naming where they were.
"""

from __future__ import annotations

import re
from typing import Any

from parallm_engine.errors import InvalidRequestError

_SURROGATE = re.compile("[\ud800-\udfff]")


def is_valid_text(s: str) -> bool:
    """Whether ``s`` encodes as UTF-8 (no lone surrogates)."""
    return s.isascii() or _SURROGATE.search(s) is None


def invalid_text_path(obj: Any, path: str = "") -> str | None:
    """The dotted path of the first string (value or dict key) in ``obj`` (strings, dicts, lists and
    tuples, nested to any depth: walked without recursion) that is not valid Unicode; None if all are."""
    stack: list[tuple[Any, str]] = [(obj, path)]
    while stack:
        value, where = stack.pop()
        if isinstance(value, str):
            if not is_valid_text(value):
                return where
        elif isinstance(value, dict):
            items = []
            for key, item in value.items():
                sub = f"{where}.{key}" if where else str(key)
                if isinstance(key, str) and not is_valid_text(key):
                    return sub
                items.append((item, sub))
            stack.extend(reversed(items))  # popped in document order
        elif isinstance(value, (list, tuple)):
            stack.extend(reversed([(item, f"{where}.{i}" if where else str(i)) for i, item in enumerate(value)]))
    return None


def check_text(obj: Any, param: str) -> None:
    """Raise :class:`InvalidRequestError` if any string in ``obj`` holds a lone UTF-16 surrogate."""
    where = invalid_text_path(obj, param)
    if where is not None:
        raise InvalidRequestError(
            f"{safe_text(where, 200)}: text contains a lone UTF-16 surrogate (e.g. \\ud800), which is not valid "
            "Unicode; send UTF-8 text", param=safe_text(where, 200),
        )


def safe_text(s: str, limit: int = 2000) -> str:
    """``s`` fit for an error message: lone surrogates escaped (``\\ud800``), at most ``limit`` characters."""
    if not is_valid_text(s):
        s = s.encode("utf-8", "backslashreplace").decode("utf-8")
    if len(s) > limit:
        s = s[: limit - 15] + f"... ({len(s)} chars)"
    return s
