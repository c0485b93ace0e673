"""Tiny random-weight models of many mlx-lm families, for the engine's correctness tests.

Not a test file: a utility. The engine's greedy tokens must equal mlx-lm's own generation, so this
module builds small models of each architecture family mlx-lm supports (a few layers, hidden 64,
real tokenizer of the default model) and gives the mlx-lm reference to compare against::

    from tests.model_zoo import FAMILIES, build, reference_greedy
    path = build("gemma3_text", tmp_path / "g3", tokenizer_dir, vocab_size)
    model, tokenizer = mlx_lm.utils.load(str(path))
    want = reference_greedy(model, prompt_ids, 20)

* ``FAMILIES``: family -> config dict (``vocab_size`` is filled in by :func:`config_for` / :func:`build`).
  Hybrids are sized so that every layer kind occurs at least once (sliding + full attention, linear
  attention / SSM / conv + attention), sliding windows and attention chunks are 8 tokens so a
  40-token prompt already wraps them.
* ``build(family, out_dir, tokenizer_dir, vocab_size, quantize_bits=None, seed=0)``: writes
  config.json, model.safetensors and the tokenizer files; checks that ``mlx_lm.utils.load_model``
  reads every saved tensor back unchanged (the model's ``sanitize`` is a no-op on them).
* ``reference_greedy(model, prompt_ids, max_tokens)``: mlx-lm's ``generate_step`` with a greedy sampler
  and the model's own ``make_prompt_cache``.
* ``mlx_batch_greedy(model, prompts, max_tokens)``: the same through mlx-lm's ``BatchGenerator``.
* ``SURVEY``: what :func:`survey` found for every family with mlx-lm 0.32.2 (table below).
  Regenerate with ``python -m tests.model_zoo [families...] [--quantize 4]`` (~2 min fp32, 2 cores).

Weights are seeded random, but not mlx's plain init, which makes degenerate models: the residual stream
is dominated by the current token's embedding, so a tied model just repeats its last input token and
attention bugs go unnoticed. Instead (``_init_weights``): embeddings / untied heads ~ N(0, 0.5^2)
(``EMBED_STD``; 0.125 for Gemma, which scales embeddings by sqrt(hidden)); every other matrix weight
x3 (``LINEAR_GAIN``; x5 for Gemma and llama4); the final norm's weight x4 (``LOGIT_GAIN``: scales all
logits, so greedy tokens are unchanged but top-1 margins grow); SSM / gated-delta layers get slow decays
(``dt_bias`` = -3, ``A = exp(A_log)`` in [0.05, 0.2], ``D`` = 0) so their state carries the whole
prompt. With that every family generates varied tokens (~20-24 distinct of 24), its continuation
depends on the first token of a 100-token prompt ("ctx"), and the smallest top-1 logprob margin over 48
greedy steps ("margin") is >= 1e-4, mostly >= 1e-2 -- far above float32 noise (~1e-6).

Survey: prompts of 40 and 100 pseudo-random tokens (:func:`prompt_ids`), 24 new tokens each; "margin"
= smallest top-1 minus top-2 logprob over those steps, float32 / 4-bit (group 64); "ctx" = changing the
first prompt token changes the 100-token continuation (both variants); "BatchGenerator" = mlx-lm's
``BatchGenerator`` on prompts of 40/23/100 tokens (greedy) vs :func:`reference_greedy` per row,
"diff@i" = first differing token of each row; identical for float32 and 4-bit. Every family builds,
loads back exactly (float32 and 4-bit), generates deterministically and has ``model.args.model_type`` ==
its family name; "*" = the model has no ``make_cache`` (``make_prompt_cache`` gives a KVCache per
layer)::

    family       model.model  make_cache() entries                 margin f32/q4    BatchGenerator
    ------------ ------------ ------------------------------------ ---------------- ---------------------------------
    llama        True         KVCache x2                           0.0274 / 0.035   equal
    qwen2        True         KVCache x2 *                         0.0004 / 0.0476  equal
    qwen3        True         KVCache x2 *                         0.0944 / 0.0237  equal
    qwen3_moe    True         KVCache x2 *                         0.063 / 0.0313   equal
    mistral      True         KVCache x2                           0.0076 / 0.0138  equal
    ministral3   True         KVCache x2                           0.1861 / 0.0498  equal
    gemma2       True         KVCache x2 *                         0.0354 / 0.0001  error (mask broadcast)
    gemma3_text  True         [RotatingKVCache, KVCache] x2        0.0437 / 0.0811  equal
    phi3         True         KVCache x2 *                         0.2971 / 0.0077  equal
    granite      True         KVCache x2 *                         0.0245 / 0.0821  equal
    cohere2      True         [RotatingKVCache, KVCache] x2        0.0297 / 0.0067  equal
    gpt_oss      True         [RotatingKVCache, KVCache] x2        0.0179 / 0.2671  equal
    olmo2        True         KVCache x2 *                         0.0025 / 0.0158  equal
    olmo3        True         [RotatingKVCache, KVCache] x2        0.0289 / 0.0044  equal
    deepseek_v3  True         KVCache x2 *                         0.0054 / 0.047   equal
    deepseek_v2  True         KVCache x2 *                         0.1559 / 0.0492  equal
    qwen3_next   True         [ArraysCache, KVCache] x2            0.1434 / 0.0015  equal
    lfm2         True         [ArraysCache, KVCache] x2            0.1346 / 0.0296  equal
    nemotron_h   False        ArraysCache, KVCache, ArraysCache    0.0235 / 0.0577  different (diff@0, diff@0, equal)
    falcon_h1    True         CacheList(ArraysCache, KVCache) x2   0.1655 / 0.1191  equal
    mamba2       False        ArraysCache x2                       0.0613 / 0.0209  equal
    mamba        False        ArraysCache x2                       0.0871 / 0.034   different (diff@0, diff@0, equal)
    llama4_text  True         KVCache x4 *                         0.1137 / 0.1077  equal
    llama4       False        ChunkedKVCache x3, KVCache           0.1243 / 0.0003  error (ChunkedKVCache)
    minicpm      True         KVCache x2 *                         0.0433 / 0.0522  equal
    cohere       True         KVCache x2 *                         0.0802 / 0.0476  equal

Findings worth knowing when testing the engine against these:

* ``len(make_cache())`` is not always the number of layers: nemotron_h has caches only for its Mamba
  (M) and attention (*) blocks, none for MLP (-) / MoE (E) blocks, and indexes them with a counter.
* ``model.model`` is absent for nemotron_h / mamba / mamba2 (``model.backbone``) and llama4
  (``model.language_model.model``); ``model.layers`` exists for all.
* mlx-lm's own BatchGenerator (right-padded batched prefill) is wrong for the padded rows of mamba
  (its blocks ignore the padding mask) and nemotron_h (its SSM ignores ``ArraysCache.lengths``, which
  mamba2 honours); it raises for gemma2 (its 5-D GQA attention cannot broadcast a per-row mask) and
  llama4 (ChunkedKVCache has no batched version). So those cannot serve as a batched reference.
* llama4_text is configured untied: tied, its forward does ``h @ embed_tokens.weight.T``, which fails
  once the embedding is quantized (an mlx-lm bug). mlx-lm's llama4_text has no chunked attention; the
  chunked-attention family is ``llama4`` (needs >= 4 layers: layer 3 is its global layer).
* gemma3_text is saved without ``lm_head`` (as real checkpoints are); its ``sanitize`` then ties it.
* ``mistral`` is model_type "mistral", which mlx-lm maps to its llama implementation.
"""

from __future__ import annotations

import copy
import io
import json
import math
import random
import shutil
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")

#: Std of the embedding / untied lm_head weights (see module docstring).
EMBED_STD = 0.5
#: Factor on every other matrix weight: with mlx's default init the layers' contribution is small next
#: to the embedding, and a tied model then just repeats its last input token.
LINEAR_GAIN = 3.0
#: Factor on the final norm's weight: scales every logit, so argmax (hence the greedy tokens) is
#: unchanged while the top-1 margins grow.
LOGIT_GAIN = 4.0
#: Value of every ``dt_bias`` (Mamba-2, gated delta) and Mamba-1 ``dt_proj.bias``: softplus(-3) ~ 0.05.
DT_BIAS = -3.0

# Shared tiny dimensions.
_DIMS = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "max_position_embeddings": 2048,
}

# Yarn rope scaling; original context 64 (x factor 32 = max_position_embeddings 2048) so the 100-token
# prompt goes past it.
_YARN = {
    "type": "yarn", "factor": 32.0, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
    "mscale": 1.0, "mscale_all_dim": 1.0,
}

FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {
        "model_type": "llama", **_DIMS, "num_hidden_layers": 2, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "tie_word_embeddings": True,
    },
    "qwen2": {
        "model_type": "qwen2", **_DIMS, "num_hidden_layers": 2, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "tie_word_embeddings": True,
    },
    "qwen3": {
        "model_type": "qwen3", **_DIMS, "num_hidden_layers": 2, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "tie_word_embeddings": True,
    },
    "qwen3_moe": {
        "model_type": "qwen3_moe", **_DIMS, "num_hidden_layers": 2, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "tie_word_embeddings": False, "num_experts": 4, "num_experts_per_tok": 2,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "moe_intermediate_size": 64, "norm_topk_prob": True,
    },
    # mlx-lm maps model_type "mistral" onto its llama implementation (MODEL_REMAPPING).
    "mistral": {
        "model_type": "mistral", **_DIMS, "num_hidden_layers": 2, "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0, "tie_word_embeddings": False, "sliding_window": None,
    },
    # Ministral 3 (text): yarn rope + llama-4 style position-dependent query scaling; the original
    # context is set to 64 so the 100-token prompt crosses a scaling step.
    "ministral3": {
        "model_type": "ministral3", **_DIMS, "num_hidden_layers": 2, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
        "rope_parameters": {
            "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 32.0, "original_max_position_embeddings": 64,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1,
        },
    },
    "gemma2": {
        "model_type": "gemma2", **_DIMS, "num_hidden_layers": 2, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "query_pre_attn_scalar": 16, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
    },
    # Layers 0, 2 sliding (window 8), layers 1, 3 global. No lm_head saved -> tied (like real Gemma 3).
    "gemma3_text": {
        "model_type": "gemma3_text", **_DIMS, "num_hidden_layers": 4, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": 16,
        "sliding_window": 8, "sliding_window_pattern": 2,
    },
    "phi3": {
        "model_type": "phi3", **_DIMS, "num_hidden_layers": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    },
    "granite": {
        "model_type": "granite", **_DIMS, "num_hidden_layers": 2, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "logits_scaling": 0.5, "attention_multiplier": 0.0625, "embedding_multiplier": 2.0,
        "residual_multiplier": 1.0, "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": True,
    },
    # Layers 0, 2 sliding (window 8, rope), layers 1, 3 global (no rope).
    "cohere2": {
        "model_type": "cohere2", **_DIMS, "num_hidden_layers": 4, "layer_norm_eps": 1e-5, "rope_theta": 50000.0,
        "logit_scale": 0.25, "sliding_window": 8, "sliding_window_pattern": 2,
    },
    "gpt_oss": {
        "model_type": "gpt_oss", **_DIMS, "num_hidden_layers": 4, "rms_norm_eps": 1e-5, "rope_theta": 150000,
        "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8,
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 64,
                         "beta_fast": 32.0, "beta_slow": 1.0},
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    },
    "olmo2": {
        "model_type": "olmo2", **_DIMS, "num_hidden_layers": 2, "rms_norm_eps": 1e-6, "rope_theta": 500000.0,
        "tie_word_embeddings": False,
    },
    "olmo3": {
        "model_type": "olmo3", **_DIMS, "num_hidden_layers": 4, "rms_norm_eps": 1e-6, "rope_theta": 500000.0,
        "sliding_window": 8, "tie_word_embeddings": False,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    },
    # MLA (multi-head latent attention) + MoE from layer 1 on.
    "deepseek_v3": {
        "model_type": "deepseek_v3", **_DIMS, "num_hidden_layers": 2, "num_key_value_heads": 4,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "moe_intermediate_size": 64, "n_shared_experts": 1,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "routed_scaling_factor": 1.0, "kv_lora_rank": 32,
        "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
        "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True, "n_group": 1,
        "topk_group": 1, "first_k_dense_replace": 1, "moe_layer_freq": 1, "rope_scaling": dict(_YARN),
    },
    "deepseek_v2": {
        "model_type": "deepseek_v2", **_DIMS, "num_hidden_layers": 2, "num_key_value_heads": 4,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "moe_intermediate_size": 64, "n_shared_experts": 1,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "routed_scaling_factor": 1.0, "kv_lora_rank": 32,
        "q_lora_rank": None, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
        "rope_scaling": dict(_YARN), "topk_method": "greedy", "n_group": 1, "topk_group": 1,
        "first_k_dense_replace": 1, "moe_layer_freq": 1,
    },
    # Layers 0, 2 gated-delta linear attention, layers 1, 3 full attention; MoE MLPs everywhere.
    "qwen3_next": {
        "model_type": "qwen3_next", **_DIMS, "num_hidden_layers": 4, "full_attention_interval": 2,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "partial_rotary_factor": 0.25,
        "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "num_experts": 4, "num_experts_per_tok": 2,
        "decoder_sparse_step": 1, "shared_expert_intermediate_size": 64, "mlp_only_layers": [],
        "moe_intermediate_size": 64, "norm_topk_prob": True, "tie_word_embeddings": False,
    },
    # Short-conv layers 0, 2 and attention layers 1, 3.
    "lfm2": {
        "model_type": "lfm2", **_DIMS, "num_hidden_layers": 4, "norm_eps": 1e-5, "rope_theta": 1000000.0,
        "conv_bias": False, "conv_L_cache": 3, "block_dim": 64, "block_ff_dim": 128, "block_multiple_of": 16,
        "block_ffn_dim_multiplier": 1.0, "block_auto_adjust_ff_dim": False,
        "layer_types": ["conv", "full_attention", "conv", "full_attention"],
    },
    # Mamba-2 (M), attention (*), MLP (-) blocks.
    "nemotron_h": {
        "model_type": "nemotron_h", **_DIMS, "hybrid_override_pattern": ["M", "*", "M", "-"],
        "mamba_num_heads": 8, "mamba_head_dim": 16, "ssm_state_size": 16, "conv_kernel": 4, "n_groups": 2,
        "mamba_proj_bias": False, "attention_bias": False, "mlp_bias": False, "use_bias": False,
        "use_conv_bias": True, "layer_norm_epsilon": 1e-5,
    },
    # Every layer runs attention and Mamba-2 in parallel (CacheList(ArraysCache, KVCache) per layer).
    "falcon_h1": {
        "model_type": "falcon_h1", **_DIMS, "num_hidden_layers": 2, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0,
        "mamba_d_ssm": 128, "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16, "mamba_n_groups": 1,
        "mamba_d_conv": 4, "mamba_chunk_size": 16, "mamba_expand": 2, "tie_word_embeddings": False,
    },
    "mamba2": {
        "model_type": "mamba2", "hidden_size": 64, "num_hidden_layers": 2, "num_heads": 8, "head_dim": 16,
        "intermediate_size": 128, "state_size": 16, "conv_kernel": 4, "n_groups": 1, "use_bias": False,
        "use_conv_bias": True, "tie_word_embeddings": True, "time_step_limit": [0.0, math.inf],
        "time_step_rank": "auto", "layer_norm_epsilon": 1e-5, "max_position_embeddings": 2048,
    },
    "mamba": {
        "model_type": "mamba", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
        "state_size": 16, "conv_kernel": 4, "use_bias": False, "use_conv_bias": True, "time_step_rank": 4,
        "tie_word_embeddings": True,
    },
    # mlx-lm 0.32's llama4_text has no chunked attention (it is the dense NoPE/RoPE text model); the
    # chunked-attention Llama 4 is model_type "llama4" (below), whose make_cache gives ChunkedKVCache.
    # Untied: with tied embeddings its forward does `h @ embed_tokens.weight.T`, which breaks once the
    # embedding is quantized.
    "llama4_text": {
        "model_type": "llama4_text", **_DIMS, "num_hidden_layers": 4, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "intermediate_size_mlp": 128, "no_rope_layers": [1, 1, 1, 0],
        "use_qk_norm": True, "tie_word_embeddings": False,
    },
    # Layers 0-2 chunked attention (chunk 8, ChunkedKVCache), layer 3 global NoPE; MoE every 2nd layer.
    "llama4": {
        "model_type": "llama4",
        "text_config": {
            "model_type": "llama4_text", **_DIMS, "num_hidden_layers": 4, "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0, "rope_scaling": None, "attention_bias": False, "attention_chunk_size": 8,
            "interleave_moe_layer_step": 2, "intermediate_size_mlp": 128, "num_experts_per_tok": 1,
            "num_local_experts": 4, "use_qk_norm": True,
        },
    },
    "minicpm": {
        "model_type": "minicpm", **_DIMS, "num_hidden_layers": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "dim_model_base": 32, "scale_depth": 1.4, "scale_emb": 4.0, "tie_word_embeddings": False,
    },
    "cohere": {
        "model_type": "cohere", **_DIMS, "num_hidden_layers": 2, "layer_norm_eps": 1e-5, "rope_theta": 10000.0,
        "logit_scale": 0.25, "use_qk_norm": False,
    },
}

#: What :func:`survey` found with mlx-lm 0.32.2 (CPU, float32 and 4-bit): see the module docstring. "caches" is
#: ``type(c).__name__`` per ``make_prompt_cache(model)`` entry (a tuple for a CacheList's inner caches);
#: "batch_generator": mlx-lm's BatchGenerator (3 prompts of 40/23/100 tokens, greedy) vs reference_greedy per
#: row ("diff@i": first differing token), "error (...)": it raised.
SURVEY: dict[str, dict[str, Any]] = {
    "llama": {
        "model_type": "llama", "has_model_attr": True, "has_make_cache": True,
        "caches": ["KVCache", "KVCache"],
        "min_margin": 0.0274, "q4_min_margin": 0.035, "context_sensitive": True,
        "deterministic": True, "load_error": None,
        "batch_generator": "equal", "batch_generator_q4": "equal",
    },
    "qwen2": {
        "model_type": "qwen2", "has_model_attr": True, "has_make_cache": False,
        "caches": ["KVCache", "KVCache"],
        "min_margin": 0.0004, "q4_min_margin": 0.0476, "context_sensitive": True,
        "deterministic": True, "load_error": None,
        "batch_generator": "equal", "batch_generator_q4": "equal",
    },
    "qwen3": {
        "model_type": "qwen3", "has_model_attr": True, "has_make_cache": False,
        "caches": ["KVCache", "KVCache"],
        "min_margin": 0.0944, "q4_min_margin": 0.0237, "context_sensitive": True,
        "deterministic": True, "load_error": None,
        "batch_generator": "equal", "batch_generator_q4": "equal",
    },
    "qwen3_moe": {
        "model_type": "qwen3_moe", "has_model_attr": True, "has_make_cache": False,
        "caches": ["KVCache", "KVCache"],
        "min_margin": 0.063, "q4_min_margin": 0.0313, "context_sensitive": True,
        "deterministic": True, "load_error": None,
        "batch_generator": "equal", "batch_generator_q4": "equal",
    },
    "mistral": {
        "model_type": "mistral", "has_model_attr": True, "has_make_cache": True,
        "caches": ["KVCache", "KVCache"],
        "min_margin": 0.0076, "q4_min_margin": 0.0138, "context_sensitive": True,
        "deterministic": True, "load_error": None,
        "batch_generator": "equal", "batch_generator_q4": "equal",
    },
    "ministral3": {
        "model_type": "ministral3", "has_model_attr": True, "has_make_cache": True,
        "caches": ["KVCache", "KVCache"],
        "min_margin": 0.1861, "q4_min_margin": 0.0498, "context_sensitive": True,
        "deterministic": True, "load_error": None,
        "batch_generator": "equal", "batch_generator_q4": "equal",
    },
    "gemma2": {
        "model_type": "gemma2", "has_model_attr": True, "has_make_cache": False,
        "caches": ["KVCache", "KVCache"],
        "min_margin": 0.0354, "q4_min_margin": 0.0001, "context_sensitive": True,
        "deterministic": True, "load_error": None,
        "batch_generator": "error (mask broadcast)", "batch_generator_q4": "error (mask broadcast)",
    },
    "gemma3_text": {
        "model_type": "gemma3_text", "has_model_attr": True, "has_make_cache": True,
        "caches": ["RotatingKVCache", "KVCache", "RotatingKVCache", "KVCache"],
        "min_margin": 0.0437, "q4_min_margin": 0.0811, "context_sensitive": True,
        "deterministic": True, "load_error": None,
        "batch_generator": "equal", "batch_generator_q4": "equal",
    },
    "phi3": {
        "model_type": "phi3", "has_model_attr": True, "has_make_cache": False,
        "caches": ["KVCache", "KVCache"],
        "min_margin": 0.2971, "q4_min_margin": 0.0077, "context_sensitive": True,
        "deterministic": True, "load_error": None,
        "batch_generator": "equal", "batch_generator_q4": "equal",
    },
    "granite": {
        "model_type": "granite", "has_model_attr": True, "has_make_cache": False,
        "caches": ["KVCache", "KVCache"],
        "min_margin": 0.0245, "q4_min_margin": 0.0821, "context_sensitive": True,
        "deterministic": True, "load_error": None,
        "batch_generator": "equal", "batch_generator_q4": "equal",
    },
    "cohere2": {
        "model_type": "cohere2", "has_model_attr": True, "has_make_cache": True,
        "caches": ["RotatingKVCache", "KVCache", "RotatingKVCache", "KVCache"],
        "min_margin": 0.0297, "q4_min_margin": 0.0067, "context_sensitive": True,
        "deterministic": True, "load_error": None,
        "batch_generator": "equal", "batch_generator_q4": "equal",
    },
    "gpt_oss": {
        "model_type": "gpt_oss", "has_model_attr": True, "has_make_cache": True,
        "caches": ["RotatingKVCache", "KVCache", "RotatingKVCache", "KVCache"],
        "min_margin": 0.0179, "q4_min_margin": 0.2671, "context_sensitive": True,
        "deterministic": True, "load_error": None,
        "batch_generator": "equal", "batch_generator_q4": "equal",
    },
    "olmo2": {
        "model_type": "olmo2", "has_model_attr": True, "has_make_cache": False,
        "caches": ["KVCache", "KVCache"],
        "min_margin": 0.0025, "q4_min_margin": 0.0158, "context_sensitive": True,
        "deterministic": True, "load_error": None,
        "batch_generator": "equal", "batch_generator_q4": "equal",
    },
    "olmo3": {
        "model_type": "olmo3", "has_model_attr": True, "has_make_cache": True,
        "caches": ["RotatingKVCache", "KVCache", "RotatingKVCache", "KVCache"],
        "min_margin": 0.0289, "q4_min_margin": 0.0044, "context_sensitive": True,
        "deterministic": True, "load_error": None,
        "batch_generator": "equal", "batch_generator_q4": "equal",
    },
    "deepseek_v3": {
        "model_type": "deepseek_v3", "has_model_attr": True, "has_make_cache": False,
        "caches": ["KVCache", "KVCache"],
        "min_margin": 0.0054, "q4_min_margin": 0.047, "context_sensitive": True,
        "deterministic": True, "load_error": None,
        "batch_generator": "equal", "batch_generator_q4": "equal",
    },
    "deepseek_v2": {
        "model_type": "deepseek_v2", "has_model_attr": True, "has_make_cache": False,
        "caches": ["KVCache", "KVCache"],
        "min_margin": 0.1559, "q4_min_margin": 0.0492, "context_sensitive": True,
        "deterministic": True, "load_error": None,
        "batch_generator": "equal", "batch_generator_q4": "equal",
    },
    "qwen3_next": {
        "model_type": "qwen3_next", "has_model_attr": True, "has_make_cache": True,
        "caches": ["ArraysCache", "KVCache", "ArraysCache", "KVCache"],
        "min_margin": 0.1434, "q4_min_margin": 0.0015, "context_sensitive": True,
        "deterministic": True, "load_error": None,
        "batch_generator": "equal", "batch_generator_q4": "equal",
    },
    "lfm2": {
        "model_type": "lfm2", "has_model_attr": True, "has_make_cache": True,
        "caches": ["ArraysCache", "KVCache", "ArraysCache", "KVCache"],
        "min_margin": 0.1346, "q4_min_margin": 0.0296, "context_sensitive": True,
        "deterministic": True, "load_error": None,
        "batch_generator": "equal", "batch_generator_q4": "equal",
    },
    "nemotron_h": {
        "model_type": "nemotron_h", "has_model_attr": False, "has_make_cache": True,
        "caches": ["ArraysCache", "KVCache", "ArraysCache"],
        "min_margin": 0.0235, "q4_min_margin": 0.0577, "context_sensitive": True,
        "deterministic": True, "load_error": None,
        "batch_generator": "different (diff@0, diff@0, equal)",
        "batch_generator_q4": "different (diff@0, diff@0, equal)",
    },
    "falcon_h1": {
        "model_type": "falcon_h1", "has_model_attr": True, "has_make_cache": True,
        "caches": [("ArraysCache", "KVCache"), ("ArraysCache", "KVCache")],
        "min_margin": 0.1655, "q4_min_margin": 0.1191, "context_sensitive": True,
        "deterministic": True, "load_error": None,
        "batch_generator": "equal", "batch_generator_q4": "equal",
    },
    "mamba2": {
        "model_type": "mamba2", "has_model_attr": False, "has_make_cache": True,
        "caches": ["ArraysCache", "ArraysCache"],
        "min_margin": 0.0613, "q4_min_margin": 0.0209, "context_sensitive": True,
        "deterministic": True, "load_error": None,
        "batch_generator": "equal", "batch_generator_q4": "equal",
    },
    "mamba": {
        "model_type": "mamba", "has_model_attr": False, "has_make_cache": True,
        "caches": ["ArraysCache", "ArraysCache"],
        "min_margin": 0.0871, "q4_min_margin": 0.034, "context_sensitive": True,
        "deterministic": True, "load_error": None,
        "batch_generator": "different (diff@0, diff@0, equal)",
        "batch_generator_q4": "different (diff@0, diff@0, equal)",
    },
    "llama4_text": {
        "model_type": "llama4_text", "has_model_attr": True, "has_make_cache": False,
        "caches": ["KVCache", "KVCache", "KVCache", "KVCache"],
        "min_margin": 0.1137, "q4_min_margin": 0.1077, "context_sensitive": True,
        "deterministic": True, "load_error": None,
        "batch_generator": "equal", "batch_generator_q4": "equal",
    },
    "llama4": {
        "model_type": "llama4", "has_model_attr": False, "has_make_cache": True,
        "caches": ["ChunkedKVCache", "ChunkedKVCache", "ChunkedKVCache", "KVCache"],
        "min_margin": 0.1243, "q4_min_margin": 0.0003, "context_sensitive": True,
        "deterministic": True, "load_error": None,
        "batch_generator": "error (ChunkedKVCache)", "batch_generator_q4": "error (ChunkedKVCache)",
    },
    "minicpm": {
        "model_type": "minicpm", "has_model_attr": True, "has_make_cache": False,
        "caches": ["KVCache", "KVCache"],
        "min_margin": 0.0433, "q4_min_margin": 0.0522, "context_sensitive": True,
        "deterministic": True, "load_error": None,
        "batch_generator": "equal", "batch_generator_q4": "equal",
    },
    "cohere": {
        "model_type": "cohere", "has_model_attr": True, "has_make_cache": False,
        "caches": ["KVCache", "KVCache"],
        "min_margin": 0.0802, "q4_min_margin": 0.0476, "context_sensitive": True,
        "deterministic": True, "load_error": None,
        "batch_generator": "equal", "batch_generator_q4": "equal",
    },
}

# Per-family overrides of EMBED_STD / LINEAR_GAIN.
# Gemma multiplies the embeddings by sqrt(hidden_size), so they need a smaller std to not swamp the layers.
_INIT: dict[str, dict[str, float]] = {
    "gemma2": {"embed_std": 0.125, "gain": 5.0},
    "gemma3_text": {"embed_std": 0.125, "gain": 5.0},
    "granite": {"embed_std": 0.25},
    "llama4": {"gain": 5.0},  # with 3.0 the one global (NoPE) layer barely moves the logits
}
# Families whose RMSNorm multiplies by (1 + weight).
_ONE_PLUS_NORM = {"gemma2", "gemma3_text"}

# Modules whose weights are left out of model.safetensors, as real checkpoints do (the model's sanitize
# then ties the output head to the embeddings).
_DROP_MODULES = {"gemma3_text": ("lm_head",)}


def config_for(family: str, vocab_size: int) -> dict[str, Any]:
    """A copy of ``FAMILIES[family]`` with ``vocab_size`` filled in (in ``text_config`` too)."""
    config = copy.deepcopy(FAMILIES[family])
    config["vocab_size"] = vocab_size
    if "text_config" in config:
        config["text_config"]["vocab_size"] = vocab_size
    return config


def _init_weights(model, vocab_size: int, embed_std: float, gain: float) -> None:
    """Redraw embedding tables and vocab-sized output heads as N(0, embed_std^2); multiply every other
    matrix weight (projections, experts, routers; not convolutions) by ``gain``."""
    import mlx.core as mx
    import mlx.nn as nn

    for name, module in model.named_modules():
        # State-space / gated-delta layers: small time steps so the recurrent state remembers long enough
        # for the whole prompt to matter (mlx's init forgets within a couple of tokens).
        # Also slow decay rates A = exp(A_log) in [0.05, 0.2], and no D skip (it would otherwise dominate
        # the state's contribution).
        if isinstance(module.get("dt_bias"), mx.array):
            module.dt_bias = mx.full(module.dt_bias.shape, DT_BIAS)
        if name.endswith("dt_proj") and isinstance(module.get("bias"), mx.array):
            module.bias = mx.full(module.bias.shape, DT_BIAS)
        if isinstance(module.get("A_log"), mx.array):
            module.A_log = mx.log(mx.random.uniform(0.05, 0.2, module.A_log.shape))
        if isinstance(module.get("A_log"), mx.array) and isinstance(module.get("D"), mx.array):
            module.D = mx.zeros(module.D.shape)
        weight = module.get("weight") if isinstance(module.get("weight"), mx.array) else None
        if weight is None or weight.ndim < 2:
            continue
        if isinstance(module, nn.Embedding) or weight.shape[0] == vocab_size:
            module.weight = mx.random.normal(weight.shape) * embed_std
        elif gain != 1.0 and not isinstance(module, nn.Conv1d) and "conv" not in name.rsplit(".", 1)[-1]:
            module.weight = weight * gain


def _scale_final_norm(model, factor: float, one_plus: bool = False) -> None:
    """Multiply the final norm's effective weight by ``factor`` (the one norm outside the layer stack)."""
    import mlx.core as mx

    norms = [
        (name, m) for name, m in model.named_modules()
        if name and ".layers." not in name and "Norm" in type(m).__name__
        and isinstance(m.get("weight"), mx.array) and m.weight.ndim == 1
    ]
    if len(norms) != 1:
        raise AssertionError(f"expected one final norm, found {[n for n, _ in norms]}")
    m = norms[0][1]
    m.weight = factor * (1.0 + m.weight) - 1.0 if one_plus else m.weight * factor


def build(
    family: str,
    out_dir,
    tokenizer_dir,
    vocab_size: int,
    quantize_bits: int | None = None,
    seed: int = 0,
    *,
    group_size: int = 64,
    verify: bool = True,
    overrides: dict | None = None,
    quant_mode: str = "affine",
) -> Path:
    """Write a tiny random-weight ``family`` model to ``out_dir`` and return the directory.

    ``quantize_bits`` (e.g. 4): quantize as ``mlx_lm convert -q`` does (``mlx_lm.utils.quantize_model``,
    which honours the model's ``quant_predicate`` and skips layers whose input size is not a multiple of
    ``group_size``), recording ``quantization`` / ``quantization_config`` in config.json.
    ``verify``: load the weights back with ``mlx_lm.utils.load_model`` and assert every saved tensor
    arrives unchanged and nothing else is loaded.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes, quantize_model, save_config

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    src = Path(tokenizer_dir)
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, out / name)

    config = config_for(family, vocab_size)
    config.update(overrides or {})  # e.g. a longer sliding window for one test
    src_config = src / "config.json"
    if src_config.exists():  # special token ids of the tokenizer's own model, as a real checkpoint has
        src_cfg = json.loads(src_config.read_text())
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if src_cfg.get(key) is not None:
                config.setdefault(key, src_cfg[key])
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    init = {"embed_std": EMBED_STD, "gain": LINEAR_GAIN, "logit_gain": LOGIT_GAIN, **_INIT.get(family, {})}
    _init_weights(model, vocab_size, init["embed_std"], init["gain"])
    _scale_final_norm(model, init["logit_gain"], one_plus=family in _ONE_PLUS_NORM)
    mx.eval(model.parameters())

    if quantize_bits is not None:
        with redirect_stdout(io.StringIO()):  # quantize_model prints bits-per-weight
            model, config = quantize_model(model, config, group_size, quantize_bits, mode=quant_mode)

    weights = dict(tree_flatten(model.parameters()))
    for prefix in _DROP_MODULES.get(family, ()):
        weights = {k: v for k, v in weights.items() if not k.startswith(prefix + ".")}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    save_config(config, out / "config.json")

    if verify:
        _verify_roundtrip(out, weights)
    return out


def _verify_roundtrip(path: Path, saved: dict) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    model, _ = load_model(path)
    loaded = dict(tree_flatten(model.parameters()))
    if set(loaded) != set(saved):
        raise AssertionError(
            f"{path}: loaded parameters differ from saved: missing {sorted(set(saved) - set(loaded))[:5]}, "
            f"extra {sorted(set(loaded) - set(saved))[:5]}"
        )
    changed = [k for k, v in saved.items() if loaded[k].dtype != v.dtype or not mx.array_equal(loaded[k], v).item()]
    if changed:
        raise AssertionError(f"{path}: sanitize/load changed {len(changed)} tensors, e.g. {changed[:5]}")


def greedy_sampler(logprobs):
    import mlx.core as mx

    return mx.argmax(logprobs, axis=-1)


def reference_greedy(model, prompt_ids, max_tokens: int) -> list[int]:
    """mlx-lm's own greedy generation: ``generate_step`` with an argmax sampler and a fresh
    ``make_prompt_cache(model)`` (i.e. the model's own ``make_cache`` when it has one)."""
    return reference_greedy_with_margins(model, prompt_ids, max_tokens)[0]


def reference_greedy_with_margins(model, prompt_ids, max_tokens: int) -> tuple[list[int], list[float]]:
    """As :func:`reference_greedy`, also returning the top-1 minus top-2 logprob at every step."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    tokens, margins = [], []
    for token, logprobs in generate_step(
        mx.array(list(prompt_ids), dtype=mx.uint32), model, max_tokens=max_tokens, sampler=greedy_sampler,
        prompt_cache=cache,
    ):
        top2 = mx.topk(logprobs.astype(mx.float32), 2)
        margins.append(float(mx.max(top2) - mx.min(top2)))
        tokens.append(int(token))
    return tokens, margins


def mlx_batch_greedy(model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy generation of several prompts at once through mlx-lm's ``BatchGenerator`` (no stop tokens)."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, max_tokens=max_tokens, sampler=greedy_sampler)
    try:
        uids = gen.insert([list(p) for p in prompts], [max_tokens] * len(prompts))
        results: dict[int, list[int]] = {uid: [] for uid in uids}
        while responses := gen.next_generated():
            for r in responses:
                if r.finish_reason != "stop":
                    results[r.uid].append(int(r.token))
    finally:
        gen.close()
    return [results[uid] for uid in uids]


def cache_types(model) -> list:
    """``type(c).__name__`` per entry of the model's cache (a tuple of inner names for a CacheList)."""
    from mlx_lm.models.cache import CacheList, make_prompt_cache

    out = []
    for c in make_prompt_cache(model):
        if isinstance(c, CacheList):
            out.append(tuple(type(x).__name__ for x in c.caches))
        else:
            out.append(type(c).__name__)
    return out


def prompt_ids(n: int, vocab_size: int, seed: int = 0) -> list[int]:
    """``n`` deterministic pseudo-random token ids, avoiding the low (special-token) ids."""
    rng = random.Random(seed * 1000003 + n)
    return [rng.randrange(256, vocab_size) for _ in range(n)]


def default_tokenizer() -> tuple[Path, int]:
    """(directory with the default model's tokenizer files, its vocab size). ``PARALLM_TEST_TOKENIZER``: a
    directory holding them (tokenizer files + config.json) where the default GGUF is not installed (the GPU
    device check carries only these)."""
    import os

    import parallm_engine  # noqa: F401  (preloads BLAS before mlx)
    from parallm_engine.models.loader import resolve_model

    path = Path(os.environ["PARALLM_TEST_TOKENIZER"]) if os.environ.get("PARALLM_TEST_TOKENIZER") \
        else resolve_model(None)[0]
    config = json.loads((path / "config.json").read_text())
    return path, int(config["vocab_size"])


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def survey_family(family: str, root: Path, tokenizer_dir, vocab_size: int, quantize_bits=None,
                  max_tokens: int = 24) -> dict[str, Any]:
    """Build, load, and run one family; see the module docstring for the recorded fields."""
    import traceback

    from mlx_lm.utils import load

    rec: dict[str, Any] = {"family": family}
    try:
        path = build(family, root / family, tokenizer_dir, vocab_size, quantize_bits=quantize_bits)
        model, _tok = load(str(path))
    except Exception as e:  # noqa: BLE001
        rec["error"] = f"build/load: {type(e).__name__}: {e}"
        rec["traceback"] = traceback.format_exc(limit=4)
        return rec
    rec["model_type"] = getattr(getattr(model, "args", None), "model_type", None)
    rec["has_model_attr"] = hasattr(model, "model")
    rec["has_make_cache"] = hasattr(model, "make_cache")
    rec["caches"] = cache_types(model)
    if quantize_bits is not None:
        rec["quantized_modules"] = sum(1 for _, m in model.named_modules() if hasattr(m, "bits"))
    try:
        p40, p100 = prompt_ids(40, vocab_size), prompt_ids(100, vocab_size)
        t40, m40 = reference_greedy_with_margins(model, p40, max_tokens)
        t100, m100 = reference_greedy_with_margins(model, p100, max_tokens)
        again = reference_greedy(model, p100, max_tokens)
        rec["deterministic"] = again == t100
        rec["min_margin"] = round(min(m40 + m100), 4)
        rec["distinct_tokens"] = f"{len(set(t40))}/{len(set(t100))}"
        alt = reference_greedy(model, [p100[0] + 1] + p100[1:], max_tokens)
        rec["ctx"] = alt != t100
    except Exception as e:  # noqa: BLE001
        rec["error"] = f"generate: {type(e).__name__}: {e}"
        rec["traceback"] = traceback.format_exc(limit=4)
        return rec
    try:
        prompts = [p40, prompt_ids(23, vocab_size, seed=1), p100]
        want = [t40[:max_tokens], reference_greedy(model, prompts[1], max_tokens), t100]
        got = mlx_batch_greedy(model, prompts, max_tokens)
        rows = ["equal" if g == w else f"diff@{_first_diff(g, w)}" for g, w in zip(got, want)]
        rec["batch"] = "equal" if all(r == "equal" for r in rows) else "different (" + ", ".join(rows) + ")"
    except Exception as e:  # noqa: BLE001
        rec["batch"] = f"error: {type(e).__name__}: {str(e)[:120]}"  # e.g. a cache with no batched form
    return rec


def survey(families=None, quantize_bits=None, max_tokens: int = 24) -> dict[str, dict[str, Any]]:
    import tempfile

    tokenizer_dir, vocab_size = default_tokenizer()
    results = {}
    with tempfile.TemporaryDirectory(prefix="model-zoo-") as tmp:
        for family in families or FAMILIES:
            results[family] = survey_family(family, Path(tmp), tokenizer_dir, vocab_size, quantize_bits, max_tokens)
            shutil.rmtree(Path(tmp) / family, ignore_errors=True)
    return results


def format_table(results: dict[str, dict[str, Any]]) -> str:
    def caches(rec):
        cs = rec.get("caches")
        if cs is None:
            return "-"
        names = [("CacheList(" + ", ".join(c) + ")") if isinstance(c, tuple) else c for c in cs]
        return ", ".join(names) + ("" if rec.get("has_make_cache") else " (default)")

    lines = ["| family | model_type | model.model | caches (per layer) | margin | distinct | ctx | batch | error |",
             "|---|---|---|---|---|---|---|---|---|"]
    for fam, rec in results.items():
        lines.append(
            f"| {fam} | {rec.get('model_type', '-')} | {rec.get('has_model_attr', '-')} | {caches(rec)} | "
            f"{rec.get('min_margin', '-')} | {rec.get('distinct_tokens', '-')} | {rec.get('ctx', '-')} | "
            f"{rec.get('batch', '-')} | {rec.get('error', '')} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    import argparse
    import pprint

    ap = argparse.ArgumentParser()
    ap.add_argument("families", nargs="*")
    ap.add_argument("--quantize", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=24)
    ns = ap.parse_args()
    res = survey(ns.families or None, ns.quantize, ns.max_tokens)
    for r in res.values():
        if "traceback" in r:
            print(r["traceback"])
    print(format_table(res))
    pprint.pprint({k: {kk: vv for kk, vv in v.items() if kk != "traceback"} for k, v in res.items()}, width=140)
