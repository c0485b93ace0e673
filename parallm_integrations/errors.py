"""ParaLLM's typed errors, importable whether or not the in-process engine is installed.

With the engine installed these ARE ``parallm_engine.errors``' classes (a plain-Python module: importing
it loads no MLX), so ``except parallm_engine.InvalidRequestError`` catches an error from the in-process
engine and from a server (``base_url=``) alike. Without it (``pip install parallm-integrations``, the
``engine`` extra left out, for ``base_url=`` only) the same hierarchy is defined here; the test suite
checks the two match (``tests/test_remote_without_mlx.py``).

:class:`EngineNotInstalledError` is the one error of this package's own: an in-process model was asked for
where the engine (``parallm-engine``, with MLX) cannot be imported.

This module is imported only when one of its errors is raised or caught by name: importing
``parallm_integrations`` does not import it (nor anything of ``parallm_engine``).
"""

from __future__ import annotations

try:
    from parallm_engine.errors import (
        AdapterLoadError,
        AdapterNotFoundError,
        ContextLengthExceededError,
        DistributedError,
        EngineDeadError,
        GatedModelError,
        GrammarError,
        ImageInputError,
        InvalidRequestError,
        ModelDownloadError,
        ModelLoadError,
        ModelNotCachedError,
        ModelNotFoundError,
        NotAnEmbeddingModelError,
        NotARerankerError,
        OutOfMemoryError,
        ParaLLMError,
        QueueFullError,
        RankLostError,
        RequestCancelledError,
        TokenizeError,
        UnsupportedArchitectureError,
        UnsupportedGGUFArchitectureError,
        UnsupportedModelError,
    )
except ImportError:  # the engine is not installed: the same classes, for the base_url= path

    class ParaLLMError(Exception):  # type: ignore[no-redef]
        """Base class of every error raised by parallm_engine."""

    class InvalidRequestError(ParaLLMError, ValueError):  # type: ignore[no-redef]
        """A request argument is out of range or of the wrong type (HTTP 400)."""

        def __init__(self, message: str, param: str | None = None):
            super().__init__(message)
            self.param = param

    class ContextLengthExceededError(InvalidRequestError):  # type: ignore[no-redef]
        """The prompt (plus max_tokens where it was given) does not fit the model's context window."""

    class ModelLoadError(ParaLLMError):  # type: ignore[no-redef]
        """The model path does not exist or cannot be loaded."""

    class QueueFullError(ParaLLMError):  # type: ignore[no-redef]
        """The engine's waiting queue is at its bound; retry later (HTTP 429)."""

        def __init__(self, message: str, retry_after: float = 1.0):
            super().__init__(message)
            self.retry_after = retry_after

    class RequestCancelledError(ParaLLMError):  # type: ignore[no-redef]
        """The request was aborted before it finished (caller cancelled, iterator closed, timeout)."""

    class GrammarError(InvalidRequestError):  # type: ignore[no-redef]
        """A response_format / schema / regex the grammar engine rejects."""

    class EngineDeadError(ParaLLMError):  # type: ignore[no-redef]
        """The engine thread stopped (shut down or crashed); no new requests are accepted."""

    class RankLostError(EngineDeadError):  # type: ignore[no-redef]
        """A rank of a distributed engine died, hung or lost its link (HTTP 503); ``rank``: which, where known."""

        def __init__(self, message: str, rank: int | None = None):
            super().__init__(message)
            self.rank = rank

    class DistributedError(ParaLLMError):  # type: ignore[no-redef]
        """The distributed mode cannot run as asked (``supported``: the modes that can)."""

        def __init__(self, message: str, supported: list[str] | None = None):
            super().__init__(message)
            self.supported = list(supported or [])

    class UnsupportedModelError(ModelLoadError):  # type: ignore[no-redef]
        """The model loads, but the engine cannot run its family correctly (refused at load, never run wrong)."""

    class ImageInputError(InvalidRequestError):  # type: ignore[no-redef]
        """An image in the request cannot be used (undecodable, unsupported, too large, remote without
        opt-in, or a model without vision) (HTTP 400)."""

    class NotAnEmbeddingModelError(InvalidRequestError):  # type: ignore[no-redef]
        """Embeddings were asked of a model that has no embedding configuration (HTTP 400)."""

    class NotARerankerError(InvalidRequestError):  # type: ignore[no-redef]
        """Reranking was asked of a model that is neither a cross-encoder nor a decoder reranker (HTTP 400)."""

    class OutOfMemoryError(ParaLLMError):  # type: ignore[no-redef]
        """The device ran out of memory for this request even with nothing else running beside it (HTTP 507)."""

    class AdapterLoadError(InvalidRequestError):  # type: ignore[no-redef]
        """A LoRA adapter cannot be used with the model (no config, unmapped format, another base) (HTTP 400)."""

    class AdapterNotFoundError(AdapterLoadError):  # type: ignore[no-redef]
        """The adapter name is not registered and is not an adapter directory (HTTP 404)."""

    class TokenizeError(ParaLLMError):  # type: ignore[no-redef]
        """A server's tokenizer endpoint gave no usable answer (no tokens for non-empty text)."""

    class ModelNotFoundError(ModelLoadError):  # type: ignore[no-redef]
        """The hub has no such repository (or revision), or it is private and no token with access was given."""

    class GatedModelError(ModelLoadError):  # type: ignore[no-redef]
        """The repository is gated: accept its terms on its hub page and give a token (``HF_TOKEN``)."""

    class ModelNotCachedError(ModelLoadError):  # type: ignore[no-redef]
        """Offline and the model is not in the local cache."""

    class ModelDownloadError(ModelLoadError):  # type: ignore[no-redef]
        """A download stopped part-way; nothing partial is loaded."""

    class UnsupportedArchitectureError(UnsupportedModelError):  # type: ignore[no-redef]
        """The repository is not a model mlx-lm or mlx-vlm can run (``architecture`` says what it is)."""

        def __init__(self, message: str, architecture: str | None = None):
            super().__init__(message)
            self.architecture = architecture

    class UnsupportedGGUFArchitectureError(ModelLoadError):  # type: ignore[no-redef]
        """A GGUF file whose architecture the GGUF loader cannot convert."""

        def __init__(self, architecture: str | None, supported: list[str], path=None):
            self.architecture, self.supported = architecture, list(supported)
            super().__init__(f"{f'{path}: ' if path else ''}GGUF architecture {architecture!r} is not supported "
                             f"(supported: {', '.join(self.supported)})")


#: The modules whose absence means "the engine is not installed" (not, say, a model family mlx-lm lacks).
ENGINE_MODULES = frozenset({"parallm_engine", "mlx", "mlx.core", "mlx.nn", "mlx_lm"})


class EngineNotInstalledError(ImportError):
    """An in-process model was asked for, but the engine cannot be imported here."""

    def __init__(self, what: str, missing: str | None = None):
        super().__init__(
            f"{what} runs the model in-process on the ParaLLM engine, which is not installed here"
            f"{f' (no module named {missing!r})' if missing else ''}. Install it with "
            "`pip install 'parallm-integrations[engine]'` (on Linux with MLX's backend: `[engine,cpu]`, or "
            "`[engine,cuda13]` / `[engine,cuda12]` for NVIDIA GPUs), or pass base_url= to use a ParaLLM / "
            "OpenAI-compatible server (`parallm serve`, vLLM, SGLang) instead.",
            name=missing,
        )


__all__ = [
    "AdapterLoadError", "AdapterNotFoundError", "ContextLengthExceededError", "EngineDeadError",
    "EngineNotInstalledError", "GrammarError", "InvalidRequestError", "ModelLoadError", "NotAnEmbeddingModelError",
    "NotARerankerError", "ParaLLMError", "QueueFullError", "RequestCancelledError", "TokenizeError",
    "UnsupportedModelError",
    "GatedModelError", "ModelDownloadError", "ModelNotCachedError", "ModelNotFoundError",
    "UnsupportedArchitectureError", "UnsupportedGGUFArchitectureError", "DistributedError", "RankLostError",
]
