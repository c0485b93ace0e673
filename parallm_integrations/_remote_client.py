"""The engine-shaped OpenAI-compatible client behind ``base_url=`` (see ``_remote`` for the
interface, the result shapes and the LangChain adapters built on it).

Imports nothing of ``parallm_engine`` and nothing of MLX: ``pip install parallm-integrations`` without the
``engine`` extra runs it. Its result types carry the engine's field names (``GenerationResult`` /
``Choice`` / ``StreamDelta`` / ``Usage`` / ``chat_format.ToolCall`` / ``ToolCallDelta``), so code reads a
result the same whichever path made it; ``logprobs`` is the server's OpenAI chat ``logprobs`` dict,
passed on as the server formatted it (``parallm serve`` with the engine's one formatter,
``parallm_engine.sampling.logprobs``). Errors the server reports are :mod:`parallm_integrations.errors`, which
are the engine's own classes when the engine is installed.

The client itself (connections, models, calls, tokenizer) is here; its result types are in
``_remote_types``, request bodies in ``_remote_requests``, response and stream mapping in
``_remote_responses``, error translation in ``_remote_errors``.
"""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request
import weakref
from collections.abc import AsyncIterator, Iterator
from typing import Any

from ._remote_errors import _raise, _raise_mid_stream
from ._remote_requests import MAX_SEQUENCES_PER_REQUEST, _chat_kwargs, _completion_kwargs, _prompt_chunks  # noqa: F401
from ._tracing import trace_headers
from ._remote_responses import TRUNCATED_CALL, _chat_result, _completion_results, _StreamState  # noqa: F401
from ._remote_types import (  # noqa: F401  (re-exported: the client's result types)
    RemoteChoice,
    RemoteDelta,
    RemoteFinish,
    RemoteReasoning,
    RemoteResult,
    RemoteText,
    RemoteToolCall,
    RemoteToolCallDelta,
    Usage,
)

DEFAULT_MODEL_ALIASES = ("", "default", "SmolLM2-135M-Instruct")


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
            resp = self.sync_client.chat.completions.create(**kwargs, **_call_options(timeout))
        except Exception as exc:
            _raise(exc)
        return _chat_result(resp)

    async def achat(self, messages: list[dict], *, model: str | None = None, tools=None, tool_choice=None,
                    response_format=None, parallel_tool_calls=None, timeout: float | None = None,
                    **sampling: Any) -> RemoteResult:
        kwargs = _chat_kwargs(messages, await self.aresolve_model(model), tools, tool_choice, response_format,
                              parallel_tool_calls, sampling)
        try:
            resp = await self.async_client.chat.completions.create(**kwargs, **_call_options(timeout))
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
                resp = self.sync_client.completions.create(**kwargs, **_call_options(timeout))
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
                resp = await self.async_client.completions.create(**kwargs, **_call_options(timeout))
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
            stream = create(**kwargs, stream=True, stream_options={"include_usage": True}, **_call_options(timeout))
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
            stream = await create(**kwargs, stream=True, stream_options={"include_usage": True}, **_call_options(timeout))
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


def _call_options(timeout: float | None) -> dict[str, Any]:
    """A call's own options: its timeout, and the caller's trace context as headers (``_tracing.py``)."""
    options: dict[str, Any] = {"timeout": timeout} if timeout is not None else {}
    headers = trace_headers()
    if headers:
        options["extra_headers"] = headers
    return options


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
