"""The ``base_url=`` path: run ParaLLM's classes against any OpenAI-compatible server (``parallm
serve``, vLLM, SGLang, mlx-lm's server, ...) through the official ``openai`` client.

Two layers. Results have the engine's shapes, so a class's code does not care where a result came from.

1. Engine-shaped, framework-free (for LlamaIndex and anything else)::

       client = get_client(base_url, api_key=None, max_retries=2)       # cached per (url, key, retries)
       client.chat(messages, *, model=None, tools=None, tool_choice=None, response_format=None,
                   parallel_tool_calls=None, timeout=None, **sampling) -> RemoteResult
       await client.achat(...)                                           -> RemoteResult
       client.chat_stream(messages, ...)                                 -> Iterator[RemoteDelta]
       client.achat_stream(messages, ...)                                -> AsyncIterator[RemoteDelta]
       client.generate(prompts, *, model=None, response_format=None, timeout=None, **sampling)
                                                                         -> list[RemoteResult]
       await client.agenerate(prompts, ...)                              -> list[RemoteResult]
       client.stream(prompt, ...) / client.astream(prompt, ...)          -> (Async)Iterator[RemoteDelta]
       client.models() / await client.amodels()                          -> list[str]
       client.resolve_model(name) / await client.aresolve_model(name)    -> str
       client.tokenize(text, model=None, add_special_tokens=False)       -> list[int]  (vLLM /tokenize)
       client.tokenize_messages(messages, model=None, tools=None, add_generation_prompt=False) -> list[int]

   ``messages`` are OpenAI message dicts, ``tools`` OpenAI tool dicts, ``sampling`` the engine's
   keyword names (max_tokens, temperature, top_p, top_k, min_p, repetition_penalty, presence_penalty,
   frequency_penalty, logit_bias, seed, stop, stop_token_ids, ignore_eos, logprobs, top_logprobs, n,
   include_stop_str_in_output). OpenAI's own fields go as themselves; the others go in ``extra_body``
   (vLLM and SGLang read them there). ``prompts`` of ``generate`` go in ONE HTTP request, so the server
   batches them.

   * ``RemoteResult`` is a :class:`parallm_engine.GenerationResult` (plus ``model``, the name the server
     answered with). Each ``Choice`` has ``text`` = ``content`` = the message text without tool-call
     markup, ``tool_calls`` = :class:`RemoteToolCall` (a ``chat_format.ToolCall`` whose ``arguments`` is
     the parsed dict, plus ``raw_arguments`` and ``error``, set when the server sent arguments that are
     not a JSON object), ``finish_reason`` as the server sent it ("tool_calls" when it made calls),
     ``logprobs`` = ``TokenLogprob`` list (``token_id`` -1: servers send token text only),
     ``token_ids`` = []. ``usage`` is a ``Usage`` (``cached_tokens`` from
     ``prompt_tokens_details.cached_tokens``, 0 when the server does not say).
   * ``RemoteDelta`` is a :class:`parallm_engine.StreamDelta` plus ``tool_calls``: a list of
     ``chat_format.ToolCallDelta`` (index, id and name on a call's first delta, argument JSON text in
     pieces after). As from the engine, ``finish_reason`` is set on a choice's last delta and ``usage``
     on the request's very last delta (streams ask for ``stream_options.include_usage``; a server that
     sends no usage leaves it None). Leaving the iteration early closes the HTTP stream, which aborts
     the request on ``parallm serve`` (and on vLLM / SGLang).
   * Errors are the engine's: a 400 is ``InvalidRequestError`` (``ContextLengthExceededError`` when the
     server says ``context_length_exceeded``), a 429 ``QueueFullError`` (``retry_after`` from the
     header), an unknown model ``ModelLoadError``, a client-side timeout ``TimeoutError``; the
     ``openai`` exception is chained as ``__cause__``. Others (401, 5xx, connection) are the ``openai``
     exceptions, after the client's own retries (``max_retries``, for 429 / 5xx / connection errors).
   * ``model=None`` or a spelling of the default model ("default", "SmolLM2-135M-Instruct") is sent as
     the server's own model when the server does not know that name (looked up once on ``/v1/models``),
     so ``ChatParaLLM(base_url=...)`` with no model works against a vLLM server too.
   * The API key is always passed explicitly ("EMPTY" when there is none): ``OPENAI_API_KEY`` from the
     environment is never sent to a ``base_url``.

2. LangChain adapters, called by ``ChatParaLLM`` / ``ParaLLM`` through ``_common.remote_function``;
   ``llm`` supplies ``base_url``, ``api_key`` and ``max_retries``; ``params`` is ``llm._remote_params(req)``
   (sampling settings, ``model``, ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` /
   ``response_format``, ``timeout``)::

       chat_generate(llm, messages, params, run_manager=None) -> ChatResult
       async achat_generate(llm, messages, params, run_manager=None) -> ChatResult
       chat_stream(llm, messages, params, run_manager=None) -> Iterator[ChatGenerationChunk]
       achat_stream(llm, messages, params, run_manager=None) -> AsyncIterator[ChatGenerationChunk]
       completion_generate(llm, prompts, params, run_manager=None) -> LLMResult
       async acompletion_generate(llm, prompts, params, run_manager=None) -> LLMResult
       completion_stream(llm, prompt, params, run_manager=None) -> Iterator[GenerationChunk]
       acompletion_stream(llm, prompt, params, run_manager=None) -> AsyncIterator[GenerationChunk]
       get_token_ids(llm, text) -> list[int]
       get_num_tokens_from_messages(llm, messages, tools=None) -> int      (OpenAI dicts in)

   They build exactly what the in-process paths build (same ``response_metadata``, ``usage_metadata``
   with ``input_token_details.cache_read``, ``tool_call_chunks``, last chunk with
   ``chunk_position="last"``) and fire no callbacks: the classes fire token callbacks themselves.
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

from parallm_engine.chat_format import ToolCall, ToolCallDelta
from parallm_engine.errors import (
    ContextLengthExceededError,
    InvalidRequestError,
    ModelLoadError,
    QueueFullError,
)
from parallm_engine.request import Choice, GenerationResult, StreamDelta, TokenLogprob, Usage

_PROVIDER = "parallm"
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
# Result types
# ----------------------------------------------------------------------------------------------


@dataclass
class RemoteToolCall(ToolCall):
    raw_arguments: str | None = None  # the argument text as the server sent it
    error: str | None = None  # set when raw_arguments is not a JSON object (arguments is then {})


@dataclass
class RemoteResult(GenerationResult):
    model: str | None = None


@dataclass
class RemoteDelta(StreamDelta):
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    model: str | None = None  # the model name the server answered with


def _usage(u) -> Usage | None:
    if u is None:
        return None
    details = getattr(u, "prompt_tokens_details", None)
    cached = getattr(details, "cached_tokens", None) if details is not None else None
    return Usage(prompt_tokens=int(u.prompt_tokens or 0), completion_tokens=int(u.completion_tokens or 0),
                 cached_tokens=int(cached or 0))


def _tool_call(tc) -> RemoteToolCall:
    fn = tc.function
    raw = fn.arguments if fn is not None else ""
    args: dict = {}
    error = None
    try:
        parsed = json.loads(raw) if raw else {}
        if isinstance(parsed, dict):
            args = parsed
        else:
            error = "arguments are not a JSON object"
    except (json.JSONDecodeError, TypeError) as exc:
        error = f"arguments are not valid JSON: {exc}"
    return RemoteToolCall(id=tc.id or "", name=(fn.name if fn is not None else "") or "", arguments=args,
                          raw_arguments=raw, error=error)


def _chat_logprobs(lp) -> list[TokenLogprob] | None:
    content = getattr(lp, "content", None) if lp is not None else None
    if not content:
        return None
    return [TokenLogprob(-1, t.token, float(t.logprob),
                         [(-1, a.token, float(a.logprob)) for a in (t.top_logprobs or [])])
            for t in content]


def _completion_logprobs(lp) -> list[TokenLogprob] | None:
    if lp is None or not lp.tokens:
        return None
    tops = lp.top_logprobs or [None] * len(lp.tokens)
    out = []
    for tok, val, top in zip(lp.tokens, lp.token_logprobs or [], tops):
        alts = [(-1, k, float(v)) for k, v in (top or {}).items()]
        out.append(TokenLogprob(-1, tok, float(val) if val is not None else float("-inf"), alts))
    return out


def _chat_result(resp) -> RemoteResult:
    choices = []
    for ch in sorted(resp.choices, key=lambda c: c.index):
        msg = ch.message
        content = msg.content or ""
        choices.append(Choice(index=ch.index, text=content, token_ids=[], finish_reason=ch.finish_reason,
                              logprobs=_chat_logprobs(ch.logprobs), content=content,
                              tool_calls=[_tool_call(tc) for tc in (msg.tool_calls or [])]))
    return RemoteResult(request_id=resp.id, choices=choices, usage=_usage(resp.usage) or Usage(),
                        prompt_token_ids=[], model=resp.model)


def _completion_results(resp, n_prompts: int, n: int) -> list[RemoteResult]:
    """One HTTP response for many prompts -> one result per prompt (choice i*n + j is prompt i's j-th)."""
    groups: list[list[Choice]] = [[] for _ in range(n_prompts)]
    for ch in sorted(resp.choices, key=lambda c: c.index):
        p, j = divmod(ch.index, n)
        if p < n_prompts:
            groups[p].append(Choice(index=j, text=ch.text, token_ids=[], finish_reason=ch.finish_reason,
                                    logprobs=_completion_logprobs(ch.logprobs), content=ch.text))
    usage = _usage(resp.usage) or Usage()
    results = []
    for i, choices in enumerate(groups):
        # The server reports usage for the whole call: it goes on the first result, so sums stay right.
        results.append(RemoteResult(request_id=f"{resp.id}-{i}", choices=choices,
                                    usage=usage if i == 0 else Usage(), prompt_token_ids=[], model=resp.model))
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


def _translate(exc: BaseException) -> BaseException:
    """An ``openai`` exception -> the error the in-process engine raises for the same problem."""
    import openai

    if isinstance(exc, openai.APITimeoutError):
        return TimeoutError(f"ParaLLM request to the server timed out ({exc})")
    if isinstance(exc, openai.RateLimitError):
        retry = 1.0
        try:
            retry = float(exc.response.headers.get("retry-after", 1.0))
        except (TypeError, ValueError, AttributeError):
            pass
        return QueueFullError(_error_fields(exc)[0], retry_after=retry)
    if isinstance(exc, (openai.BadRequestError, openai.UnprocessableEntityError)):
        message, param, code = _error_fields(exc)
        if code == "context_length_exceeded" or "context length" in message.lower():
            return ContextLengthExceededError(message, param=param)
        return InvalidRequestError(message, param=param)
    if isinstance(exc, openai.NotFoundError):
        message, param, code = _error_fields(exc)
        if code == "model_not_found" or param == "model" or "model" in message.lower():
            return ModelLoadError(message)
    if isinstance(exc, openai.APIError) and not isinstance(exc, openai.APIStatusError):
        # An error event inside a stream (``data: {"error": ...}``).
        message, param, code = _error_fields(exc)
        if code == "context_length_exceeded":
            return ContextLengthExceededError(message, param=param)
        if getattr(exc, "type", None) == "invalid_request_error":
            return InvalidRequestError(message, param=param)
    return exc


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
        usage = _usage(getattr(chunk, "usage", None))
        if usage is not None:
            self.usage = usage
        out: list[RemoteDelta] = []
        for ch in chunk.choices or []:
            if completion:
                delta = RemoteDelta(chunk.id, ch.index, ch.text or "", [], finish_reason=ch.finish_reason,
                                    logprobs=_completion_logprobs(ch.logprobs))
            else:
                d = ch.delta
                calls = []
                for tc in (getattr(d, "tool_calls", None) or []):
                    fn = tc.function
                    calls.append(ToolCallDelta(tc.index, tc.id or None, (fn.name if fn else None) or None,
                                               (fn.arguments if fn else "") or ""))
                delta = RemoteDelta(chunk.id, ch.index, (d.content if d is not None else None) or "", [],
                                    finish_reason=ch.finish_reason, logprobs=_chat_logprobs(ch.logprobs),
                                    tool_calls=calls)
            if not (delta.text or delta.tool_calls or delta.logprobs or delta.finish_reason):
                continue  # e.g. the role-only first chunk
            delta.model = self.model
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
            return [RemoteDelta(self.request_id, 0, "", [], usage=self.usage, model=self.model)]
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
        if self._models is None:
            try:
                self._models = [m.id for m in self.sync_client.models.list()]
            except Exception as exc:
                _raise(exc)
        return list(self._models)

    async def amodels(self) -> list[str]:
        if self._models is None:
            try:
                self._models = [m.id async for m in self.async_client.models.list()]
            except Exception as exc:
                _raise(exc)
        return list(self._models)

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
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if not prompts:
            return []
        kwargs = _completion_kwargs(prompts, self.resolve_model(model), response_format, sampling)
        try:
            resp = self.sync_client.completions.create(**kwargs, **_timeout(timeout))
        except Exception as exc:
            _raise(exc)
        return _completion_results(resp, len(prompts), int(sampling.get("n") or 1))

    async def agenerate(self, prompts: str | list[str], *, model: str | None = None, response_format=None,
                        timeout: float | None = None, **sampling: Any) -> list[RemoteResult]:
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if not prompts:
            return []
        kwargs = _completion_kwargs(prompts, await self.aresolve_model(model), response_format, sampling)
        try:
            resp = await self.async_client.completions.create(**kwargs, **_timeout(timeout))
        except Exception as exc:
            _raise(exc)
        return _completion_results(resp, len(prompts), int(sampling.get("n") or 1))

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
            _raise(exc)
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
            _raise(exc)
        finally:
            await stream.close()

    # -- tokenizer -------------------------------------------------------------------------------------
    def tokenize(self, text: str, *, model: str | None = None, add_special_tokens: bool = False,
                 timeout: float | None = 30.0) -> list[int]:
        """Token ids from the server's tokenizer (vLLM's ``POST /tokenize``, which ``parallm serve``
        implements too). Raises ``NotImplementedError`` for a server without it."""
        body = {"model": self.resolve_model(model), "prompt": text, "add_special_tokens": add_special_tokens}
        return self._tokenize(body, timeout)

    def tokenize_messages(self, messages: list[dict], *, model: str | None = None, tools: list[dict] | None = None,
                          add_generation_prompt: bool = False, timeout: float | None = 30.0) -> list[int]:
        """Token ids of ``messages`` (and ``tools``) rendered with the server's chat template."""
        body: dict[str, Any] = {"model": self.resolve_model(model), "messages": messages,
                                "add_generation_prompt": add_generation_prompt}
        if tools:
            body["tools"] = list(tools)
        return self._tokenize(body, timeout)

    def _tokenize(self, body: dict, timeout: float | None) -> list[int]:
        root = self.base_url[:-3] if self.base_url.endswith("/v1") else self.base_url
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {self.api_key}",
                   **self.default_headers}
        req = urllib.request.Request(f"{root}/tokenize", data=json.dumps(body).encode(), headers=headers,
                                     method="POST")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 (the user's base_url)
                return [int(t) for t in json.loads(resp.read())["tokens"]]
        except urllib.error.HTTPError as exc:
            if exc.code in (404, 405):
                raise NotImplementedError(
                    f"the server at {self.base_url} has no /tokenize endpoint; token counts need the model's "
                    "tokenizer (parallm serve and vLLM have one)"
                ) from exc
            detail = exc.read().decode("utf-8", "replace")[:500]
            if exc.code == 400:
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


# ----------------------------------------------------------------------------------------------
# LangChain adapters
# ----------------------------------------------------------------------------------------------


def client_for(llm) -> RemoteClient:
    """The client for a ``ChatParaLLM`` / ``ParaLLM`` (or anything with ``base_url``, ``api_key``
    (str or SecretStr) and ``max_retries``)."""
    key = getattr(llm, "api_key", None)
    if key is not None and hasattr(key, "get_secret_value"):
        key = key.get_secret_value()
    return get_client(llm.base_url, key or None, max_retries=getattr(llm, "max_retries", 2))


def _split_params(params: dict[str, Any]) -> dict[str, Any]:
    """``_remote_params`` output -> RemoteClient keyword arguments."""
    kw = dict(params)
    kw.pop("stream", None)
    kw.pop("stream_options", None)
    return kw


def _message_from_choice(choice, usage, model_name: str, single_call: bool):
    from langchain_core.messages import AIMessage
    from langchain_core.messages.tool import invalid_tool_call
    from langchain_core.outputs import ChatGeneration

    from ._messages import logprobs_to_openai, usage_metadata

    calls = list(choice.tool_calls or [])
    if single_call:
        calls = calls[:1]
    tool_calls, invalid = [], []
    for c in calls:
        if getattr(c, "error", None):
            invalid.append(invalid_tool_call(name=c.name, args=c.raw_arguments, id=c.id, error=c.error))
        else:
            tool_calls.append({"name": c.name, "args": c.arguments, "id": c.id, "type": "tool_call"})
    finish_reason = choice.finish_reason
    if calls and finish_reason == "stop":
        finish_reason = "tool_calls"
    meta: dict[str, Any] = {"finish_reason": finish_reason, "model_name": model_name, "model_provider": _PROVIDER}
    logprobs = logprobs_to_openai(choice.logprobs)
    if logprobs:
        meta["logprobs"] = logprobs
    message = AIMessage(content=choice.text or "", tool_calls=tool_calls, invalid_tool_calls=invalid,
                        usage_metadata=usage_metadata(usage), response_metadata=meta)
    info: dict[str, Any] = {"finish_reason": finish_reason}
    if logprobs:
        info["logprobs"] = logprobs
    return ChatGeneration(message=message, generation_info=info)


def _to_chat_result(result: RemoteResult, params: dict[str, Any]):
    from langchain_core.outputs import ChatResult

    model_name = result.model or str(params.get("model"))
    single = params.get("parallel_tool_calls") is False
    return ChatResult(
        generations=[_message_from_choice(c, result.usage, model_name, single) for c in result.choices],
        llm_output={"model_name": model_name, "model_provider": _PROVIDER},
    )


def chat_generate(llm, messages: list[dict], params: dict[str, Any], run_manager=None):
    return _to_chat_result(client_for(llm).chat(messages, **_split_params(params)), params)


async def achat_generate(llm, messages: list[dict], params: dict[str, Any], run_manager=None):
    return _to_chat_result(await client_for(llm).achat(messages, **_split_params(params)), params)


class _ChatChunks:
    """RemoteDelta -> ChatGenerationChunk, as the in-process ``_ChunkBuilder`` builds them."""

    def __init__(self, params: dict[str, Any]):
        self.model_name = str(params.get("model"))
        self.single_call = params.get("parallel_tool_calls") is False
        self.finish_reason: str | None = None
        self.usage = None
        self.saw_call = False
        self.model: str | None = None

    def feed(self, delta: RemoteDelta):
        from langchain_core.messages import AIMessageChunk
        from langchain_core.messages.tool import tool_call_chunk
        from langchain_core.outputs import ChatGenerationChunk

        from ._messages import logprobs_to_openai

        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
        if delta.usage is not None:
            self.usage = delta.usage
        self.model = delta.model or self.model
        for ev in delta.tool_calls:
            if self.single_call and ev.index > 0:
                continue
            self.saw_call = True
            yield ChatGenerationChunk(message=AIMessageChunk(content="", tool_call_chunks=[tool_call_chunk(
                name=ev.name or None, args=ev.arguments_delta or "", id=ev.id or None, index=ev.index)]))
        logprobs = logprobs_to_openai(delta.logprobs)
        if delta.text or logprobs:
            info = {"logprobs": logprobs} if logprobs else None
            msg = AIMessageChunk(content=delta.text, response_metadata=dict(info) if info else {})
            yield ChatGenerationChunk(message=msg, generation_info=info)

    def finish(self):
        from langchain_core.messages import AIMessageChunk
        from langchain_core.outputs import ChatGenerationChunk

        from ._messages import usage_metadata

        finish_reason = self.finish_reason
        if self.saw_call and finish_reason == "stop":
            finish_reason = "tool_calls"
        meta = {"finish_reason": finish_reason, "model_name": self.model or self.model_name,
                "model_provider": _PROVIDER}
        return ChatGenerationChunk(
            message=AIMessageChunk(content="", usage_metadata=usage_metadata(self.usage), response_metadata=meta,
                                   chunk_position="last"),
            generation_info={"finish_reason": finish_reason},
        )


def chat_stream(llm, messages: list[dict], params: dict[str, Any], run_manager=None):
    builder = _ChatChunks(params)
    stream = client_for(llm).chat_stream(messages, **_split_params(params))
    try:
        for delta in stream:
            yield from builder.feed(delta)
    finally:
        stream.close()
    yield builder.finish()


async def achat_stream(llm, messages: list[dict], params: dict[str, Any], run_manager=None):
    builder = _ChatChunks(params)
    stream = client_for(llm).achat_stream(messages, **_split_params(params))
    try:
        async for delta in stream:
            for chunk in builder.feed(delta):
                yield chunk
    finally:
        await stream.aclose()
    yield builder.finish()


def _llm_result(results: list[RemoteResult], params: dict[str, Any]):
    from langchain_core.outputs import Generation, LLMResult

    from ._messages import logprobs_to_openai, token_usage_dict

    generations = []
    total = Usage()
    for r in results:
        gens = []
        for c in r.choices:
            info: dict[str, Any] = {"finish_reason": c.finish_reason}
            logprobs = logprobs_to_openai(c.logprobs)
            if logprobs:
                info["logprobs"] = logprobs
            gens.append(Generation(text=c.text, generation_info=info))
        generations.append(gens)
        total.prompt_tokens += r.usage.prompt_tokens
        total.completion_tokens += r.usage.completion_tokens
        total.cached_tokens += r.usage.cached_tokens
    model_name = (results[0].model if results else None) or str(params.get("model"))
    return LLMResult(generations=generations,
                     llm_output={"token_usage": token_usage_dict(total), "model_name": model_name,
                                 "model_provider": _PROVIDER})


def completion_generate(llm, prompts: list[str], params: dict[str, Any], run_manager=None):
    return _llm_result(client_for(llm).generate(list(prompts), **_split_params(params)), params)


async def acompletion_generate(llm, prompts: list[str], params: dict[str, Any], run_manager=None):
    return _llm_result(await client_for(llm).agenerate(list(prompts), **_split_params(params)), params)


def _text_chunk(delta: RemoteDelta):
    from langchain_core.outputs import GenerationChunk

    from ._messages import logprobs_to_openai

    logprobs = logprobs_to_openai(delta.logprobs)
    if not delta.text and not logprobs:
        return None
    return GenerationChunk(text=delta.text, generation_info={"logprobs": logprobs} if logprobs else None)


def _final_text_chunk(params, finish_reason, usage):
    from langchain_core.outputs import GenerationChunk

    from ._messages import token_usage_dict

    info: dict[str, Any] = {"finish_reason": finish_reason, "model_name": str(params.get("model")),
                            "model_provider": _PROVIDER}
    if usage is not None:
        info["token_usage"] = token_usage_dict(usage)
    return GenerationChunk(text="", generation_info=info)


def completion_stream(llm, prompt: str, params: dict[str, Any], run_manager=None):
    finish_reason, usage = None, None
    stream = client_for(llm).stream(prompt, **_split_params(params))
    try:
        for delta in stream:
            finish_reason = delta.finish_reason or finish_reason
            usage = delta.usage or usage
            chunk = _text_chunk(delta)
            if chunk is not None:
                yield chunk
    finally:
        stream.close()
    yield _final_text_chunk(params, finish_reason, usage)


async def acompletion_stream(llm, prompt: str, params: dict[str, Any], run_manager=None):
    finish_reason, usage = None, None
    stream = client_for(llm).astream(prompt, **_split_params(params))
    try:
        async for delta in stream:
            finish_reason = delta.finish_reason or finish_reason
            usage = delta.usage or usage
            chunk = _text_chunk(delta)
            if chunk is not None:
                yield chunk
    finally:
        await stream.aclose()
    yield _final_text_chunk(params, finish_reason, usage)


def get_token_ids(llm, text: str) -> list[int]:
    return client_for(llm).tokenize(text, model=getattr(llm, "model", None), add_special_tokens=False)


def get_num_tokens_from_messages(llm, messages: list[dict], tools: list[dict] | None = None) -> int:
    """Tokens of OpenAI message dicts (and OpenAI tool dicts) rendered with the server's template."""
    return len(client_for(llm).tokenize_messages(messages, model=getattr(llm, "model", None), tools=tools))


__all__ = [
    "RemoteClient", "RemoteDelta", "RemoteResult", "RemoteToolCall", "get_client", "client_for",
    "chat_generate", "achat_generate", "chat_stream", "achat_stream", "completion_generate",
    "acompletion_generate", "completion_stream", "acompletion_stream", "get_token_ids",
    "get_num_tokens_from_messages",
]
