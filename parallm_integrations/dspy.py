"""DSPy on ParaLLM: :class:`ParaLLMDSPy`, a ``dspy.LM`` whose requests run on the shared in-process engine
(or on a server with ``base_url=``), and :class:`ParaLLMAdapter`, DSPy's JSON adapter that constrains every
answer to the signature's output fields.

``ParaLLMDSPy`` is a ``dspy.LM`` with a custom engine (DSPy 3.4's ``complete(Request) -> Response`` contract;
the ``forward()`` subclass interface is deprecated there): DSPy keeps its own cache, retries
(``num_retries``), history and usage tracking; each call is one blocking submit to the engine that every
ParaLLM class naming the same model and ``engine_kwargs`` shares, so DSPy's threads (``batch``,
``dspy.Parallel``, ``dspy.Evaluate(num_threads=...)``) are decoded together in one batch.

Why the adapter: a 135M model does not follow the ChatAdapter's ``[[ ## field ## ]]`` markers, and DSPy's
JSONAdapter leaves signatures with ``dict`` fields (``dspy.ReAct``'s ``next_tool_args``) to plain JSON mode.
:class:`ParaLLMAdapter` always sends the signature's JSON schema, and the engine decodes under it
(llguidance), so every answer parses, on one call::

    dspy.configure(lm=ParaLLMDSPy(), adapter=ParaLLMAdapter())

Without the adapter DSPy's default ChatAdapter runs first; when its answer does not parse, its JSON fallback
sends the signature's schema (``ParaLLMDSPy`` declares schema support) and that answer is constrained.

Nothing here is imported by ``import parallm_integrations``: ``dspy`` is an optional dependency.
"""

from __future__ import annotations

import base64
import json
from typing import Any, get_origin

import dspy
import pydantic
from dspy.adapters.json_adapter import JSONAdapter
from dspy.adapters.types.tool import ToolCalls
from dspy.clients.base_lm import LM_CLASS_STATE_KEY
from dspy.clients.engines.base import validate_request
from dspy.lm15 import (
    ContextLengthError,
    FunctionTool,
    ImagePart,
    InvalidRequestError,
    Message,
    RateLimitError,
    Request,
    Response,
    ServerError,
    StreamDeltaEvent,
    StreamEndEvent,
    StreamStartEvent,
    TextDelta,
    TextPart,
    ThinkingPart,
    ToolCallPart,
    ToolResultPart,
    TransportError,
    UnsupportedFeatureError,
    Usage,
    response_to_events,
)
from dspy.lm15 import TimeoutError as LM15TimeoutError

from ._common import DEFAULT_MODEL_NAME, ParaLLMParams, ToolRules, is_default_model
from ._messages import normalize_tool_choice, tools_to_openai

PROVIDER = "parallm"
#: Tools as DSPy sends them (OpenAI dicts) and its ``tool_choice`` spellings, as ChatParaLLM takes them.
_TOOL_RULES = ToolRules(to_openai=tools_to_openai, resolve_choice=normalize_tool_choice)
#: The OpenAI-style settings DSPy may send (adapters read them from ``supported_params``).
_SUPPORTED_PARAMS = frozenset({
    "temperature", "max_tokens", "max_completion_tokens", "top_p", "stop", "seed", "presence_penalty",
    "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "response_format", "tools", "tool_choice",
    "parallel_tool_calls", "stream",
})
_FINISH = {"stop": "stop", "length": "length", "tool_calls": "tool_call", "abort": "error"}


class _Params(ParaLLMParams):
    """Where the requests run: the same fields and engine lookup as ChatParaLLM (``_common``)."""


class _Capabilities:
    """What DSPy asks an engine before it builds a request (the sync and async halves say the same)."""

    supports_function_calling = True
    supports_response_schema = True
    supports_reasoning = False
    supported_params = _SUPPORTED_PARAMS


class ParaLLMEngine(_Capabilities):
    """DSPy's engine contract (``complete(Request) -> Response``, ``stream``, ``close``) on a ParaLLM backend:
    the shared in-process engine, or a server (``base_url``). One call, one blocking request; no lock, so
    DSPy's threads run concurrently and the engine batches them."""

    def __init__(self, params: _Params):
        self.params = params

    # -- DSPy's contract -------------------------------------------------------------------------
    def complete(self, request: Request) -> Response:
        prompt, req = self._prepare(request)
        backend = self.params._backend()
        with _as_lm15_errors():
            result = backend.run(prompt, req)
        return _response(result, backend.result_model(req, result))

    def stream(self, request: Request):
        """Text arrives as it is decoded; a request with tools is answered whole (its calls are parsed from
        the finished text), as one start / deltas / end sequence."""
        if request.tools:
            yield from response_to_events(self.complete(request))
            return
        prompt, req = self._prepare(request)
        backend = self.params._backend()
        with _as_lm15_errors():
            deltas = backend.stream(prompt, req)
            try:
                yield StreamStartEvent(model=backend.result_model(req))
                finish, usage = None, None
                for delta in deltas:
                    if delta.text:
                        yield StreamDeltaEvent(delta=TextDelta(text=delta.text))
                    finish = delta.finish_reason or finish
                    usage = delta.usage or usage
                yield StreamEndEvent(finish_reason=_FINISH.get(finish or "stop", "stop"), usage=_usage(usage))
            finally:
                deltas.close()  # aborts the request if DSPy stopped reading

    def close(self) -> None:
        """The engine is shared by every ParaLLM class in the process: nothing to close per LM."""

    # -- Request -> the engine's request --------------------------------------------------------
    def _prepare(self, request: Request):
        validate_request(request)
        config = request.config
        kwargs: dict[str, Any] = dict(config.extensions or {})  # logit_bias, user, ...: passed as given
        for name in ("max_tokens", "temperature", "top_p", "top_k", "seed", "presence_penalty",
                     "frequency_penalty"):
            value = getattr(config, name)
            if value is not None:
                kwargs[name] = value
        if config.stop:
            kwargs["stop"] = list(config.stop)
        if config.logprobs is not None:
            kwargs["logprobs"] = True
            if config.logprobs > 0:
                kwargs["top_logprobs"] = config.logprobs
        if config.response_format:
            kwargs["response_format"] = _chat_response_format(config.response_format)
            if config.response_format.get("type") == "json_object":  # JSON mode: the signature's keys, if known
                kwargs["response_format"] = _caller_response_format() or kwargs["response_format"]
        if request.tools:
            kwargs["tools"] = [_openai_tool(t) for t in request.tools]
            fmt = kwargs.get("response_format") or {}
            if not ((fmt.get("json_schema") or {}).get("schema") or {}).get("properties", True):
                # A signature whose only output is the call (dspy.ToolCalls): an empty object would be the
                # whole answer and the call could never be made. The tool grammar decides instead.
                kwargs.pop("response_format")
            choice = config.tool_choice
            if choice is not None:
                if choice.allowed:
                    kwargs["tools"] = [t for t in kwargs["tools"] if t["function"]["name"] in choice.allowed]
                if choice.mode == "required" and len(choice.allowed) == 1:
                    kwargs["tool_choice"] = {"type": "function", "function": {"name": choice.allowed[0]}}
                else:
                    kwargs["tool_choice"] = choice.mode
                if choice.parallel is not None:
                    kwargs["parallel_tool_calls"] = choice.parallel
        try:
            req = self.params._build_request(None, kwargs, _TOOL_RULES)
        except ValueError as exc:  # bad sampling settings, an unknown response_format
            raise InvalidRequestError(str(exc), provider=PROVIDER) from exc
        return _openai_messages(request), req


class AsyncParaLLMEngine(_Capabilities):
    """The async half of :class:`ParaLLMEngine` (DSPy's ``acall`` / ``aforward``): the request is awaited on
    the caller's event loop, never blocking it."""

    def __init__(self, sync: ParaLLMEngine):
        self.sync = sync

    async def complete(self, request: Request) -> Response:
        prompt, req = self.sync._prepare(request)
        backend = self.sync.params._backend()
        with _as_lm15_errors():
            await backend.aload(req)  # a model loads off the event loop
            result = await backend.arun(prompt, req)
        return _response(result, backend.result_model(req, result))

    async def stream(self, request: Request):
        if request.tools:
            for event in response_to_events(await self.complete(request)):
                yield event
            return
        prompt, req = self.sync._prepare(request)
        backend = self.sync.params._backend()
        with _as_lm15_errors():
            await backend.aload(req)
            deltas = backend.astream(prompt, req)
            try:
                yield StreamStartEvent(model=backend.result_model(req))
                finish, usage = None, None
                async for delta in deltas:
                    if delta.text:
                        yield StreamDeltaEvent(delta=TextDelta(text=delta.text))
                    finish = delta.finish_reason or finish
                    usage = delta.usage or usage
                yield StreamEndEvent(finish_reason=_FINISH.get(finish or "stop", "stop"), usage=_usage(usage))
            finally:
                await deltas.aclose()

    async def aclose(self) -> None:
        """Shared engine: nothing to close per LM."""


class ParaLLMDSPy(dspy.LM):
    """A DSPy LM on ParaLLM's shared continuous-batching engine.

    Args:
        model: None (the default model, SmolLM2-135M-Instruct), a ``.gguf`` file, an HF / MLX model directory
            or a Hugging Face id, as ``ChatParaLLM(model=...)``: the same model and ``engine_kwargs`` share one
            engine with every other ParaLLM class in the process.
        base_url / api_key: a ParaLLM (or OpenAI-compatible) server instead of the in-process engine; read from
            ``PARALLM_BASE_URL`` / ``PARALLM_API_KEY`` when not given.
        engine_kwargs: settings for the shared engine when it is first created (``ChatParaLLM``'s).
        timeout: seconds a request may take (queueing included) before it is aborted.
        temperature, max_tokens, cache, num_retries, callbacks, **kwargs: ``dspy.LM``'s. Unset sampling
            settings use the model's recommendation (SmolLM2: temperature 0.2, top_p 0.9). ``cache=True``
            (DSPy's default) answers a repeated request from DSPy's cache without running it;
            ``num_retries`` retries a full queue (or a server's 429 / 5xx / dropped connection).

    ``dspy.LM.model`` is ``"parallm/<model name>"``. Usage reaches ``lm.history`` and
    ``dspy.settings.track_usage`` with the prompt tokens the prefix cache served as
    ``prompt_tokens_details.cached_tokens``.
    """

    def __init__(self, model: str | None = None, *, base_url: str | None = None, api_key: str | None = None,
                 engine_kwargs: dict[str, Any] | None = None, timeout: float | None = None,
                 temperature: float | None = None, max_tokens: int | None = None, cache: bool = True,
                 num_retries: int = 3, callbacks: list | None = None, **kwargs: Any):
        # DSPy retries (num_retries); the HTTP client under base_url= does not retry a second time.
        fields: dict[str, Any] = {"model": model, "engine_kwargs": dict(engine_kwargs or {}), "timeout": timeout,
                                  "max_retries": 0}
        if base_url is not None:
            fields["base_url"] = base_url
        if api_key is not None:
            fields["api_key"] = api_key
        params = _Params(**fields)
        self.parallm_model = model
        self.parallm_engine_kwargs = dict(engine_kwargs or {})
        name = DEFAULT_MODEL_NAME if is_default_model(model) else str(model)
        sync = ParaLLMEngine(params)
        super().__init__(f"{PROVIDER}/{name}", model_type="chat", temperature=temperature, max_tokens=max_tokens,
                         cache=cache, callbacks=callbacks, num_retries=num_retries, engine=sync,
                         async_engine=AsyncParaLLMEngine(sync), **kwargs)

    @property
    def base_url(self) -> str | None:
        return self.engine.params.base_url

    def shared_engine(self):
        """The in-process engine the requests run on (loaded on first use); None with ``base_url``."""
        params = self.engine.params
        return None if params.base_url else params._get_engine()

    def dump_state(self) -> dict[str, Any]:
        """What rebuilds this LM (``dspy.load(..., allow_unsafe_lm_state=True)``): model, engine settings and
        ``base_url``, never the API key."""
        state = {key: val for key, val in self.kwargs.items() if key != "api_key"}
        state.update({LM_CLASS_STATE_KEY: f"{type(self).__module__}.{type(self).__qualname__}",
                      "model": self.parallm_model, "engine_kwargs": self.parallm_engine_kwargs,
                      "timeout": self.engine.params.timeout, "cache": self.cache, "num_retries": self.num_retries})
        if self.base_url:
            state["base_url"] = self.base_url
        return state

    @classmethod
    def load_state(cls, state: dict[str, Any], *, allow_custom_lm_class: bool = False) -> ParaLLMDSPy:
        state = {k: v for k, v in state.items() if k != LM_CLASS_STATE_KEY}
        return cls(**state)


class ParaLLMAdapter(JSONAdapter):
    """DSPy's JSONAdapter that always sends the signature's output fields as a JSON schema
    (``response_format`` ``json_schema``), ``dict`` fields included, whatever the LM declares. ParaLLM decodes
    under that schema, so the answer of a 135M model parses, in one call, for ``dspy.Predict``,
    ``dspy.ChainOfThought`` and ``dspy.ReAct`` alike. Works with :class:`ParaLLMDSPy` and with
    ``dspy.LM("openai/<model>", api_base=<parallm serve>/v1)``."""

    def _prepare_response_format(self, lm, lm_kwargs, signature):
        fmt = signature_response_format(signature, self.use_native_function_calling)
        tools = _react_tools(signature)
        if tools:
            fmt["json_schema"]["schema"] = _react_step_schema(fmt["json_schema"]["schema"], tools)
        lm_kwargs["response_format"] = fmt


def signature_response_format(signature, use_native_function_calling: bool = True) -> dict[str, Any]:
    """The OpenAI ``json_schema`` response format of ``signature``'s output fields, in their order, all
    required. A ``ToolCalls`` field is left to native function calling when that is on. Unlike DSPy's own,
    open mappings (``dict[str, Any]``) are kept (as open objects): the engine's grammar takes them."""
    fields = {}
    for name, field in signature.output_fields.items():
        if use_native_function_calling and field.annotation == ToolCalls:
            continue
        fields[name] = (field.annotation, ...)
    model = pydantic.create_model("DSPyProgramOutputs", __config__=pydantic.ConfigDict(extra="forbid"), **fields)
    schema = model.model_json_schema()
    for name, field in signature.output_fields.items():  # an open mapping stays open; the rest is closed
        if name in fields and get_origin(field.annotation) is dict:
            schema["properties"][name].setdefault("additionalProperties", True)
    return {"type": "json_schema", "json_schema": {"name": "DSPyProgramOutputs", "schema": schema}}


def _caller_response_format() -> dict[str, Any] | None:
    """The schema of the signature DSPy is predicting (the innermost ``dspy.Predict`` running, from
    ``dspy.settings.caller_modules``), for a request in JSON mode: DSPy's JSONAdapter falls back to plain JSON
    mode for signatures with ``dict`` fields, where a small model invents its own keys; under the signature's
    schema it writes the fields DSPy parses. None outside a ``Predict``."""
    for module in reversed(dspy.settings.caller_modules or []):
        if isinstance(module, dspy.Predict):
            fmt = signature_response_format(module.signature)
            tools = _react_tools(module.signature)
            if tools:
                fmt["json_schema"]["schema"] = _react_step_schema(fmt["json_schema"]["schema"], tools)
            return fmt
    return None


def _react_tools(signature) -> dict[str, Any] | None:
    """The tools of the ``dspy.ReAct`` whose step this ``signature`` is (its ``next_tool_name`` /
    ``next_tool_args`` fields), from the modules DSPy is running (``dspy.settings.caller_modules``);
    None for any other signature."""
    if not {"next_tool_name", "next_tool_args"} <= set(signature.output_fields):
        return None
    for module in reversed(dspy.settings.caller_modules or []):
        if isinstance(module, dspy.ReAct):
            return module.tools
    return None


def _react_step_schema(schema: dict[str, Any], tools: dict[str, Any]) -> dict[str, Any]:
    """A ReAct step's schema with ``next_tool_args`` tied to ``next_tool_name``: one alternative per tool, its
    arguments that tool's own (closed) argument schema, so a small model can only pick a tool that exists and
    call it with arguments it takes."""
    from ._messages import close_schema

    variants = []
    for name, tool in tools.items():
        args = tool.args or {}
        props = dict(schema["properties"])
        props["next_tool_name"] = {"type": "string", "const": name}
        props["next_tool_args"] = close_schema({"type": "object", "properties": dict(args),
                                                "required": [k for k, v in args.items() if "default" not in v]})
        variants.append({"type": "object", "properties": props, "required": list(props),
                         "additionalProperties": False})
    out = {k: v for k, v in schema.items() if k not in ("properties", "required", "additionalProperties", "type")}
    return {**out, "anyOf": variants}


# ----------------------------------------------------------------------------------------------
# lm15 <-> OpenAI shapes
# ----------------------------------------------------------------------------------------------


def _text_of(parts) -> str:
    return "".join(p.text for p in parts if isinstance(p, TextPart))


def _user_content(message: Message) -> str | list[dict[str, Any]]:
    if all(isinstance(p, TextPart) for p in message.parts):
        return _text_of(message.parts)
    blocks: list[dict[str, Any]] = []
    for part in message.parts:
        if isinstance(part, TextPart):
            blocks.append({"type": "text", "text": part.text})
        elif isinstance(part, ImagePart):
            url = part.url or (f"data:{part.media_type};base64,{part.data}" if part.data else None)
            if part.path is not None:
                url = f"data:{part.media_type};base64,{base64.b64encode(part.path.read_bytes()).decode()}"
            if url is None:
                raise UnsupportedFeatureError("an image by file_id cannot be sent to ParaLLM", provider=PROVIDER,
                                              feature="image.file_id")
            blocks.append({"type": "image_url", "image_url": {"url": url}})
        else:
            raise UnsupportedFeatureError(f"ParaLLM takes text and images, not {type(part).__name__}",
                                          provider=PROVIDER, feature=getattr(part, "type", None))
    return blocks


def _openai_messages(request: Request) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if request.system:
        system = request.system if isinstance(request.system, str) else _text_of(request.system)
        messages.append({"role": "system", "content": system})
    for msg in request.messages:
        results = [p for p in msg.parts if isinstance(p, ToolResultPart)]
        for part in results:
            messages.append({"role": "tool", "tool_call_id": part.id,
                             "content": "".join(getattr(c, "text", "") or "" for c in part.content)})
        if msg.role == "tool" or (results and len(results) == len(msg.parts)):
            continue
        if msg.role == "assistant":
            item: dict[str, Any] = {"role": "assistant", "content": _text_of(msg.parts) or None}
            calls = [{"id": p.id, "type": "function",
                      "function": {"name": p.name, "arguments": json.dumps(p.input, ensure_ascii=False)}}
                     for p in msg.parts if isinstance(p, ToolCallPart)]
            if calls:
                item["tool_calls"] = calls
            messages.append(item)
            continue
        role = "system" if msg.role == "developer" else msg.role
        others = Message(role=msg.role, parts=tuple(p for p in msg.parts if not isinstance(p, ToolResultPart)))
        messages.append({"role": role, "content": _user_content(others)})
    return messages


def _openai_tool(tool) -> dict[str, Any]:
    if not isinstance(tool, FunctionTool):
        raise UnsupportedFeatureError(f"ParaLLM runs function tools, not {tool!r}", provider=PROVIDER,
                                      feature="tools")
    fn: dict[str, Any] = {"name": tool.name, "parameters": dict(tool.parameters)}
    if tool.description:
        fn["description"] = tool.description
    return {"type": "function", "function": fn}


def _chat_response_format(fmt: dict[str, Any]) -> dict[str, Any]:
    """lm15's canonical ``response_format`` -> OpenAI's."""
    if fmt.get("type") != "json_schema" or "json_schema" in fmt:
        return dict(fmt)
    spec = {"name": fmt.get("name") or "response", "schema": fmt.get("schema") or {}}
    if "strict" in fmt:
        spec["strict"] = fmt["strict"]
    return {"type": "json_schema", "json_schema": spec}


def _usage(usage) -> Usage:
    if usage is None:
        return Usage()
    return Usage(input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens,
                 total_tokens=usage.prompt_tokens + usage.completion_tokens,
                 cache_read_tokens=usage.cached_tokens)


def _response(result, model: str) -> Response:
    """The engine's ``GenerationResult`` (or a server's ``RemoteResult``) -> lm15's ``Response``."""
    choice = result.choices[0]
    parts: list[Any] = []
    if getattr(choice, "reasoning", None):
        parts.append(ThinkingPart(choice.reasoning))
    calls = [c for c in choice.tool_calls or [] if not c.error]
    text = choice.content if choice.content is not None else choice.text
    if calls and choice.content is None:
        text = ""
    if text or not calls:
        parts.append(TextPart(text or ""))
    parts.extend(ToolCallPart(id=c.id, name=c.name, input=dict(c.arguments)) for c in calls)
    finish = "tool_call" if calls else _FINISH.get(choice.finish_reason or "stop", "stop")
    return Response(id=getattr(result, "request_id", None), model=model,
                    message=Message(role="assistant", parts=tuple(parts)), finish_reason=finish,
                    usage=_usage(result.usage))


class _as_lm15_errors:
    """ParaLLM's typed errors (and the HTTP client's) as lm15's, which DSPy turns into its ``LMError``s and
    retries when they are transient (a full queue, a dropped connection, a server error)."""

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if exc is None or not isinstance(exc, Exception):
            return False
        mapped = _lm15_error(exc)
        if mapped is None:
            return False
        raise mapped from exc


def _lm15_error(exc: Exception):
    from .errors import ContextLengthExceededError, EngineDeadError, QueueFullError
    from .errors import InvalidRequestError as ParaLLMInvalidRequest

    message = str(exc)
    if isinstance(exc, ContextLengthExceededError):
        return ContextLengthError(message, provider=PROVIDER)
    if isinstance(exc, ParaLLMInvalidRequest):
        return InvalidRequestError(message, provider=PROVIDER)
    if isinstance(exc, QueueFullError):
        return RateLimitError(message, provider=PROVIDER)
    if isinstance(exc, EngineDeadError):
        return ServerError(message, provider=PROVIDER)
    if isinstance(exc, TimeoutError):
        return LM15TimeoutError(message, provider=PROVIDER)
    try:
        import openai
    except ImportError:
        return None
    if isinstance(exc, openai.APIConnectionError):
        return TransportError(message, provider=PROVIDER)
    if isinstance(exc, openai.RateLimitError):
        return RateLimitError(message, provider=PROVIDER, status=429)
    if isinstance(exc, openai.InternalServerError):
        return ServerError(message, provider=PROVIDER, status=exc.status_code)
    return None


__all__ = ["AsyncParaLLMEngine", "ParaLLMAdapter", "ParaLLMDSPy", "ParaLLMEngine", "signature_response_format"]
