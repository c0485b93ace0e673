"""Per-architecture knowledge for the GGUF loader: which GGUF tensor is which mlx-lm parameter, what
llama.cpp's converter (``convert_hf_to_gguf.py``) changed on the way in and must be undone, and which
``config.json`` an mlx-lm model class needs, read from the file's metadata.

What llama.cpp's converter does, per family (checked against its source and gguf-py's tensor_mapping):

* ``llama`` (also Mistral, SmolLM, and every other ``*ForCausalLM`` it registers as LlamaModel): Q and K
  rows permuted per head for its interleaved RoPE (``LlamaModel.permute``); undone here.
* ``qwen2`` / ``qwen3``: names mapped only, no permutation (llama.cpp runs them with NEOX RoPE); qwen2
  keeps its q/k/v biases (``attn_q.bias``...), qwen3 adds per-head ``attn_q_norm`` / ``attn_k_norm``.
* ``gemma3``: no permutation; every ``*norm.weight`` was written as ``w + 1`` (``Gemma3Model.norm_shift``:
  Gemma's RMSNorm scales by ``1 + w``, llama.cpp's by ``w``), so 1 is subtracted here; four norms per
  layer (HF ``post_attention_layernorm`` -> ``post_attention_norm``, ``pre_feedforward_layernorm`` ->
  ``ffn_norm``, ``post_feedforward_layernorm`` -> ``post_ffw_norm``); the sliding-window pattern (every
  6th layer global) and the local RoPE base (10000) are not in the file: llama.cpp hard-codes them too.
* ``phi3``: fused ``attn_qkv`` and ``ffn_up`` (= HF ``gate_up_proj``, gate half first) kept fused, as
  mlx-lm's phi3 has them; no permutation; LongRoPE factors as ``rope_factors_long/short`` tensors.

A missing ``output.weight`` means tied embeddings (llama.cpp drops a tied head).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from parallm_engine.errors import UnsupportedGGUFArchitectureError

#: GGUF layer tensor (after ``blk.N.``) -> mlx-lm module path inside ``model.layers.N``: the llama layout.
LLAMA_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}

#: Top-level GGUF tensors -> mlx-lm parameter paths (same for every family here).
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


class Meta:
    """Typed reads of one architecture's ``{arch}.*`` metadata keys."""

    def __init__(self, meta: dict, arch: str):
        self.meta, self.arch = meta, arch

    def get(self, key: str, default=None):
        value = self.meta.get(f"{self.arch}.{key}", default)
        return default if value is None else value

    def int(self, key: str, default=None) -> int:
        value = self.get(key, default)
        if value is None:
            raise KeyError(f"{self.arch}.{key}")
        return int(value)

    def float(self, key: str, default=None) -> float:
        return float(self.get(key, default))


def _base_config(m: Meta) -> dict:
    """The keys every family here reads, from the metadata every llama.cpp text model writes."""
    n_head = m.int("attention.head_count")
    hidden = m.int("embedding_length")
    config = {
        "hidden_size": hidden,
        "num_hidden_layers": m.int("block_count"),
        "intermediate_size": m.int("feed_forward_length"),
        "num_attention_heads": n_head,
        "num_key_value_heads": m.int("attention.head_count_kv", n_head),
        "head_dim": m.int("attention.key_length", m.int("rope.dimension_count", hidden // n_head)),
        "rms_norm_eps": m.float("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": m.float("rope.freq_base", 10000.0),
        "max_position_embeddings": m.int("context_length", 4096),
    }
    scaling = _rope_scaling(m)
    if scaling:
        config["rope_scaling"] = scaling
    return config


def _rope_scaling(m: Meta) -> dict | None:
    """``{arch}.rope.scaling.*`` (linear / yarn; what TextModel.set_gguf_parameters writes) as HF rope_scaling."""
    kind = m.get("rope.scaling.type")
    factor = m.get("rope.scaling.factor")
    if kind in (None, "none") or not factor:
        return None
    scaling = {"rope_type": kind, "type": kind, "factor": float(factor)}
    original = m.get("rope.scaling.original_context_length")
    if original:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def _gemma3_config(m: Meta) -> dict:
    config = _base_config(m)
    head_dim = config["head_dim"]
    # llama.cpp (llama-model.cpp, LLM_ARCH_GEMMA3): attention scale 1/sqrt(head_dim), except the 27B
    # model (62 layers) whose query_pre_attn_scalar is hidden / heads; both follow HF's config values.
    scalar = config["hidden_size"] // config["num_attention_heads"] if config["num_hidden_layers"] == 62 else head_dim
    config.update(
        query_pre_attn_scalar=scalar,
        sliding_window=m.int("attention.sliding_window", 4096),
        sliding_window_pattern=_window_pattern(m.get("attention.sliding_window_pattern")),
        rope_local_base_freq=10000.0,  # not written; llama.cpp hard-codes it (rope_freq_base_train_swa)
    )
    return config


def _window_pattern(value) -> int:
    """Gemma 3's "every n-th layer is global" from ``attention.sliding_window_pattern``: llama.cpp's
    converter does not write it (llama.cpp hard-codes 6); gguf-py's writer takes an int or a per-layer list
    (true = sliding)."""
    if value is None:
        return 6
    if isinstance(value, list):
        if all(value):
            raise ValueError("attention.sliding_window_pattern: no global layer")
        period = value.index(False) + 1
        if any(bool(v) != ((i + 1) % period != 0) for i, v in enumerate(value)):
            raise ValueError("attention.sliding_window_pattern: not periodic (mlx-lm's gemma3_text needs it)")
        return period
    return int(value)


def _phi3_config(m: Meta) -> dict:
    config = _base_config(m)
    rope_dim = m.int("rope.dimension_count", config["head_dim"])
    config["partial_rotary_factor"] = rope_dim / config["head_dim"]
    original = m.get("rope.scaling.original_context_length")
    if original:
        config["original_max_position_embeddings"] = int(original)
    config.pop("rope_scaling", None)  # longrope comes from the rope_factors tensors (see convert_gguf)
    return config


def llama3_rope_factors(scaling: dict, head_dim: int, theta: float) -> list[float]:
    """The per-dimension divisors of the RoPE frequencies that Llama 3.1's "llama3" rope_scaling means (what
    convert_hf_to_gguf writes as the ``rope_freqs`` tensor; the same formula as transformers / mlx-lm)."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def llama3_rope_scaling(factors: list[float], head_dim: int, theta: float) -> dict | None:
    """The ``llama3`` rope_scaling whose factors are ``factors`` (a Llama 3.1+ GGUF's ``rope_freqs`` tensor;
    the file keeps only the factors). Fitted with Llama 3's own low / high frequency factors (1, 4); the
    original context from a dimension between the bands; checked by recomputing every factor."""
    factor = max(factors)
    if factor <= 1.0 + 1e-6:
        return None
    low, high = 1.0, 4.0
    wavelens = [2 * math.pi * theta ** (i / head_dim) for i in range(0, head_dim, 2)]
    between = [(w, f) for w, f in zip(wavelens, factors) if 1 + 1e-5 < f < factor * (1 - 1e-5)]
    if between:
        w, f = between[0]
        smooth = (1 / f - 1 / factor) / (1 - 1 / factor)
        old = w * (smooth * (high - low) + low)
    else:  # no dimension between the bands: any context that splits them the same way is the same RoPE
        old = high * max([w for w, f in zip(wavelens, factors) if f <= 1 + 1e-5], default=1.0)
    old = round(old) if abs(old - round(old)) < 1e-2 * max(1.0, old / 1000) else old
    scaling = {"rope_type": "llama3", "factor": float(factor), "low_freq_factor": low,
               "high_freq_factor": high, "original_max_position_embeddings": old}
    again = llama3_rope_factors(scaling, head_dim, theta)
    if any(abs(a - b) > 1e-4 * max(1.0, abs(b)) for a, b in zip(again, factors)):
        raise ValueError("rope_freqs is not the llama3 RoPE scaling (low/high frequency factors 1/4)")
    return scaling


@dataclass(frozen=True)
class GGUFFamily:
    """How one ``general.architecture`` maps onto an mlx-lm model class."""

    model_type: str  # mlx-lm's model_type
    architectures: str  # HF class name, for config.json
    layer_names: dict = field(default_factory=lambda: dict(LLAMA_LAYER))
    #: llama.cpp permuted Q/K rows for interleaved RoPE (llama arch only).
    permuted_qk: bool = False
    #: Added to every ``*norm.weight`` by llama.cpp's converter; subtracted back here.
    norm_shift: float = 0.0
    config: Callable[[Meta], dict] = _base_config


GEMMA3_LAYER = {
    **{k: v for k, v in LLAMA_LAYER.items() if k != "ffn_norm"},
    **QK_NORMS,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
PHI3_LAYER = {
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_up": "mlp.gate_up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}

#: ``general.architecture`` -> family. Dense Mistral models are ``llama`` in GGUF (llama.cpp's LlamaModel).
FAMILIES: dict[str, GGUFFamily] = {
    "llama": GGUFFamily("llama", "LlamaForCausalLM", permuted_qk=True),
    "qwen2": GGUFFamily("qwen2", "Qwen2ForCausalLM"),
    "qwen3": GGUFFamily("qwen3", "Qwen3ForCausalLM", layer_names={**LLAMA_LAYER, **QK_NORMS}),
    "gemma3": GGUFFamily("gemma3_text", "Gemma3ForCausalLM", layer_names=GEMMA3_LAYER, norm_shift=1.0,
                         config=_gemma3_config),
    "phi3": GGUFFamily("phi3", "Phi3ForCausalLM", layer_names=PHI3_LAYER, config=_phi3_config),
}


def family_for(arch: str | None, path) -> GGUFFamily:
    family = FAMILIES.get(arch or "")
    if family is None:
        raise UnsupportedGGUFArchitectureError(arch, sorted(FAMILIES), path)
    return family
