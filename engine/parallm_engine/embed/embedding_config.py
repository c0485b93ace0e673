"""What makes a model an embedding model, and how its vectors are made: pooling, normalisation, the
query instruction, Matryoshka truncation. Pure Python: reads the model's own files, loads nothing.

A model is an embedding model when its directory carries a sentence-transformers configuration
(``modules.json`` with a ``Pooling`` module: Qwen3-Embedding, gte-Qwen2, bge, e5, nomic, all-MiniLM ...)
or when the caller names the pooling itself (``pooling="last" | "mean" | "cls"``: any decoder's hidden
states, e.g. to try a model that ships without those files). A chat model asked for embeddings with
neither gets :class:`NotAnEmbeddingModelError`, which says so.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path

from parallm_engine.errors import InvalidRequestError, NotAnEmbeddingModelError

logger = logging.getLogger("parallm_engine")

POOLINGS = ("last", "mean", "cls")

#: sentence-transformers' ``1_Pooling/config.json`` flags -> our pooling names.
_ST_POOLING = {
    "pooling_mode_lasttoken": "last",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
}

#: Families trained with Matryoshka representation learning (their model cards say a prefix of the vector
#: is itself an embedding): ``dimensions=`` truncates and renormalises. Matched on the model's name.
MATRYOSHKA_FAMILIES = (
    "qwen3-embedding", "nomic-embed-text-v1.5", "nomic-embed-text-v2", "mxbai-embed-large",
    "snowflake-arctic-embed-m-v1.5", "snowflake-arctic-embed-l-v2", "embeddinggemma", "jina-embeddings-v3",
    "gte-modernbert", "modernbert-embed",
)

#: The query instruction format of instruction-tuned decoder embedders (the Qwen3-Embedding card).
INSTRUCTION_FORMAT = "Instruct: {task}\nQuery: "

WHICH_MODELS_WORK = (
    "Embedding models are: decoder embedding models with sentence-transformers files (modules.json + "
    "1_Pooling/config.json), e.g. Qwen3-Embedding-0.6B/4B/8B or gte-Qwen2; encoder models (BERT family: bge, "
    "e5, nomic-embed, all-MiniLM) through mlx-embeddings (`pip install mlx-embeddings`); or any decoder model "
    "with an explicit pooling='last' | 'mean' | 'cls'."
)


def not_an_embedding_model(model: str, why: str) -> NotAnEmbeddingModelError:
    return NotAnEmbeddingModelError(f"{model} is not an embedding model: {why}. {WHICH_MODELS_WORK}", param="model")


@dataclass(frozen=True)
class EmbeddingConfig:
    pooling: str  # "last" | "mean" | "cls"
    normalize: bool
    dimensions: int  # the model's native vector size (its hidden size)
    matryoshka: bool = False  # dimensions= may truncate (then renormalise)
    query_prompt: str = ""  # prepended to queries (``embed_query``; ``input_type="query"``)
    document_prompt: str = ""
    source: str = ""  # where this was found (the model's files, or the caller's override)

    def with_overrides(self, pooling: str | None = None, normalize: bool | None = None) -> "EmbeddingConfig":
        if pooling is not None:
            check_pooling(pooling)
        if pooling is None and normalize is None:
            return self
        return replace(self, pooling=pooling or self.pooling,
                       normalize=self.normalize if normalize is None else bool(normalize),
                       source=f"{self.source}; caller's override")

    def prompt_for(self, input_type: str | None, instruction: str | None) -> str:
        """The text put before each input: an explicit ``instruction`` (a task description, wrapped in
        :data:`INSTRUCTION_FORMAT`) for queries, else the model's own prompt for that input type."""
        if input_type not in (None, "query", "document"):
            raise InvalidRequestError(f"input_type must be 'query' or 'document', got {input_type!r}",
                                      param="input_type")
        if input_type == "query":
            return INSTRUCTION_FORMAT.format(task=instruction) if instruction else self.query_prompt
        if input_type == "document":
            return self.document_prompt
        return ""

    def check_dimensions(self, dimensions: int | None) -> int | None:
        if dimensions is None:
            return None
        if isinstance(dimensions, bool) or not isinstance(dimensions, int) or not 1 <= dimensions <= self.dimensions:
            raise InvalidRequestError(f"dimensions must be an integer in [1, {self.dimensions}], got {dimensions!r}",
                                      param="dimensions")
        if dimensions != self.dimensions and not self.matryoshka:
            raise InvalidRequestError(
                "this model was not trained for truncated vectors (Matryoshka); dimensions= works with "
                f"{', '.join(MATRYOSHKA_FAMILIES)}",
                param="dimensions")
        return dimensions


def check_pooling(pooling) -> str:
    if pooling not in POOLINGS:
        raise InvalidRequestError(f"pooling must be one of {POOLINGS}, got {pooling!r}", param="pooling")
    return pooling


def _read_json(path: Path) -> dict | list | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        logger.warning("could not read %s: %s", path, exc)
        return None


def sentence_transformers_config(model_dir: Path) -> dict | None:
    """The pooling, normalisation and prompts a sentence-transformers model directory declares, or None
    when it has no ``modules.json`` with a Pooling module."""
    modules = _read_json(model_dir / "modules.json") if (model_dir / "modules.json").is_file() else None
    if not isinstance(modules, list):
        return None
    pooling, normalize = None, False
    for m in modules:
        kind = str((m or {}).get("type", ""))
        if kind.endswith("Pooling"):
            cfg = _read_json(model_dir / str(m.get("path", "")) / "config.json") or {}
            pooling = next((ours for flag, ours in _ST_POOLING.items() if cfg.get(flag)), None)
            if pooling is None:
                logger.warning("%s: pooling mode %s is not supported (last / mean / cls are)", model_dir, cfg)
                return None
        elif kind.endswith("Normalize"):
            normalize = True
    if pooling is None:
        return None
    st = _read_json(model_dir / "config_sentence_transformers.json") \
        if (model_dir / "config_sentence_transformers.json").is_file() else None
    prompts = (st or {}).get("prompts") or {}
    return {"pooling": pooling, "normalize": normalize, "query_prompt": str(prompts.get("query") or ""),
            "document_prompt": str(prompts.get("document") or ""), "source": str(model_dir / "modules.json")}


def is_matryoshka(names: list[str]) -> bool:
    return any(fam in str(n).lower() for n in names if n for fam in MATRYOSHKA_FAMILIES)


def resolve_embedding_config(model_dir: Path | None, name: str, dimensions: int, *, pooling: str | None = None,
                             normalize: bool | None = None, matryoshka: bool | None = None) -> EmbeddingConfig:
    """The model's embedding configuration from its own files, with the caller's overrides; raises
    :class:`NotAnEmbeddingModelError` when there is none and ``pooling`` is not given."""
    st = sentence_transformers_config(Path(model_dir)) if model_dir is not None else None
    mrl = is_matryoshka([name, Path(model_dir).name if model_dir else ""]) if matryoshka is None else bool(matryoshka)
    if st is None:
        if pooling is None:
            raise not_an_embedding_model(name, "its directory has no sentence-transformers modules.json with a "
                                                 "Pooling module, and no pooling= was given")
        check_pooling(pooling)
        return EmbeddingConfig(pooling, True if normalize is None else bool(normalize), dimensions, mrl,
                               source="caller's pooling= (the model has no embedding configuration)")
    base = EmbeddingConfig(st["pooling"], st["normalize"], dimensions, mrl, st["query_prompt"],
                           st["document_prompt"], st["source"])
    return base.with_overrides(pooling, normalize)
