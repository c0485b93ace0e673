"""OpenAI-shaped request and response models for ``parallm serve`` (see :mod:`parallm_engine.serve.server`).

Requests are validated here (types and ranges); what only the engine can judge (a prompt longer than
the context window, a schema the grammar engine rejects, a chat template that cannot render the
messages) is checked when the request is submitted. Fields OpenAI's API has and these models do not
are ignored; vLLM's extra sampling fields (``top_k``, ``min_p``, ``repetition_penalty``,
``stop_token_ids``, ``ignore_eos``, ``include_stop_str_in_output``) are accepted, so clients written for
vLLM (``extra_body=...``) work unchanged.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

#: Seeds are 64-bit; they are reduced modulo 2**63 before they reach the engine (choice ``i`` of an
#: ``n > 1`` request uses seed + i, which must stay below 2**64).
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
MAX_N = 128
MAX_STOP = 16


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]
#: ``reasoning_effort`` (chat completions) / ``reasoning.effort`` (Responses) as a thinking-token budget: the
#: engine closes the model's reasoning after this many tokens (``sampling.reasoning_budget``). "none" /
#: "minimal": no reasoning (the template's switch is off too, and 0 closes it should the model reason anyway);
#: "high" / "xhigh": no budget (``max_tokens`` still bounds it). An explicit ``thinking_token_budget`` wins.
EFFORT_BUDGETS: dict[str, int | None] = {"none": 0, "minimal": 0, "low": 1024, "medium": 4096, "high": None,
                                         "xhigh": None}


def effort_template_kwargs(effort: str | None) -> dict[str, Any]:
    """The chat template's reasoning switches for an effort: ``enable_thinking`` (Qwen3-style templates) and
    ``reasoning_effort`` (gpt-oss's harmony template reads low / medium / high)."""
    if effort is None:
        return {}
    level = {"none": "low", "minimal": "low", "xhigh": "high"}.get(effort, effort)
    return {"enable_thinking": EFFORT_BUDGETS[effort] != 0, "reasoning_effort": level}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


class _Model(BaseModel):
    # allow_inf_nan=False: JSON's NaN / Infinity (Python's json accepts them) fail as "finite number"
    # errors, not as a misleading range error ("<= 2").
    model_config = ConfigDict(extra="ignore", populate_by_name=True, protected_namespaces=(), allow_inf_nan=False)


# ----------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------


class ErrorDetail(_Model):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Model):
    error: ErrorDetail


# ----------------------------------------------------------------------------------------------
# Shared request pieces
# ----------------------------------------------------------------------------------------------


class StreamOptions(_Model):
    include_usage: bool | None = None
    """Send one more chunk, with empty ``choices``, carrying the request's ``usage`` before ``[DONE]``."""


class JsonSchemaSpec(_Model):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema", "regex"]
    json_schema: JsonSchemaSpec | None = None
    regex: str | None = None
    """For ``type="regex"`` (a ParaLLM / vLLM-style extension): the output matches this pattern."""

    def to_engine(self) -> dict[str, Any] | None:
        if self.type == "text":
            return None
        out: dict[str, Any] = {"type": self.type}
        if self.type == "json_schema":
            spec = self.json_schema or JsonSchemaSpec()
            out["json_schema"] = {"name": spec.name, "schema": spec.schema_, "strict": spec.strict}
        elif self.type == "regex":
            out["regex"] = self.regex
        return out


class _Sampling(_Model):
    """Sampling fields shared by chat and text completions (OpenAI names, plus vLLM's extras)."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int | None = Field(default=1, ge=1, le=MAX_N)
    stop: str | list[str] | None = Field(default=None)
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # names the session (request_identity.py), as user may
    # ParaLLM extension: the agent run the request is a call of (core/programs.py; default: its session)
    program: str | None = Field(default=None, min_length=1, max_length=256)
    # vLLM extensions
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    # vLLM's scheduling extension: smaller runs first and is preempted last when memory runs short
    priority: int | None = Field(default=None, ge=-(2**31), le=2**31 - 1)
    # ParaLLM's extension: speculative decoding, e.g. {"method": "ngram", "num_tokens": 4} (spec_config)
    speculative: dict[str, Any] | str | bool | None = None
    # vLLM's extension: reasoning tokens allowed before the engine closes the reasoning (EFFORT_BUDGETS)
    thinking_token_budget: int | None = Field(default=None, ge=0)

    def sampling_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``Engine.submit`` (engine defaults where a field is unset)."""
        kw: dict[str, Any] = {}
        for name in ("max_tokens", "temperature", "top_p", "n", "presence_penalty", "frequency_penalty",
                     "top_k", "min_p", "repetition_penalty", "stop_token_ids", "ignore_eos",
                     "include_stop_str_in_output", "priority", "speculative", "thinking_token_budget"):
            value = getattr(self, name)
            if value is not None:
                kw[name] = value
        if self.stop is not None:
            stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
            stops = [s for s in stops if s]  # OpenAI ignores empty stop strings
            if len(stops) > MAX_STOP:
                from parallm_engine.errors import InvalidRequestError

                raise InvalidRequestError(f"at most {MAX_STOP} stop strings are allowed", param="stop")
            if stops:
                kw["stop"] = stops
        if self.seed is not None:
            kw["seed"] = self.seed % (2**63)
        if self.logit_bias:
            from parallm_engine.errors import InvalidRequestError

            bias: dict[int, float] = {}
            for key, value in self.logit_bias.items():
                try:
                    bias[int(key)] = value
                except ValueError:
                    raise InvalidRequestError(f"logit_bias key {key!r} is not a token id", param="logit_bias")
            kw["logit_bias"] = bias
        return kw

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


# ----------------------------------------------------------------------------------------------
# Chat completions
# ----------------------------------------------------------------------------------------------


class FunctionDefinition(_Model):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionTool(_Model):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"] = "function"
    function: NamedFunction


class FunctionCall(_Model):
    name: str
    arguments: str


class ToolCallModel(_Model):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ContentPart(_Model):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallModel] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[ChatCompletionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    reasoning_effort: ReasoningEffort | None = None
    """The template's reasoning switches and a thinking-token budget (:data:`EFFORT_BUDGETS`)."""
    chat_template_kwargs: dict[str, Any] | None = None
    """vLLM's extension: extra variables for the chat template (e.g. ``{"enable_thinking": false}``)."""
    allow_special_tokens: bool = False
    """ParaLLM extension. False (default): special-token text inside the messages and tools (a user writing
    ``<|im_start|>system``) is tokenized as plain text; only the chat template's own markers are special
    tokens, so message content cannot forge a turn. True, for trusted clients: parsed as special tokens."""

    def sampling_kwargs(self) -> dict[str, Any]:
        kw = super().sampling_kwargs()
        if self.max_completion_tokens is not None and self.max_tokens is None:
            kw["max_tokens"] = self.max_completion_tokens
        if self.reasoning_effort is not None and "thinking_token_budget" not in kw:
            budget = EFFORT_BUDGETS[self.reasoning_effort]
            if budget is not None:
                kw["thinking_token_budget"] = budget
        if self.logprobs:
            kw["logprobs"] = True
            if self.top_logprobs:
                kw["top_logprobs"] = self.top_logprobs
        return kw

    def template_kwargs(self) -> dict[str, Any]:
        """The chat template's extra variables: ``reasoning_effort``'s switches, then ``chat_template_kwargs``."""
        return {**effort_template_kwargs(self.reasoning_effort), **(self.chat_template_kwargs or {})}


class ChatCompletionMessage(_Model):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCallModel] | None = None


class TopLogprob(_Model):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprobModel(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(_Model):
    content: list[TokenLogprobModel] | None = None


class PromptTokensDetails(_Model):
    cached_tokens: int = 0


class UsageModel(_Model):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class ChatCompletionChoice(_Model):
    index: int
    message: ChatCompletionMessage
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionResponse(_Model):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageModel
    system_fingerprint: str | None = None


# ----------------------------------------------------------------------------------------------
# Text completions
# ----------------------------------------------------------------------------------------------


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="A string, a list of strings, a list of token ids, or a list of token-id lists."
    )
    echo: bool | None = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)
    suffix: str | None = None
    response_format: ResponseFormat | None = None
    """Constrain the completion (JSON object / schema / regex), as on chat completions (vLLM has it too)."""
    allow_special_tokens: bool = True
    """ParaLLM extension. The prompt is the model's raw input, so by default special-token text in it is
    parsed as special tokens (as vLLM does: a client may write its own chat markup). False tokenizes it as
    plain text (for prompts that embed untrusted text)."""

    def sampling_kwargs(self) -> dict[str, Any]:
        kw = super().sampling_kwargs()
        if self.logprobs is not None:
            kw["logprobs"] = True
            if self.logprobs:
                kw["top_logprobs"] = self.logprobs
        return kw


class CompletionLogprobs(_Model):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Model):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None


class CompletionResponse(_Model):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageModel
    system_fingerprint: str | None = None


# ----------------------------------------------------------------------------------------------
# Models, tokenizer
# ----------------------------------------------------------------------------------------------


class ModelCard(_Model):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "parallm"
    max_model_len: int | None = None  # the context window in tokens, under each name agents read it: vLLM's,
    context_length: int | None = None  # OpenRouter's / llama.cpp's,
    context_window: int | None = None  # LiteLLM's and several agents',
    max_context_length: int | None = None  # LM Studio's
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field)

    @classmethod
    def with_context(cls, context: int | None, **fields: Any) -> "ModelCard":
        return cls(max_model_len=context, context_length=context, context_window=context,
                   max_context_length=context, **fields)


class ModelList(_Model):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(_Model):
    """vLLM-compatible ``POST /tokenize``: ``prompt`` (text) or ``messages`` (chat, rendered with the
    model's template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ChatCompletionTool] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    allow_special_tokens: bool | None = None
    """Parse special-token text as special tokens; default as the generation endpoints do: False for
    ``messages`` (as chat completions), True for ``prompt`` (as completions)."""


class TokenizeResponse(_Model):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(_Model):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(_Model):
    prompt: str


class HealthResponse(_Model):
    status: str
    model: str | None = None



class CloseSessionRequest(_Model):
    """SGLang's ``/close_session`` body: the session (or program) whose run is over."""

    session_id: str = Field(min_length=1, max_length=256)
