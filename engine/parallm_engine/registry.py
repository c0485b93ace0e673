"""One engine per (model, settings) per process: every ChatParaLLM / LlamaIndex object shares it."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from .engine import Engine

_engines: dict[tuple, Engine] = {}
_lock = threading.Lock()


def _key(model, config: dict) -> tuple:
    if model is not None:
        p = Path(os.fspath(model)).expanduser()
        model = str(p.resolve()) if p.exists() else str(model)
    return (model, tuple(sorted(config.items())))


def get_engine(model: str | os.PathLike | None = None, **config) -> Engine:
    """Return the process-wide engine for this model and settings, loading it on first use."""
    key = _key(model, config)
    with _lock:
        eng = _engines.get(key)
        if eng is not None and eng._dead is None:
            return eng
        eng = Engine(model, **config)
        _engines[key] = eng
        return eng


def shutdown_all() -> None:
    with _lock:
        engines = list(_engines.values())
        _engines.clear()
    for eng in engines:
        eng.shutdown()
