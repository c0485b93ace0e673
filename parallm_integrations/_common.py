"""What ChatParaLLM and ParaLLM share: model / sampling fields, engine lookup, request building (the shared
``_request.build_request``) and the backend the requests run on (``backends``: the in-process engine, or a
server with ``base_url``), picked once when the object is built.

Nothing here imports ``parallm_engine`` (or MLX) at import time, and nothing on the ``base_url`` path
does: the engine is an optional extra (``parallm-integrations[engine]``), imported on first in-process
use (:func:`engine_import`), which says how to install it when it is missing.
"""

from __future__ import annotations

import asyncio
from typing import Any

from langchain_core.utils import from_env, secret_from_env
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SecretStr, model_validator

from ._engine_calls import (  # noqa: F401  (re-exported: the names the classes and tests import from here)
    DEFAULT_MODEL_NAME,
    Deadline,
    EngineCall,
    engine_import,
    is_default_model,
    model_sampling_defaults,
    peek_context_window,
    resolve_engine,
)
from ._lc_results import (  # noqa: F401  (re-exported)
    PROVIDER,
    chat_generation,
    chat_result,
    combine_llm_outputs,
    langchain_tool_calls,
    response_metadata,
)
from ._request import (  # noqa: F401  (re-exported)
    SAMPLING_FIELDS,
    EngineRequest,
    ToolRules,
    build_request,
    check_priority,
    check_sampling,
    thread_kwargs,
)
from .backends import Backend, PickedBackend, backend_for, same_model

#: Sampling settings the model may recommend (the engine uses its recommendation for those left unset).
_MODEL_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens")
#: Call kwargs LangChain adds for its own bookkeeping; never sent to the engine.
_LANGCHAIN_ONLY_KWARGS = ("stream", "ls_structured_output_format", "structured_output_format", "stream_usage",
                          "strict")


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

    session: str | None = None
    """The conversation these calls are turns of: after each call its context stays cached (pinned) for the
    engine's ``session_ttl`` (default 30 s), so the next turn finds it however busy the engine is. None: the
    ``thread_id`` of the call's config (``invoke(..., config={"configurable": {"thread_id": ...}})``) or of the
    LangGraph run the call is part of, if any. A per-call ``session=`` overrides it; with ``base_url`` it is
    sent as OpenAI's ``user`` field. ``Engine.release_session`` lets go early."""

    program: str | None = None
    """The agent run these calls belong to (the engine orders admission by program: the turn of a run under way
    goes ahead of runs that started after it, and ``Engine.stats()["programs"]`` reports each; docs/programs.md).
    None: the session. A per-call ``program=`` overrides it; with ``base_url`` it is sent as the ``program``
    extension field."""

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
    _picked: PickedBackend = PrivateAttr(default_factory=PickedBackend)  # backends.backend_for

    # -- the thread of a call's own config (a bare invoke sets no run context: _request.thread_kwargs) --------
    def invoke(self, input, config=None, *, stop=None, **kwargs):
        return super().invoke(input, config, stop=stop, **thread_kwargs(config, kwargs))

    async def ainvoke(self, input, config=None, *, stop=None, **kwargs):
        return await super().ainvoke(input, config, stop=stop, **thread_kwargs(config, kwargs))

    def stream(self, input, config=None, *, stop=None, **kwargs):
        return super().stream(input, config, stop=stop, **thread_kwargs(config, kwargs))

    def astream(self, input, config=None, *, stop=None, **kwargs):
        return super().astream(input, config, stop=stop, **thread_kwargs(config, kwargs))

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
        if same_model(model, self.model) and self._engine is not None and self._engine.is_alive:
            return self._engine
        return await asyncio.to_thread(self._get_engine, model)

    def _same_model(self, model: str) -> bool:
        return same_model(model, self.model)

    def _on_engine_loaded(self, engine) -> None:  # hook for subclasses
        pass

    def close_session(self, session: str) -> dict:
        """The agent run ``session`` names (a session, a LangGraph ``thread_id``, or a program) is over: the engine
        lets go of its pinned context now instead of at its TTL, and drops its program's figures. In-process:
        ``Engine.close_session``; with ``base_url``: the server's ``POST /close_session`` (SGLang's route)."""
        if not self.base_url:
            return self._get_engine().close_session(session)
        import httpx

        root = self.base_url.rstrip("/").removesuffix("/v1")
        key = self.api_key.get_secret_value() if self.api_key is not None else None
        r = httpx.post(f"{root}/close_session", json={"session_id": session},
                       headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=self.timeout or 60)
        r.raise_for_status()
        return r.json()

    # -- where requests run ---------------------------------------------------------------------
    def _backend_options(self) -> dict[str, Any]:
        """How the backend treats special-token text (subclasses: their ``allow_special_tokens``)."""
        return {}

    def _backend(self) -> Backend:
        """Where requests run: a server (``base_url``) or the in-process engine (``backends.backend_for``)."""
        return backend_for(self, self._backend_options(), request_model=self.model or DEFAULT_MODEL_NAME)

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
    def _build_request(self, stop: list[str] | str | None, kwargs: dict[str, Any],
                       tool_rules: ToolRules | None = None) -> EngineRequest:
        """Merge the object's fields, ``model_kwargs`` and per-call kwargs (these win): the shared builder."""
        from ._messages import normalize_response_format

        return build_request(self, kwargs, fields=SAMPLING_FIELDS, extra_kwargs=self.model_kwargs, stop=stop,
                             ignored_kwargs=_LANGCHAIN_ONLY_KWARGS, tool_rules=tool_rules,
                             response_format=normalize_response_format)

    # -- tokens ---------------------------------------------------------------------------------
    def get_token_ids(self, text: str) -> list[int]:
        """Token ids of ``text``: a user's ``custom_get_token_ids`` first (LangChain's convention), else the
        model's own tokenizer (no special tokens added). With ``base_url``, from the server's ``/tokenize``;
        a server without one gets LangChain's GPT-2 estimate."""
        custom = getattr(self, "custom_get_token_ids", None)
        if custom is not None:
            return list(custom(text))
        try:
            return self._backend().tokenize(text)
        except NotImplementedError:  # no /tokenize on this server
            return super().get_token_ids(text)  # type: ignore[misc]  (BaseLanguageModel's, via the MRO)

    def get_num_tokens(self, text: str) -> int:
        """Number of tokens in ``text`` for this model's tokenizer."""
        return len(self.get_token_ids(text))
