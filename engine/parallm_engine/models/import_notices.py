"""Notices other libraries log on import that a ParaLLM user cannot act on, dropped by a logging filter
on the logger that emits them: the library itself is untouched and every other message it logs passes.

* transformers, imported for its tokenizers (by mlx-lm and by ParaLLM's chat templates), warns "PyTorch was
  not found. Models won't be available ..." where torch is not installed. ParaLLM runs models with MLX and
  needs no torch; installing it (GBs) would change nothing.
"""

from __future__ import annotations

import logging

UNACTIONABLE = {"transformers": ("PyTorch was not found",)}


class DropNotices(logging.Filter):
    """Drops the records of one logger whose message starts with one of ``prefixes``."""

    def __init__(self, prefixes: tuple[str, ...]):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


def drop_unactionable_notices() -> None:
    """Install the filters (idempotent). Must run before the library is imported: the notice comes at import."""
    for name, prefixes in UNACTIONABLE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, DropNotices) for f in logger.filters):
            logger.addFilter(DropNotices(prefixes))
