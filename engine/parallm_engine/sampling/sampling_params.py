"""Per-request sampling settings and their validation, in plain Python (no mlx).

The engine's sampler (``sampling.py``) runs them; the LangChain / LlamaIndex classes import this module to
check their fields when they are constructed, with the engine's own messages, without loading MLX.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from parallm_engine.errors import InvalidRequestError
from parallm_engine.sampling.spec_config import parse_speculative

MAX_TOP_LOGPROBS = 20

#: Settings a model may recommend (``generation_config.json``, a GGUF's ``general.sampling.*`` keys, or
#: ParaLLM's table of known models, see ``loader.sampling_defaults``). A request that leaves one of them
#: unset (absent or None) gets the model's value; anything the caller sets wins. (A ``max_tokens`` default
#: is a cap: the engine still stops at what the context leaves.)
MODEL_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens")


#: Model defaults that shape sampled decoding only: a request that asks for greedy decoding (temperature 0)
#: gets the model's plain argmax, token for token what mlx-lm decodes, not a penalised one.
SAMPLED_ONLY_DEFAULTS = ("repetition_penalty",)


def apply_model_defaults(sampling: Mapping[str, Any], defaults: Mapping[str, Any] | None) -> dict[str, Any]:
    """``sampling`` with each of :data:`MODEL_DEFAULT_FIELDS` the caller left unset taken from ``defaults``
    (:data:`SAMPLED_ONLY_DEFAULTS` not when the caller asked for temperature 0)."""
    out = dict(sampling)
    greedy = out.get("temperature") == 0
    for name, value in (defaults or {}).items():
        if name in MODEL_DEFAULT_FIELDS and out.get(name) is None and not (greedy and name in SAMPLED_ONLY_DEFAULTS):
            out[name] = value
    return out


def check_sampling_fields(values: Mapping[str, Any]) -> None:
    """Validate the sampling settings that are set (not None) in ``values``, as the engine would at
    request time; raises :class:`InvalidRequestError` (a ``ValueError``) with the engine's message."""
    SamplingParams.from_kwargs(**{k: v for k, v in values.items() if v is not None})


@dataclass
class SamplingParams:
    """Sampling settings of one request, named as in OpenAI's API (plus vLLM's top_k/min_p/...)."""

    max_tokens: int | None = None  # unset: up to what the context leaves (OpenAI, vLLM); admission never reserves it
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF-style, over prompt + output
    presence_penalty: float = 0.0  # OpenAI-style, over output
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    n: int = 1
    include_stop_str_in_output: bool = False
    # Speculative decoding (spec_config.parse_speculative): None = the engine's default.
    speculative: Any = None
    # Reasoning tokens allowed (vLLM's name): once the model has generated this many inside its reasoning span
    # (<think> / harmony analysis), the engine forces the family's end of reasoning (reasoning_budget.py).
    thinking_token_budget: int | None = None

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "SamplingParams":
        known = {f.name for f in fields(cls)}
        unknown = set(kwargs) - known
        if unknown:
            raise InvalidRequestError(
                f"unknown sampling parameter(s): {', '.join(sorted(unknown))}", param=sorted(unknown)[0]
            )
        clean = {k: v for k, v in kwargs.items() if v is not None or k in ("max_tokens", "seed")}
        if "stop" in clean and isinstance(clean["stop"], str):
            clean["stop"] = [clean["stop"]]
        params = cls(**clean)
        params.validate()
        return params

    def validate(self) -> None:
        def num(name, value, lo=None, hi=None, lo_open=False, integer=False):
            ok_types = (int,) if integer else (int, float)
            if isinstance(value, bool) or not isinstance(value, ok_types):
                kind = "an integer" if integer else "a number"
                raise InvalidRequestError(f"{name} must be {kind}, got {type(value).__name__}", param=name)
            if not integer and not math.isfinite(value):
                raise InvalidRequestError(f"{name} must be finite, got {value}", param=name)
            if lo is not None and (value <= lo if lo_open else value < lo):
                raise InvalidRequestError(f"{name} must be {'>' if lo_open else '>='} {lo}, got {value}", param=name)
            if hi is not None and value > hi:
                raise InvalidRequestError(f"{name} must be <= {hi}, got {value}", param=name)

        if self.max_tokens is not None:
            num("max_tokens", self.max_tokens, lo=1, integer=True)
        num("temperature", self.temperature, lo=0.0)
        num("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)
        num("top_k", self.top_k, lo=-1, integer=True)
        num("min_p", self.min_p, lo=0.0, hi=1.0)
        num("repetition_penalty", self.repetition_penalty, lo=0.0, lo_open=True)
        num("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        num("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        num("n", self.n, lo=1, hi=128, integer=True)
        num("top_logprobs", self.top_logprobs, lo=0, hi=MAX_TOP_LOGPROBS, integer=True)
        if self.seed is not None:
            # mx.random.key takes an unsigned 64-bit seed; choice i uses seed + i.
            num("seed", self.seed, lo=0, hi=2**64 - 1 - self.n, integer=True)
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) for s in self.stop):
            raise InvalidRequestError("stop must be a string or a list of strings", param="stop")
        if any(s == "" for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty", param="stop")
        self.stop = list(self.stop)
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids must be non-negative integers", param="stop_token_ids")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise InvalidRequestError("logit_bias must be a mapping of token id to bias", param="logit_bias")
            clean = {}
            for k, v in self.logit_bias.items():
                try:
                    tid = int(k)
                except (TypeError, ValueError):
                    raise InvalidRequestError(f"logit_bias key {k!r} is not a token id", param="logit_bias")
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
                    raise InvalidRequestError("logit_bias values must be numbers in [-100, 100]", param="logit_bias")
                clean[tid] = float(v)
            self.logit_bias = clean or None
        if self.thinking_token_budget is not None:
            num("thinking_token_budget", self.thinking_token_budget, lo=0, integer=True)
        if self.top_logprobs and not self.logprobs:
            self.logprobs = True
        self.speculative = parse_speculative(self.speculative)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
        )
