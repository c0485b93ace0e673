"""Real family shapes for `parallm bench --shape qwen3-4b|llama3-8b|gemma3-4b`.

The default model (SmolLM2-135M) has a small model's costs: 64-dim heads, 30 thin layers, a 49k vocab.
A laptop user runs 4-8B models, whose decode cost per token, KV bytes per token and attention kinds are
different. ``--shape`` builds a **random-weight** model with the published architecture's exact config
(hidden size, heads, KV heads, head_dim, intermediate size, vocab, rope settings, Gemma 3's sliding-window
pattern, Qwen 3's q/k norms, max_position_embeddings) through mlx-lm's own model classes, writes it as an
MLX directory (config.json + safetensors + tokenizer files) and the bench loads it through the engine's
normal loader, like any checkpoint. Only the number of layers is cut, to fit a budget of weight bytes a
decode step reads (on a CPU, decode time is that read: ``--shape-budget-gb``, default 3 GB of fp32), or
to ``--shape-layers N``; the output says how many of how many layers were kept.

Shapes (configs as published on the Hugging Face hub; the only change is ``num_hidden_layers``):

- ``smollm2-135m``: the default model's architecture (30 layers, hidden 576, 9 / 3 heads of 64, vocab
  49,152), random bf16 weights in place of its 4-bit GGUF.
- ``qwen3-4b``: Qwen/Qwen3-4B. 36 layers, hidden 2560, 32 query / 8 KV heads of 128, intermediate 9728,
  vocab 151,936, rope theta 1e6, q/k RMSNorm, tied embeddings, 40,960 positions.
- ``llama3-8b``: meta-llama/Llama-3.1-8B. 32 layers, hidden 4096, 32 / 8 heads of 128, intermediate
  14,336, vocab 128,256, rope theta 5e5 with "llama3" rope scaling (factor 8), untied, 131,072 positions.
- ``gemma3-4b``: google/gemma-3-4b-it's text model. 34 layers, hidden 2560, 8 / 4 heads of 256,
  intermediate 10,240, vocab 262,208, five sliding-window (1,024) layers per global one, local rope theta
  1e4, global 1e6 with linear scaling 8, q/k norms, tied, 131,072 positions. Cut models keep whole groups
  of six layers (at least one global layer).

Tokenizer: the default model's (works offline), with its vocabulary padded by placeholder tokens
(``<|shape_pad_N|>``) up to the shape's vocab size. Encoding is unchanged (no merge ever produces a
placeholder), and every id the random model can generate decodes. The weights are random (mlx's own
init, seeded), so the text is noise; what the bench measures is the cost of the shape.

Built directories are cached in ``~/.cache/parallm/shapes/`` (``PARALLM_SHAPES_DIR``), keyed by shape,
layers and tokenizer; delete them to free the disk (a 3 GB budget model is ~1.5 GB on disk, bf16).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from parallm_engine.errors import InvalidRequestError

SHAPES: dict[str, dict] = {
    # The default model's own architecture (HuggingFaceTB/SmolLM2-135M-Instruct), for machines that have
    # its tokenizer but not its GGUF (a GPU device check) and for bf16 runs of the default shape.
    "smollm2-135m": {
        "model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30, "intermediate_size": 1536,
        "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "rms_norm_eps": 1e-5,
        "vocab_size": 49152, "max_position_embeddings": 8192, "rope_theta": 100000.0, "rope_scaling": None,
        "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False, "torch_dtype": "bfloat16",
    },
    "qwen3-4b": {
        "model_type": "qwen3", "hidden_size": 2560, "num_hidden_layers": 36, "intermediate_size": 9728,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-6,
        "vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rope_scaling": None,
        "tie_word_embeddings": True, "attention_bias": False, "torch_dtype": "bfloat16",
    },
    "llama3-8b": {
        "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 14336,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-5,
        "vocab_size": 128256, "max_position_embeddings": 131072, "rope_theta": 500000.0,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "torch_dtype": "bfloat16",
    },
    "gemma3-4b": {
        "model_type": "gemma3_text", "hidden_size": 2560, "num_hidden_layers": 34, "intermediate_size": 10240,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "rms_norm_eps": 1e-6,
        "vocab_size": 262208, "max_position_embeddings": 131072, "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "query_pre_attn_scalar": 256, "sliding_window": 1024, "sliding_window_pattern": 6,
        "torch_dtype": "bfloat16",
    },
}

#: Weight bytes (fp32) a decode step may read, layers + output head, when neither --shape-layers nor
#: --shape-budget-gb is given.
DEFAULT_BUDGET_GB = 3.0
PAD_TOKEN = "<|shape_pad_{}|>"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


@dataclass
class ShapePlan:
    name: str
    layers_kept: int
    layers_full: int
    layer_params: int  # one decoder layer's parameters
    embed_params: int
    head_params: int  # the output projection (the embedding itself when tied)

    def step_weight_bytes(self, layers: int | None = None, bytes_per_param: int = 4) -> int:
        """Weight bytes one decode step reads: every layer and the output head (not the embedding,
        of which a step reads only its tokens' rows)."""
        n = self.layers_kept if layers is None else layers
        return (n * self.layer_params + self.head_params) * bytes_per_param

    def total_params(self, layers: int | None = None) -> int:
        n = self.layers_kept if layers is None else layers
        cfg = SHAPES[self.name]
        tied = cfg.get("tie_word_embeddings", True)
        return n * self.layer_params + self.embed_params + (0 if tied else self.head_params) + cfg["hidden_size"]

    def describe(self) -> str:
        gb = 1e9
        return (f"shape {self.name}: random weights, {self.layers_kept} of {self.layers_full} layers kept "
                f"({self.total_params() / 1e9:.2f} B of {self.total_params(self.layers_full) / 1e9:.2f} B "
                f"parameters; a decode step reads {self.step_weight_bytes() / gb:.2f} GB of fp32 weights, "
                f"{self.step_weight_bytes(self.layers_full) / gb:.1f} GB for all layers)")

    def as_dict(self) -> dict:
        return {"name": self.name, "layers_kept": self.layers_kept, "layers_full": self.layers_full,
                "params": self.total_params(), "params_full": self.total_params(self.layers_full),
                "step_weight_bytes_fp32": self.step_weight_bytes(),
                "step_weight_bytes_fp32_full": self.step_weight_bytes(self.layers_full)}


def shape_config(name: str, layers: int | None = None) -> dict:
    """The published config of ``name`` with ``num_hidden_layers`` = ``layers`` (all when None)."""
    if name not in SHAPES:
        raise InvalidRequestError(f"unknown shape {name!r}; one of {', '.join(SHAPES)}", param="shape")
    cfg = copy.deepcopy(SHAPES[name])
    if layers is not None:
        if not 1 <= layers <= cfg["num_hidden_layers"]:
            raise InvalidRequestError(f"{name} has {cfg['num_hidden_layers']} layers; cannot keep {layers}",
                                      param="shape_layers")
        cfg["num_hidden_layers"] = layers
    return cfg


def param_counts(cfg: dict) -> tuple[int, int, int]:
    """(parameters of one decoder layer, of the embedding, of the output head) for ``cfg``."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    attn = h * q + 2 * h * kv + q * h
    norms = 2 * h  # input + post-attention norms
    if cfg["model_type"] in ("qwen3", "gemma3_text"):
        norms += 2 * cfg["head_dim"]  # q_norm, k_norm
    if cfg["model_type"] == "gemma3_text":
        norms += 2 * h  # pre- and post-feedforward norms
    embed = cfg["vocab_size"] * h
    return attn + 3 * h * i + norms, embed, embed


def plan(name: str, layers: int | None = None, budget_gb: float | None = None) -> ShapePlan:
    """How many layers to keep: ``layers`` if given, else as many as fit ``budget_gb`` of fp32 weight
    bytes per decode step (at least 2; for Gemma 3 whole groups of its sliding-window pattern)."""
    cfg = shape_config(name)
    full = cfg["num_hidden_layers"]
    per_layer, embed, head = param_counts(cfg)
    if budget_gb is not None and not budget_gb > 0:
        raise InvalidRequestError(f"the shape budget must be a positive number of GB, got {budget_gb}",
                                  param="shape_budget_gb")
    if layers is not None:
        shape_config(name, layers)  # in range, or a clear error
    else:
        budget = (budget_gb if budget_gb is not None else DEFAULT_BUDGET_GB) * 1e9
        layers = int((budget / 4 - head) // per_layer)
        group = cfg.get("sliding_window_pattern", 1)
        layers = max(layers - layers % group, group, 2)
    layers = min(max(1, layers), full)
    return ShapePlan(name, layers, full, per_layer, embed, head)


def _tokenizer_key(src: Path) -> str:
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            h.update((src / name).read_bytes())
    return h.hexdigest()[:12]


def shapes_root() -> Path:
    return Path(os.environ.get("PARALLM_SHAPES_DIR") or Path.home() / ".cache" / "parallm" / "shapes")


def pad_tokenizer(src: Path, out: Path, vocab_size: int) -> int:
    """Copy ``src``'s tokenizer files to ``out`` with the BPE vocabulary padded by placeholder tokens up to
    ``vocab_size``; returns how many were added. No merge produces a placeholder, so encoding is unchanged."""
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    data = json.loads((src / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    taken = set(vocab.values()) | {t["id"] for t in data.get("added_tokens", [])}
    added = 0
    for i in range(vocab_size):
        if i not in taken:
            vocab[PAD_TOKEN.format(i)] = i
            added += 1
    (out / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
    return added


def build_shape_model(shape: ShapePlan, tokenizer_dir, out_dir=None, seed: int = 0, overrides: dict | None = None) -> Path:
    """Write ``shape``'s random-weight model (bf16 safetensors, as the published checkpoints) and padded
    tokenizer to ``out_dir`` (default: the shapes cache, reused when already built). ``overrides`` changes
    config entries (tests: the same family and machinery at toy sizes); such a model is never cached."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    src = Path(tokenizer_dir)
    cfg = {**shape_config(shape.name, shape.layers_kept), **(overrides or {})}
    if overrides and out_dir is None:
        raise InvalidRequestError("a shape with overrides needs its own out_dir", param="overrides")
    if out_dir is None:
        cfg_key = hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:8]  # a changed config rebuilds
        out_dir = shapes_root() / f"{shape.name}-{shape.layers_kept}L-s{seed}-{cfg_key}-tok{_tokenizer_key(src)}"
    out = Path(out_dir)
    if (out / "config.json").exists():
        return out
    tmp = out.with_name(out.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    src_cfg = json.loads((src / "config.json").read_text()) if (src / "config.json").exists() else {}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # the tokenizer's own special tokens
        if src_cfg.get(key) is not None:
            cfg[key] = src_cfg[key]
    pad_tokenizer(src, tmp, cfg["vocab_size"])

    model_class, args_class = _get_classes(cfg)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(cfg))
    model.set_dtype(mx.bfloat16)  # lazily: the fp32 init is never held whole
    weights = dict(tree_flatten(model.parameters()))
    if cfg["model_type"] == "gemma3_text":
        weights.pop("lm_head.weight", None)  # saved tied, as Gemma 3 checkpoints are (sanitize ties it)
    for k in list(weights):  # evaluate in pieces to keep the build's peak memory at about the result's size
        mx.eval(weights[k])
    mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
    del model, weights
    cfg["parallm_shape"] = {**shape.as_dict(), "random_weights": True, "seed": seed, "overrides": overrides or {}}
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def prepare(name: str, layers: int | None = None, budget_gb: float | None = None, out_dir=None) -> tuple[Path, ShapePlan]:
    """Plan and build (or reuse) the ``name`` shape model with the default model's tokenizer."""
    from parallm_engine.models.loader import resolve_model

    shape = plan(name, layers, budget_gb)
    tokenizer_dir, _ = resolve_model(None)
    return build_shape_model(shape, tokenizer_dir, out_dir), shape
