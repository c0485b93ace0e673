"""Embedding requests on the shared engine: prefill only, no decode, no sampling.

An embedding request is one :class:`EmbeddingSequence` that the scheduler queues, admits (its tokens
count in the KV budget while it runs) and plans like any prompt; the model runner prefills it in the same
batched prefill forward as the chat prompts of that step (``runner.forward.prefill``), or chunk by chunk
when it is long.
The forward for a group that holds an embedding row runs the model's backbone (``model.model``: hidden
states after the final norm, the LM head skipped; the other rows need only their KV, which is the same);
each embedding row pools its own positions (last token / mean / first token) as its chunks pass. When its
prefill ends the vector is normalised, delivered, and its KV dropped: it never joins the decode batch.

Embedding rows neither read nor fill the prefix cache: an embedding text is seen once (a corpus being
indexed), so keeping its KV would only evict chat prefixes that do repeat; and a row computed from its
own tokens alone gives the vector the model gives that text alone, bit for bit as far as the batch allows.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import mlx.core as mx

from parallm_engine.embed.embedding_config import EmbeddingConfig, not_an_embedding_model
from parallm_engine.core.request import RequestHandle
from parallm_engine.core.sequence import Sequence


@dataclass(frozen=True)
class EmbeddingSpec:
    """How one request's vector is made (the engine's :class:`EmbeddingConfig`, the caller's overrides)."""

    pooling: str
    normalize: bool
    dimensions: int | None = None  # Matryoshka: keep the first ``dimensions`` values (then renormalise)


@dataclass
class EmbeddingResult:
    request_id: str
    embedding: list[float]
    prompt_tokens: int  # tokens embedded (after truncation)
    truncated: bool = False  # the text was cut to the model's context window
    metrics: dict[str, float] = field(default_factory=dict)


class EmbeddingHandle(RequestHandle):
    """What :meth:`Engine.submit_embedding` returns: ``result()`` / ``await aresult()``; ``abort()``."""

    def result(self) -> EmbeddingResult:
        for _ in self:
            pass
        return self.request.result

    async def aresult(self) -> EmbeddingResult:
        async for _ in self:
            pass
        return self.request.result


class EmbeddingSequence(Sequence):
    """A prefill-only row: its whole text is prefilled (no last token kept for a decode step)."""

    embedding = True
    adapter_key = None  # embeddings run on the base model (no LoRA adapter)
    cycle_guard = None  # nothing is generated, so nothing can cycle

    def __init__(self, request):  # no sampler, detokeniser or stops: nothing is generated
        self.request = request
        self.index = 0
        self.prompt_ids = request.prompt_ids
        self.output_ids: list[int] = []
        self.logprobs = None
        self.finish_reason = None
        self.preemptions = 0
        self._reset_prefill()

    def _reset_prefill(self) -> None:  # a step that failed to allocate restarts it (memory_recovery)
        super()._reset_prefill()
        self.pooled: mx.array | None = None  # running sum (mean), first (cls) or last hidden state

    @property
    def prefill_ids(self) -> list[int]:
        return self.prompt_ids

    def take(self, hidden: mx.array, start: int) -> None:
        """Pool the hidden states of context positions ``[start, start + len(hidden))``."""
        pooling = self.request.embedding.pooling
        if pooling == "mean":
            part = hidden.astype(mx.float32).sum(axis=0)
            self.pooled = part if self.pooled is None else self.pooled + part
        elif pooling == "cls":
            if start == 0:
                self.pooled = hidden[0].astype(mx.float32)
        else:
            self.pooled = hidden[-1].astype(mx.float32)

    def vector(self) -> mx.array:
        spec = self.request.embedding
        v = self.pooled / len(self.prompt_ids) if spec.pooling == "mean" else self.pooled
        if spec.dimensions is not None:
            v = v[: spec.dimensions]
        if spec.normalize:
            v = v / mx.maximum(mx.linalg.norm(v), 1e-12)
        return v


def check_backbone(model) -> None:
    """A typed error unless the model has a hidden-state forward (``model.model``, before the LM head) that
    embedding rows can run (``runner.forward.prefill``)."""
    inner = getattr(model, "model", None)
    if inner is None or not callable(inner):
        raise not_an_embedding_model(type(model).__module__, "its family has no hidden-state forward (model.model)")
    if getattr(model, "vision", None) is not None or getattr(model, "mrope", False):
        raise not_an_embedding_model(type(model).__module__, "vision-language models are not supported")


def finish_embeddings(finished: list, out, stats) -> list:
    """Deliver the embedding rows among the sequences whose prefill ended (their KV is dropped here);
    returns the others, which go on to the decode batch."""
    rows = [s for s in finished if s.embedding]
    if not rows:
        return finished
    vectors = [s.vector() for s in rows]
    mx.eval(vectors)
    now = time.monotonic()
    for seq, vec in zip(rows, vectors):
        req = seq.request
        seq.cache = seq.pooled = None
        req.first_token_time = now
        stats.on_prompt_done(req, 0)
        stats.embeddings_finished += 1
        stats.embedding_tokens += len(seq.prompt_ids)
        result = EmbeddingResult(req.id, vec.tolist(), len(seq.prompt_ids), getattr(req, "truncated", False),
                                 {"latency": now - req.arrival})
        out.complete(req, result)
    return [s for s in finished if not s.embedding]


def make_spec(config: EmbeddingConfig, pooling: str | None, normalize: bool | None,
              dimensions: int | None) -> EmbeddingSpec:
    cfg = config.with_overrides(pooling, normalize)
    return EmbeddingSpec(cfg.pooling, cfg.normalize, cfg.check_dimensions(dimensions))
