"""Per-request sampling parameters and the batched sampler.

All rows of a decode batch are sampled together: temperature, top-k, top-p and min-p are applied as
vectorised masks over the (B, V) logits, penalties and logit_bias as scatters on just the rows that
use them. Seeded rows draw their Gumbel noise from their own key chain, so a seeded request gives the
same tokens whatever else shares the batch; unseeded rows share one draw.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

import mlx.core as mx
import numpy as np

from .errors import InvalidRequestError

MAX_TOP_LOGPROBS = 20


@dataclass
class SamplingParams:
    """Sampling settings of one request, named as in OpenAI's API (plus vLLM's top_k/min_p/...)."""

    max_tokens: int | None = 256
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
        if self.top_logprobs and not self.logprobs:
            self.logprobs = True

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
        )


class SeqSampler:
    """Per-sequence sampling state: the seeded key chain and the token counts for penalties."""

    __slots__ = ("params", "key", "counts", "prompt_ids")

    def __init__(self, params: SamplingParams, prompt_ids: list[int], seed_offset: int = 0):
        self.params = params
        self.key = mx.random.key(params.seed + seed_offset) if params.seed is not None else None
        self.counts: dict[int, int] = {}
        self.prompt_ids = set(prompt_ids) if params.repetition_penalty != 1.0 else set()

    def next_key(self):
        self.key, sub = mx.random.split(self.key)
        return sub

    def observe(self, token: int) -> None:
        if self.params.needs_penalties:
            self.counts[token] = self.counts.get(token, 0) + 1


def _apply_penalties(logits: mx.array, samplers: list[SeqSampler]) -> mx.array:
    rows, cols, rep, pres, freq = [], [], [], [], []
    for i, s in enumerate(samplers):
        p = s.params
        if not p.needs_penalties:
            continue
        toks = set(s.counts) | s.prompt_ids
        for t in toks:
            c = s.counts.get(t, 0)
            rows.append(i)
            cols.append(t)
            rep.append(p.repetition_penalty)
            pres.append(p.presence_penalty if c else 0.0)
            freq.append(p.frequency_penalty * c)
    if not rows:
        return logits
    r = mx.array(rows)
    c = mx.array(cols)
    old = logits[r, c]
    rp = mx.array(rep, dtype=logits.dtype)
    vals = mx.where(old > 0, old / rp, old * rp)
    vals = vals - mx.array(pres, dtype=logits.dtype) - mx.array(freq, dtype=logits.dtype)
    # Tokens a grammar constraint masked to -inf must stay masked (-inf - -inf would be NaN).
    return logits.at[r, c].add(mx.where(mx.isinf(old), 0.0, vals - old))


def _apply_logit_bias(logits: mx.array, samplers: list[SeqSampler]) -> mx.array:
    rows, cols, vals = [], [], []
    vocab = logits.shape[-1]
    for i, s in enumerate(samplers):
        for t, b in (s.params.logit_bias or {}).items():
            if 0 <= t < vocab:
                rows.append(i)
                cols.append(t)
                vals.append(b)
    if not rows:
        return logits
    return logits.at[mx.array(rows), mx.array(cols)].add(mx.array(vals, dtype=logits.dtype))


def _truncation_mask(logits: mx.array, samplers: list[SeqSampler]) -> mx.array | None:
    """Vectorised top-k / top-p / min-p: a (B, V) bool mask of tokens to drop, or None."""
    B, V = logits.shape
    top_k = [s.params.top_k if s.params.top_k > 0 else V for s in samplers]
    top_p = [s.params.top_p for s in samplers]
    min_p = [s.params.min_p for s in samplers]
    if all(k >= V for k in top_k) and all(p >= 1.0 for p in top_p) and all(m <= 0.0 for m in min_p):
        return None
    order = mx.argsort(-logits, axis=-1)
    sorted_logits = mx.take_along_axis(logits, order, axis=-1)
    probs = mx.softmax(sorted_logits, axis=-1)
    ranks = mx.arange(V)[None, :]
    drop = ranks >= mx.array(top_k)[:, None]
    # top-p: keep the smallest prefix whose mass reaches p (the token that crosses p is kept).
    cum_before = mx.cumsum(probs, axis=-1) - probs
    drop = drop | (cum_before >= mx.array(top_p, dtype=probs.dtype)[:, None])
    drop = drop | (probs < probs[:, :1] * mx.array(min_p, dtype=probs.dtype)[:, None])
    # Scatter the sorted-order mask back to vocabulary order.
    inverse = mx.argsort(order, axis=-1)
    return mx.take_along_axis(drop, inverse, axis=-1)


def sample_batch(logits: mx.array, samplers: list[SeqSampler]):
    """Sample one token per row. Returns (tokens mx.array (B,), logprobs mx.array (B, V) or None).

    ``logits`` is float32 (B, V). Logprobs are of the distribution after penalties and bias, before
    temperature and truncation (what vLLM reports by default).
    """
    if any(s.params.needs_penalties for s in samplers):
        logits = _apply_penalties(logits, samplers)
    if any(s.params.logit_bias for s in samplers):
        logits = _apply_logit_bias(logits, samplers)
    want_logprobs = any(s.params.logprobs for s in samplers)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True) if want_logprobs else None

    greedy = [s.params.greedy for s in samplers]
    argmax = mx.argmax(logits, axis=-1)
    if all(greedy):
        return argmax, logprobs

    temps = mx.array([s.params.temperature if s.params.temperature > 0 else 1.0 for s in samplers], dtype=logits.dtype)
    scaled = logits / temps[:, None]
    mask = _truncation_mask(scaled, samplers)
    if mask is not None:
        scaled = mx.where(mask, -mx.inf, scaled)

    B, V = logits.shape
    seeded = [i for i, s in enumerate(samplers) if s.key is not None and not s.params.greedy]
    if len(seeded) == B:
        noise = mx.stack([mx.random.gumbel(shape=(V,), key=samplers[i].next_key()) for i in seeded])
    else:
        noise = mx.random.gumbel(shape=(B, V))
        if seeded:
            rows = mx.array(seeded)
            own = mx.stack([mx.random.gumbel(shape=(V,), key=samplers[i].next_key()) for i in seeded])
            noise = noise.at[rows].add(own - noise[rows])
    sampled = mx.argmax(scaled + noise, axis=-1)
    tokens = mx.where(mx.array(greedy), argmax, sampled)
    return tokens, logprobs


def top_logprobs_for(row_logprobs: np.ndarray, k: int) -> list[tuple[int, float]]:
    if k <= 0:
        return []
    idx = np.argpartition(-row_logprobs, k - 1)[:k]
    idx = idx[np.argsort(-row_logprobs[idx])]
    return [(int(i), float(row_logprobs[i])) for i in idx]
