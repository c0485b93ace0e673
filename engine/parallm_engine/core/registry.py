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

    return _shared(_key(model, config), lambda: Engine(model, **config))


def _shared(key, make):
    """The live engine registered under ``key``, or the one ``make()`` builds (registered for the next call)."""
    with _lock:
        eng = _engines.get(key)
        if eng is None or not eng.is_alive:
            eng = _engines[key] = make()
        return eng


def get_embedding_engine(model: str | os.PathLike | None = None, **config):
    """The process-wide engine that embeds with ``model``: an ``EncoderEngine`` (mlx-embeddings) for a BERT-
    family encoder, else the decoder :class:`Engine` :func:`get_engine` gives (shared with chat requests)."""
    from parallm_engine.embed.cross_encoder import cross_encoder_dir
    from parallm_engine.embed.encoder_engine import EncoderEngine, encoder_model_type
    from parallm_engine.errors import NotAnEmbeddingModelError

    if encoder_model_type(model) is None:
        return get_engine(model, **config)
    if cross_encoder_dir(model) is not None:  # a classification head, no pooling: get_rerank_engine runs it
        raise NotAnEmbeddingModelError(f"{model} is a cross-encoder: it scores (query, document) pairs "
                                       "(get_rerank_engine / ParaLLMRerank), it does not embed", param="model")
    return _shared(_key(model, {"encoder": True, **config}), lambda: EncoderEngine(model, **config))


def get_rerank_engine(model: str | os.PathLike | None = None, kind: str | None = None, **config):
    """The process-wide engine that reranks with ``model``: a ``CrossEncoderEngine`` for a cross-encoder (BERT /
    XLM-R ``*ForSequenceClassification``), else the decoder :class:`Engine` :func:`get_engine` gives (shared
    with chat requests) for a decoder reranker (Qwen3-Reranker). ``kind``: ``"cross-encoder"`` | ``"decoder"``
    where the model's files do not say. Anything else: NotARerankerError, before a weight is loaded."""
    from parallm_engine.embed.cross_encoder import CrossEncoderEngine, cross_encoder_dir
    from parallm_engine.embed.encoder_engine import encoder_model_type
    from parallm_engine.embed.rerank import check_kind, is_decoder_reranker, not_a_reranker
    from parallm_engine.models.loader import resolve_model

    check_kind(kind)
    if kind != "decoder" and cross_encoder_dir(model) is not None:
        return _shared(_key(model, {"cross_encoder": True, **config}), lambda: CrossEncoderEngine(model, **config))
    name = str(model) if model is not None else "the default model"
    if kind == "cross-encoder":
        raise not_a_reranker(name, "it has no sequence-classification head (config.json architectures)")
    if encoder_model_type(model) is not None:
        raise not_a_reranker(name, "an embedding encoder, without a classification head")
    if kind is None:
        import json

        path, shown = resolve_model(model)
        config_json = json.loads((path / "config.json").read_text())
        if not is_decoder_reranker(config_json, [shown, str(model or ""), path.name], path):
            raise not_a_reranker(shown, "a causal LM whose name and model card do not say reranker (pass "
                                 "kind='decoder' to score it with the Qwen3-Reranker prompt anyway)")
    return get_engine(model, **config)


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
