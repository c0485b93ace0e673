"""``ParaLLMLlamaIndex``: a LlamaIndex ``FunctionCallingLLM`` on the shared in-process ParaLLM engine.

Why not ``CustomLLM``: its ``achat`` / ``acomplete`` call the sync method on the event loop, so every
async LlamaIndex path (tree-summarize / accumulate with ``use_async``, sub-question engines, agents,
``aquery`` fan-out) would run one request at a time. Here all eight endpoints are native:

* sync calls submit to the engine and block only the calling thread;
* async calls submit with ``loop=asyncio.get_running_loop()``, so results are delivered to *that* loop
  (LlamaIndex's ``asyncio_run`` may run a second loop in a helper thread) and the loop is never blocked;
* every request is aborted when its caller stops early (exception, task cancellation, a closed stream),
  so the engine frees its batch slot and KV at the next step.

Many concurrent calls from anywhere in the process become concurrent requests in one continuous batch.
"""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from llama_index.core.base.llms.types import (
    CachePoint,
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CitableBlock,
    CitationBlock,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    LogProb,
    MessageRole,
    TextBlock,
    ThinkingBlock,
    ToolCallBlock,
)
from llama_index.core.bridge.pydantic import BaseModel, Field, PrivateAttr
from llama_index.core.constants import DEFAULT_NUM_OUTPUTS
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.events.llm import (
    LLMStructuredPredictEndEvent,
    LLMStructuredPredictStartEvent,
)
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection
from llama_index.core.llms.utils import parse_partial_json
from llama_index.core.types import PydanticProgramMode

from parallm_integrations._common import (
    DEFAULT_MODEL_NAME,
    is_default_model,
    peek_context_window,
    resolve_engine,
)

if TYPE_CHECKING:
    from llama_index.core.prompts import BasePromptTemplate
    from llama_index.core.tools.types import BaseTool

dispatcher = get_dispatcher(__name__)

#: Per-call kwargs LlamaIndex passes around for its own bookkeeping; never sent to the engine.
_LLAMA_INDEX_ONLY_KWARGS = ("formatted", "verbose", "strict", "stream", "tool_required",
                            "allow_parallel_tool_calls", "error_on_no_tool_call")
#: Object fields that are engine sampling settings (OpenAI names).
_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                    "presence_penalty", "frequency_penalty", "seed")
_ROLE_MAP = {"developer": "system", "chatbot": "assistant", "model": "assistant", "function": "tool"}


# --------------------------------------------------------------------------------------------
# LlamaIndex messages / tools -> the engine's OpenAI shapes
# --------------------------------------------------------------------------------------------


def _block_text(block: Any, role: str) -> str | None:
    """Text of one content block; None for blocks that carry nothing for the model to re-read."""
    if isinstance(block, TextBlock):
        return block.text
    if isinstance(block, (ThinkingBlock, CachePoint, ToolCallBlock)):
        return None
    if isinstance(block, CitableBlock):
        return "".join(t for t in (_block_text(b, role) for b in block.content) if t)
    if isinstance(block, CitationBlock):
        return _block_text(block.cited_content, role)
    raise ValueError(
        f"ParaLLM models accept text only; a {role} message has a {getattr(block, 'block_type', type(block).__name__)!r} "
        "content block. Pass text, or describe the attachment in words."
    )


def _call_to_openai(call_id: str | None, name: str, arguments: Any) -> dict[str, Any]:
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments if arguments is not None else {}, ensure_ascii=False)
    return {"id": call_id or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _legacy_tool_call(tc: Any) -> dict[str, Any] | None:
    """One entry of ``additional_kwargs["tool_calls"]`` (OpenAI dict or object, ToolSelection) as a dict."""
    if isinstance(tc, ToolSelection):
        return _call_to_openai(tc.tool_id, tc.tool_name, tc.tool_kwargs)
    if hasattr(tc, "model_dump"):
        tc = tc.model_dump()
    if not isinstance(tc, Mapping):
        return None
    fn = tc.get("function") or tc
    name = fn.get("name")
    if not isinstance(name, str):
        return None
    return _call_to_openai(tc.get("id"), name, fn.get("arguments", fn.get("args", {})))


def message_to_dict(message: ChatMessage) -> dict[str, Any]:
    """A LlamaIndex ``ChatMessage`` as the OpenAI-shaped dict the engine's chat template renders."""
    role = message.role.value if isinstance(message.role, MessageRole) else str(message.role)
    role = _ROLE_MAP.get(role, role)
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for block in message.blocks:
        if isinstance(block, ToolCallBlock):
            calls.append(_call_to_openai(block.tool_call_id, block.tool_name, block.tool_kwargs))
            continue
        text = _block_text(block, role)
        if text is not None:
            texts.append(text)
    if not calls and role == "assistant":
        for tc in message.additional_kwargs.get("tool_calls") or []:
            d = _legacy_tool_call(tc)
            if d is not None:
                calls.append(d)
    out: dict[str, Any] = {"role": role, "content": "\n".join(texts)}
    if calls:
        out["tool_calls"] = calls
    if role == "tool":
        call_id = message.additional_kwargs.get("tool_call_id")
        if call_id:
            out["tool_call_id"] = call_id
        name = message.additional_kwargs.get("name") or message.additional_kwargs.get("tool_name")
        if name:
            out["name"] = name
    return out


def messages_to_dicts(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    return [message_to_dict(m) for m in messages]


def _tool_to_openai(tool: Any) -> dict[str, Any]:
    if isinstance(tool, Mapping):
        if tool.get("type") == "function" and isinstance(tool.get("function"), Mapping):
            return dict(tool)
        if "name" in tool:  # a bare function spec
            return {"type": "function", "function": dict(tool)}
        raise ValueError(f"unsupported tool: {dict(tool)!r}")
    metadata = getattr(tool, "metadata", None)
    if metadata is not None and hasattr(metadata, "to_openai_tool"):
        return metadata.to_openai_tool(skip_length_check=True)
    raise ValueError(f"unsupported tool {tool!r}: pass LlamaIndex tools or OpenAI tool dicts")


def _close_schema(schema: Any) -> Any:
    """A copy of a JSON schema where every object without an explicit ``additionalProperties`` gets
    ``additionalProperties: false``. Under constrained decoding an open schema lets a small model
    invent keys until it runs out of tokens; closed, it writes the declared fields and stops."""
    if isinstance(schema, list):
        return [_close_schema(s) for s in schema]
    if not isinstance(schema, Mapping):
        return schema
    out = {k: _close_schema(v) for k, v in schema.items()}
    for key in ("properties", "$defs", "definitions", "patternProperties"):
        if isinstance(schema.get(key), Mapping):
            out[key] = {name: _close_schema(sub) for name, sub in schema[key].items()}
    stype = schema.get("type")
    is_object = stype == "object" or (isinstance(stype, list) and "object" in stype)
    if (is_object or "properties" in schema) and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


def _close_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for t in tools:
        fn = dict(t["function"])
        fn["parameters"] = _close_schema(fn.get("parameters") or {"type": "object", "properties": {}})
        out.append({**t, "function": fn})
    return out


def _resolve_tool_choice(tool_choice: Any, tool_required: bool, names: list[str]) -> Any:
    """LlamaIndex spellings (None, "auto", "none", "required"/"any", a tool name, an OpenAI dict)
    -> the engine's ("auto" | "none" | "required" | {"type": "function", "function": {"name"}})."""
    if tool_choice is None:
        return "required" if tool_required else "auto"
    if tool_choice is True or tool_choice in ("any", "required"):
        return "required"
    if tool_choice is False:
        return "none"
    if tool_choice in ("auto", "none"):
        return tool_choice
    if isinstance(tool_choice, Mapping):
        name = (tool_choice.get("function") or {}).get("name") or tool_choice.get("name")
    elif isinstance(tool_choice, str):
        name = tool_choice
    else:
        raise TypeError(f"unsupported tool_choice: {tool_choice!r}")
    if name not in names:
        raise ValueError(f"tool_choice names {name!r}, which is not among the tools {names}")
    return {"type": "function", "function": {"name": name}}


def _json_schema_format(output_cls: type[BaseModel]) -> dict[str, Any]:
    schema = output_cls.model_json_schema()
    return {"type": "json_schema",
            "json_schema": {"name": schema.get("title") or output_cls.__name__, "schema": _close_schema(schema),
                            "strict": True}}


# --------------------------------------------------------------------------------------------
# Engine output -> LlamaIndex responses
# --------------------------------------------------------------------------------------------


def _usage_kwargs(usage: Any) -> dict[str, int]:
    if usage is None:
        return {}
    return {"prompt_tokens": int(usage.prompt_tokens), "completion_tokens": int(usage.completion_tokens),
            "total_tokens": int(usage.prompt_tokens + usage.completion_tokens),
            "cached_tokens": int(usage.cached_tokens)}


def _raw(request_id: str, model: str, finish_reason: str | None, usage: Any,
         tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    raw: dict[str, Any] = {"id": request_id, "model": model, "finish_reason": finish_reason}
    if usage is not None:
        raw["usage"] = usage.as_dict()
    if tool_calls:
        raw["tool_calls"] = tool_calls
    return raw


def _logprobs(logprobs: Sequence[Any] | None) -> list[list[LogProb]] | None:
    """Engine token logprobs -> LlamaIndex's per-position lists (the chosen token, then alternatives)."""
    if not logprobs:
        return None
    out = []
    for lp in logprobs:
        row = [LogProb(token=lp.token, logprob=float(lp.logprob), bytes=list(lp.token.encode("utf-8")))]
        for _tid, tok, val in lp.top_logprobs or []:
            if tok != lp.token:
                row.append(LogProb(token=tok, logprob=float(val), bytes=list(tok.encode("utf-8"))))
        out.append(row)
    return out


class _Calls:
    """The tool calls of one response, cumulative: ``{"id", "name", "args"}`` with ``args`` the argument
    JSON text while it streams and the parsed dict once the call is complete."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []

    def blocks(self) -> list[ToolCallBlock]:
        return [ToolCallBlock(tool_call_id=c["id"], tool_name=c["name"], tool_kwargs=c["args"]) for c in self.items]

    def openai(self) -> list[dict[str, Any]]:
        return [_call_to_openai(c["id"], c["name"], c["args"]) for c in self.items]


def _assistant_message(content: str, calls: _Calls) -> ChatMessage:
    kwargs: dict[str, Any] = {}
    if calls.items:
        kwargs["tool_calls"] = calls.openai()
    return ChatMessage(role=MessageRole.ASSISTANT, blocks=[TextBlock(text=content), *calls.blocks()],
                       additional_kwargs=kwargs)


class _ChatStream:
    """Turns engine text deltas into cumulative chat state: content, and tool calls as they stream."""

    def __init__(self, tools: list[dict[str, Any]] | None, single_call: bool):
        self.single = single_call
        self.content = ""
        self.calls = _Calls()
        self._parser = None
        self._by_index: dict[int, dict[str, Any]] = {}
        self._finished = False
        if tools:
            from parallm_engine.chat_format import ToolCallStreamParser

            self._parser = ToolCallStreamParser()

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (content delta, whether the tool calls changed)."""
        if self._parser is None:
            self.content += text
            return text, False
        return self._apply(self._parser.feed(text))

    def finish(self) -> tuple[str, bool]:
        if self._parser is None or self._finished:
            return "", False
        self._finished = True
        delta, _ = self._apply(self._parser.finish())
        # The complete calls, with parsed arguments (a call whose body never became valid JSON is dropped).
        parsed = list(self._parser.calls)
        if self.single:
            parsed = parsed[:1]
        before = [(c["id"], c["args"]) for c in self.calls.items]
        self.calls.items = [{"id": c.id, "name": c.name, "args": dict(c.arguments)} for c in parsed]
        return delta, before != [(c["id"], c["args"]) for c in self.calls.items]

    def _apply(self, events: list) -> tuple[str, bool]:
        from parallm_engine.chat_format import ContentDelta, ToolCallDelta

        delta, changed = [], False
        for ev in events:
            if isinstance(ev, ContentDelta):
                delta.append(ev.text)
            elif isinstance(ev, ToolCallDelta):
                if self.single and ev.index > 0:
                    continue
                call = self._by_index.get(ev.index)
                if call is None:
                    call = {"id": ev.id or f"call_{uuid.uuid4().hex[:24]}", "name": ev.name or "", "args": ""}
                    self._by_index[ev.index] = call
                    self.calls.items.append(call)
                if ev.arguments_delta:
                    call["args"] += ev.arguments_delta
                changed = True
        text = "".join(delta)
        self.content += text
        return text, changed


class _Deadline:
    """Aborts a request when ``timeout`` seconds pass (sync: a timer thread; async: the loop's call_later)."""

    def __init__(self, handle, timeout: float | None, loop: asyncio.AbstractEventLoop | None):
        self.fired = False
        self.timeout = timeout
        self._timer: Any = None
        if not timeout or timeout <= 0:
            return

        def fire() -> None:
            if not handle.request.finished:
                self.fired = True
                handle.abort()

        if loop is not None:
            self._timer = loop.call_later(timeout, fire)
        else:
            self._timer = threading.Timer(timeout, fire)
            self._timer.daemon = True
            self._timer.start()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


class _Request:
    """One call's settings, split the way the engine wants them."""

    def __init__(self, sampling: dict[str, Any], tools: list[dict[str, Any]] | None = None,
                 tool_choice: Any = None, parallel_tool_calls: bool | None = None,
                 response_format: dict[str, Any] | None = None, timeout: float | None = None):
        self.sampling = sampling
        self.tools = tools
        self.tool_choice = tool_choice
        self.parallel_tool_calls = parallel_tool_calls
        self.response_format = response_format
        self.timeout = timeout

    @property
    def single_call(self) -> bool:
        return self.parallel_tool_calls is False

    def submit_kwargs(self) -> dict[str, Any]:
        kw = dict(self.sampling)
        if self.tools:
            kw["tools"] = _close_tools(self.tools)  # decode closed schemas: only declared arguments
            kw["tool_choice"] = self.tool_choice
            if self.parallel_tool_calls is not None:
                kw["parallel_tool_calls"] = self.parallel_tool_calls
        if self.response_format is not None:
            kw["response_format"] = self.response_format
        return kw


# --------------------------------------------------------------------------------------------
# The LLM
# --------------------------------------------------------------------------------------------


class ParaLLMLlamaIndex(FunctionCallingLLM):
    """LlamaIndex LLM running a local model on ParaLLM's shared continuous-batching engine.

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

    Token usage is in ``response.raw["usage"]`` (OpenAI shape, ``prompt_tokens_details.cached_tokens`` =
    prompt tokens served from the prefix cache) and in ``response.additional_kwargs``.
    """

    model: str | None = Field(
        default=None,
        description="Model to run: None for the default (SmolLM2-135M-Instruct), a path to a .gguf file, an "
        "HF/MLX model directory, or a repo id already in the local Hugging Face cache.",
    )
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Settings for the shared engine when it is first created (max_batch_size, dtype, "
        "prefill_chunk, kv_budget_bytes, enable_prefix_cache, ...). Objects with different engine_kwargs "
        "get different engines.",
    )
    temperature: float | None = Field(
        default=None, ge=0.0, description="Sampling temperature (0 = greedy). None uses the engine default (1.0)."
    )
    max_tokens: int | None = Field(
        default=None, gt=0,
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
    stop: str | list[str] | None = Field(
        default=None, description="Stop string(s): generation ends before the first one (not included)."
    )
    context_window: int | None = Field(
        default=None, gt=0,
        description="Override the context window LlamaIndex plans prompts with (default: the model's).",
    )
    timeout: float | None = Field(
        default=None, description="Seconds a request may take (queueing included) before it is aborted."
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
        "text. formatted=True prompts, and a custom completion_to_prompt, are always sent as raw text.",
    )
    base_url: str | None = Field(
        default=None,
        description="URL of a ParaLLM server to use instead of the in-process engine (not available yet).",
    )
    api_key: str | None = Field(default=None, exclude=True, description="API key for base_url.")

    _engine: Any = PrivateAttr(default=None)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._check_local()

    @classmethod
    def class_name(cls) -> str:
        return "ParaLLMLlamaIndex"

    # -- the engine -----------------------------------------------------------------------------
    def _check_local(self) -> None:
        if self.base_url:
            raise NotImplementedError(
                "ParaLLMLlamaIndex(base_url=...) (a remote ParaLLM server) is not available in this build; "
                "drop base_url to run the model in-process on the shared engine"
            )

    def _get_engine(self):
        """The shared engine; created (the model loaded, a few seconds) on first use."""
        self._check_local()
        eng = self._engine
        if eng is None or getattr(eng, "_dead", None) is not None:
            eng = resolve_engine(self.model, self.engine_kwargs)
            self._engine = eng
        return eng

    async def _aget_engine(self):
        eng = self._engine
        if eng is not None and getattr(eng, "_dead", None) is None:
            return eng
        return await asyncio.to_thread(self._get_engine)  # never load on the event loop

    @property
    def engine(self):
        """The shared ``parallm_engine.Engine`` (loads it on first access)."""
        return self._get_engine()

    @property
    def metadata(self) -> LLMMetadata:
        """Read often by LlamaIndex: does not load the model when the context window can be read from
        the model's config (or an engine that is already up)."""
        eng = self._engine
        ctx = self.context_window
        if ctx is None and eng is not None:
            ctx = int(eng.context_window)
        if ctx is None and not self.base_url:
            ctx = peek_context_window(self.model, self.engine_kwargs)
        if ctx is None:
            eng = self._get_engine()
            ctx = int(eng.context_window)
        if eng is not None:
            name = eng.model_name
        elif is_default_model(self.model):
            name = DEFAULT_MODEL_NAME
        else:
            name = str(self.model)
        return LLMMetadata(
            context_window=ctx,
            num_output=self.max_tokens or DEFAULT_NUM_OUTPUTS,
            is_chat_model=True,
            is_function_calling_model=True,
            model_name=name,
        )

    # -- requests -------------------------------------------------------------------------------
    def _build_request(self, kwargs: dict[str, Any]) -> _Request:
        """Merge the object's fields, additional_kwargs and per-call kwargs (these win)."""
        kw = {**self.additional_kwargs, **kwargs}
        for key in _LLAMA_INDEX_ONLY_KWARGS:
            kw.pop(key, None)
        sampling: dict[str, Any] = {}
        for name in _SAMPLING_FIELDS:
            value = getattr(self, name)
            if value is not None:
                sampling[name] = value
        if "max_completion_tokens" in kw:
            kw["max_tokens"] = kw.pop("max_completion_tokens")
        stop = kw.pop("stop", self.stop)
        if stop:
            sampling["stop"] = [stop] if isinstance(stop, str) else list(stop)
        timeout = kw.pop("timeout", self.timeout)
        tools = kw.pop("tools", None)
        tool_choice = kw.pop("tool_choice", None)
        parallel = kw.pop("parallel_tool_calls", None)
        response_format = kw.pop("response_format", None)
        sampling.update(kw)
        req = _Request(sampling, timeout=timeout, response_format=response_format)
        if tools:
            openai_tools = [_tool_to_openai(t) for t in tools]
            names = [t["function"]["name"] for t in openai_tools]
            choice = _resolve_tool_choice(tool_choice, False, names)
            if choice != "none":  # nothing may be called: do not even show the tools
                req.tools, req.tool_choice = openai_tools, choice
                if choice == "required" and parallel is None:
                    # Under a forced-call grammar a small model is offered call after call and may keep
                    # calling until max_tokens; a forced call is one call unless parallel is asked for.
                    parallel = False
                req.parallel_tool_calls = parallel
        return req

    def _chat_prompt(self, engine, messages: Sequence[ChatMessage], req: _Request) -> list[int]:
        return engine.apply_chat_template(messages_to_dicts(messages), tools=req.tools)

    def _completion_prompt(self, engine, prompt: str, formatted: bool) -> str | list[int]:
        from llama_index.core.llms.llm import default_completion_to_prompt

        if formatted:
            return prompt
        c2p = self.completion_to_prompt
        if c2p is not None and c2p is not default_completion_to_prompt:
            return c2p(prompt)
        if not self.complete_with_chat_template:
            return prompt
        msgs = ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else [])
        return engine.apply_chat_template([*msgs, {"role": "user", "content": prompt}])

    # Every request goes through these four: submit, iterate, and abort unless it finished.
    def _iter_sync(self, engine, prompt, req: _Request) -> Iterator[Any]:
        from parallm_engine import RequestCancelledError

        handle = engine.submit(prompt, **req.submit_kwargs())
        deadline = _Deadline(handle, req.timeout, None)
        try:
            yield from handle
        except RequestCancelledError:
            if deadline.fired:
                raise TimeoutError(f"ParaLLM request timed out after {req.timeout} s (aborted)") from None
            raise
        finally:
            deadline.cancel()
            if not handle.request.finished:
                handle.abort()
        yield handle.request.result  # the GenerationResult, last

    async def _iter_async(self, engine, prompt, req: _Request) -> AsyncIterator[Any]:
        from parallm_engine import RequestCancelledError

        loop = asyncio.get_running_loop()
        handle = engine.submit(prompt, loop=loop, **req.submit_kwargs())
        deadline = _Deadline(handle, req.timeout, loop)
        try:
            async for delta in handle:
                yield delta
        except RequestCancelledError:
            if deadline.fired:
                raise TimeoutError(f"ParaLLM request timed out after {req.timeout} s (aborted)") from None
            raise
        finally:
            deadline.cancel()
            if not handle.request.finished:
                handle.abort()
        yield handle.request.result

    @staticmethod
    def _is_result(item: Any) -> bool:
        return hasattr(item, "choices")

    def _run_sync(self, engine, prompt, req: _Request):
        result = None
        for item in self._iter_sync(engine, prompt, req):
            result = item
        return result

    async def _run_async(self, engine, prompt, req: _Request):
        result = None
        gen = self._iter_async(engine, prompt, req)
        try:
            async for item in gen:
                result = item
        finally:
            await gen.aclose()
        return result

    # -- building responses -----------------------------------------------------------------------
    def _chat_response(self, result, req: _Request, model_name: str) -> ChatResponse:
        from parallm_engine.chat_format import parse_tool_calls

        choice = result.choices[0]
        calls = _Calls()
        content = choice.text
        if req.tools:
            if choice.content is not None:
                content, parsed = choice.content, list(choice.tool_calls)
            else:
                content, parsed = parse_tool_calls(choice.text, req.tools)
            if req.single_call:
                parsed = parsed[:1]
            calls.items = [{"id": c.id, "name": c.name, "args": dict(c.arguments)} for c in parsed]
        finish = "tool_calls" if calls.items and choice.finish_reason == "stop" else choice.finish_reason
        return ChatResponse(
            message=_assistant_message(content, calls),
            raw=_raw(result.request_id, model_name, finish, result.usage, calls.openai()),
            additional_kwargs=_usage_kwargs(result.usage),
            logprobs=_logprobs(choice.logprobs),
        )

    @staticmethod
    def _completion_response(result, model_name: str) -> CompletionResponse:
        choice = result.choices[0]
        return CompletionResponse(
            text=choice.text,
            raw=_raw(result.request_id, model_name, choice.finish_reason, result.usage),
            additional_kwargs=_usage_kwargs(result.usage),
            logprobs=_logprobs(choice.logprobs),
        )

    def _chat_chunk(self, state: _ChatStream, delta_text: str, item, model_name: str) -> ChatResponse:
        usage = getattr(item, "usage", None)
        raw: dict[str, Any] = {"id": item.request_id, "model": model_name}
        if getattr(item, "finish_reason", None):
            finish = item.finish_reason
            raw["finish_reason"] = "tool_calls" if state.calls.items and finish == "stop" else finish
        if usage is not None:
            raw["usage"] = usage.as_dict()
        return ChatResponse(
            message=_assistant_message(state.content, state.calls),
            delta=delta_text,
            raw=raw,
            additional_kwargs=_usage_kwargs(usage),
            logprobs=_logprobs(getattr(item, "logprobs", None)),
        )

    @staticmethod
    def _check_streamable(req: _Request) -> None:
        if (req.sampling.get("n") or 1) > 1:
            raise ValueError("n must be 1 when streaming")

    # -- chat -----------------------------------------------------------------------------------
    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        req = self._build_request(kwargs)
        engine = self._get_engine()
        result = self._run_sync(engine, self._chat_prompt(engine, messages, req), req)
        return self._chat_response(result, req, engine.model_name)

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        req = self._build_request(kwargs)
        engine = await self._aget_engine()
        result = await self._run_async(engine, self._chat_prompt(engine, messages, req), req)
        return self._chat_response(result, req, engine.model_name)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        req = self._build_request(kwargs)
        self._check_streamable(req)
        engine = self._get_engine()
        prompt = self._chat_prompt(engine, messages, req)

        def gen() -> ChatResponseGen:
            state = _ChatStream(req.tools, req.single_call)
            it = self._iter_sync(engine, prompt, req)
            try:
                for item in it:
                    if self._is_result(item):
                        break
                    text, changed = state.feed(item.text)
                    if item.usage is not None or item.finish_reason is not None:
                        tail, changed2 = state.finish()
                        text, changed = text + tail, changed or changed2
                    if text or changed or item.usage is not None:
                        yield self._chat_chunk(state, text, item, engine.model_name)
            finally:
                it.close()  # aborts the request if the consumer stopped early

        return gen()

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        req = self._build_request(kwargs)
        self._check_streamable(req)
        engine = await self._aget_engine()
        prompt = self._chat_prompt(engine, messages, req)

        async def gen() -> ChatResponseAsyncGen:
            state = _ChatStream(req.tools, req.single_call)
            it = self._iter_async(engine, prompt, req)
            try:
                async for item in it:
                    if self._is_result(item):
                        break
                    text, changed = state.feed(item.text)
                    if item.usage is not None or item.finish_reason is not None:
                        tail, changed2 = state.finish()
                        text, changed = text + tail, changed or changed2
                    if text or changed or item.usage is not None:
                        yield self._chat_chunk(state, text, item, engine.model_name)
            finally:
                await it.aclose()  # aborts the request if the consumer stopped early

        return gen()

    # -- completion -----------------------------------------------------------------------------
    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        req = self._build_request(kwargs)
        engine = self._get_engine()
        result = self._run_sync(engine, self._completion_prompt(engine, prompt, formatted), req)
        return self._completion_response(result, engine.model_name)

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        req = self._build_request(kwargs)
        engine = await self._aget_engine()
        result = await self._run_async(engine, self._completion_prompt(engine, prompt, formatted), req)
        return self._completion_response(result, engine.model_name)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        req = self._build_request(kwargs)
        self._check_streamable(req)
        engine = self._get_engine()
        engine_prompt = self._completion_prompt(engine, prompt, formatted)

        def gen() -> CompletionResponseGen:
            text = ""
            it = self._iter_sync(engine, engine_prompt, req)
            try:
                for item in it:
                    if self._is_result(item):
                        break
                    text += item.text
                    if item.text or item.usage is not None:
                        yield self._completion_chunk(text, item, engine.model_name)
            finally:
                it.close()

        return gen()

    @llm_completion_callback()
    async def astream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseAsyncGen:
        req = self._build_request(kwargs)
        self._check_streamable(req)
        engine = await self._aget_engine()
        engine_prompt = self._completion_prompt(engine, prompt, formatted)

        async def gen() -> CompletionResponseAsyncGen:
            text = ""
            it = self._iter_async(engine, engine_prompt, req)
            try:
                async for item in it:
                    if self._is_result(item):
                        break
                    text += item.text
                    if item.text or item.usage is not None:
                        yield self._completion_chunk(text, item, engine.model_name)
            finally:
                await it.aclose()

        return gen()

    @staticmethod
    def _completion_chunk(text: str, item, model_name: str) -> CompletionResponse:
        raw: dict[str, Any] = {"id": item.request_id, "model": model_name}
        if item.finish_reason:
            raw["finish_reason"] = item.finish_reason
        if item.usage is not None:
            raw["usage"] = item.usage.as_dict()
        return CompletionResponse(text=text, delta=item.text, raw=raw, additional_kwargs=_usage_kwargs(item.usage),
                                  logprobs=_logprobs(item.logprobs))

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
        openai_tools = [_tool_to_openai(t) for t in tools]
        messages = list(chat_history or [])
        if user_msg is not None:
            messages.append(ChatMessage(role=MessageRole.USER, content=user_msg) if isinstance(user_msg, str)
                            else user_msg)
        out: dict[str, Any] = {"messages": messages, **kwargs}
        if openai_tools:
            names = [t["function"]["name"] for t in openai_tools]
            out["tools"] = openai_tools
            out["tool_choice"] = _resolve_tool_choice(tool_choice, tool_required, names)
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
                d = _legacy_tool_call(tc)
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
            raise ValueError(f"Expected at least one tool call, but got 0 tool calls. Response: {response.message.content!r}")
        return selections

    # -- structured output ------------------------------------------------------------------------
    def _structured_messages(self, output_cls: type[BaseModel], prompt: BasePromptTemplate,
                             prompt_args: dict[str, Any]) -> list[ChatMessage]:
        messages = self._get_messages(prompt, **prompt_args)
        hint = ("Answer with a JSON object that matches this JSON schema:\n"
                + json.dumps(output_cls.model_json_schema(), ensure_ascii=False))
        if messages and messages[0].role == MessageRole.SYSTEM:
            first = messages[0]
            messages = [ChatMessage(role=MessageRole.SYSTEM, content=f"{first.content or ''}\n\n{hint}"), *messages[1:]]
        else:
            messages = [ChatMessage(role=MessageRole.SYSTEM, content=hint), *messages]
        return messages

    @staticmethod
    def _parse_structured(output_cls: type[BaseModel], response: ChatResponse) -> BaseModel:
        text = response.message.content or ""
        if (response.raw or {}).get("finish_reason") == "length":
            raise ValueError(
                f"structured output for {output_cls.__name__} was cut off by max_tokens before the JSON was "
                f"complete: {text!r}. Raise max_tokens."
            )
        return output_cls.model_validate_json(text)

    @dispatcher.span
    def structured_predict(self, output_cls: type[BaseModel], prompt: BasePromptTemplate,
                           llm_kwargs: dict[str, Any] | None = None, **prompt_args: Any) -> BaseModel:
        """Decoding constrained to ``output_cls``'s JSON schema (the answer always parses unless max_tokens
        cuts it). With ``pydantic_program_mode`` other than DEFAULT, LlamaIndex's program is used."""
        if self.pydantic_program_mode != PydanticProgramMode.DEFAULT:
            return super().structured_predict(output_cls, prompt, llm_kwargs=llm_kwargs, **prompt_args)
        dispatcher.event(LLMStructuredPredictStartEvent(output_cls=output_cls, template=prompt,
                                                        template_args=prompt_args))
        messages = self._structured_messages(output_cls, prompt, prompt_args)
        kwargs = {**(llm_kwargs or {}), "response_format": _json_schema_format(output_cls)}
        result = self._parse_structured(output_cls, self.chat(messages, **kwargs))
        dispatcher.event(LLMStructuredPredictEndEvent(output=result))
        return result

    @dispatcher.span
    async def astructured_predict(self, output_cls: type[BaseModel], prompt: BasePromptTemplate,
                                  llm_kwargs: dict[str, Any] | None = None, **prompt_args: Any) -> BaseModel:
        if self.pydantic_program_mode != PydanticProgramMode.DEFAULT:
            return await super().astructured_predict(output_cls, prompt, llm_kwargs=llm_kwargs, **prompt_args)
        dispatcher.event(LLMStructuredPredictStartEvent(output_cls=output_cls, template=prompt,
                                                        template_args=prompt_args))
        messages = self._structured_messages(output_cls, prompt, prompt_args)
        kwargs = {**(llm_kwargs or {}), "response_format": _json_schema_format(output_cls)}
        result = self._parse_structured(output_cls, await self.achat(messages, **kwargs))
        dispatcher.event(LLMStructuredPredictEndEvent(output=result))
        return result

    # -- tokens ---------------------------------------------------------------------------------
    def get_token_ids(self, text: str) -> list[int]:
        """Token ids of ``text`` for this model's tokenizer (no special tokens added)."""
        return list(self._get_engine().encode(text, add_special_tokens=False))
