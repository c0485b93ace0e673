"""Cross-encoder rerankers (BERT / XLM-R ``*ForSequenceClassification``: bge-reranker, ms-marco MiniLM) on an
encoder engine: mlx-embeddings' encoder classes for the body, the classification head loaded here.

mlx-embeddings 0.1 builds the bare encoder (``BertModel`` / ``XLMRobertaModel``) and loads a checkpoint
strictly, so a ``*ForSequenceClassification`` checkpoint (its body under ``bert.`` / ``roberta.``, its head
under ``classifier.``) does not load through ``mlx_embeddings.load``: its encoder class is built here from the
config, the body's weights loaded into it with the prefix taken off, and the head's into
:class:`CrossEncoderModel`. The head is the one transformers uses for the family:

* BERT: the pooler (``tanh(dense(h[CLS]))``, the encoder's own) then ``classifier`` (a linear layer);
* XLM-R / RoBERTa: ``RobertaClassificationHead``: ``out_proj(tanh(dense(h[CLS])))`` (no pooler).

A batch is the waiting pairs, right-padded with an attention mask (as embedding texts are, ``EncoderEngine``),
each ``[CLS] query [SEP] doc [SEP]`` with its token types from the tokenizer's pair encoding; the score is the
model's sentence-transformers activation of its one logit (``rerank.cross_encoder_activation``).
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path

from parallm_engine.core.request import Channel, Request
from parallm_engine.embed.embedding import EmbeddingHandle
from parallm_engine.embed.encoder_engine import EncoderEngine
from parallm_engine.embed.rerank import (
    CrossEncoderHead,
    RerankResult,
    cross_encoder_activation,
    is_cross_encoder_config,
    not_a_reranker,
)
from parallm_engine.errors import (
    ContextLengthExceededError,
    InvalidRequestError,
    ModelLoadError,
    NotAnEmbeddingModelError,
)
from parallm_engine.sampling.sampler import SamplingParams

#: ``model_type`` -> (mlx-embeddings module, the body's prefix in a ForSequenceClassification checkpoint).
FAMILIES = {"bert": ("bert", "bert."), "xlm-roberta": ("xlm_roberta", "roberta."),
            "xlm_roberta": ("xlm_roberta", "roberta.")}


def cross_encoder_dir(model) -> Path | None:
    """The directory of ``model`` (downloaded on first use) when it is a cross-encoder, else None."""
    from parallm_engine.models.loader import resolve_model

    if model is None:
        return None
    try:
        path, _ = resolve_model(model, encoder_ok=True)
        config = json.loads((path / "config.json").read_text())
    except (ModelLoadError, OSError, ValueError):
        return None
    return path if is_cross_encoder_config(config, path) else None


def _model_class():
    import mlx.core as mx
    import mlx.nn as nn

    class RobertaHead(nn.Module):
        def __init__(self, hidden: int, num_labels: int):
            super().__init__()
            self.dense = nn.Linear(hidden, hidden)
            self.out_proj = nn.Linear(hidden, num_labels)

        def __call__(self, x):
            return self.out_proj(mx.tanh(self.dense(x)))

    class CrossEncoderModel(nn.Module):
        """An mlx-embeddings encoder and a sequence-classification head: ``(ids, token types, mask)`` -> logits."""

        def __init__(self, encoder, hidden: int, num_labels: int, roberta_head: bool):
            super().__init__()
            self.encoder = encoder
            self.roberta_head = roberta_head
            self.head = RobertaHead(hidden, num_labels) if roberta_head else nn.Linear(hidden, num_labels)

        def __call__(self, ids, token_type_ids, attention_mask):
            out = self.encoder(ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
            if self.roberta_head:
                return self.head(out.last_hidden_state[:, 0])
            return self.head(out.pooler_output)  # BERT: classifier(tanh(pooler.dense(h[CLS])))

    return CrossEncoderModel


def load_cross_encoder(path: Path):
    """(CrossEncoderModel, HF tokenizer, CrossEncoderHead) of the checkpoint at ``path`` (safetensors)."""
    import mlx.core as mx

    config = json.loads((path / "config.json").read_text())
    head = cross_encoder_activation(config, path)
    family = FAMILIES.get(str(config.get("model_type")))
    if family is None:
        raise ModelLoadError(f"{path}: cross-encoders of the {config.get('model_type')!r} family are not supported "
                             f"(supported: {', '.join(sorted(set(FAMILIES)))})")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has no .safetensors weights (a pytorch_model.bin checkpoint: save it with "
                             "safe_serialization=True)")
    try:
        import mlx_embeddings.models  # noqa: F401  (the encoder classes)
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise ModelLoadError(f"{path} is a cross-encoder; it needs mlx-embeddings (`pip install mlx-embeddings`, "
                             "or the `embeddings` extra)") from exc
    module_name, prefix = family
    module = importlib.import_module(f"mlx_embeddings.models.{module_name}")
    weights: dict = {}
    for f in files:
        weights.update(mx.load(str(f)))
    if not any(k.startswith(prefix) for k in weights):
        prefix = ""  # a body saved without its prefix
    body = {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix) and not k.startswith("classifier.")}
    head_w = {"head." + k[len("classifier."):]: v for k, v in weights.items() if k.startswith("classifier.")}
    roberta_head = "head.out_proj.weight" in head_w
    if not roberta_head and "head.weight" not in head_w:
        raise not_a_reranker(path.name, "its checkpoint has no classifier head (classifier.weight)")
    args = dict(config)
    if module_name == "xlm_roberta":
        args["add_pooling_layer"] = any(k.startswith("pooler.") for k in body)
    encoder = module.Model(module.ModelArgs.from_dict(args))
    body = encoder.sanitize(body)
    model = _model_class()(encoder, int(config["hidden_size"]), head.num_labels, roberta_head)
    try:
        model.load_weights([("encoder." + k, v) for k, v in body.items()] + list(head_w.items()))
    except ValueError as exc:
        raise ModelLoadError(f"{path}: the cross-encoder's weights do not fit its config: {exc}") from exc
    mx.eval(model.parameters())
    model.eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:  # noqa: BLE001  (transformers raises OSError / ValueError / KeyError)
        raise ModelLoadError(f"could not load the tokenizer of {path}: {exc}") from exc
    return model, tokenizer, head


class CrossEncoderEngine(EncoderEngine):
    """An encoder engine whose rows are (query, document) pairs scored by a classification head."""

    rerank_kinds = ("cross-encoder",)

    def __init__(self, model: str | os.PathLike, **config):
        self.cross_head: CrossEncoderHead | None = None
        super().__init__(model, **config)
        tok_max = getattr(self.tokenizer, "model_max_length", None)
        if isinstance(tok_max, int) and 0 < tok_max < self.model_info.context_window:
            self.model_info.context_window = tok_max  # sentence-transformers' max_length: the tokenizer's

    def _load(self, path: Path):
        model, tokenizer, self.cross_head = load_cross_encoder(path)
        return model, tokenizer

    def _check_embedding_model(self) -> None:
        raise NotAnEmbeddingModelError(f"{self.model_name} is a cross-encoder: it scores (query, document) pairs "
                                       "(rerank), it does not embed", param="model")

    # -- RerankAPI's parts for cross-encoders ------------------------------------------------------
    def _rerank_pair(self, query: str, doc: str, instruction: str | None, truncate: bool) -> tuple:
        """``[CLS] query [SEP] doc [SEP]`` and its token types; cut longest-first to the context window (as
        sentence-transformers' ``truncation=True``) or refused."""
        if instruction is not None:
            raise InvalidRequestError("a cross-encoder takes no instruction (decoder rerankers do)",
                                      param="instruction")
        ctx = self.model_info.context_window
        enc = self.tokenizer(query, doc, truncation=False, verbose=False, return_token_type_ids=True)
        truncated = len(enc["input_ids"]) > ctx
        if truncated:
            if not truncate:
                raise ContextLengthExceededError(
                    f"the query and document take {len(enc['input_ids'])} tokens; the model's context window is "
                    f"{ctx} (pass truncate=True to cut them)", param="documents")
            enc = self.tokenizer(query, doc, truncation="longest_first", max_length=ctx, return_token_type_ids=True)
        ids = list(enc["input_ids"])
        types = list(enc.get("token_type_ids") or [0] * len(ids))
        return ids, types, truncated

    def _submit_rerank(self, pair: tuple, loop, priority: int, group) -> EmbeddingHandle:
        req = Request(pair[0], SamplingParams(max_tokens=1), Channel(loop), priority=priority, group=group)
        req.token_type_ids = pair[1]
        req.truncated = pair[2]
        self._queue_embedding(req)  # the encoder engine's queue
        return EmbeddingHandle(self, req)

    def _rerank_result(self, index: int, raw: RerankResult, pair: tuple) -> RerankResult:
        raw.index = index
        return raw

    # -- the engine thread: a batch of pairs ----------------------------------------------------------
    def _embed_batch(self, batch: list) -> None:
        import mlx.core as mx
        import numpy as np

        lens, ids, mask = self._padded(batch)
        L = ids.shape[1]
        types = mx.array([r.token_type_ids + [0] * (L - n) for r, n in zip(batch, lens)])
        logits = self.model(ids, types, mask)[:, 0].astype(mx.float32)
        values = np.array(logits).astype(np.float64)
        self._deliver(batch, lens, lambda req, n, i, now: RerankResult(
            -1, self.cross_head.score(values[i]), n, 0, getattr(req, "truncated", False),
            {"latency": now - req.arrival, "logit": float(values[i])}))
