"""Encoder embedding models (BERT family: bge, e5, all-MiniLM, gte, multilingual-e5 / XLM-R, ModernBERT)
through mlx-embeddings, with the same surface as the decoder engine (``embedding_api.EmbeddingAPI``).

An encoder has no KV cache and no decode: every text is one bidirectional forward. One thread owns the
model; each step takes every waiting text it can (up to ``max_batch_size`` texts and ``max_batch_tokens``
padded tokens, most urgent first, similar lengths together so padding stays small), runs them as one
right-padded batch with an attention mask, pools each row over its own tokens (the model's
sentence-transformers configuration: mean / CLS / last) and delivers. Texts join and leave between steps;
an aborted text that has not started costs nothing.

``get_embedding_engine(model)`` (``registry``) picks this engine for a model whose ``config.json`` names an
encoder family, the decoder ``Engine`` otherwise; one engine per model per process either way.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from pathlib import Path

from parallm_engine.embed.embedding import EmbeddingResult
from parallm_engine.embed.embedding_api import EmbeddingAPI
from parallm_engine.embed.rerank_api import RerankAPI
from parallm_engine.core.engine_base import EngineBase
from parallm_engine.errors import EngineDeadError, InvalidRequestError, ModelLoadError, QueueFullError, RequestCancelledError
from parallm_engine.models.hub import ENCODER_TYPES
from parallm_engine.models.loader import ModelInfo, resolve_model
from parallm_engine.core.request import _Done
from parallm_engine.core.stats import EngineStats

logger = logging.getLogger("parallm_engine")

#: ``model_type`` values of the encoder families mlx-embeddings 0.1 implements.
def encoder_model_type(model) -> str | None:
    """The encoder family of a model directory (or HF id: downloaded on first use), or None for anything
    else. Loads no weights."""
    if model is None:
        return None
    try:
        path, _ = resolve_model(model, encoder_ok=True)
    except ModelLoadError:
        return None
    try:
        model_type = str(json.loads((path / "config.json").read_text()).get("model_type", ""))
    except (OSError, ValueError):
        return None
    return model_type if model_type in ENCODER_TYPES else None


def _load_mlx_embeddings(path: Path):
    try:
        import mlx_embeddings
    except ImportError as exc:
        raise ModelLoadError(f"{path} is an encoder embedding model; it needs mlx-embeddings "
                             "(`pip install mlx-embeddings`, or the `embeddings` extra)") from exc
    try:
        return mlx_embeddings.load(str(path))
    except Exception as exc:  # noqa: BLE001  (its loader raises ValueError / FileNotFoundError / KeyError)
        raise ModelLoadError(f"mlx-embeddings could not load {path}: {exc}") from exc


class EncoderEngine(EmbeddingAPI, RerankAPI, EngineBase):
    rerank_kinds: tuple = ()  # an embedding encoder has no classification head (cross_encoder.CrossEncoderEngine has)

    def __init__(self, model: str | os.PathLike, *, max_batch_size: int = 64, max_batch_tokens: int = 16384,
                 max_queue: int = 4096, dtype: str | None = None):
        import mlx.core as mx

        from parallm_engine.runner.backend import backend_info

        for name, value in (("max_batch_size", max_batch_size), ("max_batch_tokens", max_batch_tokens),
                            ("max_queue", max_queue)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidRequestError(f"{name} must be a positive integer, got {value!r}", param=name)
        path, name = resolve_model(model, encoder_ok=True)
        self.model, self.tokenizer = self._load(path)
        want = dtype or backend_info().dtype
        if want not in ("native", None):  # the CPU backend is fast in float32 only
            self.model.set_dtype(getattr(mx, want))
        cfg = json.loads((path / "config.json").read_text())
        self.model_info = ModelInfo(
            name=name, source=str(model), path=path,
            context_window=int(cfg.get("max_position_embeddings") or 512) - (2 if "roberta" in cfg["model_type"] else 0),
            vocab_size=int(cfg.get("vocab_size") or len(self.tokenizer.get_vocab())), dtype=str(want),
            num_layers=int(cfg.get("num_hidden_layers") or 0), num_kv_heads=0, head_dim=0, config=cfg)
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.max_queue = max_queue
        self.pad_id = int(getattr(self.tokenizer, "pad_token_id", None) or 0)
        self._stats = EngineStats()
        self._waiting: deque = deque()
        self._cond = threading.Condition()
        self._dead: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="parallm-encoder", daemon=True)
        self._thread.start()
        from parallm_engine.core.engine import _live_engines

        _live_engines.add(self)  # stopped before the interpreter tears MLX down (engine._shutdown_live_engines)

    def _load(self, path: Path):
        """(model, tokenizer) of the encoder at ``path`` (a cross-encoder's engine loads its head too)."""
        return _load_mlx_embeddings(path)

    # -- what the front ends read (model_name, context_window, is_alive: EngineBase) -------------------
    def _check_embedding_model(self) -> None:  # every encoder mlx-embeddings loads gives hidden states
        return None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise InvalidRequestError(f"text must be a string, got {type(text).__name__}")
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def stats(self) -> dict:
        snap = self._stats.snapshot()
        with self._cond:
            snap["waiting"] = len(self._waiting)
        snap["model"] = self.model_name
        return snap

    # -- queue ----------------------------------------------------------------------------------
    def _queue_embedding(self, req) -> None:
        with self._cond:
            if self._dead is not None:
                raise EngineDeadError(f"engine is not running: {self._dead}")
            if len(self._waiting) >= self.max_queue:
                self._stats.requests_rejected += 1
                raise QueueFullError(f"engine queue is full ({self.max_queue} texts waiting); retry later")
            self._stats.on_submit(req)
            self._waiting.append(req)
            self._cond.notify()

    def _queue_room(self) -> int:  # EmbeddingAPI's hint: the texts not yet in a batch count
        return self.max_queue - len(self._waiting)

    def abort(self, request) -> None:
        """Drop a text that has not started (one in the running batch finishes with it; nobody waits for it)."""
        with self._cond:
            req = next((r for r in self._waiting if r is request or r.id == request), None)
            if req is None:
                return
            self._waiting.remove(req)
        self._stats.on_abort(req)
        req.finished = True
        req.channel.put(_Done(RequestCancelledError(f"request {req.id} was cancelled")))

    # -- the engine thread ----------------------------------------------------------------------
    def _next_batch(self) -> list:
        """The most urgent waiting text and the others nearest its length, within both limits."""
        head = min(self._waiting, key=lambda r: (r.priority, r.arrival))
        n = len(head.prompt_ids)
        rest = sorted((r for r in self._waiting if r is not head), key=lambda r: abs(len(r.prompt_ids) - n))
        batch, longest = [head], n
        for r in rest:
            longest_if = max(longest, len(r.prompt_ids))
            if len(batch) >= self.max_batch_size or longest_if * (len(batch) + 1) > self.max_batch_tokens:
                break
            batch.append(r)
            longest = longest_if
        for r in batch:
            self._waiting.remove(r)
        return batch

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._waiting and self._dead is None:
                        self._cond.wait(0.5)
                    if self._dead is not None:
                        break
                    batch = self._next_batch()
                t0 = time.monotonic()
                try:
                    self._embed_batch(batch)
                except Exception as exc:  # noqa: BLE001  (one failing batch fails its texts, not the engine)
                    logger.exception("encoder batch failed")
                    for req in batch:
                        self._stats.on_abort(req)
                        req.finished = True
                        req.channel.put(_Done(exc))
                self._stats.busy_time += time.monotonic() - t0
        finally:
            self._dead = self._dead or EngineDeadError("engine thread stopped")
            with self._cond:
                left, self._waiting = list(self._waiting), deque()
            for req in left:
                req.finished = True
                req.channel.put(_Done(self._dead))
            import mlx.core as mx

            mx.synchronize()
            mx.clear_streams()  # as Engine._loop: this thread's streams go with it (mlx issue #3126)

    def _padded(self, batch: list):
        """(lengths, ids, mask) of a batch right-padded to its longest text."""
        import mlx.core as mx

        lens = [len(r.prompt_ids) for r in batch]
        L = max(lens)
        ids = mx.array([r.prompt_ids + [self.pad_id] * (L - n) for r, n in zip(batch, lens)])
        mask = mx.array([[1] * n + [0] * (L - n) for n in lens]).astype(mx.float32)
        return lens, ids, mask

    def _deliver(self, batch: list, lens: list[int], result) -> None:
        """The batch's forward counted; each request finished with ``result(req, n, i, now)``."""
        self._stats.prefill_forwards += 1
        self._stats.prefill_tokens += sum(lens)
        self._stats.on_step(len(batch), 0)
        now = time.monotonic()
        for i, (req, n) in enumerate(zip(batch, lens)):
            req.finished = True
            req.finish_time = req.first_token_time = now
            self._stats.on_finish(req)
            req.result = result(req, n, i, now)
            req.channel.put(_Done())

    def _embed_batch(self, batch: list) -> None:
        import mlx.core as mx

        lens, ids, mask = self._padded(batch)
        hidden = self.model(ids, attention_mask=mask).last_hidden_state
        vectors = []
        for i, (req, n) in enumerate(zip(batch, lens)):
            spec = req.embedding
            h = hidden[i, :n].astype(mx.float32)
            v = h.mean(axis=0) if spec.pooling == "mean" else h[0] if spec.pooling == "cls" else h[-1]
            if spec.dimensions is not None:
                v = v[: spec.dimensions]
            if spec.normalize:
                v = v / mx.maximum(mx.linalg.norm(v), 1e-12)
            vectors.append(v)
        mx.eval(vectors)
        self._stats.embeddings_finished += len(batch)
        self._stats.embedding_tokens += sum(lens)
        self._deliver(batch, lens, lambda req, n, i, now: EmbeddingResult(
            req.id, vectors[i].tolist(), n, getattr(req, "truncated", False), {"latency": now - req.arrival}))

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._dead = self._dead or EngineDeadError("engine was shut down")
            self._cond.notify_all()
        self._thread.join(timeout)
