"""Write a tiny HF/MLX model directory (tests/model_zoo.py) as the GGUF file llama.cpp's converter would make
of it, with the ``gguf`` package (ggml-org's gguf-py): tensor names from gguf-py's own ``TensorNameMap``,
the metadata keys ``convert_hf_to_gguf.py`` writes for the architecture, llama's Q/K row permutation,
Gemma's ``+1`` on norm weights, 1-D tensors in F32, matrices in the chosen ggml type.

Not a test file: a utility for tests/test_gguf_families.py.

``quantize_dir(hf_dir, qtype)`` first replaces the directory's matrices by what ``qtype`` stores
(quantize then dequantize with gguf-py), so the HF model and the GGUF hold the same weights; then
``write_gguf`` writes the stored blocks themselves. K-quant types, which gguf-py cannot quantize, get
random blocks with sane scales (``random_blocks``).
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import numpy as np

#: model_zoo family -> GGUF architecture (Mistral is ``llama`` in GGUF: LlamaModel converts it).
GGUF_ARCH = {
    "llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3",
    "phi3": "phi3",
}

_SPM_TEXT = [
    "The quick brown fox jumps over the lazy dog.", "Hello world, hello again!",
    "Numbers 12345 and 2024 and 3.14", "Tokenizers split words into pieces", "café naïve résumé",
    "the the the of and to in is it that was", "Paris is the capital of France.",
] * 40


#: ggml types the converted model keeps MLX-quantized (mx.load's three; Q4_K, Q5_0, Q5_1 re-packed by ParaLLM).
MX_QUANTIZED_NAMES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_0", "Q5_1")


def _load_hf(hf_dir: Path) -> tuple[dict, dict]:
    import mlx.core as mx

    config = json.loads((hf_dir / "config.json").read_text())
    weights = {k: np.array(v.astype(mx.float32)) for k, v in mx.load(str(hf_dir / "model.safetensors")).items()}
    return config, weights


def _is_matrix(name: str, arr) -> bool:
    return arr.ndim == 2 and name.endswith(".weight")


def random_blocks(qtype, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random bytes in ``qtype``'s block layout, with every fp16 scale set to a small sane value."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as Q

    block, nbytes = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(rows, cols // block, nbytes), dtype=np.uint8)
    scale = np.array([0.004], dtype=np.float16).view(np.uint8)
    # fp16 super-block scales: Q4_K / Q5_K start with d, dmin; Q6_K ends with d (gguf-py's dequantize layout).
    offsets = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (nbytes - 2,)}[qtype]
    for off in offsets:
        data[:, :, off:off + 2] = scale
    return data.reshape(rows, -1)


def _stored(arr: np.ndarray, qtype, seed: int) -> np.ndarray:
    """The bytes ``qtype`` stores for ``arr`` (rows x bytes)."""
    from gguf.constants import GGMLQuantizationType as Q
    from gguf.quants import quantize

    if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        return random_blocks(qtype, arr.shape[0], arr.shape[1], seed)
    return quantize(arr.astype(np.float32), qtype)


def quantize_dir(hf_dir: Path, qtype, embed_qtype=None) -> dict:
    """Replace the directory's matrices by the values ``qtype`` stores (the embedding by ``embed_qtype``'s);
    returns ``{hf name: (qtype, stored bytes)}`` for :func:`write_gguf`."""
    import mlx.core as mx
    from gguf.constants import GGMLQuantizationType as Q
    from gguf.quants import dequantize

    MX_QUANTIZED = {Q[n] for n in MX_QUANTIZED_NAMES}
    _, weights = _load_hf(hf_dir)
    blocks = {}
    for i, (name, arr) in enumerate(sorted(weights.items())):
        if not _is_matrix(name, arr):
            continue
        q = embed_qtype if (embed_qtype and "embed_tokens" in name) else qtype
        if q in (Q.BF16, Q.F16):  # float matrices: written by write_gguf in that type
            as_float = mx.bfloat16 if q == Q.BF16 else mx.float16
            weights[name] = np.array(mx.array(arr).astype(as_float).astype(mx.float32))
            blocks[name] = (q, None)
            continue
        stored = _stored(arr, q, seed=i)
        blocks[name] = (q, stored)
        weights[name] = dequantize(stored, q).astype(np.float32)
        if q not in MX_QUANTIZED:  # ParaLLM keeps these dequantized, in bfloat16 (gguf_reader)
            weights[name] = np.array(mx.array(weights[name]).astype(mx.bfloat16).astype(mx.float32))
    mx.save_safetensors(str(hf_dir / "model.safetensors"), {k: mx.array(v) for k, v in weights.items()},
                        metadata={"format": "mlx"})
    return blocks


def _permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.py ``LlamaModel.permute`` (rows of Q/K reordered for interleaved RoPE)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_params(writer, arch: str, cfg: dict, vocab_size: int) -> None:
    """The keys TextModel.set_gguf_parameters and the family's own set_gguf_parameters write."""
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_rope_freq_base(cfg["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if arch == "phi3":  # Phi3MiniModel: no key_length; rope dims = head_dim * partial_rotary_factor
        head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
        writer.add_rope_dimension_count(int(head_dim * cfg.get("partial_rotary_factor", 1.0)))
        return
    writer.add_key_length(cfg["head_dim"])
    writer.add_value_length(cfg["head_dim"])
    if arch == "llama":  # LlamaModel.set_gguf_parameters
        writer.add_vocab_size(vocab_size)
        writer.add_rope_dimension_count(cfg["head_dim"])
    if arch == "gemma3":
        writer.add_sliding_window(cfg["sliding_window"])  # the pattern is not written (llama.cpp: 6)


def spm_model(add_dummy_prefix: bool, vocab_size: int = 400) -> bytes:
    """A real SentencePiece BPE model (byte fallback, no normalisation, as Llama / Mistral / Gemma ship)."""
    import sentencepiece as spm

    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_SPM_TEXT), model_writer=out, vocab_size=vocab_size, model_type="bpe",
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=add_dummy_prefix, split_digits=True, hard_vocab_limit=False, minloglevel=2,
    )
    return out.getvalue()


def write_spm_vocab(writer, proto: bytes, arch: str) -> None:
    """What convert_hf_to_gguf's ``_set_vocab_sentencepiece`` writes for a tokenizer.model."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_proto=proto)
    tokens, scores, types = [], [], []
    for i in range(sp.vocab_size()):
        tokens.append(sp.id_to_piece(i).encode("utf-8"))
        scores.append(sp.get_score(i))
        types.append(2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 5 if sp.is_unused(i)
                     else 6 if sp.is_byte(i) else 1)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(sp.bos_id())
    writer.add_eos_token_id(sp.eos_id())
    writer.add_unk_token_id(sp.unk_id())
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    if arch == "gemma3":
        writer.add_add_space_prefix(False)


def write_bpe_vocab(writer, source_gguf: Path, pre: str) -> None:
    """A byte-level BPE vocabulary (the default model's: tokens, merges, types) under pre-tokenizer ``pre``."""
    from parallm_engine.models.gguf_reader import read_gguf_header

    meta, _ = read_gguf_header(source_gguf, want=lambda k: k.startswith("tokenizer."), arrays=True)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(meta["tokenizer.ggml.tokens"])
    writer.add_token_types(meta["tokenizer.ggml.token_type"])
    writer.add_token_merges(meta["tokenizer.ggml.merges"])
    writer.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(meta["tokenizer.chat_template"])


def write_gguf(hf_dir: Path, out: Path, arch: str, vocab, blocks: dict | None = None, float_type=None) -> Path:
    """Write ``hf_dir``'s model to ``out`` as llama.cpp's converter would for ``arch``. ``vocab(writer)``
    writes the tokenizer keys; ``blocks`` (from :func:`quantize_dir`) the stored matrices; other matrices
    in ``float_type`` (F32 default)."""
    import gguf
    from gguf.constants import GGMLQuantizationType as Q

    cfg, weights = _load_hf(hf_dir)
    blocks = blocks or {}
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name(hf_dir.name)
    _write_params(writer, arch, cfg, cfg["vocab_size"])
    vocab(writer)
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg["num_hidden_layers"])
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    for name, arr in weights.items():
        base, suffix = name.rsplit(".", 1)
        gname = tmap.get_name(base)
        assert gname is not None, f"gguf-py has no name for {base} in {arch}"
        qtype, stored = blocks.get(name, (None, None))
        data = stored if stored is not None else arr
        if arch == "llama" and gname.endswith((".attn_q", ".attn_k")):  # LlamaModel.modify_tensors
            data = _permute(data, n_head, n_head if gname.endswith(".attn_q") else n_kv)
        if arch == "gemma3" and name.endswith("norm.weight"):  # Gemma3Model.norm_shift
            data = data + 1.0
        kind = qtype or float_type or Q.F32
        if stored is not None:
            writer.add_tensor(f"{gname}.{suffix}", data, raw_dtype=qtype)
        elif arr.ndim == 1 or kind == Q.F32:  # llama.cpp keeps 1-D tensors in F32
            writer.add_tensor(f"{gname}.{suffix}", data.astype(np.float32))
        elif kind == Q.BF16:
            from gguf.quants import quantize

            writer.add_tensor(f"{gname}.{suffix}", quantize(data.astype(np.float32), Q.BF16), raw_dtype=Q.BF16)
        else:
            writer.add_tensor(f"{gname}.{suffix}", data.astype(np.float16))
    if arch == "llama" and (cfg.get("rope_scaling") or {}).get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_rope_freqs(cfg))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _llama3_rope_freqs(cfg: dict) -> np.ndarray:
    """convert_hf_to_gguf ``LlamaModel.generate_extra_tensors``: the llama3 rope_scaling as per-dimension factors."""
    scaling, dim, base = cfg["rope_scaling"], cfg["head_dim"], cfg["rope_theta"]
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)
