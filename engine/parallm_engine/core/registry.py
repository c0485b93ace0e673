"""One engine per (model, settings) per process: every ChatParaLLM / LlamaIndex object shares it.

``peek`` asks without creating anything (and without importing MLX when no engine was ever created),
so a front end can read a running engine's facts, e.g. its context window, at construction time."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from parallm_engine.core.engine import Engine

_engines: dict[tuple, Engine] = {}
_lock = threading.Lock()


def _key(model, config: dict) -> tuple:
    if model is not None:
        p = Path(os.fspath(model)).expanduser()
        model = str(p.resolve()) if p.exists() else str(model)
    return (model, tuple(sorted((k, _hashable(v)) for k, v in config.items())))


def _hashable(value):
    """Settings given as dicts (``adapters={name: path}``, ``speculative={...}``) as a key."""
    if isinstance(value, dict):
        return tuple(sorted((str(k), _hashable(v)) for k, v in value.items()))
    return str(value) if isinstance(value, os.PathLike) else value


def get_engine(model: str | os.PathLike | None = None, **config) -> Engine:
    """Return the process-wide engine for this model and settings, loading it on first use."""
    from parallm_engine.core.engine import Engine

    key = _key(model, config)
    with _lock:
        eng = _engines.get(key)
        if eng is not None and eng.is_alive:
            return eng
        eng = Engine(model, **config)
        _engines[key] = eng
        return eng


def get_embedding_engine(model: str | os.PathLike | None = None, **config):
    """The process-wide engine that embeds with ``model``: an ``EncoderEngine`` (mlx-embeddings) for a BERT-
    family encoder, else the decoder :class:`Engine` :func:`get_engine` gives (shared with chat requests)."""
    from parallm_engine.embed.encoder_engine import EncoderEngine, encoder_model_type

    if encoder_model_type(model) is None:
        return get_engine(model, **config)
    key = _key(model, {"encoder": True, **config})
    with _lock:
        eng = _engines.get(key)
        if eng is None or not eng.is_alive:
            eng = _engines[key] = EncoderEngine(model, **config)
        return eng


def peek(model: str | os.PathLike | None = None, **config) -> Engine | None:
    """The running engine :func:`get_engine` would return for this model and settings, or None when there
    is none (never created, or shut down). Creates and loads nothing."""
    with _lock:
        eng = _engines.get(_key(model, config))
    return eng if eng is not None and eng.is_alive else None


def shutdown_all() -> None:
    with _lock:
        engines = list(_engines.values())
        _engines.clear()
    for eng in engines:
        eng.shutdown()
