"""Tiny random-weight rerankers for the rerank tests (a utility, not a test file).

* :func:`build_bert_cross_encoder`: a 2-layer ``BertForSequenceClassification`` (one label) saved as
  transformers saves one (the body under ``bert.``, the head under ``classifier.``), with the WordPiece
  tokenizer of ``tests.embedding_models`` (pair template ``[CLS] $A [SEP] $B [SEP]`` with token types).
* :func:`build_xlmr_cross_encoder`: the same for XLM-RoBERTa (bge-reranker's family):
  ``XLMRobertaForSequenceClassification`` (the body under ``roberta.``, no pooler, the RoBERTa head
  ``classifier.dense`` / ``classifier.out_proj``), positions counted from the padding id + 1, one token type,
  a tokenizer with XLM-R's specials (``<s>`` 0, ``<pad>`` 1, ``</s>`` 2) and pair template
  ``<s> $A </s></s> $B </s>``.
* :func:`reference_cross_encoder`: their scores computed in numpy straight from the safetensors weights and the
  HF tokenizer, following transformers' ``modeling_bert`` / ``modeling_xlm_roberta`` (torch and
  sentence-transformers are not installable here): embeddings (word + position + token type) and LayerNorm,
  self-attention, erf GELU, the head on the first token (BERT: the tanh pooler, then the classifier;
  RoBERTa: ``out_proj(tanh(dense(h)))``), then sentence-transformers CrossEncoder's activation (the config's
  ``sentence_transformers.activation_fn``, else sigmoid for one label).
* :func:`build_decoder_reranker`: a tiny qwen3 named like Qwen3-Reranker, with the default model's tokenizer
  (ChatML; "yes" and "no" are single tokens).
* :func:`reference_decoder_scores`: the Qwen3-Reranker card's formula with mlx-lm alone: ``mlx_lm.load``, the
  model on each pair's ids, softmax over the last position's "no" / "yes" logits.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from tests.embedding_models import write_bert_tokenizer


def build_bert_cross_encoder(out: Path, seed: int = 0, config_extra: dict | None = None,
                             num_labels: int = 1) -> Path:
    """A 2-layer BERT cross-encoder (hidden 64, one label) in transformers' ForSequenceClassification layout."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_embeddings.models import bert

    out.mkdir(parents=True, exist_ok=True)
    vocab_size = write_bert_tokenizer(out, token_types=True)
    config = {"model_type": "bert", "architectures": ["BertForSequenceClassification"], "vocab_size": vocab_size,
              "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
              "max_position_embeddings": 128, "type_vocab_size": 2, "layer_norm_eps": 1e-12, "hidden_act": "gelu",
              "id2label": {str(i): f"LABEL_{i}" for i in range(num_labels)},
              "label2id": {f"LABEL_{i}": i for i in range(num_labels)}, **(config_extra or {})}
    mx.random.seed(seed)
    body = bert.Model(bert.ModelArgs.from_dict(config))
    mx.eval(body.parameters())
    weights = {"bert." + k: v for k, v in tree_flatten(body.parameters())}
    # A larger spread than nn.Linear's init, so the scores are spread over (0, 1), not all near 0.5.
    weights["classifier.weight"] = mx.random.normal((num_labels, 64)) * 0.5
    weights["classifier.bias"] = mx.random.normal((num_labels,)) * 0.1
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config))
    return out


def build_xlmr_cross_encoder(out: Path, seed: int = 0) -> Path:
    """A 2-layer XLM-RoBERTa cross-encoder (hidden 64, one label) in transformers' layout, as bge-reranker."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_embeddings.models import xlm_roberta
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from tests.embedding_models import WORDS

    out.mkdir(parents=True, exist_ok=True)
    vocab = ["<s>", "<pad>", "</s>", "<unk>"] + WORDS + list("abcdefghijklmnopqrstuvwxyz0123456789.,?!") + ["<mask>"]
    ids = {w: i for i, w in enumerate(dict.fromkeys(vocab))}
    tok = Tokenizer(models.WordLevel(ids, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                            pad_token="<pad>", cls_token="<s>", sep_token="</s>", mask_token="<mask>",
                            model_max_length=128, model_input_names=["input_ids", "attention_mask"]
                            ).save_pretrained(str(out))
    config = {"model_type": "xlm-roberta", "architectures": ["XLMRobertaForSequenceClassification"],
              "vocab_size": len(ids), "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "intermediate_size": 128, "max_position_embeddings": 130, "type_vocab_size": 1,
              "layer_norm_eps": 1e-5, "hidden_act": "gelu", "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2,
              "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}
    mx.random.seed(seed)
    args = xlm_roberta.ModelArgs.from_dict(config)
    args.add_pooling_layer = False  # XLMRobertaForSequenceClassification has no pooler
    body = xlm_roberta.Model(args)
    mx.eval(body.parameters())
    weights = {"roberta." + k: v for k, v in tree_flatten(body.parameters())}
    # Spread wider than nn.Linear's init, so the scores are spread over (0, 1) (and positions matter).
    weights["roberta.embeddings.position_embeddings.weight"] = mx.random.normal((130, 64))
    weights["classifier.dense.weight"] = mx.random.normal((64, 64)) * 0.3
    weights["classifier.dense.bias"] = mx.random.normal((64,)) * 0.1
    weights["classifier.out_proj.weight"] = mx.random.normal((1, 64)) * 0.5
    weights["classifier.out_proj.bias"] = mx.random.normal((1,)) * 0.1
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config))
    return out


def _layer_norm(x, g, b, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * g + b


_erf = np.vectorize(math.erf)


def reference_cross_encoder(path: Path, query: str, documents: list[str]) -> list[float]:
    """Each (query, document)'s score from numpy (float64) on the safetensors weights: transformers'
    BertForSequenceClassification / XLMRobertaForSequenceClassification forward, then sentence-transformers'
    activation."""
    from safetensors.numpy import load_file
    from transformers import AutoTokenizer

    cfg = json.loads((path / "config.json").read_text())
    w = {k: v.astype(np.float64) for k, v in load_file(str(path / "model.safetensors")).items()}
    tok = AutoTokenizer.from_pretrained(str(path))
    roberta = cfg["model_type"] in ("xlm-roberta", "xlm_roberta")
    b = "roberta." if roberta else "bert."
    H = cfg["num_attention_heads"]
    eps = cfg["layer_norm_eps"]
    act = ((cfg.get("sentence_transformers") or {}).get("activation_fn")
           or cfg.get("sbert_ce_default_activation_function") or "torch.nn.modules.activation.Sigmoid")
    scores = []
    for doc in documents:
        enc = tok(query, doc, truncation=True)
        ids = np.array(enc["input_ids"])
        types = np.array(enc["token_type_ids"]) if "token_type_ids" in enc else np.zeros_like(ids)
        n = len(ids)
        # RoBERTa numbers positions from the padding id + 1 (one unpadded pair: pad + 1 ... pad + n)
        positions = np.arange(n) + (cfg["pad_token_id"] + 1 if roberta else 0)
        x = (w[b + "embeddings.word_embeddings.weight"][ids] + w[b + "embeddings.position_embeddings.weight"][positions]
             + w[b + "embeddings.token_type_embeddings.weight"][types])
        x = _layer_norm(x, w[b + "embeddings.LayerNorm.weight"], w[b + "embeddings.LayerNorm.bias"], eps)
        for i in range(cfg["num_hidden_layers"]):
            p = f"{b}encoder.layer.{i}."

            def lin(name, v):
                return v @ w[p + name + ".weight"].T + w[p + name + ".bias"]

            d = x.shape[-1] // H
            q, k, v = (lin(f"attention.self.{m}", x).reshape(n, H, d).transpose(1, 0, 2)
                       for m in ("query", "key", "value"))
            s = q @ k.transpose(0, 2, 1) / math.sqrt(d)  # one unpadded pair: every position attends
            s = np.exp(s - s.max(-1, keepdims=True))
            ctx = (s / s.sum(-1, keepdims=True)) @ v
            ctx = ctx.transpose(1, 0, 2).reshape(n, H * d)
            a = _layer_norm(lin("attention.output.dense", ctx) + x, w[p + "attention.output.LayerNorm.weight"],
                            w[p + "attention.output.LayerNorm.bias"], eps)
            h = lin("intermediate.dense", a)
            h = 0.5 * h * (1.0 + _erf(h / math.sqrt(2.0)))  # transformers' "gelu": the exact erf form
            x = _layer_norm(lin("output.dense", h) + a, w[p + "output.LayerNorm.weight"],
                            w[p + "output.LayerNorm.bias"], eps)
        if roberta:  # RobertaClassificationHead on <s>
            hidden = np.tanh(x[0] @ w["classifier.dense.weight"].T + w["classifier.dense.bias"])
            logit = float((hidden @ w["classifier.out_proj.weight"].T + w["classifier.out_proj.bias"])[0])
        else:
            pooled = np.tanh(x[0] @ w["bert.pooler.dense.weight"].T + w["bert.pooler.dense.bias"])
            logit = float((pooled @ w["classifier.weight"].T + w["classifier.bias"])[0])
        name = act.rsplit(".", 1)[-1]
        scores.append(1 / (1 + math.exp(-logit)) if name == "Sigmoid" else math.tanh(logit) if name == "Tanh"
                      else logit)
    return scores


def build_decoder_reranker(out: Path) -> Path:
    """A tiny random qwen3 named like Qwen3-Reranker (its name is what marks a decoder reranker)."""
    from tests.model_zoo import build, default_tokenizer

    tok_dir, vocab = default_tokenizer()
    return build("qwen3", out, tok_dir, vocab, verify=False)


def reference_decoder_scores(path: Path, ids_list: list[list[int]], yes: int, no: int) -> list[float]:
    """mlx-lm alone, one pair at a time: the last position's logits, softmax over (no, yes), p(yes)."""
    import mlx.core as mx
    from mlx_lm import load

    model, _ = load(str(path))
    model.set_dtype(mx.float32)
    out = []
    for ids in ids_list:
        logits = model(mx.array([ids]))[0, -1].astype(mx.float32)
        pair = np.array([logits[no].item(), logits[yes].item()], dtype=np.float64)
        p = np.exp(pair - pair.max())
        out.append(float(p[1] / p.sum()))
    return out
