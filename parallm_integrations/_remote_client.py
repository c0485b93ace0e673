"""The engine-shaped OpenAI-compatible client behind ``base_url=`` (see ``_remote`` for the
interface, the result shapes and the LangChain adapters built on it).

Imports nothing of ``parallm_engine`` and nothing of MLX: ``pip install parallm-integrations`` without the
``engine`` extra runs it. Its result types carry the engine's field names (``GenerationResult`` /
``Choice`` / ``StreamDelta`` / ``Usage`` / ``chat_format.ToolCall`` / ``ToolCallDelta``), so code reads a
result the same whichever path made it; ``logprobs`` is the server's OpenAI chat ``logprobs`` dict,
passed on as the server formatted it (``parallm serve`` with the engine's one formatter,
``parallm_engine.logprobs``). Errors the server reports are :mod:`parallm_integrations.errors`, which
are the engine's own classes when the engine is installed.
"""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request
import weakref
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

DEFAULT_MODEL_ALIASES = ("", "default", "SmolLM2-135M-Instruct")

#: Request fields the OpenAI API has for each endpoint; everything else goes in ``extra_body``.
_CHAT_FIELDS = frozenset({
    "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stop", "seed",
    "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "tools", "tool_choice",
    "parallel_tool_calls", "response_format", "user", "metadata",
})
_COMPLETION_FIELDS = frozenset({
    "model", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "presence_penalty", "frequency_penalty",
    "logit_bias", "logprobs", "echo", "user", "best_of", "suffix",
})


# ----------------------------------------------------------------------------------------------
# Result types (the engine's field names; tests/test_remote.py checks they cover the engine's)
# ----------------------------------------------------------------------------------------------


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the server served from its prefix cache (0 when it does not say)
    spec_proposed_tokens: int = 0  # speculative decoding (ParaLLM's ``usage.speculative`` extension)
    spec_accepted_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class RemoteToolCall:
    """A tool call as the server parsed it (``chat_format.ToolCall``'s fields, plus what was sent)."""

    id: str
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)  # {} when raw_arguments is not a JSON object
    raw_arguments: str | None = None  # the argument text as the server sent it
    error: str | None = None  # set when raw_arguments is not a JSON object


@dataclass
class RemoteToolCallDelta:
    """A piece of a streamed tool call (``chat_format.ToolCallDelta``'s fields)."""

    index: int
    id: str | None = None  # set on a call's first delta, with the name
    name: str | None = None
    arguments_delta: str = ""


@dataclass
class RemoteText:
    """A content piece of a server's stream (``chat_format.ContentDelta``'s field)."""

    text: str


@dataclass
class RemoteReasoning:
    """A reasoning piece of a server's stream (``chat_format.ReasoningDelta``'s field)."""

    reasoning: str


@dataclass
class RemoteFinish:
    """A choice's end in a server's stream (``typed_output.Finish``'s ``reason``)."""

    reason: str


@dataclass
class RemoteChoice:
    index: int
    text: str
    finish_reason: str | None
    logprobs: dict | None = None  # OpenAI's chat logprobs {"content": [...]}, as the server sent it
    content: str | None = None  # = text: a server sends content without tool-call markup
    tool_calls: list[RemoteToolCall] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # servers send text only
    stop_reason: str | int | None = None
    reasoning: str | None = None  # the server's reasoning_content (vLLM / DeepSeek / parallm serve)
    incomplete: bool = False


@dataclass
class RemoteResult:
    """A finished request (``GenerationResult``'s fields; ``text`` etc. are the first choice's), plus
    ``model``, the name the server answered with."""

    request_id: str
    choices: list[RemoteChoice]
    usage: Usage = field(default_factory=Usage)
    model: str | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    system_fingerprint: str | None = None  # as the server sent it (None when it did not)

    @property
    def text(self) -> str:
        return self.choices[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.choices[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.choices[0].finish_reason

    @property
    def logprobs(self) -> dict | None:
        return self.choices[0].logprobs

    @property
    def tool_calls(self) -> list[RemoteToolCall]:
        return self.choices[0].tool_calls

    @property
    def content(self) -> str | None:
        return self.choices[0].content


@dataclass
class RemoteDelta:
    """One increment of one choice (``StreamDelta``'s fields) plus ``tool_calls`` pieces and ``model``."""

    request_id: str
    index: int
    text: str
    finish_reason: str | None = None
    usage: Usage | None = None
    logprobs: dict | None = None  # OpenAI's chat logprobs for this delta's tokens
    tool_calls: list[RemoteToolCallDelta] = field(default_factory=list)
    model: str | None = None  # the model name the server answered with
    reasoning: str | None = None  # a piece of the server's reasoning_content (never part of ``text``)
    token_ids: list[int] = field(default_factory=list)
    stop_reason: str | int | None = None
    error: BaseException | None = None
    system_fingerprint: str | None = None  # as the server sent it on the stream's chunks
    # The delta as typed pieces in the engine's order (``StreamDelta.pieces``): RemoteReasoning,
    # RemoteToolCallDelta, RemoteText, RemoteFinish; the same information as the fields above.
    pieces: list = field(default_factory=list)


def _usage(u) -> Usage | None:
    if u is None:
        return None
    details = getattr(u, "prompt_tokens_details", None)
    cached = getattr(details, "cached_tokens", None) if details is not None else None
    spec = getattr(u, "speculative", None) or {}  # openai's types keep unknown fields as attributes
    if not isinstance(spec, dict):
        spec = getattr(spec, "__dict__", {}) or {}
    return Usage(prompt_tokens=int(u.prompt_tokens or 0), completion_tokens=int(u.completion_tokens or 0),
                 cached_tokens=int(cached or 0), spec_proposed_tokens=int(spec.get("proposed_tokens") or 0),
                 spec_accepted_tokens=int(spec.get("accepted_tokens") or 0))


#: The error of a call a server sent with finish_reason "length" whose arguments are not whole (as
#: ``parallm_engine.typed_output.TRUNCATED_CALL`` says it in-process).
TRUNCATED_CALL = "the tool call was cut off by max_tokens (finish_reason 'length') before it was complete"


def _tool_call(tc, truncated: bool = False) -> RemoteToolCall:
    """A call of a server's message; ``truncated``: the last call of a message cut off by max_tokens."""
    fn = tc.function
    raw = fn.arguments if fn is not None else ""
    args: dict = {}
    error = None
    if truncated and not (raw or "").strip():
        return RemoteToolCall(id=tc.id or "", name=(fn.name if fn is not None else "") or "", arguments={},
                              raw_arguments=raw, error=TRUNCATED_CALL)
    try:
        parsed = json.loads(raw) if raw else {}
        if isinstance(parsed, dict):
            args = parsed
        else:
            error = "arguments are not a JSON object"
    except (json.JSONDecodeError, TypeError) as exc:
        error = TRUNCATED_CALL if truncated else f"arguments are not valid JSON: {exc}"
    return RemoteToolCall(id=tc.id or "", name=(fn.name if fn is not None else "") or "", arguments=args,
                          raw_arguments=raw, error=error)


def _chat_logprobs(lp) -> dict | None:
    """The server's chat ``logprobs``, as it sent them (OpenAI's shape)."""
    content = getattr(lp, "content", None) if lp is not None else None
    if not content:
        return None
    return {"content": [t.model_dump() for t in content]}


def _completion_logprobs(lp) -> dict | None:
    """A completions response's ``logprobs`` (tokens / token_logprobs / top_logprobs lists), in the chat
    shape every ParaLLM class reports (values as the server sent them)."""
    if lp is None or not lp.tokens:
        return None
    tops = lp.top_logprobs or [None] * len(lp.tokens)
    values = lp.token_logprobs or [None] * len(lp.tokens)
    return {"content": [
        {"token": tok, "logprob": val, "bytes": list(tok.encode("utf-8")),
         "top_logprobs": [{"token": k, "logprob": v, "bytes": list(k.encode("utf-8"))} for k, v in (top or {}).items()]}
        for tok, val, top in zip(lp.tokens, values, tops)
    ]}


def _reasoning(message) -> str | None:
    """A message's or delta's reasoning text: ``reasoning_content`` (vLLM, DeepSeek, ``parallm serve``) or
    ``reasoning`` (newer vLLM); openai's types keep such extra fields as attributes."""
    if message is None:
        return None
    return getattr(message, "reasoning_content", None) or getattr(message, "reasoning", None) or None


def _chat_result(resp) -> RemoteResult:
    choices = []
    for ch in sorted(resp.choices, key=lambda c: c.index):
        msg = ch.message
        content = msg.content or ""
        calls = list(msg.tool_calls or [])
        cut = ch.finish_reason == "length"
        choices.append(RemoteChoice(index=ch.index, text=content, finish_reason=ch.finish_reason,
                                    logprobs=_chat_logprobs(ch.logprobs), content=content,
                                    tool_calls=[_tool_call(tc, cut and i == len(calls) - 1)
                                                for i, tc in enumerate(calls)],
                                    reasoning=_reasoning(msg)))
    return RemoteResult(request_id=resp.id, choices=choices, usage=_usage(resp.usage) or Usage(), model=resp.model,
                        system_fingerprint=getattr(resp, "system_fingerprint", None) or None)


def _completion_results(resp, n_prompts: int, n: int) -> list[RemoteResult]:
    """One HTTP response for many prompts -> one result per prompt (choice i*n + j is prompt i's j-th)."""
    groups: list[list[RemoteChoice]] = [[] for _ in range(n_prompts)]
    for ch in sorted(resp.choices, key=lambda c: c.index):
        p, j = divmod(ch.index, n)
        if p < n_prompts:
            groups[p].append(RemoteChoice(index=j, text=ch.text, finish_reason=ch.finish_reason,
                                          logprobs=_completion_logprobs(ch.logprobs), content=ch.text))
    usage = _usage(resp.usage) or Usage()
    results = []
    for i, choices in enumerate(groups):
        # The server reports usage for the whole call: it goes on the first result, so sums stay right.
        results.append(RemoteResult(request_id=f"{resp.id}-{i}", choices=choices,
                                    usage=usage if i == 0 else Usage(), model=resp.model))
    return results


# ----------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------


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


# ----------------------------------------------------------------------------------------------
# Request bodies
# ----------------------------------------------------------------------------------------------


def _split(body: dict[str, Any], allowed: frozenset[str]) -> dict[str, Any]:
    """OpenAI fields as keyword arguments; the rest in ``extra_body``; None values dropped."""
    kwargs: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for key, value in body.items():
        if value is None:
            continue
        (kwargs if key in allowed else extra)[key] = value
    if "logit_bias" in kwargs:
        kwargs["logit_bias"] = {str(k): v for k, v in kwargs["logit_bias"].items()}
    if extra:
        kwargs["extra_body"] = extra
    return kwargs


def _chat_kwargs(messages: list[dict], model: str, tools, tool_choice, response_format, parallel_tool_calls,
                 sampling: dict[str, Any]) -> dict[str, Any]:
    body = dict(sampling)
    if body.get("top_logprobs") and not body.get("logprobs"):
        body["logprobs"] = True
    if isinstance(body.get("stop"), str):
        body["stop"] = [body["stop"]]
    if tools:
        body["tools"] = list(tools)
        if tool_choice is not None:
            body["tool_choice"] = "required" if tool_choice in ("any", True) else tool_choice
        if parallel_tool_calls is not None:
            body["parallel_tool_calls"] = parallel_tool_calls
    if response_format is not None:
        body["response_format"] = response_format
    kwargs = _split(body, _CHAT_FIELDS)
    kwargs["model"] = model
    kwargs["messages"] = messages
    return kwargs


#: Most sequences (prompts x n) one completions request carries: ``parallm serve`` refuses a request over
#: a quarter of its queue (256 of the default 1,024) with 400 ``too_many_sequences``, and vLLM's server
#: has no such cap; larger batches go as several concurrent requests.
MAX_SEQUENCES_PER_REQUEST = 64


def _prompt_chunks(prompts: list[str], n: int) -> list[list[str]]:
    size = max(1, MAX_SEQUENCES_PER_REQUEST // max(1, n))
    return [prompts[i : i + size] for i in range(0, len(prompts), size)]


def _completion_kwargs(prompt, model: str, response_format, sampling: dict[str, Any]) -> dict[str, Any]:
    body = dict(sampling)
    want = body.pop("logprobs", None)
    top = body.pop("top_logprobs", None)
    if want or top:
        body["logprobs"] = int(top or 0)  # the completions API takes the number of alternatives
    if isinstance(body.get("stop"), str):
        body["stop"] = [body["stop"]]
    if response_format is not None:
        body["response_format"] = response_format  # ParaLLM / vLLM extension: goes in extra_body
    kwargs = _split(body, _COMPLETION_FIELDS)
    kwargs["model"] = model
    kwargs["prompt"] = prompt
    return kwargs


# ----------------------------------------------------------------------------------------------
# The client
# ----------------------------------------------------------------------------------------------


class _StreamState:
    """Re-times an OpenAI chunk stream into engine-style deltas: ``usage`` (a chunk of its own at the
    end of an OpenAI stream, or, from servers that report it continuously, on every chunk) goes onto
    the request's very last delta, the last one that carries a ``finish_reason``."""

    def __init__(self) -> None:
        self.pending: RemoteDelta | None = None
        self.model: str | None = None
        self.usage: Usage | None = None
        self.request_id = ""

    def feed(self, chunk, completion: bool) -> list[RemoteDelta]:
        self.model = getattr(chunk, "model", None) or self.model
        self.request_id = getattr(chunk, "id", None) or self.request_id
        self.fingerprint = getattr(chunk, "system_fingerprint", None) or getattr(self, "fingerprint", None)
        usage = _usage(getattr(chunk, "usage", None))
        if usage is not None:
            self.usage = usage
        out: list[RemoteDelta] = []
        for ch in chunk.choices or []:
            if completion:
                delta = RemoteDelta(chunk.id, ch.index, ch.text or "", finish_reason=ch.finish_reason,
                                    logprobs=_completion_logprobs(ch.logprobs))
            else:
                d = ch.delta
                calls = []
                for tc in (getattr(d, "tool_calls", None) or []):
                    fn = tc.function
                    calls.append(RemoteToolCallDelta(tc.index, tc.id or None, (fn.name if fn else None) or None,
                                                     (fn.arguments if fn else "") or ""))
                delta = RemoteDelta(chunk.id, ch.index, (d.content if d is not None else None) or "",
                                    finish_reason=ch.finish_reason, logprobs=_chat_logprobs(ch.logprobs),
                                    tool_calls=calls, reasoning=_reasoning(d))
            if not (delta.text or delta.tool_calls or delta.logprobs or delta.finish_reason or delta.reasoning):
                continue  # e.g. the role-only first chunk
            delta.pieces = [*([RemoteReasoning(delta.reasoning)] if delta.reasoning else []), *delta.tool_calls,
                            *([RemoteText(delta.text)] if delta.text else []),
                            *([RemoteFinish(delta.finish_reason)] if delta.finish_reason else [])]
            delta.model = self.model
            delta.system_fingerprint = self.fingerprint
            if self.pending is not None:
                out.append(self.pending)
                self.pending = None
            if delta.finish_reason is not None:
                self.pending = delta  # maybe the last one: usage may still come
            else:
                out.append(delta)
        return out

    def flush(self) -> list[RemoteDelta]:
        """At the end of the stream."""
        last, self.pending = self.pending, None
        if last is not None:
            last.usage = self.usage
            return [last]
        if self.usage is not None:
            return [RemoteDelta(self.request_id, 0, "", usage=self.usage, model=self.model)]
        return []


class RemoteClient:
    """An OpenAI-compatible server, with the engine's call shapes (see the module docstring)."""

    def __init__(self, base_url: str, api_key: str | None = None, *, max_retries: int = 2,
                 default_headers: dict[str, str] | None = None):
        if not base_url:
            raise ValueError("base_url must be given")
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key or "EMPTY"
        self.max_retries = 2 if max_retries is None else int(max_retries)
        self.default_headers = dict(default_headers or {})
        self._sync = None
        self._async: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Any]" = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()
        self._models: list[str] | None = None
        self._context: dict[str, Any] = {}

    # -- openai clients ------------------------------------------------------------------------------
    @property
    def sync_client(self):
        if self._sync is None:
            import openai

            with self._lock:
                if self._sync is None:
                    self._sync = openai.OpenAI(base_url=self.base_url, api_key=self.api_key,
                                               max_retries=self.max_retries, default_headers=self.default_headers)
        return self._sync

    @property
    def async_client(self):
        """The ``AsyncOpenAI`` client of the running event loop (its connection pool belongs to one loop,
        and LlamaIndex may run a second loop in a helper thread)."""
        import openai

        loop = asyncio.get_running_loop()
        with self._lock:
            client = self._async.get(loop)
            if client is None:
                client = openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key,
                                            max_retries=self.max_retries, default_headers=self.default_headers)
                self._async[loop] = client
        return client

    # -- models ----------------------------------------------------------------------------------------
    def models(self) -> list[str]:
        """Model ids the server serves (``GET /v1/models``, asked once)."""
        if self._models is None:
            try:
                self._remember([m for m in self.sync_client.models.list()])
            except Exception as exc:
                _raise(exc)
        return list(self._models or [])

    async def amodels(self) -> list[str]:
        if self._models is None:
            try:
                self._remember([m async for m in self.async_client.models.list()])
            except Exception as exc:
                _raise(exc)
        return list(self._models or [])

    def _remember(self, cards: list) -> None:
        self._context = {m.id: getattr(m, "max_model_len", None) for m in cards}
        self._models = [m.id for m in cards]

    def context_window(self, model: str | None = None) -> int | None:
        """The served model's context window, from ``max_model_len`` on ``/v1/models`` (``parallm
        serve`` and vLLM report it); None when the server does not say."""
        name = self.resolve_model(model)
        try:
            self.models()
        except Exception:  # a server without /v1/models
            return None
        value = self._context.get(name)
        return int(value) if isinstance(value, (int, float)) else None

    def _pick(self, model: str | None, served: list[str] | None) -> str:
        if model is not None and str(model) not in DEFAULT_MODEL_ALIASES:
            return str(model)
        if served:
            return str(model) if model and str(model) in served else served[0]
        return str(model or DEFAULT_MODEL_ALIASES[-1])

    def resolve_model(self, model: str | None) -> str:
        if model is not None and str(model) not in DEFAULT_MODEL_ALIASES:
            return str(model)
        try:
            served = self.models()
        except Exception:  # a server without /v1/models: send the name as it is
            served = None
        return self._pick(model, served)

    async def aresolve_model(self, model: str | None) -> str:
        if model is not None and str(model) not in DEFAULT_MODEL_ALIASES:
            return str(model)
        try:
            served = await self.amodels()
        except Exception:
            served = None
        return self._pick(model, served)

    # -- chat ------------------------------------------------------------------------------------------
    def chat(self, messages: list[dict], *, model: str | None = None, tools=None, tool_choice=None,
             response_format=None, parallel_tool_calls=None, timeout: float | None = None,
             **sampling: Any) -> RemoteResult:
        kwargs = _chat_kwargs(messages, self.resolve_model(model), tools, tool_choice, response_format,
                              parallel_tool_calls, sampling)
        try:
            resp = self.sync_client.chat.completions.create(**kwargs, **_timeout(timeout))
        except Exception as exc:
            _raise(exc)
        return _chat_result(resp)

    async def achat(self, messages: list[dict], *, model: str | None = None, tools=None, tool_choice=None,
                    response_format=None, parallel_tool_calls=None, timeout: float | None = None,
                    **sampling: Any) -> RemoteResult:
        kwargs = _chat_kwargs(messages, await self.aresolve_model(model), tools, tool_choice, response_format,
                              parallel_tool_calls, sampling)
        try:
            resp = await self.async_client.chat.completions.create(**kwargs, **_timeout(timeout))
        except Exception as exc:
            _raise(exc)
        return _chat_result(resp)

    def chat_stream(self, messages: list[dict], *, model: str | None = None, tools=None, tool_choice=None,
                    response_format=None, parallel_tool_calls=None, timeout: float | None = None,
                    **sampling: Any) -> Iterator[RemoteDelta]:
        kwargs = _chat_kwargs(messages, self.resolve_model(model), tools, tool_choice, response_format,
                              parallel_tool_calls, sampling)
        return self._stream(self.sync_client.chat.completions.create, kwargs, timeout, completion=False)

    def achat_stream(self, messages: list[dict], *, model: str | None = None, tools=None, tool_choice=None,
                     response_format=None, parallel_tool_calls=None, timeout: float | None = None,
                     **sampling: Any) -> AsyncIterator[RemoteDelta]:
        async def gen():
            kwargs = _chat_kwargs(messages, await self.aresolve_model(model), tools, tool_choice, response_format,
                                  parallel_tool_calls, sampling)
            async for d in self._astream(self.async_client.chat.completions.create, kwargs, timeout, False):
                yield d

        return gen()

    # -- text completions ------------------------------------------------------------------------------
    def generate(self, prompts: str | list[str], *, model: str | None = None, response_format=None,
                 timeout: float | None = None, **sampling: Any) -> list[RemoteResult]:
        """All prompts at once: in requests of at most :data:`MAX_SEQUENCES_PER_REQUEST` sequences
        (a server caps one request's share of its queue), sent concurrently; results in input order."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if not prompts:
            return []
        n = int(sampling.get("n") or 1)
        model_name = self.resolve_model(model)

        def one(chunk: list[str]) -> list[RemoteResult]:
            kwargs = _completion_kwargs(chunk, model_name, response_format, sampling)
            try:
                resp = self.sync_client.completions.create(**kwargs, **_timeout(timeout))
            except Exception as exc:
                _raise(exc)
            return _completion_results(resp, len(chunk), n)

        chunks = _prompt_chunks(prompts, n)
        if len(chunks) == 1:
            return one(chunks[0])
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=min(len(chunks), 16)) as pool:
            return [r for part in pool.map(one, chunks) for r in part]

    async def agenerate(self, prompts: str | list[str], *, model: str | None = None, response_format=None,
                        timeout: float | None = None, **sampling: Any) -> list[RemoteResult]:
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if not prompts:
            return []
        n = int(sampling.get("n") or 1)
        model_name = await self.aresolve_model(model)

        async def one(chunk: list[str]) -> list[RemoteResult]:
            kwargs = _completion_kwargs(chunk, model_name, response_format, sampling)
            try:
                resp = await self.async_client.completions.create(**kwargs, **_timeout(timeout))
            except Exception as exc:
                _raise(exc)
            return _completion_results(resp, len(chunk), n)

        parts = await asyncio.gather(*(one(c) for c in _prompt_chunks(prompts, n)))
        return [r for part in parts for r in part]

    def stream(self, prompt: str, *, model: str | None = None, response_format=None, timeout: float | None = None,
               **sampling: Any) -> Iterator[RemoteDelta]:
        kwargs = _completion_kwargs(prompt, self.resolve_model(model), response_format, sampling)
        return self._stream(self.sync_client.completions.create, kwargs, timeout, completion=True)

    def astream(self, prompt: str, *, model: str | None = None, response_format=None, timeout: float | None = None,
                **sampling: Any) -> AsyncIterator[RemoteDelta]:
        async def gen():
            kwargs = _completion_kwargs(prompt, await self.aresolve_model(model), response_format, sampling)
            async for d in self._astream(self.async_client.completions.create, kwargs, timeout, True):
                yield d

        return gen()

    # -- streaming plumbing ----------------------------------------------------------------------------
    def _stream(self, create, kwargs: dict, timeout, completion: bool) -> Iterator[RemoteDelta]:
        state = _StreamState()
        try:
            stream = create(**kwargs, stream=True, stream_options={"include_usage": True}, **_timeout(timeout))
        except Exception as exc:
            _raise(exc)
        try:
            for chunk in stream:
                yield from state.feed(chunk, completion)
            yield from state.flush()
        except GeneratorExit:
            raise
        except Exception as exc:
            _raise_mid_stream(exc)
        finally:
            stream.close()  # an early exit closes the connection: the server aborts the request

    async def _astream(self, create, kwargs: dict, timeout, completion: bool) -> AsyncIterator[RemoteDelta]:
        state = _StreamState()
        try:
            stream = await create(**kwargs, stream=True, stream_options={"include_usage": True}, **_timeout(timeout))
        except Exception as exc:
            _raise(exc)
        try:
            async for chunk in stream:
                for d in state.feed(chunk, completion):
                    yield d
            for d in state.flush():
                yield d
        except Exception as exc:
            _raise_mid_stream(exc)
        finally:
            await stream.close()

    # -- tokenizer -------------------------------------------------------------------------------------
    # Two body shapes: ours and vLLM's (``{"prompt" | "messages", ...}`` -> ``{"tokens": [...]}``) and
    # llama.cpp's server (``{"content": text}`` -> ``{"tokens": [...]}``, chat rendered by its
    # ``/apply-template`` first). llama.cpp answers the other shape with 200 and no tokens: an empty answer
    # for non-empty input moves to its shape, and if that is empty too it is a TokenizeError, never 0.
    def tokenize(self, text: str, *, model: str | None = None, add_special_tokens: bool = False,
                 timeout: float | None = 30.0) -> list[int]:
        """Token ids from the server's tokenizer (``POST /tokenize``: ``parallm serve``, vLLM, SGLang and
        llama.cpp's server). Raises ``NotImplementedError`` for a server without one, ``TokenizeError`` when
        it gives no tokens for non-empty text."""
        if self._tokenize_shape != "llama.cpp":
            body = {"model": self.resolve_model(model), "prompt": text, "add_special_tokens": add_special_tokens}
            tokens = self._tokenize(body, timeout)
            if tokens or not text:
                return tokens
        tokens = self._tokenize({"content": text, "add_special": add_special_tokens}, timeout)
        return self._checked(tokens, text)

    def tokenize_messages(self, messages: list[dict], *, model: str | None = None, tools: list[dict] | None = None,
                          add_generation_prompt: bool = False, timeout: float | None = 30.0) -> list[int]:
        """Token ids of ``messages`` (and ``tools``) rendered with the server's chat template."""
        if self._tokenize_shape != "llama.cpp":
            body: dict[str, Any] = {"model": self.resolve_model(model), "messages": messages,
                                    "add_generation_prompt": add_generation_prompt}
            if tools:
                body["tools"] = list(tools)
            tokens = self._tokenize(body, timeout)
            if tokens or not messages:
                return tokens
        template: dict[str, Any] = {"messages": messages, **({"tools": list(tools)} if tools else {})}
        try:
            prompt = self._post("/apply-template", template, timeout).get("prompt")
        except NotImplementedError:  # a /tokenize that answered nothing, and no llama.cpp route either
            raise self._empty_error() from None
        if not isinstance(prompt, str):
            raise self._empty_error()
        tokens = self._tokenize({"content": prompt, "add_special": False, "parse_special": True}, timeout)
        return self._checked(tokens, prompt)

    _tokenize_shape: str | None = None  # "llama.cpp" once a server answered only that shape

    def _checked(self, tokens: list[int], text: str) -> list[int]:
        if text and not tokens:
            raise self._empty_error()
        if text:
            self._tokenize_shape = "llama.cpp"
        return tokens

    def _empty_error(self):
        from .errors import TokenizeError

        return TokenizeError(
            f"the server at {self.base_url} answered /tokenize with no tokens for non-empty text in every body "
            "shape known (parallm serve / vLLM's and llama.cpp's); it cannot count tokens"
        )

    def _tokenize(self, body: dict, timeout: float | None) -> list[int]:
        answer = self._post("/tokenize", body, timeout)
        tokens = answer.get("tokens")
        if not isinstance(tokens, list):
            return []
        # llama.cpp's with_pieces shape is [{"id": ..., "piece": ...}]; ours / vLLM's / llama.cpp's plain ids.
        return [int(t["id"]) if isinstance(t, dict) else int(t) for t in tokens]

    def _post(self, path: str, body: dict, timeout: float | None) -> dict:
        root = self.base_url[:-3] if self.base_url.endswith("/v1") else self.base_url
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {self.api_key}",
                   **self.default_headers}
        req = urllib.request.Request(f"{root}{path}", data=json.dumps(body).encode(), headers=headers,
                                     method="POST")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 (the user's base_url)
                answer = json.loads(resp.read() or b"{}")
                return answer if isinstance(answer, dict) else {}
        except urllib.error.HTTPError as exc:
            if exc.code in (404, 405, 501):
                raise NotImplementedError(
                    f"the server at {self.base_url} has no {path} endpoint; token counts need the model's "
                    "tokenizer (parallm serve, vLLM and llama.cpp's server have one)"
                ) from exc
            detail = exc.read().decode("utf-8", "replace")[:500]
            if exc.code == 400:
                from .errors import InvalidRequestError

                raise InvalidRequestError(f"tokenize failed: {detail}") from exc
            raise


def _timeout(timeout: float | None) -> dict[str, Any]:
    return {"timeout": timeout} if timeout is not None else {}


_clients: dict[tuple, RemoteClient] = {}
_clients_lock = threading.Lock()


def get_client(base_url: str, api_key: str | None = None, *, max_retries: int | None = 2,
               default_headers: dict[str, str] | None = None) -> RemoteClient:
    """The process-wide client for this server and key (connection pools are shared)."""
    key = (base_url.rstrip("/"), api_key, 2 if max_retries is None else int(max_retries),
           tuple(sorted((default_headers or {}).items())))
    with _clients_lock:
        client = _clients.get(key)
        if client is None:
            client = RemoteClient(base_url, api_key, max_retries=key[2], default_headers=default_headers)
            _clients[key] = client
        return client


__all__ = [
    "RemoteChoice", "RemoteClient", "RemoteDelta", "RemoteResult", "RemoteToolCall", "RemoteToolCallDelta", "Usage",
    "get_client", "DEFAULT_MODEL_ALIASES",
]
