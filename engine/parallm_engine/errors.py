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


class RankLostError(EngineDeadError):
    """A rank of a distributed engine died, hung or lost its link (HTTP 503): every request in flight and
    queued ends with it, and the engine takes no more. ``rank`` is the rank that was lost, where known."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank


class DistributedError(ParaLLMError):
    """The distributed mode cannot run as asked: not started under ``mlx.launch``, an unknown mode, a family
    that mode cannot split (``supported`` names the modes that can), or a feature the mode does not support."""

    def __init__(self, message: str, supported: list[str] | None = None):
        super().__init__(message)
        self.supported = list(supported or [])


class UnsupportedModelError(ModelLoadError):
    """The model loads, but the engine cannot run its family correctly (refused at load, never run wrong)."""


class ImageInputError(InvalidRequestError):
    """An image in the request cannot be used: undecodable or unsupported format, over the pixel limit, a
    remote URL without ``allow_remote_images``, or a model without a vision tower (HTTP 400)."""


class OutOfMemoryError(ParaLLMError):
    """The device ran out of memory for this request even with nothing else running beside it (HTTP 507).
    Other requests in flight are not failed by an allocation failure: they are preempted and resume."""


class NotAnEmbeddingModelError(InvalidRequestError):
    """Embeddings were asked of a model that has no embedding configuration (a chat model without
    sentence-transformers files and no ``pooling=``), or whose family cannot give hidden states (HTTP 400).
    The message says which models work (``embedding_config.WHICH_MODELS_WORK``)."""


class NotARerankerError(InvalidRequestError):
    """Reranking was asked of a model that is neither a cross-encoder (a BERT / XLM-R
    ``*ForSequenceClassification`` with one relevance logit) nor a decoder reranker (Qwen3-Reranker), and no
    ``kind=`` names one (HTTP 400). The message says which models work (``embed.rerank.WHICH_RERANKERS_WORK``)."""


class AdapterLoadError(InvalidRequestError):
    """A LoRA adapter cannot be used with this engine's model: no ``adapter_config.json``, a format or option
    the engine does not map, or weights shaped for another base model (refused at load; HTTP 400)."""

    def __init__(self, message: str, param: str | None = "adapter"):
        super().__init__(message, param=param)


class AdapterNotFoundError(AdapterLoadError):
    """The adapter name is not registered and is not an adapter directory or a cached HF repo id (HTTP 404)."""


# -- models by name (hub.py): each a ModelLoadError, so ``except ModelLoadError`` still catches them all --


class ModelNotFoundError(ModelLoadError):
    """The hub has no such repository (or revision), or it is private and no token with access was given."""


class GatedModelError(ModelLoadError):
    """The repository is gated: accept its terms on its hub page and give a token (``HF_TOKEN``)."""


class ModelNotCachedError(ModelLoadError):
    """Offline (``HF_HUB_OFFLINE=1``, or the hub cannot be reached) and the model is not in the local cache."""


class ModelDownloadError(ModelLoadError):
    """A download stopped part-way (connection lost, disk full). Nothing partial is loaded; running the same
    call again finishes it (the files that arrived whole are kept)."""


class UnsupportedArchitectureError(UnsupportedModelError):
    """The repository is not a model mlx-lm or mlx-vlm can run (``architecture`` says what it is)."""

    def __init__(self, message: str, architecture: str | None = None):
        super().__init__(message)
        self.architecture = architecture


class TokenizeError(ParaLLMError):
    """A server's tokenizer endpoint gave no usable answer (no tokens for non-empty text: a body shape it
    does not read), so no token count can be given; never reported as 0 tokens."""


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
