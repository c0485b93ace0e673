"""Typed errors. Every error a caller can cause is a subclass of :class:`ParaLLMError`, so one
``except ParaLLMError`` catches them all, and none of them stops the engine for other requests."""

from __future__ import annotations


class ParaLLMError(Exception):
    """Base class of every error raised by parallm_engine."""


class InvalidRequestError(ParaLLMError, ValueError):
    """A request argument is out of range or of the wrong type (HTTP 400)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ContextLengthExceededError(InvalidRequestError):
    """The prompt (plus max_tokens where it was given) does not fit the model's context window."""


class ModelLoadError(ParaLLMError):
    """The model path does not exist or cannot be loaded."""


class QueueFullError(ParaLLMError):
    """The engine's waiting queue is at its bound; retry later (HTTP 429)."""

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after


class RequestCancelledError(ParaLLMError):
    """The request was aborted before it finished (caller cancelled, iterator closed, timeout)."""


class GrammarError(InvalidRequestError):
    """A response_format / schema / regex the grammar engine rejects."""


class EngineDeadError(ParaLLMError):
    """The engine thread stopped (shut down or crashed); no new requests are accepted."""


class UnsupportedModelError(ModelLoadError):
    """The model loads, but the engine cannot run its family correctly (refused at load, never run wrong)."""


class ImageInputError(InvalidRequestError):
    """An image in the request cannot be used: undecodable or unsupported format, over the pixel limit, a
    remote URL without ``allow_remote_images``, or a model without a vision tower (HTTP 400)."""


class OutOfMemoryError(ParaLLMError):
    """The device ran out of memory for this request even with nothing else running beside it (HTTP 507).
    Other requests in flight are not failed by an allocation failure: they are preempted and resume."""


class UnsupportedGGUFArchitectureError(ModelLoadError):
    """A GGUF file whose ``general.architecture`` the GGUF loader cannot convert (names it and the supported ones)."""

    def __init__(self, architecture: str | None, supported: list[str], path=None):
        self.architecture = architecture
        self.supported = list(supported)
        where = f"{path}: " if path else ""
        super().__init__(
            f"{where}GGUF architecture {architecture!r} is not supported by ParaLLM's GGUF loader "
            f"(supported: {', '.join(self.supported)}); convert the original model with mlx_lm.convert "
            "and pass its directory instead"
        )
