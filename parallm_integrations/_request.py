"""The one request builder of every ParaLLM class (LangChain ``ChatParaLLM`` / ``ParaLLM``, LlamaIndex
``ParaLLMLlamaIndex``): an object's sampling fields, its extra request kwargs (``model_kwargs`` /
``additional_kwargs``), a call's kwargs and ``stop`` -> one :class:`EngineRequest`, which a backend
(``backends``) turns into an engine submission or a server request.

Plain Python: nothing of ``parallm_engine`` (or MLX) is imported at import time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: Sampling settings the engine understands, in the order they are documented.
SAMPLING_FIELDS = (
    "max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "logit_bias", "seed", "stop_token_ids", "ignore_eos", "logprobs", "top_logprobs",
    "n", "include_stop_str_in_output", "speculative",
)


def check_sampling(values: dict[str, Any]) -> None:
    """Validate the sampling settings set in ``values`` with the engine's own checks and messages
    (``parallm_engine.sampling.sampling_params``, plain Python: nothing is loaded). Raises ``ValueError``, which
    pydantic reports as a ``ValidationError`` at construction. Without the engine installed (``base_url=``
    only) there is nothing to check with here: the server checks them."""
    try:
        from parallm_engine.sampling.sampling_params import check_sampling_fields
    except ImportError:
        return
    check_sampling_fields({k: v for k, v in values.items() if k in (*SAMPLING_FIELDS, "stop")})


def check_priority(priority: Any) -> None:
    """A per-call ``priority`` must be an integer (the field's own check runs at construction)."""
    if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)):
        raise ValueError(f"priority must be an integer, got {type(priority).__name__}")


@dataclass
class EngineRequest:
    """One call's settings, split the way the engine wants them."""

    sampling: dict[str, Any]
    tools: list[dict[str, Any]] | None = None
    engine_tools: list[dict[str, Any]] | None = None  # what decoding is constrained to (default: tools)
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    model: str | None = None
    timeout: float | None = None

    def tool_kwargs(self, tools: list[dict[str, Any]] | None) -> dict[str, Any]:
        """``tools`` with this call's ``tool_choice`` / ``parallel_tool_calls`` (each only when set); nothing
        without tools."""
        if not tools:
            return {}
        kw: dict[str, Any] = {"tools": tools}
        if self.tool_choice is not None:
            kw["tool_choice"] = self.tool_choice
        if self.parallel_tool_calls is not None:
            kw["parallel_tool_calls"] = self.parallel_tool_calls
        return kw

    def submit_kwargs(self) -> dict[str, Any]:
        """kwargs for ``Engine.submit`` (the constraint kwargs only when set)."""
        kw = dict(self.sampling)
        if self.tools:
            kw.update(self.tool_kwargs(self.engine_tools or self.tools))
        if self.response_format is not None:
            kw["response_format"] = self.response_format
        return kw

    @property
    def n(self) -> int:
        return int(self.sampling.get("n") or 1)

    def check_streamable(self) -> None:
        if self.n > 1:
            raise ValueError("n must be 1 when streaming")


@dataclass(frozen=True)
class ToolRules:
    """How a framework's tools become the engine's: ``to_openai`` (its tool objects -> OpenAI tool dicts),
    ``resolve_choice`` (its ``tool_choice`` spellings and the tool names -> the engine's, or None for the
    engine's default), ``one_forced_call`` (a "required" choice without ``parallel_tool_calls`` makes one
    call: under a forced-call grammar a small model may otherwise keep calling until max_tokens)."""

    to_openai: Callable[[Sequence[Any]], list[dict[str, Any]]]
    resolve_choice: Callable[[Any, list[str]], Any]
    one_forced_call: bool = False


_UNSET = object()
#: The call kwarg by which a model's ``invoke`` / ``stream`` hands :func:`build_request` the ``thread_id`` of the
#: config it was called with (:func:`thread_kwargs`): a bare ``invoke(..., config=)`` sets no run context.
RUN_THREAD_KWARG = "_parallm_thread"


def thread_kwargs(config: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` plus the ``thread_id`` of a call's own ``config`` (``{"configurable": {"thread_id": ...}}``),
    if it names one: LangChain passes a bare ``invoke``'s config to callbacks only, so the model would not see
    the thread (inside a LangGraph node :func:`_graph_thread` finds it in the run context)."""
    thread = ((config or {}).get("configurable") or {}).get("thread_id") if isinstance(config, dict) else None
    return {**kwargs, RUN_THREAD_KWARG: str(thread)} if thread is not None else kwargs


def _graph_thread():
    """The LangGraph thread this call runs in (``config["configurable"]["thread_id"]`` of the run the call is
    part of), or None: it names the call's session, so an agent's conversation stays cached between turns."""
    try:
        from langchain_core.runnables.config import ensure_config
    except ImportError:  # LlamaIndex without LangChain
        return None
    return (ensure_config().get("configurable") or {}).get("thread_id")


def build_request(
    owner: Any,
    call_kwargs: Mapping[str, Any],
    *,
    fields: Sequence[str],
    extra_kwargs: Mapping[str, Any] | None = None,
    stop: list[str] | str | None = None,
    ignored_kwargs: Sequence[str] = (),
    tool_rules: ToolRules | None = None,
    response_format: Callable[[Any], Any] | None = None,
) -> EngineRequest:
    """Merge ``owner``'s sampling ``fields`` (those set), its ``extra_kwargs`` and ``call_kwargs`` (these
    win) into one request.

    * ``ignored_kwargs``: the framework's own bookkeeping kwargs, never sent.
    * ``model`` / ``model_name``: a per-call model (``EngineRequest.model``); ``timeout`` /
      ``request_timeout`` (default ``owner.timeout``); ``max_completion_tokens`` is ``max_tokens``.
    * ``stop``: the ``stop`` argument when given, else a ``stop`` kwarg (None: no stop strings), else
      ``owner.stop``.
    * ``owner.priority`` / ``owner.adapter`` when set; a per-call ``priority`` must be an integer.
    * ``session``: a per-call ``session``, else ``owner.session``, else the ``thread_id`` of the call's config
      or of the LangGraph run it is part of: the conversation whose context the engine keeps between turns.
      ``program``: a per-call ``program``, else ``owner.program`` (the engine's default: the session).
    * ``tools`` through ``tool_rules`` (OpenAI dicts shown to the model, closed schemas for decoding;
      ``tool_choice="none"`` shows none); without ``tool_rules`` they are left as given for the caller to
      refuse. ``response_format`` through ``response_format`` when given.
    * Everything else is a sampling setting, checked by the engine (or the server).
    """
    kw = {**(extra_kwargs or {}), **call_kwargs}
    for key in ignored_kwargs:
        kw.pop(key, None)
    model = kw.pop("model", None) or kw.pop("model_name", None)
    kw.pop("model_name", None)
    timeout = kw.pop("timeout", kw.pop("request_timeout", owner.timeout))
    if "max_completion_tokens" in kw:
        kw["max_tokens"] = kw.pop("max_completion_tokens")
    sampling: dict[str, Any] = {}
    for name in fields:
        value = getattr(owner, name)
        if value is not None:
            sampling[name] = value
    if owner.priority is not None:
        sampling["priority"] = owner.priority
    if owner.adapter is not None:
        sampling["adapter"] = owner.adapter
    run_thread = kw.pop(RUN_THREAD_KWARG, None)
    session = kw.pop("session", None) or getattr(owner, "session", None) or run_thread or _graph_thread()
    if session is not None:
        sampling["session"] = str(session)
    program = kw.pop("program", None) or getattr(owner, "program", None)
    if program is not None:
        sampling["program"] = str(program)
    check_priority(kw.get("priority"))
    stop_kwarg = kw.pop("stop", _UNSET)
    if stop is None:
        stop = owner.stop if stop_kwarg is _UNSET else stop_kwarg
    if stop:
        sampling["stop"] = [stop] if isinstance(stop, str) else list(stop)
    tools = kw.pop("tools", None)
    tool_choice = kw.pop("tool_choice", None)
    parallel = kw.pop("parallel_tool_calls", None)
    fmt = kw.pop("response_format", None)
    sampling.update(kw)
    req = EngineRequest(sampling, model=model, timeout=timeout,
                        response_format=response_format(fmt) if response_format is not None else fmt)
    if tools and tool_rules is None:
        req.tools = list(tools)
    elif tools:
        _add_tools(req, tool_rules, tools, tool_choice, parallel)
    return req


def _add_tools(req: EngineRequest, rules: ToolRules, tools, tool_choice, parallel) -> None:
    from ._messages import close_tool_schemas, tool_names

    openai_tools = rules.to_openai(tools)
    choice = rules.resolve_choice(tool_choice, tool_names(openai_tools))
    if choice == "none":  # nothing may be called: do not even show the tools
        return
    req.tools, req.tool_choice = openai_tools, choice
    # The prompt shows the tools as given; decoding is constrained to closed schemas, so a call carries
    # only declared arguments.
    req.engine_tools = close_tool_schemas(openai_tools)
    if rules.one_forced_call and choice == "required" and parallel is None:
        parallel = False
    req.parallel_tool_calls = parallel


__all__ = ["RUN_THREAD_KWARG", "SAMPLING_FIELDS", "EngineRequest", "ToolRules", "build_request", "check_priority", "check_sampling", "thread_kwargs"]
