"""Tiny random-weight embedding models for the embedding tests (a utility, not a test file).

* :func:`build_decoder_embedder`: a qwen3 model (``tests.model_zoo``) with the sentence-transformers files
  Qwen3-Embedding ships: ``modules.json`` (Transformer, Pooling, Normalize), ``1_Pooling/config.json``
  (last-token pooling) and ``config_sentence_transformers.json`` (its query prompt).
* :func:`build_bert_encoder`: a 2-layer BERT saved as mlx-embeddings loads it, with a WordPiece tokenizer
  built from a small vocabulary, and mean pooling + Normalize (all-MiniLM's configuration).
* :func:`reference_decoder` / :func:`reference_bert`: the vectors straight from the model's own forward.
"""

from __future__ import annotations

import json
from pathlib import Path

QUERY_PROMPT = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"


def write_sentence_transformers(out: Path, pooling: str, query_prompt: str = "") -> None:
    from parallm_bench.embed import write_sentence_transformers as write

    write(out, pooling, query_prompt, dims=64)


def build_decoder_embedder(out: Path, pooling: str = "last") -> Path:
    """A tiny qwen3 "Qwen3-Embedding" (the directory name marks it Matryoshka, as the real family is)."""
    from tests.model_zoo import build, default_tokenizer

    tok_dir, vocab = default_tokenizer()
    path = build("qwen3", out, tok_dir, vocab, verify=False)
    write_sentence_transformers(path, pooling, QUERY_PROMPT)
    return path


def reference_decoder(path: Path, ids_list: list[list[int]], pooling: str = "last", normalize: bool = True):
    """mlx-lm's own model (float32), one text at a time: ``model.model`` hidden states, pooled."""
    import mlx.core as mx
    from mlx_lm.utils import load

    model, _ = load(str(path))
    model.set_dtype(mx.float32)
    out = []
    for ids in ids_list:
        h = model.model(mx.array([ids]))[0]
        v = h[-1] if pooling == "last" else h[0] if pooling == "cls" else h.mean(axis=0)
        if normalize:
            v = v / mx.linalg.norm(v)
        out.append(v.tolist())
    return out


WORDS = ("the cat sat on mat dog ran fast slow red blue green apple pear query passage search answer a an of "
         "to in is was and or not what where who how why when retrieve relevant document text vector model "
         "engine batch token paris france capital river mountain city sun moon star").split()


def write_bert_tokenizer(out: Path, token_types: bool = False) -> int:
    """A WordPiece BERT tokenizer over ``WORDS`` saved in ``out``; ``token_types``: it also returns BERT's
    token type ids (a pair's second text: 1), as a cross-encoder's does. Returns the vocabulary size."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS + list("abcdefghijklmnopqrstuvwxyz0123456789.,?!") \
        + ["##" + c for c in "abcdefghijklmnopqrstuvwxyz0123456789"]
    ids = {w: i for i, w in enumerate(dict.fromkeys(vocab))}
    tok = Tokenizer(models.WordPiece(ids, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", ids["[CLS]"]), ("[SEP]", ids["[SEP]"])])
    extra = {"model_input_names": ["input_ids", "token_type_ids", "attention_mask"]} if token_types else {}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]", model_max_length=128, **extra)
    fast.save_pretrained(str(out))
    return len(ids)


def build_bert_encoder(out: Path, seed: int = 0) -> Path:
    """A 2-layer BERT (hidden 64) with a WordPiece tokenizer, saved the way mlx-embeddings loads it."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_embeddings.models import bert
    out.mkdir(parents=True, exist_ok=True)
    vocab_size = write_bert_tokenizer(out)
    config = {"model_type": "bert", "architectures": ["BertModel"], "vocab_size": vocab_size, "hidden_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
              "max_position_embeddings": 128, "type_vocab_size": 2, "layer_norm_eps": 1e-12}
    mx.random.seed(seed)
    model = bert.Model(bert.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (out / "config.json").write_text(json.dumps(config))
    write_sentence_transformers(out, "mean")
    return out


def reference_bert(path: Path, texts: list[str]):
    """mlx-embeddings' own load and forward, one text at a time: its mean-pooled, normalised text_embeds."""
    import mlx.core as mx
    from mlx_embeddings import load

    model, tokenizer = load(str(path))
    out = []
    for t in texts:
        ids = tokenizer.encode(t)
        o = model(mx.array([ids]), attention_mask=mx.ones((1, len(ids))))
        out.append(o.text_embeds[0].tolist())
    return out
