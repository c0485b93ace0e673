"""parallm_engine: one in-process continuous-batching MLX engine with radix prefix caching."""

from .backend import preload_blas as _preload_blas

_preload_blas()  # must happen before anything imports mlx.core

from .errors import (  # noqa: E402
    ContextLengthExceededError,
    EngineDeadError,
    GrammarError,
    InvalidRequestError,
    ModelLoadError,
    ParaLLMError,
    QueueFullError,
    RequestCancelledError,
)

__version__ = "0.1.0"

from .engine import Engine  # noqa: E402
from .registry import get_engine, shutdown_all  # noqa: E402
from .request import Choice, GenerationResult, RequestHandle, StreamDelta, TokenLogprob, Usage  # noqa: E402
from .sampling import SamplingParams  # noqa: E402

__all__ = [
    "Engine", "get_engine", "shutdown_all", "SamplingParams", "GenerationResult", "Choice", "StreamDelta",
    "TokenLogprob", "Usage", "RequestHandle", "ParaLLMError", "InvalidRequestError",
    "ContextLengthExceededError", "ModelLoadError", "QueueFullError", "RequestCancelledError",
    "GrammarError", "EngineDeadError",
]
