"""Where a ParaLLM class's requests run: one interface (:class:`Backend`), two implementations, picked once
from ``base_url`` when the object is built and used by the LangChain and LlamaIndex classes alike.

* :class:`EngineBackend`: the shared in-process engine (``parallm_engine``, imported on first use).
* :class:`RemoteBackend`: an OpenAI-compatible server (``base_url``: ``parallm serve``, vLLM, SGLang,
  mlx-lm's server, llama.cpp's server) through the process-wide ``RemoteClient`` for its URL and key.

Both take the same input and give the engine's result shapes (``GenerationResult`` / ``StreamDelta``, or the
client's ``RemoteResult`` / ``RemoteDelta`` with the same fields), so the classes build their responses once.
A *prompt* is either

* a list of OpenAI message dicts, rendered with the model's chat template (by the engine in-process, by the
  server on ``/v1/chat/completions``, which also parses tool calls and applies ``tool_choice``), or
* a string: raw text the model continues (``/v1/completions`` remotely).

``req`` is an :class:`~parallm_integrations._request.EngineRequest` (``_request.build_request``). A stream is
submitted (or sent) when it is first iterated, so one never iterated costs nothing; its prompt is rendered up
front, so a bad message fails at the call. Closing a stream aborts its request (in-process: at the engine's
next step; remotely: the HTTP stream closes, which ``parallm serve``, vLLM and SGLang take as an abort).

Remote errors are the engine's (``InvalidRequestError`` / ``ContextLengthExceededError`` for a 400,
``QueueFullError`` for a 429, ``ModelLoadError`` for an unknown model, ``TimeoutError``); others (401, 5xx, an
unreachable server) are the ``openai`` exceptions, after ``max_retries`` retries.
"""

from __future__ import annotations

import asyncio
import logging
import time
import warnings
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from ._engine_calls import DEFAULT_MODEL_NAME, EngineCall, is_default_model, one_fairness_group, peek_context_window
from ._request import EngineRequest

logger = logging.getLogger(__name__)

Prompt = list[dict[str, Any]] | str

#: LlamaIndex's fallback context window when none can be read (llama_index.core.constants).
FALLBACK_CONTEXT_WINDOW = 3900
#: After /v1/models could not be read, model_info uses the fallback this long before asking again.
REMOTE_INFO_RETRY_S = 30.0


class Backend(ABC):
    """The calls a ParaLLM class makes, wherever the model runs.

    ``allow_special_tokens``: whether special-token text inside chat messages is parsed as special tokens;
    ``raw_text_special_tokens``: the same for raw-text prompts (the model's raw input: parsed by default).
    """

    #: True: tool calls come inside the deltas' text (their typed ``pieces`` say what is what), in-process;
    #: False: as the server sent them (``RemoteDelta.tool_calls``).
    tool_markup_in_text: bool
    is_remote: bool

    def __init__(self, *, allow_special_tokens: bool = False, raw_text_special_tokens: bool = True):
        self.allow_special_tokens = allow_special_tokens
        self.raw_text_special_tokens = raw_text_special_tokens

    # -- requests -----------------------------------------------------------------------------
    @abstractmethod
    def run(self, prompt: Prompt, req: EngineRequest) -> Any:
        """One finished request (its first choice is the answer)."""

    @abstractmethod
    async def arun(self, prompt: Prompt, req: EngineRequest) -> Any: ...

    @abstractmethod
    def run_many(self, prompts: list[str], req: EngineRequest) -> list[Any]:
        """Raw-text prompts, all in flight at once (one batch); results in input order."""

    @abstractmethod
    async def arun_many(self, prompts: list[str], req: EngineRequest) -> list[Any]: ...

    @abstractmethod
    def stream(self, prompt: Prompt, req: EngineRequest) -> Iterator[Any]:
        """Deltas as they come; closing the iterator aborts the request."""

    @abstractmethod
    def astream(self, prompt: Prompt, req: EngineRequest) -> AsyncIterator[Any]:
        """Deltas as they come; ``aclose()`` aborts the request."""

    # -- names and sizes ------------------------------------------------------------------------
    @abstractmethod
    def result_model(self, req: EngineRequest, item: Any = None) -> str:
        """The model name a result (or delta) ``item`` of ``req`` is reported under."""

    @abstractmethod
    def model_info(self, context_window: int | None, fallback_window: int = FALLBACK_CONTEXT_WINDOW) -> tuple[int, str]:
        """(context window, model name), loading nothing that can be avoided; ``context_window`` overrides,
        ``fallback_window`` is used when a server cannot say."""

    @abstractmethod
    def decode_batch_size(self) -> int | None:
        """Requests decoded together at most (None: not known, a server)."""

    # -- tokens ---------------------------------------------------------------------------------
    @abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added). ``NotImplementedError``: no tokenizer reachable."""

    @abstractmethod
    def count_chat_tokens(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> int:
        """Tokens of ``messages`` (and ``tools``) rendered with the model's chat template."""

    async def aload(self, req: EngineRequest) -> None:
        """Make sure what ``req`` runs on is up (an in-process model loads off the event loop), so a stream
        created next renders its prompt at once."""

    def check_forced_call(self, req: EngineRequest, made_call: bool, finish_reason: str | None) -> None:
        """After a chat answer: warn when a forced ``tool_choice`` was ignored (only a server can ignore it)."""


# ----------------------------------------------------------------------------------------------
# In-process
# ----------------------------------------------------------------------------------------------


class EngineBackend(Backend):
    """The shared in-process engine: ``engine`` itself, or the engines ``owner`` loads on first use
    (``owner._get_engine(model)`` / ``await owner._aget_engine(model)``, ``model`` a per-call override;
    ``owner.model`` / ``engine_kwargs`` / ``_engine`` for :meth:`model_info`)."""

    tool_markup_in_text = True
    is_remote = False

    def __init__(self, engine: Any = None, allow_special_tokens: bool = False, *, owner: Any = None,
                 raw_text_special_tokens: bool = True, allow_remote_images: bool | None = None):
        super().__init__(allow_special_tokens=allow_special_tokens, raw_text_special_tokens=raw_text_special_tokens)
        self._fixed = engine
        self._owner = owner
        self.allow_remote_images = allow_remote_images  # None: the engine's default (off)

    # -- engines ----------------------------------------------------------------------------------
    def engine_for(self, model: str | None = None):
        return self._fixed if self._owner is None else self._owner._get_engine(model)

    async def aengine_for(self, model: str | None = None):
        """:meth:`engine_for` that never loads a model on the event loop."""
        return self._fixed if self._owner is None else await self._owner._aget_engine(model)

    async def aload(self, req: EngineRequest) -> None:
        await self.aengine_for(req.model)

    @property
    def engine(self):
        return self.engine_for(None)

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def output_parser(self):
        """The model family's tool-call / reasoning format, to split the raw text of stream deltas."""
        from parallm_engine.formats.chat_format import parser_for

        return parser_for(getattr(self.engine, "tokenizer", None))

    # -- prompts -----------------------------------------------------------------------------------
    def _engine_prompt(self, prompt: Prompt, req: EngineRequest, engine: Any = None) -> list[int] | str:
        engine = engine if engine is not None else self.engine_for(req.model)
        if isinstance(prompt, str):
            return prompt if self.raw_text_special_tokens else engine.encode(prompt, allow_special_tokens=False)
        if _has_parts(prompt):  # images: a vision-language prompt
            from parallm_engine.vision.chat import chat_prompt

            options = {} if self.allow_remote_images is None else {"allow_remote_images": self.allow_remote_images}
            return chat_prompt(engine, prompt, req.tools, options)
        return engine.apply_chat_template(prompt, tools=req.tools, allow_special_tokens=self.allow_special_tokens)

    async def _aengine_prompt(self, prompt: Prompt, req: EngineRequest, engine: Any):
        """:meth:`_engine_prompt` for the async paths: a chat with images is prepared on a worker thread
        (decoding, hashing, the image processor), never on the event loop."""
        if _has_parts(prompt):
            return await asyncio.to_thread(self._engine_prompt, prompt, req, engine)
        return self._engine_prompt(prompt, req, engine)

    # -- requests ----------------------------------------------------------------------------------
    def run(self, prompt: Prompt, req: EngineRequest):
        engine = self.engine_for(req.model)
        call = EngineCall(engine, self._engine_prompt(prompt, req, engine), req)
        for _ in call:
            pass
        return call.result

    async def arun(self, prompt: Prompt, req: EngineRequest):
        engine = await self.aengine_for(req.model)
        call = EngineCall(engine, await self._aengine_prompt(prompt, req, engine), req,
                          loop=asyncio.get_running_loop())
        async for _ in call:  # a cancelled caller aborts the request (EngineCall's finally)
            pass
        return call.result

    def run_many(self, prompts: list[str], req: EngineRequest) -> list[Any]:
        """Submit every prompt, then wait: all of them are decoded together."""
        engine = self.engine_for(req.model)
        calls: list[EngineCall] = []
        try:
            with one_fairness_group():  # one call's prompts take admission turns as one caller
                for prompt in prompts:
                    calls.append(EngineCall(engine, self._engine_prompt(prompt, req, engine), req))
            for call in calls:
                for _ in call:
                    pass
        finally:
            for call in calls:
                call._finish()
        return [c.result for c in calls]

    async def arun_many(self, prompts: list[str], req: EngineRequest) -> list[Any]:
        engine = await self.aengine_for(req.model)
        loop = asyncio.get_running_loop()
        calls: list[EngineCall] = []

        async def drain(call: EngineCall) -> None:
            async for _ in call:
                pass

        try:
            with one_fairness_group():
                for prompt in prompts:
                    calls.append(EngineCall(engine, self._engine_prompt(prompt, req, engine), req, loop=loop))
            await asyncio.gather(*(drain(c) for c in calls))
        finally:
            for call in calls:
                call._finish()
        return [c.result for c in calls]

    def stream(self, prompt: Prompt, req: EngineRequest) -> Iterator[Any]:
        engine = self.engine_for(req.model)
        engine_prompt = self._engine_prompt(prompt, req, engine)

        def gen() -> Iterator[Any]:
            yield from EngineCall(engine, engine_prompt, req)  # closing aborts (EngineCall's finally)

        return gen()

    def astream(self, prompt: Prompt, req: EngineRequest) -> AsyncIterator[Any]:
        engine = self._loaded_engine(req.model)  # None: loaded off the event loop when iteration starts
        # The prompt is rendered now (a bad message fails at the call), unless it needs a model to load or
        # has images: then off the event loop when iteration starts.
        engine_prompt = None if engine is None or _has_parts(prompt) else self._engine_prompt(prompt, req, engine)

        async def gen() -> AsyncIterator[Any]:
            nonlocal engine, engine_prompt
            if engine is None:
                engine = await self.aengine_for(req.model)
            if engine_prompt is None:
                engine_prompt = await self._aengine_prompt(prompt, req, engine)
            it = EngineCall(engine, engine_prompt, req, loop=asyncio.get_running_loop()).__aiter__()
            try:
                async for delta in it:
                    yield delta
            finally:
                await it.aclose()  # aborts the request if the consumer stopped early

        return gen()

    def _loaded_engine(self, model: str | None):
        """The engine for ``model`` if it is up (None when it would have to be loaded)."""
        if self._owner is None:
            return self._fixed
        owner = self._owner
        eng = getattr(owner, "_engine", None)
        if same_model(model, owner.model) and eng is not None and eng.is_alive:
            return eng
        return None

    # -- names and sizes ---------------------------------------------------------------------------
    def result_model(self, req: EngineRequest, item: Any = None) -> str:
        return self.engine_for(req.model).model_name

    def model_info(self, context_window: int | None, fallback_window: int = FALLBACK_CONTEXT_WINDOW) -> tuple[int, str]:
        owner = self._owner
        eng = self._fixed if owner is None else owner._engine
        ctx = context_window
        if ctx is None and eng is not None:
            ctx = int(eng.context_window)
        if ctx is None and owner is not None:
            ctx = peek_context_window(owner.model, owner.engine_kwargs)
        if ctx is None:
            eng = self.engine
            ctx = int(eng.context_window)
        if eng is not None:
            return ctx, eng.model_name
        model = getattr(owner, "model", None)
        return ctx, DEFAULT_MODEL_NAME if is_default_model(model) else str(model)

    def decode_batch_size(self) -> int | None:
        try:
            return self.engine.config.max_batch_size
        except Exception:  # the model does not load: each request reports that itself
            return None

    # -- tokens ------------------------------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        return list(self.engine.encode(text, add_special_tokens=False))

    def count_chat_tokens(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> int:
        ids = self.engine.apply_chat_template(messages, tools=tools, add_generation_prompt=False,
                                              allow_special_tokens=self.allow_special_tokens)
        return len(ids)


def same_model(model: str | None, own: str | None) -> bool:
    """Whether a per-call ``model`` (None: none given) names the object's own model ``own``."""
    return model is None or model == own or (is_default_model(model) and is_default_model(own))


def _has_parts(prompt: Prompt) -> bool:
    """A chat with content lists (images): a vision-language prompt."""
    return not isinstance(prompt, str) and any(isinstance(m.get("content"), list) for m in prompt)


# ----------------------------------------------------------------------------------------------
# A server
# ----------------------------------------------------------------------------------------------

_warned_tool_choice: set[str] = set()


def check_forced_call(base_url: str, params: dict[str, Any], made_call: bool, finish_reason: str | None) -> None:
    """A forced ``tool_choice`` ("required" / "any" / a named tool) answered without a call: the server
    ignored it (llama.cpp's server does for templates without tool support). Warn once per server; callers
    that cannot go on without a call (``with_structured_output(method="function_calling")``) raise."""
    choice = params.get("tool_choice")
    if made_call or choice in (None, "auto", "none") or finish_reason == "length" or not params.get("tools"):
        return
    if base_url in _warned_tool_choice:
        return
    _warned_tool_choice.add(base_url)
    warnings.warn(
        f"the server at {base_url} answered a forced tool_choice ({choice!r}) without a tool call: it ignores "
        "tool_choice (llama.cpp's server does for chat templates without tool support). Use a server that "
        "enforces it (parallm serve, vLLM) or check AIMessage.tool_calls. (Said once per server.)",
        UserWarning, stacklevel=5,
    )


class RemoteBackend(Backend):
    """An OpenAI-compatible server, through ``client`` (a ``RemoteClient``) or, given ``client_for``
    (``max_retries -> RemoteClient``), the process-wide client for the owner's URL, key and retries.

    ``model``: the served model (None, or a spelling of the default model: the server's own);
    ``request_model``: what requests name when neither an adapter nor a per-call model is given
    (default: ``model``)."""

    tool_markup_in_text = False
    is_remote = True
    output_parser = None

    def __init__(self, client: Any = None, model: str | None = None, allow_special_tokens: bool = False, *,
                 client_for: Callable[[int | None], Any] | None = None, request_model: str | None = None,
                 raw_text_special_tokens: bool = True):
        super().__init__(allow_special_tokens=allow_special_tokens, raw_text_special_tokens=raw_text_special_tokens)
        self._client = client
        self._client_for = client_for
        self.model = model
        self.request_model = request_model or model
        self._info_retry_at = 0.0  # /v1/models failed: model_info falls back until then

    def client(self, max_retries: int | None = None):
        return self._client if self._client_for is None else self._client_for(max_retries)

    @property
    def base_url(self) -> str:
        return self.client().base_url

    @property
    def model_name(self) -> str:
        return DEFAULT_MODEL_NAME if is_default_model(self.model) else str(self.model)

    def _kwargs(self, req: EngineRequest, chat: bool) -> dict[str, Any]:
        """``RemoteClient`` keyword arguments: the sampling settings (engine names), ``model`` (an adapter is
        sent as the model: a server serves its LoRA adapters as models, vLLM's convention), ``timeout``,
        ``response_format``, ParaLLM's ``allow_special_tokens`` extension (only when not the default) and,
        for a chat, the tools as shown to the model (the server constrains decoding itself; parallm serve
        closes the argument schemas as the engine does)."""
        kw = dict(req.sampling)
        kw.pop("stream", None)
        kw.pop("stream_options", None)
        adapter = kw.pop("adapter", None)
        kw["model"] = adapter or req.model or self.request_model
        if req.timeout is not None:
            kw["timeout"] = req.timeout
        if req.response_format is not None:
            kw["response_format"] = req.response_format
        if chat and self.allow_special_tokens:
            kw["allow_special_tokens"] = True
        if not chat and not self.raw_text_special_tokens:
            kw["allow_special_tokens"] = False
        if chat:
            kw.update(req.tool_kwargs(req.tools))
        return kw

    # -- requests ----------------------------------------------------------------------------------
    def run(self, prompt: Prompt, req: EngineRequest):
        if isinstance(prompt, str):
            return self.client().generate(prompt, **self._kwargs(req, chat=False))[0]
        return self.client().chat(prompt, **self._kwargs(req, chat=True))

    async def arun(self, prompt: Prompt, req: EngineRequest):
        if isinstance(prompt, str):
            return (await self.client().agenerate(prompt, **self._kwargs(req, chat=False)))[0]
        return await self.client().achat(prompt, **self._kwargs(req, chat=True))

    def run_many(self, prompts: list[str], req: EngineRequest) -> list[Any]:
        return self.client().generate(list(prompts), **self._kwargs(req, chat=False))

    async def arun_many(self, prompts: list[str], req: EngineRequest) -> list[Any]:
        return await self.client().agenerate(list(prompts), **self._kwargs(req, chat=False))

    def stream(self, prompt: Prompt, req: EngineRequest) -> Iterator[Any]:
        if isinstance(prompt, str):
            return self.client().stream(prompt, **self._kwargs(req, chat=False))
        return self.client().chat_stream(prompt, **self._kwargs(req, chat=True))

    def astream(self, prompt: Prompt, req: EngineRequest) -> AsyncIterator[Any]:
        if isinstance(prompt, str):
            return self.client().astream(prompt, **self._kwargs(req, chat=False))
        return self.client().achat_stream(prompt, **self._kwargs(req, chat=True))

    def check_forced_call(self, req: EngineRequest, made_call: bool, finish_reason: str | None) -> None:
        check_forced_call(self.base_url, self._kwargs(req, chat=True), made_call, finish_reason)

    # -- names and sizes ---------------------------------------------------------------------------
    def result_model(self, req: EngineRequest, item: Any = None) -> str:
        """The name the server answered with, else the name asked for."""
        return getattr(item, "model", None) or str(self._kwargs(req, chat=True)["model"] or self.model_name)

    def model_info(self, context_window: int | None, fallback_window: int = FALLBACK_CONTEXT_WINDOW) -> tuple[int, str]:
        """The server's ``max_model_len`` and model name. The client asks ``/v1/models`` once and remembers
        the answer (this client makes no retries: model info is read all the time); when it cannot be read
        (the server is down, or has no such endpoint) the fallback is used for a while before asking again."""
        fallback_name = self.model_name
        if context_window is not None and not is_default_model(self.model):
            return context_window, fallback_name  # nothing to ask the server
        if time.monotonic() < self._info_retry_at:
            return context_window or fallback_window, fallback_name
        client = self.client(max_retries=0)
        try:
            client.models()
        except Exception as exc:  # noqa: BLE001  (metadata must not fail; the request itself will say why)
            logger.warning("could not read the model list of %s (%s); using context_window=%s until it can be read",
                           client.base_url, exc, context_window or fallback_window)
            self._info_retry_at = time.monotonic() + REMOTE_INFO_RETRY_S
            return context_window or fallback_window, fallback_name
        ctx = context_window or client.context_window(self.model) or fallback_window
        return ctx, client.resolve_model(self.model)

    def decode_batch_size(self) -> int | None:
        return None

    # -- tokens ------------------------------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        return self.client().tokenize(text, model=self.model, add_special_tokens=False)

    def count_chat_tokens(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> int:
        return len(self.client().tokenize_messages(messages, model=self.model, tools=tools))


# ----------------------------------------------------------------------------------------------
# Picking one
# ----------------------------------------------------------------------------------------------


def owner_client(owner: Any, max_retries: int | None = None):
    """The process-wide ``RemoteClient`` for ``owner``'s ``base_url``, ``api_key`` (str or SecretStr) and
    ``max_retries`` (or the given ``max_retries``)."""
    from ._remote_client import get_client

    key = owner.api_key
    if key is not None and hasattr(key, "get_secret_value"):
        key = key.get_secret_value()
    retries = owner.max_retries if max_retries is None else max_retries
    return get_client(owner.base_url, key or None, max_retries=retries)


class PickedBackend:
    """The backend an owner picked and what it was picked for; picked again when that changes. Each
    ParaLLM class holds one (``_picked``)."""

    def __init__(self) -> None:
        self.backend: Backend | None = None
        self.key: tuple = ()

    def get(self, key: tuple, build) -> Backend:
        if self.backend is None or self.key != key:
            self.backend, self.key = build(), key
        return self.backend


def backend_for(owner: Any, options: dict[str, Any], request_model: str | None = None) -> Backend:
    """``owner``'s backend (a ParaLLM class: ``base_url``, ``api_key``, ``max_retries``, ``model``, ``_get_engine``
    / ``_aget_engine``, ``_engine``, ``engine_kwargs``, and its ``_picked``: a :class:`PickedBackend`): a
    server when ``base_url`` is set, else the in-process engine. Picked on first use and kept; picked again
    only when ``base_url``, the model or ``options`` change."""
    key = (bool(owner.base_url), owner.model, request_model, tuple(sorted(options.items())),
           getattr(owner, "allow_remote_images", None))

    def build() -> Backend:
        if owner.base_url:
            return RemoteBackend(model=owner.model, request_model=request_model,
                                 client_for=lambda retries: owner_client(owner, retries), **options)
        return EngineBackend(owner=owner, allow_remote_images=getattr(owner, "allow_remote_images", None),
                             **options)

    return owner._picked.get(key, build)


__all__ = ["Backend", "EngineBackend", "PickedBackend", "RemoteBackend", "backend_for", "check_forced_call", "owner_client"]
