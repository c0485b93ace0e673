"""Runtime code states what is: its comments and docstrings carry no measured figures, dates or session numbers.

Figures live in the docs (``docs/benchmarks-archive.md`` holds the dated measurement record); a comment points
there. Only comments (tokenize's COMMENT tokens) and docstrings (ast) are scanned, so code and the strings passed
to exceptions or loggers are not.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import parallm_engine

PACKAGE = Path(parallm_engine.__file__).resolve().parent

FIGURES = [
    re.compile(r"\b\d+(\.\d+)?\s?(tok/s|GFLOP/s|GB/s)(?!\w)"),
    re.compile(r"\b\d+(\.\d+)?x (faster|slower)\b"),
    re.compile(r"\b20\d\d-\d\d-\d\d\b"),
    re.compile(r"\bMeasured on\b"),
    re.compile(r"\b(stop|session) \d+\b"),
]


def _comments(source: str):
    """(line, text) of each comment."""
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string


def _docstrings(source: str):
    """(line, text) of each line of each module, class and function docstring."""
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        body = node.body
        if not (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            continue
        first = body[0].value.lineno
        for offset, text in enumerate(body[0].value.value.splitlines()):
            yield first + offset, text


def test_runtime_code_carries_no_measured_figures():
    files = sorted(PACKAGE.rglob("*.py"))
    assert files, PACKAGE
    hits = []
    for path in files:
        source = path.read_text(encoding="utf-8")
        for line, text in [*_comments(source), *_docstrings(source)]:
            if any(pattern.search(text) for pattern in FIGURES):
                hits.append(f"{path.relative_to(PACKAGE)}:{line}: {text.strip()}")
    assert not hits, (
        "runtime comments/docstrings carry measured figures, dates or session numbers; state what the code "
        "does and point to docs/benchmarks-archive.md instead:\n" + "\n".join(hits)
    )
