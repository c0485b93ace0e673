"""Errors of the ``base_url=`` client: an ``openai`` exception becomes the error the in-process engine raises
for the same problem (:mod:`parallm_integrations.errors`), the ``openai`` one chained as ``__cause__``."""

from __future__ import annotations

from typing import Any


def _error_fields(exc) -> tuple[str, str | None, str | None]:
    body = getattr(exc, "body", None)
    err = body.get("error", body) if isinstance(body, dict) else None
    if isinstance(err, dict):
        return str(err.get("message") or exc), err.get("param"), err.get("code")
    return str(getattr(exc, "message", None) or exc), None, getattr(exc, "code", None)


#: How servers word a prompt that does not fit: OpenAI / parallm serve's code, llama.cpp's error type
#: (400 ``exceed_context_size_error``: "the request exceeds the available context size"), vLLM's and
#: SGLang's messages ("This model's maximum context length is N tokens...", "... is longer than the model's
#: context length").
_CONTEXT_CODES = frozenset({"context_length_exceeded", "exceed_context_size_error"})
_CONTEXT_WORDS = ("context length", "context size", "context window", "maximum context")


def _is_context_overflow(exc: BaseException, message: str, code: Any) -> bool:
    body = getattr(exc, "body", None)
    err = body.get("error", body) if isinstance(body, dict) else {}
    kind = err.get("type") if isinstance(err, dict) else None
    kind = kind or getattr(exc, "type", None)
    if code in _CONTEXT_CODES or kind in _CONTEXT_CODES:
        return True
    return any(w in message.lower() for w in _CONTEXT_WORDS)


def _translate(exc: BaseException) -> BaseException:
    """An ``openai`` exception -> the error the in-process engine raises for the same problem."""
    import openai

    from .errors import (ContextLengthExceededError, InvalidRequestError, ModelLoadError, OutOfMemoryError,
                         QueueFullError)

    if isinstance(exc, openai.APITimeoutError):
        return TimeoutError(f"ParaLLM request to the server timed out ({exc})")
    if type(exc) is openai.APIConnectionError and getattr(exc, "request", None) is not None:
        # openai says only "Connection error.": say which server, and why (same type, so callers that
        # catch openai.APIConnectionError still do).
        request = exc.request
        url = request.url
        cause = exc.__cause__ or exc.__context__
        return openai.APIConnectionError(
            message=f"cannot reach the OpenAI-compatible server at {url}: {cause or exc} (is base_url right and "
            "the server running?)",
            request=request,
        )
    if isinstance(exc, openai.RateLimitError):
        retry = 1.0
        try:
            retry = float(exc.response.headers.get("retry-after", 1.0))
        except (TypeError, ValueError, AttributeError):
            pass
        return QueueFullError(_error_fields(exc)[0], retry_after=retry)
    if isinstance(exc, (openai.BadRequestError, openai.UnprocessableEntityError)):
        message, param, code = _error_fields(exc)
        if _is_context_overflow(exc, message, code):
            return ContextLengthExceededError(message, param=param)
        return InvalidRequestError(message, param=param)
    if isinstance(exc, openai.NotFoundError):
        message, param, code = _error_fields(exc)
        if code == "model_not_found" or param == "model" or "model" in message.lower():
            return ModelLoadError(message)
    if isinstance(exc, openai.APIStatusError) and _error_fields(exc)[2] == "out_of_memory":
        return OutOfMemoryError(_error_fields(exc)[0])
    if isinstance(exc, openai.APIError) and _error_fields(exc)[2] == "rank_lost":
        from .errors import RankLostError  # a distributed server's group broke (503, or a stream's error event)

        return RankLostError(_error_fields(exc)[0])
    if isinstance(exc, openai.APIError) and not isinstance(exc, openai.APIStatusError):
        # An error event inside a stream (``data: {"error": ...}``).
        message, param, code = _error_fields(exc)
        if _is_context_overflow(exc, message, code):
            return ContextLengthExceededError(message, param=param)
        if getattr(exc, "type", None) == "invalid_request_error":
            return InvalidRequestError(message, param=param)
    return exc


def _raise_mid_stream(exc: BaseException):
    """An error while a stream's chunks arrive. The connection dropping there (the server stopped or restarted)
    cannot be retried without repeating what was already delivered: a typed EngineDeadError, at once."""
    import httpx
    import openai

    lost = (isinstance(exc, httpx.TransportError) and not isinstance(exc, httpx.TimeoutException)) or (
        type(exc) is openai.APIConnectionError)
    if lost:
        from .errors import EngineDeadError

        raise EngineDeadError(f"the server closed the stream mid-answer (stopped or restarted?): "
                              f"{exc.__cause__ or exc!r}") from exc
    _raise(exc)


def _raise(exc: BaseException):
    new = _translate(exc)
    if new is exc:
        raise exc
    raise new from exc
