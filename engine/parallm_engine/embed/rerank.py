"""Rerankers: which models rerank, how each kind scores a (query, document) pair. Reads the model's own files,
loads nothing (the engines run the forwards: ``cross_encoder.py``, ``rerank_api.py``).

Two kinds, each scored as its model card defines:

* **cross-encoder** (BERT / XLM-R ``*ForSequenceClassification``: bge-reranker, ms-marco MiniLM): the pair
  ``[CLS] query [SEP] doc [SEP]`` through the encoder, the classification head, and sentence-transformers
  CrossEncoder's activation (:func:`cross_encoder_activation`: sigmoid of the one logit unless the model's
  config names another).
* **decoder** (Qwen3-Reranker): the card's chat prompt, and p("yes") of the softmax over the "yes" / "no"
  logits at the last position. The document comes last, so the system + instruction + query tokens, the same
  for every candidate, are a prefix the engine's radix cache computes once.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from parallm_engine.errors import InvalidRequestError, ModelLoadError, NotARerankerError

logger = logging.getLogger("parallm_engine")

KINDS = ("cross-encoder", "decoder")

WHICH_RERANKERS_WORK = (
    "Rerankers are: cross-encoders (BERT / XLM-RoBERTa *ForSequenceClassification with one output, e.g. "
    "BAAI/bge-reranker-base, cross-encoder/ms-marco-MiniLM-L6-v2) and decoder rerankers (Qwen/Qwen3-Reranker-"
    "0.6B/4B/8B: a Qwen3 causal LM answering \"yes\" / \"no\"); kind='cross-encoder' | 'decoder' names the kind "
    "of a model whose files do not say it."
)

#: The Qwen3-Reranker card's prompt: a system turn, the user turn (instruction, query, document), and an
#: empty thinking block opening the answer; the model's next token is "yes" or "no".
QWEN3_SYSTEM = ("Judge whether the Document meets the requirements based on the Query and the Instruct provided. "
                "Note that the answer can only be \"yes\" or \"no\".")
QWEN3_PREFIX = f"<|im_start|>system\n{QWEN3_SYSTEM}<|im_end|>\n<|im_start|>user\n"
QWEN3_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
QWEN3_USER = "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {doc}"
QWEN3_DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


@dataclass
class RerankResult:
    """One document's score. ``index``: its position in the call's ``documents``."""

    index: int
    relevance_score: float
    tokens: int  # tokens the pair took (after truncation)
    cached_tokens: int = 0  # of those, read from the prefix cache (decoder rerankers)
    truncated: bool = False  # the pair was cut to the model's context window
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def score(self) -> float:
        return self.relevance_score


def not_a_reranker(model: str, why: str) -> NotARerankerError:
    return NotARerankerError(f"{model} is not a reranker: {why}. {WHICH_RERANKERS_WORK}", param="model")


def check_kind(kind) -> str | None:
    if kind is not None and kind not in KINDS:
        raise InvalidRequestError(f"kind must be one of {KINDS} or None, got {kind!r}", param="kind")
    return kind


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def is_cross_encoder_config(config: dict, model_dir: Path | None = None) -> bool:
    """A sequence-classification encoder: ``*ForSequenceClassification`` in its architectures, or the
    sentence-transformers CrossEncoder keys in its files."""
    archs = config.get("architectures") or []
    if any(str(a).endswith("ForSequenceClassification") for a in archs):
        return True
    if "sentence_transformers" in config or "sbert_ce_default_activation_function" in config:
        return True
    if model_dir is not None:
        st = _read_json(Path(model_dir) / "config_sentence_transformers.json")
        return str(st.get("model_type", "")) == "CrossEncoder"
    return False


def is_decoder_reranker(config: dict, names: list[str], model_dir: Path | None = None) -> bool:
    """A Qwen3 causal LM whose name or model card says it is a reranker (Qwen3-Reranker ships as a plain
    ``Qwen3ForCausalLM``: only its name and card tell it apart from a chat model)."""
    cfg = config.get("text_config", config)
    archs = [str(a) for a in (config.get("architectures") or [])]
    if cfg.get("model_type") != "qwen3" or (archs and not any(a.endswith("ForCausalLM") for a in archs)):
        return False
    if any("reranker" in str(n).lower() for n in names if n):
        return True
    if model_dir is not None:
        try:
            card = (Path(model_dir) / "README.md").read_text(errors="replace")[:8192].lower()
        except OSError:
            return False
        return "qwen3-reranker" in card
    return False


# -- cross-encoders ---------------------------------------------------------------------------------

#: sentence-transformers' activation names (``torch.nn`` classes) -> the function on the logit.
_ACTIVATIONS = {
    "Sigmoid": lambda x: 1.0 / (1.0 + np.exp(-x)),
    "Identity": lambda x: x,
    "Tanh": np.tanh,
}


@dataclass(frozen=True)
class CrossEncoderHead:
    """How a cross-encoder's logits become a score: its number of labels and its activation."""

    num_labels: int
    activation: str  # a key of _ACTIVATIONS
    source: str  # where the activation was read

    def score(self, logit: float) -> float:
        return float(_ACTIVATIONS[self.activation](np.float64(logit)))


def cross_encoder_activation(config: dict, model_dir: Path | None = None) -> CrossEncoderHead:
    """sentence-transformers' rule: the ``activation_fn`` a saved CrossEncoder's
    ``config_sentence_transformers.json`` names (v5: read when the model loads, so it wins), else
    ``CrossEncoder.get_default_activation_fn``'s: the ``activation_fn`` in config.json's
    ``sentence_transformers`` entry (v4), else the older ``sbert_ce_default_activation_function``, else sigmoid
    when the model has one label (identity otherwise). A model with more than one label predicts classes,
    not a relevance: it is refused."""
    num_labels = len(config["id2label"]) if isinstance(config.get("id2label"), dict) and config["id2label"] \
        else int(config.get("num_labels") or 2)  # transformers' default is 2 labels
    path, source = None, "sentence-transformers' default (one label: sigmoid)"
    st = _read_json(Path(model_dir) / "config_sentence_transformers.json") if model_dir is not None else {}
    st_cfg = config.get("sentence_transformers")
    if st.get("activation_fn"):
        path, source = st["activation_fn"], "config_sentence_transformers.json activation_fn"
    elif isinstance(st_cfg, dict) and st_cfg.get("activation_fn"):
        path, source = st_cfg["activation_fn"], "config.json sentence_transformers.activation_fn"
    elif config.get("sbert_ce_default_activation_function"):
        path = config["sbert_ce_default_activation_function"]
        source = "config.json sbert_ce_default_activation_function"
    if num_labels != 1:
        raise not_a_reranker(str(model_dir or "this model"), f"its classifier has {num_labels} labels (a reranker "
                             "has one relevance logit)")
    if path is None:
        return CrossEncoderHead(1, "Sigmoid", source)
    name = str(path).rsplit(".", 1)[-1]
    if not str(path).startswith("torch.") or name not in _ACTIVATIONS:
        raise ModelLoadError(f"cross-encoder activation {path!r} ({source}) is not supported; supported: "
                             f"{', '.join('torch.nn.' + n for n in _ACTIVATIONS)}")
    return CrossEncoderHead(1, name, source)


# -- decoder rerankers ------------------------------------------------------------------------------


def single_token_id(tokenizer, word: str) -> int | None:
    """The id of ``word`` as one vocabulary token (as the Qwen3-Reranker code's ``convert_tokens_to_ids``),
    or None where it is not one token."""
    convert = getattr(tokenizer, "convert_tokens_to_ids", None)
    tid = convert(word) if convert is not None else None
    unk = getattr(tokenizer, "unk_token_id", None)
    if isinstance(tid, int) and tid >= 0 and tid != unk:
        return tid
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    return vocab.get(word)


@dataclass(frozen=True)
class DecoderPrompt:
    """The Qwen3-Reranker prompt in tokens: ``prefix`` (system turn), then per document the user text, then
    ``suffix``; ``yes`` / ``no`` the answer tokens whose logits give the score."""

    prefix: tuple[int, ...]
    suffix: tuple[int, ...]
    yes: int
    no: int

    def pair_ids(self, tokenizer, query: str, doc: str, instruction: str | None, limit: int,
                 truncate: bool) -> tuple[list[int], bool]:
        """Tokens of one (query, document) pair: prefix + the user text + suffix, as the card's code makes
        them; a pair over ``limit`` tokens has its user text cut at the end (the document's tail) when
        ``truncate``."""
        text = QWEN3_USER.format(instruction=instruction or QWEN3_DEFAULT_INSTRUCTION, query=query, doc=doc)
        body = list(tokenizer.encode(text, add_special_tokens=False))
        room = limit - len(self.prefix) - len(self.suffix)
        truncated = len(body) > room
        if truncated:
            from parallm_engine.errors import ContextLengthExceededError

            if not truncate or room <= 0:
                raise ContextLengthExceededError(
                    f"the query and document take {len(body) + len(self.prefix) + len(self.suffix)} tokens; the "
                    f"model's context window leaves {limit}" + ("" if room <= 0 else " (pass truncate=True to cut "
                                                                  "the document)"), param="documents")
            body = body[:room]
        return list(self.prefix) + body + list(self.suffix), truncated


def decoder_prompt(tokenizer, model: str) -> DecoderPrompt:
    yes, no = single_token_id(tokenizer, "yes"), single_token_id(tokenizer, "no")
    if yes is None or no is None:
        raise not_a_reranker(model, "its vocabulary has no single \"yes\" / \"no\" tokens for the decoder "
                             "reranker's answer")
    return DecoderPrompt(tuple(tokenizer.encode(QWEN3_PREFIX, add_special_tokens=False)),
                         tuple(tokenizer.encode(QWEN3_SUFFIX, add_special_tokens=False)), yes, no)


class AnswerChoice:
    """The decoder reranker's one answer token, as a constraint of the engine's sampler
    (``sampling.constrained``'s interface): only "yes" and "no" are allowed, so the logprobs the row reports
    are the log-softmax over just those two logits, which is the card's score (p(yes) = exp(logprob of yes))."""

    def __init__(self, yes: int, no: int, vocab_size: int):
        self.allowed = (yes, no)
        self.words = (vocab_size + 31) // 32  # the bitmask width every constraint of the batch shares
        self.done = False

    def fill_bitmask(self, row: np.ndarray) -> None:
        bits = row.view(np.uint32)
        bits[:] = 0
        for t in self.allowed:
            bits[t // 32] |= np.uint32(1 << (t % 32))

    def advance(self, token: int) -> None:
        self.done = True

    def is_done(self) -> bool:
        return self.done


def decoder_score(result, yes: int, no: int) -> float:
    """p(yes) from a finished one-token request constrained by :class:`AnswerChoice` (``top_logprobs=2``):
    the sigmoid of logit(yes) - logit(no) (= the two log-probabilities' difference), in float64, so a score
    near 1 keeps the resolution the float32 log-probability of "yes" alone would round away."""
    lp = result.choices[0].logprobs[0]
    tops = {tid: value for tid, _tok, value in lp.top_logprobs}
    tops.setdefault(lp.token_id, lp.logprob)
    diff = tops.get(yes, -math.inf) - tops.get(no, -math.inf)
    if math.isnan(diff):
        return 0.0
    return 1.0 / (1.0 + math.exp(-diff)) if diff > -700 else 0.0


def check_rerank_args(query, documents, top_n) -> list[str]:
    """The call's documents as strings (``{"text": ...}`` objects too); a typed error for anything else."""
    from parallm_engine.core.validation import check_text

    if not isinstance(query, str) or not query:
        got = "an empty string" if isinstance(query, str) else type(query).__name__
        raise InvalidRequestError(f"query must be a non-empty string, got {got}", param="query")
    check_text(query, "query")
    if isinstance(documents, (str, bytes)) or not isinstance(documents, (list, tuple)):
        raise InvalidRequestError(f"documents must be a list of strings, got {type(documents).__name__}",
                                  param="documents")
    if not documents:
        raise InvalidRequestError("documents must not be empty", param="documents")
    texts = []
    for i, d in enumerate(documents):
        if isinstance(d, dict) and isinstance(d.get("text"), str):
            d = d["text"]
        if not isinstance(d, str):
            raise InvalidRequestError(f"documents[{i}] must be a string (or an object with a 'text' string), got "
                                      f"{type(d).__name__}", param="documents")
        check_text(d, "documents")
        texts.append(d)
    if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1):
        raise InvalidRequestError(f"top_n must be a positive integer or None, got {top_n!r}", param="top_n")
    return texts


def ranked(results: list[RerankResult], top_n: int | None) -> list[RerankResult]:
    """Best first (ties: input order), the first ``top_n``."""
    out = sorted(results, key=lambda r: (-r.relevance_score, r.index))
    return out if top_n is None else out[:top_n]
