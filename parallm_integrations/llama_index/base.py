"""``ParaLLMLlamaIndex``: a LlamaIndex ``FunctionCallingLLM`` on the shared in-process ParaLLM engine, or on
any OpenAI-compatible server (``base_url=``).

Why not ``CustomLLM``: its ``achat`` / ``acomplete`` call the sync method on the event loop, so every
async LlamaIndex path (tree-summarize / accumulate with ``use_async``, sub-question engines, agents,
``aquery`` fan-out) would run one request at a time. Here all eight endpoints are native:

* sync calls submit to the engine and block only the calling thread;
* async calls submit with ``loop=asyncio.get_running_loop()``, so results are delivered to *that* loop
  (LlamaIndex's ``asyncio_run`` may run a second loop in a helper thread) and the loop is never blocked;
* every request is aborted when its caller stops early (exception, task cancellation, a closed stream),
  so the engine frees its batch slot and KV at the next step.

Many concurrent calls from anywhere in the process become concurrent requests in one continuous batch.

With ``base_url`` the same requests go to a server through the official ``openai`` client (async calls on
``AsyncOpenAI``; leaving a stream closes the HTTP stream, which aborts the request on ``parallm serve``,
vLLM and SGLang). Requests and responses are built by the same code either way (``parallm_integrations.backends``).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
    ToolCallBlock,
)
from llama_index.core.bridge.pydantic import BaseModel, Field, PrivateAttr, SecretStr, model_validator
from llama_index.core.constants import DEFAULT_CONTEXT_WINDOW, DEFAULT_NUM_OUTPUTS
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.events.llm import (
    LLMStructuredPredictEndEvent,
    LLMStructuredPredictInProgressEvent,
    LLMStructuredPredictStartEvent,
)
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection
from llama_index.core.llms.utils import parse_partial_json
from llama_index.core.types import PydanticProgramMode

from parallm_integrations._engine_calls import resolve_engine
from parallm_integrations._request import EngineRequest, ToolRules, build_request, check_sampling
from parallm_integrations.backends import Backend, PickedBackend, backend_for, same_model
from parallm_integrations.llama_index._messages import (  # noqa: F401  (message_to_dict: re-exported)
    amessages_to_dicts,
    json_schema_format,
    legacy_tool_call,
    message_to_dict,
    messages_to_dicts,
    resolve_tool_choice,
    tool_to_openai,
)
from parallm_integrations.llama_index._structured import (
    astream_objects,
    parse_structured,
    stream_objects,
    structured_messages,
)
from parallm_integrations.llama_index._responses import (
    ChatStream,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
)

if TYPE_CHECKING:
    from llama_index.core.prompts import BasePromptTemplate
    from llama_index.core.tools.types import BaseTool

dispatcher = get_dispatcher(__name__)
logger = logging.getLogger(__name__)

#: Per-call kwargs LlamaIndex passes around for its own bookkeeping; never sent to the engine.
_LLAMA_INDEX_ONLY_KWARGS = ("formatted", "verbose", "strict", "stream", "tool_required",
                            "allow_parallel_tool_calls", "error_on_no_tool_call")
#: Object fields that are engine sampling settings (OpenAI names).
_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                    "presence_penalty", "frequency_penalty", "seed", "speculative")
#: LlamaIndex's tools: its tool objects or OpenAI dicts; its tool_choice spellings; a forced call is one call
#: unless parallel calls are asked for.
_TOOL_RULES = ToolRules(to_openai=lambda tools: [tool_to_openai(t) for t in tools],
                        resolve_choice=lambda choice, names: resolve_tool_choice(choice, False, names),
                        one_forced_call=True)


def _env_secret(name: str):
    def factory() -> SecretStr | None:
        value = os.environ.get(name)
        return SecretStr(value) if value else None

    return factory


# --------------------------------------------------------------------------------------------
# The LLM
# --------------------------------------------------------------------------------------------


class ParaLLMLlamaIndex(FunctionCallingLLM):
    """LlamaIndex LLM running a local model on ParaLLM's shared continuous-batching engine, or talking to
    an OpenAI-compatible server when ``base_url`` is set.

    Constructing it loads nothing; the engine (``parallm_engine.get_engine``) is created on first use
    and shared by every ParaLLM object for the same model in the process, LangChain's ``ChatParaLLM``
    included. Concurrent calls (``aquery`` fan-out, ``TreeSummarize(use_async=True)``, sub-question
    engines, many agents) are batched together instead of queuing behind each other.

    Example::

        from llama_index.core import SummaryIndex, Document
        from parallm_integrations.llama_index import ParaLLMLlamaIndex

        llm = ParaLLMLlamaIndex(temperature=0, max_tokens=128)
        index = SummaryIndex.from_documents([Document(text="...")])
        engine = index.as_query_engine(llm=llm, response_mode="tree_summarize", use_async=True)
        print(engine.query("What is this about?"))

    Remote: ``ParaLLMLlamaIndex(base_url="http://localhost:8000/v1", api_key=...)`` sends the same requests
    to ``parallm serve`` (or vLLM, SGLang, mlx-lm's server) and nothing is loaded in-process. Chat and
    chat-template completions go to ``/v1/chat/completions`` (the server renders its template and parses
    tool calls), raw-text completions to ``/v1/completions``; the context window is the server's
    ``max_model_len``. Errors are the engine's (``ContextLengthExceededError``, ``InvalidRequestError``,
    ``QueueFullError``, ``TimeoutError``), or the ``openai`` client's for auth / connection / server errors.

    Token usage is in ``response.raw["usage"]`` (OpenAI shape, ``prompt_tokens_details.cached_tokens`` =
    prompt tokens served from the prefix cache) and in ``response.additional_kwargs``.
    """

    model: str | None = Field(
        default=None,
        description="Model to run: None for the default (SmolLM2-135M-Instruct), a path to a .gguf file, an "
        "HF/MLX model directory, or a Hugging Face model id (org/name[@revision], downloaded once into the HF "
        "cache, see docs/models.md). With base_url: the "
        "model name the server serves (None, or the default's name: the server's own model).",
    )
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Settings for the shared engine when it is first created (max_batch_size, dtype, "
        "prefill_chunk, kv_budget_bytes, enable_prefix_cache, ...). Objects with different engine_kwargs "
        "get different engines.",
    )
    temperature: float | None = Field(
        default=None,
        description="Sampling temperature, >= 0 (0 = greedy). None uses the model's recommendation where it has "
        "one (generation_config.json, GGUF metadata; SmolLM2: 0.2 with top_p 0.9), else 1.0.",
    )
    max_tokens: int | None = Field(
        default=None,
        description="Most tokens to generate per call. None generates until the model stops or the context "
        "window is full. Also LlamaIndex's num_output (the room PromptHelper leaves for the answer).",
    )
    top_p: float | None = Field(default=None, description="Nucleus sampling probability mass, in (0, 1].")
    top_k: int | None = Field(default=None, description="Keep only the top_k most likely tokens (0/-1: off).")
    min_p: float | None = Field(
        default=None, description="Drop tokens below min_p times the most likely token's probability."
    )
    repetition_penalty: float | None = Field(
        default=None, description="Multiplicative penalty on tokens already in the prompt or output (1.0 = off)."
    )
    presence_penalty: float | None = Field(
        default=None, description="OpenAI-style additive penalty in [-2, 2] on tokens already in the output."
    )
    frequency_penalty: float | None = Field(
        default=None, description="OpenAI-style penalty in [-2, 2] proportional to a token's count in the output."
    )
    seed: int | None = Field(
        default=None, description="Random seed: a seeded request samples the same tokens whatever shares the batch."
    )
    speculative: dict[str, Any] | str | bool | None = Field(
        default=None,
        description="Speculative decoding, e.g. {'method': 'ngram', 'num_tokens': 4}: drafts copied from the "
        "prompt and output, verified inside the running batch (the output is unchanged). None: the engine's "
        "default; False: off.",
    )
    priority: int | None = Field(
        default=None, strict=True,
        description="Scheduling priority (vLLM's convention): smaller runs first and is preempted last when "
        "memory runs short; None = 0. A per-call priority= overrides it.",
    )
    session: str | None = Field(
        default=None,
        description="The conversation these calls are turns of: after each call its context stays cached "
        "(pinned) for the engine's session_ttl (default 30 s), so the next turn finds it. A per-call session= "
        "overrides it; with base_url it is sent as OpenAI's user field.",
    )
    program: str | None = Field(
        default=None,
        description="The agent run these calls belong to: the engine orders admission by program (a run under "
        "way before runs that started after it) and Engine.stats()['programs'] reports each. None: the session. "
        "A per-call program= overrides it.",
    )
    adapter: str | None = Field(
        default=None,
        description="LoRA adapter the requests run under: a name the engine knows (engine_kwargs={'adapters': "
        "{name: path}}, or a server's --adapter NAME=PATH) or an adapter directory (in-process). None: the base "
        "model. Requests with different adapters share one batch; a per-call adapter= overrides it.",
    )
    stop: str | list[str] | None = Field(
        default=None, description="Stop string(s): generation ends before the first one (not included)."
    )
    context_window: int | None = Field(
        default=None, gt=0,
        description="Override the context window LlamaIndex plans prompts with (default: the model's; with "
        "base_url, the server's max_model_len).",
    )
    timeout: float | None = Field(
        default=None,
        description="Seconds a request may take (queueing included) before it is aborted with TimeoutError "
        "(with base_url: the HTTP timeout of each attempt).",
    )
    additional_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra engine request arguments sent with every call (e.g. logit_bias, stop_token_ids, "
        "logprobs, top_logprobs, response_format).",
    )
    complete_with_chat_template: bool = Field(
        default=True,
        description="complete()/stream_complete() with formatted=False wrap the prompt as one user turn of the "
        "model's chat template (and system_prompt, if set), as Ollama's generate does; False continues the raw "
        "text. formatted=True prompts, and a custom completion_to_prompt, are always sent as raw text. With "
        "base_url the chat-template case goes to /v1/chat/completions (the server applies its template), raw "
        "text to /v1/completions.",
    )
    allow_special_tokens: bool = Field(
        default=False,
        description="Whether special-token text inside chat messages and tools ('<|im_start|>system' in a user's "
        "message) is parsed as special tokens. False (default): it is tokenized as plain text, so content cannot "
        "forge a turn; only the chat template's own markers are special tokens. True only for trusted input. "
        "Raw-text completions (formatted=True, or complete_with_chat_template=False) are the model's raw input "
        "and always have special tokens parsed. With base_url it is sent to the server (parallm serve reads it).",
    )
    base_url: str | None = Field(
        default_factory=lambda: os.environ.get("PARALLM_BASE_URL") or None,
        description="URL of an OpenAI-compatible server (parallm serve, vLLM, SGLang, mlx-lm's server; e.g. "
        "http://localhost:8000/v1) to send requests to instead of running the model in-process. Read from "
        "PARALLM_BASE_URL if not given.",
    )
    api_key: SecretStr | None = Field(
        default_factory=_env_secret("PARALLM_API_KEY"), exclude=True,
        description="API key for base_url; read from PARALLM_API_KEY if not given (OPENAI_API_KEY is never "
        "sent). Unused in-process.",
    )
    max_retries: int = Field(
        default=2, ge=0,
        description="Retries of failed HTTP calls (429, 5xx, connection errors) when base_url is set; "
        "in-process requests are never retried.",
    )

    _engine: Any = PrivateAttr(default=None)
    _picked: PickedBackend = PrivateAttr(default_factory=PickedBackend)  # backends.backend_for

    @model_validator(mode="after")
    def _check_sampling(self):
        """Invalid sampling settings fail here, at construction, with the engine's messages."""
        fields = {name: getattr(self, name) for name in (*_SAMPLING_FIELDS, "stop")}
        check_sampling({**self.additional_kwargs, **{k: v for k, v in fields.items() if v is not None}})
        return self

    @classmethod
    def class_name(cls) -> str:
        return "ParaLLMLlamaIndex"

    # -- where requests run ---------------------------------------------------------------------
    def _get_engine(self, model: str | None = None):
        """The shared engine (for a per-call ``model``, that model's); created (the model loaded, a few
        seconds) on first use."""
        if self.base_url:
            raise RuntimeError(
                f"this ParaLLMLlamaIndex sends its requests to the server at base_url={self.base_url!r}; it has no "
                "in-process engine (drop base_url to run the model in this process)"
            )
        if not same_model(model, self.model):
            return resolve_engine(model, self.engine_kwargs)
        eng = self._engine
        if eng is None or not eng.is_alive:
            eng = resolve_engine(self.model, self.engine_kwargs)
            self._engine = eng
        return eng

    async def _aget_engine(self, model: str | None = None):
        eng = self._engine
        if same_model(model, self.model) and eng is not None and eng.is_alive:
            return eng
        return await asyncio.to_thread(self._get_engine, model)  # never load on the event loop

    @property
    def engine(self):
        """The shared ``parallm_engine.Engine`` (loads it on first access). Not available with base_url."""
        return self._get_engine()

    def _backend(self) -> Backend:
        """Where requests run: the server at base_url, or the in-process engine (``backends.backend_for``)."""
        return backend_for(self, {"allow_special_tokens": self.allow_special_tokens})

    # -- metadata -------------------------------------------------------------------------------
    @property
    def metadata(self) -> LLMMetadata:
        """Read often by LlamaIndex: does not load the model when the context window can be read from
        the model's config (or an engine that is already up). With base_url, the context window is the
        server's ``max_model_len`` (``GET /v1/models``, asked once), else ``context_window`` if set, else
        LlamaIndex's default; nothing is loaded in-process."""
        ctx, name = self._backend().model_info(self.context_window, DEFAULT_CONTEXT_WINDOW)
        return LLMMetadata(
            context_window=ctx,
            num_output=self.max_tokens or DEFAULT_NUM_OUTPUTS,
            is_chat_model=True,
            is_function_calling_model=True,
            model_name=name,
        )

    # -- requests -------------------------------------------------------------------------------
    def _build_request(self, kwargs: dict[str, Any]) -> EngineRequest:
        """Merge the object's fields, additional_kwargs and per-call kwargs (these win): the shared builder."""
        return build_request(self, kwargs, fields=_SAMPLING_FIELDS, extra_kwargs=self.additional_kwargs,
                             ignored_kwargs=_LLAMA_INDEX_ONLY_KWARGS, tool_rules=_TOOL_RULES)

    def _completion_input(self, prompt: str, formatted: bool) -> str | list[dict[str, Any]]:
        """What complete() sends: raw text (formatted prompts, a custom completion_to_prompt,
        complete_with_chat_template=False), else one user turn (after system_prompt, if set) for the
        model's chat template, which the engine renders in-process and the server renders remotely."""
        from llama_index.core.llms.llm import default_completion_to_prompt

        if formatted:
            return prompt
        c2p = self.completion_to_prompt
        if c2p is not None and c2p is not default_completion_to_prompt:
            return c2p(prompt)
        if not self.complete_with_chat_template:
            return prompt
        msgs = ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else [])
        return [*msgs, {"role": "user", "content": prompt}]

    # -- chat -----------------------------------------------------------------------------------
    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        req = self._build_request(kwargs)
        backend = self._backend()
        result = backend.run(messages_to_dicts(messages), req)
        return chat_response(result, req.tools, req.parallel_tool_calls is False, backend.result_model(req, result))

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        req = self._build_request(kwargs)
        backend = self._backend()
        result = await backend.arun(await amessages_to_dicts(messages), req)
        return chat_response(result, req.tools, req.parallel_tool_calls is False, backend.result_model(req, result))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        req = self._build_request(kwargs)
        req.check_streamable()
        backend = self._backend()
        deltas = backend.stream(messages_to_dicts(messages), req)

        def gen() -> ChatResponseGen:
            state = ChatStream(req.tools, req.parallel_tool_calls is False, backend.tool_markup_in_text,
                               getattr(backend, "output_parser", None))
            try:
                for item in deltas:
                    text = state.update(item)
                    if text is not None:
                        yield chat_chunk(state, text, item, backend.result_model(req, item))
            finally:
                deltas.close()  # aborts the request if the consumer stopped early

        return gen()

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        req = self._build_request(kwargs)
        req.check_streamable()
        backend = self._backend()
        await backend.aload(req)  # the model loads off the event loop; the prompt then renders at the call
        deltas = backend.astream(await amessages_to_dicts(messages), req)

        async def gen() -> ChatResponseAsyncGen:
            state = ChatStream(req.tools, req.parallel_tool_calls is False, backend.tool_markup_in_text,
                               getattr(backend, "output_parser", None))
            try:
                async for item in deltas:
                    text = state.update(item)
                    if text is not None:
                        yield chat_chunk(state, text, item, backend.result_model(req, item))
            finally:
                await deltas.aclose()  # aborts the request if the consumer stopped early

        return gen()

    # -- completion -----------------------------------------------------------------------------
    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        req = self._build_request(kwargs)
        backend = self._backend()
        result = backend.run(self._completion_input(prompt, formatted), req)
        return completion_response(result, backend.result_model(req, result))

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        req = self._build_request(kwargs)
        backend = self._backend()
        result = await backend.arun(self._completion_input(prompt, formatted), req)
        return completion_response(result, backend.result_model(req, result))

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        req = self._build_request(kwargs)
        req.check_streamable()
        backend = self._backend()
        deltas = backend.stream(self._completion_input(prompt, formatted), req)

        def gen() -> CompletionResponseGen:
            text = ""
            try:
                for item in deltas:
                    text += item.text
                    if item.text or item.usage is not None:
                        yield completion_chunk(text, item, backend.result_model(req, item))
            finally:
                deltas.close()

        return gen()

    @llm_completion_callback()
    async def astream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseAsyncGen:
        req = self._build_request(kwargs)
        req.check_streamable()
        backend = self._backend()
        await backend.aload(req)  # the model loads off the event loop; the prompt then renders at the call
        deltas = backend.astream(self._completion_input(prompt, formatted), req)

        async def gen() -> CompletionResponseAsyncGen:
            text = ""
            try:
                async for item in deltas:
                    text += item.text
                    if item.text or item.usage is not None:
                        yield completion_chunk(text, item, backend.result_model(req, item))
            finally:
                await deltas.aclose()

        return gen()

    # -- tool calling -----------------------------------------------------------------------------
    def _prepare_chat_with_tools(
        self,
        tools: Sequence[BaseTool],
        user_msg: str | ChatMessage | None = None,
        chat_history: list[ChatMessage] | None = None,
        verbose: bool = False,
        allow_parallel_tool_calls: bool = False,
        tool_required: bool = False,
        tool_choice: Any = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """The ``chat`` kwargs for a call with ``tools``: OpenAI tool dicts rendered into the prompt by the
        model's chat template; ``tool_required`` (or a tool name as ``tool_choice``) constrains decoding so
        the answer is a valid call."""
        openai_tools = [tool_to_openai(t) for t in tools]
        messages = list(chat_history or [])
        if user_msg is not None:
            messages.append(ChatMessage(role=MessageRole.USER, content=user_msg) if isinstance(user_msg, str)
                            else user_msg)
        out: dict[str, Any] = {"messages": messages, **kwargs}
        if openai_tools:
            names = [t["function"]["name"] for t in openai_tools]
            out["tools"] = openai_tools
            out["tool_choice"] = resolve_tool_choice(tool_choice, tool_required, names)
            out["parallel_tool_calls"] = bool(allow_parallel_tool_calls)
        return out

    def get_tool_calls_from_response(
        self, response: ChatResponse, error_on_no_tool_call: bool = True, **kwargs: Any
    ) -> list[ToolSelection]:
        """Tool calls of a (possibly partial, streamed) response as ``ToolSelection``s."""
        selections: list[ToolSelection] = []
        blocks = [b for b in response.message.blocks if isinstance(b, ToolCallBlock)]
        if blocks:
            raw_calls = [(b.tool_call_id, b.tool_name, b.tool_kwargs) for b in blocks]
        else:
            raw_calls = []
            for tc in response.message.additional_kwargs.get("tool_calls") or []:
                d = legacy_tool_call(tc)
                if d is not None:
                    raw_calls.append((d["id"], d["function"]["name"], d["function"]["arguments"]))
        for call_id, name, args in raw_calls:
            if isinstance(args, str):
                try:
                    args = parse_partial_json(args) if args.strip() else {}
                except (ValueError, TypeError):
                    args = {}
            if not isinstance(args, dict):
                args = {}
            selections.append(ToolSelection(tool_id=call_id or "", tool_name=name, tool_kwargs=args))
        if not selections and error_on_no_tool_call:
            # A call max_tokens cut off is not a call (LlamaIndex has no invalid calls): say why it is missing.
            cut = " (the answer was cut off by max_tokens: finish_reason 'length')" \
                if isinstance(response.raw, dict) and response.raw.get("finish_reason") == "length" else ""
            raise ValueError(f"Expected at least one tool call, but got 0 tool calls{cut}. "
                             f"Response: {response.message.content!r}")
        return selections

    # -- structured output ------------------------------------------------------------------------
    def _structured_call(self, output_cls: type[BaseModel], prompt: BasePromptTemplate, prompt_args: dict[str, Any],
                         llm_kwargs: dict[str, Any] | None) -> tuple[list[ChatMessage], dict[str, Any]]:
        """The messages (the schema in the system message) and chat kwargs (decoding constrained to the schema)."""
        messages = structured_messages(self._get_messages(prompt, **prompt_args), output_cls)
        return messages, {**(llm_kwargs or {}), "response_format": json_schema_format(output_cls)}

    @dispatcher.span
    def structured_predict(self, output_cls: type[BaseModel], prompt: BasePromptTemplate,
                           llm_kwargs: dict[str, Any] | None = None, **prompt_args: Any) -> BaseModel:
        """Decoding constrained to ``output_cls``'s JSON schema (the answer always parses unless max_tokens
        cuts it). With ``pydantic_program_mode`` other than DEFAULT, LlamaIndex's program is used."""
        if self.pydantic_program_mode != PydanticProgramMode.DEFAULT:
            return super().structured_predict(output_cls, prompt, llm_kwargs=llm_kwargs, **prompt_args)
        dispatcher.event(LLMStructuredPredictStartEvent(output_cls=output_cls, template=prompt,
                                                        template_args=prompt_args))
        messages, kwargs = self._structured_call(output_cls, prompt, prompt_args, llm_kwargs)
        result = parse_structured(output_cls, self.chat(messages, **kwargs))
        dispatcher.event(LLMStructuredPredictEndEvent(output=result))
        return result

    @dispatcher.span
    async def astructured_predict(self, output_cls: type[BaseModel], prompt: BasePromptTemplate,
                                  llm_kwargs: dict[str, Any] | None = None, **prompt_args: Any) -> BaseModel:
        if self.pydantic_program_mode != PydanticProgramMode.DEFAULT:
            return await super().astructured_predict(output_cls, prompt, llm_kwargs=llm_kwargs, **prompt_args)
        dispatcher.event(LLMStructuredPredictStartEvent(output_cls=output_cls, template=prompt,
                                                        template_args=prompt_args))
        messages, kwargs = self._structured_call(output_cls, prompt, prompt_args, llm_kwargs)
        result = parse_structured(output_cls, await self.achat(messages, **kwargs))
        dispatcher.event(LLMStructuredPredictEndEvent(output=result))
        return result

    @dispatcher.span
    def stream_structured_predict(self, output_cls: type[BaseModel], prompt: BasePromptTemplate,
                                  llm_kwargs: dict[str, Any] | None = None, **prompt_args: Any):
        """:meth:`structured_predict`, streamed: decoding constrained to ``output_cls``'s schema; yields the
        object so far (a ``FlexibleModel``) as the JSON grows, then the complete ``output_cls`` instance."""
        if self.pydantic_program_mode != PydanticProgramMode.DEFAULT:
            yield from super().stream_structured_predict(output_cls, prompt, llm_kwargs=llm_kwargs, **prompt_args)
            return
        dispatcher.event(LLMStructuredPredictStartEvent(output_cls=output_cls, template=prompt,
                                                        template_args=prompt_args))
        messages, kwargs = self._structured_call(output_cls, prompt, prompt_args, llm_kwargs)
        obj = None
        for obj in stream_objects(self.stream_chat(messages, **kwargs), output_cls):
            dispatcher.event(LLMStructuredPredictInProgressEvent(output=obj))
            yield obj
        dispatcher.event(LLMStructuredPredictEndEvent(output=obj))

    @dispatcher.span
    async def astream_structured_predict(self, output_cls: type[BaseModel], prompt: BasePromptTemplate,
                                         llm_kwargs: dict[str, Any] | None = None, **prompt_args: Any):
        """Async :meth:`stream_structured_predict` (awaited, it returns the async generator, as LlamaIndex's)."""
        if self.pydantic_program_mode != PydanticProgramMode.DEFAULT:
            return await super().astream_structured_predict(output_cls, prompt, llm_kwargs=llm_kwargs,
                                                            **prompt_args)
        messages, kwargs = self._structured_call(output_cls, prompt, prompt_args, llm_kwargs)

        async def gen():
            dispatcher.event(LLMStructuredPredictStartEvent(output_cls=output_cls, template=prompt,
                                                            template_args=prompt_args))
            obj = None
            async for obj in astream_objects(await self.astream_chat(messages, **kwargs), output_cls):
                dispatcher.event(LLMStructuredPredictInProgressEvent(output=obj))
                yield obj
            dispatcher.event(LLMStructuredPredictEndEvent(output=obj))

        return gen()

    # -- tokens ---------------------------------------------------------------------------------
    def get_token_ids(self, text: str) -> list[int]:
        """Token ids of ``text`` for this model's tokenizer (no special tokens added); with base_url, from
        the server's ``/tokenize`` (``NotImplementedError`` for a server without one)."""
        return self._backend().tokenize(text)
