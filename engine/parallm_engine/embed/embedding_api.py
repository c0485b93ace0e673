"""The embedding methods every engine has (``Engine`` for decoder models, ``EncoderEngine`` for BERT-family
models): ``embed`` / ``aembed`` (all texts of one call in flight at once, vectors in input order),
``embed_results`` / ``aembed_results`` (with token counts), ``submit_embedding`` (a handle to cancel).

::

    eng = get_engine("Qwen/Qwen3-Embedding-0.6B")
    docs = eng.embed(["first passage", "second passage"])          # list of vectors (unit length)
    q = eng.embed("what is in the first passage?", input_type="query")[0]   # the model's query prompt
    h = eng.submit_embedding("a long text", truncate=True); h.abort()      # cancellable

Inputs are strings or lists of token ids. An empty string is refused (InvalidRequestError); a text longer
than the context window is refused (ContextLengthExceededError) unless ``truncate=True``, which keeps its
first tokens (and its final special token, e.g. the EOS a last-token pooler reads).
"""

from __future__ import annotations

import asyncio
from typing import Any, Sequence

from parallm_engine.embed.embedding import EmbeddingHandle, EmbeddingResult, EmbeddingSpec, check_backbone, make_spec
from parallm_engine.embed.embedding_config import EmbeddingConfig, not_an_embedding_model, resolve_embedding_config
from parallm_engine.errors import ContextLengthExceededError, EngineDeadError, InvalidRequestError, NotAnEmbeddingModelError
from parallm_engine.core.request import Channel, Request
from parallm_engine.sampling.sampler import SamplingParams
from parallm_engine.core.validation import check_text

EmbeddingInput = str | Sequence[int]


class EmbeddingAPI:
    """Mixed into an engine that has ``model_info``, ``tokenizer``, ``encode``, ``abort``, ``_dead``
    (``EngineBase``) and ``_queue_embedding(request)``."""

    def embedding_config(self, pooling: str | None = None, normalize: bool | None = None) -> EmbeddingConfig:
        """The model's embedding configuration (``embedding_config.resolve_embedding_config``) with the
        caller's overrides; NotAnEmbeddingModelError for a chat model when ``pooling`` is not given."""
        base = self.__dict__.get("_embedding_config_obj", False)
        if base is False:  # read once (a benign race reads it twice)
            self._check_embedding_model()
            try:
                base = self._resolve_embedding_config(None)
            except NotAnEmbeddingModelError:
                base = None  # a chat model: it embeds only with the caller's pooling=
            self.__dict__["_embedding_config_obj"] = base
        if base is None:
            return self._resolve_embedding_config(pooling, normalize)
        return base.with_overrides(pooling, normalize)

    def _resolve_embedding_config(self, pooling: str | None, normalize: bool | None = None) -> EmbeddingConfig:
        info = self.model_info
        cfg = info.config.get("text_config", info.config)
        dims = int(cfg.get("hidden_size") or cfg.get("d_model") or cfg.get("dim") or 0)
        return resolve_embedding_config(info.path, info.name, dims, pooling=pooling, normalize=normalize)

    def _check_embedding_model(self) -> None:
        """``Engine``: the decoder must have a hidden-state forward (``embedding.check_backbone``), and be causal:
        a bidirectional embedder (EmbeddingGemma) run with the engine's causal attention would give wrong
        vectors, so it is refused."""
        check_backbone(self.model)
        cfg = self.model_info.config.get("text_config", self.model_info.config)
        if cfg.get("use_bidirectional_attention") or cfg.get("is_causal") is False:
            raise not_an_embedding_model(self.model_info.name, "its attention is bidirectional, and the engine runs "
                                         "decoders with causal attention only")

    # -- one request ----------------------------------------------------------------------------
    def submit_embedding(
        self,
        text: EmbeddingInput,
        *,
        loop: asyncio.AbstractEventLoop | None = None,
        input_type: str | None = None,
        instruction: str | None = None,
        pooling: str | None = None,
        normalize: bool | None = None,
        dimensions: int | None = None,
        truncate: bool = False,
        priority: int = 0,
        group=None,
        request_id: str | None = None,
    ) -> EmbeddingHandle:
        """Queue one text; returns a handle (``result()``, ``await aresult()``, ``abort()``).

        ``input_type``: ``"query"`` puts the model's query prompt before the text (Qwen3-Embedding's
        ``Instruct: ...\\nQuery:``, from its ``config_sentence_transformers.json``), ``"document"`` its
        document prompt; ``instruction``: a task description for queries, as ``Instruct: {task}\\nQuery: ``.
        ``pooling`` / ``normalize``: override the model's own configuration (``pooling`` also lets any
        decoder embed). ``dimensions``: Matryoshka truncation (then renormalised), for models trained so.
        ``truncate``: cut a text longer than the context window instead of refusing it."""
        if not self.is_alive:  # EngineBase: the decoder engine's core, or the encoder engine's own thread
            raise EngineDeadError(f"engine is not running: {self._dead}")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidRequestError(f"priority must be an integer, got {type(priority).__name__}", param="priority")
        config = self.embedding_config(pooling, normalize)
        spec = make_spec(config, pooling, normalize, dimensions)
        prefix = config.prompt_for(input_type, instruction)
        ids, truncated = self._embedding_ids(text, prefix, bool(truncate))
        req = Request(ids, SamplingParams(max_tokens=1), Channel(loop), request_id=request_id, priority=priority,
                      group=group)
        req.embedding: EmbeddingSpec = spec
        req.truncated = truncated
        self._queue_embedding(req)
        return EmbeddingHandle(self, req)

    def _embedding_ids(self, text: EmbeddingInput, prefix: str, truncate: bool) -> tuple[list[int], bool]:
        if isinstance(text, str):
            if not text:
                raise InvalidRequestError("cannot embed an empty string", param="input")
            check_text(text, "input")
            ids = list(self.tokenizer.encode(prefix + text, add_special_tokens=True))
        elif isinstance(text, (list, tuple)) and text and all(isinstance(t, int) and not isinstance(t, bool)
                                                              for t in text):
            ids = list(text)
            vocab = self.model_info.vocab_size
            if any(t < 0 or t >= vocab for t in ids):
                raise InvalidRequestError(f"token ids must be in [0, {vocab})", param="input")
        else:
            raise InvalidRequestError(
                f"each input must be a non-empty string or list of token ids, got {type(text).__name__}", param="input")
        ctx = self.model_info.context_window
        if len(ids) <= ctx:
            return ids, False
        if not truncate:
            raise ContextLengthExceededError(
                f"input has {len(ids)} tokens; the model's context window is {ctx} (pass truncate=True to embed "
                "its first tokens)", param="input")
        special = set(getattr(self.tokenizer, "all_special_ids", None) or [])
        return (ids[: ctx - 1] + ids[-1:] if ids[-1] in special else ids[:ctx]), True

    # -- many texts -----------------------------------------------------------------------------
    @staticmethod
    def _embedding_inputs(texts) -> list:
        if isinstance(texts, str):
            return [texts]
        if isinstance(texts, (list, tuple)) and texts and all(isinstance(t, int) and not isinstance(t, bool)
                                                               for t in texts):
            return [list(texts)]  # one token-id input
        if not isinstance(texts, (list, tuple)):
            raise InvalidRequestError(f"texts must be a string or a list, got {type(texts).__name__}", param="input")
        return list(texts)

    def embed_results(self, texts: EmbeddingInput | list[EmbeddingInput], **options: Any) -> list[EmbeddingResult]:
        """Every text in flight at once; results in input order. Options as :meth:`submit_embedding`."""
        handles: list[EmbeddingHandle] = []
        try:
            group = options.pop("group", None) or object()  # one call's texts: one fairness group
            for t in self._embedding_inputs(texts):
                handles.append(self.submit_embedding(t, group=group, **options))
            return [h.result() for h in handles]
        finally:
            for h in handles:
                if not h.request.finished:
                    h.abort()

    async def aembed_results(self, texts: EmbeddingInput | list[EmbeddingInput], **options: Any) -> list[EmbeddingResult]:
        loop = asyncio.get_running_loop()
        handles: list[EmbeddingHandle] = []
        try:
            group = options.pop("group", None) or object()
            for t in self._embedding_inputs(texts):
                handles.append(self.submit_embedding(t, loop=loop, group=group, **options))
            return list(await asyncio.gather(*(h.aresult() for h in handles)))
        finally:
            for h in handles:
                if not h.request.finished:
                    h.abort()

    def embed(self, texts: EmbeddingInput | list[EmbeddingInput], **options: Any) -> list[list[float]]:
        """The vectors of ``texts`` (a bare string gives a one-item list)."""
        return [r.embedding for r in self.embed_results(texts, **options)]

    async def aembed(self, texts: EmbeddingInput | list[EmbeddingInput], **options: Any) -> list[list[float]]:
        return [r.embedding for r in await self.aembed_results(texts, **options)]

    # -- the decoder engine's queue ---------------------------------------------------------------
    def _queue_embedding(self, req: Request) -> None:
        """``Engine``: the scheduler takes it like any prompt (``embedding.EmbeddingSequence``)."""
        self.core.take_queue_slot()
        self.core.enqueue_add(req)
