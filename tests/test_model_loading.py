"""The GGUF loader: logits of the loaded default model match a straightforward numpy reference built
from the raw GGUF tensors (dequantised by hand, llama.cpp's interleaved RoPE on its permuted Q/K rows,
which checks the un-permutation), the tokenizer round-trips, and the converted model is cached."""

from __future__ import annotations

import numpy as np
import pytest

from parallm_engine import ModelLoadError
from parallm_engine.models.gguf import converted_dir_for, ensure_converted
from parallm_engine.models.loader import default_model_path, resolve_model


def _unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    """MLX affine packing: little-endian fields of `bits` bits inside each uint32."""
    per = 32 // bits
    shifts = (np.arange(per, dtype=np.uint32) * bits)[None, None, :]
    vals = (packed[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    return vals.reshape(packed.shape[0], -1).astype(np.float32)


def _dequant(raw: dict, base: str) -> np.ndarray:
    w = np.array(raw[f"{base}.weight"])
    if f"{base}.scales" not in raw:
        return w.astype(np.float32)
    scales = np.array(raw[f"{base}.scales"]).astype(np.float32)
    biases = np.array(raw[f"{base}.biases"]).astype(np.float32)
    bits = w.shape[1] * 32 // (scales.shape[1] * 32)
    q = _unpack(w, bits)
    group = q.shape[1] // scales.shape[1]
    q = q.reshape(q.shape[0], scales.shape[1], group)
    return (q * scales[..., None] + biases[..., None]).reshape(q.shape[0], -1)


def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope_interleaved(x, theta):
    """llama.cpp's RoPE on GGUF-ordered rows: rotate adjacent pairs (2i, 2i+1). x: (heads, T, D)."""
    H, T, D = x.shape
    inv = theta ** (-np.arange(0, D, 2, dtype=np.float64) / D)
    ang = np.arange(T)[:, None] * inv[None, :]
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out


def _reference_logits(gguf_path, tokens: list[int]) -> np.ndarray:
    import mlx.core as mx

    raw, meta = mx.load(str(gguf_path), return_metadata=True)
    n_head = int(meta["llama.attention.head_count"].item())
    n_kv = int(meta["llama.attention.head_count_kv"].item())
    eps = float(meta["llama.attention.layer_norm_rms_epsilon"].item())
    theta = float(meta["llama.rope.freq_base"].item())
    n_layers = int(meta["llama.block_count"].item())
    emb = _dequant(raw, "token_embd")
    x = emb[tokens]
    T = len(tokens)
    D = x.shape[1] // n_head
    causal = np.triu(np.full((T, T), -np.inf, dtype=np.float32), 1)
    for i in range(n_layers):
        p = f"blk.{i}"
        h = _rms(x, np.array(raw[f"{p}.attn_norm.weight"]), eps)
        q = (h @ _dequant(raw, f"{p}.attn_q").T).reshape(T, n_head, D).transpose(1, 0, 2)
        k = (h @ _dequant(raw, f"{p}.attn_k").T).reshape(T, n_kv, D).transpose(1, 0, 2)
        v = (h @ _dequant(raw, f"{p}.attn_v").T).reshape(T, n_kv, D).transpose(1, 0, 2)
        q, k = _rope_interleaved(q, theta), _rope_interleaved(k, theta)
        rep = n_head // n_kv
        k, v = np.repeat(k, rep, axis=0), np.repeat(v, rep, axis=0)
        att = q @ k.transpose(0, 2, 1) / np.sqrt(D) + causal
        att = np.exp(att - att.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        o = (att @ v).transpose(1, 0, 2).reshape(T, -1)
        x = x + o @ _dequant(raw, f"{p}.attn_output").T
        h = _rms(x, np.array(raw[f"{p}.ffn_norm.weight"]), eps)
        g = h @ _dequant(raw, f"{p}.ffn_gate").T
        u = h @ _dequant(raw, f"{p}.ffn_up").T
        x = x + ((g / (1 + np.exp(-g))) * u) @ _dequant(raw, f"{p}.ffn_down").T
    x = _rms(x, np.array(raw["output_norm.weight"]), eps)
    head = _dequant(raw, "output") if "output.weight" in raw else emb
    return x[-1] @ head.T


def test_logits_match_dequantised_reference(engine):
    import mlx.core as mx

    tokens = engine.encode("The capital of France is Paris, and the capital of Italy is")
    ref = _reference_logits(default_model_path(), tokens)
    ours = np.array(engine.model(mx.array(tokens)[None])[0, -1].astype(mx.float32))
    assert ours.shape == ref.shape
    err = np.abs(ours - ref).max() / np.abs(ref).max()
    assert err < 2e-3, f"relative max error {err}"
    assert int(ours.argmax()) == int(ref.argmax())


def test_tokenizer_round_trip_and_digits(engine):
    text = "Hello 12345 world ünïcode 你好 😀 <|im_start|>"
    ids = engine.encode(text)
    assert engine.decode(ids) == text
    # Digits are split individually (llama.cpp's smollm pre-tokenizer).
    digits = engine.encode("2024", add_special_tokens=False)
    assert len(digits) == 4
    # Special tokens are single ids.
    assert len(engine.encode("<|im_start|>", add_special_tokens=False)) == 1


def test_chat_template_renders_chatml_and_tools(engine):
    text = engine.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    tool = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                             "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
    msgs = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    text = engine.apply_chat_template(msgs, tools=[tool], tokenize=False)
    assert "<tools>" in text and '"get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text


def test_conversion_is_cached(tmp_path):
    gguf = default_model_path()
    first = ensure_converted(gguf, cache_dir=tmp_path)
    assert first == converted_dir_for(gguf, tmp_path)
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    again = ensure_converted(gguf, cache_dir=tmp_path)
    assert again == first and (first / "model.safetensors").stat().st_mtime_ns == mtime
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (first / name).exists()


def test_resolve_model_paths(tmp_path, tiny_model_dir):
    path, name = resolve_model(None)
    assert (path / "config.json").exists() and name == "SmolLM2-135M-Instruct"
    assert resolve_model(str(tiny_model_dir))[0] == tiny_model_dir
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError):
        resolve_model(str(tmp_path / "empty"))
    with pytest.raises(ModelLoadError):
        resolve_model(str(tmp_path / "missing.gguf"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file")
    with pytest.raises(ModelLoadError):
        ensure_converted(bad, cache_dir=tmp_path)


def test_backend_reports_fast_path():
    from parallm_engine.runner.backend import backend_info

    info = backend_info()
    assert info.device in ("cpu", "gpu", "cuda")
    if info.device == "cpu":
        assert info.dtype == "float32"
