"""The rerank methods every engine has: ``rerank`` / ``arerank`` (a query and any number of documents ->
each document's relevance score, best first).

::

    eng = get_rerank_engine("Qwen/Qwen3-Reranker-0.6B")        # or a cross-encoder: BAAI/bge-reranker-base
    for r in eng.rerank("what is the capital of France?", docs, top_n=3):
        print(r.index, r.relevance_score)

On the decoder ``Engine`` (Qwen3-Reranker) each (query, document) pair is one request on the shared batch: its
prompt prefilled, its one answer position's logits read, nothing generated beyond it. The answer is
constrained to "yes" / "no" (``rerank.AnswerChoice``), so the log-probabilities the row reports are the
softmax over those two logits: p("yes") is the score. The document comes last in the prompt, so the
system + instruction + query tokens, the same for every candidate, are one prefix: the candidates of a call
arrive together and the radix cache prefills it once (in-flight dedup), then each row computes its document.

On a cross-encoder's engine (``cross_encoder.CrossEncoderEngine``) each pair is one row of a padded encoder
batch: ``[CLS] query [SEP] doc [SEP]`` with token types, the classification head, the model's activation.

As for embeddings (``embedding_api``): every pair is checked and tokenized before any is queued, at most a
quarter of the engine's queue is in flight per call (``window``), and ``wait=True`` waits where the queue is
full instead of raising QueueFullError.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from parallm_engine.core.request import Channel, Request
from parallm_engine.embed.embedding import EmbeddingHandle
from parallm_engine.embed.embedding_api import _BulkShare, _Window
from parallm_engine.embed.rerank import (
    AnswerChoice,
    DecoderPrompt,
    RerankResult,
    check_kind,
    check_rerank_args,
    decoder_prompt,
    decoder_score,
    is_decoder_reranker,
    not_a_reranker,
    ranked,
)
from parallm_engine.errors import EngineDeadError, InvalidRequestError
from parallm_engine.sampling.sampler import SamplingParams


class RerankAPI:
    """Mixed into an engine (``EngineBase``: ``model_info``, ``tokenizer``, ``abort``, ``is_alive``, ``max_queue``).
    This class runs decoder rerankers on the ``Engine``; ``CrossEncoderEngine`` overrides the pair, the
    submission and the result for cross-encoders; a plain ``EncoderEngine`` reranks nothing."""

    #: The kinds of reranker this engine runs (the first is what it runs a model as).
    rerank_kinds: tuple = ("decoder",)

    def rerank_kind(self, kind: str | None = None) -> str:
        """The kind this engine reranks its model as; NotARerankerError when it does not rerank (a chat model
        whose name and card do not say reranker, unless ``kind="decoder"``)."""
        check_kind(kind)
        name = self.model_info.name
        if not self.rerank_kinds:
            raise not_a_reranker(name, "an embedding encoder, without a classification head")
        own = self.rerank_kinds[0]
        if kind is not None and kind not in self.rerank_kinds:
            raise not_a_reranker(name, f"this engine runs it as a {own} model, not a {kind}")
        if own == "decoder" and kind is None:
            info = self.model_info
            if not is_decoder_reranker(info.config, [info.name, info.source, info.path.name], info.path):
                raise not_a_reranker(name, "a causal LM whose name and model card do not say reranker (pass "
                                     "kind='decoder' to score it with the Qwen3-Reranker prompt anyway)")
        return own

    # -- one call --------------------------------------------------------------------------------
    def rerank(self, query: str, documents: list, *, top_n: int | None = None, instruction: str | None = None,
               kind: str | None = None, truncate: bool = True, priority: int = 0, wait: bool = False,
               window: int | None = None) -> list[RerankResult]:
        """Each document's relevance to ``query``, best first (the first ``top_n``; None: all), as
        :class:`RerankResult` (``index`` into ``documents``, ``relevance_score``, ``tokens``).

        ``documents``: strings (or ``{"text": ...}`` objects). ``instruction``: a decoder reranker's task
        (default the card's "Given a web search query, retrieve relevant passages that answer the query");
        cross-encoders take none. ``truncate`` (default True, as sentence-transformers and Cohere do): a pair
        longer than the context window has its document cut; False refuses it (ContextLengthExceededError).
        ``wait`` / ``window``: as :meth:`embed_results`."""
        many, finish = self._rerank_many(query, documents, top_n, instruction, kind, truncate, priority, None,
                                         wait, window)
        return ranked(many.run(finish), top_n)

    async def arerank(self, query: str, documents: list, *, top_n: int | None = None,
                      instruction: str | None = None, kind: str | None = None, truncate: bool = True,
                      priority: int = 0, wait: bool = False, window: int | None = None) -> list[RerankResult]:
        """:meth:`rerank` on the caller's event loop (cancelling the task aborts what is in flight)."""
        many, finish = self._rerank_many(query, documents, top_n, instruction, kind, truncate, priority,
                                         asyncio.get_running_loop(), wait, window)
        return ranked(await many.arun(finish), top_n)

    def _rerank_many(self, query, documents, top_n, instruction, kind, truncate, priority, loop, wait,
                     window) -> tuple[_Window, Any]:
        if not self.is_alive:
            raise EngineDeadError(f"engine is not running: {self._dead}")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidRequestError(f"priority must be an integer, got {type(priority).__name__}", param="priority")
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise InvalidRequestError(f"window must be a positive integer, got {window!r}", param="window")
        if instruction is not None and not isinstance(instruction, str):
            raise InvalidRequestError(f"instruction must be a string, got {type(instruction).__name__}",
                                      param="instruction")
        texts = check_rerank_args(query, documents, top_n)
        self.rerank_kind(kind)
        # Every pair tokenized (and checked) before any is queued: a bad one fails the call before any runs.
        pairs = [self._rerank_pair(query, doc, instruction, bool(truncate)) for doc in texts]
        group = object()  # one call: one group (admission takes turns across callers)

        def submit(i: int) -> EmbeddingHandle:
            return self._submit_rerank(pairs[i], loop, priority, group)

        def finish(i: int, raw) -> RerankResult:
            return self._rerank_result(i, raw, pairs[i])

        share = max(1, self.max_queue // 4)
        bulk = self.__dict__.setdefault("_embedding_bulk", _BulkShare()) if wait else None  # embeddings' share
        many = _Window(submit, [len(p[0]) for p in pairs], window or share, self._queue_room, bulk, share)
        return many, finish

    # -- the decoder reranker (Engine) -------------------------------------------------------------
    def _decoder_prompt(self) -> DecoderPrompt:
        prompt = self.__dict__.get("_rerank_prompt")
        if prompt is None:
            prompt = self.__dict__["_rerank_prompt"] = decoder_prompt(self.tokenizer, self.model_info.name)
        return prompt

    def _rerank_pair(self, query: str, doc: str, instruction: str | None, truncate: bool) -> tuple:
        """(token ids, token types or None, truncated) of one pair."""
        # One position is the answer's: the prompt must leave room for it, as any prompt must.
        ids, truncated = self._decoder_prompt().pair_ids(self.tokenizer, query, doc, instruction,
                                                         self.model_info.context_window - 1, truncate)
        return ids, None, truncated

    def _submit_rerank(self, pair: tuple, loop, priority: int, group) -> EmbeddingHandle:
        """One prompt-only request: greedy, one token, constrained to yes / no, with both log-probabilities."""
        prompt = self._decoder_prompt()
        vocab = self.model_info.vocab_size
        params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=True, top_logprobs=2)
        req = Request(pair[0], params, Channel(loop), grammar=functools.partial(AnswerChoice, prompt.yes, prompt.no, vocab),
                      priority=priority, group=group)
        self.core.take_queue_slot()
        self.core.enqueue_add(req)
        return EmbeddingHandle(self, req)  # its result(): the request's GenerationResult

    def _rerank_result(self, index: int, raw, pair: tuple) -> RerankResult:
        usage = raw.usage
        prompt = self._decoder_prompt()
        return RerankResult(index, decoder_score(raw, prompt.yes, prompt.no), usage.prompt_tokens,
                            usage.cached_tokens, pair[2], dict(raw.metrics))
