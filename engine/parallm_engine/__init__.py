"""parallm_engine: one in-process continuous-batching MLX engine with radix prefix caching.

Importing the package loads no MLX: the engine, the registry and the result types are imported on
first use (``from parallm_engine import get_engine`` imports them then). So the pure-Python modules
(``errors``, ``sampling_params``, ``chat_format``, ``logprobs``) can be imported where MLX is missing
or unwanted, e.g. by a ``base_url=`` client. The one thing done eagerly is the fast-BLAS preload, which
must come before anything imports ``mlx.core`` and loads only a shared library (see ``backend``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from parallm_engine.runner.backend import preload_blas as _preload_blas

_preload_blas()  # must happen before anything imports mlx.core

from parallm_engine.models.import_notices import drop_unactionable_notices as _drop_unactionable_notices  # noqa: E402

_drop_unactionable_notices()  # before anything imports transformers (its no-PyTorch notice)

from parallm_engine.errors import (  # noqa: E402  (plain Python: no MLX)
    AdapterLoadError,
    AdapterNotFoundError,
    ContextLengthExceededError,
    EngineDeadError,
    GrammarError,
    ImageInputError,
    InvalidRequestError,
    ModelLoadError,
    NotAnEmbeddingModelError,
    NotARerankerError,
    OutOfMemoryError,
    ParaLLMError,
    QueueFullError,
    RequestCancelledError,
    TokenizeError,
    UnsupportedGGUFArchitectureError,
    UnsupportedModelError,
)

__version__ = "0.1.0"

#: Public names imported on first access (these modules import MLX), and where each lives.
_LAZY = {
    "Engine": "core.engine",
    "get_engine": "core.registry",
    "get_embedding_engine": "core.registry",
    "get_rerank_engine": "core.registry",
    "CrossEncoderEngine": "embed.cross_encoder",
    "RerankResult": "embed.rerank",
    "shutdown_all": "core.registry",
    "EncoderEngine": "embed.encoder_engine",
    "EmbeddingResult": "embed.embedding",
    "EmbeddingHandle": "embed.embedding",
    "SamplingParams": "sampling.sampling_params",
    "Choice": "core.request",
    "GenerationResult": "core.request",
    "RequestHandle": "core.request",
    "StreamDelta": "core.request",
    "TokenLogprob": "core.request",
    "Usage": "core.request",
}

if TYPE_CHECKING:
    from parallm_engine.core.engine import Engine
    from parallm_engine.embed.embedding import EmbeddingHandle, EmbeddingResult
    from parallm_engine.embed.encoder_engine import EncoderEngine
    from parallm_engine.core.registry import get_embedding_engine, get_engine, get_rerank_engine, shutdown_all
    from parallm_engine.embed.cross_encoder import CrossEncoderEngine
    from parallm_engine.embed.rerank import RerankResult
    from parallm_engine.core.request import Choice, GenerationResult, RequestHandle, StreamDelta, TokenLogprob, Usage
    from parallm_engine.sampling.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from parallm_engine.models.mlx_install import require_backend_library

    require_backend_library()  # a typed error, not a linker error, where no MLX backend is installed
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "Engine", "get_engine", "shutdown_all", "SamplingParams", "GenerationResult", "Choice", "StreamDelta",
    "TokenLogprob", "Usage", "RequestHandle", "ParaLLMError", "InvalidRequestError",
    "ContextLengthExceededError", "ModelLoadError", "QueueFullError", "RequestCancelledError",
    "GrammarError", "EngineDeadError", "UnsupportedModelError", "ImageInputError", "OutOfMemoryError",
    "get_embedding_engine", "EncoderEngine", "EmbeddingResult", "EmbeddingHandle", "NotAnEmbeddingModelError",
    "AdapterLoadError", "AdapterNotFoundError",
    "get_rerank_engine", "CrossEncoderEngine", "RerankResult", "NotARerankerError",
    "TokenizeError",
    "UnsupportedGGUFArchitectureError",
]
